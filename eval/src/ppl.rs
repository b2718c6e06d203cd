//! Perplexity with the studies' protocol.
//!
//! The first `n_tokens` tokens (default 8192) are cut into non-overlapping
//! windows of `window` tokens (default 512). Each window starts from an empty
//! cache (`KvStore::reset`), positions restart at 0 and no BOS token is
//! added. The logits at position `i` predict token `i + 1`, so a window of
//! `w` tokens yields `w - 1` predictions. Perplexity is `exp(mean NLL)` over
//! the scored predictions.
//!
//! Two scorings are reported from the same forward passes:
//!
//! * **all**: every prediction of each window (`w - 1` per window);
//! * **second half**: only predictions made from positions `w/2 .. w-1`
//!   (`w - 1 - w/2` per window), the `llama-perplexity` convention, where
//!   every scored token has at least `w/2` tokens of context.
//!
//! Two evaluation paths exist: [`EvalPath::Prefill`] feeds each window as one
//! block (`extend` + `attend_causal` per layer), [`EvalPath::Decode`] feeds it
//! token by token (`extend` of one row + `attend`).

use std::time::Instant;

use ndarray::ArrayView2;

use crate::capture::{Capture, Recorder};
use crate::kvq_store::{CacheSpec, KvqStore};
use crate::model::{Hooks, KvStore, Model, ModelError, Result};
use crate::BoxError;

/// How the tokens of a window are fed to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalPath {
    /// The whole window as one block.
    Prefill,
    /// One token at a time.
    Decode,
}

impl std::str::FromStr for EvalPath {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "prefill" => Ok(EvalPath::Prefill),
            "decode" => Ok(EvalPath::Decode),
            _ => Err(format!("unknown eval path {s:?} (prefill, decode)")),
        }
    }
}

/// Perplexity evaluation settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PplOptions {
    /// How many tokens from the start of the corpus to evaluate.
    pub n_tokens: usize,
    /// Window length; each window starts from an empty cache.
    pub window: usize,
    /// Prefill or token-by-token decode.
    pub path: EvalPath,
}

impl Default for PplOptions {
    fn default() -> Self {
        PplOptions {
            n_tokens: 8192,
            window: 512,
            path: EvalPath::Prefill,
        }
    }
}

/// Summed negative log-likelihood over a set of predictions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NllSum {
    /// Sum of `-ln p(token)`.
    pub nll: f64,
    /// Number of predictions.
    pub count: usize,
}

impl NllSum {
    /// Mean NLL in nats.
    pub fn mean(&self) -> f64 {
        self.nll / self.count as f64
    }

    /// Perplexity `exp(mean NLL)`.
    pub fn ppl(&self) -> f64 {
        self.mean().exp()
    }

    fn add(&mut self, other: NllSum) {
        self.nll += other.nll;
        self.count += other.count;
    }
}

/// Result of one window.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowResult {
    /// All predictions of the window.
    pub all: NllSum,
    /// Predictions from the second half of the window.
    pub second_half: NllSum,
    /// Wall-clock seconds spent on the window.
    pub seconds: f64,
}

/// Result of a perplexity run.
#[derive(Debug, Clone, PartialEq)]
pub struct PplReport {
    /// All predictions of all windows.
    pub all: NllSum,
    /// Second-half predictions of all windows.
    pub second_half: NllSum,
    /// Per-window results, in order.
    pub windows: Vec<WindowResult>,
    /// Per-prediction NLL of every window concatenated (`window - 1` per window).
    pub token_nll: Vec<f32>,
}

/// `-ln softmax(logits)[target]`, computed in `f64`.
pub fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    lse - logits[target] as f64
}

