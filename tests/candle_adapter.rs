//! The candle adapters (features `candle`, `mistralrs`; the evaluation
//! crate turns them on, so `cargo test` runs these): tensors in either
//! layout and dtype give exactly what the slice API gives, bad tensors are
//! errors that leave the cache untouched, and mistral.rs's trait decodes
//! fused.
#![cfg(feature = "mistralrs")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::Rng;
use kvq::cache::PagePool;
use kvq::mistralrs::KvqCache;
use kvq::{presets, CacheConfig, Error, LayerCache};
use mistralrs_kv_cache::{AttendConfig, CompressedKVCache, DecodeOutput};

const N_KV: usize = 2;
const HD: usize = 32;
const W: usize = N_KV * HD;

fn config() -> CacheConfig {
    let (k, v) = presets::kivi(4).unwrap();
    CacheConfig::new(N_KV, HD)
        .keys(k)
        .values(v)
        .residual(8)
        .sinks(2)
}

/// `rows` (`[n, heads·HD]`) as a tensor `[n, heads, HD]` or `[1, heads, n,
/// HD]`, of `dtype`.
fn tensor(rows: &[f32], heads: usize, heads_first: bool, dtype: DType) -> Tensor {
    let n = rows.len() / (heads * HD);
    let t = Tensor::from_vec(rows.to_vec(), (n, heads, HD), &Device::Cpu).unwrap();
    let t = if heads_first {
        t.transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .unsqueeze(0)
            .unwrap()
    } else {
        t
    };
    t.to_dtype(dtype).unwrap()
}

