//! The plugin driven as NCCL drives it, over long runs and from several threads.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use nccl_net_prism::abi::{NCCL_SUCCESS, PTR_HOST};
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;
use parking_lot::Mutex;

mod common;
use common::{Ctx, Pair};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The tests measure this process's memory, descriptors and threads, which a test running beside
/// them would move: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn rss_kb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Prism's threads in this process (named `prism-*`; the test harness's own threads come and go
/// with the tests it runs).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.starts_with("prism")))
        .count()
}

#[derive(Clone, Copy)]
struct P(*mut c_void);
// SAFETY: plugin objects may be used from any thread (one at a time here).
unsafe impl Send for P {}

fn connect(ctx: *mut c_void) -> (*mut c_void, *mut c_void) {
    let mut handle = [0u8; 128];
    let mut listen = null_mut();
    // SAFETY: v12 contract.
    assert_eq!(unsafe { NET.listen.unwrap()(ctx, 0, handle.as_mut_ptr().cast(), &mut listen) }, NCCL_SUCCESS);
    let (mut send, mut recv): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    let start = Instant::now();
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            // SAFETY: v12 contract.
            assert_eq!(unsafe { NET.connect.unwrap()(ctx, 0, handle.as_mut_ptr().cast(), &mut send, null_mut()) }, NCCL_SUCCESS);
        }
        if recv.is_null() {
            // SAFETY: v12 contract.
            assert_eq!(unsafe { NET.accept.unwrap()(listen, &mut recv, null_mut()) }, NCCL_SUCCESS);
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no connection within 20 s");
    }
    // SAFETY: v12 contract.
    assert_eq!(unsafe { NET.close_listen.unwrap()(listen) }, NCCL_SUCCESS);
    (send, recv)
}

fn reg(comm: *mut c_void, buf: &[u8]) -> *mut c_void {
    let mut mh = null_mut();
    // SAFETY: v12 contract; the buffer outlives the handle.
    assert_eq!(unsafe { NET.reg_mr.unwrap()(comm, buf.as_ptr() as *mut c_void, buf.len(), PTR_HOST, &mut mh) }, NCCL_SUCCESS);
    mh
}

fn dereg(comm: *mut c_void, mh: *mut c_void) {
    // SAFETY: v12 contract.
    assert_eq!(unsafe { NET.dereg_mr.unwrap()(comm, mh) }, NCCL_SUCCESS);
}

/// `n` messages of `len` bytes from send to recv, NCCL style (8 in flight), checked.
fn transfer(send: *mut c_void, recv: *mut c_void, n: usize, len: usize, seed: u8, limit: Duration) {
    let src: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect();
    let mut dst = vec![vec![0u8; len.max(1)]; 8];
    let smh = reg(send, &src);
    let rmh: Vec<*mut c_void> = dst.iter().map(|d| reg(recv, d)).collect();
    let t0 = Instant::now();
    let (mut sent, mut got) = (0usize, 0usize);
    let mut sq: std::collections::VecDeque<*mut c_void> = Default::default();
    let mut rq: std::collections::VecDeque<(*mut c_void, usize)> = Default::default();
    let (mut sposted, mut rposted) = (0usize, 0usize);
    while sent < n || got < n {
        while rposted < n && rq.len() < 8 {
            let slot = rposted % 8;
            let mut req = null_mut();
            let mut data = dst[slot].as_mut_ptr().cast::<c_void>();
            let mut size = len;
            let mut tag: c_int = 0;
            let mut mh = rmh[slot];
            // SAFETY: arrays of one; buffer outlives the request.
            let rc = unsafe { NET.irecv.unwrap()(recv, 1, &mut data, &mut size, &mut tag, &mut mh, null_mut(), &mut req) };
            assert_eq!(rc, NCCL_SUCCESS, "irecv");
            if req.is_null() {
                break;
            }
            rq.push_back((req, slot));
            rposted += 1;
        }
        while sposted < n && sq.len() < 8 {
            let mut req = null_mut();
            // SAFETY: buffer outlives the request.
            let rc = unsafe { NET.isend.unwrap()(send, src.as_ptr() as *mut c_void, len, 0, smh, null_mut(), &mut req) };
            assert_eq!(rc, NCCL_SUCCESS, "isend");
            if req.is_null() {
                break;
            }
            sq.push_back(req);
            sposted += 1;
        }
        if let Some(&req) = sq.front() {
            let (mut done, mut size) = (0, -1);
            // SAFETY: a live request.
            assert_eq!(unsafe { NET.test.unwrap()(req, &mut done, &mut size) }, NCCL_SUCCESS, "send test");
            if done == 1 {
                sq.pop_front();
                sent += 1;
            }
        }
        if let Some(&(req, slot)) = rq.front() {
            let (mut done, mut size) = (0, -1);
            // SAFETY: a live request.
            assert_eq!(unsafe { NET.test.unwrap()(req, &mut done, &mut size) }, NCCL_SUCCESS, "recv test");
            if done == 1 {
                assert_eq!(size as usize, len);
                assert!(dst[slot][..len] == src[..], "wrong bytes");
                dst[slot].fill(0);
                rq.pop_front();
                got += 1;
            }
        }
        assert!(t0.elapsed() < limit, "transfer stuck: sent {sent}/{n} received {got}/{n}");
    }
    dereg(send, smh);
    for m in rmh {
        dereg(recv, m);
    }
}

