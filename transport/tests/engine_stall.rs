//! Alive but stuck, end to end over loopback: a fake peer finishes the handshake, offers a buffer
//! (CTS) and answers every keepalive, but never acknowledges a DATA packet (as a path that carries
//! small control packets but not DATA would). The send's `test()` must fail with the stall error
//! within `PRISM_STALL_TIMEOUT_MS`, not wait forever; the peer timeout never fires because the peer
//! keeps answering.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prism_transport::engine::{Net, SendBuf, TransportConfig, HANDLE_LEN};
use prism_transport::wire::{ControlKind, ControlPacket, ControlRepr, CtsBuf, CtsPacket, CtsRepr, Header, PacketType};

const HELLO_LEN: usize = 144;

struct Zeros(usize);
impl SendBuf for Zeros {
    fn len(&self) -> usize {
        self.0
    }
    fn read(&self, _: usize, out: &mut [u8]) {
        out.fill(0);
    }
}

/// The fake peer: handshake by hand (layout in `wire/hello.rs`), then CTS and PONGs only. Returns
/// how many DATA packets and PINGs it got.
fn fake_peer(tcp: TcpListener, udp: UdpSocket, stop: Arc<AtomicBool>) -> (u64, u64) {
    let (mut s, _) = tcp.accept().unwrap();
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello).unwrap();
    let token = u64::from_be_bytes(hello[16..24].try_into().unwrap());
    let rail = SocketAddr::from(([hello[48], hello[49], hello[50], hello[51]], u16::from_be_bytes([hello[52], hello[53]])));
    let mut reply = [0u8; HELLO_LEN];
    reply[0..5].copy_from_slice(&hello[0..5]);
    reply[6] = 1;
    reply[8..16].copy_from_slice(&hello[8..16]);
    reply[16..24].copy_from_slice(&0x5eed_u64.to_be_bytes());
    reply[32..40].copy_from_slice(&hello[16..24]);
    reply[40] = 2;
    reply[44..48].copy_from_slice(&hello[44..48]);
    reply[48..52].copy_from_slice(&[127, 0, 0, 1]);
    reply[52..54].copy_from_slice(&udp.local_addr().unwrap().port().to_be_bytes());
    s.write_all(&reply).unwrap();

    let cts = CtsRepr::new(token, 0, 0, &[CtsBuf { size: 1 << 20, tag: 1 }]).unwrap();
    let mut cts_bytes = vec![0u8; cts.buffer_len()];
    cts.emit(&mut CtsPacket::new_unchecked(&mut cts_bytes[..]));
    udp.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let (mut data, mut pings) = (0, 0);
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        if data == 0 {
            // Until DATA comes, the CTS may have arrived before the comm existed: say it again.
            udp.send_to(&cts_bytes, rail).unwrap();
        }
        let Ok((n, from)) = udp.recv_from(&mut buf) else { continue };
        let Ok(h) = Header::new_checked(&buf[..n]) else { continue };
        match h.packet_type() {
            Ok(PacketType::Data) => data += 1,
            Ok(PacketType::Control) => {
                let Ok(c) = ControlPacket::new_checked(&buf[..n]).and_then(|p| ControlRepr::parse(&p)) else { continue };
                if c.kind == ControlKind::Ping {
                    pings += 1;
                    let pong = ControlRepr { token, cts_ack: 0, kind: ControlKind::Pong, entropy: c.entropy, ts_us: c.ts_us, cum_psn: 0 };
                    let mut out = vec![0u8; pong.buffer_len()];
                    pong.emit(&mut ControlPacket::new_unchecked(&mut out[..]));
                    udp.send_to(&out, from).unwrap();
                }
            }
            _ => {}
        }
    }
    (data, pings)
}

#[test]
fn a_peer_that_answers_keepalives_but_never_acknowledges_data_fails_the_send_within_the_stall_timeout() {
    let vars: BTreeMap<String, String> = [
        ("PRISM_IFNAMES", "lo"),
        ("PRISM_SEED", "42"),
        ("PRISM_PATHS", "2"),
        ("PRISM_STALL_TIMEOUT_MS", "500"),
        ("PRISM_PEER_TIMEOUT_MS", "10000"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let net = Net::new(TransportConfig::from_vars(&vars).unwrap(), prism_lb::LbConfig::default()).unwrap();
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut handle = [0u8; HANDLE_LEN];
    drop(net.listen(0, &mut handle).unwrap());
    handle[6..8].copy_from_slice(&tcp.local_addr().unwrap().port().to_be_bytes());
    let stop = Arc::new(AtomicBool::new(false));
    let peer = {
        let stop = stop.clone();
        std::thread::spawn(move || fake_peer(tcp, udp, stop))
    };
    let t0 = Instant::now();
    let mut s = loop {
        if let Some(c) = net.connect(0, &mut handle).unwrap() {
            break c;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "handshake with the fake peer did not finish");
    };
    // Timed from before the post: the CTS is already in, so `isend` itself sends the first DATA packet,
    // and the stall is measured from that packet (taken after `isend`, the clock started late: once
    // "failed after 499.55 ms" for a 500 ms bound).
    let t_post = Instant::now();
    let req = s.isend(Box::new(Zeros(64 << 10)), 1).unwrap().expect("room for the send");
    let res = loop {
        match s.test(req) {
            Ok(None) => {}
            other => break other,
        }
        assert!(t_post.elapsed() < Duration::from_secs(8), "the stuck send neither completed nor failed in 8 s");
        std::thread::sleep(Duration::from_millis(1));
    };
    let took = t_post.elapsed();
    stop.store(true, Ordering::Relaxed);
    let (data, pings) = peer.join().unwrap();
    let e = res.expect_err("the send cannot complete: nothing was acknowledged").to_string();
    assert!(e.contains("no progress for") && e.contains("while the peer was alive"), "{e}");
    assert!(took >= Duration::from_millis(500) && took < Duration::from_millis(3000), "failed after {took:?}: {e}");
    assert!(data > 0, "no DATA reached the fake peer: the CTS did not match the send");
    eprintln!("stuck send failed after {took:?} ({data} DATA packets, {pings} keepalives answered): {e}");
}
