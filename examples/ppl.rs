//! Perplexity of the reference model on a corpus, with a full-precision
//! (`DenseStore`) KV cache.
//!
//! ```text
//! cargo run --release --example ppl -- [--corpus austen|code|PATH] [--tokens 8192]
//!     [--window 512] [--path prefill|decode] [--model PATH] [--quiet]
//! ```
//!
//! Assets come from `scripts/fetch-assets.sh`. Prints perplexity over all
//! predictions of each window and over the second half only
//! (llama-perplexity convention), plus timings.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;
use std::time::Instant;

use common::gguf::Gguf;
use common::model::{DenseStore, Hooks, Model};
use common::ppl::{perplexity, EvalPath, PplOptions};
use common::tokenizer::Tokenizer;

struct Args {
    model: std::path::PathBuf,
    corpus: String,
    opts: PplOptions,
    quiet: bool,
}

const USAGE: &str = "usage: ppl [--corpus austen|code|PATH] [--tokens N] [--window N] \
[--path prefill|decode] [--model PATH] [--quiet]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: common::assets::path(common::assets::MODEL),
        corpus: "austen".into(),
        opts: PplOptions::default(),
        quiet: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = val()?.into(),
            "--corpus" => a.corpus = val()?,
            "--tokens" => a.opts.n_tokens = val()?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--window" => a.opts.window = val()?.parse().map_err(|e| format!("--window: {e}"))?,
            "--path" => a.opts.path = val()?.parse::<EvalPath>()?,
            "--quiet" => a.quiet = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(a)
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let gguf = Gguf::open(&args.model)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let model = Model::from_gguf(&gguf)?;
    drop(gguf);
    let load_s = t0.elapsed().as_secs_f64();

    let corpus_path = common::assets::corpus(&args.corpus);
    let text = std::fs::read_to_string(&corpus_path)?;
    let t1 = Instant::now();
    let tokens = tok.encode(&text)?;
    let tok_s = t1.elapsed().as_secs_f64();

    let cfg = &model.cfg;
    println!(
        "model {} ({} layers, d={}, heads {}/{}, head_dim {}), corpus {} ({} of {} tokens used)",
        args.model.display(),
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        corpus_path.display(),
        args.opts.n_tokens,
        tokens.len()
    );
    println!(
        "load {load_s:.2}s, tokenize {tok_s:.2}s; path {:?}, window {}",
        args.opts.path, args.opts.window
    );

    let mut store = DenseStore::for_config(cfg);
    let t2 = Instant::now();
    let quiet = args.quiet;
    let report = perplexity(
        &model,
        &tokens,
        &mut store,
        &mut Hooks::default(),
        &args.opts,
        |w, r| {
            if !quiet {
                eprintln!(
                    "window {w:3}: ppl {:8.4} (second half {:8.4})  {:.2}s",
                    r.all.ppl(),
                    r.second_half.ppl(),
                    r.seconds
                );
            }
        },
    )?;
    let eval_s = t2.elapsed().as_secs_f64();
    println!(
        "ppl (all {} predictions): {:.4}   mean NLL {:.5}",
        report.all.count,
        report.all.ppl(),
        report.all.mean()
    );
    println!(
        "ppl (second half, {} predictions): {:.4}   mean NLL {:.5}",
        report.second_half.count,
        report.second_half.ppl(),
        report.second_half.mean()
    );
    println!(
        "eval {eval_s:.1}s ({:.0} tokens/s)",
        args.opts.n_tokens as f64 / eval_s
    );
    Ok(())
}

fn main() -> ExitCode {
    common::init_threads();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
