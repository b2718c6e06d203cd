//! The packed weighted sum: the driver, the scale expansion and the fused per-token kernel.

use super::*;

/// Packed weighted sum: `out_i += Σ_t p[i·tokens + t] · v̂_t`.
///
/// Per-token values with groups of whole vectors and one query keep raw
/// codes in the tile and fold the scales into the weights, group by group
/// (`w_tg = p_t·scale_tg`), adding `Σ_t p_t·zero_tg` per group at the end
/// (the fused kernel for the compiled shapes with one or four queries).
/// With two or more queries, other groupings and per-channel values the
/// tile is dequantized once and every query sums its rows.
///
/// # Safety
/// [`super::check_head`]`(head, out.len(), p.len())` passed; `HD` is 0 or
/// the head's `head_dim`.
#[inline(always)]
pub(crate) unsafe fn weighted_sum<S: Simd, const B: u8, const HD: usize>(
    s: S,
    head: &PackedHead<'_>,
    p: &[f32],
    out: &mut [f32],
) {
    let pl = Plan::new(head);
    let g = Geo::new::<S, B, HD>(head.layout().head_dim(), head.layout().scheme().bits());
    let (hd, hdp, t_all) = (g.hd, g.hdp, pl.tokens);
    let nq = out.len() / hd;
    if t_all == 0 {
        return;
    }
    // The unpacked tile, allocated by the arms that unpack into memory.
    let scr_len = S::T * hdp;
    let mut u8buf = vec![0u8; hdp];
    let mut acc = Buf::new(nq * hdp);
    let codes = head.codes().as_ptr();
    let tile_p = |i: usize, t0: usize, n: usize| tile_weights(p, t_all, i, t0, n);
    // 3-bit rows take the fused path only transcoded to bytes, so no
    // 3-bit instance of `fused_sum_pt` is compiled.
    let t3 = if const { HD > 0 && B == 3 } {
        Tile3::new::<B>(s, hd)
    } else {
        None
    };
    match head.layout().scheme().axis() {
        Axis::PerToken
            if const { HD > 0 }
                && g.fast
                && (matches!(nq, 1..=4 | 8) || (B == 4 && nq <= 8))
                && g.nch <= MAX_NCH
                && (B != 3 || t3.is_some())
                && (!matches!(B, 2 | 4) || {
                    let fmt = head.layout().scheme().scale_format();
                    // Two queries: both in registers for a whole row
                    // (measured 1.4x faster than the tile kernels).
                    match nq {
                        1 => byte_vectors::<S, B, 1>(g, fmt),
                        2 => byte_vectors::<S, B, 2>(g, fmt),
                        3 => byte_vectors::<S, B, 3>(g, fmt),
                        4 => byte_vectors::<S, B, 4>(g, fmt),
                        5 => byte_vectors::<S, B, 5>(g, fmt),
                        6 => byte_vectors::<S, B, 6>(g, fmt),
                        7 => byte_vectors::<S, B, 7>(g, fmt),
                        _ => byte_vectors::<S, B, 8>(g, fmt),
                    }
                })
                && head.layout().channels_per_group().is_multiple_of(S::L) =>
        {
            let mut tp = TileParams::new::<S>(head, g, pl);
            let a = acc.m();
            // SAFETY: check_head passed; the shape conditions of the arm
            // hold. Transcoded 3-bit rows are read as 8-bit rows.
            unsafe {
                match (nq, t3) {
                    (1, Some(t3)) => fused_sum_pt::<S, 8, 1>(s, g, head, &mut tp, p, a, Some(t3)),
                    (2, Some(t3)) => fused_sum_pt::<S, 8, 2>(s, g, head, &mut tp, p, a, Some(t3)),
                    (3, Some(t3)) => fused_sum_pt::<S, 8, 3>(s, g, head, &mut tp, p, a, Some(t3)),
                    (4, Some(t3)) => fused_sum_pt::<S, 8, 4>(s, g, head, &mut tp, p, a, Some(t3)),
                    (_, Some(t3)) => fused_sum_pt::<S, 8, 8>(s, g, head, &mut tp, p, a, Some(t3)),
                    (1, None) if const { B != 3 } => {
                        fused_sum_pt::<S, B, 1>(s, g, head, &mut tp, p, a, None)
                    }
                    (2, None) if const { B != 3 } => {
                        fused_sum_pt::<S, B, 2>(s, g, head, &mut tp, p, a, None)
                    }
                    (3, None) if const { B != 3 } => {
                        fused_sum_pt::<S, B, 3>(s, g, head, &mut tp, p, a, None)
                    }
                    (4, None) if const { B != 3 } => {
                        fused_sum_pt::<S, B, 4>(s, g, head, &mut tp, p, a, None)
                    }
                    (5, None) if const { B == 4 } => {
                        fused_sum_pt::<S, B, 5>(s, g, head, &mut tp, p, a, None)
                    }
                    (6, None) if const { B == 4 } => {
                        fused_sum_pt::<S, B, 6>(s, g, head, &mut tp, p, a, None)
                    }
                    (7, None) if const { B == 4 } => {
                        fused_sum_pt::<S, B, 7>(s, g, head, &mut tp, p, a, None)
                    }
                    (_, None) if const { B != 3 } => {
                        fused_sum_pt::<S, B, 8>(s, g, head, &mut tp, p, a, None)
                    }
                    (_, None) => unreachable!("the arm's guard holds a 3-bit tile"),
                }
            }
        }
        Axis::PerToken => {
            let mut scr = Buf::new(scr_len);
            let mut tp = TileParams::new::<S>(head, g, pl);
            let (gpr, cpg) = (tp.gpr, tp.cpg);
            let gch = gpr.div_ceil(S::L);
            // Groups of whole vectors and `nch ≤ MAX_NCH`: `gpr ≤ 32` groups.
            assert!(tp.rows.is_some() || gch <= 4);
            let wst = gch * S::L;
            // Token-major weights of the tile, `w[t][k] = p_t·scale_tk`,
            // and `Σ_t p_t·zero_tk` per query (lanes of `zacc`).
            let mut wbuf = Buf::new(S::T * wst);
            let mut zacc = Buf::new(nq * wst);
            let vpg = cpg / S::L;
            // Many queries (prefill, wide GQA): the tile is dequantized
            // once and each query's sum is a plain weighted sum of rows.
            // With few, folding the scales into each query's weights
            // costs less than dequantizing every code.
            let deq_tile = tp.rows.is_some() || nq >= DEQ_TILE_QUERIES;
            let mut t0 = 0;
            while t0 < t_all {
                let n = S::T.min(t_all - t0);
                tp.load(s, head, t0, n);
                let rows = tp.deq_rows();
                // SAFETY: rows `t0..t0+n ≤ tokens` are in `codes`
                // (check_head); the scratch holds `T` rows of `hdp`.
                unsafe {
                    let (r, sp, u8b) = (
                        codes.add(t0 * g.rb),
                        scr.m().as_mut_ptr(),
                        u8buf.as_mut_ptr(),
                    );
                    match rows {
                        Some(d) => unpack_tile::<S, B, Rows>(s, g, r, n, sp, u8b, d),
                        None if deq_tile => {
                            unpack_tile::<S, B, PerToken>(s, g, r, n, sp, u8b, tp.deq())
                        }
                        None => unpack_tile::<S, B, Raw>(s, g, r, n, sp, u8b, Raw),
                    }
                }
                for i in 0..nq {
                    let pt = tile_p(i, t0, n);
                    let a = acc.m()[i * hdp..].as_mut_ptr();
                    if deq_tile {
                        // SAFETY: `pt` holds T weights; `acc` `hdp` floats per query.
                        unsafe {
                            sum_vectors(
                                s,
                                scr.s().as_ptr(),
                                0,
                                g.nch,
                                &splat_tile(s, pt.as_ptr()),
                                a,
                            )
                        };
                        continue;
                    }
                    let d = tp.deq();
                    let mut zt = [s.zero(); 4];
                    for (tt, &pv) in pt.iter().enumerate().take(n) {
                        let pb = s.splat(pv);
                        for (c, z) in zt.iter_mut().enumerate().take(gch) {
                            // SAFETY: the params buffers are padded by
                            // `PAD ≥ wst` floats past the tile's last token,
                            // so these `L`-lane reads stay inside; lanes past
                            // `gpr` are never used. `wbuf` holds `T` rows of
                            // `wst`.
                            unsafe {
                                let o = tt * d.stride + c * S::L;
                                s.store(
                                    wbuf.m().as_mut_ptr().add(tt * wst + c * S::L),
                                    s.mul(s.load(d.sc.add(o)), pb),
                                );
                                *z = s.fma(s.load(d.ze.add(o)), pb, *z);
                            }
                        }
                    }
                    for (c, z) in zt.iter().enumerate().take(gch) {
                        // SAFETY: `zacc` holds `wst = gch·L` floats per query.
                        unsafe {
                            let zp = zacc.m().as_mut_ptr().add(i * wst + c * S::L);
                            s.store(zp, s.add(s.load(zp), *z));
                        }
                    }
                    // No stale weight (an inf times a zero code is NaN).
                    wbuf.m()[n * wst..].fill(0.0);
                    for k in 0..gpr {
                        let mut w = [s.zero(); 16];
                        for (tt, w) in w.iter_mut().enumerate().take(S::T) {
                            *w = s.splat(wbuf.s()[tt * wst + k]);
                        }
                        // SAFETY: vectors `k·vpg..(k+1)·vpg ≤ nch` (groups
                        // are whole vectors); `acc` `hdp` floats per query.
                        unsafe { sum_vectors(s, scr.s().as_ptr(), k * vpg, (k + 1) * vpg, &w, a) };
                    }
                }
                t0 += n;
            }
            if !deq_tile {
                for i in 0..nq {
                    let a = &mut acc.m()[i * hdp..i * hdp + hd];
                    for (k, a) in a.chunks_mut(cpg).enumerate() {
                        let z = zacc.s()[i * wst + k];
                        a.iter_mut().for_each(|a| *a += z);
                    }
                }
            }
        }
        Axis::PerChannel => {
            let mut scr = Buf::new(scr_len);
            let mut work = ChannelSum {
                p,
                t_all,
                nq,
                hdp,
                nch: g.nch,
                acc: acc.m().as_mut_ptr(),
            };
            // SAFETY: the caller's contract; the scratch and `u8buf` are
            // sized for `g`, `acc` holds `hdp` floats per query.
            unsafe { channel_tiles::<S, B, _>(s, g, head, &pl, &mut scr, &mut u8buf, &mut work) };
        }
    }
    for i in 0..nq {
        for (o, a) in out[i * hd..(i + 1) * hd]
            .iter_mut()
            .zip(&acc.s()[i * hdp..])
        {
            *o += a;
        }
    }
}

