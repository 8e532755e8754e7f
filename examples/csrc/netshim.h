/*
 * netshim.h: a flat, version-neutral C API over one dlopened NCCL net plugin (ABI v9 to v12, as
 * declared in include/prism_net.h). prism-perf's Rust code calls only these functions, so the
 * per-version tables, argument lists and property layouts stay on the C side.
 *
 * Every function returning int returns the plugin's result code (0 = success), or
 * SHIM_ERR_USAGE when the shim itself refuses the call (NULL shim, missing table slot).
 */
#ifndef PRISM_NETSHIM_H
#define PRISM_NETSHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHIM_ERR_USAGE (-1)
/* A getProperties call wrote past the end of the struct of the version being served. */
#define SHIM_ERR_PROPS_OVERFLOW (-2)

typedef struct shim shim_t;

/* Device properties, the same for every ABI version (fields a version lacks are -1). */
typedef struct {
  char name[64];
  char pci_path[256];
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed_mbps;
  int port;
  float latency_us;
  int max_comms;
  int max_recvs;
  int net_device_type;
  int net_device_version;
  int vdev_count;
  size_t max_p2p_bytes;
  int max_multi_request_size;
  int rail_id;
  int plane_id;
} shim_props_t;

/* Which plugin log lines reach stderr: 0 = WARN (and ABORT/VERSION), 1 = +INFO, 2 = +TRACE. */
void shim_set_verbosity(int verbosity);

/* dlopen `path` (RTLD_NOW | RTLD_LOCAL) and dlsym ncclNetPlugin_v<version>; NULL and a message in
 * err (always NUL-terminated) on failure. */
shim_t* shim_open(const char* path, int version, char* err, size_t err_len);
int shim_version(const shim_t* s);
/* The table's `name` field (never NULL for an open shim). */
const char* shim_name(const shim_t* s);

/* init: v11/v12 once per "communicator" with comm_id, v9/v10 once per process. */
int shim_init(shim_t* s, uint64_t comm_id);
int shim_devices(shim_t* s, int* ndev);
int shim_get_props(shim_t* s, int dev, shim_props_t* out);
/* handle points to PRISM_NET_HANDLE_MAXSIZE bytes. */
int shim_listen(shim_t* s, int dev, void* handle, void** listen_comm);
int shim_connect(shim_t* s, int dev, void* handle, void** send_comm);
int shim_accept(shim_t* s, void* listen_comm, void** recv_comm);
/* Host memory only (PRISM_PTR_HOST). */
int shim_reg_mr(shim_t* s, void* comm, void* data, size_t size, void** mhandle);
int shim_dereg_mr(shim_t* s, void* comm, void* mhandle);
/* A NULL *request after success means "retry later". */
int shim_isend(shim_t* s, void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request);
/* A single receive (n = 1). */
int shim_irecv(shim_t* s, void* recv_comm, void* data, size_t size, int tag, void* mhandle, void** request);
int shim_test(shim_t* s, void* request, int* done, int* size);
/* A grouped receive of n buffers (1 <= n <= the device's maxRecvs), as NCCL's proxy posts them. */
int shim_irecv_n(shim_t* s, void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                 void** request);
/* test for a grouped receive: on completion sizes[0..n) get the bytes received into each buffer. */
int shim_test_n(shim_t* s, void* request, int* done, int* sizes, int n);
int shim_close_send(shim_t* s, void* send_comm);
int shim_close_recv(shim_t* s, void* recv_comm);
int shim_close_listen(shim_t* s, void* listen_comm);
/* v11/v12: finalize(ctx) after a successful init; no-op before v11 (those tables have no finalize). */
int shim_finalize(shim_t* s);
/* dlclose and free the shim. */
void shim_close(shim_t* s);

#ifdef __cplusplus
}
#endif

#endif /* PRISM_NETSHIM_H */
