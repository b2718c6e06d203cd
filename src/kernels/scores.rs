//! Scores `q·Kᵀ` straight from packed keys: the exact kernels and the
//! opt-in int8-query one.

use super::{check_queries, Backend};
use crate::error::Result;
use crate::store::PackedHead;

/// Attention logits of `n_q` queries against every key of a head, straight
/// from packed codes: `out[i·tokens + t] = q_i · k̂_t` (unscaled).
///
/// `q` is `[n_q, head_dim]`; `out` is `[n_q, tokens]`. Uses
/// [`Backend::detect`].
///
/// # Errors
/// [`Error::Length`](crate::Error::Length) when `q` is empty or not a multiple of `head_dim`, or
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
    run(backend, head, q, out);
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
    if backend == Backend::Avx512 && super::x86_64::Avx512Vnni::takes(head) {
        if let Some(s) = super::x86_64::Avx512Vnni::new() {
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
            && super::x86_64::Avx512Vnni::takes(head)
            && super::x86_64::Avx512Vnni::new().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (backend, head);
        false
    }
}

packed_kernel!(
    run,
    scores,
    crate::kernels::portable::scores,
    |h: &PackedHead<'_>, x: usize, o: usize| crate::kernels::x86_64::check_head(h, x, o)
);
