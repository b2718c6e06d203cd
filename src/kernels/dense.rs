//! Dense (unquantized) decode kernels over `f32` and `f16` caches: the
//! baselines the packed kernels are measured against, and what an engine
//! would run without kvq.
//!
//! They are honest, fast code, not strawmen: the same tiling, accumulator
//! layout and runtime dispatch as the packed kernels, with F16C
//! (`vcvtph2ps`) widening f16 on the fly. A dense decode is bound by memory
//! bandwidth; see `docs/PERFORMANCE.md` for what they reach.
//!
//! Layouts: one KV head, `keys`/`values` `[tokens, head_dim]` row-major;
//! queries `q` and outputs of [`weighted_sum_f32`] `[n_q, head_dim]`;
//! scores and weights `[n_q, tokens]`.
//!
//! # Example: dense scores and weighted sum
//! ```
//! use kvq::kernels::dense;
//! use half::f16;
//! let hd = 64;
//! let keys: Vec<f16> = (0..10 * hd).map(|i| f16::from_f32((i % 7) as f32 - 3.0)).collect();
//! let q = vec![0.25f32; hd];
//! let mut s = vec![0.0; 10];
//! dense::scores_f16(hd, &keys, &q, &mut s)?;
//! let want: f32 = keys[..hd].iter().map(|k| k.to_f32() * 0.25).sum();
//! assert!((s[0] - want).abs() < 1e-5);
//! let mut out = vec![0.0; hd];
//! dense::weighted_sum_f16(hd, &keys, &[0.1; 10], &mut out)?;
//! # Ok::<(), kvq::Error>(())
//! ```

use super::{portable, Backend};
use crate::error::{Error, Result};
use crate::simd::Kernel;
use half::f16;

/// `out[i·tokens + t] = q_i · keys_t` for `f32` keys `[tokens, head_dim]`
/// and queries `q = [n_q, head_dim]`, on [`Backend::detect`].
///
/// # Errors
/// [`Error::InvalidShape`] for `head_dim == 0`; [`Error::Length`] when
/// `keys` or `q` is not a multiple of `head_dim` (or `q` is empty), or
/// `out.len() != n_q·tokens`.
pub fn scores_f32(head_dim: usize, keys: &[f32], q: &[f32], out: &mut [f32]) -> Result<()> {
    scores_f32_on(Backend::detect(), head_dim, keys, q, out)
}

/// [`scores_f32`] on a chosen backend (portable when the CPU lacks it).
///
/// # Errors
/// As [`scores_f32`].
pub fn scores_f32_on(
    backend: Backend,
    head_dim: usize,
    keys: &[f32],
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    scores_impl(backend, head_dim, keys, q, out)
}

/// [`scores_f32`] for `f16` keys (widened with F16C where available).
///
/// # Errors
/// As [`scores_f32`].
pub fn scores_f16(head_dim: usize, keys: &[f16], q: &[f32], out: &mut [f32]) -> Result<()> {
    scores_f16_on(Backend::detect(), head_dim, keys, q, out)
}

/// [`scores_f16`] on a chosen backend.
///
/// # Errors
/// As [`scores_f32`].
pub fn scores_f16_on(
    backend: Backend,
    head_dim: usize,
    keys: &[f16],
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    scores_impl(backend, head_dim, keys, q, out)
}

/// `out_i += Σ_t p[i·tokens + t] · values_t` (accumulates) for `f32`
/// values `[tokens, head_dim]`, weights `p = [n_q, tokens]` and
/// `out = [n_q, head_dim]`, on [`Backend::detect`].
///
/// # Errors
/// [`Error::InvalidShape`] for `head_dim == 0`; [`Error::Length`] when
/// `values` or `out` is not a multiple of `head_dim` (or `out` is empty), or
/// `p.len() != n_q·tokens`.
pub fn weighted_sum_f32(head_dim: usize, values: &[f32], p: &[f32], out: &mut [f32]) -> Result<()> {
    weighted_sum_f32_on(Backend::detect(), head_dim, values, p, out)
}

/// [`weighted_sum_f32`] on a chosen backend.
///
/// # Errors
/// As [`weighted_sum_f32`].
pub fn weighted_sum_f32_on(
    backend: Backend,
    head_dim: usize,
    values: &[f32],
    p: &[f32],
    out: &mut [f32],
) -> Result<()> {
    weighted_sum_impl(backend, head_dim, values, p, out)
}

