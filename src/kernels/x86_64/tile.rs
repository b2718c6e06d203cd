//! The kernels, written once over [`Simd`] and compiled twice (inside the
//! `#[target_feature]` entry points of `avx2.rs` and `avx512.rs`, into
//! which everything here is `#[inline(always)]`).
//!
//! See the [module docs](super) for the tile scheme. Raw pointers are only
//! used inside a tile, after the safe wrappers asserted the head's lengths
//! ([`super::check_head`]) and the tile's extent was checked against them.

use super::Simd;
use crate::pack;
use crate::scheme::{Axis, Mode, ScaleFormat};
use crate::store::PackedHead;
use half::f16;

/// `for $j in $lo..$hi { $body }`, fully unrolled into exactly `$n`
/// guarded copies (`$n` is 2, 4, 8, 16 or 32 and bounds `$hi − $lo`): the
/// bounds are compile-time constants wherever this is used, so every `if`
/// folds, every index into a register array is a constant and the array
/// stays in registers (LLVM will not unroll 16 iterations of a large body
/// by itself). Each site asks for the smallest `$n` its loop needs: the
/// copies are generated before they fold, and nested sites multiply.
macro_rules! unroll {
    // `$cap` a constant expression bounding `$hi − $lo` (at most 32): the
    // fewest copies that cover it, chosen at compile time (the other
    // ladders' copies are never emitted).
    (cap = $cap:expr; $j:ident in $lo:expr, $hi:expr => $body:block) => {{
        if const { $cap <= 2 } {
            unroll!(2; $j in $lo, $hi => $body)
        } else if const { $cap <= 4 } {
            unroll!(4; $j in $lo, $hi => $body)
        } else if const { $cap <= 8 } {
            unroll!(8; $j in $lo, $hi => $body)
        } else if const { $cap <= 16 } {
            unroll!(16; $j in $lo, $hi => $body)
        } else {
            unroll!(32; $j in $lo, $hi => $body)
        }
    }};
    ($n:tt; $j:ident in $lo:expr, $hi:expr => $body:block) => {{
        let (lo, hi): (usize, usize) = ($lo, $hi);
        assert!(hi <= lo + $n, "unroll: more iterations than copies");
        unroll!(@n $n, lo, hi, $j, $body);
    }};
    (@n 2, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1)
    };
    (@n 4, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3)
    };
    (@n 8, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3 4 5 6 7)
    };
    (@n 16, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@n 32, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@go $lo:ident, $hi:ident, $j:ident, $body:block, $($k:literal)*) => {
        $( if $lo + $k < $hi { let $j: usize = $lo + $k; $body } )*
    };
}

/// How many tokens ahead of the tile being computed the kernels ask for
/// the code and parameter streams. Decode streams the cache from DRAM and
/// the hardware prefetchers stop at every 4 KiB page; a software prefetch
/// this far ahead (4 KiB of codes for 4-bit rows of 128) keeps the next
/// pages in flight while the current tile is computed (measured in
/// `docs/PERFORMANCE.md`).
pub(super) const PREFETCH_TOKENS: usize = 64;

/// How far ahead the dense baselines ask for their rows, into L2
/// (`prefetcht1`). The dense kernels' compute per byte is light, so they
/// need more bytes in flight than the packed ones: on the AMD EPYC (Zen 4)
/// development VM this is ≈1.2x faster than [`PREFETCH_TOKENS`] into L1,
/// and on the earlier Ice Lake VM an L2 hint and twice the distance each
/// measured the same as before (`docs/PERFORMANCE.md`, session 9). A
/// baseline that streams slower than it could would flatter the packed
/// kernels.
pub(super) const DENSE_PREFETCH_TOKENS: usize = 128;

/// Hint the cache lines covering `len` bytes from `p` into L1/L2.
///
/// A prefetch never faults, so `p` may point anywhere (the address is
/// formed with `wrapping_add` and only used as a hint).
#[inline(always)]
pub(super) fn prefetch(p: *const u8, len: usize) {
    prefetch_to::<{ core::arch::x86_64::_MM_HINT_T0 }>(p, len);
}

/// [`prefetch`] with the hint `H` (`_MM_HINT_T0` into L1, `_MM_HINT_T1`
/// into L2).
#[inline(always)]
fn prefetch_to<const H: i32>(p: *const u8, len: usize) {
    let mut o = 0;
    while o < len + 63 {
        // SAFETY: a prefetch is a hint: it reads nothing into the program
        // and never faults, whatever the address (SSE, baseline on x86-64).
        unsafe { core::arch::x86_64::_mm_prefetch::<H>(p.wrapping_add(o) as *const i8) };
        o += 64;
    }
}

/// Prefetch the stream `base` of `per` bytes per token for the `n` tokens
/// [`PREFETCH_TOKENS`] after token `t0`.
#[inline(always)]
pub(super) fn prefetch_ahead(base: *const u8, per: usize, t0: usize, n: usize) {
    prefetch(base.wrapping_add((t0 + PREFETCH_TOKENS) * per), n * per);
}

/// One stream's prefetch spread over a tile's tokens: token `tt` asks for
/// the lines that start within its bytes [`PREFETCH_TOKENS`] ahead, so the
/// requests go out one or two per token between the vector work instead
/// of as a burst at the tile's start (measured faster, most for the dense
/// f16 kernels: `docs/PERFORMANCE.md`, session 7).
#[derive(Clone, Copy)]
pub(super) struct Ahead {
    p: *const u8,
    per: usize,
}

impl Ahead {
    /// No stream.
    pub(super) const NONE: Ahead = Ahead {
        p: core::ptr::null(),
        per: 0,
    };

    /// The stream `base` of `per` bytes per token, for the tile at `t0`.
    #[inline(always)]
    pub(super) fn new(base: *const u8, per: usize, t0: usize) -> Ahead {
        Ahead {
            p: base.wrapping_add((t0 + PREFETCH_TOKENS) * per),
            per,
        }
    }

    /// Prefetch token `tt`'s bytes: one line per 64 bytes from its start
    /// (whole lines for a multiple of 64 bytes per token; a shorter token
    /// asks for its line again, which costs one load slot).
    #[inline(always)]
    pub(super) fn token(self, tt: usize) {
        self.token_to::<{ core::arch::x86_64::_MM_HINT_T0 }>(tt);
    }

    /// [`Ahead::token`] with the hint `H`.
    #[inline(always)]
    fn token_to<const H: i32>(self, tt: usize) {
        let a = self.p.wrapping_add(tt * self.per);
        let mut o = 0;
        while o < self.per {
            // SAFETY: a prefetch is a hint: it reads nothing into the
            // program and never faults, whatever the address.
            unsafe { core::arch::x86_64::_mm_prefetch::<H>(a.wrapping_add(o) as *const i8) };
            o += 64;
        }
    }
}

/// The prefetch of a per-channel kernel, whose params come as one set per
/// block of `gl` tokens: spread over the tokens like the codes (the params
/// as `set/gl` bytes per token) when the set divides evenly and the kernel
/// calls [`Ahead::token`], otherwise one set per block and each tile's
/// codes as a burst.
#[derive(Clone, Copy)]
pub(super) struct BlockAhead {
    codes: *const u8,
    rb: usize,
    params: *const u8,
    set: usize,
    gl: usize,
    spread: bool,
}

impl BlockAhead {
    /// For `head`; `per_token`: the kernel calls [`Ahead::token`].
    #[inline(always)]
    pub(super) fn new(head: &PackedHead<'_>, per_token: bool) -> BlockAhead {
        let l = head.layout();
        let (set, gl) = (head.set_len() * l.scheme().param_bytes(), l.group_len());
        BlockAhead {
            codes: head.codes().as_ptr(),
            rb: l.row_bytes(),
            params: head.params().as_ptr(),
            set,
            gl,
            spread: per_token && set.is_multiple_of(gl),
        }
    }

    /// At the start of block `k`.
    #[inline(always)]
    pub(super) fn block(&self, k: usize) {
        if !self.spread {
            let ahead = k + PREFETCH_TOKENS.div_ceil(self.gl);
            prefetch(self.params.wrapping_add(ahead * self.set), self.set);
        }
    }

    /// For the tile of `n` tokens at `t0`: the per-token streams, or
    /// (after a burst of the codes) none.
    #[inline(always)]
    pub(super) fn tile(&self, t0: usize, n: usize) -> [Ahead; 2] {
        if self.spread {
            [
                Ahead::new(self.codes, self.rb, t0),
                Ahead::new(self.params, self.set / self.gl, t0),
            ]
        } else {
            prefetch_ahead(self.codes, self.rb, t0, n);
            [Ahead::NONE; 2]
        }
    }
}

/// A zeroed `f32` buffer whose start is 64-byte aligned (whole cache lines,
/// so a 512-bit load never splits one).
pub(super) struct Buf {
    v: Vec<f32>,
    off: usize,
    len: usize,
}

impl Buf {
    pub(super) fn new(len: usize) -> Buf {
        let v = vec![0f32; len + 16];
        // An f32 pointer is at most 15 elements from a 64-byte boundary.
        let off = v.as_ptr().align_offset(64).min(16);
        Buf { v, off, len }
    }
    #[inline(always)]
    pub(super) fn s(&self) -> &[f32] {
        &self.v[self.off..self.off + self.len]
    }
    #[inline(always)]
    pub(super) fn m(&mut self) -> &mut [f32] {
        &mut self.v[self.off..self.off + self.len]
    }
}

