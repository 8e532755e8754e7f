//! The feedback every policy may consume. The transport reports; what a policy does with it is its own
//! business (REPS recycles entropies, PRO skips dead paths, MCC adjusts a window, spray ignores it).

/// One feedback event about one entropy (path) of one flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feedback {
    /// A packet sent on `entropy` was acknowledged. `congested` is the ECN echo or the transport's
    /// delay-based congestion verdict; `rtt_us` the sample taken from the echoed timestamp.
    Ack { entropy: u16, rtt_us: u32, congested: bool, bytes: u32, now_us: u64 },
    /// A packet sent on `entropy` was reported lost (reorder threshold exceeded).
    Nack { entropy: u16, now_us: u64 },
    /// A retransmission timeout fired. `entropy` is the path of the timed-out packet when the
    /// transport knows it. `max_rtt_us` is the largest RTT seen since the last timeout and `base_rtt_us`
    /// the smallest ever seen, so a policy can tell a failure (low RTT, then silence) from congestion.
    Timeout { entropy: Option<u16>, max_rtt_us: u32, base_rtt_us: u32, now_us: u64 },
    /// The transport declared the path dead (repeated timeouts) or alive again.
    PathState { entropy: u16, alive: bool, now_us: u64 },
}
