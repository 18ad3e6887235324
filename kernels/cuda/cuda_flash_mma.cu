/* The tiled attention on tensor cores, at precision bf16: FlashAttention-2's forward (Dao 2023,
 * Algorithm 1: per key tile S = Q K^T, online softmax, O += P V) and backward (Algorithm 2, in
 * a deterministic two-pass form), as bf16 x bf16 -> fp32 products of the warp's tensor cores
 * (PTX mma.sync m16n8k16, kernels/cuda/cuda_mma.cuh, sm_80 and later), for head dims that are
 * multiples of 16 up to RF_FLASH_MAX_D, taken at precision bf16 unless RLFLOW_CUDA_ATTENTION
 * names another path (rf__cuda_attention_bf16; at precision fp32 attention is fp32 arithmetic).
 * cuda_flash.cu's FMA kernels stay the path for other head dims, for fp32, for GPUs before
 * sm_80 and where the tiles do not fit; tests/test_kernels_cuda.c checks these kernels against
 * the CPU mirror kernels/cpu/cpu_flash_ref.c in its RF_FLASH_BF16_MMA mode and against the FMA
 * ones.
 *
 * Forward work split. A block of 4 warps owns a tile of 64 (query, head) rows of one (sequence,
 * KV head), the rows of the group's heads query by query, each warp 16 of them, and visits the
 * key tiles of RF_FLASH_BC = 32 keys in order: the same key tiles, hence the same online-softmax
 * steps per row, as the mirror and the FMA kernel, and like them takes a row's keys in chunks of
 * RF_FLASH_CHUNK from an empty state each, merging the chunks' states in order. It is also
 * decoding's attention over the paged KV cache at precision bf16
 * (rf__cuda_flash_paged_forward_mma), one block per (row tile, sequence, KV head), or, for the
 * one-query rows of a step with few sequences, one block per key chunk, whose states
 * cuda_flash.cu's combine merges in the same order (FlashDecoding's split, Dao et al. 2023;
 * rf__cuda_flash_paged_chunks_mma): either way a row gets training's bits. Per key tile:
 *  1. the block stages K (by rows) and V (transposed), rounded to bf16, in shared memory, two
 *     key tiles a round (Q was staged once per row tile and sits in each warp's registers as A
 *     fragments);
 *  2. each warp computes its 16 x 32 scores into registers;
 *  3. each lane, for its two rows: scaled and masked scores, the row's new max m' (over the
 *     row's 4 lanes), corr = exp(m - m'), p = exp(score - m'), l = l corr + sum p (fp32,
 *     unrounded p; the lane's part of the row), p rounded to bf16 as the next product's A
 *     fragments, the row's part of O rescaled by corr;
 *  4. O (16 x D, fp32 in registers) += P (16 x 32) V (32 x D).
 * The first version ran on WMMA, whose fragment layout is unspecified, so its per-row steps went
 * through shared memory (S, P and O once per key tile, a warp walking its 16 rows one by one);
 * mma.sync's documented layout keeps them in registers. Every output row is written by one
 * warp: no atomics, deterministic. */
#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_mma.cuh"
#include "kernels/flash_ref.h"

#define TC_WARPS 4
#define TC_BR (16 * TC_WARPS) /* query rows per block: 16 per warp */
#define TC_BC RF_FLASH_BC     /* keys per tile: the mirror's online-softmax steps */
#define TC_THREADS (32 * TC_WARPS)
#define TC_PAD 8 /* elements added to each shared row: conflict-free fragment loads */

static_assert(TC_BC % 16 == 0, "key tiles of whole k-steps of the second product");

#define TC_KT (2 * TC_BC) /* keys the forward stages per round: two of the mirror's key tiles */

/* The forward's shared memory for head dim D: where it merges chunks (merged), first the merged
 * state's outputs, each lane's own (D / 2 floats a lane, float4 slots, conflict-free: kept out of
 * the registers, where at D = 64 they made ptxas spill); then Q (TC_BR x (D + 8)) and K (TC_KT x
 * (D + 8)) as bf16 rows, V transposed (D x (TC_KT + 8), bf16: the second product's B operand
 * reads pairs of adjacent keys). Rows padded by 8 elements: the fragment loads of a warp's 32
 * lanes (8 rows x 4 pairs) fall in 32 different banks. */
static __host__ __device__ inline size_t fwd_merged_bytes(int D, bool merged) {
    return merged ? sizeof(float) * (size_t)TC_THREADS * (D / 2) : 0;
}
static __host__ __device__ inline size_t fwd_smem_bytes(int D, bool merged) {
    return fwd_merged_bytes(D, merged) +
           sizeof(__nv_bfloat16) * ((size_t)(TC_BR + TC_KT) * (D + TC_PAD) + (size_t)D * (TC_KT + TC_PAD));
}

/* Rounds 4 floats to bf16 into tile row r at column d (8 bytes; d a multiple of 4) and, when
 * tile_t is not NULL, into column r of rows d .. d + 3 of the transposed tile (ldt). */
static __device__ inline void put4(__nv_bfloat16 *tile, int ld, __nv_bfloat16 *tile_t, int ldt, int r, int d,
                                   float4 x) {
    if (tile) {
        uint2 u = {rf__pack_bf16(x.x, x.y), rf__pack_bf16(x.z, x.w)};
        *(uint2 *)(tile + r * ld + d) = u;
    }
    if (tile_t) {
        tile_t[(d + 0) * ldt + r] = __float2bfloat16_rn(x.x), tile_t[(d + 1) * ldt + r] = __float2bfloat16_rn(x.y);
        tile_t[(d + 2) * ldt + r] = __float2bfloat16_rn(x.z), tile_t[(d + 3) * ldt + r] = __float2bfloat16_rn(x.w);
    }
}

