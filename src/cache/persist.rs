//! Saving a cache to a byte stream and loading it back
//! (`docs/FORMAT.md`, section 7).
//!
//! A saved cache is its configuration, then each of K and V of each layer
//! as stored (sink rows, packed codes and params, residual rows), then a
//! checksum. Nothing is re-quantized either way, so a loaded cache equals
//! the saved one byte for byte and attends identically.
//!
//! Loading trusts nothing: every count is checked against the
//! configuration before the bytes it announces are read, and buffers grow
//! only as bytes arrive, so a header claiming more tokens than the stream
//! holds fails with an error after reading what is there, without
//! allocating for the claim.

use super::*;
use crate::quant::codebook::FITTED_ID;
use crate::quant::{FittedLevels, Levels, Rotation};
use crate::store::{check_fits, validate_params, SchemeBytes};
use std::io::{Read, Write};

const MAGIC: &[u8; 4] = b"KVQC";
const VERSION: u8 = 1;
/// Kind byte of the stream header: one layer, or a whole model.
const KIND_LAYER: u8 = 0;
const KIND_MODEL: u8 = 1;
/// Bytes read into a buffer at a time: it never grows past what arrived
/// by more than this.
const READ_STEP: usize = 1 << 20;
/// What loading a model may allocate before the rows that back it arrive:
/// per byte read so far, plus a fixed allowance (a layer's configuration
/// allocates per head and per channel; a hostile stream of empty layers
/// must not turn a few bytes into gigabytes).
const ALLOC_PER_BYTE: usize = 64;
const ALLOC_ALLOWANCE: usize = 64 << 20;

/// The stream header (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct StreamHeader {
    magic: [u8; 4],
    version: u8,
    kind: u8,
    reserved0: [u8; 2],
    n_layers: u32,
    reserved1: u32,
}

/// A codec as saved (16 bytes): `present` 0 for full precision, 1 for
/// the uniform grid, `2 + id` for a codebook ([`Levels`]: 0 `iq4_nl`, 1 NF4,
/// 2 Lloyd-Max, 3 fp8 `e4m3`, 4 fp8 `e5m2`, 5 fitted, whose `2^bits`
/// levels follow the layer's headers as little-endian `f32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct CodecTag {
    present: u8,
    bits: u8,
    axis: u8,
    group_kind: u8,
    mode: u8,
    scale_format: u8,
    rounding: u8,
    /// `0` none, `1` Hadamard.
    rotation: u8,
    group_size: u32,
    /// Bit 0: the int8 kernels read it; bits 16–31: the share of values
    /// kept as outliers, in 1/10 000 (0: none).
    flags: u32,
}

/// One layer's configuration and length (72 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct LayerHeader {
    n_kv_heads: u32,
    head_dim: u32,
    /// `u64::MAX` stands for `usize::MAX` (keep every token exact).
    sinks: u64,
    residual: u64,
    len: u64,
    /// The bits of the `f32` scale; meaningful when flag bit 0 is set.
    softmax_scale: u32,
    /// Bit 0: a softmax scale is set; bit 1: int8 kernels for the cache.
    flags: u32,
    keys: CodecTag,
    values: CodecTag,
}

/// The RoPE of a pre-RoPE cache (48 bytes), after its [`LayerHeader`]
/// when flag bit 2 is set.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct RopeHeader {
    /// The bits of the `f64` base.
    base: u64,
    dims: u32,
    /// `0` halves (NeoX), `1` adjacent pairs.
    style: u8,
    /// `0` none, `1` linear, `2` Llama 3.
    scaling: u8,
    reserved: u16,
    /// Scaling parameters as `f64` bits (zero where unused): the factor,
    /// Llama 3's low and high frequency factors.
    factor: u64,
    low: u64,
    high: u64,
    original_max_position: u32,
    reserved1: u32,
}

/// The row counts of one of K or V (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct TensorHeader {
    sink_rows: u64,
    packed: u64,
    tail_rows: u64,
}

