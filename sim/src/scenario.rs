//! Scenario files: the fabric, the workload, the schemes to compare and what to vary, as JSON.
//! Every field has a default where a sensible one exists; unknown fields are errors.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A scenario that cannot be loaded or run; the message says which field and why.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The JSON does not parse or has an unknown or mistyped field.
    #[error("scenario JSON: {0}")]
    Parse(#[from] serde_json::Error),
    /// A field has a value the simulator cannot use.
    #[error("scenario field {field}: {reason}")]
    Invalid {
        /// The field.
        field: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
    /// The load-balancing variables of a scheme are invalid.
    #[error("scheme {scheme}: {source}")]
    Lb {
        /// The scheme's name.
        scheme: String,
        /// The `prism-lb` error (names the variable).
        source: prism_lb::ConfigError,
    },
}

pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ScenarioError {
    ScenarioError::Invalid { field: field.into(), reason: reason.into() }
}

/// One experiment: a fabric, a workload, and the schemes (and message sizes) to run it with.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name (used for output files).
    pub name: String,
    /// What the experiment reproduces.
    #[serde(default)]
    pub description: String,
    /// Seed of every random choice (policies, workload, failures); run `r` uses `seed + r`.
    #[serde(default = "one")]
    pub seed: u64,
    /// Repetitions with consecutive seeds (results are averaged).
    #[serde(default = "one_u32")]
    pub runs: u32,
    /// The fabric.
    pub topology: TopologySpec,
    /// Link parameters.
    pub link: LinkSpec,
    /// Packet sizes.
    #[serde(default)]
    pub packet: PacketSpec,
    /// Protocol (proto) parameters of every connection.
    #[serde(default)]
    pub proto: ProtoSpec,
    /// The traffic.
    pub workload: WorkloadSpec,
    /// Message sizes to sweep (bytes); each replaces the workload's `bytes`. Empty: the workload's own.
    #[serde(default)]
    pub sizes: Vec<u64>,
    /// The schemes compared; every one runs on every size.
    pub schemes: Vec<SchemeSpec>,
    /// Link failures and slow links.
    #[serde(default)]
    pub failures: FailureSpec,
    /// Queue sampling period, µs (0: no time series; maxima are always exact).
    #[serde(default = "default_sample_us")]
    pub sample_us: f64,
    /// Stop a run at this simulated time, ms (a safety net against a stuck scheme).
    #[serde(default = "default_max_ms")]
    pub max_sim_ms: f64,
    /// What the paper reports, for the side-by-side table (free text per metric).
    #[serde(default)]
    pub paper: BTreeMap<String, String>,
    /// Overrides merged into this scenario for the scaled-down CI version: key by key, objects one level
    /// deep, except objects with a `kind` (topology, workload), which replace the original whole.
    #[serde(default)]
    pub ci: Option<serde_json::Value>,
}

fn one() -> u64 {
    1
}
fn one_u32() -> u32 {
    1
}
fn default_sample_us() -> f64 {
    1.0
}
fn default_max_ms() -> f64 {
    1000.0
}

/// The fabric's shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TopologySpec {
    /// Two tiers: `hosts / hosts_per_leaf` leaves, each with one link to every spine.
    LeafSpine {
        /// Hosts.
        hosts: usize,
        /// Hosts under each leaf.
        hosts_per_leaf: usize,
        /// Spines (= uplinks per leaf).
        spines: usize,
    },
    /// Rail-optimised: every host has `rails` NICs; NIC r of host h hangs from leaf (r, h / hosts_per_leaf);
    /// every leaf has one link to every spine.
    Rails {
        /// Hosts (compute domains).
        hosts: usize,
        /// NICs per host.
        rails: usize,
        /// Hosts under each leaf of a rail.
        hosts_per_leaf: usize,
        /// Spines shared by all rails.
        spines: usize,
    },
    /// Three-tier k-ary fat tree: k pods of k/2 edge and k/2 aggregation switches, (k/2)² cores,
    /// k³/4 hosts.
    FatTree {
        /// Switch radix (even).
        k: usize,
    },
}

impl TopologySpec {
    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        match *self {
            TopologySpec::LeafSpine { hosts, .. } | TopologySpec::Rails { hosts, .. } => hosts,
            TopologySpec::FatTree { k } => k * k * k / 4,
        }
    }

    /// NICs per host.
    pub fn rails(&self) -> usize {
        match *self {
            TopologySpec::Rails { rails, .. } => rails,
            _ => 1,
        }
    }
}

