//! The configuration of a layer's cache and its byte counts.

use super::*;

/// Configuration of one layer's cache. Checked by [`LayerCache::new`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheConfig {
    pub(super) n_kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) keys: Option<Codec>,
    pub(super) values: Option<Codec>,
    pub(super) residual: usize,
    pub(super) sinks: usize,
    pub(super) softmax_scale: Option<f32>,
    pub(super) backend: Option<Backend>,
    pub(super) threads: usize,
    pub(super) int8: bool,
    pub(super) rope: Option<Rope>,
}

impl CacheConfig {
    /// A full-precision cache of this shape: no schemes, no residual window,
    /// no sinks, softmax scale `1/√head_dim`, the detected backend, all
    /// available threads.
    pub fn new(n_kv_heads: usize, head_dim: usize) -> Self {
        CacheConfig {
            n_kv_heads,
            head_dim,
            keys: None,
            values: None,
            residual: 0,
            sinks: 0,
            softmax_scale: None,
            backend: None,
            threads: 0,
            int8: false,
            rope: None,
        }
    }
    /// Quantize keys with `scheme` (the uniform grid, [`Codec::uniform`]).
    pub fn keys(mut self, scheme: QuantScheme) -> Self {
        self.keys = Some(Codec::uniform(scheme));
        self
    }
    /// Quantize values with `scheme` (the uniform grid, [`Codec::uniform`]).
    pub fn values(mut self, scheme: QuantScheme) -> Self {
        self.values = Some(Codec::uniform(scheme));
        self
    }
    /// Keep keys in full precision (`None`) or quantize them.
    pub fn keys_opt(mut self, scheme: Option<QuantScheme>) -> Self {
        self.keys = scheme.map(Codec::uniform);
        self
    }
    /// Keep values in full precision (`None`) or quantize them.
    pub fn values_opt(mut self, scheme: Option<QuantScheme>) -> Self {
        self.values = scheme.map(Codec::uniform);
        self
    }
    /// Store keys in `codec` (`None`: full precision), e.g.
    /// [`Codec::hadamard`] for rotated keys.
    pub fn key_codec(mut self, codec: impl Into<Option<Codec>>) -> Self {
        self.keys = codec.into();
        self
    }
    /// Store values in `codec` (`None`: full precision).
    pub fn value_codec(mut self, codec: impl Into<Option<Codec>>) -> Self {
        self.values = codec.into();
        self
    }
    /// Keep the newest `tokens` in full precision.
    pub fn residual(mut self, tokens: usize) -> Self {
        self.residual = tokens;
        self
    }
    /// Keep the first `tokens` (attention sinks) exact forever.
    pub fn sinks(mut self, tokens: usize) -> Self {
        self.sinks = tokens;
        self
    }
    /// Multiply logits by `scale` before the softmax (default `1/√head_dim`;
    /// [`LayerCache::new`] rejects a non-finite one).
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    /// Run the kernels on `backend` (default: [`Backend::detect`]).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }
    /// Opt in to the approximate int8 kernels in `attend` for both codecs
    /// (as [`Codec::with_int8_kernels`] on each): packed keys
    /// through [`kernels::scores_i8_on`] (int8 query) and packed values
    /// through [`kernels::weighted_sum_i8_on`] (int8 weights). Faster on
    /// CPUs with AVX-512 VNNI, with the extra error documented there and
    /// measured by `cargo run --release --example int8_error`; elsewhere
    /// the exact kernels. Default off.
    pub fn int8_kernels(mut self, on: bool) -> Self {
        self.int8 = on;
        self
    }
    /// Store keys before RoPE: `append`/`extend` take the keys as the
    /// projection (and any `k_norm`) made them, before the model's `rope`,
    /// and the cache rotates each key to its position — its index in the
    /// cache, sinks included — when it scores. Queries stay post-RoPE.
    /// Per-channel key groups then see channels that RoPE has not turned
    /// (KVQuant's pre-RoPE keys; `docs/RESULTS.md` measures what it buys).
    /// [`LayerCache::keys_f32`] returns the stored, pre-RoPE keys.
    /// [`LayerCache::new`] checks `rope` and rejects a rotated key codec.
    ///
    /// The scores of pre-RoPE keys unpack and dequantize each tile, turn
    /// it to its positions, then take the dot products (SIMD for the
    /// uniform grid at whole-vector shapes; other codecs and shapes decode
    /// through the codec a chunk at a time): slower than the post-RoPE
    /// kernels, which never dequantize (`docs/PERFORMANCE.md`).
    ///
    /// The rotation tables are derived data, not in [`LayerCache::bytes`]:
    /// `cos` and `sin` of 256 positions (128 KiB at 128 rotary channels
    /// paired by halves, twice that for adjacent pairs) plus one row per
    /// 256 cached positions (2 bytes per token at 128 channels).
    pub fn pre_rope(mut self, rope: impl Into<Option<Rope>>) -> Self {
        self.rope = rope.into();
        self
    }
    /// The RoPE the cache applies to its pre-RoPE keys
    /// ([`CacheConfig::pre_rope`]; `None`: keys are stored post-RoPE).
    pub fn rope(&self) -> Option<Rope> {
        self.rope
    }
    /// Whether `attend` uses the int8 kernels ([`CacheConfig::int8_kernels`]).
    pub fn uses_int8_kernels(&self) -> bool {
        self.int8
    }
    /// Use at most `n` threads in `attend` (0 = all available, 1 = the
    /// calling thread only, for engines with their own pools).
    ///
    /// The contract: `attend` and `attend_causal` take `&self` and may be
    /// called from many threads at once on one cache (results are those of
    /// a single caller, bit for bit). Each call with more than one thread
    /// spawns up to `n` scoped threads, joined before it returns, and
    /// takes no lock, so calls never deadlock each other; but `n` threads
    /// per call inside a caller's own pool of `m` workers means up to `n·m`
    /// runnable threads. An engine that already spreads layers, heads or
    /// sequences over its own pool sets `threads(1)`.
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n;
        self
    }
    /// KV heads.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Key scheme (`None`: full precision).
    pub fn key_scheme(&self) -> Option<QuantScheme> {
        self.keys.map(|c| c.scheme())
    }
    /// Value scheme (`None`: full precision).
    pub fn value_scheme(&self) -> Option<QuantScheme> {
        self.values.map(|c| c.scheme())
    }
    /// Key codec (`None`: full precision).
    pub fn key_codec_spec(&self) -> Option<Codec> {
        self.keys
    }
    /// Value codec (`None`: full precision).
    pub fn value_codec_spec(&self) -> Option<Codec> {
        self.values
    }
    /// Residual window length.
    pub fn residual_len(&self) -> usize {
        self.residual
    }
    /// Number of sink tokens.
    pub fn sink_len(&self) -> usize {
        self.sinks
    }

    /// Bytes of one page of `page_tokens` tokens of keys plus one of
    /// values, as a [`PagePool`] with that page size allocates them for a
    /// cache of this configuration (each rounded up to whole quantized
    /// units; full-precision tensors take no pages). What to multiply by
    /// the pages a pool should hold.
    ///
    /// # Errors
    /// As [`LayerCache::new`] for a configuration it rejects.
    pub fn page_bytes(&self, page_tokens: usize) -> Result<usize> {
        check_shape("CacheConfig::page_bytes", self.n_kv_heads, self.head_dim)?;
        let mut total = 0usize;
        for c in [self.keys, self.values].into_iter().flatten() {
            // The built codec's layout: outlier entries take page bytes.
            let l = *c.build(self.n_kv_heads, self.head_dim)?.layout();
            let unit = l.block_tokens();
            total = total.saturating_add(l.bytes(page_tokens.div_ceil(unit).saturating_mul(unit)));
        }
        Ok(total)
    }
}

/// Bytes a cache holds, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheBytes {
    /// Packed codes.
    pub codes: usize,
    /// Scales and zeros, outlier entries
    /// ([`Codec::with_outliers`](crate::Codec::with_outliers)), and a fitted
    /// codebook's levels ([`Codec::table_bytes`](crate::Codec::table_bytes)).
    pub params: usize,
    /// Full-precision (f32) sinks, residual window and staging tokens.
    pub full_precision: usize,
}

impl CacheBytes {
    /// All of it.
    pub fn total(&self) -> usize {
        self.codes + self.params + self.full_precision
    }
}

impl std::ops::Add for CacheBytes {
    type Output = CacheBytes;
    fn add(self, o: CacheBytes) -> CacheBytes {
        CacheBytes {
            codes: self.codes + o.codes,
            params: self.params + o.params,
            full_precision: self.full_precision + o.full_precision,
        }
    }
}
