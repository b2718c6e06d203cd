//! Scores of pre-RoPE keys (see `kernels/rope.rs`): unpack and dequantize
//! a tile, turn it to its positions, dot it with every query — through an
//! L1 scratch for any shape, or in registers for the compiled per-channel
//! shapes whose rotation covers the head ([`rope_scores_fused`]).

use super::*;
use crate::kernels::rope::{RopeEntries, RopeRows, ROPE_LO, ROPE_SPILL};

/// Whether the SIMD kernel takes this head and rotation: whole vectors per
/// head, and per rotated half (pairs `(i, i + dims/2)`) or per rotated
/// span (adjacent pairs).
#[inline(always)]
pub(crate) fn rope_takes<S: Simd>(head: &PackedHead<'_>, rope: &RopeRows<'_>) -> bool {
    let hd = head.layout().head_dim();
    hd.is_multiple_of(S::L) && rope.lanes > 0 && rope.lanes.is_multiple_of(S::L) && hd <= 1024
}

/// Turn the tile's `n` keys (vector-major scratch, `nch` vectors) by the
/// fine rows `lo0..lo0 + n` (the offsets of their positions from the
/// coarse row the queries were turned back by).
///
/// # Safety
/// `scr` holds `nch·T·L` floats; `rope_takes` holds;
/// `lo0 + n ≤ ROPE_LO + ROPE_SPILL`.
#[inline(always)]
unsafe fn rope_tile<S: Simd>(
    s: S,
    scr: *mut f32,
    n: usize,
    rope: &RopeRows<'_>,
    lo0: usize,
    swap: S::I,
) {
    let lv = rope.lanes / S::L;
    let stride = S::T * S::L;
    // Locals, not loads through `rope` in the loop: the stores to `scr`
    // could alias the tables for all the compiler knows.
    let (loc, los) = (rope.lo.0.as_ptr(), rope.lo.1.as_ptr());
    let (lanes, adjacent) = (rope.lanes, rope.adjacent);
    for tt in 0..n {
        let l = (lo0 + tt) * lanes;
        for j in 0..lv {
            // SAFETY: row `l` holds `lanes = lv·L` floats (`lo0 + tt` is
            // below the fine table's rows); vectors `j` and `j + lv`
            // (halves) or `j` (adjacent) are below `nch` (`lanes ≤ hd`),
            // token `tt < T`.
            unsafe {
                let o = j * S::L;
                let (c, sn) = (s.load(loc.add(l + o)), s.load(los.add(l + o)));
                let pa = scr.add(j * stride + tt * S::L);
                let a = s.load(pa);
                if adjacent {
                    s.store(pa, s.fma(a, c, s.mul(s.permute(a, swap), sn)));
                } else {
                    let pb = scr.add((j + lv) * stride + tt * S::L);
                    let b = s.load(pb);
                    s.store(pa, s.sub(s.mul(a, c), s.mul(b, sn)));
                    s.store(pb, s.fma(a, sn, s.mul(b, c)));
                }
            }
        }
    }
}

/// `out[i·T + t] = q_i · R(p0 + t)·k̂_t` (see `kernels/rope.rs`).
///
/// # Safety
/// [`super::check_head`]`(head, q.len(), out.len())` passed, `rope_takes`
/// holds and the tables cover `p0 + tokens − 1`.
#[inline(always)]
pub(crate) unsafe fn rope_scores<S: Simd>(
    s: S,
    head: &PackedHead<'_>,
    rope: &RopeRows<'_>,
    p0: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let p = Plan::new(head);
    let l = head.layout();
    let g = Geo::new::<S, 0, 0>(l.head_dim(), l.scheme().bits());
    let (hdp, t_all) = (g.hdp, p.tokens);
    let mut scr = Buf::new(S::T * hdp);
    let mut u8buf = vec![0u8; hdp];
    let codes = head.codes().as_ptr();
    let mut work = RopeWork::new(s, rope, p0, q, g, t_all, out);
    match l.scheme().axis() {
        // SAFETY: the caller's contract; the scratch and `u8buf` are
        // sized for `g`.
        Axis::PerChannel => unsafe {
            // The common widths unpack with their planes known.
            let (sc, u8b) = (&mut scr, &mut u8buf[..]);
            match g.bits {
                2 => channel_tiles::<S, 2, _>(s, g, head, &p, sc, u8b, &mut work),
                4 => channel_tiles::<S, 4, _>(s, g, head, &p, sc, u8b, &mut work),
                8 => channel_tiles::<S, 8, _>(s, g, head, &p, sc, u8b, &mut work),
                _ => channel_tiles::<S, 0, _>(s, g, head, &p, sc, u8b, &mut work),
            }
        },
        Axis::PerToken => {
            let mut tp = TileParams::new::<S>(head, g, p);
            let mut t0 = 0;
            while t0 < t_all {
                let n = S::T.min(t_all - t0);
                tp.load(s, head, t0, n);
                // SAFETY: rows `t0..t0 + n` are in the codes; `tp` holds
                // this tile's params.
                unsafe {
                    let (rows, sp, u8b) = (
                        codes.add(t0 * g.rb),
                        scr.m().as_mut_ptr(),
                        u8buf.as_mut_ptr(),
                    );
                    match (tp.deq_rows(), g.bits) {
                        (None, 4) => {
                            unpack_tile::<S, 4, PerToken>(s, g, rows, n, sp, u8b, tp.deq())
                        }
                        (None, _) => {
                            unpack_tile::<S, 0, PerToken>(s, g, rows, n, sp, u8b, tp.deq())
                        }
                        (Some(d), _) => unpack_tile::<S, 0, Rows>(s, g, rows, n, sp, u8b, d),
                    }
                    work.tile(s, t0, n, sp);
                }
                t0 += n;
            }
        }
    }
}

