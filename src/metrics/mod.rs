//! Error measured where the cache is used: through attention.
//!
//! A KV cache is never read directly. Keys are read through the attention
//! logits `z_t = s·q·k_t` and the softmax `p = softmax(z)`; values through
//! the weighted sum `o = Σ_t p_t·v_t`. So the error that matters is the error
//! of `p` and of `o`, not the reconstruction error of `K` and `V` — and the
//! two can rank quantization schemes in opposite orders (see
//! `docs/METRICS.md` and the demonstration in `tests/metrics_plan.rs`).
//!
//! For one attention head, with queries `Q [n_q, head_dim]`, keys and values
//! `K, V [tokens, head_dim]` and their quantized versions `K̂, V̂`,
//! [`AttentionErrors`] reports:
//!
//! | field | definition |
//! |---|---|
//! | `k_mse`, `v_mse` | `mean((x − x̂)²)` over all elements |
//! | `k_rel`, `v_rel` | `‖x − x̂‖_F / ‖x‖_F` |
//! | `logit_rms`, `logit_max` | RMS and max of `\|s·q_i·(k_t − k̂_t)\|` over visible `(i, t)` |
//! | `kl` | `KL(p_i ‖ p̂_i)` in nats, mean over query positions |
//! | `output_rel` | `‖O − Ô‖_F / ‖O‖_F`, `O = [o_1 … o_nq]` |
//! | `top_k_overlap` | `\|top_k(p_i) ∩ top_k(p̂_i)\| / k`, mean over query positions |
//!
//! `s` is the softmax scale, `1/√head_dim` unless set. With a causal offset
//! `c`, query `i` sees tokens `0 ..= c + i`. Sums run in `f64`; the softmax
//! subtracts the row maximum, and log-probabilities are `z − logsumexp(z)`,
//! so the KL is finite even where `p̂` underflows.
//!
//! Layers ([`layer_errors`]) take `Q [n_q, n_q_heads, head_dim]` and
//! `K, V [tokens, n_kv_heads, head_dim]` (row-major, as an engine holds
//! them), with grouped-query attention: query head `j` reads KV head
//! `j / (n_q_heads / n_kv_heads)`. [`ErrorSummary`] aggregates heads and
//! layers (mean, and worst).
//!
//! # Example: one head, keys per-channel vs per-token
//! ```
//! use kvq::metrics::{head_errors_quantized, MetricsConfig};
//! use kvq::{Axis, Group, QuantScheme, UniformQuantizer};
//! let (tokens, hd) = (64, 64);
//! // Keys with one outlier channel (channel 0 is 20 in every token).
//! let k: Vec<f32> = (0..tokens * hd)
//!     .map(|i| if i % hd == 0 { 20.0 } else { ((i * 7919) % 17) as f32 / 8.0 - 1.0 })
//!     .collect();
//! let v: Vec<f32> = (0..tokens * hd).map(|i| ((i * 104729) % 23) as f32 / 11.0 - 1.0).collect();
//! let q: Vec<f32> = k[5 * hd..6 * hd].to_vec(); // one query, aligned with token 5
//! let v_exact = UniformQuantizer::new(QuantScheme::new(8, Axis::PerToken, Group::Head)?, 1, hd)?;
//! let cfg = MetricsConfig::new();
//! let mut rel = Vec::new();
//! for axis in [Axis::PerToken, Axis::PerChannel] {
//!     let kq = UniformQuantizer::new(QuantScheme::new(2, axis, Group::Size(64))?, 1, hd)?;
//!     let e = head_errors_quantized(&q, &k, &v, hd, &kq, &v_exact, &cfg)?;
//!     rel.push((e.k_mse, e.kl));
//! }
//! // Per-channel keys isolate the outlier channel: lower MSE *and* lower KL.
//! assert!(rel[1].0 < rel[0].0 && rel[1].1 < rel[0].1);
//! # Ok::<(), kvq::Error>(())
//! ```

use crate::cache::Rope;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::quant::Codec;
use crate::quant::{check_finite, check_len, check_rows, KvQuantizer};
use std::ops::Range;

mod attention;
pub(crate) use attention::*;

