//! The oracle: dequantize, then plain `f64` math.
//!
//! Obviously correct and slow; it allocates a dequantized copy, which the
//! real kernels never do. Public so that integration tests (and engine
//! authors checking their own kernels) can compare against it.

use crate::store::PackedHead;

/// `out[i·tokens + t] = q_i · k̂_t` for the queries `q = [n_q, head_dim]`.
///
/// # Panics
/// If `q.len()` is not a multiple of `head_dim` or `out.len() != n_q·tokens`.
pub fn scores(head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) {
    let hd = head.layout().head_dim();
    let t = head.tokens();
    assert_eq!(q.len() % hd, 0);
    let nq = q.len() / hd;
    assert_eq!(out.len(), nq * t);
    let mut k = vec![0f32; t * hd];
    head.dequantize_into(&mut k);
    for i in 0..nq {
        let qi = &q[i * hd..(i + 1) * hd];
        for j in 0..t {
            let kj = &k[j * hd..(j + 1) * hd];
            out[i * t + j] = qi
                .iter()
                .zip(kj)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32;
        }
    }
}

/// `out_i += Σ_t p[i·tokens + t] · v̂_t` for `p = [n_q, tokens]`,
/// `out = [n_q, head_dim]`.
///
/// # Panics
/// If `p.len()` is not a multiple of `tokens` or `out.len() != n_q·head_dim`.
pub fn weighted_sum(head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) {
    let hd = head.layout().head_dim();
    let t = head.tokens();
    let nq = p.len().checked_div(t).unwrap_or(out.len() / hd);
    assert_eq!(p.len(), nq * t);
    assert_eq!(out.len(), nq * hd);
    let mut v = vec![0f32; t * hd];
    head.dequantize_into(&mut v);
    for i in 0..nq {
        for c in 0..hd {
            let s: f64 = (0..t)
                .map(|j| p[i * t + j] as f64 * v[j * hd + c] as f64)
                .sum();
            out[i * hd + c] = (out[i * hd + c] as f64 + s) as f32;
        }
    }
}
