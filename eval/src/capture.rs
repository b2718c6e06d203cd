//! Capture of per-layer Q/K/V activations to a simple binary file.
//!
//! The format (`KVQCAP01`, documented in `docs/CAPTURE.md`) is, all
//! little-endian:
//!
//! ```text
//! magic      8 bytes  "KVQCAP01"
//! version    u32      1
//! n_layers   u32
//! n_tokens   u32      t
//! n_q_heads  u32
//! n_kv_heads u32
//! head_dim   u32      hd
//! flags      u32      bit 0: pre-RoPE keys present
//! pos0       u32      position of the first captured token
//! tokens     u32 x t  token ids
//! per layer:
//!   Q        f32 x t*n_q_heads*hd    post-RoPE queries, row-major [t, n_q*hd]
//!   K        f32 x t*n_kv_heads*hd   post-RoPE keys (what a cache stores)
//!   V        f32 x t*n_kv_heads*hd   values
//!   K_pre    f32 x t*n_kv_heads*hd   keys before RoPE (after k_norm), if flags bit 0
//! ```

use std::fmt;
use std::io::{self, Read, Write};
use std::path::Path;

use crate::model::{LayerActivations, Observer};

/// File magic.
pub const MAGIC: &[u8; 8] = b"KVQCAP01";
/// Format version written by this module.
pub const VERSION: u32 = 1;
/// Flag: the file holds pre-RoPE keys.
pub const FLAG_K_PRE_ROPE: u32 = 1;

/// Activations of one layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerCapture {
    /// Post-RoPE queries `[t, n_q*hd]`.
    pub q: Vec<f32>,
    /// Post-RoPE keys `[t, n_kv*hd]`.
    pub k: Vec<f32>,
    /// Values `[t, n_kv*hd]`.
    pub v: Vec<f32>,
    /// Pre-RoPE keys `[t, n_kv*hd]` (empty if not captured).
    pub k_pre_rope: Vec<f32>,
}

/// A capture of one window: shapes, token ids and per-layer activations.
#[derive(Debug, Clone, PartialEq)]
pub struct Capture {
    /// Number of query heads.
    pub n_q_heads: usize,
    /// Number of key/value heads.
    pub n_kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Position of the first token.
    pub pos0: usize,
    /// Token ids of the captured window.
    pub tokens: Vec<u32>,
    /// One entry per layer.
    pub layers: Vec<LayerCapture>,
}

/// A capture file that is malformed.
#[derive(Debug)]
pub enum CaptureError {
    /// Underlying I/O failure (including unexpected end of file).
    Io(io::Error),
    /// Bad magic, version or inconsistent sizes.
    Format(String),
}

impl fmt::Display for CaptureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaptureError::Io(e) => write!(f, "capture i/o: {e}"),
            CaptureError::Format(m) => write!(f, "capture format: {m}"),
        }
    }
}

impl std::error::Error for CaptureError {}

impl From<io::Error> for CaptureError {
    fn from(e: io::Error) -> Self {
        CaptureError::Io(e)
    }
}

/// An [`Observer`] that records the activations of every layer.
#[derive(Debug)]
pub struct Recorder {
    /// The capture being filled.
    pub capture: Capture,
}

impl Recorder {
    /// A recorder for a model shape and the window's tokens.
    pub fn new(
        n_layers: usize,
        n_q_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        tokens: &[u32],
    ) -> Self {
        Recorder {
            capture: Capture {
                n_q_heads,
                n_kv_heads,
                head_dim,
                pos0: 0,
                tokens: tokens.to_vec(),
                layers: vec![LayerCapture::default(); n_layers],
            },
        }
    }
}

impl Observer for Recorder {
    fn layer(&mut self, layer: usize, act: &LayerActivations<'_>) {
        if let Some(lc) = self.capture.layers.get_mut(layer) {
            if lc.q.is_empty() {
                self.capture.pos0 = act.pos0;
            }
            lc.q.extend_from_slice(act.q);
            lc.k.extend_from_slice(act.k);
            lc.v.extend_from_slice(act.v);
            lc.k_pre_rope.extend_from_slice(act.k_pre_rope);
        }
    }
}

fn put_u32(w: &mut impl Write, v: usize) -> Result<(), CaptureError> {
    let v = u32::try_from(v).map_err(|_| CaptureError::Format(format!("{v} exceeds u32")))?;
    w.write_all(&v.to_le_bytes())?;
    Ok(())
}

fn put_f32s(w: &mut impl Write, v: &[f32]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(v.len() * 4);
    for x in v {
        buf.extend_from_slice(&x.to_le_bytes());
    }
    w.write_all(&buf)
}

