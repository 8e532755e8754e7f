//! `init` with bad `PRISM_*` configuration: every unusable value fails `init` with an error code (no
//! panic, no context), the reason goes through NCCL's logger naming the variable, and a later `init`
//! with a good environment works. In its own binary: it changes the process environment.

use std::ffi::{c_char, c_int, c_ulong, c_void, CStr};
use std::ptr::null_mut;

use nccl_net_prism::abi::{Logger, NCCL_SUCCESS};
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;
use parking_lot::Mutex;

/// ncclInvalidArgument.
const INVALID_ARGUMENT: c_int = 4;

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// NCCL's logger as Prism calls it: `fmt` is always "%s" with one string argument. Defined without
/// the `...` (stable Rust has no variadic definitions): on x86-64 and aarch64 a variadic call passes
/// these pointer arguments in the registers this definition reads.
extern "C" fn record(_level: c_int, _flags: c_ulong, _file: *const c_char, _line: c_int, fmt: *const c_char, msg: *const c_char) {
    // SAFETY: Prism passes NUL-terminated strings for both.
    let (fmt, msg) = unsafe { (CStr::from_ptr(fmt), CStr::from_ptr(msg)) };
    assert_eq!(fmt.to_bytes(), b"%s");
    LOG.lock().push(msg.to_string_lossy().into_owned());
}

fn logger() -> Logger {
    type Plain = extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, *const c_char);
    // SAFETY: see `record`: the plugin only ever calls it with these six arguments.
    unsafe { std::mem::transmute::<Plain, Logger>(record) }
}

/// `init` with only `vars` set (besides loopback): its result code, and what it logged.
fn init_with(vars: &[(&str, &str)]) -> (c_int, *mut c_void, String) {
    for (k, _) in std::env::vars() {
        if k.starts_with("PRISM_") {
            std::env::remove_var(k);
        }
    }
    std::env::set_var("PRISM_IFNAMES", "lo");
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    LOG.lock().clear();
    let mut ctx = std::ptr::without_provenance_mut::<c_void>(0x40);
    // SAFETY: NCCL's init contract: a writable ctx slot, no config, a logger, no profiler.
    let rc = unsafe { NET.init.unwrap()(&mut ctx, 7, null_mut(), Some(logger()), None) };
    let log = LOG.lock().join("\n");
    (rc, ctx, log)
}

#[test]
fn every_unusable_value_fails_init_with_a_reason_naming_its_variable_and_init_recovers() {
    let cases: &[(&str, &str)] = &[
        ("PRISM_PATHS", ""),
        ("PRISM_PATHS", "  "),
        ("PRISM_PATHS", "-1"),
        ("PRISM_PATHS", "99999999999999999999999"),
        ("PRISM_PATHS", "16k"),
        ("PRISM_PATHS", "0x10"),
        ("PRISM_MTU", "9000 bytes"),
        ("PRISM_WINDOW", "0"),
        ("PRISM_SEED", "-5"),
        ("PRISM_SEED", "18446744073709551616"),
        ("PRISM_SOCKBUF", "8M"),
        ("PRISM_CONNECT_TIMEOUT_MS", "1e3"),
        ("PRISM_UDP_GSO", "true"),
        ("PRISM_UDP_TRAIN", ""),
        ("PRISM_UDP_SPORT_BASE", "65535"),
        ("PRISM_TRANSPORT", ""),
        ("PRISM_IFNAMES", ""),
        ("PRISM_IFNAMES", " , "),
        ("PRISM_HOST", " "),
        ("PRISM_PATH", ""),
        ("PRISM_CHUNK", "-128"),
        ("PRISM_MCC_MD", "0.9996"),
        ("PRISM_TOPO", ""),
        ("PRISM_PAHT", "spray"),
        // Set but empty (`PRISM_STATS=$UNSET_VAR`): not "off", which is what unsetting it says.
        ("PRISM_STATS", ""),
        ("PRISM_STATS", "  "),
    ];
    for (var, value) in cases {
        let (rc, ctx, log) = init_with(&[(var, value)]);
        assert_eq!(rc, INVALID_ARGUMENT, "{var}={value:?}: init returned {rc}; log: {log}");
        assert!(ctx.is_null(), "{var}={value:?}: a failed init left a context");
        assert!(log.contains(var), "{var}={value:?}: the logged reason does not name the variable: {log}");
    }
    // An interface that does not exist: a system error that names it.
    let (rc, ctx, log) = init_with(&[("PRISM_IFNAMES", "nosuchif0")]);
    assert_ne!(rc, NCCL_SUCCESS);
    assert!(ctx.is_null());
    assert!(log.contains("nosuchif0"), "{log}");
    // Values that parse but cannot be used on this host: the reason names the variable.
    for (var, value) in
        [("PRISM_TOPO", "/nonexistent/prism-topo.json"), ("PRISM_STATS", "/nonexistent/prism-stats-%p.json"), ("PRISM_TRANSPORT", "verbs")]
    {
        if var == "PRISM_TRANSPORT" && std::path::Path::new("/sys/class/infiniband").exists() {
            continue; // an RDMA device exists here: verbs may well work
        }
        let (rc, ctx, log) = init_with(&[(var, value)]);
        assert_ne!(rc, NCCL_SUCCESS, "{var}={value}");
        assert!(ctx.is_null());
        assert!(log.contains(var) || log.contains(value), "{var}={value}: {log}");
    }
    // And with a good environment again, init works.
    let (rc, ctx, log) = init_with(&[]);
    assert_eq!(rc, NCCL_SUCCESS, "{log}");
    // SAFETY: the context init just returned.
    assert_eq!(unsafe { NET.finalize.unwrap()(ctx) }, NCCL_SUCCESS);
}
