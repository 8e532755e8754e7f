//! Topology model: hosts, the rails (NICs) of each host, the leaf each NIC hangs from, the equal-cost
//! uplinks `s` of each leaf, the spines, and optionally which uplink each entropy takes.
//!
//! The topology comes from the JSON file named by `PRISM_TOPO`. This crate never opens files: the caller
//! reads the file and hands its text to [`Topology::from_json`]. Without a file, [`Topology::single_leaf`]
//! is the default: every host hangs every NIC from one leaf, so every flow is rack-local.

use serde::{Deserialize, Serialize};

/// Most rails (NICs per host) a topology may declare.
pub const MAX_RAILS: u16 = 64;
/// Most equal-cost uplinks a leaf may declare.
pub const MAX_UPLINKS: u16 = 1024;

/// A topology file that cannot be used; the message names the field and says what is accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopologyError {
    /// The text is not JSON of the expected shape (serde's message names the field and position).
    #[error("PRISM_TOPO: not a valid topology: {0}")]
    Parse(String),
    /// A field has a value that cannot be used.
    #[error("PRISM_TOPO: {field}: {reason}")]
    Invalid {
        /// JSON path of the field, e.g. `hosts[3].leaves`.
        field: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
}

/// One leaf (top-of-rack) switch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Leaf {
    /// Number of equal-cost uplinks (leaf → spine) of this leaf: Ethereal's `s`.
    pub uplinks: u16,
    /// The uplink each entropy takes when the fabric's hash (or source routing) is known; entry `e % len`
    /// is the uplink of entropy `e`. Without it, entropy `e` is taken to leave on uplink `e % uplinks`.
    pub entropy_uplink: Option<Vec<u16>>,
}

/// One host and the leaf of each of its NICs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Host {
    /// Optional name (hostname or address) so the caller can find a peer's index.
    pub name: Option<String>,
    /// `leaves[r]` is the leaf that NIC (rail) `r` hangs from.
    pub leaves: Vec<u32>,
}

