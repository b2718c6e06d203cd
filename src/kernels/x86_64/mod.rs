//! x86-64 kernels: AVX2+FMA+F16C ([`avx2`]) and AVX-512F/BW/VL
//! ([`avx512`]), both written once, generically, in [`tile`] over the small
//! [`Simd`] vocabulary that each of the two files implements.
//! [`quantize`] compiles the quantizer's driver for both and gives it
//! vector loops over the same vocabulary.
//!
//! # How a kernel runs
//!
//! Tokens are processed in *tiles* of `Simd::T` tokens (8 with AVX2, 16
//! with AVX-512; one tile's scores fill exactly one vector):
//!
//! 1. **Unpack** the tile's code rows into a small, 64-byte-aligned f32
//!    scratch in L1 (`T × head_dim` floats). The plane layout of
//!    [`pack`](crate::pack) makes this one zero-extending load, one shift and
//!    one mask per 16 (8) codes: field `f` of `m` consecutive bytes is `m`
//!    consecutive elements. Per-token schemes are dequantized here
//!    (`x = fma(code, scale, zero)`, one rounding), so every query that
//!    shares the KV head reuses the same floats.
//! 2. **Math** over the scratch, chunk-outer and token-inner: scores keep
//!    one accumulator per token of the tile and reduce all `T` of them at
//!    once with a transpose-and-add (about 3 shuffles per token instead of a
//!    full horizontal sum each); weighted sums keep one broadcast weight per
//!    token in registers and four partial sums per chunk.
//!
//! All arithmetic is `f32` with FMA; no query is rounded to a narrower type.
//!
//! # Safety architecture
//!
//! The only way to get an [`Avx2`] or [`Avx512`] value is `new()`, which
//! returns `None` unless `is_x86_feature_detected!` confirms every feature
//! the file's instructions use; the values are tokens, and holding one is
//! the proof that calling the `#[target_feature]` functions is sound. The
//! safe methods on the tokens `assert!` every length the raw-pointer loops
//! rely on before entering them.

/// Call `$f::<BITS, HD>$args` for the head's width and dimension: the
/// listed `(BITS, HD)` shapes get a compile-time shape (fully unrolled
/// rows held in registers, the fused kernels); every other shape runs one
/// instance compiled for any width and dimension (`BITS = 0, HD = 0`: both
/// read at run time, the tile-buffer kernels). A compile-time shape costs
/// tens of KiB of machine code per kernel and backend and seconds of build
/// time, so the backends list only the shapes where a benchmark shows the
/// fused kernels pay (see `docs/PERFORMANCE.md`).
macro_rules! by_shape {
    ([$(($b:literal, $hd:literal)),*], $f:ident, $head:expr, $args:tt) => {{
        let l = $head.layout();
        match (l.scheme().bits(), l.head_dim()) {
            $(($b, $hd) => $f::<$b, $hd> $args,)*
            _ => $f::<0, 0> $args,
        }
    }};
}

/// Cephes `expf`: range limits, `ln 2` split for the reduction, and the
/// polynomial for `e^r - 1 - r` on `|r| ≤ ln(2)/2`.
pub(super) mod expc {
    pub const LO: f32 = -87.336_55;
    pub const HI: f32 = 88.376_26;
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const C1: f32 = 0.693_359_4;
    pub const C2: f32 = -2.121_944_4e-4;
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
}

mod avx2;
mod avx512;
mod avx512_vnni;
mod quantize;
mod tile;

pub(crate) use avx2::Avx2;
pub(crate) use avx512::Avx512;
pub(crate) use avx512_vnni::Avx512Vnni;
pub(crate) use tile::DenseElem;

use crate::scheme::Axis;
use crate::store::PackedHead;

/// The vector vocabulary the generic kernels in [`tile`] are written in.
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
    /// Vector registers the ISA has (16 with AVX2, 32 with AVX-512).
    const REGS: usize;
    /// A vector of `L` floats.
    type F: Copy;
    /// A vector of `L` 32-bit integers.
    type I: Copy;
    /// Per-call constants of [`Simd::code3_bytes`].
    type C3: Copy;

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
    /// Lane `l` of the result is lane `idx[l]` of `table` (`idx[l] < L`).
    fn permute(self, table: Self::F, idx: Self::I) -> Self::F;
    /// `(v >> s) & mask` for `s ≥ 0`, `(v << -s) & mask` for `s < 0`.
    fn shr_mask(self, v: Self::I, s: i32, mask: u32) -> Self::I;
    /// `((v >> a) & mask) << sh` in the low half of the lanes and
    /// `((v >> b) & mask) << sh` in the high half.
    fn shr_pair_mask(self, v: Self::I, a: u32, b: u32, mask: u32, sh: u32) -> Self::I;
    /// Bitwise or.
    fn or(self, a: Self::I, b: Self::I) -> Self::I;
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
}

/// Assert every length the packed kernels' raw loops rely on: `q_len`
/// (scores) or `out_len` (weighted sum) is `n_q · head_dim`, `other` is
/// `n_q · tokens`, and the head's buffers hold its tokens. Returns `n_q`.
#[track_caller]
pub(super) fn check_head(head: &PackedHead<'_>, per_query_hd: usize, per_query_t: usize) -> usize {
    let l = head.layout();
    let hd = l.head_dim();
    let t = head.tokens();
    assert!(
        hd > 0 && per_query_hd > 0 && per_query_hd.is_multiple_of(hd),
        "kernels: queries must be a positive multiple of head_dim"
    );
    let nq = per_query_hd / hd;
    assert_eq!(
        per_query_t,
        nq * t,
        "kernels: per-token buffer must be n_q·tokens"
    );
    assert!(
        head.codes().len() >= l.head_code_bytes(t),
        "kernels: code rows shorter than the layout"
    );
    let set = head.set_len() * l.scheme().param_bytes();
    let sets = match l.scheme().axis() {
        Axis::PerToken => t,
        Axis::PerChannel => t.div_ceil(l.group_len()),
    };
    assert!(
        head.params().len() >= sets * set,
        "kernels: params shorter than the layout"
    );
    nq
}
