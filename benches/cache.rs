//! Cache throughput: quantize/append (f32 input bytes per second), the
//! cost of an append at 1k and 1M tokens (amortized O(1)), and of a fork
//! of a long prompt and the fork's first append (`fork/…`).
//!
//! `cargo bench --bench cache`. The decode-attention benches, with the dense
//! f32/f16 baselines and the DRAM-read roofline, are in `benches/kernels.rs`.
//!
//! Throughput is f32 input bytes per second on one core (the quantizer and
//! `append`/`extend` are single-threaded); `docs/PERFORMANCE.md` has the
//! numbers.

mod common;

use common::data;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvq::{
    presets, Axis, CacheConfig, Group, KvQuantizer, LayerCache, QuantScheme, UniformQuantizer,
};
use std::hint::black_box;
use std::time::Duration;

fn schemes() -> Vec<(&'static str, QuantScheme, QuantScheme)> {
    let (k4, v4) = presets::kivi(4).unwrap();
    let (k2, v2) = presets::kivi(2).unwrap();
    let pt = |b| QuantScheme::new(b, Axis::PerToken, Group::Size(32)).unwrap();
    vec![
        ("kivi4", k4, v4),
        ("kivi2", k2, v2),
        ("pt4", pt(4), pt(4)),
        ("pt8", pt(8), pt(8)),
        ("pt3", pt(3), pt(3)),
    ]
}

/// Lloyd-Max levels at `bits` on symmetric per-token groups of 32, rotated
/// (as the paired bench's `cache 4b-H-gauss`).
fn gauss(bits: u8) -> kvq::Codec {
    let s = QuantScheme::new(bits, Axis::PerToken, Group::Size(32))
        .and_then(|s| s.with_mode(kvq::Mode::Symmetric))
        .expect("a valid scheme");
    kvq::Codec::codebook(s, kvq::Levels::Gauss).with_rotation(kvq::Rotation::Hadamard)
}

fn append(c: &mut Criterion) {
    let (n_kv, hd, tokens) = (8, 128, 1024);
    let w = n_kv * hd;
    let k = data(tokens * w, 1);
    let v = data(tokens * w, 2);
    let mut g = c.benchmark_group("append");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    g.throughput(Throughput::Bytes((2 * tokens * w * 4) as u64));
    // The schemes, KIVI-4 with 1 % outliers in keys and values (the
    // encoder picks and corrects them), and the codebooks: `iq4_nl`, and
    // rotated Lloyd-Max levels at 4 and 3 bits (each group's scale chosen
    // among several starts and refit).
    let (k4, v4) = presets::kivi(4).unwrap();
    let o = |s| kvq::Codec::from(s).with_outliers(0.01).unwrap();
    let cfgs = schemes()
        .into_iter()
        .map(|(name, ks, vs)| (name, CacheConfig::new(n_kv, hd).keys(ks).values(vs)))
        .chain([(
            "kivi4-o1",
            CacheConfig::new(n_kv, hd)
                .key_codec(o(k4))
                .value_codec(o(v4)),
        )])
        .chain([4, 3].map(|bits| {
            let c = gauss(bits);
            let name = if bits == 4 { "H-gauss4" } else { "H-gauss3" };
            (name, CacheConfig::new(n_kv, hd).key_codec(c).value_codec(c))
        }))
        .chain([(
            "iq4nl",
            CacheConfig::new(n_kv, hd)
                .key_codec(presets::iq4_nl())
                .value_codec(presets::iq4_nl()),
        )]);
    for (name, cfg) in cfgs {
        let mut cache = LayerCache::new(cfg).unwrap();
        g.bench_function(BenchmarkId::new("extend", name), |b| {
            b.iter(|| {
                cache.clear();
                cache.extend(black_box(&k), black_box(&v)).unwrap();
            })
        });
        g.bench_function(BenchmarkId::new("append-token", name), |b| {
            b.iter(|| {
                cache.clear();
                for t in 0..tokens {
                    cache
                        .append(&k[t * w..(t + 1) * w], &v[t * w..(t + 1) * w])
                        .unwrap();
                }
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("quantize");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    g.throughput(Throughput::Bytes((tokens * w * 4) as u64));
    for (name, ks, _) in schemes() {
        let q = UniformQuantizer::new(ks, n_kv, hd).unwrap();
        g.bench_function(BenchmarkId::new("block", name), |b| {
            b.iter(|| black_box(q.quantize(black_box(&k), tokens).unwrap()))
        });
    }
    g.finish();
}

/// Amortized append: the cost of appending 1024 tokens one at a time to a
/// cache that already holds 1k and 1M tokens (one KV head of 128, KIVI-4;
/// 136 MB packed at 1M). The measured tokens are truncated away after each
/// batch, outside the timing, so every batch starts at the same length.
fn append_at_length(c: &mut Criterion) {
    let (n_kv, hd, batch) = (1, 128, 1024);
    let w = n_kv * hd;
    let k = data(batch * w, 3);
    let v = data(batch * w, 4);
    let mut g = c.benchmark_group("append_at");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    g.throughput(Throughput::Elements(batch as u64));
    let (ks, vs) = presets::kivi(4).unwrap();
    for start in [1 << 10, 1 << 20] {
        let mut cache = LayerCache::new(CacheConfig::new(n_kv, hd).keys(ks).values(vs)).unwrap();
        let fill_k = data(start * w, 5);
        let fill_v = data(start * w, 6);
        cache.extend(&fill_k, &fill_v).unwrap();
        drop((fill_k, fill_v));
        g.bench_function(BenchmarkId::new("kivi4", start), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = std::time::Instant::now();
                    for i in 0..batch {
                        cache
                            .append(&k[i * w..(i + 1) * w], &v[i * w..(i + 1) * w])
                            .unwrap();
                    }
                    total += t.elapsed();
                    cache.truncate(start).unwrap();
                }
                total
            })
        });
    }
    g.finish();
}

/// `fork`: a fork of a prompt of 4k and 32k tokens (8 KV heads of 128,
/// KIVI-4, residual 128, 4 sinks), and the fork plus its first append,
/// which copies the page it writes into; outside a pool and in a pool of
/// 256-token pages.
fn fork(c: &mut Criterion) {
    let (n_kv, hd) = (8, 128);
    let w = n_kv * hd;
    let mut g = c.benchmark_group("fork");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let (ks, vs) = presets::kivi(4).unwrap();
    let cfg = CacheConfig::new(n_kv, hd)
        .keys(ks)
        .values(vs)
        .residual(128)
        .sinks(4);
    let row_k = data(w, 7);
    let row_v = data(w, 8);
    for tokens in [4096, 32768] {
        let fill_k = data(tokens * w, 5);
        let fill_v = data(tokens * w, 6);
        let pool = kvq::cache::PagePool::new(256, None).unwrap();
        for (name, pool) in [("alone", None), ("pool256", Some(&pool))] {
            let mut prompt = match pool {
                Some(p) => LayerCache::new_in(cfg, p),
                None => LayerCache::new(cfg),
            }
            .unwrap();
            prompt.extend(&fill_k, &fill_v).unwrap();
            g.bench_function(BenchmarkId::new(format!("fork-{name}"), tokens), |b| {
                b.iter(|| black_box(prompt.fork()))
            });
            g.bench_function(
                BenchmarkId::new(format!("fork-append-{name}"), tokens),
                |b| {
                    b.iter(|| {
                        let mut f = prompt.fork();
                        f.append(&row_k, &row_v).unwrap();
                        black_box(f)
                    })
                },
            );
        }
    }
    g.finish();
}

criterion_group!(benches, append, append_at_length, fork);
criterion_main!(benches);
