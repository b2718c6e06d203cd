//! Key channels at different bit widths within a head: a study of what a
//! mixed-width per-channel key format would buy, run as a quantize-dequantize
//! [`RoundTrip`] on the keys before RoPE (no such format exists in `kvq`).
//!
//! Per-channel keys give every channel of a head the same bits. Where a
//! channel's error reaches the scores depends on the queries: the score
//! error of a key error `Δk` before RoPE is `Σ_pairs (R(p)ᵀq)_pair·Δk_pair`,
//! and a rotation keeps each pair's query energy, so channel `c` weighs in
//! with its pair's mean query energy `a_c` (summed over the query heads of
//! its KV head). [`ChannelBits::fit`] measures, on calibration windows,
//! each channel's mean squared error `D_c(b)` at `b = 0..=8` bits (0: the
//! block's mean only) and hands out a head's budget of code bits greedily by
//! the largest drop of `a_c·D_c` per bit, looking one to three bits ahead
//! (the drop from 0 to 1 bit can be smaller than from 1 to 2).
//!
//! Each channel is stored as `kvq`'s per-channel asymmetric grid of its
//! width (blocks of `block` tokens, an `f16` scale and zero per block); a
//! 0-bit channel keeps its block mean as one `f16`. With
//! [`ChannelBits::with_trellis`] (or [`FitOptions::trellis`]) a 1–3-bit
//! channel's block is instead a chain of a trellis code
//! ([`crate::trellis`]) around the block's `f16` mean, with one `f16`
//! scale: the same two params, the same bits.
//! [`ChannelBits::effective_bits`] counts codes and params exactly.

use crate::capture::Capture;
use crate::model::{Config, RopeStyle, RoundTrip};
use crate::trellis::TrellisCode;
use kvq::{Axis, Codec, Group, QuantScheme};

/// Widest channel the greedy hands out.
pub(crate) const MAX_BITS: u8 = 8;

/// How [`ChannelBits::fit_with`] hands out the widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FitOptions {
    /// Tokens per per-channel block (each block an `f16` scale and zero
    /// per channel).
    pub block: usize,
    /// Both channels of a rotary pair at one width (what a format that
    /// keeps pairs together for the scores after RoPE stores).
    pub pairs: bool,
    /// One budget for the whole layer, spent across its heads, instead of
    /// one per head.
    pub per_layer: bool,
    /// One budget for the whole model, spent across its layers and heads
    /// (the errors weighed are the scores', in the same units in every
    /// layer); overrides `per_layer`.
    pub global: bool,
    /// Positions kept exact ([`ChannelBits::with_sinks`]): the fit leaves
    /// their rows out and the widths keep them.
    pub sinks: usize,
    /// Channels of 1–3 bits in a trellis code along their block's tokens
    /// ([`ChannelBits::with_trellis`]) instead of the uniform grid.
    pub trellis: bool,
    /// With `trellis`: each channel of 1–4 bits in the trellis or the
    /// grid, whichever its calibration error favours at its width.
    pub by_error: bool,
}

impl Default for FitOptions {
    /// Blocks of 64 tokens, channels on their own, one budget per head, no
    /// sinks.
    fn default() -> Self {
        FitOptions {
            block: 64,
            pairs: false,
            per_layer: false,
            global: false,
            sinks: 0,
            trellis: false,
            by_error: false,
        }
    }
}

/// Per-layer, per-channel key widths (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelBits {
    block: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// `bits[layer][head·head_dim + c]`.
    bits: Vec<Vec<u8>>,
    /// Positions kept exact (attention sinks).
    sinks: usize,
    /// Trellis codes of 1–4 bits (index `bits − 1`); empty: the uniform
    /// grid at every width.
    trellis: Vec<TrellisCode>,
    /// `coded[layer][head·head_dim + c]`: the channel is in the trellis
    /// code of its width (empty without trellis codes).
    coded: Vec<Vec<bool>>,
}

/// Widest channel a trellis code takes by default: at 4 bits a block's
/// min/max grid already beats a 256-level trellis on blocks of 32
/// Gaussian tokens.
const TRELLIS_MAX_BITS: u8 = 3;

