//! Tokenize (a prefix of) a corpus with the GGUF tokenizer and print the ids,
//! one per line; used by `scripts/check_tokenizer.py` to compare against the
//! Hugging Face `tokenizers` package.
//!
//! ```text
//! cargo run --release --example tokenize -- [--corpus austen|code|PATH] [--chars N] [--model PATH]
//! ```
//!
//! `--chars N` keeps the first `N` Unicode scalar values (default: all). With
//! `--check` it instead tokenizes the whole corpus, verifies that decoding
//! reproduces it exactly, and prints counts and timing.

#[path = "common/mod.rs"]
mod common;

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use common::gguf::Gguf;
use common::tokenizer::Tokenizer;

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut model = common::assets::path(common::assets::MODEL);
    let mut corpus = "austen".to_string();
    let mut chars: Option<usize> = None;
    let mut check = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--model" => model = it.next().ok_or("--model needs a value")?.into(),
            "--corpus" => corpus = it.next().ok_or("--corpus needs a value")?,
            "--chars" => chars = Some(it.next().ok_or("--chars needs a value")?.parse()?),
            "--check" => check = true,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let tok = Tokenizer::from_gguf(&Gguf::open(&model)?)?;
    let text = std::fs::read_to_string(common::assets::corpus(&corpus))?;
    let text = match chars {
        Some(n) => text
            .char_indices()
            .nth(n)
            .map_or(&text[..], |(i, _)| &text[..i]),
        None => &text[..],
    };
    let t0 = Instant::now();
    let ids = tok.encode(text)?;
    let secs = t0.elapsed().as_secs_f64();
    if check {
        let back = tok.decode(&ids)?;
        if back != text {
            return Err("decode(encode(text)) != text".into());
        }
        println!(
            "{corpus}: {} bytes -> {} tokens ({:.2} bytes/token), encode {secs:.2}s, round trip exact",
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

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
