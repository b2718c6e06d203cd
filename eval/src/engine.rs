//! A Llama forward pass written with candle ops, as an engine built on
//! candle writes it, whose attention keeps K/V either in candle's own
//! [`candle_nn::kv_cache::KvCache`] or in a [`kvq::LayerCache`] through
//! the `candle` adapter (`append_tensor` / `attend_tensor`).
//!
//! Everything but the cache is shared: the same weights (from the same
//! GGUF file, or from a [`Model`]), the same projections, RoPE, norms and
//! MLP. What the switch to kvq changes is [`Attention::Kvq`]'s arm of
//! [`Attention::attend`] and the cache's construction in
//! [`Caches::kvq`]: the lines an engine author rewrites.

use candle_core::{DType, Device, Tensor, D};
use candle_nn::kv_cache::KvCache;

use crate::model::{Activation, Config, Model, RopeStyle};

/// Errors of the engine: candle's or kvq's, as text.
pub type Result<T> = std::result::Result<T, EngineError>;

/// An error of the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineError(pub String);

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EngineError {}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError(format!("candle: {e}"))
    }
}

impl From<kvq::Error> for EngineError {
    fn from(e: kvq::Error) -> Self {
        EngineError(format!("kvq: {e}"))
    }
}

/// One block's weights as candle tensors (matrices transposed once at
/// load, `[in, out]`, so every product reads them contiguously).
struct Block {
    attn_norm: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    ffn_norm: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
}

/// A Llama-architecture model in candle tensors (f32, CPU).
pub struct CandleLlama {
    cfg: Config,
    embed: Tensor,
    blocks: Vec<Block>,
    out_norm: Tensor,
    head: Tensor,
    /// RoPE tables `[positions, head_dim/2]`, grown on demand.
    cos: Tensor,
    sin: Tensor,
}

fn matrix(a: &ndarray::Array2<f32>) -> Result<Tensor> {
    let s = a
        .as_slice()
        .ok_or_else(|| EngineError("weights not in standard layout".into()))?;
    Ok(Tensor::from_slice(s, a.dim(), &Device::Cpu)?)
}

/// `a` (`[out, in]`) as a contiguous `[in, out]` tensor.
fn transposed(a: &ndarray::Array2<f32>) -> Result<Tensor> {
    Ok(matrix(a)?.t()?.contiguous()?)
}

fn vector(v: &[f32]) -> Result<Tensor> {
    Ok(Tensor::from_slice(v, v.len(), &Device::Cpu)?)
}

