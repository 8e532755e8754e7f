//! Ethereal through the runtime: plans of whole batches on a two-leaf fabric, and the per-flow path
//! policy's reaction to NACKs and timeouts.

use std::collections::{BTreeMap, HashSet};

use prism_lb::split::split_counts;
use prism_lb::topology::{Host, Leaf};
use prism_lb::{Feedback, FlowInfo, LbConfig, LbRuntime, PathCtx, PathKind, Plan, SendReq, SplitKind, Topology};

const F: u64 = 1 << 20;
const SEED: u64 = 0x5eed_e7e4;
/// Host 0 (the sender) and host 65 hang from leaf 0; hosts 1..=64 from leaf 1.
const LOCAL_PEER: usize = 65;

fn topo(s: u16) -> Topology {
    let mut hosts = vec![Host { name: None, leaves: vec![0] }];
    hosts.extend((1..=64).map(|_| Host { name: None, leaves: vec![1] }));
    hosts.push(Host { name: None, leaves: vec![0] });
    Topology::new(1, s, vec![Leaf { uplinks: s, entropy_uplink: None }; 2], hosts).unwrap()
}

fn runtime(s: u16, path: PathKind) -> LbRuntime {
    let cfg = LbConfig { split: SplitKind::Ethereal, path, ..LbConfig::default() };
    cfg.runtime(topo(s), 0, SEED).unwrap()
}

fn req(dst: usize, len: u64) -> SendReq {
    SendReq { dst_host: dst, len, flow: dst as u64, home_rail: 0 }
}

fn bytes_per_uplink(plans: &[Plan], s: usize) -> Vec<u64> {
    let mut per = vec![0u64; s];
    for c in plans.iter().flat_map(|p| &p.chunks) {
        per[c.uplink.expect("remote chunks are pinned") as usize] += c.len as u64;
    }
    per
}

fn subflows(p: &Plan) -> usize {
    p.chunks.iter().map(|c| (c.rail, c.subflow)).collect::<HashSet<_>>().len()
}

#[test]
fn every_uplink_carries_exactly_n_f_over_s_for_n_1_to_64_and_s_2_4_8_16() {
    for s in [2u16, 4, 8, 16] {
        let rt = runtime(s, PathKind::Spray);
        for n in 1..=64usize {
            let reqs: Vec<_> = (1..=n).map(|d| req(d, F)).collect();
            let plans = rt.plan_batch(&reqs, 0).unwrap();
            let want = n as u64 * F / s as u64;
            let per = bytes_per_uplink(&plans, s as usize);
            assert!(per.iter().all(|&b| b == want), "seed {SEED:#x}, n = {n}, s = {s}: {per:?}, want {want} each");
        }
    }
}

#[test]
fn a_batch_has_the_sub_flow_count_of_algorithm_1() {
    // s·⌊n/s⌋ + r·s/g, the digest's worked examples among them (16 → 16, 3 → 48, 15 → 240, 24 → 32).
    for s in [2u16, 4, 8, 16] {
        let rt = runtime(s, PathKind::Spray);
        for n in 1..=64usize {
            let reqs: Vec<_> = (1..=n).map(|d| req(d, F)).collect();
            let plans = rt.plan_batch(&reqs, 0).unwrap();
            let got: usize = plans.iter().map(subflows).sum();
            assert_eq!(got, split_counts(n, s as usize).subflows, "n = {n}, s = {s}");
        }
    }
    let rt = runtime(16, PathKind::Spray);
    for (n, total) in [(1usize, 16usize), (3, 48), (5, 80), (12, 48), (15, 240), (16, 16), (17, 32), (24, 32)] {
        let reqs: Vec<_> = (1..=n).map(|d| req(d, F)).collect();
        let got: usize = rt.plan_batch(&reqs, 0).unwrap().iter().map(subflows).sum();
        assert_eq!(got, total, "n = {n}");
    }
}

