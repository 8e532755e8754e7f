//! The workload's part of a run: transfers become ready when the transfers they depend on have arrived,
//! each host plans the ones ready at one instant as a batch with `prism-lb`, and the plans' chunks
//! become pieces posted on connection pairs. Also the run's lower bound.

use std::collections::BTreeMap;

use prism_lb::{CcKind, RailKind, SendReq};
use prism_transport::wire::DATA_HEADER_LEN;

use super::hosts::Piece;
use super::Sim;
use crate::events::{Event, Ps, PS_PER_US};
use crate::workload::{self, Transfer};

/// Progress of one transfer.
pub(super) struct TState {
    deps_left: u32,
    dependents: Vec<u32>,
    received: u64,
    done_at: Option<Ps>,
}

/// The workload's transfers and their dependency graph.
pub(super) struct Work {
    pub(super) transfers: Vec<Transfer>,
    tstate: Vec<TState>,
    /// Per host: transfers ready (or waiting for their start time) not yet planned.
    host_ready: Vec<Vec<u32>>,
    /// Per host: the time of its scheduled `StartBatch`.
    host_batch_at: Vec<Option<Ps>>,
    /// Transfers not yet done.
    pub(super) remaining: usize,
    /// When the last transfer was done.
    pub(super) last_done: Ps,
}

impl Work {
    pub(super) fn new(transfers: Vec<Transfer>, hosts: usize) -> Self {
        let mut tstate: Vec<TState> = transfers
            .iter()
            .map(|t| TState { deps_left: t.deps.len() as u32, dependents: Vec::new(), received: 0, done_at: None })
            .collect();
        for (i, t) in transfers.iter().enumerate() {
            for &d in &t.deps {
                tstate[d as usize].dependents.push(i as u32);
            }
        }
        let remaining = transfers.len();
        Self { transfers, tstate, host_ready: vec![Vec::new(); hosts], host_batch_at: vec![None; hosts], remaining, last_done: 0 }
    }

    /// When transfer `t` may start at the earliest, ps.
    fn start_ps(&self, t: u32) -> Ps {
        (self.transfers[t as usize].start_us * PS_PER_US as f64) as Ps
    }
}

impl Sim {
    /// The lower bound of this run's workload, µs.
    pub fn bound_us(&self) -> f64 {
        let fab = &self.net.fab;
        let host_link = &fab.ports[fab.nic_port[0] as usize];
        let bytes_per_us = 1e9 / host_link.nominal_mps_per_byte as f64; // mps/byte → bytes per µs
        let payload = self.net.payload as u64;
        let per_pkt = (DATA_HEADER_LEN + self.net.overhead) as u64;
        let wire = |b: u64| (b + b.div_ceil(payload) * per_pkt) as f64;
        let prop = host_link.prop_ps as f64 / PS_PER_US as f64;
        let full_pkt_us = (payload + per_pkt) as f64 / bytes_per_us;
        let hops = &fab.hops;
        let hosts = fab.hosts;
        let lat = |s: u32, d: u32| {
            let h = hops[s as usize * hosts + d as usize] as f64;
            h * prop + (h - 1.0).max(0.0) * full_pkt_us
        };
        let hosts_bound = workload::lower_bound_us(&self.work.transfers, hosts, bytes_per_us, fab.rails, wire, lat);
        hosts_bound.max(self.leaf_bound_us(&wire) + lat(0, (hosts - 1) as u32).min(2.0 * prop))
    }

