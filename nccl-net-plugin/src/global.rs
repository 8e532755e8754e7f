//! The process-wide engine and its lifetime.
//!
//! One [`prism_transport::engine::Net`] serves every communicator of the process. It is created by the
//! first `init` of any version. v11/v12 pair each `init` with a `finalize`: the engine is dropped when
//! the last context is finalized, and a later `init` builds a fresh one (NCCL may also `dlclose` and
//! `dlopen` the library between communicators). v9/v10 `init` once per process and never finalize, so
//! their engine lives until the library is unloaded; a `.fini_array` hook drops it then, so its sockets
//! close and a `dlopen` after `dlclose` starts clean. Comms keep the engine alive through an `Arc` until
//! they are closed.
//!
//! There is never more than one engine: an `init` while the previous engine is still alive (comms of a
//! finalized context still open) takes that engine up again, and one that comes while the previous
//! engine is being dropped (another thread's last `finalize` or close) waits for it to be gone. Two
//! engines side by side would each bind the rails' UDP ports; with `PRISM_UDP_SPORT_BASE` the second
//! could not, and `init` failed.

use std::collections::BTreeMap;
use std::ffi::{c_int, CStr, CString};
use std::path::PathBuf;
use std::sync::Arc;

use std::sync::Weak;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use prism_transport::engine::{Net, MAX_RECVS};

use crate::abi::props::DeviceProps;
use crate::config::PluginConfig;
use crate::error::{invalid, PluginError};
use crate::log::INIT_TARGET;

/// One device as NCCL sees it, with C strings that outlive any engine.
#[derive(Debug, Clone, Copy)]
pub struct Device {
    /// Unique name (NCCL's topology key).
    pub name: &'static CStr,
    /// sysfs PCI path, `None` for virtual interfaces.
    pub pci_path: Option<&'static CStr>,
    /// Link speed in Mbit/s.
    pub speed_mbps: c_int,
    /// GUID (unique per device, see `prism_transport::engine::sysfs`).
    pub guid: u64,
}

/// The engine plus what the plugin derived from its configuration.
pub struct NetState {
    /// The engine.
    pub net: Net,
    /// Devices in NCCL order.
    pub devices: Vec<Device>,
    /// Where to write statistics when the engine goes away.
    pub stats_file: Option<PathBuf>,
    /// Counts this engine as alive until everything above is dropped (fields drop in order).
    _alive: Alive,
}

/// Engines built and not yet completely dropped, and a signal when one is gone.
static ENGINES: Mutex<usize> = Mutex::new(0);
static ENGINE_GONE: Condvar = Condvar::new();

/// How long an `init` waits for a previous engine that is being dropped (its sockets closing, its
/// threads ending); far longer than that takes.
const TEARDOWN_WAIT: Duration = Duration::from_secs(10);

/// One live engine in [`ENGINES`].
struct Alive;

impl Alive {
    fn new() -> Self {
        *ENGINES.lock() += 1;
        Alive
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        let mut n = ENGINES.lock();
        *n = n.saturating_sub(1);
        ENGINE_GONE.notify_all();
    }
}

/// Waits until no engine is alive, or [`TEARDOWN_WAIT`] passed (the build then reports what it finds).
fn wait_for_teardown() {
    let deadline = Instant::now() + TEARDOWN_WAIT;
    let mut n = ENGINES.lock();
    while *n > 0 {
        if ENGINE_GONE.wait_until(&mut n, deadline).timed_out() {
            tracing::warn!("a previous engine is still being torn down after {TEARDOWN_WAIT:?}; building a new one beside it");
            return;
        }
    }
}

impl NetState {
    /// Checks a device index from NCCL.
    pub fn dev(&self, dev: c_int) -> Result<usize, PluginError> {
        usize::try_from(dev)
            .ok()
            .filter(|&d| d < self.devices.len())
            .ok_or_else(|| invalid(format!("device {dev} does not exist (Prism has {})", self.devices.len())))
    }

    /// The properties of device `dev`, in version-independent form.
    pub fn props(&self, dev: c_int) -> Result<DeviceProps, PluginError> {
        let d = self.devices[self.dev(dev)?];
        Ok(DeviceProps {
            dev,
            name: d.name.as_ptr(),
            pci_path: d.pci_path.map_or(std::ptr::null(), CStr::as_ptr),
            speed_mbps: d.speed_mbps,
            guid: d.guid,
            max_recvs: MAX_RECVS as c_int,
        })
    }

    /// Writes the engine's statistics to `PRISM_STATS`, if set. A failure is logged, not returned:
    /// statistics must never fail NCCL's teardown.
    pub fn write_stats(&self) {
        let Some(path) = &self.stats_file else { return };
        let text = match serde_json::to_string_pretty(&self.net.stats_json()) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("PRISM_STATS: cannot serialise statistics: {e}");
                return;
            }
        };
        match std::fs::write(path, text + "\n") {
            Ok(()) => tracing::info!(target: INIT_TARGET, "statistics written to {}", path.display()),
            Err(e) => tracing::warn!("PRISM_STATS: cannot write {}: {e}", path.display()),
        }
    }
}

/// Device names and paths must stay valid for as long as NCCL may hold them, which can outlive one
/// engine; each distinct string is therefore leaked exactly once and shared by later engines.
fn intern(s: &str) -> &'static CStr {
    static STRINGS: Mutex<BTreeMap<String, &'static CStr>> = Mutex::new(BTreeMap::new());
    let mut strings = STRINGS.lock();
    if let Some(c) = strings.get(s) {
        return c;
    }
    let c: &'static CStr = Box::leak(CString::new(s.replace('\0', "")).unwrap_or_default().into_boxed_c_str());
    strings.insert(s.to_owned(), c);
    c
}

