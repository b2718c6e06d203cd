//! The tokenizers of the evaluated models, built from a GGUF vocabulary.
//!
//! [`Tokenizer::from_gguf`] picks the algorithm from `tokenizer.ggml.model`:
//!
//! * `"gpt2"`: byte-level BPE (GPT-2 style) with SmolLM2's pre-tokenizer
//!   (`tokenizer.ggml.pre = "smollm"`), see [`bpe`];
//! * `"llama"`: SentencePiece BPE with byte fallback (Gemma 3), see [`spm`].
//!
//! Either way special tokens in the input text are *not* recognised (text
//! is always plain text), `encode` adds no BOS/EOS ([`Tokenizer::bos`] says
//! which BOS the model expects), and [`Tokenizer::decode`] inverts
//! [`Tokenizer::encode`] exactly, except that SentencePiece decodes a literal
//! `'▁'` (U+2581) in the input as a space, as the `sentencepiece` package does.

use std::fmt;

use crate::gguf::{Gguf, GgufError};

pub mod bpe;
pub mod spm;

pub use bpe::GPT2_PATTERN;
pub use spm::{PieceType, SpmOptions};

/// Tokenizer construction, encoding or decoding failure.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerError(pub String);

impl fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tokenizer: {}", self.0)
    }
}

impl std::error::Error for TokenizerError {}

impl From<GgufError> for TokenizerError {
    fn from(e: GgufError) -> Self {
        TokenizerError(e.to_string())
    }
}

fn err<T>(msg: impl Into<String>) -> Result<T, TokenizerError> {
    Err(TokenizerError(msg.into()))
}

/// Boxed: each model holds kilobytes of inline tables.
#[derive(Debug, Clone)]
enum Model {
    Bpe(Box<bpe::Bpe>),
    Spm(Box<spm::Spm>),
}

/// A byte-level BPE or SentencePiece tokenizer.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    model: Model,
    bos: Option<u32>,
}

/// An optional GGUF key: `None` when absent, an error when of the wrong type.
fn optional<'g, T>(
    g: &'g Gguf,
    key: &str,
    get: impl Fn(&'g Gguf, &str) -> Result<T, GgufError>,
) -> Result<Option<T>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(_) => Ok(Some(get(g, key)?)),
    }
}

/// The BOS id if `tokenizer.ggml.add_bos_token` (default `add_bos`) is set.
fn gguf_bos(g: &Gguf, add_bos: bool, n_vocab: usize) -> Result<Option<u32>, TokenizerError> {
    if !optional(g, "tokenizer.ggml.add_bos_token", Gguf::get_bool)?.unwrap_or(add_bos) {
        return Ok(None);
    }
    let bos = g.get_usize("tokenizer.ggml.bos_token_id")?;
    if bos >= n_vocab {
        return err(format!("bos_token_id {bos} outside the vocabulary"));
    }
    Ok(Some(bos as u32))
}

