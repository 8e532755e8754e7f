//! NCCL's LL/LL128 readers trust a line of the receive buffer once its flags are new, so a packet
//! boundary inside a line can show a line half new, half old (packets sprayed over many paths land
//! out of order). Every DATA packet proto sends must start at a multiple of `wire::LINE_BYTES` of its
//! buffer and carry a multiple of it, except the buffer's last packet: checked here for many payload
//! sizes (MTU-derived ones that are not whole lines among them), transmit buffer sizes and message
//! sizes, with reordering and losses so that retransmissions are checked too.

use prism_lb::path::Spray;
use prism_transport::proto::{Completion, Connection, MsgId, PayloadSource, Placer, ProtoConfig, RecvSpec};
use prism_transport::wire::{DataPacket, DataRepr, Header, PacketType, DATA_HEADER_LEN, LINE_BYTES};

const TA: u64 = 0x11;
const TB: u64 = 0x22;

fn byte(msg: u64, off: u64) -> u8 {
    (off.wrapping_mul(31) ^ msg.wrapping_mul(7) ^ (off >> 8)) as u8
}

/// Sends of message id `k` hold `byte(k, off)`.
struct Source;
impl PayloadSource for Source {
    fn read(&mut self, msg: MsgId, offset: u64, out: &mut [u8]) {
        for (i, b) in out.iter_mut().enumerate() {
            *b = byte(msg.0, offset + i as u64);
        }
    }
}

