//! Verbs backend (RoCEv2) on the `sideway` crate, which loads `libibverbs.so.1` at run time: the same
//! library works on hosts without rdma-core, where [`probe`] just reports that no device exists.
//!
//! Per rail ([`VerbsDevice`]): device context, PD, the RoCEv2 IPv4-mapped GID, and a registration
//! cache ([`MrCache`]: NCCL registers the same buffer again and again). Per connection and rail
//! ([`QpSet`]): `PRISM_PATHS` UC (or RC) QPs, one per entropy, each with its own GRH flow label so its
//! RoCEv2 UDP source port (and so its ECMP path) differs ([`flow_label`], [`udp_sport`]); one send and
//! one receive CQ (basic CQs: rxe's extended CQ polls forever, research note G1); a registered ring of
//! small send slots and one of receive slots.
//!
//! Data: an RDMA WRITE WITH IMM of the payload from the registered send buffer straight into the
//! receiver's registered buffer (imm = low 32 bits of the PSN, big-endian on the wire, note G3), then a
//! SEND of the 64-byte DATA header on the same QP (a QP keeps order). Every other packet is a SEND. The
//! receiver pairs each header with the WRITE that came just before it on that QP ([`match_header`]);
//! a header without its WRITE, or a WRITE without its header (UC lost one of them), is dropped and
//! counted, and proto's loss recovery resends the packet.
//!
//! Every receive WQE carries one slot of the receive ring; a WRITE WITH IMM consumes a WQE without
//! writing into it (note G4), so WRITEs and SENDs can share one FIFO receive queue.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use parking_lot::Mutex;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, GenericCompletionQueue, WorkCompletionOperationType, WorkCompletionStatus};
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard as _, QueuePair as _, QueuePairAttribute, QueuePairState, QueuePairType, SendOperationFlags,
    SetScatterGatherEntry as _, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

pub use crate::wire::RailPeer;
use crate::wire::{DataPacket, Header, PacketType, DATA_HEADER_LEN};

/// Bytes of one send or receive ring slot: the largest control packet (a keyed CTS) fits.
pub const SLOT_BYTES: usize = 1024;
/// Receive WQEs (and ring slots) per QP.
pub const RECV_DEPTH: usize = 256;
/// Send slots per QP (each DATA packet also takes a WRITE WQE without a slot).
pub const SEND_SLOTS: usize = 128;
/// RC retransmission timeout exponent (4.096 µs · 2^t): TCG guests need ≥ 16 (notes §4).
pub const RC_TIMEOUT: u8 = 16;
/// RC retry count (7 = rxe retries for ever, notes §6).
pub const RC_RETRY: u8 = 7;

/// Errors of the verbs backend.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// No usable RDMA device (library missing, no device, no active port, no RoCEv2 IPv4 GID).
    #[error("{0}")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("{what}: {detail}")]
    Call {
        /// What was attempted.
        what: String,
        /// The library's error.
        detail: String,
    },
}

fn call(what: impl Into<String>) -> impl FnOnce(&dyn std::fmt::Display) -> VerbsError {
    let what = what.into();
    move |e| VerbsError::Call { what, detail: e.to_string() }
}

macro_rules! vtry {
    ($e:expr, $what:expr) => {
        $e.map_err(|e| call($what)(&e))
    };
}

// ---------------------------------------------------------------------------------------------
// Pure parts (unit-tested without a device).

/// The RoCEv2 UDP source port the kernel derives from a GRH flow label (rxe, mlx5:
/// `rdma_flow_label_to_udp_sport`).
pub fn udp_sport(flow_label: u32) -> u16 {
    let fl = flow_label & 0xF_FFFF;
    0xC000 | (((fl & 0x3FFF) ^ (fl >> 14)) as u16)
}

/// First flow label of a connection's QPs: in `1..0x4000 - paths`, so that `base + i` never carries
/// into bit 14 and the `paths` labels give `paths` distinct source ports. Derived from the token, so
/// connections spread over different ports.
pub fn flow_label_base(token: u64, paths: u16) -> u32 {
    let span = 0x4000u64.saturating_sub(u64::from(paths)).max(2) - 1;
    1 + ((token ^ (token >> 29) ^ (token >> 47)) % span) as u32
}

/// Flow label of QP `i` of a connection whose base is `base`.
pub fn flow_label(base: u32, i: u16) -> u32 {
    base + u32::from(i)
}

/// The immediate value of a DATA packet's WRITE: the PSN's low 32 bits (host order; posted as
/// big-endian).
pub fn imm_of(psn: u64) -> u32 {
    psn as u32
}

/// A WRITE WITH IMM that arrived on a QP and waits for its DATA header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingWrite {
    /// The immediate: low 32 bits of the PSN.
    pub psn_low: u32,
    /// Bytes the WRITE placed.
    pub len: u32,
}

