//! Helpers.

use super::*;

pub(crate) const FORMATS: [ScaleFormat; 3] =
    [ScaleFormat::F16, ScaleFormat::Bf16, ScaleFormat::F32];
pub(crate) const GROUPS: [Group; 6] = [
    Group::Size(8),
    Group::Size(16),
    Group::Size(32),
    Group::Size(64),
    Group::Head,
    Group::Vector,
];
/// The smallest positive subnormal f32, 2^-149.
pub(crate) const TINY: f64 = 1.401298464324817e-45;
pub(crate) const EPS: f64 = f32::EPSILON as f64;

/// Every valid scheme of `bits`, and a check that exactly the documented
/// combinations are rejected.
pub(crate) fn schemes_of(bits: u8) -> Vec<QuantScheme> {
    let mut out = Vec::new();
    for axis in [Axis::PerToken, Axis::PerChannel] {
        for group in GROUPS {
            let s = QuantScheme::new(bits, axis, group);
            let want_err = axis == Axis::PerChannel && matches!(group, Group::Head | Group::Vector);
            assert_eq!(s.is_err(), want_err, "{bits} {axis:?} {group:?}: {s:?}");
            let Ok(s) = s else { continue };
            for mode in [Mode::Asymmetric, Mode::Symmetric] {
                let m = s.with_mode(mode);
                assert_eq!(m.is_err(), mode == Mode::Symmetric && bits == 1);
                let Ok(m) = m else { continue };
                for fmt in FORMATS {
                    out.push(m.with_scale_format(fmt));
                }
            }
        }
    }
    out
}

pub(crate) fn all_schemes() -> Vec<QuantScheme> {
    (1..=8).flat_map(schemes_of).collect()
}

pub(crate) fn scheme(
    bits: u8,
    axis: Axis,
    group: Group,
    mode: Mode,
    fmt: ScaleFormat,
) -> QuantScheme {
    QuantScheme::new(bits, axis, group)
        .unwrap()
        .with_mode(mode)
        .unwrap()
        .with_scale_format(fmt)
}

/// Kinds of input, including the awkward ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    /// Normal values, a random magnitude per token.
    Random,
    /// `1000 + small`: the zero dwarfs the range.
    Offset,
    /// Every token constant (all heads and channels).
    ConstantRows,
    /// Every (head, channel) constant over tokens.
    ConstantChannels,
    /// Channel 3 of every head 1000x larger than the rest.
    OutlierChannel,
    /// ~1e30.
    Huge,
    /// ~1e-30.
    Tiny,
    /// ~1e-40 (subnormal f32).
    Subnormal,
    /// Magnitudes 1e-8..1e3 in one group, exact zeros and repeats.
    Wild,
}

pub(crate) const KINDS: [Kind; 9] = [
    Kind::Random,
    Kind::Offset,
    Kind::ConstantRows,
    Kind::ConstantChannels,
    Kind::OutlierChannel,
    Kind::Huge,
    Kind::Tiny,
    Kind::Subnormal,
    Kind::Wild,
];

/// `[tokens, nh, hd]` row-major.
pub(crate) fn gen(kind: Kind, tokens: usize, nh: usize, hd: usize, rng: &mut Rng) -> Vec<f32> {
    let w = nh * hd;
    let mut x = vec![0f32; tokens * w];
    let chan: Vec<f32> = (0..w).map(|_| rng.normal()).collect();
    for t in 0..tokens {
        let mag = rng.normal().exp();
        let row_v = rng.normal() * 4.0;
        for i in 0..w {
            let c = i % hd;
            x[t * w + i] = match kind {
                Kind::Random => rng.normal() * mag,
                Kind::Offset => 1000.0 + rng.normal() * 0.01,
                Kind::ConstantRows => row_v,
                Kind::ConstantChannels => chan[i],
                Kind::OutlierChannel => rng.normal() * if c == 3 { 1000.0 } else { 1.0 },
                Kind::Huge => rng.normal() * 1e30,
                Kind::Tiny => rng.normal() * 1e-30,
                Kind::Subnormal => rng.normal() * 1e-40,
                Kind::Wild => match rng.below(8) {
                    0 => 0.0,
                    1 => 1.5,
                    _ => rng.normal() * 10f32.powf(rng.range(-8.0, 3.0)),
                },
            };
        }
    }
    x
}

