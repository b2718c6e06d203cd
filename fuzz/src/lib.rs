//! The fuzz targets of kvq-fuzz, as a library: the structured mutation
//! fuzzer (`src/main.rs`) and the coverage-guided AFL++ harness
//! (`fuzz/afl/`) run the same targets on the same bytes.

pub mod input;
pub mod seeds;
pub mod targets;

pub use targets::run;

/// Every target; `all` runs them in this order.
pub const TARGETS: &[&str] = &["block", "load", "config", "ops", "gguf"];
