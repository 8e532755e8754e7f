/*
 * proxy_test.c: plays NCCL's proxy against libnccl-net-prism.so, in two processes, through the C ABI only.
 *
 * Usage: proxy_test <v9|v10|v11|v12> <path to the plugin .so> [seed]
 *
 * The program dlopens the plugin, forks into rank 0 and rank 1 (the listen handles travel over a
 * socketpair, as NCCL's bootstrap would carry them), and each rank then drives the plugin the way NCCL's
 * proxy threads do: non-blocking connect/accept retry loops, regMr, isend/irecv with NULL-request
 * retries, test loops, iflush, deregMr, close, and for v11/v12 finalize and init again. Every scenario
 * runs in both directions at once (each rank has a send comm and a recv comm to the other) and checks
 * every received byte against a pattern derived from (seed, sender, scenario, message, offset), the
 * untouched tail of each receive buffer and a canary after it. One summary line per scenario and rank;
 * the exit status is non-zero if anything failed on either rank.
 *
 * Only include/prism_net.h, libc and libdl are used; nothing here links Rust.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "prism_net.h"

#define MAX_RECVS 8
#define CANARY 64
#define CANARY_BYTE 0xC5
#define UNTOUCHED_BYTE 0xEE
#define SIZE_GUARD (-7)
#define MIB (1024 * 1024)

/* ------------------------------------------------------------------ process-wide state */

static int g_version;       /* 9, 10, 11 or 12 */
static int g_rank;          /* 0 = parent, 1 = child */
static int g_peer_fd = -1;  /* socketpair end to the other rank */
static uint64_t g_seed = 0x5eed;
static double g_timeout_s = 120.0;
static int g_failures;
static int g_verbose;
static union {
  void* any;
  prism_net_v9_t* v9;
  prism_net_v10_t* v10;
  prism_net_v11_t* v11;
  prism_net_v12_t* v12;
} g_net;

static int g_log_calls, g_log_warns, g_log_bad_fmt;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define SAY(...)                                        \
  do {                                                  \
    printf("[v%d rank%d] ", g_version, g_rank);         \
    printf(__VA_ARGS__);                                \
    printf("\n");                                       \
    fflush(stdout);                                     \
  } while (0)

#define FAIL(...)                 \
  do {                            \
    printf("[v%d rank%d] FAIL: ", g_version, g_rank); \
    printf(__VA_ARGS__);          \
    printf("\n");                 \
    fflush(stdout);               \
    g_failures++;                 \
  } while (0)

#define CHECK(cond, ...)  \
  do {                    \
    if (!(cond)) {        \
      FAIL(__VA_ARGS__);  \
      return -1;          \
    }                     \
  } while (0)

/* NCCL's logger as the plugin sees it. Prism must always pass fmt = "%s". */
static void test_logger(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  g_log_calls++;
  if (fmt == NULL || strcmp(fmt, "%s") != 0) {
    g_log_bad_fmt++;
    fprintf(stderr, "[v%d rank%d] logger called with fmt \"%s\" (must be \"%%s\")\n", g_version, g_rank,
            fmt ? fmt : "(null)");
    return;
  }
  va_list ap;
  va_start(ap, fmt);
  const char* msg = va_arg(ap, const char*);
  va_end(ap);
  if (level == PRISM_LOG_WARN) g_log_warns++;
  if (level == PRISM_LOG_WARN || g_verbose) {
    fprintf(stderr, "[v%d rank%d] plugin %s (flags %#lx) %s:%d %s\n", g_version, g_rank,
            level == PRISM_LOG_WARN ? "WARN" : level == PRISM_LOG_INFO ? "INFO" : "TRACE", flags,
            file ? file : "?", line, msg ? msg : "(null)");
  }
}

/* ------------------------------------------------------------------ the other rank */

static void xwrite(const void* buf, size_t n) {
  const char* p = buf;
  while (n > 0) {
    ssize_t k = write(g_peer_fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      printf("[v%d rank%d] FAIL: peer channel write: %s\n", g_version, g_rank, strerror(errno));
      exit(1);
    }
    p += k;
    n -= (size_t)k;
  }
}

static void xread(void* buf, size_t n) {
  char* p = buf;
  while (n > 0) {
    ssize_t k = read(g_peer_fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      printf("[v%d rank%d] FAIL: the other rank is gone (it failed or timed out first)\n", g_version, g_rank);
      exit(1);
    }
    p += k;
    n -= (size_t)k;
  }
}

/* Both ranks reach the same point; a rank that already failed makes the other fail here too. */
static void barrier(const char* where) {
  int32_t mine = g_failures, theirs = 0;
  xwrite(&mine, sizeof mine);
  xread(&theirs, sizeof theirs);
  if (theirs != 0) {
    printf("[v%d rank%d] FAIL: the other rank reported %d failure(s) before %s\n", g_version, g_rank, theirs, where);
    exit(1);
  }
}

/* ------------------------------------------------------------------ data pattern */

static uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/* The seed of message `index` of scenario `scenario` sent by rank `sender`. */
static uint64_t msg_seed(int sender, int scenario, int index) {
  return mix64(g_seed ^ mix64(((uint64_t)sender << 48) | ((uint64_t)scenario << 32) | (uint32_t)index));
}

static uint8_t pattern_byte(uint64_t seed, size_t size, size_t off) {
  uint64_t w = mix64(seed ^ mix64(size) ^ (off >> 3) * 0xD6E8FEB86659FD93ULL);
  return (uint8_t)(w >> (8 * (off & 7)));
}

static void fill_pattern(uint8_t* p, size_t size, uint64_t seed) {
  for (size_t off = 0; off < size; off += 8) {
    uint64_t w = mix64(seed ^ mix64(size) ^ (off >> 3) * 0xD6E8FEB86659FD93ULL);
    size_t n = size - off < 8 ? size - off : 8;
    for (size_t i = 0; i < n; i++) p[off + i] = (uint8_t)(w >> (8 * i));
  }
}

/* First offset where the message differs from its pattern, or SIZE_MAX. */
static size_t check_pattern(const uint8_t* p, size_t size, uint64_t seed) {
  for (size_t off = 0; off < size; off += 8) {
    uint64_t w = mix64(seed ^ mix64(size) ^ (off >> 3) * 0xD6E8FEB86659FD93ULL);
    size_t n = size - off < 8 ? size - off : 8;
    for (size_t i = 0; i < n; i++)
      if (p[off + i] != (uint8_t)(w >> (8 * i))) return off + i;
  }
  return SIZE_MAX;
}

static size_t check_bytes(const uint8_t* p, size_t n, uint8_t value) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != value) return i;
  return SIZE_MAX;
}

/* ------------------------------------------------------------------ the ABI, one call per slot */

static const char* net_name(void) {
  switch (g_version) {
    case 9: return g_net.v9->name;
    case 10: return g_net.v10->name;
    case 11: return g_net.v11->name;
    default: return g_net.v12->name;
  }
}

