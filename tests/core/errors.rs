//! Errors.

use super::*;

#[test]
fn errors_schemes_and_shapes() {
    for bits in [0u8, 9, 255] {
        let e = QuantScheme::new(bits, Axis::PerToken, Group::Head).unwrap_err();
        assert!(matches!(e, Error::InvalidScheme { .. }), "{e:?}");
        assert_msg(&e, &["scheme", "bits", &bits.to_string()]);
    }
    for n in [0usize, 12, 7, 100] {
        let e = QuantScheme::new(4, Axis::PerChannel, Group::Size(n)).unwrap_err();
        assert!(matches!(e, Error::InvalidScheme { .. }), "{e:?}");
        assert_msg(&e, &["group size", "multiple of 8", &n.to_string()]);
    }
    for g in [Group::Head, Group::Vector] {
        let e = QuantScheme::new(4, Axis::PerChannel, g).unwrap_err();
        assert!(matches!(e, Error::InvalidScheme { .. }), "{e:?}");
        assert!(msg(&e).contains(&format!("{g:?}")), "{e}");
    }
    let e = QuantScheme::new(1, Axis::PerToken, Group::Size(8))
        .unwrap()
        .with_mode(Mode::Symmetric)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidScheme { .. }));
    assert_msg(&e, &["symmetric", ">= 2", "1"]);

    let s = QuantScheme::new(4, Axis::PerToken, Group::Size(48)).unwrap();
    let e = UniformQuantizer::new(s, 2, 64).unwrap_err();
    assert!(
        matches!(e, Error::SchemeShape { op: "layout", .. }),
        "{e:?}"
    );
    assert_msg(&e, &["layout", "48", "64"]);
    // A per-channel group need not divide head_dim (it counts tokens).
    assert!(QuantScheme::new(4, Axis::PerChannel, Group::Size(48))
        .unwrap()
        .layout(2, 64)
        .is_ok());

    let s = QuantScheme::new(4, Axis::PerToken, Group::Head).unwrap();
    for (nh, hd, want) in [
        (0usize, 64usize, "n_kv_heads"),
        (2, 20, "20"),
        (2, 0, "head_dim"),
    ] {
        let e = s.layout(nh, hd).unwrap_err();
        assert!(
            matches!(e, Error::InvalidShape { op: "layout", .. }),
            "{e:?}"
        );
        assert_msg(&e, &["layout", want]);
    }
}

