//! Ethereal in the engine, over loopback: sends posted within `PRISM_ETHEREAL_BATCH_US` on any comm
//! are planned as one batch (Algorithm 1 over all of them), sends further apart are not, and no send
//! waits longer than the window. Host "a" is on leaf 0 and host "b" on leaf 1 of a topology whose
//! leaves have 4 uplinks; both are this process (two `Net`s on `lo`).
//!
//! Wall-clock tests: the window is 200 ms so that sends posted back to back are surely within it; the
//! only timing asserted is that a batched send is not planned before its window is over (the engine
//! plans no batch before its deadline) and that it completes well within seconds.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{pair_between, SharedRecv, VecSend};
use prism_transport::engine::{Net, RecvComm, SendComm, TransportConfig};
use serde_json::Value;

const WINDOW_MS: u64 = 200;
const MIB: usize = 1 << 20;

/// A topology file for this test (removed on drop).
struct Topo(std::path::PathBuf);

impl Topo {
    fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("prism-ethereal-{tag}-{}.json", std::process::id()));
        let text = r#"{"rails": 1, "uplinks": 4, "hosts": [{"name": "a", "leaves": [0]}, {"name": "b", "leaves": [1]}]}"#;
        std::fs::write(&path, text).unwrap();
        Topo(path)
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn net(topo: &Topo, host: &str, lb: &[(&str, &str)]) -> Net {
    let path = topo.0.to_str().unwrap();
    let vars: BTreeMap<String, String> = [("PRISM_IFNAMES", "lo"), ("PRISM_SEED", "42"), ("PRISM_PATHS", "8"), ("PRISM_HOST", host)]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lbv: BTreeMap<String, String> =
        [("PRISM_TOPO", path), ("PRISM_CHUNK", "65536")].iter().chain(lb).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Net::new(TransportConfig::from_vars(&vars).unwrap(), prism_lb::LbConfig::from_vars(&lbv).unwrap()).unwrap()
}

