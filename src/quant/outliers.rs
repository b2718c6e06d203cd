//! Dense-and-sparse storage ([`Sparse`]): a codec's grid for the bulk of
//! the values and a short side list for the few that would stretch it.
//!
//! A group's range is set by its extremes; one large value in a row or a
//! channel widens every step of its group. [`Sparse`] takes, per param set
//! (a head's row per-token, a head's block per-channel), the `n` values
//! whose removal shrinks their groups' ranges the most, quantizes the set
//! with those values pulled into what remains of their group's range, and
//! stores per value a `(position, correction)` entry: the correction is
//! the value minus what the grid decodes at that position, in f16. A decode
//! adds the corrections; the fused scores and weighted sums add
//! `q·correction` and `p·correction` after the grid's kernel, without a
//! dequantized copy.
//!
//! `n` comes from a fraction of the set's elements ([`Codec::with_outliers`]),
//! rounded up, at least one. Entries cost [`OUTLIER_BYTES`] each, counted by
//! [`Layout::bytes`] and [`Layout::effective_bits`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use half::f16;

use super::codec::{Codec, KvCodec, Pending};
use crate::error::{Error, Result};
use crate::kernels::sparse::{rows_axpy_on, transpose_on, Mat};
use crate::scheme::{Axis, Layout, Mode, OUTLIER_BYTES};
use crate::simd::{Backend, Kernel};
use crate::store::PackedHead;

/// The largest `|x|` a codec with outliers stores: its corrections are f16,
/// and a correction is at most the value's distance to its group's range,
/// below twice this.
pub const OUTLIER_LIMIT: f32 = 16384.0;

/// Outlier fractions are kept in units of 1/10 000 of the elements.
pub(crate) const PER: u32 = 10_000;

/// Entries per param set of `elements` values for a fraction of `per`/10 000.
pub(crate) fn count(per: u16, elements: usize) -> usize {
    (u32::from(per) as usize * elements)
        .div_ceil(PER as usize)
        .max(1)
}

/// A codec with `n` outliers per param set kept apart as f16 corrections
/// (see the [module docs](self)).
#[derive(Debug)]
pub struct Sparse<C> {
    inner: C,
    /// The same grid for one head: a per-channel block is encoded head by
    /// head from that head's values alone, without copying whole rows.
    single: Arc<dyn KvCodec>,
    layout: Layout,
    per: u16,
}

impl<C: KvCodec> Sparse<C> {
    /// `inner` with `per`/10 000 of each param set's elements (rounded up,
    /// at least one) kept as outliers.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a fraction outside (0, 0.5] or an
    /// inner codec that already has outliers or transforms its rows (a
    /// rotation goes around the outliers, not inside);
    /// [`Error::SchemeShape`] as [`Layout`]'s outlier checks.
    pub fn new(inner: C, per: u16) -> Result<Self> {
        let op = "Sparse::new";
        let il = *inner.layout();
        if per == 0 || u32::from(per) > PER / 2 {
            return Err(Error::InvalidConfig {
                op,
                what: format!(
                    "an outlier fraction of {} %: it must be in (0, 50] %",
                    f64::from(per) / 100.0
                ),
            });
        }
        if il.outliers() > 0 || inner.transforms() {
            return Err(Error::InvalidConfig {
                op,
                what: "outliers wrap a plain grid or codebook".into(),
            });
        }
        let layout = il.with_outliers(count(per, il.set_elements()))?;
        let single = inner.spec().build(1, il.head_dim())?;
        Ok(Sparse {
            inner,
            single,
            layout,
            per,
        })
    }

