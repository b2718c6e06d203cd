//! Codebook formats: each code indexes a fixed table of levels, times one
//! scale per group, `x̂ = scale·level[code]`.
//!
//! The storage is that of a symmetric per-token [`QuantScheme`](crate::QuantScheme) — packed
//! codes of `bits` bits and one scale per group, nothing else — so the
//! accounting ([`Layout`]) is the uniform grid's; only the meaning of a code
//! differs. Three tables ([`Levels`]):
//!
//! * [`Levels::Iq4Nl`]: llama.cpp's `iq4_nl` cache type value for value —
//!   its 16 non-uniform integer levels (−127 … 113), blocks of 32, an f16
//!   scale, and ggml's reference encoder (`quantize_row_iq4_nl_ref`: codes
//!   from `d₀ = m/−127` with `m` the block's first element of largest
//!   magnitude, then `d` refit by least squares weighted by `x²`, stored to
//!   the nearest f16; `d` may be negative).
//! * [`Levels::Nf4`]: the NF4 quantiles of a unit Gaussian (QLoRA). Codes
//!   start from the group's absmax as the scale; the scale is refit by
//!   least squares and the codes recomputed with the stored scale.
//! * [`Levels::Gauss`]: the Lloyd-Max levels of a unit Gaussian at 2, 3 or
//!   4 bits (the MSE-optimal quantizer of N(0,1)), meant for heads after
//!   the Hadamard rotation, which makes their values close to Gaussian
//!   (TurboQuant's recipe without its 1-bit residual). A group of 32 is too
//!   small for its RMS to be a good scale, so the encoder tries four
//!   starts (the absmax on the outer level, 10 % inside and outside it, and
//!   the RMS), refits each as NF4 does, and keeps the one of least squared
//!   error: on Gaussian groups of 32 that is 15 % below llama.cpp's `q4_0`
//!   at the same 4.5 bits, and at 3.5 (2.5) bits below the uniform 3-bit
//!   (2-bit) grid with scale and zero, which takes 4 (3) bits.
//!
//! * [`Levels::Fitted`]: a table of 4, 8 or 16 levels fitted to a layer's own
//!   keys or values ([`Codec::fit_levels`], KVQuant's non-uniform
//!   codebooks on this crate's per-group scales), encoded as Lloyd-Max is.
//!   The table is part of the format: saved with the cache and counted in
//!   its bytes ([`FittedLevels::bytes`]).
//!
//! * [`Levels::E4m3`], [`Levels::E5m2`]: 8-bit floating point (OCP FP8),
//!   the standard bytes times one scale per group (`absmax/448` or
//!   `absmax/57344`), see `quant::fp8`.
//!
//! The fused kernels look levels up in registers (`vpermps`) or, for fp8,
//! decode a byte with a shift and a multiply (see `kernels::codebook`).

use super::codec::{Codec, KvCodec, Pending};
use super::fp8::{Fp8, E4M3, E5M2};
use crate::error::{Error, Result};
use crate::kernels;
use crate::scheme::{Axis, Group, Layout, Mode, Rounding, ScaleFormat};
use crate::simd::{Backend, Kernel};
use crate::store::PackedHead;

/// The table of a codebook format (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Levels {
    /// llama.cpp's `iq4_nl` levels and encoder (4 bits, groups of 32, f16
    /// scales, [`Rounding::Ggml`]: use [`crate::presets::iq4_nl`]).
    Iq4Nl,
    /// NF4: Gaussian quantiles scaled by the group's absmax (4 bits).
    Nf4,
    /// Lloyd-Max levels of a unit Gaussian scaled by a least-squares fit
    /// from the group's RMS (2, 3 or 4 bits).
    Gauss,
    /// FP8 `e4m3fn` bytes times the group's `absmax/448` (8 bits).
    E4m3,
    /// FP8 `e5m2` bytes times the group's `absmax/57344` (8 bits).
    E5m2,
    /// A table fitted to data ([`Codec::fit_levels`]) or given
    /// ([`FittedLevels::new`]), of 4, 8 or 16 levels (2–4 bits: the
    /// widths of a symmetric scheme a table covers).
    Fitted(FittedLevels),
}

/// Most levels a table holds: what a 4-bit code indexes, and what the
/// kernels keep in one register.
const MAX_LEVELS: usize = 16;

