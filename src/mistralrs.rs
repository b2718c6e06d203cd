//! mistral.rs's compressed-cache trait,
//! [`mistralrs_kv_cache::CompressedKVCache`], over kvq
//! layer caches (feature `mistralrs`).
//!
//! [`KvqCache`] holds one [`LayerCache`] per layer behind its own lock, so
//! calls for different layers run in parallel as the trait asks. Decode
//! steps are fused: the new token is quantized into the cache and
//! attention runs on the packed bytes ([`DecodeOutput::Fused`]). Prefill
//! stores the prompt and hands back what the cache holds, decoded, for
//! the engine's own attention over the prompt (the trait's contract).
//!
//! One `KvqCache` is one sequence: tensors are `[1, heads, tokens,
//! head_dim]` (batch 1), on the CPU, `f32`/`f16`/`bf16`.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use kvq::mistralrs::KvqCache;
//! use kvq::{presets, CacheConfig};
//! use mistralrs_kv_cache::{AttendConfig, CompressedKVCache, DecodeOutput};
//! let (keys, values) = presets::kivi(4)?;
//! let cache = KvqCache::uniform(2, CacheConfig::new(2, 64).keys(keys).values(values))?;
//! let dev = Device::Cpu;
//! let t = |heads, n| Tensor::randn(0f32, 1.0, (1, heads, n, 64), &dev).unwrap();
//! let kv = cache.prefill(0, &t(2, 16), &t(2, 16), &t(4, 16)).unwrap();
//! assert_eq!(kv.k.dims(), &[1, 2, 16, 64]);
//! let cfg = AttendConfig { softmax_scale: 0.125, n_kv_groups: 2 };
//! let DecodeOutput::Fused(out) = cache.decode(0, &t(2, 1), &t(2, 1), &t(4, 1), &cfg).unwrap() else {
//!     unreachable!("kvq decodes fused")
//! };
//! assert_eq!(out.dims(), &[1, 4, 1, 64]);
//! assert_eq!(cache.seq_len(0), 17);
//! # Ok::<(), kvq::Error>(())
//! ```

use std::sync::{Mutex, MutexGuard};

use candle_core::Tensor;
use mistralrs_kv_cache::{AttendConfig, CompressedKVCache, DecodeOutput, DequantResult};

use crate::cache::{CacheConfig, LayerCache, PagePool};
use crate::error::{Error, Result};

/// A whole model's cache for one sequence, as mistral.rs's
/// [`CompressedKVCache`].
#[derive(Debug)]
pub struct KvqCache {
    layers: Vec<Mutex<LayerCache>>,
}

impl KvqCache {
    /// One layer cache per configuration (mixed formats per layer).
    ///
    /// # Errors
    /// As [`LayerCache::new`] for any layer.
    pub fn new(configs: impl IntoIterator<Item = CacheConfig>) -> Result<Self> {
        let layers = configs
            .into_iter()
            .map(|c| LayerCache::new(c).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvqCache { layers })
    }

    /// [`new`](Self::new) with every layer's pages from `pool`: many
    /// sequences' caches under one memory limit ([`PagePool`]; an append
    /// beyond it is an error that changes nothing).
    ///
    /// # Errors
    /// As [`LayerCache::new`] for any layer.
    pub fn new_in(configs: impl IntoIterator<Item = CacheConfig>, pool: &PagePool) -> Result<Self> {
        let layers = configs
            .into_iter()
            .map(|c| LayerCache::new_in(c, pool).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvqCache { layers })
    }

    /// `n_layers` layers of the same configuration.
    ///
    /// # Errors
    /// As [`LayerCache::new`].
    pub fn uniform(n_layers: usize, config: CacheConfig) -> Result<Self> {
        Self::new(std::iter::repeat_n(config, n_layers))
    }

    /// Layer `l`'s cache, locked (for `truncate`, `fork`, `save` and the
    /// rest of [`LayerCache`]'s API).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when there is no layer `l`.
    pub fn layer(&self, l: usize) -> Result<MutexGuard<'_, LayerCache>> {
        self.lock("layer", l)
    }

    fn lock(&self, op: &'static str, l: usize) -> Result<MutexGuard<'_, LayerCache>> {
        let m = self.layers.get(l).ok_or_else(|| Error::InvalidArgument {
            op,
            what: format!("layer {l} of {}", self.layers.len()),
        })?;
        // A panic inside a layer's call cannot leave it half-written:
        // every LayerCache call either completes or leaves it untouched.
        Ok(m.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

fn candle(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

impl CompressedKVCache for KvqCache {
    fn prefill(
        &self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        _q: &Tensor,
    ) -> candle_core::Result<DequantResult> {
        let mut c = self.lock("prefill", layer).map_err(candle)?;
        c.append_tensor(k, v).map_err(candle)?;
        let (kd, vd) = (
            c.keys_tensor().map_err(candle)?,
            c.values_tensor().map_err(candle)?,
        );
        Ok(DequantResult {
            k: kd.to_dtype(k.dtype())?,
            v: vd.to_dtype(v.dtype())?,
            logit_bias: None,
        })
    }

    fn decode(
        &self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        q: &Tensor,
        config: &AttendConfig,
    ) -> candle_core::Result<DecodeOutput> {
        let op = "decode";
        let mut c = self.lock(op, layer).map_err(candle)?;
        // Everything about the query is checked before the token goes in,
        // so a rejected call leaves the cache as it was.
        let n_kv = c.config().n_kv_heads();
        let want_heads = n_kv * config.n_kv_groups;
        let heads = q.dims().get(1).copied().unwrap_or(0);
        let scale = c.softmax_scale();
        let close = (config.softmax_scale - scale).abs() <= 1e-6 * scale;
        if heads != want_heads || !close || q.dims().first() != Some(&1) {
            return Err(candle(Error::InvalidArgument {
                op,
                what: format!(
                    "query shape {:?} with {} groups and softmax scale {} for a layer of {n_kv} KV \
                     heads and scale {scale} (set CacheConfig::softmax_scale to the model's)",
                    q.dims(),
                    config.n_kv_groups,
                    config.softmax_scale
                ),
            }));
        }
        let q32 = q
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if let Some(i) = q32.iter().position(|x| !x.is_finite()) {
            return Err(candle(Error::NonFinite {
                op,
                token: 0,
                head: i / c.config().head_dim(),
                channel: i % c.config().head_dim(),
                value: q32[i],
            }));
        }
        c.append_tensor(k, v).map_err(candle)?;
        Ok(DecodeOutput::Fused(c.attend_tensor(q).map_err(candle)?))
    }

    fn seq_len(&self, layer: usize) -> usize {
        self.lock("seq_len", layer).map_or(0, |c| c.len())
    }

    fn reset(&self) -> candle_core::Result<()> {
        for l in 0..self.layers.len() {
            self.lock("reset", l).map_err(candle)?.clear();
        }
        Ok(())
    }

    fn memory_usage(&self) -> usize {
        (0..self.layers.len())
            .filter_map(|l| self.lock("memory_usage", l).ok())
            .map(|c| c.bytes().total())
            .sum()
    }
}