const _: () = {
    use std::mem::size_of;
    assert!(size_of::<StreamHeader>() == 16);
    assert!(size_of::<CodecTag>() == 16);
    assert!(size_of::<LayerHeader>() == 72);
    assert!(size_of::<TensorHeader>() == 24);
    assert!(size_of::<RopeHeader>() == 48);
};

/// The checksum of a saved stream: 64-bit FNV-1a over every byte before
/// it, taken as little-endian 64-bit words (the last one zero-padded),
/// then over the byte count.
struct Checksum {
    h: u64,
    carry: [u8; 8],
    n_carry: usize,
    total: u64,
}

impl Checksum {
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Self {
        Checksum {
            h: 0xcbf2_9ce4_8422_2325,
            carry: [0; 8],
            n_carry: 0,
            total: 0,
        }
    }

    fn word(&mut self, w: u64) {
        self.h = (self.h ^ w).wrapping_mul(Self::PRIME);
    }

    fn section(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        if self.n_carry > 0 {
            let k = (8 - self.n_carry).min(bytes.len());
            self.carry[self.n_carry..self.n_carry + k].copy_from_slice(&bytes[..k]);
            self.n_carry += k;
            bytes = &bytes[k..];
            if self.n_carry < 8 {
                return;
            }
            self.word(u64::from_le_bytes(self.carry));
            self.n_carry = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.word(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        self.carry[..rest.len()].copy_from_slice(rest);
        self.n_carry = rest.len();
    }

    fn value(&self) -> u64 {
        let mut c = Checksum { ..*self };
        if c.n_carry > 0 {
            c.carry[c.n_carry..].fill(0);
            c.word(u64::from_le_bytes(c.carry));
        }
        c.word(c.total);
        c.h
    }
}

/// A writer that hashes every section it writes.
struct Out<W> {
    w: W,
    sum: Checksum,
    op: &'static str,
}

impl<W: Write> Out<W> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.sum.section(bytes);
        self.w.write_all(bytes).map_err(|e| io_error(self.op, &e))
    }

    fn put_f32(&mut self, x: &[f32]) -> Result<()> {
        self.put(&f32_bytes(x))
    }
}

/// A reader that hashes every section it reads.
struct In<R> {
    r: R,
    sum: Checksum,
    op: &'static str,
}

impl<R: Read> In<R> {
    /// `n` bytes, read in steps of at most [`READ_STEP`].
    fn take(&mut self, n: usize, what: &str) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        while v.len() < n {
            let a = v.len();
            v.resize(a + (n - a).min(READ_STEP), 0);
            self.r.read_exact(&mut v[a..]).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    Error::Malformed {
                        op: self.op,
                        what: format!("the stream ends inside {what} ({n} bytes announced)"),
                    }
                } else {
                    io_error(self.op, &e)
                }
            })?;
        }
        self.sum.section(&v);
        Ok(v)
    }

    fn pod<T: bytemuck::Pod>(&mut self, what: &str) -> Result<T> {
        let b = self.take(std::mem::size_of::<T>(), what)?;
        Ok(bytemuck::pod_read_unaligned(&b))
    }

    fn take_f32(&mut self, n: usize, what: &str) -> Result<Vec<f32>> {
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| self.bad(format!("{n} floats of {what}")))?;
        let b = self.take(bytes, what)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    fn bad(&self, what: String) -> Error {
        Error::Malformed { op: self.op, what }
    }

    /// Read the checksum and compare it with the bytes read so far.
    fn finish(mut self) -> Result<()> {
        let want = self.sum.value();
        let b = self.take(8, "the checksum")?;
        let got = u64::from_le_bytes(b.try_into().expect("8 bytes"));
        if got != want {
            return Err(self.bad(format!(
                "checksum {got:#018x} does not match the content ({want:#018x})"
            )));
        }
        Ok(())
    }
}

