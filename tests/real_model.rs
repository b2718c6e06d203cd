//! Tests against the real SmolLM2-135M model and corpora in `assets/`.
//!
//! Skipped (with a message) when the assets are absent; fetch them with
//! `scripts/fetch-assets.sh` (CI does). The test profile optimizes
//! dependencies (see `Cargo.toml`), so this runs in well under a minute with
//! a plain `cargo test`.
//!
//! Pinned values: `docs/RESULTS.md`. The 4-bit KIVI-style cache (keys
//! per-channel, values per-token, groups of 32, no residual window) must stay
//! within 5 % of the full-precision perplexity on the first window of each
//! corpus (measured: +1.6 % prose, see RESULTS.md).

mod common;

use kvq_eval::assets;
use kvq_eval::kvq_store::{CacheSpec, KvqStore};
use kvq_eval::model::{DenseStore, Hooks};
use kvq_eval::ppl::{
    capture_window, perplexity, perplexity_kl, EvalPath, Kl, PplOptions, Reference,
};
use kvq_eval::programs::sweep::{attention_kl, Config};

/// Full-precision perplexity of the first 512-token window, all predictions
/// and second half, as measured on x86-64 in f32 (`docs/RESULTS.md`).
/// Then KIVI-4's relative ppl change on that window and its mean
/// next-token KL against the full-precision run, and (prose only, to
/// keep the test short) the mean attention KL (nats, over layers) of
/// KIVI-4, q4_0 and Hadamard-rotated q4_0 on its captured Q/K/V: the
/// figures `docs/RESULTS.md` quotes for the first window, measured by this
/// test's own code.
const AUSTEN_W0: W0 = (
    21.8932,
    21.9000,
    0.01113,
    1.9404e-2,
    Some([6.1655e-3, 9.0024e-2, 2.4342e-2]),
);
const CODE_W0: W0 = (9.4716, 9.0365, 0.02510, 1.9080e-2, None);

/// First-window figures: full-precision ppl (all, second half), KIVI-4's
/// relative ppl change and mean next-token KL, and the attention KLs.
type W0 = (f64, f64, f64, f64, Option<[f64; 3]>);

