/* Shared by the update tests (test_actor, test_dp, test_train_tp, test_train_tpdp): a tiny
 * random model, a batch of training samples of different lengths, and comparisons of
 * tensor-parallel shards. */
#ifndef RF_TEST_TRAIN_UTIL_H
#define RF_TEST_TRAIN_UTIL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "common/crc32c.h"
#include "model/model.h"
#include "model/model_tp.h"
#include "test_util.h"

/* The tiny preset (4 query heads) over a 50-token vocabulary with kv_heads k/v heads, random
 * (std 0.2) from seed, ready to train; with a value head (a critic) when value_head. */
static inline rf_model *rf_test_tiny_model_kv(uint64_t seed, int value_head, int kv_heads) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 50) == RF_OK);
    c.value_head = value_head;
    c.num_key_value_heads = kv_heads;
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, seed, 0.2f);
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    return m;
}

/* The tiny preset as it is (2 k/v heads). */
static inline rf_model *rf_test_tiny_model(uint64_t seed, int value_head) {
    return rf_test_tiny_model_kv(seed, value_head, 2);
}

/* A backward hook (model.h, rf_grad_ready_fn) that logs the ranges it is given (the first 64). */
typedef struct rf_test_hook_log {
    size_t off[64], n[64];
    int count;
    int fail_at; /* return an error at the call with this index (0 = never) */
} rf_test_hook_log;

static inline rf_status rf_test_log_range(void *ctx, size_t off, size_t n) {
    rf_test_hook_log *h = ctx;
    if (h->count < 64) h->off[h->count] = off, h->n[h->count] = n;
    h->count++;
    return h->fail_at && h->count == h->fail_at ? rf_error(RF_ERR_IO, "hook stops at %d", h->count) : RF_OK;
}

/* Runs pass(ctx) (a backward pass of model m) without a hook and again with the logging hook
 * h on m (left installed): the gradients must be the same bits. */
static inline void rf_test_hook_pass(rf_model *m, void (*pass)(void *), void *ctx, rf_test_hook_log *h) {
    float *plain = malloc(sizeof(float) * m->n_params);
    RF_ASSERT(plain);
    pass(ctx);
    memcpy(plain, m->grads, sizeof(float) * m->n_params);
    *h = (rf_test_hook_log){0};
    rf_model_set_grad_hook(m, rf_test_log_range, h);
    pass(ctx);
    CHECK(memcmp(plain, m->grads, sizeof(float) * m->n_params) == 0);
    free(plain);
}

/* 1 when each logged range ends where the one before it starts. */
static inline int rf_test_hook_contiguous(const rf_test_hook_log *h) {
    int contiguous = 1;
    for (int i = 1; i < h->count && i < 64; i++) contiguous &= h->off[i] + h->n[i] == h->off[i - 1];
    return contiguous;
}

/* max over the shard of |shard - the same slice of whole| / max |whole| (tensor parallelism:
 * a shard against the whole model). */
static inline double rf_test_shard_diff(const rf_model_tp *tp, const rf_model *whole) {
    float *local = malloc(sizeof(float) * tp->m->n_params);
    RF_ASSERT(local);
    rf_param_table pt = {&tp->cfg, tp->full_views, tp->n_full_views};
    rf_layout_extract(&pt, tp->shards, whole->params, local);
    double d = 0, mx = 0;
    for (size_t i = 0; i < tp->m->n_params; i++) d = fmax(d, fabs((double)tp->m->params[i] - local[i]));
    for (size_t i = 0; i < whole->n_params; i++) mx = fmax(mx, fabs((double)whole->params[i]));
    free(local);
    return d / mx;
}

/* 1 when the replicated tensors of tp's shard are the same bits on every rank of c (tp's
 * group): their CRC-32C gathered. */
static inline int rf_test_replicated_same(rf_comm *c, const rf_model_tp *tp) {
    uint32_t crc = 0, *all = malloc(sizeof(uint32_t) * (size_t)tp->tp);
    RF_ASSERT(all);
    for (int i = 0; i < tp->m->n_views; i++)
        if (rf_model_tp_replicated(tp, i))
            crc = rf_crc32c_extend(crc, tp->m->params + tp->m->views[i].offset, tp->m->views[i].numel * sizeof(float));
    int same = rf_comm_allgather(c, &crc, all, sizeof crc, 60.0, "replicated checksums") == RF_OK;
    for (int r = 0; same && r < tp->tp; r++) same = all[r] == crc;
    free(all);
    return same;
}

/* n samples (prompts of 2-5 tokens, responses of 1-7) in groups of 4, advantages of both
 * signs, proximal and behaviour log-probs from model m (so the first step's ratio is 1). */
static inline void rf_test_train_samples(rf_train_sample *s, int n, rf_model *m) {
    for (int i = 0; i < n; i++) {
        memset(&s[i], 0, sizeof s[i]);
        s[i].n_prompt = 2 + i % 4, s[i].n_resp = 1 + (i * 5) % 7;
        int len = s[i].n_prompt + s[i].n_resp;
        s[i].tokens = malloc(sizeof(int32_t) * (size_t)len);
        for (int t = 0; t < len; t++) s[i].tokens[t] = (i * 7 + t * 3 + t * t) % 50;
        RF_ASSERT(rf_train_sample_alloc(&s[i]) == RF_OK);
        for (int t = 0; t < s[i].n_resp; t++) s[i].adv[t] = (i % 3 ? 1.0f : -1.3f) * (0.5f + 0.1f * t);
        s[i].group = i / 4;
    }
    float **prox = malloc(sizeof(float *) * (size_t)n);
    RF_ASSERT(prox);
    for (int i = 0; i < n; i++) prox[i] = s[i].prox_logp;
    RF_ASSERT(rf_actor_logprobs(m, s, n, 1000, 1.0f, prox, NULL) == RF_OK);
    for (int i = 0; i < n; i++) memcpy(s[i].behav_logp, s[i].prox_logp, sizeof(float) * (size_t)s[i].n_resp);
    free(prox);
}

#endif
