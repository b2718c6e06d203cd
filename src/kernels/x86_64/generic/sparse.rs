//! The blocked transpose and sparse row updates of the outlier post-passes.

use super::*;

/// `dst[j·ldd + i] (+)= src[i·lds + j]` for the whole `L × L` blocks of
/// rows `0..rb` and columns `0..cb` (multiples of `L`).
///
/// # Safety
/// `src` holds rows `0..rb` of stride `lds` to column `cb`, and `dst` rows
/// `0..cb` of stride `ldd` to column `rb`.
#[inline(always)]
pub(crate) unsafe fn transpose_blocks<S: Simd>(
    s: S,
    (src, lds): (&[f32], usize),
    (rb, cb): (usize, usize),
    (dst, ldd): (&mut [f32], usize),
    add: bool,
) {
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for i0 in (0..rb).step_by(S::L) {
        for j0 in (0..cb).step_by(S::L) {
            let mut a = [s.zero(); 16];
            // SAFETY: row `i0 + k < rb`, columns `j0..j0 + L ≤ cb` of
            // `src`; row `j0 + k < cb`, columns `i0..i0 + L ≤ rb` of `dst`
            // (the caller's extents).
            unsafe {
                unroll!(16 max S::L; k in 0, S::L => {
                    a[k] = s.load(sp.add((i0 + k) * lds + j0));
                });
                s.transpose(&mut a);
                if add {
                    unroll!(16 max S::L; k in 0, S::L => {
                        a[k] = s.add(a[k], s.load(dp.add((j0 + k) * ldd + i0)));
                    });
                }
                unroll!(16 max S::L; k in 0, S::L => {
                    s.store(dp.add((j0 + k) * ldd + i0), a[k]);
                });
            }
        }
    }
}

/// `dst[d·w..][..w] += r·src[s·w..][..w]` for each update; see
/// [`crate::kernels::sparse::rows_axpy_on`].
///
/// # Safety
/// Every update's rows lie inside `src` and `dst`.
#[inline(always)]
pub(crate) unsafe fn rows_axpy<S: Simd>(
    s: S,
    updates: &[(u32, u32, f32)],
    swap: bool,
    (src, w): (&[f32], usize),
    dst: &mut [f32],
) {
    let body = w / S::L * S::L;
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for &(a, b, r) in updates {
        let (d, x) = if swap { (b, a) } else { (a, b) };
        let rv = s.splat(r);
        // SAFETY: rows `d` and `x` of `w` floats are in `dst` and `src`
        // (the caller's check).
        unsafe {
            let (o, i) = (dp.add(d as usize * w), sp.add(x as usize * w));
            for k in (0..body).step_by(S::L) {
                s.store(o.add(k), s.fma(s.load(i.add(k)), rv, s.load(o.add(k))));
            }
            for k in body..w {
                *o.add(k) += r * *i.add(k);
            }
        }
    }
}
