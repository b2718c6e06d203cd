//! The coverage-guided AFL++ harness over kvq-fuzz's targets (one binary
//! per target, `src/bin/<target>.rs`), built with `cargo afl build
//! --release` and run by `scripts/afl.sh`.
//!
//! A panic aborts the process (afl.rs's hook), which AFL++ saves as a
//! crash; so does an allocation above 1 GiB, which the allocator refuses.

use std::alloc::{GlobalAlloc, Layout, System};

/// Refuse any single allocation above this: no input may make kvq
/// allocate for a claim it does not back.
const ALLOC_LIMIT: usize = 1 << 30;

struct Guarded;

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

#[global_allocator]
static ALLOC: Guarded = Guarded;

/// Run `target` (one of [`kvq_fuzz::TARGETS`]) on every input AFL++ gives,
/// in persistent mode.
pub fn fuzz(target: &'static str) {
    assert!(
        kvq_fuzz::TARGETS.contains(&target),
        "unknown target {target}"
    );
    afl::fuzz!(|data: &[u8]| {
        kvq_fuzz::run(target, data);
    });
}
