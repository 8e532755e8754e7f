/*
 * ll_test.c: plays NCCL's LL reader against libnccl-net-prism.so, in two processes, through the C ABI.
 *
 * Usage: ll_test <path to the plugin .so> [seconds]     (default 10 s; LL_TEST_SECONDS also sets it)
 *
 * NCCL's LL protocol keeps the receive buffer in host memory and its reader trusts a 16-byte line
 * {data0, flag0, data1, flag1} as soon as both flags carry the step's value, without waiting for the
 * network's completion. That is only safe if no line is ever visible half new, half old with both
 * flags new: every write into the buffer must cover whole lines (NCCL's IB transport writes in
 * 128-byte units, LL128's line).
 *
 * Rank 0 sends 64 KiB LL-formatted messages, step after step, into the SAME receive buffer of rank 1
 * (NCCL reuses its LL buffer; rank 1 posts the receive of step s once step s-1 completed and was
 * checked). A poller thread on rank 1 does aligned 16-byte SSE loads over that buffer the whole time
 * and counts lines whose two flags are equal and non-zero (lines a reader would accept) and, among
 * them, lines with a data word older than the flags' step (torn lines: a reader of that step would take
 * stale data). A data word of the NEXT step (whole, or some of its bytes) under the old flags is a line
 * being written in ascending order, harmless (the next step's reader still waits for its flags): counted
 * as `ahead`, not torn.
 * Every completed message is also checked in full (wrong lines). One summary line:
 *   ll: transport=.. mtu=<PRISM_MTU> paths=<PRISM_PATHS> steps=N lines_checked=M torn=T wrong=W ahead=A
 * The exit status is non-zero if torn > 0, wrong > 0, a transfer failed or timed out, or too few steps
 * or lines were checked for the run to mean anything.
 *
 * Only include/prism_net.h, libc, libpthread, libdl and SSE2 intrinsics are used.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <emmintrin.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "prism_net.h"

#define MSG_BYTES (64 * 1024)
#define LINE_BYTES 16
#define LINES (MSG_BYTES / LINE_BYTES)
#define TAG 7
/* A run that checked less than this proves nothing. */
#define MIN_STEPS 20
#define MIN_LINES_CHECKED 1000000ULL
/* One step (post, transfer, completion) taking longer than this is a hang. */
#define STEP_TIMEOUT_S 30.0

static int g_rank;
static int g_peer_fd = -1;
static prism_net_v9_t* g_net;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define FAIL(...)                        \
  do {                                   \
    printf("ll rank%d: FAIL: ", g_rank); \
    printf(__VA_ARGS__);                 \
    printf("\n");                        \
    fflush(stdout);                      \
    return -1;                           \
  } while (0)

