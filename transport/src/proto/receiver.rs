//! The receiving half of a connection: grouped receives and their (reliable) CTS, DATA validation and
//! placement, the out-of-order window and SACK generation.

use std::collections::VecDeque;

use smallvec::SmallVec;

use super::connection::Connection;
use super::window::{Arrival, PsnWindow};
use super::{Completion, Micros, MsgError, MsgId, Placer, RecvSpec, Transmit};
use crate::wire::sack::ECHO_BY_PSN;
use crate::wire::{CtsBuf, CtsPacket, CtsRepr, DataRepr, SackPacket, SackRepr, LINE_BYTES, MAX_RECV_BUFS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SubEnd {
    Open,
    Done,
    Truncated { send_len: u64 },
}

/// The byte ranges of one buffer that arrived (start to end), disjoint and merged. An honest sender
/// sends every byte of a message under one PSN only (a retransmission reuses the PSN), so DATA that
/// overlaps bytes already received is forged or corrupted: counting it would let a message complete
/// with a hole, and the real packet's PSN would then be refused forever.
///
/// Sorted by start, the first few held inline: a message arriving in order is one range, one arriving
/// over sprayed paths a handful, so a DATA packet does not follow a pointer to a tree node of its own.
#[derive(Debug, Clone, Default)]
struct Ranges(SmallVec<[(u64, u64); 4]>);

impl Ranges {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        // The last range starting before `end` reaches past `start`.
        let i = self.0.partition_point(|r| r.0 < end);
        start < end && i > 0 && self.0[i - 1].1 > start
    }

    /// Add a range that `overlaps` said is new.
    fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let mut start = start;
        // A range ending where this one starts absorbs it.
        let i = self.0.partition_point(|r| r.0 <= start);
        if i > 0 && self.0[i - 1].1 == start {
            start = self.0[i - 1].0;
            self.0.remove(i - 1);
        }
        // So does one starting where it ends.
        let j = self.0.partition_point(|r| r.0 < end);
        let end = if self.0.get(j).is_some_and(|r| r.0 == end) { self.0.remove(j).1 } else { end };
        let k = self.0.partition_point(|r| r.0 < start);
        match self.0.get_mut(k) {
            Some(r) if r.0 == start => r.1 = end,
            _ => self.0.insert(k, (start, end)),
        }
    }
}

/// One buffer of a grouped receive.
#[derive(Debug, Clone)]
struct RecvSub {
    spec: RecvSpec,
    /// Length of the send that matched this buffer, learnt from its first packet.
    total: Option<u64>,
    /// Bytes received: the total length of `got`.
    received: u64,
    got: Ranges,
    end: SubEnd,
}

impl RecvSub {
    /// Its message began to arrive and has not finished: the sender is sending it now.
    fn started(&self) -> bool {
        self.total.is_some() && self.end == SubEnd::Open
    }
}

/// A posted grouped receive and the state of its CTS.
#[derive(Debug, Clone)]
struct RecvGroup {
    id: MsgId,
    seq: u64,
    subs: Vec<RecvSub>,
    cts_sent_at: Option<Micros>,
    cts_retries: u32,
    cts_queued: bool,
    /// Copies of the CTS just sent, each on another path, still to go.
    cts_copies_due: u8,
}

#[derive(Debug)]
pub(crate) struct RxState {
    next_cts_seq: u64,
    /// Outstanding grouped receives in CTS order.
    groups: VecDeque<RecvGroup>,
    /// Every CTS below this was acknowledged by the peer.
    cts_acked: u64,
    /// CTS to send (first copies and retransmissions).
    cts_queue: VecDeque<u64>,
    pub(crate) window: PsnWindow,
    sack_due: bool,
    sack_deadline: Option<Micros>,
    unsacked: u32,
    /// PSN, entropy and timestamp of the latest DATA packet, echoed by the next SACK.
    trigger: Option<(u64, u16, u32)>,
    congested: bool,
    /// The trigger was a retransmission of a packet that had arrived.
    spurious: bool,
    /// Buffers whose message began to arrive and has not finished.
    started_subs: usize,
    /// When DATA was last accepted into a receive.
    data_at: Micros,
    /// The entropy that DATA came in on (see `Connection::reply_entropy`).
    data_entropy: Option<u16>,
    /// Doublings of the CTS timeout that carry over to every CTS until one sent once is acknowledged
    /// (RFC 6298 5.5 and 5.7, across CTS: see `Connection::cts_backoff`).
    cts_shift: u32,
}

