//! [`candle_core::Tensor`] in and out of a [`LayerCache`] (feature
//! `candle`).
//!
//! Two layouts are taken, told apart by their rank:
//! - `[tokens, heads, head_dim]`, kvq's own row layout, read in place;
//! - `[1, heads, tokens, head_dim]`, the `[batch, heads, seq, head_dim]`
//!   layout of candle's attention code (batch 1: a cache is one sequence),
//!   read with one transposing copy when it holds more than one token.
//!
//! Tensors must be contiguous, on the CPU, and of dtype `f32`, `f16` or
//! `bf16`; anything else is an [`Error::InvalidArgument`] naming what was
//! passed. Attention outputs come back in the query's layout and dtype.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use kvq::{presets, CacheConfig, LayerCache};
//! let (keys, values) = presets::kivi(4)?;
//! let mut cache = LayerCache::new(CacheConfig::new(2, 64).keys(keys).values(values))?;
//! let dev = Device::Cpu;
//! // A 40-token prompt in candle's [batch, kv_heads, seq, head_dim] layout.
//! let k = Tensor::randn(0f32, 1.0, (1, 2, 40, 64), &dev).unwrap();
//! let v = Tensor::randn(0f32, 1.0, (1, 2, 40, 64), &dev).unwrap();
//! cache.append_tensor(&k, &v)?;
//! // One decode step: 8 query heads (GQA 4), bf16.
//! let q = Tensor::randn(0f32, 1.0, (1, 8, 1, 64), &dev).unwrap().to_dtype(DType::BF16).unwrap();
//! let out = cache.attend_tensor(&q)?;
//! assert_eq!(out.dims(), &[1, 8, 1, 64]);
//! assert_eq!(out.dtype(), DType::BF16);
//! # Ok::<(), kvq::Error>(())
//! ```

use std::borrow::Cow;

use candle_core::{DType, Device, Tensor, WithDType};

use crate::cache::LayerCache;
use crate::error::{Error, Result};

/// Which of the two layouts a tensor is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// `[tokens, heads, head_dim]`.
    Rows,
    /// `[1, heads, tokens, head_dim]`.
    Heads,
}

/// A tensor's tokens, as `[tokens, heads·head_dim]` rows.
struct Rows<'a, T: Clone> {
    data: Cow<'a, [T]>,
    tokens: usize,
    order: Order,
}

fn bad(op: &'static str, what: String) -> Error {
    Error::InvalidArgument { op, what }
}

/// The shape `t` must have: `[tokens, heads, hd]` or `[1, heads, tokens,
/// hd]`; returns the order and the token count.
fn shape_of(
    op: &'static str,
    what: &str,
    t: &Tensor,
    heads: usize,
    hd: usize,
) -> Result<(Order, usize)> {
    match *t.dims() {
        [n, h, d] if h == heads && d == hd => Ok((Order::Rows, n)),
        [1, h, n, d] if h == heads && d == hd => Ok((Order::Heads, n)),
        _ => Err(Error::InvalidShape {
            op,
            what: format!(
                "{what} have shape {:?}, expected [tokens, {heads}, {hd}] or [1, {heads}, tokens, {hd}]",
                t.dims()
            ),
        }),
    }
}

/// `t`'s elements as `[tokens, heads·hd]` rows: in place for the row
/// layout, transposed into a copy for the heads layout.
fn rows<'a, T: WithDType>(
    op: &'static str,
    what: &str,
    t: &'a Tensor,
    heads: usize,
    hd: usize,
    storage: &'a candle_core::CpuStorage,
) -> Result<Rows<'a, T>> {
    let (order, tokens) = shape_of(op, what, t, heads, hd)?;
    let all = storage
        .as_slice::<T>()
        .map_err(|e| bad(op, format!("{what}: {e}")))?;
    let (a, b) = t.layout().contiguous_offsets().ok_or_else(|| {
        bad(
            op,
            format!("{what} are not contiguous (call .contiguous() first)"),
        )
    })?;
    let flat = &all[a..b];
    let data = if order == Order::Rows || tokens <= 1 {
        Cow::Borrowed(flat)
    } else {
        let mut out = Vec::with_capacity(flat.len());
        for t in 0..tokens {
            for h in 0..heads {
                out.extend_from_slice(&flat[(h * tokens + t) * hd..][..hd]);
            }
        }
        Cow::Owned(out)
    };
    Ok(Rows {
        data,
        tokens,
        order,
    })
}

