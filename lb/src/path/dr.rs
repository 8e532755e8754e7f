//! Destination rotation, DR (seed 000, `seed-survey-and-slides.md` §1.5 and §3.2): every source
//! round-robins its packets per destination. One pointer per (rail, destination leaf), shared by all flows
//! to that leaf (OFAN's consolidation, which the digest recommends over HOST DR's per-host pointers that
//! spread small messages "too thin"), moved one step per packet.
//!
//! Reading: OFAN initialises each pointer to a random position of a random traversal order, so that hosts
//! do not rotate in lockstep (the Θ(m) "stickiness" failure); we do the same and keep the order fixed.
//! Under failures DR rotates only over reachable paths: entropies the flow was told are dead are stepped
//! over. Only data packets are rotated (the transport's ACKs do not go through `lb`).

use std::sync::{Arc, Mutex};

use rand::{rngs::SmallRng, seq::SliceRandom, Rng, SeedableRng};

use super::{lock, DeadSet, PathCtx, PathPolicy};
use crate::feedback::Feedback;

/// The rotation shared by all flows to one destination leaf on one rail.
#[derive(Debug)]
pub struct DrShared {
    order: Vec<u16>,
    pos: usize,
    rng: SmallRng,
}

impl DrShared {
    /// A pointer whose random order and start are fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { order: Vec::new(), pos: 0, rng: SmallRng::seed_from_u64(seed) }
    }

    /// Shared state wrapped for several flows.
    pub fn shared(seed: u64) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Self::new(seed)))
    }

    fn next(&mut self, m: u16) -> u16 {
        if self.order.len() != m as usize {
            self.order = (0..m).collect();
            self.order.shuffle(&mut self.rng);
            self.pos = self.rng.gen_range(0..m as usize);
        }
        let e = self.order[self.pos];
        self.pos += 1;
        if self.pos == self.order.len() {
            self.pos = 0;
        }
        e
    }
}

/// One flow's view of its destination leaf's rotation.
#[derive(Debug)]
pub struct Dr {
    shared: Arc<Mutex<DrShared>>,
    dead: DeadSet,
}

impl Dr {
    /// A flow that rotates with the pointer in `shared`.
    pub fn new(shared: Arc<Mutex<DrShared>>) -> Self {
        Self { shared, dead: DeadSet::default() }
    }
}

impl Dr {
    /// The pointer's next entropy that is neither dead nor the one to avoid (at most one turn).
    fn next_alive(&self, sh: &mut DrShared, ctx: &PathCtx) -> u16 {
        let m = ctx.n_paths.max(1);
        let mut e = sh.next(m);
        if self.dead.count() > 0 || ctx.avoid.is_some() {
            for _ in 1..m {
                if !self.dead.is_dead(e) && ctx.avoid != Some(e) {
                    break;
                }
                e = sh.next(m);
            }
        }
        e
    }
}