#[test]
fn errors_lengths() {
    let (nh, hd, tokens) = (2usize, 32usize, 5usize);
    let s = scheme(
        4,
        Axis::PerToken,
        Group::Size(16),
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let q = UniformQuantizer::new(s, nh, hd).unwrap();
    let x = vec![0.5f32; tokens * nh * hd];
    let len = |e: Error, op: &str, expected: usize, got: usize| {
        match &e {
            Error::Length {
                op: o,
                expected: x,
                got: g,
                ..
            } => {
                assert_eq!((*o, *x, *g), (op, expected, got), "{e}")
            }
            _ => panic!("{e:?}"),
        }
        assert_msg(&e, &[op, &expected.to_string(), &got.to_string()]);
    };
    len(
        q.quantize(&x[1..], tokens).unwrap_err(),
        "quantize",
        320,
        319,
    );
    len(
        q.quantize(&x, tokens + 1).unwrap_err(),
        "quantize",
        384,
        320,
    );
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    len(q.quantize(&xh, 4).unwrap_err(), "quantize", 256, 320);

    let b = q.quantize(&x, tokens).unwrap();
    let mut out = vec![0f32; 321];
    len(
        q.dequantize(&b, &mut out).unwrap_err(),
        "dequantize",
        320,
        321,
    );
    len(
        b.dequantize_into(&mut out[..10]).unwrap_err(),
        "dequantize",
        320,
        10,
    );
    let other = UniformQuantizer::new(s, 1, 64).unwrap();
    let e = other.dequantize(&b, &mut out[..320]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::SchemeShape {
                op: "dequantize",
                ..
            }
        ),
        "{e:?}"
    );

    let head = b.head(0);
    let mut o = vec![0f32; 2 * tokens];
    len(
        kernels::scores(&head, &[0.0; 33], &mut o).unwrap_err(),
        "scores",
        32,
        33,
    );
    len(
        kernels::scores(&head, &[], &mut o).unwrap_err(),
        "scores",
        32,
        0,
    );
    len(
        kernels::scores(&head, &[0.0; 64], &mut o[1..]).unwrap_err(),
        "scores",
        10,
        9,
    );
    let mut o = vec![0f32; 64];
    len(
        kernels::weighted_sum(&head, &[0.0; 9], &mut o).unwrap_err(),
        "weighted_sum",
        10,
        9,
    );
    len(
        kernels::weighted_sum(&head, &[0.0; 10], &mut o[..63]).unwrap_err(),
        "weighted_sum",
        32,
        63,
    );
    len(
        kernels::weighted_sum(&head, &[], &mut []).unwrap_err(),
        "weighted_sum",
        32,
        0,
    );
    for b in Backend::available() {
        assert!(kernels::scores_on(b, &head, &[0.0; 31], &mut [0.0; 5]).is_err());
        assert!(kernels::weighted_sum_on(b, &head, &[0.0; 4], &mut [0.0; 32]).is_err());
    }

    let l = *b.layout();
    let (codes, params) = (head.codes(), head.params());
    assert_eq!(
        (codes.len(), params.len()),
        (tokens * 16, tokens * 2 * 2 * 2)
    );
    len(
        PackedHead::new(l, tokens, &codes[1..], params).unwrap_err(),
        "PackedHead::new",
        80,
        79,
    );
    len(
        PackedHead::new(l, tokens, codes, &params[..8]).unwrap_err(),
        "PackedHead::new",
        40,
        8,
    );
    len(
        PackedHead::new(l, 4, codes, params).unwrap_err(),
        "PackedHead::new",
        64,
        80,
    );
    let (c, p) = (b.codes().to_vec(), b.params().to_vec());
    len(
        PackedBlock::from_parts(l, tokens, c[1..].to_vec(), p.clone()).unwrap_err(),
        "PackedBlock::from_parts",
        160,
        159,
    );
    len(
        PackedBlock::from_parts(l, tokens, c.clone(), [&p[..], &[0, 0]].concat()).unwrap_err(),
        "PackedBlock::from_parts",
        80,
        82,
    );
    assert_eq!(PackedBlock::from_parts(l, tokens, c, p).unwrap(), b);
    // Token counts whose sizes overflow usize.
    for t in [usize::MAX, usize::MAX / 8] {
        let e = PackedBlock::from_parts(l, t, vec![], vec![]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidShape {
                    op: "PackedBlock::from_parts",
                    ..
                }
            ),
            "{e:?}"
        );
        assert_msg(&e, &[&t.to_string(), "2x32"]);
        let e = PackedHead::new(l, t, &[], &[]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidShape {
                    op: "PackedHead::new",
                    ..
                }
            ),
            "{e:?}"
        );
    }
}

