/* Declarations shared by the files of the CUDA back end: the back end's module state (one
 * device, one stream, one cuBLAS handle, a sticky error flag), the error-checking macros that
 * wrap every CUDA and cuBLAS call, small launch and reduction helpers, and the rf_cuda_* ops
 * that cuda_backend.cu gathers into the rf_kernels table.
 *
 * Each rf_cuda_<op> has exactly the signature of the CPU op of the same name
 * (kernels/cpu/, kernels/kernels.h) and runs asynchronously on rf__cuda.stream: the table
 * carries no stream argument, so the stream is the back end's one stream, held here.
 *
 * Error policy (ops return void): the first failing CUDA/cuBLAS call records its message with
 * rf_error(RF_ERR_CUDA, ...), prints it to stderr and sets rf__cuda.failed. From then on every
 * op returns at once without touching memory (alloc returns NULL, sum_squares returns NaN,
 * to_host fills the host buffer with 0xff bytes, which reads as NaN floats / -1 ints), so a
 * failure cannot be mistaken for a result. A CUDA fault inside a kernel is asynchronous: it
 * surfaces at the next checked call (a later launch, to_host, sync, sum_squares). */
#ifndef RF_CUDA_COMMON_CUH
#define RF_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"

/* ---- module state (defined in cuda_backend.cu) ---- */
struct rf__cuda_state {
    int initialised;
    int device;
    cudaStream_t stream;  /* every op is ordered on this one stream */
    cublasHandle_t blas;  /* bound to `stream` */
    int failed;           /* sticky: set by the first failed call, never cleared */
    double *partials;     /* (RF_CUDA_REDUCE_BLOCKS + 1) device scratch for sum_squares */
    rf_precision precision; /* operand precision of the matrix products (set_precision) */
    int tf32;             /* fp32 products on TF32 tensor cores (RLFLOW_CUDA_TF32, default 1) */
};
extern rf__cuda_state rf__cuda;

/* Records a failed call (file:line, the call's text, the CUDA message) once; returns 0. */
int rf__cuda_fail(const char *what, const char *detail, const char *file, int line);

static inline int rf__cuda_check(cudaError_t e, const char *what, const char *file, int line) {
    return e == cudaSuccess ? 1 : rf__cuda_fail(what, cudaGetErrorString(e), file, line);
}
static inline int rf__cublas_check(cublasStatus_t e, const char *what, const char *file,
                                   int line) {
    return e == CUBLAS_STATUS_SUCCESS ? 1 : rf__cuda_fail(what, cublasGetStatusString(e), file,
                                                          line);
}

/* Each evaluates to 1 on success, 0 after recording the failure. */
#define RF_CUDA_CHECK(call) rf__cuda_check((call), #call, __FILE__, __LINE__)
#define RF_CUBLAS_CHECK(call) rf__cublas_check((call), #call, __FILE__, __LINE__)
/* After every <<<...>>>: catches bad launch configurations and earlier asynchronous faults. */
#define RF_CUDA_LAUNCH_CHECK() RF_CUDA_CHECK(cudaGetLastError())
/* First statement of every op: after a failure, ops do nothing (see the policy above). */
#define RF_CUDA_GUARD(...)                  \
    do {                                    \
        if (rf__cuda.failed) return __VA_ARGS__; \
    } while (0)

/* ---- launch helpers ---- */
#define RF_CUDA_THREADS 256      /* threads per block for elementwise and row kernels */
#define RF_CUDA_MAX_GRID 65535u  /* grid-stride loops cover the rest; keeps grids modest */
#define RF_CUDA_REDUCE_BLOCKS 512 /* partial sums of sum_squares (fixed for determinism) */

/* Blocks for n elements at RF_CUDA_THREADS each, capped (kernels loop grid-stride). n > 0. */
static inline unsigned rf__cuda_blocks(size_t n) {
    size_t b = (n + RF_CUDA_THREADS - 1) / RF_CUDA_THREADS;
    return b > RF_CUDA_MAX_GRID ? RF_CUDA_MAX_GRID : (unsigned)b;
}

