//! Command line: nccl-tests' flags (`-b -e -f -i -n -w -c -d -o -T`), plus how ranks are started
//! (`-N`, or `--rank/--nranks/--rendezvous`) and which plugin is loaded.

use std::path::PathBuf;

use clap::Parser;

use crate::coll::Collective;

/// prism-perf: nccl-tests-style collectives on host memory through an NCCL net plugin's C ABI.
#[derive(Debug, Clone, Parser, PartialEq)]
#[command(
    name = "prism-perf",
    version,
    after_help = "Sizes take K, M, G suffixes (powers of 1024), as in nccl-tests.\n\
Local run:      prism-perf all_reduce -N 2 -b 1M -e 64M -f 2\n\
Multi-host run: prism-perf all_reduce --rank R --nranks N --rendezvous HOST:PORT  (rank 0 listens on HOST:PORT)"
)]
pub struct Args {
    /// Collective to run.
    #[arg(value_enum)]
    pub collective: Collective,
    /// Smallest size in bytes.
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Multiply the size by this factor at each step (1 = add -i instead).
    #[arg(short = 'f', long = "stepfactor", default_value_t = 1)]
    pub step_factor: usize,
    /// Add this many bytes at each step when -f is 1.
    #[arg(short = 'i', long = "stepbytes", default_value = "1M", value_parser = parse_size)]
    pub step_bytes: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Warm-up iterations per size (not timed).
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 1)]
    pub warmup: usize,
    /// Check the data (1) or not (0), in a dedicated pass after the timed iterations.
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u32,
    /// Data type: only `float` is supported.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub datatype: String,
    /// Reduction: only `sum` is supported.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Local ranks to spawn (each a process) when --rank is not given.
    #[arg(short = 'N', long = "local-ranks", default_value_t = 1)]
    pub local_ranks: usize,
    /// This process's rank in a job started by hand (one rank per host).
    #[arg(long)]
    pub rank: Option<usize>,
    /// Ranks in the job (with --rank).
    #[arg(long)]
    pub nranks: Option<usize>,
    /// HOST:PORT where rank 0 listens for the other ranks (with --rank).
    #[arg(long)]
    pub rendezvous: Option<String>,
    /// Plugin to load: a path, a `lib*.so` name, or NCCL_NET_PLUGIN-style short name (`prism` loads
    /// libnccl-net-prism.so). Default: $NCCL_NET_PLUGIN, else libnccl-net-prism.so next to this program.
    #[arg(long)]
    pub plugin: Option<String>,
    /// ABI version of the plugin table to use (ncclNetPlugin_vN).
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(9..=12))]
    pub abi: u32,
    /// Net device (plugin device index) every comm is opened on.
    #[arg(long, default_value_t = 0)]
    pub dev: usize,
    /// Seconds any wait (connection, collective, rendezvous) may go without progress before failing.
    #[arg(short = 'T', long = "timeout", default_value_t = 60)]
    pub timeout_s: u64,
    /// Write the results as JSON to this file (rank 0).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// More plugin logging on stderr: -v shows INFO lines, -vv TRACE.
    #[arg(short = 'v', action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Requests in flight per comm (at most 32, NCCL_NET_MAX_REQUESTS).
    #[arg(long, default_value_t = 8)]
    pub window: usize,
    /// Largest single message: collectives cut their blocks into slices of this size.
    #[arg(long, default_value = "512K", value_parser = parse_size)]
    pub slice: usize,
    /// Set by the local launcher on the processes it spawns.
    #[arg(long, hide = true)]
    pub spawned: bool,
}

/// Parses `1024`, `64K`, `1M`, `2G` (powers of 1024, either case, as nccl-tests' `parsesize`).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1usize << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = digits.parse().map_err(|_| format!("{s:?}: expected a size such as 4096, 64K, 1M or 2G"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?}: too large"))
}

/// The sizes of a sweep, as nccl-tests walks them: from `min` while `<= max`, times `factor` if it is
/// above 1, else plus `step`.
pub fn sweep(min: usize, max: usize, factor: usize, step: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut size = min;
    while size <= max {
        out.push(size);
        let next = if factor > 1 { size.checked_mul(factor) } else { size.checked_add(step) };
        match next {
            Some(n) if n > size => size = n,
            _ => break,
        }
    }
    out
}

impl Args {
    /// Checks what clap cannot: value ranges that depend on each other, and unsupported types.
    pub fn validate(&self) -> Result<(), String> {
        if self.datatype != "float" && self.datatype != "f32" {
            return Err(format!("-d {}: prism-perf supports only float", self.datatype));
        }
        if self.op != "sum" {
            return Err(format!("-o {}: prism-perf supports only sum", self.op));
        }
        if self.min_bytes > self.max_bytes {
            return Err(format!("-b {} is larger than -e {}", self.min_bytes, self.max_bytes));
        }
        if self.step_factor == 0 {
            return Err("-f 0: the step factor must be at least 1".into());
        }
        if self.step_factor > 1 && self.min_bytes == 0 {
            return Err("-b 0 with -f > 1 would never grow: start at 1 byte or more".into());
        }
        if self.step_factor == 1 && self.step_bytes == 0 && self.min_bytes < self.max_bytes {
            return Err("-i 0 with -f 1 would never grow: give -i or -f".into());
        }
        if self.check > 1 {
            return Err(format!("-c {}: 0 (no check) or 1 (check)", self.check));
        }
        if self.iters == 0 {
            return Err("-n 0: at least one timed iteration".into());
        }
        if !(1..=crate::net::MAX_REQUESTS_PER_COMM).contains(&self.window) {
            return Err(format!("--window {}: between 1 and {}", self.window, crate::net::MAX_REQUESTS_PER_COMM));
        }
        if self.slice < crate::net::ELEM_BYTES {
            return Err(format!("--slice {}: at least one element ({} bytes)", self.slice, crate::net::ELEM_BYTES));
        }
        if self.timeout_s == 0 {
            return Err("-T 0: the timeout must be at least 1 second".into());
        }
        match (self.rank, self.nranks, &self.rendezvous) {
            (None, None, None) => {
                if self.local_ranks == 0 {
                    return Err("-N 0: at least one rank".into());
                }
            }
            (Some(r), Some(n), Some(_)) => {
                if n == 0 || r >= n {
                    return Err(format!("--rank {r} --nranks {n}: need 0 <= rank < nranks"));
                }
            }
            (Some(0), Some(1), None) => {}
            _ => return Err("--rank, --nranks and --rendezvous go together (one rank of a multi-process job)".into()),
        }
        Ok(())
    }

