//! Tests of the schedules and the executor, on the in-memory network.

use std::time::Duration;

use super::exec::Op;
use super::*;
use crate::data;
use crate::memnet::{self, MemNet, MemNetConfig};

/// Runs `coll` once on `n` in-memory ranks; returns each rank's wrong-element count (or error text).
fn run_job(
    coll: Collective,
    n: usize,
    bytes: usize,
    slice: usize,
    window: usize,
    cfg: MemNetConfig,
) -> (MemNet, Vec<Result<usize, String>>) {
    let (net, ranks) = memnet::mesh(n, cfg);
    let exec = ExecConfig { window, max_inflight: 64, timeout: Duration::from_secs(20) };
    let threads: Vec<_> = ranks
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || -> Result<usize, String> {
                let counts = coll.counts(bytes, n);
                let bufs = Buffers::alloc(&mut t, coll, counts).map_err(|e| e.to_string())?;
                let p = plan(coll, t.rank(), n, counts, bufs, slice);
                // Two passes: the second proves buffers and schedules are reusable.
                for pass in 0..2 {
                    data::prepare(&mut t, bufs, counts, pass).map_err(|e| e.to_string())?;
                    execute(&mut t, &p, &exec).map_err(|e| e.to_string())?;
                }
                data::count_wrong(&t, coll, bufs, counts, 1).map_err(|e| e.to_string())
            })
        })
        .collect();
    let results = threads.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("rank thread panicked".into()))).collect();
    (net, results)
}

/// Byte sizes including ones whose element count is not divisible by 2, 3 or 4, and sizes smaller
/// than the number of ranks.
const SIZES: [usize; 8] = [0, 4, 12, 20, 4 * 97, 4 * 1000, 4 * 1003, 4 * 4099];

fn exact_for_all(coll: Collective) {
    for n in [1, 2, 3, 4] {
        for (k, &bytes) in SIZES.iter().enumerate() {
            let seed = 1000 * n as u64 + k as u64;
            let (_, res) = run_job(coll, n, bytes, 64, 4, MemNetConfig::lossless(seed));
            for (r, w) in res.iter().enumerate() {
                assert_eq!(w, &Ok(0), "{} n={n} bytes={bytes} rank {r} seed {seed}: {res:?}", coll.name());
            }
        }
    }
}

#[test]
fn sendrecv_delivers_every_element_on_1_to_4_ranks() {
    exact_for_all(Collective::SendRecv);
}

#[test]
fn all_reduce_sums_exactly_on_1_to_4_ranks_at_uneven_sizes() {
    exact_for_all(Collective::AllReduce);
}

#[test]
fn all_gather_places_every_block_on_1_to_4_ranks() {
    exact_for_all(Collective::AllGather);
}

#[test]
fn reduce_scatter_leaves_block_r_summed_on_rank_r() {
    exact_for_all(Collective::ReduceScatter);
}

#[test]
fn alltoall_transposes_blocks_on_1_to_4_ranks() {
    exact_for_all(Collective::AllToAll);
}

#[test]
fn sparse_alltoall_delivers_its_skewed_blocks_and_writes_nothing_else() {
    exact_for_all(Collective::AllToAllSparse);
}

#[test]
fn oneway_delivers_from_each_even_rank_to_the_next_and_nothing_else() {
    exact_for_all(Collective::OneWay);
    assert_eq!(Collective::OneWay.peers(0, 2), (vec![1], vec![]));
    assert_eq!(Collective::OneWay.peers(1, 2), (vec![], vec![0]));
    assert_eq!(Collective::OneWay.peers(2, 3), (vec![], vec![]), "the odd one out idles");
}

#[test]
fn sparse_alltoall_is_sparse_and_skewed() {
    for n in [2, 3, 4, 8] {
        let c = 840;
        for src in 0..n {
            let mut lens: Vec<usize> = (0..n).filter(|&d| d != src).map(|d| sparse_len(src, d, n, c)).collect();
            lens.sort_unstable_by(|a, b| b.cmp(a));
            let fan = (n - 1).div_ceil(2);
            let want: Vec<usize> = (0..n - 1).map(|k| if k < fan { c / (k + 1) } else { 0 }).collect();
            assert_eq!(lens, want, "n={n} src={src}");
        }
    }
    // The pattern on 4 ranks (metrics.py's port for the fabric's lower bound pins the same matrix).
    let m4: Vec<Vec<usize>> = (0..4).map(|s| (0..4).map(|d| sparse_len(s, d, 4, 840)).collect()).collect();
    assert_eq!(m4, vec![vec![840, 840, 420, 0], vec![840, 840, 0, 420], vec![840, 420, 840, 0], vec![0, 840, 420, 840]]);
    // Deterministic, and not the same subset on every rank.
    assert_eq!(sparse_len(1, 5, 8, 100), sparse_len(1, 5, 8, 100));
    let first: Vec<usize> = (0..8).map(|s| (0..8).filter(|&d| d != s).max_by_key(|&d| sparse_len(s, d, 8, 100)).unwrap()).collect();
    assert!(first.iter().any(|&d| d != first[0]), "{first:?}");
}

