/*
 * layout.c: prints the size of every struct in include/prism_net.h and the offset of every field the
 * plugin's #[repr(C)] mirrors declare, one "struct field value" line each ("struct sizeof N" for sizes).
 * The Rust test nccl-net-plugin/tests/layout.rs compares them with std::mem::{size_of, offset_of}.
 */
#include <stddef.h>
#include <stdio.h>

#include "prism_net.h"

#define SIZE(T) printf("%s sizeof %zu\n", #T, sizeof(T))
#define OFF(T, f) printf("%s %s %zu\n", #T, #f, offsetof(T, f))

#define PROPS_HEAD(T)                                                                                      \
  OFF(T, name); OFF(T, pciPath); OFF(T, guid); OFF(T, ptrSupport); OFF(T, regIsGlobal); OFF(T, forceFlush); \
  OFF(T, speed); OFF(T, port); OFF(T, latency); OFF(T, maxComms); OFF(T, maxRecvs); OFF(T, netDeviceType);  \
  OFF(T, netDeviceVersion); OFF(T, vProps); OFF(T, maxP2pBytes); OFF(T, maxCollBytes)

#define TABLE_HEAD(T)                                                                                       \
  OFF(T, name); OFF(T, init); OFF(T, devices); OFF(T, getProperties); OFF(T, listen); OFF(T, connect);       \
  OFF(T, accept); OFF(T, regMr); OFF(T, regMrDmaBuf); OFF(T, deregMr); OFF(T, isend); OFF(T, irecv);         \
  OFF(T, iflush); OFF(T, test); OFF(T, closeSend); OFF(T, closeRecv); OFF(T, closeListen);                  \
  OFF(T, getDeviceMr); OFF(T, irecvConsumed); OFF(T, makeVDevice)

int main(void) {
  SIZE(prism_net_device_handle_t);
  OFF(prism_net_device_handle_t, device_type);
  OFF(prism_net_device_handle_t, device_version);
  OFF(prism_net_device_handle_t, handle);
  OFF(prism_net_device_handle_t, size);
  OFF(prism_net_device_handle_t, needs_proxy_progress);
  SIZE(prism_net_comm_config_t);
  SIZE(prism_vdevice_props_v9_t);
  SIZE(prism_vdevice_props_v12_t);
  SIZE(prism_net_attr_t);
  OFF(prism_net_attr_t, recvCommAttr);
  OFF(prism_net_attr_t, op);
  OFF(prism_net_attr_t, algo);
  OFF(prism_net_attr_t, proto);

  SIZE(prism_net_properties_v9_t);
  PROPS_HEAD(prism_net_properties_v9_t);
  SIZE(prism_net_properties_v11_t);
  PROPS_HEAD(prism_net_properties_v11_t);
  OFF(prism_net_properties_v11_t, maxMultiRequestSize);
  SIZE(prism_net_properties_v12_t);
  PROPS_HEAD(prism_net_properties_v12_t);
  OFF(prism_net_properties_v12_t, maxMultiRequestSize);
  OFF(prism_net_properties_v12_t, railId);
  OFF(prism_net_properties_v12_t, planeId);

  SIZE(prism_net_v9_t);
  TABLE_HEAD(prism_net_v9_t);
  SIZE(prism_net_v10_t);
  TABLE_HEAD(prism_net_v10_t);
  SIZE(prism_net_v11_t);
  TABLE_HEAD(prism_net_v11_t);
  OFF(prism_net_v11_t, finalize);
  OFF(prism_net_v11_t, setNetAttr);
  SIZE(prism_net_v12_t);
  TABLE_HEAD(prism_net_v12_t);
  OFF(prism_net_v12_t, finalize);
  OFF(prism_net_v12_t, setNetAttr);
  return 0;
}
