//! 8-bit floating-point codes (OCP FP8): `e4m3` (the `float8_e4m3fn` of
//! PyTorch, vLLM and TensorRT-LLM: 4 exponent bits, bias 7, 3 mantissa bits,
//! no infinities, largest 448) and `e5m2` (bias 15, 2 mantissa bits,
//! largest finite 57344), each byte times one scale per group.
//!
//! The bytes are the standard encodings, so a cache's codes can be handed
//! to anything that reads fp8. Encoding divides by the group's scale
//! (`absmax / largest`, stored to the nearest value of the scale format)
//! and rounds to the nearest fp8 value, ties to the even mantissa,
//! saturating at the largest finite one; NaN and infinity are never
//! produced.
//!
//! Decoding needs no table: placing the 7 magnitude bits of an `e4m3` byte
//! at bit 20 of an `f32` (`e5m2`: bit 21) gives a float `2^-120`
//! (`2^-112`) times the value — subnormals included, since both formats
//! read a zero exponent field the same way — so a decode is a shift, an or
//! with the sign and one multiply.

/// An fp8 format: [`E4M3`] or [`E5M2`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8 {
    /// Mantissa bits (3 for e4m3, 2 for e5m2).
    man: u32,
    /// Largest finite value.
    pub max: f32,
    /// Code of the largest finite magnitude.
    max_code: u8,
}

/// `e4m3fn`.
pub const E4M3: Fp8 = Fp8 {
    man: 3,
    max: 448.0,
    max_code: 0x7e,
};

/// `e5m2`.
pub const E5M2: Fp8 = Fp8 {
    man: 2,
    max: 57344.0,
    max_code: 0x7b,
};

impl Fp8 {
    /// Where the magnitude bits go in an `f32`.
    #[inline]
    pub(crate) fn shift(self) -> u32 {
        23 - self.man
    }

    /// What the shifted float is multiplied by: `2^(127 − bias)`.
    #[inline]
    pub(crate) fn factor(self) -> f32 {
        match self.man {
            3 => f32::from_bits((127 + 120) << 23),
            _ => f32::from_bits((127 + 112) << 23),
        }
    }

    /// The value of code `b` (a NaN code of `e4m3fn`, `0x7f`/`0xff`, or an
    /// infinity or NaN of `e5m2` decodes to a finite number: such codes are
    /// never written).
    #[inline]
    pub fn decode(self, b: u8) -> f32 {
        Self::decode_with(b, self.shift(), self.factor())
    }

    /// [`decode`](Self::decode) with the format's [`shift`](Self::shift)
    /// and [`factor`](Self::factor) given.
    #[inline]
    pub(crate) fn decode_with(b: u8, shift: u32, factor: f32) -> f32 {
        let bits = (u32::from(b & 0x80) << 24) | (u32::from(b & 0x7f) << shift);
        f32::from_bits(bits) * factor
    }

    /// The code nearest to `x` (finite), ties to the even code, beyond the
    /// largest finite value saturating to it.
    pub fn encode(self, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        if a >= self.max {
            return sign | self.max_code;
        }
        // Magnitude codes are ordered by value: the largest code whose
        // value is at most `a`.
        let (mut lo, mut hi) = (0u8, self.max_code);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.decode(mid) <= a {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let (vl, vh) = (self.decode(lo), self.decode(hi));
        let code = if a - vl < vh - a || (a - vl == vh - a && lo % 2 == 0) {
            lo
        } else {
            hi
        };
        sign | code
    }
}
