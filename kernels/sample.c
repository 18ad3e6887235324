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
    } else { /* the row's total (1 but for rounding) from the sum */
        double total = sum * exp((double)m * inv_temp - lse), cum = 0;
        u *= total;
        pick = V - 1;
        for (int j = 0; j < V; j++) {
            cum += (double)expf((float)((double)z[j] * inv_temp - lse));
            if (u < cum) {
                pick = j;
                break;
            }
        }
    }
    if (logp) *logp = (float)((double)z[pick] * inv_temp - lse);
    return pick;
}
