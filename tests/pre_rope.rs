//! Pre-RoPE keys ([`CacheConfig::pre_rope`]): at full precision the cache
//! attends exactly as a cache of post-RoPE keys does; quantized, it attends
//! as dense attention over its own dequantized keys rotated by the
//! reference [`Rope::apply`]; the configuration survives save/load, fork and
//! truncate; bad parameters are errors.

mod common;

use common::{backends, max_abs_diff, Rng};
use kvq::cache::dense_attention;
use kvq::{
    presets, Axis, CacheConfig, Codec, Error, Group, KvCache, LayerCache, QuantScheme, Rope,
    RopeScaling, RopeStyle,
};

fn ropes(hd: usize) -> Vec<Rope> {
    vec![
        Rope::new(10_000.0, hd, RopeStyle::Halves),
        Rope::new(500_000.0, hd, RopeStyle::Adjacent),
        // Partial rotary: the last channels are not rotated.
        Rope::new(10_000.0, hd / 2, RopeStyle::Halves),
        Rope::new(10_000.0, hd, RopeStyle::Adjacent)
            .with_scaling(RopeScaling::Linear { factor: 4.0 }),
        Rope::new(500_000.0, hd, RopeStyle::Halves).with_scaling(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        }),
    ]
}

/// `rows` (`[n, width]`, positions `p0..`) rotated by the reference.
fn rotated(rope: &Rope, rows: &[f32], width: usize, hd: usize, p0: usize) -> Vec<f32> {
    let mut out = rows.to_vec();
    for (t, row) in out.chunks_exact_mut(width).enumerate() {
        rope.apply(row, hd, p0 + t);
    }
    out
}

fn relative(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    max_abs_diff(a, b) / scale
}

/// The relative error of `c.attend` (pre-RoPE keys) against dense
/// attention over its decoded keys rotated by the reference.
fn decode_error(c: &LayerCache, rope: &Rope, q: &[f32], n_q: usize) -> f32 {
    let (n_kv, hd) = (c.config().n_kv_heads(), c.config().head_dim());
    let mut out = vec![0f32; n_q * hd];
    c.attend(q, n_q, &mut out).unwrap();
    let kr = rotated(rope, &c.keys_f32(), n_kv * hd, hd, 0);
    let want = dense_attention(
        q,
        n_q,
        &kr,
        &c.values_f32(),
        n_kv,
        hd,
        1.0 / (hd as f32).sqrt(),
    );
    relative(&out, &want)
}

#[test]
fn full_precision_pre_rope_attends_as_post_rope_keys() {
    let mut rng = Rng::new(3);
    let (n_kv, hd, n_q) = (2, 64, 4);
    let w = n_kv * hd;
    for rope in ropes(hd) {
        for (sinks, residual, values) in [
            (0, 0, None),
            (4, 32, Some(Codec::from(presets::kivi(4).unwrap().1))),
        ] {
            let len = 700;
            let k = rng.vec(len * w);
            let v = rng.vec(len * w);
            let cfg = CacheConfig::new(n_kv, hd)
                .value_codec(values)
                .sinks(sinks)
                .residual(residual);
            let mut pre = LayerCache::new(cfg.pre_rope(rope)).unwrap();
            let mut post = LayerCache::new(cfg).unwrap();
            pre.extend(&k, &v).unwrap();
            post.extend(&rotated(&rope, &k, w, hd, 0), &v).unwrap();
            assert_eq!(pre.keys_f32(), k, "pre-RoPE keys are stored as given");
            // Decode: one query at the last position.
            let q = rng.vec(n_q * hd);
            let (mut a, mut b) = (vec![0f32; n_q * hd], vec![0f32; n_q * hd]);
            pre.attend(&q, n_q, &mut a).unwrap();
            post.attend(&q, n_q, &mut b).unwrap();
            let d = relative(&a, &b);
            assert!(d < 2e-5, "{rope:?} sinks {sinks}: decode differs by {d}");
            // Prefill: the last 100 positions, causal.
            let qs = rng.vec(100 * n_q * hd);
            let (mut a, mut b) = (vec![0f32; qs.len()], vec![0f32; qs.len()]);
            pre.attend_causal(&qs, n_q, &mut a, None).unwrap();
            post.attend_causal(&qs, n_q, &mut b, None).unwrap();
            let d = relative(&a, &b);
            assert!(d < 2e-5, "{rope:?} sinks {sinks}: prefill differs by {d}");
        }
    }
}

