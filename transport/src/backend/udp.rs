//! UDP backend: per rail, `paths` sockets bound to distinct source ports. The source port IS the path:
//! ECMP switches hash the 5-tuple, so entropy `e` leaves from socket `e`. Peers address their datagrams
//! to socket 0 ("the rail port"), so one `recvmmsg` drains a rail's traffic.
//!
//! The other sockets only send, but their ports are open to anything that can reach the host: a
//! datagram sent to one would sit in its receive queue for as long as the socket lives (a flood at
//! them once held 130–253 MB of kernel memory). So each carries a drop-all socket filter (the kernel
//! discards what arrives before charging it to any buffer, and counts it: [`UdpRail::send_only_drops`]).
//! Should the filter be refused, they still cannot accumulate: they have the smallest receive buffer
//! the kernel allows, sit in one epoll set per rail, and [`UdpRail::drain_strays`] discards (and
//! counts) whatever reaches them; the set's descriptor ([`UdpRail::stray_fd`]) is readable while any
//! of them is, so a thread sleeping in `poll` wakes for them too.
//!
//! Both directions are batched, through `nix`'s safe wrappers (so this file needs no `unsafe`). Where
//! the kernel supports them (and `PRISM_UDP_GSO`/`PRISM_UDP_GRO` leave them on), a run of datagrams of
//! one entropy whose sizes are equal (the last may be shorter) leaves as one GSO train (`sendmsg` with
//! `UDP_SEGMENT`: one system call and one trip through the stack for up to 64 KiB), and the rail port
//! receives coalesced buffers (`UDP_GRO`) that [`segments`] splits by the segment size the kernel
//! reports. Elsewhere, or when the kernel refuses a train, it is one datagram per message
//! (`sendmmsg`/`recvmmsg`), as before; each fallback is logged once.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::socket::{
    recvmmsg, sendmmsg, sendmsg, setsockopt, sockopt, ControlMessage, ControlMessageOwned, MsgFlags, MultiHeaders, SockaddrIn,
};
use socket2::{Domain, Protocol, Socket, Type};

/// Most datagrams one `sendmmsg`/`recvmmsg` moves.
pub const BATCH: usize = 64;

/// Largest UDP payload of one message, a GSO train or a GRO buffer included (65,535 minus the IPv4
/// and UDP headers).
pub const MAX_TRAIN_BYTES: usize = 65_507;

/// Most datagrams in one GSO train (the kernel's `UDP_MAX_SEGMENTS` is 64 on older kernels).
pub const MAX_TRAIN_SEGMENTS: usize = 64;

/// Bytes of a receive buffer when GRO is on: a coalesced buffer never exceeds one UDP message, and a
/// longer one would be cut off (the cut segment then fails the packet checks, like any truncation).
pub const GRO_BUF_BYTES: usize = 65_536;

/// The UDP offloads a rail asks for (`PRISM_UDP_GSO`, `PRISM_UDP_GRO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offloads {
    /// Send GSO trains.
    pub gso: bool,
    /// Receive coalesced buffers.
    pub gro: bool,
}

impl Offloads {
    /// Both on.
    pub const ALL: Self = Self { gso: true, gro: true };
    /// Both off: one datagram per message in both directions.
    pub const NONE: Self = Self { gso: false, gro: false };
}

/// The byte ranges of the datagrams in a receive buffer holding `len` bytes that the kernel coalesced
/// with segment size `seg` (0: one datagram). Every segment has `seg` bytes but the last, which may be
/// shorter. The ranges never leave `0..len`, whatever `seg` says (it is checked like any input: a
/// bogus size only cuts the buffer into pieces that then fail the packet checks one by one).
pub fn segments(len: usize, seg: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = if seg == 0 || seg >= len { len.max(1) } else { seg };
    (0..len.max(1)).step_by(step).map(move |start| start..(start + step).min(len))
}

/// Logged once per process: the kernel refused an offload (every rail would say the same).
static GSO_FALLBACK_LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static GRO_FALLBACK_LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn log_once(flag: &std::sync::atomic::AtomicBool, what: std::fmt::Arguments<'_>) {
    if !flag.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::info!("{what}");
    }
}

/// One datagram to send: its entropy and its bytes in two parts, sent back to back without being
/// copied together (the engine's header, then the payload where NCCL's buffer holds it; either may
/// be empty).
#[derive(Debug, Clone, Copy)]
pub struct OutDatagram<'a> {
    /// The entropy, i.e. the socket it leaves from.
    pub entropy: u16,
    /// The first bytes.
    pub head: &'a [u8],
    /// The rest.
    pub tail: &'a [u8],
}

