//! The candle engine with candle's KV cache and with kvq's, side by side
//! on SmolLM2: logits on the first window, then decode speed and cache
//! bytes at a long context.
//!
//! ```text
//! cargo run --release --example engine -- [--context 4096] [--decode 32]
//!     [--check 512] [--corpus austen|code|PATH] [--model PATH]
//! ```
//!
//! 1. The first `--check` tokens of the corpus in one prefill, with
//!    candle's cache (f32), kvq's at full precision and the reference
//!    model (`kvq_eval::model`): the largest logit difference of each pair.
//! 2. For each cache: a `--context`-token prompt from the corpus in chunks
//!    of 512, then `--decode` greedy decode steps, each timed; the median
//!    step, tokens/s, the cache's bytes and how many greedy tokens match
//!    candle's f32 cache.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::DType;
use clap::Parser;

use crate::engine::{argmax, last_row, max_abs_diff, Caches, CandleLlama};
use crate::model::{DenseStore, Hooks};
use crate::BoxError;

/// The candle engine with candle's KV cache and with kvq's: logits on
/// the first window, decode speed and cache bytes at a long context.
#[derive(Debug, Clone, Parser)]
#[command(name = "engine")]
pub struct Args {
    /// Prompt tokens before the timed decode steps.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub context: usize,
    /// Timed greedy decode steps after the prompt.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub decode: usize,
    /// Tokens of the logits check (one prefill each way; 0 skips it).
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub check: usize,
    /// Corpus: austen, code, or a path.
    #[arg(long, value_name = "austen|code|PATH", default_value = "austen")]
    pub corpus: String,
    /// GGUF model (Llama architecture): SmolLM2 by default.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// The caches to run, by key (default: all): candle-f32, candle-f16,
    /// kvq-f32, kvq-kivi4, kvq-kivi4-r128s4.
    #[arg(long, value_name = "KEY,...", value_delimiter = ',')]
    pub caches: Vec<String>,
}

/// Builds one cache kind for a model.
type MakeCaches = Box<dyn Fn(&crate::model::Config) -> Result<Caches, BoxError>>;

/// One cache kind of the comparison.
struct Kind {
    key: &'static str,
    label: &'static str,
    make: MakeCaches,
}

fn kinds() -> Vec<Kind> {
    let (k4, v4) = kvq::presets::kivi(4).expect("a preset");
    vec![
        Kind {
            key: "candle-f32",
            label: "candle KvCache, f32",
            make: Box::new(|c| Ok(Caches::candle(c, DType::F32))),
        },
        Kind {
            key: "candle-f16",
            label: "candle KvCache, f16",
            make: Box::new(|c| Ok(Caches::candle(c, DType::F16))),
        },
        Kind {
            key: "kvq-f32",
            label: "kvq, full precision",
            make: Box::new(|c| Ok(Caches::kvq(c, |x| x)?)),
        },
        Kind {
            key: "kvq-kivi4",
            label: "kvq KIVI-4 (K per-channel / V per-token, groups of 32)",
            make: Box::new(move |c| Ok(Caches::kvq(c, |x| x.keys(k4).values(v4))?)),
        },
        Kind {
            key: "kvq-kivi4-r128s4",
            label: "kvq KIVI-4, residual 128, 4 sinks",
            make: Box::new(move |c| {
                Ok(Caches::kvq(c, |x| {
                    x.keys(k4).values(v4).residual(128).sinks(4)
                })?)
            }),
        },
    ]
}

/// Run the program.
pub fn run(args: Args) -> Result<(), BoxError> {
    let super::Loaded {
        tok,
        model,
        bos,
        name,
        ..
    } = super::load(&super::model_path(args.model))?;
    let mut e = CandleLlama::from_model(&model)?;
    let cfg = model.cfg.clone();
    let text = std::fs::read_to_string(crate::assets::corpus(&args.corpus))?;
    let need = args.context.max(args.check) + 1;
    let ids = super::prefix_tokens(&tok, &text, need)?;
    let ids = crate::ppl::with_bos(&ids, bos).into_owned();
    if ids.len() < need {
        return Err(format!("the corpus gives {} tokens, {need} needed", ids.len()).into());
    }
    println!(
        "{name}: {} layers, {} query / {} KV heads of {}; {} threads",
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    if args.check > 0 {
        let w = &ids[..args.check];
        let t = Instant::now();
        let candle = e.forward(w, 0, &mut Caches::candle(&cfg, DType::F32))?;
        let kv = e.forward(w, 0, &mut Caches::kvq(&cfg, |x| x)?)?;
        let mut store = DenseStore::for_config(&cfg);
        let h = model.forward(w, 0, &mut store, &mut Hooks::default())?;
        let reference = model.logits(h.view());
        let reference = candle_core::Tensor::from_slice(
            reference.as_slice().ok_or("logits not contiguous")?,
            reference.dim(),
            &candle_core::Device::Cpu,
        )?;
        let top = candle.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        println!(
            "logits of the first {} tokens (largest |logit| {top:.2}): candle f32 vs kvq full \
             precision {:.2e}, candle vs the reference model {:.2e}, kvq vs the reference {:.2e} \
             ({:.1} s)",
            args.check,
            max_abs_diff(&candle, &kv)?,
            max_abs_diff(&candle, &reference)?,
            max_abs_diff(&kv, &reference)?,
            t.elapsed().as_secs_f64()
        );
    }

    println!(
        "\n{} prompt tokens ({}), then {} greedy decode steps:\n",
        args.context, args.corpus, args.decode
    );
    println!("| cache | cache MiB | prefill s | decode ms/token (median) | tokens/s | greedy tokens as candle f32 |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut first: Option<Vec<u32>> = None;
    let all = kinds();
    if let Some(bad) = args
        .caches
        .iter()
        .find(|c| !all.iter().any(|k| k.key == c.as_str()))
    {
        let keys: Vec<_> = all.iter().map(|k| k.key).collect();
        return Err(format!("unknown cache {bad}; one of {}", keys.join(", ")).into());
    }
    for k in all
        .into_iter()
        .filter(|k| args.caches.is_empty() || args.caches.iter().any(|c| c == k.key))
    {
        let mut caches = (k.make)(&cfg)?;
        let t = Instant::now();
        let mut logits = None;
        for p in (0..args.context).step_by(512) {
            let end = (p + 512).min(args.context);
            logits = Some(e.forward_last(&ids[p..end], p, &mut caches)?);
        }
        let prefill = t.elapsed().as_secs_f64();
        let mut next = argmax(&last_row(&logits.ok_or("empty prompt")?)?);
        let (mut steps, mut greedy) = (Vec::new(), Vec::new());
        for i in 0..args.decode {
            greedy.push(next);
            let t = Instant::now();
            let l = e.forward_last(&[next], args.context + i, &mut caches)?;
            next = argmax(&last_row(&l)?);
            steps.push(t.elapsed().as_secs_f64() * 1e3);
        }
        steps.sort_by(f64::total_cmp);
        let med = steps.get(steps.len() / 2).copied().unwrap_or(f64::NAN);
        let same = match &first {
            None => {
                first = Some(greedy.clone());
                greedy.len()
            }
            Some(f) => f.iter().zip(&greedy).take_while(|(a, b)| a == b).count(),
        };
        println!(
            "| {} | {:.1} | {prefill:.2} | {med:.2} | {:.1} | {same}/{} |",
            k.label,
            caches.bytes() as f64 / (1 << 20) as f64,
            1e3 / med,
            greedy.len()
        );
    }
    Ok(())
}
