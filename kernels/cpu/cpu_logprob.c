/* Fused LM head + per-token log-prob and entropy of given tokens on the CPU.
 *
 * The logits of RF_LOGPROB_CHUNK tokens at a time are produced by one matrix product (rf_cpu_gemm) into a scratch
 * buffer of (chunk, V) floats, reduced to log-prob and entropy, and dropped: memory stays
 * O(chunk * V) whatever the batch, which is what makes 150k-token vocabularies affordable. */
#include <math.h>
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernel_math.h"

/* Logits of rows [t0, t0+n) into z (n, V), scaled by inv_temp; returns per-row lse and
 * entropy into lse_out/ent_out (n). */
static void chunk_logits(float *z, float *lse_out, float *ent_out, const float *h,
                         const float *w, int t0, int n, int C, int V, float inv_temp) {
    rf_cpu_gemm(0, 1, n, V, C, inv_temp, h + (size_t)t0 * C,
                C, w, C, 0.0f, z, V, 1);
#pragma omp parallel for if (n * (size_t)V > 65536)
    for (int r = 0; r < n; r++) {
        const float *zr = z + (size_t)r * V;
        float m;
        double sum, wsum;
        rf_cpu_row_softmax_stats(zr, V, &m, &sum, &wsum);
        lse_out[r] = m + (float)log(sum);
        /* H = lse - sum p z = log(sum) - sum e (z - m) / sum */
        ent_out[r] = (float)(log(sum) - wsum / sum);
    }
}

int rf_cpu_logprob_chunk_rows(int V) {
    int r = (8 << 20) / (V > 0 ? V : 1);
    return r < 16 ? 16 : r > RF_LOGPROB_CHUNK ? RF_LOGPROB_CHUNK : r;
}

/* Allocating a fresh multi-megabyte buffer per call costs page faults on every step. */
float *rf_cpu_logprob_scratch(size_t n) {
    static float *buf;
    static size_t cap;
    if (n > cap) {
        free(buf);
        buf = malloc(n * sizeof(float));
        cap = buf ? n : 0;
    }
    return buf;
}

void rf_cpu_logprob_forward(float *logp, float *entropy, const float *h, const float *w,
                            const int32_t *targets, int T, int C, int V, float inv_temp) {
    int chunk = rf_cpu_logprob_chunk_rows(V);
    float *z = rf_cpu_logprob_scratch((size_t)chunk * V);
    float lse[RF_LOGPROB_CHUNK], ent[RF_LOGPROB_CHUNK];
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        chunk_logits(z, lse, ent, h, w, t0, n, C, V, inv_temp);
        for (int r = 0; r < n; r++) {
            logp[t0 + r] = z[(size_t)r * V + targets[t0 + r]] - lse[r];
            if (entropy) entropy[t0 + r] = ent[r];
        }
    }
}

void rf_cpu_logprob_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                             const float *h, const float *w, const int32_t *targets, int T,
                             int C, int V, float inv_temp) {
    int chunk = rf_cpu_logprob_chunk_rows(V);
    float *z = rf_cpu_logprob_scratch((size_t)chunk * V);
    float lse[RF_LOGPROB_CHUNK], ent[RF_LOGPROB_CHUNK];
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        chunk_logits(z, lse, ent, h, w, t0, n, C, V, inv_temp);
        /* z becomes dL/d(raw logits) = inv_temp * dL/dz */
#pragma omp parallel for if (n * (size_t)V > 65536)
        for (int r = 0; r < n; r++) {
            float *zr = z + (size_t)r * V;
            float dl = dlogp ? dlogp[t0 + r] : 0.0f, de = dentropy ? dentropy[t0 + r] : 0.0f;
            int tgt = targets[t0 + r];
#pragma omp simd
            for (int j = 0; j < V; j++) {
                float lp = zr[j] - lse[r];
                zr[j] = inv_temp * rf_logprob_dlogit(rf_cpu_expf(lp), lp, ent[r], j == tgt, dl, de);
            }
        }
        /* dh (n, C) = dz (n, V) @ w (V, C); dw (V, C) += dz^T (V, n) @ h (n, C) */
        rf_cpu_gemm(0, 0, n, C, V, 1.0f, z, V, w, C, 0.0f,
                    dh + (size_t)t0 * C, C, 1);
        if (dw)
            rf_cpu_gemm(1, 0, V, C, n, 1.0f, z, V,
                        h + (size_t)t0 * C, C, 1.0f, dw, C, 0);
    }
}
