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
use crate::quant::{
    abs_max_finite, check_finite, check_len, group_params, quantize_channel_block, quantize_token,
};
use crate::scheme::{check_shape, Axis, Layout, QuantScheme};
use crate::store::PackedHead;
use crate::views::{check_tail, check_tokens, contiguous};
use ndarray::{Array3, ArrayView2, ArrayView3};

/// Configuration of one layer's cache. Checked by [`LayerCache::new`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheConfig {
    n_kv_heads: usize,
    head_dim: usize,
    keys: Option<QuantScheme>,
    values: Option<QuantScheme>,
    residual: usize,
    sinks: usize,
    softmax_scale: Option<f32>,
    backend: Option<Backend>,
    threads: usize,
    int8: bool,
}

impl CacheConfig {
    /// A full-precision cache of this shape: no schemes, no residual window,
    /// no sinks, softmax scale `1/√head_dim`, the detected backend, all
    /// available threads.
    pub fn new(n_kv_heads: usize, head_dim: usize) -> Self {
        CacheConfig {
            n_kv_heads,
            head_dim,
            keys: None,
            values: None,
            residual: 0,
            sinks: 0,
            softmax_scale: None,
            backend: None,
            threads: 0,
            int8: false,
        }
    }
    /// Quantize keys with `scheme`.
    pub fn keys(mut self, scheme: QuantScheme) -> Self {
        self.keys = Some(scheme);
        self
    }
    /// Quantize values with `scheme`.
    pub fn values(mut self, scheme: QuantScheme) -> Self {
        self.values = Some(scheme);
        self
    }
    /// Keep keys in full precision (`None`) or quantize them.
    pub fn keys_opt(mut self, scheme: Option<QuantScheme>) -> Self {
        self.keys = scheme;
        self
    }
    /// Keep values in full precision (`None`) or quantize them.
    pub fn values_opt(mut self, scheme: Option<QuantScheme>) -> Self {
        self.values = scheme;
        self
    }
    /// Keep the newest `tokens` in full precision.
    pub fn residual(mut self, tokens: usize) -> Self {
        self.residual = tokens;
        self
    }
    /// Keep the first `tokens` (attention sinks) exact forever.
    pub fn sinks(mut self, tokens: usize) -> Self {
        self.sinks = tokens;
        self
    }
    /// Multiply logits by `scale` before the softmax (default `1/√head_dim`).
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    /// Run the kernels on `backend` (default: [`Backend::detect`]).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }
    /// Opt in to the approximate int8 kernels in `attend`: packed keys
    /// through [`kernels::scores_i8_on`] (int8 query) and packed values
    /// through [`kernels::weighted_sum_i8_on`] (int8 weights). Faster on
    /// CPUs with AVX-512 VNNI, with the extra error documented there and
    /// measured by `cargo run --release --example int8_error`; elsewhere
    /// the exact kernels. Default off.
    pub fn int8_kernels(mut self, on: bool) -> Self {
        self.int8 = on;
        self
    }
    /// Whether `attend` uses the int8 kernels ([`CacheConfig::int8_kernels`]).
    pub fn uses_int8_kernels(&self) -> bool {
        self.int8
    }
    /// Use at most `n` threads in `attend` (0 = all available, 1 = the
    /// calling thread only, for engines with their own pools).
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n;
        self
    }
    /// KV heads.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Key scheme (`None`: full precision).
    pub fn key_scheme(&self) -> Option<QuantScheme> {
        self.keys
    }
    /// Value scheme (`None`: full precision).
    pub fn value_scheme(&self) -> Option<QuantScheme> {
        self.values
    }
    /// Residual window length.
    pub fn residual_len(&self) -> usize {
        self.residual
    }
    /// Number of sink tokens.
    pub fn sink_len(&self) -> usize {
        self.sinks
    }
}

/// Bytes a cache holds, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheBytes {
    /// Packed codes.
    pub codes: usize,
    /// Scales and zeros.
    pub params: usize,
    /// Full-precision (f32) sinks, residual window and staging tokens.
    pub full_precision: usize,
}

impl CacheBytes {
    /// All of it.
    pub fn total(&self) -> usize {
        self.codes + self.params + self.full_precision
    }
}

impl std::ops::Add for CacheBytes {
    type Output = CacheBytes;
    fn add(self, o: CacheBytes) -> CacheBytes {
        CacheBytes {
            codes: self.codes + o.codes,
            params: self.params + o.params,
            full_precision: self.full_precision + o.full_precision,
        }
    }
}

