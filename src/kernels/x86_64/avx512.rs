//! AVX-512 kernels: 512-bit vectors, 16 lanes, tiles of 16 tokens.
//!
//! Needs AVX-512F, BW and VL (plus AVX2, FMA and F16C, which every AVX-512
//! CPU has). Everything in this file may use those instructions and no
//! others.

use super::tile::{self, DenseElem};
use super::Simd;
use crate::quant::{QuantOps, Scalar};
use crate::scheme::{Mode, QuantScheme, ScaleFormat};
use crate::store::PackedHead;
use core::arch::x86_64::*;

/// Blocks of 64 codes in a row [`Code3`] covers (head dims up to 512).
const MAX_BLOCKS: usize = 8;

/// The per-dword shift counts of [`Simd::code3_bytes`] for one head dim:
/// for each block of 64 codes, the 2-bit plane's right shift (`x`) and the
/// 1-bit plane's right rotate (`y`).
#[derive(Clone, Copy)]
pub(crate) struct Code3 {
    x: [__m512i; MAX_BLOCKS],
    y: [__m512i; MAX_BLOCKS],
}

/// The plane bytes of codes `64k..64k+64` of a plane of `m` bytes at `p`
/// (`m` 16, 32 or a multiple of 64): one block, or the whole plane
/// repeated across the register.
///
/// # Safety
/// AVX-512F; `p` valid for `m` bytes; `64k < 8m/P` for the plane's width
/// `P` (the block's bytes lie inside the plane).
#[inline(always)]
unsafe fn plane_block(p: *const u8, m: usize, k: usize) -> __m512i {
    // SAFETY: the caller's contract.
    unsafe {
        match m {
            16 => _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i)),
            32 => _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i)),
            _ => _mm512_loadu_si512(p.add(64 * k % m) as *const _),
        }
    }
}

/// Proof that the CPU runs this file's instructions (see [`Avx512::new`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// `Some` only when the CPU has AVX-512F/BW/VL, AVX2, FMA and F16C.
    #[inline]
    pub(crate) fn new() -> Option<Avx512> {
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx512(()))
    }

    /// Packed scores (see [`crate::kernels::scores`]).
    ///
    /// # Panics
    /// If the lengths do not fit the head (the public wrappers have
    /// already returned an error for those).
    pub(crate) fn scores(self, head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
        super::check_head(head, q.len(), out.len());
        // SAFETY: `self` proves the features `scores_entry` enables;
        // `check_head` asserted the lengths its raw loops rely on.
        unsafe { scores_entry(self, head, q, out) }
    }

    /// Packed weighted sum (see [`crate::kernels::weighted_sum`]).
    ///
    /// # Panics
    /// As [`scores`](Self::scores).
    pub(crate) fn weighted_sum(self, head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
        super::check_head(head, out.len(), p.len());
        // SAFETY: as in `scores`.
        unsafe { weighted_sum_entry(self, head, p, out) }
    }

    /// `x ← e^(x − max)`, returning `(max, Σ)`.
    pub(crate) fn softmax_parts(self, x: &mut [f32]) -> (f32, f32) {
        // SAFETY: `self` proves the features; the kernel is safe code otherwise.
        unsafe { softmax_parts_entry(self, x) }
    }

    /// `x ← x·k`.
    pub(crate) fn scale(self, x: &mut [f32], k: f32) {
        // SAFETY: `self` proves the features.
        unsafe { scale_entry(self, x, k) }
    }

    /// Dense scores over `[tokens, hd]` keys.
    pub(crate) fn dense_scores<E: DenseElem>(self, hd: usize, k: &[E], q: &[f32], out: &mut [f32]) {
        // SAFETY: `self` proves the features; the kernel asserts lengths.
        unsafe { dense_scores_entry(self, hd, k, q, out) }
    }

    /// Dense weighted sum over `[tokens, hd]` values.
    pub(crate) fn dense_weighted_sum<E: DenseElem>(
        self,
        hd: usize,
        v: &[E],
        p: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: `self` proves the features; the kernel asserts lengths.
        unsafe { dense_weighted_sum_entry(self, hd, v, p, out) }
    }
}

