/* Linear layers on the CPU (HF weight layout (OC, C): y = x W^T + b) through rf_cpu_gemm
 * (oneDNN, kernels/cpu/cpu_gemm.c); w is the B operand of the forward and dinp products, so
 * in bf16 mode its converted copy is made once per update. */
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

void rf_cpu_matmul_forward(float *out, const float *inp, const float *w, const float *bias, int T,
                           int C, int OC) {
    if (T == 0) return;
    if (bias) {
#pragma omp parallel for if ((size_t)T * OC > RF_OMP_MIN_COPY)
        for (int t = 0; t < T; t++) memcpy(out + (size_t)t * OC, bias, sizeof(float) * (size_t)OC);
    }
    /* out (T, OC) = inp (T, C) @ w^T (C, OC) (+ the bias already there) */
    rf_cpu_gemm(0, 1, T, OC, C, 1.0f, inp, C, w, C, bias ? 1.0f : 0.0f, out, OC, 1);
}

void rf_cpu_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, int T, int C, int OC) {
    if (T == 0) return;
    if (dinp) /* dinp (T, C) = dout (T, OC) @ w (OC, C) */
        rf_cpu_gemm(0, 0, T, C, OC, 1.0f, dout, OC, w, C, 0.0f, dinp, C, 1);
    if (dw) /* dw (OC, C) += dout^T (OC, T) @ inp (T, C); dout as dinp's product read it */
        (dinp ? rf_cpu_gemm_same_a : rf_cpu_gemm)(1, 0, OC, C, T, 1.0f, dout, OC, inp, C, 1.0f, dw, C, 0);
    if (dbias) {
        /* Per output o, s = sum over t in order, then dbias[o] += s: the same additions as a
         * loop down each column, walked a row of DBIAS_COLS columns at a time (a column walk
         * touches one cache line per row; this one reads rows in order and vectorises). */
        enum { DBIAS_COLS = 64 };
        int nb = (OC + DBIAS_COLS - 1) / DBIAS_COLS;
#pragma omp parallel for if ((size_t)T * OC > RF_OMP_MIN_COPY)
        for (int b = 0; b < nb; b++) {
            int o0 = b * DBIAS_COLS, n = OC - o0 < DBIAS_COLS ? OC - o0 : DBIAS_COLS;
            float s[DBIAS_COLS] = {0};
            for (int t = 0; t < T; t++) {
                const float *d = dout + (size_t)t * OC + o0;
#pragma omp simd
                for (int j = 0; j < n; j++) s[j] += d[j];
            }
            for (int j = 0; j < n; j++) dbias[o0 + j] += s[j];
        }
    }
}
