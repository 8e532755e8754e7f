//! nccl-tests-style output: the header comment block, one row per size, the footer; and the JSON file.

use std::fmt::Write as _;

use serde::Serialize;

use crate::coll::Collective;
use crate::net::DeviceProps;

/// The result of one size, as rank 0 reports it (time is the slowest rank's average).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SizeResult {
    /// nccl-tests' size column: the larger of the send and receive buffers, in bytes.
    pub bytes: usize,
    /// nccl-tests' count column (elements).
    pub count: usize,
    /// Average time per iteration in µs, the maximum over ranks.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements summed over ranks (`None` without -c).
    pub wrong: Option<usize>,
}

/// One rank as the header lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankInfo {
    /// Rank.
    pub rank: usize,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Net device index.
    pub dev: usize,
}

/// What the header shows.
#[derive(Debug, Clone, Serialize)]
pub struct HeaderInfo {
    /// The collective.
    pub collective: Collective,
    /// Ranks in the job.
    pub nranks: usize,
    /// -b, -e, -f, -i.
    pub min_bytes: usize,
    /// -e.
    pub max_bytes: usize,
    /// -f.
    pub step_factor: usize,
    /// -i.
    pub step_bytes: usize,
    /// -w.
    pub warmup: usize,
    /// -n.
    pub iters: usize,
    /// -c.
    pub check: bool,
    /// Where the plugin was loaded from.
    pub plugin_path: String,
    /// The table's name.
    pub plugin_name: String,
    /// ABI version used.
    pub abi: u32,
    /// Every device the plugin reported.
    pub devices: Vec<DeviceProps>,
    /// Every rank.
    pub ranks: Vec<RankInfo>,
    /// `PRISM_*` variables of rank 0's environment.
    pub env: Vec<(String, String)>,
    /// Requests in flight per comm.
    pub window: usize,
    /// Largest message, bytes.
    pub slice_bytes: usize,
}

/// The comment block above the table, ending with the column titles.
pub fn header(h: &HeaderInfo) -> String {
    let mut s = String::new();
    let step = if h.step_factor > 1 { format!("{}(factor)", h.step_factor) } else { format!("{}(bytes)", h.step_bytes) };
    let _ = writeln!(
        s,
        "# prism-perf {}: nRanks {} minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} validation: {}",
        h.collective.name(),
        h.nranks,
        h.min_bytes,
        h.max_bytes,
        step,
        h.warmup,
        h.iters,
        u8::from(h.check)
    );
    let _ = writeln!(s, "# Host memory; data type float only; redop sum; out-of-place only (no in-place columns)");
    let _ = writeln!(s, "#");
    let _ = writeln!(
        s,
        "# Plugin: {} name \"{}\" ABI v{} (ncclNetPlugin_v{}), {} device(s)",
        h.plugin_path,
        h.plugin_name,
        h.abi,
        h.abi,
        h.devices.len()
    );
    for d in &h.devices {
        let pci = if d.pci_path.is_empty() { "-" } else { d.pci_path.as_str() };
        let _ = writeln!(
            s,
            "#  dev {}: \"{}\" speed {} Mbps ptrSupport 0x{:x} maxRecvs {} maxComms {} maxP2pBytes {} pci {} guid {:#018x}",
            d.dev, d.name, d.speed_mbps, d.ptr_support, d.max_recvs, d.max_comms, d.max_p2p_bytes, pci, d.guid
        );
    }
    let _ = writeln!(s, "# Using devices");
    for r in &h.ranks {
        let name = h.devices.iter().find(|d| d.dev == r.dev).map_or("?", |d| d.name.as_str());
        let _ = writeln!(s, "#  Rank {:2} Pid {:7} on {:>12} net device {} [{}]", r.rank, r.pid, r.host, r.dev, name);
    }
    if h.env.is_empty() {
        let _ = writeln!(s, "# Env: no PRISM_* variables set");
    } else {
        let vars: Vec<String> = h.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(s, "# Env: {}", vars.join(" "));
    }
    let _ = writeln!(s, "# Window {} requests per comm, messages of at most {} bytes", h.window, h.slice_bytes);
    let _ = writeln!(s, "#");
    let _ = writeln!(s, "#{:>62}", "out-of-place");
    let _ = writeln!(
        s,
        "#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
    );
    let _ = writeln!(
        s,
        "#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    s
}

fn time_str(us: f64) -> String {
    // nccl-tests keeps the column 7 wide by dropping decimals as the time grows.
    if us < 10_000.0 {
        format!("{us:7.2}")
    } else if us < 100_000.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.0}")
    }
}

/// One table row.
pub fn row(coll: Collective, r: &SizeResult) -> String {
    let redop = if coll.is_reduction() { "sum" } else { "none" };
    let wrong = r.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {}  {:6.2}  {:6.2}  {:>6}",
        r.bytes,
        r.count,
        "float",
        redop,
        -1,
        time_str(r.time_us),
        r.algbw,
        r.busbw,
        wrong
    )
}