static prism_result_t net_init(void** ctx, uint64_t comm_id) {
  prism_net_comm_config_t config = {.trafficClass = -1};
  switch (g_version) {
    case 9: *ctx = NULL; return g_net.v9->init(test_logger);
    case 10: *ctx = NULL; return g_net.v10->init(test_logger, NULL);
    case 11: return g_net.v11->init(ctx, comm_id, &config, test_logger, NULL);
    default: return g_net.v12->init(ctx, comm_id, &config, test_logger, NULL);
  }
}

static prism_result_t net_finalize(void* ctx) {
  switch (g_version) {
    case 11: return g_net.v11->finalize(ctx);
    case 12: return g_net.v12->finalize(ctx);
    default: return PRISM_OK; /* v9/v10 have no finalize */
  }
}

static prism_result_t net_devices(int* ndev) {
  switch (g_version) {
    case 9: return g_net.v9->devices(ndev);
    case 10: return g_net.v10->devices(ndev);
    case 11: return g_net.v11->devices(ndev);
    default: return g_net.v12->devices(ndev);
  }
}

static size_t props_size(void) {
  switch (g_version) {
    case 9: case 10: return sizeof(prism_net_properties_v9_t);
    case 11: return sizeof(prism_net_properties_v11_t);
    default: return sizeof(prism_net_properties_v12_t);
  }
}

/* Writes the version's own layout into `buf`. */
static prism_result_t net_get_properties(int dev, void* buf) {
  switch (g_version) {
    case 9: return g_net.v9->getProperties(dev, buf);
    case 10: return g_net.v10->getProperties(dev, buf);
    case 11: return g_net.v11->getProperties(dev, buf);
    default: return g_net.v12->getProperties(dev, buf);
  }
}

static prism_result_t net_listen(void* ctx, int dev, void* handle, void** lcomm) {
  switch (g_version) {
    case 9: return g_net.v9->listen(dev, handle, lcomm);
    case 10: return g_net.v10->listen(dev, handle, lcomm);
    case 11: return g_net.v11->listen(ctx, dev, handle, lcomm);
    default: return g_net.v12->listen(ctx, dev, handle, lcomm);
  }
}

static prism_result_t net_connect(void* ctx, int dev, void* handle, void** scomm, prism_net_device_handle_t** dc) {
  prism_net_comm_config_t config = {.trafficClass = -1};
  switch (g_version) {
    case 9: return g_net.v9->connect(dev, handle, scomm, dc);
    case 10: return g_net.v10->connect(dev, &config, handle, scomm, dc);
    case 11: return g_net.v11->connect(ctx, dev, handle, scomm, dc);
    default: return g_net.v12->connect(ctx, dev, handle, scomm, dc);
  }
}

/* The slots from accept on have the same type in every version, at the same offsets; the switch still
 * goes through each version's own struct so a layout slip in the header would show. */
#define SAME_SLOT(slot, ...)                                      \
  switch (g_version) {                                            \
    case 9: return g_net.v9->slot(__VA_ARGS__);                   \
    case 10: return g_net.v10->slot(__VA_ARGS__);                 \
    case 11: return g_net.v11->slot(__VA_ARGS__);                 \
    default: return g_net.v12->slot(__VA_ARGS__);                 \
  }

static prism_result_t net_accept(void* lcomm, void** rcomm, prism_net_device_handle_t** dc) { SAME_SLOT(accept, lcomm, rcomm, dc) }
static prism_result_t net_reg_mr(void* comm, void* data, size_t size, int type, void** mh) { SAME_SLOT(regMr, comm, data, size, type, mh) }
static prism_result_t net_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, void** mh) {
  SAME_SLOT(regMrDmaBuf, comm, data, size, type, 0, -1, mh)
}
static prism_result_t net_dereg_mr(void* comm, void* mh) { SAME_SLOT(deregMr, comm, mh) }
static prism_result_t net_iflush(void* rcomm, int n, void** data, int* sizes, void** mhs, void** req) {
  SAME_SLOT(iflush, rcomm, n, data, sizes, mhs, req)
}
static prism_result_t net_test(void* req, int* done, int* sizes) { SAME_SLOT(test, req, done, sizes) }
static prism_result_t net_close_send(void* c) { SAME_SLOT(closeSend, c) }
static prism_result_t net_close_recv(void* c) { SAME_SLOT(closeRecv, c) }
static prism_result_t net_close_listen(void* c) { SAME_SLOT(closeListen, c) }

static prism_result_t net_isend(void* scomm, void* data, size_t size, int tag, void* mh, void** req) {
  switch (g_version) {
    case 9: return g_net.v9->isend(scomm, data, size, tag, mh, req);
    case 10: return g_net.v10->isend(scomm, data, size, tag, mh, NULL, req);
    case 11: return g_net.v11->isend(scomm, data, size, tag, mh, NULL, req);
    default: return g_net.v12->isend(scomm, data, size, tag, mh, NULL, req);
  }
}

static prism_result_t net_irecv(void* rcomm, int n, void** data, size_t* sizes, int* tags, void** mhs, void** req) {
  void* phandles[MAX_RECVS] = {0};
  switch (g_version) {
    case 9: return g_net.v9->irecv(rcomm, n, data, sizes, tags, mhs, req);
    case 10: return g_net.v10->irecv(rcomm, n, data, sizes, tags, mhs, phandles, req);
    case 11: return g_net.v11->irecv(rcomm, n, data, sizes, tags, mhs, phandles, req);
    default: return g_net.v12->irecv(rcomm, n, data, sizes, tags, mhs, phandles, req);
  }
}

/* ------------------------------------------------------------------ buffers */

/* A message or receive buffer: `size` usable bytes, then a canary; registered on a comm. */
typedef struct {
  uint8_t* base;
  size_t size;
  void* mh;
} buf_t;

static int buf_alloc(buf_t* b, void* comm, size_t size, uint8_t fill) {
  b->size = size;
  b->base = malloc(size + CANARY);
  b->mh = NULL;
  CHECK(b->base != NULL, "malloc(%zu) failed", size + CANARY);
  memset(b->base, fill, size);
  memset(b->base + size, CANARY_BYTE, CANARY);
  prism_result_t rc = net_reg_mr(comm, b->base, size + CANARY, PRISM_PTR_HOST, &b->mh);
  CHECK(rc == PRISM_OK && b->mh != NULL, "regMr(%zu bytes) returned %d, mhandle %p", size + CANARY, rc, b->mh);
  return 0;
}

static int buf_free(void* comm, buf_t* b) {
  prism_result_t rc = net_dereg_mr(comm, b->mh);
  free(b->base);
  b->base = NULL;
  CHECK(rc == PRISM_OK, "deregMr returned %d", rc);
  return 0;
}

/* ------------------------------------------------------------------ requests and the progress loop */

