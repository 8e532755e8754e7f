//! The `extern "C"` functions NCCL calls through the tables in [`crate::exports`].
//!
//! Each one is the same shape: [`guard`] (install the logger bridge, stop panics, turn an error into
//! its result code with a WARN saying why), then argument checks that turn NCCL's raw pointers into
//! checked Rust values, then one call into the safe API (`global`, `comm`, `mr`). Output pointers are
//! cleared first, so NCCL sees NULL whenever a call fails or has nothing yet.
//!
//! Safety contract of every function here: NCCL passes each pointer either NULL or valid for what the
//! ABI says the slot does with it (out-pointers writable, arrays of `n` entries, buffers alive until
//! their request completes, objects that this plugin returned earlier and has not freed). NULL,
//! misaligned pointers, and objects of the wrong kind are detected and refused.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use prism_transport::engine::{RecvBuf, MAX_RECVS};

use crate::abi::{
    CommConfig, DeviceHandle, Logger, NcclResult, NetAttr, ProfilerCallback, PropertiesV11, PropertiesV12, PropertiesV9,
    NCCL_INTERNAL_ERROR, NCCL_SUCCESS, PTR_CUDA,
};
use crate::buf::{HostRecvBuf, HostSendBuf};
use crate::comm::{Context, ListenObj, RecvObj, SendObj};
use crate::error::{invalid, PluginError};
use crate::global::{self, NetState};
use crate::handle::{conn_handle, out_ptr, Tagged};
use crate::mr::{MemRegion, CUDA_UNSUPPORTED};
use crate::requests::{CommKind, RequestToken};

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Runs one entry point: no panic leaves it, and an error becomes its result code plus a WARN.
fn guard(func: &'static str, f: impl FnOnce() -> Result<(), PluginError>) -> NcclResult {
    // The outer catch covers the logging itself, so not even a failing log line can unwind into C.
    catch_unwind(AssertUnwindSafe(|| {
        crate::log::ensure_installed();
        let result = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => r,
            Err(payload) => Err(PluginError::Panic(panic_message(&*payload))),
        };
        match result {
            Ok(()) => NCCL_SUCCESS,
            Err(e) => {
                let code = e.code();
                tracing::warn!("{func}: {e} (returning {code})");
                code
            }
        }
    }))
    .unwrap_or(NCCL_INTERNAL_ERROR)
}

/// Writes through a plain out-pointer after checking it.
///
/// # Safety
/// `ptr` must be NULL or valid for writes of a `T`.
unsafe fn write_out<T>(ptr: *mut T, value: T, what: &str) -> Result<(), PluginError> {
    if ptr.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !ptr.is_aligned() {
        return Err(invalid(format!("{what} {ptr:p} is misaligned")));
    }
    // SAFETY: non-null and aligned; the caller guarantees it is writable.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Clears NCCL's device-offload out-pointer: host comms have none. NULL means NCCL asked for nothing.
///
/// # Safety
/// `dev_comm` must be NULL or valid for a pointer-sized write.
unsafe fn no_dev_comm(dev_comm: *mut *mut DeviceHandle) {
    if !dev_comm.is_null() && dev_comm.is_aligned() {
        // SAFETY: non-null, aligned, and by the caller's contract writable.
        unsafe { dev_comm.write(std::ptr::null_mut()) };
    }
}

// ---------------------------------------------------------------- init / finalize

/// `init` of v9.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn init_v9(log: Option<Logger>) -> NcclResult {
    guard("init", || {
        crate::log::set_logger(log);
        global::init_legacy().map(drop)
    })
}

/// `init` of v10 (the profiler callback is not used).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn init_v10(log: Option<Logger>, _prof: Option<ProfilerCallback>) -> NcclResult {
    guard("init", || {
        crate::log::set_logger(log);
        global::init_legacy().map(drop)
    })
}

/// `init` of v11/v12: one context per communicator.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn init_v11(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfig,
    log: Option<Logger>,
    _prof: Option<ProfilerCallback>,
) -> NcclResult {
    guard("init", || {
        crate::log::set_logger(log);
        // SAFETY: NCCL passes a writable pointer-sized slot for the context.
        let ctx = unsafe { out_ptr(ctx, "ctx") }?;
        // NCCL's config lives on its stack: copy the value now.
        let traffic_class = if config.is_null() || !config.is_aligned() {
            -1
        } else {
            // SAFETY: non-null and aligned; NCCL passes a valid ncclNetCommConfig for the call.
            unsafe { (*config).traffic_class }
        };
        let net = global::init_context()?;
        tracing::debug!(comm_id = format!("{comm_id:#x}"), traffic_class, "communicator context created");
        *ctx = Tagged::into_raw(Context { comm_id, traffic_class, net });
        Ok(())
    })
}

