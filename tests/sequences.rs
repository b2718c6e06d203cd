//! What an engine does to a sequence besides appending: truncate
//! (rollback), fork, save and load — against a shadow that keeps every
//! token in f32, and against hostile bytes.

mod common;

use common::{attend, checksum, max_abs_diff, reseal, Rng};
use kvq::cache::{attend_batch, dense_attention, resident_bytes};
use kvq::{
    presets, Axis, Backend, CacheConfig, Codec, Error, Group, KvCache, LayerCache, Mode,
    QuantScheme, Rounding,
};
use proptest::prelude::*;

const N_KV: usize = 2;
const HD: usize = 64;
const W: usize = N_KV * HD;

fn scheme(bits: u8, axis: Axis, group: Group) -> QuantScheme {
    QuantScheme::new(bits, axis, group).unwrap()
}

/// Configurations that reach every storage path: full precision, per-token
/// and per-channel packing with and without residual window and sinks,
/// shared params, rotation, ggml rounding, int8 kernels, "keep everything".
fn configs() -> Vec<(&'static str, CacheConfig)> {
    let base = CacheConfig::new(N_KV, HD);
    let (k4, v4) = presets::kivi(4).unwrap();
    let pc2 = scheme(2, Axis::PerChannel, Group::Size(16));
    let pt8 = scheme(8, Axis::PerToken, Group::Size(32));
    let vec8 = scheme(8, Axis::PerToken, Group::Vector)
        .with_mode(Mode::Symmetric)
        .unwrap();
    vec![
        ("full precision", base),
        ("kivi-4", base.keys(k4).values(v4)),
        (
            "kivi-4 r16 s3",
            base.keys(k4).values(v4).residual(16).sinks(3),
        ),
        ("k2 pc16 / full v, s2", base.keys(pc2).sinks(2)),
        ("pt8 r5", base.keys(pt8).values(pt8).residual(5)),
        (
            "H·k4 / H·v4",
            base.key_codec(Codec::hadamard(k4))
                .value_codec(Codec::hadamard(v4))
                .residual(7),
        ),
        ("q4_0", base.keys(presets::q4_0()).values(presets::q4_0())),
        ("vector 8-bit sym", base.keys(vec8).values(vec8).sinks(1)),
        (
            "int8 kernels, scale",
            base.keys(pt8)
                .values(pt8)
                .int8_kernels(true)
                .softmax_scale(0.1),
        ),
        (
            "residual max",
            base.keys(k4).values(v4).residual(usize::MAX),
        ),
    ]
}

/// Keys and values of `n` random tokens.
fn tokens(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<f32>) {
    (rng.vec(n * W), rng.vec(n * W))
}

fn scale(c: &LayerCache) -> f32 {
    let s = 1.0 / (HD as f32).sqrt();
    // The one configuration above that sets its own.
    if c.config().uses_int8_kernels() {
        0.1
    } else {
        s
    }
}

fn saved(c: &LayerCache) -> Vec<u8> {
    let mut b = Vec::new();
    c.save(&mut b).unwrap();
    assert_eq!(b.len(), c.saved_bytes());
    b
}

#[test]
fn truncate_keeps_the_kept_tokens_exactly() {
    let mut rng = Rng::new(7);
    for (name, cfg) in configs() {
        for cut in [0, 1, 2, 3, 5, 16, 17, 31, 32, 33, 47, 64, 70, 99, 100] {
            let mut c = LayerCache::new(cfg).unwrap();
            let (k, v) = tokens(&mut rng, 100);
            c.extend(&k, &v).unwrap();
            let (bk, bv) = (c.keys_f32(), c.values_f32());
            c.truncate(cut).unwrap();
            // Sinks and packed tokens keep their values from here on;
            // full-precision ones until their unit is quantized.
            let fixed = [
                cut.min(cfg.sink_len()) + c.packed_len().0,
                cut.min(cfg.sink_len()) + c.packed_len().1,
            ];
            assert_eq!(c.len(), cut, "{name} cut {cut}");
            assert_eq!(c.keys_f32(), bk[..cut * W], "{name} cut {cut}: keys");
            assert_eq!(c.values_f32(), bv[..cut * W], "{name} cut {cut}: values");
            // What attention reads is what the cache now holds, also after
            // more tokens arrive (positions, windows and blocks line up).
            let (k2, v2) = tokens(&mut rng, 45);
            c.extend(&k2, &v2).unwrap();
            assert_eq!(
                c.keys_f32()[..fixed[0] * W],
                bk[..fixed[0] * W],
                "{name} cut {cut}"
            );
            assert_eq!(
                c.values_f32()[..fixed[1] * W],
                bv[..fixed[1] * W],
                "{name} cut {cut}"
            );
            let q = rng.vec(4 * HD);
            let want = dense_attention(&q, 4, &c.keys_f32(), &c.values_f32(), N_KV, HD, scale(&c));
            let got = attend(&c, &q, 4);
            // The int8 kernels round the query too.
            let tol = if c.config().uses_int8_kernels() {
                2e-2
            } else {
                2e-4
            };
            assert!(
                max_abs_diff(&got, &want) < tol,
                "{name} cut {cut}: {}",
                max_abs_diff(&got, &want)
            );
        }
    }
}

