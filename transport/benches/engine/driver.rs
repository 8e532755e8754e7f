//! The engine benchmark's driver: a sender and a receiver `proto::Connection` moving a stream of
//! messages to each other over an in-memory, lossless "wire", in one thread, with the work a backend
//! adds per packet on each shape of packet. Shared by the benchmark (`main.rs`) and its test
//! (`tests/engine_bench.rs`), which runs it small and checks the bytes.
//!
//! What one run does: end A posts `depth` sends of `msg` bytes at a time, end B as many receives;
//! each round A writes up to [`BATCH`] packets (the engine's UDP batch) into its transmit buffers, B
//! takes them all, then B's answers (CTS, SACK) go to A the same way; expired timers run; completions
//! are collected and new messages posted, until `total` bytes were received and acknowledged. The
//! clock is virtual: each round advances it by the time its bytes take on a 400 Gbit/s NIC, so RTT
//! samples and delayed SACKs behave as on a fast link and nothing ever times out.
//!
//! Per shape, what is done per DATA packet (besides proto's own work at both ends):
//! - **verbs**: 64 KiB packets. The sender's payload source only records which bytes proto wanted (the
//!   NIC reads them from the send buffer); the receiver gets the 64-byte header through
//!   `handle_placed_data` (the NIC already wrote the payload). No byte of payload is touched by the CPU.
//! - **udp**: packets of 8,832 payload bytes (MTU 9000 less IP, UDP and Prism headers, whole lines).
//!   The sender's payload stays in place (the engine sends header and payload as two iovecs; the kernel
//!   copies them); the receiver's placer copies the payload into the posted buffer (the engine's one
//!   copy). The kernel's copies and system calls are not here: `scripts/bench-udp`'s pump measures them.
//!
//! The "wire copy" (the NIC's DMA for verbs, the kernel's send copy for UDP) is CPU work of neither
//! engine, so timed runs skip it: the receiver then "receives" whatever the transmit buffer held. With
//! `verify` the wire copy is done, every message carries its own pattern, every receive buffer is
//! cleared before it is posted and compared after it completes; that proves the driver really moves
//! the bytes it times. Every run, verified or not, checks that each message completed at both ends,
//! that B placed exactly the bytes A sent, and that nothing was retransmitted or dropped.

use std::time::{Duration, Instant};

use nix::time::{clock_gettime, ClockId};
use prism_lb::path::Spray;
use prism_transport::proto::{Completion, Connection, MsgId, NoPlacement, PayloadSource, Placer, ProtoConfig, RecvSpec};
use prism_transport::wire::{DataPacket, DataRepr, Header, PacketType, DATA_HEADER_LEN, LINE_BYTES, MAX_HEADER_LEN};

/// The unit the result is given in: one 64 KiB chunk of data.
pub const CHUNK: u64 = 64 << 10;
/// The NIC the result is scaled to.
pub const NIC_BITS_PER_S: f64 = 400e9;
/// Most packets one end writes before the other end takes them (the engine's UDP batch).
pub const BATCH: usize = 64;
/// Transmit buffer of the receiving end (CTS, SACK and control packets only).
const RX_END_TXBUF: usize = 4096;
const TOKEN_A: u64 = 0x00be_4c00_0000_00a1;
const TOKEN_B: u64 = 0x00be_4c00_0000_00b2;
/// Rounds without any packet, completion or expired timer before the run is declared stuck.
const MAX_IDLE_ROUNDS: u32 = 1000;

/// The packets the engine's backends send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// 64 KiB DATA packets, payload placed by the NIC, no copy.
    Verbs,
    /// MTU-9000 datagrams, payload copied once into the receive buffer.
    Udp,
}

