/*
 * netshim.c: dlopens one NCCL net plugin and plays NCCL's side of the ABI (v9 to v12) behind the
 * version-neutral API of netshim.h. Only host memory, single receives and no profiler: what a
 * host-only benchmark needs.
 */
#define _GNU_SOURCE
#include "netshim.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prism_net.h"

struct shim {
  void* dl;
  int version;
  union {
    const prism_net_v9_t* v9;
    const prism_net_v10_t* v10;
    const prism_net_v11_t* v11;
    const prism_net_v12_t* v12;
  } t;
  void* ctx; /* v11/v12 per-communicator context from init */
  int initialised;
};

/* Written once before init; read by plugin threads afterwards. */
static volatile int shim_verbosity = 0;

void shim_set_verbosity(int verbosity) { shim_verbosity = verbosity; }

static const char* level_name(int level) {
  switch (level) {
    case PRISM_LOG_VERSION: return "VERSION";
    case PRISM_LOG_WARN: return "WARN";
    case PRISM_LOG_INFO: return "INFO";
    case PRISM_LOG_ABORT: return "ABORT";
    case PRISM_LOG_TRACE: return "TRACE";
    default: return "LOG";
  }
}

static int level_enabled(int level) {
  switch (level) {
    case PRISM_LOG_NONE: return 0;
    case PRISM_LOG_INFO: return shim_verbosity >= 1;
    case PRISM_LOG_TRACE: return shim_verbosity >= 2;
    default: return 1; /* WARN, ABORT, VERSION and anything unknown: never hide a problem */
  }
}

/* The logger NCCL would pass: printf-style, one line per call, to stderr (stdout is the table). */
static void shim_logger(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags;
  if (!level_enabled(level) || fmt == NULL) return;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  size_t len = strlen(msg);
  while (len > 0 && (msg[len - 1] == '\n' || msg[len - 1] == '\r')) msg[--len] = '\0';
  fprintf(stderr, "plugin %s %s:%d %s\n", level_name(level), file ? file : "?", line, msg);
}

static void set_err(char* err, size_t err_len, const char* fmt, ...) {
  if (err == NULL || err_len == 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, err_len, fmt, ap);
  va_end(ap);
}

