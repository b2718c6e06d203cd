//! A cache's heap against what it reports (`bytes()`): a counting
//! allocator sees every allocation of this test binary. The excess is a
//! constant of the configuration (the page being filled, the window, the
//! scratch) plus the page table, not a fraction of the length.

use half::f16;
use kvq::cache::resident_bytes;
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

/// Random-looking f16 rows `[tokens, w]`.
fn rows(tokens: usize, w: usize, salt: usize) -> Vec<f16> {
    (0..tokens * w)
        .map(|i| f16::from_f32((((i * 7 + salt) % 251) as f32 - 125.0) / 125.0))
        .collect()
}

#[test]
fn a_cache_holds_what_it_reports_plus_a_constant() {
    // One test at a time sees the counter (this binary has one test).
    let (n_kv, hd) = (4, 128);
    let w = n_kv * hd;
    let (keys, values) = presets::kivi(4).unwrap();
    let pc_unit = keys.layout(n_kv, hd).unwrap().block_tokens();
    for (res, sinks) in [(0, 0), (128, 4)] {
        let cfg = CacheConfig::new(n_kv, hd)
            .keys(keys)
            .values(values)
            .residual(res)
            .sinks(sinks);
        // What a cache may hold beyond `bytes()`, whatever its length:
        // the spare capacity of the page being filled (under a page of
        // 4096 tokens of K and of V), the full-precision tail with its not yet compacted rows and
        // its vector's spare capacity (at most four times the window plus
        // a unit and 64 rows), the scratch a call keeps between calls
        // (2 MiB at most), and the buffer handles.
        let page = keys.layout(n_kv, hd).unwrap().bytes(4096)
            + values.layout(n_kv, hd).unwrap().bytes(4096);
        let tail = 2 * 4 * (res + pc_unit + 64 + sinks) * w * 4;
        let constant = page + tail + (2 << 20) + (64 << 10);
        let mut excess = Vec::new();
        for tokens in [8192, 65536] {
            let (k, v) = (rows(tokens, w, 0), rows(tokens, w, 3));
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
            println!(
                "residual {res}, sinks {sinks}, {tokens} tokens: {bytes} bytes reported, \
                 {heap} on the heap ({:.3}x, {} more; allowed {constant} more)",
                heap as f64 / bytes as f64,
                heap as i64 - bytes as i64
            );
            assert!(
                heap <= bytes + constant,
                "{tokens} tokens: heap {heap} for {bytes} bytes reported"
            );
            excess.push(heap.saturating_sub(bytes));
            drop(cache);
        }
        // Eight times the tokens, the same excess but for the page table:
        // under 512 bytes per page of K or V (14 more pages of each here),
        // 0.05 % of a page's 1.2 MB.
        let more_pages = (65536 - 8192) / 4096;
        assert!(
            excess[1] <= excess[0] + 2 * more_pages * 512,
            "residual {res}: excess {excess:?} grows with the length"
        );
    }

    // Shared pages: forks, cuts into shared pages and drops, in any
    // order, return every byte, and while they live the heap is what
    // `resident_bytes` counts (each shared page once) plus each cache's
    // constant.
    let cfg = CacheConfig::new(n_kv, hd)
        .keys(keys)
        .values(values)
        .residual(16);
    let tokens = 3 * 4096 + 100;
    let (k, v) = (rows(tokens, w, 1), rows(tokens, w, 2));
    let base = LIVE.load(Ordering::Relaxed);
    let (mut family, heap) = retained(|| {
        let mut prompt = LayerCache::new(cfg).unwrap();
        prompt.extend(&k, &v).unwrap();
        let mut family = vec![prompt];
        for i in 0..6 {
            let mut f = family[i / 2].fork();
            f.truncate(tokens - 1000 * i).unwrap();
            f.extend(&k[..300 * w], &v[..300 * w]).unwrap();
            family.push(f);
        }
        family
    });
    let resident = resident_bytes(&family).total();
    let per_cache = 2 * (4 * (16 + 64 + 32) * w * 4) + (2 << 20);
    let n = family.len();
    assert!(
        resident <= heap && heap <= resident + n * per_cache,
        "{heap} {resident}"
    );
    // Drop in a scrambled order: the last holder of a page frees it.
    for i in [3, 0, 4, 1, 2, 1, 0] {
        family.remove(i % family.len());
    }
    assert!(family.is_empty());
    drop(family);
    let after = LIVE.load(Ordering::Relaxed);
    assert_eq!(after, base, "pages leaked");
    println!("{n} caches: {heap} on the heap, {resident} resident; all freed");
}
