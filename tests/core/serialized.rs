//! Serialized blocks.

use super::*;

fn small_block(s: QuantScheme) -> PackedBlock {
    let mut rng = Rng::new(47);
    let (nh, hd, tokens) = (2, 16, 3);
    let x = gen(Kind::Random, tokens, nh, hd, &mut rng);
    quantize_ok(s, nh, hd, &x, tokens)
}

#[track_caller]
fn malformed(r: kvq::Result<PackedBlock>, part: &str) {
    match r {
        Err(
            e @ Error::Malformed {
                op: "PackedBlock::from_bytes",
                ..
            },
        ) => assert_msg(&e, &["PackedBlock::from_bytes", "malformed", part]),
        r => panic!("expected Malformed ({part}), got {r:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bytes_round_trip(
        s in prop::sample::select(all_schemes()),
        nh in 1usize..=3,
        tokens in 0usize..=40,
        seed in any::<u64>(),
    ) {
        let hd = 64;
        let mut rng = Rng::new(seed);
        let x = gen(Kind::Random, tokens, nh, hd, &mut rng);
        let b = quantize_ok(s, nh, hd, &x, tokens);
        let bytes = b.to_bytes();
        prop_assert_eq!(bytes.len(), 32 + b.bytes());
        prop_assert_eq!(&bytes[32..], &[b.codes(), b.params()].concat()[..]);
        let back = PackedBlock::from_bytes(&bytes).unwrap();
        prop_assert_eq!(&back, &b);
        prop_assert_eq!(back.to_bytes(), bytes);
    }
}

/// The header, byte by byte, as `docs/FORMAT.md` documents it.
#[test]
fn bytes_header_layout() {
    let s = scheme(
        5,
        Axis::PerChannel,
        Group::Size(32),
        Mode::Symmetric,
        ScaleFormat::Bf16,
    );
    let b = small_block(s);
    let h = &b.to_bytes()[..32];
    assert_eq!(
        h,
        [
            b'K', b'V', b'Q', b'B', 1, 5, 1, 0, 1, 1, 0, 0, 32, 0, 0, 0, 2, 0, 0, 0, 16, 0, 0, 0,
            3, 0, 0, 0, 0, 0, 0, 0
        ]
    );
    let s = scheme(
        4,
        Axis::PerToken,
        Group::Vector,
        Mode::Asymmetric,
        ScaleFormat::F32,
    );
    let h = small_block(s).to_bytes();
    assert_eq!(&h[4..16], &[1, 4, 0, 2, 0, 2, 0, 0, 0, 0, 0, 0]);
    let s = scheme(
        8,
        Axis::PerToken,
        Group::Head,
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let h = small_block(s).to_bytes();
    assert_eq!(&h[4..16], &[1, 8, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
}

/// Header fields above 255 are little-endian `u32`s at the offsets of
/// `docs/FORMAT.md`, section 5 (checked against bytes written out by hand),
/// and `from_bytes` reads a block at any address: the input has no
/// alignment.
#[test]
fn bytes_header_multibyte_fields_and_unaligned_input() {
    let s = scheme(
        2,
        Axis::PerToken,
        Group::Size(128),
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let (nh, hd, tokens) = (3, 384, 258);
    let x = gen(Kind::Random, tokens, nh, hd, &mut Rng::new(5));
    let b = quantize_ok(s, nh, hd, &x, tokens);
    let bytes = b.to_bytes();
    #[rustfmt::skip]
    let want: [u8; 32] = [
        0x4B, 0x56, 0x51, 0x42, // magic "KVQB"
        1, 2, 0, 0, 0, 0,       // version, bits, axis, group kind, mode, format
        0, 0,                   // reserved
        0x80, 0, 0, 0,          // group size 128
        3, 0, 0, 0,             // n_kv_heads 3
        0x80, 0x01, 0, 0,       // head_dim 384 = 0x180
        0x02, 0x01, 0, 0,       // tokens 258 = 0x102
        0, 0, 0, 0,             // reserved
    ];
    assert_eq!(bytes[..32], want);
    assert_eq!(bytes.len(), 32 + b.bytes());
    assert_eq!(bytes[32..], [b.codes(), b.params()].concat());
    for off in 0..8 {
        let mut buf = vec![0xA5u8; off];
        buf.extend_from_slice(&bytes);
        assert_eq!(
            PackedBlock::from_bytes(&buf[off..]).unwrap(),
            b,
            "offset {off}"
        );
    }
    // Truncated inside the header, and corrupted high bytes of its fields.
    malformed(PackedBlock::from_bytes(&bytes[..17]), "17 bytes");
    malformed(PackedBlock::from_bytes(&[]), "0 bytes");
    let with = |i: usize, v: u8| {
        let mut x = bytes.clone();
        x[i] = v;
        PackedBlock::from_bytes(&x)
    };
    malformed(with(25, 2), "header says 514 tokens of 3x384");
    malformed(with(27, 1), "header says 16777474 tokens");
    malformed(with(21, 2), "header says 258 tokens of 3x640"); // 128 divides 640
    malformed(with(21, 0), "of 3x128, body has"); // a group of 128 fits, the sizes do not
    malformed(with(13, 1), "body has"); // groups of 384: fewer params
    malformed(with(14, 1), "65664"); // does not divide head_dim
    malformed(with(17, 1), "header says 258 tokens of 259x384");
    // Past kvq's 2^16 heads: rejected as a shape before any size is computed.
    malformed(with(18, 1), "65539 heads of 384 channels");
}

#[test]
fn bytes_malformed() {
    let s = scheme(
        3,
        Axis::PerToken,
        Group::Size(8),
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let b = small_block(s);
    let good = b.to_bytes();
    // Every truncation, and one byte too many.
    for n in 0..good.len() {
        let r = PackedBlock::from_bytes(&good[..n]);
        assert!(
            matches!(r, Err(Error::Malformed { .. })),
            "truncated to {n}: {r:?}"
        );
    }
    malformed(PackedBlock::from_bytes(&good[..31]), "31 bytes");
    malformed(PackedBlock::from_bytes(&good[..40]), "3 tokens");
    malformed(
        PackedBlock::from_bytes(&[&good[..], &[0]].concat()),
        "body has",
    );

    let with = |i: usize, v: u8| {
        let mut x = good.clone();
        x[i] = v;
        PackedBlock::from_bytes(&x)
    };
    malformed(with(0, b'k'), "magic");
    malformed(with(3, b'C'), "magic");
    malformed(with(4, 0), "version 0");
    malformed(with(4, 2), "version 2");
    malformed(with(5, 0), "bits");
    malformed(with(5, 9), "bits");
    malformed(with(6, 2), "axis byte 2");
    malformed(with(7, 3), "group byte 3");
    malformed(with(8, 2), "mode byte 2");
    malformed(with(9, 3), "scale format byte 3");
    malformed(with(12, 12), "multiple of 8");
    malformed(with(12, 48), "48"); // does not divide head_dim 16
    malformed(with(16, 0), "n_kv_heads");
    malformed(with(20, 20), "head_dim");
    malformed(with(24, 4), "header says 4 tokens");
    malformed(with(9, 2), "body has"); // f32 params need twice the bytes

    // Per-channel with Group::Head in the header.
    let mut x = good.clone();
    x[6] = 1;
    x[7] = 1;
    malformed(PackedBlock::from_bytes(&x), "per-channel");
    // Symmetric 1-bit.
    let mut x = good.clone();
    x[5] = 1;
    x[8] = 1;
    malformed(PackedBlock::from_bytes(&x), "symmetric");

    // Bad params: NaN, inf, negative scale; NaN zero.
    let params_at = 32 + b.codes().len();
    let groups = 2; // 16 channels / 8 per group
    for (off, bits, part) in [
        (0usize, 0x7E00u16, "scale 0 of param set 0 is NaN"),
        (2, 0x7C00, "scale 1 of param set 0 is inf"),
        (4 * groups * 2 + 2, 0xBC00, "scale 1 of param set 2 is -1"),
        (
            4 * groups * 5 + 2 * groups,
            0x7E00,
            "zero 0 of param set 5 is NaN",
        ),
    ] {
        let mut x = good.clone();
        x[params_at + off..params_at + off + 2].copy_from_slice(&bits.to_le_bytes());
        malformed(PackedBlock::from_bytes(&x), part);
        // from_parts checks the same.
        let p = x[params_at..].to_vec();
        let e = PackedBlock::from_parts(*b.layout(), 3, b.codes().to_vec(), p).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Malformed {
                    op: "PackedBlock::from_parts",
                    ..
                }
            ),
            "{e:?}"
        );
    }
    // A negative zero point is fine.
    let mut x = good.clone();
    x[params_at + 2 * groups..params_at + 2 * groups + 2].copy_from_slice(&0xBC00u16.to_le_bytes());
    assert!(PackedBlock::from_bytes(&x).is_ok());
}

/// Every single-byte corruption of the header of small blocks is an error
/// or a valid block — never a panic.
#[test]
fn bytes_header_fuzz() {
    for s in [
        scheme(
            3,
            Axis::PerToken,
            Group::Size(8),
            Mode::Asymmetric,
            ScaleFormat::F16,
        ),
        scheme(
            4,
            Axis::PerChannel,
            Group::Size(8),
            Mode::Symmetric,
            ScaleFormat::F32,
        ),
        scheme(
            2,
            Axis::PerToken,
            Group::Vector,
            Mode::Asymmetric,
            ScaleFormat::Bf16,
        ),
    ] {
        let good = small_block(s).to_bytes();
        let mut n_ok = 0;
        for i in 0..32 {
            for v in 0..=255u8 {
                let mut x = good.clone();
                x[i] = v;
                let r = std::panic::catch_unwind(|| PackedBlock::from_bytes(&x));
                let r = r.unwrap_or_else(|_| panic!("{}: byte {i} = {v} panics", s.label()));
                match r {
                    Ok(b) => {
                        n_ok += 1;
                        assert_eq!(b.bytes() + 32, x.len());
                        assert_eq!(b.layout().bytes(b.tokens()), b.bytes());
                        let mut out =
                            vec![
                                0f32;
                                b.tokens() * b.layout().n_kv_heads() * b.layout().head_dim()
                            ];
                        b.dequantize_into(&mut out).unwrap();
                        let back = PackedBlock::from_bytes(&b.to_bytes()).unwrap();
                        assert_eq!(back, b);
                    }
                    Err(Error::Malformed { .. }) => {}
                    Err(e) => panic!("byte {i} = {v}: not Malformed: {e:?}"),
                }
            }
        }
        assert!(n_ok >= 32, "the unchanged value of each byte parses");
    }
}

/// Headers whose sizes multiply past `usize` are rejected, not a panic or an
/// out-of-bounds slice.
#[test]
fn bytes_header_huge_sizes() {
    let mut h = small_block(scheme(
        8,
        Axis::PerToken,
        Group::Size(8),
        Mode::Asymmetric,
        ScaleFormat::F32,
    ))
    .to_bytes()[..32]
        .to_vec();
    for (nh, hd, tokens) in [
        (1u32 << 31, 1u32 << 31, 2u32),
        (u32::MAX, 0xFFFF_FFF8, u32::MAX),
        (1 << 30, 1 << 30, 16),
        (1, 0xFFFF_FFF8, 0xFFFF_FFFF),
    ] {
        h[16..20].copy_from_slice(&nh.to_le_bytes());
        h[20..24].copy_from_slice(&hd.to_le_bytes());
        h[24..28].copy_from_slice(&tokens.to_le_bytes());
        let r = std::panic::catch_unwind(|| PackedBlock::from_bytes(&h));
        let r = r.unwrap_or_else(|_| panic!("{nh}x{hd}x{tokens} panics"));
        assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
    }
}
