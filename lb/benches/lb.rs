//! Hot paths of `prism-lb`: planning a 64 MiB message into 32 KiB chunks over 8 rails (goal: < 20 µs per
//! 1024 chunks) and one path pick per policy over 64 entropies (goal: < 50 ns).
//!
//! Run: `cargo bench -p prism-lb -- --warm-up-time 1 --measurement-time 2`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use prism_lb::{Feedback, FlowInfo, LbConfig, PathCtx, PathKind, SendReq, SplitKind, Topology};

const MSG: u64 = 64 << 20;
const CHUNKS: u64 = MSG / (32 << 10);
const PATHS: u16 = 64;

fn req(dst: usize) -> SendReq {
    SendReq { dst_host: dst, len: MSG, flow: 1, home_rail: 0 }
}

fn ctx(n: u64) -> PathCtx {
    PathCtx { msg: n >> 10, offset: 0, n_paths: PATHS, retransmit: false, avoid: None, now_us: n }
}

fn plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_64MiB_32KiB_8rails");
    g.throughput(Throughput::Elements(CHUNKS));

    let rt = LbConfig::default().runtime(Topology::single_leaf(8), 0, 1).unwrap();
    g.bench_function("lpt", |b| b.iter(|| black_box(rt.plan(black_box(&req(1)), 0).unwrap())));

    for (name, rail) in [("rr", prism_lb::RailKind::Rr), ("hash", prism_lb::RailKind::Hash)] {
        let rt = LbConfig { rail, ..LbConfig::default() }.runtime(Topology::single_leaf(8), 0, 1).unwrap();
        g.bench_function(name, |b| b.iter(|| black_box(rt.plan(black_box(&req(1)), 0).unwrap())));
    }

    // Ethereal on a leaf-spine (16 uplinks per leaf): the destination is on another leaf, so each rail's
    // share is cut into 16 sub-flows.
    let topo = Topology::leaf_spine(64, 16, 8, 16).unwrap();
    let rt = LbConfig { split: SplitKind::Ethereal, ..LbConfig::default() }.runtime(topo.clone(), 0, 1).unwrap();
    g.bench_function("lpt_ethereal_16_uplinks", |b| b.iter(|| black_box(rt.plan(black_box(&req(40)), 0).unwrap())));

    // Plan plus one PRO pick per chunk over 64 entropies (the path layer's share of a message).
    let rt = LbConfig { path: PathKind::Pro, ..LbConfig::default() }.runtime(topo, 0, 1).unwrap();
    let mut pols: Vec<_> = (0..8).map(|r| rt.path_policy(FlowInfo { dst_host: 40, rail: r }, 7)).collect();
    g.bench_function("lpt_plus_pro_pick_per_chunk_64_paths", |b| {
        let mut n = 0u64;
        b.iter(|| {
            let p = rt.plan(black_box(&req(40)), 0).unwrap();
            let mut acc = 0u32;
            for ch in &p.chunks {
                n += 1;
                acc += pols[ch.rail as usize].pick_for(&ctx(n), ch.uplink) as u32;
            }
            black_box(acc)
        })
    });
    g.finish();
}

fn pick(c: &mut Criterion) {
    let mut g = c.benchmark_group("pick_64_paths");
    for path in [PathKind::Spray, PathKind::Ecmp, PathKind::Pro, PathKind::Reps, PathKind::Dr] {
        let mut p = LbConfig { path, ..LbConfig::default() }.path_policy(3);
        g.bench_function(path.name(), |b| {
            let mut n = 0u64;
            b.iter(|| {
                n += 1;
                black_box(p.pick(black_box(&ctx(n))))
            })
        });
    }
    // REPS in its steady state: every pick recycles the entropy a clean ACK just returned.
    let mut p = LbConfig { path: PathKind::Reps, ..LbConfig::default() }.path_policy(3);
    g.bench_function("reps_recycling_pick_plus_ack", |b| {
        let mut n = 0u64;
        b.iter(|| {
            n += 1;
            let e = p.pick(black_box(&ctx(n)));
            p.feedback(&Feedback::Ack { entropy: e, rtt_us: 10, congested: false, bytes: 4096, now_us: n });
            black_box(e)
        })
    });
    // Through the runtime's per-flow object (shared PRO state, uplink pinning).
    let topo = Topology::leaf_spine(64, 16, 1, 16).unwrap();
    for path in [PathKind::Pro, PathKind::Dr] {
        let rt = LbConfig { path, ..LbConfig::default() }.runtime(topo.clone(), 0, 1).unwrap();
        let mut p = rt.path_policy(FlowInfo { dst_host: 40, rail: 0 }, 5);
        g.bench_function(format!("runtime_{}_unpinned", path.name()), |b| {
            let mut n = 0u64;
            b.iter(|| {
                n += 1;
                black_box(p.pick_for(black_box(&ctx(n)), None))
            })
        });
        g.bench_function(format!("runtime_{}_pinned", path.name()), |b| {
            let mut n = 0u64;
            b.iter(|| {
                n += 1;
                black_box(p.pick_for(black_box(&ctx(n)), Some(3)))
            })
        });
    }
    g.finish();

    // A chunk's 8 packets in one call: PRO and DR take their shared lock once per burst.
    let mut g = c.benchmark_group("pick_burst_8_of_64_paths");
    g.throughput(Throughput::Elements(8));
    for path in [PathKind::Spray, PathKind::Pro, PathKind::Dr] {
        let mut p = LbConfig { path, ..LbConfig::default() }.path_policy(3);
        let mut out = [0u16; 8];
        g.bench_function(path.name(), |b| {
            let mut n = 0u64;
            b.iter(|| {
                n += 1;
                p.pick_burst(black_box(&ctx(n)), None, &mut out);
                black_box(out[7])
            })
        });
    }
    g.finish();
}

criterion_group!(benches, plan, pick);
criterion_main!(benches);
