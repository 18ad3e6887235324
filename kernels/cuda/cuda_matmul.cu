/* Matrix products on the GPU through cuBLAS (cublasGemmEx: TF32, fp32 or bf16 operands; row-major, HF Linear weight layout): the
 * CUDA twin of kernels/cpu/cpu_matmul.c.
 *
 * Row-major <-> column-major. cuBLAS is column-major. A row-major (R, K) matrix with leading
 * dimension K is, read column-major, its transpose (K, R) with the same leading dimension. So
 * to get a row-major product out = A @ B we ask cuBLAS for out^T = B^T @ A^T, passing the row-
 * major buffers as they are: swap the operands, keep every leading dimension equal to the
 * row-major row length, and swap m and n. The three products the back end needs:
 *
 *  1. out (T, OC) = x (T, C) @ w (OC, C)^T          [forward; logits]
 *     col-major: out^T (OC, T) = w (OC, C) @ x^T (C, T)
 *     w's buffer reads as w^T (C, OC), ld C -> op T;  x's reads as x^T (C, T), ld C -> op N
 *     sgemm(T, N, m=OC, n=T, k=C, A=w, lda=C, B=x, ldb=C, C=out, ldc=OC)
 *
 *  2. out (T, C) = x (T, OC) @ w (OC, C)              [dinp; dh]
 *     col-major: out^T (C, T) = w^T (C, OC) @ x^T (OC, T)
 *     w's buffer reads as w^T (C, OC), ld C -> op N;  x's reads as x^T (OC, T), ld OC -> op N
 *     sgemm(N, N, m=C, n=T, k=OC, A=w, lda=C, B=x, ldb=OC, C=out, ldc=C)
 *
 *  3. out (OC, C) = x (T, OC)^T @ y (T, C)            [dw]
 *     col-major: out^T (C, OC) = y^T (C, T) @ x (T, OC)
 *     y's buffer reads as y^T (C, T), ld C -> op N;   x's reads as x^T (OC, T), ld OC -> op T
 *     sgemm(N, T, m=C, n=OC, k=T, A=y, lda=C, B=x, ldb=OC, C=out, ldc=C)
 *
 * beta = 1 accumulates into out (dw +=, bias pre-filled), beta = 0 overwrites (dinp). */
#include <cuda_bf16.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

/* ---- precision ----
 * fp32: cublasGemmEx on fp32 operands with CUBLAS_COMPUTE_32F_FAST_TF32 (tensor cores, inputs
 * rounded to TF32's 10-bit mantissa, fp32 accumulation) unless RLFLOW_CUDA_TF32=0, which gives
 * plain fp32 (CUBLAS_COMPUTE_32F), the CPU back end's result to fp32 rounding.
 * bf16: both operands rounded to bf16 (round to nearest even, __float2bfloat16_rn), products on
 * tensor cores with CUBLAS_COMPUTE_32F (fp32 accumulation), fp32 output. A weight operand comes
 * from a bf16 copy kept per weight tensor (the cache below), made once per update; an
 * activation operand is converted into a scratch buffer at each call. */

rf_status rf__cuda_set_precision(rf_precision p) {
    if (p != RF_PRECISION_FP32 && p != RF_PRECISION_BF16)
        return rf_error(RF_ERR_UNSUPPORTED, "cuda: unknown precision %d", (int)p);
    rf_status st = rf__cuda_check_env();
    if (st != RF_OK) return st;
    const char *e = getenv("RLFLOW_CUDA_TF32");
    rf__cuda.tf32 = !(e && strcmp(e, "0") == 0);
    rf__cuda.precision = p;
    return RF_OK;
}

/* One bf16 copy of a weight tensor (src, n floats). */
typedef struct {
    const float *src;
    size_t n;
    __nv_bfloat16 *copy; /* (n) device */
    int valid;           /* 0: src was written since the copy was made */
    int fresh;           /* rewritten by the kernel that wrote src (AdamW) since the last
                            weights_updated: that call keeps it */
} bf16_entry;

#define RF_BF16_CACHE_MAX 4096 /* weight tensors with a copy; more fall back to scratch */
/* The cache and the scratch are shared by the threads that use the back end (a colocated
 * rollout thread and the training thread): g_lock guards them, and is held across a bf16
 * product's conversions and its enqueue, so that another thread's conversion into the same
 * scratch is queued after this product on the one stream. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static bf16_entry g_cache[RF_BF16_CACHE_MAX];
static int g_cache_n;
/* Scratch for activation operands: two, since dw's product converts both of its operands. */
static __nv_bfloat16 *g_scratch[2];
static size_t g_scratch_n[2];
/* What scratch 0 holds: the B operand (src, n floats) a product converted last (only B
 * operands go there). A backward's dw product reads the output gradient its dinp product just
 * converted (rf__cuda_gemm_xtw_again): then the conversion is not made again. */
static const float *g_held_src;
static size_t g_held_n;

