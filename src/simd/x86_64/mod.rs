//! x86-64: the tokens ([`Avx2`], [`Avx512`], [`Avx512Vnni`]), the CPU's
//! features read once ([`Cpu`]), and the [`Simd`] vocabulary that `avx2.rs`
//! and `avx512.rs` implement.
//!
//! # Safety architecture
//!
//! The only way to get a token is its `new()`, which returns `None` unless
//! the CPU has every feature the token's instructions use (read once with
//! `is_x86_feature_detected!` and cached); holding one is the proof that
//! calling the `#[target_feature]` code compiled for it is sound. Methods
//! that read memory through raw pointers are `unsafe` and state what they
//! need; the kernels' safe wrappers `assert!` every length their loops
//! rely on before entering them.

mod avx2;
mod avx512;

pub(crate) use avx2::Avx2;
pub(crate) use avx512::Avx512;

use std::sync::atomic::{AtomicU8, Ordering};

/// The CPU features the tokens need, read once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cpu {
    /// AVX2, FMA, F16C.
    pub(crate) on_avx2: bool,
    /// AVX-512F/BW/VL, AVX2, FMA, F16C.
    pub(crate) on_avx512: bool,
    /// AVX-512 VNNI.
    pub(crate) vnni: bool,
}

/// `Cpu` as bits (`1` AVX2, `2` AVX-512, `4` VNNI), `0x80` once read.
static CPU: AtomicU8 = AtomicU8::new(0);

impl Cpu {
    /// The features, read on the first call and cached (an atomic load
    /// afterwards).
    #[inline]
    pub(crate) fn get() -> Cpu {
        let mut bits = CPU.load(Ordering::Relaxed);
        if bits == 0 {
            let c = Cpu::read();
            bits = 0x80 | c.on_avx2 as u8 | (c.on_avx512 as u8) << 1 | (c.vnni as u8) << 2;
            CPU.store(bits, Ordering::Relaxed);
        }
        Cpu {
            on_avx2: bits & 1 != 0,
            on_avx512: bits & 2 != 0,
            vnni: bits & 4 != 0,
        }
    }
}

/// Proof that the CPU has AVX-512F/BW/VL, VNNI, AVX2, FMA and F16C (see
/// [`Avx512Vnni::new`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512Vnni(pub(crate) Avx512);

impl Avx512Vnni {
    /// `Some` only when the CPU has every feature of [`Avx512`] and VNNI.
    #[inline]
    pub(crate) fn new() -> Option<Avx512Vnni> {
        let base = Avx512::new()?;
        Cpu::get().vnni.then_some(Avx512Vnni(base))
    }
}

/// Cephes `expf`: range limits, `ln 2` split for the reduction, and the
/// polynomial for `e^r - 1 - r` on `|r| ≤ ln(2)/2`.
pub(crate) mod expc {
    pub(crate) const LO: f32 = -87.336_55;
    pub(crate) const HI: f32 = 88.376_26;
    pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub(crate) const C1: f32 = 0.693_359_4;
    pub(crate) const C2: f32 = -2.121_944_4e-4;
    pub(crate) const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
}

/// The vector vocabulary the SIMD kernels are written in, once, generically.
///
/// Arithmetic takes `self` (the token) and is safe; memory access takes raw
/// pointers and is `unsafe`, with the contract that the pointer is valid
/// for the bytes named in the method's doc.
///
/// # Safety
/// An implementor is a token: a value of it may exist only on a CPU that
/// supports every instruction its methods use.
pub(crate) unsafe trait Simd: Copy {
    /// `f32` lanes per vector (8 or 16).
    const L: usize;
    /// Tokens per tile; equals `L` so one tile's scores fill one vector.
    const T: usize = Self::L;

    /// This token as an [`Avx512`] one, where it is one (for the few loops
    /// that have an AVX-512-only version).
    #[inline(always)]
    fn avx512(self) -> Option<Avx512> {
        None
    }
    /// Vector registers the ISA has (16 with AVX2, 32 with AVX-512).
    const REGS: usize;
    /// A vector of `L` floats.
    type F: Copy;
    /// A vector of `L` 32-bit integers.
    type I: Copy;
    /// Per-call constants of [`Simd::code3_bytes`].
    type C3: Copy;
    /// A 16-entry `f32` table held in registers, for [`Simd::lut16`].
    type T16: Copy;

