//! Tests of the evaluation harness (`kvq-eval`, in `eval/`) that need no assets:
//! the reference transformer (prefill vs decode, quant points, q/k norm),
//! the GGUF reader (round trip of a file written here, truncation and
//! corruption), the tokenizers (tiny vocabularies, and Gemma 3's when its
//! opt-in file is present) and the capture format.

use kvq_eval::capture::{Capture, Recorder};
use kvq_eval::gguf::{GgmlType, Gguf, Value};
use kvq_eval::model::{
    Activation, Config, DenseStore, Hooks, KvStore, Model, QuantPoint, RopeStyle, RoundTrip,
    SlidingWindow,
};
use kvq_eval::ppl::{
    perplexity, perplexity_kl, window_logits, EvalPath, Kl, PplOptions, Reference,
};
use kvq_eval::tokenizer::{PieceType, SpmOptions, Tokenizer};
use proptest::prelude::*;

// ---------------------------------------------------------------- model ----

fn tiny_config(rope_style: RopeStyle) -> Config {
    Config {
        n_layers: 2,
        d_model: 32,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        ffn_dim: 48,
        vocab_size: 61,
        rope_base: 10_000.0,
        rope_dim: 8,
        rope_style,
        rms_eps: 1e-5,
        ctx_len: 128,
        activation: Activation::Silu,
        embed_scale: 1.0,
        sliding: None,
    }
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = kvq_eval::model::SplitMix64(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Logits of every position, fed as one block.
fn prefill_logits(m: &Model, toks: &[u32], hooks: &mut Hooks<'_>) -> Vec<f32> {
    let mut store = DenseStore::for_config(&m.cfg);
    window_logits(m, toks, &mut store, hooks).unwrap()
}

/// Logits of every position, fed one token at a time.
fn decode_logits(m: &Model, toks: &[u32], hooks: &mut Hooks<'_>) -> Vec<f32> {
    let mut store = DenseStore::for_config(&m.cfg);
    let mut out = Vec::new();
    for (i, &t) in toks.iter().enumerate() {
        let h = m.forward(&[t], i, &mut store, hooks).unwrap();
        out.extend(m.logits(h.view()).iter());
    }
    assert_eq!(store.len(0), toks.len());
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn prefill_equals_decode_without_and_with_qk_norm() {
    for (qk_norm, style) in [
        (false, RopeStyle::Adjacent),
        (true, RopeStyle::Adjacent),
        (true, RopeStyle::Halves),
    ] {
        let m = Model::random(tiny_config(style), 7, qk_norm);
        assert_eq!(m.layers[0].k_norm.is_some(), qk_norm);
        let toks = tokens(37, m.cfg.vocab_size, 1);
        let a = prefill_logits(&m, &toks, &mut Hooks::default());
        let b = decode_logits(&m, &toks, &mut Hooks::default());
        let scale = a.iter().fold(0.0f32, |s, v| s.max(v.abs()));
        let d = max_abs_diff(&a, &b);
        assert!(scale > 0.1, "degenerate logits");
        assert!(
            d <= 2e-5 * scale,
            "qk_norm={qk_norm} {style:?}: diff {d} (scale {scale})"
        );
    }
}

#[test]
fn chunked_prefill_equals_single_block() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 3, true);
    let toks = tokens(40, m.cfg.vocab_size, 2);
    let full = prefill_logits(&m, &toks, &mut Hooks::default());
    let mut store = DenseStore::for_config(&m.cfg);
    let mut out = Vec::new();
    for (start, end) in [(0, 17), (17, 18), (18, 40)] {
        let h = m
            .forward(&toks[start..end], start, &mut store, &mut Hooks::default())
            .unwrap();
        out.extend(m.logits(h.view()).iter());
    }
    assert!(max_abs_diff(&full, &out) < 1e-4);
}

#[test]
fn causality_future_tokens_do_not_change_past_logits() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 11, false);
    let mut toks = tokens(20, m.cfg.vocab_size, 5);
    let a = prefill_logits(&m, &toks, &mut Hooks::default());
    toks[19] = (toks[19] + 1) % m.cfg.vocab_size as u32;
    let b = prefill_logits(&m, &toks, &mut Hooks::default());
    let v = m.cfg.vocab_size;
    assert!(max_abs_diff(&a[..19 * v], &b[..19 * v]) < 1e-5);
    assert!(max_abs_diff(&a[19 * v..], &b[19 * v..]) > 1e-4);
}

/// Round to a coarse grid: a crude stand-in quantizer.
struct Coarse(f32);

impl Coarse {
    fn apply(&self, x: &mut [f32]) {
        x.iter_mut()
            .for_each(|v| *v = (*v / self.0).round() * self.0);
    }
}

impl RoundTrip for Coarse {
    fn round_trip(
        &self,
        _: usize,
        _: usize,
        x: &mut [f32],
        n: usize,
        nkv: usize,
        hd: usize,
    ) -> Result<(), String> {
        assert_eq!(x.len(), n * nkv * hd);
        self.apply(x);
        Ok(())
    }
}

/// Identity "quantizer" that counts calls.
#[derive(Default)]
struct Identity(std::cell::Cell<usize>);

impl RoundTrip for Identity {
    fn round_trip(
        &self,
        _: usize,
        _: usize,
        _: &mut [f32],
        _: usize,
        _: usize,
        _: usize,
    ) -> Result<(), String> {
        self.0.set(self.0.get() + 1);
        Ok(())
    }
}

#[test]
fn quant_points_are_applied_where_asked() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 5, true);
    let toks = tokens(24, m.cfg.vocab_size, 9);
    let base = prefill_logits(&m, &toks, &mut Hooks::default());

    // An identity round trip changes nothing and runs once per layer.
    for point in [
        QuantPoint::AfterKProj,
        QuantPoint::AfterKNorm,
        QuantPoint::AfterRope,
    ] {
        let id = Identity::default();
        let mut hooks = Hooks {
            k: Some((point, &id)),
            ..Hooks::default()
        };
        assert_eq!(prefill_logits(&m, &toks, &mut hooks), base);
        assert_eq!(id.0.get(), m.cfg.n_layers);
    }

    // A real round trip changes the output, differently per point.
    let q = Coarse(0.25);
    let run = |point| {
        let mut hooks = Hooks {
            k: Some((point, &q as &dyn RoundTrip)),
            ..Hooks::default()
        };
        prefill_logits(&m, &toks, &mut hooks)
    };
    let (a, b, c) = (
        run(QuantPoint::AfterKProj),
        run(QuantPoint::AfterKNorm),
        run(QuantPoint::AfterRope),
    );
    assert!(max_abs_diff(&a, &base) > 1e-4);
    assert!(max_abs_diff(&a, &b) > 1e-5);
    assert!(max_abs_diff(&b, &c) > 1e-5);

    // Values have one point.
    let mut hooks = Hooks {
        v: Some(&q),
        ..Hooks::default()
    };
    assert!(max_abs_diff(&prefill_logits(&m, &toks, &mut hooks), &base) > 1e-4);
}

/// A store that quantizes K on the way in: what a kvq-backed store does.
struct QuantStore(DenseStore, Coarse);
impl KvStore for QuantStore {
    fn extend(&mut self, l: usize, k: &[f32], v: &[f32]) -> Result<(), String> {
        let mut k = k.to_vec();
        self.1.apply(&mut k);
        self.0.extend(l, &k, v)
    }
    fn attend_causal(
        &mut self,
        l: usize,
        q: &[f32],
        h: usize,
        w: Option<usize>,
        o: &mut [f32],
    ) -> Result<(), String> {
        self.0.attend_causal(l, q, h, w, o)
    }
    fn attend(
        &mut self,
        l: usize,
        q: &[f32],
        h: usize,
        w: Option<usize>,
        o: &mut [f32],
    ) -> Result<(), String> {
        self.0.attend(l, q, h, w, o)
    }
    fn reset(&mut self) {
        self.0.reset()
    }
}

#[test]
fn quantizing_after_rope_equals_a_quantizing_store() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 8, false);
    let toks = tokens(16, m.cfg.vocab_size, 4);
    let q = Coarse(0.125);
    let mut hooks = Hooks {
        k: Some((QuantPoint::AfterRope, &q)),
        ..Hooks::default()
    };
    let a = prefill_logits(&m, &toks, &mut hooks);
    let mut store = QuantStore(DenseStore::for_config(&m.cfg), Coarse(0.125));
    let b = window_logits(&m, &toks, &mut store, &mut Hooks::default()).unwrap();
    assert_eq!(a, b);
}

#[test]
fn perplexity_paths_agree_and_windows_reset() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 21, true);
    let toks = tokens(64, m.cfg.vocab_size, 3);
    let mut store = DenseStore::for_config(&m.cfg);
    let mut run = |path| {
        let opts = PplOptions {
            n_tokens: 64,
            window: 16,
            path,
            bos: None,
        };
        perplexity(
            &m,
            &toks,
            &mut store,
            &mut Hooks::default(),
            &opts,
            |_, _| {},
        )
        .unwrap()
    };
    let p = run(EvalPath::Prefill);
    let d = run(EvalPath::Decode);
    assert_eq!(p.windows.len(), 4);
    assert_eq!(p.all.count, 4 * 15);
    assert_eq!(p.second_half.count, 4 * 7);
    assert!((p.all.mean() - d.all.mean()).abs() < 1e-5);
    assert!((p.second_half.mean() - d.second_half.mean()).abs() < 1e-5);
    // Each window starts from an empty cache: identical windows score identically.
    let rep: Vec<u32> = toks[..16].repeat(4);
    let opts = PplOptions {
        n_tokens: 64,
        window: 16,
        path: EvalPath::Prefill,
        bos: None,
    };
    let r = perplexity(
        &m,
        &rep,
        &mut store,
        &mut Hooks::default(),
        &opts,
        |_, _| {},
    )
    .unwrap();
    for w in &r.windows {
        assert!((w.all.nll - r.windows[0].all.nll).abs() < 1e-9);
    }
    // Too few tokens is an error, not a panic.
    let opts = PplOptions {
        n_tokens: 128,
        ..opts
    };
    assert!(perplexity(
        &m,
        &toks,
        &mut store,
        &mut Hooks::default(),
        &opts,
        |_, _| {}
    )
    .is_err());
}

