/* Declarations shared by the files of the CPU back end; each file defines one group of ops. */
#ifndef RF_CPU_INTERNAL_H
#define RF_CPU_INTERNAL_H

#include <math.h>

#include "kernels/kernels.h"

void rf_cpu_matmul_forward(float *out, const float *inp, const float *w, const float *bias, int T,
                           int C, int OC);
void rf_cpu_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, int T, int C, int OC);
void rf_cpu_attention_forward(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *q_off, const int32_t *k_start,
                              const int32_t *k_len, int n_seq, int H, int KVH, int D);
void rf_cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                               int H, int KVH, int D);
void rf_cpu_logprob_forward(float *logp, float *entropy, const float *h, const float *w,
                            const int32_t *targets, int T, int C, int V, float inv_temp);
void rf_cpu_logprob_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                             const float *h, const float *w, const int32_t *targets, int T,
                             int C, int V, float inv_temp);
void rf_cpu_logprob_vp_partials(float *lmax, float *sumexp, float *zsum, float *ztgt,
                                const float *h, const float *w, const int32_t *targets, int T,
                                int C, int Vl, int v0, float inv_temp);
void rf_cpu_logprob_vp_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                                const float *lse, const float *entropy, const float *h,
                                const float *w, const int32_t *targets, int T, int C, int Vl,
                                int v0, float inv_temp);

/* Rows per chunk of the log-prob kernels: up to RF_LOGPROB_CHUNK, fewer for large vocabularies
 * so that the scratch stays near 32 MB (about 55 rows for a 150k vocabulary). */
int rf_cpu_logprob_chunk_rows(int V);

/* The log-prob kernels' scratch of n floats, reused across calls and shared by the whole-
 * vocabulary and vocabulary-parallel kernels (the back end is not re-entrant: kernels.h). */
float *rf_cpu_logprob_scratch(size_t n);

/* Softmax statistics of one row of logits zr (V): the maximum *m, sum_j exp(z_j - m) into
 * *sum and sum_j exp(z_j - m) (z_j - m) into *wsum (lse = m + log sum; entropy = log sum -
 * wsum / sum). Float exponentials (vectorised) in blocks of 1024, double accumulators (V up to
 * ~150k terms). Shared by the whole-vocabulary and vocabulary-parallel log-prob kernels. */
static inline void rf_cpu_row_softmax_stats(const float *zr, int V, float *m_out, double *sum_out,
                                            double *wsum_out) {
    float m = -INFINITY;
    for (int j = 0; j < V; j++) m = zr[j] > m ? zr[j] : m;
    double sum = 0.0, wsum = 0.0;
    for (int j0 = 0; j0 < V; j0 += 1024) {
        float fs = 0.0f, fw = 0.0f;
        int j1 = j0 + 1024 < V ? j0 + 1024 : V;
#pragma omp simd reduction(+ : fs, fw)
        for (int j = j0; j < j1; j++) {
            float e = expf(zr[j] - m);
            fs += e;
            fw += e * (zr[j] - m);
        }
        sum += fs;
        wsum += fw;
    }
    *m_out = m, *sum_out = sum, *wsum_out = wsum;
}

#endif
