/* safetensors reading (model/safetensors.c) on arbitrary files: open and validate the header,
 * then read every tensor it accepted as f32 (and bf16 ones as stored, and a block of each), so
 * every offset and shape the validation let through is also dereferenced. */
#include "model/safetensors.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = rf_fuzz_file("model.safetensors", data, size);
    rf_safetensors *st = NULL;
    rf_status s = rf_st_open_file(&st, path);
    rf_fuzz_check_error(s);
    if (s == RF_OK) {
        for (int i = 0; i < rf_st_count(st); i++) {
            const rf_st_tensor *t = rf_st_at(st, i);
            if (rf_st_find(st, t->name) != t) abort();
            size_t numel = t->nbytes / rf_dtype_size(t->dtype);
            if (numel > (1u << 22)) continue; /* the fuzzer's memory limit, not the reader's */
            float *dst = malloc(sizeof(float) * (numel ? numel : 1));
            rf_fuzz_check_error(rf_st_read_f32(st, t->name, dst, t->shape, t->ndim));
            if (t->dtype == RF_DTYPE_BF16)
                rf_fuzz_check_error(rf_st_read_bf16(st, t->name, (uint16_t *)dst, t->shape, t->ndim));
            if (t->ndim > 0 && t->shape[0] > 0)
                rf_fuzz_check_error(rf_st_read_block_f32(st, t->name, dst, t->shape, t->ndim, 0, 1, 0,
                                                         numel / t->shape[0] ? 1 : 0));
            free(dst);
        }
        float one;
        s = rf_st_read_f32(st, "absent.weight", &one, NULL, 0);
        if (s == RF_OK) abort();
        rf_fuzz_check_error(s);
    }
    rf_st_close(st);
    rf_error_clear();
    return 0;
}