#[test]
fn a_connections_messages_in_one_batch_are_one_flow_whose_uplinks_every_message_uses() {
    // Two connections post 4 messages of F each in one batch. Proto sends a connection's messages one
    // after the other, so Algorithm 1's flows are the two connections (2 flows of 4F over 4 uplinks:
    // each cut into 2 pieces, on 2 uplinks of its own), and every message of a connection is cut the
    // same way, so the connection uses both its uplinks all the time. (Planned as 8 flows of F, 2
    // whole messages went on each uplink, and a connection crossed one uplink at a time.)
    let rt = runtime(4, PathKind::Spray);
    let reqs: Vec<SendReq> = (0..8).map(|i| SendReq { dst_host: 1 + i % 2, len: F, flow: 100 + (i % 2) as u64, home_rail: 0 }).collect();
    let plans = rt.plan_batch(&reqs, 0).unwrap();
    let mut per_conn: BTreeMap<u64, Vec<Vec<u16>>> = BTreeMap::new();
    for (r, p) in reqs.iter().zip(&plans) {
        let mut ups: Vec<u16> = p.chunks.iter().map(|c| c.uplink.expect("remote chunks are pinned")).collect();
        ups.sort_unstable();
        ups.dedup();
        per_conn.entry(r.flow).or_default().push(ups);
    }
    let sets: Vec<&Vec<u16>> = per_conn
        .values()
        .map(|msgs| {
            assert!(msgs.iter().all(|u| u == &msgs[0]), "a connection's messages on different uplinks: {msgs:?}");
            &msgs[0]
        })
        .collect();
    assert_eq!(sets.iter().map(|u| u.len()).collect::<Vec<_>>(), vec![2, 2], "each flow in s/g = 2 pieces: {sets:?}");
    assert!(sets[0].iter().all(|u| !sets[1].contains(u)), "the two flows share an uplink: {sets:?}");
    assert_eq!(bytes_per_uplink(&plans, 4), vec![2 * F; 4]);
}

#[test]
fn messages_of_two_sizes_to_one_leaf_still_load_every_uplink_equally() {
    // Size classes: 5 flows of 1 MiB and 3 of 256 KiB over 4 uplinks.
    let rt = runtime(4, PathKind::Spray);
    let mut reqs: Vec<_> = (1..=5).map(|d| req(d, F)).collect();
    reqs.extend((6..=8).map(|d| req(d, F / 4)));
    let per = bytes_per_uplink(&rt.plan_batch(&reqs, 0).unwrap(), 4);
    let want = (5 * F + 3 * F / 4) / 4;
    assert!(per.iter().all(|&b| b == want), "{per:?}");
}

#[test]
fn rack_local_flows_are_sent_whole_and_at_once() {
    let rt = runtime(16, PathKind::Spray);
    let p = rt.plan(&req(LOCAL_PEER, 3 * F + 5), 0).unwrap();
    assert_eq!(p.total_bytes(), 3 * F + 5);
    assert!(p.chunks.iter().all(|c| c.uplink.is_none() && c.subflow == 0 && c.start_after_us == 0), "{:?}", &p.chunks[..2]);
}

#[test]
fn sub_flows_start_within_the_jitter_bound_and_not_all_at_once() {
    let rt = runtime(16, PathKind::Spray);
    let plans = rt.plan_batch(&(1..=8).map(|d| req(d, F)).collect::<Vec<_>>(), 0).unwrap();
    let starts: HashSet<u32> = plans.iter().flat_map(|p| p.chunks.iter().map(|c| c.start_after_us)).collect();
    assert!(starts.iter().all(|&s| s <= 2), "{starts:?}");
    assert!(starts.len() > 1, "{starts:?}");
}

#[test]
fn the_plan_serves_the_sub_flows_round_robin() {
    // One flow to a remote leaf with 16 uplinks: 16 pieces, and every 16 consecutive chunks of the plan
    // hold one chunk of each (Ethereal's assumption A3, uniform round-robin service).
    let rt = runtime(16, PathKind::Spray);
    let p = rt.plan(&req(1, F), 0).unwrap();
    assert_eq!(p.chunks.len(), 32, "1 MiB = 16 pieces of 64 KiB = 32 chunks of 32 KiB");
    for w in p.chunks.chunks(16) {
        let ups: HashSet<_> = w.iter().map(|c| c.uplink).collect();
        assert_eq!(ups.len(), 16, "{w:?}");
    }
}

#[test]
fn a_bad_uplink_gets_nothing_until_the_reset_timer_fires() {
    let rt = runtime(4, PathKind::Spray);
    rt.mark_uplink(0, 3, false, 100);
    // 3 flows over the 3 good uplinks: one whole flow each.
    let per = bytes_per_uplink(&rt.plan_batch(&(1..=3).map(|d| req(d, F)).collect::<Vec<_>>(), 200).unwrap(), 4);
    assert_eq!(per, vec![F, F, F, 0]);
    // The default reset timer is 10 ms.
    let per = bytes_per_uplink(&rt.plan_batch(&(1..=4).map(|d| req(d, F)).collect::<Vec<_>>(), 100 + 10_000).unwrap(), 4);
    assert_eq!(per, vec![F; 4]);
}

