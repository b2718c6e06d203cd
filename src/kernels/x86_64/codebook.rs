//! The codebook kernels' vector loops (see `kernels/codebook.rs`). One
//! query at a compile-time head dim ([`one_query`]): each row looked up
//! with [`Simd::lut16`], scaled per group and multiplied into the query or
//! added into the output, all in registers. Several queries: a tile of
//! `T` rows decoded and scaled into the uniform kernels' vector-major
//! scratch, then one transposed reduction per query ([`dot_tile`]) or one
//! broadcast weighted update of every output vector ([`sum_vectors`]).

use super::generic::{
    dot_tile, reduce_query, row_vectors, splat_tile, store_lanes, sum_vectors, unroll, zero_tail,
    Ahead, Buf, Tile3, MAX_NCH,
};
use super::Simd;
use crate::kernels::codebook::Book;
use crate::scheme::Layout;
use crate::store::PackedHead;

/// Whether rows of this layout decode a whole vector per load: every
/// plane's bytes a multiple of `L` (4 bits: `head_dim/2`; 2 bits:
/// `head_dim/4`; 3 bits: both planes, `head_dim/4` and `head_dim/8`), or
/// a 3-bit row's 1-bit plane exactly half a vector (head_dim 64 on
/// AVX-512), loaded into both halves of the lanes ([`book_vec`]).
#[inline(always)]
pub(crate) fn takes<S: Simd>(l: &Layout, book: Book<'_>) -> bool {
    let hd = l.head_dim();
    let whole = |m: usize| m > 0 && m.is_multiple_of(S::L);
    match (l.scheme().bits(), book.fp8) {
        (8, true) => whole(hd),
        (4, false) => whole(hd / 2),
        (2, false) => whole(hd / 4),
        (3, false) => whole(hd / 4) && (whole(hd / 8) || 2 * (hd / 8) == S::L),
        _ => false,
    }
}

/// Assert every length [`run`] relies on.
#[inline(always)]
pub(crate) fn check(head: &PackedHead<'_>, x: usize, out: usize, sum: bool) {
    let l = head.layout();
    let (hd, t) = (l.head_dim(), head.tokens());
    assert!(
        head.codes().len() >= t * l.row_bytes(),
        "codebook: code rows"
    );
    let nq = if sum { out / hd } else { x / hd };
    let (xs, os) = if sum {
        (nq * t, nq * hd)
    } else {
        (nq * hd, nq * t)
    };
    assert!(x == xs && out == os, "codebook: lengths");
}

/// Vector `j` of a row's values before the group's scale: elements
/// `j·L..(j+1)·L`, from the `hd` codes at `row` (`B` 2, 3 or 4 with a
/// table; 8 for fp8, `fp8` its shift and factor). The lookup reads the
/// index's low four bits only, so a 4-bit field needs no mask, nor a
/// 2-bit one with the table repeated every four entries ([`table_for`]).
/// 2- and 3-bit tables repeat every eight entries, so their lookups take
/// [`Simd::lut8`]: one permute where AVX2's 16 entries take two and a
/// blend.
///
/// # Safety
/// `row` valid for `hd·B/8` bytes, every plane whole vectors or a 3-bit
/// row's 1-bit plane half a vector ([`takes`]), `j < hd/L`.
#[inline(always)]
unsafe fn book_vec<S: Simd, const B: u8>(
    s: S,
    tbl: S::T16,
    fp8: (u32, f32),
    row: *const u8,
    hd: usize,
    j: usize,
) -> S::F {
    let e = j * S::L;
    // SAFETY: every load reads `L` bytes (`L/2` for a 1-bit plane of
    // half a vector) inside the row's planes, by `takes` and the caller's
    // contract (see `crate::pack` for the plane layout).
    unsafe {
        match B {
            8 => {
                let v = s.load_u8(row.add(e));
                let sign = s.shr_mask(v, -24, 0x8000_0000);
                let mag = s.shr_mask(v, -(fp8.0 as i32), 0x7f << fp8.0);
                s.mul(s.bits_f32(s.or(sign, mag)), s.splat(fp8.1))
            }
            4 => {
                let m = hd / 2;
                let v = s.load_u8(row.add(e % m));
                s.lut16(tbl, s.shr_mask(v, 4 * (e / m) as i32, u32::MAX))
            }
            2 => {
                let m = hd / 4;
                let v = s.load_u8(row.add(e % m));
                s.lut8(tbl, s.shr_mask(v, 2 * (e / m) as i32, u32::MAX))
            }
            _ => {
                // Two planes: bits 0–1 in `m2` bytes, then bit 2 in `m1`
                // (element `e`'s at bit `e / m1` of byte `e mod m1`).
                let (m2, m1) = (hd / 4, hd / 8);
                let (f, jb) = (e / m2, e % m2);
                let lo = s.shr_mask(s.load_u8(row.add(jb)), 2 * f as i32, 3);
                let hi = if m1.is_multiple_of(S::L) {
                    let hi = s.load_u8(row.add(m2 + jb % m1));
                    s.shr_mask(hi, (2 * f + jb / m1) as i32 - 2, 4)
                } else {
                    // Half a vector (`2·m1 = L`): the plane in both halves,
                    // the low lanes' bit `e / m1`, the high lanes' next.
                    let hi = s.load_u8_dup(row.add(m2));
                    let k = (e / m1) as u32;
                    s.shr_pair_mask(hi, k, k + 1, 1, 2)
                };
                s.lut8(tbl, s.or(lo, hi))
            }
        }
    }
}

