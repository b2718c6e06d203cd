//! Integration tests of kvq's core: bit packing, the quantizer's error
//! budget, the fused kernels against the oracle (every backend), memory
//! accounting, errors, and the serialized format.
//!
//! Checks are written as functions that return `Err(String)` on the first
//! violation, so that a test can also feed them a deliberately broken block
//! or kernel and assert that they notice (see the `*_catches_*` tests).

use half::{bf16, f16};
use kvq::kernels::{self, reference};
use kvq::pack::{pack, packed_len, unpack};
use kvq::{
    Axis, Backend, Element, Error, Group, KvQuantizer, Layout, Mode, PackedBlock, PackedHead,
    QuantScheme, ScaleFormat, UniformQuantizer,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

const FORMATS: [ScaleFormat; 3] = [ScaleFormat::F16, ScaleFormat::Bf16, ScaleFormat::F32];
const GROUPS: [Group; 6] = [
    Group::Size(8),
    Group::Size(16),
    Group::Size(32),
    Group::Size(64),
    Group::Head,
    Group::Vector,
];
/// The smallest positive subnormal f32, 2^-149.
const TINY: f64 = 1.401298464324817e-45;
const EPS: f64 = f32::EPSILON as f64;

/// xorshift64*: deterministic data without depending on a rand version.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }
    /// Roughly standard normal (sum of 4 uniforms, rescaled).
    fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.unit()).sum();
        (s - 2.0) * 1.732
    }
}

/// Every valid scheme of `bits`, and a check that exactly the documented
/// combinations are rejected.
fn schemes_of(bits: u8) -> Vec<QuantScheme> {
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

fn all_schemes() -> Vec<QuantScheme> {
    (1..=8).flat_map(schemes_of).collect()
}

fn scheme(bits: u8, axis: Axis, group: Group, mode: Mode, fmt: ScaleFormat) -> QuantScheme {
    QuantScheme::new(bits, axis, group)
        .unwrap()
        .with_mode(mode)
        .unwrap()
        .with_scale_format(fmt)
}

/// Kinds of input, including the awkward ones.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
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

const KINDS: [Kind; 9] = [
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
fn gen(kind: Kind, tokens: usize, nh: usize, hd: usize, rng: &mut Rng) -> Vec<f32> {
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
                    _ => rng.normal() * 10f32.powf(rng.uniform(-8.0, 3.0)),
                },
            };
        }
    }
    x
}

