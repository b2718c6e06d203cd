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
//! The layout follows the hardware: [`reference`](mod@reference) is the
//! oracle, `portable` runs anywhere, and architecture files hold the SIMD
//! versions (`x86_64/avx2.rs`, `x86_64/avx512.rs`, both instances of the
//! generic tile kernels in `x86_64/tile.rs`). A [`Backend`] is chosen once
//! at run time (or forced). [`dense`] holds the unquantized f32/f16
//! baselines.
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
//! about `1e-6` of `Σ_c |q_c·k̂_c|` for scores and of `Σ_t |p_t·v̂_t|` for
//! weighted sums. The SIMD backends use FMA and another summation order
//! than the portable one, so backends differ in the last bits; force
//! [`Backend::Portable`] for results identical across machines.

pub mod dense;
pub mod reference;

pub(crate) mod portable;

pub(crate) use portable::{axpy, dot};
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_64;

use crate::error::{Error, Result};
use crate::store::PackedHead;
use std::sync::atomic::{AtomicU8, Ordering};

/// Which implementation of the kernels runs.
///
/// [`Backend::detect`] picks the best one the CPU supports, once, and caches
/// it. Set the environment variable `KVQ_BACKEND=portable` (read at first
/// detection) or pass a backend explicitly (`*_on` functions,
/// [`CacheConfig::backend`](crate::CacheConfig::backend)) to force one —
/// e.g. [`Backend::Portable`] for results that are bit-identical across
/// machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// Plain Rust; every CPU.
    Portable,
    /// x86-64 with AVX2, FMA and F16C: 256-bit vectors.
    Avx2,
    /// x86-64 with AVX-512F/BW/VL (and AVX2, FMA, F16C): 512-bit vectors.
    Avx512,
}

static DETECTED: AtomicU8 = AtomicU8::new(0);

impl Backend {
    /// Every backend this build knows, best last.
    pub const ALL: &'static [Backend] = &[Backend::Portable, Backend::Avx2, Backend::Avx512];

    /// The best backend this CPU supports (detected once, then cached).
    pub fn detect() -> Backend {
        match DETECTED.load(Ordering::Relaxed) {
            0 => {
                let b = Self::detect_uncached();
                DETECTED.store(b.id(), Ordering::Relaxed);
                b
            }
            id => Self::from_id(id),
        }
    }

    fn detect_uncached() -> Backend {
        if let Ok(v) = std::env::var("KVQ_BACKEND") {
            if let Some(b) = Self::ALL
                .iter()
                .find(|b| b.name() == v.to_ascii_lowercase())
            {
                if b.is_available() {
                    return *b;
                }
            }
        }
        *Self::ALL
            .iter()
            .rev()
            .find(|b| b.is_available())
            .unwrap_or(&Backend::Portable)
    }

    fn id(self) -> u8 {
        match self {
            Backend::Portable => 1,
            Backend::Avx2 => 2,
            Backend::Avx512 => 3,
        }
    }
    fn from_id(id: u8) -> Backend {
        Self::ALL
            .iter()
            .copied()
            .find(|b| b.id() == id)
            .unwrap_or(Backend::Portable)
    }

    /// Whether this CPU can run it.
    pub fn is_available(self) -> bool {
        match self {
            Backend::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => x86_64::Avx2::new().is_some(),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 => x86_64::Avx512::new().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Avx2 | Backend::Avx512 => false,
        }
    }

    /// Every backend this CPU can run.
    pub fn available() -> Vec<Backend> {
        Self::ALL
            .iter()
            .copied()
            .filter(|b| b.is_available())
            .collect()
    }

    /// Lowercase name (`"portable"`, `"avx2"`, `"avx512"`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Portable => "portable",
            Backend::Avx2 => "avx2",
            Backend::Avx512 => "avx512",
        }
    }
}

fn check_queries(op: &'static str, hd: usize, q_len: usize) -> Result<usize> {
    if q_len == 0 || !q_len.is_multiple_of(hd) {
        return Err(Error::Length {
            op,
            what: "query values (a positive multiple of head_dim)",
            expected: hd * (q_len / hd).max(1),
            got: q_len,
        });
    }
    Ok(q_len / hd)
}

