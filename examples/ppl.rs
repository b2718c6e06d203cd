//! Perplexity of the reference model on a corpus, with a full-precision
//! (`DenseStore`) KV cache.
//!
//! ```text
//! cargo run --release --example ppl -- [--corpus austen|code|PATH] [--tokens 8192]
//!     [--window 512] [--path prefill|decode] [--model PATH] [--quiet]
//! ```
//!
//! Assets come from `scripts/fetch-assets.sh`. Prints perplexity over all
//! predictions of each window and over the second half only
//! (llama-perplexity convention), plus timings.
//!
//! `--help` lists the flags. The program is
//! [`kvq_eval::programs::ppl`](kvq_eval::programs::ppl).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::ppl::run)
}
