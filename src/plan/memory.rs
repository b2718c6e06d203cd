//! The memory model: the bytes of a model's cache at any context length.

use super::*;

/// How a cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CacheFormat {
    /// Full precision, 4 bytes per element.
    F32,
    /// Full precision, 2 bytes per element.
    F16,
    /// Full precision, 2 bytes per element (the usual baseline).
    Bf16,
    /// Quantized with kvq: keys and values each with their own scheme.
    Quantized {
        /// Scheme of the keys.
        keys: QuantScheme,
        /// Scheme of the values.
        values: QuantScheme,
    },
}

impl CacheFormat {
    /// Bytes per element of a full-precision format, `None` when quantized.
    pub fn dense_bytes(&self) -> Option<usize> {
        match self {
            CacheFormat::F32 => Some(4),
            CacheFormat::F16 | CacheFormat::Bf16 => Some(2),
            CacheFormat::Quantized { .. } => None,
        }
    }

    /// A short name: `bf16`, or `K4b-pthead-asym-f16/V8b-…`.
    pub fn label(&self) -> String {
        match self {
            CacheFormat::F32 => "f32".into(),
            CacheFormat::F16 => "f16".into(),
            CacheFormat::Bf16 => "bf16".into(),
            CacheFormat::Quantized { keys, values } => {
                format!("K{}/V{}", keys.label(), values.label())
            }
        }
    }
}

/// The memory of a model's cache, exactly, at any context length.
///
/// A model has `layers` layers of three kinds. Attention layers (listed in
/// [`new`](Self::new)) keep a KV cache of `n_kv_heads × head_dim` keys and
/// values per token; a full-attention layer's grows with the context, a
/// sliding-window layer's ([`with_sliding_window`](Self::with_sliding_window):
/// Gemma 3's local layers, Mistral) holds only the newest `window` tokens.
/// The remaining layers are linear attention (Gated DeltaNet, Mamba…) with
/// a fixed-size state. Quantized caches are counted with
/// [`Layout::bytes`], i.e. exactly what kvq allocates: codes, scales and
/// zeros, a partial per-channel block counted as a whole block.
///
/// Byte counts are `u64` and saturate at `u64::MAX`.
///
/// # Example: the hybrid model of the study
/// 32 layers, every fourth full attention (8 layers × 4 KV heads × head dim
/// 256), 24 Gated DeltaNet layers of 1 MiB of state each:
/// ```
/// use kvq::plan::{CacheFormat, MemoryModel, GB};
/// use kvq::{Axis, Group, QuantScheme};
/// let full: Vec<usize> = (3..32).step_by(4).collect();
/// let bf16 = MemoryModel::new(32, &full, 4, 256)?.with_linear_state(1 << 20);
/// assert_eq!(bf16.cache_bytes(1), 32 * 1024); // 32 KiB per token
/// assert_eq!(bf16.crossing_tokens(), Some(768)); // cache = state at 768 tokens
/// let full_ctx = 262_144;
/// assert!((bf16.cache_bytes(full_ctx) as f64 / GB - 8.59).abs() < 0.01);
/// assert!((bf16.state_share(8192) - 0.086).abs() < 0.001);
///
/// // K 4 bits / V 8 bits, f16 scale and zero per head: 2.6x smaller.
/// let k4v8 = bf16.clone().with_format(CacheFormat::Quantized {
///     keys: QuantScheme::new(4, Axis::PerToken, Group::Head)?,
///     values: QuantScheme::new(8, Axis::PerToken, Group::Head)?,
/// })?;
/// let saved = (bf16.cache_bytes(full_ctx) - k4v8.cache_bytes(full_ctx)) as f64 / GB;
/// assert!((saved - 5.3).abs() < 0.05);
/// assert!((bf16.cache_bytes(full_ctx) as f64 / k4v8.cache_bytes(full_ctx) as f64 - 2.61).abs() < 0.01);
/// # Ok::<(), kvq::Error>(())
/// ```
///
/// # Example: Gemma 3 270M
/// 18 layers of one KV head of 256 channels; five of every six see only
/// the last 512 tokens:
/// ```
/// use kvq::plan::MemoryModel;
/// let local: Vec<usize> = (0..18).filter(|l| l % 6 != 5).collect();
/// let m = MemoryModel::transformer(18, 1, 256)?.with_sliding_window(&local, 512)?;
/// // bf16: 1 KiB per token and layer; 3 global layers grow, 15 stop at 512.
/// assert_eq!(m.cache_bytes(8192), (3 * 8192 + 15 * 512) * 1024);
/// assert_eq!(m.cache_bytes_per_token(), 3.0 * 1024.0);
/// # Ok::<(), kvq::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryModel {
    layers: usize,
    /// Every attention layer (full and sliding), ascending.
    full_attention: Vec<usize>,
    /// The sliding-window subset of `full_attention`, ascending.
    sliding: Vec<usize>,
    window: usize,
    n_kv_heads: usize,
    head_dim: usize,
    state_per_linear_layer: u64,
    format: CacheFormat,
    layouts: Option<(Layout, Layout)>,
    /// Bytes per attention layer whatever its length: fitted tables.
    tables: usize,
}

