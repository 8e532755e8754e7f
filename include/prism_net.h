/*
 * prism_net.h: Prism's own declaration of the NCCL net plugin ABI that libnccl-net-prism.so implements
 * (versions 9 to 12). Written from the ABI's documented layouts; only sizes, offsets and calling
 * conventions have to agree with NCCL, so the names here are Prism's.
 *
 * Symbols exported by the plugin (data symbols, the tables themselves):
 *   prism_net_v12_t ncclNetPlugin_v12;   NCCL 2.30+
 *   prism_net_v11_t ncclNetPlugin_v11;   NCCL 2.28-2.29
 *   prism_net_v10_t ncclNetPlugin_v10;   NCCL 2.26-2.27
 *   prism_net_v9_t  ncclNetPlugin_v9;    NCCL 2.24-2.25
 */
#ifndef PRISM_NET_H
#define PRISM_NET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Result codes (a C int). */
typedef int prism_result_t;
#define PRISM_OK 0
#define PRISM_ERR_CUDA 1
#define PRISM_ERR_SYSTEM 2
#define PRISM_ERR_INTERNAL 3
#define PRISM_ERR_INVALID_ARGUMENT 4
#define PRISM_ERR_INVALID_USAGE 5
#define PRISM_ERR_REMOTE 6

#define PRISM_NET_HANDLE_MAXSIZE 128
#define PRISM_NET_MAX_REQUESTS 32
#define PRISM_PTR_HOST 0x1
#define PRISM_PTR_CUDA 0x2
#define PRISM_PTR_DMABUF 0x4
/* On entry to irecv, *request may hold this value: completion is optional (LL/LL128). */
#define PRISM_OPTIONAL_RECV_COMPLETION ((void*)0x1)
#define PRISM_MAX_NET_SIZE_BYTES (1024LL * 1024 * 1024 * 1024)
/* The maxP2pBytes Prism announces (1 GiB, as NCCL's IB transport: test() reports sizes in an int). */
#define PRISM_MAX_P2P_BYTES (1024LL * 1024 * 1024)

/* Logger levels and subsystems (the plugin calls the logger with fmt = "%s"). */
#define PRISM_LOG_NONE 0
#define PRISM_LOG_VERSION 1
#define PRISM_LOG_WARN 2
#define PRISM_LOG_INFO 3
#define PRISM_LOG_ABORT 4
#define PRISM_LOG_TRACE 5
#define PRISM_SUBSYS_INIT 0x1
#define PRISM_SUBSYS_NET 0x10

typedef void (*prism_logger_t)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);
typedef prism_result_t (*prism_profiler_cb_t)(void** event_handle, int type, void* parent_handle,
                                              int64_t plugin_id, void* ext_data);

/* Device-offload handle; host plugins ignore it (32 bytes). */
typedef struct {
  int device_type;
  int device_version;
  void* handle;
  size_t size;
  int needs_proxy_progress;
} prism_net_device_handle_t;

typedef struct { int trafficClass; } prism_net_comm_config_t;

typedef struct { int ndevs; int devs[4]; } prism_vdevice_props_v9_t;  /* v9, v10, v11 */
typedef struct { int ndevs; int devs[8]; } prism_vdevice_props_v12_t;

/* Common head of every properties version (64 bytes). */
#define PRISM_NET_PROPERTIES_HEAD \
  char* name;                     \
  char* pciPath;                  \
  uint64_t guid;                  \
  int ptrSupport;                 \
  int regIsGlobal;                \
  int forceFlush;                 \
  int speed; /* Mbps */           \
  int port;                       \
  float latency; /* us */         \
  int maxComms;                   \
  int maxRecvs;                   \
  int netDeviceType;              \
  int netDeviceVersion;

typedef struct { /* 104 bytes */
  PRISM_NET_PROPERTIES_HEAD
  prism_vdevice_props_v9_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
} prism_net_properties_v9_t;
typedef prism_net_properties_v9_t prism_net_properties_v10_t;

typedef struct { /* 112 bytes */
  PRISM_NET_PROPERTIES_HEAD
  prism_vdevice_props_v9_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
} prism_net_properties_v11_t;

typedef struct { /* 128 bytes */
  PRISM_NET_PROPERTIES_HEAD
  prism_vdevice_props_v12_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
  int16_t railId;
  int16_t planeId;
} prism_net_properties_v12_t;

typedef struct { int32_t maxConcurrentPeers, minConcurrentPeers, maxFlowsPerPeer, minFlowsPerPeer; } prism_net_comm_attr_t;
typedef struct { prism_net_comm_attr_t sendCommAttr, recvCommAttr; uint32_t op, algo, proto; } prism_net_attr_t;

