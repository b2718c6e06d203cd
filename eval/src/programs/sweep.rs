//! The sweep: perplexity of SmolLM2-135M (or Gemma 3 270M, `--model gemma`)
//! with kvq caches of many K/V schemes, on prose (Jane Austen) and code (the
//! Python standard library).
//!
//! ```text
//! cargo run --release --example sweep -- [--model smollm2|gemma|PATH]
//!     [--grid default|full|split|ladder|trap|codebook|prerope|budget|rotation|plan|fit|outliers|alloc|trellis|klt|widths]
//!     [--full] [--budgets B,B] [--calib austen|code|PATH]
//!     [--tokens N] [--window 512]
//!     [--domains austen,code] [--path prefill|decode] [--residual R] [--sinks S]
//!     [--out results] [--no-fetch] [--only SUBSTR,SUBSTR]
//! ```
//!
//! Grids ([`GridKind`]): `default` (17 caches), `full` (bits 2–8 × axis ×
//! group, and every other codec once), `split` (the K/V bit split at
//! equal budgets, 3–8 effective bits), `ladder` (granularity at 4 bits), `trap` (keys alone quantized
//! after `k_proj`, after `k_norm` and in the cache, after RoPE: the
//! measurement-point trap of a model with `k_norm`), `codebook` (the
//! codebook codecs — `iq4_nl`, NF4, Lloyd-Max, fp8 — plain and rotated, beside
//! the uniform grids of the same and half a bit more), `prerope` (per-channel
//! keys stored before RoPE against after it, 2–4 bits), `budget`
//! (per-channel keys with rotated Lloyd-Max values at 4.25–5 bits),
//! `rotation` (every uniform scheme with and without the Hadamard rotation),
//! `plan` (what `kvq::Planner` chooses from a held-out window at each
//! of `--budgets`: its per-layer allocation and its best single pair),
//! `fit` (codebooks fitted per layer to a held-out window, against the
//! Lloyd-Max tables they start from), `alloc` (a study: key channels at
//! widths fitted by query energy, against one width, [`crate::alloc`]),
//! `trellis` (a study: values in a trellis code against rotated Lloyd-Max
//! levels of the same bits, and key channels in it against the grid,
//! [`crate::trellis`]), `widths` (trellis key widths with one budget for
//! the model or in blocks of 256 tokens) and `klt` (a study: values and
//! keys in a basis fitted per head at per-channel widths, [`crate::klt`]).
//!
//! Fetches the assets with `scripts/fetch-assets.sh` when they are missing
//! (pip + apt, checked by sha256). For every domain and configuration it
//! runs the studies' protocol (non-overlapping 512-token windows, each from
//! an empty cache) and reports effective bits, compression against an f16
//! cache, perplexity, Δppl against the full-precision cache, the mean
//! attention KL of the first window (exact vs quantized attention over the
//! real Q/K/V, via `kvq::metrics`), and the next-token KL against the
//! full-precision run (mean, 99th percentile, same top-1 rate, as
//! `llama-perplexity --kl-divergence`; the baseline's distributions are
//! kept in memory, 4 bytes per vocabulary entry and prediction). Writes `sweep.csv`, `sweep.json` and
//! `sweep.svg` (Δppl against effective bits, every point labelled, each
//! domain's Pareto front drawn) into `--out`.
//!
//! The default grid (17 configurations × 2 domains × 4096 tokens) takes
//! about 11 minutes on 2 cores once built; `--full` sweeps
//! bits 2–8 × axis × group.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use kvq::{Axis, Codec, Group, Levels, QuantScheme, Rotation};
use serde::Serialize;

use crate::alloc::{ChannelBits, FitOptions};
use crate::capture::{Capture, LayerCapture};
use crate::klt::{KltCode, KltOptions, KltTensor};
use crate::kvq_store::{CacheSpec, CodecRoundTrip, KvqStore};
use crate::model::RoundTrip;
use crate::model::{Hooks, Model, QuantPoint};
use crate::ppl::{
    capture_window, perplexity_kl, with_bos, EvalPath, Kl, KlReport, PplOptions, Reference,
};
use crate::report::{self, Align, PlotPoint, Table};
use crate::trellis::TrellisCode;
use crate::BoxError;

/// Perplexity of SmolLM2-135M with kvq caches of many K/V schemes, on prose
/// (Jane Austen) and code (the Python standard library).
///
/// Fetches the assets with scripts/fetch-assets.sh when they are missing.
/// For every domain and configuration: effective bits, compression against
/// an f16 cache, perplexity (all predictions and second half of each
/// window), Δppl against the full-precision cache, the mean attention KL
/// of the first window, and the next-token KL against the full-precision
/// run (mean, 99th percentile, same top-1 rate). Writes sweep.csv, sweep.json and sweep.svg into
/// --out. The default grid takes about 11 minutes on 2 cores.
#[derive(Debug, Clone, Parser)]
#[command(name = "sweep")]
pub struct Args {
    /// GGUF model: smollm2, gemma (fetched with scripts/fetch-assets.sh --gemma), or a path.
    #[arg(long, value_name = "smollm2|gemma|PATH", default_value = "smollm2")]
    pub model: PathBuf,
    /// The grid of caches (see the module docs).
    #[arg(
        long,
        value_name = "default|full|split|ladder|trap|codebook|budget|prerope|rotation|plan|fit",
        default_value = "default"
    )]
    pub grid: GridKind,
    /// Shorthand for --grid full: bits 2–8 for keys and values × axis × group
    /// (8192 tokens unless --tokens).
    #[arg(long)]
    pub full: bool,
    /// Tokens per domain (default: 4096; 8192 with --full).
    #[arg(long, value_name = "N")]
    pub tokens: Option<usize>,
    /// Tokens per window; each window starts from an empty cache.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub window: usize,
    /// Corpora: austen, code, or paths.
    #[arg(
        long,
        value_name = "D,D",
        value_delimiter = ',',
        default_value = "austen,code"
    )]
    pub domains: Vec<String>,
    /// Feed each window as one block (prefill) or token by token (decode).
    #[arg(long, value_name = "prefill|decode", default_value = "prefill")]
    pub path: EvalPath,
    /// Most recent tokens kept in full precision.
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub residual: usize,
    /// First tokens kept in full precision (attention sinks).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub sinks: usize,
    /// Output directory (default: `<repo>/results`).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Fail instead of running scripts/fetch-assets.sh when assets are missing.
    #[arg(long)]
    pub no_fetch: bool,
    /// Only the configurations whose name contains one of these (the baseline always runs).
    #[arg(long, value_name = "SUBSTR,SUBSTR")]
    pub only: Option<String>,
    /// --grid plan: the budgets, mean effective bits.
    #[arg(
        long,
        value_name = "B,B",
        value_delimiter = ',',
        default_value = "3,3.5,4,4.5"
    )]
    pub budgets: Vec<f64>,
    /// --grid plan, fit, alloc and trellis: the corpora of the held-out calibration windows (from
    /// each, the window right after the tokens the sweep scores).
    #[arg(
        long,
        value_name = "D,D",
        value_delimiter = ',',
        default_value = "austen,code"
    )]
    pub calib: Vec<String>,
}

impl Args {
    /// The grid asked for (`--full` wins over `--grid`).
    pub fn grid_kind(&self) -> GridKind {
        if self.full {
            GridKind::Full
        } else {
            self.grid
        }
    }

    /// The perplexity settings these arguments ask for (`bos` from the model).
    pub fn ppl_options(&self, bos: Option<u32>) -> PplOptions {
        let long = !matches!(self.grid_kind(), GridKind::Default);
        PplOptions {
            n_tokens: self.tokens.unwrap_or(if long { 8192 } else { 4096 }),
            window: self.window,
            path: self.path,
            bos,
        }
    }
}

/// Which grid of caches the sweep runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GridKind {
    /// 17 caches: the main schemes, presets and rotations.
    Default,
    /// Bits {2,3,4,6,8}² × {per-token 32, per-token head, KIVI}, per-token
    /// vector groups at 2–4 bits, and every other codec: rotated per-token
    /// groups at each width, KIVI with keys before RoPE at 2–4 bits, the
    /// codebooks (`iq4_nl`, NF4, rotated Lloyd-Max at 2–4 bits) and fp8.
    Full,
    /// The K/V bit split at equal budgets: per-token groups of 32, average
    /// bits 2–7 split as (b−1, b+1), (b, b), (b+1, b−1).
    Split,
    /// Granularity at 4 bits: whole vector, head, 64, 32 per token, and
    /// per-channel keys.
    Ladder,
    /// Keys alone at 2–8 bits (per-token head and 32 groups), quantized
    /// after `k_proj`, after `k_norm` and after RoPE.
    Trap,
    /// The codebook codecs, plain and rotated, with uniform references.
    Codebook,
    /// Caches at 4.25–5 effective bits built from the best parts below 5
    /// bits: per-channel keys (groups of 32–128 tokens, 4 and 5 bits) with
    /// rotated Lloyd-Max values (3 and 4 bits, groups of 32 and 64), keys
    /// in the cache after RoPE and stored before it.
    Budget,
    /// Keys stored before RoPE ([`CacheSpec::pre_rope`]) or after it, at
    /// 2–4 bits, per-channel alone and with per-token values; per-token
    /// keys as the control.
    PreRope,
    /// Every uniform scheme with and without the Hadamard rotation:
    /// per-token groups at 2–8 bits, KIVI at 2–4 bits (values rotated, and
    /// both rotated), and ggml's `q8_0`, `q5_1`, `q5_0`, `q4_1`, `q4_0`.
    Rotation,
    /// Caches the planner ([`kvq::Planner`]) chooses from a held-out
    /// window ([`plan_grid`]): per budget, the per-layer allocation and the
    /// best single pair, keys stored before RoPE.
    Plan,
    /// Rotated codebooks fitted per layer and per K/V to held-out windows
    /// ([`fit_grid`]) beside the Lloyd-Max tables they start from: values
    /// alone, keys alone (query-weighted and not), and both at 3–4
    /// effective bits.
    Fit,
    /// Dense-and-sparse outliers ([`kvq::Codec::with_outliers`]): KIVI at
    /// 2–4 bits with and without them, keys before RoPE in large
    /// per-channel blocks with them beside rotated Lloyd-Max values, near
    /// 3 and 3.5 effective bits.
    Outliers,
    /// A study of key channels at different widths within a head
    /// ([`crate::alloc`], fitted on the held-out windows): keys before
    /// RoPE at the same per-channel grid, one width for every channel or
    /// widths by query energy, alone and beside rotated Lloyd-Max values.
    Alloc,
    /// A study of values in a bitshift trellis code ([`crate::trellis`])
    /// against rotated Lloyd-Max levels at the same bits, keys' channels in
    /// the same code along their tokens against the grid, and the two at
    /// 3.0 effective bits ([`trellis_grid`]).
    Trellis,
    /// Key widths by rotary pair in a trellis code with one budget for the
    /// whole model, or in blocks of 256 tokens, alone and beside trellis
    /// values ([`widths_grid`]).
    Widths,
    /// A study of values and keys coded in a basis fitted per layer and
    /// KV head ([`crate::klt`]: principal axes weighted by where the error
    /// lands, per-channel widths) against rotated Lloyd-Max and trellis
    /// values, and trellis key widths, at the same bits ([`klt_grid`]).
    Klt,
}

