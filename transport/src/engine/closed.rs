//! What the engine keeps of closed comms for `PRISM_STATS`: bounded, however many comms a long job
//! opens and closes.
//!
//! - `closed_summary`: one entry per (rail, peer, role) with every closed comm folded in (counts of
//!   comms, bytes, packets, retransmissions, timeouts, drops by reason, RTT min/avg/max, path state
//!   changes...). At most [`MAX_GROUPS`] entries; comms of further peers are folded into one entry per role
//!   with rail and peer "other".
//! - `comms`: the full statistics of the first [`LIST_FIRST`] and the last [`LIST_LAST`] closed comms,
//!   each with at most [`MAX_PATHS_LISTED`] paths (those with the most trouble first, then the busiest;
//!   `path_summary` always covers every path; on verbs, at most as many QPs in all). Kept as compact
//!   JSON text (a few KB each, at most some tens of KB).
//!
//! The stats file therefore holds at most 64 comms of at most 64 paths and 256 summaries, a few MB at
//! worst whatever the job does; a job with at most 64 comms sees every one of them (each with at most 64
//! paths listed).

use std::collections::{BTreeMap, VecDeque};

use serde_json::{json, Map, Value};

use crate::proto::{ConnStats, PathHealth, PathStats};

/// Closed comms listed in full from the start of the engine's life...
pub const LIST_FIRST: usize = 32;
/// ...and from its end (the most recent).
pub const LIST_LAST: usize = 32;
/// Paths listed per comm (its `path_summary` covers all of them).
pub const MAX_PATHS_LISTED: usize = 64;
/// (rail, peer, role) summaries; further peers go to peer "other".
pub const MAX_GROUPS: usize = 256;

/// Totals over a set of paths.
#[derive(Debug, Default, Clone)]
struct PathSum {
    paths: u64,
    not_alive_at_close: u64,
    state_changes: u64,
    probes_sent: u64,
    pkts_sent: u64,
    bytes_sent: u64,
    retransmissions: u64,
    timeouts: u64,
    rtt_samples: u64,
    rtt_sum_us: u64,
    rtt_min_us: u64,
    rtt_max_us: u64,
}

impl PathSum {
    fn add_path(&mut self, p: &PathStats) {
        self.paths += 1;
        self.not_alive_at_close += u64::from(p.state != PathHealth::Alive);
        self.state_changes += p.state_changes;
        self.probes_sent += p.probes_sent;
        self.pkts_sent += p.pkts_sent;
        self.bytes_sent += p.bytes_sent;
        self.retransmissions += p.retransmissions;
        self.timeouts += p.timeouts;
        if p.rtt_samples > 0 {
            self.rtt_min_us = if self.rtt_samples == 0 { p.rtt_min_us } else { self.rtt_min_us.min(p.rtt_min_us) };
            self.rtt_max_us = self.rtt_max_us.max(p.rtt_max_us);
            self.rtt_samples += p.rtt_samples;
            self.rtt_sum_us = self.rtt_sum_us.saturating_add(p.rtt_sum_us);
        }
    }

    fn add(&mut self, o: &PathSum) {
        if o.rtt_samples > 0 {
            self.rtt_min_us = if self.rtt_samples == 0 { o.rtt_min_us } else { self.rtt_min_us.min(o.rtt_min_us) };
            self.rtt_max_us = self.rtt_max_us.max(o.rtt_max_us);
        }
        self.paths += o.paths;
        self.not_alive_at_close += o.not_alive_at_close;
        self.state_changes += o.state_changes;
        self.probes_sent += o.probes_sent;
        self.pkts_sent += o.pkts_sent;
        self.bytes_sent += o.bytes_sent;
        self.retransmissions += o.retransmissions;
        self.timeouts += o.timeouts;
        self.rtt_samples += o.rtt_samples;
        self.rtt_sum_us = self.rtt_sum_us.saturating_add(o.rtt_sum_us);
    }

    fn to_json(&self) -> Value {
        json!({
            "paths": self.paths,
            "not_alive_at_close": self.not_alive_at_close,
            "state_changes": self.state_changes,
            "probes_sent": self.probes_sent,
            "pkts_sent": self.pkts_sent,
            "bytes_sent": self.bytes_sent,
            "retransmissions": self.retransmissions,
            "timeouts": self.timeouts,
            "rtt_samples": self.rtt_samples,
            "rtt_min_us": self.rtt_min_us,
            "rtt_avg_us": self.rtt_sum_us.checked_div(self.rtt_samples).unwrap_or(0),
            "rtt_max_us": self.rtt_max_us,
        })
    }
}

