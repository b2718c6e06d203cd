//! Accounting and choice: the memory model of a model's cache, and a K/V
//! bit-budget planner that ranks schemes by error at the point of use.
//!
//! * [`MemoryModel`] counts the bytes of a model's cache at any context
//!   length — exactly what kvq's storage allocates, per-channel partial
//!   blocks included — beside the fixed-size state of linear-attention
//!   layers (Gated DeltaNet and kin), and finds where the two cross.
//! * [`Planner`] takes captured `Q, K, V` of every full-attention layer
//!   ([`LayerCapture`]), candidate key and value schemes and a budget of
//!   effective bits, and returns the pairs within budget ranked by attention
//!   error ([`Objective`]), with the Pareto front of bits against error —
//!   or spends the budget layer by layer ([`Planner::plan_per_layer`]).
//!
//! Sizes are bytes; where this crate writes GB it means 10⁹ bytes (decimal),
//! which is the unit that reproduces the study's figures (32 KiB/token ×
//! 262,144 tokens = 8.59·10⁹ B = "8.6 GB"; it is 8.0 GiB).

use crate::error::{Error, Result};
use crate::metrics::{
    assemble, head_rows, matmul_nn, ratio, rows_err, Attention, AttentionErrors, ErrorSummary,
    KeyStats, LayerCapture, MetricsConfig, QueryGroup, Recon,
};
use crate::quant::{Codec, Levels, Rotation};
use crate::scheme::{Axis, Group, Layout, Mode, QuantScheme, ScaleFormat};

/// Bytes in a (decimal) gigabyte, the unit of the study's memory figures.
pub const GB: f64 = 1e9;

mod memory;
mod planner;
pub use memory::*;
pub use planner::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_bytes_matches_layout() {
        for (axis, g) in [
            (Axis::PerToken, Group::Size(32)),
            (Axis::PerChannel, Group::Size(32)),
        ] {
            let l = QuantScheme::new(3, axis, g).unwrap().layout(2, 64).unwrap();
            for t in [0, 1, 7, 31, 32, 33, 100, 1023] {
                assert_eq!(layout_bytes(&l, t), l.bytes(t) as u128, "{axis:?} {t}");
            }
        }
    }

    #[test]
    fn pareto_is_strictly_improving() {
        let s = QuantScheme::new(4, Axis::PerToken, Group::Head).unwrap();
        let c = |b: f64, sc: f64| Candidate {
            keys: s.into(),
            values: s.into(),
            effective_bits: b,
            score: sc,
            errors: ErrorSummary::default(),
            exact: true,
        };
        let e = vec![
            c(3.0, 0.5),
            c(4.0, 0.6),
            c(4.0, 0.3),
            c(5.0, 0.3),
            c(6.0, 0.1),
        ];
        assert_eq!(pareto_indices(&e), vec![0, 2, 4]);
    }
}