/// Attention logits of `n_q` queries against every key of a head, straight
/// from packed codes: `out[i·tokens + t] = q_i · k̂_t` (unscaled).
///
/// `q` is `[n_q, head_dim]`; `out` is `[n_q, tokens]`. Uses
/// [`Backend::detect`].
///
/// # Errors
/// [`Error::Length`] when `q` is empty or not a multiple of `head_dim`, or
/// `out` is not `n_q·tokens` long.
///
/// # Example: scores from packed keys
/// ```
/// use kvq::{kernels, Axis, Group, KvQuantizer, QuantScheme, UniformQuantizer};
/// let q = UniformQuantizer::new(QuantScheme::new(4, Axis::PerChannel, Group::Size(32))?, 1, 64)?;
/// let keys: Vec<f32> = (0..100 * 64).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect();
/// let packed = q.quantize(&keys, 100)?;
/// let query = vec![0.5f32; 64];
/// let mut logits = vec![0.0; 100];
/// kernels::scores(&packed.head(0), &query, &mut logits)?;
/// // The same number as attention over the dequantized keys:
/// let k0 = &q.roundtrip(&keys, 100)?[..64];
/// let want: f32 = k0.iter().map(|k| k * 0.5).sum();
/// assert!((logits[0] - want).abs() < 1e-4);
/// # Ok::<(), kvq::Error>(())
/// ```
pub fn scores(head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) -> Result<()> {
    scores_on(Backend::detect(), head, q, out)
}

/// [`scores`] on a chosen backend (falls back to portable if the CPU lacks it).
///
/// # Errors
/// As [`scores`].
pub fn scores_on(
    backend: Backend,
    head: &PackedHead<'_>,
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let nq = check_queries("scores", head.layout().head_dim(), q.len())?;
    crate::quant::check_len("scores", "output logits", nq * head.tokens(), out.len())?;
    #[cfg(target_arch = "x86_64")]
    match backend {
        Backend::Avx512 => {
            if let Some(s) = x86_64::Avx512::new() {
                s.scores(head, q, out);
                return Ok(());
            }
        }
        Backend::Avx2 => {
            if let Some(s) = x86_64::Avx2::new() {
                s.scores(head, q, out);
                return Ok(());
            }
        }
        Backend::Portable => {}
    }
    portable::scores(head, q, out);
    Ok(())
}

/// Scores with an int8-quantized query — opt-in, faster, approximate.
/// Uses [`Backend::detect`].
///
/// For per-channel keys with `head_dim` a multiple of 64 on a CPU with
/// AVX-512 VNNI, each block's folded query `q'_c = q_c·scale_c` is rounded
/// to int8 with one step `δ = max_c |q'_c| / 127`, `q̃_c = round(q'_c/δ)`,
/// and multiplied into the unsigned codes with `vpdpbusd` (exact `i32`
/// sums): `ŝ_t = δ·Σ_c q̃_c·code_tc + q·zero`. About 4x less work per token
/// than the exact kernel, which matters when the cache is in L2/L3 rather
/// than DRAM.
///
/// **Extra error**, against the exact score `s_t` of [`scores`]: the query
/// rounding adds at most `δ/2` per channel, so
/// `|ŝ_t − s_t| ≤ (δ/2)·Σ_c code_tc ≤ (δ/2)·head_dim·(2^bits − 1)`,
/// and typically (independent roundings) about
/// `δ·(Σ_c code_tc²/12)^½` — for 4-bit codes and head_dim 128, roughly
/// `0.3 %` of `max_c |q'_c|·(2^bits − 1)·√head_dim`. Logits are scaled by
/// `1/√head_dim` and then exponentiated, so check this against your
/// model's tolerance (see `docs/PERFORMANCE.md` for measured numbers).
///
/// Everywhere else — per-token keys, other head dims, CPUs without VNNI,
/// or another `backend` — this is exactly [`scores_on`].
///
/// # Errors
/// As [`scores`].
pub fn scores_i8(head: &PackedHead<'_>, q: &[f32], out: &mut [f32]) -> Result<()> {
    scores_i8_on(Backend::detect(), head, q, out)
}

/// [`scores_i8`] on a chosen backend (the int8 kernel runs only for
/// [`Backend::Avx512`] on a CPU with VNNI).
///
/// # Errors
/// As [`scores`].
pub fn scores_i8_on(
    backend: Backend,
    head: &PackedHead<'_>,
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512 && x86_64::Avx512Vnni::takes(head) {
        if let Some(s) = x86_64::Avx512Vnni::new() {
            let nq = check_queries("scores", head.layout().head_dim(), q.len())?;
            crate::quant::check_len("scores", "output logits", nq * head.tokens(), out.len())?;
            s.scores_i8(head, q, out);
            return Ok(());
        }
    }
    scores_on(backend, head, q, out)
}

