//! What a run measures: event and packet counters, the reorder-distance histogram, periodic samples of
//! every queue, and the [`RunResult`] assembled from them and the fabric's port counters at the end.

use serde::{Deserialize, Serialize};

use super::Sim;
use crate::events::{Event, Ps, PS_PER_US};
use crate::fabric::Port;

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
    /// Losses declared by the time-based rule (RACK).
    #[serde(default)]
    pub time_losses: u64,
    /// Losses declared by a retransmission timeout.
    #[serde(default)]
    pub timeout_losses: u64,
    /// Tail-loss probes sent.
    #[serde(default)]
    pub tail_probes: u64,
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

/// Picoseconds as (fractional) microseconds.
pub(super) fn ps_to_us(ps: Ps) -> f64 {
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

/// Port layers (`tier_from * 4 + tier_to`).
const LAYERS: usize = 16;

/// The run's own counters (the ports count theirs in the fabric).
pub(super) struct Metrics {
    /// Queue sampling period, ps (0: off).
    pub(super) sample_ps: Ps,
    /// (time, max queue per layer).
    samples: Vec<(Ps, Vec<u64>)>,
    /// Per layer: sum over samples of the mean queue of its ports.
    layer_sum: Vec<f64>,
    layer_samples: u64,
    /// Sum over samples of the mean queue of the switch ports.
    switch_sum: f64,
    ooo_hist: Vec<u64>,
    pub(super) failed_requests: u64,
    /// Packets the hosts put on the wire.
    pub(super) created: u64,
    /// Packets that reached a host.
    pub(super) delivered: u64,
    pub(super) peak_events: usize,
    ev_kinds: [u64; 7],
}

impl Metrics {
    pub(super) fn new(sample_ps: Ps) -> Self {
        Self {
            sample_ps,
            samples: Vec::new(),
            layer_sum: vec![0.0; LAYERS],
            layer_samples: 0,
            switch_sum: 0.0,
            ooo_hist: vec![0; 128],
            failed_requests: 0,
            created: 0,
            delivered: 0,
            peak_events: 0,
            ev_kinds: [0; 7],
        }
    }

    /// Count one event by kind.
    pub(super) fn count_event(&mut self, ev: &Event) {
        self.ev_kinds[match ev {
            Event::Arrive { .. } => 0,
            Event::PortFree { .. } => 1,
            Event::Timer { .. } => 2,
            Event::Pump { .. } => 3,
            Event::StartBatch { .. } => 4,
            Event::LinkChange { .. } => 5,
            Event::Sample => 6,
        }] += 1;
    }

    /// A DATA packet arrived `distance` PSNs below the highest one its connection end has seen.
    pub(super) fn record_reorder(&mut self, distance: u64) {
        self.ooo_hist[ooo_bucket(distance)] += 1;
    }

    /// The reorder distance at quantile `q`.
    fn ooo_quantile(&self, q: f64) -> u64 {
        let total: u64 = self.ooo_hist.iter().sum();
        let target = (q * total as f64).ceil() as u64;
        let mut acc = 0;
        for (b, &c) in self.ooo_hist.iter().enumerate() {
            acc += c;
            if acc >= target.max(1) {
                return ooo_bucket_value(b);
            }
        }
        0
    }
}

impl Sim {
    /// Sample every queue and schedule the next sample.
    pub(super) fn sample(&mut self) {
        let m = &mut self.metrics;
        let mut max = vec![0u64; LAYERS];
        let mut sum = [0u64; LAYERS];
        let mut cnt = [0u64; LAYERS];
        let (mut ssum, mut scnt) = (0u64, 0u64);
        for p in &self.net.fab.ports {
            let l = p.layer as usize;
            max[l] = max[l].max(p.queued_bytes);
            sum[l] += p.queued_bytes;
            cnt[l] += 1;
            if l / 4 > 0 {
                ssum += p.queued_bytes;
                scnt += 1;
            }
        }
        for l in 0..LAYERS {
            if cnt[l] > 0 {
                m.layer_sum[l] += sum[l] as f64 / cnt[l] as f64;
            }
        }
        m.layer_samples += 1;
        m.switch_sum += ssum as f64 / scnt.max(1) as f64;
        m.samples.push((self.now, max));
        self.q.push(self.now + m.sample_ps, Event::Sample);
    }

    /// The result of the run so far.
    pub(super) fn report(&self, size: u64, failures: bool, bound: f64, wall_s: f64) -> RunResult {
        let (fab, m) = (&self.net.fab, &self.metrics);
        let completed = self.work.remaining == 0;
        let cct_ps = if completed { self.work.last_done } else { self.now };
        let cct_us = ps_to_us(cct_ps);
        let mut present: Vec<usize> = Vec::new();
        for p in &fab.ports {
            if !present.contains(&(p.layer as usize)) {
                present.push(p.layer as usize);
            }
        }
        present.sort_unstable();
        let layers: Vec<LayerStats> = present
            .iter()
            .map(|&l| {
                let ports: Vec<_> = fab.ports.iter().filter(|p| p.layer as usize == l).collect();
                let cap = |p: &&Port| cct_ps as f64 * 1000.0 / p.nominal_mps_per_byte as f64;
                let util: f64 = ports.iter().map(|p| p.stats.tx_bytes as f64).sum::<f64>() / ports.iter().map(cap).sum::<f64>().max(1.0);
                LayerStats {
                    layer: fab.layer_names[l].clone(),
                    ports: ports.len(),
                    max_queue_bytes: ports.iter().map(|p| p.stats.max_queue).max().unwrap_or(0),
                    avg_queue_bytes: m.layer_sum[l] / m.layer_samples.max(1) as f64,
                    utilisation: util,
                    max_port_utilisation: ports.iter().map(|p| p.stats.tx_bytes as f64 / cap(p).max(1.0)).fold(0.0, f64::max),
                    drops_overflow: ports.iter().map(|p| p.stats.drops_overflow).sum(),
                    drops_failed: ports.iter().map(|p| p.stats.drops_failed).sum(),
                    ecn_marks: ports.iter().map(|p| p.stats.ecn_marks).sum(),
                }
            })
            .collect();
        let max_switch_queue_bytes = fab.ports.iter().filter(|p| fab.tier(p.from) > 0).map(|p| p.stats.max_queue).max().unwrap_or(0);
        let max_fabric_queue_bytes =
            fab.ports.iter().filter(|p| fab.tier(p.from) > 0 && fab.tier(p.to) > 0).map(|p| p.stats.max_queue).max().unwrap_or(0);
        let nic_load_us = fab
            .ports
            .iter()
            .filter(|p| fab.tier(p.from) == 0 || fab.tier(p.to) == 0)
            .map(|p| p.stats.tx_bytes as f64 * p.nominal_mps_per_byte as f64 / 1e9)
            .fold(0.0, f64::max);
        let mut pt = ProtoTotals { connections: self.hosts.pairs.len(), failed_requests: m.failed_requests, ..ProtoTotals::default() };
        for conn in self.hosts.connections() {
            let s = conn.stats();
            pt.data_pkts_sent += s.data_pkts_sent;
            pt.retransmissions += s.retransmissions;
            pt.timeouts += s.timeouts;
            pt.reorder_losses += s.reorder_losses;
            pt.time_losses += s.time_losses;
            pt.timeout_losses += s.timeout_losses;
            pt.tail_probes += s.tail_probes;
            pt.spurious_retransmissions += s.spurious_retransmissions;
            pt.duplicates += s.duplicates;
            pt.cts_retransmitted += s.cts_retransmitted;
            pt.dropped += s.dropped.total();
            pt.paths_died +=
                s.paths.iter().filter(|p| p.state == prism_transport::proto::PathHealth::Dead || p.state_changes > 1).count() as u64;
        }
        let ooo_max = m.ooo_hist.iter().rposition(|&c| c > 0).map_or(0, ooo_bucket_value);
        let changes = &self.net.changes;
        let reroute_us = (!changes.is_empty()).then(|| {
            changes
                .iter()
                .filter(|c| c.factor.is_none())
                .flat_map(|c| [c.ports.0, c.ports.1].map(|p| (c.at, p)))
                .filter_map(|(at, p)| fab.ports[p as usize].stats.last_failed_drop.map(|d| ps_to_us(d.saturating_sub(at))))
                .fold(0.0, f64::max)
        });
        // Downsample the series to at most 400 points (max within each bucket).
        let n = m.samples.len();
        let step = n.div_ceil(400).max(1);
        let queue_series = m
            .samples
            .chunks(step)
            .map(|ch| {
                let t = ps_to_us(ch[0].0);
                let v = present.iter().map(|&l| ch.iter().map(|s| s.1[l]).max().unwrap_or(0)).collect();
                (t, v)
            })
            .collect();
        let events = self.q.processed();
        RunResult {
            scheme: self.hosts.scheme.name.clone(),
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
            avg_switch_queue_bytes: m.switch_sum / m.layer_samples.max(1) as f64,
            proto: pt,
            ooo_p50: m.ooo_quantile(0.5),
            ooo_p99: m.ooo_quantile(0.99),
            ooo_max,
            reroute_us,
            links_changed: changes.len(),
            events,
            wall_s,
            events_per_s: events as f64 / wall_s.max(1e-9),
            peak_pending_events: m.peak_events,
            events_by_kind: m.ev_kinds.to_vec(),
            peak_packets: self.net.pool.capacity(),
            queue_series,
        }
    }
}
