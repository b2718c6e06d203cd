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

use super::{Avx2, Avx512};
use crate::error::Result;
use crate::quant::{self, code_of, QuantOps};
use crate::scheme::Layout;
use core::arch::x86_64::*;

/// Generates the safe methods on a feature token and their
/// `#[target_feature]` entry points.
macro_rules! quantize_entries {
    ($tok:ident, $feat:literal, $token_fn:ident, $block_fn:ident) => {
        impl $tok {
            /// [`quant::quantize_token_generic`] compiled for this token's
            /// features.
            pub(crate) fn quantize_token(
                self,
                l: &Layout,
                x: &[f32],
                token: usize,
                codes: &mut [u8],
                params: &mut [u8],
            ) -> Result<()> {
                // SAFETY: holding `self` proves the CPU has every feature
                // the entry point enables; the body is safe code.
                unsafe { $token_fn(self, l, x, token, codes, params) }
            }

            /// [`quant::quantize_channel_block_generic`] compiled for this
            /// token's features.
            #[allow(clippy::too_many_arguments)]
            pub(crate) fn quantize_channel_block(
                self,
                l: &Layout,
                rows: &[f32],
                tb: usize,
                h: usize,
                token0: usize,
                codes: &mut [u8],
                params: &mut [u8],
            ) -> Result<()> {
                // SAFETY: as in `quantize_token`.
                unsafe { $block_fn(self, l, rows, tb, h, token0, codes, params) }
            }
        }

        #[target_feature(enable = $feat)]
        unsafe fn $token_fn(
            s: $tok,
            l: &Layout,
            x: &[f32],
            token: usize,
            codes: &mut [u8],
            params: &mut [u8],
        ) -> Result<()> {
            quant::quantize_token_generic(s, l, x, token, codes, params)
        }

        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $block_fn(
            s: $tok,
            l: &Layout,
            rows: &[f32],
            tb: usize,
            h: usize,
            token0: usize,
            codes: &mut [u8],
            params: &mut [u8],
        ) -> Result<()> {
            quant::quantize_channel_block_generic(s, l, rows, tb, h, token0, codes, params)
        }
    };
}

quantize_entries!(Avx2, "avx2,fma,f16c", token_avx2, block_avx2);
quantize_entries!(
    Avx512,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    token_avx512,
    block_avx512
);

/// Scalar tail of a min/max pass.
#[inline(always)]
fn tail_min_max(x: &[f32], mut lo: f32, mut hi: f32, mut ok: bool) -> (f32, f32, bool) {
    for &v in x {
        lo = if v < lo { v } else { lo };
        hi = if v > hi { v } else { hi };
        ok &= v.is_finite();
    }
    (lo, hi, ok)
}

impl QuantOps for Avx512 {
    #[inline(always)]
    fn min_max_finite(self, x: &[f32]) -> (f32, f32, bool) {
        let n = x.len() / 16 * 16;
        // SAFETY: `self` proves AVX-512F; loads at `i + 16 ≤ n ≤ x.len()`.
        let (lo, hi, ok) = unsafe {
            let mut lo = _mm512_set1_ps(f32::INFINITY);
            let mut hi = _mm512_set1_ps(f32::NEG_INFINITY);
            // `v − v` is +0 for finite `v`, NaN (nonzero bits) otherwise.
            let mut bad = _mm512_setzero_si512();
            let mut i = 0;
            while i < n {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                // minps(a, b) = a < b ? a : b, the scalar select exactly.
                lo = _mm512_min_ps(v, lo);
                hi = _mm512_max_ps(v, hi);
                bad = _mm512_or_si512(bad, _mm512_castps_si512(_mm512_sub_ps(v, v)));
                i += 16;
            }
            (
                _mm512_reduce_min_ps(lo),
                _mm512_reduce_max_ps(hi),
                _mm512_test_epi32_mask(bad, bad) == 0,
            )
        };
        tail_min_max(&x[n..], lo, hi, ok)
    }

    #[inline(always)]
    fn codes(self, xs: &[f32], inv_scale: f32, zero: f32, max_code: f32, out: &mut [u8]) {
        let len = xs.len().min(out.len());
        let n = len / 16 * 16;
        // SAFETY: `self` proves AVX-512F; 16 floats read and 16 bytes
        // written at `i + 16 ≤ n ≤ len`.
        unsafe {
            let (vi, vz) = (_mm512_set1_ps(inv_scale), _mm512_set1_ps(zero));
            let (vm, vh, v0) = (
                _mm512_set1_ps(max_code),
                _mm512_set1_ps(0.5),
                _mm512_setzero_ps(),
            );
            let mut i = 0;
            while i < n {
                let v = _mm512_loadu_ps(xs.as_ptr().add(i));
                let y = _mm512_mul_ps(_mm512_sub_ps(v, vz), vi);
                let y = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(y, v0), vm), vh);
                let c = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(y));
                _mm_storeu_si128(out.as_mut_ptr().add(i) as *mut __m128i, c);
                i += 16;
            }
        }
        for i in n..len {
            out[i] = code_of(xs[i], inv_scale, zero, max_code);
        }
    }

    #[inline(always)]
    fn codes_pc(self, xs: &[f32], inv: &[f32], zero: &[f32], max_code: f32, out: &mut [u8]) {
        let len = xs.len().min(inv.len()).min(zero.len()).min(out.len());
        let n = len / 16 * 16;
        // SAFETY: as in `codes`, for all four slices.
        unsafe {
            let (vm, vh, v0) = (
                _mm512_set1_ps(max_code),
                _mm512_set1_ps(0.5),
                _mm512_setzero_ps(),
            );
            let mut i = 0;
            while i < n {
                let v = _mm512_loadu_ps(xs.as_ptr().add(i));
                let vz = _mm512_loadu_ps(zero.as_ptr().add(i));
                let vi = _mm512_loadu_ps(inv.as_ptr().add(i));
                let y = _mm512_mul_ps(_mm512_sub_ps(v, vz), vi);
                let y = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(y, v0), vm), vh);
                let c = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(y));
                _mm_storeu_si128(out.as_mut_ptr().add(i) as *mut __m128i, c);
                i += 16;
            }
        }
        for i in n..len {
            out[i] = code_of(xs[i], inv[i], zero[i], max_code);
        }
    }
}

