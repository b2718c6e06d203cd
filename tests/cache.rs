//! The streaming cache: placement of tokens, fused attention against dense
//! attention, GQA, all-or-nothing appends, accounting.

use half::f16;
mod common;

use common::{backends, max_abs_diff, placed, Rng};
use kvq::cache::dense_attention;
use kvq::{Axis, CacheConfig, Error, Group, KvCache, LayerCache, Mode, QuantScheme, ScaleFormat};

fn scheme(bits: u8, axis: Axis, group: Group) -> QuantScheme {
    QuantScheme::new(bits, axis, group).unwrap()
}

fn kivi(bits: u8) -> (QuantScheme, QuantScheme) {
    kvq::presets::kivi(bits).unwrap()
}

/// Fill a cache with `len` random tokens; returns the raw K and V.
fn fill(cache: &mut LayerCache, len: usize, rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    let w = cache.config().n_kv_heads() * cache.config().head_dim();
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    for _ in 0..len {
        let k = rng.vec(w);
        let v = rng.vec(w);
        cache.append(&k, &v).unwrap();
        ks.extend(k);
        vs.extend(v);
    }
    (ks, vs)
}

#[test]
fn full_precision_window_equals_dense() {
    let (n_kv, hd) = (2, 64);
    let (k, v) = kivi(4);
    let cfg = CacheConfig::new(n_kv, hd).keys(k).values(v).residual(300);
    let mut c = LayerCache::new(cfg).unwrap();
    let mut rng = Rng::new(7);
    let (ks, vs) = fill(&mut c, 200, &mut rng);
    assert_eq!(c.packed_len(), (0, 0));
    assert_eq!(c.keys_f32(), ks);
    let q = rng.vec(4 * hd);
    let mut out = vec![0.0; 4 * hd];
    c.attend(&q, 4, &mut out).unwrap();
    let want = dense_attention(&q, 4, &ks, &vs, n_kv, hd, 1.0 / 8.0);
    assert!(
        max_abs_diff(&out, &want) < 2e-6,
        "{}",
        max_abs_diff(&out, &want)
    );
}

#[test]
fn eight_bit_is_close_to_dense() {
    let (n_kv, hd) = (4, 128);
    for axis in [Axis::PerToken, Axis::PerChannel] {
        let s = scheme(8, axis, Group::Size(32));
        let cfg =
            CacheConfig::new(n_kv, hd)
                .keys(s)
                .values(scheme(8, Axis::PerToken, Group::Size(32)));
        let mut c = LayerCache::new(cfg).unwrap();
        let mut rng = Rng::new(11);
        let (ks, vs) = fill(&mut c, 257, &mut rng);
        let q = rng.vec(8 * hd);
        let mut out = vec![0.0; 8 * hd];
        c.attend(&q, 8, &mut out).unwrap();
        let want = dense_attention(&q, 8, &ks, &vs, n_kv, hd, 1.0 / (hd as f32).sqrt());
        let d = max_abs_diff(&out, &want);
        assert!(d < 5e-3, "{axis:?}: {d}");
        // And 2 bits is clearly worse: the test can tell quantization apart.
        let s2 = scheme(2, axis, Group::Size(32));
        let cfg =
            CacheConfig::new(n_kv, hd)
                .keys(s2)
                .values(scheme(2, Axis::PerToken, Group::Size(32)));
        let mut c2 = LayerCache::new(cfg).unwrap();
        c2.extend(&ks, &vs).unwrap();
        let mut out2 = vec![0.0; 8 * hd];
        c2.attend(&q, 8, &mut out2).unwrap();
        assert!(max_abs_diff(&out2, &want) > 4.0 * d);
    }
}

#[test]
fn streaming_equals_bulk_extend() {
    let (n_kv, hd) = (3, 64);
    let mut rng = Rng::new(5);
    let configs = [
        {
            let (k, v) = kivi(2);
            CacheConfig::new(n_kv, hd)
                .keys(k)
                .values(v)
                .residual(16)
                .sinks(3)
        },
        CacheConfig::new(n_kv, hd)
            .keys(scheme(3, Axis::PerToken, Group::Head))
            .values(scheme(5, Axis::PerToken, Group::Vector)),
        CacheConfig::new(n_kv, hd)
            .keys(scheme(4, Axis::PerChannel, Group::Size(8)).with_scale_format(ScaleFormat::Bf16))
            .values(
                scheme(6, Axis::PerToken, Group::Size(16))
                    .with_mode(Mode::Symmetric)
                    .unwrap(),
            )
            .residual(5),
    ];
    for cfg in configs {
        let w = n_kv * hd;
        let len = 133;
        let ks = rng.vec(len * w);
        let vs = rng.vec(len * w);
        let mut a = LayerCache::new(cfg).unwrap();
        for t in 0..len {
            a.append(&ks[t * w..(t + 1) * w], &vs[t * w..(t + 1) * w])
                .unwrap();
        }
        let mut b = LayerCache::new(cfg).unwrap();
        b.extend(&ks, &vs).unwrap();
        assert!(a == b, "{cfg:?}");
        assert_eq!(a.bytes(), b.bytes());
        // Mixed: a prefix in bulk, the rest streamed.
        let mut c = LayerCache::new(cfg).unwrap();
        c.extend(&ks[..50 * w], &vs[..50 * w]).unwrap();
        c.extend(&ks[50 * w..], &vs[50 * w..]).unwrap();
        assert!(a == c);
        // Random chunks: units straddle what is already in the tail and
        // the new rows, and sink, residual and block edges fall anywhere.
        for trial in 0..20 {
            let mut d = LayerCache::new(cfg).unwrap();
            let mut e = LayerCache::new(cfg).unwrap();
            let mut t = 0;
            let mut cuts = Vec::new();
            while t < len {
                let n = (1 + (rng.f().abs() * 40.0) as usize).min(len - t);
                d.extend(&ks[t * w..(t + n) * w], &vs[t * w..(t + n) * w])
                    .unwrap();
                cuts.push(n);
                // The same state as streaming the same prefix.
                for u in t..t + n {
                    e.append(&ks[u * w..(u + 1) * w], &vs[u * w..(u + 1) * w])
                        .unwrap();
                }
                t += n;
                assert!(d == e, "trial {trial}, chunks {cuts:?}, {cfg:?}");
            }
            assert!(a == d, "trial {trial}, chunks {cuts:?}, {cfg:?}");
        }
    }
}

