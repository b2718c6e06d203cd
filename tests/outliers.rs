//! Dense-and-sparse outliers ([`Codec::with_outliers`]): exact accounting,
//! encoders against error budgets, the fused kernels on every backend
//! against the oracle (the codec's own decode, then `f64` sums), and a
//! cache's life (attend, save/load, truncate, fork, pools, rejected input
//! and hostile bytes).

mod common;

use common::{backends, max_abs_diff, placed, reseal, Rng};
use kvq::cache::{dense_attention, PagePool};
use kvq::{
    presets, Axis, Backend, CacheConfig, Codec, Error, Group, KvCodec, LayerCache, Levels, Mode,
    PackedHead, QuantScheme, Rotation, OUTLIER_LIMIT,
};

fn pt(bits: u8, group: Group) -> QuantScheme {
    QuantScheme::new(bits, Axis::PerToken, group).unwrap()
}

fn pc(bits: u8, g: usize) -> QuantScheme {
    QuantScheme::new(bits, Axis::PerChannel, Group::Size(g)).unwrap()
}

fn sym(bits: u8, group: Group) -> QuantScheme {
    pt(bits, group).with_mode(Mode::Symmetric).unwrap()
}

/// Every kind of format outliers wrap: per-token and per-channel grids
/// of several widths, symmetric and asymmetric, a codebook, rotated ones.
fn codecs() -> Vec<Codec> {
    let g32 = Group::Size(32);
    let o = |c: Codec, f: f64| c.with_outliers(f).unwrap();
    vec![
        o(pt(2, g32).into(), 0.01),
        o(pt(3, Group::Head).into(), 0.02),
        o(sym(4, Group::Size(8)).into(), 0.05),
        o(pt(8, g32).into(), 0.01),
        o(pc(2, 32).into(), 0.01),
        o(pc(3, 64).into(), 0.005),
        o(pc(4, 32).into(), 0.5),
        o(Codec::codebook(sym(3, g32), Levels::Gauss), 0.01),
        o(Codec::hadamard(pt(4, g32)), 0.01),
        o(
            Codec::codebook(sym(2, g32), Levels::Gauss).with_rotation(Rotation::Hadamard),
            0.02,
        ),
        o(Codec::from(pt(4, g32)).with_int8_kernels(true), 0.01),
    ]
}

/// Gaussian rows with spikes: a few values per head far outside the rest
/// (as keys have), of both signs.
fn spiky(rng: &mut Rng, tokens: usize, width: usize) -> Vec<f32> {
    (0..tokens * width)
        .map(|_| {
            let x = rng.normal();
            if rng.below(200) == 0 {
                x * 40.0 + 30.0 * x.signum()
            } else {
                x
            }
        })
        .collect()
}

