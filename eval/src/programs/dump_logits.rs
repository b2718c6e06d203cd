//! Dump the logits of the first tokens of a corpus, for the independent numpy
//! cross-check in `scripts/crosscheck.py`.
//!
//! ```text
//! cargo run --release --example dump_logits -- [--corpus austen|code|PATH] [--tokens 128]
//!     [--model PATH] [--out results/logits.bin]
//! ```
//!
//! Output format (little-endian): magic `KVQLOG01`, `u32 n_tokens`,
//! `u32 vocab`, `u32 token ids[n_tokens]`, `f32 logits[n_tokens][vocab]`.
//! Logits come from one prefill of the window from an empty `DenseStore`.

use std::io::Write;
use std::path::PathBuf;

use clap::Parser;

use crate::model::{DenseStore, Hooks};
use crate::ppl::window_logits;
use crate::BoxError;

/// Dump the logits of the first tokens of a corpus, for the numpy
/// cross-check in scripts/crosscheck.py.
///
/// Output (little-endian): magic `KVQLOG01`, `u32 n_tokens`, `u32 vocab`,
/// `u32 token_ids[n_tokens]`, `f32 logits[n_tokens][vocab]`, from one
/// prefill of the window from an empty full-precision cache.
#[derive(Debug, Clone, Parser)]
#[command(name = "dump_logits")]
pub struct Args {
    /// Corpus: austen, code, or a path.
    #[arg(long, value_name = "austen|code|PATH", default_value = "austen")]
    pub corpus: String,
    /// Tokens from the start of the corpus.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub tokens: usize,
    /// GGUF model: smollm2 (the default), gemma (both fetched into assets/), or a path.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Output file (default: `<repo>/results/logits.bin`).
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
}

/// Run the program.
pub fn run(args: Args) -> Result<(), BoxError> {
    let n = args.tokens;
    let out_path = args
        .out
        .unwrap_or_else(|| crate::repo_root().join("results/logits.bin"));
    let super::Loaded {
        tok, model, bos, ..
    } = super::load(&super::model_path(args.model))?;
    let text = std::fs::read_to_string(crate::assets::corpus(&args.corpus))?;
    // A generous prefix is plenty for `n` tokens (>= 1 byte per token).
    let mut cut = (n * 16).min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut tokens = tok.encode(&text[..cut])?;
    if tokens.len() <= n {
        return Err(format!("corpus too short for {n} tokens").into());
    }
    // Drop the last few, which may depend on where the prefix was cut.
    tokens.truncate(n);
    let tokens = crate::ppl::with_bos(&tokens, bos).into_owned();
    let mut store = DenseStore::for_config(&model.cfg);
    let logits = window_logits(&model, &tokens, &mut store, &mut Hooks::default())?;
    if let Some(dir) = out_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut w = std::io::BufWriter::new(std::fs::File::create(&out_path)?);
    w.write_all(b"KVQLOG01")?;
    w.write_all(&(n as u32).to_le_bytes())?;
    w.write_all(&(model.cfg.vocab_size as u32).to_le_bytes())?;
    for t in &tokens {
        w.write_all(&t.to_le_bytes())?;
    }
    for x in &logits {
        w.write_all(&x.to_le_bytes())?;
    }
    w.flush()?;
    println!(
        "wrote {} ({n} tokens x {} logits)",
        out_path.display(),
        model.cfg.vocab_size
    );
    Ok(())
}