/// How attention is computed for the metrics: softmax scale, causal mask and
/// the `k` of the top-k overlap.
///
/// The default is scale `1/√head_dim`, no mask (every query sees every
/// token), `k = 8`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetricsConfig {
    scale: Option<f64>,
    causal_offset: Option<usize>,
    top_k: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl MetricsConfig {
    /// Scale `1/√head_dim`, not causal, top-8 overlap.
    pub const fn new() -> Self {
        MetricsConfig {
            scale: None,
            causal_offset: None,
            top_k: 8,
        }
    }

    /// Multiply logits by `scale` instead of `1/√head_dim` (checked when
    /// used: it must be finite and positive).
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Causal mask: query position `i` sees tokens `0 ..= offset + i`.
    ///
    /// For `n_q` queries that are the last `n_q` tokens of the context, the
    /// offset is `tokens − n_q`; for a whole prefill (`n_q = tokens`) it is 0.
    pub fn with_causal(mut self, offset: usize) -> Self {
        self.causal_offset = Some(offset);
        self
    }

    /// Use `k` for the top-k overlap (checked when used: at least 1). A
    /// query that sees fewer than `k` tokens compares all it sees.
    pub fn with_top_k(mut self, k: usize) -> Self {
        self.top_k = k;
        self
    }

    /// The scale set with [`with_scale`](Self::with_scale), if any.
    pub fn scale(&self) -> Option<f64> {
        self.scale
    }
    /// The causal offset, if the mask is on.
    pub fn causal_offset(&self) -> Option<usize> {
        self.causal_offset
    }
    /// The `k` of the top-k overlap.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The scale used for `head_dim`: the one set, or `1/√head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
    }

    /// Check the configuration for `head_dim`, returning the scale.
    pub(crate) fn check(&self, op: &'static str, head_dim: usize) -> Result<f64> {
        let s = self.scale_for(head_dim);
        if !(s.is_finite() && s > 0.0) {
            return Err(Error::InvalidArgument {
                op,
                what: format!("softmax scale must be finite and positive, got {s}"),
            });
        }
        if self.top_k == 0 {
            return Err(Error::InvalidArgument {
                op,
                what: "top_k must be at least 1, got 0".into(),
            });
        }
        Ok(s)
    }

    /// Tokens seen by each query at the given positions.
    pub(crate) fn visible(
        &self,
        op: &'static str,
        positions: &[usize],
        n_q: usize,
        tokens: usize,
    ) -> Result<Vec<usize>> {
        match self.causal_offset {
            None => Ok(vec![tokens; positions.len()]),
            Some(c) => {
                if c.checked_add(n_q).is_none_or(|end| end > tokens) {
                    return Err(Error::InvalidShape {
                        op,
                        what: format!(
                            "causal offset {c} + {n_q} query positions is beyond {tokens} tokens"
                        ),
                    });
                }
                Ok(positions.iter().map(|&i| c + i + 1).collect())
            }
        }
    }
}

/// The shape of one attention layer: query heads, KV heads, head dimension.
///
/// Grouped-query attention: `n_q_heads` is a multiple of `n_kv_heads`, and
/// query head `j` reads KV head `j / (n_q_heads / n_kv_heads)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnShape {
    n_q_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl AttnShape {
    /// A layer shape.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when a count is 0 or `n_q_heads` is not a
    /// multiple of `n_kv_heads`.
    pub fn new(n_q_heads: usize, n_kv_heads: usize, head_dim: usize) -> Result<Self> {
        let op = "AttnShape::new";
        if n_q_heads == 0 || n_kv_heads == 0 || head_dim == 0 {
            return Err(Error::InvalidShape {
                op,
                what: format!(
                    "heads and head_dim must be at least 1, got {n_q_heads} query heads, \
                     {n_kv_heads} KV heads, head_dim {head_dim}"
                ),
            });
        }
        if !n_q_heads.is_multiple_of(n_kv_heads) {
            return Err(Error::InvalidShape {
                op,
                what: format!("{n_q_heads} query heads is not a multiple of {n_kv_heads} KV heads"),
            });
        }
        Ok(AttnShape {
            n_q_heads,
            n_kv_heads,
            head_dim,
        })
    }
    /// Query heads.
    pub fn n_q_heads(&self) -> usize {
        self.n_q_heads
    }
    /// KV heads.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_q_heads / self.n_kv_heads
    }
}

