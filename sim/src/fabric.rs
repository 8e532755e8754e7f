//! The fabric: nodes (hosts and switches), ports (directed links with a FIFO output queue, a rate, a
//! propagation delay, an ECN threshold and a failure state), routing tables of equal-cost next hops per
//! destination NIC, and the switches' choice among them (path id, ECMP hash, spraying, round robin,
//! adaptive, OFAN, flowlets).

use std::collections::{HashMap, VecDeque};

use rand::{rngs::SmallRng, seq::SliceRandom, Rng, SeedableRng};

use crate::events::{Ps, PS_PER_NS, PS_PER_US};
use crate::scenario::{invalid, LinkSpec, ScenarioError, SwitchMode, TopologySpec};

/// Largest header the simulator keeps per packet (every control packet and a DATA header fit).
pub const MAX_HDR: usize = 80;

/// What switches and ports read of a packet at every hop, kept apart from its header bytes so the
/// per-hop work touches 16 bytes.
#[derive(Debug, Clone, Copy)]
pub struct PacketMeta {
    /// Source NIC (host · rails + rail).
    pub src_nic: u32,
    /// Destination NIC.
    pub dst_nic: u32,
    /// Bytes on the wire (datagram + link overhead): what serialisation and buffers count.
    pub wire_bytes: u32,
    /// Entropy (UDP source port index) the sender chose.
    pub entropy: u16,
    /// True for DATA packets (OFAN keeps separate pointers for data and acknowledgements).
    pub data: bool,
}

/// The packet's wire bytes up to the payload, exactly as the sending connection wrote them (the
/// payload itself is never read by the protocol in the simulator, so only its length is kept).
#[derive(Clone)]
pub struct PacketBody {
    /// Datagram length handed to the protocol at the receiver.
    pub dgram_len: u32,
    /// Bytes of `hdr` that are valid.
    pub hdr_len: u8,
    /// The datagram's first bytes.
    pub hdr: [u8; MAX_HDR],
}

impl PacketBody {
    /// The valid header bytes.
    #[inline]
    pub fn hdr_bytes(&self) -> &[u8] {
        &self.hdr[..self.hdr_len as usize]
    }

    /// The valid header bytes, mutable (ECN marking).
    #[inline]
    pub fn hdr_bytes_mut(&mut self) -> &mut [u8] {
        &mut self.hdr[..self.hdr_len as usize]
    }
}

/// A packet in flight.
#[derive(Clone)]
pub struct Packet {
    /// What the fabric reads.
    pub meta: PacketMeta,
    /// What the receiver reads.
    pub body: PacketBody,
}

/// A pool of packets, recycled so the hot path does not allocate.
#[derive(Default)]
pub struct PacketPool {
    metas: Vec<PacketMeta>,
    bodies: Vec<PacketBody>,
    free: Vec<u32>,
}

impl PacketPool {
    /// Take a slot and fill it.
    #[inline]
    pub fn alloc(&mut self, p: Packet) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.metas[i as usize] = p.meta;
                self.bodies[i as usize] = p.body;
                i
            }
            None => {
                self.metas.push(p.meta);
                self.bodies.push(p.body);
                (self.metas.len() - 1) as u32
            }
        }
    }

    /// Return a slot.
    #[inline]
    pub fn release(&mut self, i: u32) {
        self.free.push(i);
    }

    /// The fabric's view of packet `i`.
    #[inline]
    pub fn get(&self, i: u32) -> &PacketMeta {
        &self.metas[i as usize]
    }

    /// The header bytes of packet `i`.
    #[inline]
    pub fn body(&self, i: u32) -> &PacketBody {
        &self.bodies[i as usize]
    }

    /// The header bytes of packet `i`, mutable (ECN marking).
    #[inline]
    pub fn body_mut(&mut self, i: u32) -> &mut PacketBody {
        &mut self.bodies[i as usize]
    }

    /// Packets alive now (allocated and not released).
    pub fn live(&self) -> usize {
        self.metas.len() - self.free.len()
    }

    /// Slots ever allocated (the high-water mark of packets alive at once).
    pub fn capacity(&self) -> usize {
        self.metas.len()
    }
}

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
    /// Packets waiting (the one being serialised is not in the queue).
    pub queue: VecDeque<u32>,
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

