//! The dense (unquantized) baselines over the same vocabulary.

use super::*;

/// Elements of a dense cache: `f32` or `f16`.
pub(crate) trait DenseElem: Copy {
    /// Load `L` elements as floats.
    ///
    /// # Safety
    /// `p` valid for `L` elements.
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::F;
    /// One element as `f32`.
    fn get(self) -> f32;
}

impl DenseElem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const f32) -> S::F {
        // SAFETY: the caller's contract.
        unsafe { s.load(p) }
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

impl DenseElem for f16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const f16) -> S::F {
        // SAFETY: the caller's contract; `f16` is two little-endian bytes.
        unsafe { s.load_f16(p as *const u8) }
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

/// The prefetch of the dense tile at `t0` ([`DENSE_PREFETCH_TOKENS`]
/// ahead, into L2), spread over its `full` column steps
/// ([`Ahead::dense_step`]) when the tile's bytes split into whole lines
/// per step; otherwise issued here at once.
#[inline(always)]
pub(crate) fn dense_ahead<S: Simd>(base: *const u8, row: usize, full: usize, t0: usize) -> Ahead {
    let bytes = S::T * row;
    let p = base.wrapping_add((t0 + DENSE_PREFETCH_TOKENS) * row);
    if full > 0 && bytes.is_multiple_of(full) && (bytes / full).is_multiple_of(64) {
        Ahead {
            p,
            per: bytes / full,
            // (Read by `dense_step`, which does not stop at an end: a dense
            // buffer is the whole context, and past it lie few rows.)
            end: usize::MAX,
        }
    } else {
        prefetch_to::<{ core::arch::x86_64::_MM_HINT_T1 }>(p, bytes);
        Ahead::NONE
    }
}

impl Ahead {
    /// Column step `j` of a dense tile ([`dense_ahead`]): its share of the
    /// tile's lines, into L2.
    #[inline(always)]
    pub(crate) fn dense_step(self, j: usize) {
        self.token_to::<{ core::arch::x86_64::_MM_HINT_T1 }>(j);
    }
}

/// Dense scores, `out[i·tokens + t] = q_i · k_t` over `k = [tokens, hd]`.
///
/// Panics unless `k.len()`, `q.len()` are multiples of `hd` and
/// `out.len() = n_q·tokens`.
#[inline(always)]
pub(crate) fn dense_scores<S: Simd, E: DenseElem>(
    s: S,
    hd: usize,
    k: &[E],
    q: &[f32],
    out: &mut [f32],
) {
    assert!(
        hd > 0 && k.len().is_multiple_of(hd) && q.len().is_multiple_of(hd),
        "dense: lengths"
    );
    let t_all = k.len() / hd;
    let nq = q.len() / hd;
    assert_eq!(out.len(), nq * t_all, "dense: output length");
    let full = hd / S::L;
    let tail = full * S::L;
    let kp = k.as_ptr();
    let row = hd * std::mem::size_of::<E>();
    let mut t0 = 0;
    while t0 + S::T <= t_all {
        // The same software prefetch as the packed kernels (a fair
        // baseline), spread over the tile's column steps.
        let ah = dense_ahead::<S>(kp as *const u8, row, full, t0);
        for i in 0..nq {
            let qi = &q[i * hd..(i + 1) * hd];
            let mut acc = [s.zero(); 16];
            for j in 0..full {
                if i == 0 {
                    ah.dense_step(j);
                }
                // SAFETY: rows `t0..t0+T ≤ tokens` of `k`; elements
                // `j·L..j·L+L ≤ hd` of each row and of `qi`.
                unsafe {
                    let qj = s.load(qi.as_ptr().add(j * S::L));
                    for (tt, a) in acc.iter_mut().enumerate().take(S::T) {
                        *a = s.fma(E::load(s, kp.add((t0 + tt) * hd + j * S::L)), qj, *a);
                    }
                }
            }
            let o = &mut out[i * t_all + t0..i * t_all + t0 + S::T];
            store_lanes(s, s.reduce(&acc), o);
            if tail < hd {
                for (tt, o) in o.iter_mut().enumerate() {
                    let row = &k[(t0 + tt) * hd..(t0 + tt + 1) * hd];
                    *o += (tail..hd).map(|c| qi[c] * row[c].get()).sum::<f32>();
                }
            }
        }
        t0 += S::T;
    }
    for t in t0..t_all {
        let row = &k[t * hd..(t + 1) * hd];
        for i in 0..nq {
            let qi = &q[i * hd..(i + 1) * hd];
            let mut a = s.zero();
            for j in 0..full {
                // SAFETY: elements `j·L..j·L+L ≤ hd` of `row` and `qi`.
                unsafe {
                    a = s.fma(
                        E::load(s, row.as_ptr().add(j * S::L)),
                        s.load(qi.as_ptr().add(j * S::L)),
                        a,
                    )
                };
            }
            out[i * t_all + t] = s.hsum(a) + (tail..hd).map(|c| qi[c] * row[c].get()).sum::<f32>();
        }
    }
}

/// Dense weighted sum, `out_i += Σ_t p[i·tokens + t] · v_t`.
///
/// Panics unless `v.len()`, `out.len()` are multiples of `hd` and
/// `p.len() = n_q·tokens`.
#[inline(always)]
pub(crate) fn dense_weighted_sum<S: Simd, E: DenseElem>(
    s: S,
    hd: usize,
    v: &[E],
    p: &[f32],
    out: &mut [f32],
) {
    assert!(
        hd > 0 && v.len().is_multiple_of(hd) && out.len().is_multiple_of(hd),
        "dense: lengths"
    );
    let t_all = v.len() / hd;
    let nq = out.len() / hd;
    assert_eq!(p.len(), nq * t_all, "dense: weights length");
    let full = hd / S::L;
    let tail = full * S::L;
    let vp = v.as_ptr();
    let row = hd * std::mem::size_of::<E>();
    let mut t0 = 0;
    while t0 + S::T <= t_all {
        let ah = dense_ahead::<S>(vp as *const u8, row, full, t0);
        for i in 0..nq {
            let pi = &p[i * t_all + t0..i * t_all + t0 + S::T];
            let oi = &mut out[i * hd..(i + 1) * hd];
            let mut w = [s.zero(); 16];
            for (w, p) in w.iter_mut().zip(pi) {
                *w = s.splat(*p);
            }
            for j in 0..full {
                if i == 0 {
                    ah.dense_step(j);
                }
                // SAFETY: rows `t0..t0+T ≤ tokens` of `v`; elements
                // `j·L..j·L+L ≤ hd` of each row and of `oi`.
                unsafe {
                    let mut a = [s.zero(); 4];
                    for (tt, w) in w.iter().enumerate().take(S::T) {
                        a[tt % 4] =
                            s.fma(E::load(s, vp.add((t0 + tt) * hd + j * S::L)), *w, a[tt % 4]);
                    }
                    let r = s.add(s.add(a[0], a[1]), s.add(a[2], a[3]));
                    let o = oi.as_mut_ptr().add(j * S::L);
                    s.store(o, s.add(s.load(o), r));
                }
            }
            for (c, o) in oi.iter_mut().enumerate().skip(tail) {
                *o += (0..S::T)
                    .map(|tt| pi[tt] * v[(t0 + tt) * hd + c].get())
                    .sum::<f32>();
            }
        }
        t0 += S::T;
    }
    for t in t0..t_all {
        let row = &v[t * hd..(t + 1) * hd];
        for i in 0..nq {
            let w = p[i * t_all + t];
            let oi = &mut out[i * hd..(i + 1) * hd];
            for j in 0..full {
                // SAFETY: elements `j·L..j·L+L ≤ hd` of `row` and `oi`.
                unsafe {
                    let o = oi.as_mut_ptr().add(j * S::L);
                    s.store(
                        o,
                        s.fma(
                            E::load(s, row.as_ptr().add(j * S::L)),
                            s.splat(w),
                            s.load(o),
                        ),
                    );
                }
            }
            for c in tail..hd {
                oi[c] += w * row[c].get();
            }
        }
    }
}
