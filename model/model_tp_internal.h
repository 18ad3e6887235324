/* Helpers shared by model_tp.c and model_tp_pass.c (not part of the public interface). */
#ifndef RF_MODEL_TP_INTERNAL_H
#define RF_MODEL_TP_INTERNAL_H

#include "model/model_tp.h"

/* In-place sum of x (n floats, the back end's memory) over the group; nothing at tp = 1.
 * `what` names it in errors ("tensor parallelism: <what>"); layer >= 0 adds "of layer N". */
rf_status rf__tp_allreduce(rf_model_tp *tp, float *x, size_t n, const char *what, int layer);

/* The same for x in host memory (per-token statistics), over rf_comm_host of the group. */
rf_status rf__tp_allreduce_host(rf_model_tp *tp, float *x, size_t n, const char *what);

/* rf_comm_allgather of host memory over the group (rf_comm_host), counted in tp->comm_s. */
rf_status rf__tp_allgather(rf_model_tp *tp, const void *in, void *out, size_t bytes, const char *what);

/* Floats of tp->host per token: the log-prob combination's arrays (model_tp_pass.c). */
#define RF_TP_HOST_PER_TOKEN(tp) (8 + (size_t)(tp)->tp)

/* The staging of the partial replicated gradients (backward), once. Not
 * rf_model_tp_enable_training: ZeRO-1 frees the shard's AdamW moments, which must stay
 * freed. */
rf_status rf__tp_reserve_sync(rf_model_tp *tp);

/* Grows activation buffers and the per-token host arrays (tokens, lse, ent, host) to T
 * tokens. */
rf_status rf__tp_reserve(rf_model_tp *tp, int T);

#endif
