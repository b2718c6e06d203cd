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
//! KV head under GQA) and unpack each code row once for all of them.
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

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86_64;

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
    if q_len == 0 || q_len % hd != 0 {
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
