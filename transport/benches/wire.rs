//! Parse and emit of the two packets on the data path: DATA (header only; the codec never touches the
//! payload) and SACK.
//!
//! Times are this thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`, wall time where that clock is
//! missing), so a busy shared machine inflates them less than wall-clock time would.

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use nix::time::{clock_gettime, ClockId};
use prism_transport::wire::{DataPacket, DataRepr, SackPacket, SackRepr, DATA_HEADER_LEN, SACK_LEN};

/// CPU time this thread has run, if the clock is available.
fn thread_cpu() -> Option<Duration> {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).ok().map(Duration::from)
}

/// Time `iters` runs of `f`.
fn measure(iters: u64, mut f: impl FnMut()) -> Duration {
    let (cpu0, wall0) = (thread_cpu(), Instant::now());
    for _ in 0..iters {
        f();
    }
    match (cpu0, thread_cpu()) {
        (Some(a), Some(b)) => b - a,
        _ => wall0.elapsed(),
    }
}

fn data_repr() -> DataRepr {
    DataRepr {
        token: 0x0123_4567_89ab_cdef,
        cts_ack: 17,
        psn: 1 << 33,
        cts_seq: 17,
        sub: 3,
        offset: 1 << 20,
        len: 8192,
        total_len: 4 << 20,
        entropy: 11,
        ts_us: 123_456,
        trunc: false,
        ce: false,
        retx: false,
    }
}

fn sack_repr() -> SackRepr {
    SackRepr {
        token: 0x0123_4567_89ab_cdef,
        cts_ack: 0,
        cum_psn: 1 << 33,
        base_psn: (1 << 33) + 1,
        bitmap: [u64::MAX, 0xf0f0_f0f0_f0f0_f0f0, 0, 1],
        echo: Some((11, 123_456)),
        congested: false,
        spurious: false,
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("wire");
    g.throughput(Throughput::Elements(1));

    let mut buf = vec![0u8; DATA_HEADER_LEN + 8192];
    let data = data_repr();
    g.bench_function("data_emit", |b| {
        b.iter_custom(|n| measure(n, || black_box(&data).emit(&mut DataPacket::new_unchecked(black_box(&mut buf[..])))));
    });
    data.emit(&mut DataPacket::new_unchecked(&mut buf[..]));
    g.bench_function("data_parse", |b| {
        b.iter_custom(|n| {
            measure(n, || {
                black_box(DataRepr::parse(&DataPacket::new_checked(black_box(&buf[..])).unwrap()).unwrap());
            })
        });
    });

    let mut sbuf = [0u8; SACK_LEN];
    let sack = sack_repr();
    g.bench_function("sack_emit", |b| {
        b.iter_custom(|n| measure(n, || black_box(&sack).emit(&mut SackPacket::new_unchecked(black_box(&mut sbuf[..])))));
    });
    sack.emit(&mut SackPacket::new_unchecked(&mut sbuf[..]));
    g.bench_function("sack_parse", |b| {
        b.iter_custom(|n| {
            measure(n, || {
                black_box(SackRepr::parse(&SackPacket::new_checked(black_box(&sbuf[..])).unwrap()).unwrap());
            })
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
