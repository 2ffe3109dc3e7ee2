//! The CPU kernels' unit tests' random inputs: `n` values in `[-2, 2]` (steps of 1/5000),
//! deterministic in `seed`.

/// `n` pseudo-random values in `[-2, 2]` from `seed` (splitmix64 of `seed·1000003 ^ i`).
pub(crate) fn rnd(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = stageb_shared::seed::splitmix64(seed.wrapping_mul(1_000_003) ^ i);
            ((h % 20_001) as f32 - 10_000.0) / 5_000.0
        })
        .collect()
}
