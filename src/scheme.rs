//! Quantization schemes and their exact memory accounting.
//!
//! A [`QuantScheme`] says *how* to quantize (bits, grouping axis, group size,
//! symmetric or asymmetric, scale format). Bound to a shape
//! (`n_kv_heads`, `head_dim`) it becomes a [`Layout`], which knows how many
//! bytes every part of the packed storage takes. Both are validated when they
//! are made, so everything downstream may trust them.

use crate::error::{Error, Result};
use half::{bf16, f16};

/// The axis along which a quantization group runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Axis {
    /// A group is a run of channels of one token (values, and llama.cpp's
    /// block formats). Groups are made as each token arrives.
    PerToken,
    /// A group is a run of tokens of one channel (KIVI's keys). Isolates the
    /// outlier channels that keys have. Groups are made once a whole block of
    /// tokens is there.
    PerChannel,
}

/// How many elements share one scale (and zero).
///
/// The group always runs *along the axis*: per-token groups split a token's
/// channels, per-channel groups split a channel's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// `n` elements, `n` a positive multiple of 8. Per-token: `n` must divide
    /// `head_dim`. Per-channel: `n` tokens per block.
    Size(usize),
    /// One group per head (`head_dim` channels). Per-token only.
    Head,
    /// One group for the whole key (or value) vector of a token: all KV heads
    /// of the layer together, `n_kv_heads * head_dim` channels — the GPT-2
    /// "whole vector" case of the study. Per-token only.
    Vector,
}

/// How a group's params and codes are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Rounding {
    /// kvq's grid: the scale rounded *up* and the zero *down* into the
    /// scale format, so every element lies inside the grid (error at most
    /// half a step); codes are the nearest grid point.
    #[default]
    Grid,
    /// llama.cpp's reference quantizer (`quantize_row_q*_ref` in
    /// `ggml-quants.c`), value for value: symmetric 4/5-bit `d = m/−2^(b−1)`
    /// with `m` the group's first element of largest magnitude (so `d` may
    /// be negative and the levels are `−2^(b−1) … 2^(b−1)−1`), symmetric
    /// 8-bit `d = absmax/127` with codes rounded half away from zero,
    /// asymmetric `d = (max − min)/(2^b − 1)` and `m = min`; the codes are
    /// computed with the unrounded `1/d`, and `d` and `m` are stored rounded
    /// to the nearest f16. Only the five ggml block types: per-token groups
    /// of 32, f16 scales, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `q8_0`.
    Ggml,
}

/// Symmetric or asymmetric quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// `x̂ = scale·code + zero` with unsigned codes `0..=2^bits-1`,
    /// `zero ≤ min`, `scale = (max - zero) / (2^bits - 1)`. Stores scale and
    /// zero.
    Asymmetric,
    /// `x̂ = scale·c` with signed `c` in `-(2^(bits-1)-1) ..= 2^(bits-1)-1`,
    /// `scale = absmax / (2^(bits-1)-1)`; stored as the unsigned code
    /// `c + 2^(bits-1)`, so `x̂ = scale·code + zero` with the implied
    /// `zero = -scale·2^(bits-1)`. Stores the scale only; needs `bits ≥ 2`.
    Symmetric,
}

/// The number format scales and zeros are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleFormat {
    /// IEEE binary16 (2 bytes). Range ±65504; the default.
    F16,
    /// bfloat16 (2 bytes). f32's range, 8 bits of precision.
    Bf16,
    /// IEEE binary32 (4 bytes).
    F32,
}

impl ScaleFormat {
    /// Bytes one stored number takes.
    pub const fn bytes(self) -> usize {
        match self {
            ScaleFormat::F16 | ScaleFormat::Bf16 => 2,
            ScaleFormat::F32 => 4,
        }
    }

