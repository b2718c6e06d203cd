//! Study B on real K/V: which grouping axis suits keys and values, judged by
//! reconstruction error *and* by error where the cache is used.
//!
//! ```text
//! cargo run --release --example axes -- [--model smollm2|gemma|PATH] [--domains austen,code] [--bits 2,3,4]
//! ```
//!
//! Captures the full-precision Q/K/V of SmolLM2-135M (or `--model`) on the first 512-token
//! window of each corpus, then quantizes only the keys (values exact) or only
//! the values (keys exact) per-token vs per-channel (groups of 32 channels
//! or 32 tokens, f16 scale and zero), and reports, averaged over all 30
//! layers and 9 query heads with a causal mask: relative reconstruction
//! error, attention KL, and relative error of the attention output.

use clap::Parser;
use kvq::metrics::{layer_errors, AttnShape, ErrorSummary, MetricsConfig};
use kvq::{Axis, Group, KvQuantizer, QuantScheme, UniformQuantizer};

use crate::ppl::capture_window;
use crate::report::{Align, Table};
use crate::BoxError;

/// Which grouping axis suits keys and values (study B), judged by
/// reconstruction error and by error where the cache is used.
///
/// Captures the full-precision Q/K/V of SmolLM2-135M on the first 512-token
/// window of each corpus, quantizes only the keys or only the values
/// per-token vs per-channel (groups of 32), and reports, averaged over all
/// layers and query heads with a causal mask: relative reconstruction
/// error, attention KL, and relative error of the attention output.
#[derive(Debug, Clone, Parser)]
#[command(name = "axes")]
pub struct Args {
    /// GGUF model: smollm2, gemma (fetched with scripts/fetch-assets.sh --gemma), or a path.
    #[arg(long, value_name = "smollm2|gemma|PATH", default_value = "smollm2")]
    pub model: std::path::PathBuf,
    /// Corpora: austen, code, or paths.
    #[arg(
        long,
        value_name = "D,D",
        value_delimiter = ',',
        default_value = "austen,code"
    )]
    pub domains: Vec<String>,
    /// Bit widths to compare.
    #[arg(
        long,
        value_name = "B,B",
        value_delimiter = ',',
        default_value = "2,3,4"
    )]
    pub bits: Vec<u8>,
}

/// Run the program.
pub fn run(args: Args) -> Result<(), BoxError> {
    let path = crate::assets::model(&args.model);
    crate::assets::ensure_model(&path, true)?;
    let super::Loaded {
        tok, model, bos, ..
    } = super::load(&path)?;
    let c = model.cfg.clone();
    let (nq, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
    let shape = AttnShape::new(nq, nkv, hd)?;
    let mcfg = MetricsConfig::new().with_causal(0);
    use Align::{Left, Right};
    let mut table = Table::new(&[
        ("domain", Left),
        ("tensor", Left),
        ("bits", Right),
        ("axis", Left),
        ("recon rel", Right),
        ("attn KL", Right),
        ("output rel", Right),
    ]);
    for d in &args.domains {
        let text = std::fs::read_to_string(crate::assets::corpus(d))?;
        let cut = text
            .char_indices()
            .nth(16 * 512)
            .map_or(text.len(), |(i, _)| i);
        let ids = tok.encode(&text[..cut])?;
        let first = ids
            .get(..512)
            .ok_or_else(|| format!("{d}: fewer than 512 tokens"))?;
        let cap = capture_window(&model, &crate::ppl::with_bos(first, bos))?;
        for tensor in ["keys", "values"] {
            for &b in &args.bits {
                for axis in [Axis::PerToken, Axis::PerChannel] {
                    let q = UniformQuantizer::new(
                        QuantScheme::new(b, axis, Group::Size(32))?,
                        nkv,
                        hd,
                    )?;
                    let mut layers = Vec::new();
                    for l in &cap.layers {
                        let t = l.k.len() / (nkv * hd);
                        let (kh, vh) = if tensor == "keys" {
                            (q.roundtrip(&l.k, t)?, l.v.clone())
                        } else {
                            (l.k.clone(), q.roundtrip(&l.v, t)?)
                        };
                        layers.push(
                            layer_errors(shape, l.q.as_slice(), &l.k, &l.v, &kh, &vh, &mcfg)?
                                .summary,
                        );
                    }
                    let m = ErrorSummary::combine(&layers).mean;
                    let recon = if tensor == "keys" { m.k_rel } else { m.v_rel };
                    let name = if axis == Axis::PerToken {
                        "per-token"
                    } else {
                        "per-channel"
                    };
                    table.row([
                        d.clone(),
                        tensor.to_string(),
                        b.to_string(),
                        name.to_string(),
                        format!("{recon:.4}"),
                        format!("{:.2e}", m.kl),
                        format!("{:.4}", m.output_rel),
                    ]);
                }
            }
        }
    }
    print!("{table}");
    Ok(())
}
