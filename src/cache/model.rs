//! The caches of all layers of a model.

use super::*;

/// The caches of all layers of a model; each layer may have its own schemes
/// (per-layer mixed precision).
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(super) layers: Vec<LayerCache>,
}

impl KvCache {
    /// One [`LayerCache`] per configuration.
    ///
    /// # Errors
    /// As [`LayerCache::new`]; [`Error::InvalidShape`] for no layers.
    pub fn new(configs: impl IntoIterator<Item = CacheConfig>) -> Result<Self> {
        Self::build(configs, None)
    }

    /// [`new`](Self::new) with every layer's pages from `pool` (one
    /// sequence of a serving engine; see [`PagePool`]).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    ///
    /// # Example
    /// ```
    /// use kvq::{cache::PagePool, presets, CacheConfig, KvCache};
    /// let (keys, values) = presets::kivi(4)?;
    /// let cfg = CacheConfig::new(2, 64).keys(keys).values(values);
    /// let pool = PagePool::new(256, Some(30 * 4 * cfg.page_bytes(256)?))?;
    /// let mut seq = KvCache::new_in(std::iter::repeat_n(cfg, 30), &pool)?;
    /// let row = vec![0.5f32; 128];
    /// for _ in 0..300 {
    ///     for l in 0..30 {
    ///         seq.layer_mut(l).append(&row, &row)?;
    ///     }
    /// }
    /// // Two pages of keys and two of values per layer.
    /// assert_eq!(pool.stats().pages, 30 * 4);
    /// # Ok::<(), kvq::Error>(())
    /// ```
    pub fn new_in(configs: impl IntoIterator<Item = CacheConfig>, pool: &PagePool) -> Result<Self> {
        Self::build(configs, Some(pool))
    }

    fn build(
        configs: impl IntoIterator<Item = CacheConfig>,
        pool: Option<&PagePool>,
    ) -> Result<Self> {
        let layers = configs
            .into_iter()
            .map(|c| match pool {
                Some(p) => LayerCache::new_in(c, p),
                None => LayerCache::new(c),
            })
            .collect::<Result<Vec<_>>>()?;
        if layers.is_empty() {
            return Err(Error::InvalidShape {
                op: "KvCache::new",
                what: "a cache needs at least one layer".into(),
            });
        }
        Ok(KvCache { layers })
    }
    /// `n_layers` layers with the same configuration.
    ///
    /// # Errors
    /// As [`KvCache::new`].
    pub fn uniform(n_layers: usize, cfg: CacheConfig) -> Result<Self> {
        Self::new(std::iter::repeat_n(cfg, n_layers))
    }
    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    /// Layer `i`.
    ///
    /// # Panics
    /// If `i >= n_layers()`.
    pub fn layer(&self, i: usize) -> &LayerCache {
        &self.layers[i]
    }
    /// Layer `i`, mutable.
    ///
    /// # Panics
    /// If `i >= n_layers()`.
    pub fn layer_mut(&mut self, i: usize) -> &mut LayerCache {
        &mut self.layers[i]
    }
    /// All layers.
    pub fn layers(&self) -> &[LayerCache] {
        &self.layers
    }
    /// Bytes held by all layers.
    pub fn bytes(&self) -> CacheBytes {
        self.layers
            .iter()
            .map(LayerCache::bytes)
            .fold(CacheBytes::default(), |a, b| a + b)
    }
    /// Bits per cached element over all layers (0 when empty).
    pub fn effective_bits(&self) -> f64 {
        let elems: usize = self
            .layers
            .iter()
            .map(|l| 2 * l.len() * l.cfg.n_kv_heads * l.cfg.head_dim)
            .sum();
        if elems == 0 {
            0.0
        } else {
            8.0 * self.bytes().total() as f64 / elems as f64
        }
    }
    /// A copy sharing every layer's packed tokens ([`LayerCache::fork`]).
    pub fn fork(&self) -> KvCache {
        KvCache {
            layers: self.layers.iter().map(LayerCache::fork).collect(),
        }
    }
    /// Keep the first `len` tokens of every layer
    /// ([`LayerCache::truncate`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a layer holds fewer than `len`
    /// tokens. No layer changes on error.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let op = "KvCache::truncate";
        let cuts = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if len > l.len() {
                    return Err(Error::InvalidArgument {
                        op,
                        what: format!(
                            "cannot keep {len} tokens of layer {i}, which holds {}",
                            l.len()
                        ),
                    });
                }
                l.prepare_cut(op, len)
            })
            .collect::<Result<Vec<_>>>()?;
        for (l, c) in self.layers.iter_mut().zip(cuts) {
            l.apply_cut(c);
        }
        Ok(())
    }
    /// Forget all tokens in every layer.
    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(LayerCache::clear);
    }
}
