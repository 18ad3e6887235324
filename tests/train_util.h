/* Shared by the update tests (test_actor, test_dp, test_train_tp): a tiny random model and a
 * batch of training samples of different lengths. */
#ifndef RF_TEST_TRAIN_UTIL_H
#define RF_TEST_TRAIN_UTIL_H

#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "model/model.h"
#include "test_util.h"

/* The tiny preset over a 50-token vocabulary, random (std 0.2) from seed, ready to train;
 * with a value head (a critic) when value_head. */
static inline rf_model *rf_test_tiny_model(uint64_t seed, int value_head) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 50) == RF_OK);
    c.value_head = value_head;
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, seed, 0.2f);
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    return m;
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
