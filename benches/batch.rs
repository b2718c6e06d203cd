//! Batched decode: one step of many sequences of mixed lengths, every
//! (sequence, KV head) pair a unit of work spread over the threads, timed
//! in interleaved rounds like `benches/paired.rs`.
//!
//! ```text
//! cargo bench --bench batch                       # 16 and 64 sequences
//! KVQ_BATCH_SEQS=32 KVQ_BATCH_ROUNDS=50 cargo bench --bench batch
//! ```
//!
//! - `KVQ_BATCH_SEQS`: sequence counts (default `16,64`).
//! - `KVQ_BATCH_TOKENS`: mean tokens per sequence (default 4096); lengths
//!   are spread evenly over `[mean/8, 15·mean/8]` in a shuffled order.
//! - `KVQ_BATCH_NQ`: query heads per KV head (default `1,4`).
//! - `KVQ_BATCH_ROUNDS`: rounds (default 30).
//! - `KVQ_BATCH_ORDER=sorted`: the sequences in ascending length, not
//!   scrambled (an even split by count would give one thread most of the
//!   tokens; both the cache and the baseline split by tokens).
//!
//! Cases, each at one and at two threads: `dense-f16`, the same units over
//! f16 rows with the dense kernels (the baseline); `kivi4` through
//! `kvq::cache::attend_batch` over caches outside a pool (4096-token
//! pages); `kivi4-pool1024` and `kivi4-pool256` in a `PagePool`. 8 KV
//! heads of 128, residual 0. The figures are in `docs/PERFORMANCE.md`.

mod common;

use common::{data, env_list, env_num, scheme, Paired};
use half::f16;
use kvq::cache::{attend_batch, PagePool};
use kvq::kernels::{self, dense};
use kvq::{Axis, Backend, CacheConfig, LayerCache};
use std::hint::black_box;
use std::time::Instant;

const N_KV: usize = 8;
const HD: usize = 128;

/// One sequence's f16 K and V rows per KV head, `[tokens, hd]` each.
struct Dense {
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
}

/// One decode step of every sequence over f16 rows (`q` already carries
/// the softmax scale): unit `u` is sequence `u / N_KV`, head `u % N_KV`,
/// units split over `threads` scoped threads in contiguous ranges of
/// about equal tokens (what `attend_batch` does).
fn dense_batch(be: Backend, seqs: &[Dense], q: &[f32], nq: usize, out: &mut [f32], threads: usize) {
    let units = seqs.len() * N_KV;
    let unit = nq * HD;
    let cost = |u: usize| seqs[u / N_KV].k[0].len() / HD + 64;
    let total: usize = (0..units).map(cost).sum();
    let mut edges = vec![0];
    let mut acc = 0;
    for u in 0..units {
        acc += cost(u);
        if edges.len() < threads && u + 1 < units && acc * threads >= total * edges.len() {
            edges.push(u + 1);
        }
    }
    edges.push(units);
    let mut rest = &mut out[..];
    std::thread::scope(|s| {
        for w in edges.windows(2) {
            let (block, tail) = rest.split_at_mut((w[1] - w[0]) * unit);
            rest = tail;
            let u0 = w[0];
            s.spawn(move || {
                let mut sc = Vec::new();
                for (k, dst) in block.chunks_mut(unit).enumerate() {
                    let u = u0 + k;
                    let (i, h) = (u / N_KV, u % N_KV);
                    let d = &seqs[i];
                    let ctx = d.k[h].len() / HD;
                    sc.resize(nq * ctx, 0.0);
                    let qh = &q[u * unit..(u + 1) * unit];
                    dense::scores_f16_on(be, HD, &d.k[h], qh, &mut sc).unwrap();
                    for row in sc.chunks_mut(ctx) {
                        kernels::softmax_on(be, row);
                    }
                    dst.fill(0.0);
                    dense::weighted_sum_f16_on(be, HD, &d.v[h], &sc, dst).unwrap();
                }
            });
        }
    });
}

