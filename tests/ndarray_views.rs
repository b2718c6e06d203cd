//! The ndarray forms of the cache and quantizer: views of every layout
//! (contiguous, permuted, reversed axes, stepped, negative strides, a
//! column range of a wider buffer) give bit-identical results to the slice
//! path on the same numbers, for f32, f16 and bf16; wrong shapes are errors
//! that leave the cache as it was.

mod common;

use common::Rng;
use half::{bf16, f16};
use kvq::{
    presets, Axis, CacheConfig, Element, Error, Group, KvQuantizer, LayerCache, QuantScheme,
    UniformQuantizer,
};
use ndarray::{s, Array2, Array3, ArrayView2, ArrayView3};

const N_KV: usize = 2;
const HD: usize = 64;
const W: usize = N_KV * HD;
const N_Q: usize = 4;

/// `[tokens, N_KV, HD]` of random numbers in `T`.
fn data<T: Element>(tokens: usize, seed: u64) -> Array3<T> {
    let mut rng = Rng::new(seed);
    Array3::from_shape_simple_fn((tokens, N_KV, HD), || T::from_f32(rng.f()))
}

/// The same logical `[tokens, N_KV, HD]` numbers in storage of several
/// layouts; `view` gives each as an `ArrayView3`.
struct Layouts3<T> {
    standard: Array3<T>,
    /// Stored head-major `[N_KV, tokens, HD]`.
    head_major: Array3<T>,
    /// Stored `[HD, N_KV, tokens]` (column-major of the logical shape).
    reversed: Array3<T>,
    /// The tokens at the even rows of `[2·tokens, N_KV, HD]`.
    doubled: Array3<T>,
    /// The tokens in reverse order.
    backwards: Array3<T>,
    /// Channels 4..4+HD of `[tokens, N_KV, HD + 8]`.
    padded: Array3<T>,
}

const LAYOUTS3: [&str; 6] = [
    "standard",
    "head_major",
    "reversed",
    "doubled",
    "backwards",
    "padded",
];

impl<T: Element> Layouts3<T> {
    fn new(x: &Array3<T>) -> Self {
        let t = x.dim().0;
        let mut doubled = Array3::from_elem((2 * t, N_KV, HD), T::from_f32(9.0));
        doubled.slice_mut(s![..;2, .., ..]).assign(x);
        let mut padded = Array3::from_elem((t, N_KV, HD + 8), T::from_f32(-9.0));
        padded.slice_mut(s![.., .., 4..4 + HD]).assign(x);
        Layouts3 {
            standard: x.clone(),
            head_major: x
                .view()
                .permuted_axes([1, 0, 2])
                .as_standard_layout()
                .to_owned(),
            reversed: x.view().reversed_axes().as_standard_layout().to_owned(),
            doubled,
            backwards: x.slice(s![..;-1, .., ..]).as_standard_layout().to_owned(),
            padded,
        }
    }

    fn view(&self, name: &str) -> ArrayView3<'_, T> {
        match name {
            "standard" => self.standard.view(),
            "head_major" => self.head_major.view().permuted_axes([1, 0, 2]),
            "reversed" => self.reversed.view().reversed_axes(),
            "doubled" => self.doubled.slice(s![..;2, .., ..]),
            "backwards" => self.backwards.slice(s![..;-1, .., ..]),
            "padded" => self.padded.slice(s![.., .., 4..4 + HD]),
            _ => unreachable!("{name}"),
        }
    }
}

/// `[tokens, W]` views of several layouts (the same numbers as `x`).
struct Layouts2<T> {
    standard: Array2<T>,
    /// Stored `[W, tokens]`.
    transposed: Array2<T>,
    /// The tokens at rows 1, 4, 7, … of `[3·tokens, W]`.
    stepped: Array2<T>,
    /// K in the first `W` columns and V in the last of `[tokens, 2·W]`:
    /// this is the K (or V) half.
    fused: Array2<T>,
    /// The tokens in reverse order.
    backwards: Array2<T>,
}

const LAYOUTS2: [&str; 5] = ["standard", "transposed", "stepped", "fused", "backwards"];

