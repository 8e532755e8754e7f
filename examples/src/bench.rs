//! One rank of a prism-perf run: rendezvous, plugin, connections, then for each size warm-up, timed
//! iterations and a check pass; rank 0 gathers the timings and prints the table.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::cli::Args;
use crate::coll::{self, Buffers, Collective, Counts, ExecConfig};
use crate::data;
use crate::net::{DeviceProps, Place, Plugin, ShimTransport, Transport, ELEM_BYTES};
use crate::rendezvous::Rendezvous;
use crate::report::{self, HeaderInfo, JsonPlugin, JsonReport, RankInfo, SizeResult};

/// First line a spawned rank 0 prints on stdout: the address its rendezvous listens on.
pub const ANNOUNCE: &str = "PRISM_PERF_RENDEZVOUS";

/// The plugin file name NCCL derives from `NCCL_NET_PLUGIN=prism`.
pub const DEFAULT_PLUGIN: &str = "libnccl-net-prism.so";

/// Where to look for the plugin, in order: `--plugin` (else `$NCCL_NET_PLUGIN`'s first entry) read the
/// way NCCL reads it (as given, then `libnccl-net-<name>.so` for a bare name), else
/// `libnccl-net-prism.so` next to the executable.
pub fn plugin_candidates(arg: Option<&str>, env: Option<&str>, exe_dir: Option<&Path>) -> Vec<PathBuf> {
    let named =
        arg.map(str::to_string).or_else(|| env.and_then(|e| e.split(',').map(str::trim).find(|s| !s.is_empty()).map(str::to_string)));
    match named {
        Some(name) => {
            let mut v = vec![PathBuf::from(&name)];
            let is_lib_so = name.starts_with("lib") && name.ends_with(".so");
            if !name.contains('/') && !is_lib_so {
                v.push(PathBuf::from(format!("libnccl-net-{name}.so")));
            }
            v
        }
        None => vec![exe_dir.map_or_else(|| PathBuf::from(DEFAULT_PLUGIN), |d| d.join(DEFAULT_PLUGIN))],
    }
}

fn open_plugin(args: &Args) -> Result<Plugin> {
    let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf));
    let env = std::env::var("NCCL_NET_PLUGIN").ok();
    let candidates = plugin_candidates(args.plugin.as_deref(), env.as_deref(), exe_dir.as_deref());
    let mut errors = Vec::new();
    for c in &candidates {
        match Plugin::open(c, args.abi) {
            Ok(p) => return Ok(p),
            Err(e) => errors.push(e.to_string()),
        }
    }
    bail!("no usable plugin (give --plugin PATH): {}", errors.join("; "))
}

fn prism_env() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::env::vars().filter(|(k, _)| k.starts_with("PRISM_")).collect();
    v.sort();
    v
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "?".into())
}

/// A communicator id every rank agrees on (rank 0 picks it), passed to a v11/v12 `init`.
fn fresh_comm_id() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ (u64::from(std::process::id()) << 32) ^ 0x5052_4953_4d00_0000
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() & 1 != 0 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// Which plugin lines reach stderr (0 WARN, 1 +INFO, 2 +TRACE): the more verbose of `-v` and
/// `$NCCL_DEBUG`, which is what NCCL's own logger would honour.
pub fn log_verbosity(v_flags: u8, nccl_debug: Option<&str>) -> u8 {
    let from_env = match nccl_debug.map(str::to_ascii_uppercase).as_deref() {
        Some("TRACE") => 2,
        Some("INFO") => 1,
        _ => 0,
    };
    v_flags.min(2).max(from_env)
}

/// The `NCCL_DEBUG` value that lets a plugin emit the lines of `verbosity` (None: leave it alone).
pub fn nccl_debug_for(verbosity: u8) -> Option<&'static str> {
    match verbosity {
        0 => None,
        1 => Some("INFO"),
        _ => Some("TRACE"),
    }
}

/// The largest counts over the sweep, to size the buffers once.
pub fn max_counts(coll: Collective, sizes: &[usize], nranks: usize) -> Counts {
    sizes.iter().map(|&s| coll.counts(s, nranks)).fold(Counts { send: 0, recv: 0, param: 0 }, |a, c| Counts {
        send: a.send.max(c.send),
        recv: a.recv.max(c.recv),
        param: a.param.max(c.param),
    })
}

