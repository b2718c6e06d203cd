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

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;

use crate::model::{DenseStore, Hooks};
use crate::ppl::{perplexity, EvalPath};
use crate::BoxError;

/// Perplexity of the reference model on a corpus, with a full-precision KV
/// cache.
///
/// Assets come from scripts/fetch-assets.sh. Prints perplexity over all
/// predictions of each window and over the second half only
/// (llama-perplexity convention), plus timings.
#[derive(Debug, Clone, Parser)]
#[command(name = "ppl")]
pub struct Args {
    /// Corpus: austen, code, or a path.
    #[arg(long, value_name = "austen|code|PATH", default_value = "austen")]
    pub corpus: String,
    /// Tokens from the start of the corpus to evaluate.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub tokens: usize,
    /// Tokens per window; each window starts from an empty cache.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub window: usize,
    /// Feed each window as one block (prefill) or token by token (decode).
    #[arg(long, value_name = "prefill|decode", default_value = "prefill")]
    pub path: EvalPath,
    /// GGUF model: smollm2 (the default), gemma (both fetched into assets/), or a path.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// No per-window lines on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// Run the program.
pub fn run(args: Args) -> Result<(), BoxError> {
    let model_path = super::model_path(args.model);
    let t0 = Instant::now();
    let super::Loaded {
        tok, model, bos, ..
    } = super::load(&model_path)?;
    let opts = crate::ppl::PplOptions {
        n_tokens: args.tokens,
        window: args.window,
        path: args.path,
        bos,
    };
    let load_s = t0.elapsed().as_secs_f64();

    let corpus_path = crate::assets::corpus(&args.corpus);
    let text = std::fs::read_to_string(&corpus_path)?;
    let t1 = Instant::now();
    let tokens = tok.encode(&text)?;
    let tok_s = t1.elapsed().as_secs_f64();

    let cfg = &model.cfg;
    println!(
        "model {} ({} layers, d={}, heads {}/{}, head_dim {}), corpus {} ({} of {} tokens used)",
        model_path.display(),
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        corpus_path.display(),
        opts.n_tokens,
        tokens.len()
    );
    println!(
        "load {load_s:.2}s, tokenize {tok_s:.2}s; path {:?}, window {}",
        opts.path, opts.window
    );

    let mut store = DenseStore::for_config(cfg);
    let t2 = Instant::now();
    let quiet = args.quiet;
    let report = perplexity(
        &model,
        &tokens,
        &mut store,
        &mut Hooks::default(),
        &opts,
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
        opts.n_tokens as f64 / eval_s
    );
    Ok(())
}