/// # Safety
/// The CPU has the enabled features; `check_head(head, q.len(), out.len())` passed.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_entry(s: Avx512, head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        by_shape!(
            [(2, 128), (3, 128), (4, 128), (8, 128)],
            scores_b,
            head,
            (s, head, q, out)
        )
    }
}

/// # Safety
/// As [`scores_entry`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_b<const B: u8, const HD: usize>(
    s: Avx512,
    head: &PackedHead<'_>,
    q: &[f32],
    out: &mut [f32],
) {
    // SAFETY: the caller's contract, passed on.
    unsafe { tile::scores::<Avx512, B, HD>(s, head, q, out) }
}

/// # Safety
/// The CPU has the enabled features; `check_head(head, out.len(), p.len())` passed.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn weighted_sum_entry(s: Avx512, head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        by_shape!(
            [(2, 128), (3, 128), (4, 128), (8, 128)],
            weighted_sum_b,
            head,
            (s, head, p, out)
        )
    }
}

/// # Safety
/// As [`weighted_sum_entry`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn weighted_sum_b<const B: u8, const HD: usize>(
    s: Avx512,
    head: &PackedHead<'_>,
    p: &[f32],
    out: &mut [f32],
) {
    // SAFETY: the caller's contract, passed on.
    unsafe { tile::weighted_sum::<Avx512, B, HD>(s, head, p, out) }
}

/// # Safety
/// The CPU has the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dense_scores_entry<E: DenseElem>(
    s: Avx512,
    hd: usize,
    k: &[E],
    q: &[f32],
    out: &mut [f32],
) {
    tile::dense_scores(s, hd, k, q, out)
}

/// # Safety
/// The CPU has the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dense_weighted_sum_entry<E: DenseElem>(
    s: Avx512,
    hd: usize,
    v: &[E],
    p: &[f32],
    out: &mut [f32],
) {
    tile::dense_weighted_sum(s, hd, v, p, out)
}

/// # Safety
/// The CPU has the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn softmax_parts_entry(s: Avx512, x: &mut [f32]) -> (f32, f32) {
    tile::softmax_parts(s, x)
}

/// # Safety
/// The CPU has the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scale_entry(s: Avx512, x: &mut [f32], k: f32) {
    tile::scale_in_place(s, x, k)
}

// SAFETY: an `Avx512` exists only when `Avx512::new` found every feature
// the methods below use (AVX-512F/BW/VL, AVX2, FMA, F16C).
unsafe impl Simd for Avx512 {
    const REGS: usize = 32;
    const L: usize = 16;
    type F = __m512;
    type I = __m512i;
    type C3 = Code3;

