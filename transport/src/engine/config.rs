//! Transport configuration from `PRISM_*` variables (passed in as a map; the engine never reads the
//! environment itself, so tests and the plugin configure it the same way).

use std::collections::BTreeMap;

use super::TransportError;

/// Everything the engine and its backends can be told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportConfig {
    /// `PRISM_IFNAMES`: interfaces to use as rails, in order; empty = the default route's interface.
    pub ifnames: Vec<String>,
    /// `PRISM_PATHS`: entropies (UDP source ports) per rail.
    pub paths: u16,
    /// `PRISM_MTU`: largest datagram Prism sends, IP and UDP headers included; 0 = the interface MTU
    /// capped at 9000.
    pub mtu: u32,
    /// `PRISM_WINDOW`: data packets in flight per connection.
    pub window_pkts: u32,
    /// `PRISM_PEER_TIMEOUT_MS`: silence after which outstanding requests fail.
    pub peer_timeout_ms: u64,
    /// `PRISM_STALL_TIMEOUT_MS`: time without progress (DATA unacknowledged, a started receive without
    /// new data) after which outstanding requests fail although the peer still answers.
    pub stall_timeout_ms: u64,
    /// `PRISM_CONNECT_TIMEOUT_MS`: how long a handshake may take before connect/accept fail.
    pub connect_timeout_ms: u64,
    /// `PRISM_RTO_MIN_US`: lower clamp of the per-path retransmission timeout.
    pub rto_min_us: u64,
    /// `PRISM_SOCKBUF`: socket send/receive buffer size in bytes.
    pub sockbuf: u32,
    /// `PRISM_SEED`: seed of every random choice (tokens excepted); 0 = from the OS.
    pub seed: u64,
    /// `PRISM_HOST`: this host's name in the `PRISM_TOPO` topology (default: the hostname).
    pub host: Option<String>,
    /// `PRISM_TRANSPORT`: which backend moves the packets.
    pub transport: Transport,
    /// `PRISM_IB_HCA`: RDMA devices to use as rails, in order; empty = every active one.
    pub ib_hca: Vec<String>,
    /// `PRISM_QP`: the verbs data QPs' type.
    pub qp: QpType,
    /// `PRISM_IB_GID_INDEX`: GID index to use; `None` = the first RoCEv2 IPv4-mapped one.
    pub ib_gid_index: Option<u8>,
    /// `PRISM_IB_CHUNK`: payload bytes of one verbs DATA packet (one RDMA WRITE).
    pub ib_chunk: u32,
    /// `PRISM_IB_RECV_DEPTH`: receive WQEs (each with a 1 KiB ring slot) per verbs QP.
    pub ib_recv_depth: u32,
    /// `PRISM_IB_SEND_SLOTS`: send ring slots (1 KiB each) per verbs QP.
    pub ib_send_slots: u32,
    /// `PRISM_CHUNK` (the load-balancing chunk) was set: on verbs it then caps `ib_chunk`;
    /// otherwise the chunk grows to `ib_chunk` there.
    pub lb_chunk_set: bool,
    /// `PRISM_UDP_GSO`: send runs of equal datagrams of one entropy as one GSO train (`UDP_SEGMENT`)
    /// where the kernel supports it.
    pub udp_gso: bool,
    /// `PRISM_UDP_GRO`: receive coalesced datagrams (`UDP_GRO`) where the kernel supports it.
    pub udp_gro: bool,
    /// `PRISM_UDP_TRAIN`: a message's new datagrams go on one entropy this many at a time (one GSO
    /// train); 1 = each datagram picked on its own; 0 = `auto` (see [`TransportConfig::train_pkts`]).
    pub udp_train: u32,
    /// `PRISM_UDP_SPORT_BASE`: 0 = every UDP socket on an ephemeral port; else rail `r`'s entropy `e`
    /// binds port `base + r * paths + e` (a fabric that routes by source port can then know which
    /// entropy takes which uplink).
    pub udp_sport_base: u16,
}

/// `PRISM_TRANSPORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Verbs when an active RDMA device with a RoCEv2 IPv4 GID exists, else UDP.
    Auto,
    /// Verbs or fail.
    Verbs,
    /// UDP sockets.
    Udp,
}

