/* The CUDA back end: module state (device, stream, cuBLAS handle, sticky error flag), memory
 * ops, and the rf_kernels table that gathers every CUDA op (the ops themselves live in the
 * other files of kernels/cuda/, one group per file, mirroring kernels/cpu/). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda_module.h"

rf__cuda_state rf__cuda;

int rf__cuda_fail(const char *what, const char *detail, const char *file, int line) {
    if (!rf__cuda.failed) {
        rf__cuda.failed = 1;
        rf_error(RF_ERR_CUDA, "cuda: %s:%d: %s: %s", file, line, what, detail);
        fprintf(stderr, "rlflow: cuda: %s:%d: %s: %s (CUDA back end disabled from here on)\n",
                file, line, what, detail);
    }
    return 0;
}

/* ---- memory ---- */

/* Zero-filled like the CPU alloc; the fill is ordered on the stream, so any op issued after
 * this returns sees zeros. A zero-byte request still returns a distinct pointer. */
void *rf_cuda_alloc(size_t bytes) {
    RF_CUDA_GUARD(NULL);
    void *p = NULL;
    size_t n = bytes ? bytes : 1;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess && e != cudaErrorMemoryAllocation) { /* a broken device, not a full one */
        RF_CUDA_CHECK(e);
        return NULL;
    }
    if (e != cudaSuccess) {
        /* Out of memory is bad input, not a broken device: report it without the sticky flag. */
        (void)cudaGetLastError(); /* clear the non-sticky error so later launch checks pass */
        rf_error(RF_ERR_NOMEM, "cuda: out of device memory allocating %zu bytes (%s)", bytes,
                 cudaGetErrorString(e));
        return NULL;
    }
    if (!RF_CUDA_CHECK(cudaMemsetAsync(p, 0, n, rf__cuda.stream))) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

/* cudaFree waits for the device, so work still queued that reads p finishes first. */
void rf_cuda_free(void *p) {
    if (!p) return;
    rf__cuda_bf16_forget(p);
    RF_CUDA_CHECK(cudaFree(p));
}

/* Synchronises after the copy so that, as on the CPU, host_src may be reused or freed on
 * return even when it is pinned memory (uploads are weights and small index arrays). */
void rf_cuda_to_device(void *dst, const void *host_src, size_t bytes) {
    RF_CUDA_GUARD();
    if (!bytes) return;
    if (RF_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice,
                                      rf__cuda.stream)))
        RF_CUDA_CHECK(cudaStreamSynchronize(rf__cuda.stream));
    /* stale once the write is queued: a copy another thread converts in between is made
       before the write on the stream and would otherwise stay marked valid */
    rf__cuda_bf16_invalidate(dst, bytes);
}

void rf_cuda_to_host(void *host_dst, const void *src, size_t bytes) {
    if (!bytes) return;
    if (!rf__cuda.failed &&
        RF_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost,
                                      rf__cuda.stream)) &&
        RF_CUDA_CHECK(cudaStreamSynchronize(rf__cuda.stream)))
        return;
    memset(host_dst, 0xff, bytes); /* never hand back stale bytes as if they were a result */
}

void rf_cuda_copy(void *dst, const void *src, size_t bytes) {
    RF_CUDA_GUARD();
    if (bytes)
        RF_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                      rf__cuda.stream));
    rf__cuda_bf16_invalidate(dst, bytes); /* after the write is queued (rf_cuda_to_device) */
}

void rf_cuda_zero(void *p, size_t bytes) {
    RF_CUDA_GUARD();
    if (bytes) RF_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, rf__cuda.stream));
    rf__cuda_bf16_invalidate(p, bytes); /* after the write is queued (rf_cuda_to_device) */
}

int rf_cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    RF_CUDA_GUARD(-1);
    return RF_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes)) ? 0 : -1;
}

void rf_cuda_sync(void) {
    RF_CUDA_GUARD();
    RF_CUDA_CHECK(cudaStreamSynchronize(rf__cuda.stream));
}

/* ---- precision (the products themselves: cuda_matmul.cu) ---- */

static rf_status rf_cuda_set_precision(rf_precision p) { return rf__cuda_set_precision(p); }

static rf_precision rf_cuda_get_precision(void) { return rf__cuda.precision; }