/// The levels of a [`Levels::Fitted`] table: 4, 8 or 16 finite values,
/// strictly ascending, the largest magnitude in `[1e-3, 1e3]` and no
/// non-zero level closer to zero than `1/1024` of it.
///
/// The last rule bounds a group's scale: the least-squares scale of codes
/// whose levels are `q` is at most the group's absmax over the smallest
/// non-zero `|q|`, so a table with a level near zero could overflow an f16
/// scale on ordinary rows.
///
/// ```
/// use kvq::quant::FittedLevels;
/// let t = FittedLevels::new(&[-1.6, -0.4, 0.5, 1.4])?;
/// assert_eq!(t.bits(), 2);
/// assert_eq!(t.levels(), &[-1.6, -0.4, 0.5, 1.4]);
/// assert!(FittedLevels::new(&[0.0, 1.0, 2.0]).is_err()); // not a power of two
/// assert!(FittedLevels::new(&[1.0, -1.0, 2.0, 3.0]).is_err()); // not ascending
/// # Ok::<(), kvq::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FittedLevels {
    n: u8,
    /// The levels' `f32` bits; zero past `n`.
    bits: [u32; MAX_LEVELS],
}

impl std::fmt::Debug for FittedLevels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("FittedLevels").field(&self.levels()).finish()
    }
}

impl FittedLevels {
    /// The table `levels`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a table that breaks a rule of the
    /// [type docs](Self): a count other than 4, 8 or 16, a NaN or
    /// infinite level, levels not strictly ascending, a largest magnitude
    /// outside `[1e-3, 1e3]`, or a non-zero level within `1/1024` of the
    /// largest magnitude of zero.
    pub fn new(levels: &[f32]) -> Result<Self> {
        let bad = |what: String| {
            Err(Error::InvalidConfig {
                op: "FittedLevels::new",
                what,
            })
        };
        let n = levels.len();
        if !matches!(n, 4 | 8 | 16) {
            return bad(format!(
                "{n} levels: a fitted table has 4, 8 or 16 (2–4 bits)"
            ));
        }
        if let Some(i) = levels.iter().position(|x| !x.is_finite()) {
            return bad(format!("level {i} is {}", levels[i]));
        }
        if let Some(i) = levels.windows(2).position(|w| w[0] >= w[1]) {
            return bad(format!(
                "levels are not strictly ascending: level {} is {} and level {} is {}",
                i,
                levels[i],
                i + 1,
                levels[i + 1]
            ));
        }
        let top = levels[0].abs().max(levels[n - 1].abs());
        if !(1e-3..=1e3).contains(&top) {
            return bad(format!(
                "largest level magnitude {top} is outside [1e-3, 1e3]"
            ));
        }
        if let Some(&x) = levels.iter().find(|&&x| x != 0.0 && x.abs() < top / 1024.0) {
            return bad(format!(
                "level {x} is within 1/1024 of the largest magnitude {top} of zero \
                 (make it zero or move it out)"
            ));
        }
        let mut bits = [0u32; MAX_LEVELS];
        for (b, x) in bits.iter_mut().zip(levels) {
            *b = x.to_bits();
        }
        Ok(FittedLevels { n: n as u8, bits })
    }

    /// The levels, ascending.
    pub fn levels(&self) -> &[f32] {
        bytemuck::cast_slice(&self.bits[..usize::from(self.n)])
    }

    /// The width of a code: `log2` of the number of levels.
    pub fn bits(&self) -> u8 {
        self.n.trailing_zeros() as u8
    }

    /// Bytes the table takes where the format stores it (once per tensor:
    /// an `f32` a level).
    pub fn bytes(&self) -> usize {
        4 * usize::from(self.n)
    }

    /// The smallest non-zero level magnitude.
    fn smallest(&self) -> f32 {
        self.levels()
            .iter()
            .filter(|x| **x != 0.0)
            .fold(f32::INFINITY, |m, x| m.min(x.abs()))
    }
}

/// The saved id of [`Levels::Fitted`].
pub(crate) const FITTED_ID: u8 = 5;

/// llama.cpp's `kvalues_iq4nl`.
const IQ4NL: [f32; 16] = [
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0,
    89.0, 113.0,
];