/// Does a DATA header (`psn`, payload `len`) belong to the WRITE pending on its QP?
pub fn match_header(pending: Option<PendingWrite>, psn: u64, len: u32) -> bool {
    pending.is_some_and(|p| p.psn_low == imm_of(psn) && p.len == len)
}

/// Registrations keyed by (address, length), reference-counted: NCCL registers the same buffer many
/// times; the memory is deregistered with the last release.
#[derive(Debug)]
pub struct MrCache<M> {
    entries: BTreeMap<(usize, usize), (M, u32)>,
}

impl<M> Default for MrCache<M> {
    fn default() -> Self {
        Self { entries: BTreeMap::new() }
    }
}

impl<M> MrCache<M> {
    /// Take a reference on the registration of exactly `(addr, len)`, registering it with `reg` if new.
    pub fn acquire<E>(&mut self, addr: usize, len: usize, reg: impl FnOnce() -> Result<M, E>) -> Result<&M, E> {
        use std::collections::btree_map::Entry;
        match self.entries.entry((addr, len)) {
            Entry::Occupied(o) => {
                let v = o.into_mut();
                v.1 += 1;
                Ok(&v.0)
            }
            Entry::Vacant(v) => Ok(&v.insert((reg()?, 1)).0),
        }
    }

    /// Drop a reference; returns the registration when it was the last one (the caller drops it,
    /// which deregisters). `None` also for a range that was never acquired.
    pub fn release(&mut self, addr: usize, len: usize) -> Option<M> {
        let e = self.entries.get_mut(&(addr, len))?;
        e.1 -= 1;
        if e.1 == 0 {
            self.entries.remove(&(addr, len)).map(|(m, _)| m)
        } else {
            None
        }
    }

    /// A registration that covers `addr..addr + len`, with its key.
    pub fn covering(&self, addr: usize, len: usize) -> Option<((usize, usize), &M)> {
        let end = addr.checked_add(len)?;
        // Entries start at or before addr; the covering one may be any of them (ranges may nest).
        self.entries
            .range(..=(addr, usize::MAX))
            .rev()
            .find(|((a, l), _)| *a <= addr && a.checked_add(*l).is_some_and(|e| e >= end))
            .map(|(k, (m, _))| (*k, m))
    }

    /// Number of distinct registrations.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// References held on `(addr, len)`.
    pub fn refs(&self, addr: usize, len: usize) -> u32 {
        self.entries.get(&(addr, len)).map_or(0, |e| e.1)
    }
}

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
    mtu: Mtu,
    /// Active MTU in bytes.
    pub mtu_bytes: u32,
    /// Link speed in Mbit/s.
    pub speed_mbps: u32,
    mrs: Mutex<MrCache<Arc<MemoryRegion>>>,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
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

// ---------------------------------------------------------------------------------------------
// Rings and QPs.

/// A registered array of fixed-size slots.
struct Ring {
    // The MR goes first: it must be deregistered before the memory is freed.
    mr: Arc<MemoryRegion>,
    buf: Box<[u8]>,
}

impl Ring {
    fn new(dev: &VerbsDevice, slots: usize) -> Result<Self, VerbsError> {
        let mut buf = vec![0u8; slots * SLOT_BYTES].into_boxed_slice();
        let addr = buf.as_mut_ptr() as usize;
        let access = AccessFlags::LocalWrite;
        // SAFETY: `buf` is heap memory owned by this Ring and outlives `mr` (field order); the device
        // writes into it only through receive WQEs this backend posts, one slot each.
        let mr = unsafe { dev.pd.reg_mr(addr, buf.len(), access) };
        let mr = vtry!(mr, "ibv_reg_mr(ring)")?;
        Ok(Self { mr, buf })
    }

    fn addr(&self, slot: usize) -> u64 {
        self.buf.as_ptr() as u64 + (slot * SLOT_BYTES) as u64
    }

    fn slot(&self, slot: usize) -> &[u8] {
        &self.buf[slot * SLOT_BYTES..(slot + 1) * SLOT_BYTES]
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        &mut self.buf[slot * SLOT_BYTES..(slot + 1) * SLOT_BYTES]
    }
}