/// Link parameters (all links alike unless a failure makes one slow).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Rate, Gbit/s.
    pub gbps: f64,
    /// Propagation delay, ns.
    pub latency_ns: f64,
    /// Output buffer per switch port, bytes.
    pub buffer_bytes: u64,
    /// ECN marking threshold, bytes of queue (0: no marking).
    #[serde(default)]
    pub ecn_bytes: u64,
    /// Host NIC rate if different from `gbps`.
    #[serde(default)]
    pub host_gbps: Option<f64>,
}

/// Packet sizes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PacketSpec {
    /// Payload bytes per DATA packet (a multiple of 128, as Prism's packets carry whole LL128 lines).
    pub payload: usize,
    /// Bytes each packet takes on the wire beyond Prism's datagram (Ethernet/IP/UDP headers, FCS,
    /// preamble and inter-frame gap).
    pub overhead: usize,
}

impl Default for PacketSpec {
    fn default() -> Self {
        Self { payload: 4096, overhead: 66 }
    }
}

/// Protocol parameters (see `prism_transport::proto::ProtoConfig`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProtoSpec {
    /// Entropies per connection, as a multiple of the distinct paths between two leaves (at least 1).
    pub entropies_per_path: u16,
    /// Fixed entropy count (overrides `entropies_per_path`).
    pub n_paths: Option<u16>,
    /// Most DATA packets in flight per connection.
    pub window_pkts: u32,
    /// Initial reorder threshold, packets.
    pub reorder_threshold: u32,
    /// Smallest RTO, µs.
    pub rto_min_us: u64,
    /// RTO before any sample, µs.
    pub rto_initial_us: u64,
    /// Largest RTO (exponential backoff stops here), µs.
    pub rto_max_us: u64,
    /// Consecutive timeouts before a path is dead.
    pub path_dead_after: u32,
    /// SACK every this many packets.
    pub sack_every_pkts: u32,
    /// ... or this long after the first unacknowledged one, µs.
    pub sack_delay_us: u64,
}

impl Default for ProtoSpec {
    fn default() -> Self {
        Self {
            entropies_per_path: 1,
            n_paths: None,
            window_pkts: 512,
            reorder_threshold: 32,
            rto_min_us: 100,
            rto_initial_us: 1000,
            rto_max_us: 200_000,
            path_dead_after: 3,
            sack_every_pkts: 8,
            sack_delay_us: 5,
        }
    }
}

/// The traffic of one run. `bytes` is the message size the sweep replaces.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkloadSpec {
    /// Every host sends `bytes` to every other host: all at once, or in steps of `parallel`
    /// destinations.
    AllToAll {
        /// Bytes per pair.
        bytes: u64,
        /// `None`: every transfer at once. `Some(k)`: as the REPS artifact's all-to-all
        /// (`gen_serialn_alltoall.py`): hosts in a random order, and each host sends to `k`
        /// destinations at a time, shifted so that every host also receives from `k` sources per step,
        /// its next step once its own `k` transfers have arrived; every receive is posted at the
        /// start (one rail, no flow splitting).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parallel: Option<u32>,
    },
    /// A random permutation without fixed points: each host sends `bytes` to one host and receives
    /// from one.
    Permutation {
        /// Bytes per host.
        bytes: u64,
    },
    /// An all-reduce of a `bytes`-byte vector over all hosts.
    AllReduce {
        /// Vector size.
        bytes: u64,
        /// Algorithm.
        algorithm: AllReduceAlgo,
        /// Pipeline chunks per tree (double binary tree only).
        #[serde(default = "default_tree_chunks")]
        chunks: u32,
    },
    /// Hosts in groups of `group` (consecutive ids, paired across leaves when `cross_leaf`), each
    /// group running its own all-reduce at the same time (seed 003's "4 pairs").
    GroupAllReduce {
        /// Vector size.
        bytes: u64,
        /// Hosts per group.
        group: usize,
        /// Algorithm.
        algorithm: AllReduceAlgo,
    },
    /// Each host sends `bytes` to its successor on a random ring (PRO's ring traffic).
    RandomRing {
        /// Bytes per host.
        bytes: u64,
    },
    /// Each host sends `bytes` to its parent and children in a random double binary tree (PRO's tree
    /// traffic).
    RandomTree {
        /// Bytes per flow.
        bytes: u64,
    },
    /// MoE all-to-all between GPUs (`rails` GPUs per host, GPU i's home NIC is rail i).
    Moe {
        /// Bytes each GPU sends in total (before the distribution skews it).
        bytes: u64,
        /// How tokens are distributed.
        distribution: MoeDistribution,
    },
    /// Explicit flows (tests and small demonstrations).
    Flows {
        /// The flows.
        flows: Vec<FlowSpec>,
        /// Scale every flow's bytes by the swept size divided by this (0: sizes do not apply).
        #[serde(default)]
        bytes: u64,
    },
}

