//! A small reference transformer (Llama, Qwen3 and Gemma 3 shapes) with a
//! pluggable KV cache.
//!
//! Architecture: token embedding (times [`Config::embed_scale`]) ->
//! `n_layers` x [RMSNorm -> attention (GQA, RoPE, optional per-head q/k
//! RMSNorm, optional sliding window) -> optional post-attention RMSNorm ->
//! residual -> RMSNorm -> gated MLP (SiLU or tanh-GELU gate) -> optional
//! post-MLP RMSNorm -> residual] -> RMSNorm -> output head (tied to the token
//! embedding unless the file has `output.weight`).
//!
//! Gemma 3 (`gemma3` GGUF) uses every optional part: q/k norms, the two post
//! norms, the tanh-GELU gate, embeddings scaled by `√d_model`, and
//! [`SlidingWindow`] layers (five of every six see only the last 512
//! positions and use RoPE base 10⁴; the sixth is global with base 10⁶).
//!
//! Weights are dequantized to `f32` at load time; large matrix products go
//! through `ndarray`'s `dot` (matrixmultiply, threaded), single-token products
//! through a threaded row-dot kernel.
//!
//! # Where the KV cache plugs in
//!
//! Every layer hands its post-RoPE keys and its values to a [`KvStore`]
//! (`extend`) and asks it for the attention output (`attend_causal` for a
//! block of tokens, `attend` for one). That is exactly the point where an
//! inference engine stores K and V, so a quantizing store (e.g. one backed by
//! `kvq::LayerCache`) sees what a real cache would.
//!
//! For experiments about *where* keys are quantized, [`Hooks::k`] applies a
//! quantize-dequantize [`RoundTrip`] to the keys at a chosen [`QuantPoint`]
//! and the model continues with the reconstructed keys; pair it with a
//! full-precision store such as [`DenseStore`]. Values have a single point
//! (the `v_proj` output), see [`Hooks::v`].
//!
//! # RoPE convention
//!
//! GGUF `llama` Q/K weights are permuted at conversion so that RoPE rotates
//! *adjacent* pairs `(2i, 2i+1)` ([`RopeStyle::Adjacent`]). Architectures
//! converted without that permutation (`qwen3`) rotate the two halves of each
//! head ([`RopeStyle::Halves`], "NeoX").

use std::fmt;

use ndarray::{s, Array2, ArrayView2, ArrayViewMut2, Axis};

use crate::gguf::{Gguf, GgufError};

/// Model loading or evaluation failure.
#[derive(Debug)]
pub struct ModelError(pub String);

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ModelError {}

impl From<GgufError> for ModelError {
    fn from(e: GgufError) -> Self {
        ModelError(format!("gguf: {e}"))
    }
}

impl From<String> for ModelError {
    fn from(e: String) -> Self {
        ModelError(e)
    }
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, ModelError>;

/// How rotary position embeddings pair up the channels of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotate `(2i, 2i+1)`: GGUF `llama` weights (ggml's "normal" mode).
    Adjacent,
    /// Rotate `(i, i + d/2)`: "NeoX" mode (`qwen2`, `qwen3` GGUF weights).
    Halves,
}

/// The gate activation of the MLP: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x·σ(x)` (SwiGLU: Llama, Qwen).
    Silu,
    /// GELU with the tanh approximation (GeGLU: Gemma).
    GeluTanh,
}

impl Activation {
    /// The activation of one value.
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluTanh => {
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
            }
        }
    }
}

/// Sliding-window attention on some layers (Gemma 3's local layers).
///
/// Layers come in periods of `period`: the last layer of each period is
/// global (full causal attention, [`Config::rope_base`]); the others are
/// local: a query sees only the last `window` positions, its own included,
/// and RoPE uses `rope_base`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// Positions a local layer's query sees, its own included.
    pub window: usize,
    /// Layers per period (the last of each is global).
    pub period: usize,
    /// RoPE frequency base of the local layers.
    pub rope_base: f64,
}

/// Hyper-parameters of the transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Residual stream width.
    pub d_model: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads (GQA when smaller than `n_heads`).
    pub n_kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Hidden width of the MLP.
    pub ffn_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RoPE frequency base.
    pub rope_base: f64,
    /// Number of rotated channels per head (the rest pass through).
    pub rope_dim: usize,
    /// RoPE channel pairing.
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Training context length (informational).
    pub ctx_len: usize,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Factor on the token embeddings before the first block (`√d_model`
    /// for Gemma, 1 otherwise).
    pub embed_scale: f32,
    /// Sliding-window layers, if any.
    pub sliding: Option<SlidingWindow>,
}

