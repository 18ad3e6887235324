/* Per-element math shared by the CPU and CUDA back ends, written once. Every function here is
 * `static inline` and marked RF_HD so nvcc compiles it for host and device. */
#ifndef RF_KERNEL_MATH_H
#define RF_KERNEL_MATH_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define RF_HD __host__ __device__
#else
#define RF_HD
#endif

/* sigmoid(x) from e = e^-x (the CPU back end computes e^-x for a whole block first). */
RF_HD static inline float rf_sigmoid_of_exp(float e) { return 1.0f / (1.0f + e); }

RF_HD static inline float rf_sigmoidf(float x) { return rf_sigmoid_of_exp(expf(-x)); }

/* silu(g) * u, given s = rf_sigmoidf(g). */
RF_HD static inline float rf_swiglu_s(float g, float u, float s) { return g * s * u; }

/* silu(g) * u */
RF_HD static inline float rf_swiglu(float g, float u) { return rf_swiglu_s(g, u, rf_sigmoidf(g)); }

/* Gradients of silu(g) * u with respect to g and u, given s = rf_sigmoidf(g). */
RF_HD static inline void rf_swiglu_grad_s(float g, float u, float dout, float s, float *dg,
                                          float *du) {
    *du = dout * g * s;
    *dg = dout * u * s * (1.0f + g * (1.0f - s));
}

/* Gradients of silu(g) * u with respect to g and u. */
RF_HD static inline void rf_swiglu_grad(float g, float u, float dout, float *dg, float *du) {
    rf_swiglu_grad_s(g, u, dout, rf_sigmoidf(g), dg, du);
}

/* One AdamW step for a single element; returns the new parameter value. */
RF_HD static inline float rf_adamw_elem(float p, float g, float *m, float *v, float lr,
                                        float beta1, float beta2, float eps, float wd,
                                        float bc1, float bc2) {
    *m = beta1 * *m + (1.0f - beta1) * g;
    *v = beta2 * *v + (1.0f - beta2) * g * g;
    float mhat = *m / bc1, vhat = *v / bc2;
    return p - lr * (mhat / (sqrtf(vhat) + eps) + wd * p);
}

/* Rotates the pair (x0, x1) by angle with sign (+1 forward, -1 backward). */
RF_HD static inline void rf_rope_pair(float *x0, float *x1, float angle, int sign) {
    float c = cosf(angle), s = sign * sinf(angle);
    float a = *x0, b = *x1;
    *x0 = a * c - b * s;
    *x1 = b * c + a * s;
}

/* d entropy / d z_k = -p_k (log p_k + H); d logp_target / d z_k = onehot_k - p_k. */
RF_HD static inline float rf_logprob_dlogit(float p, float logp, float H, int is_target,
                                            float dlogp, float dent) {
    return dlogp * ((float)is_target - p) - dent * p * (logp + H);
}

/* e^x in float, written so that `omp simd` loops vectorise it (glibc's expf is a scalar call
 * per element unless built with -ffast-math); host code (the CPU back end, kernels/sample.c): x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite
 * split of ln2), e^r by Cephes' degree-6 polynomial, 2^n put in the exponent bits. Within 2 ulp
 * of e^x for x in [-87.3, 88.37] (test_kernels checks); x below clamps to -87.3 (e^x ~ 1.2e-38
 * instead of 0 or a denormal), above to 88.37 (~2.6e38, not inf). NaN stays NaN. */
static inline float rf_expf_fast(float x) {
    /* NaN fails both tests and takes -87.3: it must not reach the int conversion below
     * (undefined for NaN); the result is x itself then */
    float xc = x > -87.3f ? (x < 88.37f ? x : 88.37f) : -87.3f;
    /* round xc / ln2 to the nearest integer: adding 1.5 * 2^23 drops the fraction bits */
    float kf = xc * 1.44269504088896341f + 12582912.0f;
    kf -= 12582912.0f;
    float r = xc - kf * 0.693359375f - kf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } two_n = {.u = (uint32_t)((int32_t)kf + 127) << 23};
    return x != x ? x : p * two_n.f;
}

#endif
