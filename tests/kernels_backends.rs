//! One harness, every backend: the packed kernels of each available
//! [`Backend`] against the oracle (`kernels::reference`), and the dense
//! baselines against plain loops.
//!
//! Backends the CPU lacks are skipped with a message (a failure under
//! `KVQ_REQUIRE_ALL=1`, which CI sets). The
//! tolerance is relative to the magnitude of the terms summed, elementwise:
//! for a score, `Σ_c |q_c|·(|scale·code| + |zero|)`; for a weighted sum,
//! `|out₀| + Σ_t |p_t|·(|scale·code| + |zero|)` — the numbers each kernel
//! actually adds, whose rounding is what the backends may differ by.

mod common;

use common::{backends, Rng, KERNEL_TOL};
use half::{bf16, f16};
use kvq::kernels::{self, dense, reference};
use kvq::{
    Axis, Backend, Group, KvQuantizer, Layout, Mode, PackedHead, QuantScheme, ScaleFormat,
    UniformQuantizer,
};

fn read(fmt: ScaleFormat, b: &[u8]) -> f32 {
    match fmt {
        ScaleFormat::F16 => f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        ScaleFormat::Bf16 => bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        ScaleFormat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// `|scale·code| + |zero|` of every element `[tokens, head_dim]`: the
/// magnitude of what a kernel adds for it.
fn term_bounds(head: &PackedHead<'_>) -> Vec<f64> {
    let l = head.layout();
    let s = l.scheme();
    let (hd, t) = (l.head_dim(), head.tokens());
    let fmt = s.scale_format();
    let fb = fmt.bytes();
    let mut codes = vec![0u8; hd];
    let mut out = vec![0f64; t * hd];
    let set_len = match s.axis() {
        Axis::PerToken => l.groups_per_row(),
        Axis::PerChannel => hd,
    };
    let set_bytes = set_len * s.param_bytes();
    for tt in 0..t {
        kvq::pack::unpack(
            &head.codes()[tt * l.row_bytes()..(tt + 1) * l.row_bytes()],
            s.bits(),
            &mut codes,
        );
        for c in 0..hd {
            let (k, g) = match s.axis() {
                Axis::PerToken => (tt, c / l.channels_per_group()),
                Axis::PerChannel => (tt / l.group_len(), c),
            };
            let base = k * set_bytes;
            let scale = read(fmt, &head.params()[base + g * fb..]) as f64;
            let zero = match s.mode() {
                Mode::Asymmetric => read(fmt, &head.params()[base + (set_len + g) * fb..]) as f64,
                _ => -scale * (1u32 << (s.bits() - 1)) as f64,
            };
            out[tt * hd + c] = (scale * codes[c] as f64).abs() + zero.abs();
        }
    }
    out
}

/// Scores and weighted sums of every backend against the oracle.
fn check_head(head: &PackedHead<'_>, rng: &mut Rng, nq: usize, what: &str) {
    let hd = head.layout().head_dim();
    let t = head.tokens();
    let bound = term_bounds(head);
    let q: Vec<f32> = (0..nq * hd).map(|_| rng.f()).collect();
    let mut want = vec![0f32; nq * t];
    reference::scores(head, &q, &mut want);
    let p: Vec<f32> = (0..nq * t).map(|_| rng.f()).collect();
    let out0: Vec<f32> = (0..nq * hd).map(|_| rng.f()).collect();
    let mut want_ws = out0.clone();
    reference::weighted_sum(head, &p, &mut want_ws);
    for b in backends() {
        let mut got = vec![f32::NAN; nq * t];
        kernels::scores_on(b, head, &q, &mut got).unwrap();
        for i in 0..nq {
            for tt in 0..t {
                let mag: f64 = (0..hd)
                    .map(|c| (q[i * hd + c].abs() as f64) * bound[tt * hd + c])
                    .sum();
                let (g, w) = (got[i * t + tt] as f64, want[i * t + tt] as f64);
                assert!(
                    (g - w).abs() <= KERNEL_TOL * mag + 1e-38,
                    "{} scores {what}, nq {nq}, query {i}, token {tt}: got {g}, want {w} (magnitude {mag})",
                    b.name()
                );
            }
        }
        let mut got = out0.clone();
        kernels::weighted_sum_on(b, head, &p, &mut got).unwrap();
        for i in 0..nq {
            for c in 0..hd {
                let mag = out0[i * hd + c].abs() as f64
                    + (0..t)
                        .map(|tt| p[i * t + tt].abs() as f64 * bound[tt * hd + c])
                        .sum::<f64>();
                let (g, w) = (got[i * hd + c] as f64, want_ws[i * hd + c] as f64);
                assert!(
                    (g - w).abs() <= KERNEL_TOL * mag + 1e-38,
                    "{} weighted_sum {what}, nq {nq}, query {i}, channel {c}: got {g}, want {w} (magnitude {mag})",
                    b.name()
                );
            }
        }
    }
}

/// Kinds of data to quantize.
#[derive(Debug, Clone, Copy)]
enum Data {
    /// Uniform in `[-1, 1)`.
    Uniform,
    /// Every token the same constant row (zero-range groups).
    Constant,
    /// A few huge channels and tokens (the key-outlier case).
    Outliers,
    /// Magnitudes around 1e30 (f32 scales only).
    Huge,
    /// Magnitudes around 1e-30, some subnormal (f32 scales only).
    Tiny,
    /// Magnitudes around 1e-6: subnormal f16 scales.
    F16Subnormal,
}

fn make(data: Data, rng: &mut Rng, tokens: usize, width: usize) -> Vec<f32> {
    let hot: Vec<bool> = (0..width).map(|_| rng.below(16) == 0).collect();
    (0..tokens * width)
        .map(|i| match data {
            Data::Uniform => rng.f(),
            Data::Constant => 0.375,
            Data::Outliers => {
                let x = rng.f();
                if hot[i % width] || rng.below(200) == 0 {
                    x * 3000.0
                } else {
                    x
                }
            }
            Data::Huge => rng.f() * 1e30,
            Data::Tiny => rng.f() * if rng.below(2) == 0 { 1e-30 } else { 1e-39 },
            Data::F16Subnormal => rng.f() * 1e-6,
        })
        .collect()
}

fn scheme(bits: u8, axis: Axis, group: Group, mode: Mode, fmt: ScaleFormat) -> Option<QuantScheme> {
    QuantScheme::new(bits, axis, group)
        .and_then(|s| s.with_mode(mode))
        .ok()
        .map(|s| s.with_scale_format(fmt))
}

fn groups(axis: Axis, hd: usize) -> Vec<Group> {
    match axis {
        Axis::PerToken => {
            let mut g: Vec<Group> = [8, 16, 32, 64, 128]
                .iter()
                .filter(|&&n| hd.is_multiple_of(n))
                .map(|&n| Group::Size(n))
                .collect();
            g.extend([Group::Head, Group::Vector]);
            g
        }
        Axis::PerChannel => vec![
            Group::Size(8),
            Group::Size(24),
            Group::Size(32),
            Group::Size(128),
        ],
    }
}

fn run_case(rng: &mut Rng, s: QuantScheme, hd: usize, tokens: usize, nq: usize, data: Data) {
    let n_kv = 2;
    let q = UniformQuantizer::new(s, n_kv, hd).unwrap();
    let x = make(data, rng, tokens, n_kv * hd);
    let block = match q.quantize(&x, tokens) {
        Ok(b) => b,
        // Only values near 1e30 can overflow a scale (bf16/f32 scales, a
        // grid top beyond f32); anywhere else an overflow is a bug.
        Err(kvq::Error::ScaleOverflow { .. }) if matches!(data, Data::Huge) => return,
        Err(e) => panic!("{}: {e}", s.label()),
    };
    // Head 1: its codes and params start past head 0's.
    let what = format!("{} hd {hd} tokens {tokens} {data:?}", s.label());
    check_head(&block.head(1), rng, nq, &what);
}

const MODES: [Mode; 2] = [Mode::Asymmetric, Mode::Symmetric];
const FORMATS: [ScaleFormat; 3] = [ScaleFormat::F16, ScaleFormat::Bf16, ScaleFormat::F32];

/// Every width, axis, mode and format at the head dims that matter, with
/// the awkward token counts; groups and query counts vary by case.
#[test]
fn every_scheme_every_backend() {
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    for bits in 1..=8u8 {
        for axis in [Axis::PerToken, Axis::PerChannel] {
            for mode in MODES {
                for fmt in FORMATS {
                    for hd in [64, 128, 256] {
                        let tokens = rng.pick(&[1, 7, 31, 33, 100]);
                        let group = rng.pick(&groups(axis, hd));
                        let nq = 1 + rng.below(8);
                        if let Some(s) = scheme(bits, axis, group, mode, fmt) {
                            run_case(&mut rng, s, hd, tokens, nq, Data::Uniform);
                        }
                    }
                }
            }
        }
    }
}

/// Query counts one to nine at every head dim with a compile-time shape
/// (64, 128, 256): the fused per-token weighted sum takes one to four and
/// eight queries (4-bit rows one to eight), the tile kernels the others;
/// per-channel keys run the fused scores; each width, in whole and partial
/// tiles.
#[test]
fn fused_kernels_for_every_query_count() {
    let mut rng = Rng::new(0x5EED_0003);
    for bits in [2u8, 3, 4, 8] {
        for axis in [Axis::PerToken, Axis::PerChannel] {
            for mode in MODES {
                // Per-channel keys read f16 params straight from the stored
                // bytes and the others through a widened copy: both paths.
                let fmts: &[ScaleFormat] = match axis {
                    Axis::PerChannel => &[ScaleFormat::F16, ScaleFormat::Bf16, ScaleFormat::F32],
                    _ => &[ScaleFormat::F16],
                };
                for &fmt in fmts {
                    let s =
                        scheme(bits, axis, Group::Size(32), mode, fmt).expect("a 32-wide scheme");
                    for hd in [64, 128, 256] {
                        for nq in 1..=9 {
                            for tokens in [5, 40] {
                                run_case(&mut rng, s, hd, tokens, nq, Data::Uniform);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Head dims whose planes do not split into whole vectors (the generic
/// unpack path), and every group size.
#[test]
fn odd_head_dims_and_all_groups() {
    let mut rng = Rng::new(42);
    for hd in [8, 24, 40, 72, 96, 200] {
        for bits in 1..=8u8 {
            for axis in [Axis::PerToken, Axis::PerChannel] {
                for group in groups(axis, hd) {
                    let mode = rng.pick(&MODES);
                    let fmt = rng.pick(&FORMATS);
                    let tokens = rng.pick(&[1, 7, 17, 33]);
                    if let Some(s) = scheme(bits, axis, group, mode, fmt) {
                        let nq = 1 + rng.below(4);
                        run_case(&mut rng, s, hd, tokens, nq, Data::Uniform);
                    }
                }
            }
        }
    }
}

/// Head dims past the kernels' compile-time shapes and register budgets
/// (the run-time path, more vectors per row than any unrolled loop).
#[test]
fn wide_head_dims() {
    let mut rng = Rng::new(11);
    for hd in [520, 1024] {
        for bits in [2, 4, 8] {
            for (axis, group) in [
                (Axis::PerToken, Group::Size(8)),
                (Axis::PerChannel, Group::Size(32)),
            ] {
                for mode in MODES {
                    if let Some(s) = scheme(bits, axis, group, mode, ScaleFormat::F16) {
                        let nq = 1 + rng.below(2);
                        run_case(&mut rng, s, hd, 40, nq, Data::Uniform);
                    }
                }
            }
        }
    }
}

/// Long contexts (1023 tokens: many tiles, a partial last tile and block).
#[test]
fn long_context() {
    let mut rng = Rng::new(7);
    for bits in [2, 3, 4, 8] {
        for (axis, group) in [
            (Axis::PerToken, Group::Size(32)),
            (Axis::PerChannel, Group::Size(32)),
        ] {
            let s = scheme(bits, axis, group, Mode::Asymmetric, ScaleFormat::F16).unwrap();
            run_case(
                &mut rng,
                s,
                128,
                1023,
                if bits == 4 { 4 } else { 1 },
                Data::Uniform,
            );
        }
    }
}

/// Zero-range groups, outliers, extreme magnitudes and subnormal scales.
#[test]
fn awkward_values() {
    let mut rng = Rng::new(2024);
    let cases = [
        (Data::Constant, ScaleFormat::F16),
        (Data::Constant, ScaleFormat::F32),
        (Data::Outliers, ScaleFormat::F16),
        (Data::Outliers, ScaleFormat::Bf16),
        (Data::Huge, ScaleFormat::F32),
        (Data::Huge, ScaleFormat::Bf16),
        (Data::Tiny, ScaleFormat::F32),
        (Data::F16Subnormal, ScaleFormat::F16),
    ];
    for (data, fmt) in cases {
        for bits in [1, 2, 3, 4, 5, 8] {
            for axis in [Axis::PerToken, Axis::PerChannel] {
                for hd in [64, 128] {
                    let group = if axis == Axis::PerToken {
                        Group::Size(32)
                    } else {
                        Group::Size(16)
                    };
                    let mode = rng.pick(&MODES);
                    if let Some(s) = scheme(bits, axis, group, mode, fmt) {
                        let (tokens, nq) = (rng.pick(&[7, 33]), 1 + rng.below(3));
                        run_case(&mut rng, s, hd, tokens, nq, data);
                    }
                }
            }
        }
    }
}

/// Random code bytes and random params straight through `PackedHead::new`:
/// every code value appears, not just what a quantizer makes.
#[test]
fn random_bytes() {
    let mut rng = Rng::new(0xDEAD_BEEF);
    for _ in 0..150 {
        let bits = 1 + rng.below(8) as u8;
        let axis = rng.pick(&[Axis::PerToken, Axis::PerChannel]);
        let hd = rng.pick(&[16, 64, 128, 256, 56]);
        let group = rng.pick(&groups(axis, hd));
        let mode = rng.pick(&MODES);
        let fmt = rng.pick(&FORMATS);
        let Some(s) = scheme(bits, axis, group, mode, fmt) else {
            continue;
        };
        let l: Layout = s.layout(1, hd).unwrap();
        let tokens = rng.pick(&[1, 7, 31, 33, 64]);
        let codes: Vec<u8> = (0..l.head_code_bytes(tokens))
            .map(|_| rng.next_u64() as u8)
            .collect();
        let n = l.param_bytes(tokens) / s.scale_format().bytes();
        let mut params = vec![0u8; l.param_bytes(tokens)];
        let fb = fmt.bytes();
        for i in 0..n {
            let x = rng.f();
            let b = &mut params[i * fb..(i + 1) * fb];
            match fmt {
                ScaleFormat::F16 => b.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
                ScaleFormat::Bf16 => b.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
                _ => b.copy_from_slice(&x.to_le_bytes()),
            }
        }
        let head = PackedHead::new(l, tokens, &codes, &params).unwrap();
        let nq = 1 + rng.below(8);
        check_head(
            &head,
            &mut rng,
            nq,
            &format!("random {} hd {hd} tokens {tokens}", s.label()),
        );
    }
}

/// No tokens: nothing written, nothing added.
#[test]
fn empty_head() {
    let s = QuantScheme::new(4, Axis::PerChannel, Group::Size(32)).unwrap();
    let l = s.layout(1, 64).unwrap();
    let head = PackedHead::new(l, 0, &[], &[]).unwrap();
    for b in backends() {
        let mut out: Vec<f32> = vec![];
        kernels::scores_on(b, &head, &[1.0; 128], &mut out).unwrap();
        let mut o = vec![0.5f32; 128];
        kernels::weighted_sum_on(b, &head, &[], &mut o).unwrap();
        assert!(o.iter().all(|&x| x == 0.5));
    }
}

#[test]
fn backend_api() {
    let d = Backend::detect();
    assert!(d.is_available());
    assert_eq!(Backend::detect(), d, "detection is cached");
    assert_eq!(Backend::ALL.last(), Some(&Backend::Avx512));
    let names: Vec<_> = Backend::ALL.iter().map(|b| b.name()).collect();
    assert_eq!(names, ["portable", "avx2", "avx512"]);
    assert!(Backend::available().contains(&Backend::Portable));
}

/// Dense baselines against plain loops, every backend, odd shapes.
#[test]
fn dense_baselines() {
    let mut rng = Rng::new(99);
    for hd in [1, 3, 8, 15, 16, 64, 72, 128, 130] {
        for t in [0, 1, 7, 15, 16, 17, 33, 100] {
            let nq = 1 + rng.below(5);
            let k32: Vec<f32> = (0..t * hd).map(|_| rng.f() * 4.0).collect();
            let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
            let k16f: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
            let q: Vec<f32> = (0..nq * hd).map(|_| rng.f()).collect();
            let p: Vec<f32> = (0..nq * t).map(|_| rng.f()).collect();
            let out0: Vec<f32> = (0..nq * hd).map(|_| rng.f()).collect();
            for (kf, is16) in [(&k32, false), (&k16f, true)] {
                // Plain loops in f64, and the magnitudes for the tolerance.
                let s_want: Vec<(f64, f64)> = (0..nq * t)
                    .map(|x| {
                        let (i, tt) = (x / t, x % t);
                        (0..hd).fold((0.0, 0.0), |(s, m), c| {
                            let v = q[i * hd + c] as f64 * kf[tt * hd + c] as f64;
                            (s + v, m + v.abs())
                        })
                    })
                    .collect();
                let w_want: Vec<(f64, f64)> = (0..nq * hd)
                    .map(|x| {
                        let (i, c) = (x / hd, x % hd);
                        (0..t).fold((out0[x] as f64, out0[x].abs() as f64), |(s, m), tt| {
                            let v = p[i * t + tt] as f64 * kf[tt * hd + c] as f64;
                            (s + v, m + v.abs())
                        })
                    })
                    .collect();
                for b in backends() {
                    let mut s = vec![f32::NAN; nq * t];
                    let mut w = out0.clone();
                    if is16 {
                        dense::scores_f16_on(b, hd, &k16, &q, &mut s).unwrap();
                        dense::weighted_sum_f16_on(b, hd, &k16, &p, &mut w).unwrap();
                    } else {
                        dense::scores_f32_on(b, hd, &k32, &q, &mut s).unwrap();
                        dense::weighted_sum_f32_on(b, hd, &k32, &p, &mut w).unwrap();
                    }
                    for (g, &(want, m)) in s.iter().zip(&s_want) {
                        assert!(
                            (*g as f64 - want).abs() <= 1e-6 * m + 1e-30,
                            "{} dense scores f16={is16} hd {hd} t {t}: {g} vs {want}",
                            b.name()
                        );
                    }
                    for (g, &(want, m)) in w.iter().zip(&w_want) {
                        assert!(
                            (*g as f64 - want).abs() <= 1e-6 * m + 1e-30,
                            "{} dense sum f16={is16} hd {hd} t {t}: {g} vs {want}",
                            b.name()
                        );
                    }
                }
            }
        }
    }
}

/// Wrong lengths are errors, not panics, on every backend.
#[test]
fn length_errors() {
    let s = QuantScheme::new(4, Axis::PerToken, Group::Size(32)).unwrap();
    let q = UniformQuantizer::new(s, 1, 64).unwrap();
    let block = q.quantize(&vec![0.5f32; 64 * 10], 10).unwrap();
    let head = block.head(0);
    for b in backends() {
        assert!(kernels::scores_on(b, &head, &[0.0; 63], &mut [0.0; 10]).is_err());
        assert!(kernels::scores_on(b, &head, &[0.0; 64], &mut [0.0; 9]).is_err());
        assert!(kernels::weighted_sum_on(b, &head, &[0.0; 9], &mut [0.0; 64]).is_err());
        assert!(dense::scores_f32_on(b, 64, &[0.0; 65], &[0.0; 64], &mut [0.0; 1]).is_err());
        assert!(dense::scores_f32_on(b, 0, &[], &[], &mut []).is_err());
        assert!(
            dense::weighted_sum_f16_on(b, 64, &[f16::ZERO; 64], &[0.0; 2], &mut [0.0; 64]).is_err()
        );
    }
}

/// Softmax and its unnormalized parts against f64, every backend.
#[test]
fn softmax_every_backend() {
    let mut rng = Rng::new(5);
    for n in [0, 1, 2, 7, 15, 16, 17, 31, 100, 1000, 4099] {
        for spread in [1.0f32, 30.0, 200.0] {
            let x: Vec<f32> = (0..n).map(|_| rng.f() * spread).collect();
            let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for b in backends() {
                let mut p = x.clone();
                let (pm, ps) = kernels::softmax_parts_on(b, &mut p);
                if n == 0 {
                    assert_eq!((pm, ps), (f32::NEG_INFINITY, 0.0));
                    continue;
                }
                assert_eq!(pm as f64, m);
                assert!(
                    (ps as f64 - sum).abs() <= 1e-6 * sum,
                    "{} sum {ps} vs {sum}",
                    b.name()
                );
                // `x − max` is rounded to f32 first: relative error
                // |x − max|·2^-24 on top of the 2 ulp of `exp`.
                let tol = |v: f32| 4e-7 + (m - v as f64).abs() * 6e-8;
                for ((g, w), &v) in p.iter().zip(&e).zip(&x) {
                    assert!(
                        (*g as f64 - w).abs() <= tol(v) * w + 1e-37,
                        "{} n {n}: e {g} vs {w}",
                        b.name()
                    );
                }
                let mut s = x.clone();
                kernels::softmax_on(b, &mut s);
                for ((g, w), &v) in s.iter().zip(&e).zip(&x) {
                    let w = w / sum;
                    assert!(
                        (*g as f64 - w).abs() <= (tol(v) + 1.5e-6) * w + 1e-37,
                        "{} n {n}: p {g} vs {w}",
                        b.name()
                    );
                }
            }
        }
    }
}

/// The opt-in int8-query scores stay within their documented bound,
/// `(δ/2)·Σ_c code_tc` with `δ = max_c |q_c·scale_c| / 127` per block, of
/// the exact scores, on every backend (where the int8 kernel does not run,
/// they are the exact scores).
#[test]
fn int8_scores_error_bound() {
    let mut rng = Rng::new(31337);
    for bits in [1, 2, 3, 4, 5, 8] {
        for hd in [64, 128, 256] {
            for fmt in FORMATS {
                let s = scheme(
                    bits,
                    Axis::PerChannel,
                    Group::Size(32),
                    Mode::Asymmetric,
                    fmt,
                )
                .unwrap();
                let tokens = 77;
                let nq = 1 + rng.below(4);
                let qz = UniformQuantizer::new(s, 1, hd).unwrap();
                let x = make(Data::Outliers, &mut rng, tokens, hd);
                let block = qz.quantize(&x, tokens).unwrap();
                let head = block.head(0);
                let l = head.layout();
                let q: Vec<f32> = (0..nq * hd).map(|_| rng.f()).collect();
                let mut want = vec![0f32; nq * tokens];
                reference::scores(&head, &q, &mut want);
                let bound = term_bounds(&head);
                let fb = fmt.bytes();
                let mut codes = vec![0u8; hd];
                for b in backends() {
                    let mut got = vec![0f32; nq * tokens];
                    kernels::scores_i8_on(b, &head, &q, &mut got).unwrap();
                    for t in 0..tokens {
                        kvq::pack::unpack(
                            &head.codes()[t * l.row_bytes()..(t + 1) * l.row_bytes()],
                            bits,
                            &mut codes,
                        );
                        let set = (t / 32) * 2 * hd * fb;
                        for i in 0..nq {
                            let qi = &q[i * hd..(i + 1) * hd];
                            let delta = (0..hd)
                                .map(|c| {
                                    (qi[c] * read(fmt, &head.params()[set + c * fb..])).abs() as f64
                                })
                                .fold(0.0, f64::max)
                                / 127.0;
                            let sum_codes: f64 = codes.iter().map(|&c| c as f64).sum();
                            let mag: f64 = (0..hd)
                                .map(|c| qi[c].abs() as f64 * bound[t * hd + c])
                                .sum();
                            let lim = delta / 2.0 * sum_codes * (1.0 + 1e-6) + KERNEL_TOL * mag;
                            let (g, w) = (got[i * tokens + t] as f64, want[i * tokens + t] as f64);
                            assert!(
                                (g - w).abs() <= lim,
                                "{} {} hd {hd} token {t}: {g} vs {w}, bound {lim}",
                                b.name(),
                                s.label()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The quantizer's SIMD loops (`UniformQuantizer::quantize_on`) give the
/// same bytes as the portable ones, for every width, axis, mode, format and
/// group, odd head dims and token counts, and awkward data; and the same
/// error for the same bad input.
#[test]
fn quantize_is_bit_identical_on_every_backend() {
    let bes = backends();
    let mut rng = Rng::new(0xC0FFEE);
    let datas = [
        Data::Uniform,
        Data::Constant,
        Data::Outliers,
        Data::Huge,
        Data::Tiny,
        Data::F16Subnormal,
    ];
    let mut cases = 0;
    for bits in 1..=8u8 {
        for axis in [Axis::PerToken, Axis::PerChannel] {
            for mode in MODES {
                for fmt in FORMATS {
                    for hd in [8, 24, 64, 72, 128, 256] {
                        let group = rng.pick(&groups(axis, hd));
                        let Some(s) = scheme(bits, axis, group, mode, fmt) else {
                            continue;
                        };
                        let Ok(q) = UniformQuantizer::new(s, 3, hd) else {
                            continue;
                        };
                        let tokens = rng.pick(&[1, 5, 17, 33, 40]);
                        let data = rng.pick(&datas);
                        let mut x = make(data, &mut rng, tokens, 3 * hd);
                        if rng.below(8) == 0 {
                            let i = rng.below(x.len());
                            x[i] = rng.pick(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
                        }
                        let want = q.quantize_on(Backend::Portable, &x, tokens);
                        for &b in &bes {
                            let got = q.quantize_on(b, &x, tokens);
                            match (&want, &got) {
                                (Ok(w), Ok(g)) => assert!(
                                    w.to_bytes() == g.to_bytes(),
                                    "{} on {}: bytes differ ({} hd {hd} {data:?})",
                                    s.label(),
                                    b.name(),
                                    tokens
                                ),
                                (Err(w), Err(g)) => {
                                    assert_eq!(w.to_string(), g.to_string(), "{}", s.label())
                                }
                                _ => panic!(
                                    "{} on {}: {:?} vs {:?}",
                                    s.label(),
                                    b.name(),
                                    want.as_ref().err(),
                                    got.as_ref().err()
                                ),
                            }
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(cases > 300, "only {cases} cases ran");
}
