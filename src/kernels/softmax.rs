//! The softmax of attention logits, whole or in mergeable parts.

use super::Backend;
use crate::simd::Kernel;

/// The numerically stable softmax of attention logits, in place:
/// `x_t ← e^(x_t − max) / Σ_u e^(x_u − max)`. Uses [`Backend::detect`].
///
/// The SIMD backends evaluate `e^x` with a vectorized Cephes `expf`
/// (within 2 ulp of the true value; `0` below `e^-87.3`, where `f32` is
/// subnormal), about 20x faster than the scalar `f32::exp` the portable
/// backend uses; the two agree to about `1e-6` relative. An empty `x` is
/// left as is.
///
/// # Example: attention weights
/// ```
/// let mut x = vec![1.0f32, 2.0, 3.0];
/// kvq::kernels::softmax(&mut x);
/// assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
/// assert!((x[2] - 0.665_240_9).abs() < 1e-6);
/// ```
pub fn softmax(x: &mut [f32]) {
    softmax_on(Backend::detect(), x)
}

/// [`softmax`] on a chosen backend.
pub fn softmax_on(backend: Backend, x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let (_, sum) = softmax_parts_on(backend, x);
    backend.dispatch(Scale { x, k: 1.0 / sum })
}

/// The unnormalized half of a softmax, for merging chunks
/// (flash-decoding): `x_t ← e^(x_t − m)` with `m = max_t x_t`, returning
/// `(m, Σ_t e^(x_t − m))`. Returns `(-inf, 0)` for an empty `x`.
///
/// Two chunks `(m₁, s₁)`, `(m₂, s₂)` with weighted sums `o₁`, `o₂` combine
/// as `m = max(m₁, m₂)`, `s = s₁·e^(m₁−m) + s₂·e^(m₂−m)`,
/// `o = (o₁·e^(m₁−m) + o₂·e^(m₂−m)) / s`.
pub fn softmax_parts(x: &mut [f32]) -> (f32, f32) {
    softmax_parts_on(Backend::detect(), x)
}

/// [`softmax_parts`] on a chosen backend.
pub fn softmax_parts_on(backend: Backend, x: &mut [f32]) -> (f32, f32) {
    if x.is_empty() {
        return (f32::NEG_INFINITY, 0.0);
    }
    backend.dispatch(SoftmaxParts(x))
}

/// `x ← e^(x − max)`, returning `(max, Σ)`.
struct SoftmaxParts<'a>(&'a mut [f32]);

impl Kernel for SoftmaxParts<'_> {
    type Output = (f32, f32);

    fn portable(self) -> (f32, f32) {
        let x = self.0;
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Summed in f64: a sequential f32 sum of thousands of terms drifts
        // past the 1e-6 the backends are documented to agree to.
        let mut sum = 0f64;
        for v in x.iter_mut() {
            *v = (*v - m).exp();
            sum += *v as f64;
        }
        (m, sum as f32)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: super::x86_64::Simd>(self, s: S) -> (f32, f32) {
        super::x86_64::generic::softmax_parts(s, self.0)
    }
}

/// `x ← x·k`.
struct Scale<'a> {
    x: &'a mut [f32],
    k: f32,
}

impl Kernel for Scale<'_> {
    type Output = ();

    fn portable(self) {
        self.x.iter_mut().for_each(|v| *v *= self.k);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: super::x86_64::Simd>(self, s: S) {
        super::x86_64::generic::scale_in_place(s, self.x, self.k)
    }
}