/* Stages `rows` rows of D floats in bf16 (zero past n): row r from row_at(r) (a float pointer,
 * 16-byte aligned when VEC: one float4 a thread at a time, else one float), by rows into tile
 * (ld) when not NULL and transposed into tile_t (ldt) when not NULL. Every thread of the block takes
 * part; consecutive threads read consecutive floats of a row. */
template <int D, bool VEC, class RowAt>
static __device__ inline void stage(__nv_bfloat16 *tile, int ld, __nv_bfloat16 *tile_t, int ldt, int n, int rows,
                                    const RowAt &row_at) {
    if (VEC) {
        for (int idx = threadIdx.x; idx < rows * (D / 4); idx += blockDim.x) {
            int r = idx / (D / 4), d = idx % (D / 4) * 4;
            float4 x = r < n ? *(const float4 *)(row_at(r) + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            put4(tile, ld, tile_t, ldt, r, d, x);
        }
    } else {
        for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
            int r = idx / D, d = idx % D;
            __nv_bfloat16 x = __float2bfloat16_rn(r < n ? row_at(r)[d] : 0.0f);
            if (tile) tile[r * ld + d] = x;
            if (tile_t) tile_t[d * ldt + r] = x;
        }
    }
}

/* A row's sum of its 4 lanes' parts (lanes 4 g .. 4 g + 3), in one order for every kernel that
 * needs a chunk's row sum. */
static __device__ inline float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* A chunk's state (m, this lane's part of l, o: the lane's two rows) merged into the merged state
 * of the chunks before it (mt, lt, and the lane's outputs in its shared slots ot[n TC_THREADS]:
 * rows g and g + 8 as x, y and z, w), as split decoding's combine merges it (rf__merge_factors):
 * the chunk's l is its 4 lanes' parts added first. reset: the chunk's state emptied for the
 * next one. Every lane of the warp takes part (shuffles). */
