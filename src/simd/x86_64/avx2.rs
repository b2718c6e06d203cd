//! AVX2 vocabulary: 256-bit vectors, 8 lanes, tiles of 8 tokens.
//!
//! Needs AVX2, FMA and F16C (Haswell and later, Zen and later).
//! Everything in this file may use those instructions and no others.

use super::Simd;
use core::arch::x86_64::*;

/// Blocks of 32 codes in a row [`Code3`] covers (head dims up to 512).
const MAX_BLOCKS: usize = 16;

/// The per-dword shift counts of [`Simd::code3_bytes`] for one head dim:
/// for each block of 32 codes, the 2-bit plane's right shift (`x`) and the
/// 1-bit plane's right (`yr`) and left (`yl`) shifts.
#[derive(Clone, Copy)]
pub(crate) struct Code3 {
    x: [__m256i; MAX_BLOCKS],
    yr: [__m256i; MAX_BLOCKS],
    yl: [__m256i; MAX_BLOCKS],
}

/// The plane bytes of codes `32k..32k+32` of a plane of `m` bytes at `p`
/// (`m` 16 or a multiple of 32): one block, or the 16-byte plane in both
/// halves.
///
/// # Safety
/// AVX2; `p` valid for `m` bytes; the block's bytes lie inside the plane.
#[inline(always)]
unsafe fn plane_block(p: *const u8, m: usize, k: usize) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe {
        if m == 16 {
            _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_si256(p.add(32 * k % m) as *const __m256i)
        }
    }
}

/// Proof that the CPU runs this file's instructions (see [`Avx2::new`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` only when the CPU has AVX2, FMA and F16C (read once, see
    /// [`super::Cpu`]).
    #[inline]
    pub(crate) fn new() -> Option<Avx2> {
        super::Cpu::get().on_avx2.then_some(Avx2(()))
    }
}

// SAFETY: an `Avx2` exists only when `Avx2::new` found every feature the
// methods below use (AVX2, FMA, F16C; AVX and SSE come with AVX2).
unsafe impl Simd for Avx2 {
    const REGS: usize = 16;
    const L: usize = 8;
    type F = __m256;
    type I = __m256i;
    type C3 = Code3;
    type T16 = (__m256, __m256);