/// Wrong elements over all sizes.
pub fn out_of_bounds(results: &[SizeResult]) -> usize {
    results.iter().filter_map(|r| r.wrong).sum()
}

/// Mean bus bandwidth over sizes (nccl-tests' "Avg bus bandwidth").
pub fn avg_busbw(results: &[SizeResult]) -> f64 {
    if results.is_empty() {
        0.0
    } else {
        results.iter().map(|r| r.busbw).sum::<f64>() / results.len() as f64
    }
}

/// The lines below the table.
pub fn footer(results: &[SizeResult]) -> String {
    let wrong = out_of_bounds(results);
    format!(
        "# Out of bounds values : {} {}\n# Avg bus bandwidth    : {:.6} \n#\n",
        wrong,
        if wrong == 0 { "OK" } else { "FAILED" },
        avg_busbw(results)
    )
}

/// The `--json` file.
#[derive(Debug, Clone, Serialize)]
pub struct JsonReport {
    /// The command line of this process.
    pub command: Vec<String>,
    /// The collective.
    pub collective: Collective,
    /// Ranks.
    pub nranks: usize,
    /// Element type.
    pub datatype: &'static str,
    /// Reduction, or "none".
    pub redop: &'static str,
    /// Always false: out-of-place only.
    pub in_place: bool,
    /// The plugin and its devices.
    pub plugin: JsonPlugin,
    /// Per size.
    pub results: Vec<SizeResult>,
    /// Wrong elements over all sizes.
    pub out_of_bounds: usize,
    /// Mean busbw over sizes, GB/s.
    pub avg_busbw: f64,
    /// Where each rank's plugin wrote its counters (`PRISM_STATS`; set per rank by `--json`).
    pub stats_files: Vec<String>,
    /// Rank 0's plugin statistics (per comm, per path: bytes, packets, retransmissions, RTT), when
    /// the plugin wrote them before this file (ABI v11/v12 write them at finalize).
    pub stats: Option<serde_json::Value>,
}

/// The plugin part of the JSON file.
#[derive(Debug, Clone, Serialize)]
pub struct JsonPlugin {
    /// Loaded from.
    pub path: String,
    /// Table name.
    pub name: String,
    /// ABI version.
    pub abi: u32,
    /// Devices.
    pub devices: Vec<DeviceProps>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(bytes: usize, busbw: f64, wrong: Option<usize>) -> SizeResult {
        SizeResult { bytes, count: bytes / 4, time_us: 123.456, algbw: busbw / 2.0, busbw, wrong }
    }

    #[test]
    fn row_columns_line_up_with_the_titles() {
        let h = HeaderInfo {
            collective: Collective::AllReduce,
            nranks: 2,
            min_bytes: 1,
            max_bytes: 2,
            step_factor: 2,
            step_bytes: 0,
            warmup: 1,
            iters: 20,
            check: true,
            plugin_path: "p.so".into(),
            plugin_name: "Prism".into(),
            abi: 12,
            devices: Vec::new(),
            ranks: Vec::new(),
            env: Vec::new(),
            window: 8,
            slice_bytes: 524288,
        };
        let head = header(&h);
        let titles = head.lines().rev().nth(1).unwrap();
        let line = row(Collective::AllReduce, &result(1048576, 1.5, Some(0)));
        assert_eq!(titles.len(), line.len(), "\n{titles}\n{line}");
        // Each title ends where its value ends.
        for title in ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"] {
            let end = titles.find(title).unwrap() + title.len();
            assert_ne!(line.as_bytes()[end - 1], b' ', "column {title} in\n{titles}\n{line}");
        }
    }

    #[test]
    fn footer_says_failed_when_any_size_had_wrong_elements() {
        let ok = footer(&[result(8, 1.0, Some(0)), result(16, 3.0, Some(0))]);
        assert!(ok.contains("Out of bounds values : 0 OK"), "{ok}");
        assert!(ok.contains("Avg bus bandwidth    : 2.000000"), "{ok}");
        let bad = footer(&[result(8, 1.0, Some(0)), result(16, 3.0, Some(5))]);
        assert!(bad.contains("Out of bounds values : 5 FAILED"), "{bad}");
    }

    #[test]
    fn unchecked_sizes_print_na_and_do_not_count_as_wrong() {
        let r = result(8, 1.0, None);
        assert!(row(Collective::SendRecv, &r).ends_with("N/A"));
        assert_eq!(out_of_bounds(&[r]), 0);
    }

    #[test]
    fn redop_column_says_none_for_data_movement() {
        let r = result(8, 1.0, Some(0));
        assert!(row(Collective::AllGather, &r).contains(" none "));
        assert!(row(Collective::ReduceScatter, &r).contains(" sum "));
    }
}
