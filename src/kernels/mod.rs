//! Dequant-fused attention kernels: scores `q·Kᵀ` and the weighted sum
//! `p·V`, read straight from packed codes.
//!
//! * scores, per-token keys: `s_t = Σ_g scale_tg·(q_g·codes_tg) + zero_tg·Σq_g`
//! * scores, per-channel keys: the block's channel scales are folded into the
//!   query once per block, `q'_c = q_c·scale_c`, then `s_t = q'·codes_t + q·zero`
//! * weighted sum, per-token values: `out = Σ_t (p_t·scale_t)·codes_t + Σ_t p_t·zero_t`
//! * weighted sum, per-channel values: `out_c = scale_c·Σ_t p_t·code_tc + zero_c·Σ_t p_t`
//!
//! All kernels take several queries at once (the query heads that share a
//! KV head under GQA) and unpack each code row once for all of them. They
//! are single-threaded and work on one KV head: callers spread heads (and
//! chunks of long contexts) over threads.
//!
//! | function | what |
//! |---|---|
//! | [`scores`] / [`scores_on`] | `q·k̂` for every packed key, exact `f32` |
//! | [`scores_i8`] / [`scores_i8_on`] | the same with an int8-quantized query (opt-in, AVX-512 VNNI, documented extra error) |
//! | [`weighted_sum_i8`] / [`weighted_sum_i8_on`] | the weighted sum with int8-quantized weights (opt-in, AVX-512 VNNI, documented extra error) |
//! | [`softmax`] / [`softmax_parts`] | vectorized softmax; the unnormalized `(max, sum)` form merges chunks |
//! | [`weighted_sum`] / [`weighted_sum_on`] | `Σ p·v̂`, accumulated into the output |
//! | [`dense`] | the same over unquantized `f32`/`f16` rows: the baselines |
//! | [`reference`](mod@reference) | the oracle (dequantize, `f64` math) |
//!
//! In the SIMD backends, per-token keys and values are dequantized into a
//! tile buffer in L1 as `fma(code, scale, zero)` (shared by all the queries
//! of a KV head), which costs the same as folding scales per group and
//! handles every group size alike.
//!
//! The layout follows the concepts and the hardware: `scores.rs`,
//! `weighted_sum.rs` and `softmax.rs` hold the public functions and their
//! kernel values; [`reference`](mod@reference) is the oracle, `portable`
//! runs anywhere, and `x86_64/generic/` holds the SIMD kernels, written
//! once over the vector vocabulary of `crate::simd` (one file per concept:
//! prefetch, unpack, params, fused scores, scores, weighted sum, dense,
//! softmax), with the AVX-512 VNNI kernels in `x86_64/int8.rs`. A
//! [`Backend`] is chosen once at run time (or forced); each public function
//! hands a kernel value to the one dispatch in `crate::simd`, which runs it
//! inside the backend's `#[target_feature]` trampoline. [`dense`] holds the
//! unquantized f32/f16 baselines.
//!
//! # Hardware
//!
//! | backend | needs | vector | tile |
//! |---|---|---|---|
//! | [`Backend::Avx512`] | x86-64 AVX-512F/BW/VL, AVX2, FMA, F16C | 16 × f32 | 16 tokens |
//! | [`Backend::Avx2`] | x86-64 AVX2, FMA, F16C | 8 × f32 | 8 tokens |
//! | [`Backend::Portable`] | any CPU | — | 1 token |
//!
//! Detection uses `is_x86_feature_detected!` at run time, once; nothing
//! depends on `-C target-cpu`. Every bit width 1–8, both axes and all scale
//! formats run on every backend. The SIMD backends unpack with one shift
//! and one mask per vector whenever each plane of a row is a whole (or, on
//! AVX-512, a half) number of vectors — every width at `head_dim` 128 or
//! 256, every width at 64 — and otherwise through
//! [`pack::unpack`](crate::pack::unpack) followed by the same vector math.
//!
//! # Numerics
//!
//! All backends compute in `f32` from the stored scales and zeros, and
//! agree with [`reference`](mod@reference) (dequantize, then `f64` math) to
//! within `1e-6` of `Σ_c |q_c·k̂_c|` for scores and of `Σ_t |p_t·v̂_t|` for
//! weighted sums (the tolerance the backend tests hold every kernel to). The SIMD backends use FMA and another summation order
//! than the portable one, so backends differ in the last bits; force
//! [`Backend::Portable`] for results identical across machines.