/// One of K or V of a layer.
#[derive(Debug, Clone)]
struct Tensor {
    layout: Option<Layout>,
    width: usize,
    sinks: usize,
    residual: usize,
    /// Sink rows, `[≤ sinks, width]`.
    sink: Vec<f32>,
    /// Full-precision tail rows; live rows start at `tail_start`.
    tail: Vec<f32>,
    tail_start: usize,
    /// Packed tokens.
    packed: usize,
    /// Per head codes (and params, or one shared param buffer).
    codes: Vec<Vec<u8>>,
    params: Vec<Vec<u8>>,
    /// Per-channel: running min/max of the block being filled.
    pend_min: Vec<f32>,
    pend_max: Vec<f32>,
}

impl PartialEq for Tensor {
    /// Equal when every stored number agrees (ignoring spare capacity and
    /// the dead prefix of the tail).
    fn eq(&self, o: &Self) -> bool {
        self.layout == o.layout
            && self.sink == o.sink
            && self.tail_slice() == o.tail_slice()
            && self.packed == o.packed
            && self.codes == o.codes
            && self.params == o.params
            && self.pend_min == o.pend_min
            && self.pend_max == o.pend_max
    }
}

impl Tensor {
    /// Copy the running per-channel ranges into `(min, max)` (reusing
    /// their allocations).
    fn pending_into(&self, p: &mut (Vec<f32>, Vec<f32>)) {
        p.0.clear();
        p.0.extend_from_slice(&self.pend_min);
        p.1.clear();
        p.1.extend_from_slice(&self.pend_max);
    }

    fn new(layout: Option<Layout>, n_kv: usize, hd: usize, sinks: usize, residual: usize) -> Self {
        let np = match layout {
            Some(l) if l.shared_params() => 1,
            _ => n_kv,
        };
        let pc = matches!(layout, Some(l) if l.scheme().axis() == Axis::PerChannel);
        Tensor {
            layout,
            width: n_kv * hd,
            sinks,
            residual,
            sink: Vec::new(),
            tail: Vec::new(),
            tail_start: 0,
            packed: 0,
            codes: vec![Vec::new(); n_kv],
            params: vec![Vec::new(); np],
            pend_min: if pc { vec![0.0; n_kv * hd] } else { Vec::new() },
            pend_max: if pc { vec![0.0; n_kv * hd] } else { Vec::new() },
        }
    }

    fn tail_rows(&self) -> usize {
        (self.tail.len() / self.width) - self.tail_start
    }

    fn tail_slice(&self) -> &[f32] {
        &self.tail[self.tail_start * self.width..]
    }

    /// Tokens quantized at a time.
    fn unit(&self) -> usize {
        self.layout.map_or(usize::MAX, |l| l.block_tokens())
    }

