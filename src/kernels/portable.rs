//! The portable kernels: plain Rust, no `unsafe`, any CPU.
//!
//! Each code row is unpacked once, straight to floats, into a small buffer and used by every
//! query that shares the KV head (GQA); scales are applied per group, never
//! to a dequantized copy of the cache. Callers (the safe wrappers in
//! [`super`]) have checked all lengths.

use crate::pack;
use crate::scheme::Axis;
use crate::store::PackedHead;

pub(crate) fn scores(head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
    let l = head.layout();
    let hd = l.head_dim();
    let rb = l.row_bytes();
    let bits = l.scheme().bits();
    let t_all = head.tokens();
    let nq = q.len() / hd;
    let mut cf = vec![0f32; hd];
    let mut cb = vec![0u8; hd];
    match l.scheme().axis() {
        Axis::PerToken => {
            let gpr = l.groups_per_row();
            let cpg = l.channels_per_group();
            // Σ q over each group, once per call.
            let qsum: Vec<f32> = q.chunks_exact(cpg).map(|g| g.iter().sum()).collect();
            let mut sc = vec![0f32; gpr];
            let mut ze = vec![0f32; gpr];
            for t in 0..t_all {
                unpack_f32(&head.codes[t * rb..(t + 1) * rb], bits, &mut cb, &mut cf);
                head.params_into(t, &mut sc, &mut ze);
                for i in 0..nq {
                    let qi = &q[i * hd..(i + 1) * hd];
                    let mut acc = 0f32;
                    for g in 0..gpr {
                        let r = g * cpg..(g + 1) * cpg;
                        acc += sc[g] * dot(&qi[r.clone()], &cf[r]) + ze[g] * qsum[i * gpr + g];
                    }
                    out[i * t_all + t] = acc;
                }
            }
        }
        Axis::PerChannel => {
            let g = l.group_len();
            let mut sc = vec![0f32; hd];
            let mut ze = vec![0f32; hd];
            let mut qs = vec![0f32; nq * hd];
            let mut bias = vec![0f32; nq];
            for k in 0..t_all.div_ceil(g) {
                head.params_into(k, &mut sc, &mut ze);
                // Fold the block's channel scales into the queries.
                for i in 0..nq {
                    let qi = &q[i * hd..(i + 1) * hd];
                    for c in 0..hd {
                        qs[i * hd + c] = qi[c] * sc[c];
                    }
                    bias[i] = dot(qi, &ze);
                }
                for t in k * g..((k + 1) * g).min(t_all) {
                    unpack_f32(&head.codes[t * rb..(t + 1) * rb], bits, &mut cb, &mut cf);
                    for i in 0..nq {
                        out[i * t_all + t] = dot(&qs[i * hd..(i + 1) * hd], &cf) + bias[i];
                    }
                }
            }
        }
    }
}

