//! The process-wide engine (`Net`): rails, the connection handshake, listeners.
//!
//! The handshake runs over a short-lived non-blocking TCP connection, as NCCL's own transports do for
//! their out-of-band exchange: it is reliable without a retransmission scheme of its own, and a peer
//! that is gone shows up as a refused or reset connection. Its only job is to swap connection tokens
//! and datagram ports; everything after it travels over the rail's UDP sockets.
//!
//! Handle layout (128 bytes, written by `listen`, read by `connect`; big-endian):
//! `0..4` magic "PRSM", `4` version, `6..8` TCP port, `8..12` IPv4 address, `12..20` listen nonce,
//! `64..72` the connect state key (0 until `connect` first runs; NCCL passes the same handle on every
//! retry, so the state of a connect in progress is found through it).
//!
//! HELLO (connect → listener) and its reply have one layout, [`crate::wire::hello`] (144 bytes: kind,
//! status, backend, nonce, token, host id, echo, block length, up to 16 rails as (IPv4, UDP port)).
//! Rails pair by index (rail r talks to the peer's rail r), as in rail-optimised fabrics.
//!
//! Both ends prove whom they talk to: the listener takes only a HELLO with its nonce, the connector
//! only a reply with that nonce that echoes its token. A connect retried against a listener that is
//! gone can be connected by the kernel to itself (the ephemeral source port is the closed listener's
//! port: TCP simultaneous open); that socket is dropped and the connect retried, and if it ever
//! got that far the connector would read its own HELLO, which is not a reply.
//!
//! On verbs the block after the 144 bytes carries, per rail, the GID and every QP's number and first
//! PSN ([`crate::wire::verbs_block`]); both ends create their QPs before they write their HELLO and connect
//! them once they have read the peer's.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use prism_lb::{LbRuntime, Topology};
use rand::{RngCore, SeedableRng};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::comm::{CommCore, RecvComm, SendComm, SharedCore};
use super::config::{QpType, Transport};
use super::planned::{PlannedPaths, Plans, SharedRate};
use super::progress::Progress;
use super::rail::Rail;
use super::vcomm::VerbsComm;
use super::{device, sysfs, DeviceInfo, TransportConfig, TransportError, HANDLE_LEN};
use crate::backend::udp::{UdpRail, BATCH};
use crate::backend::verbs::{self, VerbsDevice};
use crate::proto::{Connection, ProtoConfig};
use crate::wire::{
    self, HelloBackend, HelloKind, HelloPacket, HelloRepr, VerbsBlock, VerbsBlockRepr, HELLO_LEN, HELLO_MAX_BLOCK, HELLO_MAX_RAILS,
    HELLO_VERSION,
};

/// The handle shares the HELLO's magic and version.
const MAGIC: &[u8; 4] = wire::hello::HELLO_MAGIC;
const VERSION: u8 = HELLO_VERSION;
/// Largest verbs block after a HELLO.
const MAX_EXT: usize = HELLO_MAX_BLOCK;
const MAX_RAILS: usize = HELLO_MAX_RAILS;
const STAGE_OFF: usize = 64;

/// State every comm shares: configuration, clock, rails, statistics of closed comms.
pub(crate) struct NetInner {
    pub cfg: TransportConfig,
    pub lb: prism_lb::LbConfig,
    /// The load balancer shared by every comm (RailS loads, PRO/DR state per leaf, ...).
    pub lb_rt: LbRuntime,
    /// This host's id in the topology (or a stable id from its address when hosts are not listed).
    pub host_id: u32,
    pub proto: ProtoConfig,
    start: Instant,
    pub rails: Vec<Arc<Rail>>,
    closed: Mutex<super::closed::ClosedComms>,
    seeds: AtomicU64,
    pub progress: Progress,
    /// Path knowledge shared by the comms that talk to the same peer rail.
    pub board: super::board::PathBoard,
    /// Handshake counters of the listeners.
    handshakes: HandshakeStats,
}

