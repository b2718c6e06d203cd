//! The fuzz targets of kvq-fuzz, as a library: the structured mutation
//! fuzzer (`src/main.rs`) and the coverage-guided AFL++ harness
//! (`fuzz/afl/`) run the same targets on the same bytes.

pub mod input;
pub mod seeds;
pub mod targets;

pub use targets::run;

/// Every target; `all` runs them in this order.
pub const TARGETS: &[&str] = &["block", "load", "config", "ops", "gguf"];

use std::alloc::{GlobalAlloc, Layout, System};

/// Refuse any single allocation above this: no input may make kvq
/// allocate for a claim it does not back.
pub const ALLOC_LIMIT: usize = 1 << 30;

/// The fuzzers' global allocator: `System`, except that a single
/// allocation above [`ALLOC_LIMIT`] fails, which aborts the run (a
/// finding). Each fuzzer binary installs it with `#[global_allocator]`.
pub struct Guarded;

// SAFETY: forwards to `System`, refusing (null) only sizes above the limit,
// which `GlobalAlloc` allows any allocator to do.
unsafe impl GlobalAlloc for Guarded {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if l.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System.alloc` with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if l.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(p, l, new) }
    }
}
