//! What NCCL needs to place a NIC in its topology, read from sysfs: the PCI function (NCCL attaches
//! the NIC to that function's CPU and PCI switch), the link speed and a GUID.
//!
//! Every reader takes the sysfs root (`/sys` in production, [`SYSFS`]) so the tests can point it at a
//! fake tree. A missing or unreadable file is "unknown" (`None`), never an error: properties only
//! tune NCCL's placement and must not stop a rail from working.
//!
//! Rules (README, "Device properties"):
//! - PCI path: the real path of `class/net/<if>/device` (UDP) or `class/infiniband/<dev>/device`
//!   (verbs), cut back to the nearest PCI function (`dddd:bb:dd.f`). NCCL's topology (`ncclTopoFillNet`)
//!   attaches a path whose `subsystem` is not `pci` to the first CPU, and reads the bus id from the
//!   path's last component, so a virtio netdev (`.../0000:00:03.0/virtio2`) is reported as its PCI
//!   function `.../0000:00:03.0`. No PCI function (loopback, bridges, veth): NULL (first CPU).
//! - A Soft-RoCE (rxe) device has no `device` link: it is placed where its netdev is.
//! - Speed: verbs `ports/<port>/rate` (active speed × width, e.g. "100 Gb/sec (4X EDR)"), else the
//!   netdev's `speed`; a netdev that reports none (virtual interfaces say -1 or refuse the read) counts
//!   as [`DEFAULT_SPEED_MBPS`], NCCL's socket transport's guess too.
//! - GUID: verbs `node_guid`; UDP the MAC address (low 48 bits) with the rail index in the top 16 bits,
//!   so two rails on one interface (`PRISM_IFNAMES=lo,lo`) still differ.

use std::path::{Path, PathBuf};

/// The sysfs root of the running system.
pub const SYSFS: &str = "/sys";