struct RrPtr {
    perm: Vec<u16>,
    pos: u16,
    wraps: u8,
}

struct DrPtr {
    order: Vec<u16>,
    pos: u16,
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

fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

struct Builder {
    nodes: Vec<Node>,
    ports: Vec<Port>,
    links: Vec<(u32, u32)>,
    link: LinkSpec,
}

fn mps_per_byte(gbps: f64) -> u64 {
    // 8 bits per byte at gbps·1e9 bit/s, in ps·1000.
    (8.0e3 / gbps * 1000.0).round() as u64
}

impl Builder {
    fn node(&mut self, kind: NodeKind, name: String, pod: u32) -> u32 {
        self.nodes.push(Node { kind, name, pod, leaf_id: None, ports: Vec::new() });
        (self.nodes.len() - 1) as u32
    }

    fn tier(&self, n: u32) -> u8 {
        match self.nodes[n as usize].kind {
            NodeKind::Host(_) => 0,
            NodeKind::Switch { tier, .. } => tier,
        }
    }

    fn connect(&mut self, a: u32, b: u32) -> (u32, u32) {
        let host_link = self.tier(a) == 0 || self.tier(b) == 0;
        let gbps = if host_link { self.link.host_gbps.unwrap_or(self.link.gbps) } else { self.link.gbps };
        let mk = |from: u32, to: u32, ports: &mut Vec<Port>, nodes: &mut Vec<Node>| {
            let (tf, tt) = (
                match nodes[from as usize].kind {
                    NodeKind::Host(_) => 0u8,
                    NodeKind::Switch { tier, .. } => tier,
                },
                match nodes[to as usize].kind {
                    NodeKind::Host(_) => 0u8,
                    NodeKind::Switch { tier, .. } => tier,
                },
            );
            let m = mps_per_byte(gbps);
            ports.push(Port {
                from,
                to,
                mps_per_byte: m,
                nominal_mps_per_byte: m,
                prop_ps: (self.link.latency_ns * PS_PER_NS as f64).round() as Ps,
                buffer_bytes: self.link.buffer_bytes,
                ecn_bytes: self.link.ecn_bytes,
                queue: VecDeque::new(),
                queued_bytes: 0,
                free_at: 0,
                free_pending: false,
                nic: None,
                failed: false,
                layer: tf * 4 + tt,
                stats: PortStats::default(),
            });
            let id = (ports.len() - 1) as u32;
            nodes[from as usize].ports.push(id);
            id
        };
        let p = mk(a, b, &mut self.ports, &mut self.nodes);
        let q = mk(b, a, &mut self.ports, &mut self.nodes);
        self.links.push((p, q));
        (p, q)
    }
}

/// Layer names by `tier_from * 4 + tier_to`.
fn layer_name(l: u8, top: u8) -> String {
    let t = |x: u8| match (x, top) {
        (0, _) => "host",
        (1, _) => "leaf",
        (2, 2) => "spine",
        (2, _) => "agg",
        _ => "core",
    };
    format!("{}->{}", t(l / 4), t(l % 4))
}

impl Fabric {
    /// Build the fabric of `topo` with `link` parameters; switches choose next hops by `mode`.
    pub fn new(topo: &TopologySpec, link: &LinkSpec, mode: SwitchMode, flowlet_gap_us: f64, seed: u64) -> Result<Self, ScenarioError> {
        let mut b = Builder { nodes: Vec::new(), ports: Vec::new(), links: Vec::new(), link: link.clone() };
        let hosts = topo.hosts();
        let rails = topo.rails();
        for h in 0..hosts {
            b.node(NodeKind::Host(h as u32), format!("host{h}"), 0);
        }
        let mut nic_port = vec![u32::MAX; hosts * rails];
        let mut sw_count = 0u32;
        let mut sw = |b: &mut Builder, tier: u8, name: String, pod: u32| {
            let n = b.node(NodeKind::Switch { tier, index: sw_count }, name, pod);
            sw_count += 1;
            n
        };
        let mut leaves: Vec<u32> = Vec::new();
        let mut up_fanout = [1u32; 4];
        let top;
        match *topo {
            TopologySpec::LeafSpine { hosts, hosts_per_leaf, spines } | TopologySpec::Rails { hosts, hosts_per_leaf, spines, .. } => {
                let per_rail = hosts.div_ceil(hosts_per_leaf);
                for r in 0..rails {
                    for g in 0..per_rail {
                        let name = if rails > 1 { format!("leaf{}", r * per_rail + g) } else { format!("leaf{g}") };
                        leaves.push(sw(&mut b, 1, name, g as u32));
                    }
                }
                let sp: Vec<u32> = (0..spines).map(|s| sw(&mut b, 2, format!("spine{s}"), 0)).collect();
                for h in 0..hosts {
                    for r in 0..rails {
                        let leaf = leaves[r * per_rail + h / hosts_per_leaf];
                        let (p, _) = b.connect(h as u32, leaf);
                        nic_port[h * rails + r] = p;
                    }
                }
                for &l in &leaves {
                    for &s in &sp {
                        b.connect(l, s);
                    }
                }
                up_fanout[1] = spines as u32;
                top = 2;
            }
            TopologySpec::FatTree { k } => {
                let half = k / 2;
                let mut edges = Vec::new();
                let mut aggs = Vec::new();
                for p in 0..k {
                    for i in 0..half {
                        edges.push(sw(&mut b, 1, format!("edge{}", p * half + i), p as u32));
                    }
                }
                for p in 0..k {
                    for i in 0..half {
                        aggs.push(sw(&mut b, 2, format!("agg{}", p * half + i), p as u32));
                    }
                }
                let cores: Vec<u32> = (0..half * half).map(|c| sw(&mut b, 3, format!("core{c}"), 0)).collect();
                for h in 0..hosts {
                    let e = edges[h / half];
                    let (p, _) = b.connect(h as u32, e);
                    nic_port[h] = p;
                }
                for p in 0..k {
                    for i in 0..half {
                        for j in 0..half {
                            b.connect(edges[p * half + i], aggs[p * half + j]);
                        }
                    }
                }
                // Aggregation j of every pod connects to cores j·k/2 .. (j+1)·k/2.
                for p in 0..k {
                    for j in 0..half {
                        for c in 0..half {
                            b.connect(aggs[p * half + j], cores[j * half + c]);
                        }
                    }
                }
                leaves = edges;
                up_fanout[1] = half as u32;
                up_fanout[2] = half as u32;
                top = 3;
            }
        }
        for (i, &l) in leaves.iter().enumerate() {
            b.nodes[l as usize].leaf_id = Some(i as u32);
        }
        for (nic, &p) in nic_port.iter().enumerate() {
            b.ports[p as usize].nic = Some(nic as u32);
        }
        let mut radix_div = [1u32; 4];
        for t in 2..4 {
            radix_div[t] = radix_div[t - 1] * up_fanout[t - 1];
        }
        let paths_between_leaves: u32 = up_fanout[1..top as usize].iter().product();
        let leaf_uplinks = vec![paths_between_leaves.min(1024) as u16; leaves.len()];
        let switches: Vec<u32> =
            (0..b.nodes.len() as u32).filter(|&n| matches!(b.nodes[n as usize].kind, NodeKind::Switch { .. })).collect();
        let n_dst = hosts * rails;
        let mut fabric = Fabric {
            route: vec![u32::MAX; switches.len() * n_dst],
            groups: Vec::new(),
            radix_div,
            paths_between_leaves,
            leaves: leaves.len(),
            leaf_uplinks,
            links: b.links,
            hops: vec![0; hosts * hosts],
            mode,
            rng: SmallRng::seed_from_u64(mix64(seed ^ 0x5157)),
            salt: mix64(seed ^ 0xEC3F),
            rr: Vec::new(),
            ofan: Vec::new(),
            flowlets: HashMap::new(),
            flowlet_gap: (flowlet_gap_us * PS_PER_US as f64) as Ps,
            layer_names: (0..16).map(|l| layer_name(l, top)).collect(),
            nodes: b.nodes,
            ports: b.ports,
            hosts,
            rails,
            nic_port,
            switches,
        };
        fabric.build_routes()?;
        let n_groups = fabric.groups.len();
        fabric.rr = (0..n_groups).map(|_| None).collect();
        fabric.ofan = (0..fabric.switches.len() * fabric.leaves * 2).map(|_| None).collect();
        Ok(fabric)
    }

