//! What the decode benches share: deterministic data, the KIVI-style
//! packed layer and its dense baselines, and the multi-head `attend` loop
//! (`benches/kernels.rs` times it with criterion, `benches/paired.rs`
//! interleaves the cases call by call). `benches/cache.rs` only takes
//! `data`, hence the `allow`.

#![allow(dead_code)]

use half::f16;
use kvq::kernels::{self, dense};
use kvq::{
    cache::PagePool, Axis, Backend, CacheConfig, Group, KvQuantizer, LayerCache, PackedBlock,
    QuantScheme, UniformQuantizer,
};

/// Deterministic pseudo-random values in `[-1, 1)`.
pub fn data(n: usize, seed: u64) -> Vec<f32> {
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

pub fn scheme(bits: u8, axis: Axis) -> QuantScheme {
    QuantScheme::new(bits, axis, Group::Size(32)).unwrap()
}

pub fn quantize(
    bits: u8,
    axis: Axis,
    n_kv: usize,
    hd: usize,
    x: &[f32],
    tokens: usize,
) -> PackedBlock {
    UniformQuantizer::new(scheme(bits, axis), n_kv, hd)
        .unwrap()
        .quantize(x, tokens)
        .unwrap()
}

/// A whole layer's K and V for one decode step.
#[derive(Clone)]
pub enum Layer {
    /// Packed K (per-channel) and V (per-token); `i8q`: scores through the
    /// opt-in int8-query kernel; `i8w`: the weighted sum through the opt-in
    /// int8-weight kernel.
    Packed {
        k: PackedBlock,
        v: PackedBlock,
        i8q: bool,
        i8w: bool,
    },
    F16 {
        k: Vec<Vec<f16>>,
        v: Vec<Vec<f16>>,
    },
    F32 {
        k: Vec<Vec<f32>>,
        v: Vec<Vec<f32>>,
    },
    /// The public cache, attended through `LayerCache::attend` (its own
    /// threads across heads), and the pool its pages come from.
    Cache(Box<LayerCache>, Option<PagePool>),
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

pub const N_KV: usize = 8;
pub const THREADS: usize = 2;

impl Layer {
    pub fn bytes(&self) -> usize {
        match self {
            Layer::Packed { k, v, .. } => k.bytes() + v.bytes(),
            Layer::F16 { k, v } => (k.iter().chain(v).map(Vec::len).sum::<usize>()) * 2,
            Layer::F32 { k, v } => (k.iter().chain(v).map(Vec::len).sum::<usize>()) * 4,
            Layer::Read { k, v } => (k.iter().chain(v).map(Vec::len).sum::<usize>()) * 8,
            Layer::Cache(c, _) => c.bytes().total(),
        }
    }

    /// Scores, softmax and weighted sum of KV head `h` for its `nq`
    /// queries (`q`, `out` `[nq, hd]`), with `s` as scratch.
    pub fn head(
        &self,
        be: Backend,
        h: usize,
        hd: usize,
        q: &[f32],
        s: &mut [f32],
        out: &mut [f32],
    ) {
        let nq = q.len() / hd;
        let ctx = s.len() / nq;
        if let Layer::Read { k, v } = self {
            out[0] = (read_sum(&k[h]) ^ read_sum(&v[h])) as f32;
            return;
        }
        assert!(
            !matches!(self, Layer::Cache(..)),
            "a cache attends all heads at once"
        );
        match self {
            Layer::Packed { k, i8q: false, .. } => {
                kernels::scores_on(be, &k.head(h), q, s).unwrap()
            }
            Layer::Packed { k, i8q: true, .. } => {
                kernels::scores_i8_on(be, &k.head(h), q, s).unwrap()
            }
            Layer::F16 { k, .. } => dense::scores_f16_on(be, hd, &k[h], q, s).unwrap(),
            Layer::F32 { k, .. } => dense::scores_f32_on(be, hd, &k[h], q, s).unwrap(),
            Layer::Read { .. } | Layer::Cache(..) => unreachable!(),
        }
        for row in s.chunks_mut(ctx) {
            kernels::softmax_on(be, row);
        }
        out.fill(0.0);
        match self {
            Layer::Packed { v, i8w: false, .. } => {
                kernels::weighted_sum_on(be, &v.head(h), s, out).unwrap()
            }
            Layer::Packed { v, i8w: true, .. } => {
                kernels::weighted_sum_i8_on(be, &v.head(h), s, out).unwrap()
            }
            Layer::F16 { v, .. } => dense::weighted_sum_f16_on(be, hd, &v[h], s, out).unwrap(),
            Layer::F32 { v, .. } => dense::weighted_sum_f32_on(be, hd, &v[h], s, out).unwrap(),
            Layer::Read { .. } | Layer::Cache(..) => unreachable!(),
        }
    }
}

/// One decode step over all heads, heads split across `THREADS` threads.
pub fn attend(layer: &Layer, be: Backend, hd: usize, ctx: usize, q: &[f32], out: &mut [f32]) {
    attend_threads(layer, be, hd, ctx, q, out, THREADS);
}

/// [`attend`] with the heads split across `threads` threads (a divisor of
/// [`N_KV`]).
pub fn attend_threads(
    layer: &Layer,
    be: Backend,
    hd: usize,
    ctx: usize,
    q: &[f32],
    out: &mut [f32],
    threads: usize,
) {
    assert!(
        threads > 0 && N_KV.is_multiple_of(threads),
        "threads must divide the {N_KV} KV heads"
    );
    if let Layer::Cache(c, _) = layer {
        // Its threads were fixed when it was built.
        c.attend(q, q.len() / hd, out).unwrap();
        return;
    }
    let per = q.len() / N_KV; // nq·hd per KV head
    let nq = per / hd;
    std::thread::scope(|sc| {
        let heads_per = N_KV / threads;
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
pub fn bytes_of(name: &str, ctx: usize, hd: usize) -> usize {
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
/// development VMs' last-level caches are 32–48 MiB), so every call streams from DRAM,
/// as a many-layer model's cache does.
pub const COLD_BYTES: usize = 1 << 30;

/// A boxed layer builder.
pub type Make<'a> = Box<dyn Fn() -> Layer + 'a>;

/// Head-major copy (`[N_KV][ctx·hd]`) of `[ctx, N_KV, hd]` values.
fn split(x: &[f32], ctx: usize, hd: usize) -> Vec<Vec<f32>> {
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
}

/// The `attend` cases at one context, by name: the `dram-read` roofline,
/// the dense f16 and f32 baselines, then `<backend> {2,3,4,8}b-kivi32` and
/// the `-i8q` int8-query variants of 4 and 8 bits, and the `-i8qw`
/// variants (int8 query and int8 weights). `kx`/`vx` are
/// `[ctx, N_KV, hd]`.
pub fn layer_cases<'a>(
    be: Backend,
    hd: usize,
    ctx: usize,
    kx: &'a [f32],
    vx: &'a [f32],
) -> Vec<(String, Make<'a>)> {
    let mut cases: Vec<(String, Make<'a>)> = vec![
        (
            "dram-read".into(),
            Box::new(move || {
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
            Box::new(move || {
                let h = |x: &[f32]| {
                    split(x, ctx, hd)
                        .into_iter()
                        .map(|r| r.iter().map(|&v| f16::from_f32(v)).collect())
                        .collect()
                };
                Layer::F16 { k: h(kx), v: h(vx) }
            }),
        ),
        (
            "dense-f32".into(),
            Box::new(move || Layer::F32 {
                k: split(kx, ctx, hd),
                v: split(vx, ctx, hd),
            }),
        ),
    ];
    for (bits, i8q, i8w) in [
        (2u8, false, false),
        (3, false, false),
        (4, false, false),
        (8, false, false),
        (4, true, false),
        (8, true, false),
        (4, true, true),
        (8, true, true),
    ] {
        let suffix = match (i8q, i8w) {
            (false, _) => "",
            (true, false) => "-i8q",
            (true, true) => "-i8qw",
        };
        cases.push((
            format!("{} {bits}b-kivi32{suffix}", be.name()),
            Box::new(move || Layer::Packed {
                k: quantize(bits, Axis::PerChannel, N_KV, hd, kx, ctx),
                v: quantize(bits, Axis::PerToken, N_KV, hd, vx, ctx),
                i8q,
                i8w,
            }),
        ));
    }
    cases
}

/// The cases through the public cache (built by `extend`, two threads):
/// `cache 4b-kivi32` (KIVI-4, residual 0), `cache 4b-kivi32-r128s4`
/// (residual window 128, 4 sinks) and `cache 4b-H-pt32` (K and V per-token
/// 4-bit groups of 32 behind the Hadamard rotation). `kx`/`vx` are
/// `[ctx, N_KV, hd]`.
pub fn cache_cases<'a>(
    be: Backend,
    hd: usize,
    kx: &'a [f32],
    vx: &'a [f32],
) -> Vec<(String, Make<'a>)> {
    let base = move || CacheConfig::new(N_KV, hd).backend(be).threads(THREADS);
    let build = move |cfg: CacheConfig| {
        let mut c = LayerCache::new(cfg).unwrap();
        c.extend(kx, vx).unwrap();
        Layer::Cache(Box::new(c), None)
    };
    let (pc, pt) = (scheme(4, Axis::PerChannel), scheme(4, Axis::PerToken));
    // KIVI-4 in a page pool of each size `KVQ_PAIRED_PAGES` lists.
    let pages: Vec<usize> = std::env::var("KVQ_PAIRED_PAGES")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_default();
    let pooled = pages.into_iter().map(move |n| {
        let make = move || {
            let pool = PagePool::new(n, None).unwrap();
            let mut c = LayerCache::new_in(base().keys(pc).values(pt), &pool).unwrap();
            c.extend(kx, vx).unwrap();
            Layer::Cache(Box::new(c), Some(pool))
        };
        (
            format!("cache 4b-kivi32-pool{n}"),
            Box::new(make) as Make<'a>,
        )
    });
    let mut cases: Vec<(String, Make<'a>)> = vec![
        (
            "cache 4b-kivi32".into(),
            Box::new(move || build(base().keys(pc).values(pt))) as Make<'a>,
        ),
        (
            "cache 4b-kivi32-r128s4".into(),
            Box::new(move || build(base().keys(pc).values(pt).residual(128).sinks(4))),
        ),
        (
            // KIVI-4 with keys stored before RoPE (each row unpacked,
            // dequantized and turned in registers, then scored; values
            // fused as usual).
            "cache 4b-kivi32-prerope".into(),
            Box::new(move || {
                let rope = kvq::Rope::new(500_000.0, hd, kvq::RopeStyle::Halves);
                build(base().keys(pc).values(pt).pre_rope(rope))
            }),
        ),
        (
            "cache 4b-H-pt32".into(),
            Box::new(move || {
                let h = kvq::Codec::hadamard(pt);
                build(base().key_codec(h).value_codec(h))
            }),
        ),
        (
            "cache 4b-iq4nl".into(),
            Box::new(move || {
                let c = kvq::presets::iq4_nl();
                build(base().key_codec(c).value_codec(c))
            }),
        ),
        (
            // The same per-token K/V unrotated: what the rotation costs.
            "cache 4b-pt32".into(),
            Box::new(move || build(base().keys(pt).values(pt))),
        ),
        (
            // KIVI-4 with rotated values (per-channel keys as they are).
            "cache 4b-kivi32-HV".into(),
            Box::new(move || build(base().keys(pc).value_codec(kvq::Codec::hadamard(pt)))),
        ),
        (
            // KIVI-4 with keys and values rotated.
            "cache 4b-H-kivi32".into(),
            Box::new(move || {
                build(
                    base()
                        .key_codec(kvq::Codec::hadamard(pc))
                        .value_codec(kvq::Codec::hadamard(pt)),
                )
            }),
        ),
        (
            // The layer the planner picks most at 4.5 bits: 4-bit keys
            // before RoPE in blocks of 128, rotated 4-bit Lloyd-Max values
            // in groups of 64, 4 sinks.
            "cache 4.5b-plan".into(),
            Box::new(move || {
                let rope = kvq::Rope::new(500_000.0, hd, kvq::RopeStyle::Halves);
                let k = QuantScheme::new(4, Axis::PerChannel, Group::Size(128)).unwrap();
                build(
                    base()
                        .keys(k)
                        .value_codec(gauss_in(4, 64))
                        .pre_rope(rope)
                        .sinks(4),
                )
            }),
        ),
        (
            "cache 4b-H-gauss".into(),
            Box::new(move || build(base().key_codec(gauss(4)).value_codec(gauss(4)))),
        ),
        (
            "cache 3b-H-gauss".into(),
            Box::new(move || build(base().key_codec(gauss(3)).value_codec(gauss(3)))),
        ),
        (
            // KIVI-4 with 1 % dense-and-sparse outliers in keys and values:
            // the grid's kernels, then the entries' corrections.
            "cache 4b-kivi32-o1".into(),
            Box::new(move || {
                let o = |s| kvq::Codec::from(s).with_outliers(0.01).unwrap();
                build(base().key_codec(o(pc)).value_codec(o(pt)))
            }),
        ),
        (
            // The same 3.0-bit layer's grids without the outliers.
            "cache 3b-prerope".into(),
            Box::new(move || {
                let rope = kvq::Rope::new(500_000.0, hd, kvq::RopeStyle::Halves);
                let k = QuantScheme::new(2, Axis::PerChannel, Group::Size(128)).unwrap();
                build(base().keys(k).value_codec(gauss(3)).pre_rope(rope))
            }),
        ),
        (
            // 2-bit keys before RoPE in blocks of 128 with 1 % outliers,
            // rotated 3-bit Lloyd-Max values: a 3.0-bit layer.
            "cache 3b-prerope-o1".into(),
            Box::new(move || {
                let rope = kvq::Rope::new(500_000.0, hd, kvq::RopeStyle::Halves);
                let k = QuantScheme::new(2, Axis::PerChannel, Group::Size(128)).unwrap();
                let k = kvq::Codec::from(k).with_outliers(0.01).unwrap();
                build(base().key_codec(k).value_codec(gauss(3)).pre_rope(rope))
            }),
        ),
    ];
    cases.extend(pooled);
    cases
}

/// Lloyd-Max levels at `bits` on symmetric per-token groups of 32, rotated.
fn gauss(bits: u8) -> kvq::Codec {
    gauss_in(bits, 32)
}

/// Lloyd-Max levels at `bits` on symmetric per-token groups of `group`,
/// rotated.
fn gauss_in(bits: u8, group: usize) -> kvq::Codec {
    let s = QuantScheme::new(bits, Axis::PerToken, Group::Size(group))
        .and_then(|s| s.with_mode(kvq::Mode::Symmetric))
        .expect("a valid scheme");
    kvq::Codec::codebook(s, kvq::Levels::Gauss).with_rotation(kvq::Rotation::Hadamard)
}

/// `COLD_BYTES` worth of copies of `first` (at least one, at most 64).
pub fn cold_copies(first: Layer) -> Vec<Layer> {
    let copies = COLD_BYTES.div_ceil(first.bytes()).clamp(1, 64);
    match &first {
        // A clone of a cache shares its pages: each copy is a saved and
        // loaded one, in memory of its own.
        Layer::Cache(c, pool) => {
            let mut b = Vec::new();
            c.save(&mut b).unwrap();
            let (be, threads) = (c.backend(), THREADS);
            (0..copies)
                .map(|_| {
                    let c = match pool {
                        Some(p) => LayerCache::load_in(&b[..], p),
                        None => LayerCache::load_on(&b[..], Some(be), threads),
                    };
                    Layer::Cache(Box::new(c.unwrap()), pool.clone())
                })
                .collect()
        }
        _ => (0..copies).map(|_| first.clone()).collect(),
    }
}

/// The `q`-quantile (0..=1) of `v` (sorted in place).
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The number in the environment variable `name`, if set.
pub fn env_num(name: &str) -> Option<usize> {
    match env_list(name)?[..] {
        [n] => Some(n),
        ref v => panic!("{name}: one number, not {v:?}"),
    }
}

/// The comma-separated numbers in the environment variable `name`, if set.
pub fn env_list(name: &str) -> Option<Vec<usize>> {
    let v = std::env::var(name).ok()?;
    Some(
        v.split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}: comma-separated numbers, not {v:?}"))
            })
            .collect(),
    )
}

/// What a paired run says of one case against its baseline: both timed
/// in the same rounds (ms per call, one entry per round).
pub struct Paired {
    pub min: f64,
    pub median: f64,
    /// Quartiles and median of `baseline time / case time` per round.
    pub ratio_p25: f64,
    pub ratio: f64,
    pub ratio_p75: f64,
    /// Baseline minimum ÷ case minimum.
    pub min_ratio: f64,
}

impl Paired {
    pub fn new(base: &[f64], case: &[f64]) -> Paired {
        let mut ratios: Vec<f64> = base.iter().zip(case).map(|(b, t)| b / t).collect();
        let mut t = case.to_vec();
        let (min, median) = (quantile(&mut t, 0.0), quantile(&mut t, 0.5));
        Paired {
            min,
            median,
            ratio_p25: quantile(&mut ratios, 0.25),
            ratio: quantile(&mut ratios, 0.5),
            ratio_p75: quantile(&mut ratios, 0.75),
            min_ratio: quantile(&mut base.to_vec(), 0.0) / min,
        }
    }
}
