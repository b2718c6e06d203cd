//! x86-64 kernels, written once, generically, in [`tile`] over the
//! [`Simd`] vocabulary of [`crate::simd`], and compiled for each token
//! inside its trampoline (see [`crate::simd`]'s `Kernel`). [`int8`] holds
//! the opt-in AVX-512 VNNI kernels; [`quantize`] gives the quantizer's
//! driver vector loops over the same vocabulary.
//!
//! # How a kernel runs
//!
//! Tokens are processed in *tiles* of `Simd::T` tokens (8 with AVX2, 16
//! with AVX-512; one tile's scores fill exactly one vector):
//!
//! 1. **Unpack** the tile's code rows into a small, 64-byte-aligned f32
//!    scratch in L1 (`T × head_dim` floats). The plane layout of
//!    [`pack`](crate::pack) makes this one zero-extending load, one shift and
//!    one mask per 16 (8) codes: field `f` of `m` consecutive bytes is `m`
//!    consecutive elements. Per-token schemes are dequantized here
//!    (`x = fma(code, scale, zero)`, one rounding), so every query that
//!    shares the KV head reuses the same floats.
//! 2. **Math** over the scratch, chunk-outer and token-inner: scores keep
//!    one accumulator per token of the tile and reduce all `T` of them at
//!    once with a transpose-and-add (about 3 shuffles per token instead of a
//!    full horizontal sum each); weighted sums keep one broadcast weight per
//!    token in registers and four partial sums per chunk.
//!
//! All arithmetic is `f32` with FMA; no query is rounded to a narrower type.
//!

/// Run `shape_BITS_HD::run$args` (of the listed modules) for a head whose
/// width and dimension [`compiled_shape`] lists, and `shape_any::run$args`
/// for every other shape.
macro_rules! by_shape {
    ($head:expr, [$($s:ident = ($b:literal, $hd:literal)),*; $any:ident], $args:tt) => {{
        let l = $head.layout();
        let (bits, hd) = (l.scheme().bits(), l.head_dim());
        match (bits, hd) {
            _ if !$crate::kernels::x86_64::compiled_shape(bits, hd) => $any::run $args,
            $(($b, $hd) => $s::run $args,)*
            _ => unreachable!("kernels: a compiled shape without its module"),
        }
    }};
}
pub(crate) use by_shape;

/// Whether the SIMD backends have kernels compiled for heads of `bits` bits
/// and `head_dim` (one place for [`by_shape!`]'s routing and the `const`
/// guards of [`fused_shape`]). The widths most caches use get a
/// compile-time shape at the head dims of most models — 128 (Llama,
/// Mistral, Qwen), 64 (SmolLM2, small Llamas) and 256 (Gemma): fully
/// unrolled rows held in registers, the fused kernels. Every other shape
/// runs one instance compiled for any width and dimension (`BITS = 0, HD =
/// 0`, both read at run time: the tile-buffer kernels). A compile-time
/// shape costs tens of KiB of machine code per kernel and token and
/// seconds of build time, so shapes are listed only where a benchmark
/// shows the fused kernels pay (`docs/PERFORMANCE.md`): 2, 3, 4 and 8
/// bits at head_dim 64, 128 and 256, on AVX2 and AVX-512 alike.
pub(crate) const fn compiled_shape(bits: u8, head_dim: usize) -> bool {
    matches!((bits, head_dim), (2 | 3 | 4 | 8, 64 | 128 | 256))
}

/// Whether token `S` has kernels compiled for the shape `(B, HD)`
/// (`(0, 0)`: any shape; [`compiled_shape`]). A `const` guard around the
/// call, so the other shapes are never compiled.
pub(crate) const fn fused_shape<S: Simd>(b: u8, hd: usize) -> bool {
    (b == 0 && hd == 0) || compiled_shape(b, hd)
}

pub(crate) mod codebook;
pub(crate) mod generic;
pub(crate) mod int8;
pub(crate) mod quantize;

pub(crate) use crate::simd::x86_64::{Avx512Vnni, Simd};
pub(crate) use generic::DenseElem;

use crate::scheme::Axis;
use crate::store::PackedHead;

/// Assert every length the packed kernels' raw loops rely on: `q_len`
/// (scores) or `out_len` (weighted sum) is `n_q · head_dim`, `other` is
/// `n_q · tokens`, and the head's buffers hold its tokens. Returns `n_q`.
#[track_caller]
pub(crate) fn check_head(head: &PackedHead<'_>, per_query_hd: usize, per_query_t: usize) -> usize {
    let l = head.layout();
    let hd = l.head_dim();
    let t = head.tokens();
    assert!(
        hd > 0 && per_query_hd > 0 && per_query_hd.is_multiple_of(hd),
        "kernels: queries must be a positive multiple of head_dim"
    );
    let nq = per_query_hd / hd;
    assert_eq!(
        per_query_t,
        nq * t,
        "kernels: per-token buffer must be n_q·tokens"
    );
    assert!(
        head.codes().len() >= l.head_code_bytes(t),
        "kernels: code rows shorter than the layout"
    );
    let set = head.set_len() * l.scheme().param_bytes();
    let sets = match l.scheme().axis() {
        Axis::PerToken => t,
        Axis::PerChannel => t.div_ceil(l.group_len()),
    };
    assert!(
        head.params().len() >= sets * set,
        "kernels: params shorter than the layout"
    );
    nq
}
