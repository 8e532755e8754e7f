//! The stall watchdog and the receiver's byte accounting under a forged DATA packet: two
//! `proto::Connection`s on a deterministic in-memory network with a virtual clock. A connection
//! whose peer keeps answering but whose requests make no progress fails them within
//! `stall_timeout_us`; waiting for the peer to post, or a slow transfer that keeps moving, does not.
//!
//! The driver advances the clock to the earliest of the next delivery and both `poll_timeout`s and
//! fails if neither exists while requests are outstanding (a real driver would sleep forever).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use prism_lb::path::Spray;
use prism_transport::proto::{Completion, Connection, Micros, MsgError, MsgId, PayloadSource, Placer, ProtoConfig, RecvSpec};
use prism_transport::wire::{DataPacket, DataRepr, MAX_HEADER_LEN};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const A: usize = 0;
const B: usize = 1;
const TOKENS: [u64; 2] = [0x5e4d_0000_0000_00a1, 0x5e4d_0000_0000_00b2];
/// A whole number of 128-byte lines, as proto rounds every payload (NCCL LL/LL128).
const PAYLOAD: usize = 1024;
const STALL_US: Micros = 2_000_000;

fn pattern(off: u64) -> u8 {
    (off.wrapping_mul(0x9e37_79b9) >> 7) as u8 ^ off as u8
}

#[derive(Default)]
struct Source(BTreeMap<MsgId, u64>);
impl PayloadSource for Source {
    fn read(&mut self, msg: MsgId, offset: u64, out: &mut [u8]) {
        let len = self.0[&msg];
        assert!(offset + out.len() as u64 <= len);
        for (i, b) in out.iter_mut().enumerate() {
            *b = pattern(offset + i as u64);
        }
    }
}

#[derive(Default)]
struct Sink(BTreeMap<MsgId, Vec<u8>>);
impl Placer for Sink {
    fn place(&mut self, msg: MsgId, sub: usize, offset: u64, data: &[u8]) {
        assert_eq!(sub, 0);
        let buf = self.0.get_mut(&msg).expect("posted receive");
        buf[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }
}

/// A datagram on its way: (arrival time, tie-break sequence, destination end, bytes).
type InTransit = (Micros, u64, usize, Vec<u8>);

struct Sim {
    now: Micros,
    conns: [Connection; 2],
    src: Source,
    sink: Sink,
    done: [Vec<(Micros, Completion)>; 2],
    queue: BinaryHeap<Reverse<InTransit>>,
    seq: u64,
    loss: f64,
    rng: SmallRng,
    buf: Vec<u8>,
}

fn cfg() -> ProtoConfig {
    ProtoConfig { n_paths: 4, max_payload: PAYLOAD, stall_timeout_us: STALL_US, ..ProtoConfig::default() }
}

impl Sim {
    fn new(seed: u64, loss: f64) -> Self {
        Self::with_cfg(seed, loss, cfg())
    }

    fn with_cfg(seed: u64, loss: f64, cfg: ProtoConfig) -> Self {
        let conn = |i: usize| Connection::new(cfg.clone(), TOKENS[i], TOKENS[1 - i], Box::new(Spray::new(seed + i as u64)), 0);
        Self {
            now: 0,
            conns: [conn(A), conn(B)],
            src: Source::default(),
            sink: Sink::default(),
            done: [Vec::new(), Vec::new()],
            queue: BinaryHeap::new(),
            seq: 0,
            loss,
            rng: SmallRng::seed_from_u64(seed),
            buf: vec![0; PAYLOAD + MAX_HEADER_LEN],
        }
    }

    fn post_send(&mut self, len: u64) -> MsgId {
        let id = self.conns[A].post_send(len, 7, self.now).unwrap();
        self.src.0.insert(id, len);
        id
    }

    fn post_recv(&mut self, len: u64) -> MsgId {
        let id = self.conns[B].post_recv(&[RecvSpec { len, tag: 7 }], self.now).unwrap();
        self.sink.0.insert(id, vec![0; len as usize]);
        id
    }

    /// Put a datagram on the wire towards `to`, 10 µs away (lost with the sim's loss rate).
    fn deliver(&mut self, to: usize, bytes: Vec<u8>) {
        if self.loss > 0.0 && self.rng.gen_bool(self.loss) {
            return;
        }
        self.seq += 1;
        self.queue.push(Reverse((self.now + 10, self.seq, to, bytes)));
    }

    fn pump(&mut self) {
        for i in [A, B] {
            while let Some(t) = self.conns[i].poll_transmit(self.now, &mut self.src, &mut self.buf) {
                let bytes = self.buf[..t.len].to_vec();
                self.deliver(1 - i, bytes);
            }
            while let Some(c) = self.conns[i].poll_completion() {
                self.done[i].push((self.now, c));
            }
        }
    }

