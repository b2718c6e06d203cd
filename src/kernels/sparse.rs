//! The outlier post-passes of many queries (prefill): transposes, so each
//! entry reads the queries or weights of one channel or token as a row, and
//! batches of sparse row updates on those rows.

use super::Backend;
use crate::simd::Kernel;

/// A row-major matrix in a slice: `rows × cols` floats, row `i` starting
/// at `i·ld` (`ld ≥ cols`).
#[derive(Clone, Copy)]
pub(crate) struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

impl Mat {
    /// Floats a slice must hold for it (0 for an empty matrix).
    fn span(self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        (self.rows - 1)
            .checked_mul(self.ld)
            .and_then(|n| n.checked_add(self.cols))
            .expect("transpose: size overflows")
    }
}

/// `dst[j·ldd + i] = src[i·m.ld + j]` for `src` holding `m`, or `+=` with
/// `add`. Panics if `m.ld < m.cols`, `ldd < m.rows` (with `m.cols > 0`), or
/// either slice is too short.
pub(crate) fn transpose_on(
    backend: Backend,
    (src, m): (&[f32], Mat),
    (dst, ldd): (&mut [f32], usize),
    add: bool,
) {
    let d = Mat {
        rows: m.cols,
        cols: m.rows,
        ld: ldd,
    };
    assert!(
        m.ld >= m.cols && (m.cols == 0 || ldd >= m.rows),
        "transpose: a stride is shorter than its rows"
    );
    assert!(
        src.len() >= m.span() && dst.len() >= d.span(),
        "transpose: slices too short"
    );
    backend.dispatch(Transpose {
        src,
        m,
        dst,
        ldd,
        add,
    })
}

/// The arguments, lengths checked.
struct Transpose<'a> {
    src: &'a [f32],
    m: Mat,
    dst: &'a mut [f32],
    ldd: usize,
    add: bool,
}

impl Kernel for Transpose<'_> {
    type Output = ();

    fn portable(self) {
        let m = self.m;
        scalar(
            self.src,
            m,
            (0, m.rows),
            (0, m.cols),
            (self.dst, self.ldd),
            self.add,
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: super::x86_64::Simd>(self, s: S) {
        let (m, ldd, add) = (self.m, self.ldd, self.add);
        let (rb, cb) = (m.rows / S::L * S::L, m.cols / S::L * S::L);
        // SAFETY: `transpose_on` checked both slices against the strides.
        unsafe {
            super::x86_64::generic::transpose_blocks(
                s,
                (self.src, m.ld),
                (rb, cb),
                (&mut *self.dst, ldd),
                add,
            )
        };
        // The rows and columns past the last whole block.
        scalar(
            self.src,
            m,
            (0, rb),
            (cb, m.cols),
            (&mut *self.dst, ldd),
            add,
        );
        scalar(self.src, m, (rb, m.rows), (0, m.cols), (self.dst, ldd), add);
    }
}

/// The portable loop over rows `r0..r1` and columns `c0..c1`, in blocks of
/// 16 columns so each source line is read once.
fn scalar(
    src: &[f32],
    m: Mat,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
    (dst, ldd): (&mut [f32], usize),
    add: bool,
) {
    for j0 in (c0..c1).step_by(16) {
        let j1 = (j0 + 16).min(c1);
        for i in r0..r1 {
            for (j, &v) in (j0..j1).zip(&src[i * m.ld + j0..i * m.ld + j1]) {
                let d = &mut dst[j * ldd + i];
                *d = if add { *d + v } else { v };
            }
        }
    }
}

/// `dst[d·w..(d + 1)·w] += r·src[s·w..(s + 1)·w]` for each `(a, b, r)` of
/// `updates`, with `(d, s) = (a, b)`, or `(b, a)` with `swap`: one
/// outlier entry's correction into every query's row. Panics if a row is
/// out of either slice.
pub(crate) fn rows_axpy_on(
    backend: Backend,
    updates: &[(u32, u32, f32)],
    swap: bool,
    (src, w): (&[f32], usize),
    dst: &mut [f32],
) {
    let rows = |len: usize| len.checked_div(w).unwrap_or(usize::MAX);
    let (ns, nd) = (rows(src.len()), rows(dst.len()));
    for &(a, b, _) in updates {
        let (d, s) = if swap { (b, a) } else { (a, b) };
        assert!(
            (d as usize) < nd && (s as usize) < ns,
            "rows_axpy: row out of range"
        );
    }
    backend.dispatch(RowsAxpy {
        updates,
        swap,
        src,
        w,
        dst,
    })
}

/// The arguments, rows checked.
struct RowsAxpy<'a> {
    updates: &'a [(u32, u32, f32)],
    swap: bool,
    src: &'a [f32],
    w: usize,
    dst: &'a mut [f32],
}

