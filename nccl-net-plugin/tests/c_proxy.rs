//! The acceptance test of the C ABI: `tests-c/proxy_test.c` plays NCCL's proxy in two processes against
//! the built `libnccl_net_prism.so`, for each ABI version, over loopback (`PRISM_IFNAMES=lo`).
//! The C program's output is printed; a failing run shows which scenario and byte went wrong.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use parking_lot::Mutex;

/// The harness binary, compiled once per test run.
fn proxy_test() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = common::scratch_dir().join("proxy_test");
        common::compile_c(&["proxy_test.c"], &out);
        out
    })
    .clone()
}

/// Two processes moving up to 64 MiB each way: one version at a time keeps the two cores for it.
static SERIAL: Mutex<()> = Mutex::new(());

fn run(version: &str) {
    let _one_at_a_time = SERIAL.lock();
    let bin = proxy_test();
    let plugin = common::plugin_path();
    // A fixed seed per version: reruns see the same bytes; the C program prints it either way.
    let seed = match version {
        "v9" => "0x9009",
        "v10" => "0x1010",
        "v11" => "0x1111",
        _ => "0x1212",
    };
    let mut cmd = Command::new(&bin);
    cmd.arg(version).arg(&plugin).arg(seed);
    // Only the variables this test means: a stray PRISM_* in the caller's environment would be refused.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PRISM_") {
            cmd.env_remove(k);
        }
    }
    let stats_dir = common::scratch_dir().join(format!("stats-{version}"));
    let _ = std::fs::remove_dir_all(&stats_dir);
    std::fs::create_dir_all(&stats_dir).expect("stats directory");
    cmd.env("PRISM_IFNAMES", "lo").env("PRISM_STATS", stats_dir.join("prism-%p.json")).env("PROXY_TEST_TIMEOUT_S", "120");
    let out = cmd.output().expect("run proxy_test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    if !stderr.is_empty() {
        println!("--- stderr (plugin warnings; several are expected from the error scenarios) ---\n{stderr}");
    }
    assert!(out.status.success(), "proxy_test {version} failed ({}); see the output above", out.status);
    assert!(stdout.contains(&format!("[{version}] PASS")), "no PASS line for {version}");
    check_stats(&stats_dir);
}

/// Each of the two processes wrote its engine's statistics (`PRISM_STATS`, `%p` = pid) when the engine
/// went away: at the last finalize (v11/v12) or when the library was unloaded (v9/v10).
fn check_stats(dir: &std::path::Path) {
    let files: Vec<_> = std::fs::read_dir(dir).expect("stats directory").map(|e| e.expect("entry").path()).collect();
    assert_eq!(files.len(), 2, "one statistics file per process expected in {}: {files:?}", dir.display());
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read statistics");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(v.get("rails").is_some(), "{} has no rails: {text}", f.display());
    }
}

#[test]
fn nccl_proxy_v9_drives_the_plugin_end_to_end() {
    run("v9");
}

#[test]
fn nccl_proxy_v10_drives_the_plugin_end_to_end() {
    run("v10");
}

#[test]
fn nccl_proxy_v11_drives_the_plugin_end_to_end() {
    run("v11");
}

#[test]
fn nccl_proxy_v12_drives_the_plugin_end_to_end() {
    run("v12");
}