/* Writes through the table already mark the bf16 copies they touch stale; this covers writes
 * made around it (NCCL into parameter memory, another library's kernels). */
static void rf_cuda_weights_updated(void) { rf__cuda_bf16_invalidate_all(); }

/* ---- the table ---- */

static const rf_kernels cuda_table = {
    /* .name = */ "cuda",
    /* .alloc = */ rf_cuda_alloc,
    /* .free = */ rf_cuda_free,
    /* .to_device = */ rf_cuda_to_device,
    /* .to_host = */ rf_cuda_to_host,
    /* .copy = */ rf_cuda_copy,
    /* .zero = */ rf_cuda_zero,
    /* .sync = */ rf_cuda_sync,
    /* .mem_info = */ rf_cuda_mem_info,
    /* .set_precision = */ rf_cuda_set_precision,
    /* .get_precision = */ rf_cuda_get_precision,
    /* .weights_updated = */ rf_cuda_weights_updated,
    /* .add_inplace = */ rf_cuda_add_inplace,
    /* .scale = */ rf_cuda_scale,
    /* .sum_squares = */ rf_cuda_sum_squares,
    /* .matmul_forward = */ rf_cuda_matmul_forward,
    /* .matmul_backward = */ rf_cuda_matmul_backward,
    /* .embedding_forward = */ rf_cuda_embedding_forward,
    /* .embedding_backward = */ rf_cuda_embedding_backward,
    /* .rmsnorm_forward = */ rf_cuda_rmsnorm_forward,
    /* .rmsnorm_backward = */ rf_cuda_rmsnorm_backward,
    /* .add_rmsnorm_forward = */ rf_cuda_add_rmsnorm_forward,
    /* .rope = */ rf_cuda_rope,
    /* .rope_qk = */ rf_cuda_rope_qk,
    /* .attention_forward = */ rf_cuda_attention_forward,
    /* .attention_backward = */ rf_cuda_attention_backward,
    /* .swiglu_forward = */ rf_cuda_swiglu_forward,
    /* .swiglu_backward = */ rf_cuda_swiglu_backward,
    /* .logprob_forward = */ rf_cuda_logprob_forward,
    /* .logprob_backward = */ rf_cuda_logprob_backward,
    /* .adamw = */ rf_cuda_adamw,
    /* .paged_kv_write = */ rf_cuda_paged_kv_write,
    /* .paged_attention_forward = */ rf_cuda_paged_attention_forward,
    /* .logprob_vp_partials = */ rf_cuda_logprob_vp_partials,
    /* .logprob_vp_backward = */ rf_cuda_logprob_vp_backward,
    /* .heads_expand = */ rf_cuda_heads_expand,
    /* .heads_reduce = */ rf_cuda_heads_reduce,
    /* .sample_rows = */ rf_cuda_sample_rows,
    /* .row_lse = */ rf_cuda_row_lse,
    /* .bind_bf16 = */ NULL, /* frozen models load their weights as fp32 here */
    /* .trim = */ NULL,
    /* .operand_hold = */ NULL,
    /* .operands_release = */ NULL,
};
/* C++ has no designated initialisers before C++20, hence the positional table above; this
 * catches a field added to rf_kernels without a matching entry here. */
static_assert(sizeof(rf_kernels) == 43 * sizeof(void *), "rf_kernels changed: update cuda_table");

/* Creates the stream, the cuBLAS handle bound to it, and the reduction scratch. On failure
 * everything created so far is released and the state stays uninitialised. */
