//! The sending half of a connection: matching sends to CTS groups, PSN bookkeeping, SACK processing,
//! loss detection (reorder threshold and per-path RTO) and selective retransmission on another path.

use std::collections::{BTreeMap, VecDeque};

use prism_lb::{Feedback, PathCtx};

use super::connection::Connection;
use super::path::TxEntry;
use super::stats::PathHealth;
use super::{Completion, Micros, MsgError, MsgId, PayloadSource, Transmit, MAX_OUTSTANDING_RECVS, OOO_WINDOW_PKTS};
use crate::wire::{CtsBuf, CtsRepr, DataPacket, DataRepr, SackRepr, DATA_HEADER_LEN, MAX_RECV_BUFS};

/// An RTT this far above the path's base RTT (in addition to doubling it) counts as congestion when
/// the receiver did not report any: the delay-based verdict REPS needs on networks without ECN.
const DELAY_CONGESTION_SLACK_US: u64 = 50;

/// Consecutive losses on one path (a timeout counts as one, a loss later found spurious is taken
/// back), with nothing sent on it after them delivered in between, that mark it dead even without
/// `path_dead_after` timeouts: while the other paths keep acknowledging, a black-holed path's packets
/// are all found lost by the reorder threshold and its RTO never fires.
///
/// Two, because a connection spraying over many entropies puts only a few packets on each one: with
/// 128 entropies per rail and a few hundred packets per connection and second (a 100 Mbit/s fabric),
/// a run of 8 took seconds to build up on any one path and a black-holed path was never left. Under 1%
/// random loss a healthy path dies this way once per 10^4 of its packets (and a probe revives it after
/// `path_revive_us`); a late packet that was only overtaken takes its loss back and revives the path.
const LOSS_RUN_DEAD: u32 = 2;

/// During a failure episode, fewer paths proven since it began than this: other live paths are used
/// too (explored), so the connection never squeezes itself onto one or two paths.
const MIN_PROVEN_PATHS: usize = 4;

/// CTS sequence numbers accepted ahead of the next expected one, and CTS groups held at most; a
/// receiver never has more than `MAX_OUTSTANDING_RECVS` receives posted, so anything further is bogus.
const CTS_AHEAD: u64 = 2 * MAX_OUTSTANDING_RECVS as u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PktState {
    InFlight,
    /// Declared lost, waiting in the retransmission queue.
    Lost,
    Sacked,
}

/// Everything needed to (re)send one PSN, so a retransmission never depends on the message still
/// being around (a truncation marker outlives its failed send).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SentPkt {
    msg: MsgId,
    cts_seq: u64,
    offset: u64,
    total: u64,
    len: u32,
    sub: u8,
    trunc: bool,
    state: PktState,
    entropy: u16,
    sent_at: Micros,
    tx_seq: u64,
    /// Sent more than once: an acknowledgement does not say which copy arrived.
    resent: bool,
}

/// A posted send that has not completed.
#[derive(Debug, Clone)]
pub(crate) struct SendMsg {
    id: MsgId,
    len: u64,
    tag: i32,
    matched: bool,
    all_sent: bool,
    unacked: u32,
}

/// A matched send (or a truncation marker) whose first transmission is not finished.
#[derive(Debug, Clone, Copy)]
struct TxItem {
    msg: MsgId,
    cts_seq: u64,
    sub: u8,
    total: u64,
    next_offset: u64,
    trunc: bool,
}

/// A CTS as the sender holds it until every buffer is matched.
#[derive(Debug, Clone, Copy)]
struct CtsGroup {
    seq: u64,
    n: u8,
    bufs: [CtsBuf; MAX_RECV_BUFS],
    matched: u8,
}

impl CtsGroup {
    /// The first buffer with `tag` not matched yet.
    fn free_buf(&self, tag: i32) -> Option<usize> {
        (0..self.n as usize).find(|&i| self.matched & (1 << i) == 0 && self.bufs[i].tag == tag)
    }
}

/// What `match_send` did with a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Matched {
    /// No held group has a free buffer with its tag: it waits.
    No,
    /// Matched; it stays in `sends` until acknowledged.
    Yes,
    /// Matched a buffer too small for it: it failed `Truncated` and left `sends`.
    Removed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LossCause {
    Reorder,
    Timeout,
    PathDead,
}

#[derive(Debug)]
pub(crate) struct TxState {
    next_psn: u64,
    /// Oldest PSN not yet acknowledged; `ring[i]` is PSN `snd_una + i`.
    snd_una: u64,
    /// When `snd_una` last moved, or the first packet went out with nothing unacknowledged: the
    /// stall watchdog's measure of progress.
    una_moved_at: Micros,
    ring: VecDeque<SentPkt>,
    next_tx_seq: u64,
    /// (tx_seq, psn) of every transmission in sending order, cleaned lazily; its front is the oldest
    /// transmission still in flight, the first candidate for reorder-threshold loss.
    tx_order: VecDeque<(u64, u64)>,
    /// One past the highest transmission sequence number acknowledged.
    acked_tx_end: u64,
    /// Send time of the newest transmission known to have arrived.
    acked_sent_at: Micros,
    /// A timeout fired while the peer was silent: a stall is going on.
    stalled: bool,
    /// Losses of packets sent before this instant (the end of the last stall) blame no path.
    exempt_before: Micros,
    retx_queue: VecDeque<u64>,
    in_flight: u32,
    sends: VecDeque<SendMsg>,
    /// Sends in `sends` not matched to a buffer yet.
    unmatched: usize,
    tx_queue: VecDeque<TxItem>,
    /// Every CTS below this was received (this is the `cts_ack` every outgoing packet carries).
    pub(crate) cts_next: u64,
    cts_ahead: BTreeMap<u64, CtsGroup>,
    groups: VecDeque<CtsGroup>,
    pub(crate) ack_pending: bool,
    reorder_threshold: u32,
    /// A path died since its packets in flight were last written off.
    path_died: bool,
    /// Paths currently dead.
    pub(crate) dead_paths: u32,
    /// A failure episode: since when (shortly before the first of the paths now dead died) only paths
    /// proven since then carry new packets. A failing spine or link takes many entropies at once, and a
    /// connection that sprays finds each of them only by losing packets on it; paths proven to work
    /// since the failure began are the safe ones. Ends when no path is dead any more.
    pub(crate) episode_since: Option<Micros>,
    /// Send time of the packet whose loss was last held against its path.
    blamed_sent_at: Option<Micros>,
    /// While no RTT is known: when the connection's RTO was last backed off (a timeout of a packet
    /// sent before that is part of the same round and does not back it off again).
    unsampled_backoff_at: Option<Micros>,
}