#[test]
fn gqa_equals_per_head() {
    let (n_kv, hd) = (2, 64);
    let (k, v) = kivi(4);
    let cfg = CacheConfig::new(n_kv, hd)
        .keys(k)
        .values(v)
        .residual(32)
        .sinks(2);
    let mut c = LayerCache::new(cfg).unwrap();
    let mut rng = Rng::new(9);
    let (kr, vr) = fill(&mut c, 300, &mut rng);
    let (kd, vd) = placed(&cfg, &kr, &vr);
    assert_eq!((c.keys_f32(), c.values_f32()), (kd.clone(), vd.clone()));
    for r in [1usize, 2, 3, 8] {
        let n_q = n_kv * r;
        let q = rng.vec(n_q * hd);
        let mut out = vec![0.0; n_q * hd];
        c.attend(&q, n_q, &mut out).unwrap();
        // Each query head alone (as MHA over its KV head) gives the same.
        let d = diff_from_heads_alone(&c, &q, &out, n_kv, hd);
        assert!(d < 1e-6, "r {r}: {d}");
        let want = dense_attention(&q, n_q, &kd, &vd, n_kv, hd, 0.125);
        assert!(max_abs_diff(&out, &want) < 1e-5);
    }
}

/// The largest difference between `out`, the attention of every query
/// head of `q` at once, and each query head attended alone (as MHA over
/// its KV head, one query per KV head).
fn diff_from_heads_alone(c: &LayerCache, q: &[f32], out: &[f32], n_kv: usize, hd: usize) -> f32 {
    let n_q = q.len() / hd;
    let r = n_q / n_kv;
    (0..n_q)
        .map(|i| {
            let h = i / r;
            let mut qi = vec![0.0; n_kv * hd];
            qi[h * hd..(h + 1) * hd].copy_from_slice(&q[i * hd..(i + 1) * hd]);
            let mut oi = vec![0.0; n_kv * hd];
            c.attend(&qi, n_kv, &mut oi).unwrap();
            max_abs_diff(&out[i * hd..(i + 1) * hd], &oi[h * hd..(h + 1) * hd])
        })
        .fold(0.0, f32::max)
}

/// Several queries per KV head over many pages, where the keys' and the
/// values' sections end at different places: per-channel blocks of 48 or
/// 32 tokens pack whole blocks and per-token rows every token (so their
/// packed regions end apart), sinks, a residual window, and pages of 96
/// tokens (the same for every unit) or 40 (rounded up to a whole block:
/// 48, 64 or 40, so most page ends differ too). Decode splits the range
/// where both end and merges the pieces, which must equal each query head
/// alone and dense attention.
#[test]
fn gqa_across_pages_whose_sections_differ() {
    let (n_kv, hd) = (2, 64);
    let pc = |g| scheme(4, Axis::PerChannel, Group::Size(g));
    let pt = scheme(4, Axis::PerToken, Group::Size(32));
    let pools = [96, 40].map(|t| kvq::cache::PagePool::new(t, None).unwrap());
    for (backend, pool) in backends()
        .into_iter()
        .flat_map(|b| pools.iter().map(move |p| (b, p)))
    {
        for ((ks, vs), (len, res, sinks)) in [
            (pc(48), pt),
            (pc(48), pc(32)),
            (pc(32), pc(48)),
            (pt, pc(48)),
        ]
        .into_iter()
        .flat_map(|kv| [(700, 0, 0), (701, 20, 3), (655, 7, 1)].map(|x| (kv, x)))
        {
            let cfg = CacheConfig::new(n_kv, hd)
                .keys(ks)
                .values(vs)
                .residual(res)
                .sinks(sinks)
                .backend(backend)
                .threads(1);
            let mut c = LayerCache::new_in(cfg, pool).unwrap();
            let mut rng = Rng::new(len as u64);
            let (kr, vr) = fill(&mut c, len, &mut rng);
            let (kd, vd) = placed(&cfg, &kr, &vr);
            for r in [2usize, 4] {
                let n_q = n_kv * r;
                let q = rng.vec(n_q * hd);
                let mut out = vec![0.0; n_q * hd];
                c.attend(&q, n_q, &mut out).unwrap();
                let d = diff_from_heads_alone(&c, &q, &out, n_kv, hd);
                assert!(d < 1e-5, "len {len} r {r}: {d}");
                let want = dense_attention(&q, n_q, &kd, &vd, n_kv, hd, 0.125);
                let d = max_abs_diff(&out, &want);
                assert!(d < 1e-5, "len {len} r {r}: {d}");
            }
        }
    }
}

