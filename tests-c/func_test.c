/*
 * func_test.c: a functional suite for an NCCL net plugin in the style of an MPI-driven third-party suite,
 * played against libnccl-net-prism.so through its C ABI (dlopened by examples/csrc/netshim.c).
 *
 * Usage: func_test <v9|v10|v11|v12> <plugin .so> [case ...]
 *
 * Every case runs in freshly fork()ed ranks (2, or 4 for the ring and listen reuse) that each dlopen the
 * plugin, init it, run the case and finalize. The parent process never loads the plugin: it is the
 * rendezvous (an allgather of listen handles and barriers over one socketpair per rank, like
 * MPI_Allgather/MPI_Barrier) and the referee: each rank reports its result, and a case that does not end
 * within its budget is reported as FAIL and its ranks are killed by PID. Every wait inside a rank is bounded
 * too (FUNC_TEST_WAIT_S, default 30 s), so a deadlock is a FAIL naming the requests still pending.
 * Every received byte is checked against a pattern seeded by (seed, case, sender, message), as is the
 * untouched tail of a larger receive buffer and a canary after each buffer.
 *
 * One line per case, "name: ok" or "name: FAIL <why>", then "func: N passed, M failed"; the exit status
 * is non-zero if anything failed. Environment: FUNC_TEST_SEED, FUNC_TEST_WAIT_S, FUNC_TEST_CASE_S (the
 * budget of a whole case), FUNC_TEST_VERBOSE (plugin INFO lines). The program sets PRISM_IFNAMES for each
 * case: "lo", and for device-pairs two devices, FUNC_TEST_IFNAMES2 (default "lo,lo").
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../examples/csrc/netshim.h"
#include "prism_net.h"

#define MIB (1024 * 1024)
#define HANDLE PRISM_NET_HANDLE_MAXSIZE
#define MAX_RANKS 4
#define MAX_GROUP 8
#define NTHREADS 4
#define CANARY 64
#define CANARY_BYTE 0xC5
#define UNTOUCHED 0xEE

/* ------------------------------------------------------------------ configuration and clocks */

static int g_version;
static const char* g_plugin;
static uint64_t g_seed = 0xF00D;
static double g_wait_s = 30.0;
static double g_case_s = 0; /* 0: derived from g_wait_s */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------ rank state and failure reporting */

static int g_rank, g_nranks;
static int g_hub = -1;                 /* socketpair to the parent */
static int g_peer_chan[NTHREADS];      /* rank 0 <-> rank 1, one channel per thread (-1 elsewhere) */
static shim_t* g_shim;
static int g_case;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_why[1024];               /* the first failure of this rank */
static _Thread_local const char* t_who = "main";

#define LOG(...)                                                      \
  do {                                                                \
    char m_[768];                                                     \
    snprintf(m_, sizeof m_, __VA_ARGS__);                             \
    printf("  [v%d rank%d %s] %s\n", g_version, g_rank, t_who, m_);   \
    fflush(stdout);                                                   \
  } while (0)

static void set_failure(const char* fmt, ...) {
  char m[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&g_lock);
  if (g_why[0] == '\0') snprintf(g_why, sizeof g_why, "rank %d %s: %s", g_rank, t_who, m);
  pthread_mutex_unlock(&g_lock);
  printf("  [v%d rank%d %s] FAIL: %s\n", g_version, g_rank, t_who, m);
  fflush(stdout);
}

#define REQUIRE(cond, ...)    \
  do {                        \
    if (!(cond)) {            \
      set_failure(__VA_ARGS__); \
      return -1;              \
    }                         \
  } while (0)

/* ------------------------------------------------------------------ byte channels with deadlines */

