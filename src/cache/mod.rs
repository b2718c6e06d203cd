//! The streaming quantized KV cache.
//!
//! [`LayerCache`] holds one attention layer's keys and values; [`KvCache`]
//! holds all layers, each with its own schemes if wanted.
//!
//! # Where a token lives
//!
//! Positions `0..sinks` (attention sinks) stay exact forever. After them,
//! each of K and V keeps its newest tokens in full precision (the *residual
//! window*) and quantizes older ones into packed storage, **once**:
//!
//! * per-token schemes quantize a token when it leaves the residual window
//!   (with `residual = 0`, on arrival);
//! * per-channel schemes (KIVI keys) quantize a whole block of `group`
//!   tokens at once, when the oldest `group` full-precision tokens all lie
//!   outside the residual window — so between `residual` and
//!   `residual + group − 1` of the newest tokens are full precision, and no
//!   token is ever quantized twice (HF's `QuantizedCache` re-quantizes; kvq
//!   does not).
//!
//! A tensor with no scheme (`None`) is kept in full precision. Full-precision
//! parts are stored as `f32`.
//!
//! # Appends are all-or-nothing
//!
//! [`LayerCache::append`] and [`LayerCache::extend`] (and its ndarray forms
//! [`LayerCache::extend_view2`] and [`LayerCache::extend_view3`]) check
//! everything first — lengths or shapes, finiteness (NaN/inf is rejected,
//! naming token, head and channel), and that every scale the tokens will
//! need fits the scale format — and only then change the cache. A rejected
//! call leaves it byte-for-byte as it was.
//!
//! # Example: a KIVI-4 cache, streamed and attended
//! ```
//! use kvq::{Axis, CacheConfig, Group, LayerCache, QuantScheme};
//! let (n_kv, hd, n_q) = (2, 64, 4);
//! let keys = QuantScheme::new(4, Axis::PerChannel, Group::Size(32))?;
//! let values = QuantScheme::new(4, Axis::PerToken, Group::Size(32))?;
//! let cfg = CacheConfig::new(n_kv, hd).keys(keys).values(values).residual(128).sinks(4);
//! let mut cache = LayerCache::new(cfg)?;
//! let mut seed = 1u64;
//! let mut rnd = move || { seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17; (seed % 2001) as f32 / 1000.0 - 1.0 };
//! for _ in 0..1000 {
//!     let k: Vec<f32> = (0..n_kv * hd).map(|_| rnd()).collect();
//!     let v: Vec<f32> = (0..n_kv * hd).map(|_| rnd()).collect();
//!     cache.append(&k, &v)?;
//! }
//! let q: Vec<f32> = (0..n_q * hd).map(|_| rnd()).collect();
//! let mut out = vec![0.0; n_q * hd];
//! cache.attend(&q, n_q, &mut out)?;
//!
//! // The same attention, computed densely over what the cache holds.
//! let (k, v) = (cache.keys_f32(), cache.values_f32());
//! let want = kvq::cache::dense_attention(&q, n_q, &k, &v, n_kv, hd, 1.0 / 8.0);
//! for (a, b) in out.iter().zip(&want) { assert!((a - b).abs() < 1e-4); }
//! println!("{} bytes, {:.2} effective bits", cache.bytes().total(), cache.effective_bits());
//! # Ok::<(), kvq::Error>(())
//! ```

use crate::element::{as_f32, widen_into, Element};
use crate::error::{Error, Result};
use crate::kernels::{self, axpy, dot, Backend};
use crate::quant::codec::{Codec, KvCodec, Pending};
use crate::quant::{abs_max_finite, check_finite, check_len, check_rows};
use crate::scheme::{check_shape, Axis, Layout, QuantScheme};
use crate::store::PackedHead;
use crate::views::{check_tail, check_tokens, contiguous};
use ndarray::{Array3, ArrayView2, ArrayView3};
use std::sync::Arc;

mod attention;
mod config;
mod model;
mod page;
mod persist;
mod rope;
mod tensor;

pub use attention::dense_attention;
use attention::*;
pub use config::*;
pub use model::*;
use page::*;
pub use page::{PagePool, PoolStats, MAX_PAGE_TOKENS};
use rope::RopeTable;
pub use rope::{Rope, RopeScaling, RopeStyle};
use tensor::*;

/// Floats of each of K and V checked and stored at a time by `extend`
/// (256 KiB: K and V chunks together stay in L2).
const EXTEND_CHUNK_FLOATS: usize = 64 * 1024;

/// The lengths of a [`Tensor`]'s buffers at one moment (the packed
/// buffers' lengths follow from `packed`).
#[derive(Clone, Copy)]
struct Mark {
    sink: usize,
    tail: usize,
    tail_start: usize,
    packed: usize,
}

#[derive(Debug, Default, Clone)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    codes: Vec<u8>,
    params: Vec<u8>,
    outliers: Vec<u8>,
    /// Working copies of the K and V running ranges (min, max) for a
    /// call, swapped in on success (reused, so an append allocates nothing).
    pend: [Pending; 2],
}

/// Bytes `caches` hold together: each cache's own rows and packed
/// buffers, and every page that forks share
/// ([`LayerCache::fork`]) once.
pub fn resident_bytes<'a>(caches: impl IntoIterator<Item = &'a LayerCache>) -> CacheBytes {
    let mut seen = std::collections::HashSet::new();
    let mut total = CacheBytes::default();
    for c in caches {
        for t in [&c.k, &c.v] {
            total = total + t.own_bytes();
            for (id, b) in t.segments() {
                if seen.insert(id) {
                    total = total + b;
                }
            }
        }
    }
    total
}

