//! The fused scores of a tile (rows unpacked into registers and multiplied into every query) and the reductions shared by the scores kernels.

use super::*;

/// Fused scores of up to `T` tokens: each row is unpacked (and
/// dequantized by `d`) into registers and multiplied into every query at
/// once; token `tt`'s partial sums for query `i` go to `accbuf[(i·T + tt)·L]`
/// for [`reduce_query`]. Rows `n..T` get zeros.
///
/// # Safety
/// `rows` valid for `n` rows; `q` for `nq·hdp` floats; `accbuf` for
/// `nq·T·L`; `Geo::fast` holds and `nch ≤ 32`; `d` built for this tile.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn fused_scores_tile<
    S: Simd,
    const B: u8,
    D: Deq<S>,
    const NIB: bool,
    const HD: usize,
>(
    s: S,
    g: Geo,
    rows: *const u8,
    n: usize,
    d: D,
    q: *const f32,
    nq: usize,
    accbuf: *mut f32,
    ah: [Ahead; 2],
) {
    // One query: its vectors in registers for the whole tile, so the
    // per-token FMAs do not each load it again (on Zen 4 the loads, not
    // the FMAs, were the bound).
    let mut q1 = [s.zero(); MAX_NCH];
    if nq == 1 {
        unroll!(32 max row_vectors::<S, HD>(); j in 0, g.nch => {
            // SAFETY: the caller's contract: `q` holds `hdp ≥ nch·L` floats.
            q1[j] = unsafe { s.load(q.add(j * S::L)) };
        });
    }
    // Several queries: two tokens at a time when both rows fit the
    // registers, so each query vector loaded serves two tokens (on Zen 4
    // one 512-bit load per cycle bound the one-token loop).
    let pairs = nq > 1 && 2 * g.nch + 6 <= S::REGS;
    let mut tt = 0;
    while tt < n {
        if pairs && tt + 1 < n {
            for u in tt..tt + 2 {
                ah[0].token(u);
                ah[1].token(u);
            }
            // SAFETY: the caller's contract; rows `tt, tt+1 < n`, vectors
            // `j < nch`, queries `i < nq`.
            unsafe {
                let (ra, rb) = (rows.add(tt * g.rb), rows.add((tt + 1) * g.rb));
                let (mut xa, mut xb) = ([s.zero(); MAX_NCH], [s.zero(); MAX_NCH]);
                unroll!(32 max row_vectors::<S, HD>(); j in 0, g.nch => {
                    xa[j] = row_vec::<S, B, D, NIB>(s, g, d, ra, tt, j);
                    xb[j] = row_vec::<S, B, D, NIB>(s, g, d, rb, tt + 1, j);
                });
                for i in 0..nq {
                    let qi = q.add(i * g.hdp);
                    let (mut a, mut b) = ([s.zero(); 2], [s.zero(); 2]);
                    unroll!(32 max row_vectors::<S, HD>(); j in 0, g.nch => {
                        let qv = s.load(qi.add(j * S::L));
                        a[j % 2] = s.fma(xa[j], qv, a[j % 2]);
                        b[j % 2] = s.fma(xb[j], qv, b[j % 2]);
                    });
                    s.store(accbuf.add((i * S::T + tt) * S::L), s.add(a[0], a[1]));
                    s.store(accbuf.add((i * S::T + tt + 1) * S::L), s.add(b[0], b[1]));
                }
            }
            tt += 2;
            continue;
        }
        ah[0].token(tt);
        ah[1].token(tt);
        // SAFETY: the caller's contract; vectors `j < nch`, queries `i < nq`.
        unsafe {
            let row = rows.add(tt * g.rb);
            if nq == 1 {
                let mut a = [s.zero(); 2];
                unroll!(32 max row_vectors::<S, HD>(); j in 0, g.nch => {
                    let x = row_vec::<S, B, D, NIB>(s, g, d, row, tt, j);
                    a[j % 2] = s.fma(x, q1[j], a[j % 2]);
                });
                s.store(accbuf.add(tt * S::L), s.add(a[0], a[1]));
            } else {
                let mut xs = [s.zero(); MAX_NCH];
                unroll!(32 max row_vectors::<S, HD>(); j in 0, g.nch => {
                    xs[j] = row_vec::<S, B, D, NIB>(s, g, d, row, tt, j);
                });
                row_into_queries::<S, HD>(s, &xs, g, q, nq, accbuf, tt);
            }
        }
        tt += 1;
    }
    // SAFETY: the caller's contract.
    unsafe { zero_tail(s, accbuf, nq, n) };
}