impl<'a> OutDatagram<'a> {
    /// A datagram in one piece.
    pub fn whole(entropy: u16, bytes: &'a [u8]) -> Self {
        Self { entropy, head: bytes, tail: &[] }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    /// True for an empty datagram.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How many of `pkts` (datagrams of one socket, in order) one GSO train takes: the first datagram
/// sets the segment size, every following one has that size but the last, which may be shorter, and
/// the train stays within one UDP message and `MAX_TRAIN_SEGMENTS`.
pub fn train_len(pkts: &[OutDatagram<'_>]) -> usize {
    let Some(first) = pkts.first() else { return 0 };
    let seg = first.len();
    let mut total = seg;
    let mut n = 1;
    for p in &pkts[1..] {
        let len = p.len();
        if seg == 0 || n == MAX_TRAIN_SEGMENTS || len > seg || len == 0 || total + len > MAX_TRAIN_BYTES {
            break;
        }
        total += len;
        n += 1;
        if len < seg {
            break;
        }
    }
    n
}

/// Bytes of a stray datagram read by [`UdpRail::drain_strays`]: it is discarded, so the rest is cut off.
const STRAY_PEEK: usize = 64;

/// Most `recvmmsg` batches one [`UdpRail::drain_strays`] reads from one socket (its receive buffer
/// holds a few datagrams, so one batch normally empties it).
const STRAY_BATCHES: usize = 4;

/// The sockets of one rail.
#[derive(Debug)]
pub struct UdpRail {
    socks: Vec<UdpSocket>,
    ports: Vec<u16>,
    addr: Ipv4Addr,
    /// Sockets 1.. (send-only), readable when any of them has a datagram queued.
    strays: Epoll,
    /// Datagrams the local stack refused (`sendmmsg` errors other than a full buffer).
    send_errors: std::sync::atomic::AtomicU64,
    /// Datagrams dropped because a socket's send buffer was full (`EAGAIN`).
    send_full: std::sync::atomic::AtomicU64,
    /// GSO trains are sent (cleared for good if the kernel refuses one).
    gso: std::sync::atomic::AtomicBool,
    /// The rail port receives coalesced buffers (see [`segments`]).
    gro: bool,
    /// GSO trains sent, and the datagrams they carried (statistics).
    trains: std::sync::atomic::AtomicU64,
    train_datagrams: std::sync::atomic::AtomicU64,
}

/// A classic BPF program that accepts nothing: attached to the send-only sockets, the kernel drops
/// every datagram addressed to them before charging it to any buffer (and counts it in the socket's
/// `drops`, see [`UdpRail::send_only_drops`]).
const DROP_ALL: [libc::sock_filter; 1] = [libc::sock_filter { code: (libc::BPF_RET | libc::BPF_K) as u16, jt: 0, jf: 0, k: 0 }];

/// `rcv`: also size the receive buffer (socket 0); the send-only sockets get the smallest one.
fn sockbuf(sock: &Socket, bytes: usize, rcv: bool) {
    // Root may exceed net.core.[rw]mem_max (SO_*BUFFORCE); everybody else gets the sysctl's cap.
    if !rcv {
        // The kernel raises 0 to its minimum (SOCK_MIN_RCVBUF, a few KiB).
        let _ = sock.set_recv_buffer_size(0);
    } else if sock.set_recv_buffer_size(bytes).is_err() || sock.recv_buffer_size().unwrap_or(0) < bytes {
        let _ = force_buf(sock, libc::SO_RCVBUFFORCE, bytes);
    }
    if sock.set_send_buffer_size(bytes).is_err() || sock.send_buffer_size().unwrap_or(0) < bytes {
        let _ = force_buf(sock, libc::SO_SNDBUFFORCE, bytes);
    }
}

fn force_buf(sock: &Socket, opt: libc::c_int, bytes: usize) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    let v = bytes.min(i32::MAX as usize);
    if opt == libc::SO_RCVBUFFORCE {
        setsockopt(sock, sockopt::RcvBufForce, &v)
    } else {
        setsockopt(sock, sockopt::SndBufForce, &v)
    }
}

impl UdpRail {
    /// Bind `paths` non-blocking sockets on `addr`: socket `i` on port `first_port + i`, or each on its
    /// own ephemeral port when `first_port` is 0. Socket 0 (the rail port) gets `sockbuf_bytes` of
    /// receive buffer; the others receive nothing legitimate and get the kernel's smallest (see the
    /// module comment).
    /// `offloads` says which of GSO and GRO to use where the kernel has them; without (setsockopt
    /// fails) the rail uses one datagram per message and says so once per process.
    /// A fixed range that does not fit below 65536 is `InvalidInput`; a port that cannot be bound is
    /// the bind's error with the port in its message.
    pub fn bind(addr: Ipv4Addr, first_port: u16, paths: u16, sockbuf_bytes: u32, offloads: Offloads) -> io::Result<Self> {
        if first_port != 0 && u32::from(first_port) + u32::from(paths.max(1)) - 1 > u32::from(u16::MAX) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ports {first_port}..{} do not fit below 65536", u32::from(first_port) + u32::from(paths.max(1)) - 1),
            ));
        }
        let mut socks = Vec::with_capacity(paths as usize);
        let mut ports = Vec::with_capacity(paths as usize);
        let strays = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        for i in 0..paths.max(1) {
            let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
            s.set_nonblocking(true)?;
            // Before the bind, so that no datagram can reach a large buffer in between.
            sockbuf(&s, sockbuf_bytes as usize, i == 0);
            if i > 0 {
                // Best effort: where it fails, the smallest buffer and `drain_strays` bound them.
                if let Err(e) = s.attach_filter(&DROP_ALL) {
                    tracing::debug!("cannot attach the drop-all filter to a send-only socket ({e}); it is drained instead");
                }
            }
            let port = if first_port == 0 { 0 } else { first_port + i };
            s.bind(&SocketAddrV4::new(addr, port).into()).map_err(|e| {
                if port == 0 {
                    e
                } else {
                    io::Error::new(e.kind(), format!("port {port}: {e}"))
                }
            })?;
            let u: UdpSocket = s.into();
            if i > 0 {
                strays.add(&u, EpollEvent::new(EpollFlags::EPOLLIN, u64::from(i)))?;
            }
            ports.push(u.local_addr()?.port());
            socks.push(u);
        }
        // GSO is asked for per message (a cmsg); a kernel that knows the option accepts it as a
        // socket option too (0: no default segment size).
        let gso = offloads.gso
            && match setsockopt(&socks[0], sockopt::UdpGsoSegment, &0) {
                Ok(()) => true,
                Err(e) => {
                    log_once(&GSO_FALLBACK_LOGGED, format_args!("UDP GSO unavailable ({e}): one datagram per message"));
                    false
                }
            };
        let gro = offloads.gro
            && match setsockopt(&socks[0], sockopt::UdpGroSegment, &true) {
                Ok(()) => true,
                Err(e) => {
                    log_once(&GRO_FALLBACK_LOGGED, format_args!("UDP GRO unavailable ({e}): one datagram per receive buffer"));
                    false
                }
            };
        Ok(Self {
            socks,
            ports,
            addr,
            strays,
            send_errors: std::sync::atomic::AtomicU64::new(0),
            send_full: std::sync::atomic::AtomicU64::new(0),
            gso: std::sync::atomic::AtomicBool::new(gso),
            gro,
            trains: std::sync::atomic::AtomicU64::new(0),
            train_datagrams: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// GSO trains are in use (false where the kernel lacks them, refused one, or they were turned off).
    pub fn gso(&self) -> bool {
        self.gso.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The rail port receives coalesced buffers: receive buffers must hold [`GRO_BUF_BYTES`].
    pub fn gro(&self) -> bool {
        self.gro
    }

    /// Datagrams dropped so far because a socket's send buffer was full (each lost, and recovered).
    pub fn send_full(&self) -> u64 {
        self.send_full.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// GSO trains sent so far, and the datagrams they carried.
    pub fn train_stats(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.trains.load(Relaxed), self.train_datagrams.load(Relaxed))
    }

    /// Datagrams the local stack refused so far (each lost, and recovered like any loss).
    pub fn send_errors(&self) -> u64 {
        self.send_errors.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The port peers send to.
    pub fn rail_port(&self) -> u16 {
        self.ports[0]
    }

    /// The rail's address.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// Source ports by entropy.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// Send `pkts` (entropy, bytes) to `dest`, per run of consecutive datagrams of one entropy (a
    /// socket is one source port; callers put each entropy's datagrams together, in order, so that a
    /// batch sprayed over P entropies costs P runs, not one per packet). A run leaves as GSO trains
    /// (see [`train_len`]) when GSO is on, else with one `sendmmsg`. Packets of one entropy keep their
    /// order; across entropies the batch is reordered by at most its length (the transport's reorder
    /// threshold allows for that). A full socket buffer (`EAGAIN`) drops the rest of that run: the
    /// transport treats it as loss. Returns how many datagrams the kernel took.
    pub fn send(&self, dest: SocketAddrV4, pkts: &[OutDatagram<'_>]) -> io::Result<usize> {
        let addr = SockaddrIn::from(dest);
        let mut sent = 0;
        let mut i = 0;
        while i < pkts.len() {
            let e = pkts[i].entropy;
            let mut j = i + 1;
            while j < pkts.len() && pkts[j].entropy == e {
                j += 1;
            }
            let sock = &self.socks[e as usize % self.socks.len()];
            let run = &pkts[i..j];
            let done = if self.gso() { self.send_trains(sock, addr, run, &mut sent) } else { 0 };
            if done < run.len() {
                self.send_plain(sock, addr, &run[done..], &mut sent);
            }
            i = j;
        }
        Ok(sent)
    }

    /// Send `run` (one socket's datagrams) as GSO trains; returns how many of `run` are dealt with
    /// (sent, dropped on a full buffer, or refused): all of them unless the kernel refused GSO itself,
    /// in which case GSO is off from now on and the caller sends the rest one by one.
    fn send_trains(&self, sock: &UdpSocket, addr: SockaddrIn, run: &[OutDatagram<'_>], sent: &mut usize) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        let mut iov = [IoSlice::new(&[]); 2 * MAX_TRAIN_SEGMENTS];
        let mut k = 0;
        while k < run.len() {
            let n = train_len(&run[k..]).max(1);
            // The kernel cuts the train every `seg` bytes wherever its pieces end.
            let mut nio = 0;
            for p in &run[k..k + n] {
                for part in [p.head, p.tail] {
                    if !part.is_empty() {
                        iov[nio] = IoSlice::new(part);
                        nio += 1;
                    }
                }
            }
            // The segment size fits: a train is at most MAX_TRAIN_BYTES long.
            let seg = run[k].len() as u16;
            let gso = [ControlMessage::UdpGsoSegments(&seg)];
            let cmsgs: &[ControlMessage<'_>] = if n > 1 { &gso } else { &[] };
            match sendmsg(sock.as_raw_fd(), &iov[..nio], cmsgs, MsgFlags::MSG_DONTWAIT, Some(&addr)) {
                Ok(_) => {
                    *sent += n;
                    if n > 1 {
                        self.trains.fetch_add(1, Relaxed);
                        self.train_datagrams.fetch_add(n as u64, Relaxed);
                    }
                }
                // A full buffer ends the run, as on the plain path.
                Err(nix::errno::Errno::EAGAIN) => {
                    self.send_full.fetch_add((run.len() - k) as u64, Relaxed);
                    return run.len();
                }
                // The kernel or the device cannot segment (no checksum offload: EIO; no UDP_SEGMENT:
                // EINVAL/ENOPROTOOPT/EOPNOTSUPP): GSO is off for this rail, the rest goes one by one.
                Err(
                    err @ (nix::errno::Errno::EIO
                    | nix::errno::Errno::EINVAL
                    | nix::errno::Errno::ENOPROTOOPT
                    | nix::errno::Errno::EOPNOTSUPP),
                ) if n > 1 => {
                    self.gso.store(false, Relaxed);
                    log_once(&GSO_FALLBACK_LOGGED, format_args!("the kernel refused a UDP GSO train ({err}): one datagram per message"));
                    return k;
                }
                Err(err) => self.refused(err, n),
            }
            k += n;
        }
        run.len()
    }

    /// A refused datagram, or train of `n`: counted per datagram, logged once.
    fn refused(&self, err: nix::errno::Errno, n: usize) {
        if self.send_errors.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed) == 0 {
            tracing::warn!("a datagram was refused by the local stack ({err}); it is lost and resent (counted in send_errors)");
        }
    }

    /// Send `run` (one socket's datagrams) with `sendmmsg`, one datagram per message.
    fn send_plain(&self, sock: &UdpSocket, addr: SockaddrIn, run: &[OutDatagram<'_>], sent: &mut usize) {
        for (c, chunk) in run.chunks(BATCH).enumerate() {
            let iovs: Vec<[IoSlice<'_>; 2]> = chunk.iter().map(|p| [IoSlice::new(p.head), IoSlice::new(p.tail)]).collect();
            let addrs = vec![Some(addr); chunk.len()];
            let mut hdrs = MultiHeaders::<SockaddrIn>::preallocate(chunk.len(), None);
            // sendmmsg stops at the first datagram that fails and reports the error on the next call:
            // one refused datagram (a local firewall rule answers EPERM, a route error) must not take
            // the rest of the run with it. Only a full buffer (EAGAIN) ends the run.
            let mut k = 0;
            while k < chunk.len() {
                match sendmmsg(sock.as_raw_fd(), &mut hdrs, &iovs[k..], &addrs[k..], [], MsgFlags::MSG_DONTWAIT) {
                    Ok(res) => {
                        let n = res.count();
                        *sent += n;
                        k += n;
                        if n == 0 {
                            return;
                        }
                    }
                    Err(nix::errno::Errno::EAGAIN) => {
                        let left = run.len() - c * BATCH - k;
                        self.send_full.fetch_add(left as u64, std::sync::atomic::Ordering::Relaxed);
                        return;
                    }
                    Err(err) => {
                        self.refused(err, 1);
                        k += 1;
                    }
                }
            }
        }
    }

    /// Receive up to `bufs.len()` (at most `BATCH`) buffers from socket `sock` without blocking; the
    /// k-th `(len, source, segment size)` in `out` describes `bufs[k]`. The segment size is the one
    /// the kernel reported for a coalesced (GRO) buffer, 0 for a single datagram: split the buffer
    /// with [`segments`].
    pub fn recv(&self, sock: usize, bufs: &mut [Vec<u8>], out: &mut Vec<(usize, SocketAddrV4, usize)>) -> io::Result<()> {
        out.clear();
        let n = bufs.len().min(BATCH);
        let gro = self.gro && sock == 0;
        let mut hdrs = MultiHeaders::<SockaddrIn>::preallocate(n, gro.then(|| nix::cmsg_space!(i32)));
        let mut iovs: Vec<[IoSliceMut<'_>; 1]> = bufs[..n].iter_mut().map(|b| [IoSliceMut::new(&mut b[..])]).collect();
        match recvmmsg(self.socks[sock].as_raw_fd(), &mut hdrs, iovs.iter_mut(), MsgFlags::MSG_DONTWAIT, None) {
            Ok(res) => {
                for r in res {
                    // Keep one entry per buffer so that entry k stays buffer k; a datagram without a
                    // source (none on UDP) gets 0.0.0.0:0, which no connection accepts as its peer.
                    let src = r.address.map_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0), |a| SocketAddrV4::new(a.ip(), a.port()));
                    let mut seg = 0;
                    if gro {
                        if let Ok(cmsgs) = r.cmsgs() {
                            for c in cmsgs {
                                if let ControlMessageOwned::UdpGroSegments(s) = c {
                                    seg = usize::try_from(s).unwrap_or(0);
                                }
                            }
                        }
                    }
                    out.push((r.bytes, src, seg));
                }
                Ok(())
            }
            Err(nix::errno::Errno::EAGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The socket peers send to, for readiness polling.
    pub fn rx_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.socks[0].as_fd()
    }

    /// Readable while a send-only socket has a datagram queued (see [`UdpRail::drain_strays`]).
    pub fn stray_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.strays.0.as_fd()
    }

    /// Discard the datagrams queued on the send-only sockets (nobody sends to them legitimately) and
    /// say how many there were, and how many the kernel dropped on them. Costs one `epoll_wait` when
    /// none has any. Bounded: a socket is read at most `STRAY_BATCHES` times per call, so a flood
    /// cannot hold the caller.
    pub fn drain_strays(&self) -> io::Result<u64> {
        let mut events = [EpollEvent::empty(); BATCH];
        let mut read = 0u64;
        let mut scratch: Vec<[u8; STRAY_PEEK]> = Vec::new();
        let ready = self.strays.wait(&mut events, EpollTimeout::ZERO)?;
        for ev in &events[..ready] {
            let Some(sock) = self.socks.get(ev.data() as usize) else { continue };
            if scratch.is_empty() {
                scratch = vec![[0u8; STRAY_PEEK]; BATCH];
            }
            for _ in 0..STRAY_BATCHES {
                let mut hdrs = MultiHeaders::<SockaddrIn>::preallocate(BATCH, None);
                let mut iovs: Vec<[IoSliceMut<'_>; 1]> = scratch.iter_mut().map(|b| [IoSliceMut::new(&mut b[..])]).collect();
                // A datagram longer than the scratch buffer is cut off (MSG_TRUNC) and consumed whole.
                let n = match recvmmsg(sock.as_raw_fd(), &mut hdrs, iovs.iter_mut(), MsgFlags::MSG_DONTWAIT, None) {
                    Ok(res) => res.count(),
                    Err(nix::errno::Errno::EAGAIN) => 0,
                    Err(e) => return Err(e.into()),
                };
                read += n as u64;
                if n < BATCH {
                    break;
                }
            }
        }
        Ok(read)
    }

    /// Datagrams the kernel dropped on the send-only sockets (the drop-all filter, or a full buffer
    /// where the filter could not be attached), from the `drops` column of `/proc/net/udp`. `None`
    /// without procfs. Reads a file: for statistics, not for the data path.
    ///
    /// The kernel produces that table a page per `read`, finding each page again by its line number:
    /// a socket another thread opens or closes between two reads shifts the lines after it, which then
    /// appear twice or not at all (a test counted 50 drops as 100 while other tests churned sockets).
    /// So a line counts once, matched by the socket's inode, and the table is re-read (at most 8
    /// times) until every send-only socket of the rail has been seen.
    pub fn send_only_drops(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        let inodes: Vec<u64> = self.socks[1..]
            .iter()
            .map(|s| std::fs::metadata(format!("/proc/self/fd/{}", s.as_raw_fd())).map(|m| m.ino()))
            .collect::<io::Result<_>>()
            .ok()?;
        let mut drops: Vec<Option<u64>> = vec![None; inodes.len()];
        for _ in 0..8 {
            let table = std::fs::read_to_string("/proc/self/net/udp").ok()?;
            for line in table.lines().skip(1) {
                // sl local rem st tx:rx tr:when retrnsmt uid timeout inode ref pointer drops
                let f: Vec<&str> = line.split_whitespace().collect();
                let (Some(ino), Some(d)) = (f.get(9).and_then(|s| s.parse::<u64>().ok()), f.get(12).and_then(|s| s.parse::<u64>().ok()))
                else {
                    continue;
                };
                if let Some(k) = inodes.iter().position(|&i| i == ino) {
                    drops[k] = Some(drops[k].map_or(d, |seen| seen.max(d)));
                }
            }
            if drops.iter().all(Option::is_some) {
                break;
            }
        }
        Some(drops.iter().flatten().sum())
    }

    /// Number of sockets (entropies).
    pub fn paths(&self) -> usize {
        self.socks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_entropy_has_its_own_source_port() {
        let rail = UdpRail::bind(Ipv4Addr::LOCALHOST, 0, 8, 1 << 20, Offloads::ALL).unwrap();
        let mut ports = rail.ports().to_vec();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 8);
    }

    #[test]
    fn a_fixed_first_port_gives_entropy_i_port_first_plus_i() {
        // Another process may hold any given port on a shared machine: try a few free-looking ranges
        // and accept only "address in use" as a reason to move on.
        let mut last = None;
        for _ in 0..20 {
            let probe = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
            let first = probe.local_addr().unwrap().port().min(u16::MAX - 8);
            drop(probe);
            match UdpRail::bind(Ipv4Addr::LOCALHOST, first, 8, 1 << 20, Offloads::ALL) {
                Ok(rail) => {
                    assert_eq!(rail.ports(), (first..first + 8).collect::<Vec<_>>().as_slice());
                    assert_eq!(rail.rail_port(), first);
                    return;
                }
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
                    last = Some(e);
                }
            }
        }
        panic!("no free range of 8 ports in 20 tries: {last:?}");
    }

    #[test]
    fn a_taken_fixed_port_is_an_error_naming_the_port() {
        let holder = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = holder.local_addr().unwrap().port();
        let Err(e) = UdpRail::bind(Ipv4Addr::LOCALHOST, port, 2, 1 << 20, Offloads::ALL) else { panic!("the port is taken") };
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        assert!(e.to_string().contains(&format!("port {port}")), "{e}");
    }

    #[test]
    fn a_fixed_range_past_65535_is_refused_before_binding() {
        let Err(e) = UdpRail::bind(Ipv4Addr::LOCALHOST, 65_530, 8, 1 << 20, Offloads::ALL) else { panic!("out of range") };
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("65530..65537"), "{e}");
    }

    #[test]
    fn datagrams_at_a_send_only_port_are_dropped_by_the_kernel_and_counted() {
        let rail = UdpRail::bind(Ipv4Addr::LOCALHOST, 0, 4, 1 << 20, Offloads::ALL).unwrap();
        let stray = SocketAddrV4::new(Ipv4Addr::LOCALHOST, rail.ports()[2]);
        let attacker = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        assert_eq!(rail.send_only_drops(), Some(0), "nothing sent yet");
        for _ in 0..50 {
            attacker.send_to(&[7u8; 1000], stray).unwrap();
        }
        let t0 = std::time::Instant::now();
        let mut read = 0;
        while read + rail.send_only_drops().unwrap() < 50 {
            read += rail.drain_strays().unwrap();
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "only {read} read, {:?} dropped", rail.send_only_drops());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(read, 0, "the drop-all filter let datagrams through");
        assert_eq!(rail.send_only_drops(), Some(50));
        let mut bufs = vec![vec![0u8; 2048]; 4];
        let mut got = Vec::new();
        rail.recv(0, &mut bufs, &mut got).unwrap();
        assert!(got.is_empty(), "the rail port received nothing");
    }

    #[test]
    fn send_only_drops_are_counted_once_while_other_sockets_come_and_go() {
        let rail = UdpRail::bind(Ipv4Addr::LOCALHOST, 0, 4, 1 << 20, Offloads::ALL).unwrap();
        let stray = SocketAddrV4::new(Ipv4Addr::LOCALHOST, rail.ports()[1]);
        let attacker = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        for _ in 0..50 {
            attacker.send_to(&[7u8; 100], stray).unwrap();
        }
        let t0 = std::time::Instant::now();
        while rail.send_only_drops() != Some(50) {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{:?} dropped", rail.send_only_drops());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Enough sockets that the table spans many pages, opened and closed while it is read.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                for i in 0..20_000u32 {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    held.push(UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap());
                    if held.len() > 300 {
                        held.remove((i as usize * 7919) % held.len());
                    }
                }
            })
        };
        for _ in 0..200 {
            assert_eq!(rail.send_only_drops(), Some(50));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churn.join().unwrap();
    }

    #[test]
    fn batched_datagrams_arrive_from_the_entropys_port() {
        let a = UdpRail::bind(Ipv4Addr::LOCALHOST, 0, 4, 1 << 20, Offloads::ALL).unwrap();
        let b = UdpRail::bind(Ipv4Addr::LOCALHOST, 0, 1, 1 << 20, Offloads::ALL).unwrap();
        let dest = SocketAddrV4::new(Ipv4Addr::LOCALHOST, b.rail_port());
        let payloads: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 100 + i as usize]).collect();
        let pkts: Vec<OutDatagram<'_>> = payloads.iter().enumerate().map(|(i, p)| OutDatagram::whole((i / 3) as u16, p)).collect();
        assert_eq!(a.send(dest, &pkts).unwrap(), 10);
        let mut bufs = vec![vec![0u8; 2048]; 16];
        let mut got = Vec::new();
        let mut seen = Vec::new();
        for _ in 0..1000 {
            b.recv(0, &mut bufs, &mut got).unwrap();
            for (k, &(len, src, seg)) in got.iter().enumerate() {
                for r in segments(len, seg) {
                    seen.push((bufs[k][r.start], r.len(), src.port()));
                }
            }
            if seen.len() == 10 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        seen.sort();
        assert_eq!(seen.len(), 10);
        for (i, len, port) in seen {
            assert_eq!(len, 100 + i as usize);
            assert_eq!(port, a.ports()[(i / 3) as usize]);
        }
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn a_gro_buffer_splits_into_segments_inside_it() {
        let r: Vec<_> = segments(30, 10).collect();
        assert_eq!(r, [0..10, 10..20, 20..30]);
        // A truncated last segment.
        assert_eq!(segments(25, 10).collect::<Vec<_>>(), [0..10, 10..20, 20..25]);
        // No segment size: one datagram.
        assert_eq!(segments(25, 0).collect::<Vec<_>>(), [0..25]);
        // Bogus sizes: larger than the buffer, absurdly large, 1.
        assert_eq!(segments(25, 26).collect::<Vec<_>>(), [0..25]);
        assert_eq!(segments(25, usize::MAX).collect::<Vec<_>>(), [0..25]);
        assert_eq!(segments(5, 1).collect::<Vec<_>>(), [0..1, 1..2, 2..3, 3..4, 4..5]);
        // An empty buffer is one empty datagram (a runt, dropped by the packet checks).
        assert_eq!(segments(0, 7).collect::<Vec<_>>(), [0..0]);
        for len in 0..300 {
            for seg in [0, 1, 2, 3, 7, 64, 127, 128, 299, 300, 301, usize::MAX / 2] {
                let mut next = 0;
                for r in segments(len, seg) {
                    assert_eq!(r.start, next, "len {len} seg {seg}: ranges are contiguous");
                    assert!(r.end <= len, "len {len} seg {seg}: {r:?} leaves the buffer");
                    assert!(seg == 0 || r.len() <= seg, "len {len} seg {seg}: {r:?} is longer than a segment");
                    next = r.end;
                }
                assert_eq!(next, len, "len {len} seg {seg}: every byte is in a segment");
            }
        }
    }

    #[test]
    fn a_train_is_equal_datagrams_but_a_shorter_last_within_one_message() {
        let big: &[u8] = &[0u8; 9000];
        let small: &[u8] = &[0u8; 100];
        let t = |sizes: &[&[u8]]| train_len(&sizes.iter().map(|p| OutDatagram::whole(0, p)).collect::<Vec<_>>());
        assert_eq!(t(&[]), 0);
        assert_eq!(t(&[big]), 1);
        // 7 x 9000 fits in 65,507 bytes, 8 do not.
        assert_eq!(t(&[big; 10]), 7);
        // A shorter datagram ends the train (it is its last).
        assert_eq!(t(&[big, big, small, big]), 3);
        // A longer datagram cannot follow.
        assert_eq!(t(&[small, big]), 1);
        assert_eq!(t(&[small; 100]), MAX_TRAIN_SEGMENTS);
        assert_eq!(t(&[small, &[]]), 1);
    }

    /// Send `payloads` over one entropy from a rail with `tx` offloads to one with `rx` offloads and
    /// return what arrived (datagram by datagram, split as the engine splits), and how many coalesced
    /// buffers were seen.
    fn exchange(tx: Offloads, rx: Offloads, payloads: &[Vec<u8>]) -> (Vec<Vec<u8>>, usize, (u64, u64)) {
        let a = UdpRail::bind(Ipv4Addr::LOCALHOST, 0, 2, 4 << 20, tx).unwrap();
        let b = UdpRail::bind(Ipv4Addr::LOCALHOST, 0, 1, 4 << 20, rx).unwrap();
        let dest = SocketAddrV4::new(Ipv4Addr::LOCALHOST, b.rail_port());
        // In two pieces where they are long enough (a header, then the payload in place).
        let pkts: Vec<OutDatagram<'_>> =
            payloads.iter().map(|p| OutDatagram { entropy: 1, head: &p[..p.len().min(48)], tail: &p[p.len().min(48)..] }).collect();
        assert_eq!(a.send(dest, &pkts).unwrap(), payloads.len());
        let mut bufs = vec![vec![0u8; GRO_BUF_BYTES]; 16];
        let mut got = Vec::new();
        let mut seen = Vec::new();
        let mut coalesced = 0;
        let t0 = std::time::Instant::now();
        while seen.len() < payloads.len() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "only {} of {} arrived", seen.len(), payloads.len());
            b.recv(0, &mut bufs, &mut got).unwrap();
            for (k, &(len, src, seg)) in got.iter().enumerate() {
                assert_eq!(src.port(), a.ports()[1]);
                coalesced += usize::from(seg > 0 && seg < len);
                seen.extend(segments(len, seg).map(|r| bufs[k][r].to_vec()));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        (seen, coalesced, a.train_stats())
    }

    #[test]
    fn gso_and_gro_deliver_the_same_datagrams_as_the_plain_path() {
        // 20 full datagrams and a short one (a message's last packet), then a control-sized one.
        let mut payloads: Vec<Vec<u8>> = (0..20u32).map(|i| (0..8960u32).map(|b| (b * 7 + i * 13) as u8).collect()).collect();
        payloads.push(vec![0xab; 1234]);
        payloads.push(vec![0xcd; 64]);
        let (plain, plain_coalesced, plain_trains) = exchange(Offloads::NONE, Offloads::NONE, &payloads);
        assert_eq!(plain, payloads, "the plain path delivers every datagram, in order");
        assert_eq!(plain_coalesced, 0);
        assert_eq!(plain_trains, (0, 0));
        let (fast, fast_coalesced, (trains, in_trains)) = exchange(Offloads::ALL, Offloads::ALL, &payloads);
        assert_eq!(fast, payloads, "GSO trains received with GRO deliver the same datagrams, in order");
        // 21 datagrams in trains of at most 7 (the 1,234-byte one ends the third), then a single one.
        assert_eq!((trains, in_trains), (3, 21), "this kernel has UDP GSO on loopback");
        assert!(fast_coalesced > 0, "loopback hands a GRO socket the trains whole");
        // GSO towards a socket without GRO: the kernel splits the trains.
        let (mixed, mixed_coalesced, _) = exchange(Offloads::ALL, Offloads::NONE, &payloads);
        assert_eq!(mixed, payloads);
        assert_eq!(mixed_coalesced, 0);
    }
}