/* Sum over a warp; every lane gets the total (butterfly order is fixed: deterministic). */
template <typename T>
static __device__ inline T rf__warp_sum(T x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
static __device__ inline float rf__warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

/* Sum over a block whose size is a multiple of 32 (at most 1024); every thread gets the
 * total. `shared` holds 32 T. Ends with a barrier, so `shared` may be reused right after. */
template <typename T>
static __device__ inline T rf__block_sum(T x, T *shared) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    x = rf__warp_sum(x);
    if (lane == 0) shared[warp] = x;
    __syncthreads();
    T total = lane < nwarps ? shared[lane] : (T)0;
    total = rf__warp_sum(total);
    __syncthreads();
    return total;
}
static __device__ inline float rf__block_max(float x, float *shared) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    x = rf__warp_max(x);
    if (lane == 0) shared[warp] = x;
    __syncthreads();
    float m = lane < nwarps ? shared[lane] : -INFINITY;
    m = rf__warp_max(m);
    __syncthreads();
    return m;
}

#define RF_LOGPROB_THREADS 512 /* threads per row block of the log-prob kernels: V is large */

/* The sums of logits row zr (V) at inv_temp, for the whole block (every thread gets them; launch
 * with RF_LOGPROB_THREADS threads, the block order of the sums): zs = zr * inv_temp, m = max
 * zs, sum = sum e, wsum = sum e (zs - m), with e = exp(zs - m) in float, summed in double
 * (kernels/sample.c rf_row_softmax_stats on the GPU). The log-prob kernels pass inv_temp 1 on
 * logits their product has scaled; the sampler passes its inv_temp on the raw logits, and the
 * scaling and subtraction are single roundings (__fmul_rn, __fsub_rn: never fused), so both see
 * the same zs. */
static __device__ inline void rf__row_softmax_sums(const float *zr, int V, float inv_temp, float *m_out,
                                                   double *sum_out, double *wsum_out) {
    __shared__ float fshared[32];
    __shared__ double dshared[32];
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, __fmul_rn(zr[j], inv_temp));
    m = rf__block_max(m, fshared);
    /* float exponentials, double accumulators (V up to ~150k terms), as on the CPU */
    double sum = 0.0, wsum = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float x = __fsub_rn(__fmul_rn(zr[j], inv_temp), m), e = expf(x);
        sum += (double)e;
        wsum += (double)(e * x);
    }
    *m_out = m;
    *sum_out = rf__block_sum(sum, dshared);
    *wsum_out = rf__block_sum(wsum, dshared);
}

/* ---- ops (one group per file, as in kernels/cpu/) ---- */
/* cuda_backend.cu: memory */
void *rf_cuda_alloc(size_t bytes);
void rf_cuda_free(void *p);
void rf_cuda_to_device(void *dst, const void *host_src, size_t bytes);
void rf_cuda_to_host(void *host_dst, const void *src, size_t bytes);
void rf_cuda_copy(void *dst, const void *src, size_t bytes);
void rf_cuda_zero(void *p, size_t bytes);
void rf_cuda_sync(void);
int rf_cuda_mem_info(size_t *free_bytes, size_t *total_bytes);

/* cuda_elementwise.cu */
void rf_cuda_add_inplace(float *a, const float *b, size_t n);
void rf_cuda_scale(float *x, float s, size_t n);
double rf_cuda_sum_squares(const float *x, size_t n);
void rf_cuda_embedding_forward(float *out, const int32_t *tokens, const float *wte, int T, int C);
void rf_cuda_embedding_backward(float *dwte, const float *dout, const int32_t *tokens, int T,
                                int C);
void rf_cuda_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w, int N,
                             int C, float eps);
void rf_cuda_rmsnorm_backward(float *dinp, float *dw, const float *dout, const float *inp,
                              const float *w, const float *rstd, int N, int C);
void rf_cuda_rope(float *x, const int32_t *pos, const float *inv_freq, int T, int H, int D,
                  int sign);
void rf_cuda_add_rmsnorm_forward(float *x, float *out, float *rstd, const float *add, const float *w, int N,
                                 int C, float eps);
void rf_cuda_rope_qk(float *q, float *k, const int32_t *pos, const float *inv_freq, int T, int H, int KVH,
                     int D, int sign);