fn io_error(op: &'static str, e: &std::io::Error) -> Error {
    Error::Io {
        op,
        kind: e.kind(),
        what: e.to_string(),
    }
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn usize_u64(x: usize) -> u64 {
    if x == usize::MAX {
        u64::MAX
    } else {
        x as u64
    }
}

fn u64_usize(x: u64) -> Option<usize> {
    if x == u64::MAX {
        Some(usize::MAX)
    } else {
        usize::try_from(x).ok()
    }
}

fn codec_tag(c: Option<Codec>) -> CodecTag {
    let Some(c) = c else {
        return bytemuck::Zeroable::zeroed();
    };
    let b = SchemeBytes::new(&c.scheme());
    CodecTag {
        present: c.levels().map_or(1, |l| 2 + l.id()),
        bits: b.bits,
        axis: b.axis,
        group_kind: b.group_kind,
        mode: b.mode,
        scale_format: b.scale_format,
        rounding: b.rounding,
        rotation: match c.rotation() {
            Rotation::None => 0,
            Rotation::Hadamard => 1,
        },
        group_size: b.group_size.to_le(),
        flags: (u32::from(c.int8_kernels()) | u32::from(c.outlier_share()) << 16).to_le(),
    }
}

fn rope_header(r: &Rope) -> RopeHeader {
    let f = |x: f64| x.to_bits().to_le();
    let (scaling, factor, low, high, original_max_position) = match r.scaling() {
        RopeScaling::None => (0, 0, 0, 0, 0),
        RopeScaling::Linear { factor } => (1, f(factor), 0, 0, 0),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => (
            2,
            f(factor),
            f(low_freq_factor),
            f(high_freq_factor),
            original_max_position.to_le(),
        ),
    };
    RopeHeader {
        base: r.base().to_bits().to_le(),
        dims: (r.dims() as u32).to_le(),
        style: match r.style() {
            RopeStyle::Halves => 0,
            RopeStyle::Adjacent => 1,
        },
        scaling,
        reserved: 0,
        factor,
        low,
        high,
        original_max_position,
        reserved1: 0,
    }
}

fn header_rope(h: &RopeHeader) -> std::result::Result<Rope, String> {
    let style = match h.style {
        0 => RopeStyle::Halves,
        1 => RopeStyle::Adjacent,
        x => return Err(format!("RoPE style byte {x}")),
    };
    let f = |x: u64| f64::from_bits(u64::from_le(x));
    let (factor, low, high, n) = (
        f(h.factor),
        f(h.low),
        f(h.high),
        u32::from_le(h.original_max_position),
    );
    let unused = |bits: &[u64]| bits.iter().all(|&b| b == 0);
    let scaling = match h.scaling {
        0 if unused(&[h.factor, h.low, h.high, n.into()]) => RopeScaling::None,
        1 if unused(&[h.low, h.high, n.into()]) => RopeScaling::Linear { factor },
        2 => RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position: n,
        },
        x => return Err(format!("RoPE scaling byte {x} or its parameters")),
    };
    if h.reserved != 0 || h.reserved1 != 0 {
        return Err("RoPE reserved bytes are not zero".into());
    }
    let dims = u32::from_le(h.dims) as usize;
    Ok(Rope::new(f64::from_bits(u64::from_le(h.base)), dims, style).with_scaling(scaling))
}

