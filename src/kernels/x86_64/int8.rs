//! The opt-in int8-query scores kernel: AVX-512 VNNI (`vpdpbusd`,
//! unsigned codes × signed int8 query, exact `i32` sums), per-channel keys.
//!
//! Needs AVX-512F/BW/VL and VNNI (Ice Lake, Sapphire Rapids, Zen 4 and
//! later). See [`crate::kernels::scores_i8`] for the arithmetic and its
//! error; `portable::scores_i8` is its specification.
//!
//! A row of `head_dim` codes is handled 64 elements at a time, as bytes:
//! for each plane, a 64-byte load (or a 32/16/8-byte load broadcast to all
//! 64 bytes, when the plane has fewer bytes than that), a per-16-bit-word
//! shift that brings field `f` of every sub-block to the bottom, and a byte
//! mask; higher planes are shifted up and ORed in. One `vpdpbusd` then
//! multiplies the 64 codes into the quantized query.

use super::generic::{self, Buf, Plan};
use crate::scheme::{Axis, Mode, ScaleFormat};
use crate::simd::x86_64::{Avx512, Avx512Vnni, Simd};
use crate::store::PackedHead;
use core::arch::x86_64::*;

impl Avx512Vnni {
    /// Whether this kernel takes `head` (per-channel keys, `head_dim` 64,
    /// 128 or 256); otherwise callers run the exact kernel.
    pub(crate) fn takes(head: &PackedHead<'_>) -> bool {
        let l = head.layout();
        l.scheme().axis() == crate::scheme::Axis::PerChannel
            && matches!(l.head_dim(), 64 | 128 | 256)
    }

    /// Int8-query scores (see [`crate::kernels::scores_i8`]).
    ///
    /// # Panics
    /// If the lengths do not fit the head or [`takes`](Self::takes) is false.
    pub(crate) fn scores_i8(self, head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
        super::check_head(head, q.len(), out.len());
        assert!(
            Self::takes(head),
            "scores_i8: per-channel keys with head_dim 64, 128 or 256"
        );
        // SAFETY: `self` proves the features the entry enables;
        // `check_head` and the assert above give the kernel's preconditions.
        unsafe { entry(self, head, q, out) }
    }
}

impl Avx512Vnni {
    /// Whether the int8-weight kernel takes `head`: per-token values of 4
    /// bits (`head_dim` 128 or 256) or 8 bits (64, 128 or 256), in groups
    /// of a multiple of 16 channels; otherwise callers run the exact kernel.
    pub(crate) fn takes_ws(head: &PackedHead<'_>) -> bool {
        let l = head.layout();
        let hd = l.head_dim();
        l.scheme().axis() == Axis::PerToken
            && match l.scheme().bits() {
                4 => matches!(hd, 128 | 256),
                8 => matches!(hd, 64 | 128 | 256),
                _ => false,
            }
            && l.channels_per_group().is_multiple_of(16)
    }

    /// Int8-weight weighted sum (see [`crate::kernels::weighted_sum_i8`]).
    ///
    /// # Panics
    /// If the lengths do not fit the head or [`takes_ws`](Self::takes_ws)
    /// is false.
    pub(crate) fn weighted_sum_i8(self, head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
        super::check_head(head, out.len(), p.len());
        assert!(
            Self::takes_ws(head),
            "weighted_sum_i8: per-token values of 4 bits (head_dim 128/256) or 8 bits (64/128/256)"
        );
        // SAFETY: `self` proves the features the entry enables;
        // `check_head` and the assert above give the kernel's preconditions.
        unsafe { entry_ws(self, head, p, out) }
    }
}

/// The params of the lanes in `m` from `p` (stored as `fmt`), widened;
/// the other lanes 0. Read straight from the stored bytes: a widened copy
/// costs its stores and, for rows that straddle two of them, the loads
/// that cannot be forwarded.
///
/// # Safety
/// AVX-512F/BW/VL; the lanes in `m` are readable at `p`.
#[inline(always)]
unsafe fn masked_params(fmt: ScaleFormat, p: *const u8, m: __mmask16) -> __m512 {
    // SAFETY: the caller's contract; masked-off lanes are not read.
    unsafe {
        match fmt {
            ScaleFormat::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p as *const i16)),
            ScaleFormat::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p as *const i16)),
            )),
            ScaleFormat::F32 => _mm512_maskz_loadu_ps(m, p as *const f32),
        }
    }
}