/// What one rank measured at one size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankMeasure {
    /// Average µs per iteration.
    pub time_us: f64,
    /// Wrong elements in the check pass (None without -c).
    pub wrong: Option<usize>,
}

/// Runs warm-up, timed iterations and the check pass of one size on this rank.
pub fn measure_size(
    t: &mut dyn Transport,
    rv: &mut Rendezvous,
    args: &Args,
    bufs: Buffers,
    bytes: usize,
    exec: &ExecConfig,
) -> Result<RankMeasure> {
    let coll = args.collective;
    let (rank, n) = (t.rank(), t.nranks());
    let counts = coll.counts(bytes, n);
    let slice = (args.slice / ELEM_BYTES).max(1);
    let plan = coll::plan(coll, rank, n, counts, bufs, slice);
    data::prepare(t, bufs, counts, 0)?;
    for _ in 0..args.warmup {
        coll::execute(t, &plan, exec)?;
    }
    rv.barrier()?;
    let start = Instant::now();
    for _ in 0..args.iters {
        coll::execute(t, &plan, exec)?;
    }
    let time_us = start.elapsed().as_secs_f64() * 1e6 / args.iters as f64;
    let wrong = if args.check == 1 {
        // A dedicated pass with different data, so a buffer left over from the timed runs is caught.
        data::prepare(t, bufs, counts, 1)?;
        coll::execute(t, &plan, exec)?;
        Some(data::count_wrong(t, coll, bufs, counts, 1)?)
    } else {
        None
    };
    Ok(RankMeasure { time_us, wrong })
}

/// Combines every rank's measure into the row rank 0 prints: time is the slowest rank's.
pub fn combine(coll: Collective, bytes: usize, nranks: usize, all: &[RankMeasure]) -> SizeResult {
    let counts = coll.counts(bytes, nranks);
    let time_us = all.iter().map(|m| m.time_us).fold(0.0, f64::max);
    let wrong = all.iter().map(|m| m.wrong).try_fold(0usize, |acc, w| w.map(|w| acc + w));
    let (algbw, busbw) = crate::bw::bandwidths(coll, counts.param, nranks, time_us);
    SizeResult { bytes: counts.size_bytes(), count: counts.param, time_us, algbw, busbw, wrong }
}