#[test]
fn per_channel_flush_across_block_boundaries() {
    let (n_kv, hd, g, r) = (2, 32, 32, 16);
    let (ks, vs) = (
        scheme(3, Axis::PerChannel, Group::Size(g)),
        scheme(3, Axis::PerToken, Group::Size(16)),
    );
    for backend in backends() {
        for len in [g - 1, g, g + 1, 3 * g + r - 1, 3 * g + r, 3 * g + r + 1] {
            for (res, sinks) in [(0, 0), (r, 0), (r, 4)] {
                let cfg = CacheConfig::new(n_kv, hd)
                    .keys(ks)
                    .values(vs)
                    .residual(res)
                    .sinks(sinks)
                    .backend(backend);
                let mut c = LayerCache::new(cfg).unwrap();
                let mut rng = Rng::new(len as u64 + 1);
                let (kr, vr) = fill(&mut c, len, &mut rng);
                let after_sinks = len.saturating_sub(sinks);
                let (pk, pv) = c.packed_len();
                // Keys: whole blocks only, at least `res` newest kept exact.
                let want_pk = if after_sinks >= res + g {
                    (after_sinks - res) / g * g
                } else {
                    0
                };
                let at = format!("{backend:?} len {len} res {res} sinks {sinks}");
                assert_eq!(pk, want_pk, "{at}");
                assert_eq!(pv, after_sinks.saturating_sub(res), "{at}");
                // Every row where the shadow puts it: sinks and tail exact,
                // the sealed region as the codec quantizes the raw rows.
                let (kd, vd) = placed(&cfg, &kr, &vr);
                let w = n_kv * hd;
                let tail0 = (sinks + pk).min(len) * w;
                assert_eq!(&kd[tail0..], &kr[tail0..], "{at}");
                if pk > 0 {
                    assert_ne!(&kd[sinks * w..tail0], &kr[sinks * w..tail0], "{at}");
                }
                assert_eq!(c.keys_f32(), kd, "{at}: keys");
                assert_eq!(c.values_f32(), vd, "{at}: values");
                let q = rng.vec(2 * n_kv * hd);
                let mut out = vec![0.0; q.len()];
                c.attend(&q, 2 * n_kv, &mut out).unwrap();
                let want =
                    dense_attention(&q, 2 * n_kv, &kd, &vd, n_kv, hd, 1.0 / (hd as f32).sqrt());
                assert!(max_abs_diff(&out, &want) < 1e-5, "{at}");
            }
        }
    }
}

#[test]
fn sinks_stay_exact() {
    let (n_kv, hd) = (1, 64);
    for backend in backends() {
        let cfg = CacheConfig::new(n_kv, hd)
            .keys(scheme(2, Axis::PerToken, Group::Size(32)))
            .values(scheme(2, Axis::PerToken, Group::Size(32)))
            .sinks(4)
            .backend(backend);
        let mut c = LayerCache::new(cfg).unwrap();
        let mut rng = Rng::new(3);
        let (ks, vs) = fill(&mut c, 40, &mut rng);
        let (kd, vd) = placed(&cfg, &ks, &vs);
        assert_eq!(&kd[..4 * hd], &ks[..4 * hd]);
        assert_ne!(&kd[4 * hd..5 * hd], &ks[4 * hd..5 * hd]);
        assert_eq!(c.keys_f32(), kd, "{backend:?}");
        assert_eq!(c.values_f32(), vd, "{backend:?}");
        let q = rng.vec(3 * hd);
        let mut out = vec![0.0; q.len()];
        c.attend(&q, 3, &mut out).unwrap();
        let want = dense_attention(&q, 3, &kd, &vd, n_kv, hd, 0.125);
        assert!(max_abs_diff(&out, &want) < 1e-5, "{backend:?}");
    }
}

#[test]
fn rejected_appends_leave_cache_untouched() {
    let (n_kv, hd) = (2, 64);
    for (k, v) in [
        kivi(4),
        (
            scheme(4, Axis::PerToken, Group::Head),
            scheme(1, Axis::PerChannel, Group::Size(8)),
        ),
    ] {
        let cfg = CacheConfig::new(n_kv, hd)
            .keys(k)
            .values(v)
            .residual(8)
            .sinks(1);
        let mut c = LayerCache::new(cfg).unwrap();
        let mut rng = Rng::new(1);
        fill(&mut c, 45, &mut rng);
        let before = c.clone();
        let w = n_kv * hd;
        let good = rng.vec(w);

        let mut bad = good.clone();
        bad[w - 3] = f32::NAN;
        let e = c.append(&bad, &good).unwrap_err();
        assert!(
            matches!(
                e,
                Error::NonFinite {
                    token: 0,
                    head: 1,
                    channel: 61,
                    ..
                }
            ),
            "{e}"
        );
        assert!(c == before);
        let e = c.append(&good, &bad).unwrap_err();
        assert!(e.to_string().contains("non-finite"), "{e}");
        assert!(c == before);

        // Wrong lengths.
        assert!(matches!(
            c.append(&good[..w - 1], &good[..w - 1]),
            Err(Error::Length { .. })
        ));
        assert!(matches!(
            c.append(&good, &good[..w - 8]),
            Err(Error::Length { .. })
        ));
        assert!(c == before);

        // A bad token in the middle of a bulk extend rejects the whole call.
        let mut ks = rng.vec(10 * w);
        let vs = rng.vec(10 * w);
        ks[6 * w + 5] = f32::INFINITY;
        let e = c.extend(&ks, &vs).unwrap_err();
        assert!(
            matches!(
                e,
                Error::NonFinite {
                    token: 6,
                    head: 0,
                    channel: 5,
                    ..
                }
            ),
            "{e}"
        );
        assert!(c == before);

        // A value whose scale does not fit f16.
        let mut huge = good.clone();
        huge[0] = 1.0e5;
        huge[1] = -1.0e5;
        let e = c.append(&huge, &huge).unwrap_err();
        assert!(matches!(e, Error::ScaleOverflow { .. }), "{e}");
        assert!(c == before);
        assert_eq!(c.len(), 45);
        c.append(&good, &good).unwrap();
        assert_eq!(c.len(), 46);
    }
}

