//! Quantizer error budget.

use super::*;

/// Every bits × axis × group × mode × scale format, on several input kinds
/// and shapes, obeys the documented math and error bound.
#[test]
fn error_budget_every_scheme() {
    let mut rng = Rng::new(7);
    let shapes = [
        (1usize, 64usize, 1usize),
        (2, 64, 9),
        (1, 128, 5),
        (1, 64, 37),
    ];
    let kinds = [Kind::Random, Kind::Offset, Kind::OutlierChannel, Kind::Wild];
    let mut n = 0;
    for (si, s) in all_schemes().into_iter().enumerate() {
        for (ki, &kind) in kinds.iter().enumerate() {
            let (nh, hd, tokens) = shapes[(si + ki) % shapes.len()];
            let x = gen(kind, tokens, nh, hd, &mut rng);
            let q = UniformQuantizer::new(s, nh, hd).unwrap();
            let block = q.quantize(&x, tokens).unwrap();
            check_block(&x, &block).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            if ki == 0 {
                // f16/bf16 input: the codes and params of its f32 widening.
                let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                let wh: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
                let wb: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
                assert_eq!(q.quantize(&xh, tokens), q.quantize(&wh, tokens));
                assert_eq!(q.quantize(&xb, tokens), q.quantize(&wb, tokens));
            }
        }
        n += 1;
    }
    assert_eq!(n, 8 * 10 * 2 * 3 - 10 * 3);
}

/// Small magnitudes and subnormals: the bound still holds (here the step can
/// be a subnormal f32, whose reciprocal overflows f32).
#[test]
fn error_budget_tiny_and_subnormal() {
    let mut rng = Rng::new(11);
    for kind in [Kind::Tiny, Kind::Subnormal] {
        for bits in 1..=8 {
            for s in schemes_of(bits) {
                let (nh, hd, tokens) = (2, 64, 9);
                let x = gen(kind, tokens, nh, hd, &mut rng);
                let block = quantize_ok(s, nh, hd, &x, tokens);
                check_block(&x, &block).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            }
        }
    }
}

/// ~1e30: fine with f32 and bf16 scales, `ScaleOverflow` with f16.
#[test]
fn error_budget_huge() {
    let mut rng = Rng::new(13);
    for bits in 1..=8 {
        for s in schemes_of(bits) {
            let (nh, hd, tokens) = (2, 64, 9);
            let x = gen(Kind::Huge, tokens, nh, hd, &mut rng);
            let q = UniformQuantizer::new(s, nh, hd).unwrap();
            match (s.scale_format(), q.quantize(&x, tokens)) {
                (ScaleFormat::F16, Err(Error::ScaleOverflow { op, format, .. })) => {
                    assert_eq!((op, format), ("quantize", "f16"));
                }
                (ScaleFormat::F16, r) => panic!("{}: {r:?}", s.label()),
                (_, r) => {
                    let b = r.unwrap_or_else(|e| panic!("{}: {e}", s.label()));
                    check_block(&x, &b).unwrap();
                }
            }
        }
    }
}