    /// The format's name, as used in messages.
    pub const fn name(self) -> &'static str {
        match self {
            ScaleFormat::F16 => "f16",
            ScaleFormat::Bf16 => "bf16",
            ScaleFormat::F32 => "f32",
        }
    }

    /// Round `x` to the nearest number of this format that is `≥ x`.
    /// May return `+inf` when `x` is beyond the format's range.
    #[inline(always)]
    pub fn round_up(self, x: f64) -> f32 {
        let x32 = f64_to_f32_directed(x, true);
        match self {
            ScaleFormat::F32 => x32,
            ScaleFormat::F16 => f16_bits_to_f32(f32_to_f16_up(x32)),
            ScaleFormat::Bf16 => f32::from_bits((f32_to_bf16_up(x32) as u32) << 16),
        }
    }

    /// Round `x` to the nearest number of this format that is `≤ x`.
    /// May return `-inf` when `x` is beyond the format's range.
    #[inline(always)]
    pub fn round_down(self, x: f64) -> f32 {
        -self.round_up(-x)
    }

    /// Write `x` (already representable) as little-endian bytes.
    #[inline(always)]
    pub(crate) fn write(self, x: f32, out: &mut [u8]) {
        match self {
            // Representable, so rounding in either direction is exact.
            ScaleFormat::F16 => out[..2].copy_from_slice(&f32_to_f16_up(x).to_le_bytes()),
            ScaleFormat::Bf16 => out[..2].copy_from_slice(&f32_to_bf16_up(x).to_le_bytes()),
            ScaleFormat::F32 => out[..4].copy_from_slice(&x.to_bits().to_le_bytes()),
        }
    }

    /// Read one stored number.
    #[inline]
    pub(crate) fn read(self, b: &[u8]) -> f32 {
        match self {
            ScaleFormat::F16 => f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            ScaleFormat::Bf16 => bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            ScaleFormat::F32 => f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
    }
}

/// `x` as f32, rounded toward +inf (`up`) or -inf.
#[inline(always)]
fn f64_to_f32_directed(x: f64, up: bool) -> f32 {
    let y = x as f32;
    if (y as f64) == x || !y.is_finite() && !x.is_finite() {
        return y;
    }
    let below = (y as f64) < x;
    if below == up {
        next_f32(y, up)
    } else {
        y
    }
}

#[inline(always)]
fn next_f32(y: f32, up: bool) -> f32 {
    if y.is_nan() || (y.is_infinite() && (y > 0.0) == up) {
        return y;
    }
    if y == 0.0 {
        let tiny = f32::from_bits(1);
        return if up { tiny } else { -tiny };
    }
    let bits = y.to_bits();
    // Away from zero means +1 on the magnitude bits.
    let away = (y > 0.0) == up;
    f32::from_bits(if away { bits + 1 } else { bits - 1 })
}

/// The IEEE half nearest to `x` that is `≥ x` (toward +inf), as bits;
/// `x` NaN gives a NaN. Integer-only (no F16C, no call): it runs once per
/// group on the quantize path.
#[inline(always)]
fn f32_to_f16_up(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = b & 0x7FFF_FFFF;
    if a > 0x7F80_0000 {
        return 0x7E00; // NaN
    }
    let e = (a >> 23) as i32 - 127;
    // Magnitude truncated toward zero, and whether that lost anything.
    let (mag, inexact) = if a == 0x7F80_0000 {
        (0x7C00u16, false)
    } else if e > 15 {
        (0x7BFF, true)
    } else if e >= -14 {
        let m = a & 0x7F_FFFF;
        ((((e + 15) as u32) << 10 | m >> 13) as u16, m & 0x1FFF != 0)
    } else if a < 0x0080_0000 {
        // An f32 subnormal is far below the smallest half subnormal.
        (0, a != 0)
    } else {
        // Half subnormal: units of 2^-24.
        let m = (a & 0x7F_FFFF) | 0x80_0000;
        let sh = (-1 - e) as u32; // 14 ..
        if sh >= 32 {
            (0, true)
        } else {
            ((m >> sh) as u16, m & ((1u32 << sh) - 1) != 0)
        }
    };
    // Toward zero is already up for negatives; positives step one up
    // (0x7BFF + 1 is +inf).
    if inexact && sign == 0 {
        mag + 1
    } else {
        sign | mag
    }
}

/// A half's bits as the (exact) `f32`.
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let e = ((h >> 10) & 0x1F) as u32;
    let m = (h & 0x3FF) as u32;
    let mag = if e == 0x1F {
        0x7F80_0000 | m << 13
    } else if e > 0 {
        (e + 112) << 23 | m << 13
    } else {
        // Subnormal (or zero): m · 2^-24, exact in f32.
        (m as f32 * (1.0 / 16_777_216.0)).to_bits()
    };
    f32::from_bits(sign | mag)
}

/// The bfloat16 nearest to `x` that is `≥ x`, as bits (NaN stays NaN).
#[inline(always)]
fn f32_to_bf16_up(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return 0x7FC0;
    }
    let t = (b >> 16) as u16;
    if b & 0xFFFF != 0 && b >> 31 == 0 {
        t + 1
    } else {
        t
    }
}

