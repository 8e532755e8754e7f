//! A path policy confined to the entropies of one uplink, for chunks the split layer pinned there.
//!
//! The wrapped policy works in its own index space `0..k` (the k entropies of the uplink's class); picks
//! are mapped to real entropies and feedback back to indices, so stateful policies (REPS's cache, PRO's
//! walk, DR's rotation) stay consistent. Feedback about entropies outside the class is not for it.

use super::{PathCtx, PathPolicy};
use crate::feedback::Feedback;

/// A policy restricted to the entropies that leave on one uplink.
pub struct Pinned {
    inner: Box<dyn PathPolicy>,
    uplink: u16,
    n_paths: u16,
    class: Vec<u16>,
    index: Vec<u16>,
    class_of: Box<dyn Fn(u16) -> u16 + Send>,
}

impl std::fmt::Debug for Pinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinned").field("inner", &self.inner.name()).field("uplink", &self.uplink).field("class", &self.class).finish()
    }
}

const NOT_IN_CLASS: u16 = u16::MAX;

impl Pinned {
    /// Confine `inner` to the entropies `e` with `class_of(e) == uplink`.
    pub fn new(inner: Box<dyn PathPolicy>, uplink: u16, class_of: Box<dyn Fn(u16) -> u16 + Send>) -> Self {
        Self { inner, uplink, n_paths: 0, class: Vec::new(), index: Vec::new(), class_of }
    }

    /// The uplink this policy is confined to.
    pub fn uplink(&self) -> u16 {
        self.uplink
    }

    fn refresh(&mut self, n_paths: u16) {
        if n_paths == self.n_paths {
            return;
        }
        self.n_paths = n_paths;
        self.class = (0..n_paths).filter(|&e| (self.class_of)(e) == self.uplink).collect();
        self.index = vec![NOT_IN_CLASS; n_paths as usize];
        for (i, &e) in self.class.iter().enumerate() {
            self.index[e as usize] = i as u16;
        }
    }

    fn to_index(&self, e: u16) -> Option<u16> {
        self.index.get(e as usize).copied().filter(|&i| i != NOT_IN_CLASS)
    }

    /// The feedback translated into the class's index space, or `None` when it is about another uplink.
    fn translate(&self, fb: &Feedback) -> Option<Feedback> {
        let mut fb = *fb;
        match &mut fb {
            Feedback::Ack { entropy, .. } | Feedback::Nack { entropy, .. } | Feedback::PathState { entropy, .. } => {
                *entropy = self.to_index(*entropy)?;
            }
            Feedback::Timeout { entropy, .. } => {
                if let Some(e) = entropy {
                    *e = self.to_index(*e)?;
                }
            }
        }
        Some(fb)
    }
}

