//! SplitMix64 (Steele, Lea and Flood, 2014): the one 64-bit mixing hash Prism uses wherever it needs a
//! cheap, well-mixed, deterministic value from an integer (seeds, ECMP-like keys, synthetic patterns).

/// The increment of the SplitMix64 generator (2^64 / φ, odd).
pub const SPLITMIX64_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output for a generator whose state was `x` before the step: `x + γ` through the
/// finaliser. A well-mixed 64-bit hash of `x`; a generator is `state += γ` with
/// `splitmix64(state - γ)` as its output, i.e. `out = splitmix64(state); state += γ`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(SPLITMIX64_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first outputs of the reference generator (`splitmix64.c`) seeded with `seed`.
    fn outputs(seed: u64, n: usize) -> Vec<u64> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                let out = splitmix64(state);
                state = state.wrapping_add(SPLITMIX64_GAMMA);
                out
            })
            .collect()
    }

    #[test]
    fn matches_the_reference_generator_seeded_with_zero() {
        assert_eq!(outputs(0, 3), [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f]);
    }

    #[test]
    fn matches_the_reference_generator_seeded_with_1234567() {
        assert_eq!(
            outputs(1_234_567, 5),
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821
            ]
        );
    }
}
