//! Values (or keys) in a fitted transform basis at per-channel widths: a
//! study of what a transform-coded format would buy over rotated Lloyd-Max
//! values and per-channel keys at the same bits, run as a
//! quantize-dequantize [`RoundTrip`] (no such format exists in `kvq`). On
//! SmolLM2 it buys nothing: both lose by far (`docs/RESULTS.md`, "Values
//! and keys in a fitted basis").
//!
//! A head's value error reaches the model through its slice of `o_proj`:
//! the output error of `Δv` is `W·Δv`, whose energy is `Δvᵀ·M·Δv` with
//! `M = Wᵀ·W` (summed over the query heads that share the KV head, and
//! with a post-attention norm's weights folded in). With `A = M^{1/2}`,
//! `z = A·v` turns that into a plain squared error; the eigenvectors `Q` of
//! `z`'s covariance then decorrelate it, and `y = Qᵀ·A·v` has channels of
//! variance `λ_i`, each costing `λ_i·ε(b_i)` of output error at `b_i` bits
//! (`ε` the Lloyd-Max error of a unit Gaussian). Bits go greedily where
//! they cut the most error (reverse water-filling), so weak directions get
//! none and are replaced by their mean. Without the weighting (`M = I`)
//! the transform is the values' principal axes. Keys take the same code
//! after RoPE with `M = E[q·qᵀ]` over the query heads that read them (the
//! score error's energy).
//!
//! The sorted variances make the widths non-increasing along `y`: a row is
//! a few runs of one width each. Each row is coded as `y_i − μ_i` over
//! `σ_i = √λ_i`, times one per-token `f16` scale (the RMS of the coded
//! channels), on Lloyd-Max levels of its channel's width; decode applies
//! the inverse transform. Attention can stay in `y` (the weights sum the
//! coded rows) and apply the inverse once per query. The transform, means,
//! scales and widths are per layer and KV head, fitted on calibration
//! captures; they are constants of the model, not stored per token.

use crate::capture::Capture;
use crate::model::{Model, RoundTrip};
use half::f16;
use std::sync::OnceLock;

/// Widest channel (the width fit's).
pub const MAX_BITS: u8 = crate::alloc::MAX_BITS;

/// Which tensor a [`KltCode`] codes, and the error it weighs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KltTensor {
    /// Values at `v_proj`, their error weighed through `o_proj`.
    Values,
    /// Keys after RoPE (what a post-RoPE cache stores), their error
    /// weighed by the queries' second moment `E[q·qᵀ]` (the score error's
    /// energy; a constant shift of every key moves no softmax).
    Keys,
}

/// How a [`KltCode`] is fitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KltOptions {
    /// The tensor coded.
    pub tensor: KltTensor,
    /// Mean code bits per value (the per-token scale comes on top).
    pub code_bits: f64,
    /// Weight the error where it reaches the model (`o_proj` for values,
    /// the queries for keys), or leave it plain (principal axes).
    pub weighted: bool,
    /// One budget per layer across its KV heads, or per head.
    pub per_layer: bool,
    /// Store a per-token `f16` scale, or code against the fitted
    /// variances alone.
    pub token_scale: bool,
    /// Positions kept exact (and left out of the fit).
    pub sinks: usize,
}

impl Default for KltOptions {
    fn default() -> Self {
        KltOptions {
            tensor: KltTensor::Values,
            code_bits: 3.0,
            weighted: true,
            per_layer: false,
            token_scale: true,
            sinks: 0,
        }
    }
}

/// One KV head's fitted code.
#[derive(Debug, Clone)]
struct HeadCode {
    /// `y = fwd·v`, row-major `hd×hd`.
    fwd: Vec<f32>,
    /// `v = inv·y`, row-major `hd×hd`.
    inv: Vec<f32>,
    /// Mean of `y` over the calibration rows.
    mean: Vec<f32>,
    /// Standard deviation of each `y` channel.
    sigma: Vec<f32>,
    /// Code bits of each `y` channel (non-increasing).
    bits: Vec<u8>,
}