    #[inline(always)]
    fn zero(self) -> __m256 {
        // SAFETY: `self` proves AVX2 (this and every block below).
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m256 {
        // SAFETY: AVX.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX.
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn max(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX.
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    fn exp(self, x: __m256) -> __m256 {
        use super::expc::*;
        // SAFETY: AVX, AVX2 and FMA.
        unsafe {
            let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO));
            let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
            let n = _mm256_round_ps::<0x08>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C1), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C2), r);
            let mut p = _mm256_set1_ps(P[0]);
            for &c in &P[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let y = _mm256_fmadd_ps(
                p,
                _mm256_mul_ps(r, r),
                _mm256_add_ps(r, _mm256_set1_ps(1.0)),
            );
            let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))
        }
    }
    #[inline(always)]
    fn hmax(self, a: __m256) -> f32 {
        // SAFETY: AVX.
        unsafe {
            let x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
            let x = _mm_max_ss(x, _mm_movehdup_ps(x));
            _mm_cvtss_f32(x)
        }
    }
    #[inline(always)]
    fn hmin(self, a: __m256) -> f32 {
        // SAFETY: AVX.
        unsafe {
            let x = _mm_min_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let x = _mm_min_ps(x, _mm_movehl_ps(x, x));
            let x = _mm_min_ss(x, _mm_movehdup_ps(x));
            _mm_cvtss_f32(x)
        }
    }
    #[inline(always)]
    fn min(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX.
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    fn or_nonfinite(self, acc: __m256i, v: __m256) -> __m256i {
        // SAFETY: AVX2.
        unsafe { _mm256_or_si256(acc, _mm256_castps_si256(_mm256_sub_ps(v, v))) }
    }
    #[inline(always)]
    fn any(self, v: __m256i) -> bool {
        // SAFETY: AVX.
        unsafe { _mm256_testz_si256(v, v) == 0 }
    }
    #[inline(always)]
    fn zero_i(self) -> __m256i {
        // SAFETY: AVX.
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: FMA.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn cvt(self, v: __m256i) -> __m256 {
        // SAFETY: AVX.
        unsafe { _mm256_cvtepi32_ps(v) }
    }
    #[inline(always)]
    fn permute(self, table: __m256, idx: __m256i) -> __m256 {
        // SAFETY: AVX2.
        unsafe { _mm256_permutevar8x32_ps(table, idx) }
    }
    #[inline(always)]
    fn bits_f32(self, v: __m256i) -> __m256 {
        // SAFETY: AVX (a register reinterpretation).
        unsafe { _mm256_castsi256_ps(v) }
    }
    #[inline(always)]
    fn table16(self, t: &[f32; 16]) -> (__m256, __m256) {
        // SAFETY: AVX; `t` is 16 floats (two unaligned loads of 8).
        unsafe {
            (
                _mm256_loadu_ps(t.as_ptr()),
                _mm256_loadu_ps(t.as_ptr().add(8)),
            )
        }
    }
    #[inline(always)]
    fn lut16(self, t: (__m256, __m256), idx: __m256i) -> __m256 {
        // SAFETY: AVX2. `vpermps` reads the low 3 bits of each index; bit 3,
        // shifted into the sign bit, picks the table's upper half.
        unsafe {
            let lo = _mm256_permutevar8x32_ps(t.0, idx);
            let hi = _mm256_permutevar8x32_ps(t.1, idx);
            _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)))
        }
    }
    #[inline(always)]
    fn lut8(self, t: (__m256, __m256), idx: __m256i) -> __m256 {
        // SAFETY: AVX2. `vpermps` reads the low 3 bits of each index; the
        // upper eight entries equal the lower (the caller's table).
        unsafe { _mm256_permutevar8x32_ps(t.0, idx) }
    }
    #[inline(always)]
    fn scale16(self, t: (__m256, __m256), c: __m256) -> (__m256, __m256) {
        (self.mul(t.0, c), self.mul(t.1, c))
    }
    #[inline(always)]
    fn field_f32<const P: u32>(self, v: __m256i) -> __m256 {
        self.field_at_f32::<P, 0>(v)
    }
    #[inline(always)]
    fn field_at_f32<const P: u32, const SH: u32>(self, v: __m256i) -> __m256 {
        // SAFETY: AVX2. (A table permute would work for fields of up to 3
        // bits, but 256-bit converts issue on two ports and `vpermps` on
        // one, so shift, mask and convert is faster here.)
        unsafe {
            let v = _mm256_srlv_epi32(v, _mm256_set1_epi32(SH as i32));
            _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << P) - 1)))
        }
    }
    #[inline(always)]
    fn shr_mask(self, v: __m256i, sh: i32, mask: u32) -> __m256i {
        // SAFETY: AVX2. `sh` is a constant after unrolling, so these
        // become immediate shifts.
        unsafe {
            let v = if sh >= 0 {
                _mm256_srlv_epi32(v, _mm256_set1_epi32(sh))
            } else {
                _mm256_sllv_epi32(v, _mm256_set1_epi32(-sh))
            };
            _mm256_and_si256(v, _mm256_set1_epi32(mask as i32))
        }
    }
    #[inline(always)]
    fn shr_pair_mask(self, v: __m256i, a: u32, b: u32, mask: u32, sh: u32) -> __m256i {
        // SAFETY: AVX2.
        unsafe {
            let counts = _mm256_blend_epi32::<0xF0>(
                _mm256_set1_epi32(a as i32),
                _mm256_set1_epi32(b as i32),
            );
            let v = _mm256_and_si256(_mm256_srlv_epi32(v, counts), _mm256_set1_epi32(mask as i32));
            _mm256_sllv_epi32(v, _mm256_set1_epi32(sh as i32))
        }
    }
    #[inline(always)]
    fn code3_consts(self, hd: usize) -> Option<Code3> {
        // As on AVX-512, but 32 codes per register: each plane's bytes
        // for a block are one load, or the 16-byte plane (1-bit at head_dim
        // 128) in both halves. AVX2 has no variable rotate: the 1-bit
        // field goes to bit 2 by a right shift or a left shift (a count of
        // 32 or more gives 0, so one of the two is empty per dword).
        let (m2, m1) = (hd / 4, hd / 8);
        let fits = |m: usize| m == 16 || m.is_multiple_of(32);
        if !(hd.is_multiple_of(128) && hd <= 32 * MAX_BLOCKS && fits(m2) && fits(m1)) {
            return None;
        }
        let (mut x, mut yr, mut yl) = (
            [[0u32; 8]; MAX_BLOCKS],
            [[0u32; 8]; MAX_BLOCKS],
            [[0u32; 8]; MAX_BLOCKS],
        );
        for k in 0..hd / 32 {
            for l in 0..8 {
                // Dword `l` of block `k`: channels `c..c+4`, one field of
                // each plane.
                let c = 32 * k + 4 * l;
                let f1 = (c / m1) as u32;
                x[k][l] = 2 * (c / m2) as u32;
                yr[k][l] = if f1 >= 2 { f1 - 2 } else { 32 };
                yl[k][l] = if f1 >= 2 { 32 } else { 2 - f1 };
            }
        }
        // SAFETY: AVX; each array holds 8 dwords.
        let mut v = unsafe { [[_mm256_setzero_si256(); MAX_BLOCKS]; 3] };
        for (vi, ci) in v.iter_mut().zip([&x, &yr, &yl]) {
            for (x, c) in vi.iter_mut().zip(ci) {
                // SAFETY: as above.
                *x = unsafe { _mm256_loadu_si256(c.as_ptr() as *const __m256i) };
            }
        }
        Some(Code3 {
            x: v[0],
            yr: v[1],
            yl: v[2],
        })
    }
    #[inline(always)]
    unsafe fn code3_bytes(self, c: &Code3, row: *const u8, hd: usize, out: *mut u8) {
        let (m2, m1) = (hd / 4, hd / 8);
        // SAFETY: the caller's contract: `code3_consts(hd)` accepted the
        // shape, so every load stays inside the row's `m2 + m1` bytes and
        // every store inside `out`'s `hd`; AVX2.
        unsafe {
            for k in 0..hd / 32 {
                let x = _mm256_srlv_epi32(plane_block(row, m2, k), c.x[k]);
                let p1 = plane_block(row.add(m2), m1, k);
                let y = _mm256_or_si256(
                    _mm256_srlv_epi32(p1, c.yr[k]),
                    _mm256_sllv_epi32(p1, c.yl[k]),
                );
                // Bits 0–1 from the 2-bit plane, bit 2 from the 1-bit one.
                let v = _mm256_or_si256(
                    _mm256_and_si256(x, _mm256_set1_epi8(3)),
                    _mm256_and_si256(y, _mm256_set1_epi8(4)),
                );
                _mm256_storeu_si256(out.add(32 * k) as *mut __m256i, v);
            }
        }
    }
    #[inline(always)]
    fn or(self, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: AVX2.
        unsafe { _mm256_or_si256(a, b) }
    }
    #[inline(always)]
    fn add_i(self, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: AVX2.
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    fn splat_i(self, x: u32) -> __m256i {
        // SAFETY: AVX.
        unsafe { _mm256_set1_epi32(x as i32) }
    }
    #[inline(always)]
    fn select(self, m: u32, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: AVX2.
        unsafe {
            let m = _mm256_set1_epi32(m as i32);
            _mm256_or_si256(_mm256_and_si256(a, m), _mm256_andnot_si256(m, b))
        }
    }
    #[inline(always)]
    fn reduce(self, a: &[__m256; 16]) -> __m256 {
        // Two rounds of horizontal adds leave, in each 128-bit half, the
        // four partial sums of tokens 0–3 (u0) or 4–7 (u1); adding the
        // halves finishes them, in order.
        // SAFETY: AVX.
        unsafe {
            let t0 = _mm256_hadd_ps(a[0], a[1]);
            let t1 = _mm256_hadd_ps(a[2], a[3]);
            let t2 = _mm256_hadd_ps(a[4], a[5]);
            let t3 = _mm256_hadd_ps(a[6], a[7]);
            let u0 = _mm256_hadd_ps(t0, t1);
            let u1 = _mm256_hadd_ps(t2, t3);
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(u0, u1),
                _mm256_permute2f128_ps::<0x31>(u0, u1),
            )
        }
    }
    #[inline(always)]
    fn transpose(self, a: &mut [__m256; 16]) {
        // As the AVX-512 one, with two 128-bit halves: after the second
        // level `u[4k + j]` holds, in half `h`, column `4h + j` of rows
        // `4k..4k + 4`.
        // SAFETY: AVX.
        unsafe {
            let mut t = [_mm256_setzero_ps(); 8];
            for k in 0..4 {
                t[2 * k] = _mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]);
                t[2 * k + 1] = _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]);
            }
            let mut u = [_mm256_setzero_ps(); 8];
            for k in 0..2 {
                let (b, c) = (4 * k, 4 * k + 2);
                u[b] = _mm256_shuffle_ps::<0b01_00_01_00>(t[b], t[c]);
                u[b + 1] = _mm256_shuffle_ps::<0b11_10_11_10>(t[b], t[c]);
                u[b + 2] = _mm256_shuffle_ps::<0b01_00_01_00>(t[b + 1], t[c + 1]);
                u[b + 3] = _mm256_shuffle_ps::<0b11_10_11_10>(t[b + 1], t[c + 1]);
            }
            for j in 0..4 {
                a[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]);
                a[4 + j] = _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]);
            }
        }
    }
    #[inline(always)]
    fn hsum(self, a: __m256) -> f32 {
        // SAFETY: AVX and SSE3.
        unsafe {
            let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
            let x = _mm_add_ss(x, _mm_movehdup_ps(x));
            _mm_cvtss_f32(x)
        }
    }

    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> __m256 {
        // SAFETY: the caller's contract (8 floats); AVX.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m256) {
        // SAFETY: the caller's contract (8 floats); AVX.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_i(self, p: *const f32) -> __m256i {
        // SAFETY: the caller's contract (8 floats); AVX.
        unsafe { _mm256_castps_si256(_mm256_loadu_ps(p)) }
    }
    #[inline(always)]
    unsafe fn store_i(self, p: *mut f32, v: __m256i) {
        // SAFETY: the caller's contract (8 floats); AVX.
        unsafe { _mm256_storeu_ps(p, _mm256_castsi256_ps(v)) }
    }
    #[inline(always)]
    unsafe fn bcast(self, p: *const f32) -> __m256 {
        // SAFETY: the caller's contract (one float); AVX.
        unsafe { _mm256_set1_ps(*p) }
    }
    #[inline(always)]
    unsafe fn store_u8_trunc(self, p: *mut u8, v: __m256) {
        // SAFETY: the caller's contract (8 bytes); AVX2.
        unsafe {
            let c = _mm256_cvttps_epi32(v);
            let w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
            _mm_storel_epi64(p as *mut __m128i, _mm_packus_epi16(w, w))
        }
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8) -> __m256i {
        // SAFETY: the caller's contract (8 bytes; `_mm_loadl_epi64` reads
        // exactly 8, unaligned); AVX2.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load_u8_dup(self, p: *const u8) -> __m256i {
        // SAFETY: the caller's contract (4 bytes, read unaligned); AVX2.
        unsafe {
            let x = _mm_cvtsi32_si128((p as *const i32).read_unaligned());
            _mm256_cvtepu8_epi32(_mm_unpacklo_epi32(x, x))
        }
    }
    #[inline(always)]
    unsafe fn load_u16(self, p: *const u8) -> __m256i {
        // SAFETY: the caller's contract (16 bytes, unaligned load); AVX2.
        unsafe { _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load_u16_dup(self, p: *const u8) -> __m256i {
        // SAFETY: the caller's contract (8 bytes, read unaligned); AVX2.
        unsafe {
            let x = _mm_set1_epi64x((p as *const i64).read_unaligned());
            _mm256_cvtepu16_epi32(x)
        }
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u8) -> __m256 {
        // SAFETY: the caller's contract (16 bytes, unaligned); F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load_bf16(self, p: *const u8) -> __m256 {
        // SAFETY: the caller's contract (16 bytes, unaligned); AVX2.
        // A bfloat16 is the high half of the f32 with the same bits.
        unsafe {
            let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
        }
    }
    #[inline(always)]
    unsafe fn load_f32_bytes(self, p: *const u8) -> __m256 {
        // SAFETY: the caller's contract (32 bytes); `loadu` has no
        // alignment requirement; AVX.
        unsafe { _mm256_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn gather_pairs(self, base: *const f32, idx: __m256i) -> (__m256, __m256) {
        // SAFETY: the caller's contract (both floats of every lane's pair
        // readable; a gather has no alignment requirement); AVX2.
        unsafe {
            let f = base as *const f64;
            let x0 = _mm256_castpd_ps(_mm256_i32gather_pd::<8>(f, _mm256_castsi256_si128(idx)));
            let x1 = _mm256_castpd_ps(_mm256_i32gather_pd::<8>(
                f,
                _mm256_extracti128_si256::<1>(idx),
            ));
            // Per 128-bit half `[e0 e1 e4 e5 | e2 e3 e6 e7]`, then the
            // 64-bit quarters in order.
            let order = |v: __m256| {
                _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)))
            };
            (
                order(_mm256_shuffle_ps::<0b10_00_10_00>(x0, x1)),
                order(_mm256_shuffle_ps::<0b11_01_11_01>(x0, x1)),
            )
        }
    }
}
