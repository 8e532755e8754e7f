//! A connected comm: one `proto::Connection` plus the buffers of its outstanding requests, driven by
//! whoever calls `isend`/`irecv`/`test` (NCCL's proxy progress thread).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddrV4;
use std::sync::Arc;

use parking_lot::Mutex;

use super::planned::{ChunkMap, Plans, SharedRate};
mod endpoints;

use super::progress::Driven;
use super::rail::{Datagram, Inbox, RX_ROUNDS};
use super::shared::NetInner;
use super::vcomm::VerbsComm;
use super::{RecvBuf, ReqId, SendBuf, TransportError};
use crate::backend::udp::{OutDatagram, BATCH};
use crate::proto::{Completion, Connection, MsgError, MsgId, PayloadSource, Placer, PostError};
pub use endpoints::{RecvComm, SendComm};

/// Batches of transmissions one progress call may send before it returns (keeps test() short).
const MAX_TX_BATCHES: usize = 64;

/// How often a comm that sends DATA publishes its view of the paths to the shared board.
const BOARD_EVERY_US: u64 = 10_000;

/// Message ids of requests posted on a dead connection (failed before proto saw them) have this bit
/// set; proto's own ids count up from 0 and never reach it.
const DEAD_POST: u64 = 1 << 63;

enum Outcome {
    Sent(u64),
    Received(Vec<u64>),
    Failed(MsgError),
}

/// Who the comm talks to, as the handshake settled it.
struct Ident {
    /// Our connection token (the peer's datagrams carry it).
    token: u64,
    /// The peer's rails, paired by index with ours.
    peer_rails: Vec<SocketAddrV4>,
    peer_host: u32,
    /// The NCCL device this comm was opened on.
    home: u16,
    /// "send" or "recv" (logs, statistics).
    role: &'static str,
}

/// The load balancer's side of the comm.
struct LbState {
    plans: Plans,
    /// `PRISM_CC`: sets the in-flight window from message and packet delays.
    rate: SharedRate,
    /// When each send was posted (for the rate controller's message delay).
    posted_at: HashMap<MsgId, u64>,
    /// Bytes planned onto each rail (stats).
    rail_bytes: Vec<u64>,
    /// Bytes planned onto each (rail, pinned uplink; None: any), sends planned and their sub-flows
    /// (distinct (rail, uplink) pairs), for stats.
    uplink_bytes: BTreeMap<(u16, Option<u16>), u64>,
    sends_planned: u64,
    subflows: u64,
    /// Sends held in proto until their batch is planned (`batch.rs`), in posting order.
    held: Vec<MsgId>,
}

/// Datagrams the rails demultiplexed to this comm.
struct Rx {
    inbox: Arc<Inbox>,
    incoming: Vec<Datagram>,
    /// Datagrams from an address other than the peer's (dropped).
    wrong_peer: u64,
}

/// The requests NCCL posted: their buffers, their outcomes, the ids NCCL holds.
struct Requests {
    sends: HashMap<MsgId, Box<dyn SendBuf>>,
    recvs: HashMap<MsgId, Vec<Box<dyn RecvBuf>>>,
    done: HashMap<MsgId, Outcome>,
    /// Request ids NCCL holds, and the message each one stands for.
    ids: HashMap<ReqId, MsgId>,
    next_id: u32,
    /// Requests posted after the connection died (they fail when tested).
    dead_posts: u64,
}

/// This comm's part in the path board (see `board`).
struct BoardState {
    /// Last publication: when, and the DATA packets sent by then.
    at_us: u64,
    data_pkts: u64,
    /// Control packets moved off a path a sending comm to the same peer does not trust.
    steered: u64,
    /// Of those, moved to another rail (their own trusted no socket).
    other_rail: u64,
}

/// The per-comm half of the rail backend (`rail::RailBackend`).
enum CommBackend {
    /// UDP: datagrams are built into these buffers and sent per rail and socket (GSO trains, or sendmmsg).
    Udp(UdpTx),
    /// Verbs: the comm's QPs and the registrations of its outstanding buffers.
    Verbs(Box<VerbsComm>),
    /// After `shutdown` (the QPs and registrations are gone).
    Closed,
}