/// Queries from which the generic per-token weighted sum dequantizes each
/// tile once rather than folding scales into every query's weights.
const DEQ_TILE_QUERIES: usize = 2;

/// Tokens `t0..t0 + n` of query `i`'s weights (`p` is `[nq, t_all]`), zero
/// past the last token: one tile's weights for `splat_tile`.
#[inline(always)]
fn tile_weights(p: &[f32], t_all: usize, i: usize, t0: usize, n: usize) -> [f32; 16] {
    let mut w = [0f32; 16];
    w[..n].copy_from_slice(&p[i * t_all + t0..i * t_all + t0 + n]);
    w
}

/// The weighted sum of per-channel tiles into `acc` (`hdp` floats per
/// query): `acc_i += Σ_t p[i·t_all + t]·tile_t`.
struct ChannelSum<'a> {
    p: &'a [f32],
    t_all: usize,
    nq: usize,
    hdp: usize,
    nch: usize,
    acc: *mut f32,
}

impl<S: Simd> TileWork<S> for ChannelSum<'_> {
    #[inline(always)]
    unsafe fn tile(&mut self, s: S, t0: usize, n: usize, scr: *mut f32) {
        for i in 0..self.nq {
            let w = tile_weights(self.p, self.t_all, i, t0, n);
            // SAFETY: `w` holds `T ≤ 16` weights; `acc` `hdp` floats per
            // query `i < nq`; the scratch the caller's.
            unsafe {
                let a = self.acc.add(i * self.hdp);
                sum_vectors(s, scr, 0, self.nch, &splat_tile(s, w.as_ptr()), a);
            }
        }
    }
}