/// The shape of one code row as the tile loops see it. Made by
/// [`Geo::new`] with `HD` either the head dimension (a compile-time
/// constant: every loop below unrolls and every branch on the shape folds)
/// or 0 (the run-time fallback for other head dimensions).
#[derive(Clone, Copy)]
struct Geo {
    /// `head_dim`.
    hd: usize,
    /// `head_dim` rounded up to whole vectors.
    hdp: usize,
    /// Vectors per row, `hdp / L`.
    nch: usize,
    /// Bytes per packed row.
    rb: usize,
    /// Every plane of the row splits into whole vectors (or, with 16
    /// lanes, exact half vectors): the shift-and-mask unpack applies.
    fast: bool,
    /// Bits per code (the `B` of the kernel, or the head's width when the
    /// kernel was compiled for any width, `B = 0`).
    bits: u8,
}

impl Geo {
    #[inline(always)]
    fn new<S: Simd, const B: u8, const HD: usize>(hd_rt: usize, bits_rt: u8) -> Geo {
        let hd = if HD > 0 { HD } else { hd_rt };
        let bits = if B > 0 { B } else { bits_rt };
        let hdp = hd.div_ceil(S::L) * S::L;
        // A plane of width p is m = hd·p/8 bytes (see `pack`).
        let ok = |p: usize| {
            let m = hd * p / 8;
            m.is_multiple_of(S::L) || (2 * m == S::L && p < 8)
        };
        let b = bits as usize;
        let fast = if b == 8 {
            ok(8)
        } else {
            (b & 4 == 0 || ok(4)) && (b & 2 == 0 || ok(2)) && (b & 1 == 0 || ok(1))
        };
        Geo {
            hd,
            hdp,
            nch: hdp / S::L,
            rb: hd * b / 8,
            fast,
            bits,
        }
    }
}

/// What the unpack does to a vector of codes before it is stored.
trait Deq<S: Simd>: Copy {
    /// Dequantize (or not) vector `j` of tile row `tt`.
    ///
    /// # Safety
    /// `tt < T` and `j < nch` of the tile the value was built for.
    unsafe fn apply(self, s: S, tt: usize, j: usize, x: S::F) -> S::F;
}

/// Codes as floats, no dequantization.
#[derive(Clone, Copy)]
struct Raw;

impl<S: Simd> Deq<S> for Raw {
    #[inline(always)]
    unsafe fn apply(self, _: S, _: usize, _: usize, x: S::F) -> S::F {
        x
    }
}

/// 3-bit rows transcoded to code bytes a tile at a time
/// ([`Simd::code3_bytes`]), for the fused loops to read as 8-bit rows:
/// a 3-bit code's two plane fields cost a shift, mask and merge per vector
/// each; the transcode does that for 64 codes per register.
struct Tile3<S: Simd> {
    c: S::C3,
    /// `T` rows of `hd` code bytes.
    buf: Vec<u8>,
    hd: usize,
}

impl<S: Simd> Tile3<S> {
    /// `Some` for 3-bit rows when the ISA transcodes rows of `hd`.
    #[inline(always)]
    fn new<const B: u8>(s: S, hd: usize) -> Option<Tile3<S>> {
        let c = if B == 3 {
            s.code3_consts(hd)?
        } else {
            return None;
        };
        Some(Tile3 {
            c,
            buf: vec![0u8; S::T * hd],
            hd,
        })
    }

    /// Transcode rows `0..n` (`rb` bytes apart from `rows`); returns the
    /// tile of `n` rows of `hd` code bytes.
    ///
    /// # Safety
    /// `rows` valid for `n` rows of `rb ≥ 3·hd/8` bytes.
    #[inline(always)]
    unsafe fn load(&mut self, s: S, rows: *const u8, rb: usize, n: usize) -> *const u8 {
        assert!(n <= S::T, "kernels: a tile has at most T rows");
        for t in 0..n {
            // SAFETY: the caller's contract; `buf` holds `T ≥ n` rows of `hd`.
            unsafe {
                s.code3_bytes(
                    &self.c,
                    rows.add(t * rb),
                    self.hd,
                    self.buf.as_mut_ptr().add(t * self.hd),
                )
            };
        }
        self.buf.as_ptr()
    }

    /// The shape of the transcoded rows.
    #[inline(always)]
    fn geo(&self, g: Geo) -> Geo {
        Geo { rb: self.hd, ..g }
    }
}

/// Most vectors a row may have for the per-token fast path.
const MAX_NCH: usize = 32;
/// Floats of padding after a tile's params, so whole-vector reads of a
/// token's groups never leave the buffer.
const PAD: usize = 64;

/// Per-token groups of whole vectors: `x = code·scale_tg + zero_tg`, the
/// scale of token `tt`, group `g` at `sc[tt·stride + g]`, its zero at
/// `ze[tt·stride + g]`, and vector `j` in group `goff[j]`.
#[derive(Clone, Copy)]
struct PerToken {
    sc: *const f32,
    ze: *const f32,
    stride: usize,
    goff: [u32; MAX_NCH],
}

impl<S: Simd> Deq<S> for PerToken {
    #[inline(always)]
    unsafe fn apply(self, s: S, tt: usize, j: usize, x: S::F) -> S::F {
        // SAFETY: `sc`/`ze` hold `T` tokens of `stride` numbers whose
        // groups `goff[j] < gpr` are in bounds (built by `TileParams`).
        unsafe {
            let o = tt * self.stride + self.goff[j] as usize;
            s.fma(x, s.bcast(self.sc.add(o)), s.bcast(self.ze.add(o)))
        }
    }
}

/// Per-channel scales and zeros from `hdp`-float rows,
/// `x_c = code_c·sc_c + ze_c`, the rows advancing by `stride` per tile row (0 for the
/// per-channel params of a block, `hdp` for per-token params expanded to
/// channels when groups do not line up with vectors).
#[derive(Clone, Copy)]
struct Rows {
    sc: *const f32,
    ze: *const f32,
    stride: usize,
}

impl<S: Simd> Deq<S> for Rows {
    #[inline(always)]
    unsafe fn apply(self, s: S, tt: usize, j: usize, x: S::F) -> S::F {
        // SAFETY: both buffers hold row `tt` of `hdp = nch·L` floats.
        unsafe {
            let o = tt * self.stride + j * S::L;
            s.fma(x, s.load(self.sc.add(o)), s.load(self.ze.add(o)))
        }
    }
}

/// Unpack `n ≤ T` code rows starting at `rows` into the scratch, which is
/// vector-major: vector `j` of token `tt` at `(j·T + tt)·L`, so the `T`
/// tokens of a vector are contiguous. Rows `n..T` are zeroed.
///
/// # Safety
/// `rows` valid for `n·rb` bytes; `scr` for `T·hdp` floats; `u8buf` for
/// `hdp` bytes whose bytes `hd..hdp` are zero; `d` built for this tile.
#[inline(always)]
unsafe fn unpack_tile<S: Simd, const B: u8, D: Deq<S>>(
    s: S,
    g: Geo,
    rows: *const u8,
    n: usize,
    scr: *mut f32,
    u8buf: *mut u8,
    d: D,
) {
    for tt in 0..n {
        // SAFETY: row `tt < n` and scratch row `tt < T` are in bounds.
        unsafe {
            let row = rows.add(tt * g.rb);
            let dst = scr.add(tt * S::L);
            if g.fast {
                if B > 0 {
                    unpack_row::<S, B, D>(s, row, g.hd, dst, tt, d);
                } else {
                    unpack_row_any::<S, D>(s, g.bits, row, g.hd, dst, tt, d);
                }
            } else {
                unpack_row_scalar::<S, B, D>(s, g, row, u8buf, dst, tt, d);
            }
        }
    }
    for tt in n..S::T {
        for j in 0..g.nch {
            // SAFETY: scratch row `tt < T`, vector `j < nch`.
            unsafe { s.store(scr.add((j * S::T + tt) * S::L), s.zero()) };
        }
    }
}

/// One row by shift and mask, plane by plane (see [`pack`]): the first
/// plane stores integer codes, later ones OR their bits in, the last one
/// converts, dequantizes and stores floats.
///
/// # Safety
/// `row` valid for the row's bytes, `dst` for the row's vectors; `Geo::fast`.
#[inline(always)]
unsafe fn unpack_row<S: Simd, const B: u8, D: Deq<S>>(
    s: S,
    row: *const u8,
    hd: usize,
    dst: *mut f32,
    tt: usize,
    d: D,
) {
    let (h2, h4, h8) = (hd / 2, hd / 4, hd / 8);
    // SAFETY: the planes of a `B`-bit row are `m = hd·p/8` bytes each,
    // widest first, and together exactly `rb` bytes (see `pack`).
    unsafe {
        match B {
            1 => plane::<S, D, 1, 0, true, true>(s, row, h8, dst, tt, d),
            2 => plane::<S, D, 2, 0, true, true>(s, row, h4, dst, tt, d),
            3 => {
                plane::<S, D, 2, 0, true, false>(s, row, h4, dst, tt, d);
                plane::<S, D, 1, 2, false, true>(s, row.add(h4), h8, dst, tt, d);
            }
            4 => plane::<S, D, 4, 0, true, true>(s, row, h2, dst, tt, d),
            5 => {
                plane::<S, D, 4, 0, true, false>(s, row, h2, dst, tt, d);
                plane::<S, D, 1, 4, false, true>(s, row.add(h2), h8, dst, tt, d);
            }
            6 => {
                plane::<S, D, 4, 0, true, false>(s, row, h2, dst, tt, d);
                plane::<S, D, 2, 4, false, true>(s, row.add(h2), h4, dst, tt, d);
            }
            7 => {
                plane::<S, D, 4, 0, true, false>(s, row, h2, dst, tt, d);
                plane::<S, D, 2, 4, false, false>(s, row.add(h2), h4, dst, tt, d);
                plane::<S, D, 1, 6, false, true>(s, row.add(h2 + h4), h8, dst, tt, d);
            }
            _ => plane::<S, D, 8, 0, true, true>(s, row, hd, dst, tt, d),
        }
    }
}