/// A long `extend` is checked and stored in chunks; a fault in a late
/// chunk undoes the earlier ones, the error is the one a whole-input check
/// finds first (non-finite keys, then values, then overflow), and the
/// cache works on as if the call had never happened.
#[test]
fn rejected_long_extend_rolls_back_every_chunk() {
    let (n_kv, hd) = (2, 64);
    let w = n_kv * hd;
    let n = 2000; // several chunks at this width
    for (k, v) in [
        kivi(4),
        (
            scheme(4, Axis::PerToken, Group::Size(32)),
            scheme(2, Axis::PerChannel, Group::Size(16)),
        ),
    ] {
        let cfg = CacheConfig::new(n_kv, hd)
            .keys(k)
            .values(v)
            .residual(40)
            .sinks(3);
        let mut rng = Rng::new(33);
        let mut c = LayerCache::new(cfg).unwrap();
        fill(&mut c, 45, &mut rng);
        let before = c.clone();
        let ks = rng.vec(n * w);
        let vs = rng.vec(n * w);

        // Overflow in the keys' first chunk, NaN in the values' last one:
        // the non-finite value is reported.
        let (mut kb, mut vb) = (ks.clone(), vs.clone());
        kb[100 * w] = 1.0e5;
        kb[100 * w + 1] = -1.0e5;
        vb[1900 * w + 70] = f32::NAN;
        let e = c.extend(&kb, &vb).unwrap_err();
        assert!(
            matches!(
                e,
                Error::NonFinite {
                    token: 1900,
                    head: 1,
                    channel: 6,
                    ..
                }
            ),
            "{e}"
        );
        assert!(c == before);
        // Only the overflow: reported, and nothing stored.
        let e = c.extend(&kb, &vs).unwrap_err();
        assert!(matches!(e, Error::ScaleOverflow { .. }), "{e}");
        assert!(c == before);
        // A fault in the last chunk only.
        let mut kc = ks.clone();
        kc[(n - 1) * w] = f32::NEG_INFINITY;
        let e = c.extend(&kc, &vs).unwrap_err();
        assert!(matches!(e, Error::NonFinite { token: 1999, .. }), "{e}");
        assert!(c == before);

        // And the cache goes on exactly as a fresh copy does.
        let mut d = before.clone();
        c.extend(&ks, &vs).unwrap();
        for t in 0..n {
            d.append(&ks[t * w..(t + 1) * w], &vs[t * w..(t + 1) * w])
                .unwrap();
        }
        assert!(c == d);
    }
}

#[test]
fn per_channel_overflow_is_caught_at_append() {
    // Each token fits f16 alone; together in one 1-bit channel block they
    // would need a scale of 130000: the second append must fail, not a
    // later flush.
    let s = scheme(1, Axis::PerChannel, Group::Size(8));
    let mut c = LayerCache::new(CacheConfig::new(1, 8).keys(s).values(s)).unwrap();
    let a = [65000.0f32; 8];
    let b = [-65000.0f32; 8];
    c.append(&a, &a).unwrap();
    let before = c.clone();
    assert!(matches!(c.append(&b, &a), Err(Error::ScaleOverflow { .. })));
    assert!(c == before);
    // Small values after a large one in the same open block: the new
    // tokens alone look safe, the block's range does not (65504 and −2
    // need a 1-bit scale of 65506). Found by `kvq-fuzz ops`; it panicked
    // when the block was sealed.
    let mut c = LayerCache::new(CacheConfig::new(1, 8).keys(s).values(s)).unwrap();
    let mut big = [0.5f32; 8];
    big[6] = 65504.0;
    c.append(&[0.5f32; 8], &big).unwrap();
    let before = c.clone();
    let small = [-2.0f32; 8 * 12];
    assert!(matches!(
        c.extend(&small, &small),
        Err(Error::ScaleOverflow { .. })
    ));
    assert!(c == before);
    // Below the overflow the same stream is stored.
    big[6] = 30000.0;
    let mut c = LayerCache::new(CacheConfig::new(1, 8).keys(s).values(s)).unwrap();
    c.append(&[0.5f32; 8], &big).unwrap();
    c.extend(&small, &small).unwrap();
    assert_eq!(c.len(), 13);
}

#[test]
fn half_inputs_match_f32() {
    let (n_kv, hd) = (2, 64);
    let (k, v) = kivi(4);
    let cfg = CacheConfig::new(n_kv, hd).keys(k).values(v).residual(4);
    let mut rng = Rng::new(17);
    let ks: Vec<f16> = rng
        .vec(70 * n_kv * hd)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let vs: Vec<f16> = rng
        .vec(70 * n_kv * hd)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let mut a = LayerCache::new(cfg).unwrap();
    a.extend(&ks, &vs).unwrap();
    let mut b = LayerCache::new(cfg).unwrap();
    let kf: Vec<f32> = ks.iter().map(|x| x.to_f32()).collect();
    let vf: Vec<f32> = vs.iter().map(|x| x.to_f32()).collect();
    b.extend(&kf, &vf).unwrap();
    assert!(a == b);
}

