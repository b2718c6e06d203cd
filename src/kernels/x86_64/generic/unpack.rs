//! Code rows to floats: the tile buffer, the row shape, and the shift-and-mask unpack of each plane.

use super::*;

/// A zeroed `f32` buffer whose start is 64-byte aligned (whole cache lines,
/// so a 512-bit load never splits one).
pub(crate) struct Buf {
    pub(crate) v: Vec<f32>,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

thread_local! {
    /// Buffers of finished kernel calls, for the next call on this thread:
    /// a cache split into many small pages makes one call per page, and
    /// allocating each call's scratch anew cost a fifth of the time at
    /// 16-token pages.
    static SPARE: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Spare buffers kept per thread.
const SPARE_BUFS: usize = 16;

impl Buf {
    pub(crate) fn new(len: usize) -> Buf {
        let want = len + 16;
        let mut v = SPARE
            .try_with(|f| {
                let mut f = f.borrow_mut();
                // The first spare that fits, else the largest one (grown).
                let i = f
                    .iter()
                    .position(|b| b.capacity() >= want)
                    .or_else(|| (0..f.len()).max_by_key(|&i| f[i].capacity()));
                i.map(|i| f.swap_remove(i))
            })
            .ok()
            .flatten()
            .unwrap_or_default();
        v.clear();
        v.resize(want, 0.0);
        // An f32 pointer is at most 15 elements from a 64-byte boundary.
        let off = v.as_ptr().align_offset(64).min(16);
        Buf { v, off, len }
    }
    #[inline(always)]
    pub(crate) fn s(&self) -> &[f32] {
        &self.v[self.off..self.off + self.len]
    }
    #[inline(always)]
    pub(crate) fn m(&mut self) -> &mut [f32] {
        &mut self.v[self.off..self.off + self.len]
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        // (During thread teardown the spares are gone: the buffer is freed.)
        let _ = SPARE.try_with(|f| {
            let mut f = f.borrow_mut();
            if f.len() < SPARE_BUFS {
                f.push(v);
            }
        });
    }
}

/// The shape of one code row as the tile loops see it. Made by
/// [`Geo::new`] with `HD` either the head dimension (a compile-time
/// constant: every loop below unrolls and every branch on the shape folds)
/// or 0 (the run-time fallback for other head dimensions).
#[derive(Clone, Copy)]
pub(crate) struct Geo {
    /// `head_dim`.
    pub(crate) hd: usize,
    /// `head_dim` rounded up to whole vectors.
    pub(crate) hdp: usize,
    /// Vectors per row, `hdp / L`.
    pub(crate) nch: usize,
    /// Bytes per packed row.
    pub(crate) rb: usize,
    /// Every plane of the row splits into whole vectors (or, with 16
    /// lanes, exact half vectors): the shift-and-mask unpack applies.
    pub(crate) fast: bool,
    /// Bits per code (the `B` of the kernel, or the head's width when the
    /// kernel was compiled for any width, `B = 0`).
    pub(crate) bits: u8,
}

impl Geo {
    #[inline(always)]
    pub(crate) fn new<S: Simd, const B: u8, const HD: usize>(hd_rt: usize, bits_rt: u8) -> Geo {
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
pub(crate) trait Deq<S: Simd>: Copy {
    /// Dequantize (or not) vector `j` of tile row `tt`.
    ///
    /// # Safety
    /// `tt < T` and `j < nch` of the tile the value was built for.
    unsafe fn apply(self, s: S, tt: usize, j: usize, x: S::F) -> S::F;
}

/// Codes as floats, no dequantization.
#[derive(Clone, Copy)]
pub(crate) struct Raw;

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
pub(crate) struct Tile3<S: Simd> {
    pub(crate) c: S::C3,
    /// `T` rows of `hd` code bytes.
    pub(crate) buf: Vec<u8>,
    pub(crate) hd: usize,
}

impl<S: Simd> Tile3<S> {
    /// `Some` for 3-bit rows when the ISA transcodes rows of `hd`.
    #[inline(always)]
    pub(crate) fn new<const B: u8>(s: S, hd: usize) -> Option<Tile3<S>> {
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
    pub(crate) unsafe fn load(&mut self, s: S, rows: *const u8, rb: usize, n: usize) -> *const u8 {
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
    pub(crate) fn geo(&self, g: Geo) -> Geo {
        Geo { rb: self.hd, ..g }
    }
}

/// Most vectors a row may have for the per-token fast path.
pub(crate) const MAX_NCH: usize = 32;
/// Floats of padding after a tile's params, so whole-vector reads of a
/// token's groups never leave the buffer.
pub(crate) const PAD: usize = 64;

/// Per-token groups of whole vectors: `x = code·scale_tg + zero_tg`, the
/// scale of token `tt`, group `g` at `sc[tt·stride + g]`, its zero at
/// `ze[tt·stride + g]`, and vector `j` in group `goff[j]`.
#[derive(Clone, Copy)]
pub(crate) struct PerToken {
    pub(crate) sc: *const f32,
    pub(crate) ze: *const f32,
    pub(crate) stride: usize,
    pub(crate) goff: [u32; MAX_NCH],
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
pub(crate) struct Rows {
    pub(crate) sc: *const f32,
    pub(crate) ze: *const f32,
    pub(crate) stride: usize,
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
pub(crate) unsafe fn unpack_tile<S: Simd, const B: u8, D: Deq<S>>(
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

/// What [`channel_tiles`] does with each tile once it is dequantized.
pub(crate) trait TileWork<S: Simd> {
    /// Tokens `t0..t0 + n` of the head, dequantized in the vector-major
    /// scratch `scr` (rows `n..T` zero).
    ///
    /// # Safety
    /// `scr` is valid for `T·hdp` floats of the head's [`Geo`].
    unsafe fn tile(&mut self, s: S, t0: usize, n: usize, scr: *mut f32);
}

/// A per-channel head block by block: each block's params widened, each of
/// its tiles unpacked and dequantized into `scr` (`x_c = code_c·sc_c +
/// ze_c`), then handed to `work`.
///
/// # Safety
/// [`super::check_head`] passed for `head`; `g` and `p` were built for it;
/// `scr` holds `T·hdp` floats and `u8buf` `hdp` bytes whose bytes `hd..hdp`
/// are zero.
#[inline(always)]
pub(crate) unsafe fn channel_tiles<S: Simd, const B: u8, W: TileWork<S>>(
    s: S,
    g: Geo,
    head: &PackedHead<'_>,
    p: &Plan,
    scr: &mut Buf,
    u8buf: &mut [u8],
    work: &mut W,
) {
    let (hd, hdp, t_all) = (g.hd, g.hdp, p.tokens);
    let gl = head.layout().group_len();
    let codes = head.codes().as_ptr();
    let (mut sc, mut ze) = (Buf::new(hdp), Buf::new(hdp));
    for k in 0..t_all.div_ceil(gl) {
        block_params(s, head, p, hd, k, sc.m(), ze.m());
        let d = Rows {
            sc: sc.s().as_ptr(),
            ze: ze.s().as_ptr(),
            stride: 0,
        };
        let t_end = ((k + 1) * gl).min(t_all);
        let mut t0 = k * gl;
        while t0 < t_end {
            let n = S::T.min(t_end - t0);
            prefetch_ahead(codes, g.rb, t0, n, t_all);
            // SAFETY: rows `t0..t0 + n` are in the codes (`check_head`);
            // the scratch holds `T` rows of `hdp`; `sc`/`ze` hold the
            // block's `hdp` params and are not written meanwhile.
            unsafe {
                let sp = scr.m().as_mut_ptr();
                unpack_tile::<S, B, Rows>(s, g, codes.add(t0 * g.rb), n, sp, u8buf.as_mut_ptr(), d);
                work.tile(s, t0, n, sp);
            }
            t0 += n;
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
pub(crate) unsafe fn unpack_row<S: Simd, const B: u8, D: Deq<S>>(
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
pub(crate) unsafe fn unpack_row_any<S: Simd, D: Deq<S>>(
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
pub(crate) unsafe fn plane<
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
pub(crate) unsafe fn emit<S: Simd, D: Deq<S>, const FIRST: bool, const LAST: bool>(
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
pub(crate) unsafe fn unpack_row_scalar<S: Simd, const B: u8, D: Deq<S>>(
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
pub(crate) unsafe fn codes_vec<S: Simd, const B: u8>(
    s: S,
    row: *const u8,
    hd: usize,
    j: usize,
) -> S::I {
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
pub(crate) unsafe fn codes_f32<S: Simd, const B: u8>(
    s: S,
    row: *const u8,
    hd: usize,
    j: usize,
) -> S::F {
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
pub(crate) unsafe fn pf<S: Simd, const P: u32>(s: S, src: *const u8, m: usize, j: usize) -> S::F {
    let e = j * S::L;
    if m.is_multiple_of(S::L) {
        let bit = P * (e / m) as u32;
        // SAFETY: bytes `e mod m .. + L ≤ m`.
        let v = unsafe { s.load_u8(src.add(e % m)) };
        // The field's nibble at the bottom (the higher bits are ignored),
        // then the field within it: the two fields of a 2-bit nibble (four
        // of a 1-bit one) share one shift, and the low nibble needs none.
        let v = match bit / 4 {
            0 => v,
            k => s.shr_mask(v, 4 * k as i32, u32::MAX),
        };
        match (P, bit % 4) {
            (1, 1) => s.field_at_f32::<P, 1>(v),
            (1, 3) => s.field_at_f32::<P, 3>(v),
            (1 | 2, 2) => s.field_at_f32::<P, 2>(v),
            // `P` divides 4, so the field never crosses the nibble.
            _ => s.field_at_f32::<P, 0>(v),
        }
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
pub(crate) unsafe fn pv<S: Simd, const P: u32, const SH: u32>(
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