/// # Safety
/// The CPU has the enabled features; `check_head(head, out.len(),
/// p.len())` passed and [`Avx512Vnni::takes_ws`] holds.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn entry_ws(s: Avx512Vnni, head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
    let l = head.layout();
    // SAFETY: the caller's contract, passed on (`takes_ws`: the bits and
    // head dims matched here).
    unsafe {
        match (l.scheme().bits(), l.head_dim()) {
            (4, 128) => kernel_ws::<4, 128>(s, head, p, out),
            (4, _) => kernel_ws::<4, 256>(s, head, p, out),
            (_, 64) => kernel_ws::<8, 64>(s, head, p, out),
            (_, 128) => kernel_ws::<8, 128>(s, head, p, out),
            _ => kernel_ws::<8, 256>(s, head, p, out),
        }
    }
}

/// `vpternlogd` selector for `(a & c) | (b & !c)`.
const SELECT: i32 = 0xE4;

/// The int8-weight weighted sum of `portable::weighted_sum_i8`, per query
/// and tile of 16 tokens:
///
/// 1. each token's group weights `w = p_t·scale_tg` (lanes = groups) and
///    their maximum magnitude per group, the zero sums `Σ p_t·zero_tg`;
/// 2. per four tokens, the rounded weights as bytes, one dword per group
///    holding the four tokens' weights, permuted to the lanes of each code
///    vector;
/// 3. the four tokens' rows interleaved (two rounds of byte/word unpacks)
///    so that each dword holds one channel's codes of the four tokens, and
///    one `vpdpbusd` per code vector (for 4 bits, the high nibbles are
///    masked in place, at 16 times their value);
/// 4. at the tile's end the `i32` sums times each group's step into `f32`.
///
/// Code vector `k` of 64-byte chunk `v` holds, in lane `4j + m`, byte
/// `64v + 16j + 4k + m` of the rows: channel `64v + 16j + 4k + m + f·rb`
/// for field `f` (4 bits: `rb = head_dim/2`), so a 128-bit lane never
/// straddles a group of a multiple of 16 channels.
///
/// # Safety
/// As [`entry_ws`], with `B`/`HD` the head's bits and head dimension.
#[inline(always)]
unsafe fn kernel_ws<const B: u8, const HD: usize>(
    v: Avx512Vnni,
    head: &PackedHead<'_>,
    p: &[f32],
    out: &mut [f32],
) {
    let s = v.0;
    let l = head.layout();
    let sch = l.scheme();
    let (t_all, rb) = (head.tokens(), l.row_bytes());
    let (gpr, cpg) = (l.groups_per_row(), l.channels_per_group());
    let fmt = sch.scale_format();
    let sym = sch.mode() == Mode::Symmetric;
    let half = (1u32 << (B - 1)) as f32;
    let vals = if sym { gpr } else { 2 * gpr };
    let fb = fmt.bytes();
    let pb_tok = vals * fb;
    let nq = out.len() / HD;
    // 64-byte chunks per row, fields per byte.
    let nv = HD * B as usize / 8 / 64;
    let nf = 8 / B as usize;
    assert!(
        (1..=4).contains(&nv) && nv * nf <= 4 && gpr <= 16,
        "weighted_sum_i8: shape"
    );
    if t_all == 0 {
        return;
    }
    let codes = head.codes().as_ptr();
    let params = head.params();
    let mut wbuf = Buf::new(16 * 16);
    let mut facc = Buf::new(16 * 16 * 4);
    let mut zs = [0f32; 16];
    let mut lanes = [0i32; 16];
    // SAFETY: the features of `entry_ws`; every pointer below stays in its
    // buffer: rows `t0 + tt` with `tt < n` (or row `t0`) of `codes`
    // (check_head), 64-byte chunks `v < nv` of a row, the `gpr ≤ 16`
    // unmasked params of rows `t0 + tt` with `tt < n` (check_head), `wbuf`
    // 16 rows of 16 floats, `facc` `4·nv·nf ≤ 16` vectors.
    unsafe {
        // Lane `4j + m` of code vectors of chunk `v`, field `f`: its group.
        let mut gidx = [[_mm512_setzero_si512(); 2]; 4];
        for (vi, gv) in gidx.iter_mut().enumerate().take(nv) {
            for (f, g) in gv.iter_mut().enumerate().take(nf) {
                for (lane, x) in lanes.iter_mut().enumerate() {
                    *x = ((64 * vi + 16 * (lane / 4) + f * rb) / cpg) as i32;
                }
                *g = _mm512_loadu_si512(lanes.as_ptr() as *const _);
            }
        }
        let gmask = ((1u32 << gpr) - 1) as __mmask16;
        let (lo, hi) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8));
        let (m8, m16, m24) = (
            _mm512_set1_epi32(0xFF),
            _mm512_set1_epi32(0xFFFF),
            _mm512_set1_epi32(0xFF_FFFF),
        );
        for i in 0..nq {
            let pi = p.as_ptr().add(i * t_all);
            for k in 0..16 {
                s.store(facc.m().as_mut_ptr().add(16 * k), s.zero());
            }
            let mut zacc = s.zero();
            let mut t0 = 0;
            while t0 < t_all {
                let n = 16.min(t_all - t0);
                let ah = [
                    generic::Ahead::new(codes, rb, t0, t_all),
                    generic::Ahead::new(params.as_ptr(), pb_tok, t0, t_all),
                ];
                // 1. Weights, their maxima, the zero sums.
                let mut amax = s.zero();
                for tt in 0..16 {
                    let w = if tt < n {
                        ah[0].token(tt);
                        ah[1].token(tt);
                        let pb = s.bcast(pi.add(t0 + tt));
                        let row = params.as_ptr().add((t0 + tt) * pb_tok);
                        let sc = masked_params(fmt, row, gmask);
                        let ze = if sym {
                            s.mul(sc, s.splat(-half))
                        } else {
                            masked_params(fmt, row.add(gpr * fb), gmask)
                        };
                        zacc = s.fma(ze, pb, zacc);
                        s.mul(sc, pb)
                    } else {
                        s.zero()
                    };
                    amax = s.max(amax, _mm512_abs_ps(w));
                    s.store(wbuf.m().as_mut_ptr().add(16 * tt), w);
                }
                let delta = _mm512_div_ps(amax, s.splat(127.0));
                let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(delta, s.zero());
                let inv = _mm512_maskz_div_ps(pos, s.splat(1.0), delta);
                // 2.–3. Four tokens at a time.
                let mut acc = [[_mm512_setzero_si512(); 4]; 4];
                for q in 0..4 {
                    let mut qv = [_mm512_setzero_si512(); 4];
                    for (u, x) in qv.iter_mut().enumerate() {
                        let w = s.load(wbuf.s().as_ptr().add(16 * (4 * q + u)));
                        *x = _mm512_cvtps_epi32(s.mul(w, inv));
                    }
                    // Dword `g`: the four tokens' weights of group `g`, as bytes.
                    let x = _mm512_ternarylogic_epi32::<SELECT>(
                        qv[0],
                        _mm512_slli_epi32::<8>(qv[1]),
                        m8,
                    );
                    let x =
                        _mm512_ternarylogic_epi32::<SELECT>(x, _mm512_slli_epi32::<16>(qv[2]), m16);
                    let x =
                        _mm512_ternarylogic_epi32::<SELECT>(x, _mm512_slli_epi32::<24>(qv[3]), m24);
                    let row = |u: usize| {
                        let tt = if 4 * q + u < n { 4 * q + u } else { 0 };
                        codes.add((t0 + tt) * rb)
                    };
                    let rows = [row(0), row(1), row(2), row(3)];
                    for vi in 0..nv {
                        let r = |u: usize| _mm512_loadu_si512(rows[u].add(64 * vi) as *const _);
                        let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
                        let a = _mm512_unpacklo_epi8(r0, r1);
                        let b = _mm512_unpackhi_epi8(r0, r1);
                        let c = _mm512_unpacklo_epi8(r2, r3);
                        let d = _mm512_unpackhi_epi8(r2, r3);
                        let xs = [
                            _mm512_unpacklo_epi16(a, c),
                            _mm512_unpackhi_epi16(a, c),
                            _mm512_unpacklo_epi16(b, d),
                            _mm512_unpackhi_epi16(b, d),
                        ];
                        // Accumulator slot `vi·nf + f`.
                        let w0 = _mm512_permutexvar_epi32(gidx[vi][0], x);
                        if B == 4 {
                            let w1 = _mm512_permutexvar_epi32(gidx[vi][1], x);
                            for (k, xk) in xs.iter().enumerate() {
                                let a0 = &mut acc[2 * vi][k];
                                *a0 = _mm512_dpbusd_epi32(*a0, _mm512_and_si512(*xk, lo), w0);
                                let a1 = &mut acc[2 * vi + 1][k];
                                *a1 = _mm512_dpbusd_epi32(*a1, _mm512_and_si512(*xk, hi), w1);
                            }
                        } else {
                            for (k, xk) in xs.iter().enumerate() {
                                acc[vi][k] = _mm512_dpbusd_epi32(acc[vi][k], *xk, w0);
                            }
                        }
                    }
                }
                // 4. `facc += δ_g·sum` (high nibbles summed at 16 times).
                for (vi, gv) in gidx.iter().enumerate().take(nv) {
                    for (f, gf) in gv.iter().enumerate().take(nf) {
                        let mut dv = _mm512_permutexvar_ps(*gf, delta);
                        if B == 4 && f == 1 {
                            dv = s.mul(dv, s.splat(1.0 / 16.0));
                        }
                        let slot = vi * nf + f;
                        for (k, a) in acc[slot].iter().enumerate() {
                            let o = facc.m().as_mut_ptr().add(16 * (4 * slot + k));
                            s.store(o, s.fma(_mm512_cvtepi32_ps(*a), dv, s.load(o)));
                        }
                    }
                }
                t0 += n;
            }
            // Lanes back to channels, plus the zero sums.
            s.store(zs.as_mut_ptr(), zacc);
            let o = &mut out[i * HD..(i + 1) * HD];
            for slot in 0..nv * nf {
                let (vi, f) = (slot / nf, slot % nf);
                for k in 0..4 {
                    for lane in 0..16 {
                        let c = 64 * vi + 16 * (lane / 4) + 4 * k + lane % 4 + f * rb;
                        o[c] += facc.s()[16 * (4 * slot + k) + lane] + zs[c / cpg];
                    }
                }
            }
        }
    }
}

