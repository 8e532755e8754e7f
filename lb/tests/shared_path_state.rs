//! PRO's counter and DR's pointer are shared per destination leaf by the runtime: flows to hosts under
//! one leaf stagger or rotate together, flows to other leaves do not disturb them.

use prism_lb::{FlowInfo, LbConfig, LbRuntime, PathCtx, PathKind, PathPolicy, ProStart, Topology};

const SEED: u64 = 77;
const M: u16 = 16;

/// 4 leaves of 8 hosts; host 0 sends.
fn runtime(path: PathKind) -> LbRuntime {
    let cfg = LbConfig { path, ..LbConfig::default() };
    cfg.runtime(Topology::leaf_spine(32, 8, 1, 16).unwrap(), 0, SEED).unwrap()
}

fn ctx() -> PathCtx {
    PathCtx { msg: 0, offset: 0, n_paths: M, retransmit: false, avoid: None, now_us: 0 }
}

fn policies(rt: &LbRuntime, hosts: &[usize]) -> Vec<Box<dyn PathPolicy>> {
    hosts.iter().map(|&h| rt.path_policy(FlowInfo { dst_host: h, rail: 0 }, SEED ^ h as u64)).collect()
}

/// `rounds` rounds, one pick per flow per round; after each flow pick, `noise` picks a packet to another leaf.
fn run(flows: &mut [Box<dyn PathPolicy>], noise: &mut Option<Box<dyn PathPolicy>>, rounds: usize) -> Vec<Vec<u16>> {
    (0..rounds)
        .map(|_| {
            flows
                .iter_mut()
                .map(|f| {
                    let e = f.pick(&ctx());
                    if let Some(n) = noise {
                        n.pick(&ctx());
                    }
                    e
                })
                .collect()
        })
        .collect()
}

#[test]
fn pro_flows_to_hosts_under_one_leaf_take_consecutive_paths_every_round() {
    let rt = runtime(PathKind::Pro);
    // Hosts 8, 9, 10 hang from leaf 1: one counter, span 3.
    let r = run(&mut policies(&rt, &[8, 9, 10]), &mut None, 4 * M as usize);
    for round in &r {
        assert_eq!(round[1], (round[0] + 1) % M, "{round:?}");
        assert_eq!(round[2], (round[0] + 2) % M, "{round:?}");
    }
    for f in 0..3 {
        for w in r.chunks(M as usize) {
            let mut seen: Vec<u16> = w.iter().map(|x| x[f]).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..M).collect::<Vec<_>>(), "flow {f}");
        }
    }
}

#[test]
fn pro_traffic_to_another_leaf_does_not_disturb_a_leafs_counter() {
    let quiet = run(&mut policies(&runtime(PathKind::Pro), &[8, 9]), &mut None, 20);
    let rt = runtime(PathKind::Pro);
    let mut noise = Some(rt.path_policy(FlowInfo { dst_host: 16, rail: 0 }, 1));
    let noisy = run(&mut policies(&rt, &[8, 9]), &mut noise, 20);
    assert_eq!(quiet, noisy);
}

#[test]
fn dr_flows_to_one_leaf_share_a_rotation_covering_every_path_once_per_m_packets() {
    let rt = runtime(PathKind::Dr);
    let r = run(&mut policies(&rt, &[8, 9, 10, 11]), &mut None, 2 * M as usize);
    let all: Vec<u16> = r.into_iter().flatten().collect();
    for w in all.chunks(M as usize) {
        let mut s = w.to_vec();
        s.sort_unstable();
        assert_eq!(s, (0..M).collect::<Vec<_>>(), "{w:?}");
    }
}

#[test]
fn dr_keeps_one_pointer_per_destination_leaf() {
    let quiet = run(&mut policies(&runtime(PathKind::Dr), &[8, 9]), &mut None, 20);
    let rt = runtime(PathKind::Dr);
    let mut noise = Some(rt.path_policy(FlowInfo { dst_host: 24, rail: 0 }, 1));
    let noisy = run(&mut policies(&rt, &[8, 9]), &mut noise, 20);
    assert_eq!(quiet, noisy);
}

#[test]
fn pro_and_dr_start_leaves_at_different_offsets() {
    // PRO with random starts (`PRISM_PRO_START=random`); with `rack` starts see the next test.
    for path in [PathKind::Pro, PathKind::Dr] {
        let cfg = LbConfig { path, pro_start: ProStart::Random, ..LbConfig::default() };
        let rt = cfg.runtime(Topology::leaf_spine(32, 8, 1, 16).unwrap(), 0, SEED).unwrap();
        let firsts: std::collections::HashSet<u16> =
            [1usize, 8, 16, 24].iter().map(|&h| rt.path_policy(FlowInfo { dst_host: h, rail: 0 }, 0).pick(&ctx())).collect();
        assert!(firsts.len() >= 3, "{path:?}: {firsts:?}");
    }
}

#[test]
fn pro_rack_starts_put_a_hosts_flows_to_every_leaf_at_its_place_in_the_rack() {
    // With `rack` starts a host's counters for every destination leaf start at the same place (its index
    // in the rack after the rack's common shift), so the rack's hosts stay on distinct uplinks whatever
    // leaf each sends to; two racks' shifts differ.
    let topo = Topology::leaf_spine(32, 8, 1, 16).unwrap();
    let cfg = LbConfig { path: PathKind::Pro, ..LbConfig::default() };
    let first = |host: usize, dst: usize| {
        cfg.runtime(topo.clone(), host, SEED + host as u64).unwrap().path_policy(FlowInfo { dst_host: dst, rail: 0 }, 0).pick(&ctx())
    };
    let base = first(0, 8);
    for dst in [9usize, 16, 24] {
        assert_eq!(first(0, dst), base, "host 0 to host {dst}");
    }
    for h in 1..8usize {
        assert_eq!(first(h, 8 + (h * 5) % 24), (base + h as u16) % M, "host {h}");
    }
    let other_rack: std::collections::HashSet<u16> = (8..16usize).map(|h| first(h, 0)).collect();
    assert_eq!(other_rack.len(), 8, "{other_rack:?}");
}