typedef struct {
  int is_send;
  void* comm;
  int n;
  void* data[MAX_RECVS];
  size_t sizes[MAX_RECVS];
  int tags[MAX_RECVS];
  void* mh[MAX_RECVS];
  int hint;          /* irecv: *request = 0x1 on input (optional completion) */
  int null_sizes;    /* test with sizes == NULL */
  void* req;
  enum { UNPOSTED, POSTED, DONE, FAILED } state;
  int rc;
  int got[MAX_RECVS];
  int post_nulls;
} op_t;

static void post_op(op_t* op) {
  void* req = op->hint ? PRISM_OPTIONAL_RECV_COMPLETION : NULL;
  prism_result_t rc = op->is_send
                          ? net_isend(op->comm, op->data[0], op->sizes[0], op->tags[0], op->mh[0], &req)
                          : net_irecv(op->comm, op->n, op->data, op->sizes, op->tags, op->mh, &req);
  if (rc != PRISM_OK) {
    op->state = FAILED;
    op->rc = rc;
  } else if (req == NULL) {
    op->post_nulls++;
  } else if (req == PRISM_OPTIONAL_RECV_COMPLETION) {
    FAIL("%s returned the optional-completion hint itself as its request", op->is_send ? "isend" : "irecv");
    op->state = FAILED;
    op->rc = -1;
  } else {
    op->req = req;
    op->state = POSTED;
  }
}

/* Posts the ops in order (sends and receives are separate FIFO queues, as NCCL posts them), retrying
 * NULL requests, and tests every posted op (newest first if `reverse`: the plugin must progress the
 * whole comm, not just the tested request) until each is done or failed. -1 on timeout. */
static int run_ops(const char* what, op_t* ops, int nops, int reverse) {
  double deadline = now_s() + g_timeout_s;
  for (;;) {
    for (int kind = 0; kind < 2; kind++) {
      for (int i = 0; i < nops; i++) {
        if (ops[i].is_send != kind || ops[i].state != UNPOSTED) continue;
        post_op(&ops[i]);
        if (ops[i].state == UNPOSTED) break; /* NULL: the plugin wants us to come back later */
      }
    }
    int unresolved = 0;
    for (int j = 0; j < nops; j++) {
      op_t* op = &ops[reverse ? nops - 1 - j : j];
      if (op->state == POSTED) {
        int done = 0;
        int sizes[2 * MAX_RECVS];
        for (int k = 0; k < 2 * MAX_RECVS; k++) sizes[k] = SIZE_GUARD;
        prism_result_t rc = net_test(op->req, &done, op->null_sizes ? NULL : sizes);
        if (rc != PRISM_OK) {
          op->state = FAILED;
          op->rc = rc;
        } else if (done) {
          op->state = DONE;
          int n = op->is_send ? 1 : op->n;
          for (int k = 0; k < n; k++) op->got[k] = sizes[k];
          for (int k = n; k < 2 * MAX_RECVS; k++)
            if (sizes[k] != SIZE_GUARD) {
              FAIL("%s: test wrote sizes[%d] = %d for a request of %d buffer(s)", what, k, sizes[k], n);
              op->state = FAILED;
              op->rc = -1;
            }
        } else if (!op->null_sizes) {
          for (int k = 0; k < 2 * MAX_RECVS; k++)
            if (sizes[k] != SIZE_GUARD) {
              FAIL("%s: test wrote sizes[%d] = %d before the request was done", what, k, sizes[k]);
              op->state = FAILED;
              op->rc = -1;
              break;
            }
        }
      }
      if (op->state == UNPOSTED || op->state == POSTED) unresolved++;
    }
    if (unresolved == 0) return 0;
    if (now_s() > deadline) {
      FAIL("%s: %d of %d requests still unresolved after %.0f s", what, unresolved, nops, g_timeout_s);
      for (int i = 0; i < nops; i++)
        if (ops[i].state == UNPOSTED || ops[i].state == POSTED)
          SAY("  op %d (%s, %zu bytes): %s", i, ops[i].is_send ? "send" : "recv", ops[i].sizes[0],
              ops[i].state == UNPOSTED ? "never posted (always NULL)" : "posted, never done");
      return -1;
    }
  }
}

static void send_op(op_t* op, void* comm, buf_t* b, size_t size, int tag) {
  memset(op, 0, sizeof *op);
  op->is_send = 1;
  op->comm = comm;
  op->n = 1;
  op->data[0] = b ? b->base : NULL;
  op->mh[0] = b ? b->mh : NULL;
  op->sizes[0] = size;
  op->tags[0] = tag;
}

static void recv_op(op_t* op, void* comm, int n, buf_t* bufs, const int* tags) {
  memset(op, 0, sizeof *op);
  op->comm = comm;
  op->n = n;
  for (int i = 0; i < n; i++) {
    op->data[i] = bufs[i].base;
    op->mh[i] = bufs[i].mh;
    op->sizes[i] = bufs[i].size;
    op->tags[i] = tags[i];
  }
}

/* Checks receive buffer `b` after a message of `sent` bytes from the peer with `seed`, reported as
 * `reported`: the message, the untouched rest, the canary. */
static int verify_recv(const char* what, const buf_t* b, size_t sent, uint64_t seed, int reported) {
  CHECK(reported >= 0 && (size_t)reported == sent, "%s: test reported %d bytes, the peer sent %zu", what, reported, sent);
  size_t bad = check_pattern(b->base, sent, seed);
  CHECK(bad == SIZE_MAX, "%s: byte %zu of %zu is 0x%02x, expected 0x%02x", what, bad, sent, b->base[bad],
        pattern_byte(seed, sent, bad));
  bad = check_bytes(b->base + sent, b->size - sent, UNTOUCHED_BYTE);
  CHECK(bad == SIZE_MAX, "%s: byte %zu past the %zu-byte message was overwritten", what, sent + bad, sent);
  bad = check_bytes(b->base + b->size, CANARY, CANARY_BYTE);
  CHECK(bad == SIZE_MAX, "%s: canary byte %zu after the %zu-byte buffer was overwritten", what, bad, b->size);
  return 0;
}

/* ------------------------------------------------------------------ connections */

typedef struct {
  void* send;
  void* recv;
} comms_t;

/* Listens, swaps handles with the other rank, then connects and accepts in one interleaved retry loop
 * (as NCCL's proxy service thread does): neither call may block, both return NULL until ready. */
