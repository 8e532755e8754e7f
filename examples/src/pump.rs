//! The reference Prism's UDP backend is measured against (`prism-udp-pump`): one sender thread and one
//! receiver thread move datagrams of one size over loopback as fast as the kernel lets them, either
//! one datagram per message (`sendmmsg`/`recvmmsg`, "plain") or in GSO trains (`UDP_SEGMENT`, up to
//! 64 KiB per message) received coalesced (`UDP_GRO`). It reports goodput (bytes the receiver got per
//! second of wall time, from the start (after both threads' set-up) to the last datagram received) and the CPU time of
//! both threads per received byte. Loopback drops what overflows the receiver's buffer, so the sender
//! may send more than arrives: only received bytes count.
//!
//! "gso-placed" is GSO/GRO moving a message the way a transport must: the sender's trains walk a
//! source buffer of `PLACED_BUFFER` bytes (64 MiB, larger than any cache here) and the receiver copies
//! each coalesced payload into a destination buffer of the same size, as a transport places datagrams
//! into the buffer a receive posted (the kernel cannot receive into it: the GRO buffer holds many
//! datagrams, each of which says where it goes). The hot-buffer modes measure the kernel alone; this
//! one adds what reading and writing a large message costs the memory system, the floor of any
//! transport that places UDP payloads into a posted buffer.
//!
//! Everything goes through `nix`'s safe wrappers; nothing here is `unsafe`.

use std::io::{IoSlice, IoSliceMut};
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use nix::sys::resource::{getrusage, UsageWho};
use nix::sys::socket::{recvmmsg, sendmmsg, setsockopt, sockopt, ControlMessage, ControlMessageOwned, MsgFlags, MultiHeaders, SockaddrIn};
use serde::Serialize;

/// How the pump moves datagrams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One datagram per message: `sendmmsg` of 64, `recvmmsg` of 64.
    Plain,
    /// GSO trains (`UDP_SEGMENT`) of up to 64 KiB, `sendmmsg` of 8 trains; GRO (`UDP_GRO`) on receive.
    Gso,
    /// As `Gso`, from a 64 MiB source buffer into a 64 MiB destination buffer (one copy on receive).
    GsoPlaced,
    /// As `GsoPlaced` with 1 MiB buffers, which stay in the caches: against `GsoPlaced`, what large
    /// messages cost a copying transport on this machine's memory system alone.
    #[value(name = "gso-placed-1m")]
    #[serde(rename = "gso-placed-1m")]
    GsoPlaced1m,
}

/// Source and destination buffer of `Mode::GsoPlaced`.
pub const PLACED_BUFFER: usize = 64 << 20;
/// Source and destination buffer of `Mode::GsoPlaced1m`.
pub const PLACED_BUFFER_SMALL: usize = 1 << 20;

impl Mode {
    /// The source and destination buffer of a placed mode.
    pub fn placed_buffer(self) -> Option<usize> {
        match self {
            Mode::GsoPlaced => Some(PLACED_BUFFER),
            Mode::GsoPlaced1m => Some(PLACED_BUFFER_SMALL),
            Mode::Plain | Mode::Gso => None,
        }
    }
}

/// Largest UDP payload of one message (a GSO train included): 65,535 minus the IPv4 and UDP headers.
pub const MAX_UDP_PAYLOAD: usize = 65_507;

