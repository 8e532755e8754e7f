//! `fixed:k`: the MP-RDMA-k baseline of Ethereal's evaluation (`seed-ethereal.md` §4.4): every flow is cut
//! into k equal sub-flows and each sub-flow is pinned to an uplink drawn at random, as ECMP would hash a
//! sub-flow's 5-tuple. No topology awareness and no bad-path marks, which is what Ethereal improves on.

use rand::{rngs::SmallRng, Rng};

/// The uplinks of the `k` sub-flows of one flow, each uniform over `0..s`.
pub fn fixed_uplinks(k: usize, s: u16, rng: &mut SmallRng) -> Vec<u16> {
    (0..k).map(|_| rng.gen_range(0..s.max(1))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn sub_flows_land_on_random_uplinks_that_collide_like_ecmp() {
        // 4 sub-flows over 4 uplinks: a hash puts two on one uplink most of the time (1 − 4!/4⁴ ≈ 0.906).
        let seed = 42;
        let mut rng = SmallRng::seed_from_u64(seed);
        let trials = 10_000;
        let collided = (0..trials)
            .filter(|_| {
                let mut u = fixed_uplinks(4, 4, &mut rng);
                u.sort_unstable();
                u.dedup();
                u.len() < 4
            })
            .count();
        let rate = collided as f64 / trials as f64;
        assert!((rate - 0.906).abs() < 0.02, "seed {seed}: collision rate {rate}");
    }
}
