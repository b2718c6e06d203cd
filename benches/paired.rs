//! The multi-head `attend` cases of `benches/kernels.rs`, measured in
//! interleaved rounds, so their ratios to the f16 baseline survive a noisy
//! host.
//!
//! ```text
//! cargo bench --bench paired                  # ctx 32768, 1 and 4 queries per KV head
//! cargo bench --bench paired -- 4b 8b         # only cases whose name contains 4b or 8b
//! cargo bench --bench paired -- 'cache 4b-kivi32$'  # exactly this case (and f16)
//! KVQ_PAIRED_ROUNDS=200 cargo bench --bench paired
//! KVQ_BENCH_FULL=1 cargo bench --bench paired # + ctx 131072
//! KVQ_PAIRED_THREADS=1 KVQ_PAIRED_NQ=1 cargo bench --bench paired -- 4b dram
//! KVQ_PAIRED_CTX=16384 KVQ_PAIRED_RESIDENT=1 cargo bench --bench paired -- 4b
//! ```
//!
//! - `KVQ_PAIRED_CTX`: the context lengths (comma-separated), instead of
//!   32768 (and 131072 with `KVQ_BENCH_FULL=1`).
//! - `KVQ_PAIRED_NQ`: the query heads per KV head (default `1,4`).
//! - `KVQ_PAIRED_HD`: the head dimension (default 128; SmolLM2 has 64,
//!   Gemma 3 256).
//! - `KVQ_PAIRED_THREADS`: the threads the 8 heads are split across
//!   (default 2; 1 measures what one core streams).
//! - `KVQ_PAIRED_RESIDENT=1`: one copy of each layer instead of 1 GiB of
//!   them, so a layer that fits the last-level cache is read from there
//!   rather than from DRAM.
//! - `KVQ_PAIRED_PAGES`: page sizes (comma-separated) for extra cases
//!   `cache 4b-kivi32-pool{N}`, KIVI-4 in a `PagePool` of `N`-token pages.
//! - `KVQ_BACKEND`: the backend every case runs on (`portable`, `avx2`,
//!   `avx512`; default the best this CPU has), as for the library.
//!
//! One thread against two, and DRAM against a cache-resident layer, tell
//! whether a path is bound by its arithmetic or by how it streams memory
//! (`docs/PERFORMANCE.md`, "Known weak spots").
//!
//! Why a second harness: criterion measures one case for a few seconds,
//! then the next. On a shared host whose speed drifts by tens of percent
//! within minutes (see `docs/PERFORMANCE.md`), the ratio of two criterion
//! medians then mixes the host's drift into the kernels' difference. Here
//! every round calls every case once, back to back (the order rotates from
//! round to round), so the f16 call and the packed call of a round see the
//! same host; the median over rounds of `f16 time / case time` cancels the
//! drift. The times themselves are printed too (min and median), with GB/s
//! of cache streamed at the median, and the ratio of the minimums: host
//! noise only ever adds time, so each case's fastest call is its least
//! disturbed one, and a fixed stall costs a short call a larger fraction
//! than a long one (which biases the per-round ratios against the faster
//! kernel).
//!
//! Beside the kernel loop, the `cache …` cases call `LayerCache::attend`
//! on a cache built by `extend` (what an engine calls; its own two threads
//! across heads), KIVI-4 without and with a residual window and sinks,
//! with keys before RoPE, with rotated values and with both rotated;
//! 4-bit per-token K/V plain and rotated; the codebooks: `iq4_nl`, rotated
//! Lloyd-Max at 4 and 3 bits; `cache 4.5b-plan`, the layer the planner
//! picks most at 4.5 bits (`docs/RESULTS.md`, "Planned caches"); and the
//! dense-and-sparse outliers: `cache 4b-kivi32-o1` (KIVI-4 with 1 % of
//! keys and values as outliers) and `cache 3b-prerope-o1`.
//!
//! Same shape as criterion's `attend/hd128/q{N}`: 8 KV heads, head_dim
//! 128 (or `KVQ_PAIRED_HD`), two threads across heads, each case's layer copied until the
//! copies add up to 1 GiB and rotated, so every call streams from DRAM.
//! Nothing is asserted here; the measured numbers are in
//! `docs/perf/records/`, the current ones in `docs/PERFORMANCE.md`.

