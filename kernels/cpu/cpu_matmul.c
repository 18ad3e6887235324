/* Matrix products on the CPU through OpenBLAS sgemm (row-major, HF Linear weight layout). */
#include <cblas.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

void rf_cpu_matmul_forward(float *out, const float *inp, const float *w, const float *bias, int T,
                           int C, int OC) {
    if (T == 0) return;
    if (T <= 4) {
        /* Decoding: sgemm would pack all of w for a handful of rows; sgemv streams it once. */
        for (int t = 0; t < T; t++) {
            float *o = out + (size_t)t * OC;
            if (bias) memcpy(o, bias, sizeof(float) * (size_t)OC);
            cblas_sgemv(CblasRowMajor, CblasNoTrans, OC, C, 1.0f, w, C, inp + (size_t)t * C, 1,
                        bias ? 1.0f : 0.0f, o, 1);
        }
        return;
    }
    if (bias) {
#pragma omp parallel for if (T > 64)
        for (int t = 0; t < T; t++)
            for (int o = 0; o < OC; o++) out[(size_t)t * OC + o] = bias[o];
    }
    /* out (T, OC) = inp (T, C) @ w^T (C, OC) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, OC, C, 1.0f, inp, C, w, C,
                bias ? 1.0f : 0.0f, out, OC);
}

void rf_cpu_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, int T, int C, int OC) {
    if (T == 0) return;
    if (dinp) /* dinp (T, C) = dout (T, OC) @ w (OC, C) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, C, OC, 1.0f, dout, OC, w, C,
                    0.0f, dinp, C);
    if (dw) /* dw (OC, C) += dout^T (OC, T) @ inp (T, C) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, T, 1.0f, dout, OC, inp, C,
                    1.0f, dw, C);
    if (dbias) {
#pragma omp parallel for if (OC > 256)
        for (int o = 0; o < OC; o++) {
            float s = 0.0f;
            for (int t = 0; t < T; t++) s += dout[(size_t)t * OC + o];
            dbias[o] += s;
        }
    }
}
