/* Micro-batching shared by the actor's files. */
#ifndef RF_ACTOR_INTERNAL_H
#define RF_ACTOR_INTERNAL_H

#include "actor/actor.h"

/* A micro-batch: samples idx[0..n) packed; inputs are each sequence but its last token,
 * targets the sequence shifted by one. resp[k] is the row of sample k's first response token. */
typedef struct micro {
    int n, T;
    int last; /* the last micro-batch of its rf__for_each_micro call */
    int32_t *tok, *tgt, *cu, *resp;
} micro;

rf_status rf__micro_pack(micro *mb, rf_train_sample *s, const int *idx, int n);
void rf__micro_free(micro *mb);
/* Samples from idx[0..n) that fit in max_tokens (at least one). */
int rf__micro_count(const rf_train_sample *s, const int *idx, int n, int max_tokens);
rf_status rf__validate_samples(const rf_train_sample *s, int n);

/* Forward over micro-batches of samples idx[0..n), calling fn after each forward. */
typedef rf_status (*micro_fn)(rf_model *m, micro *mb, rf_train_sample *s, const int *idx, void *ctx);
rf_status rf__for_each_micro(rf_model *m, rf_train_sample *s, const int *idx, int n,
                             int max_tokens, micro_fn fn, void *ctx);

/* 0..n-1 (caller frees). */
int *rf__identity(int n);

#endif
