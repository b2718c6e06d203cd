//! The [`KvQuantizer`] trait and the uniform integer quantizer.
//!
//! # The math
//!
//! Every stored element is `x̂ = scale·code + zero`, with `code` an unsigned
//! integer of `bits` bits and one `(scale, zero)` per group.
//!
//! * **Asymmetric**: `zero = ⌊min⌋_fmt` (the group minimum rounded *down*
//!   into the scale format), `scale = ⌈(max − zero)/(2^bits − 1)⌉_fmt`
//!   (rounded *up*), `code = clamp(round((x − zero)/scale), 0, 2^bits − 1)`.
//! * **Symmetric**: `scale = ⌈absmax/(2^(bits−1) − 1)⌉_fmt`,
//!   `c = clamp(round(x/scale), −(2^(bits−1)−1), 2^(bits−1)−1)`, stored as
//!   `code = c + 2^(bits−1)`; the zero is implied, `zero = −scale·2^(bits−1)`.
//!
//! Quantization uses the scale and zero **as stored** (after rounding to the
//! scale format), so dequantization and the fused kernels see exactly the
//! numbers the quantizer assumed. Because the scale is rounded up and the
//! zero down, every element of the group lies inside the grid: the error of
//! each element is at most **half a step**, `scale/2`, plus the f32 rounding
//! of computing the code and evaluating `scale·code + zero` — a few ulps of
//! the group's magnitude `|zero| + scale·(2^bits − 1)` (not of the element:
//! an element near 0 in a group spanning ±1000 carries about `ulp(1000)`),
//! and at most 2^-149 more in f32's subnormal range. The scale format's
//! rounding only makes the step slightly larger, never leaves an element
//! outside the grid.
//!
//! An asymmetric group whose values are all equal has `scale = 0` and
//! reconstructs exactly when its value is representable in the scale format
//! (always for f32 scales, and for 0). Otherwise `zero = ⌊value⌋_fmt` and
//! `d = value − zero < ulp_fmt(value)`, so the error is at most half of
//! `scale = ⌈d/(2^bits − 1)⌉_fmt`: below `ulp_fmt(value)/2`, and about
//! `ulp_fmt(value)/(2^bits − 1)/2` unless that is below the format's
//! smallest subnormal. A constant symmetric group is no special case.
//!
//! Non-finite input (NaN, ±inf) is rejected with [`Error::NonFinite`]
//! naming token, head and channel; a group whose scale or zero falls outside
//! the scale format's range (|x| beyond 65504 with f16 scales), or whose
//! grid `zero + scale·(2^bits − 1)` overflows f32 (a range near `f32::MAX`),
//! is rejected with [`Error::ScaleOverflow`]. In both cases nothing is
//! produced.

use crate::element::{as_f32, Element};
use crate::error::{Error, Result};
use crate::scheme::{Axis, Layout, Mode, QuantScheme, Rounding, ScaleFormat};
use crate::simd::Backend;
use crate::simd::Kernel;
use crate::store::PackedBlock;
use crate::views::{check_tail, contiguous};
use ndarray::{Array3, ArrayView3};

pub mod codebook;
pub mod codec;
pub mod fp8;
pub mod outliers;
pub mod rotation;

pub use codebook::{CodebookCodec, FittedLevels, Levels};
pub use codec::{Codec, KvCodec, Pending, Rotated, Rotation, UniformCodec};
pub use outliers::{Sparse, OUTLIER_LIMIT};
pub use rotation::Hadamard;

/// A quantizer of K or V blocks `[tokens, n_kv_heads, head_dim]`.
///
/// One trait for every kind of quantizer (uniform integer today; rotations,
/// codebooks and fp8 later), so that caches, metrics and the planner take
/// any of them.
pub trait KvQuantizer {
    /// The packed form this quantizer produces.
    type Packed;

    /// KV heads of the blocks it takes.
    fn n_kv_heads(&self) -> usize;
    /// Channels per head.
    fn head_dim(&self) -> usize;
    /// Bits per element including scale/zero overhead.
    fn effective_bits(&self) -> f64;
    /// A short name for tables.
    fn label(&self) -> String;

    /// Quantize `tokens` tokens of `x`, laid out `[tokens, n_kv_heads,
    /// head_dim]` row-major.
    ///
    /// # Errors
    /// [`Error::Length`] when `x.len() != tokens·n_kv_heads·head_dim`,
    /// [`Error::NonFinite`] for NaN/inf input, [`Error::ScaleOverflow`] when
    /// a scale does not fit its format.
    fn quantize<T: Element>(&self, x: &[T], tokens: usize) -> Result<Self::Packed>;

    /// Dequantize into `out`, `[tokens, n_kv_heads, head_dim]` row-major.
    ///
    /// # Errors
    /// [`Error::Length`] when `out` has the wrong length,
    /// [`Error::SchemeShape`] when `packed` was made for another layout.
    fn dequantize(&self, packed: &Self::Packed, out: &mut [f32]) -> Result<()>;

