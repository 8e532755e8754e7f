//! The simulation of one run: the fabric, the hosts' connections (real `proto` state machines driven
//! with simulated time), the workload's transfers, and the event loop that ties them together.
//!
//! Each flow piece (source, destination, rail, pinned uplink) is a pair of `proto::Connection`s: the
//! sender's end posts sends and emits DATA, the receiver's end posts receives (ahead of the sends, as
//! NCCL does) and emits CTS and SACKs. A host's NIC pulls the next datagram from its connections
//! round-robin whenever the wire is free, so the NIC is never faster than line rate and its connections
//! share it fairly. Packets carry the real wire bytes (headers; the payload's bytes are not copied).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prism_lb::{CcKind, FlowInfo, LbConfig, LbRuntime, MessageSample, RailKind, SendReq};
use prism_transport::proto::{Completion, Connection, MsgId, PayloadSource, Placer, ProtoConfig, RecvSpec};
use prism_transport::wire::{self, data::FLAG_CE, Header, DATA_HEADER_LEN};
use rand::{rngs::SmallRng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::events::{Event, EventQueue, Ps, PS_PER_US};
use crate::fabric::{Fabric, Packet, PacketBody, PacketMeta, PacketPool, MAX_HDR};
use crate::host::{locked, PacketAimd, SharedAimd, SharedRate, SimPolicy};
use crate::scenario::{invalid, RateMode, Scenario, ScenarioError, SchemeSpec};
use crate::workload::{self, Transfer};

/// Tokens are `TOKEN_BASE + endpoint index`: the receiving host demultiplexes by the token in the
/// datagram, as the UDP engine does.
const TOKEN_BASE: u64 = 0x5052_4953_4d00_0000;
/// Receives posted ahead per connection (below `proto::MAX_OUTSTANDING_RECVS`).
const RECV_AHEAD: usize = 48;
/// Sends posted at once per connection.
const SEND_AHEAD: usize = 48;

struct NoPayload;
impl PayloadSource for NoPayload {
    fn read(&mut self, _msg: MsgId, _offset: u64, _out: &mut [u8]) {}
}
struct NoPlace;
impl Placer for NoPlace {
    fn place(&mut self, _msg: MsgId, _sub: usize, _offset: u64, _data: &[u8]) {}
}

struct Endpoint {
    conn: Connection,
    nic: u32,
    peer_nic: u32,
    pair: u32,
    sender: bool,
    timer_at: Option<Ps>,
    in_ready: bool,
    max_psn: Option<u64>,
}

#[derive(Clone, Copy)]
struct Piece {
    transfer: u32,
    bytes: u64,
    ready_at: Ps,
}

struct Pair {
    ep_send: u32,
    ep_recv: u32,
    pending_send: VecDeque<Piece>,
    pending_recv: VecDeque<Piece>,
    posted_send: VecDeque<(MsgId, u64, Ps)>,
    posted_recv: VecDeque<(MsgId, u32, u64)>,
    out_bytes: u64,
    rate: Option<SharedRate>,
    aimd: Option<SharedAimd>,
    pump_at: Option<Ps>,
}

struct TState {
    deps_left: u32,
    dependents: Vec<u32>,
    received: u64,
    done_at: Option<Ps>,
}

/// Per-layer queue and utilisation figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LayerStats {
    /// Layer name (`leaf->spine`, ...).
    pub layer: String,
    /// Ports in the layer.
    pub ports: usize,
    /// Largest queue any port of the layer held, bytes.
    pub max_queue_bytes: u64,
    /// Mean over samples of the mean queue of the layer's ports, bytes.
    pub avg_queue_bytes: f64,
    /// Bytes sent by the layer's ports / (ports · rate · CCT).
    pub utilisation: f64,
    /// Highest utilisation of one port of the layer.
    pub max_port_utilisation: f64,
    /// Packets dropped by full buffers.
    pub drops_overflow: u64,
    /// Packets dropped by failed links.
    pub drops_failed: u64,
    /// DATA packets marked CE.
    pub ecn_marks: u64,
}

/// Protocol counters summed over every connection.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProtoTotals {
    /// DATA packets sent (retransmissions included).
    pub data_pkts_sent: u64,
    /// Retransmitted DATA packets.
    pub retransmissions: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// Losses declared by the reorder threshold.
    pub reorder_losses: u64,
    /// Retransmissions found needless.
    pub spurious_retransmissions: u64,
    /// Duplicate DATA packets received.
    pub duplicates: u64,
    /// Packets the protocol dropped (bad token, beyond window, ...).
    pub dropped: u64,
    /// CTS retransmitted after their timer expired.
    #[serde(default)]
    pub cts_retransmitted: u64,
    /// Paths marked dead (state changes into dead).
    pub paths_died: u64,
    /// Requests that failed.
    pub failed_requests: u64,
    /// Connections (pairs of endpoints).
    pub connections: usize,
}