impl RxState {
    pub(crate) fn new() -> Self {
        Self {
            next_cts_seq: 0,
            groups: VecDeque::new(),
            cts_acked: 0,
            cts_queue: VecDeque::new(),
            window: PsnWindow::new(),
            sack_due: false,
            sack_deadline: None,
            unsacked: 0,
            trigger: None,
            congested: false,
            spurious: false,
            started_subs: 0,
            data_at: 0,
            data_entropy: None,
            cts_shift: 0,
        }
    }

    /// Since when a receive that got part of its message has had no new DATA (None: no message is
    /// half received). The stall watchdog's receive-side measure of progress.
    pub(crate) fn starved_since(&self) -> Option<Micros> {
        (self.started_subs > 0).then_some(self.data_at)
    }

    /// A SACK is due now.
    pub(crate) fn sack_due(&self) -> bool {
        self.sack_due
    }

    /// CTS wait to be sent (first copies, second copies or retransmissions).
    pub(crate) fn cts_pending(&self) -> bool {
        !self.cts_queue.is_empty()
    }

    /// Grouped receives posted and not completed.
    pub(crate) fn open_recvs(&self) -> usize {
        self.groups.len()
    }

    /// Forget outstanding receives (the connection died); returns their ids.
    pub(crate) fn abandon(&mut self) -> Vec<MsgId> {
        self.cts_queue.clear();
        self.sack_due = false;
        self.sack_deadline = None;
        self.started_subs = 0;
        self.groups.drain(..).map(|g| g.id).collect()
    }

    /// Every sequence number a CTS went out with is below this.
    pub(crate) fn next_cts_seq(&self) -> u64 {
        self.next_cts_seq
    }

    /// The index of the group with CTS sequence number `seq`. Sequence numbers are unique and
    /// increasing, and groups usually complete in order, so `seq - first seq` is tried before a
    /// binary search (which reads several groups of a cold deque).
    fn group_index(&self, seq: u64) -> Option<usize> {
        let guess = seq.wrapping_sub(self.groups.front()?.seq);
        if self.groups.get(usize::try_from(guess).ok()?).is_some_and(|g| g.seq == seq) {
            return Some(guess as usize);
        }
        self.groups.binary_search_by_key(&seq, |g| g.seq).ok()
    }

    /// The index of the first group whose CTS is not acknowledged (`groups.len()` if none): the
    /// partition point of `seq < cts_acked`, found without a binary search when every group or none
    /// is acknowledged (the usual cases).
    fn first_unacked_group(&self) -> usize {
        match (self.groups.front(), self.groups.back()) {
            (Some(f), _) if f.seq >= self.cts_acked => 0,
            (_, Some(b)) if b.seq < self.cts_acked => self.groups.len(),
            _ => self.groups.partition_point(|g| g.seq < self.cts_acked),
        }
    }
}

impl Connection {
    /// Register a grouped receive and queue its CTS.
    pub(super) fn queue_recv(&mut self, id: MsgId, bufs: &[RecvSpec]) {
        let rx = &mut self.rx;
        let seq = rx.next_cts_seq;
        rx.next_cts_seq += 1;
        let subs = bufs.iter().map(|&spec| RecvSub { spec, total: None, received: 0, got: Ranges::default(), end: SubEnd::Open }).collect();
        rx.groups.push_back(RecvGroup { id, seq, subs, cts_sent_at: None, cts_retries: 0, cts_queued: true, cts_copies_due: 0 });
        rx.cts_queue.push_back(seq);
    }