/// Values or keys coded in a fitted basis at per-channel widths (see the
/// [module docs](self)).
#[derive(Debug, Clone)]
pub struct KltCode {
    n_layers: usize,
    n_kv: usize,
    hd: usize,
    /// `[layer·n_kv + head]`.
    heads: Vec<HeadCode>,
    token_scale: bool,
    sinks: usize,
}

/// Lloyd-Max levels of a unit Gaussian at 1–[`MAX_BITS`] bits (index
/// `b − 1`), with their mean squared errors.
fn gauss_tables() -> &'static [(Vec<f32>, f64)] {
    static TABLES: OnceLock<Vec<(Vec<f32>, f64)>> = OnceLock::new();
    TABLES.get_or_init(|| {
        (1..=MAX_BITS)
            .map(|b| {
                let n = 1usize << b;
                // Start from the high-rate optimum (density^(1/3): N(0, 3)),
                // then Lloyd steps on the exact cell integrals.
                let mut lv: Vec<f64> = (0..n)
                    .map(|j| {
                        3f64.sqrt() * crate::trellis::normal_quantile((j as f64 + 0.5) / n as f64)
                    })
                    .collect();
                let edges = |lv: &[f64]| -> Vec<f64> {
                    std::iter::once(f64::NEG_INFINITY)
                        .chain(lv.windows(2).map(|w| (w[0] + w[1]) / 2.0))
                        .chain(std::iter::once(f64::INFINITY))
                        .collect()
                };
                for _ in 0..5000 {
                    let e = edges(&lv);
                    for (k, l) in lv.iter_mut().enumerate() {
                        let (a, z) = (e[k], e[k + 1]);
                        let mass = normal_cdf(z) - normal_cdf(a);
                        if mass > 0.0 {
                            *l = (normal_pdf(a) - normal_pdf(z)) / mass;
                        }
                    }
                }
                // E[(x − l)²] over each cell: ∫x²φ − 2l∫xφ + l²∫φ.
                let e = edges(&lv);
                let xphi = |x: f64| {
                    if x.is_finite() {
                        x * normal_pdf(x)
                    } else {
                        0.0
                    }
                };
                let err = lv
                    .iter()
                    .enumerate()
                    .map(|(k, &l)| {
                        let (a, z) = (e[k], e[k + 1]);
                        let mass = normal_cdf(z) - normal_cdf(a);
                        let m1 = normal_pdf(a) - normal_pdf(z);
                        let m2 = mass + xphi(a) - xphi(z);
                        m2 - 2.0 * l * m1 + l * l * mass
                    })
                    .sum();
                (lv.iter().map(|&v| v as f32).collect(), err)
            })
            .collect()
    })
}

/// The standard normal density.
fn normal_pdf(x: f64) -> f64 {
    if x.is_finite() {
        (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
    } else {
        0.0
    }
}

/// The standard normal distribution function, through `erfc` (Numerical
/// Recipes' Chebyshev fit, relative error below 1.2e-7).
fn normal_cdf(x: f64) -> f64 {
    let z = (-x / std::f64::consts::SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    let erfc = if -x >= 0.0 { erfc } else { 2.0 - erfc };
    0.5 * erfc
}

/// Relative error of a unit Gaussian at `b` bits (1 at 0 bits: the mean).
fn gauss_error(b: u8) -> f64 {
    if b == 0 {
        1.0
    } else {
        gauss_tables()[usize::from(b) - 1].1
    }
}

/// The nearest of the sorted `levels` to `x`.
fn nearest(levels: &[f32], x: f32) -> f32 {
    let i = levels.partition_point(|&l| l < x);
    match (i.checked_sub(1).map(|j| levels[j]), levels.get(i)) {
        (Some(a), Some(&b)) => {
            if x - a <= b - x {
                a
            } else {
                b
            }
        }
        (Some(a), None) => a,
        (None, Some(&b)) => b,
        (None, None) => 0.0,
    }
}

/// Eigenvalues (descending) and eigenvectors (columns of the row-major
/// `n×n` result) of the symmetric `a`, by cyclic Jacobi rotations.
fn sym_eig(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0f64; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let norm: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    for _sweep in 0..60 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j] * a[i * n + j])
            .sum::<f64>()
            .sqrt();
        if off <= 1e-13 * norm.max(f64::MIN_POSITIVE) {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() <= 1e-300 {
                    continue;
                }
                let (app, aqq) = (a[p * n + p], a[q * n + q]);
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| a[j * n + j].total_cmp(&a[i * n + i]));
    let vals = order.iter().map(|&i| a[i * n + i]).collect();
    let mut vecs = vec![0f64; n * n];
    for (c, &i) in order.iter().enumerate() {
        for r in 0..n {
            vecs[r * n + c] = v[r * n + i];
        }
    }
    (vals, vecs)
}