#[test]
fn layouts_count_outliers_exactly() {
    let (n_kv, hd) = (3, 64);
    for c in codecs() {
        let built = c.build(n_kv, hd).unwrap();
        let l = *built.layout();
        let plain = *c.scheme().layout(n_kv, hd).unwrap().scheme();
        let pl = plain.layout(n_kv, hd).unwrap();
        let elems = l.block_tokens() * hd;
        let want = ((c.outlier_fraction() * elems as f64) - 1e-9)
            .ceil()
            .max(1.0) as usize;
        assert_eq!(l.outliers(), want, "{}", c.label());
        assert_eq!(l.set_elements(), elems);
        assert_eq!(built.spec(), c, "{}", c.label());
        for t in [0usize, 1, 31, 32, 33, 200] {
            let sets = t.div_ceil(l.block_tokens());
            assert_eq!(l.head_outlier_bytes(t), sets * want * 4);
            assert_eq!(l.outlier_bytes(t), n_kv * sets * want * 4);
            assert_eq!(
                l.bytes(t),
                pl.bytes(t) + l.outlier_bytes(t),
                "{}",
                c.label()
            );
        }
        let extra = (want * 32) as f64 / elems as f64;
        assert!((l.effective_bits() - pl.effective_bits() - extra).abs() < 1e-12);
        assert!(c.label().contains("+o"), "{}", c.label());
    }
    // What a cache holds is what the layout says.
    let mut rng = Rng::new(1);
    let c = Codec::from(pc(2, 32)).with_outliers(0.01).unwrap();
    let v = Codec::from(pt(3, Group::Size(32)))
        .with_outliers(0.02)
        .unwrap();
    let cfg = CacheConfig::new(2, 128).key_codec(c).value_codec(v);
    let mut cache = LayerCache::new(cfg).unwrap();
    let x = spiky(&mut rng, 100, 256);
    cache.extend(&x, &x).unwrap();
    let (kl, vl) = (
        *c.build(2, 128).unwrap().layout(),
        *v.build(2, 128).unwrap().layout(),
    );
    let b = cache.bytes();
    assert_eq!(
        b.codes + b.params,
        kl.bytes(96) + vl.bytes(100),
        "96 keys packed (3 blocks), 100 values"
    );
    assert_eq!(b.full_precision, 4 * 256 * 4);
    // The memory model of one such layer holds the same bytes.
    let m = kvq::MemoryModel::new(1, &[0], 2, 128)
        .unwrap()
        .with_codecs(c, v)
        .unwrap();
    assert_eq!(
        m.layer_cache_bytes(96) as usize,
        kl.bytes(96) + vl.bytes(96)
    );
    let eb = (kl.effective_bits() + vl.effective_bits()) / 2.0;
    assert!((m.effective_bits() - eb).abs() < 1e-12);
    // A pool's pages hold the entries: `page_bytes` counts them, and a pool
    // of exactly two pages of each tensor takes 128 tokens, not 129.
    let page = cfg.page_bytes(64).unwrap();
    assert_eq!(page, kl.bytes(64) + vl.bytes(64));
    let pool = PagePool::new(64, Some(2 * page)).unwrap();
    let mut pooled = LayerCache::new_in(cfg, &pool).unwrap();
    let x = spiky(&mut rng, 129 + 31, 256);
    pooled.extend(&x[..128 * 256], &x[..128 * 256]).unwrap();
    assert!(matches!(
        pooled.extend(&x[128 * 256..], &x[128 * 256..]),
        Err(Error::PoolExhausted { .. })
    ));
    assert_eq!(pooled.len(), 128);
}

#[test]
fn bad_outlier_settings_are_errors() {
    let c = Codec::from(pt(4, Group::Size(32)));
    for f in [0.0, -0.01, 0.5001, 1.0, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(c.with_outliers(f), Err(Error::InvalidConfig { .. })),
            "{f}"
        );
    }
    assert!(c.with_outliers(0.5).is_ok());
    // A vector-wide group spans every head; outliers are per head.
    let v = Codec::from(pt(4, Group::Vector))
        .with_outliers(0.01)
        .unwrap();
    assert!(matches!(v.build(2, 64), Err(Error::SchemeShape { .. })));
    // Positions are 16-bit: a per-channel block of 1024 × 128 is too big.
    let big = Codec::from(pc(4, 1024)).with_outliers(0.01).unwrap();
    assert!(matches!(big.build(1, 128), Err(Error::SchemeShape { .. })));
    assert!(Codec::from(pc(4, 512))
        .with_outliers(0.01)
        .unwrap()
        .build(1, 128)
        .is_ok());
    // A packed block holds no outliers; a view needs its entries.
    let built = c.with_outliers(0.01).unwrap().build(1, 64).unwrap();
    let l = *built.layout();
    assert!(kvq::PackedBlock::from_parts(l, 1, vec![0; 32], vec![0; 8]).is_err());
    assert!(matches!(
        PackedHead::new(l, 1, &[0; 32], &[0; 8]),
        Err(Error::Length { .. })
    ));
    assert!(PackedHead::with_outliers(l, 1, &[0; 32], &[0; 8], &[0; 4]).is_ok());
}

/// Relative MSE and largest error of `c` on `x`.
fn errors(c: &Codec, x: &[f32], n_kv: usize, hd: usize) -> (f64, f32) {
    let y = c.roundtrip(x, n_kv, hd).unwrap();
    let e: f64 = x
        .iter()
        .zip(&y)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let p: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
    (e / p, max_abs_diff(x, &y))
}

