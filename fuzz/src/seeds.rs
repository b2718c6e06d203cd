//! The built-in seed corpus (what `write-seeds` writes to `fuzz/corpus`).

use crate::input::Rng;
use kvq::{
    presets, Axis, CacheConfig, Codec, Group, KvCache, KvQuantizer, LayerCache, Mode, QuantScheme,
    ScaleFormat, UniformQuantizer,
};

pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "block" => blocks(),
        "load" => caches(),
        "gguf" => vec![gguf(false), gguf(true)],
        // Choice streams: random bytes of a few lengths.
        _ => {
            let mut rng = Rng::new(0x5eed ^ target.len() as u64);
            [16usize, 64, 256, 1024]
                .iter()
                .map(|&n| (0..n).map(|_| rng.next_u64() as u8).collect())
                .collect()
        }
    }
}

fn data(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.below(2001) as f32 - 1000.0) / 500.0)
        .collect()
}

fn blocks() -> Vec<Vec<u8>> {
    let mut rng = Rng::new(11);
    let s = |b, a, g| QuantScheme::new(b, a, g).unwrap();
    let schemes = [
        s(4, Axis::PerToken, Group::Size(32)),
        s(3, Axis::PerToken, Group::Head),
        s(2, Axis::PerChannel, Group::Size(16)),
        s(8, Axis::PerToken, Group::Vector)
            .with_mode(Mode::Symmetric)
            .unwrap(),
        s(5, Axis::PerToken, Group::Size(8)).with_scale_format(ScaleFormat::Bf16),
        s(1, Axis::PerChannel, Group::Size(8)).with_scale_format(ScaleFormat::F32),
        presets::q4_0(),
    ];
    schemes
        .iter()
        .enumerate()
        .map(|(i, &sc)| {
            let (n_kv, hd, t) = (1 + i % 2, 32, 3 + i);
            let q = UniformQuantizer::new(sc, n_kv, hd).unwrap();
            q.quantize(&data(&mut rng, n_kv * hd * t), t)
                .unwrap()
                .to_bytes()
        })
        .collect()
}