impl NetInner {
    /// Microseconds since the engine started (proto's clock).
    pub fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Fold the final statistics of a closed comm (`v` without its connection's, `conn`) into the
    /// bounded record `stats_json` reports (see `closed`).
    pub fn record_stats(&self, v: serde_json::Value, conn: &crate::proto::ConnStats) {
        self.closed.lock().record(v, conn);
    }

    /// A seed for one connection's random choices: reproducible under `PRISM_SEED`.
    fn conn_seed(&self) -> u64 {
        let n = self.seeds.fetch_add(1, Ordering::Relaxed);
        if self.cfg.seed == 0 {
            rand::random()
        } else {
            // splitmix64 step: distinct, well-mixed seeds from one base.
            let mut z = self.cfg.seed.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    /// Wrap a new comm so that both its owner and the progress thread can drive it.
    fn adopt(self: &Arc<Self>, core: CommCore) -> SharedCore {
        let shared = Arc::new(Mutex::new(core));
        self.progress.adopt(self, &shared);
        shared
    }

    /// A protocol connection whose path policy follows the lb plans stored in `plans` and reports
    /// to `rate`.
    fn connection(&self, local: u64, peer: u64, peer_host: u32, home: u16, plans: &Plans, rate: &SharedRate) -> Connection {
        let seed = self.conn_seed();
        let policy = PlannedPaths::new(&self.lb_rt, peer_host as usize, self.rails.len() as u16, self.cfg.paths, home, seed, plans.clone())
            .with_rate(rate.clone());
        Connection::new(self.proto.clone(), local, peer, Box::new(policy), self.now_us())
    }

    /// Is this engine on the verbs backend?
    pub fn is_verbs(&self) -> bool {
        self.rails.first().is_some_and(|r| r.verbs.is_some())
    }

    /// A new connection's QPs (verbs backend), or None on UDP.
    fn verbs_comm(&self, token: u64, connector: bool) -> Result<Option<VerbsComm>, TransportError> {
        if !self.is_verbs() {
            return Ok(None);
        }
        let devs: Vec<Arc<VerbsDevice>> = self.rails.iter().filter_map(|r| r.verbs.clone()).collect();
        VerbsComm::create(&devs, self.cfg.paths, self.cfg.qp == QpType::Rc, token, self.proto.max_payload, connector).map(Some)
    }

    /// This engine's backend, as a HELLO names it.
    fn hello_backend(&self) -> HelloBackend {
        if self.is_verbs() {
            HelloBackend::Verbs
        } else {
            HelloBackend::Udp
        }
    }

    /// Our half of a handshake message: rails, token, host id, and the verbs block if any; `echo` is
    /// the token of the HELLO a reply answers.
    fn hello(
        &self,
        kind: HelloKind,
        status: u8,
        nonce: u64,
        token: u64,
        echo: u64,
        verbs: Option<&VerbsComm>,
    ) -> Result<Vec<u8>, TransportError> {
        let block = verbs.map(|v| VerbsBlockRepr { rails: v.local() }.to_vec()).unwrap_or_default();
        let rails: Vec<SocketAddrV4> = self.rails.iter().map(|r| SocketAddrV4::new(r.addr, r.port())).collect();
        // At most 16 rails (checked when the engine starts, so this cannot fail) and a block far below 4 GiB.
        let repr = HelloRepr::new(kind, status, self.hello_backend(), nonce, token, self.host_id, echo, block.len() as u32, &rails)
            .map_err(|e| TransportError::Config(format!("handshake: {e}")))?;
        let mut m = repr.to_vec();
        m.extend_from_slice(&block);
        Ok(m)
    }

    /// Check the peer's backend and connect our QPs to its (verbs).
    fn join(&self, h: &HelloRepr, block: &[u8], verbs: &mut Option<VerbsComm>) -> Result<(), TransportError> {
        let ours = self.hello_backend();
        if h.backend != ours {
            return Err(TransportError::ConnectionFailed(format!(
                "the peer uses the {} backend, this end {} (set the same PRISM_TRANSPORT on both)",
                h.backend.name(),
                ours.name()
            )));
        }
        if let Some(v) = verbs.as_mut() {
            let peers = VerbsBlock::new_checked(block)
                .and_then(|b| VerbsBlockRepr::parse(&b))
                .map_err(|e| TransportError::ConnectionFailed(format!("bad verbs handshake block: {e}")))?;
            v.connect(&peers.rails)?;
        }
        Ok(())
    }
}

/// The peer's half of a handshake, checked (only its first [`HELLO_LEN`] bytes are read).
fn parse_hello(m: &[u8]) -> Result<HelloRepr, TransportError> {
    let p = HelloPacket::new_checked(m).map_err(|e| match e {
        wire::WireError::BadField { field: "hello version", value } => {
            TransportError::ConnectionFailed(format!("peer speaks handshake version {value} (this Prism: {HELLO_VERSION})"))
        }
        e => TransportError::ConnectionFailed(format!("bad handshake: {e}")),
    })?;
    HelloRepr::parse(&p).map_err(|e| TransportError::ConnectionFailed(format!("bad handshake: {e}")))
}

/// Tell a refused connector so (best effort: it fails on its own timeout otherwise).
fn refuse(inner: &NetInner, sock: &Socket) {
    if let Ok(m) = inner.hello(HelloKind::Reply, 1, 0, 0, 0, None) {
        let _ = (&*sock).write(&m);
    }
}

/// A fresh random connection token (never 0, which marks "none").
fn new_token() -> u64 {
    loop {
        let t = rand::rngs::StdRng::from_entropy().next_u64();
        if t != 0 {
            return t;
        }
    }
}

enum Stage {
    /// TCP connect in flight.
    Connecting,
    /// Writing our HELLO (bytes written so far).
    Writing(usize),
    /// Reading the listener's reply (bytes read so far).
    Reading(usize),
}

struct PendingConnect {
    sock: Socket,
    dev: usize,
    token: u64,
    /// The listener's nonce from the handle: its reply must carry it.
    nonce: u64,
    /// Why the last attempt did not get through (for the timeout's error).
    last_failure: Option<&'static str>,
    /// Attempts the kernel connected to themselves.
    self_connects: u32,
    out: Vec<u8>,
    inp: Vec<u8>,
    stage: Stage,
    verbs: Option<VerbsComm>,
    started: Instant,
    target: SocketAddrV4,
}

impl Drop for Net {
    fn drop(&mut self) {
        // Comms normally close first (and stop the thread); this covers a caller that did not.
        self.inner.progress.stop();
    }
}

/// The process-wide engine. `Send + Sync`: NCCL calls it from several threads.
pub struct Net {
    inner: Arc<NetInner>,
    devices: Vec<DeviceInfo>,
    pending: Mutex<HashMap<u64, PendingConnect>>,
    next_stage: AtomicU64,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> TransportError {
    let what = what.into();
    move |source| TransportError::Io { what, source }
}

fn would_block(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) || e.raw_os_error() == Some(libc::EINPROGRESS)
}

impl Net {
    /// Discover the rails, bind their sockets and get ready to listen and connect.
    pub fn new(cfg: TransportConfig, lb: prism_lb::LbConfig) -> Result<Net, TransportError> {
        let vdevs = match cfg.transport {
            Transport::Udp => {
                tracing::info!("transport: udp (PRISM_TRANSPORT=udp)");
                None
            }
            Transport::Verbs => match verbs::probe(&cfg.ib_hca, cfg.ib_gid_index) {
                Ok(d) => Some(d),
                Err(e) => return Err(TransportError::NoDevice(format!("PRISM_TRANSPORT=verbs: {e}"))),
            },
            Transport::Auto => match verbs::probe(&cfg.ib_hca, cfg.ib_gid_index) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::info!("transport: udp (no RDMA device: {e})");
                    None
                }
            },
        };
        let mut rails = Vec::new();
        let mut min_dgram = usize::MAX;
        if let Some(vdevs) = vdevs {
            let names: Vec<String> =
                vdevs.iter().map(|d| format!("{} (GID index {}, {}, {})", d.name, d.gid_index, d.ipv4, d.ifname)).collect();
            let why = if cfg.transport == Transport::Verbs { "PRISM_TRANSPORT=verbs" } else { "auto: RDMA device found" };
            tracing::info!(
                "transport: verbs ({why}; {} {} QPs per rail: {})",
                cfg.paths,
                if cfg.qp == QpType::Rc { "RC" } else { "UC" },
                names.join(", ")
            );
            for (rail, d) in vdevs.into_iter().enumerate() {
                // Verbs device names are unique (one entry per device), so the names need no suffix.
                let p = sysfs::verbs_placement(std::path::Path::new(sysfs::SYSFS), &d.name, 1, &d.ifname, rail);
                let info = DeviceInfo {
                    name: format!("prism:{}", d.name),
                    ifname: d.ifname.clone(),
                    addr: std::net::IpAddr::V4(d.ipv4),
                    speed_mbps: p.speed_mbps,
                    mtu: d.mtu_bytes,
                    pci_path: p.pci_path,
                    guid: p.guid,
                };
                // One WRITE never spans two lb chunks: the path policy places a packet by the chunk
                // its offset falls in, so packets that cover several chunks would all follow the
                // first one's rail (with 64 KiB packets over 32 KiB chunks, every packet started on
                // an even chunk and one rail carried everything). Both sizes are whole lines
                // (multiples of `wire::LINE_BYTES`, checked by their parsers; rounded here again), so
                // every WRITE but a buffer's last one ends on a line boundary (NCCL's LL/LL128).
                let payload = cfg.ib_chunk.min(lb.chunk_bytes.max(1024)) as usize;
                let payload = payload - payload % wire::LINE_BYTES;
                min_dgram = min_dgram.min(wire::MAX_HEADER_LEN + payload);
                let addr = d.ipv4;
                rails.push(Arc::new(Rail::new(info, None, Some(Arc::new(d)), addr, min_dgram)));
            }
        }
        let devices = if rails.is_empty() { device::discover(&cfg.ifnames)? } else { Vec::new() };
        for info in devices {
            let std::net::IpAddr::V4(addr) = info.addr else {
                return Err(TransportError::NoDevice(format!("{}: only IPv4 is supported", info.ifname)));
            };
            // IP (20) + UDP (8) headers come out of the MTU; loopback's 64 KiB MTU is capped like jumbo frames.
            let mtu = if cfg.mtu == 0 { info.mtu.min(9000) } else { cfg.mtu } as usize;
            let max_dgram = mtu.saturating_sub(28);
            if max_dgram < wire::MAX_HEADER_LEN + wire::MIN_PAYLOAD {
                return Err(TransportError::Config(format!("PRISM_MTU={mtu}: too small for Prism's headers")));
            }
            min_dgram = min_dgram.min(max_dgram);
            let udp = UdpRail::bind(addr, cfg.paths, cfg.sockbuf).map_err(io_err(format!("binding UDP sockets on {}", info.ifname)))?;
            tracing::info!(
                rail = %info.name, addr = %addr, port = udp.rail_port(), paths = udp.paths(), max_datagram = max_dgram,
                "rail ready: {} source ports, one per entropy", udp.paths()
            );
            rails.push(Arc::new(Rail::new(info, Some(udp), None, addr, max_dgram)));
        }
        if rails.len() > MAX_RAILS {
            return Err(TransportError::Config(format!("PRISM_IFNAMES: {} rails, at most {MAX_RAILS}", rails.len())));
        }
        let (lb_rt, host_id) = lb_runtime(&cfg, &lb, &rails)?;
        // Every rail uses the smallest payload so that a retransmission fits on any of them. A comm's
        // entropies cover every rail (rail-major), so its proto knows rails × paths of them. The
        // payload is whole lines (`wire::LINE_BYTES`): at MTU 9000 a datagram holds 8,908 payload
        // bytes, of which 8,832 are used, so that packets sprayed out of order never tear an LL line.
        let payload = min_dgram - wire::MAX_HEADER_LEN;
        let proto = ProtoConfig {
            n_paths: cfg.paths * rails.len() as u16,
            max_payload: payload - payload % wire::LINE_BYTES,
            window_pkts: cfg.window_pkts,
            // A batch is reordered by up to its length when it is spread over the sockets; a small
            // window (slow links) cannot have that many packets overtake a lost one, so stay below it.
            reorder_threshold: ProtoConfig::default().reorder_threshold.max(BATCH as u32 + 32).min((cfg.window_pkts / 2).max(3)),
            rto_min_us: cfg.rto_min_us,
            peer_timeout_us: cfg.peer_timeout_ms * 1000,
            stall_timeout_us: cfg.stall_timeout_ms * 1000,
            ..ProtoConfig::default()
        };
        tracing::info!("load balancing: {} (host id {host_id})", lb.describe());
        let inner = Arc::new(NetInner {
            cfg,
            lb,
            lb_rt,
            host_id,
            proto,
            start: Instant::now(),
            rails,
            closed: Mutex::new(Default::default()),
            seeds: AtomicU64::new(0),
            progress: Progress::default(),
            board: super::board::PathBoard::default(),
            handshakes: HandshakeStats::default(),
        });
        let devices = inner.rails.iter().map(|r| r.info.clone()).collect();
        Ok(Net { inner, devices, pending: Mutex::new(HashMap::new()), next_stage: AtomicU64::new(1) })
    }

    /// The rails, in NCCL device order.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// The backend moving the packets: "verbs" or "udp".
    pub fn backend(&self) -> &'static str {
        if self.inner.is_verbs() {
            "verbs"
        } else {
            "udp"
        }
    }

