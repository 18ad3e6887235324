/* Paged KV cache ops on the GPU: the CUDA twins of kernels/cpu/cpu_paged.c, same layouts and
 * arguments.
 *
 * Attention over the paged cache gives every query row, decoding or a prefill chunk, the bits
 * training's attention gives the same row, so that a token's log-prob from generation equals
 * the trainer's recomputation (docs/cuda.md, "Precision"): by default (head dims up to
 * RF_FLASH_MAX_D) it is training's tiled forward itself, cuda_flash.cu's kernel reading its key
 * tiles through the block table (rf__cuda_flash_paged_forward); for larger heads, or under
 * RLFLOW_CUDA_ATTENTION=reference, the unsplit kernel below, which does a row's arithmetic as
 * cuda_attention.cu's reference forward does (one warp per (query, head) row, lanes split the
 * head dimension, online softmax over keys one at a time; Milakov & Gimelshein 2018), key j read
 * through the sequence's block table.
 *
 * RLFLOW_CUDA_DECODE=split takes, for rows of one-query sequences, split-K decoding
 * (FlashDecoding: Dao, Haziza, Massa, Sizov 2023): up to RF_DECODE_SPLITS blocks per (sequence,
 * head) each take a chunk of the keys, their 4 warps every 4th key, and a second kernel combines
 * the chunks' partial softmaxes; a long context at batch 1 is then read by many blocks at once,
 * at the price of a different order of additions than training's (log-probs differ in the last
 * bits). kernels/cpu/cpu_flash_ref.c (rf_flash_ref_paged_decode) is that split in plain C,
 * tested on every machine (test_flash_ref). The small warp helpers are repeated from
 * cuda_attention.cu, where they are file-static. */
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
                                              int H, int KVH, int D, int skip_single) {
    int lane = threadIdx.x % 32, group = H / KVH;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32, rows = (size_t)q_off[n_seq] * H;
    float scale = 1.0f / sqrtf((float)D);
    for (size_t row = warp; row < rows; row += n_warps) {
        int t = (int)(row / H), h = (int)(row % H);
        int s = paged_seq_of_row(q_off, n_seq, t);
        int qlen = q_off[s + 1] - q_off[s], i = t - q_off[s];
        if (skip_single && qlen == 1) continue; /* the split-K kernels' row */
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

/* ---- split-K decoding ---- */

/* A partial softmax in a warp's registers: lane d holds acc dims d, d + 32, ... */
struct dec_partial {
    float m, l, acc[RF_PAGED_PER_LANE];
};

static __device__ inline void dec_merge(dec_partial *into, float m_b, float l_b, const float *acc_b,
                                        int D, int lane) {
    float m = fmaxf(into->m, m_b);
    if (m == -INFINITY) return;
    float ca = expf(into->m - m), cb = expf(m_b - m);
    into->l = into->l * ca + l_b * cb;
#pragma unroll
    for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
        int d = lane + 32 * r;
        if (d < D) into->acc[r] = into->acc[r] * ca + acc_b[d] * cb;
    }
    into->m = m;
}

/* Partials (n_seq, H, RF_DECODE_SPLITS) of m and l, and of acc (.., D): grid (RF_DECODE_SPLITS,
 * n_seq, H), RF_DECODE_WARPS warps; warp w takes keys lo + w, lo + w + 4, ... of its chunk. */
static __global__ void decode_split_kernel(float *pm, float *pl, float *pacc, const float *q,
                                           const float *k_pool, const float *v_pool,
                                           const int32_t *q_off, const int32_t *block_table,
                                           int max_blocks, const int32_t *k_len, int block_size,
                                           int H, int KVH, int D) {
    __shared__ float wm[RF_DECODE_WARPS], wl[RF_DECODE_WARPS], wacc[RF_DECODE_WARPS][RF_PAGED_MAX_D];
    int sp = blockIdx.x, s = blockIdx.y, h = blockIdx.z, lane = threadIdx.x % 32, w = threadIdx.x / 32;
    if (q_off[s + 1] - q_off[s] != 1) return; /* the unsplit kernel's rows */
    int nk = k_len[s], ns, chunk;
    if (nk <= 0) return;
    rf_decode_split(nk, &ns, &chunk);
    if (sp >= ns) return;
    int lo = sp * chunk, hi = min(nk, lo + chunk);
    const int32_t *bt = block_table + (size_t)s * max_blocks;
    size_t row = (size_t)q_off[s] * H + h, head = (size_t)(h / (H / KVH)) * D;
    float scale = 1.0f / sqrtf((float)D), qr[RF_PAGED_PER_LANE];
    dec_partial p;
    p.m = -INFINITY, p.l = 0.0f;
#pragma unroll
    for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
        int d = lane + 32 * r;
        qr[r] = d < D ? q[row * D + d] : 0.0f;
        p.acc[r] = 0.0f;
    }
    for (int j = lo + w; j < hi; j += RF_DECODE_WARPS) {
        size_t kr = ((size_t)bt[j / block_size] * block_size + j % block_size) * KVH * D + head;
        float sc = scale * paged_warp_dot(qr, k_pool + kr, D, lane);
        float m_new = fmaxf(p.m, sc), corr = expf(p.m - m_new), e = expf(sc - m_new);
        p.l = p.l * corr + e;
#pragma unroll
        for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
            int d = lane + 32 * r;
            p.acc[r] = p.acc[r] * corr + (d < D ? e * v_pool[kr + d] : 0.0f);
        }
        p.m = m_new;
    }
    if (lane == 0) wm[w] = p.m, wl[w] = p.l;