pub(crate) fn read_fmt(fmt: ScaleFormat, b: &[u8]) -> f32 {
    match fmt {
        ScaleFormat::F16 => f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        ScaleFormat::Bf16 => bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        ScaleFormat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// Groups in one param set, from the scheme alone (not from `Layout`).
pub(crate) fn set_len(l: &Layout) -> usize {
    let s = l.scheme();
    match (s.axis(), s.group()) {
        (Axis::PerToken, Group::Size(n)) => l.head_dim() / n,
        (Axis::PerToken, _) => 1,
        (Axis::PerChannel, _) => l.head_dim(),
    }
}

/// `(scale, zero)` of element `(t, c)` of a head, decoded from its param
/// bytes as `docs/FORMAT.md` describes them.
pub(crate) fn stored_param(head: &PackedHead<'_>, t: usize, c: usize) -> (f32, f32) {
    let l = head.layout();
    let s = l.scheme();
    let fmt = s.scale_format();
    let fb = fmt.bytes();
    let n = set_len(l);
    let (set, g) = match (s.axis(), s.group()) {
        (Axis::PerToken, Group::Size(gs)) => (t, c / gs),
        (Axis::PerToken, _) => (t, 0),
        (Axis::PerChannel, Group::Size(gs)) => (t / gs, c),
        _ => unreachable!(),
    };
    let per_set = n * fb * if s.mode() == Mode::Asymmetric { 2 } else { 1 };
    let p = &head.params()[set * per_set..(set + 1) * per_set];
    let scale = read_fmt(fmt, &p[g * fb..]);
    let zero = match s.mode() {
        Mode::Asymmetric => read_fmt(fmt, &p[(n + g) * fb..]),
        Mode::Symmetric => -scale * (1u32 << (s.bits() - 1)) as f32,
    };
    (scale, zero)
}

/// Power-of-two plane widths of a code width, widest first (the table in
/// `kvq::pack`).
pub(crate) fn plane_widths(bits: u8) -> Vec<usize> {
    if bits == 8 {
        return vec![8];
    }
    [4usize, 2, 1]
        .into_iter()
        .filter(|&p| bits as usize & p != 0)
        .collect()
}

/// An independent packer written from the normative rule: in a plane of
/// width `p` with `m = n·p/8` bytes, element `i` is field `i div m` of byte
/// `i mod m`.
pub(crate) fn ref_pack(codes: &[u8], bits: u8) -> Vec<u8> {
    let n = codes.len();
    let mut out = Vec::new();
    let mut shift = 0;
    for p in plane_widths(bits) {
        let m = n * p / 8;
        let mask = ((1u16 << p) - 1) as u8;
        let mut plane = vec![0u8; m];
        for (i, &code) in codes.iter().enumerate() {
            plane[i % m] |= ((code >> shift) & mask) << (p * (i / m));
        }
        out.extend(plane);
        shift += p;
    }
    out
}

pub(crate) fn ref_unpack(packed: &[u8], bits: u8, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    let (mut shift, mut off) = (0, 0);
    for p in plane_widths(bits) {
        let m = n * p / 8;
        let mask = ((1u16 << p) - 1) as u8;
        for (i, o) in out.iter_mut().enumerate() {
            *o |= ((packed[off + i % m] >> (p * (i / m))) & mask) << shift;
        }
        off += m;
        shift += p;
    }
    out
}

/// The code of element `(t, c)` of a head.
pub(crate) fn stored_codes(head: &PackedHead<'_>, t: usize) -> Vec<u8> {
    let l = head.layout();
    let rb = l.head_dim() * l.scheme().bits() as usize / 8;
    ref_unpack(
        &head.codes()[t * rb..(t + 1) * rb],
        l.scheme().bits(),
        l.head_dim(),
    )
}

/// The index of an element's group in `[tokens, nh, hd]` input (dense,
/// below `tokens·nh·hd`).
pub(crate) fn group_index(l: &Layout, t: usize, h: usize, c: usize) -> usize {
    let (nh, hd) = (l.n_kv_heads(), l.head_dim());
    match (l.scheme().axis(), l.scheme().group()) {
        (Axis::PerToken, Group::Size(n)) => (t * nh + h) * hd + c / n,
        (Axis::PerToken, Group::Head) => t * nh + h,
        (Axis::PerToken, Group::Vector) => t,
        (Axis::PerChannel, Group::Size(n)) => ((t / n) * nh + h) * hd + c,
        _ => unreachable!(),
    }
}

/// Allowed rounding beyond half a step: the f32 evaluation of the code and
/// of `scale·code + zero` (relative to the larger of |zero| and
/// |scale·code|), plus absolute rounding in the subnormal range.
pub(crate) fn slack(scale: f32, zero: f32, max_code: f32) -> f64 {
    4.0 * EPS * (zero.abs() as f64 + scale as f64 * max_code as f64) + 2.0 * TINY
}

/// Checks every documented property of a quantized block against the input
/// it came from:
/// 1. the stored `(scale, zero)` are the documented functions of the group's
///    min and max (zero rounded down, scale rounded up into the format);
/// 2. dequantization is exactly `scale·code + zero` with the stored numbers
///    and codes read from the documented byte layout;
/// 3. `|x − x̂| ≤ scale/2 + slack`.
///
/// Returns the largest error in steps (`|x − x̂| / scale`) on success.
pub(crate) fn check_block(x: &[f32], block: &PackedBlock) -> Result<f64, String> {
    let l = block.layout();
    let s = l.scheme();
    let fmt = s.scale_format();
    let (nh, hd, tokens) = (l.n_kv_heads(), l.head_dim(), block.tokens());
    if x.len() != tokens * nh * hd {
        return Err(format!(
            "input has {} values, block {tokens} tokens",
            x.len()
        ));
    }
    let bits = s.bits() as u32;
    let max_code = ((1u32 << bits) - 1) as f32;
    let mut range = vec![(f32::INFINITY, f32::NEG_INFINITY); x.len()];
    for t in 0..tokens {
        for h in 0..nh {
            for c in 0..hd {
                let v = x[(t * nh + h) * hd + c];
                let e = &mut range[group_index(l, t, h, c)];
                *e = (e.0.min(v), e.1.max(v));
            }
        }
    }
    // The documented (scale, zero) of every group.
    let documented: Vec<(f32, f32)> = range
        .iter()
        .map(|&(mn, mx)| {
            if mn > mx {
                return (f32::NAN, f32::NAN); // no element in this group index
            }
            match s.mode() {
                Mode::Asymmetric => {
                    let z = fmt.round_down(mn as f64);
                    (fmt.round_up((mx as f64 - z as f64) / max_code as f64), z)
                }
                Mode::Symmetric => {
                    let absmax = mn.abs().max(mx.abs()) as f64;
                    let sc = fmt.round_up(absmax / ((1u32 << (bits - 1)) - 1) as f64);
                    (sc, -sc * (1u32 << (bits - 1)) as f32)
                }
            }
        })
        .collect();
    let mut deq = vec![f32::NAN; x.len()];
    block.dequantize_into(&mut deq).map_err(|e| e.to_string())?;
    let mut worst = 0f64;
    for h in 0..nh {
        let head = block.head(h);
        for t in 0..tokens {
            let codes = stored_codes(&head, t);
            for (c, &code) in codes.iter().enumerate() {
                let i = (t * nh + h) * hd + c;
                let (scale, zero) = stored_param(&head, t, c);
                let gi = group_index(l, t, h, c);
                let ((mn, mx), (want_s, want_z)) = (range[gi], documented[gi]);
                let at = || format!("{} token {t} head {h} channel {c}", s.label());
                if scale != want_s || zero != want_z {
                    return Err(format!(
                        "{}: group [{mn}, {mx}] stored (scale {scale}, zero {zero}), \
                         documented ({want_s}, {want_z})",
                        at()
                    ));
                }
                if code as f32 > max_code {
                    return Err(format!("{}: code {code} > {max_code}", at()));
                }
                let xhat = scale * code as f32 + zero;
                if deq[i].to_bits() != xhat.to_bits() {
                    return Err(format!(
                        "{}: dequantized {} but scale·code + zero = {xhat}",
                        at(),
                        deq[i]
                    ));
                }
                let err = (x[i] as f64 - xhat as f64).abs();
                let bound = scale as f64 / 2.0 + slack(scale, zero, max_code);
                if err.is_nan() || err > bound {
                    return Err(format!(
                        "{}: x = {:e}, x̂ = {xhat:e} (code {code}, scale {scale:e}, zero {zero:e}): \
                         error {err:e} > bound {bound:e}",
                        at(),
                        x[i]
                    ));
                }
                // The code is the nearest grid point.
                for nb in [code as f32 - 1.0, code as f32 + 1.0] {
                    if (0.0..=max_code).contains(&nb) {
                        let e_nb = (x[i] as f64 - (scale * nb + zero) as f64).abs();
                        if err.is_nan() || err > e_nb + slack(scale, zero, max_code) {
                            return Err(format!(
                                "{}: x = {:e}: code {code} (error {err:e}) but code {nb} is nearer \
                                 ({e_nb:e})",
                                at(),
                                x[i]
                            ));
                        }
                    }
                }
                if scale > 0.0 {
                    worst = worst.max(err / scale as f64);
                }
            }
        }
    }
    Ok(worst)
}

/// Tokens to use with a scheme: per-channel gets a partial last block too.
pub(crate) fn quantize_ok(
    s: QuantScheme,
    nh: usize,
    hd: usize,
    x: &[f32],
    tokens: usize,
) -> PackedBlock {
    let q = UniformQuantizer::new(s, nh, hd).unwrap();
    q.quantize(x, tokens)
        .unwrap_or_else(|e| panic!("{}: {e}", s.label()))
}

pub(crate) fn msg(e: &Error) -> String {
    e.to_string()
}

#[track_caller]
pub(crate) fn assert_msg(e: &Error, parts: &[&str]) {
    let m = msg(e);
    for p in parts {
        assert!(m.contains(p), "message {m:?} lacks {p:?}");
    }
}
