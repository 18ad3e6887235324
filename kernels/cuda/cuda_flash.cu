/* Tiled causal GQA attention over packed variable-length sequences: FlashAttention-2's
 * algorithm (Dao 2023, Algorithms 1 and 2) on the GPU, the fast path of attention_forward and
 * attention_backward for head dims up to RF_FLASH_MAX_D (cuda_attention.cu keeps the one-warp-
 * per-row kernels as the reference and the path for larger heads).
 *
 * kernels/cpu/cpu_flash_ref.c is this file's algorithm in plain C (same tiles, same order, same
 * online-softmax updates, same rounding at bf16; its forward tiles hold one head's queries
 * where these hold a GQA group's, which changes no row's arithmetic), tested on every machine
 * (tests/test_flash_ref.c); tests/test_kernels_cuda.c checks these kernels against it, against
 * the reference kernels and against the CPU back end.
 *
 * Work split. A block of 4 warps owns one (sequence, KV head, tile of RF_FLASH_BR = 32 (query,
 * head) rows of the KV head's group) forward, one (sequence, head, tile of 32 query rows) in
 * the dq pass, one (sequence, KV head, tile of RF_FLASH_BC = 32 key rows) in the dk/dv pass;
 * each warp owns 8 of the tile's rows and keeps their accumulators in registers
 * (lane d holds dims d, d + 32, ...). The other side's tiles are staged in shared memory, rows
 * padded by one float so that lanes reading different rows hit different banks. A score is
 * one lane's dot product over D (lane = the key, or the query, of the tile); probabilities are
 * broadcast with __shfl_sync into the accumulations. Every output row is written by one warp:
 * no atomics, deterministic. The forward takes a row's keys in fixed chunks of RF_FLASH_CHUNK
 * whose softmax states it merges in order; it is also decoding's attention over the paged KV
 * cache (kv_paged below; cuda_paged.cu), a decoding step's chunks then possibly each in its own
 * block and merged by a second kernel, so that generation and training give a row the same
 * bits whatever the batch.
 *
 * Precision: fp32 arithmetic at precision fp32, and at bf16 under RLFLOW_CUDA_ATTENTION=fp32
 * (as on the CPU). Where attention rounds to bf16 (rf__cuda_attention_bf16: the default at
 * precision bf16, or =fma), q, k, v and dout are rounded to bf16 as they are loaded
 * (__float2bfloat16_rn); scores, softmax statistics (m, l, lse, Di) and accumulators stay
 * fp32. The products here run on CUDA cores (FMA); by default the forward and the backward go
 * to the tensor-core kernels of cuda_flash_mma.cu where they can (head dims multiple of 16,
 * sm_80+; docs/cuda.md). */
#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/flash_ref.h"

#define BR RF_FLASH_BR
#define BC RF_FLASH_BC
#define CH RF_FLASH_CHUNK
#define FWARPS 4
#define ROWS_PER_WARP (BR / FWARPS) /* = BC / FWARPS = 8 */
#define FTHREADS (32 * FWARPS)

static_assert(BR == BC, "one warp layout serves query and key tiles");
static_assert(CH % BC == 0, "chunks are whole key tiles");


/* tile (BR or BC rows, padded row length ld) = rows 0..n-1 of src (row stride `stride`), zero
 * past n; every thread of the block takes part. */
static __device__ inline void load_tile(float *tile, const float *src, size_t stride, int n,
                                        int D, int ld, int bf16) {
    for (int idx = threadIdx.x; idx < BR * D; idx += blockDim.x) {
        int r = idx / D, d = idx % D;
        tile[r * ld + d] = r < n ? rf__bf16_round(src[(size_t)r * stride + d], bf16) : 0.0f;
    }
}

/* The products below are written as fmaf, not left to the compiler's contraction, so that
 * every kernel that shares them (training's forward, the KV cache's, the paged KV cache's)
 * rounds a row the same way whatever the compiler does with each. */
