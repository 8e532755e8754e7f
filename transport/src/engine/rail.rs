//! One rail's shared datagram endpoint: its UDP sockets, and the table that hands each arriving
//! datagram to the connection whose token it carries. All comms on a rail share it, so whichever comm
//! makes progress drains the rail for everybody (NCCL drives different comms from different threads).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::DeviceInfo;
use crate::backend::udp::{segments, UdpRail, BATCH, GRO_BUF_BYTES};
use crate::backend::verbs::VerbsDevice;
use crate::wire;

/// Datagrams waiting for their connection: source, bytes (the Vec is a recycled receive buffer),
/// length, the segment size of a coalesced (GRO) buffer (0: one datagram), the connection's token, the
/// length past which a datagram is too long for the rail it arrived on, and that rail's index (the
/// buffer goes back to its pool).
/// A coalesced buffer may hold datagrams of other connections between the same two sockets: the
/// receiver reads only the segments that carry `token` (see [`Datagram::packets`]).
pub(crate) struct Datagram {
    pub src: SocketAddrV4,
    pub buf: Vec<u8>,
    pub len: usize,
    pub seg: usize,
    pub token: u64,
    pub max_len: usize,
    pub rail: usize,
}

impl Datagram {
    /// The datagrams of this buffer that carry its token, each at most `max_len` bytes (a longer one is
    /// cut to one byte over the rail's largest datagram, which the packet checks reject, as they reject
    /// any oversized datagram).
    pub fn packets(&self) -> impl Iterator<Item = &[u8]> {
        let max_len = self.max_len;
        let len = self.len.min(self.buf.len());
        segments(len, self.seg)
            .map(move |r| &self.buf[r.start..r.end.min(r.start.saturating_add(max_len))])
            .filter(move |p| wire::peek_token(p) == Some(self.token))
    }
}

/// Datagrams demultiplexed to one connection.
#[derive(Default)]
pub(crate) struct Inbox {
    q: Mutex<Vec<Datagram>>,
}

impl Inbox {
    /// Take everything queued so far.
    pub fn drain(&self, into: &mut Vec<Datagram>) {
        std::mem::swap(&mut *self.q.lock(), into);
    }
}

/// `poll_rx` also drains the rail's send-only sockets every this many calls (one `epoll_wait` when
/// they are empty; the progress thread drains them as soon as they are readable).
const STRAY_EVERY: u32 = 16;

/// Most connections whose datagrams one coalesced buffer is handed to (GRO merges datagrams of one
/// socket pair, which all comms between two ranks on a rail share; normally one).
const MAX_TOKENS_PER_BUF: usize = 8;

/// The receive batch of a UDP rail (named apart from proto's receive state).
struct RxBatch {
    bufs: Vec<Vec<u8>>,
    got: Vec<(usize, SocketAddrV4, usize)>,
    polls: u32,
}

/// Receive buffers per `recvmmsg` when GRO is on (each holds up to 64 KiB of coalesced datagrams).
const GRO_BATCH: usize = 16;

/// After a receive found the rail port empty, [`Rail::poll_rx`] skips the system call for this long
/// (µs). NCCL's proxy tests its requests in a tight loop, each test progressing the comm: most of
/// those `recvmmsg` calls found nothing (626,000 of them in a 2-rank 64 MiB sendrecv of 44
/// iterations, against 660,000 datagrams received), at 1-2 µs each. A datagram arriving meanwhile
/// waits at most this long, and not at all when the progress thread is the one waiting (its `poll`
/// says the socket is readable, see [`Rail::rx_readable`]).
const RX_IDLE_US: u64 = 10;

/// `rx_empty_at` when the rail port is not known to be empty.
const NOT_EMPTY: u64 = u64::MAX;

/// Receive batches one progress call takes from each rail at most (bounded so that one test() call
/// cannot be held hostage by a flood).
pub(crate) const RX_ROUNDS: usize = 4;

/// Bytes of spare receive buffers a rail keeps for reuse (at least `RX_ROUNDS` batches): as much as
/// the default socket buffer (`PRISM_SOCKBUF`), i.e. about what a connection's window has queued in
/// the inboxes at once. With only one `poll_rx` worth (4 MiB of GRO buffers) the pool ran dry whenever
/// the comms lagged behind the rail (each comm drains its inbox only when it progresses), and every
/// buffer it lacked was a fresh zeroed 64 KiB allocation (memset and page faults: 3 to 5 % of the
/// CPU of a 64 MiB sendrecv), freed again on its return.
const SPARE_BYTES: usize = 8 << 20;

/// What moves a rail's packets: the one place the engine tells its two backends apart.
pub(crate) enum RailBackend {
    /// The rail's UDP sockets (one per entropy, plus the rail port).
    Udp(UdpRail),
    /// The RDMA device (QPs are per connection, in `vcomm`).
    Verbs(Arc<VerbsDevice>),
}