/// Every difference between the backends a comm sees is here (and in `transmit`, which builds the
/// UDP datagrams itself); the comm calls these unconditionally.
impl CommBackend {
    /// Reap verbs completions and feed what arrived to `conn` (UDP datagrams come through the rails).
    fn poll(&mut self, conn: &mut Connection, now: u64, sink: &mut dyn Placer) {
        if let CommBackend::Verbs(v) = self {
            v.poll(conn, now, sink);
        }
    }

    /// proto's completions as NCCL may see them. On verbs over UC a receive that got a packet by
    /// fragments is reported only once the sender said that none of its WRITEs can still land in
    /// the buffer (FENCE, see `vcomm::fence`).
    fn completions(&mut self, comps: Vec<Completion>, now: u64) -> Vec<Completion> {
        let CommBackend::Verbs(v) = self else { return comps };
        let mut comps: Vec<Completion> = comps
            .into_iter()
            .filter_map(|c| match c {
                Completion::Sent { msg, len } => {
                    v.sent(msg);
                    Some(Completion::Sent { msg, len })
                }
                Completion::Received { msg, sizes } => v.received(msg, sizes, now).map(|sizes| Completion::Received { msg, sizes }),
                other => Some(other),
            })
            .collect();
        comps.extend(v.released(now).into_iter().map(|(msg, sizes)| Completion::Received { msg, sizes }));
        comps
    }

    /// The request is done: its buffers belong to NCCL again.
    fn release(&mut self, msg: MsgId) {
        if let CommBackend::Verbs(v) = self {
            v.release(msg);
        }
    }

    /// The address a buffer is moved from or to in place (verbs: RDMA reads or writes it), None on
    /// UDP (the bytes are copied). A verbs buffer without an address is an error unless it is empty.
    fn buffer_addr(&self, addr: Option<usize>, len: usize) -> Result<Option<usize>, TransportError> {
        if !matches!(self, CommBackend::Verbs(_)) {
            return Ok(None);
        }
        match addr {
            Some(a) => Ok(Some(a)),
            None if len == 0 => Ok(Some(0)),
            None => Err(TransportError::InvalidArgument("the verbs backend needs buffers with an address".into())),
        }
    }

    /// Register the buffer of send `msg` at `addr` (from `buffer_addr`).
    fn send_posted(&mut self, msg: MsgId, addr: Option<usize>, len: usize) -> Result<(), TransportError> {
        match (self, addr) {
            (CommBackend::Verbs(v), Some(a)) => v.register(msg, &[(a, len)]),
            _ => Ok(()),
        }
    }

    /// Register the buffers (`ranges` from `buffer_addr`) of receive `msg`.
    fn recv_posted(&mut self, msg: MsgId, ranges: &[(usize, usize)]) -> Result<(), TransportError> {
        let CommBackend::Verbs(v) = self else { return Ok(()) };
        v.recv_posted(msg);
        v.register(msg, ranges)
    }

    /// The verbs side's statistics (null on UDP).
    fn stats(&self) -> serde_json::Value {
        match self {
            CommBackend::Verbs(v) => v.stats(),
            _ => serde_json::Value::Null,
        }
    }
}

/// Transmit state of a UDP comm. The datagrams themselves are built in the transmitting thread's
/// buffers (`TX_BUFS`): `transmit` fills and sends them within one call, so a comm needs none of its
/// own (64 full datagrams per comm were 561 KiB of resident memory each, 1 MiB per comm pair).
struct UdpTx {
    /// Largest datagram of this comm's rails.
    dgram: usize,
    /// (entropy, datagram length, payload left in place: message, offset, length) of each filled
    /// buffer; with a payload in place the buffer holds only the header, the first `length - payload`
    /// bytes.
    meta: Vec<(u16, usize, Option<InPlace>)>,
    /// Per rail: (socket, buffer index) to send.
    by_rail: Vec<Vec<(u16, usize)>>,
}

/// State shared by send and receive comms.
pub(crate) struct CommCore {
    net: Arc<NetInner>,
    conn: Connection,
    id: Ident,
    lb: LbState,
    rx: Rx,
    requests: Requests,
    backend: CommBackend,
    board: BoardState,
    closed: bool,
    /// When the owner (NCCL's thread) last drove this comm; the progress thread leaves it alone
    /// while the owner is active (`owner_active`).
    owner_active_us: u64,
    /// Request failures logged at WARN so far: the first of a comm says what happened, the rest
    /// (every other request of a comm whose peer went away fails the same way) go to DEBUG.
    failures_warned: u32,
}

