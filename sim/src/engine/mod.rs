//! The simulation of one run: the fabric, the hosts' connections (real `proto` state machines driven
//! with simulated time), the workload's transfers, and the event loop that ties them together.
//!
//! Each flow piece (source, destination, rail, pinned uplink) is a pair of `proto::Connection`s: the
//! sender's end posts sends and emits DATA, the receiver's end posts receives (ahead of the sends, as
//! NCCL does) and emits CTS and SACKs. A host's NIC pulls the next datagram from its connections
//! round-robin whenever the wire is free, so the NIC is never faster than line rate and its connections
//! share it fairly. Packets carry the real wire bytes (headers; the payload's bytes are not copied).
//!
//! [`Sim`] holds the event queue and the clock; each concern has its own part and its own file:
//! - [`network`]: the fabric's ports, packets and link changes (serialisation, queues, drops, ECN);
//! - [`hosts`]: the connection pairs, their posting of sends and receives, the NICs' round-robin;
//! - [`work`]: the workload's transfers, their dependencies and their planning by `prism-lb`;
//! - [`metrics`]: counters, queue samples and the [`RunResult`].

mod hosts;
mod metrics;
mod network;
mod work;

use std::time::Instant;

use prism_lb::LbConfig;
use prism_transport::proto::ProtoConfig;
use rand::{rngs::SmallRng, SeedableRng};

use crate::events::{Event, EventQueue, Ps, MAX_PORTS, PS_PER_US};
use crate::fabric::{Fabric, PacketPool};
use crate::scenario::{invalid, Scenario, ScenarioError, SchemeSpec};
use crate::workload;

use hosts::Hosts;
use metrics::{ps_to_us, Metrics};
pub use metrics::{LayerStats, ProtoTotals, RunResult};
use network::Network;
use work::Work;

/// One run in progress.
pub struct Sim {
    q: EventQueue,
    now: Ps,
    max_ps: Ps,
    seed: u64,
    progress: Option<indicatif::ProgressBar>,
    net: Network,
    hosts: Hosts,
    work: Work,
    metrics: Metrics,
}