/// `a·b` for row-major `n×n` matrices.
fn matmul(a: &[f64], b: &[f64], n: usize) -> Vec<f64> {
    let mut c = vec![0f64; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            if aik == 0.0 {
                continue;
            }
            for j in 0..n {
                c[i * n + j] += aik * b[k * n + j];
            }
        }
    }
    c
}

fn transpose(a: &[f64], n: usize) -> Vec<f64> {
    let mut t = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            t[j * n + i] = a[i * n + j];
        }
    }
    t
}

/// `U·diag(f(d))·Uᵀ` for the eigen pairs `(d, U)`.
fn eig_fn(d: &[f64], u: &[f64], n: usize, f: impl Fn(f64) -> f64) -> Vec<f64> {
    let mut ud = u.to_vec();
    for r in 0..n {
        for c in 0..n {
            ud[r * n + c] *= f(d[c]);
        }
    }
    matmul(&ud, &transpose(u, n), n)
}

/// Greedy widths (reverse water-filling): each step gives one more bit to
/// the channel whose error falls most (the first on ties); `vars` are the
/// channels' variances, `budget` their total bits. The Gaussian errors fall
/// convexly, so the width fit's greedy ([`crate::alloc`]) takes one bit a
/// step here.
fn water_fill(vars: &[f64], budget: usize) -> Vec<u8> {
    let units: Vec<Vec<usize>> = (0..vars.len()).map(|c| vec![c]).collect();
    let eps: [f64; MAX_BITS as usize + 1] = std::array::from_fn(|b| gauss_error(b as u8));
    crate::alloc::greedy(&units, vars, &vec![eps; vars.len()], budget)
}