/// Row `tt`'s `nch` vectors `xs` multiplied into each of `nq` queries
/// (`hdp` floats apart from `q`): the partial sums go to
/// `accbuf[(i·T + tt)·L]` for [`reduce_query`].
///
/// # Safety
/// `q` valid for `nq·hdp` floats, `accbuf` for `nq·T·L`; `tt < T`;
/// `nch ≤ MAX_NCH`.
#[inline(always)]
pub(crate) unsafe fn row_into_queries<S: Simd, const HD: usize>(
    s: S,
    xs: &[S::F; MAX_NCH],
    g: Geo,
    q: *const f32,
    nq: usize,
    accbuf: *mut f32,
    tt: usize,
) {
    for i in 0..nq {
        // SAFETY: the caller's contract; vectors `j < nch`, queries `i < nq`.
        unsafe {
            let qi = q.add(i * g.hdp);
            let mut a = [s.zero(); 2];
            unroll!(32 max row_vectors::<S, HD>(); j in 0, g.nch => {
                a[j % 2] = s.fma(xs[j], s.load(qi.add(j * S::L)), a[j % 2]);
            });
            s.store(accbuf.add((i * S::T + tt) * S::L), s.add(a[0], a[1]));
        }
    }
}

/// Zero the partial sums of tile rows `n..T` of every query.
///
/// # Safety
/// `accbuf` valid for `nq·T·L` floats.
#[inline(always)]
pub(crate) unsafe fn zero_tail<S: Simd>(s: S, accbuf: *mut f32, nq: usize, n: usize) {
    for i in 0..nq {
        for tt in n..S::T {
            // SAFETY: `i < nq`, `tt < T`.
            unsafe { s.store(accbuf.add((i * S::T + tt) * S::L), s.zero()) };
        }
    }
}

/// Vectors of a row of `HD` channels (`HD > 0`), or the most any row of
/// the fused kernels has: the bound of an [`unroll!`] over a row, so an
/// instance compiles only the copies its shape needs.
pub(crate) const fn row_vectors<S: Simd, const HD: usize>() -> usize {
    if HD > 0 {
        HD.div_ceil(S::L)
    } else {
        MAX_NCH
    }
}

/// Vector `j` of token `tt`'s row for [`fused_scores_tile`]: the
/// dequantized codes, or with `NIB` (2- and 4-bit raw codes read a byte
/// vector at a time, queries rewritten by [`nibble_queries`]) field
/// `f = j div h` of byte vector `j mod h`, `h = nch·B/8`: for 4 bits the
/// prefix `v_f = b & (2^{4·(f+1)} − 1)` (the low nibbles, then the whole
/// bytes); for 2 bits the field in place, `b & (3·4^f)` ([`byte_field`]).
///
/// # Safety
/// `row` valid for the row's bytes; `Geo::fast`; `j < nch`.
#[inline(always)]
pub(crate) unsafe fn row_vec<S: Simd, const B: u8, D: Deq<S>, const NIB: bool>(
    s: S,
    g: Geo,
    d: D,
    row: *const u8,
    tt: usize,
    j: usize,
) -> S::F {
    // SAFETY: the caller's contract.
    unsafe {
        if NIB {
            let h = g.nch * B as usize / 8;
            let bytes = s.load_u8(row.add(j % h * S::L));
            if telescoped(B as u32) {
                byte_prefix::<S>(s, bytes, j / h)
            } else {
                byte_field::<S, B>(s, bytes, j / h)
            }
        } else {
            d.apply(s, tt, j, codes_f32::<S, B>(s, row, g.hd, j))
        }
    }
}

