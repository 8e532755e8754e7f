//! Connection setup and teardown: listen, connect, accept, and the three closes.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use crate::abi::{CommConfig, DeviceHandle, NcclResult};
use crate::comm::{Context, ListenObj, RecvObj, SendObj};
use crate::error::PluginError;
use crate::global::{self, NetState};
use crate::handle::{conn_handle, out_ptr, Tagged};
use crate::requests::CommKind;

use super::{guard, no_dev_comm};

/// Shared body of every `listen`.
///
/// # Safety
/// `handle` must be NULL or `NCCL_NET_HANDLE_MAXSIZE` writable bytes; `listen_comm` NULL or writable.
unsafe fn listen_on(net: Arc<NetState>, dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> Result<(), PluginError> {
    // SAFETY: forwarded contract.
    let out = unsafe { out_ptr(listen_comm, "listenComm") }?;
    // SAFETY: forwarded contract.
    let handle = unsafe { conn_handle(handle) }?;
    let dev = net.dev(dev)?;
    let listener = net.net.listen(dev, handle)?;
    *out = Tagged::into_raw(ListenObj { net, listener: parking_lot::Mutex::new(listener) });
    Ok(())
}

/// `listen` of v9/v10.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn listen_v9(dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> NcclResult {
    // SAFETY: NCCL passes its handle buffer and a writable out-pointer.
    guard("listen", || unsafe { listen_on(global::current("listen")?, dev, handle, listen_comm) })
}

/// `listen` of v11/v12.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn listen_v11(ctx: *mut c_void, dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> NcclResult {
    guard("listen", || {
        // SAFETY: NCCL passes a context `init` returned.
        let net = unsafe { Tagged::<Context>::from_ptr(ctx, "ctx") }?.net.clone();
        // SAFETY: NCCL passes its handle buffer and a writable out-pointer.
        unsafe { listen_on(net, dev, handle, listen_comm) }
    })
}

/// Shared body of every `connect`: one non-blocking step of the handshake.
///
/// # Safety
/// As for `listen_on`; `dev_comm` NULL or writable.
unsafe fn connect_to(
    net: Arc<NetState>,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    dev_comm: *mut *mut DeviceHandle,
) -> Result<(), PluginError> {
    // SAFETY: forwarded contract.
    unsafe { no_dev_comm(dev_comm) };
    // SAFETY: forwarded contract.
    let out = unsafe { out_ptr(send_comm, "sendComm") }?;
    // SAFETY: forwarded contract; NCCL passes the same handle buffer on every retry and nobody else
    // touches it meanwhile, so the engine may keep its connect state in it.
    let handle = unsafe { conn_handle(handle) }?;
    let dev = net.dev(dev)?;
    if let Some(comm) = net.net.connect(dev, handle)? {
        *out = SendObj::into_raw(net, comm, CommKind::Send);
    }
    Ok(())
}

/// `connect` of v9.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn connect_v9(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    dev_comm: *mut *mut DeviceHandle,
) -> NcclResult {
    // SAFETY: NCCL passes its handle buffer and writable out-pointers.
    guard("connect", || unsafe { connect_to(global::current("connect")?, dev, handle, send_comm, dev_comm) })
}

/// `connect` of v10 (the traffic class in `config` is not used: UDP rails have none to set yet).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn connect_v10(
    dev: c_int,
    _config: *mut CommConfig,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    dev_comm: *mut *mut DeviceHandle,
) -> NcclResult {
    // SAFETY: NCCL passes its handle buffer and writable out-pointers.
    guard("connect", || unsafe { connect_to(global::current("connect")?, dev, handle, send_comm, dev_comm) })
}

/// `connect` of v11/v12.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn connect_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    dev_comm: *mut *mut DeviceHandle,
) -> NcclResult {
    guard("connect", || {
        // SAFETY: NCCL passes a context `init` returned.
        let net = unsafe { Tagged::<Context>::from_ptr(ctx, "ctx") }?.net.clone();
        // SAFETY: NCCL passes its handle buffer and writable out-pointers.
        unsafe { connect_to(net, dev, handle, send_comm, dev_comm) }
    })
}

/// `accept`: one non-blocking step of the handshake on the listener.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn accept(listen_comm: *mut c_void, recv_comm: *mut *mut c_void, dev_comm: *mut *mut DeviceHandle) -> NcclResult {
    guard("accept", || {
        // SAFETY: NCCL passes NULL or a writable device-handle slot.
        unsafe { no_dev_comm(dev_comm) };
        // SAFETY: NCCL passes a writable out-pointer.
        let out = unsafe { out_ptr(recv_comm, "recvComm") }?;
        // SAFETY: NCCL passes a listen comm `listen` returned.
        let l = unsafe { Tagged::<ListenObj>::from_ptr(listen_comm, "listenComm") }?;
        let accepted = l.listener.lock().accept()?;
        if let Some(comm) = accepted {
            *out = RecvObj::into_raw(l.net.clone(), comm, CommKind::Recv);
        }
        Ok(())
    })
}

// ---------------------------------------------------------------- memory registration

/// `closeSend`; requests still in flight are dropped with the comm.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn close_send(send_comm: *mut c_void) -> NcclResult {
    guard("closeSend", || {
        if send_comm.is_null() {
            return Ok(()); // as NCCL's own transports: closing nothing succeeds
        }
        // SAFETY: NCCL passes a send comm `connect` returned, once, with no call on it in progress.
        let comm = unsafe { Tagged::<SendObj>::take(send_comm, "sendComm") }?;
        log_close("send", comm.outstanding());
        Ok(())
    })
}

/// `closeRecv`; requests still in flight are dropped with the comm.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn close_recv(recv_comm: *mut c_void) -> NcclResult {
    guard("closeRecv", || {
        if recv_comm.is_null() {
            return Ok(());
        }
        // SAFETY: NCCL passes a recv comm `accept` returned, once, with no call on it in progress.
        let comm = unsafe { Tagged::<RecvObj>::take(recv_comm, "recvComm") }?;
        log_close("recv", comm.outstanding());
        Ok(())
    })
}

fn log_close(kind: &str, outstanding: usize) {
    if outstanding > 0 {
        tracing::info!("closing a {kind} comm with {outstanding} request(s) in flight; they are dropped");
    }
}

/// `closeListen`.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn close_listen(listen_comm: *mut c_void) -> NcclResult {
    guard("closeListen", || {
        if listen_comm.is_null() {
            return Ok(());
        }
        // SAFETY: NCCL passes a listen comm `listen` returned, once.
        unsafe { Tagged::<ListenObj>::take(listen_comm, "listenComm") }.map(drop)
    })
}