/// Whether [`scores_i8_on`] runs the int8 (VNNI) kernel for this head on
/// this backend and CPU, rather than the exact one.
pub fn scores_i8_is_int8(backend: Backend, head: &PackedHead<'_>) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        backend == Backend::Avx512
            && x86_64::Avx512Vnni::takes(head)
            && x86_64::Avx512Vnni::new().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (backend, head);
        false
    }
}

/// Attention-weighted sum of a head's values, straight from packed codes:
/// `out_i += Σ_t p[i·tokens + t] · v̂_t` (accumulates into `out`).
///
/// `p` is `[n_q, tokens]`; `out` is `[n_q, head_dim]`. Uses
/// [`Backend::detect`].
///
/// # Errors
/// [`Error::Length`] when `out` is empty or not a multiple of `head_dim`, or
/// `p` is not `n_q·tokens` long.
pub fn weighted_sum(head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) -> Result<()> {
    weighted_sum_on(Backend::detect(), head, p, out)
}

/// [`weighted_sum`] on a chosen backend.
///
/// # Errors
/// As [`weighted_sum`].
pub fn weighted_sum_on(
    backend: Backend,
    head: &PackedHead<'_>,
    p: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let nq = check_queries("weighted_sum", head.layout().head_dim(), out.len())?;
    crate::quant::check_len("weighted_sum", "probabilities", nq * head.tokens(), p.len())?;
    #[cfg(target_arch = "x86_64")]
    match backend {
        Backend::Avx512 => {
            if let Some(s) = x86_64::Avx512::new() {
                s.weighted_sum(head, p, out);
                return Ok(());
            }
        }
        Backend::Avx2 => {
            if let Some(s) = x86_64::Avx2::new() {
                s.weighted_sum(head, p, out);
                return Ok(());
            }
        }
        Backend::Portable => {}
    }
    portable::weighted_sum(head, p, out);
    Ok(())
}

/// Weighted sum with int8-quantized weights — opt-in, faster, approximate.
/// Uses [`Backend::detect`].
///
/// For per-token values of 4 bits (`head_dim` 128 or 256) or 8 bits (64,
/// 128 or 256) in groups of a multiple of 16 channels, on a CPU with
/// AVX-512 VNNI: per query, per tile of 16 tokens and per group `g`, the
/// weights `w_t = p_t·scale_tg` are rounded to int8 with one step
/// `δ = max_t |w_t| / 127`, `w̃_t = round(w_t/δ)`, and multiplied into the
/// unsigned codes with `vpdpbusd` four tokens at a time (exact `i32`
/// sums): `out_c += δ·Σ_t w̃_t·code_tc + Σ_t p_t·zero_tg` (the zero sums
/// exact in `f32`). About half the work per token of the exact kernel. One
/// query per call: with several (GQA), this is the exact kernel (see
/// [`weighted_sum_i8_is_int8`]).
///
/// **Extra error**, against the exact [`weighted_sum`]: the rounding adds
/// at most `δ/2` per token and group, so per channel
/// `|ô_c − o_c| ≤ Σ_tiles (δ_g/2)·Σ_t code_tc ≤ Σ_tiles (δ_g/2)·16·(2^bits − 1)`,
/// and typically (independent roundings) `δ·(Σ_t code_tc²/12)^½` per tile:
/// small next to the weight of the tile's heaviest token. With softmax
/// weights most of the output comes from a few heavy tokens, which keep
/// about 7 bits; `docs/PERFORMANCE.md` has measured attention-output
/// errors. Non-finite weights give an unspecified (but not undefined)
/// result.
///
/// Everywhere else — per-channel values, other widths or head dims, CPUs
/// without VNNI, or another `backend` — this is exactly [`weighted_sum_on`].
///
/// # Errors
/// As [`weighted_sum`].
pub fn weighted_sum_i8(head: &PackedHead<'_>, p: &[f32], out: &mut [f32]) -> Result<()> {
    weighted_sum_i8_on(Backend::detect(), head, p, out)
}