/// Values near the top of f32's range: either a `ScaleOverflow` or a block
/// within the bound — never an infinite reconstruction.
#[test]
fn error_budget_near_f32_max() {
    let mut rng = Rng::new(17);
    for bits in 1..=8 {
        for s in schemes_of(bits) {
            if s.scale_format() == ScaleFormat::F16 {
                continue;
            }
            let (nh, hd, tokens) = (1, 64, 8);
            let mut x: Vec<f32> = (0..tokens * hd)
                .map(|_| rng.range(-1.0, 1.0) * 3.0e38)
                .collect();
            x[0] = f32::MAX;
            x[1] = -f32::MAX;
            let q = UniformQuantizer::new(s, nh, hd).unwrap();
            match q.quantize(&x, tokens) {
                Err(Error::ScaleOverflow { .. }) => {}
                Err(e) => panic!("{}: {e}", s.label()),
                Ok(b) => {
                    check_block(&x, &b).unwrap();
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A random scheme, shape and input kind: the bound holds, and f16/bf16
    /// input gives exactly the block of its f32 widening.
    #[test]
    fn error_budget_random(
        s in prop::sample::select(all_schemes()),
        nh in 1usize..=2,
        hd_i in 0usize..2,
        tokens in 1usize..=40,
        kind in prop::sample::select(vec![
            Kind::Random, Kind::Offset, Kind::ConstantRows, Kind::ConstantChannels,
            Kind::OutlierChannel, Kind::Tiny, Kind::Wild,
        ]),
        seed in any::<u64>(),
    ) {
        let hd = [64, 192][hd_i];
        let mut rng = Rng::new(seed);
        let x = gen(kind, tokens, nh, hd, &mut rng);
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        let block = q.quantize(&x, tokens).unwrap();
        check_block(&x, &block).map_err(TestCaseError::fail)?;
        // Element types: same codes and params as the widened f32 input.
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        check_element(&q, &xh, tokens)?;
        check_element(&q, &xb, tokens)?;
    }
}

fn check_element<T: Element>(
    q: &UniformQuantizer,
    x: &[T],
    tokens: usize,
) -> Result<(), TestCaseError> {
    let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let a = q
        .quantize(x, tokens)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let b = q
        .quantize(&wide, tokens)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(
        a == b,
        "{}: {} input differs from its f32 widening",
        q.label(),
        T::NAME
    );
    check_block(&wide, &a).map_err(TestCaseError::fail)?;
    Ok(())
}

/// The bound is not vacuous: on random data the worst error is close to half
/// a step (so a quantizer that rounded badly would fail it).
#[test]
fn error_budget_is_tight() {
    let mut rng = Rng::new(3);
    let x = gen(Kind::Random, 64, 2, 64, &mut rng);
    for bits in [2, 4, 8] {
        let s = QuantScheme::new(bits, Axis::PerToken, Group::Size(32)).unwrap();
        let worst = check_block(&x, &quantize_ok(s, 2, 64, &x, 64)).unwrap();
        assert!(worst > 0.45 && worst <= 0.5 + 1e-3, "{bits}: {worst}");
    }
}

/// The checker notices a wrong code, a wrong scale and a wrong zero.
#[test]
fn check_block_catches_corruption() {
    let mut rng = Rng::new(5);
    let x = gen(Kind::Random, 4, 1, 64, &mut rng);
    for s in [
        scheme(
            4,
            Axis::PerToken,
            Group::Size(32),
            Mode::Asymmetric,
            ScaleFormat::F32,
        ),
        scheme(
            3,
            Axis::PerChannel,
            Group::Size(8),
            Mode::Symmetric,
            ScaleFormat::F16,
        ),
    ] {
        let b = quantize_ok(s, 1, 64, &x, 4);
        check_block(&x, &b).unwrap();
        let l = *b.layout();
        for (which, byte) in [("code", 0usize), ("code", 17), ("param", 0), ("param", 3)] {
            let (mut codes, mut params) = (b.codes().to_vec(), b.params().to_vec());
            match which {
                "code" => codes[byte] ^= 0x04,
                _ => params[byte] ^= 0x01,
            }
            let bad = PackedBlock::from_parts(l, 4, codes, params).unwrap();
            assert!(
                check_block(&x, &bad).is_err(),
                "{} {which} {byte}",
                s.label()
            );
        }
    }
}

/// Constant rows and channels: exact with f32 scales and for values the scale
/// format represents; otherwise within the documented bound, which is then at
/// most half an ulp of the format at that value.
#[test]
fn zero_range_groups() {
    let representable = [0.0f32, 0.5, -3.0, 1.0, -0.25, 1024.0, 96.0];
    let other = [0.1f32, -1e-3, 3.3e-5, 1234.567, 1e-6, -7.77e-7, 60000.3];
    let (nh, hd, tokens) = (2, 64, 3);
    for bits in 1..=8 {
        // Constant groups depend on bits, mode and format, not on the size.
        for s in schemes_of(bits)
            .into_iter()
            .filter(|s| matches!(s.group(), Group::Size(8) | Group::Head | Group::Vector))
        {
            for &v in representable.iter().chain(&other) {
                // Constant along the group's axis: whole tokens for per-token,
                // whole blocks of a channel for per-channel (here: all).
                let x = vec![v; tokens * nh * hd];
                let block = quantize_ok(s, nh, hd, &x, tokens);
                check_block(&x, &block).unwrap();
                let mut back = vec![0f32; x.len()];
                block.dequantize_into(&mut back).unwrap();
                let fmt = s.scale_format();
                let exact = s.mode() == Mode::Asymmetric
                    && (fmt == ScaleFormat::F32 || representable.contains(&v));
                let ulp = ulp_fmt(fmt, v);
                for &y in &back {
                    if exact {
                        assert_eq!(y, v, "{}: {v}", s.label());
                    } else {
                        let err = (y as f64 - v as f64).abs();
                        // asymmetric: < half an ulp of the format at v (plus
                        // f32 evaluation); symmetric: the general bound, checked
                        // above.
                        if s.mode() == Mode::Asymmetric {
                            assert!(
                                err <= ulp / 2.0 + 4.0 * EPS * v.abs() as f64,
                                "{}: {v} -> {y} (ulp {ulp:e})",
                                s.label()
                            );
                        }
                    }
                }
            }
        }
    }
    // Different constants per token / per channel at once.
    let (nh, hd, tokens) = (2, 64, 40);
    let mut rng = Rng::new(23);
    for kind in [Kind::ConstantRows, Kind::ConstantChannels] {
        for s in all_schemes() {
            if s.scale_format() != ScaleFormat::F32 || s.mode() != Mode::Asymmetric {
                continue;
            }
            let constant_groups = matches!(
                (kind, s.axis()),
                (Kind::ConstantRows, Axis::PerToken) | (Kind::ConstantChannels, Axis::PerChannel)
            );
            let x = gen(kind, tokens, nh, hd, &mut rng);
            let block = quantize_ok(s, nh, hd, &x, tokens);
            check_block(&x, &block).unwrap();
            if constant_groups {
                let mut back = vec![0f32; x.len()];
                block.dequantize_into(&mut back).unwrap();
                assert_eq!(back, x, "{} {kind:?}", s.label());
            }
        }
    }
}

/// Spacing of `fmt` just above |v|.
fn ulp_fmt(fmt: ScaleFormat, v: f32) -> f64 {
    let a = v.abs();
    match fmt {
        ScaleFormat::F32 => (f32::from_bits(a.to_bits() + 1) - a) as f64,
        ScaleFormat::F16 => {
            let h = f16::from_f32(a);
            let h = if h.to_f32() > a {
                f16::from_bits(h.to_bits() - 1)
            } else {
                h
            };
            (f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()) as f64
        }
        ScaleFormat::Bf16 => {
            let h = bf16::from_f32(a);
            let h = if h.to_f32() > a {
                bf16::from_bits(h.to_bits() - 1)
            } else {
                h
            };
            (bf16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()) as f64
        }
    }
}

/// Next value of the format toward +inf after a representable `r`.
fn next_up(fmt: ScaleFormat, r: f32) -> f32 {
    match fmt {
        ScaleFormat::F32 => {
            if r == 0.0 {
                f32::from_bits(1)
            } else if r > 0.0 {
                f32::from_bits(r.to_bits() + 1)
            } else {
                f32::from_bits(r.to_bits() - 1)
            }
        }
        ScaleFormat::F16 => {
            let h = f16::from_f32(r);
            if r == 0.0 {
                f16::from_bits(1).to_f32()
            } else if r > 0.0 {
                f16::from_bits(h.to_bits() + 1).to_f32()
            } else {
                f16::from_bits(h.to_bits() - 1).to_f32()
            }
        }
        ScaleFormat::Bf16 => {
            let h = bf16::from_f32(r);
            if r == 0.0 {
                bf16::from_bits(1).to_f32()
            } else if r > 0.0 {
                bf16::from_bits(h.to_bits() + 1).to_f32()
            } else {
                bf16::from_bits(h.to_bits() - 1).to_f32()
            }
        }
    }
}

fn representable(fmt: ScaleFormat, r: f32) -> bool {
    match fmt {
        ScaleFormat::F32 => true,
        ScaleFormat::F16 => f16::from_f32(r).to_f32() == r,
        ScaleFormat::Bf16 => bf16::from_f32(r).to_f32() == r,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// `round_up` is the least representable number ≥ x, `round_down` the
    /// greatest ≤ x — the two roundings the error bound rests on.
    #[test]
    fn directed_rounding_is_tight(m in -1.0f64..1.0, e in -50i32..20) {
        let x = m * 2f64.powi(e);
        for fmt in FORMATS {
            let u = fmt.round_up(x);
            let d = fmt.round_down(x);
            if u.is_finite() {
                prop_assert!(representable(fmt, u) && u as f64 >= x, "{:?} up {} {}", fmt, x, u);
                let below = -next_up(fmt, -u);
                prop_assert!((below as f64) < x, "{:?} up {} {} not least", fmt, x, u);
            }
            if d.is_finite() {
                prop_assert!(representable(fmt, d) && d as f64 <= x, "{:?} down {} {}", fmt, x, d);
                prop_assert!((next_up(fmt, d) as f64) > x, "{:?} down {} {} not greatest", fmt, x, d);
            }
        }
    }
}