impl KltCode {
    /// Fit every layer's and KV head's transform and widths on the values
    /// or post-RoPE keys of `caps` (`opts.tensor`; the first `opts.sinks`
    /// rows of each left out), weighted by `model`'s `o_proj` or by the
    /// captured queries when `opts.weighted`.
    ///
    /// # Errors
    /// A message for no captures, captures that do not match the model or
    /// whose tensors disagree on their rows, a budget outside
    /// 0–[`MAX_BITS`], too few rows to fit, non-finite calibration data,
    /// or error weights without energy (e.g. all-zero queries).
    pub fn fit(model: &Model, caps: &[Capture], opts: KltOptions) -> Result<Self, String> {
        let cfg = &model.cfg;
        let (n_kv, hd, n_q) = (cfg.n_kv_heads, cfg.head_dim, cfg.n_heads);
        if caps.is_empty()
            || caps.iter().any(|c| {
                c.n_kv_heads != n_kv
                    || c.head_dim != hd
                    || c.n_q_heads != n_q
                    || c.layers.len() != cfg.n_layers
            })
        {
            return Err("transform: captures do not match the model".into());
        }
        for c in caps {
            c.check().map_err(|e| format!("transform: {e}"))?;
        }
        if !(0.0..=f64::from(MAX_BITS)).contains(&opts.code_bits) {
            return Err(format!("transform: budget {} out of range", opts.code_bits));
        }
        let group = n_q / n_kv;
        let width = n_kv * hd;
        let mut heads = Vec::with_capacity(cfg.n_layers * n_kv);
        for l in 0..cfg.n_layers {
            let lw = &model.layers[l];
            // The layer's heads, their widths set once the budget is spent.
            let mut layer: Vec<HeadCode> = Vec::with_capacity(n_kv);
            for h in 0..n_kv {
                // Mean and covariance of the head's values.
                let mut mean = vec![0f64; hd];
                let mut cov = vec![0f64; hd * hd];
                let mut n = 0usize;
                for cap in caps {
                    let rows = match opts.tensor {
                        KltTensor::Values => &cap.layers[l].v,
                        KltTensor::Keys => &cap.layers[l].k,
                    };
                    for row in rows.chunks_exact(width).skip(opts.sinks) {
                        let x = &row[h * hd..(h + 1) * hd];
                        for i in 0..hd {
                            mean[i] += f64::from(x[i]);
                            for j in 0..hd {
                                cov[i * hd + j] += f64::from(x[i]) * f64::from(x[j]);
                            }
                        }
                        n += 1;
                    }
                }
                if n < 2 * hd {
                    return Err(format!("transform: {n} calibration rows for head_dim {hd}"));
                }
                let nf = n as f64;
                mean.iter_mut().for_each(|m| *m /= nf);
                for i in 0..hd {
                    for j in 0..hd {
                        cov[i * hd + j] = cov[i * hd + j] / nf - mean[i] * mean[j];
                    }
                }
                // The output metric M = Σ Wᵀ·diag(γ²)·W over the head's
                // query heads. Their cross terms are left out: each query
                // head weighs the value errors with its own attention, so
                // their errors in the output are taken as uncorrelated.
                let mut m = vec![0f64; hd * hd];
                if opts.weighted && opts.tensor == KltTensor::Keys {
                    // E[q·qᵀ] of the query heads sharing this KV head.
                    for cap in caps {
                        for row in cap.layers[l].q.chunks_exact(n_q * hd).skip(opts.sinks) {
                            for qh in h * group..(h + 1) * group {
                                let q = &row[qh * hd..(qh + 1) * hd];
                                for i in 0..hd {
                                    let qi = f64::from(q[i]);
                                    for j in 0..hd {
                                        m[i * hd + j] += qi * f64::from(q[j]);
                                    }
                                }
                            }
                        }
                    }
                } else if opts.weighted {
                    let gamma = lw.post_attn_norm.as_deref();
                    for qh in h * group..(h + 1) * group {
                        for (r, wrow) in lw.wo.outer_iter().enumerate() {
                            let g2 = gamma.map_or(1.0, |g| f64::from(g[r]).powi(2));
                            let w = &wrow.as_slice().ok_or("o_proj not contiguous")?
                                [qh * hd..(qh + 1) * hd];
                            for i in 0..hd {
                                let wi = f64::from(w[i]) * g2;
                                for j in 0..hd {
                                    m[i * hd + j] += wi * f64::from(w[j]);
                                }
                            }
                        }
                    }
                } else {
                    for i in 0..hd {
                        m[i * hd + i] = 1.0;
                    }
                }
                if !(mean.iter().chain(&cov).chain(&m)).all(|x| x.is_finite()) {
                    return Err(format!(
                        "transform: layer {l} head {h}: non-finite calibration data"
                    ));
                }
                let (d, u) = sym_eig(m, hd);
                if !(d[0] > 0.0 && d[0].is_finite()) {
                    return Err(format!(
                        "transform: layer {l} head {h}: the error weights have no energy"
                    ));
                }
                // Directions the weights barely see are kept, not inverted
                // to infinity.
                let floor = d[0] * 1e-8;
                let a = eig_fn(&d, &u, hd, |x| x.max(floor).sqrt());
                let a_inv = eig_fn(&d, &u, hd, |x| 1.0 / x.max(floor).sqrt());
                let cz = matmul(&matmul(&a, &cov, hd), &a, hd);
                let (lam, q) = sym_eig(cz, hd);
                let qt = transpose(&q, hd);
                let fwd = matmul(&qt, &a, hd);
                let inv = matmul(&a_inv, &q, hd);
                let ymean: Vec<f64> = (0..hd)
                    .map(|i| (0..hd).map(|j| fwd[i * hd + j] * mean[j]).sum())
                    .collect();
                let lam: Vec<f64> = lam.iter().map(|&x| x.max(0.0)).collect();
                layer.push(HeadCode {
                    fwd: fwd.iter().map(|&x| x as f32).collect(),
                    inv: inv.iter().map(|&x| x as f32).collect(),
                    mean: ymean.iter().map(|&x| x as f32).collect(),
                    sigma: lam.iter().map(|&x| x.sqrt() as f32).collect(),
                    bits: Vec::new(),
                });
            }
            // Widths: one budget per head, or the layer's heads pooled.
            // Each scope's budget, rounded once.
            let budget = |channels: usize| (opts.code_bits * channels as f64).round() as usize;
            let var = |c: &HeadCode| -> Vec<f64> {
                c.sigma.iter().map(|&s| f64::from(s).powi(2)).collect()
            };
            if opts.per_layer {
                let all: Vec<f64> = layer.iter().flat_map(var).collect();
                let b = water_fill(&all, budget(width));
                for (c, w) in layer.iter_mut().zip(b.chunks(hd)) {
                    c.bits = w.to_vec();
                }
            } else {
                for c in &mut layer {
                    c.bits = water_fill(&var(c), budget(hd));
                }
            }
            heads.extend(layer);
        }
        Ok(KltCode {
            n_layers: cfg.n_layers,
            n_kv,
            hd,
            heads,
            token_scale: opts.token_scale,
            sinks: opts.sinks,
        })
    }

