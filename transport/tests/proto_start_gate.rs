//! Start times of sends (`Connection::hold_send`, `Connection::set_send_starts`): Ethereal's per-chunk
//! start jitter and the engine's batching window. Two connections over a lossless in-memory network
//! with a fixed delay and a virtual clock; the driver advances the clock to the earliest of the next
//! delivery and the connections' `poll_timeout`s, and fails if neither exists while work is
//! outstanding (a real driver would then sleep forever).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use prism_lb::path::Spray;
use prism_transport::proto::{Completion, Connection, Micros, MsgId, NoPlacement, PayloadSource, ProtoConfig, RecvSpec};
use prism_transport::wire::{DataPacket, DataRepr, Header, PacketType, MAX_HEADER_LEN};

const A: usize = 0;
const B: usize = 1;
const TOKENS: [u64; 2] = [0xa1, 0xb2];
const DELAY_US: Micros = 5;
/// Payload of a DATA packet (the default `max_payload`).
const PKT: u64 = 8192;

struct Zeros;

impl PayloadSource for Zeros {
    fn read(&mut self, _: MsgId, _: u64, out: &mut [u8]) {
        out.fill(0);
    }
}

/// One first transmission of a DATA packet by end A: (time handed over, message offset).
type Sent = (Micros, u64);

/// A datagram on its way: (arrival time, tie-break sequence, destination end, bytes).
type InTransit = (Micros, u64, usize, Vec<u8>);

struct Net {
    now: Micros,
    ends: [Connection; 2],
    queue: BinaryHeap<Reverse<InTransit>>,
    seq: u64,
    /// First transmissions of DATA by end A.
    data: Vec<Sent>,
    retransmissions: u64,
    /// Completed requests: (time, end, request).
    done: Vec<(Micros, usize, MsgId)>,
    buf: Vec<u8>,
}

impl Net {
    fn new() -> Self {
        let cfg = ProtoConfig::default();
        let end = |i: usize| Connection::new(cfg.clone(), TOKENS[i], TOKENS[1 - i], Box::new(Spray::new(i as u64 + 1)), 0);
        Self {
            now: 0,
            ends: [end(A), end(B)],
            queue: BinaryHeap::new(),
            seq: 0,
            data: Vec::new(),
            retransmissions: 0,
            done: Vec::new(),
            buf: vec![0; cfg.max_payload + MAX_HEADER_LEN],
        }
    }

    fn pump(&mut self) {
        for i in [A, B] {
            while let Some(t) = self.ends[i].poll_transmit(self.now, &mut Zeros, &mut self.buf) {
                let bytes = self.buf[..t.len].to_vec();
                if i == A && Header::new_checked(&bytes[..]).ok().and_then(|h| h.packet_type().ok()) == Some(PacketType::Data) {
                    let d = DataRepr::parse(&DataPacket::new_checked(&bytes[..]).unwrap()).unwrap();
                    if d.retx {
                        self.retransmissions += 1;
                    } else {
                        self.data.push((self.now, d.offset));
                    }
                }
                self.seq += 1;
                self.queue.push(Reverse((self.now + DELAY_US, self.seq, 1 - i, bytes)));
            }
            while let Some(c) = self.ends[i].poll_completion() {
                match c {
                    Completion::Sent { msg, .. } | Completion::Received { msg, .. } => self.done.push((self.now, i, msg)),
                    Completion::Failed { msg, error } => panic!("{msg:?} failed: {error}"),
                }
            }
        }
    }

    fn advance(&mut self, to: Micros) {
        self.now = self.now.max(to);
        while self.queue.peek().is_some_and(|Reverse(x)| x.0 <= self.now) {
            let Reverse((_, _, dst, bytes)) = self.queue.pop().unwrap();
            self.ends[dst].handle_datagram(&bytes, self.now, &mut NoPlacement);
        }
        for c in &mut self.ends {
            if c.poll_timeout().is_some_and(|t| t <= self.now) {
                c.handle_timeout(self.now);
            }
        }
    }

    fn next_event(&mut self) -> Option<Micros> {
        let timers: Vec<Micros> = self.ends.iter_mut().filter_map(|c| c.poll_timeout()).collect();
        self.queue.peek().map(|Reverse(x)| x.0).into_iter().chain(timers).min()
    }

    /// Drive until `n` requests completed, or until `until` when `n` is None; fails past `limit`.
    fn run(&mut self, n: Option<usize>, until: Micros, limit: Micros) {
        loop {
            self.pump();
            if n.is_some_and(|n| self.done.len() >= n) {
                return;
            }
            let next = self.next_event().unwrap_or_else(|| panic!("at {} µs nothing is pending: a driver would sleep forever", self.now));
            if n.is_none() && next > until {
                self.now = until;
                return;
            }
            assert!(next <= limit, "not done by {limit} µs (next event at {next} µs)");
            self.advance(next);
        }
    }
}

