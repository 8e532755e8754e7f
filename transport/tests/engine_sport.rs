//! `PRISM_UDP_SPORT_BASE`: rail r's entropy e leaves from port base + r * PRISM_PATHS + e, so a fabric
//! that steers by source port knows which uplink each entropy takes. Over loopback: the ports are the
//! engine's, data flows, and a taken port or a range past 65535 fails init with an error
//! naming the variable.

mod common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{pair, SharedRecv, VecSend};
use prism_transport::engine::{Net, RecvBuf, SendBuf, TransportConfig, TransportError};

const PATHS: u16 = 4;
const RAILS: u16 = 2;

fn try_net(base: u16) -> Result<Net, TransportError> {
    let vars: BTreeMap<String, String> = [
        ("PRISM_IFNAMES", "lo,lo".to_string()),
        ("PRISM_SEED", "42".to_string()),
        ("PRISM_PATHS", PATHS.to_string()),
        ("PRISM_UDP_SPORT_BASE", base.to_string()),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.clone()))
    .collect();
    Net::new(TransportConfig::from_vars(&vars)?, prism_lb::LbConfig::default())
}

fn in_use(port: u16) -> bool {
    matches!(UdpSocket::bind((Ipv4Addr::LOCALHOST, port)), Err(e) if e.kind() == std::io::ErrorKind::AddrInUse)
}

/// A Net on a range of ports nobody else holds (another process may own any given port on a shared
/// machine: a few ranges are tried, and only "cannot bind" moves on to the next).
fn net_on_free_range() -> (Net, u16) {
    let n = RAILS * PATHS;
    for _ in 0..20 {
        let probe = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let base = probe.local_addr().unwrap().port().min(u16::MAX - n);
        drop(probe);
        match try_net(base) {
            Ok(net) => return (net, base),
            Err(e) => assert!(e.to_string().contains("cannot bind UDP source ports"), "{e}"),
        }
    }
    panic!("no free range of {n} ports in 20 tries");
}

#[test]
fn every_rail_and_entropy_binds_its_port_and_data_flows() {
    let (net, base) = net_on_free_range();
    for p in base..base + RAILS * PATHS {
        assert!(in_use(p), "port {p} (base {base}) is not held by the engine");
    }
    let (mut s, mut r) = pair(&net);
    let data: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 7 + 3) as u8).collect();
    let rb = SharedRecv::filled(data.len(), 0);
    let rid = r.irecv(vec![(Box::new(rb.clone()) as Box<dyn RecvBuf>, 1)]).unwrap().expect("room");
    let sid = s.isend(Box::new(VecSend(Arc::new(data.clone()))) as Box<dyn SendBuf>, 1).unwrap().expect("room");
    let (mut sdone, mut rdone) = (false, false);
    let t0 = Instant::now();
    while !(sdone && rdone) {
        sdone = sdone || s.test(sid).unwrap().is_some();
        rdone = rdone || r.test(rid).unwrap().is_some();
        assert!(t0.elapsed() < Duration::from_secs(30), "the transfer did not finish");
    }
    assert!(rb.0.lock().unwrap()[..] == data[..], "the bytes differ");
}

#[test]
fn a_taken_port_fails_init_naming_the_variable_and_the_port() {
    let holder = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let taken = holder.local_addr().unwrap().port();
    // The very first socket (rail 0, entropy 0) is the one that cannot bind: nothing else decides.
    let Err(e) = try_net(taken) else { panic!("a taken port must fail init") };
    let e = e.to_string();
    assert!(e.starts_with(&format!("PRISM_UDP_SPORT_BASE={taken}: rail 0 (lo): cannot bind UDP source ports {taken}..")), "{e}");
    assert!(e.contains(&format!("port {taken}: ")), "{e}");
    drop(holder);
}

#[test]
fn a_range_past_65535_fails_init_before_binding() {
    // Each rail alone fits (65530 + 3), both do not (65530 + 2 * 4 - 1 = 65537).
    let Err(e) = try_net(65_530) else { panic!("out of range") };
    let e = e.to_string();
    assert_eq!(e, "PRISM_UDP_SPORT_BASE=65530: 2 rails x PRISM_PATHS=4 need ports up to 65537, past 65535");
}