static __device__ inline float sdot(const float *a, const float *b, int D) {
    float s = 0.0f;
    for (int d = 0; d < D; d++) s = fmaf(a[d], b[d], s);
    return s;
}

static size_t smem_bytes(int tiles, int D) { return sizeof(float) * (size_t)tiles * BR * (D + 1); }

/* ---- forward ---- */

/* (m_t, l_t, acc_t) = the softmax state of keys A, merged with (m_c, l_c, acc_c), that of the
 * keys B after them: the state of A then B (rf__merge_factors, cuda_common.cuh, which the
 * tensor-core forward's chunk boundaries share). One function for the forward's own chunk
 * boundaries and for split decoding's combine, so both round alike. */
template <int NPL>
static __device__ inline void merge_state(float &m_t, float &l_t, float *acc_t, float m_c,
                                          float l_c, const float *acc_c) {
    float m, ca, cb;
    if (!rf__merge_factors(m_t, m_c, &m, &ca, &cb)) return;
    l_t = fmaf(l_t, ca, l_c * cb);
#pragma unroll
    for (int i = 0; i < NPL; i++) acc_t[i] = fmaf(acc_t[i], ca, acc_c[i] * cb);
    m_t = m;
}

/* grid (tiles of BR (query, head) pairs, stride gridDim.x; n_seq; KVH) or, SPLIT, (key chunks;
 * n_seq; KVH). NPL: head dims per lane (D <= 32 NPL). A block's tile holds the rows of every
 * head of a KV head's group (pair p = query p / group, head p % group of the group), so each
 * key tile is loaded once for the group (FlashAttention's GQA packing): a decoding step of a
 * model with groups of 7 reads its KV cache once, not 7 times. Warp w takes rows w, w + 4, ...
 *
 * A row's keys are taken in chunks of RF_FLASH_CHUNK (from key 0 of its sequence), each chunk's
 * tiles with the online softmax from an empty state, the chunks' states merged in order
 * (merge_state). Not SPLIT, one block does it all in registers; SPLIT, block x takes chunk x of
 * the rows of one-query sequences (the only ones it takes; an unsplit launch beside it skips
 * them, skip_one_query) and writes its state to part (m, l, acc), and
 * decode_combine_kernel merges them in order: the same operations in the same order, so a
 * decoding step split over many blocks gets the bits one block (and training) gets.
 * A row's arithmetic depends on its own q and keys only, not on which tile, warp, block or
 * kernel instance computes it, nor on the tile's other rows (key tiles past a row's last key
 * add exact zeros: a factor exp(0) = 1 and products 0 v; chunks past it are empty states):
 * training's forward and decoding's (kv_paged) give a row the same bits. */
