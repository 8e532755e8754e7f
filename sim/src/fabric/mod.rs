//! The fabric: nodes (hosts and switches), ports (directed links with a FIFO output queue, a rate, a
//! propagation delay, an ECN threshold and a failure state), routing tables of equal-cost next hops per
//! destination NIC, and the switches' choice among them (path id, ECMP hash, spraying, round robin,
//! adaptive, OFAN, flowlets).

//!
//! - [`packet`]: packets and their pool;
//! - building a topology and its routing tables (`build`);
//! - the switches' choice of next hop (`switch`).

mod build;
mod packet;
mod switch;

use std::collections::{HashMap, VecDeque};

use rand::rngs::SmallRng;

use crate::events::Ps;
use crate::scenario::{invalid, ScenarioError, SwitchMode};

pub use packet::{Packet, PacketBody, PacketMeta, PacketPool, MAX_HDR};
use switch::{DrPtr, RrPtr};

/// What a node is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKind {
    /// Host `id`.
    Host(u32),
    /// A switch at `tier` (1 = leaf/edge, 2 = spine/aggregation, 3 = core).
    Switch {
        /// Tier.
        tier: u8,
        /// Index among the switches.
        index: u32,
    },
}

/// A node of the fabric.
#[derive(Debug, Clone)]
pub struct Node {
    /// Kind.
    pub kind: NodeKind,
    /// Name used in scenario files and results (`host3`, `leaf0`, `spine2`, `edge5`, `agg1`, `core0`).
    pub name: String,
    /// Pod (fat tree), else the leaf group; used by OFAN to consolidate pointers.
    pub pod: u32,
    /// For leaves: the leaf id given to `prism-lb`'s topology.
    pub leaf_id: Option<u32>,
    /// Outgoing ports.
    pub ports: Vec<u32>,
}

/// A directed link with its output queue at the sending end.
#[derive(Debug, Clone)]
pub struct Port {
    /// Sending node.
    pub from: u32,
    /// Receiving node.
    pub to: u32,
    /// Serialisation time, thousandths of a ps per byte.
    pub mps_per_byte: u64,
    /// The nominal value of `mps_per_byte` (slow links scale it).
    pub nominal_mps_per_byte: u64,
    /// Propagation delay, ps.
    pub prop_ps: Ps,
    /// Buffer, bytes (packets beyond it are tail-dropped).
    pub buffer_bytes: u64,
    /// ECN threshold, bytes (0: off).
    pub ecn_bytes: u64,
    /// Packets waiting (the one being serialised is not in the queue) with their wire bytes, so a port
    /// sends its next packet without reading the packet itself.
    pub queue: VecDeque<(u32, u32)>,
    /// Bytes waiting.
    pub queued_bytes: u64,
    /// When the packet being serialised (if any) has left: the port is idle from then on.
    pub free_at: Ps,
    /// A `PortFree` event is scheduled (NIC ports: the NIC is sending; switch ports: packets wait).
    pub free_pending: bool,
    /// For a host's port: its NIC index (host · rails + rail).
    pub nic: Option<u32>,
    /// Failed: everything sent to it is silently dropped.
    pub failed: bool,
    /// Layer label index (see [`Fabric::layer_names`]).
    pub layer: u8,
    /// Counters.
    pub stats: PortStats,
}

/// Counters of one port.
#[derive(Debug, Clone, Default)]
pub struct PortStats {
    /// Packets handed to the port by its switch (before any drop).
    pub offered: u64,
    /// Bytes serialised.
    pub tx_bytes: u64,
    /// Packets serialised.
    pub tx_pkts: u64,
    /// Packets tail-dropped (buffer full).
    pub drops_overflow: u64,
    /// Packets dropped because the link had failed.
    pub drops_failed: u64,
    /// When the last packet was dropped on a failed link, ps.
    pub last_failed_drop: Option<Ps>,
    /// DATA packets marked CE.
    pub ecn_marks: u64,
    /// Largest queue seen, bytes.
    pub max_queue: u64,
}

impl Port {
    /// Serialisation time of `bytes`, ps.
    #[inline]
    pub fn ser_ps(&self, bytes: u32) -> Ps {
        (bytes as u64 * self.mps_per_byte).div_ceil(1000)
    }
}

