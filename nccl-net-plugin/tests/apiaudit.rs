//! Call sequences an independent API audit found mishandled (or probed and found right): each test
//! names what NCCL, or a careless caller, does and what it must get back.
//!
//! Tests here share the process-wide engine, so they run one at a time.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use nccl_net_prism::abi::NCCL_SUCCESS;
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;
use parking_lot::Mutex;

mod common;
use common::{close, connect, drive_connect, listen, Ctx, Pair};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// ncclInvalidUsage.
const INVALID_USAGE: c_int = 5;

const ENV: &[(&str, &str)] = &[("PRISM_CONNECT_TIMEOUT_MS", "3000")];

fn isend_tag(send: *mut c_void, data: &[u8], tag: c_int) -> (c_int, *mut c_void) {
    let mut req = null_mut();
    // SAFETY: a live buffer the caller keeps until the request completes.
    let rc = unsafe { NET.isend.unwrap()(send, data.as_ptr() as *mut c_void, data.len(), tag, null_mut(), null_mut(), &mut req) };
    (rc, req)
}

/// A grouped receive of `bufs` (pointer, size) with `tags`.
fn irecv_group(recv: *mut c_void, bufs: &[(*mut u8, usize)], tags: &[c_int]) -> (c_int, *mut c_void) {
    let mut req = null_mut();
    let mut d: Vec<*mut c_void> = bufs.iter().map(|b| b.0.cast()).collect();
    let mut s: Vec<usize> = bufs.iter().map(|b| b.1).collect();
    let mut t = tags.to_vec();
    // SAFETY: arrays of n entries; the buffers live until the request completes.
    let rc = unsafe {
        NET.irecv.unwrap()(recv, bufs.len() as c_int, d.as_mut_ptr(), s.as_mut_ptr(), t.as_mut_ptr(), null_mut(), null_mut(), &mut req)
    };
    (rc, req)
}

/// Tests until done or failed: (rc, sizes).
fn wait(req: *mut c_void, n: usize) -> (c_int, Vec<c_int>) {
    let start = Instant::now();
    loop {
        let mut done = 0;
        let mut sizes = vec![-7 as c_int; 64];
        // SAFETY: a live request; room for 64 sizes.
        let rc = unsafe { NET.test.unwrap()(req, &mut done, sizes.as_mut_ptr()) };
        if rc != NCCL_SUCCESS || done == 1 {
            sizes.truncate(n);
            return (rc, sizes);
        }
        assert!(start.elapsed() < Duration::from_secs(30), "request neither done nor failed within 30 s");
    }
}

#[test]
fn a_send_larger_than_its_receive_fails_both_and_writes_nothing_past_the_buffer() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    let p = connect(&ctx);
    let msg = vec![0x5au8; 20_000];
    let mut rbuf = vec![0xeeu8; 30_000];
    let (rc, r) = irecv_group(p.recv, &[(rbuf.as_mut_ptr(), 10_000)], &[0]);
    assert_eq!(rc, NCCL_SUCCESS);
    let (rc, s) = isend_tag(p.send, &msg, 0);
    assert_eq!(rc, NCCL_SUCCESS);
    // ncclInvalidUsage on both ends, as NCCL's socket transport reports a truncated message.
    assert_eq!(wait(s, 1).0, INVALID_USAGE);
    assert_eq!(wait(r, 1).0, INVALID_USAGE);
    assert!(rbuf[10_000..].iter().all(|&b| b == 0xee), "bytes written past the posted receive");
    close(p);
    drop(ctx);
}

#[test]
fn a_grouped_receive_fills_each_buffer_by_tag_and_reports_each_size() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    let p = connect(&ctx);
    let mut a = vec![0u8; 4096];
    let mut b = vec![0u8; 4096];
    let mut z = vec![0u8; 16];
    let (rc, r) = irecv_group(p.recv, &[(a.as_mut_ptr(), 4096), (z.as_mut_ptr(), 0), (b.as_mut_ptr(), 4096)], &[1, 3, 2]);
    assert_eq!(rc, NCCL_SUCCESS);
    let m2 = vec![2u8; 1000];
    let m1 = vec![1u8; 3000];
    let (rc, s2) = isend_tag(p.send, &m2, 2);
    assert_eq!(rc, NCCL_SUCCESS);
    let (rc, s0) = isend_tag(p.send, &[], 3);
    assert_eq!(rc, NCCL_SUCCESS);
    let (rc, s1) = isend_tag(p.send, &m1, 1);
    assert_eq!(rc, NCCL_SUCCESS);
    assert_eq!(wait(s2, 1), (NCCL_SUCCESS, vec![1000]));
    assert_eq!(wait(s0, 1), (NCCL_SUCCESS, vec![0]));
    assert_eq!(wait(s1, 1), (NCCL_SUCCESS, vec![3000]));
    assert_eq!(wait(r, 3), (NCCL_SUCCESS, vec![3000, 0, 1000]));
    assert!(a[..3000].iter().all(|&x| x == 1) && a[3000..].iter().all(|&x| x == 0));
    assert!(b[..1000].iter().all(|&x| x == 2) && b[1000..].iter().all(|&x| x == 0));
    assert!(z.iter().all(|&x| x == 0));
    close(p);
    drop(ctx);
}

