//! Values in a bitshift trellis code: a study of what a trellis-coded value
//! format would buy over rotated Lloyd-Max levels at the same bits, run as
//! a quantize-dequantize [`RoundTrip`] on the values (no such format exists
//! in `kvq`).
//!
//! A scalar codebook of `2^k` levels spends `k` bits on each value alone.
//! A trellis code spends the same `k` bits per value but lets each value
//! read a *window* of the bit stream: value `i`'s state is the last `L`
//! bits written up to it, `s_i = ((s_{i−1} << k) | c_i) mod 2^L`, and it
//! decodes as `scale·level[s_i]` from a table of `2^L` levels. The encoder
//! picks the whole head's codes at once (Viterbi over the `2^L` states), so
//! each value chooses among `2^k` levels that depend on its neighbours'
//! choices, which fills space better than one grid per value: on unit
//! Gaussians at `L = 8` (chains of 128, each with its own scale) the mean
//! squared error is 0.087 at 2 bits and 0.025 at 3, against Lloyd-Max's
//! 0.118 and 0.035 (about 0.2 bit). The decode
//! of one value needs only its window, as QTIP's bitshift trellis does,
//! so a fused kernel can decode any value without its predecessors.
//!
//! Here each head's values are rotated by `kvq`'s Hadamard rotation, coded
//! as one chain whose first state has its high `L − k` bits zero (exactly
//! `k` bits per value), with one `f16` scale per group of `group` values:
//! the group's RMS to pick the path, then the least-squares scale for it.
//! The table is fitted to Gaussian samples by Lloyd iterations on the
//! trellis' own encoder, from Gaussian quantiles in a fixed random order.

use crate::model::RoundTrip;
use half::f16;
use kvq::Hadamard;

/// Widest state the study allows (a table of 4096 levels).
const MAX_STATE_BITS: u32 = 12;

/// A bitshift trellis code for values (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct TrellisCode {
    /// `L`: bits of the state window.
    state_bits: u32,
    /// `k`: bits written per value.
    code_bits: u32,
    /// Values per `f16` scale.
    group: usize,
    /// `2^L` levels for values of unit RMS.
    levels: Vec<f32>,
    /// Positions kept exact.
    sinks: usize,
}

/// A 64-bit LCG step: the study's deterministic random source.
fn lcg(s: &mut u64) -> u64 {
    *s = s
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *s >> 11
}

fn uniform(s: &mut u64) -> f64 {
    (lcg(s) as f64 + 0.5) / (1u64 << 53) as f64
}

