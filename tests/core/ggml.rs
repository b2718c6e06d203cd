//! The ggml presets against an independent transcription of llama.cpp's
//! reference quantizers (`quantize_row_q*_ref`, then `dequantize_row_q*`):
//! the same values, bit for bit, on every backend; and the fused kernels
//! over them against the scalar oracle.

use super::*;

/// ggml's reference round trip of one 32-value block of `ty`.
fn ggml_block(ty: &str, x: &[f32]) -> Vec<f32> {
    let f16r = |v: f32| f16::from_f32(v).to_f32();
    match ty {
        "q8_0" => {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let dd = f16r(d);
            x.iter().map(|v| (v * id).round() * dd).collect()
        }
        "q4_0" | "q5_0" => {
            let (half, top) = if ty == "q4_0" { (8, 15) } else { (16, 31) };
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in x {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            let d = max / -(half as f32);
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let dd = f16r(d);
            x.iter()
                .map(|v| {
                    let q = ((v * id + half as f32 + 0.5) as i8 as i32).min(top);
                    (q - half) as f32 * dd
                })
                .collect()
        }
        "q4_1" | "q5_1" => {
            let top = if ty == "q4_1" { 15 } else { 31 };
            let (mut min, mut max) = (f32::MAX, -f32::MAX);
            for &v in x {
                if v < min {
                    min = v;
                }
                if v > max {
                    max = v;
                }
            }
            let d = (max - min) / top as f32;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let (dd, mm) = (f16r(d), f16r(min));
            x.iter()
                .map(|v| {
                    let q = (((v - min) * id + 0.5) as i8 as i32).min(top);
                    q as f32 * dd + mm
                })
                .collect()
        }
        _ => unreachable!(),
    }
}

fn presets_ggml() -> Vec<(&'static str, QuantScheme)> {
    use kvq::presets;
    vec![
        ("q4_0", presets::q4_0()),
        ("q4_1", presets::q4_1()),
        ("q5_0", presets::q5_0()),
        ("q5_1", presets::q5_1()),
        ("q8_0", presets::q8_0()),
    ]
}

/// Rows with the awkward cases: all-zero blocks, exact ties of +m/−m,
/// negative extremes, constant blocks, wide and tiny ranges.
fn awkward_rows(rng: &mut Rng, tokens: usize, width: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(tokens * width);
    for t in 0..tokens {
        for b in 0..width / 32 {
            let kind = (t + b) % 7;
            for j in 0..32 {
                x.push(match kind {
                    0 => 0.0,
                    1 => [1.5, -1.5][j % 2] * (j as f32 / 31.0).max(0.1),
                    2 => -3.0 * rng.unit() - if j == 7 { 10.0 } else { 0.0 },
                    3 => 0.25,
                    4 => rng.f() * 3000.0,
                    5 => rng.f() * 1e-3,
                    _ => rng.normal(),
                });
            }
        }
    }
    x
}

#[test]
fn ggml_presets_match_the_reference_value_for_value() {
    let (n_kv, hd, tokens) = (2, 64, 21);
    let mut rng = Rng::new(17);
    let x = awkward_rows(&mut rng, tokens, n_kv * hd);
    for (ty, s) in presets_ggml() {
        assert_eq!(s.rounding(), kvq::Rounding::Ggml);
        let want: Vec<f32> = x.chunks(32).flat_map(|b| ggml_block(ty, b)).collect();
        let q = UniformQuantizer::new(s, n_kv, hd).unwrap();
        for b in backends() {
            let got = q.quantize_on(b, &x, tokens).unwrap();
            let mut deq = vec![0f32; x.len()];
            got.dequantize_into(&mut deq).unwrap();
            for (i, (g, w)) in deq.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (*g == 0.0 && *w == 0.0),
                    "{ty} {b:?} element {i}: {g} vs ggml {w} (x = {})",
                    x[i]
                );
            }
            // Serialized and read back: the same block.
            let back = PackedBlock::from_bytes(&got.to_bytes()).unwrap();
            assert_eq!(back, got, "{ty}");
        }
    }
}

#[test]
fn ggml_presets_have_ggml_levels() {
    // q4_0 uses all 16 levels: a block whose largest magnitude is positive
    // reaches +8·|d|; the grid's symmetric 4-bit uses 15 (±7).
    let x: Vec<f32> = (0..32).map(|j| j as f32 / 31.0 * 8.0).collect();
    let q = UniformQuantizer::new(kvq::presets::q4_0(), 1, 32).unwrap();
    let r = q.roundtrip(&x, 1).unwrap();
    assert_eq!(r[31], 8.0);
    assert_eq!(r[0], 0.0);
    let grid = kvq::presets::q4_0()
        .with_rounding(kvq::Rounding::Grid)
        .unwrap();
    let levels = |r: &[f32]| {
        let mut v: Vec<u32> = r.iter().map(|x| x.to_bits()).collect();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    let wide: Vec<f32> = (0..32).map(|j| j as f32 - 15.5).collect();
    let rg = UniformQuantizer::new(grid, 1, 32)
        .unwrap()
        .roundtrip(&wide, 1)
        .unwrap();
    let rq = q.roundtrip(&wide, 1).unwrap();
    assert_eq!((levels(&rq), levels(&rg)), (16, 15));
    // Not a ggml type: an error.
    for bad in [
        QuantScheme::new(3, Axis::PerToken, Group::Size(32)),
        QuantScheme::new(4, Axis::PerToken, Group::Size(64)),
        QuantScheme::new(4, Axis::PerChannel, Group::Size(32)),
    ] {
        let e = bad.unwrap().with_rounding(kvq::Rounding::Ggml);
        assert!(matches!(e, Err(Error::InvalidScheme { .. })), "{e:?}");
    }
}

#[test]
fn ggml_presets_through_the_fused_kernels() {
    let (n_kv, hd, tokens) = (1, 128, 200);
    let mut rng = Rng::new(23);
    let x = awkward_rows(&mut rng, tokens, n_kv * hd);
    for (ty, s) in presets_ggml() {
        let block = UniformQuantizer::new(s, n_kv, hd)
            .unwrap()
            .quantize(&x, tokens)
            .unwrap();
        let head = block.head(0);
        for nq in [1, 4] {
            let q: Vec<f32> = (0..nq * hd).map(|_| rng.normal()).collect();
            let p: Vec<f32> = (0..nq * tokens)
                .map(|_| rng.unit() / tokens as f32)
                .collect();
            let (mut ws, mut wv) = (vec![0f32; nq * tokens], vec![0f32; nq * hd]);
            kernels::reference::scores(&head, &q, &mut ws);
            kernels::reference::weighted_sum(&head, &p, &mut wv);
            for b in backends() {
                let (mut gs, mut gv) = (vec![0f32; nq * tokens], vec![0f32; nq * hd]);
                kernels::scores_on(b, &head, &q, &mut gs).unwrap();
                kernels::weighted_sum_on(b, &head, &p, &mut gv).unwrap();
                let scale_s = ws.iter().fold(1f32, |m, v| m.max(v.abs()));
                let scale_v = wv.iter().fold(1f32, |m, v| m.max(v.abs()));
                for (g, w) in gs.iter().zip(&ws) {
                    assert!(
                        (g - w).abs() <= 1e-4 * scale_s,
                        "{ty} {b:?} nq {nq} scores {g} vs {w}"
                    );
                }
                for (g, w) in gv.iter().zip(&wv) {
                    assert!(
                        (g - w).abs() <= 1e-4 * scale_v,
                        "{ty} {b:?} nq {nq} sums {g} vs {w}"
                    );
                }
            }
        }
    }
}