pub(crate) fn weighted_sum(head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
    let l = head.layout();
    let hd = l.head_dim();
    let rb = l.row_bytes();
    let bits = l.scheme().bits();
    let t_all = head.tokens();
    let nq = out.len() / hd;
    let mut cf = vec![0f32; hd];
    let mut cb = vec![0u8; hd];
    let mut acc = vec![0f32; nq * hd];
    match l.scheme().axis() {
        Axis::PerToken => {
            let gpr = l.groups_per_row();
            let cpg = l.channels_per_group();
            let mut sc = vec![0f32; gpr];
            let mut ze = vec![0f32; gpr];
            let mut zacc = vec![0f32; nq * gpr];
            for t in 0..t_all {
                unpack_f32(&head.codes[t * rb..(t + 1) * rb], bits, &mut cb, &mut cf);
                head.params_into(t, &mut sc, &mut ze);
                for i in 0..nq {
                    let pt = p[i * t_all + t];
                    let a = &mut acc[i * hd..(i + 1) * hd];
                    for g in 0..gpr {
                        axpy(
                            pt * sc[g],
                            &cf[g * cpg..(g + 1) * cpg],
                            &mut a[g * cpg..(g + 1) * cpg],
                        );
                        zacc[i * gpr + g] += pt * ze[g];
                    }
                }
            }
            for i in 0..nq {
                for c in 0..hd {
                    out[i * hd + c] += acc[i * hd + c] + zacc[i * gpr + c / cpg];
                }
            }
        }
        Axis::PerChannel => {
            let g = l.group_len();
            let mut sc = vec![0f32; hd];
            let mut ze = vec![0f32; hd];
            for k in 0..t_all.div_ceil(g) {
                acc.fill(0.0);
                let mut psum = vec![0f32; nq];
                for t in k * g..((k + 1) * g).min(t_all) {
                    unpack_f32(&head.codes[t * rb..(t + 1) * rb], bits, &mut cb, &mut cf);
                    for i in 0..nq {
                        let pt = p[i * t_all + t];
                        psum[i] += pt;
                        axpy(pt, &cf, &mut acc[i * hd..(i + 1) * hd]);
                    }
                }
                head.params_into(k, &mut sc, &mut ze);
                for i in 0..nq {
                    for c in 0..hd {
                        out[i * hd + c] += sc[c] * acc[i * hd + c] + ze[c] * psum[i];
                    }
                }
            }
        }
    }
}

/// Unpack a row of codes (see [`pack`]) through the `u8` scratch `tmp`
/// (`out.len()` bytes) and widen them to floats (exact: codes are below
/// 256).
fn unpack_f32(packed: &[u8], bits: u8, tmp: &mut [u8], out: &mut [f32]) {
    pack::unpack(packed, bits, tmp);
    for (o, &c) in out.iter_mut().zip(tmp.iter()) {
        *o = c as f32;
    }
}

/// Dot product with 8 independent accumulators (lets the compiler
/// vectorize without reassociation licence).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `y += a·x`.
#[inline]
pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The int8-query arithmetic of [`super::scores_i8`], in plain Rust: per
/// block, `q'_c = q_c·scale_c`, `δ = max_c |q'_c| / 127`,
/// `q̃_c = round(q'_c / δ)`, and `s_t = δ·Σ_c q̃_c·code_tc + q·zero` with
/// the integer sum exact. Per-channel keys only. The specification the
/// VNNI kernel is tested against.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn scores_i8(head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
    let l = head.layout();
    assert_eq!(l.scheme().axis(), Axis::PerChannel);
    let hd = l.head_dim();
    let rb = l.row_bytes();
    let bits = l.scheme().bits();
    let t_all = head.tokens();
    let nq = q.len() / hd;
    let g = l.group_len();
    let mut codes = vec![0u8; hd];
    let (mut sc, mut ze) = (vec![0f32; hd], vec![0f32; hd]);
    let mut qi = vec![0i32; nq * hd];
    let mut delta = vec![0f32; nq];
    let mut bias = vec![0f32; nq];
    for k in 0..t_all.div_ceil(g) {
        head.params_into(k, &mut sc, &mut ze);
        for i in 0..nq {
            let qv = &q[i * hd..(i + 1) * hd];
            let (d, b) = quantize_query(qv, &sc, &ze, &mut qi[i * hd..(i + 1) * hd]);
            delta[i] = d;
            bias[i] = b;
        }
        for t in k * g..((k + 1) * g).min(t_all) {
            pack::unpack(&head.codes[t * rb..(t + 1) * rb], bits, &mut codes);
            for i in 0..nq {
                let dot: i32 = qi[i * hd..(i + 1) * hd]
                    .iter()
                    .zip(&codes)
                    .map(|(&a, &c)| a * c as i32)
                    .sum();
                out[i * t_all + t] = delta[i].mul_add(dot as f32, bias[i]);
            }
        }
    }
}

