//! The engine end to end over loopback UDP in one process: handshake, sizes, grouped receives,
//! truncation, many requests in flight, a peer that vanishes.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{pair, CopySend, SharedRecv, VecSend};
use prism_transport::engine::{Net, RecvBuf, RecvComm, SendBuf, SendComm, TransportConfig, TransportError, HANDLE_LEN};
use prism_transport::wire::HELLO_VERSION;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) as u8).collect()
}

/// One grouped receive's outcome (its sizes, or the error) and the bytes of its buffers.
type RecvOutcome = (Result<Vec<usize>, String>, Vec<Vec<u8>>);

/// Drive both comms until every request is done; returns each receive's sizes (or error).
fn run(
    s: &mut SendComm,
    r: &mut RecvComm,
    sends: Vec<(Vec<u8>, i32)>,
    recvs: Vec<Vec<(usize, i32)>>,
) -> (Vec<Result<usize, String>>, Vec<RecvOutcome>) {
    run_with(s, r, sends, recvs, false)
}

/// `run`, with send buffers that only copy (`copy`: the engine cannot send their bytes in place).
fn run_with(
    s: &mut SendComm,
    r: &mut RecvComm,
    sends: Vec<(Vec<u8>, i32)>,
    recvs: Vec<Vec<(usize, i32)>>,
    copy: bool,
) -> (Vec<Result<usize, String>>, Vec<RecvOutcome>) {
    let rbufs: Vec<Vec<SharedRecv>> = recvs.iter().map(|g| g.iter().map(|&(n, _)| SharedRecv::filled(n, 0xEE)).collect()).collect();
    let mut rreqs = Vec::new();
    for (g, bufs) in recvs.iter().zip(&rbufs) {
        let items: Vec<(Box<dyn RecvBuf>, i32)> =
            g.iter().zip(bufs).map(|(&(_, tag), b)| (Box::new(b.clone()) as Box<dyn RecvBuf>, tag)).collect();
        rreqs.push(Some(r.irecv(items).unwrap().expect("room for the receive")));
    }
    let mut sreqs = Vec::new();
    for (data, tag) in &sends {
        let buf: Box<dyn SendBuf> =
            if copy { Box::new(CopySend(Arc::new(data.clone()))) } else { Box::new(VecSend(Arc::new(data.clone()))) };
        sreqs.push(Some(s.isend(buf, *tag).unwrap().expect("room for the send")));
    }
    let mut sres: Vec<Option<Result<usize, String>>> = vec![None; sends.len()];
    let mut rres: Vec<Option<Result<Vec<usize>, String>>> = vec![None; recvs.len()];
    let t0 = Instant::now();
    while sres.iter().any(Option::is_none) || rres.iter().any(Option::is_none) {
        for (i, q) in sreqs.iter_mut().enumerate() {
            if let Some(id) = *q {
                match s.test(id) {
                    Ok(Some(n)) => (sres[i], *q) = (Some(Ok(n)), None),
                    Ok(None) => {}
                    Err(e) => (sres[i], *q) = (Some(Err(e.to_string())), None),
                }
            }
        }
        for (i, q) in rreqs.iter_mut().enumerate() {
            if let Some(id) = *q {
                match r.test(id) {
                    Ok(Some(n)) => (rres[i], *q) = (Some(Ok(n)), None),
                    Ok(None) => {}
                    Err(e) => (rres[i], *q) = (Some(Err(e.to_string())), None),
                }
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "transfer did not finish: sends {sres:?} recvs {rres:?}");
    }
    let recv_out =
        rres.into_iter().zip(rbufs).map(|(res, bufs)| (res.unwrap(), bufs.iter().map(|b| b.0.lock().unwrap().clone()).collect())).collect();
    (sres.into_iter().map(Option::unwrap).collect(), recv_out)
}

#[test]
fn every_size_arrives_intact_over_loopback() {
    let net = net(&[]);
    let (mut s, mut r) = pair(&net);
    for (k, &n) in [0usize, 1, 7, 4096, 65535, 1 << 20, 16 << 20].iter().enumerate() {
        let data = pattern(k as u64, n);
        let (sres, rres) = run(&mut s, &mut r, vec![(data.clone(), 3)], vec![vec![(n + 100, 3)]]);
        assert_eq!(sres[0], Ok(n));
        assert_eq!(rres[0].0, Ok(vec![n]), "size {n}");
        assert_eq!(&rres[0].1[0][..n], &data[..], "bytes of size {n}");
        assert!(rres[0].1[0][n..].iter().all(|&b| b == 0xEE), "bytes past the message of size {n} were touched");
    }
}

#[test]
fn thirty_two_requests_in_flight_complete_in_order() {
    let net = net(&[]);
    let (mut s, mut r) = pair(&net);
    let sends: Vec<_> = (0..32).map(|i| (pattern(i, 10_000 + i as usize * 777), 1)).collect();
    let recvs: Vec<_> = (0..32).map(|_| vec![(64 * 1024, 1)]).collect();
    let (sres, rres) = run(&mut s, &mut r, sends.clone(), recvs);
    for (i, (data, _)) in sends.iter().enumerate() {
        assert_eq!(sres[i], Ok(data.len()));
        assert_eq!(rres[i].0, Ok(vec![data.len()]));
        assert_eq!(&rres[i].1[0][..data.len()], &data[..], "message {i}");
    }
}

#[test]
fn grouped_receive_matches_sends_by_tag() {
    let net = net(&[]);
    let (mut s, mut r) = pair(&net);
    // Sends with tags 7, 5, 9, 5 land in the buffers posted with those tags, in order per tag.
    let sends: Vec<_> = [(7, 100), (5, 200), (9, 300), (5, 400)].iter().map(|&(t, n)| (pattern(t as u64 + n as u64, n), t)).collect();
    let (sres, rres) = run(&mut s, &mut r, sends.clone(), vec![vec![(1000, 5), (1000, 5), (1000, 7), (1000, 9)]]);
    assert!(sres.iter().all(Result::is_ok), "{sres:?}");
    assert_eq!(rres[0].0, Ok(vec![200, 400, 100, 300]));
    assert_eq!(&rres[0].1[0][..200], &sends[1].0[..]);
    assert_eq!(&rres[0].1[1][..400], &sends[3].0[..]);
    assert_eq!(&rres[0].1[2][..100], &sends[0].0[..]);
    assert_eq!(&rres[0].1[3][..300], &sends[2].0[..]);
}

#[test]
fn a_send_larger_than_the_receive_fails_both_and_writes_nothing_past_it() {
    let net = net(&[]);
    let (mut s, mut r) = pair(&net);
    let (sres, rres) = run(&mut s, &mut r, vec![(pattern(1, 5000), 0)], vec![vec![(4000, 0)]]);
    assert!(sres[0].as_ref().is_err_and(|e| e.contains("truncated")), "{sres:?}");
    assert!(rres[0].0.is_err(), "{:?}", rres[0].0);
    assert_eq!(rres[0].1[0].len(), 4000);
    // The comm keeps working after the failed pair.
    let data = pattern(2, 3000);
    let (sres, rres) = run(&mut s, &mut r, vec![(data.clone(), 0)], vec![vec![(4000, 0)]]);
    assert_eq!(sres[0], Ok(3000));
    assert_eq!(&rres[0].1[0][..3000], &data[..]);
}

/// A peer that answers the handshake and then never says a word again (a crashed host): the
/// handshake is played by hand from the layout documented in `wire/hello.rs` (bytes, not the view: an independent check of the format).
fn silent_peer(net: &Net) -> (SendComm, std::net::UdpSocket) {
    use std::io::{Read, Write};
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut handle = [0u8; HANDLE_LEN];
    handle[0..4].copy_from_slice(b"PRSM");
    handle[4] = HELLO_VERSION;
    handle[6..8].copy_from_slice(&tcp.local_addr().unwrap().port().to_be_bytes());
    handle[8..12].copy_from_slice(&[127, 0, 0, 1]);
    handle[12..20].copy_from_slice(&77u64.to_be_bytes());
    let udp_port = udp.local_addr().unwrap().port();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = tcp.accept().unwrap();
        let mut hello = [0u8; 144];
        s.read_exact(&mut hello).unwrap();
        let mut reply = [0u8; 144];
        reply[0..4].copy_from_slice(b"PRSM");
        reply[4] = HELLO_VERSION;
        reply[6] = 1; // one rail; byte 7 = 0: UDP backend; bytes 28..32 = 0: no verbs block
        reply[8..16].copy_from_slice(&77u64.to_be_bytes());
        reply[16..24].copy_from_slice(&0x5eed_u64.to_be_bytes());
        reply[32..40].copy_from_slice(&hello[16..24]); // echo of the connector's token
        reply[40] = 2; // a reply
        reply[44..48].copy_from_slice(&hello[44..48]); // takes what the connector takes
        reply[48..52].copy_from_slice(&[127, 0, 0, 1]);
        reply[52..54].copy_from_slice(&udp_port.to_be_bytes());
        s.write_all(&reply).unwrap();
    });
    let t0 = Instant::now();
    let comm = loop {
        if let Some(c) = net.connect(0, &mut handle).unwrap() {
            break c;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "handshake with the silent peer did not finish");
    };
    peer.join().unwrap();
    (comm, udp)
}

