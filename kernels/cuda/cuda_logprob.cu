/* Fused LM head + per-token log-prob and entropy of given tokens on the GPU: the CUDA twin of
 * kernels/cpu/cpu_logprob.c.
 *
 * As on the CPU, the logits of a chunk of tokens are produced by one sgemm into a scratch
 * buffer of (chunk, V) floats, reduced row by row (one block per row; float exponentials
 * summed in double, like the CPU), and dropped, so memory stays O(chunk * V). The GPU's chunks
 * are as many rows as 640 MB of logits hold (RLFLOW_CUDA_LOGPROB_MB), 256 to 4096 (1024 at
 * Qwen2.5's 151 936 ids): the
 * backward's dW += dz^T h reads and writes the whole (V, C) gradient once per chunk, which at
 * chunks of 256 rows moved 17 GB a qwen0.5b step (4096 tokens) for 3.3 TFLOP of products, and
 * larger products run closer to peak.
 * The scratch comes from cudaMallocAsync on the back end's stream, so it costs no
 * synchronisation and the driver's pool reuses it from call to call. */
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/kernel_math.h"

/* Log-sum-exp and entropy of logits row zr (V), for the whole block; the CPU chunk_logits
 * reduction: H = lse - sum p z = log(sum) - sum e (z - m) / sum, with e = exp(z - m). */
static __device__ void row_stats(const float *zr, int V, float *lse, float *ent) {
    float m;
    double sum, wsum;
    rf__row_softmax_sums(zr, V, 1.0f, &m, &sum, &wsum);
    *lse = m + (float)log(sum);
    *ent = (float)(log(sum) - wsum / sum);
}

/* z row zr (V) becomes dL/d(raw logits) = inv_temp * dL/dz, given the row's lse and entropy
 * (over the whole vocabulary) and its target column tgt (outside [0, V): none here). The
 * caller's reads of the row must be done (a barrier) before. */
static __device__ void row_dlogits(float *zr, int V, float lse, float ent, int tgt, float dl, float de,
                                   float inv_temp) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float lp = zr[j] - lse;
        zr[j] = inv_temp * rf_logprob_dlogit(expf(lp), lp, ent, j == tgt, dl, de);
    }
}

/* One block per row r of the chunk: logp[r] = z[r, target] - lse, entropy[r] = H. */
static __global__ void logprob_forward_kernel(float *logp, float *entropy, const float *z,
                                              const int32_t *targets, int V) {
    int r = blockIdx.x;
    const float *zr = z + (size_t)r * V;
    float lse, ent;
    row_stats(zr, V, &lse, &ent);
    if (threadIdx.x == 0) {
        logp[r] = zr[targets[r]] - lse;
        if (entropy) entropy[r] = ent;
    }
}

/* One block per row: z becomes dL/d(raw logits) = inv_temp * dL/dz. row_stats ends with a
 * barrier, so every read of the row is done before any thread overwrites it. */
static __global__ void logprob_backward_kernel(float *z, const float *dlogp,
                                               const float *dentropy, const int32_t *targets,
                                               int V, float inv_temp) {
    int r = blockIdx.x;
    float *zr = z + (size_t)r * V;
    float lse, ent;
    row_stats(zr, V, &lse, &ent);
    row_dlogits(zr, V, lse, ent, targets[r], dlogp ? dlogp[r] : 0.0f, dentropy ? dentropy[r] : 0.0f, inv_temp);
}

/* Vocabulary-parallel partials, one block per row of the chunk (rf_cpu_logprob_vp_partials):
 * this slice's max, sum of exp, sum of exp times (z - max), and the target's logit when the
 * target is in [v0, v0 + Vl). */
static __global__ void logprob_vp_partials_kernel(float *lmax, float *sumexp, float *zsum, float *ztgt,
                                                  const float *z, const int32_t *targets, int Vl, int v0) {
    int r = blockIdx.x;
    const float *zr = z + (size_t)r * Vl;
    float m;
    double sum, wsum;
    rf__row_softmax_sums(zr, Vl, 1.0f, &m, &sum, &wsum);
    if (threadIdx.x == 0) {
        int tgt = targets[r] - v0;
        lmax[r] = m, sumexp[r] = (float)sum, zsum[r] = (float)wsum;
        ztgt[r] = tgt >= 0 && tgt < Vl ? zr[tgt] : 0.0f;
    }
}

/* Vocabulary-parallel backward, one block per row: the slice's dL/d(raw logits) from the whole
 * vocabulary's lse and entropy (no reads of other columns, so no barrier is needed). */
static __global__ void logprob_vp_backward_kernel(float *z, const float *dlogp, const float *dentropy,
                                                  const float *lse, const float *entropy, const int32_t *targets,
                                                  int Vl, int v0, float inv_temp) {
    int r = blockIdx.x;
    row_dlogits(z + (size_t)r * Vl, Vl, lse[r], entropy[r], targets[r] - v0, dlogp ? dlogp[r] : 0.0f,
                dentropy ? dentropy[r] : 0.0f, inv_temp);
}

