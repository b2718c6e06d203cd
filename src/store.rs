//! Packed storage: codes and scales in flat buffers, and views of one head.
//!
//! See `docs/FORMAT.md` for the byte layout, and [`Layout`] for its sizes.

use crate::error::{Error, Result};
use crate::pack;
use crate::scheme::{Axis, Group, Layout, Mode, QuantScheme, Rounding, ScaleFormat};
use ndarray::Array3;

/// A quantized block `[tokens, n_kv_heads, head_dim]`, stored head-major.
///
/// * `codes`: for each head, `tokens` rows of [`Layout::row_bytes`] packed
///   codes (see [`pack`](mod@crate::pack)).
/// * `params`: per-token, for each head and token, a *param set* of the
///   row's groups: `[scale_0 … scale_{g-1}][zero_0 … zero_{g-1}]` (zeros
///   absent when symmetric); `Group::Vector`, one set per token shared by all
///   heads; per-channel, for each head and block of `group` tokens, a set of
///   `head_dim` scales then `head_dim` zeros. Numbers are little-endian in the
///   scheme's [`ScaleFormat`].
///
/// `bytes()` is exactly [`Layout::bytes`]`(tokens)`.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedBlock {
    layout: Layout,
    tokens: usize,
    codes: Vec<u8>,
    params: Vec<u8>,
}

impl PackedBlock {
    pub(crate) fn zeroed(layout: Layout, tokens: usize) -> Self {
        PackedBlock {
            layout,
            tokens,
            codes: vec![0; layout.code_bytes(tokens)],
            params: vec![0; layout.param_bytes(tokens)],
        }
    }

    /// Assemble a block from its two buffers (e.g. read from disk).
    ///
    /// # Errors
    /// [`Error::Length`] when a buffer does not have the layout's size for
    /// `tokens`; [`Error::InvalidShape`] when that size overflows `usize`;
    /// [`Error::Malformed`] when a stored scale or zero is not finite or a
    /// scale is negative.
    pub fn from_parts(
        layout: Layout,
        tokens: usize,
        codes: Vec<u8>,
        params: Vec<u8>,
    ) -> Result<Self> {
        let op = "PackedBlock::from_parts";
        check_fits(op, &layout, tokens)?;
        if layout.outliers() > 0 {
            return Err(Error::InvalidConfig {
                op,
                what: "a packed block holds no outlier entries; a codec with outliers stores \
                       them in a cache"
                    .into(),
            });
        }
        crate::quant::check_len(op, "bytes of codes", layout.code_bytes(tokens), codes.len())?;
        crate::quant::check_len(
            op,
            "bytes of params",
            layout.param_bytes(tokens),
            params.len(),
        )?;
        validate_params(op, &layout, &params)?;
        Ok(PackedBlock {
            layout,
            tokens,
            codes,
            params,
        })
    }

