//! The sans-IO connection core: receiver-driven matching (CTS), selective repeat over many paths,
//! per-path RTT/RTO, SACK, the receiver's out-of-order window, keepalives and peer timeouts.
//!
//! A [`Connection`] never touches a socket, a clock or a thread. The driver (UDP engine, simulator,
//! tests) feeds it datagrams and the time, and asks it what to send ([`Connection::poll_transmit`]),
//! when to wake it ([`Connection::poll_timeout`]) and what finished ([`Connection::poll_completion`]).
//! Payload moves only through [`PayloadSource`] (sender) and [`Placer`] (receiver), and only with ranges
//! checked against the sizes posted by the application. Everything is deterministic: no hashing order,
//! no hidden randomness (the path policy brings its own seeded RNG).
//!
//! How the pieces fit (the packet layouts are in [`crate::wire`]):
//! - **Matching.** `post_recv` queues a CTS (sequence number, buffer sizes and tags). The sender holds
//!   CTS in sequence order and puts each send, in posting order, into the first unmatched buffer with
//!   its tag of the oldest group that has one, as NCCL does; a send no held group has a buffer for
//!   waits without holding up sends of other tags, and per tag sends fill buffers in posting order. A send larger than its buffer fails `Truncated` at once and
//!   sends one payload-less TRUNC packet instead, which ends that buffer at the receiver.
//! - **Reliable control.** Every packet's header carries `cts_ack` (all CTS below it were received), so
//!   data acknowledges CTS; with nothing else to send the sender answers a CTS with an ACK. The receiver
//!   resends a CTS on a timer with backoff until it is acknowledged.
//! - **Selective repeat.** PSNs are per connection and 64-bit (they never wrap). The receiver keeps an
//!   out-of-order window of [`OOO_WINDOW_PKTS`] PSNs and sends SACKs (cumulative PSN, 256-PSN bitmap,
//!   echo of the triggering packet's entropy and timestamp) on a gap, a duplicate, a filled hole, a
//!   message's last packet, every `sack_every_pkts` packets or after `sack_delay_us`. The sender declares a packet lost once
//!   `reorder_threshold` later *transmissions* were acknowledged (for first copies that is the PSN
//!   distance; retransmissions keep their PSN), or when its path's RTO expires, and resends it on
//!   another path. A duplicate of a resent packet is reported back and widens the threshold.
//! - **Paths.** Per entropy: RFC 6298 RTT/RTO from echoed timestamps, packets in flight, health.
//!   One timeout makes a path suspect; `path_dead_after` consecutive timeouts, or a run of losses with
//!   nothing later delivered on it, make it dead: its packets in flight are written off, new packets
//!   avoid it, and after `path_revive_us` a PING probes it. Every event goes to the policy as
//!   [`prism_lb::Feedback`].
//! - **Liveness.** While requests are outstanding, a PING goes out after `keepalive_us` of silence
//!   (answered by the peer whatever its state), and `peer_timeout_us` of silence fails everything.
//!   A peer that answers but lets a request make no progress for `stall_timeout_us` (its oldest DATA
//!   packet never acknowledged, or a started receive getting no new data) fails everything too.
//!   `close` sends CLOSE (carrying the receive-side cumulative PSN, so the peer can still complete the
//!   sends that arrived); the peer then fails what is outstanding with `PeerClosed`.

mod config;
mod connection;
mod deadline;
mod gate;
mod path;
mod paths;
mod receiver;
mod recovery;
mod rtt;
mod sender;
mod stats;
mod transmit;
mod window;

pub use config::ProtoConfig;
pub use connection::Connection;
pub use gate::GateStats;
pub use stats::{ConnStats, DropStats, PathHealth, PathStats};

/// The caller's monotonic clock, in microseconds.
pub type Micros = u64;

/// Most sends outstanding on one connection; one more is `Full`. NCCL keeps up to `maxRecvs` (8) × 32
/// sends in flight per comm (NCCL's IB sender has 256 request slots).
pub const MAX_OUTSTANDING_SENDS: usize = 256;

/// Most grouped receives outstanding on one connection; one more is `Full`. NCCL posts up to 32.
pub const MAX_OUTSTANDING_RECVS: usize = 64;

/// Most requests outstanding on one connection, sends and grouped receives together.
pub const MAX_OUTSTANDING: usize = MAX_OUTSTANDING_SENDS + MAX_OUTSTANDING_RECVS;