template <int NPL, class KV, bool SPLIT>
static __global__ void __launch_bounds__(FTHREADS)
flash_forward_kernel(float *out, float *lse, float *part, const float *q, const float *k,
                     const float *v, KV kv, const int32_t *q_off, const int32_t *k_len, int H,
                     int KVH, int D, int bf16, int skip_one_query, int max_chunks) {
    extern __shared__ float sm[];
    int s = blockIdx.y, kvh = blockIdx.z, group = H / KVH, ld = D + 1;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float *Q = sm, *K = Q + BR * ld, *V = K + BC * ld;
    int qlen = q_off[s + 1] - q_off[s], klen = k_len[s], off = klen - qlen;
    if (SPLIT ? qlen != 1 : skip_one_query && qlen == 1) return; /* block-uniform */
    int chunk = SPLIT ? (int)blockIdx.x : 0, x0 = SPLIT ? 0 : (int)blockIdx.x;
    int xs = SPLIT ? 1 : (int)gridDim.x;
    if (SPLIT && chunk * CH >= klen) return;
    int pairs = qlen * group;
    float scale = 1.0f / sqrtf((float)D);
    for (int p0 = x0 * BR; p0 < pairs; p0 += xs * BR) {
        int nr = min(BR, pairs - p0);
        __syncthreads(); /* the previous tile's readers are done */
        rf__load_q_pairs(Q, BR, q, q_off[s], p0, nr, group, kvh, H, D, ld, bf16);
        /* per row: the running chunk's state (m, l, acc) and, not SPLIT, the merged state of
         * the chunks before it (mt, lt, acct) */
        float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][NPL];
        float mt[ROWS_PER_WARP], lt[ROWS_PER_WARP], acct[ROWS_PER_WARP][NPL];
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
            m[rr] = mt[rr] = -INFINITY, l[rr] = lt[rr] = 0.0f;
#pragma unroll
            for (int i = 0; i < NPL; i++) acc[rr][i] = acct[rr][i] = 0.0f;
        }
        int nkeys = min((p0 + nr - 1) / group + 1 + off, klen); /* the tile's last query's */
        int jlo = SPLIT ? chunk * CH : 0, jhi = SPLIT ? min(nkeys, jlo + CH) : nkeys;
        for (int j0 = jlo; j0 < jhi; j0 += BC) {
            if (!SPLIT && j0 > 0 && j0 % CH == 0) { /* a chunk ends: merge it, start the next */
#pragma unroll
                for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
                    merge_state<NPL>(mt[rr], lt[rr], acct[rr], m[rr], l[rr], acc[rr]);
                    m[rr] = -INFINITY, l[rr] = 0.0f;
#pragma unroll
                    for (int i = 0; i < NPL; i++) acc[rr][i] = 0.0f;
                }
            }
            int nc = min(BC, klen - j0);
            __syncthreads();
            rf__load_kv_rows(K, BC, k, kv, s, kvh, j0, nc, D, ld, bf16);
            rf__load_kv_rows(V, BC, v, kv, s, kvh, j0, nc, D, ld, bf16);
            __syncthreads();
#pragma unroll
            for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
                int r = rr * FWARPS + warp;
                if (r >= nr) continue; /* warp-uniform */
                int c = lane, lim = (p0 + r) / group + off;
                float sc = c < nc && j0 + c <= lim ? scale * sdot(Q + r * ld, K + c * ld, D)
                                                  : -INFINITY;
                float m_new = fmaxf(m[rr], rf__warp_max(sc));
                if (m_new == -INFINITY) continue; /* nothing visible yet (warp-uniform) */
                float corr = expf(m[rr] - m_new), p = expf(sc - m_new);
                l[rr] = fmaf(l[rr], corr, rf__warp_sum(p));
#pragma unroll
                for (int i = 0; i < NPL; i++) acc[rr][i] *= corr;
                for (int c2 = 0; c2 < nc; c2++) {
                    float pc = __shfl_sync(0xffffffffu, p, c2);
#pragma unroll
                    for (int i = 0; i < NPL; i++) {
                        int d = lane + 32 * i;
                        if (d < D) acc[rr][i] = fmaf(pc, V[c2 * ld + d], acc[rr][i]);
                    }
                }
                m[rr] = m_new;
            }
        }
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
            int r = rr * FWARPS + warp, pr = p0 + r;
            if (r >= nr) continue;
            int h = kvh * group + pr % group;
            if (SPLIT) { /* one query: pair pr is head pr of the group */
                rf__chunk_states cs = rf__chunk_states_of(part, (int)gridDim.y, H, max_chunks);
                size_t slot = cs.at(s, h, chunk);
                if (lane == 0) cs.m[slot] = m[rr], cs.l[slot] = l[rr];
#pragma unroll
                for (int i = 0; i < NPL; i++) {
                    int d = lane + 32 * i;
                    if (d < D) cs.acc[slot * D + d] = acc[rr][i];
                }
                continue;
            }
            merge_state<NPL>(mt[rr], lt[rr], acct[rr], m[rr], l[rr], acc[rr]);
            size_t row = (size_t)(q_off[s] + pr / group) * H + h;
            float inv = lt[rr] > 0.0f ? 1.0f / lt[rr] : 0.0f;
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                int d = lane + 32 * i;
                if (d < D) out[row * D + d] = acct[rr][i] * inv;
            }
            if (lse && lane == 0) lse[row] = lt[rr] > 0.0f ? mt[rr] + logf(lt[rr]) : -INFINITY;
        }
    }
}

