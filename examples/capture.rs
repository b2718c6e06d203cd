//! Capture per-layer Q/K/V of one window of a corpus to a `KVQCAP01` file
//! (format: `docs/CAPTURE.md`), for offline study of quantization error where
//! the cache is used.
//!
//! ```text
//! cargo run --release --example capture -- [--corpus austen|code|PATH] [--tokens 512]
//!     [--window-index 0] [--model PATH] [--out results/capture-<corpus>-w<index>.kvqcap]
//! ```
//!
//! `--help` lists the flags. The program is
//! [`kvq_eval::programs::capture`](kvq_eval::programs::capture).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::capture::run)
}
