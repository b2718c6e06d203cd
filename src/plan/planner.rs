//! The K/V bit-budget planner.

use super::*;

/// The error a [`Planner`] minimizes (the mean over every query head of
/// every layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Objective {
    /// Relative error of the attention output, `‖O − Ô‖/‖O‖`: sees keys and
    /// values together. The default.
    #[default]
    OutputError,
    /// `KL(p ‖ p̂)` of the attention distribution. Sees only the keys: use it
    /// to choose keys — with it, every value scheme of a key scheme scores
    /// the same and the cheapest wins.
    Kl,
}

impl Objective {
    /// The objective's value for `e`.
    pub fn of(&self, e: &AttentionErrors) -> f64 {
        match self {
            Objective::OutputError => e.output_rel,
            Objective::Kl => e.kl,
        }
    }
    /// Its name, as used in tables.
    pub fn name(&self) -> &'static str {
        match self {
            Objective::OutputError => "output_rel",
            Objective::Kl => "kl",
        }
    }
}

/// A grid of candidate formats: every combination of its lists.
///
/// Groups follow the axis ([`Group`]): per-token `Size(n)` is `n` channels,
/// per-channel `Size(n)` is `n` tokens. Combinations that are not a valid
/// [`QuantScheme`] (per-channel with `Group::Head`/`Group::Vector`,
/// symmetric 1-bit) or codec (a codebook on a scheme it does not take, see
/// [`Codec::codebook`]) are left out; formats that do not fit a capture's
/// shape are reported in [`Plan::skipped`].
#[derive(Debug, Clone, PartialEq)]
pub struct SchemeGrid {
    /// Bits per code.
    pub bits: Vec<u8>,
    /// Grouping axes.
    pub axes: Vec<Axis>,
    /// Group sizes.
    pub groups: Vec<Group>,
    /// Symmetric and/or asymmetric.
    pub modes: Vec<Mode>,
    /// Formats of scales and zeros.
    pub scale_formats: Vec<ScaleFormat>,
    /// Tables: `None` for the uniform grid, or a codebook
    /// ([`Levels`]) on the scheme's storage.
    pub levels: Vec<Option<Levels>>,
    /// Rotations around each format.
    pub rotations: Vec<Rotation>,
    /// Shares of each param set kept as dense-and-sparse outliers
    /// ([`Codec::with_outliers`]); `0.0` for none.
    pub outliers: Vec<f64>,
}

impl Default for SchemeGrid {
    /// Bits 2, 3, 4, 5, 6, 8; both axes; groups of 32, 64 and a head;
    /// asymmetric; f16 scales; the uniform grid, unrotated, no outliers.
    /// 30 schemes.
    fn default() -> Self {
        SchemeGrid {
            bits: vec![2, 3, 4, 5, 6, 8],
            axes: vec![Axis::PerToken, Axis::PerChannel],
            groups: vec![Group::Size(32), Group::Size(64), Group::Head],
            modes: vec![Mode::Asymmetric],
            scale_formats: vec![ScaleFormat::F16],
            levels: vec![None],
            rotations: vec![Rotation::None],
            outliers: vec![0.0],
        }
    }
}

