//! Many sequences in one page pool: appends, truncates, forks, frees and
//! save/load against caches outside any pool and an f32 shadow, with the
//! pool's accounting checked after every step.

mod common;

use common::{attend, max_abs_diff, Rng};
use kvq::cache::{attend_batch, dense_attention, resident_bytes, PagePool, PoolStats};
use kvq::{presets, Axis, CacheConfig, Codec, Error, Group, LayerCache, QuantScheme};
use proptest::prelude::*;

const N_KV: usize = 2;
const HD: usize = 64;
const W: usize = N_KV * HD;

fn scheme(bits: u8, axis: Axis, group: Group) -> QuantScheme {
    QuantScheme::new(bits, axis, group).unwrap()
}

/// Keys and values of `n` random tokens.
fn tokens(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<f32>) {
    (rng.vec(n * W), rng.vec(n * W))
}

fn saved(c: &LayerCache) -> Vec<u8> {
    let mut b = Vec::new();
    c.save(&mut b).unwrap();
    b
}

/// 8-bit schemes of every kind (per-channel, per-token, rotated, ggml's
/// q8_0, sinks and windows) and full precision, which takes no pages.
fn configs() -> Vec<CacheConfig> {
    let base = CacheConfig::new(N_KV, HD).threads(1);
    let pc8 = scheme(8, Axis::PerChannel, Group::Size(16));
    let pt8 = scheme(8, Axis::PerToken, Group::Size(32));
    vec![
        base.keys(pc8).values(pt8),
        base.keys(pc8).values(pt8).residual(9).sinks(2),
        base.key_codec(Codec::hadamard(pt8)).values(pc8).residual(4),
        base.keys(presets::q8_0()).values(presets::q8_0()).sinks(1),
        base,
    ]
}

/// The pool's counts agree with what the caches hold: the bytes written
/// into distinct pages, whole pages within the capacity.
fn check_accounting(pool: &PagePool, seqs: &[Seq]) -> Result<(), TestCaseError> {
    let s = pool.stats();
    let r = resident_bytes(seqs.iter().map(|q| &q.pooled));
    prop_assert_eq!(s.stored, r.codes + r.params, "{:?}", s);
    prop_assert!(s.used >= s.stored, "{:?}", s);
    prop_assert!(s.used <= s.capacity.unwrap_or(usize::MAX), "{:?}", s);
    prop_assert!(
        s.used.saturating_add(s.kept) <= s.capacity.unwrap_or(usize::MAX),
        "{:?}",
        s
    );
    prop_assert_eq!(s.pages == 0, s.used == 0, "{:?}", s);
    Ok(())
}

/// A sequence in the pool, the same sequence outside any pool, and its
/// tokens in f32.
struct Seq {
    pooled: LayerCache,
    alone: LayerCache,
    k: Vec<f32>,
    v: Vec<f32>,
}