fn ctx(msg: u64, now_us: u64) -> PathCtx {
    PathCtx { msg, offset: 0, n_paths: 64, retransmit: false, avoid: None, now_us }
}

#[test]
fn pinned_chunks_only_use_entropies_of_their_uplink_under_every_path_policy() {
    for path in [PathKind::Spray, PathKind::Ecmp, PathKind::Pro, PathKind::Reps, PathKind::Dr] {
        let rt = runtime(4, path);
        let plans = rt.plan_batch(&(1..=3).map(|d| req(d, F)).collect::<Vec<_>>(), 0).unwrap();
        for (i, p) in plans.iter().enumerate() {
            let mut pol = rt.path_policy(FlowInfo { dst_host: i + 1, rail: 0 }, SEED + i as u64);
            for c in &p.chunks {
                for _ in 0..8 {
                    let e = pol.pick_for(&ctx(0, 0), c.uplink);
                    assert!(e < 64);
                    assert_eq!(Some(rt.topology().uplink_of_entropy(0, e)), c.uplink, "{path:?}");
                }
            }
        }
    }
}

#[test]
fn a_nack_moves_the_sub_flow_to_another_uplink_for_the_rest_of_its_message() {
    let rt = runtime(4, PathKind::Spray);
    let mut pol = rt.path_policy(FlowInfo { dst_host: 1, rail: 0 }, SEED);
    let e = pol.pick_for(&ctx(0, 10), Some(2));
    assert_eq!(e % 4, 2);
    pol.feedback(&Feedback::Nack { entropy: e, own_path: true, now_us: 11 });
    let moved: HashSet<u16> = (0..50).map(|_| pol.pick_for(&ctx(0, 12), Some(2)) % 4).collect();
    assert_eq!(moved.len(), 1, "one new uplink for the sub-flow: {moved:?}");
    assert!(!moved.contains(&2));
    // The next message's sub-flow pinned to uplink 2 uses it again (a NACK does not mark it bad).
    assert_eq!(pol.pick_for(&ctx(1, 13), Some(2)) % 4, 2);
}

#[test]
fn a_loss_only_other_uplinks_overtook_does_not_move_the_sub_flow() {
    let rt = runtime(4, PathKind::Spray);
    let mut pol = rt.path_policy(FlowInfo { dst_host: 1, rail: 0 }, SEED);
    let e = pol.pick_for(&ctx(0, 10), Some(2));
    assert_eq!(e % 4, 2);
    // Overdue against packets on other uplinks only: a deeper queue, not the path's own gap.
    pol.feedback(&Feedback::Nack { entropy: e, own_path: false, now_us: 11 });
    let kept: HashSet<u16> = (0..50).map(|_| pol.pick_for(&ctx(0, 12), Some(2)) % 4).collect();
    assert_eq!(kept, HashSet::from([2]), "the sub-flow stays on its uplink");
    // The same loss proven on its own path moves it.
    pol.feedback(&Feedback::Nack { entropy: e, own_path: true, now_us: 13 });
    assert!(!(0..50).any(|_| pol.pick_for(&ctx(0, 14), Some(2)) % 4 == 2), "a path's own loss moves the sub-flow");
}

#[test]
fn a_timeout_marks_the_uplink_bad_for_the_next_batches() {
    let rt = runtime(4, PathKind::Spray);
    let mut pol = rt.path_policy(FlowInfo { dst_host: 1, rail: 0 }, SEED);
    let e = pol.pick_for(&ctx(0, 10), Some(1));
    pol.feedback(&Feedback::Timeout { entropy: Some(e), max_rtt_us: 10, base_rtt_us: 10, now_us: 20 });
    let per = bytes_per_uplink(&rt.plan_batch(&(1..=3).map(|d| req(d, F)).collect::<Vec<_>>(), 30).unwrap(), 4);
    assert_eq!(per[1], 0, "{per:?}");
    // The path coming back alive clears the mark at once.
    pol.feedback(&Feedback::PathState { entropy: e, alive: true, now_us: 40 });
    let per = bytes_per_uplink(&rt.plan_batch(&(1..=4).map(|d| req(d, F)).collect::<Vec<_>>(), 50).unwrap(), 4);
    assert_eq!(per, vec![F; 4]);
}

fn retx(msg: u64, offset: u64, now_us: u64, avoid: u16) -> PathCtx {
    PathCtx { retransmit: true, avoid: Some(avoid), offset, ..ctx(msg, now_us) }
}

