//! What the integration tests share: one seeded generator, the list of
//! backends under test, the kernel-against-oracle tolerance, and the
//! largest element-wise difference of two outputs.
//!
//! Each test binary compiles its own copy, so an item one of them does not
//! use is expected.
#![allow(dead_code)]

use kvq::Backend;

/// Relative tolerance of a SIMD kernel against the `f64` oracle, as a
/// fraction of the summed magnitudes (`Σ|q_c·k̂_c|`, `Σ|p_t·v̂_t|`).
pub const KERNEL_TOL: f64 = 1e-6;

/// xorshift64*, seeded through a multiply so that small and zero seeds
/// give unrelated streams: deterministic data without a rand dependency.
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// One of `xs`, uniformly.
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in `[-1, 1)`.
    pub fn f(&mut self) -> f32 {
        self.unit() * 2.0 - 1.0
    }
    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }
    /// `n` values uniform in `[-1, 1)`.
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
    /// Roughly standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.unit()).sum();
        (s - 2.0) * 1.732
    }
    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn unit64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    pub fn normal64(&mut self) -> f64 {
        let u1 = self.unit64().max(1e-300);
        let u2 = self.unit64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// The environment variable that turns skips into failures. `1`: every
/// skip fails, as `.ci/run` sets it on a CPU with AVX-512 VNNI, where
/// every backend and the fetched assets are present, so a check that
/// cannot run is a defect. `assets`: a skip for want of an asset fails,
/// one for want of a CPU feature ([`skip_cpu`]) stays a skip, as `.ci/run`
/// sets it on a CPU without AVX-512 VNNI.
pub const REQUIRE_ALL: &str = "KVQ_REQUIRE_ALL";

/// Skip a check that cannot run here for want of a file or another input:
/// a failure when [`REQUIRE_ALL`] is `1` or `assets`, otherwise a line on
/// stderr (`cargo test -- --nocapture` shows it).
pub fn skip(what: &str) {
    let v = std::env::var(REQUIRE_ALL).unwrap_or_default();
    if v == "1" || v == "assets" {
        panic!("{REQUIRE_ALL}={v} but this check cannot run: {what}");
    }
    eprintln!("SKIPPED: {what}");
}

/// Skip a check this CPU cannot run (a backend, an instruction set): a
/// failure when [`REQUIRE_ALL`] is `1`, otherwise a line on stderr.
pub fn skip_cpu(what: &str) {
    if std::env::var(REQUIRE_ALL).is_ok_and(|v| v == "1") {
        panic!("{REQUIRE_ALL}=1 but this CPU cannot run this check: {what}");
    }
    eprintln!("SKIPPED: {what}");
}

/// Every backend this CPU runs, in `Backend::ALL` order; each one it
/// lacks is a [`skip_cpu`].
pub fn backends() -> Vec<Backend> {
    let available = Backend::available();
    assert!(available.contains(&Backend::Portable));
    assert!(available.contains(&Backend::detect()));
    for &b in Backend::ALL {
        if !available.contains(&b) {
            skip_cpu(&format!(
                "backend {}: this CPU does not support it",
                b.name()
            ));
        }
    }
    Backend::ALL
        .iter()
        .copied()
        .filter(|b| available.contains(b))
        .collect()
}

/// The largest `|a_i − b_i|` (the lengths must agree).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// What a cache of `cfg` built by appending the raw rows `ks` / `vs`
/// (`[tokens, n_kv_heads·head_dim]`) in order hands attention, derived
/// from the configuration alone, not from the cache's buffers: sinks
/// exact, then the sealed region quantized by [`kvq::Codec::roundtrip`]
/// (whole blocks of `block_tokens()` for per-channel schemes, every token
/// past the window for per-token ones), then the exact tail of at least
/// `residual` tokens.
///
/// A token packed into the wrong slot, sealed too early or too late, or a
/// sink or tail row lost shows up as a difference from this shadow. Keys
/// before RoPE are compared as stored (the cache rotates them in its
/// scores only).
pub fn placed(cfg: &kvq::CacheConfig, ks: &[f32], vs: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (n_kv, hd) = (cfg.n_kv_heads(), cfg.head_dim());
    let side = |codec: Option<kvq::Codec>, raw: &[f32]| -> Vec<f32> {
        let w = n_kv * hd;
        assert_eq!(raw.len() % w, 0);
        let mut out = raw.to_vec();
        let Some(codec) = codec else { return out };
        let len = raw.len() / w;
        let sinks = cfg.sink_len().min(len);
        let after = len - sinks;
        let unit = codec.scheme().layout(n_kv, hd).unwrap().block_tokens();
        let res = cfg.residual_len();
        let sealed = if after >= res.saturating_add(unit) {
            (after - res) / unit * unit
        } else {
            0
        };
        let region = sinks * w..(sinks + sealed) * w;
        let q = codec.roundtrip(&raw[region.clone()], n_kv, hd).unwrap();
        out[region].copy_from_slice(&q);
        out
    };
    (
        side(cfg.key_codec_spec(), ks),
        side(cfg.value_codec_spec(), vs),
    )
}

/// `c.attend(q, n_q, …)` into a new output.
pub fn attend(c: &kvq::LayerCache, q: &[f32], n_q: usize) -> Vec<f32> {
    let mut out = vec![0.0; n_q * c.config().head_dim()];
    c.attend(q, n_q, &mut out).unwrap();
    out
}

/// The checksum as `docs/FORMAT.md` section 7 defines it, written from
/// the document.
pub fn checksum(b: &[u8]) -> u64 {
    const P: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in b.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(P);
    }
    (h ^ b.len() as u64).wrapping_mul(P)
}

