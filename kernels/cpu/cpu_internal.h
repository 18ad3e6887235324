/* Declarations shared by the files of the CPU back end; each file defines one group of ops. */
#ifndef RF_CPU_INTERNAL_H
#define RF_CPU_INTERNAL_H

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

#endif
