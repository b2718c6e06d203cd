//! The candle engine (`kvq_eval::engine`): a Llama forward pass in candle
//! ops with candle's own KV cache or kvq's. At full precision the two give
//! the same logits to f32 rounding, and both the reference model's; with a
//! 4-bit kvq cache the logits move by what the format costs, no more.
#![cfg(feature = "mistralrs")]

mod common;

use candle_core::DType;
use kvq_eval::engine::{last_row, max_abs_diff, Caches, CandleLlama};
use kvq_eval::model::{Activation, Config, DenseStore, Hooks, Model, RopeStyle};

fn tiny(rope_style: RopeStyle) -> Model {
    let cfg = Config {
        n_layers: 3,
        d_model: 64,
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 32,
        ffn_dim: 64,
        vocab_size: 97,
        rope_base: 10_000.0,
        rope_dim: 32,
        rope_style,
        rms_eps: 1e-5,
        ctx_len: 256,
        activation: Activation::Silu,
        embed_scale: 1.0,
        sliding: None,
    };
    Model::random(cfg, 5, false)
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = kvq_eval::model::SplitMix64(9);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Logits `[n, vocab]` of the reference model (ndarray), one prefill.
fn reference(m: &Model, toks: &[u32]) -> Vec<f32> {
    let mut store = DenseStore::for_config(&m.cfg);
    let h = m
        .forward(toks, 0, &mut store, &mut Hooks::default())
        .unwrap();
    m.logits(h.view()).iter().copied().collect()
}

fn flat(t: &candle_core::Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn candle_and_kvq_caches_give_the_reference_logits() {
    for style in [RopeStyle::Adjacent, RopeStyle::Halves] {
        let m = tiny(style);
        let mut e = CandleLlama::from_model(&m).unwrap();
        let toks = tokens(40, m.cfg.vocab_size);
        let want = reference(&m, &toks);
        let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
        // A 30-token prefill, then 10 decode steps, on each cache.
        let mut run = |mut caches: Caches| {
            let mut out = flat(&e.forward(&toks[..30], 0, &mut caches).unwrap());
            for (i, &t) in toks[30..].iter().enumerate() {
                out.extend(flat(&e.forward(&[t], 30 + i, &mut caches).unwrap()));
            }
            (out, caches.bytes())
        };
        let (candle32, _) = run(Caches::candle(&m.cfg, DType::F32));
        let (exact, exact_bytes) = run(Caches::kvq(&m.cfg, |c| c).unwrap());
        let tol = 2e-5 * scale;
        assert!(
            common::max_abs_diff(&candle32, &want) < tol,
            "{style:?}: candle vs reference"
        );
        assert!(
            common::max_abs_diff(&exact, &candle32) < tol,
            "{style:?}: kvq vs candle"
        );
        assert_eq!(exact_bytes, m.cfg.n_layers * 40 * 2 * m.cfg.kv_width() * 4);
        // f16 K/V in candle, 4-bit KIVI in kvq: close, not equal.
        let (candle16, _) = run(Caches::candle(&m.cfg, DType::F16));
        let (k4, v4) = kvq::presets::kivi(4).unwrap();
        let (kivi, kivi_bytes) = run(Caches::kvq(&m.cfg, |c| c.keys(k4).values(v4)).unwrap());
        let d16 = common::max_abs_diff(&candle16, &want);
        let d4 = common::max_abs_diff(&kivi, &want);
        assert!(d16 > 0.0 && d16 < 1e-2 * scale, "{style:?}: f16 {d16}");
        assert!(
            d4 > d16 && d4 < 0.2 * scale,
            "{style:?}: KIVI-4 {d4} against f16 {d16}"
        );
        assert!(
            kivi_bytes < exact_bytes / 4,
            "{kivi_bytes} vs {exact_bytes}"
        );
    }
}

#[test]
fn the_engine_refuses_what_it_does_not_run() {
    let mut m = tiny(RopeStyle::Adjacent);
    m.cfg.activation = Activation::GeluTanh;
    assert!(CandleLlama::from_model(&m).is_err());
    let m = tiny(RopeStyle::Adjacent);
    let mut e = CandleLlama::from_model(&m).unwrap();
    let mut wrong = Caches::candle(&m.cfg, DType::F32);
    wrong.layers.pop();
    assert!(e.forward(&[1, 2], 0, &mut wrong).is_err());
    // A decode step after a prefill is the longer prefill's last row.
    let mut caches = Caches::kvq(&m.cfg, |c| c).unwrap();
    let last = last_row(&e.forward(&[1, 2, 3], 0, &mut caches).unwrap()).unwrap();
    assert_eq!(last.len(), m.cfg.vocab_size);
    let a = e.forward(&[4], 3, &mut caches).unwrap();
    let mut again = Caches::kvq(&m.cfg, |c| c).unwrap();
    let b = e.forward(&[1, 2, 3, 4], 0, &mut again).unwrap();
    let b_last = b.get(3).unwrap().unsqueeze(0).unwrap();
    assert!(max_abs_diff(&a, &b_last).unwrap() < 1e-4);
}