    /// The layout it was made with.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// All packed codes (head-major).
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }
    /// All params (scales and zeros).
    pub fn params(&self) -> &[u8] {
        &self.params
    }
    /// Bytes held: codes plus params. Equals `layout().bytes(tokens())`.
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.params.len()
    }

    /// A view of head `h`, what the kernels take.
    ///
    /// # Panics
    /// If `h >= n_kv_heads` (an index error, like slicing).
    #[track_caller]
    pub fn head(&self, h: usize) -> PackedHead<'_> {
        let l = &self.layout;
        assert!(
            h < l.n_kv_heads(),
            "head {h} out of range ({} heads)",
            l.n_kv_heads()
        );
        let cb = l.head_code_bytes(self.tokens);
        let params = if l.shared_params() {
            &self.params[..]
        } else {
            let pb = l.head_param_bytes(self.tokens);
            &self.params[h * pb..(h + 1) * pb]
        };
        PackedHead {
            layout: *l,
            tokens: self.tokens,
            codes: &self.codes[h * cb..(h + 1) * cb],
            params,
            outliers: &[],
        }
    }

    /// Dequantize into `out`, `[tokens, n_kv_heads, head_dim]` row-major.
    ///
    /// # Errors
    /// [`Error::Length`] when `out` has the wrong length.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        let l = &self.layout;
        let (nh, hd) = (l.n_kv_heads(), l.head_dim());
        crate::quant::check_len(
            "dequantize",
            "output values",
            self.tokens * nh * hd,
            out.len(),
        )?;
        let mut tmp = vec![0f32; self.tokens * hd];
        for h in 0..nh {
            self.head(h).dequantize_into(&mut tmp);
            for t in 0..self.tokens {
                out[(t * nh + h) * hd..(t * nh + h + 1) * hd]
                    .copy_from_slice(&tmp[t * hd..(t + 1) * hd]);
            }
        }
        Ok(())
    }

    /// Dequantize into a new array `[tokens, n_kv_heads, head_dim]` (the
    /// numbers [`dequantize_into`](Self::dequantize_into) writes).
    pub fn dequantize_array(&self) -> Array3<f32> {
        let l = &self.layout;
        let mut out = Array3::zeros((self.tokens, l.n_kv_heads(), l.head_dim()));
        let flat = out
            .as_slice_mut()
            .expect("a new array is in standard layout");
        self.dequantize_into(flat)
            .expect("the array has the block's shape");
        out
    }

    /// Store token `t` from one token's head-major code rows and params.
    pub(crate) fn put_token(&mut self, t: usize, codes: &[u8], params: &[u8]) {
        let l = self.layout;
        let rb = l.row_bytes();
        let cb = l.head_code_bytes(self.tokens);
        for h in 0..l.n_kv_heads() {
            self.codes[h * cb + t * rb..h * cb + (t + 1) * rb]
                .copy_from_slice(&codes[h * rb..(h + 1) * rb]);
        }
        if l.shared_params() {
            let pb = l.scheme().param_bytes();
            self.params[t * pb..(t + 1) * pb].copy_from_slice(params);
        } else {
            let per = l.head_param_bytes(1);
            let hp = l.head_param_bytes(self.tokens);
            for h in 0..l.n_kv_heads() {
                self.params[h * hp + t * per..h * hp + (t + 1) * per]
                    .copy_from_slice(&params[h * per..(h + 1) * per]);
            }
        }
    }

    /// Per-channel: the code rows and param set of block `b` of head `h`
    /// (`tb` tokens in it).
    pub(crate) fn channel_block_mut(
        &mut self,
        h: usize,
        b: usize,
        tb: usize,
    ) -> (&mut [u8], &mut [u8]) {
        let l = self.layout;
        let rb = l.row_bytes();
        let g = l.group_len();
        let cb = l.head_code_bytes(self.tokens);
        let set = l.head_param_bytes(g);
        let hp = l.head_param_bytes(self.tokens);
        let codes = &mut self.codes[h * cb + b * g * rb..h * cb + (b * g + tb) * rb];
        let params = &mut self.params[h * hp + b * set..h * hp + (b + 1) * set];
        (codes, params)
    }

    /// Serialize: a 32-byte header, then codes, then params (see
    /// `docs/FORMAT.md`, "Serialized block").
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.bytes());
        out.extend_from_slice(bytemuck::bytes_of(&Header::new(&self.layout, self.tokens)));
        out.extend_from_slice(&self.codes);
        out.extend_from_slice(&self.params);
        out
    }

    /// Parse bytes written by [`to_bytes`](Self::to_bytes).
    ///
    /// # Errors
    /// [`Error::Malformed`] for a wrong magic or version, an invalid scheme
    /// or shape, a length that does not match the header, or non-finite
    /// params.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let op = "PackedBlock::from_bytes";
        let bad = |what: String| Error::Malformed { op, what };
        // The header's 32 bytes, copied out (`bytes` has no alignment).
        let head = bytes.get(..HEADER_LEN).unwrap_or(bytes);
        let h: Header =
            bytemuck::try_pod_read_unaligned(head).map_err(|_: bytemuck::PodCastError| {
                bad(format!(
                    "{} bytes is shorter than the 32-byte header",
                    bytes.len()
                ))
            })?;
        if h.magic != *MAGIC {
            return Err(bad("magic is not \"KVQB\"".into()));
        }
        if h.version != VERSION {
            return Err(bad(format!("unsupported version {}", h.version)));
        }
        let u32_le = |x: u32| u32::from_le(x) as usize;
        let scheme = SchemeBytes {
            bits: h.bits,
            axis: h.axis,
            group_kind: h.group_kind,
            mode: h.mode,
            scale_format: h.scale_format,
            rounding: h.reserved0[0],
            group_size: u32::from_le(h.group_size),
        }
        .scheme()
        .map_err(bad)?;
        let (nh, hd, tokens) = (u32_le(h.n_kv_heads), u32_le(h.head_dim), u32_le(h.tokens));
        let layout = scheme.layout(nh, hd).map_err(|e| bad(e.to_string()))?;
        let need = layout
            .checked_bytes(tokens)
            .and_then(|b| HEADER_LEN.checked_add(b));
        match need {
            Some(n) if n == bytes.len() => {}
            _ => {
                return Err(bad(format!(
                    "header says {tokens} tokens of {nh}x{hd}, body has {} bytes",
                    bytes.len() - HEADER_LEN
                )))
            }
        }
        let cb = layout.code_bytes(tokens);
        let codes = bytes[HEADER_LEN..HEADER_LEN + cb].to_vec();
        let params = bytes[HEADER_LEN + cb..].to_vec();
        validate_params(op, &layout, &params)?;
        Ok(PackedBlock {
            layout,
            tokens,
            codes,
            params,
        })
    }
}