/// Messages per `sendmmsg`/`recvmmsg` in plain mode.
const PLAIN_BATCH: usize = 64;
/// GSO trains per `sendmmsg`, and coalesced buffers per `recvmmsg`, in GSO mode.
const GSO_BATCH: usize = 8;
/// How long the receiver waits for one more datagram once the sender is done.
const IDLE: Duration = Duration::from_millis(100);

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct PumpConfig {
    /// Bytes of each datagram (UDP payload).
    pub size: usize,
    /// Plain or GSO/GRO.
    pub mode: Mode,
    /// The sender stops after this long...
    pub duration: Duration,
    /// ...or after sending this many bytes, whichever comes first.
    pub max_bytes: u64,
    /// Send and receive buffer of each socket.
    pub sockbuf: usize,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct PumpResult {
    /// Plain or GSO/GRO.
    pub mode: Mode,
    /// Bytes of each datagram.
    pub datagram_bytes: usize,
    /// Datagrams per GSO train (1 in plain mode).
    pub train: usize,
    /// Bytes the sender handed to the kernel.
    pub sent_bytes: u64,
    /// Bytes the receiver got.
    pub received_bytes: u64,
    /// Wall time from the sender's start to the last datagram received, seconds.
    pub seconds: f64,
    /// received_bytes / seconds, in GB/s (10^9 bytes).
    pub goodput_gbs: f64,
    /// CPU time (user + system) of the sender thread, seconds.
    pub sender_cpu_s: f64,
    /// CPU time (user + system) of the receiver thread, seconds.
    pub receiver_cpu_s: f64,
    /// Both threads' CPU time per received byte, nanoseconds.
    pub cpu_ns_per_byte: f64,
}

/// Errors of a pump run.
#[derive(Debug, thiserror::Error)]
pub enum PumpError {
    /// The datagram size cannot be sent.
    #[error("datagram size {0}: must be between 1 and {MAX_UDP_PAYLOAD}")]
    Size(usize),
    /// A socket call failed.
    #[error("{0}: {1}")]
    Io(&'static str, std::io::Error),
    /// A thread panicked.
    #[error("the {0} thread panicked")]
    Thread(&'static str),
}

fn io(what: &'static str) -> impl Fn(nix::errno::Errno) -> PumpError {
    move |e| PumpError::Io(what, e.into())
}

/// Datagrams per GSO train of `size`-byte datagrams (the kernel takes at most 64 KiB per message).
pub fn train_len(size: usize) -> usize {
    (MAX_UDP_PAYLOAD / size.max(1)).clamp(1, 64)
}

fn thread_cpu() -> f64 {
    getrusage(UsageWho::RUSAGE_THREAD).map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 * 1e-6;
        t(u.user_time()) + t(u.system_time())
    })
}

fn sockbufs(s: &UdpSocket, bytes: usize) {
    // Root may exceed net.core.[rw]mem_max; everybody else gets the sysctl's cap.
    if setsockopt(s, sockopt::RcvBufForce, &bytes).is_err() {
        let _ = setsockopt(s, sockopt::RcvBuf, &bytes);
    }
    if setsockopt(s, sockopt::SndBufForce, &bytes).is_err() {
        let _ = setsockopt(s, sockopt::SndBuf, &bytes);
    }
}

/// Run the pump once over 127.0.0.1.
pub fn run(cfg: &PumpConfig) -> Result<PumpResult, PumpError> {
    if cfg.size == 0 || cfg.size > MAX_UDP_PAYLOAD {
        return Err(PumpError::Size(cfg.size));
    }
    let rx = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| PumpError::Io("bind", e))?;
    let tx = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| PumpError::Io("bind", e))?;
    sockbufs(&rx, cfg.sockbuf);
    sockbufs(&tx, cfg.sockbuf);
    let dest = match rx.local_addr().map_err(|e| PumpError::Io("local_addr", e))? {
        std::net::SocketAddr::V4(a) => a,
        std::net::SocketAddr::V6(_) => unreachable!("bound to an IPv4 address"),
    };
    tx.connect(dest).map_err(|e| PumpError::Io("connect", e))?;
    rx.set_read_timeout(Some(IDLE)).map_err(|e| PumpError::Io("SO_RCVTIMEO", e))?;
    let train = match cfg.mode {
        Mode::Plain => 1,
        Mode::Gso | Mode::GsoPlaced | Mode::GsoPlaced1m => {
            setsockopt(&rx, sockopt::UdpGroSegment, &true).map_err(io("setsockopt(UDP_GRO)"))?;
            train_len(cfg.size)
        }
    };
    let done = Arc::new(AtomicBool::new(false));
    // Both threads set up (the placed modes fill 64 MiB each) and then start the clock together: set-up
    // is neither timed nor charged, and a loaded machine cannot spend the whole duration on it (a
    // 200 ms run that did sent nothing).
    let ready = Arc::new(Barrier::new(2));
    let receiver = {
        let done = done.clone();
        let ready = ready.clone();
        let mode = cfg.mode;
        let size = cfg.size;
        std::thread::spawn(move || receive(&rx, mode, size, &done, &ready))
    };
    let sender = {
        let done = done.clone();
        let cfg = *cfg;
        std::thread::spawn(move || {
            let r = send(&tx, &cfg, train, &ready);
            done.store(true, Ordering::Release);
            r
        })
    };
    let (sent_bytes, sender_cpu_s) = sender.join().map_err(|_| PumpError::Thread("sender"))??;
    let (received_bytes, last, receiver_cpu_s) = receiver.join().map_err(|_| PumpError::Thread("receiver"))??;
    let seconds = last.as_secs_f64();
    let goodput_gbs = if seconds > 0.0 { received_bytes as f64 / seconds / 1e9 } else { 0.0 };
    let cpu_ns_per_byte = if received_bytes > 0 { (sender_cpu_s + receiver_cpu_s) * 1e9 / received_bytes as f64 } else { 0.0 };
    Ok(PumpResult {
        mode: cfg.mode,
        datagram_bytes: cfg.size,
        train,
        sent_bytes,
        received_bytes,
        seconds,
        goodput_gbs,
        sender_cpu_s,
        receiver_cpu_s,
        cpu_ns_per_byte,
    })
}

