//! Prism's load-balancing brains: pure policies (no I/O, no clock reads, no threads, no unsafe).
//!
//! Every decision takes its inputs as arguments (time included) and answers a plan or a path, so the
//! plugin, the fabric tests and the simulator all run the same code. Randomness comes only from RNGs
//! seeded by the caller.
#![forbid(unsafe_code)]

pub mod config;
pub mod feedback;
pub mod path;

pub use config::{ConfigError, LbConfig};
pub use feedback::Feedback;
pub use path::{PathCtx, PathPolicy};
