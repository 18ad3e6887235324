/* The tiled attention forward on tensor cores, at precision bf16: FlashAttention-2's forward
 * (Dao 2023, Algorithm 1) with its two products per key tile, S = Q K^T and O += P V, as
 * bf16 x bf16 -> fp32 warp matrix operations (CUDA's WMMA API, 16 x 16 x 16 tiles, sm_80 and
 * later), for head dims that are multiples of 16 up to RF_FLASH_MAX_D. cuda_flash.cu's FMA
 * kernels stay the path for other head dims, for fp32, for the backward, for GPUs before sm_80,
 * and under RLFLOW_CUDA_ATTENTION=fma; tests/test_kernels_cuda.c checks this kernel against the
 * CPU mirror kernels/cpu/cpu_flash_ref.c in its RF_FLASH_BF16_MMA mode and against the FMA one.
 *
 * Work split. A block of 4 warps owns a tile of 64 query rows of one (sequence, head), each warp
 * 16 of them, and visits the key tiles of RF_FLASH_BC = 32 keys in order: the same key tiles,
 * hence the same online-softmax steps per row, as the mirror and the FMA kernel. Per key tile:
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

/* S (16 x TC_BC, fp32, ld lds) = Qw (16 x D) K^T: K is (TC_BC x D) row-major, i.e. K^T
 * column-major with the same leading dimension. */
static __device__ inline void scores_mma(float *S, const __nv_bfloat16 *Qw,
                                         const __nv_bfloat16 *K, int D, const tc_layout &L) {
#if __CUDA_ARCH__ >= 800
    frag_c acc[TC_BC / 16];
#pragma unroll
    for (int n = 0; n < TC_BC / 16; n++) wmma::fill_fragment(acc[n], 0.0f);
    for (int kk = 0; kk < D; kk += 16) {
        frag_a a;
        wmma::load_matrix_sync(a, Qw + kk, L.ldh);
#pragma unroll
        for (int n = 0; n < TC_BC / 16; n++) {
            frag_bt b;
            wmma::load_matrix_sync(b, K + n * 16 * L.ldh + kk, L.ldh);
            wmma::mma_sync(acc[n], a, b, acc[n]);
        }
    }
#pragma unroll
    for (int n = 0; n < TC_BC / 16; n++)
        wmma::store_matrix_sync(S + n * 16, acc[n], L.lds, wmma::mem_row_major);
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
#endif
}

/* grid (query tiles of TC_BR, stride gridDim.x; n_seq; H), TC_THREADS threads, L.bytes of
 * dynamic shared memory. */
