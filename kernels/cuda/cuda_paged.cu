/* Paged KV cache ops on the GPU: the CUDA twins of kernels/cpu/cpu_paged.c, same layouts and
 * arguments.
 *
 * Attention over the paged cache gives every query row, decoding or a prefill chunk, the bits
 * training's attention gives the same row, so that a token's log-prob from generation equals
 * the trainer's recomputation (docs/cuda.md, "Precision"): by default (head dims up to
 * RF_FLASH_MAX_D) it is training's tiled forward itself, cuda_flash.cu's kernel reading its key
 * tiles through the block table, decoding steps split over key chunks where that helps
 * (rf__cuda_flash_paged_forward); for larger heads, or under RLFLOW_CUDA_ATTENTION=reference,
 * the unsplit kernel below, which does a row's arithmetic as cuda_attention.cu's reference
 * forward does (one warp per (query, head) row, lanes split the head dimension, online softmax
 * over keys one at a time; Milakov & Gimelshein 2018), key j read through the sequence's block
 * table. The small warp helpers are repeated from cuda_attention.cu, where they are
 * file-static. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/flash_ref.h"

#define RF_PAGED_MAX_D 256
#define RF_PAGED_PER_LANE (RF_PAGED_MAX_D / 32)
#define RF_PAGED_WARPS 4
#define RF_PAGED_BLOCKS 2048 /* fixed grid: the query row count lives on the device */

/* ---- scatter ---- */

static __global__ void paged_kv_write_kernel(float *k_pool, float *v_pool, const float *k,
                                             const float *v, const int32_t *slots, int T,
                                             int row) {
    size_t n = (size_t)T * row;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / row, c = i % row, dst = (size_t)slots[t] * row + c;
        k_pool[dst] = k[i];
        v_pool[dst] = v[i];
    }
}

void rf_cuda_paged_kv_write(float *k_pool, float *v_pool, const float *k, const float *v,
                            const int32_t *slots, int T, int KVH, int D) {
    RF_CUDA_GUARD();
    if (T <= 0) return;
    paged_kv_write_kernel<<<rf__cuda_blocks((size_t)T * KVH * D), RF_CUDA_THREADS, 0,
                            rf__cuda.stream>>>(k_pool, v_pool, k, v, slots, T, KVH * D);
    RF_CUDA_LAUNCH_CHECK();
}

/* ---- attention ---- */

static __device__ int paged_seq_of_row(const int32_t *off, int n_seq, int t) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (off[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static __device__ inline float paged_warp_dot(const float r[RF_PAGED_PER_LANE], const float *y,
                                              int D, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < RF_PAGED_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < D) s = fmaf(r[i], y[d], s);
    }
    return rf__warp_sum(s);
}

/* One warp per (query row t, head h), grid-stride over the q_off[n_seq] * H rows. */
static __global__ void paged_attention_kernel(float *out, const float *q, const float *k_pool,
                                              const float *v_pool, const int32_t *q_off,
                                              const int32_t *block_table, int max_blocks,
                                              const int32_t *k_len, int n_seq, int block_size,
                                              int H, int KVH, int D) {
    int lane = threadIdx.x % 32, group = H / KVH;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32, rows = (size_t)q_off[n_seq] * H;
    float scale = 1.0f / sqrtf((float)D);
    for (size_t row = warp; row < rows; row += n_warps) {
        int t = (int)(row / H), h = (int)(row % H);
        int s = paged_seq_of_row(q_off, n_seq, t);
        int qlen = q_off[s + 1] - q_off[s], i = t - q_off[s];
        int nk = i + (k_len[s] - qlen) + 1; /* keys visible to this query */
        const int32_t *bt = block_table + (size_t)s * max_blocks;
        size_t head = (size_t)(h / group) * D;
        float qr[RF_PAGED_PER_LANE], acc[RF_PAGED_PER_LANE];
#pragma unroll
        for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
            int d = lane + 32 * r;
            qr[r] = d < D ? q[row * D + d] : 0.0f;
            acc[r] = 0.0f;
        }
        float m = -INFINITY, sum = 0.0f; /* running max and sum of exp(score - m) */
        for (int j = 0; j < nk; j++) {
            size_t kr = ((size_t)bt[j / block_size] * block_size + j % block_size) * KVH * D + head;
            float sc = scale * paged_warp_dot(qr, k_pool + kr, D, lane);
            float m_new = fmaxf(m, sc);
            float corr = expf(m - m_new), p = expf(sc - m_new); /* corr = 0 at the first key */
            sum = fmaf(sum, corr, p);
#pragma unroll
            for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
                int d = lane + 32 * r;
                acc[r] *= corr;
                if (d < D) acc[r] = fmaf(p, v_pool[kr + d], acc[r]);
            }
            m = m_new;
        }
        float inv = nk > 0 ? 1.0f / sum : 0.0f;
#pragma unroll
        for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
            int d = lane + 32 * r;
            if (d < D) out[row * D + d] = inv * acc[r];
        }
    }
}

void rf_cuda_paged_attention_forward(float *out, const float *q, const float *k_pool,
                                     const float *v_pool, const int32_t *q_off,
                                     const int32_t *block_table, int max_blocks,
                                     const int32_t *k_len, int n_seq, int block_size, int H,
                                     int KVH, int D) {
    RF_CUDA_GUARD();
    if (n_seq <= 0 || H <= 0) return;
    if (D < 1 || D > RF_PAGED_MAX_D || KVH < 1 || H % KVH != 0 || block_size < 1) {
        char detail[128];
        snprintf(detail, sizeof detail, "unsupported shape H=%d KVH=%d D=%d block_size=%d", H,
                 KVH, D, block_size);
        rf__cuda_fail("paged_attention_forward", detail, __FILE__, __LINE__);
        return;
    }
    const char *e = getenv("RLFLOW_CUDA_ATTENTION");
    if (!(e && strcmp(e, "reference") == 0) && rf__cuda_flash_supported(n_seq, H, KVH, D)) {
        rf__cuda_flash_paged_forward(out, q, k_pool, v_pool, q_off, block_table, max_blocks,
                                     k_len, n_seq, block_size, H, KVH, D);
        return;
    }
    paged_attention_kernel<<<RF_PAGED_BLOCKS, 32 * RF_PAGED_WARPS, 0, rf__cuda.stream>>>(
        out, q, k_pool, v_pool, q_off, block_table, max_blocks, k_len, n_seq, block_size, H,
        KVH, D);
    RF_CUDA_LAUNCH_CHECK();
}