/// 1,000 communicator lifetimes: init, connect, data, close, finalize; nothing may grow.
#[test]
fn a_thousand_init_connect_close_finalize_cycles_leave_nothing() {
    let _serial = serial();
    let _serial = ONE_AT_A_TIME.lock();
    let cycle = |i: usize| {
        let ctx = Ctx::init(&[]);
        let (s, r) = connect(ctx.0);
        transfer(s, r, 4, 5000, i as u8, Duration::from_secs(10));
        common::close(Pair { send: s, recv: r });
        ctx.finalize();
    };
    for i in 0..50 {
        cycle(i);
    }
    let (rss0, fd0, th0) = (rss_kb(), fds(), threads());
    let t0 = Instant::now();
    for i in 0..1000 {
        cycle(i);
    }
    let (rss1, fd1, th1) = (rss_kb(), fds(), threads());
    eprintln!("1000 cycles in {:?}: RSS {rss0} -> {rss1} KB, fds {fd0} -> {fd1}, threads {th0} -> {th1}", t0.elapsed());
    assert_eq!(fd1, fd0);
    assert_eq!(th1, th0);
    assert!(rss1 < rss0 + 4096, "RSS grew {} KB", rss1 - rss0);
}

/// 1,000 comm pairs opened and closed on one context (no finalize in between).
#[test]
fn a_thousand_comm_pairs_on_one_context_leave_nothing() {
    let _serial = serial();
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(&[]);
    for i in 0..50 {
        let (s, r) = connect(ctx.0);
        transfer(s, r, 4, 5000, i as u8, Duration::from_secs(10));
        common::close(Pair { send: s, recv: r });
    }
    let (rss0, fd0, th0) = (rss_kb(), fds(), threads());
    let t0 = Instant::now();
    for i in 0..1000 {
        let (s, r) = connect(ctx.0);
        transfer(s, r, 4, 5000, i as u8, Duration::from_secs(10));
        common::close(Pair { send: s, recv: r });
    }
    let (rss1, fd1, th1) = (rss_kb(), fds(), threads());
    eprintln!("1000 pairs in {:?}: RSS {rss0} -> {rss1} KB, fds {fd0} -> {fd1}, threads {th0} -> {th1}", t0.elapsed());
    assert_eq!(fd1, fd0);
    assert!(rss1 < rss0 + 4096, "RSS grew {} KB", rss1 - rss0);
    ctx.finalize();
}

/// Several "communicators" (one context each) on their own threads at once, each with several
/// comm pairs moving data, while contexts are finalized and re-initialized.
#[test]
fn communicators_on_several_threads_with_init_and_finalize_racing() {
    let _serial = serial();
    let _serial = ONE_AT_A_TIME.lock();
    if std::env::var_os("PRISM_IFNAMES").is_none() {
        std::env::set_var("PRISM_IFNAMES", "lo");
    }
    let t0 = Instant::now();
    let workers: Vec<_> = (0..4)
        .map(|w| {
            std::thread::spawn(move || {
                for cycle in 0..15 {
                    let mut ctx = null_mut();
                    // SAFETY: v12 init contract.
                    assert_eq!(unsafe { NET.init.unwrap()(&mut ctx, w as u64, null_mut(), None, None) }, NCCL_SUCCESS);
                    let pairs: Vec<(P, P)> = (0..6).map(|_| connect(ctx)).map(|(s, r)| (P(s), P(r))).collect();
                    for (i, (s, r)) in pairs.iter().enumerate() {
                        let len = if (i + cycle) % 3 == 0 { 200_000 } else { 3000 };
                        transfer(s.0, r.0, 8, len, (w * 50 + i) as u8, Duration::from_secs(20));
                    }
                    for (s, r) in pairs {
                        common::close(Pair { send: s.0, recv: r.0 });
                    }
                    // SAFETY: v12 finalize contract.
                    assert_eq!(unsafe { NET.finalize.unwrap()(ctx) }, NCCL_SUCCESS);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    eprintln!("done in {:?}; threads {}", t0.elapsed(), threads());
}

/// 300 pairs open at once through the plugin, data on all.
#[test]
fn three_hundred_pairs_through_the_plugin() {
    let _serial = serial();
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(&[]);
    let fd0 = fds();
    let t0 = Instant::now();
    let pairs: Vec<(*mut c_void, *mut c_void)> = (0..300).map(|_| connect(ctx.0)).collect();
    eprintln!("300 pairs in {:?}, fds {fd0} -> {}", t0.elapsed(), fds());
    let t1 = Instant::now();
    for (i, &(s, r)) in pairs.iter().enumerate() {
        transfer(s, r, 8, 100_000, i as u8, Duration::from_secs(10));
    }
    eprintln!("data on all in {:?}", t1.elapsed());
    for (s, r) in pairs {
        common::close(Pair { send: s, recv: r });
    }
    ctx.finalize();
}