impl SchemeGrid {
    /// Every valid scheme of the grid, in the order of the lists (bits
    /// outermost), without duplicates.
    pub fn schemes(&self) -> Vec<QuantScheme> {
        let mut out: Vec<QuantScheme> = Vec::new();
        for &b in &self.bits {
            for &a in &self.axes {
                for &g in &self.groups {
                    for &m in &self.modes {
                        for &f in &self.scale_formats {
                            if let Ok(s) = QuantScheme::new(b, a, g).and_then(|s| s.with_mode(m)) {
                                let s = s.with_scale_format(f);
                                if !out.contains(&s) {
                                    out.push(s);
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Every valid codec of the grid: each scheme of
    /// [`schemes`](Self::schemes) with each table of `levels` it takes,
    /// each rotation and each share of `outliers`, in that order, without
    /// duplicates. Whether a codebook takes a scheme does not depend on the
    /// layer's shape, so it is checked here on one head of 256 channels;
    /// outliers are left out of `Group::Vector` schemes (they are per
    /// head) and shares outside (0, 0.5] other than 0 are dropped.
    pub fn codecs(&self) -> Vec<Codec> {
        let mut out: Vec<Codec> = Vec::new();
        for s in self.schemes() {
            for &l in &self.levels {
                for &r in &self.rotations {
                    for &f in &self.outliers {
                        let c = match l {
                            None => Codec::uniform(s),
                            Some(l) => Codec::codebook(s, l),
                        }
                        .with_rotation(r);
                        let c = match f {
                            0.0 => c,
                            _ if s.group() == Group::Vector => continue,
                            _ => match c.with_outliers(f) {
                                Ok(c) => c,
                                Err(_) => continue,
                            },
                        };
                        // Only a codebook that refuses its scheme is left
                        // out here; a shape this head does not take is
                        // reported against the captures' shapes.
                        let valid = !matches!(c.build(1, 256), Err(Error::InvalidConfig { .. }));
                        if valid && !out.contains(&c) {
                            out.push(c);
                        }
                    }
                }
            }
        }
        out
    }
}

/// One key/value pair scored by a [`Planner`].
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Format of the keys.
    pub keys: Codec,
    /// Format of the values.
    pub values: Codec,
    /// `(effective bits of K + of V) / 2`, averaged over layers weighted by
    /// their `n_kv_heads·head_dim` (per layer, for a per-layer plan).
    pub effective_bits: f64,
    /// The [`Objective`] (its mean over heads and layers, layers weighted
    /// as [`Planner::with_layer_weights`] says); lower is better.
    pub score: f64,
    /// All errors, mean and worst over heads and layers.
    pub errors: ErrorSummary,
    /// Whether the output error was computed exactly. Screened pairs carry
    /// the first-order estimate (see [`Planner`]); every pair on a Pareto
    /// front and the first `refine` of a ranking are exact.
    pub exact: bool,
}

impl Candidate {
    /// `K<label>/V<label>`.
    pub fn label(&self) -> String {
        format!("K{}/V{}", self.keys.label(), self.values.label())
    }
}

/// Which tensor a skipped scheme was a candidate for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Keys.
    Keys,
    /// Values.
    Values,
}

/// A candidate format left out, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Skipped {
    /// The format.
    pub codec: Codec,
    /// Keys or values.
    pub role: Role,
    /// The error that ruled it out (does not fit a layer's shape, a scale
    /// overflowed its format…).
    pub reason: Error,
}

/// What [`Planner::plan`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The budget, effective bits.
    pub budget: f64,
    /// What was minimized.
    pub objective: Objective,
    /// Every pair within budget, best first (ties: fewer bits first).
    pub ranked: Vec<Candidate>,
    /// The pairs within budget that no other pair beats on both bits and
    /// score, by increasing bits (so by decreasing score).
    pub pareto: Vec<Candidate>,
    /// Candidate schemes left out.
    pub skipped: Vec<Skipped>,
}

impl Plan {
    /// The best pair within budget.
    ///
    /// # Panics
    /// If `ranked` is empty (never for a plan returned by [`Planner::plan`],
    /// which is an error instead).
    #[track_caller]
    pub fn best(&self) -> &Candidate {
        &self.ranked[0]
    }
}

/// What [`Planner::plan_per_layer`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    /// The budget, effective bits (mean over layers).
    pub budget: f64,
    /// What was minimized.
    pub objective: Objective,
    /// One choice per layer, in order; `effective_bits`, `score` and
    /// `errors` are the layer's own (exact).
    pub layers: Vec<Candidate>,
    /// Mean effective bits of the choices, weighted by layer width.
    pub effective_bits: f64,
    /// The objective over all layers of the choices.
    pub score: f64,
    /// Errors over all layers of the choices.
    pub errors: ErrorSummary,
    /// The best single pair for every layer within the same budget, for
    /// comparison (exact).
    pub uniform: Candidate,
    /// Candidate schemes left out.
    pub skipped: Vec<Skipped>,
}

/// Chooses key and value schemes for a bit budget by error at the point of
/// use.
///
/// # How it scores
/// For every layer it quantizes each key scheme once and each value scheme
/// once (`K̂`, `V̂`), computes the exact attention `p`, `o = p·V` of the
/// (sub-sampled) captured queries once, and per key scheme `p̂` with the
/// KL, logit and top-k errors. The output error of a pair needs
/// `ô = p̂·V̂`, one product per pair; the planner first *screens* every pair
/// with the first-order expansion
/// `ô − o ≈ (p̂ − p)·V + p·(V̂ − V)` (exact up to the product of the key and
/// value errors, `(p̂ − p)·(V̂ − V)`), which costs one `head_dim`-vector per
/// query per pair, then computes `ô` exactly for the first `refine` of the
/// ranking and for every pair on the Pareto front, repeating until the front
/// is exact. Layers run in parallel; results do not depend on the number of
/// threads.
///
/// Defaults: [`Objective::OutputError`], [`MetricsConfig::new`], at most 8
/// query positions per layer (evenly spaced; with `n_q_heads` heads that is
/// `8·n_q_heads` attention rows per layer), `refine = 8`, all cores.
///
/// # Cost
/// Screening costs about `(2·n_K + n_V + 2)·q·tokens·head_dim` multiply-adds
/// per query head and layer (`n_K`, `n_V`: key and value schemes that occur
/// in a pair within budget; `q`: query positions), plus quantizing every
/// scheme once per layer; the exact pass costs `(n_K' + pairs + 2)` such
/// products for the pairs it refines. Time is linear in layers, heads,
/// tokens and query positions.
///
/// # Example: a Pareto front on a synthetic 4-layer capture
/// ```
/// use kvq::metrics::{AttnShape, LayerCapture};
/// use kvq::plan::{Planner, SchemeGrid};
/// use kvq::{Axis, Group, Mode, ScaleFormat};
/// let shape = AttnShape::new(4, 2, 64)?; // 4 query heads, 2 KV heads (GQA)
/// let (tokens, queries) = (128, 8);
/// let mut seed = 7u64;
/// let mut rnd = move || {
///     // splitmix64 → uniform in [-1, 1)
///     seed = seed.wrapping_add(0x9E3779B97F4A7C15);
///     let mut z = seed;
///     z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
///     z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
///     ((z ^ (z >> 31)) >> 11) as f32 / (1u64 << 52) as f32 - 1.0
/// };
/// let captures = (0..4)
///     .map(|_| {
///         // Keys with an outlier channel 0, plain values, random queries.
///         let k: Vec<f32> = (0..tokens * 2 * 64)
///             .map(|i| if i % 64 == 0 { 8.0 } else { rnd() })
///             .collect();
///         let v: Vec<f32> = (0..tokens * 2 * 64).map(|_| rnd()).collect();
///         let q: Vec<f32> = (0..queries * 4 * 64).map(|_| 2.0 * rnd()).collect();
///         LayerCapture::from_vecs(shape, q, k, v)
///     })
///     .collect::<Result<Vec<_>, _>>()?;
/// let grid = SchemeGrid {
///     bits: vec![2, 4, 8],
///     axes: vec![Axis::PerToken, Axis::PerChannel],
///     groups: vec![Group::Size(32)],
///     modes: vec![Mode::Asymmetric],
///     scale_formats: vec![ScaleFormat::F16],
///     ..SchemeGrid::default()
/// };
/// let plan = Planner::from_grid(&grid)?.plan(&captures, 5.5)?;
/// let front = &plan.pareto;
/// assert!(!front.is_empty());
/// for w in front.windows(2) {
///     assert!(w[0].effective_bits < w[1].effective_bits && w[0].score > w[1].score);
/// }
/// assert!(front.iter().all(|c| c.effective_bits <= 5.5 && c.exact));
/// for c in front {
///     println!("{:5.2} bits  {:.4}  {}", c.effective_bits, c.score, c.label());
/// }
/// # Ok::<(), kvq::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Planner {
    keys: Vec<Codec>,
    values: Vec<Codec>,
    objective: Objective,
    metrics: MetricsConfig,
    max_queries: usize,
    refine: usize,
    threads: usize,
    layer_weights: Vec<f64>,
}

impl Planner {
    /// A planner choosing among these key and value formats — schemes
    /// (the uniform grid) or any [`Codec`] (duplicates are dropped).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when either list is empty.
    pub fn new<K, V>(
        keys: impl IntoIterator<Item = K>,
        values: impl IntoIterator<Item = V>,
    ) -> Result<Self>
    where
        K: Into<Codec>,
        V: Into<Codec>,
    {
        fn dedup(v: impl Iterator<Item = Codec>) -> Vec<Codec> {
            let mut out: Vec<Codec> = Vec::new();
            for s in v {
                if !out.contains(&s) {
                    out.push(s);
                }
            }
            out
        }
        let keys = dedup(keys.into_iter().map(Into::into));
        let values = dedup(values.into_iter().map(Into::into));
        for (list, name) in [(&keys, "key"), (&values, "value")] {
            if list.is_empty() {
                return Err(Error::InvalidArgument {
                    op: "Planner::new",
                    what: format!("no candidate {name} schemes"),
                });
            }
        }
        Ok(Planner {
            keys,
            values,
            objective: Objective::default(),
            metrics: MetricsConfig::new(),
            max_queries: 8,
            refine: 8,
            threads: 0,
            layer_weights: Vec::new(),
        })
    }

    /// A planner with the grid's codecs for both keys and values.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the grid has no valid codec.
    pub fn from_grid(grid: &SchemeGrid) -> Result<Self> {
        let s = grid.codecs();
        Self::new(s.clone(), s)
    }

    /// Minimize `objective`.
    pub fn with_objective(mut self, objective: Objective) -> Self {
        self.objective = objective;
        self
    }
    /// Attention as `metrics` says (scale, causal mask, top-k).
    pub fn with_metrics(mut self, metrics: MetricsConfig) -> Self {
        self.metrics = metrics;
        self
    }
    /// Use at most `n` query positions per layer, evenly spaced (checked
    /// when planning: at least 1). Cost is linear in it.
    pub fn with_max_queries(mut self, n: usize) -> Self {
        self.max_queries = n;
        self
    }
    /// Compute the output error exactly for the first `n` of the ranking
    /// (and always for the Pareto front). `usize::MAX` scores every pair
    /// exactly.
    pub fn with_refine(mut self, n: usize) -> Self {
        self.refine = n;
        self
    }
    /// Weigh layer `l`'s objective by `weights[l]` wherever layers are
    /// combined (the ranking, the per-layer greedy, every reported score):
    /// the score of a choice becomes `Σ_l w_l·h_l·s_l / Σ_l w_l·h_l` (`h_l`
    /// the layer's query heads, `s_l` its objective) instead of the plain
    /// mean over heads. Layers are not equally sensitive — an error in one
    /// layer's attention output can move the logits far more than the same
    /// relative error in another — so a weight that measures that (say, the
    /// next-token KL per unit of output error, from quantizing one layer
    /// at a time) makes the objective follow the model's loss. Empty (the
    /// default): every layer weighs 1. Checked when planning: one finite,
    /// non-negative weight per capture, not all zero.
    pub fn with_layer_weights(mut self, weights: Vec<f64>) -> Self {
        self.layer_weights = weights;
        self
    }

    /// Layer `l`'s weight.
    fn weight(&self, l: usize) -> f64 {
        self.layer_weights.get(l).copied().unwrap_or(1.0)
    }

    /// The objective over layers `(l, errors)`, weighted by heads and
    /// layer weights.
    fn weighted<'e>(&self, parts: impl IntoIterator<Item = (usize, &'e ErrorSummary)>) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        for (l, e) in parts {
            let w = self.weight(l) * e.count as f64;
            num += w * self.objective.of(&e.mean);
            den += w;
        }
        if den > 0.0 {
            num / den
        } else {
            0.0
        }
    }

    /// Run on `n` threads (0: all available cores).
    pub fn with_threads(mut self, n: usize) -> Self {
        self.threads = n;
        self
    }

    /// Candidate key formats.
    pub fn key_codecs(&self) -> &[Codec] {
        &self.keys
    }
    /// Candidate value formats.
    pub fn value_codecs(&self) -> &[Codec] {
        &self.values
    }

    /// Rank every key/value pair whose effective bits are within `budget`
    /// (one pair for all layers).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no captures, a budget that is not a
    /// positive number or that no pair fits, `max_queries = 0`, a bad
    /// [`MetricsConfig`], or when every key (or value) scheme was skipped;
    /// [`Error::InvalidShape`] for a causal offset beyond a capture's tokens.
    pub fn plan(&self, captures: &[LayerCapture], budget: f64) -> Result<Plan> {
        let op = "Planner::plan";
        let setup = self.setup(op, captures, budget)?;
        let all_pairs = setup.pairs();
        let pairs: Vec<(usize, usize)> = all_pairs
            .iter()
            .copied()
            .filter(|&(k, v)| setup.pair_bits(k, v) <= budget + EPS)
            .collect();
        if pairs.is_empty() {
            return Err(no_fit(op, budget, &setup, &all_pairs));
        }
        let exact = pairs.len() <= self.refine;
        let lists = vec![pairs.clone(); captures.len()];
        let scores = self.run(&setup, &lists, exact)?;
        let (alive, skipped) = setup.survivors(&scores);
        let mut entries: Vec<Candidate> = Vec::new();
        let mut index: Vec<(usize, usize)> = Vec::new();
        for (p, &(k, v)) in pairs.iter().enumerate() {
            if !alive(k, v) {
                continue;
            }
            let parts: Vec<(usize, &ErrorSummary)> = scores
                .iter()
                .enumerate()
                .filter_map(|(l, s)| s.pairs[p].as_ref().map(|e| (l, e)))
                .collect();
            let errors = ErrorSummary::combine(parts.iter().map(|x| x.1));
            let score = self.weighted(parts);
            entries.push(self.candidate(&setup, k, v, errors, score, exact));
            index.push((k, v));
        }
        if entries.is_empty() {
            return Err(no_fit(op, budget, &setup, &[]));
        }
        // Refine until the front and the head of the ranking are exact.
        loop {
            let mut order: Vec<usize> = (0..entries.len()).collect();
            order.sort_by(|&a, &b| rank_cmp(&entries[a], &entries[b]));
            let mut need: Vec<usize> = order
                .iter()
                .take(self.refine)
                .chain(pareto_indices(&entries).iter())
                .copied()
                .filter(|&i| !entries[i].exact)
                .collect();
            need.sort_unstable();
            need.dedup();
            if need.is_empty() {
                break;
            }
            let sub: Vec<(usize, usize)> = need.iter().map(|&i| index[i]).collect();
            let lists = vec![sub; captures.len()];
            let exact_scores = self.run(&setup, &lists, true)?;
            for (j, &i) in need.iter().enumerate() {
                let parts: Vec<ErrorSummary> = exact_scores
                    .iter()
                    .map(|l| l.pairs[j].ok_or_else(|| refine_failed(op)))
                    .collect::<Result<_>>()?;
                let (k, v) = index[i];
                let score = self.weighted(parts.iter().enumerate());
                entries[i] =
                    self.candidate(&setup, k, v, ErrorSummary::combine(&parts), score, true);
            }
        }
        let pareto = pareto_indices(&entries)
            .into_iter()
            .map(|i| entries[i].clone())
            .collect();
        entries.sort_by(rank_cmp);
        Ok(Plan {
            budget,
            objective: self.objective,
            ranked: entries,
            pareto,
            skipped,
        })
    }

    /// Spend `budget` (mean effective bits over layers, weighted by layer
    /// width) layer by layer: start every layer at its cheapest pair, then
    /// repeatedly take the upgrade — to a pair on that layer's Pareto front
    /// of bits against error — with the largest reduction of the objective
    /// per bit spent, while the budget allows. Greedy is not optimal, so the
    /// result is never worse than the best uniform pair within the budget:
    /// if that pair scores better (screened, or exactly once both are
    /// refined), every layer gets it.
    ///
    /// Choices are made on the screened scores (see [`Planner`]); the chosen
    /// pair of every layer, and the best uniform pair for comparison, are
    /// then scored exactly.
    ///
    /// # Errors
    /// As [`plan`](Self::plan); [`Error::InvalidArgument`] when even the
    /// cheapest pair of every layer exceeds the budget.
    pub fn plan_per_layer(&self, captures: &[LayerCapture], budget: f64) -> Result<LayerPlan> {
        let op = "Planner::plan_per_layer";
        let setup = self.setup(op, captures, budget)?;
        let pairs = setup.pairs();
        let exact = pairs.len() <= self.refine;
        let lists = vec![pairs.clone(); captures.len()];
        let scores = self.run(&setup, &lists, exact)?;
        let (alive, skipped) = setup.survivors(&scores);
        let live: Vec<usize> = (0..pairs.len())
            .filter(|&p| alive(pairs[p].0, pairs[p].1))
            .collect();
        if live.is_empty() {
            return Err(no_fit(op, budget, &setup, &[]));
        }
        let n_layers = captures.len();
        let width: Vec<f64> = setup.width.clone();
        let total_w: f64 = width.iter().sum();
        // Each layer's share of the objective: its heads times its weight.
        let heads: Vec<f64> = captures
            .iter()
            .enumerate()
            .map(|(l, c)| c.shape().n_q_heads() as f64 * self.weight(l))
            .collect();
        let total_h: f64 = heads.iter().sum();
        // Per layer: the Pareto front of (bits, score) over live pairs.
        let fronts: Vec<Vec<(usize, f64, f64)>> = (0..n_layers)
            .map(|l| {
                let mut pts: Vec<(usize, f64, f64)> = live
                    .iter()
                    .map(|&p| {
                        let (k, v) = pairs[p];
                        let e = scores[l].pairs[p].expect("live pairs are scored");
                        (
                            p,
                            setup.layer_pair_bits(l, k, v),
                            self.objective.of(&e.mean),
                        )
                    })
                    .collect();
                pts.sort_by(|a, b| {
                    a.1.total_cmp(&b.1)
                        .then(a.2.total_cmp(&b.2))
                        .then(a.0.cmp(&b.0))
                });
                let mut front: Vec<(usize, f64, f64)> = Vec::new();
                for pt in pts {
                    if front.last().is_none_or(|f| pt.2 < f.2) {
                        front.push(pt);
                    }
                }
                front
            })
            .collect();
        let mut cur = vec![0usize; n_layers];
        let mut bits: f64 = (0..n_layers)
            .map(|l| fronts[l][0].1 * width[l] / total_w)
            .sum();
        if bits > budget + EPS {
            return Err(Error::InvalidArgument {
                op,
                what: format!(
                    "budget {budget} effective bits is below the cheapest per-layer choice ({bits:.4})"
                ),
            });
        }
        loop {
            let mut best: Option<(f64, usize, usize, f64)> = None;
            for l in 0..n_layers {
                let (_, b0, s0) = fronts[l][cur[l]];
                for (j, &(_, b, s)) in fronts[l].iter().enumerate().skip(cur[l] + 1) {
                    let db = (b - b0) * width[l] / total_w;
                    if bits + db > budget + EPS {
                        continue;
                    }
                    let gain = (s0 - s) * heads[l] / total_h / db;
                    // An upgrade that the objective does not see (a layer of
                    // weight 0) is not worth its bits.
                    if gain > 0.0 && best.is_none_or(|(g, ..)| gain > g) {
                        best = Some((gain, l, j, db));
                    }
                }
            }
            match best {
                Some((_, l, j, db)) => {
                    cur[l] = j;
                    bits += db;
                }
                None => break,
            }
        }
        // Best uniform pair within budget, by screened score.
        let uniform_p = live
            .iter()
            .copied()
            .filter(|&p| setup.pair_bits(pairs[p].0, pairs[p].1) <= budget + EPS)
            .min_by(|&a, &b| {
                let sc = |p: usize| {
                    let parts: Vec<ErrorSummary> =
                        scores.iter().map(|l| l.pairs[p].expect("live")).collect();
                    self.weighted(parts.iter().enumerate())
                };
                sc(a).total_cmp(&sc(b)).then(a.cmp(&b))
            });
        let Some(uniform_p) = uniform_p else {
            return Err(no_fit(op, budget, &setup, &pairs));
        };
        // Greedy is not optimal: never return worse than the best uniform
        // pair (by screened score).
        let layer_score = |l: usize, p: usize| {
            self.objective
                .of(&scores[l].pairs[p].expect("live pairs are scored").mean)
                * heads[l]
                / total_h
        };
        let greedy: Vec<usize> = (0..n_layers).map(|l| fronts[l][cur[l]].0).collect();
        let greedy_score: f64 = (0..n_layers).map(|l| layer_score(l, greedy[l])).sum();
        let uniform_score: f64 = (0..n_layers).map(|l| layer_score(l, uniform_p)).sum();
        let chosen = if uniform_score < greedy_score {
            vec![uniform_p; n_layers]
        } else {
            greedy
        };
        // Exact scores of the choices and of the uniform pair.
        let lists: Vec<Vec<(usize, usize)>> = (0..n_layers)
            .map(|l| vec![pairs[chosen[l]], pairs[uniform_p]])
            .collect();
        let exact_scores = self.run(&setup, &lists, true)?;
        let mut layers = Vec::with_capacity(n_layers);
        let mut uni_parts = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let (k, v) = lists[l][0];
            let e = exact_scores[l].pairs[0].ok_or_else(|| refine_failed(op))?;
            layers.push(Candidate {
                keys: setup.keys[k],
                values: setup.values[v],
                effective_bits: setup.layer_pair_bits(l, k, v),
                score: self.objective.of(&e.mean),
                errors: e,
                exact: true,
            });
            uni_parts.push(exact_scores[l].pairs[1].ok_or_else(|| refine_failed(op))?);
        }
        let (uk, uv) = pairs[uniform_p];
        let uniform = self.candidate(
            &setup,
            uk,
            uv,
            ErrorSummary::combine(&uni_parts),
            self.weighted(uni_parts.iter().enumerate()),
            true,
        );
        // The screened choice may still lose to the uniform pair once both
        // are scored exactly: then every layer gets the uniform pair, so
        // the promise holds on the reported (exact) scores.
        let mut errors = ErrorSummary::combine(layers.iter().map(|c| &c.errors));
        let mut score = self.weighted(layers.iter().map(|c| &c.errors).enumerate());
        if score > uniform.score {
            for (l, c) in layers.iter_mut().enumerate() {
                *c = Candidate {
                    keys: setup.keys[uk],
                    values: setup.values[uv],
                    effective_bits: setup.layer_pair_bits(l, uk, uv),
                    score: self.objective.of(&uni_parts[l].mean),
                    errors: uni_parts[l],
                    exact: true,
                };
            }
            errors = ErrorSummary::combine(&uni_parts);
            score = uniform.score;
        }
        let effective_bits = layers
            .iter()
            .zip(&width)
            .map(|(c, w)| c.effective_bits * w / total_w)
            .sum();
        Ok(LayerPlan {
            budget,
            objective: self.objective,
            layers,
            effective_bits,
            score,
            errors,
            uniform,
            skipped,
        })
    }

    fn candidate(
        &self,
        setup: &Setup<'_>,
        k: usize,
        v: usize,
        errors: ErrorSummary,
        score: f64,
        exact: bool,
    ) -> Candidate {
        Candidate {
            keys: setup.keys[k],
            values: setup.values[v],
            effective_bits: setup.pair_bits(k, v),
            score,
            errors,
            exact,
        }
    }

    /// Validate everything and prepare per-layer jobs.
    fn setup<'a>(
        &'a self,
        op: &'static str,
        captures: &'a [LayerCapture],
        budget: f64,
    ) -> Result<Setup<'a>> {
        if captures.is_empty() {
            return Err(Error::InvalidArgument {
                op,
                what: "no captures".into(),
            });
        }
        if !(budget.is_finite() && budget > 0.0) {
            return Err(Error::InvalidArgument {
                op,
                what: format!("budget must be a positive number of bits, got {budget}"),
            });
        }
        if self.max_queries == 0 {
            return Err(Error::InvalidArgument {
                op,
                what: "max_queries must be at least 1, got 0".into(),
            });
        }
        let w = &self.layer_weights;
        if !w.is_empty()
            && (w.len() != captures.len()
                || w.iter().any(|x| !(x.is_finite() && *x >= 0.0))
                || w.iter().all(|&x| x == 0.0))
        {
            return Err(Error::InvalidArgument {
                op,
                what: format!(
                    "layer weights must be one finite, non-negative weight per capture \
                     ({}), not all zero; got {w:?}",
                    captures.len()
                ),
            });
        }
        let mut jobs = Vec::with_capacity(captures.len());
        for cap in captures {
            let s = cap.shape();
            let scale = self.metrics.check(op, s.head_dim())?;
            let n = cap.queries();
            let m = self.max_queries.min(n);
            let positions: Vec<usize> = (0..m).map(|j| (2 * j + 1) * n / (2 * m)).collect();
            let vis = self.metrics.visible(op, &positions, n, cap.tokens())?;
            jobs.push(Job {
                cap,
                positions,
                vis,
                scale,
            });
        }
        let mut skipped = Vec::new();
        let mut filter = |list: &[Codec], role: Role| -> Vec<Codec> {
            let mut out = Vec::new();
            'codec: for &c in list {
                for cap in captures {
                    let sh = cap.shape();
                    if let Err(e) = c.build(sh.n_kv_heads(), sh.head_dim()) {
                        skipped.push(Skipped {
                            codec: c,
                            role,
                            reason: e,
                        });
                        continue 'codec;
                    }
                }
                out.push(c);
            }
            out
        };
        let keys = filter(&self.keys, Role::Keys);
        let values = filter(&self.values, Role::Values);
        for (list, name) in [(&keys, "key"), (&values, "value")] {
            if list.is_empty() {
                return Err(Error::InvalidArgument {
                    op,
                    what: format!("no candidate {name} scheme fits the captures' shapes"),
                });
            }
        }
        let width: Vec<f64> = captures
            .iter()
            .map(|c| (c.shape().n_kv_heads() * c.shape().head_dim()) as f64)
            .collect();
        let bits_of = |s: &Codec| -> Vec<f64> {
            captures
                .iter()
                .map(|c| {
                    let sh = c.shape();
                    // The built codec's layout: outlier entries count.
                    s.build(sh.n_kv_heads(), sh.head_dim())
                        .map(|b| b.layout().effective_bits())
                        .expect("filtered above")
                })
                .collect()
        };
        let key_bits = keys.iter().map(bits_of).collect();
        let value_bits = values.iter().map(bits_of).collect();
        Ok(Setup {
            jobs,
            keys,
            values,
            key_bits,
            value_bits,
            width,
            skipped,
            top_k: self.metrics.top_k(),
        })
    }

    /// Score `lists[l]` on layer `l`, for every layer, in parallel.
    fn run(
        &self,
        setup: &Setup<'_>,
        lists: &[Vec<(usize, usize)>],
        exact: bool,
    ) -> Result<Vec<LayerScores>> {
        let n = setup.jobs.len();
        let threads = match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |t| t.get()),
            t => t,
        }
        .min(n)
        .max(1);
        let work = |l: usize| score_layer(setup, l, &lists[l], exact);
        let mut out: Vec<Option<LayerScores>> = (0..n).map(|_| None).collect();
        if threads == 1 {
            for (l, o) in out.iter_mut().enumerate() {
                *o = Some(work(l));
            }
        } else {
            let results: Vec<Vec<(usize, LayerScores)>> = std::thread::scope(|sc| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let work = &work;
                        sc.spawn(move || {
                            (t..n)
                                .step_by(threads)
                                .map(|l| (l, work(l)))
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                    .collect()
            });
            for (l, s) in results.into_iter().flatten() {
                out[l] = Some(s);
            }
        }
        Ok(out
            .into_iter()
            .map(|s| s.expect("every layer is scored"))
            .collect())
    }
}

