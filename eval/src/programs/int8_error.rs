//! The extra error of the opt-in int8 kernels at the point of use: one
//! attention head (scores → softmax → weighted sum) over a packed KIVI
//! cache (keys per-channel, values per-token, groups of 32), exact kernels
//! against `scores_i8` (int8 query) and `scores_i8` + `weighted_sum_i8`
//! (int8 query and int8 weights). For scale, the same against a dense f32
//! cache shows what the 4-bit quantization itself costs.
//!
//! ```text
//! cargo run --release --example int8_error
//! ```
//!
//! Synthetic data (no download): keys uniform in [−1, 1] with three outlier
//! channels ×8 (like real keys), values uniform in [−1, 1]; the logits are
//! scaled by `sharp/√head_dim`, so `sharp` sets how peaked attention is.
//! On a CPU without AVX-512 VNNI the int8 calls run the exact kernels and
//! the int8 rows read zero.

use clap::Parser;

use crate::BoxError;
use kvq::kernels::{self, dense};
use kvq::Backend;
use kvq::{Axis, Group, KvQuantizer, QuantScheme, UniformQuantizer};

/// The extra error of the opt-in int8 kernels at the point of use, on
/// synthetic data (no download).
///
/// One attention head over a packed KIVI cache (keys per-channel, values
/// per-token, groups of 32): the exact kernels against scores_i8 (int8
/// query) and scores_i8 + weighted_sum_i8 (int8 query and weights), and for
/// scale the 4-bit quantization itself against a dense f32 cache. On a CPU
/// without AVX-512 VNNI the int8 calls run the exact kernels and the int8
/// columns read zero.
#[derive(Debug, Clone, Parser)]
#[command(name = "int8_error")]
pub struct Args {}

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Softmax weights and output of one head; `mode` 0 exact, 1 int8 query,
/// 2 int8 query and weights, 3 int8 weights only.
fn attend(
    k: &kvq::PackedHead<'_>,
    v: &kvq::PackedHead<'_>,
    q: &[f32],
    sc: f32,
    mode: u8,
) -> (Vec<f32>, Vec<f32>) {
    let be = Backend::detect();
    let mut s = vec![0f32; k.tokens()];
    if mode == 0 || mode == 3 {
        kernels::scores_on(be, k, q, &mut s).unwrap();
    } else {
        kernels::scores_i8_on(be, k, q, &mut s).unwrap();
    }
    s.iter_mut().for_each(|x| *x *= sc);
    kernels::softmax_on(be, &mut s);
    let mut out = vec![0f32; q.len()];
    if mode >= 2 {
        kernels::weighted_sum_i8_on(be, v, &s, &mut out).unwrap();
    } else {
        kernels::weighted_sum_on(be, v, &s, &mut out).unwrap();
    }
    (s, out)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n).sqrt()
}

fn kl(p: &[f32], r: &[f32]) -> f64 {
    p.iter()
        .zip(r)
        .filter(|(p, _)| **p > 0.0)
        .map(|(p, r)| *p as f64 * (*p as f64 / (*r as f64).max(1e-30)).ln())
        .sum()
}

/// Run the program: print the table.
pub fn run(_args: Args) -> Result<(), BoxError> {
    let (hd, ctx) = (128, 4096);
    let be = Backend::detect();
    println!(
        "backend {}, head_dim {hd}, {ctx} tokens, KIVI groups of 32",
        be.name()
    );
    println!("Relative RMS error of the attention output (and softmax KL) against the exact kernels on the same packed cache; first column: the packed cache's own error against dense f32.");
    println!("| bits | sharp | quantization (vs f32) | int8 query | KL | int8 weights | int8 query + weights | KL |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for bits in [4u8, 8] {
        for sharp in [1.0f32, 4.0, 16.0] {
            let mut kx = data(ctx * hd, 1);
            for t in 0..ctx {
                for c in [3, 77, 100] {
                    kx[t * hd + c] *= 8.0;
                }
            }
            let vx = data(ctx * hd, 2);
            let sc = sharp / (hd as f32).sqrt();
            // Average over a few queries.
            let (mut e_quant, mut e_q, mut kl_q, mut e_qw, mut kl_qw) = (0.0, 0.0, 0.0, 0.0, 0.0);
            let mut e_w = 0.0;
            let nq = 8;
            let qz = |ax| {
                let s = QuantScheme::new(bits, ax, Group::Size(32)).unwrap();
                UniformQuantizer::new(s, 1, hd).unwrap()
            };
            let kb = qz(Axis::PerChannel).quantize(&kx, ctx).unwrap();
            let vb = qz(Axis::PerToken).quantize(&vx, ctx).unwrap();
            let (k, v) = (kb.head(0), vb.head(0));
            for i in 0..nq {
                let q = data(hd, 10 + i as u64);
                // Dense f32 reference.
                let mut s = vec![0f32; ctx];
                dense::scores_f32_on(be, hd, &kx, &q, &mut s).unwrap();
                s.iter_mut().for_each(|x| *x *= sc);
                kernels::softmax_on(be, &mut s);
                let mut dref = vec![0f32; hd];
                dense::weighted_sum_f32_on(be, hd, &vx, &s, &mut dref).unwrap();
                let (p0, o0) = attend(&k, &v, &q, sc, 0);
                let (p1, o1) = attend(&k, &v, &q, sc, 1);
                let (p2, o2) = attend(&k, &v, &q, sc, 2);
                let (_, o3) = attend(&k, &v, &q, sc, 3);
                e_w += rel(&o3, &o0) / nq as f64;
                e_quant += rel(&o0, &dref) / nq as f64;
                e_q += rel(&o1, &o0) / nq as f64;
                kl_q += kl(&p0, &p1) / nq as f64;
                e_qw += rel(&o2, &o0) / nq as f64;
                kl_qw += kl(&p0, &p2) / nq as f64;
            }
            println!(
                "| {bits} | {sharp} | {:.2} % | {:.2} % | {kl_q:.1e} | {:.2} % | {:.2} % | {kl_qw:.1e} |",
                100.0 * e_quant,
                100.0 * e_q,
                100.0 * e_w,
                100.0 * e_qw
            );
        }
    }
    if !kernels::weighted_sum_i8_is_int8(
        be,
        &{
            let s = QuantScheme::new(4, Axis::PerToken, Group::Size(32)).unwrap();
            UniformQuantizer::new(s, 1, hd)
                .unwrap()
                .quantize(&data(hd, 3), 1)
                .unwrap()
        }
        .head(0),
        1,
    ) {
        println!(
            "(this CPU or backend has no int8 kernels: the int8 columns are the exact kernels)"
        );
    }
    Ok(())
}
