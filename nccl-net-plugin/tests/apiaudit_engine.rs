//! The process-wide engine across v11/v12 contexts when the previous engine is still alive: comms of a
//! finalized context still open, or another thread's finalize still tearing it down. A new `init` must
//! not build a second engine beside it (with `PRISM_UDP_SPORT_BASE` the second one cannot even bind
//! its ports). In its own binary: it sets the environment.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use nccl_net_prism::abi::NCCL_SUCCESS;
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;
use parking_lot::Mutex;

mod common;
use common::{close, drive_connect, listen, Pair};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn env() {
    std::env::set_var("PRISM_IFNAMES", "lo");
    std::env::set_var("PRISM_PATHS", "4");
    std::env::set_var("PRISM_UDP_SPORT_BASE", "47100");
}

fn init() -> Result<*mut c_void, c_int> {
    let mut ctx = null_mut();
    // SAFETY: NCCL's init contract: a writable ctx slot, no config, no logger, no profiler.
    match unsafe { NET.init.unwrap()(&mut ctx, 1, null_mut(), None, None) } {
        NCCL_SUCCESS => Ok(ctx),
        rc => Err(rc),
    }
}

fn finalize(ctx: *mut c_void) {
    // SAFETY: a context init returned, finalized once.
    assert_eq!(unsafe { NET.finalize.unwrap()(ctx) }, NCCL_SUCCESS);
}

fn pair(ctx: *mut c_void) -> (*mut c_void, *mut c_void) {
    let (mut handle, l) = listen(ctx);
    let (mut s, mut r) = (null_mut(), null_mut());
    drive_connect(ctx, &mut handle, l, &mut s, &mut r, Duration::from_secs(30));
    // SAFETY: closed once.
    assert_eq!(unsafe { NET.close_listen.unwrap()(l) }, NCCL_SUCCESS);
    (s, r)
}

fn exchange(s: *mut c_void, r: *mut c_void, len: usize) {
    let msg: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
    let mut got = vec![0u8; len];
    let (mut d, mut sz, mut tag) = (got.as_mut_ptr().cast::<c_void>(), len, 0 as c_int);
    let (mut rreq, mut sreq) = (null_mut(), null_mut());
    // SAFETY: arrays of one entry; the buffers outlive the requests.
    unsafe {
        assert_eq!(NET.irecv.unwrap()(r, 1, &mut d, &mut sz, &mut tag, null_mut(), null_mut(), &mut rreq), NCCL_SUCCESS);
        assert_eq!(NET.isend.unwrap()(s, msg.as_ptr() as *mut c_void, len, 0, null_mut(), null_mut(), &mut sreq), NCCL_SUCCESS);
    }
    for req in [sreq, rreq] {
        let start = Instant::now();
        loop {
            let mut done = 0;
            // SAFETY: a live request.
            assert_eq!(unsafe { NET.test.unwrap()(req, &mut done, null_mut()) }, NCCL_SUCCESS);
            if done == 1 {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "request not done within 30 s");
        }
    }
    assert_eq!(got, msg);
}

#[test]
fn init_while_a_finalized_contexts_comms_are_open_reuses_their_engine() {
    let _serial = ONE_AT_A_TIME.lock();
    env();
    let ctx1 = init().expect("first init");
    let (s1, r1) = pair(ctx1);
    finalize(ctx1);
    // The comms keep the engine (and its fixed source ports) alive: the next init must share it.
    let ctx2 = init().unwrap_or_else(|rc| panic!("init beside a live engine failed with {rc}"));
    let (s2, r2) = pair(ctx2);
    exchange(s1, r1, 10_000);
    exchange(s2, r2, 10_000);
    close(Pair { send: s1, recv: r1 });
    exchange(s2, r2, 10_000);
    close(Pair { send: s2, recv: r2 });
    finalize(ctx2);
    assert_eq!(nccl_net_prism::global::census(), (0, false));
}

#[test]
fn init_racing_another_threads_last_finalize_never_fails() {
    let _serial = ONE_AT_A_TIME.lock();
    env();
    let failures = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| {
                for _ in 0..200 {
                    match init() {
                        Ok(ctx) => finalize(ctx),
                        Err(_) => {
                            failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    assert_eq!(failures.into_inner(), 0, "inits failed while another thread's finalize dropped the engine");
}