pub(super) const EPS: f64 = 1e-9;

pub(super) fn no_fit(
    op: &'static str,
    budget: f64,
    setup: &Setup<'_>,
    pairs: &[(usize, usize)],
) -> Error {
    let cheapest = pairs
        .iter()
        .map(|&(k, v)| setup.pair_bits(k, v))
        .fold(f64::INFINITY, f64::min);
    Error::InvalidArgument {
        op,
        what: if cheapest.is_finite() {
            format!(
                "no key/value pair fits {budget} effective bits (the cheapest needs {cheapest:.4})"
            )
        } else {
            format!("no key/value pair could be scored within {budget} effective bits")
        },
    }
}

pub(super) fn refine_failed(op: &'static str) -> Error {
    Error::InvalidArgument {
        op,
        what: "a scheme that quantized the captures once failed on the second pass".into(),
    }
}

/// Ranking order: score, then bits, then labels (deterministic).
pub(super) fn rank_cmp(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    a.score
        .total_cmp(&b.score)
        .then(a.effective_bits.total_cmp(&b.effective_bits))
        .then_with(|| a.keys.label().cmp(&b.keys.label()))
        .then_with(|| a.values.label().cmp(&b.values.label()))
}

/// Indices of the Pareto front (bits vs score), by increasing bits.
pub(super) fn pareto_indices(entries: &[Candidate]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by(|&a, &b| {
        entries[a]
            .effective_bits
            .total_cmp(&entries[b].effective_bits)
            .then_with(|| rank_cmp(&entries[a], &entries[b]))
    });
    let mut front: Vec<usize> = Vec::new();
    for i in order {
        if front
            .last()
            .is_none_or(|&f| entries[i].score < entries[f].score)
        {
            front.push(i);
        }
    }
    front
}

