//! SentencePiece BPE (`tokenizer.ggml.model = "llama"`), as Gemma 3 uses it:
//! what the `sentencepiece` package's BPE model computes with an identity
//! normalizer, whitespace escaping and byte fallback.
//!
//! Encoding:
//!
//! 1. every `' '` becomes `'▁'` (U+2581); with `add_space_prefix`
//!    (SentencePiece's `add_dummy_prefix`) a `'▁'` is put before non-empty
//!    text. Nothing else is normalized, and nothing is split off: there is no
//!    pre-tokenizer, the whole text is one sequence whatever its length.
//! 2. user-defined pieces are matched in the escaped text from left to right,
//!    the longest one at each position. Each match is one token and a barrier
//!    that no merge crosses. (GGUF converters store these pieces with `' '`
//!    for `'▁'`; they are matched in their escaped form.)
//! 3. between matches every character starts as a symbol; the adjacent pair
//!    whose concatenation is a piece of the highest score is merged, the
//!    leftmost of equal candidates first, until no adjacent pair concatenates
//!    to a piece. Only normal, unused and user-defined pieces count (the ones
//!    SentencePiece keeps in its piece table; control, unknown and byte
//!    pieces are reserved ids that text never produces), and a user-defined
//!    piece cannot come out of a merge: step 2 would have matched it.
//! 4. a final symbol that is a piece is that piece's id; an unused piece is
//!    split back along the merge that formed it, as SentencePiece does. Any
//!    other symbol (a character outside the vocabulary) becomes the
//!    `<0xXX>` byte pieces of its UTF-8 encoding.
//!
//! Decoding maps `'▁'` back to `' '`, byte pieces to their byte, and control
//! and unknown pieces to nothing (SentencePiece's "invisible" symbols); with
//! `add_space_prefix` one leading space is dropped. So decoding inverts
//! encoding for every text without a literal `'▁'`; one in the input is
//! indistinguishable from an escaped space and decodes to `' '`, exactly as
//! in SentencePiece.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::{err, TokenizerError};

/// SentencePiece's whitespace symbol.
const SPACE: char = '\u{2581}';
/// No neighbour (list end).
const NONE: u32 = u32::MAX;

/// The kind of a SentencePiece piece (`ModelProto.SentencePiece.Type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PieceType {
    /// An ordinary piece, produced by merging.
    Normal,
    /// The unknown piece (never produced: unknown characters fall back to bytes).
    Unknown,
    /// A control piece such as `<bos>`: never produced from text.
    Control,
    /// A piece matched in the text before merging and kept whole.
    UserDefined,
    /// A piece that merges may pass through but that is never output.
    Unused,
    /// `<0xXX>`: one byte, for characters without a piece.
    Byte,
}

impl PieceType {
    /// From a GGUF `tokenizer.ggml.token_type` value (llama.cpp's
    /// `llama_token_type`, numbered as SentencePiece's types).
    pub fn from_gguf(t: i32) -> Option<Self> {
        Some(match t {
            1 => PieceType::Normal,
            2 => PieceType::Unknown,
            3 => PieceType::Control,
            4 => PieceType::UserDefined,
            5 => PieceType::Unused,
            6 => PieceType::Byte,
            _ => return None,
        })
    }
}

/// Options of a SentencePiece tokenizer beyond its pieces.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpmOptions {
    /// The BOS id a model expects before the text (`add_bos_token`), or
    /// `None`; reported by [`Tokenizer::bos`](super::Tokenizer::bos), never
    /// added by `encode`.
    pub bos: Option<u32>,
    /// Put a `'▁'` before non-empty text (`add_space_prefix`).
    pub add_space_prefix: bool,
}

