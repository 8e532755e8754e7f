//! Running a scenario: every scheme on every size (and with and without failures), repeated with
//! consecutive seeds, then averaged into a summary.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::engine::{RunResult, Sim};
use crate::scenario::{Scenario, ScenarioError};

/// The averaged figures of one (scheme, size, failures) case.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SummaryRow {
    /// Scheme.
    pub scheme: String,
    /// Message size, bytes.
    pub size: u64,
    /// Failures applied.
    pub failures: bool,
    /// Runs averaged.
    pub runs: usize,
    /// Runs that completed before the time limit.
    pub completed: usize,
    /// Mean CCT, µs.
    pub cct_us: f64,
    /// Lower bound, µs.
    pub bound_us: f64,
    /// Mean CCT increase over the bound, %.
    pub cct_increase_pct: f64,
    /// Mean busiest-NIC load at line rate, µs (see `RunResult::nic_load_us`).
    #[serde(default)]
    pub nic_load_us: f64,
    /// Mean of the largest switch queue, bytes.
    pub max_queue_bytes: f64,
    /// Mean time-averaged switch queue, bytes.
    pub avg_queue_bytes: f64,
    /// Mean of the largest queue between two switches (host-facing last hops left out), bytes.
    #[serde(default)]
    pub max_fabric_queue_bytes: f64,
    /// Largest queue per layer (mean over runs), bytes, by layer name.
    pub layer_max_queue: BTreeMap<String, f64>,
    /// Utilisation per layer (mean over runs).
    pub layer_utilisation: BTreeMap<String, f64>,
    /// Retransmissions per run.
    pub retransmissions: f64,
    /// Timeouts per run.
    pub timeouts: f64,
    /// Packets dropped by buffers per run.
    pub drops_overflow: f64,
    /// Packets dropped by failed links per run.
    pub drops_failed: f64,
    /// ECN marks per run.
    pub ecn_marks: f64,
    /// p99 reorder distance (max over runs).
    pub ooo_p99: u64,
    /// Time to reroute after a failure, µs (mean over runs).
    pub reroute_us: Option<f64>,
}

/// Everything one scenario produced.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExperimentResult {
    /// Scenario name.
    pub scenario: String,
    /// Its description.
    pub description: String,
    /// True for the scaled-down CI version.
    pub ci: bool,
    /// What the paper reports.
    pub paper: BTreeMap<String, String>,
    /// One row per (scheme, size, failures).
    pub summary: Vec<SummaryRow>,
    /// Slope of log(largest queue between switches) against log(size), per scheme (when sizes were
    /// swept). The host-facing last hop is left out: there every scheme carries the same data plus the
    /// host's own acknowledgements, slightly above line rate, whatever the load balancer does.
    pub queue_slope: BTreeMap<String, f64>,
    /// Every run.
    pub runs: Vec<RunResult>,
    /// Events processed over all runs.
    pub events: u64,
    /// Wall-clock seconds over all runs (their sum: each run's own time, whatever ran beside it).
    pub wall_s: f64,
    /// Events per second over all runs (`events` over `wall_s`: the speed of one run).
    pub events_per_s: f64,
    /// Runs that went at a time, each on its own thread (1 in results written before this existed).
    #[serde(default = "one")]
    pub jobs: usize,
    /// Wall-clock seconds of the whole scenario, from its first run's start to its last run's end.
    #[serde(default)]
    pub elapsed_s: f64,
}

fn one() -> usize {
    1
}

impl ExperimentResult {
    /// How fast the scenario ran: its events over the runs' own wall time, and with several jobs also
    /// over the scenario's.
    pub fn speed_summary(&self) -> String {
        let (runs, m_events) = (self.runs.len(), self.events as f64 / 1e6);
        if self.jobs > 1 && self.elapsed_s > 0.0 {
            format!(
                "{runs} runs, {m_events:.1} M events in {:.1} s of runs ({:.2} M events/s per run); {} at a time: {:.1} s wall ({:.2} M events/s)",
                self.wall_s,
                self.events_per_s / 1e6,
                self.jobs,
                self.elapsed_s,
                m_events / self.elapsed_s
            )
        } else {
            format!("{runs} runs, {m_events:.1} M events in {:.1} s wall ({:.2} M events/s)", self.wall_s, self.events_per_s / 1e6)
        }
    }

    /// The summary row of `scheme` at `size` (with `failures`).
    pub fn row(&self, scheme: &str, size: u64, failures: bool) -> Option<&SummaryRow> {
        self.summary.iter().find(|r| r.scheme == scheme && r.size == size && r.failures == failures)
    }

