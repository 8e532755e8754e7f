//! The process-wide engine (`Net`): discovers the rails, binds their sockets (or opens their RDMA
//! devices), and opens listeners and connects; the handshake is `handshake` and `listener`, the state
//! every comm shares `shared`.

use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use prism_lb::{LbRuntime, Topology};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::batch::SendBatches;
use super::comm::SendComm;
use super::config::{QpType, Transport};
use super::handshake::{io_err, new_token, write_handle, Connector};
use super::listener::Listener;
use super::progress::Progress;
use super::rail::{Rail, RailBackend};
use super::shared::{HandshakeStats, NetInner};
use super::{device, sysfs, DeviceInfo, TransportConfig, TransportError, HANDLE_LEN};
use crate::backend::udp::{Offloads, UdpRail, BATCH};
use crate::backend::verbs;
use crate::proto::ProtoConfig;
use crate::wire::{self, HELLO_MAX_RAILS};

const MAX_RAILS: usize = HELLO_MAX_RAILS;

impl Drop for Net {
    fn drop(&mut self) {
        // Comms normally close first (and stop the thread); this covers a caller that did not.
        self.inner.progress.stop();
    }
}

/// The process-wide engine. `Send + Sync`: NCCL calls it from several threads.
pub struct Net {
    inner: Arc<NetInner>,
    devices: Vec<DeviceInfo>,
    connector: Connector,
}