/// Budgets: on spiky rows every format with 1 % outliers has at most a
/// third of the plain format's relative MSE (measured: 0.04–0.2 of it);
/// on Gaussian rows it is never worse than the plain format (ranges only
/// shrink) and the spikes themselves come back within f16 rounding.
#[test]
fn outliers_meet_their_error_budgets() {
    let mut rng = Rng::new(5);
    let (n_kv, hd, tokens) = (2, 128, 96);
    let x = spiky(&mut rng, tokens, n_kv * hd);
    let g: Vec<f32> = (0..tokens * n_kv * hd).map(|_| rng.normal()).collect();
    let g32 = Group::Size(32);
    for plain in [
        Codec::from(pt(2, g32)),
        Codec::from(pt(3, g32)),
        Codec::from(pt(4, Group::Head)),
        Codec::from(pc(2, 32)),
        Codec::from(pc(3, 32)),
        Codec::from(pc(4, 64)),
        Codec::codebook(sym(3, g32), Levels::Gauss),
    ] {
        let o = plain.with_outliers(0.01).unwrap();
        let (mp, _) = errors(&plain, &x, n_kv, hd);
        let (mo, _) = errors(&o, &x, n_kv, hd);
        eprintln!("{}: rel. MSE {mp:.5} → {mo:.5}", o.label());
        assert!(mo < mp / 3.0, "{}: {mo} vs {mp}", o.label());
        let (gp, ep) = errors(&plain, &g, n_kv, hd);
        let (go, eo) = errors(&o, &g, n_kv, hd);
        assert!(
            go <= gp * 1.0001 && eo <= ep * 1.0001,
            "{}: {go} {eo} vs {gp} {ep}",
            o.label()
        );
    }
    // One spike per head row, 1 % of a row: it is the entry, and decodes
    // within f16 rounding of the correction.
    let mut row = vec![0.25f32; 2 * 128];
    row[77] = 1000.0;
    row[128 + 5] = -3000.5;
    let c = Codec::from(pt(2, Group::Head)).with_outliers(0.01).unwrap();
    let y = c.roundtrip(&row, 2, 128).unwrap();
    assert!((y[77] - 1000.0).abs() <= 1000.0 / 1024.0);
    assert!((y[133] + 3000.5).abs() <= 3001.0 / 1024.0);
    assert!(
        max_abs_diff(&y[..77], &row[..77]) < 1e-3,
        "the rest is exact here"
    );
}

/// A codec's packed heads, encoded through its own encoders.
struct Packed {
    codec: std::sync::Arc<dyn KvCodec>,
    tokens: usize,
    bufs: Vec<[Vec<u8>; 3]>,
}

fn pack(c: &Codec, rows: &[f32], n_kv: usize, hd: usize) -> Packed {
    let codec = c.build(n_kv, hd).unwrap();
    let l = *codec.layout();
    let w = n_kv * hd;
    let tokens = rows.len() / w;
    // The encoders take rows in the stored space.
    let mut stored = rows.to_vec();
    codec.transform_in(&mut stored);
    let rows = &stored[..];
    let mut bufs = vec![[Vec::new(), Vec::new(), Vec::new()]; n_kv];
    let b = Backend::Portable;
    match l.scheme().axis() {
        Axis::PerToken => {
            let (rb, pb, ob) = (
                l.row_bytes(),
                l.head_param_bytes(1),
                l.head_outlier_bytes(1),
            );
            let (mut tc, mut tp, mut to) = (
                vec![0u8; n_kv * rb],
                vec![0u8; n_kv * pb],
                vec![0u8; n_kv * ob],
            );
            for (t, row) in rows.chunks_exact(w).enumerate() {
                codec
                    .encode_token(b, row, t, &mut tc, &mut tp, &mut to)
                    .unwrap();
                for (h, [c, p, o]) in bufs.iter_mut().enumerate() {
                    c.extend_from_slice(&tc[h * rb..(h + 1) * rb]);
                    p.extend_from_slice(&tp[h * pb..(h + 1) * pb]);
                    o.extend_from_slice(&to[h * ob..(h + 1) * ob]);
                }
            }
        }
        Axis::PerChannel => {
            let g = l.block_tokens();
            let mut t0 = 0;
            while t0 < tokens {
                let n = g.min(tokens - t0);
                let (mut tc, mut tp, mut to) = (
                    vec![0u8; l.head_code_bytes(n)],
                    vec![0u8; l.head_param_bytes(n)],
                    vec![0u8; l.head_outlier_bytes(n)],
                );
                for (h, [c, p, o]) in bufs.iter_mut().enumerate() {
                    let r = &rows[t0 * w..(t0 + n) * w];
                    codec
                        .encode_block(b, r, n, h, t0, &mut tc, &mut tp, &mut to)
                        .unwrap();
                    c.extend_from_slice(&tc);
                    p.extend_from_slice(&tp);
                    o.extend_from_slice(&to);
                }
                t0 += n;
            }
        }
    }
    Packed {
        codec,
        tokens,
        bufs,
    }
}