/// The whole fabric and its switches' state.
pub struct Fabric {
    /// Nodes; hosts first (node id = host id).
    pub nodes: Vec<Node>,
    /// Ports.
    pub ports: Vec<Port>,
    /// Hosts.
    pub hosts: usize,
    /// NICs per host.
    pub rails: usize,
    /// `nic_port[h * rails + r]`: the port from host h's NIC r into the fabric.
    pub nic_port: Vec<u32>,
    /// Switch node ids by switch index.
    pub switches: Vec<u32>,
    /// `route[switch * n_dst + dst_nic]`: group of equal-cost next-hop ports.
    route: Vec<u32>,
    /// Next-hop groups (interned port lists).
    groups: Vec<Vec<u32>>,
    /// `radix_div[tier]`: product of the up-fanouts of the tiers below (path-id routing).
    radix_div: [u32; 4],
    /// Distinct up-paths from a leaf to the top tier (the number of paths between two far leaves).
    pub paths_between_leaves: u32,
    /// Number of leaves (switches of tier 1).
    pub leaves: usize,
    /// Per leaf id: its up-fanout.
    pub leaf_uplinks: Vec<u16>,
    /// Links (switch-switch or host-switch) counted once, as (port a→b, port b→a).
    pub links: Vec<(u32, u32)>,
    /// Hop count (links) from NIC to NIC: `hops[src_host * hosts + dst_host]` on rail 0.
    pub hops: Vec<u8>,
    mode: SwitchMode,
    rng: SmallRng,
    salt: u64,
    rr: Vec<Option<RrPtr>>,
    ofan: Vec<Option<DrPtr>>,
    flowlets: HashMap<u64, (u16, Ps)>,
    flowlet_gap: Ps,
    /// Names of the port layers.
    pub layer_names: Vec<String>,
}

impl Fabric {
    /// The switch index of node `n`.
    fn switch_index(&self, n: u32) -> usize {
        match self.nodes[n as usize].kind {
            NodeKind::Switch { index, .. } => index as usize,
            NodeKind::Host(_) => unreachable!("hosts do not forward"),
        }
    }

    /// The node with this name.
    pub fn node_by_name(&self, name: &str) -> Option<u32> {
        self.nodes.iter().position(|n| n.name == name).map(|i| i as u32)
    }

    /// The `index`-th pair of ports joining nodes `a` and `b` (a→b, b→a).
    pub fn link_between(&self, a: u32, b: u32, index: usize) -> Option<(u32, u32)> {
        self.links
            .iter()
            .copied()
            .filter(|&(p, _)| {
                let port = &self.ports[p as usize];
                (port.from == a && port.to == b) || (port.from == b && port.to == a)
            })
            .nth(index)
    }

    /// Tier of node `n` (0 for hosts).
    pub fn tier(&self, n: u32) -> u8 {
        match self.nodes[n as usize].kind {
            NodeKind::Host(_) => 0,
            NodeKind::Switch { tier, .. } => tier,
        }
    }

    /// The `prism-lb` topology matching this fabric: every leaf with as many "uplinks" as distinct
    /// paths to a far leaf (so an uplink class is one path id), hosts by leaf per rail.
    pub fn lb_topology(&self) -> Result<prism_lb::Topology, ScenarioError> {
        let leaves = self.leaf_uplinks.iter().map(|&u| prism_lb::topology::Leaf { uplinks: u, entropy_uplink: None }).collect();
        let hosts = (0..self.hosts)
            .map(|h| prism_lb::topology::Host {
                name: None,
                leaves: (0..self.rails)
                    .map(|r| {
                        let leaf = self.ports[self.nic_port[h * self.rails + r] as usize].to;
                        self.nodes[leaf as usize].leaf_id.unwrap_or(0)
                    })
                    .collect(),
            })
            .collect();
        prism_lb::Topology::new(self.rails as u16, self.paths_between_leaves.min(u16::MAX as u32) as u16, leaves, hosts)
            .map_err(|e| invalid("topology", e.to_string()))
    }
}