impl std::str::FromStr for GridKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "default" => Ok(GridKind::Default),
            "full" => Ok(GridKind::Full),
            "split" => Ok(GridKind::Split),
            "ladder" => Ok(GridKind::Ladder),
            "trap" => Ok(GridKind::Trap),
            "codebook" => Ok(GridKind::Codebook),
            "prerope" => Ok(GridKind::PreRope),
            "budget" => Ok(GridKind::Budget),
            "rotation" => Ok(GridKind::Rotation),
            "plan" => Ok(GridKind::Plan),
            "fit" => Ok(GridKind::Fit),
            "outliers" => Ok(GridKind::Outliers),
            "alloc" => Ok(GridKind::Alloc),
            "trellis" => Ok(GridKind::Trellis),
            "klt" => Ok(GridKind::Klt),
            "widths" => Ok(GridKind::Widths),
            _ => Err(format!(
                "unknown grid {s:?} (default, full, split, ladder, trap, codebook, prerope, \
                 budget, rotation, plan, fit, outliers, alloc, trellis, klt, widths)"
            )),
        }
    }
}

/// One cache configuration of the grid.
#[derive(Debug, Clone)]
pub struct Config {
    /// Its label in the table, files and plot.
    pub name: String,
    /// The cache.
    pub spec: CacheSpec,
    /// Where the keys are quantized: [`QuantPoint::AfterRope`] is the
    /// cache itself; at the other points the model round-trips its keys
    /// through the key codec there (every token, so no residual or sinks
    /// for keys) and the cache keeps them exact.
    pub key_point: QuantPoint,
    /// Per-layer key and value codecs, in place of `spec`'s (whose windows
    /// and RoPE placement still apply): a planned allocation.
    pub layers: Option<Vec<(Option<Codec>, Option<Codec>)>>,
    /// Keys round-tripped after `k_norm` at per-channel widths
    /// ([`crate::alloc`]) in place of any key codec: the cache keeps them
    /// exact.
    pub key_bits: Option<std::sync::Arc<ChannelBits>>,
    /// Keys round-tripped after RoPE in a fitted basis ([`crate::klt`])
    /// in place of any key codec: the cache keeps them exact.
    pub key_klt: Option<std::sync::Arc<KltCode>>,
    /// Values round-tripped at `v_proj` ([`ValueHook`]) in place of any
    /// value codec: the cache keeps them exact.
    pub value_code: Option<ValueHook>,
}

impl Config {
    /// The cache `spec`, keys quantized in the cache, one codec pair for
    /// every layer.
    pub fn new(name: impl Into<String>, spec: CacheSpec) -> Self {
        Config {
            name: name.into(),
            spec,
            key_point: QuantPoint::AfterRope,
            layers: None,
            key_bits: None,
            key_klt: None,
            value_code: None,
        }
    }

    /// Whether this is the full-precision baseline.
    pub fn is_baseline(&self) -> bool {
        self.layers.is_none()
            && self.key_bits.is_none()
            && self.key_klt.is_none()
            && self.value_code.is_none()
            && self.spec.keys.is_none()
            && self.spec.values.is_none()
    }

    /// Layer `l`'s key and value codecs.
    pub fn codecs(&self, l: usize) -> (Option<Codec>, Option<Codec>) {
        match &self.layers {
            Some(layers) => layers[l],
            None => (self.spec.key_codec(), self.spec.value_codec()),
        }
    }

    /// Effective bits of the quantized rows, K and V averaged over every
    /// layer (16 for a full-precision tensor).
    pub fn effective_bits(&self, n_layers: usize, n_kv: usize, hd: usize) -> f64 {
        // The built codec's layout: outlier entries count.
        let eb = |c: Option<Codec>| {
            c.map_or(16.0, |c| {
                c.build(n_kv, hd)
                    .map_or(f64::NAN, |b| b.layout().effective_bits())
            })
        };
        let sum: f64 = (0..n_layers)
            .map(|l| {
                let (k, v) = self.codecs(l);
                let kb = self
                    .key_bits
                    .as_ref()
                    .map_or(eb(k), |a| a.effective_bits(l));
                let kb = self.key_klt.as_ref().map_or(kb, |k| k.effective_bits());
                let vb = self
                    .value_code
                    .as_ref()
                    .map_or(eb(v), |t| t.effective_bits(hd));
                (kb + vb) / 2.0
            })
            .sum();
        sum / n_layers as f64
    }

    /// The store this configuration runs on.
    fn store(&self, cfg: &crate::model::Config, spec: CacheSpec) -> Result<KvqStore, kvq::Error> {
        match &self.layers {
            Some(layers) => KvqStore::for_model_layers(cfg, spec, layers),
            None => KvqStore::for_model(cfg, spec),
        }
    }

    /// The cache the store holds and the key round trip the model applies
    /// (keys quantized outside the cache, at the point the hook names).
    pub fn store_and_hook(&self) -> (CacheSpec, Option<(QuantPoint, KeyHook)>) {
        if let Some(k) = &self.key_klt {
            return (
                self.spec,
                Some((QuantPoint::AfterRope, KeyHook::Klt(k.clone()))),
            );
        }
        if let Some(bits) = &self.key_bits {
            return (
                self.spec,
                Some((QuantPoint::AfterKNorm, KeyHook::Widths(bits.clone()))),
            );
        }
        match (self.key_point, self.spec.key_codec()) {
            (QuantPoint::AfterRope, _) | (_, None) => (self.spec, None),
            (point, Some(codec)) => (
                CacheSpec {
                    keys: None,
                    ..self.spec
                },
                Some((point, KeyHook::Codec(CodecRoundTrip(codec)))),
            ),
        }
    }
}

/// The round trip a configuration applies to keys inside the model
/// ([`Config::store_and_hook`]): a codec's, or per-channel widths'.
#[derive(Debug, Clone)]
pub enum KeyHook {
    /// A key codec applied before the cache.
    Codec(CodecRoundTrip),
    /// Key channels at their own widths ([`crate::alloc`]).
    Widths(std::sync::Arc<ChannelBits>),
    /// Keys after RoPE in a fitted basis ([`crate::klt`]).
    Klt(std::sync::Arc<KltCode>),
}

impl RoundTrip for KeyHook {
    fn round_trip(
        &self,
        layer: usize,
        pos0: usize,
        x: &mut [f32],
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), String> {
        let rt: &dyn RoundTrip = match self {
            KeyHook::Codec(c) => c,
            KeyHook::Widths(w) => w.as_ref(),
            KeyHook::Klt(k) => k.as_ref(),
        };
        rt.round_trip(layer, pos0, x, n_tokens, n_kv_heads, head_dim)
    }
}

/// The round trip a configuration applies to values at `v_proj`: a trellis
/// code's or a fitted transform's.
#[derive(Debug, Clone)]
pub enum ValueHook {
    /// A bitshift trellis code ([`crate::trellis`]).
    Trellis(std::sync::Arc<TrellisCode>),
    /// A fitted basis at per-channel widths ([`crate::klt`]).
    Klt(std::sync::Arc<KltCode>),
}

impl ValueHook {
    /// Mean bits per stored value at `head_dim`.
    pub fn effective_bits(&self, head_dim: usize) -> f64 {
        match self {
            ValueHook::Trellis(t) => t.effective_bits(head_dim),
            ValueHook::Klt(k) => k.effective_bits(),
        }
    }
}

impl RoundTrip for ValueHook {
    fn round_trip(
        &self,
        layer: usize,
        pos0: usize,
        x: &mut [f32],
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), String> {
        let rt: &dyn RoundTrip = match self {
            ValueHook::Trellis(t) => t.as_ref(),
            ValueHook::Klt(k) => k.as_ref(),
        };
        rt.round_trip(layer, pos0, x, n_tokens, n_kv_heads, head_dim)
    }
}

fn s(bits: u8, axis: Axis, group: Group) -> QuantScheme {
    QuantScheme::new(bits, axis, group).expect("grid schemes are valid")
}

/// The symmetric per-token scheme a codebook takes.
fn sym(bits: u8, group: Group) -> QuantScheme {
    s(bits, Axis::PerToken, group)
        .with_mode(kvq::Mode::Symmetric)
        .expect("symmetric grid schemes are valid")
}

/// Rotated Lloyd-Max levels at `bits` on per-token groups of `group`.
fn gauss(bits: u8, group: usize) -> Codec {
    Codec::codebook(sym(bits, Group::Size(group)), Levels::Gauss).with_rotation(Rotation::Hadamard)
}

/// `c` with keys and values rotated, named `H·…`.
fn rotated(mut c: Config) -> Config {
    c.name = format!("H·{}", c.name);
    c.spec.key_rotation = Rotation::Hadamard;
    c.spec.value_rotation = Rotation::Hadamard;
    c
}

