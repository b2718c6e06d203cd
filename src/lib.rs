//! # kvq — KV-cache quantization for LLM inference
//!
//! A smaller KV cache that is also faster to decode from: packed formats of
//! 1–8 bits, per-token or per-channel groups, and attention kernels that read
//! the packed codes directly (no dequantized copy of the cache, ever).
//!
//! * [`QuantScheme`] — bits, [`Axis`], [`Group`], [`Mode`], [`ScaleFormat`];
//!   bound to a shape it is a [`Layout`] with exact byte accounting.
//! * [`KvQuantizer`] / [`UniformQuantizer`] — quantize `[tokens, n_kv_heads,
//!   head_dim]` blocks of `f32`, `f16` or `bf16`, as slices or `ndarray`
//!   views, into a [`PackedBlock`].
//! * [`kernels`] — `scores` (`q·Kᵀ`) and `weighted_sum` (`p·V`) straight from
//!   packed codes, with a scalar oracle and SIMD backends ([`Backend`]).
//! * [`LayerCache`] / [`KvCache`] — the streaming cache: append (slices or
//!   `ndarray` views), residual window, attention sinks, GQA, fused decode
//!   and causal-block attention.
//! * [`metrics`] — error where the cache is used (logits, attention KL,
//!   attention output), not only reconstruction error.
//! * [`plan`] — the memory model of a model's cache and a K/V bit-budget
//!   planner.
//!
//! # The math
//!
//! Every stored element is `x̂ = scale·code + zero`, `code` an unsigned
//! integer of `bits` bits, one `(scale, zero)` per group (see [`quant`] for
//! how they are chosen: the scale is rounded *up* and the zero *down* into
//! the scale format, so every element is within half a step). *Effective
//! bits* count the scales: `bits + (bits of scale + zero) / group size`; K6/V4
//! with an f16 scale and zero per 64 is `(6 + 4)/2 + 32/64 = 5.5` bits, 2.91x
//! smaller than f16.
//!
//! # Example: KIVI-style keys and values at 4 bits
//! ```
//! use kvq::{Axis, Group, KvQuantizer, QuantScheme, UniformQuantizer};
//! let (n_kv_heads, head_dim, tokens) = (2, 64, 64);
//! // Keys per-channel (groups of 32 tokens), values per-token (groups of 32 channels).
//! let kq = UniformQuantizer::new(QuantScheme::new(4, Axis::PerChannel, Group::Size(32))?, n_kv_heads, head_dim)?;
//! let vq = UniformQuantizer::new(QuantScheme::new(4, Axis::PerToken, Group::Size(32))?, n_kv_heads, head_dim)?;
//! let k: Vec<f32> = (0..tokens * n_kv_heads * head_dim).map(|i| (i as f32).sin()).collect();
//! let v: Vec<f32> = (0..tokens * n_kv_heads * head_dim).map(|i| (i as f32).cos()).collect();
//! let (pk, pv) = (kq.quantize(&k, tokens)?, vq.quantize(&v, tokens)?);
//! let bits = (kq.effective_bits() + vq.effective_bits()) / 2.0;
//! println!("{bits} effective bits, {:.2}x smaller than f16", 16.0 / bits);
//! assert_eq!(bits, 5.0);
//! assert_eq!((pk.bytes() + pv.bytes()) * 8, (bits * (2 * k.len()) as f64) as usize);
//! # Ok::<(), kvq::Error>(())
//! ```
//!
//! # Example: scores from packed keys
//! ```
//! use kvq::{kernels, presets, KvQuantizer, UniformQuantizer};
//! let (keys, _) = presets::kivi(4)?;
//! let q = UniformQuantizer::new(keys, 1, 128)?;
//! let k: Vec<f32> = (0..256 * 128).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
//! let packed = q.quantize(&k, 256)?;
//! let query: Vec<f32> = (0..128).map(|i| (i as f32 * 0.1).cos()).collect();
//! let mut logits = vec![0.0; 256];
//! kernels::scores(&packed.head(0), &query, &mut logits)?; // no dequantized copy
//! let k_hat = q.roundtrip(&k, 256)?;
//! let want: f32 = k_hat[..128].iter().zip(&query).map(|(a, b)| a * b).sum();
//! assert!((logits[0] - want).abs() < 1e-3);
//! # Ok::<(), kvq::Error>(())
//! ```
//!
//! # Errors and non-finite values
//!
//! Every failure a caller can cause — a bad scheme, a shape that does not
//! fit, a wrong buffer length, malformed bytes — is an [`Error`]. Non-finite
//! input (NaN, ±inf) is **rejected**, never quantized: the error names the
//! token, head and channel, and nothing of the call is kept (a cache append
//! is all-or-nothing). Panics are reserved for internal invariants and
//! indexing (e.g. [`PackedBlock::head`] past the last head), and say so in
//! `# Panics` sections.
//!
//! # Hardware
//!
//! | backend | CPUs | used for |
//! |---------|------|----------|
//! | [`Backend::Portable`] | every CPU | reference speed; bit-identical results everywhere |
//! | [`Backend::Avx2`] | x86-64 with AVX2 + FMA + F16C | scores and weighted sums |
//! | [`Backend::Avx512`] | x86-64 with AVX-512 F/BW/VL | scores and weighted sums |
//!
//! The backend is detected once at run time ([`Backend::detect`]); no
//! `-C target-cpu=native` needed. Force one with `KVQ_BACKEND=portable` or
//! [`CacheConfig::backend`]. `unsafe` code lives only in the
//! `kernels/x86_64` files.
#![deny(missing_docs)]

pub mod cache;
#[cfg(feature = "candle")]
pub mod candle;
pub mod element;
pub mod error;
pub mod kernels;
pub mod metrics;
#[cfg(feature = "mistralrs")]
pub mod mistralrs;
pub mod pack;
pub mod plan;
pub mod quant;
pub mod scheme;
mod simd;
pub mod store;
mod views;

pub use cache::{CacheBytes, CacheConfig, KvCache, LayerCache, Rope, RopeScaling, RopeStyle};
pub use element::Element;
pub use error::{Error, Result};
pub use kernels::Backend;
pub use metrics::{AttentionErrors, MetricsConfig};
pub use plan::{MemoryModel, Planner};
pub use quant::{
    Codec, FittedLevels, Hadamard, KvCodec, KvQuantizer, Levels, Rotation, UniformQuantizer,
    OUTLIER_LIMIT,
};
pub use scheme::{
    presets, Axis, Group, Layout, Mode, QuantScheme, Rounding, ScaleFormat, OUTLIER_BYTES,
};
pub use store::{PackedBlock, PackedHead};

/// The code blocks of `docs/INTEGRATION.md`, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/INTEGRATION.md")]
pub struct IntegrationGuideDoctests;