impl Kernel for RowsAxpy<'_> {
    type Output = ();

    fn portable(self) {
        let w = self.w;
        for &(a, b, r) in self.updates {
            let (d, s) = if self.swap { (b, a) } else { (a, b) };
            let (d, s) = (d as usize * w, s as usize * w);
            super::portable::axpy(r, &self.src[s..s + w], &mut self.dst[d..d + w]);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: super::x86_64::Simd>(self, s: S) {
        // SAFETY: `rows_axpy_on` checked every row against both slices.
        unsafe {
            super::x86_64::generic::rows_axpy(
                s,
                self.updates,
                self.swap,
                (self.src, self.w),
                self.dst,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every backend against the definition, over sizes with and without
    /// whole blocks of 8 and 16, dense and strided, with and without `add`.
    #[test]
    fn every_backend_transposes_every_size() {
        let mut ran = 0;
        for &b in &Backend::available() {
            for rows in [0, 1, 7, 8, 15, 16, 17, 33, 64] {
                for cols in [0, 1, 9, 16, 31, 48, 130] {
                    for (pad_s, pad_d) in [(0, 0), (3, 17)] {
                        let m = Mat {
                            rows,
                            cols,
                            ld: cols + pad_s,
                        };
                        let ldd = rows + pad_d;
                        let src: Vec<f32> =
                            (0..rows * m.ld).map(|k| k as f32 * 0.5 - 3.0).collect();
                        for add in [false, true] {
                            let base: Vec<f32> = (0..cols * ldd).map(|k| (k % 7) as f32).collect();
                            let mut dst = base.clone();
                            transpose_on(b, (&src, m), (&mut dst, ldd), add);
                            for j in 0..cols {
                                for i in 0..ldd {
                                    let o = j * ldd + i;
                                    let want = if i >= rows {
                                        base[o]
                                    } else {
                                        src[i * m.ld + j] + if add { base[o] } else { 0.0 }
                                    };
                                    assert_eq!(dst[o], want, "{b:?} {rows}x{cols} pads ({pad_s}, {pad_d}) add {add} ({i}, {j})");
                                }
                            }
                            ran += 1;
                        }
                    }
                }
            }
        }
        assert!(ran > 0);
    }

    /// Every backend against the definition, over row widths with and
    /// without whole vectors, repeated rows and both roles of the pair.
    #[test]
    fn every_backend_adds_rows() {
        for &b in &Backend::available() {
            for w in [1, 7, 8, 16, 23, 64, 65] {
                let src: Vec<f32> = (0..5 * w).map(|k| (k % 11) as f32 - 4.0).collect();
                let updates = [
                    (0u32, 4u32, 0.5f32),
                    (2, 0, -1.25),
                    (0, 4, 2.0),
                    (1, 3, 3.0),
                ];
                for swap in [false, true] {
                    let base: Vec<f32> = (0..5 * w).map(|k| (k % 3) as f32).collect();
                    let mut dst = base.clone();
                    rows_axpy_on(b, &updates, swap, (&src, w), &mut dst);
                    let mut want = base.clone();
                    for &(a, c, r) in &updates {
                        let (d, s) = if swap { (c, a) } else { (a, c) };
                        for k in 0..w {
                            want[d as usize * w + k] += r * src[s as usize * w + k];
                        }
                    }
                    assert_eq!(dst, want, "{b:?} w {w} swap {swap}");
                }
            }
        }
    }
}
