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
use super::outliers::Sparse;
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
    /// (`[n_kv_heads, row_bytes]`), `params` (its params) and `outliers`
    /// (`[n_kv_heads, `[`Layout::head_outlier_bytes`]`(1)]`, empty for a
    /// layout without outliers).
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
        outliers: &mut [u8],
    ) -> Result<()>;

    /// Encode head `head` of a completed block of `rows` (per-channel
    /// formats) into `codes`, `params` and `outliers` (the head's block).
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
        outliers: &mut [u8],
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
    /// Outliers kept apart, in 1/10 000 of a param set's elements (0: none).
    outliers: u16,
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
            outliers: 0,
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

    /// The same format with a `fraction` of each param set's values (a
    /// head's row per-token, a head's block of tokens per-channel) kept
    /// apart as dense-and-sparse outliers ([`Sparse`]): the values whose
    /// removal narrows their groups' ranges most, stored as (position, f16
    /// correction) entries that decode and the fused kernels add back.
    /// The count per set is `⌈fraction·elements⌉`, at least one; the
    /// fraction is kept to 1/10 000.
    ///
    /// ```
    /// use kvq::{presets, Codec};
    /// let (keys, _) = presets::kivi(2)?;
    /// let plain = Codec::uniform(keys);
    /// let sparse = plain.with_outliers(0.01)?;
    /// assert_eq!(sparse.label(), "2b-pc32-asym-f16+o1%");
    /// // 41 entries of 4 bytes per block of 32 tokens × 128 channels.
    /// let l = *sparse.build(8, 128)?.layout();
    /// assert_eq!(l.outliers(), 41);
    /// assert!((l.effective_bits() - (3.0 + 41.0 * 32.0 / 4096.0)).abs() < 1e-12);
    /// // A spike in one channel of one token no longer widens its block.
    /// let mut x: Vec<f32> = (0..32 * 128).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect();
    /// x[5 * 128 + 3] = 40.0;
    /// let err = |c: &Codec| -> Result<f32, kvq::Error> {
    ///     let y = c.roundtrip(&x, 1, 128)?;
    ///     Ok(x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max))
    /// };
    /// // (The plain grid: steps of 41/3 in that channel, errors up to 2.)
    /// assert!(err(&sparse)? < err(&plain)? / 5.0);
    /// # Ok::<(), kvq::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a fraction that is not finite or
    /// outside (0, 0.5].
    pub fn with_outliers(self, fraction: f64) -> Result<Self> {
        if !(fraction > 0.0 && fraction <= 0.5) {
            return Err(Error::InvalidConfig {
                op: "Codec::with_outliers",
                what: format!("an outlier fraction of {fraction}: it must be in (0, 0.5]"),
            });
        }
        let per = (fraction * f64::from(super::outliers::PER))
            .round()
            .max(1.0);
        Ok(self.with_outlier_share(per as u16))
    }

    /// [`with_outliers`](Self::with_outliers) in 1/10 000 (0: none; not
    /// checked here: [`build`](Self::build) refuses more than 5 000).
    pub(crate) fn with_outlier_share(mut self, per: u16) -> Self {
        self.outliers = per;
        self
    }

    /// The share of values kept as outliers (0 for none).
    pub fn outlier_fraction(&self) -> f64 {
        f64::from(self.outliers) / f64::from(super::outliers::PER)
    }

    /// [`outlier_fraction`](Self::outlier_fraction) in 1/10 000.
    pub(crate) fn outlier_share(&self) -> u16 {
        self.outliers
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
        Ok(Codec::codebook(self.scheme, Levels::Fitted(f))
            .with_rotation(self.rotation)
            .with_outlier_share(self.outliers))
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
    /// (`nf4·…`) and `H·` when rotated, suffixed `+o1%` with outliers.
    pub fn label(&self) -> String {
        let mut s = match self.levels {
            None => self.scheme.label(),
            Some(l) => format!("{}·{}", l.name(), self.scheme.label()),
        };
        if self.outliers > 0 {
            s = format!("{s}+o{}%", f64::from(self.outliers) / 100.0);
        }
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
        if self.levels.is_some() || self.outliers > 0 {
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
    /// encoder and decoder: token by token per-token, block by block
    /// per-channel (a trailing partial block as one shorter block).
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
        let unit = l.block_tokens();
        let per_token = l.scheme().axis() == Axis::PerToken;
        let (cb, pb, ob) = if per_token {
            (
                l.row_bytes(),
                l.head_param_bytes(1),
                l.head_outlier_bytes(1),
            )
        } else {
            (
                l.head_code_bytes(unit),
                l.head_param_bytes(unit),
                l.head_outlier_bytes(unit),
            )
        };
        // Per-token: every head's row at once; per-channel: one head's block.
        let heads = if per_token { n_kv_heads } else { 1 };
        let (mut codes, mut params, mut outl) = (
            vec![0u8; heads * cb],
            vec![0u8; l.param_bytes(1).max(heads * pb)],
            vec![0u8; heads * ob],
        );
        let mut pend = Pending::new(if per_token { 0 } else { width });
        let backend = Backend::detect();
        let mut dq = vec![0f32; unit * head_dim];
        let mut t0 = 0;
        while t0 < tokens {
            let n = unit.min(tokens - t0);
            let rows = &mut r[t0 * width..(t0 + n) * width];
            let abs_max = rows.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            c.check(op, rows, abs_max, t0, t0, &mut pend)?;
            if per_token {
                c.encode_token(backend, rows, t0, &mut codes, &mut params, &mut outl)?;
            }
            for h in 0..n_kv_heads {
                let (hc, hp, ho) = if per_token {
                    let p = if l.shared_params() {
                        &params[..]
                    } else {
                        &params[h * pb..(h + 1) * pb]
                    };
                    (&codes[h * cb..(h + 1) * cb], p, &outl[h * ob..(h + 1) * ob])
                } else {
                    c.encode_block(backend, rows, n, h, t0, &mut codes, &mut params, &mut outl)?;
                    (&codes[..l.head_code_bytes(n)], &params[..pb], &outl[..ob])
                };
                let head = PackedHead::with_outliers(l, n, hc, hp, ho)?;
                let d = &mut dq[..n * head_dim];
                c.decode(&head, d);
                for (t, row) in d.chunks_exact(head_dim).enumerate() {
                    rows[t * width + h * head_dim..][..head_dim].copy_from_slice(row);
                }
            }
            t0 += n;
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
        let base: Box<dyn KvCodec> = match self.levels {
            None => Box::new(UniformCodec::new(layout, self.int8)),
            Some(_) if self.int8 => {
                return Err(Error::InvalidConfig {
                    op: "Codec::build",
                    what: "the int8 kernels read the uniform grid, not a codebook".into(),
                })
            }
            Some(levels) => Box::new(CodebookCodec::new(layout, levels)?),
        };
        let base = match self.outliers {
            0 => base,
            per => Box::new(Sparse::new(base, per)?),
        };
        Ok(match rot {
            None => Arc::from(base),
            Some(h) => Arc::new(Rotated::new(base, h)),
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
        _outliers: &mut [u8],
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
        _outliers: &mut [u8],
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
        outliers: &mut [u8],
    ) -> Result<()> {
        self.inner
            .encode_token(backend, row, token, codes, params, outliers)
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
        outliers: &mut [u8],
    ) -> Result<()> {
        self.inner
            .encode_block(backend, rows, tokens, head, token0, codes, params, outliers)
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

/// A boxed codec is a codec: formats compose at run time
/// ([`Codec::build`] stacks outliers and a rotation on a grid).
impl KvCodec for Box<dyn KvCodec> {
    fn spec(&self) -> Codec {
        (**self).spec()
    }
    fn layout(&self) -> &Layout {
        (**self).layout()
    }
    fn transforms(&self) -> bool {
        (**self).transforms()
    }
    fn transform_in(&self, x: &mut [f32]) {
        (**self).transform_in(x);
    }
    fn transform_out(&self, x: &mut [f32]) {
        (**self).transform_out(x);
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
        (**self).check(op, rows, abs_max, first, token0, pend)
    }
    fn encode_token(
        &self,
        backend: Backend,
        row: &[f32],
        token: usize,
        codes: &mut [u8],
        params: &mut [u8],
        outliers: &mut [u8],
    ) -> Result<()> {
        (**self).encode_token(backend, row, token, codes, params, outliers)
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
        outliers: &mut [u8],
    ) -> Result<()> {
        (**self).encode_block(backend, rows, tokens, head, token0, codes, params, outliers)
    }
    fn scores(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        (**self).scores(backend, head, q, out)
    }
    fn weighted_sum(
        &self,
        backend: Backend,
        head: &PackedHead<'_>,
        p: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        (**self).weighted_sum(backend, head, p, out)
    }
    fn decode(&self, head: &PackedHead<'_>, out: &mut [f32]) {
        (**self).decode(head, out);
    }
}
