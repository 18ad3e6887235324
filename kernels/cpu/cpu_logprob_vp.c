/* Vocabulary-parallel fused LM head + per-token log-prob and entropy on the CPU: the per-rank
 * half of the tensor-parallel log-prob (model/model_tp.c combines the ranks' partials).
 *
 * As in cpu_logprob.c, the logits of a chunk of tokens over this rank's vocabulary slice are
 * made by one matrix product (rf_cpu_gemm) into a scratch of (chunk, Vl) floats and reduced at once, so memory stays
 * O(chunk * Vl). Each rank reduces against its own maximum; the combination rescales to the
 * global one (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"), so the
 * logits are made once per pass. */
#include <math.h>
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernel_math.h"

/* z (n, Vl) = inv_temp * h[t0 .. t0+n) @ w^T */
static void slice_logits(float *z, const float *h, const float *w, int t0, int n, int C, int Vl,
                         float inv_temp) {
    rf_cpu_gemm(0, 1, n, Vl, C, inv_temp, h + (size_t)t0 * C,
                C, w, C, 0.0f, z, Vl, 1);
}

void rf_cpu_logprob_vp_partials(float *lmax, float *sumexp, float *zsum, float *ztgt,
                                const float *h, const float *w, const int32_t *targets, int T,
                                int C, int Vl, int v0, float inv_temp) {
    int chunk = rf_cpu_logprob_chunk_rows(Vl);
    float *z = rf_cpu_logprob_scratch((size_t)chunk * Vl);
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        slice_logits(z, h, w, t0, n, C, Vl, inv_temp);
#pragma omp parallel for if (n * (size_t)Vl > 65536)
        for (int r = 0; r < n; r++) {
            const float *zr = z + (size_t)r * Vl;
            float m;
            double sum, wsum;
            rf_row_softmax_stats(zr, Vl, 1.0f, &m, &sum, &wsum);
            int tgt = targets[t0 + r] - v0;
            lmax[t0 + r] = m;
            sumexp[t0 + r] = (float)sum;
            zsum[t0 + r] = (float)wsum;
            ztgt[t0 + r] = tgt >= 0 && tgt < Vl ? zr[tgt] : 0.0f;
        }
    }
}

void rf_cpu_logprob_vp_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                                const float *lse, const float *entropy, const float *h,
                                const float *w, const int32_t *targets, int T, int C, int Vl,
                                int v0, float inv_temp) {
    int chunk = rf_cpu_logprob_chunk_rows(Vl);
    float *z = rf_cpu_logprob_scratch((size_t)chunk * Vl);
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        slice_logits(z, h, w, t0, n, C, Vl, inv_temp);
        rf_cpu_logprob_chunk_backward(dh + (size_t)t0 * C, dw, z, h + (size_t)t0 * C, w, n, C, Vl,
                                      lse + t0, entropy + t0, targets + t0, v0,
                                      dlogp ? dlogp + t0 : NULL, dentropy ? dentropy + t0 : NULL,
                                      inv_temp);
    }
}
