/* Elementwise ops, reductions, normalisation, RoPE, embedding and AdamW on the GPU: the CUDA
 * twins of the ops in kernels/cpu/cpu_kernels.c, same names, same arguments, same
 * accumulate/overwrite rules. Per-element math comes from kernels/kernel_math.h, so the two
 * back ends share one formula for each op. */
#include <math.h>

#include <cuda_bf16.h>

#include <pthread.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/kernel_math.h"

/* Grid-stride loop over n elements. */
#define RF_FOR_EACH(i, n)                                                            \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (size_t)gridDim.x * blockDim.x)

/* ---- add, scale, sum of squares ---- */

static __global__ void add_inplace_kernel(float *a, const float *b, size_t n) {
    RF_FOR_EACH(i, n) a[i] += b[i];
}

void rf_cuda_add_inplace(float *a, const float *b, size_t n) {
    RF_CUDA_GUARD();
    if (n == 0) return;
    add_inplace_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(a, b, n);
    RF_CUDA_LAUNCH_CHECK();
    rf__cuda_bf16_invalidate(a, n * sizeof(float)); /* after the write is queued */
}

static __global__ void scale_kernel(float *x, float s, size_t n) {
    RF_FOR_EACH(i, n) x[i] *= s;
}

void rf_cuda_scale(float *x, float s, size_t n) {
    RF_CUDA_GUARD();
    if (n == 0) return;
    scale_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(x, s, n);
    RF_CUDA_LAUNCH_CHECK();
    rf__cuda_bf16_invalidate(x, n * sizeof(float)); /* after the write is queued */
}

/* Pass 1: each of RF_CUDA_REDUCE_BLOCKS blocks writes one partial sum (in double, as on the
 * CPU). Pass 2: one block adds the partials into partials[RF_CUDA_REDUCE_BLOCKS]. A fixed
 * grid and fixed reduction order make the result deterministic (no atomics). */
