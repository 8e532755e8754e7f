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

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rand::{RngCore, SeedableRng};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::comm::{CommCore, RecvComm, SendComm, SharedCore};
use super::progress::Progress;
use super::rail::Rail;
use super::{device, DeviceInfo, TransportConfig, TransportError, HANDLE_LEN};
use crate::backend::udp::UdpRail;
use crate::proto::{Connection, ProtoConfig};
use crate::wire;

const MAGIC: &[u8; 4] = b"PRSM";
const VERSION: u8 = 1;
const HELLO_LEN: usize = 32;
const STAGE_OFF: usize = 64;

/// State every comm shares: configuration, clock, rails, statistics of closed comms.
pub(crate) struct NetInner {
    pub cfg: TransportConfig,
    pub lb: prism_lb::LbConfig,
    pub proto: ProtoConfig,
    start: Instant,
    pub rails: Vec<Arc<Rail>>,
    closed: Mutex<Vec<serde_json::Value>>,
    seeds: AtomicU64,
    pub progress: Progress,
}

impl NetInner {
    /// Microseconds since the engine started (proto's clock).
    pub fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Keep the final statistics of a closed comm for `stats_json`.
    pub fn record_stats(&self, v: serde_json::Value) {
        self.closed.lock().push(v);
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

    fn connection(&self, local: u64, peer: u64) -> Connection {
        let seed = self.conn_seed();
        Connection::new(self.proto.clone(), local, peer, self.lb.path_policy(seed), self.now_us())
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
    out: [u8; HELLO_LEN],
    inp: [u8; HELLO_LEN],
    stage: Stage,
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
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted)
        || e.raw_os_error() == Some(libc::EINPROGRESS)
}

impl Net {
    /// Discover the rails, bind their sockets and get ready to listen and connect.
    pub fn new(cfg: TransportConfig, lb: prism_lb::LbConfig) -> Result<Net, TransportError> {
        let devices = device::discover(&cfg.ifnames)?;
        let mut rails = Vec::with_capacity(devices.len());
        let mut min_dgram = usize::MAX;
        for info in devices {
            let std::net::IpAddr::V4(addr) = info.addr else {
                return Err(TransportError::NoDevice(format!("{}: only IPv4 is supported", info.ifname)));
            };
            // IP (20) + UDP (8) headers come out of the MTU; loopback's 64 KiB MTU is capped like jumbo frames.
            let mtu = if cfg.mtu == 0 { info.mtu.min(9000) } else { cfg.mtu } as usize;
            let max_dgram = mtu.saturating_sub(28);
            if max_dgram < wire::MAX_HEADER_LEN + 64 {
                return Err(TransportError::Config(format!("PRISM_MTU={mtu}: too small for Prism's headers")));
            }
            min_dgram = min_dgram.min(max_dgram);
            let udp = UdpRail::bind(addr, cfg.paths, cfg.sockbuf).map_err(io_err(format!("binding UDP sockets on {}", info.ifname)))?;
            tracing::info!(
                rail = %info.name, addr = %addr, port = udp.rail_port(), paths = udp.paths(), max_datagram = max_dgram,
                "rail ready: {} source ports, one per entropy", udp.paths()
            );
            rails.push(Arc::new(Rail::new(info, udp, max_dgram)));
        }
        // Every rail uses the smallest payload so that a retransmission fits on any of them.
        let proto = ProtoConfig {
            n_paths: cfg.paths,
            max_payload: min_dgram - wire::MAX_HEADER_LEN,
            window_pkts: cfg.window_pkts,
            rto_min_us: cfg.rto_min_us,
            peer_timeout_us: cfg.peer_timeout_ms * 1000,
            ..ProtoConfig::default()
        };
        let inner = Arc::new(NetInner {
            cfg,
            lb,
            proto,
            start: Instant::now(),
            rails,
            closed: Mutex::new(Vec::new()),
            seeds: AtomicU64::new(0),
            progress: Progress::default(),
        });
        let devices = inner.rails.iter().map(|r| r.info.clone()).collect();
        Ok(Net { inner, devices, pending: Mutex::new(HashMap::new()), next_stage: AtomicU64::new(1) })
    }

    /// The rails, in NCCL device order.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    fn rail(&self, dev: usize) -> Result<&Arc<Rail>, TransportError> {
        self.inner.rails.get(dev).ok_or(TransportError::BadDevice { dev, ndev: self.inner.rails.len() })
    }

