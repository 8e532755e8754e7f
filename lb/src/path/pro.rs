//! PRO (seed 002, `seed-pro.md` §1.4): orchestrated round robin. Per (rail, destination leaf) a shared
//! counter C; every flow to that leaf steps through the M paths with one stride `span` = number of active
//! flows to the leaf, made coprime with M; a flow's first packet takes C mod M, and every packet sets
//! C ← path + 1, so flows that start together take consecutive paths (inter-flow staggering, uplinks) and
//! each flow covers every path once per M packets (intra-flow round robin, downlinks).
//!
//! Readings: one span for all flows of a leaf, staggered by start offset (Algorithm 1, not the prose's
//! per-QP spans; pitfall 1); C updated after every packet (pitfall 3); C starts, by default, at the
//! host's place among the hosts of its rack plus a shift the rack shares (`PRISM_PRO_START=rack`, in the
//! runtime; pitfall 5: the listing's C = 0 puts in-phase NICs on one uplink, and independent random
//! starts, the proof's assumption, still let two hosts of a rack collide). "Active flows" are the live
//! policies of that leaf (a connection end that only receives never picks a path, so never counts),
//! which NCCL keeps for a
//! communicator's lifetime (the paper relies on P being stable). Ours, for a host without PRO's switch
//! fallback (§1.7): when M is not a power of two the stride is the smallest value ≥ P coprime with M
//! (for M = 2^k that is exactly "P, +1 if even"), and dead paths are stepped over along the walk.

use std::sync::{Arc, Mutex};

use super::{lock, DeadSet, PathCtx, PathPolicy};
use crate::feedback::Feedback;
use crate::gcd;

/// The smallest stride ≥ max(p, 1) that is coprime with `m` (for `m` a power of two: `p`, +1 if even).
pub fn coprime_stride(p: u32, m: u32) -> u32 {
    let mut s = p.max(1);
    while gcd(s as u64, m.max(1) as u64) != 1 {
        s += 1;
    }
    s
}

/// State PRO shares among all flows to one destination leaf on one rail: the counter C and the number of
/// active flows P.
#[derive(Debug)]
pub struct ProShared {
    c: u32,
    flows: u32,
    // (flows, m) → span, so the gcd search runs only when P or M changes.
    cached: (u32, u32, u32),
}

impl ProShared {
    /// Shared state whose counter starts at `c0` (the runtime sets it from `PRISM_PRO_START`; 0 reproduces the
    /// paper's listing).
    pub fn new(c0: u32) -> Self {
        Self { c: c0, flows: 0, cached: (0, 0, 1) }
    }

    /// Shared state wrapped for several flows.
    pub fn shared(c0: u32) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Self::new(c0)))
    }

    /// Number of live flows (P).
    pub fn flows(&self) -> u32 {
        self.flows
    }

    /// The stride reduced modulo `m`, so a step is one add and one compare.
    fn step(&mut self, m: u32) -> u32 {
        let p = self.flows.max(1);
        if self.cached.0 != p || self.cached.1 != m {
            self.cached = (p, m, coprime_stride(p, m) % m);
        }
        self.cached.2
    }
}

/// One flow's PRO walk.
#[derive(Debug)]
pub struct Pro {
    shared: Arc<Mutex<ProShared>>,
    path: Option<u32>,
    dead: DeadSet,
}

impl Pro {
    /// A new flow of the leaf whose state is `shared`; it counts towards that leaf's P until dropped.
    pub fn new(shared: Arc<Mutex<ProShared>>) -> Self {
        lock(&shared).flows += 1;
        Self { shared, path: None, dead: DeadSet::default() }
    }
}

/// Where a flow's walk goes next (`path` is the flow's last one; a new flow starts at C), and the
/// walk's step.
fn next_of(path: Option<u32>, sh: &mut ProShared, m: u32) -> (u32, u32) {
    let step = sh.step(m);
    let p = match path {
        Some(p) if p < m => advance(p, step, m),
        _ => sh.c % m,
    };
    (p, step)
}