    /// Mean bits per stored value: the codes plus the per-token scale.
    pub fn effective_bits(&self) -> f64 {
        let codes: usize = self
            .heads
            .iter()
            .map(|h| h.bits.iter().map(|&b| usize::from(b)).sum::<usize>())
            .sum();
        let scale = if self.token_scale { 16 } else { 0 };
        (codes + scale * self.heads.len()) as f64 / (self.heads.len() * self.hd) as f64
    }

    /// Channels of each width 0..=[`MAX_BITS`], over every head.
    pub fn histogram(&self) -> Vec<usize> {
        let mut h = vec![0; usize::from(MAX_BITS) + 1];
        for head in &self.heads {
            for &b in &head.bits {
                h[usize::from(b)] += 1;
            }
        }
        h
    }

    /// The transform coding gain in bits per value, averaged over heads:
    /// half the log2 of the ratio of arithmetic to geometric mean of the
    /// `y` variances (what ideal widths save against one width).
    pub fn coding_gain(&self) -> f64 {
        let per: f64 = self
            .heads
            .iter()
            .map(|h| {
                let v: Vec<f64> = h
                    .sigma
                    .iter()
                    .map(|&s| (f64::from(s) * f64::from(s)).max(1e-30))
                    .collect();
                let am = v.iter().sum::<f64>() / v.len() as f64;
                let gm = (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp();
                0.5 * (am / gm).log2()
            })
            .sum();
        per / self.heads.len() as f64
    }

    /// Code one head's row `x` in place with `code`'s transform.
    fn code_row(&self, code: &HeadCode, x: &mut [f32], y: &mut [f32]) {
        let hd = self.hd;
        for ((yi, row), (&m, &sd)) in y
            .iter_mut()
            .zip(code.fwd.chunks_exact(hd))
            .zip(code.mean.iter().zip(&code.sigma))
        {
            let dot: f32 = row.iter().zip(x.iter()).map(|(a, b)| a * b).sum();
            *yi = if sd > 0.0 { (dot - m) / sd } else { 0.0 };
        }
        let coded = code.bits.iter().filter(|&&b| b > 0).count();
        let scale = if self.token_scale && coded > 0 {
            let ss: f32 = y
                .iter()
                .zip(&code.bits)
                .filter(|(_, &b)| b > 0)
                .map(|(v, _)| v * v)
                .sum();
            // Saturated at the largest f16, which a stored scale holds.
            let s = f16::from_f32((ss / coded as f32).sqrt().min(f16::MAX.to_f32())).to_f32();
            if s > 0.0 {
                s
            } else {
                1.0
            }
        } else {
            1.0
        };
        let tables = gauss_tables();
        for ((yi, &b), (&m, &sd)) in y
            .iter_mut()
            .zip(&code.bits)
            .zip(code.mean.iter().zip(&code.sigma))
        {
            let q = if b == 0 {
                0.0
            } else {
                scale * nearest(&tables[usize::from(b) - 1].0, *yi / scale)
            };
            *yi = m + sd * q;
        }
        for (out, row) in x.iter_mut().zip(code.inv.chunks_exact(hd)) {
            *out = row.iter().zip(y.iter()).map(|(a, b)| a * b).sum();
        }
    }
}

impl RoundTrip for KltCode {
    fn round_trip(
        &self,
        layer: usize,
        pos0: usize,
        x: &mut [f32],
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), String> {
        let width = crate::model::rows_width("transform", x, n_tokens, n_kv_heads, head_dim)?;
        if n_kv_heads != self.n_kv || head_dim != self.hd || layer >= self.n_layers {
            return Err(format!(
                "transform: layer {layer} of {n_kv_heads}×{head_dim} is not the fitted shape"
            ));
        }
        if x.iter().any(|v| !v.is_finite()) {
            return Err("non-finite values".into());
        }
        let skip = self.sinks.saturating_sub(pos0).min(n_tokens);
        let rows = &mut x[skip * width..];
        let codes = &self.heads[layer * self.n_kv..(layer + 1) * self.n_kv];
        crate::model::on_two_threads(rows, width, |part| {
            let mut y = vec![0f32; head_dim];
            for row in part.chunks_exact_mut(width) {
                for (h, head) in row.chunks_exact_mut(head_dim).enumerate() {
                    self.code_row(&codes[h], head, &mut y);
                }
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaussian_tables_match_lloyd_max() {
        // Max (1960): 1 bit 0.3634, 2 bits 0.1175, 3 bits 0.03454.
        for (b, want) in [(1u8, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)] {
            let e = gauss_error(b);
            assert!(
                (e - want).abs() < 0.002 * want.max(0.05),
                "{b} bits: {e} vs {want}"
            );
        }
        assert!(gauss_error(8) < gauss_error(7) && gauss_error(7) < 1e-3);
        // kvq's Lloyd-Max tables (Max's, to four digits).
        for b in 2..=4u8 {
            let ours = &gauss_tables()[usize::from(b) - 1].0;
            let kvq = kvq::Levels::Gauss.table(b).unwrap();
            for (x, y) in ours.iter().zip(kvq) {
                assert!((x - y).abs() < 2e-4, "{b} bits: {ours:?} against {kvq:?}");
            }
        }
        // Each bit buys less than the one before (the water-filling's
        // greedy relies on it).
        let drops: Vec<f64> = (0..MAX_BITS)
            .map(|b| gauss_error(b) - gauss_error(b + 1))
            .collect();
        assert!(drops.windows(2).all(|w| w[0] > w[1]), "{drops:?}");
    }

    #[test]
    fn eigen_decomposition_reconstructs() {
        let n = 9;
        let mut s = 7u64;
        let mut r = vec![0f64; n * n];
        for x in r.iter_mut() {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *x = ((s >> 11) as f64 / (1u64 << 53) as f64) - 0.5;
        }
        let a = matmul(&r, &transpose(&r, n), n);
        let (d, u) = sym_eig(a.clone(), n);
        assert!(d.windows(2).all(|w| w[0] >= w[1]));
        let back = eig_fn(&d, &u, n, |x| x);
        let err: f64 = a
            .iter()
            .zip(&back)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-10, "{err}");
        let ident = matmul(&transpose(&u, n), &u, n);
        for i in 0..n {
            for j in 0..n {
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((ident[i * n + j] - want).abs() < 1e-10);
            }
        }
    }

    #[test]
    fn water_filling_favours_wide_channels() {
        let vars = [16.0, 4.0, 1.0, 0.01];
        let b = water_fill(&vars, 8);
        assert_eq!(b.iter().map(|&x| usize::from(x)).sum::<usize>(), 8);
        assert!(b.windows(2).all(|w| w[0] >= w[1]), "{b:?}");
        assert_eq!(b[3], 0, "{b:?}");
        // Ties go to the first channel.
        assert_eq!(water_fill(&[1.0, 1.0, 1.0], 4), vec![2, 1, 1]);
    }
}