static int cuda_init(int device) {
    cudaStream_t stream = NULL;
    cublasHandle_t blas = NULL;
    double *partials = NULL;
    if (rf__cuda_check_env() != RF_OK) return 0; /* a mistyped RLFLOW_CUDA_* setting */
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaMalloc(&partials, sizeof(double) * (RF_CUDA_REDUCE_BLOCKS + 1));
    if (e != cudaSuccess) {
        rf_error(RF_ERR_CUDA, "cuda: initialising device %d: %s", device, cudaGetErrorString(e));
        goto fail;
    }
    cublasStatus_t b;
    b = cublasCreate(&blas);
    if (b == CUBLAS_STATUS_SUCCESS) b = cublasSetStream(blas, stream);
    /* The compute type of each product is chosen per call (cublasGemmEx, cuda_matmul.cu). */
    if (b == CUBLAS_STATUS_SUCCESS) b = cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH);
    if (b != CUBLAS_STATUS_SUCCESS) {
        rf_error(RF_ERR_CUDA, "cuda: creating the cuBLAS handle on device %d: %s", device,
                 cublasGetStatusString(b));
        goto fail;
    }
    /* The stream-ordered allocations (log-prob chunks, attention scratch, the draws) come from
     * the device's default pool, which by default hands its memory back at every
     * synchronisation: decoding synchronises each step (its draws), so the next step's log-prob
     * chunk (156 MB at Qwen2.5's vocabulary) would be mapped again. The pool keeps up to
     * 1 GiB; mem_info counts what it keeps as used. */
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
        uint64_t keep = (uint64_t)1 << 30;
        (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    }
    (void)cudaGetLastError(); /* a driver without pools: the default behaviour */
    rf__cuda.device = device;
    rf__cuda.stream = stream;
    rf__cuda.blas = blas;
    rf__cuda.partials = partials;
    rf__cuda.failed = 0;
    rf__cuda.initialised = 1;
    rf__cuda_set_precision(RF_PRECISION_FP32); /* reads RLFLOW_CUDA_TF32 */
    return 1;
fail:
    if (blas) cublasDestroy(blas);
    if (partials) cudaFree(partials);
    if (stream) cudaStreamDestroy(stream);
    (void)cudaGetLastError();
    return 0;
}

/* The CUDA back end on `device` (>= 0; kernels/backend.c resolves RF_CUDA_ANY). The first
 * successful call picks the device and creates the back end's one stream and cuBLAS handle,
 * which live until the process exits; later calls with the same device return the same table,
 * and a different device is refused (one device per process: multi-GPU runs use one process
 * per GPU). Not thread-safe: call it from one thread before using the table; another thread then
 * calls it once (the same device) before its own first use. Errors:
 * RF_ERR_NODEVICE when no GPU is visible or `device` is out of range, RF_ERR_CUDA when the
 * runtime or cuBLAS fails to start, RF_ERR_UNSUPPORTED for a second device; NULL then. */
static const rf_kernels *cuda_kernels(int device) {
    if (rf__cuda.initialised) {
        if (device == rf__cuda.device) {
            /* the current device is per host thread: a second thread of the process (a colocated
             * rollout rank, resharding/handover.h) makes the back end's device its own */
            cudaError_t e = cudaSetDevice(device);
            if (e == cudaSuccess) return &cuda_table;
            rf_error(RF_ERR_CUDA, "cuda: cudaSetDevice(%d) in another thread: %s", device, cudaGetErrorString(e));
            return NULL;
        }
        rf_error(RF_ERR_UNSUPPORTED,
                 "cuda: the back end already runs on device %d; one device per process "
                 "(asked for device %d)", rf__cuda.device, device);
        return NULL;
    }
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        rf_error(RF_ERR_NODEVICE, "cuda: no usable GPU (cudaGetDeviceCount: %s)",
                 cudaGetErrorString(e));
        return NULL;
    }
    if (count == 0) {
        rf_error(RF_ERR_NODEVICE, "cuda: no GPU visible (cudaGetDeviceCount returned 0)");
        return NULL;
    }
    if (device < 0 || device >= count) {
        rf_error(RF_ERR_NODEVICE, "cuda: device %d out of range (%d GPU%s visible)", device,
                 count, count == 1 ? "" : "s");
        return NULL;
    }
    return cuda_init(device) ? &cuda_table : NULL;
}

static int cuda_device_count(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return count;
}

static int cuda_current_device(void) { return rf__cuda.initialised ? rf__cuda.device : -1; }

static void *cuda_stream(void) { return rf__cuda.initialised ? (void *)rf__cuda.stream : NULL; }

static const rf_cuda_module cuda_module = {
    RF_CUDA_MODULE_ABI, cuda_kernels, cuda_device_count, cuda_current_device, cuda_stream,
#ifdef RLFLOW_HAVE_NCCL
    rf__comm_nccl_impl,
#else
    NULL,
#endif
};

/* The module's entry point (kernels/cuda_module.h), looked up by the loader. */
extern "C" __attribute__((visibility("default"))) const rf_cuda_module *rf__cuda_module_entry(void) {
    return &cuda_module;
}
