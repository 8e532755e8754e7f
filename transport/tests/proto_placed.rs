//! `Connection::handle_placed_data`: the verbs backend's entry point for DATA whose payload an RDMA
//! WRITE already put into the posted buffer. The test plays the network: it copies each DATA packet's
//! payload into the receiver's buffer itself (the "WRITE") and hands the receiver only the 64-byte
//! header, as the verbs backend does.

use prism_lb::path::Spray;
use prism_transport::proto::{Completion, Connection, MsgId, PayloadSource, Placer, ProtoConfig, RecvSpec};
use prism_transport::wire::{DataPacket, DataRepr, Header, PacketType, DATA_HEADER_LEN};

const TA: u64 = 0xa1;
const TB: u64 = 0xb2;

struct Source(Vec<u8>);
impl PayloadSource for Source {
    fn read(&mut self, _: MsgId, offset: u64, out: &mut [u8]) {
        out.copy_from_slice(&self.0[offset as usize..offset as usize + out.len()]);
    }
}

/// The receiver must never be asked to copy anything on the placed path.
struct NoCopy;
impl Placer for NoCopy {
    fn place(&mut self, _: MsgId, _: usize, _: u64, _: &[u8]) {
        panic!("placed data must not go through the Placer");
    }
}

fn cfg() -> ProtoConfig {
    ProtoConfig { n_paths: 4, max_payload: 1000, ..ProtoConfig::default() }
}

fn pair() -> (Connection, Connection) {
    let a = Connection::new(cfg(), TA, TB, Box::new(Spray::new(1)), 0);
    let b = Connection::new(cfg(), TB, TA, Box::new(Spray::new(2)), 0);
    (a, b)
}

/// Everything `from` wants to send: (bytes, is_data).
fn drain(from: &mut Connection, src: &mut Source, now: u64) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; DATA_HEADER_LEN + 1000];
    while let Some(t) = from.poll_transmit(now, src, &mut buf) {
        out.push(buf[..t.len].to_vec());
    }
    out
}

fn is_data(p: &[u8]) -> bool {
    Header::new_checked(p).ok().and_then(|h| h.packet_type().ok()) == Some(PacketType::Data)
}

/// Run sender `a` (message `msg`) against receiver `b` whose buffer is `rbuf`; DATA goes through
/// `deliver_data`, which may "write" and then calls handle_placed_data (or not).
fn exchange(a: &mut Connection, b: &mut Connection, msg: &[u8], mut deliver_data: impl FnMut(&mut Connection, &[u8], u64)) {
    let mut src = Source(msg.to_vec());
    let mut empty = Source(Vec::new());
    for round in 0..200u64 {
        let now = 1_000 + round * 100;
        for p in drain(b, &mut empty, now) {
            a.handle_datagram(&p, now, &mut NoCopy);
        }
        for p in drain(a, &mut src, now) {
            if is_data(&p) {
                deliver_data(b, &p, now);
            } else {
                b.handle_datagram(&p, now, &mut NoCopy);
            }
        }
        a.handle_timeout(now);
        b.handle_timeout(now);
    }
}