/// The last `n` positions of a cache holding `k`/`v` (dequantized), as
/// `attend_causal` sees them.
struct Causal<'a> {
    q: &'a [f32],
    n_q: usize,
    k: &'a [f32],
    v: &'a [f32],
    n_kv: usize,
    hd: usize,
    n: usize,
    window: Option<usize>,
}

impl Causal<'_> {
    /// Position `j`'s row of `out` against dense attention over what it sees.
    fn check(&self, out: &[f32], j: usize) {
        let (n_q, hd, w) = (self.n_q, self.hd, self.n_kv * self.hd);
        let pos = self.k.len() / w - self.n + j;
        let lo = self.window.map_or(0, |wn| (pos + 1).saturating_sub(wn));
        let want = dense_attention(
            &self.q[j * n_q * hd..(j + 1) * n_q * hd],
            n_q,
            &self.k[lo * w..(pos + 1) * w],
            &self.v[lo * w..(pos + 1) * w],
            self.n_kv,
            hd,
            1.0 / (hd as f32).sqrt(),
        );
        let d = max_abs_diff(&out[j * n_q * hd..(j + 1) * n_q * hd], &want);
        assert!(d < 1e-5, "window {:?} position {j}: {d}", self.window);
    }
}

#[test]
fn causal_block_attention_and_window() {
    let (n_kv, hd, n_q) = (2, 32, 4);
    let (k, v) = kivi(4);
    let cfg = CacheConfig::new(n_kv, hd).keys(k).values(v).residual(8);
    let mut c = LayerCache::new(cfg).unwrap();
    let mut rng = Rng::new(21);
    let (mut kr, mut vr) = fill(&mut c, 100, &mut rng);
    let w = n_kv * hd;
    let n = 70;
    let (kn, vn) = (rng.vec(n * w), rng.vec(n * w));
    c.extend(&kn, &vn).unwrap();
    kr.extend(kn);
    vr.extend(vn);
    let (kd, vd) = placed(&cfg, &kr, &vr);
    assert_eq!((c.keys_f32(), c.values_f32()), (kd.clone(), vd.clone()));
    let q = rng.vec(n * n_q * hd);
    for window in [None, Some(1), Some(17), Some(1000)] {
        let mut out = vec![0.0; q.len()];
        c.attend_causal(&q, n_q, &mut out, window).unwrap();
        let cause = Causal {
            q: &q,
            n_q,
            k: &kd,
            v: &vd,
            n_kv,
            hd,
            n,
            window,
        };
        for j in 0..n {
            cause.check(&out, j);
        }
    }
    // The last position of a causal block is plain decode attention.
    let mut out = vec![0.0; q.len()];
    c.attend_causal(&q, n_q, &mut out, None).unwrap();
    let mut last = vec![0.0; n_q * hd];
    c.attend(&q[(n - 1) * n_q * hd..], n_q, &mut last).unwrap();
    assert!(max_abs_diff(&out[(n - 1) * n_q * hd..], &last) < 1e-6);
}

#[test]
fn long_prefill_in_key_chunks_and_position_ranges() {
    // One KV head of 64 and eight query heads (MQA): a prefill block is 64
    // rows, so its keys are taken in chunks of 1024 positions and folded
    // into a running softmax, and two threads split the 1500 positions.
    // Sinks, a residual window and per-channel blocks put chunk edges on
    // every kind of storage; two threads must agree with one bit for bit
    // and with dense attention over the dequantized cache.
    let (n_kv, hd, n_q, len, n) = (1, 64, 8, 3000, 1500);
    let (k, v) = kivi(4);
    let mk = |t| {
        CacheConfig::new(n_kv, hd)
            .keys(k)
            .values(v)
            .residual(50)
            .sinks(3)
            .threads(t)
    };
    let mut rng = Rng::new(77);
    let w = n_kv * hd;
    let (ks, vs) = (rng.vec(len * w), rng.vec(len * w));
    let mut one = LayerCache::new(mk(1)).unwrap();
    one.extend(&ks, &vs).unwrap();
    let mut two = LayerCache::new(mk(2)).unwrap();
    two.extend(&ks, &vs).unwrap();
    let (kd, vd) = (two.keys_f32(), two.values_f32());
    let q: Vec<f32> = rng.vec(n * n_q * hd).iter().map(|x| 3.0 * x).collect();
    for window in [None, Some(700), Some(5)] {
        let (mut oa, mut ob) = (vec![0.0; q.len()], vec![0.0; q.len()]);
        one.attend_causal(&q, n_q, &mut oa, window).unwrap();
        two.attend_causal(&q, n_q, &mut ob, window).unwrap();
        // The same blocks and key chunks whichever thread takes them.
        assert_eq!(oa, ob, "window {window:?}: threads 1 and 2 differ");
        let cause = Causal {
            q: &q,
            n_q,
            k: &kd,
            v: &vd,
            n_kv,
            hd,
            n,
            window,
        };
        for j in [0, 1, 63, 64, 700, 1023, 1024, 1025, 1200, n - 1] {
            cause.check(&ob, j);
        }
    }
    // Half-precision queries: widened per block, the same output as the
    // same values given as f32.
    let qh: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
    let qw: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
    let (mut oh, mut ow) = (vec![0.0; q.len()], vec![0.0; q.len()]);
    two.attend_causal(&qh, n_q, &mut oh, None).unwrap();
    two.attend_causal(&qw, n_q, &mut ow, None).unwrap();
    assert_eq!(oh, ow);
    // A NaN in the last query: refused before any output is written.
    let mut bad = q.clone();
    bad[(n - 1) * n_q * hd + 5 * hd + 3] = f32::NAN;
    let mut out = vec![7.0; q.len()];
    let e = two.attend_causal(&bad, n_q, &mut out, None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NonFinite {
                token,
                head: 5,
                channel: 3,
                ..
            } if token == n - 1
        ),
        "{e}"
    );
    assert!(out.iter().all(|&x| x == 7.0));
}