impl<T: Element> Layouts2<T> {
    fn new(x: &Array3<T>, fused_offset: usize) -> Self {
        let t = x.dim().0;
        let x2 = x
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order((t, W))
            .unwrap();
        let mut stepped = Array2::from_elem((3 * t, W), T::from_f32(7.0));
        stepped.slice_mut(s![1..;3, ..]).assign(&x2);
        let mut fused = Array2::from_elem((t, 2 * W), T::from_f32(-7.0));
        fused
            .slice_mut(s![.., fused_offset..fused_offset + W])
            .assign(&x2);
        Layouts2 {
            transposed: x2.t().as_standard_layout().to_owned(),
            backwards: x2.slice(s![..;-1, ..]).as_standard_layout().to_owned(),
            standard: x2,
            stepped,
            fused,
        }
    }

    fn view(&self, name: &str, fused_offset: usize) -> ArrayView2<'_, T> {
        match name {
            "standard" => self.standard.view(),
            "transposed" => self.transposed.t(),
            "stepped" => self.stepped.slice(s![1..;3, ..]),
            "fused" => self.fused.slice(s![.., fused_offset..fused_offset + W]),
            "backwards" => self.backwards.slice(s![..;-1, ..]),
            _ => unreachable!("{name}"),
        }
    }
}

/// Caches that exercise every place a token can live: sinks, packed
/// per-channel blocks, packed per-token rows, the residual window, a
/// full-precision tensor.
fn configs() -> Vec<CacheConfig> {
    let (k, v) = presets::kivi(4).unwrap();
    vec![
        CacheConfig::new(N_KV, HD)
            .keys(k)
            .values(v)
            .residual(16)
            .sinks(3),
        CacheConfig::new(N_KV, HD)
            .keys(QuantScheme::new(3, Axis::PerToken, Group::Head).unwrap())
            .values(QuantScheme::new(2, Axis::PerToken, Group::Vector).unwrap()),
        CacheConfig::new(N_KV, HD).values(v),
    ]
}

/// Token counts of consecutive calls, 100 tokens in all: in chunks (each
/// chunk of a non-contiguous view is a non-contiguous view), and in one
/// call (the whole view, which for some layouts is contiguous in memory but
/// not in logical order).
const FEEDS: [&[usize]; 2] = [&[1, 7, 33, 0, 59], &[100]];

/// A cache fed `k`, `v` (`[100, W]` flat) by `extend`, `feed[i]` tokens a call.
fn fed_by_slices<T: Element>(cfg: CacheConfig, feed: &[usize], k: &[T], v: &[T]) -> LayerCache {
    let mut c = LayerCache::new(cfg).unwrap();
    let mut t0 = 0;
    for &n in feed {
        c.extend(&k[t0 * W..(t0 + n) * W], &v[t0 * W..(t0 + n) * W])
            .unwrap();
        t0 += n;
    }
    c
}