fn build() -> Result<NetState, PluginError> {
    let cfg = PluginConfig::from_env()?;
    tracing::info!(target: INIT_TARGET, "{}", cfg.describe());
    let stats_file = cfg.stats_file(std::process::id());
    if let Some(path) = &stats_file {
        // Found now rather than when the job ends and the statistics are written.
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        if !dir.is_dir() {
            return Err(PluginError::BadValue {
                var: crate::config::STATS_VAR,
                value: path.display().to_string(),
                reason: "its directory does not exist",
            });
        }
    }
    let net = Net::new(cfg.transport, cfg.lb)?;
    let devices: Vec<Device> = net
        .devices()
        .iter()
        .map(|d| Device {
            name: intern(&d.name),
            pci_path: d.pci_path.as_deref().map(intern),
            speed_mbps: c_int::try_from(d.speed_mbps).unwrap_or(c_int::MAX),
            guid: d.guid,
        })
        .collect();
    if devices.is_empty() {
        return Err(PluginError::Transport(prism_transport::engine::TransportError::NoDevice(
            "the engine found no rail; set PRISM_IFNAMES".into(),
        )));
    }
    for (i, d) in net.devices().iter().enumerate() {
        tracing::info!(
            target: INIT_TARGET,
            "device {i}: {} ({} {}, {} Mbps, mtu {}, pci {}, guid {:#018x})",
            d.name,
            d.ifname,
            d.addr,
            d.speed_mbps,
            d.mtu,
            d.pci_path.as_deref().unwrap_or("none"),
            d.guid
        );
    }
    Ok(NetState { net, devices, stats_file, _alive: Alive::new() })
}

struct Global {
    net: Option<Arc<NetState>>,
    /// The last engine built, which open comms may keep alive after `net` let go of it.
    last: Weak<NetState>,
    /// Live v11/v12 contexts.
    contexts: usize,
    /// A v9/v10 `init` happened: that engine has no finalize and stays until unload.
    legacy: bool,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global { net: None, last: Weak::new(), contexts: 0, legacy: false });

fn get_or_build(g: &mut Global) -> Result<Arc<NetState>, PluginError> {
    if let Some(n) = &g.net {
        return Ok(n.clone());
    }
    if let Some(n) = g.last.upgrade() {
        tracing::debug!(target: INIT_TARGET, "the previous engine is still in use by open comms; taking it up again");
        g.net = Some(n.clone());
        return Ok(n);
    }
    wait_for_teardown();
    let n = Arc::new(build()?);
    g.last = Arc::downgrade(&n);
    g.net = Some(n.clone());
    Ok(n)
}

/// v9/v10 `init`: builds the engine if needed and keeps it until unload.
pub fn init_legacy() -> Result<Arc<NetState>, PluginError> {
    let mut g = GLOBAL.lock();
    let n = get_or_build(&mut g)?;
    g.legacy = true;
    Ok(n)
}

/// v11/v12 `init`: builds the engine if needed and counts one more context.
pub fn init_context() -> Result<Arc<NetState>, PluginError> {
    let mut g = GLOBAL.lock();
    let n = get_or_build(&mut g)?;
    g.contexts += 1;
    Ok(n)
}

/// v11/v12 `finalize`: one context fewer; the last one takes the engine down (statistics first).
pub fn finalize_context() {
    let last = {
        let mut g = GLOBAL.lock();
        g.contexts = g.contexts.saturating_sub(1);
        if g.contexts == 0 && !g.legacy {
            g.net.take()
        } else {
            None
        }
    };
    // Outside the lock: writing a file and dropping sockets need not stall another comm's init.
    if let Some(n) = last {
        n.write_stats();
        tracing::info!(target: INIT_TARGET, "last communicator finalized; engine released");
    }
}

/// The engine, for calls that need one (`devices`, `getProperties`, v9/v10 `listen`/`connect`).
pub fn current(what: &'static str) -> Result<Arc<NetState>, PluginError> {
    GLOBAL.lock().net.clone().ok_or(PluginError::NotInitialized(what))
}

/// Live v11/v12 contexts and whether an engine exists (for tests).
pub fn census() -> (usize, bool) {
    let g = GLOBAL.lock();
    (g.contexts, g.net.is_some())
}

/// Library unload (`dlclose` or process exit): NCCL's logger may be gone, so it is forgotten first;
/// then a v9/v10 engine writes its statistics and is dropped.
extern "C" fn on_unload() {
    let _ = std::panic::catch_unwind(|| {
        crate::log::clear_logger();
        let net = {
            let mut g = GLOBAL.lock();
            g.contexts = 0;
            g.legacy = false;
            g.net.take()
        };
        if let Some(n) = net {
            n.write_stats();
        }
    });
}

// The linker runs every function in `.fini_array` when the library is unloaded (dlclose) or the
// process exits; this is what `__attribute__((destructor))` does in C, without a dependency.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".fini_array"]
static ON_UNLOAD: extern "C" fn() = on_unload;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interned_string_is_shared_and_stays_valid() {
        let a = intern("prism:test0");
        let b = intern("prism:test0");
        assert_eq!(a.as_ptr(), b.as_ptr());
        assert_eq!(a.to_str().unwrap(), "prism:test0");
    }
}