/// Send until the time or byte budget is spent; (bytes sent, CPU seconds).
fn send(tx: &UdpSocket, cfg: &PumpConfig, train: usize, ready: &Barrier) -> Result<(u64, f64), PumpError> {
    let fd = tx.as_raw_fd();
    let msg_bytes = cfg.size * train;
    let batch = if cfg.mode == Mode::Plain { PLAIN_BATCH } else { GSO_BATCH };
    // Placed: as many batches of trains as fit in the source buffer, sent in turn; else one train,
    // the same bytes every time (cache-hot).
    let batches = cfg.mode.placed_buffer().map_or(1, |b| (b / (msg_bytes * batch)).max(1));
    let positions = if cfg.mode.placed_buffer().is_some() { batches * batch } else { 1 };
    // Distinct bytes per datagram position, so a receiver could tell them apart (not checked here).
    let payload: Vec<u8> = (0..msg_bytes * positions).map(|i| (i / cfg.size) as u8 ^ (i as u8)).collect();
    let iovs: Vec<[IoSlice<'_>; 1]> = (0..batch * batches)
        .map(|k| {
            let at = (k % positions) * msg_bytes;
            [IoSlice::new(&payload[at..at + msg_bytes])]
        })
        .collect();
    let mut next = 0;
    let addrs: Vec<Option<SockaddrIn>> = vec![None; batch];
    // (Fallible steps come after the barrier: the receiver must not wait at it for ever.)
    let seg = u16::try_from(cfg.size);
    let gso_mode = cfg.mode != Mode::Plain;
    let cmsg_space = if gso_mode { Some(nix::cmsg_space!(u16)) } else { None };
    let mut hdrs = MultiHeaders::<SockaddrIn>::preallocate(batch, cmsg_space);
    let mut sent = 0u64;
    ready.wait();
    let (start, cpu0) = (Instant::now(), thread_cpu());
    let seg = seg.map_err(|_| PumpError::Size(cfg.size))?;
    let gso = [ControlMessage::UdpGsoSegments(&seg)];
    let cmsgs: &[ControlMessage<'_>] = if gso_mode { &gso } else { &[] };
    while sent < cfg.max_bytes && start.elapsed() < cfg.duration {
        let window = &iovs[next * batch..(next + 1) * batch];
        match sendmmsg(fd, &mut hdrs, window, &addrs, cmsgs, MsgFlags::empty()) {
            Ok(res) => {
                sent += (res.count() * msg_bytes) as u64;
                next = (next + 1) % batches;
            }
            // Loopback frees the send buffer as it delivers; a refusal (a receiver queue overflowing
            // is not one) is retried.
            Err(nix::errno::Errno::ENOBUFS | nix::errno::Errno::EAGAIN | nix::errno::Errno::ECONNREFUSED) => {}
            Err(e) => return Err(PumpError::Io("sendmmsg", e.into())),
        }
    }
    Ok((sent, thread_cpu() - cpu0))
}

/// Receive until the sender is done and nothing arrived for `IDLE`; (bytes, time of the last
/// datagram since `start`, CPU seconds).
fn receive(rx: &UdpSocket, mode: Mode, size: usize, done: &AtomicBool, ready: &Barrier) -> Result<(u64, Duration, f64), PumpError> {
    let fd = rx.as_raw_fd();
    let (batch, buf_len) = match mode {
        Mode::Plain => (PLAIN_BATCH, size),
        Mode::Gso | Mode::GsoPlaced | Mode::GsoPlaced1m => (GSO_BATCH, MAX_UDP_PAYLOAD),
    };
    let mut bufs = vec![vec![0u8; buf_len]; batch];
    // Placed: where the next payload goes in the destination (written through once before the clock
    // starts counting what matters, so that page faults are not the measure).
    let mut dest = mode.placed_buffer().map_or_else(Vec::new, |b| vec![1u8; b]);
    let mut at = 0usize;
    let cmsg_space = if mode != Mode::Plain { Some(nix::cmsg_space!(i32)) } else { None };
    let mut hdrs = MultiHeaders::<SockaddrIn>::preallocate(batch, cmsg_space);
    let mut bytes = 0u64;
    let mut last = Duration::ZERO;
    let mut lens: Vec<usize> = Vec::with_capacity(batch);
    ready.wait();
    let (start, cpu0) = (Instant::now(), thread_cpu());
    loop {
        let res = {
            let mut iovs: Vec<[IoSliceMut<'_>; 1]> = bufs.iter_mut().map(|b| [IoSliceMut::new(&mut b[..])]).collect();
            recvmmsg(fd, &mut hdrs, iovs.iter_mut(), MsgFlags::MSG_WAITFORONE, None).map(|res| {
                lens.clear();
                lens.extend(res.map(|r| {
                    if mode != Mode::Plain {
                        // Touch the segment size as a real receiver must (to split the buffer).
                        let _ = r.cmsgs().map(|mut c| c.any(|m| matches!(m, ControlMessageOwned::UdpGroSegments(_))));
                    }
                    r.bytes
                }))
            })
        };
        match res {
            Ok(()) => {
                let mut got = 0u64;
                for (k, &len) in lens.iter().enumerate() {
                    got += len as u64;
                    if !dest.is_empty() {
                        if at + len > dest.len() {
                            at = 0;
                        }
                        dest[at..at + len].copy_from_slice(&bufs[k][..len]);
                        at += len;
                    }
                }
                if got > 0 {
                    bytes += got;
                    last = start.elapsed();
                }
            }
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {
                if done.load(Ordering::Acquire) {
                    break;
                }
            }
            Err(e) => return Err(PumpError::Io("recvmmsg", e.into())),
        }
    }
    Ok((bytes, last, thread_cpu() - cpu0))
}

/// One line describing a result.
pub fn describe(r: &PumpResult) -> String {
    format!(
        "{:<10} {:>6} B x{:<2} {:>8.3} GB/s  {:>6.3} CPU-ns/B  (sent {:.2} GB, received {:.2} GB in {:.2} s; CPU sender {:.2} s, receiver {:.2} s)",
        match r.mode {
            Mode::Plain => "plain",
            Mode::Gso => "gso",
            Mode::GsoPlaced => "gso-placed",
            Mode::GsoPlaced1m => "gso-placed-1m",
        },
        r.datagram_bytes,
        r.train,
        r.goodput_gbs,
        r.cpu_ns_per_byte,
        r.sent_bytes as f64 / 1e9,
        r.received_bytes as f64 / 1e9,
        r.seconds,
        r.sender_cpu_s,
        r.receiver_cpu_s
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_train_never_exceeds_one_udp_message() {
        assert_eq!(train_len(8972), 7);
        assert!(train_len(8972) * 8972 <= MAX_UDP_PAYLOAD);
        assert_eq!(train_len(1), 64);
        assert_eq!(train_len(MAX_UDP_PAYLOAD), 1);
    }

    #[test]
    fn every_mode_delivers_bytes_over_loopback() {
        for mode in [Mode::Plain, Mode::Gso, Mode::GsoPlaced, Mode::GsoPlaced1m] {
            let cfg = PumpConfig { size: 8972, mode, duration: Duration::from_millis(200), max_bytes: 64 << 20, sockbuf: 4 << 20 };
            let r = run(&cfg).unwrap();
            assert!(r.received_bytes > 0, "{mode:?}: nothing received");
            assert!(r.received_bytes <= r.sent_bytes, "{mode:?}: received more than sent");
            assert_eq!(r.received_bytes % 8972, 0, "{mode:?}: a partial datagram was counted");
            assert!(r.goodput_gbs > 0.0 && r.cpu_ns_per_byte > 0.0);
        }
    }
}