#[test]
fn prefill_over_threads_equals_one_thread_for_every_codec() {
    // Rotated, codebook, outlier and pre-RoPE caches through the prefill
    // split: the threads take the same blocks and chunks one thread does.
    let (n_kv, hd, n_q, len, n) = (2, 64, 6, 1500, 700);
    let (k4, v4) = kivi(4);
    let pt4 = scheme(4, Axis::PerToken, Group::Size(32));
    let rope = kvq::Rope::new(10_000.0, hd, kvq::RopeStyle::Halves);
    let base = CacheConfig::new(n_kv, hd).sinks(4).residual(40);
    let cfgs = [
        base.keys(k4).values(v4),
        base.key_codec(kvq::Codec::hadamard(pt4))
            .value_codec(kvq::Codec::hadamard(pt4)),
        base.key_codec(kvq::presets::iq4_nl())
            .value_codec(kvq::presets::iq4_nl()),
        base.key_codec(kvq::Codec::from(k4).with_outliers(0.01).unwrap())
            .value_codec(kvq::Codec::from(v4).with_outliers(0.01).unwrap()),
        base.keys(k4).values(v4).pre_rope(rope),
        base.key_codec(kvq::Codec::from(k4).with_outliers(0.01).unwrap())
            .values(v4)
            .pre_rope(rope),
    ];
    let mut rng = Rng::new(91);
    let w = n_kv * hd;
    let (ks, vs) = (rng.vec(len * w), rng.vec(len * w));
    let q: Vec<f32> = rng.vec(n * n_q * hd).iter().map(|x| 2.0 * x).collect();
    for (i, cfg) in cfgs.into_iter().enumerate() {
        let mut one = LayerCache::new(cfg.threads(1)).unwrap();
        one.extend(&ks, &vs).unwrap();
        let mut two = LayerCache::new(cfg.threads(2)).unwrap();
        two.extend(&ks, &vs).unwrap();
        for window in [None, Some(300)] {
            let (mut oa, mut ob) = (vec![0.0; q.len()], vec![0.0; q.len()]);
            one.attend_causal(&q, n_q, &mut oa, window).unwrap();
            two.attend_causal(&q, n_q, &mut ob, window).unwrap();
            assert_eq!(oa, ob, "configuration {i}, window {window:?}");
            assert!(ob.iter().all(|x| x.is_finite()));
        }
    }
}

#[test]
fn attend_rejects_bad_input() {
    let mut c = LayerCache::new(CacheConfig::new(2, 16)).unwrap();
    let mut out = vec![0.0; 64];
    assert!(matches!(
        c.attend(&[0.0f32; 64], 4, &mut out),
        Err(Error::InvalidShape { .. })
    ));
    c.append(&[0.5f32; 32], &[0.5f32; 32]).unwrap();
    assert!(matches!(
        c.attend(&[0.0f32; 64], 3, &mut out),
        Err(Error::InvalidShape { .. })
    ));
    assert!(matches!(
        c.attend(&[0.0f32; 60], 4, &mut out),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        c.attend(&[0.0f32; 64], 4, &mut out[..32]),
        Err(Error::Length { .. })
    ));
    let mut q = [0.0f32; 64];
    q[20] = f32::NAN;
    assert!(matches!(
        c.attend(&q, 4, &mut out),
        Err(Error::NonFinite {
            head: 1,
            channel: 4,
            ..
        })
    ));
    let mut out2 = vec![0.0; 128];
    assert!(matches!(
        c.attend_causal(&[0.0f32; 128], 4, &mut out2, None),
        Err(Error::InvalidShape { .. })
    ));
    assert!(matches!(
        c.attend_causal(&[0.0f32; 64], 4, &mut out, Some(0)),
        Err(Error::InvalidShape { .. })
    ));
    assert!(LayerCache::new(CacheConfig::new(0, 16)).is_err());
    assert!(LayerCache::new(CacheConfig::new(2, 12)).is_err());
    let e =
        LayerCache::new(CacheConfig::new(2, 64).keys(scheme(4, Axis::PerToken, Group::Size(48))))
            .unwrap_err();
    assert!(e.to_string().contains("48"));
}

