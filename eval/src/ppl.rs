//! Perplexity with the studies' protocol.
//!
//! The first `n_tokens` tokens (default 8192) are cut into non-overlapping
//! windows of `window` tokens (default 512). Each window starts from an empty
//! cache (`KvStore::reset`) and positions restart at 0. For a model that
//! expects a BOS token (Gemma; [`PplOptions::bos`]) the window's first token
//! is replaced by BOS, as `llama-perplexity` does: the window keeps its
//! length and the replaced token is never a target. SmolLM2 gets no BOS. The logits at position `i` predict token `i + 1`, so a window of
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
//! Against a reference run (the full-precision cache), [`perplexity_kl`]
//! also reports what `llama-perplexity --kl-divergence` does: the KL
//! divergence `KL(p_ref ‖ p)` of every next-token distribution (nats), its
//! mean and 99th percentile, and how often the most likely token is the
//! same ([`KlReport`]).
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
    /// The BOS id that replaces each window's first token (`None`: the
    /// window is the corpus's tokens unchanged).
    pub bos: Option<u32>,
}

impl Default for PplOptions {
    fn default() -> Self {
        PplOptions {
            n_tokens: 8192,
            window: 512,
            path: EvalPath::Prefill,
            bos: None,
        }
    }
}

/// A window as the model sees it: `window` with its first token replaced
/// by `bos` when given ([`PplOptions::bos`]).
pub fn with_bos(window: &[u32], bos: Option<u32>) -> std::borrow::Cow<'_, [u32]> {
    match (bos, window.split_first()) {
        (Some(b), Some((_, rest))) => {
            let mut w = Vec::with_capacity(window.len());
            w.push(b);
            w.extend_from_slice(rest);
            w.into()
        }
        _ => window.into(),
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
    log_sum_exp(logits) - logits[target] as f64
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
    let mut out = Vec::with_capacity(tokens.len().saturating_sub(1));
    window_rows(model, tokens, store, hooks, path, &mut |i, _, row| {
        out.push(nll(row, tokens[i + 1] as usize));
    })?;
    Ok(out)
}

/// What [`window_rows`] calls with each prediction: its index, final hidden
/// state and logits.
pub type RowVisitor<'a> = dyn FnMut(usize, &[f32], &[f32]) + 'a;

/// Run one window from an empty store and hand every prediction's final
/// hidden state and logits to `visit` (`visit(i, hidden, logits)` predicts
/// token `i + 1`), in order.
pub fn window_rows(
    model: &Model,
    tokens: &[u32],
    store: &mut dyn KvStore,
    hooks: &mut Hooks<'_>,
    path: EvalPath,
    visit: &mut RowVisitor<'_>,
) -> Result<()> {
    store.reset();
    let n = tokens.len();
    match path {
        EvalPath::Prefill => {
            let hidden = model.forward(tokens, 0, store, hooks)?;
            // Logits in row blocks to bound memory (vocab can be large).
            let rows = n - 1;
            let block = 128;
            for b0 in (0..rows).step_by(block) {
                let b1 = (b0 + block).min(rows);
                let h = hidden.slice(ndarray::s![b0..b1, ..]);
                let logits = model.logits(h);
                for (i, (row, hrow)) in logits.outer_iter().zip(h.outer_iter()).enumerate() {
                    let hrow = hrow.to_slice().expect("contiguous hidden rows");
                    visit(b0 + i, hrow, row.as_slice().expect("contiguous logits"));
                }
            }
        }
        EvalPath::Decode => {
            for (i, &t) in tokens[..n - 1].iter().enumerate() {
                let hidden = model.forward(&[t], i, store, hooks)?;
                let logits = model.logits(hidden.view());
                let h = hidden.as_slice().expect("contiguous hidden state");
                visit(i, h, logits.as_slice().expect("contiguous logits"));
            }
        }
    }
    Ok(())
}