/// # Safety
/// The CPU has the enabled features; `check_head` passed and
/// [`Avx512Vnni::takes`] holds.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn entry(s: Avx512Vnni, head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
    // SAFETY: the caller's contract, passed on (`takes`: hd is 64/128/256).
    // The widths the exact AVX-512 kernels are compiled for at head_dim
    // 128 get a compile-time int8 kernel too; the rest share one kernel
    // compiled for any width and dimension.
    unsafe {
        let l = head.layout();
        let (bits, hd) = (l.scheme().bits(), l.head_dim());
        match (bits, hd) {
            (2, 128) => kernel::<2, 128>(s, head, q, out),
            (3, 128) => kernel::<3, 128>(s, head, q, out),
            (4, 128) => kernel::<4, 128>(s, head, q, out),
            (8, 128) => kernel::<8, 128>(s, head, q, out),
            _ => kernel::<0, 0>(s, head, q, out),
        }
    }
}

/// Bits `SH..SH+P` of elements `64v .. 64v+64` as bytes, from a plane of
/// width `P` and `m` bytes at `src`.
///
/// # Safety
/// `src` valid for `m` bytes; `m` a multiple of 64 or `m ∈ {8, 16, 32}`; `64v` is
/// inside the row.
#[inline(always)]
unsafe fn plane_bytes<const P: u32, const SH: u32>(src: *const u8, m: usize, v: usize) -> __m512i {
    let e = v * 64;
    let f0 = (e / m) as u32;
    let fmask = ((1u32 << P) - 1) as u8;
    // SAFETY: the loads read `64`, `32`, `16` or `8` bytes inside the
    // plane (the caller's contract); the rest is AVX-512F/BW arithmetic.
    unsafe {
        let (x, counts) = if m.is_multiple_of(64) {
            let x = _mm512_loadu_si512(src.add(e % m) as *const _);
            (x, _mm512_set1_epi16((P * f0) as i16))
        } else {
            let x = match m {
                32 => _mm512_broadcast_i64x4(_mm256_loadu_si256(src as *const __m256i)),
                16 => _mm512_broadcast_i32x4(_mm_loadu_si128(src as *const __m128i)),
                _ => _mm512_set1_epi64((src as *const i64).read_unaligned()),
            };
            // Sub-block `i` (m bytes, m/2 words) holds field `f0 + i`.
            let mut c = [0u16; 32];
            for (w, c) in c.iter_mut().enumerate() {
                *c = (P * (f0 + (2 * w / m) as u32)) as u16;
            }
            (x, _mm512_loadu_si512(c.as_ptr() as *const _))
        };
        // Word shifts: bits of the neighbouring byte that move in land
        // above the field and are masked off.
        let b = _mm512_and_si512(_mm512_srlv_epi16(x, counts), _mm512_set1_epi8(fmask as i8));
        if SH == 0 {
            b
        } else {
            _mm512_slli_epi16::<SH>(b)
        }
    }
}