impl Shape {
    /// Payload bytes per DATA packet.
    pub fn payload(self) -> usize {
        match self {
            Shape::Verbs => 64 << 10,
            Shape::Udp => {
                // As the engine computes it: MTU 9000 less IP (20) and UDP (8), less Prism's largest
                // header, rounded down to whole lines.
                let p = 9000 - 28 - MAX_HEADER_LEN;
                p - p % LINE_BYTES
            }
        }
    }

    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Verbs => "verbs",
            Shape::Udp => "udp",
        }
    }

    /// What the backend does with the payload, for tables.
    pub fn what(self) -> &'static str {
        match self {
            Shape::Verbs => "no copy",
            Shape::Udp => "1 copy (rx)",
        }
    }
}

/// One run's parameters.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Packet shape.
    pub shape: Shape,
    /// Bytes to move (rounded down to whole messages; at least one message).
    pub total: u64,
    /// Bytes per message (one NCCL isend/irecv).
    pub msg: usize,
    /// Messages outstanding per end (NCCL keeps up to 8 steps in flight).
    pub depth: usize,
    /// Do the wire copy and check every received byte (see the module docs).
    pub verify: bool,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The parameters.
    pub params: Params,
    /// Messages moved.
    pub msgs: u64,
    /// Payload bytes moved (sent, acknowledged and received).
    pub bytes: u64,
    /// DATA packets A sent.
    pub data_pkts: u64,
    /// Other packets, both directions (CTS, SACK, control).
    pub other_pkts: u64,
    /// Messages whose bytes were compared (0 unless `verify`).
    pub checked_msgs: u64,
    /// This thread's CPU time over the run (wall time where the thread clock is missing).
    pub cpu: Duration,
    /// False when `cpu` is wall time.
    pub thread_clock: bool,
}

impl Outcome {
    /// CPU nanoseconds per 64 KiB of data, both ends together.
    pub fn ns_per_chunk(&self) -> f64 {
        self.cpu.as_nanos() as f64 * CHUNK as f64 / self.bytes as f64
    }

    /// CPU nanoseconds per DATA packet, both ends together (its share of control packets included).
    pub fn ns_per_packet(&self) -> f64 {
        self.cpu.as_nanos() as f64 / self.data_pkts as f64
    }

    /// Cores both ends need to keep a 400 Gbit/s NIC busy in one direction.
    pub fn cores_per_nic(&self) -> f64 {
        self.ns_per_chunk() * (NIC_BITS_PER_S / 8.0 / CHUNK as f64) / 1e9
    }

    /// Data moved per second of this thread's CPU time, in Gbit/s.
    pub fn gbit_per_cpu_s(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.cpu.as_secs_f64() / 1e9
    }
}

/// CPU time this thread has run, if the clock is available.
pub fn thread_cpu() -> Option<Duration> {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).ok().map(Duration::from)
}

/// Content of byte `off` of message `k` (differs between neighbouring offsets, lines and messages).
fn pattern(k: u64, off: usize) -> u8 {
    let x = (k.wrapping_add(1)).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((off >> 7) as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    ((x >> 32) as u8) ^ (off as u8)
}

/// One posted message: its proto id, its slot (buffer) and its index in the stream.
#[derive(Clone, Copy)]
struct Posted {
    id: MsgId,
    slot: usize,
    k: u64,
}

/// Buffers of one end, a slot per outstanding message.
struct Slots {
    bufs: Vec<Vec<u8>>,
    free: Vec<usize>,
    posted: Vec<Posted>,
}

impl Slots {
    fn new(depth: usize, len: usize, fill: u8) -> Self {
        Self { bufs: (0..depth).map(|_| vec![fill; len]).collect(), free: (0..depth).rev().collect(), posted: Vec::with_capacity(depth) }
    }

    fn find(&self, id: MsgId) -> Option<Posted> {
        self.posted.iter().find(|p| p.id == id).copied()
    }

    fn done(&mut self, id: MsgId) -> Posted {
        let i = self.posted.iter().position(|p| p.id == id).unwrap_or_else(|| panic!("completion of unknown message {id:?}"));
        let p = self.posted.swap_remove(i);
        self.free.push(p.slot);
        p
    }
}

/// The payload proto wanted for one packet: (send, offset, length).
type Read = (MsgId, u64, usize);

/// Sender payload when the bytes stay in place: note what proto asked for, copy nothing.
#[derive(Default)]
struct InPlace {
    last: Option<Read>,
}

impl PayloadSource for InPlace {
    fn read(&mut self, msg: MsgId, offset: u64, out: &mut [u8]) {
        self.last = Some((msg, offset, out.len()));
    }
}

/// Receiver placement by copy, into the slot of the posted receive.
struct CopyInto<'a>(&'a mut Slots);