/// Most buffers in one grouped receive.
pub const MAX_RECV_BUFS: usize = crate::wire::MAX_RECV_BUFS;

/// PSNs the receiver's out-of-order window spans above its cumulative PSN. Both ends use this
/// constant: the sender never sends a PSN this far above the oldest unacknowledged one, so a
/// well-behaved peer never overruns the window.
pub const OOO_WINDOW_PKTS: u64 = 4096;

/// Identifies one posted request (send or grouped receive) on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MsgId(pub u64);

/// One buffer of a grouped receive.
#[derive(Debug, Clone, Copy)]
pub struct RecvSpec {
    /// Bytes the buffer holds.
    pub len: u64,
    /// NCCL tag a matching send must carry.
    pub tag: i32,
}

/// Why a request could not be posted.
#[derive(Debug, thiserror::Error)]
pub enum PostError {
    /// Too many requests of this kind are outstanding; retry after one completes.
    #[error(
        "too many requests outstanding on this connection (at most {MAX_OUTSTANDING_SENDS} sends and \
         {MAX_OUTSTANDING_RECVS} grouped receives); retry after one completes"
    )]
    Full,
    /// A grouped receive must have between 1 and [`MAX_RECV_BUFS`] buffers.
    #[error("grouped receive of {0} buffers: must have between 1 and {MAX_RECV_BUFS}")]
    TooManyBuffers(usize),
    /// The connection is dead or closed; nothing can be posted any more.
    #[error("connection is dead: {0}")]
    Dead(MsgError),
}

/// One datagram ready in the caller's buffer: `out[..len]`, to be sent on path `entropy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Entropy (path index, `0..n_paths`) to send on.
    pub entropy: u16,
    /// Bytes of the datagram.
    pub len: usize,
}

/// Receiver side: where payload goes. Called only with `offset + data.len()` within the posted size of
/// buffer `sub` of receive `msg`.
pub trait Placer {
    /// Copy `data` to `offset` of buffer `sub` of the grouped receive `msg`.
    fn place(&mut self, msg: MsgId, sub: usize, offset: u64, data: &[u8]);
}

/// A placer that writes nothing: for payload the network already put in place (an RDMA WRITE) or a
/// driver that does not model bytes (the simulator).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPlacement;

impl Placer for NoPlacement {
    fn place(&mut self, _: MsgId, _: usize, _: u64, _: &[u8]) {}
}

/// Sender side: where payload comes from. Called only with `offset + out.len()` within the send's length.
pub trait PayloadSource {
    /// Fill `out` with the bytes of send `msg` starting at `offset`.
    fn read(&mut self, msg: MsgId, offset: u64, out: &mut [u8]);
}

/// A finished request.
#[derive(Debug)]
pub enum Completion {
    /// Every byte of the send was acknowledged by the receiver.
    Sent {
        /// The send.
        msg: MsgId,
        /// Its length.
        len: u64,
    },
    /// Every buffer of the grouped receive got its message.
    Received {
        /// The grouped receive.
        msg: MsgId,
        /// One entry per posted buffer: the size the sender actually sent.
        sizes: Vec<u64>,
    },
    /// The request failed.
    Failed {
        /// The request.
        msg: MsgId,
        /// Why.
        error: MsgError,
    },
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    /// The send is larger than the receive buffer it matched; nothing beyond the buffer was written.
    #[error("message truncated: the send has {send_len} bytes but the matching receive buffer holds {recv_len}")]
    Truncated {
        /// Bytes of the send.
        send_len: u64,
        /// Bytes of the posted buffer.
        recv_len: u64,
    },
    /// Nothing was heard from the peer for this long while requests were outstanding.
    #[error("peer silent for {silent_ms} ms while requests were outstanding; it is presumed dead")]
    PeerTimeout {
        /// Milliseconds of silence.
        silent_ms: u64,
    },
    /// The peer kept answering but a request made no progress for this long: DATA stayed
    /// unacknowledged or a started receive got no new data (a path that carries control packets but
    /// not DATA, a peer that rejects what it gets).
    #[error("no progress for {stalled_ms} ms while the peer was alive: {reason}")]
    Stalled {
        /// Milliseconds without progress.
        stalled_ms: u64,
        /// What did not move.
        reason: &'static str,
    },
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// This end closed the connection.
    #[error("the connection was closed locally")]
    Closed,
}
