//! The simulator's own model, checked against arithmetic: one flow alone, a 2:1 incast, ECMP with one
//! entropy, and a failed link. Each test states its seed; runs are deterministic.

use prism_sim::{Scenario, Sim};

const SEED: u64 = 7;

fn scenario(topology: &str, flows: &str, switch: &str, path: &str, extra: &str) -> Scenario {
    let text = format!(
        r#"{{
        "name": "model", "seed": {SEED},
        "topology": {topology},
        "link": {{ "gbps": 100, "latency_ns": 500, "buffer_bytes": 16000000 }},
        "packet": {{ "payload": 4096, "overhead": 66 }},
        "proto": {{ "window_pkts": 1024 {extra} }},
        "workload": {{ "kind": "flows", "flows": {flows} }},
        "schemes": [ {{ "name": "s", "switch": "{switch}", "vars": {{ "PRISM_PATH": "{path}" }} }} ],
        "sample_us": 0
    }}"#
    );
    Scenario::from_json(&text).unwrap_or_else(|e| panic!("seed {SEED}: {e}"))
}

/// Serialisation time of `bytes` at 100 Gbit/s, µs.
fn ser_us(bytes: f64) -> f64 {
    bytes * 8.0 / 100e3
}

#[test]
fn a_single_flow_on_an_idle_path_finishes_at_size_over_rate_plus_latency() {
    let sc = scenario(
        r#"{ "kind": "leaf_spine", "hosts": 4, "hosts_per_leaf": 2, "spines": 2 }"#,
        r#"[ { "src": 0, "dst": 2, "bytes": 4194304 } ]"#,
        "path_id",
        "spray",
        "",
    );
    let mut sim = Sim::new(&sc, &sc.schemes[0], None, false, SEED).unwrap();
    let r = sim.run(0, false);
    assert!(r.completed, "seed {SEED}");
    // 1024 packets of 4096 payload + 64 Prism header + 66 link overhead, 4 links of 0.5 µs, three
    // store-and-forward hops of one full packet, and the CTS's one-way trip before the first byte.
    let pkt = 4096.0 + 64.0 + 66.0;
    let cts = 32.0 + 12.0 + 66.0;
    let expect = 1024.0 * ser_us(pkt) + 3.0 * ser_us(pkt) + 4.0 * 0.5 + (4.0 * ser_us(cts) + 4.0 * 0.5);
    assert!((r.cct_us - expect).abs() < 0.01, "seed {SEED}: CCT {} µs, arithmetic says {expect} µs", r.cct_us);
    assert_eq!(r.proto.retransmissions, 0);
}