    /// Pick the outliers of one param set `x` (`[tb, hd]` token-major,
    /// `tb` 1 per-token), pull them into their groups' remaining ranges in
    /// `y` (a copy of `x`), and return their positions, ascending.
    fn pick(&self, x: &[f32], y: &mut [f32], tb: usize, sel: &mut Selector) {
        let l = self.inner.layout();
        let hd = l.head_dim();
        let sym = l.scheme().mode() == Mode::Symmetric;
        match l.scheme().axis() {
            Axis::PerToken => {
                let cpg = l.channels_per_group().min(hd);
                sel.run(
                    x,
                    hd / cpg,
                    |g| g * cpg..(g + 1) * cpg,
                    false,
                    sym,
                    self.layout.outliers(),
                );
            }
            Axis::PerChannel => {
                sel.run(
                    x,
                    hd,
                    |c| (c..tb * hd).step_by(hd),
                    true,
                    sym,
                    self.layout.outliers(),
                );
            }
        }
        y.copy_from_slice(x);
        for &(pos, lo, hi) in &sel.picked {
            y[pos] = x[pos].clamp(lo, hi);
        }
        // Groups down to one value (a short trailing block) leave entries
        // unpicked: they take the first free positions, holding the exact
        // error there, or zero past the block's tokens. Every entry is
        // written and positions stay distinct.
        let n = self.layout.outliers();
        if sel.picked.len() < n {
            let mut used = vec![false; self.layout.set_elements()];
            for &(pos, _, _) in &sel.picked {
                used[pos] = true;
            }
            let free = (0..used.len()).filter(|&p| !used[p]);
            let more: Vec<usize> = free.take(n - sel.picked.len()).collect();
            sel.picked.extend(more.into_iter().map(|p| (p, 0.0, 0.0)));
        }
        sel.picked.sort_unstable_by_key(|p| p.0);
    }

    /// Write one set's entries (positions, then corrections) for the
    /// positions `picked`: `x` minus the grid's decode `dq` there (zero
    /// past `x`, a short block's missing tokens).
    fn write_entries(picked: &[usize], x: &[f32], dq: &[f32], out: &mut [u8]) {
        let (pos, cor) = out.split_at_mut(2 * picked.len());
        for ((pb, cb), &p) in pos
            .chunks_exact_mut(2)
            .zip(cor.chunks_exact_mut(2))
            .zip(picked)
        {
            // (Positions are below 2^16: the layout checks the set size.)
            pb.copy_from_slice(&(p as u16).to_le_bytes());
            let r = if p < x.len() { x[p] - dq[p] } else { 0.0 };
            cb.copy_from_slice(&f16::from_f32(r).to_le_bytes());
        }
    }
}

/// What an encode works in, kept per thread: an append allocates nothing.
#[derive(Debug, Default)]
struct Scratch {
    sel: Selector,
    /// The rows as the grid gets them, their decode, and the picked
    /// positions of every head.
    y: Vec<f32>,
    dq: Vec<f32>,
    picked: Vec<usize>,
    /// One head's block (`[tokens, hd]`), per-channel.
    x: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// The greedy choice of outliers: one at a time, the end (low or high) of
/// a group whose removal shrinks that group's range (squared) the most.
/// A group is scanned for its two lowest and two highest live values, and
/// scanned again only when a pick takes from it: a set of `E` values in
/// groups of `L` costs `E + n·L` reads, not a sort of every group.
#[derive(Debug)]
struct Selector {
    /// Where the column scan runs.
    backend: Backend,
    /// Whether each position of the set has been taken.
    taken: Vec<bool>,
    /// Per group: its live extremes.
    ext: Vec<Ends>,
    /// `(position, low, high)`: the position and its group's range once
    /// every pick is made.
    picked: Vec<(usize, f32, f32)>,
}

impl Default for Selector {
    fn default() -> Self {
        Selector {
            backend: Backend::Portable,
            taken: Vec::new(),
            ext: Vec::new(),
            picked: Vec::new(),
        }
    }
}

/// [`Ends::columns`] as a kernel.
struct Columns<'a> {
    x: &'a [f32],
    w: usize,
    out: &'a mut Vec<Ends>,
}

impl Kernel for Columns<'_> {
    type Output = ();

    fn portable(self) {
        Ends::columns_body(self.x, self.w, self.out);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: crate::simd::x86_64::Simd>(self, _s: S) {
        Ends::columns_body(self.x, self.w, self.out);
    }
}

/// A group's two lowest and two highest live values (positions), and how
/// many are live.
#[derive(Debug, Clone, Copy, Default)]
struct Ends {
    lo: [usize; 2],
    hi: [usize; 2],
    live: usize,
}

impl Ends {
    /// [`scan`](Self::scan) of every column of `x` (rows of `w` values) at
    /// once, row by row: each row's update is the same selects for every
    /// column, so it runs on vectors (compiled in `backend`'s trampoline).
    fn columns(backend: Backend, x: &[f32], w: usize, out: &mut Vec<Ends>) {
        backend.dispatch(Columns { x, w, out });
    }

