//! Capture per-layer Q/K/V of one window of a corpus to a `KVQCAP01` file
//! (format: `docs/CAPTURE.md`), for offline study of quantization error where
//! the cache is used.
//!
//! ```text
//! cargo run --release --example capture -- [--corpus austen|code|PATH] [--tokens 512]
//!     [--window-index 0] [--model PATH] [--out results/capture-<corpus>-w<index>.kvqcap]
//! ```

use std::path::{Path, PathBuf};

use clap::Parser;

use crate::capture::{Capture, Recorder};
use crate::model::{DenseStore, Hooks};
use crate::ppl::window_logits;
use crate::BoxError;

/// Capture per-layer Q/K/V of one window of a corpus to a KVQCAP01 file
/// (format: docs/CAPTURE.md), for offline study of quantization error where
/// the cache is used. Reads the file back as a self-check.
#[derive(Debug, Clone, Parser)]
#[command(name = "capture")]
pub struct Args {
    /// Corpus: austen, code, or a path.
    #[arg(long, value_name = "austen|code|PATH", default_value = "austen")]
    pub corpus: String,
    /// Tokens in the window.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub tokens: usize,
    /// Which window of `--tokens` tokens (0: the first).
    #[arg(long, value_name = "I", default_value_t = 0)]
    pub window_index: usize,
    /// GGUF model: smollm2 (the default), gemma (both fetched into assets/), or a path.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Output file (default: `<repo>/results/capture-<corpus>-w<index>.kvqcap`).
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
}

/// Run the program.
pub fn run(args: Args) -> Result<(), BoxError> {
    let (n, index) = (args.tokens, args.window_index);
    let out = args.out.unwrap_or_else(|| {
        let stem = Path::new(&args.corpus)
            .file_stem()
            .map_or("corpus".into(), |s| s.to_string_lossy().into_owned());
        crate::repo_root().join(format!("results/capture-{stem}-w{index}.kvqcap"))
    });
    let super::Loaded {
        tok, model, bos, ..
    } = super::load(&super::model_path(args.model))?;
    let ids = tok.encode(&std::fs::read_to_string(crate::assets::corpus(
        &args.corpus,
    ))?)?;
    let window = ids
        .get(index * n..(index + 1) * n)
        .ok_or_else(|| format!("corpus has no window {index} of {n} tokens"))?;
    let window = &*crate::ppl::with_bos(window, bos);
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
