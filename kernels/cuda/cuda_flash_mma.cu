/* The tiled attention forward on tensor cores, at precision bf16: FlashAttention-2's forward
 * (Dao 2023, Algorithm 1) with its two products per key tile, S = Q K^T and O += P V, as
 * bf16 x bf16 -> fp32 warp matrix operations (CUDA's WMMA API, 16 x 16 x 16 tiles, sm_80 and
 * later), for head dims that are multiples of 16 up to RF_FLASH_MAX_D, taken only under
 * RLFLOW_CUDA_ATTENTION=bf16 (rf__cuda_attention_bf16: by default attention is fp32 arithmetic
 * at every precision). cuda_flash.cu's FMA kernels stay the path for other head dims, for fp32,
 * for GPUs before sm_80 and where the tiles do not fit; tests/test_kernels_cuda.c checks this kernel against the
 * CPU mirror kernels/cpu/cpu_flash_ref.c in its RF_FLASH_BF16_MMA mode and against the FMA one.
 *
 * Work split. A block of 4 warps owns a tile of 64 (query, head) rows of one (sequence, KV
 * head), the rows of the group's heads query by query, each warp 16 of them, and visits the key
 * tiles of RF_FLASH_BC = 32 keys in order: the same key tiles, hence the same online-softmax
 * steps per row, as the mirror and the FMA kernel (which also merges chunks of RF_FLASH_CHUNK
 * keys; this one takes every tile in one run). It is also decoding's attention over the paged KV
 * cache under RLFLOW_CUDA_ATTENTION=bf16 (rf__cuda_flash_paged_forward_mma), one block per
 * (row tile, sequence, KV head), never split: a row gets training's bits. Per key tile:
 *  1. the block stages K and V, rounded to bf16, in shared memory (Q was staged once per tile);
 *  2. each warp computes its 16 x 32 scores with WMMA into shared memory (fp32);
 *  3. the warp walks its 16 rows, lane = key: scaled and masked score, the row's new max m'
 *     (warp max), corr = exp(m - m'), p = exp(score - m'), l = l corr + sum p (fp32, unrounded
 *     p), p rounded to bf16 into shared memory, the row of O rescaled by corr;
 *  4. O (16 x D, fp32 in shared memory) += P (16 x 32) V (32 x D) with WMMA.
 * WMMA fragments map elements to lanes in an unspecified way, so the per-row steps run on the
 * shared-memory copies (S, P, O), not on fragments: simpler and layout-proof, at the cost of O
 * passing through shared memory once per key tile (mma.sync with a known fragment layout would
 * keep it in registers: the next step, docs/cuda.md). Every output row is written by one warp:
 * no atomics, deterministic. */
#include <cuda_bf16.h>
#include <math.h>
#include <mma.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/flash_ref.h"

using namespace nvcuda;

#define TC_WARPS 4
#define TC_BR (16 * TC_WARPS) /* query rows per block: 16 per warp */
#define TC_BC RF_FLASH_BC     /* keys per tile: lane = key in the softmax step */
#define TC_THREADS (32 * TC_WARPS)
#define TC_PAD 8 /* elements added to each shared row: keeps WMMA's 32-byte alignment */

static_assert(TC_BC == 32, "the softmax step maps one key tile onto one warp's lanes");

/* Byte offsets of the shared-memory buffers for head dim D (a multiple of 16), each start a
 * multiple of 128 bytes; leading dimensions in elements. */
struct tc_layout {
    size_t q, k, v, s, p, o, bytes;
    int ldh, lds, ldp, ldo; /* Q/K/V (bf16), S (fp32), P (bf16), O (fp32) */
};

static __host__ __device__ inline size_t up128(size_t x) { return (x + 127) & ~(size_t)127; }