    fn build_routes(&mut self) -> Result<(), ScenarioError> {
        let n = self.nodes.len();
        let n_dst = self.hosts * self.rails;
        let mut interned: HashMap<Vec<u32>, u32> = HashMap::new();
        let mut dist = vec![u32::MAX; n];
        let mut bfs = VecDeque::new();
        for d in 0..n_dst {
            let (host, rail) = (d / self.rails, d % self.rails);
            dist.iter_mut().for_each(|x| *x = u32::MAX);
            dist[host] = 0;
            let first = self.ports[self.nic_port[d] as usize].to;
            dist[first as usize] = 1;
            bfs.clear();
            bfs.push_back(first);
            while let Some(u) = bfs.pop_front() {
                for &p in &self.nodes[u as usize].ports {
                    let v = self.ports[p as usize].to;
                    if dist[v as usize] == u32::MAX && matches!(self.nodes[v as usize].kind, NodeKind::Switch { .. }) {
                        dist[v as usize] = dist[u as usize] + 1;
                        bfs.push_back(v);
                    }
                }
            }
            for (si, &s) in self.switches.iter().enumerate() {
                let ds = dist[s as usize];
                if ds == u32::MAX {
                    continue;
                }
                let mut cands: Vec<u32> = self.nodes[s as usize]
                    .ports
                    .iter()
                    .copied()
                    .filter(|&p| {
                        let v = self.ports[p as usize].to;
                        if v as usize == host {
                            // Only the destination NIC's own link reaches it.
                            ds == 1 && p == self.nic_down(host, rail)
                        } else {
                            matches!(self.nodes[v as usize].kind, NodeKind::Switch { .. }) && dist[v as usize] + 1 == ds
                        }
                    })
                    .collect();
                cands.sort_unstable();
                if cands.is_empty() {
                    return Err(invalid("topology", "a switch has no route to a host"));
                }
                let next = interned.len() as u32;
                let g = *interned.entry(cands.clone()).or_insert_with(|| {
                    self.groups.push(cands);
                    next
                });
                self.route[si * n_dst + d] = g;
            }
            // Hop counts on rail 0 from every host's NIC 0.
            if rail == 0 {
                for src in 0..self.hosts {
                    let first = self.ports[self.nic_port[src * self.rails] as usize].to;
                    let dd = dist[first as usize];
                    self.hops[src * self.hosts + host] = if src == host { 0 } else { (dd + 1).min(255) as u8 };
                }
            }
        }
        Ok(())
    }