/// `finalize` of v11/v12.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn finalize(ctx: *mut c_void) -> NcclResult {
    guard("finalize", || {
        // SAFETY: NCCL passes back the context `init` returned, once.
        let c = unsafe { Tagged::<Context>::take(ctx, "ctx") }?;
        tracing::debug!(comm_id = format!("{:#x}", c.comm_id), "communicator context finalized");
        drop(c);
        global::finalize_context();
        Ok(())
    })
}

/// `setNetAttr` of v11/v12: the hints are accepted and ignored (Prism balances per message on its own).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn set_net_attr(ctx: *mut c_void, attr: *mut NetAttr) -> NcclResult {
    guard("setNetAttr", || {
        // SAFETY: NCCL passes a context `init` returned.
        unsafe { Tagged::<Context>::from_ptr(ctx, "ctx") }?;
        if !attr.is_null() && attr.is_aligned() {
            // SAFETY: non-null and aligned; NCCL passes a valid ncclNetAttr for the call.
            let a = unsafe { *attr };
            tracing::trace!(op = a.op, algo = a.algo, proto = a.proto, "setNetAttr hint ignored");
        }
        Ok(())
    })
}

// ---------------------------------------------------------------- devices

/// `devices`: one per rail.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    guard("devices", || {
        let net = global::current("devices")?;
        let n = c_int::try_from(net.devices.len()).unwrap_or(c_int::MAX);
        // SAFETY: NCCL passes a writable int.
        unsafe { write_out(ndev, n, "ndev") }
    })
}

fn props_of(dev: c_int) -> Result<crate::abi::props::DeviceProps, PluginError> {
    global::current("getProperties")?.props(dev)
}

/// `getProperties` of v9/v10 (104-byte layout).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn get_properties_v9(dev: c_int, props: *mut PropertiesV9) -> NcclResult {
    // SAFETY: NCCL passes a writable struct of the v9/v10 layout.
    guard("getProperties", || unsafe { write_out(props, props_of(dev)?.to_v9(), "props") })
}

/// `getProperties` of v11 (112-byte layout).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn get_properties_v11(dev: c_int, props: *mut PropertiesV11) -> NcclResult {
    // SAFETY: NCCL passes a writable struct of the v11 layout.
    guard("getProperties", || unsafe { write_out(props, props_of(dev)?.to_v11(), "props") })
}

/// `getProperties` of v12 (128-byte layout).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn get_properties_v12(dev: c_int, props: *mut PropertiesV12) -> NcclResult {
    // SAFETY: NCCL passes a writable struct of the v12 layout.
    guard("getProperties", || unsafe { write_out(props, props_of(dev)?.to_v12(), "props") })
}

// ---------------------------------------------------------------- connection setup

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

/// Checks that `comm` is one of our send or receive comms.
///
/// # Safety
/// `comm` must be NULL or point to readable memory NCCL got from `connect`/`accept`.
unsafe fn check_data_comm(comm: *mut c_void) -> Result<(), PluginError> {
    // SAFETY: forwarded contract.
    if unsafe { Tagged::<SendObj>::from_ptr(comm, "comm") }.is_ok() {
        return Ok(());
    }
    // SAFETY: forwarded contract.
    unsafe { Tagged::<RecvObj>::from_ptr(comm, "comm") }.map(drop)
}

/// The engine a data comm belongs to.
///
/// # Safety
/// As for `check_data_comm`.
unsafe fn data_comm_net(comm: *mut c_void) -> Result<std::sync::Arc<crate::global::NetState>, PluginError> {
    // SAFETY: forwarded contract.
    if let Ok(s) = unsafe { Tagged::<SendObj>::from_ptr(comm, "comm") } {
        return Ok(s.net.clone());
    }
    // SAFETY: forwarded contract.
    unsafe { Tagged::<RecvObj>::from_ptr(comm, "comm") }.map(|r| r.net.clone())
}

/// Shared body of `regMr` and `regMrDmaBuf`.
///
/// # Safety
/// `comm` as for `check_data_comm`; `mhandle` NULL or writable.
unsafe fn register(comm: *mut c_void, data: *mut c_void, size: usize, kind: c_int, mhandle: *mut *mut c_void) -> Result<(), PluginError> {
    // SAFETY: forwarded contract.
    let out = unsafe { out_ptr(mhandle, "mhandle") }?;
    // SAFETY: forwarded contract.
    unsafe { check_data_comm(comm) }?;
    let mut region = MemRegion::register(data as usize, size, kind)?;
    // SAFETY: forwarded contract (checked just above to be one of our comms).
    region.register_with(unsafe { data_comm_net(comm) }?)?;
    *out = Tagged::into_raw(region);
    Ok(())
}

