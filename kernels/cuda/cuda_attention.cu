/* Causal GQA attention over packed variable-length sequences on the GPU: the CUDA twin of
 * kernels/cpu/cpu_attention.c, same layouts, same bottom-right causal alignment, same saved
 * log-sum-exp.
 *
 * Written for correctness and readability first, not speed: one warp owns one output row (a
 * (query, head) pair forward; a (query, head) row of dq or a (key, KV head) row of dk/dv
 * backward); the 32 lanes split the head dimension (lane d, d+32, ... up to
 * RF_ATT_MAX_D), so a row of q/k/v lives in registers and a dot product is one warp sum.
 * Keys are visited one at a time with an online softmax (Milakov & Gimelshein 2018), so there
 * is no buffer sized by the sequence length and no length limit. Every output row is written
 * by exactly one warp: no atomics, deterministic. A tiled FlashAttention-2 kernel (Dao 2023)
 * (cuda_flash.cu) is the fast path for head dims up to 128; these kernels are the reference it
 * is tested against, and the path for larger heads or RLFLOW_CUDA_ATTENTION=reference. The
 * forward also serves paged_attention_forward on those paths, reading keys through the block
 * table, so decoding gives a row the bits training's reference forward gives it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define RF_ATT_MAX_D 256                 /* largest head dimension supported */
#define RF_ATT_PER_LANE (RF_ATT_MAX_D / 32) /* head-dim elements held by each lane */
#define RF_ATT_WARPS 4                   /* warps per block */
#define RF_ATT_FWD_BLOCKS 2048           /* forward grid (the row count is on the device) */

/* Index of the sequence that owns row t (offsets sorted); the CPU back end's seq_of_row. */
static __device__ int seq_of_row(const int32_t *off, int n_seq, int t) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (off[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Loads row x (D) into this lane's registers: r[i] = x[lane + 32 i], 0 past D. */
static __device__ inline void load_row(float r[RF_ATT_PER_LANE], const float *x, int D,
                                       int lane) {
#pragma unroll
    for (int i = 0; i < RF_ATT_PER_LANE; i++) {
        int d = lane + 32 * i;
        r[i] = d < D ? x[d] : 0.0f;
    }
}

/* Dot product of a register row with row y (D) of memory; every lane gets it. */
static __device__ inline float warp_dot(const float r[RF_ATT_PER_LANE], const float *y, int D,
                                        int lane) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < RF_ATT_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < D) s = fmaf(r[i], y[d], s);
    }
    return rf__warp_sum(s);
}

/* acc += a * y (D) */
static __device__ inline void warp_axpy(float acc[RF_ATT_PER_LANE], float a, const float *y,
                                        int D, int lane) {
#pragma unroll
    for (int i = 0; i < RF_ATT_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < D) acc[i] = fmaf(a, y[d], acc[i]);
    }
}

static __device__ inline void store_row(float *x, const float r[RF_ATT_PER_LANE], float a,
                                        int D, int lane) {
#pragma unroll
    for (int i = 0; i < RF_ATT_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < D) x[d] = a * r[i];
    }
}

/* Checks what the kernels assume of the shapes; records a failure otherwise. */
static int attention_shapes_ok(const char *op, int H, int KVH, int D) {
    if (D >= 1 && D <= RF_ATT_MAX_D && KVH >= 1 && H % KVH == 0) return 1;
    char detail[128];
    snprintf(detail, sizeof detail, "unsupported shape H=%d KVH=%d D=%d (need H %% KVH == 0, "
             "1 <= D <= %d)", H, KVH, D, RF_ATT_MAX_D);
    return rf__cuda_fail(op, detail, __FILE__, __LINE__);
}

int rf__cuda_attention_bf16(void) {
    const char *e = getenv("RLFLOW_CUDA_ATTENTION");
    if (rf__cuda.precision != RF_PRECISION_BF16) return RF_ATT_FP32;
    if (!e || strcmp(e, "bf16") == 0) return RF_ATT_BF16_TC; /* the default at bf16 */
    return strcmp(e, "fma") == 0 ? RF_ATT_BF16_FMA : RF_ATT_FP32;
}