/// The grid: the full-precision baseline first, then the caches of `kind`
/// ([`GridKind`]); every cache with `residual` and `sinks`.
pub fn grid(kind: GridKind, residual: usize, sinks: usize) -> Vec<Config> {
    let mk = |name: String, k: Option<QuantScheme>, v: Option<QuantScheme>| {
        Config::new(
            name,
            CacheSpec {
                keys: k,
                values: v,
                residual,
                sinks,
                ..CacheSpec::FULL
            },
        )
    };
    // Per-channel keys as they are, rotated per-token values.
    let rotated_values = |mut c: Config| {
        c.name = format!("{} H·V", c.name);
        c.spec.value_rotation = Rotation::Hadamard;
        c
    };
    let pt = |b, g| s(b, Axis::PerToken, g);
    let pc = |b, g| s(b, Axis::PerChannel, g);
    let mut g = vec![mk("fp32 (baseline)".into(), None, None)];
    match kind {
        GridKind::Default => {}
        // Planned or fitted in `run`, which has the model to calibrate on.
        GridKind::Plan
        | GridKind::Fit
        | GridKind::Alloc
        | GridKind::Trellis
        | GridKind::Klt
        | GridKind::Widths => return g,
        GridKind::Rotation => {
            let (g32, g64) = (Group::Size(32), Group::Size(64));
            let mut plain = Vec::new();
            for (b, gname, grp) in [
                (8u8, "32", g32),
                (6, "32", g32),
                (4, "32", g32),
                (4, "64", g64),
                (4, "head", Group::Head),
                (3, "32", g32),
                (2, "32", g32),
            ] {
                plain.push(mk(
                    format!("K{b}/V{b} pt{gname}"),
                    Some(pt(b, grp)),
                    Some(pt(b, grp)),
                ));
            }
            let ggml = [
                ("q8_0", kvq::presets::q8_0()),
                ("q5_1", kvq::presets::q5_1()),
                ("q5_0", kvq::presets::q5_0()),
                ("q4_1", kvq::presets::q4_1()),
                ("q4_0", kvq::presets::q4_0()),
            ];
            for (name, p) in ggml {
                plain.push(mk(format!("K/V {name}"), Some(p), Some(p)));
            }
            for c in plain {
                g.push(c.clone());
                g.push(rotated(c));
            }
            for b in [4u8, 3, 2] {
                let kivi = mk(
                    format!("K{b}/V{b} KIVI pc32/pt32"),
                    Some(pc(b, g32)),
                    Some(pt(b, g32)),
                );
                g.push(kivi.clone());
                g.push(rotated_values(kivi.clone()));
                g.push(rotated(kivi));
            }
            return g;
        }
        GridKind::Full => return full_grid(g, mk),
        GridKind::Outliers => {
            let g32 = Group::Size(32);
            // KIVI with outliers in keys and values, beside the plain one.
            for b in [2u8, 3, 4] {
                let kivi = mk(
                    format!("K{b}/V{b} KIVI pc32/pt32"),
                    Some(pc(b, g32)),
                    Some(pt(b, g32)),
                );
                for f in [0.0, 0.005, 0.01] {
                    let mut c = kivi.clone();
                    if f > 0.0 {
                        c.name = format!("{} +o{}%", c.name, f * 100.0);
                        c.spec.key_outliers = f;
                        c.spec.value_outliers = f;
                    }
                    g.push(c);
                }
                // Outliers in the keys alone: what the value entries add.
                if b < 4 {
                    let mut c = kivi.clone();
                    c.name = format!("{} +o1% keys", c.name);
                    c.spec.key_outliers = 0.01;
                    g.push(c);
                }
            }
            // Keys before RoPE in per-channel blocks of 64 and 128 tokens,
            // with outliers, beside rotated Lloyd-Max values.
            for (kb, kg, f, vb) in [
                (2u8, 128usize, 0.01, 3u8),
                (2, 64, 0.01, 3),
                (2, 128, 0.02, 3),
                (3, 128, 0.0, 2),
                (3, 128, 0.005, 2),
                (3, 128, 0.01, 2),
                (3, 64, 0.01, 3),
                (3, 128, 0.01, 3),
                (4, 128, 0.01, 3),
            ] {
                let o = if f > 0.0 {
                    format!(" +o{}%", f * 100.0)
                } else {
                    String::new()
                };
                let mut c = mk(
                    format!("K{kb} pc{kg}{o} / H·V gauss{vb} pt32 @pre-RoPE"),
                    Some(pc(kb, Group::Size(kg))),
                    None,
                );
                c.spec.key_outliers = f;
                c.spec.values = Some(sym(vb, g32));
                c.spec.value_levels = Some(Levels::Gauss);
                c.spec.value_rotation = Rotation::Hadamard;
                c.spec.pre_rope = true;
                g.push(c);
            }
            return g;
        }
        GridKind::Split => {
            for b in 2u8..=7 {
                for (kb, vb) in [(b - 1, b + 1), (b, b), (b + 1, b - 1)] {
                    let g32 = Group::Size(32);
                    g.push(mk(
                        format!("K{kb}/V{vb} pt32"),
                        Some(pt(kb, g32)),
                        Some(pt(vb, g32)),
                    ));
                }
            }
            return g;
        }
        GridKind::Ladder => {
            for (gname, grp) in [
                ("vector", Group::Vector),
                ("head", Group::Head),
                ("64", Group::Size(64)),
                ("32", Group::Size(32)),
            ] {
                g.push(mk(
                    format!("K4/V4 pt{gname}"),
                    Some(pt(4, grp)),
                    Some(pt(4, grp)),
                ));
            }
            g.push(mk(
                "K4/V4 KIVI pc32/pt32".into(),
                Some(pc(4, Group::Size(32))),
                Some(pt(4, Group::Size(32))),
            ));
            return g;
        }
        GridKind::Codebook => {
            let g32 = Group::Size(32);
            let sym32 = |b| sym(b, g32);
            // (name, key scheme and levels, value scheme and levels)
            let cb =
                |name: &str, k: (QuantScheme, Option<Levels>), v: (QuantScheme, Option<Levels>)| {
                    let mut c = mk(name.into(), Some(k.0), Some(v.0));
                    c.spec.key_levels = k.1;
                    c.spec.value_levels = v.1;
                    c
                };
            let q4_0 = kvq::presets::q4_0();
            let iq4 = (q4_0, Some(Levels::Iq4Nl));
            let nf4 = (sym32(4), Some(Levels::Nf4));
            let (ga4, ga3, ga2) = (
                (sym32(4), Some(Levels::Gauss)),
                (sym32(3), Some(Levels::Gauss)),
                (sym32(2), Some(Levels::Gauss)),
            );
            // Uniform references: 5.0 bits, 4.5 (ggml q4_0), 4.0.
            g.push(mk(
                "K4/V4 KIVI pc32/pt32".into(),
                Some(pc(4, g32)),
                Some(pt(4, g32)),
            ));
            g.push(rotated(mk(
                "K4/V4 pt32".into(),
                Some(pt(4, g32)),
                Some(pt(4, g32)),
            )));
            g.push(mk("K/V q4_0".into(), Some(q4_0), Some(q4_0)));
            g.push(rotated(mk("K/V q4_0".into(), Some(q4_0), Some(q4_0))));
            g.push(rotated(mk(
                "K3/V3 pt32".into(),
                Some(pt(3, g32)),
                Some(pt(3, g32)),
            )));
            // Codebooks at 4.5 bits, plain and rotated.
            for (name, l) in [("iq4_nl", iq4), ("nf4", nf4), ("gauss4", ga4)] {
                g.push(cb(&format!("K/V {name}"), l, l));
                g.push(rotated(cb(&format!("K/V {name}"), l, l)));
            }
            // Lloyd-Max below 4.5 bits, rotated.
            g.push(rotated(cb("K gauss4/V gauss3", ga4, ga3)));
            g.push(rotated(cb("K/V gauss3", ga3, ga3)));
            g.push(rotated(cb("K gauss3/V gauss2", ga3, ga2)));
            g.push(rotated(cb("K/V gauss2", ga2, ga2)));
            // fp8 with a scale per head and token (8.125 bits at head dim 128).
            let head8 = sym(8, Group::Head);
            for (name, l) in [("e4m3", Levels::E4m3), ("e5m2", Levels::E5m2)] {
                g.push(cb(
                    &format!("K/V {name} pthead"),
                    (head8, Some(l)),
                    (head8, Some(l)),
                ));
            }
            // Per-channel keys (KIVI, unrotated) with rotated Lloyd-Max values.
            for (name, kb, v) in [("gauss4", 4, ga4), ("gauss3", 4, ga3), ("gauss3", 3, ga3)] {
                let mut c = cb(&format!("K{kb} pc32 / H·V {name}"), (pc(kb, g32), None), v);
                c.spec.value_rotation = Rotation::Hadamard;
                g.push(c);
            }
            return g;
        }
        GridKind::Budget => {
            let gauss = |b, grp| (sym(b, grp), Some(Levels::Gauss));
            g.push(mk(
                "K4/V4 KIVI pc32/pt32".into(),
                Some(pc(4, Group::Size(32))),
                Some(pt(4, Group::Size(32))),
            ));
            let (g32, g64) = (Group::Size(32), Group::Size(64));
            for (kb, kg, vb, vg) in [
                (4u8, 32usize, 4u8, g32),
                (4, 32, 4, g64),
                (4, 64, 4, g32),
                (4, 128, 4, g32),
                (4, 32, 3, g32),
                (5, 64, 3, g32),
                (5, 32, 3, g64),
            ] {
                let vname = match vg {
                    Group::Size(n) => format!("pt{n}"),
                    _ => unreachable!("value groups are sizes"),
                };
                let mut c = mk(
                    format!("K{kb} pc{kg} / H·V gauss{vb} {vname}"),
                    Some(pc(kb, Group::Size(kg))),
                    None,
                );
                let (v, l) = gauss(vb, vg);
                c.spec.values = Some(v);
                c.spec.value_levels = l;
                c.spec.value_rotation = Rotation::Hadamard;
                // The same keys stored before RoPE (per-channel groups
                // then see channels that RoPE has not rotated).
                let mut pre = c.clone();
                pre.name = format!("{} @pre-RoPE", c.name);
                pre.spec.pre_rope = true;
                g.push(c);
                g.push(pre);
            }
            return g;
        }
        GridKind::PreRope => {
            let g32 = Group::Size(32);
            for b in [2u8, 3, 4] {
                for (kname, k, v) in [
                    (format!("K{b} pc32"), pc(b, g32), None),
                    (format!("K{b} pt32"), pt(b, g32), None),
                    (
                        format!("K{b}/V{b} KIVI pc32/pt32"),
                        pc(b, g32),
                        Some(pt(b, g32)),
                    ),
                ] {
                    for (pname, pre) in [("pre-RoPE", true), ("post-RoPE", false)] {
                        let mut c = mk(format!("{kname} @{pname}"), Some(k), v);
                        c.spec.pre_rope = pre;
                        g.push(c);
                    }
                }
            }
            return g;
        }
        GridKind::Trap => {
            for b in [2u8, 3, 4, 6, 8] {
                for (gname, grp) in [("head", Group::Head), ("32", Group::Size(32))] {
                    for (pname, point) in [
                        ("k_proj", QuantPoint::AfterKProj),
                        ("k_norm", QuantPoint::AfterKNorm),
                        ("rope", QuantPoint::AfterRope),
                    ] {
                        let mut c = mk(format!("K{b} pt{gname} @{pname}"), Some(pt(b, grp)), None);
                        c.key_point = point;
                        g.push(c);
                    }
                }
            }
            return g;
        }
    }
    {
        let g32 = Group::Size(32);
        let g64 = Group::Size(64);
        g.push(mk("K8/V8 pt32".into(), Some(pt(8, g32)), Some(pt(8, g32))));
        g.push(mk(
            "K4/V4 KIVI pc32/pt32".into(),
            Some(pc(4, g32)),
            Some(pt(4, g32)),
        ));
        // The same cache read through the opt-in int8 kernels (int8 query;
        // int8 weights where one query per KV head reaches them).
        let mut kivi_i8 = mk(
            "K4/V4 KIVI pc32/pt32 int8 kernels".into(),
            Some(pc(4, g32)),
            Some(pt(4, g32)),
        );
        kivi_i8.spec.int8 = true;
        g.push(kivi_i8);
        g.push(mk("K4/V4 pt32".into(), Some(pt(4, g32)), Some(pt(4, g32))));
        g.push(mk(
            "K4/V4 pt-vector".into(),
            Some(pt(4, Group::Vector)),
            Some(pt(4, Group::Vector)),
        ));
        g.push(mk("K6/V4 pt64".into(), Some(pt(6, g64)), Some(pt(4, g64))));
        g.push(mk("K4/V6 pt64".into(), Some(pt(4, g64)), Some(pt(6, g64))));
        g.push(mk("K4/V8 pt32".into(), Some(pt(4, g32)), Some(pt(8, g32))));
        g.push(mk(
            "K2/V2 KIVI pc32/pt32".into(),
            Some(pc(2, g32)),
            Some(pt(2, g32)),
        ));
        g.push(mk(
            "K3/V3 KIVI pc32/pt32".into(),
            Some(pc(3, g32)),
            Some(pt(3, g32)),
        ));
        // llama.cpp's q4_0 cache type, value for value, plain and rotated
        // (llama.cpp rotates its quantized caches by default).
        let q4_0 = kvq::presets::q4_0();
        g.push(mk("K/V q4_0".into(), Some(q4_0), Some(q4_0)));
        g.push(rotated(mk("K/V q4_0".into(), Some(q4_0), Some(q4_0))));
        // The randomized Hadamard rotation around per-token grids.
        for b in [4u8, 3] {
            g.push(rotated(mk(
                format!("K{b}/V{b} pt32"),
                Some(pt(b, g32)),
                Some(pt(b, g32)),
            )));
            g.push(rotated_values(mk(
                format!("K{b}/V{b} KIVI pc32/pt32"),
                Some(pc(b, g32)),
                Some(pt(b, g32)),
            )));
        }
    }
    g
}