/// The codec of a tag (`fitted`: the levels [`read_fitted`] read for it).
fn tag_codec(
    t: &CodecTag,
    fitted: Option<FittedLevels>,
    what: &str,
) -> std::result::Result<Option<Codec>, String> {
    let levels = match t.present {
        0 if bytemuck::bytes_of(t).iter().all(|&b| b == 0) => return Ok(None),
        0 => return Err(format!("{what}: a full-precision tag with non-zero bytes")),
        1 => None,
        x if x == 2 + FITTED_ID => match fitted {
            Some(f) => Some(Levels::Fitted(f)),
            None => return Err(format!("{what}: a fitted codebook without its levels")),
        },
        x => match x.checked_sub(2).and_then(Levels::from_id) {
            Some(l) => Some(l),
            None => return Err(format!("{what}: codec byte {x}")),
        },
    };
    let scheme = SchemeBytes {
        bits: t.bits,
        axis: t.axis,
        group_kind: t.group_kind,
        mode: t.mode,
        scale_format: t.scale_format,
        rounding: t.rounding,
        group_size: u32::from_le(t.group_size),
    }
    .scheme()
    .map_err(|e| format!("{what}: {e}"))?;
    let rotation = match t.rotation {
        0 => Rotation::None,
        1 => Rotation::Hadamard,
        x => return Err(format!("{what}: rotation byte {x}")),
    };
    let flags = u32::from_le(t.flags);
    let share = flags >> 16;
    if flags & 0xfffe != 0 || share > crate::quant::outliers::PER / 2 {
        return Err(format!("{what}: codec flags {flags:#x}"));
    }
    let codec = match levels {
        None => Codec::uniform(scheme),
        Some(l) => Codec::codebook(scheme, l),
    };
    Ok(Some(
        codec
            .with_rotation(rotation)
            .with_int8_kernels(flags & 1 == 1)
            .with_outlier_share(share as u16),
    ))
}

impl Tensor {
    fn save<W: Write>(&self, o: &mut Out<W>) -> Result<()> {
        let h = TensorHeader {
            sink_rows: ((self.sink.len() / self.width) as u64).to_le(),
            packed: (self.packed as u64).to_le(),
            tail_rows: (self.tail_rows() as u64).to_le(),
        };
        o.put(bytemuck::bytes_of(&h))?;
        o.put_f32(&self.sink)?;
        // Codes per head, params, then outlier entries per head (none
        // without outliers).
        for (kind, n) in [self.n_codes, self.n_params, self.n_codes]
            .into_iter()
            .enumerate()
        {
            for i in 0..n {
                o.put(&self.buf(kind, i))?;
            }
        }
        o.put_f32(self.tail_slice())
    }

    /// Read what [`save`](Self::save) wrote into this empty tensor of a
    /// cache of `len` tokens, checking every count before reading what it
    /// announces and the content after.
    fn load<R: Read>(
        &mut self,
        i: &mut In<R>,
        len: usize,
        hd: usize,
        what: &'static str,
    ) -> Result<()> {
        let op = i.op;
        let bad = move |what: String| Error::Malformed { op, what };
        let h: TensorHeader = i.pod(what)?;
        let n = |x: u64| usize::try_from(u64::from_le(x)).unwrap_or(usize::MAX);
        let (sink_rows, packed, tail_rows) = (n(h.sink_rows), n(h.packed), n(h.tail_rows));
        let w = self.width;
        let unit = self.unit_or_1();
        let ok_sum = sink_rows
            .checked_add(packed)
            .and_then(|x| x.checked_add(tail_rows))
            == Some(len);
        let counts_ok = ok_sum
            && sink_rows == len.min(self.sinks)
            && packed.is_multiple_of(unit)
            && (self.codec.is_some() || packed == 0)
            && (self.codec.is_none() || tail_rows < self.residual.saturating_add(unit));
        if !counts_ok {
            return Err(bad(format!(
                "{what}: {sink_rows} sink, {packed} packed and {tail_rows} full-precision rows \
                 do not make {len} tokens of this configuration"
            )));
        }
        if let Some(l) = self.layout() {
            check_fits(op, &l, packed).map_err(|e| bad(e.to_string()))?;
        }
        let rows = |r: usize| {
            r.checked_mul(w)
                .ok_or_else(|| bad(format!("{what}: {r} rows")))
        };
        let sink_len = rows(sink_rows)?;
        self.sink = i.take_f32(sink_len, "sink rows")?;
        let n_kv = w / hd;
        let content = |e: Error| bad(format!("{what}: {e}"));
        check_finite(op, &self.sink, n_kv, hd, 0).map_err(content)?;
        if let Some(l) = self.layout() {
            let np = self.n_params;
            let codes = (0..self.n_codes)
                .map(|_| i.take(l.head_code_bytes(packed), "codes"))
                .collect::<Result<Vec<_>>>()?;
            let mut params = Vec::with_capacity(np);
            for _ in 0..np {
                let p = i.take(l.param_bytes(packed) / np, "params")?;
                validate_params(op, &l, &p)?;
                params.push(p);
            }
            let outliers = if l.outliers() > 0 {
                (0..self.n_codes)
                    .map(|_| {
                        let o = i.take(l.head_outlier_bytes(packed), "outliers")?;
                        crate::quant::outliers::validate(op, &l, &o)?;
                        Ok(o)
                    })
                    .collect::<Result<Vec<_>>>()?
            } else {
                Vec::new()
            };
            let pages = packed.div_ceil(self.page);
            let need = pages.saturating_mul(self.page_bytes());
            let mut ticket = reserve(op, self.pool.as_ref(), need)?;
            self.set_packed([&codes, &params, &outliers], packed, &mut ticket);
        }
        let tail_len = rows(tail_rows)?;
        let tail = i.take_f32(tail_len, "full-precision rows")?;
        check_finite(op, &tail, n_kv, hd, sink_rows + packed).map_err(content)?;
        let pend = self.tail_pending(op, &tail, packed).map_err(content)?;
        if !self.pend.min.is_empty() {
            self.pend = pend;
        }
        self.tail = tail;
        self.tail_start = 0;
        Ok(())
    }
}

