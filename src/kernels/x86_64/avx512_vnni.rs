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

use super::tile::{self, Buf, Plan};
use super::{Avx512, Simd};
use crate::store::PackedHead;
use core::arch::x86_64::*;

/// Proof that the CPU has AVX-512F/BW/VL, VNNI, AVX2, FMA and F16C.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512Vnni(Avx512);

impl Avx512Vnni {
    /// `Some` only when the CPU has every feature this file uses.
    #[inline]
    pub(crate) fn new() -> Option<Avx512Vnni> {
        let base = Avx512::new()?;
        is_x86_feature_detected!("avx512vnni").then_some(Avx512Vnni(base))
    }

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

/// # Safety
/// The CPU has the enabled features; `check_head` passed and
/// [`Avx512Vnni::takes`] holds.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn entry(s: Avx512Vnni, head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
    macro_rules! by_hd {
        ($b:literal) => {
            match head.layout().head_dim() {
                64 => kernel::<$b, 64>(s, head, q, out),
                128 => kernel::<$b, 128>(s, head, q, out),
                _ => kernel::<$b, 256>(s, head, q, out),
            }
        };
    }
    // SAFETY: the caller's contract, passed on (`takes`: hd is 64/128/256).
    unsafe {
        match head.layout().scheme().bits() {
            1 => by_hd!(1),
            2 => by_hd!(2),
            3 => by_hd!(3),
            4 => by_hd!(4),
            5 => by_hd!(5),
            6 => by_hd!(6),
            7 => by_hd!(7),
            _ => by_hd!(8),
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

/// Quantize `q'_c = q_c·sc_c` to int8 into `qi` (as
/// `portable::quantize_query`, bit for bit: same products, same `δ`, and
/// `vcvtps2dq` rounds half to even like `round_ties_even`); returns `δ`.
///
/// # Safety
/// `q`, `sc` valid for `HD` floats, `qi` for `HD` bytes; the features of
/// [`entry`].
#[inline(always)]
unsafe fn quantize_query<const HD: usize>(
    s: Avx512,
    q: *const f32,
    sc: *const f32,
    qi: *mut i8,
) -> f32 {
    // SAFETY: the caller's contract; vectors `j < HD/16`.
    unsafe {
        let mut m = s.zero();
        for j in 0..HD / 16 {
            let x = s.mul(s.load(q.add(16 * j)), s.load(sc.add(16 * j)));
            m = s.max(m, _mm512_abs_ps(x));
        }
        let delta = s.hmax(m) / 127.0;
        let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
        for j in 0..HD / 16 {
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

/// # Safety
/// As [`entry`], with `HD` the head dimension.
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
    let nq = q.len() / HD;
    let nv = HD / 64;
    if t_all == 0 {
        return;
    }
    let (mut sc, mut ze) = (Buf::new(HD), Buf::new(HD));
    let mut qi = vec![0i8; nq * HD];
    let mut delta = vec![0f32; nq];
    let mut bias = vec![0f32; nq];
    let accbuf = Buf::new(nq * 16 * 16);
    let codes = head.codes().as_ptr();
    // Prefetch as the exact kernels do: both streams spread over the
    // tokens (the params as `set/gl` bytes per token), or per block.
    let set = head.set_len() * l.scheme().param_bytes();
    let spread = set.is_multiple_of(gl);
    for k in 0..t_all.div_ceil(gl) {
        if !spread {
            let ahead = k + tile::PREFETCH_TOKENS.div_ceil(gl);
            tile::prefetch(head.params().as_ptr().wrapping_add(ahead * set), set);
        }
        tile::block_params(s, head, &p, HD, k, sc.m(), ze.m());
        for i in 0..nq {
            // SAFETY: `q` holds `HD` floats per query, `sc`/`ze` `HD`,
            // `qi` `HD` bytes per query.
            unsafe {
                delta[i] = quantize_query::<HD>(
                    s,
                    q.as_ptr().add(i * HD),
                    sc.s().as_ptr(),
                    qi.as_mut_ptr().add(i * HD),
                );
                // The bias with the same vector dot as the exact kernel.
                let mut b = s.zero();
                for j in 0..HD / 16 {
                    b = s.fma(
                        s.load(q.as_ptr().add(i * HD + j * 16)),
                        s.load(ze.s().as_ptr().add(j * 16)),
                        b,
                    );
                }
                bias[i] = s.hsum(b);
            }
        }
        let t_end = ((k + 1) * gl).min(t_all);
        let mut t0 = k * gl;
        while t0 < t_end {
            let n = 16.min(t_end - t0);
            let ah = if spread {
                [
                    tile::Ahead::new(codes, rb, t0),
                    tile::Ahead::new(head.params().as_ptr(), set / gl, t0),
                ]
            } else {
                tile::prefetch_ahead(codes, rb, t0, n);
                [tile::Ahead::NONE; 2]
            };
            // SAFETY: rows `t0..t0+n ≤ tokens` are in `codes` (check_head);
            // `qi` holds `HD` bytes per query and `accbuf` 16 vectors per
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
                        *c = row_bytes::<B>(row, HD, vi);
                    }
                    for i in 0..nq {
                        let mut a = _mm512_setzero_si512();
                        for (vi, c) in c.iter().enumerate().take(nv) {
                            let qv =
                                _mm512_loadu_si512(qi.as_ptr().add(i * HD + vi * 64) as *const _);
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
                tile::store_lanes(s, r, &mut out[i * t_all + t0..i * t_all + t0 + n]);
            }
            t0 += n;
        }
    }
}