impl TxState {
    /// The peer was heard: a stall, if one was going on, ends now, and what was sent during it is
    /// not held against any path.
    pub(crate) fn peer_heard(&mut self, now: Micros) {
        if std::mem::take(&mut self.stalled) {
            self.exempt_before = now;
        }
    }

    pub(crate) fn new(reorder_threshold: u32) -> Self {
        Self {
            next_psn: 0,
            snd_una: 0,
            una_moved_at: 0,
            ring: VecDeque::new(),
            next_tx_seq: 0,
            tx_order: VecDeque::new(),
            acked_tx_end: 0,
            acked_sent_at: 0,
            stalled: false,
            exempt_before: 0,
            retx_queue: VecDeque::new(),
            in_flight: 0,
            sends: VecDeque::new(),
            unmatched: 0,
            tx_queue: VecDeque::new(),
            cts_next: 0,
            cts_ahead: BTreeMap::new(),
            groups: VecDeque::new(),
            ack_pending: false,
            reorder_threshold,
            path_died: false,
            dead_paths: 0,
            episode_since: None,
            blamed_sent_at: None,
            unsampled_backoff_at: None,
        }
    }

    /// Sends posted and not completed.
    pub(crate) fn open_sends(&self) -> usize {
        self.sends.len()
    }

    /// Anything left to send or to get acknowledged.
    pub(crate) fn busy(&self) -> bool {
        !self.sends.is_empty() || !self.tx_queue.is_empty() || self.snd_una < self.next_psn
    }

    /// Next PSN to be assigned (every PSN below was sent at least once).
    pub(crate) fn next_psn(&self) -> u64 {
        self.next_psn
    }

    /// Since when the oldest unacknowledged DATA packet has been waiting for its acknowledgement
    /// (None: everything sent was acknowledged). A send waiting for a CTS has nothing unacknowledged.
    pub(crate) fn unacked_since(&self) -> Option<Micros> {
        (self.snd_una < self.next_psn).then_some(self.una_moved_at)
    }

    /// Forget everything in flight (the connection died); returns the sends that were outstanding.
    pub(crate) fn abandon(&mut self) -> Vec<MsgId> {
        let ids = self.sends.iter().map(|s| s.id).collect();
        let cts_next = self.cts_next;
        *self = Self::new(self.reorder_threshold);
        self.cts_next = cts_next;
        ids
    }

    fn send_index(&self, id: MsgId) -> Option<usize> {
        self.sends.binary_search_by_key(&id, |s| s.id).ok()
    }

    fn is_live(&self, tx_seq: u64, psn: u64) -> bool {
        psn >= self.snd_una
            && self.ring.get((psn - self.snd_una) as usize).is_some_and(|r| r.state == PktState::InFlight && r.tx_seq == tx_seq)
    }
}

impl Connection {
    /// Queue a send; it goes out once a CTS buffer matches it.
    pub(super) fn queue_send(&mut self, id: MsgId, len: u64, tag: i32) {
        self.tx.sends.push_back(SendMsg { id, len, tag, matched: false, all_sent: false, unacked: 0 });
        self.tx.unmatched += 1;
        // Every older send still waiting waits for a tag no held group has a free buffer for (see
        // `match_send`), so only the new one can match now.
        self.match_send(self.tx.sends.len() - 1, 0);
    }

    /// A CTS arrived: hold it in sequence order and match waiting sends against it.
    pub(super) fn on_cts(&mut self, cts: &CtsRepr) {
        self.stats.cts_received += 1;
        let tx = &mut self.tx;
        if cts.cts_seq < tx.cts_next {
            // Our acknowledgement was lost; say it again.
            tx.ack_pending = true;
            return;
        }
        if cts.cts_seq - tx.cts_next >= CTS_AHEAD || tx.groups.len() + tx.cts_ahead.len() >= CTS_AHEAD as usize {
            self.stats.dropped.malformed += 1;
            tracing::debug!(seq = cts.cts_seq, expected = tx.cts_next, "CTS too far ahead, dropped");
            return;
        }
        tx.ack_pending = true;
        tx.cts_ahead.entry(cts.cts_seq).or_insert(CtsGroup { seq: cts.cts_seq, n: cts.n, bufs: cts.bufs, matched: 0 });
        let first_new = tx.cts_next;
        while let Some(g) = tx.cts_ahead.remove(&tx.cts_next) {
            tx.groups.push_back(g);
            tx.cts_next += 1;
        }
        if tx.cts_next > first_new {
            self.match_waiting(first_new);
        }
    }