    /// The port from NIC `rail` of `host`'s leaf down to the host.
    fn nic_down(&self, host: usize, rail: usize) -> u32 {
        let up = &self.ports[self.nic_port[host * self.rails + rail] as usize];
        let leaf = up.to;
        *self.nodes[leaf as usize]
            .ports
            .iter()
            .filter(|&&p| self.ports[p as usize].to == host as u32)
            .nth(
                // With several NICs of one host under one leaf, the r-th such link is NIC r's.
                (0..rail).filter(|&r| self.ports[self.nic_port[host * self.rails + r] as usize].to == leaf).count(),
            )
            .expect("every NIC's leaf links back to it")
    }

    /// The switch index of node `n`.
    fn switch_index(&self, n: u32) -> usize {
        match self.nodes[n as usize].kind {
            NodeKind::Switch { index, .. } => index as usize,
            NodeKind::Host(_) => unreachable!("hosts do not forward"),
        }
    }

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
                (mix64(key ^ mix64(self.salt ^ si as u64)) % n as u64) as usize
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
                let key = mix64((si as u64) << 48 ^ (pkt.src_nic as u64) << 32 ^ (pkt.dst_nic as u64) << 16 ^ pkt.entropy as u64);
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

    /// The candidate next-hop ports of switch node `node` towards `dst_nic` (for tests and reports).
    pub fn candidates(&self, node: u32, dst_nic: u32) -> &[u32] {
        let si = self.switch_index(node);
        let g = self.route[si * self.hosts * self.rails + dst_nic as usize];
        &self.groups[g as usize]
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