    /// The peer acknowledged every CTS below `ack` (from any packet's header). Takes RTT samples from
    /// CTS that were sent once (Karn's rule). The caller checked `ack <= next_cts_seq`.
    pub(super) fn on_cts_ack(&mut self, ack: u64, now: Micros) {
        let rx = &mut self.rx;
        if ack <= rx.cts_acked {
            return;
        }
        for g in rx.groups.iter().filter(|g| g.seq >= rx.cts_acked && g.seq < ack) {
            if let (0, Some(at)) = (g.cts_retries, g.cts_sent_at) {
                self.ctl_rtt.sample(now.saturating_sub(at));
                rx.cts_shift = 0;
            }
        }
        rx.cts_acked = ack;
    }

    /// Earliest CTS retransmission, looking only at groups from the first unacknowledged CTS on
    /// (groups are in CTS order, and acknowledged ones never time out).
    pub(super) fn cts_deadline(&self) -> Option<Micros> {
        let rto = self.cts_timeout();
        let first = self.rx.first_unacked_group();
        self.rx.groups.range(first..).filter(|g| !g.cts_queued).filter_map(|g| self.cts_due(g, rto)).min()
    }

    /// How long a CTS waits for its acknowledgement before it is sent again: the sender acknowledges
    /// every CTS at once (in the header of its next packet, or a bare ACK), whether or not a send
    /// matches it, so two smoothed RTTs of CTS and acknowledgement (the tail-loss probe's timeout),
    /// plus the SACK delay for an acknowledgement that waits behind data, and never more than the
    /// RTO. Both copies of a CTS were lost in bench-loss's 5 % loss about once every 400 receives,
    /// and each such loss cost the whole RTO (at least `PRISM_RTO_MIN_US`) before.
    /// Over reliable paths (`reliable_paths`) a CTS is lost only with its path, and the
    /// acknowledgement may wait behind the data queued on the sender's path: the RTO, which the
    /// data's own round trips (that queue included) set.
    fn cts_timeout(&self) -> u64 {
        let rto = self.ctl_rtt.rto_us();
        if self.cfg.reliable_paths {
            return rto;
        }
        match self.ctl_rtt.srtt_us() {
            Some(srtt) => (2 * srtt + self.cfg.sack_delay_us).clamp(1, rto),
            None => rto,
        }
    }

    /// When group `g`'s CTS, if sent, is due again: its send time plus the timeout `rto` backed off
    /// by [`Self::cts_backoff`].
    fn cts_due(&self, g: &RecvGroup, rto: u64) -> Option<Micros> {
        g.cts_sent_at.map(|at| at.saturating_add(self.cts_backoff(rto, g.cts_retries.max(self.rx.cts_shift))))
    }

    /// The timeout `rto` doubled `retries` times (the caller passes the larger of the CTS's own
    /// retransmissions and `cts_shift`), at most `rto_max_us`.
    ///
    /// The backoff carries over to the next CTS (`cts_shift`) until a CTS sent once is acknowledged,
    /// as RFC 6298 keeps a backed-off RTO for new segments until a valid sample (Karn's rule takes
    /// none from a retransmitted CTS). A receiving comm sends no DATA, so its connection RTT comes
    /// from CTS round trips alone: one estimate taken while the fabric was idle gave every later CTS
    /// a timeout far below the loaded round trip, each was sent again, none of them could be sampled,
    /// and the estimate never caught up. On the rail fabric's fault-free alltoall 28-167 of 192 CTS
    /// went out again per policy run (12 runs; 12-80 with this).
    fn cts_backoff(&self, rto: u64, retries: u32) -> u64 {
        rto.saturating_mul(1 << retries.min(16)).min(self.cfg.rto_max_us)
    }

    /// Queue every CTS whose timer expired for retransmission.
    pub(super) fn on_cts_timers(&mut self, now: Micros) {
        let rto = self.cts_timeout();
        // Groups are in CTS order and acknowledged ones never expire: start at the first unacknowledged.
        let first = self.rx.first_unacked_group();
        for i in first..self.rx.groups.len() {
            let g = &self.rx.groups[i];
            let expired = g.seq >= self.rx.cts_acked && !g.cts_queued && self.cts_due(g, rto).is_some_and(|due| due <= now);
            if expired {
                let g = &mut self.rx.groups[i];
                g.cts_queued = true;
                self.rx.cts_queue.push_back(g.seq);
                self.rx.cts_shift = self.rx.cts_shift.max(g.cts_retries + 1).min(16);
            }
        }
    }

