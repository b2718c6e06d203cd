//! Tokenize (a prefix of) a corpus with the GGUF tokenizer and print the ids,
//! one per line; used by `scripts/check_tokenizer.py` to compare against the
//! Hugging Face `tokenizers` package (SmolLM2) and `sentencepiece` (Gemma 3,
//! `--model assets/gemma-3-270m-q4_k_m.gguf`).
//!
//! ```text
//! cargo run --release --example tokenize -- [--corpus austen|code|PATH] [--chars N] [--model PATH] [--check]
//! ```
//!
//! `--chars N` keeps the first `N` Unicode scalar values (default: all). With
//! `--check` it instead tokenizes the whole corpus, verifies that decoding
//! reproduces it exactly, and prints counts and timing.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;

use crate::gguf::Gguf;
use crate::tokenizer::Tokenizer;
use crate::BoxError;

/// Tokenize (a prefix of) a corpus with the GGUF tokenizer and print the
/// ids, one per line (for scripts/check_tokenizer.py).
#[derive(Debug, Clone, Parser)]
#[command(name = "tokenize")]
pub struct Args {
    /// Corpus: austen, code, or a path.
    #[arg(long, value_name = "austen|code|PATH", default_value = "austen")]
    pub corpus: String,
    /// Keep the first N Unicode scalar values (default: all).
    #[arg(long, value_name = "N")]
    pub chars: Option<usize>,
    /// GGUF model (default: the fetched SmolLM2-135M in assets/).
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Instead of the ids: verify that decoding reproduces the text exactly,
    /// and print counts and timing.
    #[arg(long)]
    pub check: bool,
}

/// Run the program.
pub fn run(args: Args) -> Result<(), BoxError> {
    let tok = Tokenizer::from_gguf(&Gguf::open(super::model_path(args.model))?)?;
    let text = std::fs::read_to_string(crate::assets::corpus(&args.corpus))?;
    let text = match args.chars {
        Some(n) => text
            .char_indices()
            .nth(n)
            .map_or(&text[..], |(i, _)| &text[..i]),
        None => &text[..],
    };
    let t0 = Instant::now();
    let ids = tok.encode(text)?;
    let secs = t0.elapsed().as_secs_f64();
    if args.check {
        let back = tok.decode(&ids)?;
        if back != text {
            return Err("decode(encode(text)) != text".into());
        }
        println!(
            "{}: {} bytes -> {} tokens ({:.2} bytes/token), encode {secs:.2}s, round trip exact",
            args.corpus,
            text.len(),
            ids.len(),
            text.len() as f64 / ids.len() as f64
        );
        return Ok(());
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for id in ids {
        writeln!(out, "{id}")?;
    }
    Ok(())
}