    /// Quantize then dequantize: what the cache will hand to attention.
    ///
    /// # Errors
    /// As [`quantize`](Self::quantize).
    fn roundtrip<T: Element>(&self, x: &[T], tokens: usize) -> Result<Vec<f32>> {
        let p = self.quantize(x, tokens)?;
        let mut out = vec![0.0; tokens * self.n_kv_heads() * self.head_dim()];
        self.dequantize(&p, &mut out)?;
        Ok(out)
    }

    /// [`quantize`](Self::quantize) of an ndarray view `[tokens,
    /// n_kv_heads, head_dim]`; `tokens` is the view's first dimension.
    ///
    /// Any strides work. A view in standard layout (row-major and
    /// contiguous) is read in place with no copy; any other (transposed,
    /// sliced with a step, permuted) is first copied into one contiguous
    /// buffer of `tokens·n_kv_heads·head_dim` elements. The packed bytes are
    /// those of `quantize` of the same numbers.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the last two dimensions are not
    /// `[n_kv_heads, head_dim]`; otherwise as [`quantize`](Self::quantize).
    ///
    /// # Example
    /// ```
    /// use kvq::{presets, KvQuantizer, UniformQuantizer};
    /// use ndarray::Array3;
    /// let (keys, _) = presets::kivi(4)?;
    /// let q = UniformQuantizer::new(keys, 2, 64)?;
    /// let k = Array3::from_shape_fn((32, 2, 64), |(t, h, c)| ((t * 7 + h + c) % 13) as f32 / 13.0);
    /// let packed = q.quantize_view(k.view())?;
    /// assert_eq!(packed, q.quantize(k.as_slice().unwrap(), 32)?);
    /// let back = packed.dequantize_array(); // [32, 2, 64]
    /// assert_eq!(back, q.roundtrip_view(k.view())?);
    /// assert!(back.iter().zip(&k).all(|(a, b)| (a - b).abs() <= 0.5 / 15.0 + 1e-6));
    /// # Ok::<(), kvq::Error>(())
    /// ```
    fn quantize_view<T: Element>(&self, x: ArrayView3<'_, T>) -> Result<Self::Packed> {
        let op = "quantize_view";
        let tail = [self.n_kv_heads(), self.head_dim()];
        check_tail(op, "the input has", x.shape(), &tail, VIEW3)?;
        let mut buf = Vec::new();
        self.quantize(contiguous(&x, &mut buf), x.dim().0)
    }

    /// [`roundtrip`](Self::roundtrip) of an ndarray view `[tokens,
    /// n_kv_heads, head_dim]` (strides as in
    /// [`quantize_view`](Self::quantize_view)), returned as an array of the
    /// same shape.
    ///
    /// # Errors
    /// As [`quantize_view`](Self::quantize_view).
    fn roundtrip_view<T: Element>(&self, x: ArrayView3<'_, T>) -> Result<Array3<f32>> {
        let op = "roundtrip_view";
        let tail = [self.n_kv_heads(), self.head_dim()];
        check_tail(op, "the input has", x.shape(), &tail, VIEW3)?;
        let mut buf = Vec::new();
        let out = self.roundtrip(contiguous(&x, &mut buf), x.dim().0)?;
        Ok(Array3::from_shape_vec(x.raw_dim(), out).expect("roundtrip keeps the shape"))
    }
}

/// The dimensions of a K or V block, as error messages name them.
const VIEW3: &str = "[tokens, n_kv_heads, head_dim]";

/// The uniform integer quantizer of a [`QuantScheme`] (any bits, axis,
/// group, mode and scale format).
///
/// # Example: quantize a key block per-channel
/// ```
/// use kvq::{Axis, Group, KvQuantizer, QuantScheme, UniformQuantizer};
/// let scheme = QuantScheme::new(4, Axis::PerChannel, Group::Size(32))?;
/// let q = UniformQuantizer::new(scheme, 2, 64)?; // 2 KV heads, head_dim 64
/// let keys: Vec<f32> = (0..32 * 2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
/// let packed = q.quantize(&keys, 32)?;
/// assert_eq!(packed.bytes(), scheme.layout(2, 64)?.bytes(32));
/// let back = q.roundtrip(&keys, 32)?;
/// let worst = keys.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
/// assert!(worst < 2.0 / 15.0 / 2.0 + 1e-3); // half a step of a range-2 group
/// # Ok::<(), kvq::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UniformQuantizer {
    layout: Layout,
}

