//! A connected comm: one `proto::Connection` plus the buffers of its outstanding requests, driven by
//! whoever calls `isend`/`irecv`/`test` (NCCL's proxy progress thread).

use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::sync::Arc;

use parking_lot::Mutex;

use super::net::NetInner;
use super::planned::{ChunkMap, Plans, SharedRate};
use super::rail::{Datagram, Inbox};
use super::vcomm::VerbsComm;
use super::{RecvBuf, ReqId, SendBuf, TransportError, MAX_RECVS, MAX_RECV_REQUESTS, MAX_SEND_REQUESTS};
use crate::backend::udp::BATCH;
use crate::proto::{Completion, Connection, MsgError, MsgId, PayloadSource, Placer, PostError, RecvSpec};

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

/// State shared by send and receive comms.
pub(crate) struct CommCore {
    net: Arc<NetInner>,
    conn: Connection,
    token: u64,
    /// The peer's rails, paired by index with ours.
    peer_rails: Vec<SocketAddrV4>,
    peer_host: u32,
    /// The NCCL device this comm was opened on.
    home: u16,
    plans: Plans,
    /// `PRISM_CC`: sets the in-flight window from message and packet delays.
    rate: SharedRate,
    /// When each send was posted (for the rate controller's message delay).
    posted_at: HashMap<MsgId, u64>,
    /// Bytes planned onto each rail (stats).
    rail_bytes: Vec<u64>,
    inbox: Arc<Inbox>,
    incoming: Vec<Datagram>,
    sends: HashMap<MsgId, Box<dyn SendBuf>>,
    recvs: HashMap<MsgId, Vec<Box<dyn RecvBuf>>>,
    done: HashMap<MsgId, Outcome>,
    /// Request ids NCCL holds, and the message each one stands for.
    reqs: HashMap<ReqId, MsgId>,
    next_req: u32,
    /// Requests posted after the connection died (they fail when tested).
    dead_posts: u64,
    tx: Vec<Vec<u8>>,
    tx_meta: Vec<(u16, usize)>,
    tx_by_rail: Vec<Vec<(u16, usize)>>,
    /// Datagrams from an address other than the peer's (dropped).
    wrong_peer: u64,
    role: &'static str,
    closed: bool,
    /// When the owner (NCCL's thread) last drove this comm; the progress thread leaves it alone
    /// while the owner is active.
    owner_active_us: u64,
    /// Last publication to the path board: when, and the DATA packets sent by then.
    board_at_us: u64,
    board_data_pkts: u64,
    /// Control packets moved off a path a sending comm to the same peer does not trust.
    steered: u64,
    /// Request failures logged at WARN so far: the first of a comm says what happened, the rest
    /// (every other request of a comm whose peer went away fails the same way) go to DEBUG.
    failures_warned: u32,
    /// The verbs side (verbs backend only).
    verbs: Option<VerbsComm>,
}

struct Sources<'a>(&'a HashMap<MsgId, Box<dyn SendBuf>>);