/// Prefix `f` of 4-bit fields of widened bytes as floats: the low nibble,
/// then the byte. Field `f` is `(prefix f − prefix f−1)/16^f`, exactly.
#[inline(always)]
pub(crate) fn byte_prefix<S: Simd>(s: S, bytes: S::I, f: usize) -> S::F {
    if f == 0 {
        s.field_f32::<4>(bytes)
    } else {
        s.cvt(bytes)
    }
}

/// Field `f` of `B`-bit fields (`B` 2 or 4) of widened bytes at `2^{B·f}`
/// times its value, exactly: 2-bit fields masked in place, the 4-bit high
/// nibble as the byte less its low one (measured faster than its mask; the
/// low nibble's lookup is the one field 0 made, where both are read in
/// one pass). The weighted sum's code vectors, and the scores' 2-bit ones.
#[inline(always)]
pub(crate) fn byte_field<S: Simd, const B: u8>(s: S, bytes: S::I, f: usize) -> S::F {
    match (B, f) {
        (2, 0) => s.in_place_f32::<2, 0>(bytes),
        (2, 1) => s.in_place_f32::<2, 2>(bytes),
        (2, 2) => s.in_place_f32::<2, 4>(bytes),
        (2, _) => s.in_place_f32::<2, 6>(bytes),
        (_, 0) => s.field_f32::<4>(bytes),
        _ => s.sub(s.cvt(bytes), s.field_f32::<4>(bytes)),
    }
}

/// Whether the scores' queries for `bits`-bit byte vectors telescope (4-bit
/// prefixes, [`byte_prefix`]) rather than read fields in place (2 bits).
#[inline(always)]
pub(crate) fn telescoped(bits: u32) -> bool {
    bits == 4
}

/// Rewrite per-channel queries for `bits`-bit rows (2 or 4) read a byte
/// vector at a time (see [`row_vec`]). Byte `c` of the plane holds the
/// fields of channels `c + f·m` (`m = hd·bits/8` bytes, `F = 8/bits`
/// fields), read at `2^{bits·f}` times their value, so field `f`'s queries
/// are scaled by `2^{−bits·f}` (exact). 4-bit rows read the prefixes `v_0 =
/// b & 15` and `v_1 = b`, field 1 being `(v_1 − v_0)/16`, so the dot
/// product telescopes: `q_0·x_0 + q_1·x_1 = v_0·(q_0 − q_1/16) +
/// v_1·q_1/16`, and the kernel widens each byte vector once and converts
/// it without a mask. `qs` holds `nq` queries of `hdp` floats.
#[inline(always)]
pub(crate) fn nibble_queries(qs: &mut [f32], nq: usize, hd: usize, hdp: usize, bits: u32) {
    let fields = (8 / bits) as usize;
    let m = hd / fields;
    for qi in qs.chunks_exact_mut(hdp).take(nq) {
        // Scale field `f` by 2^−bits·f (exact), then (prefixes) subtract
        // the next.
        unscale_fields(&mut qi[..hd], bits);
        if !telescoped(bits) {
            continue;
        }
        for f in 0..fields - 1 {
            let (cur, next) = qi[f * m..(f + 2) * m].split_at_mut(m);
            for (a, b) in cur.iter_mut().zip(next.iter()) {
                *a -= *b;
            }
        }
    }
}

/// Multiply field `f` of `x` (`F = 8/bits` equal parts) by `2^{−bits·f}`
/// (exact): the field scale of a byte-vector row ([`byte_field`],
/// [`byte_prefix`]).
#[inline(always)]
pub(crate) fn unscale_fields(x: &mut [f32], bits: u32) {
    let fields = (8 / bits) as usize;
    let m = x.len() / fields;
    for f in 1..fields {
        let k = 1.0 / (1u32 << (bits as usize * f)) as f32;
        for v in &mut x[f * m..(f + 1) * m] {
            *v *= k;
        }
    }
}

