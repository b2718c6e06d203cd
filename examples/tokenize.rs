//! Tokenize (a prefix of) a corpus with the GGUF tokenizer and print the ids,
//! one per line; used by `scripts/check_tokenizer.py` to compare against the
//! Hugging Face `tokenizers` package (SmolLM2) and `sentencepiece` (Gemma 3,
//! `--model assets/gemma-3-270m-q4_k_m.gguf`).
//!
//! ```text
//! cargo run --release --example tokenize -- [--corpus austen|code|PATH] [--chars N] [--model PATH] [--check]
//! ```
//!
//! `--chars N` keeps the first `N` Unicode scalar values (default: all). With
//! `--check` it instead tokenizes the whole corpus, verifies that decoding
//! reproduces it exactly, and prints counts and timing.
//!
//! `--help` lists the flags. The program is
//! [`kvq_eval::programs::tokenize`](kvq_eval::programs::tokenize).

fn main() -> std::process::ExitCode {
    kvq_eval::program(kvq_eval::programs::tokenize::run)
}
