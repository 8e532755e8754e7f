//! Helpers shared by the integration tests: where the built plugin is, and how to compile the C
//! programs in `tests-c/` against `include/prism_net.h`.
#![allow(dead_code)] // each test binary uses a different subset

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use nccl_net_prism::abi::NCCL_SUCCESS;
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;

/// A context of the v12 table called in-process, as NCCL calls it. Dropping it finalizes it, so a
/// failed test still leaves no context behind for the next one.
pub struct Ctx(pub *mut c_void);

impl Ctx {
    /// `init` on loopback (unless `PRISM_IFNAMES` is set) with `env` set first. The engine reads the
    /// environment at init: callers hold their test binary's one-test-at-a-time lock, so no other
    /// thread reads it while it changes.
    pub fn init(env: &[(&str, &str)]) -> Ctx {
        if std::env::var_os("PRISM_IFNAMES").is_none() {
            std::env::set_var("PRISM_IFNAMES", "lo");
        }
        for (k, v) in env {
            std::env::set_var(k, v);
        }
        let mut ctx = null_mut();
        // SAFETY: NCCL's init contract: a writable ctx slot, no config, no logger, no profiler.
        let rc = unsafe { NET.init.unwrap()(&mut ctx, 1, null_mut(), None, None) };
        assert_eq!(rc, NCCL_SUCCESS, "init");
        assert!(!ctx.is_null());
        Ctx(ctx)
    }

    /// Finalize now, and assert that it succeeded.
    pub fn finalize(mut self) {
        let ctx = std::mem::replace(&mut self.0, null_mut());
        // SAFETY: the context init returned, finalized once.
        assert_eq!(unsafe { NET.finalize.unwrap()(ctx) }, NCCL_SUCCESS);
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the context init returned, not finalized yet.
            unsafe { NET.finalize.unwrap()(self.0) };
        }
    }
}

/// A send comm and the receive comm it is connected to.
pub struct Pair {
    pub send: *mut c_void,
    pub recv: *mut c_void,
}

/// `listen` on device 0 of context `ctx`: the handle to connect with and the listen comm.
pub fn listen(ctx: *mut c_void) -> ([u8; 128], *mut c_void) {
    let mut handle = [0u8; 128];
    let mut l = null_mut();
    // SAFETY: the v12 listen contract.
    assert_eq!(unsafe { NET.listen.unwrap()(ctx, 0, handle.as_mut_ptr().cast(), &mut l) }, NCCL_SUCCESS);
    (handle, l)
}

/// NCCL's retry loop: `connect` with `handle` and `accept` on `listen` until both comms exist, for at
/// most `limit`.
pub fn drive_connect(
    ctx: *mut c_void,
    handle: &mut [u8; 128],
    listen: *mut c_void,
    send: &mut *mut c_void,
    recv: &mut *mut c_void,
    limit: Duration,
) {
    let start = Instant::now();
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            // SAFETY: the connect contract; the same handle on every retry.
            assert_eq!(unsafe { NET.connect.unwrap()(ctx, 0, handle.as_mut_ptr().cast(), send, null_mut()) }, NCCL_SUCCESS);
        }
        if recv.is_null() {
            // SAFETY: the accept contract.
            assert_eq!(unsafe { NET.accept.unwrap()(listen, recv, null_mut()) }, NCCL_SUCCESS);
        }
        assert!(start.elapsed() < limit, "no loopback connection within {limit:?}");
    }
}

/// A connected pair over loopback, made with NCCL's retry loop; the listen comm is closed.
pub fn connect(ctx: &Ctx) -> Pair {
    let (mut handle, l) = listen(ctx.0);
    let (mut send, mut recv) = (null_mut(), null_mut());
    drive_connect(ctx.0, &mut handle, l, &mut send, &mut recv, Duration::from_secs(60));
    // SAFETY: the listen comm, closed once.
    assert_eq!(unsafe { NET.close_listen.unwrap()(l) }, NCCL_SUCCESS);
    Pair { send, recv }
}

/// Close both comms of a pair.
pub fn close(p: Pair) {
    // SAFETY: comms from connect/accept, closed once.
    unsafe {
        assert_eq!(NET.close_send.unwrap()(p.send), NCCL_SUCCESS);
        assert_eq!(NET.close_recv.unwrap()(p.recv), NCCL_SUCCESS);
    }
}

/// The repository root (the workspace around this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("crate sits inside the workspace").to_path_buf()
}

/// `target/<profile>/`: the test binary runs from `target/<profile>/deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps").to_path_buf()
}

/// The cdylib cargo built for this test run. `cargo test` builds it into `deps/`, next to the test
/// binary, without copying it up to `target/<profile>/` (only `cargo build` does that), so `deps/` is
/// the fresh one.
pub fn plugin_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("test binary directory").join("libnccl_net_prism.so");
    if deps.exists() {
        return deps;
    }
    let p = profile_dir().join("libnccl_net_prism.so");
    assert!(p.exists(), "neither {} nor {} exists: cargo builds the cdylib with the tests of prism-nccl", deps.display(), p.display());
    p
}

/// Compiles C sources from `tests-c/` into `out` with the system compiler (`$CC`, default `cc`).
pub fn compile_c(sources: &[&str], out: &Path) {
    let root = repo_root();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let mut cmd = Command::new(&cc);
    cmd.args(["-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Werror"]).arg("-I").arg(root.join("include"));
    for s in sources {
        cmd.arg(root.join("tests-c").join(s));
    }
    cmd.arg("-o").arg(out).arg("-ldl");
    let output = cmd.output().unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(
        output.status.success(),
        "compiling {sources:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A scratch directory for this test binary's artifacts.
pub fn scratch_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("prism-nccl");
    std::fs::create_dir_all(&d).expect("create the scratch directory");
    d
}