/// How to quantize one tensor (keys or values) of a layer.
///
/// Made with [`QuantScheme::new`] (asymmetric, f16 scale and zero) and
/// adjusted with [`with_mode`](QuantScheme::with_mode) and
/// [`with_scale_format`](QuantScheme::with_scale_format). A scheme that
/// exists is valid; whether it fits a shape is checked by
/// [`layout`](QuantScheme::layout).
///
/// # Example
/// ```
/// use kvq::{Axis, Group, QuantScheme};
/// // The study's best 5.5-bit split: K 6 bits, V 4 bits, f16 scale + zero per 64.
/// let k = QuantScheme::new(6, Axis::PerToken, Group::Size(64))?;
/// let v = QuantScheme::new(4, Axis::PerToken, Group::Size(64))?;
/// let (lk, lv) = (k.layout(12, 64)?, v.layout(12, 64)?);
/// let bits = (lk.effective_bits() + lv.effective_bits()) / 2.0;
/// assert_eq!(bits, 5.5);
/// assert!((16.0 / bits - 2.91).abs() < 0.01);
/// # Ok::<(), kvq::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantScheme {
    bits: u8,
    axis: Axis,
    group: Group,
    mode: Mode,
    scale_format: ScaleFormat,
    rounding: Rounding,
}

impl QuantScheme {
    /// An asymmetric scheme with f16 scale and zero.
    ///
    /// # Errors
    /// [`Error::InvalidScheme`] when `bits` is not in `1..=8`, a
    /// `Group::Size(n)` has `n` zero or not a multiple of 8, or a per-channel
    /// scheme asks for `Group::Head`/`Group::Vector` (per-channel groups run
    /// along tokens, so only `Size` means something).
    pub fn new(bits: u8, axis: Axis, group: Group) -> Result<Self> {
        if !(1..=8).contains(&bits) {
            return Err(Error::InvalidScheme {
                what: format!("bits must be in 1..=8, got {bits}"),
            });
        }
        match (axis, group) {
            (_, Group::Size(n)) if n == 0 || !n.is_multiple_of(8) || u32::try_from(n).is_err() => {
                return Err(Error::InvalidScheme {
                    what: format!(
                        "group size must be a positive multiple of 8 below 2^32, got {n}"
                    ),
                })
            }
            (Axis::PerChannel, Group::Head | Group::Vector) => {
                return Err(Error::InvalidScheme {
                    what: format!(
                    "per-channel groups run along tokens: use Group::Size(tokens), not {group:?}"
                ),
                })
            }
            _ => {}
        }
        Ok(QuantScheme {
            bits,
            axis,
            group,
            mode: Mode::Asymmetric,
            scale_format: ScaleFormat::F16,
            rounding: Rounding::Grid,
        })
    }

    /// The same scheme with another [`Mode`].
    ///
    /// # Errors
    /// [`Error::InvalidScheme`] for `Mode::Symmetric` with `bits == 1`
    /// (a symmetric grid needs at least the levels −1, 0, +1).
    pub fn with_mode(mut self, mode: Mode) -> Result<Self> {
        if mode == Mode::Symmetric && self.bits < 2 {
            return Err(Error::InvalidScheme {
                what: "symmetric quantization needs bits >= 2, got 1".into(),
            });
        }
        self.mode = mode;
        self.check_rounding()?;
        Ok(self)
    }

    /// The same scheme with scales (and zeros) stored in `format`.
    ///
    /// ggml's blocks store f16 scales: a [`Rounding::Ggml`] scheme given
    /// another format becomes [`Rounding::Grid`].
    pub fn with_scale_format(mut self, format: ScaleFormat) -> Self {
        self.scale_format = format;
        if format != ScaleFormat::F16 {
            self.rounding = Rounding::Grid;
        }
        self
    }

    /// The same scheme with another [`Rounding`].
    ///
    /// # Errors
    /// [`Error::InvalidScheme`] for [`Rounding::Ggml`] on a scheme that is
    /// not one of ggml's block types (see [`Rounding::Ggml`]).
    pub fn with_rounding(mut self, rounding: Rounding) -> Result<Self> {
        self.rounding = rounding;
        self.check_rounding()?;
        Ok(self)
    }

    fn check_rounding(&self) -> Result<()> {
        if self.rounding == Rounding::Grid {
            return Ok(());
        }
        let ggml_type = matches!(
            (self.bits, self.mode),
            (4 | 5 | 8, Mode::Symmetric) | (4 | 5, Mode::Asymmetric)
        );
        if !ggml_type
            || self.axis != Axis::PerToken
            || self.group != Group::Size(32)
            || self.scale_format != ScaleFormat::F16
        {
            return Err(Error::InvalidScheme {
                what: format!(
                    "ggml rounding needs a ggml block type (q4_0, q4_1, q5_0, q5_1, q8_0: per-token groups of 32, f16 scales), not {}",
                    self.label()
                ),
            });
        }
        Ok(())
    }