thread_local! {
    /// The transmit buffers of the thread that runs `CommCore::transmit` (see `UdpTx`).
    static TX_BUFS: std::cell::Cell<Vec<Vec<u8>>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A payload left in NCCL's send buffer: (message, offset, length).
type InPlace = (MsgId, usize, usize);

/// proto's payload source on UDP: where the send buffer exposes its bytes (`SendBuf::bytes`), the
/// payload is not copied into the packet but recorded, and the datagram leaves as the packet's header
/// followed by those bytes in place (one iovec each); otherwise it is copied.
struct Sources<'a> {
    bufs: &'a HashMap<MsgId, Box<dyn SendBuf>>,
    /// The payload of the packet just built, when it stays in place: (message, offset, length).
    in_place: Option<InPlace>,
}

impl PayloadSource for Sources<'_> {
    fn read(&mut self, msg: MsgId, offset: u64, out: &mut [u8]) {
        self.in_place = None;
        if let Some(buf) = self.bufs.get(&msg) {
            let off = offset as usize;
            let Some(end) = off.checked_add(out.len()).filter(|&end| end <= buf.len()) else { return };
            if buf.bytes().is_some_and(|b| end <= b.len()) {
                self.in_place = Some((msg, off, out.len()));
            } else {
                buf.read(off, out);
            }
        }
    }
}

struct Sinks<'a>(&'a mut HashMap<MsgId, Vec<Box<dyn RecvBuf>>>);

impl Placer for Sinks<'_> {
    fn place(&mut self, msg: MsgId, sub: usize, offset: u64, data: &[u8]) {
        // proto already checked the range against the posted size; check again against the real
        // buffer, because this is the last line before memory NCCL owns.
        if let Some(buf) = self.0.get_mut(&msg).and_then(|v| v.get_mut(sub)) {
            let off = offset as usize;
            if off.checked_add(data.len()).is_some_and(|end| end <= buf.len()) {
                buf.write(off, data);
            }
        }
    }
}

