//! The quantizer's hot loops (group min/max, codes, bit packing) compiled
//! for AVX2 and AVX-512.
//!
//! The driver is the portable code of [`crate::quant`], generic over
//! [`QuantOps`] and `#[inline(always)]` all the way down, compiled inside
//! `#[target_feature]` entry points; the tokens supply explicit vector
//! versions of the per-element loops (group min/max with the finiteness
//! check, and the codes). They are the same IEEE operations per element as
//! the scalar loops (min/max are exact in any order), so every backend
//! produces **bit-identical** packed bytes (tested in
//! `tests/kernels_backends.rs`); only the speed differs.

use crate::quant::{code_of, QuantOps, Scalar};
use crate::scheme::{Mode, QuantScheme, ScaleFormat};
use crate::simd::x86_64::{Avx512, Simd};
use core::arch::x86_64::*;

/// [`QuantOps::min_max_finite`] over `S` vectors, scalar tail.
#[inline(always)]
fn min_max_finite<S: Simd>(s: S, x: &[f32]) -> (f32, f32, bool) {
    let n = x.len() / S::L * S::L;
    let (mut lo, mut hi, mut bad) = (
        s.splat(f32::INFINITY),
        s.splat(f32::NEG_INFINITY),
        s.zero_i(),
    );
    let mut i = 0;
    while i < n {
        // SAFETY: `i + L ≤ n ≤ x.len()`.
        let v = unsafe { s.load(x.as_ptr().add(i)) };
        // `a < b ? a : b` with the value first: the scalar select exactly.
        lo = s.min(v, lo);
        hi = s.max(v, hi);
        bad = s.or_nonfinite(bad, v);
        i += S::L;
    }
    let (mut lo, mut hi, mut ok) = (s.hmin(lo), s.hmax(hi), !s.any(bad));
    for &v in &x[n..] {
        lo = if v < lo { v } else { lo };
        hi = if v > hi { v } else { hi };
        ok &= v.is_finite();
    }
    (lo, hi, ok)
}

/// `out[i] = code_of(xs[i], inv_i, zero_i, max_code)` over `S` vectors,
/// with `params(i)` the vectors of `(1/scale, zero)` for lanes `i..i+L`
/// and `scalar(i)` the same for one element of the tail.
#[inline(always)]
fn codes<S: Simd>(
    s: S,
    xs: &[f32],
    out: &mut [u8],
    max_code: f32,
    params: impl Fn(usize) -> (S::F, S::F),
    scalar: impl Fn(usize) -> (f32, f32),
) {
    let len = xs.len().min(out.len());
    let n = len / S::L * S::L;
    let (vm, vh, v0) = (s.splat(max_code), s.splat(0.5), s.zero());
    let mut i = 0;
    while i < n {
        let (vi, vz) = params(i);
        // SAFETY: `L` floats read and `L` bytes written at `i + L ≤ n ≤ len`.
        unsafe {
            let y = s.mul(s.sub(s.load(xs.as_ptr().add(i)), vz), vi);
            // The operations of `code_of`, in its order.
            let y = s.add(s.min(s.max(y, v0), vm), vh);
            s.store_u8_trunc(out.as_mut_ptr().add(i), y);
        }
        i += S::L;
    }
    for i in n..len {
        let (is, z) = scalar(i);
        out[i] = code_of(xs[i], is, z, max_code);
    }
}

/// The vector [`QuantOps`] of every token; AVX-512 also vectorizes the
/// group params and their stores (bit-identical to the scalar code).
impl<S: Simd> QuantOps for S {
    #[inline(always)]
    fn min_max_finite(self, x: &[f32]) -> (f32, f32, bool) {
        min_max_finite(self, x)
    }
    #[inline(always)]
    fn codes(self, xs: &[f32], inv_scale: f32, zero: f32, max_code: f32, out: &mut [u8]) {
        let (vi, vz) = (self.splat(inv_scale), self.splat(zero));
        codes(self, xs, out, max_code, |_| (vi, vz), |_| (inv_scale, zero));
    }
    #[inline(always)]
    fn codes_pc(self, xs: &[f32], inv: &[f32], zero: &[f32], max_code: f32, out: &mut [u8]) {
        let n = xs.len().min(out.len());
        let (inv, zero) = (&inv[..n], &zero[..n]);
        let v = |i: usize| {
            // SAFETY: `codes` asks for lanes `i..i+L ≤ n` only, and both
            // slices hold `n` floats.
            unsafe {
                (
                    self.load(inv.as_ptr().add(i)),
                    self.load(zero.as_ptr().add(i)),
                )
            }
        };
        codes(self, xs, out, max_code, v, |i| (inv[i], zero[i]));
    }
    #[inline(always)]
    fn group_params(
        self,
        s: &QuantScheme,
        mins: &[f32],
        maxs: &[f32],
        scales: &mut [f32],
        zeros: &mut [f32],
    ) -> std::result::Result<(), usize> {
        match self.avx512() {
            Some(a) => a.group_params(s, mins, maxs, scales, zeros),
            None => Scalar.group_params(s, mins, maxs, scales, zeros),
        }
    }
    #[inline(always)]
    fn write_params(self, fmt: ScaleFormat, vals: &[f32], out: &mut [u8]) {
        match self.avx512() {
            Some(a) => a.write_params(fmt, vals, out),
            None => Scalar.write_params(fmt, vals, out),
        }
    }
}