    #[inline(always)]
    fn columns_body(x: &[f32], w: usize, out: &mut Vec<Ends>) {
        let rows = x.len() / w;
        let (mut lo0, mut hi0) = (x[..w].to_vec(), x[..w].to_vec());
        let (mut lo1, mut hi1) = (vec![f32::INFINITY; w], vec![f32::NEG_INFINITY; w]);
        let init: Vec<u32> = (0..w as u32).collect();
        let (mut plo0, mut plo1, mut phi0, mut phi1) =
            (init.clone(), init.clone(), init.clone(), init);
        for t in 1..rows {
            let row = &x[t * w..(t + 1) * w];
            let base = (t * w) as u32;
            for c in 0..w {
                let (v, p) = (row[c], base + c as u32);
                // Strict comparisons: among equal values the first stays.
                // Low and high sides are written out: through a shared
                // helper on pairs the loop stops vectorizing (extend
                // 18 → 26 ms in `cargo bench --bench cache`).
                let (below0, below1) = (v < lo0[c], v < lo1[c]);
                plo1[c] = if below0 {
                    plo0[c]
                } else if below1 {
                    p
                } else {
                    plo1[c]
                };
                lo1[c] = if below0 {
                    lo0[c]
                } else if below1 {
                    v
                } else {
                    lo1[c]
                };
                plo0[c] = if below0 { p } else { plo0[c] };
                lo0[c] = if below0 { v } else { lo0[c] };
                let (above0, above1) = (v > hi0[c], v > hi1[c]);
                phi1[c] = if above0 {
                    phi0[c]
                } else if above1 {
                    p
                } else {
                    phi1[c]
                };
                hi1[c] = if above0 {
                    hi0[c]
                } else if above1 {
                    v
                } else {
                    hi1[c]
                };
                phi0[c] = if above0 { p } else { phi0[c] };
                hi0[c] = if above0 { v } else { hi0[c] };
            }
        }
        out.extend((0..w).map(|c| Ends {
            lo: [plo0[c] as usize, plo1[c] as usize],
            hi: [phi0[c] as usize, phi1[c] as usize],
            live: rows,
        }));
    }

    fn scan(x: &[f32], members: impl Iterator<Item = usize>, taken: &[bool]) -> Ends {
        let (mut lo, mut hi) = ([f32::INFINITY; 2], [f32::NEG_INFINITY; 2]);
        let (mut pl, mut ph) = ([usize::MAX; 2], [usize::MAX; 2]);
        let mut live = 0;
        for p in members.filter(|&p| !taken[p]) {
            let v = x[p];
            // Selects, not branches: which value is lowest is data, and a
            // mispredicted branch per value cost more than the update.
            // Strict comparisons: among equal values the first stays.
            let (b0, b1) = (v < lo[0], v < lo[1]);
            pl[1] = if b0 {
                pl[0]
            } else if b1 {
                p
            } else {
                pl[1]
            };
            lo[1] = if b0 {
                lo[0]
            } else if b1 {
                v
            } else {
                lo[1]
            };
            pl[0] = if b0 { p } else { pl[0] };
            lo[0] = if b0 { v } else { lo[0] };
            let (a0, a1) = (v > hi[0], v > hi[1]);
            ph[1] = if a0 {
                ph[0]
            } else if a1 {
                p
            } else {
                ph[1]
            };
            hi[1] = if a0 {
                hi[0]
            } else if a1 {
                v
            } else {
                hi[1]
            };
            ph[0] = if a0 { p } else { ph[0] };
            hi[0] = if a0 { v } else { hi[0] };
            live += 1;
        }
        if live == 1 {
            (pl[1], ph[1]) = (pl[0], ph[0]);
        }
        Ends {
            lo: pl,
            hi: ph,
            live,
        }
    }
}