fn read_fmt(fmt: ScaleFormat, b: &[u8]) -> f32 {
    match fmt {
        ScaleFormat::F16 => f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        ScaleFormat::Bf16 => bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        ScaleFormat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// Groups in one param set, from the scheme alone (not from `Layout`).
fn set_len(l: &Layout) -> usize {
    let s = l.scheme();
    match (s.axis(), s.group()) {
        (Axis::PerToken, Group::Size(n)) => l.head_dim() / n,
        (Axis::PerToken, _) => 1,
        (Axis::PerChannel, _) => l.head_dim(),
    }
}

/// `(scale, zero)` of element `(t, c)` of a head, decoded from its param
/// bytes as `docs/FORMAT.md` describes them.
fn stored_param(head: &PackedHead<'_>, t: usize, c: usize) -> (f32, f32) {
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
fn plane_widths(bits: u8) -> Vec<usize> {
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
fn ref_pack(codes: &[u8], bits: u8) -> Vec<u8> {
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

fn ref_unpack(packed: &[u8], bits: u8, n: usize) -> Vec<u8> {
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
fn stored_codes(head: &PackedHead<'_>, t: usize) -> Vec<u8> {
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
fn group_index(l: &Layout, t: usize, h: usize, c: usize) -> usize {
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
fn slack(scale: f32, zero: f32, max_code: f32) -> f64 {
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
fn check_block(x: &[f32], block: &PackedBlock) -> Result<f64, String> {
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
fn quantize_ok(s: QuantScheme, nh: usize, hd: usize, x: &[f32], tokens: usize) -> PackedBlock {
    let q = UniformQuantizer::new(s, nh, hd).unwrap();
    q.quantize(x, tokens)
        .unwrap_or_else(|e| panic!("{}: {e}", s.label()))
}

// ---------------------------------------------------------------------------
// 1. Packing
// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// pack → unpack is the identity for every width and row length, and the
    /// bytes are exactly those of the normative rule.
    #[test]
    fn pack_unpack_identity(bits in 1u8..=8, n8 in 1usize..64, seed in any::<u64>()) {
        let n = n8 * 8;
        let mut rng = Rng::new(seed);
        let codes: Vec<u8> = (0..n).map(|_| (rng.next_u64() >> (64 - bits)) as u8).collect();
        let mut packed = vec![0xA5u8; packed_len(n, bits)];
        prop_assert_eq!(packed.len(), n * bits as usize / 8);
        pack(&codes, bits, &mut packed);
        prop_assert_eq!(&packed, &ref_pack(&codes, bits));
        let mut back = vec![0xFFu8; n];
        unpack(&packed, bits, &mut back);
        prop_assert_eq!(&back, &codes);
        // unpack is a function of the bytes only: a packed row of random
        // bytes unpacks to what the rule says.
        let noise: Vec<u8> = (0..packed.len()).map(|_| rng.next_u64() as u8).collect();
        unpack(&noise, bits, &mut back);
        prop_assert_eq!(&back, &ref_unpack(&noise, bits, n));
    }
}

/// The packing examples of `docs/FORMAT.md`, section 2.
#[test]
fn pack_worked_examples() {
    let codes = [5u8, 3, 7, 0, 6, 1, 2, 4, 4, 2, 1, 6, 0, 7, 3, 5];
    let mut out = [0u8; 6];
    pack(&codes, 3, &mut out);
    assert_eq!(out, [0x09, 0xE7, 0xDB, 0x60, 0x17, 0xE8]);

    // Every width: c_i = i mod 2^b.
    let table: [&[u8]; 8] = [
        &[0x00, 0xFF],
        &[0x00, 0x55, 0xAA, 0xFF],
        &[0x00, 0x55, 0xAA, 0xFF, 0xCC, 0xCC],
        &[0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7],
        &[0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7, 0, 0],
        &[0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7, 0, 0, 0, 0],
        &[
            0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7, 0, 0, 0, 0, 0, 0,
        ],
        &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    ];
    for (bits, want) in (1..=8u8).zip(table) {
        let codes: Vec<u8> = (0..16).map(|i| (i % (1usize << bits)) as u8).collect();
        let mut out = vec![0u8; packed_len(16, bits)];
        pack(&codes, bits, &mut out);
        assert_eq!(out, want, "{bits} bits");
    }

    let mut out = [0u8; 2];
    pack(
        &[1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0],
        1,
        &mut out,
    );
    // element i is bit i div 2 of byte i mod 2
    assert_eq!(out, [0b1110_0011, 0b0111_1010]);
}

/// The block examples of `docs/FORMAT.md`, sections 4 and 5, byte for byte.
#[test]
fn format_doc_block_examples() {
    let s = QuantScheme::new(3, Axis::PerToken, Group::Size(8)).unwrap();
    let q = UniformQuantizer::new(s, 2, 8).unwrap();
    let x: Vec<f32> = [
        [0.0f32, 1., 2., 3., 4., 5., 6., 7.],
        [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5],
        [3.0; 8],
        [1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0],
    ]
    .concat();
    let b = q.quantize(&x, 2).unwrap();
    let want: Vec<u8> = [
        &b"KVQB"[..],
        &[
            1, 3, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 2, 0, 0, 0, 8, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,
        ],
        &[
            0x88, 0xDD, 0xF0, 0, 0, 0, 0x88, 0xDD, 0xF0, 0x77, 0x22, 0x0F,
        ],
        &[0x00, 0x3C, 0x00, 0x00, 0x00, 0x00, 0x00, 0x42],
        &[0x00, 0x38, 0x00, 0xC0, 0x00, 0x38, 0x00, 0xC0],
    ]
    .concat();
    assert_eq!(b.to_bytes(), want);
    assert_eq!(q.roundtrip(&x, 2).unwrap(), x);

    let s = QuantScheme::new(4, Axis::PerToken, Group::Size(8))
        .unwrap()
        .with_mode(Mode::Symmetric)
        .unwrap();
    let q = UniformQuantizer::new(s, 1, 8).unwrap();
    let x = [-7.0f32, -3.5, 0.0, 0.5, 1.0, 2.0, 3.5, 7.0];
    let b = q.quantize(&x, 1).unwrap();
    assert_eq!(b.codes(), [0x91, 0xA5, 0xC8, 0xF9]);
    assert_eq!(b.params(), [0x00, 0x3C]);
    assert_eq!(
        q.roundtrip(&x, 1).unwrap(),
        [-7.0, -3.0, 0.0, 1.0, 1.0, 2.0, 4.0, 7.0]
    );

    // Section 6: per-channel partial block, Vector.
    let l = QuantScheme::new(2, Axis::PerChannel, Group::Size(8))
        .unwrap()
        .layout(1, 8)
        .unwrap();
    assert_eq!((l.code_bytes(10), l.param_bytes(10)), (20, 64));
    let l = QuantScheme::new(3, Axis::PerToken, Group::Vector)
        .unwrap()
        .layout(12, 64)
        .unwrap();
    assert_eq!(l.bytes(1), 292);
}

#[test]
#[should_panic(expected = "does not fit")]
fn pack_rejects_oversized_codes() {
    let mut out = [0u8; 3];
    pack(&[8, 0, 0, 0, 0, 0, 0, 0], 3, &mut out);
}

// ---------------------------------------------------------------------------
// 2. Quantizer error budget
// ---------------------------------------------------------------------------

/// Every bits × axis × group × mode × scale format, on several input kinds
/// and shapes, obeys the documented math and error bound.
#[test]
fn error_budget_every_scheme() {
    let mut rng = Rng::new(7);
    let shapes = [
        (1usize, 64usize, 1usize),
        (2, 64, 9),
        (1, 128, 5),
        (1, 64, 37),
    ];
    let kinds = [Kind::Random, Kind::Offset, Kind::OutlierChannel, Kind::Wild];
    let mut n = 0;
    for (si, s) in all_schemes().into_iter().enumerate() {
        for (ki, &kind) in kinds.iter().enumerate() {
            let (nh, hd, tokens) = shapes[(si + ki) % shapes.len()];
            let x = gen(kind, tokens, nh, hd, &mut rng);
            let q = UniformQuantizer::new(s, nh, hd).unwrap();
            let block = q.quantize(&x, tokens).unwrap();
            check_block(&x, &block).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            if ki == 0 {
                // f16/bf16 input: the codes and params of its f32 widening.
                let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                let wh: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
                let wb: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
                assert_eq!(q.quantize(&xh, tokens), q.quantize(&wh, tokens));
                assert_eq!(q.quantize(&xb, tokens), q.quantize(&wb, tokens));
            }
        }
        n += 1;
    }
    assert_eq!(n, 8 * 10 * 2 * 3 - 10 * 3);
}

/// Small magnitudes and subnormals: the bound still holds (here the step can
/// be a subnormal f32, whose reciprocal overflows f32).
#[test]
fn error_budget_tiny_and_subnormal() {
    let mut rng = Rng::new(11);
    for kind in [Kind::Tiny, Kind::Subnormal] {
        for bits in 1..=8 {
            for s in schemes_of(bits) {
                let (nh, hd, tokens) = (2, 64, 9);
                let x = gen(kind, tokens, nh, hd, &mut rng);
                let block = quantize_ok(s, nh, hd, &x, tokens);
                check_block(&x, &block).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            }
        }
    }
}

/// ~1e30: fine with f32 and bf16 scales, `ScaleOverflow` with f16.
#[test]
fn error_budget_huge() {
    let mut rng = Rng::new(13);
    for bits in 1..=8 {
        for s in schemes_of(bits) {
            let (nh, hd, tokens) = (2, 64, 9);
            let x = gen(Kind::Huge, tokens, nh, hd, &mut rng);
            let q = UniformQuantizer::new(s, nh, hd).unwrap();
            match (s.scale_format(), q.quantize(&x, tokens)) {
                (ScaleFormat::F16, Err(Error::ScaleOverflow { op, format, .. })) => {
                    assert_eq!((op, format), ("quantize", "f16"));
                }
                (ScaleFormat::F16, r) => panic!("{}: {r:?}", s.label()),
                (_, r) => {
                    let b = r.unwrap_or_else(|e| panic!("{}: {e}", s.label()));
                    check_block(&x, &b).unwrap();
                }
            }
        }
    }
}

/// Values near the top of f32's range: either a `ScaleOverflow` or a block
/// within the bound — never an infinite reconstruction.
#[test]
fn error_budget_near_f32_max() {
    let mut rng = Rng::new(17);
    for bits in 1..=8 {
        for s in schemes_of(bits) {
            if s.scale_format() == ScaleFormat::F16 {
                continue;
            }
            let (nh, hd, tokens) = (1, 64, 8);
            let mut x: Vec<f32> = (0..tokens * hd)
                .map(|_| rng.uniform(-1.0, 1.0) * 3.0e38)
                .collect();
            x[0] = f32::MAX;
            x[1] = -f32::MAX;
            let q = UniformQuantizer::new(s, nh, hd).unwrap();
            match q.quantize(&x, tokens) {
                Err(Error::ScaleOverflow { .. }) => {}
                Err(e) => panic!("{}: {e}", s.label()),
                Ok(b) => {
                    check_block(&x, &b).unwrap();
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A random scheme, shape and input kind: the bound holds, and f16/bf16
    /// input gives exactly the block of its f32 widening.
    #[test]
    fn error_budget_random(
        s in prop::sample::select(all_schemes()),
        nh in 1usize..=2,
        hd_i in 0usize..2,
        tokens in 1usize..=40,
        kind in prop::sample::select(vec![
            Kind::Random, Kind::Offset, Kind::ConstantRows, Kind::ConstantChannels,
            Kind::OutlierChannel, Kind::Tiny, Kind::Wild,
        ]),
        seed in any::<u64>(),
    ) {
        let hd = [64, 192][hd_i];
        let mut rng = Rng::new(seed);
        let x = gen(kind, tokens, nh, hd, &mut rng);
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        let block = q.quantize(&x, tokens).unwrap();
        check_block(&x, &block).map_err(TestCaseError::fail)?;
        // Element types: same codes and params as the widened f32 input.
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        check_element(&q, &xh, tokens)?;
        check_element(&q, &xb, tokens)?;
    }
}

fn check_element<T: Element>(
    q: &UniformQuantizer,
    x: &[T],
    tokens: usize,
) -> Result<(), TestCaseError> {
    let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let a = q
        .quantize(x, tokens)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let b = q
        .quantize(&wide, tokens)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(
        a == b,
        "{}: {} input differs from its f32 widening",
        q.label(),
        T::NAME
    );
    check_block(&wide, &a).map_err(TestCaseError::fail)?;
    Ok(())
}

/// The bound is not vacuous: on random data the worst error is close to half
/// a step (so a quantizer that rounded badly would fail it).
#[test]
fn error_budget_is_tight() {
    let mut rng = Rng::new(3);
    let x = gen(Kind::Random, 64, 2, 64, &mut rng);
    for bits in [2, 4, 8] {
        let s = QuantScheme::new(bits, Axis::PerToken, Group::Size(32)).unwrap();
        let worst = check_block(&x, &quantize_ok(s, 2, 64, &x, 64)).unwrap();
        assert!(worst > 0.45 && worst <= 0.5 + 1e-3, "{bits}: {worst}");
    }
}

/// The checker notices a wrong code, a wrong scale and a wrong zero.
#[test]
fn check_block_catches_corruption() {
    let mut rng = Rng::new(5);
    let x = gen(Kind::Random, 4, 1, 64, &mut rng);
    for s in [
        scheme(
            4,
            Axis::PerToken,
            Group::Size(32),
            Mode::Asymmetric,
            ScaleFormat::F32,
        ),
        scheme(
            3,
            Axis::PerChannel,
            Group::Size(8),
            Mode::Symmetric,
            ScaleFormat::F16,
        ),
    ] {
        let b = quantize_ok(s, 1, 64, &x, 4);
        check_block(&x, &b).unwrap();
        let l = *b.layout();
        for (which, byte) in [("code", 0usize), ("code", 17), ("param", 0), ("param", 3)] {
            let (mut codes, mut params) = (b.codes().to_vec(), b.params().to_vec());
            match which {
                "code" => codes[byte] ^= 0x04,
                _ => params[byte] ^= 0x01,
            }
            let bad = PackedBlock::from_parts(l, 4, codes, params).unwrap();
            assert!(
                check_block(&x, &bad).is_err(),
                "{} {which} {byte}",
                s.label()
            );
        }
    }
}

/// Constant rows and channels: exact with f32 scales and for values the scale
/// format represents; otherwise within the documented bound, which is then at
/// most half an ulp of the format at that value.
#[test]
fn zero_range_groups() {
    let representable = [0.0f32, 0.5, -3.0, 1.0, -0.25, 1024.0, 96.0];
    let other = [0.1f32, -1e-3, 3.3e-5, 1234.567, 1e-6, -7.77e-7, 60000.3];
    let (nh, hd, tokens) = (2, 64, 3);
    for bits in 1..=8 {
        // Constant groups depend on bits, mode and format, not on the size.
        for s in schemes_of(bits)
            .into_iter()
            .filter(|s| matches!(s.group(), Group::Size(8) | Group::Head | Group::Vector))
        {
            for &v in representable.iter().chain(&other) {
                // Constant along the group's axis: whole tokens for per-token,
                // whole blocks of a channel for per-channel (here: all).
                let x = vec![v; tokens * nh * hd];
                let block = quantize_ok(s, nh, hd, &x, tokens);
                check_block(&x, &block).unwrap();
                let mut back = vec![0f32; x.len()];
                block.dequantize_into(&mut back).unwrap();
                let fmt = s.scale_format();
                let exact = s.mode() == Mode::Asymmetric
                    && (fmt == ScaleFormat::F32 || representable.contains(&v));
                let ulp = ulp_fmt(fmt, v);
                for &y in &back {
                    if exact {
                        assert_eq!(y, v, "{}: {v}", s.label());
                    } else {
                        let err = (y as f64 - v as f64).abs();
                        // asymmetric: < half an ulp of the format at v (plus
                        // f32 evaluation); symmetric: the general bound, checked
                        // above.
                        if s.mode() == Mode::Asymmetric {
                            assert!(
                                err <= ulp / 2.0 + 4.0 * EPS * v.abs() as f64,
                                "{}: {v} -> {y} (ulp {ulp:e})",
                                s.label()
                            );
                        }
                    }
                }
            }
        }
    }
    // Different constants per token / per channel at once.
    let (nh, hd, tokens) = (2, 64, 40);
    let mut rng = Rng::new(23);
    for kind in [Kind::ConstantRows, Kind::ConstantChannels] {
        for s in all_schemes() {
            if s.scale_format() != ScaleFormat::F32 || s.mode() != Mode::Asymmetric {
                continue;
            }
            let constant_groups = matches!(
                (kind, s.axis()),
                (Kind::ConstantRows, Axis::PerToken) | (Kind::ConstantChannels, Axis::PerChannel)
            );
            let x = gen(kind, tokens, nh, hd, &mut rng);
            let block = quantize_ok(s, nh, hd, &x, tokens);
            check_block(&x, &block).unwrap();
            if constant_groups {
                let mut back = vec![0f32; x.len()];
                block.dequantize_into(&mut back).unwrap();
                assert_eq!(back, x, "{} {kind:?}", s.label());
            }
        }
    }
}

/// Spacing of `fmt` just above |v|.
fn ulp_fmt(fmt: ScaleFormat, v: f32) -> f64 {
    let a = v.abs();
    match fmt {
        ScaleFormat::F32 => (f32::from_bits(a.to_bits() + 1) - a) as f64,
        ScaleFormat::F16 => {
            let h = f16::from_f32(a);
            let h = if h.to_f32() > a {
                f16::from_bits(h.to_bits() - 1)
            } else {
                h
            };
            (f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()) as f64
        }
        ScaleFormat::Bf16 => {
            let h = bf16::from_f32(a);
            let h = if h.to_f32() > a {
                bf16::from_bits(h.to_bits() - 1)
            } else {
                h
            };
            (bf16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()) as f64
        }
    }
}

/// Next value of the format toward +inf after a representable `r`.
fn next_up(fmt: ScaleFormat, r: f32) -> f32 {
    match fmt {
        ScaleFormat::F32 => {
            if r == 0.0 {
                f32::from_bits(1)
            } else if r > 0.0 {
                f32::from_bits(r.to_bits() + 1)
            } else {
                f32::from_bits(r.to_bits() - 1)
            }
        }
        ScaleFormat::F16 => {
            let h = f16::from_f32(r);
            if r == 0.0 {
                f16::from_bits(1).to_f32()
            } else if r > 0.0 {
                f16::from_bits(h.to_bits() + 1).to_f32()
            } else {
                f16::from_bits(h.to_bits() - 1).to_f32()
            }
        }
        ScaleFormat::Bf16 => {
            let h = bf16::from_f32(r);
            if r == 0.0 {
                bf16::from_bits(1).to_f32()
            } else if r > 0.0 {
                bf16::from_bits(h.to_bits() + 1).to_f32()
            } else {
                bf16::from_bits(h.to_bits() - 1).to_f32()
            }
        }
    }
}

fn representable(fmt: ScaleFormat, r: f32) -> bool {
    match fmt {
        ScaleFormat::F32 => true,
        ScaleFormat::F16 => f16::from_f32(r).to_f32() == r,
        ScaleFormat::Bf16 => bf16::from_f32(r).to_f32() == r,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// `round_up` is the least representable number ≥ x, `round_down` the
    /// greatest ≤ x — the two roundings the error bound rests on.
    #[test]
    fn directed_rounding_is_tight(m in -1.0f64..1.0, e in -50i32..20) {
        let x = m * 2f64.powi(e);
        for fmt in FORMATS {
            let u = fmt.round_up(x);
            let d = fmt.round_down(x);
            if u.is_finite() {
                prop_assert!(representable(fmt, u) && u as f64 >= x, "{:?} up {} {}", fmt, x, u);
                let below = -next_up(fmt, -u);
                prop_assert!((below as f64) < x, "{:?} up {} {} not least", fmt, x, u);
            }
            if d.is_finite() {
                prop_assert!(representable(fmt, d) && d as f64 <= x, "{:?} down {} {}", fmt, x, d);
                prop_assert!((next_up(fmt, d) as f64) > x, "{:?} down {} {} not greatest", fmt, x, d);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// 3. Fused kernels against the oracle, on every backend
// ---------------------------------------------------------------------------

/// A kernel under test: `(name, scores, weighted_sum)`, each with the
/// signature of `kernels::scores`/`kernels::weighted_sum`.
type KernelFn<'a> = &'a dyn Fn(&PackedHead<'_>, &[f32], &mut [f32]) -> kvq::Result<()>;
type Kernels<'a> = (&'a str, KernelFn<'a>, KernelFn<'a>);

/// Relative tolerance of a fused kernel against the f64 oracle, relative to
/// the magnitude of the terms it sums: `Σ_c |q_c|·(|scale·code_c| + |zero_c|)`
/// for a score (the fused formula adds `scale·(q·codes)` and `zero·Σq`, so
/// that, not `Σ|q_c·k̂_c|`, is what its rounding scales with) and
/// `|out₀| + Σ_t |p_t|·(|scale·code| + |zero|)` for a weighted sum. Plus, in
/// f32's subnormal range, an absolute `2^-148` per term and code level.
const REL: f64 = 1e-5;

/// Every decoded `(scale, zero)` of a head, and `(set, group)` of an element.
struct HeadParams {
    scales: Vec<f32>,
    zeros: Vec<f32>,
    n: usize,
}

impl HeadParams {
    fn new(head: &PackedHead<'_>) -> Self {
        let l = head.layout();
        let s = l.scheme();
        let (fmt, fb, n) = (s.scale_format(), s.scale_format().bytes(), set_len(l));
        let asym = s.mode() == Mode::Asymmetric;
        let per_set = n * fb * if asym { 2 } else { 1 };
        let (mut scales, mut zeros) = (Vec::new(), Vec::new());
        for p in head.params().chunks(per_set) {
            for g in 0..n {
                let sc = read_fmt(fmt, &p[g * fb..]);
                scales.push(sc);
                zeros.push(if asym {
                    read_fmt(fmt, &p[(n + g) * fb..])
                } else {
                    -sc * (1u32 << (s.bits() - 1)) as f32
                });
            }
        }
        HeadParams { scales, zeros, n }
    }
    fn at(&self, l: &Layout, t: usize, c: usize) -> (f32, f32) {
        let (set, g) = match (l.scheme().axis(), l.scheme().group()) {
            (Axis::PerToken, Group::Size(gs)) => (t, c / gs),
            (Axis::PerToken, _) => (t, 0),
            (Axis::PerChannel, Group::Size(gs)) => (t / gs, c),
            _ => unreachable!(),
        };
        (self.scales[set * self.n + g], self.zeros[set * self.n + g])
    }
}

/// The kernel harness: runs every kernel pair in `under_test` on every head
/// of `block` with the same `n_q` random queries and probabilities, and
/// compares each with the oracle (`kernels::reference`). Returns the worst
/// error in units of the tolerance, or the first mismatch.
fn fused_vs_oracle(
    block: &PackedBlock,
    n_q: usize,
    rng: &mut Rng,
    under_test: &[Kernels<'_>],
) -> Result<f64, String> {
    let l = block.layout();
    let (hd, tokens) = (l.head_dim(), block.tokens());
    let levels = (1u32 << l.scheme().bits()) as f64;
    let label = l.scheme().label();
    let mut worst = 0f64;
    for h in 0..l.n_kv_heads() {
        let head = block.head(h);
        let hp = HeadParams::new(&head);
        // |scale·code| + |zero| of every element, f64.
        let mut mag_k = vec![0f64; tokens * hd];
        for t in 0..tokens {
            let codes = stored_codes(&head, t);
            for c in 0..hd {
                let (s, z) = hp.at(l, t, c);
                mag_k[t * hd + c] = (s as f64 * codes[c] as f64).abs() + (z as f64).abs();
            }
        }
        // Queries: normal, with one loud channel half of the time.
        let loud = rng.below(2) == 0;
        let q: Vec<f32> = (0..n_q * hd)
            .map(|i| rng.normal() * if loud && i % hd == 5 { 100.0 } else { 1.0 })
            .collect();
        let mut want = vec![f32::NAN; n_q * tokens];
        reference::scores(&head, &q, &mut want);
        let tol: Vec<f64> = (0..n_q * tokens)
            .map(|it| {
                let (i, t) = (it / tokens.max(1), it % tokens.max(1));
                let mag: f64 = (0..hd)
                    .map(|c| (q[i * hd + c] as f64).abs() * mag_k[t * hd + c])
                    .sum();
                REL * mag + 2.0 * hd as f64 * levels * TINY
            })
            .collect();
        for (name, scores, _) in under_test {
            let mut got = vec![f32::NAN; n_q * tokens];
            scores(&head, &q, &mut got).map_err(|e| format!("{name}: scores: {e}"))?;
            for (it, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let err = (g as f64 - w as f64).abs();
                if err.is_nan() || err > tol[it] {
                    return Err(format!(
                        "{name}: scores {label}: head {h} query {} token {}: fused {g:e}, \
                         oracle {w:e}, |diff| {err:e} > tol {:e}",
                        it / tokens,
                        it % tokens,
                        tol[it]
                    ));
                }
                worst = worst.max(err / tol[it]);
            }
        }
        // Probabilities: positive, softmax-like, or signed weights in every
        // third call.
        let signed = rng.below(3) == 0;
        let p: Vec<f32> = (0..n_q * tokens)
            .map(|_| {
                let v = (rng.normal() * 2.0).exp() / tokens as f32;
                if signed && rng.below(2) == 0 {
                    -v
                } else {
                    v
                }
            })
            .collect();
        let out0: Vec<f32> = (0..n_q * hd).map(|_| rng.normal()).collect();
        let mut want = out0.clone();
        reference::weighted_sum(&head, &p, &mut want);
        let tol: Vec<f64> = (0..n_q * hd)
            .map(|ic| {
                let (i, c) = (ic / hd, ic % hd);
                let mag: f64 = (0..tokens)
                    .map(|t| (p[i * tokens + t] as f64).abs() * mag_k[t * hd + c])
                    .sum();
                REL * (mag + (out0[ic] as f64).abs()) + 2.0 * tokens as f64 * levels * TINY
            })
            .collect();
        for (name, _, wsum) in under_test {
            let mut got = out0.clone();
            wsum(&head, &p, &mut got).map_err(|e| format!("{name}: weighted_sum: {e}"))?;
            for (ic, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let err = (g as f64 - w as f64).abs();
                if err.is_nan() || err > tol[ic] {
                    return Err(format!(
                        "{name}: weighted_sum {label}: head {h} query {} channel {}: \
                         fused {g:e}, oracle {w:e}, |diff| {err:e} > tol {:e}",
                        ic / hd,
                        ic % hd,
                        tol[ic]
                    ));
                }
                worst = worst.max(err / tol[ic]);
            }
        }
    }
    Ok(worst)
}

/// Every backend this CPU has (saying which of `Backend::ALL` it skips).
fn backends() -> Vec<Backend> {
    let available = Backend::available();
    assert!(available.contains(&Backend::Portable));
    assert!(available.contains(&Backend::detect()));
    for &b in Backend::ALL {
        if !available.contains(&b) {
            eprintln!(
                "skipping backend {}: this CPU does not support it",
                b.name()
            );
        }
    }
    Backend::ALL
        .iter()
        .copied()
        .filter(|b| available.contains(b))
        .collect()
}

/// The harness on every available backend: the one place that lists what
/// is under test, so a backend added to `Backend::ALL` is covered here.
fn fused_all(block: &PackedBlock, n_q: usize, rng: &mut Rng) -> Result<f64, String> {
    let list = backends();
    let scores: Vec<_> = list
        .iter()
        .map(|&b| {
            move |h: &PackedHead<'_>, q: &[f32], o: &mut [f32]| kernels::scores_on(b, h, q, o)
        })
        .collect();
    let wsums: Vec<_> = list
        .iter()
        .map(|&b| {
            move |h: &PackedHead<'_>, p: &[f32], o: &mut [f32]| kernels::weighted_sum_on(b, h, p, o)
        })
        .collect();
    let under_test: Vec<Kernels<'_>> = list
        .iter()
        .zip(scores.iter().zip(&wsums))
        .map(|(b, (s, w))| (b.name(), s as KernelFn<'_>, w as KernelFn<'_>))
        .collect();
    fused_vs_oracle(block, n_q, rng, &under_test)
}

/// The sweep: every bits 1–8 × mode × axis/group × scale format, one input
/// kind each, chosen so that every (axis, mode, format) meets every kind;
/// token counts, head dims, heads and query counts rotate through the
/// awkward values.
#[test]
fn fused_kernels_match_oracle() {
    let token_counts = [1usize, 7, 31, 33, 1023, 2, 64];
    let head_dims = [64usize, 128, 256, 8, 24];
    let mut rng = Rng::new(29);
    let mut worst = 0f64;
    let mut seen = std::collections::HashSet::new();
    for (k, s) in all_schemes().into_iter().enumerate() {
        let gi = GROUPS.iter().position(|&g| g == s.group()).unwrap();
        let kind = KINDS[((s.bits() as usize - 1) * GROUPS.len() + gi) % KINDS.len()];
        let mut tokens = token_counts[k % token_counts.len()];
        let mut hd = head_dims[(k / 2) % head_dims.len()];
        if let Group::Size(n) = s.group() {
            if s.axis() == Axis::PerToken && !hd.is_multiple_of(n) {
                hd = 64.max(n);
            }
        }
        let nh = 1 + (k / 3) % 2;
        // 1023 tokens only every third time, and at most 64 wide (debug
        // builds; `fused_kernels_long_and_wide` has the big ones).
        if tokens == 1023 && ((k / 3) % 3 != 0 || nh * hd > 64) {
            tokens = 33;
        }
        let n_q = 1 + k % 8;
        let x = gen(kind, tokens, nh, hd, &mut rng);
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        let huge_f16 = kind == Kind::Huge && s.scale_format() == ScaleFormat::F16;
        seen.insert(format!(
            "{kind:?} {:?} {:?} {:?}",
            s.axis(),
            s.mode(),
            s.scale_format()
        ));
        let block = match q.quantize(&x, tokens) {
            Ok(b) => b,
            Err(Error::ScaleOverflow { .. }) if huge_f16 => continue,
            Err(e) => panic!("{} {kind:?}: {e}", s.label()),
        };
        assert!(!huge_f16, "1e30 with f16 scales must overflow");
        let w = fused_all(&block, n_q, &mut rng)
            .unwrap_or_else(|e| panic!("{kind:?} {tokens}x{nh}x{hd} n_q {n_q}: {e}"));
        worst = worst.max(w);
    }
    eprintln!("worst error {worst:.3} of the tolerance");
    assert_eq!(seen.len(), KINDS.len() * 2 * 2 * 3);
}

/// The big shapes: 1023 tokens at head dims 64, 128, 256, 8 queries.
#[test]
fn fused_kernels_long_and_wide() {
    let mut rng = Rng::new(31);
    for (bits, axis, group, mode, hd) in [
        (4, Axis::PerToken, Group::Size(32), Mode::Asymmetric, 64),
        (3, Axis::PerChannel, Group::Size(32), Mode::Symmetric, 128),
        (8, Axis::PerToken, Group::Head, Mode::Symmetric, 256),
        (2, Axis::PerChannel, Group::Size(64), Mode::Asymmetric, 256),
    ] {
        let s = scheme(bits, axis, group, mode, ScaleFormat::F16);
        let x = gen(Kind::OutlierChannel, 1023, 1, hd, &mut rng);
        let block = quantize_ok(s, 1, hd, &x, 1023);
        fused_all(&block, 8, &mut rng).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn fused_kernels_random(
        s in prop::sample::select(all_schemes()),
        nh in 1usize..=2,
        hd_i in 0usize..4,
        tokens in 0usize..=80,
        n_q in 1usize..=8,
        kind in prop::sample::select(KINDS.to_vec()),
        seed in any::<u64>(),
    ) {
        let hd = [8usize, 16, 24, 64][hd_i];
        if let Group::Size(n) = s.group() {
            prop_assume!(s.axis() == Axis::PerChannel || hd.is_multiple_of(n));
        }
        let mut rng = Rng::new(seed);
        let x = gen(kind, tokens, nh, hd, &mut rng);
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        let block = match q.quantize(&x, tokens) {
            Err(Error::ScaleOverflow { .. }) if kind == Kind::Huge => return Ok(()),
            r => r.unwrap(),
        };
        fused_all(&block, n_q, &mut rng).map_err(TestCaseError::fail)?;
    }
}

/// The harness is not a tautology: a kernel that is off by a fraction of one
/// step in one place, or forgets the zero, is caught.
#[test]
fn harness_catches_a_wrong_kernel() {
    let mut rng = Rng::new(37);
    let x = gen(Kind::Random, 33, 1, 64, &mut rng);
    for axis in [Axis::PerToken, Axis::PerChannel] {
        let s = scheme(4, axis, Group::Size(32), Mode::Asymmetric, ScaleFormat::F16);
        let block = quantize_ok(s, 1, 64, &x, 33);
        let good = |h: &PackedHead<'_>, q: &[f32], o: &mut [f32]| {
            reference::scores(h, q, o);
            Ok(())
        };
        let good_w = |h: &PackedHead<'_>, p: &[f32], o: &mut [f32]| {
            reference::weighted_sum(h, p, o);
            Ok(())
        };
        assert!(fused_vs_oracle(&block, 2, &mut rng, &[("oracle", &good, &good_w)]).is_ok());
        // A score off by a quarter step of one element, in the last token
        // of the last query.
        let off = |h: &PackedHead<'_>, q: &[f32], o: &mut [f32]| {
            reference::scores(h, q, o);
            let (s, _) = stored_param(h, 0, 0);
            assert!(s > 0.0);
            let last = o.len() - 1;
            o[last] += s / 4.0 * q[0].abs().max(1.0);
            Ok(())
        };
        let r = fused_vs_oracle(
            &block,
            2,
            &mut rng,
            &[("good", &good, &good_w), ("off", &off, &good_w)],
        );
        assert!(r.unwrap_err().starts_with("off: scores"));
        // A weighted sum that drops the zero of token 0.
        let no_zero = |h: &PackedHead<'_>, p: &[f32], o: &mut [f32]| {
            reference::weighted_sum(h, p, o);
            let (_, z) = stored_param(h, 0, 0);
            o[0] -= p[0] * z;
            Ok(())
        };
        let r = fused_vs_oracle(&block, 1, &mut rng, &[("no_zero", &good, &no_zero)]);
        assert!(r.unwrap_err().starts_with("no_zero: weighted_sum"));
    }
}

/// `scores`/`weighted_sum` (detected backend) are `*_on(detect())`, and a
/// `PackedHead` over an engine's own buffers reads the same as the block's.
#[test]
fn kernels_entry_points_agree() {
    let mut rng = Rng::new(41);
    let (nh, hd, tokens) = (2, 64, 40);
    let s = scheme(
        5,
        Axis::PerChannel,
        Group::Size(16),
        Mode::Asymmetric,
        ScaleFormat::Bf16,
    );
    let x = gen(Kind::OutlierChannel, tokens, nh, hd, &mut rng);
    let block = quantize_ok(s, nh, hd, &x, tokens);
    let q: Vec<f32> = (0..3 * hd).map(|_| rng.normal()).collect();
    let p: Vec<f32> = (0..3 * tokens).map(|_| rng.unit()).collect();
    for h in 0..nh {
        let view = block.head(h);
        let own = PackedHead::new(*block.layout(), tokens, view.codes(), view.params()).unwrap();
        let (mut a, mut b) = (vec![0f32; 3 * tokens], vec![0f32; 3 * tokens]);
        kernels::scores(&view, &q, &mut a).unwrap();
        kernels::scores_on(Backend::detect(), &own, &q, &mut b).unwrap();
        assert_eq!(a, b);
        let (mut a, mut b) = (vec![1f32; 3 * hd], vec![1f32; 3 * hd]);
        kernels::weighted_sum(&view, &p, &mut a).unwrap();
        kernels::weighted_sum_on(Backend::detect(), &own, &p, &mut b).unwrap();
        assert_eq!(a, b);
    }
}

// ---------------------------------------------------------------------------
// 4. Accounting
// ---------------------------------------------------------------------------

/// Bytes of a block by the formula of `docs/FORMAT.md`, from first principles.
fn formula_bytes(s: &QuantScheme, nh: usize, hd: usize, tokens: usize) -> usize {
    let codes = tokens * nh * hd * s.bits() as usize / 8;
    let pb = s.scale_format().bytes() * if s.mode() == Mode::Asymmetric { 2 } else { 1 };
    let params = match (s.axis(), s.group()) {
        (Axis::PerToken, Group::Size(n)) => tokens * nh * (hd / n) * pb,
        (Axis::PerToken, Group::Head) => tokens * nh * pb,
        (Axis::PerToken, Group::Vector) => tokens * pb,
        (Axis::PerChannel, Group::Size(n)) => tokens.div_ceil(n) * nh * hd * pb,
        _ => unreachable!(),
    };
    codes + params
}

#[test]
fn accounting_sweep() {
    let mut rng = Rng::new(43);
    for s in all_schemes() {
        for (nh, hd) in [(1usize, 8usize), (2, 24), (3, 64), (1, 256)] {
            let Ok(layout) = s.layout(nh, hd) else {
                // Only a per-token group that does not divide head_dim fails.
                let Group::Size(n) = s.group() else {
                    panic!("{}", s.label())
                };
                assert!(s.axis() == Axis::PerToken && hd % n != 0);
                continue;
            };
            let q = UniformQuantizer::from_layout(layout);
            let gl = layout.group_len();
            for tokens in [0usize, 1, 7, 31, 33, 64, 128, 1023, 4096] {
                let want = formula_bytes(&s, nh, hd, tokens);
                assert_eq!(
                    layout.bytes(tokens),
                    want,
                    "{} {nh}x{hd} t{tokens}",
                    s.label()
                );
                assert_eq!(layout.code_bytes(tokens) + layout.param_bytes(tokens), want);
                // A real block allocates exactly that (a few sizes: debug
                // builds quantize slowly).
                if [0, 1, 7, 33].contains(&tokens) && (hd <= 64 || tokens <= 1) {
                    let x: Vec<f32> = (0..tokens * nh * hd).map(|_| rng.normal()).collect();
                    let b = q.quantize(&x, tokens).unwrap();
                    assert_eq!(b.bytes(), want, "{} {nh}x{hd} t{tokens}", s.label());
                    assert_eq!(b.codes().len() + b.params().len(), want);
                    assert_eq!(b.codes().len(), layout.code_bytes(tokens));
                    assert_eq!(b.params().len(), layout.param_bytes(tokens));
                }
                let whole = s.axis() == Axis::PerToken || tokens % gl == 0;
                if whole {
                    let eb = layout.effective_bits() * (tokens * nh * hd) as f64 / 8.0;
                    if gl.is_power_of_two() {
                        assert_eq!(eb, want as f64, "{} {nh}x{hd} t{tokens}", s.label());
                    } else {
                        assert!((eb - want as f64).abs() <= 1e-9 * want as f64);
                    }
                }
            }
            assert_eq!(
                layout.bytes_per_token() * layout.block_tokens() as f64,
                layout.bytes(layout.block_tokens()) as f64
            );
        }
    }
}

/// The study's numbers.
#[test]
fn accounting_study_examples() {
    // GPT-2 small: K 6 bits / V 4 bits, f16 scale + zero per 64 channels.
    let k = QuantScheme::new(6, Axis::PerToken, Group::Size(64)).unwrap();
    let v = QuantScheme::new(4, Axis::PerToken, Group::Size(64)).unwrap();
    let (lk, lv) = (k.layout(12, 64).unwrap(), v.layout(12, 64).unwrap());
    assert_eq!(lk.effective_bits(), 6.5);
    assert_eq!(lv.effective_bits(), 4.5);
    let bits = (lk.effective_bits() + lv.effective_bits()) / 2.0;
    assert_eq!(bits, 5.5);
    assert_eq!(format!("{:.2}", 16.0 / bits), "2.91");
    // Per head and token: 48+4 and 32+4 bytes against 2·128 of f16.
    assert_eq!((lk.bytes(1), lv.bytes(1)), (12 * 52, 12 * 36));
    assert_eq!(
        format!(
            "{:.2}",
            (12 * 256) as f64 / (lk.bytes(1) + lv.bytes(1)) as f64
        ),
        "2.91"
    );

    // Qwen3.5: head dim 256, 4 KV heads, 8 full-attention layers,
    // K 4 bits / V 8 bits per 256 channels.
    let k = QuantScheme::new(4, Axis::PerToken, Group::Size(256)).unwrap();
    let v = QuantScheme::new(8, Axis::PerToken, Group::Size(256)).unwrap();
    let (lk, lv) = (k.layout(4, 256).unwrap(), v.layout(4, 256).unwrap());
    let bits = (lk.effective_bits() + lv.effective_bits()) / 2.0;
    assert_eq!(bits, 6.125);
    assert_eq!(format!("{:.2}", 16.0 / bits), "2.61");
    // 262144 tokens: bf16 cache 8.6 GB, 5.3 GB saved.
    let tokens = 262_144usize;
    let dense = 8 * 2 * tokens * 4 * 256 * 2;
    assert_eq!(dense / tokens, 32 * 1024);
    let packed = 8 * (lk.bytes(tokens) + lv.bytes(tokens));
    assert_eq!(format!("{:.1}", dense as f64 / 1e9), "8.6");
    assert_eq!(format!("{:.1}", (dense - packed) as f64 / 1e9), "5.3");
}

// ---------------------------------------------------------------------------
// 5. Errors
// ---------------------------------------------------------------------------

fn msg(e: &Error) -> String {
    e.to_string()
}

#[track_caller]
fn assert_msg(e: &Error, parts: &[&str]) {
    let m = msg(e);
    for p in parts {
        assert!(m.contains(p), "message {m:?} lacks {p:?}");
    }
}

#[test]
fn errors_schemes_and_shapes() {
    for bits in [0u8, 9, 255] {
        let e = QuantScheme::new(bits, Axis::PerToken, Group::Head).unwrap_err();
        assert!(matches!(e, Error::InvalidScheme { .. }), "{e:?}");
        assert_msg(&e, &["scheme", "bits", &bits.to_string()]);
    }
    for n in [0usize, 12, 7, 100] {
        let e = QuantScheme::new(4, Axis::PerChannel, Group::Size(n)).unwrap_err();
        assert!(matches!(e, Error::InvalidScheme { .. }), "{e:?}");
        assert_msg(&e, &["group size", "multiple of 8", &n.to_string()]);
    }
    for g in [Group::Head, Group::Vector] {
        let e = QuantScheme::new(4, Axis::PerChannel, g).unwrap_err();
        assert!(matches!(e, Error::InvalidScheme { .. }), "{e:?}");
        assert!(msg(&e).contains(&format!("{g:?}")), "{e}");
    }
    let e = QuantScheme::new(1, Axis::PerToken, Group::Size(8))
        .unwrap()
        .with_mode(Mode::Symmetric)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidScheme { .. }));
    assert_msg(&e, &["symmetric", ">= 2", "1"]);

    let s = QuantScheme::new(4, Axis::PerToken, Group::Size(48)).unwrap();
    let e = UniformQuantizer::new(s, 2, 64).unwrap_err();
    assert!(
        matches!(e, Error::SchemeShape { op: "layout", .. }),
        "{e:?}"
    );
    assert_msg(&e, &["layout", "48", "64"]);
    // A per-channel group need not divide head_dim (it counts tokens).
    assert!(QuantScheme::new(4, Axis::PerChannel, Group::Size(48))
        .unwrap()
        .layout(2, 64)
        .is_ok());

    let s = QuantScheme::new(4, Axis::PerToken, Group::Head).unwrap();
    for (nh, hd, want) in [
        (0usize, 64usize, "n_kv_heads"),
        (2, 20, "20"),
        (2, 0, "head_dim"),
    ] {
        let e = s.layout(nh, hd).unwrap_err();
        assert!(
            matches!(e, Error::InvalidShape { op: "layout", .. }),
            "{e:?}"
        );
        assert_msg(&e, &["layout", want]);
    }
}

#[test]
fn errors_lengths() {
    let (nh, hd, tokens) = (2usize, 32usize, 5usize);
    let s = scheme(
        4,
        Axis::PerToken,
        Group::Size(16),
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let q = UniformQuantizer::new(s, nh, hd).unwrap();
    let x = vec![0.5f32; tokens * nh * hd];
    let len = |e: Error, op: &str, expected: usize, got: usize| {
        match &e {
            Error::Length {
                op: o,
                expected: x,
                got: g,
                ..
            } => {
                assert_eq!((*o, *x, *g), (op, expected, got), "{e}")
            }
            _ => panic!("{e:?}"),
        }
        assert_msg(&e, &[op, &expected.to_string(), &got.to_string()]);
    };
    len(
        q.quantize(&x[1..], tokens).unwrap_err(),
        "quantize",
        320,
        319,
    );
    len(
        q.quantize(&x, tokens + 1).unwrap_err(),
        "quantize",
        384,
        320,
    );
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    len(q.quantize(&xh, 4).unwrap_err(), "quantize", 256, 320);

    let b = q.quantize(&x, tokens).unwrap();
    let mut out = vec![0f32; 321];
    len(
        q.dequantize(&b, &mut out).unwrap_err(),
        "dequantize",
        320,
        321,
    );
    len(
        b.dequantize_into(&mut out[..10]).unwrap_err(),
        "dequantize",
        320,
        10,
    );
    let other = UniformQuantizer::new(s, 1, 64).unwrap();
    let e = other.dequantize(&b, &mut out[..320]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::SchemeShape {
                op: "dequantize",
                ..
            }
        ),
        "{e:?}"
    );

    let head = b.head(0);
    let mut o = vec![0f32; 2 * tokens];
    len(
        kernels::scores(&head, &[0.0; 33], &mut o).unwrap_err(),
        "scores",
        32,
        33,
    );
    len(
        kernels::scores(&head, &[], &mut o).unwrap_err(),
        "scores",
        32,
        0,
    );
    len(
        kernels::scores(&head, &[0.0; 64], &mut o[1..]).unwrap_err(),
        "scores",
        10,
        9,
    );
    let mut o = vec![0f32; 64];
    len(
        kernels::weighted_sum(&head, &[0.0; 9], &mut o).unwrap_err(),
        "weighted_sum",
        10,
        9,
    );
    len(
        kernels::weighted_sum(&head, &[0.0; 10], &mut o[..63]).unwrap_err(),
        "weighted_sum",
        32,
        63,
    );
    len(
        kernels::weighted_sum(&head, &[], &mut []).unwrap_err(),
        "weighted_sum",
        32,
        0,
    );
    for b in Backend::available() {
        assert!(kernels::scores_on(b, &head, &[0.0; 31], &mut [0.0; 5]).is_err());
        assert!(kernels::weighted_sum_on(b, &head, &[0.0; 4], &mut [0.0; 32]).is_err());
    }

    let l = *b.layout();
    let (codes, params) = (head.codes(), head.params());
    assert_eq!(
        (codes.len(), params.len()),
        (tokens * 16, tokens * 2 * 2 * 2)
    );
    len(
        PackedHead::new(l, tokens, &codes[1..], params).unwrap_err(),
        "PackedHead::new",
        80,
        79,
    );
    len(
        PackedHead::new(l, tokens, codes, &params[..8]).unwrap_err(),
        "PackedHead::new",
        40,
        8,
    );
    len(
        PackedHead::new(l, 4, codes, params).unwrap_err(),
        "PackedHead::new",
        64,
        80,
    );
    let (c, p) = (b.codes().to_vec(), b.params().to_vec());
    len(
        PackedBlock::from_parts(l, tokens, c[1..].to_vec(), p.clone()).unwrap_err(),
        "PackedBlock::from_parts",
        160,
        159,
    );
    len(
        PackedBlock::from_parts(l, tokens, c.clone(), [&p[..], &[0, 0]].concat()).unwrap_err(),
        "PackedBlock::from_parts",
        80,
        82,
    );
    assert_eq!(PackedBlock::from_parts(l, tokens, c, p).unwrap(), b);
    // Token counts whose sizes overflow usize.
    for t in [usize::MAX, usize::MAX / 8] {
        let e = PackedBlock::from_parts(l, t, vec![], vec![]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidShape {
                    op: "PackedBlock::from_parts",
                    ..
                }
            ),
            "{e:?}"
        );
        assert_msg(&e, &[&t.to_string(), "2x32"]);
        let e = PackedHead::new(l, t, &[], &[]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidShape {
                    op: "PackedHead::new",
                    ..
                }
            ),
            "{e:?}"
        );
    }
}

/// NaN and ±inf name the exact token, head and channel, for every element
/// type and axis; the first one in memory order is reported.
#[test]
fn errors_non_finite() {
    let (nh, hd, tokens) = (3usize, 16usize, 11usize);
    for axis in [Axis::PerToken, Axis::PerChannel] {
        let s = QuantScheme::new(3, axis, Group::Size(8)).unwrap();
        let q = UniformQuantizer::new(s, nh, hd).unwrap();
        for (t, h, c) in [
            (0usize, 0usize, 0usize),
            (7, 2, 13),
            (10, 1, 5),
            (10, 2, 15),
        ] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = vec![0.25f32; tokens * nh * hd];
                x[(t * nh + h) * hd + c] = bad;
                // a second one later must not be the one reported
                if t < 10 {
                    x[(10 * nh + 2) * hd + 15] = f32::NAN;
                }
                let check = |e: Error| {
                    match &e {
                        Error::NonFinite {
                            op,
                            token,
                            head,
                            channel,
                            value,
                        } => {
                            assert_eq!((*op, *token, *head, *channel), ("quantize", t, h, c));
                            assert!(value.is_nan() == bad.is_nan());
                        }
                        _ => panic!("{e:?}"),
                    }
                    assert_msg(
                        &e,
                        &[
                            "quantize",
                            &format!("token {t}"),
                            &format!("head {h}"),
                            &format!("channel {c}"),
                        ],
                    );
                };
                check(q.quantize(&x, tokens).unwrap_err());
                let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                check(q.quantize(&xh, tokens).unwrap_err());
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                check(q.quantize(&xb, tokens).unwrap_err());
            }
        }
    }
    // f16 overflow on narrowing is the caller's inf, reported as such.
    let q = UniformQuantizer::new(
        QuantScheme::new(4, Axis::PerToken, Group::Head).unwrap(),
        1,
        8,
    )
    .unwrap();
    let mut x = [f16::from_f32(1.0); 8];
    x[6] = f16::from_f32(1e6);
    assert!(matches!(
        q.quantize(&x, 1).unwrap_err(),
        Error::NonFinite {
            token: 0,
            head: 0,
            channel: 6,
            ..
        }
    ));
}

/// A scale that does not fit f16 names the token, head and group.
#[test]
fn errors_scale_overflow() {
    let (nh, hd, tokens) = (2usize, 64usize, 40usize);
    for (axis, group) in [
        (Axis::PerToken, Group::Size(16)),
        (Axis::PerToken, Group::Head),
        (Axis::PerToken, Group::Vector),
        (Axis::PerChannel, Group::Size(16)),
    ] {
        for mode in [Mode::Asymmetric, Mode::Symmetric] {
            for big in [1e30f32, -1e30, 1e6, -1e6] {
                let s = scheme(4, axis, group, mode, ScaleFormat::F16);
                let q = UniformQuantizer::new(s, nh, hd).unwrap();
                let mut x = vec![1.0f32; tokens * nh * hd];
                let (t, h, c) = (37, 1, 40);
                x[(t * nh + h) * hd + c] = big;
                let e = q.quantize(&x, tokens).unwrap_err();
                let (wt, wh, wg) = match (axis, group) {
                    (Axis::PerToken, Group::Size(n)) => (t, h, c / n),
                    (Axis::PerToken, Group::Head) => (t, h, 0),
                    (Axis::PerToken, _) => (t, 0, 0),
                    (Axis::PerChannel, _) => (32, h, c),
                };
                match &e {
                    Error::ScaleOverflow {
                        op,
                        what,
                        format,
                        token,
                        head,
                        group,
                        ..
                    } => {
                        assert_eq!((*op, *format), ("quantize", "f16"));
                        assert!(*what == "scale" || *what == "zero");
                        assert_eq!((*token, *head, *group), (wt, wh, wg), "{} {e}", s.label());
                    }
                    _ => panic!("{} {big}: {e:?}", s.label()),
                }
                assert_msg(
                    &e,
                    &[
                        "quantize",
                        "f16",
                        &format!("token {wt}"),
                        &format!("group {wg}"),
                    ],
                );
                // bf16 and f32 scales take it.
                for fmt in [ScaleFormat::Bf16, ScaleFormat::F32] {
                    let q = UniformQuantizer::new(s.with_scale_format(fmt), nh, hd).unwrap();
                    check_block(&x, &q.quantize(&x, tokens).unwrap()).unwrap();
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// 6. Serialized blocks
// ---------------------------------------------------------------------------

fn small_block(s: QuantScheme) -> PackedBlock {
    let mut rng = Rng::new(47);
    let (nh, hd, tokens) = (2, 16, 3);
    let x = gen(Kind::Random, tokens, nh, hd, &mut rng);
    quantize_ok(s, nh, hd, &x, tokens)
}

#[track_caller]
fn malformed(r: kvq::Result<PackedBlock>, part: &str) {
    match r {
        Err(
            e @ Error::Malformed {
                op: "PackedBlock::from_bytes",
                ..
            },
        ) => assert_msg(&e, &["PackedBlock::from_bytes", "malformed", part]),
        r => panic!("expected Malformed ({part}), got {r:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bytes_round_trip(
        s in prop::sample::select(all_schemes()),
        nh in 1usize..=3,
        tokens in 0usize..=40,
        seed in any::<u64>(),
    ) {
        let hd = 64;
        let mut rng = Rng::new(seed);
        let x = gen(Kind::Random, tokens, nh, hd, &mut rng);
        let b = quantize_ok(s, nh, hd, &x, tokens);
        let bytes = b.to_bytes();
        prop_assert_eq!(bytes.len(), 32 + b.bytes());
        prop_assert_eq!(&bytes[32..], &[b.codes(), b.params()].concat()[..]);
        let back = PackedBlock::from_bytes(&bytes).unwrap();
        prop_assert_eq!(&back, &b);
        prop_assert_eq!(back.to_bytes(), bytes);
    }
}

/// The header, byte by byte, as `docs/FORMAT.md` documents it.
#[test]
fn bytes_header_layout() {
    let s = scheme(
        5,
        Axis::PerChannel,
        Group::Size(32),
        Mode::Symmetric,
        ScaleFormat::Bf16,
    );
    let b = small_block(s);
    let h = &b.to_bytes()[..32];
    assert_eq!(
        h,
        [
            b'K', b'V', b'Q', b'B', 1, 5, 1, 0, 1, 1, 0, 0, 32, 0, 0, 0, 2, 0, 0, 0, 16, 0, 0, 0,
            3, 0, 0, 0, 0, 0, 0, 0
        ]
    );
    let s = scheme(
        4,
        Axis::PerToken,
        Group::Vector,
        Mode::Asymmetric,
        ScaleFormat::F32,
    );
    let h = small_block(s).to_bytes();
    assert_eq!(&h[4..16], &[1, 4, 0, 2, 0, 2, 0, 0, 0, 0, 0, 0]);
    let s = scheme(
        8,
        Axis::PerToken,
        Group::Head,
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let h = small_block(s).to_bytes();
    assert_eq!(&h[4..16], &[1, 8, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
}

/// Header fields above 255 are little-endian `u32`s at the offsets of
/// `docs/FORMAT.md`, section 5 (checked against bytes written out by hand),
/// and `from_bytes` reads a block at any address: the input has no
/// alignment.
#[test]
fn bytes_header_multibyte_fields_and_unaligned_input() {
    let s = scheme(
        2,
        Axis::PerToken,
        Group::Size(128),
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let (nh, hd, tokens) = (3, 384, 258);
    let x = gen(Kind::Random, tokens, nh, hd, &mut Rng::new(5));
    let b = quantize_ok(s, nh, hd, &x, tokens);
    let bytes = b.to_bytes();
    #[rustfmt::skip]
    let want: [u8; 32] = [
        0x4B, 0x56, 0x51, 0x42, // magic "KVQB"
        1, 2, 0, 0, 0, 0,       // version, bits, axis, group kind, mode, format
        0, 0,                   // reserved
        0x80, 0, 0, 0,          // group size 128
        3, 0, 0, 0,             // n_kv_heads 3
        0x80, 0x01, 0, 0,       // head_dim 384 = 0x180
        0x02, 0x01, 0, 0,       // tokens 258 = 0x102
        0, 0, 0, 0,             // reserved
    ];
    assert_eq!(bytes[..32], want);
    assert_eq!(bytes.len(), 32 + b.bytes());
    assert_eq!(bytes[32..], [b.codes(), b.params()].concat());
    for off in 0..8 {
        let mut buf = vec![0xA5u8; off];
        buf.extend_from_slice(&bytes);
        assert_eq!(
            PackedBlock::from_bytes(&buf[off..]).unwrap(),
            b,
            "offset {off}"
        );
    }
    // Truncated inside the header, and corrupted high bytes of its fields.
    malformed(PackedBlock::from_bytes(&bytes[..17]), "17 bytes");
    malformed(PackedBlock::from_bytes(&[]), "0 bytes");
    let with = |i: usize, v: u8| {
        let mut x = bytes.clone();
        x[i] = v;
        PackedBlock::from_bytes(&x)
    };
    malformed(with(25, 2), "header says 514 tokens of 3x384");
    malformed(with(27, 1), "header says 16777474 tokens");
    malformed(with(21, 2), "header says 258 tokens of 3x640"); // 128 divides 640
    malformed(with(21, 0), "of 3x128, body has"); // a group of 128 fits, the sizes do not
    malformed(with(13, 1), "body has"); // groups of 384: fewer params
    malformed(with(14, 1), "65664"); // does not divide head_dim
    malformed(with(18, 1), "header says 258 tokens of 65539x384");
}

#[test]
fn bytes_malformed() {
    let s = scheme(
        3,
        Axis::PerToken,
        Group::Size(8),
        Mode::Asymmetric,
        ScaleFormat::F16,
    );
    let b = small_block(s);
    let good = b.to_bytes();
    // Every truncation, and one byte too many.
    for n in 0..good.len() {
        let r = PackedBlock::from_bytes(&good[..n]);
        assert!(
            matches!(r, Err(Error::Malformed { .. })),
            "truncated to {n}: {r:?}"
        );
    }
    malformed(PackedBlock::from_bytes(&good[..31]), "31 bytes");
    malformed(PackedBlock::from_bytes(&good[..40]), "3 tokens");
    malformed(
        PackedBlock::from_bytes(&[&good[..], &[0]].concat()),
        "body has",
    );

    let with = |i: usize, v: u8| {
        let mut x = good.clone();
        x[i] = v;
        PackedBlock::from_bytes(&x)
    };
    malformed(with(0, b'k'), "magic");
    malformed(with(3, b'C'), "magic");
    malformed(with(4, 0), "version 0");
    malformed(with(4, 2), "version 2");
    malformed(with(5, 0), "bits");
    malformed(with(5, 9), "bits");
    malformed(with(6, 2), "axis byte 2");
    malformed(with(7, 3), "group byte 3");
    malformed(with(8, 2), "mode byte 2");
    malformed(with(9, 3), "scale format byte 3");
    malformed(with(12, 12), "multiple of 8");
    malformed(with(12, 48), "48"); // does not divide head_dim 16
    malformed(with(16, 0), "n_kv_heads");
    malformed(with(20, 20), "head_dim");
    malformed(with(24, 4), "header says 4 tokens");
    malformed(with(9, 2), "body has"); // f32 params need twice the bytes

    // Per-channel with Group::Head in the header.
    let mut x = good.clone();
    x[6] = 1;
    x[7] = 1;
    malformed(PackedBlock::from_bytes(&x), "per-channel");
    // Symmetric 1-bit.
    let mut x = good.clone();
    x[5] = 1;
    x[8] = 1;
    malformed(PackedBlock::from_bytes(&x), "symmetric");

    // Bad params: NaN, inf, negative scale; NaN zero.
    let params_at = 32 + b.codes().len();
    let groups = 2; // 16 channels / 8 per group
    for (off, bits, part) in [
        (0usize, 0x7E00u16, "scale 0 of param set 0 is NaN"),
        (2, 0x7C00, "scale 1 of param set 0 is inf"),
        (4 * groups * 2 + 2, 0xBC00, "scale 1 of param set 2 is -1"),
        (
            4 * groups * 5 + 2 * groups,
            0x7E00,
            "zero 0 of param set 5 is NaN",
        ),
    ] {
        let mut x = good.clone();
        x[params_at + off..params_at + off + 2].copy_from_slice(&bits.to_le_bytes());
        malformed(PackedBlock::from_bytes(&x), part);
        // from_parts checks the same.
        let p = x[params_at..].to_vec();
        let e = PackedBlock::from_parts(*b.layout(), 3, b.codes().to_vec(), p).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Malformed {
                    op: "PackedBlock::from_parts",
                    ..
                }
            ),
            "{e:?}"
        );
    }
    // A negative zero point is fine.
    let mut x = good.clone();
    x[params_at + 2 * groups..params_at + 2 * groups + 2].copy_from_slice(&0xBC00u16.to_le_bytes());
    assert!(PackedBlock::from_bytes(&x).is_ok());
}

/// Every single-byte corruption of the header of small blocks is an error
/// or a valid block — never a panic.
#[test]
fn bytes_header_fuzz() {
    for s in [
        scheme(
            3,
            Axis::PerToken,
            Group::Size(8),
            Mode::Asymmetric,
            ScaleFormat::F16,
        ),
        scheme(
            4,
            Axis::PerChannel,
            Group::Size(8),
            Mode::Symmetric,
            ScaleFormat::F32,
        ),
        scheme(
            2,
            Axis::PerToken,
            Group::Vector,
            Mode::Asymmetric,
            ScaleFormat::Bf16,
        ),
    ] {
        let good = small_block(s).to_bytes();
        let mut n_ok = 0;
        for i in 0..32 {
            for v in 0..=255u8 {
                let mut x = good.clone();
                x[i] = v;
                let r = std::panic::catch_unwind(|| PackedBlock::from_bytes(&x));
                let r = r.unwrap_or_else(|_| panic!("{}: byte {i} = {v} panics", s.label()));
                match r {
                    Ok(b) => {
                        n_ok += 1;
                        assert_eq!(b.bytes() + 32, x.len());
                        assert_eq!(b.layout().bytes(b.tokens()), b.bytes());
                        let mut out =
                            vec![
                                0f32;
                                b.tokens() * b.layout().n_kv_heads() * b.layout().head_dim()
                            ];
                        b.dequantize_into(&mut out).unwrap();
                        let back = PackedBlock::from_bytes(&b.to_bytes()).unwrap();
                        assert_eq!(back, b);
                    }
                    Err(Error::Malformed { .. }) => {}
                    Err(e) => panic!("byte {i} = {v}: not Malformed: {e:?}"),
                }
            }
        }
        assert!(n_ok >= 32, "the unchanged value of each byte parses");
    }
}

/// Headers whose sizes multiply past `usize` are rejected, not a panic or an
/// out-of-bounds slice.
#[test]
fn bytes_header_huge_sizes() {
    let mut h = small_block(scheme(
        8,
        Axis::PerToken,
        Group::Size(8),
        Mode::Asymmetric,
        ScaleFormat::F32,
    ))
    .to_bytes()[..32]
        .to_vec();
    for (nh, hd, tokens) in [
        (1u32 << 31, 1u32 << 31, 2u32),
        (u32::MAX, 0xFFFF_FFF8, u32::MAX),
        (1 << 30, 1 << 30, 16),
        (1, 0xFFFF_FFF8, 0xFFFF_FFFF),
    ] {
        h[16..20].copy_from_slice(&nh.to_le_bytes());
        h[20..24].copy_from_slice(&hd.to_le_bytes());
        h[24..28].copy_from_slice(&tokens.to_le_bytes());
        let r = std::panic::catch_unwind(|| PackedBlock::from_bytes(&h));
        let r = r.unwrap_or_else(|_| panic!("{nh}x{hd}x{tokens} panics"));
        assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
    }
}