impl LayerCache {
    /// Bytes an empty cache of this configuration allocates: the
    /// per-channel running ranges.
    fn config_alloc(&self) -> usize {
        let per_tensor = |t: &Tensor| (t.pend.min.len() + t.pend.max.len()) * 4;
        per_tensor(&self.k) + per_tensor(&self.v)
    }

    /// Bytes [`save`](Self::save) writes: [`bytes`](Self::bytes) plus the
    /// headers and the checksum (144 bytes; 192 with pre-RoPE keys).
    pub fn saved_bytes(&self) -> usize {
        16 + self.layer_saved_bytes() + 8
    }

    fn layer_saved_bytes(&self) -> usize {
        72 + if self.cfg.rope.is_some() { 48 } else { 0 } + 2 * 24 + self.bytes().total()
    }

    /// Write the cache to `w`: configuration, every stored byte, and a
    /// checksum ([`saved_bytes`](Self::saved_bytes) bytes; the layout is
    /// `docs/FORMAT.md`, section 7). The backend and thread count are not
    /// saved: they belong to the machine that loads it.
    ///
    /// # Errors
    /// [`Error::Io`] when `w` fails.
    ///
    /// # Example
    /// ```
    /// use kvq::{presets, CacheConfig, LayerCache};
    /// let (keys, values) = presets::kivi(4)?;
    /// let mut cache = LayerCache::new(CacheConfig::new(2, 64).keys(keys).values(values))?;
    /// for t in 0..50 {
    ///     let row: Vec<f32> = (0..128).map(|c| ((t * 7 + c) % 9) as f32).collect();
    ///     cache.append(&row, &row)?;
    /// }
    /// let mut bytes = Vec::new();
    /// cache.save(&mut bytes)?;
    /// assert_eq!(bytes.len(), cache.saved_bytes());
    /// let back = LayerCache::load(&bytes[..])?;
    /// assert!(back == cache);
    /// // A flipped byte is caught.
    /// bytes[200] ^= 1;
    /// assert!(LayerCache::load(&bytes[..]).is_err());
    /// # Ok::<(), kvq::Error>(())
    /// ```
    pub fn save(&self, w: impl Write) -> Result<()> {
        let mut o = Out {
            w,
            sum: Checksum::new(),
            op: "LayerCache::save",
        };
        o.put(bytemuck::bytes_of(&stream_header(KIND_LAYER, 1)))?;
        self.save_layer(&mut o)?;
        let s = o.sum.value().to_le_bytes();
        o.w.write_all(&s).map_err(|e| io_error(o.op, &e))?;
        o.w.flush().map_err(|e| io_error(o.op, &e))
    }

