//! The connection handshake: its messages, the handle, and the connecting side (`Connector`); the
//! listening side is `listener`.
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
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rand::{RngCore, SeedableRng};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::comm::{adopt, CommCore, SendComm};
use super::planned::{Plans, SharedRate};
use super::shared::NetInner;
use super::vcomm::VerbsComm;
use super::{TransportError, HANDLE_LEN};
use crate::wire::{
    self, HelloBackend, HelloKind, HelloPacket, HelloRepr, VerbsBlock, VerbsBlockRepr, HELLO_LEN, HELLO_MAX_BLOCK, HELLO_VERSION,
};

/// The handle shares the HELLO's magic and version.
const MAGIC: &[u8; 4] = wire::hello::HELLO_MAGIC;
const VERSION: u8 = HELLO_VERSION;
/// Largest verbs block after a HELLO.
pub(super) const MAX_EXT: usize = HELLO_MAX_BLOCK;
const STAGE_OFF: usize = 64;

impl NetInner {
    /// This engine's backend, as a HELLO names it.
    pub(super) fn hello_backend(&self) -> HelloBackend {
        if self.is_verbs() {
            HelloBackend::Verbs
        } else {
            HelloBackend::Udp
        }
    }

    /// Our half of a handshake message: rails, token, host id, and the verbs block if any; `echo` is
    /// the token of the HELLO a reply answers.
    pub(super) fn hello(
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
            .map_err(|e| TransportError::Config(format!("handshake: {e}")))?
            .with_max_dgram(self.max_datagram() as u32);
        let mut m = repr.to_vec();
        m.extend_from_slice(&block);
        Ok(m)
    }

