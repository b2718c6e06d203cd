//! The building blocks of the attention metrics, shared with the planner.
//! Everything is f64; products are register-blocked (results do not depend
//! on how rows are grouped: every cell is summed in the same order).

use super::*;

/// Rows of head `h` of a `[rows, n_heads, hd]` tensor, contiguous, as f64.
pub(crate) fn head_rows(x: &[f32], rows: usize, n_heads: usize, hd: usize, h: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(rows * hd);
    for r in 0..rows {
        let b = (r * n_heads + h) * hd;
        out.extend(x[b..b + hd].iter().map(|&v| v as f64));
    }
    out
}

/// The queries of the query heads that read KV head `kvh`, stacked: rows
/// `j·n + i` are query position `positions[i]` of the group's `j`-th head.
pub(crate) struct QueryGroup {
    pub(crate) q: Vec<f64>,
    pub(crate) vis: Vec<usize>,
    pub(crate) n: usize,
}

impl QueryGroup {
    pub(crate) fn new(cap: &LayerCapture, positions: &[usize], vis: &[usize], kvh: usize) -> Self {
        let s = cap.shape;
        let (hd, nqh, g) = (s.head_dim, s.n_q_heads, s.group());
        let mut q = Vec::with_capacity(g * positions.len() * hd);
        let mut v = Vec::with_capacity(g * positions.len());
        for j in 0..g {
            let head = kvh * g + j;
            for (&i, &n) in positions.iter().zip(vis) {
                let b = (i * nqh + head) * hd;
                q.extend(cap.q[b..b + hd].iter().map(|&x| x as f64));
                v.push(n);
            }
        }
        QueryGroup {
            q,
            vis: v,
            n: positions.len(),
        }
    }
    /// Rows of the group's `j`-th query head.
    pub(crate) fn rows(&self, j: usize) -> Range<usize> {
        j * self.n..(j + 1) * self.n
    }
}

/// `(Σ ‖o_i − ô_i‖², Σ ‖o_i‖²)` over `rows` of `[m, hd]` outputs.
pub(crate) fn rows_err(o: &[f64], oh: &[f64], rows: Range<usize>, hd: usize) -> (f64, f64) {
    let r = rows.start * hd..rows.end * hd;
    o[r.clone()]
        .iter()
        .zip(&oh[r])
        .fold((0.0, 0.0), |(n, d), (a, b)| {
            (n + (a - b) * (a - b), d + a * a)
        })
}

/// `√(num/den)`, 0 for 0/0, ∞ for x/0.
pub(crate) fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    }
}

/// `Σ x·y` in two lanes (even, odd index) then the odd tail: the order every
/// cell of [`matmul_nt`] uses.
#[inline]
pub(super) fn dot2(x: &[f64], y: &[f64]) -> f64 {
    let k = x.len().min(y.len());
    let kk = k & !1;
    let (mut a0, mut a1) = (0f64, 0f64);
    for (p, q) in x[..kk].chunks_exact(2).zip(y[..kk].chunks_exact(2)) {
        a0 += p[0] * q[0];
        a1 += p[1] * q[1];
    }
    let mut s = a0 + a1;
    if k > kk {
        s += x[kk] * y[kk];
    }
    s
}

/// `C = A·Bᵀ`: `c[i·n + j] = Σ_p a[i·k + p]·b[j·k + p]`.
pub(crate) fn matmul_nt(a: &[f64], b: &[f64], m: usize, n: usize, k: usize, c: &mut [f64]) {
    let kk = k & !1;
    let mut i = 0;
    while i + 4 <= m {
        let ar: [&[f64]; 4] = std::array::from_fn(|r| &a[(i + r) * k..(i + r + 1) * k]);
        let mut j = 0;
        while j + 2 <= n {
            let br: [&[f64]; 2] = std::array::from_fn(|s| &b[(j + s) * k..(j + s + 1) * k]);
            let mut acc = [[[0f64; 2]; 2]; 4];
            let mut p = 0;
            while p < kk {
                for r in 0..4 {
                    for s in 0..2 {
                        for l in 0..2 {
                            acc[r][s][l] += ar[r][p + l] * br[s][p + l];
                        }
                    }
                }
                p += 2;
            }
            for r in 0..4 {
                for s in 0..2 {
                    let mut v = acc[r][s][0] + acc[r][s][1];
                    if k > kk {
                        v += ar[r][kk] * br[s][kk];
                    }
                    c[(i + r) * n + j + s] = v;
                }
            }
            j += 2;
        }
        for jj in j..n {
            for r in 0..4 {
                c[(i + r) * n + jj] = dot2(ar[r], &b[jj * k..(jj + 1) * k]);
            }
        }
        i += 4;
    }
    for ii in i..m {
        for jj in 0..n {
            c[ii * n + jj] = dot2(&a[ii * k..(ii + 1) * k], &b[jj * k..(jj + 1) * k]);
        }
    }
}