    /// Register `addr..addr + len` on every verbs rail (NCCL's `regMr`); nothing on UDP. Repeated
    /// registrations of the same range share one MR; each must be paired with [`Self::dereg_mr`].
    /// The caller vouches that the memory stays mapped until then.
    pub fn reg_mr(&self, addr: usize, len: usize) -> Result<(), TransportError> {
        let mut done: Vec<&Arc<Rail>> = Vec::new();
        for r in &self.inner.rails {
            if let Some(d) = &r.verbs {
                if let Err(e) = d.acquire(addr, len) {
                    for r in done {
                        if let Some(d) = &r.verbs {
                            d.release((addr, len.max(1)));
                        }
                    }
                    return Err(TransportError::InvalidArgument(format!("regMr of {len} bytes at {addr:#x} on {}: {e}", d.name)));
                }
                done.push(r);
            }
        }
        Ok(())
    }

    /// Undo one [`Self::reg_mr`] of the same range.
    pub fn dereg_mr(&self, addr: usize, len: usize) {
        for r in &self.inner.rails {
            if let Some(d) = &r.verbs {
                d.release((addr, len.max(1)));
            }
        }
    }

    fn rail(&self, dev: usize) -> Result<&Arc<Rail>, TransportError> {
        self.inner.rails.get(dev).ok_or(TransportError::BadDevice { dev, ndev: self.inner.rails.len() })
    }