impl Net {
    /// Discover the rails, bind their sockets and get ready to listen and connect.
    pub fn new(cfg: TransportConfig, mut lb: prism_lb::LbConfig) -> Result<Net, TransportError> {
        let vdevs = match cfg.transport {
            Transport::Udp => {
                tracing::info!("transport: udp (PRISM_TRANSPORT=udp)");
                None
            }
            Transport::Verbs => match verbs::probe(&cfg.ib_hca, cfg.ib_gid_index) {
                Ok(d) => Some(d),
                Err(e) => return Err(TransportError::NoDevice(format!("PRISM_TRANSPORT=verbs: {e}"))),
            },
            Transport::Auto => match verbs::probe(&cfg.ib_hca, cfg.ib_gid_index) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::info!("transport: udp (no RDMA device: {e})");
                    None
                }
            },
        };
        let mut rails = Vec::new();
        let mut min_dgram = usize::MAX;
        if let Some(vdevs) = vdevs {
            let names: Vec<String> =
                vdevs.iter().map(|d| format!("{} (GID index {}, {}, {})", d.name, d.gid_index, d.ipv4, d.ifname)).collect();
            let why = if cfg.transport == Transport::Verbs { "PRISM_TRANSPORT=verbs" } else { "auto: RDMA device found" };
            let depths = cfg.verbs_depths();
            tracing::info!(
                "transport: verbs ({why}; {} {} QPs per connection and rail, {} receives and {} send slots each: \
                 {} KiB of registered rings per connection and rail; {})",
                cfg.paths,
                if cfg.qp == QpType::Rc { "RC" } else { "UC" },
                depths.recv,
                depths.send_slots,
                depths.ring_bytes(usize::from(cfg.paths)) >> 10,
                names.join(", ")
            );
            if let Some(w) = super::vcomm::shallow_receive_queue(depths.recv, cfg.ib_chunk) {
                tracing::warn!("{w}");
            }
            for (rail, d) in vdevs.into_iter().enumerate() {
                // Verbs device names are unique (one entry per device), so the names need no suffix.
                let p = sysfs::verbs_placement(std::path::Path::new(sysfs::SYSFS), &d.name, 1, &d.ifname, rail);
                let info = DeviceInfo {
                    name: format!("prism:{}", d.name),
                    ifname: d.ifname.clone(),
                    addr: std::net::IpAddr::V4(d.ipv4),
                    speed_mbps: p.speed_mbps,
                    mtu: d.mtu_bytes,
                    pci_path: p.pci_path,
                    guid: p.guid,
                };
                // One WRITE never spans two lb chunks: the path policy places a packet by the chunk
                // its offset falls in, so packets that cover several chunks would all follow the
                // first one's rail (with 64 KiB packets over 32 KiB chunks, every packet started on
                // an even chunk and one rail carried everything). Both sizes are whole lines
                // (multiples of `wire::LINE_BYTES`, checked by their parsers; rounded here again), so
                // every WRITE but a buffer's last one ends on a line boundary (NCCL's LL/LL128).
                // Unless PRISM_CHUNK says otherwise, the chunk grows to the verbs packet (a WRITE's
                // segmentation is the NIC's business, not bound by the MTU): 64 KiB by default.
                if !cfg.lb_chunk_set && lb.chunk_bytes < cfg.ib_chunk {
                    lb.chunk_bytes = cfg.ib_chunk;
                }
                let payload = cfg.ib_chunk.min(lb.chunk_bytes.max(1024)) as usize;
                let payload = payload - payload % wire::LINE_BYTES;
                min_dgram = min_dgram.min(wire::MAX_HEADER_LEN + payload);
                let addr = d.ipv4;
                rails.push(Arc::new(Rail::new(rails.len(), info, RailBackend::Verbs(Arc::new(d)), addr, min_dgram)));
            }
        }
        let devices = if rails.is_empty() { device::discover(&cfg.ifnames)? } else { Vec::new() };
        if cfg.udp_sport_base != 0 && !devices.is_empty() {
            // Checked before any socket exists, so the answer does not depend on which ports are free.
            let last = u32::from(cfg.udp_sport_base) + devices.len() as u32 * u32::from(cfg.paths) - 1;
            if last > u32::from(u16::MAX) {
                return Err(TransportError::Config(format!(
                    "PRISM_UDP_SPORT_BASE={}: {} rails x PRISM_PATHS={} need ports up to {last}, past 65535",
                    cfg.udp_sport_base,
                    devices.len(),
                    cfg.paths
                )));
            }
        }
        for info in devices {
            let std::net::IpAddr::V4(addr) = info.addr else {
                return Err(TransportError::NoDevice(format!("{}: only IPv4 is supported", info.ifname)));
            };
            // IP (20) + UDP (8) headers come out of the MTU; loopback's 64 KiB MTU is capped like jumbo frames.
            let mtu = if cfg.mtu == 0 { info.mtu.min(9000) } else { cfg.mtu } as usize;
            let max_dgram = mtu.saturating_sub(28);
            if max_dgram < wire::MAX_HEADER_LEN + wire::MIN_PAYLOAD {
                return Err(TransportError::Config(format!("PRISM_MTU={mtu}: too small for Prism's headers")));
            }
            min_dgram = min_dgram.min(max_dgram);
            let offloads = Offloads { gso: cfg.udp_gso, gro: cfg.udp_gro };
            let udp = if cfg.udp_sport_base == 0 {
                UdpRail::bind(addr, 0, cfg.paths, cfg.sockbuf, offloads)
                    .map_err(io_err(format!("binding UDP sockets on {}", info.ifname)))?
            } else {
                // Rail r's entropy e on port base + r * paths + e: a fabric that steers by source port
                // knows every entropy's uplink.
                // (Within 65535: checked above.)
                let base = u32::from(cfg.udp_sport_base);
                let first = base + rails.len() as u32 * u32::from(cfg.paths);
                let last = first + u32::from(cfg.paths) - 1;
                UdpRail::bind(addr, first as u16, cfg.paths, cfg.sockbuf, offloads).map_err(|e| {
                    TransportError::Config(format!(
                        "PRISM_UDP_SPORT_BASE={base}: rail {} ({}): cannot bind UDP source ports {first}..{last} on {addr}: {e}",
                        rails.len(),
                        info.ifname
                    ))
                })?
            };
            tracing::info!(
                rail = %info.name, addr = %addr, port = udp.rail_port(), paths = udp.paths(), max_datagram = max_dgram,
                gso = udp.gso(), gro = udp.gro(), "rail ready: {} source ports, one per entropy", udp.paths()
            );
            rails.push(Arc::new(Rail::new(rails.len(), info, RailBackend::Udp(udp), addr, max_dgram)));
        }
        if rails.len() > MAX_RAILS {
            return Err(TransportError::Config(format!("PRISM_IFNAMES: {} rails, at most {MAX_RAILS}", rails.len())));
        }
        let (lb_rt, host_id, seed) = lb_runtime(&cfg, &lb, &rails)?;
        let verbs = rails.iter().any(|r| r.backend.verbs().is_some());
        let proto = proto_config(&cfg, rails.len(), verbs, min_dgram);
        tracing::info!("load balancing: {} (host id {host_id})", lb.describe());
        // Ethereal's interceptor window; without it (or without Ethereal) each send is planned when posted.
        let batches = (lb.split == prism_lb::SplitKind::Ethereal && lb.ethereal.batch_us > 0).then(|| SendBatches::new(&lb_rt));
        let inner = Arc::new(NetInner {
            batches,
            cfg,
            lb,
            lb_rt,
            host_id,
            proto,
            start: Instant::now(),
            rails,
            closed: Mutex::new(Default::default()),
            seed,
            seeds: AtomicU64::new(0),
            progress: Progress::default(),
            board: super::board::PathBoard::default(),
            handshakes: HandshakeStats::default(),
        });
        let devices = inner.rails.iter().map(|r| r.info.clone()).collect();
        Ok(Net { inner, devices, connector: Connector::default() })
    }

    /// The rails, in NCCL device order.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// The backend moving the packets: "verbs" or "udp".
    pub fn backend(&self) -> &'static str {
        self.inner.backend_name()
    }

    /// Register `addr..addr + len` on every verbs rail (NCCL's `regMr`); nothing on UDP. Repeated
    /// registrations of the same range share one MR; each must be paired with [`Self::dereg_mr`].
    /// The caller vouches that the memory stays mapped until then.
    pub fn reg_mr(&self, addr: usize, len: usize) -> Result<(), TransportError> {
        let rails = &self.inner.rails;
        for (i, r) in rails.iter().enumerate() {
            if let Err(e) = r.backend.acquire_mr(addr, len) {
                for r in &rails[..i] {
                    r.backend.release_mr(addr, len);
                }
                return Err(TransportError::InvalidArgument(format!("regMr of {len} bytes at {addr:#x} on {e}")));
            }
        }
        Ok(())
    }

    /// Undo one [`Self::reg_mr`] of the same range.
    pub fn dereg_mr(&self, addr: usize, len: usize) {
        for r in &self.inner.rails {
            r.backend.release_mr(addr, len);
        }
    }

    fn rail(&self, dev: usize) -> Result<&Arc<Rail>, TransportError> {
        self.inner.rails.get(dev).ok_or(TransportError::BadDevice { dev, ndev: self.inner.rails.len() })
    }

    /// Start listening on `dev`; fills `handle` for the peer's `connect`.
    pub fn listen(&self, dev: usize, handle: &mut [u8; HANDLE_LEN]) -> Result<Listener, TransportError> {
        let rail = self.rail(dev)?.clone();
        let sock = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).map_err(io_err("TCP socket"))?;
        sock.set_nonblocking(true).map_err(io_err("TCP non-blocking"))?;
        sock.bind(&SockAddr::from(SocketAddrV4::new(rail.addr, 0))).map_err(io_err("TCP bind"))?;
        sock.listen(128).map_err(io_err("TCP listen"))?;
        let port = sock.local_addr().ok().and_then(|a| a.as_socket_ipv4()).map(|a| a.port()).unwrap_or(0);
        let nonce = new_token();
        write_handle(handle, rail.addr, port, nonce);
        tracing::debug!(rail = %rail.info.name, port, "listening");
        Ok(Listener::new(self.inner.clone(), rail, dev as u16, sock, nonce))
    }

    /// Connect to the listener described by `handle`; `Ok(None)` until the handshake is done.
    pub fn connect(&self, dev: usize, handle: &mut [u8; HANDLE_LEN]) -> Result<Option<SendComm>, TransportError> {
        self.connector.connect(&self.inner, dev, handle)
    }

    /// Per-rail counters and the statistics of the comms closed so far (bounded: every closed comm is
    /// summed per rail, peer and role; the first and last few are listed in full), as JSON.
    pub fn stats_json(&self) -> serde_json::Value {
        let rails: Vec<_> = self
            .inner
            .rails
            .iter()
            .map(|r| {
                let mut v = serde_json::json!({
                    "name": r.info.name, "ifname": r.info.ifname, "addr": r.info.addr.to_string(),
                    "unknown_token_dropped": r.unknown_token.load(Ordering::Relaxed),
                    "runt_dropped": r.runt.load(Ordering::Relaxed),
                    "wrong_port_dropped": r.wrong_port.load(Ordering::Relaxed),
                });
                if let (serde_json::Value::Object(m), serde_json::Value::Object(b)) = (&mut v, r.backend.json()) {
                    m.extend(b);
                }
                v
            })
            .collect();
        let mut out = serde_json::json!({
            "backend": self.inner.backend_name(),
            "config": { "transport": self.inner.cfg.describe(), "lb": self.inner.lb.describe() },
            "rails": rails,
            "handshakes": self.inner.handshakes.json(),
        });
        if let serde_json::Value::Object(m) = &mut out {
            m.extend(self.inner.closed.lock().to_json());
        }
        out
    }
}

