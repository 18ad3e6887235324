#include "kernels/sample.h"

#include <math.h>
#include <stddef.h>

#include "kernels/cpu/cpu_level.h" /* the row statistics are compiled once per x86-64 level */
#include "kernels/kernel_math.h"

void RF_LEVELED(rf_row_softmax_stats)(const float *z, int V, float inv_temp, float *m_out,
                                      double *sum_out, double *wsum_out) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int j = 0; j < V; j++) {
        float zs = z[j] * inv_temp;
        m = zs > m ? zs : m;
    }
    double sum = 0.0, wsum = 0.0;
    for (int j0 = 0; j0 < V; j0 += 1024) {
        float fs = 0.0f, fw = 0.0f;
        int j1 = j0 + 1024 < V ? j0 + 1024 : V;
#pragma omp simd reduction(+ : fs, fw)
        for (int j = j0; j < j1; j++) {
            float x = z[j] * inv_temp - m, e = rf_expf_fast(x);
            fs += e;
            fw += e * x;
        }
        sum += fs;
        wsum += fw;
    }
    *m_out = m, *sum_out = sum, *wsum_out = wsum;
}

#ifndef RF_CPU_LEVEL /* the rest in the baseline copy alone */

float rf_row_lse(const float *z, int V, float inv_temp, float *entropy) {
    float m;
    double sum, wsum;
    rf_row_softmax_stats(z, V, inv_temp, &m, &sum, &wsum);
    if (entropy) *entropy = (float)(log(sum) - wsum / sum); /* lse - sum p z */
    return m + (float)log(sum);
}

float rf_logits_logprob(const float *z, int V, float inv_temp, int32_t id) {
    return rf_logprob_given_lse(z[id], inv_temp, rf_row_lse(z, V, inv_temp, NULL));
}

float rf_logprob_given_lse(float z_id, float inv_temp, float lse) { return z_id * inv_temp - lse; }

/* The passes over the whole row take exp in float (expf: a third faster than exp here; each
 * term is right to float's precision, far below what log-probs are compared at), the sums and
 * the walk's cumulative in double. */
double rf_logits_lse(const float *z, int V, float inv_temp, float *max_out, double *sum_out) {
    float m = -INFINITY;
    for (int j = 0; j < V; j++) m = z[j] > m ? z[j] : m;
    double s = 0;
    for (int j = 0; j < V; j++) s += (double)expf((z[j] - m) * inv_temp);
    *max_out = m, *sum_out = s;
    return (double)m * inv_temp + log(s);
}

int32_t rf_draw_whole(const float *z, int V, float inv_temp, int greedy, double u, float *logp) {
    int32_t pick = 0;
    if (greedy) {
        for (int j = 1; j < V; j++)
            if (z[j] > z[pick]) pick = j;
    } else { /* the row's total (1 but for rounding) from the sum */
        float m;
        double sum, lse = rf_logits_lse(z, V, inv_temp, &m, &sum);
        double total = sum * exp((double)m * inv_temp - lse), cum = 0, target = u * total;
        pick = -1;
        for (int j = 0; j < V && pick < 0; j++) {
            cum += (double)expf((float)((double)z[j] * inv_temp - lse));
            if (target < cum) pick = j;
        }
        if (pick < 0) {
            /* These terms, each rounded on its own, can end short of the total (by up to 1e-7
             * on broad rows of 150 k ids): the draw again over the log-sum-exp's own terms, in
             * its order, whose sum is the total exactly, so an id of positive probability is
             * drawn rather than the last id whatever its probability. */
            double target2 = u * sum;
            int32_t last = 0; /* the last id of positive weight */
            cum = 0;
            for (int j = 0; j < V && pick < 0; j++) {
                double e = (double)expf((z[j] - m) * inv_temp);
                if (e > 0) last = j;
                cum += e;
                if (e > 0 && target2 < cum) pick = j;
            }
            if (pick < 0) pick = last; /* u * sum rounded up to sum (u within 2^-53 of 1) */
        }
    }
    if (logp) *logp = rf_logits_logprob(z, V, inv_temp, pick);
    return pick;
}
#endif
