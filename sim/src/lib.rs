//! `prism-sim`: a discrete-event, packet-level fabric simulator whose hosts run Prism's real load
//! balancer (`prism-lb`: rail, split, path and rate policies chosen by `PRISM_*` variables) and the real
//! protocol core (`prism_transport::proto`: CTS, selective repeat, SACK, per-path RTO), so what is
//! measured at scale is the code that ships.
//!
//! - [`fabric`]: output-queued switches, FIFO byte-counted port buffers, link rates and delays, ECN
//!   marking, failures, slow links; leaf-spine, rail-optimised and 3-tier fat-tree topologies; switch
//!   next-hop choice by path id, ECMP hash, spraying, round robin, adaptive, OFAN or flowlets.
//! - [`engine`]: one run — hosts, connections, the event loop, metrics.
//! - [`workload`]: collectives and traffic matrices as transfers with dependencies.
//! - [`scenario`]: the JSON scenario files; [`experiment`]: running every case of one;
//!   [`report`]: markdown and SVG.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod engine;
pub mod events;
pub mod experiment;
pub mod fabric;
pub mod host;
pub mod report;
pub mod scenario;
pub mod workload;

pub use engine::{RunResult, Sim};
pub use experiment::{run_scenario, run_scenario_jobs, ExperimentResult, SummaryRow};
pub use scenario::{Scenario, ScenarioError};
