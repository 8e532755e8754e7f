//! The switches' choice among equal-cost next hops: path id, ECMP hash, spraying, round robin
//! (re-permuted or not), adaptive (shortest quantised queue), OFAN and flowlets.

use rand::{seq::SliceRandom, Rng};

use prism_lb::splitmix64;

use super::{Fabric, NodeKind, PacketMeta};
use crate::events::Ps;
use crate::scenario::SwitchMode;

/// A round-robin pointer over a next-hop group, in a shuffled order.
pub(super) struct RrPtr {
    perm: Vec<u16>,
    pos: u16,
    wraps: u8,
}

/// OFAN's destination-rotation pointer.
pub(super) struct DrPtr {
    order: Vec<u16>,
    pos: u16,
}

impl Fabric {
    /// The output port switch `node` uses for `pkt` (arrived at `now`).
    pub fn next_hop(&mut self, node: u32, pkt: &PacketMeta, now: Ps) -> u32 {
        let si = self.switch_index(node);
        let n_dst = self.hosts * self.rails;
        let g = self.route[si * n_dst + pkt.dst_nic as usize] as usize;
        let n = self.groups[g].len();
        if n == 1 {
            return self.groups[g][0];
        }
        let tier = match self.nodes[node as usize].kind {
            NodeKind::Switch { tier, .. } => tier as usize,
            NodeKind::Host(_) => 0,
        };
        let idx = match self.mode {
            SwitchMode::PathId => (pkt.entropy as u32 / self.radix_div[tier]) as usize % n,
            SwitchMode::Hash => {
                let key = (pkt.src_nic as u64) | (pkt.dst_nic as u64) << 24 | (pkt.entropy as u64) << 48;
                (splitmix64(key ^ splitmix64(self.salt ^ si as u64)) % n as u64) as usize
            }
            SwitchMode::Spray => self.rng.gen_range(0..n),
            SwitchMode::RoundRobin | SwitchMode::SimpleRoundRobin => {
                let repermute = self.mode == SwitchMode::RoundRobin;
                let rng = &mut self.rng;
                let ptr = self.rr[g].get_or_insert_with(|| {
                    let mut perm: Vec<u16> = (0..n as u16).collect();
                    perm.shuffle(rng);
                    RrPtr { perm, pos: 0, wraps: 0 }
                });
                let i = ptr.perm[ptr.pos as usize] as usize;
                ptr.pos += 1;
                if ptr.pos as usize == n {
                    ptr.pos = 0;
                    ptr.wraps += 1;
                    if repermute && ptr.wraps == 5 {
                        ptr.wraps = 0;
                        ptr.perm.shuffle(rng);
                    }
                }
                i
            }
            SwitchMode::Adaptive => {
                let ports = &self.groups[g];
                let bin = |p: u32| {
                    let port = &self.ports[p as usize];
                    let f = port.queued_bytes as f64 / port.buffer_bytes.max(1) as f64;
                    if f < 0.05 {
                        0
                    } else if f < 0.10 {
                        1
                    } else if f < 0.20 {
                        2
                    } else {
                        3
                    }
                };
                let best = ports.iter().map(|&p| bin(p)).min().unwrap_or(0);
                let count = ports.iter().filter(|&&p| bin(p) == best).count();
                let pick = self.rng.gen_range(0..count);
                ports.iter().enumerate().filter(|&(_, &p)| bin(p) == best).nth(pick).map(|(i, _)| i).unwrap_or(0)
            }
            SwitchMode::Ofan => {
                let dst_leaf_node = self.ports[self.nic_port[pkt.dst_nic as usize] as usize].to as usize;
                let leaf = self.nodes[dst_leaf_node].leaf_id.unwrap_or(0) as usize;
                // Consolidate at the coarsest waypoint: edges keep one pointer per destination leaf,
                // higher tiers one per destination pod.
                let key = if tier <= 1 { leaf } else { self.nodes[dst_leaf_node].pod as usize };
                let slot = (si * self.leaves + key.min(self.leaves - 1)) * 2 + pkt.data as usize;
                let rng = &mut self.rng;
                let ptr = self.ofan[slot].get_or_insert_with(|| {
                    let mut order: Vec<u16> = (0..n as u16).collect();
                    order.shuffle(rng);
                    DrPtr { pos: rng.gen_range(0..n as u16), order }
                });
                let i = ptr.order[ptr.pos as usize % ptr.order.len()] as usize;
                ptr.pos = (ptr.pos + 1) % ptr.order.len() as u16;
                i
            }
            SwitchMode::Flowlet => {
                let key = splitmix64((si as u64) << 48 ^ (pkt.src_nic as u64) << 32 ^ (pkt.dst_nic as u64) << 16 ^ pkt.entropy as u64);
                let gap = self.flowlet_gap;
                let rng = &mut self.rng;
                let e = self.flowlets.entry(key).or_insert((u16::MAX, 0));
                if e.0 == u16::MAX || now.saturating_sub(e.1) > gap || e.0 as usize >= n {
                    e.0 = rng.gen_range(0..n) as u16;
                }
                e.1 = now;
                e.0 as usize
            }
        };
        self.groups[g][idx]
    }
}
