/* Batched generation with a KV cache: prefill every prompt in one pass, then decode the still
 * running sequences together, one token each per step. Sampling is seeded per sequence
 * (seed + index), so a sequence's output does not depend on what else is in the batch. */
#ifndef RF_GENERATE_H
#define RF_GENERATE_H

#include <stdint.h>

#include "model/model.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

#define RF_MAX_STOP 8

typedef enum rf_finish { RF_FINISH_LENGTH, RF_FINISH_EOS, RF_FINISH_STOP } rf_finish;

typedef struct rf_gen_params {
    rf_sampling sampling;
    int max_new_tokens;
    uint64_t seed;
    const int32_t *eos_ids; /* generation ends after one of these is produced */
    int n_eos;
    const char *stop[RF_MAX_STOP]; /* stop strings; need a tokenizer */
    int n_stop;
} rf_gen_params;

typedef struct rf_gen_output {
    int32_t *tokens;   /* (n_tokens) generated ids, including a final EOS; owned */
    float *logprobs;   /* (n_tokens) behaviour log-probs (see rf_sample); owned */
    int n_tokens;
    char *text;        /* decoded text (special tokens skipped), cut before a stop string;
                          NUL-terminated but may hold NULs (a token decoding to U+0000) */
    size_t text_len;   /* bytes in text: use it, not strlen */
    rf_finish finish;
} rf_gen_output;

/* Generates for n prompts (token arrays prompts[i] of lengths prompt_lens[i]). `tok` may be
 * NULL when there are no stop strings and no text is wanted. Fills out[0..n). `progress` = 1
 * draws a progress line on stderr. */
rf_status rf_generate(rf_model *m, const rf_tokenizer *tok, const int32_t *const *prompts,
                      const int *prompt_lens, int n, const rf_gen_params *p, rf_gen_output *out,
                      int progress);

void rf_gen_output_free(rf_gen_output *o);

const char *rf_finish_name(rf_finish f);

#endif
