//! The four tables NCCL looks up with `dlsym`, newest first: `ncclNetPlugin_v12` (NCCL 2.30),
//! `_v11` (2.28-2.29), `_v10` (2.26-2.27), `_v9` (2.24-2.25).
//!
//! `getDeviceMr`, `irecvConsumed` and `makeVDevice` are NULL (NCCL checks them: no device offload, and
//! each physical rail is already its own device). v11/v12 `setNetAttr` is a function that accepts and
//! ignores the hints, so NCCL's calls succeed.
#![allow(non_upper_case_globals)]

use crate::abi::{NetV10, NetV11, NetV12, NetV9};
use crate::entry;

/// Network name NCCL shows and matches with `NCCL_NET=Prism`.
const NAME: &std::ffi::CStr = c"Prism";

/// NCCL 2.30.
#[no_mangle]
pub static ncclNetPlugin_v12: NetV12 = NetV12 {
    name: NAME.as_ptr(),
    init: Some(entry::init_v11),
    devices: Some(entry::devices),
    get_properties: Some(entry::get_properties_v12),
    listen: Some(entry::listen_v11),
    connect: Some(entry::connect_v11),
    accept: Some(entry::accept),
    reg_mr: Some(entry::reg_mr),
    reg_mr_dma_buf: Some(entry::reg_mr_dma_buf),
    dereg_mr: Some(entry::dereg_mr),
    isend: Some(entry::isend_v10),
    irecv: Some(entry::irecv_v10),
    iflush: Some(entry::iflush),
    test: Some(entry::test),
    close_send: Some(entry::close_send),
    close_recv: Some(entry::close_recv),
    close_listen: Some(entry::close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_v_device: None,
    finalize: Some(entry::finalize),
    set_net_attr: Some(entry::set_net_attr),
};

/// NCCL 2.28-2.29.
#[no_mangle]
pub static ncclNetPlugin_v11: NetV11 = NetV11 {
    name: NAME.as_ptr(),
    init: Some(entry::init_v11),
    devices: Some(entry::devices),
    get_properties: Some(entry::get_properties_v11),
    listen: Some(entry::listen_v11),
    connect: Some(entry::connect_v11),
    accept: Some(entry::accept),
    reg_mr: Some(entry::reg_mr),
    reg_mr_dma_buf: Some(entry::reg_mr_dma_buf),
    dereg_mr: Some(entry::dereg_mr),
    isend: Some(entry::isend_v10),
    irecv: Some(entry::irecv_v10),
    iflush: Some(entry::iflush),
    test: Some(entry::test),
    close_send: Some(entry::close_send),
    close_recv: Some(entry::close_recv),
    close_listen: Some(entry::close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_v_device: None,
    finalize: Some(entry::finalize),
    set_net_attr: Some(entry::set_net_attr),
};

/// NCCL 2.26-2.27.
#[no_mangle]
pub static ncclNetPlugin_v10: NetV10 = NetV10 {
    name: NAME.as_ptr(),
    init: Some(entry::init_v10),
    devices: Some(entry::devices),
    get_properties: Some(entry::get_properties_v9),
    listen: Some(entry::listen_v9),
    connect: Some(entry::connect_v10),
    accept: Some(entry::accept),
    reg_mr: Some(entry::reg_mr),
    reg_mr_dma_buf: Some(entry::reg_mr_dma_buf),
    dereg_mr: Some(entry::dereg_mr),
    isend: Some(entry::isend_v10),
    irecv: Some(entry::irecv_v10),
    iflush: Some(entry::iflush),
    test: Some(entry::test),
    close_send: Some(entry::close_send),
    close_recv: Some(entry::close_recv),
    close_listen: Some(entry::close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_v_device: None,
};

/// NCCL 2.24-2.25.
#[no_mangle]
pub static ncclNetPlugin_v9: NetV9 = NetV9 {
    name: NAME.as_ptr(),
    init: Some(entry::init_v9),
    devices: Some(entry::devices),
    get_properties: Some(entry::get_properties_v9),
    listen: Some(entry::listen_v9),
    connect: Some(entry::connect_v9),
    accept: Some(entry::accept),
    reg_mr: Some(entry::reg_mr),
    reg_mr_dma_buf: Some(entry::reg_mr_dma_buf),
    dereg_mr: Some(entry::dereg_mr),
    isend: Some(entry::isend_v9),
    irecv: Some(entry::irecv_v9),
    iflush: Some(entry::iflush),
    test: Some(entry::test),
    close_send: Some(entry::close_send),
    close_recv: Some(entry::close_recv),
    close_listen: Some(entry::close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_v_device: None,
};