    /// Match every waiting send, in posting order, against the groups from CTS `from_seq` on (the
    /// older groups have no free buffer with the tag of any waiting send: see `match_send`).
    fn match_waiting(&mut self, from_seq: u64) {
        let (mut si, mut left) = (0, self.tx.unmatched);
        while left > 0 && si < self.tx.sends.len() {
            if self.tx.sends[si].matched {
                si += 1;
                continue;
            }
            left -= 1;
            if self.match_send(si, from_seq) != Matched::Removed {
                si += 1;
            }
        }
    }

    /// NCCL's matching: send `si` goes into the first free buffer with its tag of the oldest held CTS
    /// group (from CTS `from_seq` on) that has one; a group is let go once all its buffers are matched.
    /// A send without such a buffer waits, and sends of other tags go on past it.
    ///
    /// Sends are matched in posting order and a buffer, once matched, stays so: per tag, sends fill the
    /// buffers of that tag in posting order, and while a send of tag t waits no held group has a free
    /// t buffer. That invariant is why a new send, or a new CTS, can be matched on its own.
    fn match_send(&mut self, si: usize, from_seq: u64) -> Matched {
        let tx = &mut self.tx;
        let tag = tx.sends[si].tag;
        let first = tx.groups.partition_point(|g| g.seq < from_seq);
        let found = tx.groups.range(first..).enumerate().find_map(|(i, g)| g.free_buf(tag).map(|b| (first + i, b)));
        let Some((gi, bi)) = found else { return Matched::No };
        let group = &mut tx.groups[gi];
        group.matched |= 1 << bi;
        let buf = group.bufs[bi];
        let cts_seq = group.seq;
        if group.matched.count_ones() == u32::from(group.n) {
            tx.groups.remove(gi);
        }
        tx.unmatched -= 1;
        let send = &mut tx.sends[si];
        send.matched = true;
        let (id, len) = (send.id, send.len);
        if len > buf.size {
            // The receiver learns of it from a payload-less TRUNC packet; the send fails now.
            tx.sends.remove(si);
            tx.tx_queue.push_back(TxItem { msg: id, cts_seq, sub: bi as u8, total: len, next_offset: 0, trunc: true });
            tracing::debug!(msg = id.0, send_len = len, recv_len = buf.size, "send larger than the matched receive");
            self.completions.push_back(Completion::Failed { msg: id, error: MsgError::Truncated { send_len: len, recv_len: buf.size } });
            Matched::Removed
        } else {
            tx.tx_queue.push_back(TxItem { msg: id, cts_seq, sub: bi as u8, total: len, next_offset: 0, trunc: false });
            Matched::Yes
        }
    }

    /// Check a SACK against what was sent before acting on any of it.
    pub(super) fn sack_is_consistent(&self, sack: &SackRepr) -> bool {
        if sack.cum_psn > self.tx.next_psn {
            return false;
        }
        let top = (0..4).rev().find(|&j| sack.bitmap[j] != 0).map(|j| 64 * j as u64 + 63 - u64::from(sack.bitmap[j].leading_zeros()));
        top.map_or(0, |t| sack.base_psn + t + 1) <= self.tx.next_psn
    }

    /// Apply a SACK (already checked with `sack_is_consistent`).
    pub(super) fn on_sack(&mut self, sack: &SackRepr, now: Micros) {
        self.stats.sacks_received += 1;
        if sack.spurious {
            self.stats.spurious_retransmissions += 1;
            Self::widen_reorder_threshold(&mut self.tx, &self.cfg, &mut self.stats);
        }
        let echo = sack.echo.and_then(|(entropy, ts)| self.echo_sample(entropy, ts, sack.congested, now));
        self.ack_through(sack.cum_psn, now, echo);
        for j in 0..4 {
            let mut word = sack.bitmap[j];
            while word != 0 {
                let psn = sack.base_psn + 64 * j as u64 + u64::from(word.trailing_zeros());
                word &= word - 1;
                if psn >= self.tx.snd_una {
                    self.mark_sacked(psn, now, echo);
                }
            }
        }
        self.after_acks(now);
    }

    /// Apply a bare cumulative acknowledgement (from a control packet).
    pub(super) fn on_cum_ack(&mut self, cum_psn: u64, now: Micros) {
        self.ack_through(cum_psn, now, None);
        self.after_acks(now);
    }

    fn ack_through(&mut self, cum_psn: u64, now: Micros, echo: Option<Echo>) {
        let mut psn = self.tx.snd_una;
        while psn < cum_psn {
            self.mark_sacked(psn, now, echo);
            psn += 1;
        }
    }

    /// An RTT sample from an echoed timestamp: exact for the path it names, whatever got retransmitted.
    fn echo_sample(&mut self, entropy: u16, ts_us: u32, congested: bool, now: Micros) -> Option<Echo> {
        let rtt = (now as u32).wrapping_sub(ts_us);
        if entropy >= self.cfg.n_paths || rtt > i32::MAX as u32 {
            return None;
        }
        self.rto_deadlines.touch(entropy);
        let path = &mut self.paths[entropy as usize];
        path.rtt.sample(u64::from(rtt));
        let base = *path.base_rtt_us.get_or_insert(rtt);
        path.base_rtt_us = Some(base.min(rtt));
        path.max_rtt_since_timeout_us = path.max_rtt_since_timeout_us.max(rtt);
        let ps = &mut self.stats.paths[entropy as usize];
        ps.record_rtt(u64::from(rtt));
        ps.srtt_us = path.rtt.srtt_us().unwrap_or(0);
        ps.rto_us = path.rtt.rto_us();
        self.ctl_rtt.sample(u64::from(rtt));
        let delayed = u64::from(rtt) > 2 * u64::from(base) + DELAY_CONGESTION_SLACK_US;
        Some(Echo { entropy, ts_us, rtt_us: rtt, congested: congested || delayed })
    }

