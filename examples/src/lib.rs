//! prism-perf: nccl-tests-style collectives on host memory through an NCCL net plugin's C ABI.
//!
//! The plugin is dlopened by a small C shim (`csrc/netshim.c`, built against `include/prism_net.h`) and
//! driven like NCCL's proxy drives it; nothing here links Prism's transport or plugin crates (only
//! `prism-lb`'s `splitmix64`, the hash of the sparse alltoall's pattern). Layers, bottom up: [`ffi`]
//! (every `unsafe` call: the shim and host memory), [`net`] (host buffers, the [`net::Transport`]
//! trait, the plugin and the transport over it), [`coll`] (schedules and their
//! executor), [`data`] (test data and its check), [`rendezvous`] (TCP bootstrap between ranks),
//! [`bench`](mod@bench) (one rank's run), [`launch`] (`-N` local ranks), [`report`] (table and JSON).

#![warn(missing_docs)]

pub mod bench;
pub mod bw;
pub mod cli;
pub mod coll;
pub mod data;
pub mod ffi;
pub mod launch;
pub mod memnet;
pub mod net;
pub mod pump;
pub mod rendezvous;
pub mod report;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// The program: parse flags, then run as the launcher of `-N` local ranks or as one rank.
pub fn main() -> ExitCode {
    let args = cli::Args::parse();
    if let Err(e) = args.validate() {
        eprintln!("prism-perf: {e}");
        return ExitCode::from(2);
    }
    let outcome = match (args.rank, args.nranks) {
        (Some(rank), Some(nranks)) => bench::run_rank(&args, rank, nranks).map(|ok| i32::from(!ok)),
        _ if args.local_ranks > 1 => launch::spawn_local(args.local_ranks, Duration::from_secs(args.timeout_s)),
        _ => bench::run_rank(&args, 0, 1).map(|ok| i32::from(!ok)),
    };
    match outcome {
        Ok(0) => ExitCode::SUCCESS,
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            let who = args.rank.map_or_else(String::new, |r| format!("rank {r}: "));
            eprintln!("prism-perf: {who}error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
