#include "kernels/sample.h"

#include <math.h>

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
    float m;
    double sum, lse = rf_logits_lse(z, V, inv_temp, &m, &sum);
    int32_t pick = 0;
    if (greedy) {
        for (int j = 1; j < V; j++)
            if (z[j] > z[pick]) pick = j;
    } else { /* the walk adds the terms of the sum in the same order, so it ends at sum exactly
                and u * sum (u < 1) is passed by an id of positive probability */
        double target = u * sum, cum = 0;
        int32_t last = 0; /* the last id of positive probability walked */
        pick = -1;
        for (int j = 0; j < V && pick < 0; j++) {
            double e = (double)expf((z[j] - m) * inv_temp);
            if (e > 0) last = j;
            cum += e;
            if (e > 0 && target < cum) pick = j;
        }
        if (pick < 0) pick = last; /* u * sum rounded up to sum (u within 2^-53 of 1) */
    }
    if (logp) *logp = (float)((double)z[pick] * inv_temp - lse);
    return pick;
}
