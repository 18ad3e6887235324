/* Element types of stored tensors (checkpoints) and conversions between them and f32.
 *
 * Compute is always f32; bf16 and f16 exist only on disk (and later in device buffers).
 * The scalar conversions are `static inline` and RF_HD so host and CUDA code share one
 * definition. Bit layouts: IEEE 754-2008 binary32 / binary16; bfloat16 is the top 16 bits of
 * a binary32. f32 -> bf16/f16 rounds to nearest, ties to even (what PyTorch's .to() does);
 * NaN stays NaN (quiet), infinities stay infinite, f16 subnormals are exact both ways. */
#ifndef RF_DTYPE_H
#define RF_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kernel_math.h" /* RF_HD */

typedef enum rf_dtype { RF_DTYPE_F32, RF_DTYPE_BF16, RF_DTYPE_F16 } rf_dtype;

/* Safetensors spelling: "F32", "BF16", "F16" ("?" for an invalid value). */
const char *rf_dtype_name(rf_dtype d);

/* Bytes per element (0 for an invalid value). */
size_t rf_dtype_size(rf_dtype d);

RF_HD static inline uint32_t rf__f32_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

RF_HD static inline float rf__bits_f32(uint32_t x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

RF_HD static inline float rf_bf16_to_f32(uint16_t h) { return rf__bits_f32((uint32_t)h << 16); }

/* Round to nearest even on the 16 dropped bits. A NaN whose payload lives only in the low
 * bits would truncate to infinity, so NaN sets the quiet bit instead of rounding. */
RF_HD static inline uint16_t rf_f32_to_bf16(float f) {
    uint32_t x = rf__f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

RF_HD static inline float rf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return rf__bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp != 0) return rf__bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
    if (man == 0) return rf__bits_f32(sign); /* signed zero */
    /* Subnormal man * 2^-24: shift the leading 1 up to the implicit-bit position. */
    int e = 113; /* exponent of 2^-14 in binary32 bias, before normalising */
    while (!(man & 0x400u)) {
        man <<= 1;
        e--;
    }
    return rf__bits_f32(sign | ((uint32_t)e << 23) | ((man & 0x3ffu) << 13));
}

RF_HD static inline uint16_t rf_f32_to_f16(float f) {
    uint32_t x = rf__f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) { /* normal f16: rebias exponent 127 -> 15, round 13 bits */
        uint32_t r = ax - 0x38000000u;
        return (uint16_t)(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
    }
    if (ax < 0x33000000u) return sign; /* below 2^-25: rounds to zero */
    /* Subnormal f16: value / 2^-24 = M >> (126 - e), with M the 24-bit significand. */
    uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t s = 126u - e; /* 14..24 */
    uint32_t q = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

/* Bulk conversions between f32 and `d`. `src`/`dst` on the dtype side may be unaligned
 * (tensors inside a mapped file); n elements. */
void rf_dtype_to_f32(float *dst, const void *src, rf_dtype d, size_t n);
void rf_dtype_from_f32(void *dst, const float *src, rf_dtype d, size_t n);

#endif