/// The per-vector scales of a tile whose groups fit one vector
/// (`gpr ≤ L`): row `t` of `w` gets token `t`'s scales permuted to the
/// vectors by `ix` (`ne ≤ 2·L` floats per row). With the weights `pw` of
/// a single query, the rows are `pw[t]·scale` and `Σ_t pw[t]·zero_t` is
/// added into `z` in the same pass (four independent chains). With `zo =
/// (zr, f)`, row `t` of `zr` gets the zeros permuted the same way, times
/// the per-vector factors `f`.
///
/// # Safety
/// `d` holds `n` tokens' params with `L` readable floats at each token's
/// scales and zeros; `w` (and `zr`) hold `n` rows of `ne`; `pw`, if given,
/// `n` weights.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn expand_scales<S: Simd>(
    s: S,
    d: PerToken,
    pw: Option<&[f32]>,
    zo: Option<(*mut f32, [S::F; 2])>,
    ix: [S::I; 2],
    ne: usize,
    n: usize,
    w: *mut f32,
    z: &mut S::F,
) {
    let mut zt = [s.zero(); 4];
    let mut t = 0;
    while t < n {
        unroll!(4; u in 0, 4 => {
            if t + u < n {
                let o = (t + u) * d.stride;
                // SAFETY: the caller's contract; row `t + u < n`.
                unsafe {
                    let mut v = s.load(d.sc.add(o));
                    if let Some(pw) = pw {
                        let pb = s.bcast(pw.as_ptr().add(t + u));
                        v = s.mul(v, pb);
                        zt[u] = s.fma(s.load(d.ze.add(o)), pb, zt[u]);
                    }
                    let r = w.add((t + u) * ne);
                    s.store(r, s.permute(v, ix[0]));
                    if ne > S::L {
                        s.store(r.add(S::L), s.permute(v, ix[1]));
                    }
                    if let Some((zr, f)) = zo {
                        let ze = s.load(d.ze.add(o));
                        let r = zr.add((t + u) * ne);
                        s.store(r, s.mul(s.permute(ze, ix[0]), f[0]));
                        if ne > S::L {
                            s.store(r.add(S::L), s.mul(s.permute(ze, ix[1]), f[1]));
                        }
                    }
                }
            }
        });
        t += 4;
    }
    *z = s.add(*z, s.add(s.add(zt[0], zt[1]), s.add(zt[2], zt[3])));
}