#[test]
fn quantized_pre_rope_keys_attend_as_their_rotated_decode() {
    let mut rng = Rng::new(9);
    let (n_kv, hd) = (2, 128);
    let w = n_kv * hd;
    let g32 = Group::Size(32);
    let pc = |b, g| Codec::from(QuantScheme::new(b, Axis::PerChannel, Group::Size(g)).unwrap());
    let r = ropes(hd);
    // Per-channel 2, 4 and 8 bits at head_dim 128 with a rotation of
    // every channel take the fused kernel;
    // partial rotary, other widths, per-token keys and codebooks go
    // through the scratch kernel or the chunked decode-and-rotate path.
    let keys = [
        (pc(4, 32), r[0]),
        (pc(2, 64), r[1]),
        (
            QuantScheme::new(3, Axis::PerToken, g32).unwrap().into(),
            r[2],
        ),
        // 120 adjacent rotary channels take the scratch kernel only with
        // 8 lanes (AVX2), and the chunked path otherwise.
        (pc(4, 32), Rope::new(10_000.0, 120, RopeStyle::Adjacent)),
        // A codebook decodes through its own levels, not the uniform grid.
        (presets::iq4_nl(), r[0]),
        (pc(8, 32), r[4]),
        (pc(4, 64), r[3]),
        (pc(4, 32), r[2]),
        (pc(3, 32), r[0]),
        // Outliers: the fused kernel on the grid, then each entry's share
        // of the rotated key; partial rotary leaves some entries unrotated.
        (pc(2, 32).with_outliers(0.01).unwrap(), r[1]),
        (pc(4, 32).with_outliers(0.02).unwrap(), r[2]),
        (pc(3, 64).with_outliers(0.01).unwrap(), r[0]),
        // 2 bits with pairs of halves: one query per KV head folds the
        // block's scales and zeros into the turned-back query; four
        // queries dequantize and turn each row.
        (pc(2, 32), r[0]),
        (pc(2, 64), r[0]),
        (pc(2, 128).with_outliers(0.01).unwrap(), r[4]),
    ];
    for backend in backends() {
        for (ki, (key, rope)) in keys.into_iter().enumerate() {
            // One query per KV head, then four.
            let n_q = if ki % 2 == 0 { 2 } else { 8 };
            // 555 tokens: a partial per-channel block stays full precision.
            let len = 555;
            let k = rng.vec(len * w);
            let v = rng.vec(len * w);
            let cfg = CacheConfig::new(n_kv, hd)
                .key_codec(key)
                .values(QuantScheme::new(4, Axis::PerToken, g32).unwrap())
                .sinks(3)
                .backend(backend)
                .pre_rope(rope);
            let mut c = LayerCache::new(cfg).unwrap();
            // In pieces, so rows arrive across chunk and block edges.
            for part in [1usize, 100, 200, 254] {
                let done = c.len();
                c.extend(
                    &k[done * w..(done + part) * w],
                    &v[done * w..(done + part) * w],
                )
                .unwrap();
            }
            assert_eq!(c.len(), len);
            let q = rng.vec(n_q * hd);
            let d = decode_error(&c, &rope, &q, n_q);
            assert!(d < 1e-4, "{backend:?} {key:?}: {d}");
            // And the quantized keys are closer to the truth pre-RoPE.
            let kd = c.keys_f32();
            assert!(
                max_abs_diff(&kd, &k) < 1.0,
                "{key:?}: the stored keys decode near the input"
            );
        }
    }
}

