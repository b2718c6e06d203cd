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

use super::Simd;
use super::{Avx2, Avx512};
use crate::error::Result;
use crate::quant::{self, code_of, QuantOps};
use crate::scheme::Layout;

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

/// The vector [`QuantOps`] of a feature token.
macro_rules! quant_ops {
    ($tok:ident) => {
        impl QuantOps for $tok {
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
            fn codes_pc(
                self,
                xs: &[f32],
                inv: &[f32],
                zero: &[f32],
                max_code: f32,
                out: &mut [u8],
            ) {
                let n = xs.len().min(out.len());
                let (inv, zero) = (&inv[..n], &zero[..n]);
                let v = |i: usize| {
                    // SAFETY: `codes` asks for lanes `i..i+L ≤ n` only,
                    // and both slices hold `n` floats.
                    unsafe {
                        (
                            self.load(inv.as_ptr().add(i)),
                            self.load(zero.as_ptr().add(i)),
                        )
                    }
                };
                codes(self, xs, out, max_code, v, |i| (inv[i], zero[i]));
            }
        }
    };
}

quant_ops!(Avx2);
quant_ops!(Avx512);