impl Selector {
    /// `columns`: the groups are the `groups` columns of `x` (rows of
    /// `groups` values; per-channel blocks), first scanned row by row.
    #[allow(clippy::too_many_arguments)]
    fn run<I: Iterator<Item = usize>>(
        &mut self,
        x: &[f32],
        groups: usize,
        members: impl Fn(usize) -> I,
        columns: bool,
        sym: bool,
        n: usize,
    ) {
        self.taken.clear();
        self.taken.resize(x.len(), false);
        self.ext.clear();
        if columns {
            Ends::columns(self.backend, x, groups, &mut self.ext);
        } else {
            for g in 0..groups {
                self.ext.push(Ends::scan(x, members(g), &self.taken));
            }
        }
        let range = |lo: f32, hi: f32| {
            if sym {
                lo.abs().max(hi.abs())
            } else {
                hi - lo
            }
        };
        // The better end of a group to drop: (gain, drop the high end).
        let best = |e: &Ends| -> Option<(f32, bool)> {
            if e.live < 2 {
                return None;
            }
            let now = range(x[e.lo[0]], x[e.hi[0]]);
            let hi = range(x[e.lo[0]], x[e.hi[1]]);
            let lo = range(x[e.lo[1]], x[e.hi[0]]);
            let (after, high) = if hi <= lo { (hi, true) } else { (lo, false) };
            Some((now * now - after * after, high))
        };
        // Each group's better end in a max-heap by gain (ties: the lowest
        // group), so a pick costs a log, not a scan of every group; only
        // the picked group's entry changes.
        let key = |g: usize, (gain, high): (f32, bool)| (gain.max(0.0).to_bits(), Reverse(g), high);
        let mut heap = BinaryHeap::with_capacity(groups);
        for (g, e) in self.ext.iter().enumerate() {
            if let Some(b) = best(e) {
                heap.push(key(g, b));
            }
        }
        let mut dropped = Vec::with_capacity(n);
        for _ in 0..n {
            // Every group down to one value: nothing left to take (only for
            // sets of at most two values per group, refused by the layout).
            let Some((_, Reverse(g), high)) = heap.pop() else {
                break;
            };
            let e = self.ext[g];
            let p = if high { e.hi[0] } else { e.lo[0] };
            self.taken[p] = true;
            dropped.push((g, p));
            self.ext[g] = Ends::scan(x, members(g), &self.taken);
            if let Some(b) = best(&self.ext[g]) {
                heap.push(key(g, b));
            }
        }
        self.picked.clear();
        for (g, pos) in dropped {
            let e = self.ext[g];
            let (lo, hi) = (x[e.lo[0]], x[e.hi[0]]);
            let (lo, hi) = if sym {
                let m = lo.abs().max(hi.abs());
                (-m, m)
            } else {
                (lo, hi)
            };
            self.picked.push((pos, lo, hi));
        }
    }
}

/// An f16's value, inline and without a branch on its class (the post
/// passes convert one or two corrections per token; a call per value to a
/// runtime-dispatched conversion costs more than the rest of the work).
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let em = h & 0x7fff;
    // Exponent and mantissa moved into f32's fields, then scaled by
    // 2^(127−15): exact for normal and subnormal values alike.
    let v = f32::from_bits(em << 13) * f32::from_bits((254 - 15) << 23);
    let v = if em >= 0x7c00 {
        // Infinity and NaN keep an all-ones exponent.
        f32::from_bits((em << 13) | 0x7f80_0000)
    } else {
        v
    };
    f32::from_bits(v.to_bits() | (h & 0x8000) << 16)
}

/// One head's entries as the post-passes read them.
struct Sets<'a> {
    bytes: &'a [u8],
    n: usize,
    hd: usize,
    /// Tokens per set, and `log2(hd)` when `hd` is a power of two (a
    /// per-channel position splits by a shift, not a division).
    bt: usize,
    shift: Option<u32>,
    tokens: usize,
}

impl<'a> Sets<'a> {
    fn new(head: &PackedHead<'a>) -> Option<Self> {
        let l = &head.layout;
        let n = l.outliers();
        (n > 0).then(|| Sets {
            bytes: head.outliers,
            n,
            hd: l.head_dim(),
            bt: l.block_tokens(),
            shift: l
                .head_dim()
                .is_power_of_two()
                .then(|| l.head_dim().trailing_zeros()),
            tokens: head.tokens,
        })
    }

    /// Calls `f(token, channel, correction)` for each entry whose token is
    /// in the view, set by set.
    #[inline(always)]
    fn each(&self, mut f: impl FnMut(usize, usize, f32)) {
        let n = self.n;
        for (k, set) in self.bytes.chunks_exact(n * OUTLIER_BYTES).enumerate() {
            let (pos, cor) = set.split_at(2 * n);
            let base = k * self.bt;
            for (p, r) in pos.chunks_exact(2).zip(cor.chunks_exact(2)) {
                let p = usize::from(u16::from_le_bytes([p[0], p[1]]));
                let r = f16_to_f32(u16::from_le_bytes([r[0], r[1]]));
                let (t, c) = match (self.bt, self.shift) {
                    (1, _) => (base, p),
                    (_, Some(s)) => (base + (p >> s), p & (self.hd - 1)),
                    _ => (base + p / self.hd, p % self.hd),
                };
                if t < self.tokens {
                    f(t, c, r);
                }
            }
        }
    }
}

