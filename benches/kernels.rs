//! Decode kernels: packed scores and weighted sums against the dense f32
//! and f16 baselines, per backend, and a multi-head "attend" loop that
//! streams a whole layer's cache from DRAM on both cores.
//!
//! ```text
//! cargo bench --bench kernels                      # default: ~5 minutes
//! KVQ_BENCH_FULL=1 cargo bench --bench kernels     # + context 131072, every backend everywhere
//! cargo bench --bench kernels -- 'attend'          # one group
//! ```
//!
//! Groups are `scores/hd{D}/q{N}`, `weighted_sum/hd{D}/q{N}` (one KV head,
//! `N` query heads sharing it) and `attend/hd128/q{N}` (8 KV heads, two
//! threads, layer copies rotated through 1 GiB so every call reads DRAM,
//! with a `dram-read` roofline of the f16 cache's bytes). Each benchmark is `BenchmarkId::new("<backend>
//! <scheme>" or "dense-f16"/"dense-f32", context)`, with
//! `Throughput::Bytes` of cache streamed (codes + scales + zeros, or the
//! dense rows), so criterion's GB/s are comparable across schemes.
//!
//! Scheme names: `4b-pc32` = 4-bit keys per-channel in blocks of 32 tokens;
//! `4b-pt32` = per-token groups of 32 channels; asymmetric, f16 scale and
//! zero. The attend loop uses KIVI's pairing: keys per-channel, values
//! per-token (`4b-kivi32`); `-i8q` scores with the opt-in int8-query kernel
//! (`kernels::scores_i8`, AVX-512 VNNI).
//!
//! The full multi-head `attend` of `LayerCache` (threads across heads,
//! residual window, sinks) is benched in `benches/cache.rs`; the loop here
//! calls the kernels directly (scores → softmax → weighted sum per KV head,
//! heads split over two `std::thread::scope` threads) so the kernels'
//! DRAM-streaming speed is measured without the cache around them.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use kvq::kernels::{self, dense};
use kvq::{Axis, Backend, Group, KvQuantizer, PackedBlock, QuantScheme, UniformQuantizer};
use std::cell::OnceCell;
use std::hint::black_box;
use std::time::Duration;

fn full() -> bool {
    std::env::var("KVQ_BENCH_FULL").is_ok_and(|v| v == "1")
}

fn contexts() -> Vec<usize> {
    if full() {
        vec![4096, 32768, 131072]
    } else {
        vec![4096, 32768]
    }
}

/// Deterministic pseudo-random values in `[-1, 1)`.
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

fn scheme(bits: u8, axis: Axis) -> QuantScheme {
    QuantScheme::new(bits, axis, Group::Size(32)).unwrap()
}

fn quantize(bits: u8, axis: Axis, n_kv: usize, hd: usize, x: &[f32], tokens: usize) -> PackedBlock {
    UniformQuantizer::new(scheme(bits, axis), n_kv, hd)
        .unwrap()
        .quantize(x, tokens)
        .unwrap()
}

fn label(bits: u8, axis: Axis) -> String {
    format!(
        "{bits}b-{}32",
        if axis == Axis::PerChannel { "pc" } else { "pt" }
    )
}

/// The SIMD backends everywhere; portable only at head_dim 128 unless full.
fn backends(hd: usize) -> Vec<Backend> {
    Backend::available()
        .into_iter()
        .filter(|&b| b != Backend::Portable || hd == 128 || full())
        .collect()
}