static int connect_pair(void* ctx, const char* what, comms_t* out) {
  char my_handle[PRISM_NET_HANDLE_MAXSIZE], peer_handle[PRISM_NET_HANDLE_MAXSIZE];
  memset(my_handle, 0, sizeof my_handle);
  void* lcomm = NULL;
  prism_result_t rc = net_listen(ctx, 0, my_handle, &lcomm);
  CHECK(rc == PRISM_OK && lcomm != NULL, "%s: listen returned %d, listenComm %p", what, rc, lcomm);
  xwrite(my_handle, sizeof my_handle);
  xread(peer_handle, sizeof peer_handle);

  void* scomm = NULL;
  void* rcomm = NULL;
  prism_net_device_handle_t* dev_handle = NULL;
  int connect_calls = 0, accept_calls = 0;
  double t0 = now_s();
  while (scomm == NULL || rcomm == NULL) {
    if (scomm == NULL) {
      connect_calls++;
      /* NCCL passes a pointer to a NULL device handle; the plugin must leave it NULL. */
      rc = net_connect(ctx, 0, peer_handle, &scomm, &dev_handle);
      CHECK(rc == PRISM_OK, "%s: connect returned %d after %d calls", what, rc, connect_calls);
      CHECK(dev_handle == NULL, "%s: connect set a device handle", what);
    }
    if (rcomm == NULL) {
      accept_calls++;
      /* The GDR probe passes no device-handle pointer at all. */
      rc = net_accept(lcomm, &rcomm, NULL);
      CHECK(rc == PRISM_OK, "%s: accept returned %d after %d calls", what, rc, accept_calls);
    }
    CHECK(now_s() - t0 < g_timeout_s, "%s: no connection after %.0f s (%d connect, %d accept calls)", what,
          g_timeout_s, connect_calls, accept_calls);
  }
  rc = net_close_listen(lcomm);
  CHECK(rc == PRISM_OK, "%s: closeListen returned %d", what, rc);
  out->send = scomm;
  out->recv = rcomm;
  SAY("%s: ok (connected after %d connect and %d accept calls, %.3f s)", what, connect_calls, accept_calls,
      now_s() - t0);
  return 0;
}

static int close_pair(const char* what, comms_t* c) {
  prism_result_t a = net_close_send(c->send);
  prism_result_t b = net_close_recv(c->recv);
  CHECK(a == PRISM_OK && b == PRISM_OK, "%s: closeSend returned %d, closeRecv %d", what, a, b);
  c->send = c->recv = NULL;
  return 0;
}

/* ------------------------------------------------------------------ scenarios */

enum { SC_SIZES = 1, SC_INFLIGHT, SC_GROUPED, SC_LARGER_RECV, SC_HINT, SC_BIDIR, SC_TRUNC, SC_REINIT, SC_CLOSE };

static int scenario_properties(void) {
  int ndev = -1;
  prism_result_t rc = net_devices(&ndev);
  CHECK(rc == PRISM_OK && ndev >= 1, "devices returned %d, ndev %d", rc, ndev);
  const char* names[64];
  uint64_t guids[64];
  for (int dev = 0; dev < ndev && dev < 64; dev++) {
    /* 256 bytes of 0xAB: the plugin must write exactly its version's layout and nothing after it. */
    union {
      unsigned char raw[256];
      prism_net_properties_v9_t v9;
      prism_net_properties_v11_t v11;
      prism_net_properties_v12_t v12;
    } u;
    memset(u.raw, 0xAB, sizeof u.raw);
    rc = net_get_properties(dev, &u);
    CHECK(rc == PRISM_OK, "getProperties(%d) returned %d", dev, rc);
    size_t bad = check_bytes(u.raw + props_size(), sizeof u.raw - props_size(), 0xAB);
    CHECK(bad == SIZE_MAX, "getProperties(%d) wrote byte %zu, past the %zu-byte v%d struct", dev, props_size() + bad,
          props_size(), g_version);
    prism_net_properties_v9_t* p = &u.v9; /* the head is the same in every version */
    CHECK(p->name != NULL && p->name[0] != '\0', "device %d has no name", dev);
    for (int k = 0; k < dev; k++) CHECK(strcmp(names[k], p->name) != 0, "devices %d and %d are both named %s", k, dev, p->name);
    names[dev] = p->name;
    guids[dev] = p->guid;
    for (int k = 0; k < dev; k++) CHECK(guids[k] != p->guid, "devices %d and %d share guid %#llx", k, dev, (unsigned long long)p->guid);
    CHECK(p->ptrSupport == PRISM_PTR_HOST, "device %d ptrSupport %#x (want host only)", dev, p->ptrSupport);
    CHECK(p->regIsGlobal == 0 && p->forceFlush == 0 && p->port == 0, "device %d regIsGlobal %d forceFlush %d port %d", dev,
          p->regIsGlobal, p->forceFlush, p->port);
    CHECK(p->speed > 0, "device %d speed %d Mbps", dev, p->speed);
    CHECK(p->maxComms == 65536 && p->maxRecvs == MAX_RECVS, "device %d maxComms %d maxRecvs %d", dev, p->maxComms, p->maxRecvs);
    CHECK(p->netDeviceType == 0 && p->netDeviceVersion == 0, "device %d offload type %d version %d", dev, p->netDeviceType,
          p->netDeviceVersion);
    if (g_version == 12) {
      prism_net_properties_v12_t* q = &u.v12;
      CHECK(q->vProps.ndevs == 1 && q->vProps.devs[0] == dev, "device %d vProps {%d, {%d}}", dev, q->vProps.ndevs, q->vProps.devs[0]);
      CHECK(q->maxP2pBytes == (size_t)PRISM_MAX_P2P_BYTES && q->maxCollBytes == (size_t)PRISM_MAX_NET_SIZE_BYTES,
            "device %d maxP2pBytes %zu maxCollBytes %zu", dev, q->maxP2pBytes, q->maxCollBytes);
      CHECK(q->maxMultiRequestSize == 1 && q->railId == dev && q->planeId == -1,
            "device %d maxMultiRequestSize %d railId %d planeId %d", dev, q->maxMultiRequestSize, q->railId, q->planeId);
    } else {
      CHECK(p->vProps.ndevs == 1 && p->vProps.devs[0] == dev, "device %d vProps {%d, {%d}}", dev, p->vProps.ndevs, p->vProps.devs[0]);
      CHECK(p->maxP2pBytes == (size_t)PRISM_MAX_P2P_BYTES && p->maxCollBytes == (size_t)PRISM_MAX_NET_SIZE_BYTES,
            "device %d maxP2pBytes %zu maxCollBytes %zu", dev, p->maxP2pBytes, p->maxCollBytes);
      if (g_version == 11) CHECK(u.v11.maxMultiRequestSize == 1, "device %d maxMultiRequestSize %d", dev, u.v11.maxMultiRequestSize);
    }
    SAY("properties: device %d = %s, pci %s, %d Mbps", dev, p->name, p->pciPath ? p->pciPath : "none", p->speed);
  }
  char scratch[256];
  int warns = g_log_warns;
  CHECK(net_get_properties(-1, scratch) != PRISM_OK, "getProperties(-1) succeeded");
  CHECK(net_get_properties(ndev, scratch) != PRISM_OK, "getProperties(%d) succeeded with %d devices", ndev, ndev);
  CHECK(g_log_warns >= warns + 2, "a bad device index was refused without a WARN");
  SAY("properties: ok (%d device(s), name \"%s\", v%d layout of %zu bytes, nothing written past it)", ndev, net_name(),
      g_version, props_size());
  return 0;
}

