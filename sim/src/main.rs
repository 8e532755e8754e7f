//! `prism-sim run FILE [--json OUT] [--ci]` runs one scenario; `prism-sim all [DIR]` runs every
//! scenario of a folder. Each run writes JSON, a markdown summary and SVG charts.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use prism_sim::{report, run_scenario_jobs, Scenario};

#[derive(Parser)]
#[command(name = "prism-sim", about = "Packet-level fabric simulator running Prism's own lb and proto")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one scenario file.
    Run {
        /// The scenario (JSON).
        file: PathBuf,
        /// Write the full result JSON here (default: OUT_DIR/NAME.json).
        #[arg(long)]
        json: Option<PathBuf>,
        /// Folder for the markdown summary and SVG charts.
        #[arg(long, default_value = "target/sim")]
        out_dir: PathBuf,
        /// Run the scenario's scaled-down CI version.
        #[arg(long)]
        ci: bool,
        /// No progress bars.
        #[arg(long)]
        quiet: bool,
        /// Run only the schemes with these names (repeatable).
        #[arg(long)]
        scheme: Vec<String>,
        /// Run only these message sizes, bytes (repeatable).
        #[arg(long)]
        size: Vec<u64>,
        /// Runs (schemes, sizes, seeds) at a time, each on its own thread; 0 = one per core. The results
        /// do not depend on it; the memory does (a 128-host run holds about 630 MB).
        #[arg(long, default_value_t = 0)]
        jobs: usize,
    },
    /// Render the markdown summary and the SVG charts again from a result JSON.
    Report {
        /// A result JSON written by `run`.
        json: PathBuf,
        /// Folder for the markdown and SVG files.
        #[arg(long, default_value = "target/sim")]
        out_dir: PathBuf,
    },
    /// Run every scenario in a folder.
    All {
        /// The folder.
        #[arg(default_value = "sim/scenarios")]
        dir: PathBuf,
        /// Folder for results.
        #[arg(long, default_value = "target/sim")]
        out_dir: PathBuf,
        /// Run the scaled-down CI versions.
        #[arg(long)]
        ci: bool,
        /// No progress bars.
        #[arg(long)]
        quiet: bool,
        /// Runs at a time, as for `run`.
        #[arg(long, default_value_t = 0)]
        jobs: usize,
    },
}

/// What `run` and `all` share: where results go and how the runs are made.
struct RunOpts<'a> {
    out_dir: &'a Path,
    ci: bool,
    quiet: bool,
    jobs: usize,
}

fn run_one(file: &Path, json: Option<&Path>, o: &RunOpts, only: &[String], sizes: &[u64]) -> anyhow::Result<()> {
    let (out_dir, ci, quiet) = (o.out_dir, o.ci, o.quiet);
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let sc = Scenario::from_json(&text).with_context(|| format!("loading {}", file.display()))?;
    let mut sc = if ci { sc.ci_variant()? } else { sc };
    if !only.is_empty() {
        sc.schemes.retain(|s| only.contains(&s.name));
        anyhow::ensure!(!sc.schemes.is_empty(), "no scheme of {} is named {:?}", file.display(), only);
    }
    if !sizes.is_empty() {
        sc.sizes = sizes.to_vec();
    }
    eprintln!("== {} ({} schemes, {} sizes, {} runs each)", sc.name, sc.schemes.len(), sc.sizes.len().max(1), sc.runs);
    let jobs = if o.jobs == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { o.jobs };
    let res = run_scenario_jobs(&sc, !quiet, ci, jobs)?;
    std::fs::create_dir_all(out_dir)?;
    let stem = if ci { format!("{}-ci", sc.name) } else { sc.name.clone() };
    let json_path = json.map(Path::to_path_buf).unwrap_or_else(|| out_dir.join(format!("{stem}.json")));
    if let Some(p) = json_path.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(&json_path, serde_json::to_string_pretty(&res)?)?;
    let md = write_outputs(&res, out_dir)?;
    println!("{md}");
    eprintln!("== {}: {}; results in {}", sc.name, res.speed_summary(), json_path.display());
    Ok(())
}

/// Write the markdown summary and the charts of `res` into `out_dir`; returns the markdown.
fn write_outputs(res: &prism_sim::ExperimentResult, out_dir: &Path) -> anyhow::Result<String> {
    std::fs::create_dir_all(out_dir)?;
    let stem = if res.ci { format!("{}-ci", res.scenario) } else { res.scenario.clone() };
    let md = report::markdown(res);
    std::fs::write(out_dir.join(format!("{stem}.md")), &md)?;
    for (suffix, svg) in report::charts(res) {
        std::fs::write(out_dir.join(format!("{stem}-{suffix}.svg")), svg)?;
    }
    Ok(md)
}

/// The glibc tunables that back malloc's heap with transparent huge pages (glibc 2.35 and later;
/// older versions and other C libraries ignore them) and grow it 64 MiB at a time: grown by malloc's
/// default 128 KiB, the heap's end is rarely on a huge page boundary, its newest pages come as
/// 4 KiB ones, and about every other 128-host run spent 1.3–2.2 s of system time (instead of 0.3) on
/// some 10,000 page faults and on zeroing; grown 64 MiB at a time it takes about 2,000 faults and
/// 0.3 s every time.
const HUGE_PAGES_TUNABLE: &str = "glibc.malloc.hugetlb=1:glibc.malloc.top_pad=67108864";

/// Run again with `HUGE_PAGES_TUNABLE` unless `GLIBC_TUNABLES` is set already (by an earlier pass of
/// this function, or by the user, who can turn it off so). A 128-host run keeps its 16,256 connection
/// pairs in about 500 MB touched at random, so with 4 KiB pages nearly every protocol call also misses
/// the TLB: with 2 MiB pages the 128-host all-to-all takes about a fifth less CPU time. Results do not
/// change (nothing the simulation computes depends on addresses). If the re-execution fails, the run
/// goes on as it is.
#[cfg(target_os = "linux")]
fn reexec_with_huge_pages() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os("GLIBC_TUNABLES").is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let err = std::process::Command::new(exe).args(std::env::args_os().skip(1)).env("GLIBC_TUNABLES", HUGE_PAGES_TUNABLE).exec();
    eprintln!("prism-sim: running without huge pages (re-execution failed: {err})");
}

fn main() -> anyhow::Result<()> {
    #[cfg(target_os = "linux")]
    reexec_with_huge_pages();
    tracing_subscriber_init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run { file, json, out_dir, ci, quiet, scheme, size, jobs } => {
            run_one(&file, json.as_deref(), &RunOpts { out_dir: &out_dir, ci, quiet, jobs }, &scheme, &size)
        }
        Cmd::Report { json, out_dir } => {
            let text = std::fs::read_to_string(&json).with_context(|| format!("reading {}", json.display()))?;
            let mut res: prism_sim::ExperimentResult =
                serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
            res.queue_slope = prism_sim::experiment::queue_slopes(&res.summary);
            write_outputs(&res, &out_dir)?;
            Ok(())
        }
        Cmd::All { dir, out_dir, ci, quiet, jobs } => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .with_context(|| format!("reading {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            files.sort();
            for f in files {
                run_one(&f, None, &RunOpts { out_dir: &out_dir, ci, quiet, jobs }, &[], &[])?;
            }
            Ok(())
        }
    }
}

/// Logs stay off unless something goes wrong: the simulator itself reports through its outputs.
fn tracing_subscriber_init() {}