/// `rows` rounded through `dtype`, as the slice API would take them.
fn through(rows: &[f32], dtype: DType) -> Tensor {
    Tensor::from_vec(rows.to_vec(), rows.len(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn tensors_in_either_layout_and_dtype_equal_the_slice_api() {
    let mut rng = Rng::new(1);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for heads_first in [false, true] {
            let (k, v) = (rng.vec(300 * W), rng.vec(300 * W));
            let mut a = LayerCache::new(config()).unwrap();
            a.append_tensor(
                &tensor(&k[..299 * W], N_KV, heads_first, dtype),
                &tensor(&v[..299 * W], N_KV, heads_first, dtype),
            )
            .unwrap();
            a.append_tensor(
                &tensor(&k[299 * W..], N_KV, heads_first, dtype),
                &tensor(&v[299 * W..], N_KV, heads_first, dtype),
            )
            .unwrap();
            // The slice API on the same numbers (rounded to the dtype).
            let mut b = LayerCache::new(config()).unwrap();
            let (kr, vr) = (f32s(&through(&k, dtype)), f32s(&through(&v, dtype)));
            b.extend(&kr, &vr).unwrap();
            assert!(a == b, "{dtype:?} heads_first {heads_first}");
            for n in [1, 5] {
                let q = rng.vec(n * 8 * HD);
                let qt = tensor(&q, 8, heads_first, dtype);
                let got = a.attend_causal_tensor(&qt, Some(100)).unwrap();
                assert_eq!(got.dims(), qt.dims());
                assert_eq!(got.dtype(), dtype);
                let mut want = vec![0.0; q.len()];
                b.attend_causal(&f32s(&through(&q, dtype)), 8, &mut want, Some(100))
                    .unwrap();
                // Back in the query's layout and dtype.
                let want = tensor(&want, 8, heads_first, dtype);
                assert_eq!(f32s(&got), f32s(&want), "{dtype:?} {heads_first} n {n}");
            }
            // What attention reads, in candle's layout.
            let kt = a.keys_tensor().unwrap();
            assert_eq!(kt.dims(), &[1, N_KV, 300, HD]);
            assert_eq!(
                f32s(&kt),
                f32s(&tensor(&a.keys_f32(), N_KV, true, DType::F32))
            );
            assert_eq!(
                f32s(&a.values_tensor().unwrap()),
                f32s(&tensor(&a.values_f32(), N_KV, true, DType::F32))
            );
        }
    }
}

#[test]
fn bad_tensors_are_errors_and_leave_the_cache_as_it_was() {
    let mut rng = Rng::new(2);
    let mut c = LayerCache::new(config()).unwrap();
    let (k, v) = (rng.vec(20 * W), rng.vec(20 * W));
    c.append_tensor(
        &tensor(&k, N_KV, true, DType::F32),
        &tensor(&v, N_KV, true, DType::F32),
    )
    .unwrap();
    let before = c.clone();
    let good = tensor(&rng.vec(W), N_KV, true, DType::F32);
    let dev = Device::Cpu;
    let cases: Vec<(&str, Tensor, Tensor)> = vec![
        (
            "dtype f64",
            good.to_dtype(DType::F64).unwrap(),
            good.to_dtype(DType::F64).unwrap(),
        ),
        (
            "dtype u8",
            good.to_dtype(DType::U8).unwrap(),
            good.to_dtype(DType::U8).unwrap(),
        ),
        (
            "k/v dtypes differ",
            good.clone(),
            good.to_dtype(DType::F16).unwrap(),
        ),
        (
            "batch 2",
            Tensor::zeros((2, N_KV, 1, HD), DType::F32, &dev).unwrap(),
            Tensor::zeros((2, N_KV, 1, HD), DType::F32, &dev).unwrap(),
        ),
        (
            "heads",
            Tensor::zeros((1, 3, 1, HD), DType::F32, &dev).unwrap(),
            Tensor::zeros((1, 3, 1, HD), DType::F32, &dev).unwrap(),
        ),
        (
            "rank 2",
            Tensor::zeros((1, W), DType::F32, &dev).unwrap(),
            Tensor::zeros((1, W), DType::F32, &dev).unwrap(),
        ),
        (
            "token counts differ",
            tensor(&rng.vec(2 * W), N_KV, true, DType::F32),
            good.clone(),
        ),
        (
            "layouts differ",
            tensor(&rng.vec(W), N_KV, false, DType::F32),
            good.clone(),
        ),
        (
            "not contiguous",
            Tensor::zeros((N_KV, 4, HD), DType::F32, &dev)
                .unwrap()
                .transpose(0, 1)
                .unwrap(),
            Tensor::zeros((N_KV, 4, HD), DType::F32, &dev)
                .unwrap()
                .transpose(0, 1)
                .unwrap(),
        ),
        ("NaN", (good.clone() * f64::NAN).unwrap(), good.clone()),
    ];
    for (what, k, v) in cases {
        let e = c.append_tensor(&k, &v).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument { .. }
                    | Error::InvalidShape { .. }
                    | Error::NonFinite { .. }
            ),
            "{what}: {e}"
        );
        assert!(c == before, "{what}: the cache changed");
    }
    let qs = [
        Tensor::zeros((1, 4, 1, HD + 1), DType::F32, &dev).unwrap(),
        Tensor::zeros((1, 3, 1, HD), DType::F32, &dev).unwrap(),
        Tensor::zeros((4, HD), DType::F32, &dev).unwrap(),
        Tensor::zeros((1, 4, 1, HD), DType::I64, &dev).unwrap(),
    ];
    for q in &qs {
        assert!(
            c.attend_tensor(q).is_err(),
            "{:?} {:?}",
            q.dims(),
            q.dtype()
        );
    }
    // A query longer than the cache is the slice API's error.
    let long = Tensor::zeros((1, 4, 21, HD), DType::F32, &dev).unwrap();
    assert!(c.attend_tensor(&long).is_err());
}