pub(super) struct Job<'a> {
    cap: &'a LayerCapture,
    positions: Vec<usize>,
    vis: Vec<usize>,
    scale: f64,
}

pub(super) struct Setup<'a> {
    jobs: Vec<Job<'a>>,
    keys: Vec<Codec>,
    values: Vec<Codec>,
    /// `[codec][layer]` effective bits.
    key_bits: Vec<Vec<f64>>,
    value_bits: Vec<Vec<f64>>,
    /// `n_kv_heads·head_dim` per layer.
    width: Vec<f64>,
    skipped: Vec<Skipped>,
    top_k: usize,
}

impl Setup<'_> {
    fn pairs(&self) -> Vec<(usize, usize)> {
        (0..self.keys.len())
            .flat_map(|k| (0..self.values.len()).map(move |v| (k, v)))
            .collect()
    }
    fn layer_pair_bits(&self, l: usize, k: usize, v: usize) -> f64 {
        (self.key_bits[k][l] + self.value_bits[v][l]) / 2.0
    }
    fn pair_bits(&self, k: usize, v: usize) -> f64 {
        let tw: f64 = self.width.iter().sum();
        (0..self.width.len())
            .map(|l| self.layer_pair_bits(l, k, v) * self.width[l] / tw)
            .sum()
    }
    /// Which pairs survived quantization on every layer, and the skipped
    /// list including the schemes that failed there.
    #[allow(clippy::type_complexity)]
    fn survivors(
        &self,
        scores: &[LayerScores],
    ) -> (Box<dyn Fn(usize, usize) -> bool>, Vec<Skipped>) {
        let mut bad_k = vec![false; self.keys.len()];
        let mut bad_v = vec![false; self.values.len()];
        let mut skipped = self.skipped.clone();
        for l in scores {
            for (i, e) in &l.failed_keys {
                if !bad_k[*i] {
                    bad_k[*i] = true;
                    skipped.push(Skipped {
                        codec: self.keys[*i],
                        role: Role::Keys,
                        reason: e.clone(),
                    });
                }
            }
            for (i, e) in &l.failed_values {
                if !bad_v[*i] {
                    bad_v[*i] = true;
                    skipped.push(Skipped {
                        codec: self.values[*i],
                        role: Role::Values,
                        reason: e.clone(),
                    });
                }
            }
        }
        (Box::new(move |k, v| !bad_k[k] && !bad_v[v]), skipped)
    }
}