    /// The next CTS to send, if any.
    pub(super) fn poll_cts(&mut self, now: Micros, out: &mut [u8]) -> Option<Transmit> {
        let gi = loop {
            let &seq = self.rx.cts_queue.front()?;
            match self.rx.group_index(seq) {
                Some(i) if seq >= self.rx.cts_acked => break i,
                Some(i) => {
                    self.rx.groups[i].cts_queued = false;
                    self.rx.groups[i].cts_copies_due = 0;
                    self.rx.cts_queue.pop_front();
                }
                None => {
                    self.rx.cts_queue.pop_front();
                }
            }
        };
        let g = &self.rx.groups[gi];
        let mut bufs = [CtsBuf::default(); MAX_RECV_BUFS];
        for (b, s) in bufs.iter_mut().zip(&g.subs) {
            *b = CtsBuf { size: s.spec.len, tag: s.spec.tag };
        }
        let repr = CtsRepr::new(self.peer_token, self.tx.cts_next, g.seq, &bufs[..g.subs.len()]).ok()?;
        if out.len() < repr.buffer_len() {
            tracing::warn!(buffer = out.len(), need = repr.buffer_len(), "transmit buffer too small for a CTS");
            return None;
        }
        repr.emit(&mut CtsPacket::new_unchecked(&mut out[..repr.buffer_len()]));
        // Every CTS goes out twice, on two paths (`ctl_entropy` rotates): a lost CTS costs a whole
        // retransmission timeout, and before the first RTT sample that is the initial RTO, far
        // above the round trip. With a failed link on 1 % of a fabric's paths, one receive in
        // twenty-odd lost its first CTS and finished an initial RTO late (the simulator's seed-000
        // failure runs); a second copy is one small packet per posted receive. Until the
        // connection has an RTT sample (its first receives), three times: both copies of one
        // receive's CTS still went into failed links in 1-2 of 16 such runs (p squared per receive,
        // over 128 receives), and each such run took the initial RTO longer (6x its CCT).
        let extra: u8 = if self.cfg.n_paths <= 1 || self.cfg.reliable_paths {
            0
        } else if self.ctl_rtt.srtt_us().is_none() && self.cfg.n_paths > 2 {
            2
        } else {
            1
        };
        let g = &mut self.rx.groups[gi];
        let copy = g.cts_copies_due > 0;
        if copy {
            g.cts_copies_due -= 1;
            self.stats.cts_copies += 1;
        } else {
            if g.cts_sent_at.is_some() {
                g.cts_retries += 1;
                self.stats.cts_retransmitted += 1;
            } else {
                self.stats.cts_sent += 1;
            }
            g.cts_copies_due = extra;
        }
        g.cts_sent_at = Some(now);
        if g.cts_copies_due == 0 {
            g.cts_queued = false;
            self.rx.cts_queue.pop_front();
        }
        self.tx.ack_pending = false;
        // The first copy goes back along the path the latest DATA came in on, when that was recent:
        // it works, as far as anybody knows, while this end (which only receives) cannot tell its
        // own paths apart. The other copies rotate, as before any DATA came: with a whole rail
        // failing (a NIC or its link dead: half the entropies, with two rails) both copies often
        // went into it, and each receive waited for its CTS to be resent.
        let entropy = match (copy, self.reply_entropy(now)) {
            (false, Some(e)) => e,
            _ => self.ctl_entropy(),
        };
        Some(Transmit { entropy, len: repr.buffer_len() })
    }

