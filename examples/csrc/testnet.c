/*
 * testnet.c: a small, strict, in-process net plugin for prism-perf's own tests (built by build.rs as
 * libprism-testnet.so in OUT_DIR; never installed). Ranks are threads of one process; a connection is
 * a queue in this library's memory. It follows the ABI's rules and checks the caller against them:
 * connect/accept answer "not yet" before they succeed, a send waits for its receive (as Prism's CTS
 * does), a send larger than its receive fails, buffers must lie inside the memory handle passed,
 * at most PRISM_NET_MAX_REQUESTS requests per comm, v11/v12 finalize gets the ctx init returned.
 * Each version's getProperties writes exactly its own struct.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prism_net.h"

#define MAGIC 0x7e57e7ULL
#define MAX_LISTENS 256
#define QUEUE 64

typedef struct {
  void* data;
  size_t size;
  int posted; /* receive posted, waiting for its send */
  int done;
  size_t got;
} slot_t;

typedef struct {
  /* receives in posting order; head = oldest not yet matched by a send */
  slot_t slots[QUEUE];
  unsigned posted, matched;
  int accepted;
} pipe_t;

typedef struct {
  int used;
  pipe_t* pending; /* a connect waiting for accept */
} listen_rec_t;

typedef struct {
  uint64_t magic;
  int id;
} handle_t;

typedef struct {
  int id;
} listen_comm_t;

typedef struct {
  pipe_t* pipe;
  int open_requests;
  int is_send;
} comm_t;

typedef struct {
  char* base;
  size_t size;
} mr_t;

typedef struct {
  comm_t* comm;
  int done;
  size_t size;
  slot_t* slot; /* receives: where completion appears */
} req_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static listen_rec_t listens[MAX_LISTENS];
static prism_logger_t logger;

static prism_result_t do_init(prism_logger_t log) {
  logger = log;
  if (logger) logger(PRISM_LOG_INFO, PRISM_SUBSYS_INIT, __FILE__, __LINE__, "%s", "testnet: init");
  return PRISM_OK;
}

static prism_result_t devices(int* ndev) {
  *ndev = 2;
  return PRISM_OK;
}

#define FILL_HEAD(p, dev)                           \
  (p)->name = (dev) == 0 ? "testnet0" : "testnet1"; \
  (p)->pciPath = NULL;                              \
  (p)->guid = (uint64_t)(dev);                      \
  (p)->ptrSupport = PRISM_PTR_HOST;                 \
  (p)->regIsGlobal = 0;                             \
  (p)->forceFlush = 0;                              \
  (p)->speed = 100000;                              \
  (p)->port = 0;                                    \
  (p)->latency = 0;                                 \
  (p)->maxComms = 65536;                            \
  (p)->maxRecvs = 1;                                \
  (p)->netDeviceType = 0;                           \
  (p)->netDeviceVersion = 0;                        \
  (p)->vProps.ndevs = 1;                            \
  (p)->vProps.devs[0] = (dev);                      \
  (p)->maxP2pBytes = (size_t)PRISM_MAX_NET_SIZE_BYTES; \
  (p)->maxCollBytes = (size_t)PRISM_MAX_NET_SIZE_BYTES;

static prism_result_t props_v9(int dev, prism_net_properties_v9_t* p) {
  if (dev < 0 || dev > 1) return PRISM_ERR_INVALID_ARGUMENT;
  FILL_HEAD(p, dev)
  return PRISM_OK;
}
static prism_result_t props_v11(int dev, prism_net_properties_v11_t* p) {
  if (dev < 0 || dev > 1) return PRISM_ERR_INVALID_ARGUMENT;
  FILL_HEAD(p, dev)
  p->maxMultiRequestSize = 1;
  return PRISM_OK;
}
static prism_result_t props_v12(int dev, prism_net_properties_v12_t* p) {
  if (dev < 0 || dev > 1) return PRISM_ERR_INVALID_ARGUMENT;
  FILL_HEAD(p, dev)
  p->maxMultiRequestSize = 1;
  p->railId = (int16_t)dev;
  p->planeId = -1;
  return PRISM_OK;
}