/// Parse `<0xXX>`.
fn byte_piece(p: &str) -> Option<u8> {
    let hex = p.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Length of the UTF-8 sequence that starts with `lead`.
fn utf8_len(lead: u8) -> usize {
    match lead {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    }
}

/// A byte trie of the user-defined pieces (escaped), for longest matches.
#[derive(Debug, Clone)]
struct Trie {
    /// Node 0 is the root.
    nodes: Vec<TrieNode>,
    /// Whether some piece starts with this byte (skips the walk for most
    /// positions).
    starts: [bool; 256],
}

#[derive(Debug, Clone, Default)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    id: Option<u32>,
}

impl Trie {
    fn new() -> Self {
        Trie {
            nodes: vec![TrieNode::default()],
            starts: [false; 256],
        }
    }

    fn child(&self, node: usize, b: u8) -> Option<usize> {
        self.nodes[node]
            .children
            .iter()
            .find(|c| c.0 == b)
            .map(|c| c.1 as usize)
    }

    /// Insert a non-empty key; the first id given for a key stays.
    fn insert(&mut self, key: &[u8], id: u32) {
        let Some(&first) = key.first() else {
            return;
        };
        self.starts[first as usize] = true;
        let mut node = 0;
        for &b in key {
            node = match self.child(node, b) {
                Some(n) => n,
                None => {
                    let n = self.nodes.len();
                    self.nodes.push(TrieNode::default());
                    self.nodes[node].children.push((b, n as u32));
                    n
                }
            };
        }
        self.nodes[node].id.get_or_insert(id);
    }

    /// The longest key that `s` starts with: (byte length, id).
    fn longest(&self, s: &[u8]) -> Option<(usize, u32)> {
        if !s.first().is_some_and(|&b| self.starts[b as usize]) {
            return None;
        }
        let mut node = 0;
        let mut best = None;
        for (i, &b) in s.iter().enumerate() {
            match self.child(node, b) {
                Some(n) => node = n,
                None => break,
            }
            if let Some(id) = self.nodes[node].id {
                best = Some((i + 1, id));
            }
        }
        best
    }
}

/// A symbol of the run being merged: a byte range of the run and its
/// neighbours in the list of live symbols (`len == 0`: merged away).
#[derive(Debug, Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

/// A candidate merge of symbols `left` and `right`, `len` bytes long when
/// queued (a different length on pop means one side has changed since).
#[derive(Debug, Clone, Copy)]
struct Cand {
    score: f32,
    left: u32,
    right: u32,
    len: u32,
}