    /// The entropy the latest DATA came in on, if that was less than an RTO ago and this end does not
    /// know that path to be unfit (a connection that also sends, or a driver's hint).
    fn reply_entropy(&self, now: Micros) -> Option<u16> {
        let e = self.rx.data_entropy?;
        let recent = now.saturating_sub(self.rx.data_at) < self.ctl_rtt.rto_us();
        (recent && self.path_preferred(e)).then_some(e)
    }

    /// A checked DATA packet arrived: dedup by PSN, validate against the posted buffer, place, ack.
    /// `payload` None: the payload is already in the buffer (RDMA WRITE); only the header counts.
    /// `echo_psn`: the header was rebuilt by the verbs backend without a send timestamp; the SACK it
    /// triggers echoes its PSN instead (`wire::sack::FLAG_ECHO_PSN`).
    pub(super) fn on_data(&mut self, d: &DataRepr, payload: Option<&[u8]>, now: Micros, placer: &mut dyn Placer, echo_psn: bool) {
        let (echo_entropy, echo_ts) = if echo_psn { (d.entropy | ECHO_BY_PSN, d.psn as u32) } else { (d.entropy, d.ts_us) };
        self.stats.data_pkts_received += 1;
        match self.rx.window.classify(d.psn) {
            Arrival::Duplicate => {
                self.stats.duplicates += 1;
                // The sender resent something we have: its view is stale, so tell it now, and tell it
                // the resend was needless (its reorder threshold is too tight) unless the network
                // merely duplicated an original.
                self.rx.trigger = Some((d.psn, echo_entropy, echo_ts));
                self.rx.spurious = d.retx;
                self.rx.sack_due = true;
                return;
            }
            Arrival::BeyondWindow => {
                self.stats.dropped.beyond_window += 1;
                self.rx.sack_due = true;
                return;
            }
            Arrival::New => {}
        }
        let completions = self.completions.len();
        let Some(ended_msg) = self.accept_data(d, payload, placer) else {
            return;
        };
        self.rx.data_at = now;
        self.rx.data_entropy = Some(d.entropy % self.cfg.n_paths.max(1));
        let end_before = self.rx.window.end();
        self.rx.window.insert(d.psn);
        let rx = &mut self.rx;
        rx.trigger = Some((d.psn, echo_entropy, echo_ts));
        rx.spurious = false;
        rx.congested |= d.ce;
        rx.unsacked += 1;
        // A new hole or a filled one changes what the sender must retransmit: report at once
        // (unless holes are normal here, `reliable_paths`). So does the packet that completes a
        // message or a receive: a send completes only when acknowledged, and nothing after it may
        // come to trigger a SACK (a one-packet message waited out the delay, on a driver that
        // progresses an idle comm only now and then up to a millisecond). On lossy paths also a
        // message's last packet when earlier ones are missing (they may be lost at the tail); over
        // reliable paths they are on their way on other paths, and acknowledging both the last
        // packet and the one that completes the message made two SACKs of most 512 KiB receives.
        let reordered = !self.cfg.reliable_paths && d.psn != end_before;
        let last = !self.cfg.reliable_paths && d.offset.saturating_add(u64::from(d.len)) >= d.total_len;
        let tail = ended_msg || last || self.completions.len() > completions;
        if reordered || tail || rx.unsacked >= self.cfg.sack_every_pkts {
            rx.sack_due = true;
        } else if rx.sack_deadline.is_none() {
            // Over reliable paths a SACK releases window and gives an RTT sample, nothing more
            // urgent (the last packet of a receive is acknowledged at once): wait up to a round
            // trip for `sack_every_pkts` packets, half of one when the window holds fewer than two
            // such batches (then the window, not the count, may be what stops the sender). On a
            // slow link (Soft-RoCE in a VM: a 64 KiB packet every 2.5 ms) the fixed delay
            // acknowledged every packet, and half an SRTT (47 ms there, a 512 KiB receive taking
            // 25 ms) added a SACK to nearly every receive: 2.2 per receive, 4.4 WQEs per MiB. The
            // sample stays honest: the SACK echoes the latest packet.
            let delay = match self.ctl_rtt.srtt_us() {
                Some(srtt) if self.cfg.reliable_paths => {
                    let ample = self.cfg.window_pkts >= 2 * self.cfg.sack_every_pkts;
                    self.cfg.sack_delay_us.max(if ample { srtt } else { srtt / 2 })
                }
                _ => self.cfg.sack_delay_us,
            };
            rx.sack_deadline = Some(now.saturating_add(delay));
        }
    }

