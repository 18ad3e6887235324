/* Internal helpers shared by the model's files (not part of the public interface). */
#ifndef RF_MODEL_INTERNAL_H
#define RF_MODEL_INTERNAL_H

#include "model/model.h"

/* Grows activation buffers to hold T tokens. */
rf_status rf__model_reserve(rf_model *m, int T);

/* Copies host index arrays to the back end: returns device pointers in the same order.
 * Each of the `n` arrays has counts[i] int32 entries. */
rf_status rf__model_upload_ints(rf_model *m, int n, const int32_t *const *host,
                                const int *counts, int32_t **dev);

/* Ensures m->dev_out holds `n` floats. */
rf_status rf__model_dev_out(rf_model *m, size_t n);

/* One layer in decoding mode: appends keys/values of slots to cache c, attends over it. */
void rf__layer_forward_cached(rf_model *m, int l, rf_layer_acts *a, const float *x_in,
                              float *x_out, int T, rf_kv_cache *c, const int *slots,
                              const int *counts, int n);

#endif