mod common;

use common::{
    attend_threads, bytes_of, cache_cases, cold_copies, data, env_list, env_num, layer_cases,
    Layer, Paired, N_KV, THREADS,
};
use kvq::Backend;
use std::hint::black_box;
use std::time::Instant;

const BASELINE: &str = "dense-f16";

fn main() {
    // `cargo bench` passes `--bench`; other arguments filter the cases.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let keep = |name: &str| {
        // A filter ending in `$` names one case exactly.
        let hit = |f: &String| match f.strip_suffix('$') {
            Some(exact) => name == exact,
            None => name.contains(f.as_str()),
        };
        name == BASELINE || filters.is_empty() || filters.iter().any(hit)
    };
    let full = std::env::var("KVQ_BENCH_FULL").is_ok_and(|v| v == "1");
    let nqs = env_list("KVQ_PAIRED_NQ").unwrap_or_else(|| vec![1, 4]);
    let threads = env_num("KVQ_PAIRED_THREADS").unwrap_or(THREADS);
    let resident = std::env::var("KVQ_PAIRED_RESIDENT").is_ok_and(|v| v == "1");
    let ctxs = env_list("KVQ_PAIRED_CTX").unwrap_or_else(|| {
        if full {
            vec![32768, 131072]
        } else {
            vec![32768]
        }
    });
    let rounds = env_num("KVQ_PAIRED_ROUNDS").unwrap_or(100).max(3);
    let hd = env_num("KVQ_PAIRED_HD").unwrap_or(128);
    let (be, warm) = (Backend::detect(), 3);
    for &ctx in &ctxs {
        let kx = data(ctx * N_KV * hd, 11);
        let vx = data(ctx * N_KV * hd, 12);
        let cases: Vec<(String, Vec<Layer>)> = layer_cases(be, hd, ctx, &kx, &vx)
            .into_iter()
            .chain(cache_cases(be, hd, &kx, &vx))
            .filter(|(name, _)| keep(name))
            .map(|(name, make)| {
                let layers = if resident {
                    vec![make()]
                } else {
                    cold_copies(make())
                };
                (name, layers)
            })
            .collect();
        let base = cases
            .iter()
            .position(|(n, _)| n == BASELINE)
            .expect("the f16 baseline is always a case");
        for &nq in &nqs {
            let q = data(N_KV * nq * hd, 13);
            let mut out = vec![0f32; N_KV * nq * hd];
            let mut times = vec![Vec::with_capacity(rounds); cases.len()];
            for r in 0..warm + rounds {
                for k in 0..cases.len() {
                    let c = (r + k) % cases.len();
                    let layers = &cases[c].1;
                    let layer = &layers[r % layers.len()];
                    let t = Instant::now();
                    attend_threads(layer, be, hd, ctx, black_box(&q), &mut out, threads);
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    if r >= warm {
                        times[c].push(ms);
                    }
                }
            }
            println!(
                "\nattend/hd{hd}/q{nq}, ctx {ctx}, {} backend, {rounds} rounds \
                 (+{warm} warm-up), {threads} thread(s), {}",
                be.name(),
                if resident {
                    "one copy per case (resident when it fits the caches)"
                } else {
                    "1 GiB rotated per case"
                }
            );
            println!(
                "| case | min ms | median ms | GB/s at median | f16 ÷ case, median of rounds | p25–p75 | f16 min ÷ case min |"
            );
            println!("|---|---:|---:|---:|---:|---:|---:|");
            for (c, (name, _)) in cases.iter().enumerate() {
                let p = Paired::new(&times[base], &times[c]);
                // A cache counts its own bytes (codebooks store no zeros).
                let bytes = match name.starts_with("cache ") {
                    true => cases[c].1[0].bytes(),
                    false => bytes_of(name, ctx, hd),
                };
                let gbs = bytes as f64 / p.median / 1e6;
                println!(
                    "| {name} | {:.2} | {:.2} | {gbs:.1} | **{:.2}x** | {:.2}–{:.2}x | {:.2}x |",
                    p.min, p.median, p.ratio, p.ratio_p25, p.ratio_p75, p.min_ratio,
                );
            }
        }
    }
}