    /// Start listening on `dev`; fills `handle` for the peer's `connect`.
    pub fn listen(&self, dev: usize, handle: &mut [u8; HANDLE_LEN]) -> Result<Listener, TransportError> {
        let rail = self.rail(dev)?.clone();
        let sock = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).map_err(io_err("TCP socket"))?;
        sock.set_nonblocking(true).map_err(io_err("TCP non-blocking"))?;
        sock.bind(&SockAddr::from(SocketAddrV4::new(rail.addr, 0))).map_err(io_err("TCP bind"))?;
        sock.listen(128).map_err(io_err("TCP listen"))?;
        let port = sock.local_addr().ok().and_then(|a| a.as_socket_ipv4()).map(|a| a.port()).unwrap_or(0);
        let nonce = new_token();
        handle.fill(0);
        handle[0..4].copy_from_slice(MAGIC);
        handle[4] = VERSION;
        handle[6..8].copy_from_slice(&port.to_be_bytes());
        handle[8..12].copy_from_slice(&rail.addr.octets());
        handle[12..20].copy_from_slice(&nonce.to_be_bytes());
        tracing::debug!(rail = %rail.info.name, port, "listening");
        Ok(Listener::new(self.inner.clone(), rail, dev as u16, sock, nonce))
    }

    /// Connect to the listener described by `handle`; `Ok(None)` until the handshake is done.
    pub fn connect(&self, dev: usize, handle: &mut [u8; HANDLE_LEN]) -> Result<Option<SendComm>, TransportError> {
        let key = u64::from_be_bytes(handle[STAGE_OFF..STAGE_OFF + 8].try_into().expect("8 bytes"));
        let mut pending = self.pending.lock();
        // A connect whose caller stopped calling (NCCL gave up on it) would keep its socket and QPs
        // until the engine goes: one past twice the connect timeout is nobody's any more.
        let abandoned = std::time::Duration::from_millis(self.inner.cfg.connect_timeout_ms.saturating_mul(2));
        pending.retain(|&k, pc| k == key || pc.started.elapsed() <= abandoned);
        if key == 0 || !pending.contains_key(&key) {
            let target = parse_handle(handle)?;
            let rail = self.rail(dev)?;
            let token = new_token();
            let nonce = u64::from_be_bytes(handle[12..20].try_into().expect("8 bytes"));
            let verbs = self.inner.verbs_comm(token, true)?;
            let out = self.inner.hello(HelloKind::Hello, 0, nonce, token, 0, verbs.as_ref())?;
            let sock = start_tcp_connect(target, rail.addr)?;
            let key = self.next_stage.fetch_add(1, Ordering::Relaxed);
            handle[STAGE_OFF..STAGE_OFF + 8].copy_from_slice(&key.to_be_bytes());
            pending.insert(
                key,
                PendingConnect {
                    sock,
                    dev,
                    token,
                    nonce,
                    last_failure: None,
                    self_connects: 0,
                    out,
                    inp: vec![0; HELLO_LEN],
                    stage: Stage::Connecting,
                    started: Instant::now(),
                    target,
                    verbs,
                },
            );
            tracing::debug!(%target, "connect started");
        }
        let key = u64::from_be_bytes(handle[STAGE_OFF..STAGE_OFF + 8].try_into().expect("8 bytes"));
        let pc = pending.get_mut(&key).expect("inserted above");
        match self.advance(pc) {
            Ok(None) => {
                let ms = pc.started.elapsed().as_millis() as u64;
                if ms > self.inner.cfg.connect_timeout_ms {
                    let peer = match (pc.last_failure, pc.self_connects) {
                        (Some(why), 0) => format!("{} (last attempt: {why})", pc.target),
                        (Some(why), n) => format!("{} (last attempt: {why}; {n} attempt(s) connected to themselves)", pc.target),
                        (None, _) => pc.target.to_string(),
                    };
                    pending.remove(&key);
                    handle[STAGE_OFF..STAGE_OFF + 8].fill(0);
                    return Err(TransportError::HandshakeTimeout { peer, ms });
                }
                Ok(None)
            }
            Ok(Some(comm)) => {
                pending.remove(&key);
                handle[STAGE_OFF..STAGE_OFF + 8].fill(0);
                Ok(Some(comm))
            }
            Err(e) => {
                pending.remove(&key);
                handle[STAGE_OFF..STAGE_OFF + 8].fill(0);
                Err(e)
            }
        }
    }

    fn advance(&self, pc: &mut PendingConnect) -> Result<Option<SendComm>, TransportError> {
        loop {
            match pc.stage {
                Stage::Connecting => {
                    if let Some(e) = pc.sock.take_error().map_err(io_err("TCP connect"))? {
                        if e.kind() == io::ErrorKind::ConnectionRefused {
                            // The listener may not be up yet on a slow peer: retry until the timeout.
                            return self.retry(pc, "connection refused (no listener on that port: not up yet, or gone)");
                        }
                        return Err(TransportError::Io { what: format!("TCP connect to {}", pc.target), source: e });
                    }
                    match pc.sock.peer_addr() {
                        Ok(peer) if is_self_connected(&pc.sock, &peer) => {
                            // The kernel connected the retried socket to itself: nobody listens there.
                            tracing::debug!(target = %pc.target, "TCP connect reached itself; retrying");
                            pc.self_connects += 1;
                            return self.retry(pc, "the socket connected to itself (no listener on that port any more)");
                        }
                        Ok(_) => pc.stage = Stage::Writing(0),
                        Err(_) => return Ok(None),
                    }
                }
                Stage::Writing(n) => match (&pc.sock).write(&pc.out[n..]) {
                    Ok(k) if n + k == pc.out.len() => pc.stage = Stage::Reading(0),
                    Ok(k) => pc.stage = Stage::Writing(n + k),
                    Err(e) if would_block(&e) => return Ok(None),
                    Err(e) => return Err(TransportError::Io { what: format!("handshake with {}", pc.target), source: e }),
                },
                Stage::Reading(n) => match (&pc.sock).read(&mut pc.inp[n..]) {
                    Ok(0) => {
                        return Err(TransportError::ConnectionFailed(format!(
                            "{} closed the handshake (wrong or stale handle?)",
                            pc.target
                        )))
                    }
                    Ok(k) => {
                        let got = n + k;
                        if got == HELLO_LEN && pc.inp.len() == HELLO_LEN {
                            // The fixed part is in: make room for the block it announces, but only
                            // in a reply that proves it comes from our listener (anything else is
                            // judged on its 144 bytes by `finish_connect`).
                            let h = parse_hello(&pc.inp)?;
                            if h.kind == HelloKind::Reply && h.status == 0 && h.nonce == pc.nonce && h.echo == pc.token {
                                pc.inp.resize(HELLO_LEN + h.block_len as usize, 0);
                            }
                        }
                        if got == pc.inp.len() {
                            return self.finish_connect(pc);
                        }
                        pc.stage = Stage::Reading(got);
                    }
                    Err(e) if would_block(&e) => return Ok(None),
                    Err(e) => return Err(TransportError::Io { what: format!("handshake with {}", pc.target), source: e }),
                },
            }
        }
    }

    /// Start the TCP connect again, remembering why the last attempt failed.
    fn retry(&self, pc: &mut PendingConnect, why: &'static str) -> Result<Option<SendComm>, TransportError> {
        pc.last_failure = Some(why);
        pc.sock = start_tcp_connect(pc.target, self.inner.rails[pc.dev].addr)?;
        pc.stage = Stage::Connecting;
        pc.inp = vec![0; HELLO_LEN];
        Ok(None)
    }

    fn finish_connect(&self, pc: &mut PendingConnect) -> Result<Option<SendComm>, TransportError> {
        let h = parse_hello(&pc.inp)?;
        if h.kind == HelloKind::Hello && h.token == pc.token {
            // Our own HELLO came back: the socket talks to itself.
            pc.self_connects += 1;
            return self.retry(pc, "the handshake read back its own HELLO (the socket connected to itself)");
        }
        if h.kind != HelloKind::Reply {
            return Err(TransportError::ConnectionFailed(format!("{} answered the handshake with a HELLO, not a reply", pc.target)));
        }
        if h.status != 0 {
            return Err(TransportError::ConnectionFailed(format!("{} refused the handshake (status {})", pc.target, h.status)));
        }
        if h.nonce != pc.nonce || h.echo != pc.token {
            return Err(TransportError::ConnectionFailed(format!(
                "{} answered for another listener or another connect (nonce {:#x}, echo {:#x}; expected {:#x}, {:#x})",
                pc.target, h.nonce, h.echo, pc.nonce, pc.token
            )));
        }
        self.inner.join(&h, &pc.inp[HELLO_LEN..], &mut pc.verbs)?;
        let home = pc.dev as u16;
        let plans = Plans::default();
        let rate: SharedRate = Arc::new(Mutex::new(self.inner.lb_rt.rate_controller()));
        let conn = self.inner.connection(pc.token, h.token, h.host, home, &plans, &rate);
        tracing::info!(rail = %self.inner.rails[pc.dev].info.name, peer = %h.rails()[0], rails = h.rails().len(), "send comm connected");
        let core =
            CommCore::new(self.inner.clone(), conn, pc.token, h.rails().to_vec(), h.host, home, plans, rate, "send", pc.verbs.take());
        Ok(Some(SendComm::new(self.inner.adopt(core))))
    }

    /// Per-rail counters and the statistics of the comms closed so far (bounded: every closed comm is
    /// summed per rail, peer and role; the first and last few are listed in full), as JSON.
    pub fn stats_json(&self) -> serde_json::Value {
        let rails: Vec<_> = self
            .inner
            .rails
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.info.name, "ifname": r.info.ifname, "addr": r.info.addr.to_string(),
                    "source_ports": r.udp.as_ref().map(|u| u.ports().to_vec()),
                    "verbs_device": r.verbs.as_ref().map(|d| serde_json::json!({
                        "name": d.name, "gid_index": d.gid_index, "mtu": d.mtu_bytes, "registrations": d.registrations(),
                    })),
                    "unknown_token_dropped": r.unknown_token.load(Ordering::Relaxed),
                    "runt_dropped": r.runt.load(Ordering::Relaxed),
                    "wrong_port_dropped": r.wrong_port.load(Ordering::Relaxed),
                    "wrong_port_kernel_dropped": r.udp.as_ref().and_then(UdpRail::send_only_drops),
                })
            })
            .collect();
        let mut out = serde_json::json!({
            "backend": if self.inner.is_verbs() { "verbs" } else { "udp" },
            "config": { "transport": self.inner.cfg.describe(), "lb": self.inner.lb.describe() },
            "rails": rails,
            "handshakes": self.inner.handshakes.json(),
        });
        if let serde_json::Value::Object(m) = &mut out {
            m.extend(self.inner.closed.lock().to_json());
        }
        out
    }
}