/// The NF4 levels (QLoRA's `NF4` data type, symmetric about 0 with an
/// exact 0).
const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Lloyd-Max reconstruction levels of N(0, 1) (Max, 1960), checked by a
/// Lloyd iteration in `tests/codebook.rs`.
const GAUSS2: [f32; 4] = [-1.5104, -0.4528, 0.4528, 1.5104];
const GAUSS3: [f32; 8] = [
    -2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520,
];
const GAUSS4: [f32; 16] = [
    -2.7326, -2.0690, -1.6180, -1.2562, -0.9424, -0.6568, -0.3881, -0.1284, 0.1284, 0.3881, 0.6568,
    0.9424, 1.2562, 1.6180, 2.0690, 2.7326,
];

impl Levels {
    /// Every fixed table (all but [`Levels::Fitted`]), for tests and
    /// sweeps.
    pub const ALL: &'static [Levels] = &[
        Levels::Iq4Nl,
        Levels::Nf4,
        Levels::Gauss,
        Levels::E4m3,
        Levels::E5m2,
    ];

    /// The levels at `bits` bits, ascending (`None` when this table has no
    /// such width, and for fp8, which decodes without a table).
    pub fn table(&self, bits: u8) -> Option<&[f32]> {
        match (self, bits) {
            (Levels::Fitted(f), b) if b == f.bits() => Some(f.levels()),
            (Levels::Iq4Nl, 4) => Some(&IQ4NL),
            (Levels::Nf4, 4) => Some(&NF4),
            (Levels::Gauss, 2) => Some(&GAUSS2),
            (Levels::Gauss, 3) => Some(&GAUSS3),
            (Levels::Gauss, 4) => Some(&GAUSS4),
            _ => None,
        }
    }

    /// Its short name: `iq4_nl`, `nf4`, `gauss`, `e4m3`, `e5m2`, `fit`.
    pub fn name(self) -> &'static str {
        match self {
            Levels::Iq4Nl => "iq4_nl",
            Levels::Nf4 => "nf4",
            Levels::Gauss => "gauss",
            Levels::E4m3 => "e4m3",
            Levels::E5m2 => "e5m2",
            Levels::Fitted(_) => "fit",
        }
    }

    /// The fp8 format, for the fp8 levels.
    fn fp8(self) -> Option<Fp8> {
        match self {
            Levels::E4m3 => Some(E4M3),
            Levels::E5m2 => Some(E5M2),
            _ => None,
        }
    }

    /// Its id in saved caches (`docs/FORMAT.md`).
    pub(crate) fn id(self) -> u8 {
        match self {
            Levels::Iq4Nl => 0,
            Levels::Nf4 => 1,
            Levels::Gauss => 2,
            Levels::E4m3 => 3,
            Levels::E5m2 => 4,
            Levels::Fitted(_) => FITTED_ID,
        }
    }

    /// The fixed table of a saved id (a fitted table's levels are saved
    /// with it: [`FITTED_ID`]).
    pub(crate) fn from_id(id: u8) -> Option<Levels> {
        Levels::ALL.get(usize::from(id)).copied()
    }

    /// The fitted table, if this is one.
    pub fn fitted(&self) -> Option<&FittedLevels> {
        match self {
            Levels::Fitted(f) => Some(f),
            _ => None,
        }
    }
}

/// The index of the level nearest to `x` in the strictly ascending `t` (at
/// least two levels), ties to the upper one (ggml's `best_index_int8`);
/// the ends take everything beyond, NaN the last.
///
/// Branch-free, as [`nearest_scaled`]: the lower neighbour is the count
/// of inner levels not above `x`, then one comparison picks it or the
/// next — the index a binary search finds, without its unpredictable
/// branches.
#[inline(always)]
pub(crate) fn nearest(t: &[f32], x: f32) -> u8 {
    let inner = &t[1..t.len() - 1];
    let lo = inner.iter().map(|&v| usize::from(not_below(x, v))).sum();
    pick(t, x, lo)
}

/// `!(x < v)`, which counts NaN as above every level (clippy prefers the
/// spelled-out form); `|` rather than `||`, which may branch.
#[inline(always)]
fn not_below(x: f32, v: f32) -> bool {
    (x >= v) | x.is_nan()
}

/// `lo` or `lo + 1`, whichever level of `t` is nearer to `x` (ties and NaN
/// to the upper one); `lo + 1 < t.len()`.
#[inline(always)]
fn pick(t: &[f32], x: f32, lo: usize) -> u8 {
    // A flag added, not a branch: which way is as likely as not.
    lo as u8 + u8::from(not_below(x - t[lo], t[lo + 1] - x))
}

