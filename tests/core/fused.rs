//! Fused kernels against the oracle, on every backend.

use super::*;

/// A kernel under test: `(name, scores, weighted_sum)`, each with the
/// signature of `kernels::scores`/`kernels::weighted_sum`.
type KernelFn<'a> = &'a dyn Fn(&PackedHead<'_>, &[f32], &mut [f32]) -> kvq::Result<()>;
type Kernels<'a> = (&'a str, KernelFn<'a>, KernelFn<'a>);

/// Relative tolerance of a fused kernel against the f64 oracle, relative to
/// the magnitude of the terms it sums: `Σ_c |q_c|·(|scale·code_c| + |zero_c|)`
/// for a score (the fused formula adds `scale·(q·codes)` and `zero·Σq`, so
/// that, not `Σ|q_c·k̂_c|`, is what its rounding scales with) and
/// `|out₀| + Σ_t |p_t|·(|scale·code| + |zero|)` for a weighted sum. Plus, in
/// f32's subnormal range, an absolute `2^-148` per term and code level.
const REL: f64 = 1e-5;

/// Every decoded `(scale, zero)` of a head, and `(set, group)` of an element.
struct HeadParams {
    scales: Vec<f32>,
    zeros: Vec<f32>,
    n: usize,
}

impl HeadParams {
    fn new(head: &PackedHead<'_>) -> Self {
        let l = head.layout();
        let s = l.scheme();
        let (fmt, fb, n) = (s.scale_format(), s.scale_format().bytes(), set_len(l));
        let asym = s.mode() == Mode::Asymmetric;
        let per_set = n * fb * if asym { 2 } else { 1 };
        let (mut scales, mut zeros) = (Vec::new(), Vec::new());
        for p in head.params().chunks(per_set) {
            for g in 0..n {
                let sc = read_fmt(fmt, &p[g * fb..]);
                scales.push(sc);
                zeros.push(if asym {
                    read_fmt(fmt, &p[(n + g) * fb..])
                } else {
                    -sc * (1u32 << (s.bits() - 1)) as f32
                });
            }
        }
        HeadParams { scales, zeros, n }
    }
    fn at(&self, l: &Layout, t: usize, c: usize) -> (f32, f32) {
        let (set, g) = match (l.scheme().axis(), l.scheme().group()) {
            (Axis::PerToken, Group::Size(gs)) => (t, c / gs),
            (Axis::PerToken, _) => (t, 0),
            (Axis::PerChannel, Group::Size(gs)) => (t / gs, c),
            _ => unreachable!(),
        };
        (self.scales[set * self.n + g], self.zeros[set * self.n + g])
    }
}