/// Speed reported for an interface whose speed sysfs does not know, in Mbit/s.
pub const DEFAULT_SPEED_MBPS: u32 = 10_000;

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Whether `s` names a PCI function: `domain:bus:device.function` in hex (`0000:3b:00.0`).
pub fn is_pci_function(s: &str) -> bool {
    let hex = |p: &str, n: std::ops::RangeInclusive<usize>| n.contains(&p.len()) && p.bytes().all(|b| b.is_ascii_hexdigit());
    let mut parts = s.split(':');
    let (Some(domain), Some(bus), Some(devfn), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let Some((dev, func)) = devfn.split_once('.') else { return false };
    hex(domain, 4..=8) && hex(bus, 2..=2) && hex(dev, 2..=2) && hex(func, 1..=1)
}

/// The nearest PCI function at or above the real path of `link`, as a string.
fn pci_function_of(link: &Path) -> Option<String> {
    let real: PathBuf = std::fs::canonicalize(link).ok()?;
    let f = real.ancestors().find(|a| a.file_name().and_then(|n| n.to_str()).is_some_and(is_pci_function))?;
    f.to_str().map(str::to_string)
}

/// PCI path of network interface `ifname`, or `None` when it sits on no PCI function.
pub fn net_pci_path(root: &Path, ifname: &str) -> Option<String> {
    pci_function_of(&root.join("class/net").join(ifname).join("device"))
}

/// Link speed of `ifname` in Mbit/s, `None` when unknown (missing, unreadable, -1 or 0).
pub fn net_speed_mbps(root: &Path, ifname: &str) -> Option<u32> {
    read(&root.join("class/net").join(ifname).join("speed"))?.parse::<u32>().ok().filter(|&s| s > 0)
}

/// The Ethernet address of `ifname` as a 48-bit number (`None` for other address lengths).
pub fn net_mac(root: &Path, ifname: &str) -> Option<u64> {
    let s = read(&root.join("class/net").join(ifname).join("address"))?;
    let octets: Vec<&str> = s.split(':').collect();
    if octets.len() != 6 {
        return None;
    }
    octets.iter().try_fold(0u64, |acc, o| Some((acc << 8) | u64::from(u8::from_str_radix(o, 16).ok()?)))
}

/// GUID of UDP rail `rail` on `ifname`: the MAC in the low 48 bits, the rail index above, so it is
/// unique per rail and the same every run with the same `PRISM_IFNAMES`.
pub fn udp_guid(root: &Path, ifname: &str, rail: usize) -> u64 {
    let mac = net_mac(root, ifname).unwrap_or(0) & 0xffff_ffff_ffff;
    ((rail as u64 & 0xffff) << 48) | mac
}

/// Parses an InfiniBand `rate` file ("100 Gb/sec (4X EDR)", "2.5 Gb/sec (1X SDR)") into Mbit/s.
pub fn parse_ib_rate_mbps(s: &str) -> Option<u32> {
    let mut f = s.split_whitespace();
    let value: f64 = f.next()?.parse().ok()?;
    let scale = match f.next()? {
        "Gb/sec" => 1000.0,
        "Mb/sec" => 1.0,
        _ => return None,
    };
    let mbps = (value * scale).round();
    (mbps >= 1.0 && mbps <= f64::from(u32::MAX)).then_some(mbps as u32)
}

/// Active speed × width of `port` of RDMA device `dev` in Mbit/s.
pub fn ib_rate_mbps(root: &Path, dev: &str, port: u8) -> Option<u32> {
    parse_ib_rate_mbps(&read(&root.join("class/infiniband").join(dev).join(format!("ports/{port}/rate")))?)
}

/// Parses a `node_guid` file ("0002:c903:0031:7b30").
pub fn parse_node_guid(s: &str) -> Option<u64> {
    let groups: Vec<&str> = s.split(':').collect();
    if groups.len() != 4 || groups.iter().any(|g| g.len() != 4) {
        return None;
    }
    groups.iter().try_fold(0u64, |acc, g| Some((acc << 16) | u64::from(u16::from_str_radix(g, 16).ok()?)))
}

/// Node GUID of RDMA device `dev`.
pub fn ib_node_guid(root: &Path, dev: &str) -> Option<u64> {
    parse_node_guid(&read(&root.join("class/infiniband").join(dev).join("node_guid"))?)
}

/// What NCCL's topology needs to know about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// PCI function in sysfs, `None` when there is none.
    pub pci_path: Option<String>,
    /// Link speed in Mbit/s.
    pub speed_mbps: u32,
    /// Device GUID.
    pub guid: u64,
}

/// Placement of UDP rail `rail` on interface `ifname`.
pub fn udp_placement(root: &Path, ifname: &str, rail: usize) -> Placement {
    Placement {
        pci_path: net_pci_path(root, ifname),
        speed_mbps: net_speed_mbps(root, ifname).unwrap_or(DEFAULT_SPEED_MBPS),
        guid: udp_guid(root, ifname, rail),
    }
}

/// Placement of port `port` of RDMA device `dev`, whose GID belongs to netdev `ifname`. Soft-RoCE
/// has no `device` link, no meaningful GUID of its own in some kernels: each falls back to the
/// netdev (PCI function, speed, MAC-derived GUID with rail index `rail`).
pub fn verbs_placement(root: &Path, dev: &str, port: u8, ifname: &str, rail: usize) -> Placement {
    let ib = root.join("class/infiniband").join(dev);
    Placement {
        pci_path: pci_function_of(&ib.join("device")).or_else(|| net_pci_path(root, ifname)),
        speed_mbps: ib_rate_mbps(root, dev, port).or_else(|| net_speed_mbps(root, ifname)).unwrap_or(DEFAULT_SPEED_MBPS),
        guid: ib_node_guid(root, dev).filter(|&g| g != 0).unwrap_or_else(|| udp_guid(root, ifname, rail)),
    }
}

