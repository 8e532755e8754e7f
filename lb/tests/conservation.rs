//! Conservation laws, for any topology, configuration and batch: every byte of a message is planned
//! exactly once, no chunk is empty or larger than `PRISM_CHUNK`, every rail, uplink and entropy is in
//! range, and pinned chunks only use their uplink's entropies. Inputs (seed included) are printed by
//! proptest on failure.

use std::collections::HashMap;

use proptest::prelude::*;

use prism_lb::rail::{Lpt, RailPolicy, TieBreak};
use prism_lb::topology::{Host, Leaf};
use prism_lb::{FlowInfo, LbConfig, PathCtx, PathKind, PathPolicy, RailKind, SendReq, SplitKind, Topology};

#[derive(Debug, Clone)]
struct Case {
    topo: Topology,
    cfg: LbConfig,
    host: usize,
    batches: Vec<Vec<(usize, u64)>>,
    n_paths: u16,
    seed: u64,
}

fn topology() -> impl Strategy<Value = Topology> {
    (1u16..=4, prop::collection::vec(1u16..=16, 1..=3), 2usize..=8).prop_flat_map(|(rails, ups, hosts)| {
        let n_leaves = ups.len() as u32;
        prop::collection::vec(prop::collection::vec(0..n_leaves, rails as usize), hosts).prop_map(move |ls| {
            let leaves = ups.iter().map(|&u| Leaf { uplinks: u, entropy_uplink: None }).collect();
            let hosts = ls.into_iter().map(|l| Host { name: None, leaves: l }).collect();
            Topology::new(rails, 16, leaves, hosts).expect("generated topologies are valid")
        })
    })
}

fn config() -> impl Strategy<Value = LbConfig> {
    let rail = prop_oneof![Just(RailKind::Lpt), Just(RailKind::Rr), Just(RailKind::Hash), Just(RailKind::Single)];
    let split = prop_oneof![Just(SplitKind::None), Just(SplitKind::Ethereal), (1u16..=8).prop_map(SplitKind::Fixed)];
    let path = prop_oneof![Just(PathKind::Spray), Just(PathKind::Ecmp), Just(PathKind::Pro), Just(PathKind::Reps), Just(PathKind::Dr)];
    let tie = prop_oneof![Just(TieBreak::Rotated), Just(TieBreak::Lowest)];
    (rail, split, path, 256u32..=65536, tie, 0u32..=5).prop_map(|(rail, split, path, chunk_bytes, lpt_tie, jitter)| {
        let mut c = LbConfig { rail, split, path, chunk_bytes, lpt_tie, ..LbConfig::default() };
        c.ethereal.jitter_us = jitter;
        c
    })
}

