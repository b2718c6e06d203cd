//! [`KvCodec`]: the one interface between the cache and a stored format,
//! and [`Codec`], a format described as data.
//!
//! The cache never looks inside a format: it hands a codec the rows to
//! check and encode, and the packed heads to score and sum over. A codec
//! owns its byte layout and accounting ([`Layout`]), its all-or-nothing
//! checks, its encoders, its fused kernels and its decode path, plus an
//! optional orthogonal transform around all of it (a rotation: rows and
//! queries go in through [`KvCodec::transform_in`], outputs and decoded rows
//! come back through [`KvCodec::transform_out`]).
//!
//! Formats compose: [`Rotated`] wraps any codec with the randomized
//! Hadamard rotation ([`Hadamard`]); [`UniformCodec`] is the uniform integer
//! grid with its exact and int8 kernels; [`CodebookCodec`] indexes a table
//! of levels ([`Levels`]: `iq4_nl`, NF4, Lloyd-Max) with the same storage.

use std::fmt;
use std::sync::Arc;

use super::codebook::{CodebookCodec, FittedLevels, Levels};
use super::rotation::Hadamard;
use super::{group_params, min_max, quantize_channel_block, quantize_token, safe_abs};
use crate::error::{Error, Result};
use crate::kernels;
use crate::scheme::{Axis, Layout, QuantScheme};
use crate::simd::Backend;
use crate::store::PackedHead;

/// The per-channel block being filled: its running range per channel.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pending {
    /// Per channel minimum of the block's rows so far
    /// (`[n_kv_heads·head_dim]`; empty for per-token formats).
    pub min: Vec<f32>,
    /// Per channel maximum, likewise.
    pub max: Vec<f32>,
    /// Whether a row of the block so far held a value beyond the bound
    /// below which no scale can overflow (so the block's range, not the
    /// new rows alone, decides whether later rows fit). Follows from `min`
    /// and `max`; kept so an append need not scan them.
    pub large: bool,
}

impl Pending {
    /// An empty block state for rows of `width` values.
    pub fn new(width: usize) -> Self {
        Pending {
            min: vec![0.0; width],
            max: vec![0.0; width],
            large: false,
        }
    }

    /// Copy `o` into `self`, reusing the allocations.
    pub fn copy_from(&mut self, o: &Pending) {
        self.min.clear();
        self.min.extend_from_slice(&o.min);
        self.max.clear();
        self.max.extend_from_slice(&o.max);
        self.large = o.large;
    }
}

/// A stored K or V format: what the cache calls (see the [module
/// docs](self)).
///
/// Rows are `[tokens, n_kv_heads·head_dim]` f32, already checked finite and
/// (with a transform) already in the stored space. Positions count from the
/// first packed token of the tensor (sinks excluded).
pub trait KvCodec: fmt::Debug + Send + Sync {
    /// The format as data (for equality, labels and serialization).
    fn spec(&self) -> Codec;

    /// Shape and exact byte accounting of the packed storage.
    fn layout(&self) -> &Layout;

    /// Whether [`transform_in`](Self::transform_in) and
    /// [`transform_out`](Self::transform_out) do anything.
    fn transforms(&self) -> bool {
        false
    }

    /// Map rows, or queries, of whole heads into the stored space (an
    /// orthogonal map, so scores are unchanged; identity by default).
    fn transform_in(&self, _x: &mut [f32]) {}

    /// The inverse of [`transform_in`](Self::transform_in), for attention
    /// outputs and decoded rows.
    fn transform_out(&self, _x: &mut [f32]) {}

    /// Check that `rows` (the first at position `first`, reported as token
    /// `token0` of the caller's input) can be encoded, advancing the
    /// per-channel ranges in `pend`. `abs_max` is the largest `|x|` of the
    /// rows. Encoding rows that passed never fails.
    ///
    /// # Errors
    /// [`Error::ScaleOverflow`] when a group's scale or zero would not fit.
    fn check(
        &self,
        op: &'static str,
        rows: &[f32],
        abs_max: f32,
        first: usize,
        token0: usize,
        pend: &mut Pending,
    ) -> Result<()>;

