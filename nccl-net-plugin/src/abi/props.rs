//! Device properties, one struct per layout: v9 and v10 share one (104 bytes), v11 adds
//! `maxMultiRequestSize` (112 bytes), v12 doubles `vProps` and adds `railId`/`planeId` (128 bytes).
//!
//! `getProperties` must write exactly the caller's layout: NCCL's v11 wrapper passes a 112-byte stack
//! object, so writing the v12 struct there would corrupt NCCL's stack. [`DeviceProps`] holds the
//! values once and converts to each layout.

use std::ffi::{c_char, c_int};

use super::{MAX_NET_SIZE_BYTES, MAX_P2P_BYTES, NET_DEVICE_HOST, NET_DEVICE_INVALID_VERSION, PTR_HOST};

/// `ncclNetVDeviceProps_v9_t` .. `_v11_t`: devices fused into one (at most 4).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VDevicePropsV9 {
    /// Number of entries of `devs` in use.
    pub ndevs: c_int,
    /// Physical device indices.
    pub devs: [c_int; 4],
}

/// `ncclNetVDeviceProps_v12_t`: devices fused into one (at most 8).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VDevicePropsV12 {
    /// Number of entries of `devs` in use.
    pub ndevs: c_int,
    /// Physical device indices.
    pub devs: [c_int; 8],
}

/// `ncclNetProperties_v9_t` and `_v10_t` (104 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropertiesV9 {
    /// Unique device name (NCCL's topology key); must stay valid.
    pub name: *mut c_char,
    /// sysfs path of the PCI device, or NULL for a virtual interface.
    pub pci_path: *mut c_char,
    /// Devices with the same guid are the same physical port.
    pub guid: u64,
    /// `NCCL_PTR_*` bits the plugin accepts in `regMr`.
    pub ptr_support: c_int,
    /// Whether registrations outlive their comm.
    pub reg_is_global: c_int,
    /// Whether NCCL must flush after every GPU receive.
    pub force_flush: c_int,
    /// Port speed in Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency in microseconds, 0 = NCCL's default.
    pub latency: f32,
    /// Most comms the device serves.
    pub max_comms: c_int,
    /// Most buffers in one grouped receive.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Offload version.
    pub net_device_version: c_int,
    /// Fused devices.
    pub v_props: VDevicePropsV9,
    /// Largest point-to-point transfer.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer.
    pub max_coll_bytes: usize,
}

/// `ncclNetProperties_v11_t` (112 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropertiesV11 {
    /// Unique device name (NCCL's topology key); must stay valid.
    pub name: *mut c_char,
    /// sysfs path of the PCI device, or NULL for a virtual interface.
    pub pci_path: *mut c_char,
    /// Devices with the same guid are the same physical port.
    pub guid: u64,
    /// `NCCL_PTR_*` bits the plugin accepts in `regMr`.
    pub ptr_support: c_int,
    /// Whether registrations outlive their comm.
    pub reg_is_global: c_int,
    /// Whether NCCL must flush after every GPU receive.
    pub force_flush: c_int,
    /// Port speed in Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency in microseconds, 0 = NCCL's default.
    pub latency: f32,
    /// Most comms the device serves.
    pub max_comms: c_int,
    /// Most buffers in one grouped receive.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Offload version.
    pub net_device_version: c_int,
    /// Fused devices.
    pub v_props: VDevicePropsV9,
    /// Largest point-to-point transfer.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer.
    pub max_coll_bytes: usize,
    /// Most requests in one multi-request.
    pub max_multi_request_size: c_int,
}