fn get_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn get_f32s(r: &mut impl Read, n: usize) -> io::Result<Vec<f32>> {
    let mut buf = vec![0u8; n * 4];
    r.read_exact(&mut buf)?;
    Ok(buf
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

impl Capture {
    /// Number of captured tokens.
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Whether pre-RoPE keys are present in every layer.
    pub fn has_k_pre_rope(&self) -> bool {
        !self.layers.is_empty()
            && self
                .layers
                .iter()
                .all(|l| l.k_pre_rope.len() == l.k.len() && !l.k.is_empty())
    }

    /// Every layer's tensors hold `n_tokens` rows of their width.
    pub(crate) fn check(&self) -> Result<(), CaptureError> {
        let t = self.n_tokens();
        let (nq, nkv) = (
            t * self.n_q_heads * self.head_dim,
            t * self.n_kv_heads * self.head_dim,
        );
        for (i, l) in self.layers.iter().enumerate() {
            let pre_ok = l.k_pre_rope.is_empty() || l.k_pre_rope.len() == nkv;
            if l.q.len() != nq || l.k.len() != nkv || l.v.len() != nkv || !pre_ok {
                return Err(CaptureError::Format(format!(
                    "layer {i} has inconsistent sizes"
                )));
            }
        }
        Ok(())
    }

    /// Serialize to a writer.
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), CaptureError> {
        self.check()?;
        let pre = self.has_k_pre_rope();
        w.write_all(MAGIC)?;
        for v in [
            VERSION as usize,
            self.layers.len(),
            self.n_tokens(),
            self.n_q_heads,
            self.n_kv_heads,
            self.head_dim,
            if pre { FLAG_K_PRE_ROPE as usize } else { 0 },
            self.pos0,
        ] {
            put_u32(w, v)?;
        }
        for &t in &self.tokens {
            w.write_all(&t.to_le_bytes())?;
        }
        for l in &self.layers {
            put_f32s(w, &l.q)?;
            put_f32s(w, &l.k)?;
            put_f32s(w, &l.v)?;
            if pre {
                put_f32s(w, &l.k_pre_rope)?;
            }
        }
        Ok(())
    }

    /// Write to a file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), CaptureError> {
        let mut w = io::BufWriter::new(std::fs::File::create(path)?);
        self.write_to(&mut w)?;
        w.flush()?;
        Ok(())
    }

    /// Deserialize from a reader. Sizes are checked against `max_floats`
    /// (total floats the caller is willing to allocate).
    pub fn read_from(r: &mut impl Read, max_floats: usize) -> Result<Self, CaptureError> {
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(CaptureError::Format("bad magic".into()));
        }
        let version = get_u32(r)?;
        if version != VERSION {
            return Err(CaptureError::Format(format!(
                "unsupported version {version}"
            )));
        }
        let mut h = [0usize; 7];
        for v in h.iter_mut() {
            *v = get_u32(r)? as usize;
        }
        let [n_layers, t, n_q, n_kv, hd, flags, pos0] = h;
        let pre = flags & FLAG_K_PRE_ROPE as usize != 0;
        let per_layer = t
            .checked_mul(hd)
            .and_then(|x| x.checked_mul(n_q + (2 + usize::from(pre)) * n_kv));
        let total = per_layer
            .and_then(|p| p.checked_mul(n_layers))
            .and_then(|p| p.checked_add(t));
        if !matches!(total, Some(tot) if tot <= max_floats) {
            return Err(CaptureError::Format(
                "declared sizes exceed the limit".into(),
            ));
        }
        let mut tokens = Vec::with_capacity(t);
        for _ in 0..t {
            tokens.push(get_u32(r)?);
        }
        let mut layers = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            let q = get_f32s(r, t * n_q * hd)?;
            let k = get_f32s(r, t * n_kv * hd)?;
            let v = get_f32s(r, t * n_kv * hd)?;
            let k_pre_rope = if pre {
                get_f32s(r, t * n_kv * hd)?
            } else {
                Vec::new()
            };
            layers.push(LayerCapture {
                q,
                k,
                v,
                k_pre_rope,
            });
        }
        Ok(Capture {
            n_q_heads: n_q,
            n_kv_heads: n_kv,
            head_dim: hd,
            pos0,
            tokens,
            layers,
        })
    }

    /// Read a file written by [`Capture::save`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CaptureError> {
        let len = std::fs::metadata(path.as_ref())?.len() as usize;
        let mut r = io::BufReader::new(std::fs::File::open(path)?);
        Self::read_from(&mut r, len / 4)
    }
}