impl Packed {
    fn head(&self, h: usize) -> PackedHead<'_> {
        let [c, p, o] = &self.bufs[h];
        PackedHead::with_outliers(*self.codec.layout(), self.tokens, c, p, o).unwrap()
    }
}

/// The magnitude of what the kernels add per element `[tokens, hd]`: the
/// decoded value, and for the uniform grid (whose kernels sum `scale·code`
/// and `zero` apart) twice the largest grid value of the element's group,
/// which bounds `|scale·code| + |zero|`.
fn term_bounds(p: &Packed, h: usize, dec: &[f32]) -> Vec<f64> {
    let l = *p.codec.layout();
    let (hd, t) = (l.head_dim(), p.tokens);
    let mut out: Vec<f64> = dec.iter().map(|&x| f64::from(x.abs())).collect();
    let spec = p.codec.spec();
    if spec.levels().is_some() {
        return out;
    }
    let grid_layout = spec.scheme().layout(l.n_kv_heads(), hd).unwrap();
    let [c, pa, _] = &p.bufs[h];
    let mut grid = vec![0f32; t * hd];
    PackedHead::new(grid_layout, t, c, pa)
        .unwrap()
        .dequantize_into(&mut grid);
    let cpg = l.channels_per_group();
    for tt in 0..t {
        for ch in 0..hd {
            let m = match l.scheme().axis() {
                Axis::PerToken => grid[tt * hd + ch / cpg * cpg..][..cpg]
                    .iter()
                    .fold(0f32, |m, x| m.max(x.abs())),
                Axis::PerChannel => {
                    let b0 = tt / l.block_tokens() * l.block_tokens();
                    (b0..t.min(b0 + l.block_tokens()))
                        .map(|u| grid[u * hd + ch].abs())
                        .fold(0f32, f32::max)
                }
            };
            out[tt * hd + ch] += 2.0 * f64::from(m);
        }
    }
    out
}

/// The oracle: the codec's decode, then `f64` sums; every backend's
/// scores and weighted sums within the kernels' tolerance of it.
fn check_kernels(p: &Packed, rng: &mut Rng, nq: usize, what: &str) {
    let t = p.tokens;
    let hd = p.codec.layout().head_dim();
    for h in 0..p.bufs.len() {
        let head = p.head(h);
        let mut dec = vec![0f32; t * hd];
        p.codec.decode(&head, &mut dec);
        let bound = term_bounds(p, h, &dec);
        common::check_codec_kernels(&*p.codec, &head, Some(&bound), rng, nq, what);
    }
}

#[test]
fn fused_kernels_match_the_oracle_on_every_backend() {
    let mut rng = Rng::new(11);
    // Awkward sizes: one token, a partial per-channel block, head_dim 24
    // (three groups of 8), 64 and 128, one and four queries.
    for (n_kv, hd, tokens) in [(1, 128, 1), (2, 128, 70), (3, 64, 33), (1, 24, 45)] {
        for c in codecs() {
            let Ok(built) = c.build(n_kv, hd) else {
                // Groups of 32 do not divide 24.
                assert_eq!(hd, 24);
                continue;
            };
            let x = spiky(&mut rng, tokens, n_kv * hd);
            let p = pack(&c, &x, n_kv, hd);
            // The decode, mapped back from the stored space, is the codec's
            // round trip.
            let rt = c.roundtrip(&x, n_kv, hd).unwrap();
            let w = n_kv * hd;
            let mut rows = vec![0f32; tokens * w];
            let mut dec = vec![0f32; tokens * hd];
            for h in 0..n_kv {
                built.decode(&p.head(h), &mut dec);
                for t in 0..tokens {
                    rows[t * w + h * hd..][..hd].copy_from_slice(&dec[t * hd..(t + 1) * hd]);
                }
            }
            built.transform_out(&mut rows);
            let d = max_abs_diff(&rows, &rt);
            assert!(
                d <= 1e-4,
                "{} {n_kv}x{hd}x{tokens}: decode vs round trip {d}",
                c.label()
            );
            // 20 queries: the post-passes' transposed path (prefill).
            for nq in [1, 4, 20] {
                check_kernels(
                    &p,
                    &mut rng,
                    nq,
                    &format!("{} {n_kv}x{hd}x{tokens}", c.label()),
                );
            }
        }
    }
}