    /// Start listening on `dev`; fills `handle` for the peer's `connect`.
    pub fn listen(&self, dev: usize, handle: &mut [u8; HANDLE_LEN]) -> Result<Listener, TransportError> {
        let rail = self.rail(dev)?.clone();
        let sock = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).map_err(io_err("TCP socket"))?;
        sock.set_nonblocking(true).map_err(io_err("TCP non-blocking"))?;
        sock.bind(&SockAddr::from(SocketAddrV4::new(rail.udp.addr(), 0))).map_err(io_err("TCP bind"))?;
        sock.listen(128).map_err(io_err("TCP listen"))?;
        let port = sock.local_addr().ok().and_then(|a| a.as_socket_ipv4()).map(|a| a.port()).unwrap_or(0);
        let nonce = new_token();
        handle.fill(0);
        handle[0..4].copy_from_slice(MAGIC);
        handle[4] = VERSION;
        handle[6..8].copy_from_slice(&port.to_be_bytes());
        handle[8..12].copy_from_slice(&rail.udp.addr().octets());
        handle[12..20].copy_from_slice(&nonce.to_be_bytes());
        tracing::debug!(rail = %rail.info.name, port, "listening");
        Ok(Listener { inner: self.inner.clone(), rail, sock, nonce, pending: Vec::new() })
    }

    /// Connect to the listener described by `handle`; `Ok(None)` until the handshake is done.
    pub fn connect(&self, dev: usize, handle: &mut [u8; HANDLE_LEN]) -> Result<Option<SendComm>, TransportError> {
        let key = u64::from_be_bytes(handle[STAGE_OFF..STAGE_OFF + 8].try_into().expect("8 bytes"));
        let mut pending = self.pending.lock();
        if key == 0 || !pending.contains_key(&key) {
            let target = parse_handle(handle)?;
            let rail = self.rail(dev)?;
            let token = new_token();
            let mut out = [0u8; HELLO_LEN];
            out[0..4].copy_from_slice(MAGIC);
            out[4] = VERSION;
            out[8..16].copy_from_slice(&handle[12..20]);
            out[16..24].copy_from_slice(&token.to_be_bytes());
            out[24..28].copy_from_slice(&rail.udp.addr().octets());
            out[28..30].copy_from_slice(&rail.udp.rail_port().to_be_bytes());
            let sock = start_tcp_connect(target, rail.udp.addr())?;
            let key = self.next_stage.fetch_add(1, Ordering::Relaxed);
            handle[STAGE_OFF..STAGE_OFF + 8].copy_from_slice(&key.to_be_bytes());
            pending.insert(
                key,
                PendingConnect { sock, dev, token, out, inp: [0; HELLO_LEN], stage: Stage::Connecting, started: Instant::now(), target },
            );
            tracing::debug!(%target, "connect started");
        }
        let key = u64::from_be_bytes(handle[STAGE_OFF..STAGE_OFF + 8].try_into().expect("8 bytes"));
        let pc = pending.get_mut(&key).expect("inserted above");
        match self.advance(pc) {
            Ok(None) => {
                let ms = pc.started.elapsed().as_millis() as u64;
                if ms > self.inner.cfg.connect_timeout_ms {
                    let peer = pc.target.to_string();
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
                            pc.sock = start_tcp_connect(pc.target, self.inner.rails[pc.dev].udp.addr())?;
                            return Ok(None);
                        }
                        return Err(TransportError::Io { what: format!("TCP connect to {}", pc.target), source: e });
                    }
                    match pc.sock.peer_addr() {
                        Ok(_) => pc.stage = Stage::Writing(0),
                        Err(_) => return Ok(None),
                    }
                }
                Stage::Writing(n) => match (&pc.sock).write(&pc.out[n..]) {
                    Ok(k) if n + k == HELLO_LEN => pc.stage = Stage::Reading(0),
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
                    Ok(k) if n + k == HELLO_LEN => return self.finish_connect(pc).map(Some),
                    Ok(k) => pc.stage = Stage::Reading(n + k),
                    Err(e) if would_block(&e) => return Ok(None),
                    Err(e) => return Err(TransportError::Io { what: format!("handshake with {}", pc.target), source: e }),
                },
            }
        }
    }

    fn finish_connect(&self, pc: &PendingConnect) -> Result<SendComm, TransportError> {
        let r = &pc.inp;
        if &r[0..4] != MAGIC || r[4] != VERSION || r[5] != 0 {
            return Err(TransportError::ConnectionFailed(format!("{} refused the handshake (status {})", pc.target, r[5])));
        }
        let peer_token = u64::from_be_bytes(r[16..24].try_into().expect("8 bytes"));
        let ip = Ipv4Addr::new(r[24], r[25], r[26], r[27]);
        let port = u16::from_be_bytes([r[28], r[29]]);
        let peer = SocketAddrV4::new(ip, port);
        let rail = self.inner.rails[pc.dev].clone();
        let conn = self.inner.connection(pc.token, peer_token);
        tracing::info!(rail = %rail.info.name, %peer, "send comm connected");
        Ok(SendComm::new(self.inner.adopt(CommCore::new(self.inner.clone(), rail, conn, pc.token, peer, "send"))))
    }

    /// Statistics of every comm closed so far plus per-rail counters, as JSON.
    pub fn stats_json(&self) -> serde_json::Value {
        let rails: Vec<_> = self
            .inner
            .rails
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.info.name, "ifname": r.info.ifname, "addr": r.info.addr.to_string(),
                    "source_ports": r.udp.ports(),
                    "unknown_token_dropped": r.unknown_token.load(Ordering::Relaxed),
                    "runt_dropped": r.runt.load(Ordering::Relaxed),
                })
            })
            .collect();
        serde_json::json!({
            "config": { "transport": self.inner.cfg.describe(), "lb": self.inner.lb.describe() },
            "rails": rails,
            "comms": *self.inner.closed.lock(),
        })
    }
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