/// Turn a dequantized tile to its positions, then score it against every
/// query into `out` (`[nq, t_all]`).
struct RopeWork<'a, 'r, S: Simd> {
    rope: &'a RopeRows<'r>,
    p0: usize,
    swap: S::I,
    q: &'a [f32],
    /// The queries turned back by coarse row `qr_hi` (`R(hi)ᵀ·q`).
    qr: Buf,
    qr_hi: usize,
    nq: usize,
    hd: usize,
    nch: usize,
    t_all: usize,
    out: &'a mut [f32],
}

impl<'a, 'r, S: Simd> RopeWork<'a, 'r, S> {
    /// The work of one call: `q` not yet turned back, the swap of
    /// adjacent lanes built.
    fn new(
        s: S,
        rope: &'a RopeRows<'r>,
        p0: usize,
        q: &'a [f32],
        g: Geo,
        t_all: usize,
        out: &'a mut [f32],
    ) -> Self {
        // Lane `k` of the swap reads lane `k ^ 1`: an adjacent pair's partner.
        let mut idx = [0f32; 16];
        for (k, v) in idx.iter_mut().enumerate() {
            *v = f32::from_bits((k ^ 1) as u32);
        }
        // SAFETY: `idx` holds 16 ≥ L floats.
        let swap = unsafe { s.load_i(idx.as_ptr()) };
        RopeWork {
            rope,
            p0,
            swap,
            q,
            qr: Buf::new(q.len()),
            qr_hi: usize::MAX,
            nq: q.len() / g.hd,
            hd: g.hd,
            nch: g.nch,
            t_all,
            out,
        }
    }

    /// `qr = R(hi·ROPE_LO)ᵀ·q` for every query (the rotary lanes turned
    /// back, the rest copied).
    fn turn_queries_back(&mut self, hi: usize) {
        let (r, lanes, hd) = (self.rope, self.rope.lanes, self.hd);
        let (c, sn) = (
            &r.hi.0[hi * lanes..(hi + 1) * lanes],
            &r.hi.1[hi * lanes..(hi + 1) * lanes],
        );
        for (dst, src) in self
            .qr
            .m()
            .chunks_exact_mut(hd)
            .zip(self.q.chunks_exact(hd))
        {
            dst.copy_from_slice(src);
            if r.adjacent {
                // Lane `k` of a pair `(a, b)`: `a' = a·C − b·S` with the
                // first channel's `S` the negated sine, `b' = b·C − a·S`.
                for k in (0..lanes).step_by(2) {
                    let (a, b) = (src[k], src[k + 1]);
                    dst[k] = a * c[k] - b * sn[k];
                    dst[k + 1] = b * c[k + 1] - a * sn[k + 1];
                }
            } else {
                for k in 0..lanes {
                    let (a, b) = (src[k], src[k + lanes]);
                    dst[k] = a * c[k] + b * sn[k];
                    dst[k + lanes] = b * c[k] - a * sn[k];
                }
            }
        }
        self.qr_hi = hi;
    }
}