/// The result of one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    /// Scheme name.
    pub scheme: String,
    /// Message size swept (bytes), or the workload's own.
    pub size: u64,
    /// True when the scenario's failures applied.
    pub failures: bool,
    /// Seed.
    pub seed: u64,
    /// Completed before the time limit.
    pub completed: bool,
    /// Collective completion time (last byte of the last transfer received), µs.
    pub cct_us: f64,
    /// Lower bound, µs.
    pub bound_us: f64,
    /// (CCT − bound) / bound, percent.
    pub cct_increase_pct: f64,
    /// Per-layer queues and utilisation.
    pub layers: Vec<LayerStats>,
    /// Largest queue of any switch port, bytes.
    pub max_switch_queue_bytes: u64,
    /// Time-averaged queue over all switch ports, bytes.
    pub avg_switch_queue_bytes: f64,
    /// The busiest NIC's bytes (sent or received, retransmissions included) at line rate, µs: the
    /// completion time the scheme's placement of bytes on NICs allows, whatever the fabric does.
    #[serde(default)]
    pub nic_load_us: f64,
    /// Largest queue of a port between two switches (the host-facing last hop left out), bytes.
    #[serde(default)]
    pub max_fabric_queue_bytes: u64,
    /// Protocol counters.
    pub proto: ProtoTotals,
    /// Reorder distance of DATA arrivals (how many higher PSNs arrived first): p50, p99, max.
    pub ooo_p50: u64,
    /// p99 of the reorder distance.
    pub ooo_p99: u64,
    /// Largest reorder distance.
    pub ooo_max: u64,
    /// Time from a link failure to the last packet sent into it, µs (`None` without failures).
    pub reroute_us: Option<f64>,
    /// Links failed or slowed.
    pub links_changed: usize,
    /// Events processed.
    pub events: u64,
    /// Wall-clock seconds.
    pub wall_s: f64,
    /// Events per wall-clock second.
    pub events_per_s: f64,
    /// Events by kind: arrive, port free, timer, pump, start batch, link change, sample.
    #[serde(default)]
    pub events_by_kind: Vec<u64>,
    /// Most events waiting in the queue at once.
    #[serde(default)]
    pub peak_pending_events: usize,
    /// Most packets alive at once.
    #[serde(default)]
    pub peak_packets: usize,
    /// Max queue per layer over time: (µs, bytes per layer in `layers` order), downsampled.
    pub queue_series: Vec<(f64, Vec<u64>)>,
}

/// A scheduled change of a link (both directions).
#[derive(Debug, Clone, Copy)]
struct LinkChange {
    ports: (u32, u32),
    at: Ps,
    /// `None`: down.
    factor: Option<f64>,
}

/// One run in progress.
pub struct Sim {
    q: EventQueue,
    now: Ps,
    fab: Fabric,
    pool: PacketPool,
    payload: usize,
    overhead: usize,
    cfg: LbConfig,
    scheme: SchemeSpec,
    proto: ProtoConfig,
    runtimes: Vec<LbRuntime>,
    eps: Vec<Endpoint>,
    pairs: Vec<Pair>,
    pair_index: HashMap<(u32, u32, u16, u16, u32), u32>,
    ready: Vec<VecDeque<u32>>,
    transfers: Vec<Transfer>,
    tstate: Vec<TState>,
    host_ready: Vec<Vec<u32>>,
    host_batch_at: Vec<Option<Ps>>,
    remaining: usize,
    last_done: Ps,
    txbuf: Vec<u8>,
    rxbuf: Vec<u8>,
    changes: Vec<LinkChange>,
    sample_ps: Ps,
    samples: Vec<(Ps, Vec<u64>)>,
    layer_sum: Vec<f64>,
    layer_samples: u64,
    switch_sum: f64,
    ooo_hist: Vec<u64>,
    failed_requests: u64,
    created: u64,
    delivered: u64,
    peak_events: usize,
    ev_kinds: [u64; 7],
    seed: u64,
    max_ps: Ps,
    progress: Option<indicatif::ProgressBar>,
}

fn nanos_to_us(ps: Ps) -> f64 {
    ps as f64 / PS_PER_US as f64
}

/// Buckets of the reorder-distance histogram: exact below 64, then powers of two.
fn ooo_bucket(d: u64) -> usize {
    if d < 64 {
        d as usize
    } else {
        64 + (63 - d.leading_zeros() as usize).min(63)
    }
}
fn ooo_bucket_value(b: usize) -> u64 {
    if b < 64 {
        b as u64
    } else {
        1u64 << (b - 64)
    }
}

