/* The CUDA runtime as the CUDA back end's sources use it, run on the CPU (docs/cuda.md, "Running
 * the CUDA kernels on the CPU"): the emulated module (build/librlflow_cudaemu.so) compiles
 * the .cu files of kernels/cuda as C++ against this header and its neighbours (cuda_bf16.h,
 * cublas_v2.h) after tests/cuda_emu/cu_rewrite.c has turned each `k<<<grid, block, smem, stream>>>(args)`
 * into a call of rf_emu_launch and each `extern __shared__` array into the block's dynamic shared
 * memory.
 *
 * A kernel runs block after block on the calling thread; a block's threads are fibers
 * (tests/cuda_emu/cuda_emu.cpp) that run one at a time from one barrier to the next
 * (__syncthreads, __syncwarp, a shuffle), so shared memory is a thread-local static, and a
 * missing barrier shows as a wrong result in one of the two orders the threads and blocks can be
 * run in (RF_EMU_ORDER=forward|reverse). Device memory is host memory filled with 0xff (NaN
 * floats) when allocated, so AddressSanitizer sees every access out of bounds. Not a model of
 * timing, of the memory model beyond barriers, nor of cuBLAS's or the tensor cores' rounding
 * order. */
#ifndef RF_CUDA_EMU_RUNTIME_H
#define RF_CUDA_EMU_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- runtime (C and C++: comm/comm_nccl.c includes it too) ---- */
#ifdef __cplusplus
extern "C" {
#endif
typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719,
} cudaError_t;
typedef struct rf_emu_stream *cudaStream_t;
typedef struct rf_emu_pool *cudaMemPool_t;
typedef struct rf_emu_event *cudaEvent_t;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};
enum cudaDeviceAttr {
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 };
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02

const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventDestroy(cudaEvent_t e);
/* Whether [p, p + bytes) lies in one device allocation (the emulated NCCL checks its buffers). */
int rf_emu_on_device(const void *p, size_t bytes);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value);
cudaError_t rf_emu_func_set_attribute(const void *fn, enum cudaFuncAttribute attr, int value);

#ifdef __cplusplus
}
template <typename T>
static inline cudaError_t cudaMalloc(T **p, size_t bytes) { return cudaMalloc((void **)p, bytes); }
template <typename T>
static inline cudaError_t cudaMallocAsync(T **p, size_t bytes, cudaStream_t s) {
    return cudaMallocAsync((void **)p, bytes, s);
}
template <typename F>
static inline cudaError_t cudaFuncSetAttribute(F *fn, cudaFuncAttribute attr, int value) {
    return rf_emu_func_set_attribute((const void *)fn, attr, value);
}
#endif

#ifdef __cplusplus
/* ---- qualifiers ---- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
/* one copy: a block's threads (fibers) share it, and blocks run one at a time (launches are
 * serialised over the whole process) */
#define __shared__ static

/* ---- vector types (the ones the kernels use) ---- */
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(8) uint2 {
    unsigned x, y;
};

/* ---- built-in variables ---- */
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
extern uint3 threadIdx, blockIdx; /* set by the scheduler before each switch to a thread */
extern dim3 blockDim, gridDim;

/* ---- device functions ---- */
void __syncthreads(void);
void __syncwarp(unsigned mask = 0xffffffffu);
[[noreturn]] void __trap(void);

/* A warp's exchange: every lane of `mask` offers `mine` and gets what lane `src` offered
 * (src < 0: its own value back). One barrier of the warp's lanes in `mask`. */
uint64_t rf_emu_warp_exchange(unsigned mask, uint64_t mine, int src);
/* d += a b: PTX mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 on a whole warp
 * (kernels/cuda/cuda_mma.cuh, which calls it where RF_CUDA_EMU is defined). */
void rf_emu_mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2]);
#define RF_CUDA_EMU 1
static inline int rf_emu_lane(void) { return (int)(threadIdx.x % 32); }

template <typename T>
static inline T rf_emu_shuffle(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    u = rf_emu_warp_exchange(mask, u, src);
    T r;
    memcpy(&r, &u, sizeof(T));
    return r;
}
template <typename T>
static inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    int lane = rf_emu_lane();
    return rf_emu_shuffle(mask, v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    int lane = rf_emu_lane(), src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = -1; /* outside its segment: own */
    return rf_emu_shuffle(mask, v, src);
}
template <typename T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    int lane = rf_emu_lane();
    int src = (lane & (width - 1)) >= (int)delta ? lane - (int)delta : -1;
    return rf_emu_shuffle(mask, v, src);
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    int lane = rf_emu_lane();
    int src = (lane & (width - 1)) + (int)delta < width ? lane + (int)delta : -1;
    return rf_emu_shuffle(mask, v, src);
}

/* Atomics (the blocks of launches run one at a time; atomic all the same). */
template <typename F, typename U>
static inline F rf_emu_atomic_add_float(F *p, F v) {
    static_assert(sizeof(F) == sizeof(U), "same width");
    U *u = (U *)p, old = __atomic_load_n(u, __ATOMIC_RELAXED), nu;
    F f;
    do {
        memcpy(&f, &old, sizeof f);
        F s = f + v;
        memcpy(&nu, &s, sizeof nu);
    } while (!__atomic_compare_exchange_n(u, &old, nu, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return f;
}
static inline float atomicAdd(float *p, float v) {
    return rf_emu_atomic_add_float<float, uint32_t>(p, v);
}
static inline double atomicAdd(double *p, double v) {
    return rf_emu_atomic_add_float<double, uint64_t>(p, v);
}
static inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

/* Correctly rounded single operations that the compiler may not fuse with their neighbours
 * (nvcc's __fmul_rn, __fsub_rn): the empty asm makes the result a register the next operation
 * must read, so no contraction into an fma. */
static inline float __fmul_rn(float a, float b) {
    float r = a * b;
    __asm__("" : "+x"(r));
    return r;
}
static inline float __fsub_rn(float a, float b) {
    float r = a - b;
    __asm__("" : "+x"(r));
    return r;
}

/* CUDA's integer and float min/max overloads */
#define RF_EMU_MINMAX(T)                                   \
    static inline T min(T a, T b) { return b < a ? b : a; } \
    static inline T max(T a, T b) { return a < b ? b : a; }
RF_EMU_MINMAX(int)
RF_EMU_MINMAX(unsigned)
RF_EMU_MINMAX(long)
RF_EMU_MINMAX(unsigned long)
RF_EMU_MINMAX(long long)
RF_EMU_MINMAX(unsigned long long)
RF_EMU_MINMAX(float)
RF_EMU_MINMAX(double)
#undef RF_EMU_MINMAX

/* ---- launches (what cu_rewrite.c makes of <<<...>>>) ---- */
void rf_emu_launch_body(const char *name, const void *fn, void (*body)(void *), void *ctx,
                        dim3 grid, dim3 block, size_t smem, cudaStream_t stream);
template <typename L>
static inline void rf_emu_launch(const char *name, const void *fn, L body, dim3 grid, dim3 block,
                                 size_t smem = 0, cudaStream_t stream = 0) {
    rf_emu_launch_body(name, fn, [](void *c) { (*(L *)c)(); }, &body, grid, block, smem, stream);
}
/* The running block's dynamic shared memory (extern __shared__). */
void *rf_emu_dynamic_smem(void);

#endif /* __cplusplus */

#endif
