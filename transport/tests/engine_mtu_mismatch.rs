//! Two engines whose datagram sizes differ (`PRISM_MTU`, or interface MTUs, differ between two
//! hosts). A receiver takes datagrams of at most its own size and drops longer ones, so before the
//! HELLO said how large a datagram each end takes, the end with the larger MTU sent DATA the other
//! could never take, retransmissions included, and the transfer failed on the stall watchdog. Each
//! connection now sends packets that fit both ends, whichever end sends.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{net, pair_between, SharedRecv, VecSend};
use prism_transport::engine::{RecvBuf, SendBuf};

#[test]
fn ends_with_different_mtus_deliver_both_ways() {
    // Short watchdogs so that a failure shows quickly.
    let big = net(&[("PRISM_MTU", "9000"), ("PRISM_STALL_TIMEOUT_MS", "3000"), ("PRISM_PEER_TIMEOUT_MS", "3000")]);
    let small = net(&[("PRISM_MTU", "1500"), ("PRISM_STALL_TIMEOUT_MS", "3000"), ("PRISM_PEER_TIMEOUT_MS", "3000")]);
    for (from, to, what) in [(&big, &small, "MTU 9000 to MTU 1500"), (&small, &big, "MTU 1500 to MTU 9000")] {
        let (mut s, mut r) = pair_between(from, to);
        let len = 256 << 10;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let rbuf = SharedRecv::filled(len, 0xEE);
        let rid = r.irecv(vec![(Box::new(rbuf.clone()) as Box<dyn RecvBuf>, 0)]).unwrap().expect("room");
        let sid = s.isend(Box::new(VecSend(Arc::new(data.clone()))) as Box<dyn SendBuf>, 0).unwrap().expect("room");
        let (mut sent, mut got) = (None, None);
        let t0 = Instant::now();
        while sent.is_none() || got.is_none() {
            if sent.is_none() {
                sent = s.test(sid).map_err(|e| e.to_string()).transpose();
            }
            if got.is_none() {
                got = r.test(rid).map_err(|e| e.to_string()).transpose();
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "{what}: neither done nor failed in 20 s");
        }
        assert_eq!(sent, Some(Ok(len)), "{what}: send of {len} bytes (after {:?})", t0.elapsed());
        assert_eq!(got, Some(Ok(vec![len])), "{what}: receive");
        assert!(rbuf.0.lock().unwrap()[..] == data[..], "{what}: bytes differ");
        // Well before any watchdog: no packet was dropped for its size.
        assert!(t0.elapsed() < Duration::from_secs(2), "{what}: took {:?}", t0.elapsed());
    }
}