    /// How params and codes are chosen.
    pub fn rounding(&self) -> Rounding {
        self.rounding
    }

    /// Bits per code, `1..=8`.
    pub fn bits(&self) -> u8 {
        self.bits
    }
    /// Grouping axis.
    pub fn axis(&self) -> Axis {
        self.axis
    }
    /// Group size.
    pub fn group(&self) -> Group {
        self.group
    }
    /// Symmetric or asymmetric.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// Format of stored scales and zeros.
    pub fn scale_format(&self) -> ScaleFormat {
        self.scale_format
    }

    /// Bind the scheme to a layer's shape.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `n_kv_heads` is 0 or `head_dim` is not a
    /// positive multiple of 8; [`Error::SchemeShape`] when a per-token
    /// `Group::Size(n)` does not divide `head_dim`.
    pub fn layout(&self, n_kv_heads: usize, head_dim: usize) -> Result<Layout> {
        Layout::new(*self, n_kv_heads, head_dim)
    }

    /// A short, stable name, e.g. `k4-pc32-asym-f16`, `v8-pt64-sym-f16`,
    /// `4b/token/head`.
    pub fn label(&self) -> String {
        let axis = match self.axis {
            Axis::PerToken => "pt",
            Axis::PerChannel => "pc",
        };
        let group = match self.group {
            Group::Size(n) => n.to_string(),
            Group::Head => "head".into(),
            Group::Vector => "vec".into(),
        };
        let mode = match self.mode {
            Mode::Asymmetric => "asym",
            Mode::Symmetric => "sym",
        };
        let ggml = match self.rounding {
            Rounding::Grid => "",
            Rounding::Ggml => "-ggml",
        };
        format!(
            "{}b-{axis}{group}-{mode}-{}{ggml}",
            self.bits,
            self.scale_format.name()
        )
    }

    /// Numbers stored per group: 2 (scale, zero) asymmetric, 1 symmetric.
    pub fn params_per_group(&self) -> usize {
        match self.mode {
            Mode::Asymmetric => 2,
            Mode::Symmetric => 1,
        }
    }

    /// Bytes of scale (+ zero) per group.
    pub fn param_bytes(&self) -> usize {
        self.params_per_group() * self.scale_format.bytes()
    }
}

/// Presets with the bit budget of formats people already know.
///
/// These match each format's bits, grouping and scale overhead (and so its
/// effective bits and memory); the byte layout is kvq's own
/// (see `docs/FORMAT.md`), not a copy of the original.
pub mod presets {
    use super::*;

    fn s(bits: u8, axis: Axis, group: Group, mode: Mode) -> QuantScheme {
        QuantScheme::new(bits, axis, group)
            .and_then(|q| q.with_mode(mode))
            .expect("preset schemes are valid")
    }
    fn ggml(bits: u8, mode: Mode) -> QuantScheme {
        s(bits, Axis::PerToken, Group::Size(32), mode)
            .with_rounding(Rounding::Ggml)
            .expect("ggml block types")
    }

