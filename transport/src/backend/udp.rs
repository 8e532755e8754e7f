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
//! Both directions are batched (`sendmmsg`/`recvmmsg`, through `nix`'s safe wrappers, so this file
//! needs no `unsafe`).

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::socket::{recvmmsg, sendmmsg, MsgFlags, MultiHeaders, SockaddrIn};
use socket2::{Domain, Protocol, Socket, Type};

/// Most datagrams one `sendmmsg`/`recvmmsg` moves.
pub const BATCH: usize = 64;

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
    /// Bind `paths` non-blocking sockets on `addr`, each on its own ephemeral port. Socket 0 (the rail
    /// port) gets `sockbuf_bytes` of receive buffer; the others receive nothing legitimate and get the
    /// kernel's smallest (see the module comment).
    pub fn bind(addr: Ipv4Addr, paths: u16, sockbuf_bytes: u32) -> io::Result<Self> {
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
            s.bind(&SocketAddrV4::new(addr, 0).into())?;
            let u: UdpSocket = s.into();
            if i > 0 {
                strays.add(&u, EpollEvent::new(EpollFlags::EPOLLIN, u64::from(i)))?;
            }
            ports.push(u.local_addr()?.port());
            socks.push(u);
        }
        Ok(Self { socks, ports, addr, strays, send_errors: std::sync::atomic::AtomicU64::new(0) })
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

    /// Send `pkts` (entropy, bytes) to `dest` with one `sendmmsg` per entropy: a socket is one source
    /// port, so a batch sprayed over P entropies costs P system calls, not one per packet. Packets of
    /// one entropy keep their order; across entropies the batch is reordered by at most its length
    /// (the transport's reorder threshold allows for that). A full socket buffer (`EAGAIN`) drops the
    /// rest of that entropy's run: the transport treats it as loss. Returns how many datagrams the
    /// kernel took.
    pub fn send(&self, dest: SocketAddrV4, pkts: &[(u16, &[u8])]) -> io::Result<usize> {
        let addr = SockaddrIn::from(dest);
        let mut order: Vec<usize> = (0..pkts.len()).collect();
        order.sort_by_key(|&k| pkts[k].0);
        let mut sent = 0;
        let mut i = 0;
        while i < order.len() {
            let e = pkts[order[i]].0;
            let mut j = i + 1;
            while j < order.len() && pkts[order[j]].0 == e {
                j += 1;
            }
            let sock = &self.socks[e as usize % self.socks.len()];
            let iovs: Vec<[IoSlice<'_>; 1]> = order[i..j].iter().map(|&k| [IoSlice::new(pkts[k].1)]).collect();
            let addrs = vec![Some(addr); j - i];
            let mut hdrs = MultiHeaders::<SockaddrIn>::preallocate(j - i, None);
            // sendmmsg stops at the first datagram that fails and reports the error on the next call:
            // one refused datagram (a local firewall rule answers EPERM, a route error) must not take
            // the rest of the run with it. Only a full buffer (EAGAIN) ends the run.
            let mut k = 0;
            while k < j - i {
                match sendmmsg(sock.as_raw_fd(), &mut hdrs, &iovs[k..], &addrs[k..], [], MsgFlags::MSG_DONTWAIT) {
                    Ok(res) => {
                        let n = res.count();
                        sent += n;
                        k += n;
                        if n == 0 {
                            break;
                        }
                    }
                    Err(nix::errno::Errno::EAGAIN) => break,
                    Err(err) => {
                        if self.send_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
                            tracing::warn!(
                                "a datagram was refused by the local stack ({err}); it is lost and resent (counted in send_errors)"
                            );
                        }
                        k += 1;
                    }
                }
            }
            i = j;
        }
        Ok(sent)
    }

    /// Receive up to `bufs.len()` (at most `BATCH`) datagrams from socket `sock` without blocking;
    /// the k-th `(len, source)` in `out` describes `bufs[k]`.
    pub fn recv(&self, sock: usize, bufs: &mut [Vec<u8>], out: &mut Vec<(usize, SocketAddrV4)>) -> io::Result<()> {
        out.clear();
        let n = bufs.len().min(BATCH);
        let mut hdrs = MultiHeaders::<SockaddrIn>::preallocate(n, None);
        let mut iovs: Vec<[IoSliceMut<'_>; 1]> = bufs[..n].iter_mut().map(|b| [IoSliceMut::new(&mut b[..])]).collect();
        match recvmmsg(self.socks[sock].as_raw_fd(), &mut hdrs, iovs.iter_mut(), MsgFlags::MSG_DONTWAIT, None) {
            Ok(res) => {
                for r in res {
                    // Keep one entry per datagram so that entry k stays buffer k; a datagram without a
                    // source (none on UDP) gets 0.0.0.0:0, which no connection accepts as its peer.
                    let src = r.address.map_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0), |a| SocketAddrV4::new(a.ip(), a.port()));
                    out.push((r.bytes, src));
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
    /// where the filter could not be attached), from the `drops` column of `/proc/net/udp` (this
    /// network namespace's sockets; an address and port name one socket). `None` without procfs.
    /// Reads a file: for statistics, not for the data path.
    pub fn send_only_drops(&self) -> Option<u64> {
        let table = std::fs::read_to_string("/proc/net/udp").ok()?;
        // procfs prints the address as the u32 in memory, in hex.
        let addr = format!("{:08X}", u32::from_ne_bytes(self.addr.octets()));
        let mut total = 0u64;
        for line in table.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(drops)) = (f.get(1), f.last()) else { continue };
            let Some((a, p)) = local.split_once(':') else { continue };
            let Ok(port) = u16::from_str_radix(p, 16) else { continue };
            if a.eq_ignore_ascii_case(&addr) && self.ports[1..].contains(&port) {
                total += drops.parse::<u64>().unwrap_or(0);
            }
        }
        Some(total)
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
        let rail = UdpRail::bind(Ipv4Addr::LOCALHOST, 8, 1 << 20).unwrap();
        let mut ports = rail.ports().to_vec();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 8);
    }

    #[test]
    fn datagrams_at_a_send_only_port_are_dropped_by_the_kernel_and_counted() {
        let rail = UdpRail::bind(Ipv4Addr::LOCALHOST, 4, 1 << 20).unwrap();
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
    fn batched_datagrams_arrive_from_the_entropys_port() {
        let a = UdpRail::bind(Ipv4Addr::LOCALHOST, 4, 1 << 20).unwrap();
        let b = UdpRail::bind(Ipv4Addr::LOCALHOST, 1, 1 << 20).unwrap();
        let dest = SocketAddrV4::new(Ipv4Addr::LOCALHOST, b.rail_port());
        let payloads: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 100 + i as usize]).collect();
        let pkts: Vec<(u16, &[u8])> = payloads.iter().enumerate().map(|(i, p)| ((i / 3) as u16, &p[..])).collect();
        assert_eq!(a.send(dest, &pkts).unwrap(), 10);
        let mut bufs = vec![vec![0u8; 2048]; 16];
        let mut got = Vec::new();
        let mut seen = Vec::new();
        for _ in 0..1000 {
            b.recv(0, &mut bufs, &mut got).unwrap();
            for (k, (len, src)) in got.iter().enumerate() {
                seen.push((bufs[k][0], *len, src.port()));
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
}