    /// All lanes zero.
    fn zero(self) -> Self::F;
    /// `x` in every lane.
    fn splat(self, x: f32) -> Self::F;
    /// `a + b`.
    fn add(self, a: Self::F, b: Self::F) -> Self::F;
    /// `a - b`.
    fn sub(self, a: Self::F, b: Self::F) -> Self::F;
    /// Lanewise maximum, `a > b ? a : b`.
    fn max(self, a: Self::F, b: Self::F) -> Self::F;
    /// Lanewise minimum, `a < b ? a : b`.
    fn min(self, a: Self::F, b: Self::F) -> Self::F;
    /// The smallest lane.
    fn hmin(self, a: Self::F) -> f32;
    /// `acc` ORed with the bits of `v − v`: nonzero exactly in the lanes
    /// where `v` is NaN or ±inf.
    fn or_nonfinite(self, acc: Self::I, v: Self::F) -> Self::I;
    /// Whether any bit of `v` is set.
    fn any(self, v: Self::I) -> bool;
    /// All bits zero.
    fn zero_i(self) -> Self::I;
    /// `e^x` lanewise, within 2 ulp for `x ≥ -87.3` (Cephes' `expf`
    /// reduction and polynomial); `0` below (where `e^x` is subnormal or 0).
    fn exp(self, x: Self::F) -> Self::F;
    /// The largest lane.
    fn hmax(self, a: Self::F) -> f32;
    /// `a · b`.
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    /// `a · b + c`, one rounding.
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// Integers to floats (exact for codes).
    fn cvt(self, v: Self::I) -> Self::F;
    /// `(v & (2^P − 1))` as floats, for `P ≤ 4`; the backends use a table
    /// permute where the ISA's permute indexes enough entries (no mask
    /// and no convert needed).
    fn field_f32<const P: u32>(self, v: Self::I) -> Self::F;
    /// `((v >> SH) & (2^P − 1))` as floats, for `SH + P ≤ 4`: a field of
    /// the low nibble. Where the permute indexes 16 entries this is one
    /// table lookup (no shift, mask or convert), so the two fields of a
    /// nibble cost no more than its low one.
    fn field_at_f32<const P: u32, const SH: u32>(self, v: Self::I) -> Self::F;
    /// `v & ((2^P − 1) << SH)` as floats, for `SH + P ≤ 8` and lanes that
    /// hold one byte: a field of the byte in place (`2^SH` times its value).
    /// AVX-512 looks fields of up to 2 bits up in a 16-entry table (those
    /// of the high nibble after one shift, which the fields share); the
    /// rest mask and convert.
    #[inline(always)]
    fn in_place_f32<const P: u32, const SH: u32>(self, v: Self::I) -> Self::F {
        self.cvt(self.shr_mask(v, 0, ((1 << P) - 1) << SH))
    }
    /// Lane `l` of the result is lane `idx[l]` of `table` (`idx[l] < L`).
    fn permute(self, table: Self::F, idx: Self::I) -> Self::F;
    /// The 16 entries of `t` in registers.
    fn table16(self, t: &[f32; 16]) -> Self::T16;
    /// Lane `l` of the result is `t[idx[l]]` (`idx[l] < 16`): a codebook
    /// lookup, one permute on AVX-512, two and a blend on AVX2.
    fn lut16(self, t: Self::T16, idx: Self::I) -> Self::F;
    /// [`lut16`](Self::lut16) of a table whose entries repeat every eight
    /// (`t[i] = t[i mod 8]`, as the 2- and 3-bit codebook tables are
    /// stored): any index, one permute on either ISA.
    fn lut8(self, t: Self::T16, idx: Self::I) -> Self::F;
    /// Every entry of `t` times `c` (the same in every lane).
    fn scale16(self, t: Self::T16, c: Self::F) -> Self::T16;
    /// `(v >> s) & mask` for `s ≥ 0`, `(v << -s) & mask` for `s < 0`.
    fn shr_mask(self, v: Self::I, s: i32, mask: u32) -> Self::I;
    /// `((v >> a) & mask) << sh` in the low half of the lanes and
    /// `((v >> b) & mask) << sh` in the high half.
    fn shr_pair_mask(self, v: Self::I, a: u32, b: u32, mask: u32, sh: u32) -> Self::I;
    /// Bitwise or.
    fn or(self, a: Self::I, b: Self::I) -> Self::I;
    /// `a + b` lanewise, wrapping.
    fn add_i(self, a: Self::I, b: Self::I) -> Self::I;
    /// `x` in every lane.
    fn splat_i(self, x: u32) -> Self::I;
    /// Bitwise `(a & m) | (b & !m)`, `m` in every lane.
    fn select(self, m: u32, a: Self::I, b: Self::I) -> Self::I;
    /// The lanes' bits read as floats (no conversion).
    fn bits_f32(self, v: Self::I) -> Self::F;
    /// The constants of [`Simd::code3_bytes`] for rows of `hd` channels,
    /// or `None` where this ISA unpacks 3-bit rows vector by vector.
    fn code3_consts(self, hd: usize) -> Option<Self::C3>;
    /// Write the `hd` codes of a 3-bit row (two planes, see
    /// [`crate::pack`]) to `out` as bytes, so the vector loops read them
    /// as 8-bit codes: a few whole-register byte operations per 64 codes
    /// instead of a shift, mask and merge per vector of each plane.
    ///
    /// # Safety
    /// `row` valid for `3·hd/8` bytes, `out` for `hd`; `c` made by
    /// `code3_consts(hd)`.
    unsafe fn code3_bytes(self, c: &Self::C3, row: *const u8, hd: usize, out: *mut u8);
    /// Lane `t` (for `t < T`) of the result is the sum of all lanes of
    /// `acc[t]`; `acc[T..]` are ignored.
    fn reduce(self, acc: &[Self::F; 16]) -> Self::F;
    /// Transposes the `L × L` block in `a[..L]`: lane `j` of `a[i]` moves
    /// to lane `i` of `a[j]`; `a[L..]` are left as they are.
    fn transpose(self, a: &mut [Self::F; 16]);
    /// The sum of all lanes.
    fn hsum(self, a: Self::F) -> f32;