const MAGIC: &[u8; 4] = b"KVQB";
const VERSION: u8 = 1;
const HEADER_LEN: usize = 32;

/// The header of a serialized block, field for field as it lies in the
/// bytes (`docs/FORMAT.md`, section 5). The `u32` fields hold their values
/// little-endian (`u32::to_le` on write, `u32::from_le` on read), so the
/// bytes are the same on every host. Every field is naturally aligned and
/// there is no padding (`Pod` checks that), but the input of
/// [`PackedBlock::from_bytes`] has no alignment, so the header is copied
/// out of it (`try_pod_read_unaligned`).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct Header {
    magic: [u8; 4],
    version: u8,
    bits: u8,
    /// `0` per-token, `1` per-channel.
    axis: u8,
    /// `0` `Size`, `1` `Head`, `2` `Vector`.
    group_kind: u8,
    /// `0` asymmetric, `1` symmetric.
    mode: u8,
    /// `0` f16, `1` bf16, `2` f32.
    scale_format: u8,
    reserved0: [u8; 2],
    /// `G` for `Group::Size(G)`, else zero.
    group_size: u32,
    n_kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    reserved1: u32,
}

// The table of docs/FORMAT.md, section 5.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<Header>() == HEADER_LEN);
    assert!(offset_of!(Header, version) == 4);
    assert!(offset_of!(Header, scale_format) == 9);
    assert!(offset_of!(Header, reserved0) == 10);
    assert!(offset_of!(Header, group_size) == 12);
    assert!(offset_of!(Header, n_kv_heads) == 16);
    assert!(offset_of!(Header, head_dim) == 20);
    assert!(offset_of!(Header, tokens) == 24);
    assert!(offset_of!(Header, reserved1) == 28);
};

impl Header {
    fn new(l: &Layout, tokens: usize) -> Self {
        let b = SchemeBytes::new(l.scheme());
        let le = |x: usize| (x as u32).to_le();
        Header {
            magic: *MAGIC,
            version: VERSION,
            bits: b.bits,
            axis: b.axis,
            group_kind: b.group_kind,
            mode: b.mode,
            scale_format: b.scale_format,
            reserved0: [b.rounding, 0],
            group_size: b.group_size.to_le(),
            n_kv_heads: le(l.n_kv_heads()),
            head_dim: le(l.head_dim()),
            tokens: le(tokens),
            reserved1: 0,
        }
    }
}