fn case() -> impl Strategy<Value = Case> {
    (topology(), config(), 1u16..=128, any::<u64>()).prop_flat_map(|(topo, cfg, n_paths, seed)| {
        let hosts = topo.hosts().len();
        let msg = (0..hosts, prop_oneof![0u64..=1000, 0u64..=300_000]);
        (0..hosts, prop::collection::vec(prop::collection::vec(msg, 1..=6), 1..=3)).prop_map(move |(host, batches)| Case {
            topo: topo.clone(),
            cfg: cfg.clone(),
            host,
            batches,
            n_paths,
            seed,
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_byte_is_planned_once_no_chunk_is_empty_and_every_entropy_is_in_range(c in case()) {
        let rt = c.cfg.runtime(c.topo.clone(), c.host, c.seed).unwrap();
        let mut flows: HashMap<(usize, u16), Box<dyn PathPolicy>> = HashMap::new();
        for (b, batch) in c.batches.iter().enumerate() {
            let reqs: Vec<SendReq> = batch
                .iter()
                .enumerate()
                .map(|(i, &(dst, len))| SendReq { dst_host: dst, len, flow: i as u64, home_rail: (i % 3) as u16 })
                .collect();
            let plans = rt.plan_batch(&reqs, b as u64 * 50).unwrap();
            prop_assert_eq!(plans.len(), reqs.len());
            for (r, p) in reqs.iter().zip(&plans) {
                let mut ranges: Vec<(u64, u32)> = p.chunks.iter().map(|ch| (ch.offset, ch.len)).collect();
                ranges.sort_unstable();
                let mut next = 0u64;
                for (off, len) in ranges {
                    prop_assert!(len >= 1 && len <= c.cfg.chunk_bytes, "chunk of {} bytes", len);
                    prop_assert_eq!(off, next, "gap or overlap at {}", off);
                    next = off + len as u64;
                }
                prop_assert_eq!(next, r.len);
                for ch in &p.chunks {
                    prop_assert!(ch.rail < c.topo.rails());
                    let my_leaf = c.topo.leaf_of(c.host, ch.rail).unwrap();
                    if let Some(u) = ch.uplink {
                        prop_assert!(c.cfg.split != SplitKind::None);
                        prop_assert!(!c.topo.rack_local(c.host, r.dst_host, ch.rail), "a rack-local chunk was pinned");
                        prop_assert!(u < c.topo.leaf(my_leaf).uplinks);
                    }
                    let pol = flows
                        .entry((r.dst_host, ch.rail))
                        .or_insert_with(|| rt.path_policy(FlowInfo { dst_host: r.dst_host, rail: ch.rail }, c.seed ^ r.dst_host as u64));
                    let ctx = PathCtx { msg: b as u64, offset: 0, n_paths: c.n_paths, retransmit: false, avoid: None, now_us: b as u64 };
                    let e = pol.pick_for(&ctx, ch.uplink);
                    prop_assert!(e < c.n_paths, "entropy {} of {}", e, c.n_paths);
                    if let Some(u) = ch.uplink {
                        if !c.topo.uplink_entropies(my_leaf, u, c.n_paths).is_empty() {
                            prop_assert_eq!(c.topo.uplink_of_entropy(my_leaf, e), u);
                        }
                    }
                    let re = PathCtx { retransmit: true, avoid: Some(e), ..ctx };
                    prop_assert!(pol.pick_for(&re, ch.uplink) < c.n_paths);
                }
            }
        }
    }

    #[test]
    fn lpt_loads_towards_every_destination_stay_within_one_chunk(
        rails in 1u16..=8,
        chunk in 256u32..=65536,
        batches in prop::collection::vec(prop::collection::vec((0usize..5, 0u64..=500_000), 1..=8), 1..=10),
        dead in prop::collection::vec(any::<bool>(), 8),
    ) {
        let mut lpt = Lpt::new(rails, TieBreak::Rotated);
        let alive: Vec<bool> = dead.iter().take(rails as usize).map(|d| !d).collect();
        let usable: Vec<usize> = if alive.iter().any(|&a| a) { (0..rails as usize).filter(|&r| alive[r]).collect() } else { (0..rails as usize).collect() };
        let mut out = Vec::new();
        for batch in &batches {
            let reqs: Vec<SendReq> = batch.iter().map(|&(d, len)| SendReq { dst_host: d, len, flow: 0, home_rail: 0 }).collect();
            out.clear();
            lpt.assign(7, &reqs, chunk, &alive, &mut out);
            prop_assert!(out.iter().all(|c| usable.contains(&(c.rail as usize))));
            for d in 0..5 {
                let l = lpt.load(d);
                let live: Vec<u64> = usable.iter().map(|&r| l[r]).collect();
                let spread = live.iter().max().unwrap() - live.iter().min().unwrap();
                prop_assert!(spread <= chunk as u64, "dst {}: {:?}", d, l);
            }
        }
    }

    #[test]
    fn ethereal_uplink_loads_differ_by_at_most_one_byte_per_flow_for_any_flow_size(
        s in 1u16..=16,
        n in 1usize..=40,
        f in 1u64..=200_000,
        seed in any::<u64>(),
    ) {
        let mut hosts = vec![Host { name: None, leaves: vec![0] }];
        hosts.extend((0..n).map(|_| Host { name: None, leaves: vec![1] }));
        let topo = Topology::new(1, s, vec![Leaf { uplinks: s, entropy_uplink: None }; 2], hosts).unwrap();
        let rt = LbConfig { split: SplitKind::Ethereal, ..LbConfig::default() }.runtime(topo, 0, seed).unwrap();
        let reqs: Vec<SendReq> = (1..=n).map(|d| SendReq { dst_host: d, len: f, flow: 0, home_rail: 0 }).collect();
        let mut per = vec![0u64; s as usize];
        for ch in rt.plan_batch(&reqs, 0).unwrap().iter().flat_map(|p| &p.chunks) {
            per[ch.uplink.unwrap() as usize] += ch.len as u64;
        }
        let spread = per.iter().max().unwrap() - per.iter().min().unwrap();
        // Pieces of f·g/s bytes are rounded to whole bytes; a flow that is smaller than its piece count
        // cannot reach every uplink.
        if f >= s as u64 {
            prop_assert!(spread <= n as u64, "{:?}", per);
        }
        prop_assert_eq!(per.iter().sum::<u64>(), n as u64 * f);
    }
}