/// Rounding immediates for the embedded-rounding and F16C conversions.
const UP: i32 = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;

impl Avx512 {
    /// [`crate::quant::group_params`] of every group, eight at a time: the same
    /// IEEE operations in the same order (f64 subtract and divide, f64→f32
    /// rounded up by the conversion's embedded rounding, f32→f16 rounded
    /// by F16C's immediate, f32→bf16 in integers), so the results are
    /// bit-identical to the scalar code. The last `< 8` groups take the
    /// scalar code. See [`QuantOps::group_params`].
    #[inline(always)]
    pub(crate) fn group_params(
        self,
        s: &QuantScheme,
        mins: &[f32],
        maxs: &[f32],
        scales: &mut [f32],
        zeros: &mut [f32],
    ) -> Result<(), usize> {
        let n = mins.len();
        assert!(maxs.len() >= n && scales.len() >= n && zeros.len() >= n);
        let fmt = s.scale_format();
        let bits = s.bits() as u32;
        let sym = s.mode() == Mode::Symmetric;
        let levels = ((1u32 << bits) - 1) as f32;
        let qmax = ((1u32 << (bits - 1)) - 1) as f64;
        let half = (1u32 << (bits - 1)) as f32;
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: lanes `i..i+8 ≤ n` of slices of at least `n` floats
            // (asserted above); `self` proves AVX-512F/VL and F16C.
            let bad = unsafe {
                let mn = _mm256_loadu_ps(mins.as_ptr().add(i));
                let mx = _mm256_loadu_ps(maxs.as_ptr().add(i));
                let vl = _mm256_set1_ps(levels);
                let (scale, zero, bad) = if sym {
                    let am = _mm256_max_ps(abs8(mn), abs8(mx));
                    let d = _mm512_div_pd(_mm512_cvtps_pd(am), _mm512_set1_pd(qmax));
                    let scale = up_fmt(fmt, _mm512_cvt_roundpd_ps::<UP>(d));
                    let zero = _mm256_mul_ps(neg8(scale), _mm256_set1_ps(half));
                    let top = _mm256_mul_ps(scale, vl);
                    (
                        scale,
                        zero,
                        nonfinite8(scale) | nonfinite8(zero) | nonfinite8(top),
                    )
                } else {
                    // round_down(x) = −round_up(−x); `min` is an f32, so only
                    // the format rounds.
                    let zero = neg8(up_fmt(fmt, neg8(mn)));
                    let diff = _mm512_sub_pd(_mm512_cvtps_pd(mx), _mm512_cvtps_pd(zero));
                    let d = _mm512_div_pd(diff, _mm512_set1_pd(levels as f64));
                    let scale = up_fmt(fmt, _mm512_cvt_roundpd_ps::<UP>(d));
                    let top = _mm256_add_ps(_mm256_mul_ps(scale, vl), zero);
                    (
                        scale,
                        zero,
                        nonfinite8(zero) | nonfinite8(scale) | nonfinite8(top),
                    )
                };
                _mm256_storeu_ps(scales.as_mut_ptr().add(i), scale);
                _mm256_storeu_ps(zeros.as_mut_ptr().add(i), zero);
                bad
            };
            if bad != 0 {
                return Err(i + bad.trailing_zeros() as usize);
            }
            i += 8;
        }
        Scalar
            .group_params(
                s,
                &mins[i..n],
                &maxs[i..n],
                &mut scales[i..n],
                &mut zeros[i..n],
            )
            .map_err(|j| i + j)
    }

    /// [`QuantOps::write_params`] eight values at a time (exact
    /// conversions: every value is representable), scalar tail.
    #[inline(always)]
    pub(crate) fn write_params(self, fmt: ScaleFormat, vals: &[f32], out: &mut [u8]) {
        let fb = fmt.bytes();
        let n = vals.len();
        assert!(out.len() >= n * fb);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: reads floats `i..i+8 ≤ n`, writes bytes `i·fb..(i+8)·fb
            // ≤ n·fb` (asserted); AVX-512F/VL, F16C.
            unsafe {
                let v = _mm256_loadu_ps(vals.as_ptr().add(i));
                let dst = out.as_mut_ptr().add(i * fb);
                match fmt {
                    ScaleFormat::F16 => {
                        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_POS_INF>(v);
                        _mm_storeu_si128(dst as *mut __m128i, h)
                    }
                    ScaleFormat::Bf16 => {
                        let h = _mm256_srli_epi32::<16>(_mm256_castps_si256(v));
                        _mm_storeu_si128(dst as *mut __m128i, _mm256_cvtepi32_epi16(h))
                    }
                    ScaleFormat::F32 => _mm256_storeu_ps(dst as *mut f32, v),
                }
            }
            i += 8;
        }
        Scalar.write_params(fmt, &vals[i..], &mut out[i * fb..]);
    }
}