/// A scheme as the serialized formats store it: six one-byte fields and
/// the group size (`docs/FORMAT.md`, section 5).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SchemeBytes {
    pub(crate) bits: u8,
    /// `0` per-token, `1` per-channel.
    pub(crate) axis: u8,
    /// `0` `Size`, `1` `Head`, `2` `Vector`.
    pub(crate) group_kind: u8,
    /// `0` asymmetric, `1` symmetric.
    pub(crate) mode: u8,
    /// `0` f16, `1` bf16, `2` f32.
    pub(crate) scale_format: u8,
    /// `0` grid, `1` ggml.
    pub(crate) rounding: u8,
    /// `G` for `Group::Size(G)`, else zero.
    pub(crate) group_size: u32,
}

impl SchemeBytes {
    pub(crate) fn new(s: &QuantScheme) -> Self {
        let (group_kind, group_size) = match s.group() {
            // (A scheme's group size is below 2^32.)
            Group::Size(n) => (0, u32::try_from(n).unwrap_or(u32::MAX)),
            Group::Head => (1, 0),
            Group::Vector => (2, 0),
        };
        SchemeBytes {
            bits: s.bits(),
            axis: match s.axis() {
                Axis::PerToken => 0,
                Axis::PerChannel => 1,
            },
            group_kind,
            mode: match s.mode() {
                Mode::Asymmetric => 0,
                Mode::Symmetric => 1,
            },
            scale_format: match s.scale_format() {
                ScaleFormat::F16 => 0,
                ScaleFormat::Bf16 => 1,
                ScaleFormat::F32 => 2,
            },
            rounding: match s.rounding() {
                Rounding::Grid => 0,
                Rounding::Ggml => 1,
            },
            group_size,
        }
    }

    /// The scheme these bytes name, or what is wrong with them.
    pub(crate) fn scheme(&self) -> std::result::Result<QuantScheme, String> {
        let axis = match self.axis {
            0 => Axis::PerToken,
            1 => Axis::PerChannel,
            x => return Err(format!("axis byte {x}")),
        };
        let group = match self.group_kind {
            0 => Group::Size(self.group_size as usize),
            1 => Group::Head,
            2 => Group::Vector,
            x => return Err(format!("group byte {x}")),
        };
        let mode = match self.mode {
            0 => Mode::Asymmetric,
            1 => Mode::Symmetric,
            x => return Err(format!("mode byte {x}")),
        };
        let fmt = match self.scale_format {
            0 => ScaleFormat::F16,
            1 => ScaleFormat::Bf16,
            2 => ScaleFormat::F32,
            x => return Err(format!("scale format byte {x}")),
        };
        let rounding = match self.rounding {
            0 => Rounding::Grid,
            1 => Rounding::Ggml,
            x => return Err(format!("rounding byte {x}")),
        };
        QuantScheme::new(self.bits, axis, group)
            .and_then(|s| s.with_mode(mode))
            .map_err(|e| e.to_string())?
            .with_scale_format(fmt)
            .with_rounding(rounding)
            .map_err(|e| e.to_string())
    }
}

/// `tokens` tokens of `layout` have a size that fits in `usize`.
/// That a block of `tokens` tokens fits in memory and in the serialized
/// header (32-bit token count).
pub(crate) fn check_fits(op: &'static str, l: &Layout, tokens: usize) -> Result<()> {
    if u32::try_from(tokens).is_err() {
        return Err(Error::InvalidShape {
            op,
            what: format!(
                "{tokens} tokens of {}x{}: a block holds at most 2^32 − 1 (its header counts them in 32 bits)",
                l.n_kv_heads(),
                l.head_dim()
            ),
        });
    }
    match l.checked_bytes(tokens) {
        Some(_) => Ok(()),
        None => Err(Error::InvalidShape {
            op,
            what: format!(
                "{tokens} tokens of {}x{} do not fit in memory",
                l.n_kv_heads(),
                l.head_dim()
            ),
        }),
    }
}