/// [`expand_scales`] for one query, straight from `f16` params: row `t`
/// of `w` gets token `t`'s scales times `pw[t]`, permuted to the vectors
/// by `ix`. Token `t`'s `vals` numbers start at `src + 2·t·vals` and are
/// read as one vector (`2·gpr ≤ L` or symmetric), so `z` gets `Σ_t
/// pw[t]·(scales, zeros)`: the zero sums in lanes `gpr..2·gpr` (the
/// scale sums in lanes `0..gpr`). No widened copy of the params: its
/// stores and the loads of rows that straddle two of them were the
/// larger part of this step's cost (`docs/perf/records/2026-11-30-icelake.md`).
///
/// # Safety
/// `src` valid for `2·((n−1)·vals + L)` bytes; `pw` holds `n ≤ T`
/// weights; `w` `n` rows of `ne ≤ 2·L`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn expand_scales_f16<S: Simd>(
    s: S,
    src: *const u8,
    vals: usize,
    pw: &[f32],
    ix: [S::I; 2],
    ne: usize,
    w: *mut f32,
    z: &mut S::F,
) {
    let n = pw.len();
    let mut zt = [s.zero(); 4];
    let mut t = 0;
    while t < n {
        unroll!(4; u in 0, 4 => {
            if t + u < n {
                // SAFETY: the caller's contract; row `t + u < n`.
                unsafe {
                    let v = s.load_f16(src.add(2 * (t + u) * vals));
                    let v = s.mul(v, s.bcast(pw.as_ptr().add(t + u)));
                    zt[u] = s.add(zt[u], v);
                    let r = w.add((t + u) * ne);
                    s.store(r, s.permute(v, ix[0]));
                    if ne > S::L {
                        s.store(r.add(S::L), s.permute(v, ix[1]));
                    }
                }
            }
        });
        t += 4;
    }
    *z = s.add(*z, s.add(s.add(zt[0], zt[1]), s.add(zt[2], zt[3])));
}

/// [`expand_scales`] for several queries, straight from `f16` params: row
/// `t` of `w` gets token `t`'s scales permuted to the vectors by `ix.0`,
/// row `t` of `zr` its zeros (lanes picked by `ix.1`) times the per-vector
/// factors `f`. Token `t`'s `vals` numbers start at `src + 2·t·vals` and
/// are read as one vector. Reading the widened copy instead, each token's
/// vector straddled two of the copy's stores, a stall on store-to-load
/// forwarding per token.
///
/// # Safety
/// `src` valid for `2·((n−1)·vals + L)` bytes; `w` and `zr` hold `n ≤ T`
/// rows of `ne ≤ 2·L`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn expand_params_f16<S: Simd>(
    s: S,
    src: *const u8,
    vals: usize,
    n: usize,
    (ix, iz): ([S::I; 2], [S::I; 2]),
    f: [S::F; 2],
    ne: usize,
    (w, zr): (*mut f32, *mut f32),
) {
    for t in 0..n {
        // SAFETY: the caller's contract; row `t < n`.
        unsafe {
            let v = s.load_f16(src.add(2 * t * vals));
            let (r, q) = (w.add(t * ne), zr.add(t * ne));
            s.store(r, s.permute(v, ix[0]));
            s.store(q, s.mul(s.permute(v, iz[0]), f[0]));
            if ne > S::L {
                s.store(r.add(S::L), s.permute(v, ix[1]));
                s.store(q.add(S::L), s.mul(s.permute(v, iz[1]), f[1]));
            }
        }
    }
}

/// `z[c] += Σ_t pi[t]·zero_tc` for the `gch` zero vectors of a tile, in
/// four independent chains.
///
/// # Safety
/// `d` holds `pi.len()` tokens' params with `gch·L` readable floats at
/// each token's zeros; `gch ≤ 4`.
#[inline(always)]
pub(crate) unsafe fn zero_sums<S: Simd>(
    s: S,
    d: PerToken,
    pi: &[f32],
    gch: usize,
    z: &mut [S::F; 4],
) {
    let n = pi.len();
    // Indexed by unrolled constants only, so the chains stay in registers
    // (an iterator over `zt[u]` put them on the stack: a store-to-load
    // forwarding round trip per FMA).
    let mut zt = [[s.zero(); 4]; 4];
    let mut t = 0;
    while t < n {
        unroll!(4; u in 0, 4 => {
            if t + u < n {
                // SAFETY: the caller's contract; token `t + u < n`.
                unsafe {
                    let pb = s.bcast(pi.as_ptr().add(t + u));
                    let o = (t + u) * d.stride;
                    unroll!(4; c in 0, 4 => {
                        if c < gch {
                            zt[u][c] = s.fma(s.load(d.ze.add(o + c * S::L)), pb, zt[u][c]);
                        }
                    });
                }
            }
        });
        t += 4;
    }
    unroll!(4; c in 0, 4 => {
        if c < gch {
            z[c] = s.add(
                z[c],
                s.add(s.add(zt[0][c], zt[1][c]), s.add(zt[2][c], zt[3][c])),
            );
        }
    });
}

/// Byte vectors per column block of [`fused_sum_pt`]'s byte-vector path:
/// `NQ·P·bb` accumulators (`P` the fields of a pass, [`pass_fields`])
/// fill half the register file.
#[inline(always)]
fn byte_block<S: Simd, const B: u8, const NQ: usize>(g: Geo) -> usize {
    let nf = 8 / B as usize;
    byte_block_max::<S, B, NQ>().min((g.nch / nf).max(1))
}