    /// Load `L` floats.
    /// # Safety
    /// `p` valid for reading `L` floats.
    unsafe fn load(self, p: *const f32) -> Self::F;
    /// Truncate `L` lanes (each in `[0, 256)`) toward zero and store them
    /// as `L` bytes.
    /// # Safety
    /// `p` valid for writing `L` bytes.
    unsafe fn store_u8_trunc(self, p: *mut u8, v: Self::F);
    /// Store `L` floats.
    /// # Safety
    /// `p` valid for writing `L` floats.
    unsafe fn store(self, p: *mut f32, v: Self::F);
    /// Load `L` 32-bit integers (stored in a float scratch).
    /// # Safety
    /// `p` valid for reading `L` floats.
    unsafe fn load_i(self, p: *const f32) -> Self::I;
    /// Store `L` 32-bit integers into a float scratch.
    /// # Safety
    /// `p` valid for writing `L` floats.
    unsafe fn store_i(self, p: *mut f32, v: Self::I);
    /// `*p` in every lane.
    /// # Safety
    /// `p` valid for reading one float.
    unsafe fn bcast(self, p: *const f32) -> Self::F;
    /// `L` bytes, zero-extended to 32-bit lanes.
    /// # Safety
    /// `p` valid for reading `L` bytes.
    unsafe fn load_u8(self, p: *const u8) -> Self::I;
    /// `L/2` bytes, zero-extended, in both halves of the lanes.
    /// # Safety
    /// `p` valid for reading `L/2` bytes.
    unsafe fn load_u8_dup(self, p: *const u8) -> Self::I;
    /// `L` little-endian `u16`s, zero-extended to 32-bit lanes.
    /// # Safety
    /// `p` valid for reading `2·L` bytes.
    unsafe fn load_u16(self, p: *const u8) -> Self::I;
    /// `L/2` little-endian `u16`s, zero-extended, in both halves of the
    /// lanes.
    /// # Safety
    /// `p` valid for reading `L` bytes.
    unsafe fn load_u16_dup(self, p: *const u8) -> Self::I;
    /// `L` little-endian IEEE halves, widened.
    /// # Safety
    /// `p` valid for reading `2·L` bytes (any alignment).
    unsafe fn load_f16(self, p: *const u8) -> Self::F;
    /// `L` little-endian bfloat16s, widened.
    /// # Safety
    /// `p` valid for reading `2·L` bytes (any alignment).
    unsafe fn load_bf16(self, p: *const u8) -> Self::F;
    /// `L` little-endian f32s at any alignment.
    /// # Safety
    /// `p` valid for reading `4·L` bytes.
    unsafe fn load_f32_bytes(self, p: *const u8) -> Self::F;
    /// Lane `l` of the results is `(base[2·idx[l]], base[2·idx[l] + 1])`
    /// (indices as signed 32-bit integers): a gather of two tables
    /// interleaved, both entries of a lane fetched by one 64-bit element
    /// (half the elements of a gather per table).
    /// # Safety
    /// `base.offset(2·idx[l])` valid for reading two floats for every lane.
    unsafe fn gather_pairs(self, base: *const f32, idx: Self::I) -> (Self::F, Self::F);
}