/// The lb runtime of this process, this host's id in its topology and the process's seed (0: none).
fn lb_runtime(cfg: &TransportConfig, lb: &prism_lb::LbConfig, rails: &[Arc<Rail>]) -> Result<(LbRuntime, u32, u64), TransportError> {
    let n = rails.len() as u16;
    let topo = match &lb.topo_path {
        None => Topology::single_leaf(n),
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| TransportError::Config(format!("PRISM_TOPO={path}: cannot read it: {e}")))?;
            let t = Topology::from_json(&text).map_err(|e| TransportError::Config(format!("PRISM_TOPO={path}: {e}")))?;
            if t.rails() != n {
                return Err(TransportError::Config(format!(
                    "PRISM_TOPO={path}: the topology has {} rails but this host has {n} (PRISM_IFNAMES)",
                    t.rails()
                )));
            }
            t
        }
    };
    let host_id = if topo.lists_hosts() {
        let name = match &cfg.host {
            Some(h) => h.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default(),
        };
        topo.host_by_name(&name).ok_or_else(|| {
            TransportError::Config(format!("PRISM_TOPO: host '{name}' is not in the topology (set PRISM_HOST to its name there)"))
        })? as u32
    } else {
        // Any stable id per host will do: the address of its first rail.
        match rails[0].info.addr {
            std::net::IpAddr::V4(a) => u32::from(a),
            std::net::IpAddr::V6(_) => 0,
        }
    };
    let addr = match rails.first().map(|r| r.info.addr) {
        Some(std::net::IpAddr::V4(a)) => u32::from(a),
        _ => 0,
    };
    let process_seed = process_seed(cfg.seed, host_id, addr);
    let seed = if process_seed == 0 { rand::random() } else { process_seed };
    let rt = lb.runtime(topo, host_id as usize, seed).map_err(|e| TransportError::Config(format!("load balancing: {e}")))?;
    Ok((rt, host_id, process_seed))
}

