//! State every comm of the engine shares (`NetInner`): configuration, clock, rails, the load
//! balancer, the progress thread, statistics. Owned by `Net`; every comm and listener holds an `Arc`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use prism_lb::LbRuntime;

use super::batch::SendBatches;
use super::board::PathBoard;
use super::closed::ClosedComms;
use super::config::QpType;
use super::planned::{PlannedPaths, Plans, SharedRate};
use super::progress::{Host, Progress};
use super::rail::Rail;
use super::vcomm::VerbsComm;
use super::{TransportConfig, TransportError};
use crate::backend::verbs::VerbsDevice;
use crate::proto::{Connection, ProtoConfig};
use crate::wire::HelloRepr;

/// State every comm shares: configuration, clock, rails, statistics of closed comms.
pub(crate) struct NetInner {
    pub cfg: TransportConfig,
    pub lb: prism_lb::LbConfig,
    /// The load balancer shared by every comm (RailS loads, PRO/DR state per leaf, ...).
    pub lb_rt: LbRuntime,
    /// Ethereal's batching of sends across comms (`PRISM_ETHEREAL_BATCH_US` > 0 with `PRISM_SPLIT=ethereal`).
    pub batches: Option<SendBatches>,
    /// This host's id in the topology (or a stable id from its address when hosts are not listed).
    pub host_id: u32,
    pub proto: ProtoConfig,
    pub(super) start: Instant,
    pub rails: Vec<Arc<Rail>>,
    pub(super) closed: Mutex<ClosedComms>,
    /// This process's seed (`PRISM_SEED` mixed with the host, see `net::process_seed`; 0: random).
    pub(super) seed: u64,
    pub(super) seeds: AtomicU64,
    pub progress: Progress,
    /// Path knowledge shared by the comms that talk to the same peer rail.
    pub board: PathBoard,
    /// Handshake counters of the listeners.
    pub(super) handshakes: HandshakeStats,
}

impl NetInner {
    /// Microseconds since the engine started (proto's clock).
    pub fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Fold the final statistics of a closed comm (`v` without its connection's, `conn`) into the
    /// bounded record `stats_json` reports (see `closed`).
    pub fn record_stats(&self, v: serde_json::Value, conn: &crate::proto::ConnStats) {
        self.closed.lock().record(v, conn);
    }

    /// A seed for one connection's random choices: reproducible under `PRISM_SEED`.
    pub(super) fn conn_seed(&self) -> u64 {
        let n = self.seeds.fetch_add(1, Ordering::Relaxed);
        if self.seed == 0 {
            rand::random()
        } else {
            // The n-th output of a splitmix64 generator seeded with the base: distinct, well-mixed seeds.
            use prism_lb::hash::SPLITMIX64_GAMMA;
            prism_lb::splitmix64(self.seed.wrapping_add(n.wrapping_mul(SPLITMIX64_GAMMA)).wrapping_sub(SPLITMIX64_GAMMA))
        }
    }

    /// The largest datagram this engine takes on every rail, header included (told to peers in the
    /// HELLO).
    pub(super) fn max_datagram(&self) -> usize {
        self.rails.iter().map(|r| r.max_datagram).min().unwrap_or(0)
    }

    /// A protocol connection to the peer whose HELLO is `h`, whose path policy follows the lb plans
    /// stored in `plans` and reports to `rate`.
    ///
    /// On UDP its packets fit the peer's largest datagram as well as ours: a receiver cuts every
    /// datagram to its own largest (`Rail::new`) and drops what is longer, so a sender with a larger
    /// `PRISM_MTU` (or interface MTU) than its peer had every DATA packet dropped, retransmissions
    /// included, until the stall watchdog failed the transfer. (On verbs a WRITE's size is the
    /// sender's business; the receiver's work requests take any.)
    pub(super) fn connection(&self, local: u64, h: &HelloRepr, home: u16, plans: &Plans, rate: &SharedRate) -> Connection {
        let (peer, peer_host) = (h.token, h.host);
        let mut proto = self.proto.clone();
        if !self.is_verbs() {
            let fit = (h.max_dgram as usize).saturating_sub(crate::wire::MAX_HEADER_LEN);
            let fit = (fit - fit % crate::wire::LINE_BYTES).max(crate::wire::MIN_PAYLOAD);
            if fit < proto.max_payload {
                tracing::info!(
                    peer_max_datagram = h.max_dgram,
                    payload = fit,
                    own_payload = proto.max_payload,
                    "the peer takes smaller datagrams than this end: this connection's packets carry {fit} bytes"
                );
                proto.max_payload = fit;
            }
        }
        let seed = self.conn_seed();
        // UDP with GSO: runs of `PRISM_UDP_TRAIN` datagrams per entropy (verbs packets are whole
        // 64 KiB WRITEs already, and without GSO a run saves nothing).
        let train = match self.rails.first().and_then(|r| r.backend.udp()) {
            Some(u) if u.gso() => match self.cfg.train_pkts(self.rails.len(), proto.max_payload + crate::wire::MAX_HEADER_LEN) {
                1 => 0,
                n => u64::from(n) * proto.max_payload as u64,
            },
            _ => 0,
        };
        let policy = PlannedPaths::new(&self.lb_rt, peer_host as usize, self.rails.len() as u16, self.cfg.paths, home, seed, plans.clone())
            .with_rate(rate.clone())
            .with_train(train);
        Connection::new(proto, local, peer, Box::new(policy), self.now_us())
    }

    /// Is this engine on the verbs backend?
    pub fn is_verbs(&self) -> bool {
        self.rails.first().is_some_and(|r| r.backend.verbs().is_some())
    }

    /// "verbs" or "udp".
    pub fn backend_name(&self) -> &'static str {
        self.rails.first().map_or("udp", |r| r.backend.name())
    }

    /// A new connection's QPs (verbs backend), or None on UDP.
    pub(super) fn verbs_comm(&self, token: u64, connector: bool) -> Result<Option<VerbsComm>, TransportError> {
        if !self.is_verbs() {
            return Ok(None);
        }
        let devs: Vec<Arc<VerbsDevice>> = self.rails.iter().filter_map(|r| r.backend.verbs().cloned()).collect();
        let depths = self.cfg.verbs_depths();
        VerbsComm::create(&devs, self.cfg.paths, self.cfg.qp == QpType::Rc, depths, token, &self.proto, connector).map(Some)
    }
}

impl Host for NetInner {
    fn now_us(&self) -> u64 {
        NetInner::now_us(self)
    }
    fn progress(&self) -> &Progress {
        &self.progress
    }
    fn rails(&self) -> &[Arc<Rail>] {
        &self.rails
    }
}

/// Handshake counters of all listeners (shown in the stats JSON as `handshakes`).
#[derive(Default)]
pub(crate) struct HandshakeStats {
    pub(super) accepted: AtomicU64,
    pub(super) pending: AtomicU64,
    pub(super) dropped_full: AtomicU64,
    pub(super) dropped_timeout: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) peer_closed: AtomicU64,
    pub(super) accept_out_of_fds: AtomicU64,
}

impl HandshakeStats {
    pub(super) fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "accepted": g(&self.accepted), "pending": g(&self.pending), "dropped_full": g(&self.dropped_full),
            "dropped_timeout": g(&self.dropped_timeout), "rejected": g(&self.rejected), "peer_closed": g(&self.peer_closed),
            "accept_out_of_fds": g(&self.accept_out_of_fds),
        })
    }
}