/// The kernel harness: runs every kernel pair in `under_test` on every head
/// of `block` with the same `n_q` random queries and probabilities, and
/// compares each with the oracle (`kernels::reference`). Returns the worst
/// error in units of the tolerance, or the first mismatch.
fn fused_vs_oracle(
    block: &PackedBlock,
    n_q: usize,
    rng: &mut Rng,
    under_test: &[Kernels<'_>],
) -> Result<f64, String> {
    let l = block.layout();
    let (hd, tokens) = (l.head_dim(), block.tokens());
    let levels = (1u32 << l.scheme().bits()) as f64;
    let label = l.scheme().label();
    let mut worst = 0f64;
    for h in 0..l.n_kv_heads() {
        let head = block.head(h);
        let hp = HeadParams::new(&head);
        // |scale·code| + |zero| of every element, f64.
        let mut mag_k = vec![0f64; tokens * hd];
        for t in 0..tokens {
            let codes = stored_codes(&head, t);
            for c in 0..hd {
                let (s, z) = hp.at(l, t, c);
                mag_k[t * hd + c] = (s as f64 * codes[c] as f64).abs() + (z as f64).abs();
            }
        }
        // Queries: normal, with one loud channel half of the time.
        let loud = rng.below(2) == 0;
        let q: Vec<f32> = (0..n_q * hd)
            .map(|i| rng.normal() * if loud && i % hd == 5 { 100.0 } else { 1.0 })
            .collect();
        let mut want = vec![f32::NAN; n_q * tokens];
        reference::scores(&head, &q, &mut want);
        let tol: Vec<f64> = (0..n_q * tokens)
            .map(|it| {
                let (i, t) = (it / tokens.max(1), it % tokens.max(1));
                let mag: f64 = (0..hd)
                    .map(|c| (q[i * hd + c] as f64).abs() * mag_k[t * hd + c])
                    .sum();
                REL * mag + 2.0 * hd as f64 * levels * TINY
            })
            .collect();
        for (name, scores, _) in under_test {
            let mut got = vec![f32::NAN; n_q * tokens];
            scores(&head, &q, &mut got).map_err(|e| format!("{name}: scores: {e}"))?;
            for (it, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let err = (g as f64 - w as f64).abs();
                if err.is_nan() || err > tol[it] {
                    return Err(format!(
                        "{name}: scores {label}: head {h} query {} token {}: fused {g:e}, \
                         oracle {w:e}, |diff| {err:e} > tol {:e}",
                        it / tokens,
                        it % tokens,
                        tol[it]
                    ));
                }
                worst = worst.max(err / tol[it]);
            }
        }
        // Probabilities: positive, softmax-like, or signed weights in every
        // third call.
        let signed = rng.below(3) == 0;
        let p: Vec<f32> = (0..n_q * tokens)
            .map(|_| {
                let v = (rng.normal() * 2.0).exp() / tokens as f32;
                if signed && rng.below(2) == 0 {
                    -v
                } else {
                    v
                }
            })
            .collect();
        let out0: Vec<f32> = (0..n_q * hd).map(|_| rng.normal()).collect();
        let mut want = out0.clone();
        reference::weighted_sum(&head, &p, &mut want);
        let tol: Vec<f64> = (0..n_q * hd)
            .map(|ic| {
                let (i, c) = (ic / hd, ic % hd);
                let mag: f64 = (0..tokens)
                    .map(|t| (p[i * tokens + t] as f64).abs() * mag_k[t * hd + c])
                    .sum();
                REL * (mag + (out0[ic] as f64).abs()) + 2.0 * tokens as f64 * levels * TINY
            })
            .collect();
        for (name, _, wsum) in under_test {
            let mut got = out0.clone();
            wsum(&head, &p, &mut got).map_err(|e| format!("{name}: weighted_sum: {e}"))?;
            for (ic, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let err = (g as f64 - w as f64).abs();
                if err.is_nan() || err > tol[ic] {
                    return Err(format!(
                        "{name}: weighted_sum {label}: head {h} query {} channel {}: \
                         fused {g:e}, oracle {w:e}, |diff| {err:e} > tol {:e}",
                        ic / hd,
                        ic % hd,
                        tol[ic]
                    ));
                }
                worst = worst.max(err / tol[ic]);
            }
        }
    }
    Ok(worst)
}

/// The harness on every available backend: the one place that lists what
/// is under test, so a backend added to `Backend::ALL` is covered here.
fn fused_all(block: &PackedBlock, n_q: usize, rng: &mut Rng) -> Result<f64, String> {
    let list = backends();
    let scores: Vec<_> = list
        .iter()
        .map(|&b| {
            move |h: &PackedHead<'_>, q: &[f32], o: &mut [f32]| kernels::scores_on(b, h, q, o)
        })
        .collect();
    let wsums: Vec<_> = list
        .iter()
        .map(|&b| {
            move |h: &PackedHead<'_>, p: &[f32], o: &mut [f32]| kernels::weighted_sum_on(b, h, p, o)
        })
        .collect();
    let under_test: Vec<Kernels<'_>> = list
        .iter()
        .zip(scores.iter().zip(&wsums))
        .map(|(b, (s, w))| (b.name(), s as KernelFn<'_>, w as KernelFn<'_>))
        .collect();
    fused_vs_oracle(block, n_q, rng, &under_test)
}

/// The sweep: every bits 1–8 × mode × axis/group × scale format, one input
/// kind each, chosen so that every (axis, mode, format) meets every kind;
/// token counts, head dims, heads and query counts rotate through the
/// awkward values.
#[test]
fn fused_kernels_match_oracle() {
    let token_counts = [1usize, 7, 31, 33, 1023, 2, 64];
    let head_dims = [64usize, 128, 256, 8, 24];
    let mut rng = Rng::new(29);
    let mut worst = 0f64;
    let mut seen = std::collections::HashSet::new();
    for (k, s) in all_schemes().into_iter().enumerate() {
        let gi = GROUPS.iter().position(|&g| g == s.group()).unwrap();
        let kind = KINDS[((s.bits() as usize - 1) * GROUPS.len() + gi) % KINDS.len()];
        let mut tokens = token_counts[k % token_counts.len()];
        let mut hd = head_dims[(k / 2) % head_dims.len()];
        if let Group::Size(n) = s.group() {
            if s.axis() == Axis::PerToken && !hd.is_multiple_of(n) {
                hd = 64.max(n);
            }
        }
        let nh = 1 + (k / 3) % 2;
        // 1023 tokens only every third time, and at most 64 wide (debug
        // builds; `fused_kernels_long_and_wide` has the big ones).
        if tokens == 1023 && ((k / 3) % 3 != 0 || nh * hd > 64) {
            tokens = 33;
        }
        let n_q = 1 + k % 8;
        let x = gen(kind, tokens, nh, hd, &mut rng);
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        let huge_f16 = kind == Kind::Huge && s.scale_format() == ScaleFormat::F16;
        seen.insert(format!(
            "{kind:?} {:?} {:?} {:?}",
            s.axis(),
            s.mode(),
            s.scale_format()
        ));
        let block = match q.quantize(&x, tokens) {
            Ok(b) => b,
            Err(Error::ScaleOverflow { .. }) if huge_f16 => continue,
            Err(e) => panic!("{} {kind:?}: {e}", s.label()),
        };
        assert!(!huge_f16, "1e30 with f16 scales must overflow");
        let w = fused_all(&block, n_q, &mut rng)
            .unwrap_or_else(|e| panic!("{kind:?} {tokens}x{nh}x{hd} n_q {n_q}: {e}"));
        worst = worst.max(w);
    }
    eprintln!("worst error {worst:.3} of the tolerance");
    assert_eq!(seen.len(), KINDS.len() * 2 * 2 * 3);
}

/// The big shapes: 1023 tokens at head dims 64, 128, 256, 8 queries.
#[test]
fn fused_kernels_long_and_wide() {
    let mut rng = Rng::new(31);
    for (bits, axis, group, mode, hd) in [
        (4, Axis::PerToken, Group::Size(32), Mode::Asymmetric, 64),
        (3, Axis::PerChannel, Group::Size(32), Mode::Symmetric, 128),
        (8, Axis::PerToken, Group::Head, Mode::Symmetric, 256),
        (2, Axis::PerChannel, Group::Size(64), Mode::Asymmetric, 256),
    ] {
        let s = scheme(bits, axis, group, mode, ScaleFormat::F16);
        let x = gen(Kind::OutlierChannel, 1023, 1, hd, &mut rng);
        let block = quantize_ok(s, 1, hd, &x, 1023);
        fused_all(&block, 8, &mut rng).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn fused_kernels_random(
        s in prop::sample::select(all_schemes()),
        nh in 1usize..=2,
        hd_i in 0usize..4,
        tokens in 0usize..=80,
        n_q in 1usize..=8,
        kind in prop::sample::select(KINDS.to_vec()),
        seed in any::<u64>(),
    ) {
        let hd = [8usize, 16, 24, 64][hd_i];
        if let Group::Size(n) = s.group() {
            prop_assume!(s.axis() == Axis::PerChannel || hd.is_multiple_of(n));
        }
        let mut rng = Rng::new(seed);
        let x = gen(kind, tokens, nh, hd, &mut rng);
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        let block = match q.quantize(&x, tokens) {
            Err(Error::ScaleOverflow { .. }) if kind == Kind::Huge => return Ok(()),
            r => r.unwrap(),
        };
        fused_all(&block, n_q, &mut rng).map_err(TestCaseError::fail)?;
    }
}

/// The harness is not a tautology: a kernel that is off by a fraction of one
/// step in one place, or forgets the zero, is caught.
#[test]
fn harness_catches_a_wrong_kernel() {
    let mut rng = Rng::new(37);
    let x = gen(Kind::Random, 33, 1, 64, &mut rng);
    for axis in [Axis::PerToken, Axis::PerChannel] {
        let s = scheme(4, axis, Group::Size(32), Mode::Asymmetric, ScaleFormat::F16);
        let block = quantize_ok(s, 1, 64, &x, 33);
        let good = |h: &PackedHead<'_>, q: &[f32], o: &mut [f32]| {
            reference::scores(h, q, o);
            Ok(())
        };
        let good_w = |h: &PackedHead<'_>, p: &[f32], o: &mut [f32]| {
            reference::weighted_sum(h, p, o);
            Ok(())
        };
        assert!(fused_vs_oracle(&block, 2, &mut rng, &[("oracle", &good, &good_w)]).is_ok());
        // A score off by a quarter step of one element, in the last token
        // of the last query.
        let off = |h: &PackedHead<'_>, q: &[f32], o: &mut [f32]| {
            reference::scores(h, q, o);
            let (s, _) = stored_param(h, 0, 0);
            assert!(s > 0.0);
            let last = o.len() - 1;
            o[last] += s / 4.0 * q[0].abs().max(1.0);
            Ok(())
        };
        let r = fused_vs_oracle(
            &block,
            2,
            &mut rng,
            &[("good", &good, &good_w), ("off", &off, &good_w)],
        );
        assert!(r.unwrap_err().starts_with("off: scores"));
        // A weighted sum that drops the zero of token 0.
        let no_zero = |h: &PackedHead<'_>, p: &[f32], o: &mut [f32]| {
            reference::weighted_sum(h, p, o);
            let (_, z) = stored_param(h, 0, 0);
            o[0] -= p[0] * z;
            Ok(())
        };
        let r = fused_vs_oracle(&block, 1, &mut rng, &[("no_zero", &good, &no_zero)]);
        assert!(r.unwrap_err().starts_with("no_zero: weighted_sum"));
    }
}

