//! The candle engine with candle's KV cache and with kvq's, side by side
//! on SmolLM2: logits on the first window, then decode speed and cache
//! bytes at a 4096-token context.
//!
//! ```text
//! cargo run --release --example engine -- [--context 4096] [--decode 32]
//!     [--check 512] [--corpus austen|code|PATH] [--model PATH]
//! ```
//!
//! Assets come from `scripts/fetch-assets.sh`. `--help` lists the flags.
//! The program is [`kvq_eval::programs::engine`](kvq_eval::programs::engine);
//! the engine is [`kvq_eval::engine`](kvq_eval::engine).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::engine::run)
}