#[test]
fn a_truncated_full_precision_cache_is_the_shorter_cache() {
    let mut rng = Rng::new(8);
    let cfg = CacheConfig::new(N_KV, HD).sinks(3);
    for cut in [0, 2, 3, 4, 128] {
        let (k, v) = tokens(&mut rng, 130);
        let mut c = LayerCache::new(cfg).unwrap();
        c.extend(&k[..128 * W], &v[..128 * W]).unwrap();
        c.append(&k[128 * W..129 * W], &v[128 * W..129 * W])
            .unwrap();
        c.append(&k[129 * W..], &v[129 * W..]).unwrap();
        c.truncate(cut).unwrap();
        let mut fresh = LayerCache::new(cfg).unwrap();
        fresh.extend(&k[..cut * W], &v[..cut * W]).unwrap();
        assert!(c == fresh, "cut {cut}");
        assert_eq!(saved(&c), saved(&fresh), "cut {cut}");
    }
}

#[test]
fn a_rejected_truncate_changes_nothing() {
    let mut rng = Rng::new(9);
    for (name, cfg) in configs() {
        let mut c = LayerCache::new(cfg).unwrap();
        let (k, v) = tokens(&mut rng, 40);
        c.extend(&k, &v).unwrap();
        let before = saved(&c);
        let e = c.truncate(41);
        assert!(
            matches!(e, Err(Error::InvalidArgument { .. })),
            "{name}: {e:?}"
        );
        assert_eq!(saved(&c), before, "{name}");
    }
    let cfg = CacheConfig::new(N_KV, HD);
    let mut m = KvCache::uniform(3, cfg).unwrap();
    let (k, v) = tokens(&mut rng, 10);
    for i in 0..3 {
        m.layer_mut(i)
            .extend(&k[..(8 + i) * W], &v[..(8 + i) * W])
            .unwrap();
    }
    // Layer 0 holds only 8: no layer is cut.
    assert!(m.truncate(9).is_err());
    assert_eq!((m.layer(1).len(), m.layer(2).len()), (9, 10));
    m.truncate(8).unwrap();
    assert!(m.layers().iter().all(|l| l.len() == 8));
}

#[test]
fn save_and_load_round_trip_bit_exactly() {
    let mut rng = Rng::new(10);
    for (name, cfg) in configs() {
        for n in [0, 1, 3, 40, 100] {
            let mut c = LayerCache::new(cfg).unwrap();
            let (k, v) = tokens(&mut rng, n);
            c.extend(&k, &v).unwrap();
            if n == 100 {
                c.truncate(77).unwrap();
            }
            let b = saved(&c);
            let back = LayerCache::load(&b[..]).unwrap();
            assert!(back == c, "{name} n {n}");
            if !c.is_empty() {
                let q = rng.vec(2 * HD);
                assert_eq!(attend(&back, &q, 2), attend(&c, &q, 2), "{name} n {n}");
            }
            // The loaded cache goes on as the original would.
            let (k2, v2) = tokens(&mut rng, 20);
            let (mut a, mut b2) = (c.clone(), back);
            a.extend(&k2, &v2).unwrap();
            b2.extend(&k2, &v2).unwrap();
            assert!(a == b2, "{name} n {n}: after more tokens");
        }
    }
}

#[test]
fn a_whole_model_round_trips_with_its_mixed_layers() {
    let mut rng = Rng::new(11);
    let cfgs: Vec<CacheConfig> = configs().into_iter().map(|(_, c)| c).collect();
    let mut m = KvCache::new(cfgs).unwrap();
    let (k, v) = tokens(&mut rng, 50);
    for i in 0..m.n_layers() {
        m.layer_mut(i).extend(&k, &v).unwrap();
    }
    let mut b = Vec::new();
    m.save(&mut b).unwrap();
    assert_eq!(b.len(), m.saved_bytes());
    for backend in common::backends() {
        let back = KvCache::load_on(&b[..], Some(backend), 1).unwrap();
        assert_eq!(back.n_layers(), m.n_layers());
        for (x, y) in back.layers().iter().zip(m.layers()) {
            assert_eq!(saved(x), saved(y));
            assert_eq!(x.backend(), backend);
        }
    }
    // A model stream is not a layer stream, and the other way round.
    assert!(matches!(
        LayerCache::load(&b[..]),
        Err(Error::Malformed { .. })
    ));
    let l = saved(m.layer(1));
    assert!(matches!(
        KvCache::load(&l[..]),
        Err(Error::Malformed { .. })
    ));
}

