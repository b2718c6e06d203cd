//! Scores of keys stored before RoPE (`CacheConfig::pre_rope`): each tile
//! of a packed head is unpacked and dequantized into the vector-major
//! scratch, every key turned to its position there, and the tile scored
//! against every query with one transposed reduction per query — the
//! uniform kernels' unfused path with a rotation between unpack and dot.
//!
//! The rotation of position `p` comes from two tables of `cos` and
//! (signed) `sin` per lane ([`RopeRows`]): `R(p) = R(hi)·R(lo)` with `hi`
//! a multiple of [`ROPE_LO`] and `lo = p − hi`. The kernel never forms
//! `R(p)`: as `q·R(hi)·R(lo)·k = (R(hi)ᵀ·q)·(R(lo)·k)`, it turns the
//! queries back by `R(hi)` once per [`ROPE_LO`] positions and each key by
//! `R(lo)` alone, `hi` the coarse row at or below the tile's first token
//! (so `lo` reaches past [`ROPE_LO`] by less than a tile: the fine table
//! has [`ROPE_SPILL`] rows more).

use crate::simd::{Backend, Kernel};
use crate::store::PackedHead;

/// Positions per coarse-table entry.
pub(crate) const ROPE_LO: usize = 256;

/// Rows of the fine table past [`ROPE_LO`]: a tile (at most 64 tokens)
/// that starts below a coarse row's end may reach past it.
pub(crate) const ROPE_SPILL: usize = 64;

/// The rotation tables of one layer, `lanes` floats per row.
///
/// With `adjacent` false (pairs `(i, i + dims/2)`) a lane is a pair:
/// `lanes = dims/2`, `S` the sine. With `adjacent` (pairs `(2i, 2i+1)`) a
/// lane is a channel: `lanes = dims`, each pair's cosine twice and its sine
/// negated on the first channel, so `x'_c = x_c·C_c + x_{c^1}·S_c`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RopeRows<'a> {
    pub(crate) adjacent: bool,
    pub(crate) lanes: usize,
    /// `(cos, sin)` rows of positions `0..ROPE_LO + ROPE_SPILL`.
    pub(crate) lo: (&'a [f32], &'a [f32]),
    /// The same rows with each lane's `cos` and `sin` side by side
    /// (`[rows, lanes, 2]`): one 64-bit gather element fetches both.
    pub(crate) lo_cs: &'a [f32],
    /// `(cos, sin)` rows of positions `0, ROPE_LO, 2·ROPE_LO, …`.
    pub(crate) hi: (&'a [f32], &'a [f32]),
}

/// `out[i·T + t] = q_i · R(p0 + t)·k̂_t` for every token `t` of `head` on
/// `backend`, when a SIMD kernel takes this shape (whole vectors per head
/// and per rotary half); `false` (nothing written) otherwise.
///
/// # Panics
/// If the lengths do not fit (`q` `nq·head_dim`, `out` `nq·tokens`) or the
/// tables do not cover the positions.
pub(crate) fn rope_scores_on(
    backend: Backend,
    head: &PackedHead<'_>,
    rope: &RopeRows<'_>,
    p0: usize,
    q: &[f32],
    out: &mut [f32],
) -> bool {
    let hd = head.layout().head_dim();
    let t = head.tokens();
    assert!(
        q.len().is_multiple_of(hd) && out.len() == q.len() / hd * t,
        "rope_scores: lengths"
    );
    let rows = |n: usize| n.div_ceil(ROPE_LO);
    assert!(
        rope.lo.0.len() >= (ROPE_LO + ROPE_SPILL) * rope.lanes
            && rope.lo.1.len() == rope.lo.0.len()
            && rope.hi.0.len() >= rows(p0 + t) * rope.lanes
            && rope.hi.1.len() == rope.hi.0.len(),
        "rope_scores: tables"
    );
    backend.dispatch(Args {
        head,
        rope,
        p0,
        q,
        out,
    })
}

struct Args<'a, 'h> {
    head: &'a PackedHead<'h>,
    rope: &'a RopeRows<'a>,
    p0: usize,
    q: &'a [f32],
    out: &'a mut [f32],
}

impl Kernel for Args<'_, '_> {
    type Output = bool;