/// The next-token distributions of a reference run, kept as the final
/// hidden states (`d_model` floats per prediction: 20 MB for 8192 tokens of
/// Gemma 3, whose 262k-entry distributions would take 8.6 GB as `f32`).
/// Comparing recomputes the reference logits with the same model, a block
/// of rows at a time, so they are exactly the recorded run's.
#[derive(Debug, Clone, Default)]
pub struct Reference {
    width: usize,
    hidden: Vec<f32>,
    top1: Vec<u32>,
}

impl Reference {
    /// Predictions recorded.
    pub fn len(&self) -> usize {
        self.top1.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.top1.is_empty()
    }

    fn push(&mut self, hidden: &[f32], logits: &[f32]) {
        self.width = hidden.len();
        self.hidden.extend_from_slice(hidden);
        self.top1.push(argmax(logits));
    }
}

/// Rows of reference log-probabilities, recomputed a block at a time.
struct RefRows<'a> {
    reference: &'a Reference,
    model: &'a Model,
    /// First prediction of the cached block.
    first: usize,
    /// Log-probabilities of the cached block, `[rows, vocab]`.
    logp: Vec<f32>,
    vocab: usize,
}

impl<'a> RefRows<'a> {
    const BLOCK: usize = 128;

    fn new(reference: &'a Reference, model: &'a Model) -> Self {
        RefRows {
            reference,
            model,
            first: 0,
            logp: Vec::new(),
            vocab: 0,
        }
    }

    /// Log-probabilities of prediction `k`.
    fn row(&mut self, k: usize) -> Result<&[f32]> {
        let cached = self.logp.len() / self.vocab.max(1);
        if self.logp.is_empty() || k < self.first || k >= self.first + cached {
            let r = self.reference;
            let end = (k + Self::BLOCK).min(r.len());
            let h =
                ArrayView2::from_shape((end - k, r.width), &r.hidden[k * r.width..end * r.width])
                    .map_err(|e| ModelError(format!("reference hidden states: {e}")))?;
            let logits = self.model.logits(h);
            self.vocab = logits.ncols();
            self.logp.clear();
            for row in logits.outer_iter() {
                let row = row.as_slice().expect("contiguous logits");
                let lse = log_sum_exp(row);
                self.logp
                    .extend(row.iter().map(|&v| (v as f64 - lse) as f32));
            }
            self.first = k;
        }
        let i = k - self.first;
        Ok(&self.logp[i * self.vocab..(i + 1) * self.vocab])
    }

    /// `KL(ref_k ‖ softmax(logits))` in nats, and whether the most likely
    /// token agrees, for prediction `k`.
    fn compare(&mut self, k: usize, logits: &[f32]) -> Result<(f64, bool)> {
        let top1 = self.reference.top1[k];
        let lp = self.row(k)?;
        if lp.len() != logits.len() {
            return Err(ModelError(format!(
                "the reference's vocabulary has {} entries, this model's logits {}",
                lp.len(),
                logits.len()
            )));
        }
        let lse = log_sum_exp(logits);
        let kl: f64 = lp
            .iter()
            .zip(logits)
            // p·log p → 0 where p = 0 (a log-probability of −inf).
            .filter(|(&a, _)| a > f32::NEG_INFINITY)
            .map(|(&a, &b)| {
                let a = a as f64;
                a.exp() * (a - (b as f64 - lse))
            })
            .sum();
        // Rounding can leave an identical distribution a hair below zero.
        Ok((kl.max(0.0), argmax(logits) == top1))
    }
}

/// KL divergence of a run's next-token distributions from a reference's,
/// as `llama-perplexity --kl-divergence` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KlReport {
    /// Mean KL over every prediction (nats).
    pub mean: f64,
    /// Mean KL over the second half of each window (nats).
    pub mean_second_half: f64,
    /// 99th percentile of the per-prediction KL (nats).
    pub p99: f64,
    /// Share of predictions whose most likely token is the reference's.
    pub same_top1: f64,
    /// Predictions compared.
    pub count: usize,
}

