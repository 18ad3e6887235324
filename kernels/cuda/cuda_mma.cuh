/* The tensor cores' warp-level product with a known register layout: PTX
 * mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (sm_80 and later), which the tiled
 * attention's tensor-core kernels (cuda_flash_mma.cu) use so that scores, probabilities and the
 * output stay in registers (WMMA's fragment layout is unspecified: its kernels had to pass them
 * through shared memory).
 *
 * d (16 x 8, fp32) += a (16 x 16, bf16, row-major) b (16 x 8, bf16, column-major). Lane l of the
 * warp, g = l / 4, t = l % 4, holds (each 32-bit register two bf16, the lower index in the low
 * half):
 *   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
 *   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
 *   d[0], d[1] = D[g][2t, 2t+1]   d[2], d[3] = D[g+8][2t, 2t+1]
 * (the PTX ISA's "Matrix Fragments for mma.m16n8k16"). Output row i depends on row i of A only.
 * Every lane of the warp must call it (warp-uniform control flow). On the CPU emulation
 * (tests/cuda_emu, RF_CUDA_EMU) the same layout is computed by rf_emu_mma_m16n8k16. */
#ifndef RF_CUDA_MMA_CUH
#define RF_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

static __device__ inline void rf__mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(RF_CUDA_EMU)
    rf_emu_mma_m16n8k16(d, a, b);
#elif __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    (void)d, (void)a, (void)b;
    __trap(); /* built for an architecture without these tensor-core instructions */
#endif
}

/* Two floats rounded to bf16 (round to nearest even) in one register, lo in the low half. */
static __device__ inline uint32_t rf__pack_bf16(float lo, float hi) {
    __nv_bfloat16 a = __float2bfloat16_rn(lo), b = __float2bfloat16_rn(hi);
    uint16_t ua, ub;
    memcpy(&ua, &a, 2), memcpy(&ub, &b, 2);
    return (uint32_t)ua | (uint32_t)ub << 16;
}

/* A product's result as the next product's A operand, in registers: the 4 values x of n-tile n
 * of a 16 x 8N accumulator (x[0..1] row g, x[2..3] row g + 8; columns 2t, 2t + 1 of the tile)
 * are, rounded to bf16, k-step n / 2's registers 0 and 1 (even n) or 2 and 3 (odd n) of the
 * 16 x 16-per-k-step A fragments a. */
static __device__ inline void rf__acc_to_a(uint32_t a[][4], int n, const float x[4]) {
    a[n / 2][(n % 2) * 2] = rf__pack_bf16(x[0], x[1]);
    a[n / 2][(n % 2) * 2 + 1] = rf__pack_bf16(x[2], x[3]);
}

/* Two adjacent bf16 of shared memory (p 4-byte aligned) as one register. */
static __device__ inline uint32_t rf__ld_bf16x2(const __nv_bfloat16 *p) {
#if defined(RF_CUDA_EMU)
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
#else
    return *(const uint32_t *)p;
#endif
}

/* The warp's A fragment (16 x 16) of rows r0 .. r0 + 15, columns k0 .. k0 + 15 of a bf16 tile
 * (leading dim ld, 4-byte aligned rows). */
static __device__ inline void rf__ld_a(uint32_t a[4], const __nv_bfloat16 *tile, int ld, int r0, int k0) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const __nv_bfloat16 *p = tile + (r0 + g) * ld + k0 + 2 * t;
    a[0] = rf__ld_bf16x2(p), a[1] = rf__ld_bf16x2(p + 8 * ld);
    a[2] = rf__ld_bf16x2(p + 8), a[3] = rf__ld_bf16x2(p + 8 * ld + 8);
}

/* The warp's B fragment (16 x 8: k0 .. k0 + 15 by n0 .. n0 + 7) of a bf16 tile holding B^T by
 * rows (row n, column k; ld). */
static __device__ inline void rf__ld_b(uint32_t b[2], const __nv_bfloat16 *tile, int ld, int n0, int k0) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const __nv_bfloat16 *p = tile + (n0 + g) * ld + k0 + 2 * t;
    b[0] = rf__ld_bf16x2(p), b[1] = rf__ld_bf16x2(p + 8);
}

#endif