static __global__ void sum_squares_partial_kernel(double *partials, const float *x, size_t n) {
    __shared__ double shared[32];
    double s = 0.0;
    RF_FOR_EACH(i, n) s += (double)x[i] * (double)x[i];
    s = rf__block_sum(s, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

static __global__ void sum_squares_final_kernel(double *partials, int n_partials) {
    __shared__ double shared[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) s += partials[i];
    s = rf__block_sum(s, shared);
    if (threadIdx.x == 0) partials[n_partials] = s;
}

/* One caller at a time: the partials are one buffer, and another thread's passes queued between
 * this call's would overwrite them. */
static pthread_mutex_t g_sum_lock = PTHREAD_MUTEX_INITIALIZER;

static double sum_squares_locked(const float *x, size_t n) {
    double result = NAN;
    sum_squares_partial_kernel<<<RF_CUDA_REDUCE_BLOCKS, RF_CUDA_THREADS, 0, rf__cuda.stream>>>(
        rf__cuda.partials, x, n);
    if (!RF_CUDA_LAUNCH_CHECK()) return NAN;
    sum_squares_final_kernel<<<1, RF_CUDA_THREADS, 0, rf__cuda.stream>>>(rf__cuda.partials,
                                                                         RF_CUDA_REDUCE_BLOCKS);
    if (!RF_CUDA_LAUNCH_CHECK()) return NAN;
    if (!RF_CUDA_CHECK(cudaMemcpyAsync(&result, rf__cuda.partials + RF_CUDA_REDUCE_BLOCKS,
                                       sizeof(double), cudaMemcpyDeviceToHost, rf__cuda.stream)))
        return NAN;
    if (!RF_CUDA_CHECK(cudaStreamSynchronize(rf__cuda.stream))) return NAN;
    return result;
}

double rf_cuda_sum_squares(const float *x, size_t n) {
    RF_CUDA_GUARD(NAN);
    if (n == 0) return 0.0;
    pthread_mutex_lock(&g_sum_lock);
    double r = sum_squares_locked(x, n);
    pthread_mutex_unlock(&g_sum_lock);
    return r;
}

/* ---- embedding ---- */

static __global__ void embedding_forward_kernel(float *out, const int32_t *tokens,
                                                const float *wte, int T, int C) {
    RF_FOR_EACH(i, (size_t)T * C) {
        size_t t = i / C, c = i % C;
        out[i] = tokens[t] >= 0 ? wte[(size_t)tokens[t] * C + c] : 0.0f;
    }
}

void rf_cuda_embedding_forward(float *out, const int32_t *tokens, const float *wte, int T,
                               int C) {
    RF_CUDA_GUARD();
    size_t n = (size_t)T * C;
    if (n == 0) return;
    embedding_forward_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(
        out, tokens, wte, T, C);
    RF_CUDA_LAUNCH_CHECK();
}

/* Repeated tokens add into the same row. For the CPU's sums, in its order (serial over tokens:
 * the same bits, run after run), each token's row is added by the chain of its occurrences:
 * next[t] = the next position with the same token (-1: none), head[t] = whether t is the
 * first. An atomicAdd per element, as before, added repeats in an order of the moment: runs of
 * the same recipe on a GPU drifted apart from the first step. */
#define EMB_TILE 256
static __global__ void embedding_chain_kernel(int32_t *next, int32_t *head, const int32_t *tokens, int T) {
    __shared__ int32_t tile[EMB_TILE];
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int32_t mine = t < T ? tokens[t] : -1, nx = -1, first = 1;
    for (int base = 0; base < T; base += EMB_TILE) {
        __syncthreads();
        if (base + (int)threadIdx.x < T) tile[threadIdx.x] = tokens[base + threadIdx.x];
        __syncthreads();
        int n = min(EMB_TILE, T - base);
        for (int j = 0; j < n; j++) {
            int u = base + j;
            if (tile[j] != mine) continue;
            if (u < t) first = 0;
            else if (u > t && nx < 0) nx = u;
        }
    }
    if (t < T) next[t] = nx, head[t] = mine >= 0 && first;
}

static __global__ void embedding_backward_kernel(float *dwte, const float *dout, const int32_t *tokens,
                                                 const int32_t *next, const int32_t *head, int T, int C) {
    RF_FOR_EACH(i, (size_t)T * C) {
        size_t t = i / C, c = i % C;
        if (!head[t]) continue;
        float *w = dwte + (size_t)tokens[t] * C + c, acc = *w;
        for (int u = (int)t; u >= 0; u = next[u]) acc += dout[(size_t)u * C + c];
        *w = acc;
    }
}

void rf_cuda_embedding_backward(float *dwte, const float *dout, const int32_t *tokens, int T,
                                int C) {
    RF_CUDA_GUARD();
    size_t n = (size_t)T * C;
    if (n == 0) return;
    cudaStream_t st = rf__cuda.stream;
    int32_t *chain = NULL; /* next (T), head (T): stream-ordered scratch */
    if (!RF_CUDA_CHECK(cudaMallocAsync((void **)&chain, sizeof(int32_t) * 2 * (size_t)T, st))) return;
    embedding_chain_kernel<<<(T + EMB_TILE - 1) / EMB_TILE, EMB_TILE, 0, st>>>(chain, chain + T, tokens, T);
    if (RF_CUDA_LAUNCH_CHECK()) {
        embedding_backward_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, st>>>(dwte, dout, tokens, chain,
                                                                                 chain + T, T, C);
        RF_CUDA_LAUNCH_CHECK();
    }
    RF_CUDA_CHECK(cudaFreeAsync(chain, st));
}

/* ---- grouped-query heads of a tensor-parallel rank ---- */

static __global__ void heads_expand_kernel(float *dst, const float *src, int T, int H, int KV, int D, int h0,
                                           int group) {
    RF_FOR_EACH(e, (size_t)T * H * D) {
        size_t t = e / ((size_t)H * D), i = e / D % H, d = e % D;
        dst[e] = src[((size_t)t * KV + (h0 + i) / group - h0 / group) * D + d];
    }
}

void rf_cuda_heads_expand(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group) {
    RF_CUDA_GUARD();
    size_t n = (size_t)T * H * D;
    if (n == 0) return;
    heads_expand_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(dst, src, T, H, KV, D, h0, group);
    RF_CUDA_LAUNCH_CHECK();
}

/* One thread per output element, summing its query heads in order: the CPU's order, no atomics. */
static __global__ void heads_reduce_kernel(float *dst, const float *src, int T, int H, int KV, int D, int h0,
                                           int group) {
    RF_FOR_EACH(e, (size_t)T * KV * D) {
        size_t t = e / ((size_t)KV * D), j = e / D % KV, d = e % D;
        float acc = 0.0f;
        for (int i = 0; i < H; i++)
            if ((h0 + i) / group - h0 / group == (int)j) acc += src[((size_t)t * H + i) * D + d];
        dst[e] = acc;
    }
}

void rf_cuda_heads_reduce(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group) {
    RF_CUDA_GUARD();
    size_t n = (size_t)T * KV * D;
    if (n == 0) return;
    heads_reduce_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(dst, src, T, H, KV, D, h0, group);
    RF_CUDA_LAUNCH_CHECK();
}

/* ---- RMSNorm ---- */

/* One block per row. */
static __global__ void rmsnorm_forward_kernel(float *out, float *rstd, const float *inp,
                                              const float *w, int C, float eps) {
    __shared__ float shared[32];
    int n = blockIdx.x;
    const float *x = inp + (size_t)n * C;
    float *y = out + (size_t)n * C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) ss += x[c] * x[c];
    ss = rf__block_sum(ss, shared);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) y[c] = x[c] * r * w[c];
    if (rstd && threadIdx.x == 0) rstd[n] = r;
}