/// Calls `f(token, channel, correction)` for each entry of `head` whose
/// token is in the view.
pub(crate) fn for_each(head: &PackedHead<'_>, f: impl FnMut(usize, usize, f32)) {
    if let Some(s) = Sets::new(head) {
        s.each(f);
    }
}

/// Calls `f(first token, positions, corrections)` for each set of `head`
/// that starts in the view, with the set's bytes as stored (positions
/// ascending; entries past the view's tokens included).
pub(crate) fn for_each_set(head: &PackedHead<'_>, mut f: impl FnMut(usize, &[u8], &[u8])) {
    let Some(s) = Sets::new(head) else { return };
    for (k, set) in s.bytes.chunks_exact(s.n * OUTLIER_BYTES).enumerate() {
        let base = k * s.bt;
        if base >= s.tokens {
            break;
        }
        let (pos, cor) = set.split_at(2 * s.n);
        f(base, pos, cor);
    }
}

/// How many of a set's ascending positions (`u16` each) lie below `lim`.
pub(crate) fn entries_below(pos: &[u8], lim: usize) -> usize {
    let (mut lo, mut hi) = (0, pos.len() / 2);
    while lo < hi {
        let m = (lo + hi) / 2;
        if usize::from(u16::from_le_bytes([pos[2 * m], pos[2 * m + 1]])) < lim {
            lo = m + 1;
        } else {
            hi = m;
        }
    }
    lo
}

/// `out[t·hd + c] += correction` for each entry: a decode's last step.
pub(crate) fn add_to_rows(head: &PackedHead<'_>, out: &mut [f32]) {
    let hd = head.layout.head_dim();
    for_each(head, |t, c, r| out[t * hd + c] += r);
}

/// `out[i·T + t] += q_i[c]·correction` for each entry: the scores' part
/// the grid does not hold.
pub(crate) fn add_scores(backend: Backend, head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
    let (hd, t_all) = (head.layout.head_dim(), head.tokens);
    match q.len() / hd {
        1 => for_each(head, |t, c, r| out[t] += q[c] * r),
        nq if nq >= WIDE_QUERIES => wide_scores(backend, head, q, out, nq),
        nq => {
            // Entry by entry, each entry into every query: a few rows of
            // scores a row of tokens apart share an L1 set without
            // evicting each other.
            for_each(head, |t, c, r| {
                for i in 0..nq {
                    out[i * t_all + t] += q[i * hd + c] * r;
                }
            });
        }
    }
}

/// Queries from which the post-passes transpose: each entry then costs
/// `nq` contiguous multiply-adds, and the transposes about one pass over
/// the `nq` rows. Fewer (GQA decode) take each entry into every query in
/// place: their rows, a row of tokens apart, fall into one L1 set, which
/// holds 8 (Zen 4) or 12 (Zen 5) lines.
const WIDE_QUERIES: usize = 9;

/// Tokens per tile of the wide post-passes: a tile's `nq` floats per token
/// (sums or transposed weights) and its padded copy stay in L1 beside the
/// transposed queries or the channel sums, for any prompt length.
const WIDE_TILE: usize = 64;

/// Floats per row of the padded buffer through which a tile passes
/// between the `nq` rows of `T` floats of the scores or weights and its
/// transposed form. Those rows lie a multiple of 4 KiB apart whenever `T`
/// is one of 1024 floats (a page, a chunk of prefill), i.e. in one L1 set,
/// which 16 rows taken at a time by the block transpose overflow; through
/// this buffer the rows are read or written one at a time.
const STAGE_LD: usize = WIDE_TILE + 16;

/// Calls `f(t0, entries)` once per tile of `WIDE_TILE` tokens from `t0`
/// that holds entries, with the tile's entries as `(token − t0, channel,
/// correction)`. (Entries come in token order, so each tile is visited
/// once; another order would visit a tile again and still be correct.)
fn by_tile(head: &PackedHead<'_>, mut f: impl FnMut(usize, &[(u32, u32, f32)])) {
    let mut tile: Option<usize> = None;
    let mut batch = Vec::new();
    for_each(head, |t, c, r| {
        let t0 = t / WIDE_TILE * WIDE_TILE;
        if tile != Some(t0) {
            if let Some(p0) = tile {
                f(p0, &batch);
                batch.clear();
            }
            tile = Some(t0);
        }
        // Token in tile < WIDE_TILE and channel < head_dim ≤ 2^16.
        batch.push(((t - t0) as u32, c as u32, r));
    });
    if let Some(p0) = tile {
        f(p0, &batch);
    }
}

