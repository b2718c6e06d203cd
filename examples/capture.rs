//! Capture per-layer Q/K/V of one window of a corpus to a `KVQCAP01` file
//! (format: `docs/CAPTURE.md`), for offline study of quantization error where
//! the cache is used.
//!
//! ```text
//! cargo run --release --example capture -- [--corpus austen|code|PATH] [--tokens 512]
//!     [--window-index 0] [--model PATH] [--out results/capture-<corpus>.kvqcap]
//! ```

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;

use common::capture::{Capture, Recorder};
use common::gguf::Gguf;
use common::model::{DenseStore, Hooks, Model};
use common::ppl::window_logits;
use common::tokenizer::Tokenizer;

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut model_path = common::assets::path(common::assets::MODEL);
    let mut corpus = "austen".to_string();
    let mut n: usize = 512;
    let mut index: usize = 0;
    let mut out: Option<std::path::PathBuf> = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model_path = val()?.into(),
            "--corpus" => corpus = val()?,
            "--tokens" => n = val()?.parse()?,
            "--window-index" => index = val()?.parse()?,
            "--out" => out = Some(val()?.into()),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let out = out.unwrap_or_else(|| {
        let stem = std::path::Path::new(&corpus)
            .file_stem()
            .map_or("corpus".into(), |s| s.to_string_lossy().into_owned());
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(format!("results/capture-{stem}-w{index}.kvqcap"))
    });
    let gguf = Gguf::open(&model_path)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let model = Model::from_gguf(&gguf)?;
    drop(gguf);
    let ids = tok.encode(&std::fs::read_to_string(common::assets::corpus(&corpus))?)?;
    let window = ids
        .get(index * n..(index + 1) * n)
        .ok_or_else(|| format!("corpus has no window {index} of {n} tokens"))?;
    let c = &model.cfg;
    let mut rec = Recorder::new(c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, window);
    let mut store = DenseStore::for_config(c);
    {
        let mut hooks = Hooks {
            observer: Some(&mut rec),
            ..Hooks::default()
        };
        window_logits(&model, window, &mut store, &mut hooks)?;
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    rec.capture.save(&out)?;
    // Read it back as a self-check.
    let back = Capture::load(&out)?;
    if back != rec.capture {
        return Err("capture did not read back identically".into());
    }
    println!(
        "wrote {} ({} layers x {} tokens, {} q heads, {} kv heads, head_dim {}, pre-RoPE K: {})",
        out.display(),
        back.layers.len(),
        back.n_tokens(),
        back.n_q_heads,
        back.n_kv_heads,
        back.head_dim,
        back.has_k_pre_rope()
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