static prism_result_t do_listen(int dev, void* handle, void** listen_comm) {
  if (dev < 0 || dev > 1 || handle == NULL || listen_comm == NULL) return PRISM_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  int id = -1;
  for (int i = 0; i < MAX_LISTENS; i++)
    if (!listens[i].used) {
      id = i;
      break;
    }
  if (id < 0) {
    pthread_mutex_unlock(&lock);
    return PRISM_ERR_SYSTEM;
  }
  listens[id].used = 1;
  listens[id].pending = NULL;
  pthread_mutex_unlock(&lock);
  handle_t h = {MAGIC, id};
  memset(handle, 0, PRISM_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof h);
  listen_comm_t* lc = calloc(1, sizeof *lc);
  lc->id = id;
  *listen_comm = lc;
  return PRISM_OK;
}

/* First call: offer a pipe to the listener and answer "not yet"; later calls: done once accepted. */
static prism_result_t do_connect(void* handle, void** send_comm) {
  handle_t h;
  memcpy(&h, handle, sizeof h);
  if (h.magic != MAGIC || h.id < 0 || h.id >= MAX_LISTENS) return PRISM_ERR_INVALID_ARGUMENT;
  *send_comm = NULL;
  pthread_mutex_lock(&lock);
  listen_rec_t* l = &listens[h.id];
  /* The connect state lives in the handle, as NCCL's IB plugin keeps it: a pointer after the id. */
  pipe_t* mine;
  memcpy(&mine, (char*)handle + 64, sizeof mine);
  if (mine == NULL) {
    if (!l->used || l->pending != NULL) {
      pthread_mutex_unlock(&lock);
      return l->used ? PRISM_OK : PRISM_ERR_INVALID_USAGE;
    }
    mine = calloc(1, sizeof *mine);
    l->pending = mine;
    memcpy((char*)handle + 64, &mine, sizeof mine);
    pthread_mutex_unlock(&lock);
    return PRISM_OK;
  }
  int ready = mine->accepted;
  pthread_mutex_unlock(&lock);
  if (ready) {
    comm_t* c = calloc(1, sizeof *c);
    c->pipe = mine;
    c->is_send = 1;
    *send_comm = c;
  }
  return PRISM_OK;
}

static prism_result_t do_accept(void* listen_comm, void** recv_comm) {
  listen_comm_t* lc = listen_comm;
  *recv_comm = NULL;
  pthread_mutex_lock(&lock);
  pipe_t* p = listens[lc->id].pending;
  if (p != NULL) {
    listens[lc->id].pending = NULL;
    p->accepted = 1;
  }
  pthread_mutex_unlock(&lock);
  if (p != NULL) {
    comm_t* c = calloc(1, sizeof *c);
    c->pipe = p;
    *recv_comm = c;
  }
  return PRISM_OK;
}

static prism_result_t reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  if (comm == NULL || mhandle == NULL || type != PRISM_PTR_HOST) return PRISM_ERR_INVALID_ARGUMENT;
  mr_t* m = malloc(sizeof *m);
  m->base = data;
  m->size = size;
  *mhandle = m;
  return PRISM_OK;
}
static prism_result_t reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                                    void** mhandle) {
  (void)comm, (void)data, (void)size, (void)type, (void)offset, (void)fd, (void)mhandle;
  return PRISM_ERR_INTERNAL;
}
static prism_result_t dereg_mr(void* comm, void* mhandle) {
  (void)comm;
  free(mhandle);
  return PRISM_OK;
}

static int inside(void* mhandle, void* data, size_t size) {
  mr_t* m = mhandle;
  return m != NULL && (char*)data >= m->base && (char*)data + size <= m->base + m->size;
}

