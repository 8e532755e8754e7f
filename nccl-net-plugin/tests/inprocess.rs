//! Claims about the entry points checked in-process, both ends of a loopback connection in this test
//! (the C harness covers the full scenarios across two processes). The v12 table is called exactly as
//! NCCL calls it. Tests here share the process-wide engine, so they run one at a time and each one
//! finalizes what it initialized.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use nccl_net_prism::abi::{NCCL_SUCCESS, PTR_HOST};
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;
use nccl_net_prism::global;
use nccl_net_prism::requests::SEND_POOL_SIZE as POOL_SIZE;
use parking_lot::Mutex;

mod common;
use common::Ctx;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A connected (send comm, recv comm) pair over loopback, made with NCCL's retry loop.
fn connect(ctx: &Ctx) -> (*mut c_void, *mut c_void) {
    let mut handle = [0u8; 128];
    let mut listen = null_mut();
    // SAFETY: the v12 listen contract: ctx from init, a 128-byte handle, a writable out-pointer.
    assert_eq!(unsafe { NET.listen.unwrap()(ctx.0, 0, handle.as_mut_ptr().cast(), &mut listen) }, NCCL_SUCCESS);
    assert!(!listen.is_null());
    let (mut send, mut recv): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    let start = std::time::Instant::now();
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            // SAFETY: the connect contract; the same handle on every retry, no device handle.
            let rc = unsafe { NET.connect.unwrap()(ctx.0, 0, handle.as_mut_ptr().cast(), &mut send, null_mut()) };
            assert_eq!(rc, NCCL_SUCCESS, "connect");
        }
        if recv.is_null() {
            // SAFETY: the accept contract.
            assert_eq!(unsafe { NET.accept.unwrap()(listen, &mut recv, null_mut()) }, NCCL_SUCCESS, "accept");
        }
        assert!(start.elapsed().as_secs() < 60, "no loopback connection within 60 s");
    }
    // SAFETY: the listen comm, closed once.
    assert_eq!(unsafe { NET.close_listen.unwrap()(listen) }, NCCL_SUCCESS);
    (send, recv)
}

fn close(send: *mut c_void, recv: *mut c_void) {
    // SAFETY: comms from connect/accept, closed once.
    unsafe {
        assert_eq!(NET.close_send.unwrap()(send), NCCL_SUCCESS);
        assert_eq!(NET.close_recv.unwrap()(recv), NCCL_SUCCESS);
    }
}

fn isend(send: *mut c_void, buf: &[u8]) -> (c_int, *mut c_void) {
    let mut req = null_mut();
    // SAFETY: `buf` outlives every use in these tests (requests complete or the comm closes first).
    let rc = unsafe { NET.isend.unwrap()(send, buf.as_ptr() as *mut c_void, buf.len(), 0, null_mut(), null_mut(), &mut req) };
    (rc, req)
}

fn irecv(recv: *mut c_void, buf: &mut [u8]) -> (c_int, *mut c_void) {
    let mut req = null_mut();
    let mut data = buf.as_mut_ptr().cast::<c_void>();
    let mut size = buf.len();
    let mut tag: c_int = 0;
    // SAFETY: arrays of one entry; `buf` outlives the request.
    let rc = unsafe { NET.irecv.unwrap()(recv, 1, &mut data, &mut size, &mut tag, null_mut(), null_mut(), &mut req) };
    (rc, req)
}

/// Tests every request round-robin until each is done, as NCCL's progress thread does; the reported
/// size of each, or its error code.
fn wait_all(reqs: &[*mut c_void]) -> Vec<Result<c_int, c_int>> {
    let start = std::time::Instant::now();
    let mut out: Vec<Option<Result<c_int, c_int>>> = vec![None; reqs.len()];
    while out.iter().any(Option::is_none) {
        for (i, &req) in reqs.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let (mut done, mut size) = (0, -1);
            // SAFETY: a request isend/irecv returned, not yet reported done.
            let rc = unsafe { NET.test.unwrap()(req, &mut done, &mut size) };
            if rc != NCCL_SUCCESS {
                out[i] = Some(Err(rc));
            } else if done == 1 {
                out[i] = Some(Ok(size));
            }
        }
        assert!(start.elapsed().as_secs() < 60, "requests not done within 60 s");
    }
    out.into_iter().flatten().collect()
}

#[test]
fn a_send_comm_that_is_full_answers_null_and_never_an_error() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(&[]);
    let (send, recv) = connect(&ctx);
    let msg = vec![7u8; 1024];
    // No receive is posted, so nothing can complete: the pool (or the engine) fills up.
    let mut posted = Vec::new();
    let mut nulls = 0;
    for _ in 0..POOL_SIZE + 8 {
        let (rc, req) = isend(send, &msg);
        assert_eq!(rc, NCCL_SUCCESS, "a full comm must answer NULL, not an error");
        if req.is_null() {
            nulls += 1;
        } else {
            posted.push(req);
        }
    }
    assert!(posted.len() >= 32, "only {} sends in flight; NCCL needs 32", posted.len());
    assert!(nulls >= 8, "{} sends accepted beyond a pool of {POOL_SIZE}", posted.len());
    // Closing with all of them in flight is fine too.
    close(send, recv);
    ctx.finalize();
}

