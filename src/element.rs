//! The element types kvq accepts: `f32`, `half::f16`, `half::bf16`.

use half::{bf16, f16};

mod private {
    use half::slice::HalfFloatSliceExt;

    pub trait Sealed: Sized {
        /// The slice itself when the type is `f32`.
        fn f32s(_: &[Self]) -> Option<&[f32]> {
            None
        }
        /// Widen `x` into `out` (same length).
        fn widen(x: &[Self], out: &mut [f32]);
    }
    impl Sealed for f32 {
        fn f32s(x: &[f32]) -> Option<&[f32]> {
            Some(x)
        }
        fn widen(x: &[f32], out: &mut [f32]) {
            out.copy_from_slice(x);
        }
    }
    impl Sealed for half::f16 {
        fn widen(x: &[half::f16], out: &mut [f32]) {
            // F16C / NEON where the CPU has it (half's runtime dispatch).
            x.convert_to_f32_slice(out);
        }
    }
    impl Sealed for half::bf16 {
        fn widen(x: &[half::bf16], out: &mut [f32]) {
            x.convert_to_f32_slice(out);
        }
    }
}

/// A floating-point element of K, V or Q: `f32`, [`f16`](struct@half::f16) or [`bf16`](struct@half::bf16).
///
/// Everything that takes model data is generic over this one trait, so an
/// engine passes its tensors as they are. Sealed: kvq's kernels are written
/// for exactly these three.
pub trait Element: Copy + Send + Sync + 'static + private::Sealed {
    /// The type's name (`"f32"`, `"f16"`, `"bf16"`).
    const NAME: &'static str;
    /// Widen to `f32` (exact for all three).
    fn to_f32(self) -> f32;
    /// Narrow from `f32`, rounding to nearest.
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for f16 {
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Element for bf16 {
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Widen a slice into `out` (cleared first).
pub(crate) fn widen_into<T: Element>(x: &[T], out: &mut Vec<f32>) {
    out.clear();
    out.resize(x.len(), 0.0);
    T::widen(x, out);
}

/// `x` as `f32` values: borrowed when `T` is `f32`, else widened into
/// `buf`.
pub(crate) fn as_f32<'a, T: Element>(x: &'a [T], buf: &'a mut Vec<f32>) -> &'a [f32] {
    match T::f32s(x) {
        Some(f) => f,
        None => {
            widen_into(x, buf);
            buf
        }
    }
}