    /// Drive until `done` holds; panics past `limit` or if nothing is pending.
    fn run_until(&mut self, limit: Micros, mut done: impl FnMut(&Sim) -> bool) {
        loop {
            self.pump();
            if done(self) {
                return;
            }
            let timers = self.conns.iter_mut().filter_map(|c| c.poll_timeout());
            let next = self.queue.peek().map(|Reverse((at, ..))| *at).into_iter().chain(timers).min();
            let next = next.unwrap_or_else(|| panic!("at {} µs nothing is pending: a driver would sleep forever", self.now));
            assert!(next <= limit, "not done by {limit} µs (next event at {next} µs)");
            self.now = self.now.max(next);
            while self.queue.peek().is_some_and(|Reverse((at, ..))| *at <= self.now) {
                let Reverse((_, _, to, bytes)) = self.queue.pop().expect("peeked");
                if to == B {
                    self.conns[B].handle_datagram(&bytes, self.now, &mut self.sink);
                } else {
                    self.conns[A].handle_datagram(&bytes, self.now, &mut MustNotPlace);
                }
            }
            for c in &mut self.conns {
                if c.poll_timeout().is_some_and(|t| t <= self.now) {
                    c.handle_timeout(self.now);
                }
            }
        }
    }

    /// A DATA packet the sender never sent: right token, in-window PSN, claiming `len` bytes at
    /// `offset` of the first receive's message (of `total` bytes), payload 0xEE.
    fn forge(&mut self, psn: u64, offset: u64, len: u32, total: u64) {
        let repr = DataRepr {
            token: TOKENS[B],
            cts_ack: 0,
            psn,
            cts_seq: 0,
            sub: 0,
            offset,
            len,
            total_len: total,
            entropy: 0,
            ts_us: 0,
            trunc: false,
            ce: false,
            retx: false,
        };
        let mut bytes = vec![0xEE; repr.buffer_len()];
        repr.emit(&mut DataPacket::new_unchecked(&mut bytes[..]));
        self.conns[B].handle_datagram(&bytes, self.now, &mut self.sink);
    }
}

struct MustNotPlace;
impl Placer for MustNotPlace {
    fn place(&mut self, _: MsgId, _: usize, _: u64, _: &[u8]) {
        panic!("the sending end has no receive posted");
    }
}

fn stalled(c: &Completion) -> Option<(u64, &'static str)> {
    match c {
        Completion::Failed { error: MsgError::Stalled { stalled_ms, reason }, .. } => Some((*stalled_ms, reason)),
        _ => None,
    }
}

/// 20 packets of 1024 bytes.
const LEN: u64 = 20 * PAYLOAD as u64;

#[test]
fn forged_data_ahead_of_the_sender_fails_the_send_within_the_stall_timeout() {
    // The forged packet takes PSN 20 (one past the message, not sent yet) and claims the message's
    // first 1024 bytes before the real ones arrive. Before the fix the receiver counted those bytes
    // twice, completed the message with its last packet missing, refused that packet (PSN 19) for a
    // receive no longer outstanding, and the sender retransmitted PSN 19 forever while keepalives kept
    // the peer timeout away. Now the real first packet is refused as overlapping, the sender's oldest
    // packet stays unacknowledged, and the watchdog fails the send.
    let mut sim = Sim::new(1, 0.0);
    let recv = sim.post_recv(LEN);
    let send = sim.post_send(LEN);
    sim.forge(20, 0, PAYLOAD as u32, LEN);
    sim.run_until(4 * STALL_US, |s| !s.done[A].is_empty() && !s.done[B].is_empty());
    let (t, c) = &sim.done[A][0];
    let (ms, reason) = stalled(c).unwrap_or_else(|| panic!("send completed {c:?}, expected a stall error"));
    assert!(matches!(c, Completion::Failed { msg, .. } if *msg == send));
    assert!(*t >= STALL_US && *t <= STALL_US + 500_000, "the send failed at {t} µs, bound {STALL_US} µs");
    assert!(ms >= STALL_US / 1000 && reason.contains("unacknowledged"), "{c:?}");
    let Completion::Failed { error, .. } = c else { unreachable!("checked above") };
    assert_eq!(error.to_string(), format!("no progress for {ms} ms while the peer was alive: DATA sent to the peer stays unacknowledged"));
    // The forged bytes cover exactly the real first packet's range, so the receive is complete, with
    // the forged bytes in it (without authentication they cannot be told apart); every other byte is
    // the sender's.
    let (_, rc) = &sim.done[B][0];
    assert!(matches!(rc, Completion::Received { msg, .. } if *msg == recv), "{rc:?}");
    let buf = &sim.sink.0[&recv];
    assert!(buf[..PAYLOAD].iter().all(|&b| b == 0xEE));
    assert!((PAYLOAD..LEN as usize).all(|o| buf[o] == pattern(o as u64)), "a real byte is missing or wrong");
    assert!(sim.conns[B].stats().dropped.overlapping >= 1);
}

#[test]
fn forged_partial_data_fails_both_ends_within_the_stall_timeout() {
    // Half a packet forged ahead of the real one: the receive can never be completed by the real
    // sender (its first packet overlaps the forged bytes), so both ends fail instead of waiting.
    let mut sim = Sim::new(2, 0.0);
    let recv = sim.post_recv(LEN);
    sim.post_send(LEN);
    sim.forge(20, 0, PAYLOAD as u32 / 2, LEN);
    sim.run_until(4 * STALL_US, |s| !s.done[A].is_empty() && !s.done[B].is_empty());
    for end in [A, B] {
        let (t, c) = &sim.done[end][0];
        assert!(stalled(c).is_some(), "end {end}: {c:?}");
        assert!(*t >= STALL_US && *t <= STALL_US + 500_000, "end {end} failed at {t} µs, bound {STALL_US} µs");
    }
    let (_, rc) = &sim.done[B][0];
    assert!(
        matches!(rc, Completion::Failed { msg, error: MsgError::Stalled { reason, .. } } if *msg == recv && reason.contains("receive")),
        "{rc:?}"
    );
}

#[test]
fn forged_data_after_the_real_bytes_is_refused_and_the_transfer_completes() {
    // The same forged packet arriving once the real first packet is in: refused as overlapping, its
    // PSN stays free, and the next message (which uses PSN 20) arrives intact. A window of 4 packets
    // leaves the first receive half filled when the forged packet comes.
    let mut sim = Sim::with_cfg(3, 0.0, ProtoConfig { window_pkts: 4, ..cfg() });
    let first = sim.post_recv(LEN);
    sim.post_send(LEN);
    sim.run_until(STALL_US, |s| s.conns[B].stats().data_bytes_placed >= PAYLOAD as u64);
    sim.forge(20, 0, PAYLOAD as u32, LEN);
    let second = sim.post_recv(LEN);
    sim.post_send(LEN);
    sim.run_until(4 * STALL_US, |s| s.done[A].len() == 2 && s.done[B].len() == 2);
    for (_, c) in sim.done[A].iter().chain(&sim.done[B]) {
        assert!(!matches!(c, Completion::Failed { .. }), "{c:?}");
    }
    for id in [first, second] {
        assert!((0..LEN as usize).all(|o| sim.sink.0[&id][o] == pattern(o as u64)), "receive {id:?} has wrong bytes");
    }
    assert_eq!(sim.conns[B].stats().dropped.overlapping, 1);
}

#[test]
fn a_send_whose_receive_is_posted_long_after_the_stall_timeout_still_succeeds() {
    let mut sim = Sim::new(4, 0.0);
    sim.post_send(LEN);
    let late = 5 * STALL_US;
    sim.run_until(late, |s| s.now >= late - 200_000);
    assert!(sim.done[A].is_empty(), "{:?}", sim.done[A]);
    sim.post_recv(LEN);
    sim.run_until(late + STALL_US, |s| !s.done[A].is_empty() && !s.done[B].is_empty());
    assert!(matches!(sim.done[A][0].1, Completion::Sent { .. }), "{:?}", sim.done[A]);
    assert!(matches!(sim.done[B][0].1, Completion::Received { .. }), "{:?}", sim.done[B]);
}

#[test]
fn a_receive_whose_send_is_posted_long_after_the_stall_timeout_still_succeeds() {
    let mut sim = Sim::new(5, 0.0);
    sim.post_recv(LEN);
    let late = 5 * STALL_US;
    sim.run_until(late, |s| s.now >= late - 200_000);
    assert!(sim.done[B].is_empty(), "{:?}", sim.done[B]);
    sim.post_send(LEN);
    sim.run_until(late + STALL_US, |s| !s.done[A].is_empty() && !s.done[B].is_empty());
    assert!(matches!(sim.done[A][0].1, Completion::Sent { .. }), "{:?}", sim.done[A]);
    assert!(matches!(sim.done[B][0].1, Completion::Received { .. }), "{:?}", sim.done[B]);
}

#[test]
fn heavy_loss_slows_a_transfer_without_tripping_the_watchdog() {
    // 30% of all packets lost both ways: many retransmissions (and some timeouts), but the oldest
    // packet keeps getting through, so messages go on for far longer than the stall timeout and none
    // fails.
    let mut sim = Sim::new(6, 0.3);
    let mut n = 0;
    while sim.now <= 2 * STALL_US {
        n += 1;
        assert!(n <= 50_000, "50,000 messages took only {} µs", sim.now);
        sim.post_recv(LEN);
        sim.post_send(LEN);
        let k = sim.done[A].len();
        sim.run_until(sim.now + 10 * STALL_US, |s| s.done[A].len() > k && s.done[B].len() > k);
    }
    for (_, c) in sim.done[A].iter().chain(&sim.done[B]) {
        assert!(!matches!(c, Completion::Failed { .. }), "{c:?}");
    }
    let st = sim.conns[A].stats();
    assert!(st.retransmissions > 1000 && st.timeouts > 10, "{} retransmissions, {} timeouts", st.retransmissions, st.timeouts);
}
