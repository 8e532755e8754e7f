//! The `#[repr(C)]` mirrors against the C header itself: `tests-c/layout.c` prints gcc's sizes and
//! offsets for `include/prism_net.h`, and every one must equal Rust's. (The unit tests in `src/abi/`
//! pin the same numbers to the research notes; this one catches a header and the mirrors drifting apart.)

mod common;

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

use nccl_net_prism::abi::{
    CommConfig, DeviceHandle, NetAttr, NetV10, NetV11, NetV12, NetV9, PropertiesV11, PropertiesV12, PropertiesV9, VDevicePropsV12,
    VDevicePropsV9,
};

fn c_layout() -> BTreeMap<(String, String), usize> {
    let bin = common::scratch_dir().join("layout");
    common::compile_c(&["layout.c"], &bin);
    let out = Command::new(&bin).output().expect("run layout");
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .expect("ASCII")
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            ((f[0].to_string(), f[1].to_string()), f[2].parse().expect("number"))
        })
        .collect()
}

macro_rules! entries {
    ($map:ident, $c:literal, $t:ty, [$($cf:literal => $rf:ident),* $(,)?]) => {
        $map.insert(($c.to_string(), "sizeof".to_string()), size_of::<$t>());
        $( $map.insert(($c.to_string(), $cf.to_string()), offset_of!($t, $rf)); )*
    };
}

macro_rules! props {
    ($map:ident, $c:literal, $t:ty, [$($cf:literal => $rf:ident),* $(,)?]) => {
        entries!($map, $c, $t, [
            "name" => name, "pciPath" => pci_path, "guid" => guid, "ptrSupport" => ptr_support,
            "regIsGlobal" => reg_is_global, "forceFlush" => force_flush, "speed" => speed, "port" => port,
            "latency" => latency, "maxComms" => max_comms, "maxRecvs" => max_recvs,
            "netDeviceType" => net_device_type, "netDeviceVersion" => net_device_version, "vProps" => v_props,
            "maxP2pBytes" => max_p2p_bytes, "maxCollBytes" => max_coll_bytes, $($cf => $rf),*
        ]);
    };
}

macro_rules! table {
    ($map:ident, $c:literal, $t:ty, [$($cf:literal => $rf:ident),* $(,)?]) => {
        entries!($map, $c, $t, [
            "name" => name, "init" => init, "devices" => devices, "getProperties" => get_properties,
            "listen" => listen, "connect" => connect, "accept" => accept, "regMr" => reg_mr,
            "regMrDmaBuf" => reg_mr_dma_buf, "deregMr" => dereg_mr, "isend" => isend, "irecv" => irecv,
            "iflush" => iflush, "test" => test, "closeSend" => close_send, "closeRecv" => close_recv,
            "closeListen" => close_listen, "getDeviceMr" => get_device_mr, "irecvConsumed" => irecv_consumed,
            "makeVDevice" => make_v_device, $($cf => $rf),*
        ]);
    };
}

fn rust_layout() -> BTreeMap<(String, String), usize> {
    let mut m = BTreeMap::new();
    entries!(m, "prism_net_device_handle_t", DeviceHandle, [
        "device_type" => net_device_type, "device_version" => net_device_version, "handle" => handle,
        "size" => size, "needs_proxy_progress" => needs_proxy_progress,
    ]);
    entries!(m, "prism_net_comm_config_t", CommConfig, []);
    entries!(m, "prism_vdevice_props_v9_t", VDevicePropsV9, []);
    entries!(m, "prism_vdevice_props_v12_t", VDevicePropsV12, []);
    entries!(m, "prism_net_attr_t", NetAttr, [
        "recvCommAttr" => recv_comm_attr, "op" => op, "algo" => algo, "proto" => proto,
    ]);
    props!(m, "prism_net_properties_v9_t", PropertiesV9, []);
    props!(m, "prism_net_properties_v11_t", PropertiesV11, ["maxMultiRequestSize" => max_multi_request_size]);
    props!(m, "prism_net_properties_v12_t", PropertiesV12, [
        "maxMultiRequestSize" => max_multi_request_size, "railId" => rail_id, "planeId" => plane_id,
    ]);
    table!(m, "prism_net_v9_t", NetV9, []);
    table!(m, "prism_net_v10_t", NetV10, []);
    table!(m, "prism_net_v11_t", NetV11, ["finalize" => finalize, "setNetAttr" => set_net_attr]);
    table!(m, "prism_net_v12_t", NetV12, ["finalize" => finalize, "setNetAttr" => set_net_attr]);
    m
}

#[test]
fn every_size_and_offset_matches_the_c_header() {
    let c = c_layout();
    let rust = rust_layout();
    assert_eq!(c.len(), rust.len(), "the C program and this test list different fields");
    let diffs: Vec<String> = c
        .iter()
        .filter(|(k, v)| rust.get(*k) != Some(v))
        .map(|((s, f), v)| format!("{s}.{f}: C {v}, Rust {:?}", rust.get(&(s.clone(), f.clone()))))
        .collect();
    assert!(diffs.is_empty(), "layout differs:\n{}", diffs.join("\n"));
}
