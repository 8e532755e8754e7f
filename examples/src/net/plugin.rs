//! A loaded plugin: its table's name and version, `init`, `devices`, `getProperties`, `finalize`.

use std::ffi::c_int;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::NetError;
use crate::ffi::{self, c_chars_to_string, Shim};

/// A plugin result code as a `Result`, naming the call.
pub(super) fn check(call: &'static str, code: c_int) -> Result<(), NetError> {
    if code == 0 {
        Ok(())
    } else {
        Err(NetError::Plugin { call, code })
    }
}

/// One device's properties as the plugin reported them.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceProps {
    /// Device index.
    pub dev: usize,
    /// `name`.
    pub name: String,
    /// `pciPath` (empty when NULL).
    pub pci_path: String,
    /// `guid`.
    pub guid: u64,
    /// `speed` in Mbps.
    pub speed_mbps: i32,
    /// `port`.
    pub port: i32,
    /// `ptrSupport` bits (1 = host).
    pub ptr_support: i32,
    /// `regIsGlobal`.
    pub reg_is_global: i32,
    /// `latency` in µs.
    pub latency_us: f32,
    /// `maxComms`.
    pub max_comms: i32,
    /// `maxRecvs`.
    pub max_recvs: i32,
    /// `maxP2pBytes`.
    pub max_p2p_bytes: usize,
    /// `railId` (v12; -1 before).
    pub rail_id: i32,
}

/// A loaded plugin: the dlopened `.so` and its `ncclNetPlugin_vN` table.
pub struct Plugin {
    shim: Shim,
    path: PathBuf,
    version: u32,
    name: String,
    initialised: bool,
}

impl Plugin {
    /// Which plugin log lines reach stderr: 0 = WARN, 1 = +INFO, 2 = +TRACE. Call before `init`.
    pub fn set_verbosity(verbosity: u8) {
        ffi::set_verbosity(verbosity);
    }

    /// dlopens `path` and looks up `ncclNetPlugin_v{version}` (9..=12).
    pub fn open(path: &Path, version: u32) -> Result<Self, NetError> {
        let version_c = c_int::try_from(version).map_err(|_| NetError::Load(format!("ABI version {version}")))?;
        let shim = Shim::open(path, version_c).map_err(NetError::Load)?;
        let name = shim.name();
        Ok(Self { shim, path: path.to_path_buf(), version, name, initialised: false })
    }

    /// The table's `name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The path it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The ABI version in use.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `init` (v11/v12 get `comm_id` as the communicator hash).
    pub fn init(&mut self, comm_id: u64) -> Result<(), NetError> {
        check("init", self.shim.init(comm_id))?;
        self.initialised = true;
        Ok(())
    }

    /// `devices`.
    pub fn devices(&self) -> Result<usize, NetError> {
        let (code, n) = self.shim.devices();
        check("devices", code)?;
        usize::try_from(n).map_err(|_| NetError::Plugin { call: "devices", code: n })
    }

    /// `getProperties(dev)`.
    pub fn properties(&self, dev: usize) -> Result<DeviceProps, NetError> {
        let dev_c = c_int::try_from(dev).map_err(|_| NetError::Protocol(format!("device {dev}")))?;
        let (code, p) = self.shim.properties(dev_c);
        check("getProperties", code)?;
        Ok(DeviceProps {
            dev,
            name: c_chars_to_string(&p.name),
            pci_path: c_chars_to_string(&p.pci_path),
            guid: p.guid,
            speed_mbps: p.speed_mbps,
            port: p.port,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            latency_us: p.latency_us,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            max_p2p_bytes: p.max_p2p_bytes,
            rail_id: p.rail_id,
        })
    }

    /// `finalize` (v11/v12) after a successful `init`.
    pub fn finalize(&mut self) -> Result<(), NetError> {
        if !self.initialised {
            return Ok(());
        }
        self.initialised = false;
        check("finalize", self.shim.finalize())
    }

    /// The loaded shim, for the transport's comm and request calls.
    pub(super) fn shim(&self) -> &Shim {
        &self.shim
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        // Errors here have no one left to report to; `ShimTransport::close` reports them on the normal
        // path. The shim itself is closed (dlclose) when the field drops, after this.
        let _ = self.finalize();
    }
}