    fn mark_sacked(&mut self, psn: u64, now: Micros, echo: Option<Echo>) {
        let tx = &mut self.tx;
        let Some(rec) = tx.ring.get_mut((psn - tx.snd_una) as usize) else { return };
        let was = rec.state;
        rec.state = PktState::Sacked;
        let rec = *rec;
        match was {
            PktState::Sacked => return,
            PktState::InFlight => {
                tx.in_flight -= 1;
                self.paths[rec.entropy as usize].in_flight -= 1;
                self.stats.paths[rec.entropy as usize].in_flight -= 1;
            }
            PktState::Lost => {
                // The "lost" packet was only late: it does not count against its path either.
                let path = &mut self.paths[rec.entropy as usize];
                path.consecutive_losses = path.consecutive_losses.saturating_sub(1);
                self.stats.spurious_retransmissions += 1;
                Self::widen_reorder_threshold(tx, &self.cfg, &mut self.stats);
            }
        }
        let tx = &mut self.tx;
        let exact = echo.filter(|e| e.entropy == rec.entropy && e.ts_us == rec.sent_at as u32);
        // For a packet sent more than once, only the echo tells which copy arrived. Crediting the
        // latest copy when an older one arrived would make every transmission before it look
        // overtaken (a cascade of false reorder losses) and the wrong path look healthy.
        let known_copy = !rec.resent || exact.is_some();
        if known_copy {
            tx.acked_tx_end = tx.acked_tx_end.max(rec.tx_seq + 1);
            tx.acked_sent_at = tx.acked_sent_at.max(rec.sent_at);
        }
        let (rtt_us, congested) = match exact {
            Some(e) => (e.rtt_us, e.congested),
            None => (now.saturating_sub(rec.sent_at).min(u64::from(u32::MAX)) as u32, false),
        };
        self.policy.feedback(&Feedback::Ack { entropy: rec.entropy, rtt_us, congested, bytes: rec.len, now_us: now });
        if known_copy {
            self.path_delivered(rec.entropy, rec.tx_seq, rec.sent_at, now);
        }
        self.clean_path_front(rec.entropy);
        if rec.trunc {
            return;
        }
        let Some(i) = self.tx.send_index(rec.msg) else { return };
        let send = &mut self.tx.sends[i];
        send.unacked -= 1;
        if send.unacked == 0 && send.all_sent {
            let (msg, len) = (send.id, send.len);
            self.tx.sends.remove(i);
            self.completions.push_back(Completion::Sent { msg, len });
        }
    }

    /// A loss was declared for a packet that had only been overtaken: the reorder threshold is too
    /// tight. Grows by one per such event, as PRO grows its out-of-order window per repeated arrival.
    fn widen_reorder_threshold(tx: &mut TxState, cfg: &super::ProtoConfig, stats: &mut super::ConnStats) {
        tx.reorder_threshold = (tx.reorder_threshold + 1).min(cfg.window_pkts.max(cfg.reorder_threshold));
        stats.reorder_threshold = tx.reorder_threshold;
    }

    /// After acknowledgements: release the acknowledged prefix and look for reorder losses.
    fn after_acks(&mut self, now: Micros) {
        let tx = &mut self.tx;
        let una = tx.snd_una;
        while tx.ring.front().is_some_and(|r| r.state == PktState::Sacked) {
            tx.ring.pop_front();
            tx.snd_una += 1;
        }
        if tx.snd_una != una {
            tx.una_moved_at = now;
        }
        // A transmission is lost once `reorder_threshold` later transmissions were acknowledged; for
        // first copies that is the PSN distance of the threshold rule, and it stays right for
        // retransmissions, which reuse their old PSN.
        while let Some(&(tx_seq, psn)) = self.tx.tx_order.front() {
            if !self.tx.is_live(tx_seq, psn) {
                self.tx.tx_order.pop_front();
                continue;
            }
            if tx_seq + u64::from(self.tx.reorder_threshold) >= self.tx.acked_tx_end {
                break;
            }
            self.tx.tx_order.pop_front();
            self.declare_lost(psn, now, LossCause::Reorder);
        }
        self.flush_dead_paths(now);
    }