/// `ncclNetProperties_v12_t` (128 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropertiesV12 {
    /// Unique device name (NCCL's topology key); must stay valid.
    pub name: *mut c_char,
    /// sysfs path of the PCI device, or NULL for a virtual interface.
    pub pci_path: *mut c_char,
    /// Devices with the same guid are the same physical port.
    pub guid: u64,
    /// `NCCL_PTR_*` bits the plugin accepts in `regMr`.
    pub ptr_support: c_int,
    /// Whether registrations outlive their comm.
    pub reg_is_global: c_int,
    /// Whether NCCL must flush after every GPU receive.
    pub force_flush: c_int,
    /// Port speed in Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency in microseconds, 0 = NCCL's default.
    pub latency: f32,
    /// Most comms the device serves.
    pub max_comms: c_int,
    /// Most buffers in one grouped receive.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Offload version.
    pub net_device_version: c_int,
    /// Fused devices.
    pub v_props: VDevicePropsV12,
    /// Largest point-to-point transfer.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer.
    pub max_coll_bytes: usize,
    /// Most requests in one multi-request.
    pub max_multi_request_size: c_int,
    /// Rail of the device.
    pub rail_id: i16,
    /// Plane of the device, `-1` = unknown.
    pub plane_id: i16,
}

/// Most comms Prism reports per device; a comm costs a few small allocations, so the bound is NCCL's.
pub const MAX_COMMS: c_int = 65536;

/// The properties of one device, independent of the ABI version.
#[derive(Debug, Clone, Copy)]
pub struct DeviceProps {
    /// Device index (also its rail id: one device per rail).
    pub dev: c_int,
    /// NUL-terminated name that lives as long as the process.
    pub name: *const c_char,
    /// NUL-terminated sysfs path that lives as long as the process, or NULL.
    pub pci_path: *const c_char,
    /// Link speed in Mbit/s.
    pub speed_mbps: c_int,
    /// Device GUID, unique per device.
    pub guid: u64,
    /// Most buffers in one grouped receive.
    pub max_recvs: c_int,
}

impl DeviceProps {
    /// The v9/v10 layout.
    pub fn to_v9(&self) -> PropertiesV9 {
        PropertiesV9 {
            name: self.name.cast_mut(),
            pci_path: self.pci_path.cast_mut(),
            guid: self.guid,
            ptr_support: PTR_HOST,
            reg_is_global: 0,
            force_flush: 0,
            speed: self.speed_mbps,
            port: 0,
            latency: 0.0,
            max_comms: MAX_COMMS,
            max_recvs: self.max_recvs,
            net_device_type: NET_DEVICE_HOST,
            net_device_version: NET_DEVICE_INVALID_VERSION,
            v_props: VDevicePropsV9 { ndevs: 1, devs: [self.dev, 0, 0, 0] },
            max_p2p_bytes: MAX_P2P_BYTES,
            max_coll_bytes: MAX_NET_SIZE_BYTES,
        }
    }