    /// Validate a new DATA packet against its receive and place its payload: whether it ended its
    /// message (its last missing byte, or a truncation). None: dropped and counted, PSN not marked
    /// (a correct sender never sends such a packet).
    fn accept_data(&mut self, d: &DataRepr, payload: Option<&[u8]>, placer: &mut dyn Placer) -> Option<bool> {
        let Some(gi) = self.rx.group_index(d.cts_seq) else {
            self.stats.dropped.unknown_msg += 1;
            tracing::debug!(cts_seq = d.cts_seq, psn = d.psn, "DATA for a receive that is not outstanding");
            return None;
        };
        let group = &mut self.rx.groups[gi];
        let Some(sub) = group.subs.get_mut(d.sub as usize) else {
            self.stats.dropped.bad_offset_len += 1;
            return None;
        };
        if sub.end != SubEnd::Open {
            self.stats.dropped.unknown_msg += 1;
            return None;
        }
        let was_started = sub.started();
        let size = sub.spec.len;
        if d.trunc {
            if d.total_len <= size {
                self.stats.dropped.malformed += 1;
                return None;
            }
            sub.end = SubEnd::Truncated { send_len: d.total_len };
        } else {
            let end = d.offset + u64::from(d.len);
            let consistent = sub.total.unwrap_or(d.total_len) == d.total_len;
            let fits = d.total_len <= size && end <= d.total_len && sub.received + u64::from(d.len) <= d.total_len;
            let len_ok = !matches!(payload, Some(p) if p.len() != d.len as usize);
            // No packet boundary inside a 128-byte line (NCCL's LL/LL128): a packet starts on a line,
            // and only the one that ends the message may end inside one. A conforming sender never
            // breaks this (`transmit.rs`); DATA that does is refused like any DATA that does not fit.
            let line = LINE_BYTES as u64;
            let lines_ok = d.offset.is_multiple_of(line) && (end == d.total_len || u64::from(d.len).is_multiple_of(line));
            if !consistent || !fits || !len_ok || !lines_ok {
                self.stats.dropped.bad_offset_len += 1;
                tracing::debug!(offset = d.offset, len = d.len, total = d.total_len, posted = size, "DATA outside the posted buffer");
                return None;
            }
            if sub.got.overlaps(d.offset, end) {
                self.stats.dropped.overlapping += 1;
                tracing::debug!(psn = d.psn, offset = d.offset, len = d.len, "DATA overlaps bytes already received: forged or corrupted");
                return None;
            }
            if let Some(p) = payload.filter(|p| !p.is_empty()) {
                placer.place(group.id, d.sub as usize, d.offset, p);
            }
            self.stats.data_bytes_placed += u64::from(d.len);
            sub.total = Some(d.total_len);
            sub.received += u64::from(d.len);
            sub.got.insert(d.offset, end);
            if sub.received == d.total_len {
                sub.end = SubEnd::Done;
            }
        }
        match (was_started, sub.started()) {
            (false, true) => self.rx.started_subs += 1,
            (true, false) => self.rx.started_subs -= 1,
            _ => {}
        }
        let ended = sub.end != SubEnd::Open;
        if ended && group.subs.iter().all(|s| s.end != SubEnd::Open) {
            let group = self.rx.groups.remove(gi).expect("index from group_index");
            let truncated = group.subs.iter().find_map(|s| match s.end {
                SubEnd::Truncated { send_len } => Some(MsgError::Truncated { send_len, recv_len: s.spec.len }),
                _ => None,
            });
            self.completions.push_back(match truncated {
                Some(error) => Completion::Failed { msg: group.id, error },
                None => Completion::Received { msg: group.id, sizes: group.subs.iter().map(|s| s.total.unwrap_or(0)).collect() },
            });
        }
        Some(ended)
    }

