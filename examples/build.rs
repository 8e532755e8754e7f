//! Compiles the C shim (`csrc/netshim.c`) that dlopens the plugin through `include/prism_net.h`.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let include = manifest.join("..").join("include");
    let csrc = manifest.join("csrc");
    for f in [csrc.join("netshim.c"), csrc.join("netshim.h"), csrc.join("testnet.c"), include.join("prism_net.h")] {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    cc::Build::new()
        .file(csrc.join("netshim.c"))
        .include(&include)
        .include(&csrc)
        .flag_if_supported("-std=c11")
        .flag_if_supported("-Wall")
        .flag_if_supported("-Wextra")
        .flag_if_supported("-Werror=implicit-function-declaration")
        .compile("netshim");
    build_test_plugin(&csrc, &include);
    // dlopen/dlsym live in libdl on glibc < 2.34 (and in libc itself after; linking libdl is harmless).
    println!("cargo:rustc-link-lib=dl");
}

/// `libprism-testnet.so` in OUT_DIR: the in-process reference plugin prism-perf's tests load through
/// the shim (see `csrc/testnet.c`). Tests find it with `env!("OUT_DIR")`.
fn build_test_plugin(csrc: &std::path::Path, include: &std::path::Path) {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let compiler = cc::Build::new().get_compiler();
    let status = compiler
        .to_command()
        .args(["-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden", "-pthread"])
        .arg("-I")
        .arg(include)
        .arg(csrc.join("testnet.c"))
        .arg("-o")
        .arg(out.join("libprism-testnet.so"))
        .status()
        .expect("running the C compiler for the test plugin");
    assert!(status.success(), "building libprism-testnet.so failed");
}