/// The 16-entry table the kernels look codes of `bits` up in: 2-bit
/// levels repeated every four entries ([`book_vec`], [`paired_codes`])
/// and 3-bit ones every eight ([`paired_codes`]), so a field shifted down
/// needs no mask and both look up with [`Simd::lut8`]; others as stored.
#[inline(always)]
fn table_for(book: Book<'_>, bits: u8) -> [f32; 16] {
    let mut t = *book.table;
    if (bits == 2 || bits == 3) && !book.fp8 {
        let m = (1 << bits) - 1;
        for i in 0..16 {
            t[i] = t[i & m];
        }
    }
    t
}

/// Whether rows decode in the paired order ([`paired_codes`]): 16 lanes,
/// head_dim 128, 2-, 3- or 4-bit table codes, groups of whole 32-channel
/// blocks (so each vector's lanes share one scale): 32, 64 or 128
/// channels, the kernels' `gshift` 5, 6 or 7.
#[inline(always)]
fn paired<S: Simd>(hd: usize, cpg: usize, bits: u8, fp8: bool) -> bool {
    S::L == 16 && hd == 128 && matches!(cpg, 32 | 64 | 128) && !fp8 && matches!(bits, 2..=4)
}

/// The row's 128 codes as 8 index vectors in the paired order: vector
/// `2b + r` holds the codes of channels `32b + 2i + r` (`i < 16`), the
/// even channels of block `b` and then its odd ones. In that order every
/// plane's bytes sit two to a lane after one `u16`-widening load per 32
/// bytes (the 3-bit rows' 16-byte plane loaded twice over into one
/// register), and each vector is one shift of such a register, where the
/// natural order takes a byte-widening load per vector: the shift runs
/// beside the table permutes, the widening competes with them for the
/// shuffle ports (`docs/PERFORMANCE.md`, "The paired order"). Only the
/// low four bits of a lane are the index; the bits above are other codes
/// (the lookup ignores them), and bit 3 of a 3-bit index or bits 2–3 of a
/// 2-bit one are too ([`table_for`] repeats the levels to match).
///
/// # Safety
/// `row` valid for `128·B/8` bytes; `S::L == 16`.
#[inline(always)]
unsafe fn paired_codes<S: Simd, const B: u8>(s: S, row: *const u8) -> [S::I; 8] {
    let shr = |v, n: u32| s.shr_mask(v, n as i32, u32::MAX);
    let mut ix = [s.zero_i(); 8];
    // SAFETY: every load reads inside the row's planes (`crate::pack`):
    // 64 bytes at 4 bits, 32 at 2, 32 + 16 at 3.
    unsafe {
        match B {
            4 => {
                // Byte `k` holds channel `k` (low nibble) and `k + 64`.
                let z = [s.load_u16(row), s.load_u16(row.add(32))];
                for b in 0..4 {
                    for r in 0..2 {
                        ix[2 * b + r] = shr(z[b % 2], (8 * r + 4 * (b / 2)) as u32);
                    }
                }
            }
            2 => {
                // Byte `k` holds channels `k + 32f` at bits `2f`.
                let z = s.load_u16(row);
                for b in 0..4 {
                    for r in 0..2 {
                        ix[2 * b + r] = shr(z, (8 * r + 2 * b) as u32);
                    }
                }
            }
            _ => {
                // Bits 0–1 as the 2-bit layout; bit 2 of channel `c` is
                // bit `c / 16` of byte `32 + c % 16`. With that plane
                // repeated in both halves of the lanes, code `(b, r)` of
                // lane `i` has its bit 2 at `8r + 2b + [i ≥ 8]`: moved to
                // `8r + 2b + 2`, just above its low bits, a select per
                // parity of `b` joins the planes.
                let lo = s.load_u16(row);
                let hi = s.shr_pair_mask(s.load_u16_dup(row.add(32)), 0, 1, u32::MAX, 2);
                let even = s.select(0x3333, lo, hi);
                let odd = s.select(0xCCCC, lo, hi);
                for b in 0..4 {
                    for r in 0..2 {
                        let v = if b % 2 == 0 { even } else { odd };
                        ix[2 * b + r] = shr(v, (8 * r + 2 * b) as u32);
                    }
                }
            }
        }
    }
    ix
}

