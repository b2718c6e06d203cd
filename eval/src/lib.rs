//! The real-model evaluation harness of `kvq`: the library behind the
//! top-level examples (`cargo run --release --example sweep`, `ppl`, `axes`,
//! `capture`, `dump_logits`, `tokenize`, `int8_error`) and the root's
//! `tests/eval_model.rs` and `tests/real_model.rs`.
//!
//! * [`gguf`]: GGUF reader and dequantization.
//! * [`tokenizer`]: byte-level BPE (SmolLM2) and SentencePiece BPE (Gemma 3).
//! * [`model`]: reference Llama-style transformer with a pluggable KV store.
//! * [`kvq_store`]: the model's KV store backed by `kvq::KvCache`.
//! * [`ppl`]: perplexity protocol (512-token windows from an empty cache).
//! * [`capture`]: per-layer Q/K/V dumps (`KVQCAP01`).
//! * `engine` (feature `engine`, on by default): a Llama forward pass in
//!   candle ops with candle's KV cache or kvq's, side by side.
//! * [`assets`]: locations of the files fetched by `scripts/fetch-assets.sh`.
//! * [`report`]: aligned tables, CSV/JSON files, the sweep's SVG plot and
//!   progress bars.
//! * [`programs`]: the examples' command lines (`clap`) and their bodies;
//!   each example is `fn main() { kvq_eval::program(programs::X::run) }`.

pub mod alloc;
pub mod assets;
pub mod capture;
#[cfg(feature = "engine")]
pub mod engine;
pub mod gguf;
pub mod klt;
pub mod kvq_store;
pub mod model;
pub mod ppl;
pub mod programs;
pub mod report;
pub mod tokenizer;
pub mod trellis;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The error type of the programs: anything printable.
pub type BoxError = Box<dyn std::error::Error>;

/// Let matrixmultiply use every available core unless `MATMUL_NUM_THREADS`
/// is set (its own default counts *physical* cores, which some VMs report as
/// one). Call at the start of `main`, before any other thread exists.
pub fn init_threads() {
    if std::env::var_os("MATMUL_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("MATMUL_NUM_THREADS", n.to_string());
    }
}

/// The repository root (the `kvq` package's directory, parent of `eval/`).
pub fn repo_root() -> PathBuf {
    let eval = Path::new(env!("CARGO_MANIFEST_DIR"));
    eval.parent().unwrap_or(eval).to_path_buf()
}

/// The `main` of every example: [`init_threads`], parse the command line
/// into `A` (`--help` and usage errors exit through `clap`, the latter with
/// status 2), run, and print an error with exit status 1.
pub fn program<A: clap::Parser>(run: fn(A) -> Result<(), BoxError>) -> ExitCode {
    init_threads();
    let args = A::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
