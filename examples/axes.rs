//! Study B on real K/V: which grouping axis suits keys and values, judged by
//! reconstruction error *and* by error where the cache is used.
//!
//! ```text
//! cargo run --release --example axes -- [--domains austen,code] [--bits 2,3,4]
//! ```
//!
//! Captures the full-precision Q/K/V of SmolLM2-135M on the first 512-token
//! window of each corpus, then quantizes only the keys (values exact) or only
//! the values (keys exact) per-token vs per-channel (groups of 32 channels
//! or 32 tokens, f16 scale and zero), and reports, averaged over all 30
//! layers and 9 query heads with a causal mask: relative reconstruction
//! error, attention KL, and relative error of the attention output.
//!
//! `--help` lists the flags. The program is
//! [`kvq_eval::programs::axes`](kvq_eval::programs::axes).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::axes::run)
}
