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
