//! Prefill attention: `LayerCache::attend_causal` over a whole prompt
//! (every position attends to itself and everything before it), on
//! quantized caches, beside dense causal attention over f32 and f16 K/V in
//! the same run. Cases are called in interleaved rounds, as in
//! `benches/paired.rs`, so their ratios survive a drifting host.
//!
//! ```text
//! cargo bench --bench prefill                                # 512 and 4096 tokens
//! KVQ_PREFILL_CTX=16384 KVQ_PREFILL_ROUNDS=3 cargo bench --bench prefill
//! KVQ_PREFILL_NQ=4 cargo bench --bench prefill               # four query heads per KV head
//! cargo bench --bench prefill -- 4b-kivi32 iq4nl             # only cases whose name contains these
//! ```
//!
//! 8 KV heads of 128, two threads. Cases: `dense-f16` (always run: the
//! baseline), `dense-f32`, and caches through `attend_causal`: `cache
//! fp32` (nothing packed), `4b-kivi32`, `8b-kivi32`, `4b-H-pt32`
//! (Hadamard-rotated 4-bit per-token K/V), `4b-kivi32-prerope` (keys
//! stored before RoPE), `4b-iq4nl` (llama.cpp's grid for K and V) and
//! `4b-kivi32-o1` (1 % outliers in K and V). The dense baselines are
//! flash-style: query blocks of 64 positions, keys in chunks of 1024
//! (f32 ones copied to a line-aligned buffer), scored with the SIMD dense
//! kernels (`kernels::dense`, the ones the decode baseline uses), masked,
//! and folded into a running softmax per row before the chunk's values
//! are summed through the same kernels. Nothing is asserted; the numbers
//! are in `docs/`.

mod common;

use common::{data, scheme};
use half::f16;
use kvq::kernels::{self, dense};
use kvq::{Axis, CacheConfig, Codec, LayerCache};
use std::hint::black_box;
use std::time::Instant;

const N_KV: usize = 8;
const HD: usize = 128;
const THREADS: usize = 2;
const BLOCK: usize = 64;

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

/// Dense K/V of one layer, head-major (`[head][token][hd]`).
enum Dense {
    F32 { k: Vec<Vec<f32>>, v: Vec<Vec<f32>> },
    F16 { k: Vec<Vec<f16>>, v: Vec<Vec<f16>> },
}

fn head_major<T: Copy>(x: &[f32], ctx: usize, conv: impl Fn(f32) -> T) -> Vec<Vec<T>> {
    (0..N_KV)
        .map(|h| {
            (0..ctx)
                .flat_map(|t| x[t * N_KV * HD + h * HD..][..HD].iter().map(|&v| conv(v)))
                .collect()
        })
        .collect()
}

impl Dense {
    /// Causal attention of all `ctx` positions; `q` `[ctx, n_q·HD]`
    /// (pre-scaled), `out` the same shape.
    fn attend(&self, q: &[f32], n_q: usize, ctx: usize, out: &mut [f32]) {
        let r = n_q / N_KV;
        let per = N_KV.div_ceil(THREADS);
        let mut parts: Vec<Vec<f32>> = vec![Vec::new(); N_KV];
        std::thread::scope(|sc| {
            for (ci, chunk) in parts.chunks_mut(per).enumerate() {
                sc.spawn(move || {
                    for (k, dst) in chunk.iter_mut().enumerate() {
                        *dst = self.head(ci * per + k, q, n_q, r, ctx);
                    }
                });
            }
        });
        for (h, p) in parts.iter().enumerate() {
            for j in 0..ctx {
                out[j * n_q * HD + h * r * HD..][..r * HD]
                    .copy_from_slice(&p[j * r * HD..][..r * HD]);
            }
        }
    }