impl PayloadSource for Sources<'_> {
    fn read(&mut self, msg: MsgId, offset: u64, out: &mut [u8]) {
        if let Some(buf) = self.0.get(&msg) {
            let off = offset as usize;
            if off.checked_add(out.len()).is_some_and(|end| end <= buf.len()) {
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
        let ntx = if verbs.is_some() { 0 } else { BATCH };
        let tx = (0..ntx).map(|_| vec![0u8; max_dgram]).collect();
        let nrails = net.rails.len();
        Self {
            net,
            conn,
            token,
            peer_rails,
            peer_host,
            home,
            plans,
            rate,
            posted_at: HashMap::new(),
            rail_bytes: vec![0; nrails],
            inbox,
            incoming: Vec::new(),
            sends: HashMap::new(),
            recvs: HashMap::new(),
            done: HashMap::new(),
            reqs: HashMap::new(),
            next_req: 1,
            dead_posts: 0,
            tx,
            tx_meta: Vec::with_capacity(BATCH),
            tx_by_rail: vec![Vec::with_capacity(BATCH); nrails],
            wrong_peer: 0,
            role,
            closed: false,
            owner_active_us: 0,
            board_at_us: 0,
            board_data_pkts: 0,
            steered: 0,
            failures_warned: 0,
            verbs,
        }
    }

    /// True when the owner drove the comm within the last `window_us`.
    pub fn owner_active(&self, now: u64, window_us: u64) -> bool {
        now.saturating_sub(self.owner_active_us) < window_us
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
            None
        } else {
            self.conn.poll_timeout()
        }
    }

    /// Receive, run timers, transmit, collect completions.
    pub fn progress(&mut self) {
        if self.closed {
            return;
        }
        let now = self.net.now_us();
        if let Some(v) = self.verbs.as_mut() {
            v.poll(&mut self.conn, now);
        }
        for rail in &self.net.rails {
            rail.poll_rx();
        }
        self.inbox.drain(&mut self.incoming);
        {
            let mut sinks = Sinks(&mut self.recvs);
            for d in &self.incoming {
                if !self.peer_rails.iter().any(|p| p.ip() == d.src.ip()) {
                    self.wrong_peer += 1;
                    continue;
                }
                self.conn.handle_datagram(&d.buf[..d.len], now, &mut sinks);
            }
        }
        if !self.incoming.is_empty() {
            self.net.rails[0].recycle(self.incoming.drain(..).map(|d| d.buf));
        }
        if self.conn.poll_timeout().is_some_and(|t| t <= now) {
            self.conn.handle_timeout(now);
        }
        let mut comps: Vec<Completion> = std::iter::from_fn(|| self.conn.poll_completion()).collect();
        if let Some(v) = self.verbs.as_mut() {
            // On verbs a receive is reported only once the sender said that none of its WRITEs can
            // still land in the buffer (FENCE); sends tell the receiver so.
            comps = comps
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
        }
        self.transmit(now);
        self.publish_paths(now);
        for c in comps {
            let (msg, outcome) = match c {
                Completion::Sent { msg, len } => {
                    if let Some(sent_us) = self.posted_at.remove(&msg) {
                        let sample = prism_lb::MessageSample { bytes: len, sent_us, done_us: now };
                        self.rate.lock().message_done(&sample);
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
            if let Some(v) = self.verbs.as_mut() {
                v.release(msg);
            }
            self.sends.remove(&msg);
            self.recvs.remove(&msg);
            self.plans.lock().remove(&msg.0);
            self.posted_at.remove(&msg);
            self.done.insert(msg, outcome);
        }
        self.apply_rate();
    }

    /// Turn the rate controller's byte window into proto's packet window (never above `PRISM_WINDOW`).
    fn apply_rate(&mut self) {
        let bytes = self.rate.lock().window_bytes();
        let pkt = self.net.proto.max_payload.max(1) as u64;
        let pkts = (bytes / pkt).clamp(1, u64::from(self.net.cfg.window_pkts)) as u32;
        if pkts != self.conn.window_pkts() {
            self.conn.set_window_pkts(pkts);
        }
    }

    /// A comm that sends DATA tells the others which of its paths it trusts (see `board`).
    fn publish_paths(&mut self, now: u64) {
        let sent = self.conn.stats().data_pkts_sent;
        if sent == self.board_data_pkts || now.saturating_sub(self.board_at_us) < BOARD_EVERY_US {
            return;
        }
        self.board_at_us = now;
        self.board_data_pkts = sent;
        let paths = self.net.cfg.paths;
        let rails = self.net.rails.len().min(self.peer_rails.len());
        for (rail, dest) in self.peer_rails.iter().enumerate().take(rails) {
            let good = (0..paths).map(|i| self.conn.path_preferred(rail as u16 * paths + i)).collect();
            self.net.board.publish(*dest, good, now);
        }
    }

    /// SACK, CTS and ACK packets (not DATA, and not PINGs, which probe their own path) leave from a
    /// socket a sending comm to the same peer trusts.
    fn steer(board: &super::board::PathBoard, dest: SocketAddrV4, sock: u16, pkt: &[u8], now: u64) -> u16 {
        use crate::wire::{ControlKind, ControlPacket, ControlRepr, Header, PacketType};
        let steerable = match Header::new_checked(pkt).ok().and_then(|h| h.packet_type().ok()) {
            Some(PacketType::Sack | PacketType::Cts) => true,
            Some(PacketType::Control) => {
                ControlPacket::new_checked(pkt).ok().and_then(|p| ControlRepr::parse(&p).ok()).is_some_and(|c| c.kind == ControlKind::Ack)
            }
            _ => false,
        };
        if !steerable {
            return sock;
        }
        board.steer(dest, sock, now).unwrap_or(sock)
    }

    fn transmit(&mut self, now: u64) {
        if let Some(v) = self.verbs.as_mut() {
            v.transmit(&mut self.conn, now);
            return;
        }
        for _ in 0..MAX_TX_BATCHES {
            self.tx_meta.clear();
            let mut src = Sources(&self.sends);
            for buf in self.tx.iter_mut() {
                match self.conn.poll_transmit(now, &mut src, buf) {
                    Some(t) => self.tx_meta.push((t.entropy, t.len)),
                    None => break,
                }
            }
            if self.tx_meta.is_empty() {
                return;
            }
            // Entropies are rail-major: entropy e leaves rail e / paths from its socket e % paths,
            // towards the peer's rail of the same index.
            let paths = self.net.cfg.paths;
            for v in &mut self.tx_by_rail {
                v.clear();
            }
            for (k, &(e, _)) in self.tx_meta.iter().enumerate() {
                let rail = (e / paths) as usize % self.tx_by_rail.len();
                let dest = self.peer_rails[rail % self.peer_rails.len()];
                let sock = Self::steer(&self.net.board, dest, e % paths, &self.tx[k][..self.tx_meta[k].1], now);
                self.steered += u64::from(sock != e % paths);
                self.tx_by_rail[rail].push((sock, k));
            }
            for (rail, items) in self.tx_by_rail.iter().enumerate() {
                if items.is_empty() {
                    continue;
                }
                let dest = self.peer_rails[rail % self.peer_rails.len()];
                let pkts: Vec<(u16, &[u8])> = items.iter().map(|&(e, k)| (e, &self.tx[k][..self.tx_meta[k].1])).collect();
                let Some(udp) = &self.net.rails[rail].udp else { continue };
                if let Err(e) = udp.send(dest, &pkts) {
                    tracing::warn!(role = self.role, peer = %dest, "sendmmsg failed: {e}");
                }
            }
            if self.tx_meta.len() < BATCH {
                return;
            }
        }
    }

    /// A request failed: WARN for the first failure of this comm, DEBUG after that (a comm whose peer
    /// closed with 64 requests in flight logs one line, not 64).
    fn log_failure(&mut self, what: std::fmt::Arguments<'_>) {
        if self.failures_warned == 0 {
            tracing::warn!(role = self.role, peer = %self.peer_rails[0], "{what} (further failures of this comm are logged at DEBUG)");
        } else {
            tracing::debug!(role = self.role, peer = %self.peer_rails[0], "{what}");
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
                if self.reqs.len() >= limit {
                    return Ok(None);
                }
                self.log_failure(format_args!("{what} on a dead connection: accepted, it fails when tested ({err})"));
                let msg = MsgId(DEAD_POST | self.dead_posts);
                self.dead_posts += 1;
                self.done.insert(msg, Outcome::Failed(err));
                Ok(Some(self.new_req(msg)))
            }
            other => Err(TransportError::InvalidArgument(other.to_string())),
        }
    }

    /// Ask the load balancer how to spread message `msg` over rails and uplinks.
    fn plan(&mut self, msg: MsgId, len: u64, now: u64) {
        if len == 0 {
            return;
        }
        let req = prism_lb::SendReq { dst_host: self.peer_host as usize, len, flow: self.token, home_rail: self.home };
        match self.net.lb_rt.plan(&req, now) {
            Ok(plan) => {
                let map = ChunkMap::from_plan(&plan);
                for (rail, bytes) in map.rails() {
                    if let Some(b) = self.rail_bytes.get_mut(rail as usize) {
                        *b += bytes;
                    }
                }
                self.plans.lock().insert(msg.0, map);
            }
            Err(e) => tracing::warn!("no plan for a {len}-byte message ({e}); it stays on its own rail"),
        }
    }

    /// On the verbs backend a buffer must have an address (RDMA reads or writes it in place).
    fn verbs_addr(&self, addr: Option<usize>, len: usize) -> Result<Option<usize>, TransportError> {
        if self.verbs.is_none() {
            return Ok(None);
        }
        match addr {
            Some(a) => Ok(Some(a)),
            None if len == 0 => Ok(Some(0)),
            None => Err(TransportError::InvalidArgument("the verbs backend needs buffers with an address".into())),
        }
    }

    fn new_req(&mut self, msg: MsgId) -> ReqId {
        let id = ReqId(self.next_req);
        self.next_req = self.next_req.wrapping_add(1).max(1);
        self.reqs.insert(id, msg);
        id
    }

    /// Progress, then the outcome of `req` if it is done (the request is then forgotten).
    fn test(&mut self, req: ReqId) -> Result<Option<Outcome>, TransportError> {
        let msg = *self.reqs.get(&req).ok_or(TransportError::UnknownRequest(req.0))?;
        self.owner_progress();
        let out = self.done.remove(&msg);
        if out.is_some() {
            self.reqs.remove(&req);
        }
        Ok(out)
    }

    /// The rate controller's name, state and the window it sets, under one lock.
    fn rate_stats(&self) -> serde_json::Value {
        let rate = self.rate.lock();
        serde_json::json!({ "controller": rate.name(), "window_pkts": self.conn.window_pkts(), "state": rate.describe_state() })
    }

    /// Final statistics of this comm, but for its connection's (`record_stats` takes those apart).
    fn stats(&self) -> serde_json::Value {
        serde_json::json!({
            "role": self.role,
            "rail": self.net.rails[self.home as usize].info.name,
            "peer": self.peer_rails[0].to_string(),
            "peer_host": self.peer_host,
            "paths_per_rail": self.net.cfg.paths,
            "planned_bytes_per_rail": self.rail_bytes,
            "rate": self.rate_stats(),
            "wrong_peer_dropped": self.wrong_peer,
            "control_steered": self.steered,
            "backend": if self.verbs.is_some() { "verbs" } else { "udp" },
            "verbs": self.verbs.as_ref().map(VerbsComm::stats),
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
            rail.unregister(self.token);
        }
        self.net.record_stats(self.stats(), self.conn.stats());
        self.sends.clear();
        self.recvs.clear();
        // Registrations go with the QPs (VerbsComm's drop releases what is still held).
        self.verbs = None;
    }
}

/// A comm as the engine's progress thread and its owner share it.
pub(crate) type SharedCore = Arc<Mutex<CommCore>>;

/// Close a comm from its owner's thread and let the engine stop its progress thread if it was the last.
fn close_shared(core: &SharedCore) {
    let net = {
        let mut c = core.lock();
        c.shutdown();
        c.net.clone()
    };
    net.progress.closed();
}

fn failed(e: MsgError) -> TransportError {
    match e {
        MsgError::Truncated { .. } => TransportError::Truncated(e.to_string()),
        other => TransportError::RequestFailed(other.to_string()),
    }
}

/// The sending end of a connection (NCCL's sendComm).
pub struct SendComm {
    shared: SharedCore,
}

impl Drop for SendComm {
    fn drop(&mut self) {
        close_shared(&self.shared);
    }
}

impl SendComm {
    pub(crate) fn new(shared: SharedCore) -> Self {
        Self { shared }
    }

    /// Post a send of `buf` with `tag`. `Ok(None)`: too many outstanding, retry later. On a connection
    /// whose peer closed or died the send is accepted and its `test` reports why it failed.
    pub fn isend(&mut self, buf: Box<dyn SendBuf>, tag: i32) -> Result<Option<ReqId>, TransportError> {
        let mut core = self.shared.lock();
        let now = core.net.now_us();
        let addr = core.verbs_addr(buf.addr(), buf.len())?;
        match core.conn.post_send(buf.len() as u64, tag, now) {
            Ok(msg) => {
                if let (Some(v), Some(a)) = (core.verbs.as_mut(), addr) {
                    if let Err(e) = v.register(msg, &[(a, buf.len())]) {
                        // proto has the send already; it cannot be moved without its memory.
                        core.conn.close(now);
                        return Err(e);
                    }
                }
                core.plan(msg, buf.len() as u64, now);
                core.posted_at.insert(msg, now);
                core.sends.insert(msg, buf);
                core.owner_progress();
                Ok(Some(core.new_req(msg)))
            }
            Err(e) => {
                core.owner_progress();
                core.post_error(e, "isend", MAX_SEND_REQUESTS)
            }
        }
    }

    /// Progress the comm; `Some(size)` once `req` is done (it is then forgotten), `Err` if it failed.
    pub fn test(&mut self, req: ReqId) -> Result<Option<usize>, TransportError> {
        match self.shared.lock().test(req)? {
            None => Ok(None),
            Some(Outcome::Sent(len)) => Ok(Some(len as usize)),
            Some(Outcome::Failed(e)) => Err(failed(e)),
            Some(Outcome::Received(_)) => Err(TransportError::UnknownRequest(req.0)),
        }
    }
}

/// The receiving end of a connection (NCCL's recvComm).
pub struct RecvComm {
    shared: SharedCore,
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        close_shared(&self.shared);
    }
}

impl RecvComm {
    pub(crate) fn new(shared: SharedCore) -> Self {
        Self { shared }
    }

    /// Post a (grouped) receive into `bufs`, each with its tag. `Ok(None)`: retry later. On a
    /// connection whose peer closed or died the receive is accepted and its `test` reports why it failed.
    pub fn irecv(&mut self, bufs: Vec<(Box<dyn RecvBuf>, i32)>) -> Result<Option<ReqId>, TransportError> {
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(TransportError::InvalidArgument(format!("a grouped receive needs 1 to {MAX_RECVS} buffers, got {}", bufs.len())));
        }
        let mut core = self.shared.lock();
        let now = core.net.now_us();
        let specs: Vec<RecvSpec> = bufs.iter().map(|(b, tag)| RecvSpec { len: b.len() as u64, tag: *tag }).collect();
        let mut ranges = Vec::with_capacity(bufs.len());
        for (b, _) in &bufs {
            if let Some(a) = core.verbs_addr(b.addr(), b.len())? {
                ranges.push((a, b.len()));
            }
        }
        match core.conn.post_recv(&specs, now) {
            Ok(msg) => {
                if let Some(v) = core.verbs.as_mut() {
                    v.recv_posted(msg);
                    if let Err(e) = v.register(msg, &ranges) {
                        core.conn.close(now);
                        return Err(e);
                    }
                }
                core.recvs.insert(msg, bufs.into_iter().map(|(b, _)| b).collect());
                core.owner_progress();
                Ok(Some(core.new_req(msg)))
            }
            Err(e) => {
                core.owner_progress();
                core.post_error(e, "irecv", MAX_RECV_REQUESTS)
            }
        }
    }

    /// Progress the comm; the real received sizes once `req` is done, `Err` if it failed.
    pub fn test(&mut self, req: ReqId) -> Result<Option<Vec<usize>>, TransportError> {
        match self.shared.lock().test(req)? {
            None => Ok(None),
            Some(Outcome::Received(sizes)) => Ok(Some(sizes.into_iter().map(|s| s as usize).collect())),
            Some(Outcome::Failed(e)) => Err(failed(e)),
            Some(Outcome::Sent(_)) => Err(TransportError::UnknownRequest(req.0)),
        }
    }
}