/// Errors of one attention head (or their mean or worst over many; see
/// [`ErrorSummary`]). All values are `f64`; relative errors are ratios (not
/// percent). See the [module docs](self) for the definitions.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionErrors {
    /// Mean squared reconstruction error of the keys.
    pub k_mse: f64,
    /// `‖K − K̂‖ / ‖K‖`.
    pub k_rel: f64,
    /// Mean squared reconstruction error of the values.
    pub v_mse: f64,
    /// `‖V − V̂‖ / ‖V‖`.
    pub v_rel: f64,
    /// RMS of the scaled logit error over every visible `(query, token)`.
    pub logit_rms: f64,
    /// Largest absolute scaled logit error.
    pub logit_max: f64,
    /// `KL(p ‖ p̂)` of the attention distribution, nats, mean over queries.
    pub kl: f64,
    /// `‖O − Ô‖ / ‖O‖` of the attention output, over all query positions.
    pub output_rel: f64,
    /// Mean fraction of the exact top-k attended tokens that are also in the
    /// quantized top-k (1 is perfect).
    pub top_k_overlap: f64,
}

impl AttentionErrors {
    fn fields(&self) -> [f64; 9] {
        [
            self.k_mse,
            self.k_rel,
            self.v_mse,
            self.v_rel,
            self.logit_rms,
            self.logit_max,
            self.kl,
            self.output_rel,
            self.top_k_overlap,
        ]
    }
    fn from_fields(f: [f64; 9]) -> Self {
        AttentionErrors {
            k_mse: f[0],
            k_rel: f[1],
            v_mse: f[2],
            v_rel: f[3],
            logit_rms: f[4],
            logit_max: f[5],
            kl: f[6],
            output_rel: f[7],
            top_k_overlap: f[8],
        }
    }
}

/// Errors aggregated over heads (and layers): the mean and the worst.
///
/// `worst` is the largest value of every error field and the *smallest*
/// top-k overlap (overlap is better when higher).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ErrorSummary {
    /// Heads aggregated.
    pub count: usize,
    /// Field-wise mean over the heads.
    pub mean: AttentionErrors,
    /// Field-wise worst over the heads.
    pub worst: AttentionErrors,
}

impl ErrorSummary {
    /// Mean and worst of per-head errors (all zeros when there are none).
    pub fn of<'a, I: IntoIterator<Item = &'a AttentionErrors>>(heads: I) -> Self {
        let mut sum = [0f64; 9];
        let mut worst = [f64::NEG_INFINITY; 9];
        worst[8] = f64::INFINITY;
        let mut n = 0usize;
        for h in heads {
            let f = h.fields();
            for i in 0..9 {
                sum[i] += f[i];
                worst[i] = if i == 8 {
                    worst[i].min(f[i])
                } else {
                    worst[i].max(f[i])
                };
            }
            n += 1;
        }
        if n == 0 {
            return ErrorSummary::default();
        }
        ErrorSummary {
            count: n,
            mean: AttentionErrors::from_fields(sum.map(|s| s / n as f64)),
            worst: AttentionErrors::from_fields(worst),
        }
    }

    /// Combine summaries (of layers, say): the mean weighted by `count`,
    /// and the worst of the worst.
    pub fn combine<'a, I: IntoIterator<Item = &'a ErrorSummary>>(parts: I) -> Self {
        let mut sum = [0f64; 9];
        let mut worst = [f64::NEG_INFINITY; 9];
        worst[8] = f64::INFINITY;
        let mut n = 0usize;
        for p in parts {
            if p.count == 0 {
                continue;
            }
            let (m, w) = (p.mean.fields(), p.worst.fields());
            for i in 0..9 {
                sum[i] += m[i] * p.count as f64;
                worst[i] = if i == 8 {
                    worst[i].min(w[i])
                } else {
                    worst[i].max(w[i])
                };
            }
            n += p.count;
        }
        if n == 0 {
            return ErrorSummary::default();
        }
        ErrorSummary {
            count: n,
            mean: AttentionErrors::from_fields(sum.map(|s| s / n as f64)),
            worst: AttentionErrors::from_fields(worst),
        }
    }
}

/// Errors of every query head of a layer, and their summary.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerErrors {
    /// One entry per query head, in order. Reconstruction errors are those
    /// of the KV head the query head reads.
    pub heads: Vec<AttentionErrors>,
    /// Mean and worst over the query heads.
    pub summary: ErrorSummary,
}

/// Errors of every layer of a model, and their summary over all heads.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelErrors {
    /// One entry per layer, in order.
    pub layers: Vec<LayerErrors>,
    /// Mean and worst over every query head of every layer.
    pub summary: ErrorSummary,
}

/// Calibration data of one attention layer: `Q [n_q, n_q_heads, head_dim]`
/// and `K, V [tokens, n_kv_heads, head_dim]`, full precision, row-major.
///
/// What [`Planner`](crate::plan::Planner) takes, one per full-attention
/// layer. Keys are captured where the cache stores them (after `k_norm` and
/// RoPE, if the model stores them so — see `docs/STUDIES.md`, study A).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCapture {
    shape: AttnShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    n_q: usize,
    tokens: usize,
    /// Keys before RoPE and the RoPE that turns them into `k`, for a cache
    /// that stores keys before RoPE.
    pre_rope: Option<(Vec<f32>, Rope)>,
    /// Leading tokens the cache keeps exact.
    sinks: usize,
}