/// # Safety
/// `row` valid for the row; `hd` a multiple of 64; `v < hd/64`.
#[inline(always)]
unsafe fn row_bytes<const B: u8>(row: *const u8, hd: usize, v: usize) -> __m512i {
    let (h2, h4, h8) = (hd / 2, hd / 4, hd / 8);
    // SAFETY: the planes of a `B`-bit row are `hd·p/8` bytes each, widest
    // first (see `pack`); with `hd` a multiple of 64 each is a multiple of 64
    // bytes or 8, 16 or 32 bytes.
    unsafe {
        match B {
            1 => plane_bytes::<1, 0>(row, h8, v),
            2 => plane_bytes::<2, 0>(row, h4, v),
            3 => _mm512_or_si512(
                plane_bytes::<2, 0>(row, h4, v),
                plane_bytes::<1, 2>(row.add(h4), h8, v),
            ),
            4 => plane_bytes::<4, 0>(row, h2, v),
            5 => _mm512_or_si512(
                plane_bytes::<4, 0>(row, h2, v),
                plane_bytes::<1, 4>(row.add(h2), h8, v),
            ),
            6 => _mm512_or_si512(
                plane_bytes::<4, 0>(row, h2, v),
                plane_bytes::<2, 4>(row.add(h2), h4, v),
            ),
            7 => _mm512_or_si512(
                _mm512_or_si512(
                    plane_bytes::<4, 0>(row, h2, v),
                    plane_bytes::<2, 4>(row.add(h2), h4, v),
                ),
                plane_bytes::<1, 6>(row.add(h2 + h4), h8, v),
            ),
            _ => plane_bytes::<8, 0>(row, hd, v),
        }
    }
}

