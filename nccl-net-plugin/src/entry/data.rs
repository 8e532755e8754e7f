//! The data path: memory registration, isend, irecv, iflush, test.

use std::ffi::{c_int, c_void};

use prism_transport::engine::{RecvBuf, MAX_RECVS};

use crate::abi::{NcclResult, MAX_P2P_BYTES, PTR_CUDA};
use crate::buf::{HostRecvBuf, HostSendBuf};
use crate::comm::{RecvObj, SendObj};
use crate::error::{invalid, PluginError};
use crate::handle::{out_ptr, Tagged};
use crate::mr::{MemRegion, CUDA_UNSUPPORTED};
use crate::requests::{CommKind, RequestToken};

use super::{guard, write_out};

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

/// The largest send or receive buffer: the `maxP2pBytes` Prism announces (below what `test` can
/// report in its `int` size).
const MAX_BUFFER_BYTES: usize = MAX_P2P_BYTES;
const _: () = assert!(MAX_BUFFER_BYTES <= c_int::MAX as usize);

/// Checks one message buffer of `isend`/`irecv`: NULL only when empty, at most `max` bytes, and not
/// wrapping around the address space.
fn check_buffer(call: &str, data: *mut c_void, size: usize, max: usize) -> Result<(), PluginError> {
    if data.is_null() && size > 0 {
        return Err(invalid(format!("{call} of {size} bytes at NULL")));
    }
    if size > max {
        return Err(invalid(format!("{call} of {size} bytes: at most {max}")));
    }
    if (data as usize).checked_add(size).is_none() {
        return Err(invalid(format!("{call} range {data:p} + {size} wraps around the address space")));
    }
    Ok(())
}

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
    // At most maxP2pBytes, which test()'s int can report: a larger send was planned chunk by chunk
    // inside this call (time and memory in proportion to its size) and could never complete.
    check_buffer("isend", data, size, MAX_BUFFER_BYTES)?;
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
        check_buffer(&format!("irecv buffer {i}"), data[i], sizes[i], MAX_BUFFER_BYTES)?;
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
        // Every argument is checked before the request is tested: a completed request is freed, so a
        // call refused after that would lose its completion.
        if !sizes.is_null() && !sizes.is_aligned() {
            return Err(invalid(format!("sizes {sizes:p} is misaligned")));
        }
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
            for (i, s) in reported.iter().enumerate() {
                // SAFETY: aligned (checked above); NCCL passes room for one size per buffer of the
                // request (n <= maxRecvs).
                unsafe { sizes.add(i).write(*s) };
            }
        }
        // SAFETY: checked writable above.
        unsafe { done.write(1) };
        Ok(())
    })
}

// ---------------------------------------------------------------- close