    /// Encode one token's row (per-token formats) into `codes`
    /// (`[n_kv_heads, row_bytes]`) and `params` (its params).
    ///
    /// # Errors
    /// As [`check`](Self::check); never for checked rows.
    fn encode_token(
        &self,
        backend: Backend,
        row: &[f32],
        token: usize,
        codes: &mut [u8],
        params: &mut [u8],
    ) -> Result<()>;

    /// Encode head `head` of a completed block of `rows` (per-channel
    /// formats) into `codes` and `params`.
    ///
    /// # Errors
    /// As [`check`](Self::check); never for checked rows.
    #[allow(clippy::too_many_arguments)]
    fn encode_block(
        &self,
        backend: Backend,
        rows: &[f32],
        tokens: usize,
        head: usize,
        token0: usize,
        codes: &mut [u8],
        params: &mut [u8],
    ) -> Result<()>;

    /// `out[i·T + t] = q_i·k̂_t` for the queries `q` (stored space) of one
    /// packed head.
    ///
    /// # Errors
    /// [`Error::Length`] for inconsistent lengths.
    fn scores(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()>;

    /// `out[i] += Σ_t p[i·T + t]·v̂_t` (stored space) for one packed head.
    ///
    /// # Errors
    /// [`Error::Length`] for inconsistent lengths.
    fn weighted_sum(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        p: &[f32],
        out: &mut [f32],
    ) -> Result<()>;

    /// The packed head's tokens as f32 rows `[tokens, head_dim]` (stored
    /// space).
    fn decode(&self, head: &PackedHead<'_>, out: &mut [f32]);
}

/// An orthogonal transform applied around a format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Rotation {
    /// None: the format sees the rows as given.
    #[default]
    None,
    /// The randomized Hadamard rotation of each head ([`Hadamard`]).
    Hadamard,
}

/// A stored format as data: a [`QuantScheme`], an optional [`Rotation`]
/// around it and the choice of kernels. What a cache is configured with
/// ([`CacheConfig::key_codec`](crate::CacheConfig::key_codec)); built into a
/// [`KvCodec`] for a shape by [`Codec::build`].
///
/// ```
/// use kvq::{presets, Codec};
/// let (_, values) = presets::kivi(4)?;
/// let c = Codec::hadamard(values);
/// assert_eq!(c.label(), "H·4b-pt32-asym-f16");
/// let built = c.build(8, 128)?;
/// assert_eq!(built.spec(), c);
/// # Ok::<(), kvq::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Codec {
    scheme: QuantScheme,
    rotation: Rotation,
    int8: bool,
    levels: Option<Levels>,
}

impl From<QuantScheme> for Codec {
    fn from(s: QuantScheme) -> Self {
        Codec::uniform(s)
    }
}

impl Codec {
    /// The uniform grid of `scheme`, exact kernels, no rotation.
    pub fn uniform(scheme: QuantScheme) -> Self {
        Codec {
            scheme,
            rotation: Rotation::None,
            int8: false,
            levels: None,
        }
    }

    /// The codebook `levels` on the storage of `scheme` (a symmetric
    /// per-token scheme of a width the table has; checked by
    /// [`build`](Self::build)): `x̂ = scale·level[code]`.
    ///
    /// ```
    /// use kvq::{Axis, Codec, Group, Levels, Mode, QuantScheme};
    /// let s = QuantScheme::new(4, Axis::PerToken, Group::Size(32))?.with_mode(Mode::Symmetric)?;
    /// let c = Codec::codebook(s, Levels::Gauss).with_rotation(kvq::Rotation::Hadamard);
    /// assert_eq!(c.label(), "H·gauss·4b-pt32-sym-f16");
    /// let x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
    /// let y = c.roundtrip(&x, 1, 128)?;
    /// let mse = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / 128.0;
    /// assert!(mse < 0.01 * 0.5); // within 1 % of the signal's power
    /// # Ok::<(), kvq::Error>(())
    /// ```
    pub fn codebook(scheme: QuantScheme, levels: Levels) -> Self {
        Codec {
            levels: Some(levels),
            ..Codec::uniform(scheme)
        }
    }