#[test]
fn kl_against_a_reference_run() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 22, true);
    let toks = tokens(64, m.cfg.vocab_size, 4);
    let opts = PplOptions {
        n_tokens: 64,
        window: 16,
        path: EvalPath::Prefill,
        bos: None,
    };
    let mut reference = Reference::default();
    let mut dense = DenseStore::for_config(&m.cfg);
    let (base, none) = perplexity_kl(
        &m,
        &toks,
        &mut dense,
        &mut Hooks::default(),
        &opts,
        Kl::Record(&mut reference),
        |_, _| {},
    )
    .unwrap();
    assert!(none.is_none());
    assert_eq!(reference.len(), 4 * 15);
    // The same run again: no divergence, the same top token everywhere.
    let (again, kl) = perplexity_kl(
        &m,
        &toks,
        &mut dense,
        &mut Hooks::default(),
        &opts,
        Kl::Compare(&reference),
        |_, _| {},
    )
    .unwrap();
    let kl = kl.unwrap();
    assert_eq!(again.all, base.all);
    // (The reference's log-probabilities are rounded to f32: a hair above 0.)
    assert!(kl.mean < 1e-7 && kl.p99 < 1e-6, "{kl:?}");
    assert_eq!((kl.same_top1, kl.count), (1.0, 60));
    // A coarse cache diverges, more at the tail than on average; the
    // decode path agrees with prefill on it.
    let mut coarse = QuantStore(DenseStore::for_config(&m.cfg), Coarse(0.5));
    let (_, q) = perplexity_kl(
        &m,
        &toks,
        &mut coarse,
        &mut Hooks::default(),
        &opts,
        Kl::Compare(&reference),
        |_, _| {},
    )
    .unwrap();
    let q = q.unwrap();
    assert!(q.mean > 1e-6 && q.p99 >= q.mean && q.count == 60, "{q:?}");
    let dec = PplOptions {
        path: EvalPath::Decode,
        ..opts.clone()
    };
    let (_, qd) = perplexity_kl(
        &m,
        &toks,
        &mut coarse,
        &mut Hooks::default(),
        &dec,
        Kl::Compare(&reference),
        |_, _| {},
    )
    .unwrap();
    assert!((qd.unwrap().mean - q.mean).abs() < 1e-4 * (1.0 + q.mean));
    // A reference of other tokens' count is an error.
    let short = PplOptions {
        n_tokens: 32,
        ..opts
    };
    assert!(perplexity_kl(
        &m,
        &toks,
        &mut dense,
        &mut Hooks::default(),
        &short,
        Kl::Compare(&reference),
        |_, _| {}
    )
    .is_err());
}

#[test]
fn bos_replaces_the_first_token_of_every_window() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 23, true);
    let toks = tokens(48, m.cfg.vocab_size, 6);
    let run = |toks: &[u32], bos| {
        let opts = PplOptions {
            n_tokens: 48,
            window: 16,
            path: EvalPath::Prefill,
            bos,
        };
        let mut store = DenseStore::for_config(&m.cfg);
        perplexity(
            &m,
            toks,
            &mut store,
            &mut Hooks::default(),
            &opts,
            |_, _| {},
        )
        .unwrap()
    };
    let mut replaced = toks.clone();
    for w in replaced.chunks_mut(16) {
        w[0] = 5;
    }
    let (a, b) = (run(&toks, Some(5)), run(&replaced, None));
    assert_eq!(a.all, b.all);
    assert_eq!(a.token_nll, b.token_nll);
    // The first token is context only: the window keeps its predictions.
    assert_eq!(a.all.count, 3 * 15);
    assert_ne!(a.all, run(&toks, None).all);
}

#[test]
fn capture_round_trip() {
    let m = Model::random(tiny_config(RopeStyle::Adjacent), 2, true);
    let toks = tokens(12, m.cfg.vocab_size, 8);
    let c = &m.cfg;
    let mut rec = Recorder::new(c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, &toks);
    let mut store = DenseStore::for_config(c);
    {
        let mut hooks = Hooks {
            observer: Some(&mut rec),
            ..Hooks::default()
        };
        window_logits(&m, &toks, &mut store, &mut hooks).unwrap();
    }
    let cap = rec.capture;
    assert!(cap.has_k_pre_rope());
    // The captured post-RoPE keys/values are exactly what the store holds.
    for l in 0..c.n_layers {
        let (k, v) = store.layer(l);
        assert_eq!(cap.layers[l].k, k);
        assert_eq!(cap.layers[l].v, v);
        // RoPE at position 0 is the identity.
        let w = c.kv_width();
        assert_eq!(cap.layers[l].k[..w], cap.layers[l].k_pre_rope[..w]);
        assert_ne!(
            cap.layers[l].k[w..2 * w],
            cap.layers[l].k_pre_rope[w..2 * w]
        );
    }
    let mut buf = Vec::new();
    cap.write_to(&mut buf).unwrap();
    assert_eq!(&buf[..8], b"KVQCAP01");
    let back = Capture::read_from(&mut buf.as_slice(), usize::MAX).unwrap();
    assert_eq!(back, cap);
    for cut in [0, 7, 8, 20, 40, buf.len() / 2, buf.len() - 1] {
        assert!(Capture::read_from(&mut &buf[..cut], usize::MAX).is_err());
    }
    assert!(Capture::read_from(&mut buf.as_slice(), 10).is_err());
}

// ----------------------------------------------------------------- gguf ----

/// Minimal GGUF v3 writer for tests.
struct GgufBuilder {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    data: Vec<u8>,
    n_tensors: u64,
    alignment: usize,
}

impl GgufBuilder {
    fn new(alignment: usize) -> Self {
        GgufBuilder {
            kv: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            data: Vec::new(),
            n_tensors: 0,
            alignment,
        }
    }

    fn string(buf: &mut Vec<u8>, s: &str) {
        buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        buf.extend_from_slice(s.as_bytes());
    }

    /// Add a key with a raw encoded value (type id + payload).
    fn kv_raw(&mut self, key: &str, ty: u32, payload: &[u8]) -> &mut Self {
        Self::string(&mut self.kv, key);
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.kv.extend_from_slice(payload);
        self.n_kv += 1;
        self
    }