void rf_cuda_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w, int N,
                             int C, float eps) {
    RF_CUDA_GUARD();
    if (N <= 0 || C <= 0) return;
    rmsnorm_forward_kernel<<<N, RF_CUDA_THREADS, 0, rf__cuda.stream>>>(out, rstd, inp, w, C,
                                                                       eps);
    RF_CUDA_LAUNCH_CHECK();
}

/* The residual add fused with RMSNorm: one block per row; each thread re-reads only the
 * elements it wrote itself. */
static __global__ void add_rmsnorm_forward_kernel(float *x, float *out, float *rstd, const float *add,
                                                  const float *w, int C, float eps) {
    __shared__ float shared[32];
    int n = blockIdx.x;
    float *xr = x + (size_t)n * C, *y = out + (size_t)n * C;
    const float *ar = add + (size_t)n * C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = xr[c] + ar[c];
        xr[c] = v;
        ss += v * v;
    }
    ss = rf__block_sum(ss, shared);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) y[c] = xr[c] * r * w[c];
    if (rstd && threadIdx.x == 0) rstd[n] = r;
}

void rf_cuda_add_rmsnorm_forward(float *x, float *out, float *rstd, const float *add, const float *w, int N,
                                 int C, float eps) {
    RF_CUDA_GUARD();
    if (N <= 0 || C <= 0) return;
    add_rmsnorm_forward_kernel<<<N, RF_CUDA_THREADS, 0, rf__cuda.stream>>>(x, out, rstd, add, w, C, eps);
    RF_CUDA_LAUNCH_CHECK();
}

/* dinp: one block per row, accumulating (+=) as on the CPU. */
static __global__ void rmsnorm_backward_dinp_kernel(float *dinp, const float *dout,
                                                    const float *inp, const float *w,
                                                    const float *rstd, int C) {
    __shared__ float shared[32];
    int n = blockIdx.x;
    const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
    float *dx = dinp + (size_t)n * C;
    float r = rstd[n], dot = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dot += dy[c] * w[c] * x[c];
    dot = rf__block_sum(dot, shared);
    float k = dot * r * r * r / (float)C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dx[c] += r * w[c] * dy[c] - k * x[c];
}