/// The lb runtime of this process, and this host's id in its topology.
fn lb_runtime(cfg: &TransportConfig, lb: &prism_lb::LbConfig, rails: &[Arc<Rail>]) -> Result<(LbRuntime, u32), TransportError> {
    let n = rails.len() as u16;
    let topo = match &lb.topo_path {
        None => Topology::single_leaf(n),
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| TransportError::Config(format!("PRISM_TOPO={path}: cannot read it: {e}")))?;
            let t = Topology::from_json(&text).map_err(|e| TransportError::Config(format!("PRISM_TOPO={path}: {e}")))?;
            if t.rails() != n {
                return Err(TransportError::Config(format!(
                    "PRISM_TOPO={path}: the topology has {} rails but this host has {n} (PRISM_IFNAMES)",
                    t.rails()
                )));
            }
            t
        }
    };
    let host_id = if topo.lists_hosts() {
        let name = match &cfg.host {
            Some(h) => h.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default(),
        };
        topo.host_by_name(&name).ok_or_else(|| {
            TransportError::Config(format!("PRISM_TOPO: host '{name}' is not in the topology (set PRISM_HOST to its name there)"))
        })? as u32
    } else {
        // Any stable id per host will do: the address of its first rail.
        match rails[0].info.addr {
            std::net::IpAddr::V4(a) => u32::from(a),
            std::net::IpAddr::V6(_) => 0,
        }
    };
    let seed = if cfg.seed == 0 { rand::random() } else { cfg.seed };
    let rt = lb.runtime(topo, host_id as usize, seed).map_err(|e| TransportError::Config(format!("load balancing: {e}")))?;
    Ok((rt, host_id))
}