#[test]
fn a_fork_is_independent_of_its_parent() {
    let mut rng = Rng::new(12);
    for (name, cfg) in configs() {
        let mut parent = LayerCache::new(cfg).unwrap();
        let (k, v) = tokens(&mut rng, 60);
        parent.extend(&k, &v).unwrap();
        let before = saved(&parent);
        let mut child = parent.clone();
        child.truncate(30).unwrap();
        let (k2, v2) = tokens(&mut rng, 50);
        child.extend(&k2, &v2).unwrap();
        assert_eq!(saved(&parent), before, "{name}");
        assert_eq!(child.len(), 80, "{name}");
    }
}

// ---------------------------------------------------------------------
// Hostile bytes.

fn put_u64(b: &mut [u8], at: usize, x: u64) {
    b[at..at + 8].copy_from_slice(&x.to_le_bytes());
}

fn malformed(b: &[u8]) -> String {
    match LayerCache::load(b) {
        Err(Error::Malformed { what, .. }) => what,
        r => panic!("expected Malformed, got {:?}", r.map(|c| c.len())),
    }
}

/// Offsets: stream header 16, layer header 72 (len at 24), then the key
/// tensor's row counts.
const LEN_AT: usize = 16 + 24;
const K_ROWS_AT: usize = 16 + 72;

fn sample() -> (LayerCache, Vec<u8>) {
    let mut rng = Rng::new(13);
    let (k4, v4) = presets::kivi(4).unwrap();
    let cfg = CacheConfig::new(N_KV, HD)
        .keys(k4)
        .values(v4)
        .residual(8)
        .sinks(2);
    let mut c = LayerCache::new(cfg).unwrap();
    let (k, v) = tokens(&mut rng, 45);
    c.extend(&k, &v).unwrap();
    let b = saved(&c);
    (c, b)
}

#[test]
fn the_sample_checksum_is_the_documented_one() {
    let (_, b) = sample();
    let n = b.len() - 8;
    assert_eq!(b[n..], checksum(&b[..n]).to_le_bytes());
}

#[test]
fn every_truncated_stream_is_rejected() {
    let (_, b) = sample();
    for n in 0..b.len() {
        assert!(
            LayerCache::load(&b[..n]).is_err(),
            "{n} of {} bytes",
            b.len()
        );
    }
}

#[test]
fn every_flipped_bit_is_rejected() {
    let (_, b) = sample();
    for i in 0..b.len() {
        for bit in [0, 7] {
            let mut x = b.clone();
            x[i] ^= 1 << bit;
            assert!(LayerCache::load(&x[..]).is_err(), "byte {i} bit {bit}");
        }
    }
}