/// One step of the walk from `p`.
fn advance(p: u32, step: u32, m: u32) -> u32 {
    if p + step >= m {
        p + step - m
    } else {
        p + step
    }
}

/// The flow takes path `p`: C ← path + 1.
fn take(path: &mut Option<u32>, sh: &mut ProShared, p: u32, m: u32) -> u16 {
    *path = Some(p);
    sh.c = if p + 1 == m { 0 } else { p + 1 };
    p as u16
}

/// One packet: the next path of a flow's walk; C ← path + 1.
fn walk(path: &mut Option<u32>, dead: &DeadSet, sh: &mut ProShared, ctx: &PathCtx) -> u16 {
    let m = ctx.n_paths.max(1) as u32;
    let (mut p, step) = next_of(*path, sh, m);
    // Step over dead paths and the lost copy's path along the same walk, at most one full cycle.
    if dead.count() > 0 || ctx.avoid.is_some() {
        for _ in 0..m {
            if !dead.is_dead(p as u16) && ctx.avoid != Some(p as u16) {
                break;
            }
            p = advance(p, step, m);
        }
    }
    take(path, sh, p, m)
}

/// One packet that must go on a path `fit` accepts: the flow's walk continued past dead, avoided and
/// unfit paths (at most one full cycle, which the coprime stride makes visit every path); the state
/// moves only when a path is found.
fn walk_fit(path: &mut Option<u32>, dead: &DeadSet, sh: &mut ProShared, ctx: &PathCtx, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
    let m = ctx.n_paths.max(1) as u32;
    let (mut p, step) = next_of(*path, sh, m);
    for _ in 0..m {
        let e = p as u16;
        if !dead.is_dead(e) && ctx.avoid != Some(e) && fit(e) {
            return Some(take(path, sh, p, m));
        }
        p = advance(p, step, m);
    }
    None
}

impl Drop for Pro {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.flows = s.flows.saturating_sub(1);
    }
}