/// First transmission time of the packet at each offset.
fn first_sent(data: &[Sent]) -> BTreeMap<u64, Micros> {
    let mut m = BTreeMap::new();
    for &(t, off) in data {
        m.entry(off).or_insert(t);
    }
    m
}

#[test]
fn a_chunk_leaves_at_its_start_time_and_not_before_even_with_nothing_else_to_do() {
    // Four chunks of two packets; their start delays are not in offset order, and the receive is
    // posted first, so once the CTS is in nothing but the start times is pending.
    let chunk = 2 * PKT;
    let delays: [Micros; 4] = [30, 0, 250, 120];
    let mut net = Net::new();
    net.now = 1_000;
    net.ends[B].post_recv(&[RecvSpec { len: 4 * chunk, tag: 1 }], net.now).unwrap();
    let post = net.now;
    let msg = net.ends[A].post_send(4 * chunk, 1, post).unwrap();
    let starts: Vec<(u64, Micros)> = delays.iter().enumerate().map(|(k, d)| (k as u64 * chunk, post + d)).collect();
    net.ends[A].set_send_starts(msg, &starts);
    net.run(Some(2), 0, post + 100_000);
    assert_eq!(net.retransmissions, 0);
    let first = first_sent(&net.data);
    assert_eq!(first.len(), 8, "{first:?}");
    // Packets leave in offset order: a chunk goes at its start time, or right behind an earlier chunk
    // that started later (chunk 3, due at +120, follows chunk 2 at +250).
    let expect: [Micros; 4] = [30, 30, 250, 250];
    for (k, want) in expect.iter().enumerate() {
        for p in 0..2 {
            let off = k as u64 * chunk + p * PKT;
            let at = first[&off];
            assert!(at >= post + delays[k], "offset {off} left at {at}, before its start {}", post + delays[k]);
            assert_eq!(at, post + want, "offset {off} of chunk {k}");
        }
    }
    // Two packets waited: the first from the CTS (+5) to +30, chunk 2's first from +30 to +250.
    let g = net.ends[A].gate_stats();
    assert_eq!((g.held_sends, g.waited_pkts, g.waited_us), (0, 2, 25 + 220));
    // Without start times the same send leaves at once, when the CTS arrives (one delay later).
    let mut plain = Net::new();
    plain.now = 1_000;
    plain.ends[B].post_recv(&[RecvSpec { len: 4 * chunk, tag: 1 }], plain.now).unwrap();
    plain.ends[A].post_send(4 * chunk, 1, plain.now).unwrap();
    plain.run(Some(2), 0, 100_000);
    assert!(first_sent(&plain.data).values().all(|&t| t == 1_000 + DELAY_US), "{:?}", plain.data);
}

#[test]
fn a_held_send_and_the_sends_behind_it_wait_until_it_is_released() {
    let mut net = Net::new();
    net.ends[B].post_recv(&[RecvSpec { len: PKT, tag: 1 }, RecvSpec { len: PKT, tag: 2 }], 0).unwrap();
    let first = net.ends[A].post_send(PKT, 1, 0).unwrap();
    net.ends[A].hold_send(first);
    let second = net.ends[A].post_send(PKT, 2, 0).unwrap();
    // Held: nothing leaves for 5 ms (the CTS came long before; the driver does not hang meanwhile).
    net.run(None, 5_000, 5_000);
    assert!(net.data.is_empty(), "{:?}", net.data);
    assert!(net.done.is_empty());
    // Released with a start 40 µs ahead: both go then, in posting order, and complete in that order.
    net.ends[A].set_send_starts(first, &[(0, 5_040)]);
    net.run(Some(3), 0, 100_000);
    assert_eq!(net.data, vec![(5_040, 0), (5_040, 0)]);
    let g = net.ends[A].gate_stats();
    assert_eq!((g.held_sends, g.waited_pkts, g.waited_us), (1, 1, 5_040 - DELAY_US));
    let sent: Vec<MsgId> = net.done.iter().filter(|d| d.1 == A).map(|d| d.2).collect();
    assert_eq!(sent, vec![first, second]);
}

#[test]
fn start_times_already_passed_change_nothing() {
    let mut net = Net::new();
    net.now = 500;
    net.ends[B].post_recv(&[RecvSpec { len: 3 * PKT, tag: 1 }], 500).unwrap();
    let msg = net.ends[A].post_send(3 * PKT, 1, 500).unwrap();
    net.ends[A].hold_send(msg);
    net.ends[A].set_send_starts(msg, &[(0, 100), (PKT, 500)]);
    net.run(Some(2), 0, 100_000);
    assert!(net.data.iter().all(|d| d.0 == 500 + DELAY_US), "{:?}", net.data);
}