impl PathPolicy for Dr {
    fn name(&self) -> &'static str {
        "dr"
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        let mut sh = lock(&self.shared);
        self.next_alive(&mut sh, ctx)
    }

    fn pick_burst(&mut self, ctx: &PathCtx, _uplink: Option<u16>, out: &mut [u16]) {
        let mut sh = lock(&self.shared);
        for o in out {
            *o = self.next_alive(&mut sh, ctx);
        }
    }

    /// The rotation continued past unfit paths as past dead ones; with no fit path the pointer
    /// stays where it was.
    fn pick_fit(&mut self, ctx: &PathCtx, _uplink: Option<u16>, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        let m = ctx.n_paths.max(1);
        let mut sh = lock(&self.shared);
        let mut e = sh.next(m);
        let start = sh.pos;
        for _ in 0..m {
            if !self.dead.is_dead(e) && ctx.avoid != Some(e) && fit(e) {
                return Some(e);
            }
            e = sh.next(m);
        }
        sh.pos = (start + sh.order.len() - 1) % sh.order.len();
        None
    }

    fn feedback(&mut self, fb: &Feedback) {
        self.dead.apply(fb);
    }

    fn describe_state(&self) -> serde_json::Value {
        serde_json::json!({ "pointer": lock(&self.shared).pos, "dead": self.dead.count() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(m: u16) -> PathCtx {
        PathCtx { msg: 0, offset: 0, n_paths: m, retransmit: false, avoid: None, now_us: 0 }
    }

    fn covers_once(picks: &[u16], m: u16) -> bool {
        let mut seen = vec![0u32; m as usize];
        picks.iter().for_each(|&e| seen[e as usize] += 1);
        seen.iter().all(|&c| c == 1)
    }

    /// `pick_fit` keeps to the rotation's order, passing over unfit paths as over dead ones: the fit
    /// paths are used equally (one each per turn), and with none fit the pointer does not move.
    #[test]
    fn pick_fit_rotates_over_the_fit_paths_only_and_evenly() {
        let m = 16u16;
        let leaf = DrShared::shared(3);
        let mut flows: Vec<Dr> = (0..2).map(|_| Dr::new(leaf.clone())).collect();
        let unfit = |e: u16| e % 4 == 1;
        let mut seen = vec![0u32; m as usize];
        for i in 0..12 * 5 {
            let e = flows[i % 2].pick_fit(&ctx(m), None, &mut |e| !unfit(e)).expect("fit paths exist");
            seen[e as usize] += 1;
        }
        for e in 0..m {
            assert_eq!(seen[e as usize], if unfit(e) { 0 } else { 5 }, "path {e}: {seen:?}");
        }
        let pos = lock(&leaf).pos;
        assert_eq!(flows[0].pick_fit(&ctx(m), None, &mut |_| false), None);
        assert_eq!(lock(&leaf).pos, pos, "nothing fit: the pointer stays");
        // The walk goes on from there with the rotation's next entry.
        let want = lock(&leaf).order[pos];
        assert_eq!(flows[1].pick(&ctx(m)), want);
    }

    #[test]
    fn flows_to_one_leaf_share_one_rotation_that_covers_every_path_once_per_m_packets() {
        let m = 16;
        let leaf = DrShared::shared(9);
        let mut flows: Vec<Dr> = (0..3).map(|_| Dr::new(leaf.clone())).collect();
        // Interleave the three flows unevenly; together they walk one rotation.
        let mut picks = Vec::new();
        for i in 0..(4 * m as usize) {
            let f = [0, 1, 0, 2, 2][i % 5];
            picks.push(flows[f].pick(&ctx(m)));
        }
        for w in picks.chunks(m as usize) {
            assert!(covers_once(w, m), "{w:?}");
        }
    }

    #[test]
    fn each_destination_leaf_rotates_on_its_own_pointer() {
        let m = 8;
        let (a, b) = (DrShared::shared(1), DrShared::shared(2));
        let mut to_a = Dr::new(a);
        let mut to_b = Dr::new(b);
        let mut pa = Vec::new();
        // Traffic to leaf B in between must not advance leaf A's rotation.
        for _ in 0..m {
            pa.push(to_a.pick(&ctx(m)));
            for _ in 0..3 {
                to_b.pick(&ctx(m));
            }
        }
        assert!(covers_once(&pa, m), "{pa:?}");
    }

    #[test]
    fn different_seeds_start_at_different_places() {
        let firsts: std::collections::HashSet<u16> = (0..32).map(|s| Dr::new(DrShared::shared(s)).pick(&ctx(64))).collect();
        assert!(firsts.len() > 16, "{firsts:?}");
    }

    #[test]
    fn dead_paths_are_stepped_over() {
        let mut f = Dr::new(DrShared::shared(4));
        f.feedback(&Feedback::PathState { entropy: 1, alive: false, now_us: 0 });
        for _ in 0..100 {
            assert_ne!(f.pick(&ctx(4)), 1);
        }
    }
}