/// `PRISM_QP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpType {
    /// Unreliable connected (Prism's proto does the reliability).
    Uc,
    /// Reliable connected.
    Rc,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            ifnames: Vec::new(),
            paths: 16,
            mtu: 0,
            window_pkts: 512,
            peer_timeout_ms: 10_000,
            stall_timeout_ms: 20_000,
            connect_timeout_ms: 120_000,
            rto_min_us: 20_000,
            sockbuf: 8 << 20,
            seed: 0,
            host: None,
            transport: Transport::Auto,
            ib_hca: Vec::new(),
            qp: QpType::Uc,
            ib_gid_index: None,
            ib_chunk: 65_536,
            ib_recv_depth: crate::backend::verbs::RECV_DEPTH as u32,
            ib_send_slots: crate::backend::verbs::SEND_SLOTS as u32,
            lb_chunk_set: false,
            udp_gso: true,
            udp_gro: true,
            udp_train: 0,
            udp_sport_base: 0,
        }
    }
}

/// A 0/1 switch.
fn flag(vars: &BTreeMap<String, String>, var: &str, out: &mut bool) -> Result<(), TransportError> {
    match vars.get(var).map(|v| v.trim()) {
        None => Ok(()),
        Some("1") => {
            *out = true;
            Ok(())
        }
        Some("0") => {
            *out = false;
            Ok(())
        }
        Some(v) => Err(bad(var, v, "must be 0 or 1")),
    }
}

fn bad(var: &str, value: &str, reason: &str) -> TransportError {
    TransportError::Config(format!("{var}={value}: {reason}"))
}

fn num<T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy>(
    vars: &BTreeMap<String, String>,
    var: &str,
    lo: T,
    hi: T,
    into: &mut T,
) -> Result<(), TransportError> {
    if let Some(v) = vars.get(var) {
        let n: T = v.trim().parse().map_err(|_| bad(var, v, &format!("must be a number between {lo} and {hi}")))?;
        if n < lo || n > hi {
            return Err(bad(var, v, &format!("must be between {lo} and {hi}")));
        }
        *into = n;
    }
    Ok(())
}