    /// When the delayed SACK is due.
    pub(super) fn sack_deadline(&self) -> Option<Micros> {
        self.rx.sack_deadline
    }

    /// The delayed-SACK timer.
    pub(super) fn on_sack_timer(&mut self, now: Micros) {
        if self.rx.sack_deadline.is_some_and(|d| d <= now) {
            self.rx.sack_due = true;
            self.rx.sack_deadline = None;
        }
    }

    /// The SACK, if one is due.
    pub(super) fn poll_sack(&mut self, out: &mut [u8]) -> Option<Transmit> {
        let rx = &mut self.rx;
        if !rx.sack_due {
            return None;
        }
        let (trigger_psn, echo) = match rx.trigger {
            Some((psn, entropy, ts)) => (psn, Some((entropy, ts))),
            None => (rx.window.cum(), None),
        };
        let (base_psn, bitmap) = rx.window.sack_bitmap(trigger_psn);
        let repr = SackRepr {
            token: self.peer_token,
            cts_ack: self.tx.cts_next,
            cum_psn: rx.window.cum(),
            base_psn,
            bitmap,
            echo,
            congested: rx.congested,
            spurious: rx.spurious,
        };
        if out.len() < repr.buffer_len() {
            tracing::warn!(buffer = out.len(), need = repr.buffer_len(), "transmit buffer too small for a SACK");
            return None;
        }
        repr.emit(&mut SackPacket::new_unchecked(&mut out[..repr.buffer_len()]));
        rx.sack_due = false;
        rx.sack_deadline = None;
        rx.unsacked = 0;
        rx.congested = false;
        rx.spurious = false;
        self.stats.sacks_sent += 1;
        self.tx.ack_pending = false;
        // The triggering packet came in on its entropy, so that path works; answer along it, unless
        // this end knows better (the path is dead, or unproven during a failure episode: a connection
        // that also sends, or a driver's hint, learnt it; the way back may hash elsewhere).
        let entropy = match echo {
            Some((e, _)) if self.path_preferred((e & !ECHO_BY_PSN) % self.cfg.n_paths) => (e & !ECHO_BY_PSN) % self.cfg.n_paths,
            _ => self.ctl_entropy(),
        };
        Some(Transmit { entropy, len: repr.buffer_len() })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::Ranges;

    /// The ranges as a map from start to end, merged the way a tree of ranges merges them.
    fn reference_insert(m: &mut BTreeMap<u64, u64>, start: u64, end: u64) {
        let mut start = start;
        if let Some((&s, &e)) = m.range(..=start).next_back() {
            if e == start {
                m.remove(&s);
                start = s;
            }
        }
        let end = m.remove(&end).unwrap_or(end);
        m.insert(start, end);
    }

    /// Random packet-sized pieces of a buffer, in random order and some twice: every answer of
    /// `overlaps` and every set of ranges after an insert are those of a `BTreeMap` of ranges.
    #[test]
    fn ranges_follow_a_tree_of_ranges() {
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for round in 0..200 {
            let pieces = 1 + rand(40);
            let mut r = Ranges::default();
            let mut m = BTreeMap::new();
            for _ in 0..3 * pieces {
                let (start, end) = if rand(10) == 0 {
                    // Odd sizes and offsets, overlapping pieces included.
                    let s = rand(pieces * 4096);
                    (s, s + rand(9000))
                } else {
                    let p = rand(pieces);
                    (p * 4096, (p + 1) * 4096)
                };
                let overlaps = start < end && m.range(..end).next_back().is_some_and(|(_, &e)| e > start);
                assert_eq!(r.overlaps(start, end), overlaps, "round {round}: {start}..{end} in {m:?}");
                if !overlaps && start < end {
                    r.insert(start, end);
                    reference_insert(&mut m, start, end);
                }
                assert_eq!(r.0.iter().copied().collect::<Vec<_>>(), m.iter().map(|(&s, &e)| (s, e)).collect::<Vec<_>>(), "round {round}");
            }
        }
    }
}
