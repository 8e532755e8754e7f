//! The connection: one NCCL comm's protocol state, both halves, plus what they share (paths, timers,
//! keepalives, peer timeout, close). The halves live in `sender.rs` and `receiver.rs`.

use std::collections::VecDeque;

use prism_lb::PathPolicy;

use super::gate::StartGates;
use super::paths::Paths;
use super::receiver::RxState;
use super::rtt::RttEstimator;
use super::sender::TxState;
use super::stats::{ConnStats, PathStats};
use super::{
    Completion, Micros, MsgError, MsgId, PayloadSource, Placer, PostError, ProtoConfig, RecvSpec, Transmit, MAX_OUTSTANDING_RECVS,
    MAX_OUTSTANDING_SENDS, MAX_RECV_BUFS,
};
use crate::wire::{
    ControlKind, ControlPacket, ControlRepr, CtsPacket, CtsRepr, DataPacket, DataRepr, Header, PacketType, SackPacket, SackRepr, WireError,
};

#[derive(Debug, Clone)]
enum Life {
    Open,
    /// Closed locally: a CLOSE goes out, and again (rate-limited) when the peer keeps talking.
    Closed {
        close_due: bool,
        last_close_at: Option<Micros>,
    },
    /// The peer timed out or closed.
    Dead(MsgError),
}

/// A parsed, checked packet. A CTS may carry the verbs backend's remote keys (a few hundred bytes);
/// the value lives on the stack for one packet, so it is not boxed.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    Data(DataRepr),
    Cts(CtsRepr),
    Sack(SackRepr),
    Control(ControlRepr),
}

impl Parsed {
    fn parse(bytes: &[u8], ptype: PacketType) -> Result<Self, WireError> {
        Ok(match ptype {
            PacketType::Data => Self::Data(DataRepr::parse(&DataPacket::new_checked(bytes)?)?),
            PacketType::Cts => Self::Cts(CtsRepr::parse(&CtsPacket::new_checked(bytes)?)?),
            PacketType::Sack => Self::Sack(SackRepr::parse(&SackPacket::new_checked(bytes)?)?),
            PacketType::Control => Self::Control(ControlRepr::parse(&ControlPacket::new_checked(bytes)?)?),
        })
    }

    fn cts_ack(&self) -> u64 {
        match self {
            Self::Data(r) => r.cts_ack,
            Self::Cts(r) => r.cts_ack,
            Self::Sack(r) => r.cts_ack,
            Self::Control(r) => r.cts_ack,
        }
    }
}

/// The sans-IO protocol state of one NCCL comm (either role; control flows both ways).
pub struct Connection {
    pub(super) cfg: ProtoConfig,
    local_token: u64,
    pub(super) peer_token: u64,
    pub(super) policy: Box<dyn PathPolicy>,
    next_msg_id: u64,
    pub(super) tx: TxState,
    pub(super) rx: RxState,
    pub(super) paths: Paths,
    /// RTT of the connection as a whole, for CTS retransmission and probes.
    pub(super) ctl_rtt: RttEstimator,
    pub(super) stats: ConnStats,
    pub(super) completions: VecDeque<Completion>,
    life: Life,
    /// Latest time seen; the caller's clock is taken as monotonic even if it is not.
    pub(super) now: Micros,
    pub(super) last_heard: Micros,
    /// Since when requests have been outstanding (silence before that does not count).
    work_since: Option<Micros>,
    last_ping_at: Option<Micros>,
    ping_due: bool,
    /// PINGs to answer (entropy, timestamp), oldest first: one per entropy (a newer PING replaces
    /// the timestamp), at most `n_paths` (a burst of probes, e.g. after a failure ended, is
    /// answered in full; a peer cannot make it grow beyond that).
    pong_due: VecDeque<(u16, u32)>,
    /// Start times of sends the driver set (`gate.rs`).
    pub(super) gates: StartGates,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("local_token", &self.local_token)
            .field("peer_token", &self.peer_token)
            .field("policy", &self.policy.name())
            .field("life", &self.life)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// A connection between `local_token` (this end) and `peer_token`, spreading packets with `policy`.
    /// Unusable configuration values are corrected (and logged).
    pub fn new(cfg: ProtoConfig, local_token: u64, peer_token: u64, policy: Box<dyn PathPolicy>, now: Micros) -> Self {
        let cfg = cfg.sanitized();
        let rtt = RttEstimator::new(cfg.rto_min_us, cfg.rto_max_us, cfg.rto_initial_us);
        let paths = Paths::new(cfg.n_paths, &rtt, cfg.path_dead_after, cfg.path_revive_us);
        let stats = ConnStats {
            reorder_threshold: cfg.reorder_threshold,
            paths: (0..cfg.n_paths).map(|entropy| PathStats { entropy, rto_us: rtt.rto_us(), ..PathStats::default() }).collect(),
            ..ConnStats::default()
        };
        Self {
            tx: TxState::new(cfg.reorder_threshold),
            rx: RxState::new(),
            paths,
            ctl_rtt: rtt,
            stats,
            completions: VecDeque::new(),
            cfg,
            local_token,
            peer_token,
            policy,
            next_msg_id: 0,
            life: Life::Open,
            now,
            last_heard: now,
            work_since: None,
            last_ping_at: None,
            ping_due: false,
            pong_due: VecDeque::new(),
            gates: StartGates::default(),
        }
    }