impl Placer for CopyInto<'_> {
    fn place(&mut self, msg: MsgId, sub: usize, offset: u64, data: &[u8]) {
        assert_eq!(sub, 0, "one buffer per receive");
        let p = self.0.find(msg).unwrap_or_else(|| panic!("placement into unknown receive {msg:?}"));
        let off = offset as usize;
        self.0.bufs[p.slot][off..off + data.len()].copy_from_slice(data);
    }
}

/// The receiver's placer for a packet that is not DATA (none comes with payload).
struct NoPayload;

impl PayloadSource for NoPayload {
    fn read(&mut self, msg: MsgId, _: u64, _: &mut [u8]) {
        panic!("the receiving end has no send to read ({msg:?})");
    }
}

fn config(shape: Shape) -> ProtoConfig {
    // The engine's settings (engine/net.rs) for one rail of 16 paths and its default window.
    ProtoConfig { n_paths: 16, max_payload: shape.payload(), reorder_threshold: 96, rto_min_us: 20_000, ..ProtoConfig::default() }
}

fn is_data(pkt: &[u8]) -> bool {
    Header::new_checked(pkt).ok().and_then(|h| h.packet_type().ok()) == Some(PacketType::Data)
}

/// Run one benchmark; panics if anything did not arrive as sent.
pub fn run(p: Params) -> Outcome {
    assert!(p.msg > 0 && p.depth > 0, "message size and depth must be positive");
    let n_msgs = (p.total / p.msg as u64).max(1);
    let payload = p.shape.payload();
    let mut a = Connection::new(config(p.shape), TOKEN_A, TOKEN_B, Box::new(Spray::new(1)), 0);
    let mut b = Connection::new(config(p.shape), TOKEN_B, TOKEN_A, Box::new(Spray::new(2)), 0);
    let mut a_slots = Slots::new(p.depth, p.msg, 0x5a);
    let mut b_slots = Slots::new(p.depth, p.msg, 0);
    let mut a_tx: Vec<Vec<u8>> = (0..BATCH).map(|_| vec![0u8; MAX_HEADER_LEN + payload]).collect();
    let mut a_meta: Vec<(usize, Option<Read>)> = Vec::with_capacity(BATCH);
    let mut b_tx: Vec<Vec<u8>> = (0..BATCH).map(|_| vec![0u8; RX_END_TXBUF]).collect();
    let mut b_lens: Vec<usize> = Vec::with_capacity(BATCH);
    // Receives in CTS order: proto numbers a connection's CTS 0, 1, 2, ... by post_recv.
    let mut recv_by_seq: std::collections::VecDeque<(u64, usize)> = std::collections::VecDeque::new();
    let (mut sends_posted, mut recvs_posted, mut sent, mut received) = (0u64, 0u64, 0u64, 0u64);
    let (mut other_pkts, mut checked) = (0u64, 0u64);
    let mut wire_ns: u64 = 0;
    let mut idle = 0u32;

    let (cpu0, wall0) = (thread_cpu(), Instant::now());
    while sent < n_msgs || received < n_msgs {
        let now = wire_ns / 1000;
        let mut busy = false;
        // Post what the pipeline has room for.
        while recvs_posted < n_msgs && !b_slots.free.is_empty() {
            let slot = b_slots.free.pop().expect("a free slot");
            if p.verify {
                b_slots.bufs[slot].fill(0);
            }
            let id = b.post_recv(&[RecvSpec { len: p.msg as u64, tag: 0 }], now).expect("post_recv");
            b_slots.posted.push(Posted { id, slot, k: recvs_posted });
            recv_by_seq.push_back((recvs_posted, slot));
            recvs_posted += 1;
            busy = true;
        }
        while sends_posted < n_msgs && !a_slots.free.is_empty() {
            let slot = a_slots.free.pop().expect("a free slot");
            if p.verify {
                for (i, byte) in a_slots.bufs[slot].iter_mut().enumerate() {
                    *byte = pattern(sends_posted, i);
                }
            }
            let id = a.post_send(p.msg as u64, 0, now).expect("post_send");
            a_slots.posted.push(Posted { id, slot, k: sends_posted });
            sends_posted += 1;
            busy = true;
        }

        // A's batch out, B takes it.
        a_meta.clear();
        let mut src = InPlace::default();
        for buf in a_tx.iter_mut() {
            src.last = None;
            let Some(t) = a.poll_transmit(now, &mut src, buf) else { break };
            a_meta.push((t.len, src.last));
        }
        for (buf, &(len, read)) in a_tx.iter_mut().zip(&a_meta) {
            wire_ns += len as u64 / 50;
            let pkt = &mut buf[..len];
            if !is_data(pkt) {
                other_pkts += 1;
                b.handle_datagram(pkt, now, &mut NoPlacement);
                continue;
            }
            if p.verify {
                wire_copy(pkt, read, &a_slots, &mut b_slots, &recv_by_seq, p.shape);
            }
            match p.shape {
                Shape::Verbs => b.handle_placed_data(&pkt[..DATA_HEADER_LEN], now),
                Shape::Udp => b.handle_datagram(pkt, now, &mut CopyInto(&mut b_slots)),
            }
        }
        // B's answers back to A.
        b_lens.clear();
        for buf in b_tx.iter_mut() {
            let Some(t) = b.poll_transmit(now, &mut NoPayload, buf) else { break };
            b_lens.push(t.len);
        }
        for (buf, &len) in b_tx.iter().zip(&b_lens) {
            wire_ns += len as u64 / 50;
            other_pkts += 1;
            a.handle_datagram(&buf[..len], now, &mut NoPlacement);
        }
        busy |= !a_meta.is_empty() || !b_lens.is_empty();

        // Timers, then completions.
        let now = wire_ns / 1000;
        for c in [&mut a, &mut b] {
            if c.poll_timeout().is_some_and(|t| t <= now) {
                c.handle_timeout(now);
            }
        }
        while let Some(c) = a.poll_completion() {
            match c {
                Completion::Sent { msg, len } => {
                    assert_eq!(len, p.msg as u64, "send length");
                    a_slots.done(msg);
                    sent += 1;
                    busy = true;
                }
                other => panic!("sender: unexpected completion {other:?}"),
            }
        }
        while let Some(c) = b.poll_completion() {
            match c {
                Completion::Received { msg, sizes } => {
                    assert_eq!(sizes, [p.msg as u64], "received size");
                    let done = b_slots.done(msg);
                    assert_eq!(done.k, received, "receives complete in order");
                    recv_by_seq.retain(|&(k, _)| k != done.k);
                    if p.verify {
                        let buf = &b_slots.bufs[done.slot];
                        if let Some(i) = (0..p.msg).find(|&i| buf[i] != pattern(done.k, i)) {
                            panic!("message {} byte {i}: got {:#04x}, sent {:#04x}", done.k, buf[i], pattern(done.k, i));
                        }
                        checked += 1;
                    }
                    received += 1;
                    busy = true;
                }
                other => panic!("receiver: unexpected completion {other:?}"),
            }
        }
        if busy {
            idle = 0;
            continue;
        }
        // Nothing moved: wait (virtually) for the next timer (a delayed SACK).
        idle += 1;
        assert!(idle < MAX_IDLE_ROUNDS, "stuck: {sent}/{n_msgs} sent, {received}/{n_msgs} received");
        let next = [a.poll_timeout(), b.poll_timeout()].into_iter().flatten().min();
        let next = next.unwrap_or_else(|| panic!("stuck without a timer: {sent}/{n_msgs} sent, {received}/{n_msgs} received"));
        wire_ns = wire_ns.max(next * 1000);
    }
    let (cpu, thread_clock) = match (cpu0, thread_cpu()) {
        (Some(x), Some(y)) => (y - x, true),
        _ => (wall0.elapsed(), false),
    };

    let bytes = n_msgs * p.msg as u64;
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.data_bytes_sent, bytes, "sender: DATA bytes sent");
    assert_eq!(sb.data_bytes_placed, bytes, "receiver: DATA bytes placed");
    assert_eq!(sa.retransmissions, 0, "lossless wire, yet retransmissions");
    assert_eq!(sa.dropped.total() + sb.dropped.total(), 0, "packets dropped: {:?} / {:?}", sa.dropped, sb.dropped);
    Outcome { params: p, msgs: n_msgs, bytes, data_pkts: sa.data_pkts_sent, other_pkts, checked_msgs: checked, cpu, thread_clock }
}

