//! The coverage-guided AFL++ harness over kvq-fuzz's targets (one binary
//! per target, `src/bin/<target>.rs`), built with `cargo afl build
//! --release` and run by `scripts/afl.sh`.
//!
//! A panic aborts the process (afl.rs's hook), which AFL++ saves as a
//! crash; so does an allocation above 1 GiB, which the allocator refuses.

#[global_allocator]
static ALLOC: kvq_fuzz::Guarded = kvq_fuzz::Guarded;

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
