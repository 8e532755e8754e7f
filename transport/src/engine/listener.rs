//! The listening side of the handshake (NCCL's listenComm): accepts TCP connections, checks each
//! HELLO against the listener's nonce, reads the verbs block within a budget, answers and hands over
//! a receive comm. The messages themselves are `handshake`'s.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use socket2::Socket;

use super::comm::{adopt, CommCore, RecvComm};
use super::handshake::{new_token, parse_hello, refuse, would_block, MAX_EXT};
use super::planned::{Plans, SharedRate};
use super::rail::Rail;
use super::shared::NetInner;
use super::TransportError;
use crate::wire::{HelloBackend, HelloKind, HelloRepr, HELLO_LEN};

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
    pub(super) fn new(inner: Arc<NetInner>, rail: Arc<Rail>, dev: u16, sock: Socket, nonce: u64) -> Listener {
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
            let conn = self.inner.connection(token, &h, self.dev, &plans, &rate);
            let core = CommCore::new(self.inner.clone(), conn, token, h.rails().to_vec(), h.host, self.dev, plans, rate, "recv", verbs);
            let comm = RecvComm::new(adopt(&self.inner, core));
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