    /// Check that `rows` (tokens at positions `pos0..`) can be stored, and
    /// advance the per-channel pending state in `pend` accordingly.
    /// `abs_max` is the largest `|x|` of `rows` (all finite).
    fn check(
        &self,
        what: &'static str,
        rows: &[f32],
        abs_max: f32,
        pos0: usize,
        pend: &mut (Vec<f32>, Vec<f32>),
    ) -> Result<()> {
        let Some(l) = self.layout else { return Ok(()) };
        let s = l.scheme();
        let pc = s.axis() == Axis::PerChannel;
        // Common case: every value is small enough that no scale can
        // overflow; only the per-channel running range needs updating.
        if abs_max <= crate::quant::safe_abs(s.scale_format()) {
            if pc {
                self.advance_pending(rows, pos0, pend);
            }
            return Ok(());
        }
        let hd = l.head_dim();
        let ovf = |w: &'static str, v: f32, t: usize, h: usize, g: usize| Error::ScaleOverflow {
            op: what,
            what: w,
            value: v,
            format: s.scale_format().name(),
            token: t,
            head: h,
            group: g,
        };
        for (i, row) in rows.chunks_exact(self.width).enumerate() {
            let pos = pos0 + i;
            if pos < self.sinks {
                continue;
            }
            match s.axis() {
                Axis::PerToken => {
                    let gl = l.channels_per_group();
                    for (j, g) in row.chunks_exact(gl.min(self.width)).enumerate() {
                        let (mn, mx) = crate::quant::min_max(g);
                        group_params(s, mn, mx).map_err(|(w, v)| {
                            let gph = (hd / gl).max(1);
                            ovf(w, v, i, j / gph, j % gph)
                        })?;
                    }
                }
                Axis::PerChannel => {
                    let first = (pos - self.sinks).is_multiple_of(l.group_len());
                    let (mn, mx) = pend;
                    for c in 0..self.width {
                        if first {
                            mn[c] = row[c];
                            mx[c] = row[c];
                        } else {
                            mn[c] = mn[c].min(row[c]);
                            mx[c] = mx[c].max(row[c]);
                        }
                        group_params(s, mn[c], mx[c])
                            .map_err(|(w, v)| ovf(w, v, i, c / hd, c % hd))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Per-channel: fold `rows` into the running min/max of their blocks.
    fn advance_pending(&self, rows: &[f32], pos0: usize, pend: &mut (Vec<f32>, Vec<f32>)) {
        let g = self.layout.map_or(1, |l| l.group_len());
        let (mn, mx) = pend;
        // Only the rows from the last block start on decide the state.
        let n = rows.len() / self.width;
        let last_start = (0..n)
            .rev()
            .find(|&i| pos0 + i >= self.sinks && (pos0 + i - self.sinks).is_multiple_of(g))
            .unwrap_or(0);
        for (i, row) in rows.chunks_exact(self.width).enumerate().skip(last_start) {
            let pos = pos0 + i;
            if pos < self.sinks {
                continue;
            }
            if (pos - self.sinks).is_multiple_of(g) {
                mn.copy_from_slice(row);
                mx.copy_from_slice(row);
            } else {
                for ((lo, hi), &v) in mn.iter_mut().zip(mx.iter_mut()).zip(row) {
                    *lo = if v < *lo { v } else { *lo };
                    *hi = if v > *hi { v } else { *hi };
                }
            }
        }
    }

    /// Store checked rows at positions `pos0..`: sink positions first,
    /// then the tail; every unit of rows that leaves the residual window is
    /// quantized, straight from `rows` when none of its rows is in the tail
    /// yet (so prefill copies only the rows that stay full precision). The
    /// same bytes as storing the rows one at a time: units are always the
    /// oldest `unit` unquantized rows.
    fn push_rows(&mut self, rows: &[f32], pos0: usize, backend: Backend, scratch: &mut Scratch) {
        let w = self.width;
        let n_sink = self.sinks.saturating_sub(pos0).min(rows.len() / w);
        self.sink.extend_from_slice(&rows[..n_sink * w]);
        let rows = &rows[n_sink * w..];
        let m = rows.len() / w;
        let unit = self.unit();
        if m == 0 || unit == usize::MAX {
            self.tail.extend_from_slice(rows);
            return;
        }
        let live = self.tail_rows();
        let total = live + m;
        let units = if total >= self.residual + unit {
            (total - self.residual) / unit
        } else {
            0
        };
        // Units that start in the tail are completed and quantized there.
        let mixed = units.min(live.div_ceil(unit));
        let need = (mixed * unit).saturating_sub(live);
        self.tail.extend_from_slice(&rows[..need * w]);
        for _ in 0..mixed {
            self.flush(unit, backend, scratch);
        }
        let mut i = need;
        for _ in mixed..units {
            self.store_unit(&rows[i * w..(i + unit) * w], unit, backend, scratch);
            i += unit;
        }
        self.tail.extend_from_slice(&rows[i * w..]);
    }

    /// Quantize the oldest `unit` tail rows.
    fn flush(&mut self, unit: usize, backend: Backend, scratch: &mut Scratch) {
        let w = self.width;
        let tail = std::mem::take(&mut self.tail);
        self.store_unit(
            &tail[self.tail_start * w..(self.tail_start + unit) * w],
            unit,
            backend,
            scratch,
        );
        self.tail = tail;
        self.tail_start += unit;
    }

    /// Drop the tail's dead prefix once it outweighs the live rows (after
    /// an append has succeeded: until then [`rollback`](Self::rollback)
    /// may revive those rows).
    fn compact(&mut self) {
        let w = self.width;
        if self.tail_start * w == self.tail.len() {
            self.tail.clear();
            self.tail_start = 0;
        } else if self.tail_start > 64 && self.tail_start * 2 > self.tail.len() / w {
            self.tail.drain(..self.tail_start * w);
            self.tail_start = 0;
        }
    }

    /// [`compact`](Self::compact) in the middle of an append: drop only
    /// dead rows added since `m`, so a rollback still finds the rows it
    /// revives. Keeps the tail bounded during a long `extend`.
    fn compact_since(&mut self, m: &Mark) {
        let w = self.width;
        let keep = m.tail / w;
        let rows = self.tail.len() / w;
        if self.tail_start > keep + 64 && (self.tail_start - keep) * 2 > rows - keep {
            self.tail.drain(keep * w..self.tail_start * w);
            self.tail_start = keep;
        }
    }

    /// Where every growing buffer ends, for [`rollback`](Self::rollback).
    fn mark(&self) -> Mark {
        Mark {
            sink: self.sink.len(),
            tail: self.tail.len(),
            tail_start: self.tail_start,
            packed: self.packed,
        }
    }

    /// Undo everything stored since `m` was taken (no compaction may have
    /// run in between).
    fn rollback(&mut self, m: &Mark) {
        self.sink.truncate(m.sink);
        self.tail.truncate(m.tail);
        self.tail_start = m.tail_start;
        self.packed = m.packed;
        if let Some(l) = self.layout {
            let params = l.param_bytes(m.packed) / self.params.len();
            for c in &mut self.codes {
                c.truncate(l.head_code_bytes(m.packed));
            }
            for p in &mut self.params {
                p.truncate(params);
            }
        }
    }

    /// Quantize `unit` rows (the next positions after the packed ones)
    /// into packed storage.
    fn store_unit(&mut self, rows: &[f32], unit: usize, backend: Backend, scratch: &mut Scratch) {
        let l = self.layout.expect("flush needs a scheme");
        let rb = l.row_bytes();
        let token = self.sinks + self.packed;
        match l.scheme().axis() {
            Axis::PerToken => {
                scratch.codes.resize(l.n_kv_heads() * rb, 0);
                scratch.params.resize(l.param_bytes(1), 0);
                quantize_token(
                    backend,
                    &l,
                    rows,
                    token,
                    &mut scratch.codes,
                    &mut scratch.params,
                )
                .expect("scales were checked when the token was appended");
                for (h, c) in self.codes.iter_mut().enumerate() {
                    c.extend_from_slice(&scratch.codes[h * rb..(h + 1) * rb]);
                }
                let per = scratch.params.len() / self.params.len();
                for (h, p) in self.params.iter_mut().enumerate() {
                    p.extend_from_slice(&scratch.params[h * per..(h + 1) * per]);
                }
            }
            Axis::PerChannel => {
                scratch.codes.resize(unit * rb, 0);
                scratch.params.resize(l.head_param_bytes(unit), 0);
                for h in 0..l.n_kv_heads() {
                    quantize_channel_block(
                        backend,
                        &l,
                        rows,
                        unit,
                        h,
                        token,
                        &mut scratch.codes,
                        &mut scratch.params,
                    )
                    .expect("scales were checked when the tokens were appended");
                    self.codes[h].extend_from_slice(&scratch.codes);
                    self.params[h].extend_from_slice(&scratch.params);
                }
            }
        }
        self.packed += unit;
    }

    /// Tokens quantized at a time, 1 when full precision.
    fn unit_or_1(&self) -> usize {
        self.layout.map_or(1, |l| l.block_tokens())
    }

    /// The stored runs of positions `a..b` for head `h`, in order.
    fn sections(&self, h: usize, a: usize, b: usize) -> Vec<Section<'_>> {
        let n_sink = self.sink.len() / self.width;
        let p_end = n_sink + self.packed;
        let t_end = p_end + self.tail_rows();
        let mut out = Vec::with_capacity(3);
        let clip = |s0: usize, s1: usize| (a.max(s0), b.min(s1));
        let (x0, x1) = clip(0, n_sink);
        if x0 < x1 {
            out.push(Section {
                start: x0,
                len: x1 - x0,
                data: SectionData::Dense(&self.sink[x0 * self.width..]),
            });
        }
        let (x0, x1) = clip(n_sink, p_end);
        if x0 < x1 {
            let view = self.head(h).expect("packed tokens exist");
            out.push(Section {
                start: x0,
                len: x1 - x0,
                data: SectionData::Packed(sub_view(view, x0 - n_sink, x1 - n_sink)),
            });
        }
        let (x0, x1) = clip(p_end, t_end);
        if x0 < x1 {
            out.push(Section {
                start: x0,
                len: x1 - x0,
                data: SectionData::Dense(&self.tail_slice()[(x0 - p_end) * self.width..]),
            });
        }
        out
    }

    fn head(&self, h: usize) -> Option<PackedHead<'_>> {
        let l = self.layout?;
        if self.packed == 0 {
            return None;
        }
        let p = if l.shared_params() {
            &self.params[0]
        } else {
            &self.params[h]
        };
        Some(
            PackedHead::new(l, self.packed, &self.codes[h], p)
                .expect("cache keeps consistent buffers"),
        )
    }

    fn bytes(&self) -> CacheBytes {
        CacheBytes {
            codes: self.codes.iter().map(Vec::len).sum(),
            params: self.params.iter().map(Vec::len).sum(),
            full_precision: (self.sink.len() + self.tail_rows() * self.width) * 4,
        }
    }

    fn clear(&mut self) {
        self.sink.clear();
        self.tail.clear();
        self.tail_start = 0;
        self.packed = 0;
        self.codes.iter_mut().for_each(Vec::clear);
        self.params.iter_mut().for_each(Vec::clear);
    }

    /// Everything as f32 rows `[len, width]`: what attention sees.
    fn to_f32(&self) -> Vec<f32> {
        let mut out = self.sink.clone();
        if let Some(l) = self.layout {
            let hd = l.head_dim();
            let n_kv = self.width / hd;
            let base = out.len();
            out.resize(base + self.packed * self.width, 0.0);
            let mut tmp = vec![0f32; self.packed * hd];
            for h in 0..n_kv {
                if let Some(view) = self.head(h) {
                    view.dequantize_into(&mut tmp);
                    for t in 0..self.packed {
                        let o = base + t * self.width + h * hd;
                        out[o..o + hd].copy_from_slice(&tmp[t * hd..(t + 1) * hd]);
                    }
                }
            }
        }
        out.extend_from_slice(self.tail_slice());
        out
    }
}

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
    /// Working copies of the K and V running ranges (min, max) for a
    /// call, swapped in on success (reused, so an append allocates nothing).
    pend: [(Vec<f32>, Vec<f32>); 2],
}

/// The quantized K/V cache of one attention layer.
///
/// See the [module docs](self) for where tokens live and an example.
#[derive(Debug, Clone)]
pub struct LayerCache {
    cfg: CacheConfig,
    len: usize,
    k: Tensor,
    v: Tensor,
    scratch: Scratch,
    backend: Backend,
    threads: usize,
}

impl PartialEq for LayerCache {
    /// Equal when configuration, length and every stored byte agree.
    fn eq(&self, o: &Self) -> bool {
        self.cfg == o.cfg && self.len == o.len && self.k == o.k && self.v == o.v
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
        check_shape("LayerCache::new", cfg.n_kv_heads, cfg.head_dim)?;
        let lay = |s: Option<QuantScheme>| {
            s.map(|s| s.layout(cfg.n_kv_heads, cfg.head_dim))
                .transpose()
        };
        let (lk, lv) = (lay(cfg.keys)?, lay(cfg.values)?);
        let threads = match cfg.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        Ok(LayerCache {
            cfg,
            len: 0,
            k: Tensor::new(lk, cfg.n_kv_heads, cfg.head_dim, cfg.sinks, cfg.residual),
            v: Tensor::new(lv, cfg.n_kv_heads, cfg.head_dim, cfg.sinks, cfg.residual),
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

    /// Forget every token, keeping allocations (e.g. between evaluation
    /// windows).
    pub fn clear(&mut self) {
        self.len = 0;
        self.k.clear();
        self.v.clear();
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
        let r = self.extend_f32(op, as_f32(k, &mut wk), as_f32(v, &mut wv), n_kv, hd, w, s);
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
        let marks = (self.k.mark(), self.v.mark(), self.len);
        let [mut pk, mut pv] = std::mem::take(&mut s.pend);
        self.k.pending_into(&mut pk);
        self.v.pending_into(&mut pv);
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
            self.k.push_rows(kc, self.len, self.backend, &mut q);
            self.v.push_rows(vc, self.len, self.backend, &mut q);
            self.len += e - t;
            self.k.compact_since(&marks.0);
            self.v.compact_since(&marks.1);
            t = e;
        }
        s.codes = q.codes;
        s.params = q.params;
        if ok {
            // The new ranges in; the old ones kept as next call's buffers.
            std::mem::swap(&mut self.k.pend_min, &mut pk.0);
            std::mem::swap(&mut self.k.pend_max, &mut pk.1);
            std::mem::swap(&mut self.v.pend_min, &mut pv.0);
            std::mem::swap(&mut self.v.pend_max, &mut pv.1);
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
        let mut pk = (self.k.pend_min.clone(), self.k.pend_max.clone());
        let mut pv = (self.v.pend_min.clone(), self.v.pend_max.clone());
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
        let qw = n_q_heads * hd;
        if q.is_empty() || !q.len().is_multiple_of(qw) {
            return Err(Error::Length {
                op,
                what: "query values (a positive multiple of n_q_heads·head_dim)",
                expected: qw * (q.len() / qw).max(1),
                got: q.len(),
            });
        }
        check_len(op, "output values", q.len(), out.len())?;
        let n = q.len() / qw;
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
        let scale = self.scale();
        let mut qf = Vec::new();
        widen_into(q, &mut qf);
        check_finite(op, &qf, n_q_heads, hd, 0)?;
        qf.iter_mut().for_each(|x| *x *= scale);

        let n_kv = self.cfg.n_kv_heads;
        let per_head = n * r * hd;
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
        let threads = if self.len * n * n_kv >= PARALLEL_MIN_WORK {
            self.threads
        } else {
            1
        };
        if threads > 1 && n == 1 && !n_kv.is_multiple_of(threads) {
            // Decode with fewer (or unevenly many) KV heads than threads:
            // split each head's tokens into chunks (flash-decoding), then
            // merge the partial softmaxes.
            self.attend_split(&gather, r, threads, window, &mut tmp);
        } else if threads > 1 && n_kv > 1 {
            let t = threads.min(n_kv);
            let chunk = n_kv.div_ceil(t);
            fan_out(tmp.chunks_mut(chunk * per_head), |ci, block| {
                for (k, dst) in block.chunks_mut(per_head).enumerate() {
                    self.head_attention(ci * chunk + k, &gather(ci * chunk + k), n, r, window, dst);
                }
            });
        } else {
            for (h, dst) in tmp.chunks_mut(per_head).enumerate() {
                self.head_attention(h, &gather(h), n, r, window, dst);
            }
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

    /// Attention of KV head `h` for `n` positions × `r` query heads (`qh` is
    /// `[n, r, hd]`, pre-scaled); writes `[n, r, hd]` into `dst`.
    fn head_attention(
        &self,
        h: usize,
        qh: &[f32],
        n: usize,
        r: usize,
        window: Option<usize>,
        dst: &mut [f32],
    ) {
        let hd = self.cfg.head_dim;
        let len = self.len;
        // Query positions in sub-blocks so the score matrix stays small.
        let sub = (QUERY_BLOCK / r).max(1);
        let mut scratch = AttnScratch::default();
        let mut j0 = 0;
        while j0 < n {
            let j1 = (j0 + sub).min(n);
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
            let mut part = Partial::new(rows, hd);
            let q = &qh[j0 * r * hd..j1 * r * hd];
            self.partial(h, q, rows, a, b, &vis, &mut part, &mut scratch);
            merge(
                std::slice::from_ref(&part),
                rows,
                hd,
                &mut dst[j0 * r * hd..j1 * r * hd],
            );
            j0 = j1;
        }
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
        s.scores.clear();
        s.scores.resize(rows * width, 0.0);
        self.k_scores(h, q, rows, a, b, &mut s.scores, &mut s.tmp);
        for (i, (row, &(v0, v1))) in s.scores.chunks_exact_mut(width).zip(vis).enumerate() {
            let lo = v0.clamp(a, b) - a;
            let hi = v1.clamp(a, b) - a;
            row[..lo].fill(0.0);
            row[hi..].fill(0.0);
            let (m, sum) = kernels::softmax_parts_on(self.backend, &mut row[lo..hi]);
            part.max[i] = m;
            part.sum[i] = sum;
        }
        part.out.fill(0.0);
        self.v_sum(h, &s.scores, rows, a, b, &mut part.out, &mut s.tmp);
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
        for sec in self.k.sections(h, a, b) {
            let off = sec.start - a;
            match sec.data {
                SectionData::Dense(data) => {
                    for t in 0..sec.len {
                        let k = &data[t * self.k.width + h * hd..][..hd];
                        for i in 0..rows {
                            out[i * width + off + t] = dot(&q[i * hd..(i + 1) * hd], k);
                        }
                    }
                }
                SectionData::Packed(view) => {
                    tmp.clear();
                    tmp.resize(rows * sec.len, 0.0);
                    if self.cfg.int8 {
                        kernels::scores_i8_on(self.backend, &view, q, tmp)
                    } else {
                        kernels::scores_on(self.backend, &view, q, tmp)
                    }
                    .expect("lengths are consistent");
                    for i in 0..rows {
                        out[i * width + off..i * width + off + sec.len]
                            .copy_from_slice(&tmp[i * sec.len..(i + 1) * sec.len]);
                    }
                }
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
        for sec in self.v.sections(h, a, b) {
            let off = sec.start - a;
            match sec.data {
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
                    tmp.clear();
                    tmp.resize(rows * sec.len, 0.0);
                    for i in 0..rows {
                        tmp[i * sec.len..(i + 1) * sec.len]
                            .copy_from_slice(&p[i * width + off..i * width + off + sec.len]);
                    }
                    if self.cfg.int8 {
                        kernels::weighted_sum_i8_on(self.backend, &view, tmp, dst)
                    } else {
                        kernels::weighted_sum_on(self.backend, &view, tmp, dst)
                    }
                    .expect("lengths are consistent");
                }
            }
        }
    }
}

/// Per-row softmax state of a range of positions: running max, sum of
/// `exp(l − max)`, and the unnormalized weighted sum of values.
#[derive(Debug, Clone)]
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
}

impl Partial {
    fn new(rows: usize, hd: usize) -> Self {
        Partial {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
            out: vec![0.0; rows * hd],
        }
    }
}

/// Combine partials over disjoint position ranges into normalized outputs.
fn merge(parts: &[Partial], rows: usize, hd: usize, dst: &mut [f32]) {
    for i in 0..rows {
        let m = parts
            .iter()
            .map(|p| p.max[i])
            .fold(f32::NEG_INFINITY, f32::max);
        let o = &mut dst[i * hd..(i + 1) * hd];
        o.fill(0.0);
        let mut total = 0f32;
        for p in parts {
            if p.max[i] == f32::NEG_INFINITY {
                continue;
            }
            let w = (p.max[i] - m).exp();
            total += w * p.sum[i];
            axpy(w, &p.out[i * hd..(i + 1) * hd], o);
        }
        let inv = 1.0 / total;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

#[derive(Debug, Default)]
struct AttnScratch {
    scores: Vec<f32>,
    tmp: Vec<f32>,
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// A run of positions of one tensor and where they are stored.
struct Section<'a> {
    start: usize,
    len: usize,
    data: SectionData<'a>,
}

enum SectionData<'a> {
    /// Full-precision rows (stride = tensor width), first row = `start`.
    Dense(&'a [f32]),
    /// Packed tokens of one head, first token = `start`.
    Packed(PackedHead<'a>),
}

/// Work (`len · positions · kv heads`) below which `attend` stays on one thread.
const PARALLEL_MIN_WORK: usize = 16 * 1024;

/// `work(i, item)` for every item: the first on the calling thread, the
/// others on scoped threads spawned before it starts. One spawn fewer per
/// call than spawning them all. A spawn and join cost tens of µs on the
/// development VM, against a 1–2 ms decode step
/// (`docs/perf/records/2026-12-01-zen4.md`).
fn fan_out<T: Send>(items: impl IntoIterator<Item = T>, work: impl Fn(usize, T) + Sync) {
    let mut items = items.into_iter().enumerate();
    let Some((i0, first)) = items.next() else {
        return;
    };
    std::thread::scope(|sc| {
        for (i, item) in items {
            let work = &work;
            sc.spawn(move || work(i, item));
        }
        work(i0, first);
    });
}

/// Query rows (positions × query heads) scored at once in `attend_causal`.
const QUERY_BLOCK: usize = 64;

/// Tokens `t0..t1` of a packed head; per-channel, `t0` must start a block.
fn sub_view(view: PackedHead<'_>, t0: usize, t1: usize) -> PackedHead<'_> {
    let l = view.layout;
    let g = l.block_tokens();
    assert!(
        t0.is_multiple_of(g) && t0 <= t1 && t1 <= view.tokens,
        "sub_view {t0}..{t1} of {}",
        view.tokens
    );
    let pb = |t: usize| {
        if l.shared_params() {
            l.param_bytes(t)
        } else {
            l.head_param_bytes(t)
        }
    };
    PackedHead {
        layout: l,
        tokens: t1 - t0,
        codes: &view.codes[l.head_code_bytes(t0)..l.head_code_bytes(t1)],
        params: &view.params[pb(t0)..pb(t1)],
    }
}

/// Plain dense attention of one position (f64 accumulation), the yardstick
/// the cache is tested against: `q` `[n_q_heads·head_dim]`, `k`/`v`
/// `[len, n_kv_heads·head_dim]`, returns `[n_q_heads·head_dim]`.
///
/// # Panics
/// If the lengths do not fit the shape or `n_q_heads` is not a multiple of
/// `n_kv_heads`.
pub fn dense_attention(
    q: &[f32],
    n_q_heads: usize,
    k: &[f32],
    v: &[f32],
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let w = n_kv_heads * head_dim;
    assert_eq!(q.len(), n_q_heads * head_dim);
    assert_eq!(k.len(), v.len());
    assert!(k.len().is_multiple_of(w) && n_q_heads.is_multiple_of(n_kv_heads));
    let len = k.len() / w;
    let r = n_q_heads / n_kv_heads;
    let mut out = vec![0f32; q.len()];
    for i in 0..n_q_heads {
        let h = i / r;
        let qi = &q[i * head_dim..(i + 1) * head_dim];
        let logits: Vec<f64> = (0..len)
            .map(|t| {
                let kt = &k[t * w + h * head_dim..t * w + (h + 1) * head_dim];
                qi.iter()
                    .zip(kt)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let s: f64 = e.iter().sum();
        for c in 0..head_dim {
            let acc: f64 = (0..len)
                .map(|t| e[t] * v[t * w + h * head_dim + c] as f64)
                .sum();
            out[i * head_dim + c] = (acc / s) as f32;
        }
    }
    out
}

/// The caches of all layers of a model; each layer may have its own schemes
/// (per-layer mixed precision).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
}

impl KvCache {
    /// One [`LayerCache`] per configuration.
    ///
    /// # Errors
    /// As [`LayerCache::new`]; [`Error::InvalidShape`] for no layers.
    pub fn new(configs: impl IntoIterator<Item = CacheConfig>) -> Result<Self> {
        let layers = configs
            .into_iter()
            .map(LayerCache::new)
            .collect::<Result<Vec<_>>>()?;
        if layers.is_empty() {
            return Err(Error::InvalidShape {
                op: "KvCache::new",
                what: "a cache needs at least one layer".into(),
            });
        }
        Ok(KvCache { layers })
    }
    /// `n_layers` layers with the same configuration.
    ///
    /// # Errors
    /// As [`KvCache::new`].
    pub fn uniform(n_layers: usize, cfg: CacheConfig) -> Result<Self> {
        Self::new(std::iter::repeat_n(cfg, n_layers))
    }
    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    /// Layer `i`.
    ///
    /// # Panics
    /// If `i >= n_layers()`.
    pub fn layer(&self, i: usize) -> &LayerCache {
        &self.layers[i]
    }
    /// Layer `i`, mutable.
    ///
    /// # Panics
    /// If `i >= n_layers()`.
    pub fn layer_mut(&mut self, i: usize) -> &mut LayerCache {
        &mut self.layers[i]
    }
    /// All layers.
    pub fn layers(&self) -> &[LayerCache] {
        &self.layers
    }
    /// Bytes held by all layers.
    pub fn bytes(&self) -> CacheBytes {
        self.layers
            .iter()
            .map(LayerCache::bytes)
            .fold(CacheBytes::default(), |a, b| a + b)
    }
    /// Bits per cached element over all layers (0 when empty).
    pub fn effective_bits(&self) -> f64 {
        let elems: usize = self
            .layers
            .iter()
            .map(|l| 2 * l.len() * l.cfg.n_kv_heads * l.cfg.head_dim)
            .sum();
        if elems == 0 {
            0.0
        } else {
            8.0 * self.bytes().total() as f64 / elems as f64
        }
    }
    /// Forget all tokens in every layer.
    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(LayerCache::clear);
    }
}
