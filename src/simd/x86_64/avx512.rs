//! AVX-512 vocabulary: 512-bit vectors, 16 lanes, tiles of 16 tokens.
//!
//! Needs AVX-512F, BW and VL (plus AVX2, FMA and F16C, which every AVX-512
//! CPU has). Everything in this file may use those instructions and no
//! others.

use super::Simd;
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

/// `v`, unseen by the optimizer: it keeps a shift of widened bytes on the
/// widened vector. (Knowing the lanes hold zero-extended bytes, LLVM moves
/// such a shift and mask before a second widening: one more operation on
/// the shuffle port the table lookups need.)
///
/// # Safety
/// AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn opaque(mut v: __m512i) -> __m512i {
    // SAFETY: an empty template: no instruction runs; `v` stays in its
    // register.
    unsafe {
        core::arch::asm!(
            "/* {0} */",
            inout(zmm_reg) v,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    v
}

/// Proof that the CPU runs this file's instructions (see [`Avx512::new`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// `Some` only when the CPU has AVX-512F/BW/VL, AVX2, FMA and F16C (read once, see
    /// [`super::Cpu`]).
    #[inline]
    pub(crate) fn new() -> Option<Avx512> {
        super::Cpu::get().on_avx512.then_some(Avx512(()))
    }
}

// SAFETY: an `Avx512` exists only when `Avx512::new` found every feature
// the methods below use (AVX-512F/BW/VL, AVX2, FMA, F16C).
unsafe impl Simd for Avx512 {
    const REGS: usize = 32;
    const L: usize = 16;
    type F = __m512;
    type I = __m512i;
    type C3 = Code3;
    type T16 = __m512;

