//! Byte-level BPE (GPT-2 style), as used by SmolLM2 (`tokenizer.ggml.model =
//! "gpt2"`, `tokenizer.ggml.pre = "smollm"`): the Hugging Face pipeline
//! `Digits(individual_digits) -> ByteLevel(add_prefix_space = false) -> BPE`.
//!
//! 1. every numeric character (`\p{N}`) becomes its own pre-token;
//! 2. the remaining runs are split with [`GPT2_PATTERN`];
//! 3. each pre-token's UTF-8 bytes are mapped to the printable "byte-level"
//!    alphabet (`Ġ` for space, ...) and merged with the ranked BPE merges.

use std::collections::HashMap;

use fancy_regex::Regex;

use super::{err, TokenizerError};

/// The GPT-2 pre-tokenizer pattern.
pub const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// GPT-2's reversible map from bytes to printable characters.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut next = 256u32;
    for b in 0..256u32 {
        let cp = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        table[b as usize] = char::from_u32(cp).expect("valid code point");
    }
    table
}

/// A byte-level BPE tokenizer.
#[derive(Debug, Clone)]
pub(crate) struct Bpe {
    /// Token strings in byte-level alphabet, indexed by id.
    tokens: Vec<String>,
    /// Decoded bytes of each token.
    token_bytes: Vec<Vec<u8>>,
    /// Byte-level string -> id.
    ids: HashMap<String, u32>,
    /// (left id, right id) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Id of the single-byte token for each byte (some byte-level vocabularies
    /// lack bytes that never occur in UTF-8 text, e.g. 0xC0, or in training
    /// data, e.g. most control characters).
    byte_ids: [Option<u32>; 256],
    pre: Regex,
}

impl Bpe {
    /// Build from byte-level token strings (id = index) and merges written as
    /// `"left right"`, highest priority first.
    pub(crate) fn new<S: AsRef<str>, M: AsRef<str>>(
        tokens: impl IntoIterator<Item = S>,
        merges: impl IntoIterator<Item = M>,
    ) -> Result<Self, TokenizerError> {
        let b2c = byte_to_char_table();
        let c2b: HashMap<char, u8> = b2c.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();

        let tokens: Vec<String> = tokens.into_iter().map(|s| s.as_ref().to_owned()).collect();
        if u32::try_from(tokens.len()).is_err() {
            return err("vocabulary too large");
        }
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut token_bytes = Vec::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            // Later duplicates do not override earlier ids (matches HF behaviour).
            ids.entry(t.clone()).or_insert(i as u32);
            // Tokens outside the byte alphabet (e.g. special tokens made of
            // other characters) decode to their UTF-8 text.
            let bytes = t
                .chars()
                .flat_map(|ch| match c2b.get(&ch) {
                    Some(&b) => vec![b],
                    None => ch.to_string().into_bytes(),
                })
                .collect();
            token_bytes.push(bytes);
        }

        let mut byte_ids = [None; 256];
        for (b, &ch) in b2c.iter().enumerate() {
            byte_ids[b] = ids.get(ch.to_string().as_str()).copied();
        }

        let mut merge_map = HashMap::new();
        for (rank, m) in merges.into_iter().enumerate() {
            let m = m.as_ref();
            let Some((l, r)) = m.split_once(' ') else {
                return err(format!("malformed merge {m:?}"));
            };
            let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) else {
                return err(format!("merge {m:?} uses unknown tokens"));
            };
            let Some(&merged) = ids.get(&format!("{l}{r}")) else {
                return err(format!("merge {m:?} produces an unknown token"));
            };
            merge_map.entry((li, ri)).or_insert((rank as u32, merged));
        }

        let pre = Regex::new(GPT2_PATTERN).map_err(|e| TokenizerError(e.to_string()))?;
        Ok(Bpe {
            tokens,
            token_bytes,
            ids,
            merges: merge_map,
            byte_ids,
            pre,
        })
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub(crate) fn token_id(&self, s: &str) -> Option<u32> {
        self.ids.get(s).copied()
    }

    pub(crate) fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// Split `text` into pre-tokens (sub-slices of `text`, in order, covering it).
    pub(crate) fn pre_tokenize<'t>(&self, text: &'t str) -> Result<Vec<&'t str>, TokenizerError> {
        let mut out = Vec::new();
        let mut run_start = 0;
        for (i, ch) in text.char_indices() {
            if ch.is_numeric() {
                self.split_regex(&text[run_start..i], &mut out)?;
                out.push(&text[i..i + ch.len_utf8()]);
                run_start = i + ch.len_utf8();
            }
        }
        self.split_regex(&text[run_start..], &mut out)?;
        Ok(out)
    }

    fn split_regex<'t>(&self, s: &'t str, out: &mut Vec<&'t str>) -> Result<(), TokenizerError> {
        let mut last = 0;
        for m in self.pre.find_iter(s) {
            let m = m.map_err(|e| TokenizerError(e.to_string()))?;
            // The pattern matches every character class, so there are no gaps;
            // keep any (impossible) gap anyway so that decoding stays exact.
            if m.start() > last {
                out.push(&s[last..m.start()]);
            }
            out.push(m.as_str());
            last = m.end();
        }
        if last < s.len() {
            out.push(&s[last..]);
        }
        Ok(())
    }

    /// BPE-merge one pre-token's bytes into ids, appending to `out`.
    ///
    /// Fails if a byte has no token: encoding must stay exactly invertible.
    fn bpe(&self, piece: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut syms = Vec::with_capacity(piece.len());
        for b in piece.bytes() {
            match self.byte_ids[b as usize] {
                Some(id) => syms.push(id),
                None => return err(format!("byte 0x{b:02x} (in {piece:?}) has no token")),
            }
        }
        loop {
            // Leftmost occurrence of the best-ranked mergeable pair.
            let best = syms
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| self.merges.get(&(w[0], w[1])).map(|&(r, m)| (r, i, m)))
                .min_by_key(|&(r, i, _)| (r, i));
            match best {
                Some((_, i, merged)) => {
                    syms[i] = merged;
                    syms.remove(i + 1);
                }
                None => break,
            }
        }
        out.extend_from_slice(&syms);
        Ok(())
    }

    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut cache: HashMap<&str, (usize, usize)> = HashMap::new();
        for piece in self.pre_tokenize(text)? {
            if let Some(&(start, len)) = cache.get(piece) {
                out.extend_from_within(start..start + len);
                continue;
            }
            let start = out.len();
            self.bpe(piece, &mut out)?;
            cache.insert(piece, (start, out.len() - start));
        }
        Ok(out)
    }
}