/// NaN and ±inf name the exact token, head and channel, for every element
/// type and axis; the first one in memory order is reported.
#[test]
fn errors_non_finite() {
    let (nh, hd, tokens) = (3usize, 16usize, 11usize);
    for axis in [Axis::PerToken, Axis::PerChannel] {
        let s = QuantScheme::new(3, axis, Group::Size(8)).unwrap();
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        for (t, h, c) in [
            (0usize, 0usize, 0usize),
            (7, 2, 13),
            (10, 1, 5),
            (10, 2, 15),
        ] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = vec![0.25f32; tokens * nh * hd];
                x[(t * nh + h) * hd + c] = bad;
                // a second one later must not be the one reported
                if t < 10 {
                    x[(10 * nh + 2) * hd + 15] = f32::NAN;
                }
                let check = |e: Error| {
                    match &e {
                        Error::NonFinite {
                            op,
                            token,
                            head,
                            channel,
                            value,
                        } => {
                            assert_eq!((*op, *token, *head, *channel), ("quantize", t, h, c));
                            assert!(value.is_nan() == bad.is_nan());
                        }
                        _ => panic!("{e:?}"),
                    }
                    assert_msg(
                        &e,
                        &[
                            "quantize",
                            &format!("token {t}"),
                            &format!("head {h}"),
                            &format!("channel {c}"),
                        ],
                    );
                };
                check(q.quantize(&x, tokens).unwrap_err());
                let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                check(q.quantize(&xh, tokens).unwrap_err());
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                check(q.quantize(&xb, tokens).unwrap_err());
            }
        }
    }
    // f16 overflow on narrowing is the caller's inf, reported as such.
    let q = UniformQuantizer::new(
        QuantScheme::new(4, Axis::PerToken, Group::Head).unwrap(),
        1,
        8,
    )
    .unwrap();
    let mut x = [f16::from_f32(1.0); 8];
    x[6] = f16::from_f32(1e6);
    assert!(matches!(
        q.quantize(&x, 1).unwrap_err(),
        Error::NonFinite {
            token: 0,
            head: 0,
            channel: 6,
            ..
        }
    ));
}

/// A scale that does not fit f16 names the token, head and group.
#[test]
fn errors_scale_overflow() {
    let (nh, hd, tokens) = (2usize, 64usize, 40usize);
    for (axis, group) in [
        (Axis::PerToken, Group::Size(16)),
        (Axis::PerToken, Group::Head),
        (Axis::PerToken, Group::Vector),
        (Axis::PerChannel, Group::Size(16)),
    ] {
        for mode in [Mode::Asymmetric, Mode::Symmetric] {
            for big in [1e30f32, -1e30, 1e6, -1e6] {
                let s = scheme(4, axis, group, mode, ScaleFormat::F16);
                let q = UniformQuantizer::new(s, nh, hd).unwrap();
                let mut x = vec![1.0f32; tokens * nh * hd];
                let (t, h, c) = (37, 1, 40);
                x[(t * nh + h) * hd + c] = big;
                let e = q.quantize(&x, tokens).unwrap_err();
                let (wt, wh, wg) = match (axis, group) {
                    (Axis::PerToken, Group::Size(n)) => (t, h, c / n),
                    (Axis::PerToken, Group::Head) => (t, h, 0),
                    (Axis::PerToken, _) => (t, 0, 0),
                    (Axis::PerChannel, _) => (32, h, c),
                };
                match &e {
                    Error::ScaleOverflow {
                        op,
                        what,
                        format,
                        token,
                        head,
                        group,
                        ..
                    } => {
                        assert_eq!((*op, *format), ("quantize", "f16"));
                        assert!(*what == "scale" || *what == "zero");
                        assert_eq!((*token, *head, *group), (wt, wh, wg), "{} {e}", s.label());
                    }
                    _ => panic!("{} {big}: {e:?}", s.label()),
                }
                assert_msg(
                    &e,
                    &[
                        "quantize",
                        "f16",
                        &format!("token {wt}"),
                        &format!("group {wg}"),
                    ],
                );
                // bf16 and f32 scales take it.
                for fmt in [ScaleFormat::Bf16, ScaleFormat::F32] {
                    let q = UniformQuantizer::new(s.with_scale_format(fmt), nh, hd).unwrap();
                    check_block(&x, &q.quantize(&x, tokens).unwrap()).unwrap();
                }
            }
        }
    }
}

