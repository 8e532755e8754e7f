//! The listener against hostile peers that can only reach its TCP port (issue 14):
//! - 1,100 silent connections (connect, send nothing) while the listener's process may hold 1,024 fds:
//!   before the fix `accept` failed with "Too many open files" from then on (also after the attacker
//!   left) and the legitimate peer was never accepted;
//! - 500 connections whose HELLO announces a 1 MiB block and then sends it: before the fix the
//!   listener allocated (and filled) the block before it checked the nonce.
//!
//! Each scenario runs its listener in a child process (this test binary re-executed with
//! `PRISM_LIS_ROLE`), so the fd limit and the RSS are that process's alone; the attackers are a
//! second child (again this binary), so their connections hold only the listener's fds. Children are
//! killed by PID and waited for.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use prism_transport::engine::{Listener, Net, TransportConfig, HANDLE_LEN};
use prism_transport::wire::HELLO_VERSION;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

const ROLE: &str = "PRISM_LIS_ROLE";
const HELLO_LEN: usize = 144;
const CONNECT_TIMEOUT_MS: u64 = 10_000;

fn new_net() -> Net {
    let ms = CONNECT_TIMEOUT_MS.to_string();
    let vars: BTreeMap<String, String> =
        [("PRISM_IFNAMES", "lo"), ("PRISM_SEED", "42"), ("PRISM_PATHS", "2"), ("PRISM_CONNECT_TIMEOUT_MS", ms.as_str())]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    Net::new(TransportConfig::from_vars(&vars).unwrap(), prism_lb::LbConfig::default()).unwrap()
}

/// Re-execute this test binary running only `test` with `ROLE=role` (plus `env`).
fn spawn_self(test: &str, role: &str, env: &[(&str, String)], stdin: bool) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]).env(ROLE, role).stdout(Stdio::piped());
    if stdin {
        cmd.stdin(Stdio::piped());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Lines the child prints on stdout that start with "@" (the harness prints other lines too).
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(l) = l.strip_prefix('@') {
                let _ = tx.send(l.to_string());
            } else {
                println!("{l}");
            }
        }
    });
    rx
}

fn rss_kb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn target(handle: &[u8; HANDLE_LEN]) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(handle[8], handle[9], handle[10], handle[11]), u16::from_be_bytes([handle[6], handle[7]]))
}

/// Connect a legitimate peer (same process, own Net) while pumping `lis`; how long until both ends
/// had their comm. Fails the test if `accept` returns an error or it takes longer than `limit`.
fn legit_connect(peer: &Net, lis: &mut Listener, handle: &[u8; HANDLE_LEN], limit: Duration) -> Duration {
    let mut h = *handle;
    let t0 = Instant::now();
    let (mut s, mut r) = (None, None);
    while s.is_none() || r.is_none() {
        if s.is_none() {
            s = peer.connect(0, &mut h).unwrap_or_else(|e| panic!("legitimate connect failed after {:?}: {e}", t0.elapsed()));
        }
        if r.is_none() {
            r = lis.accept().unwrap_or_else(|e| panic!("accept failed after {:?}: {e}", t0.elapsed()));
        }
        assert!(t0.elapsed() < limit, "the legitimate peer was not accepted within {limit:?} (send comm: {})", s.is_some());
        std::thread::sleep(Duration::from_micros(200));
    }
    t0.elapsed()
}

