//! Every load-balancing policy through the real plugin: `prism-perf` runs with each `PRISM_PATH`,
//! `PRISM_RAIL` and `PRISM_SPLIT` value, every byte is checked (`#wrong = 0`), and the plugin's own
//! statistics show the spread each policy promises.
//!
//! Needs `cargo build --release` (or the same profile as the test) first, so that
//! `libnccl-net-prism.so` sits next to `prism-perf`; `scripts/test` does that.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn bin_dir() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_prism-perf"));
    let dir = exe.parent().expect("bin dir").to_path_buf();
    assert!(
        dir.join("libnccl-net-prism.so").exists(),
        "{} is missing: run `cargo build` with this profile first (scripts/test does)",
        dir.join("libnccl-net-prism.so").display()
    );
    dir
}

/// Run prism-perf with `env`; return rank 0's plugin statistics (the JSON report embeds them).
fn run(name: &str, env: &[(&str, &str)], args: &[&str]) -> Value {
    let dir = bin_dir();
    let out = std::env::temp_dir().join(format!("prism-policy-{}-{name}.json", std::process::id()));
    let mut cmd = Command::new(dir.join("prism-perf"));
    cmd.args(args).arg("--json").arg(&out).env("PRISM_IFNAMES", "lo").env("PRISM_SEED", "7").env_remove("PRISM_STATS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let res = cmd.output().expect("running prism-perf");
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{name}: prism-perf failed\n{stdout}\n{}", String::from_utf8_lossy(&res.stderr));
    assert!(stdout.contains("# Out of bounds values : 0 OK"), "{name}: wrong data\n{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for f in report["stats_files"].as_array().unwrap() {
        let _ = std::fs::remove_file(Path::new(f.as_str().unwrap()));
    }
    let _ = std::fs::remove_file(&out);
    assert!(report["stats"].is_object(), "{name}: no plugin statistics in the report");
    report["stats"].clone()
}

fn send_comm(stats: &Value) -> &Value {
    stats["comms"].as_array().unwrap().iter().find(|c| c["role"] == "send").expect("a send comm")
}

/// First-copy data packets per entropy of rank 0's send comm.
fn pkts_per_entropy(stats: &Value) -> Vec<u64> {
    send_comm(stats)["conn"]["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pkts_sent"].as_u64().unwrap() - p["retransmissions"].as_u64().unwrap())
        .collect()
}

const ONE_MESSAGE: &[&str] = &["sendrecv", "-N", "2", "-b", "4M", "-e", "4M", "-n", "1", "-w", "0", "-c", "1", "--slice", "4M"];
const MANY_PACKETS: &[&str] = &["sendrecv", "-N", "2", "-b", "8M", "-e", "8M", "-n", "2", "-w", "1", "-c", "1"];

#[test]
fn ecmp_puts_each_message_on_one_entropy() {
    // -c 1 adds a check pass, so the run has two 4 MiB messages: at most two entropies carry data.
    let per = pkts_per_entropy(&run("ecmp", &[("PRISM_PATH", "ecmp")], ONE_MESSAGE));
    let used = per.iter().filter(|&&n| n > 0).count();
    assert!((1..=2).contains(&used), "ecmp used {used} entropies: {per:?}");
}

fn assert_even(name: &str, per: &[u64], tolerance: f64) {
    let total: u64 = per.iter().sum();
    let mean = total as f64 / per.len() as f64;
    assert!(total > 1000, "{name}: only {total} packets");
    for (e, &n) in per.iter().enumerate() {
        let dev = (n as f64 - mean).abs() / mean;
        assert!(dev <= tolerance, "{name}: entropy {e} carried {n} packets, mean {mean:.0} (±{tolerance}): {per:?}");
    }
}

/// Enough packets that uniform random spraying is within 25 % of the mean on every one of 16 entropies
/// by a wide margin: about 720 first copies each, so 25 % is some 6.7 standard deviations (with 8 MiB
/// messages, about 180 each, the seed's own spread was 22 % and a few packets moved off a path made it
/// fail now and then).
const SPRAY_PACKETS: &[&str] = &["sendrecv", "-N", "2", "-b", "32M", "-e", "32M", "-n", "2", "-w", "1", "-c", "1"];

