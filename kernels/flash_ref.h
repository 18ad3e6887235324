/* FlashAttention-2's tiling (Dao 2023, "FlashAttention-2: Faster Attention with Better
 * Parallelism and Work Partitioning", Algorithms 1 and 2) written as plain C: the CPU mirror of
 * the CUDA back end's tiled attention kernels (kernels/cuda/cuda_flash.cu), with the same tile
 * sizes, the same order of tiles, the same online-softmax updates and the same split of the
 * backward into a dk/dv pass over key tiles and a dq pass over query tiles (no atomics); its
 * forward tiles hold one head's queries where the CUDA kernel's hold a GQA group's (a row's
 * arithmetic does not depend on its tile's other rows). It
 * exists so that the algorithm itself is tested on every machine (tests/test_flash_ref.c,
 * against kernels/cpu/cpu_attention.c); the CUDA kernels are tested against it and against
 * the reference CUDA kernels on a GPU (tests/test_kernels_cuda.c).
 *
 * Arguments, layouts, causality (bottom-right aligned), GQA mapping and scale are those of
 * rf_kernels.attention_forward / attention_backward (kernels/kernels.h). `bf16` is one of:
 *   RF_FLASH_FP32 (0):     everything fp32;
 *   RF_FLASH_BF16_LOAD (1): q, k, v (and dout in backward) rounded to bf16 as they are loaded
 *                          into a tile, as the FMA kernels do at precision bf16; scores,
 *                          softmax statistics and accumulators fp32;
 *   RF_FLASH_BF16_MMA (2):  as 1, and the probabilities rounded to bf16 before their
 *                          product with V (forward) and p and ds before their products with
 *                          dO, Q and K (backward): the tensor-core kernels (cuda_flash_mma.cu),
 *                          whose products take bf16 operands. The row sums l add the unrounded
 *                          probabilities, as FlashAttention-2 does. */
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

#define RF_FLASH_FP32 0
#define RF_FLASH_BF16_LOAD 1
#define RF_FLASH_BF16_MMA 2

/* A row's keys are taken in chunks of RF_FLASH_CHUNK from its sequence's first key: each
 * chunk's tiles with the online softmax from an empty state, the chunks' states (max, sum,
 * unnormalised output) then merged in order. Fixed, so that a decoding step split over its
 * chunks (one block each on the GPU) adds exactly as training's forward does; in every mode,
 * the tensor-core kernels' too. */
#define RF_FLASH_CHUNK 128

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

/* paged_attention_forward (kernels.h) as the CUDA back end computes it by default: every row,
 * one-query or a prefill chunk's, by the tiled forward above over the sequence's keys read
 * through its block table (so each row gets the bits rf_flash_ref_forward gives it on the same
 * keys laid out contiguously). `bf16` as rf_flash_ref_forward's; D <= RF_FLASH_MAX_D. */
void rf_flash_ref_paged_forward(float *out, const float *q, const float *k_pool,
                                const float *v_pool, const int32_t *q_off,
                                const int32_t *block_table, int max_blocks,
                                const int32_t *k_len, int n_seq, int block_size, int H, int KVH,
                                int D, int bf16);

#ifdef __cplusplus
}
#endif

#endif
