//! The randomized Hadamard rotation: `y = H·D·x` per head, `H` the
//! normalized Walsh–Hadamard matrix, `D` a fixed diagonal of ±1.
//!
//! Attention only needs dot products, and an orthogonal `R` keeps them:
//! `q·k = (R·q)·(R·k)` and `Σ p_t·v_t = Rᵀ·Σ p_t·(R·v_t)`. Rotating keys and
//! values before they are quantized, the query before the scores and the
//! output back after the weighted sum is therefore exact up to f32
//! rounding — but the rotated vectors have their outlier channels spread
//! over the whole block, so a per-token grid of few bits fits them far
//! better (the reason llama.cpp, RotateKV, ExLlamaV3 and TurboQuant rotate).
//! `D` (random signs) keeps a structured vector, e.g. one spike, from
//! mapping to another structured one.
//!
//! A head of `head_dim` channels is rotated in blocks of the largest power
//! of two dividing it (the whole head at 64, 128 or 256; 32 at 96).

use crate::error::{Error, Result};

/// The rotation of one head (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct Hadamard {
    head_dim: usize,
    block: usize,
    /// `D`, one sign per channel of a head.
    signs: Vec<f32>,
    /// `1/√block`: makes `H` orthonormal.
    norm: f32,
}

/// The seed of the sign diagonal: part of the format (the same for every
/// cache, so stored bytes mean the same thing everywhere).
const SIGN_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hadamard {
    /// The rotation of heads of `head_dim` channels.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `head_dim` is a positive multiple of 8
    /// (blocks of at least 8 channels).
    pub fn new(head_dim: usize) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(8) {
            return Err(Error::InvalidShape {
                op: "Hadamard::new",
                what: format!("head_dim {head_dim} is not a positive multiple of 8"),
            });
        }
        let block = 1usize << head_dim.trailing_zeros();
        let mut s = SIGN_SEED;
        let signs = (0..head_dim)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                if s >> 63 == 0 {
                    1.0
                } else {
                    -1.0
                }
            })
            .collect();
        Ok(Hadamard {
            head_dim,
            block,
            signs,
            norm: 1.0 / (block as f32).sqrt(),
        })
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Channels per Walsh–Hadamard block.
    pub fn block(&self) -> usize {
        self.block
    }

    /// `x ← H·D·x` for every head of `x` (a whole number of heads: rows of
    /// any number of heads, one after the other).
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of `head_dim` (callers pass whole rows).
    pub fn forward(&self, x: &mut [f32]) {
        assert!(x.len().is_multiple_of(self.head_dim), "whole heads");
        for head in x.chunks_exact_mut(self.head_dim) {
            head.iter_mut().zip(&self.signs).for_each(|(v, s)| *v *= s);
            self.blocks(head);
        }
    }

    /// `x ← D·H·x`, the inverse of [`forward`](Self::forward).
    ///
    /// # Panics
    /// As [`forward`](Self::forward).
    pub fn inverse(&self, x: &mut [f32]) {
        assert!(x.len().is_multiple_of(self.head_dim), "whole heads");
        for head in x.chunks_exact_mut(self.head_dim) {
            self.blocks(head);
            head.iter_mut().zip(&self.signs).for_each(|(v, s)| *v *= s);
        }
    }

    /// The normalized transform of each block of one head (`H` is its own
    /// inverse).
    fn blocks(&self, head: &mut [f32]) {
        for b in head.chunks_exact_mut(self.block) {
            fwht(b);
            b.iter_mut().for_each(|v| *v *= self.norm);
        }
    }
}

/// The unnormalized fast Walsh–Hadamard transform of `x` (length a power of
/// two), in place: `log₂ n` rounds of butterflies.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    if n >= 4 {
        // The first two rounds, whose halves are one and two values long,
        // as one 4-point transform per quad: the same sums in the same
        // order, without a loop per butterfly.
        for c in x.chunks_exact_mut(4) {
            let (s0, d0) = (c[0] + c[1], c[0] - c[1]);
            let (s1, d1) = (c[2] + c[3], c[2] - c[3]);
            c[0] = s0 + s1;
            c[1] = d0 + d1;
            c[2] = s0 - s1;
            c[3] = d0 - d1;
        }
        h = 4;
    }
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (u, w) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *w);
                *u = p + q;
                *w = p - q;
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_first_rounds_change_no_bit() {
        // The plain rounds, one butterfly at a time.
        fn plain(x: &mut [f32]) {
            let mut h = 1;
            while h < x.len() {
                for pair in x.chunks_exact_mut(2 * h) {
                    let (a, b) = pair.split_at_mut(h);
                    for (u, w) in a.iter_mut().zip(b.iter_mut()) {
                        let (p, q) = (*u, *w);
                        *u = p + q;
                        *w = p - q;
                    }
                }
                h *= 2;
            }
        }
        let mut seed = 12345u32;
        for n in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
            let x: Vec<f32> = (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                    (seed >> 8) as f32 / (1 << 20) as f32 - 8.0
                })
                .collect();
            let (mut a, mut b) = (x.clone(), x);
            fwht(&mut a);
            plain(&mut b);
            let (a, b): (Vec<u32>, Vec<u32>) = (
                a.iter().map(|v| v.to_bits()).collect(),
                b.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(a, b, "n {n}");
        }
    }

    #[test]
    fn matches_the_dense_matrix_and_inverts() {
        for hd in [8, 24, 64, 96, 128] {
            let r = Hadamard::new(hd).unwrap();
            let b = r.block();
            assert!(b.is_power_of_two() && hd % b == 0 && (hd / b) % 2 == 1);
            let x: Vec<f32> = (0..2 * hd)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let mut y = x.clone();
            r.forward(&mut y);
            // Dense H·D: entry (i, j) of a block is (−1)^popcount(i & j)/√b.
            for h in 0..2 {
                for i in 0..hd {
                    let (blk, ii) = (i / b, i % b);
                    let want: f64 = (0..b)
                        .map(|jj| {
                            let j = blk * b + jj;
                            let sgn = if (ii & jj).count_ones() % 2 == 0 {
                                1.0
                            } else {
                                -1.0
                            };
                            sgn * r.signs[j] as f64 * x[h * hd + j] as f64
                        })
                        .sum::<f64>()
                        / (b as f64).sqrt();
                    assert!((y[h * hd + i] as f64 - want).abs() < 1e-4, "hd {hd} i {i}");
                }
            }
            // Norm kept; inverse restores x.
            let n2 = |v: &[f32]| v.iter().map(|&a| a as f64 * a as f64).sum::<f64>();
            assert!((n2(&y) - n2(&x)).abs() < 1e-4 * n2(&x));
            r.inverse(&mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn spreads_a_spike() {
        let r = Hadamard::new(128).unwrap();
        let mut x = vec![0f32; 128];
        x[5] = 100.0;
        r.forward(&mut x);
        let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!((m - 100.0 / 128f32.sqrt()).abs() < 1e-3, "max {m}");
        assert!(Hadamard::new(12).is_err() && Hadamard::new(0).is_err());
    }
}