/* out rows of one-query sequences from the split forward's chunk states, merged in order from an
 * empty state as the unsplit forward merges them: one warp per (sequence, head), grid-stride. */
template <int NPL>
static __global__ void decode_combine_kernel(float *out, const float *part, const int32_t *q_off,
                                             const int32_t *k_len, int n_seq, int H, int D,
                                             int max_chunks) {
    int lane = threadIdx.x % 32;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32;
    rf__chunk_states cs = rf__chunk_states_of(part, n_seq, H, max_chunks);
    for (size_t sh = warp; sh < (size_t)n_seq * H; sh += n_warps) {
        int s = (int)(sh / H), h = (int)(sh % H);
        if (q_off[s + 1] - q_off[s] != 1) continue;
        int n_chunks = (k_len[s] + CH - 1) / CH;
        float mt = -INFINITY, lt = 0.0f, acct[NPL], accc[NPL];
#pragma unroll
        for (int i = 0; i < NPL; i++) acct[i] = 0.0f;
        for (int c = 0; c < n_chunks; c++) {
            size_t slot = cs.at(s, h, c);
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                int d = lane + 32 * i;
                accc[i] = d < D ? cs.acc[slot * D + d] : 0.0f;
            }
            merge_state<NPL>(mt, lt, acct, cs.m[slot], cs.l[slot], accc);
        }
        size_t row = (size_t)q_off[s] * H + h;
        float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            int d = lane + 32 * i;
            if (d < D) out[row * D + d] = acct[i] * inv;
        }
    }
}

int rf__cuda_flash_supported(int n_seq, int H, int KVH, int D) {
    return D >= 1 && D <= RF_FLASH_MAX_D && n_seq <= 65535 && H <= 65535 && KVH >= 1 &&
           H % KVH == 0;
}

template <int NPL, class KV, bool SPLIT>
static int launch_forward_t(dim3 grid, float *out, float *lse, float *part, const float *q,
                            const float *k, const float *v, KV kv, const int32_t *q_off,
                            const int32_t *k_len, int H, int KVH, int D, int bf16,
                            int skip_one_query, int max_chunks) {
    size_t sm = smem_bytes(3, D);
    if (!rf__allow_smem(flash_forward_kernel<NPL, KV, SPLIT>, sm)) return 0;
    flash_forward_kernel<NPL, KV, SPLIT><<<grid, FTHREADS, sm, rf__cuda.stream>>>(
        out, lse, part, q, k, v, kv, q_off, k_len, H, KVH, D, bf16, skip_one_query, max_chunks);
    return RF_CUDA_LAUNCH_CHECK();
}

/* The unsplit forward (1 when launched); skip_one_query: leave one-query sequences' rows to a
 * split launch. */
template <class KV>
static int launch_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                          KV kv, const int32_t *q_off, const int32_t *k_len, int n_seq, int H,
                          int KVH, int D, int bf16, int skip_one_query) {
    dim3 grid((unsigned)rf__flash_forward_gx(n_seq, KVH), (unsigned)n_seq, (unsigned)KVH);
    return D <= 64 ? launch_forward_t<2, KV, false>(grid, out, lse, NULL, q, k, v, kv, q_off, k_len,
                                                    H, KVH, D, bf16, skip_one_query, 0)
                   : launch_forward_t<4, KV, false>(grid, out, lse, NULL, q, k, v, kv, q_off, k_len,
                                                    H, KVH, D, bf16, skip_one_query, 0);
}