/// Decode attention for many sequences at once, one new position each:
/// the batched decode step of a serving engine. `caches[i]` is sequence
/// `i`'s cache of this layer; `q` is `[caches.len(), n_q_heads·head_dim]`
/// and `out` the same shape. Every (sequence, KV head) pair is one unit of
/// work, spread over `threads` threads (0: all available) on scoped
/// threads joined before it returns; each unit is what
/// [`LayerCache::attend`] computes for that head on one thread, so the
/// output equals calling `attend` on each cache with `.threads(1)`, bit
/// for bit. The caches may differ in length and codecs, not in shape.
///
/// # Errors
/// [`Error::InvalidShape`] when the caches differ in `n_kv_heads` or
/// `head_dim`, and as [`LayerCache::attend`] for any one of them (shape
/// errors name the sequence); [`Error::Length`] when `q` or `out` is not
/// `caches.len()` rows.
/// Nothing is written to `out` on error.
///
/// # Example
/// ```
/// use kvq::{cache::attend_batch, presets, CacheConfig, LayerCache};
/// let (n_kv, hd, n_q) = (2, 64, 8);
/// let (keys, values) = presets::kivi(4)?;
/// let cfg = CacheConfig::new(n_kv, hd).keys(keys).values(values);
/// let mut seqs: Vec<LayerCache> = (0..3).map(|_| LayerCache::new(cfg)).collect::<Result<_, _>>()?;
/// for (i, s) in seqs.iter_mut().enumerate() {
///     for t in 0..100 * (i + 1) {
///         let row: Vec<f32> = (0..n_kv * hd).map(|c| ((t + c) % 7) as f32 / 7.0).collect();
///         s.append(&row, &row)?;
///     }
/// }
/// let q = vec![0.1f32; 3 * n_q * hd];
/// let mut out = vec![0f32; q.len()];
/// let refs: Vec<&LayerCache> = seqs.iter().collect();
/// attend_batch(&refs, &q, n_q, &mut out, 0)?;
/// # Ok::<(), kvq::Error>(())
/// ```
pub fn attend_batch<T: Element>(
    caches: &[&LayerCache],
    q: &[T],
    n_q_heads: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    let op = "attend_batch";
    let Some(first) = caches.first() else {
        check_len(op, "query values", 0, q.len())?;
        return check_len(op, "output values", 0, out.len());
    };
    let (n_kv, hd) = (first.cfg.n_kv_heads, first.cfg.head_dim);
    let n_seq = caches.len();
    let qw = query_width(op, n_q_heads, hd)?;
    let total = n_seq.checked_mul(qw).ok_or_else(|| Error::InvalidShape {
        op,
        what: format!("{n_seq} sequences of {qw} query values do not fit"),
    })?;
    check_len(
        op,
        "query values (caches × n_q_heads·head_dim)",
        total,
        q.len(),
    )?;
    check_len(op, "output values", total, out.len())?;
    let mut qs = Vec::with_capacity(n_seq);
    for (i, c) in caches.iter().enumerate() {
        let named = |e: Error| Error::InvalidShape {
            op,
            what: format!("sequence {i}: {e}"),
        };
        if (c.cfg.n_kv_heads, c.cfg.head_dim) != (n_kv, hd) {
            return Err(named(Error::InvalidShape {
                op,
                what: format!(
                    "{}x{} heads, where sequence 0 has {n_kv}x{hd}",
                    c.cfg.n_kv_heads, c.cfg.head_dim
                ),
            }));
        }
        c.check_heads(op, n_q_heads).map_err(named)?;
        let qi = &q[i * qw..(i + 1) * qw];
        qs.push(c.prepared_queries(op, qi, n_q_heads)?);
    }
    let r = n_q_heads / n_kv;
    let unit = r * hd;
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // One position per sequence: `out` is [sequence][KV head][r·hd], unit
    // `i·n_kv + h` is sequence i, head h. The units go to the threads in
    // contiguous ranges of about equal work (cached tokens plus a fixed
    // cost per call), not equal counts: a batch ordered by length would
    // otherwise leave one thread most of its tokens.
    let units = n_seq * n_kv;
    let parts = balanced_split(out, unit, units, threads, 1, |u| {
        caches[u / n_kv].len + BATCH_UNIT_COST
    });
    fan_out(parts, |_, (us, block)| {
        let mut ws = HeadScratch::default();
        for (k, dst) in block.chunks_mut(unit).enumerate() {
            let u = us.start + k;
            let (i, h) = (u / n_kv, u % n_kv);
            let qh = &qs[i][h * unit..(h + 1) * unit];
            caches[i].head_attention(h, qh, 1, 0..1, r, None, dst, &mut ws);
        }
    });
    for (i, c) in caches.iter().enumerate() {
        if let Some(v) = c.v.codec.as_ref().filter(|v| v.transforms()) {
            v.transform_out(&mut out[i * qw..(i + 1) * qw]);
        }
    }
    Ok(())
}

/// `out`, `n` items of `width` values, split into at most `threads`
/// contiguous ranges of about equal `cost` (inner edges on multiples of
/// `step`), each with its items' range.
fn balanced_split(
    out: &mut [f32],
    width: usize,
    n: usize,
    threads: usize,
    step: usize,
    cost: impl Fn(usize) -> usize,
) -> Vec<(std::ops::Range<usize>, &mut [f32])> {
    let t = threads.min(n).max(1);
    let total: usize = (0..n).map(&cost).sum();
    let mut edges = vec![0];
    let mut acc = 0;
    for i in 0..n {
        acc += cost(i);
        let e = (i + 1).div_ceil(step) * step;
        if edges.len() < t && e < n && e > edges[edges.len() - 1] && acc * t >= total * edges.len()
        {
            edges.push(e);
        }
    }
    edges.push(n);
    let mut parts = Vec::with_capacity(edges.len() - 1);
    let mut rest = out;
    for w in edges.windows(2) {
        let (mine, tail) = rest.split_at_mut((w[1] - w[0]) * width);
        parts.push((w[0]..w[1], mine));
        rest = tail;
    }
    parts
}

/// What one (sequence, KV head) call of `attend_batch` costs beyond its
/// tokens, in tokens: its setup (sections, scratch, the first tile's
/// misses) when the batch is split over threads.
const BATCH_UNIT_COST: usize = 64;

/// Values of one position's queries, `n_q_heads·head_dim`, when it fits.
fn query_width(op: &'static str, n_q_heads: usize, hd: usize) -> Result<usize> {
    n_q_heads
        .checked_mul(hd)
        .ok_or_else(|| Error::InvalidShape {
            op,
            what: format!("{n_q_heads} query heads of {hd} channels do not fit"),
        })
}

/// Query rows from which full-precision sections are attended through the
/// blocked dense kernels (their head's rows gathered into one buffer
/// first): prefill blocks, and decode with 8 or more query heads per KV
/// head. Fewer rows read the section in place.
const DENSE_BLOCK_ROWS: usize = 8;

/// Pre-RoPE keys are decoded and rotated about this many tokens at a time.
const ROPE_CHUNK: usize = 256;