/// Every size of the sweep on an established transport; rank 0 gets the rows (others an empty list).
pub fn run_sweep(
    t: &mut dyn Transport,
    rv: &mut Rendezvous,
    args: &Args,
    bufs: Buffers,
    on_row: &mut dyn FnMut(&SizeResult),
) -> Result<Vec<SizeResult>> {
    let exec = ExecConfig { window: args.window, max_inflight: 256, timeout: Duration::from_secs(args.timeout_s) };
    let (rank, n) = (t.rank(), t.nranks());
    let mut rows = Vec::new();
    for bytes in args.sizes() {
        // Spawned ranks' lines get a "[rank r]" prefix from the launcher already.
        let who = if args.spawned { String::new() } else { format!("rank {rank}: ") };
        eprintln!(
            "prism-perf: {who}{} {} B: {} warm-up, {} timed{}",
            args.collective.name(),
            bytes,
            args.warmup,
            args.iters,
            if args.check == 1 { ", 1 check" } else { "" }
        );
        let m = measure_size(t, rv, args, bufs, bytes, &exec).with_context(|| format!("size {bytes} B"))?;
        let all = rv.allgather(json!({"time_us": m.time_us, "wrong": m.wrong}))?;
        if rank == 0 {
            let measures: Vec<RankMeasure> = all
                .iter()
                .map(|v| RankMeasure {
                    time_us: v.get("time_us").and_then(Value::as_f64).unwrap_or(f64::INFINITY),
                    wrong: v.get("wrong").and_then(Value::as_u64).map(|w| w as usize),
                })
                .collect();
            let row = combine(args.collective, bytes, n, &measures);
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Where rank `rank` asks the plugin to write its statistics when `--json FILE` is given.
pub fn stats_path(json: &std::path::Path, rank: usize) -> String {
    format!("{}.rank{rank}.stats.json", json.display())
}

/// Runs this process as `rank` of `nranks`; returns whether every check passed (rank 0 knows; the
/// others return true unless they failed).
pub fn run_rank(args: &Args, rank: usize, nranks: usize) -> Result<bool> {
    let timeout = Duration::from_secs(args.timeout_s);
    if let Some(json) = &args.json {
        // Ask the plugin for its statistics (PRISM_STATS) unless the user chose a file already; this
        // happens before the plugin is loaded, while the process has no other thread.
        if std::env::var_os("PRISM_STATS").is_none() {
            std::env::set_var("PRISM_STATS", stats_path(json, rank));
        }
    }
    let mut rv = if nranks == 1 {
        Rendezvous::single()
    } else if rank == 0 {
        let addr = args.rendezvous.as_deref().ok_or_else(|| anyhow!("--rendezvous is required"))?;
        let listener = Rendezvous::bind(addr)?;
        if args.spawned {
            // The local launcher waits for this line to start the other ranks.
            let mut out = std::io::stdout().lock();
            writeln!(out, "{ANNOUNCE} {}", listener.local_addr()?)?;
            out.flush()?;
        }
        Rendezvous::serve(listener, nranks, timeout)?
    } else {
        let addr = args.rendezvous.as_deref().ok_or_else(|| anyhow!("--rendezvous is required"))?;
        Rendezvous::join(addr, rank, nranks, timeout)?
    };
    match run_connected(args, &mut rv) {
        Ok(ok) => Ok(ok),
        Err(e) => {
            rv.abort(&format!("{e:#}"));
            Err(e)
        }
    }
}

fn run_connected(args: &Args, rv: &mut Rendezvous) -> Result<bool> {
    let (rank, nranks) = (rv.rank(), rv.nranks());
    let timeout = Duration::from_secs(args.timeout_s);
    let me = json!({
        "signature": args.job_signature(),
        "host": host_name(),
        "pid": std::process::id(),
        "dev": args.dev,
        "comm_id": if rank == 0 { fresh_comm_id() } else { 0 },
    });
    let hello = rv.allgather(me)?;
    let my_sig = args.job_signature();
    for (r, h) in hello.iter().enumerate() {
        let sig = h.get("signature").and_then(Value::as_str).unwrap_or("");
        if sig != my_sig {
            bail!("rank {r} runs a different job: \"{sig}\" (this rank: \"{my_sig}\")");
        }
    }
    let comm_id = hello[0].get("comm_id").and_then(Value::as_u64).unwrap_or(0);
    let ranks: Vec<RankInfo> = hello
        .iter()
        .enumerate()
        .map(|(r, h)| RankInfo {
            rank: r,
            host: h.get("host").and_then(Value::as_str).unwrap_or("?").to_string(),
            pid: h.get("pid").and_then(Value::as_u64).unwrap_or(0) as u32,
            dev: h.get("dev").and_then(Value::as_u64).unwrap_or(0) as usize,
        })
        .collect();

    let verbosity = log_verbosity(args.verbose, std::env::var("NCCL_DEBUG").ok().as_deref());
    if let Some(level) = nccl_debug_for(verbosity) {
        // Plugins read NCCL_DEBUG to skip formatting lines NCCL would drop, as NCCL itself filters by
        // it. No other thread runs yet, so changing the environment here races with nothing.
        std::env::set_var("NCCL_DEBUG", level);
    }
    Plugin::set_verbosity(verbosity);
    let mut plugin = open_plugin(args)?;
    plugin.init(comm_id).context("plugin init")?;
    let ndev = plugin.devices()?;
    if args.dev >= ndev {
        bail!("--dev {}: the plugin has {ndev} device(s)", args.dev);
    }
    let devices: Vec<DeviceProps> = (0..ndev).map(|d| plugin.properties(d)).collect::<Result<_, _>>()?;
    let (plugin_path, plugin_name, abi) = (plugin.path().display().to_string(), plugin.name().to_string(), plugin.version());

    let (send_peers, recv_peers) = args.collective.peers(rank, nranks);
    let exchange = Box::new(|mine: Vec<(usize, Vec<u8>)>| -> Result<Vec<(usize, Vec<u8>)>, String> {
        let listen: Vec<Value> = mine.iter().map(|(p, h)| json!([p, hex(h)])).collect();
        let all = rv.allgather(json!({ "listen": listen })).map_err(|e| e.to_string())?;
        let mut theirs = Vec::new();
        for &p in &send_peers {
            // Peer p listened for this rank: its entry keyed by our rank.
            let entry = all
                .get(p)
                .and_then(|v| v.get("listen"))
                .and_then(Value::as_array)
                .and_then(|l| l.iter().find(|e| e.get(0).and_then(Value::as_u64) == Some(rank as u64)))
                .ok_or_else(|| format!("rank {p} did not listen for rank {rank}"))?;
            let h = entry.get(1).and_then(Value::as_str).and_then(unhex).ok_or_else(|| format!("bad handle from rank {p}"))?;
            theirs.push((p, h));
        }
        Ok(theirs)
    });
    let place = Place { dev: args.dev, rank, nranks };
    let mut t = ShimTransport::establish(plugin, place, &send_peers, &recv_peers, exchange, timeout)?;

    let sizes = args.sizes();
    let bufs = Buffers::alloc(&mut t, args.collective, max_counts(args.collective, &sizes, nranks))?;
    let header_info = HeaderInfo {
        collective: args.collective,
        nranks,
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        step_factor: args.step_factor,
        step_bytes: args.step_bytes,
        warmup: args.warmup,
        iters: args.iters,
        check: args.check == 1,
        plugin_path: plugin_path.clone(),
        plugin_name: plugin_name.clone(),
        abi,
        devices: devices.clone(),
        ranks,
        env: prism_env(),
        window: args.window,
        slice_bytes: args.slice,
    };
    if rank == 0 {
        print!("{}", report::header(&header_info));
        std::io::stdout().flush()?;
    }
    let coll = args.collective;
    let mut print_row = |r: &SizeResult| {
        println!("{}", report::row(coll, r));
        let _ = std::io::stdout().flush();
    };
    let rows = run_sweep(&mut t, rv, args, bufs, &mut print_row)?;
    // Nobody closes comms a peer may still be receiving on.
    rv.barrier()?;
    t.close().context("closing comms")?;

    if rank != 0 {
        return Ok(true);
    }
    print!("{}", report::footer(&rows));
    std::io::stdout().flush()?;
    if let Some(path) = &args.json {
        let doc = JsonReport {
            command: crate::launch::user_command(&std::env::args().collect::<Vec<_>>(), args.spawned),
            collective: coll,
            nranks,
            datatype: "float",
            redop: if coll.is_reduction() { "sum" } else { "none" },
            in_place: false,
            plugin: JsonPlugin { path: plugin_path, name: plugin_name, abi, devices },
            out_of_bounds: report::out_of_bounds(&rows),
            avg_busbw: report::avg_busbw(&rows),
            results: rows.clone(),
            stats_files: match std::env::var("PRISM_STATS") {
                Ok(p) if p == stats_path(path, 0) => (0..nranks).map(|r| stats_path(path, r)).collect(),
                Ok(p) if !p.is_empty() => vec![p],
                _ => Vec::new(),
            },
            // This rank's plugin wrote its file when the comms closed (v11/v12 finalize).
            stats: std::env::var("PRISM_STATS")
                .ok()
                .and_then(|p| std::fs::read_to_string(p.replace("%p", &std::process::id().to_string())).ok())
                .and_then(|t| serde_json::from_str(&t).ok()),
        };
        let text = serde_json::to_string_pretty(&doc)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(report::out_of_bounds(&rows) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_plugin_name_also_tries_libnccl_net_name_so() {
        let c = plugin_candidates(Some("prism"), None, None);
        assert_eq!(c, vec![PathBuf::from("prism"), PathBuf::from("libnccl-net-prism.so")]);
    }

    #[test]
    fn a_path_or_lib_so_name_is_used_as_given() {
        assert_eq!(plugin_candidates(Some("./x/libfoo.so"), None, None), vec![PathBuf::from("./x/libfoo.so")]);
        assert_eq!(plugin_candidates(Some("libfoo.so"), None, None), vec![PathBuf::from("libfoo.so")]);
    }

    #[test]
    fn nccl_net_plugin_is_used_when_no_flag_is_given() {
        let c = plugin_candidates(None, Some(" prism , other"), Some(Path::new("/opt/bin")));
        assert_eq!(c[1], PathBuf::from("libnccl-net-prism.so"));
        let flag_wins = plugin_candidates(Some("libx.so"), Some("prism"), None);
        assert_eq!(flag_wins, vec![PathBuf::from("libx.so")]);
    }

    #[test]
    fn default_plugin_sits_next_to_the_executable() {
        let c = plugin_candidates(None, None, Some(Path::new("target/release")));
        assert_eq!(c, vec![Path::new("target/release").join("libnccl-net-prism.so")]);
    }

    #[test]
    fn verbosity_is_the_more_verbose_of_v_and_nccl_debug() {
        assert_eq!(log_verbosity(0, None), 0);
        assert_eq!(log_verbosity(1, Some("WARN")), 1);
        assert_eq!(log_verbosity(0, Some("info")), 1);
        assert_eq!(log_verbosity(1, Some("TRACE")), 2);
        assert_eq!(log_verbosity(5, None), 2);
        assert_eq!(nccl_debug_for(1), Some("INFO"));
        assert_eq!(nccl_debug_for(0), None);
    }

    #[test]
    fn handles_survive_the_hex_round_trip() {
        let h: Vec<u8> = (0..=255u8).collect();
        assert_eq!(unhex(&hex(&h)).unwrap(), h);
        assert!(unhex("abc").is_none());
        assert!(unhex("zz").is_none());
    }

    #[test]
    fn combined_time_is_the_slowest_rank_and_wrong_is_summed() {
        let all = [RankMeasure { time_us: 10.0, wrong: Some(1) }, RankMeasure { time_us: 30.0, wrong: Some(2) }];
        let r = combine(Collective::SendRecv, 4000, 2, &all);
        assert_eq!((r.time_us, r.wrong, r.count, r.bytes), (30.0, Some(3), 1000, 4000));
        let unchecked = [RankMeasure { time_us: 1.0, wrong: None }, RankMeasure { time_us: 1.0, wrong: None }];
        assert_eq!(combine(Collective::SendRecv, 4000, 2, &unchecked).wrong, None);
    }

    #[test]
    fn a_sweep_over_the_in_memory_network_gives_rank_0_one_checked_row_per_size() {
        use crate::memnet::{mesh, MemNetConfig};
        use clap::Parser;
        let n = 3;
        let args =
            Args::try_parse_from(["prism-perf", "all_reduce", "-b", "1K", "-e", "64K", "-f", "4", "-n", "2", "--slice", "1K"]).unwrap();
        let listener = Rendezvous::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (_net, ranks) = mesh(n, MemNetConfig::lossless(11));
        let mut listener = Some(listener);
        let threads: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, mut t)| {
                let args = args.clone();
                let addr = addr.clone();
                let listener = listener.take();
                std::thread::spawn(move || {
                    let timeout = Duration::from_secs(20);
                    let mut rv = match listener {
                        Some(l) => Rendezvous::serve(l, n, timeout).unwrap(),
                        None => Rendezvous::join(&addr, r, n, timeout).unwrap(),
                    };
                    let sizes = args.sizes();
                    let bufs = Buffers::alloc(&mut t, args.collective, max_counts(args.collective, &sizes, n)).unwrap();
                    let mut printed = 0;
                    let rows = run_sweep(&mut t, &mut rv, &args, bufs, &mut |_| printed += 1).unwrap();
                    (rows, printed)
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let (rows, printed) = &results[0];
        assert_eq!(rows.iter().map(|r| r.bytes).collect::<Vec<_>>(), vec![1024, 4096, 16384, 65536]);
        assert_eq!(*printed, 4);
        assert!(rows.iter().all(|r| r.wrong == Some(0) && r.time_us > 0.0 && r.busbw > 0.0), "{rows:?}");
        assert!(results[1].0.is_empty() && results[2].0.is_empty(), "only rank 0 reports rows");
    }

    #[test]
    fn buffers_are_sized_for_the_largest_size_of_the_sweep() {
        let m = max_counts(Collective::ReduceScatter, &[1024, 4096, 2048], 4);
        assert_eq!((m.send, m.recv, m.param), (1024, 256, 256));
    }
}
