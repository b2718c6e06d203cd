//! The weighted sum `p·V` straight from packed values: the exact kernels
//! and the opt-in int8-weight one.

use super::{check_queries, Backend};
use crate::error::Result;
use crate::store::PackedHead;

/// Attention-weighted sum of a head's values, straight from packed codes:
/// `out_i += Σ_t p[i·tokens + t] · v̂_t` (accumulates into `out`).
///
/// `p` is `[n_q, tokens]`; `out` is `[n_q, head_dim]`. Uses
/// [`Backend::detect`].
///
/// # Errors
/// [`Error::Length`](crate::Error::Length) when `out` is empty or not a multiple of `head_dim`, or
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
    run(backend, head, p, out);
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
        if let Some(s) = super::x86_64::Avx512Vnni::new() {
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
            && super::x86_64::Avx512Vnni::takes_ws(head)
            && super::x86_64::Avx512Vnni::new().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (backend, head, n_q);
        false
    }
}

packed_kernel!(
    run,
    weighted_sum,
    crate::kernels::portable::weighted_sum,
    |h: &PackedHead<'_>, x: usize, o: usize| crate::kernels::x86_64::check_head(h, o, x)
);