impl Ord for Cand {
    /// Higher score first, then the leftmost. Scores are never NaN and
    /// never -0.0 (see [`Spm::new`]), so `total_cmp` is the numeric order.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}

impl Eq for Cand {}

/// Scratch space reused across the runs of one `encode`.
#[derive(Debug, Default)]
struct Work {
    syms: Vec<Sym>,
    heap: BinaryHeap<Cand>,
    /// Unused piece id -> (start, left length) in the run of the last
    /// candidate pair that formed it: how it is split back.
    splits: HashMap<u32, (u32, u32)>,
}

/// A SentencePiece BPE tokenizer.
#[derive(Debug, Clone)]
pub(crate) struct Spm {
    /// Piece strings as given, indexed by id.
    pieces: Vec<String>,
    types: Vec<PieceType>,
    scores: Vec<f32>,
    /// Given piece string -> id (first wins).
    ids: HashMap<String, u32>,
    /// Normal, unused and (escaped) user-defined piece -> id: what merges
    /// may produce and what a final symbol is looked up in.
    mergeable: HashMap<String, u32>,
    /// Longest key of `mergeable`, in bytes.
    max_len: usize,
    user: Trie,
    byte_ids: [Option<u32>; 256],
    /// The bytes each id decodes to.
    decoded: Vec<Box<[u8]>>,
    has_unused: bool,
    add_space_prefix: bool,
}

impl Spm {
    pub(crate) fn new<S: AsRef<str>>(
        pieces: &[S],
        scores: &[f32],
        types: &[PieceType],
        add_space_prefix: bool,
    ) -> Result<Self, TokenizerError> {
        let n = pieces.len();
        if scores.len() != n || types.len() != n {
            return err(format!(
                "{n} pieces but {} scores and {} types",
                scores.len(),
                types.len()
            ));
        }
        if u32::try_from(n).is_err() {
            return err("vocabulary too large");
        }
        let mut spm = Spm {
            pieces: Vec::with_capacity(n),
            types: types.to_vec(),
            scores: Vec::with_capacity(n),
            ids: HashMap::with_capacity(n),
            mergeable: HashMap::with_capacity(n),
            max_len: 0,
            user: Trie::new(),
            byte_ids: [None; 256],
            decoded: Vec::with_capacity(n),
            has_unused: types.contains(&PieceType::Unused),
            add_space_prefix,
        };
        for (i, (p, (&score, &ty))) in pieces.iter().zip(scores.iter().zip(types)).enumerate() {
            let p = p.as_ref();
            let id = i as u32;
            if score.is_nan() {
                return err(format!("piece {id} ({p:?}) has a NaN score"));
            }
            // SentencePiece compares scores with `<`, for which -0.0 == 0.0.
            spm.scores.push(score + 0.0);
            spm.ids.entry(p.to_owned()).or_insert(id);
            let decoded: Box<[u8]> = match ty {
                PieceType::Byte => {
                    let Some(b) = byte_piece(p) else {
                        return err(format!("byte piece {id} is {p:?}, not <0xXX>"));
                    };
                    spm.byte_ids[b as usize].get_or_insert(id);
                    Box::new([b])
                }
                PieceType::Control | PieceType::Unknown => Box::new([]),
                PieceType::Normal | PieceType::Unused | PieceType::UserDefined => {
                    let key = if ty == PieceType::UserDefined {
                        if p.is_empty() {
                            return err(format!("user-defined piece {id} is empty"));
                        }
                        let key = p.replace(' ', "\u{2581}");
                        spm.user.insert(key.as_bytes(), id);
                        key
                    } else {
                        p.to_owned()
                    };
                    let decoded = key.replace(SPACE, " ").into_bytes().into_boxed_slice();
                    if !key.is_empty() {
                        spm.max_len = spm.max_len.max(key.len());
                        spm.mergeable.entry(key).or_insert(id);
                    }
                    decoded
                }
            };
            spm.decoded.push(decoded);
            spm.pieces.push(p.to_owned());
        }
        Ok(spm)
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub(crate) fn token(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub(crate) fn token_id(&self, s: &str) -> Option<u32> {
        self.ids.get(s).copied()
    }

    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut norm = String::with_capacity(text.len() + text.len() / 4 + 3);
        if self.add_space_prefix && !text.is_empty() {
            norm.push(SPACE);
        }
        let mut last = 0;
        for (i, _) in text.match_indices(' ') {
            norm.push_str(&text[last..i]);
            norm.push(SPACE);
            last = i + 1;
        }
        norm.push_str(&text[last..]);
        if u32::try_from(norm.len()).is_err() {
            return err("text longer than 4 GiB");
        }

        // Merges never involve a user-defined match, so the runs between
        // matches are independent: merging each on its own gives what one
        // queue over the whole text gives (its order restricted to a run is
        // the run's own order), with small queues that stay in cache.
        let mut out = Vec::with_capacity(norm.len() / 3);
        let mut work = Work::default();
        let bytes = norm.as_bytes();
        let (mut run, mut i) = (0, 0);
        while i < bytes.len() {
            if let Some((len, id)) = self.user.longest(&bytes[i..]) {
                self.encode_run(&norm[run..i], &mut work, &mut out)?;
                out.push(id);
                i += len;
                run = i;
            } else {
                i += utf8_len(bytes[i]);
            }
        }
        self.encode_run(&norm[run..], &mut work, &mut out)?;
        Ok(out)
    }

    /// Merge one run of escaped text (no user-defined piece inside) and
    /// append its ids.
    fn encode_run(
        &self,
        run: &str,
        work: &mut Work,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        work.syms.clear();
        work.heap.clear();
        work.splits.clear();
        if run.is_empty() {
            return Ok(());
        }
        if run.chars().nth(1).is_none() {
            return self.emit(run, run, &work.splits, out);
        }
        for (i, ch) in run.char_indices() {
            let k = work.syms.len() as u32;
            work.syms.push(Sym {
                start: i as u32,
                len: ch.len_utf8() as u32,
                prev: if k == 0 { NONE } else { k - 1 },
                next: k + 1,
            });
        }
        if let Some(s) = work.syms.last_mut() {
            s.next = NONE;
        }
        for k in 1..work.syms.len() as u32 {
            self.push_pair(run, work, k - 1, k);
        }
        while let Some(c) = work.heap.pop() {
            let (sl, sr) = (work.syms[c.left as usize], work.syms[c.right as usize]);
            if sl.len == 0 || sr.len == 0 || sl.next != c.right || sl.len + sr.len != c.len {
                continue;
            }
            let l = &mut work.syms[c.left as usize];
            l.len = c.len;
            l.next = sr.next;
            work.syms[c.right as usize].len = 0;
            if sr.next != NONE {
                work.syms[sr.next as usize].prev = c.left;
            }
            if sl.prev != NONE {
                self.push_pair(run, work, sl.prev, c.left);
            }
            if sr.next != NONE {
                self.push_pair(run, work, c.left, sr.next);
            }
        }
        let mut k = 0;
        while k != NONE {
            let s = work.syms[k as usize];
            let piece = &run[s.start as usize..(s.start + s.len) as usize];
            self.emit(piece, run, &work.splits, out)?;
            k = s.next;
        }
        Ok(())
    }

    /// Queue the merge of symbols `l` and `r` if their concatenation is a piece.
    fn push_pair(&self, run: &str, work: &mut Work, l: u32, r: u32) {
        let (a, b) = (work.syms[l as usize], work.syms[r as usize]);
        let len = a.len + b.len;
        if len as usize > self.max_len {
            return;
        }
        let piece = &run[a.start as usize..(a.start + len) as usize];
        let Some(&id) = self.mergeable.get(piece) else {
            return;
        };
        work.heap.push(Cand {
            score: self.scores[id as usize],
            left: l,
            right: r,
            len,
        });
        // Recorded when queued, not when merged, and the last one wins:
        // that is how SentencePiece splits an unused piece back.
        if self.has_unused && self.types[id as usize] == PieceType::Unused {
            work.splits.insert(id, (a.start, a.len));
        }
    }

    /// Append the ids of one final symbol.
    fn emit(
        &self,
        piece: &str,
        run: &str,
        splits: &HashMap<u32, (u32, u32)>,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        if let Some(&id) = self.mergeable.get(piece) {
            if self.types[id as usize] == PieceType::Unused {
                if let Some(&(start, left)) = splits.get(&id) {
                    let (start, mid) = (start as usize, (start + left) as usize);
                    let end = start + piece.len();
                    self.emit(&run[start..mid], run, splits, out)?;
                    return self.emit(&run[mid..end], run, splits, out);
                }
            }
            out.push(id);
            return Ok(());
        }
        // Not a piece (SentencePiece would also take a one-character control
        // or byte piece here; no real vocabulary has one, and bytes keep
        // decoding exact).
        for b in piece.bytes() {
            match self.byte_ids[b as usize] {
                Some(id) => out.push(id),
                None => {
                    return err(format!(
                        "{piece:?} is not in the vocabulary and byte 0x{b:02X} has no piece"
                    ))
                }
            }
        }
        Ok(())
    }

    pub(crate) fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.decoded.get(id as usize).map(|b| &b[..])
    }

    /// Undo the space prefix of the decoded bytes of a whole sequence.
    pub(crate) fn strip_prefix(&self, bytes: &mut Vec<u8>) {
        if self.add_space_prefix && bytes.first() == Some(&b' ') {
            bytes.remove(0);
        }
    }
}
