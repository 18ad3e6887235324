/* The CUDA back end as a module loaded at run time (docs/cuda.md, "Build"): the .cu files of kernels/cuda
 * and comm's NCCL back end are built into librlflow_cuda.so, which links the CUDA runtime,
 * cuBLAS and NCCL; rlflow itself does not. The module is opened (dlopen) the first time a
 * process asks for CUDA: rf_cuda_kernels, rf_cuda_device_count, rf_comm_nccl. A CPU run never
 * maps the CUDA libraries, which cost every process about 217 MB of resident memory and 0.2 s
 * at start when they were linked in.
 *
 * Internal to kernels/backend.c (the loader), kernels/cuda/cuda_backend.cu and comm (the
 * module's side). */
#ifndef RF_CUDA_MODULE_H
#define RF_CUDA_MODULE_H

#include "comm/comm.h"
#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Changes whenever the table below does: a module of another version is refused. */
#define RF_CUDA_MODULE_ABI 4

typedef struct rf_cuda_module {
    int abi; /* RF_CUDA_MODULE_ABI */
    /* The back end on `device` (>= 0): rf_cuda_kernels' contract (kernels.h). */
    const rf_kernels *(*kernels)(int device);
    int (*device_count)(void);
    int (*current_device)(void);  /* -1 before kernels() started the back end */
    void *(*stream)(void);        /* the back end's cudaStream_t, NULL before it started */
    /* rf_comm_nccl (comm.h); NULL when the module was built without NCCL. */
    rf_status (*comm_nccl)(rf_comm *from, int device, double timeout_s, rf_comm **out);
} rf_cuda_module;

/* The module's entry point (the one symbol the loader looks up). */
const rf_cuda_module *rf__cuda_module_entry(void);
typedef const rf_cuda_module *(*rf_cuda_module_entry_fn)(void);

/* Loader (kernels/backend.c): the module, opened on the first call; NULL with the reason
 * recorded (RF_ERR_NODEVICE: a build without CUDA, or a module that cannot be opened). Where
 * it is looked for: $RLFLOW_CUDA_MODULE, then the build's own path, then librlflow_cuda.so
 * next to the running program. Not thread-safe: the first call comes from one thread. */
const rf_cuda_module *rf__cuda_module(void);

/* comm_nccl.c's rf_comm_nccl, exported by the module. */
rf_status rf__comm_nccl_impl(rf_comm *from, int device, double timeout_s, rf_comm **out);

#ifdef __cplusplus
}
#endif

#endif
