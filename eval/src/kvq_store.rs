//! [`KvStore`] backed by kvq's quantized cache: K/V go through
//! [`kvq::KvCache`] exactly where an engine stores them (post-RoPE keys,
//! `v_proj` values), and attention runs on the fused kernels.

use crate::model::{Config, KvStore, RoundTrip};
use kvq::{CacheConfig, Codec, KvCache, Levels, QuantScheme, Rotation};

/// A codec's quantize-dequantize round trip, for [`crate::model::Hooks`]:
/// quantizes keys at another point of the layer than the cache's.
#[derive(Debug, Clone, Copy)]
pub struct CodecRoundTrip(pub Codec);

impl RoundTrip for CodecRoundTrip {
    fn round_trip(
        &self,
        _layer: usize,
        _pos0: usize,
        x: &mut [f32],
        _n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), String> {
        let y = self
            .0
            .roundtrip(x, n_kv_heads, head_dim)
            .map_err(|e| e.to_string())?;
        x.copy_from_slice(&y);
        Ok(())
    }
}

/// Schemes and windows of a quantized cache (`None` keeps that tensor in
/// full precision).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheSpec {
    /// Key scheme.
    pub keys: Option<QuantScheme>,
    /// Value scheme.
    pub values: Option<QuantScheme>,
    /// Full-precision residual window (newest tokens).
    pub residual: usize,
    /// Attention-sink tokens kept exact.
    pub sinks: usize,
    /// The rotation around the key scheme ([`Codec::with_rotation`]).
    pub key_rotation: Rotation,
    /// The rotation around the value scheme.
    pub value_rotation: Rotation,
    /// Attention through the opt-in int8 kernels
    /// ([`CacheConfig::int8_kernels`]).
    pub int8: bool,
    /// A codebook on the key scheme's storage ([`Codec::codebook`];
    /// `None`: the uniform grid).
    pub key_levels: Option<Levels>,
    /// A codebook on the value scheme's storage.
    pub value_levels: Option<Levels>,
    /// Keys stored before RoPE, rotated by the cache when it scores
    /// ([`CacheConfig::pre_rope`]; needs the model's RoPE, so build the
    /// store with [`KvqStore::for_model`]).
    pub pre_rope: bool,
    /// The share of each key param set kept as dense-and-sparse outliers
    /// ([`Codec::with_outliers`]; 0: none).
    pub key_outliers: f64,
    /// The same for values.
    pub value_outliers: f64,
}

impl CacheSpec {
    /// Full precision everywhere.
    pub const FULL: CacheSpec = CacheSpec {
        keys: None,
        values: None,
        residual: 0,
        sinks: 0,
        key_rotation: Rotation::None,
        value_rotation: Rotation::None,
        int8: false,
        key_levels: None,
        value_levels: None,
        pre_rope: false,
        key_outliers: 0.0,
        value_outliers: 0.0,
    };

    /// The key codec (`None`: full precision).
    pub fn key_codec(&self) -> Option<Codec> {
        self.keys.map(|s| {
            outliers(codec(s, self.key_levels), self.key_outliers).with_rotation(self.key_rotation)
        })
    }

    /// The value codec (`None`: full precision).
    pub fn value_codec(&self) -> Option<Codec> {
        self.values.map(|s| {
            outliers(codec(s, self.value_levels), self.value_outliers)
                .with_rotation(self.value_rotation)
        })
    }
}

/// `c` with a share `f` of outliers (none for 0).
///
/// # Panics
/// For a share outside `[0, 0.5]`: specs are written in code.
fn outliers(c: Codec, f: f64) -> Codec {
    if f == 0.0 {
        c
    } else {
        c.with_outliers(f).expect("an outlier share in (0, 0.5]")
    }
}

fn codec(s: QuantScheme, levels: Option<Levels>) -> Codec {
    match levels {
        None => Codec::uniform(s),
        Some(l) => Codec::codebook(s, l),
    }
}