/// Rows of 128 floats from the natural order to the paired one
/// ([`paired_codes`]) (`back` false) or back.
fn pair_rows(src: &[f32], dst: &mut [f32], back: bool) {
    for (s, d) in src.chunks_exact(128).zip(dst.chunks_exact_mut(128)) {
        for v in 0..8 {
            for i in 0..16 {
                let c = 32 * (v / 2) + 2 * i + v % 2;
                if back {
                    d[c] = s[16 * v + i];
                } else {
                    d[16 * v + i] = s[c];
                }
            }
        }
    }
}

/// Decode the `hd` codes of `row` to their values, times their group's
/// scale from `sc` when `SCALED` (groups of `2^gshift` channels, a
/// multiple of `L`; else unscaled: the caller scales). Vector `j` of the
/// row goes to `dst + j·stride`. The width and the scaling are
/// compile-time constants so the loops are straight-line vector code.
///
/// # Safety
/// As [`book_vec`]; `dst` valid for `hd/L` vectors `stride` floats apart;
/// with `SCALED`, `sc` holds `hd >> gshift` scales.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn decode_codes<S: Simd, const B: u8, const SCALED: bool>(
    s: S,
    tbl: S::T16,
    fp8: (u32, f32),
    row: *const u8,
    hd: usize,
    (sc, gshift): (*const f32, u32),
    (dst, stride): (*mut f32, usize),
) {
    // 2- and 4-bit rows a field of the plane at a time, so each field's
    // shift is a constant: `book_vec` at a run-time head dim shifts by a
    // run-time amount, a register move and a slower shift per vector.
    // The same lookups and products.
    if B == 2 || B == 4 {
        // Bytes of the plane, each holding one element of every field.
        let m = hd * B as usize / 8;
        macro_rules! field {
            ($f:literal) => {
                if $f * B < 8 {
                    for jb in (0..m).step_by(S::L) {
                        let e = $f * m + jb;
                        // SAFETY: the caller's contract: the plane's `m`
                        // bytes are whole vectors ([`takes`]), element `e <
                        // hd` is vector `e/L` of `dst`, its group `e >>
                        // gshift` of the row.
                        unsafe {
                            let ix = s.shr_mask(s.load_u8(row.add(jb)), (B * $f) as i32, u32::MAX);
                            let v = if B == 2 {
                                s.lut8(tbl, ix)
                            } else {
                                s.lut16(tbl, ix)
                            };
                            let v = if SCALED {
                                s.mul(v, s.bcast(sc.add(e >> gshift)))
                            } else {
                                v
                            };
                            s.store(dst.add(e / S::L * stride), v)
                        }
                    }
                }
            };
        }
        field!(0);
        field!(1);
        field!(2);
        field!(3);
        return;
    }
    for j in 0..hd / S::L {
        // SAFETY: the caller's contract; `j < hd/L`, group `j·L >> gshift`
        // of the row.
        unsafe {
            let v = book_vec::<S, B>(s, tbl, fp8, row, hd, j);
            let v = if SCALED {
                s.mul(v, s.bcast(sc.add((j * S::L) >> gshift)))
            } else {
                v
            };
            s.store(dst.add(j * stride), v)
        }
    }
}