static prism_result_t do_isend(void* send_comm, void* data, size_t size, void* mhandle, void** request) {
  comm_t* c = send_comm;
  *request = NULL;
  if (c == NULL || !c->is_send || (size > 0 && !inside(mhandle, data, size))) return PRISM_ERR_INVALID_ARGUMENT;
  if (c->open_requests >= PRISM_NET_MAX_REQUESTS) return PRISM_ERR_INTERNAL;
  pthread_mutex_lock(&lock);
  pipe_t* p = c->pipe;
  if (p->matched == p->posted) { /* no receive posted yet: retry later */
    pthread_mutex_unlock(&lock);
    return PRISM_OK;
  }
  slot_t* s = &p->slots[p->matched % QUEUE];
  if (size > s->size) {
    pthread_mutex_unlock(&lock);
    return PRISM_ERR_INVALID_USAGE;
  }
  memcpy(s->data, data, size);
  s->got = size;
  s->done = 1;
  p->matched++;
  pthread_mutex_unlock(&lock);
  req_t* r = calloc(1, sizeof *r);
  r->comm = c;
  r->done = 1;
  r->size = size;
  c->open_requests++;
  *request = r;
  return PRISM_OK;
}

static prism_result_t do_irecv(void* recv_comm, int n, void** data, size_t* sizes, void** mhandles, void** request) {
  comm_t* c = recv_comm;
  *request = NULL;
  if (c == NULL || c->is_send || n != 1) return PRISM_ERR_INVALID_ARGUMENT;
  if (sizes[0] > 0 && !inside(mhandles[0], data[0], sizes[0])) return PRISM_ERR_INVALID_ARGUMENT;
  if (c->open_requests >= PRISM_NET_MAX_REQUESTS) return PRISM_ERR_INTERNAL;
  pthread_mutex_lock(&lock);
  pipe_t* p = c->pipe;
  if (p->posted - p->matched >= QUEUE) {
    pthread_mutex_unlock(&lock);
    return PRISM_OK;
  }
  slot_t* s = &p->slots[p->posted % QUEUE];
  /* A slot is reused only after its receive was tested done (open_requests bounds that). */
  s->data = data[0];
  s->size = sizes[0];
  s->posted = 1;
  s->done = 0;
  s->got = 0;
  p->posted++;
  pthread_mutex_unlock(&lock);
  req_t* r = calloc(1, sizeof *r);
  r->comm = c;
  r->slot = s;
  c->open_requests++;
  *request = r;
  return PRISM_OK;
}

static prism_result_t test(void* request, int* done, int* sizes) {
  req_t* r = request;
  if (r == NULL || done == NULL) return PRISM_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  int d = r->slot ? r->slot->done : r->done;
  size_t size = r->slot ? r->slot->got : r->size;
  pthread_mutex_unlock(&lock);
  *done = d;
  if (d) {
    if (sizes) sizes[0] = (int)size;
    r->comm->open_requests--;
    free(r);
  }
  return PRISM_OK;
}

static prism_result_t iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request) {
  (void)recv_comm, (void)n, (void)data, (void)sizes, (void)mhandles;
  *request = NULL;
  return PRISM_OK;
}

static prism_result_t close_comm(void* comm) {
  comm_t* c = comm;
  if (c == NULL) return PRISM_ERR_INVALID_ARGUMENT;
  /* The pipe is shared by both ends and lives as long as the process: closing order is free. */
  free(c);
  return PRISM_OK;
}

static prism_result_t close_listen(void* listen_comm) {
  listen_comm_t* lc = listen_comm;
  if (lc == NULL) return PRISM_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  listens[lc->id].used = 0;
  pthread_mutex_unlock(&lock);
  free(lc);
  return PRISM_OK;
}

/* Per-version entry points. */
static prism_result_t init_v9(prism_logger_t log) { return do_init(log); }
static prism_result_t init_v10(prism_logger_t log, prism_profiler_cb_t prof) {
  (void)prof;
  return do_init(log);
}
static char ctx_token;
static prism_result_t init_v11(void** ctx, uint64_t comm_id, prism_net_comm_config_t* config, prism_logger_t log,
                               prism_profiler_cb_t prof) {
  (void)comm_id, (void)prof;
  if (ctx == NULL || config == NULL) return PRISM_ERR_INVALID_ARGUMENT;
  *ctx = &ctx_token;
  return do_init(log);
}
static prism_result_t finalize(void* ctx) { return ctx == &ctx_token ? PRISM_OK : PRISM_ERR_INVALID_ARGUMENT; }