/// [`row_bytes`] for a width known only at run time.
///
/// # Safety
/// As [`row_bytes`], with `bits` the row's width.
#[inline(always)]
unsafe fn row_bytes_any(bits: u8, row: *const u8, hd: usize, v: usize) -> __m512i {
    // SAFETY: the caller's contract, for the width `bits`.
    unsafe {
        match bits {
            1 => row_bytes::<1>(row, hd, v),
            2 => row_bytes::<2>(row, hd, v),
            3 => row_bytes::<3>(row, hd, v),
            4 => row_bytes::<4>(row, hd, v),
            5 => row_bytes::<5>(row, hd, v),
            6 => row_bytes::<6>(row, hd, v),
            7 => row_bytes::<7>(row, hd, v),
            _ => row_bytes::<8>(row, hd, v),
        }
    }
}

/// Quantize `q'_c = q_c·sc_c` to int8 into `qi` (as
/// `portable::quantize_query`, bit for bit: same products, same `δ`, and
/// `vcvtps2dq` rounds half to even like `round_ties_even`); returns `δ`.
///
/// # Safety
/// `q`, `sc` valid for `hd` floats, `qi` for `hd` bytes; the features of
/// [`entry`].
#[inline(always)]
unsafe fn quantize_query(s: Avx512, hd: usize, q: *const f32, sc: *const f32, qi: *mut i8) -> f32 {
    // SAFETY: the caller's contract; vectors `j < hd/16`.
    unsafe {
        let mut m = s.zero();
        for j in 0..hd / 16 {
            let x = s.mul(s.load(q.add(16 * j)), s.load(sc.add(16 * j)));
            m = s.max(m, _mm512_abs_ps(x));
        }
        let delta = s.hmax(m) / 127.0;
        let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
        for j in 0..hd / 16 {
            let x = s.mul(
                s.mul(s.load(q.add(16 * j)), s.load(sc.add(16 * j))),
                s.splat(inv),
            );
            _mm_storeu_si128(
                qi.add(16 * j) as *mut __m128i,
                _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)),
            );
        }
        delta
    }
}