/* The slots every version shares at the same offsets (checked by the static asserts below). */
#define CHECK_SLOT(tbl, slot)                                                                    \
  if ((tbl)->slot == NULL) {                                                                     \
    set_err(err, err_len, "%s: ncclNetPlugin_v%d.%s is NULL", path, version, #slot);           \
    goto fail;                                                                                   \
  }
#define CHECK_COMMON_SLOTS(tbl) \
  CHECK_SLOT(tbl, name)         \
  CHECK_SLOT(tbl, init)         \
  CHECK_SLOT(tbl, devices)      \
  CHECK_SLOT(tbl, getProperties) \
  CHECK_SLOT(tbl, listen)       \
  CHECK_SLOT(tbl, connect)      \
  CHECK_SLOT(tbl, accept)       \
  CHECK_SLOT(tbl, regMr)        \
  CHECK_SLOT(tbl, deregMr)      \
  CHECK_SLOT(tbl, isend)        \
  CHECK_SLOT(tbl, irecv)        \
  CHECK_SLOT(tbl, test)         \
  CHECK_SLOT(tbl, closeSend)    \
  CHECK_SLOT(tbl, closeRecv)    \
  CHECK_SLOT(tbl, closeListen)

_Static_assert(sizeof(prism_net_v9_t) == 160, "v9 table is 20 pointers");
_Static_assert(sizeof(prism_net_v10_t) == 160, "v10 table is 20 pointers");
_Static_assert(sizeof(prism_net_v11_t) == 176, "v11 table is 22 pointers");
_Static_assert(sizeof(prism_net_v12_t) == 176, "v12 table is 22 pointers");
_Static_assert(sizeof(prism_net_properties_v9_t) == 104, "v9 properties");
/* The shim calls the slots whose C signature never changed through the v9 view of any table. */
#define SAME_SLOT(slot)                                                                     \
  _Static_assert(offsetof(prism_net_v9_t, slot) == offsetof(prism_net_v12_t, slot) &&       \
                     offsetof(prism_net_v10_t, slot) == offsetof(prism_net_v11_t, slot) &&  \
                     offsetof(prism_net_v9_t, slot) == offsetof(prism_net_v10_t, slot),     \
                 #slot " is at the same offset in every version")
SAME_SLOT(name);
SAME_SLOT(devices);
SAME_SLOT(accept);
SAME_SLOT(regMr);
SAME_SLOT(deregMr);
SAME_SLOT(test);
SAME_SLOT(closeSend);
SAME_SLOT(closeRecv);
SAME_SLOT(closeListen);
_Static_assert(sizeof(prism_net_properties_v11_t) == 112, "v11 properties");
_Static_assert(sizeof(prism_net_properties_v12_t) == 128, "v12 properties");

shim_t* shim_open(const char* path, int version, char* err, size_t err_len) {
  if (err != NULL && err_len > 0) err[0] = '\0';
  if (path == NULL) {
    set_err(err, err_len, "no plugin path");
    return NULL;
  }
  if (version < 9 || version > 12) {
    set_err(err, err_len, "ABI version %d: must be 9, 10, 11 or 12", version);
    return NULL;
  }
  shim_t* s = calloc(1, sizeof *s);
  if (s == NULL) {
    set_err(err, err_len, "out of memory");
    return NULL;
  }
  s->version = version;
  dlerror();
  s->dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (s->dl == NULL) {
    const char* e = dlerror();
    set_err(err, err_len, "dlopen(%s): %s", path, e ? e : "unknown error");
    free(s);
    return NULL;
  }
  char sym[32];
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", version);
  dlerror();
  void* table = dlsym(s->dl, sym);
  if (table == NULL) {
    const char* e = dlerror();
    set_err(err, err_len, "%s has no symbol %s (%s): try another --abi", path, sym, e ? e : "NULL symbol");
    goto fail;
  }
  switch (version) {
    case 9: s->t.v9 = table; CHECK_COMMON_SLOTS(s->t.v9) break;
    case 10: s->t.v10 = table; CHECK_COMMON_SLOTS(s->t.v10) break;
    case 11: s->t.v11 = table; CHECK_COMMON_SLOTS(s->t.v11) CHECK_SLOT(s->t.v11, finalize) break;
    case 12: s->t.v12 = table; CHECK_COMMON_SLOTS(s->t.v12) CHECK_SLOT(s->t.v12, finalize) break;
  }
  return s;
fail:
  dlclose(s->dl);
  free(s);
  return NULL;
}

int shim_version(const shim_t* s) { return s ? s->version : 0; }

const char* shim_name(const shim_t* s) {
  if (s == NULL) return "";
  /* The name slot sits at offset 0 in every version. */
  return s->t.v9->name ? s->t.v9->name : "";
}

int shim_init(shim_t* s, uint64_t comm_id) {
  if (s == NULL) return SHIM_ERR_USAGE;
  prism_net_comm_config_t config = {.trafficClass = -1};
  int rc = SHIM_ERR_USAGE;
  switch (s->version) {
    case 9: rc = s->t.v9->init(shim_logger); break;
    case 10: rc = s->t.v10->init(shim_logger, NULL); break;
    case 11: rc = s->t.v11->init(&s->ctx, comm_id, &config, shim_logger, NULL); break;
    case 12: rc = s->t.v12->init(&s->ctx, comm_id, &config, shim_logger, NULL); break;
  }
  if (rc == PRISM_OK) s->initialised = 1;
  return rc;
}

int shim_devices(shim_t* s, int* ndev) {
  if (s == NULL || ndev == NULL) return SHIM_ERR_USAGE;
  return s->t.v9->devices(ndev);
}

static void copy_str(char* dst, size_t cap, const char* src) {
  if (src == NULL) {
    dst[0] = '\0';
    return;
  }
  snprintf(dst, cap, "%s", src);
}

/* The fields every version 9..12 has, in the same place. */
#define COPY_HEAD(p)                                             \
  copy_str(out->name, sizeof out->name, (p).name);               \
  copy_str(out->pci_path, sizeof out->pci_path, (p).pciPath);    \
  out->guid = (p).guid;                                          \
  out->ptr_support = (p).ptrSupport;                             \
  out->reg_is_global = (p).regIsGlobal;                          \
  out->force_flush = (p).forceFlush;                             \
  out->speed_mbps = (p).speed;                                   \
  out->port = (p).port;                                          \
  out->latency_us = (p).latency;                                 \
  out->max_comms = (p).maxComms;                                 \
  out->max_recvs = (p).maxRecvs;                                 \
  out->net_device_type = (p).netDeviceType;                      \
  out->net_device_version = (p).netDeviceVersion;                \
  out->vdev_count = (p).vProps.ndevs;                            \
  out->max_p2p_bytes = (p).maxP2pBytes;

/* The struct of the version being served, followed by a canary that a plugin writing a larger
 * (newer) layout would overwrite: the stack corruption NCCL would suffer, made visible. */
#define CANARY_BYTES 64
#define CANARY_BYTE 0xA5
#define PROPS_CALL(VER, TYPE)                                                       \
  do {                                                                              \
    struct {                                                                        \
      TYPE p;                                                                       \
      unsigned char canary[CANARY_BYTES];                                           \
    } buf;                                                                          \
    memset(&buf.p, 0, sizeof buf.p);                                                \
    memset(buf.canary, CANARY_BYTE, sizeof buf.canary);                             \
    rc = s->t.VER->getProperties(dev, &buf.p);                                      \
    if (rc != PRISM_OK) return rc;                                                  \
    for (size_t i = 0; i < CANARY_BYTES; i++)                                       \
      if (buf.canary[i] != CANARY_BYTE) return SHIM_ERR_PROPS_OVERFLOW;             \
    COPY_HEAD(buf.p)                                                                \
    EXTRA(buf.p)                                                                    \
  } while (0)

int shim_get_props(shim_t* s, int dev, shim_props_t* out) {
  if (s == NULL || out == NULL) return SHIM_ERR_USAGE;
  memset(out, 0, sizeof *out);
  out->max_multi_request_size = -1;
  out->rail_id = -1;
  out->plane_id = -1;
  int rc = SHIM_ERR_USAGE;
  switch (s->version) {
#define EXTRA(p) (void)0;
    case 9: PROPS_CALL(v9, prism_net_properties_v9_t); break;
    case 10: PROPS_CALL(v10, prism_net_properties_v10_t); break;
#undef EXTRA
#define EXTRA(p) out->max_multi_request_size = (p).maxMultiRequestSize;
    case 11: PROPS_CALL(v11, prism_net_properties_v11_t); break;
#undef EXTRA
#define EXTRA(p)                                          \
  out->max_multi_request_size = (p).maxMultiRequestSize;  \
  out->rail_id = (p).railId;                              \
  out->plane_id = (p).planeId;
    case 12: PROPS_CALL(v12, prism_net_properties_v12_t); break;
#undef EXTRA
  }
  return rc;
}

int shim_listen(shim_t* s, int dev, void* handle, void** listen_comm) {
  if (s == NULL || handle == NULL || listen_comm == NULL) return SHIM_ERR_USAGE;
  *listen_comm = NULL;
  switch (s->version) {
    case 9: return s->t.v9->listen(dev, handle, listen_comm);
    case 10: return s->t.v10->listen(dev, handle, listen_comm);
    case 11: return s->t.v11->listen(s->ctx, dev, handle, listen_comm);
    case 12: return s->t.v12->listen(s->ctx, dev, handle, listen_comm);
  }
  return SHIM_ERR_USAGE;
}

int shim_connect(shim_t* s, int dev, void* handle, void** send_comm) {
  if (s == NULL || handle == NULL || send_comm == NULL) return SHIM_ERR_USAGE;
  /* Like NCCL for a host plugin: a pointer to a NULL device handle (no offload requested). */
  prism_net_device_handle_t* dev_handle = NULL;
  prism_net_comm_config_t config = {.trafficClass = -1};
  *send_comm = NULL;
  switch (s->version) {
    case 9: return s->t.v9->connect(dev, handle, send_comm, &dev_handle);
    case 10: return s->t.v10->connect(dev, &config, handle, send_comm, &dev_handle);
    case 11: return s->t.v11->connect(s->ctx, dev, handle, send_comm, &dev_handle);
    case 12: return s->t.v12->connect(s->ctx, dev, handle, send_comm, &dev_handle);
  }
  return SHIM_ERR_USAGE;
}

int shim_accept(shim_t* s, void* listen_comm, void** recv_comm) {
  if (s == NULL || recv_comm == NULL) return SHIM_ERR_USAGE;
  prism_net_device_handle_t* dev_handle = NULL;
  *recv_comm = NULL;
  return s->t.v9->accept(listen_comm, recv_comm, &dev_handle);
}

int shim_reg_mr(shim_t* s, void* comm, void* data, size_t size, void** mhandle) {
  if (s == NULL || mhandle == NULL) return SHIM_ERR_USAGE;
  *mhandle = NULL;
  return s->t.v9->regMr(comm, data, size, PRISM_PTR_HOST, mhandle);
}

int shim_dereg_mr(shim_t* s, void* comm, void* mhandle) {
  if (s == NULL) return SHIM_ERR_USAGE;
  return s->t.v9->deregMr(comm, mhandle);
}

int shim_isend(shim_t* s, void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  if (s == NULL || request == NULL) return SHIM_ERR_USAGE;
  *request = NULL;
  switch (s->version) {
    case 9: return s->t.v9->isend(send_comm, data, size, tag, mhandle, request);
    case 10: return s->t.v10->isend(send_comm, data, size, tag, mhandle, NULL, request);
    case 11: return s->t.v11->isend(send_comm, data, size, tag, mhandle, NULL, request);
    case 12: return s->t.v12->isend(send_comm, data, size, tag, mhandle, NULL, request);
  }
  return SHIM_ERR_USAGE;
}

int shim_irecv(shim_t* s, void* recv_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  if (s == NULL || request == NULL) return SHIM_ERR_USAGE;
  /* One-element arrays, as NCCL passes for a single receive; no profiler handle. */
  void* datas[1] = {data};
  size_t sizes[1] = {size};
  int tags[1] = {tag};
  void* mhandles[1] = {mhandle};
  void* phandles[1] = {NULL};
  *request = NULL;
  switch (s->version) {
    case 9: return s->t.v9->irecv(recv_comm, 1, datas, sizes, tags, mhandles, request);
    case 10: return s->t.v10->irecv(recv_comm, 1, datas, sizes, tags, mhandles, phandles, request);
    case 11: return s->t.v11->irecv(recv_comm, 1, datas, sizes, tags, mhandles, phandles, request);
    case 12: return s->t.v12->irecv(recv_comm, 1, datas, sizes, tags, mhandles, phandles, request);
  }
  return SHIM_ERR_USAGE;
}

int shim_irecv_n(shim_t* s, void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                 void** request) {
  if (s == NULL || request == NULL || n < 1 || n > PRISM_NET_MAX_REQUESTS) return SHIM_ERR_USAGE;
  void* phandles[PRISM_NET_MAX_REQUESTS] = {NULL};
  *request = NULL;
  switch (s->version) {
    case 9: return s->t.v9->irecv(recv_comm, n, data, sizes, tags, mhandles, request);
    case 10: return s->t.v10->irecv(recv_comm, n, data, sizes, tags, mhandles, phandles, request);
    case 11: return s->t.v11->irecv(recv_comm, n, data, sizes, tags, mhandles, phandles, request);
    case 12: return s->t.v12->irecv(recv_comm, n, data, sizes, tags, mhandles, phandles, request);
  }
  return SHIM_ERR_USAGE;
}

int shim_test_n(shim_t* s, void* request, int* done, int* sizes, int n) {
  if (s == NULL || done == NULL || n < 0 || n > PRISM_NET_MAX_REQUESTS) return SHIM_ERR_USAGE;
  *done = 0;
  int all[PRISM_NET_MAX_REQUESTS] = {0};
  int rc = s->t.v9->test(request, done, all);
  if (sizes != NULL)
    for (int i = 0; i < n; i++) sizes[i] = all[i];
  return rc;
}

int shim_test(shim_t* s, void* request, int* done, int* size) {
  if (s == NULL || done == NULL) return SHIM_ERR_USAGE;
  *done = 0;
  /* A single receive reports one size; NCCL passes room for more, so do we. */
  int sizes[PRISM_NET_MAX_REQUESTS] = {0};
  int rc = s->t.v9->test(request, done, sizes);
  if (size != NULL) *size = sizes[0];
  return rc;
}

int shim_close_send(shim_t* s, void* send_comm) {
  if (s == NULL) return SHIM_ERR_USAGE;
  return s->t.v9->closeSend(send_comm);
}

int shim_close_recv(shim_t* s, void* recv_comm) {
  if (s == NULL) return SHIM_ERR_USAGE;
  return s->t.v9->closeRecv(recv_comm);
}

int shim_close_listen(shim_t* s, void* listen_comm) {
  if (s == NULL) return SHIM_ERR_USAGE;
  return s->t.v9->closeListen(listen_comm);
}

int shim_finalize(shim_t* s) {
  if (s == NULL) return SHIM_ERR_USAGE;
  if (!s->initialised) return PRISM_OK;
  int rc = PRISM_OK;
  switch (s->version) {
    case 11: rc = s->t.v11->finalize(s->ctx); break;
    case 12: rc = s->t.v12->finalize(s->ctx); break;
    default: break;
  }
  s->initialised = 0;
  s->ctx = NULL;
  return rc;
}

void shim_close(shim_t* s) {
  if (s == NULL) return;
  if (s->dl != NULL) dlclose(s->dl);
  free(s);
}
