//! Scores of keys stored before RoPE (`CacheConfig::pre_rope`): each tile
//! of a packed head is unpacked and dequantized into the vector-major
//! scratch, every key turned to its position there, and the tile scored
//! against every query with one transposed reduction per query — the
//! uniform kernels' unfused path with a rotation between unpack and dot.
//!
//! The rotation of position `p` comes from two tables of `cos` and
//! (signed) `sin` per lane ([`RopeRows`]): `R(p) = R(hi)·R(lo)` with `hi`
//! a multiple of [`ROPE_LO`] and `lo = p − hi`. The kernel never forms
//! `R(p)`: as `q·R(hi)·R(lo)·k = (R(hi)ᵀ·q)·(R(lo)·k)`, it turns the
//! queries back by `R(hi)` once per [`ROPE_LO`] positions and each key by
//! `R(lo)` alone, `hi` the coarse row at or below the tile's first token
//! (so `lo` reaches past [`ROPE_LO`] by less than a tile: the fine table
//! has [`ROPE_SPILL`] rows more).

use crate::simd::{Backend, Kernel};
use crate::store::PackedHead;

/// Positions per coarse-table entry.
pub(crate) const ROPE_LO: usize = 256;

/// Rows of the fine table past [`ROPE_LO`]: a tile (at most 64 tokens)
/// that starts below a coarse row's end may reach past it.
pub(crate) const ROPE_SPILL: usize = 64;

/// The rotation tables of one layer, `lanes` floats per row.
///
/// With `adjacent` false (pairs `(i, i + dims/2)`) a lane is a pair:
/// `lanes = dims/2`, `S` the sine. With `adjacent` (pairs `(2i, 2i+1)`) a
/// lane is a channel: `lanes = dims`, each pair's cosine twice and its sine
/// negated on the first channel, so `x'_c = x_c·C_c + x_{c^1}·S_c`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RopeRows<'a> {
    pub(crate) adjacent: bool,
    pub(crate) lanes: usize,
    /// `(cos, sin)` rows of positions `0..ROPE_LO + ROPE_SPILL`.
    pub(crate) lo: (&'a [f32], &'a [f32]),
    /// `(cos, sin)` rows of positions `0, ROPE_LO, 2·ROPE_LO, …`.
    pub(crate) hi: (&'a [f32], &'a [f32]),
}

/// `out[i·T + t] = q_i · R(p0 + t)·k̂_t` for every token `t` of `head` on
/// `backend`, when a SIMD kernel takes this shape (whole vectors per head
/// and per rotary half); `false` (nothing written) otherwise.
///
/// # Panics
/// If the lengths do not fit (`q` `nq·head_dim`, `out` `nq·tokens`) or the
/// tables do not cover the positions.
pub(crate) fn rope_scores_on(
    backend: Backend,
    head: &PackedHead<'_>,
    rope: &RopeRows<'_>,
    p0: usize,
    q: &[f32],
    out: &mut [f32],
) -> bool {
    let hd = head.layout().head_dim();
    let t = head.tokens();
    assert!(
        q.len().is_multiple_of(hd) && out.len() == q.len() / hd * t,
        "rope_scores: lengths"
    );
    let rows = |n: usize| n.div_ceil(ROPE_LO);
    assert!(
        rope.lo.0.len() >= (ROPE_LO + ROPE_SPILL) * rope.lanes
            && rope.lo.1.len() == rope.lo.0.len()
            && rope.hi.0.len() >= rows(p0 + t) * rope.lanes
            && rope.hi.1.len() == rope.hi.0.len(),
        "rope_scores: tables"
    );
    backend.dispatch(Args {
        head,
        rope,
        p0,
        q,
        out,
    })
}

struct Args<'a, 'h> {
    head: &'a PackedHead<'h>,
    rope: &'a RopeRows<'a>,
    p0: usize,
    q: &'a [f32],
    out: &'a mut [f32],
}

impl Kernel for Args<'_, '_> {
    type Output = bool;

    fn portable(self) -> bool {
        false
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: crate::simd::x86_64::Simd>(self, s: S) -> bool {
        use super::x86_64::generic;
        let Args {
            head,
            rope,
            p0,
            q,
            out,
        } = self;
        use super::x86_64::fused_shape;
        if !generic::rope_takes::<S>(head, rope) {
            return false;
        }
        super::x86_64::check_head(head, q.len(), out.len());
        // The compiled per-channel shapes whose rotation covers the head:
        // rows turned in registers (`generic::rope_scores_fused`).
        macro_rules! fused {
            ($b:literal) => {
                if const { fused_shape::<S>($b, 128) } {
                    if generic::rope_fused_takes::<S, $b, 128>(head, rope) {
                        // SAFETY: as below, and `rope_fused_takes` holds.
                        unsafe {
                            generic::rope_scores_fused::<S, $b, 128>(s, head, rope, p0, q, out)
                        };
                        return true;
                    }
                }
            };
        }
        match head.layout().scheme().bits() {
            2 => fused!(2),
            4 => fused!(4),
            8 => fused!(8),
            _ => {}
        }
        // SAFETY: `check_head` asserted the head's buffers and the lengths,
        // `rope_scores_on` the tables, `rope_takes` the shape; `s` proves
        // the features this body is compiled with.
        unsafe { generic::rope_scores(s, head, rope, p0, q, out) };
        true
    }
}