/// [`quantize_query`] and the bias `q·zero` of one block in one pass,
/// straight from its stored `f16` params at `src` (`hd` scales, then `hd`
/// zeros unless symmetric): the same products, maximum, rounding and bias
/// sum, in the same order, as [`generic::block_params`], [`quantize_query`]
/// and the bias loop of [`kernel`]. Returns `(δ, bias)`.
///
/// # Safety
/// `q` valid for `hd` floats, `src` for the block's params, `qi` for `hd`
/// bytes; `hd ≤ 256`; the features of [`entry`].
#[inline(always)]
unsafe fn quantize_query_f16(
    s: Avx512,
    hd: usize,
    q: *const f32,
    src: *const u8,
    p: &Plan,
    qi: *mut i8,
) -> (f32, f32) {
    let mut x = [s.zero(); 16];
    let (mut m, mut b) = (s.zero(), s.zero());
    // SAFETY: the caller's contract; vectors `j < hd/16 ≤ 16`.
    unsafe {
        for (j, x) in x.iter_mut().enumerate().take(hd / 16) {
            let sc = s.load_f16(src.add(32 * j));
            let ze = if p.sym() {
                s.mul(sc, s.splat(-p.half()))
            } else {
                s.load_f16(src.add(2 * hd + 32 * j))
            };
            let qv = s.load(q.add(16 * j));
            *x = s.mul(qv, sc);
            m = s.max(m, _mm512_abs_ps(*x));
            b = s.fma(qv, ze, b);
        }
        let delta = s.hmax(m) / 127.0;
        let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
        for (j, x) in x.iter().enumerate().take(hd / 16) {
            _mm_storeu_si128(
                qi.add(16 * j) as *mut __m128i,
                _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(s.mul(*x, s.splat(inv)))),
            );
        }
        (delta, s.hsum(b))
    }
}