#[test]
fn outlier_caches_attend_save_load_truncate_and_fork() {
    let mut rng = Rng::new(3);
    let (n_kv, hd, n_q) = (2, 128, 8);
    let w = n_kv * hd;
    let g32 = Group::Size(32);
    let o = |c: Codec, f: f64| c.with_outliers(f).unwrap();
    for (kc, vc, sinks, residual) in [
        (o(pc(2, 32).into(), 0.01), o(pt(2, g32).into(), 0.01), 0, 0),
        (
            o(pc(3, 32).into(), 0.01),
            o(Codec::hadamard(pt(3, g32)), 0.01),
            4,
            40,
        ),
        (
            o(Codec::hadamard(sym(4, g32)), 0.02),
            o(Codec::codebook(sym(3, g32), Levels::Gauss), 0.01),
            1,
            0,
        ),
    ] {
        for backend in backends() {
            let pool = PagePool::new(64, None).unwrap();
            let cfg = CacheConfig::new(n_kv, hd)
                .key_codec(kc)
                .value_codec(vc)
                .sinks(sinks)
                .residual(residual)
                .backend(backend);
            let mut c = LayerCache::new_in(cfg, &pool).unwrap();
            let tokens = 150;
            let k = spiky(&mut rng, tokens, w);
            let v = spiky(&mut rng, tokens, w);
            c.extend(&k[..70 * w], &v[..70 * w]).unwrap();
            for t in 70..tokens {
                let r = t * w..(t + 1) * w;
                c.append(&k[r.clone()], &v[r]).unwrap();
            }
            let (kh, vh) = placed(&cfg, &k, &v);
            // A rotation maps rows in and back: its f32 rounding may move a
            // value across a rounding edge of the grid (one step).
            let tol = if kc.rotation() == Rotation::None && vc.rotation() == Rotation::None {
                1e-5
            } else {
                0.5
            };
            let close = |a: &[f32], b: &[f32]| max_abs_diff(a, b) <= tol;
            assert!(close(&c.keys_f32(), &kh), "{}", kc.label());
            assert!(close(&c.values_f32(), &vh), "{}", vc.label());
            let scale = 1.0 / (hd as f32).sqrt();
            let q: Vec<f32> = (0..n_q * hd).map(|_| rng.normal()).collect();
            let mut out = vec![0f32; n_q * hd];
            c.attend(&q, n_q, &mut out).unwrap();
            let want = dense_attention(&q, n_q, &c.keys_f32(), &c.values_f32(), n_kv, hd, scale);
            let d = max_abs_diff(&out, &want);
            assert!(d < 2e-4, "{}/{}: attend {d}", kc.label(), vc.label());

            let mut bytes = Vec::new();
            c.save(&mut bytes).unwrap();
            assert_eq!(bytes.len(), c.saved_bytes());
            let back = LayerCache::load_in(&bytes[..], &pool).unwrap();
            assert_eq!(back, c);
            assert_eq!(back.config().key_codec_spec(), Some(kc));
            assert_eq!(back.config().value_codec_spec(), Some(vc));
            let mut out2 = vec![0f32; n_q * hd];
            back.attend(&q, n_q, &mut out2).unwrap();
            // The backend is the loading machine's: bit-exact on the same.
            if backend == Backend::detect() {
                assert_eq!(out, out2, "load round trip is bit-exact");
            } else {
                let m = out.iter().fold(1f32, |m, x| m.max(x.abs()));
                assert!(max_abs_diff(&out, &out2) < 1e-5 * m);
            }

            // A fork shares pages; the original cut inside a key block
            // keeps what it held before the cut.
            let f = c.fork();
            c.truncate(83).unwrap();
            assert!(close(&c.keys_f32(), &kh[..83 * w]));
            assert!(close(&c.values_f32(), &vh[..83 * w]));
            let mut out3 = vec![0f32; n_q * hd];
            f.attend(&q, n_q, &mut out3).unwrap();
            assert_eq!(out3, out, "the fork is untouched");
            // Appending after the cut: the cache attends over what it holds.
            c.extend(&k[83 * w..], &v[83 * w..]).unwrap();
            c.attend(&q, n_q, &mut out3).unwrap();
            let want = dense_attention(&q, n_q, &c.keys_f32(), &c.values_f32(), n_kv, hd, scale);
            assert!(max_abs_diff(&out3, &want) < 2e-4);
        }
    }
}