impl UniformQuantizer {
    /// A quantizer of `scheme` for blocks with this shape.
    ///
    /// # Errors
    /// As [`QuantScheme::layout`].
    pub fn new(scheme: QuantScheme, n_kv_heads: usize, head_dim: usize) -> Result<Self> {
        Ok(UniformQuantizer {
            layout: scheme.layout(n_kv_heads, head_dim)?,
        })
    }
    /// From a layout.
    pub fn from_layout(layout: Layout) -> Self {
        UniformQuantizer { layout }
    }
    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// [`KvQuantizer::quantize`] with its loops compiled for `backend`
    /// (the portable one when the CPU lacks it). The packed bytes are
    /// identical on every backend; only the speed differs.
    ///
    /// # Errors
    /// As [`KvQuantizer::quantize`].
    pub fn quantize_on<T: Element>(
        &self,
        backend: Backend,
        x: &[T],
        tokens: usize,
    ) -> Result<PackedBlock> {
        let l = &self.layout;
        let width = l.n_kv_heads() * l.head_dim();
        crate::store::check_fits("quantize", l, tokens)?;
        let want = tokens
            .checked_mul(width)
            .ok_or_else(|| Error::InvalidShape {
                op: "quantize",
                what: format!("{tokens} tokens of {width} values do not fit in memory"),
            })?;
        check_len("quantize", "values", want, x.len())?;
        let mut buf = Vec::new();
        let xf = as_f32(x, &mut buf);
        // Finiteness is checked while each group's or block's min/max is
        // taken (the first non-finite value in token order is reported).
        let mut block = PackedBlock::zeroed(*l, tokens);
        match l.scheme().axis() {
            Axis::PerToken => {
                let mut codes = vec![0u8; l.n_kv_heads() * l.row_bytes()];
                let mut params = vec![0u8; l.param_bytes(1)];
                for t in 0..tokens {
                    quantize_token(
                        backend,
                        l,
                        &xf[t * width..(t + 1) * width],
                        t,
                        &mut codes,
                        &mut params,
                    )?;
                    block.put_token(t, &codes, &params);
                }
            }
            Axis::PerChannel => {
                let g = l.group_len();
                let mut t0 = 0;
                while t0 < tokens {
                    let tb = g.min(tokens - t0);
                    let rows = &xf[t0 * width..(t0 + tb) * width];
                    for h in 0..l.n_kv_heads() {
                        let (codes, params) = block.channel_block_mut(h, t0 / g, tb);
                        quantize_channel_block(backend, l, rows, tb, h, t0, codes, params)?;
                    }
                    t0 += tb;
                }
            }
        }
        Ok(block)
    }
}

impl KvQuantizer for UniformQuantizer {
    type Packed = PackedBlock;

    fn n_kv_heads(&self) -> usize {
        self.layout.n_kv_heads()
    }
    fn head_dim(&self) -> usize {
        self.layout.head_dim()
    }
    fn effective_bits(&self) -> f64 {
        self.layout.effective_bits()
    }
    fn label(&self) -> String {
        self.layout.scheme().label()
    }

    fn quantize<T: Element>(&self, x: &[T], tokens: usize) -> Result<PackedBlock> {
        self.quantize_on(Backend::detect(), x, tokens)
    }

    fn dequantize(&self, packed: &PackedBlock, out: &mut [f32]) -> Result<()> {
        if packed.layout() != &self.layout {
            return Err(Error::SchemeShape {
                op: "dequantize",
                what: "packed block was made with another scheme or shape".into(),
            });
        }
        packed.dequantize_into(out)
    }
}

/// How many rows of `unit` values `len` holds, or [`Error::Length`] when
/// it is not a positive multiple of `unit` (`what` names the values and
/// the rule, e.g. "query values (a positive multiple of head_dim)").
pub(crate) fn check_rows(
    op: &'static str,
    what: &'static str,
    len: usize,
    unit: usize,
) -> Result<usize> {
    if len == 0 || !len.is_multiple_of(unit) {
        return Err(Error::Length {
            op,
            what,
            expected: unit * (len / unit).max(1),
            got: len,
        });
    }
    Ok(len / unit)
}

pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<()> {
    if expected != got {
        return Err(Error::Length {
            op,
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// First non-finite element of token-major `x` as an error.
pub(crate) fn check_finite(
    op: &'static str,
    x: &[f32],
    n_heads: usize,
    head_dim: usize,
    token0: usize,
) -> Result<()> {
    // Fast scan in chunks (vectorizes), then find the first culprit.
    let all_finite = x
        .chunks(256)
        .all(|c| c.iter().fold(true, |ok, v| ok & v.is_finite()));
    if all_finite {
        return Ok(());
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        let width = n_heads * head_dim;
        return Err(Error::NonFinite {
            op,
            token: token0 + i / width,
            head: (i % width) / head_dim,
            channel: i % head_dim,
            value: x[i],
        });
    }
    Ok(())
}

/// `(scale, zero)` of a group as stored, or which one overflowed.
#[inline(always)]
pub(crate) fn group_params(
    scheme: &QuantScheme,
    min: f32,
    max: f32,
) -> std::result::Result<(f32, f32), (&'static str, f32)> {
    let fmt = scheme.scale_format();
    let bits = scheme.bits() as i32;
    if scheme.rounding() == Rounding::Ggml {
        // Whether a group overflows depends on magnitudes only, so the
        // larger-magnitude end stands for ggml's first element of largest
        // magnitude.
        let m = if max.abs() >= min.abs() { max } else { min };
        return ggml_params(scheme, min, max, m).map(|p| (p.0, p.1));
    }
    match scheme.mode() {
        Mode::Asymmetric => {
            let zero = fmt.round_down(min as f64);
            if !zero.is_finite() {
                return Err(("zero", min));
            }
            let levels = ((1u32 << bits) - 1) as f64;
            let scale = fmt.round_up((max as f64 - zero as f64) / levels);
            // The top of the grid must be an f32 too (a range beyond f32::MAX).
            if !scale.is_finite() || !(scale * levels as f32 + zero).is_finite() {
                return Err(("scale", ((max as f64 - zero as f64) / levels) as f32));
            }
            Ok((scale, zero))
        }
        Mode::Symmetric => {
            let absmax = min.abs().max(max.abs()) as f64;
            let qmax = ((1u32 << (bits - 1)) - 1) as f64;
            let scale = fmt.round_up(absmax / qmax);
            let zero = -scale * (1u32 << (bits - 1)) as f32;
            let top = scale * ((1u32 << bits) - 1) as f32;
            if !scale.is_finite() || !zero.is_finite() || !top.is_finite() {
                return Err(("scale", (absmax / qmax) as f32));
            }
            Ok((scale, zero))
        }
    }
}

/// ggml's params of a group with range `min..=max` and first element of
/// largest magnitude `m` ([`Rounding::Ggml`]): `(scale, zero)` as stored
/// (nearest f16) and the unrounded `d` the codes are computed with.
pub(crate) fn ggml_params(
    s: &QuantScheme,
    min: f32,
    max: f32,
    m: f32,
) -> std::result::Result<(f32, f32, f32), (&'static str, f32)> {
    let nearest = |v: f32| half::f16::from_f32(v).to_f32();
    let b = s.bits() as u32;
    let d = match (s.mode(), b) {
        (Mode::Symmetric, 8) => m.abs() / 127.0,
        (Mode::Symmetric, _) => m / -((1u32 << (b - 1)) as f32),
        (Mode::Asymmetric, _) => (max - min) / ((1u32 << b) - 1) as f32,
    };
    let sc = nearest(d);
    if !sc.is_finite() {
        return Err(("scale", d));
    }
    let zero = match s.mode() {
        Mode::Symmetric => -sc * (1u32 << (b - 1)) as f32,
        Mode::Asymmetric => nearest(min),
    };
    if !zero.is_finite() {
        return Err(("zero", min));
    }
    Ok((sc, zero, d))
}

/// One group quantized as ggml's reference quantizer does
/// ([`Rounding::Ggml`]): codes into `out`, `(scale, zero)` as stored.
fn ggml_group(
    s: &QuantScheme,
    xs: &[f32],
    out: &mut [u8],
) -> std::result::Result<(f32, f32), (&'static str, f32)> {
    let b = s.bits() as u32;
    let top = ((1u32 << b) - 1) as i32;
    // ggml's scans: the first element of largest magnitude, and min/max
    // from ±FLT_MAX.
    let (mut amax, mut m) = (0f32, 0f32);
    let (mut lo, mut hi) = (f32::MAX, -f32::MAX);
    for &v in xs {
        if amax < v.abs() {
            amax = v.abs();
            m = v;
        }
        lo = if v < lo { v } else { lo };
        hi = if v > hi { v } else { hi };
    }
    let (sc, zero, d) = ggml_params(s, lo, hi, m)?;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    match (s.mode(), b) {
        (Mode::Symmetric, 8) => {
            for (c, &v) in out.iter_mut().zip(xs) {
                *c = ((v * id).round() as i32 + 128) as u8;
            }
        }
        (Mode::Symmetric, _) => {
            let bias = (1u32 << (b - 1)) as f32 + 0.5;
            for (c, &v) in out.iter_mut().zip(xs) {
                *c = ((v * id + bias) as i8 as i32).min(top) as u8;
            }
        }
        (Mode::Asymmetric, _) => {
            for (c, &v) in out.iter_mut().zip(xs) {
                *c = (((v - lo) * id + 0.5) as i8 as i32).min(top) as u8;
            }
        }
    }
    Ok((sc, zero))
}

/// [`quantize_token_generic`] for [`Rounding::Ggml`] schemes (per-token
/// groups of 32, f16 params): ggml's scalar reference loops, group by group.
fn ggml_token(
    l: &Layout,
    x: &[f32],
    token: usize,
    codes: &mut [u8],
    params: &mut [u8],
    tmp: &mut [u8],
) -> Result<()> {
    if !x.iter().all(|v| v.is_finite()) {
        return Err(nonfinite(l, x, token));
    }
    let s = l.scheme();
    let fmt = s.scale_format();
    let (hd, gl, gpr, rb) = (
        l.head_dim(),
        l.group_len(),
        l.groups_per_row(),
        l.row_bytes(),
    );
    let pb = s.param_bytes();
    for h in 0..l.n_kv_heads() {
        let ph = &mut params[h * gpr * pb..][..gpr * pb];
        for g in 0..gpr {
            let xs = &x[h * hd + g * gl..][..gl];
            let (sc, zero) = ggml_group(s, xs, &mut tmp[g * gl..(g + 1) * gl])
                .map_err(|(what, value)| overflow(fmt, what, value, token, h, g))?;
            fmt.write(sc, &mut ph[g * 2..]);
            if s.mode() == Mode::Asymmetric {
                fmt.write(zero, &mut ph[(gpr + g) * 2..]);
            }
        }
        crate::pack::pack(tmp, s.bits(), &mut codes[h * rb..(h + 1) * rb]);
    }
    Ok(())
}

/// The code of `x` given stored `(scale, zero)`: nearest grid point
/// (ties round up). Written without `round()` (a libm call on baseline
/// x86-64) so that loops over it vectorize: clamp into `[0, max_code]`, then
/// `+0.5` and truncate.
#[inline(always)]
pub(crate) fn code_of(x: f32, inv_scale: f32, zero: f32, max_code: f32) -> u8 {
    (((x - zero) * inv_scale).max(0.0).min(max_code) + 0.5) as i32 as u8
}

/// [`code_of`] computed in f64, for a group whose `1/scale` overflows f32:
/// a scale below 2^-128, so every value of the group is below 2^-96 and
/// `scale` may be subnormal.
#[cold]
fn code_of_f64(x: f32, scale: f32, zero: f32, max_code: f32) -> u8 {
    (((x as f64 - zero as f64) / scale as f64)
        .max(0.0)
        .min(max_code as f64)
        + 0.5) as u8
}

/// Codes of a run of values sharing one `(scale, zero)`.
#[inline(always)]
fn codes_into<O: QuantOps>(
    ops: O,
    xs: &[f32],
    scale: f32,
    zero: f32,
    max_code: f32,
    out: &mut [u8],
) {
    let inv_scale = inv(scale);
    if !inv_scale.is_finite() {
        for (c, &v) in out.iter_mut().zip(xs) {
            *c = code_of_f64(v, scale, zero, max_code);
        }
        return;
    }
    ops.codes(xs, inv_scale, zero, max_code, out);
}

/// The quantizer's inner loops, so the SIMD backends can supply explicit
/// vector versions. Every implementation gives bit-identical results to
/// [`Scalar`]: the same IEEE operations per element, and min/max (exact in
/// any order).
pub(crate) trait QuantOps: Copy {
    /// [`min_max_finite`].
    fn min_max_finite(self, x: &[f32]) -> (f32, f32, bool);
    /// `out[i] = code_of(xs[i], inv_scale, zero, max_code)` (one group).
    fn codes(self, xs: &[f32], inv_scale: f32, zero: f32, max_code: f32, out: &mut [u8]);
    /// `out[c] = code_of(xs[c], inv[c], zero[c], max_code)` (one row of a
    /// per-channel block).
    fn codes_pc(self, xs: &[f32], inv: &[f32], zero: &[f32], max_code: f32, out: &mut [u8]);
    /// [`group_params`] of every group `i` (`mins[i]`, `maxs[i]`) into
    /// `scales[i]`, `zeros[i]`; `Err(i)` names the first group that
    /// overflows (its outputs and later ones are unspecified).
    #[inline(always)]
    fn group_params(
        self,
        s: &QuantScheme,
        mins: &[f32],
        maxs: &[f32],
        scales: &mut [f32],
        zeros: &mut [f32],
    ) -> std::result::Result<(), usize> {
        for (i, (((&mn, &mx), sc), ze)) in mins.iter().zip(maxs).zip(scales).zip(zeros).enumerate()
        {
            (*sc, *ze) = group_params(s, mn, mx).map_err(|_| i)?;
        }
        Ok(())
    }
    /// `fmt.write` of every value of `vals` (each representable in `fmt`)
    /// into consecutive slots of `out`.
    #[inline(always)]
    fn write_params(self, fmt: ScaleFormat, vals: &[f32], out: &mut [u8]) {
        let fb = fmt.bytes();
        for (&v, o) in vals.iter().zip(out.chunks_exact_mut(fb)) {
            fmt.write(v, o);
        }
    }
}

/// The portable loops.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl QuantOps for Scalar {
    #[inline(always)]
    fn min_max_finite(self, x: &[f32]) -> (f32, f32, bool) {
        min_max_finite(x)
    }
    #[inline(always)]
    fn codes(self, xs: &[f32], inv_scale: f32, zero: f32, max_code: f32, out: &mut [u8]) {
        for (c, &v) in out.iter_mut().zip(xs) {
            *c = code_of(v, inv_scale, zero, max_code);
        }
    }
    #[inline(always)]
    fn codes_pc(self, xs: &[f32], inv: &[f32], zero: &[f32], max_code: f32, out: &mut [u8]) {
        for (((c, &v), &is), &z) in out.iter_mut().zip(xs).zip(inv).zip(zero) {
            *c = code_of(v, is, z, max_code);
        }
    }
}

#[inline(always)]
pub(crate) fn inv(scale: f32) -> f32 {
    if scale > 0.0 {
        1.0 / scale
    } else {
        0.0
    }
}

/// [`quantize_token_generic`] on `backend` (the SIMD backends compile the
/// generic driver with their vector loops; the bytes are identical on
/// every backend).
pub(crate) fn quantize_token(
    backend: Backend,
    l: &Layout,
    x: &[f32],
    token: usize,
    codes: &mut [u8],
    params: &mut [u8],
) -> Result<()> {
    backend.dispatch(QuantizeToken {
        l,
        x,
        token,
        codes,
        params,
    })
}

/// [`quantize_channel_block_generic`] on `backend`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_channel_block(
    backend: Backend,
    l: &Layout,
    rows: &[f32],
    tb: usize,
    h: usize,
    token0: usize,
    codes: &mut [u8],
    params: &mut [u8],
) -> Result<()> {
    backend.dispatch(QuantizeBlock {
        l,
        rows,
        tb,
        h,
        token0,
        codes,
        params,
    })
}

/// `impl Kernel` for a quantizer's argument struct whose `run<O:
/// QuantOps>` does the work: the scalar loops on the portable backend,
/// each SIMD token's loops on the others.
macro_rules! quant_kernel {
    ($t:ident) => {
        impl Kernel for $t<'_> {
            type Output = Result<()>;

            fn portable(self) -> Result<()> {
                self.run(Scalar)
            }

            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            fn simd<S: crate::simd::x86_64::Simd>(self, s: S) -> Result<()> {
                self.run(s)
            }
        }
    };
}

/// The per-token quantizer as a kernel (its own codegen unit).
mod token_kernel {
    use super::*;

    /// The arguments of [`quantize_token`], as a kernel.
    pub(super) struct QuantizeToken<'a> {
        pub(super) l: &'a Layout,
        pub(super) x: &'a [f32],
        pub(super) token: usize,
        pub(super) codes: &'a mut [u8],
        pub(super) params: &'a mut [u8],
    }

    impl QuantizeToken<'_> {
        #[inline(always)]
        fn run<O: QuantOps>(self, ops: O) -> Result<()> {
            quantize_token_generic(ops, self.l, self.x, self.token, self.codes, self.params)
        }
    }

    quant_kernel!(QuantizeToken);
}
use token_kernel::*;

