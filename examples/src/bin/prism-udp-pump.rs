//! prism-udp-pump: the loopback reference of `scripts/bench-udp` (see `prism_examples::pump`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use prism_examples::pump::{self, Mode, PumpConfig};

/// Move datagrams of one size over loopback with one sender and one receiver thread, plain
/// (sendmmsg/recvmmsg) or GSO/GRO, and print goodput and CPU time per received byte.
#[derive(Debug, Parser)]
#[command(name = "prism-udp-pump", version)]
struct Args {
    /// Bytes per datagram (UDP payload; 8972 = MTU 9000 minus IP and UDP headers).
    #[arg(short = 's', long, default_value_t = 8972)]
    size: usize,
    /// Modes to run, one after the other.
    #[arg(short = 'm', long, value_enum, num_args = 1.., default_values_t = [Mode::Plain, Mode::Gso])]
    mode: Vec<Mode>,
    /// Seconds each mode sends for.
    #[arg(short = 't', long, default_value_t = 3.0)]
    seconds: f64,
    /// Stop sending after this many bytes (K, M, G suffixes), if that comes first.
    #[arg(short = 'B', long, value_parser = prism_examples::cli::parse_size)]
    bytes: Option<usize>,
    /// Socket buffer size (K, M, G suffixes).
    #[arg(long, default_value = "8M", value_parser = prism_examples::cli::parse_size)]
    sockbuf: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !(args.seconds > 0.0 && args.seconds <= 3600.0) {
        eprintln!("prism-udp-pump: -t {}: must be between 0 and 3600 seconds", args.seconds);
        return ExitCode::from(2);
    }
    let mut results = Vec::new();
    for &mode in &args.mode {
        let cfg = PumpConfig {
            size: args.size,
            mode,
            duration: Duration::from_secs_f64(args.seconds),
            max_bytes: args.bytes.map_or(u64::MAX, |b| b as u64),
            sockbuf: args.sockbuf,
        };
        match pump::run(&cfg) {
            Ok(r) => {
                println!("{}", pump::describe(&r));
                results.push(r);
            }
            Err(e) => {
                eprintln!("prism-udp-pump: {mode:?}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(path) = args.json {
        let text = serde_json::to_string_pretty(&serde_json::json!({ "results": results })).unwrap_or_default();
        if let Err(e) = std::fs::write(&path, text + "\n") {
            eprintln!("prism-udp-pump: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