fn layer_config(n_kv_heads: usize, head_dim: usize, spec: &CacheSpec) -> CacheConfig {
    CacheConfig::new(n_kv_heads, head_dim)
        .key_codec(spec.key_codec())
        .value_codec(spec.value_codec())
        .residual(spec.residual)
        .sinks(spec.sinks)
        .int8_kernels(spec.int8)
}

/// A kvq cache for every layer of a model.
#[derive(Debug, Clone)]
pub struct KvqStore {
    cache: KvCache,
}

impl KvqStore {
    /// One layer cache per model layer, all with `spec` (which must keep
    /// keys post-RoPE: see [`KvqStore::for_model`]).
    ///
    /// # Errors
    /// As [`KvCache::uniform`]; [`kvq::Error::InvalidConfig`] for a
    /// pre-RoPE `spec`.
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        spec: CacheSpec,
    ) -> Result<Self, kvq::Error> {
        if spec.pre_rope {
            return Err(kvq::Error::InvalidConfig {
                op: "KvqStore::new",
                what: "pre-RoPE keys need the model's RoPE (KvqStore::for_model)".into(),
            });
        }
        Ok(KvqStore {
            cache: KvCache::uniform(n_layers, layer_config(n_kv_heads, head_dim, &spec))?,
        })
    }

    /// One layer cache per layer of the model `cfg`, all with `spec`; with
    /// `spec.pre_rope` each layer rotates its keys with that layer's RoPE
    /// ([`Config::kvq_rope`]).
    ///
    /// # Errors
    /// As [`KvCache::new`].
    pub fn for_model(cfg: &Config, spec: CacheSpec) -> Result<Self, kvq::Error> {
        let base = layer_config(cfg.n_kv_heads, cfg.head_dim, &spec);
        let layers =
            (0..cfg.n_layers).map(|l| base.pre_rope(spec.pre_rope.then(|| cfg.kvq_rope(l))));
        Ok(KvqStore {
            cache: KvCache::new(layers)?,
        })
    }

    /// One layer cache per layer of the model `cfg` with its own key and
    /// value codecs (`layers[l]`, `None`: full precision) and `spec`'s
    /// windows and RoPE placement (its codecs are ignored): a per-layer
    /// allocation such as [`kvq::Planner::plan_per_layer`] makes.
    ///
    /// # Errors
    /// As [`KvCache::new`]; [`kvq::Error::InvalidConfig`] when `layers` does
    /// not have one entry per layer.
    pub fn for_model_layers(
        cfg: &Config,
        spec: CacheSpec,
        layers: &[(Option<Codec>, Option<Codec>)],
    ) -> Result<Self, kvq::Error> {
        if layers.len() != cfg.n_layers {
            return Err(kvq::Error::InvalidConfig {
                op: "KvqStore::for_model_layers",
                what: format!(
                    "{} layer codecs for a model of {} layers",
                    layers.len(),
                    cfg.n_layers
                ),
            });
        }
        let base = layer_config(cfg.n_kv_heads, cfg.head_dim, &spec);
        let configs = layers.iter().enumerate().map(|(l, &(k, v))| {
            base.key_codec(k)
                .value_codec(v)
                .pre_rope(spec.pre_rope.then(|| cfg.kvq_rope(l)))
        });
        Ok(KvqStore {
            cache: KvCache::new(configs)?,
        })
    }

    /// The underlying cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }
}

impl KvStore for KvqStore {
    fn pre_rope_keys(&self, layer: usize) -> bool {
        self.cache.layer(layer).config().rope().is_some()
    }

    fn extend(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), String> {
        self.cache
            .layer_mut(layer)
            .extend(k, v)
            .map_err(|e| e.to_string())
    }

    fn attend_causal(
        &mut self,
        layer: usize,
        q: &[f32],
        n_q_heads: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<(), String> {
        self.cache
            .layer(layer)
            .attend_causal(q, n_q_heads, out, window)
            .map_err(|e| e.to_string())
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        n_q_heads: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<(), String> {
        self.cache
            .layer(layer)
            .attend_causal(q, n_q_heads, out, window)
            .map_err(|e| e.to_string())
    }

    fn reset(&mut self) {
        self.cache.clear();
    }
}
