//! The feedback every policy may consume. The transport reports; what a policy does with it is its own
//! business (REPS recycles entropies, PRO skips dead paths, MCC adjusts a window, spray ignores it).

/// One feedback event about one entropy (path) of one flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feedback {
    /// A packet sent on `entropy` was acknowledged. `congested` is the ECN echo or the transport's
    /// delay-based congestion verdict; `rtt_us` the sample taken from the echoed timestamp.
    Ack {
        /// The entropy the acknowledged packet used.
        entropy: u16,
        /// RTT sample, µs.
        rtt_us: u32,
        /// ECN echo or the transport's delay verdict.
        congested: bool,
        /// Payload bytes acknowledged.
        bytes: u32,
        /// Caller's clock, µs.
        now_us: u64,
    },
    /// A packet sent on `entropy` was reported lost (reorder threshold exceeded, or overdue by time).
    Nack {
        /// The entropy the lost packet used.
        entropy: u16,
        /// The path itself lost it: a packet sent after it on the same entropy arrived first (a path
        /// keeps its packets in order), which is what a per-path NACK of a RoCE QP says. False when
        /// only packets on other paths overtook it: queues of different depth reorder a sprayed
        /// connection's paths without losing anything, and such a loss may yet turn out spurious.
        own_path: bool,
        /// Caller's clock, µs.
        now_us: u64,
    },
    /// A retransmission timeout fired. `entropy` is the path of the timed-out packet when the
    /// transport knows it. `max_rtt_us` is the largest RTT seen since the last timeout and `base_rtt_us`
    /// the smallest ever seen, so a policy can tell a failure (low RTT, then silence) from congestion.
    Timeout {
        /// The timed-out packet's entropy, when known.
        entropy: Option<u16>,
        /// Largest RTT since the last timeout, µs.
        max_rtt_us: u32,
        /// Smallest RTT ever seen, µs (0 when none was measured).
        base_rtt_us: u32,
        /// Caller's clock, µs.
        now_us: u64,
    },
    /// The transport declared the path dead (repeated timeouts) or alive again.
    PathState {
        /// The entropy concerned.
        entropy: u16,
        /// False when the path is dead.
        alive: bool,
        /// Caller's clock, µs.
        now_us: u64,
    },
}

impl Feedback {
    /// The entropy the event is about, when it names one.
    pub fn entropy(&self) -> Option<u16> {
        match *self {
            Feedback::Ack { entropy, .. } | Feedback::Nack { entropy, .. } | Feedback::PathState { entropy, .. } => Some(entropy),
            Feedback::Timeout { entropy, .. } => entropy,
        }
    }

    /// The caller's clock when the event happened, µs.
    pub fn now_us(&self) -> u64 {
        match *self {
            Feedback::Ack { now_us, .. }
            | Feedback::Nack { now_us, .. }
            | Feedback::Timeout { now_us, .. }
            | Feedback::PathState { now_us, .. } => now_us,
        }
    }
}
