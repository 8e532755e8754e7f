//! `getProperties` checked against this machine's sysfs, through the exported C tables: the interface
//! of the default route must be reported with its PCI function, its speed and a MAC-derived GUID, and
//! two rails on one interface must reach NCCL under distinct names and GUIDs. Tests here rebuild the
//! process-wide engine with their own environment, so they run one at a time.

use std::ffi::{c_void, CStr};
use std::path::{Path, PathBuf};
use std::ptr::null_mut;

use nccl_net_prism::abi::props::{PropertiesV11, PropertiesV12, PropertiesV9};
use nccl_net_prism::abi::NCCL_SUCCESS;
use nccl_net_prism::exports::{ncclNetPlugin_v11 as NET11, ncclNetPlugin_v12 as NET, ncclNetPlugin_v9 as NET9};
use parking_lot::Mutex;
use prism_transport::engine::sysfs::DEFAULT_SPEED_MBPS;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A v12 context over the UDP backend on `ifnames`; finalized on drop.
struct Ctx(*mut c_void);

impl Ctx {
    fn init(ifnames: &str) -> Ctx {
        // Only tests holding ONE_AT_A_TIME change the environment or init.
        std::env::set_var("PRISM_IFNAMES", ifnames);
        std::env::set_var("PRISM_TRANSPORT", "udp");
        let mut ctx = null_mut();
        // SAFETY: NCCL's init contract: a writable ctx slot, no config, no logger, no profiler.
        let rc = unsafe { NET.init.unwrap()(&mut ctx, 1, null_mut(), None, None) };
        assert_eq!(rc, NCCL_SUCCESS, "init with PRISM_IFNAMES={ifnames}");
        Ctx(ctx)
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the context init returned, finalized once.
        unsafe { NET.finalize.unwrap()(self.0) };
    }
}

fn devices() -> i32 {
    let mut n = 0;
    // SAFETY: a writable int.
    assert_eq!(unsafe { NET.devices.unwrap()(&mut n) }, NCCL_SUCCESS);
    n
}

fn props_v12(dev: i32) -> PropertiesV12 {
    let mut p = std::mem::MaybeUninit::<PropertiesV12>::zeroed();
    // SAFETY: a writable v12 struct, the layout the v12 table writes.
    assert_eq!(unsafe { NET.get_properties.unwrap()(dev, p.as_mut_ptr()) }, NCCL_SUCCESS);
    // SAFETY: zeroed is a valid value of the struct (null pointers, zero numbers), and getProperties
    // filled it.
    unsafe { p.assume_init() }
}

fn props_v11(dev: i32) -> PropertiesV11 {
    let mut p = std::mem::MaybeUninit::<PropertiesV11>::zeroed();
    // SAFETY: as props_v12, v11 layout.
    assert_eq!(unsafe { NET11.get_properties.unwrap()(dev, p.as_mut_ptr()) }, NCCL_SUCCESS);
    // SAFETY: as props_v12.
    unsafe { p.assume_init() }
}

fn props_v9(dev: i32) -> PropertiesV9 {
    let mut p = std::mem::MaybeUninit::<PropertiesV9>::zeroed();
    // SAFETY: as props_v12, v9 layout.
    assert_eq!(unsafe { NET9.get_properties.unwrap()(dev, p.as_mut_ptr()) }, NCCL_SUCCESS);
    // SAFETY: as props_v12.
    unsafe { p.assume_init() }
}

fn string(p: *const std::ffi::c_char) -> Option<String> {
    // SAFETY: the plugin's strings are NUL-terminated and live for the process.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_str().expect("UTF-8").to_string())
}

/// The interface of the default IPv4 route, read here independently of the plugin.
fn default_route_ifname() -> String {
    let table = std::fs::read_to_string("/proc/net/route").expect("read /proc/net/route");
    table
        .lines()
        .skip(1)
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 7 && f[1] == "00000000" && f[7] == "00000000").then(|| f[0].to_string())
        })
        .expect("this test needs a default-route interface, and the machine has none (see /proc/net/route)")
}

/// The PCI function `ifname` sits on: the nearest ancestor of its `device` link's real path whose
/// `subsystem` is the PCI bus.
fn expected_pci_path(ifname: &str) -> Option<String> {
    let real = std::fs::canonicalize(format!("/sys/class/net/{ifname}/device")).ok()?;
    let on_pci = |d: &Path| std::fs::canonicalize(d.join("subsystem")).is_ok_and(|s| s.file_name().is_some_and(|n| n == "pci"));
    real.ancestors().find(|d| on_pci(d)).map(|d| d.to_str().unwrap().to_string())
}

fn expected_speed(ifname: &str) -> i32 {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/speed"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|&s| s > 0)
        .unwrap_or(DEFAULT_SPEED_MBPS as i32)
}

fn mac(ifname: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/sys/class/net/{ifname}/address")).expect("interface address");
    u64::from_str_radix(&s.trim().replace(':', ""), 16).expect("a MAC address")
}

#[test]
fn the_default_route_interface_is_reported_as_sysfs_describes_it() {
    let _one = ONE_AT_A_TIME.lock();
    let ifname = default_route_ifname();
    let _ctx = Ctx::init(&ifname);
    assert_eq!(devices(), 1);
    let p = props_v12(0);
    assert_eq!(string(p.name).as_deref(), Some(format!("prism:{ifname}").as_str()));
    let pci = string(p.pci_path);
    assert_eq!(pci, expected_pci_path(&ifname), "pciPath of {ifname}");
    if let Some(pci) = &pci {
        // The path names a PCI function: NCCL takes its last component as the bus id.
        assert!(PathBuf::from(pci).join("config").exists(), "{pci} is not a PCI function");
        let real = std::fs::canonicalize(format!("/sys/class/net/{ifname}/device")).unwrap();
        assert!(real.starts_with(pci), "{pci} is not above {}", real.display());
    }
    assert_eq!(p.speed, expected_speed(&ifname), "speed of {ifname}");
    assert_eq!(p.guid, mac(&ifname), "guid of {ifname} (rail 0: the MAC)");
    // The older layouts carry the same values.
    let (p11, p9) = (props_v11(0), props_v9(0));
    assert_eq!((string(p11.name), string(p11.pci_path), p11.speed, p11.guid), (string(p.name), pci.clone(), p.speed, p.guid));
    assert_eq!((string(p9.name), string(p9.pci_path), p9.speed, p9.guid), (string(p.name), pci, p.speed, p.guid));
}

#[test]
fn two_rails_on_one_interface_have_distinct_names_and_guids() {
    let _one = ONE_AT_A_TIME.lock();
    let _ctx = Ctx::init("lo,lo");
    assert_eq!(devices(), 2);
    let (a, b) = (props_v12(0), props_v12(1));
    assert_eq!(string(a.name).as_deref(), Some("prism:lo"));
    assert_eq!(string(b.name).as_deref(), Some("prism:lo#1"));
    assert_ne!(a.guid, b.guid);
    assert_eq!((a.pci_path, b.pci_path), (std::ptr::null_mut(), std::ptr::null_mut()), "loopback is on no PCI function");
    assert_eq!((a.speed, b.speed), (expected_speed("lo"), expected_speed("lo")));
    assert_eq!((a.rail_id, b.rail_id), (0, 1));
    for (dev, p) in [(0, a), (1, b)] {
        let (p11, p9) = (props_v11(dev), props_v9(dev));
        assert_eq!((string(p11.name), p11.guid), (string(p.name), p.guid));
        assert_eq!((string(p9.name), p9.guid), (string(p.name), p.guid));
    }
}