#[test]
fn placed_headers_complete_a_receive_without_copying() {
    let (mut a, mut b) = pair();
    let msg: Vec<u8> = (0..4500u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut rbuf = vec![0u8; 5000];
    let r = b.post_recv(&[RecvSpec { len: 5000, tag: 9 }], 0).unwrap();
    let s = a.post_send(msg.len() as u64, 9, 0).unwrap();
    exchange(&mut a, &mut b, &msg, |b, p, now| {
        let d = DataRepr::parse(&DataPacket::new_checked(p).unwrap()).unwrap();
        // The "RDMA WRITE": payload straight into the buffer, then only the header to proto.
        rbuf[d.offset as usize..d.offset as usize + d.len as usize].copy_from_slice(&p[DATA_HEADER_LEN..]);
        b.handle_placed_data(&p[..DATA_HEADER_LEN], now);
    });
    let mut got_recv = false;
    while let Some(c) = b.poll_completion() {
        if let Completion::Received { msg: m, sizes } = c {
            assert_eq!(m, r);
            assert_eq!(sizes, vec![4500]);
            got_recv = true;
        }
    }
    assert!(got_recv, "the receive did not complete");
    assert!(matches!(a.poll_completion(), Some(Completion::Sent { msg, len: 4500 }) if msg == s));
    assert_eq!(&rbuf[..4500], &msg[..]);
    assert_eq!(b.stats().data_bytes_placed, 4500);
    assert_eq!(b.stats().dropped.total(), 0);
}

#[test]
fn a_placed_header_outside_the_posted_buffer_is_dropped_and_counted() {
    let (mut a, mut b) = pair();
    b.post_recv(&[RecvSpec { len: 3000, tag: 1 }], 0).unwrap();
    a.post_send(2500, 1, 0).unwrap();
    let msg = vec![1u8; 2500];
    let mut forged = 0;
    exchange(&mut a, &mut b, &msg, |b, p, now| {
        let mut d = DataRepr::parse(&DataPacket::new_checked(p).unwrap()).unwrap();
        // A forged header: same PSN, but claims bytes past the posted size.
        d.offset = 2900;
        d.total_len = 3100;
        let mut h = vec![0u8; d.buffer_len()];
        d.emit(&mut DataPacket::new_unchecked(&mut h[..]));
        b.handle_placed_data(&h[..DATA_HEADER_LEN], now);
        forged += 1;
    });
    assert!(forged > 0);
    assert!(b.stats().dropped.bad_offset_len >= 1);
    assert_eq!(b.stats().data_bytes_placed, 0);
    assert!(b.poll_completion().is_none());
}

#[test]
fn only_bare_data_headers_are_accepted_as_placed() {
    let (mut a, mut b) = pair();
    b.post_recv(&[RecvSpec { len: 3000, tag: 1 }], 0).unwrap();
    a.post_send(500, 1, 0).unwrap();
    let msg = vec![2u8; 500];
    let mut calls = 0;
    let mut cts = None;
    exchange(&mut a, &mut b, &msg, |b, p, now| {
        // The whole datagram (header + payload) is not a bare header.
        b.handle_placed_data(p, now);
        calls += 1;
    });
    assert!(calls > 0);
    assert_eq!(b.stats().data_bytes_placed, 0);
    let trailing = b.stats().dropped.total();
    assert!(trailing >= 1, "{trailing}");
    // A CTS handed to the placed path is dropped too.
    let mut empty = Source(Vec::new());
    let (mut c, mut d) = pair();
    d.post_recv(&[RecvSpec { len: 10, tag: 0 }], 0).unwrap();
    for p in drain(&mut d, &mut empty, 10) {
        cts = Some(p);
    }
    let before = c.stats().dropped.total();
    c.handle_placed_data(&cts.expect("a CTS"), 20);
    assert_eq!(c.stats().dropped.total(), before + 1);
}

#[test]
fn a_duplicate_placed_header_is_counted_once() {
    let (mut a, mut b) = pair();
    b.post_recv(&[RecvSpec { len: 800, tag: 4 }], 0).unwrap();
    a.post_send(800, 4, 0).unwrap();
    let msg = vec![3u8; 800];
    exchange(&mut a, &mut b, &msg, |b, p, now| {
        b.handle_placed_data(&p[..DATA_HEADER_LEN], now);
        b.handle_placed_data(&p[..DATA_HEADER_LEN], now);
    });
    assert_eq!(b.stats().data_bytes_placed, 800);
    assert!(b.stats().duplicates >= 1);
    assert!(matches!(b.poll_completion(), Some(Completion::Received { .. })));
}

/// Run one 4,500-byte message through `deliver` (the receiver's side of each DATA packet, its header
/// rebuilt without a timestamp) and return the sender's RTT samples: (count, largest µs).
fn rtt_with_rebuilt_headers(deliver: impl Fn(&mut Connection, &[u8], u64)) -> (u64, u64, bool) {
    let (mut a, mut b) = pair();
    let msg: Vec<u8> = (0..4500u32).map(|i| i as u8).collect();
    b.post_recv(&[RecvSpec { len: 5000, tag: 3 }], 0).unwrap();
    a.post_send(msg.len() as u64, 3, 0).unwrap();
    exchange(&mut a, &mut b, &msg, |b, p, now| {
        let d = DataRepr::parse(&DataPacket::new_checked(p).unwrap()).unwrap();
        // What the verbs backend rebuilds from a descriptor and an immediate: no send timestamp.
        let r = DataRepr { ts_us: 0, ..d };
        let mut h = vec![0u8; DATA_HEADER_LEN];
        r.emit(&mut DataPacket::new_unchecked(&mut h[..]));
        deliver(b, &h, now);
    });
    let received = std::iter::from_fn(|| b.poll_completion()).any(|c| matches!(c, Completion::Received { .. }));
    let samples = a.stats().paths.iter().map(|p| p.rtt_samples).sum();
    let max = a.stats().paths.iter().map(|p| p.rtt_max_us).max().unwrap_or(0);
    (samples, max, received)
}

/// A rebuilt header has no send timestamp: its SACK echoes the PSN and the sender looks the send
/// time up, so RTT samples stay true (the exchange's rounds are 100 µs apart). Given as an ordinary
/// placed header, the zero timestamp would be echoed and taken for a send time (an RTT of the whole
/// clock), which is what the PSN echo prevents.
#[test]
fn rebuilt_headers_echo_their_psn_and_rtt_samples_stay_true() {
    let (samples, max, received) = rtt_with_rebuilt_headers(|b, h, now| b.handle_rebuilt_data(h, now));
    assert!(received, "the receive did not complete");
    assert!(samples > 0, "no RTT sample from an echo by PSN");
    assert!(max <= 1_000, "RTT sample {max} µs from an echo by PSN");
    let (samples, max, _) = rtt_with_rebuilt_headers(|b, h, now| b.handle_placed_data(h, now));
    assert!(samples > 0 && max > 1_000, "the zero timestamp echoed as such gives a false sample ({samples}, {max} µs)");
}