/// The packed kernel `$tile` (`generic::scores` or `generic::weighted_sum`) for
/// every shape [`x86_64::by_shape!`] distinguishes, one module per shape
/// (so the shapes are compiled as separate, parallel codegen units), and
/// `$run(backend, head, x, out)`, which sends a head to its shape's kernel.
/// `$check(head, x.len(), out.len())` asserts the lengths the raw loops
/// rely on; `$portable` is the portable body.
macro_rules! packed_kernel {
    ($run:ident, $tile:ident, $portable:path, $check:expr) => {
        packed_kernel!(
            @shapes $run, $tile, $portable, $check,
            [
                shape_2_128 = (2, 128),
                shape_3_128 = (3, 128),
                shape_4_128 = (4, 128),
                shape_8_128 = (8, 128),
                shape_2_64 = (2, 64),
                shape_3_64 = (3, 64),
                shape_4_64 = (4, 64),
                shape_8_64 = (8, 64),
                shape_2_256 = (2, 256),
                shape_3_256 = (3, 256),
                shape_4_256 = (4, 256),
                shape_8_256 = (8, 256)
            ]
        );
    };
    // One module per listed shape and the any-shape module; `$run` routes
    // by the same list (`x86_64::compiled_shape` says which it compiles).
    (@shapes $run:ident, $tile:ident, $portable:path, $check:expr,
     [$($m:ident = ($b:literal, $hd:literal)),*]) => {
        $(packed_kernel!(@shape $m, $b, $hd, $tile, $portable, $check);)*
        packed_kernel!(@shape shape_any, 0, 0, $tile, $portable, $check);

        /// Run the kernel for `head`'s shape on `backend` (lengths checked).
        fn $run(backend: Backend, head: &PackedHead<'_>, x: &[f32], out: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            super::x86_64::by_shape!(
                head,
                [$($m = ($b, $hd)),*; shape_any],
                (backend, head, x, out)
            );
            #[cfg(not(target_arch = "x86_64"))]
            shape_any::run(backend, head, x, out);
        }
    };
    (@shape $m:ident, $b:literal, $hd:literal, $tile:ident, $portable:path, $check:expr) => {
        mod $m {
            use crate::simd::{Backend, Kernel};
            use crate::store::PackedHead;

            /// The kernel's arguments, lengths already checked, for a head of
            /// this module's shape (`(0, 0)`: any shape).
            struct Args<'a, 'h> {
                head: &'a PackedHead<'h>,
                x: &'a [f32],
                out: &'a mut [f32],
            }

            impl Kernel for Args<'_, '_> {
                type Output = ();

                fn portable(self) {
                    $portable(self.head, self.x, self.out)
                }

                #[cfg(target_arch = "x86_64")]
                #[inline(always)]
                fn simd<S: crate::simd::x86_64::Simd>(self, s: S) {
                    use crate::kernels::x86_64::{fused_shape, generic};
                    let Args { head, x, out } = self;
                    ($check)(head, x.len(), out.len());
                    if const { fused_shape::<S>($b, $hd) } {
                        // SAFETY: `$check` asserted every length the raw
                        // loops rely on; `by_shape!` sends only heads of
                        // this shape here (any, for `(0, 0)`); `s` proves
                        // the features this body is compiled with.
                        unsafe { generic::$tile::<S, $b, $hd>(s, head, x, out) }
                    } else {
                        unreachable!("kernels: no kernel for this shape on this token")
                    }
                }
            }

            pub(super) fn run(backend: Backend, head: &PackedHead<'_>, x: &[f32], out: &mut [f32]) {
                backend.dispatch(Args { head, x, out })
            }
        }
    };
}

pub(crate) mod codebook;
pub mod dense;
pub mod reference;

pub(crate) mod portable;
pub(crate) mod rope;
mod scores;
mod softmax;
pub(crate) mod sparse;
mod weighted_sum;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_64;

pub use crate::simd::Backend;
pub(crate) use portable::{axpy, dot};
pub use scores::{scores, scores_i8, scores_i8_is_int8, scores_i8_on, scores_on};
pub use softmax::{softmax, softmax_on, softmax_parts, softmax_parts_on};
pub use weighted_sum::{
    weighted_sum, weighted_sum_i8, weighted_sum_i8_is_int8, weighted_sum_i8_on, weighted_sum_on,
};

use crate::error::Result;