    /// `scheme` after the randomized Hadamard rotation of each head.
    pub fn hadamard(scheme: QuantScheme) -> Self {
        Codec::uniform(scheme).with_rotation(Rotation::Hadamard)
    }

    /// The same format with `rotation` around it.
    pub fn with_rotation(mut self, rotation: Rotation) -> Self {
        self.rotation = rotation;
        self
    }

    /// The same format read by the approximate int8 kernels
    /// ([`kernels::scores_i8_on`], [`kernels::weighted_sum_i8_on`]).
    pub fn with_int8_kernels(mut self, on: bool) -> Self {
        self.int8 = on;
        self
    }

    /// The grid.
    pub fn scheme(&self) -> QuantScheme {
        self.scheme
    }

    /// The rotation around the grid.
    pub fn rotation(&self) -> Rotation {
        self.rotation
    }

    /// Whether the int8 kernels read it.
    pub fn int8_kernels(&self) -> bool {
        self.int8
    }

    /// The codebook, `None` for the uniform grid.
    pub fn levels(&self) -> Option<Levels> {
        self.levels
    }

    /// This codebook format with its levels fitted to `rows`
    /// (`[tokens, n_kv_heads·head_dim]`, as the cache would store them):
    /// the same scheme and rotation, [`Levels::Fitted`] levels. `weights`
    /// (one per channel of a row, after the rotation, `≥ 0`) weigh each
    /// element's squared error; keys weighted by their queries' energy per
    /// channel make the fit minimize the score error
    /// ([`LayerCapture::fit_keys`](crate::metrics::LayerCapture::fit_keys)).
    ///
    /// The fit starts from this format's levels (Lloyd-Max, NF4 or an
    /// earlier fit) and runs Lloyd iterations on the format's own encoder,
    /// per-group scales included: on these rows the result's weighted
    /// squared error is never above the start's.
    ///
    /// ```
    /// use kvq::{Axis, Codec, Group, Levels, Mode, QuantScheme, Rotation};
    /// let s = QuantScheme::new(3, Axis::PerToken, Group::Size(32))?.with_mode(Mode::Symmetric)?;
    /// let start = Codec::codebook(s, Levels::Gauss).with_rotation(Rotation::Hadamard);
    /// // Heavy-tailed rows: a cube of a sine.
    /// let x: Vec<f32> = (0..64 * 256).map(|i| ((i as f32 * 0.37).sin()).powi(3)).collect();
    /// let fit = start.fit_levels(&x, 2, 128, None)?;
    /// assert_eq!(fit.levels().unwrap().name(), "fit");
    /// let mse = |c: &Codec| -> Result<f32, kvq::Error> {
    ///     let y = c.roundtrip(&x, 2, 128)?;
    ///     Ok(x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>())
    /// };
    /// assert!(mse(&fit)? <= mse(&start)?);
    /// # Ok::<(), kvq::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when this is not a codebook with a table
    /// to start from (the uniform grid, fp8, `iq4_nl`); as
    /// [`build`](Self::build) for the shape; [`Error::Length`] for rows
    /// that are not whole tokens or weights not one per channel;
    /// [`Error::NonFinite`] for NaN or infinite rows;
    /// [`Error::InvalidArgument`] for a negative or non-finite weight, or
    /// all weights zero; [`Error::ScaleOverflow`] for rows a group's scale
    /// cannot hold.
    pub fn fit_levels(
        &self,
        rows: &[f32],
        n_kv_heads: usize,
        head_dim: usize,
        weights: Option<&[f32]>,
    ) -> Result<Codec> {
        let f = super::codebook::fit_levels(self, rows, n_kv_heads, head_dim, weights)?;
        Ok(Codec::codebook(self.scheme, Levels::Fitted(f)).with_rotation(self.rotation))
    }

    /// Bytes the format stores once per tensor, beside its packed rows: a
    /// fitted table's levels ([`FittedLevels::bytes`]); 0 for the rest.
    pub fn table_bytes(&self) -> usize {
        self.levels
            .as_ref()
            .and_then(Levels::fitted)
            .map_or(0, FittedLevels::bytes)
    }