static __host__ __device__ inline tc_layout tc_layout_of(int D) {
    tc_layout L;
    L.ldh = D + TC_PAD, L.lds = TC_BC + TC_PAD, L.ldp = TC_BC + TC_PAD, L.ldo = D + TC_PAD;
    L.q = 0;
    L.k = L.q + up128(sizeof(__nv_bfloat16) * TC_BR * L.ldh);
    L.v = L.k + up128(sizeof(__nv_bfloat16) * TC_BC * L.ldh);
    L.s = L.v + up128(sizeof(__nv_bfloat16) * TC_BC * L.ldh);
    L.p = L.s + up128(sizeof(float) * TC_BR * L.lds);
    L.o = L.p + up128(sizeof(__nv_bfloat16) * TC_BR * L.ldp);
    L.bytes = L.o + up128(sizeof(float) * TC_BR * L.ldo);
    return L;
}

/* tile (rows x D, leading dim ld) = rows 0..n-1 of src (row stride `stride`) rounded to bf16,
 * zero past n; every thread of the block takes part. */
static __device__ inline void load_bf16(__nv_bfloat16 *tile, const float *src, size_t stride,
                                        int n, int rows, int D, int ld) {
    for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
        int r = idx / D, d = idx % D;
        tile[r * ld + d] = __float2bfloat16_rn(r < n ? src[(size_t)r * stride + d] : 0.0f);
    }
}

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> frag_bt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> frag_b;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_c;

/* One warp's C (16 x 16 NT, fp32, ld ldc) = A (16 x D) B^T, A and B (16 NT x D) row-major
 * bf16: B^T is B read column-major with the same leading dimension. */
template <int NT>
static __device__ inline void warp_abt(float *C, int ldc, const __nv_bfloat16 *A, int lda,
                                       const __nv_bfloat16 *B, int ldb, int D) {
#if __CUDA_ARCH__ >= 800
    frag_c acc[NT];
#pragma unroll
    for (int n = 0; n < NT; n++) wmma::fill_fragment(acc[n], 0.0f);
    for (int kk = 0; kk < D; kk += 16) {
        frag_a a;
        wmma::load_matrix_sync(a, A + kk, lda);
#pragma unroll
        for (int n = 0; n < NT; n++) {
            frag_bt b;
            wmma::load_matrix_sync(b, B + n * 16 * ldb + kk, ldb);
            wmma::mma_sync(acc[n], a, b, acc[n]);
        }
    }
#pragma unroll
    for (int n = 0; n < NT; n++) wmma::store_matrix_sync(C + n * 16, acc[n], ldc, wmma::mem_row_major);
#else
    __trap(); /* built for an architecture without these tensor-core instructions */
#endif
}

/* Ow (16 x D, fp32, ld ldo) += Pw (16 x TC_BC) V (TC_BC x D). */
static __device__ inline void pv_mma(float *Ow, const __nv_bfloat16 *Pw, const __nv_bfloat16 *V,
                                     int D, const tc_layout &L) {
#if __CUDA_ARCH__ >= 800
    for (int n = 0; n < D; n += 16) {
        frag_c o;
        wmma::load_matrix_sync(o, Ow + n, L.ldo, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < TC_BC; kk += 16) {
            frag_a a;
            frag_b b;
            wmma::load_matrix_sync(a, Pw + kk, L.ldp);
            wmma::load_matrix_sync(b, V + kk * L.ldh + n, L.ldh);
            wmma::mma_sync(o, a, b, o);
        }
        wmma::store_matrix_sync(Ow + n, o, L.ldo, wmma::mem_row_major);
    }
#else
    __trap(); /* built for an architecture without these tensor-core instructions */
#endif
}

/* grid (tiles of TC_BR (query, head) pairs, stride gridDim.x; n_seq; KVH), TC_THREADS threads,
 * L.bytes of dynamic shared memory. A tile holds the rows of every head of a KV head's group
 * (pair p = query p / group, head p % group of the group), so each key tile is loaded once for
 * the group, as in cuda_flash.cu. A row's arithmetic depends on its own q and keys only: the
 * tensor cores' products give output row i from row i of A alone, key tiles past a row's last
 * key add exact zeros (p = 0 and corr = 1), so training's forward (kv_rows) and decoding's over
 * the paged cache (kv_paged) give a row the same bits. */
