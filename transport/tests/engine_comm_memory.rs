//! What one open comm pair costs in resident memory. NCCL opens hundreds to thousands of comms per
//! process (channels x peers x directions); each UDP comm allocated BATCH (64) transmit buffers of a
//! full datagram (64 x 8,972 bytes, 561 KiB) for its whole life, although `transmit` fills and sends
//! them within one call and keeps nothing in them between calls (now the transmitting thread's). One test in
//! its own file (its own process), so that no other test's allocations move the RSS it measures.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{net, pair, rss_kb, SharedRecv, VecSend};
use prism_transport::engine::{RecvBuf, RecvComm, SendComm};

fn one_message(s: &mut SendComm, r: &mut RecvComm, data: &Arc<Vec<u8>>) {
    let buf = SharedRecv::filled(data.len(), 0);
    let rq = r.irecv(vec![(Box::new(buf.clone()) as Box<dyn RecvBuf>, 0)]).unwrap().expect("room for the receive");
    let sq = s.isend(Box::new(VecSend(data.clone())), 0).unwrap().expect("room for the send");
    let (mut sd, mut rd) = (false, false);
    let t0 = Instant::now();
    while !(sd && rd) {
        sd = sd || s.test(sq).unwrap().is_some();
        rd = rd || r.test(rq).unwrap().is_some();
        assert!(t0.elapsed() < Duration::from_secs(10), "message did not complete");
    }
    assert!(buf.0.lock().unwrap()[..] == data[..]);
}

/// 300 connected pairs (600 comms), each having moved one 1 MiB message: at most 256 KiB of
/// resident memory per pair (it was about 1.07 MiB: 321 MB for 300 pairs, before any data moved).
#[test]
fn an_open_comm_pair_costs_bounded_resident_memory() {
    const PAIRS: usize = 300;
    let net = net(&[("PRISM_SEED", "42")]);
    let data = Arc::new((0..1usize << 20).map(|i| (i * 7) as u8).collect::<Vec<u8>>());
    // Warm up the rail's buffers and the allocator with one pair.
    {
        let (mut s, mut r) = pair(&net);
        one_message(&mut s, &mut r, &data);
    }
    let rss0 = rss_kb();
    let mut pairs: Vec<(SendComm, RecvComm)> = (0..PAIRS).map(|_| pair(&net)).collect();
    let rss_open = rss_kb();
    for (s, r) in pairs.iter_mut() {
        one_message(s, r, &data);
    }
    let rss1 = rss_kb();
    let per_pair = (rss1.saturating_sub(rss0)) / PAIRS as u64;
    eprintln!(
        "{PAIRS} pairs: RSS {rss0} KB -> {rss_open} KB connected -> {rss1} KB after a message each: {per_pair} KB per pair \
         ({} KB per pair just connected)",
        rss_open.saturating_sub(rss0) / PAIRS as u64
    );
    assert!(per_pair <= 256, "{per_pair} KB of resident memory per open comm pair ({PAIRS} pairs: {} MB)", (rss1 - rss0) >> 10);
    drop(pairs);
}