/// This process's seed from `PRISM_SEED` (0: none, every choice random), its host id and its first
/// rail's address: reproducible from run to run, different from host to host. Every process used
/// `PRISM_SEED` itself before, so with it set every host drew the same "random" choices at the same
/// moments (Ethereal's start uplink and sub-flow order, PRO's start without a topology, DR's rotation,
/// each connection's spraying sequence), which on a fabric routed by source port lined their choices
/// up; the simulator has always mixed the host into each host's seed.
fn process_seed(seed: u64, host_id: u32, addr: u32) -> u64 {
    if seed == 0 {
        return 0;
    }
    prism_lb::splitmix64(seed ^ prism_lb::splitmix64((u64::from(host_id) << 32) | u64::from(addr))).max(1)
}

/// The protocol configuration of every connection of a `Net` with `n_rails` rails whose smallest
/// datagram is `min_dgram` bytes. Every value is already one the protocol can run with
/// (`ProtoConfig::sanitized` changes nothing), so no connection logs a correction: the variables were
/// checked when they were read, and what follows from them is clamped here once.
fn proto_config(cfg: &TransportConfig, n_rails: usize, verbs: bool, min_dgram: usize) -> ProtoConfig {
    let d = ProtoConfig::default();
    // Every rail uses the smallest payload so that a retransmission fits on any of them. A comm's
    // entropies cover every rail (rail-major), so its proto knows rails × paths of them. The
    // payload is whole lines (`wire::LINE_BYTES`): at MTU 9000 a datagram holds 8,908 payload
    // bytes, of which 8,832 are used, so that packets sprayed out of order never tear an LL line.
    let payload = min_dgram.saturating_sub(wire::MAX_HEADER_LEN);
    let window_pkts = cfg.window_pkts.clamp(1, crate::proto::OOO_WINDOW_PKTS as u32);
    // Before the first RTT sample a connection waits the initial RTO, which the floor
    // (`PRISM_RTO_MIN_US`) bounds from below like every other RTO; the ceiling is never below it.
    let rto_max_us = d.rto_max_us.max(cfg.rto_min_us);
    ProtoConfig {
        n_paths: cfg.paths.saturating_mul(n_rails as u16).max(1),
        max_payload: (payload - payload % wire::LINE_BYTES).max(wire::MIN_PAYLOAD),
        window_pkts,
        // A batch is reordered by up to its length when it is spread over the sockets; a small
        // window (slow links) cannot have that many packets overtake a lost one, so stay below it.
        reorder_threshold: d.reorder_threshold.max(BATCH as u32 + 32).min((window_pkts / 2).max(3)),
        rto_min_us: cfg.rto_min_us,
        rto_max_us,
        rto_initial_us: d.rto_initial_us.clamp(cfg.rto_min_us, rto_max_us),
        peer_timeout_us: cfg.peer_timeout_ms * 1000,
        stall_timeout_us: cfg.stall_timeout_ms * 1000,
        // Verbs: each path is a reliable connected QP, in order by itself; a SACK per MiB of
        // 64 KiB packets (and at each receive's end, or after the delay).
        reliable_paths: verbs,
        sack_every_pkts: if verbs { 16 } else { d.sack_every_pkts },
        ..d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_is_reproducible_per_process_but_differs_between_hosts() {
        assert_eq!(process_seed(0, 3, 0x0a00_0001), 0, "no PRISM_SEED: random choices");
        let a = process_seed(7, 0, 0x0a64_0002);
        assert_eq!(a, process_seed(7, 0, 0x0a64_0002));
        assert_ne!(a, 0);
        assert_ne!(a, process_seed(7, 1, 0x0a65_0102), "two hosts of one topology");
        assert_ne!(a, process_seed(7, 0, 0x0a65_0102), "two processes of one host on different rails");
        assert_ne!(a, process_seed(8, 0, 0x0a64_0002));
    }

    /// The engine's protocol configuration never needs the per-connection correction (which logs a
    /// WARN on every comm): with the defaults, at every bound of every variable it is built from, on
    /// UDP and verbs, with one rail and many.
    #[test]
    fn no_valid_configuration_needs_correcting_per_connection() {
        let d = TransportConfig::default();
        let mut cfgs = vec![d.clone()];
        for rto in [10, 2_000, 20_000, 200_000, 1_000_000, 10_000_000] {
            cfgs.push(TransportConfig { rto_min_us: rto, ..d.clone() });
        }
        for window_pkts in [1, 2, 3, 7, 64, 512, 4096, 65_536] {
            cfgs.push(TransportConfig { window_pkts, ..d.clone() });
        }
        for paths in [1, 16, 1024] {
            cfgs.push(TransportConfig { paths, ..d.clone() });
        }
        for ms in [10, 3_600_000] {
            cfgs.push(TransportConfig { peer_timeout_ms: ms, stall_timeout_ms: ms, ..d.clone() });
        }
        for cfg in &cfgs {
            for n_rails in [1, MAX_RAILS] {
                for verbs in [false, true] {
                    for min_dgram in [576 - 28, 1472, 8972, 65_507, 65_536 + wire::MAX_HEADER_LEN] {
                        let p = proto_config(cfg, n_rails, verbs, min_dgram);
                        assert_eq!(p.sanitized(), p, "{cfg:?} rails {n_rails} verbs {verbs} datagram {min_dgram}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_initial_rto_is_never_below_the_floor_and_the_ceiling_never_below_either() {
        let d = TransportConfig::default();
        let p = proto_config(&d, 1, false, 8972);
        assert_eq!((p.rto_min_us, p.rto_initial_us, p.rto_max_us), (20_000, 20_000, 200_000));
        let p = proto_config(&TransportConfig { rto_min_us: 2_000, ..d.clone() }, 1, false, 8972);
        assert_eq!((p.rto_min_us, p.rto_initial_us, p.rto_max_us), (2_000, 10_000, 200_000));
        let p = proto_config(&TransportConfig { rto_min_us: 1_000_000, ..d }, 1, false, 8972);
        assert_eq!((p.rto_min_us, p.rto_initial_us, p.rto_max_us), (1_000_000, 1_000_000, 1_000_000));
    }

    #[test]
    fn payloads_are_whole_lines_of_the_smallest_datagram() {
        let p = proto_config(&TransportConfig::default(), 2, false, 8972);
        assert_eq!((p.max_payload, p.n_paths), (8832, 32));
    }
}