/// The per-channel block quantizer as a kernel (its own codegen unit).
mod block_kernel {
    use super::*;

    /// The arguments of [`quantize_channel_block`], as a kernel.
    pub(super) struct QuantizeBlock<'a> {
        pub(super) l: &'a Layout,
        pub(super) rows: &'a [f32],
        pub(super) tb: usize,
        pub(super) h: usize,
        pub(super) token0: usize,
        pub(super) codes: &'a mut [u8],
        pub(super) params: &'a mut [u8],
    }

    impl QuantizeBlock<'_> {
        #[inline(always)]
        fn run<O: QuantOps>(self, ops: O) -> Result<()> {
            let QuantizeBlock {
                l,
                rows,
                tb,
                h,
                token0,
                codes,
                params,
            } = self;
            quantize_channel_block_generic(ops, l, rows, tb, h, token0, codes, params)
        }
    }

    quant_kernel!(QuantizeBlock);
}
use block_kernel::*;

/// Quantize one token (all heads; `x` is `[n_kv_heads·head_dim]`, finite).
/// Writes `n_kv_heads` code rows (head-major) into `codes` and the token's
/// params into `params`: per head `[scales…][zeros…]` (symmetric: scales
/// only), or one shared set for `Group::Vector`.
#[inline(always)]
pub(crate) fn quantize_token_generic<O: QuantOps>(
    ops: O,
    l: &Layout,
    x: &[f32],
    token: usize,
    codes: &mut [u8],
    params: &mut [u8],
) -> Result<()> {
    let s = l.scheme();
    let fmt = s.scale_format();
    let fb = fmt.bytes();
    let hd = l.head_dim();
    let gl = l.channels_per_group();
    let max_code = ((1u32 << s.bits()) - 1) as f32;
    let mut buf = [0u8; 512];
    let mut heap;
    let tmp: &mut [u8] = if hd <= buf.len() {
        &mut buf[..hd]
    } else {
        heap = vec![0u8; hd];
        &mut heap[..]
    };
    if s.rounding() == Rounding::Ggml {
        return ggml_token(l, x, token, codes, params, tmp);
    }
    let sym = s.mode() == Mode::Symmetric;
    if l.shared_params() {
        let (mn, mx, ok) = ops.min_max_finite(x);
        if !ok {
            return Err(nonfinite(l, x, token));
        }
        let (scale, zero) = group_params(s, mn, mx)
            .map_err(|(what, value)| overflow(fmt, what, value, token, 0, 0))?;
        fmt.write(scale, &mut params[..fb]);
        if !sym {
            fmt.write(zero, &mut params[fb..2 * fb]);
        }
        for h in 0..l.n_kv_heads() {
            codes_into(ops, &x[h * hd..(h + 1) * hd], scale, zero, max_code, tmp);
            let rb = l.row_bytes();
            crate::pack::pack(tmp, s.bits(), &mut codes[h * rb..(h + 1) * rb]);
        }
        return Ok(());
    }
    // A compile-time group length for the common sizes: fixed trip counts,
    // so the min/max and code loops become straight vector code.
    match gl {
        32 => token_groups::<32, O>(ops, l, x, token, codes, params, tmp),
        64 => token_groups::<64, O>(ops, l, x, token, codes, params, tmp),
        128 => token_groups::<128, O>(ops, l, x, token, codes, params, tmp),
        _ => token_groups::<0, O>(ops, l, x, token, codes, params, tmp),
    }
}