fn single_head(c: &mut Criterion) {
    for hd in [64, 128, 256] {
        for nq in [1, 4] {
            for kernel in ["scores", "weighted_sum"] {
                let mut g = c.benchmark_group(format!("{kernel}/hd{hd}/q{nq}"));
                g.sample_size(10)
                    .warm_up_time(Duration::from_millis(100))
                    .measurement_time(Duration::from_millis(300));
                for ctx in contexts() {
                    // Built on first use, so a filtered run only pays for
                    // the cases it measures.
                    let x = OnceCell::new();
                    let x = || x.get_or_init(|| data(ctx * hd, 1));
                    let x16 = OnceCell::new();
                    let x16 = || {
                        x16.get_or_init(|| {
                            x().iter().map(|&v| f16::from_f32(v)).collect::<Vec<f16>>()
                        })
                    };
                    let q = data(nq * hd, 2);
                    let p: Vec<f32> = data(nq * ctx, 3)
                        .iter()
                        .map(|v| v.abs() / ctx as f32)
                        .collect();
                    let mut out = vec![0f32; nq * ctx.max(hd)];
                    // Dense baselines.
                    g.throughput(Throughput::Bytes((ctx * hd * 2) as u64));
                    g.bench_function(BenchmarkId::new("dense-f16", ctx), |b| {
                        let k = x16();
                        b.iter(|| match kernel {
                            "scores" => {
                                dense::scores_f16(hd, black_box(k), &q, &mut out[..nq * ctx])
                                    .unwrap()
                            }
                            _ => dense::weighted_sum_f16(hd, black_box(k), &p, &mut out[..nq * hd])
                                .unwrap(),
                        })
                    });
                    g.throughput(Throughput::Bytes((ctx * hd * 4) as u64));
                    g.bench_function(BenchmarkId::new("dense-f32", ctx), |b| {
                        let k = x();
                        b.iter(|| match kernel {
                            "scores" => {
                                dense::scores_f32(hd, black_box(k), &q, &mut out[..nq * ctx])
                                    .unwrap()
                            }
                            _ => dense::weighted_sum_f32(hd, black_box(k), &p, &mut out[..nq * hd])
                                .unwrap(),
                        })
                    });
                    let axes: &[Axis] = if kernel == "scores" {
                        &[Axis::PerChannel, Axis::PerToken]
                    } else {
                        &[Axis::PerToken]
                    };
                    for &axis in axes {
                        for bits in [2u8, 3, 4, 8] {
                            let block = OnceCell::new();
                            let layout = scheme(bits, axis).layout(1, hd).unwrap();
                            g.throughput(Throughput::Bytes(layout.bytes(ctx) as u64));
                            for be in backends(hd) {
                                let id = BenchmarkId::new(
                                    format!("{} {}", be.name(), label(bits, axis)),
                                    ctx,
                                );
                                g.bench_function(id, |b| {
                                    let head = block
                                        .get_or_init(|| quantize(bits, axis, 1, hd, x(), ctx))
                                        .head(0);
                                    b.iter(|| match kernel {
                                        "scores" => kernels::scores_on(
                                            be,
                                            black_box(&head),
                                            &q,
                                            &mut out[..nq * ctx],
                                        )
                                        .unwrap(),
                                        _ => kernels::weighted_sum_on(
                                            be,
                                            black_box(&head),
                                            &p,
                                            &mut out[..nq * hd],
                                        )
                                        .unwrap(),
                                    })
                                });
                            }
                        }
                    }
                }
                g.finish();
            }
        }
    }
}

/// A whole layer's K and V for one decode step.
#[derive(Clone)]
enum Layer {
    /// Packed K (per-channel) and V (per-token); `i8q`: scores through the
    /// opt-in int8-query kernel.
    Packed {
        k: PackedBlock,
        v: PackedBlock,
        i8q: bool,
    },
    F16 {
        k: Vec<Vec<f16>>,
        v: Vec<Vec<f16>>,
    },
    F32 {
        k: Vec<Vec<f32>>,
        v: Vec<Vec<f32>>,
    },
    /// The roofline: as many bytes as the f16 layer, only read (summed as
    /// integers), no arithmetic to speak of.
    Read {
        k: Vec<Vec<u64>>,
        v: Vec<Vec<u64>>,
    },
}