void rf_cuda_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
void rf_cuda_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, size_t n);
void rf_cuda_adamw(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                   float beta1, float beta2, float eps, float weight_decay, int step,
                   float grad_scale);

/* cuda_matmul.cu */
void rf_cuda_matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                            int T, int C, int OC);
void rf_cuda_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                             const float *inp, const float *w, int T, int C, int OC);
/* Row-major sgemm helpers shared with cuda_logprob.cu (mapping worked out in cuda_matmul.cu);
 * each returns 1, or 0 after recording a cuBLAS failure.
 *   xwt: out (T, OC) = alpha x (T, C) @ w (OC, C)^T + beta out
 *   xw:  out (T, C)  = alpha x (T, OC) @ w (OC, C)  + beta out
 *   xtw: out (OC, C) = alpha x (T, OC)^T @ y (T, C) + beta out */
int rf__cuda_gemm_xwt(float *out, const float *x, const float *w, int T, int C, int OC,
                      float alpha, float beta);
int rf__cuda_gemm_xw(float *out, const float *x, const float *w, int T, int C, int OC,
                     float alpha, float beta);
int rf__cuda_gemm_xtw(float *out, const float *x, const float *y, int T, int C, int OC,
                      float alpha, float beta);
/* rf__cuda_gemm_xtw where x is the x of the previous rf__cuda_gemm_xw on this back end,
 * unchanged since (a backward's dw after its dinp): in bf16 mode that product's conversion of x
 * is used again where it is still the last one made. */
int rf__cuda_gemm_xtw_again(float *out, const float *x, const float *y, int T, int C, int OC,
                            float alpha, float beta);

/* Precision of the matrix products (cuda_matmul.cu). set_precision also re-reads
 * RLFLOW_CUDA_TF32 ("0" = plain fp32 sgemm for precision fp32; anything else or unset = TF32). */
rf_status rf__cuda_set_precision(rf_precision p);
/* The bf16 weight copies: the table's writes that may land on a weight (to_device, copy, zero,
 * add_inplace, scale; AdamW refreshes the copy itself) call rf__cuda_bf16_invalidate on the
 * bytes they write once the write is queued, so a copy made from them is remade before its next
 * use (comm/comm_nccl.c does the same for the buffers its collectives write). The other ops'
 * outputs (products, norms, attention, gradients) are activations and gradients, never a
 * weight operand. rf__cuda_bf16_forget when memory is freed; weights_updated drops validity of
 * all copies but those AdamW refreshed since its last call (writes made outside the table and
 * NCCL). */
extern "C" void rf__cuda_bf16_invalidate(const void *p, size_t bytes); /* comm_nccl.c too */
void rf__cuda_bf16_forget(const void *p);
void rf__cuda_bf16_invalidate_all(void);
/* For a kernel about to overwrite exactly the tensor p (n floats), e.g. AdamW on one weight:
 * the bf16 copy of p when one exists, marked valid on the promise that the kernel writes it
 * along with p (NULL when there is none); any other copy overlapping p is marked stale. */
__nv_bfloat16 *rf__cuda_bf16_updated_by_writer(const float *p, size_t n);

/* cuda_attention.cu */
void rf_cuda_attention_forward(float *out, float *lse, const float *q, const float *k,
                               const float *v, const int32_t *q_off, const int32_t *k_start,
                               const int32_t *k_len, int n_seq, int H, int KVH, int D);
void rf_cuda_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                                const float *q, const float *k, const float *v,
                                const float *out, const float *lse, const int32_t *cu_seqlens,
                                int n_seq, int T, int H, int KVH, int D);

/* Raises a kernel's dynamic shared memory limit to `bytes`. Set whatever the size: without the
 * opt-in a kernel's dynamic limit is 48 KiB less its static shared memory, not 48 KiB. Returns 0
 * after recording a failure. */
template <typename F>
static inline int rf__allow_smem(F *kernel, size_t bytes) {
    if (bytes == 0) return 1;
    return RF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)bytes));
}