    fn portable(self) -> bool {
        false
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: crate::simd::x86_64::Simd>(self, s: S) -> bool {
        use super::x86_64::generic;
        let Args {
            head,
            rope,
            p0,
            q,
            out,
        } = self;
        use super::x86_64::fused_shape;
        if !generic::rope_takes::<S>(head, rope) {
            return false;
        }
        super::x86_64::check_head(head, q.len(), out.len());
        // The compiled per-channel shapes whose rotation covers the head:
        // rows turned in registers (`generic::rope_scores_fused`).
        macro_rules! fused {
            ($b:literal, $hd:literal) => {
                if const { fused_shape::<S>($b, $hd) } {
                    if generic::rope_fused_takes::<S, $b, $hd>(head, rope) {
                        // SAFETY: as below, and `rope_fused_takes` holds.
                        unsafe {
                            generic::rope_scores_fused::<S, $b, $hd>(s, head, rope, p0, q, out)
                        };
                        return true;
                    }
                }
            };
        }
        let l = head.layout();
        match (l.scheme().bits(), l.head_dim()) {
            (2, 128) => fused!(2, 128),
            (4, 64) => fused!(4, 64),
            (4, 128) => fused!(4, 128),
            (4, 256) => fused!(4, 256),
            (8, 64) => fused!(8, 64),
            (8, 128) => fused!(8, 128),
            (8, 256) => fused!(8, 256),
            _ => {}
        }
        // SAFETY: `check_head` asserted the head's buffers and the lengths,
        // `rope_scores_on` the tables, `rope_takes` the shape; `s` proves
        // the features this body is compiled with.
        unsafe { generic::rope_scores(s, head, rope, p0, q, out) };
        true
    }
}

/// `[a₀, b₀, a₁, b₁, …]`: two tables of one length side by side, as
/// [`RopeRows::lo_cs`] and the turned queries of [`rope_outliers_on`] hold
/// them.
pub(crate) fn interleave(a: &[f32], b: &[f32]) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "interleave: lengths");
    a.iter().zip(b).flat_map(|(&x, &y)| [x, y]).collect()
}

/// One outlier set's entries of keys stored before RoPE, cut to the
/// tokens one coarse row turns: positions `t·hd + c` (little-endian `u16`,
/// `t` the token within the set) and f16 corrections, as stored.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RopeEntries<'a> {
    pub(crate) pos: &'a [u8],
    pub(crate) cor: &'a [u8],
    /// `log2(head_dim)`.
    pub(crate) shift: u32,
}

/// Whether [`rope_outliers_on`] takes this rotation for heads of `hd`
/// channels: `hd` a power of two, every channel rotated.
pub(crate) fn rope_outliers_take(rope: &RopeRows<'_>, hd: usize) -> bool {
    hd.is_power_of_two() && hd >= 2 && rope.lanes == if rope.adjacent { hd } else { hd / 2 }
}

