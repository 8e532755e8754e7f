//! `#[repr(C)]` mirrors of the NCCL net plugin ABI, versions 9 to 12 (`include/prism_net.h`).
//!
//! Only sizes, offsets and calling conventions have to agree with NCCL; the layout tests at the bottom
//! of each file pin them to the values gcc computes from NCCL's headers. C enums (`ncclResult_t`,
//! `ncclNetDeviceType`) are plain `c_int`s here so an unexpected value can never be undefined behaviour.

pub mod props;
pub mod tables;

use std::ffi::{c_char, c_int, c_ulong, c_void};

pub use props::{PropertiesV11, PropertiesV12, PropertiesV9, VDevicePropsV12, VDevicePropsV9};
pub use tables::{NetV10, NetV11, NetV12, NetV9};

/// `ncclResult_t`: what every plugin function returns.
pub type NcclResult = c_int;

/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclSystemError`: the kernel, a system library or the network failed.
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
/// `ncclInternalError`: NCCL called the plugin in a way it cannot serve (bad arguments, misuse).
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
/// `ncclInvalidArgument`: a value the user configured is not usable.
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
/// `ncclInvalidUsage`: the application broke a rule, e.g. a send larger than the posted receive.
pub const NCCL_INVALID_USAGE: NcclResult = 5;
/// `ncclRemoteError`: the peer or the path to it failed a request.
pub const NCCL_REMOTE_ERROR: NcclResult = 6;

/// `NCCL_NET_HANDLE_MAXSIZE`: bytes of the connection handle NCCL exchanges out of band.
pub const NET_HANDLE_MAXSIZE: usize = 128;
/// `NCCL_PTR_HOST`: host memory.
pub const PTR_HOST: c_int = 0x1;
/// `NCCL_PTR_CUDA`: GPU memory (needs GPUDirect RDMA).
pub const PTR_CUDA: c_int = 0x2;
/// `NCCL_PTR_DMABUF`: GPU memory through a dma-buf file descriptor.
pub const PTR_DMABUF: c_int = 0x4;
/// `NCCL_NET_OPTIONAL_RECV_COMPLETION`: value `*request` may hold on entry to `irecv`.
pub const OPTIONAL_RECV_COMPLETION: usize = 0x1;
/// `NCCL_MAX_NET_SIZE_BYTES`: the largest `maxP2pBytes`/`maxCollBytes` NCCL accepts (1 TiB).
pub const MAX_NET_SIZE_BYTES: usize = 1 << 40;
/// The `maxP2pBytes` Prism announces: 1 GiB, as NCCL's own IB transport (`MAX_NET_SIZE`). A completed
/// message's size is reported in `test`'s `int`, so no single send or receive past 2 GiB - 1 could
/// ever complete; announcing NCCL's ceiling (1 TiB) promised what does not work.
pub const MAX_P2P_BYTES: usize = 1 << 30;
/// `NCCL_NET_DEVICE_HOST`: no device offload.
pub const NET_DEVICE_HOST: c_int = 0;
/// `NCCL_NET_DEVICE_INVALID_VERSION`: the offload version of a host device.
pub const NET_DEVICE_INVALID_VERSION: c_int = 0;
/// `NCCL_NET_ID_UNDEF`: a rail or plane id the plugin does not know.
pub const NET_ID_UNDEF: i16 = -1;

/// `NCCL_LOG_WARN`.
pub const LOG_WARN: c_int = 2;
/// `NCCL_LOG_INFO`.
pub const LOG_INFO: c_int = 3;
/// `NCCL_LOG_TRACE`.
pub const LOG_TRACE: c_int = 5;
/// `NCCL_INIT` subsystem flag.
pub const SUBSYS_INIT: c_ulong = 0x1;
/// `NCCL_NET` subsystem flag.
pub const SUBSYS_NET: c_ulong = 0x10;

/// `ncclDebugLogger_t`: NCCL's printf-style logger. Prism always passes `fmt = "%s"` and one string.
pub type Logger = unsafe extern "C" fn(level: c_int, flags: c_ulong, file: *const c_char, line: c_int, fmt: *const c_char, ...);

/// `ncclProfilerCallback_t`: NCCL's profiler hook (v10+). Prism does not call it.
pub type ProfilerCallback = unsafe extern "C" fn(
    event_handle: *mut *mut c_void,
    kind: c_int,
    parent_handle: *mut c_void,
    plugin_id: i64,
    ext_data: *mut c_void,
) -> NcclResult;

/// `ncclNetDeviceHandle_v7_t` .. `_v12_t` (32 bytes): device-offload handle; a host plugin hands out none.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DeviceHandle {
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Offload version.
    pub net_device_version: c_int,
    /// Offload object.
    pub handle: *mut c_void,
    /// Size of `handle`.
    pub size: usize,
    /// Whether the proxy must keep progressing the comm.
    pub needs_proxy_progress: c_int,
}

/// `ncclNetCommConfig_v10_t` .. `_v12_t`: per-communicator options.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CommConfig {
    /// Traffic class, `-1` when the user set none.
    pub traffic_class: c_int,
}

/// `ncclNetCommAttr_v11_t` / `_v12_t`: hints about one side of a communicator.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CommAttr {
    /// Most peers served at once, `-1` if unknown.
    pub max_concurrent_peers: i32,
    /// Fewest peers served at once, `-1` if unknown.
    pub min_concurrent_peers: i32,
    /// Most flows per peer, `-1` if unknown.
    pub max_flows_per_peer: i32,
    /// Fewest flows per peer, `-1` if unknown.
    pub min_flows_per_peer: i32,
}

/// `ncclNetAttr_v11_t` / `_v12_t` (44 bytes): the hints `setNetAttr` passes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetAttr {
    /// Hints for send comms.
    pub send_comm_attr: CommAttr,
    /// Hints for receive comms.
    pub recv_comm_attr: CommAttr,
    /// Bitmask of collective operations.
    pub op: u32,
    /// Bitmask of algorithms.
    pub algo: u32,
    /// Bitmask of protocols.
    pub proto: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn device_handle_is_32_bytes_with_the_c_offsets() {
        assert_eq!(size_of::<DeviceHandle>(), 32);
        assert_eq!(offset_of!(DeviceHandle, net_device_type), 0);
        assert_eq!(offset_of!(DeviceHandle, net_device_version), 4);
        assert_eq!(offset_of!(DeviceHandle, handle), 8);
        assert_eq!(offset_of!(DeviceHandle, size), 16);
        assert_eq!(offset_of!(DeviceHandle, needs_proxy_progress), 24);
    }

    #[test]
    fn net_attr_is_44_bytes_with_op_algo_proto_after_two_comm_attrs() {
        assert_eq!(size_of::<CommAttr>(), 16);
        assert_eq!(size_of::<NetAttr>(), 44);
        assert_eq!(offset_of!(NetAttr, recv_comm_attr), 16);
        assert_eq!(offset_of!(NetAttr, op), 32);
        assert_eq!(offset_of!(NetAttr, algo), 36);
        assert_eq!(offset_of!(NetAttr, proto), 40);
    }

    #[test]
    fn comm_config_is_one_int() {
        assert_eq!(size_of::<CommConfig>(), 4);
    }

    #[test]
    fn max_net_size_is_one_tebibyte() {
        assert_eq!(MAX_NET_SIZE_BYTES, 1024 * 1024 * 1024 * 1024);
    }
}