/// Counters of one QP (serialized into `PRISM_STATS`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct QpStats {
    /// Local QP number.
    pub qpn: u32,
    /// Flow label of its GRH.
    pub flow_label: u32,
    /// UDP source port the kernel derives from it.
    pub udp_sport: u16,
    /// WRITE WITH IMM posted.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// SENDs posted.
    pub sends: u64,
    /// Packets not posted: send queue full.
    pub sq_full: u64,
    /// Packets not posted: the QP is dead.
    pub dead_drops: u64,
    /// DATA headers delivered with their payload in place.
    pub placed: u64,
    /// Other packets received.
    pub received: u64,
    /// WRITEs whose header never came (the next completion was not their header).
    pub orphan_writes: u64,
    /// DATA headers without their WRITE.
    pub orphan_headers: u64,
    /// Error completions.
    pub errors: u64,
    /// The QP went to the error state or reported an error completion (and is not re-created yet).
    pub dead: bool,
    /// Times the QP was re-created (reset and connected again to the peer's) after it died.
    pub recreated: u64,
}

struct Qp {
    // The QP must be destroyed before its CQs (sideway asserts on ibv_destroy_cq).
    qp: ExtendedQueuePair,
    psn: u32,
    /// Bumped by every reset; carried in the work request ids so that completions of WRs posted
    /// before a reset are recognised and ignored.
    gen: u16,
    wrs_in_flight: usize,
    slots_in_flight: usize,
    next_slot: usize,
    pending: Option<PendingWrite>,
    /// PSNs of the WRITEs posted and not yet completed locally, in posting order (a send queue
    /// completes in order).
    write_psns: std::collections::VecDeque<u64>,
    stats: QpStats,
}

/// What a receive completion brought.
pub enum RxEvent<'a> {
    /// A DATA header whose payload its WRITE already placed.
    Placed(&'a [u8]),
    /// Any other packet (CTS, SACK, control, payload-less DATA).
    Packet(&'a [u8]),
}

/// Why a packet was not posted (proto's loss recovery resends DATA; control is resent by its timers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostFail {
    /// The QP is dead.
    Dead,
    /// The send queue is full.
    Full,
    /// The packet does not fit a slot.
    TooBig,
}

const KIND_WRITE: u64 = 0;
const KIND_SLOT: u64 = 1;

fn wr_id(q: usize, gen: u16, kind: u64, slot: usize) -> u64 {
    (u64::from(gen) << 48) | (((q as u64) & 0xffff) << 32) | (kind << 24) | slot as u64
}

/// (QP index, generation, kind, slot).
fn wr_parts(id: u64) -> (usize, u16, u64, usize) {
    (((id >> 32) & 0xffff) as usize, (id >> 48) as u16, (id >> 24) & 0xff, (id & 0xff_ffff) as usize)
}

/// One connection's QPs on one rail.
pub struct QpSet {
    // Drop order matters: QPs, then CQs, then rings (their MRs), then the device.
    qps: Vec<Qp>,
    send_cq: Arc<BasicCompletionQueue>,
    recv_cq: Arc<BasicCompletionQueue>,
    send_ring: Ring,
    recv_ring: Ring,
    dev: Arc<VerbsDevice>,
    rc: bool,
    connected: bool,
    /// The peer's GID on this rail (known once connected).
    peer_gid: [u8; 16],
}

impl QpSet {
    /// Create `paths` QPs (UC, or RC when `rc`) in INIT with their receives posted; flow labels
    /// start at `fl_base`.
    pub fn new(dev: &Arc<VerbsDevice>, paths: u16, rc: bool, fl_base: u32) -> Result<Self, VerbsError> {
        let n = paths.max(1) as usize;
        let send_wr = (2 * SEND_SLOTS) as u32;
        let send_cq = vtry!(dev.ctx.create_cq_builder().setup_cqe(send_wr * n as u32).build(), "create send CQ")?;
        let recv_cq = vtry!(dev.ctx.create_cq_builder().setup_cqe((RECV_DEPTH * n) as u32).build(), "create recv CQ")?;
        let send_ring = Ring::new(dev, SEND_SLOTS * n)?;
        let recv_ring = Ring::new(dev, RECV_DEPTH * n)?;
        let mut qps = Vec::with_capacity(n);
        for i in 0..n {
            let mut b = dev.pd.create_qp_builder();
            b.setup_qp_type(if rc { QueuePairType::ReliableConnection } else { QueuePairType::UnreliableConnection })
                // UC has no RDMA READ: the default op flags make rxe refuse the QP (note G2).
                .setup_send_ops_flags(SendOperationFlags::Write | SendOperationFlags::WriteWithImmediate | SendOperationFlags::Send)
                .setup_max_send_wr(send_wr)
                .setup_max_recv_wr(RECV_DEPTH as u32)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .setup_send_cq(GenericCompletionQueue::from(send_cq.clone()))
                .setup_recv_cq(GenericCompletionQueue::from(recv_cq.clone()));
            let mut qp = vtry!(b.build_ex(), "create QP")?;
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(1)
                .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
            vtry!(qp.modify(&a), "QP RESET->INIT")?;
            let fl = flow_label(fl_base, i as u16);
            let stats = QpStats { qpn: qp.qp_number(), flow_label: fl, udp_sport: udp_sport(fl), ..QpStats::default() };
            let psn = rand::random::<u32>() & 0xFF_FFFF;
            qps.push(Qp {
                qp,
                psn,
                gen: 0,
                wrs_in_flight: 0,
                slots_in_flight: 0,
                next_slot: 0,
                pending: None,
                write_psns: std::collections::VecDeque::new(),
                stats,
            });
        }
        let mut set = Self { qps, send_cq, recv_cq, send_ring, recv_ring, dev: dev.clone(), rc, connected: false, peer_gid: [0; 16] };
        for q in 0..n {
            for s in 0..RECV_DEPTH {
                set.post_recv(q, q * RECV_DEPTH + s)?;
            }
        }
        Ok(set)
    }