    fn save_layer<W: Write>(&self, o: &mut Out<W>) -> Result<()> {
        let c = &self.cfg;
        let h = LayerHeader {
            n_kv_heads: (c.n_kv_heads as u32).to_le(),
            head_dim: (c.head_dim as u32).to_le(),
            sinks: usize_u64(c.sinks).to_le(),
            residual: usize_u64(c.residual).to_le(),
            len: (self.len as u64).to_le(),
            softmax_scale: c.softmax_scale.map_or(0, f32::to_bits).to_le(),
            flags: (u32::from(c.softmax_scale.is_some())
                | (u32::from(c.int8) << 1)
                | (u32::from(c.rope.is_some()) << 2))
                .to_le(),
            keys: codec_tag(c.keys),
            values: codec_tag(c.values),
        };
        o.put(bytemuck::bytes_of(&h))?;
        if let Some(r) = &c.rope {
            o.put(bytemuck::bytes_of(&rope_header(r)))?;
        }
        for c in [c.keys, c.values].into_iter().flatten() {
            if let Some(f) = c.levels().as_ref().and_then(Levels::fitted) {
                o.put_f32(f.levels())?;
            }
        }
        self.k.save(o)?;
        self.v.save(o)
    }

    /// Read a cache written by [`save`](Self::save), on the detected
    /// backend with all available threads.
    ///
    /// # Errors
    /// [`Error::Malformed`] for anything that is not a cache `save` wrote:
    /// a wrong magic, version or kind, a configuration [`LayerCache::new`]
    /// rejects, row counts that do not fit the configuration, a stream that
    /// ends early, non-finite rows or params, or a checksum that does not
    /// match. [`Error::Io`] when `r` fails.
    pub fn load(r: impl Read) -> Result<Self> {
        Self::load_on(r, None, 0)
    }

    /// [`load`](Self::load) on `backend` (`None`: detected) with `threads`
    /// threads (0: all available).
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn load_on(r: impl Read, backend: Option<Backend>, threads: usize) -> Result<Self> {
        let mut i = In {
            r,
            sum: Checksum::new(),
            op: "LayerCache::load",
        };
        read_stream_header(&mut i, KIND_LAYER)?;
        let l = Self::load_layer(&mut i, backend, threads, None)?;
        i.finish()?;
        Ok(l)
    }

    /// [`load`](Self::load) into pages of `pool` (a sequence restored into
    /// a serving engine's pool), on the detected backend with all
    /// available threads.
    ///
    /// # Errors
    /// As [`load`](Self::load); [`Error::PoolExhausted`] when the pool has
    /// no room for the cache's pages (nothing is taken from it then).
    pub fn load_in(r: impl Read, pool: &PagePool) -> Result<Self> {
        let mut i = In {
            r,
            sum: Checksum::new(),
            op: "LayerCache::load_in",
        };
        read_stream_header(&mut i, KIND_LAYER)?;
        let l = Self::load_layer(&mut i, None, 0, Some(pool))?;
        i.finish()?;
        Ok(l)
    }