    /// The only or first row of `scheme` with `failures`.
    pub fn first(&self, scheme: &str, failures: bool) -> Option<&SummaryRow> {
        self.summary.iter().find(|r| r.scheme == scheme && r.failures == failures)
    }
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Least-squares slope of log(y) over log(x) (points with y ≤ 0 are taken as y = 1 byte).
pub fn loglog_slope(points: &[(f64, f64)]) -> f64 {
    let pts: Vec<(f64, f64)> = points.iter().map(|&(x, y)| (x.max(1e-12).ln(), y.max(1.0).ln())).collect();
    let n = pts.len() as f64;
    if pts.len() < 2 {
        return 0.0;
    }
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

/// Run every case of `sc`, one after the other. `progress` shows a bar per run; `ci` marks the result as
/// the CI version.
pub fn run_scenario(sc: &Scenario, progress: bool, ci: bool) -> Result<ExperimentResult, ScenarioError> {
    run_scenario_jobs(sc, progress, ci, 1)
}

/// Run every case of `sc`, up to `jobs` at a time, each on a thread of its own. The runs share nothing
/// (each builds its simulator from the scenario and its own seed), so the results are the same for any
/// `jobs` and come back in the same order; what changes is the wall time of a scenario with several
/// schemes, sizes or seeds (two 128-host 1 MiB all-to-alls side by side on 2 cores: 1.82 times the
/// events per second of one after the other, each run 4 % slower). Progress bars only with one job
/// (several would overwrite each other). After a case fails to build, no further case is started and
/// the first failure in case order is returned.
pub fn run_scenario_jobs(sc: &Scenario, progress: bool, ci: bool, jobs: usize) -> Result<ExperimentResult, ScenarioError> {
    let started = std::time::Instant::now();
    let sizes: Vec<Option<u64>> = if sc.sizes.is_empty() { vec![None] } else { sc.sizes.iter().copied().map(Some).collect() };
    let has_failures = sc.failures.random_link_prob > 0.0 || !sc.failures.links.is_empty();
    let variants: Vec<bool> = match (has_failures, sc.failures.with_baseline) {
        (false, _) => vec![false],
        (true, false) => vec![true],
        (true, true) => vec![false, true],
    };
    let mut cases = Vec::new();
    for &size in &sizes {
        for &fail in &variants {
            for scheme in &sc.schemes {
                for r in 0..sc.runs {
                    cases.push((size, fail, scheme, sc.seed + r as u64));
                }
            }
        }
    }
    let jobs = jobs.clamp(1, cases.len().max(1));
    let progress = progress && jobs == 1;
    let run_case = |i: usize| -> Result<RunResult, ScenarioError> {
        let (size, fail, scheme, seed) = cases[i];
        let mut sim = Sim::new(sc, scheme, size, fail, seed)?;
        if progress {
            let label = format!("{} {}{}", scheme.name, size.map(human_bytes).unwrap_or_default(), if fail { " fail" } else { "" });
            let expect = sim.bound_us() * 1.5;
            sim = sim.with_progress(&label, expect);
        }
        let res = sim.run(size.unwrap_or(0), fail);
        tracing::info!(scheme = %res.scheme, size = res.size, cct_us = res.cct_us, events = res.events, "run done");
        Ok(res)
    };
    // Each worker takes the next case not yet taken (none once a case failed); results go to the case's
    // own slot. With one job, one worker runs the cases in order.
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let mut done: Vec<Option<Result<RunResult, ScenarioError>>> = (0..cases.len()).map(|_| None).collect();
    let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
    let slots = std::sync::Mutex::new(&mut done);
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= cases.len() || failed.load(Ordering::Relaxed) {
                    break;
                }
                let res = run_case(i);
                failed.fetch_or(res.is_err(), Ordering::Relaxed);
                // A worker that panicked poisoned the lock; its panic ends the scope anyway.
                if let Ok(mut slots) = slots.lock() {
                    slots[i] = Some(res);
                }
            });
        }
    });
    // Without a failure every case ran; with one, the first in case order is the answer.
    let mut runs = Vec::with_capacity(cases.len());
    for res in done.into_iter().flatten() {
        runs.push(res?);
    }
    let mut summary = Vec::new();
    for &size in &sizes {
        for &fail in &variants {
            for scheme in &sc.schemes {
                let rs: Vec<&RunResult> =
                    runs.iter().filter(|r| r.scheme == scheme.name && r.size == size.unwrap_or(0) && r.failures == fail).collect();
                let mut layer_max_queue = BTreeMap::new();
                let mut layer_utilisation = BTreeMap::new();
                for l in &rs[0].layers {
                    let same = |r: &&RunResult| r.layers.iter().find(|x| x.layer == l.layer).cloned().unwrap_or_default();
                    layer_max_queue.insert(l.layer.clone(), mean(rs.iter().map(|r| same(r).max_queue_bytes as f64)));
                    layer_utilisation.insert(l.layer.clone(), mean(rs.iter().map(|r| same(r).utilisation)));
                }
                let reroutes: Vec<f64> = rs.iter().filter_map(|r| r.reroute_us).collect();
                summary.push(SummaryRow {
                    scheme: scheme.name.clone(),
                    size: size.unwrap_or(0),
                    failures: fail,
                    runs: rs.len(),
                    completed: rs.iter().filter(|r| r.completed).count(),
                    cct_us: mean(rs.iter().map(|r| r.cct_us)),
                    bound_us: mean(rs.iter().map(|r| r.bound_us)),
                    cct_increase_pct: mean(rs.iter().map(|r| r.cct_increase_pct)),
                    nic_load_us: mean(rs.iter().map(|r| r.nic_load_us)),
                    max_queue_bytes: mean(rs.iter().map(|r| r.max_switch_queue_bytes as f64)),
                    avg_queue_bytes: mean(rs.iter().map(|r| r.avg_switch_queue_bytes)),
                    max_fabric_queue_bytes: mean(rs.iter().map(|r| r.max_fabric_queue_bytes as f64)),
                    layer_max_queue,
                    layer_utilisation,
                    retransmissions: mean(rs.iter().map(|r| r.proto.retransmissions as f64)),
                    timeouts: mean(rs.iter().map(|r| r.proto.timeouts as f64)),
                    drops_overflow: mean(rs.iter().map(|r| r.layers.iter().map(|l| l.drops_overflow).sum::<u64>() as f64)),
                    drops_failed: mean(rs.iter().map(|r| r.layers.iter().map(|l| l.drops_failed).sum::<u64>() as f64)),
                    ecn_marks: mean(rs.iter().map(|r| r.layers.iter().map(|l| l.ecn_marks).sum::<u64>() as f64)),
                    ooo_p99: rs.iter().map(|r| r.ooo_p99).max().unwrap_or(0),
                    reroute_us: (!reroutes.is_empty()).then(|| mean(reroutes.iter().copied())),
                });
            }
        }
    }
    let queue_slope = queue_slopes(&summary);
    let events: u64 = runs.iter().map(|r| r.events).sum();
    let wall_s: f64 = runs.iter().map(|r| r.wall_s).sum();
    Ok(ExperimentResult {
        scenario: sc.name.clone(),
        description: sc.description.clone(),
        ci,
        paper: sc.paper.clone(),
        summary,
        queue_slope,
        runs,
        events,
        wall_s,
        events_per_s: events as f64 / wall_s.max(1e-9),
        jobs,
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

/// Per scheme, the slope of log(largest queue between switches) over log(message size), when at least
/// three sizes were run (with the first failure variant present: a scenario may have only failure rows).
pub fn queue_slopes(summary: &[SummaryRow]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some(first) = summary.first() else {
        return out;
    };
    let variant = first.failures;
    let mut sizes: Vec<u64> = summary.iter().map(|r| r.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.len() < 3 {
        return out;
    }
    for r in summary {
        if out.contains_key(&r.scheme) {
            continue;
        }
        let pts: Vec<(f64, f64)> = summary
            .iter()
            .filter(|x| x.scheme == r.scheme && x.failures == variant)
            .map(|x| (x.size as f64, x.max_fabric_queue_bytes))
            .collect();
        out.insert(r.scheme.clone(), loglog_slope(&pts));
    }
    out
}

/// `4 KiB`, `16 MiB`, ...
pub fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut i = 0;
    while x >= 1024.0 && i < U.len() - 1 {
        x /= 1024.0;
        i += 1;
    }
    if (x - x.round()).abs() < 1e-9 {
        format!("{} {}", x.round() as u64, U[i])
    } else {
        format!("{x:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loglog_slope_recovers_power_laws() {
        let lin: Vec<_> = (1..6).map(|i| (i as f64 * 10.0, i as f64 * 30.0)).collect();
        assert!((loglog_slope(&lin) - 1.0).abs() < 1e-9);
        let sqrt: Vec<_> = (1..6).map(|i| ((i * i) as f64, i as f64 * 100.0)).collect();
        assert!((loglog_slope(&sqrt) - 0.5).abs() < 1e-9);
        let flat: Vec<_> = (1..6).map(|i| (i as f64, 7.0)).collect();
        assert!(loglog_slope(&flat).abs() < 1e-9);
    }

    #[test]
    fn human_bytes_uses_binary_units() {
        assert_eq!(human_bytes(4096), "4 KiB");
        assert_eq!(human_bytes(16 << 20), "16 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
