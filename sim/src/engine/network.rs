//! The network part of a run: packets crossing the fabric's ports (serialisation, propagation, FIFO
//! queues with tail drop and ECN marking, failed links) and the scenario's scheduled link changes.

use super::Sim;
use crate::events::{Event, Ps, PS_PER_US};
use crate::fabric::{Fabric, PacketPool};
use crate::scenario::{invalid, FailureSpec, ScenarioError};

/// A scheduled change of a link (both directions).
#[derive(Debug, Clone, Copy)]
pub(super) struct LinkChange {
    pub(super) ports: (u32, u32),
    pub(super) at: Ps,
    /// `None`: down.
    pub(super) factor: Option<f64>,
}

/// The fabric with its packets in flight and the scenario's link changes.
pub(super) struct Network {
    pub(super) fab: Fabric,
    pub(super) pool: PacketPool,
    /// Payload bytes of a full DATA packet.
    pub(super) payload: usize,
    /// Link overhead per packet (Ethernet, IP, UDP, FCS, preamble, gap), bytes.
    pub(super) overhead: usize,
    pub(super) changes: Vec<LinkChange>,
}

/// The link changes of `failures` on `fab` (the random failures drawn from `seed`).
pub(super) fn link_changes(fab: &Fabric, failures: &FailureSpec, seed: u64) -> Result<Vec<LinkChange>, ScenarioError> {
    let mut changes = Vec::new();
    for (i, l) in failures.links.iter().enumerate() {
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
    if failures.random_link_prob > 0.0 {
        use rand::{rngs::SmallRng, Rng, SeedableRng};
        let mut frng = SmallRng::seed_from_u64(seed ^ 0xFA11);
        for &(p, q) in &fab.links {
            let sw = |x: u32| fab.tier(fab.ports[x as usize].from) > 0 && fab.tier(fab.ports[x as usize].to) > 0;
            if sw(p) && frng.gen_bool(failures.random_link_prob) {
                changes.push(LinkChange { ports: (p, q), at: 0, factor: None });
            }
        }
    }
    Ok(changes)
}

impl Network {
    /// Apply scheduled change `change` to both directions of its link.
    pub(super) fn apply_link_change(&mut self, change: u32) {
        let c = self.changes[change as usize];
        for p in [c.ports.0, c.ports.1] {
            let port = &mut self.fab.ports[p as usize];
            match c.factor {
                None => port.failed = true,
                Some(f) => port.mps_per_byte = (port.nominal_mps_per_byte as f64 / f.clamp(1e-3, 1.0)) as u64,
            }
        }
    }
}

impl Sim {
    /// Put `pkt` on the wire of idle port `port`. A NIC's port always gets a `PortFree` (to pull the
    /// next datagram); a switch port only when packets wait behind this one, so an uncongested hop costs
    /// one event.
    /// `bytes` is the packet's `wire_bytes`.
    pub(super) fn start_tx(&mut self, port: u32, pkt: u32, bytes: u32) {
        let p = &mut self.net.fab.ports[port as usize];
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

    pub(super) fn on_port_free(&mut self, port: u32) {
        let p = &mut self.net.fab.ports[port as usize];
        p.free_pending = false;
        if let Some((next, bytes)) = p.queue.pop_front() {
            p.queued_bytes -= bytes as u64;
            self.start_tx(port, next, bytes);
        } else if let Some(nic) = p.nic {
            self.nic_pull(nic);
        }
    }

    /// Enqueue `pkt` at `port` (tail drop when full, ECN mark above the threshold, silent drop when
    /// failed).
    fn enqueue(&mut self, port: u32, pkt: u32) {
        let p = &mut self.net.fab.ports[port as usize];
        p.stats.offered += 1;
        if p.failed {
            p.stats.drops_failed += 1;
            p.stats.last_failed_drop = Some(self.now);
            self.net.pool.release(pkt);
            return;
        }
        let wire_bytes = self.net.pool.get(pkt).wire_bytes;
        if p.free_at <= self.now && p.queue.is_empty() {
            self.start_tx(port, pkt, wire_bytes);
            return;
        }
        let bytes = wire_bytes as u64;
        if p.queued_bytes + bytes > p.buffer_bytes {
            p.stats.drops_overflow += 1;
            self.net.pool.release(pkt);
            return;
        }
        if p.ecn_bytes > 0 && p.queued_bytes >= p.ecn_bytes && self.net.pool.get(pkt).data {
            // The switch flips the CE flag in the Prism header, written at delivery (`PacketMeta::ce`).
            self.net.pool.get_mut(pkt).ce = true;
            p.stats.ecn_marks += 1;
        }
        p.queue.push_back((pkt, wire_bytes));
        p.queued_bytes += bytes;
        p.stats.max_queue = p.stats.max_queue.max(p.queued_bytes);
        if !p.free_pending {
            p.free_pending = true;
            let at = p.free_at.max(self.now);
            self.q.push(at, Event::PortFree { port });
        }
    }

    /// Packet `pkt` crossed `port`: a switch forwards it, a host receives it.
    pub(super) fn on_arrive(&mut self, pkt: u32, port: u32) {
        let to = self.net.fab.ports[port as usize].to;
        if self.net.fab.tier(to) > 0 {
            let out = self.net.fab.next_hop(to, self.net.pool.get(pkt), self.now);
            self.enqueue(out, pkt);
            return;
        }
        self.deliver(pkt);
    }
}