/// Adds every number of `v` into `acc` at the same place (objects recursively; arrays element-wise),
/// skipping `skip` keys. Counters only: callers leave settings out.
fn add_numbers(acc: &mut Value, v: &Value, skip: &[&str]) {
    match (acc, v) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, x) in b {
                if skip.contains(&k.as_str()) {
                    continue;
                }
                match a.get_mut(k) {
                    Some(slot) => add_numbers(slot, x, skip),
                    None => {
                        let mut slot = zero_like(x, skip);
                        add_numbers(&mut slot, x, skip);
                        a.insert(k.clone(), slot);
                    }
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            if a.len() < b.len() {
                a.extend(b[a.len()..].iter().map(|x| zero_like(x, skip)));
            }
            for (slot, x) in a.iter_mut().zip(b) {
                add_numbers(slot, x, skip);
            }
        }
        (a @ Value::Number(_), Value::Number(b)) => {
            if let (Some(x), Some(y)) = (a.as_u64(), b.as_u64()) {
                *a = Value::from(x.saturating_add(y));
            }
        }
        _ => {}
    }
}

/// The shape of `v` with every number 0 (strings and the like dropped).
fn zero_like(v: &Value, skip: &[&str]) -> Value {
    match v {
        Value::Object(m) => {
            Value::Object(m.iter().filter(|(k, _)| !skip.contains(&k.as_str())).map(|(k, x)| (k.clone(), zero_like(x, skip))).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| zero_like(x, skip)).collect()),
        Value::Number(_) => Value::from(0u64),
        _ => Value::Null,
    }
}

/// One (rail, peer, role) summary.
#[derive(Debug, Default)]
struct Group {
    comms: u64,
    /// planned_bytes_per_rail and _per_uplink, sends_planned, planned_subflows, start_gates,
    /// wrong_peer_dropped, control_steered, conn counters, verbs counters.
    sums: Value,
    paths: PathSum,
}

/// Connection fields that are settings or state, not counters.
const NOT_COUNTERS: &[&str] = &["paths", "reorder_threshold"];

/// Statistics of the comms closed so far, bounded.
#[derive(Debug, Default)]
pub(crate) struct ClosedComms {
    closed: u64,
    first: Vec<Box<str>>,
    last: VecDeque<Box<str>>,
    groups: BTreeMap<(String, String, String), Group>,
}

impl ClosedComms {
    /// Folds one closed comm in: `v` is its statistics without `conn`, `conn` its connection's.
    pub fn record(&mut self, mut v: Value, conn: &ConnStats) {
        self.closed += 1;
        let mut all = PathSum::default();
        for p in &conn.paths {
            all.add_path(p);
        }
        self.fold(&v, conn, &all);

        // The listed form: every counter, at most MAX_PATHS_LISTED paths, the summary of all paths.
        let mut c = serde_json::to_value(ConnNoPaths(conn)).unwrap_or(Value::Null);
        if let Value::Object(m) = &mut c {
            let listed = listed_paths(&conn.paths);
            if listed.len() < conn.paths.len() {
                m.insert(
                    "paths_listed".into(),
                    json!(format!(
                        "{} of {}: those not alive or with the most timeouts, retransmissions and state changes, then the busiest",
                        listed.len(),
                        conn.paths.len()
                    )),
                );
            }
            m.insert("paths".into(), serde_json::to_value(listed).unwrap_or(Value::Null));
            m.insert("path_summary".into(), all.to_json());
        }
        if let Value::Object(m) = &mut v {
            m.insert("conn".into(), c);
        }
        // Verbs: one QP per path per rail; the first few of each rail are listed, MAX_PATHS_LISTED
        // in all (at least 4 per rail).
        if let Some(rails) = v.pointer_mut("/verbs/rails").and_then(Value::as_array_mut) {
            let per_rail = (MAX_PATHS_LISTED / rails.len().max(1)).max(4);
            for r in rails {
                if let Some(qps) = r.get_mut("qps").and_then(Value::as_array_mut) {
                    if qps.len() > per_rail {
                        let n = qps.len();
                        qps.truncate(per_rail);
                        r["qps_listed"] = json!(format!("the first {per_rail} of {n}"));
                    }
                }
            }
        }
        let text: Box<str> = v.to_string().into();
        if self.first.len() < LIST_FIRST {
            self.first.push(text);
        } else {
            if self.last.len() >= LIST_LAST {
                self.last.pop_front();
            }
            self.last.push_back(text);
        }
    }