#[test]
fn mistralrs_trait_prefills_and_decodes_fused() {
    let mut rng = Rng::new(3);
    let layers = 3;
    let cache = KvqCache::uniform(layers, config()).unwrap();
    let mut shadow: Vec<LayerCache> = (0..layers)
        .map(|_| LayerCache::new(config()).unwrap())
        .collect();
    let n_q = 4;
    let cfg = AttendConfig {
        softmax_scale: 1.0 / (HD as f32).sqrt(),
        n_kv_groups: n_q / N_KV,
    };
    for (l, s) in shadow.iter_mut().enumerate() {
        let (k, v, q) = (rng.vec(40 * W), rng.vec(40 * W), rng.vec(40 * n_q * HD));
        let r = cache
            .prefill(
                l,
                &tensor(&k, N_KV, true, DType::F16),
                &tensor(&v, N_KV, true, DType::F16),
                &tensor(&q, n_q, true, DType::F16),
            )
            .unwrap();
        s.extend(
            &f32s(&through(&k, DType::F16)),
            &f32s(&through(&v, DType::F16)),
        )
        .unwrap();
        assert_eq!(r.k.dims(), &[1, N_KV, 40, HD]);
        assert_eq!(r.k.dtype(), DType::F16);
        assert_eq!(
            f32s(&r.k),
            f32s(&tensor(&s.keys_f32(), N_KV, true, DType::F16))
        );
        assert_eq!(
            f32s(&r.v),
            f32s(&tensor(&s.values_f32(), N_KV, true, DType::F16))
        );
        assert!(r.logit_bias.is_none());
    }
    // Decode steps on every layer from threads at once.
    for _ in 0..20 {
        let steps: Vec<_> = (0..layers)
            .map(|_| (rng.vec(W), rng.vec(W), rng.vec(n_q * HD)))
            .collect();
        std::thread::scope(|s| {
            for (l, (k, v, q)) in steps.iter().enumerate() {
                let cache = &cache;
                let cfg = &cfg;
                s.spawn(move || {
                    let out = cache
                        .decode(
                            l,
                            &tensor(k, N_KV, true, DType::F32),
                            &tensor(v, N_KV, true, DType::F32),
                            &tensor(q, n_q, true, DType::F32),
                            cfg,
                        )
                        .unwrap();
                    let DecodeOutput::Fused(out) = out else {
                        panic!("layer {l}: kvq decodes fused")
                    };
                    assert_eq!(out.dims(), &[1, n_q, 1, HD]);
                });
            }
        });
        for (l, (k, v, q)) in steps.iter().enumerate() {
            shadow[l].append(k, v).unwrap();
            assert!(*cache.layer(l).unwrap() == shadow[l], "layer {l}");
            // The fused output is the slice API's attend.
            let mut want = vec![0.0; q.len()];
            shadow[l].attend(q, n_q, &mut want).unwrap();
            let got = cache
                .layer(l)
                .unwrap()
                .attend_tensor(&tensor(q, n_q, true, DType::F32))
                .unwrap();
            assert_eq!(f32s(&got), want);
        }
    }
    assert_eq!(cache.seq_len(1), 60);
    assert_eq!(
        cache.memory_usage(),
        shadow.iter().map(|s| s.bytes().total()).sum::<usize>()
    );
    // Rejected decodes leave the layer as it was.
    let (k, v) = (
        tensor(&rng.vec(W), N_KV, true, DType::F32),
        tensor(&rng.vec(W), N_KV, true, DType::F32),
    );
    let q = tensor(&rng.vec(n_q * HD), n_q, true, DType::F32);
    let bad_groups = AttendConfig {
        n_kv_groups: 3,
        ..cfg
    };
    let bad_scale = AttendConfig {
        softmax_scale: 0.5,
        ..cfg
    };
    let nan_q = (q.clone() * f64::NAN).unwrap();
    assert!(cache.decode(0, &k, &v, &q, &bad_groups).is_err());
    assert!(cache.decode(0, &k, &v, &q, &bad_scale).is_err());
    assert!(cache.decode(0, &k, &v, &nan_q, &cfg).is_err());
    assert!(cache.decode(7, &k, &v, &q, &cfg).is_err());
    assert!(*cache.layer(0).unwrap() == shadow[0]);
    cache.reset().unwrap();
    assert_eq!((cache.seq_len(0), cache.memory_usage()), (0, 0));
}

#[test]
fn mistralrs_sequences_share_one_page_pool() {
    let cfg = config();
    let pool = PagePool::new(64, Some(2 * cfg.page_bytes(64).unwrap())).unwrap();
    let mut rng = Rng::new(9);
    let (k, v, q) = (rng.vec(100 * W), rng.vec(100 * W), rng.vec(100 * 4 * HD));
    let (k, v, q) = (
        tensor(&k, N_KV, true, DType::F32),
        tensor(&v, N_KV, true, DType::F32),
        tensor(&q, 4, true, DType::F32),
    );
    let a = KvqCache::new_in([cfg], &pool).unwrap();
    let b = KvqCache::new_in([cfg], &pool).unwrap();
    a.prefill(0, &k, &v, &q).unwrap();
    // 100 tokens, 2 sinks, a window of 8: one page of keys (two blocks of
    // 32) and two of values.
    assert_eq!(pool.stats().pages, 3);
    // The second sequence does not fit, and is left empty.
    assert!(b.prefill(0, &k, &v, &q).is_err());
    assert_eq!(b.seq_len(0), 0);
    assert_eq!(pool.stats().pages, 3);
    drop(a);
    b.prefill(0, &k, &v, &q).unwrap();
    assert_eq!(pool.stats().pages, 3);
}