#[test]
fn real_model_tokenizer_and_first_window_perplexity() {
    if !assets::present() {
        common::skip("the real-model test: assets missing, run scripts/fetch-assets.sh");
        return;
    }
    kvq_eval::init_threads();
    let kvq_eval::programs::Loaded {
        tok, model, bos, ..
    } = kvq_eval::programs::load(&assets::path(assets::MODEL)).unwrap();
    assert_eq!(bos, None, "SmolLM2 asks for no BOS");
    let cfg = &model.cfg;
    assert_eq!(
        (
            cfg.n_layers,
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim
        ),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((cfg.rope_base, cfg.rms_eps), (100_000.0, 1e-5));
    assert!(model.output.is_none(), "SmolLM2 ties its output head");

    for (name, file, want) in [
        ("austen", assets::AUSTEN, AUSTEN_W0),
        ("code", assets::CODE, CODE_W0),
    ] {
        let text = std::fs::read_to_string(assets::path(file)).unwrap();
        let ids = tok.encode(&text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "{name}: round trip");
        println!(
            "{name}: {} bytes -> {} tokens, round trip exact",
            text.len(),
            ids.len()
        );

        let mut store = DenseStore::for_config(cfg);
        let opts = PplOptions {
            n_tokens: 512,
            window: 512,
            path: EvalPath::Prefill,
            bos: None,
        };
        let mut reference = Reference::default();
        let (r, _) = perplexity_kl(
            &model,
            &ids,
            &mut store,
            &mut Hooks::default(),
            &opts,
            Kl::Record(&mut reference),
            |_, _| {},
        )
        .unwrap();
        let (all, half) = (r.all.ppl(), r.second_half.ppl());
        println!("{name}: first window ppl {all:.4} (second half {half:.4})");
        assert_eq!(r.all.count, 511);
        assert_eq!(r.second_half.count, 255);
        // Different GEMM kernels sum in different orders: allow 0.1 %.
        assert!(
            (all / want.0 - 1.0).abs() < 1e-3,
            "{name}: ppl {all} vs {}",
            want.0
        );
        assert!(
            (half / want.1 - 1.0).abs() < 1e-3,
            "{name}: ppl {half} vs {}",
            want.1
        );

        // The same window through kvq's 4-bit KIVI-style cache (fused kernels).
        let (k4, v4) = kvq::presets::kivi(4).unwrap();
        let spec = CacheSpec {
            keys: Some(k4),
            values: Some(v4),
            residual: 0,
            sinks: 0,
            key_rotation: kvq::Rotation::None,
            value_rotation: kvq::Rotation::None,
            int8: false,
            key_levels: None,
            value_levels: None,
            pre_rope: false,
            key_outliers: 0.0,
            value_outliers: 0.0,
        };
        // The window through a kvq store of `spec`: ppl and next-token KL.
        let run = |spec: CacheSpec| {
            let mut store = KvqStore::for_model(cfg, spec).unwrap();
            let (q, kl) = perplexity_kl(
                &model,
                &ids,
                &mut store,
                &mut Hooks::default(),
                &opts,
                Kl::Compare(&reference),
                |_, _| {},
            )
            .unwrap();
            (q, kl.unwrap())
        };
        let (q, kl) = run(spec);
        println!(
            "{name}: KIVI-4 first window next-token KL {:.5} (p99 {:.4}, same top-1 {:.2} %)",
            kl.mean,
            kl.p99,
            100.0 * kl.same_top1
        );
        // Pinned at the AVX-512 kernels' value. Kernels that sum in another
        // order re-round some later layers' keys and values (a flip of a
        // whole grid step), which moves one window's mean KL: measured
        // 0.01707 / 0.02031 / 0.01940 (portable / AVX2 / AVX-512) on
        // austen, 0.01887 / 0.01799 / 0.01908 on code, while over eight
        // windows the kernels agree to 2 % (docs/RESULTS.md). ±20 % holds
        // every backend; a kernel that loses precision moves it by
        // multiples.
        assert!(
            (kl.mean / want.3 - 1.0).abs() < 0.2,
            "{name}: KIVI-4 next-token KL {} vs {}",
            kl.mean,
            want.3
        );
        let q4 = q.all.ppl();
        let rel = q4 / all - 1.0;
        println!(
            "{name}: KIVI-4 first window ppl {q4:.4} ({:+.3} %)",
            rel * 100.0
        );
        // Within a quarter of its measured change or two points, whichever
        // is wider: kernels that sum in another order move a single
        // window's ppl by up to 1.3 points (austen: +0.01 / +1.31 / +1.11 %
        // portable / AVX2 / AVX-512; docs/RESULTS.md, noise floor); a
        // doubling of code's damage fails.
        let want_rel = want.2;
        assert!(
            (rel - want_rel).abs() < (0.25 * want_rel.abs()).max(0.02),
            "{name}: KIVI-4 costs {:+.3} %, measured {:+.3} %",
            rel * 100.0,
            want_rel * 100.0
        );

        // The same cache with keys stored before RoPE: the cache rotates
        // them, and per-channel blocks see unrotated channels. Its
        // next-token KL is pinned at the AVX-512 kernels' value (±20 %):
        // 25–35 % below KIVI-4's on prose, level with it on code's first
        // window (over 8 windows 12–17 % below: docs/RESULTS.md, keys
        // before RoPE). It moves with the kernels' rounding as KIVI-4's
        // does: 0.01259 / 0.01360 / 0.01449 (portable / AVX2 / AVX-512)
        // on prose, 0.01813 / 0.01734 / 0.01670 on code.
        let pre = CacheSpec {
            pre_rope: true,
            ..spec
        };
        let (_, pkl) = run(pre);
        println!(
            "{name}: KIVI-4 with pre-RoPE keys, first window next-token KL {:.5}",
            pkl.mean
        );
        let want_pre = if name == "austen" { 0.01449 } else { 0.01670 };
        assert!(
            (pkl.mean / want_pre - 1.0).abs() < 0.2,
            "{name}: pre-RoPE KIVI-4 next-token KL {} vs {want_pre}",
            pkl.mean
        );
        if name == "austen" {
            assert!(
                pkl.mean < 0.8 * kl.mean,
                "{name}: pre-RoPE KL {} is not a fifth below KIVI-4's {}",
                pkl.mean,
                kl.mean
            );
        }

        // Attention KL of the first window's real Q/K/V, per scheme.
        if let Some(pins) = want.4 {
            let cap = capture_window(&model, &ids[..512]).unwrap();
            let kl = |spec: CacheSpec| attention_kl(&cap, &Config::new("pin", spec)).unwrap();
            let q4_0 = kvq::presets::q4_0();
            let plain = CacheSpec {
                keys: Some(q4_0),
                values: Some(q4_0),
                ..CacheSpec::FULL
            };
            let rotated = CacheSpec {
                key_rotation: kvq::Rotation::Hadamard,
                value_rotation: kvq::Rotation::Hadamard,
                ..plain
            };
            let (kl_kivi, kl_q4, kl_hq4) = (kl(spec), kl(plain), kl(rotated));
            println!(
                "{name}: attention KL KIVI-4 {kl_kivi:.4e}, q4_0 {kl_q4:.4e}, H·q4_0 {kl_hq4:.4e}"
            );
            for (what, got, pinned) in [
                ("KIVI-4", kl_kivi, pins[0]),
                ("q4_0", kl_q4, pins[1]),
                ("H·q4_0", kl_hq4, pins[2]),
            ] {
                assert!(
                    (got / pinned - 1.0).abs() < 0.02,
                    "{name}: {what} attention KL {got:.4e}, measured {pinned:.4e}"
                );
            }
        }

        // And the full-precision kvq cache reproduces the dense store.
        let mut store =
            KvqStore::new(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, CacheSpec::FULL).unwrap();
        let f = perplexity(
            &model,
            &ids,
            &mut store,
            &mut Hooks::default(),
            &opts,
            |_, _| {},
        )
        .unwrap();
        assert!(
            (f.all.ppl() / all - 1.0).abs() < 1e-4,
            "{name}: kvq fp {} vs dense {all}",
            f.all.ppl()
        );
    }
}