    /// Our side's connection data.
    pub fn local(&self) -> RailPeer {
        RailPeer { gid: self.dev.gid, qps: self.qps.iter().map(|q| (q.qp.qp_number(), q.psn)).collect() }
    }

    /// The device.
    pub fn device(&self) -> &Arc<VerbsDevice> {
        &self.dev
    }

    /// Move every QP to RTR and RTS towards the peer's QPs (paired by index).
    pub fn connect(&mut self, peer: &RailPeer) -> Result<(), VerbsError> {
        if peer.qps.len() != self.qps.len() {
            return Err(VerbsError::Call {
                what: "connect QPs".into(),
                detail: format!("peer has {} QPs on this rail, we have {}", peer.qps.len(), self.qps.len()),
            });
        }
        self.peer_gid = peer.gid;
        for (q, &(rqpn, rpsn)) in peer.qps.iter().enumerate() {
            self.connect_qp(q, rqpn, rpsn)?;
        }
        self.connected = true;
        Ok(())
    }

    /// Move QP `q` (in INIT) to RTR and RTS towards the peer's QP `rqpn` whose first PSN is `rpsn`.
    fn connect_qp(&mut self, q: usize, rqpn: u32, rpsn: u32) -> Result<(), VerbsError> {
        let gid = Gid { raw: self.peer_gid };
        let qp = &mut self.qps[q];
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(0).setup_port(1).setup_service_level(0).setup_grh(&gid, qp.stats.flow_label, self.dev.gid_index, 64, 0);
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(self.dev.mtu)
            .setup_dest_qp_num(rqpn)
            .setup_rq_psn(rpsn & 0xFF_FFFF)
            .setup_address_vector(&ah);
        if self.rc {
            a.setup_max_dest_read_atomic(0).setup_min_rnr_timer(12);
        }
        vtry!(qp.qp.modify(&a), format!("QP {:#x} INIT->RTR", qp.stats.qpn))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToSend).setup_sq_psn(qp.psn);
        if self.rc {
            a.setup_timeout(RC_TIMEOUT).setup_retry_cnt(RC_RETRY).setup_rnr_retry(7).setup_max_read_atomic(0);
        }
        vtry!(qp.qp.modify(&a), format!("QP {:#x} RTR->RTS", qp.stats.qpn))?;
        tracing::debug!(
            dev = %self.dev.name, qpn = qp.stats.qpn, rqpn, flow_label = qp.stats.flow_label,
            udp_sport = qp.stats.udp_sport, "QP connected; expected RoCEv2 source port {:#x}", qp.stats.udp_sport
        );
        Ok(())
    }

    /// Is the rail's port active (the link is up)?
    pub fn port_active(&self) -> bool {
        self.dev.ctx.query_port(1).is_ok_and(|p| p.port_state() == PortState::Active)
    }

    /// Reset dead QP `q` for re-creation: RESET (drops every outstanding WR; their completions
    /// still in the CQs are ignored by generation), INIT, receives posted again, a new first PSN.
    /// The QP stays dead until [`Self::reconnect_qp`]. Returns its (QPN, PSN) for the peer and the
    /// PSNs of the WRITEs that were still queued (the NIC is done with them).
    pub fn reset_qp(&mut self, q: usize) -> Result<(u32, u32, Vec<u64>), VerbsError> {
        let qp = self.qps.get_mut(q).ok_or_else(|| VerbsError::Call { what: "reset QP".into(), detail: format!("no QP {q}") })?;
        qp.stats.dead = true;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Reset);
        vtry!(qp.qp.modify(&a), format!("QP {:#x} ->RESET", qp.stats.qpn))?;
        qp.gen = qp.gen.wrapping_add(1);
        qp.wrs_in_flight = 0;
        qp.slots_in_flight = 0;
        qp.pending = None;
        let drained: Vec<u64> = qp.write_psns.drain(..).collect();
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        vtry!(qp.qp.modify(&a), format!("QP {:#x} RESET->INIT", qp.stats.qpn))?;
        qp.psn = rand::random::<u32>() & 0xFF_FFFF;
        let (qpn, psn) = (qp.qp.qp_number(), qp.psn);
        for s in 0..RECV_DEPTH {
            self.post_recv(q, q * RECV_DEPTH + s)?;
        }
        Ok((qpn, psn, drained))
    }

    /// Connect QP `q` (after [`Self::reset_qp`]) to the peer's re-created QP; it is live again.
    pub fn reconnect_qp(&mut self, q: usize, rqpn: u32, rpsn: u32) -> Result<(), VerbsError> {
        if q >= self.qps.len() || !self.connected {
            return Err(VerbsError::Call { what: "reconnect QP".into(), detail: format!("no connected QP {q}") });
        }
        self.connect_qp(q, rqpn, rpsn)?;
        let qp = &mut self.qps[q];
        qp.stats.dead = false;
        qp.stats.recreated += 1;
        Ok(())
    }

    fn post_recv(&mut self, q: usize, slot: usize) -> Result<(), VerbsError> {
        let addr = self.recv_ring.addr(slot);
        let lkey = self.recv_ring.mr.lkey();
        let gen = self.qps[q].gen;
        let qp = &mut self.qps[q].qp;
        let mut g = qp.start_post_recv();
        let h = g.construct_wr(wr_id(q, gen, KIND_SLOT, slot));
        // SAFETY: the slot lies inside the registered receive ring, which outlives the QP; each slot
        // is posted at most once at a time (reposted only after its completion was consumed).
        unsafe { h.setup_sge(lkey, addr, SLOT_BYTES as u32) };
        vtry!(g.post(), "post receive")
    }

    /// Number of QPs (entropies on this rail).
    pub fn paths(&self) -> usize {
        self.qps.len()
    }

    fn check_postable(&mut self, q: usize, wrs: usize, slot: bool) -> Result<(), PostFail> {
        let qp = &mut self.qps[q];
        if qp.stats.dead || !self.connected {
            qp.stats.dead_drops += 1;
            return Err(PostFail::Dead);
        }
        if qp.wrs_in_flight + wrs > 2 * SEND_SLOTS || (slot && qp.slots_in_flight >= SEND_SLOTS) {
            qp.stats.sq_full += 1;
            return Err(PostFail::Full);
        }
        Ok(())
    }

    fn take_slot(&mut self, q: usize, bytes: &[u8]) -> usize {
        let qp = &mut self.qps[q];
        let slot = q * SEND_SLOTS + qp.next_slot;
        qp.next_slot = (qp.next_slot + 1) % SEND_SLOTS;
        self.send_ring.slot_mut(slot)[..bytes.len()].copy_from_slice(bytes);
        slot
    }

    /// Post a SEND of `bytes` (a whole control packet, or a payload-less DATA header) on QP `q`.
    pub fn post_send(&mut self, q: usize, bytes: &[u8]) -> Result<(), PostFail> {
        if bytes.len() > SLOT_BYTES {
            return Err(PostFail::TooBig);
        }
        self.check_postable(q, 1, true)?;
        let slot = self.take_slot(q, bytes);
        let addr = self.send_ring.addr(slot);
        let lkey = self.send_ring.mr.lkey();
        let qp = &mut self.qps[q];
        let mut g = qp.qp.start_post_send();
        let h = g.construct_wr(wr_id(q, qp.gen, KIND_SLOT, slot), WorkRequestFlags::Signaled).setup_send();
        // SAFETY: the slot is inside the registered send ring, which outlives the QP; it is not
        // reused before this WR's completion (slots_in_flight < SEND_SLOTS, completions are FIFO).
        unsafe { h.setup_sge(lkey, addr, bytes.len() as u32) };
        if let Err(e) = g.post() {
            tracing::warn!(qpn = qp.stats.qpn, "post send failed: {e}");
            qp.stats.errors += 1;
            return Err(PostFail::Dead);
        }
        qp.wrs_in_flight += 1;
        qp.slots_in_flight += 1;
        qp.stats.sends += 1;
        Ok(())
    }

    /// Post a DATA packet on QP `q`: WRITE WITH IMM of `len` bytes from `local` (registered, `lkey`)
    /// to `remote` (`rkey`), then a SEND of its 64-byte `header`. The caller checked the ranges.
    #[allow(clippy::too_many_arguments)]
    pub fn post_data(
        &mut self,
        q: usize,
        local: u64,
        lkey: u32,
        len: u32,
        remote: u64,
        rkey: u32,
        psn: u64,
        header: &[u8],
    ) -> Result<(), PostFail> {
        if header.len() > SLOT_BYTES {
            return Err(PostFail::TooBig);
        }
        self.check_postable(q, 2, true)?;
        let slot = self.take_slot(q, header);
        let haddr = self.send_ring.addr(slot);
        let ring_lkey = self.send_ring.mr.lkey();
        let qp = &mut self.qps[q];
        let mut g = qp.qp.start_post_send();
        let w =
            g.construct_wr(wr_id(q, qp.gen, KIND_WRITE, 0), WorkRequestFlags::Signaled).setup_write_imm(rkey, remote, imm_of(psn).to_be());
        // SAFETY: `local..local + len` lies in memory registered with `lkey` that the caller keeps
        // registered and unchanged until the send completes (the engine holds the registration for
        // the message's lifetime).
        unsafe { w.setup_sge(lkey, local, len) };
        let h = g.construct_wr(wr_id(q, qp.gen, KIND_SLOT, slot), WorkRequestFlags::Signaled).setup_send();
        // SAFETY: as in post_send.
        unsafe { h.setup_sge(ring_lkey, haddr, header.len() as u32) };
        if let Err(e) = g.post() {
            tracing::warn!(qpn = qp.stats.qpn, "post write failed: {e}");
            qp.stats.errors += 1;
            return Err(PostFail::Dead);
        }
        qp.wrs_in_flight += 2;
        qp.slots_in_flight += 1;
        qp.write_psns.push_back(psn);
        qp.stats.writes += 1;
        qp.stats.write_bytes += u64::from(len);
        qp.stats.sends += 1;
        Ok(())
    }

    /// Reap send completions (frees slots; an error completion kills its QP); `write_done` gets the
    /// PSN of every WRITE that completed (successfully or not: either way the NIC is done with it).
    pub fn poll_send(&mut self, mut write_done: impl FnMut(u64)) {
        loop {
            let Ok(poller) = self.send_cq.start_poll() else { return };
            let mut n = 0;
            for wc in poller {
                n += 1;
                let (q, gen, kind, _) = wr_parts(wc.wr_id());
                let Some(qp) = self.qps.get_mut(q) else { continue };
                if gen != qp.gen {
                    // Posted before a reset: already accounted for by reset_qp.
                    continue;
                }
                qp.wrs_in_flight = qp.wrs_in_flight.saturating_sub(1);
                if kind == KIND_SLOT {
                    qp.slots_in_flight = qp.slots_in_flight.saturating_sub(1);
                } else if let Some(psn) = qp.write_psns.pop_front() {
                    write_done(psn);
                }
                if wc.status() != WorkCompletionStatus::Success as u32 {
                    qp.stats.errors += 1;
                    if !qp.stats.dead {
                        tracing::warn!(dev = %self.dev.name, qpn = qp.stats.qpn, status = wc.status(), "send completion error: QP marked dead");
                    }
                    qp.stats.dead = true;
                }
            }
            if n == 0 {
                return;
            }
        }
    }

    /// Reap receive completions and hand each packet to `deliver` (then repost its slot).
    pub fn poll_recv(&mut self, mut deliver: impl FnMut(RxEvent<'_>)) {
        loop {
            let Ok(poller) = self.recv_cq.start_poll() else { return };
            let wcs: Vec<(u64, u32, u32, u32, u32)> =
                poller.map(|wc| (wc.wr_id(), wc.status(), wc.opcode(), wc.byte_len(), u32::from_be(wc.imm_data()))).collect();
            if wcs.is_empty() {
                return;
            }
            for (id, status, opcode, len, imm) in wcs {
                let (q, gen, _, slot) = wr_parts(id);
                if q >= self.qps.len() || slot >= RECV_DEPTH * self.qps.len() || gen != self.qps[q].gen {
                    // A receive posted before a reset (flushed): its slot was posted again then.
                    continue;
                }
                if status != WorkCompletionStatus::Success as u32 {
                    let qp = &mut self.qps[q];
                    qp.stats.errors += 1;
                    if status != WorkCompletionStatus::WorkRequestFlushedError as u32 && !qp.stats.dead {
                        tracing::warn!(dev = %self.dev.name, qpn = qp.stats.qpn, status, "receive completion error: QP marked dead");
                    }
                    qp.stats.dead = true;
                    continue;
                }
                if opcode == WorkCompletionOperationType::ReceiveWithImmediate as u32 {
                    let qp = &mut self.qps[q];
                    if qp.pending.is_some() {
                        qp.stats.orphan_writes += 1;
                    }
                    qp.pending = Some(PendingWrite { psn_low: imm, len });
                } else if opcode == WorkCompletionOperationType::Receive as u32 {
                    let n = (len as usize).min(SLOT_BYTES);
                    let bytes = &self.recv_ring.slot(slot)[..n];
                    let qp = &mut self.qps[q];
                    match classify_header(bytes) {
                        Some((psn, plen)) if plen > 0 => {
                            let pending = qp.pending.take();
                            if match_header(pending, psn, plen) {
                                qp.stats.placed += 1;
                                deliver(RxEvent::Placed(bytes));
                            } else {
                                if pending.is_some() {
                                    qp.stats.orphan_writes += 1;
                                }
                                qp.stats.orphan_headers += 1;
                            }
                        }
                        _ => {
                            qp.stats.received += 1;
                            deliver(RxEvent::Packet(bytes));
                        }
                    }
                }
                if let Err(e) = self.post_recv(q, slot) {
                    let qp = &mut self.qps[q];
                    if !qp.stats.dead {
                        tracing::warn!(qpn = qp.stats.qpn, "repost receive failed: {e}; QP marked dead");
                    }
                    qp.stats.dead = true;
                }
            }
        }
    }

    /// Mark QPs that left RTS (rxe moves a QP to ERR on local errors) as dead.
    pub fn check_states(&mut self) {
        for qp in &mut self.qps {
            if self.connected && !qp.stats.dead && matches!(qp.qp.state(), QueuePairState::Error | QueuePairState::SendQueueError) {
                tracing::warn!(qpn = qp.stats.qpn, "QP in the error state: marked dead");
                qp.stats.dead = true;
            }
        }
    }

    /// Is QP `q` dead?
    pub fn is_dead(&self, q: usize) -> bool {
        self.qps.get(q).is_none_or(|q| q.stats.dead)
    }

    /// Counters of every QP.
    pub fn stats(&self) -> Vec<QpStats> {
        self.qps.iter().map(|q| q.stats.clone()).collect()
    }
}