    /// KIVI (2 or 4 bits): keys per-channel in blocks of 32 tokens, values
    /// per-token in groups of 32 channels, f16 scale and zero. Returns
    /// `(keys, values)`. Pair it with a residual window of 128 tokens.
    ///
    /// # Errors
    /// [`Error::InvalidScheme`] for bits outside `1..=8`.
    pub fn kivi(bits: u8) -> Result<(QuantScheme, QuantScheme)> {
        Ok((
            QuantScheme::new(bits, Axis::PerChannel, Group::Size(32))?,
            QuantScheme::new(bits, Axis::PerToken, Group::Size(32))?,
        ))
    }
    /// llama.cpp `q8_0`: symmetric 8-bit, f16 scale per 32 (8.5 bits).
    ///
    /// ggml's own quantizer ([`Rounding::Ggml`]): the same values llama.cpp
    /// stores for this type.
    pub fn q8_0() -> QuantScheme {
        ggml(8, Mode::Symmetric)
    }
    /// llama.cpp `q4_0`: symmetric 4-bit, f16 scale per 32 (4.5 bits).
    ///
    /// ggml's own quantizer ([`Rounding::Ggml`]): the same values llama.cpp
    /// stores for this type.
    pub fn q4_0() -> QuantScheme {
        ggml(4, Mode::Symmetric)
    }
    /// llama.cpp `q4_1`: asymmetric 4-bit, f16 scale and min per 32 (5 bits).
    ///
    /// ggml's own quantizer ([`Rounding::Ggml`]): the same values llama.cpp
    /// stores for this type.
    pub fn q4_1() -> QuantScheme {
        ggml(4, Mode::Asymmetric)
    }
    /// llama.cpp `q5_0`: symmetric 5-bit, f16 scale per 32 (5.5 bits).
    ///
    /// ggml's own quantizer ([`Rounding::Ggml`]): the same values llama.cpp
    /// stores for this type.
    pub fn q5_0() -> QuantScheme {
        ggml(5, Mode::Symmetric)
    }
    /// llama.cpp `q5_1`: asymmetric 5-bit, f16 scale and min per 32 (6 bits).
    ///
    /// ggml's own quantizer ([`Rounding::Ggml`]): the same values llama.cpp
    /// stores for this type.
    pub fn q5_1() -> QuantScheme {
        ggml(5, Mode::Asymmetric)
    }
    /// llama.cpp `iq4_nl`: 16 non-uniform levels, f16 scale per 32 (4.5
    /// bits), ggml's encoder ([`Levels::Iq4Nl`](crate::quant::codebook::Levels::Iq4Nl)):
    /// the values llama.cpp stores for this cache type. A codec, not a
    /// scheme: its codes index a table.
    pub fn iq4_nl() -> crate::Codec {
        crate::Codec::codebook(q4_0(), crate::quant::codebook::Levels::Iq4Nl)
    }
    /// HF quanto `int4` as used by transformers' `QuantizedCache`: asymmetric
    /// 4-bit, groups of 64 channels per token.
    pub fn quanto_int4() -> QuantScheme {
        s(4, Axis::PerToken, Group::Size(64), Mode::Asymmetric)
    }
    /// HF quanto `int2`: asymmetric 2-bit, groups of 64 channels per token.
    pub fn quanto_int2() -> QuantScheme {
        s(2, Axis::PerToken, Group::Size(64), Mode::Asymmetric)
    }
}

/// A [`QuantScheme`] bound to a layer shape: every size in the packed storage.
///
/// Storage is head-major. For each KV head, the *code rows* hold one row of
/// `head_dim` packed codes per token (`row_bytes()` bytes). The *params* hold
/// scale (and zero) per group: per-token, `groups_per_row()` groups per head
/// row; per-channel, `head_dim` groups per block of `block_tokens()` tokens;
/// `Group::Vector`, one group per token shared by all heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    scheme: QuantScheme,
    n_kv_heads: usize,
    head_dim: usize,
    /// Elements per group (channels per-token, tokens per-channel).
    group_len: usize,
    /// Outlier entries per param set and head (0: none).
    outliers: usize,
}

/// Bytes of one outlier entry: a little-endian `u16` position within its
/// param set's elements and the little-endian f16 correction added there
/// (a set stores its positions, then its corrections: `docs/FORMAT.md`,
/// section 4).
pub const OUTLIER_BYTES: usize = 4;

impl Layout {
    /// See [`QuantScheme::layout`].
    ///
    /// # Errors
    /// As [`QuantScheme::layout`].
    pub fn new(scheme: QuantScheme, n_kv_heads: usize, head_dim: usize) -> Result<Self> {
        check_shape("layout", n_kv_heads, head_dim)?;
        let group_len = match (scheme.axis, scheme.group) {
            (Axis::PerToken, Group::Size(n)) => {
                if !head_dim.is_multiple_of(n) {
                    return Err(Error::SchemeShape {
                        op: "layout",
                        what: format!(
                            "per-token group of {n} channels does not divide head_dim {head_dim}"
                        ),
                    });
                }
                n
            }
            (Axis::PerToken, Group::Head) => head_dim,
            (Axis::PerToken, Group::Vector) => n_kv_heads * head_dim,
            (Axis::PerChannel, Group::Size(n)) => n,
            (Axis::PerChannel, _) => unreachable!("rejected by QuantScheme::new"),
        };
        Ok(Layout {
            scheme,
            n_kv_heads,
            head_dim,
            group_len,
            outliers: 0,
        })
    }