/// The per-group part of [`quantize_token_generic`], with `G` the group
/// length (0: read from the layout).
#[inline(always)]
fn token_groups<const G: usize, O: QuantOps>(
    ops: O,
    l: &Layout,
    x: &[f32],
    token: usize,
    codes: &mut [u8],
    params: &mut [u8],
    tmp: &mut [u8],
) -> Result<()> {
    let s = l.scheme();
    let fmt = s.scale_format();
    let fb = fmt.bytes();
    let gl = if G > 0 { G } else { l.channels_per_group() };
    let max_code = ((1u32 << s.bits()) - 1) as f32;
    let sym = s.mode() == Mode::Symmetric;
    let gpr = l.groups_per_row();
    let rb = l.row_bytes();
    // Groups in batches: min/max of each (stopping at a non-finite
    // value), the batch's params at once (vector code on AVX-512), then
    // params bytes and codes, packing each head's row when it is complete.
    let total = l.n_kv_heads() * gpr;
    let (mut mins, mut maxs) = ([0f32; PARAM_BATCH], [0f32; PARAM_BATCH]);
    let (mut scales, mut zeros) = ([0f32; PARAM_BATCH], [0f32; PARAM_BATCH]);
    let overflow_at = |k: usize, mn: f32, mx: f32| -> Error {
        let (what, value) = group_params(s, mn, mx).expect_err("the batch saw an overflow");
        overflow(fmt, what, value, token, k / gpr, k % gpr)
    };
    let mut k0 = 0;
    while k0 < total {
        let nb = PARAM_BATCH.min(total - k0);
        let mut finite = nb;
        for b in 0..nb {
            let k = k0 + b;
            let (mn, mx, ok) = ops.min_max_finite(&x[k * gl..(k + 1) * gl]);
            if !ok {
                finite = b;
                break;
            }
            (mins[b], maxs[b]) = (mn, mx);
        }
        let r = ops.group_params(
            s,
            &mins[..finite],
            &maxs[..finite],
            &mut scales[..finite],
            &mut zeros[..finite],
        );
        // Group order decides which fault is reported: an overflow before
        // the first non-finite group, else the non-finite value.
        if let Err(b) = r {
            return Err(overflow_at(k0 + b, mins[b], maxs[b]));
        }
        if finite < nb {
            return Err(nonfinite(l, x, token));
        }
        let mut b = 0;
        while b < nb {
            // The batch's groups of one head: `g0..g1`.
            let (h, g0) = ((k0 + b) / gpr, (k0 + b) % gpr);
            let g1 = gpr.min(g0 + nb - b);
            let ph = &mut params[h * gpr * s.param_bytes()..][..gpr * s.param_bytes()];
            ops.write_params(fmt, &scales[b..b + g1 - g0], &mut ph[g0 * fb..g1 * fb]);
            if !sym {
                ops.write_params(
                    fmt,
                    &zeros[b..b + g1 - g0],
                    &mut ph[(gpr + g0) * fb..(gpr + g1) * fb],
                );
            }
            for g in g0..g1 {
                let xs = &x[(h * gpr + g) * gl..(h * gpr + g + 1) * gl];
                let (sc, ze) = (scales[b + g - g0], zeros[b + g - g0]);
                codes_into(ops, xs, sc, ze, max_code, &mut tmp[g * gl..(g + 1) * gl]);
            }
            if g1 == gpr {
                crate::pack::pack(tmp, s.bits(), &mut codes[h * rb..(h + 1) * rb]);
            }
            b += g1 - g0;
        }
        k0 += nb;
    }
    Ok(())
}

