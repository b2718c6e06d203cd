//! Rotary position embeddings applied by the cache, for keys stored before
//! RoPE ([`CacheConfig::pre_rope`]).
//!
//! RoPE rotates each pair of a head's channels by an angle that grows with
//! the token's position, so after RoPE a channel's values swing with
//! position and a per-channel group of tokens sees a wider range than the
//! channel itself has. Stored before RoPE, the groups see the channels
//! as the projection made them (KVQuant's pre-RoPE keys); the cache
//! rotates each key by its own position when it scores, so queries stay
//! post-RoPE as usual.

use super::*;
use crate::kernels::rope::{RopeEntries, RopeRows, ROPE_LO as LO, ROPE_SPILL};
use crate::store::PackedHead;

/// Which channels of a head RoPE pairs up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RopeStyle {
    /// `(i, i + dims/2)`: the two halves of the rotary channels ("NeoX",
    /// Hugging Face's `rotate_half`; ggml's NeoX mode: Qwen, Gemma, Phi).
    Halves,
    /// `(2i, 2i + 1)`: adjacent channels (GPT-J; ggml's normal mode, which
    /// GGUF `llama` weights are permuted for).
    Adjacent,
}

/// How the model stretches RoPE's frequencies for long contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum RopeScaling {
    /// The frequencies as they are.
    None,
    /// Positions divided by `factor` (every frequency divided by it).
    Linear {
        /// The divisor (≥ 1 in practice; positive and finite).
        factor: f64,
    },
    /// Llama 3.1's piecewise scaling: wavelengths shorter than
    /// `original_max_position / high_freq_factor` kept, longer than
    /// `original_max_position / low_freq_factor` divided by `factor`,
    /// blended in between.
    Llama3 {
        /// Divisor of the low frequencies (8 for Llama 3.1).
        factor: f64,
        /// 1 for Llama 3.1.
        low_freq_factor: f64,
        /// 4 for Llama 3.1.
        high_freq_factor: f64,
        /// The pre-training context (8192 for Llama 3.1).
        original_max_position: u32,
    },
}

/// The model's rotary position embedding: `base` (θ, e.g. 10000 or
/// 500000), the number of rotary channels at the start of each head
/// (`dims`, even, at most `head_dim`; partial rotary leaves the rest), the
/// pairing and the frequency scaling. Pair `i` at position `p` turns by
/// `p·f_i`, `f_i = base^(−2i/dims)` (then scaled):
/// `(a, b) ↦ (a·cos − b·sin, a·sin + b·cos)`.
///
/// ```
/// use kvq::{Rope, RopeStyle};
/// let rope = Rope::new(10_000.0, 4, RopeStyle::Halves);
/// let mut k = [1.0f32, 0.0, 0.0, 0.0];
/// rope.apply(&mut k, 4, 1);
/// // Pair 0 (channels 0 and 2) turns by one radian at position 1.
/// assert!((k[0] - 1f32.cos()).abs() < 1e-6 && (k[2] - 1f32.sin()).abs() < 1e-6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    base: f64,
    dims: usize,
    style: RopeStyle,
    scaling: RopeScaling,
}

impl Rope {
    /// RoPE with `base`, `dims` rotary channels per head and `style`, no
    /// scaling (checked by [`LayerCache::new`]).
    pub fn new(base: f64, dims: usize, style: RopeStyle) -> Rope {
        Rope {
            base,
            dims,
            style,
            scaling: RopeScaling::None,
        }
    }

    /// The same with `scaling`.
    pub fn with_scaling(mut self, scaling: RopeScaling) -> Rope {
        self.scaling = scaling;
        self
    }

    /// θ.
    pub fn base(&self) -> f64 {
        self.base
    }
    /// Rotary channels per head.
    pub fn dims(&self) -> usize {
        self.dims
    }
    /// The pairing.
    pub fn style(&self) -> RopeStyle {
        self.style
    }
    /// The frequency scaling.
    pub fn scaling(&self) -> RopeScaling {
        self.scaling
    }

