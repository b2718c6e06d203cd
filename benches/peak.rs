//! One core's peak rate of the two operations the decode kernels are made
//! of: 512-bit FMAs and `vpermps` table lookups, each in twelve independent
//! chains (more than their latency times their throughput), so the loop
//! runs at the ports' rate. The floors in `docs/PERFORMANCE.md` come from
//! these rates.
//!
//! ```text
//! cargo bench --bench peak
//! ```

use std::time::Instant;

#[cfg(target_arch = "x86_64")]
mod zmm {
    use std::arch::x86_64::*;

    /// `n` rounds of twelve dependent-per-chain FMAs; the sum keeps the
    /// result alive.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fmas(n: u64) -> f32 {
        let mut a = [_mm512_set1_ps(1.0); 12];
        let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..n {
            for v in &mut a {
                *v = _mm512_fmadd_ps(*v, b, c);
            }
        }
        _mm512_reduce_add_ps(
            a.iter()
                .fold(_mm512_setzero_ps(), |s, v| _mm512_add_ps(s, *v)),
        )
    }

    /// `n` rounds of twelve dependent-per-chain `vpermps`.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn permutes(n: u64) -> f32 {
        let mut a = [_mm512_set1_epi32(3); 12];
        for _ in 0..n {
            for v in &mut a {
                *v = _mm512_castps_si512(_mm512_permutexvar_ps(*v, _mm512_castsi512_ps(*v)));
            }
        }
        let s = a
            .iter()
            .fold(_mm512_setzero_si512(), |s, v| _mm512_add_epi32(s, *v));
        _mm512_reduce_add_epi32(s) as f32
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            println!("skipped: this CPU has no AVX-512");
            return;
        }
        let n = 200_000_000u64;
        for _ in 0..3 {
            let t = Instant::now();
            // SAFETY: AVX-512F detected above.
            let r = unsafe { zmm::fmas(n) };
            let f = (12 * n) as f64 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            // SAFETY: AVX-512F detected above.
            let r2 = unsafe { zmm::permutes(n / 4) };
            let p = (3 * n) as f64 / t.elapsed().as_secs_f64();
            println!(
                "one core: {:.2}e9 512-bit FMAs/s, {:.2}e9 vpermps/s (checksums {r}, {r2})",
                f / 1e9,
                p / 1e9
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    println!("skipped: not x86_64");
}