/// The dtype check every entry point makes, with the tensor's device.
fn check_tensor(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if !matches!(t.device(), Device::Cpu) {
        return Err(bad(
            op,
            format!(
                "{what} are on {:?}; kvq's kernels run on the CPU",
                t.device().location()
            ),
        ));
    }
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(bad(
            op,
            format!(
                "{what} have dtype {:?}; kvq takes f32, f16 or bf16",
                t.dtype()
            ),
        ));
    }
    Ok(())
}

/// Run `f` on `t`'s rows in its own element type.
fn with_rows<R>(
    op: &'static str,
    what: &str,
    t: &Tensor,
    heads: usize,
    hd: usize,
    f: impl FnOnce(RowsOf<'_>) -> Result<R>,
) -> Result<R> {
    check_tensor(op, what, t)?;
    let (storage, _) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(bad(op, format!("{what} are not in CPU storage")));
    };
    match t.dtype() {
        DType::F32 => f(RowsOf::F32(rows(op, what, t, heads, hd, cpu)?)),
        DType::F16 => f(RowsOf::F16(rows(op, what, t, heads, hd, cpu)?)),
        DType::BF16 => f(RowsOf::Bf16(rows(op, what, t, heads, hd, cpu)?)),
        _ => unreachable!("check_tensor admits these three"),
    }
}