/// `(psn, len)` of a bare DATA header with payload (the only packets whose payload comes by WRITE);
/// `None` for anything else (TRUNC and zero-length DATA travel as ordinary packets).
fn classify_header(bytes: &[u8]) -> Option<(u64, u32)> {
    let h = Header::new_checked(bytes).ok()?;
    if h.packet_type().ok()? != PacketType::Data || bytes.len() != DATA_HEADER_LEN {
        return None;
    }
    let p = DataPacket::new_checked_header(bytes).ok()?;
    let trunc = h.flags() & crate::wire::data::FLAG_TRUNC != 0;
    (!trunc).then(|| (p.psn(), p.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sport_follows_the_kernel_fold() {
        // Measured on rxe (research notes §5).
        assert_eq!(udp_sport(0x12345), 0xe341);
        assert_eq!(udp_sport(0x1234c), 0xe348);
        assert_eq!(udp_sport(0xabcde), 0xfcf4);
        assert_eq!(udp_sport(0x0234c), udp_sport(0x12348));
    }

    #[test]
    fn every_connection_gets_distinct_ports_for_its_qps() {
        for token in [0u64, 1, 0xdead_beef, u64::MAX, 0x1234_5678_9abc_def0] {
            for paths in [1u16, 4, 16, 64, 1024] {
                let base = flow_label_base(token, paths);
                assert!(base >= 1, "label 0 would let the kernel pick");
                let mut ports: Vec<u16> = (0..paths).map(|i| udp_sport(flow_label(base, i))).collect();
                assert!(ports.iter().all(|&p| p >= 0xC000));
                ports.sort_unstable();
                ports.dedup();
                assert_eq!(ports.len(), paths as usize, "token {token:#x} paths {paths}");
            }
        }
    }

    #[test]
    fn imm_is_the_low_half_of_the_psn() {
        assert_eq!(imm_of(0x1_0000_0005), 5);
        assert_eq!(imm_of(0xffff_ffff), 0xffff_ffff);
        assert_eq!(imm_of(7).to_be(), u32::from_be_bytes([0, 0, 0, 7]).to_be());
        // What the receiver reads back (u32::from_be of the wire value) is the original.
        assert_eq!(u32::from_be(imm_of(0xabc).to_be()), 0xabc);
    }

    #[test]
    fn a_header_matches_only_its_own_write() {
        let p = Some(PendingWrite { psn_low: 9, len: 4096 });
        assert!(match_header(p, 9, 4096));
        assert!(match_header(p, 9 + (1 << 32), 4096));
        assert!(!match_header(p, 10, 4096));
        assert!(!match_header(p, 9, 4095));
        assert!(!match_header(None, 9, 4096));
    }

    #[test]
    fn only_bare_data_headers_with_payload_wait_for_a_write() {
        use crate::wire::{ControlKind, ControlPacket, ControlRepr, DataRepr};
        let d = DataRepr {
            token: 1,
            cts_ack: 0,
            psn: 77,
            cts_seq: 0,
            sub: 0,
            offset: 0,
            len: 100,
            total_len: 100,
            entropy: 0,
            ts_us: 0,
            trunc: false,
            ce: false,
            retx: false,
        };
        let mut buf = vec![0u8; d.buffer_len()];
        d.emit(&mut DataPacket::new_unchecked(&mut buf[..]));
        assert_eq!(classify_header(&buf[..DATA_HEADER_LEN]), Some((77, 100)));
        assert_eq!(classify_header(&buf), None, "a whole datagram is not a bare header");
        let t = DataRepr { trunc: true, len: 0, total_len: 5000, ..d };
        let mut tb = vec![0u8; t.buffer_len()];
        t.emit(&mut DataPacket::new_unchecked(&mut tb[..]));
        assert_eq!(classify_header(&tb), None);
        let mut c = vec![0u8; crate::wire::CONTROL_LEN];
        ControlRepr { token: 1, cts_ack: 0, kind: ControlKind::Ping, entropy: 0, ts_us: 0, cum_psn: 0 }
            .emit(&mut ControlPacket::new_unchecked(&mut c[..]));
        assert_eq!(classify_header(&c), None);
    }

    #[test]
    fn mr_cache_counts_references_and_releases_on_the_last() {
        let mut c: MrCache<u32> = MrCache::default();
        let mut regs = 0;
        let mut reg = || -> Result<u32, ()> {
            regs += 1;
            Ok(regs)
        };
        assert_eq!(*c.acquire(0x1000, 0x100, &mut reg).unwrap(), 1);
        assert_eq!(*c.acquire(0x1000, 0x100, &mut reg).unwrap(), 1);
        assert_eq!(regs, 1, "same range registers once");
        assert_eq!(c.refs(0x1000, 0x100), 2);
        assert_eq!(c.release(0x1000, 0x100), None);
        assert_eq!(c.release(0x1000, 0x100), Some(1));
        assert!(c.is_empty());
        assert_eq!(c.release(0x1000, 0x100), None, "unknown ranges are ignored");
    }

    #[test]
    fn mr_cache_finds_a_covering_registration() {
        let mut c: MrCache<&str> = MrCache::default();
        c.acquire(0x1000, 0x1000, || Ok::<_, ()>("big")).unwrap();
        c.acquire(0x1800, 0x10, || Ok::<_, ()>("small")).unwrap();
        assert_eq!(c.covering(0x1000, 0x1000).map(|(_, m)| *m), Some("big"));
        assert_eq!(c.covering(0x1900, 0x100).map(|(_, m)| *m), Some("big"));
        assert_eq!(c.covering(0x1800, 0x8).map(|(_, m)| *m), Some("small"));
        assert_eq!(c.covering(0x1f00, 0x200), None, "crosses the end");
        assert_eq!(c.covering(0xf00, 0x200), None, "starts before");
        assert_eq!(c.covering(usize::MAX, 2), None);
    }

    #[test]
    fn deregistering_a_buffer_whose_request_is_in_flight_keeps_the_registration_until_the_request_ends() {
        // NCCL's regMr, then a request on a buffer inside it (takes its own reference on the covering
        // registration), then NCCL's deregMr with the request still in flight.
        let mut c: MrCache<&str> = MrCache::default();
        c.acquire(0x1000, 0x1000, || Ok::<_, ()>("nccl")).unwrap();
        let (key, _) = c.covering(0x1100, 0x100).unwrap();
        c.acquire(key.0, key.1, || Ok::<_, ()>("unused")).unwrap();
        assert_eq!(c.release(0x1000, 0x1000), None, "the request still holds the registration");
        assert_eq!(c.refs(0x1000, 0x1000), 1);
        assert_eq!(c.release(key.0, key.1), Some("nccl"), "the request's end deregisters");
        assert!(c.is_empty());
        assert_eq!(c.release(0x1000, 0x1000), None, "a second release is ignored");
    }

    #[test]
    fn a_failed_registration_leaves_nothing_behind() {
        let mut c: MrCache<u32> = MrCache::default();
        assert!(c.acquire(0x1000, 1, || Err::<u32, _>("EFAULT")).is_err());
        assert!(c.is_empty());
    }

    #[test]
    fn wr_ids_carry_qp_kind_and_slot() {
        assert_eq!(wr_parts(wr_id(15, 0, KIND_SLOT, 4095)), (15, 0, KIND_SLOT, 4095));
        assert_eq!(wr_parts(wr_id(0, 0, KIND_WRITE, 0)), (0, 0, KIND_WRITE, 0));
        assert_eq!(wr_parts(wr_id(1023, 0xffff, KIND_SLOT, RECV_DEPTH * 1024 - 1)), (1023, 0xffff, KIND_SLOT, RECV_DEPTH * 1024 - 1));
        assert_eq!(wr_parts(wr_id(7, 3, KIND_WRITE, 0)).1, 3, "the generation survives");
    }
}