/// `regMr`.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn reg_mr(comm: *mut c_void, data: *mut c_void, size: usize, kind: c_int, mhandle: *mut *mut c_void) -> NcclResult {
    // SAFETY: NCCL passes a comm it got from us and a writable out-pointer.
    guard("regMr", || unsafe { register(comm, data, size, kind, mhandle) })
}

/// `regMrDmaBuf`: host memory registers as with `regMr`; a dma-buf is GPU memory, which needs GPUDirect.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn reg_mr_dma_buf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    _offset: u64,
    _fd: c_int,
    mhandle: *mut *mut c_void,
) -> NcclResult {
    guard("regMrDmaBuf", || {
        if kind & PTR_CUDA != 0 {
            // SAFETY: NCCL passes NULL or a writable out-pointer.
            unsafe { out_ptr(mhandle, "mhandle") }?;
            return Err(PluginError::Unsupported(format!("regMrDmaBuf type {kind:#x}: {CUDA_UNSUPPORTED}")));
        }
        // SAFETY: NCCL passes a comm it got from us and a writable out-pointer.
        unsafe { register(comm, data, size, kind, mhandle) }
    })
}

/// `deregMr`. NULL is fine. The comm is not looked at: the handle is self-contained, and the caller may
/// already have closed the comm.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn dereg_mr(_comm: *mut c_void, mhandle: *mut c_void) -> NcclResult {
    guard("deregMr", || {
        if mhandle.is_null() {
            return Ok(());
        }
        // SAFETY: NCCL passes back a handle regMr returned, once.
        unsafe { Tagged::<MemRegion>::take(mhandle, "mhandle") }.map(drop)
    })
}

/// Checks an optional memory handle against a buffer.
///
/// # Safety
/// `mhandle` must be NULL or point to readable memory NCCL got from `regMr`.
unsafe fn check_mr(mhandle: *mut c_void, data: *mut c_void, size: usize) -> Result<(), PluginError> {
    if mhandle.is_null() {
        return Ok(());
    }
    // SAFETY: forwarded contract.
    unsafe { Tagged::<MemRegion>::from_ptr(mhandle, "mhandle") }?.check_covers(data as usize, size)
}

// ---------------------------------------------------------------- data path

/// Shared body of every `isend`.
///
/// # Safety
/// NCCL's contract: `send_comm` from `connect`, `data` valid for `size` bytes until the request
/// completes, `mhandle` NULL or from `regMr`, `request` writable.
unsafe fn post_send(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> Result<(), PluginError> {
    // SAFETY: forwarded contract.
    let out = unsafe { out_ptr(request, "request") }?;
    // SAFETY: forwarded contract.
    let comm = unsafe { Tagged::<SendObj>::from_ptr(send_comm, "sendComm") }?;
    if data.is_null() && size > 0 {
        return Err(invalid(format!("isend of {size} bytes from NULL")));
    }
    // SAFETY: forwarded contract.
    unsafe { check_mr(mhandle, data, size) }?;
    // SAFETY: NCCL keeps `data` readable and unchanged for `size` bytes until test reports the request
    // done or the comm is closed; NULL only with size 0 (checked above).
    let buf = unsafe { HostSendBuf::new(data.cast_const().cast(), size) };
    *out = comm.isend(Box::new(buf), tag)?;
    Ok(())
}

/// `isend` of v9.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn isend_v9(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's isend contract.
    guard("isend", || unsafe { post_send(send_comm, data, size, tag, mhandle, request) })
}

/// `isend` of v10-v12 (the profiler handle is not used).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn isend_v10(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    _phandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's isend contract.
    guard("isend", || unsafe { post_send(send_comm, data, size, tag, mhandle, request) })
}

