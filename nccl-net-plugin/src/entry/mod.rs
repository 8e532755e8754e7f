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
//! misaligned pointers, objects of the wrong kind, and object pointers Prism never returned or already
//! closed (see [`crate::handle`]) are detected and refused without being read.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::abi::{
    CommConfig, DeviceHandle, Logger, NcclResult, NetAttr, ProfilerCallback, PropertiesV11, PropertiesV12, PropertiesV9,
    NCCL_INTERNAL_ERROR, NCCL_SUCCESS,
};
use crate::comm::Context;
use crate::error::{invalid, PluginError};
use crate::global;
use crate::handle::{out_ptr, Tagged};

mod conn;
mod data;

pub use conn::*;
pub use data::*;

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