    #[inline(always)]
    fn zero(self) -> __m512 {
        // SAFETY: `self` proves AVX-512F (this and every block below).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn min(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    fn hmin(self, a: __m512) -> f32 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_reduce_min_ps(a) }
    }
    #[inline(always)]
    fn or_nonfinite(self, acc: __m512i, v: __m512) -> __m512i {
        // SAFETY: AVX-512F.
        unsafe { _mm512_or_si512(acc, _mm512_castps_si512(_mm512_sub_ps(v, v))) }
    }
    #[inline(always)]
    fn any(self, v: __m512i) -> bool {
        // SAFETY: AVX-512F.
        unsafe { _mm512_test_epi32_mask(v, v) != 0 }
    }
    #[inline(always)]
    fn zero_i(self) -> __m512i {
        // SAFETY: AVX-512F.
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    fn exp(self, x: __m512) -> __m512 {
        use super::expc::*;
        // SAFETY: AVX-512F.
        unsafe {
            let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LO));
            let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LO)), _mm512_set1_ps(HI));
            let n = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C1), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C2), r);
            let mut p = _mm512_set1_ps(P[0]);
            for &c in &P[1..] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
            }
            let y = _mm512_fmadd_ps(
                p,
                _mm512_mul_ps(r, r),
                _mm512_add_ps(r, _mm512_set1_ps(1.0)),
            );
            let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            ));
            _mm512_maskz_mov_ps(!under, _mm512_mul_ps(y, _mm512_castsi512_ps(e)))
        }
    }
    #[inline(always)]
    fn hmax(self, a: __m512) -> f32 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_reduce_max_ps(a) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn cvt(self, v: __m512i) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_cvtepi32_ps(v) }
    }
    #[inline(always)]
    fn permute(self, table: __m512, idx: __m512i) -> __m512 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_permutexvar_ps(idx, table) }
    }
    #[inline(always)]
    fn code3_consts(self, hd: usize) -> Option<Code3> {
        // Each plane's 64-code blocks come from one load or broadcast:
        // plane bytes in whole 64-byte blocks, or one block of 32 (2-bit
        // plane at head_dim 128; 1-bit at 256) or 16 (1-bit at 128)
        // repeated across the register.
        let (m2, m1) = (hd / 4, hd / 8);
        let fits = |m: usize| m == 16 || m == 32 || m.is_multiple_of(64);
        if !(hd.is_multiple_of(128) && hd <= 64 * MAX_BLOCKS && fits(m2) && fits(m1)) {
            return None;
        }
        let (mut x, mut y) = ([[0u32; 16]; MAX_BLOCKS], [[0u32; 16]; MAX_BLOCKS]);
        for k in 0..hd / 64 {
            for l in 0..16 {
                // Dword `l` of block `k`: channels `c..c+4`, one field of
                // each plane (the plane lengths are multiples of 4).
                let c = 64 * k + 4 * l;
                x[k][l] = 2 * (c / m2) as u32;
                // Rotate right by `field − 2`: the field's bit to bit 2
                // of every byte, from within the same byte.
                y[k][l] = ((c / m1) as i32 - 2).rem_euclid(32) as u32;
            }
        }
        // SAFETY: AVX-512F; each array holds 16 dwords.
        let (mut cx, mut cy) = unsafe {
            (
                [_mm512_setzero_si512(); MAX_BLOCKS],
                [_mm512_setzero_si512(); MAX_BLOCKS],
            )
        };
        for k in 0..MAX_BLOCKS {
            // SAFETY: as above.
            unsafe {
                cx[k] = _mm512_loadu_si512(x[k].as_ptr() as *const _);
                cy[k] = _mm512_loadu_si512(y[k].as_ptr() as *const _);
            }
        }
        Some(Code3 { x: cx, y: cy })
    }
    #[inline(always)]
    unsafe fn code3_bytes(self, c: &Code3, row: *const u8, hd: usize, out: *mut u8) {
        let (m2, m1) = (hd / 4, hd / 8);
        // SAFETY: the caller's contract: `code3_consts(hd)` accepted the
        // shape, so every load below stays inside the row's `m2 + m1`
        // bytes and every store inside `out`'s `hd`; AVX-512F.
        unsafe {
            for k in 0..hd / 64 {
                let x = _mm512_srlv_epi32(plane_block(row, m2, k), c.x[k]);
                let y = _mm512_rorv_epi32(plane_block(row.add(m2), m1, k), c.y[k]);
                // Bits 0–1 from the 2-bit plane, bit 2 from the 1-bit one
                // (`c ? a : b` per bit with `c` = 3, then `& 7`).
                let v = _mm512_ternarylogic_epi32::<0xE4>(x, y, _mm512_set1_epi8(3));
                let v = _mm512_and_si512(v, _mm512_set1_epi8(7));
                _mm512_storeu_si512(out.add(64 * k) as *mut _, v);
            }
        }
    }
    #[inline(always)]
    fn field_f32<const P: u32>(self, v: __m512i) -> __m512 {
        // SAFETY: AVX-512F. `vpermps` reads the low 4 bits of each index:
        // entry `i` of the table is `i & (2^P − 1)`.
        unsafe {
            let t = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            );
            let t = if P >= 4 {
                t
            } else {
                let mask = _mm512_set1_epi32((1 << P) - 1);
                _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_cvttps_epi32(t), mask))
            };
            _mm512_permutexvar_ps(v, t)
        }
    }
    #[inline(always)]
    fn shr_mask(self, v: __m512i, sh: i32, mask: u32) -> __m512i {
        // SAFETY: AVX-512F. `sh` is a constant after unrolling, so these
        // become immediate shifts.
        unsafe {
            let v = if sh >= 0 {
                _mm512_srlv_epi32(v, _mm512_set1_epi32(sh))
            } else {
                _mm512_sllv_epi32(v, _mm512_set1_epi32(-sh))
            };
            _mm512_and_si512(v, _mm512_set1_epi32(mask as i32))
        }
    }
    #[inline(always)]
    fn shr_pair_mask(self, v: __m512i, a: u32, b: u32, mask: u32, sh: u32) -> __m512i {
        // SAFETY: AVX-512F.
        unsafe {
            let counts = _mm512_mask_blend_epi32(
                0xFF00,
                _mm512_set1_epi32(a as i32),
                _mm512_set1_epi32(b as i32),
            );
            let v = _mm512_and_si512(_mm512_srlv_epi32(v, counts), _mm512_set1_epi32(mask as i32));
            _mm512_sllv_epi32(v, _mm512_set1_epi32(sh as i32))
        }
    }
    #[inline(always)]
    fn or(self, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: AVX-512F.
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    fn reduce(self, a: &[__m512; 16]) -> __m512 {
        // Transpose-and-add in four levels (128-bit halves, 128-bit
        // quarters, pairs, lanes). The last level leaves the sum of slot
        // `k + 4r` in lane `4k + r`, so slot `s` is fed token
        // `4·(s mod 4) + s div 4` and lane `t` comes out as token `t`.
        // SAFETY: AVX-512F.
        unsafe {
            let x = |s: usize| a[4 * (s % 4) + s / 4];
            let mut c = [_mm512_setzero_ps(); 8];
            for (i, c) in c.iter_mut().enumerate() {
                let (p, q) = (x(2 * i), x(2 * i + 1));
                *c = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b01_00_01_00>(p, q),
                    _mm512_shuffle_f32x4::<0b11_10_11_10>(p, q),
                );
            }
            let mut d = [_mm512_setzero_ps(); 4];
            for (i, d) in d.iter_mut().enumerate() {
                let (p, q) = (c[2 * i], c[2 * i + 1]);
                *d = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(p, q),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q),
                );
            }
            let e0 = _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(d[0], d[1]),
                _mm512_shuffle_ps::<0b11_10_11_10>(d[0], d[1]),
            );
            let e1 = _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(d[2], d[3]),
                _mm512_shuffle_ps::<0b11_10_11_10>(d[2], d[3]),
            );
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(e0, e1),
                _mm512_shuffle_ps::<0b11_01_11_01>(e0, e1),
            )
        }
    }
    #[inline(always)]
    fn hsum(self, a: __m512) -> f32 {
        // SAFETY: AVX-512F.
        unsafe { _mm512_reduce_add_ps(a) }
    }

    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> __m512 {
        // SAFETY: the caller's contract (16 floats); AVX-512F.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m512) {
        // SAFETY: the caller's contract (16 floats); AVX-512F.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_i(self, p: *const f32) -> __m512i {
        // SAFETY: the caller's contract (16 floats); AVX-512F.
        unsafe { _mm512_castps_si512(_mm512_loadu_ps(p)) }
    }
    #[inline(always)]
    unsafe fn store_i(self, p: *mut f32, v: __m512i) {
        // SAFETY: the caller's contract (16 floats); AVX-512F.
        unsafe { _mm512_storeu_ps(p, _mm512_castsi512_ps(v)) }
    }
    #[inline(always)]
    unsafe fn bcast(self, p: *const f32) -> __m512 {
        // SAFETY: the caller's contract (one float); AVX-512F.
        unsafe { _mm512_set1_ps(*p) }
    }
    #[inline(always)]
    unsafe fn store_u8_trunc(self, p: *mut u8, v: __m512) {
        // SAFETY: the caller's contract (16 bytes); AVX-512F.
        unsafe {
            let c = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v));
            _mm_storeu_si128(p as *mut __m128i, c)
        }
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8) -> __m512i {
        // SAFETY: the caller's contract (16 bytes, unaligned load); AVX-512F.
        unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load_u8_dup(self, p: *const u8) -> __m512i {
        // SAFETY: the caller's contract (8 bytes; `_mm_loadl_epi64` reads
        // exactly 8, unaligned); AVX-512F.
        unsafe {
            let x = _mm_loadl_epi64(p as *const __m128i);
            _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(x, x))
        }
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u8) -> __m512 {
        // SAFETY: the caller's contract (32 bytes, unaligned); AVX-512F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u8) -> __m512 {
        // SAFETY: the caller's contract (32 bytes, unaligned); AVX-512F.
        // A bfloat16 is the high half of the f32 with the same bits.
        unsafe {
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
        }
    }
    #[inline(always)]
    unsafe fn load_f32_bytes(self, p: *const u8) -> __m512 {
        // SAFETY: the caller's contract (64 bytes); `loadu` has no
        // alignment requirement; AVX-512F.
        unsafe { _mm512_loadu_ps(p as *const f32) }
    }
}

