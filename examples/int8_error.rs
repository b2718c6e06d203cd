//! The extra error of the opt-in int8 kernels at the point of use: one
//! attention head (scores → softmax → weighted sum) over a packed KIVI
//! cache (keys per-channel, values per-token, groups of 32), exact kernels
//! against `scores_i8` (int8 query) and `scores_i8` + `weighted_sum_i8`
//! (int8 query and int8 weights). For scale, the same against a dense f32
//! cache shows what the 4-bit quantization itself costs.
//!
//! ```text
//! cargo run --release --example int8_error
//! ```
//!
//! Synthetic data (no download): keys uniform in [−1, 1] with three outlier
//! channels ×8 (like real keys), values uniform in [−1, 1]; the logits are
//! scaled by `sharp/√head_dim`, so `sharp` sets how peaked attention is.
//! On a CPU without AVX-512 VNNI the int8 calls run the exact kernels and
//! the int8 rows read zero.
//!
//! `--help` lists the flags. The program is
//! [`kvq_eval::programs::int8_error`](kvq_eval::programs::int8_error).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::int8_error::run)
}