    fn declare_lost(&mut self, psn: u64, now: Micros, cause: LossCause) {
        let tx = &mut self.tx;
        let rec = &mut tx.ring[(psn - tx.snd_una) as usize];
        debug_assert_eq!(rec.state, PktState::InFlight);
        rec.state = PktState::Lost;
        let (entropy, tx_seq, sent_at) = (rec.entropy, rec.tx_seq, rec.sent_at);
        tx.in_flight -= 1;
        // Overtaken by packets sent much later (more than an RTO after it) means nothing sent around
        // the same time got through on any path: a stall of the peer or of this host, not this path.
        let path_rto = self.paths[entropy as usize].rtt.rto_us();
        let blame = sent_at >= tx.exempt_before && tx.acked_sent_at <= sent_at.saturating_add(path_rto);
        tx.retx_queue.push_back(psn);
        let path = &mut self.paths[entropy as usize];
        path.in_flight -= 1;
        // One timeout writes off every expired packet of its path at once; it counts once, in
        // `path_timeout`, so a lost tail SACK does not look like a run of losses.
        if cause == LossCause::Reorder && blame {
            path.consecutive_losses += 1;
            self.tx.blamed_sent_at = Some(sent_at);
        }
        path.last_loss_tx_seq = path.last_loss_tx_seq.max(tx_seq);
        let run = path.consecutive_losses;
        self.stats.paths[entropy as usize].in_flight -= 1;
        match cause {
            LossCause::Reorder => {
                self.stats.reorder_losses += 1;
                self.policy.feedback(&Feedback::Nack { entropy, now_us: now });
            }
            LossCause::Timeout => self.stats.timeout_losses += 1,
            LossCause::PathDead => self.stats.dead_path_losses += 1,
        }
        self.clean_path_front(entropy);
        if run >= LOSS_RUN_DEAD && self.paths[entropy as usize].health != PathHealth::Dead {
            tracing::debug!(entropy, run, "path lost every recent packet");
            self.set_health(entropy, PathHealth::Dead, now);
        }
    }

    /// Write off every packet in flight on a path that just died: waiting for their timeouts would
    /// only delay the retransmissions.
    fn flush_dead_paths(&mut self, now: Micros) {
        if !std::mem::take(&mut self.tx.path_died) {
            return;
        }
        for e in 0..self.cfg.n_paths {
            if self.paths[e as usize].health != PathHealth::Dead {
                continue;
            }
            self.rto_deadlines.touch(e);
            while let Some(&TxEntry { tx_seq, psn, .. }) = self.paths[e as usize].queue.front() {
                self.paths[e as usize].queue.pop_front();
                if self.tx.is_live(tx_seq, psn) {
                    self.declare_lost(psn, now, LossCause::PathDead);
                }
            }
        }
    }

    /// Keep the invariant that a path's queue front is a packet in flight on it.
    fn clean_path_front(&mut self, entropy: u16) {
        self.rto_deadlines.touch(entropy);
        let tx = &self.tx;
        let q = &mut self.paths[entropy as usize].queue;
        while let Some(f) = q.front() {
            if tx.is_live(f.tx_seq, f.psn) {
                return;
            }
            q.pop_front();
        }
    }

    /// Transmission `tx_seq` on `entropy` was acknowledged. Sent after the path's last loss, it ends
    /// the loss run; sent after its last timeout too, it proves the path works. (Order of
    /// transmission, not time: a whole window can leave within one microsecond.)
    fn path_delivered(&mut self, entropy: u16, tx_seq: u64, sent_at: Micros, now: Micros) {
        let path = &mut self.paths[entropy as usize];
        path.last_ok_sent_at = Some(path.last_ok_sent_at.map_or(sent_at, |t| t.max(sent_at)));
        if tx_seq > path.last_loss_tx_seq {
            path.consecutive_losses = 0;
        }
        if path.timeout_tx_seq.is_some_and(|t| tx_seq < t) {
            return;
        }
        path.consecutive_timeouts = 0;
        if path.health != PathHealth::Alive {
            self.set_health(entropy, PathHealth::Alive, now);
        }
    }

    /// Move a path to a new health state, telling the policy when it dies or comes back.
    pub(super) fn set_health(&mut self, entropy: u16, health: PathHealth, now: Micros) {
        let was = self.paths[entropy as usize].health;
        if was == health {
            return;
        }
        if health == PathHealth::Dead {
            self.dead_paths += 1;
        } else if was == PathHealth::Dead {
            self.dead_paths -= 1;
        }
        let path = &mut self.paths[entropy as usize];
        path.health = health;
        let ps = &mut self.stats.paths[entropy as usize];
        ps.state = health;
        ps.state_changes += 1;
        let rto = path.rtt.rto_us();
        if health == PathHealth::Dead {
            self.tx.dead_paths += 1;
            // The failure had begun when the packet whose loss revealed it was sent: a path that
            // delivered a packet sent after that works. (Without such a loss, an RTO before now.)
            let since = self.tx.blamed_sent_at.take().unwrap_or(now.saturating_sub(rto));
            self.tx.episode_since.get_or_insert(since);
        } else if was == PathHealth::Dead {
            self.tx.dead_paths -= 1;
            if self.tx.dead_paths == 0 {
                self.tx.episode_since = None;
            }
        }
        let path = &mut self.paths[entropy as usize];
        match health {
            PathHealth::Dead => {
                path.dead_since = now;
                self.tx.path_died = true;
                path.probe = super::path::Probe::Idle;
                tracing::info!(entropy, timeouts = path.consecutive_timeouts, losses = path.consecutive_losses, "path marked dead");
                self.policy.feedback(&Feedback::PathState { entropy, alive: false, now_us: now });
            }
            PathHealth::Alive if was == PathHealth::Dead => {
                path.probe = super::path::Probe::Idle;
                tracing::info!(entropy, "path alive again");
                self.policy.feedback(&Feedback::PathState { entropy, alive: true, now_us: now });
            }
            _ => {}
        }
    }

    /// Earliest retransmission timeout of any path.
    pub(super) fn rto_deadline(&self) -> Option<Micros> {
        self.paths.iter().filter_map(|p| p.rto_deadline()).min()
    }