/* One message of each size in each direction, both directions at once. Size 0 is sent from NULL. */
static int scenario_sizes(comms_t* c) {
  static const size_t sizes[] = {0, 1, 7, 4096, 65535, 1 * MIB, 16 * MIB, 64 * MIB};
  const int nsizes = (int)(sizeof sizes / sizeof sizes[0]);
  double t0 = now_s();
  size_t total = 0;
  for (int i = 0; i < nsizes; i++) {
    size_t size = sizes[i];
    buf_t sb, rb;
    if (buf_alloc(&sb, c->send, size, 0) || buf_alloc(&rb, c->recv, size, UNTOUCHED_BYTE)) return -1;
    fill_pattern(sb.base, size, msg_seed(g_rank, SC_SIZES, i));
    op_t ops[2];
    if (size == 0)
      send_op(&ops[0], c->send, NULL, 0, 0); /* NULL data, NULL mhandle, 0 bytes */
    else
      send_op(&ops[0], c->send, &sb, size, 0);
    int tag = 0;
    recv_op(&ops[1], c->recv, 1, &rb, &tag);
    char what[64];
    snprintf(what, sizeof what, "sizes[%zu]", size);
    if (run_ops(what, ops, 2, 0)) return -1;
    CHECK(ops[0].state == DONE && ops[1].state == DONE, "%s: send %s (rc %d), recv %s (rc %d)", what,
          ops[0].state == DONE ? "done" : "failed", ops[0].rc, ops[1].state == DONE ? "done" : "failed", ops[1].rc);
    CHECK(ops[0].got[0] == (int)size, "%s: send reported %d bytes", what, ops[0].got[0]);
    if (verify_recv(what, &rb, size, msg_seed(1 - g_rank, SC_SIZES, i), ops[1].got[0])) return -1;
    if (buf_free(c->send, &sb) || buf_free(c->recv, &rb)) return -1;
    total += size;
  }
  double dt = now_s() - t0;
  SAY("sizes: ok (0, 1, 7, 4096, 65535, 1 MiB, 16 MiB, 64 MiB each way, both directions at once; %.1f MiB received in "
      "%.2f s)", (double)total / MIB, dt);
  return 0;
}

/* 32 sends and 32 receives posted before any test, then tested newest first. */
static int scenario_inflight(comms_t* c) {
  enum { N = 32 };
  buf_t sb[N], rb[N];
  op_t ops[2 * N];
  size_t sizes[N];
  for (int i = 0; i < N; i++) {
    sizes[i] = (i % 8 == 7) ? 256 * 1024 + (size_t)i : (size_t)i * 1031 + 1;
    if (buf_alloc(&sb[i], c->send, sizes[i], 0) || buf_alloc(&rb[i], c->recv, sizes[i] + 100, UNTOUCHED_BYTE)) return -1;
    fill_pattern(sb[i].base, sizes[i], msg_seed(g_rank, SC_INFLIGHT, i));
    send_op(&ops[i], c->send, &sb[i], sizes[i], 0);
    ops[i].null_sizes = 1; /* sizes == NULL: the plugin must not write through it */
    int tag = 0;
    recv_op(&ops[N + i], c->recv, 1, &rb[i], &tag);
  }
  for (int i = 0; i < 2 * N; i++) post_op(&ops[i]);
  int sends = 0, recvs = 0;
  for (int i = 0; i < 2 * N; i++) {
    CHECK(ops[i].state != FAILED, "inflight: posting op %d failed with %d", i, ops[i].rc);
    if (ops[i].state == POSTED) *(ops[i].is_send ? &sends : &recvs) += 1;
  }
  CHECK(sends == N && recvs == N, "inflight: only %d sends and %d receives of %d each were accepted at once", sends, recvs, N);
  if (run_ops("inflight", ops, 2 * N, 1)) return -1;
  for (int i = 0; i < N; i++) {
    CHECK(ops[i].state == DONE && ops[N + i].state == DONE, "inflight: message %d: send rc %d, recv rc %d", i, ops[i].rc,
          ops[N + i].rc);
    char what[32];
    snprintf(what, sizeof what, "inflight[%d]", i);
    if (verify_recv(what, &rb[i], sizes[i], msg_seed(1 - g_rank, SC_INFLIGHT, i), ops[N + i].got[0])) return -1;
    if (buf_free(c->send, &sb[i]) || buf_free(c->recv, &rb[i])) return -1;
  }
  SAY("inflight: ok (32 sends + 32 receives in flight per comm, tested newest first, sends tested with sizes == NULL)");
  return 0;
}

/* One receive of n = 4 buffers with distinct tags; the peer sends the four tags out of order. Each send
 * must land in the buffer with its tag, and test must report four sizes and no more. */
static int scenario_grouped(comms_t* c) {
  enum { N = 4 };
  static const int tags[N] = {10, 11, 12, 13};
  static const size_t recv_sizes[N] = {4096, 8192, 100, 64};
  static const size_t send_sizes[N] = {3000, 8192, 1, 0}; /* by tag index */
  static const int send_order[N] = {2, 0, 3, 1};          /* tags 12, 10, 13, 11 */
  buf_t sb[N], rb[N];
  op_t ops[N + 1];
  for (int i = 0; i < N; i++) {
    if (buf_alloc(&rb[i], c->recv, recv_sizes[i], UNTOUCHED_BYTE)) return -1;
    int t = send_order[i];
    if (buf_alloc(&sb[i], c->send, send_sizes[t], 0)) return -1;
    fill_pattern(sb[i].base, send_sizes[t], msg_seed(g_rank, SC_GROUPED, t));
    send_op(&ops[i], c->send, &sb[i], send_sizes[t], tags[t]);
  }
  recv_op(&ops[N], c->recv, N, rb, tags);
  if (run_ops("grouped", ops, N + 1, 0)) return -1;
  for (int i = 0; i <= N; i++) CHECK(ops[i].state == DONE, "grouped: op %d failed with %d", i, ops[i].rc);
  for (int t = 0; t < N; t++) {
    char what[48];
    snprintf(what, sizeof what, "grouped[tag %d]", tags[t]);
    if (verify_recv(what, &rb[t], send_sizes[t], msg_seed(1 - g_rank, SC_GROUPED, t), ops[N].got[t])) return -1;
  }
  for (int i = 0; i < N; i++)
    if (buf_free(c->send, &sb[i]) || buf_free(c->recv, &rb[i])) return -1;
  SAY("grouped: ok (n = 4, tags 10..13 sent as 12, 10, 13, 11; each landed in its tag's buffer; sizes 3000, 8192, 1, 0)");
  return 0;
}

