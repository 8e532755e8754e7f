//! The engine's only thread, as a process that loads the plugin sees it: listed while a comm is open,
//! gone from `/proc/self/task` the moment the last comm's close returns (NCCL may dlclose the plugin
//! right after), however often comms come and go and from however many threads.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{pair, SharedRecv, VecSend};
use prism_transport::engine::{Net, RecvBuf, RecvComm, SendComm};

/// The tests count threads of the whole process by name: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const THREAD_NAME: &str = "prism-progress";

/// How many threads of this process carry the progress thread's name.
fn progress_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("the test needs procfs")
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == THREAD_NAME)
        .count()
}

/// Whether a progress thread shows up within a few seconds: a new thread names itself once it runs,
/// so right after the comm that started it the kernel may still show it under its creator's name.
fn progress_thread_appears() -> bool {
    let t0 = Instant::now();
    while progress_threads() == 0 {
        if t0.elapsed() > Duration::from_secs(5) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// One small message, so that the progress thread has work (and acknowledgements owed) at close.
fn exchange(s: &mut SendComm, r: &mut RecvComm, len: usize) {
    let out = SharedRecv::filled(len, 0);
    let rreq = r.irecv(vec![(Box::new(out.clone()) as Box<dyn RecvBuf>, 0)]).unwrap().expect("room for the receive");
    let sreq = s.isend(Box::new(VecSend::new(vec![0x5A; len])), 0).unwrap().expect("room for the send");
    let (mut sent, mut got) = (false, false);
    let t0 = Instant::now();
    while !sent || !got {
        sent = sent || s.test(sreq).unwrap().is_some();
        got = got || r.test(rreq).unwrap().is_some();
        assert!(t0.elapsed() < Duration::from_secs(20), "a {len}-byte message did not complete");
    }
    assert!(out.0.lock().unwrap().iter().all(|&b| b == 0x5A), "the message arrived damaged");
}

#[test]
fn no_progress_thread_is_listed_once_the_last_comm_closes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let net = net();
    assert_eq!(progress_threads(), 0, "a progress thread before any comm");
    for round in 0..300 {
        let (mut s, mut r) = pair(&net);
        assert!(progress_thread_appears(), "round {round}: comms are open, the thread must run");
        assert_eq!(progress_threads(), 1, "round {round}: one engine, one thread");
        exchange(&mut s, &mut r, 1 + round * 997 % 70_000);
        // Alternate which end closes last.
        if round % 2 == 0 {
            drop(s);
            drop(r);
        } else {
            drop(r);
            drop(s);
        }
        assert_eq!(progress_threads(), 0, "round {round}: the last comm closed, yet the progress thread is listed");
    }
}

/// A comm adopted while another thread closes the engine's last comm must find a running thread (the
/// old one, still serving, or a new one), never one that is about to stop.
#[test]
fn comms_opened_while_others_close_always_have_a_progress_thread() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let net = Arc::new(net());
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let net = net.clone();
            std::thread::spawn(move || {
                for round in 0..150 {
                    let (s, r) = pair(&net);
                    assert!(progress_thread_appears(), "worker {w} round {round}: a comm is open without a progress thread");
                    drop((s, r));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    assert_eq!(progress_threads(), 0, "every comm closed, yet the progress thread is listed");
}

fn net() -> Net {
    common::net(&[("PRISM_SEED", "7"), ("PRISM_PATHS", "4")])
}

/// NCCL posts a send and then stops testing it (its proxy thread busy elsewhere, or preempted for
/// good): the progress thread takes the comm over once the owner has not driven it for a while, and
/// the message is delivered without one more test of the send. Its completion waits for the next test.
#[test]
fn a_send_its_owner_stopped_testing_is_still_delivered() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let net = net();
    let (mut s, mut r) = pair(&net);
    // Larger than the sender's window: it needs acknowledgements processed to finish.
    let len = 32 << 20;
    let out = SharedRecv::filled(len, 0);
    let rreq = r.irecv(vec![(Box::new(out.clone()) as Box<dyn RecvBuf>, 0)]).unwrap().expect("room for the receive");
    let sreq = s.isend(Box::new(VecSend::new(vec![0xA5; len])), 0).unwrap().expect("room for the send");
    let t0 = Instant::now();
    while r.test(rreq).unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(20), "the receive did not complete while the sender's owner was away");
    }
    assert!(out.0.lock().unwrap().iter().all(|&b| b == 0xA5), "the message arrived damaged");
    let t0 = Instant::now();
    while s.test(sreq).unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(20), "the send did not complete once tested again");
    }
    drop((s, r));
}
