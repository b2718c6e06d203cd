//! Attention over a layer's regions: partial softmax states and their merge, the thread split, the dense reference.

use super::*;

/// Per-row softmax state of a range of positions: running max, sum of
/// `exp(l − max)`, and the unnormalized weighted sum of values.
#[derive(Debug, Clone)]
pub(super) struct Partial {
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
    pub(super) out: Vec<f32>,
}

impl Partial {
    pub(super) fn new(rows: usize, hd: usize) -> Self {
        Partial {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
            out: vec![0.0; rows * hd],
        }
    }
}

impl Partial {
    /// `rows` rows of `hd` (contents unspecified: `partial` writes them all).
    pub(super) fn resize(&mut self, rows: usize, hd: usize) {
        self.max.resize(rows, f32::NEG_INFINITY);
        self.sum.resize(rows, 0.0);
        self.out.resize(rows * hd, 0.0);
    }

    /// Fold in the state of a further, disjoint range of positions (the
    /// online softmax): both rescaled to the larger running max.
    pub(super) fn absorb(&mut self, other: &Partial, hd: usize) {
        for i in 0..self.max.len() {
            let (m1, m2) = (self.max[i], other.max[i]);
            if m2 == f32::NEG_INFINITY {
                continue;
            }
            let o = &mut self.out[i * hd..(i + 1) * hd];
            let src = &other.out[i * hd..(i + 1) * hd];
            if m1 == f32::NEG_INFINITY {
                self.max[i] = m2;
                self.sum[i] = other.sum[i];
                o.copy_from_slice(src);
                continue;
            }
            let m = m1.max(m2);
            let (w1, w2) = ((m1 - m).exp(), (m2 - m).exp());
            self.max[i] = m;
            self.sum[i] = self.sum[i] * w1 + other.sum[i] * w2;
            if w1 != 1.0 {
                o.iter_mut().for_each(|x| *x *= w1);
            }
            axpy(w2, src, o);
        }
    }
}

/// Scores (rows × key positions) a prefill block computes per key chunk:
/// 256 KiB, well inside a core's L2 beside the tiles and the outputs.
pub(super) const SCORE_CHUNK_FLOATS: usize = 64 * 1024;