#[test]
fn a_foreign_handle_never_takes_over_another_connect_in_progress() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    let (mut ha, la) = listen(ctx.0);
    let mut s = null_mut();
    // SAFETY: first step of a connect to listener A.
    assert_eq!(unsafe { NET.connect.unwrap()(ctx.0, 0, ha.as_mut_ptr().cast(), &mut s, null_mut()) }, NCCL_SUCCESS);
    assert!(ha[64..72].iter().any(|&b| b != 0), "the connect keeps its state key in the handle");
    // Junk with no Prism magic that happens to carry A's key.
    let mut junk = [0u8; 128];
    junk[64..72].copy_from_slice(&ha[64..72]);
    let start = Instant::now();
    let rc = loop {
        let mut out = null_mut();
        // SAFETY: the connect contract with a 128-byte handle of junk.
        let rc = unsafe { NET.connect.unwrap()(ctx.0, 0, junk.as_mut_ptr().cast(), &mut out, null_mut()) };
        assert!(out.is_null(), "a handle without Prism's magic connected (it took over another caller's connect)");
        if rc != NCCL_SUCCESS {
            break rc;
        }
        let mut r = null_mut();
        // SAFETY: the accept contract.
        unsafe { NET.accept.unwrap()(la, &mut r, null_mut()) };
        if !r.is_null() {
            // SAFETY: closed once.
            unsafe { NET.close_recv.unwrap()(r) };
        }
        assert!(start.elapsed() < Duration::from_secs(10), "junk handle neither failed nor connected");
    };
    assert_ne!(rc, NCCL_SUCCESS);
    // Listener B's real handle, carrying A's key (a buffer reused without clearing): it connects to B.
    let (mut hb, lb) = listen(ctx.0);
    hb[64..72].copy_from_slice(&ha[64..72]);
    let (mut sb, mut rb, mut ra): (*mut c_void, *mut c_void, *mut c_void) = (null_mut(), null_mut(), null_mut());
    // B's comm pair carries data (a send comm connected to A would match no receive of B's).
    drive_connect(ctx.0, &mut hb, lb, &mut sb, &mut rb, Duration::from_secs(10));
    // And A's own caller still gets its comm, to A.
    drive_connect(ctx.0, &mut ha, la, &mut s, &mut ra, Duration::from_secs(10));
    let mut got = vec![0u8; 64];
    let (rc, r) = irecv_group(rb, &[(got.as_mut_ptr(), 64)], &[0]);
    assert_eq!(rc, NCCL_SUCCESS);
    let (rc, sreq) = isend_tag(sb, &[7u8; 64], 0);
    assert_eq!(rc, NCCL_SUCCESS);
    assert_eq!(wait(sreq, 1), (NCCL_SUCCESS, vec![64]));
    assert_eq!(wait(r, 1), (NCCL_SUCCESS, vec![64]));
    assert_eq!(got, vec![7u8; 64]);
    close(Pair { send: sb, recv: rb });
    close(Pair { send: s, recv: ra });
    // SAFETY: closed once.
    unsafe {
        NET.close_listen.unwrap()(la);
        NET.close_listen.unwrap()(lb);
    }
    drop(ctx);
}