    /// A short label: the scheme's, prefixed with the codebook's name
    /// (`nf4·…`) and `H·` when rotated.
    pub fn label(&self) -> String {
        let s = match self.levels {
            None => self.scheme.label(),
            Some(l) => format!("{}·{}", l.name(), self.scheme.label()),
        };
        match self.rotation {
            Rotation::None => s,
            Rotation::Hadamard => format!("H·{s}"),
        }
    }

    /// `x` (`[tokens, n_kv_heads·head_dim]`) quantized and decoded as this
    /// format stores it, in the caller's space (rotated in and back): the
    /// `x̂` that metrics compare with `x`. Per-channel schemes quantize a
    /// trailing partial block as [`UniformQuantizer`](crate::UniformQuantizer) does.
    ///
    /// # Errors
    /// As [`build`](Self::build) and
    /// [`KvQuantizer::roundtrip`](crate::KvQuantizer::roundtrip).
    pub fn roundtrip(&self, x: &[f32], n_kv_heads: usize, head_dim: usize) -> Result<Vec<f32>> {
        use crate::{KvQuantizer, UniformQuantizer};
        if self.levels.is_some() {
            return self.roundtrip_built(x, n_kv_heads, head_dim);
        }
        let q = UniformQuantizer::new(self.scheme, n_kv_heads, head_dim)?;
        let tokens = x.len() / (n_kv_heads * head_dim).max(1);
        match self.rotation {
            Rotation::None => q.roundtrip(x, tokens),
            Rotation::Hadamard => {
                let op = "Codec::roundtrip";
                let h = Hadamard::new(head_dim)?;
                super::check_len(op, "values", tokens * n_kv_heads * head_dim, x.len())?;
                // NaN/inf is reported where the caller put it, before the
                // rotation spreads it over a head.
                super::check_finite(op, x, n_kv_heads, head_dim, 0)?;
                let mut r = x.to_vec();
                h.forward(&mut r);
                let mut back = q.roundtrip(&r, tokens)?;
                h.inverse(&mut back);
                Ok(back)
            }
        }
    }

    /// [`roundtrip`](Self::roundtrip) through the built codec's own
    /// encoder and decoder, token by token.
    fn roundtrip_built(&self, x: &[f32], n_kv_heads: usize, head_dim: usize) -> Result<Vec<f32>> {
        let op = "Codec::roundtrip";
        let c = self.build(n_kv_heads, head_dim)?;
        let l = *c.layout();
        let width = n_kv_heads * head_dim;
        let tokens = x.len() / width;
        super::check_len(op, "values", tokens * width, x.len())?;
        super::check_finite(op, x, n_kv_heads, head_dim, 0)?;
        let mut r = x.to_vec();
        c.transform_in(&mut r);
        let (rb, pb) = (l.row_bytes(), l.head_param_bytes(1));
        let (mut codes, mut params) = (vec![0u8; n_kv_heads * rb], vec![0u8; n_kv_heads * pb]);
        let mut pend = Pending::default();
        let backend = Backend::detect();
        for (t, row) in r.chunks_exact_mut(width).enumerate() {
            let abs_max = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            c.check(op, row, abs_max, t, t, &mut pend)?;
            c.encode_token(backend, row, t, &mut codes, &mut params)?;
            for h in 0..n_kv_heads {
                let head = PackedHead::new(
                    l,
                    1,
                    &codes[h * rb..(h + 1) * rb],
                    &params[h * pb..(h + 1) * pb],
                )?;
                c.decode(&head, &mut row[h * head_dim..(h + 1) * head_dim]);
            }
        }
        c.transform_out(&mut r);
        Ok(r)
    }

