//! `spray`: uniform random entropy per packet (oblivious packet spraying, the baseline of every seed).

use rand::{rngs::SmallRng, Rng, SeedableRng};

use super::{other_than, PathCtx, PathPolicy};

/// Uniform random entropy per packet, from a seeded RNG.
#[derive(Debug)]
pub struct Spray {
    rng: SmallRng,
}

impl Spray {
    /// A spraying policy whose choices are fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { rng: SmallRng::seed_from_u64(seed) }
    }
}

impl PathPolicy for Spray {
    fn name(&self) -> &'static str {
        "spray"
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        let n = ctx.n_paths.max(1);
        other_than(self.rng.gen_range(0..n), ctx.avoid, n)
    }

    // No `pick_fit`: random picks have no order to continue, and drawing uniformly among the fit
    // paths instead of the transport's correction measured slower in the simulator (`docs/fabric.md`,
    // "Where a corrected packet goes").
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(n_paths: u16) -> PathCtx {
        PathCtx { msg: 0, offset: 0, n_paths, retransmit: false, avoid: None, now_us: 0 }
    }

    #[test]
    fn every_entropy_is_in_range_and_all_are_used() {
        let mut p = Spray::new(7);
        let mut seen = vec![0u32; 16];
        for _ in 0..16_000 {
            let e = p.pick(&ctx(16));
            seen[e as usize] += 1;
        }
        // 1000 expected per entropy; a uniform draw stays well within ±20%.
        assert!(seen.iter().all(|&c| (800..1200).contains(&c)), "{seen:?}");
    }

    #[test]
    fn retransmission_avoids_the_lost_path() {
        let mut p = Spray::new(1);
        for _ in 0..1000 {
            let c = PathCtx { retransmit: true, avoid: Some(3), ..ctx(4) };
            assert_ne!(p.pick(&c), 3);
        }
    }
}