/// The `n·gpr` scales of tokens `t0..t0 + n` as `f32`, into `scales`:
/// `f16` ones widened `L` at a time (read per group they cost more than
/// the row's decode), others read one by one.
#[inline(always)]
fn tile_scales<S: Simd>(
    s: S,
    head: &PackedHead<'_>,
    f16: bool,
    gpr: usize,
    (t0, n): (usize, usize),
    scales: &mut [f32],
) {
    let n = n * gpr;
    if f16 {
        let p = &head.params()[t0 * gpr * 2..(t0 * gpr + n) * 2];
        let whole_l = n / S::L * S::L;
        for k in (0..whole_l).step_by(S::L) {
            // SAFETY: `2·L` bytes at `2k` lie inside `p` (`k + L <= n`, `p`
            // holds `2n`), and `scales` holds `n` floats.
            unsafe {
                let v = s.load_f16(p.as_ptr().add(2 * k));
                s.store(scales.as_mut_ptr().add(k), v);
            }
        }
        for (k, v) in scales.iter_mut().enumerate().take(n).skip(whole_l) {
            *v = half::f16::from_bits(u16::from_le_bytes([p[2 * k], p[2 * k + 1]])).to_f32();
        }
    } else {
        for (k, v) in scales[..n].iter_mut().enumerate() {
            *v = head.param(t0 + k / gpr, k % gpr).0;
        }
    }
}

