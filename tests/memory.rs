//! A cache's heap against what it reports (`bytes()`): a counting
//! allocator sees every allocation of this test binary.

use half::f16;
use kvq::{presets, CacheConfig, LayerCache};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to `System`, counting the live bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` came from `System.alloc` with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            LIVE.fetch_add(new, Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The heap a closure leaves allocated.
fn retained<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    let t = f();
    (t, LIVE.load(Ordering::Relaxed).saturating_sub(before))
}

#[test]
fn a_cache_holds_about_what_it_reports() {
    // One test at a time sees the counter (this binary has one test).
    let (n_kv, hd, tokens) = (8, 128, 8192);
    let w = n_kv * hd;
    let k: Vec<f16> = (0..tokens * w)
        .map(|i| f16::from_f32(((i % 251) as f32 - 125.0) / 125.0))
        .collect();
    let v: Vec<f16> = (0..tokens * w)
        .map(|i| f16::from_f32(((i % 241) as f32 - 120.0) / 120.0))
        .collect();
    let (keys, values) = presets::kivi(4).unwrap();
    for cfg in [
        CacheConfig::new(n_kv, hd).keys(keys).values(values),
        CacheConfig::new(n_kv, hd)
            .keys(keys)
            .values(values)
            .residual(128)
            .sinks(4),
    ] {
        // A prompt in f16 (widened inside), then decode steps.
        let (cache, heap) = retained(|| {
            let mut c = LayerCache::new(cfg).unwrap();
            c.extend(&k[..(tokens - 64) * w], &v[..(tokens - 64) * w])
                .unwrap();
            for t in tokens - 64..tokens {
                c.append(&k[t * w..(t + 1) * w], &v[t * w..(t + 1) * w])
                    .unwrap();
            }
            c
        });
        let bytes = cache.bytes().total();
        // Growing buffers double, so up to twice the bytes, plus a fixed
        // allowance for the per-head vectors, the residual window's slack
        // and the append scratch; the f16 prompt widened to f32 (32 MiB
        // here, eight times the packed cache) must not stay.
        let allowance = 2 << 20;
        assert!(
            heap <= 2 * bytes + allowance,
            "heap {heap} for {bytes} bytes reported ({:.2}x)",
            heap as f64 / bytes as f64
        );
        println!(
            "{} bytes reported, {heap} on the heap ({:.2}x)",
            bytes,
            heap as f64 / bytes as f64
        );
        drop(cache);
    }
}