/// `O = W·V`: `o[i·d + c] = Σ_t w[i·t_len + t]·v[t·d + c]`, summed over `t`
/// in order.
pub(crate) fn matmul_nn(w: &[f64], v: &[f64], m: usize, t_len: usize, d: usize) -> Vec<f64> {
    let mut o = vec![0f64; m * d];
    let mut i = 0;
    let cell = |o: &mut [f64], i: usize, c: usize| {
        let mut s = 0f64;
        for t in 0..t_len {
            s += w[i * t_len + t] * v[t * d + c];
        }
        o[i * d + c] = s;
    };
    while i + 4 <= m {
        let mut c = 0;
        while c + 4 <= d {
            let mut acc = [[0f64; 4]; 4];
            for t in 0..t_len {
                let vr = &v[t * d + c..t * d + c + 4];
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = w[(i + r) * t_len + t];
                    for l in 0..4 {
                        row[l] += x * vr[l];
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                o[(i + r) * d + c..(i + r) * d + c + 4].copy_from_slice(row);
            }
            c += 4;
        }
        for cc in c..d {
            for r in 0..4 {
                cell(&mut o, i + r, cc);
            }
        }
        i += 4;
    }
    for ii in i..m {
        for c in 0..d {
            cell(&mut o, ii, c);
        }
    }
    o
}

/// Reconstruction error sums of one head.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Recon {
    pub(crate) err2: f64,
    pub(crate) norm2: f64,
    pub(crate) n: usize,
}

impl Recon {
    pub(crate) fn of(x: &[f64], xh: &[f64]) -> Self {
        let (mut e, mut n) = (0f64, 0f64);
        for (&a, &b) in x.iter().zip(xh) {
            let d = a - b;
            e += d * d;
            n += a * a;
        }
        Recon {
            err2: e,
            norm2: n,
            n: x.len(),
        }
    }
    pub(crate) fn mse(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.err2 / self.n as f64
        }
    }
    pub(crate) fn rel(&self) -> f64 {
        ratio(self.err2, self.norm2)
    }
}

/// Scaled logits, log-probabilities and probabilities of `m` query rows
/// against `t` tokens, dense `[m, t]`; row `i` sees its first `vis[i]`
/// tokens (beyond them `p = 0`).
#[derive(Debug, Clone)]
pub(crate) struct Attention {
    pub(crate) t: usize,
    pub(crate) vis: Vec<usize>,
    pub(crate) z: Vec<f64>,
    pub(crate) logp: Vec<f64>,
    pub(crate) p: Vec<f64>,
}

impl Attention {
    /// `q [m, hd]` against `k [t, hd]`.
    pub(crate) fn new(
        q: &[f64],
        vis: &[usize],
        k: &[f64],
        t: usize,
        hd: usize,
        scale: f64,
    ) -> Self {
        let m = vis.len();
        let mut z = vec![0f64; m * t];
        matmul_nt(q, k, m, t, hd, &mut z);
        let mut logp = vec![0f64; m * t];
        let mut p = vec![0f64; m * t];
        for (i, &n) in vis.iter().enumerate() {
            let r = i * t..i * t + n;
            let zr = &mut z[r.clone()];
            let mut mx = f64::NEG_INFINITY;
            for s in zr.iter_mut() {
                *s *= scale;
                mx = mx.max(*s);
            }
            let pr = &mut p[r.clone()];
            let mut sum = 0f64;
            for (pt, &s) in pr.iter_mut().zip(zr.iter()) {
                *pt = (s - mx).exp();
                sum += *pt;
            }
            let (inv, lse) = (1.0 / sum, mx + sum.ln());
            for ((pt, lp), &s) in pr.iter_mut().zip(&mut logp[r]).zip(zr.iter()) {
                *pt *= inv;
                *lp = s - lse;
            }
        }
        Attention {
            t,
            vis: vis.to_vec(),
            z,
            logp,
            p,
        }
    }