static int fd_write(int fd, const void* buf, size_t n, double deadline) {
  const char* p = buf;
  while (n > 0) {
    struct pollfd pf = {fd, POLLOUT, 0};
    int ms = (int)((deadline - now_s()) * 1000);
    if (ms <= 0) return -1;
    int r = poll(&pf, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

static int fd_read(int fd, void* buf, size_t n, double deadline) {
  char* p = buf;
  while (n > 0) {
    struct pollfd pf = {fd, POLLIN, 0};
    int ms = (int)((deadline - now_s()) * 1000);
    if (ms <= 0) return -1;
    int r = poll(&pf, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    ssize_t k = read(fd, p, n);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* Frames between a rank and the parent: {type, len} then len bytes. */
enum { F_GATHER = 1, F_RESULT = 2, F_ABORT = 3 };
typedef struct {
  uint32_t type, len;
} frame_t;

/* MPI_Allgather over the parent: every rank contributes `len` bytes; `all` gets nranks * len, by rank.
 * A rank that is gone makes the parent answer F_ABORT; this rank then fails too. */
static int allgather(const char* what, const void* mine, size_t len, void* all) {
  double deadline = now_s() + g_wait_s * 4;
  frame_t f = {F_GATHER, (uint32_t)len};
  REQUIRE(fd_write(g_hub, &f, sizeof f, deadline) == 0 && fd_write(g_hub, mine, len, deadline) == 0,
          "%s: cannot reach the rendezvous", what);
  frame_t r;
  REQUIRE(fd_read(g_hub, &r, sizeof r, deadline) == 0, "%s: no answer from the rendezvous within %.0f s", what,
          g_wait_s * 4);
  REQUIRE(r.type != F_ABORT, "%s: another rank failed or exited before reaching this point", what);
  REQUIRE(r.type == F_GATHER && r.len == len * (size_t)g_nranks, "%s: bad rendezvous answer", what);
  REQUIRE(fd_read(g_hub, all, r.len, deadline) == 0, "%s: rendezvous answer cut short", what);
  return 0;
}

static int barrier(const char* what) {
  int32_t mine = g_why[0] != '\0', all[MAX_RANKS];
  if (allgather(what, &mine, sizeof mine, all)) return -1;
  for (int r = 0; r < g_nranks; r++) REQUIRE(all[r] == 0, "%s: rank %d failed before this point", what, r);
  return 0;
}

/* Rank 0 thread t <-> rank 1 thread t: a handle or a one-byte barrier. */
static int chan_swap(int t, const char* what, const void* mine, void* theirs, size_t len) {
  double deadline = now_s() + g_wait_s * 2;
  REQUIRE(fd_write(g_peer_chan[t], mine, len, deadline) == 0, "%s: the peer thread is gone", what);
  REQUIRE(fd_read(g_peer_chan[t], theirs, len, deadline) == 0, "%s: the peer thread did not arrive within %.0f s",
          what, g_wait_s * 2);
  return 0;
}

static int chan_barrier(int t, const char* what) {
  char a = 1, b = 0;
  return chan_swap(t, what, &a, &b, 1);
}

/* ------------------------------------------------------------------ patterns */

static uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/* The seed of message `msg` sent by `sender` in the current case (`sub` tells sub-runs apart). */
static uint64_t seed_of(int sender, int sub, int msg) {
  return mix64(g_seed ^ mix64(((uint64_t)g_case << 56) ^ ((uint64_t)sender << 48) ^ ((uint64_t)sub << 24) ^
                              (uint64_t)(uint32_t)msg));
}

static void fill(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t off = 0; off < n; off += 8) {
    uint64_t w = mix64(seed ^ (off >> 3) * 0xD6E8FEB86659FD93ULL);
    for (size_t i = 0; i < 8 && off + i < n; i++) p[off + i] = (uint8_t)(w >> (8 * i));
  }
}

/* First offset that differs from the pattern, or SIZE_MAX. */
static size_t mismatch(const uint8_t* p, size_t n, uint64_t seed) {
  for (size_t off = 0; off < n; off += 8) {
    uint64_t w = mix64(seed ^ (off >> 3) * 0xD6E8FEB86659FD93ULL);
    for (size_t i = 0; i < 8 && off + i < n; i++)
      if (p[off + i] != (uint8_t)(w >> (8 * i))) return off + i;
  }
  return SIZE_MAX;
}

/* ------------------------------------------------------------------ buffers */

typedef struct {
  uint8_t* base;
  size_t size;
  void* mh;
  void* comm;
} buf_t;

static int buf_new(buf_t* b, void* comm, size_t size, uint8_t fill_byte) {
  b->size = size;
  b->comm = comm;
  b->mh = NULL;
  b->base = malloc(size + CANARY);
  REQUIRE(b->base != NULL, "malloc(%zu) failed", size + CANARY);
  memset(b->base, fill_byte, size);
  memset(b->base + size, CANARY_BYTE, CANARY);
  int rc = shim_reg_mr(g_shim, comm, b->base, size + CANARY, &b->mh);
  REQUIRE(rc == 0 && b->mh != NULL, "regMr(%zu bytes) returned %d", size + CANARY, rc);
  return 0;
}

static int buf_send(buf_t* b, void* comm, size_t size, uint64_t seed) {
  if (buf_new(b, comm, size, 0)) return -1;
  fill(b->base, size, seed);
  return 0;
}

static int buf_free(buf_t* b) {
  if (b->base == NULL) return 0;
  int rc = b->mh ? shim_dereg_mr(g_shim, b->comm, b->mh) : 0;
  free(b->base);
  b->base = NULL;
  REQUIRE(rc == 0, "deregMr returned %d", rc);
  return 0;
}

/* A receive buffer after a message of `sent` bytes with `seed`, of which test() reported `got`. */
static int verify(const char* what, const buf_t* b, size_t sent, uint64_t seed, int got) {
  REQUIRE(got >= 0 && (size_t)got == sent, "%s: test() reported %d bytes, the peer sent %zu", what, got, sent);
  size_t bad = mismatch(b->base, sent, seed);
  REQUIRE(bad == SIZE_MAX, "%s: byte %zu of the %zu-byte message is wrong (0x%02x)", what, bad, sent, b->base[bad]);
  for (size_t i = sent; i < b->size; i++)
    REQUIRE(b->base[i] == UNTOUCHED, "%s: byte %zu past the %zu-byte message in a %zu-byte buffer was written", what,
            i, sent, b->size);
  for (size_t i = 0; i < CANARY; i++)
    REQUIRE(b->base[b->size + i] == CANARY_BYTE, "%s: canary byte %zu after the %zu-byte buffer was written", what,
            i, b->size);
  return 0;
}

/* ------------------------------------------------------------------ requests */

typedef struct {
  int is_send;
  void* comm;
  int n;
  void* data[MAX_GROUP];
  size_t sizes[MAX_GROUP];
  int tags[MAX_GROUP];
  void* mh[MAX_GROUP];
  void* req;
  enum { UNPOSTED, POSTED, DONE, FAILED } state;
  int rc;
  int got[MAX_GROUP];
  long nulls;
} op_t;

static void op_send(op_t* op, void* comm, const buf_t* b, size_t size, int tag) {
  memset(op, 0, sizeof *op);
  op->is_send = 1;
  op->comm = comm;
  op->n = 1;
  op->data[0] = b->base;
  op->mh[0] = b->mh;
  op->sizes[0] = size;
  op->tags[0] = tag;
}

static void op_recv(op_t* op, void* comm, int n, buf_t* bufs, const int* tags) {
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

static void op_post(op_t* op) {
  void* req = NULL;
  int rc = op->is_send ? shim_isend(g_shim, op->comm, op->data[0], op->sizes[0], op->tags[0], op->mh[0], &req)
                       : shim_irecv_n(g_shim, op->comm, op->n, op->data, op->sizes, op->tags, op->mh, &req);
  if (rc != 0) {
    op->state = FAILED;
    op->rc = rc;
  } else if (req == NULL) {
    op->nulls++;
  } else {
    op->req = req;
    op->state = POSTED;
  }
}

/* Posts sends and receives in order (each its own FIFO, as NCCL's proxy posts them: the next one only
 * after the previous one got a request), retrying NULL requests, and tests every posted request until all
 * are done, one fails, or `g_wait_s` passes. */
static int run_ops(const char* what, op_t* ops, int nops) {
  double t0 = now_s();
  for (;;) {
    for (int kind = 0; kind < 2; kind++)
      for (int i = 0; i < nops; i++) {
        if (ops[i].is_send != kind || ops[i].state != UNPOSTED) continue;
        op_post(&ops[i]);
        if (ops[i].state == UNPOSTED) break;
      }
    int pending = 0;
    for (int i = 0; i < nops; i++) {
      op_t* op = &ops[i];
      if (op->state == POSTED) {
        int done = 0, sizes[MAX_GROUP];
        int rc = shim_test_n(g_shim, op->req, &done, sizes, op->n);
        if (rc != 0) {
          op->state = FAILED;
          op->rc = rc;
        } else if (done) {
          op->state = DONE;
          for (int k = 0; k < op->n; k++) op->got[k] = sizes[k];
        }
      }
      if (op->state == FAILED)
        REQUIRE(0, "%s: %s #%d (tag %d, %zu bytes) failed: %s returned %d", what, op->is_send ? "send" : "recv", i,
                op->tags[0], op->sizes[0], op->req ? "test" : op->is_send ? "isend" : "irecv", op->rc);
      if (op->state == UNPOSTED || op->state == POSTED) pending++;
    }
    if (pending == 0) return 0;
    if (now_s() - t0 > g_wait_s) {
      char list[512] = "";
      size_t len = 0;
      int shown = 0;
      for (int i = 0; i < nops && len < sizeof list - 64; i++) {
        if (ops[i].state != UNPOSTED && ops[i].state != POSTED) continue;
        if (shown++ == 8) {
          len += (size_t)snprintf(list + len, sizeof list - len, " ...");
          break;
        }
        len += (size_t)snprintf(list + len, sizeof list - len, " %s#%d(tag %d)%s", ops[i].is_send ? "send" : "recv",
                                i, ops[i].tags[0],
                                ops[i].state == UNPOSTED ? " never accepted (NULL request every time)"
                                                         : " posted, never done");
      }
      REQUIRE(0, "%s: %d of %d requests pending after %.0f s (deadlock):%s", what, pending, nops, g_wait_s, list);
    }
  }
}

/* ------------------------------------------------------------------ connections */

static int do_listen(int dev, char* handle, void** lcomm, const char* what) {
  memset(handle, 0, HANDLE);
  int rc = shim_listen(g_shim, dev, handle, lcomm);
  REQUIRE(rc == 0 && *lcomm != NULL, "%s: listen(dev %d) returned %d", what, dev, rc);
  return 0;
}

/* The non-blocking connect and accept loops of NCCL's proxy, interleaved; either side may be NULL. */
static int connect_accept(int dev, const char* handle, void** scomm, void* lcomm, void** rcomm, const char* what) {
  char h[HANDLE];
  if (handle) memcpy(h, handle, HANDLE);
  if (scomm) *scomm = NULL;
  if (rcomm) *rcomm = NULL;
  double t0 = now_s();
  while ((scomm && *scomm == NULL) || (rcomm && *rcomm == NULL)) {
    if (scomm && *scomm == NULL) {
      int rc = shim_connect(g_shim, dev, h, scomm);
      REQUIRE(rc == 0, "%s: connect(dev %d) returned %d", what, dev, rc);
    }
    if (rcomm && *rcomm == NULL) {
      int rc = shim_accept(g_shim, lcomm, rcomm);
      REQUIRE(rc == 0, "%s: accept returned %d", what, rc);
    }
    REQUIRE(now_s() - t0 < g_wait_s, "%s: no connection after %.0f s (send comm %s, recv comm %s)", what, g_wait_s,
            scomm ? (*scomm ? "up" : "pending") : "-", rcomm ? (*rcomm ? "up" : "pending") : "-");
    if ((scomm && *scomm == NULL) || (rcomm && *rcomm == NULL)) sleep_ms(1);
  }
  return 0;
}

/* Every rank listens on `dev`, handles are allgathered, each rank connects to rank `to` and accepts one
 * connection (from whichever rank connects to it); to < 0: no connect, accept_from_n accepts. */
typedef struct {
  void* send;
  void* recv;
} pair_t;

static int close_pair(pair_t* p, const char* what) {
  int a = p->send ? shim_close_send(g_shim, p->send) : 0;
  int b = p->recv ? shim_close_recv(g_shim, p->recv) : 0;
  p->send = p->recv = NULL;
  REQUIRE(a == 0 && b == 0, "%s: closeSend returned %d, closeRecv %d", what, a, b);
  return 0;
}

/* Rank r connects to rank `to` and accepts from rank `from` (the ring; with 2 ranks, both are the peer). */
static int wire_ring(int to, pair_t* p, const char* what) {
  char mine[HANDLE], all[MAX_RANKS * HANDLE];
  void* lcomm = NULL;
  if (do_listen(0, mine, &lcomm, what)) return -1;
  if (allgather(what, mine, HANDLE, all)) return -1;
  if (connect_accept(0, all + to * HANDLE, &p->send, lcomm, &p->recv, what)) return -1;
  int rc = shim_close_listen(g_shim, lcomm);
  REQUIRE(rc == 0, "%s: closeListen returned %d", what, rc);
  return 0;
}

/* One message each way on `p` (send to the peer, receive from the peer), checked. */
static int exchange(pair_t* p, int from, size_t size, size_t recv_size, int sub, int msg, const char* what) {
  buf_t sb, rb;
  if (buf_send(&sb, p->send, size, seed_of(g_rank, sub, msg)) || buf_new(&rb, p->recv, recv_size, UNTOUCHED))
    return -1;
  op_t ops[2];
  int tag = 0;
  op_send(&ops[0], p->send, &sb, size, 0);
  op_recv(&ops[1], p->recv, 1, &rb, &tag);
  if (run_ops(what, ops, 2)) return -1;
  if (verify(what, &rb, size, seed_of(from, sub, msg), ops[1].got[0])) return -1;
  if (buf_free(&sb) || buf_free(&rb)) return -1;
  return 0;
}

/* ------------------------------------------------------------------ case 1: every device pair */

static int case_device_pairs(void) {
  int ndev = 0;
  REQUIRE(shim_devices(g_shim, &ndev) == 0, "devices() failed");
  REQUIRE(ndev >= 2, "%d device(s): this case needs two (PRISM_IFNAMES=lo,lo)", ndev);
  char names[2][64];
  for (int d = 0; d < ndev; d++) {
    shim_props_t pr;
    REQUIRE(shim_get_props(g_shim, d, &pr) == 0, "getProperties(%d) failed", d);
    if (g_rank == 0) LOG("device %d: name \"%s\", maxComms %d, maxRecvs %d", d, pr.name, pr.max_comms, pr.max_recvs);
    snprintf(names[d < 2 ? d : 1], sizeof names[0], "%s", pr.name);
  }
  /* NCCL tells devices apart by name; not a failure of this case, but worth seeing. */
  if (g_rank == 0 && strcmp(names[0], names[1]) == 0) LOG("note: devices 0 and 1 share the name \"%s\"", names[0]);
  /* Each rank listens once per device; every (local device, peer listen device) pair is connected both ways,
   * one pair at a time, each listen comm accepting once per local device of the peer. */
  void* lcomm[2];
  char mine[2 * HANDLE], all[MAX_RANKS * 2 * HANDLE];
  for (int d = 0; d < 2; d++)
    if (do_listen(d, mine + d * HANDLE, &lcomm[d], "device-pairs: listen")) return -1;
  if (allgather("device-pairs: handles", mine, sizeof mine, all)) return -1;
  const char* peer = all + (1 - g_rank) * 2 * HANDLE;
  int pairs = 0;
  for (int sd = 0; sd < 2; sd++)
    for (int ld = 0; ld < 2; ld++) {
      char what[96];
      snprintf(what, sizeof what, "device-pairs: dev %d -> peer listen dev %d", sd, ld);
      pair_t p;
      /* Both ranks connect from device sd to the peer's listener on device ld; each accepts on its ld. */
      if (connect_accept(sd, peer + ld * HANDLE, &p.send, lcomm[ld], &p.recv, what)) return -1;
      if (exchange(&p, 1 - g_rank, 4096 + 17 * (size_t)(sd * 2 + ld), 4096 + 64, sd * 2 + ld, 0, what)) return -1;
      if (close_pair(&p, what)) return -1;
      pairs++;
    }
  for (int d = 0; d < 2; d++) REQUIRE(shim_close_listen(g_shim, lcomm[d]) == 0, "device-pairs: closeListen failed");
  LOG("device-pairs: %d pairs, one message each way on each", pairs);
  return 0;
}

/* ------------------------------------------------------------------ case 2: many sizes */

static int case_sizes(void) {
  static const size_t sizes[] = {0, 1, 2, 127, 128, 129, 4095, 4096, 65535, 65536, MIB + 3, 16 * MIB, 64 * MIB};
  const int nsizes = (int)(sizeof sizes / sizeof sizes[0]);
  pair_t p;
  if (wire_ring(1 - g_rank, &p, "sizes: connect")) return -1;
  int msg = 0;
  for (int i = 0; i < nsizes; i++)
    for (int larger = 0; larger < 2; larger++) {
      size_t s = sizes[i];
      if (s == 64 * MIB && larger) continue; /* 64 MiB once */
      size_t rs = larger ? 2 * s + 64 : s;
      char what[96];
      snprintf(what, sizeof what, "sizes: %zu bytes into a %zu-byte buffer", s, rs);
      if (exchange(&p, 1 - g_rank, s, rs, 0, msg++, what)) return -1;
    }
  if (close_pair(&p, "sizes: close")) return -1;
  LOG("sizes: %d messages each way, receive buffers equal to and larger than the send", msg);
  return 0;
}

/* ------------------------------------------------------------------ case 3: a ring of 4 */

static int case_ring(void) {
  static const size_t sizes[] = {1, 4096, 65536 + 7, MIB, 4 * MIB + 1};
  const int nsizes = (int)(sizeof sizes / sizeof sizes[0]);
  const int iters = 3;
  int next = (g_rank + 1) % g_nranks, prev = (g_rank + g_nranks - 1) % g_nranks;
  pair_t p;
  if (wire_ring(next, &p, "ring: connect")) return -1;
  int msg = 0;
  for (int it = 0; it < iters; it++)
    for (int i = 0; i < nsizes; i++) {
      char what[96];
      snprintf(what, sizeof what, "ring: iteration %d, %zu bytes to rank %d", it, sizes[i], next);
      if (exchange(&p, prev, sizes[i], sizes[i], 0, msg++, what)) return -1;
    }
  if (close_pair(&p, "ring: close")) return -1;
  LOG("ring: %d messages sent to rank %d and received from rank %d", msg, next, prev);
  return 0;
}

/* ------------------------------------------------------------------ case 4: listen-comm reuse */

/* Which of the candidate senders' seeds the message matches, or -1. */
static int identify(const buf_t* b, size_t size, int got, int sub, int msg) {
  if (got < 0 || (size_t)got != size) return -1;
  for (int r = 0; r < g_nranks; r++)
    if (mismatch(b->base, size, seed_of(r, sub, msg)) == SIZE_MAX) return r;
  return -1;
}

static int case_listen_reuse(void) {
  const size_t size = 65536 + 5;
  const int sequential = 3;
  /* Part 1: ranks 1..3 connect at once to rank 0's one listen comm. */
  char mine[HANDLE], all[MAX_RANKS * HANDLE];
  void* lcomm = NULL;
  if (g_rank == 0 && do_listen(0, mine, &lcomm, "listen-reuse: listen")) return -1;
  if (g_rank != 0) memset(mine, 0, sizeof mine);
  if (allgather("listen-reuse: handles", mine, HANDLE, all)) return -1;
  if (g_rank == 0) {
    void* rc[MAX_RANKS] = {NULL};
    int seen[MAX_RANKS] = {0};
    for (int i = 1; i < g_nranks; i++)
      if (connect_accept(0, NULL, NULL, lcomm, &rc[i], "listen-reuse: accept from several ranks")) return -1;
    for (int i = 1; i < g_nranks; i++) {
      buf_t rb;
      if (buf_new(&rb, rc[i], size, UNTOUCHED)) return -1;
      op_t op;
      int tag = 0;
      op_recv(&op, rc[i], 1, &rb, &tag);
      if (run_ops("listen-reuse: receive from several ranks", &op, 1)) return -1;
      int who = identify(&rb, size, op.got[0], 0, 0);
      REQUIRE(who > 0 && !seen[who], "listen-reuse: connection %d carried a message from no expected rank (or twice)",
              i);
      seen[who] = 1;
      if (verify("listen-reuse: several ranks", &rb, size, seed_of(who, 0, 0), op.got[0]) || buf_free(&rb)) return -1;
      REQUIRE(shim_close_recv(g_shim, rc[i]) == 0, "listen-reuse: closeRecv failed");
    }
  } else {
    pair_t p = {NULL, NULL};
    if (connect_accept(0, all, &p.send, NULL, NULL, "listen-reuse: connect to rank 0")) return -1;
    buf_t sb;
    if (buf_send(&sb, p.send, size, seed_of(g_rank, 0, 0))) return -1;
    op_t op;
    op_send(&op, p.send, &sb, size, 0);
    if (run_ops("listen-reuse: send to rank 0", &op, 1) || buf_free(&sb) || close_pair(&p, "listen-reuse: close"))
      return -1;
  }
  if (barrier("listen-reuse: sequential")) return -1;
  /* Part 2: rank 1 connects again and again to the same listen comm, one connection at a time. */
  for (int k = 0; k < sequential; k++) {
    char what[80];
    snprintf(what, sizeof what, "listen-reuse: sequential connect %d", k + 1);
    if (g_rank == 0) {
      void* rcomm = NULL;
      if (connect_accept(0, NULL, NULL, lcomm, &rcomm, what)) return -1;
      buf_t rb;
      if (buf_new(&rb, rcomm, size, UNTOUCHED)) return -1;
      op_t op;
      int tag = 0;
      op_recv(&op, rcomm, 1, &rb, &tag);
      if (run_ops(what, &op, 1) || verify(what, &rb, size, seed_of(1, 1, k), op.got[0]) || buf_free(&rb)) return -1;
      REQUIRE(shim_close_recv(g_shim, rcomm) == 0, "%s: closeRecv failed", what);
    } else if (g_rank == 1) {
      void* scomm = NULL;
      if (connect_accept(0, all, &scomm, NULL, NULL, what)) return -1;
      buf_t sb;
      if (buf_send(&sb, scomm, size, seed_of(1, 1, k))) return -1;
      op_t op;
      op_send(&op, scomm, &sb, size, 0);
      if (run_ops(what, &op, 1) || buf_free(&sb)) return -1;
      REQUIRE(shim_close_send(g_shim, scomm) == 0, "%s: closeSend failed", what);
    }
    if (barrier(what)) return -1;
  }
  if (g_rank == 0) {
    REQUIRE(shim_close_listen(g_shim, lcomm) == 0, "listen-reuse: closeListen failed");
    LOG("listen-reuse: one listen comm accepted %d concurrent and %d sequential connections", g_nranks - 1, sequential);
  }
  return 0;
}

/* ------------------------------------------------------------------ case 5: close with requests in flight */

static int count_fds(void) {
  DIR* d = opendir("/proc/self/fd");
  if (d == NULL) return -1;
  int n = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

enum { INFLIGHT_N = 8, CLOSE_ITERS = 10 };
/* How many of the round kinds below are played (a build-time knob for trying the harness itself). */
#ifndef CLOSE_KINDS
#define CLOSE_KINDS 3
#endif

/* Posts without waiting: each post is tried once (sends again for up to 1 s while NULL, so that most are
 * really in flight, unless the peer already closed); every post must return 0. */
static int post_all(const char* what, int is_send, void* comm, buf_t* bufs, int retry_null, int* in_flight) {
  for (int i = 0; i < INFLIGHT_N; i++) {
    double t0 = now_s();
    for (;;) {
      void* req = NULL;
      void* data = bufs[i].base;
      int tag = 0, rc;
      if (is_send)
        rc = shim_isend(g_shim, comm, data, bufs[i].size, 0, bufs[i].mh, &req);
      else
        rc = shim_irecv_n(g_shim, comm, 1, &data, &bufs[i].size, &tag, &bufs[i].mh, &req);
      REQUIRE(rc == 0, "%s: %s #%d returned %d (a post is accepted; failures come from test())", what,
              is_send ? "isend" : "irecv", i, rc);
      if (req != NULL) {
        (*in_flight)++;
        break;
      }
      if (!retry_null || now_s() - t0 > 1.0) break;
      sleep_ms(1);
    }
  }
  return 0;
}

static int dereg_all(const char* what, buf_t* bufs) {
  for (int i = 0; i < INFLIGHT_N; i++) {
    int rc = shim_dereg_mr(g_shim, bufs[i].comm, bufs[i].mh);
    REQUIRE(rc == 0, "%s: deregMr of buffer %d with its request in flight returned %d", what, i, rc);
    bufs[i].mh = NULL;
  }
  return 0;
}

/* One thread's 10 connect / post / deregMr / close rounds; rank 0 sends, rank 1 receives. Round kinds:
 * 0 = the receiver posts, then the sender, then both deregister and close at once with everything in
 * flight; 1 = the sender posts and closes first, then the receiver posts on a comm whose peer is gone;
 * 2 = the receiver posts and closes first, then the sender posts on a comm whose peer is gone. */
static int close_rounds(int t, int* in_flight) {
  for (int it = 0; it < CLOSE_ITERS; it++) {
    int kind = it % CLOSE_KINDS;
    char what[96];
    snprintf(what, sizeof what, "close-inflight: round %d (%s)", it,
             kind == 0 ? "both post, both close" : kind == 1 ? "sender closes first" : "receiver closes first");
    char mine[HANDLE], theirs[HANDLE];
    void* lcomm = NULL;
    void* comm = NULL;
    int sender = g_rank == 0;
    if (!sender && do_listen(0, mine, &lcomm, what)) return -1;
    if (sender) memset(mine, 0, sizeof mine);
    if (chan_swap(t, what, mine, theirs, HANDLE)) return -1;
    if (sender ? connect_accept(0, theirs, &comm, NULL, NULL, what) : connect_accept(0, NULL, NULL, lcomm, &comm, what))
      return -1;
    buf_t bufs[INFLIGHT_N];
    for (int i = 0; i < INFLIGHT_N; i++)
      if (sender ? buf_send(&bufs[i], comm, MIB, seed_of(0, it, t * INFLIGHT_N + i))
                 : buf_new(&bufs[i], comm, MIB, UNTOUCHED))
        return -1;
    int first = kind == 0 ? -1 : kind == 1 ? 0 : 1; /* the rank that closes first: 0 sender, 1 receiver */
    if (kind == 0) {
      if (!sender && post_all(what, 0, comm, bufs, 0, in_flight)) return -1;
      if (chan_barrier(t, what)) return -1; /* receives posted: the sends find their clear-to-send */
      if (sender && post_all(what, 1, comm, bufs, 1, in_flight)) return -1;
      if (chan_barrier(t, what)) return -1; /* both posted: both close with all of it in flight */
    } else if (g_rank != first) {
      if (chan_barrier(t, what)) return -1; /* the other side has closed */
      sleep_ms(50);                         /* and its close has had time to reach this side */
      if (post_all(what, sender, comm, bufs, 0, in_flight)) return -1;
    } else if (post_all(what, sender, comm, bufs, 0, in_flight)) {
      return -1;
    }
    if (dereg_all(what, bufs)) return -1;
    int rc = sender ? shim_close_send(g_shim, comm) : shim_close_recv(g_shim, comm);
    REQUIRE(rc == 0, "%s: %s with requests in flight returned %d", what, sender ? "closeSend" : "closeRecv", rc);
    if (lcomm) {
      rc = shim_close_listen(g_shim, lcomm);
      REQUIRE(rc == 0, "%s: closeListen returned %d", what, rc);
    }
    for (int i = 0; i < INFLIGHT_N; i++) free(bufs[i].base);
    if (kind != 0 && g_rank == first && chan_barrier(t, what)) return -1;
    if (chan_barrier(t, what)) return -1; /* the round is over on both sides */
  }
  return 0;
}

typedef struct {
  int t;
  int rc;
  int in_flight;
} thr_arg_t;

static void* close_thread(void* p) {
  thr_arg_t* a = p;
  char who[16];
  snprintf(who, sizeof who, "thread%d", a->t);
  t_who = who;
  a->rc = close_rounds(a->t, &a->in_flight);
  return NULL;
}

static int case_close(int nthreads) {
  int base = count_fds();
  thr_arg_t args[NTHREADS];
  pthread_t th[NTHREADS];
  if (nthreads == 1) {
    args[0].t = 0;
    args[0].in_flight = 0;
    args[0].rc = close_rounds(0, &args[0].in_flight);
  } else {
    for (int t = 0; t < nthreads; t++) {
      args[t] = (thr_arg_t){t, 0, 0};
      REQUIRE(pthread_create(&th[t], NULL, close_thread, &args[t]) == 0, "pthread_create failed");
    }
    for (int t = 0; t < nthreads; t++) pthread_join(th[t], NULL);
  }
  int in_flight = 0;
  for (int t = 0; t < nthreads; t++) {
    if (args[t].rc) return -1;
    in_flight += args[t].in_flight;
  }
  /* Everything the comms held is released (closing may finish in the background: allow 5 s). */
  double t0 = now_s();
  int fds = count_fds();
  while (fds != base && now_s() - t0 < 5.0) {
    sleep_ms(20);
    fds = count_fds();
  }
  REQUIRE(fds == base, "%d file descriptors open after closing everything, %d before the first connection", fds,
          base);
  LOG("close-inflight (%d thread(s)): %d rounds, %d requests were in flight at close; fds back to %d after %.2f s",
      nthreads, CLOSE_ITERS * nthreads, in_flight, base, now_s() - t0);
  return 0;
}

/* ------------------------------------------------------------------ cases 6, 7, 8: grouped receives */

/* One grouped-receive pattern: `ngroups` receives of `n` buffers with tags `gtags`, then sends in the order
 * `send_tag[]`, of which send k must land in group `dst_group[k]`, slot `dst_slot[k]`. Rank 0 sends, rank 1
 * receives. */
static int grouped(const char* what, int sub, int ngroups, int n, const int* gtags, int nsends, const int* send_tag,
                   const int* dst_group, const int* dst_slot, pair_t* p) {
  int rc = 0;
  op_t* ops = calloc((size_t)(g_rank == 0 ? nsends : ngroups), sizeof(op_t));
  buf_t* bufs = calloc((size_t)(g_rank == 0 ? nsends : ngroups * n), sizeof(buf_t));
  REQUIRE(ops && bufs, "out of memory");
  /* Send k is 1000 + 61 k bytes: every slot's size tells which send filled it. */
  if (g_rank == 0) {
    for (int k = 0; k < nsends && rc == 0; k++) {
      rc = buf_send(&bufs[k], p->send, 1000 + 61 * (size_t)k, seed_of(0, sub, k));
      if (rc == 0) op_send(&ops[k], p->send, &bufs[k], bufs[k].size, send_tag[k]);
    }
    if (rc == 0) rc = run_ops(what, ops, nsends);
    for (int k = 0; k < nsends; k++) rc |= buf_free(&bufs[k]);
  } else {
    const size_t cap = 1000 + 61 * (size_t)nsends + 100;
    for (int g = 0; g < ngroups && rc == 0; g++) {
      for (int s = 0; s < n && rc == 0; s++) rc = buf_new(&bufs[g * n + s], p->recv, cap, UNTOUCHED);
      if (rc == 0) op_recv(&ops[g], p->recv, n, &bufs[g * n], gtags);
    }
    if (rc == 0) rc = run_ops(what, ops, ngroups);
    for (int k = 0; k < nsends && rc == 0; k++) {
      int g = dst_group[k], s = dst_slot[k];
      char w[160];
      snprintf(w, sizeof w, "%s: send #%d (tag %d) in group %d slot %d", what, k, send_tag[k], g, s);
      int got = ops[g].got[s];
      int from = got >= 1000 && (got - 1000) % 61 == 0 ? (got - 1000) / 61 : -1;
      if (from != k) {
        set_failure("%s: that slot got %d bytes%s%d", w, got, from >= 0 ? ", which is send #" : " (no send is ",
                    from >= 0 ? from : got);
        rc = -1;
        break;
      }
      rc = verify(w, &bufs[g * n + s], 1000 + 61 * (size_t)k, seed_of(0, sub, k), got);
    }
    for (int k = 0; k < ngroups * n; k++) rc |= buf_free(&bufs[k]);
  }
  free(ops);
  free(bufs);
  return rc;
}

static int case_grouped_one_tag(pair_t* p) {
  int tags[MAX_GROUP] = {0}, send_tag[MAX_GROUP] = {0}, dg[MAX_GROUP] = {0}, ds[MAX_GROUP];
  for (int n = 1; n <= MAX_GROUP; n++) {
    for (int k = 0; k < n; k++) ds[k] = k; /* sends fill the group's slots in order */
    char what[64];
    snprintf(what, sizeof what, "grouped-one-tag: n = %d", n);
    if (grouped(what, n, 1, n, tags, n, send_tag, dg, ds, p) || barrier(what)) return -1;
  }
  LOG("grouped-one-tag: groups of 1..8 buffers, all tag 0, each filled in order");
  return 0;
}

static int case_grouped_tags(pair_t* p) {
  const int tags[2] = {0, 1}, send_tag[4] = {0, 0, 1, 1}, dg[4] = {0, 1, 0, 1}, ds[4] = {0, 0, 1, 1};
  if (grouped("grouped-several-tags: {0,1} twice, sends 0,0,1,1", 1, 2, 2, tags, 4, send_tag, dg, ds, p)) return -1;
  LOG("grouped-several-tags: sends tag 0, 0, 1, 1 landed in group 1, 2, 1, 2");
  return 0;
}

static int case_multi_recv(pair_t* p) {
  int tags[8], send_tag[16], dg[16], ds[16];
  for (int i = 0; i < 8; i++) tags[i] = i;
  int k = 0;
  for (int t = 0; t <= 6; t++) send_tag[k] = t, dg[k] = 0, ds[k++] = t; /* group 1, tags 0-6 */
  send_tag[k] = 1, dg[k] = 1, ds[k++] = 1;                              /* tag 1: group 1 has none left */
  send_tag[k] = 7, dg[k] = 0, ds[k++] = 7;                              /* tag 7: still group 1's */
  send_tag[k] = 0, dg[k] = 1, ds[k++] = 0;
  for (int t = 2; t <= 7; t++) send_tag[k] = t, dg[k] = 1, ds[k++] = t;
  if (grouped("multi-recv-interleaved", 1, 2, 8, tags, k, send_tag, dg, ds, p)) return -1;
  LOG("multi-recv-interleaved: 16 sends over two groups of tags 0-7, every byte in the right buffer");
  return 0;
}

static int case_max_recvs(pair_t* p) {
  shim_props_t pr;
  REQUIRE(shim_get_props(g_shim, 0, &pr) == 0, "getProperties(0) failed");
  REQUIRE(pr.max_recvs >= 1, "maxRecvs is %d", pr.max_recvs);
  int n = pr.max_recvs < MAX_GROUP ? pr.max_recvs : MAX_GROUP;
  int ngroups = 32, nsends = ngroups * n;
  int tags[MAX_GROUP];
  for (int i = 0; i < n; i++) tags[i] = i;
  int* st = calloc((size_t)nsends * 3, sizeof(int));
  REQUIRE(st != NULL, "out of memory");
  for (int k = 0; k < nsends; k++) st[k] = k % n, st[nsends + k] = k / n, st[2 * nsends + k] = k % n;
  int rc = grouped("max-recvs-x32", 1, ngroups, n, tags, nsends, st, st + nsends, st + 2 * nsends, p);
  free(st);
  if (rc == 0)
    LOG("max-recvs-x32: %d grouped receives of %d (maxRecvs %d), %d sends", ngroups, n, pr.max_recvs, nsends);
  return rc;
}

/* Runs a grouped case on a fresh pair: rank 0 sends, rank 1 receives. */
static int with_pair(int (*body)(pair_t*)) {
  pair_t p;
  if (wire_ring(1 - g_rank, &p, "connect")) return -1;
  if (body(&p)) return -1; /* a stuck comm is not closed: that could wait on the stuck requests too */
  return close_pair(&p, "close");
}

/* ------------------------------------------------------------------ the cases */

typedef struct {
  const char* name;
  int nranks;
  int ndevs; /* PRISM_IFNAMES for this case: 2 = lo,lo */
  int (*run)(void);
  int arg;
} case_t;

static int run_device_pairs(void) { return case_device_pairs(); }
static int run_sizes(void) { return case_sizes(); }
static int run_ring(void) { return case_ring(); }
static int run_listen_reuse(void) { return case_listen_reuse(); }
static int run_close1(void) { return case_close(1); }
static int run_close4(void) { return case_close(NTHREADS); }
static int run_grouped1(void) { return with_pair(case_grouped_one_tag); }
static int run_grouped2(void) { return with_pair(case_grouped_tags); }
static int run_multi(void) { return with_pair(case_multi_recv); }
static int run_max(void) { return with_pair(case_max_recvs); }

static const case_t CASES[] = {
    {"device-pairs", 2, 2, run_device_pairs, 0},
    {"sizes", 2, 1, run_sizes, 0},
    {"ring", 4, 1, run_ring, 0},
    {"listen-reuse", 4, 1, run_listen_reuse, 0},
    {"close-inflight", 2, 1, run_close1, 0},
    {"close-inflight-4threads", 2, 1, run_close4, 0},
    {"grouped-one-tag", 2, 1, run_grouped1, 0},
    {"grouped-several-tags", 2, 1, run_grouped2, 0},
    {"multi-recv-interleaved", 2, 1, run_multi, 0},
    {"max-recvs-x32", 2, 1, run_max, 0},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

/* ------------------------------------------------------------------ a rank */

static void send_result(int ok) {
  double deadline = now_s() + 5;
  const char* why = ok ? "" : g_why[0] ? g_why : "failed without a message";
  frame_t f = {F_RESULT, (uint32_t)strlen(why)};
  if (fd_write(g_hub, &f, sizeof f, deadline) == 0) fd_write(g_hub, why, f.len, deadline);
}

static void rank_main(const case_t* c) {
  /* Plugin WARN lines (stderr) interleave with this rank's progress lines. */
  dup2(STDOUT_FILENO, STDERR_FILENO);
  setvbuf(stdout, NULL, _IOLBF, 0);
  char err[512];
  shim_set_verbosity(getenv("FUNC_TEST_VERBOSE") ? 1 : 0);
  g_shim = shim_open(g_plugin, g_version, err, sizeof err);
  if (g_shim == NULL) {
    set_failure("%s", err);
    send_result(0);
    _exit(1);
  }
  int rc = shim_init(g_shim, 0xF000 + (uint64_t)g_rank);
  if (rc != 0) {
    set_failure("init returned %d", rc);
    send_result(0);
    _exit(1);
  }
  int ok = c->run() == 0 && g_why[0] == '\0';
  send_result(ok);
  if (!ok) _exit(1); /* comms may be stuck: no teardown that could wait on them */
  rc = shim_finalize(g_shim);
  shim_close(g_shim);
  if (rc != 0) {
    printf("  [v%d rank%d] finalize returned %d\n", g_version, g_rank, rc);
    fflush(stdout);
    exit(1);
  }
  fflush(stdout);
  exit(0); /* exit, not _exit: the plugin's unload hook runs as in any process */
}

/* ------------------------------------------------------------------ the parent: rendezvous and referee */

typedef struct {
  pid_t pid;
  int fd;
  int alive;       /* the hub is open */
  int reported;    /* F_RESULT received: 1 + how many ranks reported before */
  int ok;
  char why[1024];
  int in_gather;
  char* gather;    /* this round's contribution */
  uint32_t glen;
  int status;
  int exited;
} child_t;

static int read_frame(child_t* ch, double deadline) {
  frame_t f;
  if (fd_read(ch->fd, &f, sizeof f, deadline) != 0) return -1;
  if (f.len > 1 << 20) return -1;
  char* data = malloc(f.len + 1);
  if (data == NULL || (f.len && fd_read(ch->fd, data, f.len, deadline) != 0)) {
    free(data);
    return -1;
  }
  data[f.len] = '\0';
  if (f.type == F_GATHER) {
    free(ch->gather);
    ch->gather = data;
    ch->glen = f.len;
    ch->in_gather = 1;
    return 0;
  }
  if (f.type == F_RESULT) {
    static int order;
    ch->reported = ++order;
    ch->ok = f.len == 0;
    snprintf(ch->why, sizeof ch->why, "%s", data);
  }
  free(data);
  return 0;
}

static void answer_gathers(child_t* ch, int n, double deadline) {
  int waiting = 0, gone = 0;
  for (int r = 0; r < n; r++) {
    waiting += ch[r].in_gather;
    gone += !ch[r].alive || ch[r].reported;
  }
  if (waiting == 0) return;
  if (waiting + 0 == n) {
    uint32_t len = ch[0].glen;
    int same = 1;
    for (int r = 1; r < n; r++) same &= ch[r].glen == len;
    if (same) {
      char* all = malloc((size_t)len * n + 1);
      for (int r = 0; r < n; r++) memcpy(all + (size_t)r * len, ch[r].gather, len);
      frame_t f = {F_GATHER, len * (uint32_t)n};
      for (int r = 0; r < n; r++) {
        fd_write(ch[r].fd, &f, sizeof f, deadline);
        fd_write(ch[r].fd, all, f.len, deadline);
        ch[r].in_gather = 0;
      }
      free(all);
      return;
    }
  } else if (gone == 0) {
    return; /* the others will come */
  }
  /* Some rank will never come (or contributions differ): the waiting ones fail. */
  frame_t f = {F_ABORT, 0};
  for (int r = 0; r < n; r++)
    if (ch[r].in_gather) {
      fd_write(ch[r].fd, &f, sizeof f, deadline);
      ch[r].in_gather = 0;
    }
}

/* A failure that only says the other side went away: the other side's own message explains it better. */
static int secondary(const char* why) {
  return strstr(why, "another rank failed") || strstr(why, "the peer thread is gone") ||
         strstr(why, "the peer thread did not arrive") || strstr(why, "failed before this point");
}

/* Runs one case in fresh ranks; 0 = passed. `why` gets the reason of a failure. */
static int run_case(const case_t* c, char* why, size_t why_len) {
  const char* two = getenv("FUNC_TEST_IFNAMES2");
  setenv("PRISM_IFNAMES", c->ndevs == 2 ? (two && two[0] ? two : "lo,lo") : "lo", 1);
  int hub[MAX_RANKS][2], chan[NTHREADS][2];
  for (int r = 0; r < c->nranks; r++)
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, hub[r]) != 0) {
      snprintf(why, why_len, "socketpair: %s", strerror(errno));
      return -1;
    }
  for (int t = 0; t < NTHREADS; t++)
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, chan[t]) != 0) {
      snprintf(why, why_len, "socketpair: %s", strerror(errno));
      return -1;
    }
  child_t ch[MAX_RANKS];
  memset(ch, 0, sizeof ch);
  fflush(NULL);
  for (int r = 0; r < c->nranks; r++) {
    pid_t pid = fork();
    if (pid < 0) {
      snprintf(why, why_len, "fork: %s", strerror(errno));
      for (int k = 0; k < r; k++) kill(ch[k].pid, SIGKILL);
      return -1;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL); /* a killed referee takes its ranks along */
      if (getppid() == 1) _exit(1);
      g_rank = r;
      g_nranks = c->nranks;
      g_hub = hub[r][1];
      for (int k = 0; k < c->nranks; k++) {
        close(hub[k][0]);
        if (k != r) close(hub[k][1]);
      }
      for (int t = 0; t < NTHREADS; t++) {
        g_peer_chan[t] = r < 2 ? chan[t][r] : -1;
        if (r != 0) close(chan[t][0]);
        if (r != 1) close(chan[t][1]);
      }
      rank_main(c);
    }
    ch[r].pid = pid;
    ch[r].fd = hub[r][0];
    ch[r].alive = 1;
  }
  for (int r = 0; r < c->nranks; r++) close(hub[r][1]);
  for (int t = 0; t < NTHREADS; t++) close(chan[t][0]), close(chan[t][1]);

  double budget = g_case_s > 0 ? g_case_s : g_wait_s * 6 + 120;
  double t0 = now_s(), deadline = t0 + budget;
  int running = c->nranks;
  while (running > 0 && now_s() < deadline) {
    struct pollfd pf[MAX_RANKS];
    for (int r = 0; r < c->nranks; r++) pf[r] = (struct pollfd){ch[r].alive ? ch[r].fd : -1, POLLIN, 0};
    int ms = (int)((deadline - now_s()) * 1000);
    poll(pf, (nfds_t)c->nranks, ms < 200 ? (ms > 0 ? ms : 0) : 200);
    for (int r = 0; r < c->nranks; r++)
      if (ch[r].alive && (pf[r].revents & (POLLIN | POLLHUP | POLLERR)))
        if (read_frame(&ch[r], now_s() + 5) != 0) {
          ch[r].alive = 0;
          close(ch[r].fd);
        }
    answer_gathers(ch, c->nranks, now_s() + 5);
    for (int r = 0; r < c->nranks; r++)
      if (!ch[r].exited && waitpid(ch[r].pid, &ch[r].status, WNOHANG) == ch[r].pid) {
        ch[r].exited = 1;
        running--;
      }
  }
  int timed_out = running > 0;
  for (int r = 0; r < c->nranks; r++)
    if (!ch[r].exited) {
      kill(ch[r].pid, SIGKILL);
      waitpid(ch[r].pid, &ch[r].status, 0);
      ch[r].exited = 1;
    }
  /* A rank may have written its result and exited between the last poll and waitpid: read what is left. */
  for (int r = 0; r < c->nranks; r++)
    while (ch[r].alive && !ch[r].reported && read_frame(&ch[r], now_s() + 1) == 0) {
    }
  for (int r = 0; r < c->nranks; r++) {
    if (ch[r].alive) close(ch[r].fd);
    free(ch[r].gather);
  }
  /* The reason: the earliest failure a rank reported of its own (not "the other side went away"), else the
   * earliest reported failure, else a timeout or a crash. */
  why[0] = '\0';
  for (int pass = 0; pass < 2 && !why[0]; pass++) {
    int best = -1;
    for (int r = 0; r < c->nranks; r++)
      if (ch[r].reported && !ch[r].ok && (pass == 1 || !secondary(ch[r].why)) &&
          (best < 0 || ch[r].reported < ch[best].reported))
        best = r;
    if (best >= 0) snprintf(why, why_len, "%s", ch[best].why);
  }
  int failed = why[0] != '\0';
  for (int r = 0; r < c->nranks; r++) {
    int clean = WIFEXITED(ch[r].status) && WEXITSTATUS(ch[r].status) == 0;
    if (clean && ch[r].reported && ch[r].ok) continue;
    failed = 1;
    if (why[0]) continue;
    if (!ch[r].reported)
      snprintf(why, why_len, "rank %d %s", r,
               timed_out ? "did not finish within the case budget (killed)"
               : WIFSIGNALED(ch[r].status) ? "was killed by a signal without reporting"
                                           : "exited without reporting");
    else
      snprintf(why, why_len, "rank %d passed but %s in finalize/unload", r,
               WIFSIGNALED(ch[r].status) ? "died (signal or killed after the budget)" : "exited non-zero");
    if (WIFSIGNALED(ch[r].status) && !timed_out) {
      size_t l = strlen(why);
      snprintf(why + l, why_len - l, " (signal %d)", WTERMSIG(ch[r].status));
    }
  }
  if (timed_out && !why[0]) snprintf(why, why_len, "did not finish within %.0f s", budget);
  return failed ? -1 : 0;
}

int main(int argc, char** argv) {
  if (argc < 3 ||
      (strcmp(argv[1], "v9") && strcmp(argv[1], "v10") && strcmp(argv[1], "v11") && strcmp(argv[1], "v12"))) {
    fprintf(stderr, "usage: %s <v9|v10|v11|v12> <plugin .so> [case ...]\ncases:", argv[0]);
    for (int i = 0; i < NCASES; i++) fprintf(stderr, " %s", CASES[i].name);
    fprintf(stderr, "\n");
    return 2;
  }
  g_version = atoi(argv[1] + 1);
  g_plugin = argv[2];
  const char* e;
  if ((e = getenv("FUNC_TEST_SEED"))) g_seed = strtoull(e, NULL, 0);
  if ((e = getenv("FUNC_TEST_WAIT_S"))) g_wait_s = atof(e);
  if ((e = getenv("FUNC_TEST_CASE_S"))) g_case_s = atof(e);
  if (g_wait_s <= 0) g_wait_s = 30;
  for (int a = 3; a < argc; a++) {
    int found = 0;
    for (int i = 0; i < NCASES; i++) found |= strcmp(argv[a], CASES[i].name) == 0;
    if (!found) {
      fprintf(stderr, "unknown case \"%s\"\n", argv[a]);
      return 2;
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGPIPE, SIG_IGN);
  printf("func v%d: plugin %s, seed %#llx, wait %.0f s\n", g_version, g_plugin, (unsigned long long)g_seed, g_wait_s);
  int passed = 0, failed = 0;
  for (int i = 0; i < NCASES; i++) {
    int selected = argc == 3;
    for (int a = 3; a < argc; a++) selected |= strcmp(argv[a], CASES[i].name) == 0;
    if (!selected) continue;
    g_case = i + 1;
    char why[1100];
    double t0 = now_s();
    int rc = run_case(&CASES[i], why, sizeof why);
    if (rc == 0) {
      printf("%s: ok (%.1f s)\n", CASES[i].name, now_s() - t0);
      passed++;
    } else {
      printf("%s: FAIL %s (%.1f s)\n", CASES[i].name, why, now_s() - t0);
      failed++;
    }
  }
  printf("func: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
