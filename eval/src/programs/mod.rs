//! The examples' programs: one module per `cargo run --release --example X`,
//! each with its command line (`Args`, a `clap` parser: every program has
//! `--help`) and its body (`run`).
//!
//! * [`sweep`]: perplexity of SmolLM2-135M over a grid of kvq caches.
//! * [`ppl`]: perplexity with a full-precision cache.
//! * [`axes`]: which grouping axis suits keys and values (study B).
//! * [`capture`]: a `KVQCAP01` file of one window's Q/K/V.
//! * [`dump_logits`]: logits for `scripts/crosscheck.py`.
//! * [`tokenize`]: token ids for `scripts/check_tokenizer.py`.
//! * [`int8_error`]: the int8 kernels' extra error on synthetic data.
//! * `engine` (feature `engine`): the candle engine with candle's KV cache
//!   and with kvq's.

pub mod axes;
pub mod capture;
pub mod dump_logits;
#[cfg(feature = "engine")]
pub mod engine;
pub mod int8_error;
pub mod ppl;
pub mod sweep;
pub mod tokenize;

use std::path::PathBuf;

use crate::gguf::Gguf;
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::BoxError;

/// `--model smollm2|gemma|PATH` when given, else the fetched SmolLM2 in
/// the assets directory.
pub(crate) fn model_path(model: Option<PathBuf>) -> PathBuf {
    model.map_or_else(
        || crate::assets::path(crate::assets::MODEL),
        |m| crate::assets::model(&m),
    )
}

/// A GGUF file's tokenizer and model.
#[derive(Debug)]
pub struct Loaded {
    /// The tokenizer.
    pub tok: Tokenizer,
    /// The model.
    pub model: Model,
    /// The BOS id when the file asks for one (`tokenizer.ggml.add_bos_token`):
    /// each perplexity window then starts with it ([`crate::ppl::PplOptions::bos`]).
    pub bos: Option<u32>,
    /// The model's name: the published one for the fetched files, else
    /// `general.name`, else the file name.
    pub name: String,
}

/// The tokenizer and the model of a GGUF file.
pub fn load(path: &std::path::Path) -> Result<Loaded, BoxError> {
    let gguf = Gguf::open(path)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let model = Model::from_gguf(&gguf)?;
    let bos = tok.bos();
    if let Some(b) = bos {
        if b as usize >= model.cfg.vocab_size {
            return Err(format!("BOS id {b} outside the vocabulary").into());
        }
    }
    let file = path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    // SmolLM2's `general.name` is a training-run label; the fetched files
    // get their published names.
    let name = match file.as_str() {
        crate::assets::MODEL => "SmolLM2-135M-Instruct".to_owned(),
        crate::assets::GEMMA => "Gemma 3 270M".to_owned(),
        _ => gguf.get_str("general.name").map_or(file, str::to_owned),
    };
    Ok(Loaded {
        tok,
        model,
        bos,
        name,
    })
}

/// The first `n` tokens (or more) of a text, tokenizing only a prefix: the
/// pre-tokenizer is local, so the first tokens do not depend on the cut.
/// Returns fewer than `n` only when the whole text has fewer.
pub fn prefix_tokens(tok: &Tokenizer, text: &str, n: usize) -> Result<Vec<u32>, BoxError> {
    let mut cut = (n * 16).min(text.len());
    loop {
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let prefix = match text[..cut].rfind('\n') {
            Some(i) if cut < text.len() => &text[..i + 1],
            _ => &text[..cut],
        };
        let ids = tok.encode(prefix)?;
        if ids.len() > n + 64 || cut == text.len() {
            return Ok(ids);
        }
        cut = (cut * 2).min(text.len());
    }
}