rf_status rf__cuda_check_env(void) {
    static const char *const att[] = {"reference", "fma", "bf16", "fp32"};
    const char *e = getenv("RLFLOW_CUDA_ATTENTION"), *d = getenv("RLFLOW_CUDA_DECODE");
    int ok = !e;
    for (size_t i = 0; i < sizeof att / sizeof *att; i++) ok |= e && strcmp(e, att[i]) == 0;
    if (!ok)
        return rf_error(RF_ERR_ARG, "cuda: RLFLOW_CUDA_ATTENTION=\"%s\": expected bf16, fp32, fma "
                        "or reference (or unset: bf16 at precision bf16, fp32 otherwise)", e);
    if (d && strcmp(d, "split") != 0 && strcmp(d, "tiled") != 0)
        return rf_error(RF_ERR_ARG, "cuda: RLFLOW_CUDA_DECODE=\"%s\": expected split or tiled (or "
                        "unset: chosen by the batch)", d);
    const char *mb = getenv("RLFLOW_CUDA_LOGPROB_MB");
    if (mb && rf__cuda_logprob_mb() <= 0)
        return rf_error(RF_ERR_ARG, "cuda: RLFLOW_CUDA_LOGPROB_MB=\"%s\": expected a whole number of "
                        "megabytes from 1 to 65536 (or unset: 640)", mb);
    return RF_OK;
}

int rf__cuda_logprob_mb(void) {
    const char *e = getenv("RLFLOW_CUDA_LOGPROB_MB");
    if (!e) return 640;
    char *end;
    long v = strtol(e, &end, 10);
    return end != e && *end == '\0' && v >= 1 && v <= 65536 ? (int)v : -1;
}

int rf__cuda_attention_flash(int n_seq, int H, int KVH, int D) {
    const char *e = getenv("RLFLOW_CUDA_ATTENTION");
    if (e && strcmp(e, "reference") == 0) return 0;
    return rf__cuda_flash_supported(n_seq, H, KVH, D);
}

static unsigned warp_blocks(size_t rows) {
    size_t b = (rows + RF_ATT_WARPS - 1) / RF_ATT_WARPS;
    return b > RF_CUDA_MAX_GRID ? RF_CUDA_MAX_GRID : (unsigned)b;
}

/* ---- forward ---- */

/* One warp per (query row t, head h), grid-stride over the q_off[n_seq] * H rows; key j of
 * sequence s at kv.at(s, kvh, j): contiguous rows (attention_forward) or the paged KV cache's
 * block table (paged_attention_forward under RLFLOW_CUDA_ATTENTION=reference or for heads over
 * RF_FLASH_MAX_D), one kernel so that both give a row the same bits. */
template <class KV>
static __global__ void attention_forward_kernel(float *out, float *lse, const float *q,
                                                const float *k, const float *v, KV kv,
                                                const int32_t *q_off, const int32_t *k_len,
                                                int n_seq, int H, int KVH, int D) {
    int lane = threadIdx.x % 32, group = H / KVH;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32;
    size_t rows = (size_t)q_off[n_seq] * H;
    float scale = 1.0f / sqrtf((float)D);
    for (size_t row = warp; row < rows; row += n_warps) {
        int t = (int)(row / H), h = (int)(row % H), kvh = h / group;
        int s = seq_of_row(q_off, n_seq, t);
        int qlen = q_off[s + 1] - q_off[s], i = t - q_off[s];
        int nk = i + (k_len[s] - qlen) + 1; /* keys visible to this query */
        float qr[RF_ATT_PER_LANE], acc[RF_ATT_PER_LANE];
        load_row(qr, q + row * D, D, lane);
#pragma unroll
        for (int r = 0; r < RF_ATT_PER_LANE; r++) acc[r] = 0.0f;
        float m = -INFINITY, sum = 0.0f; /* running max and sum of exp(score - m) */
        for (int j = 0; j < nk; j++) {
            size_t kr = kv.at(s, kvh, j);
            float sc = scale * warp_dot(qr, k + kr, D, lane);
            float m_new = fmaxf(m, sc);
            float corr = expf(m - m_new), p = expf(sc - m_new); /* corr = 0 at the first key */
            sum = fmaf(sum, corr, p);
#pragma unroll
            for (int r = 0; r < RF_ATT_PER_LANE; r++) acc[r] *= corr;
            warp_axpy(acc, p, v + kr, D, lane);
            m = m_new;
        }
        store_row(out + row * D, acc, nk > 0 ? 1.0f / sum : 0.0f, D, lane);
        if (lse && lane == 0) lse[row] = nk > 0 ? m + logf(sum) : -INFINITY;
    }
}

