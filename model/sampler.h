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

/* rf_sample with its uniform draw given: u in [0, 1) (rf_sample draws it from rng, once, when
 * not greedy; greedy ignores u). */
int32_t rf_sample_u(const float *logits, int V, const rf_sampling *s, double u, float *logp,
                    float *work);

/* 1 when s samples from candidates sorted by logit (top-k or top-p on), 0 when from the whole
 * vocabulary in id order (or greedy). The two draw different tokens for the same u. */
int rf_sampling_sorted(const rf_sampling *s);

/* The inverse temperature every draw and reported log-prob of s uses: 1 / temperature, 1 when
 * greedy. One expression, so that a log-prob computed in two places rounds the same. */
float rf_sampling_inv_temp(const rf_sampling *s);

/* The sorted draw of rf_sample_u: the logits z (n) of n candidates sorted by logit descending
 * (lower id first on ties), holding at least the top-k and the top-p nucleus of the
 * whole distribution, whose log-sum-exp at inv_temp = 1 / temperature is lse. Cuts them to
 * top_k and to the nucleus and returns the index (into z) of the candidate drawn with
 * u, as rf_sample_u does on the whole row (the vocabulary-parallel sampler of model_tp.h merges
 * the ranks' candidates into this). */
int rf_sample_sorted(const float *z, int n, const rf_sampling *s, double lse, double u);

/* The candidates of a top-k / top-p draw from logits z (V) whose log-sum-exp at 1 / temperature
 * is lse: ids (V of room) of the largest logits, sorted by logit descending and lower id first,
 * at least the top_k of them (ties included) or, with top_p < 1, enough that their mass passes
 * top_p; rf_sample_sorted cuts them exactly. Found by selection, not by sorting the whole row.
 * scratch: V floats. Returns the count. */
int rf_sample_candidates(const float *z, int V, const rf_sampling *s, double lse, int32_t *ids, float *scratch);

/* One draw from row `row` of a batch of logits rows, under s with the uniform u (rf_sample_u). */
typedef struct rf_draw {
    int32_t row;
    rf_sampling s;
    double u;
} rf_draw;

#endif