impl<S: Simd> TileWork<S> for RopeWork<'_, '_, S> {
    #[inline(always)]
    unsafe fn tile(&mut self, s: S, t0: usize, n: usize, scr: *mut f32) {
        let p = self.p0 + t0;
        let hi = p / ROPE_LO;
        if hi != self.qr_hi {
            self.turn_queries_back(hi);
        }
        let lo0 = p - hi * ROPE_LO;
        debug_assert!(lo0 + n <= ROPE_LO + ROPE_SPILL && n <= ROPE_SPILL);
        // SAFETY: the scratch holds the tile's `n ≤ T` rows (the unpack
        // zeroes the rest); `lo0 < ROPE_LO` and `n ≤ T ≤ ROPE_SPILL`, so
        // the fine rows exist (`rope_scores_on`'s check); query `i` of `qr`
        // holds `hd = hdp` floats (`rope_takes`); the coarse table covers
        // the tile (the caller's).
        unsafe {
            rope_tile(s, scr, n, self.rope, lo0, self.swap);
            for i in 0..self.nq {
                let r = dot_tile(s, scr, self.nch, self.qr.s().as_ptr().add(i * self.hd));
                let o = i * self.t_all + t0;
                store_lanes(s, r, &mut self.out[o..o + n]);
            }
        }
    }
}

/// Whether [`rope_scores_fused`] takes this head and rotation: per-channel
/// codes whose rows unpack by shift and mask, and a rotation of every
/// channel (partial rotary goes through the scratch).
#[inline(always)]
pub(crate) fn rope_fused_takes<S: Simd, const B: u8, const HD: usize>(
    head: &PackedHead<'_>,
    rope: &RopeRows<'_>,
) -> bool {
    let l = head.layout();
    let g = Geo::new::<S, B, HD>(l.head_dim(), l.scheme().bits());
    let full = if rope.adjacent { HD } else { HD / 2 };
    HD > 0
        && l.head_dim() == HD
        && l.scheme().bits() == B
        && l.scheme().axis() == Axis::PerChannel
        && g.fast
        && g.nch <= MAX_NCH
        && rope.lanes == full
        && rope_takes::<S>(head, rope)
}

/// [`rope_scores`] with each tile's rows unpacked, dequantized and turned
/// in registers, then multiplied into every query at once (the fused
/// kernels' partial sums and reduction): no scratch is written or read
/// back, and the rotation of a token serves every query of the KV head.
/// One query with pairs `(c, c + HD/2)` folds the block's scales and zeros
/// into the query instead ([`fold_rope_query`]): six FMAs per pair of
/// vectors from the raw codes, where dequantizing, turning and dotting
/// take nine.
///
/// # Safety
/// As [`rope_scores`], and [`rope_fused_takes`]`::<S, B, HD>` holds.
#[inline(always)]
pub(crate) unsafe fn rope_scores_fused<S: Simd, const B: u8, const HD: usize>(
    s: S,
    head: &PackedHead<'_>,
    rope: &RopeRows<'_>,
    p0: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let p = Plan::new(head);
    let l = head.layout();
    let g = Geo::new::<S, B, HD>(l.head_dim(), l.scheme().bits());
    let (hd, hdp, t_all) = (g.hd, g.hdp, p.tokens);
    let nq = q.len() / hd;
    if t_all == 0 {
        return;
    }
    let mut work = RopeWork::new(s, rope, p0, q, g, t_all, out);
    let swap = work.swap;
    let mut accbuf = Buf::new(nq * S::T * S::L);
    let gl = l.group_len();
    let codes = head.codes().as_ptr();
    let (mut sc, mut ze) = (Buf::new(hdp), Buf::new(hdp));
    // One query, pairs `(c, c + HD/2)`: the block's scales and zeros and
    // the turned-back query folded per (block, coarse row), see
    // [`fold_rope_query`].
    let one = nq == 1 && !rope.adjacent;
    let mut fold = Buf::new(if one { 6 * hd / 2 } else { 0 });
    let mut folded = (usize::MAX, usize::MAX);
    let pf = BlockAhead::new(head, true);
    // The block walk of `channel_tiles`, written out: a closure would not
    // inherit the target features of the kernel's trampoline, and its SIMD
    // calls would not be inlined.
    for k in 0..t_all.div_ceil(gl) {
        pf.block(k);
        block_params(s, head, &p, hd, k, sc.m(), ze.m());
        let d = Rows {
            sc: sc.s().as_ptr(),
            ze: ze.s().as_ptr(),
            stride: 0,
        };
        let t_end = ((k + 1) * gl).min(t_all);
        let mut t0 = k * gl;
        while t0 < t_end {
            let n = S::T.min(t_end - t0);
            let pos = p0 + t0;
            let hi = pos / ROPE_LO;
            if hi != work.qr_hi {
                work.turn_queries_back(hi);
            }
            let lo0 = pos - hi * ROPE_LO;
            debug_assert!(lo0 + n <= ROPE_LO + ROPE_SPILL && n <= ROPE_SPILL);
            let ah = pf.tile(t0, n);
            // SAFETY: rows `t0..t0 + n` are in the codes (`check_head`);
            // `sc`/`ze` hold the block's `hdp` params; the fine rows
            // `lo0..lo0 + n` exist (`lo0 < ROPE_LO`, `n ≤ T ≤ ROPE_SPILL`,
            // `rope_scores_on`'s check); `qr` holds `nq` queries of
            // `hd = hdp` floats; `accbuf` `nq·T` vectors.
            unsafe {
                if one {
                    if folded != (k, hi) {
                        fold_rope_query(s, g, work.qr.s().as_ptr(), d, fold.m().as_mut_ptr());
                        folded = (k, hi);
                    }
                    let (rows, f, a) = (
                        codes.add(t0 * g.rb),
                        fold.s().as_ptr(),
                        accbuf.m().as_mut_ptr(),
                    );
                    fused_rope_tile_one::<S, B, HD>(s, g, rows, n, rope, lo0, f, a, ah);
                } else {
                    fused_rope_tile::<S, B, HD>(
                        s,
                        g,
                        codes.add(t0 * g.rb),
                        n,
                        d,
                        rope,
                        lo0,
                        swap,
                        work.qr.s().as_ptr(),
                        nq,
                        accbuf.m().as_mut_ptr(),
                        ah,
                    );
                }
                for i in 0..nq {
                    let r = reduce_query(s, accbuf.s().as_ptr(), i);
                    let o = i * t_all + t0;
                    store_lanes(s, r, &mut work.out[o..o + n]);
                }
            }
            t0 += n;
        }
    }
}