#[test]
fn accounting_matches_schemes() {
    let (n_kv, hd) = (4, 128);
    let (k, v) = (
        scheme(4, Axis::PerChannel, Group::Size(32)),
        scheme(2, Axis::PerToken, Group::Size(64)),
    );
    let (lk, lv) = (k.layout(n_kv, hd).unwrap(), v.layout(n_kv, hd).unwrap());
    let mut c = LayerCache::new(CacheConfig::new(n_kv, hd).keys(k).values(v)).unwrap();
    let mut rng = Rng::new(2);
    fill(&mut c, 1024, &mut rng);
    let b = c.bytes();
    assert_eq!(b.full_precision, 0);
    assert_eq!(b.codes + b.params, lk.bytes(1024) + lv.bytes(1024));
    let want = (lk.effective_bits() + lv.effective_bits()) / 2.0;
    assert!(
        (c.effective_bits() - want).abs() < 1e-12,
        "{} vs {want}",
        c.effective_bits()
    );

    // With a residual window and sinks, the overhead fades with length.
    let cfg = CacheConfig::new(n_kv, hd)
        .keys(k)
        .values(v)
        .residual(128)
        .sinks(4);
    let mut c = LayerCache::new(cfg).unwrap();
    fill(&mut c, 4000, &mut rng);
    let b = c.bytes();
    let (pk, pv) = c.packed_len();
    assert_eq!(b.codes + b.params, lk.bytes(pk) + lv.bytes(pv));
    assert_eq!(
        b.full_precision,
        ((4000 - pk) + (4000 - pv)) * n_kv * hd * 4
    );
    assert!(c.effective_bits() > want && c.effective_bits() < want + 1.5);

    let mut kv = KvCache::new([
        CacheConfig::new(n_kv, hd).keys(k).values(v),
        CacheConfig::new(n_kv, hd)
            .keys(scheme(8, Axis::PerToken, Group::Size(32)))
            .values(v),
    ])
    .unwrap();
    for l in 0..2 {
        let w = n_kv * hd;
        kv.layer_mut(l)
            .extend(&rng.vec(64 * w), &rng.vec(64 * w))
            .unwrap();
    }
    let l8 = scheme(8, Axis::PerToken, Group::Size(32))
        .layout(n_kv, hd)
        .unwrap();
    assert_eq!(
        kv.bytes().total(),
        lk.bytes(64) + 2 * lv.bytes(64) + l8.bytes(64)
    );
    kv.clear();
    assert_eq!(kv.bytes().total(), 0);
    assert_eq!(kv.effective_bits(), 0.0);
}

#[test]
fn threads_do_not_change_results() {
    let (n_kv, hd) = (8, 64);
    let (k, v) = kivi(4);
    let mut rng = Rng::new(4);
    let mut a = LayerCache::new(CacheConfig::new(n_kv, hd).keys(k).values(v).threads(1)).unwrap();
    let (ks, vs) = fill(&mut a, 3000, &mut rng);
    let mut b = LayerCache::new(CacheConfig::new(n_kv, hd).keys(k).values(v).threads(2)).unwrap();
    b.extend(&ks, &vs).unwrap();
    let q = rng.vec(16 * hd);
    let (mut oa, mut ob) = (vec![0.0; q.len()], vec![0.0; q.len()]);
    a.attend(&q, 16, &mut oa).unwrap();
    b.attend(&q, 16, &mut ob).unwrap();
    assert_eq!(oa, ob);
}

