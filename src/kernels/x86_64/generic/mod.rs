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

/// `for $j in $lo..$hi { $body }`, fully unrolled into `$n` guarded
/// copies (`$n` is 1, 2, 4, 8, 16 or 32 and bounds `$hi − $lo`): the
/// bounds are compile-time constants wherever this is used, so every `if`
/// folds, every index into a register array is a constant and the array
/// stays in registers (LLVM will not unroll 16 iterations of a large body
/// by itself).
///
/// The copies exist in the generic MIR, before any bound is known, and
/// nested sites multiply them; rustc's MIR passes keep a bit set of the
/// body's locals per basic block, so their memory grows with the square
/// of a body's size. Each site therefore takes the smallest literal `$n`
/// that bounds its loop for every instance, and `$n max $cap` names the
/// instance's own bound, which folds each surplus copy's guard to a
/// constant `false` once the instance is generated. (A ladder choosing
/// `$n` from `$cap` at compile time expands every rung in the generic
/// MIR: 63 copies per site, which nested three deep took rustc past
/// 20 GB.)
macro_rules! unroll {
    // `$n` copies of which only the first `$cap` (a constant expression,
    // at most `$n`) can run: after monomorphization every copy's guard is
    // a constant, so the code generator branches past the others.
    ($n:tt max $cap:expr; $j:ident in $lo:expr, $hi:expr => $body:block) => {{
        let (lo, hi): (usize, usize) = ($lo, $hi);
        let cap: usize = const {
            assert!($cap <= $n, "unroll: a bound above the copies");
            $cap
        };
        assert!(hi <= lo + cap, "unroll: more iterations than copies");
        unroll!(@n $n, lo, hi, cap, $j, $body);
    }};
    ($n:tt; $j:ident in $lo:expr, $hi:expr => $body:block) => {{
        let (lo, hi): (usize, usize) = ($lo, $hi);
        assert!(hi <= lo + $n, "unroll: more iterations than copies");
        unroll!(@n $n, lo, hi, $n, $j, $body);
    }};
    (@n 1, $($a:tt)*) => { unroll!(@go $($a)*; 0) };
    (@n 2, $($a:tt)*) => { unroll!(@go $($a)*; 0 1) };
    (@n 4, $($a:tt)*) => { unroll!(@go $($a)*; 0 1 2 3) };
    (@n 8, $($a:tt)*) => { unroll!(@go $($a)*; 0 1 2 3 4 5 6 7) };
    (@n 16, $($a:tt)*) => {
        unroll!(@go $($a)*; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@n 32, $($a:tt)*) => {
        unroll!(@go $($a)*; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@go $lo:ident, $hi:ident, $cap:expr, $j:ident, $body:block; $($k:literal)*) => {
        $( if $k < $cap && $lo + $k < $hi { let $j: usize = $lo + $k; $body } )*
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