impl CandleLlama {
    /// The candle model of `m`'s weights. Llama-style blocks only: SiLU
    /// MLP, RoPE on every channel, no q/k norms, post norms, sliding
    /// windows or embedding scale (SmolLM2, Llama); other configurations
    /// are an error.
    pub fn from_model(m: &Model) -> Result<Self> {
        let cfg = m.cfg.clone();
        let unsupported = cfg.activation != Activation::Silu
            || cfg.rope_dim != cfg.head_dim
            || cfg.sliding.is_some()
            || cfg.embed_scale != 1.0
            || m.layers.iter().any(|l| {
                l.q_norm.is_some()
                    || l.k_norm.is_some()
                    || l.post_attn_norm.is_some()
                    || l.post_ffn_norm.is_some()
            });
        if unsupported {
            return Err(EngineError(
                "the candle engine runs Llama-style blocks only (SiLU, full RoPE, no extra norms)"
                    .into(),
            ));
        }
        let blocks = m
            .layers
            .iter()
            .map(|l| {
                Ok(Block {
                    attn_norm: vector(&l.attn_norm)?,
                    wq: transposed(&l.wq)?,
                    wk: transposed(&l.wk)?,
                    wv: transposed(&l.wv)?,
                    wo: transposed(&l.wo)?,
                    ffn_norm: vector(&l.ffn_norm)?,
                    w_gate: transposed(&l.w_gate)?,
                    w_up: transposed(&l.w_up)?,
                    w_down: transposed(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = matrix(&m.tok_embd)?;
        let head = match &m.output {
            Some(o) => transposed(o)?,
            None => embed.t()?.contiguous()?,
        };
        let empty = Tensor::zeros((0, cfg.head_dim / 2), DType::F32, &Device::Cpu)?;
        Ok(CandleLlama {
            embed,
            blocks,
            out_norm: vector(&m.out_norm)?,
            head,
            cos: empty.clone(),
            sin: empty,
            cfg,
        })
    }

    /// RoPE tables for positions `0..n` (f64 angles, as the reference
    /// model computes them).
    fn ensure_rope(&mut self, n: usize) -> Result<()> {
        if self.cos.dim(0)? >= n {
            return Ok(());
        }
        let half = self.cfg.head_dim / 2;
        let n = n.next_power_of_two().max(512);
        let base = self.cfg.rope_base;
        let (mut c, mut s) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for p in 0..n {
            for i in 0..half {
                let a = p as f64 * base.powf(-2.0 * i as f64 / self.cfg.rope_dim as f64);
                c.push(a.cos() as f32);
                s.push(a.sin() as f32);
            }
        }
        self.cos = Tensor::from_vec(c, (n, half), &Device::Cpu)?;
        self.sin = Tensor::from_vec(s, (n, half), &Device::Cpu)?;
        Ok(())
    }

    /// Logits `[n, vocab]` for `tokens` at positions `pos0..pos0+n`, with
    /// K/V kept in `caches` (one per layer, `pos0` tokens long).
    pub fn forward(&mut self, tokens: &[u32], pos0: usize, caches: &mut Caches) -> Result<Tensor> {
        let x = self.hidden(tokens, pos0, caches)?;
        Ok(x.matmul(&self.head)?)
    }

    /// Logits `[1, vocab]` of the last of `tokens` only (a prefill chunk
    /// or a decode step that samples once), otherwise as
    /// [`forward`](Self::forward).
    pub fn forward_last(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        caches: &mut Caches,
    ) -> Result<Tensor> {
        let x = self.hidden(tokens, pos0, caches)?;
        let last = x.narrow(0, tokens.len() - 1, 1)?;
        Ok(last.matmul(&self.head)?)
    }

    /// Final-normed hidden states `[n, d_model]`.
    fn hidden(&mut self, tokens: &[u32], pos0: usize, caches: &mut Caches) -> Result<Tensor> {
        let n = tokens.len();
        if n == 0 {
            return Err(EngineError("forward: no tokens".into()));
        }
        if caches.layers.len() != self.blocks.len() {
            return Err(EngineError(format!(
                "{} caches for {} layers",
                caches.layers.len(),
                self.blocks.len()
            )));
        }
        self.ensure_rope(pos0 + n)?;
        let (cos, sin) = (self.cos.narrow(0, pos0, n)?, self.sin.narrow(0, pos0, n)?);
        let ids = Tensor::from_slice(tokens, n, &Device::Cpu)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let c = &self.cfg;
        let (nh, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let eps = c.rms_eps;
        let scale = 1.0 / (hd as f64).sqrt();
        let rope = |t: &Tensor| match c.rope_style {
            RopeStyle::Adjacent => candle_nn::rotary_emb::rope_i(t, &cos, &sin),
            RopeStyle::Halves => candle_nn::rotary_emb::rope(t, &cos, &sin),
        };
        // [n, heads·hd] → [1, heads, n, hd].
        let heads = |t: Tensor, h: usize| t.reshape((1, n, h, hd))?.transpose(1, 2)?.contiguous();
        for (b, cache) in self.blocks.iter().zip(&mut caches.layers) {
            let h = candle_nn::ops::rms_norm(&x, &b.attn_norm, eps)?;
            let q = rope(&heads(h.matmul(&b.wq)?, nh)?)?;
            let k = rope(&heads(h.matmul(&b.wk)?, nkv)?)?;
            let v = heads(h.matmul(&b.wv)?, nkv)?;
            let y = cache.attend(&q, &k, &v, pos0, scale)?;
            let y = y.transpose(1, 2)?.reshape((n, nh * hd))?;
            x = (x + y.matmul(&b.wo)?)?;
            let h = candle_nn::ops::rms_norm(&x, &b.ffn_norm, eps)?;
            let g = candle_nn::ops::silu(&h.matmul(&b.w_gate)?)?;
            let u = h.matmul(&b.w_up)?;
            x = (x + (g * u)?.matmul(&b.w_down)?)?;
        }
        Ok(candle_nn::ops::rms_norm(&x, &self.out_norm, eps)?)
    }
}

/// One layer's K/V store and the attention that reads it.
pub enum Attention {
    /// candle's cache (K/V in `dtype`, grown 512 tokens at a time), then
    /// attention as candle's Llama writes it: repeat K/V per query group,
    /// `softmax(q·kᵀ·scale + mask)·v`.
    Candle {
        /// The cache.
        cache: KvCache,
        /// What K/V are stored as (`F32` or `F16`).
        dtype: DType,
    },
    /// A kvq cache: the new K/V appended, attention fused on the packed
    /// bytes.
    Kvq(Box<kvq::LayerCache>),
}

impl Attention {
    /// Store the new `k`, `v` (`[1, n_kv, n, hd]`, positions
    /// `pos0..pos0+n`) and attend `q` (`[1, n_heads, n, hd]`) causally over
    /// everything stored; returns `[1, n_heads, n, hd]` f32.
    pub fn attend(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        pos0: usize,
        scale: f64,
    ) -> Result<Tensor> {
        match self {
            Attention::Candle { cache, dtype } => {
                let (k, v) = cache.append(&k.to_dtype(*dtype)?, &v.to_dtype(*dtype)?)?;
                let (nh, n) = (q.dim(1)?, q.dim(2)?);
                let rep = nh / k.dim(1)?;
                let (k, v) = (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?);
                let q = q.to_dtype(*dtype)?;
                let att = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?;
                let att = if n > 1 {
                    att.broadcast_add(&causal_mask(n, pos0)?)?
                } else {
                    att
                };
                let p = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(*dtype)?;
                Ok(p.matmul(&v)?.to_dtype(DType::F32)?)
            }
            Attention::Kvq(cache) => {
                cache.append_tensor(k, v)?;
                Ok(cache.attend_tensor(q)?)
            }
        }
    }

    /// Bytes the cache holds: candle's whole allocation (its tensors grow
    /// in steps of 512 tokens), kvq's [`bytes`](kvq::LayerCache::bytes).
    pub fn bytes(&self) -> usize {
        match self {
            Attention::Candle { cache, .. } => [cache.k_cache(), cache.v_cache()]
                .iter()
                .filter_map(|c| c.all_data().as_ref())
                .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                .sum(),
            Attention::Kvq(c) => c.bytes().total(),
        }
    }
}

/// `[1, nkv, t, hd]` → `[1, nkv·rep, t, hd]`, each KV head repeated for
/// its query group.
fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.contiguous()?);
    }
    let (b, nkv, t, hd) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .expand((b, nkv, rep, t, hd))?
        .reshape((b, nkv * rep, t, hd))?)
}

/// `[n, pos0+n]`: 0 where query `i` (position `pos0+i`) may look, −∞ after.
fn causal_mask(n: usize, pos0: usize) -> Result<Tensor> {
    let t = pos0 + n;
    let m: Vec<f32> = (0..n)
        .flat_map(|i| {
            (0..t).map(move |j| {
                if j <= pos0 + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(m, (n, t), &Device::Cpu)?)
}

/// Every layer's [`Attention`].
pub struct Caches {
    /// One per layer.
    pub layers: Vec<Attention>,
}

impl Caches {
    /// candle's `KvCache` for every layer, K/V stored as `dtype`.
    pub fn candle(cfg: &Config, dtype: DType) -> Self {
        let layers = (0..cfg.n_layers)
            .map(|_| Attention::Candle {
                cache: KvCache::new(2, 512),
                dtype,
            })
            .collect();
        Caches { layers }
    }

    /// A kvq cache of `spec` for every layer (`kvq::CacheConfig`'s shape
    /// and softmax scale are the model's).
    pub fn kvq(cfg: &Config, spec: impl Fn(kvq::CacheConfig) -> kvq::CacheConfig) -> Result<Self> {
        let layers = (0..cfg.n_layers)
            .map(|_| {
                let c = spec(kvq::CacheConfig::new(cfg.n_kv_heads, cfg.head_dim));
                Ok(Attention::Kvq(Box::new(kvq::LayerCache::new(c)?)))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Caches { layers })
    }

    /// Bytes every layer's cache holds.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(Attention::bytes).sum()
    }
}

/// The last row of `logits` (`[n, vocab]`) as a vector.
pub fn last_row(logits: &Tensor) -> Result<Vec<f32>> {
    let n = logits.dim(0)?;
    Ok(logits.get(n - 1)?.to_vec1()?)
}

/// Index of the largest value.
pub fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// The largest `|a − b|` over two logit tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(D::Minus1)?.to_scalar()?)
}