impl Tokenizer {
    /// Build from a GGUF file's `tokenizer.ggml.*` keys.
    ///
    /// `"gpt2"` models need `tokens` and `merges`, and the pre-tokenizer
    /// (`pre`, if present) must be `smollm`. `"llama"` models need `tokens`
    /// and take `scores` (default 0), `token_type` (default normal),
    /// `add_space_prefix` (default true) and `add_bos_token` (default true,
    /// with `bos_token_id`); `pre`, if present, must be `default`. The
    /// defaults are llama.cpp's.
    pub fn from_gguf(g: &Gguf) -> Result<Self, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let pre = optional(g, "tokenizer.ggml.pre", Gguf::get_str)?;
        match model {
            "gpt2" => Self::bpe_from_gguf(g, pre),
            "llama" => Self::spm_from_gguf(g, pre),
            _ => err(format!("unsupported tokenizer model {model:?}")),
        }
    }

    fn bpe_from_gguf(g: &Gguf, pre: Option<&str>) -> Result<Self, TokenizerError> {
        if let Some(pre) = pre.filter(|&p| p != "smollm") {
            return err(format!("unsupported pre-tokenizer {pre:?}"));
        }
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let merges = g.get_str_array("tokenizer.ggml.merges")?;
        let mut tok = Self::new(&tokens, merges)?;
        tok.bos = gguf_bos(g, false, tokens.len())?;
        Ok(tok)
    }

    fn spm_from_gguf(g: &Gguf, pre: Option<&str>) -> Result<Self, TokenizerError> {
        if let Some(pre) = pre.filter(|&p| p != "default") {
            return err(format!(
                "unsupported pre-tokenizer {pre:?} for an SPM model"
            ));
        }
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        let scores = optional(g, "tokenizer.ggml.scores", Gguf::get_f32_array)?
            .unwrap_or_else(|| vec![0.0; n]);
        let types = match optional(g, "tokenizer.ggml.token_type", Gguf::get_i32_array)? {
            None => vec![PieceType::Normal; n],
            Some(types) => types
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    PieceType::from_gguf(t)
                        .ok_or_else(|| TokenizerError(format!("token {i} has unknown type {t}")))
                })
                .collect::<Result<_, _>>()?,
        };
        let add_space_prefix =
            optional(g, "tokenizer.ggml.add_space_prefix", Gguf::get_bool)?.unwrap_or(true);
        let options = SpmOptions {
            bos: gguf_bos(g, true, n)?,
            add_space_prefix,
        };
        Self::spm(&tokens, &scores, &types, options)
    }

    /// A byte-level BPE from byte-level token strings (id = index) and merges
    /// written as `"left right"`, highest priority first.
    pub fn new<S: AsRef<str>, M: AsRef<str>>(
        tokens: impl IntoIterator<Item = S>,
        merges: impl IntoIterator<Item = M>,
    ) -> Result<Self, TokenizerError> {
        Ok(Tokenizer {
            model: Model::Bpe(Box::new(bpe::Bpe::new(tokens, merges)?)),
            bos: None,
        })
    }

    /// A SentencePiece BPE from its pieces (id = index), their scores and
    /// types. User-defined pieces may be written with `' '` or `'▁'`.
    ///
    /// Fails if the three lengths differ, a score is NaN, a byte piece is not
    /// `<0xXX>`, a user-defined piece is empty or the BOS id is out of range.
    pub fn spm<S: AsRef<str>>(
        pieces: &[S],
        scores: &[f32],
        types: &[PieceType],
        options: SpmOptions,
    ) -> Result<Self, TokenizerError> {
        if let Some(bos) = options.bos.filter(|&b| b as usize >= pieces.len()) {
            return err(format!("BOS id {bos} outside the vocabulary"));
        }
        Ok(Tokenizer {
            model: Model::Spm(Box::new(spm::Spm::new(
                pieces,
                scores,
                types,
                options.add_space_prefix,
            )?)),
            bos: options.bos,
        })
    }

    /// The BOS id the model expects before the text (`add_bos_token`), if
    /// any. [`Tokenizer::encode`] never adds it.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match &self.model {
            Model::Bpe(m) => m.vocab_size(),
            Model::Spm(m) => m.vocab_size(),
        }
    }

    /// The string of a token as the vocabulary stores it (byte-level
    /// alphabet for BPE, `'▁'` for spaces for SentencePiece).
    pub fn token(&self, id: u32) -> Option<&str> {
        match &self.model {
            Model::Bpe(m) => m.token(id),
            Model::Spm(m) => m.token(id),
        }
    }

    /// The id of a token string as the vocabulary stores it.
    pub fn token_id(&self, s: &str) -> Option<u32> {
        match &self.model {
            Model::Bpe(m) => m.token_id(s),
            Model::Spm(m) => m.token_id(s),
        }
    }

    /// Split `text` into pre-tokens (sub-slices of `text`, in order, covering
    /// it). SentencePiece has no pre-tokenizer: the whole text is one.
    pub fn pre_tokenize<'t>(&self, text: &'t str) -> Result<Vec<&'t str>, TokenizerError> {
        match &self.model {
            Model::Bpe(m) => m.pre_tokenize(text),
            Model::Spm(_) if text.is_empty() => Ok(Vec::new()),
            Model::Spm(_) => Ok(vec![text]),
        }
    }

    /// Encode text to token ids (no BOS/EOS, no special-token parsing).
    ///
    /// Fails if a byte needed to encode the text has no token: encoding must
    /// stay exactly invertible.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.model {
            Model::Bpe(m) => m.encode(text),
            Model::Spm(m) => m.encode(text),
        }
    }

    /// The bytes a sequence of ids stands for.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        for &id in ids {
            let bytes = match &self.model {
                Model::Bpe(m) => m.token_bytes(id),
                Model::Spm(m) => m.token_bytes(id),
            };
            match bytes {
                Some(b) => out.extend_from_slice(b),
                None => return err(format!("token id {id} out of range")),
            }
        }
        if let Model::Spm(m) = &self.model {
            m.strip_prefix(&mut out);
        }
        Ok(out)
    }

    /// Decode ids to text; fails if the bytes are not valid UTF-8 (e.g. a
    /// sequence cut inside a multi-byte character).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        String::from_utf8(self.decode_bytes(ids)?)
            .map_err(|e| TokenizerError(format!("decoded bytes are not UTF-8: {e}")))
    }
}