/// Widest channel [`FitOptions::by_error`] tries in a trellis code.
const TRELLIS_TRY_BITS: u8 = 4;

/// The trellis codes of 1–4 bits for per-channel blocks of `block` tokens
/// (256-level tables, one scale per block).
fn trellis_codes(block: usize) -> Result<Vec<TrellisCode>, String> {
    (1..=u32::from(TRELLIS_TRY_BITS))
        .map(|k| TrellisCode::gaussian(8, k, block))
        .collect()
}

/// The channels of `x` (`[tokens, width]`) with `pick(c)` true, each
/// block of `block` tokens coded by `code` around its `f16` mean (the
/// mean and the code's scale: the two params of the grid's block).
fn code_channels(
    x: &mut [f32],
    width: usize,
    block: usize,
    code: &TrellisCode,
    pick: impl Fn(usize) -> bool,
) {
    let mut col = Vec::with_capacity(block);
    let mut scratch = crate::trellis::Scratch::default();
    for rows in x.chunks_mut(block * width) {
        for c in (0..width).filter(|&c| pick(c)) {
            col.clear();
            col.extend(rows.iter().skip(c).step_by(width));
            let m = f16_mean(col.iter().copied());
            col.iter_mut().for_each(|v| *v -= m);
            code.code(&mut col, &mut scratch);
            for (y, v) in rows.iter_mut().skip(c).step_by(width).zip(&col) {
                *y = v + m;
            }
        }
    }
}

/// The mean of `v` (at least one value), as the `f16` a block stores.
fn f16_mean(v: impl Iterator<Item = f32>) -> f32 {
    let (sum, n) = v.fold((0f64, 0usize), |(s, n), x| (s + f64::from(x), n + 1));
    half::f16::from_f64(sum / n as f64).to_f32()
}

/// `x` (`[tokens, width]`, `width` a multiple of 8) with every channel
/// quantized at `bits` per-channel in blocks of `block` tokens (channels
/// are independent on this axis, so one call serves every channel of that
/// width).
fn at_width(x: &[f32], width: usize, bits: u8, block: usize) -> Result<Vec<f32>, String> {
    if bits == 0 {
        let mut out = x.to_vec();
        for rows in out.chunks_mut(block * width) {
            for c in 0..width {
                let m = f16_mean(rows.iter().skip(c).step_by(width).copied());
                rows.iter_mut().skip(c).step_by(width).for_each(|v| *v = m);
            }
        }
        return Ok(out);
    }
    let s =
        QuantScheme::new(bits, Axis::PerChannel, Group::Size(block)).map_err(|e| e.to_string())?;
    Codec::uniform(s)
        .roundtrip(x, 1, width)
        .map_err(|e| e.to_string())
}

/// Index of the channel `c` rotates with under `style` (itself outside the
/// rotary channels).
fn partner(c: usize, style: RopeStyle, rope_dim: usize) -> usize {
    if c >= rope_dim {
        return c;
    }
    match style {
        RopeStyle::Adjacent => c ^ 1,
        RopeStyle::Halves => (c + rope_dim / 2) % rope_dim,
    }
}

impl ChannelBits {
    /// Fit the widths on `caps` (calibration windows of the model `cfg`,
    /// with pre-RoPE keys): `code_bits` mean code bits per channel in every
    /// head, per-channel blocks of `block` tokens.
    ///
    /// # Errors
    /// Captures without pre-RoPE keys or of another shape, a budget outside
    /// `0..=8`, or a block of 0.
    pub fn fit(
        cfg: &Config,
        caps: &[Capture],
        code_bits: f64,
        block: usize,
    ) -> Result<Self, String> {
        Self::fit_with(
            cfg,
            caps,
            code_bits,
            FitOptions {
                block,
                ..FitOptions::default()
            },
        )
    }

