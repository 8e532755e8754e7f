//! Each documented way of loading Prism into NCCL, played by `tests-c/loader_test.c` (NCCL's lookup
//! rules: `NCCL_NET_PLUGIN` → dlopen name or the process itself → `ncclNetPlugin_v12`..`_v6` → init →
//! devices) in a child process: `NCCL_NET_PLUGIN=prism` with `LD_LIBRARY_PATH`, `LD_PRELOAD` with
//! `NCCL_NET_PLUGIN=STATIC_PLUGIN`, and plain `LD_PRELOAD` (which works through the SONAME
//! `libnccl-net.so`). A decoy `libnccl-net.so` on the library path checks which plugin wins.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Scratch layout: the loader, a decoy plugin directory, and a directory with only Prism's NCCL name.
struct Setup {
    loader: PathBuf,
    /// Contains only `libnccl-net-prism.so` → the built plugin.
    prism_dir: PathBuf,
    /// Contains only `libnccl-net.so`, a plugin named "Decoy".
    decoy_dir: PathBuf,
    /// Contains nothing.
    empty_dir: PathBuf,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let dir = common::scratch_dir().join("loader");
        let _ = std::fs::remove_dir_all(&dir);
        let (prism_dir, decoy_dir, empty_dir) = (dir.join("prism"), dir.join("decoy"), dir.join("empty"));
        for d in [&prism_dir, &decoy_dir, &empty_dir] {
            std::fs::create_dir_all(d).unwrap();
        }
        let loader = dir.join("loader_test");
        common::compile_c(&["loader_test.c"], &loader);
        compile_shared("decoy_plugin.c", &decoy_dir.join("libnccl-net.so"));
        std::os::unix::fs::symlink(common::plugin_path(), prism_dir.join("libnccl-net-prism.so")).unwrap();
        Setup { loader, prism_dir, decoy_dir, empty_dir }
    })
}

/// Compiles one C source from `tests-c/` into a shared library.
fn compile_shared(source: &str, out: &Path) {
    let root = common::repo_root();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let output = Command::new(&cc)
        .args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I"])
        .arg(root.join("include"))
        .arg(root.join("tests-c").join(source))
        .arg("-o")
        .arg(out)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(output.status.success(), "compiling {source} failed:\n{}", String::from_utf8_lossy(&output.stderr));
}

/// Runs the loader with exactly these loader-related variables (and loopback for Prism).
fn run(ld_library_path: &Path, ld_preload: Option<&Path>, nccl_net_plugin: Option<&str>) -> (bool, String) {
    let s = setup();
    let mut cmd = Command::new(&s.loader);
    cmd.env_remove("LD_PRELOAD")
        .env_remove("NCCL_NET_PLUGIN")
        .env("LD_LIBRARY_PATH", ld_library_path)
        .env("PRISM_IFNAMES", "lo")
        .env("PRISM_TRANSPORT", "udp");
    if let Some(p) = ld_preload {
        cmd.env("LD_PRELOAD", p);
    }
    if let Some(n) = nccl_net_plugin {
        cmd.env("NCCL_NET_PLUGIN", n);
    }
    let out = cmd.output().expect("run loader_test");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let text = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    (out.status.success(), if out.status.success() { stdout.trim().to_string() } else { text })
}

#[test]
fn the_plugin_carries_the_soname_nccl_dlopens_by_default() {
    let out = Command::new("readelf").arg("-d").arg(common::plugin_path()).output().expect("run readelf -d");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Library soname: [libnccl-net.so]"), "readelf -d:\n{text}");
}

#[test]
fn nccl_net_plugin_prism_finds_it_on_the_library_path() {
    let s = setup();
    let (ok, out) = run(&s.prism_dir, None, Some("prism"));
    assert!(ok, "{out}");
    assert_eq!(out, "loaded prism as libnccl-net-prism.so v12: name=Prism ndev=1 dev0=prism:lo");
    // A decoy libnccl-net.so on the path changes nothing: the file is found by its own name.
    let both = std::env::join_paths([&s.decoy_dir, &s.prism_dir]).unwrap();
    let (ok, out) = run(Path::new(&both), None, Some("prism"));
    assert!(ok, "{out}");
    assert!(out.contains("name=Prism"), "{out}");
}

#[test]
fn ld_preload_with_static_plugin_finds_it_in_the_process() {
    let s = setup();
    let (ok, out) = run(&s.empty_dir, Some(&common::plugin_path()), Some("STATIC_PLUGIN"));
    assert!(ok, "{out}");
    assert_eq!(out, "loaded STATIC_PLUGIN as (process) v12: name=Prism ndev=1 dev0=prism:lo");
}

#[test]
fn plain_ld_preload_answers_nccls_default_name() {
    let s = setup();
    let (ok, out) = run(&s.empty_dir, Some(&common::plugin_path()), None);
    assert!(ok, "{out}");
    assert_eq!(out, "loaded libnccl-net.so as libnccl-net.so v12: name=Prism ndev=1 dev0=prism:lo");
    // The preloaded library wins over another libnccl-net.so on the library path.
    let (ok, out) = run(&s.decoy_dir, Some(&common::plugin_path()), None);
    assert!(ok, "{out}");
    assert!(out.contains("name=Prism"), "{out}");
    // The NCCL name (symlink) preloaded works the same.
    let (ok, out) = run(&s.empty_dir, Some(&s.prism_dir.join("libnccl-net-prism.so")), None);
    assert!(ok, "{out}");
    assert!(out.contains("name=Prism"), "{out}");
}

#[test]
fn without_any_of_them_prism_is_not_loaded() {
    // The controls: the loader really follows the rules, so the tests above can fail.
    let s = setup();
    // (A libnccl-net.so installed on this system could load here; it must not be Prism.)
    let (_, out) = run(&s.empty_dir, None, None);
    assert!(!out.contains("name=Prism"), "{out}");
    let (ok, out) = run(&s.decoy_dir, None, None);
    assert!(ok && out.contains("name=Decoy"), "{out}");
    let (_, out) = run(&s.empty_dir, None, Some("prism"));
    assert!(!out.contains("name=Prism"), "{out}");
    // NCCL_NET_PLUGIN names another plugin: a preloaded Prism is not picked up by that name.
    let (_, out) = run(&s.empty_dir, Some(&common::plugin_path()), Some("other"));
    assert!(!out.contains("name=Prism"), "{out}");
    let (ok, out) = run(&s.empty_dir, Some(&common::plugin_path()), Some("none"));
    assert!(!ok && out.contains("no plugin"), "{out}");
}