    /// The codec for heads of this shape.
    ///
    /// # Errors
    /// As [`QuantScheme::layout`]; [`Error::InvalidShape`] for a rotation
    /// that does not fit `head_dim`; [`Error::InvalidConfig`] for a codebook
    /// that does not fit its scheme ([`CodebookCodec::new`]) or asks for
    /// the int8 kernels (they read the uniform grid).
    pub fn build(&self, n_kv_heads: usize, head_dim: usize) -> Result<Arc<dyn KvCodec>> {
        let layout = self.scheme.layout(n_kv_heads, head_dim)?;
        let rot = match self.rotation {
            Rotation::None => None,
            Rotation::Hadamard => Some(Hadamard::new(head_dim)?),
        };
        Ok(match (self.levels, rot) {
            (None, None) => Arc::new(UniformCodec::new(layout, self.int8)),
            (None, Some(h)) => Arc::new(Rotated::new(UniformCodec::new(layout, self.int8), h)),
            (Some(_), _) if self.int8 => {
                return Err(Error::InvalidConfig {
                    op: "Codec::build",
                    what: "the int8 kernels read the uniform grid, not a codebook".into(),
                })
            }
            (Some(levels), None) => Arc::new(CodebookCodec::new(layout, levels)?),
            (Some(levels), Some(h)) => {
                Arc::new(Rotated::new(CodebookCodec::new(layout, levels)?, h))
            }
        })
    }
}

/// The uniform integer grid ([`QuantScheme`]), with the exact fused
/// kernels or, opted in, the int8 ones.
#[derive(Debug, Clone)]
pub struct UniformCodec {
    layout: Layout,
    int8: bool,
}

impl UniformCodec {
    /// The codec of `layout`; `int8` picks the int8 kernels.
    pub fn new(layout: Layout, int8: bool) -> Self {
        UniformCodec { layout, int8 }
    }
}

impl KvCodec for UniformCodec {
    fn spec(&self) -> Codec {
        Codec::uniform(*self.layout.scheme()).with_int8_kernels(self.int8)
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn check(
        &self,
        op: &'static str,
        rows: &[f32],
        abs_max: f32,
        first: usize,
        token0: usize,
        pend: &mut Pending,
    ) -> Result<()> {
        let l = &self.layout;
        let s = l.scheme();
        let width = l.n_kv_heads() * l.head_dim();
        // Common case: every value is small enough that no scale can
        // overflow; only the per-channel running range needs updating. (A
        // per-channel block already open may hold large values from an
        // earlier call: then its range decides, row by row, below.)
        let safe = safe_abs(s.scale_format());
        let open_block_large = pend.large && !first.is_multiple_of(l.group_len());
        if abs_max <= safe && !open_block_large {
            if s.axis() == Axis::PerChannel {
                advance_pending(l, rows, first, pend);
            }
            return Ok(());
        }
        let hd = l.head_dim();
        let ovf = |w: &'static str, v: f32, t: usize, h: usize, g: usize| Error::ScaleOverflow {
            op,
            what: w,
            value: v,
            format: s.scale_format().name(),
            token: t,
            head: h,
            group: g,
        };
        for (i, row) in rows.chunks_exact(width).enumerate() {
            let t = token0 + i;
            match s.axis() {
                Axis::PerToken => {
                    // The groups the quantizer takes: within a head, or the
                    // whole vector (`Group::Vector`, head 0 group 0).
                    let gl = l.group_len().min(width);
                    for (j, g) in row.chunks_exact(gl).enumerate() {
                        let (mn, mx) = min_max(g);
                        group_params(s, mn, mx).map_err(|(w, v)| {
                            let c = j * gl;
                            ovf(w, v, t, c / hd, c % hd / gl.min(hd))
                        })?;
                    }
                }
                Axis::PerChannel => {
                    let opens = (first + i).is_multiple_of(l.group_len());
                    let big = row.iter().any(|v| v.abs() > safe);
                    pend.large = big || (pend.large && !opens);
                    let (mn, mx) = (&mut pend.min, &mut pend.max);
                    for c in 0..width {
                        if opens {
                            mn[c] = row[c];
                            mx[c] = row[c];
                        } else {
                            mn[c] = mn[c].min(row[c]);
                            mx[c] = mx[c].max(row[c]);
                        }
                        group_params(s, mn[c], mx[c])
                            .map_err(|(w, v)| ovf(w, v, t, c / hd, c % hd))?;
                    }
                }
            }
        }
        Ok(())
    }

    fn encode_token(
        &self,
        backend: Backend,
        row: &[f32],
        token: usize,
        codes: &mut [u8],
        params: &mut [u8],
    ) -> Result<()> {
        quantize_token(backend, &self.layout, row, token, codes, params)
    }