/// Each packet picked on its own (`PRISM_UDP_TRAIN=1`): the policies' own spread. With the default GSO
/// trains of 7 datagrams a draw places 7 packets, so the same run has a seventh of the draws and about
/// 2.6 times the relative spread (a CI run saw 35 % on one entropy): that default is tested below.
const PER_PACKET: (&str, &str) = ("PRISM_UDP_TRAIN", "1");

#[test]
fn spray_uses_every_entropy_within_25_percent() {
    let per = pkts_per_entropy(&run("spray", &[("PRISM_PATH", "spray"), PER_PACKET], SPRAY_PACKETS));
    assert_eq!(per.len(), 16);
    assert_even("spray", &per, 0.25);
}

#[test]
fn by_default_spray_sends_gso_trains_and_still_reaches_every_entropy() {
    // `PRISM_UDP_TRAIN=auto`: 512 packets over 16 entropies on loopback, trains of 7 datagrams (one GSO
    // send each); about 100 trains per entropy in this run, so every entropy is well within half and
    // twice the mean (some 5 standard deviations).
    let stats = run("spray-trains", &[("PRISM_PATH", "spray")], SPRAY_PACKETS);
    let per = pkts_per_entropy(&stats);
    assert_eq!(per.len(), 16);
    assert_even("spray with trains", &per, 0.5);
    let rail = &stats["rails"][0];
    let (trains, datagrams) = (rail["gso_trains"].as_u64().unwrap(), rail["gso_train_datagrams"].as_u64().unwrap());
    assert!(trains > 0 && datagrams >= 5 * trains, "{datagrams} datagrams in {trains} GSO trains: trains of fewer than 5");
}

#[test]
fn pro_and_dr_rotate_over_every_entropy_within_5_percent() {
    // A retransmission timeout can mark a path dead for a while and shift its packets to the others;
    // on a loaded test machine a descheduled process causes such timeouts, so this test about the
    // spread (not about loss recovery) gives the timers room.
    for p in ["pro", "dr"] {
        let per = pkts_per_entropy(&run(p, &[("PRISM_PATH", p), ("PRISM_RTO_MIN_US", "200000"), PER_PACKET], MANY_PACKETS));
        assert_even(p, &per, 0.05);
    }
}

#[test]
fn reps_moves_every_byte_on_valid_entropies() {
    let per = pkts_per_entropy(&run("reps", &[("PRISM_PATH", "reps")], MANY_PACKETS));
    assert_eq!(per.len(), 16);
    assert!(per.iter().sum::<u64>() > 1000);
}

fn planned_per_rail(stats: &Value) -> Vec<u64> {
    send_comm(stats)["planned_bytes_per_rail"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
}

#[test]
fn rail_policies_spread_or_pin_as_configured_over_two_rails() {
    let two = [("PRISM_IFNAMES", "lo,lo")];
    for (rail, check) in [("lpt", "even"), ("rr", "even"), ("hash", "one"), ("single", "home")] {
        let mut env = two.to_vec();
        env.push(("PRISM_RAIL", rail));
        let per = planned_per_rail(&run(rail, &env, MANY_PACKETS));
        let total: u64 = per.iter().sum();
        assert!(total > 0, "{rail}: nothing planned");
        match check {
            "even" => assert!(per[0].abs_diff(per[1]) <= 32 * 1024 * 4, "{rail}: {per:?}"),
            "one" => assert!(per.iter().filter(|&&b| b > 0).count() == 1, "{rail}: {per:?}"),
            _ => assert_eq!(per[1], 0, "{rail}: device 0's comm left its rail: {per:?}"),
        }
    }
}

#[test]
fn split_policies_move_every_byte() {
    for split in ["none", "ethereal", "fixed:4"] {
        let stats = run(split, &[("PRISM_SPLIT", split), ("PRISM_PATH", "pro")], MANY_PACKETS);
        assert!(pkts_per_entropy(&stats).iter().sum::<u64>() > 1000, "{split}");
    }
}

#[test]
fn mcc_rate_control_moves_every_byte_and_reports_its_window() {
    let stats = run("mcc", &[("PRISM_CC", "mcc")], MANY_PACKETS);
    let rate = &send_comm(&stats)["rate"];
    assert_eq!(rate["controller"], "mcc", "{rate}");
    let w = rate["window_pkts"].as_u64().unwrap();
    assert!((1..=512).contains(&w), "window {w}");
}
