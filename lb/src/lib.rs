//! Prism's load-balancing brains: pure policies (no I/O, no clock reads, no threads, no unsafe).
//!
//! Every decision takes its inputs as arguments (time included) and answers a plan or a path, so the
//! plugin, the fabric tests and the simulator all run the same code. Randomness comes only from RNGs
//! seeded by the caller.
//!
//! Four layers, each chosen by configuration ([`LbConfig::from_vars`]):
//! - rail ([`rail`]): which NIC carries each chunk (RailS LPT, `rr`, `hash`, `single`);
//! - split ([`split`]): how a message's bytes on a rail become sub-flows pinned to uplinks (Ethereal,
//!   `fixed:k`, `none`);
//! - path ([`path`]): which entropy each packet uses (PRO, REPS, DR, spray, ECMP);
//! - rate ([`rate`]): how much may be in flight (MCC, none).
//!
//! A process builds one [`LbRuntime`] ([`LbConfig::runtime`]) that holds the state shared among flows
//! (LPT loads, PRO counters, DR pointers, Ethereal's bad-path marks) and asks it for plans
//! ([`LbRuntime::plan`]) and per-flow path policies ([`LbRuntime::path_policy`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod feedback;
pub mod hash;
pub mod path;
pub mod plan;
pub mod rail;
pub mod rate;
pub mod runtime;
pub mod split;
pub mod topology;

pub use config::{ConfigError, LbConfig, PathKind, ProStart};
pub use feedback::Feedback;
pub use hash::splitmix64;
pub use path::{PathCtx, PathPolicy};
pub use plan::{Chunk, Plan, PlanError, SendReq};
pub use rail::{RailKind, TieBreak};
pub use rate::{CcKind, MessageSample, RateController};
pub use runtime::{FlowInfo, FlowPaths, LbRuntime};
pub use split::{Batcher, SplitKind};
pub use topology::{Topology, TopologyError};

/// Greatest common divisor (gcd(0, b) = b).
pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