struct PendingAccept {
    sock: Socket,
    from: SocketAddr,
    inp: [u8; HELLO_LEN],
    got: usize,
    reply: Option<([u8; HELLO_LEN], usize, RecvComm)>,
}

/// A listening endpoint (NCCL's listenComm). Several connects may be accepted from one listener.
pub struct Listener {
    inner: Arc<NetInner>,
    rail: Arc<Rail>,
    sock: Socket,
    nonce: u64,
    pending: Vec<PendingAccept>,
}

impl Listener {
    /// Accept one connection if a peer has finished its half of the handshake; never blocks.
    pub fn accept(&mut self) -> Result<Option<RecvComm>, TransportError> {
        loop {
            match self.sock.accept() {
                Ok((s, from)) => {
                    s.set_nonblocking(true).map_err(io_err("TCP non-blocking"))?;
                    let from = from.as_socket().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
                    self.pending.push(PendingAccept { sock: s, from, inp: [0; HELLO_LEN], got: 0, reply: None });
                }
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(TransportError::Io { what: "TCP accept".into(), source: e }),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            match self.step(i) {
                Ok(Some(comm)) => {
                    self.pending.swap_remove(i);
                    return Ok(Some(comm));
                }
                Ok(None) => i += 1,
                Err(e) => {
                    // One bad peer must not break the listener for the others.
                    tracing::warn!(from = %self.pending[i].from, "handshake dropped: {e}");
                    self.pending.swap_remove(i);
                }
            }
        }
        Ok(None)
    }

    fn step(&mut self, i: usize) -> Result<Option<RecvComm>, TransportError> {
        let p = &mut self.pending[i];
        if p.reply.is_none() {
            match (&p.sock).read(&mut p.inp[p.got..]) {
                Ok(0) => return Err(TransportError::ConnectionFailed("peer closed during handshake".into())),
                Ok(k) => p.got += k,
                Err(e) if would_block(&e) => return Ok(None),
                Err(e) => return Err(TransportError::Io { what: "handshake read".into(), source: e }),
            }
            if p.got < HELLO_LEN {
                return Ok(None);
            }
            let h = &p.inp;
            let mut reply = [0u8; HELLO_LEN];
            reply[0..4].copy_from_slice(MAGIC);
            reply[4] = VERSION;
            let nonce = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
            if &h[0..4] != MAGIC || h[4] != VERSION || nonce != self.nonce {
                reply[5] = 1;
                let _ = (&p.sock).write(&reply);
                return Err(TransportError::BadHandle(format!("HELLO from {} does not match this listener", p.from)));
            }
            let peer_token = u64::from_be_bytes(h[16..24].try_into().expect("8 bytes"));
            let peer = SocketAddrV4::new(Ipv4Addr::new(h[24], h[25], h[26], h[27]), u16::from_be_bytes([h[28], h[29]]));
            let token = new_token();
            reply[16..24].copy_from_slice(&token.to_be_bytes());
            reply[24..28].copy_from_slice(&self.rail.udp.addr().octets());
            reply[28..30].copy_from_slice(&self.rail.udp.rail_port().to_be_bytes());
            // Registered before the reply leaves, so the sender's first datagram finds its comm.
            let conn = self.inner.connection(token, peer_token);
            let comm = RecvComm::new(self.inner.adopt(CommCore::new(self.inner.clone(), self.rail.clone(), conn, token, peer, "recv")));
            p.reply = Some((reply, 0, comm));
        }
        let Some((reply, sent, _)) = p.reply.as_mut() else { return Ok(None) };
        while *sent < HELLO_LEN {
            match (&p.sock).write(&reply[*sent..]) {
                Ok(k) => *sent += k,
                Err(e) if would_block(&e) => return Ok(None),
                Err(e) => return Err(TransportError::Io { what: "handshake write".into(), source: e }),
            }
        }
        let (_, _, comm) = p.reply.take().expect("checked above");
        tracing::info!(rail = %self.rail.info.name, from = %p.from, "recv comm accepted");
        Ok(Some(comm))
    }
}