    fn load_layer<R: Read>(
        i: &mut In<R>,
        backend: Option<Backend>,
        threads: usize,
        pool: Option<&PagePool>,
    ) -> Result<Self> {
        let h: LayerHeader = i.pod("a layer header")?;
        let rope = if u32::from_le(h.flags) & 4 != 0 {
            let r: RopeHeader = i.pod("a RoPE header")?;
            Some(header_rope(&r).map_err(|e| i.bad(e))?)
        } else {
            None
        };
        let k_levels = read_fitted(i, &h.keys, "keys")?;
        let v_levels = read_fitted(i, &h.values, "values")?;
        let mut cfg = layer_config(&h, k_levels, v_levels).map_err(|e| i.bad(e))?;
        if let Some(r) = rope {
            cfg = cfg.pre_rope(r);
        }
        let cfg = match backend {
            Some(b) => cfg.backend(b),
            None => cfg,
        }
        .threads(threads);
        let mut c = LayerCache::build(cfg, pool.map(PagePool::handle))
            .map_err(|e| i.bad(format!("configuration: {e}")))?;
        let len = u64::from_le(h.len);
        let len = u32::try_from(len)
            .map_err(|_| i.bad(format!("{len} tokens: a cache holds at most 2^32 − 1")))?
            as usize;
        let hd = c.cfg.head_dim;
        c.k.load(i, len, hd, "keys")?;
        c.v.load(i, len, hd, "values")?;
        c.len = len;
        if let Some(r) = &mut c.rope {
            r.ensure(len);
        }
        Ok(c)
    }
}

fn stream_header(kind: u8, n_layers: u32) -> StreamHeader {
    StreamHeader {
        magic: *MAGIC,
        version: VERSION,
        kind,
        reserved0: [0; 2],
        n_layers: n_layers.to_le(),
        reserved1: 0,
    }
}

/// Check the stream header; returns the layer count.
fn read_stream_header<R: Read>(i: &mut In<R>, kind: u8) -> Result<u32> {
    let h: StreamHeader = i.pod("the stream header")?;
    if h.magic != *MAGIC {
        return Err(i.bad("magic is not \"KVQC\"".into()));
    }
    if h.version != VERSION {
        return Err(i.bad(format!("unsupported version {}", h.version)));
    }
    if h.kind != kind {
        let name = |k: u8| match k {
            KIND_LAYER => "one layer".to_string(),
            KIND_MODEL => "a model".to_string(),
            x => format!("kind {x}"),
        };
        return Err(i.bad(format!(
            "the stream holds {}, not {}",
            name(h.kind),
            name(kind)
        )));
    }
    if h.reserved0 != [0; 2] || h.reserved1 != 0 {
        return Err(i.bad("reserved header bytes are not zero".into()));
    }
    let n = u32::from_le(h.n_layers);
    if n == 0 || (kind == KIND_LAYER && n != 1) {
        return Err(i.bad(format!("{n} layers")));
    }
    Ok(n)
}

/// The levels of a fitted codec's tag, read from the stream (`None` for
/// any other tag; a width outside 2–4 bits is refused before reading).
fn read_fitted<R: Read>(i: &mut In<R>, t: &CodecTag, what: &str) -> Result<Option<FittedLevels>> {
    if t.present != 2 + FITTED_ID {
        return Ok(None);
    }
    if !(2..=4).contains(&t.bits) {
        return Err(i.bad(format!(
            "{what}: a fitted codebook of {} bits (2–4)",
            t.bits
        )));
    }
    let levels = i.take_f32(1 << t.bits, "fitted levels")?;
    FittedLevels::new(&levels)
        .map(Some)
        .map_err(|e| i.bad(format!("{what}: {e}")))
}

fn layer_config(
    h: &LayerHeader,
    k_levels: Option<FittedLevels>,
    v_levels: Option<FittedLevels>,
) -> std::result::Result<CacheConfig, String> {
    let (n_kv, hd) = (
        u32::from_le(h.n_kv_heads) as usize,
        u32::from_le(h.head_dim) as usize,
    );
    let flags = u32::from_le(h.flags);
    if flags > 7 {
        return Err(format!("layer flags {flags:#x}"));
    }
    let sinks = u64_usize(u64::from_le(h.sinks)).ok_or("sinks do not fit this machine")?;
    let residual = u64_usize(u64::from_le(h.residual)).ok_or("residual does not fit")?;
    let mut cfg = CacheConfig::new(n_kv, hd)
        .key_codec(tag_codec(&h.keys, k_levels, "keys")?)
        .value_codec(tag_codec(&h.values, v_levels, "values")?)
        .sinks(sinks)
        .residual(residual)
        .int8_kernels(flags & 2 != 0);
    if flags & 1 != 0 {
        cfg = cfg.softmax_scale(f32::from_bits(u32::from_le(h.softmax_scale)));
    } else if h.softmax_scale != 0 {
        return Err("a softmax scale without its flag".into());
    }
    Ok(cfg)
}