fn parse_handle(h: &[u8; HANDLE_LEN]) -> Result<SocketAddrV4, TransportError> {
    if &h[0..4] != MAGIC {
        return Err(TransportError::BadHandle("no Prism magic (was it made by another plugin?)".into()));
    }
    if h[4] != VERSION {
        return Err(TransportError::BadHandle(format!("version {} (this Prism speaks {VERSION})", h[4])));
    }
    let port = u16::from_be_bytes([h[6], h[7]]);
    if port == 0 {
        return Err(TransportError::BadHandle("TCP port 0".into()));
    }
    Ok(SocketAddrV4::new(Ipv4Addr::new(h[8], h[9], h[10], h[11]), port))
}

/// A TCP socket whose peer is its own address: the kernel connected a retried connect to itself
/// (simultaneous open on a port nobody listens on any more).
fn is_self_connected(sock: &Socket, peer: &SockAddr) -> bool {
    sock.local_addr().ok().and_then(|a| a.as_socket()) == peer.as_socket()
}

fn start_tcp_connect(target: SocketAddrV4, local: Ipv4Addr) -> Result<Socket, TransportError> {
    let sock = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).map_err(io_err("TCP socket"))?;
    sock.set_nonblocking(true).map_err(io_err("TCP non-blocking"))?;
    sock.set_nodelay(true).map_err(io_err("TCP_NODELAY"))?;
    // Leave from the rail's address so the listener sees the rail, not whatever the route picks.
    sock.bind(&SockAddr::from(SocketAddrV4::new(local, 0))).map_err(io_err("TCP bind"))?;
    match sock.connect(&SockAddr::from(target)) {
        Ok(()) => Ok(sock),
        Err(e) if would_block(&e) => Ok(sock),
        Err(e) => Err(TransportError::Io { what: format!("TCP connect to {target}"), source: e }),
    }
}

/// Most handshakes a listener keeps pending; when full, the oldest is dropped for a newcomer.
pub const MAX_PENDING_HANDSHAKES: usize = 256;
/// Longest a handshake may stay pending (capped further by `PRISM_CONNECT_TIMEOUT_MS`): a silent
/// peer holds an fd no longer than this.
pub const MAX_HANDSHAKE_AGE_MS: u64 = 5_000;
/// Verbs-block bytes all pending handshakes of one listener may hold together (a block is read only
/// after its HELLO's nonce was verified; one that does not fit waits, then times out).
const EXT_BUDGET: usize = 4 * MAX_EXT;
/// New connections taken per `accept` call (the pending ones are served between batches).
const ACCEPT_BATCH: usize = 64;
/// At most one "accept is out of fds" warning per this interval.
const ACCEPT_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Handshake counters of all listeners (shown in the stats JSON as `handshakes`).
#[derive(Default)]
pub(crate) struct HandshakeStats {
    accepted: AtomicU64,
    pending: AtomicU64,
    dropped_full: AtomicU64,
    dropped_timeout: AtomicU64,
    rejected: AtomicU64,
    peer_closed: AtomicU64,
    accept_out_of_fds: AtomicU64,
}

impl HandshakeStats {
    fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "accepted": g(&self.accepted), "pending": g(&self.pending), "dropped_full": g(&self.dropped_full),
            "dropped_timeout": g(&self.dropped_timeout), "rejected": g(&self.rejected), "peer_closed": g(&self.peer_closed),
            "accept_out_of_fds": g(&self.accept_out_of_fds),
        })
    }
}