/// Rows of one of the three element types.
enum RowsOf<'a> {
    F32(Rows<'a, f32>),
    F16(Rows<'a, half::f16>),
    Bf16(Rows<'a, half::bf16>),
}

/// Call `$body` with `$r` bound to the rows of whichever type `$x` holds.
macro_rules! each_type {
    ($x:expr, $r:ident => $body:expr) => {
        match $x {
            RowsOf::F32($r) => $body,
            RowsOf::F16($r) => $body,
            RowsOf::Bf16($r) => $body,
        }
    };
}

impl LayerCache {
    /// [`extend`](Self::extend) from candle tensors: `k` and `v` are
    /// `[tokens, n_kv_heads, head_dim]` or `[1, n_kv_heads, tokens,
    /// head_dim]` (see the [module docs](crate::candle)), the same layout
    /// and dtype for both.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a tensor off the CPU, of another
    /// dtype or not contiguous, or when `k` and `v` differ in dtype or
    /// layout; [`Error::InvalidShape`] for any other shape or differing
    /// token counts; otherwise as [`extend`](Self::extend). Nothing is
    /// stored on error.
    pub fn append_tensor(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let op = "append_tensor";
        let (n_kv, hd) = (self.config().n_kv_heads(), self.config().head_dim());
        if k.dtype() != v.dtype() {
            return Err(bad(
                op,
                format!("keys are {:?} but values {:?}", k.dtype(), v.dtype()),
            ));
        }
        let ks = shape_of(op, "keys", k, n_kv, hd)?;
        if shape_of(op, "values", v, n_kv, hd)? != ks {
            return Err(Error::InvalidShape {
                op,
                what: format!("keys have shape {:?} but values {:?}", k.dims(), v.dims()),
            });
        }
        with_rows(op, "keys", k, n_kv, hd, |kr| {
            with_rows(op, "values", v, n_kv, hd, |vr| match (kr, vr) {
                (RowsOf::F32(a), RowsOf::F32(b)) => self.extend(&a.data, &b.data),
                (RowsOf::F16(a), RowsOf::F16(b)) => self.extend(&a.data, &b.data),
                (RowsOf::Bf16(a), RowsOf::Bf16(b)) => self.extend(&a.data, &b.data),
                _ => unreachable!("the dtypes were compared above"),
            })
        })
    }

    /// [`attend_causal`](Self::attend_causal) with a candle query tensor:
    /// `q` is `[n, n_q_heads, head_dim]` or `[1, n_q_heads, n, head_dim]`
    /// for the last `n` cached positions (`n = 1`: a decode step, what
    /// [`attend`](Self::attend) computes). The output has `q`'s shape and
    /// dtype.
    ///
    /// # Errors
    /// As [`append_tensor`](Self::append_tensor) for the tensor itself,
    /// and as [`attend_causal`](Self::attend_causal).
    pub fn attend_tensor(&self, q: &Tensor) -> Result<Tensor> {
        self.attend_causal_tensor(q, None)
    }

    /// [`attend_tensor`](Self::attend_tensor) with a sliding `window`
    /// (each query sees at most its last `window` positions).
    ///
    /// # Errors
    /// As [`attend_tensor`](Self::attend_tensor).
    pub fn attend_causal_tensor(&self, q: &Tensor, window: Option<usize>) -> Result<Tensor> {
        let op = "attend_tensor";
        let hd = self.config().head_dim();
        let n_q = match *q.dims() {
            [_, h, _] | [1, h, _, _] => h,
            _ => 0,
        };
        if n_q == 0 {
            return Err(Error::InvalidShape {
                op,
                what: format!(
                    "queries have shape {:?}, expected [n, n_q_heads, {hd}] or [1, n_q_heads, n, {hd}]",
                    q.dims()
                ),
            });
        }
        let (out, order, n) = with_rows(op, "queries", q, n_q, hd, |qr| {
            each_type!(qr, r => {
                let mut out = vec![0f32; r.data.len()];
                self.attend_causal(&r.data[..], n_q, &mut out, window)?;
                Ok((out, r.order, r.tokens))
            })
        })?;
        let tensor = |t: candle_core::Result<Tensor>| t.map_err(|e| bad(op, e.to_string()));
        let t = tensor(Tensor::from_vec(out, (n, n_q, hd), &Device::Cpu))?;
        let t = match order {
            Order::Rows => t,
            Order::Heads if n == 1 => tensor(t.reshape((1, n_q, 1, hd)))?,
            Order::Heads => tensor(t.transpose(0, 1).and_then(|t| t.contiguous()))
                .and_then(|t| tensor(t.unsqueeze(0)))?,
        };
        tensor(t.to_dtype(q.dtype()))
    }

    /// Keys as candle's `[1, n_kv_heads, len, head_dim]` f32 tensor: what
    /// attention reads ([`keys_f32`](Self::keys_f32)), for a caller that
    /// runs its own attention over the whole cache (prefill with a fused
    /// SDPA, say).
    ///
    /// # Errors
    /// Only if candle cannot build the tensor.
    pub fn keys_tensor(&self) -> Result<Tensor> {
        heads_tensor(self, self.keys_f32())
    }

    /// Values as [`keys_tensor`](Self::keys_tensor) gives keys.
    ///
    /// # Errors
    /// As [`keys_tensor`](Self::keys_tensor).
    pub fn values_tensor(&self) -> Result<Tensor> {
        heads_tensor(self, self.values_f32())
    }
}

/// `[len, n_kv, hd]` rows as a `[1, n_kv, len, hd]` tensor.
fn heads_tensor(c: &LayerCache, rows: Vec<f32>) -> Result<Tensor> {
    let (n_kv, hd) = (c.config().n_kv_heads(), c.config().head_dim());
    let len = rows.len() / (n_kv * hd).max(1);
    Tensor::from_vec(rows, (len, n_kv, hd), &Device::Cpu)
        .and_then(|t| t.transpose(0, 1)?.contiguous()?.unsqueeze(0))
        .map_err(|e| bad("keys_tensor", e.to_string()))
}