pub(crate) fn validate_params(op: &'static str, l: &Layout, params: &[u8]) -> Result<()> {
    let s = l.scheme();
    let fmt = s.scale_format();
    let fb = fmt.bytes();
    // Param sets alternate [scales][zeros]; a set has `n` groups.
    let n = match s.axis() {
        Axis::PerToken => l.groups_per_row(),
        Axis::PerChannel => l.head_dim(),
    };
    let set = n * s.param_bytes();
    // The largest code's value must be finite too (a finite scale near
    // the format's top times 2^bits overflows).
    let top = f32::from(u16::try_from((1u32 << s.bits()) - 1).unwrap_or(u16::MAX));
    for (k, chunk) in params.chunks(set).enumerate() {
        let nv = chunk.len() / fb;
        for g in 0..n.min(nv) {
            let sc = fmt.read(&chunk[g * fb..]);
            let ze = if nv > n {
                fmt.read(&chunk[(n + g) * fb..])
            } else {
                0.0
            };
            // (Non-finite params are reported as such below.)
            if sc.is_finite() && ze.is_finite() && (sc.abs() * top + ze.abs()).is_infinite() {
                return Err(Error::Malformed {
                    op,
                    what: format!(
                        "param set {k}, group {g}: scale {sc} and zero {ze} overflow their grid"
                    ),
                });
            }
        }
        for i in 0..chunk.len() / fb {
            let v = fmt.read(&chunk[i * fb..]);
            let is_scale = i < n;
            // ggml's symmetric `d = m/−2^(b−1)` is negative when `m` is.
            let neg_ok = s.rounding() == Rounding::Ggml;
            if !v.is_finite() || (is_scale && v < 0.0 && !neg_ok) {
                return Err(Error::Malformed {
                    op,
                    what: format!(
                        "{} {} of param set {k} is {v}",
                        if is_scale { "scale" } else { "zero" },
                        if is_scale { i } else { i - n }
                    ),
                });
            }
        }
    }
    Ok(())
}

/// One KV head of packed storage: what the kernels read.
///
/// `codes` holds `tokens` rows of [`Layout::row_bytes`]; `params` holds the
/// head's param sets (see [`PackedBlock`]); `outliers` the head's outlier
/// entries, [`Layout::outliers`] per param set (empty for layouts without).
/// Made by [`PackedBlock::head`], by the cache, or by [`PackedHead::new`]
/// over an engine's own buffers.
#[derive(Debug, Clone, Copy)]
pub struct PackedHead<'a> {
    pub(crate) layout: Layout,
    pub(crate) tokens: usize,
    pub(crate) codes: &'a [u8],
    pub(crate) params: &'a [u8],
    pub(crate) outliers: &'a [u8],
}

impl<'a> PackedHead<'a> {
    /// A view over buffers laid out as `docs/FORMAT.md` says.
    ///
    /// # Errors
    /// [`Error::Length`] when a buffer does not match the layout for
    /// `tokens` tokens of one head; [`Error::InvalidShape`] when that size
    /// overflows `usize`.
    pub fn new(layout: Layout, tokens: usize, codes: &'a [u8], params: &'a [u8]) -> Result<Self> {
        Self::with_outliers(layout, tokens, codes, params, &[])
    }