impl PathPolicy for Pro {
    fn name(&self) -> &'static str {
        "pro"
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        let mut sh = lock(&self.shared);
        walk(&mut self.path, &self.dead, &mut sh, ctx)
    }

    fn pick_burst(&mut self, ctx: &PathCtx, _uplink: Option<u16>, out: &mut [u16]) {
        let mut sh = lock(&self.shared);
        for o in out {
            *o = walk(&mut self.path, &self.dead, &mut sh, ctx);
        }
    }

    fn pick_fit(&mut self, ctx: &PathCtx, _uplink: Option<u16>, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        let mut sh = lock(&self.shared);
        walk_fit(&mut self.path, &self.dead, &mut sh, ctx, fit)
    }

    fn feedback(&mut self, fb: &Feedback) {
        self.dead.apply(fb);
    }

    fn describe_state(&self) -> serde_json::Value {
        let sh = lock(&self.shared);
        serde_json::json!({ "path": self.path, "flows_to_leaf": sh.flows, "c": sh.c, "dead": self.dead.count() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(m: u16) -> PathCtx {
        PathCtx { msg: 0, offset: 0, n_paths: m, retransmit: false, avoid: None, now_us: 0 }
    }

    /// P flows on one leaf with C starting at `c0`, `rounds` rounds of one packet per flow in order.
    fn rounds(m: u16, p: usize, c0: u32, rounds: usize) -> Vec<Vec<u16>> {
        let sh = ProShared::shared(c0);
        let mut flows: Vec<Pro> = (0..p).map(|_| Pro::new(sh.clone())).collect();
        (0..rounds).map(|_| flows.iter_mut().map(|f| f.pick(&ctx(m))).collect()).collect()
    }

    #[test]
    fn the_digests_test_vectors_hold_with_c_starting_at_0() {
        // seed-pro.md §1.4 table: (M, P, rounds 0..4).
        let v: Vec<(u16, usize, Vec<Vec<u16>>)> = vec![
            (4, 2, vec![vec![0, 1], vec![3, 0], vec![2, 3], vec![1, 2], vec![0, 1]]),
            (8, 1, vec![vec![0], vec![1], vec![2], vec![3], vec![4]]),
            (8, 2, vec![vec![0, 1], vec![3, 4], vec![6, 7], vec![1, 2], vec![4, 5]]),
            (8, 3, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 0], vec![1, 2, 3], vec![4, 5, 6]]),
            (8, 4, vec![vec![0, 1, 2, 3], vec![5, 6, 7, 0], vec![2, 3, 4, 5], vec![7, 0, 1, 2], vec![4, 5, 6, 7]]),
            (8, 5, vec![vec![0, 1, 2, 3, 4], vec![5, 6, 7, 0, 1], vec![2, 3, 4, 5, 6], vec![7, 0, 1, 2, 3], vec![4, 5, 6, 7, 0]]),
            (8, 8, vec![vec![0, 1, 2, 3, 4, 5, 6, 7], vec![1, 2, 3, 4, 5, 6, 7, 0], vec![2, 3, 4, 5, 6, 7, 0, 1]]),
        ];
        for (m, p, want) in v {
            assert_eq!(rounds(m, p, 0, want.len()), want, "M = {m}, P = {p}");
        }
    }

    /// With paths unfit for the transport (not dead to PRO), `pick_fit` continues the walk past them:
    /// every fit path gets one packet per cycle (no pile-up on the fit path next to an unfit block),
    /// the walk and C stay as if the unfit paths had been stepped over, and with no fit path nothing
    /// moves.
    #[test]
    fn pick_fit_continues_the_walk_past_unfit_paths_and_spreads_evenly() {
        let m = 16u16;
        let unfit = |e: u16| e < 4; // a block of 4 paths (one spine of four) failing
        let sh = ProShared::shared(0);
        let mut f = Pro::new(sh.clone());
        let mut counts = [0u32; 16];
        let mut prev: Option<u16> = None;
        for _ in 0..12 * 10 {
            let e = f.pick_fit(&ctx(m), None, &mut |e| !unfit(e)).expect("fit paths exist");
            assert!(!unfit(e), "picked unfit path {e}");
            if let Some(p) = prev {
                // one flow: stride 1, so the next fit path after the previous one
                let mut want = (p + 1) % m;
                while unfit(want) {
                    want = (want + 1) % m;
                }
                assert_eq!(e, want);
            }
            prev = Some(e);
            counts[e as usize] += 1;
            assert_eq!(lock(&sh).c, (u32::from(e) + 1) % u32::from(m), "C follows the walk");
        }
        assert_eq!(&counts[..4], &[0; 4]);
        assert!(counts[4..].iter().all(|&c| c == 10), "each fit path once per cycle: {counts:?}");
        // Nothing fit: None, and neither the walk nor C moves.
        let (path, c) = (f.path, lock(&sh).c);
        assert_eq!(f.pick_fit(&ctx(m), None, &mut |_| false), None);
        assert_eq!((f.path, lock(&sh).c), (path, c));
        // Two flows (stride 3 on 16): still every fit path equally often, and the avoided one never.
        let sh = ProShared::shared(0);
        let mut fl: Vec<Pro> = (0..2).map(|_| Pro::new(sh.clone())).collect();
        let mut counts = [0u32; 16];
        for _ in 0..12 * 10 {
            for f in &mut fl {
                let c = PathCtx { avoid: Some(9), ..ctx(m) };
                let e = f.pick_fit(&c, None, &mut |e| !unfit(e)).expect("fit paths exist");
                counts[e as usize] += 1;
            }
        }
        assert_eq!(counts[9], 0);
        let fit: Vec<u32> = (4..16).filter(|&e| e != 9).map(|e| counts[e]).collect();
        let (lo, hi) = (fit.iter().min().unwrap(), fit.iter().max().unwrap());
        assert!(hi - lo <= 2 && *lo > 0, "fit paths evenly used: {counts:?}");
    }

    #[test]
    fn a_random_start_offset_shifts_the_test_vectors() {
        let c0 = 5;
        let base = rounds(8, 3, 0, 8);
        let shifted = rounds(8, 3, c0, 8);
        for (b, s) in base.iter().zip(&shifted) {
            let b2: Vec<u16> = b.iter().map(|&x| (x + c0 as u16) % 8).collect();
            assert_eq!(&b2, s);
        }
    }

    #[test]
    fn every_flow_visits_every_path_exactly_once_per_m_packets() {
        for m in [1u16, 2, 4, 6, 8, 12, 16, 48, 64] {
            for p in 1..=10 {
                let r = rounds(m, p, 3, 3 * m as usize);
                for f in 0..p {
                    for w in 0..3 {
                        let mut seen = vec![0u32; m as usize];
                        (0..m as usize).for_each(|k| seen[r[w * m as usize + k][f] as usize] += 1);
                        assert!(seen.iter().all(|&c| c == 1), "M = {m}, P = {p}, flow {f}: {seen:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn flows_of_one_leaf_never_share_a_path_in_a_round_when_p_is_at_most_m() {
        // Inter-flow staggering balances the uplinks: every round, P distinct paths.
        for m in [4u16, 8, 16, 64] {
            for p in 1..=m as usize {
                for round in rounds(m, p, 0, 2 * m as usize) {
                    let mut r = round.clone();
                    r.sort_unstable();
                    r.dedup();
                    assert_eq!(r.len(), p, "M = {m}, P = {p}: {round:?}");
                }
            }
        }
    }

    #[test]
    fn over_m_rounds_every_path_carries_exactly_p_packets() {
        for (m, p) in [(8u16, 2usize), (8, 4), (16, 6), (64, 10)] {
            let mut load = vec![0usize; m as usize];
            rounds(m, p, 1, m as usize).iter().flatten().for_each(|&x| load[x as usize] += 1);
            assert!(load.iter().all(|&l| l == p), "M = {m}, P = {p}: {load:?}");
        }
    }

    #[test]
    fn stride_is_coprime_with_paths() {
        assert_eq!(coprime_stride(2, 8), 3);
        assert_eq!(coprime_stride(3, 8), 3);
        assert_eq!(coprime_stride(8, 8), 9);
        assert_eq!(coprime_stride(2, 6), 5);
        assert_eq!(coprime_stride(4, 12), 5);
        assert_eq!(coprime_stride(0, 1), 1);
        for m in 1..100u32 {
            for p in 0..20 {
                assert_eq!(gcd(coprime_stride(p, m) as u64, m as u64), 1);
            }
        }
    }

    #[test]
    fn dead_paths_are_skipped_and_the_rest_still_covered() {
        let sh = ProShared::shared(0);
        let mut f = Pro::new(sh);
        f.feedback(&Feedback::PathState { entropy: 2, alive: false, now_us: 0 });
        f.feedback(&Feedback::PathState { entropy: 5, alive: false, now_us: 0 });
        let picks: Vec<u16> = (0..6).map(|_| f.pick(&ctx(8))).collect();
        let mut s = picks.clone();
        s.sort_unstable();
        assert_eq!(s, vec![0, 1, 3, 4, 6, 7], "{picks:?}");
    }

    #[test]
    fn a_dropped_flow_no_longer_counts_towards_the_span() {
        let sh = ProShared::shared(0);
        let a = Pro::new(sh.clone());
        let b = Pro::new(sh.clone());
        assert_eq!(lock(&sh).flows(), 2);
        drop(a);
        drop(b);
        assert_eq!(lock(&sh).flows(), 0);
    }

    #[test]
    fn a_burst_gives_the_same_walk_as_single_picks() {
        let (mut a, mut b) = (Pro::new(ProShared::shared(2)), Pro::new(ProShared::shared(2)));
        let mut burst = [0u16; 20];
        a.pick_burst(&ctx(8), None, &mut burst);
        let single: Vec<u16> = (0..20).map(|_| b.pick(&ctx(8))).collect();
        assert_eq!(burst.to_vec(), single);
    }

    #[test]
    fn a_retransmission_avoids_the_lost_path() {
        let mut f = Pro::new(ProShared::shared(0));
        for _ in 0..100 {
            let c = PathCtx { retransmit: true, avoid: Some(3), ..ctx(8) };
            assert_ne!(f.pick(&c), 3);
        }
    }
}