#pragma unroll
    for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
        int d = lane + 32 * r;
        if (d < D) wacc[w][d] = p.acc[r];
    }
    __syncthreads();
    if (w != 0) return;
    dec_partial t; /* the warps' partials combined in order, as the CPU mirror does */
    t.m = -INFINITY, t.l = 0.0f;
#pragma unroll
    for (int r = 0; r < RF_PAGED_PER_LANE; r++) t.acc[r] = 0.0f;
    for (int ww = 0; ww < RF_DECODE_WARPS; ww++) dec_merge(&t, wm[ww], wl[ww], wacc[ww], D, lane);
    size_t slot = ((size_t)s * H + h) * RF_DECODE_SPLITS + sp;
    if (lane == 0) pm[slot] = t.m, pl[slot] = t.l;
#pragma unroll
    for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
        int d = lane + 32 * r;
        if (d < D) pacc[slot * D + d] = t.acc[r];
    }
}

/* out rows of one-query sequences: the chunks' partials combined in order; one warp per
 * (sequence, head), grid-stride. */
static __global__ void decode_combine_kernel(float *out, const float *pm, const float *pl,
                                             const float *pacc, const int32_t *q_off,
                                             const int32_t *k_len, int n_seq, int H, int D) {
    int lane = threadIdx.x % 32;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32;
    for (size_t sh = warp; sh < (size_t)n_seq * H; sh += n_warps) {
        int s = (int)(sh / H), h = (int)(sh % H);
        if (q_off[s + 1] - q_off[s] != 1) continue;
        int nk = k_len[s], ns = 0, chunk = 0;
        if (nk > 0) rf_decode_split(nk, &ns, &chunk);
        dec_partial t;
        t.m = -INFINITY, t.l = 0.0f;
#pragma unroll
        for (int r = 0; r < RF_PAGED_PER_LANE; r++) t.acc[r] = 0.0f;
        for (int sp = 0; sp < ns; sp++) {
            size_t slot = sh * RF_DECODE_SPLITS + sp;
            dec_merge(&t, pm[slot], pl[slot], pacc + slot * D, D, lane);
        }
        float inv = t.l > 0.0f ? 1.0f / t.l : 0.0f;
        size_t row = (size_t)q_off[s] * H + h;
#pragma unroll
        for (int r = 0; r < RF_PAGED_PER_LANE; r++) {
            int d = lane + 32 * r;
            if (d < D) out[row * D + d] = t.acc[r] * inv;
        }
    }
}

/* Split-K for the one-query rows; 1 when launched, 0 after a failure (recorded). */
static int decode_split(float *out, const float *q, const float *k_pool, const float *v_pool,
                        const int32_t *q_off, const int32_t *block_table, int max_blocks,
                        const int32_t *k_len, int n_seq, int block_size, int H, int KVH, int D) {
    cudaStream_t st = rf__cuda.stream;
    size_t slots = (size_t)n_seq * H * RF_DECODE_SPLITS;
    float *scratch = NULL; /* m, l (slots) then acc (slots, D): stream-ordered */
    if (!RF_CUDA_CHECK(cudaMallocAsync((void **)&scratch, sizeof(float) * slots * (D + 2), st)))
        return 0;
    float *pm = scratch, *pl = pm + slots, *pacc = pl + slots;
    decode_split_kernel<<<dim3(RF_DECODE_SPLITS, n_seq, H), 32 * RF_DECODE_WARPS, 0, st>>>(
        pm, pl, pacc, q, k_pool, v_pool, q_off, block_table, max_blocks, k_len, block_size, H,
        KVH, D);
    int ok = RF_CUDA_LAUNCH_CHECK();
    if (ok) {
        size_t blocks = ((size_t)n_seq * H + RF_PAGED_WARPS - 1) / RF_PAGED_WARPS;
        decode_combine_kernel<<<blocks > RF_CUDA_MAX_GRID ? RF_CUDA_MAX_GRID : (unsigned)blocks,
                                32 * RF_PAGED_WARPS, 0, st>>>(out, pm, pl, pacc, q_off, k_len,
                                                              n_seq, H, D);
        ok = RF_CUDA_LAUNCH_CHECK();
    }
    RF_CUDA_CHECK(cudaFreeAsync(scratch, st));
    return ok;
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
    const char *e = getenv("RLFLOW_CUDA_ATTENTION"), *dec = getenv("RLFLOW_CUDA_DECODE");
    int reference = e && strcmp(e, "reference") == 0, split_k = dec && strcmp(dec, "split") == 0;
    if (!reference && !split_k && rf__cuda_flash_supported(n_seq, H, KVH, D)) {
        /* training's tiled forward reading keys through the block table: every row, decoding
         * or a prefill chunk, gets the bits training's attention gives it (cuda_flash.cu) */
        rf__cuda_flash_paged_forward(out, q, k_pool, v_pool, q_off, block_table, max_blocks,
                                     k_len, n_seq, block_size, H, KVH, D);
        return;
    }
    int split = split_k && !reference && n_seq <= 65535 && H <= 65535;
    /* Whether a sequence has one query is known on the device only: both kernels run, each
     * taking its rows (the unsplit one returns at once for one-query rows). */
    paged_attention_kernel<<<RF_PAGED_BLOCKS, 32 * RF_PAGED_WARPS, 0, rf__cuda.stream>>>(
        out, q, k_pool, v_pool, q_off, block_table, max_blocks, k_len, n_seq, block_size, H,
        KVH, D, split);
    if (!RF_CUDA_LAUNCH_CHECK() || !split) return;
    decode_split(out, q, k_pool, v_pool, q_off, block_table, max_blocks, k_len, n_seq,
                 block_size, H, KVH, D);
}