/// # Safety
/// As [`entry`], with `B`/`HD` the head's width and dimension, or 0 for
/// a kernel compiled for any (read at run time).
#[inline(always)]
unsafe fn kernel<const B: u8, const HD: usize>(
    v: Avx512Vnni,
    head: &PackedHead<'_>,
    q: &[f32],
    out: &mut [f32],
) {
    let s = v.0;
    let l = head.layout();
    let p = Plan::new(head);
    let (t_all, rb, gl) = (head.tokens(), l.row_bytes(), l.group_len());
    let hd = if HD > 0 { HD } else { l.head_dim() };
    let bits = if B > 0 { B } else { l.scheme().bits() };
    let nq = q.len() / hd;
    let nv = hd / 64;
    if t_all == 0 {
        return;
    }
    let (mut sc, mut ze) = (Buf::new(hd), Buf::new(hd));
    let mut qi = vec![0i8; nq * hd];
    let mut delta = vec![0f32; nq];
    let mut bias = vec![0f32; nq];
    let accbuf = Buf::new(nq * 16 * 16);
    let codes = head.codes().as_ptr();
    // Prefetch as the exact kernels do.
    let pf = generic::BlockAhead::new(head, true);
    // `f16` params: each block's int8 queries and biases straight from
    // the stored bytes, in registers.
    let direct = p.fmt() == ScaleFormat::F16;
    let set = hd * 2 * if p.sym() { 1 } else { 2 };
    for k in 0..t_all.div_ceil(gl) {
        pf.block(k);
        if direct {
            let src = &head.params()[k * set..(k + 1) * set];
            for i in 0..nq {
                // SAFETY: `src` holds the block's `set` bytes, `q` `hd`
                // floats per query, `qi` `hd` bytes per query.
                unsafe {
                    (delta[i], bias[i]) = quantize_query_f16(
                        s,
                        hd,
                        q.as_ptr().add(i * hd),
                        src.as_ptr(),
                        &p,
                        qi.as_mut_ptr().add(i * hd),
                    );
                }
            }
        } else {
            generic::block_params(s, head, &p, hd, k, sc.m(), ze.m());
            for i in 0..nq {
                // SAFETY: `q` holds `hd` floats per query, `sc`/`ze` `hd`,
                // `qi` `hd` bytes per query.
                unsafe {
                    delta[i] = quantize_query(
                        s,
                        hd,
                        q.as_ptr().add(i * hd),
                        sc.s().as_ptr(),
                        qi.as_mut_ptr().add(i * hd),
                    );
                    // The bias with the same vector dot as the exact kernel.
                    let mut b = s.zero();
                    for j in 0..hd / 16 {
                        b = s.fma(
                            s.load(q.as_ptr().add(i * hd + j * 16)),
                            s.load(ze.s().as_ptr().add(j * 16)),
                            b,
                        );
                    }
                    bias[i] = s.hsum(b);
                }
            }
        }
        let t_end = ((k + 1) * gl).min(t_all);
        let mut t0 = k * gl;
        while t0 < t_end {
            let n = 16.min(t_end - t0);
            let ah = pf.tile(t0, n);
            // SAFETY: rows `t0..t0+n ≤ tokens` are in `codes` (check_head);
            // `qi` holds `hd` bytes per query and `accbuf` 16 vectors per
            // query; `nv ≤ 4`.
            unsafe {
                let acc_at =
                    |i: usize, tt: usize| accbuf.s().as_ptr().add((i * 16 + tt) * 16) as *mut f32;
                for tt in 0..n {
                    ah[0].token(tt);
                    ah[1].token(tt);
                    let row = codes.add((t0 + tt) * rb);
                    let mut c = [_mm512_setzero_si512(); 4];
                    for (vi, c) in c.iter_mut().enumerate().take(nv) {
                        *c = if B > 0 {
                            row_bytes::<B>(row, hd, vi)
                        } else {
                            row_bytes_any(bits, row, hd, vi)
                        };
                    }
                    for i in 0..nq {
                        let mut a = _mm512_setzero_si512();
                        for (vi, c) in c.iter().enumerate().take(nv) {
                            let qv =
                                _mm512_loadu_si512(qi.as_ptr().add(i * hd + vi * 64) as *const _);
                            a = _mm512_dpbusd_epi32(a, *c, qv);
                        }
                        s.store_i(acc_at(i, tt), a);
                    }
                }
                for i in 0..nq {
                    for tt in n..16 {
                        s.store(acc_at(i, tt), s.zero());
                    }
                }
            }
            for i in 0..nq {
                // SAFETY: `accbuf` holds 16 vectors per query.
                let r = unsafe {
                    let mut a = [s.zero(); 16];
                    for (tt, a) in a.iter_mut().enumerate() {
                        // Integer sums below 2^24 convert exactly.
                        *a = s.cvt(s.load_i(accbuf.s().as_ptr().add((i * 16 + tt) * 16)));
                    }
                    s.reduce(&a)
                };
                let r = s.fma(r, s.splat(delta[i]), s.splat(bias[i]));
                generic::store_lanes(s, r, &mut out[i * t_all + t0..i * t_all + t0 + n]);
            }
            t0 += n;
        }
    }
}