/// [`GridKind::Full`] after the baseline `g`.
fn full_grid(
    mut g: Vec<Config>,
    mk: impl Fn(String, Option<QuantScheme>, Option<QuantScheme>) -> Config,
) -> Vec<Config> {
    let pt = |b, g| s(b, Axis::PerToken, g);
    let pc = |b, g| s(b, Axis::PerChannel, g);
    for kb in [2u8, 3, 4, 6, 8] {
        for vb in [2u8, 3, 4, 6, 8] {
            for (gname, grp) in [("32", Group::Size(32)), ("head", Group::Head)] {
                g.push(mk(
                    format!("K{kb}/V{vb} pt{gname}"),
                    Some(pt(kb, grp)),
                    Some(pt(vb, grp)),
                ));
            }
            g.push(mk(
                format!("K{kb}/V{vb} KIVI pc32/pt32"),
                Some(pc(kb, Group::Size(32))),
                Some(pt(vb, Group::Size(32))),
            ));
        }
    }
    for b in [2u8, 3, 4] {
        g.push(mk(
            format!("K{b}/V{b} pt-vector"),
            Some(pt(b, Group::Vector)),
            Some(pt(b, Group::Vector)),
        ));
    }
    // Every other codec: each per-token width rotated, KIVI with keys
    // before RoPE, the codebooks (rotated where they are meant to be) and
    // fp8, the same codec on both tensors.
    for b in [2u8, 3, 4, 6, 8] {
        g.push(rotated(mk(
            format!("K{b}/V{b} pt32"),
            Some(pt(b, Group::Size(32))),
            Some(pt(b, Group::Size(32))),
        )));
    }
    for b in [2u8, 3, 4] {
        let mut c = mk(
            format!("K{b}/V{b} KIVI pc32/pt32 @pre-RoPE"),
            Some(pc(b, Group::Size(32))),
            Some(pt(b, Group::Size(32))),
        );
        c.spec.pre_rope = true;
        g.push(c.clone());
        // The same with 1 % dense-and-sparse outliers in keys and values.
        c.name = format!("K{b}/V{b} KIVI pc32/pt32 +o1% @pre-RoPE");
        c.spec.key_outliers = 0.01;
        c.spec.value_outliers = 0.01;
        g.push(c);
    }
    let mut books = vec![
        (
            "K/V iq4_nl".to_owned(),
            kvq::presets::q4_0(),
            Levels::Iq4Nl,
            false,
        ),
        (
            "K/V nf4".to_owned(),
            sym(4, Group::Size(32)),
            Levels::Nf4,
            false,
        ),
        (
            "K/V e4m3 pthead".to_owned(),
            sym(8, Group::Head),
            Levels::E4m3,
            false,
        ),
        (
            "K/V e5m2 pthead".to_owned(),
            sym(8, Group::Head),
            Levels::E5m2,
            false,
        ),
    ];
    for b in [2u8, 3, 4] {
        books.push((
            format!("K/V gauss{b}"),
            sym(b, Group::Size(32)),
            Levels::Gauss,
            true,
        ));
    }
    for (name, scheme, levels, rotate) in books {
        let mut c = mk(name, Some(scheme), Some(scheme));
        c.spec.key_levels = Some(levels);
        c.spec.value_levels = Some(levels);
        g.push(if rotate { rotated(c) } else { c });
    }
    g
}

/// One result of the sweep (a line of `sweep.csv`, an element of
/// `sweep.json`'s `rows`).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Corpus.
    pub domain: String,
    /// Configuration name.
    pub config: String,
    /// Effective bits per element, K and V averaged.
    pub effective_bits: f64,
    /// 16 / effective bits.
    pub compression_vs_f16: f64,
    /// Perplexity over all predictions.
    pub ppl: f64,
    /// `ppl` minus the baseline's.
    pub delta_ppl: f64,
    /// Perplexity over the second half of each window.
    pub ppl_second_half: f64,
    /// `ppl_second_half` minus the baseline's.
    pub delta_ppl_second_half: f64,
    /// Mean attention KL on the first window (nats per position and head).
    pub attention_kl: f64,
    /// Mean KL divergence of the next-token distribution from the
    /// baseline's, every prediction (nats; `llama-perplexity
    /// --kl-divergence`).
    pub kl_mean: f64,
    /// The same over the second half of each window.
    pub kl_mean_second_half: f64,
    /// 99th percentile of the per-prediction KL (nats).
    pub kl_p99: f64,
    /// Share of predictions whose most likely token is the baseline's.
    pub same_top1: f64,
    /// Wall time of this configuration's perplexity run.
    pub seconds: f64,
}

/// The columns of `sweep.csv`, in order.
pub const CSV_COLUMNS: [&str; 14] = [
    "domain",
    "config",
    "effective_bits",
    "compression_vs_f16",
    "ppl",
    "delta_ppl",
    "ppl_second_half",
    "delta_ppl_second_half",
    "attention_kl",
    "kl_mean",
    "kl_mean_second_half",
    "kl_p99",
    "same_top1",
    "seconds",
];

/// `sweep.json`: the settings and the rows.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Model file name.
    pub model: String,
    /// The grid (`default`, `full`, `split`, `ladder`, `trap`, `codebook`,
    /// `prerope`, `budget`, `rotation`, `plan`, `fit`).
    pub grid: String,
    /// Tokens per domain.
    pub tokens: usize,
    /// Tokens per window.
    pub window: usize,
    /// `Prefill` or `Decode`.
    pub path: String,
    /// Full-precision recent tokens.
    pub residual: usize,
    /// Full-precision first tokens.
    pub sinks: usize,
    /// The results.
    pub rows: Vec<Row>,
    /// The per-layer codecs of the configurations that have them
    /// (`--grid plan`).
    pub allocations: Vec<Allocation>,
}

/// One configuration's codecs, layer by layer (an element of `sweep.json`'s
/// `allocations`).
#[derive(Debug, Clone, Serialize)]
pub struct Allocation {
    /// Configuration name.
    pub config: String,
    /// Per layer: the key codec's label, or `None` for full precision.
    pub keys: Vec<Option<String>>,
    /// Per layer: the value codec's label.
    pub values: Vec<Option<String>>,
}