/// Sum of the words (four independent chains, so it is bound by the
/// loads, not by the adds).
fn read_sum(x: &[u64]) -> u64 {
    let mut a = [0u64; 8];
    for c in x.chunks_exact(8) {
        for i in 0..8 {
            a[i] = a[i].wrapping_add(c[i]);
        }
    }
    a.iter().fold(0, |s, &v| s.wrapping_add(v))
}

const N_KV: usize = 8;
const THREADS: usize = 2;

impl Layer {
    fn bytes(&self) -> usize {
        match self {
            Layer::Packed { k, v, .. } => k.bytes() + v.bytes(),
            Layer::F16 { k, v } => (k.iter().chain(v).map(Vec::len).sum::<usize>()) * 2,
            Layer::F32 { k, v } => (k.iter().chain(v).map(Vec::len).sum::<usize>()) * 4,
            Layer::Read { k, v } => (k.iter().chain(v).map(Vec::len).sum::<usize>()) * 8,
        }
    }

    /// Scores, softmax and weighted sum of KV head `h` for its `nq`
    /// queries (`q`, `out` `[nq, hd]`), with `s` as scratch.
    fn head(&self, be: Backend, h: usize, hd: usize, q: &[f32], s: &mut [f32], out: &mut [f32]) {
        let nq = q.len() / hd;
        let ctx = s.len() / nq;
        if let Layer::Read { k, v } = self {
            out[0] = (read_sum(&k[h]) ^ read_sum(&v[h])) as f32;
            return;
        }
        match self {
            Layer::Packed { k, i8q: false, .. } => {
                kernels::scores_on(be, &k.head(h), q, s).unwrap()
            }
            Layer::Packed { k, i8q: true, .. } => {
                kernels::scores_i8_on(be, &k.head(h), q, s).unwrap()
            }
            Layer::F16 { k, .. } => dense::scores_f16_on(be, hd, &k[h], q, s).unwrap(),
            Layer::F32 { k, .. } => dense::scores_f32_on(be, hd, &k[h], q, s).unwrap(),
            Layer::Read { .. } => unreachable!(),
        }
        for row in s.chunks_mut(ctx) {
            kernels::softmax_on(be, row);
        }
        out.fill(0.0);
        match self {
            Layer::Packed { v, .. } => kernels::weighted_sum_on(be, &v.head(h), s, out).unwrap(),
            Layer::F16 { v, .. } => dense::weighted_sum_f16_on(be, hd, &v[h], s, out).unwrap(),
            Layer::F32 { v, .. } => dense::weighted_sum_f32_on(be, hd, &v[h], s, out).unwrap(),
            Layer::Read { .. } => unreachable!(),
        }
    }
}

/// One decode step over all heads, heads split across `THREADS` threads.
fn attend(layer: &Layer, be: Backend, hd: usize, ctx: usize, q: &[f32], out: &mut [f32]) {
    let per = q.len() / N_KV; // nq·hd per KV head
    let nq = per / hd;
    std::thread::scope(|sc| {
        let heads_per = N_KV / THREADS;
        for (ti, (qc, oc)) in q
            .chunks(per * heads_per)
            .zip(out.chunks_mut(per * heads_per))
            .enumerate()
        {
            sc.spawn(move || {
                let mut s = vec![0f32; nq * ctx];
                for (k, (qh, oh)) in qc.chunks(per).zip(oc.chunks_mut(per)).enumerate() {
                    layer.head(be, ti * heads_per + k, hd, qh, &mut s, oh);
                }
            });
        }
    });
}

/// Bytes of a layer case by its name (without building it).
fn bytes_of(name: &str, ctx: usize, hd: usize) -> usize {
    let elems = 2 * N_KV * ctx * hd;
    match name {
        "dense-f16" | "dram-read" => elems * 2,
        "dense-f32" => elems * 4,
        _ => {
            let bits: u8 = name
                .split(' ')
                .nth(1)
                .and_then(|b| b[..1].parse().ok())
                .unwrap();
            let k = scheme(bits, Axis::PerChannel)
                .layout(N_KV, hd)
                .unwrap()
                .bytes(ctx);
            let v = scheme(bits, Axis::PerToken)
                .layout(N_KV, hd)
                .unwrap()
                .bytes(ctx);
            k + v
        }
    }
}