#[cfg(test)]
mod tests {
    use super::{Avx2, Avx512, Simd};

    /// The lanes of an integer vector.
    fn lanes<S: Simd>(s: S, v: S::I) -> Vec<u32> {
        let mut out = [0f32; 16];
        // SAFETY: `out` holds 16 ≥ L floats.
        unsafe { s.store_i(out.as_mut_ptr(), v) };
        out[..S::L].iter().map(|f| f.to_bits()).collect()
    }

    /// The `u16` loads and the bitwise select against their scalar
    /// definitions, on odd bytes and masks.
    fn widen_and_select<S: Simd>(s: S) {
        let bytes: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
        let word = |k: usize| u16::from_le_bytes([bytes[2 * k], bytes[2 * k + 1]]) as u32;
        // SAFETY: `bytes` holds 64 ≥ 2·L bytes.
        let (a, d) = unsafe { (s.load_u16(bytes.as_ptr()), s.load_u16_dup(bytes.as_ptr())) };
        let want: Vec<u32> = (0..S::L).map(word).collect();
        assert_eq!(lanes(s, a), want, "load_u16");
        let want: Vec<u32> = (0..S::L).map(|l| word(l % (S::L / 2))).collect();
        assert_eq!(lanes(s, d), want, "load_u16_dup");
        // SAFETY: as above.
        let b = unsafe { s.load_u16(bytes.as_ptr().add(2 * S::L)) };
        let m = 0xCCCC_3333u32;
        let (la, lb) = (lanes(s, a), lanes(s, b));
        let want: Vec<u32> = (0..S::L).map(|l| (la[l] & m) | (lb[l] & !m)).collect();
        assert_eq!(lanes(s, s.select(m, a, b)), want, "select");
        // A scaled table looks up the products of its entries.
        let t: [f32; 16] = std::array::from_fn(|k| k as f32 * 0.37 - 2.1);
        let c = 1.0 / 3.0;
        let idx: Vec<u8> = (0..S::L).map(|l| (l * 7 % 16) as u8).collect();
        // SAFETY: `idx` holds `L` bytes.
        let got = s.lut16(s.scale16(s.table16(&t), s.splat(c)), unsafe {
            s.load_u8(idx.as_ptr())
        });
        let mut out = [0f32; 16];
        // SAFETY: `out` holds 16 ≥ L floats.
        unsafe { s.store(out.as_mut_ptr(), got) };
        for (l, &i) in idx.iter().enumerate() {
            assert_eq!(out[l].to_bits(), (t[i as usize] * c).to_bits(), "scale16");
        }
        // The fields of a nibble, from lanes whose higher bits are set too.
        let all: Vec<u8> = (0..S::L).map(|l| (l * 53 + 201) as u8).collect();
        // SAFETY: `all` holds `L` bytes.
        let v = unsafe { s.load_u8(all.as_ptr()) };
        let fields: [(u32, u32, S::F); 7] = [
            (1, 0, s.field_at_f32::<1, 0>(v)),
            (1, 1, s.field_at_f32::<1, 1>(v)),
            (1, 3, s.field_at_f32::<1, 3>(v)),
            (2, 0, s.field_at_f32::<2, 0>(v)),
            (2, 2, s.field_at_f32::<2, 2>(v)),
            (3, 1, s.field_at_f32::<3, 1>(v)),
            (4, 0, s.field_at_f32::<4, 0>(v)),
        ];
        // Fields in place, for every byte value.
        let bytes: Vec<u8> = (0..=255).collect();
        for chunk in bytes.chunks_exact(S::L) {
            // SAFETY: `chunk` holds `L` bytes.
            let v = unsafe { s.load_u8(chunk.as_ptr()) };
            let in_place: [(u32, u32, S::F); 8] = [
                (2, 0, s.in_place_f32::<2, 0>(v)),
                (2, 2, s.in_place_f32::<2, 2>(v)),
                (2, 4, s.in_place_f32::<2, 4>(v)),
                (2, 6, s.in_place_f32::<2, 6>(v)),
                (4, 0, s.in_place_f32::<4, 0>(v)),
                (4, 4, s.in_place_f32::<4, 4>(v)),
                (3, 3, s.in_place_f32::<3, 3>(v)),
                (1, 7, s.in_place_f32::<1, 7>(v)),
            ];
            for (p, sh, got) in in_place {
                // SAFETY: `out` holds 16 ≥ L floats.
                unsafe { s.store(out.as_mut_ptr(), got) };
                for (l, &b) in chunk.iter().enumerate() {
                    let want = (b as u32 & (((1 << p) - 1) << sh)) as f32;
                    assert_eq!(out[l], want, "in_place_f32::<{p}, {sh}> of {b}");
                }
            }
        }
        for (p, sh, got) in fields {
            // SAFETY: `out` holds 16 ≥ L floats.
            unsafe { s.store(out.as_mut_ptr(), got) };
            for (l, &b) in all.iter().enumerate() {
                let want = ((b as u32 >> sh) & ((1 << p) - 1)) as f32;
                assert_eq!(out[l], want, "field_at_f32::<{p}, {sh}> of {b}");
            }
        }
        // Wrapping adds, splats and gathers at signed offsets.
        let sum = s.add_i(a, s.splat_i(u32::MAX - 5));
        let want: Vec<u32> = la.iter().map(|&x| x.wrapping_sub(6)).collect();
        assert_eq!(lanes(s, sum), want, "add_i, splat_i");
        let back: Vec<i32> = (0..S::L as i32).map(|l| -(l * 3 % 20)).collect();
        // Pairs at signed offsets: lane `l` reads floats `40 + 2·back[l]`
        // and the next.
        let table: Vec<f32> = (0..42).map(|k| k as f32 * 0.75 + 3.0).collect();
        let base = table.as_ptr().wrapping_add(40);
        let mut odd = [0f32; 16];
        // SAFETY: every `40 + 2·back[l]` (in `2..=40`) and the float after
        // it index `table`; `out` and `odd` hold 16 ≥ L floats.
        unsafe {
            let idx = s.load_i(back.as_ptr() as *const f32);
            let (e, o) = s.gather_pairs(base, idx);
            s.store(out.as_mut_ptr(), e);
            s.store(odd.as_mut_ptr(), o);
        }
        for (l, &b) in back.iter().enumerate() {
            let k = (40 + 2 * b) as usize;
            assert_eq!((out[l], odd[l]), (table[k], table[k + 1]), "gather_pairs");
        }
    }

    #[test]
    fn u16_loads_select_scaled_tables_fields_adds_and_gathers_match_their_definitions() {
        let mut ran = false;
        if let Some(s) = Avx2::new() {
            widen_and_select(s);
            ran = true;
        }
        match Avx512::new() {
            Some(s) => widen_and_select(s),
            None => println!("AVX-512 part skipped: this CPU has no AVX-512"),
        }
        if !ran {
            println!("AVX2 part skipped: this CPU has no AVX2");
        }
    }
}
