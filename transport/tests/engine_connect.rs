//! `connect` to a listener that is gone (a peer that died during set-up): it must fail with a clear
//! error within `PRISM_CONNECT_TIMEOUT_MS`, never hand out a comm. On loopback the kernel can
//! self-connect a retried TCP connect (source port = the closed listener's port, simultaneous open);
//! the connector would then read its own HELLO as the reply. Before the fix, looping `connect` on a
//! closed listener's handle returned such a comm after 16 ms to 0.6 s (1,300 to 38,000 calls).
//! The fake listeners below play the handshake from the layout documented in `wire/hello.rs`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prism_transport::engine::{Net, TransportConfig, TransportError, HANDLE_LEN};

const HELLO_LEN: usize = 144;

fn net(connect_timeout_ms: &str) -> Net {
    let vars: BTreeMap<String, String> =
        [("PRISM_IFNAMES", "lo"), ("PRISM_SEED", "42"), ("PRISM_PATHS", "2"), ("PRISM_CONNECT_TIMEOUT_MS", connect_timeout_ms)]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    Net::new(TransportConfig::from_vars(&vars).unwrap(), prism_lb::LbConfig::default()).unwrap()
}

/// Call `connect` as NCCL does (until it returns a comm or an error): whether it returned a comm,
/// or its error; how long it took; how many calls.
fn connect_until_done(net: &Net, handle: &mut [u8; HANDLE_LEN]) -> (Result<(), TransportError>, Duration, u64) {
    let t0 = Instant::now();
    let mut calls = 0;
    loop {
        calls += 1;
        match net.connect(0, handle) {
            Ok(Some(_comm)) => return (Ok(()), t0.elapsed(), calls),
            Ok(None) => {}
            Err(e) => return (Err(e), t0.elapsed(), calls),
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "connect neither connected nor failed in 30 s ({calls} calls)");
    }
}

#[test]
fn connect_to_a_closed_listener_fails_within_the_connect_timeout_and_never_returns_a_comm() {
    let net = net("3000");
    let mut handle = [0u8; HANDLE_LEN];
    drop(net.listen(0, &mut handle).unwrap());
    let (res, took, calls) = connect_until_done(&net, &mut handle);
    eprintln!("connect to a closed listener: {res:?} after {took:?} and {calls} calls");
    let Err(e) = res else { panic!("connect to a closed listener returned a comm after {took:?} ({calls} calls)") };
    let msg = e.to_string();
    assert!(matches!(e, TransportError::HandshakeTimeout { .. }), "{msg}");
    assert!(msg.contains("last attempt:"), "the error does not say why: {msg}");
    assert!(took >= Duration::from_millis(3000) && took < Duration::from_millis(4500), "failed after {took:?}: {msg}");
    assert!(calls > 100, "only {calls} calls: the retries were not exercised");
}

/// A TCP server on 127.0.0.1 that answers every connection with `answer(hello)` until dropped.
struct FakeListener {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<u64>>,
}

impl FakeListener {
    fn new(answer: impl Fn(&[u8; HELLO_LEN]) -> [u8; HELLO_LEN] + Send + 'static) -> Self {
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        tcp.set_nonblocking(true).unwrap();
        let port = tcp.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut answered = 0;
            while !flag.load(Ordering::Relaxed) {
                match tcp.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false).unwrap();
                        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                        let mut hello = [0u8; HELLO_LEN];
                        if s.read_exact(&mut hello).is_ok() && s.write_all(&answer(&hello)).is_ok() {
                            answered += 1;
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
            answered
        });
        Self { port, stop, thread: Some(thread) }
    }

    /// Stop the server; how many HELLOs it answered.
    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for FakeListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A handle of this Prism (version, nonce) that points at the fake listener's port.
fn handle_for(net: &Net, port: u16) -> [u8; HANDLE_LEN] {
    let mut handle = [0u8; HANDLE_LEN];
    drop(net.listen(0, &mut handle).unwrap());
    handle[6..8].copy_from_slice(&port.to_be_bytes());
    handle
}

