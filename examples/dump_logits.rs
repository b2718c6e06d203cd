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

#[path = "common/mod.rs"]
mod common;

use std::io::Write;
use std::process::ExitCode;

use common::gguf::Gguf;
use common::model::{DenseStore, Hooks, Model};
use common::ppl::window_logits;
use common::tokenizer::Tokenizer;

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut model_path = common::assets::path(common::assets::MODEL);
    let mut corpus = "austen".to_string();
    let mut n: usize = 128;
    let mut out_path =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results/logits.bin");
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model_path = val()?.into(),
            "--corpus" => corpus = val()?,
            "--tokens" => n = val()?.parse()?,
            "--out" => out_path = val()?.into(),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let gguf = Gguf::open(&model_path)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let model = Model::from_gguf(&gguf)?;
    let text = std::fs::read_to_string(common::assets::corpus(&corpus))?;
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