template <int NT>
static __device__ inline void merge_chunk(float4 *ot, float (*o)[4], float *m, float *l, float *mt, float *lt,
                                          bool reset) {
    float ca[2], cb[2];
    bool any[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float lc = quad_sum(l[h]), mm;
        any[h] = rf__merge_factors(mt[h], m[h], &mm, &ca[h], &cb[h]);
        if (any[h]) lt[h] = fmaf(lt[h], ca[h], lc * cb[h]), mt[h] = mm;
    }
#pragma unroll
    for (int n = 0; n < NT; n++) {
        float4 x = ot[n * TC_THREADS];
        if (any[0]) x.x = fmaf(x.x, ca[0], o[n][0] * cb[0]), x.y = fmaf(x.y, ca[0], o[n][1] * cb[0]);
        if (any[1]) x.z = fmaf(x.z, ca[1], o[n][2] * cb[1]), x.w = fmaf(x.w, ca[1], o[n][3] * cb[1]);
        ot[n * TC_THREADS] = x;
        if (reset) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    if (reset) m[0] = m[1] = -INFINITY, l[0] = l[1] = 0.0f;
}

/* grid (tiles of TC_BR (query, head) pairs, stride gridDim.x; n_seq; KVH) or, SPLIT, (key chunks;
 * n_seq; KVH), TC_THREADS threads, fwd_smem_bytes(D, !SPLIT) of dynamic shared memory. A tile
 * holds the rows of every head of a KV head's
 * group (pair p = query p / group, head p % group of the group), so each key tile is loaded once
 * for the group, as in cuda_flash.cu. Warp w owns the tile's rows 16 w .. 16 w + 15; lane
 * (g, t) (cuda_mma.cuh) holds rows g and g + 8 of them: its Q fragments (D / 16 x 4 registers),
 * its part of the 16 x TC_BC scores, its m and l, and its part of O (D / 8 x 4 floats), all in
 * registers across the key tiles. Per key tile: S = Q K^T (D / 16 x 4 products), each row's
 * max over its 4 lanes (two shuffles), corr = exp(m - m'), p = exp(s - m'), l = l corr + p
 * (fp32, the lane's own part; the 4 parts are added at the end of each chunk), p rounded to
 * bf16 as the A operand of O = O corr + P V (2 x D / 8 products). Every RF_FLASH_CHUNK keys
 * (two staging rounds) the chunk's state is merged into the merged state (merge_chunk, the
 * factors of rf__merge_factors, as the combine takes them) and starts afresh. SPLIT: block x
 * takes chunk x of the rows of one-query sequences (the only ones it takes; an unsplit launch
 * beside it skips them, skip_one_query) and writes the chunk's state (m, l, unnormalised O) to
 * part, where cuda_flash.cu's decode_combine_kernel merges the chunks from an empty state as
 * this kernel merges them. A row's arithmetic depends on its own q and keys only (a product's
 * row i reads row i of A; key tiles past a row's last key add exact zeros: p = 0, corr = 1;
 * chunks past it are empty states, whose merge changes nothing), so training's forward
 * (kv_rows) and decoding's over the paged cache (kv_paged), split or not, give a row the same
 * bits. */
template <int D, bool VEC, class KV, bool SPLIT>
static __global__ void __launch_bounds__(TC_THREADS)
flash_forward_mma_kernel(float *out, float *lse, float *part, const float *q, const float *k,
                         const float *v, KV kv, const int32_t *q_off, const int32_t *k_len, int H,
                         int KVH, int skip_one_query, int max_chunks) {
    constexpr int LDH = D + TC_PAD, LDT = TC_KT + TC_PAD, KS = D / 16, NT = D / 8;
    static_assert(RF_FLASH_CHUNK % TC_KT == 0, "chunks are whole staging rounds");
    extern __shared__ __align__(128) unsigned char smem[];
    float4 *ot = (float4 *)smem + threadIdx.x; /* this lane's merged outputs: slot n at ot[n TC_THREADS] */
    __nv_bfloat16 *Q = (__nv_bfloat16 *)(smem + fwd_merged_bytes(D, !SPLIT));
    __nv_bfloat16 *K = Q + TC_BR * LDH, *Vt = K + TC_KT * LDH;
    int s = blockIdx.y, kvh = blockIdx.z, group = H / KVH;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, wr0 = warp * 16, g = lane / 4, t = lane % 4;
    int qlen = q_off[s + 1] - q_off[s], klen = k_len[s], off = klen - qlen;
    if (SPLIT ? qlen != 1 : skip_one_query && qlen == 1) return; /* block-uniform */
    int chunk = SPLIT ? (int)blockIdx.x : 0, x0 = SPLIT ? 0 : (int)blockIdx.x;
    int xs = SPLIT ? 1 : (int)gridDim.x;
    if (SPLIT && chunk * RF_FLASH_CHUNK >= klen) return;
    int pairs = qlen * group;
    float scale = 1.0f / sqrtf((float)D);
    for (int p0 = x0 * TC_BR; p0 < pairs; p0 += xs * TC_BR) {
        int nr = min(TC_BR, pairs - p0);
        __syncthreads(); /* the previous tile's readers are done */
        int q_first = q_off[s];
        stage<D, VEC>(Q, LDH, (__nv_bfloat16 *)NULL, 0, nr, TC_BR, [&](int r) {
            int p = p0 + r; /* pair p: query p / group of head kvh group + p % group */
            return q + ((size_t)(q_first + p / group) * H + kvh * group + p % group) * D;
        });
        __syncthreads();
        uint32_t qa[KS][4];
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            const __nv_bfloat16 *r0 = Q + (wr0 + g) * LDH + kk * 16 + 2 * t, *r1 = r0 + 8 * LDH;
            qa[kk][0] = rf__ld_bf16x2(r0), qa[kk][1] = rf__ld_bf16x2(r1);
            qa[kk][2] = rf__ld_bf16x2(r0 + 8), qa[kk][3] = rf__ld_bf16x2(r1 + 8);
        }
        /* the running chunk's state (m, l: this lane's part, o) and, not SPLIT, the merged state
         * of the chunks before it (mt, lt: the whole row's; its outputs in ot) */
        float o[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
            if (!SPLIT) ot[n * TC_THREADS] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        /* this lane's two rows: valid, and the last key each sees */
        int ra = wr0 + g, rb = ra + 8;
        int lima = ra < nr ? (p0 + ra) / group + off : -1, limb = rb < nr ? (p0 + rb) / group + off : -1;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        float mt[2] = {-INFINITY, -INFINITY}, lt[2] = {0.0f, 0.0f};
        int nkeys = min((p0 + nr - 1) / group + 1 + off, klen); /* the tile's last query's */
        int jlo = SPLIT ? chunk * RF_FLASH_CHUNK : 0, jhi = SPLIT ? min(nkeys, jlo + RF_FLASH_CHUNK) : nkeys;
        /* the warp's rows see keys up to wlim; rows past nr none (warp-uniform) */
        int wlim = wr0 < nr ? (p0 + min(wr0 + 15, nr - 1)) / group + off : -1;
        for (int j00 = jlo; j00 < jhi; j00 += TC_KT) { /* staging rounds of two key tiles */
            if (!SPLIT && j00 > 0 && j00 % RF_FLASH_CHUNK == 0) /* a chunk ends: merge it, start the next */
                merge_chunk<NT>(ot, o, m, l, mt, lt, true);
            int nk = min(TC_KT, klen - j00);
            __syncthreads();
            stage<D, VEC>(K, LDH, (__nv_bfloat16 *)NULL, 0, nk, TC_KT, [&](int r) { return k + kv.at(s, kvh, j00 + r); });
            stage<D, VEC>((__nv_bfloat16 *)NULL, 0, Vt, LDT, nk, TC_KT, [&](int r) { return v + kv.at(s, kvh, j00 + r); });
            __syncthreads();
#pragma unroll 1
            for (int sub = 0; sub < TC_KT / TC_BC; sub++) {
            int j0 = j00 + sub * TC_BC, nc = min(TC_BC, klen - j0);
            if (j0 >= jhi || j0 > wlim) break; /* no row of the warp sees this tile: m, l, O unchanged */
            const __nv_bfloat16 *Kb = K + sub * TC_BC * LDH, *Vb = Vt + sub * TC_BC;
            float sc[TC_BC / 8][4];
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n++) {
                sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KS; kk++) {
                    const __nv_bfloat16 *kr = Kb + (n * 8 + g) * LDH + kk * 16 + 2 * t;
                    uint32_t b[2] = {rf__ld_bf16x2(kr), rf__ld_bf16x2(kr + 8)};
                    rf__mma_16816(sc[n], qa[kk], b); /* S = Q K^T */
                }
            }
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int c = n * 8 + 2 * t + (e & 1), lim = e < 2 ? lima : limb;
                    float x = c < nc && j0 + c <= lim ? scale * sc[n][e] : -INFINITY;
                    sc[n][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
            float corr[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                float m_new = fmaxf(m[h], mx[h]);
                corr[h] = m_new == -INFINITY ? 1.0f : expf(m[h] - m_new); /* 0 at the first */
                mx[h] = m_new;
            }
            float ps[2] = {0.0f, 0.0f};
            uint32_t pa[TC_BC / 16][4];
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n++) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float mn = mx[e >> 1];
                    p[e] = mn == -INFINITY ? 0.0f : expf(sc[n][e] - mn);
                    ps[e >> 1] += p[e];
                }
                rf__acc_to_a(pa, n, p); /* n-tile n: half of k-step n / 2 */
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                l[h] = fmaf(l[h], corr[h], ps[h]);
                if (mx[h] != -INFINITY) m[h] = mx[h];
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                o[n][0] *= corr[0], o[n][1] *= corr[0], o[n][2] *= corr[1], o[n][3] *= corr[1];
#pragma unroll
                for (int j = 0; j < TC_BC / 16; j++) {
                    const __nv_bfloat16 *vr = Vb + (n * 8 + g) * LDT + j * 16 + 2 * t;
                    uint32_t b[2] = {rf__ld_bf16x2(vr), rf__ld_bf16x2(vr + 8)};
                    rf__mma_16816(o[n], pa[j], b); /* O += P V */
                }
            }
            }
        }
        if (!SPLIT) /* the last chunk merged */
            merge_chunk<NT>(ot, o, m, l, mt, lt, false);
        else /* the chunk's sum over the row's 4 lanes, as merge_chunk adds them */
            l[0] = quad_sum(l[0]), l[1] = quad_sum(l[1]);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = h ? rb : ra, pr = p0 + r;
            if (r >= nr) continue;
            int head = kvh * group + pr % group;
            if (SPLIT) { /* one query: pair pr is head pr of the group; the chunk's state */
                rf__chunk_states cs = rf__chunk_states_of(part, (int)gridDim.y, H, max_chunks);
                size_t slot = cs.at(s, head, chunk);
                if (t == 0) cs.m[slot] = m[h], cs.l[slot] = l[h];
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    cs.acc[slot * D + n * 8 + 2 * t] = o[n][2 * h];
                    cs.acc[slot * D + n * 8 + 2 * t + 1] = o[n][2 * h + 1];
                }
                continue;
            }
            size_t row = (size_t)(q_off[s] + pr / group) * H + head;
            float inv = lt[h] > 0.0f ? 1.0f / lt[h] : 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                float4 x = ot[n * TC_THREADS];
                out[row * D + n * 8 + 2 * t] = (h ? x.z : x.x) * inv;
                out[row * D + n * 8 + 2 * t + 1] = (h ? x.w : x.y) * inv;
            }
            if (lse && t == 0) lse[row] = lt[h] > 0.0f ? mt[h] + logf(lt[h]) : -INFINITY;
        }
    }
}

