//! Packing.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// pack → unpack is the identity for every width and row length, and the
    /// bytes are exactly those of the normative rule.
    #[test]
    fn pack_unpack_identity(bits in 1u8..=8, n8 in 1usize..64, seed in any::<u64>()) {
        let n = n8 * 8;
        let mut rng = Rng::new(seed);
        let codes: Vec<u8> = (0..n).map(|_| (rng.next_u64() >> (64 - bits)) as u8).collect();
        let mut packed = vec![0xA5u8; packed_len(n, bits)];
        prop_assert_eq!(packed.len(), n * bits as usize / 8);
        pack(&codes, bits, &mut packed);
        prop_assert_eq!(&packed, &ref_pack(&codes, bits));
        let mut back = vec![0xFFu8; n];
        unpack(&packed, bits, &mut back);
        prop_assert_eq!(&back, &codes);
        // unpack is a function of the bytes only: a packed row of random
        // bytes unpacks to what the rule says.
        let noise: Vec<u8> = (0..packed.len()).map(|_| rng.next_u64() as u8).collect();
        unpack(&noise, bits, &mut back);
        prop_assert_eq!(&back, &ref_unpack(&noise, bits, n));
    }
}

/// The packing examples of `docs/FORMAT.md`, section 2.
#[test]
fn pack_worked_examples() {
    let codes = [5u8, 3, 7, 0, 6, 1, 2, 4, 4, 2, 1, 6, 0, 7, 3, 5];
    let mut out = [0u8; 6];
    pack(&codes, 3, &mut out);
    assert_eq!(out, [0x09, 0xE7, 0xDB, 0x60, 0x17, 0xE8]);

    // Every width: c_i = i mod 2^b.
    let table: [&[u8]; 8] = [
        &[0x00, 0xFF],
        &[0x00, 0x55, 0xAA, 0xFF],
        &[0x00, 0x55, 0xAA, 0xFF, 0xCC, 0xCC],
        &[0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7],
        &[0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7, 0, 0],
        &[0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7, 0, 0, 0, 0],
        &[
            0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7, 0, 0, 0, 0, 0, 0,
        ],
        &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    ];
    for (bits, want) in (1..=8u8).zip(table) {
        let codes: Vec<u8> = (0..16).map(|i| (i % (1usize << bits)) as u8).collect();
        let mut out = vec![0u8; packed_len(16, bits)];
        pack(&codes, bits, &mut out);
        assert_eq!(out, want, "{bits} bits");
    }

    let mut out = [0u8; 2];
    pack(
        &[1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0],
        1,
        &mut out,
    );
    // element i is bit i div 2 of byte i mod 2
    assert_eq!(out, [0b1110_0011, 0b0111_1010]);
}

/// The block examples of `docs/FORMAT.md`, sections 4 and 5, byte for byte.
#[test]
fn format_doc_block_examples() {
    let s = QuantScheme::new(3, Axis::PerToken, Group::Size(8)).unwrap();
    let q = UniformQuantizer::new(s, 2, 8).unwrap();
    let x: Vec<f32> = [
        [0.0f32, 1., 2., 3., 4., 5., 6., 7.],
        [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5],
        [3.0; 8],
        [1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0],
    ]
    .concat();
    let b = q.quantize(&x, 2).unwrap();
    let want: Vec<u8> = [
        &b"KVQB"[..],
        &[
            1, 3, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 2, 0, 0, 0, 8, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,
        ],
        &[
            0x88, 0xDD, 0xF0, 0, 0, 0, 0x88, 0xDD, 0xF0, 0x77, 0x22, 0x0F,
        ],
        &[0x00, 0x3C, 0x00, 0x00, 0x00, 0x00, 0x00, 0x42],
        &[0x00, 0x38, 0x00, 0xC0, 0x00, 0x38, 0x00, 0xC0],
    ]
    .concat();
    assert_eq!(b.to_bytes(), want);
    assert_eq!(q.roundtrip(&x, 2).unwrap(), x);

    let s = QuantScheme::new(4, Axis::PerToken, Group::Size(8))
        .unwrap()
        .with_mode(Mode::Symmetric)
        .unwrap();
    let q = UniformQuantizer::new(s, 1, 8).unwrap();
    let x = [-7.0f32, -3.5, 0.0, 0.5, 1.0, 2.0, 3.5, 7.0];
    let b = q.quantize(&x, 1).unwrap();
    assert_eq!(b.codes(), [0x91, 0xA5, 0xC8, 0xF9]);
    assert_eq!(b.params(), [0x00, 0x3C]);
    assert_eq!(
        q.roundtrip(&x, 1).unwrap(),
        [-7.0, -3.0, 0.0, 1.0, 1.0, 2.0, 4.0, 7.0]
    );

    // Section 6: per-channel partial block, Vector.
    let l = QuantScheme::new(2, Axis::PerChannel, Group::Size(8))
        .unwrap()
        .layout(1, 8)
        .unwrap();
    assert_eq!((l.code_bytes(10), l.param_bytes(10)), (20, 64));
    let l = QuantScheme::new(3, Axis::PerToken, Group::Vector)
        .unwrap()
        .layout(12, 64)
        .unwrap();
    assert_eq!(l.bytes(1), 292);
}

#[test]
#[should_panic(expected = "does not fit")]
fn pack_rejects_oversized_codes() {
    let mut out = [0u8; 3];
    pack(&[8, 0, 0, 0, 0, 0, 0, 0], 3, &mut out);
}