impl Sim {
    /// Prepare run `seed` of `scheme` on `sc` with message size `size` (if swept), with or without the
    /// scenario's failures.
    pub fn new(sc: &Scenario, scheme: &SchemeSpec, size: Option<u64>, with_failures: bool, seed: u64) -> Result<Self, ScenarioError> {
        let cfg = LbConfig::from_vars(&scheme.vars).map_err(|source| ScenarioError::Lb { scheme: scheme.name.clone(), source })?;
        let fab = Fabric::new(&sc.topology, &sc.link, scheme.switch, scheme.flowlet_gap_us, seed)?;
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
        };
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x00C0_FFEE);
        let transfers = workload::generate(&sc.workload, fab.hosts, fab.rails, size, &mut rng)?;
        let mut tstate: Vec<TState> = transfers
            .iter()
            .map(|t| TState { deps_left: t.deps.len() as u32, dependents: Vec::new(), received: 0, done_at: None })
            .collect();
        for (i, t) in transfers.iter().enumerate() {
            for &d in &t.deps {
                tstate[d as usize].dependents.push(i as u32);
            }
        }
        let mut changes = Vec::new();
        if with_failures {
            let f = &sc.failures;
            for (i, l) in f.links.iter().enumerate() {
                let a = fab.node_by_name(&l.between[0]);
                let b = fab.node_by_name(&l.between[1]);
                let (Some(a), Some(b)) = (a, b) else {
                    return Err(invalid(format!("failures.links[{i}].between"), "no such node"));
                };
                let Some(ports) = fab.link_between(a, b, l.index) else {
                    return Err(invalid(format!("failures.links[{i}].between"), "those nodes are not linked"));
                };
                changes.push(LinkChange { ports, at: (l.at_us * PS_PER_US as f64) as Ps, factor: l.rate_factor });
            }
            if f.random_link_prob > 0.0 {
                use rand::Rng;
                let mut frng = SmallRng::seed_from_u64(seed ^ 0xFA11);
                for &(p, q) in &fab.links {
                    let sw = |x: u32| fab.tier(fab.ports[x as usize].from) > 0 && fab.tier(fab.ports[x as usize].to) > 0;
                    if sw(p) && frng.gen_bool(f.random_link_prob) {
                        changes.push(LinkChange { ports: (p, q), at: 0, factor: None });
                    }
                }
            }
        }
        let nics = fab.hosts * fab.rails;
        let hosts = fab.hosts;
        let sample_ps = (sc.sample_us * PS_PER_US as f64) as Ps;
        let remaining = transfers.len();
        Ok(Self {
            q: EventQueue::new(),
            now: 0,
            pool: PacketPool::default(),
            payload: sc.packet.payload,
            overhead: sc.packet.overhead,
            cfg,
            scheme: scheme.clone(),
            proto,
            runtimes,
            eps: Vec::new(),
            pairs: Vec::new(),
            pair_index: HashMap::new(),
            ready: vec![VecDeque::new(); nics],
            transfers,
            tstate,
            host_ready: vec![Vec::new(); hosts],
            host_batch_at: vec![None; hosts],
            remaining,
            last_done: 0,
            txbuf: vec![0; DATA_HEADER_LEN + sc.packet.payload + 64],
            rxbuf: vec![0; DATA_HEADER_LEN + sc.packet.payload + 64],
            changes,
            sample_ps,
            samples: Vec::new(),
            layer_sum: vec![0.0; 16],
            layer_samples: 0,
            switch_sum: 0.0,
            ooo_hist: vec![0; 128],
            failed_requests: 0,
            created: 0,
            delivered: 0,
            peak_events: 0,
            ev_kinds: [0; 7],
            seed,
            max_ps: (sc.max_sim_ms * 1e9) as Ps,
            progress: None,
            fab,
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
        &self.fab
    }

    /// Packets the hosts put on the wire, packets that reached a host, and packets still in the fabric
    /// (the run stops when the last transfer completes).
    pub fn packet_counts(&self) -> (u64, u64, u64) {
        (self.created, self.delivered, self.pool.live() as u64)
    }

    /// When transfer `t` was fully received, ps.
    pub fn transfer_done_at(&self, t: usize) -> Option<Ps> {
        self.tstate.get(t).and_then(|s| s.done_at)
    }

    /// The lower bound of this run's workload, µs.
    pub fn bound_us(&self) -> f64 {
        let host_link = &self.fab.ports[self.fab.nic_port[0] as usize];
        let bytes_per_us = 1e9 / host_link.nominal_mps_per_byte as f64; // mps/byte → bytes per µs
        let payload = self.payload as u64;
        let per_pkt = (DATA_HEADER_LEN + self.overhead) as u64;
        let wire = |b: u64| (b + b.div_ceil(payload) * per_pkt) as f64;
        let prop = host_link.prop_ps as f64 / PS_PER_US as f64;
        let full_pkt_us = (payload + per_pkt) as f64 / bytes_per_us;
        let hops = &self.fab.hops;
        let hosts = self.fab.hosts;
        let lat = |s: u32, d: u32| {
            let h = hops[s as usize * hosts + d as usize] as f64;
            h * prop + (h - 1.0).max(0.0) * full_pkt_us
        };
        let hosts_bound = workload::lower_bound_us(&self.transfers, hosts, bytes_per_us, self.fab.rails, wire, lat);
        hosts_bound.max(self.leaf_bound_us(&wire) + lat(0, (hosts - 1) as u32).min(2.0 * prop))
    }

    /// The busiest leaf's traffic to (or from) other leaves through all of its uplinks at line rate, µs
    /// (single-rail fabrics; with rails the leaf a byte crosses depends on the rail policy).
    fn leaf_bound_us(&self, wire: &dyn Fn(u64) -> f64) -> f64 {
        if self.fab.rails != 1 {
            return 0.0;
        }
        let leaf_of = |h: u32| self.fab.ports[self.fab.nic_port[h as usize] as usize].to as usize;
        let n = self.fab.nodes.len();
        let (mut up, mut down) = (vec![0.0f64; n], vec![0.0f64; n]);
        for t in self.transfers.iter().filter(|t| t.src != t.dst) {
            let (a, b) = (leaf_of(t.src), leaf_of(t.dst));
            if a != b {
                up[a] += wire(t.bytes);
                down[b] += wire(t.bytes);
            }
        }
        (0..n)
            .filter(|&l| up[l] > 0.0 || down[l] > 0.0)
            .map(|l| {
                // Bytes per µs of the leaf's links towards higher tiers.
                let cap: f64 = self.fab.nodes[l]
                    .ports
                    .iter()
                    .map(|&p| &self.fab.ports[p as usize])
                    .filter(|p| self.fab.tier(p.to) > 1)
                    .map(|p| 1e9 / p.nominal_mps_per_byte as f64)
                    .sum();
                up[l].max(down[l]) / cap.max(1e-9)
            })
            .fold(0.0, f64::max)
    }

    /// Run to completion (or the time limit) and report.
    pub fn run(&mut self, size: u64, failures: bool) -> RunResult {
        let wall = Instant::now();
        let bound = self.bound_us();
        for (i, c) in self.changes.clone().iter().enumerate() {
            self.q.push(c.at, Event::LinkChange { change: i as u32 });
        }
        if self.sample_ps > 0 {
            self.q.push(0, Event::Sample);
        }
        for i in 0..self.transfers.len() {
            if self.transfers[i].deps.is_empty() {
                let at = (self.transfers[i].start_us * PS_PER_US as f64) as Ps;
                self.make_ready(i as u32, at);
            }
        }
        let mut next_tick = 0u64;
        while let Some((t, ev)) = self.q.pop() {
            self.peak_events = self.peak_events.max(self.q.len());
            if self.remaining == 0 || t > self.max_ps {
                break;
            }
            self.now = t;
            self.dispatch(ev);
            if let Some(pb) = &self.progress {
                let n = self.q.processed();
                if n >= next_tick {
                    next_tick = n + 200_000;
                    pb.set_position(nanos_to_us(t) as u64);
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

    fn dispatch(&mut self, ev: Event) {
        self.ev_kinds[match ev {
            Event::Arrive { .. } => 0,
            Event::PortFree { .. } => 1,
            Event::Timer { .. } => 2,
            Event::Pump { .. } => 3,
            Event::StartBatch { .. } => 4,
            Event::LinkChange { .. } => 5,
            Event::Sample => 6,
        }] += 1;
        match ev {
            Event::Arrive { pkt, port } => self.on_arrive(pkt, port),
            Event::PortFree { port } => self.on_port_free(port),
            Event::Timer { ep } => {
                if self.eps[ep as usize].timer_at == Some(self.now) {
                    self.eps[ep as usize].timer_at = None;
                    let now_us = self.now_us();
                    self.eps[ep as usize].conn.handle_timeout(now_us);
                    self.after_ep(ep);
                }
            }
            Event::Pump { pair } => {
                if self.pairs[pair as usize].pump_at == Some(self.now) {
                    self.pairs[pair as usize].pump_at = None;
                }
                self.pump_send(pair);
            }
            Event::StartBatch { host } => self.start_batch(host),
            Event::LinkChange { change } => {
                let c = self.changes[change as usize];
                for p in [c.ports.0, c.ports.1] {
                    let port = &mut self.fab.ports[p as usize];
                    match c.factor {
                        None => port.failed = true,
                        Some(f) => port.mps_per_byte = (port.nominal_mps_per_byte as f64 / f.clamp(1e-3, 1.0)) as u64,
                    }
                }
            }
            Event::Sample => self.sample(),
        }
    }

    #[inline]
    fn now_us(&self) -> u64 {
        self.now / PS_PER_US
    }

    fn make_ready(&mut self, t: u32, at: Ps) {
        let tr = &self.transfers[t as usize];
        if tr.src == tr.dst || tr.bytes == 0 {
            // A gate, or traffic that never leaves the host: done when ready.
            if at <= self.now {
                self.transfer_done(t);
            } else {
                let host = tr.src;
                self.host_ready[host as usize].push(t);
                self.schedule_batch(host, at);
            }
            return;
        }
        let host = tr.src;
        self.host_ready[host as usize].push(t);
        self.schedule_batch(host, at.max(self.now));
    }

    fn schedule_batch(&mut self, host: u32, at: Ps) {
        if self.host_batch_at[host as usize].is_none_or(|x| at < x) {
            self.host_batch_at[host as usize] = Some(at);
            self.q.push(at, Event::StartBatch { host });
        }
    }

    fn transfer_done(&mut self, t: u32) {
        let st = &mut self.tstate[t as usize];
        if st.done_at.is_some() {
            return;
        }
        st.done_at = Some(self.now);
        self.remaining -= 1;
        self.last_done = self.last_done.max(self.now);
        let deps = std::mem::take(&mut self.tstate[t as usize].dependents);
        for d in deps {
            let st = &mut self.tstate[d as usize];
            st.deps_left -= 1;
            if st.deps_left == 0 {
                let at = (self.transfers[d as usize].start_us * PS_PER_US as f64) as Ps;
                self.make_ready(d, at.max(self.now));
            }
        }
    }

    /// Plan and post every transfer of `host` that is ready now, as one batch (Ethereal's interceptor
    /// sees sends posted at the same instant together).
    fn start_batch(&mut self, host: u32) {
        if self.host_batch_at[host as usize] != Some(self.now) {
            return;
        }
        self.host_batch_at[host as usize] = None;
        let now = self.now;
        let all = std::mem::take(&mut self.host_ready[host as usize]);
        let (ready, later): (Vec<u32>, Vec<u32>) =
            all.into_iter().partition(|&t| (self.transfers[t as usize].start_us * PS_PER_US as f64) as Ps <= now);
        if !later.is_empty() {
            let next = later.iter().map(|&t| (self.transfers[t as usize].start_us * PS_PER_US as f64) as Ps).min().unwrap_or(now);
            self.host_ready[host as usize] = later;
            self.schedule_batch(host, next);
        }
        let mut net = Vec::new();
        for t in ready {
            let tr = &self.transfers[t as usize];
            if tr.src == tr.dst || tr.bytes == 0 {
                self.transfer_done(t);
            } else {
                net.push(t);
            }
        }
        if net.is_empty() {
            return;
        }
        let reqs: Vec<SendReq> = net
            .iter()
            .map(|&t| {
                let tr = &self.transfers[t as usize];
                SendReq { dst_host: tr.dst as usize, len: tr.bytes, flow: t as u64, home_rail: tr.home_rail }
            })
            .collect();
        let plans = match self.runtimes[host as usize].plan_batch(&reqs, self.now_us()) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("planning failed: {e}");
                return;
            }
        };
        let gated = self.cfg.cc == CcKind::Mcc;
        for (k, plan) in plans.iter().enumerate() {
            let t = net[k];
            let tr = self.transfers[t as usize].clone();
            // Bytes and earliest start per (rail, pinned uplink), in first-seen order.
            let mut groups: BTreeMap<(u16, u32), (u64, u32)> = BTreeMap::new();
            for c in &plan.chunks {
                let key = (c.rail, c.uplink.map_or(u32::MAX, u32::from));
                let g = groups.entry(key).or_insert((0, u32::MAX));
                g.0 += c.len as u64;
                g.1 = g.1.min(c.start_after_us);
            }
            for ((rail, pin), (bytes, after_us)) in groups {
                let dst_rail = match (tr.dst_rail, self.cfg.rail) {
                    // GPU-bound NICs without rail alignment: the data lands on the destination GPU's
                    // NIC, crossing rails through the spines (RailS's baselines).
                    (Some(r), RailKind::Single) => r,
                    _ => rail,
                };
                let pin = (pin != u32::MAX).then_some(pin as u16);
                let pair = self.pair_for(tr.src, tr.dst, rail, dst_rail, pin);
                let ready_at = now + after_us as u64 * PS_PER_US;
                let chunk = if gated { self.scheme.msg_chunk.max(1) } else { bytes };
                let mut left = bytes;
                while left > 0 {
                    let b = left.min(chunk);
                    left -= b;
                    let piece = Piece { transfer: t, bytes: b, ready_at };
                    let p = &mut self.pairs[pair as usize];
                    p.pending_recv.push_back(piece);
                    p.pending_send.push_back(piece);
                }
                self.pump_recv(pair);
                self.pump_send(pair);
            }
        }
    }

    fn pair_for(&mut self, src: u32, dst: u32, rail: u16, dst_rail: u16, pin: Option<u16>) -> u32 {
        let key = (src, dst, rail, dst_rail, pin.map_or(u32::MAX, u32::from));
        if let Some(&p) = self.pair_index.get(&key) {
            return p;
        }
        let idx = self.pairs.len() as u32;
        let rate: Option<SharedRate> = (self.cfg.cc == CcKind::Mcc).then(|| Arc::new(Mutex::new(self.cfg.rate_controller())));
        let aimd: Option<SharedAimd> = (self.scheme.rate == RateMode::PacketAimd).then(|| {
            Arc::new(Mutex::new(PacketAimd::new(self.scheme.aimd_init_pkts.unwrap_or(self.proto.window_pkts), self.proto.window_pkts)))
        });
        let flow_seed = self.seed ^ (idx as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let policy = self.runtimes[src as usize].path_policy(FlowInfo { dst_host: dst as usize, rail }, flow_seed);
        let send_policy = Box::new(SimPolicy::new(policy, pin, rate.clone(), aimd.clone()));
        // The receiving end only sends control packets; its policy is never asked for data paths.
        let recv_policy = Box::new(SimPolicy::new(
            self.runtimes[dst as usize].path_policy(FlowInfo { dst_host: src as usize, rail }, flow_seed ^ 1),
            None,
            None,
            None,
        ));
        let (es, er) = (self.eps.len() as u32, self.eps.len() as u32 + 1);
        let rails = self.fab.rails as u32;
        let src_nic = src * rails + rail as u32;
        let dst_nic = dst * rails + dst_rail as u32;
        let now_us = self.now_us();
        self.eps.push(Endpoint {
            conn: Connection::new(self.proto.clone(), TOKEN_BASE + es as u64, TOKEN_BASE + er as u64, send_policy, now_us),
            nic: src_nic,
            peer_nic: dst_nic,
            pair: idx,
            sender: true,
            timer_at: None,
            in_ready: false,
            max_psn: None,
        });
        self.eps.push(Endpoint {
            conn: Connection::new(self.proto.clone(), TOKEN_BASE + er as u64, TOKEN_BASE + es as u64, recv_policy, now_us),
            nic: dst_nic,
            peer_nic: src_nic,
            pair: idx,
            sender: false,
            timer_at: None,
            in_ready: false,
            max_psn: None,
        });
        self.pairs.push(Pair {
            ep_send: es,
            ep_recv: er,
            pending_send: VecDeque::new(),
            pending_recv: VecDeque::new(),
            posted_send: VecDeque::new(),
            posted_recv: VecDeque::new(),
            out_bytes: 0,
            rate,
            aimd,
            pump_at: None,
        });
        self.pair_index.insert(key, idx);
        idx
    }

    fn pump_recv(&mut self, pair: u32) {
        let now_us = self.now_us();
        let p = &mut self.pairs[pair as usize];
        let mut posted = false;
        while p.posted_recv.len() < RECV_AHEAD {
            let Some(piece) = p.pending_recv.front().copied() else {
                break;
            };
            let ep = &mut self.eps[p.ep_recv as usize];
            match ep.conn.post_recv(&[RecvSpec { len: piece.bytes, tag: 0 }], now_us) {
                Ok(id) => {
                    p.pending_recv.pop_front();
                    p.posted_recv.push_back((id, piece.transfer, piece.bytes));
                    posted = true;
                }
                Err(e) => {
                    tracing::debug!("post_recv: {e}");
                    break;
                }
            }
        }
        if posted {
            let ep = p.ep_recv;
            self.after_ep(ep);
        }
    }

    fn pump_send(&mut self, pair: u32) {
        let now = self.now;
        let now_us = self.now_us();
        let p = &mut self.pairs[pair as usize];
        let window = p.rate.as_ref().map(|r| locked(r).window_bytes());
        let mut posted = false;
        while p.posted_send.len() < SEND_AHEAD {
            let Some(piece) = p.pending_send.front().copied() else {
                break;
            };
            if piece.ready_at > now {
                if p.pump_at.is_none_or(|x| piece.ready_at < x) {
                    p.pump_at = Some(piece.ready_at);
                    self.q.push(piece.ready_at, Event::Pump { pair });
                }
                break;
            }
            if let Some(w) = window {
                if p.out_bytes > 0 && p.out_bytes + piece.bytes > w {
                    break;
                }
            }
            let ep = &mut self.eps[p.ep_send as usize];
            match ep.conn.post_send(piece.bytes, 0, now_us) {
                Ok(id) => {
                    p.pending_send.pop_front();
                    p.posted_send.push_back((id, piece.bytes, now));
                    p.out_bytes += piece.bytes;
                    posted = true;
                }
                Err(e) => {
                    tracing::debug!("post_send: {e}");
                    break;
                }
            }
        }
        if posted {
            let ep = p.ep_send;
            self.after_ep(ep);
        }
    }

    /// After anything happened to endpoint `ep`: handle its completions, re-arm its timer, and make sure
    /// its NIC will ask it for datagrams.
    fn after_ep(&mut self, ep: u32) {
        while let Some(c) = self.eps[ep as usize].conn.poll_completion() {
            self.on_completion(ep, c);
        }
        self.rearm(ep);
        let e = &mut self.eps[ep as usize];
        if !e.in_ready {
            e.in_ready = true;
            let nic = e.nic;
            self.ready[nic as usize].push_back(ep);
            let port = self.fab.nic_port[nic as usize];
            if !self.fab.ports[port as usize].free_pending {
                self.nic_pull(nic);
            }
        }
    }

    fn rearm(&mut self, ep: u32) {
        let e = &mut self.eps[ep as usize];
        if let Some(us) = e.conn.poll_timeout() {
            let at = (us * PS_PER_US).max(self.now);
            if e.timer_at.is_none_or(|x| at < x) {
                e.timer_at = Some(at);
                self.q.push(at, Event::Timer { ep });
            }
        }
    }

    fn on_completion(&mut self, ep: u32, c: Completion) {
        let pair = self.eps[ep as usize].pair;
        match c {
            Completion::Sent { msg, len } => {
                let p = &mut self.pairs[pair as usize];
                if let Some(i) = p.posted_send.iter().position(|x| x.0 == msg) {
                    let (_, bytes, at) = p.posted_send.remove(i).expect("index from position");
                    p.out_bytes -= bytes;
                    if let Some(r) = &p.rate {
                        locked(r).message_done(&MessageSample { bytes: len, sent_us: at / PS_PER_US, done_us: self.now / PS_PER_US });
                    }
                }
                self.pump_send(pair);
            }
            Completion::Received { msg, sizes } => {
                let p = &mut self.pairs[pair as usize];
                if let Some(i) = p.posted_recv.iter().position(|x| x.0 == msg) {
                    let (_, t, _) = p.posted_recv.remove(i).expect("index from position");
                    let got: u64 = sizes.iter().sum();
                    let st = &mut self.tstate[t as usize];
                    st.received += got;
                    if st.received >= self.transfers[t as usize].bytes {
                        self.transfer_done(t);
                    }
                }
                self.pump_recv(pair);
            }
            Completion::Failed { msg, error } => {
                self.failed_requests += 1;
                tracing::warn!(msg = msg.0, "request failed: {error}");
            }
        }
    }

    /// The NIC `nic` is free: send the next datagram of its connections, round-robin.
    fn nic_pull(&mut self, nic: u32) {
        let port = self.fab.nic_port[nic as usize];
        let now_us = self.now_us();
        while let Some(ep) = self.ready[nic as usize].pop_front() {
            let e = &mut self.eps[ep as usize];
            if e.sender {
                if let Some(a) = &self.pairs[e.pair as usize].aimd {
                    let cwnd = locked(a).window_pkts();
                    let in_flight: u32 = e.conn.stats().paths.iter().map(|p| p.in_flight).sum();
                    if in_flight >= cwnd {
                        // Woken again by the next acknowledgement.
                        e.in_ready = false;
                        continue;
                    }
                }
            }
            let Some(t) = e.conn.poll_transmit(now_us, &mut NoPayload, &mut self.txbuf) else {
                e.in_ready = false;
                continue;
            };
            let len = t.len;
            let hdr_len = if self.txbuf[1] == 1 { DATA_HEADER_LEN } else { len };
            // Receives are posted one buffer at a time, so a CTS (the longest control packet) has 44 bytes.
            assert!(hdr_len <= MAX_HDR, "control packet of {len} bytes exceeds the simulator's {MAX_HDR}");
            let mut hdr = [0u8; MAX_HDR];
            hdr[..hdr_len].copy_from_slice(&self.txbuf[..hdr_len]);
            let data = self.txbuf[1] == 1;
            let pkt = Packet {
                meta: PacketMeta {
                    src_nic: e.nic,
                    dst_nic: e.peer_nic,
                    wire_bytes: (len + self.overhead) as u32,
                    entropy: t.entropy,
                    data,
                },
                body: PacketBody { dgram_len: len as u32, hdr_len: hdr_len as u8, hdr },
            };
            self.ready[nic as usize].push_back(ep);
            // A transmission only arms deadlines at least one minimum RTO away (RTO, CTS, probes) and
            // clears the delayed-SACK one, so an armed timer within that horizon stays correct.
            let horizon = self.now + self.proto.rto_min_us * PS_PER_US;
            if self.eps[ep as usize].timer_at.is_none_or(|t| t > horizon) {
                self.rearm(ep);
            }
            let id = self.pool.alloc(pkt);
            self.created += 1;
            self.start_tx(port, id);
            return;
        }
    }

    /// Put `pkt` on the wire of idle port `port`. A NIC's port always gets a `PortFree` (to pull the
    /// next datagram); a switch port only when packets wait behind this one, so an uncongested hop costs
    /// one event.
    fn start_tx(&mut self, port: u32, pkt: u32) {
        let bytes = self.pool.get(pkt).wire_bytes;
        let p = &mut self.fab.ports[port as usize];
        let ser = p.ser_ps(bytes);
        p.free_at = self.now + ser;
        p.stats.tx_bytes += bytes as u64;
        p.stats.tx_pkts += 1;
        let prop = p.prop_ps;
        if p.nic.is_some() || !p.queue.is_empty() {
            p.free_pending = true;
            self.q.push(self.now + ser, Event::PortFree { port });
        }
        self.q.push(self.now + ser + prop, Event::Arrive { pkt, port });
    }

    fn on_port_free(&mut self, port: u32) {
        let p = &mut self.fab.ports[port as usize];
        p.free_pending = false;
        if let Some(next) = p.queue.pop_front() {
            let b = self.pool.get(next).wire_bytes as u64;
            p.queued_bytes -= b;
            self.start_tx(port, next);
        } else if let Some(nic) = p.nic {
            self.nic_pull(nic);
        }
    }

    /// Enqueue `pkt` at `port` (tail drop when full, ECN mark above the threshold, silent drop when
    /// failed).
    fn enqueue(&mut self, port: u32, pkt: u32) {
        let p = &mut self.fab.ports[port as usize];
        p.stats.offered += 1;
        if p.failed {
            p.stats.drops_failed += 1;
            p.stats.last_failed_drop = Some(self.now);
            self.pool.release(pkt);
            return;
        }
        if p.free_at <= self.now && p.queue.is_empty() {
            self.start_tx(port, pkt);
            return;
        }
        let bytes = self.pool.get(pkt).wire_bytes as u64;
        if p.queued_bytes + bytes > p.buffer_bytes {
            p.stats.drops_overflow += 1;
            self.pool.release(pkt);
            return;
        }
        if p.ecn_bytes > 0 && p.queued_bytes >= p.ecn_bytes && self.pool.get(pkt).data {
            let pk = self.pool.body_mut(pkt);
            let mut h = Header::new_unchecked(&mut pk.hdr[..pk.hdr_len as usize]);
            let flags = h.flags();
            h.set_flags(flags | FLAG_CE);
            p.stats.ecn_marks += 1;
        }
        p.queue.push_back(pkt);
        p.queued_bytes += bytes;
        p.stats.max_queue = p.stats.max_queue.max(p.queued_bytes);
        if !p.free_pending {
            p.free_pending = true;
            let at = p.free_at.max(self.now);
            self.q.push(at, Event::PortFree { port });
        }
    }

    fn on_arrive(&mut self, pkt: u32, port: u32) {
        let to = self.fab.ports[port as usize].to;
        if self.fab.tier(to) > 0 {
            let out = self.fab.next_hop(to, self.pool.get(pkt), self.now);
            self.enqueue(out, pkt);
            return;
        }
        self.deliver(pkt);
    }

    fn deliver(&mut self, pkt: u32) {
        self.delivered += 1;
        let (dst_nic, data) = (self.pool.get(pkt).dst_nic, self.pool.get(pkt).data);
        let p = self.pool.body(pkt);
        let ep = wire::peek_token(&p.hdr[..p.hdr_len as usize])
            .and_then(|t| t.checked_sub(TOKEN_BASE))
            .filter(|&i| (i as usize) < self.eps.len() && self.eps[i as usize].nic == dst_nic);
        let Some(ep) = ep else {
            self.pool.release(pkt);
            return;
        };
        let ep = ep as u32;
        let len = p.dgram_len as usize;
        let hl = p.hdr_len as usize;
        self.rxbuf[..hl].copy_from_slice(&p.hdr[..hl]);
        if data {
            let psn = u64::from_be_bytes(p.hdr[20..28].try_into().expect("DATA header has a PSN"));
            let e = &mut self.eps[ep as usize];
            match e.max_psn {
                Some(m) if psn < m => self.ooo_hist[ooo_bucket(m - psn)] += 1,
                _ => {
                    e.max_psn = Some(psn);
                    self.ooo_hist[0] += 1;
                }
            }
        }
        self.pool.release(pkt);
        let now_us = self.now_us();
        let e = &mut self.eps[ep as usize];
        e.conn.handle_datagram(&self.rxbuf[..len], now_us, &mut NoPlace);
        self.after_ep(ep);
        // An acknowledgement may open the window of a gated sender or the MCC window of its pair.
        if self.eps[ep as usize].sender {
            let pair = self.eps[ep as usize].pair;
            if self.pairs[pair as usize].rate.is_some() {
                self.pump_send(pair);
            }
        }
    }

    fn sample(&mut self) {
        let mut max = vec![0u64; 16];
        let mut sum = [0u64; 16];
        let mut cnt = [0u64; 16];
        let (mut ssum, mut scnt) = (0u64, 0u64);
        for p in &self.fab.ports {
            let l = p.layer as usize;
            max[l] = max[l].max(p.queued_bytes);
            sum[l] += p.queued_bytes;
            cnt[l] += 1;
            if l / 4 > 0 {
                ssum += p.queued_bytes;
                scnt += 1;
            }
        }
        for l in 0..16 {
            if cnt[l] > 0 {
                self.layer_sum[l] += sum[l] as f64 / cnt[l] as f64;
            }
        }
        self.layer_samples += 1;
        self.switch_sum += ssum as f64 / scnt.max(1) as f64;
        self.samples.push((self.now, max));
        self.q.push(self.now + self.sample_ps, Event::Sample);
    }

    fn report(&self, size: u64, failures: bool, bound: f64, wall_s: f64) -> RunResult {
        let completed = self.remaining == 0;
        let cct_ps = if completed { self.last_done } else { self.now };
        let cct_us = nanos_to_us(cct_ps);
        let mut present: Vec<usize> = Vec::new();
        for p in &self.fab.ports {
            if !present.contains(&(p.layer as usize)) {
                present.push(p.layer as usize);
            }
        }
        present.sort_unstable();
        let layers: Vec<LayerStats> = present
            .iter()
            .map(|&l| {
                let ports: Vec<_> = self.fab.ports.iter().filter(|p| p.layer as usize == l).collect();
                let cap = |p: &&crate::fabric::Port| cct_ps as f64 * 1000.0 / p.nominal_mps_per_byte as f64;
                let util: f64 = ports.iter().map(|p| p.stats.tx_bytes as f64).sum::<f64>() / ports.iter().map(cap).sum::<f64>().max(1.0);
                LayerStats {
                    layer: self.fab.layer_names[l].clone(),
                    ports: ports.len(),
                    max_queue_bytes: ports.iter().map(|p| p.stats.max_queue).max().unwrap_or(0),
                    avg_queue_bytes: self.layer_sum[l] / self.layer_samples.max(1) as f64,
                    utilisation: util,
                    max_port_utilisation: ports.iter().map(|p| p.stats.tx_bytes as f64 / cap(p).max(1.0)).fold(0.0, f64::max),
                    drops_overflow: ports.iter().map(|p| p.stats.drops_overflow).sum(),
                    drops_failed: ports.iter().map(|p| p.stats.drops_failed).sum(),
                    ecn_marks: ports.iter().map(|p| p.stats.ecn_marks).sum(),
                }
            })
            .collect();
        let max_switch_queue_bytes =
            self.fab.ports.iter().filter(|p| self.fab.tier(p.from) > 0).map(|p| p.stats.max_queue).max().unwrap_or(0);
        let max_fabric_queue_bytes = self
            .fab
            .ports
            .iter()
            .filter(|p| self.fab.tier(p.from) > 0 && self.fab.tier(p.to) > 0)
            .map(|p| p.stats.max_queue)
            .max()
            .unwrap_or(0);
        let nic_load_us = self
            .fab
            .ports
            .iter()
            .filter(|p| self.fab.tier(p.from) == 0 || self.fab.tier(p.to) == 0)
            .map(|p| p.stats.tx_bytes as f64 * p.nominal_mps_per_byte as f64 / 1e9)
            .fold(0.0, f64::max);
        let mut pt = ProtoTotals { connections: self.pairs.len(), failed_requests: self.failed_requests, ..ProtoTotals::default() };
        for e in &self.eps {
            let s = e.conn.stats();
            pt.data_pkts_sent += s.data_pkts_sent;
            pt.retransmissions += s.retransmissions;
            pt.timeouts += s.timeouts;
            pt.reorder_losses += s.reorder_losses;
            pt.spurious_retransmissions += s.spurious_retransmissions;
            pt.duplicates += s.duplicates;
            pt.cts_retransmitted += s.cts_retransmitted;
            pt.dropped += s.dropped.total();
            pt.paths_died +=
                s.paths.iter().filter(|p| p.state == prism_transport::proto::PathHealth::Dead || p.state_changes > 1).count() as u64;
        }
        let total: u64 = self.ooo_hist.iter().sum();
        let pct = |q: f64| -> u64 {
            let target = (q * total as f64).ceil() as u64;
            let mut acc = 0;
            for (b, &c) in self.ooo_hist.iter().enumerate() {
                acc += c;
                if acc >= target.max(1) {
                    return ooo_bucket_value(b);
                }
            }
            0
        };
        let ooo_max = self.ooo_hist.iter().rposition(|&c| c > 0).map_or(0, ooo_bucket_value);
        let reroute_us = (!self.changes.is_empty()).then(|| {
            self.changes
                .iter()
                .filter(|c| c.factor.is_none())
                .flat_map(|c| [c.ports.0, c.ports.1].map(|p| (c.at, p)))
                .filter_map(|(at, p)| self.fab.ports[p as usize].stats.last_failed_drop.map(|d| nanos_to_us(d.saturating_sub(at))))
                .fold(0.0, f64::max)
        });
        // Downsample the series to at most 400 points (max within each bucket).
        let n = self.samples.len();
        let step = n.div_ceil(400).max(1);
        let queue_series = self
            .samples
            .chunks(step)
            .map(|ch| {
                let t = nanos_to_us(ch[0].0);
                let v = present.iter().map(|&l| ch.iter().map(|s| s.1[l]).max().unwrap_or(0)).collect();
                (t, v)
            })
            .collect();
        let events = self.q.processed();
        RunResult {
            scheme: self.scheme.name.clone(),
            size,
            failures,
            seed: self.seed,
            completed,
            cct_us,
            bound_us: bound,
            cct_increase_pct: (cct_us - bound) / bound.max(1e-9) * 100.0,
            layers,
            max_switch_queue_bytes,
            max_fabric_queue_bytes,
            nic_load_us,
            avg_switch_queue_bytes: self.switch_sum / self.layer_samples.max(1) as f64,
            proto: pt,
            ooo_p50: pct(0.5),
            ooo_p99: pct(0.99),
            ooo_max,
            reroute_us,
            links_changed: self.changes.len(),
            events,
            wall_s,
            events_per_s: events as f64 / wall_s.max(1e-9),
            peak_pending_events: self.peak_events,
            events_by_kind: self.ev_kinds.to_vec(),
            peak_packets: self.pool.capacity(),
            queue_series,
        }
    }
}