/* The function slots shared by every version after init/connect/isend/irecv differ. */
#define PRISM_NET_COMMON_REG_SLOTS                                                                        \
  prism_result_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);                 \
  prism_result_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,  \
                                void** mhandle);                                                          \
  prism_result_t (*deregMr)(void* comm, void* mhandle);
#define PRISM_NET_COMMON_TAIL_SLOTS                                                                        \
  prism_result_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request); \
  prism_result_t (*test)(void* request, int* done, int* sizes);                                           \
  prism_result_t (*closeSend)(void* sendComm);                                                            \
  prism_result_t (*closeRecv)(void* recvComm);                                                            \
  prism_result_t (*closeListen)(void* listenComm);                                                        \
  prism_result_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);                          \
  prism_result_t (*irecvConsumed)(void* recvComm, int n, void* request);

typedef struct { /* 160 bytes, 20 slots */
  const char* name;
  prism_result_t (*init)(prism_logger_t log);
  prism_result_t (*devices)(int* ndev);
  prism_result_t (*getProperties)(int dev, prism_net_properties_v9_t* props);
  prism_result_t (*listen)(int dev, void* handle, void** listenComm);
  prism_result_t (*connect)(int dev, void* handle, void** sendComm, prism_net_device_handle_t** sendDevComm);
  prism_result_t (*accept)(void* listenComm, void** recvComm, prism_net_device_handle_t** recvDevComm);
  PRISM_NET_COMMON_REG_SLOTS
  prism_result_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request);
  prism_result_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                          void** request);
  PRISM_NET_COMMON_TAIL_SLOTS
  prism_result_t (*makeVDevice)(int* d, prism_vdevice_props_v9_t* props);
} prism_net_v9_t;

typedef struct { /* 160 bytes, 20 slots */
  const char* name;
  prism_result_t (*init)(prism_logger_t log, prism_profiler_cb_t prof);
  prism_result_t (*devices)(int* ndev);
  prism_result_t (*getProperties)(int dev, prism_net_properties_v10_t* props);
  prism_result_t (*listen)(int dev, void* handle, void** listenComm);
  prism_result_t (*connect)(int dev, prism_net_comm_config_t* config, void* handle, void** sendComm,
                            prism_net_device_handle_t** sendDevComm);
  prism_result_t (*accept)(void* listenComm, void** recvComm, prism_net_device_handle_t** recvDevComm);
  PRISM_NET_COMMON_REG_SLOTS
  prism_result_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                          void** request);
  prism_result_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                          void** phandles, void** request);
  PRISM_NET_COMMON_TAIL_SLOTS
  prism_result_t (*makeVDevice)(int* d, prism_vdevice_props_v9_t* props);
} prism_net_v10_t;

/* v11 and v12 share one function table; only the properties and vdevice types differ. */
#define PRISM_NET_V11_TABLE(PROPS, VPROPS)                                                                  \
  const char* name;                                                                                         \
  prism_result_t (*init)(void** ctx, uint64_t commId, prism_net_comm_config_t* config, prism_logger_t log, \
                         prism_profiler_cb_t prof);                                                         \
  prism_result_t (*devices)(int* ndev);                                                                     \
  prism_result_t (*getProperties)(int dev, PROPS* props);                                                   \
  prism_result_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);                            \
  prism_result_t (*connect)(void* ctx, int dev, void* handle, void** sendComm,                              \
                            prism_net_device_handle_t** sendDevComm);                                       \
  prism_result_t (*accept)(void* listenComm, void** recvComm, prism_net_device_handle_t** recvDevComm);     \
  PRISM_NET_COMMON_REG_SLOTS                                                                                \
  prism_result_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle,   \
                          void** request);                                                                  \
  prism_result_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,    \
                          void** phandles, void** request);                                                 \
  PRISM_NET_COMMON_TAIL_SLOTS                                                                               \
  prism_result_t (*makeVDevice)(int* d, VPROPS* props);                                                     \
  prism_result_t (*finalize)(void* ctx);                                                                    \
  prism_result_t (*setNetAttr)(void* ctx, prism_net_attr_t* attr);

typedef struct { PRISM_NET_V11_TABLE(prism_net_properties_v11_t, prism_vdevice_props_v9_t) } prism_net_v11_t;  /* 176 bytes */
typedef struct { PRISM_NET_V11_TABLE(prism_net_properties_v12_t, prism_vdevice_props_v12_t) } prism_net_v12_t; /* 176 bytes */

#ifdef __cplusplus
}
#endif

#endif /* PRISM_NET_H */