/// Reduce query `i`'s `T` partial sums in `accbuf` to one score per token.
///
/// # Safety
/// `accbuf` valid for `(i+1)·T·L` floats.
#[inline(always)]
pub(crate) unsafe fn reduce_query<S: Simd>(s: S, accbuf: *const f32, i: usize) -> S::F {
    let mut acc = [s.zero(); 16];
    for (tt, a) in acc.iter_mut().enumerate().take(S::T) {
        // SAFETY: the caller's contract.
        *a = unsafe { s.load(accbuf.add((i * S::T + tt) * S::L)) };
    }
    s.reduce(&acc)
}

/// Scores of the tile against one (padded) query: lane `t` of the result
/// is `q · scratch[t]`.
///
/// # Safety
/// `scr` valid for `T·hdp` floats, `q` for `hdp`.
#[inline(always)]
pub(crate) unsafe fn dot_tile<S: Simd>(s: S, scr: *const f32, nch: usize, q: *const f32) -> S::F {
    let mut acc = [s.zero(); 16];
    for j in 0..nch {
        // SAFETY: vector `j < nch` of the query and of rows `tt < T`.
        unsafe {
            let qj = s.load(q.add(j * S::L));
            let c = scr.add(j * S::T * S::L);
            for (tt, a) in acc.iter_mut().enumerate().take(S::T) {
                *a = s.fma(s.load(c.add(tt * S::L)), qj, *a);
            }
        }
    }
    s.reduce(&acc)
}

/// `acc[j] += Σ_t w_t·scratch[j][t]` for vectors `j0..j1`, with the `T`
/// weights already broadcast.
///
/// # Safety
/// `scr` valid for `T·hdp` floats, `acc` for `hdp`; `j1 ≤ nch`.
#[inline(always)]
pub(crate) unsafe fn sum_vectors<S: Simd>(
    s: S,
    scr: *const f32,
    j0: usize,
    j1: usize,
    w: &[S::F; 16],
    acc: *mut f32,
) {
    for j in j0..j1 {
        // SAFETY: vector `j < nch` of `acc` and of rows `tt < T`.
        unsafe {
            let mut a = [s.zero(); 4];
            let c = scr.add(j * S::T * S::L);
            for (tt, w) in w.iter().enumerate().take(S::T) {
                a[tt % 4] = s.fma(s.load(c.add(tt * S::L)), *w, a[tt % 4]);
            }
            let r = s.add(s.add(a[0], a[1]), s.add(a[2], a[3]));
            let o = acc.add(j * S::L);
            s.store(o, s.add(s.load(o), r));
        }
    }
}

/// Broadcast `T` weights.
///
/// # Safety
/// `p` valid for `T` floats.
#[inline(always)]
pub(crate) unsafe fn splat_tile<S: Simd>(s: S, p: *const f32) -> [S::F; 16] {
    let mut w = [s.zero(); 16];
    for (tt, w) in w.iter_mut().enumerate().take(S::T) {
        // SAFETY: `tt < T`.
        *w = unsafe { s.bcast(p.add(tt)) };
    }
    w
}

/// Write the first `out.len() ≤ T` lanes of `v`.
#[inline(always)]
pub(crate) fn store_lanes<S: Simd>(s: S, v: S::F, out: &mut [f32]) {
    if out.len() == S::T {
        // SAFETY: `out` holds `T = L` floats.
        unsafe { s.store(out.as_mut_ptr(), v) };
        return;
    }
    let mut tmp = [0f32; 16];
    // SAFETY: `tmp` holds 16 ≥ L floats.
    unsafe { s.store(tmp.as_mut_ptr(), v) };
    out.copy_from_slice(&tmp[..out.len()]);
}
