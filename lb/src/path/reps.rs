//! REPS, recycled entropy packet spraying (`anchors-reps-uec.md` §1.2, as its authors' htsim code does
//! it): an 8-slot circular buffer of entropies whose packets were ACKed clean. The next packet reuses the
//! oldest fresh cached entropy once ("one good ACK buys one more packet on that path"), or explores a
//! random one when none is fresh. ECN/congested ACKs and NACKs are simply not recycled. A timeout that was
//! not preceded by queueing enters frozen mode: the cached entropies are replayed round-robin for the
//! freeze time, then the buffer is reset and the next packets explore at random.
//!
//! Readings: without switch trimming we use the paper artifact's gate (freeze only when the largest RTT
//! before the timeout was below 1.65 × base RTT; never when no RTT was measured). The freeze length
//! defaults to the artifact's 10 ms; the exploration count to UEC htsim's 16 packets, because the
//! artifact's BDP/MTU needs a bandwidth-delay product this crate does not know. Both are parameters, as
//! 000 advises keeping them short (digest §1.6, §3.5). Ours: the freeze exit is also checked when
//! picking (not only on feedback), and entropies reported dead are not replayed or drawn while others
//! remain.

use rand::{rngs::SmallRng, Rng, SeedableRng};

use super::{other_than, DeadSet, PathCtx, PathPolicy};
use crate::feedback::Feedback;

/// Slots in the recycling buffer (REPS's `repsBufferSize`).
pub const REPS_SLOTS: usize = 8;

/// REPS parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepsParams {
    /// How long frozen mode lasts, µs (`PRISM_REPS_FREEZE_US`).
    pub freeze_us: u64,
    /// Random entropies drawn after leaving frozen mode (`PRISM_REPS_EXPLORE`).
    pub explore: u32,
    /// Freeze on a timeout only if max RTT < this × base RTT, in thousandths (`PRISM_REPS_FREEZE_RTT`).
    pub freeze_rtt_permille: u32,
}

impl Default for RepsParams {
    fn default() -> Self {
        Self { freeze_us: 10_000, explore: 16, freeze_rtt_permille: 1650 }
    }
}

/// One flow's REPS state (fits REPS's "< 25 bytes" in spirit: 8 entropies, valid bits, a few counters).
#[derive(Debug)]
pub struct Reps {
    params: RepsParams,
    rng: SmallRng,
    ev: [u16; REPS_SLOTS],
    valid: [bool; REPS_SLOTS],
    head: usize,
    count: usize,
    fresh: usize,
    head_frozen: usize,
    frozen: bool,
    exit_freeze_at_us: u64,
    explore_left: u32,
    dead: DeadSet,
    freezes: u64,
    recycled: u64,
    random: u64,
}

/// What a feedback event means to REPS (UEC's `PathFeedback`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Good,
    NotRecycled,
    Timeout { freeze_gate: bool },
}

impl Reps {
    /// A REPS flow whose random explorations are fixed by `seed`.
    pub fn new(params: RepsParams, seed: u64) -> Self {
        Self {
            params,
            rng: SmallRng::seed_from_u64(seed),
            ev: [0; REPS_SLOTS],
            valid: [false; REPS_SLOTS],
            head: 0,
            count: 0,
            fresh: 0,
            head_frozen: 0,
            frozen: false,
            exit_freeze_at_us: 0,
            explore_left: 0,
            dead: DeadSet::default(),
            freezes: 0,
            recycled: 0,
            random: 0,
        }
    }

    /// True while in frozen mode.
    pub fn is_frozen(&self) -> bool {
        self.frozen
    }

    /// Cached entropies not yet reused.
    pub fn fresh(&self) -> usize {
        self.fresh
    }

    /// Filled slots (fresh or not).
    pub fn cached(&self) -> usize {
        self.count
    }

    /// Random explorations still owed after the last unfreeze.
    pub fn explore_left(&self) -> u32 {
        self.explore_left
    }

    fn add(&mut self, e: u16) {
        self.ev[self.head] = e;
        if !self.valid[self.head] {
            self.fresh += 1;
        }
        self.valid[self.head] = true;
        self.head = (self.head + 1) % REPS_SLOTS;
        self.count = (self.count + 1).min(REPS_SLOTS);
    }

    fn reset_buffer(&mut self) {
        self.valid = [false; REPS_SLOTS];
        self.head = 0;
        self.count = 0;
        self.fresh = 0;
        self.head_frozen = 0;
    }

    fn maybe_unfreeze(&mut self, now_us: u64) {
        if self.frozen && now_us > self.exit_freeze_at_us {
            self.frozen = false;
            self.reset_buffer();
            self.explore_left = self.params.explore;
        }
    }