    fn fold(&mut self, v: &Value, conn: &ConnStats, paths: &PathSum) {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
        let mut key = (s("rail"), s("peer"), s("role"));
        if !self.groups.contains_key(&key) && self.groups.len() >= MAX_GROUPS - 2 {
            // Room is kept for the two ("other", "other", role) groups.
            key = ("other".into(), "other".into(), key.2);
        }
        let g = self.groups.entry(key).or_default();
        g.comms += 1;
        g.paths.add(paths);
        let mut counters = Map::new();
        for k in [
            "planned_bytes_per_rail",
            "planned_bytes_per_uplink",
            "sends_planned",
            "planned_subflows",
            "start_gates",
            "wrong_peer_dropped",
            "control_steered",
            "control_other_rail",
        ] {
            if let Some(x) = v.get(k) {
                counters.insert(k.into(), x.clone());
            }
        }
        counters.insert("conn".into(), serde_json::to_value(ConnNoPaths(conn)).unwrap_or(Value::Null));
        if let Some(vc) = v.get("verbs").and_then(|x| x.get("counters")) {
            counters.insert("verbs".into(), vc.clone());
        }
        if g.sums.is_null() {
            g.sums = Value::Object(Map::new());
        }
        add_numbers(&mut g.sums, &Value::Object(counters), NOT_COUNTERS);
    }

    /// The JSON fields for `stats_json`: `comms_closed`, `comms`, `comms_listed`, `closed_summary`.
    pub fn to_json(&self) -> Map<String, Value> {
        let listed: Vec<Value> =
            self.first.iter().chain(self.last.iter()).map(|t| serde_json::from_str(t).unwrap_or(Value::Null)).collect();
        let summary: Vec<Value> = self
            .groups
            .iter()
            .map(|((rail, peer, role), g)| {
                let mut m = Map::new();
                m.insert("rail".into(), json!(rail));
                m.insert("peer".into(), json!(peer));
                m.insert("role".into(), json!(role));
                m.insert("comms".into(), json!(g.comms));
                if let Value::Object(s) = &g.sums {
                    m.extend(s.clone());
                }
                m.insert("paths".into(), g.paths.to_json());
                Value::Object(m)
            })
            .collect();
        let mut out = Map::new();
        out.insert("comms_closed".into(), json!(self.closed));
        out.insert(
            "comms_listed".into(),
            json!({
                "first": LIST_FIRST, "last": LIST_LAST, "max_paths_per_comm": MAX_PATHS_LISTED,
                "listed": listed.len(), "omitted": self.closed - listed.len() as u64,
                "note": "`comms` lists the first and the last closed comms in full (at most this many paths each; \
                         `path_summary` covers all); `closed_summary` folds every closed comm, listed or not, per rail, peer and role",
            }),
        );
        out.insert("comms".into(), Value::Array(listed));
        out.insert("closed_summary_max".into(), json!(MAX_GROUPS));
        out.insert("closed_summary".into(), Value::Array(summary));
        out
    }
}

/// A connection's counters without its per-path array.
struct ConnNoPaths<'a>(&'a ConnStats);

impl serde::Serialize for ConnNoPaths<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut v = serde_json::to_value(ConnStats { paths: Vec::new(), ..self.0.clone() }).map_err(serde::ser::Error::custom)?;
        if let Value::Object(m) = &mut v {
            m.remove("paths");
        }
        v.serialize(s)
    }
}