#[test]
fn a_full_comm_answers_null_and_takes_posts_again_once_requests_complete() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    let p = connect(&ctx);
    let msg = vec![3u8; 512];
    let mut rbufs = vec![vec![0u8; 512]; 2048];
    // Receives with no sender: post until the comm says "later".
    let mut recvs = Vec::new();
    loop {
        let i = recvs.len();
        let (rc, r) = irecv_group(p.recv, &[(rbufs[i].as_mut_ptr(), 512)], &[0]);
        assert_eq!(rc, NCCL_SUCCESS, "a full recv comm must answer NULL, not an error");
        if r.is_null() {
            break;
        }
        recvs.push(r);
        assert!(recvs.len() < 2048, "2048 receives accepted without a test");
    }
    assert!(recvs.len() >= 32, "only {} receives in flight; NCCL needs 32", recvs.len());
    // Still "later" on a second try, and it stays so while nothing completes.
    let (rc, r) = irecv_group(p.recv, &[(rbufs[recvs.len()].as_mut_ptr(), 512)], &[0]);
    assert_eq!((rc, r.is_null()), (NCCL_SUCCESS, true));
    // One send completes the oldest receive; then a receive is taken again.
    let (rc, s) = isend_tag(p.send, &msg, 0);
    assert_eq!(rc, NCCL_SUCCESS);
    assert_eq!(wait(s, 1), (NCCL_SUCCESS, vec![512]));
    assert_eq!(wait(recvs.remove(0), 1), (NCCL_SUCCESS, vec![512]));
    let i = recvs.len() + 1;
    let (rc, r) = irecv_group(p.recv, &[(rbufs[i].as_mut_ptr(), 512)], &[0]);
    assert_eq!(rc, NCCL_SUCCESS);
    assert!(!r.is_null(), "the recv comm stayed full after a receive completed");
    recvs.push(r);
    // Every outstanding receive still completes, in posting order, with its own data.
    for (k, r) in recvs.into_iter().enumerate() {
        let m = vec![(k % 251) as u8; 100 + k];
        let (rc, s) = isend_tag(p.send, &m, 0);
        assert_eq!(rc, NCCL_SUCCESS);
        assert!(!s.is_null());
        assert_eq!(wait(s, 1), (NCCL_SUCCESS, vec![(100 + k) as c_int]));
        assert_eq!(wait(r, 1), (NCCL_SUCCESS, vec![(100 + k) as c_int]), "receive {k}");
    }
    close(p);
    drop(ctx);
}

/// A receive of `len` + 8 bytes, then a send of `len` patterned bytes on `p`: the message, the receive
/// buffer (its heap storage is what the receive writes to: keep it until the receive is done) and the
/// two requests.
fn post_one(p: &Pair, len: usize) -> (Vec<u8>, Vec<u8>, *mut c_void, *mut c_void) {
    let msg: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
    let mut got = vec![0u8; len + 8];
    let (rc, r) = irecv_group(p.recv, &[(got.as_mut_ptr(), len + 8)], &[0]);
    assert_eq!(rc, NCCL_SUCCESS);
    let (rc, s) = isend_tag(p.send, &msg, 0);
    assert_eq!(rc, NCCL_SUCCESS);
    (msg, got, r, s)
}

#[test]
fn a_receive_whose_send_completed_succeeds_even_if_the_sender_closed_before_it_was_tested() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    for len in [0usize, 100, 70_000, 1 << 20] {
        let p = connect(&ctx);
        let (msg, got, r, s) = post_one(&p, len);
        // The send is done once every byte is acknowledged: the receiver has all of it.
        assert_eq!(wait(s, 1), (NCCL_SUCCESS, vec![len as c_int]));
        // SAFETY: closed once, nothing in flight on it.
        assert_eq!(unsafe { NET.close_send.unwrap()(p.send) }, NCCL_SUCCESS);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(wait(r, 1), (NCCL_SUCCESS, vec![len as c_int]), "{len} bytes");
        assert_eq!(&got[..len], &msg[..]);
        // SAFETY: closed once.
        assert_eq!(unsafe { NET.close_recv.unwrap()(p.recv) }, NCCL_SUCCESS);
    }
    drop(ctx);
}

#[test]
fn a_send_whose_receive_completed_succeeds_even_if_the_receiver_closed_before_it_was_tested() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    for len in [0usize, 100, 70_000, 1 << 20] {
        for _ in 0..5 {
            let p = connect(&ctx);
            let (msg, got, r, s) = post_one(&p, len);
            // Progress the sender only through the receiver's tests (one progress thread serves both).
            assert_eq!(wait(r, 1), (NCCL_SUCCESS, vec![len as c_int]));
            assert_eq!(&got[..len], &msg[..]);
            // SAFETY: closed once, nothing in flight on it.
            assert_eq!(unsafe { NET.close_recv.unwrap()(p.recv) }, NCCL_SUCCESS);
            assert_eq!(wait(s, 1), (NCCL_SUCCESS, vec![len as c_int]), "{len} bytes: the peer got them all");
            // SAFETY: closed once.
            assert_eq!(unsafe { NET.close_send.unwrap()(p.send) }, NCCL_SUCCESS);
        }
    }
    drop(ctx);
}