#[derive(Debug, Clone)]
enum Op {
    New,
    Append(usize, usize),
    Truncate(usize, usize),
    Fork(usize),
    Free(usize),
    /// Saved, dropped and loaded back into the pool (offload and restore).
    Offload(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let s = any::<usize>();
    prop_oneof![
        1 => Just(Op::New),
        6 => (s, prop_oneof![1usize..4, 20usize..120]).prop_map(|(s, n)| Op::Append(s, n)),
        2 => (s, any::<usize>()).prop_map(|(s, m)| Op::Truncate(s, m)),
        2 => s.prop_map(Op::Fork),
        1 => s.prop_map(Op::Free),
        1 => s.prop_map(Op::Offload),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn many_sequences_in_one_pool_match_caches_outside_it(
        which in 0usize..5,
        page in prop_oneof![Just(1usize), Just(16), Just(40), Just(64)],
        pages in prop_oneof![Just(None), (4usize..40).prop_map(Some)],
        ops in proptest::collection::vec(op(), 1..40),
        seed in any::<u64>(),
    ) {
        let cfg = configs()[which];
        let capacity = pages.map(|n| n * cfg.page_bytes(page).unwrap());
        let pool = PagePool::new(page, capacity).unwrap();
        let mut rng = Rng::new(seed);
        let new = |pool: &PagePool| Seq {
            pooled: LayerCache::new_in(cfg, pool).unwrap(),
            alone: LayerCache::new(cfg).unwrap(),
            k: Vec::new(),
            v: Vec::new(),
        };
        let mut seqs = vec![new(&pool)];
        for o in ops {
            let pick = |s: usize, n: usize| s % n.max(1);
            match o {
                Op::New => seqs.push(new(&pool)),
                Op::Append(s, n) if !seqs.is_empty() => {
                    let i = pick(s, seqs.len());
                    let q = &mut seqs[i];
                    let (k, v) = tokens(&mut rng, n);
                    let (before, stats) = (saved(&q.pooled), pool.stats());
                    match q.pooled.extend(&k, &v) {
                        Ok(()) => {
                            q.alone.extend(&k, &v).unwrap();
                            q.k.extend(k);
                            q.v.extend(v);
                        }
                        Err(Error::PoolExhausted { need, free, .. }) => {
                            prop_assert!(capacity.is_some());
                            prop_assert!(need > free, "{} {}", need, free);
                            prop_assert_eq!(saved(&q.pooled), before);
                            prop_assert_eq!(pool.stats().used, stats.used);
                            prop_assert_eq!(pool.stats().pages, stats.pages);
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                Op::Truncate(s, m) if !seqs.is_empty() => {
                    let i = pick(s, seqs.len());
                    let q = &mut seqs[i];
                    let m = m % (q.pooled.len() + 1);
                    q.pooled.truncate(m).unwrap();
                    q.alone.truncate(m).unwrap();
                    q.k.truncate(m * W);
                    q.v.truncate(m * W);
                }
                Op::Fork(s) if !seqs.is_empty() => {
                    let q = &seqs[pick(s, seqs.len())];
                    let pages = pool.stats().pages;
                    let f = Seq {
                        pooled: q.pooled.fork(),
                        alone: q.alone.fork(),
                        k: q.k.clone(),
                        v: q.v.clone(),
                    };
                    // A fork takes no page.
                    prop_assert_eq!(pool.stats().pages, pages);
                    seqs.push(f);
                }
                Op::Free(s) if !seqs.is_empty() => {
                    let i = pick(s, seqs.len());
                    seqs.swap_remove(i);
                }
                Op::Offload(s) if !seqs.is_empty() => {
                    let i = pick(s, seqs.len());
                    let b = saved(&seqs[i].pooled);
                    let q = seqs.swap_remove(i);
                    drop(q.pooled);
                    match LayerCache::load_in(&b[..], &pool) {
                        Ok(c) => {
                            prop_assert!(c == q.alone);
                            seqs.push(Seq { pooled: c, ..q });
                        }
                        // Its pages were shared with forks, which still
                        // hold them: the pool may have no room for a copy.
                        Err(Error::PoolExhausted { .. }) => prop_assert!(capacity.is_some()),
                        Err(e) => panic!("{e}"),
                    }
                }
                _ => {}
            }
            check_accounting(&pool, &seqs)?;
            for q in &seqs {
                prop_assert!(q.pooled == q.alone);
                if q.pooled.is_empty() {
                    continue;
                }
                // One query per KV head (scores written in place) or two.
                let n_q = N_KV * (1 + rng.below(2));
                let x = rng.vec(n_q * HD);
                let got = attend(&q.pooled, &x, n_q);
                let alone = attend(&q.alone, &x, n_q);
                prop_assert!(max_abs_diff(&got, &alone) < 1e-5);
                let want = dense_attention(&x, n_q, &q.k, &q.v, N_KV, HD, 1.0 / 8.0);
                // 8 bits, values in [−1, 1]: within two half-steps per
                // element (a truncated per-channel block is quantized twice).
                let tol = if which == 4 { 1e-5 } else { 0.03 };
                prop_assert!(max_abs_diff(&got, &want) < tol);
            }
        }
        drop(seqs);
        let s = pool.stats();
        prop_assert_eq!((s.pages, s.used, s.stored), (0, 0, 0), "{:?}", s);
        pool.trim();
        prop_assert_eq!(pool.stats().kept, 0);
    }
}

fn kivi4() -> CacheConfig {
    let (k, v) = presets::kivi(4).unwrap();
    CacheConfig::new(N_KV, HD).keys(k).values(v).threads(1)
}

#[test]
fn a_fork_shares_every_page_and_copies_one_when_it_writes() {
    let pool = PagePool::new(256, None).unwrap();
    let mut rng = Rng::new(1);
    let mut a = LayerCache::new_in(kivi4(), &pool).unwrap();
    let (k, v) = tokens(&mut rng, 1000);
    a.extend(&k, &v).unwrap();
    // 1000 tokens: 4 pages of K and 4 of V, the last ones partly filled.
    let s0 = pool.stats();
    assert_eq!(s0.pages, 8);
    let mut b = a.fork();
    assert_eq!(pool.stats(), s0);
    let (k1, v1) = tokens(&mut rng, 1);
    b.append(&k1, &v1).unwrap();
    // B's first write copies the last V page (the key joins the
    // full-precision rows of a block being filled: no write to a page).
    assert_eq!(pool.stats().pages, 9);
    a.append(&k1, &v1).unwrap();
    // A is then alone on its last V page and writes in place.
    assert_eq!(pool.stats().pages, 9);
    assert!(a == b);
    drop(a);
    assert_eq!(pool.stats().pages, 8);
    drop(b);
    assert_eq!(pool.stats().pages, 0);
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn a_full_pool_refuses_a_prompt_whole() {
    let cfg = kivi4();
    let page = cfg.page_bytes(64).unwrap();
    let pool = PagePool::new(64, Some(5 * page)).unwrap();
    let mut rng = Rng::new(2);
    let mut a = LayerCache::new_in(cfg, &pool).unwrap();
    let (k, v) = tokens(&mut rng, 256);
    a.extend(&k, &v).unwrap();
    let s = pool.stats();
    assert_eq!(s.pages, 8);
    assert_eq!(s.used, 4 * page);
    assert!(s.fragmentation().abs() < 1e-12, "{s:?}");
    // 192 more tokens need 3 pages of each; one page pair is free.
    let before = saved(&a);
    let (k, v) = tokens(&mut rng, 192);
    let e = a.extend(&k, &v).unwrap_err();
    assert!(
        matches!(e, Error::PoolExhausted { need, free, .. } if need == 3 * page && free == page),
        "{e}"
    );
    assert_eq!(saved(&a), before);
    assert_eq!(pool.stats(), s);
    // 64 fit.
    a.extend(&k[..64 * W], &v[..64 * W]).unwrap();
    assert_eq!(pool.stats().pages, 10);
    assert_eq!(pool.stats().free(), 0);
    // A truncate needs no page and gives pages back.
    a.truncate(100).unwrap();
    assert_eq!(pool.stats().pages, 4);
    // Freed pages are kept for reuse, within the capacity.
    let kept = pool.stats().kept;
    assert_eq!(kept, 3 * page);
    a.extend(&k[..64 * W], &v[..64 * W]).unwrap();
    assert!(pool.stats().kept < kept);
}

#[test]
fn a_rejected_prompt_gives_back_every_page_it_took() {
    let cfg = kivi4().residual(8);
    let pool = PagePool::new(64, Some(100 * cfg.page_bytes(64).unwrap())).unwrap();
    let mut rng = Rng::new(5);
    let mut a = LayerCache::new_in(cfg, &pool).unwrap();
    let (k, v) = tokens(&mut rng, 300);
    a.extend(&k, &v).unwrap();
    let (before, stats) = (saved(&a), pool.stats());
    // A long prompt whose last value is NaN: stored chunk by chunk, then
    // undone.
    let (k, mut v) = tokens(&mut rng, 5000);
    *v.last_mut().unwrap() = f32::NAN;
    assert!(matches!(a.extend(&k, &v), Err(Error::NonFinite { .. })));
    assert_eq!(saved(&a), before);
    let after = pool.stats();
    assert_eq!(
        (after.pages, after.used, after.stored),
        (stats.pages, stats.used, stats.stored)
    );
}

#[test]
fn a_loaded_sequence_takes_its_pages_from_the_pool() {
    let cfg = kivi4().residual(16).sinks(4);
    let mut rng = Rng::new(3);
    let mut c = LayerCache::new(cfg).unwrap();
    let (k, v) = tokens(&mut rng, 700);
    c.extend(&k, &v).unwrap();
    let b = saved(&c);
    let page = cfg.page_bytes(128).unwrap();
    let small = PagePool::new(128, Some(3 * page)).unwrap();
    assert!(matches!(
        LayerCache::load_in(&b[..], &small),
        Err(Error::PoolExhausted { .. })
    ));
    assert_eq!(small.stats().used, 0);
    let pool = PagePool::new(128, Some(6 * page)).unwrap();
    let back = LayerCache::load_in(&b[..], &pool).unwrap();
    assert!(back == c);
    assert_eq!(pool.stats().pages, 12);
    let q = rng.vec(4 * HD);
    assert!(max_abs_diff(&attend(&back, &q, 4), &attend(&c, &q, 4)) < 1e-5);
    // Malformed bytes are refused and take nothing.
    let mut bad = b.clone();
    let at = bad.len() / 2;
    bad[at] ^= 1;
    drop(back);
    assert!(matches!(
        LayerCache::load_in(&bad[..], &pool),
        Err(Error::Malformed { .. })
    ));
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn a_whole_model_loads_into_one_pool() {
    let (k4, v4) = presets::kivi(4).unwrap();
    let base = CacheConfig::new(N_KV, HD);
    let cfgs = [
        base.keys(k4).values(v4),
        base.keys(presets::q8_0()).values(v4).residual(4),
        base,
    ];
    let mut rng = Rng::new(6);
    let mut m = kvq::KvCache::new(cfgs).unwrap();
    for l in 0..3 {
        let (k, v) = tokens(&mut rng, 300);
        m.layer_mut(l).extend(&k, &v).unwrap();
    }
    let mut b = Vec::new();
    m.save(&mut b).unwrap();
    let need: usize = cfgs.iter().map(|c| 2 * c.page_bytes(256).unwrap()).sum();
    let pool = PagePool::new(256, Some(need)).unwrap();
    let back = kvq::KvCache::load_in(&b[..], &pool).unwrap();
    for l in 0..3 {
        assert!(back.layer(l) == m.layer(l), "layer {l}");
    }
    // Two pages of K and two of V in each quantized layer.
    assert_eq!(pool.stats().pages, 8);
    // A second copy does not fit; the layers it loaded give their pages back.
    assert!(matches!(
        kvq::KvCache::load_in(&b[..], &pool),
        Err(Error::PoolExhausted { .. })
    ));
    assert_eq!(pool.stats().pages, 8);
    drop(back);
    assert_eq!(pool.stats().used, 0);
    let fresh = kvq::KvCache::new_in(cfgs, &pool).unwrap();
    assert_eq!(fresh.n_layers(), 3);
}

#[test]
fn batched_decode_over_pooled_sequences_equals_each_alone() {
    let pool = PagePool::new(32, None).unwrap();
    let mut rng = Rng::new(4);
    let cfg = kivi4().residual(8);
    let mut seqs = Vec::new();
    for n in [1, 31, 32, 33, 300, 1000, 64, 5] {
        let mut s = LayerCache::new_in(cfg, &pool).unwrap();
        let (k, v) = tokens(&mut rng, n);
        s.extend(&k, &v).unwrap();
        seqs.push(s);
    }
    let n_q = 4;
    let q = rng.vec(seqs.len() * n_q * HD);
    let mut out = vec![0f32; q.len()];
    let refs: Vec<&LayerCache> = seqs.iter().collect();
    attend_batch(&refs, &q, n_q, &mut out, 2).unwrap();
    for (i, s) in seqs.iter().enumerate() {
        let one = attend(s, &q[i * n_q * HD..(i + 1) * n_q * HD], n_q);
        assert_eq!(one, out[i * n_q * HD..(i + 1) * n_q * HD]);
    }
}

#[test]
fn sequences_on_many_threads_share_one_pool() {
    let cfg = kivi4();
    let page = cfg.page_bytes(64).unwrap();
    let pool = PagePool::new(64, Some(40 * page)).unwrap();
    let done: Vec<(LayerCache, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let pool = pool.clone();
                s.spawn(move || {
                    let mut rng = Rng::new(10 + t);
                    let mut c = LayerCache::new_in(cfg, &pool).unwrap();
                    let mut refused = 0;
                    for _ in 0..700 {
                        let (k, v) = tokens(&mut rng, 1);
                        match c.append(&k, &v) {
                            Ok(()) => {}
                            Err(Error::PoolExhausted { .. }) => refused += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    (c, refused)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let s: PoolStats = pool.stats();
    // 4 × 700 tokens want 4 × 11 page pairs; 40 exist. After the last
    // refusal less than a page pair was free, and nothing was freed.
    let tokens: usize = done.iter().map(|(c, _)| c.len()).sum();
    let refused: usize = done.iter().map(|(_, r)| r).sum();
    assert_eq!(tokens + refused, 4 * 700);
    assert!(refused > 0);
    assert!(s.used <= 40 * page && s.used + page > 40 * page, "{s:?}");
    let r = resident_bytes(done.iter().map(|(c, _)| c));
    assert_eq!(s.stored, r.codes + r.params);
    drop(done);
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn bad_pools_are_errors() {
    assert!(matches!(
        PagePool::new(0, None),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        PagePool::new(kvq::cache::MAX_PAGE_TOKENS + 1, None),
        Err(Error::InvalidArgument { .. })
    ));
    // A page smaller than a per-channel block holds one whole block.
    let cfg = kivi4();
    assert_eq!(
        cfg.page_bytes(1).unwrap(),
        cfg.page_bytes(32).unwrap() - {
            // Values are per token: 31 tokens fewer.
            let v = presets::kivi(4).unwrap().1;
            v.layout(N_KV, HD).unwrap().bytes(31)
        }
    );
    // Zero-capacity pools refuse the first packed token, and only that.
    let pool = PagePool::new(16, Some(0)).unwrap();
    let mut c = LayerCache::new_in(CacheConfig::new(N_KV, HD), &pool).unwrap();
    c.append(&[0.5f32; W], &[0.5f32; W]).unwrap();
    let mut q = LayerCache::new_in(kivi4().residual(2), &pool).unwrap();
    q.append(&[0.5f32; W], &[0.5f32; W]).unwrap();
    q.append(&[0.5f32; W], &[0.5f32; W]).unwrap();
    assert!(matches!(
        q.append(&[0.5f32; W], &[0.5f32; W]),
        Err(Error::PoolExhausted { .. })
    ));
    assert_eq!(q.len(), 2);
}