    /// Visible cells of row `i`.
    pub(crate) fn row(&self, i: usize) -> Range<usize> {
        i * self.t..i * self.t + self.vis[i]
    }

    /// `o_i = Σ_t p_it·v_t`, `[m, hd]`.
    pub(crate) fn output(&self, v: &[f64], hd: usize) -> Vec<f64> {
        matmul_nn(&self.p, v, self.vis.len(), self.t, hd)
    }

    /// The top-`k` tokens of every row, sorted by index (ties in `p` go to
    /// the lower index).
    pub(crate) fn top_k(&self, k: usize) -> Vec<Vec<u32>> {
        let mut buf = Vec::new();
        (0..self.vis.len())
            .map(|i| top_k_row(&self.p[self.row(i)], k, &mut buf))
            .collect()
    }
}

/// Indices of the `k` largest `p` (ties to the lower index), sorted by
/// index. One pass with a small sorted buffer: `O(len·k)` worst case, about
/// one comparison per element in practice.
pub(super) fn top_k_row(p: &[f64], k: usize, buf: &mut Vec<(f64, u32)>) -> Vec<u32> {
    let k = k.min(p.len());
    buf.clear();
    if k == 0 {
        return Vec::new();
    }
    for (t, &x) in p.iter().enumerate() {
        // Later indices lose ties, so only a strictly larger value enters.
        if buf.len() == k {
            if x <= buf[k - 1].0 {
                continue;
            }
            buf.pop();
        }
        let at = buf.partition_point(|&(y, _)| y >= x);
        buf.insert(at, (x, t as u32));
    }
    let mut top: Vec<u32> = buf.iter().map(|&(_, t)| t).collect();
    top.sort_unstable();
    top
}

/// The key side of the errors: everything that depends on `p̂` only.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeyStats {
    pub(crate) logit_rms: f64,
    pub(crate) logit_max: f64,
    pub(crate) kl: f64,
    pub(crate) top_k_overlap: f64,
}

impl KeyStats {
    /// Over the query rows `rows`.
    pub(crate) fn of(
        exact: &Attention,
        exact_top: &[Vec<u32>],
        quant: &Attention,
        rows: Range<usize>,
        k: usize,
    ) -> Self {
        let (mut sq, mut mx, mut kl, mut ov) = (0f64, 0f64, 0f64, 0f64);
        let mut cells = 0usize;
        let mut buf = Vec::new();
        let n_q = rows.len();
        for i in rows {
            let r = exact.row(i);
            cells += r.len();
            let mut kl_i = 0f64;
            for t in r.clone() {
                let d = exact.z[t] - quant.z[t];
                sq += d * d;
                mx = mx.max(d.abs());
                kl_i += exact.p[t] * (exact.logp[t] - quant.logp[t]);
            }
            kl += kl_i.max(0.0);
            let top = top_k_row(&quant.p[r], k, &mut buf);
            let want = &exact_top[i];
            if !want.is_empty() {
                let common = top.iter().filter(|t| want.binary_search(t).is_ok()).count();
                ov += common as f64 / want.len() as f64;
            }
        }
        let per_q = |x: f64| if n_q > 0 { x / n_q as f64 } else { 0.0 };
        KeyStats {
            logit_rms: if cells > 0 {
                (sq / cells as f64).sqrt()
            } else {
                0.0
            },
            logit_max: mx,
            kl: per_q(kl),
            top_k_overlap: per_q(ov),
        }
    }
}

pub(crate) fn assemble(k: &Recon, v: &Recon, ks: &KeyStats, output_rel: f64) -> AttentionErrors {
    AttentionErrors {
        k_mse: k.mse(),
        k_rel: k.rel(),
        v_mse: v.mse(),
        v_rel: v.rel(),
        logit_rms: ks.logit_rms,
        logit_max: ks.logit_max,
        kl: ks.kl,
        output_rel,
        top_k_overlap: ks.top_k_overlap,
    }
}