/// Makes names unique in order: the second `prism:lo` becomes `prism:lo#1`, the third `prism:lo#2`.
/// NCCL keys its network nodes by name, so two rails on one interface must not share one.
pub fn uniquify_names(names: &mut [String]) {
    let mut seen: Vec<String> = Vec::with_capacity(names.len());
    for name in names.iter_mut() {
        let base = name.clone();
        let mut k = 0;
        while seen.contains(name) {
            k += 1;
            *name = format!("{base}#{k}");
        }
        seen.push(name.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake sysfs tree in a fresh temporary directory, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new() -> Tree {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!("prism-sysfs-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Tree(p)
        }
        fn file(&self, rel: &str, text: &str) {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        fn dir(&self, rel: &str) {
            std::fs::create_dir_all(self.0.join(rel)).unwrap();
        }
        /// `rel` becomes a symlink to `target` (relative to the root).
        fn link(&self, rel: &str, target: &str) {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(self.0.join(target), p).unwrap();
        }
        fn path(&self, rel: &str) -> String {
            std::fs::canonicalize(&self.0).unwrap().join(rel).to_str().unwrap().to_string()
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// eth0 on a virtio function, mlx5_0 on a PCI function, rxe0 over eth0, lo virtual.
    fn machine() -> Tree {
        let t = Tree::new();
        t.dir("devices/pci0000:00/0000:00:03.0/virtio2");
        t.dir("devices/pci0000:00/0000:00:02.0/0000:3b:00.0");
        t.dir("devices/virtual/net/lo");
        t.link("class/net/eth0/device", "devices/pci0000:00/0000:00:03.0/virtio2");
        t.file("class/net/eth0/speed", "25000\n");
        t.file("class/net/eth0/address", "02:fc:00:00:00:01\n");
        t.file("class/net/lo/speed", "-1\n");
        t.file("class/net/lo/address", "00:00:00:00:00:00\n");
        t.link("class/infiniband/mlx5_0/device", "devices/pci0000:00/0000:00:02.0/0000:3b:00.0");
        t.file("class/infiniband/mlx5_0/ports/1/rate", "100 Gb/sec (4X EDR)\n");
        t.file("class/infiniband/mlx5_0/node_guid", "0002:c903:0031:7b30\n");
        t.file("class/infiniband/rxe0/ports/1/rate", "2.5 Gb/sec (1X SDR)\n");
        t.file("class/infiniband/rxe0/node_guid", "00fc:00ff:fe00:0001\n");
        t
    }

    #[test]
    fn pci_functions_are_recognised_by_their_bus_id_format() {
        assert!(is_pci_function("0000:3b:00.0"));
        assert!(is_pci_function("10000:00:1f.7"));
        for s in ["virtio2", "pci0000:00", "0000:3b:00", "0000:3b:00.0.1", "000:3b:00.0", "0000:3g:00.0", "lo"] {
            assert!(!is_pci_function(s), "{s}");
        }
    }

    #[test]
    fn rates_are_speed_times_width_in_mbits() {
        assert_eq!(parse_ib_rate_mbps("100 Gb/sec (4X EDR)"), Some(100_000));
        assert_eq!(parse_ib_rate_mbps("2.5 Gb/sec (1X SDR)"), Some(2_500));
        assert_eq!(parse_ib_rate_mbps("53.125 Gb/sec (1X HDR)"), Some(53_125));
        assert_eq!(parse_ib_rate_mbps("400 Gb/sec (4X NDR)"), Some(400_000));
        assert_eq!(parse_ib_rate_mbps("100 Mb/sec"), Some(100));
        for bad in ["", "fast", "0 Gb/sec (1X SDR)", "-5 Gb/sec", "100 furlongs", "100"] {
            assert_eq!(parse_ib_rate_mbps(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn node_guids_are_four_groups_of_four_hex_digits() {
        assert_eq!(parse_node_guid("0002:c903:0031:7b30"), Some(0x0002_c903_0031_7b30));
        for bad in ["", "0002:c903:0031", "0002:c903:0031:7b30:0000", "02:c903:0031:7b30", "000x:c903:0031:7b30"] {
            assert_eq!(parse_node_guid(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_virtio_netdev_is_placed_on_its_pci_function() {
        let t = machine();
        let p = udp_placement(&t.0, "eth0", 0);
        assert_eq!(p.pci_path.as_deref(), Some(t.path("devices/pci0000:00/0000:00:03.0").as_str()));
        assert_eq!(p.speed_mbps, 25_000);
        assert_eq!(p.guid, 0x02fc_0000_0001);
    }

    #[test]
    fn a_virtual_interface_has_no_pci_path_and_the_default_speed() {
        let t = machine();
        let p = udp_placement(&t.0, "lo", 0);
        assert_eq!(p, Placement { pci_path: None, speed_mbps: DEFAULT_SPEED_MBPS, guid: 0 });
        // Nothing at all in sysfs for the interface: still a placement, all defaults.
        let p = udp_placement(&t.0, "ghost0", 3);
        assert_eq!(p, Placement { pci_path: None, speed_mbps: DEFAULT_SPEED_MBPS, guid: 3 << 48 });
    }

    #[test]
    fn a_zero_or_garbage_speed_is_unknown() {
        let t = machine();
        t.file("class/net/eth1/speed", "0\n");
        t.file("class/net/eth2/speed", "fast\n");
        assert_eq!(net_speed_mbps(&t.0, "eth1"), None);
        assert_eq!(net_speed_mbps(&t.0, "eth2"), None);
        assert_eq!(net_speed_mbps(&t.0, "lo"), None);
        assert_eq!(net_speed_mbps(&t.0, "eth0"), Some(25_000));
    }

    #[test]
    fn two_rails_on_one_interface_get_different_guids() {
        let t = machine();
        assert_ne!(udp_guid(&t.0, "lo", 0), udp_guid(&t.0, "lo", 1));
        assert_ne!(udp_guid(&t.0, "eth0", 0), udp_guid(&t.0, "eth0", 1));
        assert_eq!(udp_guid(&t.0, "eth0", 1), (1 << 48) | 0x02fc_0000_0001);
    }

    #[test]
    fn an_hca_reports_its_pci_function_rate_and_node_guid() {
        let t = machine();
        let p = verbs_placement(&t.0, "mlx5_0", 1, "eth0", 0);
        assert_eq!(p.pci_path.as_deref(), Some(t.path("devices/pci0000:00/0000:00:02.0/0000:3b:00.0").as_str()));
        assert_eq!(p.speed_mbps, 100_000);
        assert_eq!(p.guid, 0x0002_c903_0031_7b30);
    }

    #[test]
    fn soft_roce_is_placed_on_its_netdev() {
        let t = machine();
        let p = verbs_placement(&t.0, "rxe0", 1, "eth0", 0);
        assert_eq!(p.pci_path.as_deref(), Some(t.path("devices/pci0000:00/0000:00:03.0").as_str()));
        assert_eq!(p.speed_mbps, 2_500);
        assert_eq!(p.guid, 0x00fc_00ff_fe00_0001);
        // rxe over a virtual netdev, with no rate and no GUID: NULL path, netdev speed default, MAC guid.
        let p = verbs_placement(&t.0, "rxe9", 1, "lo", 2);
        assert_eq!(p, Placement { pci_path: None, speed_mbps: DEFAULT_SPEED_MBPS, guid: 2 << 48 });
        // No rate file: the netdev's speed.
        assert_eq!(verbs_placement(&t.0, "rxe9", 1, "eth0", 0).speed_mbps, 25_000);
    }

    #[test]
    fn repeated_names_get_a_suffix_and_distinct_names_stay() {
        let mut n: Vec<String> = ["prism:lo", "prism:eth0", "prism:lo", "prism:lo"].iter().map(|s| s.to_string()).collect();
        uniquify_names(&mut n);
        assert_eq!(n, ["prism:lo", "prism:eth0", "prism:lo#1", "prism:lo#2"]);
        // A name that already looks like a suffixed one is not reused.
        let mut n: Vec<String> = ["prism:lo#1", "prism:lo", "prism:lo"].iter().map(|s| s.to_string()).collect();
        uniquify_names(&mut n);
        assert_eq!(n, ["prism:lo#1", "prism:lo", "prism:lo#2"]);
    }
}