/// The full-precision Q/K/V of every layer over the window `tokens`: a
/// prefill from an empty full-precision cache, recorded layer by layer.
pub fn capture_window(model: &Model, tokens: &[u32]) -> std::result::Result<Capture, BoxError> {
    let c = &model.cfg;
    let mut rec = Recorder::new(c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, tokens);
    let mut store = KvqStore::new(c.n_layers, c.n_kv_heads, c.head_dim, CacheSpec::FULL)?;
    let mut hooks = Hooks {
        observer: Some(&mut rec),
        ..Hooks::default()
    };
    window_nll(model, tokens, &mut store, &mut hooks, EvalPath::Prefill)?;
    Ok(rec.capture)
}

/// Per-prediction NLL of one window (`tokens.len() - 1` values).
pub fn window_nll(
    model: &Model,
    tokens: &[u32],
    store: &mut dyn KvStore,
    hooks: &mut Hooks<'_>,
    path: EvalPath,
) -> Result<Vec<f64>> {
    store.reset();
    let n = tokens.len();
    let mut out = Vec::with_capacity(n.saturating_sub(1));
    match path {
        EvalPath::Prefill => {
            let hidden = model.forward(tokens, 0, store, hooks)?;
            // Logits in row blocks to bound memory (vocab can be large).
            let rows = n - 1;
            let block = 128;
            for b0 in (0..rows).step_by(block) {
                let b1 = (b0 + block).min(rows);
                let logits = model.logits(hidden.slice(ndarray::s![b0..b1, ..]));
                for (i, row) in logits.outer_iter().enumerate() {
                    let row = row.as_slice().expect("contiguous logits");
                    out.push(nll(row, tokens[b0 + i + 1] as usize));
                }
            }
        }
        EvalPath::Decode => {
            for (i, &t) in tokens[..n - 1].iter().enumerate() {
                let hidden = model.forward(&[t], i, store, hooks)?;
                let logits = model.logits(hidden.view());
                let row = logits.as_slice().expect("contiguous logits");
                out.push(nll(row, tokens[i + 1] as usize));
            }
        }
    }
    Ok(out)
}

/// Evaluate perplexity; `progress` is called after every window with its
/// index and result.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    store: &mut dyn KvStore,
    hooks: &mut Hooks<'_>,
    opts: &PplOptions,
    mut progress: impl FnMut(usize, &WindowResult),
) -> Result<PplReport> {
    if opts.window < 2 {
        return Err(ModelError("window must be at least 2 tokens".into()));
    }
    if tokens.len() < opts.n_tokens || opts.n_tokens < opts.window {
        return Err(ModelError(format!(
            "need {} tokens (at least one window of {}), have {}",
            opts.n_tokens,
            opts.window,
            tokens.len()
        )));
    }
    let first_scored = opts.window / 2;
    let mut report = PplReport {
        all: NllSum::default(),
        second_half: NllSum::default(),
        windows: Vec::new(),
        token_nll: Vec::new(),
    };
    for (w, chunk) in tokens[..opts.n_tokens]
        .chunks_exact(opts.window)
        .enumerate()
    {
        let start = Instant::now();
        let nlls = window_nll(model, chunk, store, hooks, opts.path)?;
        let sum = |v: &[f64]| NllSum {
            nll: v.iter().sum(),
            count: v.len(),
        };
        let res = WindowResult {
            all: sum(&nlls),
            second_half: sum(&nlls[first_scored..]),
            seconds: start.elapsed().as_secs_f64(),
        };
        report.all.add(res.all);
        report.second_half.add(res.second_half);
        report.token_nll.extend(nlls.iter().map(|&v| v as f32));
        progress(w, &res);
        report.windows.push(res);
    }
    Ok(report)
}

/// Logits of `tokens` from an empty store (prefill), `[n, vocab]` row-major.
pub fn window_logits(
    model: &Model,
    tokens: &[u32],
    store: &mut dyn KvStore,
    hooks: &mut Hooks<'_>,
) -> Result<Vec<f32>> {
    store.reset();
    let hidden = model.forward(tokens, 0, store, hooks)?;
    let logits = model.logits(ArrayView2::from(&hidden));
    Ok(logits.into_raw_vec_and_offset().0)
}
