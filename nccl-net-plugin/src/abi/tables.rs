//! The function tables NCCL finds with `dlsym("ncclNetPlugin_vN")`.
//!
//! v9 and v10 have 20 slots (160 bytes) and a process-wide `init`; v11 and v12 share one 22-slot table
//! (176 bytes) with a per-communicator context, `finalize` and `setNetAttr`, and differ only in the
//! properties and virtual-device types. Every slot is an `Option` because NCCL checks the optional
//! ones (`getDeviceMr`, `irecvConsumed`, `makeVDevice`, `setNetAttr`) for NULL.

use std::ffi::{c_char, c_int, c_void};

use super::{
    CommConfig, DeviceHandle, Logger, NcclResult, NetAttr, ProfilerCallback, PropertiesV11, PropertiesV12, PropertiesV9, VDevicePropsV12,
    VDevicePropsV9,
};

type Listen = unsafe extern "C" fn(dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> NcclResult;
type ListenCtx = unsafe extern "C" fn(ctx: *mut c_void, dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> NcclResult;
type Accept =
    unsafe extern "C" fn(listen_comm: *mut c_void, recv_comm: *mut *mut c_void, recv_dev_comm: *mut *mut DeviceHandle) -> NcclResult;
type RegMr = unsafe extern "C" fn(comm: *mut c_void, data: *mut c_void, size: usize, kind: c_int, mhandle: *mut *mut c_void) -> NcclResult;
type RegMrDmaBuf = unsafe extern "C" fn(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    offset: u64,
    fd: c_int,
    mhandle: *mut *mut c_void,
) -> NcclResult;
type DeregMr = unsafe extern "C" fn(comm: *mut c_void, mhandle: *mut c_void) -> NcclResult;
type Iflush = unsafe extern "C" fn(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult;
type Test = unsafe extern "C" fn(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> NcclResult;
type Close = unsafe extern "C" fn(comm: *mut c_void) -> NcclResult;
type GetDeviceMr = unsafe extern "C" fn(comm: *mut c_void, mhandle: *mut c_void, dptr_mhandle: *mut *mut c_void) -> NcclResult;
type IrecvConsumed = unsafe extern "C" fn(recv_comm: *mut c_void, n: c_int, request: *mut c_void) -> NcclResult;
type Isend = unsafe extern "C" fn(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult;
type Irecv = unsafe extern "C" fn(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult;
type Devices = unsafe extern "C" fn(ndev: *mut c_int) -> NcclResult;
type InitV11 = unsafe extern "C" fn(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfig,
    log: Option<Logger>,
    prof: Option<ProfilerCallback>,
) -> NcclResult;
type ConnectCtx = unsafe extern "C" fn(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    send_dev_comm: *mut *mut DeviceHandle,
) -> NcclResult;
type Finalize = unsafe extern "C" fn(ctx: *mut c_void) -> NcclResult;
type SetNetAttr = unsafe extern "C" fn(ctx: *mut c_void, attr: *mut NetAttr) -> NcclResult;

/// `ncclNet_v9_t` (NCCL 2.24-2.25).
#[repr(C)]
pub struct NetV9 {
    /// Network name, matched by `NCCL_NET`.
    pub name: *const c_char,
    /// Once per process.
    pub init: Option<unsafe extern "C" fn(log: Option<Logger>) -> NcclResult>,
    /// Number of devices.
    pub devices: Option<Devices>,
    /// Properties of one device.
    pub get_properties: Option<unsafe extern "C" fn(dev: c_int, props: *mut PropertiesV9) -> NcclResult>,
    /// Creates a listening comm and the handle to connect to it.
    pub listen: Option<Listen>,
    /// Non-blocking connect to a handle.
    pub connect: Option<
        unsafe extern "C" fn(
            dev: c_int,
            handle: *mut c_void,
            send_comm: *mut *mut c_void,
            send_dev_comm: *mut *mut DeviceHandle,
        ) -> NcclResult,
    >,
    /// Non-blocking accept.
    pub accept: Option<Accept>,
    /// Registers memory.
    pub reg_mr: Option<RegMr>,
    /// Registers memory by dma-buf.
    pub reg_mr_dma_buf: Option<RegMrDmaBuf>,
    /// Deregisters memory.
    pub dereg_mr: Option<DeregMr>,
    /// Posts a send.
    pub isend: Option<
        unsafe extern "C" fn(
            send_comm: *mut c_void,
            data: *mut c_void,
            size: usize,
            tag: c_int,
            mhandle: *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    /// Posts a (grouped) receive.
    pub irecv: Option<
        unsafe extern "C" fn(
            recv_comm: *mut c_void,
            n: c_int,
            data: *mut *mut c_void,
            sizes: *mut usize,
            tags: *mut c_int,
            mhandles: *mut *mut c_void,
            request: *mut *mut c_void,
        ) -> NcclResult,
    >,
    /// Flushes GPU receives.
    pub iflush: Option<Iflush>,
    /// Tests a request.
    pub test: Option<Test>,
    /// Closes a send comm.
    pub close_send: Option<Close>,
    /// Closes a receive comm.
    pub close_recv: Option<Close>,
    /// Closes a listening comm.
    pub close_listen: Option<Close>,
    /// Device-offload memory handle.
    pub get_device_mr: Option<GetDeviceMr>,
    /// Device consumed a receive.
    pub irecv_consumed: Option<IrecvConsumed>,
    /// Fuses devices.
    pub make_v_device: Option<unsafe extern "C" fn(d: *mut c_int, props: *mut VDevicePropsV9) -> NcclResult>,
}

/// `ncclNet_v10_t` (NCCL 2.26-2.27).
#[repr(C)]
pub struct NetV10 {
    /// Network name, matched by `NCCL_NET`.
    pub name: *const c_char,
    /// Once per process.
    pub init: Option<unsafe extern "C" fn(log: Option<Logger>, prof: Option<ProfilerCallback>) -> NcclResult>,
    /// Number of devices.
    pub devices: Option<Devices>,
    /// Properties of one device (same layout as v9).
    pub get_properties: Option<unsafe extern "C" fn(dev: c_int, props: *mut PropertiesV9) -> NcclResult>,
    /// Creates a listening comm and the handle to connect to it.
    pub listen: Option<Listen>,
    /// Non-blocking connect to a handle, with the communicator's options.
    pub connect: Option<
        unsafe extern "C" fn(
            dev: c_int,
            config: *mut CommConfig,
            handle: *mut c_void,
            send_comm: *mut *mut c_void,
            send_dev_comm: *mut *mut DeviceHandle,
        ) -> NcclResult,
    >,
    /// Non-blocking accept.
    pub accept: Option<Accept>,
    /// Registers memory.
    pub reg_mr: Option<RegMr>,
    /// Registers memory by dma-buf.
    pub reg_mr_dma_buf: Option<RegMrDmaBuf>,
    /// Deregisters memory.
    pub dereg_mr: Option<DeregMr>,
    /// Posts a send.
    pub isend: Option<Isend>,
    /// Posts a (grouped) receive.
    pub irecv: Option<Irecv>,
    /// Flushes GPU receives.
    pub iflush: Option<Iflush>,
    /// Tests a request.
    pub test: Option<Test>,
    /// Closes a send comm.
    pub close_send: Option<Close>,
    /// Closes a receive comm.
    pub close_recv: Option<Close>,
    /// Closes a listening comm.
    pub close_listen: Option<Close>,
    /// Device-offload memory handle.
    pub get_device_mr: Option<GetDeviceMr>,
    /// Device consumed a receive.
    pub irecv_consumed: Option<IrecvConsumed>,
    /// Fuses devices.
    pub make_v_device: Option<unsafe extern "C" fn(d: *mut c_int, props: *mut VDevicePropsV9) -> NcclResult>,
}

/// `ncclNet_v11_t` (NCCL 2.28-2.29).
#[repr(C)]
pub struct NetV11 {
    /// Network name, matched by `NCCL_NET`.
    pub name: *const c_char,
    /// Once per communicator; returns the communicator's context.
    pub init: Option<InitV11>,
    /// Number of devices.
    pub devices: Option<Devices>,
    /// Properties of one device.
    pub get_properties: Option<unsafe extern "C" fn(dev: c_int, props: *mut PropertiesV11) -> NcclResult>,
    /// Creates a listening comm and the handle to connect to it.
    pub listen: Option<ListenCtx>,
    /// Non-blocking connect to a handle.
    pub connect: Option<ConnectCtx>,
    /// Non-blocking accept.
    pub accept: Option<Accept>,
    /// Registers memory.
    pub reg_mr: Option<RegMr>,
    /// Registers memory by dma-buf.
    pub reg_mr_dma_buf: Option<RegMrDmaBuf>,
    /// Deregisters memory.
    pub dereg_mr: Option<DeregMr>,
    /// Posts a send.
    pub isend: Option<Isend>,
    /// Posts a (grouped) receive.
    pub irecv: Option<Irecv>,
    /// Flushes GPU receives.
    pub iflush: Option<Iflush>,
    /// Tests a request.
    pub test: Option<Test>,
    /// Closes a send comm.
    pub close_send: Option<Close>,
    /// Closes a receive comm.
    pub close_recv: Option<Close>,
    /// Closes a listening comm.
    pub close_listen: Option<Close>,
    /// Device-offload memory handle.
    pub get_device_mr: Option<GetDeviceMr>,
    /// Device consumed a receive.
    pub irecv_consumed: Option<IrecvConsumed>,
    /// Fuses devices.
    pub make_v_device: Option<unsafe extern "C" fn(d: *mut c_int, props: *mut VDevicePropsV9) -> NcclResult>,
    /// Releases a communicator's context (mandatory: NCCL calls it without a NULL check).
    pub finalize: Option<Finalize>,
    /// Traffic hints.
    pub set_net_attr: Option<SetNetAttr>,
}

/// `ncclNet_v12_t` (NCCL 2.30).
#[repr(C)]
pub struct NetV12 {
    /// Network name, matched by `NCCL_NET`.
    pub name: *const c_char,
    /// Once per communicator; returns the communicator's context.
    pub init: Option<InitV11>,
    /// Number of devices.
    pub devices: Option<Devices>,
    /// Properties of one device.
    pub get_properties: Option<unsafe extern "C" fn(dev: c_int, props: *mut PropertiesV12) -> NcclResult>,
    /// Creates a listening comm and the handle to connect to it.
    pub listen: Option<ListenCtx>,
    /// Non-blocking connect to a handle.
    pub connect: Option<ConnectCtx>,
    /// Non-blocking accept.
    pub accept: Option<Accept>,
    /// Registers memory.
    pub reg_mr: Option<RegMr>,
    /// Registers memory by dma-buf.
    pub reg_mr_dma_buf: Option<RegMrDmaBuf>,
    /// Deregisters memory.
    pub dereg_mr: Option<DeregMr>,
    /// Posts a send.
    pub isend: Option<Isend>,
    /// Posts a (grouped) receive.
    pub irecv: Option<Irecv>,
    /// Flushes GPU receives.
    pub iflush: Option<Iflush>,
    /// Tests a request.
    pub test: Option<Test>,
    /// Closes a send comm.
    pub close_send: Option<Close>,
    /// Closes a receive comm.
    pub close_recv: Option<Close>,
    /// Closes a listening comm.
    pub close_listen: Option<Close>,
    /// Device-offload memory handle.
    pub get_device_mr: Option<GetDeviceMr>,
    /// Device consumed a receive.
    pub irecv_consumed: Option<IrecvConsumed>,
    /// Fuses devices.
    pub make_v_device: Option<unsafe extern "C" fn(d: *mut c_int, props: *mut VDevicePropsV12) -> NcclResult>,
    /// Releases a communicator's context (mandatory: NCCL calls it without a NULL check).
    pub finalize: Option<Finalize>,
    /// Traffic hints.
    pub set_net_attr: Option<SetNetAttr>,
}

// SAFETY: a table is immutable after construction; its only pointer fields are the name (a static C
// string literal) and functions, all valid for the life of the library and safe to read from any thread.
unsafe impl Sync for NetV9 {}
// SAFETY: as for NetV9.
unsafe impl Sync for NetV10 {}
// SAFETY: as for NetV9.
unsafe impl Sync for NetV11 {}
// SAFETY: as for NetV9.
unsafe impl Sync for NetV12 {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    macro_rules! assert_common_slots {
        ($t:ty) => {
            assert_eq!(offset_of!($t, name), 0);
            assert_eq!(offset_of!($t, init), 8);
            assert_eq!(offset_of!($t, devices), 16);
            assert_eq!(offset_of!($t, get_properties), 24);
            assert_eq!(offset_of!($t, listen), 32);
            assert_eq!(offset_of!($t, connect), 40);
            assert_eq!(offset_of!($t, accept), 48);
            assert_eq!(offset_of!($t, reg_mr), 56);
            assert_eq!(offset_of!($t, reg_mr_dma_buf), 64);
            assert_eq!(offset_of!($t, dereg_mr), 72);
            assert_eq!(offset_of!($t, isend), 80);
            assert_eq!(offset_of!($t, irecv), 88);
            assert_eq!(offset_of!($t, iflush), 96);
            assert_eq!(offset_of!($t, test), 104);
            assert_eq!(offset_of!($t, close_send), 112);
            assert_eq!(offset_of!($t, close_recv), 120);
            assert_eq!(offset_of!($t, close_listen), 128);
            assert_eq!(offset_of!($t, get_device_mr), 136);
            assert_eq!(offset_of!($t, irecv_consumed), 144);
            assert_eq!(offset_of!($t, make_v_device), 152);
        };
    }

    #[test]
    fn v9_table_has_20_slots_at_the_c_offsets() {
        assert_eq!(size_of::<NetV9>(), 160);
        assert_common_slots!(NetV9);
    }

    #[test]
    fn v10_table_has_20_slots_at_the_c_offsets() {
        assert_eq!(size_of::<NetV10>(), 160);
        assert_common_slots!(NetV10);
    }

    #[test]
    fn v11_table_has_22_slots_ending_with_finalize_and_set_net_attr() {
        assert_eq!(size_of::<NetV11>(), 176);
        assert_common_slots!(NetV11);
        assert_eq!(offset_of!(NetV11, finalize), 160);
        assert_eq!(offset_of!(NetV11, set_net_attr), 168);
    }

    #[test]
    fn v12_table_has_22_slots_ending_with_finalize_and_set_net_attr() {
        assert_eq!(size_of::<NetV12>(), 176);
        assert_common_slots!(NetV12);
        assert_eq!(offset_of!(NetV12, finalize), 160);
        assert_eq!(offset_of!(NetV12, set_net_attr), 168);
    }

    #[test]
    fn a_function_slot_is_one_nullable_pointer() {
        assert_eq!(size_of::<Option<Test>>(), size_of::<*const c_void>());
    }
}
