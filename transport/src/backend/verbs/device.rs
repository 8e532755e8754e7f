//! Devices: finding the RoCEv2 devices ([`probe`]), opening one (context, PD, GID, MTU), and its
//! memory registrations.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use parking_lot::Mutex;
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::mr::MrCache;
use super::VerbsError;

// ---------------------------------------------------------------------------------------------
// Devices.

/// One RDMA device used as a rail.
pub struct VerbsDevice {
    /// Device name, e.g. `rxe0`.
    pub name: String,
    /// The netdev behind the GID.
    pub ifname: String,
    /// IPv4 address of the GID (the rail's address, also used for the TCP handshake).
    pub ipv4: Ipv4Addr,
    /// The GID.
    pub gid: [u8; 16],
    /// GID index.
    pub gid_index: u8,
    /// Active path MTU.
    pub(super) mtu: Mtu,
    /// Active MTU in bytes.
    pub mtu_bytes: u32,
    /// Link speed in Mbit/s.
    pub speed_mbps: u32,
    mrs: Mutex<MrCache<Arc<MemoryRegion>>>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) ctx: Arc<DeviceContext>,
}

impl std::fmt::Debug for VerbsDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDevice").field("name", &self.name).field("gid_index", &self.gid_index).finish_non_exhaustive()
    }
}

/// Local and remote keys of one registered range on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrKeys {
    /// The registration's (addr, len) key in the cache (for the release).
    pub key: (usize, usize),
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

/// Find the devices: `hca` names them (empty = every device with an active port and a RoCEv2 IPv4
/// GID); `gid_index` overrides the GID search. An error says why none is usable.
pub fn probe(hca: &[String], gid_index: Option<u8>) -> Result<Vec<VerbsDevice>, VerbsError> {
    let list = DeviceList::new().map_err(|e| VerbsError::NoDevice(format!("libibverbs not usable ({e})")))?;
    if list.is_empty() {
        return Err(VerbsError::NoDevice("libibverbs found no RDMA device".into()));
    }
    let mut out = Vec::new();
    let mut why = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        if !hca.is_empty() && !hca.contains(&name) {
            continue;
        }
        match open(&dev, &name, gid_index) {
            Ok(d) => out.push(d),
            Err(e) => why.push(format!("{name}: {e}")),
        }
    }
    if !hca.is_empty() {
        if let Some(missing) = hca.iter().find(|h| !out.iter().any(|d| &d.name == *h)) {
            let detail = if why.is_empty() { "no such device".to_string() } else { why.join("; ") };
            return Err(VerbsError::NoDevice(format!("PRISM_IB_HCA names {missing}, which is not usable: {detail}")));
        }
        // Keep the order PRISM_IB_HCA gives.
        out.sort_by_key(|d| hca.iter().position(|h| h == &d.name));
    }
    if out.is_empty() {
        return Err(VerbsError::NoDevice(format!("no active RDMA device with a RoCEv2 IPv4 GID ({})", why.join("; "))));
    }
    Ok(out)
}

fn open(dev: &sideway::ibverbs::device::Device<'_>, name: &str, gid_index: Option<u8>) -> Result<VerbsDevice, VerbsError> {
    let ctx = vtry!(dev.open(), "open")?;
    let port = vtry!(ctx.query_port(1), "query_port")?;
    if port.port_state() != PortState::Active {
        return Err(VerbsError::NoDevice("port 1 is not active".into()));
    }
    let table = vtry!(ctx.query_gid_table(), "query_gid_table")?;
    let roce_v4 = |e: &&sideway::ibverbs::address::GidEntry| {
        e.port_num() == 1 && matches!(e.gid_type(), GidType::RoceV2) && Ipv6Addr::from(e.gid().raw).to_ipv4_mapped().is_some()
    };
    let entry = match gid_index {
        Some(i) => table
            .iter()
            .find(|e| e.gid_index() == u32::from(i) && e.port_num() == 1)
            .copied()
            .ok_or_else(|| VerbsError::NoDevice(format!("PRISM_IB_GID_INDEX={i}: no such GID on port 1")))?,
        None => table.iter().find(roce_v4).copied().ok_or_else(|| VerbsError::NoDevice("no RoCEv2 IPv4-mapped GID".into()))?,
    };
    let gid = entry.gid().raw;
    let ipv4 = Ipv6Addr::from(gid)
        .to_ipv4_mapped()
        .ok_or_else(|| VerbsError::NoDevice(format!("GID index {} is not IPv4-mapped", entry.gid_index())))?;
    let ifname = entry.netdev_name().unwrap_or_default();
    let speed_mbps = std::fs::read_to_string(format!("/sys/class/net/{ifname}/speed"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|&s| s > 0)
        .unwrap_or(10_000) as u32;
    let mtu = port.active_mtu();
    let pd = vtry!(ctx.alloc_pd(), "alloc_pd")?;
    Ok(VerbsDevice {
        name: name.to_string(),
        ifname,
        ipv4,
        gid,
        gid_index: entry.gid_index() as u8,
        mtu_bytes: mtu_bytes(mtu),
        mtu,
        speed_mbps,
        mrs: Mutex::new(MrCache::default()),
        pd,
        ctx,
    })
}

impl VerbsDevice {
    /// Register `addr..addr + len` (or take another reference on that exact registration).
    ///
    /// The caller vouches that the range is mapped memory it owns until the matching
    /// [`Self::release`]; the device may write into it (remote write is enabled).
    pub fn acquire(&self, addr: usize, len: usize) -> Result<MrKeys, VerbsError> {
        let mut mrs = self.mrs.lock();
        let pd = &self.pd;
        let mr = mrs.acquire(addr, len.max(1), || {
            let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
            // SAFETY: the caller owns the range until release (see above); ibv_reg_mr pins the pages
            // and fails (EFAULT) on unmapped memory rather than touching it.
            let r = unsafe { pd.reg_mr(addr, len.max(1), access) };
            r.map_err(|e| VerbsError::Call { what: format!("ibv_reg_mr({addr:#x}, {len})"), detail: e.to_string() })
        })?;
        Ok(MrKeys { key: (addr, len.max(1)), lkey: mr.lkey(), rkey: mr.rkey() })
    }

    /// A registration covering `addr..addr + len`, referenced once more (release it with its key);
    /// registers the exact range when none covers it.
    pub fn acquire_covering(&self, addr: usize, len: usize) -> Result<MrKeys, VerbsError> {
        let found = self.mrs.lock().covering(addr, len.max(1)).map(|(k, _)| k);
        match found {
            Some((a, l)) => self.acquire(a, l),
            None => self.acquire(addr, len),
        }
    }

    /// Drop one reference on the registration `key`; the last one deregisters.
    pub fn release(&self, key: (usize, usize)) {
        let last = self.mrs.lock().release(key.0, key.1);
        drop(last);
    }

    /// Registrations held (for stats and tests).
    pub fn registrations(&self) -> usize {
        self.mrs.lock().len()
    }
}
