//! Start times of sends, set by the driver: a send can be held until the driver releases it (the
//! engine's batching window: the send is not planned yet), and each byte range of a send can have a
//! not-before time (Ethereal's per-sub-flow start jitter). The gate looks only at a packet's first
//! transmission; retransmissions, control packets and truncation markers are never held.
//!
//! New data leaves in the sender's queue order, so a packet that is not due yet is taken off the queue
//! and parked here until it is, and holds up the new data behind it (never retransmissions or
//! control). `poll_timeout` reports its due time, so a driver wakes for it even if nothing else
//! happens. With no gate set, no packet is ever parked: the transmit path is what it was.

use std::collections::HashMap;

use super::connection::Connection;
use super::sender::SentPkt;
use super::{Micros, MsgId};

/// A send's gate.
#[derive(Debug, Clone)]
enum Gate {
    /// Nothing of the send leaves until the driver gives its start times.
    Held,
    /// `(offset, not_before)` sorted by offset: a packet starting at `o` waits until the `not_before`
    /// of the last entry with `offset <= o` (none: it may leave at once).
    Starts(Vec<(u64, Micros)>),
}

/// The gates of one connection's sends and the packet parked by them.
#[derive(Debug, Default)]
pub(crate) struct StartGates {
    by_msg: HashMap<MsgId, Gate>,
    /// The next packet of new data, already taken from the sender's queue: (packet, ends its send).
    pub(crate) parked: Option<(SentPkt, bool)>,
    /// Since when the parked packet has waited for its start time (None: it has not).
    waiting_since: Option<Micros>,
    stats: GateStats,
}

/// What the start gates did (for the driver's statistics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GateStats {
    /// Sends held until the driver released them.
    pub held_sends: u64,
    /// DATA packets that waited for a start time (each counted once).
    pub waited_pkts: u64,
    /// Their waits, summed (µs).
    pub waited_us: u64,
}

impl StartGates {
    /// When the packet of `msg` at `offset` may leave: `None` while the send is held.
    fn due_at(&self, msg: MsgId, offset: u64) -> Option<Micros> {
        match self.by_msg.get(&msg) {
            None => Some(0),
            Some(Gate::Held) => None,
            Some(Gate::Starts(v)) => {
                let i = v.partition_point(|s| s.0 <= offset);
                Some(i.checked_sub(1).map_or(0, |i| v[i].1))
            }
        }
    }

    /// May `rec` leave at `now`?
    pub(crate) fn is_due(&self, rec: &SentPkt, now: Micros) -> bool {
        rec.trunc || self.due_at(rec.msg, rec.offset).is_some_and(|t| t <= now)
    }

    /// The send's last packet left: its gate is no longer needed.
    pub(crate) fn forget(&mut self, msg: MsgId) {
        self.by_msg.remove(&msg);
    }

    /// When the parked packet becomes due, if that is after `now` (a due packet that waits for the
    /// window needs no timer: an acknowledgement opens the window).
    pub(crate) fn deadline(&self, now: Micros) -> Option<Micros> {
        let (rec, _) = self.parked.as_ref()?;
        if rec.trunc {
            return None;
        }
        self.due_at(rec.msg, rec.offset).filter(|&t| t > now)
    }
}

impl Connection {
    /// Hold send `msg`: none of its DATA leaves until [`Connection::set_send_starts`] is called for
    /// it. New data of later sends waits behind it (sends leave in order). For a driver that plans a
    /// send after posting it (a batching window); it must release the send in bounded time.
    pub fn hold_send(&mut self, msg: MsgId) {
        if self.tx_open_or_queued() {
            self.gates.by_msg.insert(msg, Gate::Held);
            self.gates.stats.held_sends += 1;
        }
    }

    /// What the start gates did so far.
    pub fn gate_stats(&self) -> GateStats {
        self.gates.stats
    }

    /// Release send `msg` with per-range start times: the first transmission of a packet starting at
    /// offset `o` waits until the time of the last `(offset, not_before)` entry with `offset <= o`
    /// (packets before the first entry may leave at once). An empty list releases the send entirely.
    pub fn set_send_starts(&mut self, msg: MsgId, starts: &[(u64, Micros)]) {
        if starts.iter().all(|s| s.1 <= self.now) {
            self.gates.by_msg.remove(&msg);
            return;
        }
        if !self.gates.by_msg.contains_key(&msg) && !self.tx_open_or_queued() {
            return;
        }
        let mut v = starts.to_vec();
        v.sort_by_key(|s| s.0);
        self.gates.by_msg.insert(msg, Gate::Starts(v));
    }

    /// A gate is only kept while there can be sends to apply it to (bounds the table: the driver
    /// sets gates only for sends it posted, and each is forgotten with the send's last packet).
    fn tx_open_or_queued(&self) -> bool {
        self.tx.open_sends() > 0 && self.gates.by_msg.len() < 2 * super::MAX_OUTSTANDING_SENDS
    }

    /// Whether new data may leave now: takes the next new packet off the sender's queue (into
    /// `parked`) if none is parked, and says whether it is due.
    pub(super) fn next_new_due(&mut self, now: Micros, max_payload: u64) -> bool {
        let g = &mut self.gates;
        if g.parked.is_none() {
            g.parked = self.tx.next_new_packet(max_payload, now);
        }
        let Some((rec, _)) = &g.parked else { return false };
        let due = g.is_due(rec, now);
        if !due && g.waiting_since.is_none() {
            g.waiting_since = Some(now);
            g.stats.waited_pkts += 1;
        }
        due
    }

    /// The parked packet leaves now: account for its wait.
    pub(super) fn gate_passed(&mut self, now: Micros) {
        if let Some(since) = self.gates.waiting_since.take() {
            self.gates.stats.waited_us += now.saturating_sub(since);
        }
    }

    /// Forget every gate and the parked packet (the connection died); the statistics stay.
    pub(super) fn clear_gates(&mut self) {
        self.gates = StartGates { stats: self.gates.stats, ..StartGates::default() };
    }
}