    /// A view over buffers laid out as `docs/FORMAT.md` says, with the
    /// head's outlier entries (`docs/FORMAT.md`, section 4).
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`Error::Length`] when `outliers` is not
    /// [`Layout::head_outlier_bytes`] long.
    pub fn with_outliers(
        layout: Layout,
        tokens: usize,
        codes: &'a [u8],
        params: &'a [u8],
        outliers: &'a [u8],
    ) -> Result<Self> {
        let op = "PackedHead::new";
        check_fits(op, &layout, tokens)?;
        crate::quant::check_len(
            op,
            "bytes of outliers",
            layout.head_outlier_bytes(tokens),
            outliers.len(),
        )?;
        crate::quant::check_len(
            op,
            "bytes of codes",
            layout.head_code_bytes(tokens),
            codes.len(),
        )?;
        let pb = if layout.shared_params() {
            layout.param_bytes(tokens)
        } else {
            layout.head_param_bytes(tokens)
        };
        crate::quant::check_len(op, "bytes of params", pb, params.len())?;
        Ok(PackedHead {
            layout,
            tokens,
            codes,
            params,
            outliers,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Tokens in the view.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// The packed code rows.
    pub fn codes(&self) -> &'a [u8] {
        self.codes
    }
    /// The param sets.
    pub fn params(&self) -> &'a [u8] {
        self.params
    }
    /// The outlier entries ([`Layout::outliers`] per param set).
    pub fn outliers(&self) -> &'a [u8] {
        self.outliers
    }

    /// The view without its outlier entries: the grid alone, as kernels
    /// that know only the grid read it.
    pub(crate) fn grid(&self) -> PackedHead<'a> {
        PackedHead {
            layout: self.layout.with_outliers(0).unwrap_or(self.layout),
            outliers: &[],
            ..*self
        }
    }

    /// Groups in one param set: per-token groups of a row, or `head_dim`
    /// channels of a per-channel block.
    #[inline]
    pub(crate) fn set_len(&self) -> usize {
        match self.layout.scheme().axis() {
            Axis::PerToken => self.layout.groups_per_row(),
            Axis::PerChannel => self.layout.head_dim(),
        }
    }

    /// `(scale, zero)` of group `g` of param set `k` (set = token for
    /// per-token, block for per-channel).
    #[inline]
    pub(crate) fn param(&self, k: usize, g: usize) -> (f32, f32) {
        let s = self.layout.scheme();
        let fmt = s.scale_format();
        let fb = fmt.bytes();
        let n = self.set_len();
        let base = k * n * s.param_bytes();
        let scale = fmt.read(&self.params[base + g * fb..]);
        let zero = match s.mode() {
            Mode::Asymmetric => fmt.read(&self.params[base + (n + g) * fb..]),
            Mode::Symmetric => -scale * (1u32 << (s.bits() - 1)) as f32,
        };
        (scale, zero)
    }

    /// Decode all `(scale, zero)` of param set `k` into `scales`/`zeros`.
    #[inline]
    pub(crate) fn params_into(&self, k: usize, scales: &mut [f32], zeros: &mut [f32]) {
        for g in 0..self.set_len() {
            let (s, z) = self.param(k, g);
            scales[g] = s;
            zeros[g] = z;
        }
    }

    /// Dequantize into `out`, `[tokens, head_dim]`.
    ///
    /// # Panics
    /// If `out.len() != tokens·head_dim`.
    #[track_caller]
    pub fn dequantize_into(&self, out: &mut [f32]) {
        let l = &self.layout;
        let hd = l.head_dim();
        let rb = l.row_bytes();
        let bits = l.scheme().bits();
        assert_eq!(out.len(), self.tokens * hd, "dequantize: output length");
        let mut codes = vec![0u8; hd];
        // Each param set read once (not once per element): per token its
        // groups' scales and zeros, per block every channel's.
        let n = self.set_len();
        let (mut sc, mut ze) = (vec![0f32; n], vec![0f32; n]);
        let mut set = usize::MAX;
        for t in 0..self.tokens {
            let k = match l.scheme().axis() {
                Axis::PerToken => t,
                Axis::PerChannel => t / l.group_len(),
            };
            if k != set {
                for (g, (s, z)) in sc.iter_mut().zip(ze.iter_mut()).enumerate() {
                    (*s, *z) = self.param(k, g);
                }
                set = k;
            }
            pack::unpack(&self.codes[t * rb..(t + 1) * rb], bits, &mut codes);
            let o = &mut out[t * hd..(t + 1) * hd];
            match l.scheme().axis() {
                Axis::PerToken => {
                    // A whole-vector group spans every head: one per row here.
                    let cpg = l.channels_per_group().min(hd);
                    for ((o, q), (&s, &z)) in o
                        .chunks_exact_mut(cpg)
                        .zip(codes.chunks_exact(cpg))
                        .zip(sc.iter().zip(&ze))
                    {
                        for (o, &q) in o.iter_mut().zip(q) {
                            *o = s * q as f32 + z;
                        }
                    }
                }
                Axis::PerChannel => {
                    for (((o, &q), &s), &z) in o.iter_mut().zip(&codes).zip(&sc).zip(&ze) {
                        *o = s * q as f32 + z;
                    }
                }
            }
        }
        crate::quant::outliers::add_to_rows(self, out);
    }
}