fn default_tree_chunks() -> u32 {
    8
}

/// All-reduce algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllReduceAlgo {
    /// Direct all-to-all reduce-scatter then all-to-all all-gather.
    AllToAll,
    /// Recursive halving (reduce-scatter) then recursive doubling (all-gather); needs a power of two.
    RecursiveDoubling,
    /// Ring reduce-scatter then ring all-gather.
    Ring,
    /// Two pipelined binary trees, each reducing and broadcasting half the vector.
    DoubleBinaryTree,
}

/// MoE token distributions (RailS Table I).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum MoeDistribution {
    /// Every GPU sends the same to every other GPU.
    Uniform,
    /// Top-k gating onto a subset of active experts (one expert per GPU): a fraction `sparsity` of the
    /// expert columns receive nothing, every token goes to `k` distinct active experts.
    Sparse {
        /// Experts per token.
        k: usize,
        /// Fraction of GPUs whose experts get no tokens.
        sparsity: f64,
        /// Where the idle experts are.
        #[serde(default)]
        placement: SparsePlacement,
        /// Bytes of one token's activation; 0: a fluid matrix (every sender splits its bytes evenly
        /// over the active experts of the other hosts) instead of per-token top-k draws.
        #[serde(default)]
        token_bytes: u64,
    },
    /// Sender-skewed: GPU volumes (token counts) follow Zipf(`s`) over a random ranking.
    SenderZipf {
        /// Zipf exponent.
        s: f64,
        /// Bytes of one token (per-token uniform top-`k` gating); 0: fluid.
        #[serde(default)]
        token_bytes: u64,
        /// Experts per token when `token_bytes` > 0.
        #[serde(default = "default_k")]
        k: usize,
    },
    /// Receiver-skewed: destination popularity follows Zipf(`s`) (incast onto hot experts).
    ReceiverZipf {
        /// Zipf exponent.
        s: f64,
        /// Bytes of one token (per-token top-`k` gating drawn by popularity); 0: fluid.
        #[serde(default)]
        token_bytes: u64,
        /// Experts per token when `token_bytes` > 0.
        #[serde(default = "default_k")]
        k: usize,
    },
}

fn default_k() -> usize {
    2
}

/// Where a sparse MoE workload's idle experts sit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SparsePlacement {
    /// Drawn at random among all GPUs (a host may keep all or none of its experts active).
    #[default]
    Random,
    /// Every host keeps `round((1 − sparsity) · rails)` active experts, at random positions: the
    /// sparsity is column-wise within each compute domain, so every domain receives the same bytes.
    PerHost,
}

/// One explicit flow.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSpec {
    /// Source host.
    pub src: usize,
    /// Destination host.
    pub dst: usize,
    /// Bytes.
    pub bytes: u64,
    /// Start, µs.
    #[serde(default)]
    pub start_us: f64,
}

/// How switches choose among equal-cost next hops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SwitchMode {
    /// The entropy is a path id (source routing, as PRO, Ethereal and HOST DR assume): at tier t the
    /// next hop is `(entropy / fanouts below t) mod fanout`.
    #[default]
    PathId,
    /// ECMP: hash of (source, destination, entropy) with a per-switch salt, as a switch hashes the
    /// 5-tuple (UDP source port = entropy).
    Hash,
    /// Per-packet uniform random next hop at every switch.
    Spray,
    /// Round robin per next-hop group, re-permuted every 5 wrap-arounds (000's SWITCH PKT).
    RoundRobin,
    /// Round robin per next-hop group in a fixed order, never re-permuted (000's SIMPLE RR model).
    SimpleRoundRobin,
    /// Shortest queue quantised into bins of 5%, 10%, 20% of the buffer, random among the lowest bin
    /// (000's SWITCH PKT AR, Spectrum-X-like).
    Adaptive,
    /// Destination rotation at switches: one pointer per (switch, destination leaf or pod, data/ack),
    /// random order and start (OFAN).
    Ofan,
    /// Flowlets: a flow (source, destination, entropy) keeps its next hop until it pauses for longer
    /// than `flowlet_gap_us`, then takes a random one (LetFlow-like).
    Flowlet,
}