    fn kv_str(&mut self, key: &str, s: &str) -> &mut Self {
        let mut p = Vec::new();
        Self::string(&mut p, s);
        self.kv_raw(key, 8, &p)
    }

    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv_raw(key, 4, &v.to_le_bytes())
    }

    fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv_raw(key, 6, &v.to_le_bytes())
    }

    fn kv_str_array(&mut self, key: &str, items: &[&str]) -> &mut Self {
        let mut p = 8u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for s in items {
            Self::string(&mut p, s);
        }
        self.kv_raw(key, 9, &p)
    }

    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
        while !self.data.len().is_multiple_of(self.alignment) {
            self.data.push(0);
        }
        Self::string(&mut self.infos, name);
        self.infos
            .extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend_from_slice(&d.to_le_bytes());
        }
        self.infos.extend_from_slice(&ty.to_le_bytes());
        self.infos
            .extend_from_slice(&(self.data.len() as u64).to_le_bytes());
        self.data.extend_from_slice(bytes);
        self.n_tensors += 1;
        self
    }

    fn f32_tensor(&mut self, name: &str, dims: &[u64], vals: &[f32]) -> &mut Self {
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, 0, &bytes)
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&self.n_tensors.to_le_bytes());
        out.extend_from_slice(&self.n_kv.to_le_bytes());
        out.extend_from_slice(&self.kv);
        out.extend_from_slice(&self.infos);
        while !out.len().is_multiple_of(self.alignment) {
            out.push(0);
        }
        out.extend_from_slice(&self.data);
        out
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// A file with metadata of every type and one tensor of each supported
/// quantization, plus the expected dequantized values.
fn sample_gguf() -> (Vec<u8>, Vec<(&'static str, Vec<f32>)>) {
    let mut b = GgufBuilder::new(64);
    b.kv_u32("general.alignment", 64)
        .kv_raw("t.u8", 0, &[200])
        .kv_raw("t.i8", 1, &(-5i8).to_le_bytes())
        .kv_raw("t.u16", 2, &60000u16.to_le_bytes())
        .kv_raw("t.i16", 3, &(-30000i16).to_le_bytes())
        .kv_raw("t.i32", 5, &(-7i32).to_le_bytes())
        .kv_f32("t.f32", 1.5)
        .kv_raw("t.bool", 7, &[1])
        .kv_str("t.str", "héllo")
        .kv_raw("t.u64", 10, &(1u64 << 40).to_le_bytes())
        .kv_raw("t.i64", 11, &(-1i64 << 40).to_le_bytes())
        .kv_raw("t.f64", 12, &0.25f64.to_le_bytes())
        .kv_str_array("t.strs", &["a", "bc", ""]);
    // Array of u32, and an array of arrays of i16.
    let mut p = 4u32.to_le_bytes().to_vec();
    p.extend_from_slice(&3u64.to_le_bytes());
    for v in [1u32, 2, 3] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    b.kv_raw("t.u32s", 9, &p);
    let mut p = 9u32.to_le_bytes().to_vec();
    p.extend_from_slice(&2u64.to_le_bytes());
    for row in [[1i16, -1], [7, 8]] {
        p.extend_from_slice(&3u32.to_le_bytes());
        p.extend_from_slice(&2u64.to_le_bytes());
        for v in row {
            p.extend_from_slice(&v.to_le_bytes());
        }
    }
    b.kv_raw("t.nested", 9, &p);

    let mut expected = Vec::new();
    // F32 [3, 2]
    let f: Vec<f32> = vec![1.0, -2.0, 3.5, 0.0, 1e-3, -7.25];
    b.f32_tensor("f32", &[3, 2], &f);
    expected.push(("f32", f));
    // F16 [4]
    let h = [0.5f32, -1.0, 2.0, 65504.0];
    let bytes: Vec<u8> = h.iter().flat_map(|&v| f16_bytes(v)).collect();
    b.tensor("f16", &[4], 1, &bytes);
    expected.push(("f16", h.to_vec()));
    // Q8_0 [32, 2]: two blocks, d = 0.5 and 0.125, q = i - 16 and 3*i - 50.
    let mut bytes = Vec::new();
    let mut want = Vec::new();
    for (d, q) in [
        (0.5f32, (0..32).map(|i| i - 16).collect::<Vec<i32>>()),
        (0.125, (0..32).map(|i| 3 * i - 50).collect()),
    ] {
        bytes.extend_from_slice(&f16_bytes(d));
        bytes.extend(q.iter().map(|&v| v as i8 as u8));
        want.extend(q.iter().map(|&v| v as f32 * d));
    }
    b.tensor("q8_0", &[32, 2], 8, &bytes);
    expected.push(("q8_0", want));
    // Q4_1 [32]: d = 0.25, m = -1; nibble j (low) = j % 16, high = 15 - j % 16.
    let mut bytes = f16_bytes(0.25).to_vec();
    bytes.extend_from_slice(&f16_bytes(-1.0));
    let mut want = vec![0.0; 32];
    for j in 0..16u8 {
        let (lo, hi) = (j, 15 - j);
        bytes.push(lo | (hi << 4));
        want[j as usize] = lo as f32 * 0.25 - 1.0;
        want[j as usize + 16] = hi as f32 * 0.25 - 1.0;
    }
    b.tensor("q4_1", &[32], 3, &bytes);
    expected.push(("q4_1", want));
    (b.build(), expected)
}

#[test]
fn gguf_reads_back_metadata_and_tensors() {
    let (bytes, expected) = sample_gguf();
    let g = Gguf::parse(bytes).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.get("t.u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("t.i8"), Some(&Value::I8(-5)));
    assert_eq!(g.get("t.u16"), Some(&Value::U16(60000)));
    assert_eq!(g.get("t.i16"), Some(&Value::I16(-30000)));
    assert_eq!(g.get("t.i32"), Some(&Value::I32(-7)));
    assert_eq!(g.get("t.f32"), Some(&Value::F32(1.5)));
    assert_eq!(g.get("t.bool"), Some(&Value::Bool(true)));
    assert_eq!(g.get_str("t.str").unwrap(), "héllo");
    assert_eq!(g.get_usize("t.u64").unwrap(), 1 << 40);
    assert_eq!(g.get("t.i64"), Some(&Value::I64(-1 << 40)));
    assert_eq!(g.get_f64("t.f64").unwrap(), 0.25);
    assert_eq!(g.get_str_array("t.strs").unwrap(), vec!["a", "bc", ""]);
    let u32s: Vec<u64> = g
        .get("t.u32s")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(u32s, vec![1, 2, 3]);
    let nested = g.get("t.nested").unwrap().as_array().unwrap();
    assert_eq!(
        nested[1],
        Value::Array(
            kvq_eval::gguf::ValueType::I16,
            vec![Value::I16(7), Value::I16(8)]
        )
    );
    assert!(g.get_usize("t.i8").is_err());
    assert!(g.get_str("missing").is_err());

    assert_eq!(g.tensors.len(), expected.len());
    assert_eq!(g.tensor("q8_0").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(g.tensor("f32").unwrap().rows_cols(), (2, 3));
    for (name, want) in expected {
        let (_, got) = g.dequantize(name).unwrap();
        assert_eq!(got, want, "tensor {name}");
    }
    assert!(g.dequantize("nope").is_err());
}

#[test]
fn gguf_truncations_and_corruptions_are_errors_not_panics() {
    let (bytes, _) = sample_gguf();
    // Every proper prefix is an error (the last tensor ends the file).
    for cut in 0..bytes.len() {
        assert!(
            Gguf::parse(bytes[..cut].to_vec()).is_err(),
            "prefix of {cut} bytes parsed"
        );
    }
    // Targeted corruptions that must be rejected.
    let corrupt = |pos: usize, val: &[u8]| {
        let mut b = bytes.clone();
        b[pos..pos + val.len()].copy_from_slice(val);
        Gguf::parse(b)
    };
    assert!(corrupt(0, b"GGUG").is_err(), "bad magic");
    assert!(corrupt(4, &1u32.to_le_bytes()).is_err(), "version 1");
    assert!(corrupt(4, &99u32.to_le_bytes()).is_err(), "version 99");
    assert!(
        corrupt(8, &u64::MAX.to_le_bytes()).is_err(),
        "absurd tensor count"
    );
    assert!(
        corrupt(16, &(1u64 << 60).to_le_bytes()).is_err(),
        "absurd kv count"
    );
    assert!(
        corrupt(24, &u64::MAX.to_le_bytes()).is_err(),
        "absurd key length"
    );
    // First kv is general.alignment: its type id follows the 8+17-byte key.
    assert!(
        corrupt(24 + 8 + 17, &77u32.to_le_bytes()).is_err(),
        "unknown value type"
    );
    assert!(
        corrupt(24 + 8 + 17 + 4, &48u32.to_le_bytes()).is_err(),
        "alignment not a power of two"
    );
    // Tensor infos: find the last tensor's type and offset fields by name.
    let at = bytes.windows(4).rposition(|w| w == b"q4_1").unwrap() + 4;
    // n_dims at `at`, then one dim, then type, then offset.
    assert!(corrupt(at, &9u32.to_le_bytes()).is_err(), "too many dims");
    assert!(
        corrupt(at + 12, &4u32.to_le_bytes()).is_err(),
        "unknown ggml type 4"
    );
    assert!(
        corrupt(at + 12, &1000u32.to_le_bytes()).is_err(),
        "unknown ggml type 1000"
    );
    assert!(
        corrupt(at + 4, &33u64.to_le_bytes()).is_err(),
        "row not a multiple of the block"
    );
    assert!(
        corrupt(at + 4, &(1u64 << 62).to_le_bytes()).is_err(),
        "tensor past the end"
    );
    assert!(
        corrupt(at + 16, &(1u64 << 20).to_le_bytes()).is_err(),
        "offset past the end"
    );
    assert!(
        corrupt(at + 16, &u64::MAX.to_le_bytes()).is_err(),
        "offset overflow"
    );
    assert!(
        corrupt(at + 16, &1u64.to_le_bytes()).is_err(),
        "misaligned offset"
    );
    // Any single-byte corruption anywhere must not panic (result may be Ok).
    for pos in 0..bytes.len() {
        for val in [0x00u8, 0x7f, 0xff] {
            let mut b = bytes.clone();
            b[pos] = val;
            if let Ok(g) = Gguf::parse(b) {
                for t in g.tensors.clone() {
                    let _ = g.dequantize(&t.name);
                }
            }
        }
    }
}

#[test]
fn gguf_deeply_nested_arrays_are_rejected() {
    let mut b = GgufBuilder::new(32);
    let mut p = Vec::new();
    for _ in 0..64 {
        p.extend_from_slice(&9u32.to_le_bytes());
        p.extend_from_slice(&1u64.to_le_bytes());
    }
    p.extend_from_slice(&4u32.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    b.kv_raw("deep", 9, &p);
    assert!(Gguf::parse(b.build()).is_err());
}

/// A GGUF file with `m`'s weights as F32 tensors under architecture `arch`.
fn gguf_of(m: &Model, arch: &str) -> Gguf {
    let cfg = &m.cfg;
    let mut b = GgufBuilder::new(32);
    let key = |k: &str| format!("{arch}.{k}");
    b.kv_str("general.architecture", arch)
        .kv_u32(&key("block_count"), cfg.n_layers as u32)
        .kv_u32(&key("embedding_length"), cfg.d_model as u32)
        .kv_u32(&key("feed_forward_length"), cfg.ffn_dim as u32)
        .kv_u32(&key("attention.head_count"), cfg.n_heads as u32)
        .kv_u32(&key("attention.head_count_kv"), cfg.n_kv_heads as u32)
        .kv_f32(&key("rope.freq_base"), cfg.rope_base as f32)
        .kv_f32(&key("attention.layer_norm_rms_epsilon"), cfg.rms_eps)
        .kv_u32(&key("context_length"), cfg.ctx_len as u32)
        .kv_u32(&key("vocab_size"), cfg.vocab_size as u32);
    if let Some(s) = cfg.sliding {
        b.kv_u32(&key("attention.sliding_window"), s.window as u32);
    }
    let mat = |b: &mut GgufBuilder, name: &str, a: &ndarray::Array2<f32>| {
        let (r, c) = a.dim();
        b.f32_tensor(name, &[c as u64, r as u64], a.as_slice().unwrap());
    };
    let vec = |b: &mut GgufBuilder, name: &str, v: &Option<Vec<f32>>| {
        if let Some(v) = v {
            b.f32_tensor(name, &[v.len() as u64], v);
        }
    };
    mat(&mut b, "token_embd.weight", &m.tok_embd);
    for (l, w) in m.layers.iter().enumerate() {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        b.f32_tensor(&n("attn_norm"), &[cfg.d_model as u64], &w.attn_norm);
        mat(&mut b, &n("attn_q"), &w.wq);
        mat(&mut b, &n("attn_k"), &w.wk);
        mat(&mut b, &n("attn_v"), &w.wv);
        mat(&mut b, &n("attn_output"), &w.wo);
        vec(&mut b, &n("attn_q_norm"), &w.q_norm);
        vec(&mut b, &n("attn_k_norm"), &w.k_norm);
        vec(&mut b, &n("post_attention_norm"), &w.post_attn_norm);
        b.f32_tensor(&n("ffn_norm"), &[cfg.d_model as u64], &w.ffn_norm);
        mat(&mut b, &n("ffn_gate"), &w.w_gate);
        mat(&mut b, &n("ffn_up"), &w.w_up);
        mat(&mut b, &n("ffn_down"), &w.w_down);
        vec(&mut b, &n("post_ffw_norm"), &w.post_ffn_norm);
    }
    b.f32_tensor("output_norm.weight", &[cfg.d_model as u64], &m.out_norm);
    Gguf::parse(b.build()).unwrap()
}

/// Tiny llama- and gemma3-architecture GGUFs with F32 weights load into the
/// same models; the gemma3 file gets llama.cpp's Gemma 3 defaults (every
/// sixth layer global, local RoPE base 10⁴, tanh-GELU, `√d` embedding scale).
#[test]
fn model_loads_from_gguf_metadata_and_tensors() {
    let cfg = tiny_config(RopeStyle::Adjacent);
    let gemma = Config {
        n_layers: 7,
        rope_base: 1e6,
        rope_style: RopeStyle::Halves,
        activation: Activation::GeluTanh,
        embed_scale: (32f32).sqrt(),
        sliding: Some(SlidingWindow {
            window: 5,
            period: 6,
            rope_base: 1e4,
        }),
        ..cfg.clone()
    };
    for (arch, cfg, norms) in [("llama", cfg, false), ("gemma3", gemma, true)] {
        let m = Model::random_with_norms(cfg.clone(), 13, norms, norms);
        let loaded = Model::from_gguf(&gguf_of(&m, arch)).unwrap();
        assert_eq!(loaded.cfg, cfg, "{arch}");
        assert_eq!(loaded.layers[0].post_ffn_norm.is_some(), norms);
        let toks = tokens(12, cfg.vocab_size, 1);
        assert_eq!(
            prefill_logits(&loaded, &toks, &mut Hooks::default()),
            prefill_logits(&m, &toks, &mut Hooks::default()),
            "{arch}"
        );
    }
}

/// A Gemma-shaped tiny model: q/k norms, post norms, tanh-GELU, embedding
/// scale, NeoX RoPE and sliding-window layers (`window` positions, layers
/// `period - 1` of every `period` local).
fn tiny_gemma(window: usize, period: usize) -> Model {
    let cfg = Config {
        n_layers: 3,
        n_heads: 4,
        n_kv_heads: 1,
        rope_base: 1e6,
        rope_style: RopeStyle::Halves,
        activation: Activation::GeluTanh,
        embed_scale: (32f32).sqrt(),
        sliding: Some(SlidingWindow {
            window,
            period,
            rope_base: 1e4,
        }),
        ..tiny_config(RopeStyle::Halves)
    };
    Model::random_with_norms(cfg, 31, true, true)
}

#[test]
fn gemma_layers_alternate_local_and_global() {
    let m = tiny_gemma(4, 3);
    let windows: Vec<_> = (0..3).map(|l| m.cfg.layer_window(l)).collect();
    assert_eq!(windows, [Some(4), Some(4), None]);
    let bases: Vec<_> = (0..3).map(|l| m.cfg.layer_rope_base(l)).collect();
    assert_eq!(bases, [1e4, 1e4, 1e6]);
    // Reference values of tanh-GELU (the formula evaluated in f64).
    for (x, want) in [(1.0f32, 0.841_192), (-3.0, -0.003_637_4), (0.0, 0.0)] {
        let got = Activation::GeluTanh.apply(x);
        assert!((got - want).abs() < 1e-5, "gelu({x}) = {got}");
    }
}

#[test]
fn gemma_prefill_equals_decode_on_dense_and_kvq_stores() {
    use kvq_eval::kvq_store::{CacheSpec, KvqStore};
    let m = tiny_gemma(5, 3);
    let toks = tokens(29, m.cfg.vocab_size, 3);
    let a = prefill_logits(&m, &toks, &mut Hooks::default());
    let b = decode_logits(&m, &toks, &mut Hooks::default());
    let scale = a.iter().fold(0.0f32, |s, v| s.max(v.abs()));
    assert!(scale > 0.1, "degenerate logits");
    assert!(max_abs_diff(&a, &b) <= 2e-5 * scale);
    // The kvq cache at full precision applies the same windows.
    let (c, hd) = (&m.cfg, m.cfg.head_dim);
    let mut store = KvqStore::new(c.n_layers, c.n_kv_heads, hd, CacheSpec::FULL).unwrap();
    let k = window_logits(&m, &toks, &mut store, &mut Hooks::default()).unwrap();
    assert!(max_abs_diff(&a, &k) <= 2e-5 * scale);
    store.reset();
    let mut decoded = Vec::new();
    for (i, &t) in toks.iter().enumerate() {
        let h = m.forward(&[t], i, &mut store, &mut Hooks::default());
        decoded.extend(m.logits(h.unwrap().view()).iter());
    }
    assert_eq!(store.cache().layer(0).len(), toks.len());
    assert!(max_abs_diff(&a, &decoded) <= 2e-5 * scale);
}

#[test]
fn pre_rope_kvq_store_equals_dense_and_the_k_norm_round_trip() {
    use kvq::{Axis, Group, QuantScheme};
    use kvq_eval::kvq_store::{CacheSpec, CodecRoundTrip, KvqStore};
    for m in [
        Model::random(tiny_config(RopeStyle::Adjacent), 5, true),
        tiny_gemma(5, 3),
    ] {
        let toks = tokens(32, m.cfg.vocab_size, 8);
        let a = prefill_logits(&m, &toks, &mut Hooks::default());
        let scale = a.iter().fold(0.0f32, |s, v| s.max(v.abs()));
        // Full precision: the cache's RoPE is the model's.
        let pre = CacheSpec {
            pre_rope: true,
            ..CacheSpec::FULL
        };
        assert!(
            KvqStore::new(2, 2, 8, pre).is_err(),
            "needs the model's RoPE"
        );
        let mut store = KvqStore::for_model(&m.cfg, pre).unwrap();
        let k = window_logits(&m, &toks, &mut store, &mut Hooks::default()).unwrap();
        assert!(
            max_abs_diff(&a, &k) <= 2e-5 * scale,
            "{:?} prefill",
            m.cfg.rope_style
        );
        store.reset();
        let mut decoded = Vec::new();
        for (i, &t) in toks.iter().enumerate() {
            let h = m.forward(&[t], i, &mut store, &mut Hooks::default());
            decoded.extend(m.logits(h.unwrap().view()).iter());
        }
        assert!(max_abs_diff(&a, &decoded) <= 2e-5 * scale, "decode");
        // Quantized: per-channel keys in the pre-RoPE cache are the keys a
        // round trip after k_norm gives (32 tokens: whole blocks of 8).
        let k4 = QuantScheme::new(4, Axis::PerChannel, Group::Size(8)).unwrap();
        let spec = CacheSpec {
            keys: Some(k4),
            ..pre
        };
        let mut store = KvqStore::for_model(&m.cfg, spec).unwrap();
        let cached = window_logits(&m, &toks, &mut store, &mut Hooks::default()).unwrap();
        let rt = CodecRoundTrip(spec.key_codec().unwrap());
        let mut hooks = Hooks {
            k: Some((QuantPoint::AfterKNorm, &rt)),
            ..Hooks::default()
        };
        let simulated = prefill_logits(&m, &toks, &mut hooks);
        assert!(
            max_abs_diff(&cached, &simulated) <= 2e-5 * scale,
            "quantized"
        );
        assert!(
            max_abs_diff(&cached, &a) > 1e-4 * scale,
            "4-bit keys change the logits"
        );
    }
}

#[test]
fn sliding_window_bounds_what_a_position_sees() {
    // Only local layers: with 3 layers of window 4, position p depends on
    // tokens p-9 ..= p, so changing token 0 leaves positions >= 10 exactly
    // unchanged and moves position 9.
    let m = tiny_gemma(4, 10);
    assert!((0..3).all(|l| m.cfg.layer_window(l) == Some(4)));
    let toks = tokens(16, m.cfg.vocab_size, 5);
    let mut other = toks.clone();
    other[0] = (toks[0] + 1) % m.cfg.vocab_size as u32;
    let vocab = m.cfg.vocab_size;
    let a = prefill_logits(&m, &toks, &mut Hooks::default());
    let b = prefill_logits(&m, &other, &mut Hooks::default());
    let at = |x: &[f32], p: usize| x[p * vocab..(p + 1) * vocab].to_vec();
    assert!(max_abs_diff(&at(&a, 9), &at(&b, 9)) > 1e-6);
    for p in 10..16 {
        assert_eq!(at(&a, p), at(&b, p), "position {p}");
    }
    // With the last layer global, the change reaches the end.
    let m = tiny_gemma(4, 3);
    let a = prefill_logits(&m, &toks, &mut Hooks::default());
    let b = prefill_logits(&m, &other, &mut Hooks::default());
    assert!(max_abs_diff(&at(&a, 15), &at(&b, 15)) > 1e-6);
}

// ------------------------------------------------------------ tokenizer ----

/// GPT-2 byte alphabet (the reversible bytes -> printable chars map).
fn byte_alphabet() -> Vec<String> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut n = 0;
    (0..256u32)
        .map(|b| {
            let cp = if printable(b) {
                b
            } else {
                n += 1;
                255 + n
            };
            char::from_u32(cp).unwrap().to_string()
        })
        .collect()
}

fn tiny_tokenizer() -> Tokenizer {
    let mut vocab = vec!["<|endoftext|>".to_string()];
    vocab.extend(byte_alphabet());
    let merges = [
        "Ġ t",
        "h e",
        "Ġt he",
        "Ġ a",
        "l l",
        "e ll",
        "h ell",
        "hell o",
        "Ġ Ġ",
        "ĠĠ ĠĠ",
    ];
    for m in merges {
        vocab.push(m.replace(' ', ""));
    }
    Tokenizer::new(vocab, merges).unwrap()
}

#[test]
fn tokenizer_merges_by_rank_and_splits_digits() {
    let t = tiny_tokenizer();
    let id = |s: &str| t.token_id(s).unwrap();
    // "h e" outranks "l l", and once "he" exists "e ll" can no longer apply.
    assert_eq!(
        t.encode("hello the").unwrap(),
        vec![id("he"), id("ll"), id("o"), id("Ġthe")]
    );
    assert_eq!(t.encode("ello").unwrap(), vec![id("ell"), id("o")]);
    // Digits are isolated: "12" is two pre-tokens; " 3" gives a lone space.
    assert_eq!(
        t.pre_tokenize("a12 3x").unwrap(),
        vec!["a", "1", "2", " ", "3", "x"]
    );
    // Whitespace run before a word leaves its last space to the word.
    assert_eq!(t.pre_tokenize("a   b").unwrap(), vec!["a", "  ", " b"]);
    assert_eq!(t.pre_tokenize("it's").unwrap(), vec!["it", "'s"]);
    assert_eq!(
        t.encode("     ").unwrap(),
        vec![id("ĠĠĠĠ"), id("Ġ")],
        "five spaces: best-ranked merges first, leftmost first"
    );
}

#[test]
fn tokenizer_round_trips_exactly() {
    let t = tiny_tokenizer();
    for text in [
        "",
        "hello the world",
        "  leading and trailing  \n\n\t",
        "digits 1234567890 and ½ ² ٣",
        "unicode: héllo wörld — ☃ 日本語 🎉",
        "def f(x):\n    return x**2  # comment\n",
        "it's we're they've I'm you'll he'd",
    ] {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
    assert!(t.decode(&[100_000]).is_err());
}

#[test]
fn tokenizer_rejects_bytes_missing_from_vocab() {
    // A vocabulary without the token for byte 0x04 cannot encode "\x04".
    let mut vocab = byte_alphabet();
    vocab[4] = "<unused>".into();
    let t = Tokenizer::new(vocab, Vec::<String>::new()).unwrap();
    assert!(t.encode("a\u{4}b").is_err());
    assert_eq!(t.decode(&t.encode("ab").unwrap()).unwrap(), "ab");
}

/// A tiny SentencePiece BPE vocabulary: control pieces 0-2, `<unk>` 3, the
/// 256 byte pieces, then normal, user-defined and unused pieces. The
/// user-defined ones are written with spaces, as GGUF files store them.
/// Every expectation below on it was also what the `sentencepiece` package
/// gives for the same pieces (built as scripts/check_tokenizer.py builds
/// Gemma's model).
fn tiny_spm(add_space_prefix: bool) -> Tokenizer {
    use PieceType::*;
    let mut v: Vec<(String, f32, PieceType)> = vec![
        ("<pad>".into(), 0.0, Control),
        ("<eos>".into(), 0.0, Control),
        ("<bos>".into(), 0.0, Control),
        ("<unk>".into(), 0.0, Unknown),
    ];
    v.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, Byte)));
    let normal = [
        ("▁", -1.0),
        ("a", -2.0),
        ("b", -3.0),
        ("c", -4.0),
        ("h", -5.0),
        ("e", -6.0),
        ("l", -7.0),
        ("o", -8.0),
        ("bc", -10.0),
        ("ab", -11.0),
        ("aa", -12.0),
        ("▁b", -13.0),
        ("he", -14.0),
        ("ll", -15.0),
        ("hell", -16.0),
        ("ello", -17.0),
        ("a\n", -18.0),
        ("lo", -19.0),
        ("cc", -12.0),
        ("hello", -30.0),
        ("x", -40.0),
        ("y", -40.0),
        ("z", -40.0),
        ("xy", -40.0),
        ("yz", -40.0),
    ];
    v.extend(normal.iter().map(|&(p, s)| (p.to_string(), s, Normal)));
    v.extend(["\n", "\n\n", "  ", "<hr>"].map(|p| (p.to_string(), 0.0, UserDefined)));
    v.extend([("ca", -9.0), ("cab", -25.0)].map(|(p, s)| (p.to_string(), s, Unused)));
    let pieces: Vec<&str> = v.iter().map(|p| p.0.as_str()).collect();
    let scores: Vec<f32> = v.iter().map(|p| p.1).collect();
    let types: Vec<PieceType> = v.iter().map(|p| p.2).collect();
    let options = SpmOptions {
        bos: Some(2),
        add_space_prefix,
    };
    Tokenizer::spm(&pieces, &scores, &types, options).unwrap()
}

/// The pieces `text` encodes to.
fn spm_pieces(t: &Tokenizer, text: &str) -> Vec<String> {
    let ids = t.encode(text).unwrap();
    ids.iter()
        .map(|&id| t.token(id).unwrap().to_string())
        .collect()
}

#[test]
fn tokenizer_spm_merges_by_score_ties_to_the_leftmost() {
    let t = tiny_spm(false);
    // "bc" (-10) outranks "ab" (-11).
    assert_eq!(spm_pieces(&t, "abc"), ["a", "bc"]);
    assert_eq!(spm_pieces(&t, "abcc"), ["a", "bc", "c"]);
    // he, ll, hell, hello in score order; "ello" is a piece but no merge
    // path reaches it ("el" and "llo" are not pieces).
    assert_eq!(spm_pieces(&t, "hello"), ["hello"]);
    assert_eq!(spm_pieces(&t, "ello"), ["e", "ll", "o"]);
    // The same pair at several places: leftmost first.
    assert_eq!(spm_pieces(&t, "aaa"), ["aa", "a"]);
    assert_eq!(spm_pieces(&t, "aaaa"), ["aa", "aa"]);
    // Different pieces of equal score that overlap: leftmost first.
    assert_eq!(spm_pieces(&t, "xyz"), ["xy", "z"]);
    assert_eq!(spm_pieces(&t, "yzxyz"), ["yz", "xy", "z"]);
    // Unused pieces are merged through, then split back: "ca" (-9) forms
    // before "ab" (-11) could, so "cab" comes out as c, a, b.
    assert_eq!(spm_pieces(&t, "cab"), ["c", "a", "b"]);
    assert_eq!(spm_pieces(&t, "cabc"), ["c", "a", "bc"]);
}

#[test]
fn tokenizer_spm_user_defined_pieces_spaces_and_byte_fallback() {
    let t = tiny_spm(false);
    // User-defined pieces: longest match from the left, and no merge crosses
    // one ("a\n" is a normal piece but "\n" is matched first).
    assert_eq!(spm_pieces(&t, "a\n\n\nb"), ["a", "\n\n", "\n", "b"]);
    assert_eq!(spm_pieces(&t, "a\nb"), ["a", "\n", "b"]);
    assert_eq!(spm_pieces(&t, "<hr><hr"), ["<hr>", "<0x3C>", "h", "<0x72>"]);
    // Spaces are '▁', and the user-defined "  " (stored with spaces) is
    // matched in the escaped text.
    assert_eq!(spm_pieces(&t, "a b"), ["a", "▁b"]);
    assert_eq!(spm_pieces(&t, "a  b"), ["a", "  ", "b"]);
    assert_eq!(spm_pieces(&t, "a   b"), ["a", "  ", "▁b"]);
    assert_eq!(spm_pieces(&t, "   "), ["  ", "▁"]);
    // A literal '▁' is the escaped space (SentencePiece does the same).
    assert_eq!(t.encode("a▁b").unwrap(), t.encode("a b").unwrap());
    assert_eq!(t.decode(&t.encode("a▁b").unwrap()).unwrap(), "a b");
    // Characters without a piece: their UTF-8 bytes.
    assert_eq!(spm_pieces(&t, "é"), ["<0xC3>", "<0xA9>"]);
    assert!(t.encode("").unwrap().is_empty());
    assert_eq!(t.pre_tokenize("a b\nc").unwrap(), ["a b\nc"]);
    // Control pieces decode to nothing; encode never adds the BOS.
    assert_eq!(t.bos(), Some(2));
    let a = t.token_id("a").unwrap();
    assert_eq!(t.decode(&[2, a, 1]).unwrap(), "a");
    assert!(t.decode(&[100_000]).is_err());
    assert_eq!(tiny_tokenizer().bos(), None);

    // add_space_prefix: a '▁' before non-empty text, dropped on decoding.
    let p = tiny_spm(true);
    assert_eq!(spm_pieces(&p, "ab"), ["▁", "ab"]);
    assert_eq!(spm_pieces(&p, " b"), ["  ", "b"]);
    assert!(p.encode("").unwrap().is_empty());
    for text in ["ab", " b", "  x", "", "\n"] {
        assert_eq!(p.decode(&p.encode(text).unwrap()).unwrap(), text);
    }
}

#[test]
fn tokenizer_spm_rejects_malformed_vocabularies() {
    use PieceType::*;
    let ok = |pieces: &[&str], scores: &[f32], types: &[PieceType], bos| {
        let options = SpmOptions {
            bos,
            add_space_prefix: false,
        };
        Tokenizer::spm(pieces, scores, types, options).is_ok()
    };
    assert!(ok(&["a", "<0x41>"], &[0.0, 0.0], &[Normal, Byte], Some(1)));
    assert!(!ok(&["a", "<0x41>"], &[0.0], &[Normal, Byte], None));
    assert!(!ok(
        &["a", "<0x41>"],
        &[f32::NAN, 0.0],
        &[Normal, Byte],
        None
    ));
    assert!(!ok(&["a", "<0x4G>"], &[0.0, 0.0], &[Normal, Byte], None));
    assert!(!ok(&["a", ""], &[0.0, 0.0], &[Normal, UserDefined], None));
    assert!(!ok(&["a", "<0x41>"], &[0.0, 0.0], &[Normal, Byte], Some(2)));
    // A byte without a piece cannot be encoded (decoding must stay exact).
    let options = SpmOptions::default();
    let t = Tokenizer::spm(&["a", "<0x41>"], &[0.0, 0.0], &[Normal, Byte], options).unwrap();
    assert_eq!(t.encode("aA").unwrap(), [0, 1]);
    assert!(t.encode("ab").is_err());
}

#[test]
fn tokenizer_spm_round_trips_exactly() {
    let t = tiny_spm(false);
    for text in [
        "",
        " ",
        "     ",
        "\n\n\n",
        "\t\t \t",
        "hello the world",
        "  leading and trailing  \n\n\t",
        "unicode: héllo wörld — ☃ 日本語 🎉 👩‍👩‍👧",
        "\u{0}\u{1}\u{7f}\u{10FFFF}\u{FFFD}",
        "<hr><bos></hr>",
    ] {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any text without a literal '▁' comes back exactly.
    #[test]
    fn tokenizer_spm_round_trips_any_text(
        text in prop_oneof![any::<String>(), "[abcehlo xyz\n\t<hr>é日🎉]{0,40}"],
    ) {
        prop_assume!(!text.contains('▁'));
        let t = tiny_spm(false);
        prop_assert_eq!(t.decode(&t.encode(&text).unwrap()).unwrap(), text);
    }
}

/// A GGUF metadata array of 4-byte elements of type `elem`.
fn array4(elem: u32, items: &[[u8; 4]]) -> Vec<u8> {
    let mut p = elem.to_le_bytes().to_vec();
    p.extend_from_slice(&(items.len() as u64).to_le_bytes());
    p.extend(items.iter().flatten());
    p
}

#[test]
fn tokenizer_spm_from_gguf_keys() {
    let mut pieces: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"]
        .map(String::from)
        .to_vec();
    pieces.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    pieces.extend(["▁", "a", "b", "ab", "  "].map(String::from));
    let n = pieces.len();
    let mut types = vec![3i32, 3, 3, 3];
    types.extend([6; 256]);
    types.extend([1, 1, 1, 1, 4]);
    let scores: Vec<[u8; 4]> = (0..n).map(|i| (-(i as f32)).to_le_bytes()).collect();
    let file = |model: &str, types: &[i32], scores_ty: u32, add_bos: bool| {
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let types: Vec<[u8; 4]> = types.iter().map(|t| t.to_le_bytes()).collect();
        let mut b = GgufBuilder::new(32);
        b.kv_str("tokenizer.ggml.model", model)
            .kv_str("tokenizer.ggml.pre", "default")
            .kv_str_array("tokenizer.ggml.tokens", &refs)
            .kv_raw("tokenizer.ggml.scores", 9, &array4(scores_ty, &scores))
            .kv_raw("tokenizer.ggml.token_type", 9, &array4(5, &types))
            .kv_u32("tokenizer.ggml.bos_token_id", 2)
            .kv_raw("tokenizer.ggml.add_bos_token", 7, &[add_bos as u8])
            .kv_raw("tokenizer.ggml.add_space_prefix", 7, &[0]);
        Tokenizer::from_gguf(&Gguf::parse(b.build()).unwrap())
    };
    let t = file("llama", &types, 6, true).unwrap();
    assert_eq!(t.bos(), Some(2));
    assert_eq!(t.vocab_size(), n);
    let id = |s: &str| t.token_id(s).unwrap();
    assert_eq!(
        t.encode("ab a  b").unwrap(),
        [id("ab"), id("▁"), id("a"), id("  "), id("b")]
    );
    assert_eq!(file("llama", &types, 6, false).unwrap().bos(), None);
    // Wrong types and unknown values are errors, not panics.
    assert!(file("llama", &types, 5, true).is_err(), "scores as i32");
    let mut bad = types.clone();
    bad[261] = 9;
    assert!(file("llama", &bad, 6, true).is_err(), "token type 9");
    assert!(
        file("llama", &types[1..], 6, true).is_err(),
        "one type short"
    );
    assert!(file("bert", &types, 6, true).is_err());
}

/// The real Gemma 3 270M vocabulary (the opt-in asset), against ids from
/// scripts/check_tokenizer.py's sentencepiece model (sentencepiece 0.2.3).
#[test]
fn tokenizer_gemma_matches_sentencepiece() {
    const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";
    let path = kvq_eval::assets::path(GEMMA);
    if !path.exists() {
        eprintln!("SKIPPED: {GEMMA} is absent (scripts/fetch-assets.sh --gemma fetches it)");
        return;
    }
    let t = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!(t.bos(), Some(2));
    let pinned: [(&str, &[u32]); 10] = [
        ("Hello world", &[9259, 1902]),
        (
            "It is a truth universally acknowledged",
            &[1509, 563, 496, 9043, 69127, 30285],
        ),
        ("  two", &[138, 13498]),
        ("a\n\n\nb", &[236746, 109, 236763]),
        ("\t\tx", &[255969, 236781]),
        (
            "def f(x):\n    return x**2  # comment\n",
            &[
                2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865,
                5739, 107,
            ],
        ),
        ("日本語 🎉", &[94951, 204906]),
        // User-defined pieces are matched, control pieces are plain text.
        ("<start_of_image><bos>", &[255999, 236820, 46757, 236813]),
        ("\u{10FFFF}\u{0}", &[482, 381, 429, 429, 238]),
        // 60 spaces: the longest user-defined run (31), then 29.
        (&format!("{}end", " ".repeat(60)), &[167, 165, 643]),
    ];
    for (text, ids) in pinned {
        assert_eq!(t.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(t.decode(ids).unwrap(), text);
    }
    // The first 20000 characters of each corpus (scripts/check_tokenizer.py
    // --model gemma compares every id, here and on the whole files).
    let corpora: [(&str, usize, [u32; 6], [u32; 6]); 2] = [
        (
            "austen",
            4785,
            [236773, 28230, 4715, 69210, 117816, 108],
            [573, 496, 1651, 236793, 573, 515],
        ),
        (
            "code",
            5629,
            [76499, 578, 6288, 108, 1999, 5803],
            [584, 538, 8721, 236787, 107, 140],
        ),
    ];
    for (name, n, head, tail) in corpora {
        let Ok(text) = std::fs::read_to_string(kvq_eval::assets::corpus(name)) else {
            eprintln!("SKIPPED: corpus {name} is absent (scripts/fetch-assets.sh fetches it)");
            continue;
        };
        let text: String = text.chars().take(20_000).collect();
        let ids = t.encode(&text).unwrap();
        assert_eq!(ids.len(), n, "{name}");
        assert_eq!(ids[..6], head, "{name}");
        assert_eq!(ids[n - 6..], tail, "{name}");
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
    // Exact round trips of arbitrary text without a literal '▁'.
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(&any::<String>(), |text| {
            if !text.contains('▁') {
                prop_assert_eq!(t.decode(&t.encode(&text).unwrap()).unwrap(), text);
            }
            Ok(())
        })
        .unwrap();
}

/// The K-quant and 5-bit dequantizers against blocks built here from
/// chosen codes, scales and mins (the encoding written from the format's
/// description, independently of the decoder).
#[test]
fn k_quant_and_q5_dequantizers_on_hand_built_blocks() {
    use half::f16;
    use kvq_eval::gguf::{dequant_q4_k, dequant_q5, dequant_q6_k};
    let f16b = |x: f32| f16::from_f32(x).to_le_bytes();
    let mut seed = 7u32;
    let mut next = move |n: u32| {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) % n
    };
    // Q5_0 / Q5_1: codes 0..31.
    let q: Vec<u8> = (0..32).map(|_| next(32) as u8).collect();
    let (d, m) = (0.375f32, -1.25f32);
    let mut qs = [0u8; 16];
    let mut qh = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 15) | ((q[j + 16] & 15) << 4);
    }
    for (j, &c) in q.iter().enumerate() {
        qh |= u32::from(c >> 4) << j;
    }
    let mut b0 = f16b(d).to_vec();
    b0.extend(qh.to_le_bytes());
    b0.extend(qs);
    let mut out = Vec::new();
    dequant_q5(&b0, false, &mut out);
    let want: Vec<f32> = q.iter().map(|&c| (f32::from(c) - 16.0) * d).collect();
    assert_eq!(out, want);
    let mut b1 = f16b(d).to_vec();
    b1.extend(f16b(m));
    b1.extend(qh.to_le_bytes());
    b1.extend(qs);
    out.clear();
    dequant_q5(&b1, true, &mut out);
    let want: Vec<f32> = q.iter().map(|&c| f32::from(c) * d + m).collect();
    assert_eq!(out, want);

    // Q4_K: eight sub-blocks of 32, 6-bit scales and mins, 4-bit codes.
    let (d, dmin) = (0.0625f32, 0.03125f32);
    let sc: Vec<u8> = (0..8).map(|_| next(64) as u8).collect();
    let mn: Vec<u8> = (0..8).map(|_| next(64) as u8).collect();
    let q: Vec<u8> = (0..256).map(|_| next(16) as u8).collect();
    let mut s12 = [0u8; 12];
    for j in 0..4 {
        s12[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s12[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        s12[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
    }
    let mut codes = [0u8; 128];
    for (v, &c) in q.iter().enumerate() {
        // Values 64i..64i+31 are the low nibbles of bytes 32i.., the next
        // 32 their high nibbles.
        let (i, w) = (v / 64, v % 64);
        codes[32 * i + w % 32] |= if w < 32 { c } else { c << 4 };
    }
    let mut blk = f16b(d).to_vec();
    blk.extend(f16b(dmin));
    blk.extend(s12);
    blk.extend(codes);
    assert_eq!(blk.len(), 144);
    out.clear();
    dequant_q4_k(&blk, &mut out);
    for (v, (&c, &x)) in q.iter().zip(&out).enumerate() {
        let j = v / 32;
        let want = d * f32::from(sc[j]) * f32::from(c) - dmin * f32::from(mn[j]);
        assert_eq!(x, want, "Q4_K value {v}");
    }

    // Q6_K: 6-bit codes, sixteen i8 scales.
    let d = 0.015625f32;
    let q: Vec<u8> = (0..256).map(|_| next(64) as u8).collect();
    let scales: Vec<i8> = (0..16).map(|_| next(256) as u8 as i8).collect();
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for (v, &c) in q.iter().enumerate() {
        let (half, w) = (v / 128, v % 128);
        let (k, l) = (w / 32, w % 32);
        let lo = c & 15;
        let byte = 64 * half + l + if k % 2 == 1 { 32 } else { 0 };
        ql[byte] |= if k < 2 { lo } else { lo << 4 };
        qh[32 * half + l] |= (c >> 4) << (2 * k);
    }
    let mut blk = ql.to_vec();
    blk.extend(qh);
    blk.extend(scales.iter().map(|&s| s as u8));
    blk.extend(f16b(d));
    assert_eq!(blk.len(), 210);
    out.clear();
    dequant_q6_k(&blk, &mut out);
    for (v, (&c, &x)) in q.iter().zip(&out).enumerate() {
        let (half, w) = (v / 128, v % 128);
        let (k, l) = (w / 32, w % 32);
        let s = scales[8 * half + l / 16 + 2 * k];
        let want = d * f32::from(s) * (f32::from(c) - 32.0);
        assert_eq!(x, want, "Q6_K value {v}");
    }
}

/// Every configuration of every sweep grid builds a cache for SmolLM2's
/// and Gemma 3's head shapes, with unique names, the baseline first.
#[test]
fn every_sweep_grid_builds() {
    use kvq_eval::kvq_store::KvqStore;
    use kvq_eval::programs::sweep::{grid, GridKind};
    for kind in [
        GridKind::Default,
        GridKind::Full,
        GridKind::Split,
        GridKind::Ladder,
        GridKind::Trap,
        GridKind::Codebook,
        GridKind::PreRope,
        GridKind::Budget,
        GridKind::Rotation,
        GridKind::Plan,
        GridKind::Fit,
        GridKind::Outliers,
    ] {
        let g = grid(kind, 0, 0);
        if kind == GridKind::Outliers {
            let with = g.iter().filter(|c| {
                c.spec
                    .key_codec()
                    .is_some_and(|k| k.outlier_fraction() > 0.0)
            });
            assert_eq!(with.count(), 2 * 3 + 2 + 8, "{kind:?}");
        }
        assert!(g[0].is_baseline(), "{kind:?}");
        let mut names: Vec<_> = g.iter().map(|c| c.name.clone()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), g.len(), "{kind:?}: duplicate names");
        for c in &g {
            for (n_kv, hd) in [(3, 64), (1, 256)] {
                let (spec, _) = c.store_and_hook();
                let cfg = Config {
                    n_kv_heads: n_kv,
                    n_heads: 3 * n_kv,
                    head_dim: hd,
                    rope_dim: hd,
                    ..tiny_config(RopeStyle::Halves)
                };
                KvqStore::for_model(&cfg, spec)
                    .unwrap_or_else(|e| panic!("{kind:?} {}: {e}", c.name));
            }
        }
    }
}

/// `--grid fit` on a random model: every configuration holds a codec pair
/// per layer, the fitted ones each layer's own table in place of the
/// Lloyd-Max one it starts from, with unique names; the stores hold
/// exactly those codecs, and the caches run.
#[test]
fn fitted_configurations_build_and_run() {
    use kvq::Levels;
    use kvq_eval::programs::sweep::{fit_configs, plan_captures};
    let cfg = Config {
        head_dim: 64,
        rope_dim: 64,
        d_model: 64,
        n_layers: 3,
        ..tiny_config(RopeStyle::Halves)
    };
    let m = Model::random(cfg, 7, false);
    let held = vec![tokens(96, m.cfg.vocab_size, 13)];
    let caps = plan_captures(&m, &held, None, 4).unwrap();
    let configs = fit_configs(&caps, 0, 4).unwrap();
    let mut names: Vec<_> = configs.iter().map(|c| c.name.clone()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), configs.len());
    let toks = tokens(64, m.cfg.vocab_size, 14);
    let opts = PplOptions {
        n_tokens: 64,
        window: 32,
        path: EvalPath::Prefill,
        bos: None,
    };
    let mut fitted = 0;
    for c in &configs {
        let layers = c.layers.as_ref().expect("a codec pair per layer");
        assert_eq!(layers.len(), 3);
        let fits = layers
            .iter()
            .flat_map(|&(k, v)| [k, v])
            .flatten()
            .filter(|c| matches!(c.levels(), Some(Levels::Fitted(_))))
            .count();
        // Every layer's fitted codec, and only in the configurations named so.
        assert!(
            fits % 3 == 0 && (fits > 0) == c.name.contains("fit"),
            "{}",
            c.name
        );
        fitted += fits;
        // Each layer fits its own table.
        if c.name.starts_with("V H·fit") {
            assert_ne!(layers[0].1, layers[1].1, "{}", c.name);
        }
        let (spec, hook) = c.store_and_hook();
        assert!(hook.is_none());
        assert_eq!(spec.sinks, 4);
        let mut store =
            kvq_eval::kvq_store::KvqStore::for_model_layers(&m.cfg, spec, layers).unwrap();
        for (l, &(k, v)) in layers.iter().enumerate() {
            let lc = store.cache().layer(l).config();
            assert_eq!((lc.key_codec_spec(), lc.value_codec_spec()), (k, v));
        }
        let r = perplexity(
            &m,
            &toks,
            &mut store,
            &mut Hooks::default(),
            &opts,
            |_, _| {},
        )
        .unwrap();
        assert!(r.all.ppl().is_finite(), "{}", c.name);
    }
    assert!(fitted > 0);
}

/// `--grid plan` on a random model: each budget's per-layer allocation stays
/// within it, the single pair is one codec pair for every layer, the stores
/// hold exactly the planned codecs with keys before RoPE, and the caches run.
#[test]
fn planned_configurations_build_and_run() {
    use kvq_eval::kvq_store::CacheSpec;
    use kvq_eval::programs::sweep::plan_configs;
    let cfg = Config {
        head_dim: 64,
        rope_dim: 64,
        d_model: 64,
        n_layers: 3,
        ..tiny_config(RopeStyle::Halves)
    };
    let m = Model::random(cfg, 5, false);
    let held = vec![
        tokens(96, m.cfg.vocab_size, 8),
        tokens(96, m.cfg.vocab_size, 11),
    ];
    let budgets = [3.0, 4.5];
    let configs = plan_configs(&m, &held, None, &budgets, 0, 4).unwrap();
    assert_eq!(configs.len(), 3 * budgets.len());
    let toks = tokens(64, m.cfg.vocab_size, 9);
    let opts = PplOptions {
        n_tokens: 64,
        window: 32,
        path: EvalPath::Prefill,
        bos: None,
    };
    for (i, c) in configs.iter().enumerate() {
        let budget = budgets[i / 3];
        assert!(!c.is_baseline());
        let layers = c.layers.as_ref().expect("planned per layer");
        assert_eq!(layers.len(), 3);
        let eb = c.effective_bits(3, 2, 64);
        assert!(eb <= budget + 1e-9 && eb > budget - 1.5, "{}: {eb}", c.name);
        if i % 3 == 2 {
            assert!(layers.iter().all(|l| *l == layers[0]), "{}", c.name);
        }
        let (spec, hook) = c.store_and_hook();
        assert!(hook.is_none());
        assert_eq!(spec.sinks, 4);
        assert!(spec.pre_rope);
        assert_eq!(spec.keys, CacheSpec::FULL.keys);
        let mut store =
            kvq_eval::kvq_store::KvqStore::for_model_layers(&m.cfg, spec, layers).unwrap();
        for (l, &(k, v)) in layers.iter().enumerate() {
            let lc = store.cache().layer(l).config();
            assert_eq!((lc.key_codec_spec(), lc.value_codec_spec()), (k, v));
            assert!(lc.rope().is_some());
        }
        let r = perplexity(
            &m,
            &toks,
            &mut store,
            &mut Hooks::default(),
            &opts,
            |_, _| {},
        )
        .unwrap();
        assert!(r.all.ppl().is_finite());
    }
    // A store needs one codec pair per layer.
    let (spec, _) = configs[0].store_and_hook();
    let short = &configs[0].layers.as_ref().unwrap()[..2];
    assert!(kvq_eval::kvq_store::KvqStore::for_model_layers(&m.cfg, spec, short).is_err());
    // A budget below every candidate is an error.
    assert!(plan_configs(&m, &held, None, &[1.0], 0, 4).is_err());
    // Windows of different lengths, or none, are errors.
    let ragged = vec![held[0].clone(), held[1][..50].to_vec()];
    assert!(plan_configs(&m, &ragged, None, &budgets, 0, 4).is_err());
    assert!(plan_configs(&m, &[], None, &budgets, 0, 4).is_err());
}

/// The layer weights of `--grid plan`: one per layer, finite and
/// non-negative, and zero for a layer the probe pair leaves exact (a
/// window of sinks only); two windows side by side are each window on its
/// own.
#[test]
fn layer_weights_measure_each_layer() {
    use kvq::Planner;
    use kvq_eval::kvq_store::CacheSpec;
    use kvq_eval::programs::sweep::{layer_weights, plan_captures, probe_pair};
    let cfg = Config {
        head_dim: 64,
        rope_dim: 64,
        d_model: 64,
        n_layers: 3,
        ..tiny_config(RopeStyle::Halves)
    };
    let m = Model::random(cfg, 6, false);
    let (a, b) = (
        tokens(96, m.cfg.vocab_size, 10),
        tokens(96, m.cfg.vocab_size, 12),
    );
    let spec = |sinks| CacheSpec {
        sinks,
        pre_rope: true,
        ..CacheSpec::FULL
    };
    let both = vec![a.clone(), b.clone()];
    let caps = plan_captures(&m, &both, None, 0).unwrap();
    assert_eq!(caps[0].shape().n_kv_heads(), 4);
    let w = layer_weights(&m, &both, None, &caps, spec(0)).unwrap();
    assert_eq!(w.len(), 3);
    assert!(w.iter().all(|x| x.is_finite() && *x >= 0.0), "{w:?}");
    assert!(w.iter().any(|&x| x > 0.0), "{w:?}");
    // Side by side, each window's heads are scored on their own: the
    // stacked output error lies between the two windows' own.
    let (pk, pv) = probe_pair();
    let err = |held: &[Vec<u32>]| -> Vec<f64> {
        let caps = plan_captures(&m, held, None, 0).unwrap();
        let lp = Planner::new([pk], [pv])
            .unwrap()
            .plan_per_layer(&caps, 16.0)
            .unwrap();
        lp.layers.iter().map(|c| c.errors.mean.output_rel).collect()
    };
    let (ea, eb, e2) = (
        err(std::slice::from_ref(&a)),
        err(std::slice::from_ref(&b)),
        err(&both),
    );
    for l in 0..3 {
        let (lo, hi) = (ea[l].min(eb[l]), ea[l].max(eb[l]));
        assert!(
            e2[l] >= lo * (1.0 - 1e-9) && e2[l] <= hi * (1.0 + 1e-9),
            "{l}: {e2:?}"
        );
        assert!(((ea[l] + eb[l]) / 2.0 - e2[l]).abs() <= 1e-9 * hi, "{l}");
    }
    let all_sinks = plan_captures(&m, &both, None, 96).unwrap();
    let none = layer_weights(&m, &both, None, &all_sinks, spec(96)).unwrap();
    assert_eq!(none, vec![0.0; 3]);
}

/// The channel-width study ([`kvq_eval::alloc`]): each head spends exactly
/// its budget, and on the window it was fitted to the widths lower the
/// error of the scores `q·k` against one width for every channel.
#[test]
fn channel_widths_spend_the_budget_and_lower_the_score_error() {
    use kvq_eval::alloc::ChannelBits;
    use kvq_eval::model::RoundTrip;
    let mut m = Model::random(tiny_config(RopeStyle::Halves), 31, false);
    // Keys whose channels differ in scale, as real ones do: the rows of
    // `wk` for channels 0 and 4 (a rotary pair) of every head ten times
    // larger, those of channels 1 and 5 a tenth.
    let hd = m.cfg.head_dim;
    for w in &mut m.layers {
        for (r, mut row) in w.wk.rows_mut().into_iter().enumerate() {
            match r % hd {
                0 | 4 => row.mapv_inplace(|v| v * 10.0),
                1 | 5 => row.mapv_inplace(|v| v * 0.1),
                _ => {}
            }
        }
    }
    let c = &m.cfg;
    let toks = tokens(96, c.vocab_size, 4);
    let cap = kvq_eval::ppl::capture_window(&m, &toks).unwrap();
    let (n_kv, n_q) = (c.n_kv_heads, c.n_heads);
    let fit = ChannelBits::fit(c, std::slice::from_ref(&cap), 3.0, 16).unwrap();
    let one = ChannelBits::uniform(c.n_layers, n_kv, hd, 3, 16);
    let score_error = |a: &ChannelBits| -> f64 {
        let mut e = 0.0;
        for (l, lc) in cap.layers.iter().enumerate() {
            let mut k = lc.k_pre_rope.clone();
            a.round_trip(l, 0, &mut k, toks.len(), n_kv, hd).unwrap();
            m.apply_rope(&mut k, n_kv * hd, 0, l);
            for qr in lc.q.chunks_exact(n_q * hd) {
                for (kr, kx) in k.chunks_exact(n_kv * hd).zip(lc.k.chunks_exact(n_kv * hd)) {
                    for (h, q) in qr.chunks_exact(hd).enumerate() {
                        let g = h / (n_q / n_kv) * hd;
                        let d: f32 = (0..hd).map(|i| q[i] * (kr[g + i] - kx[g + i])).sum();
                        e += f64::from(d).powi(2);
                    }
                }
            }
        }
        e
    };
    for l in 0..c.n_layers {
        for h in fit.layer(l).chunks_exact(hd) {
            assert_eq!(h.iter().map(|&b| usize::from(b)).sum::<usize>(), 3 * hd);
        }
        assert_eq!(one.effective_bits(l), 3.0 + 2.0);
    }
    let (ef, eo) = (score_error(&fit), score_error(&one));
    assert!(ef < 0.5 * eo, "fitted {ef} against one width {eo}");
    // Rotary pairs at one width (halves: channel c with c + hd/2); one
    // budget per layer, spent across its heads.
    use kvq_eval::alloc::FitOptions;
    let caps = std::slice::from_ref(&cap);
    let opts = |pairs, per_layer| FitOptions {
        block: 16,
        pairs,
        per_layer,
        global: false,
        sinks: 0,
        trellis: false,
        by_error: false,
    };
    let paired = ChannelBits::fit_with(c, caps, 3.0, opts(true, false)).unwrap();
    let layered = ChannelBits::fit_with(c, caps, 3.0, opts(false, true)).unwrap();
    for l in 0..c.n_layers {
        for h in paired.layer(l).chunks_exact(hd) {
            assert_eq!(h[..hd / 2], h[hd / 2..], "layer {l}: {h:?}");
            assert_eq!(h.iter().map(|&b| usize::from(b)).sum::<usize>(), 3 * hd);
        }
        let w = layered.layer(l);
        assert_eq!(
            w.iter().map(|&b| usize::from(b)).sum::<usize>(),
            3 * w.len()
        );
    }
    assert!(score_error(&paired) < 0.5 * eo);
    assert!(score_error(&layered) < 0.5 * eo);
    // One budget for the model: spent in full across the layers, not
    // layer by layer; with the last layer's keys 10x louder (its score
    // errors 100x larger) that layer takes more than its share.
    let mut loud = cap.clone();
    let last = loud.layers.len() - 1;
    loud.layers[last]
        .k_pre_rope
        .iter_mut()
        .for_each(|x| *x *= 10.0);
    let global = ChannelBits::fit_with(
        c,
        std::slice::from_ref(&loud),
        3.0,
        FitOptions {
            global: true,
            ..opts(true, false)
        },
    )
    .unwrap();
    let per: Vec<usize> = (0..c.n_layers)
        .map(|l| global.layer(l).iter().map(|&b| usize::from(b)).sum())
        .collect();
    assert_eq!(
        per.iter().sum::<usize>(),
        3 * c.n_layers * n_kv * hd,
        "{per:?}"
    );
    assert!(per[last] > 3 * n_kv * hd, "{per:?}");
    let per_head =
        ChannelBits::fit_with(c, std::slice::from_ref(&loud), 3.0, opts(true, false)).unwrap();
    assert_eq!(
        per_head
            .layer(last)
            .iter()
            .map(|&b| usize::from(b))
            .sum::<usize>(),
        3 * n_kv * hd
    );
    // Its budget is rounded once: 2.3 bits over 2 layers of 16 channels
    // are 74 bits, where rounding per head would leave 72.
    let odd = ChannelBits::fit_with(
        c,
        caps,
        2.3,
        FitOptions {
            global: true,
            ..opts(true, false)
        },
    )
    .unwrap();
    let total: usize = (0..c.n_layers)
        .flat_map(|l| odd.layer(l).iter().map(|&b| usize::from(b)))
        .sum();
    assert_eq!(
        total,
        (2.3 * (c.n_layers * n_kv * hd) as f64).round() as usize
    );
    // Widths fitted through the trellis code spend the same budget, at
    // the same counted bits per width, and beat one width in the grid.
    let coded = ChannelBits::fit_with(
        c,
        caps,
        3.0,
        FitOptions {
            trellis: true,
            ..opts(true, false)
        },
    )
    .unwrap();
    for l in 0..c.n_layers {
        for h in coded.layer(l).chunks_exact(hd) {
            assert_eq!(h.iter().map(|&b| usize::from(b)).sum::<usize>(), 3 * hd);
        }
    }
    assert!(coded.trellis_channels() > 0);
    assert!(score_error(&coded) < 0.5 * eo);
    // Trellis or grid per channel, by the calibration error.
    let chosen = ChannelBits::fit_with(
        c,
        caps,
        3.0,
        FitOptions {
            trellis: true,
            by_error: true,
            ..opts(true, false)
        },
    )
    .unwrap();
    for l in 0..c.n_layers {
        for h in chosen.layer(l).chunks_exact(hd) {
            assert_eq!(h.iter().map(|&b| usize::from(b)).sum::<usize>(), 3 * hd);
        }
    }
    assert!(score_error(&chosen) < 0.5 * eo);
    // A budget past 8 bits or an empty calibration set is refused.
    assert!(ChannelBits::fit(c, std::slice::from_ref(&cap), 9.0, 16).is_err());
    assert!(ChannelBits::fit(c, &[], 3.0, 16).is_err());
}

/// The value trellis study ([`kvq_eval::trellis`]): on a random model's
/// values the trellis code's attention outputs are closer to full
/// precision than rotated Lloyd-Max values of the same bits and groups,
/// and a configuration with it runs, counts its bits and is no baseline.
#[test]
fn trellis_values_beat_lloyd_max_at_the_point_of_use() {
    use kvq::metrics::{layer_errors, AttnShape, MetricsConfig};
    use kvq::{Axis, Codec, Group, Levels, Mode, QuantScheme, Rotation};
    use kvq_eval::kvq_store::CacheSpec;
    use kvq_eval::model::RoundTrip;
    use kvq_eval::programs::sweep::{Config as SweepConfig, ValueHook};
    use kvq_eval::trellis::TrellisCode;
    let cfg = Config {
        head_dim: 64,
        rope_dim: 64,
        d_model: 64,
        ..tiny_config(RopeStyle::Halves)
    };
    let m = Model::random(cfg, 12, false);
    let c = &m.cfg;
    let toks = tokens(96, c.vocab_size, 6);
    let cap = kvq_eval::ppl::capture_window(&m, &toks).unwrap();
    let (n_kv, hd) = (c.n_kv_heads, c.head_dim);
    let shape = AttnShape::new(c.n_heads, n_kv, hd).unwrap();
    let mcfg = MetricsConfig::new().with_causal(0);
    for k in [2u32, 3] {
        let code = TrellisCode::gaussian(8, k, 64).unwrap();
        let s = QuantScheme::new(k as u8, Axis::PerToken, Group::Size(64))
            .unwrap()
            .with_mode(Mode::Symmetric)
            .unwrap();
        let lloyd = Codec::codebook(s, Levels::Gauss).with_rotation(Rotation::Hadamard);
        let (mut et, mut el) = (0.0, 0.0);
        for (l, lc) in cap.layers.iter().enumerate() {
            let mut vt = lc.v.clone();
            code.round_trip(l, 0, &mut vt, toks.len(), n_kv, hd)
                .unwrap();
            let vl = lloyd.roundtrip(&lc.v, n_kv, hd).unwrap();
            let out = |vh: &[f32]| {
                layer_errors(shape, lc.q.as_slice(), &lc.k, &lc.v, &lc.k, vh, &mcfg)
                    .unwrap()
                    .summary
                    .mean
                    .output_rel
            };
            et += out(&vt);
            el += out(&vl);
        }
        assert!(
            et < 0.9 * el,
            "{k} bits: trellis {et} against Lloyd-Max {el}"
        );
    }
    let conf = SweepConfig {
        value_code: Some(ValueHook::Trellis(std::sync::Arc::new(
            TrellisCode::gaussian(8, 2, 64).unwrap(),
        ))),
        ..SweepConfig::new("V trellis2", CacheSpec::FULL)
    };
    assert!(!conf.is_baseline());
    assert_eq!(
        conf.effective_bits(c.n_layers, n_kv, hd),
        (16.0 + 2.25) / 2.0
    );
    let opts = PplOptions {
        n_tokens: 64,
        window: 32,
        path: EvalPath::Prefill,
        bos: None,
    };
    let code = conf.value_code.clone().unwrap();
    let mut hooks = Hooks {
        v: Some(&code),
        ..Hooks::default()
    };
    let (spec, hook) = conf.store_and_hook();
    assert!(hook.is_none());
    let mut store = kvq_eval::kvq_store::KvqStore::for_model(c, spec).unwrap();
    let r = perplexity(&m, &toks, &mut store, &mut hooks, &opts, |_, _| {}).unwrap();
    assert!(r.all.ppl().is_finite());
}

#[test]
fn transform_codes_fit_widths_and_round_trip() {
    use kvq::{Axis, Codec, Group, Levels, Mode, QuantScheme, Rotation};
    use kvq_eval::capture::{Capture, LayerCapture};
    use kvq_eval::klt::{KltCode, KltOptions, KltTensor};
    use kvq_eval::model::RoundTrip;
    let cfg = Config {
        head_dim: 16,
        rope_dim: 16,
        d_model: 64,
        ..tiny_config(RopeStyle::Halves)
    };
    // Post-attention norms, so the value weights take their γ.
    let mut m = Model::random_with_norms(cfg, 14, false, true);
    let c = m.cfg.clone();
    let (n_kv, hd, n_q) = (c.n_kv_heads, c.head_dim, c.n_heads);
    let (width, group) = (n_kv * hd, n_q / n_kv);
    // An o_proj that reads the head's channels very unequally.
    for lw in &mut m.layers {
        for mut row in lw.wo.outer_iter_mut() {
            for (j, w) in row.iter_mut().enumerate() {
                *w *= 4f32.powf(-((j % hd) as f32) / 4.0);
            }
        }
    }
    // Values of very unequal principal variances (2^-i on channel i of a
    // random basis), where transform coding has the most to gain; queries
    // of unequal energy along the channels.
    let t = 400;
    let mut rng = kvq_eval::model::SplitMix64(5);
    let basis: Vec<f32> = (0..hd * hd).map(|_| rng.gaussian()).collect();
    let mut rows = |n: usize| -> Vec<f32> {
        (0..n * n_kv)
            .flat_map(|_| {
                let z: Vec<f32> = (0..hd)
                    .map(|i| rng.gaussian() * 2f32.powf(-(i as f32) / 2.0))
                    .collect();
                (0..hd)
                    .map(|r| (0..hd).map(|i| basis[r * hd + i] * z[i]).sum::<f32>())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let mut qrng = kvq_eval::model::SplitMix64(6);
    let q: Vec<f32> = (0..t * n_q * hd)
        .map(|i| qrng.gaussian() * 3f32.powf(-(((i % hd) as f32) / 3.0)))
        .collect();
    let layer = |v: Vec<f32>| LayerCapture {
        q: q.clone(),
        k: v.clone(),
        v,
        k_pre_rope: Vec::new(),
    };
    let cap = Capture {
        n_q_heads: n_q,
        n_kv_heads: n_kv,
        head_dim: hd,
        pos0: 0,
        tokens: vec![0; t],
        layers: (0..c.n_layers).map(|_| layer(rows(t))).collect(),
    };
    let test = rows(64);
    let mse = |a: &[f32], b: &[f32]| -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            / a.len() as f64
    };
    let plain = KltOptions {
        weighted: false,
        ..KltOptions::default()
    };
    let fit_on = |caps: &[Capture], bits: f64, o: KltOptions| {
        KltCode::fit(
            &m,
            caps,
            KltOptions {
                code_bits: bits,
                ..o
            },
        )
    };
    let fit = |bits: f64, o: KltOptions| fit_on(std::slice::from_ref(&cap), bits, o).unwrap();
    let coded = |k: &KltCode, pos0: usize| {
        let mut x = test.clone();
        k.round_trip(0, pos0, &mut x, 64, n_kv, hd).unwrap();
        x
    };
    // More bits, less error; almost none at 8 bits a channel.
    let errs: Vec<f64> = [1.0, 2.0, 3.0, 4.0, 8.0]
        .iter()
        .map(|&b| mse(&coded(&fit(b, plain), 0), &test))
        .collect();
    assert!(errs.windows(2).all(|w| w[1] < w[0]), "{errs:?}");
    let energy = mse(&test, &vec![0.0; test.len()]);
    assert!(errs[4] < 1e-4 * energy, "{errs:?} of {energy}");
    // The codes and one f16 scale per row and head.
    let k2 = fit(2.0, plain);
    assert_eq!(k2.effective_bits(), 2.0 + 16.0 / hd as f64);
    assert_eq!(k2.histogram().iter().sum::<usize>(), c.n_layers * width);
    assert!(k2.coding_gain() > 1.0, "{}", k2.coding_gain());
    // Here the principal axes beat the rotated Lloyd-Max grid of the same
    // bits (2 code bits and a 16-bit scale per 16 values) by far.
    let s = QuantScheme::new(2, Axis::PerToken, Group::Size(16))
        .unwrap()
        .with_mode(Mode::Symmetric)
        .unwrap();
    let lloyd = Codec::codebook(s, Levels::Gauss).with_rotation(Rotation::Hadamard);
    let el = mse(&lloyd.roundtrip(&test, n_kv, hd).unwrap(), &test);
    let ek = mse(&coded(&k2, 0), &test);
    assert!(ek < 0.5 * el, "transform {ek} against Lloyd-Max {el}");
    // Sinks stay exact, only below their positions.
    let sunk = fit(2.0, KltOptions { sinks: 4, ..plain });
    let x = coded(&sunk, 0);
    assert_eq!(x[..4 * width], test[..4 * width]);
    assert_ne!(x[4 * width..5 * width], test[4 * width..5 * width]);
    assert_ne!(coded(&sunk, 4)[..width], test[..width]);
    // Weighted fits beat the plain axes where their error lands: values
    // through o_proj (and the post-attention norm's γ), keys through the
    // queries.
    let lw = &m.layers[0];
    let gamma = lw.post_attn_norm.clone().unwrap();
    let out_err = |x: &[f32]| -> f64 {
        let mut e = 0.0;
        for (row, orig) in x.chunks_exact(width).zip(test.chunks_exact(width)) {
            for h in 0..n_kv {
                let dv: Vec<f32> = (0..hd)
                    .map(|i| row[h * hd + i] - orig[h * hd + i])
                    .collect();
                for qh in h * group..(h + 1) * group {
                    for (r, w) in lw.wo.outer_iter().enumerate() {
                        let o: f32 = (0..hd).map(|i| w[qh * hd + i] * dv[i]).sum();
                        e += f64::from(gamma[r] * o).powi(2);
                    }
                }
            }
        }
        e
    };
    let score_err = |x: &[f32]| -> f64 {
        let mut e = 0.0;
        for (row, orig) in x.chunks_exact(width).zip(test.chunks_exact(width)) {
            for qrow in q.chunks_exact(n_q * hd).take(50) {
                for qh in 0..n_q {
                    let h = qh / group;
                    let d: f32 = (0..hd)
                        .map(|i| qrow[qh * hd + i] * (row[h * hd + i] - orig[h * hd + i]))
                        .sum();
                    e += f64::from(d).powi(2);
                }
            }
        }
        e
    };
    for bits in [2.0, 3.0] {
        let (w, p) = (fit(bits, KltOptions::default()), fit(bits, plain));
        let (ew, ep) = (out_err(&coded(&w, 0)), out_err(&coded(&p, 0)));
        assert!(
            ew < 0.8 * ep,
            "values, {bits} bits: {ew} against plain {ep}"
        );
        let keys = KltOptions {
            tensor: KltTensor::Keys,
            ..KltOptions::default()
        };
        let wk = fit(bits, keys);
        let pk = fit(
            bits,
            KltOptions {
                weighted: false,
                ..keys
            },
        );
        let (ew, ep) = (score_err(&coded(&wk, 0)), score_err(&coded(&pk, 0)));
        assert!(ew < 0.8 * ep, "keys, {bits} bits: {ew} against plain {ep}");
    }
    // One budget per layer keeps the layer's total.
    let pooled = fit(
        3.0,
        KltOptions {
            per_layer: true,
            ..KltOptions::default()
        },
    );
    assert_eq!(pooled.effective_bits(), 3.0 + 16.0 / hd as f64);
    // Refusals: shapes, non-finite values, budgets, calibration data.
    let mut short = test.clone();
    assert!(k2
        .round_trip(0, 0, &mut short[..width * 3 + 1], 3, n_kv, hd)
        .is_err());
    assert!(k2
        .round_trip(c.n_layers, 0, &mut short, 64, n_kv, hd)
        .is_err());
    assert!(k2
        .round_trip(usize::MAX, 0, &mut short, 64, n_kv, hd)
        .is_err());
    short[7] = f32::NAN;
    assert!(k2.round_trip(0, 0, &mut short, 64, n_kv, hd).is_err());
    let single = std::slice::from_ref(&cap);
    for bad in [-1.0, 9.0, f64::NAN] {
        assert!(fit_on(single, bad, plain).is_err());
    }
    assert!(fit_on(&[], 2.0, plain).is_err());
    let edit = |f: &dyn Fn(&mut Capture)| {
        let mut x = cap.clone();
        f(&mut x);
        x
    };
    let few = edit(&|x| {
        x.tokens.truncate(20);
        for l in &mut x.layers {
            l.q.truncate(20 * n_q * hd);
            l.k.truncate(20 * width);
            l.v.truncate(20 * width);
        }
    });
    assert!(fit_on(std::slice::from_ref(&few), 2.0, plain).is_err());
    // One row short in one layer: only the size check refuses it.
    let ragged = edit(&|x| x.layers[1].v.truncate(width * (t - 1)));
    assert!(fit_on(std::slice::from_ref(&ragged), 2.0, plain).is_err());
    let nan = edit(&|x| x.layers[0].v[3] = f32::INFINITY);
    assert!(fit_on(std::slice::from_ref(&nan), 2.0, plain).is_err());
    let silent = edit(&|x| x.layers.iter_mut().for_each(|l| l.q.fill(0.0)));
    let keys = KltOptions {
        tensor: KltTensor::Keys,
        ..KltOptions::default()
    };
    assert!(fit_on(std::slice::from_ref(&silent), 2.0, keys).is_err());
}