    /// The sizes this run measures.
    pub fn sizes(&self) -> Vec<usize> {
        sweep(self.min_bytes, self.max_bytes, self.step_factor, self.step_bytes)
    }

    /// Everything every rank must agree on, compared at the rendezvous.
    pub fn job_signature(&self) -> String {
        format!(
            "{} b={} e={} f={} i={} n={} w={} c={} window={} slice={} abi={}",
            self.collective.name(),
            self.min_bytes,
            self.max_bytes,
            self.step_factor,
            self.step_bytes,
            self.iters,
            self.warmup,
            self.check,
            self.window,
            self.slice,
            self.abi
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, String> {
        let a = Args::try_parse_from(std::iter::once("prism-perf").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        a.validate()?;
        Ok(a)
    }

    #[test]
    fn sizes_take_binary_k_m_g_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("1T").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1").is_err());
    }

    #[test]
    fn sweep_multiplies_by_factor_up_to_max_inclusive() {
        assert_eq!(sweep(1 << 20, 64 << 20, 2, 0), (0..=6).map(|k| (1usize << 20) << k).collect::<Vec<_>>());
        assert_eq!(sweep(8, 100, 3, 0), vec![8, 24, 72]);
    }

    #[test]
    fn sweep_adds_step_when_factor_is_one() {
        assert_eq!(sweep(1000, 3500, 1, 1000), vec![1000, 2000, 3000]);
        assert_eq!(sweep(5, 5, 1, 1 << 20), vec![5]);
    }

    #[test]
    fn sweep_stops_instead_of_overflowing() {
        assert_eq!(sweep(usize::MAX / 2 + 1, usize::MAX, 2, 0), vec![usize::MAX / 2 + 1]);
    }

    #[test]
    fn nccl_tests_flags_parse_with_their_defaults() {
        let a = parse(&["all_reduce", "-N", "2", "-b", "1M", "-e", "64M", "-f", "2"]).unwrap();
        assert_eq!(a.collective, Collective::AllReduce);
        assert_eq!((a.min_bytes, a.max_bytes, a.step_factor), (1 << 20, 64 << 20, 2));
        assert_eq!((a.iters, a.warmup, a.check, a.local_ranks, a.abi, a.timeout_s), (20, 1, 1, 2, 12, 60));
        assert_eq!(a.sizes().len(), 7);
    }

    #[test]
    fn every_collective_name_parses() {
        for c in Collective::ALL {
            assert_eq!(parse(&[c.name()]).unwrap().collective, c);
        }
    }

    #[test]
    fn datatypes_other_than_float_are_refused_with_a_reason() {
        let e = parse(&["all_reduce", "-d", "half"]).unwrap_err();
        assert!(e.contains("only float"), "{e}");
    }

    #[test]
    fn abi_outside_9_to_12_is_refused() {
        assert!(parse(&["sendrecv", "--abi", "8"]).is_err());
        assert!(parse(&["sendrecv", "--abi", "13"]).is_err());
        assert_eq!(parse(&["sendrecv", "--abi", "9"]).unwrap().abi, 9);
    }

    #[test]
    fn rank_needs_nranks_and_rendezvous() {
        assert!(parse(&["sendrecv", "--rank", "1"]).is_err());
        assert!(parse(&["sendrecv", "--rank", "2", "--nranks", "2", "--rendezvous", "h:1"]).is_err());
        let a = parse(&["sendrecv", "--rank", "1", "--nranks", "2", "--rendezvous", "10.0.0.1:29500"]).unwrap();
        assert_eq!((a.rank, a.nranks), (Some(1), Some(2)));
    }

    #[test]
    fn minbytes_above_maxbytes_is_refused() {
        assert!(parse(&["sendrecv", "-b", "2M", "-e", "1M"]).is_err());
    }

    #[test]
    fn window_is_bounded_by_nccl_max_requests() {
        assert!(parse(&["sendrecv", "--window", "33"]).is_err());
        assert!(parse(&["sendrecv", "--window", "0"]).is_err());
        assert_eq!(parse(&["sendrecv", "--window", "32"]).unwrap().window, 32);
    }

    #[test]
    fn job_signature_differs_when_a_shared_parameter_differs() {
        let a = parse(&["all_reduce", "-b", "1M"]).unwrap();
        let b = parse(&["all_reduce", "-b", "2M"]).unwrap();
        let c = parse(&["all_reduce", "-b", "1M", "-v", "--dev", "1"]).unwrap();
        assert_ne!(a.job_signature(), b.job_signature());
        // Per-rank choices (verbosity, device) may differ between ranks.
        assert_eq!(a.job_signature(), c.job_signature());
    }
}