/// One query against one per-channel block: `q̃ = round(q·scale / δ)`
/// into `qi`, returning `(δ, q·zero)`.
pub(crate) fn quantize_query(q: &[f32], sc: &[f32], ze: &[f32], qi: &mut [i32]) -> (f32, f32) {
    let amax = q
        .iter()
        .zip(sc)
        .fold(0f32, |m, (&a, &s)| m.max((a * s).abs()));
    let delta = amax / 127.0;
    let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
    for ((o, &a), &s) in qi.iter_mut().zip(q).zip(sc) {
        *o = ((a * s) * inv).round_ties_even().clamp(-127.0, 127.0) as i32;
    }
    (delta, dot(q, ze))
}

/// Tokens per tile of [`weighted_sum_i8`]: each tile and group gets its
/// own int8 weight step.
pub(crate) const I8_TILE: usize = 16;

/// The int8-weight arithmetic of [`super::weighted_sum_i8`], in plain
/// Rust: the specification the VNNI kernel follows exactly (its integer
/// sums are equal; its `f32` operations are the same, in the same order).
///
/// Per query, per tile of [`I8_TILE`] tokens and per group `g`: the
/// weights `w_t = p_t·scale_tg` get one step `δ = max_t |w_t| / 127` and
/// are rounded to `w̃_t = round(w_t/δ)` (ties to even); channel `c` of the
/// group adds `δ·Σ_t w̃_t·code_tc` (exact `i32` sum), and the zero points
/// add `Σ_t p_t·zero_tg` in `f32` as in the exact kernels.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn weighted_sum_i8(head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
    let l = head.layout();
    assert_eq!(l.scheme().axis(), Axis::PerToken);
    let hd = l.head_dim();
    let rb = l.row_bytes();
    let bits = l.scheme().bits();
    let t_all = head.tokens();
    let nq = out.len() / hd;
    let (gpr, cpg) = (l.groups_per_row(), l.channels_per_group());
    let mut codes = vec![0u8; I8_TILE * hd];
    let (mut sc, mut ze) = (vec![0f32; I8_TILE * gpr], vec![0f32; I8_TILE * gpr]);
    let mut acc = vec![0f32; hd];
    let mut zs = vec![0f32; gpr];
    let mut qw = [0i32; I8_TILE];
    for i in 0..nq {
        let pi = &p[i * t_all..(i + 1) * t_all];
        acc.fill(0.0);
        zs.fill(0.0);
        for t0 in (0..t_all).step_by(I8_TILE) {
            let n = I8_TILE.min(t_all - t0);
            for tt in 0..n {
                let t = t0 + tt;
                pack::unpack(
                    &head.codes[t * rb..(t + 1) * rb],
                    bits,
                    &mut codes[tt * hd..(tt + 1) * hd],
                );
                head.params_into(t, &mut sc[tt * gpr..], &mut ze[tt * gpr..]);
                for (g, z) in zs.iter_mut().enumerate() {
                    *z = ze[tt * gpr + g].mul_add(pi[t], *z);
                }
            }
            for g in 0..gpr {
                let w = |tt: usize| pi[t0 + tt] * sc[tt * gpr + g];
                let amax = (0..n).fold(0f32, |m, tt| m.max(w(tt).abs()));
                let delta = amax / 127.0;
                let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
                for (tt, q) in qw.iter_mut().enumerate().take(n) {
                    *q = (w(tt) * inv).round_ties_even().clamp(-127.0, 127.0) as i32;
                }
                for c in g * cpg..(g + 1) * cpg {
                    let sum: i32 = (0..n).map(|tt| qw[tt] * codes[tt * hd + c] as i32).sum();
                    acc[c] = delta.mul_add(sum as f32, acc[c]);
                }
            }
        }
        for (c, o) in out[i * hd..(i + 1) * hd].iter_mut().enumerate() {
            *o += acc[c] + zs[c / cpg];
        }
    }
}