    /// Post a send of `len` bytes with NCCL tag `tag`. It is transmitted once the peer's CTS offers a
    /// buffer for it, and completes `Sent` once every byte is acknowledged.
    pub fn post_send(&mut self, len: u64, tag: i32, now: Micros) -> Result<MsgId, PostError> {
        let now = self.clock(now);
        self.check_postable()?;
        if self.tx.open_sends() >= MAX_OUTSTANDING_SENDS {
            return Err(PostError::Full);
        }
        let id = self.new_msg_id();
        self.queue_send(id, len, tag);
        self.update_work(now);
        Ok(id)
    }

    /// Post a grouped receive of 1..=8 buffers; a CTS tells the peer about them.
    pub fn post_recv(&mut self, bufs: &[RecvSpec], now: Micros) -> Result<MsgId, PostError> {
        let now = self.clock(now);
        if bufs.is_empty() || bufs.len() > MAX_RECV_BUFS {
            return Err(PostError::TooManyBuffers(bufs.len()));
        }
        self.check_postable()?;
        if self.rx.open_recvs() >= MAX_OUTSTANDING_RECVS {
            return Err(PostError::Full);
        }
        let id = self.new_msg_id();
        self.queue_recv(id, bufs);
        self.update_work(now);
        Ok(id)
    }

    fn check_postable(&self) -> Result<(), PostError> {
        match &self.life {
            Life::Open => {}
            Life::Closed { .. } => return Err(PostError::Dead(MsgError::Closed)),
            Life::Dead(e) => return Err(PostError::Dead(e.clone())),
        }
        Ok(())
    }

    fn new_msg_id(&mut self) -> MsgId {
        let id = MsgId(self.next_msg_id);
        self.next_msg_id += 1;
        id
    }

    fn clock(&mut self, now: Micros) -> Micros {
        self.now = self.now.max(now);
        self.now
    }

    /// Work is outstanding: requests, unacknowledged packets or CTS.
    fn has_work(&self) -> bool {
        self.tx.busy() || self.rx.open_recvs() > 0
    }

    fn update_work(&mut self, now: Micros) {
        if !matches!(self.life, Life::Open) || !self.has_work() {
            self.work_since = None;
        } else if self.work_since.is_none() {
            self.work_since = Some(now);
        }
    }

    /// One datagram from the network. Anything malformed, misaddressed or inconsistent is dropped and
    /// counted in `stats().dropped`; payload reaches `placer` only inside a posted buffer.
    pub fn handle_datagram(&mut self, bytes: &[u8], now: Micros, placer: &mut dyn Placer) {
        self.handle_packet(bytes, now, Some(placer), false);
    }

    /// A DATA header whose payload was already written into the posted buffer by the network (the
    /// verbs backend's RDMA WRITE): exactly the 64-byte header, without payload. The same checks and
    /// bookkeeping as [`Self::handle_datagram`] (token, receive outstanding, `offset + len` within
    /// the posted size, duplicate PSNs, SACK), but nothing is copied. Anything that is not such a
    /// header is dropped and counted.
    pub fn handle_placed_data(&mut self, header: &[u8], now: Micros) {
        self.handle_packet(header, now, None, false);
    }