/// Fields of a code byte that [`fused_sum_pt`]'s byte-vector path takes
/// per pass over a tile: all of them, unless more than four queries'
/// accumulators for every field would overflow half the register file;
/// then the most that fit and divide the fields (2-bit rows with eight
/// queries on AVX-512: two passes of two fields; 4-bit rows with five to
/// eight on AVX2: two of one), each pass widening the bytes again,
/// rather than the tile kernels.
const fn pass_fields<S: Simd, const B: u8, const NQ: usize>() -> usize {
    let nf = fields::<B>();
    if NQ <= 4 || NQ * nf <= S::REGS / 2 {
        return nf;
    }
    // `nf` is a power of two: halve it until a pass fits (at least one).
    let mut p = nf;
    while p > 1 && NQ * p > S::REGS / 2 {
        p /= 2;
    }
    p
}

/// Passes over a tile of [`fused_sum_pt`]'s byte-vector path.
const fn passes<S: Simd, const B: u8, const NQ: usize>() -> usize {
    fields::<B>().div_ceil(pass_fields::<S, B, NQ>())
}

/// The copies of [`fused_sum_pt`]'s pass loop: [`passes`], at most two
/// ([`byte_vectors`] sends more to the tile kernels).
const fn passes_unrolled<S: Simd, const B: u8, const NQ: usize>() -> usize {
    let p = passes::<S, B, NQ>();
    if p > 2 {
        2
    } else {
        p
    }
}

/// Fields per code byte of `B`-bit codes (`B` = 0, the any-width
/// instance: 1).
const fn fields<const B: u8>() -> usize {
    8 / if B == 0 { 8 } else { B as usize }
}

/// The most byte vectors [`byte_block`] gives for any geometry: the
/// compile-time bound of the unrolled block loops (their copies are
/// emitted before the bounds fold, and the instances multiply: a loose
/// bound costs compile time and memory, not run time).
const fn byte_block_max<S: Simd, const B: u8, const NQ: usize>() -> usize {
    let nf = pass_fields::<S, B, NQ>();
    let jb = if S::REGS / 2 / NQ == 0 {
        1
    } else {
        S::REGS / 2 / NQ
    };
    // At most 8 (what `byte_vectors` accepts; 8-bit rows, which never
    // take this path, would give 16).
    if jb / nf == 0 {
        1
    } else if jb / nf > 8 {
        8
    } else {
        jb / nf
    }
}

/// Whether a 2- or 4-bit head of geometry `g` and scale format `fmt` fits
/// [`fused_sum_pt`]'s byte-vector path: each field is whole vectors, the
/// blocks tile the row, and scales are `f16` (the fields accumulate up to
/// `2^6` times too large, headroom only `f16` scales guarantee).
#[inline(always)]
fn byte_vectors<S: Simd, const B: u8, const NQ: usize>(g: Geo, fmt: ScaleFormat) -> bool {
    if !matches!(B, 2 | 4) {
        return false;
    }
    let nf = 8 / B as usize;
    let (h, bb) = (g.nch / nf, byte_block::<S, B, NQ>(g));
    (g.hd / nf).is_multiple_of(S::L)
        && h.is_multiple_of(bb)
        && bb * nf <= 16
        && bb <= 8
        // Five to eight queries: only where a pass's accumulators fit
        // half the register file, in at most two passes (a pass's fields
        // divide the byte's: `pass_fields` halves them).
        && (NQ <= 4
            || (NQ * pass_fields::<S, B, NQ>() * bb <= S::REGS / 2
                && passes::<S, B, NQ>() <= 2))
        && fmt == ScaleFormat::F16
}