/// Eight dwords (each < 256) to eight bytes, in order.
#[inline(always)]
fn narrow8(c: __m256i) -> __m128i {
    // SAFETY: only reached from code that holds an `Avx2` token.
    unsafe {
        let w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
        _mm_packus_epi16(w, w)
    }
}

impl QuantOps for Avx2 {
    #[inline(always)]
    fn min_max_finite(self, x: &[f32]) -> (f32, f32, bool) {
        let n = x.len() / 8 * 8;
        // SAFETY: `self` proves AVX2; loads at `i + 8 ≤ n ≤ x.len()`.
        let (lo, hi, ok) = unsafe {
            let mut lo = _mm256_set1_ps(f32::INFINITY);
            let mut hi = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut bad = _mm256_setzero_si256();
            let mut i = 0;
            while i < n {
                let v = _mm256_loadu_ps(x.as_ptr().add(i));
                lo = _mm256_min_ps(v, lo);
                hi = _mm256_max_ps(v, hi);
                bad = _mm256_or_si256(bad, _mm256_castps_si256(_mm256_sub_ps(v, v)));
                i += 8;
            }
            let mut l = [0f32; 8];
            let mut h = [0f32; 8];
            _mm256_storeu_ps(l.as_mut_ptr(), lo);
            _mm256_storeu_ps(h.as_mut_ptr(), hi);
            let lo = l
                .iter()
                .fold(f32::INFINITY, |a, &b| if b < a { b } else { a });
            let hi = h
                .iter()
                .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
            (lo, hi, _mm256_testz_si256(bad, bad) == 1)
        };
        tail_min_max(&x[n..], lo, hi, ok)
    }

    #[inline(always)]
    fn codes(self, xs: &[f32], inv_scale: f32, zero: f32, max_code: f32, out: &mut [u8]) {
        let len = xs.len().min(out.len());
        let n = len / 8 * 8;
        // SAFETY: `self` proves AVX2; 8 floats read and 8 bytes written at
        // `i + 8 ≤ n ≤ len`.
        unsafe {
            let (vi, vz) = (_mm256_set1_ps(inv_scale), _mm256_set1_ps(zero));
            let (vm, vh, v0) = (
                _mm256_set1_ps(max_code),
                _mm256_set1_ps(0.5),
                _mm256_setzero_ps(),
            );
            let mut i = 0;
            while i < n {
                let v = _mm256_loadu_ps(xs.as_ptr().add(i));
                let y = _mm256_mul_ps(_mm256_sub_ps(v, vz), vi);
                let y = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(y, v0), vm), vh);
                let c = narrow8(_mm256_cvttps_epi32(y));
                _mm_storel_epi64(out.as_mut_ptr().add(i) as *mut __m128i, c);
                i += 8;
            }
        }
        for i in n..len {
            out[i] = code_of(xs[i], inv_scale, zero, max_code);
        }
    }

    #[inline(always)]
    fn codes_pc(self, xs: &[f32], inv: &[f32], zero: &[f32], max_code: f32, out: &mut [u8]) {
        let len = xs.len().min(inv.len()).min(zero.len()).min(out.len());
        let n = len / 8 * 8;
        // SAFETY: as in `codes`, for all four slices.
        unsafe {
            let (vm, vh, v0) = (
                _mm256_set1_ps(max_code),
                _mm256_set1_ps(0.5),
                _mm256_setzero_ps(),
            );
            let mut i = 0;
            while i < n {
                let v = _mm256_loadu_ps(xs.as_ptr().add(i));
                let vz = _mm256_loadu_ps(zero.as_ptr().add(i));
                let vi = _mm256_loadu_ps(inv.as_ptr().add(i));
                let y = _mm256_mul_ps(_mm256_sub_ps(v, vz), vi);
                let y = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(y, v0), vm), vh);
                let c = narrow8(_mm256_cvttps_epi32(y));
                _mm_storel_epi64(out.as_mut_ptr().add(i) as *mut __m128i, c);
                i += 8;
            }
        }
        for i in n..len {
            out[i] = code_of(xs[i], inv[i], zero[i], max_code);
        }
    }
}