    /// [`fit`](Self::fit) with the choices of `opts`.
    ///
    /// # Errors
    /// As [`fit`](Self::fit).
    pub fn fit_with(
        cfg: &Config,
        caps: &[Capture],
        code_bits: f64,
        opts: FitOptions,
    ) -> Result<Self, String> {
        let block = opts.block;
        let (n_kv, hd, n_q) = (cfg.n_kv_heads, cfg.head_dim, cfg.n_heads);
        if caps.is_empty() || caps.iter().any(|c| !c.has_k_pre_rope()) {
            return Err("channel bits: calibration captures with pre-RoPE keys needed".into());
        }
        if caps.iter().any(|c| {
            c.n_kv_heads != n_kv
                || c.head_dim != hd
                || c.n_q_heads != n_q
                || c.layers.len() != cfg.n_layers
        }) {
            return Err("channel bits: a capture does not match the model's shape".into());
        }
        if !(0.0..=f64::from(MAX_BITS)).contains(&code_bits) || block == 0 {
            return Err(format!(
                "channel bits: budget {code_bits} or block {block} out of range"
            ));
        }
        let group = n_q / n_kv;
        let width = n_kv * hd;
        let rope_dim = cfg.rope_dim.min(hd);
        let trellis = if opts.trellis {
            trellis_codes(block)?
        } else {
            Vec::new()
        };
        // The widths tried in the trellis: the default's, or with
        // `by_error` up to 4 bits.
        let tried = if opts.by_error {
            TRELLIS_TRY_BITS
        } else {
            TRELLIS_MAX_BITS
        };
        let in_trellis = |b: u8| !trellis.is_empty() && (1..=tried).contains(&b);
        // Per layer: each channel's query energy, its error at every
        // width and whether each width is in the trellis.
        let mut fitted = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            // Query energy per channel of each KV head, pairs pooled.
            let mut energy = vec![0f64; width];
            let mut n_rows = 0usize;
            for cap in caps {
                let q = &cap.layers[l].q;
                for row in q.chunks_exact(n_q * hd) {
                    for (qh, qv) in row.chunks_exact(hd).enumerate() {
                        let h = qh / group;
                        for (c, &v) in qv.iter().enumerate() {
                            energy[h * hd + c] += f64::from(v) * f64::from(v);
                        }
                    }
                }
                n_rows += q.len() / (n_q * hd);
            }
            let a: Vec<f64> = (0..width)
                .map(|i| {
                    let (h, c) = (i / hd, i % hd);
                    let p = partner(c, cfg.rope_style, rope_dim);
                    (energy[h * hd + c] + energy[h * hd + p]) / n_rows.max(1) as f64
                })
                .collect();
            // Each channel's mean squared error at every width, in the
            // grid and (at the widths `tried`) in the trellis.
            let mut d = vec![[0f64; MAX_BITS as usize + 1]; width];
            let mut dt = vec![[0f64; MAX_BITS as usize + 1]; width];
            for cap in caps {
                let k = &cap.layers[l].k_pre_rope;
                let k = &k[(opts.sinks * width).min(k.len())..];
                for b in 0..=MAX_BITS {
                    let r = at_width(k, width, b, block)?;
                    for (i, (&y, &x)) in r.iter().zip(k).enumerate() {
                        d[i % width][b as usize] += f64::from(y - x).powi(2);
                    }
                    if !in_trellis(b) {
                        continue;
                    }
                    let mut r = k.to_vec();
                    code_channels(&mut r, width, block, &trellis[usize::from(b) - 1], |_| true);
                    for (i, (&y, &x)) in r.iter().zip(k).enumerate() {
                        dt[i % width][b as usize] += f64::from(y - x).powi(2);
                    }
                }
            }
            // Whether each channel is in the trellis at each width.
            let on: Vec<[bool; MAX_BITS as usize + 1]> = (0..width)
                .map(|c| {
                    std::array::from_fn(|b| {
                        in_trellis(b as u8) && (!opts.by_error || dt[c][b] < d[c][b])
                    })
                })
                .collect();
            for (c, dc) in d.iter_mut().enumerate() {
                for (b, e) in dc.iter_mut().enumerate() {
                    if on[c][b] {
                        *e = dt[c][b];
                    }
                }
            }
            fitted.push((a, d, on));
        }
        // The units that share a width: a channel, or a rotary pair, of
        // head `h`, numbered from `base`.
        let units = |h: usize, base: usize| -> Vec<Vec<usize>> {
            (0..hd)
                .filter_map(|c| {
                    let p = partner(c, cfg.rope_style, rope_dim);
                    match (opts.pairs, p) {
                        (true, p) if p < c => None,
                        (true, p) if p != c => Some(vec![base + h * hd + c, base + h * hd + p]),
                        _ => Some(vec![base + h * hd + c]),
                    }
                })
                .collect()
        };
        // Each scope's budget, rounded once.
        let budget = |channels: usize| (code_bits * channels as f64).round() as usize;
        let bits: Vec<Vec<u8>> = if opts.global {
            let all: Vec<Vec<usize>> = (0..cfg.n_layers)
                .flat_map(|l| (0..n_kv).flat_map(move |h| units(h, l * width)))
                .collect();
            let a: Vec<f64> = fitted.iter().flat_map(|f| f.0.iter().copied()).collect();
            let d: Vec<[f64; MAX_BITS as usize + 1]> =
                fitted.iter().flat_map(|f| f.1.iter().copied()).collect();
            greedy(&all, &a, &d, budget(width * cfg.n_layers))
                .chunks(width)
                .map(<[u8]>::to_vec)
                .collect()
        } else {
            fitted
                .iter()
                .map(|(a, d, _)| {
                    if opts.per_layer {
                        let all: Vec<Vec<usize>> = (0..n_kv).flat_map(|h| units(h, 0)).collect();
                        greedy(&all, a, d, budget(width))
                    } else {
                        let mut lb = vec![0u8; width];
                        for h in 0..n_kv {
                            let w = greedy(&units(h, 0), a, d, budget(hd));
                            let r = h * hd..(h + 1) * hd;
                            lb[r.clone()].copy_from_slice(&w[r]);
                        }
                        lb
                    }
                })
                .collect()
        };
        let coded = if trellis.is_empty() {
            Vec::new()
        } else {
            bits.iter()
                .zip(&fitted)
                .map(|(lb, (_, _, on))| {
                    lb.iter()
                        .enumerate()
                        .map(|(c, &b)| on[c][usize::from(b)])
                        .collect()
                })
                .collect()
        };
        Ok(ChannelBits {
            block,
            n_kv_heads: n_kv,
            head_dim: hd,
            bits,
            sinks: opts.sinks,
            trellis,
            coded,
        })
    }

    /// Every channel of every head at `bits`: the plain per-channel grid
    /// through the same round trip.
    pub fn uniform(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        bits: u8,
        block: usize,
    ) -> Self {
        ChannelBits {
            block,
            n_kv_heads,
            head_dim,
            bits: vec![vec![bits.min(MAX_BITS); n_kv_heads * head_dim]; n_layers],
            sinks: 0,
            trellis: Vec::new(),
            coded: Vec::new(),
        }
    }

    /// These widths with the channels of 1–3 bits in a trellis code along
    /// their block's tokens ([`TrellisCode`], 256 levels; the block's `f16`
    /// mean and scale in place of the grid's zero and scale, so the bits
    /// count the same).
    ///
    /// # Errors
    /// None for the blocks [`fit_with`](Self::fit_with) takes; the message
    /// of [`TrellisCode::gaussian`] otherwise.
    pub fn with_trellis(mut self) -> Result<Self, String> {
        self.trellis = trellis_codes(self.block)?;
        self.coded = self
            .bits
            .iter()
            .map(|l| {
                l.iter()
                    .map(|&b| (1..=TRELLIS_MAX_BITS).contains(&b))
                    .collect()
            })
            .collect();
        Ok(self)
    }

    /// Count of channels in a trellis code, over every layer and head.
    pub fn trellis_channels(&self) -> usize {
        self.coded.iter().flatten().filter(|&&c| c).count()
    }

    /// These widths with the rows at positions below `sinks` left exact,
    /// as a cache keeps its sinks; the per-channel blocks start after them.
    /// A round trip of rows that start at a later position (`pos0`) keeps
    /// only the sinks' rows among them, and its blocks start at its first
    /// quantized row, not where a cache's would.
    pub fn with_sinks(mut self, sinks: usize) -> Self {
        self.sinks = sinks;
        self
    }

    /// The widths of layer `l`, `[head·head_dim + c]`.
    pub fn layer(&self, l: usize) -> &[u8] {
        &self.bits[l]
    }

    /// Stored bits per key element of layer `l`: the codes, an `f16` scale
    /// and zero per channel and block (the mean alone for a 0-bit channel).
    pub fn effective_bits(&self, l: usize) -> f64 {
        let b = &self.bits[l];
        let per = |w: u8| f64::from(w) + if w == 0 { 16.0 } else { 32.0 } / self.block as f64;
        b.iter().map(|&w| per(w)).sum::<f64>() / b.len() as f64
    }

    /// Count of channels at each width, over every layer and head.
    pub fn histogram(&self) -> [usize; MAX_BITS as usize + 1] {
        let mut h = [0; MAX_BITS as usize + 1];
        self.bits.iter().flatten().for_each(|&w| h[w as usize] += 1);
        h
    }
}