/// One query's scores (`sum` false) or weighted sum over the whole head,
/// straight from the codes: nothing decoded to memory, the query or the
/// output row held in registers throughout. Per token, vector `j` of the
/// row is `level·c` with `c` the coefficient of its group (groups of
/// `2^gshift` channels): the scale for scores, the token's weight times
/// the scale for the sum (`o_j += level·c`). The scores add the vectors in
/// the scratch path's order ([`dot_tile`]), so both give the same bits.
/// `PAIR`: rows, query and output in the paired order ([`paired_codes`]).
///
/// # Safety
/// [`check`] and [`takes`] hold, one query, groups of whole vectors,
/// `HD` the head dim and at most `MAX_NCH·L`; with `PAIR`, [`paired`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn one_query<S: Simd, const B: u8, const HD: usize, const BYTES: bool, const PAIR: bool>(
    s: S,
    head: &PackedHead<'_>,
    (tbl, fp8): (S::T16, (u32, f32)),
    x: &[f32],
    out: &mut [f32],
    sum: bool,
    (f16, gshift, pb): (bool, u32, usize),
) {
    let nch = HD / S::L;
    // `BYTES`: 3-bit rows transcoded to a byte per code a tile at a time
    // (64 codes per register operation), so a vector is a load and a
    // lookup rather than two loads, two shifts, two masks and a merge.
    let mut t3 = if BYTES { Tile3::new::<3>(s, HD) } else { None };
    assert!(
        t3.is_some() == BYTES,
        "codebook: 3-bit rows are transcoded where the ISA can"
    );
    let (rb, tokens) = (head.layout().row_bytes(), head.tokens());
    let gpr = HD >> gshift;
    let (codes, params) = (head.codes().as_ptr(), head.params().as_ptr());
    // The row held in registers: the query (scores) or the output (sum),
    // `HD` floats either way (`check`); paired, a reordered copy.
    let mut prow = Buf::new(if PAIR { HD } else { 0 });
    let (rp, op) = if PAIR {
        let p = prow.m();
        pair_rows(if sum { &*out } else { x }, p, false);
        let p = p.as_mut_ptr();
        (p as *const f32, p)
    } else if sum {
        let p = out.as_mut_ptr();
        (p as *const f32, p)
    } else {
        (x.as_ptr(), std::ptr::null_mut())
    };
    let mut scales = vec![0f32; S::T * gpr];
    // Scale `k` of a tile belongs to its token `k / gpr` (< T ≤ 16); `gpr`
    // is at most `nch ≤ MAX_NCH` (groups of whole vectors).
    let mut owner = [0u8; 16 * MAX_NCH];
    assert!(S::T * gpr <= owner.len(), "codebook: scales per tile");
    for (k, o) in owner.iter_mut().enumerate().take(S::T * gpr) {
        *o = (k / gpr) as u8;
    }
    let mut acc = Buf::new(if sum { 0 } else { S::T * S::L });
    let acc = acc.m().as_mut_ptr();
    let mut t0 = 0;
    while t0 < tokens {
        let n = S::T.min(tokens - t0);
        tile_scales(s, head, f16, gpr, (t0, n), &mut scales);
        if sum {
            // Each scale times its token's weight, `L` at a time: the
            // weights a table, lane `l` of chunk `k` looking up token
            // `(k + l) / gpr` (`owner`).
            let mut w = [0f32; 16];
            w[..n].copy_from_slice(&x[t0..t0 + n]);
            let wt = s.table16(&w);
            for k in (0..n * gpr).step_by(S::L) {
                // SAFETY: `scales` and `owner` hold `T·gpr` entries, a
                // multiple of `L` (`T = L`), so the chunk at `k < n·gpr`
                // is whole.
                unsafe {
                    let p = scales.as_mut_ptr().add(k);
                    let o = s.lut16(wt, s.load_u8(owner.as_ptr().add(k)));
                    s.store(p, s.mul(s.load(p), o));
                }
            }
        }
        let ah = [
            Ahead::new(codes, rb, t0, tokens),
            Ahead::new(params, pb, t0, tokens),
        ];
        // SAFETY: rows `t0..t0 + n` lie in the codes (`check`), their
        // `gpr` coefficients each in `scales`; `rp` (and with `sum` `op`,
        // the same row) holds `HD = nch·L` floats (`check`); `acc` `T`
        // vectors; vectors `j < nch`.
        unsafe {
            // Held in registers for the tile: the loop has no calls.
            let mut r = [s.zero(); MAX_NCH];
            unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                r[j] = s.load(rp.add(j * S::L));
            });
            let (tile, stride) = match &mut t3 {
                Some(t3) => (t3.load(s, codes.add(t0 * rb), rb, n), HD),
                None => (codes.add(t0 * rb), rb),
            };
            // Vector `$j` of the row looked up in table `$t`.
            macro_rules! vec_at {
                ($t:expr, $row:expr, $ix:expr, $j:expr) => {
                    if PAIR {
                        s.lut16($t, $ix[$j % 8])
                    } else if BYTES {
                        s.lut8($t, s.load_u8($row.add($j * S::L)))
                    } else {
                        book_vec::<S, B>(s, $t, fp8, $row, HD, $j)
                    }
                };
            }
            for tt in 0..n {
                ah[0].token(tt);
                ah[1].token(tt);
                let (row, c) = (tile.add(tt * stride), scales.as_ptr().add(tt * gpr));
                let ix = if PAIR {
                    paired_codes::<S, B>(s, row)
                } else {
                    [s.zero_i(); 8]
                };
                if sum {
                    unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                        let v = vec_at!(tbl, row, ix, j);
                        r[j] = s.fma(v, s.bcast(c.add((j * S::L) >> gshift)), r[j]);
                    });
                } else if B != 8 && (PAIR || (3..=7).contains(&gshift)) {
                    // The table scaled per group (a constant shift, so
                    // the group's vectors share one product) rather than
                    // every looked-up vector: the same products, so the
                    // same bits. (fp8 has no table.)
                    macro_rules! scores {
                        ($gs:literal) => {{
                            let mut a = s.zero();
                            unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                                let tg = s.scale16(tbl, s.bcast(c.add((j * S::L) >> $gs)));
                                a = s.fma(vec_at!(tg, row, ix, j), r[j], a);
                            });
                            s.store(acc.add(tt * S::L), a);
                        }};
                    }
                    match gshift {
                        3 => scores!(3),
                        4 => scores!(4),
                        5 => scores!(5),
                        6 => scores!(6),
                        _ => scores!(7),
                    }
                } else {
                    let mut a = s.zero();
                    unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                        let v = vec_at!(tbl, row, ix, j);
                        let v = s.mul(v, s.bcast(c.add((j * S::L) >> gshift)));
                        a = s.fma(v, r[j], a);
                    });
                    s.store(acc.add(tt * S::L), a);
                }
            }
            if sum {
                unroll!(32 max row_vectors::<S, HD>(); j in 0, nch => {
                    s.store(op.add(j * S::L), r[j]);
                });
            }
        }
        if !sum {
            // SAFETY: `acc` holds `T` vectors.
            let v = unsafe {
                zero_tail(s, acc, 1, n);
                reduce_query(s, acc, 0)
            };
            store_lanes(s, v, &mut out[t0..t0 + n]);
        }
        t0 += n;
    }
    if PAIR && sum {
        pair_rows(prow.m(), out, true);
    }
}