/// A cache of two KV heads with `key` before `rope` and 4-bit per-token
/// values, `len` random tokens appended in one `extend`: its decode error
/// against the rotated reference for `n_q` random queries.
fn one_extend_error(
    rng: &mut Rng,
    hd: usize,
    key: Codec,
    (rope, sinks, backend): (Rope, usize, kvq::Backend),
    len: usize,
    n_q: usize,
) -> f32 {
    let w = 2 * hd;
    let (k, v) = (rng.vec(len * w), rng.vec(len * w));
    let cfg = CacheConfig::new(2, hd)
        .key_codec(key)
        .values(QuantScheme::new(4, Axis::PerToken, Group::Size(32)).unwrap())
        .sinks(sinks)
        .backend(backend)
        .pre_rope(rope);
    let mut c = LayerCache::new(cfg).unwrap();
    c.extend(&k, &v).unwrap();
    let q = rng.vec(n_q * hd);
    decode_error(&c, &rope, &q, n_q)
}

/// Head dims 64 (SmolLM2) and 256 (Gemma): per-channel 4- and 8-bit keys
/// with every channel rotated take the fused kernel compiled for that
/// head dim; partial rotary the scratch kernel. Both pair styles, one and
/// four queries per KV head, every backend.
#[test]
fn pre_rope_keys_at_head_dims_64_and_256() {
    let mut rng = Rng::new(31);
    for hd in [64usize, 256] {
        let r = ropes(hd);
        for backend in backends() {
            for (ki, (bits, rope)) in [(4u8, r[0]), (8, r[1]), (4, r[4]), (4, r[2])]
                .into_iter()
                .enumerate()
            {
                let key = QuantScheme::new(bits, Axis::PerChannel, Group::Size(32)).unwrap();
                for n_q in [2, 8] {
                    let d = one_extend_error(
                        &mut rng,
                        hd,
                        key.into(),
                        (rope, 2, backend),
                        100 + 37 * ki,
                        n_q,
                    );
                    assert!(
                        d < 1e-4,
                        "hd {hd} {backend:?} {bits} bits {rope:?} n_q {n_q}: {d}"
                    );
                }
            }
        }
    }
}

/// Key outliers before RoPE in blocks of 128 tokens: sinks that put a
/// block across a coarse row of the rotation tables beyond the fine
/// table's reach (70: blocks from position 198) split its entries between
/// two rows; one and four queries per KV head, both pair styles.
#[test]
fn pre_rope_outliers_in_long_blocks_attend_as_their_rotated_decode() {
    let mut rng = Rng::new(21);
    let hd = 128;
    let key = Codec::from(QuantScheme::new(2, Axis::PerChannel, Group::Size(128)).unwrap())
        .with_outliers(0.02)
        .unwrap();
    for backend in backends() {
        for rope in [
            Rope::new(500_000.0, hd, RopeStyle::Halves),
            Rope::new(10_000.0, hd, RopeStyle::Adjacent),
        ] {
            for (sinks, n_q) in [(0, 2), (3, 8), (70, 2), (70, 8)] {
                let d = one_extend_error(&mut rng, hd, key, (rope, sinks, backend), 900, n_q);
                assert!(
                    d < 1e-4,
                    "{backend:?} {rope:?} sinks {sinks} n_q {n_q}: {d}"
                );
            }
        }
    }
}