/// Hand out `total` code bits over `units` (channel indices into `a` and
/// `d` that share a width): at each step the jump of one to three bits
/// with the largest drop of `Σ a·D` per bit spent. Returns each channel's
/// width.
pub(crate) fn greedy(
    units: &[Vec<usize>],
    a: &[f64],
    d: &[[f64; MAX_BITS as usize + 1]],
    total: usize,
) -> Vec<u8> {
    let cost = |u: &[usize], b: usize| u.iter().map(|&c| a[c] * d[c][b]).sum::<f64>();
    let mut ub = vec![0usize; units.len()];
    let mut left = total;
    loop {
        let mut best: Option<(f64, usize, usize)> = None;
        for (i, u) in units.iter().enumerate() {
            let b = ub[i];
            for j in 1..=3usize {
                if b + j > MAX_BITS as usize || j * u.len() > left {
                    break;
                }
                let slope = (cost(u, b) - cost(u, b + j)) / (j * u.len()) as f64;
                if best.is_none_or(|(s, _, _)| slope > s) {
                    best = Some((slope, i, j));
                }
            }
        }
        let Some((_, i, j)) = best else { break };
        ub[i] += j;
        left -= j * units[i].len();
    }
    let mut bits = vec![0u8; a.len()];
    for (u, &b) in units.iter().zip(&ub) {
        u.iter().for_each(|&c| bits[c] = b as u8);
    }
    bits
}