/// Reads NCCL's array argument of `n` entries.
///
/// # Safety
/// `ptr` must be NULL or valid for reads of `n` `T`s for `'a`.
unsafe fn array<'a, T>(ptr: *const T, n: usize, what: &str) -> Result<&'a [T], PluginError> {
    if ptr.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !ptr.is_aligned() {
        return Err(invalid(format!("{what} {ptr:p} is misaligned")));
    }
    // SAFETY: non-null, aligned, and the caller guarantees n readable entries.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// Checks `n` against `maxRecvs`.
fn recv_count(n: c_int, call: &str) -> Result<usize, PluginError> {
    usize::try_from(n)
        .ok()
        .filter(|n| (1..=MAX_RECVS).contains(n))
        .ok_or_else(|| invalid(format!("{call} n = {n}: must be between 1 and maxRecvs = {MAX_RECVS}")))
}

/// Shared body of every `irecv`.
///
/// # Safety
/// NCCL's contract: `recv_comm` from `accept`; `data`, `sizes`, `tags` arrays of `n` entries and
/// `mhandles` NULL or such an array; each buffer writable for its size until the request completes;
/// `request` writable (its incoming value, possibly the optional-completion hint 0x1, is never read).
unsafe fn post_recv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> Result<(), PluginError> {
    // SAFETY: forwarded contract.
    let out = unsafe { out_ptr(request, "request") }?;
    // SAFETY: forwarded contract.
    let comm = unsafe { Tagged::<RecvObj>::from_ptr(recv_comm, "recvComm") }?;
    let n = recv_count(n, "irecv")?;
    // SAFETY: forwarded contract (n entries each).
    let (data, sizes, tags) = unsafe { (array(data, n, "data")?, array(sizes, n, "sizes")?, array(tags, n, "tags")?) };
    let mhandles = if mhandles.is_null() {
        None
    } else {
        // SAFETY: forwarded contract.
        Some(unsafe { array(mhandles, n, "mhandles") }?)
    };
    let mut bufs: Vec<(Box<dyn RecvBuf>, i32)> = Vec::with_capacity(n);
    for i in 0..n {
        if data[i].is_null() && sizes[i] > 0 {
            return Err(invalid(format!("irecv buffer {i} of {} bytes is NULL", sizes[i])));
        }
        if let Some(mh) = mhandles {
            // SAFETY: forwarded contract.
            unsafe { check_mr(mh[i], data[i], sizes[i]) }?;
        }
        // SAFETY: NCCL keeps buffer i writable and untouched for sizes[i] bytes until test reports
        // the request done or the comm is closed; NULL only with size 0 (checked above).
        let buf = unsafe { HostRecvBuf::new(data[i].cast(), sizes[i]) };
        bufs.push((Box::new(buf), tags[i]));
    }
    *out = comm.irecv(bufs)?;
    Ok(())
}

/// `irecv` of v9.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn irecv_v9(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's irecv contract.
    guard("irecv", || unsafe { post_recv(recv_comm, n, data, sizes, tags, mhandles, request) })
}

/// `irecv` of v10-v12 (profiler handles are not used).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn irecv_v10(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    _phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's irecv contract.
    guard("irecv", || unsafe { post_recv(recv_comm, n, data, sizes, tags, mhandles, request) })
}

/// `iflush`: host memory needs no flush, so there is never a request.
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn iflush(
    recv_comm: *mut c_void,
    n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iflush", || {
        // SAFETY: NCCL passes a writable out-pointer.
        unsafe { out_ptr(request, "request") }?;
        // SAFETY: NCCL passes a recv comm `accept` returned.
        unsafe { Tagged::<RecvObj>::from_ptr(recv_comm, "recvComm") }?;
        recv_count(n, "iflush").map(drop)
    })
}

/// Converts a completed size to the `int` `test` reports.
fn int_size(size: usize) -> Result<c_int, PluginError> {
    c_int::try_from(size).map_err(|_| PluginError::SizeTooLarge(size))
}

/// `test`: progresses the request's comm; when done, frees the request and reports its size(s).
///
/// # Safety
/// As NCCL calls it: every pointer NULL or valid as the ABI documents this slot (see the module doc).
pub unsafe extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard("test", || {
        // SAFETY: NCCL passes a request isend/irecv returned and not yet reported done.
        let token = unsafe { Tagged::<RequestToken>::from_ptr(request, "request") }?;
        // SAFETY: NCCL passes a writable int.
        unsafe { write_out(done, 0, "done") }?;
        let reported: Vec<c_int> = match token.kind {
            CommKind::Send => {
                // SAFETY: the token's comm pointer was set from the live comm that owns the token.
                let comm = unsafe { Tagged::<SendObj>::from_ptr(token.comm.cast_mut(), "request's comm") }?;
                match comm.test(token.index)? {
                    None => return Ok(()),
                    Some(size) => vec![int_size(size)?],
                }
            }
            CommKind::Recv => {
                // SAFETY: as above.
                let comm = unsafe { Tagged::<RecvObj>::from_ptr(token.comm.cast_mut(), "request's comm") }?;
                match comm.test(token.index)? {
                    None => return Ok(()),
                    Some(v) => v.into_iter().map(int_size).collect::<Result<_, _>>()?,
                }
            }
        };
        if !sizes.is_null() {
            if !sizes.is_aligned() {
                return Err(invalid(format!("sizes {sizes:p} is misaligned")));
            }
            for (i, s) in reported.iter().enumerate() {
                // SAFETY: NCCL passes room for one size per buffer of the request (n <= maxRecvs).
                unsafe { sizes.add(i).write(*s) };
            }
        }
        // SAFETY: checked writable above.
        unsafe { done.write(1) };
        Ok(())
    })
}

// ---------------------------------------------------------------- close

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