/* ---- column sums: out[c] += sum over rows n of a[n, c] (* b[n, c]) (* scale[n]) ----
 * One thread per column walking every row left a qk-norm's 64 columns over T x H rows (65 k at
 * 4096 tokens and 16 heads) to 64 threads. Rows are cut into chunks of RF_COLSUM_ROWS: a
 * thread per (chunk, column) sums its chunk's rows in order, then a thread per column adds the
 * chunks' sums in chunk order. No atomics: deterministic; up to one chunk it is the CPU's loop,
 * beyond the order of the sums differs from the CPU's single chain. */
#define RF_COLSUM_ROWS 256

static __global__ void colsum_chunks_kernel(float *part, const float *a, const float *b, const float *scale,
                                            int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, n0 = blockIdx.y * RF_COLSUM_ROWS;
    if (c >= C) return;
    int n1 = min(N, n0 + RF_COLSUM_ROWS);
    float s = 0.0f;
    for (int n = n0; n < n1; n++) {
        float v = a[(size_t)n * C + c];
        if (b) v *= b[(size_t)n * C + c];
        if (scale) v *= scale[n];
        s += v;
    }
    part[(size_t)blockIdx.y * C + c] = s;
}

static __global__ void colsum_final_kernel(float *out, const float *part, int chunks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.0f;
    for (int k = 0; k < chunks; k++) s += part[(size_t)k * C + c];
    out[c] += s;
}

int rf__cuda_colsum(float *out, const float *a, const float *b, const float *scale, int N, int C) {
    if (N <= 0 || C <= 0) return 1;
    int chunks = (N + RF_COLSUM_ROWS - 1) / RF_COLSUM_ROWS;
    if (chunks > 65535) return rf__cuda_fail("column sums", "more than 65535 chunks of rows", __FILE__, __LINE__);
    cudaStream_t st = rf__cuda.stream;
    float *part = NULL;
    if (!RF_CUDA_CHECK(cudaMallocAsync((void **)&part, sizeof(float) * (size_t)chunks * C, st))) return 0;
    unsigned cb = (unsigned)((C + RF_CUDA_THREADS - 1) / RF_CUDA_THREADS);
    colsum_chunks_kernel<<<dim3(cb, (unsigned)chunks), RF_CUDA_THREADS, 0, st>>>(part, a, b, scale, N, C);
    int ok = RF_CUDA_LAUNCH_CHECK();
    if (ok) {
        colsum_final_kernel<<<cb, RF_CUDA_THREADS, 0, st>>>(out, part, chunks, C);
        ok = RF_CUDA_LAUNCH_CHECK();
    }
    RF_CUDA_CHECK(cudaFreeAsync(part, st));
    return ok;
}

void rf_cuda_rmsnorm_backward(float *dinp, float *dw, const float *dout, const float *inp,
                              const float *w, const float *rstd, int N, int C) {
    RF_CUDA_GUARD();
    if (N <= 0 || C <= 0) return;
    rmsnorm_backward_dinp_kernel<<<N, RF_CUDA_THREADS, 0, rf__cuda.stream>>>(dinp, dout, inp, w,
                                                                             rstd, C);
    if (!RF_CUDA_LAUNCH_CHECK() || !dw) return; /* dw NULL: a frozen norm (LoRA) */
    rf__cuda_colsum(dw, dout, inp, rstd, N, C); /* dw[c] += sum_n dout x rstd, the CPU's order of factors */
}

/* ---- RoPE: one thread per rotated pair (t, h, i) ---- */

static __global__ void rope_kernel(float *x, const int32_t *pos, const float *inv_freq, int T,
                                   int H, int D, int sign) {
    int half = D / 2;
    RF_FOR_EACH(idx, (size_t)T * H * half) {
        size_t i = idx % half, th = idx / half, t = th / H;
        float *xh = x + th * D;
        rf_rope_pair(xh + i, xh + i + half, (float)pos[t] * inv_freq[i], sign);
    }
}

