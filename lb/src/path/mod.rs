//! Path layer: which entropy (UDP source port / QP, hence which ECMP path) each packet uses.

mod dr;
mod ecmp;
mod pinned;
mod pro;
mod reps;
mod spray;

pub use dr::{Dr, DrShared};
pub use ecmp::Ecmp;
pub use pinned::Pinned;
pub use pro::{coprime_stride, Pro, ProShared};
pub use reps::{Reps, RepsParams};
pub use spray::Spray;

use crate::feedback::Feedback;

/// What a path policy knows when it picks the entropy of one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathCtx {
    /// Message id within the flow (increases by one per message).
    pub msg: u64,
    /// Byte offset of the packet in its message (a plan's chunk is found by it).
    pub offset: u64,
    /// Number of entropies (paths) available; picks are in `0..n_paths`.
    pub n_paths: u16,
    /// True when this packet is a retransmission; `avoid` is the entropy the lost copy used.
    pub retransmit: bool,
    /// An entropy to avoid if the policy can (the path the lost copy took).
    pub avoid: Option<u16>,
    /// Caller's clock, microseconds.
    pub now_us: u64,
}

/// A per-flow (per-connection, per-rail) path policy.
pub trait PathPolicy: Send {
    /// Short name as in `PRISM_PATH`.
    fn name(&self) -> &'static str;
    /// The entropy for the next packet, in `0..ctx.n_paths`.
    fn pick(&mut self, ctx: &PathCtx) -> u16;
    /// Feedback about a path; the default ignores it.
    fn feedback(&mut self, _fb: &Feedback) {}
    /// The entropy for the next packet of a chunk the split layer pinned to `uplink` (a plan chunk's
    /// `uplink`). Policies built from a topology ([`crate::LbRuntime::path_policy`]) then only answer
    /// entropies that leave on that uplink; a policy that knows no topology ignores the pin.
    fn pick_for(&mut self, ctx: &PathCtx, uplink: Option<u16>) -> u16 {
        let _ = uplink;
        self.pick(ctx)
    }
    /// Entropies for the next `out.len()` packets of one chunk, as `pick_for` would give them one by one.
    /// Policies with shared state override it to take their lock once per burst.
    fn pick_burst(&mut self, ctx: &PathCtx, uplink: Option<u16>, out: &mut [u16]) {
        for o in out {
            *o = self.pick_for(ctx, uplink);
        }
    }
    /// Like [`PathPolicy::pick_for`], for a packet that must go on a path `fit` accepts (the
    /// transport's view, finer than the policy's dead set: e.g. during a failure episode only paths
    /// proven since it began): a policy whose picks follow an order (PRO's walk) continues that order
    /// past the unfit paths, so the packets it re-places spread as its picks do instead of piling on
    /// the fit path nearest to an unfit one. `None`: the policy has no such order (the caller corrects
    /// the pick itself, as for every policy by default) or no path is fit.
    fn pick_fit(&mut self, ctx: &PathCtx, uplink: Option<u16>, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        let _ = (ctx, uplink, fit);
        None
    }
    /// Whether entropy `e` may carry a packet of the chunk `ctx` names when the caller has to place it
    /// elsewhere than the policy picked (a tail-loss probe, a retransmission during a failure
    /// episode, a pick on a path that is not fit): a chunk the split layer pinned to an uplink may
    /// only use that uplink's entropies while any of them will do (under Ethereal a retransmission's
    /// uplink is its own, see `FlowPaths`). The default allows every entropy.
    fn allows(&mut self, ctx: &PathCtx, uplink: Option<u16>, e: u16) -> bool {
        let _ = (ctx, uplink, e);
        true
    }
    /// Where the plan chunk holding `ctx.offset` of message `ctx.msg` ends (an offset of the
    /// message; the last of the adjacent chunks that go to the same rail and uplink), for a policy
    /// that places chunks (the split layer's): a new packet should end there rather than carry the
    /// next chunk's first bytes to this chunk's rail and uplink. `None` (the default): no chunk
    /// boundary to respect.
    fn chunk_end(&mut self, ctx: &PathCtx) -> Option<u64> {
        let _ = ctx;
        None
    }
    /// A small JSON picture of the policy's state, for stats (`null` when there is nothing to say).
    fn describe_state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// Pick an entropy other than `avoid` when there is more than one path (used for retransmissions by
/// policies that have no better idea).
pub fn other_than(pick: u16, avoid: Option<u16>, n_paths: u16) -> u16 {
    match avoid {
        Some(a) if a == pick && n_paths > 1 => (pick + 1) % n_paths,
        _ => pick,
    }
}

/// The entropies a flow has been told are dead (`Feedback::PathState`), as a bit set.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeadSet {
    bits: Vec<u64>,
    count: u32,
}

impl DeadSet {
    pub(crate) fn set(&mut self, e: u16, dead: bool) {
        let (w, b) = (e as usize / 64, e % 64);
        if w >= self.bits.len() {
            if !dead {
                return;
            }
            self.bits.resize(w + 1, 0);
        }
        let was = self.bits[w] >> b & 1 == 1;
        if dead && !was {
            self.bits[w] |= 1 << b;
            self.count += 1;
        } else if !dead && was {
            self.bits[w] &= !(1 << b);
            self.count -= 1;
        }
    }

    #[inline]
    pub(crate) fn is_dead(&self, e: u16) -> bool {
        self.count > 0 && self.bits.get(e as usize / 64).is_some_and(|w| w >> (e % 64) & 1 == 1)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.bits.iter().enumerate().flat_map(|(w, &bits)| (0..64u16).filter(move |b| bits >> b & 1 == 1).map(move |b| w as u16 * 64 + b))
    }

    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// Apply a `PathState` feedback; other feedback is ignored.
    pub(crate) fn apply(&mut self, fb: &Feedback) {
        if let Feedback::PathState { entropy, alive, .. } = *fb {
            self.set(entropy, !alive);
        }
    }
}

/// Lock a mutex even if another holder panicked: policy state stays usable (at worst slightly stale).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_set_tracks_deaths_and_revivals() {
        let mut d = DeadSet::default();
        assert!(!d.is_dead(3));
        d.set(130, true);
        d.set(3, true);
        d.set(3, true);
        assert!(d.is_dead(130) && d.is_dead(3));
        assert_eq!(d.count(), 2);
        d.set(3, false);
        assert!(!d.is_dead(3));
        assert_eq!(d.count(), 1);
    }
}
