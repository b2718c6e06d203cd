//! Shared code of the real-model evaluation harness (examples and tests).
//!
//! Used by examples via `#[path = "common/mod.rs"] mod common;` and by
//! integration tests via `#[path = "../examples/common/mod.rs"] mod common;`.
//! Each user compiles its own copy, so items one of them does not use are
//! expected.
//!
//! * [`gguf`]: GGUF reader and dequantization.
//! * [`tokenizer`]: byte-level BPE (SmolLM2 / GPT-2 style).
//! * [`kvq_store`]: the model's KV store backed by `kvq::KvCache`.
//! * [`model`]: reference Llama-style transformer with a pluggable KV store.
//! * [`ppl`]: perplexity protocol (512-token windows from an empty cache).
//! * [`capture`]: per-layer Q/K/V dumps (`KVQCAP01`).
//! * [`assets`]: locations of the files fetched by `scripts/fetch-assets.sh`.
#![allow(dead_code)]

pub mod capture;
pub mod gguf;
pub mod kvq_store;
pub mod model;
pub mod ppl;
pub mod tokenizer;

/// Let matrixmultiply use every available core unless `MATMUL_NUM_THREADS`
/// is set (its own default counts *physical* cores, which some VMs report as
/// one). Call at the start of `main`, before any other thread exists.
pub fn init_threads() {
    if std::env::var_os("MATMUL_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("MATMUL_NUM_THREADS", n.to_string());
    }
}

/// Locations of the evaluation assets (see `scripts/fetch-assets.sh`).
pub mod assets {
    use std::path::PathBuf;

    /// File name of the model.
    pub const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
    /// File name of the prose corpus.
    pub const AUSTEN: &str = "austen.txt";
    /// File name of the code corpus.
    pub const CODE: &str = "python-stdlib.txt";

    /// The assets directory: `$KVQ_ASSETS` if set, else `<repo>/assets`.
    pub fn dir() -> PathBuf {
        std::env::var_os("KVQ_ASSETS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets"))
    }

    /// Path of an asset file.
    pub fn path(name: &str) -> PathBuf {
        dir().join(name)
    }

    /// Whether all three asset files exist.
    pub fn present() -> bool {
        [MODEL, AUSTEN, CODE].iter().all(|f| path(f).is_file())
    }

    /// Resolve a corpus name (`austen`, `code`) or a path to a file path.
    pub fn corpus(name: &str) -> PathBuf {
        match name {
            "austen" | "prose" => path(AUSTEN),
            "code" | "python" => path(CODE),
            other => PathBuf::from(other),
        }
    }
}