/* A receive larger than the send reports the real size and leaves the rest of the buffer alone. */
static int scenario_larger_recv(comms_t* c) {
  buf_t sb, rb;
  if (buf_alloc(&sb, c->send, 1000, 0) || buf_alloc(&rb, c->recv, 8192, UNTOUCHED_BYTE)) return -1;
  fill_pattern(sb.base, 1000, msg_seed(g_rank, SC_LARGER_RECV, 0));
  op_t ops[2];
  int tag = 0;
  send_op(&ops[0], c->send, &sb, 1000, 0);
  recv_op(&ops[1], c->recv, 1, &rb, &tag);
  if (run_ops("larger-recv", ops, 2, 0)) return -1;
  CHECK(ops[0].state == DONE && ops[1].state == DONE, "larger-recv: send rc %d, recv rc %d", ops[0].rc, ops[1].rc);
  if (verify_recv("larger-recv", &rb, 1000, msg_seed(1 - g_rank, SC_LARGER_RECV, 0), ops[1].got[0])) return -1;
  if (buf_free(c->send, &sb) || buf_free(c->recv, &rb)) return -1;
  SAY("larger-recv: ok (8192-byte receive of a 1000-byte send reported 1000, rest untouched)");
  return 0;
}

/* irecv with *request = 0x1 on input (NCCL's optional-completion hint), then iflush on host memory. */
static int scenario_hint_and_flush(comms_t* c) {
  buf_t sb, rb;
  if (buf_alloc(&sb, c->send, 4096, 0) || buf_alloc(&rb, c->recv, 4096, UNTOUCHED_BYTE)) return -1;
  fill_pattern(sb.base, 4096, msg_seed(g_rank, SC_HINT, 0));
  op_t ops[2];
  int tag = 0;
  send_op(&ops[0], c->send, &sb, 4096, 0);
  recv_op(&ops[1], c->recv, 1, &rb, &tag);
  ops[1].hint = 1;
  if (run_ops("hint", ops, 2, 0)) return -1;
  CHECK(ops[0].state == DONE && ops[1].state == DONE, "hint: send rc %d, recv rc %d", ops[0].rc, ops[1].rc);
  if (verify_recv("hint", &rb, 4096, msg_seed(1 - g_rank, SC_HINT, 0), ops[1].got[0])) return -1;

  void* data[1] = {rb.base};
  int sizes[1] = {4096};
  void* mhs[1] = {rb.mh};
  void* req = (void*)0x1234; /* must come back NULL: host memory has nothing to flush */
  prism_result_t rc = net_iflush(c->recv, 1, data, sizes, mhs, &req);
  CHECK(rc == PRISM_OK && req == NULL, "iflush returned %d, request %p (want 0, NULL)", rc, req);
  if (buf_free(c->send, &sb) || buf_free(c->recv, &rb)) return -1;
  SAY("hint: ok (irecv with *request = 0x1 on input completed normally); iflush: ok (request NULL)");
  return 0;
}

/* Four 4 MiB messages each way, all posted together. */
static int scenario_bidir(comms_t* c) {
  enum { N = 4 };
  const size_t size = 4 * MIB;
  buf_t sb[N], rb[N];
  op_t ops[2 * N];
  double t0 = now_s();
  for (int i = 0; i < N; i++) {
    if (buf_alloc(&sb[i], c->send, size, 0) || buf_alloc(&rb[i], c->recv, size, UNTOUCHED_BYTE)) return -1;
    fill_pattern(sb[i].base, size, msg_seed(g_rank, SC_BIDIR, i));
    send_op(&ops[i], c->send, &sb[i], size, 0);
    int tag = 0;
    recv_op(&ops[N + i], c->recv, 1, &rb[i], &tag);
  }
  if (run_ops("bidir", ops, 2 * N, 0)) return -1;
  double dt = now_s() - t0;
  for (int i = 0; i < N; i++) {
    CHECK(ops[i].state == DONE && ops[N + i].state == DONE, "bidir %d: send rc %d recv rc %d", i, ops[i].rc, ops[N + i].rc);
    char what[32];
    snprintf(what, sizeof what, "bidir[%d]", i);
    if (verify_recv(what, &rb[i], size, msg_seed(1 - g_rank, SC_BIDIR, i), ops[N + i].got[0])) return -1;
    if (buf_free(c->send, &sb[i]) || buf_free(c->recv, &rb[i])) return -1;
  }
  SAY("bidir: ok (4 x 4 MiB each way at once, %.0f MiB/s received)", (double)(N * size) / MIB / dt);
  return 0;
}

/* Argument checks: each bad call fails with a code (and a WARN), none crashes, none disturbs the comm. */
static int scenario_errors(comms_t* c) {
  int warns = g_log_warns;
  int calls = 0;
  buf_t b;
  if (buf_alloc(&b, c->recv, 1024, UNTOUCHED_BYTE)) return -1;
  void* req = NULL;
  void* data[MAX_RECVS + 1];
  size_t sizes[MAX_RECVS + 1];
  int tags[MAX_RECVS + 1];
  void* mhs[MAX_RECVS + 1];
  for (int i = 0; i <= MAX_RECVS; i++) {
    data[i] = b.base;
    sizes[i] = 16;
    tags[i] = 0;
    mhs[i] = b.mh;
  }
  CHECK(net_irecv(c->recv, 0, data, sizes, tags, mhs, &req) != PRISM_OK && req == NULL, "irecv with n = 0 succeeded");
  calls++;
  CHECK(net_irecv(c->recv, MAX_RECVS + 1, data, sizes, tags, mhs, &req) != PRISM_OK && req == NULL,
        "irecv with n = maxRecvs + 1 succeeded");
  calls++;
  sizes[0] = 2048; /* larger than the 1024 + canary bytes registered */
  CHECK(net_irecv(c->recv, 1, data, sizes, tags, mhs, &req) != PRISM_OK && req == NULL,
        "irecv of a buffer reaching past its memory handle succeeded");
  calls++;

  uint64_t fake_mh[4] = {0x0123456789abcdefULL, 0, 0, 0};
  CHECK(net_isend(c->send, b.base, 16, 0, fake_mh, &req) != PRISM_OK && req == NULL, "isend with a foreign mhandle succeeded");
  calls++;
  CHECK(net_isend(c->recv, b.base, 16, 0, b.mh, &req) != PRISM_OK && req == NULL, "isend on a recv comm succeeded");
  calls++;
  CHECK(net_isend(c->send, NULL, 16, 0, NULL, &req) != PRISM_OK && req == NULL, "isend of 16 bytes from NULL succeeded");
  calls++;

  void* mh = NULL;
  prism_result_t rc = net_reg_mr(c->send, b.base, 1024, PRISM_PTR_CUDA, &mh);
  CHECK(rc == PRISM_ERR_INTERNAL && mh == NULL, "regMr(NCCL_PTR_CUDA) returned %d (want %d)", rc, PRISM_ERR_INTERNAL);
  calls++;
  rc = net_reg_mr_dmabuf(c->send, b.base, 1024, PRISM_PTR_CUDA, &mh);
  CHECK(rc == PRISM_ERR_INTERNAL && mh == NULL, "regMrDmaBuf(NCCL_PTR_CUDA) returned %d (want %d)", rc, PRISM_ERR_INTERNAL);
  calls++;
  rc = net_reg_mr_dmabuf(c->send, b.base, 1024, PRISM_PTR_HOST, &mh);
  CHECK(rc == PRISM_OK && mh != NULL, "regMrDmaBuf(NCCL_PTR_HOST) returned %d", rc);
  CHECK(net_dereg_mr(c->send, mh) == PRISM_OK, "deregMr of a dma-buf registration failed");
  CHECK(net_dereg_mr(c->send, NULL) == PRISM_OK, "deregMr(comm, NULL) failed");
  CHECK(net_reg_mr(fake_mh, b.base, 1024, PRISM_PTR_HOST, &mh) != PRISM_OK && mh == NULL, "regMr on a foreign comm succeeded");
  calls++;
  int done = 7;
  CHECK(net_test(fake_mh, &done, NULL) != PRISM_OK, "test of a foreign request succeeded");
  calls++;
  CHECK(g_log_warns >= warns + calls, "%d refused calls logged only %d WARN line(s)", calls, g_log_warns - warns);
  if (buf_free(c->recv, &b)) return -1;
  SAY("errors: ok (%d bad calls refused with a code and a WARN each: n = 0, n = 9, buffer outside its mhandle, foreign "
      "mhandle/comm/request, isend on a recv comm, NULL data, CUDA regMr/regMrDmaBuf = %d)", calls, PRISM_ERR_INTERNAL);
  return 0;
}