/* The device's compute capability major, read once (one device per process). */
static int device_major(void) {
    static int major = -1;
    if (major < 0 &&
        !RF_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                              rf__cuda.device)))
        major = 0;
    return major;
}


/* Whether float loads of 16 bytes may read these buffers' rows (each a multiple of D floats,
 * D a multiple of 16, from the buffer's start): the buffers 16-byte aligned. */
static int vec_ok(const void *a, const void *b, const void *c) {
    return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15) == 0;
}

/* What a forward launch does: the rows of every sequence (training; a paged forward that does
 * not split), all but one-query sequences' (skip_one_query: a split launch takes those), or the
 * one-query sequences' key chunks into part (split). */
struct fwd_launch {
    float *out, *lse, *part;
    int skip_one_query, max_chunks; /* part: a split launch */
};

/* 1 when launched. */
template <int D, bool VEC, bool SPLIT, class KV>
static int launch_forward_mma_v(const fwd_launch &L, const float *q, const float *k, const float *v,
                                KV kv, const int32_t *q_off, const int32_t *k_len, int n_seq, int H,
                                int KVH) {
    size_t bytes = fwd_smem_bytes(D, !SPLIT);
    if (!rf__allow_smem(flash_forward_mma_kernel<D, VEC, KV, SPLIT>, bytes)) return 0;
    unsigned gx = SPLIT ? (unsigned)L.max_chunks : (unsigned)rf__flash_forward_gx(n_seq, KVH);
    dim3 grid(gx, (unsigned)n_seq, (unsigned)KVH);
    flash_forward_mma_kernel<D, VEC, KV, SPLIT><<<grid, TC_THREADS, bytes, rf__cuda.stream>>>(
        L.out, L.lse, L.part, q, k, v, kv, q_off, k_len, H, KVH, L.skip_one_query, L.max_chunks);
    return RF_CUDA_LAUNCH_CHECK();
}