/// Combine partials over disjoint position ranges into normalized outputs.
pub(super) fn merge(parts: &[Partial], rows: usize, hd: usize, dst: &mut [f32]) {
    for i in 0..rows {
        let m = parts
            .iter()
            .map(|p| p.max[i])
            .fold(f32::NEG_INFINITY, f32::max);
        let o = &mut dst[i * hd..(i + 1) * hd];
        o.fill(0.0);
        let mut total = 0f32;
        for p in parts {
            if p.max[i] == f32::NEG_INFINITY {
                continue;
            }
            let w = (p.max[i] - m).exp();
            total += w * p.sum[i];
            axpy(w, &p.out[i * hd..(i + 1) * hd], o);
        }
        let inv = 1.0 / total;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

/// What one thread reuses from head to head in `head_attention`: the
/// score scratch and the running and per-chunk softmax states.
#[derive(Debug)]
pub(super) struct HeadScratch {
    pub(super) attn: AttnScratch,
    pub(super) acc: Partial,
    pub(super) part: Partial,
}

impl Default for HeadScratch {
    fn default() -> Self {
        HeadScratch {
            attn: AttnScratch::default(),
            acc: Partial::new(0, 0),
            part: Partial::new(0, 0),
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct AttnScratch {
    pub(super) scores: Vec<f32>,
    pub(super) tmp: Vec<f32>,
}

/// `n` floats of `v` to be overwritten: grown when short, not zeroed
/// again when reused for the next head or query block.
pub(super) fn uninit_len(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

pub(super) fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    // A product that overflows means no common boundary short of the
    // end: `usize::MAX` (the split then keeps everything in one chunk).
    (a / gcd(a, b)).saturating_mul(b)
}

/// A run of positions of one tensor and where they are stored.
pub(super) struct Section<'a> {
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) data: SectionData<'a>,
}

pub(super) enum SectionData<'a> {
    /// Full-precision rows (stride = tensor width), first row = `start`.
    Dense(&'a [f32]),
    /// Packed tokens of one head, first token = `start`.
    Packed(PackedHead<'a>),
}

/// Work (`len · positions · kv heads`) below which `attend` stays on one thread.
pub(super) const PARALLEL_MIN_WORK: usize = 16 * 1024;

/// `work(i, item)` for every item, each on its own scoped thread while the
/// calling thread waits. (Running the first item on the calling thread
/// saves a spawn, tens of µs, but a new thread starts on its parent's core
/// and, while the parent keeps computing, can wait there for the scheduler
/// to move it: in a third or more of the paired bench's rounds the two
/// halves of a decode step then ran one after the other.)
pub(super) fn fan_out<T: Send>(items: impl IntoIterator<Item = T>, work: impl Fn(usize, T) + Sync) {
    let mut items = items.into_iter().enumerate().peekable();
    let Some((i0, first)) = items.next() else {
        return;
    };
    if items.peek().is_none() {
        return work(i0, first);
    }
    std::thread::scope(|sc| {
        let work = &work;
        sc.spawn(move || work(i0, first));
        for (i, item) in items {
            sc.spawn(move || work(i, item));
        }
    });
}

/// Query rows (positions × query heads) scored at once in `attend_causal`.
pub(super) const QUERY_BLOCK: usize = 64;

/// Tokens `t0..t1` of a packed head; per-channel, `t0` must start a block.
pub(super) fn sub_view(view: PackedHead<'_>, t0: usize, t1: usize) -> PackedHead<'_> {
    let l = view.layout;
    let g = l.block_tokens();
    assert!(
        t0.is_multiple_of(g) && t0 <= t1 && t1 <= view.tokens,
        "sub_view {t0}..{t1} of {}",
        view.tokens
    );
    let pb = |t: usize| {
        if l.shared_params() {
            l.param_bytes(t)
        } else {
            l.head_param_bytes(t)
        }
    };
    PackedHead {
        layout: l,
        tokens: t1 - t0,
        codes: &view.codes[l.head_code_bytes(t0)..l.head_code_bytes(t1)],
        params: &view.params[pb(t0)..pb(t1)],
        outliers: &view.outliers[l.head_outlier_bytes(t0)..l.head_outlier_bytes(t1)],
    }
}

/// Plain dense attention of one position (f64 accumulation), the yardstick
/// the cache is tested against: `q` `[n_q_heads·head_dim]`, `k`/`v`
/// `[len, n_kv_heads·head_dim]`, returns `[n_q_heads·head_dim]`.
///
/// # Panics
/// If the lengths do not fit the shape or `n_q_heads` is not a multiple of
/// `n_kv_heads`.
pub fn dense_attention(
    q: &[f32],
    n_q_heads: usize,
    k: &[f32],
    v: &[f32],
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let w = n_kv_heads * head_dim;
    assert_eq!(q.len(), n_q_heads * head_dim);
    assert_eq!(k.len(), v.len());
    assert!(k.len().is_multiple_of(w) && n_q_heads.is_multiple_of(n_kv_heads));
    let len = k.len() / w;
    let r = n_q_heads / n_kv_heads;
    let mut out = vec![0f32; q.len()];
    for i in 0..n_q_heads {
        let h = i / r;
        let qi = &q[i * head_dim..(i + 1) * head_dim];
        let logits: Vec<f64> = (0..len)
            .map(|t| {
                let kt = &k[t * w + h * head_dim..t * w + (h + 1) * head_dim];
                qi.iter()
                    .zip(kt)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let s: f64 = e.iter().sum();
        for c in 0..head_dim {
            let acc: f64 = (0..len)
                .map(|t| e[t] * v[t * w + h * head_dim + c] as f64)
                .sum();
            out[i * head_dim + c] = (acc / s) as f32;
        }
    }
    out
}