/// [`unpack_row`] for a width known only at run time: one branch per
/// row picks the width's plane sequence (the kernels compiled for any
/// width, `B = 0`, share one driver instead of one per width).
///
/// # Safety
/// As [`unpack_row`], with `bits` the row's width.
#[inline(always)]
unsafe fn unpack_row_any<S: Simd, D: Deq<S>>(
    s: S,
    bits: u8,
    row: *const u8,
    hd: usize,
    dst: *mut f32,
    tt: usize,
    d: D,
) {
    // SAFETY: the caller's contract, for the width `bits`.
    unsafe {
        match bits {
            1 => unpack_row::<S, 1, D>(s, row, hd, dst, tt, d),
            2 => unpack_row::<S, 2, D>(s, row, hd, dst, tt, d),
            3 => unpack_row::<S, 3, D>(s, row, hd, dst, tt, d),
            4 => unpack_row::<S, 4, D>(s, row, hd, dst, tt, d),
            5 => unpack_row::<S, 5, D>(s, row, hd, dst, tt, d),
            6 => unpack_row::<S, 6, D>(s, row, hd, dst, tt, d),
            7 => unpack_row::<S, 7, D>(s, row, hd, dst, tt, d),
            _ => unpack_row::<S, 8, D>(s, row, hd, dst, tt, d),
        }
    }
}

/// One plane of width `P` holding code bits `SH..SH+P`, `m` bytes at
/// `src`. Field `f` of byte `b` is element `f·m + b`, so one load of `L`
/// bytes and one shift and mask per field give `L` consecutive elements.
///
/// # Safety
/// `src` valid for `m` bytes, `dst` for the row's vectors; `m` a multiple of `L`,
/// or `2m == L` with at least two fields.
#[inline(always)]
unsafe fn plane<
    S: Simd,
    D: Deq<S>,
    const P: u32,
    const SH: u32,
    const FIRST: bool,
    const LAST: bool,
>(
    s: S,
    src: *const u8,
    m: usize,
    dst: *mut f32,
    tt: usize,
    d: D,
) {
    let k = (8 / P) as usize;
    let fmask = (1u32 << P) - 1;
    if m.is_multiple_of(S::L) {
        let per = m / S::L;
        for b in 0..per {
            // SAFETY: bytes `b·L .. b·L + L ≤ m`.
            let v = unsafe { s.load_u8(src.add(b * S::L)) };
            for f in 0..k {
                let c = s.shr_mask(v, (P * f as u32) as i32 - SH as i32, fmask << SH);
                // SAFETY: vector `f·per + b < k·per = hd/L`.
                unsafe { emit::<S, D, FIRST, LAST>(s, dst, f * per + b, tt, c, d) };
            }
        }
    } else {
        // `m` is half a vector: vector `j` holds fields `2j` and `2j+1`.
        // SAFETY: `L/2 = m` bytes.
        let v = unsafe { s.load_u8_dup(src) };
        for f in (0..k).step_by(2) {
            let c = s.shr_pair_mask(v, P * f as u32, P * (f as u32 + 1), fmask, SH);
            // SAFETY: vector `f/2 < k/2 = hd/L`.
            unsafe { emit::<S, D, FIRST, LAST>(s, dst, f / 2, tt, c, d) };
        }
    }
}

/// # Safety
/// `dst` is the scratch at token `tt`; vector `j` in the tile.
#[inline(always)]
unsafe fn emit<S: Simd, D: Deq<S>, const FIRST: bool, const LAST: bool>(
    s: S,
    dst: *mut f32,
    j: usize,
    tt: usize,
    c: S::I,
    d: D,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let p = dst.add(j * S::T * S::L);
        let c = if FIRST { c } else { s.or(c, s.load_i(p)) };
        if LAST {
            s.store(p, d.apply(s, tt, j, s.cvt(c)));
        } else {
            s.store_i(p, c);
        }
    }
}

/// Rows whose planes do not split into vectors (e.g. `head_dim` 72 at 4
/// bits): unpack with [`pack::unpack`], then convert vector by vector.
///
/// # Safety
/// As [`unpack_tile`], for one row.
#[inline(always)]
unsafe fn unpack_row_scalar<S: Simd, const B: u8, D: Deq<S>>(
    s: S,
    g: Geo,
    row: *const u8,
    u8buf: *mut u8,
    dst: *mut f32,
    tt: usize,
    d: D,
) {
    // SAFETY: `row` has `rb` bytes and `u8buf` `hdp ≥ hd` bytes; neither
    // aliases anything else borrowed here.
    unsafe {
        let src = std::slice::from_raw_parts(row, g.rb);
        let codes = std::slice::from_raw_parts_mut(u8buf, g.hd);
        pack::unpack(src, g.bits, codes);
        for j in 0..g.nch {
            let x = s.cvt(s.load_u8(u8buf.add(j * S::L)));
            s.store(dst.add(j * S::T * S::L), d.apply(s, tt, j, x));
        }
    }
}

/// The codes of vector `j` of a row (elements `j·L .. j·L + L`) as
/// integers, straight from the packed planes. With a compile-time `HD` and
/// an unrolled `j` every offset and shift is a constant, and the loads
/// shared by several vectors are merged.
///
/// # Safety
/// `row` valid for the row's bytes; `Geo::fast` holds; `j < hd/L`.
#[inline(always)]
unsafe fn codes_vec<S: Simd, const B: u8>(s: S, row: *const u8, hd: usize, j: usize) -> S::I {
    let (h2, h4, h8) = (hd / 2, hd / 4, hd / 8);
    // SAFETY: the planes of a `B`-bit row are `m = hd·p/8` bytes each,
    // widest first, and together exactly `rb` bytes (see `pack`).
    unsafe {
        match B {
            1 => pv::<S, 1, 0>(s, row, h8, j),
            2 => pv::<S, 2, 0>(s, row, h4, j),
            3 => s.or(
                pv::<S, 2, 0>(s, row, h4, j),
                pv::<S, 1, 2>(s, row.add(h4), h8, j),
            ),
            4 => pv::<S, 4, 0>(s, row, h2, j),
            5 => s.or(
                pv::<S, 4, 0>(s, row, h2, j),
                pv::<S, 1, 4>(s, row.add(h2), h8, j),
            ),
            6 => s.or(
                pv::<S, 4, 0>(s, row, h2, j),
                pv::<S, 2, 4>(s, row.add(h2), h4, j),
            ),
            7 => s.or(
                s.or(
                    pv::<S, 4, 0>(s, row, h2, j),
                    pv::<S, 2, 4>(s, row.add(h2), h4, j),
                ),
                pv::<S, 1, 6>(s, row.add(h2 + h4), h8, j),
            ),
            _ => pv::<S, 8, 0>(s, row, hd, j),
        }
    }
}

/// The codes of vector `j` of a row as floats: single-plane widths of up
/// to 4 bits through [`Simd::field_f32`] (shift, then a table permute),
/// the others through [`codes_vec`] and a convert.
///
/// # Safety
/// As [`codes_vec`].
#[inline(always)]
unsafe fn codes_f32<S: Simd, const B: u8>(s: S, row: *const u8, hd: usize, j: usize) -> S::F {
    // SAFETY: as `codes_vec`; `pf` reads what `pv` reads.
    unsafe {
        match B {
            1 => pf::<S, 1>(s, row, hd / 8, j),
            2 => pf::<S, 2>(s, row, hd / 4, j),
            4 => pf::<S, 4>(s, row, hd / 2, j),
            _ => s.cvt(codes_vec::<S, B>(s, row, hd, j)),
        }
    }
}

/// Field of vector `j` of a single plane of width `P`, as floats.
///
/// # Safety
/// As [`pv`].
#[inline(always)]
unsafe fn pf<S: Simd, const P: u32>(s: S, src: *const u8, m: usize, j: usize) -> S::F {
    let e = j * S::L;
    if m.is_multiple_of(S::L) {
        let f = e / m;
        // SAFETY: bytes `e mod m .. + L ≤ m`.
        let v = unsafe { s.load_u8(src.add(e % m)) };
        // The field's bits at the bottom; the higher fields above are
        // ignored by `field_f32`.
        s.field_f32::<P>(s.shr_mask(v, (P * f as u32) as i32, u32::MAX))
    } else {
        // SAFETY: as `pv`.
        s.cvt(unsafe { pv::<S, P, 0>(s, src, m, j) })
    }
}

/// Bits `SH..SH+P` of the codes of vector `j`, from a plane of width `P`
/// and `m` bytes at `src` (see [`plane`]).
///
/// # Safety
/// `src` valid for `m` bytes; `m` a multiple of `L` or `2m == L`; `j·L < 8m/P`.
#[inline(always)]
unsafe fn pv<S: Simd, const P: u32, const SH: u32>(
    s: S,
    src: *const u8,
    m: usize,
    j: usize,
) -> S::I {
    let e = j * S::L;
    let fmask = (1u32 << P) - 1;
    let f = e / m;
    if m.is_multiple_of(S::L) {
        // SAFETY: bytes `e mod m .. + L ≤ m`.
        let v = unsafe { s.load_u8(src.add(e % m)) };
        s.shr_mask(v, (P * f as u32) as i32 - SH as i32, fmask << SH)
    } else {
        // SAFETY: `L/2 = m` bytes.
        let v = unsafe { s.load_u8_dup(src) };
        s.shr_pair_mask(v, P * f as u32, P * (f as u32 + 1), fmask, SH)
    }
}