impl KvCache {
    /// Bytes [`save`](Self::save) writes.
    pub fn saved_bytes(&self) -> usize {
        16 + self
            .layers
            .iter()
            .map(LayerCache::layer_saved_bytes)
            .sum::<usize>()
            + 8
    }

    /// Write every layer to `w` (as [`LayerCache::save`], under one header
    /// and one checksum).
    ///
    /// # Errors
    /// [`Error::Io`] when `w` fails.
    pub fn save(&self, w: impl Write) -> Result<()> {
        let mut o = Out {
            w,
            sum: Checksum::new(),
            op: "KvCache::save",
        };
        let n = u32::try_from(self.layers.len()).map_err(|_| Error::InvalidShape {
            op: o.op,
            what: format!(
                "{} layers: a saved cache holds at most 2^32 − 1",
                self.layers.len()
            ),
        })?;
        o.put(bytemuck::bytes_of(&stream_header(KIND_MODEL, n)))?;
        for l in &self.layers {
            l.save_layer(&mut o)?;
        }
        let s = o.sum.value().to_le_bytes();
        o.w.write_all(&s).map_err(|e| io_error(o.op, &e))?;
        o.w.flush().map_err(|e| io_error(o.op, &e))
    }

    /// Read a cache written by [`KvCache::save`], on the detected backend
    /// with all available threads.
    ///
    /// # Errors
    /// As [`LayerCache::load`].
    pub fn load(r: impl Read) -> Result<Self> {
        Self::load_on(r, None, 0)
    }

    /// [`load`](Self::load) on `backend` (`None`: detected) with `threads`
    /// threads per layer (0: all available).
    ///
    /// # Errors
    /// As [`LayerCache::load`].
    pub fn load_on(r: impl Read, backend: Option<Backend>, threads: usize) -> Result<Self> {
        Self::load_with(r, backend, threads, None, "KvCache::load")
    }

    /// [`load`](Self::load) with every layer's pages from `pool`, on the
    /// detected backend with all available threads.
    ///
    /// # Errors
    /// As [`load`](Self::load); [`Error::PoolExhausted`] when the pool has
    /// no room for the layers' pages (what the loaded layers took is
    /// given back).
    pub fn load_in(r: impl Read, pool: &PagePool) -> Result<Self> {
        Self::load_with(r, None, 0, Some(pool), "KvCache::load_in")
    }

    fn load_with(
        r: impl Read,
        backend: Option<Backend>,
        threads: usize,
        pool: Option<&PagePool>,
        op: &'static str,
    ) -> Result<Self> {
        let mut i = In {
            r,
            sum: Checksum::new(),
            op,
        };
        let n = read_stream_header(&mut i, KIND_MODEL)?;
        // Grown layer by layer: the count is not trusted for an allocation,
        // and neither is what the layers' configurations allocate.
        let mut layers = Vec::new();
        let mut claimed = 0usize;
        for _ in 0..n {
            let l = LayerCache::load_layer(&mut i, backend, threads, pool)?;
            claimed += l.config_alloc();
            let backed = ALLOC_PER_BYTE
                .saturating_mul(i.sum.total as usize)
                .saturating_add(ALLOC_ALLOWANCE);
            if claimed > backed {
                return Err(i.bad(format!(
                    "{} layers whose configurations allocate {claimed} bytes, from {} bytes of stream",
                    layers.len() + 1,
                    i.sum.total
                )));
            }
            layers.push(l);
        }
        i.finish()?;
        Ok(KvCache { layers })
    }
}