/* Rows of a chunk for T tokens of V ids (the header says why); RLFLOW_CUDA_LOGPROB_MB sets the
 * megabytes (checked when the back end starts). */
static int chunk_rows(int T, int V) {
    int mb = rf__cuda_logprob_mb();
    size_t r = ((size_t)(mb > 0 ? mb : 640) << 20) / (sizeof(float) * (size_t)(V > 0 ? V : 1));
    int rows = r < 256 ? 256 : r > 4096 ? 4096 : (int)r;
    return T < rows ? T : rows;
}

/* Scratch of rows * V floats on the stream; NULL after recording a failure. */
static float *chunk_scratch(int rows, int V) {
    float *z = NULL;
    size_t bytes = sizeof(float) * (size_t)rows * V;
    return RF_CUDA_CHECK(cudaMallocAsync((void **)&z, bytes, rf__cuda.stream)) ? z : NULL;
}

/* The pass every entry point makes: for each chunk of up to chunk_rows tokens, the
 * logits z (n, V) = inv_temp * h[t0:t0+n] (n, C) @ w (V, C)^T, then row_pass(z, t0, n) (one
 * kernel launch over the chunk's rows; false on a failed launch), then, for a backward (dh not
 * NULL), dh (n, C) = dz (n, V) @ w (V, C) and dw (V, C) += dz^T (V, n) @ h (n, C). V is the
 * whole vocabulary or this rank's slice of it. */
template <typename RowPass>
static void chunked(const float *h, const float *w, int T, int C, int V, float inv_temp, float *dh, float *dw,
                    RowPass row_pass) {
    RF_CUDA_GUARD();
    if (T <= 0) return;
    int rows = chunk_rows(T, V);
    float *z = chunk_scratch(rows, V);
    if (!z) return;
    for (int t0 = 0; t0 < T; t0 += rows) {
        int n = T - t0 < rows ? T - t0 : rows;
        const float *hc = h + (size_t)t0 * C;
        if (!rf__cuda_gemm_xwt(z, hc, w, n, C, V, inv_temp, 0.0f)) break;
        if (!row_pass(z, t0, n)) break;
        if (dh && !rf__cuda_gemm_xw(dh + (size_t)t0 * C, z, w, n, C, V, 1.0f, 0.0f)) break;
        if (dh && dw && !rf__cuda_gemm_xtw_again(dw, z, hc, n, C, V, 1.0f, 1.0f)) break; /* z as dh's read it */
    }
    RF_CUDA_CHECK(cudaFreeAsync(z, rf__cuda.stream));
}

void rf_cuda_logprob_forward(float *logp, float *entropy, const float *h, const float *w,
                             const int32_t *targets, int T, int C, int V, float inv_temp) {
    chunked(h, w, T, C, V, inv_temp, NULL, NULL, [=](float *z, int t0, int n) {
        logprob_forward_kernel<<<n, RF_LOGPROB_THREADS, 0, rf__cuda.stream>>>(
            logp + t0, entropy ? entropy + t0 : NULL, z, targets + t0, V);
        return RF_CUDA_LAUNCH_CHECK();
    });
}

void rf_cuda_logprob_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                              const float *h, const float *w, const int32_t *targets, int T,
                              int C, int V, float inv_temp) {
    chunked(h, w, T, C, V, inv_temp, dh, dw, [=](float *z, int t0, int n) {
        logprob_backward_kernel<<<n, RF_LOGPROB_THREADS, 0, rf__cuda.stream>>>(
            z, dlogp ? dlogp + t0 : NULL, dentropy ? dentropy + t0 : NULL, targets + t0, V, inv_temp);
        return RF_CUDA_LAUNCH_CHECK();
    });
}

void rf_cuda_logprob_vp_partials(float *lmax, float *sumexp, float *zsum, float *ztgt, const float *h,
                                 const float *w, const int32_t *targets, int T, int C, int Vl, int v0,
                                 float inv_temp) {
    chunked(h, w, T, C, Vl, inv_temp, NULL, NULL, [=](float *z, int t0, int n) {
        logprob_vp_partials_kernel<<<n, RF_LOGPROB_THREADS, 0, rf__cuda.stream>>>(
            lmax + t0, sumexp + t0, zsum + t0, ztgt + t0, z, targets + t0, Vl, v0);
        return RF_CUDA_LAUNCH_CHECK();
    });
}

void rf_cuda_logprob_vp_backward(float *dh, float *dw, const float *dlogp, const float *dentropy, const float *lse,
                                 const float *entropy, const float *h, const float *w, const int32_t *targets, int T,
                                 int C, int Vl, int v0, float inv_temp) {
    chunked(h, w, T, C, Vl, inv_temp, dh, dw, [=](float *z, int t0, int n) {
        logprob_vp_backward_kernel<<<n, RF_LOGPROB_THREADS, 0, rf__cuda.stream>>>(
            z, dlogp ? dlogp + t0 : NULL, dentropy ? dentropy + t0 : NULL, lse + t0, entropy + t0, targets + t0, Vl, v0,
            inv_temp);
        return RF_CUDA_LAUNCH_CHECK();
    });
}
