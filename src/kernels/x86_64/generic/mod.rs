//! The kernels, written once over [`Simd`] and compiled once per token
//! (inside the `#[target_feature]` trampolines of `crate::simd`, into which
//! everything here is `#[inline(always)]`), one file per concept.
//!
//! See the [module docs](super) for the tile scheme. Raw pointers are only
//! used inside a tile, after the safe wrappers asserted the head's lengths
//! ([`super::check_head`]) and the tile's extent was checked against them.

use super::Simd;
use crate::pack;
use crate::scheme::{Axis, Mode, ScaleFormat};
use crate::store::PackedHead;
use half::f16;

/// `for $j in $lo..$hi { $body }`, fully unrolled into exactly `$n`
/// guarded copies (`$n` is 2, 4, 8, 16 or 32 and bounds `$hi − $lo`): the
/// bounds are compile-time constants wherever this is used, so every `if`
/// folds, every index into a register array is a constant and the array
/// stays in registers (LLVM will not unroll 16 iterations of a large body
/// by itself). Each site asks for the smallest `$n` its loop needs: the
/// copies are generated before they fold, and nested sites multiply.
macro_rules! unroll {
    // `$cap` a constant expression bounding `$hi − $lo` (at most 32): the
    // fewest copies that cover it, chosen at compile time (the other
    // ladders' copies are never emitted).
    (cap = $cap:expr; $j:ident in $lo:expr, $hi:expr => $body:block) => {{
        if const { $cap <= 2 } {
            unroll!(2; $j in $lo, $hi => $body)
        } else if const { $cap <= 4 } {
            unroll!(4; $j in $lo, $hi => $body)
        } else if const { $cap <= 8 } {
            unroll!(8; $j in $lo, $hi => $body)
        } else if const { $cap <= 16 } {
            unroll!(16; $j in $lo, $hi => $body)
        } else {
            unroll!(32; $j in $lo, $hi => $body)
        }
    }};
    ($n:tt; $j:ident in $lo:expr, $hi:expr => $body:block) => {{
        let (lo, hi): (usize, usize) = ($lo, $hi);
        assert!(hi <= lo + $n, "unroll: more iterations than copies");
        unroll!(@n $n, lo, hi, $j, $body);
    }};
    (@n 2, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1)
    };
    (@n 4, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3)
    };
    (@n 8, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3 4 5 6 7)
    };
    (@n 16, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@n 32, $lo:ident, $hi:ident, $j:ident, $body:block) => {
        unroll!(@go $lo, $hi, $j, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@go $lo:ident, $hi:ident, $j:ident, $body:block, $($k:literal)*) => {
        $( if $lo + $k < $hi { let $j: usize = $lo + $k; $body } )*
    };
}

pub(crate) use unroll;

mod dense;
mod fused_scores;
mod params;
mod prefetch;
mod rope;
mod scores;
mod softmax;
mod sparse;
mod unpack;
mod weighted_sum;

pub(crate) use dense::*;
pub(crate) use fused_scores::*;
pub(crate) use params::*;
pub(crate) use prefetch::*;
pub(crate) use rope::*;
pub(crate) use scores::*;
pub(crate) use softmax::*;
pub(crate) use sparse::*;
pub(crate) use unpack::*;
pub(crate) use weighted_sum::*;