#[test]
fn a_silent_peer_fails_outstanding_requests_within_the_peer_timeout() {
    let net = net(&[("PRISM_PEER_TIMEOUT_MS", "500")]);
    let (mut s, _blackhole) = silent_peer(&net);
    let req = s.isend(Box::new(VecSend(Arc::new(pattern(3, 100_000)))), 0).unwrap().unwrap();
    let t0 = Instant::now();
    let err = loop {
        match s.test(req) {
            Ok(None) => assert!(t0.elapsed() < Duration::from_secs(5), "request still pending after 5 s"),
            Ok(Some(n)) => panic!("a send to a silent peer completed with {n} bytes"),
            Err(e) => break e,
        }
    };
    let waited = t0.elapsed();
    assert!(matches!(err, TransportError::RequestFailed(ref m) if m.contains("silent")), "{err}");
    assert!(waited >= Duration::from_millis(450), "failed before the timeout: {waited:?}");
    assert!(waited < Duration::from_millis(1500), "failed only after {waited:?} (timeout 500 ms)");
}

#[test]
fn a_closed_peer_fails_the_next_send_promptly() {
    let net = net(&[("PRISM_PEER_TIMEOUT_MS", "5000")]);
    let (mut s, r) = pair(&net);
    drop(r);
    let t0 = Instant::now();
    let failed = loop {
        match s.isend(Box::new(VecSend(Arc::new(pattern(3, 1000)))), 0) {
            Err(e) => break e.to_string(),
            Ok(Some(req)) => match s.test(req) {
                Err(e) => break e.to_string(),
                Ok(Some(_)) => panic!("a send to a closed peer completed"),
                Ok(None) => {}
            },
            Ok(None) => {}
        }
        assert!(t0.elapsed() < Duration::from_secs(2), "no failure 2 s after the peer closed");
    };
    assert!(failed.contains("closed"), "{failed}");
}

