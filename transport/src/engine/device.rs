//! Rail discovery: which interfaces Prism uses, their addresses, speed, MTU and PCI path.

use std::net::{IpAddr, Ipv4Addr};

use super::{sysfs, DeviceInfo, TransportError};

/// The interface of the default IPv4 route, from `/proc/net/route`.
pub fn default_route_ifname() -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    parse_default_route(&table)
}

fn parse_default_route(table: &str) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let mut f = line.split_whitespace();
        let (ifname, dest) = (f.next()?, f.next()?);
        let mask = f.nth(5)?;
        (dest == "00000000" && mask == "00000000").then(|| ifname.to_string())
    })
}

/// The first IPv4 address of `ifname` (Prism's UDP backend speaks IPv4 today).
fn ipv4_of(ifname: &str) -> Result<Ipv4Addr, TransportError> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| TransportError::Io { what: "getifaddrs".into(), source: e.into() })?;
    addrs
        .filter(|a| a.interface_name == ifname)
        .find_map(|a| a.address.and_then(|s| s.as_sockaddr_in().map(|sin| sin.ip())))
        .ok_or_else(|| TransportError::NoDevice(format!("interface {ifname} has no IPv4 address (is it up? does it exist?)")))
}

fn sysfs(ifname: &str, file: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/{file}")).ok().map(|s| s.trim().to_string())
}

/// Describe the rails named in `ifnames` (or the default route's interface when empty). Names are made
/// unique (`prism:lo`, `prism:lo#1` for `PRISM_IFNAMES=lo,lo`), and so are GUIDs (rail index).
pub fn discover(ifnames: &[String]) -> Result<Vec<DeviceInfo>, TransportError> {
    let names: Vec<String> = if ifnames.is_empty() {
        vec![default_route_ifname()
            .ok_or_else(|| TransportError::NoDevice("no default route; set PRISM_IFNAMES (e.g. PRISM_IFNAMES=lo for one host)".into()))?]
    } else {
        ifnames.to_vec()
    };
    let root = std::path::Path::new(sysfs::SYSFS);
    let mut devs = names
        .iter()
        .enumerate()
        .map(|(rail, ifname)| {
            let addr = IpAddr::V4(ipv4_of(ifname)?);
            let mtu = sysfs(ifname, "mtu").and_then(|s| s.parse().ok()).unwrap_or(1500);
            let p = sysfs::udp_placement(root, ifname, rail);
            Ok(DeviceInfo {
                name: format!("prism:{ifname}"),
                ifname: ifname.clone(),
                addr,
                speed_mbps: p.speed_mbps,
                mtu,
                pci_path: p.pci_path,
                guid: p.guid,
            })
        })
        .collect::<Result<Vec<_>, TransportError>>()?;
    let mut unique: Vec<String> = devs.iter().map(|d| d.name.clone()).collect();
    sysfs::uniquify_names(&mut unique);
    for (d, n) in devs.iter_mut().zip(unique) {
        d.name = n;
    }
    Ok(devs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_route_is_the_zero_destination_with_zero_mask() {
        let table = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n\
                     eth1\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                     eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(parse_default_route(table).as_deref(), Some("eth0"));
        assert_eq!(parse_default_route("Iface\tDestination\n"), None);
    }

    #[test]
    fn loopback_is_a_usable_rail() {
        let devs = discover(&["lo".to_string()]).unwrap();
        assert_eq!(devs[0].addr, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(devs[0].name, "prism:lo");
        assert!(devs[0].pci_path.is_none());
    }

    #[test]
    fn two_rails_on_one_interface_have_distinct_names_and_guids() {
        let devs = discover(&["lo".to_string(), "lo".to_string()]).unwrap();
        assert_eq!(devs[0].name, "prism:lo");
        assert_eq!(devs[1].name, "prism:lo#1");
        assert_ne!(devs[0].guid, devs[1].guid);
        assert_eq!(devs[1].ifname, "lo");
    }

    #[test]
    fn a_missing_interface_is_a_clear_error() {
        let e = discover(&["nosuchif0".to_string()]).unwrap_err().to_string();
        assert!(e.contains("nosuchif0"), "{e}");
    }
}