    #[inline(always)]
    fn avx512(self) -> Option<Avx512> {
        Some(self)
    }

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
    fn bits_f32(self, v: __m512i) -> __m512 {
        // SAFETY: AVX-512F (a register reinterpretation).
        unsafe { _mm512_castsi512_ps(v) }
    }
    #[inline(always)]
    fn table16(self, t: &[f32; 16]) -> __m512 {
        // SAFETY: AVX-512F; `t` is 16 floats (unaligned load).
        unsafe { _mm512_loadu_ps(t.as_ptr()) }
    }
    #[inline(always)]
    fn lut16(self, t: __m512, idx: __m512i) -> __m512 {
        // SAFETY: AVX-512F. `vpermps` reads the low 4 bits of each index.
        unsafe { _mm512_permutexvar_ps(idx, t) }
    }
    #[inline(always)]
    fn lut8(self, t: __m512, idx: __m512i) -> __m512 {
        // Bit 3 of an index picks the table's upper eight entries, the
        // same as its lower eight.
        self.lut16(t, idx)
    }
    #[inline(always)]
    fn scale16(self, t: __m512, c: __m512) -> __m512 {
        self.mul(t, c)
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
        self.field_at_f32::<P, 0>(v)
    }
    #[inline(always)]
    fn field_at_f32<const P: u32, const SH: u32>(self, v: __m512i) -> __m512 {
        debug_assert!(SH + P <= 4);
        // Entry `i` of the table is `(i >> SH) & (2^P − 1)`; a constant the
        // compiler folds.
        let t: [f32; 16] = std::array::from_fn(|i| ((i as u32 >> SH) & ((1 << P) - 1)) as f32);
        // SAFETY: AVX-512F; `t` holds 16 floats. `vpermps` reads the low 4
        // bits of each index, which hold the field (`SH + P ≤ 4`).
        unsafe { _mm512_permutexvar_ps(v, _mm512_loadu_ps(t.as_ptr())) }
    }
    #[inline(always)]
    fn in_place_f32<const P: u32, const SH: u32>(self, v: __m512i) -> __m512 {
        let m = ((1u32 << P) - 1) << SH;
        if SH + P <= 4 {
            // Entry `i`: `i & m`.
            let t: [f32; 16] = std::array::from_fn(|i| (i as u32 & m) as f32);
            // SAFETY: AVX-512F; `vpermps` reads the low 4 bits of each
            // index, which hold the field.
            unsafe { _mm512_permutexvar_ps(v, _mm512_loadu_ps(t.as_ptr())) }
        } else if SH >= 4 && P <= 2 {
            // The high nibble, shifted down once (the shift shared by its two
            // fields), then a table: entry `i` is `(16·i) & m`. Two fields
            // cost a shift and two lookups against two masks and two
            // converts, and leave the convert's port to the FMAs (measured
            // 4 % faster in the 2-bit weighted sum).
            let t: [f32; 16] = std::array::from_fn(|i| ((i as u32) << 4 & m) as f32);
            // SAFETY: AVX-512F (this type's proof, for `opaque` too); the
            // shifted lanes' low 4 bits (the byte's high nibble) index `t`.
            unsafe {
                let v = _mm512_srli_epi32::<4>(opaque(v));
                _mm512_permutexvar_ps(v, _mm512_loadu_ps(t.as_ptr()))
            }
        } else {
            self.cvt(self.shr_mask(v, 0, m))
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
    fn add_i(self, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: AVX-512F.
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    fn splat_i(self, x: u32) -> __m512i {
        // SAFETY: AVX-512F.
        unsafe { _mm512_set1_epi32(x as i32) }
    }
    #[inline(always)]
    fn select(self, m: u32, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: AVX-512F. One `vpternlogd`: `m ? a : b` per bit.
        unsafe { _mm512_ternarylogic_epi32::<0xE4>(a, b, _mm512_set1_epi32(m as i32)) }
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
    fn transpose(self, a: &mut [__m512; 16]) {
        // Four levels of two-source shuffles, 64 in all. After the second,
        // `u[4k + j]` holds, in its 128-bit quarter `q`, column `4q + j` of
        // rows `4k..4k + 4`; the last two gather quarter `q` of
        // `u[j], u[4 + j], u[8 + j], u[12 + j]` into row `4q + j`.
        // SAFETY: AVX-512F.
        unsafe {
            let mut t = [_mm512_setzero_ps(); 16];
            for k in 0..8 {
                t[2 * k] = _mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]);
                t[2 * k + 1] = _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]);
            }
            let mut u = [_mm512_setzero_ps(); 16];
            for k in 0..4 {
                let (b, c) = (4 * k, 4 * k + 2);
                u[b] = _mm512_shuffle_ps::<0b01_00_01_00>(t[b], t[c]);
                u[b + 1] = _mm512_shuffle_ps::<0b11_10_11_10>(t[b], t[c]);
                u[b + 2] = _mm512_shuffle_ps::<0b01_00_01_00>(t[b + 1], t[c + 1]);
                u[b + 3] = _mm512_shuffle_ps::<0b11_10_11_10>(t[b + 1], t[c + 1]);
            }
            for j in 0..4 {
                let v0 = _mm512_shuffle_f32x4::<0b10_00_10_00>(u[j], u[4 + j]);
                let v1 = _mm512_shuffle_f32x4::<0b11_01_11_01>(u[j], u[4 + j]);
                let w0 = _mm512_shuffle_f32x4::<0b10_00_10_00>(u[8 + j], u[12 + j]);
                let w1 = _mm512_shuffle_f32x4::<0b11_01_11_01>(u[8 + j], u[12 + j]);
                a[j] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v0, w0);
                a[4 + j] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v1, w1);
                a[8 + j] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v0, w0);
                a[12 + j] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v1, w1);
            }
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
    unsafe fn load_u16(self, p: *const u8) -> __m512i {
        // SAFETY: the caller's contract (32 bytes, unaligned load); AVX-512F.
        unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn load_u16_dup(self, p: *const u8) -> __m512i {
        // SAFETY: the caller's contract (16 bytes, unaligned load); AVX-512F.
        unsafe {
            let x = _mm_loadu_si128(p as *const __m128i);
            _mm512_cvtepu16_epi32(_mm256_broadcastsi128_si256(x))
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
    #[inline(always)]
    unsafe fn gather_pairs(self, base: *const f32, idx: __m512i) -> (__m512, __m512) {
        // SAFETY: the caller's contract (both floats of every lane's pair
        // readable; a gather has no alignment requirement); AVX-512F.
        unsafe {
            let lo = _mm512_castsi512_si256(idx);
            let hi = _mm512_extracti64x4_epi64::<1>(idx);
            let f = base as *const f64;
            // Lanes 0–7 and 8–15 as `(even, odd)` pairs, then the evens
            // and the odds of both.
            let x0 = _mm512_castpd_ps(_mm512_i32gather_pd::<8>(lo, f));
            let x1 = _mm512_castpd_ps(_mm512_i32gather_pd::<8>(hi, f));
            let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
            (
                _mm512_permutex2var_ps(x0, even, x1),
                _mm512_permutex2var_ps(x0, odd, x1),
            )
        }
    }
}
