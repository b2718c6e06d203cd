//! Study B on real K/V: which grouping axis suits keys and values, judged by
//! reconstruction error *and* by error where the cache is used.
//!
//! ```text
//! cargo run --release --example axes -- [--domains austen,code] [--bits 2,3,4]
//! ```
//!
//! Captures the full-precision Q/K/V of SmolLM2-135M on the first 512-token
//! window of each corpus, then quantizes only the keys (values exact) or only
//! the values (keys exact) per-token vs per-channel (groups of 32 channels
//! or 32 tokens, f16 scale and zero), and reports, averaged over all 30
//! layers and 9 query heads with a causal mask: relative reconstruction
//! error, attention KL, and relative error of the attention output.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;

use common::capture::Recorder;
use common::gguf::Gguf;
use common::kvq_store::{CacheSpec, KvqStore};
use common::model::{Hooks, Model};
use common::ppl::{window_nll, EvalPath};
use common::tokenizer::Tokenizer;
use kvq::metrics::{layer_errors, AttnShape, ErrorSummary, MetricsConfig};
use kvq::{Axis, Group, KvQuantizer, QuantScheme, UniformQuantizer};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut domains = vec!["austen".to_string(), "code".to_string()];
    let mut bits: Vec<u8> = vec![2, 3, 4];
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--domains" => domains = val.split(',').map(str::to_string).collect(),
            "--bits" => bits = val.split(',').map(str::parse).collect::<Result<_, _>>()?,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let g = Gguf::open(common::assets::path(common::assets::MODEL))?;
    let tok = Tokenizer::from_gguf(&g)?;
    let model = Model::from_gguf(&g)?;
    drop(g);
    let c = model.cfg.clone();
    let (nl, nq, nkv, hd) = (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim);
    let shape = AttnShape::new(nq, nkv, hd)?;
    let mcfg = MetricsConfig::new().with_causal(0);
    println!(
        "{:<7} {:<6} {:>4} {:<11} {:>10} {:>10} {:>10}",
        "domain", "tensor", "bits", "axis", "recon rel", "attn KL", "output rel"
    );
    for d in &domains {
        let text = std::fs::read_to_string(common::assets::corpus(d))?;
        let cut = text
            .char_indices()
            .nth(16 * 512)
            .map_or(text.len(), |(i, _)| i);
        let ids = tok.encode(&text[..cut])?;
        let first = &ids[..512];
        let mut rec = Recorder::new(nl, nq, nkv, hd, first);
        let mut store = KvqStore::new(nl, nkv, hd, CacheSpec::FULL)?;
        let mut hooks = Hooks {
            observer: Some(&mut rec),
            ..Hooks::default()
        };
        window_nll(&model, first, &mut store, &mut hooks, EvalPath::Prefill)?;
        let cap = rec.capture;
        for tensor in ["keys", "values"] {
            for &b in &bits {
                for axis in [Axis::PerToken, Axis::PerChannel] {
                    let q = UniformQuantizer::new(
                        QuantScheme::new(b, axis, Group::Size(32))?,
                        nkv,
                        hd,
                    )?;
                    let mut layers = Vec::new();
                    for l in &cap.layers {
                        let t = l.k.len() / (nkv * hd);
                        let (kh, vh) = if tensor == "keys" {
                            (q.roundtrip(&l.k, t)?, l.v.clone())
                        } else {
                            (l.k.clone(), q.roundtrip(&l.v, t)?)
                        };
                        layers.push(
                            layer_errors(shape, l.q.as_slice(), &l.k, &l.v, &kh, &vh, &mcfg)?
                                .summary,
                        );
                    }
                    let m = ErrorSummary::combine(&layers).mean;
                    let recon = if tensor == "keys" { m.k_rel } else { m.v_rel };
                    let name = if axis == Axis::PerToken {
                        "per-token"
                    } else {
                        "per-channel"
                    };
                    println!(
                        "{d:<7} {tensor:<6} {b:>4} {name:<11} {recon:>10.4} {:>10.2e} {:>10.4}",
                        m.kl, m.output_rel
                    );
                }
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    common::init_threads();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
