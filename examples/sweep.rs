//! The sweep: perplexity of SmolLM2-135M with kvq caches of many K/V schemes,
//! on prose (Jane Austen) and code (the Python standard library).
//!
//! ```text
//! cargo run --release --example sweep -- [--full] [--tokens N] [--window 512]
//!     [--domains austen,code] [--path prefill|decode] [--residual R] [--sinks S]
//!     [--out results] [--no-fetch] [--only SUBSTR,SUBSTR]
//! ```
//!
//! Fetches the assets with `scripts/fetch-assets.sh` when they are missing
//! (pip + apt, checked by sha256). For every domain and configuration it
//! runs the studies' protocol (non-overlapping 512-token windows, each from
//! an empty cache) and reports effective bits, compression against an f16
//! cache, perplexity, Δppl against the full-precision cache, and the mean
//! attention KL of the first window (exact vs quantized attention over the
//! real Q/K/V, via `kvq::metrics`). Writes `sweep.csv`, `sweep.json` and
//! `sweep.svg` (Δppl against effective bits, every point labelled, each
//! domain's Pareto front drawn) into `--out`.
//!
//! The default grid (17 configurations × 2 domains × 4096 tokens) takes
//! about 11 minutes on 2 cores once built; `--full` sweeps
//! bits 2–8 × axis × group.
//!
//! `--help` lists the flags. The program is
//! [`kvq_eval::programs::sweep`](kvq_eval::programs::sweep).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::sweep::run)
}
