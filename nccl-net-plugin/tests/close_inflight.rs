//! "Close with requests in flight", as third-party NCCL-net functional suites run it, through the v12
//! table in-process: rank A posts 8 sends of 1 MiB, rank B 8 receives of 1 MiB, every buffer is
//! deregistered with the requests still in flight, then closeSend/closeRecv/closeListen; 10 times, then
//! 10 times on each of 4 threads at once (each with its own comms). Every call must succeed, a closed
//! receive comm must not write its buffers any more, and afterwards the process must have exactly the
//! threads and file descriptors it had before the first comm.
//!
//! The file holds one test so that no other test's threads or sockets disturb the counts.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use nccl_net_prism::abi::{NCCL_SUCCESS, PTR_HOST};
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;

const MSGS: usize = 8;
const MIB: usize = 1 << 20;
const ROUNDS: usize = 10;
const THREADS: usize = 4;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{dir}: {e}")).count()
}

/// Asserts that `dir` lists `want` entries again. A joined thread leaves `/proc/self/task` a moment
/// after `join` returns (the kernel clears the child tid before it reaps the task), so the count may
/// take that moment; anything still there after 2 s was left behind.
fn assert_back_to(dir: &str, want: usize, what: &str) {
    let until = Instant::now() + Duration::from_secs(2);
    while count(dir) != want && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(count(dir), want, "{what}");
}

/// A context pointer that threads may share (the plugin's objects are Send + Sync).
#[derive(Clone, Copy)]
struct Ctx(usize);

impl Ctx {
    fn ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

/// A connected pair plus the listener that made it (closed last, as the suites do).
struct Pair {
    listen: *mut c_void,
    send: *mut c_void,
    recv: *mut c_void,
}

fn connect(ctx: Ctx) -> Pair {
    let mut handle = [0u8; 128];
    let mut listen = null_mut();
    // SAFETY: the v12 listen contract: ctx from init, a 128-byte handle, a writable out-pointer.
    assert_eq!(unsafe { NET.listen.unwrap()(ctx.ptr(), 0, handle.as_mut_ptr().cast(), &mut listen) }, NCCL_SUCCESS);
    let (mut send, mut recv): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    let start = Instant::now();
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            // SAFETY: the connect contract; the same handle on every retry.
            let rc = unsafe { NET.connect.unwrap()(ctx.ptr(), 0, handle.as_mut_ptr().cast(), &mut send, null_mut()) };
            assert_eq!(rc, NCCL_SUCCESS, "connect");
        }
        if recv.is_null() {
            // SAFETY: the accept contract.
            assert_eq!(unsafe { NET.accept.unwrap()(listen, &mut recv, null_mut()) }, NCCL_SUCCESS, "accept");
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no loopback connection within 60 s");
    }
    Pair { listen, send, recv }
}

fn reg(comm: *mut c_void, buf: &mut [u8]) -> *mut c_void {
    let mut mh = null_mut();
    // SAFETY: regMr contract: our comm, a live buffer, a writable out-pointer.
    let rc = unsafe { NET.reg_mr.unwrap()(comm, buf.as_mut_ptr().cast(), buf.len(), PTR_HOST, &mut mh) };
    assert_eq!(rc, NCCL_SUCCESS, "regMr");
    mh
}