template <class KV>
static __global__ void __launch_bounds__(TC_THREADS)
flash_forward_mma_kernel(float *out, float *lse, const float *q, const float *k, const float *v,
                         KV kv, const int32_t *q_off, const int32_t *k_len, int H, int KVH,
                         int D) {
    extern __shared__ __align__(128) unsigned char smem[];
    const tc_layout L = tc_layout_of(D);
    int s = blockIdx.y, kvh = blockIdx.z, group = H / KVH;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, wr0 = warp * 16;
    __nv_bfloat16 *Q = (__nv_bfloat16 *)(smem + L.q), *K = (__nv_bfloat16 *)(smem + L.k);
    __nv_bfloat16 *V = (__nv_bfloat16 *)(smem + L.v), *P = (__nv_bfloat16 *)(smem + L.p);
    float *S = (float *)(smem + L.s), *O = (float *)(smem + L.o);
    __nv_bfloat16 *Qw = Q + wr0 * L.ldh, *Pw = P + wr0 * L.ldp;
    float *Sw = S + wr0 * L.lds, *Ow = O + wr0 * L.ldo;
    int qlen = q_off[s + 1] - q_off[s], klen = k_len[s], off = klen - qlen;
    int pairs = qlen * group;
    float scale = 1.0f / sqrtf((float)D);
    for (int p0 = blockIdx.x * TC_BR; p0 < pairs; p0 += gridDim.x * TC_BR) {
        int nr = min(TC_BR, pairs - p0);
        __syncthreads(); /* the previous tile's readers are done */
        rf__load_q_pairs(Q, TC_BR, q, q_off[s], p0, nr, group, kvh, H, D, L.ldh, 1);
        for (int idx = threadIdx.x; idx < TC_BR * D; idx += blockDim.x)
            O[(idx / D) * L.ldo + idx % D] = 0.0f;
        __syncthreads(); /* a warp's rows of O are zeroed by every warp; a tile that sees no key
                            reads them below without another barrier */
        float m[16], l[16];
#pragma unroll
        for (int rr = 0; rr < 16; rr++) m[rr] = -INFINITY, l[rr] = 0.0f;
        int nkeys = min((p0 + nr - 1) / group + 1 + off, klen); /* the tile's last query's */
        /* the warp's rows see keys up to wlim; rows past nr none (warp-uniform) */
        int wlim = wr0 < nr ? (p0 + min(wr0 + 15, nr - 1)) / group + off : -1;
        for (int j0 = 0; j0 < nkeys; j0 += TC_BC) {
            int nc = min(TC_BC, klen - j0);
            __syncthreads();
            rf__load_kv_rows(K, TC_BC, k, kv, s, kvh, j0, nc, D, L.ldh, 1);
            rf__load_kv_rows(V, TC_BC, v, kv, s, kvh, j0, nc, D, L.ldh, 1);
            __syncthreads();
            if (j0 > wlim) continue; /* no row of the warp sees this tile: m, l, O unchanged */
            warp_abt<TC_BC / 16>(Sw, L.lds, Qw, L.ldh, K, L.ldh, D); /* S = Q K^T */
            __syncwarp();
#pragma unroll
            for (int rr = 0; rr < 16; rr++) {
                int r = wr0 + rr, c = lane, lim = (p0 + r) / group + off;
                float sc = r < nr && c < nc && j0 + c <= lim ? scale * Sw[rr * L.lds + c] : -INFINITY;
                float m_new = fmaxf(m[rr], rf__warp_max(sc)), corr = 1.0f, p = 0.0f;
                if (m_new != -INFINITY) { /* warp-uniform */
                    corr = expf(m[rr] - m_new), p = expf(sc - m_new); /* corr = 0 at the first */
                    l[rr] = fmaf(l[rr], corr, rf__warp_sum(p));
                    m[rr] = m_new;
                }
                Pw[rr * L.ldp + c] = __float2bfloat16_rn(p);
                for (int d = lane; d < D; d += 32) Ow[rr * L.ldo + d] *= corr;
            }
            __syncwarp();
            pv_mma(Ow, Pw, V, D, L);
            __syncwarp();
        }
#pragma unroll
        for (int rr = 0; rr < 16; rr++) {
            int r = wr0 + rr, pr = p0 + r;
            if (r >= nr) continue; /* warp-uniform */
            size_t row = (size_t)(q_off[s] + pr / group) * H + kvh * group + pr % group;
            float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
            for (int d = lane; d < D; d += 32) out[row * D + d] = Ow[rr * L.ldo + d] * inv;
            if (lse && lane == 0) lse[row] = l[rr] > 0.0f ? m[rr] + logf(l[rr]) : -INFINITY;
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


template <class KV>
static void launch_forward_mma(float *out, float *lse, const float *q, const float *k,
                               const float *v, KV kv, const int32_t *q_off, const int32_t *k_len,
                               int n_seq, int H, int KVH, int D) {
    tc_layout L = tc_layout_of(D);
    if (!rf__allow_smem(flash_forward_mma_kernel<KV>, L.bytes)) return;
    dim3 grid((unsigned)rf__flash_forward_gx(n_seq, KVH), (unsigned)n_seq, (unsigned)KVH);
    flash_forward_mma_kernel<KV><<<grid, TC_THREADS, L.bytes, rf__cuda.stream>>>(
        out, lse, q, k, v, kv, q_off, k_len, H, KVH, D);
    RF_CUDA_LAUNCH_CHECK();
}

void rf__cuda_flash_forward_mma(float *out, float *lse, const float *q, const float *k,
                                const float *v, const int32_t *q_off, const int32_t *k_start,
                                const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    kv_rows kv = {k_start, KVH, D};
    launch_forward_mma(out, lse, q, k, v, kv, q_off, k_len, n_seq, H, KVH, D);
}

void rf__cuda_flash_paged_forward_mma(float *out, const float *q, const float *k_pool,
                                      const float *v_pool, const int32_t *q_off,
                                      const int32_t *block_table, int max_blocks,
                                      const int32_t *k_len, int n_seq, int block_size, int H,
                                      int KVH, int D) {
    kv_paged kv = {block_table, max_blocks, block_size, KVH, D};
    launch_forward_mma(out, (float *)NULL, q, k_pool, v_pool, kv, q_off, k_len, n_seq, H, KVH, D);
}

/* ---- backward (training layout), at bf16 on tensor cores ----
 *
 * FlashAttention-2's backward (Algorithm 2) in the deterministic two-pass form of the FMA
 * kernels: a dk/dv pass where a block owns TB = 64 keys of one (sequence, KV head), 16 per warp,
 * and visits the group's heads and the query tiles of TB that see them; then a dq pass where a
 * block owns TB queries of one (sequence, head) and visits the key tiles they see. Per visited
 * tile each warp computes with WMMA its 16 x 64 scores and dP (dP = dO V^T), then per element
 * p = exp(scale s - lse), ds = p (dp - Di) scale in fp32 (the mirror's pair_grads), rounds p
 * and ds to bf16 into shared memory, and accumulates dV += P^T dO, dK += dS^T Q (dk/dv pass) or
 * dQ += dS K (dq pass) with WMMA into fragments it keeps in registers across the whole visit:
 * no rescaling happens in the backward, so the fragments' unspecified layout does not matter.
 * Each output row is written by one warp: no atomics, deterministic. The CPU mirror's
 * RF_FLASH_BF16_MMA mode rounds p and ds the same way. */

#define TB 64                /* keys (dk/dv pass) or queries (dq pass) per block, 16 per warp */
#define TB_LD (TB + TC_PAD)  /* leading dimension of the 16 x TB tiles of scores, dP, P, dS */

static_assert(TB == 16 * TC_WARPS, "a warp owns 16 rows of the block's tile");

/* Byte offsets of the backward's shared buffers for head dim D: the block's own tile pair
 * (own0, own1: K, V or Q, dO) and the visited pair (vis0, vis1: Q, dO or K, V), TB x (D + 8)
 * bf16 each; S and dP (TB x TB_LD fp32, contiguous: the results pass through them at the end,
 * TB x (D + 8) fp32); P and dS (TB x TB_LD bf16); lse and Di of the query tile (2 x TB). */
struct tb_layout {
    size_t own0, own1, vis0, vis1, s, dp, p, ds, stat, bytes;
    int ldh, ldo;
};

static __host__ __device__ inline tb_layout tb_layout_of(int D) {
    tb_layout L;
    L.ldh = D + TC_PAD, L.ldo = D + TC_PAD;
    size_t tile = up128(sizeof(__nv_bfloat16) * TB * L.ldh), sc = up128(sizeof(float) * TB * TB_LD);
    L.own0 = 0, L.own1 = tile, L.vis0 = 2 * tile, L.vis1 = 3 * tile;
    L.s = 4 * tile, L.dp = L.s + sc;
    size_t out = up128(sizeof(float) * TB * L.ldo); /* the results, over S and dP */
    L.p = L.s + (2 * sc > out ? 2 * sc : out);
    L.ds = L.p + up128(sizeof(__nv_bfloat16) * TB * TB_LD);
    L.stat = L.ds + up128(sizeof(__nv_bfloat16) * TB * TB_LD);
    L.bytes = L.stat + up128(sizeof(float) * 2 * TB);
    return L;
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
    /* where the tiles do not fit (the backward at D >= 96 on a 99 KB device), the FMA kernels */
    return (backward ? tb_layout_of(D).bytes : tc_layout_of(D).bytes) <= smem_optin();
}

/* One warp's acc (16 x 16 ND) += A (16 x TB, bf16, ld lda) B (TB x 16 ND, bf16 row-major). */
template <int ND>
static __device__ inline void warp_acc_ab(frag_c *acc, const __nv_bfloat16 *A, int lda,
                                          const __nv_bfloat16 *B, int ldb) {
#if __CUDA_ARCH__ >= 800
#pragma unroll
    for (int kk = 0; kk < TB; kk += 16) {
        frag_a a;
        wmma::load_matrix_sync(a, A + kk, lda);
#pragma unroll
        for (int n = 0; n < ND; n++) {
            frag_b b;
            wmma::load_matrix_sync(b, B + kk * ldb + n * 16, ldb);
            wmma::mma_sync(acc[n], a, b, acc[n]);
        }
    }
#else
    __trap(); /* built for an architecture without these tensor-core instructions */
#endif
}

/* Rows 0..n-1 of the warp's 16 x D result acc to dst rows (row stride `stride`), through the
 * warp's part of the shared result area `tmp` (16 x ld fp32). */
template <int ND>
static __device__ inline void warp_store_rows(float *dst, size_t stride, int n, frag_c *acc,
                                              float *tmp, int ld) {
#if __CUDA_ARCH__ >= 800
    const int D = 16 * ND;
#pragma unroll
    for (int j = 0; j < ND; j++) wmma::store_matrix_sync(tmp + j * 16, acc[j], ld, wmma::mem_row_major);
    __syncwarp();
    for (int e = threadIdx.x % 32; e < n * D; e += 32)
        dst[(size_t)(e / D) * stride + e % D] = tmp[(e / D) * ld + e % D];
    __syncwarp();
#else
    __trap(); /* built for an architecture without these tensor-core instructions */
#endif
}

/* A query tile of the backward into shared memory: rows row0, row0 + H, ... (nr of them, TB
 * staged, zero past nr) of q and dout in bf16, and their lse and Di. Every thread takes part. */
static __device__ inline void stage_queries(__nv_bfloat16 *Q, __nv_bfloat16 *dO, float *lse_s,
                                            float *di_s, const float *q, const float *dout,
                                            const float *lse, const float *di, size_t row0, int nr,
                                            int H, int D, int ldh) {
    size_t qs = (size_t)H * D;
    load_bf16(Q, q + row0 * D, qs, nr, TB, D, ldh);
    load_bf16(dO, dout + row0 * D, qs, nr, TB, D, ldh);
    if (threadIdx.x < TB) {
        int r = threadIdx.x;
        lse_s[r] = r < nr ? lse[row0 + (size_t)r * H] : 0.0f;
        di_s[r] = r < nr ? di[row0 + (size_t)r * H] : 0.0f;
    }
}

/* p and ds of one element (fp32, the mirror's pair_grads), zero where the pair is not seen. */
static __device__ inline void pair_pds(int seen, float s, float dp, float lse, float di,
                                       float scale, float *p, float *ds) {
    *p = seen ? expf(scale * s - lse) : 0.0f;
    *ds = seen ? *p * (dp - di) * scale : 0.0f;
}

/* grid (key tiles of TB, stride gridDim.x; n_seq; KVH). */
template <int ND>
static __global__ void __launch_bounds__(TC_THREADS)
flash_dkdv_mma_kernel(float *dk, float *dv, const float *dout, const float *q, const float *k,
                      const float *v, const float *lse, const float *di,
                      const int32_t *cu_seqlens, int H, int KVH) {
#if __CUDA_ARCH__ >= 800
    const int D = 16 * ND;
    extern __shared__ __align__(128) unsigned char smem[];
    const tb_layout L = tb_layout_of(D);
    __nv_bfloat16 *K = (__nv_bfloat16 *)(smem + L.own0), *V = (__nv_bfloat16 *)(smem + L.own1);
    __nv_bfloat16 *Q = (__nv_bfloat16 *)(smem + L.vis0), *dO = (__nv_bfloat16 *)(smem + L.vis1);
    float *lse_s = (float *)(smem + L.stat), *di_s = lse_s + TB;
    int s = blockIdx.y, kvh = blockIdx.z, group = H / KVH;
    int lane = threadIdx.x % 32, w0 = threadIdx.x / 32 * 16;
    float *Sw = (float *)(smem + L.s) + w0 * TB_LD, *dPw = (float *)(smem + L.dp) + w0 * TB_LD;
    __nv_bfloat16 *Pw = (__nv_bfloat16 *)(smem + L.p) + w0 * TB_LD;
    __nv_bfloat16 *dSw = (__nv_bfloat16 *)(smem + L.ds) + w0 * TB_LD;
    int off = cu_seqlens[s], len = cu_seqlens[s + 1] - off;
    float scale = 1.0f / sqrtf((float)D);
    size_t ks = (size_t)KVH * D;
    for (int j0 = blockIdx.x * TB; j0 < len; j0 += gridDim.x * TB) {
        int nc = min(TB, len - j0);
        __syncthreads(); /* the previous tile's results are written */
        load_bf16(K, k + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, TB, D, L.ldh);
        load_bf16(V, v + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, TB, D, L.ldh);
        frag_c dK[ND], dV[ND];
#pragma unroll
        for (int j = 0; j < ND; j++) wmma::fill_fragment(dK[j], 0.0f), wmma::fill_fragment(dV[j], 0.0f);
        for (int h = kvh * group; h < (kvh + 1) * group; h++) {
            for (int i0 = j0; i0 < len; i0 += TB) { /* the query tiles that see a key of the tile */
                int nr = min(TB, len - i0);
                size_t row0 = (size_t)(off + i0) * H + h;
                __syncthreads();
                stage_queries(Q, dO, lse_s, di_s, q, dout, lse, di, row0, nr, H, D, L.ldh);
                __syncthreads();
                if (w0 >= nc || j0 + w0 > i0 + nr - 1) continue; /* no key of the warp seen */
                warp_abt<TB / 16>(Sw, TB_LD, K + w0 * L.ldh, L.ldh, Q, L.ldh, D);   /* S^T = K Q^T */
                warp_abt<TB / 16>(dPw, TB_LD, V + w0 * L.ldh, L.ldh, dO, L.ldh, D); /* dP^T = V dO^T */
                __syncwarp();
                for (int e = lane; e < 16 * TB; e += 32) {
                    int cc = e / TB, r = e % TB, c = w0 + cc;
                    float p, ds;
                    pair_pds(c < nc && r < nr && j0 + c <= i0 + r, Sw[cc * TB_LD + r],
                             dPw[cc * TB_LD + r], lse_s[r], di_s[r], scale, &p, &ds);
                    Pw[cc * TB_LD + r] = __float2bfloat16_rn(p);
                    dSw[cc * TB_LD + r] = __float2bfloat16_rn(ds);
                }
                __syncwarp();
                warp_acc_ab<ND>(dV, Pw, TB_LD, dO, L.ldh); /* dV += P^T dO */
                warp_acc_ab<ND>(dK, dSw, TB_LD, Q, L.ldh); /* dK += dS^T Q */
            }
        }
        __syncthreads(); /* every warp is done with S and dP: the results pass through them */
        float *tmp = (float *)(smem + L.s) + w0 * L.ldo;
        int n = max(0, min(16, nc - w0));
        size_t row = ((size_t)(off + j0 + w0) * KVH + kvh) * D;
        warp_store_rows<ND>(dv + row, ks, n, dV, tmp, L.ldo);
        warp_store_rows<ND>(dk + row, ks, n, dK, tmp, L.ldo);
    }
#else
    __trap(); /* built for an architecture without these tensor-core instructions */
#endif
}

/* grid (query tiles of TB, stride gridDim.x; n_seq; H). */
template <int ND>
static __global__ void __launch_bounds__(TC_THREADS)
flash_dq_mma_kernel(float *dq, const float *dout, const float *q, const float *k, const float *v,
                    const float *lse, const float *di, const int32_t *cu_seqlens, int H,
                    int KVH) {
#if __CUDA_ARCH__ >= 800
    const int D = 16 * ND;
    extern __shared__ __align__(128) unsigned char smem[];
    const tb_layout L = tb_layout_of(D);
    __nv_bfloat16 *Q = (__nv_bfloat16 *)(smem + L.own0), *dO = (__nv_bfloat16 *)(smem + L.own1);
    __nv_bfloat16 *K = (__nv_bfloat16 *)(smem + L.vis0), *V = (__nv_bfloat16 *)(smem + L.vis1);
    float *lse_s = (float *)(smem + L.stat), *di_s = lse_s + TB;
    int s = blockIdx.y, h = blockIdx.z, kvh = h / (H / KVH);
    int lane = threadIdx.x % 32, w0 = threadIdx.x / 32 * 16;
    float *Sw = (float *)(smem + L.s) + w0 * TB_LD, *dPw = (float *)(smem + L.dp) + w0 * TB_LD;
    __nv_bfloat16 *dSw = (__nv_bfloat16 *)(smem + L.ds) + w0 * TB_LD;
    int off = cu_seqlens[s], len = cu_seqlens[s + 1] - off;
    float scale = 1.0f / sqrtf((float)D);
    size_t qs = (size_t)H * D, ks = (size_t)KVH * D;
    for (int i0 = blockIdx.x * TB; i0 < len; i0 += gridDim.x * TB) {
        int nr = min(TB, len - i0);
        size_t row0 = (size_t)(off + i0) * H + h;
        __syncthreads(); /* the previous tile's results are written */
        stage_queries(Q, dO, lse_s, di_s, q, dout, lse, di, row0, nr, H, D, L.ldh);
        frag_c dQ[ND];
#pragma unroll
        for (int j = 0; j < ND; j++) wmma::fill_fragment(dQ[j], 0.0f);
        int wlast = i0 + min(w0 + 15, nr - 1); /* the warp's last query */
        for (int j0 = 0; j0 < i0 + nr; j0 += TB) { /* the key tiles the query tile sees */
            int nc = min(TB, i0 + nr - j0);
            __syncthreads();
            load_bf16(K, k + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, TB, D, L.ldh);
            load_bf16(V, v + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, TB, D, L.ldh);
            __syncthreads();
            if (w0 >= nr || j0 > wlast) continue; /* no query of the warp sees the tile */
            warp_abt<TB / 16>(Sw, TB_LD, Q + w0 * L.ldh, L.ldh, K, L.ldh, D);   /* S = Q K^T */
            warp_abt<TB / 16>(dPw, TB_LD, dO + w0 * L.ldh, L.ldh, V, L.ldh, D); /* dP = dO V^T */
            __syncwarp();
            for (int e = lane; e < 16 * TB; e += 32) {
                int rr = e / TB, c = e % TB, r = w0 + rr;
                float p, ds;
                pair_pds(r < nr && c < nc && j0 + c <= i0 + r, Sw[rr * TB_LD + c],
                         dPw[rr * TB_LD + c], lse_s[r], di_s[r], scale, &p, &ds);
                dSw[rr * TB_LD + c] = __float2bfloat16_rn(ds);
            }
            __syncwarp();
            warp_acc_ab<ND>(dQ, dSw, TB_LD, K, L.ldh); /* dQ += dS K */
        }
        __syncthreads(); /* every warp is done with S and dP: the results pass through them */
        float *tmp = (float *)(smem + L.s) + w0 * L.ldo;
        int n = max(0, min(16, nr - w0));
        warp_store_rows<ND>(dq + (row0 + (size_t)w0 * H) * D, qs, n, dQ, tmp, L.ldo);
    }
#else
    __trap(); /* built for an architecture without these tensor-core instructions */
#endif
}

template <int ND>
static int launch_backward_mma(float *dq, float *dk, float *dv, const float *dout, const float *q,
                               const float *k, const float *v, const float *lse, const float *di,
                               const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH) {
    size_t bytes = tb_layout_of(16 * ND).bytes;
    if (!rf__allow_smem(flash_dkdv_mma_kernel<ND>, bytes) || !rf__allow_smem(flash_dq_mma_kernel<ND>, bytes))
        return 0;
    int gx = rf__flash_backward_gx(T, TB);
    flash_dkdv_mma_kernel<ND><<<dim3(gx, n_seq, KVH), TC_THREADS, bytes, rf__cuda.stream>>>(
        dk, dv, dout, q, k, v, lse, di, cu_seqlens, H, KVH);
    if (!RF_CUDA_LAUNCH_CHECK()) return 0;
    flash_dq_mma_kernel<ND><<<dim3(gx, n_seq, H), TC_THREADS, bytes, rf__cuda.stream>>>(
        dq, dout, q, k, v, lse, di, cu_seqlens, H, KVH);
    return RF_CUDA_LAUNCH_CHECK();
}

void rf__cuda_flash_backward_mma(float *dq, float *dk, float *dv, const float *dout,
                                 const float *q, const float *k, const float *v, const float *lse,
                                 const float *di, const int32_t *cu_seqlens, int n_seq, int T,
                                 int H, int KVH, int D) {
    switch (D / 16) { /* D is a multiple of 16 up to RF_FLASH_MAX_D (rf__cuda_flash_mma_supported) */
    case 1: launch_backward_mma<1>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    case 2: launch_backward_mma<2>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    case 3: launch_backward_mma<3>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    case 4: launch_backward_mma<4>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    case 5: launch_backward_mma<5>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    case 6: launch_backward_mma<6>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    case 7: launch_backward_mma<7>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    default: launch_backward_mma<8>(dq, dk, dv, dout, q, k, v, lse, di, cu_seqlens, n_seq, T, H, KVH); break;
    }
}