/// A correct reply to `hello`: same nonce, echo of its token, one UDP rail, the same largest datagram.
fn reply_to(hello: &[u8; HELLO_LEN]) -> [u8; HELLO_LEN] {
    let mut r = [0u8; HELLO_LEN];
    r[0..5].copy_from_slice(&hello[0..5]);
    r[6] = 1;
    r[8..16].copy_from_slice(&hello[8..16]);
    r[16..24].copy_from_slice(&0x5eed_u64.to_be_bytes());
    r[32..40].copy_from_slice(&hello[16..24]);
    r[40] = 2;
    r[44..48].copy_from_slice(&hello[44..48]);
    r[48..52].copy_from_slice(&[127, 0, 0, 1]);
    r[52..54].copy_from_slice(&9u16.to_be_bytes());
    r
}

#[test]
fn a_connector_that_reads_back_its_own_hello_retries_and_never_returns_a_comm() {
    // A mirror plays the self-connected socket deterministically: whatever the connector writes comes
    // back to it.
    let net = net("1000");
    let mirror = FakeListener::new(|hello| *hello);
    let mut handle = handle_for(&net, mirror.port);
    let (res, took, calls) = connect_until_done(&net, &mut handle);
    let answered = mirror.finish();
    let Err(e) = res else { panic!("connect accepted its own HELLO as the reply ({calls} calls, {took:?})") };
    let msg = e.to_string();
    assert!(msg.contains("timed out") && msg.contains("its own HELLO"), "{msg}");
    assert!(took < Duration::from_millis(2500), "failed after {took:?}");
    assert!(answered > 1, "the mirror answered {answered} HELLOs: the connect was not retried");
}

#[test]
fn a_reply_that_does_not_echo_the_connectors_token_is_refused() {
    let net = net("5000");
    let fake = FakeListener::new(|hello| {
        let mut r = reply_to(hello);
        r[32..40].copy_from_slice(&0xbad_u64.to_be_bytes());
        r
    });
    let mut handle = handle_for(&net, fake.port);
    let (res, took, _) = connect_until_done(&net, &mut handle);
    let Err(e) = res else { panic!("a reply to another connect was accepted") };
    assert!(matches!(e, TransportError::ConnectionFailed(_)) && e.to_string().contains("another listener or another connect"), "{e}");
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn a_reply_with_another_listeners_nonce_is_refused() {
    let net = net("5000");
    let fake = FakeListener::new(|hello| {
        let mut r = reply_to(hello);
        r[8..16].copy_from_slice(&0xbad_u64.to_be_bytes());
        r
    });
    let mut handle = handle_for(&net, fake.port);
    let (res, _, _) = connect_until_done(&net, &mut handle);
    let Err(e) = res else { panic!("a reply with another listener's nonce was accepted") };
    assert!(e.to_string().contains("another listener or another connect"), "{e}");
}

#[test]
fn a_reply_whose_largest_datagram_cannot_hold_a_packet_is_refused() {
    // 64 header bytes and one 128-byte line is the least DATA packet; a peer that takes less (or
    // says nothing, 0) could receive nothing.
    for max_dgram in [0u32, 191] {
        let net = net("5000");
        let fake = FakeListener::new(move |hello| {
            let mut r = reply_to(hello);
            r[44..48].copy_from_slice(&max_dgram.to_be_bytes());
            r
        });
        let mut handle = handle_for(&net, fake.port);
        let (res, took, _) = connect_until_done(&net, &mut handle);
        let Err(e) = res else { panic!("a peer that takes datagrams of {max_dgram} bytes was accepted") };
        assert!(e.to_string().contains(&format!("at most {max_dgram} bytes")), "{e}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
}

#[test]
fn a_correct_reply_from_the_fake_listener_is_accepted() {
    // The fake listener's replies are right when nothing is changed: the refusals above are the
    // checks at work, not a broken fake.
    let net = net("5000");
    let fake = FakeListener::new(reply_to);
    let mut handle = handle_for(&net, fake.port);
    let (res, _, _) = connect_until_done(&net, &mut handle);
    assert!(res.is_ok(), "{res:?}");
}
