/* Names, sizes and bulk conversions of stored element types (see dtype.h). */
#include "model/dtype.h"

const char *rf_dtype_name(rf_dtype d) {
    switch (d) {
    case RF_DTYPE_F32: return "F32";
    case RF_DTYPE_BF16: return "BF16";
    case RF_DTYPE_F16: return "F16";
    }
    return "?";
}

size_t rf_dtype_size(rf_dtype d) {
    switch (d) {
    case RF_DTYPE_F32: return 4;
    case RF_DTYPE_BF16:
    case RF_DTYPE_F16: return 2;
    }
    return 0;
}

/* Stored tensors are little-endian; so is every host we build for. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "rlflow reads and writes little-endian tensors and assumes a little-endian host"
#endif

void rf_dtype_to_f32(float *dst, const void *src, rf_dtype d, size_t n) {
    const unsigned char *p = src;
    uint16_t h;
    if (n == 0) return; /* memcpy with NULL is undefined even for 0 bytes */
    switch (d) {
    case RF_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return;
    case RF_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            memcpy(&h, p + 2 * i, 2);
            dst[i] = rf_bf16_to_f32(h);
        }
        return;
    case RF_DTYPE_F16:
        for (size_t i = 0; i < n; i++) {
            memcpy(&h, p + 2 * i, 2);
            dst[i] = rf_f16_to_f32(h);
        }
        return;
    }
}

void rf_dtype_from_f32(void *dst, const float *src, rf_dtype d, size_t n) {
    unsigned char *p = dst;
    uint16_t h;
    if (n == 0) return; /* memcpy with NULL is undefined even for 0 bytes */
    switch (d) {
    case RF_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return;
    case RF_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            h = rf_f32_to_bf16(src[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        return;
    case RF_DTYPE_F16:
        for (size_t i = 0; i < n; i++) {
            h = rf_f32_to_f16(src[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        return;
    }
}