fn caches() -> Vec<Vec<u8>> {
    let mut rng = Rng::new(12);
    let (k4, v4) = presets::kivi(4).unwrap();
    let cfgs = [
        CacheConfig::new(1, 16),
        CacheConfig::new(1, 32)
            .keys(k4)
            .values(v4)
            .residual(4)
            .sinks(2),
        CacheConfig::new(2, 32)
            .key_codec(Codec::hadamard(presets::q8_0()))
            .values(presets::q4_0()),
        CacheConfig::new(1, 16)
            .keys(QuantScheme::new(2, Axis::PerChannel, Group::Size(8)).unwrap())
            .softmax_scale(0.5),
        // Codebooks: iq4_nl keys, rotated Lloyd-Max values.
        CacheConfig::new(1, 32)
            .key_codec(presets::iq4_nl())
            .value_codec(
                Codec::codebook(
                    QuantScheme::new(3, Axis::PerToken, Group::Size(16))
                        .unwrap()
                        .with_mode(kvq::Mode::Symmetric)
                        .unwrap(),
                    kvq::Levels::Gauss,
                )
                .with_rotation(kvq::Rotation::Hadamard),
            )
            .residual(2),
        // Fitted codebooks: their levels behind the layer header.
        CacheConfig::new(1, 32)
            .key_codec(Codec::codebook(
                QuantScheme::new(2, Axis::PerToken, Group::Size(16))
                    .unwrap()
                    .with_mode(kvq::Mode::Symmetric)
                    .unwrap(),
                kvq::Levels::Fitted(kvq::FittedLevels::new(&[-1.5, -0.4, 0.0, 0.9]).unwrap()),
            ))
            .value_codec(
                Codec::codebook(
                    QuantScheme::new(3, Axis::PerToken, Group::Size(32))
                        .unwrap()
                        .with_mode(kvq::Mode::Symmetric)
                        .unwrap(),
                    kvq::Levels::Fitted(
                        kvq::FittedLevels::new(&[-2.0, -1.3, -0.7, -0.2, 0.3, 0.8, 1.3, 2.1])
                            .unwrap(),
                    ),
                )
                .with_rotation(kvq::Rotation::Hadamard),
            ),
        // Pre-RoPE keys: a RoPE header behind the layer header.
        CacheConfig::new(1, 32)
            .keys(k4)
            .values(v4)
            .sinks(1)
            .pre_rope(
                kvq::Rope::new(5e5, 32, kvq::RopeStyle::Adjacent).with_scaling(
                    kvq::RopeScaling::Llama3 {
                        factor: 8.0,
                        low_freq_factor: 1.0,
                        high_freq_factor: 4.0,
                        original_max_position: 64,
                    },
                ),
            ),
        // Dense-and-sparse outliers: per-channel keys, per-token values.
        CacheConfig::new(2, 16)
            .key_codec(
                Codec::from(QuantScheme::new(2, Axis::PerChannel, Group::Size(8)).unwrap())
                    .with_outliers(0.02)
                    .unwrap(),
            )
            .value_codec(
                Codec::from(QuantScheme::new(3, Axis::PerToken, Group::Size(8)).unwrap())
                    .with_outliers(0.05)
                    .unwrap(),
            )
            .residual(3),
    ];
    let mut out = Vec::new();
    for (i, &cfg) in cfgs.iter().enumerate() {
        let mut c = LayerCache::new(cfg).unwrap();
        let w = cfg.n_kv_heads() * cfg.head_dim();
        let t = 5 + 7 * i;
        c.extend(&data(&mut rng, w * t), &data(&mut rng, w * t))
            .unwrap();
        let mut b = Vec::new();
        c.save(&mut b).unwrap();
        out.push(b);
    }
    let mut m = KvCache::new([cfgs[0], cfgs[1]]).unwrap();
    for l in 0..2 {
        let w = m.layer(l).config().n_kv_heads() * m.layer(l).config().head_dim();
        m.layer_mut(l)
            .extend(&data(&mut rng, w * 9), &data(&mut rng, w * 9))
            .unwrap();
    }
    let mut b = Vec::new();
    m.save(&mut b).unwrap();
    out.push(b);
    out
}

/// A small GGUF v3 file: metadata of several types (an array of strings
/// among them) and two tensors, f32 and q8_0.
fn gguf(aligned64: bool) -> Vec<u8> {
    let mut b = Vec::new();
    let put_str = |b: &mut Vec<u8>, s: &str| {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    };
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes()); // tensors
    b.extend_from_slice(&(4u64 + aligned64 as u64).to_le_bytes()); // metadata
    put_str(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    put_str(&mut b, "llama");
    put_str(&mut b, "llama.context_length");
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&2048u32.to_le_bytes());
    put_str(&mut b, "llama.rope.freq_base");
    b.extend_from_slice(&6u32.to_le_bytes());
    b.extend_from_slice(&10000f32.to_le_bytes());
    put_str(&mut b, "tokenizer.ggml.tokens");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&3u64.to_le_bytes());
    for t in ["a", "bc", "<s>"] {
        put_str(&mut b, t);
    }
    let align = if aligned64 {
        put_str(&mut b, "general.alignment");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&64u32.to_le_bytes());
        64
    } else {
        32
    };
    // f32 [8, 2] at 0; q8_0 [32, 1] (one 34-byte block) after it.
    put_str(&mut b, "w.f32");
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&8u64.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    put_str(&mut b, "w.q8");
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&32u64.to_le_bytes());
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&(align as u64).to_le_bytes());
    while b.len() % align != 0 {
        b.push(0);
    }
    for i in 0..16 {
        b.extend_from_slice(&(i as f32 * 0.25).to_le_bytes());
    }
    while b.len() % align != 0 {
        b.push(0);
    }
    b.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
    b.extend((0..32).map(|i| (i as i8 - 16) as u8));
    b
}
