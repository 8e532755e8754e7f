//! What the sender knows about one path (entropy): RTT and RTO, packets in flight, health, probing.

use std::collections::VecDeque;

use super::rtt::RttEstimator;
use super::stats::PathHealth;
use super::Micros;

/// One transmission (first copy or retransmission) of a PSN on a path.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TxEntry {
    pub(crate) tx_seq: u64,
    pub(crate) psn: u64,
    pub(crate) sent_at: Micros,
}

/// Probing of a suspect or dead path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// Not probing (alive, or dead and waiting for its next probe time).
    Idle,
    /// A probe PING should go out on this path.
    Due,
    /// A probe PING went out at this time; a PONG revives the path.
    Sent(Micros),
}

#[derive(Debug, Clone)]
pub(crate) struct Path {
    pub(crate) rtt: RttEstimator,
    pub(crate) in_flight: u32,
    /// Transmissions on this path in sending order. Entries whose packet was since acknowledged, lost or
    /// resent are removed lazily, but the front is always a packet still in flight on this path, so it
    /// is the one whose RTO expires first.
    pub(crate) queue: VecDeque<TxEntry>,
    /// When its RTO last fired or restarted: the next one is an RTO after the later of this and the
    /// send time of its oldest packet in flight (a timeout during a stall leaves the packets in
    /// flight; a timer restarts while acknowledgements of packets sent before that one keep coming).
    pub(crate) rto_fired_at: Micros,
    pub(crate) health: PathHealth,
    pub(crate) consecutive_timeouts: u32,
    /// Losses (by time, reordering or timeout) since the path last delivered a packet sent after them.
    pub(crate) consecutive_losses: u32,
    pub(crate) last_loss_tx_seq: u64,
    /// One past the newest transmission on this path known to have arrived: a loss of an older one
    /// is random loss on a working path, not a failure.
    pub(crate) delivered_tx_end: u64,
    /// RTT of the most recently sent transmission on this path known to have arrived (µs): the
    /// path's own RACK reference. A packet this path carried after another one arrived, so the
    /// older one (a path keeps its order) was due by then; the RTT includes whatever queue both met.
    pub(crate) delivered_rtt_us: u64,
    /// Probes of this suspect path that went unanswered.
    pub(crate) probe_failures: u32,
    /// Transmissions from this one on were sent after the last timeout; acknowledgements of older
    /// ones do not prove the path works now.
    pub(crate) timeout_tx_seq: Option<u64>,
    /// When the path last became suspect or dead: the next probe of a dead path is due `revive_wait`
    /// after it.
    pub(crate) bad_since: Micros,
    pub(crate) probe: Probe,
    /// How long a dead path waits before its next probe: a few RTOs at first, doubled after every
    /// unanswered probe up to `path_revive_us`.
    pub(crate) revive_wait: Micros,
    /// Largest RTT since the last timeout and smallest ever: a policy compares them to tell a failure
    /// (low RTT, then silence) from congestion (rising RTT).
    pub(crate) max_rtt_since_timeout_us: u32,
    pub(crate) base_rtt_us: Option<u32>,
    /// Send time of the latest transmission on this path known to have arrived (or of the probe that
    /// revived it): during a failure episode only paths proven after its start carry new packets.
    pub(crate) last_ok_sent_at: Option<Micros>,
    /// When an exploring PING last went out on this alive path during a failure episode (see
    /// `Paths::next_explore`); its PONG proves the path.
    pub(crate) explored_at: Option<Micros>,
    /// The connection's RTO when a packet last left on this path: the path's own RTO never goes
    /// below it (see `rto_us`).
    pub(crate) rto_floor_us: Micros,
}

impl Path {
    pub(crate) fn new(rtt: RttEstimator) -> Self {
        Self {
            rtt,
            in_flight: 0,
            queue: VecDeque::new(),
            rto_fired_at: 0,
            health: PathHealth::Alive,
            consecutive_timeouts: 0,
            consecutive_losses: 0,
            last_loss_tx_seq: 0,
            delivered_tx_end: 0,
            delivered_rtt_us: 0,
            probe_failures: 0,
            timeout_tx_seq: None,
            bad_since: 0,
            probe: Probe::Idle,
            revive_wait: 0,
            max_rtt_since_timeout_us: 0,
            base_rtt_us: None,
            last_ok_sent_at: None,
            explored_at: None,
            rto_floor_us: 0,
        }
    }

    /// New packets may use this path without reservation: it lost nothing recently.
    pub(crate) fn alive(&self) -> bool {
        self.health == PathHealth::Alive
    }

    /// Not dead: new packets may use it when no alive path is available.
    pub(crate) fn usable(&self) -> bool {
        self.health != PathHealth::Dead
    }

    /// Proven to work since `since` (the start of a failure episode).
    pub(crate) fn proven_since(&self, since: Micros) -> bool {
        self.last_ok_sent_at.is_some_and(|t| t >= since)
    }

    /// Fit for new packets during `episode` (if a failure episode is going on, its start): proven since.
    pub(crate) fn proven_in(&self, episode: Option<Micros>) -> bool {
        match episode {
            None => true,
            Some(since) => self.proven_since(since),
        }
    }

    /// When this path's oldest packet in flight times out.
    pub(crate) fn rto_deadline(&self) -> Option<Micros> {
        self.queue.front().map(|f| f.sent_at.max(self.rto_fired_at).saturating_add(self.rto_us()))
    }

    /// The path's retransmission timeout: its own estimate (backoff included), but not below the
    /// connection's. Sprayed paths share their hosts' queues, and a path sampled a few times lately
    /// has too little spread in its samples for its own estimate to cover the queue's swings (on the
    /// rail fabric every timeout of a fault-free run was spurious: 150 to 200 per run); the
    /// connection sees every path's samples. Black holes are found by the time-based rule and by
    /// exploring, not by this timer.
    pub(crate) fn rto_us(&self) -> Micros {
        self.rtt.rto_us().max(self.rto_floor_us)
    }
}