/// Rotate over copies of the layer until they add up to 1 GiB (this
/// machine's last-level cache is 48 MiB), so every call streams from DRAM,
/// as a many-layer model's cache does.
const COLD_BYTES: usize = 1 << 30;

fn attend_group(c: &mut Criterion) {
    let hd = 128;
    let be = Backend::detect();
    for nq in [1, 4] {
        let mut g = c.benchmark_group(format!("attend/hd{hd}/q{nq}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
        let ctxs: Vec<usize> = contexts().into_iter().filter(|&c| c >= 32768).collect();
        for ctx in ctxs {
            let kx = data(ctx * N_KV * hd, 11);
            let vx = data(ctx * N_KV * hd, 12);
            let q = data(N_KV * nq * hd, 13);
            let mut out = vec![0f32; N_KV * nq * hd];
            // Head-major dense copies for the baselines.
            let split = |x: &[f32]| -> Vec<Vec<f32>> {
                (0..N_KV)
                    .map(|h| {
                        (0..ctx)
                            .flat_map(|t| {
                                x[(t * N_KV + h) * hd..(t * N_KV + h + 1) * hd]
                                    .iter()
                                    .copied()
                            })
                            .collect()
                    })
                    .collect()
            };
            let mut cases: Vec<(String, Box<dyn Fn() -> Layer>)> = vec![
                (
                    "dram-read".into(),
                    Box::new(|| {
                        let words = ctx * hd / 4; // f16 bytes of one head / 8
                        let w = |seed: u64| {
                            (0..N_KV)
                                .map(|h| (0..words as u64).map(|i| i ^ seed ^ h as u64).collect())
                                .collect()
                        };
                        Layer::Read { k: w(1), v: w(2) }
                    }),
                ),
                (
                    "dense-f16".into(),
                    Box::new(|| {
                        let h = |x: &[f32]| {
                            split(x)
                                .into_iter()
                                .map(|r| r.iter().map(|&v| f16::from_f32(v)).collect())
                                .collect()
                        };
                        Layer::F16 {
                            k: h(&kx),
                            v: h(&vx),
                        }
                    }),
                ),
                (
                    "dense-f32".into(),
                    Box::new(|| Layer::F32 {
                        k: split(&kx),
                        v: split(&vx),
                    }),
                ),
            ];
            for (bits, i8q) in [
                (2u8, false),
                (3, false),
                (4, false),
                (8, false),
                (4, true),
                (8, true),
            ] {
                let (kx, vx) = (&kx, &vx);
                cases.push((
                    format!(
                        "{} {bits}b-kivi32{}",
                        be.name(),
                        if i8q { "-i8q" } else { "" }
                    ),
                    Box::new(move || Layer::Packed {
                        k: quantize(bits, Axis::PerChannel, N_KV, hd, kx, ctx),
                        v: quantize(bits, Axis::PerToken, N_KV, hd, vx, ctx),
                        i8q,
                    }),
                ));
            }
            for (name, make) in cases {
                let layers: OnceCell<Vec<Layer>> = OnceCell::new();
                let bytes = bytes_of(&name, ctx, hd);
                g.throughput(Throughput::Bytes(bytes as u64));
                let mut i = 0;
                g.bench_function(BenchmarkId::new(name, ctx), |b| {
                    let layers = layers.get_or_init(|| {
                        let copies = COLD_BYTES.div_ceil(bytes).clamp(1, 64);
                        let first = make();
                        let v: Vec<Layer> = (0..copies).map(|_| first.clone()).collect();
                        assert_eq!(v[0].bytes(), bytes);
                        v
                    });
                    b.iter(|| {
                        i = (i + 1) % layers.len();
                        attend(&layers[i], be, hd, ctx, black_box(&q), &mut out);
                    })
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, single_head, attend_group);
criterion_main!(benches);