impl RailBackend {
    /// The UDP sockets, on a UDP rail.
    pub fn udp(&self) -> Option<&UdpRail> {
        match self {
            RailBackend::Udp(u) => Some(u),
            RailBackend::Verbs(_) => None,
        }
    }

    /// The RDMA device, on a verbs rail.
    pub fn verbs(&self) -> Option<&Arc<VerbsDevice>> {
        match self {
            RailBackend::Udp(_) => None,
            RailBackend::Verbs(d) => Some(d),
        }
    }

    /// Take a registration of `addr..addr + len` (verbs; nothing on UDP). The error names the device.
    pub fn acquire_mr(&self, addr: usize, len: usize) -> Result<(), String> {
        match self {
            RailBackend::Udp(_) => Ok(()),
            RailBackend::Verbs(d) => d.acquire(addr, len).map(|_| ()).map_err(|e| format!("{}: {e}", d.name)),
        }
    }

    /// Drop one registration taken by [`Self::acquire_mr`] of the same range.
    pub fn release_mr(&self, addr: usize, len: usize) {
        if let RailBackend::Verbs(d) = self {
            d.release((addr, len.max(1)));
        }
    }

    /// "udp" or "verbs" (as `PRISM_TRANSPORT` spells it).
    pub fn name(&self) -> &'static str {
        match self {
            RailBackend::Udp(_) => "udp",
            RailBackend::Verbs(_) => "verbs",
        }
    }

    /// The backend's part of the rail's statistics.
    pub fn json(&self) -> serde_json::Value {
        match self {
            RailBackend::Udp(u) => {
                let (trains, in_trains) = u.train_stats();
                serde_json::json!({
                    "source_ports": u.ports(), "verbs_device": null, "wrong_port_kernel_dropped": u.send_only_drops(),
                    "send_errors": u.send_errors(), "send_buffer_full_dropped": u.send_full(), "gso": u.gso(), "gro": u.gro(),
                    "gso_trains": trains, "gso_train_datagrams": in_trains,
                })
            }
            RailBackend::Verbs(d) => serde_json::json!({
                "source_ports": null,
                "verbs_device": { "name": d.name, "gid_index": d.gid_index, "mtu": d.mtu_bytes, "registrations": d.registrations() },
                "wrong_port_kernel_dropped": null, "send_errors": null,
                "send_buffer_full_dropped": null, "gso": null, "gro": null, "gso_trains": null, "gso_train_datagrams": null,
            }),
        }
    }
}

/// A rail: device description, backend, demux table, recycled buffers.
pub(crate) struct Rail {
    /// Position in the engine's rails (NCCL's device index).
    pub index: usize,
    pub info: DeviceInfo,
    /// UDP sockets or RDMA device.
    pub backend: RailBackend,
    /// The rail's IPv4 address.
    pub addr: Ipv4Addr,
    /// Largest datagram this rail sends or accepts (IP/UDP headers excluded).
    pub max_datagram: usize,
    /// Bytes of each receive buffer: one datagram and a byte, or a coalesced (GRO) buffer.
    buf_len: usize,
    rx: Mutex<RxBatch>,
    /// When (engine clock, µs) a receive last found the rail port empty; `NOT_EMPTY` when the last one
    /// did not, or the socket became readable since.
    rx_empty_at: AtomicU64,
    routes: RwLock<HashMap<u64, Arc<Inbox>>>,
    spare: Mutex<Vec<Vec<u8>>>,
    /// Datagrams whose token matched no connection (late packets of closed comms, strays).
    pub unknown_token: AtomicU64,
    /// Datagrams too short to carry a token.
    pub runt: AtomicU64,
    /// Datagrams that arrived on a send-only socket (peers send only to the rail port): discarded.
    pub wrong_port: AtomicU64,
}

impl Rail {
    pub fn new(index: usize, info: DeviceInfo, backend: RailBackend, addr: Ipv4Addr, max_datagram: usize) -> Self {
        // One spare byte so that an oversized datagram shows up as longer than allowed, not truncated.
        let (nbufs, buf_len) = match backend.udp() {
            Some(u) if u.gro() => (GRO_BATCH, GRO_BUF_BYTES.max(max_datagram + 1)),
            Some(_) => (BATCH, max_datagram + 1),
            None => (0, 0),
        };
        let bufs = (0..nbufs).map(|_| vec![0u8; buf_len]).collect();
        Self {
            index,
            info,
            backend,
            addr,
            max_datagram,
            buf_len,
            rx: Mutex::new(RxBatch { bufs, got: Vec::with_capacity(BATCH), polls: 0 }),
            rx_empty_at: AtomicU64::new(NOT_EMPTY),
            routes: RwLock::new(HashMap::new()),
            spare: Mutex::new(Vec::new()),
            unknown_token: AtomicU64::new(0),
            runt: AtomicU64::new(0),
            wrong_port: AtomicU64::new(0),
        }
    }