/// [`weighted_sum_f32`] for `f16` values.
///
/// # Errors
/// As [`weighted_sum_f32`].
pub fn weighted_sum_f16(head_dim: usize, values: &[f16], p: &[f32], out: &mut [f32]) -> Result<()> {
    weighted_sum_f16_on(Backend::detect(), head_dim, values, p, out)
}

/// [`weighted_sum_f16`] on a chosen backend.
///
/// # Errors
/// As [`weighted_sum_f32`].
pub fn weighted_sum_f16_on(
    backend: Backend,
    head_dim: usize,
    values: &[f16],
    p: &[f32],
    out: &mut [f32],
) -> Result<()> {
    weighted_sum_impl(backend, head_dim, values, p, out)
}

/// The element types of a dense cache.
trait Elem: Copy {
    fn f(self) -> f32;
}
impl Elem for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
}
impl Elem for f16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
}

/// Check `[tokens, hd]` data and `[n_q, hd]` vectors; returns
/// `(tokens, n_q)`.
fn shape(
    op: &'static str,
    hd: usize,
    data: usize,
    vecs: usize,
    what: &'static str,
) -> Result<(usize, usize)> {
    if hd == 0 {
        return Err(Error::InvalidShape {
            op,
            what: "head_dim must be at least 1".into(),
        });
    }
    if !data.is_multiple_of(hd) {
        return Err(Error::Length {
            op,
            what: "cache values (a multiple of head_dim)",
            expected: data / hd * hd,
            got: data,
        });
    }
    if vecs == 0 || !vecs.is_multiple_of(hd) {
        return Err(Error::Length {
            op,
            what,
            expected: hd * (vecs / hd).max(1),
            got: vecs,
        });
    }
    Ok((data / hd, vecs / hd))
}

fn scores_impl<E: Elem + X86Elem>(
    backend: Backend,
    hd: usize,
    k: &[E],
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let op = "dense::scores";
    let (t, _) = shape(
        op,
        hd,
        k.len(),
        q.len(),
        "query values (a positive multiple of head_dim)",
    )?;
    crate::quant::check_len(op, "output logits", q.len() / hd * t, out.len())?;
    backend.dispatch(Dense {
        sum: false,
        hd,
        rows: k,
        x: q,
        out,
    });
    Ok(())
}

fn weighted_sum_impl<E: Elem + X86Elem>(
    backend: Backend,
    hd: usize,
    v: &[E],
    p: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let op = "dense::weighted_sum";
    let (t, nq) = shape(
        op,
        hd,
        v.len(),
        out.len(),
        "output values (a positive multiple of head_dim)",
    )?;
    crate::quant::check_len(op, "weights", nq * t, p.len())?;
    backend.dispatch(Dense {
        sum: true,
        hd,
        rows: v,
        x: p,
        out,
    });
    Ok(())
}

/// A dense kernel over `[tokens, hd]` rows, lengths already checked:
/// scores (`x` the queries, `out` the logits) or, with `sum`, the weighted
/// sum (`x` the weights, `out` the accumulated outputs).
struct Dense<'a, E> {
    sum: bool,
    hd: usize,
    rows: &'a [E],
    x: &'a [f32],
    out: &'a mut [f32],
}

impl<E: Elem + X86Elem> Kernel for Dense<'_, E> {
    type Output = ();

    fn portable(self) {
        let Dense {
            sum,
            hd,
            rows,
            x,
            out,
        } = self;
        let t = rows.len() / hd;
        let nq = if sum { out.len() } else { x.len() } / hd;
        let mut row = vec![0f32; hd];
        for tt in 0..t {
            for (r, v) in row.iter_mut().zip(&rows[tt * hd..(tt + 1) * hd]) {
                *r = v.f();
            }
            for i in 0..nq {
                if sum {
                    portable::axpy(x[i * t + tt], &row, &mut out[i * hd..(i + 1) * hd]);
                } else {
                    out[i * t + tt] = portable::dot(&x[i * hd..(i + 1) * hd], &row);
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: super::x86_64::Simd>(self, s: S) {
        use super::x86_64::generic;
        if self.sum {
            generic::dense_weighted_sum(s, self.hd, self.rows, self.x, self.out)
        } else {
            generic::dense_scores(s, self.hd, self.rows, self.x, self.out)
        }
    }
}

/// The element's SIMD loader (identity on other architectures).
#[cfg(target_arch = "x86_64")]
use super::x86_64::DenseElem as X86Elem;
#[cfg(not(target_arch = "x86_64"))]
trait X86Elem {}
#[cfg(not(target_arch = "x86_64"))]
impl X86Elem for f32 {}
#[cfg(not(target_arch = "x86_64"))]
impl X86Elem for f16 {}
