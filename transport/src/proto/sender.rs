//! The sending half of a connection: matching sends to CTS groups (NCCL's order) and PSN bookkeeping.
//! Acknowledgements, loss detection and (re)transmission are in `recovery.rs`.

use std::collections::{BTreeMap, VecDeque};

use super::connection::Connection;
use super::{Completion, Micros, MsgError, MsgId, MAX_OUTSTANDING_RECVS};
use crate::wire::{CtsBuf, CtsRepr, MAX_RECV_BUFS};

/// CTS sequence numbers accepted ahead of the next expected one, and CTS groups held at most; a
/// receiver never has more than `MAX_OUTSTANDING_RECVS` receives posted, so anything further is bogus.
const CTS_AHEAD: u64 = 2 * MAX_OUTSTANDING_RECVS as u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PktState {
    InFlight,
    /// Declared lost (or taken as the tail-loss probe), waiting in the retransmission queue.
    Lost,
    Sacked,
}

/// Everything needed to (re)send one PSN, so a retransmission never depends on the message still
/// being around (a truncation marker outlives its failed send).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SentPkt {
    pub(crate) msg: MsgId,
    pub(crate) cts_seq: u64,
    pub(crate) offset: u64,
    pub(crate) total: u64,
    pub(crate) len: u32,
    pub(crate) sub: u8,
    pub(crate) trunc: bool,
    pub(crate) state: PktState,
    pub(crate) entropy: u16,
    pub(crate) sent_at: Micros,
    pub(crate) tx_seq: u64,
    /// Sent more than once: an acknowledgement does not say which copy arrived.
    pub(crate) resent: bool,
    /// `Lost` only because it is resent as the tail-loss probe: an acknowledgement of the old copy
    /// is not a spurious loss.
    pub(crate) probed: bool,
    /// This copy left while a failure episode was going on (`ConnStats::episode_losses`).
    pub(crate) in_episode: bool,
    /// The connection's delivered bytes, and when they were last counted, when this copy left: its
    /// acknowledgement measures the delivery rate since (BBR's rate sample).
    pub(crate) delivered_at_send: (u64, Micros),
    /// Path and send time of the copy before this one (resent packets): an echo naming it says the
    /// copy declared lost arrived after all, and how late.
    pub(crate) prev_copy: (u16, Micros),
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
pub(crate) struct TxItem {
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

#[derive(Debug)]
pub(crate) struct TxState {
    next_psn: u64,
    /// Oldest PSN not yet acknowledged; `ring[i]` is PSN `snd_una + i`.
    pub(crate) snd_una: u64,
    /// When `snd_una` last moved, or the first packet went out with nothing unacknowledged: the
    /// stall watchdog's measure of progress.
    pub(crate) una_moved_at: Micros,
    pub(crate) ring: VecDeque<SentPkt>,
    pub(crate) next_tx_seq: u64,
    /// (tx_seq, psn) of every transmission in sending order, cleaned lazily; its front is the oldest
    /// transmission still in flight.
    pub(crate) tx_order: VecDeque<(u64, u64)>,
    /// One past the highest transmission sequence number acknowledged.
    pub(crate) acked_tx_end: u64,
    /// RACK's reference: send time of the most recently sent transmission known to have arrived...
    pub(crate) acked_sent_at: Micros,
    /// ... and its RTT.
    pub(crate) rack_rtt_us: u64,
    /// Smallest RTT sample of the connection.
    pub(crate) min_rtt_us: Option<u64>,
    /// The reordering window's factor (of min RTT / 4).
    pub(crate) reo_mult: u32,
    /// When a loss last turned out spurious.
    pub(crate) last_spurious_at: Micros,
    /// Reordering measured: how much later than RACK's reference allowed a packet was acknowledged
    /// (µs), the largest in the current and the previous measuring period...
    pub(crate) reo_late_us: [u64; 2],
    /// ... and when the current period began.
    pub(crate) reo_late_since: Micros,
    /// Bytes acknowledged (first copies known to have arrived) and when they were last counted.
    pub(crate) delivered: (u64, Micros),
    /// Largest delivery rate measured (bytes per millisecond) in the current and the previous
    /// measuring period: how fast what is in flight drains.
    pub(crate) rate_max: [u64; 2],
    /// `acked_tx_end` and `rack_rtt_us` before the acknowledgement being applied: packets acknowledged
    /// together arrived in an order nobody knows, so only earlier ones count as overtaking.
    pub(crate) acked_before: (u64, u64),
    /// When the earliest packet sent before RACK's reference becomes overdue.
    pub(crate) rack_timer: Option<Micros>,
    /// The tail-loss probe: measured from the last transmission or acknowledgement; due to go out.
    pub(crate) tlp_base: Micros,
    /// Probes sent since the last acknowledgement.
    pub(crate) tlp_count: u32,
    pub(crate) tlp_due: bool,
    /// The packet being put on a path now is a tail-loss probe (see `Connection::pick_path`).
    pub(crate) probe_pick: bool,
    /// A timeout not blamed on its path (nothing sent after the packet arrived, the peer heard
    /// meanwhile: every packet in flight may sit on failed paths) queued a retransmission: it goes on
    /// the path proven most recently, not where the policy would put it (`Connection::pick_path`).
    pub(crate) retx_to_freshest: bool,
    /// The last DATA packet sent was a message's last: the receiver acknowledges it at once.
    pub(crate) tail_last: bool,
    /// Transmission sequence number of the last tail-loss probe.
    pub(crate) tlp_tx_seq: Option<u64>,
    /// A timeout fired while the peer was silent: a stall is going on.
    pub(crate) stalled: bool,
    /// Losses of packets sent before this instant (the end of the last stall) blame no path.
    pub(crate) exempt_before: Micros,
    /// Copies a tail-loss probe wrote off (entropy, transmission, send time), oldest first, at most
    /// `PROBED_COPIES`: held against their paths once a transmission sent after them is acknowledged
    /// (`Connection::blame_probed_copies`).
    pub(crate) probed_copies: VecDeque<(u16, u64, Micros)>,
    pub(crate) retx_queue: VecDeque<u64>,
    pub(crate) in_flight: u32,
    sends: VecDeque<SendMsg>,
    /// Sends in `sends` not matched to a buffer yet.
    unmatched: usize,
    pub(crate) tx_queue: VecDeque<TxItem>,
    /// Every CTS below this was received (this is the `cts_ack` every outgoing packet carries).
    pub(crate) cts_next: u64,
    cts_ahead: BTreeMap<u64, CtsGroup>,
    groups: VecDeque<CtsGroup>,
    pub(crate) ack_pending: bool,
    pub(crate) reorder_threshold: u32,
    /// While no RTT is known: when the connection's RTO was last backed off (a timeout of a packet
    /// sent before that is part of the same round and does not back it off again).
    pub(crate) unsampled_backoff_at: Option<Micros>,
    /// When a SACK last acknowledged a packet not acknowledged before.
    pub(crate) last_new_ack_at: Micros,
}

impl TxState {
    /// The peer was heard: a stall, if one was going on, ends now, and what was sent during it is
    /// not held against any path.
    pub(crate) fn peer_heard(&mut self, now: Micros) {
        if std::mem::take(&mut self.stalled) {
            self.exempt_before = now;
        }
    }

