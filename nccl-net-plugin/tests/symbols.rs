//! The built `.so` as NCCL's loader sees it: it loads with `RTLD_NOW`, exports exactly the four tables,
//! each named "Prism", and needs nothing beyond libc, libgcc and the dynamic loader.

mod common;

use std::ffi::{c_char, c_void, CStr, CString};
use std::process::Command;

const TABLES: [&str; 4] = ["ncclNetPlugin_v12", "ncclNetPlugin_v11", "ncclNetPlugin_v10", "ncclNetPlugin_v9"];

fn nm(args: &[&str]) -> String {
    let out =
        Command::new("nm").args(args).arg(common::plugin_path()).output().expect("nm (binutils) is needed to inspect the plugin's symbols");
    assert!(out.status.success(), "nm failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn dlopen_with_rtld_now_finds_every_table_named_prism() {
    let path = CString::new(common::plugin_path().to_str().expect("UTF-8 path")).unwrap();
    // SAFETY: loading the plugin runs no initialiser of ours; the handle stays open for the test.
    let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        // SAFETY: dlerror returns a valid C string after a failed dlopen.
        let err = unsafe { CStr::from_ptr(libc::dlerror()) };
        panic!("dlopen(RTLD_NOW) failed: {err:?}");
    }
    for sym in TABLES {
        let name = CString::new(sym).unwrap();
        // SAFETY: lib is a valid handle.
        let table = unsafe { libc::dlsym(lib, name.as_ptr()) };
        assert!(!table.is_null(), "{sym} is not exported");
        // SAFETY: every table starts with `const char* name`, pointing to a static C string.
        let net_name = unsafe { CStr::from_ptr(*(table as *const *const c_char)) };
        assert_eq!(net_name.to_str().unwrap(), "Prism", "{sym}");
        // The second slot is init: never NULL.
        // SAFETY: the table has at least two pointer slots.
        let init = unsafe { *(table as *const *const c_void).add(1) };
        assert!(!init.is_null(), "{sym}.init is NULL");
    }
    // SAFETY: lib is a valid handle; nothing from it is used afterwards.
    assert_eq!(unsafe { libc::dlclose(lib) }, 0);
}

#[test]
fn exactly_the_four_tables_are_exported() {
    let mut defined: Vec<String> =
        nm(&["-D", "--defined-only"]).lines().filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned)).collect();
    defined.sort();
    let mut want: Vec<String> = TABLES.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(defined, want);
}

#[test]
fn every_undefined_symbol_comes_from_libc_libgcc_or_the_loader() {
    let text = nm(&["-D", "--undefined-only"]);
    let allowed = ["@GLIBC_", "@GCC_"];
    // Weak references (w) may stay unresolved by design (gmon, transactional memory).
    let strong: Vec<&str> = text
        .lines()
        .filter(|l| l.split_whitespace().next() == Some("U"))
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|s| !allowed.iter().any(|a| s.contains(a)))
        .collect();
    assert!(strong.is_empty(), "undefined symbols outside libc/libgcc: {strong:?}");
}

#[test]
fn only_libc_libgcc_and_the_loader_are_needed() {
    let out = Command::new("readelf").arg("-d").arg(common::plugin_path()).output().expect("readelf (binutils)");
    let text = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> =
        text.lines().filter(|l| l.contains("(NEEDED)")).filter_map(|l| l.split('[').nth(1).and_then(|s| s.split(']').next())).collect();
    assert!(!needed.is_empty(), "readelf found no NEEDED entries:\n{text}");
    for lib in &needed {
        let ok = lib.starts_with("libc.so") || lib.starts_with("libgcc_s.so") || lib.starts_with("ld-linux");
        assert!(ok, "the plugin needs {lib} (all needed: {needed:?})");
    }
}