impl Sim {
    /// Prepare run `seed` of `scheme` on `sc` with message size `size` (if swept), with or without the
    /// scenario's failures.
    pub fn new(sc: &Scenario, scheme: &SchemeSpec, size: Option<u64>, with_failures: bool, seed: u64) -> Result<Self, ScenarioError> {
        let cfg = LbConfig::from_vars(&scheme.vars).map_err(|source| ScenarioError::Lb { scheme: scheme.name.clone(), source })?;
        let fab = Fabric::new(&sc.topology, &sc.link, scheme.switch, scheme.flowlet_gap_us, seed)?;
        if fab.ports.len() > MAX_PORTS {
            return Err(invalid("topology", format!("{} ports; the event queue names at most {MAX_PORTS}", fab.ports.len())));
        }
        let topo = fab.lb_topology()?;
        let runtimes = (0..fab.hosts)
            .map(|h| {
                cfg.runtime(topo.clone(), h, seed.wrapping_mul(0x9E37_79B9).wrapping_add(h as u64))
                    .map_err(|e| invalid("topology", e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let n_paths = sc
            .proto
            .n_paths
            .unwrap_or_else(|| (fab.paths_between_leaves as u64 * sc.proto.entropies_per_path.max(1) as u64).min(4096) as u16);
        let p = &sc.proto;
        let proto = ProtoConfig {
            n_paths: n_paths.max(1),
            max_payload: sc.packet.payload,
            window_pkts: p.window_pkts,
            reorder_threshold: p.reorder_threshold,
            rto_min_us: p.rto_min_us,
            rto_max_us: p.rto_max_us,
            rto_initial_us: p.rto_initial_us,
            path_dead_after: p.path_dead_after,
            path_revive_us: 100_000,
            peer_timeout_us: 10_000_000,
            keepalive_us: 100_000,
            stall_timeout_us: 20_000_000,
            sack_every_pkts: p.sack_every_pkts,
            sack_delay_us: p.sack_delay_us,
            // The simulated paths are packet-switched and lossy like UDP's.
            reliable_paths: false,
        };
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x00C0_FFEE);
        let transfers = workload::generate(&sc.workload, fab.hosts, fab.rails, size, &mut rng)?;
        if transfers.iter().any(|t| t.recv_at_start)
            && (fab.rails != 1 || cfg.split != prism_lb::SplitKind::None || cfg.cc == prism_lb::CcKind::Mcc)
        {
            // A receive posted at the start sits on the connection the send will use: one rail and
            // whole, unsplit, ungated messages make that connection known before the send is planned.
            return Err(invalid("workload.parallel", "receives posted at the start need one rail, PRISM_SPLIT=none and no MCC"));
        }
        let changes = if with_failures { network::link_changes(&fab, &sc.failures, seed)? } else { Vec::new() };
        let nics = fab.hosts * fab.rails;
        let n_hosts = fab.hosts;
        Ok(Self {
            q: EventQueue::new(),
            now: 0,
            max_ps: (sc.max_sim_ms * 1e9) as Ps,
            seed,
            progress: None,
            hosts: Hosts::new(cfg, scheme.clone(), proto, runtimes, nics, sc.packet.payload),
            work: Work::new(transfers, n_hosts),
            metrics: Metrics::new((sc.sample_us * PS_PER_US as f64) as Ps),
            net: Network { fab, pool: PacketPool::default(), payload: sc.packet.payload, overhead: sc.packet.overhead, changes },
        })
    }

    /// Show a progress bar (simulated time against `expect_us`) while running.
    pub fn with_progress(mut self, label: &str, expect_us: f64) -> Self {
        let pb = indicatif::ProgressBar::new(expect_us.max(1.0) as u64);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len} µs sim {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb.set_prefix(label.to_string());
        self.progress = Some(pb);
        self
    }

    /// The fabric (ports and their counters).
    pub fn fabric(&self) -> &Fabric {
        &self.net.fab
    }

    /// Packets the hosts put on the wire, packets that reached a host, and packets still in the fabric
    /// (the run stops when the last transfer completes).
    pub fn packet_counts(&self) -> (u64, u64, u64) {
        (self.metrics.created, self.metrics.delivered, self.net.pool.live() as u64)
    }

    /// Run to completion (or the time limit) and report.
    pub fn run(&mut self, size: u64, failures: bool) -> RunResult {
        let wall = Instant::now();
        let bound = self.bound_us();
        for (i, c) in self.net.changes.iter().enumerate() {
            self.q.push(c.at, Event::LinkChange { change: i as u32 });
        }
        if self.metrics.sample_ps > 0 {
            self.q.push(0, Event::Sample);
        }
        for i in 0..self.work.transfers.len() {
            let tr = &self.work.transfers[i];
            if tr.recv_at_start && tr.src != tr.dst && tr.bytes > 0 {
                let (src, dst, bytes) = (tr.src, tr.dst, tr.bytes);
                let pair = self.pair_for(src, dst, 0, 0, None);
                self.hosts.pairs[pair as usize].pending_recv.push_back(hosts::Piece { transfer: i as u32, bytes, ready_at: 0 });
                self.pump_recv(pair);
            }
        }
        for i in 0..self.work.transfers.len() {
            if self.work.transfers[i].deps.is_empty() {
                let at = (self.work.transfers[i].start_us * PS_PER_US as f64) as Ps;
                self.make_ready(i as u32, at);
            }
        }
        let mut next_tick = 0u64;
        while let Some((t, ev)) = self.q.pop() {
            self.metrics.peak_events = self.metrics.peak_events.max(self.q.len());
            if self.work.remaining == 0 || t > self.max_ps {
                break;
            }
            self.now = t;
            self.touch_next();
            self.dispatch(ev);
            if let Some(pb) = &self.progress {
                let n = self.q.processed();
                if n >= next_tick {
                    next_tick = n + 200_000;
                    pb.set_position(ps_to_us(t) as u64);
                    let secs = wall.elapsed().as_secs_f64().max(1e-9);
                    pb.set_message(format!("{:.1} M events/s", n as f64 / secs / 1e6));
                }
            }
        }
        if let Some(pb) = self.progress.take() {
            pb.finish_and_clear();
        }
        let wall_s = wall.elapsed().as_secs_f64();
        self.report(size, failures, bound, wall_s)
    }

    /// Read what the next event will need first (its port, its packet, the header of a packet reaching
    /// a host, an endpoint's timer) before handling this one, so that those memory fetches overlap with
    /// this event's work instead of stalling the next (a 128-host 256 KiB all-to-all took about 3% less
    /// user CPU time, lower in 11 of 12 alternating pairs of runs). Reads only: nothing the run computes
    /// depends on them.
    #[inline]
    fn touch_next(&self) {
        match self.q.peek_near() {
            Some(Event::Arrive { pkt, port }) => {
                let to = self.net.fab.ports[port as usize].to;
                std::hint::black_box((to, self.net.pool.get(pkt).dst_nic));
                if self.net.fab.tier(to) == 0 {
                    std::hint::black_box(self.net.pool.body(pkt).hdr[0]);
                }
            }
            Some(Event::PortFree { port }) => {
                std::hint::black_box(self.net.fab.ports[port as usize].queued_bytes);
            }
            Some(Event::Timer { ep }) => self.hosts.touch(ep),
            _ => {}
        }
    }

    fn dispatch(&mut self, ev: Event) {
        self.metrics.count_event(&ev);
        match ev {
            Event::Arrive { pkt, port } => self.on_arrive(pkt, port),
            Event::PortFree { port } => self.on_port_free(port),
            Event::Timer { ep } => self.on_timer(ep),
            Event::Pump { pair } => {
                if self.hosts.pairs[pair as usize].pump_at == Some(self.now) {
                    self.hosts.pairs[pair as usize].pump_at = None;
                }
                self.pump_send(pair);
            }
            Event::StartBatch { host } => self.start_batch(host),
            Event::LinkChange { change } => self.net.apply_link_change(change),
            Event::Sample => self.sample(),
        }
    }

    /// The protocol clock (µs) at the current simulated time.
    #[inline]
    fn now_us(&self) -> u64 {
        self.now / PS_PER_US
    }
}