/// A 1-bit asymmetric vector-group scheme whose two heads are each
/// constant but far apart: every head's range is empty, the vector's is
/// 80000, beyond f16. The append is an error, like the quantizer's.
#[test]
fn errors_vector_group_overflow_across_heads() {
    let s = QuantScheme::new(1, Axis::PerToken, Group::Vector)
        .unwrap()
        .with_mode(Mode::Asymmetric)
        .unwrap();
    let (n_kv, hd) = (2, 64);
    let mut row = vec![-40000f32; hd];
    row.extend(vec![40000f32; hd]);
    let q = UniformQuantizer::new(s, n_kv, hd).unwrap();
    assert!(matches!(
        q.quantize(&row, 1),
        Err(Error::ScaleOverflow { .. })
    ));
    for b in backends() {
        let cfg = kvq::CacheConfig::new(n_kv, hd).keys(s).values(s).backend(b);
        let mut cache = kvq::LayerCache::new(cfg).unwrap();
        let ok = vec![0.5f32; n_kv * hd];
        cache.append(&ok, &ok).unwrap();
        let before = cache.clone();
        assert!(matches!(
            cache.append(&row, &ok),
            Err(Error::ScaleOverflow { op: "append", .. })
        ));
        assert!(cache == before);
    }
}

/// `residual(usize::MAX)` keeps every token exact; no sum may wrap.
#[test]
fn residual_of_usize_max_keeps_everything_exact() {
    let (n_kv, hd) = (2, 64);
    let (k, v) = kvq::presets::kivi(4).unwrap();
    let cfg = kvq::CacheConfig::new(n_kv, hd)
        .keys(k)
        .values(v)
        .residual(usize::MAX);
    let mut cache = kvq::LayerCache::new(cfg).unwrap();
    let mut rng = Rng::new(9);
    let x = rng.vec(70 * n_kv * hd);
    cache.extend(&x, &x).unwrap();
    for _ in 0..3 {
        let r = rng.vec(n_kv * hd);
        cache.append(&r, &r).unwrap();
    }
    assert_eq!(cache.packed_len(), (0, 0));
    assert_eq!(&cache.keys_f32()[..x.len()], &x[..]);
}

/// Sizes computed from caller input that do not fit are errors, before
/// anything is allocated.
#[test]
fn errors_sizes_that_do_not_fit() {
    use kvq::{CacheConfig, LayerCache};
    let s = QuantScheme::new(4, Axis::PerToken, Group::Size(32)).unwrap();
    // Heads × channels beyond the address space.
    // And shapes past kvq's limits, which would fit but make a cache
    // allocate per head before its first token (2^31 heads: 51 GB of
    // empty per-head buffers).
    let too_many = kvq::scheme::MAX_HEADS + 1;
    let too_wide = kvq::scheme::MAX_HEAD_DIM + 8;
    for (n_kv, hd) in [
        (usize::MAX / 8, 64),
        (1 << 40, 1 << 30),
        (2, 1 << 62),
        (1 << 31, 64),
        (too_many, 8),
        (8, too_wide),
    ] {
        assert!(
            matches!(s.layout(n_kv, hd), Err(Error::InvalidShape { .. })),
            "{n_kv}x{hd}"
        );
        assert!(LayerCache::new(CacheConfig::new(n_kv, hd)).is_err());
    }
    // A group size the header cannot hold.
    assert!(QuantScheme::new(4, Axis::PerChannel, Group::Size(1 << 33)).is_err());
    // tokens·width overflowing, and more tokens than a header counts.
    let q = UniformQuantizer::new(s, 2, 64).unwrap();
    for tokens in [usize::MAX / 64, 1 << 33] {
        assert!(matches!(
            q.quantize(&[0f32; 128], tokens),
            Err(Error::InvalidShape { .. })
        ));
    }
    // A non-finite softmax scale.
    for bad in [f32::NAN, f32::INFINITY] {
        let cfg = CacheConfig::new(1, 64).softmax_scale(bad);
        assert!(matches!(
            LayerCache::new(cfg),
            Err(Error::InvalidConfig { .. })
        ));
    }
    // Query heads × channels overflowing.
    let mut cache = LayerCache::new(CacheConfig::new(1, 64)).unwrap();
    cache.append(&[0f32; 64], &[0f32; 64]).unwrap();
    let mut out = [0f32; 64];
    assert!(matches!(
        cache.attend(&[0f32; 64], usize::MAX / 2, &mut out),
        Err(Error::InvalidShape { .. })
    ));
}
