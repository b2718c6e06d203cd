//! The targets. Each runs one input and returns its outcome: `ok …`, or
//! the error's variant and message with digits removed (the fuzzer's
//! novelty signal). A panic is a finding; so is a broken invariant, which
//! is asserted here (a rejected call changed the cache; a round trip was
//! not exact).

use crate::input::Choices;
use kvq::cache::PagePool;
use kvq::{
    Axis, Backend, CacheConfig, Codec, Group, KvCache, KvQuantizer, LayerCache, Levels, Mode,
    PackedBlock, QuantScheme, Rotation, Rounding, ScaleFormat, UniformQuantizer,
};
use kvq_eval::gguf::Gguf;

pub fn run(target: &str, x: &[u8]) -> String {
    match target {
        "block" => block(x),
        "load" => load(x),
        "config" => config(x),
        "ops" => ops(x),
        "gguf" => gguf(x),
        t => panic!("unknown target {t}"),
    }
}

/// The outcome of a result, without its numbers.
fn outcome<T>(r: &Result<T, kvq::Error>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => {
            let s = format!("{e:?}");
            let s: String = s.chars().filter(|c| !c.is_ascii_digit()).collect();
            s.chars().take(120).collect()
        }
    }
}

fn block(x: &[u8]) -> String {
    let r = PackedBlock::from_bytes(x);
    if let Ok(b) = &r {
        let again = PackedBlock::from_bytes(&b.to_bytes()).expect("a block's own bytes load");
        assert!(&again == b, "to_bytes ∘ from_bytes is not the identity");
        let l = b.layout();
        let mut out = vec![0f32; b.tokens() * l.n_kv_heads() * l.head_dim()];
        b.dequantize_into(&mut out)
            .expect("a loaded block dequantizes");
    }
    outcome(&r)
}

fn load(x: &[u8]) -> String {
    let r = LayerCache::load(x);
    if let Ok(c) = &r {
        let mut b = Vec::new();
        c.save(&mut b).expect("saving to memory");
        let back = LayerCache::load(&b[..]).expect("a cache's own bytes load");
        assert!(&back == c, "save ∘ load is not the identity");
        if !c.is_empty() {
            let hd = c.config().head_dim();
            let n = c.config().n_kv_heads();
            let q = vec![0.5f32; n * hd];
            let mut out = vec![0f32; n * hd];
            c.attend(&q, n, &mut out).expect("a loaded cache attends");
            assert!(out.iter().all(|v| v.is_finite()), "non-finite attention");
        }
    }
    let m = KvCache::load(x);
    format!("{} / {}", outcome(&r), outcome(&m))
}

fn scheme(c: &mut Choices) -> Result<QuantScheme, kvq::Error> {
    let bits = if c.u8() < 240 {
        c.below(10) as u8
    } else {
        c.u8()
    };
    let axis = c.pick(&[Axis::PerToken, Axis::PerChannel]);
    let group = match c.below(4) {
        0 => Group::Head,
        1 => Group::Vector,
        _ => Group::Size(c.pick(&[0, 1, 7, 8, 16, 24, 32, 64, 128, 1 << 33, usize::MAX])),
    };
    let mode = c.pick(&[Mode::Asymmetric, Mode::Symmetric]);
    let fmt = c.pick(&[ScaleFormat::F16, ScaleFormat::Bf16, ScaleFormat::F32]);
    let rounding = c.pick(&[Rounding::Grid, Rounding::Grid, Rounding::Ggml]);
    QuantScheme::new(bits, axis, group)?
        .with_mode(mode)?
        .with_scale_format(fmt)
        .with_rounding(rounding)
}

fn codec(c: &mut Choices) -> Option<Codec> {
    match c.below(3) {
        0 => None,
        _ => {
            let s = scheme(c).ok()?;
            Some(
                levels(c, s)
                    .with_rotation(c.pick(&[Rotation::None, Rotation::Hadamard]))
                    .with_int8_kernels(c.u8() > 200),
            )
        }
    }
}