/// Decode the `n ≤ T` rows at `rows` (`rb` bytes apart) into the
/// vector-major scratch (vector `j` of row `tt` at `(j·T + tt)·L`), each
/// row times its groups' scales (`gpr` per row at `sc`, groups of `cpg`
/// channels, `2^gshift` when `SCALED`), asking for the streams ahead.
/// `PAIR` (with `SCALED`): vectors in the paired order ([`paired_codes`]).
///
/// # Safety
/// `rows` valid for `n` rows of `hd·B/8` bytes; `sc` for `n·gpr` floats;
/// `scr` for `T·hd` floats; [`takes`] holds; with `PAIR`, [`paired`].
#[allow(clippy::type_complexity)]
#[inline(always)]
unsafe fn decode_tile<S: Simd, const B: u8, const SCALED: bool, const PAIR: bool>(
    s: S,
    tbl: S::T16,
    fp8: (u32, f32),
    (rows, rb, n, ah): (*const u8, usize, usize, [Ahead; 2]),
    (sc, gpr, gshift, cpg): (*const f32, usize, u32, usize),
    hd: usize,
    scr: *mut f32,
) {
    let stride = S::T * S::L;
    for tt in 0..n {
        ah[0].token(tt);
        ah[1].token(tt);
        // SAFETY: row `tt < n` and its scales are in bounds (the caller's
        // contract); scratch row `tt < T` starts at `tt·L`.
        unsafe {
            let (row, sc, dst) = (rows.add(tt * rb), sc.add(tt * gpr), scr.add(tt * S::L));
            if PAIR {
                let ix = paired_codes::<S, B>(s, row);
                for (v, &ix) in ix.iter().enumerate() {
                    let c = s.bcast(sc.add((v * S::L) >> gshift));
                    s.store(dst.add(v * stride), s.mul(s.lut16(tbl, ix), c));
                }
            } else {
                decode_codes::<S, B, SCALED>(s, tbl, fp8, row, hd, (sc, gshift), (dst, stride));
            }
            if !SCALED {
                for g in 0..gpr {
                    let v = *sc.add(g);
                    for e in g * cpg..(g + 1) * cpg {
                        *dst.add(e / S::L * stride + e % S::L) *= v;
                    }
                }
            }
        }
    }
}

/// [`decode_tile`] of 3-bit rows in groups of whole vectors, the tile's
/// rows first transcoded to a code byte each ([`Tile3`], 64 codes per
/// register operation): a vector is then one widening load and one
/// lookup where the two planes take two loads, two shifts, two masks and
/// a merge. The same levels times the same scales, so the same bits.
///
/// # Safety
/// As [`decode_tile`] with `SCALED`; `t3` made for rows of `hd` codes.
#[inline(always)]
unsafe fn decode_tile3<S: Simd>(
    s: S,
    tbl: S::T16,
    t3: &mut Tile3<S>,
    (rows, rb, n, ah): (*const u8, usize, usize, [Ahead; 2]),
    (sc, gpr, gshift): (*const f32, usize, u32),
    hd: usize,
    scr: *mut f32,
) {
    let stride = S::T * S::L;
    // SAFETY: the caller's contract: `n ≤ T` rows of `rb ≥ 3·hd/8` bytes.
    let bytes = unsafe { t3.load(s, rows, rb, n) };
    for tt in 0..n {
        ah[0].token(tt);
        ah[1].token(tt);
        // SAFETY: transcoded row `tt < n` holds `hd` bytes, its `gpr`
        // scales are in bounds (the caller's contract); scratch row `tt <
        // T` starts at `tt·L`, vector `j < hd/L`.
        unsafe {
            let (row, sc, dst) = (bytes.add(tt * hd), sc.add(tt * gpr), scr.add(tt * S::L));
            for j in 0..hd / S::L {
                let c = s.bcast(sc.add((j * S::L) >> gshift));
                let v = s.lut8(tbl, s.load_u8(row.add(j * S::L)));
                s.store(dst.add(j * stride), s.mul(v, c));
            }
        }
    }
}