/// Fold one turned-back query `q` (`HD` floats) with a block's scales and
/// zeros (`d`) for [`fused_rope_tile_one`]: with pairs `(a, b) = (c, c +
/// HD/2)`, key `k = scale·code + zero` turned by `θ` and query `q`,
/// `q·R(θ)k = Σ cos θ·u + sin θ·v` where `u = q_a·k_a + q_b·k_b =
/// A·code_a + B·code_b + U` and `v = q_b·k_a − q_a·k_b = C·code_a −
/// D·code_b + V`. `fold` gets `A, B, C, −D, U, V`, `HD/2` floats each.
///
/// # Safety
/// `q` valid for `HD` floats, `d`'s scales and zeros for `HD`, `fold` for
/// `3·HD`; `Geo::fast` (whole vectors), `nch` even.
#[inline(always)]
unsafe fn fold_rope_query<S: Simd>(s: S, g: Geo, q: *const f32, d: Rows, fold: *mut f32) {
    let (half, m) = (g.nch / 2, g.hd / 2);
    for j in 0..half {
        let (a, b) = (j * S::L, (j + half) * S::L);
        // SAFETY: the caller's contract; vectors `j`, `j + nch/2 < nch`.
        unsafe {
            let (qa, qb) = (s.load(q.add(a)), s.load(q.add(b)));
            let (sa, sb) = (s.load(d.sc.add(a)), s.load(d.sc.add(b)));
            let (za, zb) = (s.load(d.ze.add(a)), s.load(d.ze.add(b)));
            let o = fold.add(a);
            s.store(o, s.mul(qa, sa));
            s.store(o.add(m), s.mul(qb, sb));
            s.store(o.add(2 * m), s.mul(qb, sa));
            s.store(o.add(3 * m), s.sub(s.zero(), s.mul(qa, sb)));
            s.store(o.add(4 * m), s.fma(qa, za, s.mul(qb, zb)));
            s.store(o.add(5 * m), s.sub(s.mul(qb, za), s.mul(qa, zb)));
        }
    }
}