/// Rounding immediates for the embedded-rounding and F16C conversions.
const UP: i32 = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;

impl Avx512 {
    /// [`crate::quant::group_params`] of every group, eight at a time: the same
    /// IEEE operations in the same order (f64 subtract and divide, f64→f32
    /// rounded up by the conversion's embedded rounding, f32→f16 rounded
    /// by F16C's immediate, f32→bf16 in integers), so the results are
    /// bit-identical to the scalar code. The last `< 8` groups take the
    /// scalar code. See [`QuantOps::group_params`].
    #[inline(always)]
    pub(crate) fn group_params(
        self,
        s: &QuantScheme,
        mins: &[f32],
        maxs: &[f32],
        scales: &mut [f32],
        zeros: &mut [f32],
    ) -> Result<(), usize> {
        let n = mins.len();
        assert!(maxs.len() >= n && scales.len() >= n && zeros.len() >= n);
        let fmt = s.scale_format();
        let bits = s.bits() as u32;
        let sym = s.mode() == Mode::Symmetric;
        let levels = ((1u32 << bits) - 1) as f32;
        let qmax = ((1u32 << (bits - 1)) - 1) as f64;
        let half = (1u32 << (bits - 1)) as f32;
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: lanes `i..i+8 ≤ n` of slices of at least `n` floats
            // (asserted above); `self` proves AVX-512F/VL and F16C.
            let bad = unsafe {
                let mn = _mm256_loadu_ps(mins.as_ptr().add(i));
                let mx = _mm256_loadu_ps(maxs.as_ptr().add(i));
                let vl = _mm256_set1_ps(levels);
                let (scale, zero, bad) = if sym {
                    let am = _mm256_max_ps(abs8(mn), abs8(mx));
                    let d = _mm512_div_pd(_mm512_cvtps_pd(am), _mm512_set1_pd(qmax));
                    let scale = up_fmt(fmt, _mm512_cvt_roundpd_ps::<UP>(d));
                    let zero = _mm256_mul_ps(neg8(scale), _mm256_set1_ps(half));
                    let top = _mm256_mul_ps(scale, vl);
                    (
                        scale,
                        zero,
                        nonfinite8(scale) | nonfinite8(zero) | nonfinite8(top),
                    )
                } else {
                    // round_down(x) = −round_up(−x); `min` is an f32, so only
                    // the format rounds.
                    let zero = neg8(up_fmt(fmt, neg8(mn)));
                    let diff = _mm512_sub_pd(_mm512_cvtps_pd(mx), _mm512_cvtps_pd(zero));
                    let d = _mm512_div_pd(diff, _mm512_set1_pd(levels as f64));
                    let scale = up_fmt(fmt, _mm512_cvt_roundpd_ps::<UP>(d));
                    let top = _mm256_add_ps(_mm256_mul_ps(scale, vl), zero);
                    (
                        scale,
                        zero,
                        nonfinite8(zero) | nonfinite8(scale) | nonfinite8(top),
                    )
                };
                _mm256_storeu_ps(scales.as_mut_ptr().add(i), scale);
                _mm256_storeu_ps(zeros.as_mut_ptr().add(i), zero);
                bad
            };
            if bad != 0 {
                return Err(i + bad.trailing_zeros() as usize);
            }
            i += 8;
        }
        Scalar
            .group_params(
                s,
                &mins[i..n],
                &maxs[i..n],
                &mut scales[i..n],
                &mut zeros[i..n],
            )
            .map_err(|j| i + j)
    }

    /// [`QuantOps::write_params`] eight values at a time (exact
    /// conversions: every value is representable), scalar tail.
    #[inline(always)]
    pub(crate) fn write_params(self, fmt: ScaleFormat, vals: &[f32], out: &mut [u8]) {
        let fb = fmt.bytes();
        let n = vals.len();
        assert!(out.len() >= n * fb);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: reads floats `i..i+8 ≤ n`, writes bytes `i·fb..(i+8)·fb
            // ≤ n·fb` (asserted); AVX-512F/VL, F16C.
            unsafe {
                let v = _mm256_loadu_ps(vals.as_ptr().add(i));
                let dst = out.as_mut_ptr().add(i * fb);
                match fmt {
                    ScaleFormat::F16 => {
                        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_POS_INF>(v);
                        _mm_storeu_si128(dst as *mut __m128i, h)
                    }
                    ScaleFormat::Bf16 => {
                        let h = _mm256_srli_epi32::<16>(_mm256_castps_si256(v));
                        _mm_storeu_si128(dst as *mut __m128i, _mm256_cvtepi32_epi16(h))
                    }
                    ScaleFormat::F32 => _mm256_storeu_ps(dst as *mut f32, v),
                }
            }
            i += 8;
        }
        Scalar.write_params(fmt, &vals[i..], &mut out[i * fb..]);
    }
}

