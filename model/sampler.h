/* Token sampling from logits: greedy, temperature, top-k, top-p (nucleus), seeded. */
#ifndef RF_SAMPLER_H
#define RF_SAMPLER_H

#include <stdint.h>

#include "common/rng.h"
#include "common/status.h"

typedef struct rf_sampling {
    int greedy;          /* 1: argmax, ignores the rest */
    float temperature;   /* > 0 */
    int top_k;           /* 0 = off */
    float top_p;         /* 1 = off; in (0, 1] */
} rf_sampling;

/* Checks ranges; errors name the offending option. */
rf_status rf_sampling_validate(const rf_sampling *s);

/* Picks a token from logits (V). Returns the id; *logp receives the log-probability of that
 * token under the temperature-scaled full distribution (no top-k/top-p renormalisation): the
 * behaviour log-prob that RL training recomputes with inv_temp = 1/temperature (greedy: 1).
 * `work` is scratch of 2*V floats (V floats + V ints). */
int32_t rf_sample(const float *logits, int V, const rf_sampling *s, rf_rng *rng, float *logp,
                  float *work);

#endif