struct Bufs(Vec<Vec<u8>>);
impl Placer for Bufs {
    fn place(&mut self, _: MsgId, sub: usize, offset: u64, data: &[u8]) {
        self.0[sub][offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }
}

/// Checks one DATA packet against the line rule; returns it parsed.
fn check_lines(p: &[u8], what: &str) -> Option<DataRepr> {
    if Header::new_checked(p).ok().and_then(|h| h.packet_type().ok()) != Some(PacketType::Data) {
        return None;
    }
    let d = DataRepr::parse(&DataPacket::new_checked(p).unwrap()).unwrap();
    let line = LINE_BYTES as u64;
    assert_eq!(d.offset % line, 0, "{what}: packet at offset {} (len {}, total {})", d.offset, d.len, d.total_len);
    let last = d.offset + u64::from(d.len) == d.total_len;
    assert!(last || u64::from(d.len) % line == 0, "{what}: interior packet of {} bytes at {} (total {})", d.len, d.offset, d.total_len);
    Some(d)
}

/// One message of `len` bytes (one buffer), or two messages into a grouped receive of two buffers,
/// from `a` to `b`: every DATA packet is checked, in-flight DATA is delivered in reverse order each
/// round and every 5th first transmission is dropped. Returns the DATA packets seen.
fn run(max_payload: usize, room: usize, lens: &[u64]) -> usize {
    let what = format!("max_payload {max_payload}, room {room}, lens {lens:?}");
    let cfg = ProtoConfig { n_paths: 16, max_payload, ..ProtoConfig::default() };
    let mut a = Connection::new(cfg.clone(), TA, TB, Box::new(Spray::new(5)), 0);
    let mut b = Connection::new(cfg, TB, TA, Box::new(Spray::new(6)), 0);
    let specs: Vec<RecvSpec> = (0..lens.len()).map(|i| RecvSpec { len: lens[i] + 300, tag: i as i32 }).collect();
    let r = b.post_recv(&specs, 0).unwrap();
    let sends: Vec<MsgId> = lens.iter().enumerate().map(|(i, &l)| a.post_send(l, i as i32, 0).unwrap()).collect();
    let mut bufs = Bufs(lens.iter().map(|&l| vec![0u8; l as usize + 300]).collect());
    let mut out = vec![0u8; DATA_HEADER_LEN + room];
    let (mut seen, mut firsts) = (0usize, 0u64);
    let mut received = None;
    let mut sent = 0;
    for round in 0..20_000u64 {
        let now = 1_000 + round * 200;
        while let Some(t) = b.poll_transmit(now, &mut Source, &mut out) {
            a.handle_datagram(&out[..t.len], now, &mut Bufs(Vec::new()));
        }
        let mut data = Vec::new();
        while let Some(t) = a.poll_transmit(now, &mut Source, &mut out) {
            let p = out[..t.len].to_vec();
            match check_lines(&p, &what) {
                Some(d) => {
                    seen += 1;
                    if !d.retx {
                        firsts += 1;
                        if firsts % 5 == 0 {
                            continue;
                        }
                    }
                    data.push(p);
                }
                None => b.handle_datagram(&p, now, &mut bufs),
            }
        }
        for p in data.iter().rev() {
            b.handle_datagram(p, now, &mut bufs);
        }
        a.handle_timeout(now);
        b.handle_timeout(now);
        while let Some(c) = a.poll_completion() {
            assert!(matches!(c, Completion::Sent { .. }), "{what}: {c:?}");
            sent += 1;
        }
        if let Some(c) = b.poll_completion() {
            received = Some(c);
        }
        if sent == lens.len() && received.is_some() {
            break;
        }
    }
    assert_eq!(sent, lens.len(), "{what}: sends did not complete");
    match received {
        Some(Completion::Received { msg, sizes }) => {
            assert_eq!(msg, r);
            assert_eq!(sizes, lens.to_vec(), "{what}");
        }
        other => panic!("{what}: receive did not complete: {other:?}"),
    }
    for (i, &l) in lens.iter().enumerate() {
        for off in 0..l {
            assert_eq!(bufs.0[i][off as usize], byte(sends[i].0, off), "{what}: buffer {i} byte {off}");
        }
    }
    seen
}

#[test]
fn every_packet_boundary_falls_on_a_line_for_many_payload_and_message_sizes() {
    // UDP payloads at MTU 576, 1500, 4200, 9000 (minus IP/UDP and Prism headers), verbs chunk sizes,
    // and sizes that are not whole lines.
    let payloads = [100, 128, 129, 484, 1000, 1408, 4108, 8908, 8832, 9000, 16_384, 65_536];
    let lens = [1u64, 127, 128, 129, 1000, 4500, 8908, 65_536, 100_003];
    let mut total = 0;
    for &p in &payloads {
        // A transmit buffer exactly as large as the payload, and one smaller than it (not whole lines);
        // never below one line, which proto needs to send anything at all.
        for room in [p.max(LINE_BYTES), p.clamp(LINE_BYTES, 3001)] {
            for &l in &lens {
                total += run(p, room, &[l]);
            }
        }
        total += run(p, p.max(LINE_BYTES), &[70_001, 12_345]);
    }
    assert!(total > 1000, "only {total} DATA packets checked");
}

#[test]
fn the_mtu_9000_payload_is_cut_to_whole_lines() {
    // 8,908 payload bytes fit a 9000-byte datagram; 8,832 are used: 64 KiB = 7 × 8,832 + 3,712.
    let cfg = ProtoConfig { n_paths: 1, max_payload: 8908, ..ProtoConfig::default() };
    let mut a = Connection::new(cfg.clone(), TA, TB, Box::new(Spray::new(1)), 0);
    let mut b = Connection::new(cfg, TB, TA, Box::new(Spray::new(2)), 0);
    b.post_recv(&[RecvSpec { len: 65_536, tag: 0 }], 0).unwrap();
    a.post_send(65_536, 0, 0).unwrap();
    let mut out = vec![0u8; DATA_HEADER_LEN + 8908];
    let mut bufs = Bufs(vec![vec![0u8; 65_536]]);
    while let Some(t) = b.poll_transmit(0, &mut Source, &mut out) {
        a.handle_datagram(&out[..t.len], 0, &mut Bufs(Vec::new()));
    }
    let mut lens = Vec::new();
    while let Some(t) = a.poll_transmit(0, &mut Source, &mut out) {
        let p = out[..t.len].to_vec();
        if let Some(d) = check_lines(&p, "mtu 9000") {
            lens.push((d.offset, d.len));
        }
        b.handle_datagram(&p, 0, &mut bufs);
    }
    let want: Vec<(u64, u32)> = (0..7).map(|k| (k * 8832, 8832)).chain([(7 * 8832, 3712)]).collect();
    assert_eq!(lens, want);
}