#[test]
fn huge_claims_fail_without_allocating_for_them() {
    let (_, b) = sample();
    // 2^40 tokens.
    let mut x = b.clone();
    put_u64(&mut x, LEN_AT, 1 << 40);
    reseal(&mut x);
    assert!(malformed(&x).contains("tokens"));
    // 2^32 − 1 tokens, with row counts to match: the stream ends long
    // before; the buffers only grow as bytes arrive.
    let mut x = b.clone();
    let packed = (u32::MAX as u64 - 10) / 32 * 32;
    put_u64(&mut x, LEN_AT, 2 + packed + 8);
    put_u64(&mut x, K_ROWS_AT, 2);
    put_u64(&mut x, K_ROWS_AT + 8, packed);
    put_u64(&mut x, K_ROWS_AT + 16, 8);
    reseal(&mut x);
    let what = malformed(&x);
    assert!(what.contains("ends inside"), "{what}");
    // A model of 2^32 − 1 layers.
    let cfg = CacheConfig::new(N_KV, HD);
    let mut m = Vec::new();
    KvCache::uniform(1, cfg).unwrap().save(&mut m).unwrap();
    m[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal(&mut m);
    assert!(matches!(
        KvCache::load(&m[..]),
        Err(Error::Malformed { .. })
    ));
}

/// An edit of saved bytes.
type Edit = Box<dyn Fn(&mut Vec<u8>)>;

#[test]
fn content_checks_behind_a_valid_checksum() {
    let (c, b) = sample();
    let (sink, packed, tail) = (2usize, 32usize, 11usize);
    assert_eq!(c.len(), sink + packed + tail);
    let at_k_sink = K_ROWS_AT + 24;
    let at_k_codes = at_k_sink + sink * W * 4;
    let l = presets::kivi(4).unwrap().0.layout(N_KV, HD).unwrap();
    let at_k_params = at_k_codes + N_KV * l.head_code_bytes(packed);
    let at_k_tail = at_k_params + l.param_bytes(packed);
    let cases: Vec<(&str, Edit)> = vec![
        ("magic", Box::new(|x| x[0] = b'X')),
        ("version", Box::new(|x| x[4] = 9)),
        ("reserved", Box::new(|x| x[6] = 1)),
        (
            "head_dim",
            Box::new(|x| x[16 + 4..16 + 8].copy_from_slice(&60u32.to_le_bytes())),
        ),
        ("bits byte", Box::new(|x| x[16 + 40 + 1] = 0)),
        ("rotation byte", Box::new(|x| x[16 + 40 + 7] = 5)),
        (
            "softmax bits without the flag",
            Box::new(|x| x[16 + 32] = 1),
        ),
        (
            "bytes in a full-precision tag",
            Box::new(|x| x[16 + 56 + 3] = 1),
        ),
        ("row counts", Box::new(|x| put_u64(x, K_ROWS_AT + 8, 16))),
        ("sinks", Box::new(|x| put_u64(x, K_ROWS_AT, 1))),
        (
            "not a whole block",
            Box::new(|x| {
                put_u64(x, K_ROWS_AT + 8, 31);
                put_u64(x, K_ROWS_AT + 16, 12);
            }),
        ),
        (
            "nan sink",
            Box::new(move |x| x[at_k_sink..at_k_sink + 4].copy_from_slice(&f32::NAN.to_le_bytes())),
        ),
        (
            "nan scale",
            Box::new(move |x| {
                x[at_k_params..at_k_params + 2].copy_from_slice(&half::f16::NAN.to_le_bytes())
            }),
        ),
        (
            "negative scale",
            Box::new(move |x| {
                x[at_k_params..at_k_params + 2]
                    .copy_from_slice(&half::f16::from_f32(-1.0).to_le_bytes())
            }),
        ),
        (
            "inf tail",
            Box::new(move |x| {
                x[at_k_tail..at_k_tail + 4].copy_from_slice(&f32::INFINITY.to_le_bytes())
            }),
        ),
        // A residual row no f16 scale can hold: the append that would
        // quantize it would fail, so the load does.
        (
            "unquantizable tail",
            Box::new(move |x| {
                x[at_k_tail + 4..at_k_tail + 8].copy_from_slice(&1e30f32.to_le_bytes())
            }),
        ),
    ];
    for (name, edit) in &cases {
        let mut x = b.clone();
        edit(&mut x);
        reseal(&mut x);
        let r = LayerCache::load(&x[..]);
        assert!(
            matches!(r, Err(Error::Malformed { .. })),
            "{name}: {:?}",
            r.map(|c| c.len())
        );
    }
    // A bf16 scale that is finite but whose grid's top code is not (3e38
    // times 15 overflows f32): attention over it would be inf.
    let mut rng = Rng::new(15);
    let bf = scheme(4, Axis::PerToken, Group::Size(32)).with_scale_format(kvq::ScaleFormat::Bf16);
    let mut c = LayerCache::new(CacheConfig::new(N_KV, HD).keys(bf)).unwrap();
    let (k, v) = tokens(&mut rng, 3);
    c.extend(&k, &v).unwrap();
    let mut x = saved(&c);
    let at = K_ROWS_AT + 24 + N_KV * bf.layout(N_KV, HD).unwrap().head_code_bytes(3);
    x[at..at + 2].copy_from_slice(&half::bf16::from_f32(3e38).to_le_bytes());
    reseal(&mut x);
    let what = malformed(&x);
    assert!(what.contains("overflow their grid"), "{what}");
    // A tail longer than the window allows (residual 8, blocks of 32 for
    // the keys): rows cannot be where appends never put them.
    let mut rng = Rng::new(14);
    let cfg = CacheConfig::new(N_KV, HD).keys(presets::q8_0()).residual(3);
    let mut c = LayerCache::new(cfg).unwrap();
    let (k, v) = tokens(&mut rng, 10);
    c.extend(&k, &v).unwrap();
    let mut x = saved(&c);
    put_u64(&mut x, K_ROWS_AT + 8, 6);
    put_u64(&mut x, K_ROWS_AT + 16, 4);
    reseal(&mut x);
    assert!(matches!(
        LayerCache::load(&x[..]),
        Err(Error::Malformed { .. })
    ));
}

#[test]
fn empty_wide_layers_cannot_amplify_a_small_stream() {
    // A model stream of many empty layers of a wide shape: each costs 120
    // bytes of input and would make its configuration allocate megabytes.
    // Loading stops with an error once the configurations claim far more
    // than the bytes read.
    let cfg = CacheConfig::new(1 << 13, 128).keys(scheme(4, Axis::PerChannel, Group::Size(32)));
    let one = KvCache::uniform(1, cfg).unwrap();
    let mut b = Vec::new();
    one.save(&mut b).unwrap();
    let layer = b[16..b.len() - 8].to_vec();
    let stream = |n: u32| {
        let mut x = b[..16].to_vec();
        x[8..12].copy_from_slice(&n.to_le_bytes());
        for _ in 0..n {
            x.extend_from_slice(&layer);
        }
        x.extend_from_slice(&[0; 8]);
        reseal(&mut x);
        x
    };
    match KvCache::load(&stream(2000)[..]) {
        Err(Error::Malformed { what, .. }) => assert!(what.contains("allocate"), "{what}"),
        r => panic!("expected Malformed, got {:?}", r.map(|m| m.n_layers())),
    }
    // A few such layers are backed, and load.
    assert_eq!(KvCache::load(&stream(3)[..]).unwrap().n_layers(), 3);
}

#[test]
fn a_failing_writer_is_an_io_error() {
    struct Full;
    impl std::io::Write for Full {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "disk full",
            ))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let (c, _) = sample();
    assert!(matches!(
        c.save(Full),
        Err(Error::Io {
            kind: std::io::ErrorKind::StorageFull,
            ..
        })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any edit of a saved stream, checksum re-sealed or not, loads or
    /// fails with an error; it never panics.
    #[test]
    fn edited_streams_never_panic(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        seal in any::<bool>(),
        cut in any::<usize>(),
    ) {
        let (_, b) = sample();
        let mut x = b.clone();
        for (at, val) in edits {
            let i = at % x.len();
            x[i] = val;
        }
        if seal {
            reseal(&mut x);
        }
        let _ = LayerCache::load(&x[..]);
        let n = cut % (x.len() + 1);
        let _ = LayerCache::load(&x[..n]);
    }
}

// ---------------------------------------------------------------------
// Interleavings against a shadow.

#[derive(Debug, Clone)]
enum Op {
    Append(usize),
    Truncate(usize),
    Fork,
    SaveLoad,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..40).prop_map(Op::Append),
        2 => (0usize..100).prop_map(Op::Truncate),
        1 => Just(Op::Fork),
        1 => Just(Op::SaveLoad),
    ]
}