/// One tile of [`rope_scores_fused`] for one query and pairs `(c, c +
/// HD/2)`: per token and pair vector two FMAs each for `u` and `v` of
/// [`fold_rope_query`] from the raw codes, and two for `cos·u + sin·v` —
/// the key is never dequantized nor turned. Partial sums to
/// `accbuf[tt·L]`, rows `n..T` zero.
///
/// # Safety
/// `rows` valid for `n` rows; fine rows `lo0..lo0 + n` exist; `fold` as
/// [`fold_rope_query`] wrote it for this tile's block and coarse row;
/// `accbuf` valid for `T·L`; [`rope_fused_takes`] holds.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fused_rope_tile_one<S: Simd, const B: u8, const HD: usize>(
    s: S,
    g: Geo,
    rows: *const u8,
    n: usize,
    rope: &RopeRows<'_>,
    lo0: usize,
    fold: *const f32,
    accbuf: *mut f32,
    ah: [Ahead; 2],
) {
    let (loc, los) = (rope.lo.0.as_ptr(), rope.lo.1.as_ptr());
    let (lanes, half, m) = (rope.lanes, g.nch / 2, g.hd / 2);
    let mut f = [[s.zero(); MAX_NCH]; 6];
    for (k, fk) in f.iter_mut().enumerate() {
        unroll!(16 max row_vectors::<S, HD>() / 2; j in 0, half => {
            // SAFETY: the caller's contract: `fold` holds 6 runs of `HD/2`.
            fk[j] = unsafe { s.load(fold.add(k * m + j * S::L)) };
        });
    }
    for tt in 0..n {
        ah[0].token(tt);
        ah[1].token(tt);
        // SAFETY: the caller's contract; row `tt < n`, vectors `j`, `j +
        // nch/2 < nch`, fine row `lo0 + tt` of `lanes` floats.
        unsafe {
            let row = rows.add(tt * g.rb);
            let l = (lo0 + tt) * lanes;
            let mut acc = [s.zero(); 2];
            unroll!(16 max row_vectors::<S, HD>() / 2; j in 0, half => {
                let ca = row_vec::<S, B, Raw, false>(s, g, Raw, row, tt, j);
                let cb = row_vec::<S, B, Raw, false>(s, g, Raw, row, tt, j + half);
                let u = s.fma(f[0][j], ca, s.fma(f[1][j], cb, f[4][j]));
                let v = s.fma(f[2][j], ca, s.fma(f[3][j], cb, f[5][j]));
                acc[0] = s.fma(s.load(loc.add(l + j * S::L)), u, acc[0]);
                acc[1] = s.fma(s.load(los.add(l + j * S::L)), v, acc[1]);
            });
            s.store(accbuf.add(tt * S::L), s.add(acc[0], acc[1]));
        }
    }
    // SAFETY: the caller's contract.
    unsafe { zero_tail(s, accbuf, 1, n) };
}

/// One tile of [`rope_scores_fused`]: row `tt` unpacked and dequantized
/// into registers, turned by fine row `lo0 + tt` (every channel: `HD/2`
/// pair lanes, or `HD` adjacent lanes), multiplied into every query;
/// partial sums to `accbuf[(i·T + tt)·L]`, rows `n..T` zero.
///
/// # Safety
/// `rows` valid for `n` rows; `d` built for the block; fine rows
/// `lo0..lo0 + n` exist; `q` valid for `nq·HD` floats, `accbuf` for
/// `nq·T·L`; [`rope_fused_takes`] holds.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fused_rope_tile<S: Simd, const B: u8, const HD: usize>(
    s: S,
    g: Geo,
    rows: *const u8,
    n: usize,
    d: Rows,
    rope: &RopeRows<'_>,
    lo0: usize,
    swap: S::I,
    q: *const f32,
    nq: usize,
    accbuf: *mut f32,
    ah: [Ahead; 2],
) {
    let (loc, los) = (rope.lo.0.as_ptr(), rope.lo.1.as_ptr());
    let (lanes, adjacent) = (rope.lanes, rope.adjacent);
    let (nch, half) = (g.nch, g.nch / 2);
    // One query: its vectors in registers for the whole tile.
    let mut q1 = [s.zero(); MAX_NCH];
    if nq == 1 {
        unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
            // SAFETY: `q` holds `HD = nch·L` floats.
            q1[j] = unsafe { s.load(q.add(j * S::L)) };
        });
    }
    for tt in 0..n {
        ah[0].token(tt);
        ah[1].token(tt);
        // SAFETY: the caller's contract; row `tt < n`, vectors `j < nch`,
        // fine row `lo0 + tt` of `lanes` floats, queries `i < nq`.
        unsafe {
            let row = rows.add(tt * g.rb);
            let mut xs = [s.zero(); MAX_NCH];
            unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                xs[j] = row_vec::<S, B, Rows, false>(s, g, d, row, tt, j);
            });
            let l = (lo0 + tt) * lanes;
            if adjacent {
                // `x'_c = x_c·C_c + x_{c^1}·S_c` (S negated on the first
                // channel of a pair), as `rope_tile`.
                unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                    let (c, sn) = (s.load(loc.add(l + j * S::L)), s.load(los.add(l + j * S::L)));
                    let a = xs[j];
                    xs[j] = s.fma(a, c, s.mul(s.permute(a, swap), sn));
                });
            } else {
                // Pairs `(c, c + HD/2)`: vectors `j` and `j + nch/2`.
                unroll!(32 max row_vectors::<S, HD>(); j in 0, half => {
                    let (c, sn) = (s.load(loc.add(l + j * S::L)), s.load(los.add(l + j * S::L)));
                    let (a, b) = (xs[j], xs[j + half]);
                    xs[j] = s.sub(s.mul(a, c), s.mul(b, sn));
                    xs[j + half] = s.fma(a, sn, s.mul(b, c));
                });
            }
            if nq == 1 {
                let mut a = [s.zero(); 2];
                unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                    a[j % 2] = s.fma(xs[j], q1[j], a[j % 2]);
                });
                s.store(accbuf.add(tt * S::L), s.add(a[0], a[1]));
            } else {
                row_into_queries::<S, HD>(s, &xs, g, q, nq, accbuf, tt);
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { zero_tail(s, accbuf, nq, n) };
}

