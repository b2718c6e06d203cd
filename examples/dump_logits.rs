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
//!
//! `--help` lists the flags. The program is
//! [`kvq_eval::programs::dump_logits`](kvq_eval::programs::dump_logits).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::dump_logits::run)
}
