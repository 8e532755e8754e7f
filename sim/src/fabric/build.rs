//! Building a fabric: the nodes and links of a leaf-spine, rail-optimised or fat-tree topology, and
//! the switches' routing tables (equal-cost next hops per destination NIC, by BFS).

use std::collections::{HashMap, VecDeque};

use rand::{rngs::SmallRng, SeedableRng};

use prism_lb::splitmix64;

use super::{Fabric, Node, NodeKind, Port, PortStats};
use crate::events::{Ps, PS_PER_NS, PS_PER_US};
use crate::scenario::{invalid, LinkSpec, ScenarioError, SwitchMode, TopologySpec};

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
            rng: SmallRng::seed_from_u64(splitmix64(seed ^ 0x5157)),
            salt: splitmix64(seed ^ 0xEC3F),
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
}
