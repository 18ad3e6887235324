#include "model/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/sample.h"

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

static _Thread_local const float *t_keys;
static int by_key_desc(const void *a, const void *b) {
    float x = t_keys[*(const int32_t *)a], y = t_keys[*(const int32_t *)b];
    if (x != y) return x > y ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b; /* ties: lower id first, deterministic */
}

int rf_sampling_sorted(const rf_sampling *s) { return !s->greedy && (s->top_k > 0 || s->top_p < 1.0f); }

float rf_sampling_inv_temp(const rf_sampling *s) { return s->greedy ? 1.0f : 1.0f / s->temperature; }

/* The k-th largest of x (n of them, reordered), 1 <= k <= n: quickselect. */
static float kth_largest(float *x, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = x[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) { /* larger values to the left */
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) {
                float t = x[i];
                x[i] = x[j], x[j] = t;
                i++, j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return x[want]; /* between the two parts: equal to the pivot */
    }
    return x[want];
}

int rf_sample_candidates(const float *z, int V, const rf_sampling *s, double lse, int32_t *ids, float *scratch) {
    int cap = s->top_k > 0 && s->top_k < V ? s->top_k : V; /* top-k: never more are needed */
    int k = s->top_p < 1.0f && cap > 64 ? 64 : cap, n;
    double it = 1.0 / s->temperature;
    for (;;) { /* the tokens at or above the k-th largest logit, k growing until they suffice */
        memcpy(scratch, z, sizeof(float) * (size_t)V);
        float tau = kth_largest(scratch, V, k);
        double mass = 0;
        n = 0;
        for (int j = 0; j < V; j++)
            if (z[j] >= tau) ids[n++] = j;
        for (int i = 0; i < n; i++) mass += exp((double)z[ids[i]] * it - lse);
        /* enough: the whole top-k (ties included), or past top_p with a margin for the order of
         * the sums, or everything */
        if (n >= cap || (s->top_p < 1.0f && mass >= (double)s->top_p + 1e-6) || k >= V) break;
        k = k > V / 4 ? V : 4 * k;
        k = k < cap ? k : cap;
    }
    t_keys = z;
    qsort(ids, (size_t)n, sizeof(int32_t), by_key_desc);
    return n;
}

int rf_sample_sorted(const float *z, int n, const rf_sampling *s, double lse, double u) {
    float inv_temp = rf_sampling_inv_temp(s);
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
    if (!rf_sampling_sorted(s)) return rf_draw_whole(z, V, rf_sampling_inv_temp(s), s->greedy, u, logp);
    /* the top candidates sorted by logit, then cut and drawn */
    float inv_temp = rf_sampling_inv_temp(s), m;
    double sum, lse = rf_logits_lse(z, V, inv_temp, &m, &sum);
    int32_t *ids = (int32_t *)work;
    float *zs = work + V;
    int n = rf_sample_candidates(z, V, s, lse, ids, zs);
    for (int i = 0; i < n; i++) zs[i] = z[ids[i]];
    int32_t pick = ids[rf_sample_sorted(zs, n, s, lse, u)];
    if (logp) *logp = rf_logits_logprob(z, V, inv_temp, pick);
    return pick;
}

int32_t rf_sample(const float *z, int V, const rf_sampling *s, rf_rng *rng, float *logp, float *work) {
    return rf_sample_u(z, V, s, s->greedy ? 0.0 : (double)rf_rng_uniform(rng), logp, work);
}