/// Many threads attending on one shared cache at once (each call with its
/// own thread fan-out) get exactly what one thread gets.
#[test]
fn concurrent_attends_on_a_shared_cache_match_one_thread() {
    let (n_kv, hd) = (4, 64);
    let (k, v) = kivi(4);
    let mut rng = Rng::new(12);
    for threads in [1, 2] {
        let cfg = CacheConfig::new(n_kv, hd)
            .keys(k)
            .values(v)
            .residual(32)
            .sinks(2)
            .threads(threads);
        let mut cache = LayerCache::new(cfg).unwrap();
        fill(&mut cache, 5000, &mut rng);
        let queries: Vec<Vec<f32>> = (0..8).map(|_| rng.vec(8 * hd)).collect();
        let alone: Vec<Vec<f32>> = queries
            .iter()
            .map(|q| {
                let mut o = vec![0.0; q.len()];
                cache.attend(q, 8, &mut o).unwrap();
                o
            })
            .collect();
        let cache = &cache;
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..8)
                .map(|t| {
                    let qs = &queries;
                    sc.spawn(move || {
                        (0..20)
                            .map(|i| {
                                let j = (t + i) % qs.len();
                                let mut o = vec![0.0; qs[j].len()];
                                cache.attend(&qs[j], 8, &mut o).unwrap();
                                (j, o)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in handles {
                for (j, o) in h.join().unwrap() {
                    assert_eq!(o, alone[j], "threads {threads}, query {j}");
                }
            }
        });
    }
}

#[test]
fn every_backend_gives_the_same_attention() {
    let (n_kv, hd) = (2, 128);
    let (k, v) = kivi(2);
    let mut rng = Rng::new(8);
    let w = n_kv * hd;
    let (ks, vs) = (rng.vec(500 * w), rng.vec(500 * w));
    let q = rng.vec(4 * hd);
    let mut base: Option<Vec<f32>> = None;
    for &bk in kvq::Backend::ALL {
        if !bk.is_available() {
            common::skip_cpu(&format!("backend {}: not supported by this CPU", bk.name()));
            continue;
        }
        let cfg = CacheConfig::new(n_kv, hd)
            .keys(k)
            .values(v)
            .residual(64)
            .backend(bk);
        let mut c = LayerCache::new(cfg).unwrap();
        c.extend(&ks, &vs).unwrap();
        let mut out = vec![0.0; q.len()];
        c.attend(&q, 4, &mut out).unwrap();
        match &base {
            None => base = Some(out),
            Some(b) => assert!(max_abs_diff(b, &out) < 1e-5, "{}", bk.name()),
        }
    }
}

#[test]
fn token_split_decode_matches_single_thread() {
    // 1 or 3 KV heads on 2 threads: decode splits each head's tokens into
    // chunks (flash-decoding) and merges the partial softmaxes.
    for (n_kv, window) in [(1, None), (3, None), (3, Some(2500)), (1, Some(7))] {
        let hd = 64;
        let (k, v) = kivi(4);
        let mk = |t| {
            CacheConfig::new(n_kv, hd)
                .keys(k)
                .values(v)
                .residual(100)
                .sinks(3)
                .threads(t)
        };
        let mut a = LayerCache::new(mk(1)).unwrap();
        let mut rng = Rng::new(n_kv as u64 + 40);
        let (ks, vs) = fill(&mut a, 6001, &mut rng);
        let mut b = LayerCache::new(mk(2)).unwrap();
        b.extend(&ks, &vs).unwrap();
        let q = rng.vec(2 * n_kv * hd);
        let (mut oa, mut ob) = (vec![0.0; q.len()], vec![0.0; q.len()]);
        a.attend_causal(&q, 2 * n_kv, &mut oa, window).unwrap();
        b.attend_causal(&q, 2 * n_kv, &mut ob, window).unwrap();
        let d = max_abs_diff(&oa, &ob);
        assert!(d < 1e-5, "n_kv {n_kv} window {window:?}: {d}");
        let (kd, vd) = placed(a.config(), &ks, &vs);
        assert_eq!((b.keys_f32(), b.values_f32()), (kd.clone(), vd.clone()));
        let w = n_kv * hd;
        let lo = window.map_or(0, |wn| 6001 - wn);
        let want = dense_attention(&q, 2 * n_kv, &kd[lo * w..], &vd[lo * w..], n_kv, hd, 0.125);
        assert!(max_abs_diff(&ob, &want) < 1e-5);
    }
}

#[test]
fn every_backend_gives_the_same_causal_block_attention() {
    // The reference model's shape: 3 KV heads of 64, 9 query heads, a
    // 512-token prefill window.
    let (n_kv, hd, n_q, n) = (3, 64, 9, 512);
    let mut rng = Rng::new(31);
    let w = n_kv * hd;
    let (ks, vs) = (rng.vec(n * w), rng.vec(n * w));
    let q: Vec<f32> = rng.vec(n * n_q * hd).iter().map(|x| 4.0 * x).collect();
    for (k, v) in [
        kivi(4),
        kivi(2),
        (
            scheme(8, Axis::PerToken, Group::Size(32)),
            scheme(3, Axis::PerToken, Group::Head),
        ),
    ] {
        let mut base: Option<Vec<f32>> = None;
        for &bk in kvq::Backend::ALL {
            if !bk.is_available() {
                common::skip_cpu(&format!("backend {}: not supported by this CPU", bk.name()));
                continue;
            }
            let mut c =
                LayerCache::new(CacheConfig::new(n_kv, hd).keys(k).values(v).backend(bk)).unwrap();
            c.extend(&ks, &vs).unwrap();
            let mut out = vec![0.0; q.len()];
            c.attend_causal(&q, n_q, &mut out, None).unwrap();
            match &base {
                None => base = Some(out),
                Some(b) => {
                    let d = max_abs_diff(b, &out);
                    assert!(d < 1e-4, "{}: {d}", bk.name());
                }
            }
        }
    }
}

#[test]
fn int8_kernels_are_opt_in_and_close_to_exact() {
    let (n_kv, hd, len) = (2, 128, 600);
    let (k, v) = kivi(4);
    let mut rng = Rng::new(21);
    let w = n_kv * hd;
    let (ks, vs) = (rng.vec(len * w), rng.vec(len * w));
    // One query per KV head (decode): both int8 kernels take it.
    let q = rng.vec(n_kv * hd);
    let run = |bk: kvq::Backend, int8: bool| {
        let cfg = CacheConfig::new(n_kv, hd)
            .keys(k)
            .values(v)
            .backend(bk)
            .int8_kernels(int8);
        assert_eq!(cfg.uses_int8_kernels(), int8);
        let mut c = LayerCache::new(cfg).unwrap();
        c.extend(&ks, &vs).unwrap();
        let mut out = vec![0.0; q.len()];
        c.attend(&q, n_kv, &mut out).unwrap();
        out
    };
    // The portable backend has no int8 kernels: exactly the exact path.
    assert_eq!(
        run(kvq::Backend::Portable, true),
        run(kvq::Backend::Portable, false)
    );
    let bk = kvq::Backend::detect();
    let (exact, int8) = (run(bk, false), run(bk, true));
    let dense = dense_attention(&q, n_kv, &ks, &vs, n_kv, hd, 1.0 / (hd as f32).sqrt());
    let rms = |a: &[f32], b: &[f32]| {
        (a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f32>() / a.len() as f32).sqrt()
    };
    // The int8 rounding adds less error than the 4-bit cache itself has.
    let (extra, quant) = (rms(&int8, &exact), rms(&exact, &dense));
    assert!(
        extra < 0.6 * quant,
        "int8 adds {extra}, the cache's own error {quant}"
    );
    #[cfg(target_arch = "x86_64")]
    if bk == kvq::Backend::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni") {
        assert_ne!(int8, exact, "the int8 kernels did not run");
    } else {
        common::skip_cpu("the int8 comparison: no AVX-512 VNNI here");
    }
}