/// `out[i·stride + t] += r·(a_i[c]·C + b_i[c]·S)` for each entry `(t, c,
/// r)` and query `i`, with `(C, S)` the fine tables' lane of channel `c`
/// in row `fine0 + t` and `(a_i[c], b_i[c])` the pair at `2·(i·hd + c)` of
/// `turned` (`[rows, hd, 2]`): the query turned back by the coarse row
/// and, per channel, the turned channel and the signed partner
/// ([`RopeTable`'s outliers]).
///
/// [`RopeTable`'s outliers]: crate::cache
///
/// # Panics
/// If [`rope_outliers_take`] fails, the lengths disagree, or an entry's
/// token falls outside `out` or outside the fine table.
pub(crate) fn rope_outliers_on(
    backend: Backend,
    e: RopeEntries<'_>,
    rope: &RopeRows<'_>,
    fine0: isize,
    turned: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = 1usize << e.shift;
    assert!(rope_outliers_take(rope, hd), "rope_outliers: shape");
    let n = e.pos.len() / 2;
    assert!(
        e.pos.len() == 2 * n && e.cor.len() == 2 * n,
        "rope_outliers: entries"
    );
    let rows = turned.len() / (2 * hd);
    assert!(
        turned.len() == rows * 2 * hd,
        "rope_outliers: turned queries"
    );
    if n == 0 || rows == 0 {
        return;
    }
    // Sixteen running minima and maxima, as `i16` with the sign bit
    // flipped (the order of the `u16`s): baseline x86-64 has vector
    // minima of signed words only, so this loop vectorizes.
    let (mut lo, mut hi) = ([i16::MAX; 16], [i16::MIN; 16]);
    let key = |p: &[u8]| (u16::from_le_bytes([p[0], p[1]]) ^ 0x8000) as i16;
    let mut chunks = e.pos.chunks_exact(32);
    for c in &mut chunks {
        for k in 0..16 {
            let p = key(&c[2 * k..2 * k + 2]);
            (lo[k], hi[k]) = (lo[k].min(p), hi[k].max(p));
        }
    }
    for (k, p) in chunks.remainder().chunks_exact(2).enumerate() {
        (lo[k], hi[k]) = (lo[k].min(key(p)), hi[k].max(key(p)));
    }
    let back = |x: i16| x as u16 ^ 0x8000;
    let lo = back(lo.into_iter().min().unwrap_or(i16::MAX));
    let hi = back(hi.into_iter().max().unwrap_or(i16::MIN));
    let (t_lo, t_hi) = (usize::from(lo) >> e.shift, usize::from(hi) >> e.shift);
    let fine_rows = (rope.lo.0.len() / rope.lanes)
        .min(rope.lo.1.len() / rope.lanes)
        .min(rope.lo_cs.len() / (2 * rope.lanes));
    assert!(
        fine0 + t_lo as isize >= 0
            && fine0 + (t_hi as isize) < fine_rows as isize
            && (rows - 1) * stride + t_hi < out.len()
            && (rows == 1 || stride > t_hi),
        "rope_outliers: an entry outside the tables or the scores"
    );
    backend.dispatch(Outliers {
        e,
        rope,
        fine0,
        turned,
        out,
        stride,
    })
}

struct Outliers<'a> {
    e: RopeEntries<'a>,
    rope: &'a RopeRows<'a>,
    fine0: isize,
    turned: &'a [f32],
    out: &'a mut [f32],
    stride: usize,
}

impl Kernel for Outliers<'_> {
    type Output = ();

    fn portable(mut self) {
        let n = self.e.pos.len() / 2;
        self.scalar(0..n);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: crate::simd::x86_64::Simd>(mut self, s: S) {
        let n = self.e.pos.len() / 2;
        let whole = n / S::L * S::L;
        let k = &mut self;
        // SAFETY: `rope_outliers_on` asserted the shape, the lengths and
        // that every entry's token lies in the fine tables and the scores;
        // `s` proves the features this body is compiled with.
        unsafe {
            super::x86_64::generic::rope_outliers(
                s, k.e, whole, k.rope, k.fine0, k.turned, k.out, k.stride,
            )
        };
        self.scalar(whole..n);
    }
}

