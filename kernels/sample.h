/* Token sampling arithmetic on one row of logits in host memory: the log-sum-exp at a
 * temperature and the draw from the whole vocabulary (greedy, or inverse CDF in id order).
 * model/sampler.c builds its sampler on these (top-k / top-p add a sorted draw there), and the
 * CPU back end's sample_rows op (kernels.h) runs them over rows, so a draw on the CPU gives the
 * same bits wherever it is made; the CUDA back end's kernel follows the same steps. */
#ifndef RF_SAMPLE_H
#define RF_SAMPLE_H

#include <stdint.h>

/* log-sum-exp of z (V) * inv_temp: m * inv_temp + log(sum) with m the largest logit and sum
 * the sum of expf((z - m) * inv_temp) in double (*max_out = m, *sum_out = sum). */
double rf_logits_lse(const float *z, int V, float inv_temp, float *max_out, double *sum_out);

/* A draw from the whole row z (V): greedy the largest logit (the lowest id among equal ones),
 * else the first id whose cumulative probability under softmax(z * inv_temp), summed in id
 * order in double, exceeds u (in [0, 1)) times the row's total; where rounding leaves that walk
 * short of the total, the same draw over the weights expf((z - max) * inv_temp) of
 * rf_logits_lse's own sum, which end on it exactly: always an id of positive probability.
 * *logp (may be NULL) gets the pick's log-probability z * inv_temp - lse. inv_temp is
 * 1 / temperature (1 for greedy). */
int32_t rf_draw_whole(const float *z, int V, float inv_temp, int greedy, double u, float *logp);

#endif
