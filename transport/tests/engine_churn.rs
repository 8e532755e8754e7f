//! A long job whose communicators come and go: one engine held while comm pairs are created, used
//! and closed, over and over. Closing a comm must give its memory and descriptors back; only bounded
//! summaries of closed comms stay for `PRISM_STATS`. One test in its own file (its own process), so
//! that no other test's allocations move the RSS it measures.

mod common;

use std::time::{Duration, Instant};

use common::{fds, net, pair, rss_kb, SharedRecv, VecSend};
use prism_transport::engine::{Net, RecvBuf, RecvComm, SendComm};

/// One message from `s` to `r`, checked.
fn one_message(s: &mut SendComm, r: &mut RecvComm, seed: u8) {
    let data: Vec<u8> = (0..1000u32).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    let buf = SharedRecv::filled(4096, 0);
    let rq = r.irecv(vec![(Box::new(buf.clone()) as Box<dyn RecvBuf>, 0)]).unwrap().expect("room for the receive");
    let sq = s.isend(Box::new(VecSend::new(data.clone())), 0).unwrap().expect("room for the send");
    let (mut sdone, mut rdone) = (false, false);
    let t0 = Instant::now();
    while !(sdone && rdone) {
        if !sdone {
            sdone = s.test(sq).unwrap().is_some();
        }
        if !rdone {
            if let Some(sizes) = r.test(rq).unwrap() {
                assert_eq!(sizes, vec![data.len()]);
                rdone = true;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "message did not complete");
    }
    assert_eq!(&buf.0.lock().unwrap()[..data.len()], &data[..]);
}

/// Two connections in opposite directions (as NCCL's peers open them), one message each way, all closed.
fn churn(net: &Net, n: usize) {
    for i in 0..n {
        let (mut s1, mut r1) = pair(net);
        let (mut s2, mut r2) = pair(net);
        one_message(&mut s1, &mut r1, i as u8);
        one_message(&mut s2, &mut r2, !(i as u8));
        drop((s1, r1, s2, r2));
    }
}

/// Warm up, then `pairs` more; returns the RSS growth (KB) over them. Checks fds come back.
fn measure(paths: u32, warmup: usize, pairs: usize) -> (i64, serde_json::Value) {
    let net = net(&[("PRISM_SEED", "42"), ("PRISM_PATHS", &paths.to_string())]);
    churn(&net, warmup);
    let (rss0, fd0) = (rss_kb(), fds());
    let t0 = Instant::now();
    churn(&net, pairs);
    let (rss1, fd1) = (rss_kb(), fds());
    let growth = rss1 as i64 - rss0 as i64;
    eprintln!(
        "PATHS {paths}: {pairs} pairs (x2 connections) in {:.1} s; RSS {rss0} -> {rss1} KB ({growth:+} KB, {:.1} KB per pair); fds {fd0} -> {fd1}",
        t0.elapsed().as_secs_f64(),
        growth as f64 / pairs as f64
    );
    assert_eq!(fd1, fd0, "PATHS {paths}: descriptors left behind by closed comms");
    // What stays for PRISM_STATS is bounded and still counts every comm.
    let stats = net.stats_json();
    let comms = 4 * (warmup + pairs) as u64;
    assert_eq!(stats["comms_closed"], comms);
    assert_eq!(stats["comms"].as_array().unwrap().len(), 64, "the first 32 and the last 32 closed comms are listed");
    let summary = stats["closed_summary"].as_array().unwrap();
    assert_eq!(summary.iter().map(|g| g["comms"].as_u64().unwrap()).sum::<u64>(), comms, "every closed comm is summed");
    let placed: u64 = summary.iter().map(|g| g["conn"]["data_bytes_placed"].as_u64().unwrap()).sum();
    assert_eq!(placed, 2 * (warmup + pairs) as u64 * 1000, "one 1000-byte message each way per pair");
    let size = serde_json::to_string_pretty(&stats).unwrap().len();
    eprintln!("PATHS {paths}: statistics JSON {size} bytes");
    assert!(size < 4 << 20, "PATHS {paths}: statistics JSON of {size} bytes");
    (growth, stats)
}

#[test]
fn comms_that_come_and_go_leave_no_memory_or_descriptors_behind() {
    let (g16, _) = measure(16, 20, 1000);
    let (g1024, _) = measure(1024, 10, 200);
    assert!(g16 < 8 * 1024, "PATHS 16: RSS grew {g16} KB over 1,000 pairs");
    assert!(g1024 < 8 * 1024, "PATHS 1024: RSS grew {g1024} KB over 200 pairs");
}
