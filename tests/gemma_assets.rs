//! The opt-in Gemma 3 270M asset (`scripts/fetch-assets.sh --gemma`):
//! its GGUF parses and every tensor dequantizes with the evaluation crate's
//! own reader. Skipped with a message when the file is absent (it is
//! fetched only on request, under the Gemma Terms of Use).

use kvq_eval::assets;
use kvq_eval::gguf::{GgmlType, Gguf};

const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";

#[test]
fn gemma_gguf_parses_and_dequantizes() {
    let path = assets::path(GEMMA);
    if !path.exists() {
        eprintln!("SKIPPED: {GEMMA} is absent (scripts/fetch-assets.sh --gemma fetches it)");
        return;
    }
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "gemma3");
    assert_eq!(g.get_usize("gemma3.block_count").unwrap(), 18);
    assert_eq!(g.get_usize("gemma3.attention.head_count_kv").unwrap(), 1);
    assert_eq!(g.get_usize("gemma3.attention.key_length").unwrap(), 256);
    // The norms the k_norm study is about, in every block.
    for b in 0..18 {
        for t in ["attn_k_norm", "attn_q_norm"] {
            assert!(
                g.tensor(&format!("blk.{b}.{t}.weight")).is_some(),
                "blk.{b}.{t}"
            );
        }
    }
    let mut types = std::collections::BTreeSet::new();
    let names: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
    for n in &names {
        let (info, x) = g.dequantize(n).unwrap();
        assert_eq!(x.len() as u64, info.n_elements(), "{n}");
        assert!(x.iter().all(|v| v.is_finite()), "{n}: non-finite weights");
        types.insert(format!("{:?}", info.ty));
    }
    eprintln!("{} tensors of types {types:?}", names.len());
    // One tensor of each quantized type against the `gguf` PyPI package's
    // numpy dequantizers (`scripts/gguf_sums.py`: gguf 0.19.0, sums and
    // sums of squares in f64).
    let pinned = [
        ("token_embd.weight", -27668.368624, 278708.591008),
        ("blk.0.attn_k.weight", 32.072464, 256.299401),
        ("blk.0.attn_output.weight", -1.833076, 930.299264),
        ("blk.0.ffn_down.weight", 6.480194, 610.707278),
    ];
    for (n, sum, sq) in pinned {
        let (_, x) = g.dequantize(n).unwrap();
        let s: f64 = x.iter().map(|&v| v as f64).sum();
        let q: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
        assert!(
            (s - sum).abs() < 1e-6 * (1.0 + sum.abs()) + 1e-3,
            "{n}: sum {s} against {sum}"
        );
        assert!(
            (q - sq).abs() < 1e-6 * sq,
            "{n}: sum of squares {q} against {sq}"
        );
    }
    assert!(types.contains(&format!("{:?}", GgmlType::Q4_K)));
}