impl Outliers<'_> {
    /// Entries `range`, one at a time: the same products in the same
    /// order as the vector loop, so both give the same bits.
    fn scalar(&mut self, range: std::ops::Range<usize>) {
        let (e, lanes) = (self.e, self.rope.lanes);
        let hd = 1usize << e.shift;
        let cs = self.rope.lo_cs;
        for j in range {
            let p = usize::from(u16::from_le_bytes([e.pos[2 * j], e.pos[2 * j + 1]]));
            let r = crate::quant::outliers::f16_to_f32(u16::from_le_bytes([
                e.cor[2 * j],
                e.cor[2 * j + 1],
            ]));
            let (t, c) = (p >> e.shift, p & (hd - 1));
            let lane = if self.rope.adjacent {
                c | 1
            } else {
                c & (lanes - 1)
            };
            // In range: `rope_outliers_on` asserted the token's fine row.
            let l = (self.fine0 + t as isize) as usize * lanes + lane;
            let (wc, ws) = (cs[2 * l], cs[2 * l + 1]);
            for (i, ab) in self.turned.chunks_exact(2 * hd).enumerate() {
                self.out[i * self.stride + t] += r * (ab[2 * c] * wc + ab[2 * c + 1] * ws);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// A fixed pseudo-random stream in `[-1, 1)`.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        }
        fn below(&mut self, n: usize) -> usize {
            ((self.next() + 1.0) * 0.5 * n as f32) as usize % n.max(1)
        }
    }

    /// Every backend against the definition (the rotation of each entry's
    /// channel written out per style), bit-identical across backends: entry
    /// counts with and without whole vectors, one and several queries, a
    /// fine row origin below zero (a set split at a coarse row) and above.
    #[test]
    fn every_backend_adds_rotated_outlier_entries() {
        let mut g = Lcg(7);
        for (hd, adjacent) in [(128, false), (64, true), (128, true), (32, false)] {
            let lanes = if adjacent { hd } else { hd / 2 };
            let fine_rows = ROPE_LO + ROPE_SPILL;
            let mut table = || -> Vec<f32> { (0..fine_rows * lanes).map(|_| g.next()).collect() };
            let lo = (table(), table());
            let cs = interleave(&lo.0, &lo.1);
            let rope = RopeRows {
                adjacent,
                lanes,
                lo: (&lo.0, &lo.1),
                lo_cs: &cs,
                hi: (&[], &[]),
            };
            for (n, rows, fine0, tokens) in [
                (0, 1, 0isize, 8usize),
                (1, 1, 5, 8),
                (15, 2, 0, 4),
                (16, 1, 100, 64),
                (17, 3, -40, 128),
                (163, 1, 128, 128),
                (200, 4, -100, 128),
            ] {
                // Ascending positions among the tokens the fine table
                // reaches from `fine0`.
                let t0 = (-fine0).max(0) as usize;
                let span = (tokens - t0) * hd;
                let mut pos: Vec<usize> = Vec::new();
                while pos.len() < n.min(span) {
                    let p = t0 * hd + g.below(span);
                    if !pos.contains(&p) {
                        pos.push(p);
                    }
                }
                pos.sort_unstable();
                let cor: Vec<f16> = pos.iter().map(|_| f16::from_f32(g.next() * 8.0)).collect();
                let pb: Vec<u8> = pos.iter().flat_map(|&p| (p as u16).to_le_bytes()).collect();
                let cb: Vec<u8> = cor.iter().flat_map(|c| c.to_bits().to_le_bytes()).collect();
                let ta: Vec<f32> = (0..rows * hd).map(|_| g.next()).collect();
                let tb: Vec<f32> = (0..rows * hd).map(|_| g.next()).collect();
                let stride = tokens + 3;
                let base: Vec<f32> = (0..rows * stride).map(|_| g.next()).collect();
                let mut want = base.clone();
                for (&p, r) in pos.iter().zip(&cor) {
                    let (t, c) = (p / hd, p % hd);
                    let lane = match adjacent {
                        true => c | 1,
                        false => c % lanes,
                    };
                    let l = (fine0 + t as isize) as usize * lanes + lane;
                    for i in 0..rows {
                        let (a, b) = (ta[i * hd + c], tb[i * hd + c]);
                        want[i * stride + t] += r.to_f32() * (a * lo.0[l] + b * lo.1[l]);
                    }
                }
                let e = RopeEntries {
                    pos: &pb,
                    cor: &cb,
                    shift: hd.trailing_zeros(),
                };
                let ab = interleave(&ta, &tb);
                for &backend in &Backend::available() {
                    let mut got = base.clone();
                    rope_outliers_on(backend, e, &rope, fine0, &ab, &mut got, stride);
                    assert_eq!(got, want, "{backend:?} hd {hd} adjacent {adjacent} n {n}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "rope_outliers: an entry outside")]
    fn an_entry_past_the_fine_table_is_refused() {
        let lo = vec![0f32; (ROPE_LO + ROPE_SPILL) * 32];
        let rope = RopeRows {
            adjacent: false,
            lanes: 32,
            lo: (&lo, &lo),
            lo_cs: &interleave(&lo, &lo),
            hi: (&[], &[]),
        };
        let pos = (64u16 * 2).to_le_bytes();
        let e = RopeEntries {
            pos: &pos,
            cor: &[0, 0],
            shift: 6,
        };
        let q = vec![0f32; 128];
        let mut out = vec![0f32; 8];
        // Token 2 from a fine row origin of −3: row −1.
        rope_outliers_on(Backend::Portable, e, &rope, -3, &q, &mut out, 8);
    }
}
