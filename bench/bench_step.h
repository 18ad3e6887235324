/* One timed training step of a model on the benches' fixed batch (8 sequences of 256 random
 * tokens of a 16384-token vocabulary, seeded): forward, log-probs, backward and, when `o` is
 * not NULL, an optimizer step. Shared by bench_matmul and bench_lora so both time the same
 * thing; header-only because benches are single files. Returns the best of `reps` timed steps
 * after one warm-up, in seconds. */
#ifndef RF_BENCH_STEP_H
#define RF_BENCH_STEP_H

#include <stdint.h>
#include <stdlib.h>

#include "common/rng.h"
#include "common/util.h"
#include "model/model.h"
#include "trainer/optim.h"

#define RF_BENCH_STEP_SEQS 8
#define RF_BENCH_STEP_LEN 256

/* The same step on B sequences of L tokens (B <= 64): bench_lora times the Qwen2.5-0.5B shape on
 * a shorter batch than the fixed one. */
static inline double rf_bench_train_step_batch(rf_model *m, int reps, const rf_optim_opts *o, int B, int L) {
    int T = B * L;
    int32_t *tok = malloc(sizeof(int32_t) * T), *tgt = malloc(sizeof(int32_t) * T), cu[65];
    RF_ASSERT(B >= 1 && B <= 64 && L >= 1);
    float *lp = malloc(sizeof(float) * T), *dlp = malloc(sizeof(float) * T);
    rf_rng r;
    rf_rng_seed(&r, 1);
    for (int t = 0; t < T; t++) {
        tok[t] = (int32_t)(rf_rng_u64(&r) % 16384), tgt[t] = (int32_t)(rf_rng_u64(&r) % 16384);
        dlp[t] = -1.0f / T;
    }
    for (int b = 0; b <= B; b++) cu[b] = b * L;
    rf_batch bt = {B, T, tok, NULL, cu};
    double best = 1e30, gn;
    for (int i = 0; i < reps + 1; i++) {
        double t0 = rf_time_now();
        rf_model_zero_grad(m);
        RF_ASSERT(rf_model_forward(m, &bt) == RF_OK);
        RF_ASSERT(rf_model_logprobs(m, tgt, 1.0f, lp, NULL) == RF_OK);
        RF_ASSERT(rf_model_backward(m, dlp, NULL, NULL) == RF_OK);
        if (o) RF_ASSERT(rf_optim_step(m, o, &gn, NULL) == RF_OK);
        double el = rf_time_now() - t0;
        if (i > 0 && el < best) best = el;
    }
    free(tok), free(tgt), free(lp), free(dlp);
    return best;
}

/* Weights the layers' matmuls touch (*layers) and the LM head's (*head), as
 * rf_model_train_flops_per_token counts them. */
static inline void rf_bench_matmul_weights(const rf_model_config *c, double *layers, double *head) {
    double C = c->hidden_size, F = c->intermediate_size, QD = (double)c->num_attention_heads * c->head_dim,
           KD = (double)c->num_key_value_heads * c->head_dim;
    *layers = c->num_hidden_layers * (2 * C * QD + 2 * C * KD + 3 * C * F);
    *head = (double)c->vocab_size * C;
}

/* FLOPs of prefilling n_seq prompts of L tokens: the layers' matmuls on every token, the LM head
 * on the last token of each prompt (the only logits prefill makes), QK^T and PV over the causal
 * half (bench/torch_side_by_side.py counts the same). Shared by bench_model and bench_matmul. */
static inline double rf_bench_prefill_flops(const rf_model_config *c, int n_seq, int L) {
    double layers, head;
    rf_bench_matmul_weights(c, &layers, &head);
    double att = 2.0 * c->num_hidden_layers * c->num_attention_heads * c->head_dim * (double)L * L;
    return 2.0 * layers * n_seq * L + 2.0 * head * n_seq + att * n_seq;
}

static inline double rf_bench_train_step(rf_model *m, int reps, const rf_optim_opts *o) {
    return rf_bench_train_step_batch(m, reps, o, RF_BENCH_STEP_SEQS, RF_BENCH_STEP_LEN);
}

#endif