/// [`weighted_sum_i8`] on a chosen backend (the int8 kernel runs only for
/// [`Backend::Avx512`] on a CPU with VNNI).
///
/// # Errors
/// As [`weighted_sum`].
pub fn weighted_sum_i8_on(
    backend: Backend,
    head: &PackedHead<'_>,
    p: &[f32],
    out: &mut [f32],
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if weighted_sum_i8_is_int8(backend, head, out.len() / head.layout().head_dim().max(1)) {
        if let Some(s) = x86_64::Avx512Vnni::new() {
            let nq = check_queries("weighted_sum", head.layout().head_dim(), out.len())?;
            crate::quant::check_len("weighted_sum", "probabilities", nq * head.tokens(), p.len())?;
            s.weighted_sum_i8(head, p, out);
            return Ok(());
        }
    }
    weighted_sum_on(backend, head, p, out)
}

/// Whether [`weighted_sum_i8_on`] runs the int8 (VNNI) kernel for this
/// head, `n_q` queries, this backend and CPU, rather than the exact one.
/// Only one query per call takes the int8 kernel: several queries (GQA)
/// share each unpacked row in the exact fused kernel, which is faster
/// for them than one int8 pass per query (measured in
/// `docs/PERFORMANCE.md`).
pub fn weighted_sum_i8_is_int8(backend: Backend, head: &PackedHead<'_>, n_q: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        n_q == 1
            && backend == Backend::Avx512
            && x86_64::Avx512Vnni::takes_ws(head)
            && x86_64::Avx512Vnni::new().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (backend, head, n_q);
        false
    }
}

/// The numerically stable softmax of attention logits, in place:
/// `x_t ← e^(x_t − max) / Σ_u e^(x_u − max)`. Uses [`Backend::detect`].
///
/// The SIMD backends evaluate `e^x` with a vectorized Cephes `expf`
/// (within 2 ulp of the true value; `0` below `e^-87.3`, where `f32` is
/// subnormal), about 20x faster than the scalar `f32::exp` the portable
/// backend uses; the two agree to about `1e-6` relative. An empty `x` is
/// left as is.
///
/// # Example: attention weights
/// ```
/// let mut x = vec![1.0f32, 2.0, 3.0];
/// kvq::kernels::softmax(&mut x);
/// assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
/// assert!((x[2] - 0.665_240_9).abs() < 1e-6);
/// ```
pub fn softmax(x: &mut [f32]) {
    softmax_on(Backend::detect(), x)
}

/// [`softmax`] on a chosen backend.
pub fn softmax_on(backend: Backend, x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let (_, sum) = softmax_parts_on(backend, x);
    let inv = 1.0 / sum;
    #[cfg(target_arch = "x86_64")]
    match backend {
        Backend::Avx512 => {
            if let Some(s) = x86_64::Avx512::new() {
                return s.scale(x, inv);
            }
        }
        Backend::Avx2 => {
            if let Some(s) = x86_64::Avx2::new() {
                return s.scale(x, inv);
            }
        }
        Backend::Portable => {}
    }
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The unnormalized half of a softmax, for merging chunks
/// (flash-decoding): `x_t ← e^(x_t − m)` with `m = max_t x_t`, returning
/// `(m, Σ_t e^(x_t − m))`. Returns `(-inf, 0)` for an empty `x`.
///
/// Two chunks `(m₁, s₁)`, `(m₂, s₂)` with weighted sums `o₁`, `o₂` combine
/// as `m = max(m₁, m₂)`, `s = s₁·e^(m₁−m) + s₂·e^(m₂−m)`,
/// `o = (o₁·e^(m₁−m) + o₂·e^(m₂−m)) / s`.
pub fn softmax_parts(x: &mut [f32]) -> (f32, f32) {
    softmax_parts_on(Backend::detect(), x)
}

/// [`softmax_parts`] on a chosen backend.
pub fn softmax_parts_on(backend: Backend, x: &mut [f32]) -> (f32, f32) {
    if x.is_empty() {
        return (f32::NEG_INFINITY, 0.0);
    }
    #[cfg(target_arch = "x86_64")]
    match backend {
        Backend::Avx512 => {
            if let Some(s) = x86_64::Avx512::new() {
                return s.softmax_parts(x);
            }
        }
        Backend::Avx2 => {
            if let Some(s) = x86_64::Avx2::new() {
                return s.softmax_parts(x);
            }
        }
        Backend::Portable => {}
    }
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    (m, sum)
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