fn flat<T: Element>(x: &Array3<T>) -> Vec<T> {
    x.iter().copied().collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A cache fed by slices and one fed by views hold the same bytes, the
/// same dequantized keys and values, and attend to the same bits.
fn assert_same(a: &LayerCache, b: &LayerCache, what: &str) {
    assert_eq!(a.len(), 100, "{what}");
    assert!(a == b, "{what}: stored bytes differ");
    assert_eq!(bits(&a.keys_f32()), bits(&b.keys_f32()), "{what}: keys");
    assert_eq!(
        bits(&a.values_f32()),
        bits(&b.values_f32()),
        "{what}: values"
    );
    let mut rng = Rng::new(99);
    let q: Vec<f32> = (0..N_Q * HD).map(|_| rng.f()).collect();
    let (mut oa, mut ob) = (vec![0.0; N_Q * HD], vec![0.0; N_Q * HD]);
    a.attend(&q, N_Q, &mut oa).unwrap();
    b.attend(&q, N_Q, &mut ob).unwrap();
    assert_eq!(bits(&oa), bits(&ob), "{what}: attend");
    assert!(
        oa.iter().any(|&x| x != 0.0),
        "{what}: attention is not trivial"
    );
}

fn views3_match_slices<T: Element>() {
    let k = data::<T>(100, 1);
    let v = data::<T>(100, 2);
    let (lk, lv) = (Layouts3::new(&k), Layouts3::new(&v));
    let (fk, fv) = (flat(&k), flat(&v));
    for (cfg, feed) in configs().into_iter().flat_map(|c| FEEDS.map(|f| (c, f))) {
        let want = fed_by_slices(cfg, feed, &fk, &fv);
        for name in LAYOUTS3 {
            let (vk, vv) = (lk.view(name), lv.view(name));
            assert_eq!(vk.is_standard_layout(), name == "standard", "{name}");
            let mut got = LayerCache::new(cfg).unwrap();
            let mut t0 = 0;
            for &n in feed {
                let r = s![t0..t0 + n, .., ..];
                got.extend_view3(vk.slice(r), vv.slice(r)).unwrap();
                t0 += n;
            }
            assert_same(&want, &got, &format!("{} view3 {name} {feed:?}", T::NAME));
        }
    }
}

fn views2_match_slices<T: Element>() {
    let k = data::<T>(100, 3);
    let v = data::<T>(100, 4);
    // K and V halves of one fused buffer each.
    let (lk, lv) = (Layouts2::new(&k, 0), Layouts2::new(&v, W));
    let (fk, fv) = (flat(&k), flat(&v));
    for (cfg, feed) in configs().into_iter().flat_map(|c| FEEDS.map(|f| (c, f))) {
        let want = fed_by_slices(cfg, feed, &fk, &fv);
        for name in LAYOUTS2 {
            let (vk, vv) = (lk.view(name, 0), lv.view(name, W));
            assert_eq!(vk.is_standard_layout(), name == "standard", "{name}");
            let mut got = LayerCache::new(cfg).unwrap();
            let mut t0 = 0;
            for &n in feed {
                let r = s![t0..t0 + n, ..];
                got.extend_view2(vk.slice(r), vv.slice(r)).unwrap();
                t0 += n;
            }
            assert_same(&want, &got, &format!("{} view2 {name} {feed:?}", T::NAME));
        }
    }
}

#[test]
fn extend_view3_is_bit_identical_to_extend_f32() {
    views3_match_slices::<f32>();
}

#[test]
fn extend_view3_is_bit_identical_to_extend_f16() {
    views3_match_slices::<f16>();
}

#[test]
fn extend_view3_is_bit_identical_to_extend_bf16() {
    views3_match_slices::<bf16>();
}

#[test]
fn extend_view2_is_bit_identical_to_extend_f32() {
    views2_match_slices::<f32>();
}

#[test]
fn extend_view2_is_bit_identical_to_extend_f16() {
    views2_match_slices::<f16>();
}

#[test]
fn extend_view2_is_bit_identical_to_extend_bf16() {
    views2_match_slices::<bf16>();
}

/// `keys_array` / `values_array` are `[len, n_kv_heads, head_dim]`: a
/// full-precision cache hands back exactly what it was given, and a
/// quantized one the numbers of `keys_f32` / `values_f32` in that shape.
#[test]
fn arrays_have_the_documented_layout() {
    let k = data::<f32>(100, 5);
    let v = data::<f32>(100, 6);
    let mut exact = LayerCache::new(CacheConfig::new(N_KV, HD)).unwrap();
    exact.extend_view3(k.view(), v.view()).unwrap();
    assert_eq!(exact.keys_array(), k);
    assert_eq!(exact.values_array(), v);

    let mut c = LayerCache::new(configs()[0]).unwrap();
    assert_eq!(c.keys_array().dim(), (0, N_KV, HD));
    c.extend_view3(k.view(), v.view()).unwrap();
    let (ka, va) = (c.keys_array(), c.values_array());
    assert_eq!(ka.dim(), (100, N_KV, HD));
    assert_eq!(ka.as_slice().unwrap(), &c.keys_f32()[..]);
    assert_eq!(va.as_slice().unwrap(), &c.values_f32()[..]);
    assert_ne!(ka, k, "the keys are quantized");
    // Element (t, h, c) of the array is key channel c of head h, token t.
    assert_eq!(ka[[3, 1, 5]], c.keys_f32()[(3 * N_KV + 1) * HD + 5]);
}

#[track_caller]
fn shape_error(r: kvq::Result<()>, op: &str, parts: &[&str]) {
    match r {
        Err(ref e @ Error::InvalidShape { op: o, .. }) if o == op => {
            let msg = e.to_string();
            assert!(msg.starts_with(&format!("{op}: ")), "{msg}");
            for p in parts {
                assert!(msg.contains(p), "{msg:?} does not mention {p:?}");
            }
        }
        r => panic!("expected InvalidShape from {op}, got {r:?}"),
    }
}

/// Wrong shapes are `InvalidShape` errors naming the view and its shape,
/// and leave the cache exactly as it was, including shapes with the right
/// number of elements that the slice path would take.
#[test]
fn wrong_shapes_are_errors_and_change_nothing() {
    let mut c = LayerCache::new(configs()[0]).unwrap();
    let (k, v) = (data::<f32>(37, 7), data::<f32>(37, 8));
    c.extend_view3(k.view(), v.view()).unwrap();
    let before = c.clone();
    let check = |c: &LayerCache| {
        assert_eq!(c.len(), 37);
        assert!(*c == before, "a rejected call changed the cache");
    };

    let a3 = |shape: (usize, usize, usize)| Array3::<f32>::zeros(shape);
    let good = a3((5, N_KV, HD));
    for (bad, shape) in [
        (a3((5, N_KV + 1, HD)), "[5, 3, 64]"),
        (a3((5, N_KV, HD - 8)), "[5, 2, 56]"),
        (a3((5, HD, N_KV)), "[5, 64, 2]"),
        (a3((5, 2 * N_KV, HD / 2)), "[5, 4, 32]"),
        (a3((5, 1, W)), "[5, 1, 128]"),
        (a3((0, N_KV, HD + 8)), "[0, 2, 72]"),
    ] {
        let want = ["[tokens, 2, 64]", "n_kv_heads, head_dim", shape];
        let r = c.extend_view3(bad.view(), good.view());
        shape_error(
            r,
            "extend_view3",
            &[&["keys have shape"][..], &want].concat(),
        );
        check(&c);
        let r = c.extend_view3(good.view(), bad.view());
        shape_error(
            r,
            "extend_view3",
            &[&["values have shape"][..], &want].concat(),
        );
        check(&c);
    }
    let r = c.extend_view3(good.view(), a3((6, N_KV, HD)).view());
    shape_error(r, "extend_view3", &["[5, 2, 64]", "[6, 2, 64]", "tokens"]);
    check(&c);
    // Transposed, not permuted: `[HD, N_KV, tokens]` seen as is.
    let r = c.extend_view3(good.view().reversed_axes(), good.view().reversed_axes());
    shape_error(r, "extend_view3", &["[64, 2, 5]"]);
    check(&c);

    let a2 = |shape: (usize, usize)| Array2::<f32>::zeros(shape);
    let good = a2((5, W));
    for (bad, shape) in [
        (a2((5, W - 8)), "[5, 120]"),
        (a2((5, W + 8)), "[5, 136]"),
        (a2((10, W / 2)), "[10, 64]"),
        (a2((W, 5)), "[128, 5]"),
    ] {
        let want = ["[tokens, 128]", "n_kv_heads·head_dim", shape];
        let r = c.extend_view2(bad.view(), good.view());
        shape_error(
            r,
            "extend_view2",
            &[&["keys have shape"][..], &want].concat(),
        );
        check(&c);
        let r = c.extend_view2(good.view(), bad.view());
        shape_error(
            r,
            "extend_view2",
            &[&["values have shape"][..], &want].concat(),
        );
        check(&c);
    }
    let r = c.extend_view2(good.view(), a2((4, W)).view());
    shape_error(r, "extend_view2", &["[5, 128]", "[4, 128]"]);
    check(&c);

    // No tokens: a no-op, not an error.
    c.extend_view3(a3((0, N_KV, HD)).view(), a3((0, N_KV, HD)).view())
        .unwrap();
    c.extend_view2(a2((0, W)).view(), a2((0, W)).view())
        .unwrap();
    check(&c);
}

/// A NaN in a non-contiguous view is reported at its logical token, head
/// and channel (the copy keeps the logical order), and nothing is kept.
#[test]
fn non_finite_in_a_strided_view_names_its_logical_position() {
    let mut c = LayerCache::new(configs()[0]).unwrap();
    let (k, v) = (data::<f32>(40, 9), data::<f32>(40, 10));
    c.extend_view3(k.view(), v.view()).unwrap();
    let before = c.clone();
    let mut bad = Layouts3::new(&data::<f32>(50, 11));
    // Logical token 17, head 1, channel 6 of the head-major storage.
    bad.head_major[[1, 17, 6]] = f32::NAN;
    let good = Layouts3::new(&data::<f32>(50, 12));
    let r = c.extend_view3(good.view("backwards"), bad.view("head_major"));
    match r {
        Err(Error::NonFinite {
            op: "extend_view3",
            token: 17,
            head: 1,
            channel: 6,
            ..
        }) => {}
        r => panic!("{r:?}"),
    }
    assert!(c == before);
    assert_eq!(c.len(), 40);
}

fn quantizer_views_match_slices<T: Element>() {
    let x = data::<T>(70, 13);
    let l = Layouts3::new(&x);
    let fx = flat(&x);
    let (keys, values) = presets::kivi(3).unwrap();
    for s in [keys, values, presets::q4_0()] {
        let q = UniformQuantizer::new(s, N_KV, HD).unwrap();
        let want = q.quantize(&fx, 70).unwrap();
        let want_rt = q.roundtrip(&fx, 70).unwrap();
        let mut want_dq = vec![0f32; fx.len()];
        want.dequantize_into(&mut want_dq).unwrap();
        assert_eq!(bits(&want_rt), bits(&want_dq));
        for name in LAYOUTS3 {
            let what = format!("{} {} {name}", T::NAME, s.label());
            let got = q.quantize_view(l.view(name)).unwrap();
            assert_eq!(got, want, "{what}");
            assert_eq!(got.to_bytes(), want.to_bytes(), "{what}");
            let rt = q.roundtrip_view(l.view(name)).unwrap();
            assert_eq!(rt.dim(), (70, N_KV, HD), "{what}");
            assert_eq!(bits(rt.as_slice().unwrap()), bits(&want_rt), "{what}");
        }
        let dq = want.dequantize_array();
        assert_eq!(dq.dim(), (70, N_KV, HD));
        assert_eq!(bits(dq.as_slice().unwrap()), bits(&want_dq));
    }
}

#[test]
fn quantize_view_is_bit_identical_to_quantize_f32() {
    quantizer_views_match_slices::<f32>();
}

#[test]
fn quantize_view_is_bit_identical_to_quantize_f16() {
    quantizer_views_match_slices::<f16>();
}

#[test]
fn quantize_view_is_bit_identical_to_quantize_bf16() {
    quantizer_views_match_slices::<bf16>();
}

#[test]
fn quantize_view_rejects_wrong_shapes() {
    let (keys, _) = presets::kivi(4).unwrap();
    let q = UniformQuantizer::new(keys, N_KV, HD).unwrap();
    for shape in [
        (8, N_KV, HD + 8),
        (8, HD, N_KV),
        (8, 1, W),
        (0, N_KV + 1, HD),
    ] {
        let x = Array3::<f32>::zeros(shape);
        let r = q.quantize_view(x.view()).map(|_| ());
        shape_error(
            r,
            "quantize_view",
            &["[tokens, 2, 64]", "the input has shape"],
        );
        let r = q.roundtrip_view(x.view()).map(|_| ());
        shape_error(r, "roundtrip_view", &["[tokens, 2, 64]"]);
    }
    let empty = q.quantize_view(Array3::<f32>::zeros((0, N_KV, HD)).view());
    assert_eq!(empty.unwrap().tokens(), 0);
}