#[test]
fn a_full_send_comm_takes_sends_again_once_they_complete_and_all_arrive_in_order() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    let p = connect(&ctx);
    let msgs: Vec<Vec<u8>> = (0..2048).map(|k| vec![(k % 251) as u8; 64 + k % 512]).collect();
    // Sends with no receive: post until the comm says "later".
    let mut sends = Vec::new();
    loop {
        let k = sends.len();
        let (rc, s) = isend_tag(p.send, &msgs[k], 0);
        assert_eq!(rc, NCCL_SUCCESS, "a full send comm must answer NULL, not an error");
        if s.is_null() {
            break;
        }
        sends.push(s);
        assert!(sends.len() < 2048, "2048 sends accepted without a test");
    }
    assert!(sends.len() >= 256, "only {} sends in flight; NCCL needs maxRecvs x 32", sends.len());
    let n = sends.len();
    // Receive them all, in order, each into its own buffer; then the comm takes a send again.
    let mut bufs = vec![vec![0u8; 1024]; n + 1];
    for (k, s) in sends.into_iter().enumerate() {
        let (rc, r) = irecv_group(p.recv, &[(bufs[k].as_mut_ptr(), 1024)], &[0]);
        assert_eq!(rc, NCCL_SUCCESS);
        assert!(!r.is_null());
        let len = msgs[k].len();
        assert_eq!(wait(r, 1), (NCCL_SUCCESS, vec![len as c_int]), "receive {k}");
        assert_eq!(&bufs[k][..len], &msgs[k][..], "receive {k} got another send's data");
        assert_eq!(wait(s, 1), (NCCL_SUCCESS, vec![len as c_int]), "send {k}");
    }
    let (rc, s) = isend_tag(p.send, &msgs[n], 0);
    assert_eq!(rc, NCCL_SUCCESS);
    assert!(!s.is_null(), "the send comm stayed full after every send completed");
    let (rc, r) = irecv_group(p.recv, &[(bufs[n].as_mut_ptr(), 1024)], &[0]);
    assert_eq!(rc, NCCL_SUCCESS);
    assert_eq!(wait(s, 1).0, NCCL_SUCCESS);
    assert_eq!(wait(r, 1).0, NCCL_SUCCESS);
    close(p);
    drop(ctx);
}

#[test]
fn testing_only_the_newest_request_progresses_the_ones_before_it() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(ENV);
    let p = connect(&ctx);
    let msgs: Vec<Vec<u8>> = (0..32).map(|k| vec![k as u8 + 1; 1000 + 3000 * k]).collect();
    let mut bufs = vec![vec![0u8; 100_000]; 32];
    let mut recvs = Vec::new();
    let mut sends = Vec::new();
    for k in 0..32 {
        let (rc, r) = irecv_group(p.recv, &[(bufs[k].as_mut_ptr(), 100_000)], &[0]);
        assert_eq!(rc, NCCL_SUCCESS);
        assert!(!r.is_null());
        recvs.push(r);
        let (rc, s) = isend_tag(p.send, &msgs[k], 0);
        assert_eq!(rc, NCCL_SUCCESS);
        assert!(!s.is_null());
        sends.push(s);
    }
    // aws-ofi-nccl's tests poll in arbitrary order: the newest of each first, then the rest backwards.
    let len = |k: usize| msgs[k].len() as c_int;
    assert_eq!(wait(recvs[31], 1), (NCCL_SUCCESS, vec![len(31)]));
    assert_eq!(wait(sends[31], 1), (NCCL_SUCCESS, vec![len(31)]));
    for k in (0..31).rev() {
        assert_eq!(wait(recvs[k], 1), (NCCL_SUCCESS, vec![len(k)]), "receive {k}");
        assert_eq!(wait(sends[k], 1), (NCCL_SUCCESS, vec![len(k)]), "send {k}");
        assert_eq!(&bufs[k][..msgs[k].len()], &msgs[k][..]);
    }
    close(p);
    drop(ctx);
}