#[test]
fn a_window_of_one_still_completes_every_collective() {
    for coll in Collective::ALL {
        let seed = 77;
        let (_, res) = run_job(coll, 3, 4 * 1003, 50, 1, MemNetConfig::lossless(seed));
        assert!(res.iter().all(|w| w == &Ok(0)), "{} seed {seed}: {res:?}", coll.name());
    }
}

#[test]
fn executor_never_posts_more_than_the_window_on_one_comm() {
    // The network fails any comm that gets a 4th open request.
    let cfg = MemNetConfig { max_requests_per_comm: 3, ..MemNetConfig::lossless(5) };
    for coll in Collective::ALL {
        let (_, res) = run_job(coll, 3, 4 * 4099, 16, 3, cfg);
        assert!(res.iter().all(|w| w == &Ok(0)), "{}: {res:?}", coll.name());
    }
}

#[test]
fn a_window_above_the_plugins_request_limit_is_caught_by_the_network() {
    // The counterpart of the test above: the limit check does bite.
    let cfg = MemNetConfig { max_requests_per_comm: 3, retry_later_pct: 0, delay_pct: 90, ..MemNetConfig::lossless(5) };
    let (_, res) = run_job(Collective::SendRecv, 2, 4 * 4099, 16, 8, cfg);
    assert!(res.iter().any(|w| w.as_ref().is_err_and(|e| e.contains("already open"))), "{res:?}");
}

#[test]
fn ring_slices_keep_several_sends_in_flight_per_comm() {
    let cfg = MemNetConfig { retry_later_pct: 0, delay_pct: 80, ..MemNetConfig::lossless(9) };
    let (net, res) = run_job(Collective::AllReduce, 2, 4 * 8192, 256, 8, cfg);
    assert!(res.iter().all(|w| w == &Ok(0)), "{res:?}");
    assert!(net.max_open_sends() > 1, "max sends in flight: {}", net.max_open_sends());
}

#[test]
fn verification_counts_every_corrupted_element_of_sendrecv_and_alltoall() {
    for coll in [Collective::SendRecv, Collective::AllToAll] {
        let cfg = MemNetConfig { corrupt_every: Some(101), ..MemNetConfig::lossless(3) };
        let (net, res) = run_job(coll, 3, 4 * 3000, 128, 4, cfg);
        let wrong: usize = res.iter().map(|w| *w.as_ref().unwrap()).sum();
        // Each element sent lands in exactly one place; both passes corrupt, the check sees the 2nd.
        assert!(
            wrong > 0 && wrong * 2 >= net.corrupted() - 3 && wrong * 2 <= net.corrupted() + 3,
            "{}: wrong {wrong}, corrupted {}",
            coll.name(),
            net.corrupted()
        );
    }
}

#[test]
fn corruption_inside_a_ring_reduction_is_detected() {
    for coll in [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather] {
        let cfg = MemNetConfig { corrupt_every: Some(997), ..MemNetConfig::lossless(4) };
        let (_, res) = run_job(coll, 4, 4 * 4000, 128, 4, cfg);
        let wrong: usize = res.iter().map(|w| *w.as_ref().unwrap()).sum();
        assert!(wrong > 0, "{}", coll.name());
    }
}

#[test]
fn a_silent_peer_makes_the_wait_fail_with_what_was_pending() {
    let (_net, mut ranks) = memnet::mesh(2, MemNetConfig::lossless(1));
    let mut t = ranks.remove(0);
    let coll = Collective::SendRecv;
    let counts = coll.counts(4096, 2);
    let bufs = Buffers::alloc(&mut t, coll, counts).unwrap();
    let p = plan(coll, 0, 2, counts, bufs, 256);
    let exec = ExecConfig { window: 2, max_inflight: 8, timeout: Duration::from_millis(200) };
    let err = execute(&mut t, &p, &exec).unwrap_err().to_string();
    assert!(err.contains("no progress") && err.contains("irecv #0 from rank 1"), "{err}");
    assert!(err.contains("isends to rank 1 not posted yet"), "{err}");
}

/// Per ordered pair (a -> b): the lengths of a's sends to b, and of b's receives from a, in order.
fn matched_lengths(coll: Collective, n: usize, bytes: usize, slice: usize) {
    let counts = coll.counts(bytes, n);
    let plans: Vec<Plan> = (0..n)
        .map(|r| {
            let bufs = Buffers { send: BufIdFor::id(0), recv: BufIdFor::id(1), tmp: BufIdFor::id(2) };
            plan(coll, r, n, counts, bufs, slice)
        })
        .collect();
    for a in 0..n {
        for b in 0..n {
            let sends: Vec<usize> = plans[a].sends.iter().filter(|s| s.peer == b).map(|s| s.region.len).collect();
            let recvs: Vec<usize> = plans[b].recvs.iter().filter(|r| r.peer == a).map(|r| r.region.len).collect();
            assert_eq!(sends, recvs, "{} n={n} bytes={bytes}: {a} -> {b}", coll.name());
        }
    }
}

