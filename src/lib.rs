//! # kvq — KV-cache quantization for LLM inference
//!
//! A smaller KV cache that is also faster to decode from: packed formats of
//! 1–8 bits, per-token or per-channel groups, and attention kernels that read
//! the packed codes directly (no dequantized copy).
//!
//! Every stored element is `x̂ = scale·code + zero` (see [`quant`] for how
//! scale and zero are chosen). *Effective bits* count the overhead of the
//! scales: `bits + (bits of scale + zero) / group size`.
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
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod cache;
pub mod element;
pub mod error;
pub mod kernels;
pub mod metrics;
pub mod pack;
pub mod plan;
pub mod quant;
pub mod scheme;
pub mod store;

pub use cache::{CacheBytes, CacheConfig, KvCache, LayerCache};
pub use element::Element;
pub use error::{Error, Result};
pub use kernels::Backend;
pub use quant::{KvQuantizer, UniformQuantizer};
pub use scheme::{presets, Axis, Group, Layout, Mode, QuantScheme, ScaleFormat};
pub use store::{PackedBlock, PackedHead};

/// The code blocks of `docs/INTEGRATION.md`, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/INTEGRATION.md")]
pub struct IntegrationGuideDoctests;