    /// Fire every expired per-path RTO: the path gets a timeout (suspect, dead after
    /// `path_dead_after`), its expired packets are lost and will be resent elsewhere.
    pub(super) fn on_rto(&mut self, now: Micros) {
        let expired = matches!(self.rto_deadlines.earliest(&self.paths), Some(d) if d <= now);
        if !expired {
            // Nothing expired (the cached minimum is exact): only the dead-path flush below applies.
            self.flush_dead_paths(now);
            return;
        }
        let mut any = false;
        for e in 0..self.cfg.n_paths {
            let rto = self.paths[e as usize].rtt.rto_us();
            match self.paths[e as usize].rto_deadline() {
                Some(d) if d <= now => {}
                _ => continue,
            }
            any = true;
            self.rto_deadlines.touch(e);
            let (front_tx_seq, front_sent_at) = self.paths[e as usize].queue.front().map_or((0, 0), |f| (f.tx_seq, f.sent_at));
            self.path_timeout(e, front_tx_seq, front_sent_at, now);
            let dead = self.paths[e as usize].health == PathHealth::Dead;
            while let Some(&TxEntry { tx_seq, psn, sent_at }) = self.paths[e as usize].queue.front() {
                if !self.tx.is_live(tx_seq, psn) {
                    self.paths[e as usize].queue.pop_front();
                } else if dead || sent_at.saturating_add(rto) <= now {
                    self.paths[e as usize].queue.pop_front();
                    self.declare_lost(psn, now, LossCause::Timeout);
                } else {
                    break;
                }
            }
        }
        if any {
            // A loss that hid as reordering until the timer fired: the threshold is too loose.
            let tx = &mut self.tx;
            tx.reorder_threshold = (tx.reorder_threshold / 2).max(self.cfg.reorder_threshold);
            self.stats.reorder_threshold = tx.reorder_threshold;
        }
        self.flush_dead_paths(now);
    }

    /// The RTO of the path's oldest packet in flight (transmission `tx_seq`, sent at `sent_at`) expired.
    ///
    /// The path is blamed (suspect, then dead; the policy hears of it) only if a packet sent after
    /// this one arrived: then other paths get through and this one does not. When nothing sent since
    /// came back, the peer or this host stalled (a descheduled process, a full receive queue) and
    /// every path would look dead at once; the packets are still resent, the timer backs off, what was
    /// sent until the peer is heard again is not held against any path, and the peer timeout deals
    /// with a peer that is really gone.
    fn path_timeout(&mut self, entropy: u16, tx_seq: u64, sent_at: Micros, now: Micros) {
        self.stats.timeouts += 1;
        // Blame the path when something sent after this packet arrived (other paths get through), or
        // when no other path has packets of that age still waiting (this path is the only one stuck).
        let rto = self.paths[entropy as usize].rtt.rto_us();
        let others_stuck = (0..self.cfg.n_paths).filter(|&o| o != entropy).any(|o| {
            self.paths[o as usize]
                .queue
                .front()
                .is_some_and(|f| self.tx.is_live(f.tx_seq, f.psn) && f.sent_at <= sent_at.saturating_add(rto))
        });
        let blame = sent_at >= self.tx.exempt_before && (self.tx.acked_sent_at > sent_at || !others_stuck);
        self.rto_deadlines.touch(entropy);
        if self.ctl_rtt.srtt_us().is_none() && !matches!(self.tx.unsampled_backoff_at, Some(t) if sent_at < t) {
            // No RTT measured yet and a packet timed out: the initial RTO is too short for this
            // network, so back off what paths not yet measured inherit, once per round (RFC 6298 5.5).
            self.ctl_rtt.on_timeout();
            self.tx.unsampled_backoff_at = Some(now);
        }
        let path = &mut self.paths[entropy as usize];
        path.rtt.on_timeout();
        if !blame {
            // A stall only if the peer has not been heard since this packet left. Otherwise the peer
            // is alive, and the packet was either exempt already or the last of a window clogged by
            // a black hole (every packet still in flight lost on dead paths, so nothing sent after it
            // could arrive): treating that as a stall exempted every packet in flight at the next SACK,
            // and their timeouts declared the next stall, so a black-holed path was never blamed.
            self.tx.stalled |= others_stuck && self.last_heard <= sent_at;
            self.stats.stall_timeouts += 1;
            let ps = &mut self.stats.paths[entropy as usize];
            ps.timeouts += 1;
            ps.rto_us = path.rtt.rto_us();
            tracing::debug!(entropy, "retransmission timeout while the peer was silent: not blamed on the path");
            return;
        }
        path.consecutive_timeouts += 1;
        path.consecutive_losses += 1;
        path.last_loss_tx_seq = path.last_loss_tx_seq.max(tx_seq);
        self.tx.blamed_sent_at = Some(sent_at);
        path.timeout_tx_seq = Some(self.tx.next_tx_seq);
        let fb = Feedback::Timeout {
            entropy: Some(entropy),
            max_rtt_us: path.max_rtt_since_timeout_us,
            base_rtt_us: path.base_rtt_us.unwrap_or(0),
            now_us: now,
        };
        path.max_rtt_since_timeout_us = 0;
        let health = if path.consecutive_timeouts >= self.cfg.path_dead_after { PathHealth::Dead } else { PathHealth::Suspect };
        let ps = &mut self.stats.paths[entropy as usize];
        ps.timeouts += 1;
        ps.rto_us = path.rtt.rto_us();
        tracing::debug!(entropy, consecutive = path.consecutive_timeouts, rto_us = ps.rto_us, "retransmission timeout");
        self.policy.feedback(&fb);
        if self.paths[entropy as usize].health != PathHealth::Dead {
            self.set_health(entropy, health, now);
        }
    }