    /// See [`super::Connection::cts_in_use`] (all but the packet parked at a start gate).
    pub(crate) fn cts_in_use(&self, cts_seq: u64) -> bool {
        self.groups.iter().any(|g| g.seq == cts_seq)
            || self.cts_ahead.contains_key(&cts_seq)
            || self.tx_queue.iter().any(|it| it.cts_seq == cts_seq)
            || self.ring.iter().any(|p| p.cts_seq == cts_seq && p.state != PktState::Sacked)
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
            rack_rtt_us: 0,
            min_rtt_us: None,
            reo_mult: 1,
            last_spurious_at: 0,
            reo_late_us: [0; 2],
            reo_late_since: 0,
            acked_before: (0, 0),
            delivered: (0, 0),
            rate_max: [0; 2],
            rack_timer: None,
            tlp_base: 0,
            tlp_count: 0,
            tlp_due: false,
            probe_pick: false,
            retx_to_freshest: false,
            tail_last: false,
            tlp_tx_seq: None,
            stalled: false,
            exempt_before: 0,
            probed_copies: VecDeque::new(),
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
            unsampled_backoff_at: None,
            last_new_ack_at: 0,
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

    /// Matched sends (or truncation markers) have packets not sent yet.
    pub(crate) fn new_data_queued(&self) -> bool {
        !self.tx_queue.is_empty()
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

    /// The index of send `id`. Ids are unique and increasing, and sends usually complete in order, so
    /// `id - first id` is tried before a binary search.
    fn send_index(&self, id: MsgId) -> Option<usize> {
        let guess = id.0.wrapping_sub(self.sends.front()?.id.0);
        if self.sends.get(usize::try_from(guess).ok()?).is_some_and(|s| s.id == id) {
            return Some(guess as usize);
        }
        self.sends.binary_search_by_key(&id, |s| s.id).ok()
    }

    pub(crate) fn is_live(&self, tx_seq: u64, psn: u64) -> bool {
        psn >= self.snd_una
            && self.ring.get((psn - self.snd_una) as usize).is_some_and(|r| r.state == PktState::InFlight && r.tx_seq == tx_seq)
    }

    /// A lost packet waits for its retransmission (entries acknowledged meanwhile are dropped).
    pub(crate) fn has_retransmission(&mut self) -> bool {
        while let Some(&psn) = self.retx_queue.front() {
            if psn >= self.snd_una && self.ring.get((psn - self.snd_una) as usize).is_some_and(|r| r.state == PktState::Lost) {
                return true;
            }
            self.retx_queue.pop_front();
        }
        false
    }

    /// The PSN of the most recently sent packet still in flight.
    pub(crate) fn newest_in_flight(&mut self) -> Option<u64> {
        while let Some(&(tx_seq, psn)) = self.tx_order.back() {
            if self.is_live(tx_seq, psn) {
                return Some(psn);
            }
            self.tx_order.pop_back();
        }
        None
    }

    /// Every packet of send `msg` in flight was acknowledged once more: complete it when all were.
    pub(crate) fn send_acked(&mut self, msg: MsgId, completions: &mut VecDeque<Completion>) {
        let Some(i) = self.send_index(msg) else { return };
        let send = &mut self.sends[i];
        send.unacked -= 1;
        if send.unacked == 0 && send.all_sent {
            let (msg, len) = (send.id, send.len);
            self.sends.remove(i);
            completions.push_back(Completion::Sent { msg, len });
        }
    }

    /// Message and offset of the next packet of new data, if there is one.
    pub(crate) fn next_new_at(&self) -> Option<(MsgId, u64)> {
        self.tx_queue.front().map(|item| (item.msg, item.next_offset))
    }

    /// The next packet of new data (at most `max_payload` bytes) and whether it ends its item.
    pub(crate) fn next_new_packet(&mut self, max_payload: u64, now: Micros) -> Option<(SentPkt, bool)> {
        let item = self.tx_queue.front_mut()?;
        let remaining = item.total - item.next_offset;
        let len = if item.trunc { 0 } else { remaining.min(max_payload) };
        if len == 0 && remaining > 0 && !item.trunc {
            tracing::warn!(max_payload, "transmit buffer too small for any payload");
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
            probed: false,
            in_episode: false,
            delivered_at_send: (0, 0),
            prev_copy: (0, 0),
        };
        item.next_offset += len;
        let done = item.trunc || item.next_offset == item.total;
        if done {
            self.tx_queue.pop_front();
        }
        Some((rec, done))
    }

    /// Give `rec` the next PSN; returns it.
    pub(crate) fn push_new(&mut self, rec: SentPkt, done: bool, now: Micros) -> u64 {
        if !rec.trunc {
            if let Some(i) = self.send_index(rec.msg) {
                let send = &mut self.sends[i];
                send.unacked += 1;
                send.all_sent |= done;
            }
        }
        let psn = self.next_psn;
        if self.snd_una == psn {
            self.una_moved_at = now;
        }
        self.next_psn += 1;
        self.ring.push_back(rec);
        psn
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
