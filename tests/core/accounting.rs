//! Accounting.

use super::*;

/// Bytes of a block by the formula of `docs/FORMAT.md`, from first principles.
fn formula_bytes(s: &QuantScheme, nh: usize, hd: usize, tokens: usize) -> usize {
    let codes = tokens * nh * hd * s.bits() as usize / 8;
    let pb = s.scale_format().bytes() * if s.mode() == Mode::Asymmetric { 2 } else { 1 };
    let params = match (s.axis(), s.group()) {
        (Axis::PerToken, Group::Size(n)) => tokens * nh * (hd / n) * pb,
        (Axis::PerToken, Group::Head) => tokens * nh * pb,
        (Axis::PerToken, Group::Vector) => tokens * pb,
        (Axis::PerChannel, Group::Size(n)) => tokens.div_ceil(n) * nh * hd * pb,
        _ => unreachable!(),
    };
    codes + params
}

#[test]
fn accounting_sweep() {
    let mut rng = Rng::new(43);
    for s in all_schemes() {
        for (nh, hd) in [(1usize, 8usize), (2, 24), (3, 64), (1, 256)] {
            let Ok(layout) = s.layout(nh, hd) else {
                // Only a per-token group that does not divide head_dim fails.
                let Group::Size(n) = s.group() else {
                    panic!("{}", s.label())
                };
                assert!(s.axis() == Axis::PerToken && hd % n != 0);
                continue;
            };
            let q = UniformQuantizer::from_layout(layout);
            let gl = layout.group_len();
            for tokens in [0usize, 1, 7, 31, 33, 64, 128, 1023, 4096] {
                let want = formula_bytes(&s, nh, hd, tokens);
                assert_eq!(
                    layout.bytes(tokens),
                    want,
                    "{} {nh}x{hd} t{tokens}",
                    s.label()
                );
                assert_eq!(layout.code_bytes(tokens) + layout.param_bytes(tokens), want);
                // A real block allocates exactly that (a few sizes: debug
                // builds quantize slowly).
                if [0, 1, 7, 33].contains(&tokens) && (hd <= 64 || tokens <= 1) {
                    let x: Vec<f32> = (0..tokens * nh * hd).map(|_| rng.normal()).collect();
                    let b = q.quantize(&x, tokens).unwrap();
                    assert_eq!(b.bytes(), want, "{} {nh}x{hd} t{tokens}", s.label());
                    assert_eq!(b.codes().len() + b.params().len(), want);
                    assert_eq!(b.codes().len(), layout.code_bytes(tokens));
                    assert_eq!(b.params().len(), layout.param_bytes(tokens));
                }
                let whole = s.axis() == Axis::PerToken || tokens % gl == 0;
                if whole {
                    let eb = layout.effective_bits() * (tokens * nh * hd) as f64 / 8.0;
                    if gl.is_power_of_two() {
                        assert_eq!(eb, want as f64, "{} {nh}x{hd} t{tokens}", s.label());
                    } else {
                        assert!((eb - want as f64).abs() <= 1e-9 * want as f64);
                    }
                }
            }
            assert_eq!(
                layout.bytes_per_token() * layout.block_tokens() as f64,
                layout.bytes(layout.block_tokens()) as f64
            );
        }
    }
}

/// The study's numbers.
#[test]
fn accounting_study_examples() {
    // GPT-2 small: K 6 bits / V 4 bits, f16 scale + zero per 64 channels.
    let k = QuantScheme::new(6, Axis::PerToken, Group::Size(64)).unwrap();
    let v = QuantScheme::new(4, Axis::PerToken, Group::Size(64)).unwrap();
    let (lk, lv) = (k.layout(12, 64).unwrap(), v.layout(12, 64).unwrap());
    assert_eq!(lk.effective_bits(), 6.5);
    assert_eq!(lv.effective_bits(), 4.5);
    let bits = (lk.effective_bits() + lv.effective_bits()) / 2.0;
    assert_eq!(bits, 5.5);
    assert_eq!(format!("{:.2}", 16.0 / bits), "2.91");
    // Per head and token: 48+4 and 32+4 bytes against 2·128 of f16.
    assert_eq!((lk.bytes(1), lv.bytes(1)), (12 * 52, 12 * 36));
    assert_eq!(
        format!(
            "{:.2}",
            (12 * 256) as f64 / (lk.bytes(1) + lv.bytes(1)) as f64
        ),
        "2.91"
    );

    // Qwen3.5: head dim 256, 4 KV heads, 8 full-attention layers,
    // K 4 bits / V 8 bits per 256 channels.
    let k = QuantScheme::new(4, Axis::PerToken, Group::Size(256)).unwrap();
    let v = QuantScheme::new(8, Axis::PerToken, Group::Size(256)).unwrap();
    let (lk, lv) = (k.layout(4, 256).unwrap(), v.layout(4, 256).unwrap());
    let bits = (lk.effective_bits() + lv.effective_bits()) / 2.0;
    assert_eq!(bits, 6.125);
    assert_eq!(format!("{:.2}", 16.0 / bits), "2.61");
    // 262144 tokens: bf16 cache 8.6 GB, 5.3 GB saved.
    let tokens = 262_144usize;
    let dense = 8 * 2 * tokens * 4 * 256 * 2;
    assert_eq!(dense / tokens, 32 * 1024);
    let packed = 8 * (lk.bytes(tokens) + lv.bytes(tokens));
    assert_eq!(format!("{:.1}", dense as f64 / 1e9), "8.6");
    assert_eq!(format!("{:.1}", (dense - packed) as f64 / 1e9), "5.3");
}