static prism_result_t listen_v9(int dev, void* handle, void** lc) { return do_listen(dev, handle, lc); }
static prism_result_t listen_v11(void* ctx, int dev, void* handle, void** lc) {
  if (ctx != &ctx_token) return PRISM_ERR_INVALID_ARGUMENT;
  return do_listen(dev, handle, lc);
}
static prism_result_t connect_v9(int dev, void* handle, void** sc, prism_net_device_handle_t** dh) {
  (void)dev, (void)dh;
  return do_connect(handle, sc);
}
static prism_result_t connect_v10(int dev, prism_net_comm_config_t* config, void* handle, void** sc,
                                  prism_net_device_handle_t** dh) {
  (void)dev, (void)dh;
  if (config == NULL) return PRISM_ERR_INVALID_ARGUMENT;
  return do_connect(handle, sc);
}
static prism_result_t connect_v11(void* ctx, int dev, void* handle, void** sc, prism_net_device_handle_t** dh) {
  (void)dev, (void)dh;
  if (ctx != &ctx_token) return PRISM_ERR_INVALID_ARGUMENT;
  return do_connect(handle, sc);
}
static prism_result_t accept_any(void* lc, void** rc, prism_net_device_handle_t** dh) {
  (void)dh;
  return do_accept(lc, rc);
}
static prism_result_t isend_v9(void* sc, void* data, size_t size, int tag, void* mh, void** req) {
  (void)tag;
  return do_isend(sc, data, size, mh, req);
}
static prism_result_t isend_v10(void* sc, void* data, size_t size, int tag, void* mh, void* ph, void** req) {
  (void)tag, (void)ph;
  return do_isend(sc, data, size, mh, req);
}
static prism_result_t irecv_v9(void* rc, int n, void** data, size_t* sizes, int* tags, void** mhs, void** req) {
  (void)tags;
  return do_irecv(rc, n, data, sizes, mhs, req);
}
static prism_result_t irecv_v10(void* rc, int n, void** data, size_t* sizes, int* tags, void** mhs, void** phs,
                                void** req) {
  (void)tags, (void)phs;
  return do_irecv(rc, n, data, sizes, mhs, req);
}

#define EXPORT __attribute__((visibility("default")))

EXPORT prism_net_v9_t ncclNetPlugin_v9 = {
    "testnet", init_v9, devices, props_v9, listen_v9, connect_v9, accept_any, reg_mr, reg_mr_dmabuf, dereg_mr,
    isend_v9, irecv_v9, iflush, test, close_comm, close_comm, close_listen, NULL, NULL, NULL};
EXPORT prism_net_v10_t ncclNetPlugin_v10 = {
    "testnet", init_v10, devices, props_v9, listen_v9, connect_v10, accept_any, reg_mr, reg_mr_dmabuf, dereg_mr,
    isend_v10, irecv_v10, iflush, test, close_comm, close_comm, close_listen, NULL, NULL, NULL};
EXPORT prism_net_v11_t ncclNetPlugin_v11 = {
    "testnet", init_v11, devices, props_v11, listen_v11, connect_v11, accept_any, reg_mr, reg_mr_dmabuf,
    dereg_mr, isend_v10, irecv_v10, iflush, test, close_comm, close_comm, close_listen, NULL, NULL, NULL,
    finalize, NULL};
EXPORT prism_net_v12_t ncclNetPlugin_v12 = {
    "testnet", init_v11, devices, props_v12, listen_v11, connect_v11, accept_any, reg_mr, reg_mr_dmabuf,
    dereg_mr, isend_v10, irecv_v10, iflush, test, close_comm, close_comm, close_listen, NULL, NULL, NULL,
    finalize, NULL};