/// Fused scores of up to `T` tokens: each row is unpacked (and
/// dequantized by `d`) into registers and multiplied into every query at
/// once; token `tt`'s partial sums for query `i` go to `accbuf[(i·T + tt)·L]`
/// for [`reduce_queries`]. Rows `n..T` get zeros.
///
/// # Safety
/// `rows` valid for `n` rows; `q` for `nq·hdp` floats; `accbuf` for
/// `nq·T·L`; `Geo::fast` holds and `nch ≤ 32`; `d` built for this tile.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fused_scores_tile<S: Simd, const B: u8, D: Deq<S>, const NIB: bool>(
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
        unroll!(32; j in 0, g.nch => {
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
                unroll!(32; j in 0, g.nch => {
                    xa[j] = row_vec::<S, B, D, NIB>(s, g, d, ra, tt, j);
                    xb[j] = row_vec::<S, B, D, NIB>(s, g, d, rb, tt + 1, j);
                });
                for i in 0..nq {
                    let qi = q.add(i * g.hdp);
                    let (mut a, mut b) = ([s.zero(); 2], [s.zero(); 2]);
                    unroll!(32; j in 0, g.nch => {
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
                unroll!(32; j in 0, g.nch => {
                    let x = row_vec::<S, B, D, NIB>(s, g, d, row, tt, j);
                    a[j % 2] = s.fma(x, q1[j], a[j % 2]);
                });
                s.store(accbuf.add(tt * S::L), s.add(a[0], a[1]));
            } else {
                let mut xs = [s.zero(); MAX_NCH];
                unroll!(32; j in 0, g.nch => {
                    xs[j] = row_vec::<S, B, D, NIB>(s, g, d, row, tt, j);
                });
                for i in 0..nq {
                    let qi = q.add(i * g.hdp);
                    let mut a = [s.zero(); 2];
                    unroll!(32; j in 0, g.nch => {
                        a[j % 2] = s.fma(xs[j], s.load(qi.add(j * S::L)), a[j % 2]);
                    });
                    s.store(accbuf.add((i * S::T + tt) * S::L), s.add(a[0], a[1]));
                }
            }
        }
        tt += 1;
    }
    for i in 0..nq {
        for tt in n..S::T {
            // SAFETY: `i < nq`, `tt < T`.
            unsafe { s.store(accbuf.add((i * S::T + tt) * S::L), s.zero()) };
        }
    }
}

/// Vector `j` of token `tt`'s row for [`fused_scores_tile`]: the
/// dequantized codes, or with `NIB` (2- and 4-bit raw codes read a byte
/// vector at a time, queries rewritten by [`nibble_queries`]) the prefix
/// `v_f = b & (2^{B·(f+1)} − 1)` of byte vector `j mod h` for level
/// `f = j div h`, `h = nch·B/8`: for 4 bits the low nibbles and then the
/// whole bytes; for 2 bits `b & 3`, `b & 15`, `b & 63` and `b`.
///
/// # Safety
/// `row` valid for the row's bytes; `Geo::fast`; `j < nch`.
#[inline(always)]
unsafe fn row_vec<S: Simd, const B: u8, D: Deq<S>, const NIB: bool>(
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
            byte_prefix::<S, B>(s, s.load_u8(row.add(j % h * S::L)), j / h)
        } else {
            d.apply(s, tt, j, codes_f32::<S, B>(s, row, g.hd, j))
        }
    }
}

/// Prefix `f` of `B`-bit fields (`B` 2 or 4) of widened bytes as floats:
/// `b & (2^{B·(f+1)} − 1)` — for 4 bits the low nibble, then the byte; for
/// 2 bits `b & 3`, `b & 15`, `b & 63`, then the byte. Field `f` is
/// `(prefix f − prefix f−1)/2^{B·f}`, exactly.
#[inline(always)]
fn byte_prefix<S: Simd, const B: u8>(s: S, bytes: S::I, f: usize) -> S::F {
    match (B, f) {
        (2, 0) => s.field_f32::<2>(bytes),
        (2, 1) | (4, 0) => s.field_f32::<4>(bytes),
        (2, 2) => s.cvt(s.shr_mask(bytes, 0, 63)),
        _ => s.cvt(bytes),
    }
}

/// Rewrite per-channel queries for `bits`-bit rows (2 or 4) read a byte
/// vector at a time (see [`row_vec`]). Byte `c` of the plane holds the
/// fields of channels `c + f·m` (`m = hd·bits/8` bytes, `F = 8/bits`
/// fields); with `v_f` its prefix `b & (2^{bits·(f+1)} − 1)`, field `f` is
/// `(v_f − v_{f−1})/2^{bits·f}`, so the dot product telescopes:
/// `Σ_f q_f·x_f = Σ_f v_f·(q_f/2^{bits·f} − q_{f+1}/2^{bits·(f+1)})` with
/// `q_F = 0`. The kernel widens each byte vector once and masks instead of
/// shifting each field out (a second widening on the shuffle port). `qs`
/// holds `nq` queries of `hdp` floats.
#[inline(always)]
fn nibble_queries(qs: &mut [f32], nq: usize, hd: usize, hdp: usize, bits: u32) {
    let fields = (8 / bits) as usize;
    let m = hd / fields;
    for qi in qs.chunks_exact_mut(hdp).take(nq) {
        // Scale field `f` by 2^−bits·f (exact), then subtract the next.
        unscale_fields(&mut qi[..hd], bits);
        for f in 0..fields - 1 {
            let (cur, next) = qi[f * m..(f + 2) * m].split_at_mut(m);
            for (a, b) in cur.iter_mut().zip(next.iter()) {
                *a -= *b;
            }
        }
    }
}