#[test]
fn a_two_to_one_incast_builds_the_queue_the_arithmetic_predicts() {
    let bytes = 2u64 << 20;
    let sc = scenario(
        r#"{ "kind": "leaf_spine", "hosts": 3, "hosts_per_leaf": 3, "spines": 1 }"#,
        &format!(r#"[ {{ "src": 0, "dst": 2, "bytes": {bytes} }}, {{ "src": 1, "dst": 2, "bytes": {bytes} }} ]"#),
        "path_id",
        "spray",
        "",
    );
    let mut sim = Sim::new(&sc, &sc.schemes[0], None, false, SEED).unwrap();
    let r = sim.run(0, false);
    assert!(r.completed, "seed {SEED}");
    // Two line-rate senders into one line-rate port: while both send (one flow's duration), the port
    // gains one flow's worth of wire bytes; it peaks at one flow minus what is on the wire.
    let wire = (bytes / 4096) as f64 * (4096.0 + 64.0 + 66.0);
    let port = sim.fabric().ports.iter().find(|p| p.to == 2 && p.from != 2).expect("leaf to host 2");
    let q = port.stats.max_queue as f64;
    assert!((q - wire).abs() / wire < 0.01, "seed {SEED}: max queue {q} B, arithmetic says {wire} B");
    // And the incast takes twice one flow's serialisation.
    assert!((r.cct_us - 2.0 * ser_us(wire)).abs() / r.cct_us < 0.01, "seed {SEED}: CCT {}", r.cct_us);
}

#[test]
fn ecmp_with_one_entropy_never_uses_a_second_path() {
    let sc = scenario(
        r#"{ "kind": "leaf_spine", "hosts": 4, "hosts_per_leaf": 2, "spines": 4 }"#,
        r#"[ { "src": 0, "dst": 2, "bytes": 4194304 } ]"#,
        "hash",
        "spray",
        r#", "n_paths": 1"#,
    );
    let mut sim = Sim::new(&sc, &sc.schemes[0], None, false, SEED).unwrap();
    let r = sim.run(0, false);
    assert!(r.completed, "seed {SEED}");
    let f = sim.fabric();
    let (leaf0, leaf1) = (f.node_by_name("leaf0").unwrap(), f.node_by_name("leaf1").unwrap());
    let used = |from_tier: u8, to: Option<u32>, from: Option<u32>| {
        f.ports
            .iter()
            .filter(|p| f.tier(p.from) == from_tier && to.is_none_or(|t| p.to == t) && from.is_none_or(|x| p.from == x))
            .filter(|p| f.tier(p.to) > 0 && p.stats.tx_pkts > 0)
            .count()
    };
    // The hash sees (source, destination, entropy): a sprayed flow with one entropy is one path each
    // way, however many packets it sends.
    assert_eq!(used(1, None, Some(leaf0)), 1, "seed {SEED}: uplinks of leaf0 used");
    assert_eq!(used(2, Some(leaf1), None), 1, "seed {SEED}: spine downlinks to leaf1 used");
    assert_eq!(used(1, None, Some(leaf1)), 1, "seed {SEED}: the acknowledgements' uplinks of leaf1");
}

#[test]
fn a_failed_link_drops_exactly_what_was_sent_to_it() {
    let mut sc = scenario(
        r#"{ "kind": "leaf_spine", "hosts": 4, "hosts_per_leaf": 2, "spines": 4 }"#,
        r#"[ { "src": 0, "dst": 2, "bytes": 2097152 }, { "src": 3, "dst": 1, "bytes": 2097152 } ]"#,
        "path_id",
        "spray",
        r#", "rto_min_us": 20, "rto_initial_us": 50"#,
    );
    sc.failures = serde_json::from_str(r#"{ "links": [ { "between": ["leaf0", "spine1"], "at_us": 10 } ] }"#).unwrap();
    let mut sim = Sim::new(&sc, &sc.schemes[0], None, true, SEED).unwrap();
    let r = sim.run(0, true);
    assert!(r.completed, "seed {SEED}: the flows finish over the other spines");
    let f = sim.fabric();
    let (leaf0, spine1) = (f.node_by_name("leaf0").unwrap(), f.node_by_name("spine1").unwrap());
    let (a, b) = f.link_between(leaf0, spine1, 0).unwrap();
    let failed = |p: u32| &f.ports[p as usize].stats;
    let dropped = failed(a).drops_failed + failed(b).drops_failed;
    assert!(dropped > 0, "seed {SEED}: spraying sent packets into the failed link");
    // Every packet handed to the failed link after the failure is dropped (none serialised after it),
    // nothing else is lost anywhere: sent - delivered - still in flight = dropped on that link.
    let offered_after = failed(a).offered + failed(b).offered - (failed(a).tx_pkts + failed(b).tx_pkts);
    assert_eq!(offered_after, dropped, "seed {SEED}");
    let other: u64 = f
        .ports
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 != a && *i as u32 != b)
        .map(|(_, p)| p.stats.drops_failed + p.stats.drops_overflow)
        .sum();
    assert_eq!(other, 0, "seed {SEED}");
    let (sent, delivered, in_fabric) = sim.packet_counts();
    assert_eq!(sent - delivered - in_fabric, dropped, "seed {SEED}");
    assert!(r.proto.retransmissions >= dropped / 2, "seed {SEED}: lost data was resent");
}