impl Config {
    /// Read the hyper-parameters from GGUF metadata (`{arch}.*` keys).
    ///
    /// Supported architectures: `llama` (adjacent-pair RoPE), `qwen3`
    /// (NeoX RoPE, q/k norms) and `gemma3` (NeoX RoPE, q/k norms, post
    /// norms, tanh-GELU, `√d_model` embedding scale, sliding-window layers
    /// with llama.cpp's defaults: every sixth layer global, local RoPE base
    /// 10⁴, unless the file says otherwise).
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        let rope_style = match arch {
            "llama" => RopeStyle::Adjacent,
            "qwen3" | "gemma3" => RopeStyle::Halves,
            other => return Err(ModelError(format!("unsupported architecture {other:?}"))),
        };
        let gemma = arch == "gemma3";
        let key = |k: &str| format!("{arch}.{k}");
        let d_model = g.get_usize(&key("embedding_length"))?;
        let n_heads = g.get_usize(&key("attention.head_count"))?;
        let n_kv_heads = g
            .get_usize(&key("attention.head_count_kv"))
            .unwrap_or(n_heads);
        let head_dim = match g.get_usize(&key("attention.key_length")) {
            Ok(hd) => hd,
            Err(_) => d_model.checked_div(n_heads).unwrap_or(0),
        };
        let vocab_size = match g.get_usize(&key("vocab_size")) {
            Ok(v) => v,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let cfg = Config {
            n_layers: g.get_usize(&key("block_count"))?,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: g.get_usize(&key("feed_forward_length"))?,
            vocab_size,
            rope_base: g.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_dim: g
                .get_usize(&key("rope.dimension_count"))
                .unwrap_or(head_dim),
            rope_style,
            rms_eps: g.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            ctx_len: g.get_usize(&key("context_length")).unwrap_or(0),
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embed_scale: if gemma { (d_model as f32).sqrt() } else { 1.0 },
            sliding: match g.get_usize(&key("attention.sliding_window")) {
                Ok(window) if gemma => Some(SlidingWindow {
                    window,
                    period: g
                        .get_usize(&key("attention.sliding_window_pattern"))
                        .unwrap_or(6),
                    rope_base: g.get_f64(&key("rope.freq_base_swa")).unwrap_or(10_000.0),
                }),
                _ => None,
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check internal consistency.
    pub fn validate(&self) -> Result<()> {
        let ok = self.n_layers > 0
            && self.d_model > 0
            && self.n_heads > 0
            && self.n_kv_heads > 0
            && self.head_dim > 0
            && self.n_heads.is_multiple_of(self.n_kv_heads)
            && self.rope_dim <= self.head_dim
            && self.rope_dim.is_multiple_of(2)
            && self.ffn_dim > 0
            && self.vocab_size > 0
            && self.embed_scale.is_finite()
            && self.rope_base.is_finite()
            && self.rope_base > 1.0
            && self.sliding.is_none_or(|s| {
                s.window > 0 && s.period > 0 && s.rope_base.is_finite() && s.rope_base > 1.0
            });
        if ok {
            Ok(())
        } else {
            Err(ModelError(format!("inconsistent model config {self:?}")))
        }
    }

    /// Width of one token's query vector (`n_heads * head_dim`).
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of one token's key (or value) vector (`n_kv_heads * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// The attention window of layer `l`: `Some(w)` for a local
    /// (sliding-window) layer, `None` for full causal attention.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        self.sliding
            .filter(|s| l % s.period != s.period - 1)
            .map(|s| s.window)
    }

    /// The RoPE frequency base of layer `l`.
    pub fn layer_rope_base(&self, l: usize) -> f64 {
        match self.sliding {
            Some(s) if self.layer_window(l).is_some() => s.rope_base,
            _ => self.rope_base,
        }
    }

    /// Layer `l`'s RoPE as a kvq cache applies it to pre-RoPE keys
    /// ([`kvq::CacheConfig::pre_rope`]).
    pub fn kvq_rope(&self, l: usize) -> kvq::Rope {
        let style = match self.rope_style {
            RopeStyle::Adjacent => kvq::RopeStyle::Adjacent,
            RopeStyle::Halves => kvq::RopeStyle::Halves,
        };
        kvq::Rope::new(self.layer_rope_base(l), self.rope_dim, style)
    }
}

/// Weights of one transformer block. Matrices are `[out, in]` (GGUF order).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// Pre-attention RMSNorm weight `[d_model]`.
    pub attn_norm: Vec<f32>,
    /// Query projection `[n_heads*head_dim, d_model]`.
    pub wq: Array2<f32>,
    /// Key projection `[n_kv_heads*head_dim, d_model]`.
    pub wk: Array2<f32>,
    /// Value projection `[n_kv_heads*head_dim, d_model]`.
    pub wv: Array2<f32>,
    /// Output projection `[d_model, n_heads*head_dim]`.
    pub wo: Array2<f32>,
    /// Optional per-head query RMSNorm weight `[head_dim]`.
    pub q_norm: Option<Vec<f32>>,
    /// Optional per-head key RMSNorm weight `[head_dim]`.
    pub k_norm: Option<Vec<f32>>,
    /// Optional RMSNorm of the attention output before the residual add
    /// `[d_model]` (Gemma).
    pub post_attn_norm: Option<Vec<f32>>,
    /// Pre-MLP RMSNorm weight `[d_model]`.
    pub ffn_norm: Vec<f32>,
    /// Gate projection `[ffn_dim, d_model]`.
    pub w_gate: Array2<f32>,
    /// Up projection `[ffn_dim, d_model]`.
    pub w_up: Array2<f32>,
    /// Down projection `[d_model, ffn_dim]`.
    pub w_down: Array2<f32>,
    /// Optional RMSNorm of the MLP output before the residual add
    /// `[d_model]` (Gemma).
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// Where in a layer a key quantize-dequantize round trip is applied.
// The variant names describe positions in the layer; the shared prefix reads best.
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantPoint {
    /// Right after `k_proj` (before any k_norm and RoPE). With a k_norm this
    /// point is *not* what a cache stores: the norm divides part of the error
    /// away (study A's trap); it exists to reproduce that comparison.
    AfterKProj,
    /// After the per-head k_norm, before RoPE (same as `AfterKProj` for models
    /// without k_norm).
    AfterKNorm,
    /// After RoPE: what a KV cache actually stores.
    AfterRope,
}

impl std::str::FromStr for QuantPoint {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "k-proj" | "after-k-proj" => Ok(QuantPoint::AfterKProj),
            "k-norm" | "after-k-norm" => Ok(QuantPoint::AfterKNorm),
            "rope" | "after-rope" => Ok(QuantPoint::AfterRope),
            _ => Err(format!("unknown quant point {s:?} (k-proj, k-norm, rope)")),
        }
    }
}

