//! Rail layer: which NIC of this host carries each chunk of a message. Rails pair across hosts (NIC `r`
//! talks to NIC `r` of the peer), so the rail is the only choice; the peer's NIC follows.

mod lpt;
mod simple;

pub use lpt::{Lpt, TieBreak};
pub use simple::{HashRail, RoundRobin, SingleRail};

use crate::plan::SendReq;

/// Which rail policy to run (`PRISM_RAIL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RailKind {
    /// RailS: chunks largest first, each to the rail with the fewest bytes assigned to that destination.
    Lpt,
    /// Chunks round-robin over the rails, one pointer per destination.
    Rr,
    /// One rail per connection, by hash (the multi-NIC analogue of ECMP).
    Hash,
    /// Every chunk on the connection's own rail.
    Single,
}

impl RailKind {
    /// The name as written in `PRISM_RAIL`.
    pub fn name(self) -> &'static str {
        match self {
            RailKind::Lpt => "lpt",
            RailKind::Rr => "rr",
            RailKind::Hash => "hash",
            RailKind::Single => "single",
        }
    }
}

/// One chunk of message `msg` (an index into the batch) and its rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RailChunk {
    /// Index of the message in the batch passed to [`RailPolicy::assign`].
    pub msg: u32,
    /// Byte offset in the message.
    pub offset: u64,
    /// Length in bytes (1..=chunk size).
    pub len: u32,
    /// The rail chosen.
    pub rail: u16,
}

/// A rail policy: cuts messages into chunks and gives each chunk a rail. Its state is per process.
pub trait RailPolicy: Send {
    /// Short name as in `PRISM_RAIL`.
    fn name(&self) -> &'static str;
    /// Cut every message of `reqs` into chunks of `chunk_bytes` (the last one shorter) and append them, each
    /// with a rail, to `out`. Only rails with `alive[r]` are used (all of them when none is alive).
    /// `src_host` is this host's id.
    fn assign(&mut self, src_host: usize, reqs: &[SendReq], chunk_bytes: u32, alive: &[bool], out: &mut Vec<RailChunk>);
    /// Forget accumulated state (a new round, in RailS's words).
    fn reset(&mut self) {}
    /// A small JSON picture of the state, for stats.
    fn describe_state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// A rail policy of the given kind for a host with `rails` rails; `seed` fixes its hash.
pub fn rail_policy(kind: RailKind, rails: u16, tie: TieBreak, seed: u64) -> Box<dyn RailPolicy> {
    match kind {
        RailKind::Lpt => Box::new(Lpt::new(rails, tie)),
        RailKind::Rr => Box::new(RoundRobin::new(rails)),
        RailKind::Hash => Box::new(HashRail::new(rails, seed)),
        RailKind::Single => Box::new(SingleRail::new(rails)),
    }
}

/// The usable rails as a bit mask (rails are at most 64): the alive ones, or all `n` when none is alive
/// (trying every rail beats stranding the message).
pub(crate) fn alive_mask(alive: &[bool], n: usize) -> u64 {
    let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
    let m = alive.iter().take(n).enumerate().fold(0u64, |m, (r, &a)| if a { m | 1 << r } else { m });
    // Rails beyond `alive`'s length count as alive.
    let m = m | (all & !(((1u128 << alive.len().min(64)) - 1) as u64));
    if m == 0 {
        all
    } else {
        m
    }
}