/// Entries `0..n` (`n` a multiple of `L`) of
/// `kernels::rope::rope_outliers_on`, a vector of entries at a time: the
/// positions and corrections widened, each entry's fine lane `(cos, sin)`
/// and turned channel `(a, b)` gathered a pair per element, the products
/// added into the scores entry by entry (entries of one token follow each
/// other, so a scatter would collide).
///
/// # Safety
/// `rope_outliers_on`'s assertions hold: the shape, `turned` `[rows, hd,
/// 2]`, and for every entry of `e` its fine row `fine0 + t` inside the
/// fine tables and `(rows − 1)·stride + t` inside `out`; `n` at most the
/// entries.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rope_outliers<S: Simd>(
    s: S,
    e: RopeEntries<'_>,
    n: usize,
    rope: &RopeRows<'_>,
    fine0: isize,
    turned: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = 1usize << e.shift;
    let lanes = rope.lanes;
    let rows = turned.len() / (2 * hd);
    let (cs, ab, op) = (rope.lo_cs.as_ptr(), turned.as_ptr(), out.as_mut_ptr());
    // An entry's fine lane, `(fine0 + t)·lanes + lane(c)`: with halves
    // (`hd = 2·lanes`) `t·lanes` is `pos >> 1` without its low lane bits,
    // with adjacent pairs (`lanes = hd`) `t·lanes + (c | 1)` is `pos | 1`.
    let row0 = s.splat_i((fine0 * lanes as isize) as u32);
    let lane_bits = lanes as u32 - 1;
    let (mut tok, mut val) = ([0u32; 16], [0f32; 16]);
    let mut j = 0;
    while j < n {
        // SAFETY: entries `j..j + L` exist (`n` a multiple of `L`, at most
        // the entries); the gathered pairs are in the tables and the
        // turned rows, and the tokens in `out`, by the caller's contract.
        unsafe {
            let p = s.load_u16(e.pos.as_ptr().add(2 * j));
            let r = s.load_f16(e.cor.as_ptr().add(2 * j));
            let c = s.shr_mask(p, 0, hd as u32 - 1);
            let l = if rope.adjacent {
                s.or(p, s.splat_i(1))
            } else {
                s.or(s.shr_mask(p, 1, !lane_bits), s.shr_mask(p, 0, lane_bits))
            };
            let (wc, ws) = s.gather_pairs(cs, s.add_i(l, row0));
            s.store_i(
                tok.as_mut_ptr() as *mut f32,
                s.shr_mask(p, e.shift as i32, u32::MAX),
            );
            for i in 0..rows {
                let (a, b) = s.gather_pairs(ab.add(2 * i * hd), c);
                let v = s.mul(r, s.add(s.mul(a, wc), s.mul(b, ws)));
                s.store(val.as_mut_ptr(), v);
                let o = op.add(i * stride);
                for k in 0..S::L {
                    *o.add(tok[k] as usize) += val[k];
                }
            }
        }
        j += S::L;
    }
}