impl LayerCapture {
    /// A capture (copied, widened to `f32`).
    ///
    /// # Errors
    /// [`Error::Length`] when `q` is not a positive multiple of
    /// `n_q_heads·head_dim`, `k` not a positive multiple of
    /// `n_kv_heads·head_dim`, or `v` not as long as `k`;
    /// [`Error::NonFinite`] for NaN or infinite values.
    pub fn new<T: Element>(shape: AttnShape, q: &[T], k: &[T], v: &[T]) -> Result<Self> {
        let w = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        Self::from_vecs(shape, w(q), w(k), w(v))
    }

    /// A capture that takes ownership of `f32` buffers (no copy).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_vecs(shape: AttnShape, q: Vec<f32>, k: Vec<f32>, v: Vec<f32>) -> Result<Self> {
        let op = "LayerCapture::new";
        let (n_q, tokens) = check_layer(op, &shape, &q, &k, &v)?;
        check_finite(op, &q, shape.n_q_heads, shape.head_dim, 0)?;
        check_finite(op, &k, shape.n_kv_heads, shape.head_dim, 0)?;
        check_finite(op, &v, shape.n_kv_heads, shape.head_dim, 0)?;
        Ok(LayerCapture {
            shape,
            q,
            k,
            v,
            n_q,
            tokens,
            pre_rope: None,
            sinks: 0,
        })
    }

    /// The same layer for a cache that stores keys before RoPE
    /// ([`CacheConfig::pre_rope`](crate::CacheConfig::pre_rope)): `k_pre`
    /// are the keys before `rope`, token `t` at position `t`. Attention still
    /// reads the post-RoPE keys given to [`new`](Self::new); quantized keys
    /// ([`quantized_keys`](Self::quantized_keys)) are `k_pre` through the
    /// codec, then rotated.
    ///
    /// # Errors
    /// [`Error::Length`] when `k_pre` is not as long as the keys,
    /// [`Error::NonFinite`] for NaN or infinite values,
    /// [`Error::InvalidConfig`] for a `rope` that does not fit the head,
    /// and [`Error::InvalidArgument`] when `rope` does not turn `k_pre` into
    /// the keys (beyond `1e-3` of the largest key magnitude: the wrong RoPE,
    /// or keys from another point of the layer).
    pub fn with_pre_rope_keys(mut self, k_pre: Vec<f32>, rope: Rope) -> Result<Self> {
        let op = "LayerCapture::with_pre_rope_keys";
        let hd = self.shape.head_dim;
        check_len(
            op,
            "pre-RoPE keys (as many as keys)",
            self.k.len(),
            k_pre.len(),
        )?;
        check_finite(op, &k_pre, self.shape.n_kv_heads, hd, 0)?;
        rope.check(op, hd)?;
        let width = self.shape.n_kv_heads * hd;
        let scale = self.k.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
        let mut row = vec![0f32; width];
        for (t, (pre, post)) in k_pre
            .chunks_exact(width)
            .zip(self.k.chunks_exact(width))
            .enumerate()
        {
            row.copy_from_slice(pre);
            rope.apply(&mut row, hd, t);
            let worst = row
                .iter()
                .zip(post)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if worst > 1e-3 * scale {
                return Err(Error::InvalidArgument {
                    op,
                    what: format!(
                        "RoPE at position {t} turns the pre-RoPE keys into keys {worst} away \
                         from the captured ones (largest key magnitude {scale})"
                    ),
                });
            }
        }
        self.pre_rope = Some((k_pre, rope));
        Ok(self)
    }

    /// The same layer for a cache that keeps its first `sinks` tokens exact
    /// ([`CacheConfig::sinks`](crate::CacheConfig::sinks)): the quantized
    /// keys and values leave them alone and quantize the rest from the
    /// first packed token on, as the cache does.
    pub fn with_sinks(mut self, sinks: usize) -> Self {
        self.sinks = sinks;
        self
    }

    /// Leading tokens kept exact.
    pub fn sinks(&self) -> usize {
        self.sinks
    }

    /// The RoPE of a capture for a pre-RoPE cache.
    pub fn rope(&self) -> Option<&Rope> {
        self.pre_rope.as_ref().map(|(_, r)| r)
    }

    /// The keys attention reads after `codec` stored them as this capture's
    /// cache would: the sinks exact, the rest through the codec's round
    /// trip (before RoPE, then rotated, for a pre-RoPE capture).
    /// `[tokens, n_kv_heads, head_dim]`. A per-channel block the capture
    /// ends inside is quantized too, as the cache quantizes it once it fills
    /// (until then the cache keeps its tokens exact).
    ///
    /// # Errors
    /// As [`Codec::roundtrip`].
    pub fn quantized_keys(&self, codec: &Codec) -> Result<Vec<f32>> {
        let (hd, width) = (
            self.shape.head_dim,
            self.shape.n_kv_heads * self.shape.head_dim,
        );
        let Some((pre, rope)) = &self.pre_rope else {
            return self.stored(codec, &self.k);
        };
        let mut k = self.stored(codec, pre)?;
        for (t, row) in k.chunks_exact_mut(width).enumerate() {
            rope.apply(row, hd, t);
        }
        Ok(k)
    }

    /// The values attention reads after `codec` stored them (sinks exact).
    ///
    /// # Errors
    /// As [`Codec::roundtrip`].
    pub fn quantized_values(&self, codec: &Codec) -> Result<Vec<f32>> {
        self.stored(codec, &self.v)
    }

    /// The key codebook `codec` refit to this layer's keys as its cache
    /// stores them ([`Codec::fit_levels`]): the tokens past the sinks,
    /// before RoPE for a pre-RoPE capture. Each stored channel weighs by
    /// its queries' energy, `Σ q_c²` over query positions and the KV
    /// head's query heads (after the codec's rotation), so the fit
    /// minimizes the summed squared score error. Before RoPE a channel
    /// pair shares its energy (RoPE turns one into the other); before RoPE
    /// and with a rotation, where the weights depend on the positions,
    /// every channel weighs the same.
    ///
    /// # Errors
    /// As [`Codec::fit_levels`]; [`Error::Length`] when no token is past
    /// the sinks.
    pub fn fit_keys(&self, codec: &Codec) -> Result<Codec> {
        let (nkv, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        let built = codec.build(nkv, hd)?;
        let cut = self.sinks.min(self.tokens) * nkv * hd;
        let rows = match &self.pre_rope {
            Some((pre, _)) => &pre[cut..],
            None => &self.k[cut..],
        };
        let weights = match (&self.pre_rope, built.transforms()) {
            (Some(_), true) => None,
            (rope, _) => {
                let (nq, group) = (self.shape.n_q_heads, self.shape.group());
                let mut w = vec![0f64; nkv * hd];
                let mut row = vec![0f32; nq * hd];
                for q in self.q.chunks_exact(nq * hd) {
                    row.copy_from_slice(q);
                    built.transform_in(&mut row);
                    for (i, head) in row.chunks_exact(hd).enumerate() {
                        let h = i / group;
                        for (w, &x) in w[h * hd..(h + 1) * hd].iter_mut().zip(head) {
                            *w += f64::from(x) * f64::from(x);
                        }
                    }
                }
                if let Some((_, r)) = rope {
                    for h in 0..nkv {
                        for i in 0..r.dims() / 2 {
                            let (a, b) = r.pair(i);
                            let m = (w[h * hd + a] + w[h * hd + b]) / 2.0;
                            w[h * hd + a] = m;
                            w[h * hd + b] = m;
                        }
                    }
                }
                // Relative weights: scaled to a largest of 1 so any
                // capture's energies fit an f32.
                let top = w.iter().fold(0f64, |m, &x| m.max(x));
                (top > 0.0).then(|| w.iter().map(|&x| (x / top) as f32).collect::<Vec<_>>())
            }
        };
        codec.fit_levels(rows, nkv, hd, weights.as_deref())
    }

    /// The value codebook `codec` refit to this layer's values past the
    /// sinks ([`Codec::fit_levels`]), every channel weighing the same (an
    /// output channel's error is the values' error, mixed by the softmax).
    ///
    /// # Errors
    /// As [`fit_keys`](Self::fit_keys).
    pub fn fit_values(&self, codec: &Codec) -> Result<Codec> {
        let (nkv, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        let cut = self.sinks.min(self.tokens) * nkv * hd;
        codec.fit_levels(&self.v[cut..], nkv, hd, None)
    }

    /// `x` with the rows past the sinks through `codec`.
    fn stored(&self, codec: &Codec, x: &[f32]) -> Result<Vec<f32>> {
        let (nkv, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        let cut = self.sinks.min(self.tokens) * nkv * hd;
        let mut out = x[..cut].to_vec();
        if cut < x.len() {
            out.extend(codec.roundtrip(&x[cut..], nkv, hd)?);
        }
        Ok(out)
    }

    /// The layer's shape.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }
    /// Query positions.
    pub fn queries(&self) -> usize {
        self.n_q
    }
    /// Tokens of keys and values.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Queries `[n_q, n_q_heads, head_dim]`.
    pub fn q(&self) -> &[f32] {
        &self.q
    }
    /// Keys `[tokens, n_kv_heads, head_dim]`.
    pub fn k(&self) -> &[f32] {
        &self.k
    }
    /// Values `[tokens, n_kv_heads, head_dim]`.
    pub fn v(&self) -> &[f32] {
        &self.v
    }
}

/// Query positions and tokens of a layer, or a length error.
fn check_layer(
    op: &'static str,
    shape: &AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<(usize, usize)> {
    let qw = shape.n_q_heads * shape.head_dim;
    let kw = shape.n_kv_heads * shape.head_dim;
    let n = check_rows(
        op,
        "query values (a positive multiple of n_q_heads·head_dim)",
        q.len(),
        qw,
    )?;
    let t = check_rows(
        op,
        "key values (a positive multiple of n_kv_heads·head_dim)",
        k.len(),
        kw,
    )?;
    check_len(op, "values (as many as keys)", k.len(), v.len())?;
    Ok((n, t))
}

/// Errors of one attention head from the exact and the quantized keys and
/// values — from any quantizer, or from an existing cache (dequantize it and
/// pass `k_hat`, `v_hat`).
///
/// `q` is `[n_q, head_dim]`; `k`, `v`, `k_hat`, `v_hat` are
/// `[tokens, head_dim]`.
///
/// # Errors
/// [`Error::Length`] for lengths that do not fit those shapes,
/// [`Error::InvalidShape`] for `head_dim = 0` or a causal offset beyond the
/// tokens, [`Error::InvalidArgument`] for a bad [`MetricsConfig`],
/// [`Error::NonFinite`] for NaN or infinite input.
pub fn head_errors<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    k_hat: &[f32],
    v_hat: &[f32],
    head_dim: usize,
    cfg: &MetricsConfig,
) -> Result<AttentionErrors> {
    let shape = AttnShape::new(1, 1, head_dim)?;
    let l = layer_errors(shape, q, k, v, k_hat, v_hat, cfg)?;
    Ok(l.heads[0])
}

/// [`head_errors`] with the quantized keys and values made by `kq` and `vq`
/// (any [`KvQuantizer`] built for one KV head of `head_dim` channels).
///
/// # Errors
/// As [`head_errors`]; [`Error::SchemeShape`] when a quantizer is not for
/// one head of `head_dim`; the quantizers' own errors.
pub fn head_errors_quantized<T: Element, KQ: KvQuantizer, VQ: KvQuantizer>(
    q: &[T],
    k: &[T],
    v: &[T],
    head_dim: usize,
    kq: &KQ,
    vq: &VQ,
    cfg: &MetricsConfig,
) -> Result<AttentionErrors> {
    let shape = AttnShape::new(1, 1, head_dim)?;
    let l = layer_errors_quantized(shape, q, k, v, kq, vq, cfg)?;
    Ok(l.heads[0])
}

/// Errors of every query head of a layer.
///
/// `q` is `[n_q, n_q_heads, head_dim]`; `k`, `v`, `k_hat`, `v_hat` are
/// `[tokens, n_kv_heads, head_dim]`.
///
/// # Errors
/// As [`head_errors`].
pub fn layer_errors<T: Element>(
    shape: AttnShape,
    q: &[T],
    k: &[T],
    v: &[T],
    k_hat: &[f32],
    v_hat: &[f32],
    cfg: &MetricsConfig,
) -> Result<LayerErrors> {
    let op = "layer_errors";
    let cap = LayerCapture::new(shape, q, k, v)?;
    check_len(op, "dequantized key values", cap.k.len(), k_hat.len())?;
    check_len(op, "dequantized values", cap.v.len(), v_hat.len())?;
    check_finite(op, k_hat, shape.n_kv_heads, shape.head_dim, 0)?;
    check_finite(op, v_hat, shape.n_kv_heads, shape.head_dim, 0)?;
    capture_errors_hat(&cap, k_hat, v_hat, cfg)
}

/// [`layer_errors`] with `K̂`, `V̂` made by `kq` and `vq`.
///
/// # Errors
/// As [`layer_errors`]; [`Error::SchemeShape`] when a quantizer's
/// `n_kv_heads`/`head_dim` differ from `shape`; the quantizers' own errors.
pub fn layer_errors_quantized<T: Element, KQ: KvQuantizer, VQ: KvQuantizer>(
    shape: AttnShape,
    q: &[T],
    k: &[T],
    v: &[T],
    kq: &KQ,
    vq: &VQ,
    cfg: &MetricsConfig,
) -> Result<LayerErrors> {
    let cap = LayerCapture::new(shape, q, k, v)?;
    capture_errors(&cap, kq, vq, cfg)
}

/// Errors of one captured layer under the quantizers `kq`, `vq`.
///
/// # Errors
/// As [`layer_errors_quantized`].
pub fn capture_errors<KQ: KvQuantizer, VQ: KvQuantizer>(
    cap: &LayerCapture,
    kq: &KQ,
    vq: &VQ,
    cfg: &MetricsConfig,
) -> Result<LayerErrors> {
    let op = "capture_errors";
    let s = cap.shape;
    for (name, nh, hd) in [
        ("key", kq.n_kv_heads(), kq.head_dim()),
        ("value", vq.n_kv_heads(), vq.head_dim()),
    ] {
        if nh != s.n_kv_heads || hd != s.head_dim {
            return Err(Error::SchemeShape {
                op,
                what: format!(
                    "{name} quantizer is for {nh} heads of {hd}, the layer has {} of {}",
                    s.n_kv_heads, s.head_dim
                ),
            });
        }
    }
    let k_hat = kq.roundtrip(&cap.k, cap.tokens)?;
    let v_hat = vq.roundtrip(&cap.v, cap.tokens)?;
    capture_errors_hat(cap, &k_hat, &v_hat, cfg)
}

/// Errors of every layer of a model under the same quantizers, with the
/// summary over all heads of all layers.
///
/// # Errors
/// As [`capture_errors`], for the first layer that fails.
pub fn model_errors<KQ: KvQuantizer, VQ: KvQuantizer>(
    captures: &[LayerCapture],
    kq: &KQ,
    vq: &VQ,
    cfg: &MetricsConfig,
) -> Result<ModelErrors> {
    let layers = captures
        .iter()
        .map(|c| capture_errors(c, kq, vq, cfg))
        .collect::<Result<Vec<_>>>()?;
    let summary = ErrorSummary::combine(layers.iter().map(|l| &l.summary));
    Ok(ModelErrors { layers, summary })
}

/// The core: `k_hat`/`v_hat` already checked against the capture.
fn capture_errors_hat(
    cap: &LayerCapture,
    k_hat: &[f32],
    v_hat: &[f32],
    cfg: &MetricsConfig,
) -> Result<LayerErrors> {
    let op = "layer_errors";
    let s = cap.shape;
    let scale = cfg.check(op, s.head_dim)?;
    let positions: Vec<usize> = (0..cap.n_q).collect();
    let vis = cfg.visible(op, &positions, cap.n_q, cap.tokens)?;
    let (hd, t, nkv) = (s.head_dim, cap.tokens, s.n_kv_heads);
    let mut heads = Vec::with_capacity(s.n_q_heads);
    for kvh in 0..nkv {
        let k = head_rows(&cap.k, t, nkv, hd, kvh);
        let v = head_rows(&cap.v, t, nkv, hd, kvh);
        let kh = head_rows(k_hat, t, nkv, hd, kvh);
        let vh = head_rows(v_hat, t, nkv, hd, kvh);
        let (kr, vr) = (Recon::of(&k, &kh), Recon::of(&v, &vh));
        let g = QueryGroup::new(cap, &positions, &vis, kvh);
        let exact = Attention::new(&g.q, &g.vis, &k, t, hd, scale);
        let quant = Attention::new(&g.q, &g.vis, &kh, t, hd, scale);
        let top = exact.top_k(cfg.top_k);
        let o = exact.output(&v, hd);
        let oh = quant.output(&vh, hd);
        for j in 0..s.group() {
            let rows = g.rows(j);
            let ks = KeyStats::of(&exact, &top, &quant, rows.clone(), cfg.top_k);
            let (num, den) = rows_err(&o, &oh, rows, hd);
            heads.push(assemble(&kr, &vr, &ks, ratio(num, den)));
        }
    }
    let summary = ErrorSummary::of(&heads);
    Ok(LayerErrors { heads, summary })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_input_has_zero_error() {
        let hd = 8;
        let k: Vec<f32> = (0..10 * hd).map(|i| (i as f32 * 0.3).sin()).collect();
        let v: Vec<f32> = (0..10 * hd).map(|i| (i as f32 * 0.7).cos()).collect();
        let q: Vec<f32> = (0..3 * hd).map(|i| (i as f32 * 1.3).sin()).collect();
        let e = head_errors(&q, &k, &v, &k, &v, hd, &MetricsConfig::new()).unwrap();
        assert_eq!(
            e,
            AttentionErrors {
                top_k_overlap: 1.0,
                ..Default::default()
            }
        );
    }

    #[test]
    fn kl_matches_direct_formula() {
        let hd = 8;
        let k: Vec<f32> = (0..5 * hd).map(|i| (i as f32 * 0.3).sin() * 3.0).collect();
        let kh: Vec<f32> = k.iter().map(|x| x + 0.1).collect();
        let q: Vec<f32> = (0..hd).map(|i| i as f32 * 0.5).collect();
        let s = 0.5;
        let cfg = MetricsConfig::new().with_scale(s);
        let e = head_errors(&q, &k, &k, &kh, &k, hd, &cfg).unwrap();
        let sm = |kk: &[f32]| {
            let z: Vec<f64> = (0..5)
                .map(|t| {
                    let kt = &kk[t * hd..(t + 1) * hd];
                    s * q
                        .iter()
                        .zip(kt)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                })
                .collect();
            let m = z.iter().cloned().fold(f64::MIN, f64::max);
            let sum: f64 = z.iter().map(|x| (x - m).exp()).sum();
            z.iter().map(|x| (x - m).exp() / sum).collect::<Vec<_>>()
        };
        let (p, ph) = (sm(&k), sm(&kh));
        let kl: f64 = p.iter().zip(&ph).map(|(a, b)| a * (a / b).ln()).sum();
        assert!((e.kl - kl).abs() < 1e-12, "{} vs {kl}", e.kl);
    }

    #[test]
    fn blocked_products_match_naive_and_each_other() {
        let f = |n: usize, a: f64| (0..n).map(|i| (i as f64 * a).sin()).collect::<Vec<f64>>();
        for (m, n, k) in [(1, 1, 1), (5, 3, 7), (8, 9, 16), (13, 2, 5), (4, 2, 2)] {
            let (a, b) = (f(m * k, 0.37), f(n * k, 0.11));
            let mut c = vec![0.0; m * n];
            matmul_nt(&a, &b, m, n, k, &mut c);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|p| a[i * k + p] * b[j * k + p]).sum();
                    assert!((c[i * n + j] - want).abs() < 1e-12);
                    // Every cell is summed in the same order, wherever it is.
                    let mut one = [0.0];
                    matmul_nt(
                        &a[i * k..(i + 1) * k],
                        &b[j * k..(j + 1) * k],
                        1,
                        1,
                        k,
                        &mut one,
                    );
                    assert_eq!(one[0], c[i * n + j]);
                }
            }
            let (w, v) = (f(m * n, 0.7), f(n * k, 0.3));
            let o = matmul_nn(&w, &v, m, n, k);
            for i in 0..m {
                let row = matmul_nn(&w[i * n..(i + 1) * n], &v, 1, n, k);
                assert_eq!(&o[i * k..(i + 1) * k], &row[..]);
                for c in 0..k {
                    let want: f64 = (0..n).map(|t| w[i * n + t] * v[t * k + c]).sum();
                    assert!((o[i * k + c] - want).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn top_k_matches_a_full_sort() {
        let mut buf = Vec::new();
        let rows: [&[f64]; 4] = [
            &[0.1, 0.5, 0.5, 0.2, 0.9, 0.0, 0.5],
            &[0.25; 6],
            &[1.0],
            &[0.3, 0.1, 0.2],
        ];
        for p in rows {
            for k in 1..=8 {
                let mut idx: Vec<u32> = (0..p.len() as u32).collect();
                idx.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
                let mut want = idx[..k.min(p.len())].to_vec();
                want.sort_unstable();
                assert_eq!(top_k_row(p, k, &mut buf), want, "{p:?} k={k}");
            }
        }
    }

    #[test]
    fn causal_rows_see_a_prefix() {
        let cfg = MetricsConfig::new().with_causal(2);
        assert_eq!(cfg.visible("t", &[0, 1, 2], 3, 5).unwrap(), vec![3, 4, 5]);
        assert!(cfg.visible("t", &[0, 1, 2], 3, 4).is_err());
    }
}