/// `|x|` lanewise.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn abs8(x: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_castps_si256(x),
            _mm256_set1_epi32(0x7FFF_FFFF),
        ))
    }
}

/// `−x` lanewise (sign flip, exact).
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn neg8(x: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe { _mm256_xor_ps(x, _mm256_set1_ps(-0.0)) }
}

/// Bit `k` set where lane `k` is NaN or ±inf.
///
/// # Safety
/// AVX-512F/VL.
#[inline(always)]
unsafe fn nonfinite8(x: __m256) -> u8 {
    // SAFETY: the caller's contract.
    unsafe {
        let e = _mm256_set1_epi32(0x7F80_0000);
        _mm256_cmpeq_epi32_mask(_mm256_and_si256(_mm256_castps_si256(x), e), e)
    }
}

/// `ScaleFormat::round_up` of f32 lanes: the least number of the format
/// that is `≥ x` (f16 by F16C's round-up immediate, which saturates and
/// makes subnormals as the scalar code does; bf16 by truncating the low 16
/// bits and stepping positive inexact values up).
///
/// # Safety
/// AVX-512F/VL, F16C.
#[inline(always)]
unsafe fn up_fmt(fmt: ScaleFormat, x: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        match fmt {
            ScaleFormat::F32 => x,
            ScaleFormat::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_POS_INF>(x)),
            ScaleFormat::Bf16 => {
                let b = _mm256_castps_si256(x);
                let t = _mm256_srli_epi32::<16>(b);
                let step = _mm256_test_epi32_mask(b, _mm256_set1_epi32(0xFFFF))
                    & _mm256_cmpge_epi32_mask(b, _mm256_setzero_si256());
                let t = _mm256_mask_add_epi32(t, step, t, _mm256_set1_epi32(1));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(t))
            }
        }
    }
}