/// The fabric as the load balancer sees it. Rails pair across hosts: NIC `r` of one host only ever talks to
/// NIC `r` of another (RailS's rail alignment), so a chunk's rail is both its local and its remote NIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    rails: u16,
    spines: u16,
    leaves: Vec<Leaf>,
    hosts: Vec<Host>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeafFile {
    uplinks: Option<u16>,
    entropy_uplink: Option<Vec<u16>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostFile {
    name: Option<String>,
    leaves: Vec<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TopologyFile {
    rails: Option<u16>,
    uplinks: Option<u16>,
    spines: Option<u16>,
    leaves: Option<Vec<LeafFile>>,
    #[serde(default)]
    hosts: Vec<HostFile>,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> TopologyError {
    TopologyError::Invalid { field: field.into(), reason: reason.into() }
}

impl Topology {
    /// The default when no topology file is given: `rails` NICs per host, every host on one leaf (per rail)
    /// with one uplink, so every flow is rack-local and the split layer leaves it whole.
    pub fn single_leaf(rails: u16) -> Self {
        Self { rails: rails.clamp(1, MAX_RAILS), spines: 1, leaves: vec![Leaf { uplinks: 1, entropy_uplink: None }], hosts: Vec::new() }
    }

    /// A two-tier leaf-spine: `hosts` hosts, `hosts_per_leaf` under each leaf (host `h` on leaf
    /// `h / hosts_per_leaf` for every rail), each leaf with `uplinks` uplinks to as many spines.
    pub fn leaf_spine(hosts: usize, hosts_per_leaf: usize, rails: u16, uplinks: u16) -> Result<Self, TopologyError> {
        if hosts_per_leaf == 0 {
            return Err(invalid("hosts_per_leaf", "must be at least 1"));
        }
        let n_leaves = hosts.div_ceil(hosts_per_leaf).max(1);
        let leaves = vec![Leaf { uplinks, entropy_uplink: None }; n_leaves];
        let hosts = (0..hosts).map(|h| Host { name: None, leaves: vec![(h / hosts_per_leaf) as u32; rails as usize] }).collect();
        Self::new(rails, uplinks, leaves, hosts)
    }

    /// Build and validate a topology from its parts. Leaf ids are indices into `leaves`.
    pub fn new(rails: u16, spines: u16, leaves: Vec<Leaf>, hosts: Vec<Host>) -> Result<Self, TopologyError> {
        let t = Self { rails, spines, leaves, hosts };
        t.validate()?;
        Ok(t)
    }

    /// Parse the contents of a `PRISM_TOPO` file. Every field is checked; an error names the field.
    ///
    /// ```json
    /// { "rails": 2, "uplinks": 4, "spines": 4,
    ///   "leaves": [ {"uplinks": 4}, {"uplinks": 4, "entropy_uplink": [0, 1, 2, 3]} ],
    ///   "hosts":  [ {"name": "a", "leaves": [0, 0]}, {"name": "b", "leaves": [1, 1]} ] }
    /// ```
    pub fn from_json(text: &str) -> Result<Self, TopologyError> {
        let f: TopologyFile = serde_json::from_str(text).map_err(|e| TopologyError::Parse(e.to_string()))?;
        let rails = f.rails.unwrap_or(1);
        let default_uplinks = f.uplinks.unwrap_or(1);
        if !(1..=MAX_UPLINKS).contains(&default_uplinks) {
            return Err(invalid("uplinks", format!("{default_uplinks}: must be between 1 and {MAX_UPLINKS}")));
        }
        let leaves: Vec<Leaf> = match f.leaves {
            Some(ls) => {
                ls.into_iter().map(|l| Leaf { uplinks: l.uplinks.unwrap_or(default_uplinks), entropy_uplink: l.entropy_uplink }).collect()
            }
            None => {
                // Without a leaf list, the leaves are the ids the hosts name, all with the default uplinks.
                let max_id = f.hosts.iter().flat_map(|h| h.leaves.iter().copied()).max().unwrap_or(0);
                if max_id >= 1 << 20 {
                    return Err(invalid("hosts[].leaves", format!("leaf id {max_id}: must be below {}", 1 << 20)));
                }
                vec![Leaf { uplinks: default_uplinks, entropy_uplink: None }; max_id as usize + 1]
            }
        };
        let spines = f.spines.unwrap_or_else(|| leaves.iter().map(|l| l.uplinks).max().unwrap_or(1));
        let hosts = f.hosts.into_iter().map(|h| Host { name: h.name, leaves: h.leaves }).collect();
        Self::new(rails, spines, leaves, hosts)
    }

    fn validate(&self) -> Result<(), TopologyError> {
        if !(1..=MAX_RAILS).contains(&self.rails) {
            return Err(invalid("rails", format!("{}: must be between 1 and {MAX_RAILS}", self.rails)));
        }
        if self.spines == 0 {
            return Err(invalid("spines", "0: must be at least 1"));
        }
        if self.leaves.is_empty() {
            return Err(invalid("leaves", "empty: at least one leaf is needed"));
        }
        for (i, l) in self.leaves.iter().enumerate() {
            if !(1..=MAX_UPLINKS).contains(&l.uplinks) {
                return Err(invalid(format!("leaves[{i}].uplinks"), format!("{}: must be between 1 and {MAX_UPLINKS}", l.uplinks)));
            }
            if let Some(map) = &l.entropy_uplink {
                if map.is_empty() {
                    return Err(invalid(format!("leaves[{i}].entropy_uplink"), "empty: omit it or list one uplink per entropy"));
                }
                if let Some((e, &u)) = map.iter().enumerate().find(|(_, &u)| u >= l.uplinks) {
                    return Err(invalid(
                        format!("leaves[{i}].entropy_uplink[{e}]"),
                        format!("{u}: must be below the leaf's uplinks ({})", l.uplinks),
                    ));
                }
            }
        }
        for (h, host) in self.hosts.iter().enumerate() {
            if host.leaves.len() != self.rails as usize {
                return Err(invalid(
                    format!("hosts[{h}].leaves"),
                    format!("has {} entries: must list one leaf per rail (rails = {})", host.leaves.len(), self.rails),
                ));
            }
            if let Some((r, &id)) = host.leaves.iter().enumerate().find(|(_, &id)| id as usize >= self.leaves.len()) {
                return Err(invalid(
                    format!("hosts[{h}].leaves[{r}]"),
                    format!("{id}: no such leaf (leaves are 0..{})", self.leaves.len()),
                ));
            }
        }
        Ok(())
    }

    /// Rails (NICs) per host.
    pub fn rails(&self) -> u16 {
        self.rails
    }

    /// Number of spines (informational; the uplinks of each leaf are what the policies use).
    pub fn spines(&self) -> u16 {
        self.spines
    }

    /// All leaves; a leaf's id is its index.
    pub fn leaves(&self) -> &[Leaf] {
        &self.leaves
    }

    /// All hosts; a host's id is its index. Empty means "hosts are not listed": then every host is on leaf 0.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// True when the topology lists its hosts (host ids are then checked against the list).
    pub fn lists_hosts(&self) -> bool {
        !self.hosts.is_empty()
    }

    /// Whether `host` is a valid host id here (any id is when hosts are not listed).
    pub fn knows_host(&self, host: usize) -> bool {
        self.hosts.is_empty() || host < self.hosts.len()
    }

    /// The index of the host with this name.
    pub fn host_by_name(&self, name: &str) -> Option<usize> {
        self.hosts.iter().position(|h| h.name.as_deref() == Some(name))
    }

    /// The leaf that NIC `rail` of `host` hangs from; `None` for an unknown host or rail.
    pub fn leaf_of(&self, host: usize, rail: u16) -> Option<u32> {
        if rail >= self.rails {
            return None;
        }
        if self.hosts.is_empty() {
            return Some(0);
        }
        self.hosts.get(host).map(|h| h.leaves[rail as usize])
    }

    /// The leaf with id `leaf` (ids come from [`Topology::leaf_of`], so they are in range).
    pub fn leaf(&self, leaf: u32) -> &Leaf {
        &self.leaves[(leaf as usize).min(self.leaves.len() - 1)]
    }

    /// True when `a` and `b` share the leaf of `rail`: their traffic on that rail never crosses a spine.
    pub fn rack_local(&self, a: usize, b: usize, rail: u16) -> bool {
        matches!((self.leaf_of(a, rail), self.leaf_of(b, rail)), (Some(x), Some(y)) if x == y)
    }

    /// The uplink of `leaf` that entropy `e` leaves on.
    pub fn uplink_of_entropy(&self, leaf: u32, e: u16) -> u16 {
        let l = self.leaf(leaf);
        match &l.entropy_uplink {
            Some(map) => map[e as usize % map.len()],
            None => e % l.uplinks,
        }
    }

    /// The entropies in `0..n_paths` that leave `leaf` on `uplink`, in increasing order (may be empty when
    /// there are fewer entropies than uplinks).
    pub fn uplink_entropies(&self, leaf: u32, uplink: u16, n_paths: u16) -> Vec<u16> {
        (0..n_paths).filter(|&e| self.uplink_of_entropy(leaf, e) == uplink).collect()
    }
}

impl Default for Topology {
    fn default() -> Self {
        Self::single_leaf(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_parses_and_answers_leaf_questions() {
        let t = Topology::from_json(
            r#"{ "rails": 2, "uplinks": 4, "spines": 4,
                 "leaves": [ {"uplinks": 4}, {"uplinks": 2, "entropy_uplink": [1, 0]} ],
                 "hosts": [ {"name": "a", "leaves": [0, 0]}, {"name": "b", "leaves": [1, 0]} ] }"#,
        )
        .unwrap();
        assert_eq!(t.rails(), 2);
        assert_eq!(t.host_by_name("b"), Some(1));
        assert_eq!(t.leaf_of(1, 0), Some(1));
        assert!(!t.rack_local(0, 1, 0));
        assert!(t.rack_local(0, 1, 1));
        assert_eq!(t.uplink_of_entropy(1, 0), 1);
        assert_eq!(t.uplink_of_entropy(1, 3), 0);
        assert_eq!(t.uplink_entropies(0, 1, 10), vec![1, 5, 9]);
    }

    #[test]
    fn missing_leaf_list_is_derived_from_the_hosts() {
        let t = Topology::from_json(r#"{ "uplinks": 8, "hosts": [ {"leaves": [0]}, {"leaves": [3]} ] }"#).unwrap();
        assert_eq!(t.leaves().len(), 4);
        assert_eq!(t.leaf(3).uplinks, 8);
        assert_eq!(t.spines(), 8);
    }

    #[test]
    fn a_host_with_the_wrong_number_of_leaves_names_the_field() {
        let err = Topology::from_json(r#"{ "rails": 2, "hosts": [ {"leaves": [0, 0]}, {"leaves": [0]} ] }"#).unwrap_err();
        assert!(err.to_string().contains("hosts[1].leaves"), "{err}");
    }

    #[test]
    fn an_entropy_map_entry_beyond_the_uplinks_names_the_field() {
        let err = Topology::from_json(r#"{ "leaves": [ {"uplinks": 2, "entropy_uplink": [0, 2]} ] }"#).unwrap_err();
        assert!(err.to_string().contains("leaves[0].entropy_uplink[1]"), "{err}");
    }

    #[test]
    fn an_unknown_leaf_id_names_the_field() {
        let err = Topology::from_json(r#"{ "leaves": [ {"uplinks": 2} ], "hosts": [ {"leaves": [5]} ] }"#).unwrap_err();
        assert!(err.to_string().contains("hosts[0].leaves[0]"), "{err}");
    }

    #[test]
    fn an_unknown_field_is_an_error_naming_it() {
        let err = Topology::from_json(r#"{ "railz": 2 }"#).unwrap_err();
        assert!(err.to_string().contains("railz"), "{err}");
    }

    #[test]
    fn zero_rails_and_zero_uplinks_are_rejected() {
        assert!(Topology::from_json(r#"{ "rails": 0 }"#).unwrap_err().to_string().contains("rails"));
        assert!(Topology::from_json(r#"{ "uplinks": 0 }"#).unwrap_err().to_string().contains("uplinks"));
    }

    #[test]
    fn the_default_puts_every_host_on_one_leaf() {
        let t = Topology::single_leaf(4);
        assert!(t.rack_local(17, 923, 3));
        assert!(t.knows_host(10_000));
        assert_eq!(t.leaf_of(5, 4), None);
    }
}