fn gaussian(s: &mut u64) -> f64 {
    let (u, v) = (uniform(s), uniform(s));
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// The standard normal quantile (Acklam's rational approximation, relative
/// error below 1.2e-9).
pub(crate) fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    const LOW: f64 = 0.024_25;
    if p < LOW {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - LOW {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -normal_quantile(1.0 - p)
    }
}

/// Scratch of one Viterbi pass, reused across chains.
#[derive(Debug, Default)]
pub struct Scratch {
    /// Each group's scale.
    scales: Vec<f32>,
    cost: Vec<f32>,
    next: Vec<f32>,
    /// Best predecessor cost per shared prefix (`2^(L−k)`).
    best: Vec<f32>,
    /// Per step and prefix, the high `k` bits of the best predecessor.
    back: Vec<u8>,
    states: Vec<u32>,
}

impl TrellisCode {
    /// A code of `2^state_bits` levels writing `code_bits` bits per value,
    /// one `f16` scale per `group` values, its table fitted to Gaussian
    /// samples (deterministic: the same arguments give the same table).
    ///
    /// # Errors
    /// A message for `code_bits` outside 1–4, `state_bits` not above
    /// `code_bits` or above 12, or a group of 0.
    pub fn gaussian(state_bits: u32, code_bits: u32, group: usize) -> Result<Self, String> {
        if !(1..=4).contains(&code_bits) || state_bits <= code_bits || state_bits > MAX_STATE_BITS {
            return Err(format!(
                "a trellis of {state_bits}-bit states and {code_bits}-bit codes: codes take 1-4 bits, states more bits than codes and at most {MAX_STATE_BITS}"
            ));
        }
        if group == 0 {
            return Err("a trellis group of 0 values".into());
        }
        let n = 1usize << state_bits;
        let mut rng = 0x5eed_0f7e_1115_u64 ^ u64::from(state_bits << 8 | code_bits);
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (lcg(&mut rng) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let levels = order
            .iter()
            .map(|&r| normal_quantile((r as f64 + 0.5) / n as f64) as f32)
            .collect();
        let mut code = TrellisCode {
            state_bits,
            code_bits,
            group,
            levels,
            sinks: 0,
        };
        // Lloyd iterations on chains of 128 unit Gaussians.
        const CHAIN: usize = 128;
        let train: Vec<f32> = (0..(64 * n).div_ceil(CHAIN) * CHAIN)
            .map(|_| gaussian(&mut rng) as f32)
            .collect();
        let mut s = Scratch::default();
        for _ in 0..6 {
            let mut sum = vec![0f64; n];
            let mut count = vec![0u32; n];
            for chain in train.chunks_exact(CHAIN) {
                code.viterbi(chain, &[1.0], CHAIN, &mut s);
                for (&x, &st) in chain.iter().zip(&s.states) {
                    sum[st as usize] += f64::from(x);
                    count[st as usize] += 1;
                }
            }
            for ((l, s), c) in code.levels.iter_mut().zip(&sum).zip(&count) {
                if *c > 0 {
                    *l = (s / f64::from(*c)) as f32;
                }
            }
        }
        Ok(code)
    }

    /// The same code keeping positions below `sinks` exact.
    pub fn with_sinks(mut self, sinks: usize) -> Self {
        self.sinks = sinks;
        self
    }

    /// The table of `2^L` levels (for unit-RMS values).
    pub fn levels(&self) -> &[f32] {
        &self.levels
    }

    /// Stored bits per value of heads of `head_dim`: the codes and one
    /// `f16` scale per group (a group never spans heads; sinks not
    /// counted).
    pub fn effective_bits(&self, head_dim: usize) -> f64 {
        f64::from(self.code_bits) + 16.0 / self.group.min(head_dim.max(1)) as f64
    }

    /// The states (Viterbi) that minimize `Σ (x_i − scale_{g(i)}·level[s_i])²`
    /// over one chain `x`, scales per group of `group` values, into
    /// `s.states`.
    fn viterbi(&self, x: &[f32], scales: &[f32], group: usize, s: &mut Scratch) {
        let (l, k) = (self.state_bits, self.code_bits);
        let n = 1usize << l;
        let prefixes = n >> k;
        let fan = 1usize << k;
        s.cost.clear();
        s.cost.resize(n, f32::INFINITY);
        s.next.resize(n, 0.0);
        s.best.resize(prefixes, 0.0);
        s.back.clear();
        s.back.resize(x.len() * prefixes, 0);
        // The first state's high bits are zero: states 0..2^k.
        let sc = scales[0];
        for st in 0..fan {
            let e = x[0] - sc * self.levels[st];
            s.cost[st] = e * e;
        }
        for i in 1..x.len() {
            let sc = scales[i / group];
            let back = &mut s.back[i * prefixes..(i + 1) * prefixes];
            // A state's successors share its low `L − k` bits: the best
            // predecessor of every successor of prefix `p` is the best of
            // the states `p | hi << (L − k)`.
            for (p, (b, bk)) in s.best.iter_mut().zip(back.iter_mut()).enumerate() {
                let mut m = s.cost[p];
                let mut arg = 0u8;
                for hi in 1..fan {
                    let c = s.cost[p | hi << (l - k)];
                    if c < m {
                        m = c;
                        arg = hi as u8;
                    }
                }
                *b = m;
                *bk = arg;
            }
            let xi = x[i];
            for (st, (nx, lv)) in s.next.iter_mut().zip(&self.levels).enumerate() {
                let e = xi - sc * lv;
                *nx = s.best[st >> k] + e * e;
            }
            std::mem::swap(&mut s.cost, &mut s.next);
        }
        let mut st = s
            .cost
            .iter()
            .enumerate()
            .fold((0usize, f32::INFINITY), |acc, (j, &c)| {
                if c < acc.1 {
                    (j, c)
                } else {
                    acc
                }
            })
            .0;
        s.states.clear();
        s.states.resize(x.len(), 0);
        for i in (0..x.len()).rev() {
            s.states[i] = st as u32;
            if i > 0 {
                let hi = usize::from(s.back[i * prefixes + (st >> k)]);
                st = (st >> k) | hi << (l - k);
            }
        }
    }

    /// Replace one rotated head `x` by its reconstruction: the path for
    /// the groups' RMS, then each group's least-squares `f16` scale.
    fn code_head(&self, x: &mut [f32], s: &mut Scratch) {
        let g = self.group.min(x.len());
        let mut scales = std::mem::take(&mut s.scales);
        scales.clear();
        scales.extend(x.chunks(g).map(|c| {
            let rms = (c.iter().map(|v| v * v).sum::<f32>() / c.len() as f32).sqrt();
            f16::from_f32(rms).to_f32()
        }));
        self.viterbi(x, &scales, g, s);
        s.scales = scales;
        for (c, st) in x.chunks_mut(g).zip(s.states.chunks(g)) {
            let (mut xy, mut yy) = (0f32, 0f32);
            for (v, &q) in c.iter().zip(st) {
                let y = self.levels[q as usize];
                xy += v * y;
                yy += y * y;
            }
            let scale = if yy > 0.0 {
                f16::from_f32(xy / yy).to_f32()
            } else {
                0.0
            };
            for (v, &q) in c.iter_mut().zip(st) {
                *v = scale * self.levels[q as usize];
            }
        }
    }

    /// Replace `x` by its reconstruction as one chain of this code, without
    /// a rotation: one `f16` scale per group of the code's group size
    /// (`s`: scratch reused across calls).
    pub fn code(&self, x: &mut [f32], s: &mut Scratch) {
        self.code_head(x, s);
    }

    /// Check that `states` is one chain of this trellis: each state's low
    /// `L − k` bits shifted up are the next state's high bits, and the
    /// first state's high `L − k` bits are zero.
    #[cfg(test)]
    fn is_chain(&self, states: &[u32]) -> bool {
        let (l, k) = (self.state_bits, self.code_bits);
        let mask = (1u32 << l) - 1;
        states.first().is_none_or(|&s| s >> k == 0)
            && states
                .windows(2)
                .all(|w| (w[0] << k) & mask == w[1] & !((1 << k) - 1))
    }
}

impl RoundTrip for TrellisCode {
    fn round_trip(
        &self,
        _layer: usize,
        pos0: usize,
        x: &mut [f32],
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), String> {
        let width = crate::model::rows_width("trellis", x, n_tokens, n_kv_heads, head_dim)?;
        if x.iter().any(|v| !v.is_finite()) {
            return Err("non-finite values".into());
        }
        let rot = Hadamard::new(head_dim).map_err(|e| e.to_string())?;
        let skip = self.sinks.saturating_sub(pos0).min(n_tokens);
        let rows = &mut x[skip * width..];
        // Each head is its own chain.
        crate::model::on_two_threads(rows, width, |part| {
            let mut s = Scratch::default();
            for head in part.chunks_exact_mut(head_dim) {
                rot.forward(head);
                self.code_head(head, &mut s);
                rot.inverse(head);
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normal_rows(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n).map(|_| gaussian(&mut s) as f32).collect()
    }

    fn mse(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            / a.len() as f64
    }

    /// On unit Gaussians the trellis beats the Lloyd-Max levels of its
    /// width by a fifth or more at 2 and 3 bits (0.1175, 0.03454) and a
    /// tenth at 1 bit (0.3634). Prints each width's error and the span of its levels (the
    /// figures `docs/RESULTS.md` quotes: `cargo test -p kvq-eval
    /// beats_lloyd_max -- --nocapture`).
    #[test]
    fn beats_lloyd_max_on_gaussians() {
        for (k, lloyd_max, below) in [(1, 0.3634, 0.9), (2, 0.1175, 0.8), (3, 0.03454, 0.8)] {
            let code = TrellisCode::gaussian(8, k, 128).unwrap();
            let x = normal_rows(128 * 200, 7);
            let mut y = x.clone();
            let mut s = Scratch::default();
            for head in y.chunks_exact_mut(128) {
                code.code_head(head, &mut s);
            }
            let e = mse(&x, &y);
            let (lo, hi) = code
                .levels()
                .iter()
                .fold((0f32, 0f32), |(a, b), &v| (a.min(v), b.max(v)));
            eprintln!("L8, {k} bits: mse {e:.4} (Lloyd-Max {lloyd_max}), levels {lo:.2}..{hi:.2}");
            assert!(e < lloyd_max * below, "{k} bits: {e} against {lloyd_max}");
            assert!(e > lloyd_max * 0.3, "{k} bits: {e} below any code's reach");
        }
    }

    /// The Viterbi path is the best chain: on short chains its squared
    /// error equals the least over every code sequence (brute force), and
    /// it starts where a chain must (high bits zero).
    #[test]
    fn viterbi_finds_the_best_chain() {
        for (l, k, n, seed) in [(4u32, 2u32, 5usize, 1u64), (5, 1, 9, 2), (6, 3, 3, 3)] {
            let code = TrellisCode::gaussian(l, k, 64).unwrap();
            let lv = code.levels();
            let x: Vec<f32> = normal_rows(n, seed).iter().map(|v| v * 1.3).collect();
            let mut s = Scratch::default();
            code.viterbi(&x, &[1.0], n, &mut s);
            assert!(code.is_chain(&s.states), "{l}/{k}");
            let cost = |st: &[u32]| -> f32 {
                x.iter()
                    .zip(st)
                    .map(|(v, &q)| (v - lv[q as usize]).powi(2))
                    .sum()
            };
            let got = cost(&s.states);
            let (mask, fan) = ((1u32 << l) - 1, 1u32 << k);
            let mut best = f32::INFINITY;
            for seq in 0..fan.pow(n as u32) {
                let (mut st, mut r, mut states) = (0u32, seq, Vec::with_capacity(n));
                for _ in 0..n {
                    st = ((st << k) | (r % fan)) & mask;
                    r /= fan;
                    states.push(st);
                }
                best = best.min(cost(&states));
            }
            assert!(
                (got - best).abs() <= 1e-5 * best.max(1.0),
                "{l}/{k}: {got} against {best}"
            );
        }
        // A chain broken in one place is not a chain, nor one whose first
        // state has high bits set.
        let code = TrellisCode::gaussian(6, 2, 32).unwrap();
        let mut s = Scratch::default();
        code.viterbi(&normal_rows(64, 3), &[1.0], 64, &mut s);
        let mut bad = s.states.clone();
        bad[10] ^= 1 << 5;
        assert!(!code.is_chain(&bad));
        let mut bad = s.states.clone();
        bad[0] |= 1 << 4;
        assert!(!code.is_chain(&bad));
    }

    /// Sinks stay exact, other rows change, zeros stay zeros, and the
    /// round trip refuses bad shapes and non-finite values.
    #[test]
    fn round_trip_keeps_sinks_and_refuses_bad_input() {
        let code = TrellisCode::gaussian(6, 3, 64).unwrap().with_sinks(4);
        let (t, n_kv, hd) = (10, 2, 64);
        let x = normal_rows(t * n_kv * hd, 5);
        let mut y = x.clone();
        code.round_trip(0, 1, &mut y, t, n_kv, hd).unwrap();
        let w = n_kv * hd;
        assert_eq!(&y[..3 * w], &x[..3 * w]);
        assert!(y[3 * w..].iter().zip(&x[3 * w..]).all(|(a, b)| a != b));
        assert!(mse(&x[3 * w..], &y[3 * w..]) < 0.05);
        let mut z = vec![0.0; w];
        code.round_trip(0, 9, &mut z, 1, n_kv, hd).unwrap();
        assert!(z.iter().all(|v| *v == 0.0));
        assert!(code.round_trip(0, 0, &mut y, t + 1, n_kv, hd).is_err());
        y[7] = f32::NAN;
        assert!(code.round_trip(0, 0, &mut y, t, n_kv, hd).is_err());
        assert!(TrellisCode::gaussian(3, 3, 64).is_err());
        assert!(TrellisCode::gaussian(13, 3, 64).is_err());
        assert!(TrellisCode::gaussian(8, 0, 64).is_err());
        assert!(TrellisCode::gaussian(8, 2, 0).is_err());
    }
}
