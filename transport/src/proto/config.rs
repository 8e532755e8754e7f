//! Protocol parameters of one connection.

use super::OOO_WINDOW_PKTS;
use crate::wire::{LINE_BYTES, MIN_PAYLOAD};

/// Protocol parameters of one connection. Times are microseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtoConfig {
    /// Entropies (paths) `0..n_paths`.
    pub n_paths: u16,
    /// Payload bytes per DATA packet; no packet exceeds `max_payload + wire::MAX_HEADER_LEN` bytes.
    /// Used rounded down to a multiple of [`LINE_BYTES`], so that packet boundaries fall on line
    /// boundaries of the message.
    pub max_payload: usize,
    /// Most DATA packets in flight per connection.
    pub window_pkts: u32,
    /// Initial reorder threshold: a packet is lost once this many later transmissions were acknowledged.
    /// It adapts: +1 per spurious loss, halved (not below this value) per timeout.
    pub reorder_threshold: u32,
    /// Smallest retransmission timeout.
    pub rto_min_us: u64,
    /// Largest retransmission timeout (backoff stops here).
    pub rto_max_us: u64,
    /// Retransmission timeout before any RTT sample.
    pub rto_initial_us: u64,
    /// Consecutive timeouts on one path before it is marked dead.
    pub path_dead_after: u32,
    /// A dead path is probed again after this long.
    pub path_revive_us: u64,
    /// Outstanding requests fail after this long without a valid packet from the peer.
    pub peer_timeout_us: u64,
    /// A keepalive PING goes out after this long without hearing from the peer while work is outstanding.
    pub keepalive_us: u64,
    /// Outstanding requests fail after this long without progress while the peer is heard (alive but
    /// stuck): the oldest unacknowledged DATA packet not acknowledged, or a receive that got part of
    /// its message and no new data since. Waiting for the peer to post is not a stall.
    pub stall_timeout_us: u64,
    /// The receiver acknowledges at least every this many DATA packets...
    pub sack_every_pkts: u32,
    /// ... or this long after the first unacknowledged one.
    pub sack_delay_us: u64,
    /// Every path delivers reliably and in order by itself (verbs: one reliable connected QP per
    /// path; false for UDP and the simulator's packet-switched paths). Then a hole in the PSNs is
    /// only reordering between paths, not a loss, and is acknowledged like any other packet (a SACK
    /// per hole cost one per data packet), and a CTS goes out once instead of twice (the copy is for
    /// a CTS lost on the way; a path that fails takes everything in flight on it with it and is
    /// found like any other failure).
    pub reliable_paths: bool,
}

impl Default for ProtoConfig {
    fn default() -> Self {
        Self {
            n_paths: 16,
            max_payload: 8192,
            window_pkts: 512,
            reorder_threshold: 32,
            rto_min_us: 2_000,
            rto_max_us: 200_000,
            rto_initial_us: 10_000,
            path_dead_after: 3,
            path_revive_us: 100_000,
            peer_timeout_us: 10_000_000,
            keepalive_us: 100_000,
            stall_timeout_us: 20_000_000,
            sack_every_pkts: 8,
            sack_delay_us: 50,
            reliable_paths: false,
        }
    }
}

impl ProtoConfig {
    /// The same configuration with every value forced into the range the protocol can run with
    /// (a connection cannot refuse to exist, so unusable values are corrected and logged).
    pub(crate) fn sanitized(&self) -> Self {
        let mut c = self.clone();
        c.n_paths = c.n_paths.max(1);
        c.max_payload = line_floor(c.max_payload.clamp(MIN_PAYLOAD, u32::MAX as usize));
        c.window_pkts = c.window_pkts.clamp(1, OOO_WINDOW_PKTS as u32);
        c.reorder_threshold = c.reorder_threshold.clamp(1, OOO_WINDOW_PKTS as u32);
        c.rto_min_us = c.rto_min_us.max(1);
        c.rto_max_us = c.rto_max_us.max(c.rto_min_us);
        c.rto_initial_us = c.rto_initial_us.clamp(c.rto_min_us, c.rto_max_us);
        c.path_dead_after = c.path_dead_after.max(1);
        c.path_revive_us = c.path_revive_us.max(1);
        c.peer_timeout_us = c.peer_timeout_us.max(1);
        c.keepalive_us = c.keepalive_us.max(1);
        c.stall_timeout_us = c.stall_timeout_us.max(1);
        c.sack_every_pkts = c.sack_every_pkts.max(1);
        // Compared field by field: formatting both (as before) cost more than the rest of making a
        // connection, which simulations with tens of thousands of connections felt.
        if c != *self {
            tracing::warn!(given = ?self, used = ?c, "protocol configuration corrected to usable values");
        }
        c
    }
}

/// `n` rounded down to a multiple of [`LINE_BYTES`].
pub(crate) fn line_floor(n: usize) -> usize {
    n - n % LINE_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_already_usable() {
        assert_eq!(format!("{:?}", ProtoConfig::default().sanitized()), format!("{:?}", ProtoConfig::default()));
    }

    #[test]
    fn zero_values_are_raised_to_workable_minimums() {
        let zero = ProtoConfig {
            n_paths: 0,
            max_payload: 0,
            window_pkts: 0,
            reorder_threshold: 0,
            rto_min_us: 0,
            rto_max_us: 0,
            rto_initial_us: 0,
            path_dead_after: 0,
            path_revive_us: 0,
            peer_timeout_us: 0,
            keepalive_us: 0,
            stall_timeout_us: 0,
            sack_every_pkts: 0,
            sack_delay_us: 0,
            reliable_paths: false,
        };
        let c = zero.sanitized();
        assert_eq!((c.n_paths, c.max_payload, c.window_pkts, c.sack_every_pkts), (1, MIN_PAYLOAD, 1, 1));
        assert!(c.rto_min_us >= 1 && c.rto_max_us >= c.rto_min_us && c.rto_initial_us >= c.rto_min_us);
    }

    #[test]
    fn max_payload_is_rounded_down_to_whole_lines() {
        for (given, used) in [(8908, 8832), (1408, 1408), (1409, 1408), (1535, 1408), (129, 128), (100, 128), (65_536, 65_536)] {
            let c = ProtoConfig { max_payload: given, ..ProtoConfig::default() }.sanitized();
            assert_eq!(c.max_payload, used, "max_payload {given}");
            assert_eq!(c.max_payload % LINE_BYTES, 0);
        }
    }
}