template <int D, class KV>
static int launch_forward_mma_d(const fwd_launch &L, const float *q, const float *k, const float *v,
                                KV kv, const int32_t *q_off, const int32_t *k_len, int n_seq, int H,
                                int KVH) {
    int vec = vec_ok(q, k, v);
    if (L.part)
        return vec ? launch_forward_mma_v<D, true, true>(L, q, k, v, kv, q_off, k_len, n_seq, H, KVH)
                   : launch_forward_mma_v<D, false, true>(L, q, k, v, kv, q_off, k_len, n_seq, H, KVH);
    return vec ? launch_forward_mma_v<D, true, false>(L, q, k, v, kv, q_off, k_len, n_seq, H, KVH)
               : launch_forward_mma_v<D, false, false>(L, q, k, v, kv, q_off, k_len, n_seq, H, KVH);
}

/* D a multiple of 16 up to RF_FLASH_MAX_D (rf__cuda_flash_mma_supported): the registers of a
 * lane's fragments are sized at compile time. */
template <class KV>
static int launch_forward_mma(const fwd_launch &L, const float *q, const float *k, const float *v,
                              KV kv, const int32_t *q_off, const int32_t *k_len, int n_seq, int H,
                              int KVH, int D) {
    static_assert(RF_FLASH_MAX_D == 128, "one instantiation per head dim below");
    switch (D) {
#define RF_FWD_D(d) case d: return launch_forward_mma_d<d>(L, q, k, v, kv, q_off, k_len, n_seq, H, KVH);
        RF_FWD_D(16) RF_FWD_D(32) RF_FWD_D(48) RF_FWD_D(64) RF_FWD_D(80) RF_FWD_D(96) RF_FWD_D(112) RF_FWD_D(128)
#undef RF_FWD_D
    default: /* unreachable: rf__cuda_flash_mma_supported refuses such a D */
        return rf__cuda_fail("tensor-core attention forward", "head dim not a multiple of 16 up to 128", __FILE__, __LINE__);
    }
}

void rf__cuda_flash_forward_mma(float *out, float *lse, const float *q, const float *k,
                                const float *v, const int32_t *q_off, const int32_t *k_start,
                                const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    kv_rows kv = {k_start, KVH, D};
    fwd_launch L = {out, lse, NULL, 0, 0};
    launch_forward_mma(L, q, k, v, kv, q_off, k_len, n_seq, H, KVH, D);
}

int rf__cuda_flash_paged_forward_mma(float *out, const float *q, const float *k_pool,
                                     const float *v_pool, const int32_t *q_off,
                                     const int32_t *block_table, int max_blocks,
                                     const int32_t *k_len, int n_seq, int block_size, int H,
                                     int KVH, int D, int skip_one_query) {
    kv_paged kv = {block_table, max_blocks, block_size, KVH, D};
    fwd_launch L = {out, NULL, NULL, skip_one_query, 0};
    return launch_forward_mma(L, q, k_pool, v_pool, kv, q_off, k_len, n_seq, H, KVH, D);
}

int rf__cuda_flash_paged_chunks_mma(float *part, const float *q, const float *k_pool,
                                    const float *v_pool, const int32_t *q_off,
                                    const int32_t *block_table, int max_blocks,
                                    const int32_t *k_len, int n_seq, int block_size, int H,
                                    int KVH, int D, int max_chunks) {
    kv_paged kv = {block_table, max_blocks, block_size, KVH, D};
    fwd_launch L = {NULL, NULL, part, 0, max_chunks};
    return launch_forward_mma(L, q, k_pool, v_pool, kv, q_off, k_len, n_seq, H, KVH, D);
}

/* ---- backward (training layout), at bf16 on tensor cores ----
 *
 * FlashAttention-2's backward (Algorithm 2) in the deterministic two-pass form of the FMA
 * kernels: a dk/dv pass where a block owns TB = 64 keys of one (sequence, query head), 16 per
 * warp, and visits the tiles of BQ = 32 queries of that head that see them (a GQA group's heads
 * write parts, added in head order by a small kernel); then a dq pass
 * where a block owns TB queries of one (sequence, head), 16 per warp, and visits the tiles of
 * TC_BC = 32 keys they see. Per visited tile each warp computes its 16 x 32 scores and dP with
 * the tensor cores (cuda_mma.cuh) in registers: S^T = K Q^T and dP^T = V dO^T (dk/dv pass),
 * S = Q K^T and dP = dO V^T (dq pass); then per element p = exp(scale s - lse),
 * ds = p (dp - Di) scale in fp32 (the mirror's pair_grads), p and ds rounded to bf16 as the A
 * operands of dV += P^T dO and dK += dS^T Q (dk/dv pass) or dQ += dS K (dq pass), whose fp32
 * accumulators stay in registers across the whole visit. The B operands of those last
 * products read pairs of adjacent queries (keys), so the visited tiles are staged twice: by
 * rows and transposed. Each output row is written by one warp: no atomics, deterministic. The
 * CPU mirror's RF_FLASH_BF16_MMA mode rounds p and ds the same way. */

#define TB 64 /* keys (dk/dv pass) or queries (dq pass) a block owns, 16 per warp */
#define BQ 32 /* queries per tile the dk/dv pass visits */

static_assert(TB == 16 * TC_WARPS, "a warp owns 16 rows of the block's tile");
static_assert(BQ == TC_BC, "both passes visit tiles of 32, staged with the same leading dims");

/* Shared memory of both passes for head dim D: the block's own pair of tiles (K, V or Q, dO:
 * TB x (D + 8) bf16 each), the visited pair by rows (32 x (D + 8)) and transposed (dk/dv: Q^T
 * and dO^T; dq: K^T; D x (32 + 8) each), lse and Di of the queries (TB each). */