/// The NIC's (verbs) or the kernel's (UDP) copy of one DATA packet's payload: from the send buffer
/// proto read from to the receive buffer the header names (verbs) or into the datagram (UDP).
fn wire_copy(
    pkt: &mut [u8],
    read: Option<Read>,
    a: &Slots,
    b: &mut Slots,
    by_seq: &std::collections::VecDeque<(u64, usize)>,
    shape: Shape,
) {
    let Some((msg, offset, len)) = read else { return };
    let from = a.find(msg).unwrap_or_else(|| panic!("DATA of unknown send {msg:?}"));
    let bytes = &a.bufs[from.slot][offset as usize..offset as usize + len];
    match shape {
        Shape::Udp => {
            let at = pkt.len() - len;
            pkt[at..].copy_from_slice(bytes);
        }
        Shape::Verbs => {
            let d = DataRepr::parse(&DataPacket::new_checked(&*pkt).expect("a DATA packet")).expect("a DATA header");
            assert_eq!((d.offset, u64::from(d.len)), (offset, len as u64), "header and payload source disagree");
            let &(_, slot) = by_seq.iter().find(|(seq, _)| *seq == d.cts_seq).unwrap_or_else(|| panic!("no receive for CTS {}", d.cts_seq));
            b.bufs[slot][offset as usize..offset as usize + len].copy_from_slice(bytes);
        }
    }
}

/// The cost of copying `total` bytes in 64 KiB pieces, as the UDP receiver's placement does (from a
/// batch of datagrams, 512 KiB, into the posted buffers, 4 MiB): CPU nanoseconds per 64 KiB.
pub fn memcpy_ns_per_chunk(total: u64) -> f64 {
    const SRC: usize = 512 << 10;
    const DST: usize = 4 << 20;
    let src = vec![0x3cu8; SRC];
    let mut dst = vec![0u8; DST];
    let chunks = (total / CHUNK).max(1);
    let c = CHUNK as usize;
    let (cpu0, wall0) = (thread_cpu(), Instant::now());
    for i in 0..chunks as usize {
        let (s, d) = ((i * c) % SRC, (i * c) % DST);
        let d = &mut dst[d..d + c];
        d.copy_from_slice(&src[s..s + c]);
        std::hint::black_box(d);
    }
    let cpu = match (cpu0, thread_cpu()) {
        (Some(x), Some(y)) => y - x,
        _ => wall0.elapsed(),
    };
    cpu.as_nanos() as f64 / chunks as f64
}