void rf__cuda_flash_forward(float *out, float *lse, const float *q, const float *k,
                            const float *v, const int32_t *q_off, const int32_t *k_start,
                            const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    int att = rf__cuda_attention_bf16(), bf16 = att != RF_ATT_FP32;
    if (att == RF_ATT_BF16_TC && rf__cuda_flash_mma_supported(D, 0)) { /* tensor cores: cuda_flash_mma.cu */
        rf__cuda_flash_forward_mma(out, lse, q, k, v, q_off, k_start, k_len, n_seq, H, KVH, D);
        return;
    }
    kv_rows kv = {k_start, KVH, D};
    launch_forward(out, lse, q, k, v, kv, q_off, k_len, n_seq, H, KVH, D, bf16, 0);
}

/* Whether a paged forward splits its decoding rows over key chunks: RLFLOW_CUDA_DECODE=split /
 * =tiled force it; by default where there are few (sequence, KV head) blocks to fill the GPU
 * and contexts span several chunks, and the chunk states fit 64 MB. The bits are the same
 * either way; only the speed differs. */
static int paged_split(int n_seq, int H, int KVH, int D, int max_chunks) {
    const char *e = getenv("RLFLOW_CUDA_DECODE");
    size_t bytes = sizeof(float) * (size_t)n_seq * H * max_chunks * (D + 2);
    if (e && strcmp(e, "tiled") == 0) return 0;
    if (e && strcmp(e, "split") == 0) return 1;
    return max_chunks > 1 && (size_t)n_seq * KVH < 1024 && bytes <= ((size_t)64 << 20);
}

void rf__cuda_flash_paged_forward(float *out, const float *q, const float *k_pool,
                                  const float *v_pool, const int32_t *q_off,
                                  const int32_t *block_table, int max_blocks,
                                  const int32_t *k_len, int n_seq, int block_size, int H,
                                  int KVH, int D) {
    int att = rf__cuda_attention_bf16(), bf16 = att != RF_ATT_FP32;
    int tc = att == RF_ATT_BF16_TC && rf__cuda_flash_mma_supported(D, 0); /* training's twin */
    kv_paged kv = {block_table, max_blocks, block_size, KVH, D};
    long long chunks = ((long long)max_blocks * block_size + CH - 1) / CH; /* of the longest */
    int max_chunks = chunks > INT_MAX ? INT_MAX : (int)chunks;
    int split = paged_split(n_seq, H, KVH, D, max_chunks);
    int ok = tc ? rf__cuda_flash_paged_forward_mma(out, q, k_pool, v_pool, q_off, block_table, max_blocks,
                                                   k_len, n_seq, block_size, H, KVH, D, split)
                : launch_forward(out, (float *)NULL, q, k_pool, v_pool, kv, q_off, k_len, n_seq, H, KVH,
                                 D, bf16, split);
    if (!ok || !split) return;
    cudaStream_t st = rf__cuda.stream;
    size_t n = (size_t)n_seq * H * max_chunks;
    float *part = NULL; /* chunk states: m, l (n) then acc (n, D); stream-ordered */
    if (!RF_CUDA_CHECK(cudaMallocAsync((void **)&part, sizeof(float) * n * (D + 2), st))) return;
    dim3 grid((unsigned)max_chunks, (unsigned)n_seq, (unsigned)KVH);
    if (tc)
        ok = rf__cuda_flash_paged_chunks_mma(part, q, k_pool, v_pool, q_off, block_table, max_blocks, k_len,
                                             n_seq, block_size, H, KVH, D, max_chunks);
    else if (D <= 64)
        ok = launch_forward_t<2, kv_paged, true>(grid, NULL, NULL, part, q, k_pool, v_pool, kv, q_off, k_len,
                                                 H, KVH, D, bf16, 0, max_chunks);
    else
        ok = launch_forward_t<4, kv_paged, true>(grid, NULL, NULL, part, q, k_pool, v_pool, kv, q_off, k_len,
                                                 H, KVH, D, bf16, 0, max_chunks);
    if (ok) {
        size_t blocks = ((size_t)n_seq * H + FWARPS - 1) / FWARPS;
        unsigned g = blocks > RF_CUDA_MAX_GRID ? RF_CUDA_MAX_GRID : (unsigned)blocks;
        if (D <= 64)
            decode_combine_kernel<2><<<g, FTHREADS, 0, st>>>(out, part, q_off, k_len, n_seq, H, D, max_chunks);
        else
            decode_combine_kernel<4><<<g, FTHREADS, 0, st>>>(out, part, q_off, k_len, n_seq, H, D, max_chunks);
        RF_CUDA_LAUNCH_CHECK();
    }
    RF_CUDA_CHECK(cudaFreeAsync(part, st));
}

