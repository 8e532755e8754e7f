//! Gives the cdylib the file name NCCL looks for.
//!
//! NCCL turns `NCCL_NET_PLUGIN=prism` into `dlopen("libnccl-net-prism.so")`, but cargo names the
//! artifact after the lib target with dashes replaced (`libnccl_net_prism.so`). This script leaves a
//! relative symlink `libnccl-net-prism.so -> libnccl_net_prism.so` in the profile directory
//! (`target/<profile>/`, three levels above `OUT_DIR`, whatever `CARGO_TARGET_DIR` is), so both
//! `cargo build` and `cargo build --release` produce a loadable plugin next to the real file.
//!
//! On Linux the cdylib also gets the SONAME `libnccl-net.so`, the name NCCL dlopens when
//! `NCCL_NET_PLUGIN` is unset. glibc's `dlopen` matches a bare name against the SONAMEs of objects
//! already loaded before it searches the library path, so `LD_PRELOAD=.../libnccl-net-prism.so` alone
//! makes NCCL's `dlopen("libnccl-net.so")` return Prism (README, "Using it with NCCL"). Loading by file
//! name (`NCCL_NET_PLUGIN=prism`, a path) is unaffected.

use std::path::{Path, PathBuf};

const ARTIFACT: &str = "libnccl_net_prism.so";
const NCCL_NAME: &str = "libnccl-net-prism.so";
/// The name NCCL dlopens when `NCCL_NET_PLUGIN` is unset.
const SONAME: &str = "libnccl-net.so";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_FAMILY").as_deref() != Ok("unix") {
        return;
    }
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{SONAME}");
    }
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR for build scripts"));
    // OUT_DIR = <profile dir>/build/<pkg>-<hash>/out
    let Some(profile_dir) = out_dir.ancestors().nth(3) else {
        println!("cargo:warning=OUT_DIR {} has no profile directory; not linking {NCCL_NAME}", out_dir.display());
        return;
    };
    if let Err(e) = link(profile_dir) {
        println!("cargo:warning=could not create {NCCL_NAME} in {}: {e}", profile_dir.display());
    }
}

#[cfg(unix)]
fn link(profile_dir: &Path) -> std::io::Result<()> {
    let link = profile_dir.join(NCCL_NAME);
    match std::fs::read_link(&link) {
        Ok(target) if target == Path::new(ARTIFACT) => return Ok(()),
        Ok(_) => std::fs::remove_file(&link)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        // A regular file in the way (e.g. copied by hand): replace it with the link.
        Err(_) => std::fs::remove_file(&link)?,
    }
    // The link is relative, so the profile directory can be copied or moved as a whole.
    std::os::unix::fs::symlink(ARTIFACT, &link)
}

#[cfg(not(unix))]
fn link(_profile_dir: &Path) -> std::io::Result<()> {
    Ok(())
}