fn main() {
    let be = Backend::detect();
    let counts = env_list("KVQ_BATCH_SEQS").unwrap_or_else(|| vec![16, 64]);
    let mean = env_num("KVQ_BATCH_TOKENS").unwrap_or(4096).max(8);
    let nqs = env_list("KVQ_BATCH_NQ").unwrap_or_else(|| vec![1, 4]);
    let rounds = env_num("KVQ_BATCH_ROUNDS").unwrap_or(30).max(3);
    let (ks, vs) = (scheme(4, Axis::PerChannel), scheme(4, Axis::PerToken));
    let cfg = CacheConfig::new(N_KV, HD)
        .keys(ks)
        .values(vs)
        .backend(be)
        .threads(1);
    for &n in &counts {
        // Lengths evenly over [mean/8, 15·mean/8], in a scrambled order
        // (or ascending with `KVQ_BATCH_ORDER=sorted`).
        let mut lens: Vec<usize> = (0..n)
            .map(|i| {
                let j = (i * 7 + 3) % n;
                mean / 8 + (14 * mean / 8) * j / n.max(2).saturating_sub(1).max(1)
            })
            .collect();
        if std::env::var("KVQ_BATCH_ORDER").is_ok_and(|v| v == "sorted") {
            lens.sort_unstable();
        }
        let total: usize = lens.iter().sum();
        let pools = [
            PagePool::new(1024, None).unwrap(),
            PagePool::new(256, None).unwrap(),
        ];
        let mut alone = Vec::new();
        let mut pooled: [Vec<LayerCache>; 2] = [Vec::new(), Vec::new()];
        let mut dense_seqs = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let k = data(len * N_KV * HD, 100 + 2 * i as u64);
            let v = data(len * N_KV * HD, 101 + 2 * i as u64);
            let mut c = LayerCache::new(cfg).unwrap();
            c.extend(&k, &v).unwrap();
            alone.push(c);
            for (p, dst) in pools.iter().zip(&mut pooled) {
                let mut c = LayerCache::new_in(cfg, p).unwrap();
                c.extend(&k, &v).unwrap();
                dst.push(c);
            }
            let per_head = |x: &[f32]| -> Vec<Vec<f16>> {
                (0..N_KV)
                    .map(|h| {
                        (0..len)
                            .flat_map(|t| x[(t * N_KV + h) * HD..][..HD].iter())
                            .map(|&e| f16::from_f32(e))
                            .collect()
                    })
                    .collect()
            };
            dense_seqs.push(Dense {
                k: per_head(&k),
                v: per_head(&v),
            });
        }
        let f16_bytes = total * N_KV * HD * 2 * 2;
        let q4_bytes: usize = alone.iter().map(|c| c.bytes().total()).sum();
        for &nq in &nqs {
            let q = data(n * N_KV * nq * HD, 7);
            let scale = 1.0 / (HD as f32).sqrt();
            let q_scaled: Vec<f32> = q.iter().map(|x| x * scale).collect();
            let mut out = vec![0f32; q.len()];
            let cases: Vec<String> = [1, 2]
                .iter()
                .flat_map(|t| {
                    ["dense-f16", "kivi4", "kivi4-pool1024", "kivi4-pool256"]
                        .map(|c| format!("{c} t{t}"))
                })
                .collect();
            let mut times = vec![Vec::with_capacity(rounds); cases.len()];
            for r in 0..rounds + 2 {
                for k in 0..cases.len() {
                    let c = (r + k) % cases.len();
                    let threads = 1 + c / 4;
                    let t = Instant::now();
                    match c % 4 {
                        0 => dense_batch(
                            be,
                            &dense_seqs,
                            black_box(&q_scaled),
                            nq,
                            &mut out,
                            threads,
                        ),
                        m => {
                            let seqs = match m {
                                1 => &alone,
                                2 => &pooled[0],
                                _ => &pooled[1],
                            };
                            let refs: Vec<&LayerCache> = seqs.iter().collect();
                            attend_batch(&refs, black_box(&q), N_KV * nq, &mut out, threads)
                                .unwrap();
                        }
                    }
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    if r >= 2 {
                        times[c].push(ms);
                    }
                }
            }
            println!(
                "\nbatched decode: {n} sequences, {total} tokens (mean {mean}), {N_KV} KV heads of {HD}, \
                 {nq} queries per KV head, {} backend, {rounds} rounds; f16 {:.0} MiB, KIVI-4 {:.0} MiB",
                be.name(),
                f16_bytes as f64 / (1 << 20) as f64,
                q4_bytes as f64 / (1 << 20) as f64,
            );
            println!("| case | min ms | median ms | sequences/s at median | f16 (same threads) ÷ case, median of rounds | f16 min ÷ case min |");
            println!("|---|---:|---:|---:|---:|---:|");
            for (c, name) in cases.iter().enumerate() {
                let p = Paired::new(&times[c / 4 * 4], &times[c]);
                println!(
                    "| {name} | {:.2} | {:.2} | {:.0} | **{:.2}x** | {:.2}x |",
                    p.min,
                    p.median,
                    n as f64 / p.median * 1e3,
                    p.ratio,
                    p.min_ratio,
                );
            }
        }
    }
}
