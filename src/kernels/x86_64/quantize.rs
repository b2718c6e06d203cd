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
use crate::scheme::{Layout, QuantScheme, ScaleFormat};

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
    ($tok:ident $(, { $($extra:tt)* })?) => {
        impl QuantOps for $tok {
            $($($extra)*)?
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
quant_ops!(Avx512, {
    #[inline(always)]
    fn group_params(
        self,
        s: &QuantScheme,
        mins: &[f32],
        maxs: &[f32],
        scales: &mut [f32],
        zeros: &mut [f32],
    ) -> std::result::Result<(), usize> {
        Avx512::group_params(self, s, mins, maxs, scales, zeros)
    }
    #[inline(always)]
    fn write_params(self, fmt: ScaleFormat, vals: &[f32], out: &mut [u8]) {
        Avx512::write_params(self, fmt, vals, out)
    }
});

#[cfg(test)]
mod tests {
    use super::*;
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