struct PendingAccept {
    sock: Socket,
    from: SocketAddr,
    since: Instant,
    /// The fixed part of the HELLO: nothing more is read before its nonce is verified.
    inp: [u8; HELLO_LEN],
    got: usize,
    /// The verified HELLO, once its 144 bytes are in.
    hello: Option<HelloRepr>,
    /// Its verbs block (allocated once verified and within the listener's budget).
    ext: Vec<u8>,
    /// Bytes of `EXT_BUDGET` this handshake holds.
    reserved: usize,
    reply: Option<(Vec<u8>, usize, RecvComm)>,
}

/// Why a pending handshake was dropped.
enum Refused {
    Rejected(TransportError),
    Closed(TransportError),
}

/// A listening endpoint (NCCL's listenComm). Several connects may be accepted from one listener.
///
/// Pending handshakes are bounded in number (`MAX_PENDING_HANDSHAKES`, the oldest dropped first) and
/// in age (`MAX_HANDSHAKE_AGE_MS`, at most `PRISM_CONNECT_TIMEOUT_MS`); running out of fds in `accept`
/// (EMFILE, ENFILE, ENOBUFS, ENOMEM) is logged and waited out, not returned: pending ones keep
/// timing out, and new ones are taken when fds are back. A connector whose handshake was dropped
/// sees the connection close and retries within its own timeout.
pub struct Listener {
    inner: Arc<NetInner>,
    rail: Arc<Rail>,
    dev: u16,
    sock: Socket,
    nonce: u64,
    pending: std::collections::VecDeque<PendingAccept>,
    ext_held: usize,
    out_of_fds_since_warn: u64,
    last_warn: Option<Instant>,
    /// When a refused HELLO was last logged at WARN (a flood of them is logged at DEBUG).
    last_reject_warn: Option<Instant>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.inner.handshakes.pending.fetch_sub(self.pending.len() as u64, Ordering::Relaxed);
    }
}

fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

impl Listener {
    fn new(inner: Arc<NetInner>, rail: Arc<Rail>, dev: u16, sock: Socket, nonce: u64) -> Listener {
        let pending = std::collections::VecDeque::new();
        Listener { inner, rail, dev, sock, nonce, pending, ext_held: 0, out_of_fds_since_warn: 0, last_warn: None, last_reject_warn: None }
    }

    fn max_age(&self) -> std::time::Duration {
        std::time::Duration::from_millis(MAX_HANDSHAKE_AGE_MS.min(self.inner.cfg.connect_timeout_ms))
    }

    fn remove(&mut self, i: usize) -> PendingAccept {
        let p = self.pending.remove(i).expect("index in range");
        self.ext_held -= p.reserved;
        self.inner.handshakes.pending.fetch_sub(1, Ordering::Relaxed);
        p
    }

    /// Accept one connection if a peer has finished its half of the handshake; never blocks.
    pub fn accept(&mut self) -> Result<Option<RecvComm>, TransportError> {
        let inner = self.inner.clone();
        let hs = &inner.handshakes;
        for _ in 0..ACCEPT_BATCH {
            match self.sock.accept() {
                Ok((s, from)) => {
                    let from = from.as_socket().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
                    if let Err(e) = s.set_nonblocking(true) {
                        tracing::warn!(%from, "handshake dropped: TCP non-blocking: {e}");
                        continue;
                    }
                    if self.pending.len() >= MAX_PENDING_HANDSHAKES {
                        let old = self.remove(0);
                        hs.dropped_full.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(from = %old.from, "handshake dropped: {MAX_PENDING_HANDSHAKES} pending, this one the oldest");
                    }
                    hs.pending.fetch_add(1, Ordering::Relaxed);
                    self.pending.push_back(PendingAccept {
                        sock: s,
                        from,
                        since: Instant::now(),
                        inp: [0; HELLO_LEN],
                        got: 0,
                        hello: None,
                        ext: Vec::new(),
                        reserved: 0,
                        reply: None,
                    });
                }
                Err(e) if would_block(&e) || e.raw_os_error() == Some(libc::ECONNABORTED) => break,
                Err(e) if out_of_fds(&e) => {
                    hs.accept_out_of_fds.fetch_add(1, Ordering::Relaxed);
                    self.out_of_fds_since_warn += 1;
                    if !matches!(self.last_warn, Some(t) if t.elapsed() < ACCEPT_WARN_EVERY) {
                        tracing::warn!(
                            rail = %self.rail.info.name,
                            pending = self.pending.len(),
                            "TCP accept: {e} ({} times since the last warning); pending handshakes still time out, new ones wait",
                            self.out_of_fds_since_warn
                        );
                        self.last_warn = Some(Instant::now());
                        self.out_of_fds_since_warn = 0;
                    }
                    break;
                }
                Err(e) => return Err(TransportError::Io { what: "TCP accept".into(), source: e }),
            }
        }
        let max_age = self.max_age();
        let mut i = 0;
        while i < self.pending.len() {
            match self.step(i) {
                Ok(Some(comm)) => {
                    self.remove(i);
                    self.inner.handshakes.accepted.fetch_add(1, Ordering::Relaxed);
                    return Ok(Some(comm));
                }
                Ok(None) if self.pending[i].since.elapsed() > max_age => {
                    let p = self.remove(i);
                    self.inner.handshakes.dropped_timeout.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(from = %p.from, "handshake dropped: not completed within {max_age:?}");
                }
                Ok(None) => i += 1,
                Err(why) => {
                    // One bad peer must not break the listener for the others.
                    let p = self.remove(i);
                    match why {
                        Refused::Rejected(e) => {
                            self.inner.handshakes.rejected.fetch_add(1, Ordering::Relaxed);
                            // A misconfigured peer (other backend, stale handle) is worth a warning; a
                            // flood of bad HELLOs is not worth one each.
                            if !matches!(self.last_reject_warn, Some(t) if t.elapsed() < ACCEPT_WARN_EVERY) {
                                tracing::warn!(from = %p.from, "handshake refused: {e} (further ones within 10 s at DEBUG)");
                                self.last_reject_warn = Some(Instant::now());
                            } else {
                                tracing::debug!(from = %p.from, "handshake refused: {e}");
                            }
                        }
                        Refused::Closed(e) => {
                            self.inner.handshakes.peer_closed.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(from = %p.from, "handshake dropped: {e}");
                        }
                    }
                }
            }
        }
        Ok(None)
    }