void rf_cuda_rope(float *x, const int32_t *pos, const float *inv_freq, int T, int H, int D,
                  int sign) {
    RF_CUDA_GUARD();
    size_t n = (size_t)T * H * (D / 2);
    if (n == 0) return;
    rope_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(x, pos, inv_freq,
                                                                             T, H, D, sign);
    RF_CUDA_LAUNCH_CHECK();
}

/* q's H heads and k's KVH heads of each position in one launch: one thread per rotated pair
 * (t, head of H + KVH, i). */
static __global__ void rope_qk_kernel(float *q, float *k, const int32_t *pos, const float *inv_freq, int T,
                                      int H, int KVH, int D, int sign) {
    int half = D / 2, HK = H + KVH;
    RF_FOR_EACH(idx, (size_t)T * HK * half) {
        size_t i = idx % half, th = idx / half, t = th / HK, h = th % HK;
        float *xh = h < (size_t)H ? q + (t * H + h) * D : k + (t * KVH + (h - H)) * D;
        rf_rope_pair(xh + i, xh + i + half, (float)pos[t] * inv_freq[i], sign);
    }
}

void rf_cuda_rope_qk(float *q, float *k, const int32_t *pos, const float *inv_freq, int T, int H, int KVH,
                     int D, int sign) {
    RF_CUDA_GUARD();
    size_t n = (size_t)T * (H + KVH) * (D / 2);
    if (n == 0) return;
    rope_qk_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(q, k, pos, inv_freq, T, H, KVH, D,
                                                                              sign);
    RF_CUDA_LAUNCH_CHECK();
}

/* ---- SwiGLU ---- */

static __global__ void swiglu_forward_kernel(float *out, const float *gate, const float *up,
                                             size_t n) {
    RF_FOR_EACH(i, n) out[i] = rf_swiglu(gate[i], up[i]);
}

void rf_cuda_swiglu_forward(float *out, const float *gate, const float *up, size_t n) {
    RF_CUDA_GUARD();
    if (n == 0) return;
    swiglu_forward_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(
        out, gate, up, n);
    RF_CUDA_LAUNCH_CHECK();
}

static __global__ void swiglu_backward_kernel(float *dgate, float *dup, const float *dout,
                                              const float *gate, const float *up, size_t n) {
    RF_FOR_EACH(i, n) rf_swiglu_grad(gate[i], up[i], dout[i], dgate + i, dup + i);
}

void rf_cuda_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, size_t n) {
    RF_CUDA_GUARD();
    if (n == 0) return;
    swiglu_backward_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(
        dgate, dup, dout, gate, up, n);
    RF_CUDA_LAUNCH_CHECK();
}

/* ---- AdamW ---- */

/* AdamW over one tensor, the gradient scaled by gs (clipping folded in); when bf16 is not NULL
 * it also writes the updated weight's bf16 copy (the one the bf16 products and the colocated
 * rollout read), so no conversion pass follows. */
static __global__ void adamw_kernel(float *param, __nv_bfloat16 *bf16, const float *grad,
                                    float *m, float *v, size_t n, float lr, float beta1,
                                    float beta2, float eps, float wd, float bc1, float bc2,
                                    float gs) {
    RF_FOR_EACH(i, n) {
        float p = rf_adamw_elem(param[i], grad[i] * gs, m + i, v + i, lr, beta1, beta2, eps, wd,
                                bc1, bc2);
        param[i] = p;
        if (bf16) bf16[i] = __float2bfloat16_rn(p);
    }
}

void rf_cuda_adamw(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                   float beta1, float beta2, float eps, float weight_decay, int step,
                   float grad_scale) {
    RF_CUDA_GUARD();
    if (n == 0) return;
    __nv_bfloat16 *copy = rf__cuda_bf16_updated_by_writer(param, n);
    /* Bias corrections on the host in double, exactly as the CPU back end computes them. */
    float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
    float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
    adamw_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, rf__cuda.stream>>>(
        param, copy, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale);
    RF_CUDA_LAUNCH_CHECK();
}