    fn process(&mut self, entropy: Option<u16>, v: Verdict, now_us: u64) {
        if let Verdict::Timeout { freeze_gate: true } = v {
            if !self.frozen && self.explore_left == 0 {
                self.frozen = true;
                self.exit_freeze_at_us = now_us.saturating_add(self.params.freeze_us);
                self.freezes += 1;
            }
        }
        self.maybe_unfreeze(now_us);
        if let (Verdict::Good, Some(e)) = (v, entropy) {
            self.add(e);
        }
    }

    fn random(&mut self, n: u16) -> u16 {
        self.random += 1;
        let mut e = self.rng.gen_range(0..n);
        // Ours: a few redraws keep exploration off paths the transport declared dead.
        for _ in 0..8 {
            if !self.dead.is_dead(e) || self.dead.count() >= n as u32 {
                break;
            }
            e = self.rng.gen_range(0..n);
        }
        e
    }

    fn remove_earliest_fresh(&mut self) -> u16 {
        let i = (self.head + REPS_SLOTS - self.fresh) % REPS_SLOTS;
        self.valid[i] = false;
        self.fresh -= 1;
        self.ev[i]
    }

    fn remove_frozen(&mut self, n: u16) -> Option<u16> {
        for _ in 0..self.count {
            let e = self.ev[self.head_frozen];
            self.head_frozen = (self.head_frozen + 1) % self.count;
            if e < n && !self.dead.is_dead(e) {
                return Some(e);
            }
        }
        None
    }
}