pub(super) struct LayerScores {
    /// Per pair of the layer's list; `None` when a scheme failed.
    pairs: Vec<Option<ErrorSummary>>,
    failed_keys: Vec<(usize, Error)>,
    failed_values: Vec<(usize, Error)>,
}

/// Per key scheme and KV head: what pair scoring needs.
pub(super) enum KeySide {
    /// `p̂` of the group's query rows, `[m, tokens]` (exact scoring).
    Probs(Vec<f64>),
    /// `(p̂ − p)·V`, `[m, hd]` (screening).
    Delta(Vec<f64>),
}

/// Per value scheme and KV head.
pub(super) enum ValueSide {
    /// `V̂` of the head, `[tokens, hd]` (exact scoring).
    Hat(Vec<f64>),
    /// `p·(V̂ − V)` of the group's query rows, `[m, hd]` (screening).
    Delta(Vec<f64>),
}

/// Key-side results of one key scheme: per KV head, the reconstruction, the
/// side, and the stats of each query head of its group.
pub(super) type KeyEntry = Vec<(Recon, KeySide, Vec<KeyStats>)>;
/// Value-side results of one value scheme: per KV head.
pub(super) type ValueEntry = Vec<(Recon, ValueSide)>;

pub(super) fn score_layer(
    setup: &Setup<'_>,
    l: usize,
    pairs: &[(usize, usize)],
    exact: bool,
) -> LayerScores {
    let job = &setup.jobs[l];
    let cap = job.cap;
    let s = cap.shape();
    let (hd, nkv, group) = (s.head_dim(), s.n_kv_heads(), s.group());
    let tokens = cap.tokens();

    // Exact attention of every KV head's group of query heads.
    let ks: Vec<Vec<f64>> = (0..nkv)
        .map(|h| head_rows(cap.k(), tokens, nkv, hd, h))
        .collect();
    let vs: Vec<Vec<f64>> = (0..nkv)
        .map(|h| head_rows(cap.v(), tokens, nkv, hd, h))
        .collect();
    let groups: Vec<QueryGroup> = (0..nkv)
        .map(|h| QueryGroup::new(cap, &job.positions, &job.vis, h))
        .collect();
    let refs: Vec<Attention> = (0..nkv)
        .map(|h| Attention::new(&groups[h].q, &groups[h].vis, &ks[h], tokens, hd, job.scale))
        .collect();
    let tops: Vec<Vec<Vec<u32>>> = refs.iter().map(|a| a.top_k(setup.top_k)).collect();
    let outs: Vec<Vec<f64>> = (0..nkv).map(|h| refs[h].output(&vs[h], hd)).collect();
    let zeros = vec![0f64; outs.first().map_or(0, |o| o.len())];
    let onorm: Vec<Vec<f64>> = (0..nkv)
        .map(|h| {
            (0..group)
                .map(|j| rows_err(&outs[h], &zeros, groups[h].rows(j), hd).0)
                .collect()
        })
        .collect();

    let mut used_k: Vec<usize> = pairs.iter().map(|p| p.0).collect();
    used_k.sort_unstable();
    used_k.dedup();
    let mut used_v: Vec<usize> = pairs.iter().map(|p| p.1).collect();
    used_v.sort_unstable();
    used_v.dedup();

    let mut failed_keys = Vec::new();
    let mut failed_values = Vec::new();
    let mut kside: Vec<Option<KeyEntry>> = (0..setup.keys.len()).map(|_| None).collect();
    for &ki in &used_k {
        let quantized = cap.quantized_keys(&setup.keys[ki]);
        let k_hat = match quantized {
            Ok(x) => x,
            Err(e) => {
                failed_keys.push((ki, e));
                continue;
            }
        };
        let entry = (0..nkv)
            .map(|h| {
                let kh = head_rows(&k_hat, tokens, nkv, hd, h);
                let recon = Recon::of(&ks[h], &kh);
                let g = &groups[h];
                let quant = Attention::new(&g.q, &g.vis, &kh, tokens, hd, job.scale);
                let stats = (0..group)
                    .map(|j| KeyStats::of(&refs[h], &tops[h], &quant, g.rows(j), setup.top_k))
                    .collect();
                let side = if exact {
                    KeySide::Probs(quant.p)
                } else {
                    let mut a = matmul_nn(&quant.p, &vs[h], g.vis.len(), tokens, hd);
                    for (x, o) in a.iter_mut().zip(&outs[h]) {
                        *x -= o;
                    }
                    KeySide::Delta(a)
                };
                (recon, side, stats)
            })
            .collect();
        kside[ki] = Some(entry);
    }
    let mut vside: Vec<Option<ValueEntry>> = (0..setup.values.len()).map(|_| None).collect();
    for &vi in &used_v {
        let quantized = cap.quantized_values(&setup.values[vi]);
        let v_hat = match quantized {
            Ok(x) => x,
            Err(e) => {
                failed_values.push((vi, e));
                continue;
            }
        };
        let entry = (0..nkv)
            .map(|h| {
                let vh = head_rows(&v_hat, tokens, nkv, hd, h);
                let recon = Recon::of(&vs[h], &vh);
                let side = if exact {
                    ValueSide::Hat(vh)
                } else {
                    let mut b = refs[h].output(&vh, hd);
                    for (x, o) in b.iter_mut().zip(&outs[h]) {
                        *x -= o;
                    }
                    ValueSide::Delta(b)
                };
                (recon, side)
            })
            .collect();
        vside[vi] = Some(entry);
    }

    let mut heads = Vec::with_capacity(s.n_q_heads());
    let scored = pairs
        .iter()
        .map(|&(ki, vi)| {
            let ke = kside[ki].as_ref()?;
            let ve = vside[vi].as_ref()?;
            heads.clear();
            for h in 0..nkv {
                let ((kr, kd, kst), (vr, vd)) = (&ke[h], &ve[h]);
                let g = &groups[h];
                let delta: Vec<f64> = match (kd, vd) {
                    (KeySide::Probs(ph), ValueSide::Hat(vh)) => {
                        let mut oh = matmul_nn(ph, vh, g.vis.len(), tokens, hd);
                        for (x, o) in oh.iter_mut().zip(&outs[h]) {
                            *x -= o;
                        }
                        oh
                    }
                    (KeySide::Delta(a), ValueSide::Delta(b)) => {
                        a.iter().zip(b).map(|(x, y)| x + y).collect()
                    }
                    _ => unreachable!("both sides are built in the same mode"),
                };
                for (j, st) in kst.iter().enumerate() {
                    let err = rows_err(&delta, &zeros, g.rows(j), hd).0;
                    heads.push(assemble(kr, vr, st, ratio(err, onorm[h][j])));
                }
            }
            Some(ErrorSummary::of(&heads))
        })
        .collect();
    LayerScores {
        pairs: scored,
        failed_keys,
        failed_values,
    }
}