/// Scores (`sum` false: `out[i·T + t] = x_i·k̂_t`) or the weighted sum
/// (`out_i += Σ_t x[i·T + t]·v̂_t`) of one codebook head, a tile of `T`
/// tokens at a time.
///
/// One query at a compile-time head dim takes [`one_query`]. Otherwise the
/// tile's rows go to the vector-major scratch once and are shared by every
/// query ([`dot_tile`], [`sum_vectors`]): with four queries, rows decoded
/// into registers and multiplied into every query there (scores in pairs
/// of tokens, sums in blocks of the row per pass) measured no faster
/// (`docs/PERFORMANCE.md`, "What does not pay"). `HD` 64, 128 or 256
/// (the head dims of most models) makes every loop over a row
/// straight-line code; 0 reads the head dim at run time.
///
/// # Safety
/// [`check`] and [`takes`] hold for these arguments, `HD` is 0 or the
/// head dimension, and `s` is a token of this CPU.
#[inline(always)]
pub(crate) unsafe fn run<S: Simd, const HD: usize>(
    s: S,
    head: &PackedHead<'_>,
    book: Book<'_>,
    x: &[f32],
    out: &mut [f32],
    sum: bool,
) {
    let l = head.layout();
    let (hd, rb, cpg, bits) = (
        if HD > 0 { HD } else { l.head_dim() },
        l.row_bytes(),
        l.channels_per_group(),
        l.scheme().bits(),
    );
    let tokens = head.tokens();
    let nq = if sum { out.len() / hd } else { x.len() / hd };
    // (A table book's shift and factor are zero: `Book::new`.)
    let t16 = table_for(book, bits);
    let (tbl, fp8) = (s.table16(&t16), (book.shift, book.factor));
    let nch = hd / S::L;
    // Scales applied in the decode for groups of whole vectors (a shift
    // finds the group); by the scalar loop below otherwise.
    let scaled = cpg.is_multiple_of(S::L) && cpg.is_power_of_two();
    let gshift = cpg.trailing_zeros();
    let gpr = hd / cpg;
    // The tile's f16 scales widened at once (`L` per load): the per-group
    // reads cost more than the row's decode otherwise. A tile at a time,
    // so the widening reads only bytes the prefetch asked for.
    let f16 = l.scheme().scale_format() == crate::scheme::ScaleFormat::F16 && !l.shared_params();
    // Decode streams the cache from DRAM: each token asks for the codes
    // and params `PREFETCH_TOKENS` ahead (the hardware prefetchers stop at
    // page boundaries), as the uniform tiles do.
    let (codes, params) = (head.codes().as_ptr(), head.params().as_ptr());
    let pb = if l.shared_params() {
        0
    } else {
        gpr * l.scheme().param_bytes()
    };
    // One query at a compile-time head dim with whole-vector groups: rows
    // straight into registers, the query (scores) or the output (sum)
    // held there for the whole head.
    let one = nq == 1 && HD > 0 && scaled && nch <= MAX_NCH;
    // 2- to 4-bit rows of 128 codes in whole-block groups decode in the
    // paired order on 16 lanes, one query or several alike.
    let pair = HD == 128 && paired::<S>(hd, cpg, bits, book.fp8);
    if one {
        let c = (f16, gshift, pb);
        let tb = (tbl, fp8);
        // SAFETY: the caller's contract; `one` adds one query, whole-vector
        // groups and a compile-time head dim of at most `MAX_NCH` vectors;
        // `pair` [`paired`].
        unsafe {
            match bits {
                2 if pair => one_query::<S, 2, HD, false, true>(s, head, tb, x, out, sum, c),
                3 if pair => one_query::<S, 3, HD, false, true>(s, head, tb, x, out, sum, c),
                4 if pair => one_query::<S, 4, HD, false, true>(s, head, tb, x, out, sum, c),
                2 => one_query::<S, 2, HD, false, false>(s, head, tb, x, out, sum, c),
                3 if s.code3_consts(HD).is_some() => {
                    one_query::<S, 3, HD, true, false>(s, head, tb, x, out, sum, c)
                }
                3 => one_query::<S, 3, HD, false, false>(s, head, tb, x, out, sum, c),
                4 => one_query::<S, 4, HD, false, false>(s, head, tb, x, out, sum, c),
                8 => one_query::<S, 8, HD, false, false>(s, head, tb, x, out, sum, c),
                _ => unreachable!("codebook: `takes` admits 2, 3, 4 and 8 bits"),
            }
        }
        return;
    }
    // Paired: the queries (scores) or the output rows (sum) reordered
    // once, the sums put back at the end.
    let mut prows = Buf::new(if pair { nq * hd } else { 0 });
    if pair {
        pair_rows(if sum { &*out } else { x }, prows.m(), false);
    }
    let prows = prows.m();
    // Vector-major: vector `j` of token `tt` at `(j·T + tt)·L`.
    let mut scr = Buf::new(S::T * hd);
    let scr = scr.m().as_mut_ptr();
    let stride = S::T * S::L;
    let mut scales = vec![0f32; S::T * gpr];
    // 3-bit rows in whole-vector groups: transcoded a tile at a time where
    // the ISA can ([`decode_tile3`]).
    let mut t3 = if bits == 3 && scaled && !pair && !book.fp8 {
        Tile3::new::<3>(s, hd)
    } else {
        None
    };
    let mut t0 = 0;
    while t0 < tokens {
        let n = S::T.min(tokens - t0);
        tile_scales(s, head, f16, gpr, (t0, n), &mut scales);
        let ah = [
            Ahead::new(codes, rb, t0, tokens),
            Ahead::new(params, pb, t0, tokens),
        ];
        // SAFETY: rows `t0..t0 + n` lie in the codes (checked); `scales`
        // holds their `gpr` scales each; the scratch `T` rows of `nch`
        // vectors (`hd` a multiple of `L` by `takes`).
        unsafe {
            let tile = (codes.add(t0 * rb), rb, n, ah);
            let sc = (scales.as_ptr(), gpr, gshift, cpg);
            macro_rules! go {
                ($($b:literal),*) => {
                    match (bits, scaled) {
                        (2, _) if pair => decode_tile::<S, 2, true, true>(s, tbl, fp8, tile, sc, hd, scr),
                        (3, _) if pair => decode_tile::<S, 3, true, true>(s, tbl, fp8, tile, sc, hd, scr),
                        (4, _) if pair => decode_tile::<S, 4, true, true>(s, tbl, fp8, tile, sc, hd, scr),
                        $(
                            ($b, true) => decode_tile::<S, $b, true, false>(s, tbl, fp8, tile, sc, hd, scr),
                            ($b, false) => decode_tile::<S, $b, false, false>(s, tbl, fp8, tile, sc, hd, scr),
                        )*
                        _ => unreachable!("codebook: `takes` admits 2, 3, 4 and 8 bits"),
                    }
                };
            }
            match &mut t3 {
                Some(t3) => decode_tile3(s, tbl, t3, tile, (sc.0, gpr, gshift), hd, scr),
                None => go!(2, 3, 4, 8),
            }
        }
        for tt in n..S::T {
            for j in 0..nch {
                // SAFETY: scratch row `tt < T`, vector `j < nch`.
                unsafe { s.store(scr.add(j * stride + tt * S::L), s.zero()) };
            }
        }
        for i in 0..nq {
            // SAFETY: the scratch holds the tile (rows `n..T` zero); query
            // and output row `i` hold `hd = nch·L` floats (`check`), as do
            // the paired copies, and `w` `T` weights.
            unsafe {
                if sum {
                    let mut w = [0f32; 16];
                    w[..n].copy_from_slice(&x[i * tokens + t0..i * tokens + t0 + n]);
                    let w = splat_tile(s, w.as_ptr());
                    let o = if pair {
                        prows.as_mut_ptr()
                    } else {
                        out.as_mut_ptr()
                    };
                    sum_vectors(s, scr, 0, nch, &w, o.add(i * hd));
                } else {
                    let q = if pair { prows.as_ptr() } else { x.as_ptr() };
                    let r = dot_tile(s, scr, nch, q.add(i * hd));
                    store_lanes(s, r, &mut out[i * tokens + t0..i * tokens + t0 + n]);
                }
            }
        }
        t0 += n;
    }
    if pair && sum {
        pair_rows(prows, out, true);
    }
}