/// At most MAX_PATHS_LISTED paths: all of them if they fit, else those with the most trouble, then
/// the busiest, in entropy order.
fn listed_paths(paths: &[PathStats]) -> Vec<&PathStats> {
    if paths.len() <= MAX_PATHS_LISTED {
        return paths.iter().collect();
    }
    let mut v: Vec<&PathStats> = paths.iter().collect();
    v.sort_by_key(|p| std::cmp::Reverse((p.state != PathHealth::Alive, p.timeouts, p.retransmissions, p.state_changes, p.pkts_sent)));
    v.truncate(MAX_PATHS_LISTED);
    v.sort_by_key(|p| p.entropy);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(npaths: u16, timeouts_on: u16) -> ConnStats {
        let mut c = ConnStats { data_pkts_sent: 10, data_bytes_sent: 1000, timeouts: 1, ..Default::default() };
        c.dropped.bad_token = 2;
        c.paths = (0..npaths)
            .map(|e| {
                let mut p = PathStats { entropy: e, pkts_sent: 1, ..Default::default() };
                if e == timeouts_on {
                    p.timeouts = 3;
                    p.state = PathHealth::Dead;
                    p.state_changes = 2;
                }
                p.record_rtt(10 + e as u64);
                p
            })
            .collect();
        c
    }

    fn comm(peer: &str) -> Value {
        json!({ "role": "send", "rail": "r0", "peer": peer, "planned_bytes_per_rail": [5, 7], "wrong_peer_dropped": 1, "control_steered": 0 })
    }

    #[test]
    fn every_closed_comm_is_summed_and_only_the_first_and_last_are_listed() {
        let mut c = ClosedComms::default();
        for i in 0..1000u64 {
            let mut v = comm("10.0.0.1:5000");
            v["n"] = json!(i);
            c.record(v, &conn(16, 3));
        }
        let j = c.to_json();
        assert_eq!(j["comms_closed"], 1000);
        let listed = j["comms"].as_array().unwrap();
        assert_eq!(listed.len(), LIST_FIRST + LIST_LAST);
        assert_eq!(listed[0]["n"], 0);
        assert_eq!(listed[LIST_FIRST - 1]["n"], LIST_FIRST as u64 - 1);
        assert_eq!(listed[LIST_FIRST]["n"], 1000 - LIST_LAST as u64);
        assert_eq!(listed.last().unwrap()["n"], 999);
        assert_eq!(listed[0]["conn"]["paths"].as_array().unwrap().len(), 16, "16 paths fit: all listed");
        assert_eq!(j["comms_listed"]["omitted"], 1000 - 64);
        let s = j["closed_summary"].as_array().unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0]["comms"], 1000);
        assert_eq!(s[0]["conn"]["data_pkts_sent"], 10_000);
        assert_eq!(s[0]["conn"]["dropped"]["bad_token"], 2000);
        assert_eq!(s[0]["planned_bytes_per_rail"], json!([5000, 7000]));
        assert_eq!(s[0]["wrong_peer_dropped"], 1000);
        assert_eq!(s[0]["paths"]["paths"], 16_000);
        assert_eq!(s[0]["paths"]["not_alive_at_close"], 1000);
        assert_eq!(s[0]["paths"]["state_changes"], 2000);
        assert_eq!(s[0]["paths"]["rtt_min_us"], 10);
        assert_eq!(s[0]["paths"]["rtt_max_us"], 25);
        assert!(s[0]["conn"].get("reorder_threshold").is_none(), "a setting, not a counter");
    }

    #[test]
    fn a_comm_with_many_paths_lists_the_troubled_ones_and_summarises_all() {
        let mut c = ClosedComms::default();
        c.record(comm("p"), &conn(1024, 700));
        let j = c.to_json();
        let cm = &j["comms"][0]["conn"];
        let paths = cm["paths"].as_array().unwrap();
        assert_eq!(paths.len(), MAX_PATHS_LISTED);
        assert!(paths.iter().any(|p| p["entropy"] == 700), "the dead path is listed");
        assert!(paths.windows(2).all(|w| w[0]["entropy"].as_u64() < w[1]["entropy"].as_u64()), "in entropy order");
        assert_eq!(cm["path_summary"]["paths"], 1024);
        assert_eq!(cm["path_summary"]["timeouts"], 3);
        assert!(cm["paths_listed"].as_str().unwrap().starts_with("64 of 1024"));
    }

    #[test]
    fn verbs_qps_are_listed_within_the_same_bound() {
        let mut c = ClosedComms::default();
        let mut v = comm("p");
        let qps: Vec<Value> = (0..1024).map(|i| json!({ "qpn": i })).collect();
        v["verbs"] = json!({ "counters": { "fences": 2 }, "rails": [{ "qps": qps.clone() }, { "qps": qps }] });
        c.record(v, &conn(4, 9));
        let j = c.to_json();
        let rails = j["comms"][0]["verbs"]["rails"].as_array().unwrap();
        assert!(rails.iter().all(|r| r["qps"].as_array().unwrap().len() == MAX_PATHS_LISTED / 2));
        assert_eq!(j["closed_summary"][0]["verbs"]["fences"], 2, "verbs counters are summed");
    }

    #[test]
    fn peers_beyond_the_bound_are_folded_into_other() {
        let mut c = ClosedComms::default();
        for i in 0..1000 {
            c.record(comm(&format!("10.0.{}.{}:1", i / 256, i % 256)), &conn(2, 9));
        }
        let j = c.to_json();
        let s = j["closed_summary"].as_array().unwrap();
        assert!(s.len() <= MAX_GROUPS, "{} summaries", s.len());
        assert_eq!(s.iter().map(|g| g["comms"].as_u64().unwrap()).sum::<u64>(), 1000);
        assert!(s.iter().any(|g| g["peer"] == "other"));
        // Bounded text whatever the number of comms.
        assert!(serde_json::to_string(&j).unwrap().len() < 2 << 20);
    }
}
