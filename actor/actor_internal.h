/* Micro-batching shared by the actor's files, and the model a pass runs on. */
#ifndef RF_ACTOR_INTERNAL_H
#define RF_ACTOR_INTERNAL_H

#include "actor/actor.h"
#include "model/model_tp.h"

/* The model of a pass: one rank's whole model (tp NULL), or this rank's shard of a
 * tensor-parallel model (m == tp->m; every rank of the group runs the same passes). */
typedef struct rf__net {
    rf_model *m;
    rf_model_tp *tp;
} rf__net;

rf_status rf__net_forward(const rf__net *n, const rf_batch *b);
rf_status rf__net_logprobs(const rf__net *n, const int32_t *targets, float inv_temp, float *logp, float *entropy);
rf_status rf__net_values(const rf__net *n, float *values);
rf_status rf__net_backward(const rf__net *n, const float *dlogp, const float *dentropy, const float *dvalues);

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
/* Response tokens of s in the loss (its loss mask's ones; n_resp without a mask). */
int rf__loss_tokens(const rf_train_sample *s);
rf_status rf__validate_samples(const rf_train_sample *s, int n);

/* Forward over micro-batches of samples idx[0..n), calling fn after each forward. */
typedef rf_status (*micro_fn)(const rf__net *net, micro *mb, rf_train_sample *s, const int *idx, void *ctx);
rf_status rf__for_each_micro(const rf__net *net, rf_train_sample *s, const int *idx, int n,
                             int max_tokens, micro_fn fn, void *ctx);

/* 0..n-1 (caller frees). */
int *rf__identity(int n);

#endif
