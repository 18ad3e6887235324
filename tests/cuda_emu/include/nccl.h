/* NCCL as comm/comm_nccl.c uses it, over MPI on the CPU (cuda_runtime.h says what the emulation
 * is; nccl_emu.cpp how). Non-blocking communicators answer ncclInProgress to their
 * initialisation and report success at the next ncclCommGetAsyncError, so the polling of
 * comm_nccl.c runs; operations complete when called. */
#ifndef RF_CUDA_EMU_NCCL_H
#define RF_CUDA_EMU_NCCL_H

#include <stddef.h>

#include "cuda_runtime.h"

#define NCCL_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(2, 28, 0)

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rf_emu_nccl *ncclComm_t;
typedef struct {
    char internal[128];
} ncclUniqueId;
typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7
} ncclResult_t;
typedef enum { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclFloat32 = 7 } ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;
typedef struct {
    int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {1}

const char *ncclGetErrorString(ncclResult_t r);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void *in, void *out, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclReduceScatter(const void *in, void *out, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclAllGather(const void *in, void *out, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclBroadcast(const void *in, void *out, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

#ifdef __cplusplus
}
#endif

#endif