/// Posts until the plugin hands out a request (NULL means "later", as NCCL's proxy retries).
fn retry(mut post: impl FnMut(&mut *mut c_void) -> c_int) -> *mut c_void {
    let start = Instant::now();
    loop {
        let mut req = null_mut();
        assert_eq!(post(&mut req), NCCL_SUCCESS, "a post on a live comm failed");
        if !req.is_null() {
            return req;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no request within 10 s");
    }
}

/// One round; `check_untouched`: close the receive comm first, then keep the send comm going for a
/// while and check that nothing lands in the closed comm's buffers.
fn round(ctx: Ctx, check_untouched: bool, close_recv_first: bool) {
    let p = connect(ctx);
    let mut sbufs: Vec<Vec<u8>> = (0..MSGS).map(|i| vec![i as u8 + 1; MIB]).collect();
    let mut rbufs: Vec<Vec<u8>> = (0..MSGS).map(|_| vec![0u8; MIB]).collect();
    let smh: Vec<*mut c_void> = sbufs.iter_mut().map(|b| reg(p.send, b)).collect();
    let rmh: Vec<*mut c_void> = rbufs.iter_mut().map(|b| reg(p.recv, b)).collect();
    let mut sreqs = Vec::new();
    for i in 0..MSGS {
        let (data, size, mut mh) = (rbufs[i].as_mut_ptr().cast::<c_void>(), MIB, rmh[i]);
        let (mut data, mut size, mut tag) = (data, size, 0 as c_int);
        // SAFETY: arrays of one entry; the buffer outlives the comm.
        retry(|req| unsafe { NET.irecv.unwrap()(p.recv, 1, &mut data, &mut size, &mut tag, &mut mh, null_mut(), req) });
        // SAFETY: isend contract; the buffer outlives the comm.
        let s = retry(|req| unsafe { NET.isend.unwrap()(p.send, sbufs[i].as_mut_ptr().cast(), MIB, 0, smh[i], null_mut(), req) });
        sreqs.push(Some(s));
    }
    for mh in smh.into_iter().chain(rmh) {
        // SAFETY: handles regMr returned, deregistered once, their requests still in flight.
        assert_eq!(unsafe { NET.dereg_mr.unwrap()(null_mut(), mh) }, NCCL_SUCCESS, "deregMr with requests in flight");
    }
    // SAFETY (all closes below): comms connect/accept/listen returned, closed once, no call in progress.
    if close_recv_first {
        assert_eq!(unsafe { NET.close_recv.unwrap()(p.recv) }, NCCL_SUCCESS, "closeRecv with requests in flight");
    }
    if check_untouched {
        assert!(close_recv_first);
        for b in &mut rbufs {
            b.fill(0xee);
        }
        // The send comm keeps sending (or learns that the peer is gone) for a while.
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            for r in sreqs.iter_mut() {
                let Some(req) = *r else { continue };
                let (mut done, mut size) = (0, 0);
                // SAFETY: a request isend returned, not yet reported done or failed.
                let rc = unsafe { NET.test.unwrap()(req, &mut done, &mut size) };
                if rc != NCCL_SUCCESS || done == 1 {
                    *r = None;
                }
            }
        }
        for (i, b) in rbufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == 0xee), "receive buffer {i} was written after its comm closed");
        }
    }
    assert_eq!(unsafe { NET.close_send.unwrap()(p.send) }, NCCL_SUCCESS, "closeSend with requests in flight");
    if !close_recv_first {
        assert_eq!(unsafe { NET.close_recv.unwrap()(p.recv) }, NCCL_SUCCESS, "closeRecv with requests in flight");
    }
    assert_eq!(unsafe { NET.close_listen.unwrap()(p.listen) }, NCCL_SUCCESS, "closeListen");
    // The buffers are freed here: nothing may touch them any more.
    drop((sbufs, rbufs));
}

#[test]
fn closing_with_requests_in_flight_after_deregistering_leaves_nothing_behind() {
    if std::env::var_os("PRISM_IFNAMES").is_none() {
        // Set before init, while this is the only thread: loopback whatever the machine's routes are.
        std::env::set_var("PRISM_IFNAMES", "lo");
    }
    let mut raw = null_mut();
    // SAFETY: NCCL's init contract: a writable ctx slot, no config, no logger, no profiler.
    assert_eq!(unsafe { NET.init.unwrap()(&mut raw, 1, null_mut(), None, None) }, NCCL_SUCCESS, "init");
    let ctx = Ctx(raw as usize);
    let (fds, threads) = (count("/proc/self/fd"), count("/proc/self/task"));

    for r in 0..ROUNDS {
        round(ctx, r % 2 == 0, r % 2 == 0 || r % 3 == 0);
    }
    assert_back_to("/proc/self/task", threads, "threads left after the single-threaded rounds");
    assert_back_to("/proc/self/fd", fds, "file descriptors left after the single-threaded rounds");

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            std::thread::spawn(move || {
                for r in 0..ROUNDS {
                    round(ctx, false, (r + t) % 2 == 0);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker failed");
    }
    assert_back_to("/proc/self/task", threads, "threads left after the rounds on 4 threads");
    assert_back_to("/proc/self/fd", fds, "file descriptors left after the rounds on 4 threads");
    // On the verbs backend (PRISM_TRANSPORT=verbs, e.g. in the Soft-RoCE guest) every registration is
    // gone too: NCCL's handles were deregistered and the requests' own references went with their comms.
    let stats = nccl_net_prism::global::current("test").expect("engine").net.stats_json();
    let rails = stats["rails"].as_array().expect("rails in the engine's statistics");
    for r in rails.iter().filter(|r| !r["verbs_device"].is_null()) {
        assert_eq!(r["verbs_device"]["registrations"], 0, "registrations left on {}", r["name"]);
    }
    assert_eq!(stats["comms_closed"].as_u64(), Some(2 * (ROUNDS * (1 + THREADS)) as u64), "every comm closed");

    // SAFETY: the context init returned, finalized once.
    assert_eq!(unsafe { NET.finalize.unwrap()(ctx.ptr()) }, NCCL_SUCCESS);
}
