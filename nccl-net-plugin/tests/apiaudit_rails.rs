//! Two rails (both on loopback): NCCL connects from whichever device its topology picked on this
//! rank to the device the peer listened on, which need not be the same index.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use nccl_net_prism::abi::NCCL_SUCCESS;
use nccl_net_prism::exports::ncclNetPlugin_v12 as NET;

mod common;
use common::Ctx;

fn pair(ctx: &Ctx, listen_dev: c_int, connect_dev: c_int) -> (*mut c_void, *mut c_void) {
    let mut handle = [0u8; 128];
    let mut l = null_mut();
    // SAFETY: the listen contract.
    assert_eq!(unsafe { NET.listen.unwrap()(ctx.0, listen_dev, handle.as_mut_ptr().cast(), &mut l) }, NCCL_SUCCESS);
    let (mut s, mut r): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    let start = Instant::now();
    while s.is_null() || r.is_null() {
        // SAFETY: the connect/accept contracts.
        unsafe {
            if s.is_null() {
                assert_eq!(NET.connect.unwrap()(ctx.0, connect_dev, handle.as_mut_ptr().cast(), &mut s, null_mut()), NCCL_SUCCESS);
            }
            if r.is_null() {
                assert_eq!(NET.accept.unwrap()(l, &mut r, null_mut()), NCCL_SUCCESS);
            }
        }
        assert!(start.elapsed() < Duration::from_secs(30), "dev {connect_dev} -> listener on dev {listen_dev}: no connection");
    }
    // SAFETY: closed once.
    assert_eq!(unsafe { NET.close_listen.unwrap()(l) }, NCCL_SUCCESS);
    (s, r)
}

fn wait(req: *mut c_void) -> (c_int, c_int) {
    let start = Instant::now();
    loop {
        let (mut done, mut size) = (0, -1);
        // SAFETY: a live request.
        let rc = unsafe { NET.test.unwrap()(req, &mut done, &mut size) };
        if rc != NCCL_SUCCESS || done == 1 {
            return (rc, size);
        }
        assert!(start.elapsed() < Duration::from_secs(30), "request neither done nor failed within 30 s");
    }
}

#[test]
fn a_connect_from_one_device_to_a_listener_on_another_carries_data_both_ways() {
    std::env::set_var("PRISM_IFNAMES", "lo,lo");
    let ctx = Ctx::init(&[]);
    let mut ndev = 0;
    // SAFETY: a writable int.
    assert_eq!(unsafe { NET.devices.unwrap()(&mut ndev) }, NCCL_SUCCESS);
    assert_eq!(ndev, 2);
    for (ld, cd) in [(1, 0), (0, 1), (1, 1)] {
        let (s, r) = pair(&ctx, ld, cd);
        for len in [0usize, 1, 5000, 1 << 20] {
            let msg: Vec<u8> = (0..len).map(|i| (i * 13 + ld as usize) as u8).collect();
            let mut got = vec![0u8; len + 64];
            let (mut d, mut sz, mut tag) = (got.as_mut_ptr().cast::<c_void>(), len + 64, 0 as c_int);
            let mut rreq = null_mut();
            let mut sreq = null_mut();
            // SAFETY: arrays of one entry; the buffers outlive the requests.
            unsafe {
                assert_eq!(NET.irecv.unwrap()(r, 1, &mut d, &mut sz, &mut tag, null_mut(), null_mut(), &mut rreq), NCCL_SUCCESS);
                assert_eq!(NET.isend.unwrap()(s, msg.as_ptr() as *mut c_void, len, 0, null_mut(), null_mut(), &mut sreq), NCCL_SUCCESS);
            }
            assert!(!rreq.is_null() && !sreq.is_null());
            assert_eq!(wait(sreq), (NCCL_SUCCESS, len as c_int), "dev {cd} -> dev {ld}, {len} bytes");
            assert_eq!(wait(rreq), (NCCL_SUCCESS, len as c_int), "dev {cd} -> dev {ld}, {len} bytes");
            assert_eq!(&got[..len], &msg[..]);
        }
        // SAFETY: closed once.
        unsafe {
            assert_eq!(NET.close_send.unwrap()(s), NCCL_SUCCESS);
            assert_eq!(NET.close_recv.unwrap()(r), NCCL_SUCCESS);
        }
    }
    ctx.finalize();
}