    /// The same layout with `n` outlier entries per param set and head: a
    /// side list of (position, correction) pairs beside each token's row
    /// (per-token) or each block (per-channel).
    ///
    /// # Errors
    /// [`Error::SchemeShape`] for `Group::Vector` (its params span every
    /// head), for a param set of more than 65 536 elements (positions are
    /// 16-bit) or for `n` above half the set's elements.
    pub(crate) fn with_outliers(mut self, n: usize) -> Result<Self> {
        let elems = self.block_tokens() * self.head_dim;
        let why = if self.shared_params() && n > 0 {
            Some("outliers are per head; a whole-vector group spans every head".to_string())
        } else if n > 0 && elems > 1 << 16 {
            Some(format!(
                "a param set of {elems} elements: outlier positions are 16-bit"
            ))
        } else if n > elems / 2 {
            Some(format!(
                "{n} outliers in a param set of {elems} elements (at most half)"
            ))
        } else {
            None
        };
        if let Some(what) = why {
            return Err(Error::SchemeShape {
                op: "Layout::with_outliers",
                what,
            });
        }
        self.outliers = n;
        Ok(self)
    }

    /// Outlier entries per param set and head (0 for none): per-token, per
    /// head row; per-channel, per head and block.
    pub fn outliers(&self) -> usize {
        self.outliers
    }

    /// Elements one param set covers in one head: `head_dim` per-token,
    /// `block_tokens()·head_dim` per-channel (outlier positions index them
    /// token-major).
    pub fn set_elements(&self) -> usize {
        self.block_tokens() * self.head_dim
    }

    /// Bytes of outlier entries for `tokens` tokens of one head (a partial
    /// last per-channel block counts whole, as its params do).
    pub fn head_outlier_bytes(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens()) * self.outliers * OUTLIER_BYTES
    }

    /// Bytes of outlier entries for `tokens` tokens, all heads.
    pub fn outlier_bytes(&self, tokens: usize) -> usize {
        self.n_kv_heads * self.head_outlier_bytes(tokens)
    }

    /// The scheme.
    pub fn scheme(&self) -> &QuantScheme {
        &self.scheme
    }
    /// KV heads.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Elements sharing one scale: channels (per-token) or tokens
    /// (per-channel).
    pub fn group_len(&self) -> usize {
        self.group_len
    }
    /// Whether scale/zero are shared by all heads of a token
    /// (`Group::Vector`).
    pub fn shared_params(&self) -> bool {
        self.scheme.group == Group::Vector
    }
    /// Bytes of packed codes of one head and one token.
    pub fn row_bytes(&self) -> usize {
        self.head_dim * self.scheme.bits as usize / 8
    }
    /// Per-token: groups in one head row (1 for `Group::Vector`, whose group
    /// spans all heads). Per-channel: 0.
    pub fn groups_per_row(&self) -> usize {
        match self.scheme.axis {
            Axis::PerToken if self.shared_params() => 1,
            Axis::PerToken => self.head_dim / self.group_len,
            Axis::PerChannel => 0,
        }
    }
    /// Channels covered by one group within a head row (per-token).
    pub fn channels_per_group(&self) -> usize {
        match self.scheme.axis {
            Axis::PerToken => self.group_len.min(self.head_dim),
            Axis::PerChannel => 1,
        }
    }
    /// Per-channel: tokens per block. Per-token: 1.
    pub fn block_tokens(&self) -> usize {
        match self.scheme.axis {
            Axis::PerToken => 1,
            Axis::PerChannel => self.group_len,
        }
    }

    /// Bytes of codes for `tokens` tokens of one head.
    pub fn head_code_bytes(&self, tokens: usize) -> usize {
        tokens * self.row_bytes()
    }
    /// Bytes of params for `tokens` tokens of one head (per-channel counts
    /// a partial last block as a whole block; `Group::Vector` counts the
    /// shared params once, in [`param_bytes`](Self::param_bytes), not here).
    pub fn head_param_bytes(&self, tokens: usize) -> usize {
        let pb = self.scheme.param_bytes();
        match self.scheme.axis {
            Axis::PerToken if self.shared_params() => 0,
            Axis::PerToken => tokens * self.groups_per_row() * pb,
            Axis::PerChannel => tokens.div_ceil(self.group_len) * self.head_dim * pb,
        }
    }
    /// Bytes of all params (scales and zeros) for `tokens` tokens, all heads.
    pub fn param_bytes(&self, tokens: usize) -> usize {
        if self.shared_params() {
            tokens * self.scheme.param_bytes()
        } else {
            self.n_kv_heads * self.head_param_bytes(tokens)
        }
    }
    /// Bytes of all codes for `tokens` tokens, all heads.
    pub fn code_bytes(&self, tokens: usize) -> usize {
        self.n_kv_heads * self.head_code_bytes(tokens)
    }
    /// Total bytes for `tokens` tokens: exactly what a
    /// [`PackedBlock`](crate::PackedBlock) of that many tokens allocates.
    pub fn bytes(&self, tokens: usize) -> usize {
        self.code_bytes(tokens) + self.param_bytes(tokens) + self.outlier_bytes(tokens)
    }
    /// [`bytes`](Self::bytes), or `None` when a size overflows `usize`
    /// (for sizes that come from outside: headers, `from_parts`).
    pub(crate) fn checked_bytes(&self, tokens: usize) -> Option<usize> {
        let pb = self.scheme.param_bytes();
        let row = self.head_dim.checked_mul(self.scheme.bits as usize)? / 8;
        let codes = tokens.checked_mul(row)?.checked_mul(self.n_kv_heads)?;
        let params = match self.scheme.axis {
            Axis::PerToken if self.shared_params() => tokens.checked_mul(pb)?,
            Axis::PerToken => tokens
                .checked_mul(self.groups_per_row() * pb)?
                .checked_mul(self.n_kv_heads)?,
            Axis::PerChannel => tokens
                .div_ceil(self.group_len)
                .checked_mul(self.head_dim)?
                .checked_mul(pb)?
                .checked_mul(self.n_kv_heads)?,
        };
        let outliers = tokens
            .div_ceil(self.block_tokens())
            .checked_mul(self.outliers * OUTLIER_BYTES)?
            .checked_mul(self.n_kv_heads)?;
        codes.checked_add(params)?.checked_add(outliers)
    }
    /// Bytes per token for per-token schemes; per-channel, the bytes of one
    /// full block divided by its tokens (exact when it divides).
    pub fn bytes_per_token(&self) -> f64 {
        let t = self.block_tokens();
        self.bytes(t) as f64 / t as f64
    }
    /// Bits per stored element, counting scale/zero overhead and outlier
    /// entries: `bits + param_bits / group_len + outlier_bits / set_elements`.
    pub fn effective_bits(&self) -> f64 {
        self.scheme.bits as f64
            + (self.scheme.param_bytes() * 8) as f64 / self.group_len as f64
            + (self.outliers * OUTLIER_BYTES * 8) as f64 / self.set_elements() as f64
    }
    /// Compression against an f16 cache, `16 / effective_bits`.
    pub fn compression_vs_f16(&self) -> f64 {
        16.0 / self.effective_bits()
    }
}