static __host__ __device__ inline size_t bwd_smem_bytes(int D) {
    size_t ldh = (size_t)D + TC_PAD, ldt = TC_BC + TC_PAD;
    return sizeof(__nv_bfloat16) * (2 * TB * ldh + 2 * (size_t)TC_BC * ldh + 2 * (size_t)D * ldt) +
           sizeof(float) * 2 * TB;
}

/* The most dynamic shared memory a block may opt in to on this device: 227 KB on sm_90, 163 KB
 * on sm_80, but 99 KB on sm_86 / sm_89 (A10, L4, L40S, RTX 30xx / 40xx). */
static size_t smem_optin(void) {
    static int bytes = -1;
    if (bytes < 0 &&
        !RF_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, rf__cuda.device)))
        bytes = 0;
    return (size_t)bytes;
}

int rf__cuda_flash_mma_supported(int D, int backward) {
    if (D % 16 != 0 || D > RF_FLASH_MAX_D || device_major() < 8) return 0;
    /* where the tiles do not fit the device's opt-in limit, the FMA kernels */
    return (backward ? bwd_smem_bytes(D) : fwd_smem_bytes(D, true)) <= smem_optin();
}

/* lse and Di of `rows` query rows row0, row0 + H, ... (n of them; zero past n). */
static __device__ inline void stage_stats(float *lse_s, float *di_s, const float *lse, const float *di,
                                          size_t row0, int n, int rows, int H) {
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        lse_s[r] = r < n ? lse[row0 + (size_t)r * H] : 0.0f;
        di_s[r] = r < n ? di[row0 + (size_t)r * H] : 0.0f;
    }
}

/* p and ds of one element (fp32, the mirror's pair_grads), zero where the pair is not seen. */
static __device__ inline void pair_pds(int seen, float s, float dp, float lse, float di,
                                       float scale, float *p, float *ds) {
    *p = seen ? expf(scale * s - lse) : 0.0f;
    *ds = seen ? *p * (dp - di) * scale : 0.0f;
}

/* acc (16 x 32) = rows r0.. of A (16 x D, tile a, ld) times B^T (tile b: 32 rows of D, ld). */
template <int D>
static __device__ inline void warp_scores(float acc[TC_BC / 8][4], const __nv_bfloat16 *a, int r0,
                                          const __nv_bfloat16 *b, int ld) {
#pragma unroll
    for (int n = 0; n < TC_BC / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t fa[4];
        rf__ld_a(fa, a, ld, r0, kk * 16);
#pragma unroll
        for (int n = 0; n < TC_BC / 8; n++) {
            uint32_t fb[2];
            rf__ld_b(fb, b, ld, n * 8, kk * 16);
            rf__mma_16816(acc[n], fa, fb);
        }
    }
}

/* acc (16 x D) += A (16 x 32: the packed fragments) times B (32 x D; tile bt holds B^T: D rows
 * of 32, ldt). */
template <int D>
static __device__ inline void warp_acc(float acc[D / 8][4], const uint32_t a[TC_BC / 16][4],
                                       const __nv_bfloat16 *bt, int ldt) {
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int j = 0; j < TC_BC / 16; j++) {
            uint32_t fb[2];
            rf__ld_b(fb, bt, ldt, n * 8, j * 16);
            rf__mma_16816(acc[n], a[j], fb);
        }
}

/* The warp's 16 x D result acc to dst: rows r < n of the warp (lane: rows g, g + 8), row r at
 * dst + r stride. */
template <int D>
static __device__ inline void warp_store(float *dst, size_t stride, int n, const float acc[D / 8][4]) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = g + 8 * h;
        if (r >= n) continue;
        float *row = dst + (size_t)r * stride;
#pragma unroll
        for (int c = 0; c < D / 8; c++) row[c * 8 + 2 * t] = acc[c][2 * h], row[c * 8 + 2 * t + 1] = acc[c][2 * h + 1];
    }
}

/* grid (key tiles of TB, stride gridDim.x; n_seq; H): block (x, s, h) sums query head h's part
 * of its keys' gradients, written to rows ((off + j) * out_heads + h) of dk and dv: the
 * gradients themselves where every KV head has one query head (out_heads = KVH = H), else
 * per-head parts (out_heads = H) that reduce_heads_kernel adds up. One block per query head,
 * not per KV head walking its group: a GQA model's 2 KV heads gave 8 busy blocks a sequence. */
