/* FlashAttention-2's tiling (Dao 2023, "FlashAttention-2: Faster Attention with Better
 * Parallelism and Work Partitioning", Algorithms 1 and 2) written as plain C: the CPU mirror of
 * the CUDA back end's tiled attention kernels (kernels/cuda/cuda_flash.cu), with the same tile
 * sizes, the same order of tiles, the same online-softmax updates and the same split of the
 * backward into a dk/dv pass over key tiles and a dq pass over query tiles (no atomics). It
 * exists so that the algorithm itself is tested on every machine (tests/test_flash_ref.c,
 * against kernels/cpu/cpu_attention.c); the CUDA kernels are tested against it and against
 * the reference CUDA kernels on a GPU (tests/test_kernels_cuda.c).
 *
 * Arguments, layouts, causality (bottom-right aligned), GQA mapping and scale are those of
 * rf_kernels.attention_forward / attention_backward (kernels/kernels.h). `bf16` = 1 rounds q,
 * k, v (and dout in backward) to bf16 as they are loaded into a tile, as the CUDA kernels do
 * at precision bf16; scores, softmax statistics and accumulators stay fp32. */
#ifndef RF_FLASH_REF_H
#define RF_FLASH_REF_H

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RF_FLASH_BR 32     /* query rows per tile */
#define RF_FLASH_BC 32     /* key rows per tile */
#define RF_FLASH_MAX_D 128 /* largest head dimension of the tiled kernels */

/* x rounded to the nearest bf16 (ties to even), returned as a float; NaN stays NaN. The same
 * rounding as CUDA's __float2bfloat16_rn. */
static inline float rf_round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return x;
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* The forward pass, tile by tile (D <= RF_FLASH_MAX_D). */
void rf_flash_ref_forward(float *out, float *lse, const float *q, const float *k,
                          const float *v, const int32_t *q_off, const int32_t *k_start,
                          const int32_t *k_len, int n_seq, int H, int KVH, int D, int bf16);

/* The backward pass (training layout), tile by tile; dq, dk, dv overwritten (rows past
 * cu_seqlens[n_seq]: dq untouched, dk/dv zero, as in the CPU back end). */
void rf_flash_ref_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                           const float *k, const float *v, const float *out, const float *lse,
                           const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH, int D,
                           int bf16);

#ifdef __cplusplus
}
#endif

#endif