/// Post one `MIB` send on each comm (and its receive), back to back; drive all until done. Returns
/// each send's completion time, counted from just before the first send was posted.
fn send_one_each(pairs: &mut [(SendComm, RecvComm)]) -> Vec<Duration> {
    let mut reqs = Vec::new();
    for (_, r) in pairs.iter_mut() {
        let rr = r.irecv(vec![(Box::new(SharedRecv::filled(MIB, 0)), 1)]).unwrap().unwrap();
        reqs.push((None, Some(rr), None));
    }
    let first = Instant::now();
    for ((s, _), q) in pairs.iter_mut().zip(reqs.iter_mut()) {
        q.0 = Some(s.isend(Box::new(VecSend::new(vec![7u8; MIB])), 1).unwrap().unwrap());
    }
    let t0 = Instant::now();
    while reqs.iter().any(|q| q.0.is_some() || q.1.is_some()) {
        for ((s, r), q) in pairs.iter_mut().zip(reqs.iter_mut()) {
            if let Some(id) = q.0 {
                if s.test(id).unwrap().is_some() {
                    q.0 = None;
                    q.2 = Some(first.elapsed());
                }
            }
            if let Some(id) = q.1 {
                if r.test(id).unwrap().is_some() {
                    q.1 = None;
                }
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the sends did not finish");
    }
    reqs.into_iter().map(|q| q.2.unwrap()).collect()
}

/// The listed statistics of the closed send comms.
fn send_stats(net: &Net) -> Vec<Value> {
    net.stats_json()["comms"].as_array().unwrap().iter().filter(|c| c["role"] == "send").cloned().collect()
}

fn sum(stats: &[Value], key: &str) -> u64 {
    stats.iter().map(|c| c[key].as_u64().unwrap()).sum()
}

/// Bytes per uplink of rail 0 over the comms.
fn per_uplink(stats: &[Value]) -> Vec<u64> {
    let mut v = vec![0u64; 4];
    for c in stats {
        for (u, b) in c["planned_bytes_per_uplink"][0].as_array().unwrap().iter().enumerate() {
            v[u] += b.as_u64().unwrap();
        }
    }
    v
}

/// Five comms from a to b, one 1 MiB send each, posted back to back.
fn five_flows(lb: &[(&str, &str)], tag: &str) -> (Vec<Value>, Vec<Duration>) {
    let topo = Topo::new(tag);
    let (a, b) = (net(&topo, "a", lb), net(&topo, "b", lb));
    let mut pairs: Vec<(SendComm, RecvComm)> = (0..5).map(|_| pair_between(&a, &b)).collect();
    let times = send_one_each(&mut pairs);
    drop(pairs);
    (send_stats(&a), times)
}

#[test]
fn five_flows_posted_within_the_window_on_five_comms_are_planned_as_one_batch() {
    let window = WINDOW_MS * 1000;
    let (stats, times) = five_flows(&[("PRISM_SPLIT", "ethereal"), ("PRISM_ETHEREAL_BATCH_US", &window.to_string())], "batch");
    assert_eq!(stats.len(), 5);
    assert_eq!(sum(&stats, "sends_planned"), 5);
    // Algorithm 1 over the batch (n = 5 flows to leaf 1, s = 4): four whole flows, one per uplink, and
    // the fifth in four quarters: 8 sub-flows, every uplink 5/4 MiB (Theorem 1).
    assert_eq!(sum(&stats, "planned_subflows"), 8, "{stats:#?}");
    assert_eq!(per_uplink(&stats), vec![5 * MIB as u64 / 4; 4]);
    assert_eq!(stats.iter().map(|c| c["start_gates"]["held_sends"].as_u64().unwrap()).sum::<u64>(), 5);
    // No send was planned (so none completed) before the window of the first one was over, and none
    // took long after it.
    for t in &times {
        assert!(*t >= Duration::from_millis(WINDOW_MS), "{times:?}");
        assert!(*t < Duration::from_secs(10), "{times:?}");
    }
}

#[test]
fn without_a_window_each_flow_is_planned_alone_at_once() {
    let (stats, _) = five_flows(&[("PRISM_SPLIT", "ethereal")], "alone");
    assert_eq!(sum(&stats, "sends_planned"), 5);
    // Each flow on its own: n = 1, split into four quarters, one per uplink.
    assert_eq!(sum(&stats, "planned_subflows"), 20);
    assert_eq!(per_uplink(&stats), vec![5 * MIB as u64 / 4; 4]);
}

#[test]
fn sends_further_apart_than_the_window_are_planned_apart_and_wait_at_most_the_window() {
    let window = WINDOW_MS * 1000;
    let lb = [("PRISM_SPLIT", "ethereal"), ("PRISM_ETHEREAL_BATCH_US", &window.to_string())];
    let topo = Topo::new("apart");
    let (a, b) = (net(&topo, "a", &lb), net(&topo, "b", &lb));
    let mut pairs: Vec<(SendComm, RecvComm)> = (0..2).map(|_| pair_between(&a, &b)).collect();
    // One send on the first comm, and only once it is done (after its window) one on the second.
    let mut times = send_one_each(&mut pairs[..1]);
    times.extend(send_one_each(&mut pairs[1..]));
    drop(pairs);
    let stats = send_stats(&a);
    assert_eq!(sum(&stats, "sends_planned"), 2);
    assert_eq!(sum(&stats, "planned_subflows"), 8, "two batches of one flow, each in four quarters");
    for t in &times {
        assert!(*t < Duration::from_secs(10), "{times:?}");
    }
}

#[test]
fn other_policies_are_planned_at_once_and_never_held() {
    // The window applies to Ethereal only: spraying without a split plans each send alone.
    let (stats, times) = five_flows(&[("PRISM_ETHEREAL_BATCH_US", "1000000")], "spray");
    assert_eq!(sum(&stats, "sends_planned"), 5);
    assert_eq!(sum(&stats, "planned_subflows"), 5);
    assert!(per_uplink(&stats).iter().all(|&b| b == 0));
    assert!(stats.iter().all(|c| c["start_gates"]["held_sends"] == 0 && c["start_gates"]["waited_pkts"] == 0), "{stats:#?}");
    // A one-second window would show as a one-second wait.
    assert!(times.iter().all(|t| *t < Duration::from_millis(900)), "{times:?}");
}