/// Pump `accept` for `d`; every call must return Ok (no comm: nobody legitimate connects).
fn pump(lis: &mut Listener, d: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        match lis.accept() {
            Ok(None) => {}
            Ok(Some(_)) => panic!("a comm was accepted from an attacker"),
            Err(e) => panic!("accept failed (NCCL would abort the job): {e}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn handshake_stats(net: &Net) -> serde_json::Value {
    net.stats_json()["handshakes"].clone()
}

/// The attacker: opens connections to `PRISM_LIS_TARGET` in waves of `n` read from stdin
/// ("silent N" or "big N NONCE_HEX BACKEND"), prints "@ready" after each, exits on EOF.
fn attacker() {
    // The parent may have inherited a lowered soft limit; we hold many fds.
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard.min(8192), hard).unwrap();
    let to: SocketAddrV4 = std::env::var("PRISM_LIS_TARGET").unwrap().parse().unwrap();
    let mut held = Vec::new();
    let body = vec![0x5au8; 1 << 20];
    for line in std::io::stdin().lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let n: usize = w[1].parse().unwrap();
        let mut socks = Vec::new();
        for _ in 0..n {
            let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
            s.set_nonblocking(true).unwrap();
            let _ = s.connect(&SockAddr::from(to));
            socks.push(s);
        }
        // Wait (bounded) until the kernel completed every connect: the listener takes them meanwhile.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) && socks.iter().any(|s| s.peer_addr().is_err()) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let up = socks.iter().filter(|s| s.peer_addr().is_ok()).count();
        eprintln!("attacker: {up} of {n} connections established");
        if w[0] == "big" {
            // A well-formed HELLO that announces a 1 MiB block, then the block, written as far as the
            // listener takes it (bounded in time: a listener that stops reading is the point).
            let nonce = u64::from_str_radix(w[2], 16).unwrap();
            let mut m = [0u8; HELLO_LEN];
            m[0..4].copy_from_slice(b"PRSM");
            m[4] = HELLO_VERSION;
            m[6] = 1;
            m[7] = w[3].parse().unwrap();
            m[8..16].copy_from_slice(&nonce.to_be_bytes());
            m[16..24].copy_from_slice(&0x1234u64.to_be_bytes());
            m[28..32].copy_from_slice(&(1u32 << 20).to_be_bytes());
            m[40] = 1;
            m[44..48].copy_from_slice(&9000u32.to_be_bytes());
            m[48..52].copy_from_slice(&[127, 0, 0, 1]);
            m[52..54].copy_from_slice(&9u16.to_be_bytes());
            let mut msg = m.to_vec();
            msg.extend_from_slice(&body);
            let mut sent = vec![0usize; socks.len()];
            let mut dead = vec![false; socks.len()];
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(8) {
                let mut busy = false;
                for (i, s) in socks.iter().enumerate() {
                    if dead[i] || sent[i] == msg.len() {
                        continue;
                    }
                    busy = true;
                    match (&*s).write(&msg[sent[i]..]) {
                        Ok(k) => sent[i] += k,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.raw_os_error() == Some(libc::ENOTCONN) => {}
                        Err(_) => dead[i] = true,
                    }
                }
                if !busy {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let full = sent.iter().filter(|&&k| k == msg.len()).count();
            eprintln!("attacker: {n} connections, {full} sent HELLO + 1 MiB, {} were closed", dead.iter().filter(|&&d| d).count());
        }
        held.extend(socks);
        println!("\n@ready");
        std::io::stdout().flush().unwrap();
    }
}

struct Attacker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Attacker {
    fn start(test: &str, to: SocketAddrV4) -> Attacker {
        let mut child = spawn_self(test, "attacker", &[("PRISM_LIS_TARGET", to.to_string())], true);
        let stdin = child.stdin.take();
        let lines = lines_of(&mut child);
        Attacker { child, stdin, lines }
    }

    /// Send a wave command; pump `lis` until the attacker says it is done.
    fn wave(&mut self, cmd: &str, lis: &mut Listener, on_pump: &mut dyn FnMut()) {
        writeln!(self.stdin.as_mut().unwrap(), "{cmd}").unwrap();
        let t0 = Instant::now();
        loop {
            match self.lines.try_recv() {
                Ok(l) if l == "ready" => return,
                Ok(_) => {}
                Err(mpsc::TryRecvError::Empty) => {}
                Err(e) => panic!("attacker gone: {e}"),
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "attacker wave '{cmd}' not done in 20 s");
            match lis.accept() {
                Ok(None) => {}
                Ok(Some(_)) => panic!("a comm was accepted from an attacker"),
                Err(e) => panic!("accept failed during the attack (NCCL would abort the job): {e}"),
            }
            on_pump();
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// Close its stdin (it exits, closing its connections) and wait for it.
    fn stop(mut self) {
        drop(self.stdin.take());
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        if self.stdin.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Run `test` in a child with `ROLE=listener`; its exit status is the verdict.
fn run_child(test: &str) {
    let mut child = spawn_self(test, "listener", &[], false);
    let _lines = lines_of(&mut child);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the listener child did not finish in 90 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the listener child failed: {status}");
}

const SILENT: &str = "silent_connections_with_1024_fds_neither_wedge_nor_starve_the_listener";

#[test]
fn silent_connections_with_1024_fds_neither_wedge_nor_starve_the_listener() {
    match std::env::var(ROLE).as_deref() {
        Ok("attacker") => return attacker(),
        Ok("listener") => {}
        _ => return run_child(SILENT),
    }
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 1024, hard).unwrap();
    let net = new_net();
    let peer = new_net();
    let mut handle = [0u8; HANDLE_LEN];
    let mut lis = net.listen(0, &mut handle).unwrap();
    let fds0 = open_fds();
    let mut att = Attacker::start(SILENT, target(&handle));

    // 1,100 silent connections, held: a legitimate peer still gets in within the connect timeout.
    att.wave("silent 1100", &mut lis, &mut || {});
    pump(&mut lis, Duration::from_millis(500));
    let took = legit_connect(&peer, &mut lis, &handle, Duration::from_millis(CONNECT_TIMEOUT_MS));
    println!("1,100 silent connections held: legitimate peer accepted after {took:?}; {} fds open", open_fds());
    println!("handshakes: {}", handshake_stats(&net));

    // Out of fds (as if 1,100 fds were in use elsewhere in the process): accept must keep working,
    // time out the pending handshakes, and accept again once fds are back.
    let mut filler = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        filler.push(f);
        assert!(filler.len() < 2048, "the fd limit is not in force");
    }
    att.wave("silent 300", &mut lis, &mut || {});
    pump(&mut lis, Duration::from_millis(500));
    let hs = handshake_stats(&net);
    println!("out of fds: {hs}");
    assert!(hs["accept_out_of_fds"].as_u64().unwrap() > 0, "accept never ran out of fds: the test did not test that: {hs}");
    drop(filler);

    // The attacker leaves: the legitimate peer is accepted within 2 s.
    // (NCCL keeps calling accept: the listener first takes what is queued, as it would meanwhile.)
    att.stop();
    let closed = Instant::now();
    pump(&mut lis, Duration::from_millis(200));
    let took = legit_connect(&peer, &mut lis, &handle, Duration::from_millis(1800));
    println!("after the attacker left: legitimate peer accepted {:?} after it closed ({took:?} to connect)", closed.elapsed());
    let hs = handshake_stats(&net);
    println!("handshakes: {hs}");
    assert!(hs["pending"].as_u64().unwrap() <= 256, "{hs}");
    assert!(hs["dropped_full"].as_u64().unwrap() + hs["dropped_timeout"].as_u64().unwrap() > 0, "{hs}");
    // Every pending handshake times out: the fds come back.
    pump(&mut lis, Duration::from_millis(5_500));
    let hs = handshake_stats(&net);
    assert_eq!(hs["pending"].as_u64().unwrap(), 0, "{hs}");
    assert!(open_fds() <= fds0 + 8, "{} fds open, {fds0} before the attack", open_fds());
}

const BIG: &str = "hellos_announcing_large_blocks_do_not_make_the_listener_allocate_them";

#[test]
fn hellos_announcing_large_blocks_do_not_make_the_listener_allocate_them() {
    match std::env::var(ROLE).as_deref() {
        Ok("attacker") => return attacker(),
        Ok("listener") => {}
        _ => return run_child(BIG),
    }
    let net = new_net();
    let peer = new_net();
    let mut handle = [0u8; HANDLE_LEN];
    let mut lis = net.listen(0, &mut handle).unwrap();
    let nonce = u64::from_be_bytes(handle[12..20].try_into().unwrap());
    // Warm up (one legitimate comm) so the baseline includes what any handshake allocates.
    legit_connect(&peer, &mut lis, &handle, Duration::from_secs(5));
    let rss0 = rss_kb();
    let mut max = rss0;
    let mut att = Attacker::start(BIG, target(&handle));
    // Wrong and right nonce, UDP and verbs backend byte: 4 × 125 = 500 connections.
    for (n, b) in [(nonce ^ 1, 0), (nonce, 0), (nonce, 1), (nonce ^ 1, 1)] {
        att.wave(&format!("big 125 {n:x} {b}"), &mut lis, &mut || max = max.max(rss_kb()));
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(500) {
        lis.accept().unwrap();
        max = max.max(rss_kb());
    }
    println!("500 HELLOs announcing 1 MiB: listener RSS {rss0} kB before, at most {max} kB during");
    println!("handshakes: {}", handshake_stats(&net));
    assert!(max - rss0 < 16 * 1024, "listener RSS grew by {} kB", max - rss0);
    att.stop();
    let took = legit_connect(&peer, &mut lis, &handle, Duration::from_secs(2));
    println!("legitimate peer accepted {took:?} after");
    let hs = handshake_stats(&net);
    assert!(hs["rejected"].as_u64().unwrap() >= 400, "{hs}");
}