    /// Check the parameters against a head of `head_dim` channels.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for `dims` zero, odd or above `head_dim`, a
    /// base that is not finite and above 1, or scaling factors that are not
    /// positive and finite (Llama 3: `high_freq_factor > low_freq_factor`,
    /// a positive original context).
    pub fn check(&self, op: &'static str, head_dim: usize) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidConfig { op, what });
        if self.dims == 0 || !self.dims.is_multiple_of(2) || self.dims > head_dim {
            return bad(format!(
                "RoPE dims {} must be even, positive and at most head_dim {head_dim}",
                self.dims
            ));
        }
        if !(self.base.is_finite() && self.base > 1.0) {
            return bad(format!(
                "RoPE base {} must be finite and above 1",
                self.base
            ));
        }
        let pos = |x: f64| x.is_finite() && x > 0.0;
        match self.scaling {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } if pos(factor) => Ok(()),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: lo,
                high_freq_factor: hi,
                original_max_position: n,
            } if pos(factor) && pos(lo) && pos(hi) && hi > lo && n > 0 => Ok(()),
            s => bad(format!("RoPE scaling {s:?} is not valid")),
        }
    }

    /// The `dims/2` frequencies `f_i`, scaled.
    pub fn inv_freq(&self) -> Vec<f64> {
        let half = self.dims / 2;
        (0..half)
            .map(|i| {
                let f = self.base.powf(-2.0 * i as f64 / self.dims as f64);
                match self.scaling {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / factor,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor: lo,
                        high_freq_factor: hi,
                        original_max_position: n,
                    } => {
                        let n = f64::from(n);
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < n / hi {
                            f
                        } else if wavelen > n / lo {
                            f / factor
                        } else {
                            let smooth = (n / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    }
                }
            })
            .collect()
    }

    /// The channel pairs `(a, b)` of a head, `dims/2` of them.
    pub(crate) fn pair(&self, i: usize) -> (usize, usize) {
        match self.style {
            RopeStyle::Halves => (i, i + self.dims / 2),
            RopeStyle::Adjacent => (2 * i, 2 * i + 1),
        }
    }

    /// Rotate every head of `row` (`head_dim` channels each) to `position`,
    /// angles in `f64` — the reference the cache's own rotation is tested
    /// against, and what an engine applies to its queries.
    ///
    /// # Panics
    /// If `row` is not a whole number of heads or `dims > head_dim`.
    pub fn apply(&self, row: &mut [f32], head_dim: usize, position: usize) {
        assert!(
            head_dim >= self.dims && row.len().is_multiple_of(head_dim),
            "Rope::apply: rows of whole heads"
        );
        let p = position as f64;
        let cs: Vec<(f32, f32)> = self
            .inv_freq()
            .iter()
            .map(|&f| {
                let (s, c) = (p * f).sin_cos();
                (c as f32, s as f32)
            })
            .collect();
        for head in row.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = self.pair(i);
                let (x, y) = (head[a], head[b]);
                head[a] = x * c - y * s;
                head[b] = x * s + y * c;
            }
        }
    }
}

/// `cos`/`sin` of every position's angles, as the product of a fine table
/// (positions `0..256`, and `ROPE_SPILL` past them for the kernels) and
/// a coarse one (multiples of 256, grown with the cache):
/// `cos(A + B) = cos A·cos B − sin A·sin B`. Both tables hold `f32`
/// roundings of angles computed in `f64`, so a position's rotation is
/// within a few `f32` ulps of the exact one at any context length (an
/// angle `p·f` formed in `f32` loses `p·2^−24` radians). Rows have one
/// lane per pair (halves) or per channel (adjacent pairs: the cosine twice,
/// the sine negated on the pair's first channel), as the kernels read them
/// ([`RopeRows`]). The fine table is shared by forks.
#[derive(Debug, Clone)]
pub(super) struct RopeTable {
    rope: Rope,
    inv_freq: Vec<f64>,
    /// `[LO + ROPE_SPILL, lanes]` each, then both interleaved
    /// ([`RopeRows::lo_cs`]).
    lo: Arc<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    /// `[n, lanes]` for positions `0, LO, 2·LO, …`.
    hi: (Vec<f32>, Vec<f32>),
}