/// Which rate controller the hosts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RateMode {
    /// The `PRISM_CC` variable decides (`none` or `mcc`).
    #[default]
    Lb,
    /// A per-packet ECN/delay AIMD window (the seed-003 baseline): halve at most once per RTT on a
    /// congested acknowledgement, +1 packet per window otherwise.
    PacketAimd,
    /// The MPRDMA-style window of the REPS artifact: a quarter packet off per congested
    /// acknowledgement, +1/cwnd per clean one, one packet off per loss.
    PacketMprdma,
}

/// One scheme to compare.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchemeSpec {
    /// Label in results.
    pub name: String,
    /// `PRISM_*` variables, exactly as users set them.
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
    /// Switch behaviour.
    #[serde(default)]
    pub switch: SwitchMode,
    /// Host rate control.
    #[serde(default)]
    pub rate: RateMode,
    /// Flowlet gap for `switch: flowlet`, µs.
    #[serde(default = "default_flowlet_gap")]
    pub flowlet_gap_us: f64,
    /// Initial window of `rate: packet_aimd`, packets (default: `proto.window_pkts`, i.e. line rate).
    #[serde(default)]
    pub aimd_init_pkts: Option<u32>,
    /// Bytes per posted send when a rate controller gates messages (MCC's 64 KB message chunks).
    #[serde(default = "default_msg_chunk")]
    pub msg_chunk: u64,
    /// GPU-to-GPU (MoE) workloads: every chunk lands on the destination GPU's own NIC, whichever local
    /// NIC the rail policy sent it from (crossing rails through the spines), instead of the same rail
    /// on the destination (rail-aligned). Models a multipath scheme that sprays over the sender's NICs
    /// but knows nothing of rails. `PRISM_RAIL=single` always delivers this way.
    #[serde(default)]
    pub deliver_to_gpu_nic: bool,
}

fn default_flowlet_gap() -> f64 {
    2.0
}
fn default_msg_chunk() -> u64 {
    64 << 10
}

/// Link failures and slow links.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailureSpec {
    /// Each switch-to-switch link fails (both directions, silently dropping) with this probability.
    #[serde(default)]
    pub random_link_prob: f64,
    /// Named links that change at a time.
    #[serde(default)]
    pub links: Vec<LinkChangeSpec>,
    /// Also run every scheme without the failures (a baseline row per scheme).
    #[serde(default)]
    pub with_baseline: bool,
}

/// One scheduled change of one link.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkChangeSpec {
    /// Link between two switches named `leaf3`, `spine0`, `edge5`, `agg2`, `core7`, or `host4`
    /// (e.g. `["leaf0", "spine3"]`). Both directions change.
    pub between: [String; 2],
    /// When, µs.
    #[serde(default)]
    pub at_us: f64,
    /// `down` (silent drop) or a rate factor in (0, 1] for a slow link.
    #[serde(default)]
    pub rate_factor: Option<f64>,
    /// Which occurrence when several parallel links join the pair (rails) — 0 by default.
    #[serde(default)]
    pub index: usize,
}

impl Scenario {
    /// Parse a scenario.
    pub fn from_json(text: &str) -> Result<Self, ScenarioError> {
        let s: Scenario = serde_json::from_str(text)?;
        s.validate()?;
        Ok(s)
    }