    /// The UDP port peers send to (0 on a verbs rail).
    pub fn port(&self) -> u16 {
        self.backend.udp().map_or(0, UdpRail::rail_port)
    }

    /// Deliver datagrams carrying `token` to `inbox` from now on.
    pub fn register(&self, token: u64, inbox: Arc<Inbox>) {
        self.routes.write().insert(token, inbox);
    }

    /// Stop delivering to `token`.
    pub fn unregister(&self, token: u64) {
        self.routes.write().remove(&token);
    }

    /// Give receive buffers back for reuse.
    pub fn recycle(&self, bufs: impl Iterator<Item = Vec<u8>>) {
        let mut spare = self.spare.lock();
        // So that a steady flow takes its buffers from here, not from the allocator (which zeroes them).
        let batch = if self.buf_len > self.max_datagram + 1 { GRO_BATCH } else { BATCH };
        let cap = (SPARE_BYTES / self.buf_len.max(1)).max(RX_ROUNDS * batch);
        let room = cap.saturating_sub(spare.len());
        spare.extend(bufs.filter(|b| b.len() >= self.buf_len).take(room));
    }

    /// Discard (and count) what reached the rail's send-only sockets.
    pub fn drain_strays(&self) {
        let Some(udp) = self.backend.udp() else { return };
        match udp.drain_strays() {
            Ok(n) => {
                self.wrong_port.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(rail = %self.info.name, "draining the send-only sockets failed: {e}"),
        }
    }

    /// The rail port is readable (the progress thread's `poll` said so): the next [`Rail::poll_rx`]
    /// reads it, however recently it was found empty.
    pub fn rx_readable(&self) {
        self.rx_empty_at.store(NOT_EMPTY, Ordering::Relaxed);
    }

    /// Receive one batch from the rail's socket into the inboxes (and, every `STRAY_EVERY` calls,
    /// drain its send-only sockets). Returns true when the batch was full (more may be waiting); false
    /// when the socket had no more, was found empty less than `RX_IDLE_US` before `now` (engine clock,
    /// µs; no system call then), or another thread is already draining (it delivers our datagrams
    /// too). One batch at a time, so that the caller copies what arrived out of the receive buffers
    /// while they are still in this core's cache (`CommCore::progress` alternates the two).
    pub fn poll_rx(&self, now: u64) -> bool {
        let Some(udp) = self.backend.udp() else { return false };
        let empty_at = self.rx_empty_at.load(Ordering::Relaxed);
        if empty_at != NOT_EMPTY && now.saturating_sub(empty_at) < RX_IDLE_US {
            return false;
        }
        let Some(mut rx) = self.rx.try_lock() else { return false };
        let RxBatch { bufs, got, polls } = &mut *rx;
        *polls = polls.wrapping_add(1);
        if *polls % STRAY_EVERY == 0 {
            self.drain_strays();
        }
        if let Err(e) = udp.recv(0, bufs, got) {
            tracing::warn!(rail = %self.info.name, "recvmmsg failed: {e}");
            return false;
        }
        let full = got.len() >= bufs.len().min(BATCH);
        self.rx_empty_at.store(if full { NOT_EMPTY } else { now }, Ordering::Relaxed);
        if got.is_empty() {
            return false;
        }
        let routes = self.routes.read();
        let mut spare = self.spare.lock();
        for (k, &(len, src, seg)) in got.iter().enumerate() {
            let len = len.min(bufs[k].len());
            // Each distinct token in the buffer (one, unless connections between the same two
            // sockets were coalesced together), in order of appearance; bounded by the segments.
            let mut tokens = [0u64; MAX_TOKENS_PER_BUF];
            let mut ntok = 0;
            for r in segments(len, seg) {
                let Some(token) = wire::peek_token(&bufs[k][r]) else {
                    self.runt.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                if tokens[..ntok].contains(&token) {
                    continue;
                }
                if !routes.contains_key(&token) {
                    self.unknown_token.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if ntok == MAX_TOKENS_PER_BUF {
                    // More connections in one buffer than expected: the rest are lost (and recovered).
                    self.unknown_token.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                tokens[ntok] = token;
                ntok += 1;
            }
            for (i, &token) in tokens[..ntok].iter().enumerate() {
                let Some(inbox) = routes.get(&token) else { continue };
                let fresh = spare.pop().unwrap_or_else(|| vec![0u8; self.buf_len]);
                let buf = if i + 1 == ntok {
                    // The last (normally the only) connection takes the buffer itself.
                    std::mem::replace(&mut bufs[k], fresh)
                } else {
                    // A copy for each other connection in it (rare: a coalesced mix).
                    let mut copy = fresh;
                    copy[..len].copy_from_slice(&bufs[k][..len]);
                    copy
                };
                inbox.q.lock().push(Datagram { src, buf, len, seg, token, max_len: self.max_datagram + 1, rail: self.index });
            }
        }
        drop(spare);
        full
    }
}