    fn step(&mut self, i: usize) -> Result<Option<RecvComm>, Refused> {
        let closed = |e| Refused::Closed(e);
        let p = &mut self.pending[i];
        if p.reply.is_none() {
            if p.hello.is_none() {
                match (&p.sock).read(&mut p.inp[p.got..]) {
                    Ok(0) => return Err(closed(TransportError::ConnectionFailed("peer closed during handshake".into()))),
                    Ok(k) => p.got += k,
                    Err(e) if would_block(&e) => return Ok(None),
                    Err(e) => return Err(closed(TransportError::Io { what: "handshake read".into(), source: e })),
                }
                if p.got < HELLO_LEN {
                    return Ok(None);
                }
                let ours = self.inner.hello_backend();
                match parse_hello(&p.inp) {
                    // The block is verbs-only; a HELLO for the other backend is refused before it.
                    Ok(h)
                        if h.kind == HelloKind::Hello
                            && h.nonce == self.nonce
                            && h.backend == ours
                            && (ours == HelloBackend::Verbs || h.block_len == 0) =>
                    {
                        p.hello = Some(h)
                    }
                    Ok(h) if h.kind == HelloKind::Hello && h.nonce == self.nonce && h.backend != ours => {
                        let mut none = None;
                        let e = self.inner.join(&h, &[], &mut none).err().unwrap_or(TransportError::ConnectionFailed("backend".into()));
                        refuse(&self.inner, &p.sock);
                        return Err(Refused::Rejected(e));
                    }
                    Ok(_) | Err(_) => {
                        refuse(&self.inner, &p.sock);
                        return Err(Refused::Rejected(TransportError::BadHandle(format!(
                            "HELLO from {} does not match this listener",
                            p.from
                        ))));
                    }
                }
            }
            let ext_len = p.hello.as_ref().map_or(0, |h| h.block_len as usize);
            if p.ext.len() < ext_len {
                if p.reserved == 0 {
                    if self.ext_held + ext_len > EXT_BUDGET {
                        return Ok(None); // waits for the others' blocks (or times out)
                    }
                    self.ext_held += ext_len;
                    p.reserved = ext_len;
                    p.ext.reserve_exact(ext_len);
                }
                let mut chunk = [0u8; 16 << 10];
                while p.ext.len() < ext_len {
                    let want = (ext_len - p.ext.len()).min(chunk.len());
                    match (&p.sock).read(&mut chunk[..want]) {
                        Ok(0) => return Err(closed(TransportError::ConnectionFailed("peer closed during handshake".into()))),
                        Ok(k) => p.ext.extend_from_slice(&chunk[..k]),
                        Err(e) if would_block(&e) => return Ok(None),
                        Err(e) => return Err(closed(TransportError::Io { what: "handshake read".into(), source: e })),
                    }
                }
            }
            let h = p.hello.take().expect("verified above");
            let token = new_token();
            let mut verbs = self.inner.verbs_comm(token, false).map_err(Refused::Rejected)?;
            self.inner.join(&h, &p.ext, &mut verbs).map_err(Refused::Rejected)?;
            p.ext = Vec::new();
            let reply = self.inner.hello(HelloKind::Reply, 0, self.nonce, token, h.token, verbs.as_ref()).map_err(Refused::Rejected)?;
            // Registered before the reply leaves, so the sender's first datagram finds its comm.
            let plans = Plans::default();
            let rate: SharedRate = Arc::new(Mutex::new(self.inner.lb_rt.rate_controller()));
            let conn = self.inner.connection(token, h.token, h.host, self.dev, &plans, &rate);
            let core = CommCore::new(self.inner.clone(), conn, token, h.rails().to_vec(), h.host, self.dev, plans, rate, "recv", verbs);
            let comm = RecvComm::new(self.inner.adopt(core));
            p.reply = Some((reply, 0, comm));
        }
        let Some((reply, sent, _)) = p.reply.as_mut() else { return Ok(None) };
        while *sent < reply.len() {
            match (&p.sock).write(&reply[*sent..]) {
                Ok(k) => *sent += k,
                Err(e) if would_block(&e) => return Ok(None),
                Err(e) => return Err(closed(TransportError::Io { what: "handshake write".into(), source: e })),
            }
        }
        let (_, _, comm) = p.reply.take().expect("checked above");
        tracing::info!(rail = %self.rail.info.name, from = %p.from, "recv comm accepted");
        Ok(Some(comm))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket bound to 127.0.0.1:P that connects to 127.0.0.1:P (nobody listening there) is
    /// connected by the kernel to itself: what a retried connect to a closed listener's port can get.
    #[test]
    fn a_socket_connected_to_itself_is_recognised() {
        let sock = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        sock.bind(&SockAddr::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))).unwrap();
        let me = sock.local_addr().unwrap();
        sock.connect(&me).expect("simultaneous open with itself");
        let peer = sock.peer_addr().unwrap();
        assert_eq!(peer.as_socket(), me.as_socket());
        assert!(is_self_connected(&sock, &peer));

        let lis = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let other = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        other.connect(&SockAddr::from(lis.local_addr().unwrap())).unwrap();
        assert!(!is_self_connected(&other, &other.peer_addr().unwrap()));
    }
}