/// What [`perplexity_kl`] does with each prediction's distribution.
pub enum Kl<'a> {
    /// Nothing ([`perplexity`]).
    Off,
    /// Record it: this run is the reference.
    Record(&'a mut Reference),
    /// Compare it with the reference's.
    Compare(&'a Reference),
}

fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Evaluate perplexity; `progress` is called after every window with its
/// index and result.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    store: &mut dyn KvStore,
    hooks: &mut Hooks<'_>,
    opts: &PplOptions,
    progress: impl FnMut(usize, &WindowResult),
) -> Result<PplReport> {
    perplexity_kl(model, tokens, store, hooks, opts, Kl::Off, progress).map(|r| r.0)
}

/// [`perplexity`], recording every prediction's distribution as the
/// reference or comparing it with one recorded over the same tokens and
/// options; the [`KlReport`] comes with [`Kl::Compare`].
///
/// # Errors
/// As [`perplexity`]; also when the reference holds another number of
/// predictions.
pub fn perplexity_kl(
    model: &Model,
    tokens: &[u32],
    store: &mut dyn KvStore,
    hooks: &mut Hooks<'_>,
    opts: &PplOptions,
    kl: Kl<'_>,
    mut progress: impl FnMut(usize, &WindowResult),
) -> Result<(PplReport, Option<KlReport>)> {
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
    let predictions = (opts.n_tokens / opts.window) * (opts.window - 1);
    if let Kl::Compare(r) = &kl {
        if r.len() != predictions {
            return Err(ModelError(format!(
                "the reference holds {} predictions, this run makes {predictions}",
                r.len()
            )));
        }
    }
    // Recorded into a fresh reference, handed over only when the run
    // succeeds (a failed run leaves the caller's reference as it was).
    let mut recorded = Reference::default();
    let mut failed = None;
    let mut rows = match &kl {
        Kl::Compare(r) => Some(RefRows::new(r, model)),
        _ => None,
    };
    let (mut kls, mut same, mut kl2) = (Vec::new(), 0usize, (0.0f64, 0usize));
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
        let chunk = &*with_bos(chunk, opts.bos);
        let start = Instant::now();
        let mut nlls = Vec::with_capacity(opts.window - 1);
        let base = w * (opts.window - 1);
        window_rows(
            model,
            chunk,
            store,
            hooks,
            opts.path,
            &mut |i, hidden, row| {
                nlls.push(nll(row, chunk[i + 1] as usize));
                if let Kl::Record(_) = kl {
                    recorded.push(hidden, row);
                }
                if let (Some(rr), None) = (rows.as_mut(), &failed) {
                    match rr.compare(base + i, row) {
                        Ok((d, agree)) => {
                            kls.push(d);
                            same += agree as usize;
                            if i >= first_scored {
                                kl2 = (kl2.0 + d, kl2.1 + 1);
                            }
                        }
                        Err(e) => failed = Some(e),
                    }
                }
            },
        )?;
        if let Some(e) = failed {
            return Err(e);
        }
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
    if let Kl::Record(r) = kl {
        *r = recorded;
        return Ok((report, None));
    }
    let klr = matches!(kl, Kl::Compare(_)).then(|| {
        let count = kls.len();
        let mean = kls.iter().sum::<f64>() / count.max(1) as f64;
        let mut sorted = kls;
        sorted.sort_by(f64::total_cmp);
        let p99 = sorted
            .get((count * 99 / 100).min(count.saturating_sub(1)))
            .copied()
            .unwrap_or(0.0);
        KlReport {
            mean,
            mean_second_half: kl2.0 / kl2.1.max(1) as f64,
            p99,
            same_top1: same as f64 / count.max(1) as f64,
            count,
        }
    });
    Ok((report, klr))
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