/// The uniform grid of `s` or, more than one time in three, a codebook
/// on its storage (which the cache rejects unless `s` fits it): a fixed
/// table, or a fitted one of arbitrary levels (which `FittedLevels::new`
/// may refuse).
fn levels(c: &mut Choices, s: QuantScheme) -> Codec {
    match c.below(9) {
        0 => Codec::codebook(s, Levels::Iq4Nl),
        1 => Codec::codebook(s, Levels::Nf4),
        2 => Codec::codebook(s, Levels::Gauss),
        3 => Codec::codebook(s, Levels::E4m3),
        4 => Codec::codebook(s, Levels::E5m2),
        5 => {
            let n = c.pick(&[3usize, 4, 8, 16]);
            let mut x = c.u8() as f32 / 64.0 - 2.0;
            let levels: Vec<f32> = (0..n)
                .map(|_| {
                    x += c.pick(&[-0.1f32, 0.0, 1e-5, 0.3, 1.0, f32::NAN]);
                    x
                })
                .collect();
            match kvq::FittedLevels::new(&levels) {
                Ok(f) => Codec::codebook(s, Levels::Fitted(f)),
                Err(_) => Codec::uniform(s),
            }
        }
        _ => Codec::uniform(s),
    }
}

fn backend(c: &mut Choices) -> Backend {
    let a = Backend::available();
    a[c.below(a.len())]
}

/// Arbitrary parameters into every constructor; a cache that builds gets
/// a few tokens and an attend.
fn config(x: &[u8]) -> String {
    let mut c = Choices::new(x);
    let shapes = [0, 1, 2, 3, 4, 8, 65_537, 1 << 31, usize::MAX];
    let dims = [
        0,
        7,
        8,
        16,
        24,
        64,
        80,
        96,
        128,
        256,
        1000,
        65_544,
        usize::MAX,
    ];
    let (n_kv, hd) = (c.pick(&shapes), c.pick(&dims));
    let s = scheme(&mut c);
    let mut tag = outcome(&s);
    if let Ok(s) = s {
        tag += &outcome(&s.layout(n_kv, hd));
        if n_kv <= 8 && hd <= 256 {
            let q = UniformQuantizer::new(s, n_kv, hd);
            tag += &outcome(&q);
            if let Ok(q) = q {
                let t = c.count(5);
                let data: Vec<f32> = (0..(n_kv * hd * 3)).map(|_| c.value()).collect();
                tag += &outcome(&q.quantize(&data, t));
                tag += &outcome(&Codec::hadamard(s).roundtrip(&data, n_kv, hd));
            }
        }
    }
    let cfg = CacheConfig::new(n_kv, hd)
        .key_codec(codec(&mut c))
        .value_codec(codec(&mut c))
        .residual(c.count(40))
        .sinks(c.count(6))
        .softmax_scale(c.pick(&[0.125, 1.0, f32::NAN, f32::INFINITY, 0.0, -1.0]))
        .pre_rope(rope(&mut c, hd, true))
        .backend(backend(&mut c))
        .threads(c.below(3));
    let cache = LayerCache::new(cfg);
    tag += &outcome(&cache);
    if let Ok(mut cache) = cache {
        let w = n_kv * hd;
        for _ in 0..c.below(6) {
            let k: Vec<f32> = (0..w).map(|_| c.value()).collect();
            let v: Vec<f32> = (0..w).map(|_| c.value()).collect();
            tag += &outcome(&cache.append(&k, &v));
        }
        if !cache.is_empty() {
            let q: Vec<f32> = (0..w).map(|_| c.value()).collect();
            let mut out = vec![0f32; w];
            tag += &outcome(&cache.attend(&q, n_kv, &mut out));
        }
    }
    tag
}