    /// As [`Self::handle_placed_data`], for a header the verbs backend rebuilt from a WRITE's
    /// immediate and the sender's item descriptor: its `ts_us` is not a send timestamp, so the SACK
    /// it triggers echoes its PSN instead (the sender looks the send time up).
    pub fn handle_rebuilt_data(&mut self, header: &[u8], now: Micros) {
        self.handle_packet(header, now, None, true);
    }

    /// `placer` None: `bytes` is a payload-less DATA header whose payload is already in place.
    fn handle_packet(&mut self, bytes: &[u8], now: Micros, placer: Option<&mut dyn Placer>, echo_psn: bool) {
        let now = self.clock(now);
        let header = match Header::new_checked(bytes) {
            Ok(h) => h,
            Err(e) => return self.drop_wire(&e),
        };
        if header.token() != self.local_token {
            self.stats.dropped.bad_token += 1;
            return;
        }
        let parsed = match placer {
            Some(_) => header.packet_type().and_then(|t| Parsed::parse(bytes, t)),
            None => match header.packet_type() {
                Ok(PacketType::Data) => DataPacket::new_checked_header(bytes).and_then(|p| DataRepr::parse(&p)).map(Parsed::Data),
                Ok(other) => Err(WireError::WrongType { expected: PacketType::Data as u8, got: other as u8 }),
                Err(e) => Err(e),
            },
        };
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) => return self.drop_wire(&e),
        };
        match &mut self.life {
            Life::Open => {}
            Life::Closed { close_due, last_close_at } => {
                self.stats.dropped.after_close += 1;
                let is_close = matches!(&parsed, Parsed::Control(c) if c.kind == ControlKind::Close);
                if !is_close && last_close_at.map_or(0, |t| t.saturating_add(self.cfg.rto_min_us)) <= now {
                    *close_due = true;
                }
                return;
            }
            Life::Dead(_) => {
                self.stats.dropped.after_close += 1;
                return;
            }
        }
        if !self.is_consistent(&parsed) {
            self.stats.dropped.malformed += 1;
            return;
        }
        self.last_heard = now;
        self.tx.peer_heard(now);
        self.on_cts_ack(parsed.cts_ack(), now);
        match parsed {
            Parsed::Data(d) => match placer {
                Some(placer) => {
                    let pkt = DataPacket::new_unchecked(bytes);
                    self.on_data(&d, Some(pkt.payload()), now, placer, false);
                }
                None => self.on_data(&d, None, now, &mut super::NoPlacement, echo_psn),
            },
            Parsed::Cts(c) => self.on_cts(&c),
            Parsed::Sack(s) => self.on_sack(&s, now),
            Parsed::Control(c) => self.on_control(&c, now),
        }
        self.flush_feedback();
        self.update_work(now);
    }

    fn drop_wire(&mut self, e: &WireError) {
        tracing::trace!("datagram dropped: {e}");
        self.stats.dropped.count(e);
    }

    /// Fields that refer to our own state (CTS we sent, PSNs we sent) must not point past it.
    fn is_consistent(&self, p: &Parsed) -> bool {
        if p.cts_ack() > self.rx.next_cts_seq() {
            return false;
        }
        match p {
            Parsed::Sack(s) => self.sack_is_consistent(s),
            Parsed::Control(c) => c.cum_psn <= self.tx.next_psn(),
            Parsed::Data(_) | Parsed::Cts(_) => true,
        }
    }

    fn on_control(&mut self, c: &ControlRepr, now: Micros) {
        self.stats.control_received += 1;
        self.on_cum_ack(c.cum_psn, now);
        match c.kind {
            ControlKind::Ack => {}
            ControlKind::Ping => {
                if let Some(due) = self.pong_due.iter_mut().find(|(e, _)| *e == c.entropy) {
                    due.1 = c.ts_us;
                } else if self.pong_due.len() < usize::from(self.cfg.n_paths) {
                    self.pong_due.push_back((c.entropy, c.ts_us));
                }
            }
            ControlKind::Pong => {
                let rtt = (now as u32).wrapping_sub(c.ts_us);
                if rtt <= i32::MAX as u32 {
                    self.ctl_rtt.sample(u64::from(rtt));
                }
                self.paths.pong(c.entropy, c.ts_us, now, &mut self.stats.paths);
            }
            ControlKind::Close => {
                tracing::debug!(peer = self.peer_token, "peer closed the connection");
                self.die(MsgError::PeerClosed);
            }
        }
    }

    /// Fail every outstanding request with `error` and stop.
    fn die(&mut self, error: MsgError) {
        for msg in self.tx.abandon().into_iter().chain(self.rx.abandon()) {
            self.completions.push_back(Completion::Failed { msg, error: error.clone() });
        }
        self.ping_due = false;
        self.pong_due.clear();
        self.paths.clear_in_flight(&mut self.stats.paths);
        self.clear_gates();
        self.work_since = None;
        self.life = match error {
            MsgError::Closed => Life::Closed { close_due: true, last_close_at: None },
            e => Life::Dead(e),
        };
    }

    /// When outstanding work times out for lack of any word from the peer.
    fn peer_deadline(&self) -> Option<(Micros, Micros)> {
        let since = self.work_since?;
        let base = since.max(self.last_heard);
        Some((base, base.saturating_add(self.cfg.peer_timeout_us)))
    }

    /// When outstanding work fails for lack of progress although the peer is heard, and why:
    /// (last progress, deadline, reason). The sender makes no progress while its oldest unacknowledged
    /// DATA packet stays so, the receiver while a receive that got part of its message gets no new
    /// DATA. Waiting for the peer to post (no CTS yet, no first packet yet) is not a stall. Armed only
    /// if the peer was heard since the last progress: a silent peer is the peer timeout's business.
    fn stall_deadline(&self) -> Option<(Micros, Micros, &'static str)> {
        self.work_since?;
        let tx = self.tx.unacked_since().map(|t| (t, "DATA sent to the peer stays unacknowledged"));
        let rx = self.rx.starved_since().map(|t| (t, "a receive got part of its message and no new data since"));
        let (base, reason) = match (tx, rx) {
            (Some(a), Some(b)) => {
                if b.0 < a.0 {
                    b
                } else {
                    a
                }
            }
            (a, b) => a.or(b)?,
        };
        (self.last_heard > base).then(|| (base, base.saturating_add(self.cfg.stall_timeout_us), reason))
    }

    fn keepalive_deadline(&self) -> Option<Micros> {
        let since = self.work_since?;
        let base = since.max(self.last_heard).max(self.last_ping_at.unwrap_or(0));
        Some(base.saturating_add(self.cfg.keepalive_us))
    }

    /// Probe timers of suspect and dead paths (see `paths.rs`); only while work is outstanding: an
    /// idle connection has no use for paths.
    fn path_timer_deadline(&self) -> Option<Micros> {
        self.work_since?;
        [self.paths.timer_deadline(self.ctl_rtt.rto_us()), self.paths.explore_deadline()].into_iter().flatten().min()
    }

    fn on_path_timers(&mut self, now: Micros) {
        if self.work_since.is_some() {
            self.paths.on_timers(now, self.ctl_rtt.rto_us(), self.last_heard, &mut self.stats.paths);
            self.paths.schedule_explore(now, self.explore_pace());
        }
    }

    /// Exploring PINGs during a failure episode: about sixteen per round trip while wanted.
    fn explore_pace(&self) -> Micros {
        self.ctl_rtt.srtt_us().unwrap_or(self.cfg.rto_min_us) / 16
    }

    /// Run every timer that expired by `now` (retransmission, delayed SACK, CTS, keepalive, path
    /// probes, peer timeout, stall watchdog). Calling it early is harmless.
    pub fn handle_timeout(&mut self, now: Micros) {
        let now = self.clock(now);
        if !matches!(self.life, Life::Open) {
            return;
        }
        if let Some((base, deadline)) = self.peer_deadline() {
            if now >= deadline {
                let silent_ms = (now - base) / 1000;
                tracing::warn!(peer = self.peer_token, silent_ms, "peer timed out with requests outstanding");
                self.die(MsgError::PeerTimeout { silent_ms });
                return;
            }
        }
        if let Some((base, deadline, reason)) = self.stall_deadline() {
            if now >= deadline {
                let stalled_ms = (now - base) / 1000;
                tracing::warn!(peer = self.peer_token, stalled_ms, reason, "no progress while the peer was alive");
                self.die(MsgError::Stalled { stalled_ms, reason });
                return;
            }
        }
        self.on_rto(now);
        if self.tx.rack_timer.is_some_and(|t| t <= now) {
            self.detect_losses(now);
        }
        self.on_tlp_timer(now);
        self.on_path_timers(now);
        self.on_sack_timer(now);
        self.on_cts_timers(now);
        if self.keepalive_deadline().is_some_and(|d| d <= now) {
            self.ping_due = true;
            self.last_ping_at = Some(now);
        }
        self.flush_feedback();
        self.update_work(now);
    }

    /// The next instant `handle_timeout` must run; `None` when nothing is pending (no work outstanding
    /// and no timer armed). While work is outstanding this is never `None` (the peer timeout is armed).
    ///
    /// Cheap enough for drivers with many connections (the fabric simulator): per-path retransmission
    /// deadlines are cached and only the paths that changed since the last call are looked at again,
    /// probe timers are looked at only while a path is suspect or dead, and CTS timers only among CTS
    /// not yet acknowledged.
    pub fn poll_timeout(&mut self) -> Option<Micros> {
        if !matches!(self.life, Life::Open) {
            return None;
        }
        [
            self.rto_deadline(),
            self.peer_deadline().map(|(_, d)| d),
            self.stall_deadline().map(|(_, d, _)| d),
            self.keepalive_deadline(),
            self.tx.rack_timer,
            self.tlp_deadline(),
            self.path_timer_deadline(),
            self.sack_deadline(),
            self.cts_deadline(),
            self.gates.deadline(self.now),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The next datagram to send, written into `out` (which should hold `max_payload +
    /// wire::MAX_HEADER_LEN` bytes). Call until it returns `None`. Control goes first, then
    /// retransmissions, then new data within the window.
    pub fn poll_transmit(&mut self, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Option<Transmit> {
        let now = self.clock(now);
        match self.life {
            Life::Open => {}
            Life::Closed { close_due: true, .. } => {
                let t = self.emit_control(ControlKind::Close, None, out)?;
                self.life = Life::Closed { close_due: false, last_close_at: Some(now) };
                return Some(t);
            }
            Life::Closed { .. } | Life::Dead(_) => return None,
        }
        if let Some(t) = self.poll_sack(out) {
            return Some(t);
        }
        if let Some(&(entropy, ts)) = self.pong_due.front() {
            let t = self.emit_control(ControlKind::Pong, Some((entropy % self.cfg.n_paths, entropy, ts)), out)?;
            self.pong_due.pop_front();
            return Some(t);
        }
        if self.paths.probe_pending() && out.len() >= crate::wire::CONTROL_LEN {
            if let Some(e) = self.paths.next_probe(now, &mut self.stats.paths) {
                return self.emit_control(ControlKind::Ping, Some((e, e, now as u32)), out);
            }
        }
        if self.work_since.is_some() && out.len() >= crate::wire::CONTROL_LEN {
            self.paths.schedule_explore(now, self.explore_pace());
            if let Some(e) = self.paths.next_explore(now, &mut self.stats.paths) {
                return self.emit_control(ControlKind::Ping, Some((e, e, now as u32)), out);
            }
        }
        if self.ping_due {
            let e = self.ctl_entropy();
            let t = self.emit_control(ControlKind::Ping, Some((e, e, now as u32)), out)?;
            self.ping_due = false;
            self.stats.keepalives_sent += 1;
            return Some(t);
        }
        if let Some(t) = self.poll_cts(now, out) {
            return Some(t);
        }
        if let Some(t) = self.poll_data(now, src, out) {
            return Some(t);
        }
        if self.tx.ack_pending {
            let t = self.emit_control(ControlKind::Ack, None, out)?;
            self.tx.ack_pending = false;
            return Some(t);
        }
        None
    }

    /// Whether [`Self::poll_transmit`] has nothing to send, now or at any later time, until this
    /// connection is next handed something (a datagram, a post, a timeout, a close, a window, a
    /// send's start times): nothing is queued (SACK, PONG, probe or exploring PING, keepalive, CTS,
    /// ACK, tail-loss probe, retransmission, new data) and no failure episode may queue an exploring
    /// PING. Reads only a few flags and queue lengths, so a driver with many connections can ask it
    /// while the connection is in its cache and skip a connection with nothing to send in its
    /// transmit round-robin (a receiver between its delayed SACKs), instead of a `poll_transmit` that
    /// finds nothing later. `false` means only that there may be something to send.
    pub fn transmit_idle(&self) -> bool {
        matches!(self.life, Life::Open)
            && !self.rx.sack_due()
            && self.pong_due.is_empty()
            && !self.paths.probe_pending()
            && (self.work_since.is_none() || self.paths.explore_idle())
            && !self.ping_due
            && !self.rx.cts_pending()
            && !self.tx.tlp_due
            && self.tx.retx_queue.is_empty()
            && self.gates.parked.is_none()
            && !self.tx.new_data_queued()
            && !self.tx.ack_pending
    }

    /// Write a CONTROL packet; `route` is (path to send on, entropy field, timestamp field).
    fn emit_control(&mut self, kind: ControlKind, route: Option<(u16, u16, u32)>, out: &mut [u8]) -> Option<Transmit> {
        let (path, entropy, ts_us) = match route {
            Some(r) => r,
            None => {
                let e = self.ctl_entropy();
                (e, e, 0)
            }
        };
        let repr = ControlRepr { token: self.peer_token, cts_ack: self.tx.cts_next, kind, entropy, ts_us, cum_psn: self.rx.window.cum() };
        if out.len() < repr.buffer_len() {
            tracing::warn!(buffer = out.len(), need = repr.buffer_len(), "transmit buffer too small for a control packet");
            return None;
        }
        repr.emit(&mut ControlPacket::new_unchecked(&mut out[..repr.buffer_len()]));
        self.stats.control_sent += 1;
        self.tx.ack_pending = false;
        Some(Transmit { entropy: path, len: repr.buffer_len() })
    }

    /// Round-robin over the fittest paths, so control traffic is not stuck on a broken one.
    pub(super) fn ctl_entropy(&mut self) -> u16 {
        self.paths.ctl_entropy()
    }

    /// The next finished request, if any.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }

    /// Close this end: a CLOSE goes to the peer, outstanding requests fail `Closed`, later posts fail.
    pub fn close(&mut self, now: Micros) {
        self.clock(now);
        if matches!(self.life, Life::Open) {
            self.die(MsgError::Closed);
        }
    }

    /// Change how many DATA packets may be in flight (a rate controller's window); at least 1.
    pub fn set_window_pkts(&mut self, n: u32) {
        self.cfg.window_pkts = n.max(1);
    }

    /// Whether the sender may still send DATA into the receive buffers of CTS `cts_seq`: its group
    /// waits for sends to match (a grouped receive's other tags), or a matched send into it is not
    /// fully sent, or a packet of it is unacknowledged (a retransmission needs its buffer too). The
    /// verbs sender keeps the addresses and keys of such a CTS: dropping them by age alone hung a
    /// grouped receive whose second tag came after 1,024 other receives.
    pub fn cts_in_use(&self, cts_seq: u64) -> bool {
        self.tx.cts_in_use(cts_seq) || self.gates.parked.as_ref().is_some_and(|(p, _)| p.cts_seq == cts_seq)
    }

    /// Payload bytes of this connection's DATA packets (every one but a buffer's last).
    pub fn max_payload(&self) -> usize {
        self.cfg.max_payload
    }

    /// The current in-flight window, in DATA packets.
    pub fn window_pkts(&self) -> u32 {
        self.cfg.window_pkts
    }

    /// Counters (serializable).
    pub fn stats(&self) -> &ConnStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_lb::path::Spray;

    fn conn() -> Connection {
        Connection::new(ProtoConfig::default(), 1, 2, Box::new(Spray::new(3)), 1_000)
    }

    #[test]
    fn connection_can_move_to_another_thread() {
        fn is_send<T: Send>() {}
        is_send::<Connection>();
    }

    #[test]
    fn idle_connection_arms_no_timer_and_sends_nothing() {
        let mut c = conn();
        assert_eq!(c.poll_timeout(), None);
        assert_eq!(c.poll_transmit(2_000, &mut NoPayload, &mut [0u8; 256]), None);
    }

    struct NoPayload;
    impl PayloadSource for NoPayload {
        fn read(&mut self, _: MsgId, _: u64, _: &mut [u8]) {
            panic!("nothing to read")
        }
    }

    fn ping(entropy: u16, ts_us: u32) -> ControlRepr {
        ControlRepr { token: 1, cts_ack: 0, kind: ControlKind::Ping, entropy, ts_us, cum_psn: 0 }
    }

    /// Every PONG `c` sends now: (path, entropy echoed, timestamp echoed).
    fn pongs(c: &mut Connection, now: Micros) -> Vec<(u16, u16, u32)> {
        let mut out = Vec::new();
        let mut buf = [0u8; 256];
        while let Some(t) = c.poll_transmit(now, &mut NoPayload, &mut buf) {
            let r = ControlRepr::parse(&ControlPacket::new_checked(&buf[..t.len]).unwrap()).unwrap();
            assert_eq!(r.kind, ControlKind::Pong);
            out.push((t.entropy, r.entropy, r.ts_us));
        }
        out
    }

    #[test]
    fn a_burst_of_pings_is_answered_in_full_one_pong_per_entropy() {
        // A failure ends and the peer probes every path it had given up at once: each PING gets its
        // PONG on its own path, not just the last one to arrive.
        let mut c = conn();
        for e in 0..16 {
            c.on_control(&ping(e, 100 + u32::from(e)), 2_000);
        }
        // A second PING on a path whose PONG has not left yet: one PONG, with the newer timestamp.
        c.on_control(&ping(3, 999), 2_000);
        let got = pongs(&mut c, 2_000);
        let want: Vec<_> = (0..16).map(|e| (e, e, if e == 3 { 999 } else { 100 + u32::from(e) })).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn pings_cannot_grow_the_pong_queue_past_the_paths() {
        let mut c = conn();
        let n = ProtoConfig::default().n_paths;
        for e in 0..u16::MAX {
            c.on_control(&ping(e, 1), 2_000);
        }
        assert_eq!(c.pong_due.len(), usize::from(n));
        let got = pongs(&mut c, 2_000);
        assert_eq!(got.len(), usize::from(n));
        assert!(got.iter().all(|&(path, e, _)| path == e % n), "{got:?}");
    }

    #[test]
    fn a_path_timer_is_judged_by_the_connections_rto_when_it_fires_not_when_its_packet_left() {
        // Path 5's packet left at 0 with the 20 ms floor, before the connection had measured anything;
        // by 21 ms the connection measured RTTs that give a 60 ms RTO (the rail fabric's queues): the
        // timer waits for that, and fires only once it has passed.
        let cfg = ProtoConfig { rto_min_us: 20_000, rto_initial_us: 20_000, ..ProtoConfig::default() };
        let mut c = Connection::new(cfg, 1, 2, Box::new(Spray::new(3)), 0);
        let p = c.paths.get_mut(5);
        p.queue.push_back(crate::proto::path::TxEntry { tx_seq: 0, psn: 0, sent_at: 0 });
        p.rto_floor_us = 20_000;
        assert_eq!(c.paths.get(5).rto_deadline(), Some(20_000));
        c.ctl_rtt.sample(20_000);
        assert_eq!(c.ctl_rtt.rto_us(), 60_000);
        c.on_rto(21_000);
        assert_eq!(c.stats.timeouts, 0, "timed out at 21 ms with the connection's RTO at 60 ms");
        assert_eq!(c.paths.get(5).rto_deadline(), Some(60_000));
        assert_eq!(c.rto_deadline(), Some(60_000));
        c.on_rto(60_000);
        assert_eq!(c.stats.timeouts, 1);
    }

    #[test]
    fn outstanding_work_always_arms_the_peer_timeout() {
        let mut c = conn();
        c.post_send(10, 0, 5_000).unwrap();
        let peer_deadline = 5_000 + ProtoConfig::default().peer_timeout_us;
        assert!(c.poll_timeout().is_some_and(|t| t <= peer_deadline));
        c.handle_timeout(peer_deadline);
        assert!(matches!(c.poll_completion(), Some(Completion::Failed { error: MsgError::PeerTimeout { silent_ms: 10_000 }, .. })));
        assert_eq!(c.poll_timeout(), None);
    }
}