#[test]
fn rejected_input_leaves_the_cache_untouched() {
    let (n_kv, hd) = (1, 64);
    let c = Codec::from(pc(2, 32)).with_outliers(0.01).unwrap();
    let cfg = CacheConfig::new(n_kv, hd).key_codec(c).value_codec(c);
    let mut cache = LayerCache::new(cfg).unwrap();
    let row: Vec<f32> = (0..hd).map(|i| i as f32 / 10.0).collect();
    for _ in 0..40 {
        cache.append(&row, &row).unwrap();
    }
    let before = cache.clone();
    let mut big = row.clone();
    big[9] = OUTLIER_LIMIT * 1.5;
    let e = cache.append(&big, &row).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("channel 9"), "{e}");
    let mut rows = row.repeat(30);
    rows[29 * hd + 3] = -OUTLIER_LIMIT * 2.0;
    assert!(cache.extend(&rows, &row.repeat(30)).is_err());
    assert!(cache == before);
    // At the limit it stores.
    big[9] = OUTLIER_LIMIT;
    cache.append(&big, &row).unwrap();
}

#[test]
fn hostile_outlier_bytes_are_refused() {
    let (n_kv, hd) = (1, 64);
    let kc = Codec::from(pt(2, Group::Size(32)))
        .with_outliers(0.02)
        .unwrap();
    let cfg = CacheConfig::new(n_kv, hd).key_codec(kc);
    let mut c = LayerCache::new(cfg).unwrap();
    let mut rng = Rng::new(8);
    let x = spiky(&mut rng, 10, hd);
    c.extend(&x, &x).unwrap();
    let mut good = Vec::new();
    c.save(&mut good).unwrap();
    assert!(LayerCache::load(&good[..]).is_ok());
    let l = *kc.build(n_kv, hd).unwrap().layout();
    assert_eq!(l.outliers(), 2);
    // Stream header, layer header, key tensor header, then codes, params
    // and the outlier entries of the keys (no sinks).
    let at = 16 + 72 + 24 + l.code_bytes(10) + l.param_bytes(10);
    let load = |b: &[u8]| LayerCache::load(b);
    let mutate = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        reseal(&mut b);
        b
    };
    // A position past the row, positions out of order, a NaN correction.
    let past = mutate(&|b| b[at..at + 2].copy_from_slice(&64u16.to_le_bytes()));
    // (A set: its 2 positions, then its 2 corrections.)
    let order = mutate(&|b| {
        let (p0, p1) = ([b[at], b[at + 1]], [b[at + 2], b[at + 3]]);
        b[at..at + 2].copy_from_slice(&p1);
        b[at + 2..at + 4].copy_from_slice(&p0);
    });
    let nan = mutate(&|b| b[at + 6..at + 8].copy_from_slice(&half::f16::NAN.to_le_bytes()));
    for (what, b) in [("past", past), ("order", order), ("nan", nan)] {
        assert!(
            matches!(load(&b), Err(Error::Malformed { .. })),
            "{what}: {:?}",
            load(&b).err()
        );
    }
    // The codec tag's outlier share: above half, or a stray flag bit.
    let tag_flags = 16 + 40 + 12;
    for flags in [5001u32 << 16, 200 << 16 | 2] {
        let b = mutate(&|b| b[tag_flags..tag_flags + 4].copy_from_slice(&flags.to_le_bytes()));
        assert!(
            matches!(load(&b), Err(Error::Malformed { .. })),
            "{flags:#x}"
        );
    }
    // The untouched stream loads and its entries are where the test looks.
    let back = load(&good).unwrap();
    assert!(back == c);
    assert_eq!(
        u32::from_le_bytes(good[tag_flags..tag_flags + 4].try_into().unwrap()) >> 16,
        200
    );
}

#[test]
fn presets_and_pre_rope_keys_take_outliers() {
    // The outlier share survives a model save.
    let (k, v) = presets::kivi(2).unwrap();
    let kc = Codec::from(k).with_outliers(0.01).unwrap();
    let cfg = CacheConfig::new(2, 64)
        .key_codec(kc)
        .value_codec(Codec::from(v))
        .pre_rope(kvq::Rope::new(10_000.0, 64, kvq::RopeStyle::Halves));
    let mut m = kvq::KvCache::new([cfg, cfg]).unwrap();
    let mut rng = Rng::new(2);
    for layer in 0..2 {
        let x = spiky(&mut rng, 70, 128);
        m.layer_mut(layer).extend(&x, &x).unwrap();
    }
    let mut b = Vec::new();
    m.save(&mut b).unwrap();
    let back = kvq::KvCache::load(&b[..]).unwrap();
    assert_eq!(back.layer(1).config().key_codec_spec(), Some(kc));
    for i in 0..2 {
        assert!(back.layer(i) == m.layer(i));
    }
}