impl CommCore {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        net: Arc<NetInner>,
        conn: Connection,
        token: u64,
        peer_rails: Vec<SocketAddrV4>,
        peer_host: u32,
        home: u16,
        plans: Plans,
        rate: SharedRate,
        role: &'static str,
        verbs: Option<VerbsComm>,
    ) -> Self {
        let inbox = Arc::new(Inbox::default());
        for rail in &net.rails {
            rail.register(token, inbox.clone());
        }
        let max_dgram = net.rails.iter().map(|r| r.max_datagram).min().unwrap_or(0);
        let nrails = net.rails.len();
        let backend = match verbs {
            Some(v) => CommBackend::Verbs(Box::new(v)),
            None => CommBackend::Udp(UdpTx {
                dgram: max_dgram,
                meta: Vec::with_capacity(BATCH),
                by_rail: vec![Vec::with_capacity(BATCH); nrails],
            }),
        };
        Self {
            net,
            conn,
            id: Ident { token, peer_rails, peer_host, home, role },
            lb: LbState {
                plans,
                rate,
                posted_at: HashMap::new(),
                rail_bytes: vec![0; nrails],
                uplink_bytes: BTreeMap::new(),
                sends_planned: 0,
                subflows: 0,
                held: Vec::new(),
            },
            rx: Rx { inbox, incoming: Vec::new(), wrong_peer: 0 },
            requests: Requests {
                sends: HashMap::new(),
                recvs: HashMap::new(),
                done: HashMap::new(),
                ids: HashMap::new(),
                next_id: 1,
                dead_posts: 0,
            },
            backend,
            board: BoardState { at_us: 0, data_pkts: 0, steered: 0, other_rail: 0 },
            closed: false,
            owner_active_us: 0,
            failures_warned: 0,
        }
    }

    /// True while the owner drives the comm: NCCL holds requests of it (so it will test them) and
    /// drove it within the last `window_us`. A comm whose requests NCCL has all taken back is the
    /// progress thread's at once: only the transport's own work is left (acknowledgements owed,
    /// retransmissions, keepalives), and nobody else will do it.
    pub fn owner_active(&self, now: u64, window_us: u64) -> bool {
        owner_drives(!self.requests.ids.is_empty(), self.owner_active_us, now, window_us)
    }

    /// Progress on behalf of the owner (isend/irecv/test).
    fn owner_progress(&mut self) {
        self.progress();
        self.owner_active_us = self.net.now_us();
    }

    /// True once the owner closed it.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// When this comm next needs attention even if no datagram arrives (None: closed or idle).
    pub fn next_wake(&mut self) -> Option<u64> {
        if self.closed {
            return None;
        }
        let t = self.conn.poll_timeout();
        if self.lb.held.is_empty() {
            return t;
        }
        // A held send: at once if its plan is in (another comm planned the batch), else when the
        // open batch is due.
        let now = self.net.now_us();
        let planned = {
            let plans = self.lb.plans.lock();
            self.lb.held.iter().any(|m| plans.contains_key(&m.0))
        };
        let due = if planned { now } else { self.net.batches.as_ref().and_then(|b| b.deadline()).unwrap_or(now) };
        Some(t.map_or(due, |t| t.min(due)))
    }

    /// Receive, run timers, transmit, collect completions.
    pub fn progress(&mut self) {
        if self.closed {
            return;
        }
        let now = self.net.now_us();
        self.backend.poll(&mut self.conn, now, &mut Sinks(&mut self.requests.recvs));
        // A batch from each rail, then what it brought this comm, and again while batches come full:
        // the payloads are copied to NCCL's buffers while the receive buffers are still in the cache
        // (after four batches of 64 KiB GRO buffers they were not, and the copy ran at memory speed).
        for _ in 0..RX_ROUNDS {
            let mut more = false;
            for rail in &self.net.rails {
                more |= rail.poll_rx(now);
            }
            self.handle_incoming(now);
            if !more {
                break;
            }
        }
        self.release_planned(now);
        if self.conn.poll_timeout().is_some_and(|t| t <= now) {
            self.conn.handle_timeout(now);
        }
        let comps: Vec<Completion> = std::iter::from_fn(|| self.conn.poll_completion()).collect();
        let comps = self.backend.completions(comps, now);
        self.transmit(now);
        self.publish_paths(now);
        for c in comps {
            let (msg, outcome) = match c {
                Completion::Sent { msg, len } => {
                    if let Some(sent_us) = self.lb.posted_at.remove(&msg) {
                        // The window is applied as proto's packet window: packets in flight, in bytes.
                        let pkts: u64 = self.conn.stats().paths.iter().map(|p| u64::from(p.in_flight)).sum();
                        let in_flight = pkts * self.conn.max_payload() as u64 + len;
                        let sample = prism_lb::MessageSample { bytes: len, sent_us, done_us: now, in_flight };
                        self.lb.rate.lock().message_done(&sample);
                    }
                    (msg, Outcome::Sent(len))
                }
                Completion::Received { msg, sizes } => (msg, Outcome::Received(sizes)),
                Completion::Failed { msg, error } => {
                    self.log_failure(format_args!("request failed: {error}"));
                    (msg, Outcome::Failed(error))
                }
            };
            // The buffers belong to NCCL again once the request is done.
            self.backend.release(msg);
            self.requests.sends.remove(&msg);
            self.requests.recvs.remove(&msg);
            self.lb.plans.lock().remove(&msg.0);
            self.lb.posted_at.remove(&msg);
            if !self.lb.held.is_empty() {
                // Failed before its batch was planned (the connection died); the plan its batch
                // delivers later stays in the table until the comm closes.
                self.lb.held.retain(|m| *m != msg);
            }
            self.requests.done.insert(msg, outcome);
        }
        self.apply_rate();
    }

    /// Feed the datagrams demultiplexed to this comm to its connection, and give their buffers back.
    fn handle_incoming(&mut self, now: u64) {
        self.rx.inbox.drain(&mut self.rx.incoming);
        if self.rx.incoming.is_empty() {
            return;
        }
        {
            let mut sinks = Sinks(&mut self.requests.recvs);
            for d in &self.rx.incoming {
                if !self.id.peer_rails.iter().any(|p| p.ip() == d.src.ip()) {
                    self.rx.wrong_peer += 1;
                    continue;
                }
                for pkt in d.packets() {
                    self.conn.handle_datagram(pkt, now, &mut sinks);
                }
            }
        }
        // Each buffer back to the pool of the rail it came from (one pass per rail).
        for rail in &self.net.rails {
            if self.rx.incoming.iter().any(|d| d.rail == rail.index) {
                rail.recycle(self.rx.incoming.iter_mut().filter(|d| d.rail == rail.index).map(|d| std::mem::take(&mut d.buf)));
            }
        }
        self.rx.incoming.clear();
    }

    /// Turn the rate controller's byte window into proto's packet window (never above `PRISM_WINDOW`).
    fn apply_rate(&mut self) {
        let bytes = self.lb.rate.lock().window_bytes();
        let pkt = self.conn.max_payload().max(1) as u64;
        let pkts = (bytes / pkt).clamp(1, u64::from(self.net.cfg.window_pkts)) as u32;
        if pkts != self.conn.window_pkts() {
            self.conn.set_window_pkts(pkts);
        }
    }

    /// A comm that sends DATA tells the others which of its paths it trusts (see `board`).
    fn publish_paths(&mut self, now: u64) {
        let sent = self.conn.stats().data_pkts_sent;
        if sent == self.board.data_pkts || now.saturating_sub(self.board.at_us) < BOARD_EVERY_US {
            return;
        }
        self.board.at_us = now;
        self.board.data_pkts = sent;
        let paths = self.net.cfg.paths;
        let rails = self.net.rails.len().min(self.id.peer_rails.len());
        for (rail, dest) in self.id.peer_rails.iter().enumerate().take(rails) {
            let good = (0..paths).map(|i| self.conn.path_preferred(rail as u16 * paths + i)).collect();
            self.net.board.publish(*dest, good, now);
        }
    }

    /// SACK, CTS and ACK packets (not DATA, and not PINGs, which probe their own path) leave from a
    /// socket a sending comm to the same peer trusts: (rail, socket) for one that would leave from
    /// `sock` of `rail`. When it trusts no socket of that rail (the rail is failing: our NIC, its
    /// link or its leaf), one of another rail it trusts, towards the peer's address on that rail
    /// (the peer takes packets from any of its rails' addresses).
    fn steer(
        board: &super::board::PathBoard,
        peer_rails: &[SocketAddrV4],
        rails: usize,
        rail: usize,
        sock: u16,
        pkt: &[u8],
        now: u64,
    ) -> (usize, u16) {
        use super::board::Steer;
        use crate::wire::{ControlKind, ControlPacket, ControlRepr, Header, PacketType};
        let steerable = match Header::new_checked(pkt).ok().and_then(|h| h.packet_type().ok()) {
            Some(PacketType::Sack | PacketType::Cts) => true,
            Some(PacketType::Control) => {
                ControlPacket::new_checked(pkt).ok().and_then(|p| ControlRepr::parse(&p).ok()).is_some_and(|c| c.kind == ControlKind::Ack)
            }
            _ => false,
        };
        if !steerable || peer_rails.is_empty() {
            return (rail, sock);
        }
        match board.steer(peer_rails[rail % peer_rails.len()], sock, now) {
            Steer::Keep => (rail, sock),
            Steer::To(s) => (rail, s),
            Steer::NoneTrusted => (1..rails)
                .map(|k| (rail + k) % rails)
                .find_map(|r| board.trusted(peer_rails[r % peer_rails.len()], sock, now).map(|s| (r, s)))
                .unwrap_or((rail, sock)),
        }
    }

    fn transmit(&mut self, now: u64) {
        let dgram = match &mut self.backend {
            CommBackend::Udp(tx) => tx.dgram,
            CommBackend::Verbs(v) => return v.transmit(&mut self.conn, now, &self.requests.sends, &self.lb.plans),
            CommBackend::Closed => return,
        };
        let mut bufs = TX_BUFS.take();
        bufs.resize_with(BATCH, Vec::new);
        for b in bufs.iter_mut().filter(|b| b.len() < dgram) {
            b.resize(dgram, 0);
        }
        self.transmit_udp(now, &mut bufs, dgram);
        TX_BUFS.set(bufs);
    }

    /// `transmit` on UDP, building the datagrams in `bufs` (`BATCH` buffers of at least `dgram` bytes).
    fn transmit_udp(&mut self, now: u64, bufs: &mut [Vec<u8>], dgram: usize) {
        let CommBackend::Udp(UdpTx { meta, by_rail, .. }) = &mut self.backend else { return };
        let peer_rails = &self.id.peer_rails;
        let sends = &self.requests.sends;
        for _ in 0..MAX_TX_BATCHES {
            meta.clear();
            let mut src = Sources { bufs: sends, in_place: None };
            for buf in bufs.iter_mut() {
                let buf = &mut buf[..dgram];
                src.in_place = None;
                match self.conn.poll_transmit(now, &mut src, buf) {
                    Some(t) => {
                        let mut pay = src.in_place.take();
                        // The payload is the packet's tail; should it not fit (it always does), copy it.
                        if let Some((msg, off, plen)) = pay.filter(|p| p.2 > t.len) {
                            pay = None;
                            if let Some(b) = sends.get(&msg) {
                                b.read(off, &mut buf[t.len - plen.min(t.len)..t.len]);
                            }
                        }
                        meta.push((t.entropy, t.len, pay));
                    }
                    None => break,
                }
            }
            if meta.is_empty() {
                return;
            }
            // Entropies are rail-major: entropy e leaves rail e / paths from its socket e % paths,
            // towards the peer's rail of the same index.
            let paths = self.net.cfg.paths;
            for v in by_rail.iter_mut() {
                v.clear();
            }
            for (k, &(e, len, _)) in meta.iter().enumerate() {
                let home = (e / paths) as usize % by_rail.len();
                let (rail, sock) = Self::steer(&self.net.board, peer_rails, by_rail.len(), home, e % paths, &bufs[k][..len], now);
                self.board.steered += u64::from(sock != e % paths || rail != home);
                self.board.other_rail += u64::from(rail != home);
                by_rail[rail].push((sock, k));
            }
            for (rail, items) in by_rail.iter_mut().enumerate() {
                if items.is_empty() {
                    continue;
                }
                // Each socket's datagrams together, in the order proto made them (the pairs are
                // distinct, so the unstable sort keeps it): a run per entropy, sent as GSO trains.
                items.sort_unstable();
                let dest = peer_rails[rail % peer_rails.len()];
                let pkts: Vec<OutDatagram<'_>> = items
                    .iter()
                    .map(|&(e, k)| {
                        let (_, len, pay) = meta[k];
                        let tail = pay.and_then(|(msg, off, plen)| sends.get(&msg)?.bytes()?.get(off..off + plen));
                        match tail {
                            Some(tail) => OutDatagram { entropy: e, head: &bufs[k][..len - tail.len()], tail },
                            None => OutDatagram::whole(e, &bufs[k][..len]),
                        }
                    })
                    .collect();
                let Some(udp) = self.net.rails[rail].backend.udp() else { continue };
                if let Err(e) = udp.send(dest, &pkts) {
                    tracing::warn!(role = self.id.role, peer = %dest, "sendmmsg failed: {e}");
                }
            }
            if meta.len() < BATCH {
                return;
            }
        }
    }

    /// A request failed: WARN for the first failure of this comm, DEBUG after that (a comm whose peer
    /// closed with 64 requests in flight logs one line, not 64).
    fn log_failure(&mut self, what: std::fmt::Arguments<'_>) {
        if self.failures_warned == 0 {
            tracing::warn!(role = self.id.role, peer = %self.id.peer_rails[0], "{what} (further failures of this comm are logged at DEBUG)");
        } else {
            tracing::debug!(role = self.id.role, peer = %self.id.peer_rails[0], "{what}");
        }
        self.failures_warned = self.failures_warned.saturating_add(1);
    }

    /// What a refused post tells the caller. On a dead connection (the peer closed, timed out or
    /// died) the post is accepted all the same, as NCCL expects of a plugin that is not out of
    /// resources: the request fails with the reason when it is tested. `limit` bounds the requests
    /// outstanding (beyond it: retry later), so a caller that never tests cannot grow memory.
    fn post_error(&mut self, e: PostError, what: &str, limit: usize) -> Result<Option<ReqId>, TransportError> {
        match e {
            PostError::Full => Ok(None),
            PostError::Dead(err) => {
                if self.requests.ids.len() >= limit {
                    return Ok(None);
                }
                self.log_failure(format_args!("{what} on a dead connection: accepted, it fails when tested ({err})"));
                let msg = MsgId(DEAD_POST | self.requests.dead_posts);
                self.requests.dead_posts += 1;
                self.requests.done.insert(msg, Outcome::Failed(err));
                Ok(Some(self.new_req(msg)))
            }
            other => Err(TransportError::InvalidArgument(other.to_string())),
        }
    }

    /// Ask the load balancer how to spread send `msg` over rails and uplinks: at once, or, with
    /// Ethereal's batching window, together with the sends of its batch (the send is held in proto
    /// until then; see `batch.rs`). The plan's start delays hold its chunks back in proto.
    fn plan(&mut self, msg: MsgId, len: u64, now: u64) {
        if len == 0 {
            return;
        }
        let req = prism_lb::SendReq { dst_host: self.id.peer_host as usize, len, flow: self.id.token, home_rail: self.id.home };
        let net = self.net.clone();
        if let Some(b) = &net.batches {
            self.conn.hold_send(msg);
            self.lb.held.push(msg);
            b.push(&net.lb_rt, &self.lb.plans, msg.0, req, now);
            self.release_planned(now);
            return;
        }
        match net.lb_rt.plan(&req, now) {
            Ok(plan) => {
                let map = ChunkMap::from_plan(&plan, now);
                self.count_plan(&map);
                if !map.starts().is_empty() {
                    self.conn.set_send_starts(msg, map.starts());
                }
                self.lb.plans.lock().insert(msg.0, map);
            }
            Err(e) => tracing::warn!("no plan for a {len}-byte message ({e}); it stays on its own rail"),
        }
    }

    /// Release the held sends whose batch was planned (planning the open batch first if its window
    /// is over), with their chunks' start times.
    fn release_planned(&mut self, now: u64) {
        if self.lb.held.is_empty() {
            return;
        }
        if let Some(b) = &self.net.batches {
            b.poll(&self.net.lb_rt, now);
        }
        for msg in std::mem::take(&mut self.lb.held) {
            let map = self.lb.plans.lock().get(&msg.0).cloned();
            match map {
                Some(map) => {
                    self.count_plan(&map);
                    self.conn.set_send_starts(msg, map.starts());
                }
                None => self.lb.held.push(msg),
            }
        }
    }

    /// Statistics of a send's plan.
    fn count_plan(&mut self, map: &ChunkMap) {
        for (rail, bytes) in map.rails() {
            if let Some(b) = self.lb.rail_bytes.get_mut(rail as usize) {
                *b += bytes;
            }
        }
        for (key, bytes) in map.uplinks() {
            *self.lb.uplink_bytes.entry(key).or_insert(0) += bytes;
        }
        self.lb.sends_planned += 1;
        self.lb.subflows += map.subflows() as u64;
    }

    fn new_req(&mut self, msg: MsgId) -> ReqId {
        let id = ReqId(self.requests.next_id);
        self.requests.next_id = self.requests.next_id.wrapping_add(1).max(1);
        self.requests.ids.insert(id, msg);
        id
    }

    /// Progress, then the outcome of `req` if it is done (the request is then forgotten).
    fn test(&mut self, req: ReqId) -> Result<Option<Outcome>, TransportError> {
        let msg = *self.requests.ids.get(&req).ok_or(TransportError::UnknownRequest(req.0))?;
        self.owner_progress();
        let out = self.requests.done.remove(&msg);
        if out.is_some() {
            self.requests.ids.remove(&req);
        }
        Ok(out)
    }

    /// The rate controller's name, state and the window it sets, under one lock.
    fn rate_stats(&self) -> serde_json::Value {
        let rate = self.lb.rate.lock();
        serde_json::json!({ "controller": rate.name(), "window_pkts": self.conn.window_pkts(), "state": rate.describe_state() })
    }

    /// Bytes planned onto each pinned uplink, per rail (`[rail][uplink]`; chunks the split layer left
    /// free are in `planned_bytes_per_rail` only).
    fn uplink_stats(&self) -> Vec<Vec<u64>> {
        let mut v = vec![Vec::new(); self.lb.rail_bytes.len()];
        for (&(rail, uplink), &bytes) in &self.lb.uplink_bytes {
            if let (Some(r), Some(u)) = (v.get_mut(rail as usize), uplink) {
                if r.len() <= u as usize {
                    r.resize(u as usize + 1, 0);
                }
                r[u as usize] += bytes;
            }
        }
        v
    }

    /// Final statistics of this comm, but for its connection's (`record_stats` takes those apart).
    fn stats(&self) -> serde_json::Value {
        serde_json::json!({
            "role": self.id.role,
            "rail": self.net.rails[self.id.home as usize].info.name,
            "peer": self.id.peer_rails[0].to_string(),
            "peer_host": self.id.peer_host,
            "paths_per_rail": self.net.cfg.paths,
            "planned_bytes_per_rail": self.lb.rail_bytes,
            "planned_bytes_per_uplink": self.uplink_stats(),
            "sends_planned": self.lb.sends_planned,
            "planned_subflows": self.lb.subflows,
            "start_gates": self.conn.gate_stats(),
            "rate": self.rate_stats(),
            "wrong_peer_dropped": self.rx.wrong_peer,
            "control_steered": self.board.steered,
            "control_other_rail": self.board.other_rail,
            "backend": self.net.backend_name(),
            "verbs": self.backend.stats(),
        })
    }

    /// Tell the peer, stop receiving, keep the statistics. Requests still outstanding are abandoned
    /// (their buffers are dropped here, before the caller gives the memory back).
    fn shutdown(&mut self) {
        if self.closed {
            return;
        }
        let now = self.net.now_us();
        self.conn.close(now);
        self.transmit(now);
        self.closed = true;
        for rail in &self.net.rails {
            rail.unregister(self.id.token);
        }
        self.net.record_stats(self.stats(), self.conn.stats());
        self.requests.sends.clear();
        self.requests.recvs.clear();
        // Registrations go with the QPs (VerbsComm's drop releases what is still held).
        self.backend = CommBackend::Closed;
    }
}