template <int D, bool VEC>
static __global__ void __launch_bounds__(TC_THREADS)
flash_dkdv_mma_kernel(float *dk, float *dv, const float *dout, const float *q, const float *k,
                      const float *v, const float *lse, const float *di,
                      const int32_t *cu_seqlens, int H, int KVH, int out_heads) {
    constexpr int LDH = D + TC_PAD, LDT = BQ + TC_PAD;
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *K = (__nv_bfloat16 *)smem, *V = K + TB * LDH, *Q = V + TB * LDH, *dO = Q + BQ * LDH;
    __nv_bfloat16 *Qt = dO + BQ * LDH, *dOt = Qt + D * LDT;
    float *lse_s = (float *)(dOt + D * LDT), *di_s = lse_s + TB;
    int s = blockIdx.y, h = blockIdx.z, kvh = h / (H / KVH);
    int lane = threadIdx.x % 32, w0 = threadIdx.x / 32 * 16, g = lane / 4, t = lane % 4;
    int off = cu_seqlens[s], len = cu_seqlens[s + 1] - off;
    float scale = 1.0f / sqrtf((float)D);
    size_t qs = (size_t)H * D, ks = (size_t)KVH * D, os = (size_t)out_heads * D;
    for (int j0 = blockIdx.x * TB; j0 < len; j0 += gridDim.x * TB) {
        int nc = min(TB, len - j0);
        __syncthreads(); /* the previous tile's readers are done */
        stage<D, VEC>(K, LDH, (__nv_bfloat16 *)NULL, 0, nc, TB, [&](int r) { return k + ((size_t)(off + j0) * KVH + kvh) * D + (size_t)r * ks; });
        stage<D, VEC>(V, LDH, (__nv_bfloat16 *)NULL, 0, nc, TB, [&](int r) { return v + ((size_t)(off + j0) * KVH + kvh) * D + (size_t)r * ks; });
        float dK[D / 8][4], dV[D / 8][4];
#pragma unroll
        for (int c = 0; c < D / 8; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) dK[c][e] = dV[c][e] = 0.0f;
        {
            for (int i0 = j0; i0 < len; i0 += BQ) { /* the query tiles that see a key of the tile */
                int nr = min(BQ, len - i0);
                size_t row0 = (size_t)(off + i0) * H + h;
                __syncthreads();
                stage<D, VEC>(Q, LDH, Qt, LDT, nr, BQ, [&](int r) { return q + row0 * D + (size_t)r * qs; });
                stage<D, VEC>(dO, LDH, dOt, LDT, nr, BQ, [&](int r) { return dout + row0 * D + (size_t)r * qs; });
                stage_stats(lse_s, di_s, lse, di, row0, nr, BQ, H);
                __syncthreads();
                if (w0 >= nc || j0 + w0 > i0 + nr - 1) continue; /* no key of the warp seen */
                float st[BQ / 8][4], dpt[BQ / 8][4];
                warp_scores<D>(st, K, w0, Q, LDH);   /* S^T = K Q^T */
                warp_scores<D>(dpt, V, w0, dO, LDH); /* dP^T = V dO^T */
                uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];
#pragma unroll
                for (int n = 0; n < BQ / 8; n++) {
                    float p[4], ds[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int c = w0 + g + 8 * (e >> 1), r = n * 8 + 2 * t + (e & 1); /* key, query */
                        pair_pds(c < nc && r < nr && j0 + c <= i0 + r, st[n][e], dpt[n][e], lse_s[r],
                                 di_s[r], scale, &p[e], &ds[e]);
                    }
                    rf__acc_to_a(pa, n, p);
                    rf__acc_to_a(dsa, n, ds);
                }
                warp_acc<D>(dV, pa, dOt, LDT); /* dV += P^T dO */
                warp_acc<D>(dK, dsa, Qt, LDT); /* dK += dS^T Q */
            }
        }
        size_t row = ((size_t)(off + j0 + w0) * out_heads + h) * D;
        int n = max(0, min(16, nc - w0));
        warp_store<D>(dv + row, os, n, dV);
        warp_store<D>(dk + row, os, n, dK);
    }
}

/* grid (query tiles of TB, stride gridDim.x; n_seq; H). */
template <int D, bool VEC>
static __global__ void __launch_bounds__(TC_THREADS)
flash_dq_mma_kernel(float *dq, const float *dout, const float *q, const float *k, const float *v,
                    const float *lse, const float *di, const int32_t *cu_seqlens, int H,
                    int KVH) {
    constexpr int LDH = D + TC_PAD, LDT = TC_BC + TC_PAD;
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *Q = (__nv_bfloat16 *)smem, *dO = Q + TB * LDH, *K = dO + TB * LDH, *V = K + TC_BC * LDH;
    __nv_bfloat16 *Kt = V + TC_BC * LDH;
    float *lse_s = (float *)(Kt + 2 * D * LDT), *di_s = lse_s + TB; /* past both transposed areas */
    int s = blockIdx.y, h = blockIdx.z, kvh = h / (H / KVH);
    int lane = threadIdx.x % 32, w0 = threadIdx.x / 32 * 16, g = lane / 4, t = lane % 4;
    int off = cu_seqlens[s], len = cu_seqlens[s + 1] - off;
    float scale = 1.0f / sqrtf((float)D);
    size_t qs = (size_t)H * D, ks = (size_t)KVH * D;
    for (int i0 = blockIdx.x * TB; i0 < len; i0 += gridDim.x * TB) {
        int nr = min(TB, len - i0);
        size_t row0 = (size_t)(off + i0) * H + h;
        __syncthreads(); /* the previous tile's readers are done */
        stage<D, VEC>(Q, LDH, (__nv_bfloat16 *)NULL, 0, nr, TB, [&](int r) { return q + row0 * D + (size_t)r * qs; });
        stage<D, VEC>(dO, LDH, (__nv_bfloat16 *)NULL, 0, nr, TB, [&](int r) { return dout + row0 * D + (size_t)r * qs; });
        stage_stats(lse_s, di_s, lse, di, row0, nr, TB, H);
        float dQ[D / 8][4];
#pragma unroll
        for (int c = 0; c < D / 8; c++) dQ[c][0] = dQ[c][1] = dQ[c][2] = dQ[c][3] = 0.0f;
        int wlast = i0 + min(w0 + 15, nr - 1); /* the warp's last query */
        for (int j0 = 0; j0 < i0 + nr; j0 += TC_BC) { /* the key tiles the query tile sees */
            int nc = min(TC_BC, i0 + nr - j0);
            __syncthreads();
            stage<D, VEC>(K, LDH, Kt, LDT, nc, TC_BC, [&](int r) { return k + ((size_t)(off + j0) * KVH + kvh) * D + (size_t)r * ks; });
            stage<D, VEC>(V, LDH, (__nv_bfloat16 *)NULL, 0, nc, TC_BC, [&](int r) { return v + ((size_t)(off + j0) * KVH + kvh) * D + (size_t)r * ks; });
            __syncthreads();
            if (w0 >= nr || j0 > wlast) continue; /* no query of the warp sees the tile */
            float sc[TC_BC / 8][4], dp[TC_BC / 8][4];
            warp_scores<D>(sc, Q, w0, K, LDH);  /* S = Q K^T */
            warp_scores<D>(dp, dO, w0, V, LDH); /* dP = dO V^T */
            uint32_t dsa[TC_BC / 16][4];
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n++) {
                float ds[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int r = w0 + g + 8 * (e >> 1), c = n * 8 + 2 * t + (e & 1); /* query, key */
                    float p;
                    pair_pds(r < nr && c < nc && j0 + c <= i0 + r, sc[n][e], dp[n][e], lse_s[r],
                             di_s[r], scale, &p, &ds[e]);
                }
                rf__acc_to_a(dsa, n, ds);
            }
            warp_acc<D>(dQ, dsa, Kt, LDT); /* dQ += dS K */
        }
        warp_store<D>(dq + (row0 + (size_t)w0 * H) * D, qs, max(0, min(16, nr - w0)), dQ);
    }
}