/// 8-bit schemes of every kind, and full precision (compared bit for bit).
fn shadow_configs() -> Vec<CacheConfig> {
    let base = CacheConfig::new(N_KV, HD);
    let pc8 = scheme(8, Axis::PerChannel, Group::Size(16));
    let pt8 = scheme(8, Axis::PerToken, Group::Size(32));
    vec![
        base,
        base.keys(pc8).values(pt8),
        base.keys(pc8).values(pt8).residual(9).sinks(2),
        base.key_codec(Codec::hadamard(pt8)).values(pc8).residual(4),
        base.keys(presets::q8_0()).values(presets::q8_0()).sinks(1),
        base.keys(presets::q8_0().with_rounding(Rounding::Grid).unwrap()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn any_interleaving_matches_the_shadow(
        which in 0usize..6,
        ops in proptest::collection::vec(op(), 1..24),
        seed in any::<u64>(),
    ) {
        let cfg = shadow_configs()[which];
        let exact = which == 0;
        let mut rng = Rng::new(seed);
        let mut c = LayerCache::new(cfg).unwrap();
        let (mut sk, mut sv): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        let mut parents: Vec<(LayerCache, Vec<u8>)> = Vec::new();
        for o in ops {
            match o {
                Op::Append(n) => {
                    let (k, v) = tokens(&mut rng, n);
                    if n == 1 {
                        c.append(&k, &v).unwrap();
                    } else {
                        c.extend(&k, &v).unwrap();
                    }
                    sk.extend(k);
                    sv.extend(v);
                }
                Op::Truncate(m) => {
                    let m = m.min(c.len());
                    c.truncate(m).unwrap();
                    sk.truncate(m * W);
                    sv.truncate(m * W);
                }
                Op::Fork => {
                    // Go on with the fork; the parent must not change.
                    let child = c.fork();
                    prop_assert!(child == c);
                    let snapshot = saved(&c);
                    parents.push((std::mem::replace(&mut c, child), snapshot));
                }
                Op::SaveLoad => {
                    let b = saved(&c);
                    let back = LayerCache::load(&b[..]).unwrap();
                    prop_assert!(back == c);
                    c = back;
                }
            }
            prop_assert_eq!(c.len() * W, sk.len());
            if exact {
                prop_assert_eq!(c.keys_f32(), sk.clone());
                prop_assert_eq!(c.values_f32(), sv.clone());
            }
            if !c.is_empty() {
                let q = rng.vec(4 * HD);
                let got = attend(&c, &q, 4);
                let want = dense_attention(&q, 4, &sk, &sv, N_KV, HD, 1.0 / 8.0);
                let d = max_abs_diff(&got, &want);
                // 8 bits, values in [−1, 1]: a step of at most 2/255 per
                // element, half of it per rounding, two roundings for
                // re-sealed per-channel tokens.
                let tol = if exact { 1e-5 } else { 0.03 };
                prop_assert!(d < tol, "{:?} diff {}", cfg, d);
            }
        }
        for (p, b) in &parents {
            prop_assert_eq!(&saved(p), b);
        }
    }
}

#[test]
fn load_on_picks_the_backend() {
    let (c, b) = sample();
    let back = LayerCache::load_on(&b[..], Some(Backend::Portable), 1).unwrap();
    assert_eq!(back.backend(), Backend::Portable);
    let q = Rng::new(3).vec(HD * 2);
    let d = max_abs_diff(&attend(&back, &q, 2), &attend(&c, &q, 2));
    assert!(d < 1e-5, "{d}");
}

// ---------------------------------------------------------------------
// Forks share their prefix and are otherwise invisible.

#[derive(Debug, Clone)]
enum SeqOp {
    Append(usize, usize),
    Truncate(usize, usize),
    Fork(usize),
}

fn seq_op() -> impl Strategy<Value = SeqOp> {
    prop_oneof![
        5 => (any::<usize>(), prop_oneof![1usize..4, 100usize..400]).prop_map(|(s, n)| SeqOp::Append(s, n)),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(s, m)| SeqOp::Truncate(s, m)),
        2 => any::<usize>().prop_map(SeqOp::Fork),
    ]
}

/// Keys and values of an append.
type Rows = (Vec<f32>, Vec<f32>);

/// What a sequence did (an append, or a truncate to a length), replayed
/// on a cache that never forked.
#[derive(Clone, Default)]
struct History(Vec<(Option<Rows>, usize)>);

fn replay(cfg: CacheConfig, h: &History) -> LayerCache {
    let mut c = LayerCache::new(cfg).unwrap();
    for (op, m) in &h.0 {
        match op {
            Some((k, v)) => c.extend(k, v).unwrap(),
            None => c.truncate(*m).unwrap(),
        }
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Many sequences forking from each other: each one equals, byte for
    /// byte, a cache that did the same appends and truncates without ever
    /// forking, and attends the same to rounding.
    #[test]
    fn forks_are_invisible(
        which in 0usize..4,
        ops in proptest::collection::vec(seq_op(), 1..20),
        seed in any::<u64>(),
    ) {
        let (k4, v4) = presets::kivi(4).unwrap();
        let pc2 = scheme(2, Axis::PerChannel, Group::Size(16));
        let cfg = [
            CacheConfig::new(N_KV, HD).keys(k4).values(v4),
            CacheConfig::new(N_KV, HD).keys(k4).values(v4).residual(20).sinks(3),
            CacheConfig::new(N_KV, HD).key_codec(Codec::hadamard(presets::q4_0())).values(pc2),
            CacheConfig::new(N_KV, HD).sinks(2),
        ][which];
        let mut rng = Rng::new(seed);
        let mut seqs = vec![(LayerCache::new(cfg).unwrap(), History::default())];
        let cut = ops.iter().any(|o| matches!(o, SeqOp::Truncate(..)));
        for o in ops {
            let i = match o {
                SeqOp::Append(s, n) => {
                    let i = s % seqs.len();
                    let (k, v) = tokens(&mut rng, n);
                    seqs[i].0.extend(&k, &v).unwrap();
                    seqs[i].1 .0.push((Some((k, v)), 0));
                    i
                }
                SeqOp::Truncate(s, m) => {
                    let i = s % seqs.len();
                    let m = m % (seqs[i].0.len() + 1);
                    seqs[i].0.truncate(m).unwrap();
                    seqs[i].1 .0.push((None, m));
                    i
                }
                SeqOp::Fork(s) => {
                    let i = s % seqs.len();
                    let child = seqs[i].0.fork();
                    let h = seqs[i].1.clone();
                    seqs.push((child, h));
                    seqs.len() - 1
                }
            };
            let (c, h) = &seqs[i];
            let fresh = replay(cfg, h);
            prop_assert!(*c == fresh, "sequence {}", i);
            prop_assert_eq!(saved(c), saved(&fresh));
            if !c.is_empty() {
                let q = rng.vec(2 * HD);
                let d = max_abs_diff(&attend(c, &q, 2), &attend(&fresh, &q, 2));
                prop_assert!(d < 1e-5, "sequence {} diff {}", i, d);
            }
        }
        let all: Vec<&LayerCache> = seqs.iter().map(|s| &s.0).collect();
        let sum: usize = all.iter().map(|c| c.bytes().total()).sum();
        let max = all.iter().map(|c| c.bytes().total()).max().unwrap();
        let resident = resident_bytes(all.iter().copied()).total();
        // Every cache's bytes are resident; shared ones count once, so
        // without cuts (which leave a shortened segment whole) the total
        // is at most the caches' sum.
        prop_assert!(resident >= max, "{} < {}", resident, max);
        if !cut {
            prop_assert!(resident <= sum, "{} > {}", resident, sum);
        }
    }
}

#[test]
fn forks_share_the_prompt() {
    let mut rng = Rng::new(15);
    let (k4, v4) = presets::kivi(4).unwrap();
    let cfg = CacheConfig::new(N_KV, HD)
        .keys(k4)
        .values(v4)
        .residual(32)
        .sinks(4);
    let mut prompt = LayerCache::new(cfg).unwrap();
    let (k, v) = tokens(&mut rng, 9000);
    prompt.extend(&k, &v).unwrap();
    let one = prompt.bytes().total();
    let mut beams: Vec<LayerCache> = (0..8).map(|_| prompt.fork()).collect();
    // Shared: eight forks cost their windows, sinks and the page being
    // filled (the 8964 packed tokens past two sealed pages of 4096), not
    // eight prompts.
    let r = resident_bytes(beams.iter().chain([&prompt])).total();
    let live = 9000 - 4 - 32 - 2 * 4096;
    let page = k4.layout(N_KV, HD).unwrap().bytes(live) + v4.layout(N_KV, HD).unwrap().bytes(live);
    let window = (32 + 31 + 4) * 2 * W * 4 + page;
    assert!(r <= one + 8 * window, "{r} against {one}");
    for b in &mut beams {
        let (k2, v2) = tokens(&mut rng, 300);
        b.extend(&k2, &v2).unwrap();
    }
    // Attention over the segments (the shared prompt, then the beam's
    // own tokens; threads split them) equals a cache that never forked.
    let mut alone = LayerCache::new(cfg).unwrap();
    alone.extend(&k, &v).unwrap();
    let mut b1 = prompt.fork();
    let (k3, v3) = tokens(&mut rng, 300);
    b1.extend(&k3, &v3).unwrap();
    alone.extend(&k3, &v3).unwrap();
    assert!(b1 == alone);
    let q = rng.vec(4 * HD);
    assert!(max_abs_diff(&attend(&b1, &q, 4), &attend(&alone, &q, 4)) < 1e-5);
    let r2 = resident_bytes(beams.iter().chain([&prompt])).total();
    let own: usize = beams.iter().map(|b| b.bytes().total() - one).sum();
    assert!(r2 <= one + own + 8 * window, "{r2}");
    // A beam cut back into the prompt reads the shared bytes, unchanged.
    let before = prompt.keys_f32();
    beams[0].truncate(1000).unwrap();
    assert_eq!(beams[0].keys_f32(), before[..1000 * W]);
    // (It copied the surviving part of the shared page it cut into.)
    let r3 = resident_bytes(beams.iter().chain([&prompt])).total();
    assert!(r3 <= r2 + beams[0].bytes().total(), "{r3}");
    assert_eq!(prompt.keys_f32(), before);
    // And saves as one contiguous cache.
    let back = LayerCache::load(&saved(&beams[0])[..]).unwrap();
    assert!(back == beams[0]);
    let mut m = KvCache::uniform(2, cfg).unwrap();
    m.layer_mut(0).extend(&k, &v).unwrap();
    let f = m.fork();
    assert!(f.layer(0) == m.layer(0));
}

// ---------------------------------------------------------------------
// Batched decode over many sequences.

#[test]
fn a_batch_equals_each_sequence_on_its_own() {
    let mut rng = Rng::new(16);
    let (k4, v4) = presets::kivi(4).unwrap();
    let cfgs = [
        CacheConfig::new(N_KV, HD)
            .keys(k4)
            .values(v4)
            .residual(16)
            .sinks(2),
        CacheConfig::new(N_KV, HD)
            .key_codec(Codec::hadamard(presets::q4_0()))
            .value_codec(Codec::hadamard(presets::q4_0())),
        CacheConfig::new(N_KV, HD),
        CacheConfig::new(N_KV, HD).keys(presets::q8_0()).values(v4),
    ];
    for backend in common::backends() {
        let mut seqs = Vec::new();
        for (i, cfg) in cfgs.iter().cycle().take(7).enumerate() {
            let mut c = LayerCache::new(cfg.backend(backend).threads(1)).unwrap();
            let (k, v) = tokens(&mut rng, 1 + 97 * i);
            c.extend(&k, &v).unwrap();
            seqs.push(c);
        }
        // A fork among them: segments, shared with its parent.
        let f = seqs[6].fork();
        seqs.push(f);
        let refs: Vec<&LayerCache> = seqs.iter().collect();
        for n_q in [N_KV, 4 * N_KV] {
            let q = rng.vec(seqs.len() * n_q * HD);
            for threads in [1, 2, 3, 0] {
                let mut out = vec![0f32; q.len()];
                attend_batch(&refs, &q, n_q, &mut out, threads).unwrap();
                for (i, c) in seqs.iter().enumerate() {
                    let w = n_q * HD;
                    let one = attend(c, &q[i * w..(i + 1) * w], n_q);
                    assert_eq!(
                        out[i * w..(i + 1) * w],
                        one[..],
                        "{backend:?} seq {i} nq {n_q} threads {threads}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_bad_batch_is_an_error_and_writes_nothing() {
    let mut rng = Rng::new(17);
    let mut a = LayerCache::new(CacheConfig::new(N_KV, HD)).unwrap();
    let (k, v) = tokens(&mut rng, 5);
    a.extend(&k, &v).unwrap();
    let empty = LayerCache::new(CacheConfig::new(N_KV, HD)).unwrap();
    let mut other = LayerCache::new(CacheConfig::new(1, HD)).unwrap();
    other.extend(&k[..5 * HD], &v[..5 * HD]).unwrap();
    let q = vec![0.5f32; 2 * W];
    let check = |caches: &[&LayerCache], q: &[f32], n_q: usize, out_len: usize| {
        let mut out = vec![7f32; out_len];
        let e = attend_batch(caches, q, n_q, &mut out, 2);
        assert!(out.iter().all(|&x| x == 7.0), "out written on {e:?}");
        e
    };
    assert!(matches!(
        check(&[&a, &empty], &q, N_KV, 2 * W),
        Err(Error::InvalidShape { .. })
    ));
    assert!(matches!(
        check(&[&a, &other], &q, N_KV, 2 * W),
        Err(Error::InvalidShape { .. })
    ));
    assert!(matches!(
        check(&[&a, &a], &q[..W], N_KV, 2 * W),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        check(&[&a, &a], &q, N_KV, W),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        check(&[&a, &a], &q, 3, 2 * W),
        Err(Error::InvalidShape { .. }) | Err(Error::Length { .. })
    ));
    let mut bad = q.clone();
    bad[W + 3] = f32::NAN;
    assert!(matches!(
        check(&[&a, &a], &bad, N_KV, 2 * W),
        Err(Error::NonFinite { .. })
    ));
    assert!(check(&[], &[], N_KV, 0).is_ok());
}

// ---------------------------------------------------------------------
// Pages: sealing at 4096 packed tokens, reopening, copy on write.

#[test]
fn page_boundaries_are_invisible() {
    // A narrow cache (one head of 8) so that many pages are cheap.
    let (n_kv, hd) = (1, 8);
    let w = n_kv * hd;
    let pt = scheme(4, Axis::PerToken, Group::Size(8));
    let pc = scheme(3, Axis::PerChannel, Group::Size(96));
    let base = CacheConfig::new(n_kv, hd);
    let cfgs = [
        base.keys(pt).values(pt),
        // 96-token blocks: pages of 4128 tokens (43 whole blocks).
        base.keys(pc).values(pt).residual(5).sinks(3),
    ];
    let mut rng = Rng::new(40);
    let attend = |c: &LayerCache, q: &[f32], n_q: usize| {
        let mut out = vec![0.0; q.len()];
        c.attend(q, n_q, &mut out).unwrap();
        out
    };
    for cfg in cfgs {
        let n = 3 * 4128 + 777;
        let (k, v): (Vec<f32>, Vec<f32>) = (rng.vec(n * w), rng.vec(n * w));
        let mut c = LayerCache::new(cfg).unwrap();
        // Token by token across the first seal, then in bulk.
        for t in 0..4200 {
            c.append(&k[t * w..(t + 1) * w], &v[t * w..(t + 1) * w])
                .unwrap();
        }
        c.extend(&k[4200 * w..], &v[4200 * w..]).unwrap();
        let mut bulk = LayerCache::new(cfg).unwrap();
        bulk.extend(&k, &v).unwrap();
        assert!(c == bulk);
        let (kd, vd) = common::placed(&cfg, &k, &v);
        assert_eq!((c.keys_f32(), c.values_f32()), (kd.clone(), vd.clone()));
        let q = rng.vec(3 * hd);
        let want = dense_attention(&q, 3, &kd, &vd, n_kv, hd, c.softmax_scale());
        let d = max_abs_diff(&attend(&c, &q, 3), &want);
        assert!(d < 1e-5, "{d}");
        // Saved as one run, loaded back into pages.
        let back = LayerCache::load(&saved(&c)[..]).unwrap();
        assert!(back == c);
        assert_eq!(attend(&back, &q, 3), attend(&c, &q, 3));
        // A rejected extend that would have sealed a page leaves the
        // cache as it was (the page is reopened, not lost).
        let before = c.clone();
        let (mut k2, v2) = (rng.vec(5000 * w), rng.vec(5000 * w));
        k2[4999 * w] = f32::NAN;
        assert!(c.extend(&k2, &v2).is_err());
        assert!(c == before);
        assert_eq!(c.bytes(), before.bytes());
        // Cuts: inside a sealed page some fork holds (copy on write),
        // inside one nobody else holds (reopened), on a page boundary,
        // inside the live page.
        let fork = c.fork();
        for cut in [n - 100, 2 * 4128 + 3, 4128 + 3 + 5, 5000, 4200, 17] {
            let mut t = c.clone();
            t.truncate(cut).unwrap();
            assert!(fork == before, "cut {cut}: the fork changed");
            assert_eq!(t.len(), cut);
            // Equal to a cache built to `cut` and cut the same way.
            let mut u = LayerCache::new(cfg).unwrap();
            u.extend(&k, &v).unwrap();
            u.truncate(cut).unwrap();
            assert!(t == u, "cut {cut}");
            // Goes on like it: append past the next seal.
            let (k3, v3) = (rng.vec(4300 * w), rng.vec(4300 * w));
            t.extend(&k3, &v3).unwrap();
            u.extend(&k3, &v3).unwrap();
            assert!(t == u, "cut {cut}, then 4300 more");
            assert_eq!(attend(&t, &q, 3), attend(&u, &q, 3));
            let back = LayerCache::load(&saved(&t)[..]).unwrap();
            assert!(back == t);
        }
        // The shared pages are counted once; the fork's own bytes are its
        // live page, window and sinks.
        let both = resident_bytes([&c, &fork]).total();
        assert!(both < c.bytes().total() + c.bytes().total() / 2, "{both}");
        assert!(c == before && fork == before);
    }
}