/// `codes[i] = nearest(t, x[i]·id)` for every `i`, a chunk of values at a
/// time so the counts of inner levels below them vectorize.
#[inline(always)]
fn nearest_scaled(t: &[f32], x: &[f32], id: f32, codes: &mut [u8]) {
    const CHUNK: usize = 32;
    let inner = &t[1..t.len() - 1];
    for (cs, xs) in codes.chunks_mut(CHUNK).zip(x.chunks(CHUNK)) {
        let (mut y, mut lo) = ([0f32; CHUNK], [0u32; CHUNK]);
        y.iter_mut().zip(xs).for_each(|(y, &v)| *y = v * id);
        for &v in inner {
            lo.iter_mut()
                .zip(&y)
                .for_each(|(l, &y)| *l += u32::from(not_below(y, v)));
        }
        for ((c, &l), &y) in cs.iter_mut().zip(&lo).zip(&y) {
            *c = pick(t, y, l as usize);
        }
    }
}

/// `x` rounded to the nearest value of `fmt` (infinite when out of range).
fn round_nearest(fmt: ScaleFormat, x: f32) -> f32 {
    match fmt {
        ScaleFormat::F32 => x,
        ScaleFormat::F16 => half::f16::from_f32(x).to_f32(),
        ScaleFormat::Bf16 => half::bf16::from_f32(x).to_f32(),
    }
}

/// The stored scale of one group `x` (finite values) and its codes, or the
/// scale that does not fit `fmt`.
#[inline(always)]
pub(crate) fn encode_group(
    levels: Levels,
    t: &[f32],
    fmt: ScaleFormat,
    x: &[f32],
    codes: &mut [u8],
) -> std::result::Result<f32, f32> {
    let zero_code = nearest(t, 0.0);
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    let all_zero = |codes: &mut [u8]| {
        codes.fill(zero_code);
        Ok(0.0)
    };
    match levels {
        Levels::Iq4Nl => {
            // ggml's early exit: scale 0, codes 0 (so a block decodes to −0).
            if amax < 1e-15 {
                codes.fill(0);
                return Ok(0.0);
            }
            let d0 = max / t[0];
            let id = 1.0 / d0;
            nearest_scaled(t, x, id, codes);
            let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
            for (&c, &v) in codes.iter().zip(x) {
                let q = t[usize::from(c)];
                let w = v * v;
                sumqx += w * q * v;
                sumq2 += w * q * q;
            }
            let d = round_nearest(fmt, sumqx / sumq2);
            if d.is_finite() {
                Ok(d)
            } else {
                Err(sumqx / sumq2)
            }
        }
        Levels::E4m3 | Levels::E5m2 => unreachable!("fp8 groups go to fp8_group"),
        Levels::Nf4 | Levels::Gauss | Levels::Fitted(_) => {
            if amax == 0.0 {
                return all_zero(codes);
            }
            // The symmetric tables' last level; a fitted one may be
            // lopsided.
            let top = t[t.len() - 1].max(-t[0]);
            let rms = (x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64)
                .sqrt() as f32;
            // Starting scales: the absmax on the outer level (NF4's own
            // rule), for Lloyd-Max also a little inside and outside it and
            // the RMS (best at 2 bits); each is refit by least squares and
            // the codes recomputed with the stored scale; the smallest
            // squared error wins.
            let starts: &[f32] = match levels {
                Levels::Nf4 => &[1.0],
                _ => &[0.9, 1.0, 1.1, 0.0],
            };
            let mut best = (f64::INFINITY, 0.0f32);
            // The best start's codes (on the stack for groups up to 256).
            let (mut stack, mut heap) = ([0u8; 256], Vec::new());
            let keep: &mut [u8] = if codes.len() <= stack.len() {
                &mut stack[..codes.len()]
            } else {
                heap.resize(codes.len(), 0);
                &mut heap
            };
            for &f in starts {
                let d0 = if f == 0.0 { rms } else { f * amax / top };
                let d = refit(t, fmt, x, d0, codes)?;
                let e: f64 = x
                    .iter()
                    .zip(codes.iter())
                    .map(|(&v, &c)| f64::from(v - d * t[usize::from(c)]).powi(2))
                    .sum();
                if e < best.0 {
                    best = (e, d);
                    keep.copy_from_slice(codes);
                }
            }
            codes.copy_from_slice(keep);
            Ok(best.1)
        }
    }
}