void rf_cuda_attention_forward(float *out, float *lse, const float *q, const float *k,
                               const float *v, const int32_t *q_off, const int32_t *k_start,
                               const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    RF_CUDA_GUARD();
    if (n_seq <= 0 || H <= 0) return;
    if (!attention_shapes_ok("attention_forward", H, KVH, D)) return;
    if (rf__cuda_attention_flash(n_seq, H, KVH, D)) {
        rf__cuda_flash_forward(out, lse, q, k, v, q_off, k_start, k_len, n_seq, H, KVH, D);
        return;
    }
    /* The number of query rows is q_off[n_seq], which lives on the device; a fixed grid that
     * loops grid-stride avoids reading it back (a synchronisation on every call). */
    kv_rows kv = {k_start, KVH, D};
    attention_forward_kernel<kv_rows><<<RF_ATT_FWD_BLOCKS, 32 * RF_ATT_WARPS, 0, rf__cuda.stream>>>(
        out, lse, q, k, v, kv, q_off, k_len, n_seq, H, KVH, D);
    RF_CUDA_LAUNCH_CHECK();
}

void rf_cuda_paged_attention_forward(float *out, const float *q, const float *k_pool,
                                     const float *v_pool, const int32_t *q_off,
                                     const int32_t *block_table, int max_blocks,
                                     const int32_t *k_len, int n_seq, int block_size, int H,
                                     int KVH, int D) {
    RF_CUDA_GUARD();
    if (n_seq <= 0 || H <= 0) return;
    if (!attention_shapes_ok("paged_attention_forward", H, KVH, D)) return;
    if (block_size < 1) {
        rf__cuda_fail("paged_attention_forward", "block_size < 1", __FILE__, __LINE__);
        return;
    }
    if (rf__cuda_attention_flash(n_seq, H, KVH, D)) { /* training's tiled forward: cuda_flash.cu */
        rf__cuda_flash_paged_forward(out, q, k_pool, v_pool, q_off, block_table, max_blocks,
                                     k_len, n_seq, block_size, H, KVH, D);
        return;
    }
    kv_paged kv = {block_table, max_blocks, block_size, KVH, D};
    attention_forward_kernel<kv_paged><<<RF_ATT_FWD_BLOCKS, 32 * RF_ATT_WARPS, 0, rf__cuda.stream>>>(
        out, (float *)NULL, q, k_pool, v_pool, kv, q_off, k_len, n_seq, H, KVH, D);
    RF_CUDA_LAUNCH_CHECK();
}

/* ---- backward (training layout: k_start = q_off = cu_seqlens, k_len = q_len) ----
 *
 * With P = softmax(scale Q K^T) recomputed from lse and Di = dout_i . out_i (FlashAttention-2's
 * rowsum(dO o O)), for each visible pair (query i, key j), as in the CPU task loop:
 *   p = exp(scale q_i.k_j - lse_i), ds = p (dout_i.v_j - Di) scale,
 *   dq_i += ds k_j,  dk_j += ds q_i,  dv_j += p dout_i.
 * The CPU back end gives one (sequence, KV head) task all of these; here dq rows and dk/dv rows
 * are gathered by separate kernels, each row by one warp, so neither needs atomics. */

/* Di (T, H) = rowwise dot(dout, out); one warp per row. */
static __global__ void attention_di_kernel(float *di, const float *dout, const float *out,
                                           size_t rows, int D) {
    int lane = threadIdx.x % 32;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32;
    for (size_t row = warp; row < rows; row += n_warps) {
        float r[RF_ATT_PER_LANE];
        load_row(r, dout + row * D, D, lane);
        float d = warp_dot(r, out + row * D, D, lane);
        if (lane == 0) di[row] = d;
    }
}

/* dq (T, H, D): one warp per (query row t, head h), summing over keys j <= i. */
static __global__ void attention_dq_kernel(float *dq, const float *dout, const float *q,
                                           const float *k, const float *v, const float *lse,
                                           const float *di, const int32_t *cu_seqlens,
                                           int n_seq, int T, int H, int KVH, int D) {
    int lane = threadIdx.x % 32, group = H / KVH;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32;
    float scale = 1.0f / sqrtf((float)D);
    for (size_t row = warp; row < (size_t)T * H; row += n_warps) {
        int t = (int)(row / H), h = (int)(row % H), kvh = h / group;
        if (t >= cu_seqlens[n_seq]) continue; /* past the last sequence: left as on the CPU */
        int s = seq_of_row(cu_seqlens, n_seq, t), off = cu_seqlens[s], i = t - off;
        float qr[RF_ATT_PER_LANE], dor[RF_ATT_PER_LANE], acc[RF_ATT_PER_LANE];
        load_row(qr, q + row * D, D, lane);
        load_row(dor, dout + row * D, D, lane);
#pragma unroll
        for (int r = 0; r < RF_ATT_PER_LANE; r++) acc[r] = 0.0f;
        float l = lse[row], Di = di[row];
        for (int j = 0; j <= i; j++) {
            size_t kj = ((size_t)(off + j) * KVH + kvh) * D;
            float p = expf(scale * warp_dot(qr, k + kj, D, lane) - l);
            float dp = warp_dot(dor, v + kj, D, lane);
            warp_axpy(acc, p * (dp - Di) * scale, k + kj, D, lane);
        }
        store_row(dq + row * D, acc, 1.0f, D, lane);
    }
}

