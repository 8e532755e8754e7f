//! Setup shared by the engine's integration tests: buffers over plain memory, a `Net` over loopback
//! from `PRISM_*` variables, and a connected send/receive comm pair. Each test file includes it with
//! `mod common;` and uses only part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prism_transport::engine::{Net, RecvBuf, RecvComm, SendBuf, SendComm, TransportConfig, HANDLE_LEN};

/// A send buffer over shared bytes.
pub struct VecSend(pub Arc<Vec<u8>>);

impl VecSend {
    pub fn new(data: Vec<u8>) -> Self {
        VecSend(Arc::new(data))
    }
}

impl SendBuf for VecSend {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self.0[offset..offset + out.len()]);
    }
    fn bytes(&self) -> Option<&[u8]> {
        Some(&self.0)
    }
}

/// A send buffer that only copies (no `bytes`): the engine's copy path.
pub struct CopySend(pub Arc<Vec<u8>>);

impl SendBuf for CopySend {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self.0[offset..offset + out.len()]);
    }
}

/// A receive buffer the test keeps a handle on (clones share the bytes): `.0` is the memory, `.1`
/// the size posted to the engine; a write past the posted size fails the test.
#[derive(Clone)]
pub struct SharedRecv(pub Arc<Mutex<Vec<u8>>>, pub usize);

impl SharedRecv {
    /// `len` bytes, each `fill`, all posted.
    pub fn filled(len: usize, fill: u8) -> Self {
        SharedRecv(Arc::new(Mutex::new(vec![fill; len])), len)
    }
}

impl RecvBuf for SharedRecv {
    fn len(&self) -> usize {
        self.1
    }
    fn write(&mut self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.1, "write past the posted size");
        self.0.lock().unwrap()[offset..offset + data.len()].copy_from_slice(data);
    }
}

/// A `Net` on loopback (`PRISM_IFNAMES=lo`) with the given variables (a later pair overrides an
/// earlier one).
pub fn net(vars: &[(&str, &str)]) -> Net {
    let vars: BTreeMap<String, String> =
        [("PRISM_IFNAMES", "lo")].iter().chain(vars).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Net::new(TransportConfig::from_vars(&vars).unwrap(), prism_lb::LbConfig::default()).unwrap()
}

/// A send comm and a receive comm, both on `net`, connected to each other.
pub fn pair(net: &Net) -> (SendComm, RecvComm) {
    pair_between(net, net)
}

/// A send comm on `a` connected to a receive comm on `b` (listen, then connect and accept until both
/// exist; fails the test after 10 s).
pub fn pair_between(a: &Net, b: &Net) -> (SendComm, RecvComm) {
    let mut handle = [0u8; HANDLE_LEN];
    let mut lis = b.listen(0, &mut handle).unwrap();
    let (mut s, mut r) = (None, None);
    let t0 = Instant::now();
    while s.is_none() || r.is_none() {
        if s.is_none() {
            s = a.connect(0, &mut handle).unwrap();
        }
        if r.is_none() {
            r = lis.accept().unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "handshake did not finish");
    }
    (s.unwrap(), r.unwrap())
}

/// This process's resident memory, in KB (`VmRSS`).
pub fn rss_kb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// This process's open file descriptors.
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Prism's threads in this process (named `prism-*`; the test harness's own threads come and go
/// with the tests it runs).
pub fn prism_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.starts_with("prism")))
        .count()
}