/// `|x|` lanewise.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn abs8(x: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_castps_si256(x),
            _mm256_set1_epi32(0x7FFF_FFFF),
        ))
    }
}

/// `−x` lanewise (sign flip, exact).
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn neg8(x: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe { _mm256_xor_ps(x, _mm256_set1_ps(-0.0)) }
}

/// Bit `k` set where lane `k` is NaN or ±inf.
///
/// # Safety
/// AVX-512F/VL.
#[inline(always)]
unsafe fn nonfinite8(x: __m256) -> u8 {
    // SAFETY: the caller's contract.
    unsafe {
        let e = _mm256_set1_epi32(0x7F80_0000);
        _mm256_cmpeq_epi32_mask(_mm256_and_si256(_mm256_castps_si256(x), e), e)
    }
}

/// `ScaleFormat::round_up` of f32 lanes: the least number of the format
/// that is `≥ x` (f16 by F16C's round-up immediate, which saturates and
/// makes subnormals as the scalar code does; bf16 by truncating the low 16
/// bits and stepping positive inexact values up).
///
/// # Safety
/// AVX-512F/VL, F16C.
#[inline(always)]
unsafe fn up_fmt(fmt: ScaleFormat, x: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        match fmt {
            ScaleFormat::F32 => x,
            ScaleFormat::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_POS_INF>(x)),
            ScaleFormat::Bf16 => {
                let b = _mm256_castps_si256(x);
                let t = _mm256_srli_epi32::<16>(b);
                let step = _mm256_test_epi32_mask(b, _mm256_set1_epi32(0xFFFF))
                    & _mm256_cmpge_epi32_mask(b, _mm256_setzero_si256());
                let t = _mm256_mask_add_epi32(t, step, t, _mm256_set1_epi32(1));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(t))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;
    use crate::scheme::{Axis, Group, Mode};

    /// xorshift64.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Finite f32s of every magnitude: random bits (subnormals, huge
        /// values), values near the f16 range edges, zeros, and small
        /// integers.
        fn value(&mut self) -> f32 {
            let r = self.next();
            let x = match r % 6 {
                0 => f32::from_bits((r >> 32) as u32),
                1 => f32::from_bits((r >> 8) as u32 & 0x807F_FFFF | 0x4700_0000),
                2 => (r >> 40) as f32 * 1e-12,
                3 => 0.0,
                4 => ((r >> 32) as i32 % 9) as f32,
                _ => f32::from_bits((r >> 16) as u32 & 0x80FF_FFFF | 0x3800_0000),
            };
            if x.is_finite() {
                x
            } else {
                1.0
            }
        }
    }

    /// The AVX-512 group params are bit-identical to the scalar ones, and
    /// report the same first overflowing group, for every width, mode and
    /// format over values of every magnitude.
    #[test]
    fn avx512_group_params_match_scalar() {
        let Some(s) = Avx512::new() else {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        };
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut errs = 0;
        for bits in 1..=8u8 {
            for mode in [Mode::Asymmetric, Mode::Symmetric] {
                if mode == Mode::Symmetric && bits < 2 {
                    continue;
                }
                for fmt in [ScaleFormat::F16, ScaleFormat::Bf16, ScaleFormat::F32] {
                    let sc = QuantScheme::new(bits, Axis::PerToken, Group::Size(32))
                        .unwrap()
                        .with_mode(mode)
                        .unwrap()
                        .with_scale_format(fmt);
                    for _ in 0..400 {
                        let n = 1 + (rng.next() % 40) as usize;
                        let (mut mins, mut maxs) = (vec![0f32; n], vec![0f32; n]);
                        for i in 0..n {
                            let (a, b) = (rng.value(), rng.value());
                            (mins[i], maxs[i]) = if a <= b { (a, b) } else { (b, a) };
                        }
                        let (mut s1, mut z1) = (vec![0f32; n], vec![0f32; n]);
                        let (mut s2, mut z2) = (vec![0f32; n], vec![0f32; n]);
                        let want = quant::Scalar.group_params(&sc, &mins, &maxs, &mut s1, &mut z1);
                        let got = QuantOps::group_params(s, &sc, &mins, &maxs, &mut s2, &mut z2);
                        assert_eq!(want, got, "{} {mins:?} {maxs:?}", sc.label());
                        let upto = want.err().unwrap_or(n);
                        errs += usize::from(upto < n);
                        for i in 0..upto {
                            assert_eq!(
                                (s1[i].to_bits(), z1[i].to_bits()),
                                (s2[i].to_bits(), z2[i].to_bits()),
                                "{} group {i}: min {} max {}",
                                sc.label(),
                                mins[i],
                                maxs[i]
                            );
                        }
                        let fb = fmt.bytes();
                        let (mut b1, mut b2) = (vec![0u8; upto * fb], vec![0u8; upto * fb]);
                        quant::Scalar.write_params(fmt, &s1[..upto], &mut b1);
                        QuantOps::write_params(s, fmt, &s1[..upto], &mut b2);
                        assert_eq!(b1, b2, "{}", sc.label());
                    }
                }
            }
        }
        assert!(errs > 50, "only {errs} overflow cases");
    }
}