/// A comm as the engine's progress thread and its owner share it.
pub(crate) type SharedCore = Arc<Mutex<CommCore>>;

/// Wrap a new comm so that both its owner and the progress thread can drive it.
pub(super) fn adopt(net: &Arc<NetInner>, core: CommCore) -> SharedCore {
    let shared = Arc::new(Mutex::new(core));
    net.progress.adopt(net, &shared);
    shared
}

/// The progress thread's rule (`CommCore::owner_active`): the owner drives a comm while it holds
/// requests of it and drove it within the last `window_us`.
fn owner_drives(holds_requests: bool, driven_at_us: u64, now: u64, window_us: u64) -> bool {
    holds_requests && now.saturating_sub(driven_at_us) < window_us
}

impl Driven for CommCore {
    fn is_closed(&self) -> bool {
        CommCore::is_closed(self)
    }
    fn owner_active(&self, now: u64, window_us: u64) -> bool {
        CommCore::owner_active(self, now, window_us)
    }
    fn progress(&mut self) {
        CommCore::progress(self)
    }
    fn next_wake(&mut self) -> Option<u64> {
        CommCore::next_wake(self)
    }
}

#[cfg(test)]
mod owner_tests {
    use super::owner_drives;

    #[test]
    fn the_owner_drives_a_comm_only_while_it_holds_requests_and_tested_lately() {
        // Holding requests and driven 9.999 ms ago: the owner's (a preempted owner is still driving).
        assert!(owner_drives(true, 1_000, 10_999, 10_000));
        // Not driven for the whole window: the thread takes over, requests or not.
        assert!(!owner_drives(true, 1_000, 11_000, 10_000));
        // No request held: nobody will test the comm again, so it is the thread's at once, however
        // recently its owner drove it (the last test that returned a completion).
        assert!(!owner_drives(false, 1_000, 1_000, 10_000));
        // A clock that went backwards (never on a monotonic clock) counts as just driven.
        assert!(owner_drives(true, 5_000, 4_000, 10_000));
    }
}