/* The x extent of the tiled attention's grids (1..64; blocks stride over their tiles). The
 * forward's query count lives on the device: enough tiles across x to fill the GPU when there
 * are few (sequence, KV head) pairs (the forwards' grids are (x, n_seq, KVH)). The backward:
 * one per tile of `tile` rows of T. */
static inline int rf__flash_forward_gx(int n_seq, int KVH) {
    int pairs = n_seq * KVH, gx = 2048 / (pairs > 0 ? pairs : 1);
    return gx < 1 ? 1 : gx > 64 ? 64 : gx;
}
static inline int rf__flash_backward_gx(int T, int tile) {
    int gx = (T + tile - 1) / tile;
    return gx < 1 ? 1 : gx > 64 ? 64 : gx;
}

/* Where the tiled forwards (cuda_flash.cu, cuda_flash_mma.cu) find key (and value) row j of
 * sequence s and KV head kvh: contiguous rows from k_start[s] (training, a KV cache) ... */
struct kv_rows {
    const int32_t *k_start;
    int KVH, D;
    __device__ size_t at(int s, int kvh, int j) const {
        return ((size_t)(k_start[s] + j) * KVH + kvh) * D;
    }
};
/* ... or through sequence s's row of a block table (the paged KV cache: kernels.h). */
struct kv_paged {
    const int32_t *block_table;
    int max_blocks, block_size, KVH, D;
    __device__ size_t at(int s, int kvh, int j) const {
        size_t b = (size_t)block_table[(size_t)s * max_blocks + j / block_size];
        return ((b * block_size + j % block_size) * KVH + kvh) * D;
    }
};

/* The tiled forwards' tile loads, for fp32 tiles (rounded to bf16 when `bf16`) and bf16 tiles
 * (always rounded, __float2bfloat16_rn). Every thread of the block takes part; rows past n are
 * zero. */
/* Merging two softmax states of a query row (FlashAttention's rescaling): the state of keys A
 * (max m_t, sum l_t, unnormalised output acc_t) with that of the keys B after them (m_c, l_c,
 * acc_c) is max m = max(m_t, m_c), ca = exp(m_t - m), cb = exp(m_c - m), then l_t = fmaf(l_t,
 * ca, l_c cb) and acc_t = fmaf(acc_t, ca, acc_c cb) element by element. The factors, here, for
 * every kernel that merges (the FMA and tensor-core forwards at their chunk boundaries, split
 * decoding's combine), so that all of them round alike; false where both states are empty
 * (nothing to do). Merging an empty state changes nothing; merging into one copies exactly
 * (ca = 0, cb = 1). */
static __device__ inline bool rf__merge_factors(float m_t, float m_c, float *m, float *ca, float *cb) {
    *m = fmaxf(m_t, m_c);
    if (*m == -INFINITY) return false;
    *ca = expf(m_t - *m), *cb = expf(m_c - *m);
    return true;
}

/* Split decoding's chunk states, which both forwards write and cuda_flash.cu's combine reads:
 * part holds m (n states), then l (n), then the unnormalised outputs (n x D), n = n_seq H
 * max_chunks; the state of chunk c of row (sequence s, head h) is at (s H + h) max_chunks + c. */
struct rf__chunk_states {
    float *m, *l, *acc;
    int H, max_chunks;
    __device__ size_t at(int s, int h, int c) const { return ((size_t)s * H + h) * max_chunks + c; }
};
static __device__ inline rf__chunk_states rf__chunk_states_of(const float *part, int n_seq, int H, int max_chunks) {
    size_t n = (size_t)n_seq * H * max_chunks;
    float *m = (float *)part;
    return rf__chunk_states{m, m + n, m + 2 * n, H, max_chunks};
}

static __device__ inline float rf__bf16_round(float x, int bf16) {
    return bf16 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}
static __device__ inline void rf__tile_put(float *t, float x, int bf16) { *t = rf__bf16_round(x, bf16); }
static __device__ inline void rf__tile_put(__nv_bfloat16 *t, float x, int) {
    *t = __float2bfloat16_rn(x);
}
/* tile (rows x D, leading dim ld) = rows p0 .. p0 + n - 1 of sequence s's (query, head) pairs of
 * KV head kvh's group: pair p = query p / group of head kvh group + p % group (q_first: the
 * sequence's first query row). */