    /// The next DATA packet (a retransmission first, then new data), if the window allows.
    pub(super) fn poll_data(&mut self, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Option<Transmit> {
        if self.tx.in_flight >= self.cfg.window_pkts {
            return None;
        }
        while let Some(&psn) = self.tx.retx_queue.front() {
            let tx = &self.tx;
            let lost = psn >= tx.snd_una && tx.ring.get((psn - tx.snd_una) as usize).is_some_and(|r| r.state == PktState::Lost);
            if lost {
                break;
            }
            self.tx.retx_queue.pop_front();
        }
        if let Some(&psn) = self.tx.retx_queue.front() {
            let len = self.tx.ring[(psn - self.tx.snd_una) as usize].len as usize;
            if out.len() < DATA_HEADER_LEN + len {
                tracing::warn!(buffer = out.len(), need = DATA_HEADER_LEN + len, "transmit buffer too small for a retransmission");
                return None;
            }
            self.tx.retx_queue.pop_front();
            return Some(self.transmit_data(psn, true, now, src, out));
        }
        if self.tx.next_psn - self.tx.snd_una >= OOO_WINDOW_PKTS {
            return None;
        }
        // Whole lines only: every packet but a buffer's last one ends on a line boundary of the message.
        let max_payload = super::config::line_floor(self.cfg.max_payload.min(out.len().checked_sub(DATA_HEADER_LEN)?)) as u64;
        let item = self.tx.tx_queue.front_mut()?;
        let remaining = item.total - item.next_offset;
        let len = if item.trunc { 0 } else { remaining.min(max_payload) };
        if len == 0 && remaining > 0 && !item.trunc {
            tracing::warn!(buffer = out.len(), "transmit buffer too small for any payload");
            return None;
        }
        let rec = SentPkt {
            msg: item.msg,
            cts_seq: item.cts_seq,
            offset: item.next_offset,
            total: item.total,
            len: len as u32,
            sub: item.sub,
            trunc: item.trunc,
            state: PktState::InFlight,
            entropy: 0,
            sent_at: now,
            tx_seq: 0,
            resent: false,
        };
        item.next_offset += len;
        let done = item.trunc || item.next_offset == item.total;
        if done {
            self.tx.tx_queue.pop_front();
        }
        if !rec.trunc {
            if let Some(i) = self.tx.send_index(rec.msg) {
                let send = &mut self.tx.sends[i];
                send.unacked += 1;
                send.all_sent |= done;
            }
        }
        let psn = self.tx.next_psn;
        if self.tx.snd_una == psn {
            self.tx.una_moved_at = now;
        }
        self.tx.next_psn += 1;
        self.tx.ring.push_back(rec);
        Some(self.transmit_data(psn, false, now, src, out))
    }

    /// Put PSN `psn` on a path and into `out`.
    fn transmit_data(&mut self, psn: u64, retx: bool, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Transmit {
        let idx = (psn - self.tx.snd_una) as usize;
        let old = self.tx.ring[idx];
        let entropy = if retx {
            self.pick_path(old.msg, old.offset, true, Some(old.entropy), now)
        } else {
            self.pick_path(old.msg, old.offset, false, None, now)
        };
        let tx_seq = self.tx.next_tx_seq;
        self.tx.next_tx_seq += 1;
        let rec = &mut self.tx.ring[idx];
        rec.state = PktState::InFlight;
        rec.entropy = entropy;
        rec.sent_at = now;
        rec.tx_seq = tx_seq;
        rec.resent |= retx;
        let repr = DataRepr {
            token: self.peer_token,
            cts_ack: self.tx.cts_next,
            psn,
            cts_seq: old.cts_seq,
            sub: old.sub,
            offset: old.offset,
            len: old.len,
            total_len: old.total,
            entropy,
            ts_us: now as u32,
            trunc: old.trunc,
            ce: false,
            retx,
        };
        let total = repr.buffer_len();
        let mut pkt = DataPacket::new_unchecked(&mut out[..total]);
        repr.emit(&mut pkt);
        if old.len > 0 {
            src.read(old.msg, old.offset, &mut pkt.payload_mut()[..old.len as usize]);
        }
        // A path nothing was measured on yet times out after the connection's RTO, not the configured
        // initial one: with queues deeper than that initial value, every first packet on a fresh
        // entropy (a spraying or exploring policy uses many) would time out spuriously, be resent,
        // and blame a path that works.
        self.paths[entropy as usize].rtt.inherit_initial(&self.ctl_rtt);
        self.paths[entropy as usize].queue.push_back(TxEntry { tx_seq, psn, sent_at: now });
        self.rto_deadlines.touch(entropy);
        self.paths[entropy as usize].in_flight += 1;
        self.tx.tx_order.push_back((tx_seq, psn));
        self.tx.in_flight += 1;
        self.tx.ack_pending = false;
        self.stats.data_pkts_sent += 1;
        self.stats.data_bytes_sent += u64::from(old.len);
        let ps = &mut self.stats.paths[entropy as usize];
        ps.pkts_sent += 1;
        ps.bytes_sent += u64::from(old.len);
        ps.in_flight += 1;
        if retx {
            self.stats.retransmissions += 1;
            ps.retransmissions += 1;
        }
        Transmit { entropy, len: total }
    }

    /// The policy's entropy for one packet, corrected when it names a dead path or (for a
    /// retransmission) the path the lost copy took.
    fn pick_path(&mut self, msg: MsgId, offset: u64, retransmit: bool, avoid: Option<u16>, now: Micros) -> u16 {
        let n = self.cfg.n_paths;
        let episode = self.proven_filter();
        let ok = |paths: &[super::path::Path], e: u16| {
            let p = &paths[e as usize];
            p.usable() && p.proven_in(episode) && (n == 1 || Some(e) != avoid)
        };
        let ctx = PathCtx { msg: msg.0, offset, n_paths: n, retransmit, avoid, now_us: now };
        let first = self.policy.pick(&ctx) % n;
        if ok(&self.paths, first) {
            return first;
        }
        let second = self.policy.pick(&PathCtx { avoid: Some(first), ..ctx }) % n;
        if ok(&self.paths, second) {
            return second;
        }
        if let Some(e) = (1..n).map(|k| (first + k) % n).find(|&e| ok(&self.paths, e)) {
            return e;
        }
        if episode.is_some() {
            if let Some(e) = (0..n).map(|k| (first + k) % n).find(|&e| self.paths[e as usize].usable() && (n == 1 || Some(e) != avoid)) {
                return e;
            }
        }
        // Every path is dead (or the only live one is the one to avoid): anything but the lost copy's.
        match avoid {
            Some(a) if a == first && n > 1 => (first + 1) % n,
            _ => first,
        }
    }
}

impl Connection {
    /// The start of the failure episode, if one is going on and enough paths were proven since then
    /// for new packets to keep to them.
    pub(super) fn proven_filter(&self) -> Option<Micros> {
        let since = self.tx.episode_since?;
        let proven = self.paths.iter().filter(|p| p.usable() && p.proven_since(since)).take(MIN_PROVEN_PATHS).count();
        (proven >= MIN_PROVEN_PATHS).then_some(since)
    }

    /// Whether new packets would go on path `entropy` now: it is not dead and, during a failure
    /// episode (some paths died), it was proven to work since the episode began. A driver whose other
    /// connections share this one's paths (same source and destination address and port) can steer
    /// their control packets with it.
    pub fn path_preferred(&self, entropy: u16) -> bool {
        let Some(p) = self.paths.get(entropy as usize) else { return false };
        p.usable() && p.proven_in(self.proven_filter())
    }
}

/// What a SACK's echo told about its triggering packet.
#[derive(Debug, Clone, Copy)]
pub(super) struct Echo {
    entropy: u16,
    ts_us: u32,
    rtt_us: u32,
    congested: bool,
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prism_lb::path::Spray;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    use super::*;
    use crate::proto::ProtoConfig;
    use crate::wire::CtsBuf;

    /// Never an unmatched send of tag t while a held group has a free t buffer.
    fn assert_invariant(c: &Connection, step: usize) {
        for s in c.tx.sends.iter().filter(|s| !s.matched) {
            for g in &c.tx.groups {
                assert!(
                    g.free_buf(s.tag).is_none(),
                    "step {step}: send {:?} (tag {}) waits while CTS {} has a free buffer for it",
                    s.id,
                    s.tag,
                    g.seq
                );
            }
        }
        assert_eq!(c.tx.unmatched, c.tx.sends.iter().filter(|s| !s.matched).count(), "step {step}: unmatched count");
        assert!(c.tx.groups.iter().all(|g| g.matched.count_ones() < u32::from(g.n)), "step {step}: a full group is still held");
        assert!(c.tx.groups.iter().zip(c.tx.groups.iter().skip(1)).all(|(a, b)| a.seq < b.seq), "step {step}: groups out of order");
    }

    #[test]
    fn matching_keeps_its_invariant_and_per_tag_order_under_random_posts_and_cts() {
        for seed in 0..200u64 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut c = Connection::new(ProtoConfig::default(), 1, 2, Box::new(Spray::new(seed)), 0);
            let ntags = rng.gen_range(1..=6);
            let mut next_seq = 0u64;
            // CTS arrive out of order: a few are held back and delivered later.
            let mut held_back: Vec<CtsRepr> = Vec::new();
            for step in 0..400 {
                match rng.gen_range(0..3) {
                    0 if c.tx.open_sends() < MAX_OUTSTANDING_RECVS * 4 => {
                        c.post_send(rng.gen_range(0..100), rng.gen_range(0..ntags), 0).expect("post");
                    }
                    1 if next_seq < CTS_AHEAD / 2 => {
                        let bufs: Vec<CtsBuf> =
                            (0..rng.gen_range(1..=8)).map(|_| CtsBuf { size: 100, tag: rng.gen_range(0..ntags) }).collect();
                        held_back.push(CtsRepr::new(2, 0, next_seq, &bufs).expect("cts"));
                        next_seq += 1;
                    }
                    _ if !held_back.is_empty() => {
                        let cts = held_back.swap_remove(rng.gen_range(0..held_back.len()));
                        c.on_cts(&cts);
                    }
                    _ => {}
                }
                assert_invariant(&c, step);
            }
            // Per tag, the sends matched buffers in posting order: (CTS, buffer) grows with the send id.
            let mut last: BTreeMap<i32, (MsgId, u64, u8)> = BTreeMap::new();
            let tags: BTreeMap<MsgId, i32> = c.tx.sends.iter().map(|s| (s.id, s.tag)).collect();
            let mut items: Vec<&TxItem> = c.tx.tx_queue.iter().collect();
            items.sort_by_key(|i| i.msg);
            for it in items {
                let tag = tags[&it.msg];
                if let Some(&(m, seq, sub)) = last.get(&tag) {
                    assert!((seq, sub) < (it.cts_seq, it.sub), "seed {seed}: send {:?} of tag {tag} matched before send {m:?}", it.msg);
                }
                last.insert(tag, (it.msg, it.cts_seq, it.sub));
            }
        }
    }
}