/* A send larger than the posted receive fails (both requests, code 5), nothing hangs, nothing is
 * written past the posted size. Runs on its own connection, which is then closed. */
static int scenario_truncation(void* ctx) {
  comms_t t;
  if (connect_pair(ctx, "truncation: connect", &t)) return -1;
  buf_t sb, rb;
  if (buf_alloc(&sb, t.send, 10000, 0) || buf_alloc(&rb, t.recv, 4096, UNTOUCHED_BYTE)) return -1;
  fill_pattern(sb.base, 10000, msg_seed(g_rank, SC_TRUNC, 0));
  op_t ops[2];
  int tag = 0;
  send_op(&ops[0], t.send, &sb, 10000, 0);
  recv_op(&ops[1], t.recv, 1, &rb, &tag);
  int warns = g_log_warns;
  if (run_ops("truncation", ops, 2, 0)) return -1;
  CHECK(ops[0].state == FAILED && ops[1].state == FAILED,
        "truncation: 10000-byte send into a 4096-byte receive: send %s (rc %d), recv %s (rc %d); both must fail",
        ops[0].state == DONE ? "done" : "failed", ops[0].rc, ops[1].state == DONE ? "done" : "failed", ops[1].rc);
  CHECK(ops[0].rc == PRISM_ERR_INVALID_USAGE && ops[1].rc == PRISM_ERR_INVALID_USAGE,
        "truncation: send rc %d, recv rc %d (want %d, invalid usage)", ops[0].rc, ops[1].rc, PRISM_ERR_INVALID_USAGE);
  CHECK(g_log_warns >= warns + 2, "truncation: the failures were not logged");
  size_t bad = check_bytes(rb.base + rb.size, CANARY, CANARY_BYTE);
  CHECK(bad == SIZE_MAX, "truncation: canary byte %zu after the 4096-byte receive was overwritten", bad);
  if (buf_free(t.send, &sb) || buf_free(t.recv, &rb)) return -1;
  if (close_pair("truncation: close", &t)) return -1;
  SAY("truncation: ok (send and receive failed with %d, canary intact, connection closed)", PRISM_ERR_INVALID_USAGE);
  return 0;
}

/* Closing comms with requests in flight must not crash (NCCL never tests them again). */
static int scenario_inflight_close(void* ctx) {
  comms_t t;
  if (connect_pair(ctx, "inflight-close: connect", &t)) return -1;
  enum { N = 4 };
  buf_t sb[N], rb[N];
  for (int i = 0; i < N; i++) {
    if (buf_alloc(&sb[i], t.send, 1 * MIB, 0) || buf_alloc(&rb[i], t.recv, 2 * MIB, UNTOUCHED_BYTE)) return -1;
    fill_pattern(sb[i].base, 1 * MIB, msg_seed(g_rank, SC_CLOSE, i));
  }
  /* Receives for all four, sends for only two: whatever the timing, something is in flight at close. */
  int posted = 0;
  for (int i = 0; i < N; i++) {
    void* req = NULL;
    int tag = 0;
    size_t sz = rb[i].size;
    void* d = rb[i].base;
    prism_result_t rc = net_irecv(t.recv, 1, &d, &sz, &tag, &rb[i].mh, &req);
    CHECK(rc == PRISM_OK, "inflight-close: irecv returned %d", rc);
    posted += req != NULL;
    if (i < 2) {
      req = NULL;
      rc = net_isend(t.send, sb[i].base, 1 * MIB, 0, sb[i].mh, &req);
      CHECK(rc == PRISM_OK, "inflight-close: isend returned %d", rc);
      posted += req != NULL;
    }
  }
  /* Both ranks have posted before either closes: a peer's close makes later posts fail, rightly. */
  barrier("inflight-close: close");
  if (close_pair("inflight-close: close", &t)) return -1;
  /* Deregistering after close is what NCCL does on teardown too. */
  for (int i = 0; i < N; i++) {
    CHECK(net_dereg_mr(NULL, sb[i].mh) == PRISM_OK && net_dereg_mr(NULL, rb[i].mh) == PRISM_OK, "inflight-close: deregMr failed");
    free(sb[i].base);
    free(rb[i].base);
  }
  SAY("inflight-close: ok (closed both comms with %d requests posted and untested)", posted);
  return 0;
}

/* v11/v12: finalize the last context (the engine goes away), init again, and use the new engine. */
static int scenario_reinit(void** ctx) {
  prism_result_t rc = net_finalize(*ctx);
  CHECK(rc == PRISM_OK, "reinit: finalize returned %d", rc);
  *ctx = NULL;
  rc = net_init(ctx, 0xC0FFEE + (uint64_t)g_rank);
  CHECK(rc == PRISM_OK && *ctx != NULL, "reinit: init after finalize returned %d, ctx %p", rc, *ctx);
  int ndev = 0;
  CHECK(net_devices(&ndev) == PRISM_OK && ndev >= 1, "reinit: devices after re-init returned %d devices", ndev);
  comms_t t;
  if (connect_pair(*ctx, "reinit: connect", &t)) return -1;
  buf_t sb, rb;
  if (buf_alloc(&sb, t.send, 1 * MIB, 0) || buf_alloc(&rb, t.recv, 1 * MIB, UNTOUCHED_BYTE)) return -1;
  fill_pattern(sb.base, 1 * MIB, msg_seed(g_rank, SC_REINIT, 0));
  op_t ops[2];
  int tag = 0;
  send_op(&ops[0], t.send, &sb, 1 * MIB, 0);
  recv_op(&ops[1], t.recv, 1, &rb, &tag);
  if (run_ops("reinit", ops, 2, 0)) return -1;
  CHECK(ops[0].state == DONE && ops[1].state == DONE, "reinit: send rc %d recv rc %d", ops[0].rc, ops[1].rc);
  if (verify_recv("reinit", &rb, 1 * MIB, msg_seed(1 - g_rank, SC_REINIT, 0), ops[1].got[0])) return -1;
  if (buf_free(t.send, &sb) || buf_free(t.recv, &rb)) return -1;
  if (close_pair("reinit: close", &t)) return -1;
  SAY("reinit: ok (finalize of the last context, init again, 1 MiB each way on the new engine)");
  return 0;
}