static void invalidate_locked(const void *p, size_t bytes) {
    const char *a = (const char *)p, *b = a + bytes;
    for (int i = 0; i < g_cache_n; i++) {
        const char *s = (const char *)g_cache[i].src, *e = s + g_cache[i].n * sizeof(float);
        if (s < b && a < e) g_cache[i].valid = 0, g_cache[i].fresh = 0;
    }
}

extern "C" void rf__cuda_bf16_invalidate(const void *p, size_t bytes) {
    pthread_mutex_lock(&g_lock);
    invalidate_locked(p, bytes);
    pthread_mutex_unlock(&g_lock);
}

__nv_bfloat16 *rf__cuda_bf16_updated_by_writer(const float *p, size_t n) {
    __nv_bfloat16 *copy = NULL;
    pthread_mutex_lock(&g_lock);
    invalidate_locked(p, n * sizeof(float));
    for (int i = 0; i < g_cache_n && !copy; i++)
        if (g_cache[i].src == p && g_cache[i].n == n) {
            g_cache[i].valid = g_cache[i].fresh = 1; /* the writer's kernel refreshes it */
            copy = g_cache[i].copy;
        }
    pthread_mutex_unlock(&g_lock);
    return copy;
}

/* weights_updated: every copy stale but those the writer of their weight refreshed since the
 * last call (AdamW writes the weight and its copy in one kernel, and the optimizer calls
 * weights_updated right after it: without this every copy was made again at the next step's
 * first products, a pass over all weights a step). */
void rf__cuda_bf16_invalidate_all(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_cache_n; i++) {
        if (!g_cache[i].fresh) g_cache[i].valid = 0;
        g_cache[i].fresh = 0;
    }
    pthread_mutex_unlock(&g_lock);
}

/* Freed memory may come back from a later alloc holding other data: copies made from p are
 * released, and every other copy is marked stale (p's size is not known here, and a copy of a
 * tensor inside p must not outlive it). */
void rf__cuda_bf16_forget(const void *p) {
    pthread_mutex_lock(&g_lock);
    int w = 0;
    for (int i = 0; i < g_cache_n; i++) {
        if (g_cache[i].src == p) {
            cudaFree(g_cache[i].copy);
            continue;
        }
        g_cache[i].valid = 0;
        g_cache[w++] = g_cache[i];
    }
    g_cache_n = w;
    pthread_mutex_unlock(&g_lock);
}

static __global__ void to_bf16_kernel(__nv_bfloat16 *dst, const float *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

static int to_bf16(__nv_bfloat16 *dst, const float *src, size_t n) {
    if (n == 0) return 1;
    to_bf16_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(dst, src, n);
    return RF_CUDA_LAUNCH_CHECK();
}

/* An activation operand (n floats) in bf16, in scratch buffer `which`; NULL after a failure. */
static const __nv_bfloat16 *bf16_scratch(int which, const float *src, size_t n) {
    if (g_scratch_n[which] < n) {
        /* cudaFree waits for the device: no queued product still reads the old buffer */
        if (g_scratch[which] && !RF_CUDA_CHECK(cudaFree(g_scratch[which]))) return NULL;
        g_scratch[which] = NULL, g_scratch_n[which] = 0;
        cudaError_t e = cudaMalloc((void **)&g_scratch[which], n * sizeof(__nv_bfloat16));
        if (e == cudaErrorMemoryAllocation) { /* not a broken device: the caller runs fp32 */
            (void)cudaGetLastError();
            g_scratch[which] = NULL;
            return NULL;
        }
        if (!RF_CUDA_CHECK(e)) return NULL;
        g_scratch_n[which] = n;
    }
    return to_bf16(g_scratch[which], src, n) ? g_scratch[which] : NULL;
}

/* A weight operand (n floats) in bf16: its cached copy, remade when stale. */
static const __nv_bfloat16 *bf16_weight(const float *src, size_t n, int spare) {
    for (int i = 0; i < g_cache_n; i++) {
        bf16_entry *e = &g_cache[i];
        if (e->src != src || e->n != n) continue;
        if (!e->valid) {
            if (!to_bf16(e->copy, src, n)) return NULL;
            e->valid = 1;
        }
        return e->copy;
    }
    if (g_cache_n == RF_BF16_CACHE_MAX) return bf16_scratch(spare, src, n);
    __nv_bfloat16 *copy = NULL;
    if (cudaMalloc((void **)&copy, n * sizeof(__nv_bfloat16)) != cudaSuccess) {
        (void)cudaGetLastError(); /* out of memory for the copy: convert at each call instead */
        return bf16_scratch(spare, src, n);
    }
    if (!to_bf16(copy, src, n)) {
        cudaFree(copy);
        return NULL;
    }
    g_cache[g_cache_n++] = (bf16_entry){src, n, copy, 1, 0};
    return copy;
}

/* Column-major C (m, n) = alpha op(A) op(B) + beta C (cuBLAS's convention; the row-major
 * mapping is above). na, nb: the floats of A's and B's buffers; a_weight: A is a weight (its
 * bf16 copy is cached), otherwise both are activations. */
static int gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha,
                const float *A, int lda, size_t na, int a_weight, const float *B, int ldb,
                size_t nb, float beta, float *C, int ldc, int b_again) {
    if (rf__cuda.precision == RF_PRECISION_BF16) {
        pthread_mutex_lock(&g_lock);
        const __nv_bfloat16 *a = a_weight ? bf16_weight(A, na, 1) : bf16_scratch(1, A, na);
        const __nv_bfloat16 *b = NULL;
        if (a && b_again && g_held_src == B && g_held_n == nb) {
            b = g_scratch[0]; /* converted by the previous product, B unchanged since (caller) */
        } else if (a) {
            g_held_src = NULL;
            b = bf16_scratch(0, B, nb);
            if (b) g_held_src = B, g_held_n = nb;
        }
        int ok = a && b &&
                 RF_CUBLAS_CHECK(cublasGemmEx(rf__cuda.blas, ta, tb, m, n, k, &alpha, a,
                                              CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &beta, C,
                                              CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                                              CUBLAS_GEMM_DEFAULT));
        pthread_mutex_unlock(&g_lock);
        if (ok || rf__cuda.failed) return ok;
        /* no device memory for a bf16 operand (the KV cache took it): this product in fp32 */
        static int warned;
        if (!warned++)
            fprintf(stderr, "rlflow: cuda: no device memory for a bf16 operand of %zu floats: such products "
                            "run with fp32 operands\n", a ? nb : na);
    }
    cublasComputeType_t ct = rf__cuda.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    return RF_CUBLAS_CHECK(cublasGemmEx(rf__cuda.blas, ta, tb, m, n, k, &alpha, A, CUDA_R_32F,
                                        lda, B, CUDA_R_32F, ldb, &beta, C, CUDA_R_32F, ldc, ct,
                                        CUBLAS_GEMM_DEFAULT));
}