#[test]
fn connect_to_a_garbage_handle_is_an_error() {
    let net = net(&[]);
    let mut handle = [7u8; HANDLE_LEN];
    let e = net.connect(0, &mut handle).err().expect("must fail");
    assert!(matches!(e, TransportError::BadHandle(_)), "{e}");
}

fn net_lb(extra: &[(&str, &str)], lb: &[(&str, &str)]) -> Net {
    let vars: BTreeMap<String, String> =
        [("PRISM_SEED", "42"), ("PRISM_PATHS", "4")].iter().chain(extra).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let lbv: BTreeMap<String, String> = lb.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Net::new(TransportConfig::from_vars(&vars).unwrap(), prism_lb::LbConfig::from_vars(&lbv).unwrap()).unwrap()
}

#[test]
fn two_rails_share_a_message_under_round_robin_rails() {
    // The same interface twice gives two rails with their own sockets: enough to check the rail layer.
    let net = net_lb(&[("PRISM_IFNAMES", "lo,lo")], &[("PRISM_RAIL", "rr"), ("PRISM_CHUNK", "65536")]);
    assert_eq!(net.devices().len(), 2);
    let (mut s, mut r) = pair(&net);
    let data = pattern(11, 4 << 20);
    let (sres, rres) = run(&mut s, &mut r, vec![(data.clone(), 0)], vec![vec![(4 << 20, 0)]]);
    assert_eq!(sres[0], Ok(4 << 20));
    assert_eq!(rres[0].1[0], data);
    drop((s, r));
    let stats = net.stats_json();
    let send = stats["comms"].as_array().unwrap().iter().find(|c| c["role"] == "send").unwrap();
    let per_rail: Vec<u64> = send["planned_bytes_per_rail"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(per_rail, vec![2 << 20, 2 << 20], "rr splits 64 chunks evenly");
    // Packets really left from both rails' sockets: entropies 0..4 are rail 0, 4..8 rail 1.
    let paths = send["conn"]["paths"].as_array().unwrap();
    let rail_pkts = |rail: u64| -> u64 {
        paths.iter().filter(|p| p["entropy"].as_u64().unwrap() / 4 == rail).map(|p| p["pkts_sent"].as_u64().unwrap()).sum()
    };
    assert!(rail_pkts(0) > 200 && rail_pkts(1) > 200, "rail 0: {} packets, rail 1: {}", rail_pkts(0), rail_pkts(1));
}

#[test]
fn single_rail_policy_keeps_everything_on_the_home_rail() {
    let net = net_lb(&[("PRISM_IFNAMES", "lo,lo")], &[("PRISM_RAIL", "single")]);
    let (mut s, mut r) = pair(&net);
    let data = pattern(12, 1 << 20);
    let (_, rres) = run(&mut s, &mut r, vec![(data.clone(), 0)], vec![vec![(1 << 20, 0)]]);
    assert_eq!(rres[0].1[0], data);
    drop((s, r));
    let stats = net.stats_json();
    let send = stats["comms"].as_array().unwrap().iter().find(|c| c["role"] == "send").unwrap();
    assert_eq!(send["planned_bytes_per_rail"], serde_json::json!([1 << 20, 0]));
}

/// Loopback, `PRISM_SEED=42`, `PRISM_PATHS=8` unless `extra` sets it, and `extra`.
fn net(extra: &[(&str, &str)]) -> Net {
    let vars: Vec<(&str, &str)> = [("PRISM_SEED", "42"), ("PRISM_PATHS", "8")].into_iter().chain(extra.iter().copied()).collect();
    common::net(&vars)
}

#[test]
fn gso_gro_and_the_plain_path_deliver_the_same_bytes() {
    // Sizes around one DATA packet's payload (8,832 bytes at MTU 9000), a few trains, and a message
    // with a short last packet.
    let sizes = [1usize, 8831, 8832, 8833, 100_000, (4 << 20) + 7];
    let mut delivered = Vec::new();
    // Payloads sent in place (an iovec per packet) and copied into the packet, each with GSO and GRO
    // on, off, and one of them on.
    for (gso, gro, copy) in [("1", "1", false), ("1", "1", true), ("0", "0", false), ("0", "0", true), ("1", "0", false), ("0", "1", false)]
    {
        let net = net(&[("PRISM_MTU", "9000"), ("PRISM_UDP_GSO", gso), ("PRISM_UDP_GRO", gro)]);
        let (mut s, mut r) = pair(&net);
        let mut got = Vec::new();
        for (k, &n) in sizes.iter().enumerate() {
            let data = pattern(100 + k as u64, n);
            let (sres, rres) = run_with(&mut s, &mut r, vec![(data.clone(), 5)], vec![vec![(n, 5)]], copy);
            assert_eq!(sres[0], Ok(n), "GSO {gso} GRO {gro}: size {n}");
            assert_eq!(rres[0].0, Ok(vec![n]), "GSO {gso} GRO {gro}: size {n}");
            assert!(rres[0].1[0] == data, "GSO {gso} GRO {gro}: the bytes of size {n} differ");
            got.push(rres[0].1[0].clone());
        }
        drop((s, r));
        let stats = net.stats_json();
        let rail = &stats["rails"][0];
        assert_eq!(rail["gso"], gso == "1", "GSO {gso}: {rail}");
        assert_eq!(rail["gro"], gro == "1", "GRO {gro}: {rail}");
        let trains = rail["gso_trains"].as_u64().unwrap();
        let in_trains = rail["gso_train_datagrams"].as_u64().unwrap();
        if gso == "1" {
            assert!(trains > 0 && in_trains >= 2 * trains, "GSO on: {trains} trains of {in_trains} datagrams");
        } else {
            assert_eq!((trains, in_trains), (0, 0), "GSO off sends no trains");
        }
        delivered.push(got);
    }
    assert!(delivered.windows(2).all(|w| w[0] == w[1]), "every path delivers the same bytes");
}