/// Buffer ids for pure plan tests (no pool needed).
struct BufIdFor;
impl BufIdFor {
    fn id(i: usize) -> BufId {
        let mut pool = crate::net::Pool::new();
        let mut last = pool.alloc(0).unwrap();
        for _ in 0..i {
            last = pool.alloc(0).unwrap();
        }
        last
    }
}

#[test]
fn every_send_meets_a_receive_of_the_same_size_in_the_same_order() {
    for coll in Collective::ALL {
        for n in 1..=5 {
            for bytes in [0, 4, 4 * 7, 4 * 1001, 4 * 5000] {
                matched_lengths(coll, n, bytes, 100);
            }
        }
    }
}

#[test]
fn forwarding_sends_wait_only_for_earlier_receives_of_the_same_length() {
    for coll in [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter] {
        let counts = coll.counts(4 * 1003, 4);
        let bufs = Buffers { send: BufIdFor::id(0), recv: BufIdFor::id(1), tmp: BufIdFor::id(2) };
        let p = plan(coll, 1, 4, counts, bufs, 64);
        for s in &p.sends {
            if let Some(a) = s.after {
                assert_eq!(p.recvs[a].region, s.region, "{}: a forward sends exactly what arrived", coll.name());
            }
        }
    }
}

/// Every operation `op` transitively waits for, as (is_send, index). Each op waits for at most one
/// other, so the dependencies form a chain.
fn chain(p: &Plan, mut op: Op) -> Vec<(bool, usize)> {
    let mut out = Vec::new();
    loop {
        let next = match op {
            Op::Send(j) => p.sends[j].after.map(Op::Recv),
            Op::Recv(i) => p.recvs[i].after_send.map(Op::Send),
        };
        match next {
            Some(Op::Send(j)) => out.push((true, j)),
            Some(Op::Recv(i)) => out.push((false, i)),
            None => return out,
        }
        op = next.expect("matched Some above");
    }
}

#[test]
fn every_send_and_receive_sharing_bytes_are_ordered_by_a_dependency() {
    for coll in Collective::ALL {
        for n in 2..=5 {
            let counts = coll.counts(4 * 1003, n);
            let bufs = Buffers { send: BufIdFor::id(0), recv: BufIdFor::id(1), tmp: BufIdFor::id(2) };
            for rank in 0..n {
                let p = plan(coll, rank, n, counts, bufs, 64);
                for (i, r) in p.recvs.iter().enumerate() {
                    for (j, s) in p.sends.iter().enumerate() {
                        if r.region.overlaps(&s.region) {
                            assert!(
                                chain(&p, Op::Send(j)).contains(&(false, i)) || chain(&p, Op::Recv(i)).contains(&(true, j)),
                                "{} n={n} rank {rank}: irecv #{i} and isend #{j} share bytes unordered",
                                coll.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn blocks_tile_the_count_exactly() {
    for count in [0, 1, 5, 97, 1003] {
        for n in 1..=7 {
            let mut next = 0;
            for c in 0..n {
                let (start, len) = block(c, count, n);
                assert_eq!(start, next);
                next += len;
            }
            assert_eq!(next, count);
        }
    }
}

#[test]
fn slices_cover_a_region_without_gaps() {
    assert_eq!(slices(10, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4), (8, 2)]);
    assert_eq!(slices(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
    assert_eq!(slices(0, 4).count(), 0);
}

#[test]
fn counts_round_down_per_rank_like_nccl_tests() {
    let c = Collective::AllGather.counts(1 << 20, 3);
    assert_eq!((c.send, c.recv, c.param), (87381, 262143, 87381));
    let c = Collective::ReduceScatter.counts(1 << 20, 3);
    assert_eq!((c.send, c.recv, c.param), (262143, 87381, 87381));
    let c = Collective::AllToAll.counts(1 << 20, 3);
    assert_eq!((c.send, c.recv, c.param, c.size_bytes()), (262143, 262143, 87381, 1048572));
    let c = Collective::AllReduce.counts(1 << 20, 3);
    assert_eq!((c.send, c.recv, c.param), (262144, 262144, 262144));
}

#[test]
fn alltoall_talks_to_every_other_rank_and_rings_to_two_neighbours() {
    assert_eq!(Collective::AllToAll.peers(1, 4), (vec![2, 3, 0], vec![2, 3, 0]));
    assert_eq!(Collective::AllReduce.peers(0, 4), (vec![1], vec![3]));
    assert_eq!(Collective::SendRecv.peers(0, 1), (vec![], vec![]));
}