/// Run the sweep: print the table and write `sweep.{csv,json,svg}`.
pub fn run(args: Args) -> Result<(), BoxError> {
    let model_path = crate::assets::model(&args.model);
    crate::assets::ensure_model(&model_path, !args.no_fetch)?;
    let t0 = Instant::now();
    let super::Loaded {
        tok,
        model,
        bos,
        name: model_name,
    } = super::load(&model_path)?;
    let opts = args.ppl_options(bos);
    let cfg = model.cfg.clone();
    let (n_layers, n_kv, hd, n_q) = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads);
    let kind = args.grid_kind();
    let mut configs = grid(kind, args.residual, args.sinks);
    match kind {
        GridKind::Plan => configs.extend(plan_grid(&model, &tok, &args, &opts)?),
        GridKind::Fit => configs.extend(fit_grid(&model, &tok, &args, &opts)?),
        GridKind::Alloc => configs.extend(alloc_grid(&model, &tok, &args, &opts)?),
        GridKind::Trellis => configs.extend(trellis_grid(&model, &tok, &args, &opts)?),
        GridKind::Klt => configs.extend(klt_grid(&model, &tok, &args, &opts)?),
        GridKind::Widths => configs.extend(widths_grid(&model, &tok, &args, &opts)?),
        _ => {}
    }
    if let Some(only) = &args.only {
        // Keep the baseline: Δppl needs it.
        configs.retain(|c| c.is_baseline() || only.split(',').any(|o| c.name.contains(o)));
    }
    eprintln!(
        "{model_name}: {n_layers} layers, {n_q}/{n_kv} heads, head_dim {hd}; loaded in {:.1}s; \
         {} configs x {} domains x {} tokens ({:?} path, residual {}, sinks {})",
        t0.elapsed().as_secs_f64(),
        configs.len(),
        args.domains.len(),
        opts.n_tokens,
        opts.path,
        args.residual,
        args.sinks
    );
    let windows = opts.n_tokens / opts.window.max(1);
    let progress = report::progress(
        (windows * configs.len() * args.domains.len()) as u64,
        "windows",
    );
    let mut rows = Vec::new();
    for domain in &args.domains {
        let text = std::fs::read_to_string(crate::assets::corpus(domain))?;
        let tokens = super::prefix_tokens(&tok, &text, opts.n_tokens)?;
        // Full-precision Q/K/V of the first window, for the attention KL.
        let first = tokens
            .get(..opts.window)
            .ok_or_else(|| format!("{domain}: fewer than {} tokens", opts.window))?;
        let cap = capture_window(&model, &with_bos(first, bos))?;
        let mut base: Option<(f64, f64)> = None;
        // The baseline's next-token distributions (it runs first).
        let mut reference = Reference::default();
        for c in &configs {
            let (store_spec, hook) = c.store_and_hook();
            let mut store = c.store(&model.cfg, store_spec)?;
            let mut hooks = Hooks {
                k: hook.as_ref().map(|(p, rt)| (*p, rt as &dyn RoundTrip)),
                v: c.value_code.as_ref().map(|t| t as &dyn RoundTrip),
                ..Hooks::default()
            };
            let t = Instant::now();
            progress.set_message(format!("{domain}: {}", c.name));
            let kl = if c.is_baseline() {
                Kl::Record(&mut reference)
            } else {
                Kl::Compare(&reference)
            };
            let (r, klr) = perplexity_kl(
                &model,
                &tokens,
                &mut store,
                &mut hooks,
                &opts,
                kl,
                |_, _| progress.inc(1),
            )?;
            let klr = klr.unwrap_or(KlReport {
                same_top1: 1.0,
                ..KlReport::default()
            });
            let (ppl, ppl2) = (r.all.ppl(), r.second_half.ppl());
            let (b, b2) = *base.get_or_insert((ppl, ppl2));
            let eb = c.effective_bits(n_layers, n_kv, hd);
            rows.push(Row {
                domain: domain.clone(),
                config: c.name.clone(),
                effective_bits: eb,
                compression_vs_f16: 16.0 / eb,
                ppl,
                delta_ppl: ppl - b,
                ppl_second_half: ppl2,
                delta_ppl_second_half: ppl2 - b2,
                // Keys quantized before RoPE are scored on the capture's
                // pre-RoPE keys; after `k_proj` of a model with `k_norm`
                // the capture has no keys to compare.
                attention_kl: match hook.as_ref().map(|h| h.0) {
                    None if c.spec.pre_rope => attention_kl_pre_rope(&cap, c, &model)?,
                    None => attention_kl(&cap, c)?,
                    Some(QuantPoint::AfterKNorm) => attention_kl_pre_rope(&cap, c, &model)?,
                    Some(QuantPoint::AfterRope) => attention_kl_hooked(&cap, c)?,
                    Some(_) => f64::NAN,
                },
                kl_mean: klr.mean,
                kl_mean_second_half: klr.mean_second_half,
                kl_p99: klr.p99,
                same_top1: klr.same_top1,
                seconds: t.elapsed().as_secs_f64(),
            });
        }
    }
    progress.finish();
    println!(
        "\n{model_name}, {} tokens per domain in windows of {} ({:?}{}), residual {}, sinks {}",
        opts.n_tokens,
        opts.window,
        opts.path,
        if bos.is_some() { ", BOS first" } else { "" },
        args.residual,
        args.sinks
    );
    print!("{}", table(&rows));
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| crate::repo_root().join("results"));
    std::fs::create_dir_all(&out)?;
    let file = model_path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    // The default run writes sweep.*; other models and grids get their own names.
    let stem = match (file == crate::assets::MODEL, kind) {
        (true, GridKind::Default) => "sweep".to_owned(),
        _ => format!(
            "sweep-{}-{}",
            if file == crate::assets::MODEL {
                "smollm2"
            } else if file == crate::assets::GEMMA {
                "gemma"
            } else {
                file.trim_end_matches(".gguf")
            },
            format!("{kind:?}").to_lowercase()
        ),
    };
    let report = Report {
        grid: format!("{kind:?}").to_lowercase(),
        model: file,
        tokens: opts.n_tokens,
        window: opts.window,
        path: format!("{:?}", opts.path),
        residual: args.residual,
        sinks: args.sinks,
        rows,
        allocations: configs
            .iter()
            .filter_map(|c| {
                let layers = c.layers.as_ref()?;
                let label = |x: &Option<Codec>| x.map(|c| c.label());
                Some(Allocation {
                    config: c.name.clone(),
                    keys: layers.iter().map(|l| label(&l.0)).collect(),
                    values: layers.iter().map(|l| label(&l.1)).collect(),
                })
            })
            .collect(),
    };
    std::fs::write(
        out.join(format!("{stem}.csv")),
        report::csv(&CSV_COLUMNS, &report.rows)?,
    )?;
    std::fs::write(out.join(format!("{stem}.json")), report::json(&report)?)?;
    std::fs::write(
        out.join(format!("{stem}.svg")),
        svg(&model_name, &report.rows)?,
    )?;
    println!(
        "\nwrote {}/{stem}.{{csv,json,svg}} in {:.0}s",
        out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The printed table, columns as wide as their longest cell.
pub fn table(rows: &[Row]) -> Table {
    use Align::{Left, Right};
    let mut t = Table::new(&[
        ("domain", Left),
        ("config", Left),
        ("eff.bits", Right),
        ("x f16", Right),
        ("ppl", Right),
        ("Δppl", Right),
        ("ppl 2nd½", Right),
        ("Δ 2nd½", Right),
        ("attn KL", Right),
        ("KL", Right),
        ("KL p99", Right),
        ("same top1", Right),
    ]);
    for r in rows {
        t.row([
            r.domain.clone(),
            r.config.clone(),
            format!("{:.3}", r.effective_bits),
            format!("{:.2}", r.compression_vs_f16),
            format!("{:.4}", r.ppl),
            format!("{:+.4}", r.delta_ppl),
            format!("{:.4}", r.ppl_second_half),
            format!("{:+.4}", r.delta_ppl_second_half),
            match r.attention_kl.is_nan() {
                true => "—".into(),
                false => format!("{:.2e}", r.attention_kl),
            },
            format!("{:.5}", r.kl_mean),
            format!("{:.4}", r.kl_p99),
            format!("{:.2}%", 100.0 * r.same_top1),
        ]);
    }
    t
}

/// `sweep.svg`: Δppl against effective bits of the quantized rows (the
/// baseline's 16 bits left out), one colour per domain.
pub fn svg(model: &str, rows: &[Row]) -> Result<String, String> {
    let points: Vec<PlotPoint> = rows
        .iter()
        .filter(|r| r.effective_bits < 15.0)
        .map(|r| PlotPoint {
            domain: r.domain.clone(),
            label: r.config.clone(),
            bits: r.effective_bits,
            delta: r.delta_ppl,
        })
        .collect();
    report::sweep_svg(
        &format!("{model}: Δppl vs effective bits (kvq cache)"),
        &points,
    )
}

/// Mean attention KL (nats per query position and head, over all layers)
/// between exact attention and attention over K/V quantized with `c`'s
/// codecs (every token quantized: no residual window), on the captured
/// first window with a causal mask. Keys are quantized as the cache stores
/// them (post-RoPE); see [`attention_kl_pre_rope`] for keys quantized before.
pub fn attention_kl(cap: &Capture, c: &Config) -> Result<f64, BoxError> {
    attention_kl_with(cap, c, |_, l, k| hat(&l.k, k, cap.n_kv_heads, cap.head_dim))
}

/// [`attention_kl`] with the keys quantized before RoPE (the capture's
/// pre-RoPE keys round-tripped through the key codec), then rotated by
/// `model`'s RoPE: what a pre-RoPE cache ([`CacheSpec::pre_rope`]) or a
/// round trip after `k_norm` attends over.
pub fn attention_kl_pre_rope(cap: &Capture, c: &Config, model: &Model) -> Result<f64, BoxError> {
    if !cap.has_k_pre_rope() {
        return Err("the capture has no pre-RoPE keys".into());
    }
    let (n_kv, hd) = (cap.n_kv_heads, cap.head_dim);
    let hook = c.store_and_hook().1;
    attention_kl_with(cap, c, |li, l, k| {
        let mut k = match &hook {
            Some((QuantPoint::AfterKNorm, rt)) => {
                let mut k = l.k_pre_rope.clone();
                let t = k.len() / (n_kv * hd);
                rt.round_trip(li, cap.pos0, &mut k, t, n_kv, hd)
                    .map_err(|what| kvq::Error::InvalidConfig {
                        op: "key round trip",
                        what,
                    })?;
                k
            }
            _ => hat(&l.k_pre_rope, k, n_kv, hd)?,
        };
        model.apply_rope(&mut k, n_kv * hd, cap.pos0, li);
        Ok(k)
    })
}

/// [`attention_kl`] with the keys through the configuration's round trip
/// after RoPE ([`Config::store_and_hook`]).
pub fn attention_kl_hooked(cap: &Capture, c: &Config) -> Result<f64, BoxError> {
    let (n_kv, hd) = (cap.n_kv_heads, cap.head_dim);
    let hook = c.store_and_hook().1;
    attention_kl_with(cap, c, |li, l, k| match &hook {
        Some((QuantPoint::AfterRope, rt)) => {
            let mut k = l.k.clone();
            let t = k.len() / (n_kv * hd);
            rt.round_trip(li, cap.pos0, &mut k, t, n_kv, hd)
                .map_err(|what| kvq::Error::InvalidConfig {
                    op: "key round trip",
                    what,
                })?;
            Ok(k)
        }
        _ => hat(&l.k, k, n_kv, hd),
    })
}

fn hat(x: &[f32], c: Option<Codec>, n_kv: usize, hd: usize) -> Result<Vec<f32>, kvq::Error> {
    match c {
        None => Ok(x.to_vec()),
        Some(c) => c.roundtrip(x, n_kv, hd),
    }
}

fn attention_kl_with(
    cap: &Capture,
    c: &Config,
    keys: impl Fn(usize, &LayerCapture, Option<Codec>) -> Result<Vec<f32>, kvq::Error>,
) -> Result<f64, BoxError> {
    use kvq::metrics::{layer_errors, AttnShape, MetricsConfig};
    if c.is_baseline() {
        return Ok(0.0);
    }
    let (n_q, n_kv, hd) = (cap.n_q_heads, cap.n_kv_heads, cap.head_dim);
    let shape = AttnShape::new(n_q, n_kv, hd)?;
    let cfg = MetricsConfig::new().with_causal(0);
    let mut total = 0.0;
    for (li, l) in cap.layers.iter().enumerate() {
        let (kc, vc) = c.codecs(li);
        // The KL of the attention weights does not see the values: a
        // value round trip outside the cache (`value_code`) is left out.
        let (kh, vh) = (keys(li, l, kc)?, hat(&l.v, vc, n_kv, hd)?);
        total += layer_errors(shape, l.q.as_slice(), &l.k, &l.v, &kh, &vh, &cfg)?
            .summary
            .mean
            .kl;
    }
    Ok(total / cap.layers.len() as f64)
}

/// The candidates [`plan_grid`] chooses from: per-channel keys at 2–8 bits
/// in blocks of 32, 64 and 128 tokens, and at 2–4 bits in blocks of 64 and
/// 128 with 1 % dense-and-sparse outliers; rotated values, Lloyd-Max at
/// 2–4 bits and the uniform grid at 5, 6 and 8, in groups of 32 and 64.
pub fn plan_candidates() -> (Vec<Codec>, Vec<Codec>) {
    let mut keys = Vec::new();
    for b in [2u8, 3, 4, 5, 6, 8] {
        for g in [32, 64, 128] {
            keys.push(Codec::uniform(s(b, Axis::PerChannel, Group::Size(g))));
        }
    }
    for b in [2u8, 3, 4] {
        for g in [64, 128] {
            let c = Codec::uniform(s(b, Axis::PerChannel, Group::Size(g)));
            keys.push(c.with_outliers(0.01).expect("1 % is a valid share"));
        }
    }
    let mut values = Vec::new();
    for g in [32, 64] {
        for b in [2u8, 3, 4] {
            values.push(gauss(b, g));
        }
        for b in [5u8, 6, 8] {
            values.push(Codec::hadamard(s(b, Axis::PerToken, Group::Size(g))));
        }
    }
    (keys, values)
}

/// [`GridKind::Plan`]: captures a held-out window of each corpus of
/// `args.calib` (the `window` tokens after the `n_tokens` the sweep scores)
/// and plans on them ([`plan_configs`]) at every budget of `args.budgets`.
pub fn plan_grid(
    model: &Model,
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<Vec<Config>, BoxError> {
    let held = held_windows(tok, args, opts)?;
    plan_configs(
        model,
        &held,
        opts.bos,
        &args.budgets,
        args.residual,
        args.sinks,
    )
}

/// The held-out window of each corpus of `args.calib`: the `window`
/// tokens after the `n_tokens` the sweep scores.
fn held_windows(
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<Vec<Vec<u32>>, BoxError> {
    let mut held = Vec::new();
    for corpus in &args.calib {
        let text = std::fs::read_to_string(crate::assets::corpus(corpus))?;
        let all = super::prefix_tokens(tok, &text, opts.n_tokens + opts.window)?;
        let w = all
            .get(opts.n_tokens..opts.n_tokens + opts.window)
            .ok_or_else(|| {
                format!(
                    "{corpus}: fewer than {} tokens for a held-out window",
                    opts.n_tokens + opts.window
                )
            })?;
        held.push(w.to_vec());
    }
    Ok(held)
}

/// The full-precision captures of the held-out windows `held`.
fn held_captures(
    model: &Model,
    held: &[Vec<u32>],
    bos: Option<u32>,
) -> Result<Vec<Capture>, BoxError> {
    held.iter()
        .map(|w| capture_window(model, &with_bos(w, bos)))
        .collect()
}

/// [`GridKind::Fit`]: captures the held-out windows of `args.calib` (as
/// [`plan_grid`] does) and fits codebooks on them ([`fit_configs`]).
pub fn fit_grid(
    model: &Model,
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<Vec<Config>, BoxError> {
    let held = held_windows(tok, args, opts)?;
    let captures = plan_captures(model, &held, opts.bos, args.sinks)?;
    fit_configs(&captures, args.residual, args.sinks)
}

/// Fitted codebooks against the tables they start from, on `captures`
/// (one per layer, with pre-RoPE keys and the caches' sinks, as
/// [`plan_captures`] makes them), for caches with `residual` and `sinks`.
/// Every fitted codec starts from rotated Lloyd-Max levels on per-token
/// groups of 32 and is fitted per layer: values
/// ([`kvq::metrics::LayerCapture::fit_values`]); keys after RoPE weighted
/// by their queries' energy ([`kvq::metrics::LayerCapture::fit_keys`]) and,
/// at 3 bits, unweighted; values beside per-channel keys stored before
/// RoPE (3 and 4 bits in blocks of 64).
pub fn fit_configs(
    captures: &[kvq::metrics::LayerCapture],
    residual: usize,
    sinks: usize,
) -> Result<Vec<Config>, BoxError> {
    let t = Instant::now();
    // The same layers with the keys as a post-RoPE cache stores them.
    let post = captures
        .iter()
        .map(|c| {
            Ok(
                kvq::metrics::LayerCapture::new(c.shape(), c.q(), c.k(), c.v())?
                    .with_sinks(c.sinks()),
            )
        })
        .collect::<Result<Vec<_>, kvq::Error>>()?;
    let per_layer = |f: &dyn Fn(usize) -> Result<Codec, kvq::Error>| {
        (0..captures.len()).map(f).collect::<Result<Vec<_>, _>>()
    };
    let cut = |c: &kvq::metrics::LayerCapture| {
        let s = c.shape();
        c.sinks().min(c.tokens()) * s.n_kv_heads() * s.head_dim()
    };
    let mut values = Vec::new();
    let mut keys = Vec::new();
    let mut keys_plain = Vec::new();
    for b in [2u8, 3] {
        values.push(per_layer(&|l| captures[l].fit_values(&gauss(b, 32)))?);
        keys.push(per_layer(&|l| post[l].fit_keys(&gauss(b, 32)))?);
    }
    for p in &post {
        let sh = p.shape();
        let rows = &p.k()[cut(p)..];
        keys_plain.push(gauss(3, 32).fit_levels(rows, sh.n_kv_heads(), sh.head_dim(), None)?);
    }
    for (b, (v, k)) in [2u8, 3].iter().zip(values.iter().zip(&keys)) {
        eprintln!("fitted {b}-bit levels, layer 0: values {:?}", v[0].levels());
        eprintln!("                        keys   {:?}", k[0].levels());
    }
    eprintln!("fitted in {:.1}s", t.elapsed().as_secs_f64());
    let post_spec = CacheSpec {
        residual,
        sinks,
        ..CacheSpec::FULL
    };
    let pre_spec = CacheSpec {
        pre_rope: true,
        ..post_spec
    };
    let n = captures.len();
    let cfg = |name: String, spec, layers: Vec<(Option<Codec>, Option<Codec>)>| Config {
        layers: Some(layers),
        ..Config::new(name, spec)
    };
    let each = |k: &dyn Fn(usize) -> Option<Codec>, v: &dyn Fn(usize) -> Option<Codec>| {
        (0..n).map(|l| (k(l), v(l))).collect::<Vec<_>>()
    };
    let mut out = Vec::new();
    for (i, b) in [2u8, 3].into_iter().enumerate() {
        let g = gauss(b, 32);
        out.push(cfg(
            format!("V H·gauss{b} pt32"),
            post_spec,
            each(&|_| None, &|_| Some(g)),
        ));
        let fv = &values[i];
        out.push(cfg(
            format!("V H·fit{b} pt32"),
            post_spec,
            each(&|_| None, &|l| Some(fv[l])),
        ));
    }
    for (i, b) in [2u8, 3].into_iter().enumerate() {
        let g = gauss(b, 32);
        out.push(cfg(
            format!("K H·gauss{b} pt32"),
            post_spec,
            each(&|_| Some(g), &|_| None),
        ));
        let fk = &keys[i];
        out.push(cfg(
            format!("K H·fit{b} pt32 q-weighted"),
            post_spec,
            each(&|l| Some(fk[l]), &|_| None),
        ));
    }
    out.push(cfg(
        "K H·fit3 pt32 unweighted".into(),
        post_spec,
        each(&|l| Some(keys_plain[l]), &|_| None),
    ));
    // Both: rotated per-token keys after RoPE at 3 bits with values at 2
    // (3.0 effective bits), and per-channel keys before RoPE.
    let (g2, g3) = (gauss(2, 32), gauss(3, 32));
    out.push(cfg(
        "K H·gauss3 / V H·gauss2".into(),
        post_spec,
        each(&|_| Some(g3), &|_| Some(g2)),
    ));
    out.push(cfg(
        "K H·fit3 / V H·fit2".into(),
        post_spec,
        each(&|l| Some(keys[1][l]), &|l| Some(values[0][l])),
    ));
    for (kb, vb) in [(3u8, 2u8), (4, 3)] {
        let k = Codec::uniform(s(kb, Axis::PerChannel, Group::Size(64)));
        let vi = usize::from(vb - 2);
        let g = gauss(vb, 32);
        out.push(cfg(
            format!("K{kb} pc64 pre-RoPE / V H·gauss{vb}"),
            pre_spec,
            each(&|_| Some(k), &|_| Some(g)),
        ));
        out.push(cfg(
            format!("K{kb} pc64 pre-RoPE / V H·fit{vb}"),
            pre_spec,
            each(&|_| Some(k), &|l| Some(values[vi][l])),
        ));
    }
    Ok(out)
}

/// The planner's view of the windows `held` (each as long as the first;
/// `bos` replacing each one's first token): per layer, one capture whose
/// heads are every window's heads side by side (attention never mixes
/// heads, so this is each window scored on its own, combined), keys also
/// before RoPE, the first `sinks` tokens exact.
pub fn plan_captures(
    model: &Model,
    held: &[Vec<u32>],
    bos: Option<u32>,
    sinks: usize,
) -> Result<Vec<kvq::metrics::LayerCapture>, BoxError> {
    use kvq::metrics::{AttnShape, LayerCapture as KvqCapture};
    let cfg = &model.cfg;
    let Some(len) = held.first().map(Vec::len) else {
        return Err("no calibration windows".into());
    };
    if held.iter().any(|w| w.len() != len) {
        return Err("calibration windows of different lengths".into());
    }
    let caps = held_captures(model, held, bos)?;
    if caps.iter().any(|c| !c.has_k_pre_rope()) {
        return Err("the calibration capture has no pre-RoPE keys".into());
    }
    let m = held.len();
    let shape = AttnShape::new(cfg.n_heads * m, cfg.n_kv_heads * m, cfg.head_dim)?;
    // Row t of every window, one after the other.
    let side_by_side = |part: &dyn Fn(&Capture) -> &[f32], width: usize| -> Vec<f32> {
        let mut out = Vec::with_capacity(len * width * m);
        for t in 0..len {
            for c in &caps {
                out.extend_from_slice(&part(c)[t * width..(t + 1) * width]);
            }
        }
        out
    };
    let (qw, kw) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
    (0..cfg.n_layers)
        .map(|l| {
            let q = side_by_side(&|c| &c.layers[l].q, qw);
            let k = side_by_side(&|c| &c.layers[l].k, kw);
            let v = side_by_side(&|c| &c.layers[l].v, kw);
            let k_pre = side_by_side(&|c| &c.layers[l].k_pre_rope, kw);
            Ok(KvqCapture::from_vecs(shape, q, k, v)?
                .with_sinks(sinks)
                .with_pre_rope_keys(k_pre, cfg.kvq_rope(l))?)
        })
        .collect()
}

/// The pair [`layer_weights`] quantizes one layer at a time with: 3-bit
/// per-channel keys in blocks of 64, rotated 3-bit Lloyd-Max values in
/// groups of 32 (about the middle of the budgets planned).
pub fn probe_pair() -> (Codec, Codec) {
    (
        Codec::uniform(s(3, Axis::PerChannel, Group::Size(64))),
        gauss(3, 32),
    )
}

/// How much each layer's attention error moves the model's predictions:
/// per layer `l`, the next-token KL (against full precision, mean over the
/// windows `held`) with only layer `l` quantized by [`probe_pair`], divided
/// by that layer's relative output error under the same pair on
/// `captures` — the slope of the loss against the planner's objective, so
/// `Planner::with_layer_weights` of these makes the objective follow the
/// loss. A layer whose error is zero weighs zero.
pub fn layer_weights(
    model: &Model,
    held: &[Vec<u32>],
    bos: Option<u32>,
    captures: &[kvq::metrics::LayerCapture],
    spec: CacheSpec,
) -> Result<Vec<f64>, BoxError> {
    let n = model.cfg.n_layers;
    let (pk, pv) = probe_pair();
    let probe = kvq::Planner::new([pk], [pv])?
        .with_metrics(planner_metrics())
        .with_max_queries(PLAN_QUERIES)
        .plan_per_layer(captures, 16.0)?;
    let hooks = &mut Hooks::default();
    let mut kl = vec![0f64; n];
    for w in held {
        let opts = PplOptions {
            n_tokens: w.len(),
            window: w.len(),
            path: EvalPath::Prefill,
            bos,
        };
        let mut reference = Reference::default();
        let mut full = KvqStore::for_model(&model.cfg, CacheSpec::FULL)?;
        let record = Kl::Record(&mut reference);
        perplexity_kl(model, w, &mut full, hooks, &opts, record, |_, _| {})?;
        for (l, kl) in kl.iter_mut().enumerate() {
            let mut layers = vec![(None, None); n];
            layers[l] = (Some(pk), Some(pv));
            let mut store = KvqStore::for_model_layers(&model.cfg, spec, &layers)?;
            let cmp = Kl::Compare(&reference);
            let (_, r) = perplexity_kl(model, w, &mut store, hooks, &opts, cmp, |_, _| {})?;
            *kl += r.map_or(0.0, |k| k.mean) / held.len() as f64;
        }
    }
    Ok((0..n)
        .map(|l| {
            let err = probe.layers[l].score;
            if err > 0.0 {
                kl[l] / err
            } else {
                0.0
            }
        })
        .collect())
}

/// Query positions per layer the plan grid's planner scores.
const PLAN_QUERIES: usize = 32;

/// The plan grid's attention: causal, as a prefill window.
fn planner_metrics() -> kvq::MetricsConfig {
    kvq::MetricsConfig::new().with_causal(0)
}

/// The configurations of [`plan_grid`] planned on the windows `held`
/// ([`plan_captures`]; `bos` replacing each one's first token, as the
/// sweep's windows do), for
/// caches with `residual` and `sinks`: per budget, the planner's per-layer
/// allocation, the same with its layers weighted by [`layer_weights`], and
/// its best single pair.
pub fn plan_configs(
    model: &Model,
    held: &[Vec<u32>],
    bos: Option<u32>,
    budgets: &[f64],
    residual: usize,
    sinks: usize,
) -> Result<Vec<Config>, BoxError> {
    let cfg = &model.cfg;
    let t = Instant::now();
    let captures = plan_captures(model, held, bos, sinks)?;
    let (keys, values) = plan_candidates();
    let planner = kvq::Planner::new(keys, values)?
        .with_metrics(planner_metrics())
        .with_max_queries(PLAN_QUERIES);
    let spec = CacheSpec {
        residual,
        sinks,
        pre_rope: true,
        ..CacheSpec::FULL
    };
    let weights = layer_weights(model, held, bos, &captures, spec)?;
    eprintln!(
        "layer weights (next-token KL per unit of output error): {}",
        weights
            .iter()
            .map(|w| format!("{w:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let weighted = planner.clone().with_layer_weights(weights);
    let per_layer = |lp: &kvq::plan::LayerPlan| -> Vec<(Option<Codec>, Option<Codec>)> {
        lp.layers
            .iter()
            .map(|c| (Some(c.keys), Some(c.values)))
            .collect()
    };
    let mut out = Vec::new();
    for &budget in budgets {
        let lp = planner.plan_per_layer(&captures, budget)?;
        let wp = weighted.plan_per_layer(&captures, budget)?;
        eprintln!(
            "plan {budget}: {:.3} bits, output error {:.4} (best single pair {}: {:.4}); \
             weighted {:.3} bits",
            lp.effective_bits,
            lp.score,
            lp.uniform.label(),
            lp.uniform.score,
            wp.effective_bits,
        );
        for (l, (c, w)) in lp.layers.iter().zip(&wp.layers).enumerate() {
            eprintln!(
                "  layer {l:2}: {:.3} bits  {:<45}  weighted {:.3} bits  {}",
                c.effective_bits,
                c.label(),
                w.effective_bits,
                w.label()
            );
        }
        out.push(Config {
            layers: Some(per_layer(&lp)),
            ..Config::new(format!("plan {budget} per layer"), spec)
        });
        out.push(Config {
            layers: Some(per_layer(&wp)),
            ..Config::new(format!("plan {budget} per layer, KL-weighted"), spec)
        });
        let pair = (Some(lp.uniform.keys), Some(lp.uniform.values));
        out.push(Config {
            layers: Some(vec![pair; cfg.n_layers]),
            ..Config::new(
                format!("plan {budget} one pair {}", lp.uniform.label()),
                spec,
            )
        });
    }
    eprintln!("planned in {:.1}s", t.elapsed().as_secs_f64());
    Ok(out)
}

/// What the round-trip studies ([`alloc_grid`], [`trellis_grid`]) start
/// from: the captures of the held-out windows, and the cache that keeps
/// both tensors exact with the run's residual window and sinks.
fn study_setup(
    model: &Model,
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<(Vec<Capture>, CacheSpec), BoxError> {
    let caps = held_captures(model, &held_windows(tok, args, opts)?, opts.bos)?;
    let spec = CacheSpec {
        residual: args.residual,
        sinks: args.sinks,
        ..CacheSpec::FULL
    };
    Ok((caps, spec))
}

/// A round-trip study's configuration on `spec`: keys at channel widths
/// (exact without), values in the cache through `values` on every one of
/// `n_layers` layers (exact without).
fn study_config(
    name: String,
    spec: CacheSpec,
    n_layers: usize,
    keys: Option<std::sync::Arc<ChannelBits>>,
    values: Option<Codec>,
) -> Config {
    Config {
        key_bits: keys,
        layers: values.map(|v| vec![(None, Some(v)); n_layers]),
        ..Config::new(name, spec)
    }
}

/// [`GridKind::Alloc`]: per-channel key widths ([`ChannelBits`]) fitted on
/// the held-out windows of `args.calib` (as [`plan_grid`] takes them),
/// against one width for every channel through the same round trip, keys
/// before RoPE in blocks of 64 tokens: keys alone (values exact) at 2, 2.5,
/// 3 and 4 code bits, with rotary pairs at one width, one budget per layer
/// and blocks of 128, then beside rotated Lloyd-Max values at 3 and 3.25
/// effective bits.
pub fn alloc_grid(
    model: &Model,
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<Vec<Config>, BoxError> {
    let t = Instant::now();
    let (caps, spec) = study_setup(model, tok, args, opts)?;
    let cfg = &model.cfg;
    const BLOCK: usize = 64;
    let base = FitOptions {
        block: BLOCK,
        sinks: args.sinks,
        ..FitOptions::default()
    };
    let with = |bits: f64, opts: FitOptions| -> Result<std::sync::Arc<ChannelBits>, BoxError> {
        Ok(std::sync::Arc::new(ChannelBits::fit_with(
            cfg, &caps, bits, opts,
        )?))
    };
    let fit = |bits: f64| with(bits, base);
    let one = |bits: u8| {
        std::sync::Arc::new(
            ChannelBits::uniform(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, bits, BLOCK)
                .with_sinks(args.sinks),
        )
    };
    let keys_only = |name, a| study_config(name, spec, cfg.n_layers, Some(a), None);
    let with_values = |name, a, v| study_config(name, spec, cfg.n_layers, Some(a), Some(v));
    let mut out = Vec::new();
    let mut fitted = Vec::new();
    for b in [2.0, 2.5, 3.0] {
        let a = fit(b)?;
        eprintln!(
            "channel widths {b}: counts by width 0..=8 {:?}",
            a.histogram()
        );
        fitted.push((b, a));
    }
    for (b, a) in &fitted {
        out.push(keys_only(format!("K{b} pc64 by channel"), a.clone()));
    }
    // The format's choices: rotary pairs at one width, one budget per
    // layer, blocks of 128 tokens.
    let pairs = FitOptions {
        pairs: true,
        ..base
    };
    let layer = FitOptions {
        per_layer: true,
        ..base
    };
    let wide = FitOptions { block: 128, ..base };
    out.push(keys_only("K3 pc64 by pair".into(), with(3.0, pairs)?));
    out.push(keys_only(
        "K3 pc64 by channel, per layer".into(),
        with(3.0, layer)?,
    ));
    out.push(keys_only(
        "K2.75 pc128 by channel".into(),
        with(2.75, wide)?,
    ));
    out.push(keys_only(
        "K3.25 pc128 by channel".into(),
        with(3.25, wide)?,
    ));
    for b in [2, 3, 4] {
        out.push(keys_only(format!("K{b} pc64 every channel"), one(b)));
    }
    let by = |b: f64| fitted.iter().find(|(x, _)| *x == b).map(|(_, a)| a.clone());
    if let (Some(a25), Some(a3)) = (by(2.5), by(3.0)) {
        out.push(with_values(
            "K3 pc64 by channel / H·V gauss2 pt32".into(),
            a3,
            gauss(2, 32),
        ));
        out.push(with_values(
            "K2.5 pc64 by channel / H·V gauss3 pt32".into(),
            a25,
            gauss(3, 32),
        ));
    }
    out.push(with_values(
        "K3 pc64 every channel / H·V gauss2 pt32".into(),
        one(3),
        gauss(2, 32),
    ));
    // 3.0 effective bits from the format's choices: pairs in blocks of 128.
    let paired128 = FitOptions {
        block: 128,
        pairs: true,
        ..base
    };
    out.push(with_values(
        "K2.5 pc128 by pair / H·V gauss3 pt64".into(),
        with(2.5, paired128)?,
        gauss(3, 64),
    ));
    out.push(with_values(
        "K3.25 pc128 by pair / H·V gauss2 pt32".into(),
        with(3.25, paired128)?,
        gauss(2, 32),
    ));
    eprintln!("channel widths fitted in {:.1}s", t.elapsed().as_secs_f64());
    Ok(out)
}

/// [`GridKind::Trellis`]: values in a bitshift trellis code
/// ([`TrellisCode`], one `f16` scale per group) against rotated Lloyd-Max
/// values of the same bits and groups in the cache, keys exact; then at
/// 3.0 effective bits beside key channel widths (rotary pairs, blocks of
/// 128 tokens, fitted on the held-out windows as [`alloc_grid`] does);
/// keys at one width or fitted widths with their 1–3-bit channels in the
/// grid or in a trellis code along their blocks' tokens (`·T`,
/// [`ChannelBits::with_trellis`]), alone and beside trellis values. The
/// sinks stay exact in every round trip.
pub fn trellis_grid(
    model: &Model,
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<Vec<Config>, BoxError> {
    use std::sync::Arc;
    let t = Instant::now();
    let (caps, spec) = study_setup(model, tok, args, opts)?;
    let cfg = &model.cfg;
    let hd = cfg.head_dim;
    let trellis = |l: u32, k: u32, group: usize| -> Result<Arc<TrellisCode>, BoxError> {
        Ok(Arc::new(
            TrellisCode::gaussian(l, k, group.min(hd))?.with_sinks(args.sinks),
        ))
    };
    let widths_with = |bits: f64, trellis: bool, by_error: bool| {
        let o = FitOptions {
            block: 128,
            pairs: true,
            sinks: args.sinks,
            trellis,
            by_error,
            ..FitOptions::default()
        };
        ChannelBits::fit_with(cfg, &caps, bits, o).map(Arc::new)
    };
    let widths = |bits: f64| widths_with(bits, false, false);
    let cached = |name, k, v| study_config(name, spec, cfg.n_layers, k, Some(v));
    let coded = |name: String, k: Option<Arc<ChannelBits>>, v: Arc<TrellisCode>| Config {
        key_bits: k,
        value_code: Some(ValueHook::Trellis(v)),
        ..Config::new(name, spec)
    };
    let mut out = Vec::new();
    // Values alone: the same bits and groups, Lloyd-Max or trellis.
    for (k, group) in [(2u32, 64usize), (3, 64), (2, 32)] {
        let g = group.min(hd);
        out.push(cached(
            format!("V H·gauss{k} pt{g}"),
            None,
            gauss(k as u8, g),
        ));
        out.push(coded(
            format!("V trellis{k} L8 g{g}"),
            None,
            trellis(8, k, g)?,
        ));
    }
    out.push(coded(
        format!("V trellis2 L10 g{}", 64.min(hd)),
        None,
        trellis(10, 2, 64)?,
    ));
    // 3.0 effective bits with key widths: codes plus one f16 scale and zero
    // per channel and 128 tokens on the keys.
    let g = 64.min(hd);
    let k25 = widths(2.5)?;
    let k35 = widths(3.5)?;
    out.push(cached(
        format!("K2.5 pc128 by pair / H·V gauss3 pt{g}"),
        Some(k25.clone()),
        gauss(3, g),
    ));
    out.push(coded(
        format!("K2.5 pc128 by pair / V trellis3 L8 g{g}"),
        Some(k25),
        trellis(8, 3, g)?,
    ));
    out.push(cached(
        format!("K3.5 pc128 by pair / H·V gauss2 pt{g}"),
        Some(k35.clone()),
        gauss(2, g),
    ));
    out.push(coded(
        format!("K3.5 pc128 by pair / V trellis2 L8 g{g}"),
        Some(k35),
        trellis(8, 2, g)?,
    ));
    // Keys: every channel at one width, or widths by pair, each block of
    // 128 tokens of a 1–3-bit channel in the grid or a trellis code (`·T`).
    let keys_only = |name, k| study_config(name, spec, cfg.n_layers, Some(k), None);
    for b in [2u8, 3] {
        let one =
            ChannelBits::uniform(cfg.n_layers, cfg.n_kv_heads, hd, b, 128).with_sinks(args.sinks);
        out.push(keys_only(
            format!("K{b} pc128 every channel"),
            Arc::new(one.clone()),
        ));
        out.push(keys_only(
            format!("K{b} pc128 every channel·T"),
            Arc::new(one.with_trellis()?),
        ));
    }
    out.push(keys_only("K2.5 pc128 by pair".into(), widths(2.5)?));
    let t25 = widths_with(2.5, true, false)?;
    let t35 = widths_with(3.5, true, false)?;
    out.push(keys_only("K2.5 pc128 by pair·T".into(), t25.clone()));
    out.push(coded(
        format!("K2.5 pc128 by pair·T / V trellis3 L8 g{g}"),
        Some(t25),
        trellis(8, 3, g)?,
    ));
    out.push(coded(
        format!("K3.5 pc128 by pair·T / V trellis2 L8 g{g}"),
        Some(t35),
        trellis(8, 2, g)?,
    ));
    // Each channel in the trellis or the grid, by its calibration error.
    let e25 = widths_with(2.5, true, true)?;
    eprintln!(
        "K2.5 by pair·TG: {} of {} channels in the trellis",
        e25.trellis_channels(),
        cfg.n_layers * cfg.n_kv_heads * hd
    );
    out.push(keys_only("K2.5 pc128 by pair·TG".into(), e25.clone()));
    out.push(coded(
        format!("K2.5 pc128 by pair·TG / V trellis3 L8 g{g}"),
        Some(e25),
        trellis(8, 3, g)?,
    ));
    eprintln!("trellis grid built in {:.1}s", t.elapsed().as_secs_f64());
    Ok(out)
}

/// [`GridKind::Klt`]: values in a basis fitted on the held-out windows of
/// `args.calib` ([`KltCode`]), against rotated Lloyd-Max values in the
/// cache and trellis values at the same bits (keys exact); keys after RoPE
/// in a basis weighted by the queries against key widths by rotary pair in
/// a trellis code (values exact).
pub fn klt_grid(
    model: &Model,
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<Vec<Config>, BoxError> {
    use std::sync::Arc;
    let t = Instant::now();
    let (caps, spec) = study_setup(model, tok, args, opts)?;
    let cfg = &model.cfg;
    let hd = cfg.head_dim;
    let g = 64.min(hd);
    // The per-token scale's share of a row.
    let scale_bits = 16.0 / hd as f64;
    let klt = |code_bits: f64, o: KltOptions| -> Result<Arc<KltCode>, BoxError> {
        let k = KltCode::fit(
            model,
            &caps,
            KltOptions {
                code_bits,
                sinks: args.sinks,
                ..o
            },
        )?;
        eprintln!(
            "{:?} transform {code_bits} code bits ({}weighted{}{}): widths 0..=8 {:?}, \
             coding gain {:.2} bits",
            o.tensor,
            if o.weighted { "" } else { "un" },
            if o.per_layer { ", per layer" } else { "" },
            if o.token_scale {
                ""
            } else {
                ", no token scale"
            },
            k.histogram(),
            k.coding_gain()
        );
        Ok(Arc::new(k))
    };
    let base = KltOptions::default();
    let values = |name: String, v: ValueHook| Config {
        value_code: Some(v),
        ..Config::new(name, spec)
    };
    let mut out = Vec::new();
    for k in [2u8, 3] {
        let kb = f64::from(k);
        out.push(study_config(
            format!("V H·gauss{k} pt{g}"),
            spec,
            cfg.n_layers,
            None,
            Some(gauss(k, g)),
        ));
        out.push(values(
            format!("V trellis{k} L8 g{g}"),
            ValueHook::Trellis(Arc::new(
                TrellisCode::gaussian(8, k.into(), g)?.with_sinks(args.sinks),
            )),
        ));
        let variants = [
            (format!("V klt·o{k}"), kb, base),
            (
                format!("V pca{k}"),
                kb,
                KltOptions {
                    weighted: false,
                    ..base
                },
            ),
            (
                format!("V klt·o{k} per layer"),
                kb,
                KltOptions {
                    per_layer: true,
                    ..base
                },
            ),
            // No per-token scale: its bits go to the codes.
            (
                format!("V klt·o{k} static"),
                kb + scale_bits,
                KltOptions {
                    token_scale: false,
                    ..base
                },
            ),
        ];
        for (name, bits, o) in variants {
            out.push(values(name, ValueHook::Klt(klt(bits, o)?)));
        }
    }
    // Keys after RoPE in a basis weighted by the queries (or not).
    let kopt = KltOptions {
        tensor: KltTensor::Keys,
        ..base
    };
    let keys = |name: String, k: Arc<KltCode>| Config {
        key_klt: Some(k),
        ..Config::new(name, spec)
    };
    for kb in [2.0, 2.5, 3.0] {
        out.push(keys(format!("K klt·q{kb}"), klt(kb, kopt)?));
    }
    out.push(keys(
        "K pca2.5".into(),
        klt(
            2.5,
            KltOptions {
                weighted: false,
                ..kopt
            },
        )?,
    ));
    // The best per-channel keys at the same bits: widths by rotary pair
    // in a trellis code along blocks of 128 tokens (0.25 bit of params).
    let o = FitOptions {
        block: 128,
        pairs: true,
        sinks: args.sinks,
        trellis: true,
        ..FitOptions::default()
    };
    out.push(study_config(
        "K2.5 pc128 by pair·T".into(),
        spec,
        cfg.n_layers,
        Some(Arc::new(ChannelBits::fit_with(cfg, &caps, 2.5, o)?)),
        None,
    ));
    eprintln!("transform grid built in {:.1}s", t.elapsed().as_secs_f64());
    Ok(out)
}

/// [`GridKind::Widths`]: key widths by rotary pair in a trellis code (as
/// [`trellis_grid`] fits them), with one budget for the whole model
/// ([`FitOptions::global`]) or in blocks of 256 tokens, alone and beside
/// 3-bit trellis values at 3.0 effective bits.
pub fn widths_grid(
    model: &Model,
    tok: &crate::tokenizer::Tokenizer,
    args: &Args,
    opts: &PplOptions,
) -> Result<Vec<Config>, BoxError> {
    use std::sync::Arc;
    let t = Instant::now();
    let (caps, spec) = study_setup(model, tok, args, opts)?;
    let cfg = &model.cfg;
    let g = 64.min(cfg.head_dim);
    let fit = |bits: f64, block: usize, global: bool| {
        let o = FitOptions {
            block,
            pairs: true,
            sinks: args.sinks,
            trellis: true,
            global,
            ..FitOptions::default()
        };
        ChannelBits::fit_with(cfg, &caps, bits, o).map(Arc::new)
    };
    let values = || -> Result<ValueHook, BoxError> {
        Ok(ValueHook::Trellis(Arc::new(
            TrellisCode::gaussian(8, 3, g)?.with_sinks(args.sinks),
        )))
    };
    let keys_only = |name, k| study_config(name, spec, cfg.n_layers, Some(k), None);
    let coded = |name: String, k: Arc<ChannelBits>| -> Result<Config, BoxError> {
        Ok(Config {
            key_bits: Some(k),
            value_code: Some(values()?),
            ..Config::new(name, spec)
        })
    };
    let mut out = Vec::new();
    // One budget for the whole model: the score errors the widths weigh
    // are in the same units in every layer.
    let global = fit(2.5, 128, true)?;
    eprintln!(
        "K2.5 by pair·T, one budget: effective key bits by layer {:?}",
        (0..cfg.n_layers)
            .map(|l| format!("{:.2}", global.effective_bits(l)))
            .collect::<Vec<_>>()
    );
    out.push(keys_only(
        "K2.5 pc128 by pair·T global".into(),
        global.clone(),
    ));
    out.push(coded(
        format!("K2.5 pc128 by pair·T global / V trellis3 L8 g{g}"),
        global,
    )?);
    // Blocks of 256 tokens: half the params again, an eighth of a bit more
    // for the codes at the same effective bits.
    let long = fit(2.625, 256, false)?;
    out.push(keys_only("K2.625 pc256 by pair·T".into(), long.clone()));
    out.push(coded(
        format!("K2.625 pc256 by pair·T / V trellis3 L8 g{g}"),
        long,
    )?);
    eprintln!("widths grid built in {:.1}s", t.elapsed().as_secs_f64());
    Ok(out)
}