template <class T>
static __device__ inline void rf__load_q_pairs(T *tile, int rows, const float *q, int q_first,
                                               int p0, int n, int group, int kvh, int H, int D,
                                               int ld, int bf16) {
    for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
        int r = idx / D, d = idx % D, p = p0 + r;
        size_t row = (size_t)(q_first + p / group) * H + kvh * group + p % group;
        rf__tile_put(tile + r * ld + d, r < n ? q[row * D + d] : 0.0f, bf16);
    }
}
/* tile (rows x D, leading dim ld) = key (or value) rows j0 .. j0 + n - 1 of (s, kvh) in x. */
template <class T, class KV>
static __device__ inline void rf__load_kv_rows(T *tile, int rows, const float *x, const KV &kv,
                                               int s, int kvh, int j0, int n, int D, int ld,
                                               int bf16) {
    for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
        int r = idx / D, d = idx % D;
        rf__tile_put(tile + r * ld + d, r < n ? x[kv.at(s, kvh, j0 + r) + d] : 0.0f, bf16);
    }
}

/* cuda_flash.cu: the tiled (FlashAttention-2) kernels behind attention_forward/backward.
 * rf__cuda_flash_supported: whether they take this shape (D <= RF_FLASH_MAX_D, grid limits);
 * rf__cuda_attention_flash: whether the op should use them (the shape, and RLFLOW_CUDA_ATTENTION
 * not "reference", read at each call so a test can compare both paths in one process). */
int rf__cuda_flash_supported(int n_seq, int H, int KVH, int D);
int rf__cuda_attention_flash(int n_seq, int H, int KVH, int D);
/* How attention rounds (cuda_attention.cu), read at each call. At precision fp32: RF_ATT_FP32,
 * fp32 arithmetic. At precision bf16: RF_ATT_BF16_TC by default (or RLFLOW_CUDA_ATTENTION=bf16:
 * the tensor-core kernels where rf__cuda_flash_mma_supported, the FMA ones with q, k, v and
 * dout rounded as loaded elsewhere); RF_ATT_FP32 under =fp32 (fp32 arithmetic, as on the CPU);
 * RF_ATT_BF16_FMA under =fma (the FMA kernels so rounded, for tests). Decoding's paged kernels
 * follow the same choice, so generation, scoring and training give a token the same log-prob
 * (docs/cuda.md, "Precision"). */
enum { RF_ATT_FP32 = 0, RF_ATT_BF16_FMA = 1, RF_ATT_BF16_TC = 2 };
int rf__cuda_attention_bf16(void);
/* RLFLOW_CUDA_ATTENTION and RLFLOW_CUDA_DECODE hold a known value or are unset; otherwise an
 * error naming the variable (checked at start and when the precision is set). */
rf_status rf__cuda_check_env(void);
/* RLFLOW_CUDA_LOGPROB_MB: the megabytes of logits a log-prob chunk holds (cuda_logprob.cu),
 * 640 unset, -1 for a value that is not a whole number from 1 to 65536. */
int rf__cuda_logprob_mb(void);
void rf__cuda_flash_forward(float *out, float *lse, const float *q, const float *k,
                            const float *v, const int32_t *q_off, const int32_t *k_start,
                            const int32_t *k_len, int n_seq, int H, int KVH, int D);
void rf__cuda_flash_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                             const float *k, const float *v, const float *out, const float *lse,
                             const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH, int D);
/* paged_attention_forward (kernels.h) by the tiled forward above, key tiles read through the
 * block table, decoding steps split over their key chunks where there are few sequences
 * (RLFLOW_CUDA_DECODE=split / =tiled force it): each row gets the bits rf__cuda_flash_forward
 * gives it (same shapes as that). */
void rf__cuda_flash_paged_forward(float *out, const float *q, const float *k_pool,
                                  const float *v_pool, const int32_t *q_off,
                                  const int32_t *block_table, int max_blocks,
                                  const int32_t *k_len, int n_seq, int block_size, int H,
                                  int KVH, int D);