/// Fused weighted sum of per-token values for `NQ` queries: each row is
/// unpacked into registers once and added into every query. Accumulators
/// live in registers for a tile at a time, `NQ ×` a column block of
/// vectors filling half the register file. Where `NQ ×` every field of a
/// byte vector would not fit, the tile is read in two passes, each over
/// half the fields ([`pass_fields`]).
///
/// The scales are expanded per vector (`w[t·ne + j]` is the scale of
/// vector `j`'s group), so every broadcast in the inner loop is a constant
/// offset from the token's row. One query folds its weight in
/// (`w = p_t·scale_tg`: one FMA per code vector) and keeps `Σ_t
/// p_t·zero_tg` per group, added at the end. Several queries dequantize
/// each code vector once (`code·scale + zero`, one FMA, zeros expanded
/// like the scales) and take it into every query with `p_it`.
///
/// With `t3`, each tile's 3-bit rows are transcoded to code bytes first
/// and read as `B` = 8-bit rows.
///
/// # Safety
/// `check_head` passed for `NQ` queries; `Geo::fast`, `nch ≤ MAX_NCH`,
/// groups of whole vectors; `acc` holds `NQ·hdp` floats; `B` is the
/// head's width, or 8 with `t3` (made for this head).
#[inline(always)]
pub(crate) unsafe fn fused_sum_pt<S: Simd, const B: u8, const NQ: usize>(
    s: S,
    g: Geo,
    head: &PackedHead<'_>,
    tp: &mut TileParams,
    p: &[f32],
    acc: &mut [f32],
    mut t3: Option<Tile3<S>>,
) {
    let t_all = head.tokens();
    let (gpr, cpg, hdp, nch) = (tp.gpr, tp.cpg, g.hdp, g.nch);
    let gch = gpr.div_ceil(S::L);
    let fold = NQ > 1;
    // Floats per token of the per-vector scales.
    let ne = nch.div_ceil(S::L) * S::L;
    let mut wbuf = Buf::new(2 * S::T * ne);
    // Lane `l` of index vector `m`: the group of vector `m·L + l`.
    let mut idx = [[0i32; 16]; 2];
    let perm = gch == 1 && ne <= 2 * S::L;
    if perm {
        for j in 0..nch {
            idx[j / S::L][j % S::L] = tp.goff[j] as i32;
        }
    }
    // SAFETY: each index array holds 16 ≥ L lanes.
    let ix = unsafe {
        [
            s.load_i(idx[0].as_ptr() as *const f32),
            s.load_i(idx[1].as_ptr() as *const f32),
        ]
    };
    // `Σ_t p_t·zero_tg` of one query (several fold their zeros in).
    let mut zacc = [s.zero(); 4];
    let codes = head.codes().as_ptr();
    assert!(acc.len() >= NQ * hdp && gch <= 4 && p.len() >= NQ * t_all);
    // Column blocks: `NQ·jb` accumulators fill half the register file.
    let jb = (S::REGS / 2 / NQ).max(1);
    // 2- and 4-bit rows read a byte vector at a time: byte vector `jj`
    // gives the `F = 8/B` vectors `jj + f·h` (its fields), so a block is
    // `bb` byte vectors and `P·bb` accumulators per query for the `P`
    // fields of a pass ([`pass_fields`]). Field `f` is
    // read as `2^{B·f}` times its value (`byte_field`); it accumulates at
    // that scale and is scaled back at the end. That costs up to 6 bits of
    // exponent headroom: only with f16 scales (at most 65504), where it
    // overflows only for weights beyond ≈10^30, not for probabilities.
    let nf = 8 / B as usize;
    let h = nch / nf;
    let bb = byte_block::<S, B, NQ>(g);
    // 2- and 4-bit instances hold only the byte-vector path (the driver
    // routes every other shape to the tile kernels); 8-bit ones only the
    // vector path.
    let nib = matches!(B, 2 | 4);
    assert!(!nib || byte_vectors::<S, B, NQ>(g, tp.p.fmt));
    // Accumulator slots per field.
    let fs = 16 / nf;
    // Several queries fold each vector's zero in with its scale (`x·scale
    // + zero`, one FMA per code vector) and need no per-query zero sums.
    // On the byte-vector path vector `j` is field `j div h` at `2^{B·f}`
    // times its codes, and so is its zero. (Exact: a power of two.)
    let mut zbuf = Buf::new(2 * S::T * ne);
    let mut fzv = [1f32; MAX_NCH];
    if nib {
        for (j, f) in fzv.iter_mut().enumerate().take(nch) {
            *f = (1u32 << (B as usize * (j / h))) as f32;
        }
    }
    // SAFETY: `fzv` holds `MAX_NCH` = 32 ≥ 2·L floats.
    let fz = unsafe { [s.load(fzv.as_ptr()), s.load(fzv.as_ptr().add(S::L))] };
    tp.spread = true;
    // `f16` params whose scales and zeros fit one vector: one query's
    // weights ([`expand_scales_f16`]) or several queries' scales and zeros
    // ([`expand_params_f16`]) straight from the stored params.
    let direct = perm && tp.p.fmt == ScaleFormat::F16 && (tp.p.sym || 2 * gpr <= S::L);
    // Several queries, straight from the stored params: the zeros' lanes
    // (`gpr..2·gpr`, or the scales' times `−half` when symmetric) and the
    // zero factors `fz` times that `−half`. (Exact: powers of two.)
    let (iz, fzd) = if tp.p.sym {
        let k = s.splat(-tp.p.half);
        (ix, [s.mul(fz[0], k), s.mul(fz[1], k)])
    } else {
        let mut iv = [[0i32; 16]; 2];
        for (a, b) in iv.iter_mut().flatten().zip(idx.iter().flatten()) {
            *a = b + gpr as i32;
        }
        // SAFETY: each index array holds 16 ≥ L lanes.
        let iz = unsafe {
            [
                s.load_i(iv[0].as_ptr() as *const f32),
                s.load_i(iv[1].as_ptr() as *const f32),
            ]
        };
        (iz, fz)
    };
    let mut tail = vec![0u8; 2 * (S::T * tp.vals + S::L)];
    // Two slots of `T` rows each: the next tile's weights are made before
    // the current tile's loop, so out-of-order execution overlaps their
    // latency chain (param load, convert, store, broadcast) with the loop
    // instead of stalling the loop's first FMAs on it.
    let slot = S::T * ne;
    let (wp, zp) = (wbuf.m().as_mut_ptr(), zbuf.m().as_mut_ptr());
    let tiles = t_all.div_ceil(S::T);
    // Step `it` makes tile `it`'s weights (and, with several queries,
    // zeros) into slot `it mod 2` (one query's zero sums into `zacc`),
    // then runs tile `it − 1`. (A closure would not inherit the target
    // features.)
    for it in 0..=tiles {
        if it < tiles {
            let (t0, k) = (it * S::T, it % 2);
            let n = S::T.min(t_all - t0);
            let pw = (!fold).then(|| &p[t0..t0 + n]);
            // SAFETY: slot `k < 2` of `wbuf`/`zbuf` (`2·T·ne` floats each).
            let (w, zr) = unsafe { (wp.add(k * slot), zp.add(k * slot)) };
            if direct {
                let (vals, par) = (tp.vals, head.params());
                let (a, b) = (2 * t0 * vals, 2 * ((n - 1) * vals + S::L));
                // The last tiles read through a padded copy.
                let src = if a + b <= par.len() {
                    par[a..].as_ptr()
                } else {
                    tail.fill(0);
                    tail[..2 * n * vals].copy_from_slice(&par[a..a + 2 * n * vals]);
                    tail.as_ptr()
                };
                // SAFETY: `src` holds `b` bytes (checked, or the copy of
                // `2·n·vals + 2·L` bytes); `pw` `n ≤ T` weights; the slots
                // `T` rows of `ne ≤ 2·L`.
                unsafe {
                    match pw {
                        Some(pw) => expand_scales_f16(s, src, vals, pw, ix, ne, w, &mut zacc[0]),
                        None => expand_params_f16(s, src, vals, n, (ix, iz), fzd, ne, (w, zr)),
                    }
                };
            } else {
                tp.load(s, head, t0, n);
                let d = tp.deq();
                if perm {
                    let zo = if fold { Some((zr, fz)) } else { None };
                    // SAFETY: the params buffers are padded by `PAD ≥ L` floats
                    // past the tile's last token; the slot holds `T ≥ n` rows of
                    // `ne`.
                    unsafe { expand_scales(s, d, pw, zo, ix, ne, n, w, &mut zacc[0]) };
                } else {
                    for t in 0..n {
                        let k = pw.map_or(1.0, |pw| pw[t]);
                        for (j, (&gj, &fj)) in tp.goff.iter().zip(&fzv).enumerate().take(nch) {
                            let o = t * d.stride + gj as usize;
                            // SAFETY: group `goff[j] < gpr` of token `t < n`; row
                            // `t < T` of the slot, `j < nch ≤ ne`.
                            unsafe {
                                let (sc, ze) = (*d.sc.add(o), *d.ze.add(o));
                                *w.add(t * ne + j) = sc * k;
                                if fold {
                                    *zr.add(t * ne + j) = ze * fj;
                                }
                            }
                        }
                    }
                }
                // (One query's zero sums were taken with its weights above;
                // several queries' are folded into the code vectors.)
                if !fold && !perm {
                    // SAFETY: as above, `PAD ≥ gch·L`.
                    unsafe { zero_sums(s, d, &p[t0..t0 + n], gch, &mut zacc) };
                }
            }
        }
        if it == 0 {
            continue;
        }
        let (t0, k) = ((it - 1) * S::T, (it - 1) % 2);
        let n = S::T.min(t_all - t0);
        let ah = tp.ahead(head, t0);
        // SAFETY: slot `k < 2`, as above.
        let (wt, zt) = unsafe {
            (
                wp.add(k * slot) as *const f32,
                zp.add(k * slot) as *const f32,
            )
        };
        // SAFETY: vectors `j < nch` of `acc` (`hdp` floats per query),
        // rows `t0..t0+n ≤ tokens` of `codes` (check_head), scales of
        // vectors `j < nch ≤ ne`, weights `t0..t0+n` of each query.
        unsafe {
            let mut pq = [p.as_ptr(); NQ];
            for (i, q) in pq.iter_mut().enumerate() {
                *q = q.add(i * t_all + t0);
            }
            // The tile's rows: in place, or transcoded (`hd` bytes each).
            let (tile, rb) = match &mut t3 {
                Some(t3) => (t3.load(s, codes.add(t0 * g.rb), g.rb, n), g.hd),
                None => (codes.add(t0 * g.rb), g.rb),
            };
            if const { matches!(B, 2 | 4) } {
                // `fp` fields per pass (all of them but where more
                // queries' accumulators would not fit, `pass_fields`);
                // pass `pi` takes fields `pi·fp ..`, in slots `ff·fs + k`.
                let fp = const { pass_fields::<S, B, NQ>() };
                let mut jj0 = 0;
                while jj0 < h {
                    unroll!(2 max passes_unrolled::<S, B, NQ>(); pi in 0, nf / fp => {
                        let mut a = [[s.zero(); 16]; NQ];
                        unroll!(8 max NQ; i in 0, NQ => {
                            unroll!(4 max pass_fields::<S, B, NQ>(); ff in 0, fp => {
                                let f = pi * fp + ff;
                                unroll!(8 max byte_block_max::<S, B, NQ>(); k in 0, bb => {
                                    let o = i * hdp + (jj0 + k + f * h) * S::L;
                                    a[i][ff * fs + k] = s.load(acc.as_ptr().add(o));
                                });
                            });
                        });
                        for tt in 0..n {
                            if jj0 == 0 && pi == 0 {
                                ah[0].token(tt);
                                ah[1].token(tt);
                            }
                            let row = tile.add(tt * rb + jj0 * S::L);
                            let w = wt.add(tt * ne + jj0);
                            let zr = zt.add(tt * ne + jj0);
                            let mut pb = [s.zero(); NQ];
                            if fold {
                                unroll!(8 max NQ; i in 0, NQ => { pb[i] = s.bcast(pq[i].add(tt)); });
                            }
                            // One widening per byte vector and pass; field `f`
                            // (vector `jj + f·h`) exact and `2^{B·f}` times
                            // the field.
                            unroll!(8 max byte_block_max::<S, B, NQ>(); k in 0, bb => {
                                let bytes = s.load_u8(row.add(k * S::L));
                                let mut x = [s.zero(); 4];
                                unroll!(4 max pass_fields::<S, B, NQ>(); ff in 0, fp => {
                                    x[ff] = byte_field::<S, B>(s, bytes, pi * fp + ff);
                                });
                                unroll!(4 max pass_fields::<S, B, NQ>(); ff in 0, fp => {
                                    let f = pi * fp + ff;
                                    let wf = s.bcast(w.add(f * h + k));
                                    if fold {
                                        let zf = s.bcast(zr.add(f * h + k));
                                        let xf = s.fma(x[ff], wf, zf);
                                        unroll!(8 max NQ; i in 0, NQ => {
                                            a[i][ff * fs + k] = s.fma(xf, pb[i], a[i][ff * fs + k]);
                                        });
                                    } else {
                                        a[0][ff * fs + k] = s.fma(x[ff], wf, a[0][ff * fs + k]);
                                    }
                                });
                            });
                        }
                        unroll!(8 max NQ; i in 0, NQ => {
                            unroll!(4 max pass_fields::<S, B, NQ>(); ff in 0, fp => {
                                let f = pi * fp + ff;
                                unroll!(8 max byte_block_max::<S, B, NQ>(); k in 0, bb => {
                                    let o = i * hdp + (jj0 + k + f * h) * S::L;
                                    s.store(acc.as_mut_ptr().add(o), a[i][ff * fs + k]);
                                });
                            });
                        });
                    });
                    jj0 += bb;
                }
            } else {
                let mut j0 = 0;
                while j0 < nch {
                    let j1 = (j0 + jb).min(nch);
                    let mut a = [[s.zero(); 16]; NQ];
                    unroll!(8 max NQ; i in 0, NQ => {
                        unroll!(16 max S::REGS / 2 / NQ; j in j0, j1 => {
                            a[i][j - j0] = s.load(acc.as_ptr().add(i * hdp + j * S::L));
                        });
                    });
                    for tt in 0..n {
                        if j0 == 0 {
                            ah[0].token(tt);
                            ah[1].token(tt);
                        }
                        let row = tile.add(tt * rb);
                        let w = wt.add(tt * ne);
                        let zr = zt.add(tt * ne);
                        let mut pb = [s.zero(); NQ];
                        if fold {
                            unroll!(8 max NQ; i in 0, NQ => { pb[i] = s.bcast(pq[i].add(tt)); });
                        }
                        unroll!(16 max S::REGS / 2 / NQ; j in j0, j1 => {
                            let x = codes_f32::<S, B>(s, row, g.hd, j);
                            if fold {
                                let x = s.fma(x, s.bcast(w.add(j)), s.bcast(zr.add(j)));
                                unroll!(8 max NQ; i in 0, NQ => {
                                    a[i][j - j0] = s.fma(x, pb[i], a[i][j - j0]);
                                });
                            } else {
                                a[0][j - j0] = s.fma(x, s.bcast(w.add(j)), a[0][j - j0]);
                            }
                        });
                    }
                    unroll!(8 max NQ; i in 0, NQ => {
                        unroll!(16 max S::REGS / 2 / NQ; j in j0, j1 => {
                            s.store(acc.as_mut_ptr().add(i * hdp + j * S::L), a[i][j - j0]);
                        });
                    });
                    j0 = j1;
                }
            }
        }
    }
    if nib {
        // Field `f` (channels `f·hd/F ..`) accumulated at `2^{B·f}`.
        for a in acc.chunks_exact_mut(hdp).take(NQ) {
            unscale_fields(&mut a[..g.hd], B as u32);
        }
    }
    if !fold {
        let mut zs = [0f32; 64];
        for (c, z) in zacc.iter().enumerate().take(gch) {
            // SAFETY: `zs` holds 64 ≥ 4·L floats.
            unsafe { s.store(zs.as_mut_ptr().add(c * S::L), *z) };
        }
        // The direct path summed `(scales, zeros)`: a symmetric zero is
        // `−half·scale`.
        let (zo, zk) = match (direct, tp.p.sym) {
            (false, _) => (0, 1.0),
            (true, false) => (gpr, 1.0),
            (true, true) => (0, -tp.p.half),
        };
        // Group by group: a division per channel (`c / cpg`, a run-time
        // divisor) cost more than a small page's whole sum.
        for (k, a) in acc[..g.hd].chunks_mut(cpg).enumerate() {
            let z = zs[zo + k] * zk;
            a.iter_mut().for_each(|a| *a += z);
        }
    }
}