/// Retransmissions of 400 consecutive packets of one pinned sub-flow: where each went, per uplink
/// (checking that the transport's later questions about the same packet get the same answer).
fn retransmissions_per_uplink(rt: &LbRuntime, pol: &mut dyn prism_lb::PathPolicy, pin: u16, avoid: u16) -> [u32; 4] {
    let topo = rt.topology();
    let mut per = [0u32; 4];
    for k in 0..400u64 {
        let c = retx(0, k * 8832, 20, avoid);
        let e = pol.pick_for(&c, Some(pin));
        assert_ne!(e, avoid, "never the lost copy's path");
        let u = topo.uplink_of_entropy(0, e);
        for other in 0..64 {
            assert_eq!(pol.allows(&c, Some(pin), other), topo.uplink_of_entropy(0, other) == u, "packet {k}, entropy {other}");
        }
        per[u as usize] += 1;
    }
    per
}

#[test]
fn retransmissions_of_a_pinned_sub_flow_spread_over_the_uplinks_and_its_new_packets_keep_to_its_own() {
    // A window declared lost behind a deep queue (mostly spurious on the rail fabric) is bytes no plan
    // counted: kept on the sub-flow's uplink it loaded that uplink alone.
    for path in [PathKind::Ecmp, PathKind::Spray, PathKind::Pro, PathKind::Reps, PathKind::Dr] {
        let rt = runtime(4, path);
        let mut pol = rt.path_policy(FlowInfo { dst_host: 1, rail: 0 }, SEED);
        let first = pol.pick_for(&ctx(0, 10), Some(2));
        assert_eq!(rt.topology().uplink_of_entropy(0, first), 2);
        let per = retransmissions_per_uplink(&rt, pol.as_mut(), 2, first);
        assert!(per.iter().all(|&c| (70..=130).contains(&c)), "{path:?}: {per:?}");
        // The sub-flow's new packets are where they were, and no other uplink is allowed for them.
        for _ in 0..20 {
            assert_eq!(rt.topology().uplink_of_entropy(0, pol.pick_for(&ctx(0, 30), Some(2))), 2, "{path:?}");
        }
        let other = (0..64).find(|&e| rt.topology().uplink_of_entropy(0, e) == 1).unwrap();
        assert!(!pol.allows(&ctx(0, 30), Some(2), other), "{path:?}");
    }
}

#[test]
fn retransmissions_skip_an_uplink_marked_bad_and_a_fit_pick_keeps_to_fit_paths() {
    let rt = runtime(4, PathKind::Ecmp);
    let mut pol = rt.path_policy(FlowInfo { dst_host: 1, rail: 0 }, SEED);
    let first = pol.pick_for(&ctx(0, 10), Some(0));
    rt.mark_uplink(0, 3, false, 10);
    let per = retransmissions_per_uplink(&rt, pol.as_mut(), 0, first);
    assert!(per[3] == 0 && per[..3].iter().all(|&c| (100..=170).contains(&c)), "{per:?}");
    // Only some entropies fit: a fit pick lands on one, on the packet's uplink when it has one.
    let topo = rt.topology();
    for k in 0..300u64 {
        let c = retx(0, k * 8832, 20, first);
        let e = pol.pick_fit(&c, Some(0), &mut |e| e % 8 < 4).expect("a fit entropy exists");
        assert!(e % 8 < 4 && e != first);
        assert!(pol.allows(&c, Some(0), e));
        assert_ne!(topo.uplink_of_entropy(0, e), 3);
    }
    // With no fit entropy at all the policy says so; the transport corrects.
    assert_eq!(pol.pick_fit(&retx(0, 0, 20, first), Some(0), &mut |_| false), None);
}

#[test]
fn a_batcher_from_the_configuration_feeds_plan_batch() {
    let vars: BTreeMap<String, String> =
        [("PRISM_SPLIT", "ethereal"), ("PRISM_ETHEREAL_BATCH_US", "5")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let rt = LbConfig::from_vars(&vars).unwrap().runtime(topo(4), 0, SEED).unwrap();
    let mut b = rt.batcher::<u32>();
    for d in 1..=4u32 {
        assert!(b.push(d, req(d as usize, F), 100 + d as u64).is_empty());
    }
    // The batch opened at 101 closes 5 µs later.
    assert!(b.poll(105).is_empty());
    let batch = b.poll(106);
    assert_eq!(batch.len(), 4);
    let reqs: Vec<SendReq> = batch.iter().map(|x| x.1).collect();
    // Batched together, the 4 flows go whole, one per uplink, instead of each split 4 ways.
    let plans = rt.plan_batch(&reqs, 106).unwrap();
    assert_eq!(plans.iter().map(subflows).sum::<usize>(), 4);
    assert_eq!(bytes_per_uplink(&plans, 4), vec![F; 4]);
}
