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

/* Softmax statistics of z (V) * inv_temp, as the CPU back end's log-prob kernels compute them
 * (they call this, so one compiled instance gives both its bits): zs_j = z_j * inv_temp (one
 * rounding; the kernels pass inv_temp 1 on logits their product has already scaled), *m_out =
 * max zs, *sum_out = sum_j e_j and *wsum_out = sum_j e_j (zs_j - m), e_j = rf_expf_fast(zs_j -
 * m), summed in float over blocks of 1024 in index order (the vector lanes as the compiler
 * splits the block) and the blocks in double. Compiled without contraction (CMakeLists.txt), so
 * the scaling and the subtraction round as written. */
void rf_row_softmax_stats(const float *z, int V, float inv_temp, float *m_out, double *sum_out,
                          double *wsum_out);

/* From rf_row_softmax_stats: the log-sum-exp m + log(sum) (in float, as the log-prob kernel
 * gives it) and, when entropy is not NULL, the entropy log(sum) - wsum / sum. */
float rf_row_lse(const float *z, int V, float inv_temp, float *entropy);

/* The log-prob of id under softmax(z * inv_temp) with the bits the CPU back end's
 * logprob_forward gives it when its product yields the logits z * inv_temp: z_id * inv_temp -
 * rf_row_lse. What the samplers report as a pick's log-probability (the behaviour log-prob), so
 * that generation and training agree exactly wherever the logits do. */
float rf_logits_logprob(const float *z, int V, float inv_temp, int32_t id);

/* z_id * inv_temp - lse, each a single rounding (never fused): rf_logits_logprob's last step,
 * and the CUDA sampler's, on a log-sum-exp a back end computed (kernels.h row_lse). */
float rf_logprob_given_lse(float z_id, float inv_temp, float lse);

/* A draw from the whole row z (V): greedy the largest logit (the lowest id among equal ones),
 * else the first id whose cumulative probability under softmax(z * inv_temp), summed in id
 * order in double, exceeds u (in [0, 1)) times the row's total; where rounding leaves that walk
 * short of the total, the same draw over the weights expf((z - max) * inv_temp) of
 * rf_logits_lse's own sum, which end on it exactly: always an id of positive probability.
 * *logp (may be NULL) gets the pick's log-probability rf_logits_logprob. inv_temp is
 * 1 / temperature (1 for greedy). */
int32_t rf_draw_whole(const float *z, int V, float inv_temp, int greedy, double u, float *logp);

#endif