/// The most KV heads a layout, quantizer or cache takes.
pub const MAX_HEADS: usize = 1 << 16;
/// The largest `head_dim` a layout, quantizer or cache takes.
pub const MAX_HEAD_DIM: usize = 1 << 16;
/// The most channels per token (`n_kv_heads·head_dim`) a layout,
/// quantizer or cache takes.
pub const MAX_ROW_WIDTH: usize = 1 << 20;

/// Shape check shared by every operation that takes `n_kv_heads`/`head_dim`.
pub(crate) fn check_shape(op: &'static str, n_kv_heads: usize, head_dim: usize) -> Result<()> {
    if n_kv_heads == 0 {
        return Err(Error::InvalidShape {
            op,
            what: "n_kv_heads must be at least 1, got 0".into(),
        });
    }
    if head_dim == 0 || !head_dim.is_multiple_of(8) {
        return Err(Error::InvalidShape {
            op,
            what: format!("head_dim must be a positive multiple of 8, got {head_dim}"),
        });
    }
    // Far above any model (128 heads of 576 channels, 73,728 per token, is
    // the widest in use), and low enough that what a cache allocates per
    // head and per channel before its first token (at most a few tens of
    // MiB) stays bounded for any accepted shape.
    let width = n_kv_heads.checked_mul(head_dim);
    if n_kv_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || width.is_none_or(|w| w > MAX_ROW_WIDTH)
    {
        return Err(Error::InvalidShape {
            op,
            what: format!(
                "{n_kv_heads} heads of {head_dim} channels: kvq takes at most {MAX_HEADS} heads, \
                 {MAX_HEAD_DIM} channels per head and {MAX_ROW_WIDTH} channels per token"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn study_accounting() {
        let k = QuantScheme::new(6, Axis::PerToken, Group::Size(64)).unwrap();
        let v = QuantScheme::new(4, Axis::PerToken, Group::Size(64)).unwrap();
        let b = (k.layout(12, 64).unwrap().effective_bits()
            + v.layout(12, 64).unwrap().effective_bits())
            / 2.0;
        assert_eq!(b, 5.5);
        assert!((16.0 / b - 2.909).abs() < 1e-3);
        let k = QuantScheme::new(4, Axis::PerToken, Group::Size(256)).unwrap();
        let v = QuantScheme::new(8, Axis::PerToken, Group::Size(256)).unwrap();
        let b = (k.layout(4, 256).unwrap().effective_bits()
            + v.layout(4, 256).unwrap().effective_bits())
            / 2.0;
        assert_eq!(b, 6.125);
        assert!((16.0 / b - 2.612).abs() < 1e-3);
    }

    #[test]
    fn rejects_bad_schemes() {
        assert!(QuantScheme::new(0, Axis::PerToken, Group::Head).is_err());
        assert!(QuantScheme::new(9, Axis::PerToken, Group::Head).is_err());
        assert!(QuantScheme::new(4, Axis::PerToken, Group::Size(12)).is_err());
        assert!(QuantScheme::new(4, Axis::PerToken, Group::Size(0)).is_err());
        assert!(QuantScheme::new(4, Axis::PerChannel, Group::Head).is_err());
        assert!(QuantScheme::new(1, Axis::PerToken, Group::Head)
            .unwrap()
            .with_mode(Mode::Symmetric)
            .is_err());
        let s = QuantScheme::new(4, Axis::PerToken, Group::Size(48)).unwrap();
        let e = s.layout(2, 64).unwrap_err();
        assert!(e.to_string().contains("48"), "{e}");
        assert!(s.layout(0, 48).is_err());
        assert!(s.layout(1, 20).is_err());
    }

    #[test]
    fn directed_rounding() {
        for &x in &[0.1f64, 1e-9, 3.3e-5, 1234.567, 65504.0, 1e-30, 0.0] {
            for f in [ScaleFormat::F16, ScaleFormat::Bf16, ScaleFormat::F32] {
                let u = f.round_up(x);
                let d = f.round_down(x);
                assert!(u as f64 >= x && d as f64 <= x, "{f:?} {x}: {d} {u}");
                // representable: a write/read round trip is exact
                let mut b = [0u8; 4];
                f.write(u, &mut b);
                assert_eq!(f.read(&b), u);
                f.write(d, &mut b);
                assert_eq!(f.read(&b), d);
            }
        }
        assert!(ScaleFormat::F16.round_up(70000.0).is_infinite());
    }

    /// The integer directed rounding against `half`'s conversions (round to
    /// nearest, then one step up if below) on every f16 boundary region and
    /// on pseudo-random f32 bit patterns of every exponent.
    #[test]
    fn directed_rounding_matches_half() {
        /// Round to nearest with `half`, then one step up if below.
        fn oracle<T: Copy>(
            x: f32,
            from: fn(f32) -> T,
            to: fn(T) -> f32,
            bits: fn(T) -> u16,
            of: fn(u16) -> T,
        ) -> f32 {
            let h = from(x);
            let v = to(h);
            if v >= x || v.is_nan() {
                return v;
            }
            let b = bits(h);
            let n = if v == 0.0 {
                1
            } else if v > 0.0 {
                b + 1
            } else {
                b - 1
            };
            to(of(n))
        }
        let oracle_f16 = |x| oracle(x, f16::from_f32, f16::to_f32, f16::to_bits, f16::from_bits);
        let oracle_bf16 = |x| {
            oracle(
                x,
                bf16::from_f32,
                bf16::to_f32,
                bf16::to_bits,
                bf16::from_bits,
            )
        };
        let mut xs: Vec<f32> = Vec::new();
        for h in 0..=0xFFFFu16 {
            let v = f16::from_bits(h).to_f32();
            if v.is_finite() {
                xs.push(v);
                xs.push(f32::from_bits(v.to_bits().wrapping_add(1)));
                xs.push(f32::from_bits(v.to_bits().wrapping_sub(1)));
            }
        }
        let mut r = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200_000 {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            xs.push(f32::from_bits(r as u32));
        }
        xs.extend([
            f32::MAX,
            -f32::MAX,
            f32::MIN_POSITIVE,
            65504.0,
            65520.0,
            1e-8,
            -1e-8,
        ]);
        for &x in xs.iter().filter(|x| x.is_finite()) {
            let got = f16_bits_to_f32(f32_to_f16_up(x));
            let want = oracle_f16(x);
            assert!(got == want, "f16 up of {x:e}: {got:e} vs {want:e}");
            assert_eq!(got.to_bits() >> 31 == 1 && got != 0.0, want < 0.0, "{x:e}");
            let got = f32::from_bits((f32_to_bf16_up(x) as u32) << 16);
            assert!(got == oracle_bf16(x), "bf16 up of {x:e}");
            // Exact for representable values, in both formats.
            let h = f16::from_f32(x);
            if h.is_finite() {
                assert_eq!(f32_to_f16_up(h.to_f32()), h.to_bits(), "{x:e}");
            }
        }
    }
}