/* cuda_flash_mma.cu: the tensor-core forward and backward at bf16 (head dims multiple of 16,
 * sm_80+, tiles that fit the device's shared memory: rf__cuda_flash_mma_supported), which
 * rf__cuda_flash_forward / _backward take under RF_ATT_BF16_TC; the backward's di (T, H) =
 * dout . out, made by the caller. */
int rf__cuda_flash_mma_supported(int D, int backward);
/* rf__cuda_flash_paged_forward's twins on tensor cores (decoding under RF_ATT_BF16_TC), 1 when
 * launched: the rows of every sequence, or of all but one-query ones (skip_one_query); or the
 * chunk states of one-query sequences' rows into part (m, l (n_seq, H, max_chunks) then acc
 * (n_seq, H, max_chunks, D)), which cuda_flash.cu's combine merges in order. Either way a row
 * gets the bits rf__cuda_flash_forward_mma gives it. */
int rf__cuda_flash_paged_forward_mma(float *out, const float *q, const float *k_pool,
                                     const float *v_pool, const int32_t *q_off,
                                     const int32_t *block_table, int max_blocks,
                                     const int32_t *k_len, int n_seq, int block_size, int H,
                                     int KVH, int D, int skip_one_query);
int rf__cuda_flash_paged_chunks_mma(float *part, const float *q, const float *k_pool,
                                    const float *v_pool, const int32_t *q_off,
                                    const int32_t *block_table, int max_blocks,
                                    const int32_t *k_len, int n_seq, int block_size, int H,
                                    int KVH, int D, int max_chunks);
void rf__cuda_flash_forward_mma(float *out, float *lse, const float *q, const float *k,
                                const float *v, const int32_t *q_off, const int32_t *k_start,
                                const int32_t *k_len, int n_seq, int H, int KVH, int D);
void rf__cuda_flash_backward_mma(float *dq, float *dk, float *dv, const float *dout,
                                 const float *q, const float *k, const float *v, const float *lse,
                                 const float *di, const int32_t *cu_seqlens, int n_seq, int T,
                                 int H, int KVH, int D);

/* cuda_logprob.cu */
void rf_cuda_logprob_forward(float *logp, float *entropy, const float *h, const float *w,
                             const int32_t *targets, int T, int C, int V, float inv_temp);
void rf_cuda_logprob_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                              const float *h, const float *w, const int32_t *targets, int T,
                              int C, int V, float inv_temp);
void rf_cuda_logprob_vp_partials(float *lmax, float *sumexp, float *zsum, float *ztgt, const float *h,
                                 const float *w, const int32_t *targets, int T, int C, int Vl, int v0,
                                 float inv_temp);
void rf_cuda_heads_expand(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group);
void rf_cuda_heads_reduce(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group);

/* cuda_elementwise.cu: out[c] += sum over n of a[n, c] (* b[n, c] where b) (* scale[n] where
 * scale), a and b (N, C): chunks of rows summed in order, then the chunks in order
 * (deterministic). 0 after recording a failure. */
int rf__cuda_colsum(float *out, const float *a, const float *b, const float *scale, int N, int C);

/* cuda_sample.cu */
void rf_cuda_sample_rows(int32_t *picks, float *logp, const float *logits, int V, const rf_row_draw *draws,
                         int n);
void rf_cuda_row_lse(float *lse, const float *logits, int V, const rf_row_draw *draws, int n);
void rf_cuda_logprob_vp_backward(float *dh, float *dw, const float *dlogp, const float *dentropy, const float *lse,
                                 const float *entropy, const float *h, const float *w, const int32_t *targets, int T,
                                 int C, int Vl, int v0, float inv_temp);

/* cuda_paged.cu */
void rf_cuda_paged_kv_write(float *k_pool, float *v_pool, const float *k, const float *v,
                            const int32_t *slots, int T, int KVH, int D);
/* cuda_attention.cu: the tiled or the reference forward over the paged cache */
void rf_cuda_paged_attention_forward(float *out, const float *q, const float *k_pool,
                                     const float *v_pool, const int32_t *q_off,
                                     const int32_t *block_table, int max_blocks,
                                     const int32_t *k_len, int n_seq, int block_size, int H,
                                     int KVH, int D);

#endif