/// The scores' post-pass of `nq ≥ WIDE_QUERIES` queries: the queries
/// transposed (`hd` rows of `nq`), each entry's `correction·q[.., c]`
/// summed into its token's row of a tile, and each tile's rows added
/// transposed into `out` (`nq` rows of `T`).
fn wide_scores(backend: Backend, head: &PackedHead<'_>, q: &[f32], out: &mut [f32], nq: usize) {
    let (hd, t_all) = (head.layout.head_dim(), head.tokens);
    let mut qt = vec![0f32; hd * nq];
    let all = Mat {
        rows: nq,
        cols: hd,
        ld: hd,
    };
    transpose_on(backend, (q, all), (&mut qt, nq), false);
    let mut acc = vec![0f32; WIDE_TILE * nq];
    let mut stage = vec![0f32; nq * STAGE_LD];
    by_tile(head, |t0, entries| {
        let n = WIDE_TILE.min(t_all - t0);
        acc[..n * nq].fill(0.0);
        rows_axpy_on(backend, entries, false, (&qt, nq), &mut acc);
        let m = Mat {
            rows: n,
            cols: nq,
            ld: nq,
        };
        transpose_on(backend, (&acc, m), (&mut stage, STAGE_LD), false);
        for (i, row) in stage.chunks_exact(STAGE_LD).enumerate() {
            let o = &mut out[i * t_all + t0..i * t_all + t0 + n];
            o.iter_mut().zip(row).for_each(|(o, x)| *o += x);
        }
    });
}

/// The weighted sum's post-pass of `nq ≥ WIDE_QUERIES` queries: the
/// weights of each tile that holds entries transposed (a row of `nq` per
/// token), each entry's `correction·p[.., t]` summed into its channel's
/// row (`hd` rows of `nq`), and the sums added transposed into `out` (`nq`
/// rows of `hd`).
fn wide_weighted(backend: Backend, head: &PackedHead<'_>, p: &[f32], out: &mut [f32], nq: usize) {
    let (hd, t_all) = (head.layout.head_dim(), head.tokens);
    let mut pt = vec![0f32; WIDE_TILE * nq];
    let mut stage = vec![0f32; nq * STAGE_LD];
    let mut acc = vec![0f32; hd * nq];
    by_tile(head, |t0, entries| {
        let n = WIDE_TILE.min(t_all - t0);
        for (i, row) in stage.chunks_exact_mut(STAGE_LD).enumerate() {
            row[..n].copy_from_slice(&p[i * t_all + t0..i * t_all + t0 + n]);
        }
        let m = Mat {
            rows: nq,
            cols: n,
            ld: STAGE_LD,
        };
        transpose_on(backend, (&stage, m), (&mut pt, nq), false);
        rows_axpy_on(backend, entries, true, (&pt, nq), &mut acc);
    });
    let m = Mat {
        rows: hd,
        cols: nq,
        ld: nq,
    };
    transpose_on(backend, (&acc, m), (out, hd), true);
}

/// `out[i·hd + c] += p[i·T + t]·correction` for each entry.
pub(crate) fn add_weighted(backend: Backend, head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
    let (hd, t_all) = (head.layout.head_dim(), head.tokens);
    match out.len() / hd {
        1 => for_each(head, |t, c, r| out[c] += p[t] * r),
        nq if nq >= WIDE_QUERIES => wide_weighted(backend, head, p, out, nq),
        nq => {
            // Entry by entry, as in `add_scores`.
            for_each(head, |t, c, r| {
                for i in 0..nq {
                    out[i * hd + c] += p[i * t_all + t] * r;
                }
            });
        }
    }
}

/// Check a head's (or a whole tensor's) outlier entries as read from
/// outside: per set, positions strictly ascending within the set's
/// elements and finite corrections.
pub(crate) fn validate(op: &'static str, l: &Layout, bytes: &[u8]) -> Result<()> {
    let n = l.outliers();
    if n == 0 {
        return Ok(());
    }
    let elems = l.set_elements();
    for (k, set) in bytes.chunks(n * OUTLIER_BYTES).enumerate() {
        let bad = |what: String| Error::Malformed {
            op,
            what: format!("outlier set {k}: {what}"),
        };
        if set.len() < n * OUTLIER_BYTES {
            return Err(bad("cut short".into()));
        }
        let (pos, cor) = set.split_at(2 * n);
        let mut prev: Option<usize> = None;
        for (j, (p, r)) in pos.chunks_exact(2).zip(cor.chunks_exact(2)).enumerate() {
            let p = usize::from(u16::from_le_bytes([p[0], p[1]]));
            let r = f16::from_le_bytes([r[0], r[1]]);
            if p >= elems || prev.is_some_and(|q| p <= q) {
                return Err(bad(format!(
                    "entry {j} at position {p} (positions ascend, below {elems})"
                )));
            }
            if !r.is_finite() {
                return Err(bad(format!("entry {j}: correction {r}")));
            }
            prev = Some(p);
        }
    }
    Ok(())
}