/// The width of a [`RoundTrip`]'s rows (`n_kv_heads·head_dim`), or a
/// message naming `what` when `x` is not `n_tokens` such rows.
pub fn rows_width(
    what: &str,
    x: &[f32],
    n_tokens: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> std::result::Result<usize, String> {
    let width = n_kv_heads * head_dim;
    if x.len() != n_tokens * width {
        return Err(format!(
            "{what}: {} values are not {n_tokens} tokens of {n_kv_heads}×{head_dim}",
            x.len()
        ));
    }
    Ok(width)
}

/// Run `f` over the rows of `x` (each `width` long) on two threads (the
/// machine's cores), each half its own slice; a single row (a decode step)
/// runs on the caller's thread alone. `f` is called once per part.
pub fn on_two_threads(x: &mut [f32], width: usize, f: impl Fn(&mut [f32]) + Sync) {
    let half = (x.len() / width.max(1)).div_ceil(2) * width;
    let (a, b) = x.split_at_mut(half.min(x.len()));
    if b.is_empty() {
        f(a);
    } else {
        std::thread::scope(|sc| {
            sc.spawn(|| f(a));
            f(b);
        });
    }
}

/// A quantize-dequantize round trip applied in place.
pub trait RoundTrip {
    /// Replace `x` (`[n_tokens, n_kv_heads*head_dim]` row-major, of layer
    /// `layer`, its first row at position `pos0`) by its reconstruction
    /// after quantization.
    fn round_trip(
        &self,
        layer: usize,
        pos0: usize,
        x: &mut [f32],
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> std::result::Result<(), String>;
}

/// Activations of one layer for one forward block, handed to an [`Observer`].
#[derive(Debug)]
pub struct LayerActivations<'a> {
    /// Position of the block's first token.
    pub pos0: usize,
    /// Post-RoPE queries `[n, n_heads*head_dim]`.
    pub q: &'a [f32],
    /// Keys before RoPE (after k_norm, if any) `[n, n_kv_heads*head_dim]`.
    pub k_pre_rope: &'a [f32],
    /// Post-RoPE keys, as stored `[n, n_kv_heads*head_dim]`.
    pub k: &'a [f32],
    /// Values `[n, n_kv_heads*head_dim]`.
    pub v: &'a [f32],
}

/// Receives per-layer activations during a forward pass.
pub trait Observer {
    /// Called once per layer per forward block, before attention.
    fn layer(&mut self, layer: usize, act: &LayerActivations<'_>);
}

/// Optional interventions and observation for a forward pass.
#[derive(Default)]
pub struct Hooks<'a> {
    /// Quantize-dequantize keys at the given point, then continue.
    pub k: Option<(QuantPoint, &'a dyn RoundTrip)>,
    /// Quantize-dequantize values at the `v_proj` output.
    pub v: Option<&'a dyn RoundTrip>,
    /// Observe per-layer Q/K/V.
    pub observer: Option<&'a mut dyn Observer>,
}

/// Where a KV cache stores keys/values and computes attention.
///
/// Keys arrive post-RoPE unless the store asks for them before
/// ([`KvStore::pre_rope_keys`]). Row-major layouts: one token is one row of
/// `n_kv_heads*head_dim` (K, V) or `n_q_heads*head_dim` (Q, output) floats,
/// heads contiguous inside a row. Query head `h` attends with key/value head
/// `h / (n_q_heads / n_kv_heads)`. The softmax scale is `1/sqrt(head_dim)`.
///
/// `window = Some(w)` (a sliding-window layer) limits every query to the
/// last `w` positions up to its own, its own included.
pub trait KvStore {
    /// Whether layer `layer` takes its keys before RoPE (and rotates them
    /// itself); default no.
    fn pre_rope_keys(&self, _layer: usize) -> bool {
        false
    }
    /// Append a block of `n` tokens for one layer: `k`, `v` are `[n, n_kv*head_dim]`
    /// (keys post-RoPE unless [`KvStore::pre_rope_keys`]).
    fn extend(&mut self, layer: usize, k: &[f32], v: &[f32]) -> std::result::Result<(), String>;
    /// Causal attention of the last `n` appended positions (the queries' own):
    /// `q` is `[n, n_q*head_dim]`, `out` likewise.
    fn attend_causal(
        &mut self,
        layer: usize,
        q: &[f32],
        n_q_heads: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> std::result::Result<(), String>;
    /// Attention of one new position over everything stored (decode):
    /// `q`, `out` are `[n_q*head_dim]`.
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        n_q_heads: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> std::result::Result<(), String>;
    /// Forget everything stored, for all layers.
    fn reset(&mut self);
}

/// Full-precision `f32` KV store.
#[derive(Debug, Clone)]
pub struct DenseStore {
    n_kv_heads: usize,
    head_dim: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl DenseStore {
    /// An empty store for `n_layers` layers.
    pub fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        DenseStore {
            n_kv_heads,
            head_dim,
            k: vec![Vec::new(); n_layers],
            v: vec![Vec::new(); n_layers],
        }
    }

    /// An empty store shaped for `cfg`.
    pub fn for_config(cfg: &Config) -> Self {
        Self::new(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    }

    /// Number of positions stored for `layer`.
    pub fn len(&self, layer: usize) -> usize {
        self.k
            .get(layer)
            .map_or(0, |k| k.len() / (self.n_kv_heads * self.head_dim))
    }

    /// Whether layer 0 holds no positions.
    pub fn is_empty(&self) -> bool {
        self.len(0) == 0
    }

    /// Stored keys and values of a layer, `[len, n_kv*head_dim]` each.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }
}

impl KvStore for DenseStore {
    fn extend(&mut self, layer: usize, k: &[f32], v: &[f32]) -> std::result::Result<(), String> {
        let row = self.n_kv_heads * self.head_dim;
        if layer >= self.k.len() {
            return Err(format!("layer {layer} out of range"));
        }
        if k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(format!(
                "k/v lengths {}/{} not multiples of {row}",
                k.len(),
                v.len()
            ));
        }
        self.k[layer].extend_from_slice(k);
        self.v[layer].extend_from_slice(v);
        Ok(())
    }

    fn attend_causal(
        &mut self,
        layer: usize,
        q: &[f32],
        n_q_heads: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> std::result::Result<(), String> {
        let (k, v) = self
            .k
            .get(layer)
            .zip(self.v.get(layer))
            .ok_or_else(|| format!("layer {layer} out of range"))?;
        let kv = DenseKv {
            k,
            v,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        };
        dense_attention(kv, q, n_q_heads, window, out)
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        n_q_heads: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> std::result::Result<(), String> {
        if q.len() != n_q_heads * self.head_dim {
            return Err(format!(
                "attend: q has {} floats, expected one token",
                q.len()
            ));
        }
        self.attend_causal(layer, q, n_q_heads, window, out)
    }

    fn reset(&mut self) {
        self.k.iter_mut().for_each(Vec::clear);
        self.v.iter_mut().for_each(Vec::clear);
    }
}

/// Full-precision keys and values of one layer, `[t, n_kv_heads*head_dim]`
/// each.
#[derive(Debug, Clone, Copy)]
pub struct DenseKv<'a> {
    /// Keys.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Key/value heads per row.
    pub n_kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
}

/// Exact causal softmax attention of the last `n` rows of `kv` (the
/// queries' own positions) in `f32`; with `window = Some(w)` each query
/// sees only the last `w` positions up to its own.
pub fn dense_attention(
    kv: DenseKv<'_>,
    q: &[f32],
    n_q_heads: usize,
    window: Option<usize>,
    out: &mut [f32],
) -> std::result::Result<(), String> {
    let DenseKv {
        k,
        v,
        n_kv_heads,
        head_dim,
    } = kv;
    if window == Some(0) {
        return Err("attention: a window of 0 positions".into());
    }
    let kv_row = n_kv_heads * head_dim;
    let q_row = n_q_heads * head_dim;
    if n_kv_heads == 0 || !n_q_heads.is_multiple_of(n_kv_heads) {
        return Err(format!(
            "{n_q_heads} query heads do not group over {n_kv_heads} kv heads"
        ));
    }
    if !q.len().is_multiple_of(q_row)
        || out.len() != q.len()
        || k.len() != v.len()
        || !k.len().is_multiple_of(kv_row)
    {
        return Err("attention: inconsistent buffer lengths".into());
    }
    let n = q.len() / q_row;
    let t = k.len() / kv_row;
    if n > t {
        return Err(format!("{n} queries but only {t} cached positions"));
    }
    let group = n_q_heads / n_kv_heads;
    let kk = ArrayView2::from_shape((t, kv_row), k).map_err(|e| e.to_string())?;
    let vv = ArrayView2::from_shape((t, kv_row), v).map_err(|e| e.to_string())?;
    let qq = ArrayView2::from_shape((n, q_row), q).map_err(|e| e.to_string())?;
    let mut oo = ArrayViewMut2::from_shape((n, q_row), out).map_err(|e| e.to_string())?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut scores = Array2::<f32>::zeros((n, t));
    for h in 0..n_q_heads {
        let kh = h / group;
        let cols_q = s![.., h * head_dim..(h + 1) * head_dim];
        let cols_k = s![.., kh * head_dim..(kh + 1) * head_dim];
        ndarray::linalg::general_mat_mul(
            scale,
            &qq.slice(cols_q),
            &kk.slice(cols_k).t(),
            0.0,
            &mut scores,
        );
        for (i, mut row) in scores.axis_iter_mut(Axis(0)).enumerate() {
            let visible = t - n + i + 1;
            let first = window.map_or(0, |w| visible.saturating_sub(w));
            let row = row.as_slice_mut().expect("contiguous scores");
            softmax_in_place(&mut row[first..visible]);
            row[..first].fill(0.0);
            row[visible..].fill(0.0);
        }
        ndarray::linalg::general_mat_mul(
            1.0,
            &scores,
            &vv.slice(cols_k),
            0.0,
            &mut oo.slice_mut(cols_q),
        );
    }
    Ok(())
}

/// Numerically stable softmax.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// RMSNorm of each `weight.len()`-wide chunk of `x`, in place.
fn rms_norm_chunks(x: &mut [f32], weight: &[f32], eps: f32) {
    for chunk in x.chunks_exact_mut(weight.len()) {
        let ms = chunk
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / chunk.len() as f64;
        let inv = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
        for (v, &w) in chunk.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// `x @ w.T` for `x` `[n, in]` and `w` `[out, in]`.
///
/// Blocks of several rows go to matrixmultiply; a few rows (decode) use a
/// row-dot kernel split over threads, which avoids re-packing the weight.
pub fn linear(x: ArrayView2<f32>, w: &Array2<f32>) -> Array2<f32> {
    let (n, d_in) = x.dim();
    let d_out = w.nrows();
    assert_eq!(w.ncols(), d_in, "linear: shape mismatch");
    if n >= 4 {
        return x.dot(&w.t());
    }
    let w = w.as_slice().expect("weights are contiguous");
    let x = x.as_standard_layout();
    let mut y = Array2::<f32>::zeros((n, d_out));
    // Threads only pay off for large matrices.
    let threads = if d_out * d_in >= 1 << 18 {
        std::thread::available_parallelism().map_or(1, |t| t.get())
    } else {
        1
    };
    for (xr, mut yr) in x.outer_iter().zip(y.outer_iter_mut()) {
        let xr = xr.as_slice().expect("contiguous row");
        let yr = yr.as_slice_mut().expect("contiguous row");
        if threads == 1 {
            for (yv, wr) in yr.iter_mut().zip(w.chunks_exact(d_in)) {
                *yv = dot(wr, xr);
            }
            continue;
        }
        let chunk = d_out.div_ceil(threads);
        std::thread::scope(|sc| {
            for (ci, yc) in yr.chunks_mut(chunk).enumerate() {
                let rows = &w[ci * chunk * d_in..];
                sc.spawn(move || {
                    for (j, yv) in yc.iter_mut().enumerate() {
                        *yv = dot(&rows[j * d_in..(j + 1) * d_in], xr);
                    }
                });
            }
        });
    }
    y
}

/// Dot product with eight independent accumulators (vectorizes well).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A Llama-style transformer with `f32` weights.
#[derive(Debug, Clone)]
pub struct Model {
    /// Hyper-parameters.
    pub cfg: Config,
    /// Token embedding `[vocab, d_model]`.
    pub tok_embd: Array2<f32>,
    /// Blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight.
    pub out_norm: Vec<f32>,
    /// Untied output head `[vocab, d_model]`; `None` means tied to `tok_embd`.
    pub output: Option<Array2<f32>>,
    /// Inverse RoPE frequencies of each layer, `rope_dim/2` of them.
    inv_freq: Vec<Vec<f64>>,
}

fn matrix(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Array2<f32>> {
    let (t, data) = g.dequantize(name)?;
    if t.dims.len() != 2 || t.dims[0] as usize != cols || t.dims[1] as usize != rows {
        return Err(ModelError(format!(
            "tensor {name}: dims {:?}, expected [{cols}, {rows}]",
            t.dims
        )));
    }
    Ok(Array2::from_shape_vec((rows, cols), data).expect("size checked"))
}

fn vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>> {
    let (t, data) = g.dequantize(name)?;
    if data.len() != len {
        return Err(ModelError(format!(
            "tensor {name}: dims {:?}, expected [{len}]",
            t.dims
        )));
    }
    Ok(data)
}

fn optional_vector(g: &Gguf, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
    match g.tensor(name) {
        Some(_) => vector(g, name, len).map(Some),
        None => Ok(None),
    }
}

impl Model {
    /// Load a model from a parsed GGUF file, dequantizing all weights.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let cfg = Config::from_gguf(g)?;
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let tok_embd = matrix(g, "token_embd.weight", cfg.vocab_size, d)?;
        let output = match g.tensor("output.weight") {
            Some(_) => Some(matrix(g, "output.weight", cfg.vocab_size, d)?),
            None => None,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let p = |n: &str| format!("blk.{l}.{n}.weight");
            layers.push(LayerWeights {
                attn_norm: vector(g, &p("attn_norm"), d)?,
                wq: matrix(g, &p("attn_q"), cfg.q_width(), d)?,
                wk: matrix(g, &p("attn_k"), cfg.kv_width(), d)?,
                wv: matrix(g, &p("attn_v"), cfg.kv_width(), d)?,
                wo: matrix(g, &p("attn_output"), d, cfg.q_width())?,
                q_norm: optional_vector(g, &p("attn_q_norm"), hd)?,
                k_norm: optional_vector(g, &p("attn_k_norm"), hd)?,
                post_attn_norm: optional_vector(g, &p("post_attention_norm"), d)?,
                ffn_norm: vector(g, &p("ffn_norm"), d)?,
                w_gate: matrix(g, &p("ffn_gate"), cfg.ffn_dim, d)?,
                w_up: matrix(g, &p("ffn_up"), cfg.ffn_dim, d)?,
                w_down: matrix(g, &p("ffn_down"), d, cfg.ffn_dim)?,
                post_ffn_norm: optional_vector(g, &p("post_ffw_norm"), d)?,
            });
        }
        let out_norm = vector(g, "output_norm.weight", d)?;
        Ok(Self::from_parts(cfg, tok_embd, layers, out_norm, output))
    }

    /// Assemble a model from weights (shapes are the caller's responsibility;
    /// [`Model::forward`] asserts them).
    pub fn from_parts(
        cfg: Config,
        tok_embd: Array2<f32>,
        layers: Vec<LayerWeights>,
        out_norm: Vec<f32>,
        output: Option<Array2<f32>>,
    ) -> Self {
        let inv_freq = (0..cfg.n_layers)
            .map(|l| {
                let base = cfg.layer_rope_base(l);
                (0..cfg.rope_dim / 2)
                    .map(|i| base.powf(-2.0 * i as f64 / cfg.rope_dim as f64))
                    .collect()
            })
            .collect();
        Model {
            cfg,
            tok_embd,
            layers,
            out_norm,
            output,
            inv_freq,
        }
    }

    /// A model with deterministic pseudo-random weights (for tests).
    /// `qk_norm` adds per-head q/k RMSNorm weights.
    pub fn random(cfg: Config, seed: u64, qk_norm: bool) -> Self {
        Self::random_with_norms(cfg, seed, qk_norm, false)
    }

    /// As [`Model::random`]; `post_norms` adds Gemma's post-attention and
    /// post-MLP RMSNorm weights.
    pub fn random_with_norms(cfg: Config, seed: u64, qk_norm: bool, post_norms: bool) -> Self {
        let mut rng = SplitMix64(seed);
        let mut mat = |rows: usize, cols: usize, scale: f32| {
            Array2::from_shape_fn((rows, cols), |_| rng.uniform() * scale)
        };
        let (d, hd, f) = (cfg.d_model, cfg.head_dim, cfg.ffn_dim);
        let sd = 1.0 / (d as f32).sqrt();
        let tok_embd = mat(cfg.vocab_size, d, 1.0);
        let mut layers = Vec::new();
        for _ in 0..cfg.n_layers {
            let wq = mat(cfg.q_width(), d, 2.0 * sd);
            let wk = mat(cfg.kv_width(), d, 2.0 * sd);
            let wv = mat(cfg.kv_width(), d, sd);
            let wo = mat(d, cfg.q_width(), sd);
            let w_gate = mat(f, d, sd);
            let w_up = mat(f, d, sd);
            let w_down = mat(d, f, 1.0 / (f as f32).sqrt());
            let norm = |m: &mut dyn FnMut(usize, usize, f32) -> Array2<f32>, n: usize| {
                m(1, n, 0.2).iter().map(|v| 1.0 + v).collect::<Vec<f32>>()
            };
            let attn_norm = norm(&mut mat, d);
            let ffn_norm = norm(&mut mat, d);
            let (q_norm, k_norm) = if qk_norm {
                (Some(norm(&mut mat, hd)), Some(norm(&mut mat, hd)))
            } else {
                (None, None)
            };
            let (post_attn_norm, post_ffn_norm) = if post_norms {
                (Some(norm(&mut mat, d)), Some(norm(&mut mat, d)))
            } else {
                (None, None)
            };
            layers.push(LayerWeights {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                q_norm,
                k_norm,
                post_attn_norm,
                ffn_norm,
                w_gate,
                w_up,
                w_down,
                post_ffn_norm,
            });
        }
        let out_norm = vec![1.0; d];
        Self::from_parts(cfg, tok_embd, layers, out_norm, None)
    }

    /// Apply layer `layer`'s RoPE in place to a `[n, n_heads_x*head_dim]`
    /// block whose rows are `row` floats wide (first token at `pos0`).
    pub fn apply_rope(&self, x: &mut [f32], row: usize, pos0: usize, layer: usize) {
        let hd = self.cfg.head_dim;
        let half = self.cfg.rope_dim / 2;
        let mut cs = vec![(0.0f32, 0.0f32); half];
        for (t, tok) in x.chunks_exact_mut(row).enumerate() {
            let pos = (pos0 + t) as f64;
            for (c, &f) in cs.iter_mut().zip(&self.inv_freq[layer]) {
                let (sin, cos) = (pos * f).sin_cos();
                *c = (cos as f32, sin as f32);
            }
            for head in tok.chunks_exact_mut(hd) {
                for (i, &(cos, sin)) in cs.iter().enumerate() {
                    let (a, b) = match self.cfg.rope_style {
                        RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                        RopeStyle::Halves => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        }
    }

    /// Run the blocks over `tokens` (positions `pos0..pos0+n`), storing K/V in
    /// `store`. Returns the final-normed hidden states `[n, d_model]`; turn
    /// them into logits with [`Model::logits`].
    ///
    /// With one token the store's `attend` is used, otherwise `attend_causal`.
    pub fn forward(
        &self,
        tokens: &[u32],
        pos0: usize,
        store: &mut dyn KvStore,
        hooks: &mut Hooks<'_>,
    ) -> Result<Array2<f32>> {
        let cfg = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError("forward: no tokens".into()));
        }
        let (d, hd, nkv) = (cfg.d_model, cfg.head_dim, cfg.n_kv_heads);
        let mut x = Array2::<f32>::zeros((n, d));
        for (mut row, &t) in x.outer_iter_mut().zip(tokens) {
            let t = t as usize;
            if t >= self.tok_embd.nrows() {
                return Err(ModelError(format!("token id {t} out of vocabulary")));
            }
            row.assign(&self.tok_embd.row(t));
        }
        if cfg.embed_scale != 1.0 {
            x *= cfg.embed_scale;
        }
        let mut attn = vec![0.0f32; n * cfg.q_width()];
        for (l, w) in self.layers.iter().enumerate() {
            let mut h = x.clone();
            rms_norm_chunks(
                h.as_slice_mut().expect("contiguous"),
                &w.attn_norm,
                cfg.rms_eps,
            );
            let mut q = linear(h.view(), &w.wq);
            let mut k = linear(h.view(), &w.wk);
            let mut v = linear(h.view(), &w.wv);
            let (qs, ks, vs) = (
                q.as_slice_mut().expect("contiguous"),
                k.as_slice_mut().expect("contiguous"),
                v.as_slice_mut().expect("contiguous"),
            );
            let round_trip_k = |point: QuantPoint, ks: &mut [f32]| -> Result<()> {
                match hooks.k {
                    Some((p, rt)) if p == point => Ok(rt.round_trip(l, pos0, ks, n, nkv, hd)?),
                    _ => Ok(()),
                }
            };
            round_trip_k(QuantPoint::AfterKProj, ks)?;
            if let Some(rt) = hooks.v {
                rt.round_trip(l, pos0, vs, n, nkv, hd)?;
            }
            if let Some(qn) = &w.q_norm {
                rms_norm_chunks(qs, qn, cfg.rms_eps);
            }
            if let Some(kn) = &w.k_norm {
                rms_norm_chunks(ks, kn, cfg.rms_eps);
            }
            round_trip_k(QuantPoint::AfterKNorm, ks)?;
            let pre_rope_store = store.pre_rope_keys(l);
            let k_pre_rope = (hooks.observer.is_some() || pre_rope_store).then(|| ks.to_vec());
            self.apply_rope(qs, cfg.q_width(), pos0, l);
            self.apply_rope(ks, cfg.kv_width(), pos0, l);
            round_trip_k(QuantPoint::AfterRope, ks)?;
            if let Some(obs) = hooks.observer.as_mut() {
                obs.layer(
                    l,
                    &LayerActivations {
                        pos0,
                        q: qs,
                        k_pre_rope: k_pre_rope.as_deref().unwrap_or(&[]),
                        k: ks,
                        v: vs,
                    },
                );
            }
            match (&k_pre_rope, pre_rope_store) {
                (Some(k), true) => store.extend(l, k, vs)?,
                _ => store.extend(l, ks, vs)?,
            }
            let window = cfg.layer_window(l);
            if n == 1 {
                store.attend(l, qs, cfg.n_heads, window, &mut attn)?;
            } else {
                store.attend_causal(l, qs, cfg.n_heads, window, &mut attn)?;
            }
            let attn_v = ArrayView2::from_shape((n, cfg.q_width()), &attn).expect("shape");
            let mut o = linear(attn_v, &w.wo);
            if let Some(pn) = &w.post_attn_norm {
                rms_norm_chunks(o.as_slice_mut().expect("contiguous"), pn, cfg.rms_eps);
            }
            x += &o;

            let mut h = x.clone();
            rms_norm_chunks(
                h.as_slice_mut().expect("contiguous"),
                &w.ffn_norm,
                cfg.rms_eps,
            );
            let mut gate = linear(h.view(), &w.w_gate);
            let up = linear(h.view(), &w.w_up);
            let act = cfg.activation;
            gate.zip_mut_with(&up, |g, &u| *g = act.apply(*g) * u);
            let mut f = linear(gate.view(), &w.w_down);
            if let Some(pn) = &w.post_ffn_norm {
                rms_norm_chunks(f.as_slice_mut().expect("contiguous"), pn, cfg.rms_eps);
            }
            x += &f;
        }
        rms_norm_chunks(
            x.as_slice_mut().expect("contiguous"),
            &self.out_norm,
            cfg.rms_eps,
        );
        Ok(x)
    }

    /// Logits `[n, vocab]` of final-normed hidden states `[n, d_model]`.
    pub fn logits(&self, hidden: ArrayView2<f32>) -> Array2<f32> {
        linear(hidden, self.output.as_ref().unwrap_or(&self.tok_embd))
    }
}

/// SplitMix64: a tiny deterministic PRNG for test weights.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// A standard normal sample (Box–Muller on two [`uniform`](Self::uniform)s).
    pub fn gaussian(&mut self) -> f32 {
        let u = ((self.uniform() + 1.0) / 2.0).max(1e-9);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}