impl RopeTable {
    pub(super) fn new(rope: Rope) -> RopeTable {
        let inv_freq = rope.inv_freq();
        let adjacent = rope.style == RopeStyle::Adjacent;
        let mut lo = (Vec::new(), Vec::new());
        for p in 0..LO + ROPE_SPILL {
            Self::push(&inv_freq, adjacent, p, &mut lo);
        }
        let cs = crate::kernels::rope::interleave(&lo.0, &lo.1);
        RopeTable {
            rope,
            lo: Arc::new((lo.0, lo.1, cs)),
            hi: (Vec::new(), Vec::new()),
            inv_freq,
        }
    }

    fn adjacent(&self) -> bool {
        self.rope.style == RopeStyle::Adjacent
    }

    fn lanes(&self) -> usize {
        self.inv_freq.len() * if self.adjacent() { 2 } else { 1 }
    }

    /// Append position `p`'s row to `(c, s)`.
    fn push(inv_freq: &[f64], adjacent: bool, p: usize, (c, s): &mut (Vec<f32>, Vec<f32>)) {
        for &f in inv_freq {
            let (sin, cos) = (p as f64 * f).sin_cos();
            let (cos, sin) = (cos as f32, sin as f32);
            if adjacent {
                c.extend([cos, cos]);
                s.extend([-sin, sin]);
            } else {
                c.push(cos);
                s.push(sin);
            }
        }
    }

    /// Cover positions `0..len`.
    pub(super) fn ensure(&mut self, len: usize) {
        let have = self.hi.0.len() / self.lanes();
        let adjacent = self.adjacent();
        for k in have..len.div_ceil(LO) {
            Self::push(&self.inv_freq, adjacent, k * LO, &mut self.hi);
        }
    }

