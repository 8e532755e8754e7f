//! Path layer: which entropy (UDP source port / QP, hence which ECMP path) each packet uses.

mod ecmp;
mod spray;

pub use ecmp::Ecmp;
pub use spray::Spray;

use crate::feedback::Feedback;

/// What a path policy knows when it picks the entropy of one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathCtx {
    /// Message id within the flow (increases by one per message).
    pub msg: u64,
    /// Number of entropies (paths) available; picks are in `0..n_paths`.
    pub n_paths: u16,
    /// True when this packet is a retransmission; `avoid` is the entropy the lost copy used.
    pub retransmit: bool,
    /// An entropy to avoid if the policy can (the path the lost copy took).
    pub avoid: Option<u16>,
    /// Caller's clock, microseconds.
    pub now_us: u64,
}

/// A per-flow (per-connection) path policy.
pub trait PathPolicy: Send {
    /// Short name as in `PRISM_PATH`.
    fn name(&self) -> &'static str;
    /// The entropy for the next packet, in `0..ctx.n_paths`.
    fn pick(&mut self, ctx: &PathCtx) -> u16;
    /// Feedback about a path; the default ignores it.
    fn feedback(&mut self, _fb: &Feedback) {}
}

/// Pick an entropy other than `avoid` when there is more than one path (used for retransmissions by
/// policies that have no better idea).
pub fn other_than(pick: u16, avoid: Option<u16>, n_paths: u16) -> u16 {
    match avoid {
        Some(a) if a == pick && n_paths > 1 => (pick + 1) % n_paths,
        _ => pick,
    }
}