/* ------------------------------------------------------------------ process bookkeeping */

static int count_dir(const char* path) {
  DIR* d = opendir(path);
  if (d == NULL) return -1;
  int n = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* Whether a file with this inode is still mapped into the process. */
static int still_mapped(const char* so_path) {
  char real[PATH_MAX];
  if (realpath(so_path, real) == NULL) return 0;
  FILE* f = fopen("/proc/self/maps", "r");
  if (f == NULL) return 0;
  char line[PATH_MAX + 256];
  int found = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, real)) found = 1;
  fclose(f);
  return found;
}

static int run_rank(const char* so_path) {
  int tasks_before = count_dir("/proc/self/task");
  void* lib = dlopen(so_path, RTLD_NOW | RTLD_LOCAL);
  CHECK(lib != NULL, "dlopen(%s, RTLD_NOW): %s", so_path, dlerror());
  char sym[32];
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", g_version);
  g_net.any = dlsym(lib, sym);
  CHECK(g_net.any != NULL, "dlsym(%s): %s", sym, dlerror());
  CHECK(net_name() != NULL && strcmp(net_name(), "Prism") == 0, "%s name is \"%s\"", sym, net_name() ? net_name() : "(null)");

  void* ctx = NULL;
  void* ctx2 = NULL;
  prism_result_t rc = net_init(&ctx, 0xA000 + (uint64_t)g_rank);
  CHECK(rc == PRISM_OK, "init returned %d", rc);
  if (g_version >= 11) {
    CHECK(ctx != NULL, "init returned a NULL context");
    /* A second communicator shares the engine; finalizing it must leave the first one working. */
    rc = net_init(&ctx2, 0xB000 + (uint64_t)g_rank);
    CHECK(rc == PRISM_OK && ctx2 != NULL && ctx2 != ctx, "second init returned %d, ctx %p", rc, ctx2);
  }
  SAY("init: ok");
  if (scenario_properties()) return -1;
  if (g_version >= 11) {
    CHECK(net_finalize(ctx2) == PRISM_OK, "finalize of the second context failed");
    int ndev = 0;
    CHECK(net_devices(&ndev) == PRISM_OK && ndev >= 1, "devices failed after finalizing one of two contexts");
    SAY("contexts: ok (two inits share one engine; finalizing one leaves the other working)");
  }
  barrier("connect");

  comms_t c;
  if (connect_pair(ctx, "connect", &c)) return -1;
  int tasks_open = count_dir("/proc/self/task");
  barrier("sizes");
  if (scenario_sizes(&c)) return -1;
  barrier("inflight");
  if (scenario_inflight(&c)) return -1;
  barrier("grouped");
  if (scenario_grouped(&c)) return -1;
  barrier("larger-recv");
  if (scenario_larger_recv(&c)) return -1;
  barrier("hint");
  if (scenario_hint_and_flush(&c)) return -1;
  barrier("bidir");
  if (scenario_bidir(&c)) return -1;
  barrier("errors");
  if (scenario_errors(&c)) return -1;
  barrier("close");
  if (close_pair("close", &c)) return -1;
  SAY("close: ok (every mhandle deregistered, closeSend and closeRecv returned 0)");
  barrier("truncation");
  if (scenario_truncation(ctx)) return -1;
  barrier("inflight-close");
  if (scenario_inflight_close(ctx)) return -1;
  if (g_version >= 11) {
    barrier("reinit");
    if (scenario_reinit(&ctx)) return -1;
    CHECK(net_finalize(ctx) == PRISM_OK, "final finalize failed");
  }
  barrier("unload");
  CHECK(g_log_bad_fmt == 0, "the plugin called the logger %d time(s) with a format other than \"%%s\"", g_log_bad_fmt);
  g_net.any = NULL;
  CHECK(dlclose(lib) == 0, "dlclose: %s", dlerror());
  int tasks_after = count_dir("/proc/self/task");
  CHECK(tasks_after == tasks_before, "%d thread(s) before dlopen, %d after dlclose: the plugin left threads running",
        tasks_before, tasks_after);
  SAY("unload: ok (threads: %d before dlopen, %d with comms open, %d after close and dlclose; library %s; logger called "
      "%d times, always with \"%%s\")", tasks_before, tasks_open, tasks_after,
      still_mapped(so_path) ? "still mapped (TLS destructors pin it)" : "unmapped", g_log_calls);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4 || (strcmp(argv[1], "v9") && strcmp(argv[1], "v10") && strcmp(argv[1], "v11") &&
                               strcmp(argv[1], "v12"))) {
    fprintf(stderr, "usage: %s <v9|v10|v11|v12> <plugin .so> [seed]\n", argv[0]);
    return 2;
  }
  g_version = atoi(argv[1] + 1);
  if (argc == 4) g_seed = strtoull(argv[3], NULL, 0);
  const char* t = getenv("PROXY_TEST_TIMEOUT_S");
  if (t) g_timeout_s = atof(t);
  g_verbose = getenv("PROXY_TEST_VERBOSE") != NULL;
  setvbuf(stdout, NULL, _IOLBF, 0);

  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    perror("socketpair");
    return 2;
  }
  fflush(NULL);
  pid_t child = fork();
  if (child < 0) {
    perror("fork");
    return 2;
  }
  g_rank = child == 0 ? 1 : 0;
  g_peer_fd = sv[g_rank];
  close(sv[1 - g_rank]);
  /* Last resort: a rank stuck outside every timed loop still ends. */
  alarm((unsigned)(g_timeout_s * 4 + 60));
  if (g_rank == 0) printf("[v%d] seed %#llx (rerun: %s %s %s %#llx)\n", g_version, (unsigned long long)g_seed, argv[0],
                          argv[1], argv[2], (unsigned long long)g_seed);

  int ok = run_rank(argv[2]) == 0 && g_failures == 0;
  if (g_rank == 1) {
    fflush(NULL);
    exit(ok ? 0 : 1); /* exit, not _exit: the plugin's unload hook must run as in any process */
  }
  close(g_peer_fd); /* wakes a child blocked on the channel if this rank failed early */
  int status = 0;
  waitpid(child, &status, 0);
  int child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!child_ok) {
    if (WIFSIGNALED(status))
      printf("[v%d] rank1 killed by signal %d\n", g_version, WTERMSIG(status));
    else
      printf("[v%d] rank1 exited with %d\n", g_version, WEXITSTATUS(status));
  }
  printf("[v%d] %s (seed %#llx)\n", g_version, ok && child_ok ? "PASS" : "FAIL", (unsigned long long)g_seed);
  return ok && child_ok ? 0 : 1;
}