/// Ask for the first tokens of `head`'s codes and params ahead of the
/// call that reads them: the next page of a cache, while the current one
/// is computed (a kernel's own prefetch stops at its buffer's end). A
/// hint only: nothing is read, on any backend.
pub(crate) fn prefetch_head(backend: Backend, head: &crate::store::PackedHead<'_>) {
    #[cfg(target_arch = "x86_64")]
    if backend != Backend::Portable {
        let l = head.layout();
        let t = head.tokens();
        x86_64::generic::prefetch_start(head.codes().as_ptr(), l.row_bytes(), t);
        let pb = head.params().len() / t.max(1);
        x86_64::generic::prefetch_start(head.params().as_ptr(), pb, t);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (backend, head);
}

pub(crate) fn check_queries(op: &'static str, hd: usize, q_len: usize) -> Result<usize> {
    crate::quant::check_rows(
        op,
        "query values (a positive multiple of head_dim)",
        q_len,
        hd,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Axis, Group, KvQuantizer, Mode, QuantScheme, ScaleFormat, UniformQuantizer};

    /// The int8-weight VNNI kernel follows its portable specification
    /// (same integer sums, same `f32` operations), and the specification
    /// stays inside its stated error bound against the exact weighted sum.
    #[test]
    fn int8_weights_match_their_specification_and_bound() {
        use crate::scheme::{Mode, ScaleFormat};
        let mut seed = 11u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let mut kernel_ran = false;
        for bits in [4u8, 8, 3] {
            for hd in [64, 128, 256] {
                for (tokens, nq, g, mode, fmt) in [
                    (0, 1, 32, Mode::Asymmetric, ScaleFormat::F16),
                    (1, 1, 32, Mode::Asymmetric, ScaleFormat::F16),
                    (37, 2, 32, Mode::Asymmetric, ScaleFormat::F16),
                    (100, 1, 16, Mode::Symmetric, ScaleFormat::F32),
                    (64, 3, 64, Mode::Asymmetric, ScaleFormat::Bf16),
                    (50, 1, hd, Mode::Symmetric, ScaleFormat::F16),
                    // GQA 8 over tiles of 16 and a partial one.
                    (83, 8, 16, Mode::Asymmetric, ScaleFormat::F16),
                ] {
                    let s = QuantScheme::new(bits, Axis::PerToken, Group::Size(g))
                        .unwrap()
                        .with_mode(mode)
                        .unwrap()
                        .with_scale_format(fmt);
                    let qz = UniformQuantizer::new(s, 1, hd).unwrap();
                    // Outliers in some tokens, a constant (zero-range) row.
                    let x: Vec<f32> = (0..tokens * hd)
                        .map(|i| match (i / hd) % 7 {
                            3 => 0.5,
                            5 => rnd() * 40.0,
                            _ => rnd() * 3.0,
                        })
                        .collect();
                    let block = qz.quantize(&x, tokens).unwrap();
                    let head = block.head(0);
                    // Softmax-like weights: a few heavy tokens, a long tail.
                    let p: Vec<f32> = (0..nq * tokens)
                        .map(|i| {
                            (rnd() * 6.0).exp() / tokens as f32
                                * if i % 5 == 0 { -1.0 } else { 1.0 }
                        })
                        .collect();
                    let start: Vec<f32> = (0..nq * hd).map(|_| rnd()).collect();
                    let mut want = start.clone();
                    portable::weighted_sum_i8(&head, &p, &mut want);
                    let mut exact = start.clone();
                    portable::weighted_sum(&head, &p, &mut exact);
                    // The bound: δ/2 per token and group times the codes.
                    let l = head.layout();
                    let (gpr, cpg) = (l.groups_per_row(), l.channels_per_group());
                    let mut sc = vec![0f32; gpr];
                    let mut ze = vec![0f32; gpr];
                    for i in 0..nq {
                        let mut bound = vec![0f32; gpr];
                        let mut mag = vec![0f32; gpr];
                        for t0 in (0..tokens).step_by(portable::I8_TILE) {
                            let mut amax = vec![0f32; gpr];
                            for t in t0..(t0 + portable::I8_TILE).min(tokens) {
                                head.params_into(t, &mut sc, &mut ze);
                                for g in 0..gpr {
                                    let w = p[i * tokens + t] * sc[g];
                                    amax[g] = amax[g].max(w.abs());
                                    mag[g] += w.abs() * ((1u32 << bits) - 1) as f32
                                        + (p[i * tokens + t] * ze[g]).abs();
                                }
                            }
                            let n = (tokens - t0).min(portable::I8_TILE) as f32;
                            for g in 0..gpr {
                                bound[g] += amax[g] / 254.0 * n * ((1u32 << bits) - 1) as f32;
                            }
                        }
                        for c in 0..hd {
                            let (a, b) = (want[i * hd + c], exact[i * hd + c]);
                            let g = c / cpg;
                            let slack = 1e-5 * (mag[g] + start[i * hd + c].abs());
                            assert!(
                                (a - b).abs() <= bound[g] * 1.0001 + slack,
                                "bits {bits} hd {hd} g {g}: {a} vs exact {b}, bound {}",
                                bound[g]
                            );
                        }
                    }
                    let close = |got: &[f32]| {
                        for (a, b) in got.iter().zip(&want) {
                            assert!(
                                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                                "bits {bits} hd {hd} g {g} nq {nq}: {a} vs {b}"
                            );
                        }
                    };
                    let mut got = start.clone();
                    weighted_sum_i8_on(Backend::Avx512, &head, &p, &mut got).unwrap();
                    if weighted_sum_i8_is_int8(Backend::Avx512, &head, nq) {
                        close(&got);
                    } else {
                        // Several queries, other shapes, CPUs without VNNI:
                        // the exact kernel.
                        let mut e = start.clone();
                        weighted_sum_on(Backend::Avx512, &head, &p, &mut e).unwrap();
                        assert_eq!(got, e);
                    }
                    // The kernel itself takes several queries too.
                    #[cfg(target_arch = "x86_64")]
                    if let (true, Some(v)) = (
                        x86_64::Avx512Vnni::takes_ws(&head),
                        x86_64::Avx512Vnni::new(),
                    ) {
                        let mut direct = start.clone();
                        v.weighted_sum_i8(&head, &p, &mut direct);
                        close(&direct);
                        kernel_ran = true;
                    }
                }
            }
        }
        if !kernel_ran {
            println!("skipping the int8-weight kernel: this CPU has no AVX-512 VNNI");
        }
    }

    /// The VNNI kernel computes exactly the integer sums of the portable
    /// specification; only the final `δ·sum + bias` may round differently.
    #[test]
    fn int8_kernel_matches_its_specification() {
        let mut seed = 7u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        for bits in 1..=8u8 {
            for hd in [64, 128, 256] {
                for (tokens, nq, g, mode, fmt) in [
                    (1, 1, 32, Mode::Asymmetric, ScaleFormat::F16),
                    (33, 4, 32, Mode::Asymmetric, ScaleFormat::F16),
                    (100, 9, 24, Mode::Asymmetric, ScaleFormat::F16),
                    (64, 2, 128, Mode::Asymmetric, ScaleFormat::F16),
                    (40, 1, 32, Mode::Symmetric, ScaleFormat::F16),
                    (40, 2, 16, Mode::Asymmetric, ScaleFormat::Bf16),
                    (40, 1, 32, Mode::Symmetric, ScaleFormat::F32),
                ] {
                    let s = QuantScheme::new(bits, Axis::PerChannel, Group::Size(g))
                        .unwrap()
                        .with_scale_format(fmt);
                    let s = if bits >= 2 {
                        s.with_mode(mode).unwrap()
                    } else {
                        s
                    };
                    let qz = UniformQuantizer::new(s, 1, hd).unwrap();
                    let x: Vec<f32> = (0..tokens * hd).map(|_| rnd() * 3.0).collect();
                    let block = qz.quantize(&x, tokens).unwrap();
                    let head = block.head(0);
                    let q: Vec<f32> = (0..nq * hd).map(|_| rnd()).collect();
                    let mut want = vec![0f32; nq * tokens];
                    portable::scores_i8(&head, &q, &mut want);
                    let mut got = vec![0f32; nq * tokens];
                    scores_i8_on(Backend::Avx512, &head, &q, &mut got).unwrap();
                    if !scores_i8_is_int8(Backend::Avx512, &head) {
                        println!("skipping the int8 kernel: this CPU has no AVX-512 VNNI");
                        return;
                    }
                    // `δ·sum` and the bias each reach `Σ_c |q_c|·6` (keys in
                    // [−3, 3]) and may cancel: a last-bit difference in
                    // either is relative to that, not to the score.
                    for (t, (a, b)) in got.iter().zip(&want).enumerate() {
                        let qi = &q[t / tokens * hd..(t / tokens + 1) * hd];
                        let mag = 9.0 * qi.iter().map(|v| v.abs()).sum::<f32>();
                        assert!(
                            (a - b).abs() <= 2.0 * f32::EPSILON * (1.0 + mag),
                            "bits {bits} hd {hd} g {g} {mode:?} {fmt:?}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