#[test]
fn a_completed_request_is_not_touched_again() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(&[]);
    let (send, recv) = connect(&ctx);
    let msg: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let mut out = vec![0u8; 8000];
    let (rc, rreq) = irecv(recv, &mut out);
    assert_eq!(rc, NCCL_SUCCESS);
    let (rc, sreq) = isend(send, &msg);
    assert_eq!(rc, NCCL_SUCCESS);
    assert!(!rreq.is_null() && !sreq.is_null());
    assert_eq!(wait_all(&[sreq, rreq]), vec![Ok(5000), Ok(5000)]);
    assert_eq!(&out[..5000], &msg[..]);
    assert!(out[5000..].iter().all(|&b| b == 0));
    // NCCL never does this; if something did, the answer is an error, not a stale completion.
    let mut done = 0;
    // SAFETY: the token stays allocated while its comm lives.
    let rc = unsafe { NET.test.unwrap()(sreq, &mut done, null_mut()) };
    assert_ne!(rc, NCCL_SUCCESS);
    assert_eq!(done, 0);
    close(send, recv);
    ctx.finalize();
}

#[test]
fn finalizing_the_last_context_releases_the_engine_and_init_builds_a_new_one() {
    let _serial = ONE_AT_A_TIME.lock();
    let a = Ctx::init(&[]);
    let b = Ctx::init(&[]);
    assert_eq!(global::census(), (2, true));
    a.finalize();
    assert_eq!(global::census(), (1, true), "one live context keeps the engine");
    b.finalize();
    assert_eq!(global::census(), (0, false), "the last finalize releases the engine");
    let mut ndev = 0;
    // SAFETY: a writable int.
    assert_ne!(unsafe { NET.devices.unwrap()(&mut ndev) }, NCCL_SUCCESS, "devices without an engine must fail");
    let c = Ctx::init(&[]);
    // SAFETY: a writable int.
    assert_eq!(unsafe { NET.devices.unwrap()(&mut ndev) }, NCCL_SUCCESS);
    assert!(ndev >= 1);
    c.finalize();
}

#[test]
fn a_memory_handle_covers_only_its_range() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(&[]);
    let (send, recv) = connect(&ctx);
    let buf = vec![1u8; 4096];
    let mut mh = null_mut();
    // SAFETY: regMr contract: a comm we returned, a live buffer, a writable out-pointer.
    let rc = unsafe { NET.reg_mr.unwrap()(send, buf.as_ptr() as *mut c_void, 2048, PTR_HOST, &mut mh) };
    assert_eq!(rc, NCCL_SUCCESS);
    let mut req = null_mut();
    // 2048 bytes starting at byte 1024 reach 1024 bytes past the registered 2048.
    // SAFETY: isend contract; the call is refused before anything is posted.
    let rc = unsafe { NET.isend.unwrap()(send, buf.as_ptr().add(1024) as *mut c_void, 2048, 0, mh, null_mut(), &mut req) };
    assert_eq!(rc, 3, "a buffer outside its mhandle is NCCL misuse (ncclInternalError)");
    assert!(req.is_null());
    // SAFETY: the handle regMr returned, deregistered once.
    assert_eq!(unsafe { NET.dereg_mr.unwrap()(send, mh) }, NCCL_SUCCESS);
    close(send, recv);
    ctx.finalize();
}

/// Tests `req` until it is done or fails; the error code (0 if it succeeded).
fn test_until_done(req: *mut c_void) -> c_int {
    let start = std::time::Instant::now();
    loop {
        let (mut done, mut size) = (0, -1);
        // SAFETY: a request isend/irecv returned, not yet reported done.
        let rc = unsafe { NET.test.unwrap()(req, &mut done, &mut size) };
        if rc != NCCL_SUCCESS || done == 1 {
            return rc;
        }
        assert!(start.elapsed().as_secs() < 30, "request neither done nor failed within 30 s");
    }
}

#[test]
fn posts_after_the_peer_closed_are_accepted_and_fail_in_test() {
    let _serial = ONE_AT_A_TIME.lock();
    let ctx = Ctx::init(&[]);
    let msg = vec![3u8; 4096];
    let mut out = vec![0u8; 4096];

    // The receiver closes: the sender's first post may still be outstanding when the CLOSE arrives,
    // later ones find the comm dead. Each is a request (rc 0, not NULL) whose test fails.
    let (send, recv) = connect(&ctx);
    // SAFETY: a comm accept returned, closed once.
    assert_eq!(unsafe { NET.close_recv.unwrap()(recv) }, NCCL_SUCCESS);
    for i in 0..3 {
        let (rc, req) = isend(send, &msg);
        assert_eq!(rc, NCCL_SUCCESS, "isend {i} after the peer closed must be accepted");
        assert!(!req.is_null(), "isend {i} after the peer closed returned no request");
        assert_ne!(test_until_done(req), NCCL_SUCCESS, "isend {i} to a closed peer reported success");
    }
    // SAFETY: as above.
    assert_eq!(unsafe { NET.close_send.unwrap()(send) }, NCCL_SUCCESS);

    // The sender closes: the same for receives.
    let (send, recv) = connect(&ctx);
    // SAFETY: a comm connect returned, closed once.
    assert_eq!(unsafe { NET.close_send.unwrap()(send) }, NCCL_SUCCESS);
    for i in 0..3 {
        let (rc, req) = irecv(recv, &mut out);
        assert_eq!(rc, NCCL_SUCCESS, "irecv {i} after the peer closed must be accepted");
        assert!(!req.is_null(), "irecv {i} after the peer closed returned no request");
        assert_ne!(test_until_done(req), NCCL_SUCCESS, "irecv {i} from a closed peer reported success");
    }
    assert!(out.iter().all(|&b| b == 0), "a failed receive wrote its buffer");
    // SAFETY: as above.
    assert_eq!(unsafe { NET.close_recv.unwrap()(recv) }, NCCL_SUCCESS);
    ctx.finalize();
}