    /// One KV head: `[ctx, r, HD]`. Query blocks of 64 positions; keys in
    /// chunks of [`KEY_CHUNK`], scored and summed by the dense kernels and
    /// folded into a running softmax state per row (flash attention's
    /// order). f16 rows are read in place (converting a chunk to an `f32`
    /// buffer once per block measured slower: 220 against 188 ms at 4096
    /// tokens); f32 rows are copied to a line-aligned buffer first.
    fn head(&self, h: usize, q: &[f32], n_q: usize, r: usize, ctx: usize) -> Vec<f32> {
        let mut out = vec![0f32; ctx * r * HD];
        let mut qb = Vec::new();
        let (mut kb, mut vb) = (Aligned::new(KEY_CHUNK * HD), Aligned::new(KEY_CHUNK * HD));
        let mut s = vec![0f32; BLOCK * r * KEY_CHUNK];
        let mut o = vec![0f32; BLOCK * r * HD];
        let (mut m, mut l) = (Vec::new(), Vec::new());
        for j0 in (0..ctx).step_by(BLOCK) {
            let j1 = (j0 + BLOCK).min(ctx);
            let rows = (j1 - j0) * r;
            qb.clear();
            for j in j0..j1 {
                qb.extend_from_slice(&q[j * n_q * HD + h * r * HD..][..r * HD]);
            }
            let acc = &mut out[j0 * r * HD..j1 * r * HD];
            acc.fill(0.0);
            m.clear();
            m.resize(rows, f32::NEG_INFINITY);
            l.clear();
            l.resize(rows, 0f32);
            for c0 in (0..j1).step_by(KEY_CHUNK) {
                let c1 = (c0 + KEY_CHUNK).min(j1);
                let w = c1 - c0;
                let (k, v) = (kb.get(w * HD), vb.get(w * HD));
                let s = &mut s[..rows * w];
                match self {
                    Dense::F32 { k: ks, .. } => {
                        k.copy_from_slice(&ks[h][c0 * HD..c1 * HD]);
                        dense::scores_f32(HD, k, &qb, s)
                    }
                    Dense::F16 { k: ks, .. } => {
                        dense::scores_f16(HD, &ks[h][c0 * HD..c1 * HD], &qb, s)
                    }
                }
                .unwrap();
                let o = &mut o[..rows * HD];
                for (i, row) in s.chunks_exact_mut(w).enumerate() {
                    let pos = j0 + i / r;
                    let vis = (pos + 1).saturating_sub(c0).min(w);
                    row[vis..].fill(0.0);
                    let (mc, lc) = kernels::softmax_parts(&mut row[..vis]);
                    // Rescale the running state to the new max.
                    let mn = m[i].max(mc);
                    let (a, b) = ((m[i] - mn).exp(), (mc - mn).exp());
                    if mc == f32::NEG_INFINITY {
                        continue;
                    }
                    let a = if m[i] == f32::NEG_INFINITY { 0.0 } else { a };
                    acc[i * HD..(i + 1) * HD].iter_mut().for_each(|x| *x *= a);
                    row[..vis].iter_mut().for_each(|x| *x *= b);
                    l[i] = l[i] * a + lc * b;
                    m[i] = mn;
                }
                o.fill(0.0);
                match self {
                    Dense::F32 { v: vs, .. } => {
                        v.copy_from_slice(&vs[h][c0 * HD..c1 * HD]);
                        dense::weighted_sum_f32(HD, v, s, o)
                    }
                    Dense::F16 { v: vs, .. } => {
                        dense::weighted_sum_f16(HD, &vs[h][c0 * HD..c1 * HD], s, o)
                    }
                }
                .unwrap();
                acc.iter_mut().zip(o.iter()).for_each(|(a, b)| *a += b);
            }
            for (i, l) in l.iter().enumerate() {
                acc[i * HD..(i + 1) * HD].iter_mut().for_each(|x| *x /= l);
            }
        }
        out
    }
}

/// Keys per chunk of the dense baselines: a block's scores over a chunk
/// (256 KiB) stay in L2, as the cache's do (1024 measured as fast as 256
/// for f16 at 16384 tokens and faster than 4096).
const KEY_CHUNK: usize = 1024;

/// An `f32` buffer whose used part starts on a 64-byte line, so the
/// baselines' 512-bit loads never split a line (as the packed kernels'
/// tile buffers).
struct Aligned(Vec<f32>);

impl Aligned {
    fn new(n: usize) -> Aligned {
        Aligned(vec![0f32; n + 16])
    }
    fn get(&mut self, n: usize) -> &mut [f32] {
        let off = (64 - self.0.as_ptr() as usize % 64) % 64 / 4;
        &mut self.0[off..off + n]
    }
}

enum Case {
    Dense(Dense),
    Cache(Box<LayerCache>),
}