/* ---- backward (training layout: k_start = q_off = cu_seqlens, k_len = q_len) ---- */

/* Di (rows) = dout . out per (query, head) row, dout rounded at bf16; one warp per row. */
static __global__ void flash_di_kernel(float *di, const float *dout, const float *out,
                                       const int32_t *cu_seqlens, int n_seq, int H, int D,
                                       int bf16) {
    int lane = threadIdx.x % 32;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    size_t n_warps = (size_t)gridDim.x * blockDim.x / 32, rows = (size_t)cu_seqlens[n_seq] * H;
    for (size_t row = warp; row < rows; row += n_warps) {
        float sacc = 0.0f;
        for (int d = lane; d < D; d += 32) sacc += rf__bf16_round(dout[row * D + d], bf16) * out[row * D + d];
        sacc = rf__warp_sum(sacc);
        if (lane == 0) di[row] = sacc;
    }
}

/* dk, dv of one key tile: grid (key tiles, stride gridDim.x; n_seq; KVH). Lane = query row of
 * the staged query tile; each warp's 8 key rows accumulate in registers. */
template <int NPL>
static __global__ void __launch_bounds__(FTHREADS)
flash_dkdv_kernel(float *dk, float *dv, const float *dout, const float *q, const float *k,
                  const float *v, const float *lse, const float *di, const int32_t *cu_seqlens,
                  int H, int KVH, int D, int bf16) {
    extern __shared__ float sm[];
    __shared__ float lse_s[BR], di_s[BR];
    int s = blockIdx.y, kvh = blockIdx.z, group = H / KVH, ld = D + 1;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float *K = sm, *V = K + BC * ld, *Q = V + BC * ld, *dO = Q + BR * ld;
    int off = cu_seqlens[s], L = cu_seqlens[s + 1] - off;
    float scale = 1.0f / sqrtf((float)D);
    size_t qs = (size_t)H * D, ks = (size_t)KVH * D;
    for (int j0 = blockIdx.x * BC; j0 < L; j0 += gridDim.x * BC) {
        int nc = min(BC, L - j0);
        __syncthreads();
        load_tile(K, k + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, ld, bf16);
        load_tile(V, v + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, ld, bf16);
        float dK[ROWS_PER_WARP][NPL], dV[ROWS_PER_WARP][NPL];
#pragma unroll
        for (int cc = 0; cc < ROWS_PER_WARP; cc++)
#pragma unroll
            for (int i = 0; i < NPL; i++) dK[cc][i] = dV[cc][i] = 0.0f;
        for (int h = kvh * group; h < (kvh + 1) * group; h++) {
            for (int i0 = j0 / BR * BR; i0 < L; i0 += BR) {
                int nr = min(BR, L - i0);
                size_t row0 = (size_t)(off + i0) * H + h;
                __syncthreads();
                load_tile(Q, q + row0 * D, qs, nr, D, ld, bf16);
                load_tile(dO, dout + row0 * D, qs, nr, D, ld, bf16);
                if (threadIdx.x < BR) {
                    int r = threadIdx.x;
                    lse_s[r] = r < nr ? lse[row0 + (size_t)r * H] : 0.0f;
                    di_s[r] = r < nr ? di[row0 + (size_t)r * H] : 0.0f;
                }
                __syncthreads();
#pragma unroll
                for (int cc = 0; cc < ROWS_PER_WARP; cc++) {
                    int c = warp * ROWS_PER_WARP + cc, r = lane;
                    if (c >= nc) continue; /* warp-uniform */
                    int ok = r < nr && j0 + c <= i0 + r;
                    float p = 0.0f, ds = 0.0f;
                    if (ok) {
                        p = expf(scale * sdot(Q + r * ld, K + c * ld, D) - lse_s[r]);
                        ds = p * (sdot(dO + r * ld, V + c * ld, D) - di_s[r]) * scale;
                    }
                    for (int r2 = 0; r2 < nr; r2++) {
                        float pr = __shfl_sync(0xffffffffu, p, r2);
                        float dsr = __shfl_sync(0xffffffffu, ds, r2);
#pragma unroll
                        for (int i = 0; i < NPL; i++) {
                            int d = lane + 32 * i;
                            if (d < D) {
                                dV[cc][i] += pr * dO[r2 * ld + d];
                                dK[cc][i] += dsr * Q[r2 * ld + d];
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int cc = 0; cc < ROWS_PER_WARP; cc++) {
            int c = warp * ROWS_PER_WARP + cc;
            if (c >= nc) continue;
            size_t row = ((size_t)(off + j0 + c) * KVH + kvh) * D;
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                int d = lane + 32 * i;
                if (d < D) dk[row + d] = dK[cc][i], dv[row + d] = dV[cc][i];
            }
        }
    }
}

/* dq of one query tile: grid (query tiles, stride gridDim.x; n_seq; H). Lane = key row of the
 * staged key tile; each warp's 8 query rows accumulate in registers. */
template <int NPL>
static __global__ void __launch_bounds__(FTHREADS)
flash_dq_kernel(float *dq, const float *dout, const float *q, const float *k, const float *v,
                const float *lse, const float *di, const int32_t *cu_seqlens, int H, int KVH,
                int D, int bf16) {
    extern __shared__ float sm[];
    int s = blockIdx.y, h = blockIdx.z, kvh = h / (H / KVH), ld = D + 1;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float *Q = sm, *dO = Q + BR * ld, *K = dO + BR * ld, *V = K + BC * ld;
    int off = cu_seqlens[s], L = cu_seqlens[s + 1] - off;
    float scale = 1.0f / sqrtf((float)D);
    size_t qs = (size_t)H * D, ks = (size_t)KVH * D;
    for (int i0 = blockIdx.x * BR; i0 < L; i0 += gridDim.x * BR) {
        int nr = min(BR, L - i0);
        size_t row0 = (size_t)(off + i0) * H + h;
        __syncthreads();
        load_tile(Q, q + row0 * D, qs, nr, D, ld, bf16);
        load_tile(dO, dout + row0 * D, qs, nr, D, ld, bf16);
        float dQ[ROWS_PER_WARP][NPL], lr[ROWS_PER_WARP], dr[ROWS_PER_WARP];
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
            int r = warp * ROWS_PER_WARP + rr;
            lr[rr] = r < nr ? lse[row0 + (size_t)r * H] : 0.0f;
            dr[rr] = r < nr ? di[row0 + (size_t)r * H] : 0.0f;
#pragma unroll
            for (int i = 0; i < NPL; i++) dQ[rr][i] = 0.0f;
        }
        for (int j0 = 0; j0 < i0 + nr; j0 += BC) {
            int nc = min(BC, i0 + nr - j0);
            __syncthreads();
            load_tile(K, k + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, ld, bf16);
            load_tile(V, v + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, ld, bf16);
            __syncthreads();
#pragma unroll
            for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
                int r = warp * ROWS_PER_WARP + rr, c = lane;
                if (r >= nr) continue;
                float ds = 0.0f;
                if (c < nc && j0 + c <= i0 + r) {
                    float p = expf(scale * sdot(Q + r * ld, K + c * ld, D) - lr[rr]);
                    ds = p * (sdot(dO + r * ld, V + c * ld, D) - dr[rr]) * scale;
                }
                for (int c2 = 0; c2 < nc; c2++) {
                    float dsc = __shfl_sync(0xffffffffu, ds, c2);
#pragma unroll
                    for (int i = 0; i < NPL; i++) {
                        int d = lane + 32 * i;
                        if (d < D) dQ[rr][i] += dsc * K[c2 * ld + d];
                    }
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
            int r = warp * ROWS_PER_WARP + rr;
            if (r >= nr) continue;
            size_t row = row0 + (size_t)r * H;
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                int d = lane + 32 * i;
                if (d < D) dq[row * D + d] = dQ[rr][i];
            }
        }
    }
}

template <int NPL>
static void launch_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                            const float *k, const float *v, const float *lse, const float *di,
                            const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH, int D,
                            int bf16) {
    size_t sm = smem_bytes(4, D);
    int gx = rf__flash_backward_gx(T, BR);
    if (!rf__allow_smem(flash_dkdv_kernel<NPL>, sm) || !rf__allow_smem(flash_dq_kernel<NPL>, sm)) return;
    flash_dkdv_kernel<NPL><<<dim3(gx, n_seq, KVH), FTHREADS, sm, rf__cuda.stream>>>(
        dk, dv, dout, q, k, v, lse, di, cu_seqlens, H, KVH, D, bf16);
    if (!RF_CUDA_LAUNCH_CHECK()) return;
    flash_dq_kernel<NPL><<<dim3(gx, n_seq, H), FTHREADS, sm, rf__cuda.stream>>>(
        dq, dout, q, k, v, lse, di, cu_seqlens, H, KVH, D, bf16);
    RF_CUDA_LAUNCH_CHECK();
}

void rf__cuda_flash_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                             const float *k, const float *v, const float *out, const float *lse,
                             const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH, int D) {
    int att = rf__cuda_attention_bf16(), bf16 = att != RF_ATT_FP32;
    cudaStream_t st = rf__cuda.stream;
    size_t q_rows = (size_t)T * H, kv_bytes = sizeof(float) * (size_t)T * KVH * D;
    /* rows past cu_seqlens[n_seq] (no sequence) read as zero gradients, as on the CPU */
    if (!RF_CUDA_CHECK(cudaMemsetAsync(dk, 0, kv_bytes, st)) ||
        !RF_CUDA_CHECK(cudaMemsetAsync(dv, 0, kv_bytes, st)))
        return;
    float *di = NULL; /* (T, H) scratch, stream-ordered */
    if (!RF_CUDA_CHECK(cudaMallocAsync((void **)&di, sizeof(float) * q_rows, st))) return;
    size_t blocks = (q_rows + FWARPS - 1) / FWARPS;
    flash_di_kernel<<<blocks > RF_CUDA_MAX_GRID ? RF_CUDA_MAX_GRID : (unsigned)blocks, FTHREADS, 0,
                      st>>>(di, dout, out, cu_seqlens, n_seq, H, D, bf16);
    if (RF_CUDA_LAUNCH_CHECK()) {
        if (att == RF_ATT_BF16_TC && rf__cuda_flash_mma_supported(D, 1)) /* tensor cores: cuda_flash_mma.cu */
            rf__cuda_flash_backward_mma(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T,
                                        H, KVH, D);
        else if (D <= 64)
            launch_backward<2>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH,
                               D, bf16);
        else
            launch_backward<4>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH,
                               D, bf16);
    }
    RF_CUDA_CHECK(cudaFreeAsync(di, st));
}