/* dk, dv (T, KVH, D): one warp per (key row t, KV head), summing over the query heads of the
 * group and the queries i >= j that see this key. */
static __global__ void attention_dkdv_kernel(float *dk, float *dv, const float *dout,
                                             const float *q, const float *k, const float *v,
                                             const float *lse, const float *di,
                                             const int32_t *cu_seqlens, int n_seq, int T, int H,
                                             int KVH, int D) {
    int lane = threadIdx.x % 32, group = H / KVH;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32;
    float scale = 1.0f / sqrtf((float)D);
    for (size_t row = warp; row < (size_t)T * KVH; row += n_warps) {
        int t = (int)(row / KVH), kvh = (int)(row % KVH);
        /* Rows past the last sequence find no query (j >= L) and are written as zeros, like
         * the CPU back end, which zeroes all T rows of dk/dv. */
        int s = seq_of_row(cu_seqlens, n_seq, t), off = cu_seqlens[s];
        int L = cu_seqlens[s + 1] - off, j = t - off;
        float kr[RF_ATT_PER_LANE], vr[RF_ATT_PER_LANE];
        float dkr[RF_ATT_PER_LANE], dvr[RF_ATT_PER_LANE];
        load_row(kr, k + row * D, D, lane);
        load_row(vr, v + row * D, D, lane);
#pragma unroll
        for (int r = 0; r < RF_ATT_PER_LANE; r++) dkr[r] = dvr[r] = 0.0f;
        for (int h = kvh * group; h < (kvh + 1) * group; h++) {
            for (int i = j; i < L; i++) {
                size_t qrow = (size_t)(off + i) * H + h;
                const float *qi = q + qrow * D, *do_i = dout + qrow * D;
                float p = expf(scale * warp_dot(kr, qi, D, lane) - lse[qrow]);
                float dp = warp_dot(vr, do_i, D, lane);
                warp_axpy(dvr, p, do_i, D, lane);
                warp_axpy(dkr, p * (dp - di[qrow]) * scale, qi, D, lane);
            }
        }
        store_row(dk + row * D, dkr, 1.0f, D, lane);
        store_row(dv + row * D, dvr, 1.0f, D, lane);
    }
}

void rf_cuda_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                                const float *q, const float *k, const float *v,
                                const float *out, const float *lse, const int32_t *cu_seqlens,
                                int n_seq, int T, int H, int KVH, int D) {
    RF_CUDA_GUARD();
    if (n_seq <= 0 || T <= 0 || H <= 0) return;
    if (!attention_shapes_ok("attention_backward", H, KVH, D)) return;
    if (rf__cuda_attention_flash(n_seq, H, KVH, D)) {
        rf__cuda_flash_backward(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n_seq, T, H,
                                KVH, D);
        return;
    }
    cudaStream_t st = rf__cuda.stream;
    size_t q_rows = (size_t)T * H, kv_rows = (size_t)T * KVH;
    float *di = NULL; /* (T, H) scratch, stream-ordered so it needs no synchronisation */
    if (!RF_CUDA_CHECK(cudaMallocAsync((void **)&di, sizeof(float) * q_rows, st))) return;
    int threads = 32 * RF_ATT_WARPS;
    attention_di_kernel<<<warp_blocks(q_rows), threads, 0, st>>>(di, dout, out, q_rows, D);
    if (RF_CUDA_LAUNCH_CHECK()) {
        attention_dq_kernel<<<warp_blocks(q_rows), threads, 0, st>>>(
            dq, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH, D);
        if (RF_CUDA_LAUNCH_CHECK()) {
            attention_dkdv_kernel<<<warp_blocks(kv_rows), threads, 0, st>>>(
                dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH, D);
            RF_CUDA_LAUNCH_CHECK();
        }
    }
    RF_CUDA_CHECK(cudaFreeAsync(di, st));
}