fn main() {
    let ctxs = env_list("KVQ_PREFILL_CTX", &[512, 4096]);
    let nqs = env_list("KVQ_PREFILL_NQ", &[1]);
    let rounds = env_list("KVQ_PREFILL_ROUNDS", &[10])[0].max(1);
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for &ctx in &ctxs {
        let kx = data(ctx * N_KV * HD, 1);
        let vx = data(ctx * N_KV * HD, 2);
        let base = CacheConfig::new(N_KV, HD).threads(THREADS);
        let (pc4, pt4) = (scheme(4, Axis::PerChannel), scheme(4, Axis::PerToken));
        let (pc8, pt8) = (scheme(8, Axis::PerChannel), scheme(8, Axis::PerToken));
        let cache = |cfg: CacheConfig| {
            let mut c = LayerCache::new(cfg).unwrap();
            c.extend(&kx, &vx).unwrap();
            Case::Cache(Box::new(c))
        };
        let h4 = Codec::hadamard(pt4);
        let mut cases: Vec<(&str, Case)> = vec![
            (
                "dense-f16",
                Case::Dense(Dense::F16 {
                    k: head_major(&kx, ctx, f16::from_f32),
                    v: head_major(&vx, ctx, f16::from_f32),
                }),
            ),
            (
                "dense-f32",
                Case::Dense(Dense::F32 {
                    k: head_major(&kx, ctx, |x| x),
                    v: head_major(&vx, ctx, |x| x),
                }),
            ),
            ("cache fp32", cache(base)),
            ("cache 4b-kivi32", cache(base.keys(pc4).values(pt4))),
            ("cache 8b-kivi32", cache(base.keys(pc8).values(pt8))),
            ("cache 4b-H-pt32", cache(base.key_codec(h4).value_codec(h4))),
            (
                "cache 4b-kivi32-prerope",
                cache(base.keys(pc4).values(pt4).pre_rope(kvq::Rope::new(
                    500_000.0,
                    HD,
                    kvq::RopeStyle::Halves,
                ))),
            ),
            (
                "cache 4b-iq4nl",
                cache(
                    base.key_codec(kvq::presets::iq4_nl())
                        .value_codec(kvq::presets::iq4_nl()),
                ),
            ),
            (
                "cache 4b-kivi32-o1",
                cache(
                    base.key_codec(Codec::from(pc4).with_outliers(0.01).unwrap())
                        .value_codec(Codec::from(pt4).with_outliers(0.01).unwrap()),
                ),
            ),
        ];
        cases.retain(|(n, _)| {
            *n == "dense-f16"
                || filters.is_empty()
                || filters.iter().any(|f| n.contains(f.as_str()))
        });
        for &r in &nqs {
            let n_q = N_KV * r;
            let q = data(ctx * n_q * HD, 3);
            // The cache scales queries itself; the dense path takes them scaled.
            let scale = 1.0 / (HD as f32).sqrt();
            let qs: Vec<f32> = q.iter().map(|x| x * scale).collect();
            let mut out = vec![0f32; q.len()];
            // The baselines compute what the cache does: every case's output
            // against the f32 baseline's (printed, as a check on the harness).
            let mut want = vec![0f32; q.len()];
            if let Some((_, Case::Dense(d))) = cases.iter().find(|(n, _)| *n == "dense-f32") {
                d.attend(&qs, n_q, ctx, &mut want);
            }
            let mut diffs = Vec::new();
            for (name, c) in &cases {
                match c {
                    Case::Dense(d) => d.attend(&qs, n_q, ctx, &mut out),
                    Case::Cache(c) => c.attend_causal(&q, n_q, &mut out, None).unwrap(),
                }
                let d = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                diffs.push(format!("{name} {d:.1e}"));
            }
            let mut times = vec![Vec::with_capacity(rounds); cases.len()];
            for round in 0..rounds + 1 {
                for k in 0..cases.len() {
                    let i = (k + round) % cases.len();
                    let t = Instant::now();
                    match &cases[i].1 {
                        Case::Dense(d) => d.attend(&qs, n_q, ctx, &mut out),
                        Case::Cache(c) => c.attend_causal(&q, n_q, &mut out, None).unwrap(),
                    }
                    black_box(&out);
                    // Round 0 warms up.
                    if round > 0 {
                        times[i].push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
            println!(
                "\nattend_causal, ctx {ctx}, {N_KV} KV heads of {HD}, {r} query head(s) per KV head, \
                 {THREADS} threads, {rounds} rounds"
            );
            println!("max |output − dense-f32 output|: {}", diffs.join(", "));
            println!("| case | min ms | median ms | f16 ÷ case, median of rounds |");
            println!("|---|---:|---:|---:|");
            let f16 = times[0].clone();
            for (i, (name, _)) in cases.iter().enumerate() {
                let mut t = times[i].clone();
                let mut ratio: Vec<f64> = f16.iter().zip(&t).map(|(a, b)| a / b).collect();
                t.sort_by(f64::total_cmp);
                ratio.sort_by(f64::total_cmp);
                println!(
                    "| {name} | {:.2} | {:.2} | **{:.2}x** |",
                    t[0],
                    t[t.len() / 2],
                    ratio[ratio.len() / 2]
                );
            }
        }
    }
}