impl<C: KvCodec> KvCodec for Sparse<C> {
    fn spec(&self) -> Codec {
        self.inner.spec().with_outlier_share(self.per)
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn check(
        &self,
        op: &'static str,
        rows: &[f32],
        abs_max: f32,
        first: usize,
        token0: usize,
        pend: &mut Pending,
    ) -> Result<()> {
        if abs_max > OUTLIER_LIMIT {
            let l = &self.layout;
            let (w, hd) = (l.n_kv_heads() * l.head_dim(), l.head_dim());
            let i = rows
                .iter()
                .position(|v| v.abs() > OUTLIER_LIMIT)
                .unwrap_or(0);
            return Err(Error::InvalidArgument {
                op,
                what: format!(
                    "token {}, head {}, channel {}: |{}| is above {OUTLIER_LIMIT}, the \
                     largest value a codec with f16 outlier corrections stores",
                    token0 + i / w,
                    i % w / hd,
                    i % hd,
                    rows[i]
                ),
            });
        }
        // The grid sees the values pulled into narrower ranges: what fits
        // the full ranges fits them.
        self.inner.check(op, rows, abs_max, first, token0, pend)
    }

    fn encode_token(
        &self,
        backend: Backend,
        row: &[f32],
        token: usize,
        codes: &mut [u8],
        params: &mut [u8],
        outliers: &mut [u8],
    ) -> Result<()> {
        let l = *self.inner.layout();
        let (hd, nh, n) = (l.head_dim(), l.n_kv_heads(), self.layout.outliers());
        SCRATCH.with(|sc| {
            let sc = &mut *sc.borrow_mut();
            sc.y.clear();
            sc.y.extend_from_slice(row);
            sc.picked.clear();
            for h in 0..nh {
                let r = h * hd..(h + 1) * hd;
                self.pick(&row[r.clone()], &mut sc.y[r], 1, &mut sc.sel);
                sc.picked.extend(sc.sel.picked.iter().map(|p| p.0));
            }
            self.inner
                .encode_token(backend, &sc.y, token, codes, params, &mut [])?;
            let (rb, pb) = (l.row_bytes(), l.head_param_bytes(1));
            let ob = self.layout.head_outlier_bytes(1);
            sc.dq.resize(hd, 0.0);
            for h in 0..nh {
                let view = PackedHead {
                    layout: l,
                    tokens: 1,
                    codes: &codes[h * rb..(h + 1) * rb],
                    params: &params[h * pb..(h + 1) * pb],
                    outliers: &[],
                };
                self.inner.decode(&view, &mut sc.dq);
                Self::write_entries(
                    &sc.picked[h * n..(h + 1) * n],
                    &row[h * hd..(h + 1) * hd],
                    &sc.dq,
                    &mut outliers[h * ob..(h + 1) * ob],
                );
            }
            Ok(())
        })
    }

    fn encode_block(
        &self,
        backend: Backend,
        rows: &[f32],
        tokens: usize,
        head: usize,
        token0: usize,
        codes: &mut [u8],
        params: &mut [u8],
        outliers: &mut [u8],
    ) -> Result<()> {
        let l = *self.inner.layout();
        let (hd, w) = (l.head_dim(), l.n_kv_heads() * l.head_dim());
        SCRATCH.with(|sc| {
            let sc = &mut *sc.borrow_mut();
            let Scratch {
                sel,
                y,
                dq,
                picked,
                x,
            } = sc;
            x.clear();
            for t in 0..tokens {
                x.extend_from_slice(&rows[t * w + head * hd..][..hd]);
            }
            y.resize(tokens * hd, 0.0);
            sel.backend = backend;
            self.pick(x, y, tokens, sel);
            // The head's block alone, through the one-head grid: the same
            // codes and params as head `head` of full rows.
            let one = *self.single.layout();
            self.single
                .encode_block(backend, y, tokens, 0, token0, codes, params, &mut [])?;
            let view = PackedHead {
                layout: one,
                tokens,
                codes: &codes[..one.head_code_bytes(tokens)],
                params: &params[..one.head_param_bytes(tokens)],
                outliers: &[],
            };
            dq.resize(tokens * hd, 0.0);
            self.single.decode(&view, dq);
            picked.clear();
            picked.extend(sel.picked.iter().map(|p| p.0));
            Self::write_entries(picked, x, dq, outliers);
            Ok(())
        })
    }

    fn scores(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        self.inner.scores(backend, &head.grid(), q, out)?;
        add_scores(backend, head, q, out);
        Ok(())
    }

    fn weighted_sum(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        p: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        self.inner.weighted_sum(backend, &head.grid(), p, out)?;
        add_weighted(backend, head, p, out);
        Ok(())
    }

    fn decode(&self, head: &PackedHead<'_>, out: &mut [f32]) {
        self.inner.decode(&head.grid(), out);
        add_to_rows(head, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The greedy choice written plainly: each step recomputes every
    /// group's range without the values taken so far and drops the end
    /// that shrinks one most.
    fn naive(x: &[f32], groups: &[Vec<usize>], sym: bool, n: usize) -> Vec<usize> {
        let range = |v: &[f32]| {
            let (lo, hi) = v
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &y| (a.min(y), b.max(y)));
            if sym {
                lo.abs().max(hi.abs())
            } else {
                hi - lo
            }
        };
        let mut taken: Vec<usize> = Vec::new();
        for _ in 0..n {
            let mut best: Option<(f32, usize)> = None;
            for g in groups {
                let live: Vec<usize> = g.iter().copied().filter(|p| !taken.contains(p)).collect();
                if live.len() < 2 {
                    continue;
                }
                let vals = |skip: usize| -> Vec<f32> {
                    live.iter().filter(|&&p| p != skip).map(|&p| x[p]).collect()
                };
                let all: Vec<f32> = live.iter().map(|&p| x[p]).collect();
                let now = range(&all);
                let lo = *live
                    .iter()
                    .min_by(|&&a, &&b| x[a].total_cmp(&x[b]))
                    .unwrap();
                let hi = *live
                    .iter()
                    .max_by(|&&a, &&b| x[a].total_cmp(&x[b]))
                    .unwrap();
                let (rh, rl) = (range(&vals(hi)), range(&vals(lo)));
                let (after, p) = if rh <= rl { (rh, hi) } else { (rl, lo) };
                let gain = now * now - after * after;
                if best.is_none_or(|(b, _)| gain > b) {
                    best = Some((gain, p));
                }
            }
            match best {
                Some((_, p)) => taken.push(p),
                None => break,
            }
        }
        taken.sort_unstable();
        taken
    }

    #[test]
    fn f16_conversion_is_exact() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(h), f16::from_bits(h).to_f32());
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn partial_orders_pick_what_the_plain_greedy_picks() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Distinct values (ties would make either end a valid pick).
            (s >> 11) as f32 / (1u64 << 53) as f32 * 8.0 - 4.0
        };
        for (cpg, groups, n) in [(32, 4, 1), (32, 4, 3), (8, 3, 2), (64, 2, 7), (5, 6, 4)] {
            for sym in [false, true] {
                let x: Vec<f32> = (0..cpg * groups)
                    .map(|i| rnd() * if i % 11 == 3 { 9.0 } else { 1.0 })
                    .collect();
                let members: Vec<Vec<usize>> = (0..groups)
                    .map(|g| (g * cpg..(g + 1) * cpg).collect())
                    .collect();
                let mut sel = Selector::default();
                sel.run(&x, groups, |g| g * cpg..(g + 1) * cpg, false, sym, n);
                // The same set as columns: per-channel groups.
                let mut by_col = Selector::default();
                let rows = cpg * groups / 8;
                by_col.run(
                    &x[..rows * 8],
                    8,
                    |c| (c..rows * 8).step_by(8),
                    true,
                    sym,
                    n,
                );
                let mut sel2 = Selector::default();
                sel2.run(
                    &x[..rows * 8],
                    8,
                    |c| (c..rows * 8).step_by(8),
                    false,
                    sym,
                    n,
                );
                assert_eq!(by_col.picked, sel2.picked, "column scan");
                let mut got: Vec<usize> = sel.picked.iter().map(|p| p.0).collect();
                got.sort_unstable();
                assert_eq!(
                    got,
                    naive(&x, &members, sym, n),
                    "{cpg}x{groups}, n {n}, sym {sym}"
                );
            }
        }
    }
}