static void logger(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

static int xwrite(const void* buf, size_t n) {
  const char* p = buf;
  while (n > 0) {
    ssize_t k = write(g_peer_fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

static int xread(void* buf, size_t n) {
  char* p = buf;
  while (n > 0) {
    ssize_t k = read(g_peer_fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* Line `i` of step `step`: {data0, flag0, data1, flag1}; the data words encode step and line. */
static uint32_t data0_of(uint32_t step, uint32_t i) { return (step << 12) ^ i; }
static uint32_t data1_of(uint32_t step, uint32_t i) { return ~((step << 12) ^ i) ^ 0x5A5A0000u; }

/* Every byte of `got` is that byte of `cur` or of `next`: a word the next step is overwriting. The network
 * writes bytes, not words (rxe's kernel copy under an emulator was seen mid-word: flags 15, data0 0x567 =
 * bytes 0-1 of step 16's 0x10567 over step 15's 0xf567), so a line being rewritten by step s+1 can hold
 * such words; they are as harmless as whole words of step s+1. */
static int bytes_of(uint32_t got, uint32_t cur, uint32_t next) {
  for (int b = 0; b < 32; b += 8) {
    uint32_t g = (got >> b) & 0xffu;
    if (g != ((cur >> b) & 0xffu) && g != ((next >> b) & 0xffu)) return 0;
  }
  return 1;
}

static void fill_step(uint32_t* w, uint32_t step) {
  for (uint32_t i = 0; i < LINES; i++) {
    w[4 * i + 0] = data0_of(step, i);
    w[4 * i + 1] = step;
    w[4 * i + 2] = data1_of(step, i);
    w[4 * i + 3] = step;
  }
}

/* ------------------------------------------------------------------ rank 1: the LL reader */

static uint8_t* g_rbuf;
static atomic_int g_stop;
static atomic_ullong g_lines_checked, g_torn, g_ahead;

static void* poller(void* arg) {
  (void)arg;
  unsigned long long checked = 0, torn = 0, ahead = 0;
  int reported = 0;
  while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
    for (uint32_t i = 0; i < LINES; i++) {
      /* One aligned 16-byte load, as NCCL's LL reader does (ld.volatile.v4.u32 on the GPU). Written as
       * asm: from an intrinsic the compiler may (and gcc -O2 does) split the load into four 4-byte
       * loads in any order, which tears lines by itself. The words are then taken from the register. */
      __m128i v;
      __asm__ __volatile__("movdqa %1, %0" : "=x"(v) : "m"(*(const __m128i*)(g_rbuf + (size_t)i * LINE_BYTES)));
      uint32_t w[4];
      w[0] = (uint32_t)_mm_cvtsi128_si32(v);
      w[1] = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(v, 4));
      w[2] = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(v, 8));
      w[3] = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(v, 12));
      if (w[1] == 0 || w[1] != w[3]) continue; /* the reader would wait for this line */
      checked++;
      uint32_t s = w[1];
      if (w[0] == data0_of(s, i) && w[2] == data1_of(s, i)) continue;
      /* Data of the next step (whole words, or bytes of them) under this step's flags: the line is being
       * written (in ascending order)
       * and a reader of step s+1 still waits for its flags; the reader of step s is done with the line
       * before step s+1 can be sent (NCCL's credits; here the receive is posted after the check). */
      int w0_ok = bytes_of(w[0], data0_of(s, i), data0_of(s + 1, i));
      int w2_ok = bytes_of(w[2], data1_of(s, i), data1_of(s + 1, i));
      if (w0_ok && w2_ok) {
        ahead++;
      } else {
        /* Both flags say step s but a data word is older: a reader of step s would take stale data. */
        torn++;
        if (reported < 5) {
          reported++;
          printf("ll rank1: torn line %u (byte %u): flags %u/%u, data %#x/%#x, expected %#x/%#x\n", i,
                 i * LINE_BYTES, w[1], w[3], w[0], w[2], data0_of(w[1], i), data1_of(w[1], i));
        }
      }
    }
  }
  atomic_store(&g_lines_checked, checked);
  atomic_store(&g_torn, torn);
  atomic_store(&g_ahead, ahead);
  return NULL;
}

/* Posts `isend`/`irecv` (retrying NULL requests) and tests until done; -1 on error or timeout. */
static int wait_req(void* req, const char* what, uint32_t step, int* size) {
  double deadline = now_s() + STEP_TIMEOUT_S;
  for (;;) {
    int done = 0, sizes[PRISM_NET_MAX_REQUESTS] = {0};
    prism_result_t rc = g_net->test(req, &done, sizes);
    if (rc != PRISM_OK) FAIL("%s of step %u: test returned %d", what, step, rc);
    if (done) {
      if (size) *size = sizes[0];
      return 0;
    }
    if (now_s() > deadline) FAIL("%s of step %u: not done after %.0f s", what, step, STEP_TIMEOUT_S);
  }
}

static int run_receiver(unsigned long long* steps_out, unsigned long long* wrong_out) {
  char handle[PRISM_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof handle);
  void* lcomm = NULL;
  void* rcomm = NULL;
  if (g_net->listen(0, handle, &lcomm) != PRISM_OK || lcomm == NULL) FAIL("listen failed");
  if (xwrite(handle, sizeof handle) != 0) FAIL("cannot send the handle to rank 0");
  double t0 = now_s();
  while (rcomm == NULL) {
    if (g_net->accept(lcomm, &rcomm, NULL) != PRISM_OK) FAIL("accept failed");
    if (now_s() - t0 > STEP_TIMEOUT_S) FAIL("no connection after %.0f s", STEP_TIMEOUT_S);
  }
  g_net->closeListen(lcomm);

  if (posix_memalign((void**)&g_rbuf, 4096, MSG_BYTES) != 0) FAIL("posix_memalign");
  memset(g_rbuf, 0, MSG_BYTES);
  void* mh = NULL;
  if (g_net->regMr(rcomm, g_rbuf, MSG_BYTES, PRISM_PTR_HOST, &mh) != PRISM_OK) FAIL("regMr failed");
  pthread_t th;
  if (pthread_create(&th, NULL, poller, NULL) != 0) FAIL("pthread_create");

  unsigned long long steps = 0, wrong = 0;
  int rc = 0;
  for (;;) {
    uint32_t step = 0;
    if (xread(&step, sizeof step) != 0) {
      printf("ll rank1: FAIL: rank 0 is gone\n");
      rc = -1;
      break;
    }
    if (step == 0) break; /* rank 0's time is up */
    void* data[1] = {g_rbuf};
    size_t sizes[1] = {MSG_BYTES};
    int tags[1] = {TAG};
    void* mhs[1] = {mh};
    void* req = NULL;
    double deadline = now_s() + STEP_TIMEOUT_S;
    while (req == NULL) {
      if (g_net->irecv(rcomm, 1, data, sizes, tags, mhs, &req) != PRISM_OK) {
        printf("ll rank1: FAIL: irecv of step %u failed\n", step);
        rc = -1;
        break;
      }
      if (req == NULL && now_s() > deadline) {
        printf("ll rank1: FAIL: irecv of step %u: no request after %.0f s\n", step, STEP_TIMEOUT_S);
        rc = -1;
        break;
      }
    }
    int got = -1;
    if (rc != 0 || wait_req(req, "irecv", step, &got) != 0) {
      rc = -1;
      break;
    }
    if (got != MSG_BYTES) {
      printf("ll rank1: FAIL: step %u received %d bytes, expected %d\n", step, got, MSG_BYTES);
      rc = -1;
      break;
    }
    /* The buffer is stable until the next irecv is posted: check every line. */
    const uint32_t* w = (const uint32_t*)g_rbuf;
    for (uint32_t i = 0; i < LINES; i++) {
      if (w[4 * i] != data0_of(step, i) || w[4 * i + 1] != step || w[4 * i + 2] != data1_of(step, i) ||
          w[4 * i + 3] != step) {
        if (wrong < 5)
          printf("ll rank1: step %u line %u wrong: %#x %#x %#x %#x\n", step, i, w[4 * i], w[4 * i + 1], w[4 * i + 2],
                 w[4 * i + 3]);
        wrong++;
      }
    }
    steps++;
  }
  atomic_store(&g_stop, 1);
  pthread_join(th, NULL);
  g_net->deregMr(rcomm, mh);
  g_net->closeRecv(rcomm);
  *steps_out = steps;
  *wrong_out = wrong;
  return rc;
}

/* ------------------------------------------------------------------ rank 0: the sender */

static int run_sender(double seconds) {
  char handle[PRISM_NET_HANDLE_MAXSIZE];
  if (xread(handle, sizeof handle) != 0) FAIL("no handle from rank 1");
  void* scomm = NULL;
  prism_net_device_handle_t* dh = NULL;
  double t0 = now_s();
  while (scomm == NULL) {
    if (g_net->connect(0, handle, &scomm, &dh) != PRISM_OK) FAIL("connect failed");
    if (now_s() - t0 > STEP_TIMEOUT_S) FAIL("no connection after %.0f s", STEP_TIMEOUT_S);
  }
  uint32_t* sbuf = NULL;
  if (posix_memalign((void**)&sbuf, 4096, MSG_BYTES) != 0) FAIL("posix_memalign");
  void* mh = NULL;
  if (g_net->regMr(scomm, sbuf, MSG_BYTES, PRISM_PTR_HOST, &mh) != PRISM_OK) FAIL("regMr failed");
  double end = now_s() + seconds;
  int rc = 0;
  for (uint32_t step = 1; now_s() < end && step < (1u << 20); step++) {
    fill_step(sbuf, step);
    if (xwrite(&step, sizeof step) != 0) FAIL("rank 1 is gone");
    void* req = NULL;
    double deadline = now_s() + STEP_TIMEOUT_S;
    while (req == NULL) {
      if (g_net->isend(scomm, sbuf, MSG_BYTES, TAG, mh, &req) != PRISM_OK) FAIL("isend of step %u failed", step);
      if (req == NULL && now_s() > deadline) FAIL("isend of step %u: no request after %.0f s", step, STEP_TIMEOUT_S);
    }
    if (wait_req(req, "isend", step, NULL) != 0) {
      rc = -1;
      break;
    }
  }
  uint32_t stop = 0;
  xwrite(&stop, sizeof stop);
  g_net->deregMr(scomm, mh);
  g_net->closeSend(scomm);
  free(sbuf);
  return rc;
}

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s <plugin .so> [seconds]\n", argv[0]);
    return 2;
  }
  double seconds = 10.0;
  const char* env_s = getenv("LL_TEST_SECONDS");
  if (env_s) seconds = atof(env_s);
  if (argc == 3) seconds = atof(argv[2]);
  if (!(seconds > 0)) {
    fprintf(stderr, "ll_test: the duration must be a positive number of seconds\n");
    return 2;
  }
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
  alarm((unsigned)(seconds + 4 * STEP_TIMEOUT_S));

  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    printf("ll rank%d: FAIL: dlopen(%s): %s\n", g_rank, argv[1], dlerror());
    return 1;
  }
  g_net = dlsym(lib, "ncclNetPlugin_v9");
  int ndev = 0;
  if (g_net == NULL || g_net->init(logger) != PRISM_OK || g_net->devices(&ndev) != PRISM_OK || ndev < 1) {
    printf("ll rank%d: FAIL: plugin init (symbol %p, %d devices)\n", g_rank, (void*)g_net, ndev);
    return 1;
  }

  if (g_rank == 1) {
    unsigned long long steps = 0, wrong = 0;
    int rc = run_receiver(&steps, &wrong);
    unsigned long long checked = atomic_load(&g_lines_checked), torn = atomic_load(&g_torn), ahead = atomic_load(&g_ahead);
    const char* mtu = getenv("PRISM_MTU");
    const char* paths = getenv("PRISM_PATHS");
    const char* tr = getenv("PRISM_TRANSPORT");
    printf("ll: transport=%s mtu=%s paths=%s steps=%llu lines_checked=%llu torn=%llu wrong=%llu ahead=%llu\n",
           tr ? tr : "default", mtu ? mtu : "default", paths ? paths : "default", steps, checked, torn, wrong, ahead);
    int ok = rc == 0 && torn == 0 && wrong == 0;
    if (steps < MIN_STEPS) {
      printf("ll rank1: FAIL: only %llu steps (at least %d needed)\n", steps, MIN_STEPS);
      ok = 0;
    }
    if (checked < MIN_LINES_CHECKED) {
      printf("ll rank1: FAIL: only %llu lines checked (at least %llu needed)\n", checked, MIN_LINES_CHECKED);
      ok = 0;
    }
    fflush(NULL);
    exit(ok ? 0 : 1);
  }
  int ok = run_sender(seconds) == 0;
  close(g_peer_fd);
  int status = 0;
  waitpid(child, &status, 0);
  int child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!child_ok) {
    if (WIFSIGNALED(status))
      printf("ll: rank1 killed by signal %d\n", WTERMSIG(status));
    else
      printf("ll: rank1 exited with %d\n", WEXITSTATUS(status));
  }
  printf("ll: %s\n", ok && child_ok ? "PASS" : "FAIL");
  return ok && child_ok ? 0 : 1;
}