    /// The busiest leaf's traffic to (or from) other leaves through all of its uplinks at line rate, µs
    /// (single-rail fabrics; with rails the leaf a byte crosses depends on the rail policy).
    fn leaf_bound_us(&self, wire: &dyn Fn(u64) -> f64) -> f64 {
        let fab = &self.net.fab;
        if fab.rails != 1 {
            return 0.0;
        }
        let leaf_of = |h: u32| fab.ports[fab.nic_port[h as usize] as usize].to as usize;
        let n = fab.nodes.len();
        let (mut up, mut down) = (vec![0.0f64; n], vec![0.0f64; n]);
        for t in self.work.transfers.iter().filter(|t| t.src != t.dst) {
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
                let cap: f64 = fab.nodes[l]
                    .ports
                    .iter()
                    .map(|&p| &fab.ports[p as usize])
                    .filter(|p| fab.tier(p.to) > 1)
                    .map(|p| 1e9 / p.nominal_mps_per_byte as f64)
                    .sum();
                up[l].max(down[l]) / cap.max(1e-9)
            })
            .fold(0.0, f64::max)
    }

    /// Transfer `t`'s dependencies are done: it starts at `at` (through its host's next batch).
    pub(super) fn make_ready(&mut self, t: u32, at: Ps) {
        let tr = &self.work.transfers[t as usize];
        if tr.src == tr.dst || tr.bytes == 0 {
            // A gate, or traffic that never leaves the host: done when ready.
            if at <= self.now {
                self.transfer_done(t);
            } else {
                let host = tr.src;
                self.work.host_ready[host as usize].push(t);
                self.schedule_batch(host, at);
            }
            return;
        }
        let host = tr.src;
        self.work.host_ready[host as usize].push(t);
        self.schedule_batch(host, at.max(self.now));
    }

    fn schedule_batch(&mut self, host: u32, at: Ps) {
        if self.work.host_batch_at[host as usize].is_none_or(|x| at < x) {
            self.work.host_batch_at[host as usize] = Some(at);
            self.q.push(at, Event::StartBatch { host });
        }
    }

    /// `bytes` of transfer `t` arrived.
    pub(super) fn transfer_received(&mut self, t: u32, bytes: u64) {
        let st = &mut self.work.tstate[t as usize];
        st.received += bytes;
        if st.received >= self.work.transfers[t as usize].bytes {
            self.transfer_done(t);
        }
    }

    fn transfer_done(&mut self, t: u32) {
        let st = &mut self.work.tstate[t as usize];
        if st.done_at.is_some() {
            return;
        }
        st.done_at = Some(self.now);
        self.work.remaining -= 1;
        self.work.last_done = self.work.last_done.max(self.now);
        let deps = std::mem::take(&mut self.work.tstate[t as usize].dependents);
        for d in deps {
            let st = &mut self.work.tstate[d as usize];
            st.deps_left -= 1;
            if st.deps_left == 0 {
                let at = self.work.start_ps(d);
                self.make_ready(d, at.max(self.now));
            }
        }
    }

    /// Plan and post every transfer of `host` that is ready now, as one batch (Ethereal's interceptor
    /// sees sends posted at the same instant together).
    pub(super) fn start_batch(&mut self, host: u32) {
        if self.work.host_batch_at[host as usize] != Some(self.now) {
            return;
        }
        self.work.host_batch_at[host as usize] = None;
        let now = self.now;
        let all = std::mem::take(&mut self.work.host_ready[host as usize]);
        let (ready, later): (Vec<u32>, Vec<u32>) = all.into_iter().partition(|&t| self.work.start_ps(t) <= now);
        if !later.is_empty() {
            let next = later.iter().map(|&t| self.work.start_ps(t)).min().unwrap_or(now);
            self.work.host_ready[host as usize] = later;
            self.schedule_batch(host, next);
        }
        let mut net = Vec::new();
        for t in ready {
            let tr = &self.work.transfers[t as usize];
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
                let tr = &self.work.transfers[t as usize];
                SendReq { dst_host: tr.dst as usize, len: tr.bytes, flow: t as u64, home_rail: tr.home_rail }
            })
            .collect();
        let now_us = self.now_us();
        let plans = match self.hosts.runtimes[host as usize].plan_batch(&reqs, now_us) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("planning failed: {e}");
                return;
            }
        };
        let gated = self.hosts.cfg.cc == CcKind::Mcc;
        for (k, plan) in plans.iter().enumerate() {
            let t = net[k];
            let tr = self.work.transfers[t as usize].clone();
            // Bytes and earliest start per (rail, pinned uplink), in first-seen order.
            let mut groups: BTreeMap<(u16, u32), (u64, u32)> = BTreeMap::new();
            for c in &plan.chunks {
                let key = (c.rail, c.uplink.map_or(u32::MAX, u32::from));
                let g = groups.entry(key).or_insert((0, u32::MAX));
                g.0 += c.len as u64;
                g.1 = g.1.min(c.start_after_us);
            }
            for ((rail, pin), (bytes, after_us)) in groups {
                let dst_rail = match (tr.dst_rail, self.hosts.cfg.rail) {
                    // GPU-bound NICs without rail alignment: the data lands on the destination GPU's
                    // NIC, crossing rails through the spines (RailS's baselines).
                    (Some(r), RailKind::Single) => r,
                    (Some(r), _) if self.hosts.scheme.deliver_to_gpu_nic => r,
                    _ => rail,
                };
                let pin = (pin != u32::MAX).then_some(pin as u16);
                // Checked when the engine was built: such a transfer has one group, (rail 0, no pin).
                debug_assert!(!tr.recv_at_start || (rail, dst_rail, pin) == (0, 0, None));
                let pair = self.pair_for(tr.src, tr.dst, rail, dst_rail, pin);
                let ready_at = now + after_us as u64 * PS_PER_US;
                let chunk = if gated { self.hosts.scheme.msg_chunk.max(1) } else { bytes };
                let mut left = bytes;
                while left > 0 {
                    let b = left.min(chunk);
                    left -= b;
                    let piece = Piece { transfer: t, bytes: b, ready_at };
                    let p = &mut self.hosts.pairs[pair as usize];
                    if !tr.recv_at_start {
                        p.pending_recv.push_back(piece);
                    }
                    p.pending_send.push_back(piece);
                }
                self.pump_recv(pair);
                self.pump_send(pair);
            }
        }
    }
}