    /// Check the peer's backend and connect our QPs to its (verbs).
    pub(super) fn join(&self, h: &HelloRepr, block: &[u8], verbs: &mut Option<VerbsComm>) -> Result<(), TransportError> {
        let ours = self.hello_backend();
        if h.backend != ours {
            return Err(TransportError::ConnectionFailed(format!(
                "the peer uses the {} backend, this end {} (set the same PRISM_TRANSPORT on both)",
                h.backend.name(),
                ours.name()
            )));
        }
        let least = wire::MAX_HEADER_LEN + wire::MIN_PAYLOAD;
        if (h.max_dgram as usize) < least {
            return Err(TransportError::ConnectionFailed(format!(
                "the peer takes datagrams of at most {} bytes, fewer than the {least} of a DATA packet of one 128-byte line",
                h.max_dgram
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
pub(super) fn parse_hello(m: &[u8]) -> Result<HelloRepr, TransportError> {
    let p = HelloPacket::new_checked(m).map_err(|e| match e {
        wire::WireError::BadField { field: "hello version", value } => {
            TransportError::ConnectionFailed(format!("peer speaks handshake version {value} (this Prism: {HELLO_VERSION})"))
        }
        e => TransportError::ConnectionFailed(format!("bad handshake: {e}")),
    })?;
    HelloRepr::parse(&p).map_err(|e| TransportError::ConnectionFailed(format!("bad handshake: {e}")))
}

/// Tell a refused connector so (best effort: it fails on its own timeout otherwise).
pub(super) fn refuse(inner: &NetInner, sock: &Socket) {
    if let Ok(m) = inner.hello(HelloKind::Reply, 1, 0, 0, 0, None) {
        let _ = (&*sock).write(&m);
    }
}

/// A fresh random connection token (never 0, which marks "none").
pub(super) fn new_token() -> u64 {
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
    /// The last call that drove this connect.
    last_call: Instant,
    target: SocketAddrV4,
}

/// A connect called within this long counts as being driven by a caller (see `Connector::connect`).
const DRIVEN_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

pub(super) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> TransportError {
    let what = what.into();
    move |source| TransportError::Io { what, source }
}

pub(super) fn would_block(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) || e.raw_os_error() == Some(libc::EINPROGRESS)
}

/// Write a listener's handle: its TCP address and its nonce.
pub(super) fn write_handle(handle: &mut [u8; HANDLE_LEN], addr: Ipv4Addr, port: u16, nonce: u64) {
    handle.fill(0);
    handle[0..4].copy_from_slice(MAGIC);
    handle[4] = VERSION;
    handle[6..8].copy_from_slice(&port.to_be_bytes());
    handle[8..12].copy_from_slice(&addr.octets());
    handle[12..20].copy_from_slice(&nonce.to_be_bytes());
}

/// The connects in progress, found again through the key each one writes into its handle.
#[derive(Default)]
pub(super) struct Connector {
    pending: Mutex<HashMap<u64, PendingConnect>>,
    next_stage: AtomicU64,
}

impl Connector {
    /// Connect to the listener described by `handle`; `Ok(None)` until the handshake is done.
    pub(super) fn connect(
        &self,
        inner: &Arc<NetInner>,
        dev: usize,
        handle: &mut [u8; HANDLE_LEN],
    ) -> Result<Option<SendComm>, TransportError> {
        // The handle is checked on every call, not only the first: a key alone (junk, or another
        // listener's handle that happens to carry one) must never drive a connect it does not describe.
        let target = parse_handle(handle)?;
        let nonce = u64::from_be_bytes(handle[12..20].try_into().expect("8 bytes"));
        let ours = |pc: &PendingConnect| pc.dev == dev && pc.target == target && pc.nonce == nonce;
        let mut key = u64::from_be_bytes(handle[STAGE_OFF..STAGE_OFF + 8].try_into().expect("8 bytes"));
        let mut pending = self.pending.lock();
        if key != 0 && !pending.get(&key).is_some_and(ours) {
            // A connect to another listener (or device), or none: this handle starts afresh.
            key = 0;
            handle[STAGE_OFF..STAGE_OFF + 8].fill(0);
        }
        // A connect whose caller stopped calling (NCCL gave up on it) would keep its socket and QPs
        // until the engine goes: one past twice the connect timeout is nobody's any more.
        let abandoned = std::time::Duration::from_millis(inner.cfg.connect_timeout_ms.saturating_mul(2));
        pending.retain(|&k, pc| k == key || pc.started.elapsed() <= abandoned);
        if key == 0 {
            // NCCL passes the same handle buffer on every retry. A caller that copies the handle
            // before each retry brings no key: it takes up the oldest connect to the same listener that
            // someone is driving, instead of starting one more (a socket each call, never finished).
            // Two callers that do keep their copies may share a connect this way: the one that gets
            // its comm stops calling, the other starts its own on its next call.
            let driven = pending
                .iter()
                .filter(|(_, pc)| ours(pc) && pc.last_call.elapsed() < DRIVEN_WITHIN)
                .min_by_key(|(_, pc)| pc.started)
                .map(|(&k, _)| k);
            if let Some(k) = driven {
                handle[STAGE_OFF..STAGE_OFF + 8].copy_from_slice(&k.to_be_bytes());
            }
        }
        let key = u64::from_be_bytes(handle[STAGE_OFF..STAGE_OFF + 8].try_into().expect("8 bytes"));
        if key == 0 || !pending.contains_key(&key) {
            let rail = inner.rails.get(dev).ok_or(TransportError::BadDevice { dev, ndev: inner.rails.len() })?;
            let token = new_token();
            let verbs = inner.verbs_comm(token, true)?;
            let out = inner.hello(HelloKind::Hello, 0, nonce, token, 0, verbs.as_ref())?;
            let sock = start_tcp_connect(target, rail.addr)?;
            // Keys start at 1: 0 in a handle means "no connect in progress".
            let key = self.next_stage.fetch_add(1, Ordering::Relaxed) + 1;
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
                    last_call: Instant::now(),
                    target,
                    verbs,
                },
            );
            tracing::debug!(%target, "connect started");
        }
        let key = u64::from_be_bytes(handle[STAGE_OFF..STAGE_OFF + 8].try_into().expect("8 bytes"));
        let pc = pending.get_mut(&key).expect("inserted above");
        pc.last_call = Instant::now();
        match Self::advance(inner, pc) {
            Ok(None) => {
                let ms = pc.started.elapsed().as_millis() as u64;
                if ms > inner.cfg.connect_timeout_ms {
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

    fn advance(inner: &Arc<NetInner>, pc: &mut PendingConnect) -> Result<Option<SendComm>, TransportError> {
        loop {
            match pc.stage {
                Stage::Connecting => {
                    if let Some(e) = pc.sock.take_error().map_err(io_err("TCP connect"))? {
                        if e.kind() == io::ErrorKind::ConnectionRefused {
                            // The listener may not be up yet on a slow peer: retry until the timeout.
                            return Self::retry(inner, pc, "connection refused (no listener on that port: not up yet, or gone)");
                        }
                        return Err(TransportError::Io { what: format!("TCP connect to {}", pc.target), source: e });
                    }
                    match pc.sock.peer_addr() {
                        Ok(peer) if is_self_connected(&pc.sock, &peer) => {
                            // The kernel connected the retried socket to itself: nobody listens there.
                            tracing::debug!(target = %pc.target, "TCP connect reached itself; retrying");
                            pc.self_connects += 1;
                            return Self::retry(inner, pc, "the socket connected to itself (no listener on that port any more)");
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
                            return Self::finish_connect(inner, pc);
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
    fn retry(inner: &NetInner, pc: &mut PendingConnect, why: &'static str) -> Result<Option<SendComm>, TransportError> {
        pc.last_failure = Some(why);
        pc.sock = start_tcp_connect(pc.target, inner.rails[pc.dev].addr)?;
        pc.stage = Stage::Connecting;
        pc.inp = vec![0; HELLO_LEN];
        Ok(None)
    }

    fn finish_connect(inner: &Arc<NetInner>, pc: &mut PendingConnect) -> Result<Option<SendComm>, TransportError> {
        let h = parse_hello(&pc.inp)?;
        if h.kind == HelloKind::Hello && h.token == pc.token {
            // Our own HELLO came back: the socket talks to itself.
            pc.self_connects += 1;
            return Self::retry(inner, pc, "the handshake read back its own HELLO (the socket connected to itself)");
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
        inner.join(&h, &pc.inp[HELLO_LEN..], &mut pc.verbs)?;
        let home = pc.dev as u16;
        let plans = Plans::default();
        let rate: SharedRate = Arc::new(Mutex::new(inner.lb_rt.rate_controller()));
        let conn = inner.connection(pc.token, &h, home, &plans, &rate);
        tracing::info!(rail = %inner.rails[pc.dev].info.name, peer = %h.rails()[0], rails = h.rails().len(), "send comm connected");
        let core = CommCore::new(inner.clone(), conn, pc.token, h.rails().to_vec(), h.host, home, plans, rate, "send", pc.verbs.take());
        Ok(Some(SendComm::new(adopt(inner, core))))
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
