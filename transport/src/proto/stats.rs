//! Counters of one connection, kept up to date in place so `Connection::stats` is a plain borrow.

use serde::Serialize;

use crate::wire::WireError;

/// Health of one path as the sender sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PathHealth {
    /// Carries new packets.
    #[default]
    Alive,
    /// Lost a packet (or had a timeout) since it last delivered: avoided by new packets while alive
    /// paths exist, and probed.
    Suspect,
    /// Two losses in a row, `path_dead_after` timeouts in a row or an unanswered probe: avoided until
    /// a probe gets through.
    Dead,
}

/// Counters of one path (entropy).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathStats {
    /// The entropy.
    pub entropy: u16,
    /// DATA packets sent on this path (retransmissions included).
    pub pkts_sent: u64,
    /// DATA payload bytes sent on this path (retransmissions included).
    pub bytes_sent: u64,
    /// Retransmitted DATA packets sent on this path.
    pub retransmissions: u64,
    /// Retransmission timeouts of packets sent on this path.
    pub timeouts: u64,
    /// DATA packets currently in flight on this path.
    pub in_flight: u32,
    /// RTT samples taken (echoed timestamps of this path's packets).
    pub rtt_samples: u64,
    /// Smallest RTT sample, µs (0 before any sample).
    pub rtt_min_us: u64,
    /// Mean RTT sample, µs (0 before any sample).
    pub rtt_avg_us: u64,
    /// Largest RTT sample, µs.
    pub rtt_max_us: u64,
    /// Current smoothed RTT, µs (0 before any sample).
    pub srtt_us: u64,
    /// Current retransmission timeout, µs.
    pub rto_us: u64,
    /// Current health.
    pub state: PathHealth,
    /// Transitions between health states.
    pub state_changes: u64,
    /// Dead-path probes sent on this path.
    pub probes_sent: u64,
    #[serde(skip)]
    pub(crate) rtt_sum_us: u64,
}

impl PathStats {
    pub(crate) fn record_rtt(&mut self, rtt_us: u64) {
        self.rtt_min_us = if self.rtt_samples == 0 { rtt_us } else { self.rtt_min_us.min(rtt_us) };
        self.rtt_max_us = self.rtt_max_us.max(rtt_us);
        self.rtt_samples += 1;
        self.rtt_sum_us = self.rtt_sum_us.saturating_add(rtt_us);
        self.rtt_avg_us = self.rtt_sum_us / self.rtt_samples;
    }
}

/// Packets dropped, by reason. Nothing counted here was placed or acted upon.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DropStats {
    /// Shorter than its header promises.
    pub truncated: u64,
    /// Destination token is not this connection's.
    pub bad_token: u64,
    /// An offset or length outside the message, the posted buffer, or the packet.
    pub bad_offset_len: u64,
    /// Unknown packet type or control kind.
    pub unknown_type: u64,
    /// Unsupported protocol version.
    pub bad_version: u64,
    /// Another inconsistent field (buffer count, CTS numbering, acknowledgement of unsent packets).
    pub malformed: u64,
    /// DATA for a receive that is not outstanding (never posted, or already finished).
    pub unknown_msg: u64,
    /// DATA too far above the cumulative PSN for the out-of-order window.
    pub beyond_window: u64,
    /// DATA for bytes of a buffer that already arrived under another PSN (forged or corrupted).
    pub overlapping: u64,
    /// Arrived after the connection died or was closed.
    pub after_close: u64,
}

impl DropStats {
    pub(crate) fn count(&mut self, e: &WireError) {
        let c = match e {
            WireError::Truncated { .. } => &mut self.truncated,
            WireError::BadVersion { .. } => &mut self.bad_version,
            WireError::UnknownType { .. } | WireError::WrongType { .. } => &mut self.unknown_type,
            WireError::TrailingBytes { .. } | WireError::BadRange { .. } => &mut self.bad_offset_len,
            WireError::BadField { .. } => &mut self.malformed,
        };
        *c += 1;
    }

    /// Every drop, whatever the reason.
    pub fn total(&self) -> u64 {
        self.truncated
            + self.bad_token
            + self.bad_offset_len
            + self.unknown_type
            + self.bad_version
            + self.malformed
            + self.unknown_msg
            + self.beyond_window
            + self.overlapping
            + self.after_close
    }
}

/// Counters of one connection (both roles).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ConnStats {
    /// DATA packets sent, retransmissions included.
    pub data_pkts_sent: u64,
    /// DATA payload bytes sent, retransmissions included.
    pub data_bytes_sent: u64,
    /// DATA packets retransmitted.
    pub retransmissions: u64,
    /// Packets declared lost by the time-based rule: overdue (an RTT and a reordering window after
    /// they left) while a packet sent after them arrived. Includes the tail losses a tail-loss probe
    /// revealed.
    pub time_losses: u64,
    /// Packets declared lost by the reorder count (`reorder_threshold` later transmissions
    /// acknowledged) before the time-based rule found them.
    pub reorder_losses: u64,
    /// Packets declared lost by a path's retransmission timeout (the backstop: neither rule above
    /// nor a tail-loss probe found them).
    pub timeout_losses: u64,
    /// DATA copies declared lost (by time, count or timeout) that left while a failure episode was
    /// already going on: what the episode's rules (new packets and retransmissions on paths proven
    /// since it began) did not keep off a failing path. A diagnostic for how fast a connection leaves
    /// a failure, next to the losses that revealed it.
    pub episode_losses: u64,
    /// Of `episode_losses`, retransmissions (tail-loss probes included).
    pub episode_losses_resent: u64,
    /// Tail-loss probes sent: nothing was acknowledged for two RTTs with packets in flight.
    pub tail_probes: u64,
    /// Retransmissions found needless: the packet was acknowledged before the resend went out, or
    /// the receiver reported the resent copy as a duplicate.
    pub spurious_retransmissions: u64,
    /// Retransmission timeouts (one per path per expiry).
    pub timeouts: u64,
    /// Timeouts while nothing at all was heard from the peer since the packet left (a stall, not a
    /// broken path): packets resent, path not blamed.
    pub stall_timeouts: u64,
    /// Current reorder threshold (adaptive).
    pub reorder_threshold: u32,
    /// Valid DATA packets received (duplicates included).
    pub data_pkts_received: u64,
    /// Payload bytes placed into posted buffers.
    pub data_bytes_placed: u64,
    /// DATA packets that had arrived before (network duplicates or spurious retransmissions).
    pub duplicates: u64,
    /// SACKs sent.
    pub sacks_sent: u64,
    /// SACKs received and accepted.
    pub sacks_received: u64,
    /// CTS sent, first copies.
    pub cts_sent: u64,
    /// CTS resent after their timer expired.
    pub cts_retransmitted: u64,
    /// Second copies of a CTS, sent on another path right after the first (`cts_sent` and
    /// `cts_retransmitted` count each CTS once).
    pub cts_copies: u64,
    /// CTS received (duplicates included).
    pub cts_received: u64,
    /// Other control packets sent (ACK, PING, PONG, CLOSE).
    pub control_sent: u64,
    /// Other control packets received.
    pub control_received: u64,
    /// Keepalive PINGs sent.
    pub keepalives_sent: u64,
    /// Packets dropped, by reason.
    pub dropped: DropStats,
    /// One entry per entropy.
    pub paths: Vec<PathStats>,
}