impl TransportConfig {
    /// The `PRISM_*` variables this crate understands (the plugin rejects names nobody knows).
    pub const VARS: &'static [&'static str] = &[
        "PRISM_IFNAMES",
        "PRISM_PATHS",
        "PRISM_MTU",
        "PRISM_WINDOW",
        "PRISM_PEER_TIMEOUT_MS",
        "PRISM_STALL_TIMEOUT_MS",
        "PRISM_CONNECT_TIMEOUT_MS",
        "PRISM_RTO_MIN_US",
        "PRISM_SOCKBUF",
        "PRISM_SEED",
        "PRISM_HOST",
        "PRISM_TRANSPORT",
        "PRISM_IB_HCA",
        "PRISM_QP",
        "PRISM_IB_GID_INDEX",
        "PRISM_IB_CHUNK",
        "PRISM_IB_RECV_DEPTH",
        "PRISM_IB_SEND_SLOTS",
        "PRISM_UDP_GSO",
        "PRISM_UDP_GRO",
        "PRISM_UDP_TRAIN",
        "PRISM_UDP_SPORT_BASE",
    ];

    /// Parse the variables; absent ones keep their defaults, bad ones are errors naming the variable.
    pub fn from_vars(vars: &BTreeMap<String, String>) -> Result<Self, TransportError> {
        let mut c = Self::default();
        if let Some(v) = vars.get("PRISM_IFNAMES") {
            let names: Vec<String> = v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
            if names.is_empty() {
                return Err(bad("PRISM_IFNAMES", v, "must list interface names, e.g. eth0,eth1"));
            }
            if let Some(n) = names.iter().find(|n| n.len() > 15 || n.contains('/')) {
                return Err(bad("PRISM_IFNAMES", v, &format!("'{n}' is not an interface name")));
            }
            c.ifnames = names;
        }
        num(vars, "PRISM_PATHS", 1, 1024, &mut c.paths)?;
        if let Some(v) = vars.get("PRISM_MTU") {
            let mut m = 0u32;
            num(vars, "PRISM_MTU", 576, 65_535, &mut m).map_err(|_| bad("PRISM_MTU", v, "must be between 576 and 65535"))?;
            c.mtu = m;
        }
        // The receiver's out-of-order window bounds what can be in flight.
        num(vars, "PRISM_WINDOW", 1, crate::proto::OOO_WINDOW_PKTS as u32, &mut c.window_pkts)?;
        num(vars, "PRISM_PEER_TIMEOUT_MS", 10, 3_600_000, &mut c.peer_timeout_ms)?;
        num(vars, "PRISM_STALL_TIMEOUT_MS", 10, 3_600_000, &mut c.stall_timeout_ms)?;
        num(vars, "PRISM_CONNECT_TIMEOUT_MS", 10, 3_600_000, &mut c.connect_timeout_ms)?;
        num(vars, "PRISM_RTO_MIN_US", 10, 10_000_000, &mut c.rto_min_us)?;
        num(vars, "PRISM_SOCKBUF", 65_536, 1 << 30, &mut c.sockbuf)?;
        num(vars, "PRISM_SEED", 0, u64::MAX, &mut c.seed)?;
        if let Some(h) = vars.get("PRISM_HOST") {
            if h.trim().is_empty() {
                return Err(bad("PRISM_HOST", h, "must name this host as the topology does"));
            }
            c.host = Some(h.trim().to_string());
        }
        if let Some(v) = vars.get("PRISM_TRANSPORT") {
            c.transport = match v.trim() {
                "auto" => Transport::Auto,
                "verbs" => Transport::Verbs,
                "udp" => Transport::Udp,
                _ => return Err(bad("PRISM_TRANSPORT", v, "must be auto, verbs or udp")),
            };
        }
        if let Some(v) = vars.get("PRISM_IB_HCA") {
            let names: Vec<String> = v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
            if names.is_empty() || names.iter().any(|n| n.len() > 63 || n.contains('/')) {
                return Err(bad("PRISM_IB_HCA", v, "must list RDMA device names, e.g. rxe0,rxe1"));
            }
            c.ib_hca = names;
        }
        if let Some(v) = vars.get("PRISM_QP") {
            c.qp = match v.trim() {
                "uc" => QpType::Uc,
                "rc" => QpType::Rc,
                _ => return Err(bad("PRISM_QP", v, "must be uc or rc")),
            };
        }
        if vars.contains_key("PRISM_IB_GID_INDEX") {
            let mut g = 0u8;
            num(vars, "PRISM_IB_GID_INDEX", 0, 255, &mut g)?;
            c.ib_gid_index = Some(g);
        }
        num(vars, "PRISM_IB_CHUNK", 1024, 1 << 24, &mut c.ib_chunk)?;
        // At least two repost chains deep, so that reposting never waits for the queue to run dry.
        num(vars, "PRISM_IB_RECV_DEPTH", 2 * crate::backend::verbs::REPOST_BATCH as u32, 16_384, &mut c.ib_recv_depth)?;
        num(vars, "PRISM_IB_SEND_SLOTS", 16, 8_192, &mut c.ib_send_slots)?;
        c.lb_chunk_set = vars.contains_key("PRISM_CHUNK");
        flag(vars, "PRISM_UDP_GSO", &mut c.udp_gso)?;
        flag(vars, "PRISM_UDP_GRO", &mut c.udp_gro)?;
        match vars.get("PRISM_UDP_TRAIN").map(|v| v.trim()) {
            Some("auto") => c.udp_train = 0,
            Some(v) => {
                num(vars, "PRISM_UDP_TRAIN", 1, 64, &mut c.udp_train).map_err(|_| bad("PRISM_UDP_TRAIN", v, "must be auto or 1-64"))?
            }
            None => {}
        }
        num(vars, "PRISM_UDP_SPORT_BASE", 0, 65_535, &mut c.udp_sport_base)?;
        if c.udp_sport_base != 0 && u32::from(c.udp_sport_base) + u32::from(c.paths) - 1 > 65_535 {
            let v = vars.get("PRISM_UDP_SPORT_BASE").map_or("", String::as_str);
            return Err(bad(
                "PRISM_UDP_SPORT_BASE",
                v,
                &format!("with PRISM_PATHS={} the ports run past 65535 (at most {})", c.paths, 65_536 - u32::from(c.paths)),
            ));
        }
        // Registration pins the rings; a connection that would pin more than this is a typo, not a
        // plan (PRISM_PATHS=1024 with the defaults is 384 MiB).
        const MAX_RING_BYTES: usize = 1 << 30;
        let ring = c.verbs_depths().ring_bytes(usize::from(c.paths));
        if ring > MAX_RING_BYTES {
            let (var, v) = if vars.contains_key("PRISM_IB_RECV_DEPTH") {
                ("PRISM_IB_RECV_DEPTH", c.ib_recv_depth)
            } else {
                ("PRISM_IB_SEND_SLOTS", c.ib_send_slots)
            };
            return Err(bad(
                var,
                &v.to_string(),
                &format!(
                    "with PRISM_PATHS={}, PRISM_IB_RECV_DEPTH={} and PRISM_IB_SEND_SLOTS={} each verbs connection would pin {} MiB \
                     of rings per rail (at most {} MiB)",
                    c.paths,
                    c.ib_recv_depth,
                    c.ib_send_slots,
                    ring >> 20,
                    MAX_RING_BYTES >> 20
                ),
            ));
        }
        if !(c.ib_chunk as usize).is_multiple_of(crate::wire::LINE_BYTES) {
            let v = vars.get("PRISM_IB_CHUNK").map_or("", String::as_str);
            return Err(bad("PRISM_IB_CHUNK", v, &format!("must be a multiple of {} (NCCL's LL128 line)", crate::wire::LINE_BYTES)));
        }
        Ok(c)
    }

    /// How deep each verbs connection's QPs are (`PRISM_IB_RECV_DEPTH`, `PRISM_IB_SEND_SLOTS`).
    pub fn verbs_depths(&self) -> crate::backend::verbs::Depths {
        crate::backend::verbs::Depths { recv: self.ib_recv_depth as usize, send_slots: self.ib_send_slots as usize }
    }

    /// Datagrams of one GSO train (`PRISM_UDP_TRAIN`) on `rails` rails whose datagrams are up to
    /// `datagram` bytes (header included). `auto` keeps a full window spread over every path: a window of `W` packets
    /// over `P` entropies (all rails) holds `W / T` trains of `T`, so `T = W / P` still puts one on
    /// each path, capped at what one GSO send carries; 1 (each datagram picked on its own) when the
    /// window is smaller than the paths. Defaults (512 packets, 16 entropies, one rail, 9000-byte
    /// MTU): 7 datagrams; the emulated rail fabric (16 packets over 128 entropies): 1.
    pub fn train_pkts(&self, rails: usize, datagram: usize) -> u32 {
        if self.udp_train != 0 {
            return self.udp_train;
        }
        let paths = u64::from(self.paths) * rails.max(1) as u64;
        let by_window = u64::from(self.window_pkts) / paths;
        let by_gso = (crate::backend::udp::MAX_TRAIN_BYTES / datagram.max(1)).min(crate::backend::udp::MAX_TRAIN_SEGMENTS) as u64;
        by_window.min(by_gso).max(1) as u32
    }

    /// One line for the init log.
    pub fn describe(&self) -> String {
        let ifs = if self.ifnames.is_empty() { "<default route>".to_string() } else { self.ifnames.join(",") };
        let mtu = if self.mtu == 0 { "auto".to_string() } else { self.mtu.to_string() };
        format!(
            "transport={} ifnames={ifs} ib_hca={} qp={} ib_gid_index={} ib_chunk={} paths={} udp_sport_base={} mtu={mtu} window={} peer_timeout_ms={} stall_timeout_ms={} connect_timeout_ms={} rto_min_us={} sockbuf={} seed={} udp_gso={} udp_gro={} udp_train={}",
            match self.transport {
                Transport::Auto => "auto",
                Transport::Verbs => "verbs",
                Transport::Udp => "udp",
            },
            if self.ib_hca.is_empty() { "<all active>".to_string() } else { self.ib_hca.join(",") },
            match self.qp {
                QpType::Uc => "uc",
                QpType::Rc => "rc",
            },
            self.ib_gid_index.map_or("auto".to_string(), |g| g.to_string()),
            self.ib_chunk,
            self.paths, self.udp_sport_base, self.window_pkts, self.peer_timeout_ms, self.stall_timeout_ms, self.connect_timeout_ms, self.rto_min_us, self.sockbuf, self.seed,
            u8::from(self.udp_gso), u8::from(self.udp_gro),
            if self.udp_train == 0 { "auto".to_string() } else { self.udp_train.to_string() }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_without_variables() {
        assert_eq!(TransportConfig::from_vars(&BTreeMap::new()).unwrap(), TransportConfig::default());
    }

    #[test]
    fn paths_zero_is_an_error_naming_the_variable() {
        let e = TransportConfig::from_vars(&vars(&[("PRISM_PATHS", "0")])).unwrap_err().to_string();
        assert_eq!(e, "PRISM_PATHS=0: must be between 1 and 1024");
    }

    #[test]
    fn udp_offloads_are_switches() {
        let c = TransportConfig::default();
        assert!(c.udp_gso && c.udp_gro);
        let c = TransportConfig::from_vars(&vars(&[("PRISM_UDP_GSO", "0"), ("PRISM_UDP_GRO", "0")])).unwrap();
        assert!(!c.udp_gso && !c.udp_gro);
        let e = TransportConfig::from_vars(&vars(&[("PRISM_UDP_GRO", "yes")])).unwrap_err().to_string();
        assert_eq!(e, "PRISM_UDP_GRO=yes: must be 0 or 1");
    }

    #[test]
    fn udp_train_is_auto_or_a_count_and_auto_keeps_a_window_on_every_path() {
        let c = TransportConfig::default();
        assert_eq!(c.udp_train, 0);
        // 512 packets over 16 entropies: 32 per path, capped at 7 datagrams of 8,972 bytes (one GSO send).
        assert_eq!(c.train_pkts(1, 8972), 7);
        // 1,472-byte datagrams (1500 MTU): the window is the cap, 512 / 16.
        assert_eq!(c.train_pkts(1, 1472), 32);
        // 4 rails: 512 / 64.
        assert_eq!(c.train_pkts(4, 1472), 8);
        // The emulated rail fabric: 16 packets over 128 entropies, one datagram at a time.
        let fabric = TransportConfig::from_vars(&vars(&[("PRISM_WINDOW", "16"), ("PRISM_PATHS", "128")])).unwrap();
        assert_eq!(fabric.train_pkts(1, 1472), 1);
        // Small payloads: at most 64 segments.
        let c = TransportConfig::from_vars(&vars(&[("PRISM_WINDOW", "4096"), ("PRISM_PATHS", "1")])).unwrap();
        assert_eq!(c.train_pkts(1, 256), 64);
        let c = TransportConfig::from_vars(&vars(&[("PRISM_UDP_TRAIN", "3")])).unwrap();
        assert_eq!(c.train_pkts(1, 8972), 3);
        assert_eq!(TransportConfig::from_vars(&vars(&[("PRISM_UDP_TRAIN", "auto")])).unwrap().udp_train, 0);
        for v in ["0", "65", "seven"] {
            let e = TransportConfig::from_vars(&vars(&[("PRISM_UDP_TRAIN", v)])).unwrap_err().to_string();
            assert_eq!(e, format!("PRISM_UDP_TRAIN={v}: must be auto or 1-64"));
        }
    }

    #[test]
    fn ifnames_are_split_on_commas() {
        let c = TransportConfig::from_vars(&vars(&[("PRISM_IFNAMES", "lo, eth1")])).unwrap();
        assert_eq!(c.ifnames, vec!["lo", "eth1"]);
    }

    #[test]
    fn verbs_variables_parse_and_bad_values_name_the_variable() {
        let c = TransportConfig::from_vars(&vars(&[
            ("PRISM_TRANSPORT", "verbs"),
            ("PRISM_IB_HCA", "rxe0, rxe1"),
            ("PRISM_QP", "rc"),
            ("PRISM_IB_GID_INDEX", "3"),
        ]))
        .unwrap();
        assert_eq!((c.transport, c.qp, c.ib_gid_index), (Transport::Verbs, QpType::Rc, Some(3)));
        assert_eq!(c.ib_hca, vec!["rxe0", "rxe1"]);
        for (k, v) in [("PRISM_TRANSPORT", "rdma"), ("PRISM_QP", "ud"), ("PRISM_IB_GID_INDEX", "300"), ("PRISM_IB_HCA", ",")] {
            let e = TransportConfig::from_vars(&vars(&[(k, v)])).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{k}={v}: ")), "{e}");
        }
        assert_eq!(TransportConfig::default().transport, Transport::Auto);
    }

    #[test]
    fn verbs_queue_depths_parse_within_bounds_and_size_the_rings() {
        let d = TransportConfig::default();
        assert_eq!((d.ib_recv_depth, d.ib_send_slots), (256, 128));
        assert_eq!(d.verbs_depths().ring_bytes(16), 6 << 20, "16 paths x (256 + 128) x 1 KiB");
        let c = TransportConfig::from_vars(&vars(&[("PRISM_IB_RECV_DEPTH", "64"), ("PRISM_IB_SEND_SLOTS", "32")])).unwrap();
        assert_eq!(c.verbs_depths(), crate::backend::verbs::Depths { recv: 64, send_slots: 32 });
        assert_eq!(c.verbs_depths().ring_bytes(16), 1536 << 10);
        // Shallower than two repost chains would let the queue run dry before the first repost.
        for (k, v) in
            [("PRISM_IB_RECV_DEPTH", "31"), ("PRISM_IB_RECV_DEPTH", "16385"), ("PRISM_IB_SEND_SLOTS", "15"), ("PRISM_IB_SEND_SLOTS", "x")]
        {
            let e = TransportConfig::from_vars(&vars(&[(k, v)])).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{k}={v}: ")), "{e}");
        }
        assert!(TransportConfig::VARS.contains(&"PRISM_IB_RECV_DEPTH") && TransportConfig::VARS.contains(&"PRISM_IB_SEND_SLOTS"));
        // Each bound alone is fine; together with many paths they would pin gigabytes per connection.
        assert!(TransportConfig::from_vars(&vars(&[("PRISM_PATHS", "1024")])).is_ok(), "384 MiB");
        let e = TransportConfig::from_vars(&vars(&[("PRISM_PATHS", "1024"), ("PRISM_IB_RECV_DEPTH", "4096")])).unwrap_err().to_string();
        assert_eq!(
            e,
            "PRISM_IB_RECV_DEPTH=4096: with PRISM_PATHS=1024, PRISM_IB_RECV_DEPTH=4096 and PRISM_IB_SEND_SLOTS=128 each verbs \
             connection would pin 4224 MiB of rings per rail (at most 1024 MiB)"
        );
    }

    #[test]
    fn an_explicit_lb_chunk_is_noted_for_verbs() {
        assert!(!TransportConfig::from_vars(&vars(&[])).unwrap().lb_chunk_set, "verbs may raise the default chunk");
        assert!(TransportConfig::from_vars(&vars(&[("PRISM_CHUNK", "32768")])).unwrap().lb_chunk_set);
    }

    #[test]
    fn ib_chunk_must_be_whole_lines() {
        let e = TransportConfig::from_vars(&vars(&[("PRISM_IB_CHUNK", "65000")])).unwrap_err().to_string();
        assert_eq!(e, "PRISM_IB_CHUNK=65000: must be a multiple of 128 (NCCL's LL128 line)");
        let c = TransportConfig::from_vars(&vars(&[("PRISM_IB_CHUNK", "8448")])).unwrap();
        assert_eq!(c.ib_chunk, 8448);
    }

    #[test]
    fn stall_timeout_parses_and_is_bounded() {
        assert_eq!(TransportConfig::default().stall_timeout_ms, 20_000);
        let c = TransportConfig::from_vars(&vars(&[("PRISM_STALL_TIMEOUT_MS", "1500")])).unwrap();
        assert_eq!(c.stall_timeout_ms, 1500);
        let e = TransportConfig::from_vars(&vars(&[("PRISM_STALL_TIMEOUT_MS", "0")])).unwrap_err().to_string();
        assert_eq!(e, "PRISM_STALL_TIMEOUT_MS=0: must be between 10 and 3600000");
    }

    #[test]
    fn udp_sport_base_parses_and_its_range_must_fit_the_paths() {
        assert_eq!(TransportConfig::default().udp_sport_base, 0);
        let c = TransportConfig::from_vars(&vars(&[("PRISM_UDP_SPORT_BASE", "20000"), ("PRISM_PATHS", "128")])).unwrap();
        assert_eq!((c.udp_sport_base, c.paths), (20_000, 128));
        let e = TransportConfig::from_vars(&vars(&[("PRISM_UDP_SPORT_BASE", "65500"), ("PRISM_PATHS", "64")])).unwrap_err().to_string();
        assert_eq!(e, "PRISM_UDP_SPORT_BASE=65500: with PRISM_PATHS=64 the ports run past 65535 (at most 65472)");
        let e = TransportConfig::from_vars(&vars(&[("PRISM_UDP_SPORT_BASE", "70000")])).unwrap_err().to_string();
        assert_eq!(e, "PRISM_UDP_SPORT_BASE=70000: must be a number between 0 and 65535");
        assert!(TransportConfig::from_vars(&vars(&[("PRISM_UDP_SPORT_BASE", "65472"), ("PRISM_PATHS", "64")])).is_ok());
    }

    #[test]
    fn garbage_numbers_are_rejected() {
        let e = TransportConfig::from_vars(&vars(&[("PRISM_WINDOW", "4097")])).unwrap_err().to_string();
        assert_eq!(e, "PRISM_WINDOW=4097: must be between 1 and 4096");
        let e = TransportConfig::from_vars(&vars(&[("PRISM_WINDOW", "lots")])).unwrap_err().to_string();
        assert!(e.starts_with("PRISM_WINDOW=lots: must be a number"), "{e}");
    }
}