impl PathPolicy for Reps {
    fn name(&self) -> &'static str {
        "reps"
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        let n = ctx.n_paths.max(1);
        self.maybe_unfreeze(ctx.now_us);
        let e = if self.explore_left > 0 {
            self.explore_left -= 1;
            self.random(n)
        } else if self.frozen {
            match self.remove_frozen(n) {
                Some(e) => e,
                None => self.random(n),
            }
        } else if self.count == 0 || self.fresh == 0 {
            self.random(n)
        } else {
            let e = self.remove_earliest_fresh();
            if e < n && !self.dead.is_dead(e) {
                self.recycled += 1;
                e
            } else {
                self.random(n)
            }
        };
        other_than(e, ctx.avoid, n)
    }

    fn feedback(&mut self, fb: &Feedback) {
        self.dead.apply(fb);
        match *fb {
            Feedback::Ack { entropy, congested, now_us, .. } => {
                let v = if congested { Verdict::NotRecycled } else { Verdict::Good };
                self.process(Some(entropy), v, now_us);
            }
            Feedback::Nack { entropy, now_us, .. } => self.process(Some(entropy), Verdict::NotRecycled, now_us),
            Feedback::Timeout { entropy, max_rtt_us, base_rtt_us, now_us } => {
                // A failure looks like low RTTs then silence; congestion inflates the RTT first.
                let gate = base_rtt_us > 0 && (max_rtt_us as u64) * 1000 < self.params.freeze_rtt_permille as u64 * base_rtt_us as u64;
                self.process(entropy, Verdict::Timeout { freeze_gate: gate }, now_us);
            }
            Feedback::PathState { .. } => {}
        }
    }

    fn describe_state(&self) -> serde_json::Value {
        serde_json::json!({
            "frozen": self.frozen, "cached": self.count, "fresh": self.fresh, "explore_left": self.explore_left,
            "freezes": self.freezes, "recycled": self.recycled, "random": self.random,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: u16 = 64;

    fn ctx(now_us: u64) -> PathCtx {
        PathCtx { msg: 0, offset: 0, n_paths: N, retransmit: false, avoid: None, now_us }
    }

    fn ack(e: u16, congested: bool, now_us: u64) -> Feedback {
        Feedback::Ack { entropy: e, rtt_us: 10, congested, bytes: 4096, now_us }
    }

    fn timeout(max_rtt_us: u32, base_rtt_us: u32, now_us: u64) -> Feedback {
        Feedback::Timeout { entropy: None, max_rtt_us, base_rtt_us, now_us }
    }

    fn reps() -> Reps {
        Reps::new(RepsParams::default(), 5)
    }

    #[test]
    fn clean_acks_are_recycled_oldest_first_and_each_only_once() {
        let mut r = reps();
        for e in [7, 9, 11] {
            r.feedback(&ack(e, false, 1));
        }
        assert_eq!(r.fresh(), 3);
        assert_eq!([r.pick(&ctx(2)), r.pick(&ctx(2)), r.pick(&ctx(2))], [7, 9, 11]);
        assert_eq!(r.fresh(), 0);
        // With nothing fresh, the next pick explores (a random entropy, counted as such).
        let before = r.random;
        r.pick(&ctx(2));
        assert_eq!(r.random, before + 1);
    }

    #[test]
    fn congested_acks_and_nacks_are_not_recycled() {
        let mut r = reps();
        r.feedback(&ack(3, true, 1));
        r.feedback(&Feedback::Nack { entropy: 4, own_path: true, now_us: 1 });
        assert_eq!(r.fresh(), 0);
        assert_eq!(r.cached(), 0);
    }

    #[test]
    fn the_buffer_keeps_the_8_most_recent_good_entropies() {
        let mut r = reps();
        for e in 0..10 {
            r.feedback(&ack(e, false, 1));
        }
        assert_eq!(r.fresh(), 8);
        let picks: Vec<u16> = (0..8).map(|_| r.pick(&ctx(1))).collect();
        assert_eq!(picks, (2..10).collect::<Vec<_>>());
    }

    #[test]
    fn a_new_flow_explores_random_entropies() {
        let mut r = reps();
        let picks: std::collections::HashSet<u16> = (0..64).map(|_| r.pick(&ctx(0))).collect();
        assert!(picks.len() > 20, "{picks:?}");
    }

    #[test]
    fn a_timeout_after_low_rtts_freezes_and_replays_the_cache_round_robin() {
        let mut r = reps();
        for e in [20, 21, 22] {
            r.feedback(&ack(e, false, 1));
        }
        r.pick(&ctx(1)); // uses 20; the slot stays in the buffer for replay
        r.feedback(&timeout(12, 10, 100)); // 12 < 1.65 × 10: a failure, not congestion
        assert!(r.is_frozen());
        let picks: Vec<u16> = (0..6).map(|_| r.pick(&ctx(200))).collect();
        assert_eq!(picks, vec![20, 21, 22, 20, 21, 22]);
    }

    #[test]
    fn a_timeout_after_inflated_rtts_does_not_freeze() {
        let mut r = reps();
        r.feedback(&ack(1, false, 1));
        r.feedback(&timeout(17, 10, 100)); // 17 ≥ 16.5: congestion
        assert!(!r.is_frozen());
        r.feedback(&timeout(50, 0, 100)); // no RTT measured: cannot tell, do not freeze
        assert!(!r.is_frozen());
    }

    #[test]
    fn frozen_mode_exits_after_the_freeze_time_with_a_reset_buffer_and_16_explorations() {
        let p = RepsParams { freeze_us: 1_000, ..RepsParams::default() };
        let mut r = Reps::new(p, 1);
        r.feedback(&ack(5, false, 0));
        r.feedback(&timeout(10, 10, 100));
        assert!(r.is_frozen());
        r.feedback(&ack(6, false, 1_100)); // at the exit time: still frozen (exit is strictly after)
        assert!(r.is_frozen());
        r.feedback(&ack(7, false, 1_101)); // after: exit, reset, then this good ACK is cached
        assert!(!r.is_frozen());
        assert_eq!(r.explore_left(), 16);
        assert_eq!(r.cached(), 1);
        // The 16 explorations come first, before the cached 7 is reused.
        let before = r.random;
        for _ in 0..16 {
            r.pick(&ctx(1_102));
        }
        assert_eq!(r.random, before + 16);
        assert_eq!(r.pick(&ctx(1_103)), 7);
    }

    #[test]
    fn no_second_freeze_while_exploring_after_an_unfreeze() {
        let p = RepsParams { freeze_us: 10, explore: 4, ..RepsParams::default() };
        let mut r = Reps::new(p, 1);
        r.feedback(&timeout(10, 10, 0));
        r.feedback(&ack(1, false, 11)); // exit: 4 explorations owed
        r.feedback(&timeout(10, 10, 12));
        assert!(!r.is_frozen());
    }

    #[test]
    fn the_freeze_exit_is_also_noticed_when_picking() {
        let p = RepsParams { freeze_us: 10, ..RepsParams::default() };
        let mut r = Reps::new(p, 1);
        r.feedback(&timeout(10, 10, 0));
        assert!(r.is_frozen());
        r.pick(&ctx(11));
        assert!(!r.is_frozen());
    }

    #[test]
    fn frozen_replay_skips_a_dead_entropy() {
        let mut r = reps();
        r.feedback(&ack(1, false, 0));
        r.feedback(&ack(2, false, 0));
        r.feedback(&timeout(10, 10, 1));
        r.feedback(&Feedback::PathState { entropy: 1, alive: false, now_us: 2 });
        for _ in 0..6 {
            assert_eq!(r.pick(&ctx(3)), 2);
        }
    }

    #[test]
    fn every_pick_is_in_range_even_when_paths_shrink() {
        let mut r = reps();
        r.feedback(&ack(60, false, 0));
        let c = PathCtx { n_paths: 8, ..ctx(1) };
        for _ in 0..100 {
            assert!(r.pick(&c) < 8);
        }
    }
}
