//! Hot paths of the connection: one DATA packet out of `poll_transmit` (header, path pick, 8 KiB
//! payload copy, bookkeeping), and the sender's processing of one SACK that acknowledges 256 PSNs.
//!
//! Times are this thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`, wall time where that clock is
//! missing), so a busy shared machine inflates them less than wall-clock time would. Fresh
//! connections are prepared outside the timed part.

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use nix::time::{clock_gettime, ClockId};
use prism_lb::path::Spray;
use prism_transport::proto::{Connection, MsgId, PayloadSource, Placer, ProtoConfig};
use prism_transport::wire::{CtsBuf, CtsPacket, CtsRepr, SackPacket, SackRepr, MAX_HEADER_LEN, SACK_LEN};

const LOCAL: u64 = 1;
const PEER: u64 = 2;
/// Connections prepared per timed chunk (bounds memory while keeping the clock reads rare).
const CHUNK: u64 = 256;

/// CPU time this thread has run, if the clock is available.
fn thread_cpu() -> Option<Duration> {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).ok().map(Duration::from)
}

/// Time `routine` on `iters` inputs made by `setup`, excluding the setup.
fn measure<I>(iters: u64, mut setup: impl FnMut() -> I, mut routine: impl FnMut(&mut I)) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        left -= n;
        let mut inputs: Vec<I> = (0..n).map(|_| setup()).collect();
        let (cpu0, wall0) = (thread_cpu(), Instant::now());
        for input in &mut inputs {
            routine(input);
        }
        total += match (cpu0, thread_cpu()) {
            (Some(a), Some(b)) => b - a,
            _ => wall0.elapsed(),
        };
    }
    total
}

struct Fill;
impl PayloadSource for Fill {
    fn read(&mut self, _: MsgId, offset: u64, out: &mut [u8]) {
        out.fill(offset as u8);
    }
}

struct Discard;
impl Placer for Discard {
    fn place(&mut self, _: MsgId, _: usize, _: u64, _: &[u8]) {}
}

/// A sender whose one large send is already matched by the peer's CTS.
fn matched_sender() -> Connection {
    let mut conn = Connection::new(ProtoConfig::default(), LOCAL, PEER, Box::new(Spray::new(7)), 0);
    conn.post_send(1 << 40, 0, 0).expect("post_send");
    let cts = CtsRepr::new(LOCAL, 0, 0, &[CtsBuf { size: 1 << 40, tag: 0 }]).expect("cts");
    let mut buf = vec![0u8; cts.buffer_len()];
    cts.emit(&mut CtsPacket::new_unchecked(&mut buf[..]));
    conn.handle_datagram(&buf, 1, &mut Discard);
    conn
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("proto");
    let mut out = vec![0u8; ProtoConfig::default().max_payload + MAX_HEADER_LEN];

    g.throughput(Throughput::Elements(1));
    g.bench_function("poll_transmit_one_8k_data_packet", |b| {
        b.iter_custom(|n| {
            measure(n, matched_sender, |conn| {
                black_box(conn.poll_transmit(2, &mut Fill, &mut out).expect("a DATA packet"));
            })
        });
    });

    // PSN 0 is missing; the SACK reports PSNs 1..=256 (so it also declares PSN 0 lost).
    let sack = SackRepr {
        token: LOCAL,
        cts_ack: 0,
        cum_psn: 0,
        base_psn: 1,
        bitmap: [u64::MAX; 4],
        echo: Some((3, 2)),
        congested: false,
        spurious: false,
    };
    let mut sbuf = [0u8; SACK_LEN];
    sack.emit(&mut SackPacket::new_unchecked(&mut sbuf[..]));
    let in_flight = || {
        let mut conn = matched_sender();
        let mut out = vec![0u8; ProtoConfig::default().max_payload + MAX_HEADER_LEN];
        for _ in 0..257 {
            conn.poll_transmit(2, &mut Fill, &mut out).expect("window has room");
        }
        conn
    };
    g.throughput(Throughput::Elements(256));
    g.bench_function("sack_acknowledging_256_psns", |b| {
        b.iter_custom(|n| measure(n, in_flight, |conn| conn.handle_datagram(black_box(&sbuf), 30, &mut Discard)));
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