/// No RoPE (most often), a valid one of either pairing (full or partial
/// rotary, scaled or not), or with `bad` also invalid parameters.
fn rope(c: &mut Choices<'_>, hd: usize, bad: bool) -> Option<kvq::Rope> {
    use kvq::{Rope, RopeScaling, RopeStyle};
    if c.below(3) != 0 {
        return None;
    }
    let style = c.pick(&[RopeStyle::Halves, RopeStyle::Adjacent]);
    let dims = if bad {
        c.pick(&[hd, hd / 2, 0, hd.saturating_add(2), 3])
    } else {
        c.pick(&[hd, hd / 2])
    };
    let base = if bad {
        c.pick(&[1e4, 5e5, 1.0, f64::NAN])
    } else {
        c.pick(&[1e4, 5e5])
    };
    let scaling = c.pick(&[
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
    ]);
    Some(Rope::new(base, dims, style).with_scaling(scaling))
}

/// A cache of a valid configuration (outside a pool or in one, of any
/// page size and capacity) under a sequence of calls with arbitrary
/// lengths, shapes and values. A rejected call must leave the cache as it
/// was; once the cache is gone, the pool must hold nothing.
fn ops(x: &[u8]) -> String {
    let mut c = Choices::new(x);
    let (n_kv, hd) = (c.pick(&[1, 2, 3]), c.pick(&[8, 16, 32, 64, 80]));
    let s = scheme(&mut c).ok();
    let s2 = scheme(&mut c).ok();
    let rot = c.pick(&[Rotation::None, Rotation::Hadamard]);
    let cfg = CacheConfig::new(n_kv, hd)
        .key_codec(s.map(|s| levels(&mut c, s).with_rotation(rot)))
        .value_codec(s2.map(|s| levels(&mut c, s)))
        .residual(c.pick(&[0, 1, 5, 16, usize::MAX]))
        .sinks(c.pick(&[0, 1, 4]))
        .pre_rope(rope(&mut c, hd, false))
        .backend(backend(&mut c))
        .threads(c.below(3));
    let pool = match c.below(3) {
        0 => None,
        _ => {
            let page = c.pick(&[1, 7, 64, 4096]);
            let cap = c.pick(&[None, Some(0), Some(1 << 12), Some(1 << 16), Some(1 << 20)]);
            Some(PagePool::new(page, cap).expect("a valid page size"))
        }
    };
    let made = match &pool {
        Some(p) => LayerCache::new_in(cfg, p),
        None => LayerCache::new(cfg),
    };
    let Ok(mut cache) = made else {
        return "config rejected".into();
    };
    let w = n_kv * hd;
    let trace = std::env::var_os("KVQ_FUZZ_TRACE").is_some();
    if trace {
        eprintln!("config {cfg:?}");
    }
    let mut tag = String::new();
    let mut steps = 0;
    while !c.exhausted() && steps < 24 {
        steps += 1;
        let before = cache.clone();
        let r: Result<(), kvq::Error> = match c.below(9) {
            0 | 1 => {
                let n = if c.u8() < 230 { w } else { c.count(3 * w) };
                let k: Vec<f32> = (0..n.min(4 * w)).map(|_| c.value()).collect();
                let v: Vec<f32> = (0..n.min(4 * w)).map(|_| c.value()).collect();
                if trace {
                    eprintln!("append: v = {v:?}");
                }
                cache.append(&k, &v)
            }
            2 => {
                let t = c.below(70);
                let extra = if c.u8() < 240 { 0 } else { 1 + c.below(5) };
                let k: Vec<f32> = (0..t * w + extra).map(|_| c.value()).collect();
                let v: Vec<f32> = (0..t * w).map(|_| c.value()).collect();
                let v = if extra > 0 && c.u8() < 128 {
                    k.clone()
                } else {
                    v
                };
                if trace {
                    eprintln!("extend {t} tokens (+{extra}): v = {v:?}");
                }
                cache.extend(&k, &v)
            }
            3 => {
                let (t, h, d) = (
                    c.below(5),
                    c.pick(&[n_kv, 1, n_kv + 1]),
                    c.pick(&[hd, 8, hd + 8]),
                );
                let k = ndarray::Array3::from_shape_fn((t, h, d), |_| c.value());
                let v = ndarray::Array3::from_shape_fn((t, h, d), |_| c.value());
                if c.u8() < 128 {
                    cache.extend_view3(k.view(), v.view())
                } else {
                    let (kt, vt) = (k.view().reversed_axes(), v.view().reversed_axes());
                    let kp = kt.permuted_axes([2, 1, 0]);
                    let vp = vt.permuted_axes([2, 1, 0]);
                    cache.extend_view3(kp, vp)
                }
            }
            4 => {
                let nq = c.pick(&[n_kv, 2 * n_kv, 4 * n_kv, 0, n_kv + 1, usize::MAX / 2]);
                let ql = if c.u8() < 230 {
                    nq.saturating_mul(hd).min(64 * w)
                } else {
                    c.count(8 * w) % (64 * w)
                };
                let q: Vec<f32> = (0..ql).map(|_| c.value()).collect();
                let ol = if c.u8() < 240 { ql } else { c.below(ql + 2) };
                let mut out = vec![0f32; ol];
                cache.attend(&q, nq, &mut out)
            }
            5 => {
                let n = c.below(cache.len() + 2);
                let nq = c.pick(&[n_kv, 2 * n_kv]);
                let q: Vec<f32> = (0..n * nq * hd).map(|_| c.value()).collect();
                let mut out = vec![0f32; q.len()];
                let win = c.pick(&[None, Some(0), Some(1), Some(7), Some(usize::MAX)]);
                cache.attend_causal(&q, nq, &mut out, win)
            }
            6 => {
                let n = if c.u8() < 200 {
                    c.below(cache.len() + 1)
                } else {
                    c.count(1 << 20)
                };
                cache.truncate(n)
            }
            7 => {
                // Go on with a fork: it must be the same cache.
                let f = cache.fork();
                assert!(f == cache, "a fork differs from its parent");
                cache = f;
                Ok(())
            }
            _ => {
                let mut b = Vec::new();
                cache.save(&mut b).expect("saving to memory");
                let back = match &pool {
                    Some(p) => match LayerCache::load_in(&b[..], p) {
                        // `before` and `cache` hold the pages; a copy may
                        // not fit.
                        Err(kvq::Error::PoolExhausted { .. }) => cache.clone(),
                        r => r.expect("a cache's own bytes load"),
                    },
                    None => LayerCache::load(&b[..]).expect("a cache's own bytes load"),
                };
                assert!(back == cache, "save ∘ load is not the identity");
                cache = back;
                Ok(())
            }
        };
        if trace {
            eprintln!(
                "step {steps}: len {} -> {}: {r:?}",
                before.len(),
                cache.len()
            );
        }
        if r.is_err() {
            assert!(cache == before, "a rejected call changed the cache: {r:?}");
        }
        tag += &outcome(&r);
        let keep = tag.char_indices().nth(400).map_or(tag.len(), |(i, _)| i);
        tag.truncate(keep);
    }
    drop(cache);
    if let Some(p) = pool {
        let s = p.stats();
        assert!(
            s.pages == 0 && s.used == 0 && s.stored == 0,
            "pages left in the pool: {s:?}"
        );
    }
    tag
}

fn gguf(x: &[u8]) -> String {
    match Gguf::parse(x.to_vec()) {
        Ok(g) => {
            let mut tag = format!("ok {} tensors", g.tensors.len().min(3));
            for (k, _) in g.metadata.iter().take(8) {
                let _ = g.get_usize(k);
                let _ = g.get_f64(k);
                let _ = g.get_str(k);
                let _ = g.get_str_array(k);
            }
            let names: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
            for n in names.iter().take(4) {
                let t = g.tensor(n).expect("listed tensor");
                if t.n_elements() <= 1 << 20 {
                    tag += if g.dequantize(n).is_ok() {
                        " deq"
                    } else {
                        " deq-err"
                    };
                }
            }
            tag
        }
        Err(e) => {
            let s = format!("{e:?}");
            s.chars().filter(|c| !c.is_ascii_digit()).take(60).collect()
        }
    }
}