#[test]
fn pre_rope_survives_save_load_fork_and_truncate() {
    let mut rng = Rng::new(21);
    let (n_kv, hd, n_q) = (1, 64, 2);
    let w = n_kv * hd;
    let rope = ropes(hd)[4];
    let (keys, values) = presets::kivi(4).unwrap();
    let cfg = CacheConfig::new(n_kv, hd)
        .keys(keys)
        .values(values)
        .sinks(2)
        .residual(16)
        .pre_rope(rope);
    let k = rng.vec(300 * w);
    let v = rng.vec(300 * w);
    let mut c = LayerCache::new(cfg).unwrap();
    c.extend(&k[..250 * w], &v[..250 * w]).unwrap();
    let q = rng.vec(n_q * hd);
    let attend = |c: &LayerCache| {
        let mut o = vec![0f32; n_q * hd];
        c.attend(&q, n_q, &mut o).unwrap();
        o
    };

    let mut bytes = Vec::new();
    c.save(&mut bytes).unwrap();
    assert_eq!(bytes.len(), c.saved_bytes());
    let back = LayerCache::load(&bytes[..]).unwrap();
    assert!(back == c);
    assert_eq!(back.config().rope(), Some(rope));
    assert_eq!(attend(&back), attend(&c), "bit-identical after load");
    // Every byte of the RoPE header is checked (a flip of the base bits
    // gives another valid base, so only the checksum catches that one).
    for at in 16 + 72..16 + 72 + 48 {
        let mut bad = bytes.clone();
        bad[at] ^= 0x80;
        assert!(LayerCache::load(&bad[..]).is_err(), "flipped byte {at}");
    }
    // A stream cut inside the RoPE header.
    assert!(LayerCache::load(&bytes[..16 + 72 + 10]).is_err());
    // Scaling factors round-trip bit for bit (1.1 is not an f32).
    let linear = ropes(hd)[3];
    let mut l = LayerCache::new(cfg.pre_rope(linear)).unwrap();
    l.extend(&k[..10 * w], &v[..10 * w]).unwrap();
    let mut lb = Vec::new();
    l.save(&mut lb).unwrap();
    let l2 = LayerCache::load(&lb[..]).unwrap();
    assert!(l2 == l);
    assert_eq!(l2.config().rope(), Some(linear));

    // Truncate, then append the same tokens again: as if never cut.
    let mut t = c.fork();
    t.truncate(200).unwrap();
    t.extend(&k[200 * w..300 * w], &v[200 * w..300 * w])
        .unwrap();
    let mut fresh = LayerCache::new(cfg).unwrap();
    fresh.extend(&k[..300 * w], &v[..300 * w]).unwrap();
    let d = relative(&attend(&t), &attend(&fresh));
    assert!(d < 1e-5, "truncate + extend vs fresh: {d}");
    // The fork left the original alone.
    assert_eq!(c.len(), 250);

    // Whole-model streams carry it per layer.
    let mut m = KvCache::new(vec![cfg, cfg.pre_rope(None)]).unwrap();
    m.layer_mut(0).extend(&k[..40 * w], &v[..40 * w]).unwrap();
    let mut mb = Vec::new();
    m.save(&mut mb).unwrap();
    let mb2 = KvCache::load(&mb[..]).unwrap();
    assert_eq!(mb2.layer(0).config().rope(), Some(rope));
    assert_eq!(mb2.layer(1).config().rope(), None);
}

#[test]
fn bad_rope_parameters_are_errors() {
    let hd = 64;
    let bad = [
        Rope::new(10_000.0, 0, RopeStyle::Halves),
        Rope::new(10_000.0, 63, RopeStyle::Halves),
        Rope::new(10_000.0, 66, RopeStyle::Adjacent),
        Rope::new(1.0, 64, RopeStyle::Halves),
        Rope::new(f64::NAN, 64, RopeStyle::Halves),
        Rope::new(f64::INFINITY, 64, RopeStyle::Halves),
        Rope::new(1e4, 64, RopeStyle::Halves).with_scaling(RopeScaling::Linear { factor: 0.0 }),
        Rope::new(1e4, 64, RopeStyle::Halves)
            .with_scaling(RopeScaling::Linear { factor: f64::NAN }),
        Rope::new(1e4, 64, RopeStyle::Halves).with_scaling(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 1.0,
            original_max_position: 8192,
        }),
        Rope::new(1e4, 64, RopeStyle::Halves).with_scaling(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 0,
        }),
    ];
    for r in bad {
        let e = LayerCache::new(CacheConfig::new(2, hd).pre_rope(r)).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { .. }), "{r:?}: {e}");
    }
    // A rotated key codec mixes the channels RoPE pairs up.
    let rotated = Codec::hadamard(QuantScheme::new(4, Axis::PerToken, Group::Size(32)).unwrap());
    let cfg = CacheConfig::new(2, hd)
        .key_codec(rotated)
        .pre_rope(Rope::new(1e4, hd, RopeStyle::Halves));
    assert!(matches!(
        LayerCache::new(cfg).unwrap_err(),
        Error::InvalidConfig { .. }
    ));
    // Rotated values are fine.
    let cfg = CacheConfig::new(2, hd)
        .value_codec(rotated)
        .pre_rope(Rope::new(1e4, hd, RopeStyle::Halves));
    assert!(LayerCache::new(cfg).is_ok());
}
