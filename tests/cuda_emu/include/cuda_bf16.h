/* bfloat16 as the CUDA back end's sources use it, on the CPU (cuda_runtime.h says why). Round to
 * nearest even, NaN kept a quiet NaN: cuda_bf16.h's __float2bfloat16_rn. */
#ifndef RF_CUDA_EMU_BF16_H
#define RF_CUDA_EMU_BF16_H

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    uint16_t x;
};

static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.x = (uint16_t)((u >> 16) | 0x40); /* NaN: quiet, sign kept */
        return b;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    b.x = (uint16_t)(u >> 16);
    return b;
}
static inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t u = (uint32_t)b.x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