/// The stored scale of one fp8 group `x` (`absmax/largest`, to the nearest
/// value of `fmt`) and its bytes, or the scale that does not fit `fmt`.
#[inline(always)]
fn fp8_group(
    f: Fp8,
    fmt: ScaleFormat,
    x: &[f32],
    codes: &mut [u8],
) -> std::result::Result<f32, f32> {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = amax / f.max;
    let d = round_nearest(fmt, s);
    if !d.is_finite() {
        return Err(s);
    }
    if d == 0.0 {
        codes.fill(0);
        return Ok(0.0);
    }
    let id = 1.0 / d;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = f.encode(v * id);
    }
    Ok(d)
}

/// Codes of `x` at scale `d0`, the least-squares scale for them rounded
/// into `fmt`, and the codes again at that stored scale; returns it.
#[inline(always)]
fn refit(
    t: &[f32],
    fmt: ScaleFormat,
    x: &[f32],
    d0: f32,
    codes: &mut [u8],
) -> std::result::Result<f32, f32> {
    let zero_code = nearest(t, 0.0);
    if d0.is_nan() || d0 <= 0.0 || d0.is_infinite() {
        codes.fill(zero_code);
        return Ok(0.0);
    }
    nearest_scaled(t, x, 1.0 / d0, codes);
    let (mut sqx, mut sq2) = (0.0f64, 0.0f64);
    for (&c, &v) in codes.iter().zip(x) {
        let q = f64::from(t[usize::from(c)]);
        sqx += q * f64::from(v);
        sq2 += q * q;
    }
    let fit = if sq2 > 0.0 { (sqx / sq2) as f32 } else { 0.0 };
    let d = round_nearest(fmt, fit);
    if !d.is_finite() {
        return Err(fit);
    }
    if d <= 0.0 {
        codes.fill(zero_code);
        return Ok(0.0);
    }
    nearest_scaled(t, x, 1.0 / d, codes);
    Ok(d)
}

/// Lloyd iterations [`fit_levels`] runs at most.
const FIT_ITERS: usize = 24;