/// Before section `i` is computed, ask for the start of section `i + 1`
/// when it is packed (the next page).
fn prefetch_next(backend: Backend, secs: &[Section<'_>], i: usize) {
    if let Some(Section {
        data: SectionData::Packed(v),
        ..
    }) = secs.get(i + 1)
    {
        kernels::prefetch_head(backend, v);
    }
}

/// Head `h`'s `n` rows of full-precision `data` (`[n, width]`), contiguous.
fn head_rows(data: &[f32], width: usize, h: usize, hd: usize, out: &mut [f32]) {
    for (t, row) in out.chunks_exact_mut(hd).enumerate() {
        row.copy_from_slice(&data[t * width + h * hd..][..hd]);
    }
}

/// Two scratch slices of `n1` and `n2` floats from `v`, the first starting
/// on a 64-byte line: the dense kernels' 512-bit loads of gathered rows
/// then never split a line (unaligned rows measured 0.6x the speed).
fn aligned_pair(v: &mut Vec<f32>, n1: usize, n2: usize) -> (&mut [f32], &mut [f32]) {
    let need = n1 + n2 + 16;
    if v.len() < need {
        v.resize(need, 0.0);
    }
    let off = (64 - v.as_ptr() as usize % 64) % 64 / 4;
    let (a, b) = v[off..].split_at_mut(n1);
    (a, &mut b[..n2])
}

/// A checked [`LayerCache::truncate`]: the new length and, for each of K
/// and V, the packed tokens kept, the new full-precision tail and its
/// running range.
struct Cut {
    len: usize,
    k: (usize, Vec<f32>, Pending),
    v: (usize, Vec<f32>, Pending),
}

impl Scratch {
    /// Drop buffers a long call grew past what appends need between calls
    /// (an f16 prompt widened to f32 would otherwise stay allocated, twice
    /// the prompt's size, for the cache's lifetime).
    fn release_large(&mut self) {
        let keep = 2 * EXTEND_CHUNK_FLOATS;
        for v in [&mut self.k, &mut self.v] {
            if v.capacity() > keep {
                *v = Vec::new();
            }
        }
        for v in [&mut self.codes, &mut self.params] {
            if v.capacity() > 4 * keep {
                *v = Vec::new();
            }
        }
    }
}

/// The quantized K/V cache of one attention layer.
///
/// See the [module docs](self) for where tokens live and an example.
#[derive(Debug)]
pub struct LayerCache {
    cfg: CacheConfig,
    len: usize,
    k: Tensor,
    v: Tensor,
    /// Pre-RoPE keys: the rotation of every cached position.
    rope: Option<RopeTable>,
    scratch: Scratch,
    backend: Backend,
    threads: usize,
}

impl Clone for LayerCache {
    /// A [`fork`](LayerCache::fork): every page shared, the sinks and the
    /// residual window copied, no call scratch.
    fn clone(&self) -> Self {
        LayerCache {
            cfg: self.cfg,
            len: self.len,
            k: self.k.clone(),
            v: self.v.clone(),
            rope: self.rope.clone(),
            scratch: Scratch::default(),
            backend: self.backend,
            threads: self.threads,
        }
    }
}

impl PartialEq for LayerCache {
    /// Equal when the configuration (apart from the backend and thread
    /// count, which say how to run, not what is stored), the length and
    /// every stored byte agree.
    fn eq(&self, o: &Self) -> bool {
        let content = |c: &CacheConfig| CacheConfig {
            backend: None,
            threads: 0,
            ..*c
        };
        content(&self.cfg) == content(&o.cfg) && self.len == o.len && self.k == o.k && self.v == o.v
    }
}

impl LayerCache {
    /// An empty cache.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero heads or a `head_dim` that is not a
    /// positive multiple of 8, and [`Error::SchemeShape`] when a scheme does
    /// not fit `head_dim` (see [`QuantScheme::layout`]).
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        Self::build(cfg, None)
    }

    /// An empty cache whose packed tokens live in pages of `pool` (see
    /// [`PagePool`]): a sequence of a serving engine.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn new_in(cfg: CacheConfig, pool: &PagePool) -> Result<Self> {
        Self::build(cfg, Some(pool.handle()))
    }

    fn build(cfg: CacheConfig, pool: Option<Arc<PoolInner>>) -> Result<Self> {
        check_shape("LayerCache::new", cfg.n_kv_heads, cfg.head_dim)?;
        if let Some(s) = cfg.softmax_scale.filter(|s| !s.is_finite()) {
            return Err(Error::InvalidConfig {
                op: "LayerCache::new",
                what: format!("softmax_scale must be finite, got {s}"),
            });
        }
        let build = |c: Option<Codec>| {
            c.map(|c| {
                c.with_int8_kernels(c.int8_kernels() || cfg.int8)
                    .build(cfg.n_kv_heads, cfg.head_dim)
            })
            .transpose()
        };
        let (lk, lv) = (build(cfg.keys)?, build(cfg.values)?);
        if let Some(rope) = cfg.rope {
            rope.check("LayerCache::new", cfg.head_dim)?;
            if lk.as_ref().is_some_and(|c| c.transforms()) {
                return Err(Error::InvalidConfig {
                    op: "LayerCache::new",
                    what: "pre-RoPE keys cannot be rotated: RoPE is applied to the keys \
                           as stored, and a rotation mixes their channels"
                        .into(),
                });
            }
        }
        let threads = match cfg.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        Ok(LayerCache {
            cfg,
            len: 0,
            k: Tensor::new(
                lk,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.sinks,
                cfg.residual,
                pool.clone(),
            ),
            v: Tensor::new(
                lv,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.sinks,
                cfg.residual,
                pool,
            ),
            rope: cfg.rope.map(RopeTable::new),
            scratch: Scratch::default(),
            backend: cfg.backend.unwrap_or_else(Backend::detect),
            threads,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Tokens of keys / values held in packed form.
    pub fn packed_len(&self) -> (usize, usize) {
        (self.k.packed, self.v.packed)
    }
    /// The backend the kernels run on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Forget every token (e.g. between evaluation windows), keeping the
    /// full-precision buffers' allocations; pages are let go (back to the
    /// pool, for a cache in one).
    pub fn clear(&mut self) {
        self.len = 0;
        self.k.clear();
        self.v.clear();
    }

    /// A copy of the cache that shares its packed tokens with this one
    /// instead of copying them (beam search, parallel sampling, a prompt
    /// prefix reused by many requests).
    ///
    /// Packed tokens live in reference-counted pages (4096 tokens outside
    /// a [`PagePool`], the pool's size inside one; rounded up to whole
    /// per-channel blocks), and a page is written only while one cache
    /// holds it. A fork holds every page of the original, the one being
    /// filled included, and copies only the sinks and the residual window
    /// (full precision, bounded by the configuration): forking a long
    /// prompt copies no packed byte. The first append into a shared page
    /// copies that page (copy on write), once per holder that writes; a
    /// `truncate` into a shared page shrinks only this cache's share of
    /// it. A fork equals the original byte for byte ([`PartialEq`],
    /// [`save`](Self::save)) and goes on exactly as the original would;
    /// [`resident_bytes`] and [`PoolStats`] count shared pages once.
    /// `fork` is `clone`: the sharing is the storage's, not the call's.
    ///
    /// # Example
    /// ```
    /// use kvq::{cache::resident_bytes, presets, CacheConfig, LayerCache};
    /// let (keys, values) = presets::kivi(4)?;
    /// let mut prompt = LayerCache::new(CacheConfig::new(2, 64).keys(keys).values(values))?;
    /// let row: Vec<f32> = (0..128).map(|c| (c % 5) as f32 / 5.0).collect();
    /// for _ in 0..8192 {
    ///     prompt.append(&row, &row)?;
    /// }
    /// let mut beams: Vec<LayerCache> = (0..4).map(|_| prompt.fork()).collect();
    /// for b in &mut beams {
    ///     b.append(&row, &row)?;
    /// }
    /// let alone = prompt.bytes().total() * 5;
    /// let shared = resident_bytes(beams.iter().chain([&prompt])).total();
    /// assert!(shared < alone / 3);
    /// # Ok::<(), kvq::Error>(())
    /// ```
    pub fn fork(&self) -> LayerCache {
        self.clone()
    }

    /// Keep the first `len` tokens and drop the rest: the rejected draft
    /// tokens of speculative decoding, or a prompt rewound to a shared
    /// prefix. Allocations are kept.
    ///
    /// Tokens in the sinks and the residual window are cut exactly, and so
    /// are per-token packed tokens (each token has its own params). A cut
    /// inside a per-channel block that is already quantized keeps the
    /// blocks before it packed and returns the block's surviving tokens to
    /// the full-precision tail *as decoded*: they carry the block's
    /// quantization error, and when their block fills again they are
    /// quantized a second time, with the new block's range (at most half
    /// a step of that grid more per element). A residual window at least
    /// as deep as the deepest rollback keeps every cut exact.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `len > self.len()`;
    /// [`Error::ScaleOverflow`] when the decoded tokens of a cut block
    /// could not be quantized again (values at the very top of the scale
    /// format's range). The cache is unchanged on error.
    ///
    /// # Example
    /// ```
    /// use kvq::{presets, CacheConfig, LayerCache};
    /// let (n_kv, hd) = (2, 64);
    /// let (keys, values) = presets::kivi(4)?;
    /// let cfg = CacheConfig::new(n_kv, hd).keys(keys).values(values).residual(32);
    /// let mut cache = LayerCache::new(cfg)?;
    /// let row = |t: usize| -> Vec<f32> { (0..n_kv * hd).map(|c| ((t * 31 + c) % 17) as f32 / 17.0).collect() };
    /// for t in 0..100 {
    ///     cache.append(&row(t), &row(t + 1))?;
    /// }
    /// let before = cache.keys_f32();
    /// // Four draft tokens rejected: within the residual window, exact.
    /// cache.truncate(96)?;
    /// assert_eq!(cache.keys_f32(), before[..96 * n_kv * hd]);
    /// assert!(cache.truncate(200).is_err());
    /// # Ok::<(), kvq::Error>(())
    /// ```
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let op = "truncate";
        if len > self.len {
            return Err(Error::InvalidArgument {
                op,
                what: format!("cannot keep {len} tokens of a cache of {}", self.len),
            });
        }
        if len == self.len {
            return Ok(());
        }
        let cut = self.prepare_cut(op, len)?;
        self.apply_cut(cut);
        Ok(())
    }

    /// Everything [`truncate`](Self::truncate) to `len ≤ self.len()`
    /// changes, computed and checked without changing the cache.
    fn prepare_cut(&self, op: &'static str, len: usize) -> Result<Cut> {
        let ((pk, rk), (pv, rv)) = (self.k.cut(len), self.v.cut(len));
        let ek = self.k.tail_pending(op, &rk, pk)?;
        let ev = self.v.tail_pending(op, &rv, pv)?;
        Ok(Cut {
            len,
            k: (pk, rk, ek),
            v: (pv, rv, ev),
        })
    }

    fn apply_cut(&mut self, c: Cut) {
        self.k.apply_cut(c.len, c.k.0, &c.k.1, c.k.2);
        self.v.apply_cut(c.len, c.v.0, &c.v.1, c.v.2);
        self.len = c.len;
    }

    /// Append one token: `k` and `v` are `[n_kv_heads·head_dim]`.
    ///
    /// # Errors
    /// [`Error::Length`] for wrong lengths, [`Error::NonFinite`] for NaN/inf
    /// (token 0), [`Error::ScaleOverflow`] when a scale would not fit its
    /// format. The cache is unchanged on error.
    pub fn append<T: Element>(&mut self, k: &[T], v: &[T]) -> Result<()> {
        self.extend_op("append", k, v)
    }

    /// Append many tokens (prefill): `k` and `v` are `[n, n_kv_heads·head_dim]`.
    /// Byte-for-byte the same result as appending them one at a time.
    ///
    /// # Errors
    /// As [`append`](Self::append), with the token index within the call;
    /// nothing is appended if any token is rejected.
    pub fn extend<T: Element>(&mut self, k: &[T], v: &[T]) -> Result<()> {
        self.extend_op("extend", k, v)
    }

    /// [`extend`](Self::extend) from ndarray views `[tokens,
    /// n_kv_heads·head_dim]`: one row per token, the layout of `extend`'s
    /// slices.
    ///
    /// Any strides work. A view in standard layout (row-major and
    /// contiguous, [`ArrayView2::is_standard_layout`]) is read in place with
    /// no copy; any other (transposed, sliced with a step, reversed) is
    /// first copied into one contiguous buffer per tensor of
    /// `tokens·n_kv_heads·head_dim` elements. Either way the cache ends up
    /// byte-for-byte as after `extend` of the same numbers.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when a view's second dimension is not
    /// `n_kv_heads·head_dim` or `k` and `v` hold different numbers of
    /// tokens; otherwise as [`extend`](Self::extend). The cache is
    /// unchanged on error.
    ///
    /// # Example
    /// ```
    /// use kvq::{presets, CacheConfig, Error, LayerCache};
    /// use ndarray::{s, Array2};
    /// let (n_kv, hd, tokens) = (2, 64, 40);
    /// let (keys, values) = presets::kivi(4)?;
    /// let mut cache = LayerCache::new(CacheConfig::new(n_kv, hd).keys(keys).values(values))?;
    /// let k = Array2::from_shape_fn((tokens, n_kv * hd), |(t, c)| ((t * 7 + c) % 13) as f32 / 13.0);
    /// let v = Array2::from_shape_fn((tokens, n_kv * hd), |(t, c)| ((t + 3 * c) % 11) as f32 / 11.0);
    /// cache.extend_view2(k.view(), v.view())?; // contiguous: read in place
    ///
    /// // Every other token: a strided view, copied first.
    /// cache.extend_view2(k.slice(s![..;2, ..]), v.slice(s![..;2, ..]))?;
    /// assert_eq!(cache.len(), tokens + tokens / 2);
    ///
    /// // A wrong width is an error, and nothing is appended.
    /// let e = cache.extend_view2(k.slice(s![.., ..100]), v.slice(s![.., ..100]));
    /// assert!(matches!(e, Err(Error::InvalidShape { .. })));
    /// assert_eq!(cache.len(), tokens + tokens / 2);
    /// # Ok::<(), kvq::Error>(())
    /// ```
    pub fn extend_view2<T: Element>(
        &mut self,
        k: ArrayView2<'_, T>,
        v: ArrayView2<'_, T>,
    ) -> Result<()> {
        let op = "extend_view2";
        let w = [self.cfg.n_kv_heads * self.cfg.head_dim];
        let names = "[tokens, n_kv_heads·head_dim]";
        check_tail(op, "keys have", k.shape(), &w, names)?;
        check_tail(op, "values have", v.shape(), &w, names)?;
        check_tokens(op, k.shape(), v.shape())?;
        let (mut bk, mut bv) = (Vec::new(), Vec::new());
        self.extend_op(op, contiguous(&k, &mut bk), contiguous(&v, &mut bv))
    }

    /// [`extend`](Self::extend) from ndarray views `[tokens, n_kv_heads,
    /// head_dim]`, the shape of a K or V projection split into heads.
    ///
    /// Strides as in [`extend_view2`](Self::extend_view2): a view in
    /// standard layout is read in place, any other is copied into one
    /// contiguous buffer per tensor first; the cache ends up byte-for-byte
    /// as after `extend` of the same numbers.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when a view's last two dimensions are not
    /// `[n_kv_heads, head_dim]` or `k` and `v` hold different numbers of
    /// tokens; otherwise as [`extend`](Self::extend). The cache is
    /// unchanged on error.
    ///
    /// # Example
    /// ```
    /// use kvq::{presets, CacheConfig, LayerCache};
    /// use ndarray::Array3;
    /// let (n_kv, hd, tokens) = (2, 64, 40);
    /// let (keys, values) = presets::kivi(4)?;
    /// let mut cache = LayerCache::new(CacheConfig::new(n_kv, hd).keys(keys).values(values))?;
    /// // Head-major `[n_kv_heads, tokens, head_dim]`, as many engines hold K and V.
    /// let k = Array3::from_shape_fn((n_kv, tokens, hd), |(h, t, c)| ((h + t * 7 + c) % 13) as f32 / 13.0);
    /// let v = Array3::from_shape_fn((n_kv, tokens, hd), |(h, t, c)| ((h + t + 3 * c) % 11) as f32 / 11.0);
    /// // Permuted to `[tokens, n_kv_heads, head_dim]` (not contiguous, so copied).
    /// cache.extend_view3(k.view().permuted_axes([1, 0, 2]), v.view().permuted_axes([1, 0, 2]))?;
    /// assert_eq!(cache.len(), tokens);
    /// assert_eq!(cache.keys_array().dim(), (tokens, n_kv, hd));
    /// # Ok::<(), kvq::Error>(())
    /// ```
    pub fn extend_view3<T: Element>(
        &mut self,
        k: ArrayView3<'_, T>,
        v: ArrayView3<'_, T>,
    ) -> Result<()> {
        let op = "extend_view3";
        let tail = [self.cfg.n_kv_heads, self.cfg.head_dim];
        let names = "[tokens, n_kv_heads, head_dim]";
        check_tail(op, "keys have", k.shape(), &tail, names)?;
        check_tail(op, "values have", v.shape(), &tail, names)?;
        check_tokens(op, k.shape(), v.shape())?;
        let (mut bk, mut bv) = (Vec::new(), Vec::new());
        self.extend_op(op, contiguous(&k, &mut bk), contiguous(&v, &mut bv))
    }

    fn extend_op<T: Element>(&mut self, op: &'static str, k: &[T], v: &[T]) -> Result<()> {
        let w = self.cfg.n_kv_heads * self.cfg.head_dim;
        if !k.len().is_multiple_of(w) || (op == "append" && k.len() != w) {
            return Err(Error::Length {
                op,
                what: "values for keys (a multiple of n_kv_heads·head_dim)",
                expected: w * (k.len() / w).max(1),
                got: k.len(),
            });
        }
        check_len(op, "values for values", k.len(), v.len())?;
        let mut s = std::mem::take(&mut self.scratch);
        let r = self.extend_checked(op, k, v, &mut s);
        s.release_large();
        self.scratch = s;
        r
    }

    fn extend_checked<T: Element>(
        &mut self,
        op: &'static str,
        k: &[T],
        v: &[T],
        s: &mut Scratch,
    ) -> Result<()> {
        let (n_kv, hd) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        let w = n_kv * hd;
        // f32 input is used in place; f16/bf16 is widened once.
        let (mut wk, mut wv) = (std::mem::take(&mut s.k), std::mem::take(&mut s.v));
        let (kf, vf) = (as_f32(k, &mut wk), as_f32(v, &mut wv));
        let r = if self.k.transforms() || self.v.transforms() {
            // Rotating codecs store (and check) the rotated rows, sinks and
            // residual window included. NaN/inf is reported as found in the
            // input, before the rotation spreads it over a head.
            check_finite(op, kf, n_kv, hd, 0)
                .and_then(|()| check_finite(op, vf, n_kv, hd, 0))
                .and_then(|()| {
                    let (rk, rv) = (self.k.stored_rows(kf), self.v.stored_rows(vf));
                    self.extend_f32(op, &rk, &rv, n_kv, hd, w, s)
                })
        } else {
            self.extend_f32(op, kf, vf, n_kv, hd, w, s)
        };
        (s.k, s.v) = (wk, wv);
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn extend_f32(
        &mut self,
        op: &'static str,
        k: &[f32],
        v: &[f32],
        n_kv: usize,
        hd: usize,
        w: usize,
        s: &mut Scratch,
    ) -> Result<()> {
        // Chunk by chunk, each checked and then stored while it is still in
        // L2 (one pass over the input from memory instead of two). A chunk
        // that fails its check undoes the chunks before it, and the whole
        // input is checked again in order for the error to report.
        let n = k.len() / w;
        let chunk = (EXTEND_CHUNK_FLOATS / w).max(8);
        // Every page the call takes, set aside before anything changes.
        let need =
            (self.k.page_bytes_for(n, self.len)).saturating_add(self.v.page_bytes_for(n, self.len));
        let mut ticket = reserve(op, self.k.pool.as_ref(), need)?;
        let marks = (self.k.mark(), self.v.mark(), self.len);
        let [mut pk, mut pv] = std::mem::take(&mut s.pend);
        pk.copy_from(&self.k.pend);
        pv.copy_from(&self.v.pend);
        let mut q = Scratch {
            codes: std::mem::take(&mut s.codes),
            params: std::mem::take(&mut s.params),
            ..Scratch::default()
        };
        let mut t = 0;
        let mut ok = true;
        while t < n {
            let e = (t + chunk).min(n);
            let (kc, vc) = (&k[t * w..e * w], &v[t * w..e * w]);
            // One pass per tensor finds both a non-finite value and the
            // largest |x| for the scale check.
            let ((ak, fk), (av, fv)) = (abs_max_finite(kc), abs_max_finite(vc));
            ok = fk
                && fv
                && self.k.check(op, kc, ak, self.len, &mut pk).is_ok()
                && self.v.check(op, vc, av, self.len, &mut pv).is_ok();
            if !ok {
                break;
            }
            self.k
                .push_rows(kc, self.len, self.backend, &mut q, &mut ticket);
            self.v
                .push_rows(vc, self.len, self.backend, &mut q, &mut ticket);
            self.len += e - t;
            self.k.compact_since(&marks.0);
            self.v.compact_since(&marks.1);
            t = e;
        }
        s.codes = q.codes;
        s.params = q.params;
        if ok {
            // The new ranges in; the old ones kept as next call's buffers.
            std::mem::swap(&mut self.k.pend, &mut pk);
            std::mem::swap(&mut self.v.pend, &mut pv);
        }
        s.pend = [pk, pv];
        if !ok {
            self.k.rollback(&marks.0);
            self.v.rollback(&marks.1);
            self.len = marks.2;
            return Err(self
                .check_all(op, k, v, n_kv, hd)
                .expect_err("a chunk failed its check"));
        }
        self.k.compact();
        self.v.compact();
        if let Some(r) = &mut self.rope {
            r.ensure(self.len);
        }
        Ok(())
    }

    /// Every check of an append of `k`, `v` in the order that decides
    /// which error is reported: non-finite keys, non-finite values, then
    /// scale overflow in keys and in values.
    fn check_all(
        &self,
        op: &'static str,
        k: &[f32],
        v: &[f32],
        n_kv: usize,
        hd: usize,
    ) -> Result<()> {
        check_finite(op, k, n_kv, hd, 0)?;
        check_finite(op, v, n_kv, hd, 0)?;
        let (mut pk, mut pv) = (self.k.pend.clone(), self.v.pend.clone());
        self.k
            .check(op, k, abs_max_finite(k).0, self.len, &mut pk)?;
        self.v.check(op, v, abs_max_finite(v).0, self.len, &mut pv)
    }

    /// Bytes held, by kind.
    pub fn bytes(&self) -> CacheBytes {
        self.k.bytes() + self.v.bytes()
    }

    /// Bits stored per cached K or V element, everything counted
    /// (`8·bytes / (2·len·n_kv_heads·head_dim)`); 0 when empty. Tends to the
    /// average of the two schemes' effective bits as the context grows.
    pub fn effective_bits(&self) -> f64 {
        if self.len == 0 {
            return 0.0;
        }
        let elems = 2 * self.len * self.cfg.n_kv_heads * self.cfg.head_dim;
        8.0 * self.bytes().total() as f64 / elems as f64
    }

    /// The keys as attention sees them, `[len, n_kv_heads·head_dim]`
    /// row-major: token `t`, head `h`, channel `c` at
    /// `(t·n_kv_heads + h)·head_dim + c`, sinks, packed and full-precision
    /// tokens in position order (dequantized; allocates — for tests and
    /// metrics, not the hot path).
    pub fn keys_f32(&self) -> Vec<f32> {
        self.k.to_f32()
    }
    /// The values as attention sees them, laid out as
    /// [`keys_f32`](Self::keys_f32).
    pub fn values_f32(&self) -> Vec<f32> {
        self.v.to_f32()
    }
    /// [`keys_f32`](Self::keys_f32) as an array `[len, n_kv_heads,
    /// head_dim]` (the same numbers in the same order; allocates).
    pub fn keys_array(&self) -> Array3<f32> {
        self.as_array(self.k.to_f32())
    }
    /// [`values_f32`](Self::values_f32) as an array `[len, n_kv_heads,
    /// head_dim]` (the same numbers in the same order; allocates).
    pub fn values_array(&self) -> Array3<f32> {
        self.as_array(self.v.to_f32())
    }

    fn as_array(&self, x: Vec<f32>) -> Array3<f32> {
        let shape = (self.len, self.cfg.n_kv_heads, self.cfg.head_dim);
        Array3::from_shape_vec(shape, x).expect("a tensor holds len·n_kv_heads·head_dim values")
    }

    fn scale(&self) -> f32 {
        self.cfg
            .softmax_scale
            .unwrap_or(1.0 / (self.cfg.head_dim as f32).sqrt())
    }

    /// The softmax scale attention uses: the configured one, or
    /// `1/√head_dim`.
    pub fn softmax_scale(&self) -> f32 {
        self.scale()
    }

    fn check_heads(&self, op: &'static str, n_q_heads: usize) -> Result<usize> {
        let n_kv = self.cfg.n_kv_heads;
        if n_q_heads == 0 || !n_q_heads.is_multiple_of(n_kv) {
            return Err(Error::InvalidShape {
                op,
                what: format!(
                    "n_q_heads {n_q_heads} is not a positive multiple of n_kv_heads {n_kv}"
                ),
            });
        }
        if self.len == 0 {
            return Err(Error::InvalidShape {
                op,
                what: "the cache is empty".into(),
            });
        }
        Ok(n_q_heads / n_kv)
    }

    /// Decode attention for one new position: `q` is `[n_q_heads·head_dim]`,
    /// `out` receives `[n_q_heads·head_dim]`. Query head `i` reads KV head
    /// `i / (n_q_heads / n_kv_heads)` (GQA/MQA); the query heads of one KV
    /// head are served in one pass over its packed bytes.
    ///
    /// Scores over sinks, packed tokens and full-precision tokens, a stable
    /// softmax, and the weighted sum of values — all from packed storage,
    /// with no dequantized copy. KV heads are spread over threads when the
    /// context is long enough to pay for it.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `n_q_heads` is not a positive multiple of
    /// `n_kv_heads` or the cache is empty; [`Error::Length`] for wrong `q`
    /// or `out` lengths; [`Error::NonFinite`] for NaN/inf in `q`.
    pub fn attend<T: Element>(&self, q: &[T], n_q_heads: usize, out: &mut [f32]) -> Result<()> {
        self.attend_causal(q, n_q_heads, out, None)
    }

    /// Attention for the last `n` cached positions at once (prefill or
    /// evaluation): `q` is `[n, n_q_heads·head_dim]` for positions
    /// `len−n .. len`, `out` the same shape. Query `j` sees positions up to
    /// its own (causal), and with `window = Some(w)` only the last `w` of
    /// them (sliding-window layers). Append the block's K/V first.
    ///
    /// Positions are taken in blocks of 64 query rows; each block's keys in
    /// chunks whose scores fit in L2, folded into a running softmax. With
    /// two or more blocks per KV head the threads take ranges of positions
    /// of about equal work, every KV head each, and write their own rows
    /// of `out` (so MQA's one KV head uses every thread too).
    ///
    /// # Errors
    /// As [`attend`](Self::attend); also [`Error::InvalidShape`] when `n`
    /// exceeds the cached length or `window` is `Some(0)`.
    pub fn attend_causal<T: Element>(
        &self,
        q: &[T],
        n_q_heads: usize,
        out: &mut [f32],
        window: Option<usize>,
    ) -> Result<()> {
        let op = "attend";
        let r = self.check_heads(op, n_q_heads)?;
        let hd = self.cfg.head_dim;
        let qw = query_width(op, n_q_heads, hd)?;
        let what = "query values (a positive multiple of n_q_heads·head_dim)";
        let n = check_rows(op, what, q.len(), qw)?;
        check_len(op, "output values", q.len(), out.len())?;
        if n > self.len {
            return Err(Error::InvalidShape {
                op,
                what: format!("{n} query positions but only {} cached tokens", self.len),
            });
        }
        if window == Some(0) {
            return Err(Error::InvalidShape {
                op,
                what: "window must be at least 1".into(),
            });
        }
        let n_kv = self.cfg.n_kv_heads;
        let per_head = n * r * hd;
        let threads = if self.len * n * n_kv >= PARALLEL_MIN_WORK {
            self.threads
        } else {
            1
        };
        if threads > 1 && n >= 2 * (QUERY_BLOCK / r).max(1) {
            // Prefill: threads take ranges of positions (all heads each),
            // so each writes its own rows of `out` with no shared copy.
            return self.attend_positions(q, n_q_heads, r, n, threads, window, out);
        }
        let qf = self.prepared_queries(op, q, n_q_heads)?;
        // Queries of KV head h, gathered position-major: [n, r, hd].
        let gather = |h: usize| {
            let mut qh = vec![0f32; per_head];
            for j in 0..n {
                let src = &qf[j * qw + h * r * hd..j * qw + (h + 1) * r * hd];
                qh[j * r * hd..(j + 1) * r * hd].copy_from_slice(src);
            }
            qh
        };
        let mut tmp = vec![0f32; n_kv * per_head];
        if threads > 1 && n == 1 && !n_kv.is_multiple_of(threads) {
            // Decode with fewer (or unevenly many) KV heads than threads:
            // split each head's tokens into chunks (flash-decoding), then
            // merge the partial softmaxes.
            self.attend_split(&gather, r, threads, window, &mut tmp);
        } else if threads > 1 && n_kv > 1 {
            let t = threads.min(n_kv);
            let chunk = n_kv.div_ceil(t);
            fan_out(tmp.chunks_mut(chunk * per_head), |ci, block| {
                let mut ws = HeadScratch::default();
                for (k, dst) in block.chunks_mut(per_head).enumerate() {
                    let h = ci * chunk + k;
                    self.head_attention(h, &gather(h), n, 0..n, r, window, dst, &mut ws);
                }
            });
        } else {
            let mut ws = HeadScratch::default();
            for (h, dst) in tmp.chunks_mut(per_head).enumerate() {
                self.head_attention(h, &gather(h), n, 0..n, r, window, dst, &mut ws);
            }
        }
        if let Some(c) = self.v.codec.as_ref().filter(|c| c.transforms()) {
            c.transform_out(&mut tmp);
        }
        // Scatter [h][j][r·hd] into [j][h·r·hd].
        for h in 0..n_kv {
            for j in 0..n {
                let src = &tmp[h * per_head + j * r * hd..h * per_head + (j + 1) * r * hd];
                out[j * qw + h * r * hd..j * qw + (h + 1) * r * hd].copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// `attend_causal` for `n` positions split into `threads` ranges of
    /// about equal work (a position's work is its visible length); each
    /// thread prepares its queries and writes its rows of `out`.
    #[allow(clippy::too_many_arguments)]
    fn attend_positions<T: Element>(
        &self,
        q: &[T],
        n_q_heads: usize,
        r: usize,
        n: usize,
        threads: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let op = "attend";
        let (hd, n_kv, len) = (self.cfg.head_dim, self.cfg.n_kv_heads, self.len);
        let qw = n_q_heads * hd;
        // Checked up front, a bounded slice at a time: a rejected call
        // writes nothing.
        let mut buf = Vec::new();
        let rows = (16 * 1024 / qw).max(1);
        for (c, chunk) in q.chunks(rows * qw).enumerate() {
            check_finite(op, as_f32(chunk, &mut buf), n_q_heads, hd, c * rows)?;
        }
        let visible = |j: usize| {
            let pos = len - n + j;
            window.map_or(pos + 1, |w| (pos + 1).min(w))
        };
        let sub = (QUERY_BLOCK / r).max(1);
        let parts = balanced_split(out, qw, n, threads, sub, visible);
        let scale = self.scale();
        let kt = self.k.codec.as_ref().filter(|c| c.transforms());
        let vt = self.v.codec.as_ref().filter(|c| c.transforms());
        fan_out(parts, |_, (js, dst)| {
            let mut ws = HeadScratch::default();
            let (mut qh, mut oh) = (Vec::new(), Vec::new());
            let m = js.len();
            for h in 0..n_kv {
                let qh = uninit_len(&mut qh, m * r * hd);
                for (k, j) in js.clone().enumerate() {
                    let src = &q[j * qw + h * r * hd..j * qw + (h + 1) * r * hd];
                    T::widen(src, &mut qh[k * r * hd..(k + 1) * r * hd]);
                }
                qh.iter_mut().for_each(|x| *x *= scale);
                if let Some(c) = kt {
                    c.transform_in(qh);
                }
                let oh = uninit_len(&mut oh, m * r * hd);
                self.head_attention(h, qh, n, js.clone(), r, window, oh, &mut ws);
                if let Some(c) = vt {
                    c.transform_out(oh);
                }
                for k in 0..m {
                    dst[k * qw + h * r * hd..k * qw + (h + 1) * r * hd]
                        .copy_from_slice(&oh[k * r * hd..(k + 1) * r * hd]);
                }
            }
        });
        Ok(())
    }

    /// `q` as the kernels take it: f32, checked finite, times the softmax
    /// scale, in the keys' stored space.
    fn prepared_queries<T: Element>(
        &self,
        op: &'static str,
        q: &[T],
        n_q_heads: usize,
    ) -> Result<Vec<f32>> {
        let mut qf = Vec::new();
        widen_into(q, &mut qf);
        check_finite(op, &qf, n_q_heads, self.cfg.head_dim, 0)?;
        let scale = self.scale();
        qf.iter_mut().for_each(|x| *x *= scale);
        if let Some(c) = self.k.codec.as_ref().filter(|c| c.transforms()) {
            c.transform_in(&mut qf);
        }
        Ok(qf)
    }

    /// Decode (one position) with every KV head's tokens split into
    /// `threads` chunks run in parallel; `dst` is `[n_kv, r, hd]`.
    fn attend_split(
        &self,
        gather: &(dyn Fn(usize) -> Vec<f32> + Sync),
        r: usize,
        threads: usize,
        window: Option<usize>,
        dst: &mut [f32],
    ) {
        let hd = self.cfg.head_dim;
        let n_kv = self.cfg.n_kv_heads;
        let len = self.len;
        let lo = window.map_or(0, |w| len.saturating_sub(w));
        // Chunk edges inside packed storage must fall on block boundaries.
        let align = lcm(self.k.unit_or_1(), self.v.unit_or_1());
        let sinks = self.cfg.sinks.min(len);
        let snap = |e: usize| {
            if e > sinks {
                sinks + (e - sinks) / align * align
            } else {
                e
            }
        };
        let span = (len - lo).div_ceil(threads);
        let mut edges = vec![snap(lo)];
        for c in 1..threads {
            let e = snap(lo + c * span);
            if e > *edges.last().unwrap() && e < len {
                edges.push(e);
            }
        }
        edges.push(len);
        let chunks = edges.len() - 1;
        let qs: Vec<Vec<f32>> = (0..n_kv).map(gather).collect();
        // Partials per (head, chunk): max, sum, unnormalized output.
        let mut parts: Vec<Partial> = (0..n_kv * chunks).map(|_| Partial::new(r, hd)).collect();
        let per = parts.len().div_ceil(threads);
        fan_out(parts.chunks_mut(per), |ti, block| {
            let mut scratch = AttnScratch::default();
            for (k, part) in block.iter_mut().enumerate() {
                let idx = ti * per + k;
                let (h, c) = (idx / chunks, idx % chunks);
                let vis = vec![(lo, len); r];
                self.partial(
                    h,
                    &qs[h],
                    r,
                    edges[c],
                    edges[c + 1],
                    &vis,
                    part,
                    &mut scratch,
                );
            }
        });
        for h in 0..n_kv {
            let ps = &parts[h * chunks..(h + 1) * chunks];
            let out = &mut dst[h * r * hd..(h + 1) * r * hd];
            merge(ps, r, hd, out);
        }
    }

    /// Attention of KV head `h` for positions `js` of the last `n` × `r`
    /// query heads (`qh` is `[js.len(), r, hd]`, pre-scaled); writes
    /// `[js.len(), r, hd]` into `dst`.
    #[allow(clippy::too_many_arguments)]
    fn head_attention(
        &self,
        h: usize,
        qh: &[f32],
        n: usize,
        js: std::ops::Range<usize>,
        r: usize,
        window: Option<usize>,
        dst: &mut [f32],
        ws: &mut HeadScratch,
    ) {
        let hd = self.cfg.head_dim;
        let len = self.len;
        // Query positions in sub-blocks so the score matrix stays small.
        let sub = (QUERY_BLOCK / r).max(1);
        let HeadScratch {
            attn: scratch,
            acc,
            part,
        } = ws;
        let first = js.start;
        let mut j0 = js.start;
        while j0 < js.end {
            let j1 = (j0 + sub).min(js.end);
            let rows = (j1 - j0) * r;
            // Visible range of each row: causal, and windowed.
            let vis: Vec<(usize, usize)> = (j0..j1)
                .flat_map(|j| {
                    let pos = len - n + j;
                    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    std::iter::repeat_n((lo, pos + 1), r)
                })
                .collect();
            let a = vis.iter().map(|v| v.0).min().unwrap_or(0);
            // Packed per-channel blocks must be entered at their start.
            let (sinks, align) = (
                self.cfg.sinks.min(len),
                lcm(self.k.unit_or_1(), self.v.unit_or_1()),
            );
            let a = if a > sinks {
                sinks + (a - sinks) / align * align
            } else {
                a
            };
            let b = len - n + j1;
            let q = &qh[(j0 - first) * r * hd..(j1 - first) * r * hd];
            // Several positions (prefill): keys in chunks whose score
            // matrix stays in L2, folded into a running softmax state.
            // One position (decode) takes its whole range at once.
            let span = if n > 1 {
                (SCORE_CHUNK_FLOATS / rows).max(align)
            } else {
                usize::MAX
            };
            // Several queries of one position (GQA decode): chunks end
            // where a section of the keys and one of the values both end
            // (a page, the sinks), so a chunk that is one section of each
            // has its kernels read and write their rows of scores in place
            // instead of through a copy.
            let cuts = if n == 1 && rows > 1 {
                self.common_ends(h, a, b)
            } else {
                Vec::new()
            };
            let mut cuts = cuts.into_iter();
            let mut c0 = a;
            while c0 < b {
                let e = c0.saturating_add(span);
                let c1 = if let Some(end) = cuts.next() {
                    end
                } else if e >= b {
                    b
                } else if e > sinks {
                    (sinks + (e - sinks) / align * align).max(c0 + 1).min(b)
                } else {
                    e
                };
                part.resize(rows, hd);
                self.partial(h, q, rows, c0, c1, &vis, part, scratch);
                if c0 == a {
                    std::mem::swap(acc, part);
                } else {
                    acc.absorb(part, hd);
                }
                c0 = c1;
            }
            merge(
                std::slice::from_ref(acc),
                rows,
                hd,
                &mut dst[(j0 - first) * r * hd..(j1 - first) * r * hd],
            );
            j0 = j1;
        }
    }

    /// The positions in `a+1..b` where a section of head `h`'s keys and
    /// one of its values both end, ascending: where a range can be split
    /// with every piece entering both at a section's start.
    fn common_ends(&self, h: usize, a: usize, b: usize) -> Vec<usize> {
        let ends = |t: &Tensor| -> Vec<usize> {
            t.sections(h, a, b)
                .iter()
                .map(|s| s.start + s.len)
                .filter(|&e| e < b)
                .collect()
        };
        let ve = ends(&self.v);
        ends(&self.k)
            .into_iter()
            .filter(|e| ve.binary_search(e).is_ok())
            .collect()
    }

    /// Unnormalized attention of `rows` queries over positions `a..b` of
    /// KV head `h`, each row restricted to its visible range `vis[row]`.
    #[allow(clippy::too_many_arguments)]
    fn partial(
        &self,
        h: usize,
        q: &[f32],
        rows: usize,
        a: usize,
        b: usize,
        vis: &[(usize, usize)],
        part: &mut Partial,
        s: &mut AttnScratch,
    ) {
        let width = b - a;
        // Every score is written by `k_scores` (the sections cover a..b).
        let scores = uninit_len(&mut s.scores, rows * width);
        self.k_scores(h, q, rows, a, b, scores, &mut s.tmp);
        for (i, (row, &(v0, v1))) in scores.chunks_exact_mut(width).zip(vis).enumerate() {
            let lo = v0.clamp(a, b) - a;
            let hi = v1.clamp(a, b) - a;
            row[..lo].fill(0.0);
            row[hi..].fill(0.0);
            let (m, sum) = kernels::softmax_parts_on(self.backend, &mut row[lo..hi]);
            part.max[i] = m;
            part.sum[i] = sum;
        }
        part.out.fill(0.0);
        let scores = &s.scores[..rows * width];
        self.v_sum(h, scores, rows, a, b, &mut part.out, &mut s.tmp);
    }

    /// Logits `[rows, b−a]` of `rows` queries against positions `a..b`.
    #[allow(clippy::too_many_arguments)]
    fn k_scores(
        &self,
        h: usize,
        q: &[f32],
        rows: usize,
        a: usize,
        b: usize,
        out: &mut [f32],
        tmp: &mut Vec<f32>,
    ) {
        let hd = self.cfg.head_dim;
        let width = b - a;
        if let Some(rope) = &self.rope {
            return self.k_scores_rope(rope, h, q, rows, a, b, out, tmp);
        }
        let secs = self.k.sections(h, a, b);
        for (si, sec) in secs.iter().enumerate() {
            prefetch_next(self.backend, &secs, si);
            let off = sec.start - a;
            match sec.data {
                SectionData::Dense(data) if rows >= DENSE_BLOCK_ROWS => {
                    // Many queries (prefill): the head's rows gathered once,
                    // then the blocked dense kernel over all of them.
                    let (keys, tmp) = aligned_pair(tmp, sec.len * hd, rows * sec.len);
                    head_rows(data, self.k.width, h, hd, keys);
                    kernels::dense::scores_f32_on(self.backend, hd, keys, q, tmp)
                        .expect("lengths are consistent");
                    for i in 0..rows {
                        out[i * width + off..i * width + off + sec.len]
                            .copy_from_slice(&tmp[i * sec.len..(i + 1) * sec.len]);
                    }
                }
                SectionData::Dense(data) => {
                    for t in 0..sec.len {
                        let k = &data[t * self.k.width + h * hd..][..hd];
                        for i in 0..rows {
                            out[i * width + off + t] = dot(&q[i * hd..(i + 1) * hd], k);
                        }
                    }
                }
                SectionData::Packed(view) => {
                    let c = self.k.codec.as_ref().expect("packed tokens have a codec");
                    if rows == 1 || sec.len == width {
                        // One query, or a section spanning the range: the
                        // scores go straight to their place.
                        let out = &mut out[off..off + (rows - 1) * width + sec.len];
                        c.scores(self.backend, &view, q, out)
                            .expect("lengths are consistent");
                        continue;
                    }
                    let tmp = uninit_len(tmp, rows * sec.len);
                    c.scores(self.backend, &view, q, tmp)
                        .expect("lengths are consistent");
                    for i in 0..rows {
                        out[i * width + off..i * width + off + sec.len]
                            .copy_from_slice(&tmp[i * sec.len..(i + 1) * sec.len]);
                    }
                }
            }
        }
    }

    /// [`k_scores`](Self::k_scores) of pre-RoPE keys: packed uniform
    /// sections through the SIMD kernel (`kernels::rope`) when it takes the
    /// shape; otherwise each section's keys decoded (or copied) a chunk at a
    /// time, rotated to their positions, then scored by the dense kernel.
    #[allow(clippy::too_many_arguments)]
    fn k_scores_rope(
        &self,
        rope: &RopeTable,
        h: usize,
        q: &[f32],
        rows: usize,
        a: usize,
        b: usize,
        out: &mut [f32],
        tmp: &mut Vec<f32>,
    ) {
        let hd = self.cfg.head_dim;
        let width = b - a;
        // Chunks of whole per-channel blocks, about 256 tokens: the rotated
        // keys stay in L2 between the rotation and the scores.
        let unit = self.k.unit_or_1();
        let chunk = ROPE_CHUNK.div_ceil(unit) * unit;
        let mut keys = Vec::new();
        // The SIMD kernel reads the uniform grid; other codecs decode.
        let uniform = self
            .k
            .codec
            .as_ref()
            .is_some_and(|c| c.spec().levels().is_none());
        for sec in self.k.sections(h, a, b) {
            if let (SectionData::Packed(view), true) = (&sec.data, uniform) {
                // The SIMD kernel, when it takes the shape: the whole
                // section at once.
                let s = uninit_len(tmp, rows * sec.len);
                let rr = rope.rows();
                if kernels::rope::rope_scores_on(self.backend, &view.grid(), &rr, sec.start, q, s) {
                    let off = sec.start - a;
                    for i in 0..rows {
                        out[i * width + off..i * width + off + sec.len]
                            .copy_from_slice(&s[i * sec.len..(i + 1) * sec.len]);
                    }
                    // Outliers: each entry's share of the rotated key.
                    rope.add_outlier_scores(
                        self.backend,
                        view,
                        sec.start,
                        q,
                        rows,
                        hd,
                        &mut out[off..],
                        width,
                    );
                    continue;
                }
            }
            let mut t0 = 0;
            while t0 < sec.len {
                let t1 = (t0 + chunk).min(sec.len);
                let n = t1 - t0;
                let k = uninit_len(&mut keys, n * hd);
                match &sec.data {
                    SectionData::Dense(data) => {
                        for (t, dst) in k.chunks_exact_mut(hd).enumerate() {
                            dst.copy_from_slice(&data[(t0 + t) * self.k.width + h * hd..][..hd]);
                        }
                    }
                    SectionData::Packed(view) => {
                        let c = self.k.codec.as_ref().expect("packed tokens have a codec");
                        c.decode(&sub_view(*view, t0, t1), k);
                    }
                }
                rope.apply_rows(k, hd, sec.start + t0);
                let s = uninit_len(tmp, rows * n);
                kernels::dense::scores_f32_on(self.backend, hd, k, q, s)
                    .expect("lengths are consistent");
                let off = sec.start - a + t0;
                for i in 0..rows {
                    out[i * width + off..i * width + off + n]
                        .copy_from_slice(&s[i * n..(i + 1) * n]);
                }
                t0 = t1;
            }
        }
    }

    /// `dst[rows, hd] += p[rows, b−a] · V[a..b]`.
    #[allow(clippy::too_many_arguments)]
    fn v_sum(
        &self,
        h: usize,
        p: &[f32],
        rows: usize,
        a: usize,
        b: usize,
        dst: &mut [f32],
        tmp: &mut Vec<f32>,
    ) {
        let hd = self.cfg.head_dim;
        let width = b - a;
        let secs = self.v.sections(h, a, b);
        for (si, sec) in secs.iter().enumerate() {
            prefetch_next(self.backend, &secs, si);
            let off = sec.start - a;
            match sec.data {
                SectionData::Dense(data) if rows >= DENSE_BLOCK_ROWS => {
                    let (values, tmp) = aligned_pair(tmp, sec.len * hd, rows * sec.len);
                    head_rows(data, self.v.width, h, hd, values);
                    for i in 0..rows {
                        tmp[i * sec.len..(i + 1) * sec.len]
                            .copy_from_slice(&p[i * width + off..i * width + off + sec.len]);
                    }
                    kernels::dense::weighted_sum_f32_on(self.backend, hd, values, tmp, dst)
                        .expect("lengths are consistent");
                }
                SectionData::Dense(data) => {
                    for t in 0..sec.len {
                        let v = &data[t * self.v.width + h * hd..][..hd];
                        for i in 0..rows {
                            let w = p[i * width + off + t];
                            if w != 0.0 {
                                axpy(w, v, &mut dst[i * hd..(i + 1) * hd]);
                            }
                        }
                    }
                }
                SectionData::Packed(view) => {
                    let c = self.v.codec.as_ref().expect("packed tokens have a codec");
                    if rows == 1 || sec.len == width {
                        // One query, or a section spanning the range: the
                        // weights are read in place.
                        let p = &p[off..off + (rows - 1) * width + sec.len];
                        c.weighted_sum(self.backend, &view, p, dst)
                            .expect("lengths are consistent");
                        continue;
                    }
                    let tmp = uninit_len(tmp, rows * sec.len);
                    for i in 0..rows {
                        tmp[i * sec.len..(i + 1) * sec.len]
                            .copy_from_slice(&p[i * width + off..i * width + off + sec.len]);
                    }
                    c.weighted_sum(self.backend, &view, tmp, dst)
                        .expect("lengths are consistent");
                }
            }
        }
    }
}
