//! The spread over entropies each path policy should show in the transport's stats: one 64 MiB message in
//! 4 KiB packets (16 384 packets) over 64 entropies, with the tolerances the wiring checks can reuse.

use prism_lb::{Feedback, LbConfig, PathCtx, PathKind, PathPolicy};

const PACKETS: usize = (64 << 20) / 4096;
const N: u16 = 64;
const PER_ENTROPY: usize = PACKETS / N as usize;
const SEED: u64 = 2024;

fn ctx(msg: u64) -> PathCtx {
    PathCtx { msg, offset: 0, n_paths: N, retransmit: false, avoid: None, now_us: 0 }
}

fn histogram(p: &mut dyn PathPolicy, packets: usize) -> Vec<usize> {
    let mut h = vec![0usize; N as usize];
    for _ in 0..packets {
        h[p.pick(&ctx(0)) as usize] += 1;
    }
    h
}

fn policy(path: PathKind) -> Box<dyn PathPolicy> {
    LbConfig { path, ..LbConfig::default() }.path_policy(SEED)
}

#[test]
fn spray_uses_all_64_entropies_within_25_percent_of_256_packets_each() {
    let h = histogram(policy(PathKind::Spray).as_mut(), PACKETS);
    // 256 ± 25% is about ±4 standard deviations of a binomial(16384, 1/64).
    assert!(h.iter().all(|&c| (192..=320).contains(&c)), "seed {SEED}: {h:?}");
}

#[test]
fn pro_and_dr_put_exactly_256_packets_on_each_of_64_entropies() {
    for path in [PathKind::Pro, PathKind::Dr] {
        let h = histogram(policy(path).as_mut(), PACKETS);
        assert!(h.iter().all(|&c| c == PER_ENTROPY), "{path:?}: {h:?}");
    }
}

#[test]
fn ecmp_uses_one_entropy_per_message_and_spreads_messages() {
    let mut p = policy(PathKind::Ecmp);
    let mut firsts = std::collections::HashSet::new();
    for msg in 0..64 {
        let e = p.pick(&ctx(msg));
        for _ in 0..100 {
            assert_eq!(p.pick(&ctx(msg)), e);
        }
        firsts.insert(e);
    }
    // 64 messages hashed onto 64 entropies: about 64·(1 − 1/e) ≈ 40 distinct, like ECMP collisions.
    assert!((30..=50).contains(&firsts.len()), "seed {SEED}: {}", firsts.len());
}

#[test]
fn reps_with_8_packets_in_flight_and_clean_acks_recycles_the_8_entropies_it_explored() {
    let mut p = policy(PathKind::Reps);
    let mut in_flight: std::collections::VecDeque<u16> = (0..8).map(|_| p.pick(&ctx(0))).collect();
    let explored: std::collections::HashSet<u16> = in_flight.iter().copied().collect();
    for now in 0..10_000u64 {
        let e = in_flight.pop_front().unwrap();
        p.feedback(&Feedback::Ack { entropy: e, rtt_us: 10, congested: false, bytes: 4096, now_us: now });
        let next = p.pick(&PathCtx { now_us: now, ..ctx(0) });
        assert!(explored.contains(&next), "{next} was never explored");
        in_flight.push_back(next);
    }
}

#[test]
fn reps_drops_an_entropy_whose_acks_come_back_congested() {
    let mut p = policy(PathKind::Reps);
    let mut in_flight: std::collections::VecDeque<u16> = (0..8).map(|_| p.pick(&ctx(0))).collect();
    let hot = in_flight[0];
    let mut hot_after_mark = 0;
    for now in 0..2_000u64 {
        let e = in_flight.pop_front().unwrap();
        p.feedback(&Feedback::Ack { entropy: e, rtt_us: 10, congested: e == hot, bytes: 4096, now_us: now });
        let next = p.pick(&PathCtx { now_us: now, ..ctx(0) });
        if now >= 100 && next == hot {
            hot_after_mark += 1;
        }
        in_flight.push_back(next);
    }
    // Only a random exploration can land on it again (1 in 64 per exploration).
    assert!(hot_after_mark <= 3, "seed {SEED}: entropy {hot} used {hot_after_mark} times");
}
