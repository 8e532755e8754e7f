/*
 * decoy_plugin.c: a minimal net plugin named "Decoy" (v9 table: init, devices, getProperties), built as
 * a `libnccl-net.so` that sits on the library path, so the loader tests can check which plugin wins.
 */
#include <string.h>

#include "prism_net.h"

static prism_result_t decoy_init(prism_logger_t log) {
  (void)log;
  return 0;
}

static prism_result_t decoy_devices(int* ndev) {
  *ndev = 1;
  return 0;
}

static prism_result_t decoy_get_properties(int dev, prism_net_properties_v9_t* props) {
  (void)dev;
  memset(props, 0, sizeof *props);
  props->name = (char*)"decoy0";
  return 0;
}

__attribute__((visibility("default"))) const prism_net_v9_t ncclNetPlugin_v9 = {
  .name = "Decoy",
  .init = decoy_init,
  .devices = decoy_devices,
  .getProperties = decoy_get_properties,
};