    /// The tables as the kernels read them.
    pub(super) fn rows(&self) -> RopeRows<'_> {
        RopeRows {
            adjacent: self.adjacent(),
            lanes: self.lanes(),
            lo: (&self.lo.0, &self.lo.1),
            lo_cs: &self.lo.2,
            hi: (&self.hi.0, &self.hi.1),
        }
    }

    /// Add to `out[i·stride + t]` (queries `i < rows`, `q` `[rows, hd]`)
    /// each outlier entry's share of its key turned to position `p0 + t`:
    /// a value `r` at channel `c` of a pre-RoPE key scores
    /// `q·R(p)·(r·e_c) = r·(R(−p)·q)_c`, two channels of the query.
    ///
    /// With `p = hi + lo` (`hi` a multiple of 256), `R(−p)·q =
    /// R(−lo)·(R(−hi)·q)`: the queries are turned back by `hi` once per
    /// coarse row that holds entries, so an entry costs one fine-table lane
    /// (`cos`, `sin`) and two channels of a turned query, rather than both
    /// tables' lanes and their product.
    ///
    /// # Panics
    /// If the table does not cover the view's positions
    /// ([`ensure`](Self::ensure)).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_outlier_scores(
        &self,
        backend: Backend,
        view: &PackedHead<'_>,
        p0: usize,
        q: &[f32],
        rows: usize,
        hd: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let rr = self.rows();
        if !kernels::rope::rope_outliers_take(&rr, hd) {
            return self.add_outlier_scores_any(view, p0, q, rows, hd, out, stride);
        }
        let shift = hd.trailing_zeros();
        let bt = view.layout.block_tokens();
        let mut turned = vec![0f32; rows * 2 * hd];
        let mut row = None;
        crate::quant::outliers::for_each_set(view, |base, pos, cor| {
            // Positions ascend: the view's entries of the set are a
            // prefix, and those one coarse row turns a run.
            let below = |lim: usize| crate::quant::outliers::entries_below(pos, lim);
            let at = |j: usize| usize::from(u16::from_le_bytes([pos[2 * j], pos[2 * j + 1]]));
            let tl = (view.tokens - base).min(bt);
            let (first, end) = (p0 + base, below(tl * hd));
            let mut j = 0;
            while j < end {
                // The coarse row of entry `j`'s position, and the tokens the
                // fine table reaches from it.
                let k = (first + (at(j) >> shift)) / LO;
                let reach = (k * LO + LO + ROPE_SPILL - first).min(tl);
                let j2 = below(reach * hd);
                if row != Some(k) {
                    for (qi, ab) in q.chunks_exact(hd).zip(turned.chunks_exact_mut(2 * hd)) {
                        self.turn_back(qi, k, |c, a, b| (ab[2 * c], ab[2 * c + 1]) = (a, b));
                    }
                    row = Some(k);
                }
                let e = RopeEntries {
                    pos: &pos[2 * j..2 * j2],
                    cor: &cor[2 * j..2 * j2],
                    shift,
                };
                let fine0 = first as isize - (k * LO) as isize;
                kernels::rope::rope_outliers_on(
                    backend,
                    e,
                    &rr,
                    fine0,
                    &turned,
                    &mut out[base..],
                    stride,
                );
                j = j2;
            }
        });
    }

    /// Per channel: the fine-table lane that holds its pair's `cos` and
    /// `+sin`, its partner and the partner's sign in `(R(−lo)·x)_c = x_c·cos
    /// + sign·x_partner·sin`. Unrotated channels have none.
    fn channels(&self) -> Vec<(u32, u32, f32)> {
        let dims = self.rope.dims;
        (0..dims)
            .map(|c| {
                let (lane, partner, first) = if self.adjacent() {
                    (c | 1, c ^ 1, c % 2 == 0)
                } else if c < dims / 2 {
                    (c, c + dims / 2, true)
                } else {
                    (c - dims / 2, c - dims / 2, false)
                };
                (lane as u32, partner as u32, if first { 1.0 } else { -1.0 })
            })
            .collect()
    }

    /// [`add_outlier_scores`](Self::add_outlier_scores) for any rotation
    /// (partial rotary, any head dim), entry by entry.
    #[allow(clippy::too_many_arguments)]
    fn add_outlier_scores_any(
        &self,
        view: &PackedHead<'_>,
        p0: usize,
        q: &[f32],
        rows: usize,
        hd: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let lanes = self.lanes();
        let (lc, ls) = (&self.lo.0[..], &self.lo.1[..]);
        let chan = self.channels();
        // One coarse row's entries as (token, channel, r·cos, r·sin), then
        // row by row (entry by entry, many rows' scores would lie a row of
        // tokens apart, in the same L1 sets); the turned queries as `x_c`
        // and `sign·x_partner` per channel.
        let mut ents: Vec<(u32, u32, f32, f32)> = Vec::new();
        let (mut ta, mut tb) = (vec![0f32; hd], vec![0f32; hd]);
        let mut flush = |k: usize, ents: &mut Vec<(u32, u32, f32, f32)>| {
            for i in 0..rows {
                let qi = &q[i * hd..(i + 1) * hd];
                self.turn_back(qi, k, |c, a, b| (ta[c], tb[c]) = (a, b));
                let oi = &mut out[i * stride..];
                for &(t, c, wc, ws) in ents.iter() {
                    oi[t as usize] += ta[c as usize] * wc + tb[c as usize] * ws;
                }
            }
            ents.clear();
        };
        let mut row = None;
        crate::quant::outliers::for_each(view, |t, c, r| {
            let p = p0 + t;
            let k = p / LO;
            if row != Some(k) {
                if let Some(k) = row {
                    flush(k, &mut ents);
                }
                row = Some(k);
            }
            let (wc, ws) = match chan.get(c) {
                Some(&(lane, _, _)) => {
                    let l = (p - k * LO) * lanes + lane as usize;
                    (r * lc[l], r * ls[l])
                }
                // Beyond the rotary channels a key is not turned.
                None => (r, 0.0),
            };
            ents.push((t as u32, c as u32, wc, ws));
        });
        if let Some(k) = row {
            flush(k, &mut ents);
        }
    }

    /// `put(c, a, b)` for every channel `c` of `q`, with `a = (R(−hi)·q)_c`
    /// and `b = sign_c·(R(−hi)·q)_partner(c)` for the coarse row `k` (`hi =
    /// k·256`; partner and sign as [`channels`](Self::channels) gives
    /// them); channels beyond the rotary dims `(q_c, 0)`. Per pairing, so
    /// each pair's two turned channels are formed once:
    /// `(R(−hi)·q)_c = q_c·cos + sign·q_partner·sin`, as for `lo`.
    fn turn_back(&self, q: &[f32], k: usize, mut put: impl FnMut(usize, f32, f32)) {
        let (lanes, dims) = (self.lanes(), self.rope.dims);
        let (hc, hs) = (
            &self.hi.0[k * lanes..(k + 1) * lanes],
            &self.hi.1[k * lanes..(k + 1) * lanes],
        );
        // The pair `(x, y)` = `(q_c, q_partner)` of its first channel `c`
        // and its lane's `(cos, +sin)`.
        let mut pair = |c: usize, d: usize, (x, y): (f32, f32), (co, si): (f32, f32)| {
            let (tx, ty) = (x * co + y * si, y * co + -x * si);
            put(c, tx, ty);
            put(d, ty, -tx);
        };
        if self.adjacent() {
            // Lanes `2i` and `2i + 1` hold the pair's cosine twice and its
            // sine as `−sin, +sin`: both channels read the second.
            for c in (0..dims).step_by(2) {
                pair(c, c + 1, (q[c], q[c + 1]), (hc[c + 1], hs[c + 1]));
            }
        } else {
            for c in 0..lanes {
                pair(c, c + lanes, (q[c], q[c + lanes]), (hc[c], hs[c]));
            }
        }
        for (c, &x) in q.iter().enumerate().skip(dims) {
            put(c, x, 0.0);
        }
    }

    /// Rotate `n` rows of one head (`hd` channels each, `rows` holding
    /// `n·hd`) to positions `p0..p0 + n` (the kernels' rotation, scalar).
    ///
    /// # Panics
    /// If the table does not cover `p0 + n − 1` ([`ensure`](Self::ensure)).
    pub(super) fn apply_rows(&self, rows: &mut [f32], hd: usize, p0: usize) {
        let lanes = self.lanes();
        let (mut c, mut s) = (vec![0f32; lanes], vec![0f32; lanes]);
        for (t, row) in rows.chunks_exact_mut(hd).enumerate() {
            let p = p0 + t;
            let (h, l) = ((p / LO) * lanes, (p % LO) * lanes);
            let (hc, hs) = (&self.hi.0[h..h + lanes], &self.hi.1[h..h + lanes]);
            let (lc, ls) = (&self.lo.0[l..l + lanes], &self.lo.1[l..l + lanes]);
            for i in 0..lanes {
                c[i] = hc[i] * lc[i] - hs[i] * ls[i];
                s[i] = hs[i] * lc[i] + hc[i] * ls[i];
            }
            if self.adjacent() {
                for ((pair, c), s) in row[..lanes]
                    .chunks_exact_mut(2)
                    .zip(c.chunks_exact(2))
                    .zip(s.chunks_exact(2))
                {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * c[0] + b * s[0];
                    pair[1] = b * c[1] + a * s[1];
                }
            } else {
                let (x, y) = row[..2 * lanes].split_at_mut(lanes);
                for i in 0..lanes {
                    let (a, b) = (x[i], y[i]);
                    x[i] = a * c[i] - b * s[i];
                    y[i] = a * s[i] + b * c[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_matches_the_reference_rotation_at_long_positions() {
        for style in [RopeStyle::Halves, RopeStyle::Adjacent] {
            let hd = 128;
            let rope = Rope::new(500_000.0, hd, style);
            let mut t = RopeTable::new(rope);
            let p0 = 1_000_000 - 300;
            t.ensure(p0 + 600);
            let rows: Vec<f32> = (0..600 * hd)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let mut got = rows.clone();
            t.apply_rows(&mut got, hd, p0);
            let mut worst = 0f32;
            for (i, (g, r)) in got.chunks_exact(hd).zip(rows.chunks_exact(hd)).enumerate() {
                let mut want = r.to_vec();
                rope.apply(&mut want, hd, p0 + i);
                for (a, b) in g.iter().zip(&want) {
                    worst = worst.max((a - b).abs());
                }
            }
            // Values of magnitude ≤ 1: within a few f32 ulps of 1.
            assert!(worst < 1e-6, "{style:?}: {worst}");
        }
    }
}