impl MemoryModel {
    /// A model of `layers` layers of which those at the indices
    /// `full_attention` are full attention, with a bf16 cache and no
    /// linear-attention state (set it with
    /// [`with_linear_state`](Self::with_linear_state)).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `n_kv_heads` or `head_dim` is 0, or an
    /// index is out of range or repeated.
    pub fn new(
        layers: usize,
        full_attention: &[usize],
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let op = "MemoryModel::new";
        if n_kv_heads == 0 || head_dim == 0 {
            return Err(Error::InvalidShape {
                op,
                what: format!(
                    "n_kv_heads and head_dim must be at least 1, got {n_kv_heads} and {head_dim}"
                ),
            });
        }
        let mut full = full_attention.to_vec();
        full.sort_unstable();
        if let Some(&l) = full.iter().find(|&&l| l >= layers) {
            return Err(Error::InvalidShape {
                op,
                what: format!("full-attention layer {l} is out of range ({layers} layers)"),
            });
        }
        if let Some(w) = full.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::InvalidShape {
                op,
                what: format!("full-attention layer {} is listed twice", w[0]),
            });
        }
        Ok(MemoryModel {
            layers,
            full_attention: full,
            n_kv_heads,
            head_dim,
            sliding: Vec::new(),
            window: 0,
            state_per_linear_layer: 0,
            format: CacheFormat::Bf16,
            layouts: None,
            tables: 0,
        })
    }

    /// The attention layers at `indices` are sliding-window layers: their
    /// cache holds the newest `window` tokens at most (an engine evicts the
    /// older ones; one that evicts whole per-channel blocks holds up to a
    /// block more, which this count leaves out). Replaces any earlier
    /// sliding-window setting.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `window` is 0, or an index is not one of
    /// the attention layers given to [`new`](Self::new) or is repeated.
    pub fn with_sliding_window(mut self, indices: &[usize], window: usize) -> Result<Self> {
        let op = "MemoryModel::with_sliding_window";
        let bad = |what: String| Err(Error::InvalidShape { op, what });
        if window == 0 {
            return bad("a sliding window of 0 tokens".into());
        }
        let mut sliding = indices.to_vec();
        sliding.sort_unstable();
        if let Some(w) = sliding.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("sliding-window layer {} is listed twice", w[0]));
        }
        if let Some(l) = sliding
            .iter()
            .find(|l| self.full_attention.binary_search(l).is_err())
        {
            return bad(format!("layer {l} is not an attention layer"));
        }
        self.sliding = sliding;
        self.window = window;
        Ok(self)
    }

    /// A plain transformer: every layer is full attention.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn transformer(layers: usize, n_kv_heads: usize, head_dim: usize) -> Result<Self> {
        let all: Vec<usize> = (0..layers).collect();
        Self::new(layers, &all, n_kv_heads, head_dim)
    }

    /// Each linear-attention layer holds `bytes` of fixed-size state.
    pub fn with_linear_state(mut self, bytes: u64) -> Self {
        self.state_per_linear_layer = bytes;
        self
    }

    /// The cache stored in `format`.
    ///
    /// # Errors
    /// As [`QuantScheme::layout`] for a quantized format whose schemes do
    /// not fit `n_kv_heads`/`head_dim`.
    pub fn with_format(mut self, format: CacheFormat) -> Result<Self> {
        self.layouts = match format {
            CacheFormat::Quantized { keys, values } => Some((
                keys.layout(self.n_kv_heads, self.head_dim)?,
                values.layout(self.n_kv_heads, self.head_dim)?,
            )),
            _ => None,
        };
        self.format = format;
        self.tables = 0;
        Ok(self)
    }

    /// The cache stored through the codecs `keys` and `values`: their
    /// built layouts, so outlier entries ([`Codec::with_outliers`]) and
    /// fitted tables ([`Codec::table_bytes`], per layer) are counted.
    /// [`format`](Self::format) reports their schemes.
    ///
    /// ```
    /// use kvq::{presets, Codec, MemoryModel};
    /// let (k, v) = presets::kivi(2)?;
    /// let m = MemoryModel::new(30, &(0..30).collect::<Vec<_>>(), 3, 64)?;
    /// let plain = m.clone().with_codecs(Codec::from(k), Codec::from(v))?;
    /// let o = |s| Codec::from(s).with_outliers(0.01);
    /// let sparse = m.with_codecs(o(k)?, o(v)?)?;
    /// assert_eq!(plain.effective_bits(), 3.0);
    /// assert!(sparse.effective_bits() > 3.4 && sparse.effective_bits() < 3.45);
    /// assert!(sparse.cache_bytes(4096) > plain.cache_bytes(4096));
    /// # Ok::<(), kvq::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Codec::build`] for codecs that do not fit
    /// `n_kv_heads`/`head_dim`.
    pub fn with_codecs(mut self, keys: Codec, values: Codec) -> Result<Self> {
        let (n, hd) = (self.n_kv_heads, self.head_dim);
        self.layouts = Some((*keys.build(n, hd)?.layout(), *values.build(n, hd)?.layout()));
        self.format = CacheFormat::Quantized {
            keys: keys.scheme(),
            values: values.scheme(),
        };
        self.tables = keys.table_bytes() + values.table_bytes();
        Ok(self)
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers
    }
    /// Indices of the attention layers (full and sliding-window), ascending.
    pub fn full_attention_layers(&self) -> &[usize] {
        &self.full_attention
    }
    /// Indices of the sliding-window layers, ascending.
    pub fn sliding_window_layers(&self) -> &[usize] {
        &self.sliding
    }
    /// Tokens a sliding-window layer keeps (0 without such layers).
    pub fn sliding_window(&self) -> usize {
        self.window
    }
    /// Number of linear-attention layers.
    pub fn linear_layers(&self) -> usize {
        self.layers - self.full_attention.len()
    }
    /// KV heads of a full-attention layer.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// The cache format.
    pub fn format(&self) -> CacheFormat {
        self.format
    }

    /// Bytes of keys plus values of one full-attention layer at `tokens`.
    pub fn layer_cache_bytes(&self, tokens: usize) -> u64 {
        sat(self.layer_bytes_u128(tokens))
    }

    fn layer_bytes_u128(&self, tokens: usize) -> u128 {
        let t = tokens as u128;
        match (self.format.dense_bytes(), &self.layouts) {
            (Some(b), _) => 2 * t * (self.n_kv_heads * self.head_dim * b) as u128,
            (None, Some((k, v))) => {
                layout_bytes(k, tokens) + layout_bytes(v, tokens) + self.tables as u128
            }
            (None, None) => unreachable!("a quantized format always has layouts"),
        }
    }

    /// Bytes of the whole KV cache (all attention layers, the
    /// sliding-window ones at `min(tokens, window)`) at `tokens`.
    pub fn cache_bytes(&self, tokens: usize) -> u64 {
        let global = (self.full_attention.len() - self.sliding.len()) as u128;
        let local = self.sliding.len() as u128;
        sat(self.layer_bytes_u128(tokens) * global
            + self.layer_bytes_u128(tokens.min(self.window)) * local)
    }

    /// Bytes of the fixed-size state of all linear-attention layers.
    pub fn state_bytes(&self) -> u64 {
        sat(self.state_per_linear_layer as u128 * self.linear_layers() as u128)
    }

    /// Cache plus state at `tokens`.
    pub fn total_bytes(&self, tokens: usize) -> u64 {
        self.cache_bytes(tokens).saturating_add(self.state_bytes())
    }

    /// The state's share of the total at `tokens`, in `0..=1` (0 when both
    /// are empty).
    pub fn state_share(&self, tokens: usize) -> f64 {
        let total = self.total_bytes(tokens);
        if total == 0 {
            0.0
        } else {
            self.state_bytes() as f64 / total as f64
        }
    }

    /// Cache bytes per token, all layers, in the long-context limit (a
    /// per-channel block's scales spread over its tokens; sliding-window
    /// layers, bounded, add nothing).
    pub fn cache_bytes_per_token(&self) -> f64 {
        let per_layer = match (self.format.dense_bytes(), &self.layouts) {
            (Some(b), _) => (2 * self.n_kv_heads * self.head_dim * b) as f64,
            (None, Some((k, v))) => k.bytes_per_token() + v.bytes_per_token(),
            (None, None) => unreachable!("a quantized format always has layouts"),
        };
        per_layer * (self.full_attention.len() - self.sliding.len()) as f64
    }

    /// Bits per cached element, the mean of keys and values (scale and zero
    /// overhead included): 16 for bf16, 6.125 for K4/V8 per head of 256.
    pub fn effective_bits(&self) -> f64 {
        match (self.format.dense_bytes(), &self.layouts) {
            (Some(b), _) => (8 * b) as f64,
            (None, Some((k, v))) => (k.effective_bits() + v.effective_bits()) / 2.0,
            (None, None) => unreachable!("a quantized format always has layouts"),
        }
    }

    /// The shortest context at which the cache is at least as large as the
    /// state: `Some(0)` without state, `None` when the cache never gets
    /// there (no attention layer, or only sliding-window layers that stop
    /// short of it).
    pub fn crossing_tokens(&self) -> Option<usize> {
        let state = self.state_bytes();
        if state == 0 {
            return Some(0);
        }
        if self.full_attention.is_empty() {
            return None;
        }
        let mut hi = 1usize;
        while self.cache_bytes(hi) < state {
            if self.full_attention.len() == self.sliding.len() && hi > self.window {
                return None;
            }
            hi = hi.checked_mul(2)?;
        }
        let mut lo = hi / 2; // cache(lo) < state, or lo = 0
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.cache_bytes(mid) >= state {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Some(if self.cache_bytes(lo) >= state {
            lo
        } else {
            hi
        })
    }
}

/// [`Layout::bytes`] at any token count without overflow: per-token schemes
/// are linear in tokens; per-channel ones are whole blocks plus a partial one.
pub(super) fn layout_bytes(l: &Layout, tokens: usize) -> u128 {
    let b = l.block_tokens();
    (tokens / b) as u128 * l.bytes(b) as u128 + l.bytes(tokens % b) as u128
}

pub(super) fn sat(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}