/// Multiply field `f` of `x` (`F = 8/bits` equal parts) by `2^{−bits·f}`
/// (exact): the field scale of a byte-vector row ([`byte_prefix`]).
#[inline(always)]
fn unscale_fields(x: &mut [f32], bits: u32) {
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
pub(super) unsafe fn reduce_query<S: Simd>(s: S, accbuf: *const f32, i: usize) -> S::F {
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
unsafe fn dot_tile<S: Simd>(s: S, scr: *const f32, nch: usize, q: *const f32) -> S::F {
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
unsafe fn sum_vectors<S: Simd>(
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
unsafe fn splat_tile<S: Simd>(s: S, p: *const f32) -> [S::F; 16] {
    let mut w = [s.zero(); 16];
    for (tt, w) in w.iter_mut().enumerate().take(S::T) {
        // SAFETY: `tt < T`.
        *w = unsafe { s.bcast(p.add(tt)) };
    }
    w
}

/// Write the first `out.len() ≤ T` lanes of `v`.
#[inline(always)]
pub(super) fn store_lanes<S: Simd>(s: S, v: S::F, out: &mut [f32]) {
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

/// Widen stored scales/zeros: `dst[i]` from bytes `i·fb..` of `src`.
#[inline(always)]
pub(super) fn cvt_params<S: Simd>(s: S, fmt: ScaleFormat, src: &[u8], dst: &mut [f32]) {
    let fb = fmt.bytes();
    let n = dst.len();
    assert!(src.len() >= n * fb, "kernels: params shorter than expected");
    let mut i = 0;
    while i + S::L <= n {
        // SAFETY: `i + L ≤ n`: `src` holds `(i+L)·fb` bytes, `dst` `i+L` floats.
        unsafe {
            let p = src.as_ptr().add(i * fb);
            let v = match fmt {
                ScaleFormat::F16 => s.load_f16(p),
                ScaleFormat::Bf16 => s.load_bf16(p),
                ScaleFormat::F32 => s.load_f32_bytes(p),
            };
            s.store(dst.as_mut_ptr().add(i), v);
        }
        i += S::L;
    }
    for (k, d) in dst.iter_mut().enumerate().skip(i) {
        *d = fmt.read(&src[k * fb..]);
    }
}

/// `dst = src·k`, elementwise.
#[inline(always)]
fn scale_into<S: Simd>(s: S, src: &[f32], k: f32, dst: &mut [f32]) {
    assert!(dst.len() >= src.len());
    let n = src.len();
    let mut i = 0;
    while i + S::L <= n {
        // SAFETY: `i + L ≤ n ≤ dst.len()`.
        unsafe {
            s.store(
                dst.as_mut_ptr().add(i),
                s.mul(s.load(src.as_ptr().add(i)), s.splat(k)),
            )
        };
        i += S::L;
    }
    for c in i..n {
        dst[c] = src[c] * k;
    }
}

/// The scheme as the kernels need it.
#[derive(Clone, Copy)]
pub(super) struct Plan {
    tokens: usize,
    fmt: ScaleFormat,
    sym: bool,
    /// `2^(bits-1)`: a symmetric group's implied zero is `-scale·half`.
    half: f32,
}

impl Plan {
    /// The params' stored format.
    #[inline(always)]
    pub(super) fn fmt(&self) -> ScaleFormat {
        self.fmt
    }

    /// Symmetric groups (no stored zeros).
    #[inline(always)]
    pub(super) fn sym(&self) -> bool {
        self.sym
    }

    /// `2^(bits-1)`: a symmetric group's implied zero is `-scale·half`.
    #[inline(always)]
    pub(super) fn half(&self) -> f32 {
        self.half
    }

    #[inline(always)]
    pub(super) fn new(head: &PackedHead<'_>) -> Plan {
        let sc = head.layout().scheme();
        Plan {
            tokens: head.tokens(),
            fmt: sc.scale_format(),
            sym: sc.mode() == Mode::Symmetric,
            half: (1u32 << (sc.bits() - 1)) as f32,
        }
    }
}

/// Per-token params of one tile, widened to `f32` in place of the stored
/// layout (`[s_0 … s_{g-1}][z_0 … z_{g-1}]` per token; symmetric zeros
/// computed into `zs`), plus, for groups that do not line up with whole
/// vectors, the same expanded to one scale and zero per channel.
struct TileParams {
    /// Numbers per token as stored (`gpr` or `2·gpr`).
    vals: usize,
    gpr: usize,
    /// Channels per group.
    cpg: usize,
    p: Plan,
    conv: Buf,
    zs: Buf,
    goff: [u32; MAX_NCH],
    /// Expanded `(scales, zeros)`, `T` rows of `hdp`, when groups do not
    /// line up with vectors.
    rows: Option<(Buf, Buf)>,
    hd: usize,
    hdp: usize,
    /// The kernel prefetches per token ([`TileParams::ahead`]), not
    /// [`TileParams::load`].
    spread: bool,
}

impl TileParams {
    #[inline(always)]
    fn new<S: Simd>(head: &PackedHead<'_>, g: Geo, p: Plan) -> TileParams {
        let l = head.layout();
        let gpr = l.groups_per_row();
        let cpg = l.channels_per_group();
        let vals = gpr * if p.sym { 1 } else { 2 };
        let aligned = cpg.is_multiple_of(S::L) && g.nch <= MAX_NCH;
        let mut goff = [0u32; MAX_NCH];
        if aligned {
            for (j, o) in goff.iter_mut().enumerate().take(g.nch) {
                *o = (j * S::L / cpg) as u32;
            }
        }
        TileParams {
            vals,
            gpr,
            cpg,
            p,
            conv: Buf::new(S::T * vals + PAD),
            zs: Buf::new(if p.sym { S::T * gpr + PAD } else { 0 }),
            goff,
            rows: (!aligned).then(|| (Buf::new(S::T * g.hdp), Buf::new(S::T * g.hdp))),
            hd: g.hd,
            hdp: g.hdp,
            spread: false,
        }
    }

    /// The param and code streams of the tile at `t0`, for a kernel that
    /// prefetches per token.
    #[inline(always)]
    fn ahead(&self, head: &PackedHead<'_>, t0: usize) -> [Ahead; 2] {
        if !self.spread {
            return [Ahead::NONE; 2];
        }
        [
            Ahead::new(head.codes().as_ptr(), head.layout().row_bytes(), t0),
            Ahead::new(head.params().as_ptr(), self.vals * self.p.fmt.bytes(), t0),
        ]
    }

    /// Load the params of tokens `t0..t0+n`.
    #[inline(always)]
    fn load<S: Simd>(&mut self, s: S, head: &PackedHead<'_>, t0: usize, n: usize) {
        let fb = self.p.fmt.bytes();
        let src = &head.params()[t0 * self.vals * fb..(t0 + n) * self.vals * fb];
        // Every per-token path loads a tile's params here: prefetch both
        // of its streams, params and codes (unless the kernel spreads them).
        if !self.spread {
            prefetch_ahead(head.params().as_ptr(), self.vals * fb, t0, n);
            prefetch_ahead(head.codes().as_ptr(), head.layout().row_bytes(), t0, n);
        }
        cvt_params(s, self.p.fmt, src, &mut self.conv.m()[..n * self.vals]);
        if self.p.sym {
            scale_into(s, &self.conv.s()[..n * self.gpr], -self.p.half, self.zs.m());
        }
        if let Some((rs, rz)) = &mut self.rows {
            let (hd, hdp, gpr, vals, cpg) = (self.hd, self.hdp, self.gpr, self.vals, self.cpg);
            for tt in 0..n {
                for c in 0..hd {
                    let k = c / cpg;
                    rs.m()[tt * hdp + c] = self.conv.s()[tt * vals + k];
                    rz.m()[tt * hdp + c] = if self.p.sym {
                        self.zs.s()[tt * gpr + k]
                    } else {
                        self.conv.s()[tt * vals + gpr + k]
                    };
                }
            }
        }
    }

    #[inline(always)]
    fn deq(&self) -> PerToken {
        let sc = self.conv.s().as_ptr();
        PerToken {
            sc,
            ze: if self.p.sym {
                self.zs.s().as_ptr()
            } else {
                sc.wrapping_add(self.gpr)
            },
            stride: if self.p.sym { self.gpr } else { self.vals },
            goff: self.goff,
        }
    }

    #[inline(always)]
    fn deq_rows(&self) -> Option<Rows> {
        self.rows.as_ref().map(|(rs, rz)| Rows {
            sc: rs.s().as_ptr(),
            ze: rz.s().as_ptr(),
            stride: self.hdp,
        })
    }
}

/// Per-channel params of block `k` into `sc`/`ze` (`hd` each; the padding
/// up to `hdp` stays zero).
#[inline(always)]
pub(super) fn block_params<S: Simd>(
    s: S,
    head: &PackedHead<'_>,
    p: &Plan,
    hd: usize,
    k: usize,
    sc: &mut [f32],
    ze: &mut [f32],
) {
    let fb = p.fmt.bytes();
    let set = hd * fb * if p.sym { 1 } else { 2 };
    let src = &head.params()[k * set..(k + 1) * set];
    cvt_params(s, p.fmt, &src[..hd * fb], &mut sc[..hd]);
    if p.sym {
        scale_into(s, &sc[..hd], -p.half, ze);
    } else {
        cvt_params(s, p.fmt, &src[hd * fb..], &mut ze[..hd]);
    }
}

/// A per-channel block's folded queries `qs_i = q_i·scale` (rewritten as
/// [`nibble_queries`] does for `nib` = `Some(bits)`, 2 or 4) and biases
/// `q_i·zero`, straight from the block's stored `f16` params at `src`
/// (scales, then zeros unless symmetric): the same products and sums, in
/// the same order, as [`block_params`], the bias loop and
/// [`nibble_queries`], without the widened copies in between.
///
/// # Safety
/// `src` valid for the block's `nch·L` scales (and as many zeros unless
/// symmetric) as `f16`; `qp` and `qs` for `bias.len()` queries of `hdp ≥
/// nch·L` floats; `nch ≤ MAX_NCH`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn block_queries_f16<S: Simd>(
    s: S,
    src: *const u8,
    p: &Plan,
    nch: usize,
    qp: *const f32,
    hdp: usize,
    qs: *mut f32,
    bias: &mut [f32],
    nib: Option<u32>,
) {
    let hd = nch * S::L;
    for (i, bias) in bias.iter_mut().enumerate() {
        let mut x = [s.zero(); MAX_NCH];
        let mut b = s.zero();
        // SAFETY: the caller's contract; vectors `j < nch`.
        unsafe {
            unroll!(32; j in 0, nch => {
                let sc = s.load_f16(src.add(j * S::L * 2));
                let ze = if p.sym {
                    s.mul(sc, s.splat(-p.half))
                } else {
                    s.load_f16(src.add((hd + j * S::L) * 2))
                };
                let qv = s.load(qp.add(i * hdp + j * S::L));
                x[j] = s.mul(qv, sc);
                b = s.fma(qv, ze, b);
            });
        }
        *bias = s.hsum(b);
        if let Some(bits) = nib {
            // As `nibble_queries`: scale field `f` by 2^−bits·f, then
            // subtract the next field.
            let nf = (8 / bits) as usize;
            let h = nch / nf;
            for f in 1..nf {
                let k = s.splat(1.0 / (1u32 << (bits as usize * f)) as f32);
                for v in &mut x[f * h..(f + 1) * h] {
                    *v = s.mul(*v, k);
                }
            }
            for f in 0..nf - 1 {
                for jj in 0..h {
                    x[f * h + jj] = s.sub(x[f * h + jj], x[(f + 1) * h + jj]);
                }
            }
        }
        // SAFETY: vectors `j < nch` of query `i` of `qs`.
        unsafe {
            unroll!(32; j in 0, nch => {
                s.store(qs.add(i * hdp + j * S::L), x[j]);
            });
        }
    }
}

/// Packed scores: `out[i·tokens + t] = q_i · k̂_t`.
///
/// Per-channel keys: the block's scales are folded into the queries
/// (`q'_c = q_c·scale_c`, once per block) and its zeros into one bias per
/// query, so the tile holds raw codes. Per-token keys are dequantized into
/// the tile.
///
/// # Safety
/// [`super::check_head`]`(head, q.len(), out.len())` passed; `HD` is 0 or
/// the head's `head_dim`.
#[inline(always)]
pub(crate) unsafe fn scores<S: Simd, const B: u8, const HD: usize>(
    s: S,
    head: &PackedHead<'_>,
    q: &[f32],
    out: &mut [f32],
) {
    let p = Plan::new(head);
    let g = Geo::new::<S, B, HD>(head.layout().head_dim(), head.layout().scheme().bits());
    let (hd, hdp, t_all) = (g.hd, g.hdp, p.tokens);
    let nq = q.len() / hd;
    if t_all == 0 {
        return;
    }
    let mut scr = Buf::new(S::T * hdp);
    let mut u8buf = vec![0u8; hdp];
    let mut qp = Buf::new(nq * hdp);
    for i in 0..nq {
        qp.m()[i * hdp..i * hdp + hd].copy_from_slice(&q[i * hd..(i + 1) * hd]);
    }
    // Unpack into registers (no scratch) when the shape is a compile-time
    // constant and the unpacked row fits the register file.
    let fused = HD > 0 && g.fast && g.nch <= MAX_NCH && (nq == 1 || g.nch <= S::REGS / 2);
    let mut accbuf = Buf::new(nq * S::T * S::L);
    let codes = head.codes().as_ptr();
    // One query only: with several, the transcoded 8-bit rows were slower
    // (four queries: 20 → 23 ns per token, `docs/PERFORMANCE.md`).
    let mut t3 = if fused && nq == 1 {
        Tile3::new::<B>(s, hd)
    } else {
        None
    };
    match head.layout().scheme().axis() {
        Axis::PerChannel => {
            let gl = head.layout().group_len();
            let (mut sc, mut ze, mut qs) = (Buf::new(hdp), Buf::new(hdp), Buf::new(nq * hdp));
            let mut bias = vec![0f32; nq];
            // 2- and 4-bit rows whose field vectors come from the same
            // bytes: one widening per byte vector (see `nibble_queries`).
            let nib = matches!(B, 2 | 4) && fused && (hd * B as usize / 8).is_multiple_of(S::L);
            // The fused kernel prefetches per token.
            let pf = BlockAhead::new(head, fused);
            // `f16` params and whole vectors: each block's folded queries
            // and biases straight from the stored bytes, in registers.
            let direct = p.fmt == ScaleFormat::F16 && hd == hdp && g.nch <= MAX_NCH;
            let set = hd * 2 * if p.sym { 1 } else { 2 };
            for k in 0..t_all.div_ceil(gl) {
                pf.block(k);
                if direct {
                    let src = &head.params()[k * set..(k + 1) * set];
                    // SAFETY: `src` holds the block's `set` bytes; `qp`/`qs`
                    // `hdp = nch·L` floats per query, `bias` `nq` floats.
                    unsafe {
                        block_queries_f16(
                            s,
                            src.as_ptr(),
                            &p,
                            g.nch,
                            qp.s().as_ptr(),
                            hdp,
                            qs.m().as_mut_ptr(),
                            &mut bias,
                            nib.then_some(B as u32),
                        )
                    };
                } else {
                    block_params(s, head, &p, hd, k, sc.m(), ze.m());
                    for (i, bias) in bias.iter_mut().enumerate() {
                        let mut b = s.zero();
                        for j in 0..g.nch {
                            let o = i * hdp + j * S::L;
                            // SAFETY: vector `j < nch` of buffers of `hdp`
                            // floats per query (`qp`, `qs`) or of `hdp` (`sc`, `ze`).
                            unsafe {
                                let qv = s.load(qp.s().as_ptr().add(o));
                                let sv = s.load(sc.s().as_ptr().add(j * S::L));
                                s.store(qs.m().as_mut_ptr().add(o), s.mul(qv, sv));
                                b = s.fma(qv, s.load(ze.s().as_ptr().add(j * S::L)), b);
                            }
                        }
                        *bias = s.hsum(b);
                    }
                }
                if nib && !direct {
                    nibble_queries(qs.m(), nq, hd, hdp, B as u32);
                }
                let t_end = ((k + 1) * gl).min(t_all);
                let mut t0 = k * gl;
                while t0 < t_end {
                    let n = S::T.min(t_end - t0);
                    let rows = codes.wrapping_add(t0 * g.rb);
                    let ah = pf.tile(t0, n);
                    for i in 0..nq {
                        // SAFETY: rows `t0..t0+n ≤ tokens` are in `codes`
                        // (check_head); the scratch holds `T` rows of `hdp`,
                        // `accbuf` `T` vectors per query, `qs` `hdp` floats
                        // per query.
                        let r = unsafe {
                            if const { HD > 0 } && fused {
                                let (qp, ap) = (qs.s().as_ptr(), accbuf.m().as_mut_ptr());
                                match (i, nib, &mut t3) {
                                    (0, true, _) => fused_scores_tile::<S, B, Raw, true>(
                                        s, g, rows, n, Raw, qp, nq, ap, ah,
                                    ),
                                    (0, false, Some(t3)) => {
                                        let r8 = t3.load(s, rows, g.rb, n);
                                        fused_scores_tile::<S, 8, Raw, false>(
                                            s,
                                            t3.geo(g),
                                            r8,
                                            n,
                                            Raw,
                                            qp,
                                            nq,
                                            ap,
                                            ah,
                                        )
                                    }
                                    (0, false, None) => fused_scores_tile::<S, B, Raw, false>(
                                        s, g, rows, n, Raw, qp, nq, ap, ah,
                                    ),
                                    _ => {}
                                }
                                reduce_query(s, accbuf.s().as_ptr(), i)
                            } else {
                                if i == 0 {
                                    unpack_tile::<S, B, Raw>(
                                        s,
                                        g,
                                        rows,
                                        n,
                                        scr.m().as_mut_ptr(),
                                        u8buf.as_mut_ptr(),
                                        Raw,
                                    );
                                }
                                dot_tile(s, scr.s().as_ptr(), g.nch, qs.s().as_ptr().add(i * hdp))
                            }
                        };
                        let r = s.add(r, s.splat(bias[i]));
                        store_lanes(s, r, &mut out[i * t_all + t0..i * t_all + t0 + n]);
                    }
                    t0 += n;
                }
            }
        }
        Axis::PerToken => {
            let mut tp = TileParams::new::<S>(head, g, p);
            let mut t0 = 0;
            let fused = fused && tp.rows.is_none();
            tp.spread = fused;
            while t0 < t_all {
                let n = S::T.min(t_all - t0);
                tp.load(s, head, t0, n);
                // SAFETY: as in the per-channel arm; `tp` holds this tile's params.
                unsafe {
                    let (rows, sp, u8b) = (
                        codes.add(t0 * g.rb),
                        scr.m().as_mut_ptr(),
                        u8buf.as_mut_ptr(),
                    );
                    match tp.deq_rows() {
                        _ if const { HD > 0 } && fused => match &mut t3 {
                            Some(t3) => {
                                let r8 = t3.load(s, rows, g.rb, n);
                                fused_scores_tile::<S, 8, PerToken, false>(
                                    s,
                                    t3.geo(g),
                                    r8,
                                    n,
                                    tp.deq(),
                                    qp.s().as_ptr(),
                                    nq,
                                    accbuf.m().as_mut_ptr(),
                                    tp.ahead(head, t0),
                                )
                            }
                            None => fused_scores_tile::<S, B, PerToken, false>(
                                s,
                                g,
                                rows,
                                n,
                                tp.deq(),
                                qp.s().as_ptr(),
                                nq,
                                accbuf.m().as_mut_ptr(),
                                tp.ahead(head, t0),
                            ),
                        },
                        None => unpack_tile::<S, B, PerToken>(s, g, rows, n, sp, u8b, tp.deq()),
                        Some(d) => unpack_tile::<S, B, Rows>(s, g, rows, n, sp, u8b, d),
                    }
                }
                for i in 0..nq {
                    // SAFETY: `qp` holds `hdp` floats per query, `accbuf`
                    // `T` vectors per query.
                    let r = unsafe {
                        if fused {
                            reduce_query(s, accbuf.s().as_ptr(), i)
                        } else {
                            dot_tile(s, scr.s().as_ptr(), g.nch, qp.s().as_ptr().add(i * hdp))
                        }
                    };
                    store_lanes(s, r, &mut out[i * t_all + t0..i * t_all + t0 + n]);
                }
                t0 += n;
            }
        }
    }
}

/// Packed weighted sum: `out_i += Σ_t p[i·tokens + t] · v̂_t`.
///
/// Per-token values with groups of whole vectors keep raw codes in the
/// tile and fold the scales into the weights, group by group
/// (`w_tg = p_t·scale_tg`), adding `Σ_t p_t·zero_tg` per group at the end.
/// Other groupings and per-channel values are dequantized into the tile.
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
    let mut scr = Buf::new(S::T * hdp);
    let mut u8buf = vec![0u8; hdp];
    let mut acc = Buf::new(nq * hdp);
    let codes = head.codes().as_ptr();
    // The tile's weights of query `i`, zero past its last token.
    let tile_p = |i: usize, t0: usize, n: usize| {
        let mut w = [0f32; 16];
        w[..n].copy_from_slice(&p[i * t_all + t0..i * t_all + t0 + n]);
        w
    };
    match head.layout().scheme().axis() {
        Axis::PerToken
            if const { HD > 0 }
                && g.fast
                && matches!(nq, 1 | 4)
                && g.nch <= MAX_NCH
                && head.layout().channels_per_group().is_multiple_of(S::L) =>
        {
            let mut tp = TileParams::new::<S>(head, g, pl);
            let (a, t3) = (acc.m(), Tile3::new::<B>(s, hd));
            // SAFETY: check_head passed; the shape conditions of the arm
            // hold. Transcoded 3-bit rows are read as 8-bit rows.
            unsafe {
                match (nq, t3) {
                    (1, Some(t3)) => fused_sum_pt::<S, 8, 1>(s, g, head, &mut tp, p, a, Some(t3)),
                    (_, Some(t3)) => fused_sum_pt::<S, 8, 4>(s, g, head, &mut tp, p, a, Some(t3)),
                    (1, None) => fused_sum_pt::<S, B, 1>(s, g, head, &mut tp, p, a, None),
                    (_, None) => fused_sum_pt::<S, B, 4>(s, g, head, &mut tp, p, a, None),
                }
            }
        }
        Axis::PerToken => {
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
                        None => unpack_tile::<S, B, Raw>(s, g, r, n, sp, u8b, Raw),
                        Some(d) => unpack_tile::<S, B, Rows>(s, g, r, n, sp, u8b, d),
                    }
                }
                for i in 0..nq {
                    let pt = tile_p(i, t0, n);
                    let a = acc.m()[i * hdp..].as_mut_ptr();
                    if rows.is_some() {
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
            if tp.rows.is_none() {
                for i in 0..nq {
                    for c in 0..hd {
                        acc.m()[i * hdp + c] += zacc.s()[i * wst + c / cpg];
                    }
                }
            }
        }
        Axis::PerChannel => {
            let gl = head.layout().group_len();
            let (mut sc, mut ze) = (Buf::new(hdp), Buf::new(hdp));
            for k in 0..t_all.div_ceil(gl) {
                block_params(s, head, &pl, hd, k, sc.m(), ze.m());
                let d = Rows {
                    sc: sc.s().as_ptr(),
                    ze: ze.s().as_ptr(),
                    stride: 0,
                };
                let t_end = ((k + 1) * gl).min(t_all);
                let mut t0 = k * gl;
                while t0 < t_end {
                    let n = S::T.min(t_end - t0);
                    // SAFETY: as above; `sc`/`ze` hold the block's `hdp`
                    // params and are not written meanwhile.
                    unsafe {
                        unpack_tile::<S, B, Rows>(
                            s,
                            g,
                            codes.add(t0 * g.rb),
                            n,
                            scr.m().as_mut_ptr(),
                            u8buf.as_mut_ptr(),
                            d,
                        );
                    }
                    for i in 0..nq {
                        let pt = tile_p(i, t0, n);
                        // SAFETY: `pt` holds T weights; `acc` `hdp` floats per query.
                        unsafe {
                            let a = acc.m()[i * hdp..].as_mut_ptr();
                            sum_vectors(
                                s,
                                scr.s().as_ptr(),
                                0,
                                g.nch,
                                &splat_tile(s, pt.as_ptr()),
                                a,
                            );
                        }
                    }
                    t0 += n;
                }
            }
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
unsafe fn expand_scales<S: Simd>(
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
/// larger part of this step's cost (`docs/PERFORMANCE.md`, session 8).
///
/// # Safety
/// `src` valid for `2·((n−1)·vals + L)` bytes; `pw` holds `n ≤ T`
/// weights; `w` `n` rows of `ne ≤ 2·L`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn expand_scales_f16<S: Simd>(
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

/// `z[c] += Σ_t pi[t]·zero_tc` for the `gch` zero vectors of a tile, in
/// four independent chains.
///
/// # Safety
/// `d` holds `pi.len()` tokens' params with `gch·L` readable floats at
/// each token's zeros; `gch ≤ 4`.
#[inline(always)]
unsafe fn zero_sums<S: Simd>(s: S, d: PerToken, pi: &[f32], gch: usize, z: &mut [S::F; 4]) {
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

/// Fused weighted sum of per-token values for `NQ` queries: each row is
/// unpacked into registers once and added into every query. Accumulators
/// live in registers for a tile at a time, `NQ ×` a column block of
/// vectors filling half the register file.
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
unsafe fn fused_sum_pt<S: Simd, const B: u8, const NQ: usize>(
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
    // `bb` byte vectors and `F·bb` accumulators per query. Field `f` is
    // the exact difference of two masked prefixes of the byte (see
    // `row_vec`), i.e. `2^{B·f}` times the field; it accumulates at that
    // scale and is scaled back at the end. That costs up to 6 bits of
    // exponent headroom: only with f16 scales (at most 65504), where it
    // overflows only for weights beyond ≈10^30, not for probabilities.
    let nf = 8 / B as usize;
    let h = nch / nf;
    let bb = (jb / nf).max(1).min(h.max(1));
    let nib = matches!(B, 2 | 4)
        && (g.hd / nf).is_multiple_of(S::L)
        && h.is_multiple_of(bb)
        && bb * nf <= 16
        && tp.p.fmt == ScaleFormat::F16;
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
    // One query with `f16` params whose scales and zeros fit one vector:
    // weights straight from the stored params ([`expand_scales_f16`]).
    let direct = !fold && perm && tp.p.fmt == ScaleFormat::F16 && (tp.p.sym || 2 * gpr <= S::L);
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
                // `2·n·vals + 2·L` bytes); `pw` `n ≤ T` weights; the slot
                // `T` rows of `ne ≤ 2·L`.
                unsafe {
                    expand_scales_f16(s, src, vals, pw.unwrap_or(&[]), ix, ne, w, &mut zacc[0])
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
            if const { matches!(B, 2 | 4) } && nib {
                let mut jj0 = 0;
                while jj0 < h {
                    let mut a = [[s.zero(); 16]; NQ];
                    unroll!(4; i in 0, NQ => {
                        unroll!(4; f in 0, 4 => {
                            unroll!(8; k in 0, 8 => {
                                if f < nf && k < bb {
                                    let o = i * hdp + (jj0 + k + f * h) * S::L;
                                    a[i][f * fs + k] = s.load(acc.as_ptr().add(o));
                                }
                            });
                        });
                    });
                    for tt in 0..n {
                        if jj0 == 0 {
                            ah[0].token(tt);
                            ah[1].token(tt);
                        }
                        let row = tile.add(tt * rb + jj0 * S::L);
                        let w = wt.add(tt * ne + jj0);
                        let zr = zt.add(tt * ne + jj0);
                        let mut pb = [s.zero(); NQ];
                        if fold {
                            unroll!(4; i in 0, NQ => { pb[i] = s.bcast(pq[i].add(tt)); });
                        }
                        // One widening per byte vector; field `f` (vector
                        // `jj + f·h`) is `v_f − v_{f−1}` of the masked
                        // prefixes, exact and `2^{B·f}` times the field.
                        unroll!(8; k in 0, 8 => {
                            if k < bb {
                                let bytes = s.load_u8(row.add(k * S::L));
                                let mut v = [s.zero(); 4];
                                let mut x = [s.zero(); 4];
                                unroll!(4; f in 0, 4 => {
                                    if f < nf {
                                        v[f] = byte_prefix::<S, B>(s, bytes, f);
                                        x[f] = if f == 0 { v[0] } else { s.sub(v[f], v[f - 1]) };
                                    }
                                });
                                unroll!(4; f in 0, 4 => {
                                    if f < nf {
                                        let wf = s.bcast(w.add(f * h + k));
                                        if fold {
                                            let zf = s.bcast(zr.add(f * h + k));
                                            let xf = s.fma(x[f], wf, zf);
                                            unroll!(4; i in 0, NQ => {
                                                a[i][f * fs + k] = s.fma(xf, pb[i], a[i][f * fs + k]);
                                            });
                                        } else {
                                            a[0][f * fs + k] = s.fma(x[f], wf, a[0][f * fs + k]);
                                        }
                                    }
                                });
                            }
                        });
                    }
                    unroll!(4; i in 0, NQ => {
                        unroll!(4; f in 0, 4 => {
                            unroll!(8; k in 0, 8 => {
                                if f < nf && k < bb {
                                    let o = i * hdp + (jj0 + k + f * h) * S::L;
                                    s.store(acc.as_mut_ptr().add(o), a[i][f * fs + k]);
                                }
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
                    unroll!(4; i in 0, NQ => {
                        unroll!(cap = S::REGS / 2 / NQ; j in j0, j1 => {
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
                            unroll!(4; i in 0, NQ => { pb[i] = s.bcast(pq[i].add(tt)); });
                        }
                        unroll!(cap = S::REGS / 2 / NQ; j in j0, j1 => {
                            let x = codes_f32::<S, B>(s, row, g.hd, j);
                            if fold {
                                let x = s.fma(x, s.bcast(w.add(j)), s.bcast(zr.add(j)));
                                unroll!(4; i in 0, NQ => {
                                    a[i][j - j0] = s.fma(x, pb[i], a[i][j - j0]);
                                });
                            } else {
                                a[0][j - j0] = s.fma(x, s.bcast(w.add(j)), a[0][j - j0]);
                            }
                        });
                    }
                    unroll!(4; i in 0, NQ => {
                        unroll!(cap = S::REGS / 2 / NQ; j in j0, j1 => {
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
        for (c, a) in acc[..g.hd].iter_mut().enumerate() {
            *a += zs[zo + c / cpg] * zk;
        }
    }
}

/// Elements of a dense cache: `f32` or `f16`.
pub(crate) trait DenseElem: Copy {
    /// Load `L` elements as floats.
    ///
    /// # Safety
    /// `p` valid for `L` elements.
    unsafe fn load<S: Simd>(s: S, p: *const Self) -> S::F;
    /// One element as `f32`.
    fn get(self) -> f32;
}

impl DenseElem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const f32) -> S::F {
        // SAFETY: the caller's contract.
        unsafe { s.load(p) }
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

impl DenseElem for f16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const f16) -> S::F {
        // SAFETY: the caller's contract; `f16` is two little-endian bytes.
        unsafe { s.load_f16(p as *const u8) }
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

/// The prefetch of the dense tile at `t0` ([`DENSE_PREFETCH_TOKENS`]
/// ahead, into L2), spread over its `full` column steps
/// ([`Ahead::dense_step`]) when the tile's bytes split into whole lines
/// per step; otherwise issued here at once.
#[inline(always)]
fn dense_ahead<S: Simd>(base: *const u8, row: usize, full: usize, t0: usize) -> Ahead {
    let bytes = S::T * row;
    let p = base.wrapping_add((t0 + DENSE_PREFETCH_TOKENS) * row);
    if full > 0 && bytes.is_multiple_of(full) && (bytes / full).is_multiple_of(64) {
        Ahead {
            p,
            per: bytes / full,
        }
    } else {
        prefetch_to::<{ core::arch::x86_64::_MM_HINT_T1 }>(p, bytes);
        Ahead::NONE
    }
}

impl Ahead {
    /// Column step `j` of a dense tile ([`dense_ahead`]): its share of the
    /// tile's lines, into L2.
    #[inline(always)]
    fn dense_step(self, j: usize) {
        self.token_to::<{ core::arch::x86_64::_MM_HINT_T1 }>(j);
    }
}

/// Dense scores, `out[i·tokens + t] = q_i · k_t` over `k = [tokens, hd]`.
///
/// Panics unless `k.len()`, `q.len()` are multiples of `hd` and
/// `out.len() = n_q·tokens`.
#[inline(always)]
pub(crate) fn dense_scores<S: Simd, E: DenseElem>(
    s: S,
    hd: usize,
    k: &[E],
    q: &[f32],
    out: &mut [f32],
) {
    assert!(
        hd > 0 && k.len().is_multiple_of(hd) && q.len().is_multiple_of(hd),
        "dense: lengths"
    );
    let t_all = k.len() / hd;
    let nq = q.len() / hd;
    assert_eq!(out.len(), nq * t_all, "dense: output length");
    let full = hd / S::L;
    let tail = full * S::L;
    let kp = k.as_ptr();
    let row = hd * std::mem::size_of::<E>();
    let mut t0 = 0;
    while t0 + S::T <= t_all {
        // The same software prefetch as the packed kernels (a fair
        // baseline), spread over the tile's column steps.
        let ah = dense_ahead::<S>(kp as *const u8, row, full, t0);
        for i in 0..nq {
            let qi = &q[i * hd..(i + 1) * hd];
            let mut acc = [s.zero(); 16];
            for j in 0..full {
                if i == 0 {
                    ah.dense_step(j);
                }
                // SAFETY: rows `t0..t0+T ≤ tokens` of `k`; elements
                // `j·L..j·L+L ≤ hd` of each row and of `qi`.
                unsafe {
                    let qj = s.load(qi.as_ptr().add(j * S::L));
                    for (tt, a) in acc.iter_mut().enumerate().take(S::T) {
                        *a = s.fma(E::load(s, kp.add((t0 + tt) * hd + j * S::L)), qj, *a);
                    }
                }
            }
            let o = &mut out[i * t_all + t0..i * t_all + t0 + S::T];
            store_lanes(s, s.reduce(&acc), o);
            if tail < hd {
                for (tt, o) in o.iter_mut().enumerate() {
                    let row = &k[(t0 + tt) * hd..(t0 + tt + 1) * hd];
                    *o += (tail..hd).map(|c| qi[c] * row[c].get()).sum::<f32>();
                }
            }
        }
        t0 += S::T;
    }
    for t in t0..t_all {
        let row = &k[t * hd..(t + 1) * hd];
        for i in 0..nq {
            let qi = &q[i * hd..(i + 1) * hd];
            let mut a = s.zero();
            for j in 0..full {
                // SAFETY: elements `j·L..j·L+L ≤ hd` of `row` and `qi`.
                unsafe {
                    a = s.fma(
                        E::load(s, row.as_ptr().add(j * S::L)),
                        s.load(qi.as_ptr().add(j * S::L)),
                        a,
                    )
                };
            }
            out[i * t_all + t] = s.hsum(a) + (tail..hd).map(|c| qi[c] * row[c].get()).sum::<f32>();
        }
    }
}

/// Dense weighted sum, `out_i += Σ_t p[i·tokens + t] · v_t`.
///
/// Panics unless `v.len()`, `out.len()` are multiples of `hd` and
/// `p.len() = n_q·tokens`.
#[inline(always)]
pub(crate) fn dense_weighted_sum<S: Simd, E: DenseElem>(
    s: S,
    hd: usize,
    v: &[E],
    p: &[f32],
    out: &mut [f32],
) {
    assert!(
        hd > 0 && v.len().is_multiple_of(hd) && out.len().is_multiple_of(hd),
        "dense: lengths"
    );
    let t_all = v.len() / hd;
    let nq = out.len() / hd;
    assert_eq!(p.len(), nq * t_all, "dense: weights length");
    let full = hd / S::L;
    let tail = full * S::L;
    let vp = v.as_ptr();
    let row = hd * std::mem::size_of::<E>();
    let mut t0 = 0;
    while t0 + S::T <= t_all {
        let ah = dense_ahead::<S>(vp as *const u8, row, full, t0);
        for i in 0..nq {
            let pi = &p[i * t_all + t0..i * t_all + t0 + S::T];
            let oi = &mut out[i * hd..(i + 1) * hd];
            let mut w = [s.zero(); 16];
            for (w, p) in w.iter_mut().zip(pi) {
                *w = s.splat(*p);
            }
            for j in 0..full {
                if i == 0 {
                    ah.dense_step(j);
                }
                // SAFETY: rows `t0..t0+T ≤ tokens` of `v`; elements
                // `j·L..j·L+L ≤ hd` of each row and of `oi`.
                unsafe {
                    let mut a = [s.zero(); 4];
                    for (tt, w) in w.iter().enumerate().take(S::T) {
                        a[tt % 4] =
                            s.fma(E::load(s, vp.add((t0 + tt) * hd + j * S::L)), *w, a[tt % 4]);
                    }
                    let r = s.add(s.add(a[0], a[1]), s.add(a[2], a[3]));
                    let o = oi.as_mut_ptr().add(j * S::L);
                    s.store(o, s.add(s.load(o), r));
                }
            }
            for (c, o) in oi.iter_mut().enumerate().skip(tail) {
                *o += (0..S::T)
                    .map(|tt| pi[tt] * v[(t0 + tt) * hd + c].get())
                    .sum::<f32>();
            }
        }
        t0 += S::T;
    }
    for t in t0..t_all {
        let row = &v[t * hd..(t + 1) * hd];
        for i in 0..nq {
            let w = p[i * t_all + t];
            let oi = &mut out[i * hd..(i + 1) * hd];
            for j in 0..full {
                // SAFETY: elements `j·L..j·L+L ≤ hd` of `row` and `oi`.
                unsafe {
                    let o = oi.as_mut_ptr().add(j * S::L);
                    s.store(
                        o,
                        s.fma(
                            E::load(s, row.as_ptr().add(j * S::L)),
                            s.splat(w),
                            s.load(o),
                        ),
                    );
                }
            }
            for c in tail..hd {
                oi[c] += w * row[c].get();
            }
        }
    }
}

/// `x ← e^(x − max)`, returning `(max, Σ)`; see
/// [`crate::kernels::softmax_parts`].
#[inline(always)]
pub(crate) fn softmax_parts<S: Simd>(s: S, x: &mut [f32]) -> (f32, f32) {
    let n = x.len();
    let body = n / S::L * S::L;
    let p = x.as_mut_ptr();
    let mut m = s.splat(f32::NEG_INFINITY);
    for i in (0..body).step_by(S::L) {
        // SAFETY: `i + L ≤ body ≤ n`.
        m = s.max(m, unsafe { s.load(p.add(i)) });
    }
    let mx = x[body..].iter().fold(s.hmax(m), |a, &b| a.max(b));
    let mv = s.splat(mx);
    let mut sum = [s.zero(); 2];
    for (k, i) in (0..body).step_by(S::L).enumerate() {
        // SAFETY: `i + L ≤ body ≤ n`.
        unsafe {
            let e = s.exp(s.sub(s.load(p.add(i)), mv));
            s.store(p.add(i), e);
            sum[k % 2] = s.add(sum[k % 2], e);
        }
    }
    let mut total = s.hsum(s.add(sum[0], sum[1]));
    if body < n {
        // The tail through the same vector `exp`, padded with -inf (→ 0).
        let mut t = [f32::NEG_INFINITY; 16];
        t[..n - body].copy_from_slice(&x[body..]);
        // SAFETY: `t` holds 16 ≥ L floats.
        unsafe {
            let e = s.exp(s.sub(s.load(t.as_ptr()), mv));
            total += s.hsum(e);
            s.store(t.as_mut_ptr(), e);
        }
        x[body..].copy_from_slice(&t[..n - body]);
    }
    (mx, total)
}

/// `x ← x·k`.
#[inline(always)]
pub(crate) fn scale_in_place<S: Simd>(s: S, x: &mut [f32], k: f32) {
    let n = x.len();
    let body = n / S::L * S::L;
    let p = x.as_mut_ptr();
    for i in (0..body).step_by(S::L) {
        // SAFETY: `i + L ≤ body ≤ n`.
        unsafe { s.store(p.add(i), s.mul(s.load(p.add(i)), s.splat(k))) };
    }
    for v in &mut x[body..] {
        *v *= k;
    }
}