impl PathPolicy for Pinned {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        let n = ctx.n_paths.max(1);
        self.refresh(n);
        if self.class.is_empty() {
            // Fewer entropies than uplinks: this uplink has none of its own; stay deterministic.
            return self.uplink % n;
        }
        let inner_ctx = PathCtx { n_paths: self.class.len() as u16, avoid: ctx.avoid.and_then(|a| self.to_index(a)), ..*ctx };
        let i = self.inner.pick(&inner_ctx) as usize;
        self.class[i % self.class.len()]
    }

    fn pick_burst(&mut self, ctx: &PathCtx, _uplink: Option<u16>, out: &mut [u16]) {
        let n = ctx.n_paths.max(1);
        self.refresh(n);
        if self.class.is_empty() {
            out.iter_mut().for_each(|o| *o = self.uplink % n);
            return;
        }
        let inner_ctx = PathCtx { n_paths: self.class.len() as u16, avoid: ctx.avoid.and_then(|a| self.to_index(a)), ..*ctx };
        self.inner.pick_burst(&inner_ctx, None, out);
        for o in out {
            *o = self.class[*o as usize % self.class.len()];
        }
    }

    fn pick_fit(&mut self, ctx: &PathCtx, _uplink: Option<u16>, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        let n = ctx.n_paths.max(1);
        self.refresh(n);
        if self.class.is_empty() {
            return None;
        }
        let inner_ctx = PathCtx { n_paths: self.class.len() as u16, avoid: ctx.avoid.and_then(|a| self.to_index(a)), ..*ctx };
        let class = &self.class;
        if let Some(i) = self.inner.pick_fit(&inner_ctx, None, &mut |i| class.get(i as usize).is_some_and(|&e| fit(e))) {
            return self.class.get(i as usize).copied();
        }
        // The inner policy has no walk of its own (ECMP, spraying) or found nothing fit: the fit
        // entropy of this uplink nearest after its plain pick. The split layer pinned the chunk here
        // (Ethereal balances uplinks by bytes), so it leaves the uplink only when none of the
        // uplink's paths is fit (the caller's correction in entropy order would take another
        // uplink's).
        let len = self.class.len();
        let start = self.inner.pick(&inner_ctx) as usize % len;
        (0..len).map(|k| self.class[(start + k) % len]).find(|&e| Some(e) != ctx.avoid && fit(e))
    }

    fn allows(&mut self, ctx: &PathCtx, _uplink: Option<u16>, e: u16) -> bool {
        self.refresh(ctx.n_paths.max(1));
        self.class.is_empty() || self.to_index(e).is_some()
    }

    fn feedback(&mut self, fb: &Feedback) {
        if let Some(t) = self.translate(fb) {
            self.inner.feedback(&t);
        }
    }

    fn describe_state(&self) -> serde_json::Value {
        serde_json::json!({ "uplink": self.uplink, "entropies": self.class.len(), "inner": self.inner.describe_state() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::path::{Reps, RepsParams, Spray};

    fn ctx(n: u16) -> PathCtx {
        PathCtx { msg: 0, offset: 0, n_paths: n, retransmit: false, avoid: None, now_us: 0 }
    }

    #[test]
    fn picks_stay_on_the_pinned_uplink() {
        let mut p = Pinned::new(Box::new(Spray::new(3)), 2, Box::new(|e| e % 4));
        for _ in 0..1000 {
            assert_eq!(p.pick(&ctx(64)) % 4, 2);
        }
    }

    #[test]
    fn feedback_reaches_the_inner_policy_in_its_own_index_space() {
        // REPS inside: a clean ACK on entropy 10 (uplink 2 of 4, index 2) must be replayed as entropy 10.
        let mut p = Pinned::new(Box::new(Reps::new(RepsParams::default(), 1)), 2, Box::new(|e| e % 4));
        p.pick(&ctx(64));
        p.feedback(&Feedback::Ack { entropy: 10, rtt_us: 5, congested: false, bytes: 1, now_us: 1 });
        p.feedback(&Feedback::Ack { entropy: 11, rtt_us: 5, congested: false, bytes: 1, now_us: 1 });
        assert_eq!(p.pick(&ctx(64)), 10);
    }

    #[test]
    fn a_fit_pick_stays_on_the_uplink_while_any_of_its_paths_is_fit() {
        // ECMP and spraying have no walk of their own (their pick_fit finds nothing): the fit entropy
        // of the uplink is found all the same, and only when none is fit is the pick left to the caller.
        for inner in [Box::new(crate::path::Ecmp::new(7)) as Box<dyn PathPolicy>, Box::new(Spray::new(3))] {
            let mut p = Pinned::new(inner, 2, Box::new(|e| e % 4));
            for _ in 0..100 {
                assert_eq!(p.pick_fit(&ctx(64), None, &mut |e| e == 42 || e == 11), Some(42), "42 is uplink 2's only fit path");
            }
            assert_eq!(p.pick_fit(&ctx(64), None, &mut |e| e % 4 != 2), None, "no fit path on the uplink: the caller decides");
            let avoid = PathCtx { avoid: Some(42), ..ctx(64) };
            assert_eq!(p.pick_fit(&avoid, None, &mut |e| e == 42 || e == 46), Some(46), "never the entropy to avoid");
            assert!(p.allows(&ctx(64), None, 46) && !p.allows(&ctx(64), None, 47), "only the uplink's entropies are allowed");
        }
    }

    #[test]
    fn an_uplink_without_entropies_falls_back_deterministically() {
        let mut p = Pinned::new(Box::new(Spray::new(3)), 5, Box::new(|e| e % 8));
        assert_eq!(p.pick(&ctx(4)), 1);
    }
}