    /// The scaled-down CI version: `ci` merged over the scenario (objects one level deep; an object with a
    /// `kind` replaces the original whole).
    pub fn ci_variant(&self) -> Result<Self, ScenarioError> {
        let Some(ci) = &self.ci else {
            return Ok(self.clone());
        };
        let mut base = serde_json::to_value(self)?;
        if let (Some(b), Some(o)) = (base.as_object_mut(), ci.as_object()) {
            for (k, v) in o {
                match (b.get_mut(k), v) {
                    (Some(serde_json::Value::Object(bo)), serde_json::Value::Object(vo)) if !vo.contains_key("kind") => {
                        for (k2, v2) in vo {
                            bo.insert(k2.clone(), v2.clone());
                        }
                    }
                    _ => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
            b.insert("ci".into(), serde_json::Value::Null);
        }
        let s: Scenario = serde_json::from_value(base)?;
        s.validate()?;
        Ok(s)
    }

    /// Check values the types cannot.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        match self.topology {
            TopologySpec::LeafSpine { hosts, hosts_per_leaf, spines } => {
                if hosts < 2 || hosts_per_leaf == 0 || spines == 0 {
                    return Err(invalid("topology", "leaf_spine needs hosts >= 2, hosts_per_leaf >= 1, spines >= 1"));
                }
            }
            TopologySpec::Rails { hosts, rails, hosts_per_leaf, spines } => {
                if hosts < 2 || rails == 0 || rails > 64 || hosts_per_leaf == 0 || spines == 0 {
                    return Err(invalid("topology", "rails needs hosts >= 2, 1..=64 rails, hosts_per_leaf >= 1, spines >= 1"));
                }
            }
            TopologySpec::FatTree { k } => {
                if k < 2 || k % 2 != 0 || k > 64 {
                    return Err(invalid("topology.k", format!("{k}: must be even, 2..=64")));
                }
            }
        }
        if self.link.gbps.is_nan() || self.link.gbps <= 0.0 || self.link.latency_ns < 0.0 {
            return Err(invalid("link", "gbps must be > 0 and latency_ns >= 0"));
        }
        if self.link.buffer_bytes < (self.packet.payload + 200) as u64 {
            return Err(invalid("link.buffer_bytes", "must hold at least one full packet"));
        }
        // Prism's packets carry whole 128-byte lines (NCCL's LL128; `wire::LINE_BYTES`): the simulated
        // protocol would use a smaller payload than the wire-time model assumes.
        if !(128..=65_536).contains(&self.packet.payload) || !self.packet.payload.is_multiple_of(128) {
            return Err(invalid("packet.payload", "must be a multiple of 128 between 128 and 65536"));
        }
        if self.schemes.is_empty() {
            return Err(invalid("schemes", "list at least one scheme"));
        }
        for s in &self.schemes {
            prism_lb::LbConfig::from_vars(&s.vars).map_err(|source| ScenarioError::Lb { scheme: s.name.clone(), source })?;
        }
        if !(0.0..=1.0).contains(&self.failures.random_link_prob) {
            return Err(invalid("failures.random_link_prob", "must be in [0, 1]"));
        }
        if self.runs == 0 {
            return Err(invalid("runs", "must be at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"{ "name": "t",
        "topology": { "kind": "leaf_spine", "hosts": 4, "hosts_per_leaf": 2, "spines": 2 },
        "link": { "gbps": 100, "latency_ns": 500, "buffer_bytes": 100000 },
        "workload": { "kind": "permutation", "bytes": 1000 },
        "schemes": [ { "name": "a", "vars": { "PRISM_PATH": "pro" } } ] }"#;

    #[test]
    fn a_minimal_scenario_loads_with_defaults() {
        let s = Scenario::from_json(MINIMAL).unwrap();
        assert_eq!((s.seed, s.runs, s.packet.payload), (1, 1, 4096));
        assert_eq!(s.schemes[0].switch, SwitchMode::PathId);
    }

    #[test]
    fn a_payload_of_partial_lines_is_refused() {
        let with = |p: usize| MINIMAL.replace("\"schemes\"", &format!("\"packet\": {{ \"payload\": {p}, \"overhead\": 66 }}, \"schemes\""));
        let e = Scenario::from_json(&with(1000)).unwrap_err().to_string();
        assert!(e.contains("packet.payload") && e.contains("multiple of 128"), "{e}");
        assert_eq!(Scenario::from_json(&with(8832)).unwrap().packet.payload, 8832);
    }

    #[test]
    fn an_unknown_field_is_an_error_naming_it() {
        let e = Scenario::from_json(&MINIMAL.replace("\"runs\"", "\"x\"").replace("\"name\": \"t\",", "\"name\": \"t\", \"rnus\": 2,"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rnus"), "{e}");
    }

    #[test]
    fn a_bad_policy_name_is_refused_with_prism_lbs_message() {
        let e = Scenario::from_json(&MINIMAL.replace("\"pro\"", "\"zigzag\"")).unwrap_err().to_string();
        assert!(e.contains("scheme a") && e.contains("PRISM_PATH=zigzag"), "{e}");
    }

    #[test]
    fn the_ci_variant_merges_objects_one_level_deep() {
        let text =
            MINIMAL.replace("\"schemes\"", r#""ci": { "link": { "gbps": 10 }, "topology": { "kind": "fat_tree", "k": 4 } }, "schemes""#);
        let s = Scenario::from_json(&text).unwrap().ci_variant().unwrap();
        assert_eq!((s.link.gbps, s.link.buffer_bytes), (10.0, 100000));
        assert_eq!(s.topology.hosts(), 16);
        assert!(s.ci.is_none());
    }
}