    /// The v11 layout.
    pub fn to_v11(&self) -> PropertiesV11 {
        let p = self.to_v9();
        PropertiesV11 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            force_flush: p.force_flush,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
            v_props: p.v_props,
            max_p2p_bytes: p.max_p2p_bytes,
            max_coll_bytes: p.max_coll_bytes,
            max_multi_request_size: 1,
        }
    }

    /// The v12 layout.
    pub fn to_v12(&self) -> PropertiesV12 {
        let p = self.to_v11();
        PropertiesV12 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            force_flush: p.force_flush,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: p.net_device_type,
            net_device_version: p.net_device_version,
            v_props: VDevicePropsV12 { ndevs: 1, devs: [self.dev, 0, 0, 0, 0, 0, 0, 0] },
            max_p2p_bytes: p.max_p2p_bytes,
            max_coll_bytes: p.max_coll_bytes,
            max_multi_request_size: p.max_multi_request_size,
            // Each device is one rail, so the rail id is the index (saturating: NCCL has at most a few
            // dozen devices, far below i16::MAX).
            rail_id: i16::try_from(self.dev).unwrap_or(i16::MAX),
            plane_id: super::NET_ID_UNDEF,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    macro_rules! assert_head_offsets {
        ($t:ty) => {
            assert_eq!(offset_of!($t, name), 0);
            assert_eq!(offset_of!($t, pci_path), 8);
            assert_eq!(offset_of!($t, guid), 16);
            assert_eq!(offset_of!($t, ptr_support), 24);
            assert_eq!(offset_of!($t, reg_is_global), 28);
            assert_eq!(offset_of!($t, force_flush), 32);
            assert_eq!(offset_of!($t, speed), 36);
            assert_eq!(offset_of!($t, port), 40);
            assert_eq!(offset_of!($t, latency), 44);
            assert_eq!(offset_of!($t, max_comms), 48);
            assert_eq!(offset_of!($t, max_recvs), 52);
            assert_eq!(offset_of!($t, net_device_type), 56);
            assert_eq!(offset_of!($t, net_device_version), 60);
            assert_eq!(offset_of!($t, v_props), 64);
        };
    }

    #[test]
    fn v9_props_are_104_bytes_with_the_c_offsets() {
        assert_eq!(size_of::<PropertiesV9>(), 104);
        assert_head_offsets!(PropertiesV9);
        assert_eq!(size_of::<VDevicePropsV9>(), 20);
        assert_eq!(offset_of!(PropertiesV9, max_p2p_bytes), 88);
        assert_eq!(offset_of!(PropertiesV9, max_coll_bytes), 96);
    }

    #[test]
    fn v11_props_are_112_bytes_with_max_multi_request_size_at_104() {
        assert_eq!(size_of::<PropertiesV11>(), 112);
        assert_head_offsets!(PropertiesV11);
        assert_eq!(offset_of!(PropertiesV11, max_p2p_bytes), 88);
        assert_eq!(offset_of!(PropertiesV11, max_coll_bytes), 96);
        assert_eq!(offset_of!(PropertiesV11, max_multi_request_size), 104);
    }

    #[test]
    fn v12_props_are_128_bytes_with_later_fields_shifted_by_the_wider_vprops() {
        assert_eq!(size_of::<PropertiesV12>(), 128);
        assert_head_offsets!(PropertiesV12);
        assert_eq!(size_of::<VDevicePropsV12>(), 36);
        assert_eq!(offset_of!(PropertiesV12, max_p2p_bytes), 104);
        assert_eq!(offset_of!(PropertiesV12, max_coll_bytes), 112);
        assert_eq!(offset_of!(PropertiesV12, max_multi_request_size), 120);
        assert_eq!(offset_of!(PropertiesV12, rail_id), 124);
        assert_eq!(offset_of!(PropertiesV12, plane_id), 126);
    }

    fn sample() -> DeviceProps {
        DeviceProps {
            dev: 3,
            name: c"prism:eth3".as_ptr(),
            pci_path: std::ptr::null(),
            speed_mbps: 25_000,
            guid: 0x02fc_0000_0001,
            max_recvs: 8,
        }
    }

    #[test]
    fn a_physical_device_fuses_only_itself() {
        let d = sample();
        assert_eq!(d.to_v9().v_props, VDevicePropsV9 { ndevs: 1, devs: [3, 0, 0, 0] });
        assert_eq!(d.to_v12().v_props.ndevs, 1);
        assert_eq!(d.to_v12().v_props.devs[0], 3);
    }

    #[test]
    fn props_announce_a_host_only_device_with_its_guid() {
        let p = sample().to_v9();
        assert_eq!(p.guid, 0x02fc_0000_0001);
        assert_eq!((sample().to_v11().guid, sample().to_v12().guid), (p.guid, p.guid));
        assert_eq!(p.ptr_support, PTR_HOST);
        assert_eq!((p.reg_is_global, p.force_flush, p.port), (0, 0, 0));
        assert_eq!((p.net_device_type, p.net_device_version), (NET_DEVICE_HOST, NET_DEVICE_INVALID_VERSION));
        assert_eq!(p.speed, 25_000);
        assert_eq!(p.max_recvs, 8);
        assert_eq!(p.max_comms, 65536);
        assert_eq!((p.max_p2p_bytes, p.max_coll_bytes), (MAX_P2P_BYTES, MAX_NET_SIZE_BYTES));
    }

    #[test]
    fn v12_props_put_the_device_on_its_own_rail_and_no_plane() {
        let p = sample().to_v12();
        assert_eq!((p.rail_id, p.plane_id), (3, -1));
        assert_eq!(p.max_multi_request_size, 1);
        assert_eq!(sample().to_v11().max_multi_request_size, 1);
    }
}