/// The levels of the codebook codec `start` (a table it has, not fp8 or
/// `iq4_nl`) refit to `rows` (`[tokens, n_kv_heads·head_dim]`), weighted
/// per channel of the stored space by `weights` (see
/// [`Codec::fit_levels`]).
///
/// A weighted Lloyd iteration on the codec's own encoder: every group is
/// encoded with the current table (its stored scale `d` and codes), then
/// each level moves to the least-squares value for the elements that chose
/// it, `Σ w·d·x / Σ w·d²`. The table of least weighted squared error seen
/// is kept; iteration stops when an update does not lower it, after
/// [`FIT_ITERS`] updates, or when an update breaks a rule of
/// [`FittedLevels`] that sorting and snapping to zero do not mend.
pub(crate) fn fit_levels(
    start: &Codec,
    rows: &[f32],
    n_kv_heads: usize,
    head_dim: usize,
    weights: Option<&[f32]>,
) -> Result<FittedLevels> {
    let op = "Codec::fit_levels";
    let bad = |what: String| Err(Error::InvalidConfig { op, what });
    let s = start.scheme();
    let t0 = match start.levels() {
        Some(Levels::Iq4Nl) | None => None,
        Some(l) => l.table(s.bits()).map(<[f32]>::to_vec),
    };
    let Some(mut t) = t0 else {
        return bad(format!(
            "fitting starts from a Lloyd-Max, NF4 or fitted table, not {}",
            start.label()
        ));
    };
    let built = start.build(n_kv_heads, head_dim)?;
    let width = n_kv_heads * head_dim;
    super::check_rows(
        op,
        "values (a positive multiple of n_kv_heads·head_dim)",
        rows.len(),
        width,
    )?;
    super::check_finite(op, rows, n_kv_heads, head_dim, 0)?;
    if let Some(w) = weights {
        super::check_len(op, "channel weights", width, w.len())?;
        if let Some(i) = w.iter().position(|x| !x.is_finite() || *x < 0.0) {
            return Err(Error::InvalidArgument {
                op,
                what: format!("channel weight {i} is {}", w[i]),
            });
        }
        if w.iter().all(|x| *x == 0.0) {
            return Err(Error::InvalidArgument {
                op,
                what: "every channel weight is zero".into(),
            });
        }
    }
    let mut x = rows.to_vec();
    built.transform_in(&mut x);
    let l = built.layout();
    let (cpg, fmt) = (l.channels_per_group(), s.scale_format());
    let mut codes = vec![0u8; cpg];
    let n = t.len();
    let mut best: Option<(f64, FittedLevels)> = None;
    for _ in 0..=FIT_ITERS {
        let Ok(table) = FittedLevels::new(&t) else {
            break;
        };
        let levels = Levels::Fitted(table);
        let (mut num, mut den, mut err) = (vec![0f64; n], vec![0f64; n], 0f64);
        for (tok, row) in x.chunks_exact(width).enumerate() {
            for (k, g) in row.chunks_exact(cpg).enumerate() {
                let d = encode_group(levels, &t, fmt, g, &mut codes).map_err(|value| {
                    super::overflow(
                        fmt,
                        "scale",
                        value,
                        tok,
                        k * cpg / head_dim,
                        k * cpg % head_dim / cpg,
                    )
                })?;
                let d = f64::from(d);
                for (i, (&c, &v)) in codes.iter().zip(g).enumerate() {
                    let w = weights.map_or(1.0, |w| f64::from(w[k * cpg + i]));
                    let (c, v) = (usize::from(c), f64::from(v));
                    num[c] += w * d * v;
                    den[c] += w * d * d;
                    err += w * (v - d * f64::from(t[c])).powi(2);
                }
            }
        }
        match best {
            Some((e, _)) if err >= e * (1.0 - 1e-7) => break,
            _ => best = Some((err, table)),
        }
        for (c, lv) in t.iter_mut().enumerate() {
            if den[c] > 0.0 {
                *lv = (num[c] / den[c]) as f32;
            }
        }
        t.sort_by(f32::total_cmp);
        let top = t[0].abs().max(t[n - 1].abs());
        for lv in &mut t {
            if lv.abs() < top / 1024.0 {
                *lv = 0.0;
            }
        }
    }
    match best {
        Some((_, f)) => Ok(f),
        None => bad(format!("{} is not a table to fit", start.label())),
    }
}

/// A codebook format for one shape: the layout of its symmetric scheme
/// and the levels, padded to 16 for the kernels (empty for fp8).
#[derive(Debug, Clone)]
pub struct CodebookCodec {
    layout: Layout,
    levels: Levels,
    table: [f32; 16],
    n: usize,
    fp8: Option<Fp8>,
}

impl CodebookCodec {
    /// The codebook `levels` on `layout`'s storage.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] unless the scheme is symmetric and per-token
    /// with groups inside a head, of a width the table has, with
    /// [`Rounding::Ggml`] exactly for [`Levels::Iq4Nl`] (whose scales may be
    /// negative) and `iq4_nl`'s blocks of 32 with f16 scales.
    pub fn new(layout: Layout, levels: Levels) -> Result<Self> {
        let op = "CodebookCodec::new";
        let s = *layout.scheme();
        let bad = |what: String| Err(Error::InvalidConfig { op, what });
        let fp8 = levels.fp8();
        let t = match (fp8, levels.table(s.bits())) {
            (Some(_), _) if s.bits() == 8 => Some(&[][..]),
            (_, t) => t,
        };
        let Some(t) = t else {
            return bad(format!(
                "the {} codebook has no {}-bit table",
                levels.name(),
                s.bits()
            ));
        };
        if s.axis() != Axis::PerToken || s.mode() != Mode::Symmetric {
            return bad(format!(
                "a codebook takes a symmetric per-token scheme, not {}",
                s.label()
            ));
        }
        if matches!(s.group(), Group::Vector) {
            return bad("a codebook's groups lie inside a head, not across the vector".into());
        }
        let ggml = s.rounding() == Rounding::Ggml;
        if (levels == Levels::Iq4Nl) != ggml {
            return bad(format!(
                "{} {} ggml rounding",
                levels.name(),
                if ggml { "does not take" } else { "needs" }
            ));
        }
        let mut table = [0.0; 16];
        table[..t.len()].copy_from_slice(t);
        Ok(CodebookCodec {
            layout,
            levels,
            table,
            n: t.len(),
            fp8,
        })
    }

