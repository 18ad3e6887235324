#include "model/sampler.h"

#include <math.h>
#include <stdlib.h>

rf_status rf_sampling_validate(const rf_sampling *s) {
    if (s->greedy) return RF_OK;
    if (!(s->temperature > 0.0f))
        return rf_error(RF_ERR_ARG, "temperature must be > 0 (use greedy for argmax), got %g",
                        s->temperature);
    if (s->top_k < 0) return rf_error(RF_ERR_ARG, "top_k must be >= 0, got %d", s->top_k);
    if (!(s->top_p > 0.0f && s->top_p <= 1.0f))
        return rf_error(RF_ERR_ARG, "top_p must be in (0, 1], got %g", s->top_p);
    return RF_OK;
}

/* log-sum-exp of logits * inv_temp, in double */
static double lse_scaled(const float *z, int V, float inv_temp, float *max_out) {
    float m = -INFINITY;
    for (int j = 0; j < V; j++) m = z[j] > m ? z[j] : m;
    double s = 0;
    for (int j = 0; j < V; j++) s += exp((double)(z[j] - m) * inv_temp);
    *max_out = m;
    return (double)m * inv_temp + log(s);
}

static _Thread_local const float *t_keys;
static int by_key_desc(const void *a, const void *b) {
    float x = t_keys[*(const int32_t *)a], y = t_keys[*(const int32_t *)b];
    if (x != y) return x > y ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b; /* ties: lower id first, deterministic */
}

int rf_sampling_sorted(const rf_sampling *s) { return !s->greedy && (s->top_k > 0 || s->top_p < 1.0f); }

int rf_sample_sorted(const float *z, int n, const rf_sampling *s, double lse, double u) {
    float inv_temp = 1.0f / s->temperature;
    if (s->top_k > 0 && s->top_k < n) n = s->top_k;
    if (s->top_p < 1.0f) {
        double cum = 0;
        for (int i = 0; i < n; i++) {
            cum += exp((double)z[i] * inv_temp - lse);
            if (cum >= s->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    double total = 0, cum = 0;
    for (int i = 0; i < n; i++) total += exp((double)z[i] * inv_temp - lse);
    u *= total;
    for (int i = 0; i < n; i++) {
        cum += exp((double)z[i] * inv_temp - lse);
        if (u < cum) return i;
    }
    return n - 1;
}

int32_t rf_sample_u(const float *z, int V, const rf_sampling *s, double u, float *logp, float *work) {
    float inv_temp = s->greedy ? 1.0f : 1.0f / s->temperature, m;
    double lse = lse_scaled(z, V, inv_temp, &m);
    int32_t pick = 0;
    if (s->greedy) {
        for (int j = 1; j < V; j++)
            if (z[j] > z[pick]) pick = j;
    } else if (rf_sampling_sorted(s)) { /* every id sorted by logit, then cut and drawn */
        int32_t *ids = (int32_t *)work;
        float *zs = work + V;
        for (int j = 0; j < V; j++) ids[j] = j;
        t_keys = z;
        qsort(ids, (size_t)V, sizeof(int32_t), by_key_desc);
        for (int j = 0; j < V; j++) zs[j] = z[ids[j]];
        pick = ids[rf_sample_sorted(zs, V, s, lse, u)];
    } else { /* the whole vocabulary in id order */
        double total = 0, cum = 0;
        for (int j = 0; j < V; j++) total += exp((double)z[j] * inv_temp - lse);
        u *= total;
        pick = V - 1;
        for (int j = 0; j < V; j++) {
            cum += exp((double)z[j] * inv_temp - lse);
            if (u < cum) {
                pick = j;
                break;
            }
        }
    }
    if (logp) *logp = (float)((double)z[pick] * inv_temp - lse);
    return pick;
}

int32_t rf_sample(const float *z, int V, const rf_sampling *s, rf_rng *rng, float *logp, float *work) {
    return rf_sample_u(z, V, s, s->greedy ? 0.0 : (double)rf_rng_uniform(rng), logp, work);
}