/// Groups whose params are computed together (stack buffers of this many
/// floats).
const PARAM_BATCH: usize = 64;

/// The [`Error::NonFinite`] for a token row known to hold a NaN or ±inf.
#[cold]
fn nonfinite(l: &Layout, x: &[f32], token: usize) -> Error {
    match check_finite("quantize", x, l.n_kv_heads(), l.head_dim(), token) {
        Err(e) => e,
        Ok(()) => unreachable!("min_max_finite saw a non-finite value"),
    }
}

/// Quantize one per-channel block of head `h`: `rows` is `[tb, n_kv·hd]`
/// token-major (finite). Writes `tb` code rows and `[scales(hd)][zeros(hd)]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_channel_block_generic<O: QuantOps>(
    ops: O,
    l: &Layout,
    rows: &[f32],
    tb: usize,
    h: usize,
    token0: usize,
    codes: &mut [u8],
    params: &mut [u8],
) -> Result<()> {
    let s = l.scheme();
    let fmt = s.scale_format();
    let fb = fmt.bytes();
    let hd = l.head_dim();
    let width = l.n_kv_heads() * hd;
    let max_code = ((1u32 << s.bits()) - 1) as f32;
    let sym = s.mode() == Mode::Symmetric;
    let mut mins = rows[h * hd..(h + 1) * hd].to_vec();
    let mut maxs = mins.clone();
    let mut bad = mins.iter().fold(0u32, |b, v| b | (!v.is_finite()) as u32);
    for t in 1..tb {
        let r = &rows[t * width + h * hd..t * width + (h + 1) * hd];
        for ((lo, hi), &v) in mins.iter_mut().zip(maxs.iter_mut()).zip(r) {
            *lo = if v < *lo { v } else { *lo };
            *hi = if v > *hi { v } else { *hi };
            bad |= (!v.is_finite()) as u32;
        }
    }
    if bad != 0 {
        // The block's first non-finite value in token order (blocks are
        // quantized in order, so it is also the first of the input).
        return Err(
            match check_finite("quantize", &rows[..tb * width], l.n_kv_heads(), hd, token0) {
                Err(e) => e,
                Ok(()) => unreachable!("a non-finite value was seen"),
            },
        );
    }
    let mut zeros = vec![0f32; hd];
    let mut scales = vec![0f32; hd];
    if let Err(c) = ops.group_params(s, &mins, &maxs, &mut scales, &mut zeros) {
        let (what, value) =
            group_params(s, mins[c], maxs[c]).expect_err("the batch saw an overflow");
        return Err(overflow(fmt, what, value, token0, h, c));
    }
    ops.write_params(fmt, &scales, &mut params[..hd * fb]);
    if !sym {
        ops.write_params(fmt, &zeros, &mut params[hd * fb..2 * hd * fb]);
    }
    let inv_s: Vec<f32> = scales.iter().map(|&sc| inv(sc)).collect();
    // Channels whose 1/scale overflows f32 (subnormal groups) take the f64 path.
    let tiny: Vec<usize> = (0..hd).filter(|&c| !inv_s[c].is_finite()).collect();
    let rb = l.row_bytes();
    let mut tmp = vec![0u8; hd];
    for t in 0..tb {
        let r = &rows[t * width + h * hd..t * width + (h + 1) * hd];
        ops.codes_pc(r, &inv_s, &zeros, max_code, &mut tmp);
        for &c in &tiny {
            tmp[c] = code_of_f64(r[c], scales[c], zeros[c], max_code);
        }
        crate::pack::pack(&tmp, s.bits(), &mut codes[t * rb..(t + 1) * rb]);
    }
    Ok(())
}