/* dst (T, KVH, D) = for each KV head the sum of its group's per-head parts src (T, H, D), in
 * head order (deterministic). */
static __global__ void reduce_heads_kernel(float *dst, const float *src, size_t n, int H, int KVH, int D) {
    int group = H / KVH;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / ((size_t)KVH * D);
        int kvh = (int)(i / D % KVH), d = (int)(i % D);
        const float *p = src + (t * H + (size_t)kvh * group) * D + d;
        float acc = 0.0f;
        for (int j = 0; j < group; j++) acc += p[(size_t)j * D];
        dst[i] = acc;
    }
}

template <int D, bool VEC>
static int launch_backward_mma_v(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                 const float *k, const float *v, const float *lse, const float *di,
                                 const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH) {
    size_t bytes = bwd_smem_bytes(D);
    if (!rf__allow_smem(flash_dkdv_mma_kernel<D, VEC>, bytes) || !rf__allow_smem(flash_dq_mma_kernel<D, VEC>, bytes))
        return 0;
    int gx = rf__flash_backward_gx(T, TB);
    cudaStream_t st = rf__cuda.stream;
    /* grouped heads: per-head parts (zero where no sequence writes), added up below */
    float *part = NULL;
    size_t np = (size_t)T * H * D;
    if (H != KVH && (!RF_CUDA_CHECK(cudaMallocAsync((void **)&part, 2 * sizeof(float) * np, st)) ||
                     !RF_CUDA_CHECK(cudaMemsetAsync(part, 0, 2 * sizeof(float) * np, st))))
        return 0;
    float *pk = part ? part : dk, *pv = part ? part + np : dv;
    flash_dkdv_mma_kernel<D, VEC><<<dim3(gx, n_seq, H), TC_THREADS, bytes, st>>>(
        pk, pv, dout, q, k, v, lse, di, cu_seqlens, H, KVH, part ? H : KVH);
    int ok = RF_CUDA_LAUNCH_CHECK();
    if (ok && part) {
        size_t n = (size_t)T * KVH * D;
        reduce_heads_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, st>>>(dk, pk, n, H, KVH, D);
        reduce_heads_kernel<<<rf__cuda_blocks(n), RF_CUDA_THREADS, 0, st>>>(dv, pv, n, H, KVH, D);
        ok = RF_CUDA_LAUNCH_CHECK();
    }
    if (part) ok = RF_CUDA_CHECK(cudaFreeAsync(part, st)) && ok;
    if (!ok) return 0;
    flash_dq_mma_kernel<D, VEC><<<dim3(gx, n_seq, H), TC_THREADS, bytes, st>>>(
        dq, dout, q, k, v, lse, di, cu_seqlens, H, KVH);
    return RF_CUDA_LAUNCH_CHECK();
}

template <int D>
static int launch_backward_mma(float *dq, float *dk, float *dv, const float *dout, const float *q,
                               const float *k, const float *v, const float *lse, const float *di,
                               const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH) {
    if (vec_ok(q, k, v) && vec_ok(dout, q, q))
        return launch_backward_mma_v<D, true>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH);
    return launch_backward_mma_v<D, false>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH);
}

void rf__cuda_flash_backward_mma(float *dq, float *dk, float *dv, const float *dout,
                                 const float *q, const float *k, const float *v, const float *lse,
                                 const float *di, const int32_t *cu_seqlens, int n_seq, int T,
                                 int H, int KVH, int D) {
    switch (D) { /* a multiple of 16 up to RF_FLASH_MAX_D (rf__cuda_flash_mma_supported) */
#define RF_BWD_D(d) case d: launch_backward_mma<d>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
        RF_BWD_D(16) RF_BWD_D(32) RF_BWD_D(48) RF_BWD_D(64) RF_BWD_D(80) RF_BWD_D(96) RF_BWD_D(112) RF_BWD_D(128)
#undef RF_BWD_D
    default:
        rf__cuda_fail("tensor-core attention backward", "head dim not a multiple of 16 up to 128", __FILE__, __LINE__);
    }
}
