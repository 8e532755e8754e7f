/*
 * loader_test.c: finds and starts a net plugin by NCCL's lookup rules, to check that each documented way
 * of loading Prism (LD_LIBRARY_PATH + NCCL_NET_PLUGIN=<name>, LD_PRELOAD + NCCL_NET_PLUGIN=STATIC_PLUGIN,
 * plain LD_PRELOAD) reaches it.
 *
 * The rules, as NCCL's loader (src/plugin/net.cc and src/plugin/plugin_open.cc) applies them:
 * - NCCL_NET_PLUGIN unset: one candidate, "libnccl-net.so". Set to "none" (any case): no candidate.
 *   Otherwise a comma-separated list of candidates, tried in order until one loads and initializes.
 * - A candidate that is a case-insensitive prefix of "STATIC_PLUGIN" opens the process itself
 *   (dlopen(NULL)), so the plugin tables of preloaded libraries are found.
 * - Otherwise dlopen(candidate, RTLD_NOW | RTLD_LOCAL); if that fails and the candidate has no '/' and
 *   is not already a library name ("lib...so"), dlopen("libnccl-net-<candidate>.so") next.
 * - In the opened object: the first of ncclNetPlugin_v12, _v11, _v10, _v9, _v8, _v7, _v6 that dlsym
 *   finds (this harness can only drive v9 to v12 and reports older ones as a failure).
 * - init, then devices; an error or no device disables the candidate and the next one is tried.
 *
 * Output: one line "loaded <candidate> as <dlopen name> v<version>: name=<table name> ndev=<n> dev0=<name>"
 * and exit status 0, or "no plugin: ..." and exit status 1. Only include/prism_net.h, libc and libdl.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "prism_net.h"

static const char* const versions[] = {"12", "11", "10", "9", "8", "7", "6"};

/* dlopen as NCCL's tryOpenLib does; *opened gets the name passed to dlopen ("(process)" for NULL). */
static void* try_open(const char* name, char* opened, size_t opened_len) {
  if (name == NULL || name[0] == '\0') return NULL;
  if (strncasecmp(name, "STATIC_PLUGIN", strlen(name)) == 0) {
    snprintf(opened, opened_len, "(process)");
    return dlopen(NULL, RTLD_NOW | RTLD_LOCAL);
  }
  snprintf(opened, opened_len, "%s", name);
  void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) fprintf(stderr, "loader_test: dlopen(%s): %s\n", name, dlerror());
  return h;
}

static int ends_with(const char* s, const char* suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* NCCL's openPluginLib for the NET type. */
static void* open_plugin_lib(const char* name, char* opened, size_t opened_len) {
  void* h = try_open(name, opened, opened_len);
  if (h) return h;
  if (strchr(name, '/') == NULL && (strncmp(name, "lib", 3) != 0 || !ends_with(name, ".so"))) {
    char lib[256];
    snprintf(lib, sizeof lib, "libnccl-net-%s.so", name);
    h = try_open(lib, opened, opened_len);
  }
  return h;
}

static void report_path(void* h) {
  struct link_map* lm = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm) fprintf(stderr, "loader_test: opened object: '%s'\n", lm->l_name);
}

/* Load, init and count devices of one candidate; 0 on success (line printed). */
static int try_candidate(const char* candidate) {
  char opened[300];
  void* h = open_plugin_lib(candidate, opened, sizeof opened);
  if (h == NULL) return 1;
  report_path(h);
  void* table = NULL;
  int version = 0;
  for (size_t i = 0; i < sizeof versions / sizeof versions[0] && table == NULL; i++) {
    char sym[64];
    snprintf(sym, sizeof sym, "ncclNetPlugin_v%s", versions[i]);
    table = dlsym(h, sym);
    version = atoi(versions[i]);
  }
  if (table == NULL) {
    fprintf(stderr, "loader_test: %s: no ncclNetPlugin_v12..v6 symbol\n", opened);
    dlclose(h);
    return 1;
  }
  if (version < 9) {
    fprintf(stderr, "loader_test: %s: only ncclNetPlugin_v%d, older than this harness drives\n", opened, version);
    dlclose(h);
    return 1;
  }
  const char* name = NULL;
  int rc = -1, ndev = 0;
  void* ctx = NULL;
  char* dev0 = NULL;
  switch (version) {
    case 12: {
      prism_net_v12_t* t = table;
      prism_net_properties_v12_t p;
      name = t->name;
      rc = t->init(&ctx, 0x10ade7, NULL, NULL, NULL);
      if (rc == 0) rc = t->devices(&ndev);
      if (rc == 0 && ndev > 0 && t->getProperties(0, &p) == 0) dev0 = p.name;
      break;
    }
    case 11: {
      prism_net_v11_t* t = table;
      prism_net_properties_v11_t p;
      name = t->name;
      rc = t->init(&ctx, 0x10ade7, NULL, NULL, NULL);
      if (rc == 0) rc = t->devices(&ndev);
      if (rc == 0 && ndev > 0 && t->getProperties(0, &p) == 0) dev0 = p.name;
      break;
    }
    case 10: {
      prism_net_v10_t* t = table;
      prism_net_properties_v10_t p;
      name = t->name;
      rc = t->init(NULL, NULL);
      if (rc == 0) rc = t->devices(&ndev);
      if (rc == 0 && ndev > 0 && t->getProperties(0, &p) == 0) dev0 = p.name;
      break;
    }
    default: {
      prism_net_v9_t* t = table;
      prism_net_properties_v9_t p;
      name = t->name;
      rc = t->init(NULL);
      if (rc == 0) rc = t->devices(&ndev);
      if (rc == 0 && ndev > 0 && t->getProperties(0, &p) == 0) dev0 = p.name;
      break;
    }
  }
  if (rc != 0 || ndev <= 0) {
    fprintf(stderr, "loader_test: %s v%d (%s): init/devices failed (rc %d, ndev %d)\n", opened, version,
            name ? name : "?", rc, ndev);
    return 1;
  }
  printf("loaded %s as %s v%d: name=%s ndev=%d dev0=%s\n", candidate, opened, version, name ? name : "(null)",
         ndev, dev0 ? dev0 : "(null)");
  if (version >= 11) {
    prism_result_t (*finalize)(void*) = version == 12 ? ((prism_net_v12_t*)table)->finalize
                                                      : ((prism_net_v11_t*)table)->finalize;
    if (finalize(ctx) != 0) {
      fprintf(stderr, "loader_test: finalize failed\n");
      return 1;
    }
  }
  return 0;
}

int main(void) {
  const char* env = getenv("NCCL_NET_PLUGIN");
  if (env == NULL) env = "libnccl-net.so";
  if (strcasecmp(env, "none") == 0) env = "";
  char* list = strdup(env);
  char* save = NULL;
  for (char* c = strtok_r(list, ",", &save); c; c = strtok_r(NULL, ",", &save)) {
    if (try_candidate(c) == 0) {
      free(list);
      return 0;
    }
  }
  free(list);
  printf("no plugin: NCCL would fall back to its internal IB/socket transports\n");
  return 1;
}