fn overflow(
    fmt: ScaleFormat,
    what: &'static str,
    value: f32,
    token: usize,
    head: usize,
    group: usize,
) -> Error {
    Error::ScaleOverflow {
        op: "quantize",
        what,
        value,
        format: fmt.name(),
        token,
        head,
        group,
    }
}

/// Minimum and maximum of finite values (8 lanes, so it vectorizes).
#[inline]
pub(crate) fn min_max(x: &[f32]) -> (f32, f32) {
    let (lo, hi, _) = min_max_finite(x);
    (lo, hi)
}

/// Minimum, maximum, and whether every value is finite, in one
/// vectorizing pass (16 lanes, reduced pairwise at the end).
#[inline(always)]
pub(crate) fn min_max_finite(x: &[f32]) -> (f32, f32, bool) {
    const W: usize = 16;
    let mut lo = [f32::INFINITY; W];
    let mut hi = [f32::NEG_INFINITY; W];
    let mut bad = [0u32; W];
    let chunks = x.chunks_exact(W);
    let rest = chunks.remainder();
    for c in chunks {
        let c: &[f32; W] = c.try_into().expect("chunks_exact");
        for k in 0..W {
            lo[k] = if c[k] < lo[k] { c[k] } else { lo[k] };
            hi[k] = if c[k] > hi[k] { c[k] } else { hi[k] };
            bad[k] |= (!c[k].is_finite()) as u32;
        }
    }
    for (k, &v) in rest.iter().enumerate() {
        lo[k] = if v < lo[k] { v } else { lo[k] };
        hi[k] = if v > hi[k] { v } else { hi[k] };
        bad[k] |= (!v.is_finite()) as u32;
    }
    let mut w = W;
    while w > 1 {
        w /= 2;
        for k in 0..w {
            lo[k] = if lo[k + w] < lo[k] { lo[k + w] } else { lo[k] };
            hi[k] = if hi[k + w] > hi[k] { hi[k + w] } else { hi[k] };
            bad[k] |= bad[k + w];
        }
    }
    (lo[0], hi[0], bad[0] == 0)
}

/// Largest |x| below which no group of any scheme with this format can
/// overflow its scale or zero (asymmetric: `zero ≥ −A`, `scale ≤ 2A`).
pub(crate) fn safe_abs(fmt: ScaleFormat) -> f32 {
    match fmt {
        ScaleFormat::F16 => 30000.0,
        ScaleFormat::Bf16 | ScaleFormat::F32 => 1.0e37,
    }
}

/// The largest `|x|` of a slice, and whether every value is finite, in
/// one pass that vectorizes on baseline x86-64 (float max and compare).
#[inline]
pub(crate) fn abs_max_finite(x: &[f32]) -> (f32, bool) {
    let mut m = [0f32; 16];
    let mut nan = [false; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..16 {
            let a = c[k].abs();
            m[k] = if a > m[k] { a } else { m[k] };
            nan[k] |= a.is_nan();
        }
    }
    let (mut mx, mut bad) = (0f32, false);
    for &v in rest.iter().chain(&m) {
        mx = if v.abs() > mx { v.abs() } else { mx };
        bad |= v.is_nan();
    }
    (mx, !bad && !nan.contains(&true) && mx.is_finite())
}