/// `scores`/`weighted_sum` (detected backend) are `*_on(detect())`, and a
/// `PackedHead` over an engine's own buffers reads the same as the block's.
#[test]
fn kernels_entry_points_agree() {
    let mut rng = Rng::new(41);
    let (nh, hd, tokens) = (2, 64, 40);
    let s = scheme(
        5,
        Axis::PerChannel,
        Group::Size(16),
        Mode::Asymmetric,
        ScaleFormat::Bf16,
    );
    let x = gen(Kind::OutlierChannel, tokens, nh, hd, &mut rng);
    let block = quantize_ok(s, nh, hd, &x, tokens);
    let q: Vec<f32> = (0..3 * hd).map(|_| rng.normal()).collect();
    let p: Vec<f32> = (0..3 * tokens).map(|_| rng.unit()).collect();
    for h in 0..nh {
        let view = block.head(h);
        let own = PackedHead::new(*block.layout(), tokens, view.codes(), view.params()).unwrap();
        let (mut a, mut b) = (vec![0f32; 3 * tokens], vec![0f32; 3 * tokens]);
        kernels::scores(&view, &q, &mut a).unwrap();
        kernels::scores_on(Backend::detect(), &own, &q, &mut b).unwrap();
        assert_eq!(a, b);
        let (mut a, mut b) = (vec![1f32; 3 * hd], vec![1f32; 3 * hd]);
        kernels::weighted_sum(&view, &p, &mut a).unwrap();
        kernels::weighted_sum_on(Backend::detect(), &own, &p, &mut b).unwrap();
        assert_eq!(a, b);
    }
}
