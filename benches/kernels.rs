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
//! (`kernels::scores_i8`, AVX-512 VNNI); `-i8qw` also takes the weighted
//! sum through the opt-in int8-weight kernel (`kernels::weighted_sum_i8`).
//!
//! The full multi-head `attend` of `LayerCache` (threads across heads,
//! residual window, sinks) is benched in `benches/cache.rs`; the loop here
//! calls the kernels directly (scores → softmax → weighted sum per KV head,
//! heads split over two `std::thread::scope` threads) so the kernels'
//! DRAM-streaming speed is measured without the cache around them.
//! `benches/paired.rs` runs the same `attend` cases in interleaved rounds,
//! for ratios to f16 that survive a drifting host.

mod common;

use common::{attend, bytes_of, cold_copies, data, layer_cases, quantize, scheme, Layer, N_KV};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use kvq::kernels::{self, dense};
use kvq::{Axis, Backend};
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
            let cases = layer_cases(be, hd, ctx, &kx, &vx);
            for (name, make) in cases {
                let layers: OnceCell<Vec<Layer>> = OnceCell::new();
                let bytes = bytes_of(&name, ctx, hd);
                g.throughput(Throughput::Bytes(bytes as u64));
                let mut i = 0;
                g.bench_function(BenchmarkId::new(name, ctx), |b| {
                    let layers = layers.get_or_init(|| {
                        let v = cold_copies(make());
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