    fn encode_block(
        &self,
        backend: Backend,
        rows: &[f32],
        tokens: usize,
        head: usize,
        token0: usize,
        codes: &mut [u8],
        params: &mut [u8],
    ) -> Result<()> {
        quantize_channel_block(
            backend,
            &self.layout,
            rows,
            tokens,
            head,
            token0,
            codes,
            params,
        )
    }

    fn scores(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        if self.int8 {
            kernels::scores_i8_on(backend, head, q, out)
        } else {
            kernels::scores_on(backend, head, q, out)
        }
    }

    fn weighted_sum(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        p: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        if self.int8 {
            kernels::weighted_sum_i8_on(backend, head, p, out)
        } else {
            kernels::weighted_sum_on(backend, head, p, out)
        }
    }

    fn decode(&self, head: &PackedHead<'_>, out: &mut [f32]) {
        head.dequantize_into(out);
    }
}

/// Per-channel: fold `rows` (the first at packed position `first`, every
/// value within the fast check's bound) into the running min/max of their
/// blocks.
fn advance_pending(l: &Layout, rows: &[f32], first: usize, pend: &mut Pending) {
    let (g, width) = (l.group_len(), l.n_kv_heads() * l.head_dim());
    // Only the rows from the last block start on decide the state.
    let n = rows.len() / width;
    let opened = (0..n).rev().find(|&i| (first + i).is_multiple_of(g));
    if opened.is_some() {
        // A block of these small rows only.
        pend.large = false;
    }
    let last_start = opened.unwrap_or(0);
    let (mn, mx) = (&mut pend.min, &mut pend.max);
    for (i, row) in rows.chunks_exact(width).enumerate().skip(last_start) {
        if (first + i).is_multiple_of(g) {
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

/// Any codec behind the randomized Hadamard rotation of each head: the
/// cache rotates rows and queries in and outputs back, the inner codec
/// stores and attends over rotated vectors.
#[derive(Debug, Clone)]
pub struct Rotated<C> {
    inner: C,
    rot: Hadamard,
}

impl<C: KvCodec> Rotated<C> {
    /// `inner` behind `rot`.
    ///
    /// # Panics
    /// If `rot` is for another head size than `inner`'s layout.
    pub fn new(inner: C, rot: Hadamard) -> Self {
        assert_eq!(inner.layout().head_dim(), rot.head_dim(), "one head size");
        Rotated { inner, rot }
    }
}

impl<C: KvCodec> KvCodec for Rotated<C> {
    fn spec(&self) -> Codec {
        self.inner.spec().with_rotation(Rotation::Hadamard)
    }
    fn layout(&self) -> &Layout {
        self.inner.layout()
    }
    fn transforms(&self) -> bool {
        true
    }
    fn transform_in(&self, x: &mut [f32]) {
        self.inner.transform_in(x);
        self.rot.forward(x);
    }
    fn transform_out(&self, x: &mut [f32]) {
        self.rot.inverse(x);
        self.inner.transform_out(x);
    }
    fn check(
        &self,
        op: &'static str,
        rows: &[f32],
        abs_max: f32,
        first: usize,
        token0: usize,
        pend: &mut Pending,
    ) -> Result<()> {
        self.inner.check(op, rows, abs_max, first, token0, pend)
    }
    fn encode_token(
        &self,
        backend: Backend,
        row: &[f32],
        token: usize,
        codes: &mut [u8],
        params: &mut [u8],
    ) -> Result<()> {
        self.inner.encode_token(backend, row, token, codes, params)
    }
    fn encode_block(
        &self,
        backend: Backend,
        rows: &[f32],
        tokens: usize,
        head: usize,
        token0: usize,
        codes: &mut [u8],
        params: &mut [u8],
    ) -> Result<()> {
        self.inner
            .encode_block(backend, rows, tokens, head, token0, codes, params)
    }
    fn scores(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        self.inner.scores(backend, head, q, out)
    }
    fn weighted_sum(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        p: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        self.inner.weighted_sum(backend, head, p, out)
    }
    fn decode(&self, head: &PackedHead<'_>, out: &mut [f32]) {
        self.inner.decode(head, out);
    }
}