/// Re-seal edited bytes with a matching checksum, so the content checks
/// (not only the checksum) are what rejects them.
pub fn reseal(b: &mut [u8]) {
    let n = b.len() - 8;
    let c = checksum(&b[..n]);
    b[n..].copy_from_slice(&c.to_le_bytes());
}

/// A codec's fused scores and weighted sums on every backend against the
/// oracle: its own decode of `head`, then `f64` sums. The tolerance is
/// [`KERNEL_TOL`] (2e-2 for the int8 kernels, which round the query) of
/// the terms' magnitude, each element's term bounded by `bound` (the
/// decoded value's magnitude when `None`).
pub fn check_codec_kernels(
    codec: &dyn kvq::KvCodec,
    head: &kvq::PackedHead<'_>,
    bound: Option<&[f64]>,
    rng: &mut Rng,
    nq: usize,
    what: &str,
) {
    let hd = codec.layout().head_dim();
    let t = head.tokens();
    let mut dec = vec![0f32; t * hd];
    codec.decode(head, &mut dec);
    let own: Vec<f64> = dec.iter().map(|&x| f64::from(x.abs())).collect();
    let bound = bound.unwrap_or(&own);
    let q: Vec<f32> = (0..nq * hd).map(|_| rng.f()).collect();
    let pr: Vec<f32> = (0..nq * t).map(|_| rng.unit()).collect();
    let out0: Vec<f32> = (0..nq * hd).map(|_| rng.f()).collect();
    let tol = if codec.spec().int8_kernels() {
        2e-2
    } else {
        KERNEL_TOL
    };
    for b in backends() {
        let mut s = vec![f32::NAN; nq * t];
        codec.scores(b, head, &q, &mut s).unwrap();
        let mut ws = out0.clone();
        codec.weighted_sum(b, head, &pr, &mut ws).unwrap();
        for i in 0..nq {
            for tt in 0..t {
                let (want, mag) = (0..hd).fold((0f64, 0f64), |(w, m), c| {
                    let qc = f64::from(q[i * hd + c]);
                    (
                        w + qc * f64::from(dec[tt * hd + c]),
                        m + qc.abs() * bound[tt * hd + c],
                    )
                });
                let got = f64::from(s[i * t + tt]);
                assert!(
                    (got - want).abs() <= tol * mag + 1e-30,
                    "{} scores {what}: query {i} token {tt}: {got} vs {want}",
                    b.name()
                );
            }
            for c in 0..hd {
                let o = f64::from(out0[i * hd + c]);
                let (want, mag) = (0..t).fold((o, o.abs()), |(w, m), tt| {
                    let p = f64::from(pr[i * t + tt]);
                    (
                        w + p * f64::from(dec[tt * hd + c]),
                        m + p.abs() * bound[tt * hd + c],
                    )
                });
                let got = f64::from(ws[i * hd + c]);
                assert!(
                    (got - want).abs() <= tol * mag + 1e-30,
                    "{} weighted_sum {what}: query {i} channel {c}: {got} vs {want}",
                    b.name()
                );
            }
        }
    }
}