impl RoundTrip for ChannelBits {
    fn round_trip(
        &self,
        layer: usize,
        pos0: usize,
        x: &mut [f32],
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), String> {
        let width = n_kv_heads * head_dim;
        if n_kv_heads != self.n_kv_heads || head_dim != self.head_dim || layer >= self.bits.len() {
            return Err(format!(
                "channel bits: fitted for {} layers of {}x{}, got layer {layer} of {n_kv_heads}x{head_dim}",
                self.bits.len(),
                self.n_kv_heads,
                self.head_dim
            ));
        }
        crate::model::rows_width("channel bits", x, n_tokens, n_kv_heads, head_dim)?;
        let widths = &self.bits[layer];
        let mut done = [false; MAX_BITS as usize + 1];
        // Rows at positions below `sinks` stay exact; blocks start after.
        let skip = self.sinks.saturating_sub(pos0).min(n_tokens) * width;
        let x = &mut x[skip..];
        let src = x.to_vec();
        let coded = |c: usize| self.coded.get(layer).is_some_and(|l| l[c]);
        for (b, code) in (1..).zip(&self.trellis) {
            code_channels(x, width, self.block, code, |c| widths[c] == b && coded(c));
        }
        for (c, &b) in widths.iter().enumerate() {
            if coded(c) || std::mem::replace(&mut done[b as usize], true) {
                continue;
            }
            let r = at_width(&src, width, b, self.block)?;
            for (i, (y, &w)) in x.iter_mut().zip(widths.iter().cycle()).enumerate() {
                if w == b && !coded(i % width) {
                    *y = r[i];
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_spends_the_budget_where_it_pays() {
        // Channel 0 matters 100x more than channel 1; both lose 4x per bit.
        let d: Vec<[f64; 9]> = (0..2)
            .map(|_| std::array::from_fn(|b| 4f64.powi(-(b as i32))))
            .collect();
        let one = vec![vec![0], vec![1]];
        let bits = greedy(&one, &[100.0, 1.0], &d, 8);
        assert_eq!(bits.iter().map(|&b| b as usize).sum::<usize>(), 8);
        // 100x is log4(100) ≈ 3.3 bits of lead at equal marginal drops.
        assert!(bits[0] >= bits[1] + 3, "{bits:?}");
        // A budget past 8 bits a channel stops at the cap.
        assert_eq!(greedy(&one, &[1.0, 1.0], &d, 40), vec![8, 8]);
        // A unit of two channels takes one width and two bits a step; an
        // odd budget leaves the last bit unspent.
        let pair = vec![vec![0, 1]];
        assert_eq!(greedy(&pair, &[100.0, 1.0], &d, 7), vec![3, 3]);
    }

    #[test]
    fn zero_bits_keep_the_block_mean() {
        // Channel 0 counts up, channel 1 down; 8 channels a row.
        let x: Vec<f32> = (0..10)
            .flat_map(|i| {
                let mut r = [0f32; 8];
                r[0] = i as f32;
                r[1] = -(i as f32);
                r
            })
            .collect();
        let r = at_width(&x, 8, 0, 4).unwrap();
        let col = |c: usize| r.iter().skip(c).step_by(8).copied().collect::<Vec<_>>();
        assert_eq!(
            col(0),
            vec![1.5, 1.5, 1.5, 1.5, 5.5, 5.5, 5.5, 5.5, 8.5, 8.5]
        );
        assert_eq!(
            col(1),
            vec![-1.5, -1.5, -1.5, -1.5, -5.5, -5.5, -5.5, -5.5, -8.5, -8.5]
        );
        assert!(col(2).iter().all(|&v| v == 0.0));
    }

    /// One layer of the given widths in the grid, blocks of 32 tokens.
    fn one_layer(widths: &[u8], n_kv: usize, hd: usize) -> ChannelBits {
        ChannelBits {
            block: 32,
            n_kv_heads: n_kv,
            head_dim: hd,
            bits: vec![widths.to_vec()],
            sinks: 0,
            trellis: Vec::new(),
            coded: Vec::new(),
        }
    }

    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::model::SplitMix64(seed);
        (0..n).map(|_| r.uniform()).collect()
    }

    #[test]
    fn one_width_is_the_per_channel_grid() {
        let (t, n_kv, hd) = (100, 2, 16);
        let x = noise(t * n_kv * hd, 7);
        for b in [2u8, 3, 4, 8] {
            let mut y = x.clone();
            ChannelBits::uniform(1, n_kv, hd, b, 32)
                .round_trip(0, 0, &mut y, t, n_kv, hd)
                .unwrap();
            let s = QuantScheme::new(b, Axis::PerChannel, Group::Size(32)).unwrap();
            assert_eq!(
                y,
                Codec::uniform(s).roundtrip(&x, n_kv, hd).unwrap(),
                "{b} bits"
            );
        }
    }

    #[test]
    fn mixed_widths_quantize_each_channel_at_its_own() {
        let (t, n_kv, hd) = (70, 2, 8);
        let x = noise(t * n_kv * hd, 9);
        let widths: Vec<u8> = (0..n_kv * hd).map(|i| [0, 2, 3, 4, 8][i % 5]).collect();
        let a = one_layer(&widths, n_kv, hd);
        let mut y = x.clone();
        a.round_trip(0, 0, &mut y, t, n_kv, hd).unwrap();
        for b in [0u8, 2, 3, 4, 8] {
            let r = at_width(&x, n_kv * hd, b, 32).unwrap();
            for (i, (&got, &want)) in y.iter().zip(&r).enumerate() {
                if widths[i % (n_kv * hd)] == b {
                    assert_eq!(got, want, "element {i} at {b} bits");
                }
            }
        }
        // 2/5 of the channels hold 0 bits and a mean, the rest codes and
        // a scale and zero per block of 32.
        let eb = widths
            .iter()
            .map(|&w| f64::from(w) + if w == 0 { 0.5 } else { 1.0 })
            .sum::<f64>()
            / 16.0;
        assert!((a.effective_bits(0) - eb).abs() < 1e-12);
        // Another shape or layer is refused, and the rows are untouched.
        let mut z = x.clone();
        assert!(a.round_trip(1, 0, &mut z, t, n_kv, hd).is_err());
        assert!(a.round_trip(0, 0, &mut z, t, 1, 2 * hd).is_err());
        assert!(a.round_trip(0, 0, &mut z[..8], t, n_kv, hd).is_err());
        assert_eq!(z, x);
    }

    /// With a trellis, channels of 1–3 bits take the trellis code of their
    /// width around each block's mean, wider ones the grid, 0 bits the
    /// mean; on Gaussian channels the trellis beats the grid at the same
    /// bits, which count the same.
    #[test]
    fn trellis_widths_code_their_channels() {
        let (t, n_kv, hd) = (96, 1, 8);
        let mut r = crate::model::SplitMix64(5);
        let x: Vec<f32> = (0..t * n_kv * hd)
            .map(|i| r.gaussian() * (1.0 + (i % hd) as f32) + 3.0)
            .collect();
        let widths: Vec<u8> = vec![0, 1, 2, 3, 4, 6, 2, 2];
        let grid = one_layer(&widths, n_kv, hd);
        let tr = grid.clone().with_trellis().unwrap();
        assert_eq!(tr.trellis_channels(), 5);
        let (mut yg, mut yt) = (x.clone(), x.clone());
        grid.round_trip(0, 0, &mut yg, t, n_kv, hd).unwrap();
        tr.round_trip(0, 0, &mut yt, t, n_kv, hd).unwrap();
        let err = |y: &[f32], c: usize| -> f64 {
            (0..t)
                .map(|i| f64::from(y[i * hd + c] - x[i * hd + c]).powi(2))
                .sum()
        };
        for (c, &w) in widths.iter().enumerate() {
            match w {
                0 | 4 | 6 => assert_eq!(err(&yt, c), err(&yg, c), "channel {c}"),
                _ => {
                    let mut want = x.clone();
                    let code = &tr.trellis[usize::from(w) - 1];
                    code_channels(&mut want, hd, 32, code, |k| k == c);
                    assert!((0..t).all(|i| yt[i * hd + c] == want[i * hd + c]));
                    assert!(err(&yt, c) < err(&yg, c), "channel {c} at {w} bits");
                }
            }
        }
    }

    #[test]
    fn sinks_stay_exact_and_blocks_start_after_them() {
        let (t, n_kv, hd) = (40, 1, 8);
        let x = noise(t * n_kv * hd, 3);
        let a = ChannelBits::uniform(1, n_kv, hd, 3, 16).with_sinks(4);
        let mut y = x.clone();
        a.round_trip(0, 0, &mut y, t, n_kv, hd).unwrap();
        assert_eq!(y[..4 * hd], x[..4 * hd]);
        let rest = at_width(&x[4 * hd..], hd, 3, 16).unwrap();
        assert_eq!(y[4 * hd..], rest[..]);
        // Rows from position 2: two sink rows among them.
        let mut y = x.clone();
        a.round_trip(0, 2, &mut y, t, n_kv, hd).unwrap();
        assert_eq!(y[..2 * hd], x[..2 * hd]);
        assert_eq!(y[2 * hd..], at_width(&x[2 * hd..], hd, 3, 16).unwrap()[..]);
        // Rows past the sinks: all quantized.
        let mut y = x.clone();
        a.round_trip(0, 4, &mut y, t, n_kv, hd).unwrap();
        assert_eq!(y, at_width(&x, hd, 3, 16).unwrap());
    }

    #[test]
    fn partners_follow_the_rope_style() {
        assert_eq!(partner(4, RopeStyle::Adjacent, 64), 5);
        assert_eq!(partner(5, RopeStyle::Adjacent, 64), 4);
        assert_eq!(partner(4, RopeStyle::Halves, 64), 36);
        assert_eq!(partner(36, RopeStyle::Halves, 64), 4);
        assert_eq!(partner(40, RopeStyle::Halves, 32), 40);
    }
}