int rf__cuda_gemm_xwt(float *out, const float *x, const float *w, int T, int C, int OC,
                      float alpha, float beta) {
    return gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, T, C, alpha, w, C, (size_t)OC * C, 1, x, C,
                (size_t)T * C, beta, out, OC, 0);
}

int rf__cuda_gemm_xw(float *out, const float *x, const float *w, int T, int C, int OC,
                     float alpha, float beta) {
    return gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, T, OC, alpha, w, C, (size_t)OC * C, 1, x, OC,
                (size_t)T * OC, beta, out, C, 0);
}

int rf__cuda_gemm_xtw(float *out, const float *x, const float *y, int T, int C, int OC,
                      float alpha, float beta) {
    return gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, T, alpha, y, C, (size_t)T * C, 0, x, OC,
                (size_t)T * OC, beta, out, C, 0);
}

int rf__cuda_gemm_xtw_again(float *out, const float *x, const float *y, int T, int C, int OC,
                            float alpha, float beta) {
    return gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, T, alpha, y, C, (size_t)T * C, 0, x, OC,
                (size_t)T * OC, beta, out, C, 1);
}

/* out (T, OC): every row = bias (then sgemm adds the product with beta = 1, as on the CPU). */
static __global__ void fill_bias_kernel(float *out, const float *bias, int T, int OC) {
    size_t n = (size_t)T * OC;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = bias[i % OC];
}

void rf_cuda_matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                            int T, int C, int OC) {
    RF_CUDA_GUARD();
    if (T == 0 || OC == 0) return;
    if (C == 0) { /* an empty sum: the bias (or zeros), as on the CPU */
        if (bias) fill_bias_kernel<<<rf__cuda_blocks((size_t)T * OC), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(out, bias, T, OC);
        else RF_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float) * (size_t)T * OC, rf__cuda.stream));
        RF_CUDA_LAUNCH_CHECK();
        return;
    }
    if (bias) {
        fill_bias_kernel<<<rf__cuda_blocks((size_t)T * OC), RF_CUDA_THREADS, 0,
                           rf__cuda.stream>>>(out, bias, T, OC);
        if (!RF_CUDA_LAUNCH_CHECK()) return;
    }
    rf__cuda_gemm_xwt(out, inp, w, T, C, OC, 1.0f, bias ? 1.0f : 0.0f);
}

void rf_cuda_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                             const float *inp, const float *w, int T, int C, int OC) {
    RF_CUDA_GUARD();
    if (T == 0 || C == 0 || OC == 0) { /* empty sums: dinp zeros, dw and dbias unchanged */
        if (T && C && dinp) RF_CUDA_CHECK(cudaMemsetAsync(dinp, 0, sizeof(float) * (size_t)T * C, rf__cuda.stream));
        return;
    }
    if (dinp && !rf__cuda_gemm_xw(dinp, dout, w, T, C, OC, 1.0f, 0.0f)) return;
    if (dw && !(dinp ? rf__cuda_gemm_xtw_again : rf__cuda_gemm_xtw)(dw, dout, inp, T, C, OC, 1.0f, 1.0f)) return;
    if (dbias) rf__cuda_colsum(dbias, dout, NULL, NULL, T, OC); /* column sums of dout */
}