    /// The levels.
    pub fn levels(&self) -> Levels {
        self.levels
    }

    fn levels_table(&self) -> &[f32] {
        &self.table[..self.n]
    }

    /// One group's scale and codes.
    #[inline(always)]
    fn group(
        &self,
        fmt: ScaleFormat,
        x: &[f32],
        codes: &mut [u8],
    ) -> std::result::Result<f32, f32> {
        match self.fp8 {
            Some(f) => fp8_group(f, fmt, x, codes),
            None => encode_group(self.levels, self.levels_table(), fmt, x, codes),
        }
    }

    /// What the kernels decode with.
    fn book(&self) -> kernels::codebook::Book<'_> {
        kernels::codebook::Book::new(&self.table, self.fp8)
    }

    /// Largest `|x|` below which no group's scale can overflow the format:
    /// every scale is within 8× the group's absmax (iq4_nl: `≈ absmax/127`,
    /// NF4: the absmax, Gauss: a least-squares fit over levels ≥ 0.128).
    fn safe_abs(&self) -> f32 {
        let top = match self.layout.scheme().scale_format() {
            ScaleFormat::F16 => 65504.0,
            ScaleFormat::Bf16 => half::bf16::MAX.to_f32(),
            ScaleFormat::F32 => f32::MAX,
        };
        match self.levels {
            // |d| ≤ absmax / (smallest non-zero |level|), with room for the
            // scale's rounding.
            Levels::Fitted(f) => top * f.smallest() / 4.0,
            _ => top / 16.0,
        }
    }
}

impl KvCodec for CodebookCodec {
    fn spec(&self) -> Codec {
        Codec::codebook(*self.layout.scheme(), self.levels)
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn check(
        &self,
        op: &'static str,
        rows: &[f32],
        abs_max: f32,
        _first: usize,
        token0: usize,
        _pend: &mut Pending,
    ) -> Result<()> {
        if abs_max <= self.safe_abs() {
            return Ok(());
        }
        let l = &self.layout;
        let (hd, cpg) = (l.head_dim(), l.channels_per_group());
        let fmt = l.scheme().scale_format();
        let mut codes = vec![0u8; cpg];
        for (i, row) in rows.chunks_exact(l.n_kv_heads() * hd).enumerate() {
            for (k, g) in row.chunks_exact(cpg).enumerate() {
                self.group(fmt, g, &mut codes)
                    .map_err(|value| Error::ScaleOverflow {
                        op,
                        what: "scale",
                        value,
                        format: fmt.name(),
                        token: token0 + i,
                        head: k * cpg / hd,
                        group: k * cpg % hd / cpg,
                    })?;
            }
        }
        Ok(())
    }

    fn encode_token(
        &self,
        backend: Backend,
        row: &[f32],
        token: usize,
        codes: &mut [u8],
        params: &mut [u8],
        _outliers: &mut [u8],
    ) -> Result<()> {
        backend.dispatch(EncodeRow {
            codec: self,
            row,
            token,
            codes,
            params,
        })
    }

    fn encode_block(
        &self,
        _backend: Backend,
        _rows: &[f32],
        _tokens: usize,
        _head: usize,
        _token0: usize,
        _codes: &mut [u8],
        _params: &mut [u8],
        _outliers: &mut [u8],
    ) -> Result<()> {
        Err(Error::InvalidConfig {
            op: "CodebookCodec::encode_block",
            what: "a codebook format is per-token".into(),
        })
    }

    fn scores(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        kernels::codebook::scores_on(backend, head, self.book(), q, out)
    }

    fn weighted_sum(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        p: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        kernels::codebook::weighted_sum_on(backend, head, self.book(), p, out)
    }

    fn decode(&self, head: &PackedHead<'_>, out: &mut [f32]) {
        kernels::codebook::decode(head, self.book(), out);
    }
}

/// One token's row encoded ([`KvCodec::encode_token`]), run as a kernel
/// so the encoder's loops are compiled for each backend's vectors (the
/// nearest-level counts of [`nearest_scaled`] vectorize; the body is plain
/// Rust either way, and every backend gives the same bytes).
struct EncodeRow<'a> {
    codec: &'a CodebookCodec,
    row: &'a [f32],
    token: usize,
    codes: &'a mut [u8],
    params: &'a mut [u8],
}