static __global__ void __launch_bounds__(TC_THREADS)
flash_forward_mma_kernel(float *out, float *lse, const float *q, const float *k, const float *v,
                         const int32_t *q_off, const int32_t *k_start, const int32_t *k_len,
                         int H, int KVH, int D) {
    extern __shared__ __align__(128) unsigned char smem[];
    const tc_layout L = tc_layout_of(D);
    int s = blockIdx.y, h = blockIdx.z, kvh = h / (H / KVH);
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, wr0 = warp * 16;
    __nv_bfloat16 *Q = (__nv_bfloat16 *)(smem + L.q), *K = (__nv_bfloat16 *)(smem + L.k);
    __nv_bfloat16 *V = (__nv_bfloat16 *)(smem + L.v), *P = (__nv_bfloat16 *)(smem + L.p);
    float *S = (float *)(smem + L.s), *O = (float *)(smem + L.o);
    __nv_bfloat16 *Qw = Q + wr0 * L.ldh, *Pw = P + wr0 * L.ldp;
    float *Sw = S + wr0 * L.lds, *Ow = O + wr0 * L.ldo;
    int qlen = q_off[s + 1] - q_off[s], klen = k_len[s], off = klen - qlen;
    float scale = 1.0f / sqrtf((float)D);
    size_t qs = (size_t)H * D, ks = (size_t)KVH * D;
    const float *kb = k + ((size_t)k_start[s] * KVH + kvh) * D;
    const float *vb = v + ((size_t)k_start[s] * KVH + kvh) * D;
    for (int i0 = blockIdx.x * TC_BR; i0 < qlen; i0 += gridDim.x * TC_BR) {
        int nr = min(TC_BR, qlen - i0);
        size_t row0 = (size_t)(q_off[s] + i0) * H + h;
        __syncthreads(); /* the previous tile's readers are done */
        load_bf16(Q, q + row0 * D, qs, nr, TC_BR, D, L.ldh);
        for (int idx = threadIdx.x; idx < TC_BR * D; idx += blockDim.x)
            O[(idx / D) * L.ldo + idx % D] = 0.0f;
        float m[16], l[16];
#pragma unroll
        for (int rr = 0; rr < 16; rr++) m[rr] = -INFINITY, l[rr] = 0.0f;
        int nkeys = min(i0 + nr + off, klen);
        /* the warp's rows see keys up to wlim; rows past nr none (warp-uniform) */
        int wlim = wr0 < nr ? i0 + min(wr0 + 15, nr - 1) + off : -1;
        for (int j0 = 0; j0 < nkeys; j0 += TC_BC) {
            int nc = min(TC_BC, klen - j0);
            __syncthreads();
            load_bf16(K, kb + (size_t)j0 * ks, ks, nc, TC_BC, D, L.ldh);
            load_bf16(V, vb + (size_t)j0 * ks, ks, nc, TC_BC, D, L.ldh);
            __syncthreads();
            if (j0 > wlim) continue; /* no row of the warp sees this tile: m, l, O unchanged */
            scores_mma(Sw, Qw, K, D, L);
            __syncwarp();
#pragma unroll
            for (int rr = 0; rr < 16; rr++) {
                int r = wr0 + rr, c = lane, lim = i0 + r + off;
                float sc = r < nr && c < nc && j0 + c <= lim ? scale * Sw[rr * L.lds + c] : -INFINITY;
                float m_new = fmaxf(m[rr], rf__warp_max(sc)), corr = 1.0f, p = 0.0f;
                if (m_new != -INFINITY) { /* warp-uniform */
                    corr = expf(m[rr] - m_new), p = expf(sc - m_new); /* corr = 0 at the first */
                    l[rr] = l[rr] * corr + rf__warp_sum(p);
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
            int r = wr0 + rr;
            if (r >= nr) continue; /* warp-uniform */
            size_t row = row0 + (size_t)r * H;
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

int rf__cuda_flash_mma_supported(int D) {
    const char *e = getenv("RLFLOW_CUDA_ATTENTION");
    if (e && strcmp(e, "fma") == 0) return 0;
    return D % 16 == 0 && D <= RF_FLASH_MAX_D && device_major() >= 8;
}

void rf__cuda_flash_forward_mma(float *out, float *lse, const float *q, const float *k,
                                const float *v, const int32_t *q_off, const int32_t *k_start,
                                const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    tc_layout L = tc_layout_of(D);
    static size_t allowed = 0; /* above 48 KiB needs the opt-in, once per size */
    if (L.bytes > 48 * 1024 && L.bytes > allowed) {
        if (!RF_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_mma_kernel,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)L.bytes)))
            return;
        allowed = L.bytes;
    }
    int pairs = n_seq * H, gx = 2048 / (pairs > 0 ? pairs : 1);
    gx = gx < 1 ? 1 : gx > 64 ? 64 : gx;
    dim3 grid((unsigned)gx, (unsigned)n_seq, (unsigned)H);
    flash_forward_mma_kernel<<<grid, TC_THREADS, L.bytes, rf__cuda.stream>>>(
        out, lse, q, k, v, q_off, k_start, k_len, H, KVH, D);
    RF_CUDA_LAUNCH_CHECK();
}
