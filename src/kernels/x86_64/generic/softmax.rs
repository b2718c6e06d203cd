//! The vectorized softmax.

use super::*;

/// `x ← e^(x − max)`, returning `(max, Σ)`; see
/// [`crate::kernels::softmax_parts`].
#[inline(always)]
pub(crate) fn softmax_parts<S: Simd>(s: S, x: &mut [f32]) -> (f32, f32) {
    let n = x.len();
    let body = n / S::L * S::L;
    let p = x.as_mut_ptr();
    let mut m = s.splat(f32::NEG_INFINITY);
    for i in (0..body).step_by(S::L) {
        // SAFETY: `i + L ≤ body ≤ n`.
        m = s.max(m, unsafe { s.load(p.add(i)) });
    }
    let mx = x[body..].iter().fold(s.hmax(m), |a, &b| a.max(b));
    let mv = s.splat(mx);
    let mut sum = [s.zero(); 2];
    for (k, i) in (0..body).step_by(S::L).enumerate() {
        // SAFETY: `i + L ≤ body ≤ n`.
        unsafe {
            let e = s.exp(s.sub(s.load(p.add(i)), mv));
            s.store(p.add(i), e);
            sum[k % 2] = s.add(sum[k % 2], e);
        }
    }
    let mut total = s.hsum(s.add(sum[0], sum[1]));
    if body < n {
        // The tail through the same vector `exp`, padded with -inf (→ 0).
        let mut t = [f32::NEG_INFINITY; 16];
        t[..n - body].copy_from_slice(&x[body..]);
        // SAFETY: `t` holds 16 ≥ L floats.
        unsafe {
            let e = s.exp(s.sub(s.load(t.as_ptr()), mv));
            total += s.hsum(e);
            s.store(t.as_mut_ptr(), e);
        }
        x[body..].copy_from_slice(&t[..n - body]);
    }
    (mx, total)
}

/// `x ← x·k`.
#[inline(always)]
pub(crate) fn scale_in_place<S: Simd>(s: S, x: &mut [f32], k: f32) {
    let n = x.len();
    let body = n / S::L * S::L;
    let p = x.as_mut_ptr();
    for i in (0..body).step_by(S::L) {
        // SAFETY: `i + L ≤ body ≤ n`.
        unsafe { s.store(p.add(i), s.mul(s.load(p.add(i)), s.splat(k))) };
    }
    for v in &mut x[body..] {
        *v *= k;
    }
}