impl EncodeRow<'_> {
    #[inline(always)]
    fn run(self) -> Result<()> {
        let EncodeRow {
            codec,
            row,
            token,
            codes,
            params,
        } = self;
        let l = &codec.layout;
        let s = l.scheme();
        let fmt = s.scale_format();
        let fb = fmt.bytes();
        let (hd, cpg, gpr, rb) = (
            l.head_dim(),
            l.channels_per_group(),
            l.groups_per_row(),
            l.row_bytes(),
        );
        // One head's codes, on the stack for heads up to 512 channels.
        let (mut stack, mut heap) = ([0u8; 512], Vec::new());
        let tmp: &mut [u8] = if hd <= stack.len() {
            &mut stack[..hd]
        } else {
            heap.resize(hd, 0);
            &mut heap
        };
        for h in 0..l.n_kv_heads() {
            for g in 0..gpr {
                let x = &row[h * hd + g * cpg..][..cpg];
                let d = codec
                    .group(fmt, x, &mut tmp[g * cpg..(g + 1) * cpg])
                    .map_err(|value| super::overflow(fmt, "scale", value, token, h, g))?;
                fmt.write(d, &mut params[(h * gpr + g) * fb..]);
            }
            crate::pack::pack(tmp, s.bits(), &mut codes[h * rb..(h + 1) * rb]);
        }
        Ok(())
    }
}

impl Kernel for EncodeRow<'_> {
    type Output = Result<()>;

    fn portable(self) -> Result<()> {
        self.run()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: crate::simd::x86_64::Simd>(self, _s: S) -> Result<()> {
        self.run()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The binary search the branch-free lookup replaces.
    fn by_search(t: &[f32], x: f32) -> u8 {
        let n = t.len();
        if x <= t[0] {
            return 0;
        }
        if x >= t[n - 1] {
            return (n - 1) as u8;
        }
        let (mut lo, mut hi) = (0, n - 1);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if x < t[mid] {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        if x - t[lo] < t[hi] - x {
            lo as u8
        } else {
            hi as u8
        }
    }

    /// Every table, at its levels, their neighbours one ulp either side,
    /// the midpoints, far beyond the ends, infinities, NaN and a sweep:
    /// the same index as the search, one value or a chunk at a time.
    #[test]
    fn the_branch_free_lookup_picks_what_the_search_picks() {
        let fitted = FittedLevels::new(&[-1.6, -0.4, 0.5, 1.4]).unwrap();
        let tables: Vec<&[f32]> = vec![&IQ4NL, &NF4, &GAUSS2, &GAUSS3, &GAUSS4, fitted.levels()];
        let step = |x: f32, up: bool| {
            let b = x.to_bits();
            match (x == 0.0, up == (x > 0.0)) {
                (true, _) => f32::from_bits(1) * if up { 1.0 } else { -1.0 },
                (false, true) => f32::from_bits(b + 1),
                (false, false) => f32::from_bits(b - 1),
            }
        };
        for t in tables {
            let mut xs = vec![
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                0.0,
                -0.0,
                1e30,
                -1e30,
            ];
            for (i, &v) in t.iter().enumerate() {
                xs.extend([v, step(v, true), step(v, false)]);
                if let Some(&w) = t.get(i + 1) {
                    let m = (v + w) / 2.0;
                    xs.extend([m, step(m, true), step(m, false)]);
                }
            }
            let (lo, hi) = (t[0], t[t.len() - 1]);
            xs.extend((0..=2000).map(|i| lo * 1.5 + (hi - lo * 1.5) * 1.5 * i as f32 / 2000.0));
            for &x in &xs {
                assert_eq!(nearest(t, x), by_search(t, x), "{t:?} at {x}");
            }
            // A chunk at a time, scaled, over lengths around the chunk.
            for (len, id) in [(1, 1.0), (31, 0.5), (32, 2.0), (33, 1.0), (100, -1.0)] {
                for start in [0, 7] {
                    let x: Vec<f32> = xs.iter().cycle().skip(start).take(len).copied().collect();
                    let mut codes = vec![0u8; len];
                    nearest_scaled(t, &x, id, &mut codes);
                    for (i, (&c, &v)) in codes.iter().zip(&x).enumerate() {
                        assert_eq!(c, by_search(t, v * id), "{t:?}: {i} of {len}");
                    }
                }
            }
        }
    }
}
