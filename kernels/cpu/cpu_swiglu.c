/* SwiGLU forward and backward on the CPU, vectorised, with exactly the bits of the per-element
 * formulas of kernels/kernel_math.h evaluated with the C library's expf.
 *
 * Why: rf_sigmoidf calls expf once per element, and glibc's expf is a scalar call (it
 * vectorises only under -ffast-math), which made SwiGLU 9 % of a prefill at fp32 and 13.5 % at
 * bf16 (docs/kernels.md). rf_expf_fast (kernels/kernel_math.h) is vectorised but rounds otherwise, which
 * would change every run's numbers; this file instead evaluates glibc's own expf algorithm
 * (glibc 2.27 and later, sysdeps/ieee754/flt-32/e_expf.c, from Arm's optimized-routines:
 * x N / ln 2 = k + r, 2^(k/N) from a 32-entry table, 2^(r/N) by a cubic, all in double) in
 * plain C that the compiler vectorises, with the same constants and the same operations. glibc
 * picks between two builds of it at run time: with fused multiply-adds where the CPU has FMA
 * and AVX2 (its ifunc), plain otherwise; this file asks expf which one it is (exp_mode), so
 * the results equal the library's on either kind of CPU. |x| >= 88 and NaN, where glibc leaves the fast path for
 * overflow, underflow and errno, are handed to expf itself. tests/test_kernels.c checks every
 * float in a stride of the whole range, and the operations against kernel_math.h bit for bit;
 * `bench_model --profile`'s swiglu_forward and swiglu_backward lines measure it. On AVX-512 the
 * fused build runs as exp_block_fused512 (intrinsics; the same operations). */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernel_math.h"

#define EXP_N 32
/* 2^(i/32) rounded to double, as bits, less i << 47 (the exponent the index adds back). */
static const uint64_t exp_tab[EXP_N] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
static const double exp_inv_ln2_n = 0x1.71547652b82fep+0 * EXP_N, exp_shift = 0x1.8p+52;
static const double exp_c0 = 0x1.c6af84b912394p-5 / EXP_N / EXP_N / EXP_N,
                    exp_c1 = 0x1.ebfce50fac4f3p-3 / EXP_N / EXP_N, exp_c2 = 0x1.62e42ff0c52d6p-1 / EXP_N;

/* e^x for |x| < 88 (other x: any value; the caller fixes them). FMA(a, b, c) is a * b + c,
 * fused or not: the two builds of glibc's expf. */
#define RF_EXPF_FAST(x, FMA)                                                                 \
    ({                                                                                        \
        double xd_ = (double)(x), kd_ = FMA(exp_inv_ln2_n, xd_, exp_shift);                   \
        uint64_t ki_;                                                                         \
        memcpy(&ki_, &kd_, 8);                                                                \
        kd_ -= exp_shift;                                                                     \
        double r_ = FMA(exp_inv_ln2_n, xd_, -kd_);                                            \
        uint64_t t_ = exp_tab[ki_ % EXP_N] + (ki_ << 47);                                     \
        double s_;                                                                            \
        memcpy(&s_, &t_, 8);                                                                  \
        double z_ = FMA(exp_c0, r_, exp_c1), y_ = FMA(exp_c2, r_, 1.0);                       \
        y_ = FMA(z_, r_ * r_, y_);                                                            \
        (float)(y_ * s_);                                                                     \
    })
#define FMA_FUSED(a, b, c) fma(a, b, c)
#define FMA_PLAIN(a, b, c) ((a) * (b) + (c))

/* e[i] = expf(x[i]), or expf(-x[i]) with neg (a negation, as rf_sigmoidf's -x: it flips a
 * NaN's sign, which a product by -1 does not), for n <= RF_SWIGLU_BLOCK values; the two builds,
 * then the lanes glibc takes off its fast path. */
#define RF_SWIGLU_BLOCK 512
__attribute__((target("avx2,fma"))) static void exp_block_fused(float *e, const float *x, int neg,
                                                                 int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) e[i] = RF_EXPF_FAST(neg ? -x[i] : x[i], FMA_FUSED);
}

/* Compiled without contraction: the plain build's a * b + c stays two roundings (GCC takes the
 * function attribute, clang the pragma). */
#ifdef __clang__
#define RF_NO_CONTRACT_FN
#define RF_NO_CONTRACT_BLOCK _Pragma("clang fp contract(off)")
#else
#define RF_NO_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#define RF_NO_CONTRACT_BLOCK
#endif
RF_NO_CONTRACT_FN static void exp_block_plain(float *e, const float *x, int neg, int n) {
    RF_NO_CONTRACT_BLOCK
#pragma omp simd
    for (int i = 0; i < n; i++) e[i] = RF_EXPF_FAST(neg ? -x[i] : x[i], FMA_PLAIN);
}

#ifdef __x86_64__
#include <immintrin.h>
/* The fused build on AVX-512, 8 lanes of double: the same operations in the same order as
 * exp_block_fused (RF_EXPF_FAST with FMA_FUSED), written with intrinsics because GCC
 * vectorises that loop at the avx2 target's width and looks up the table with gathers. Here the
 * 32-entry table is four registers read by two two-register permutes and a blend on bit 4 of
 * the index. Lanes off glibc's fast path (|x| >= 88, NaN) get expf itself. Does the whole
 * vectors of the n values; returns how many (the caller does the rest). */
__attribute__((target("avx512f"))) static int exp_block_fused512(float *e, const float *x, int neg, int n) {
    const __m512i t0 = _mm512_loadu_si512(exp_tab), t1 = _mm512_loadu_si512(exp_tab + 8);
    const __m512i t2 = _mm512_loadu_si512(exp_tab + 16), t3 = _mm512_loadu_si512(exp_tab + 24);
    const __m512d inv = _mm512_set1_pd(exp_inv_ln2_n), shift = _mm512_set1_pd(exp_shift);
    const __m512d c0 = _mm512_set1_pd(exp_c0), c1 = _mm512_set1_pd(exp_c1), c2 = _mm512_set1_pd(exp_c2);
    const __m512d one = _mm512_set1_pd(1.0);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(neg ? (int)0x80000000u : 0));
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), lim = _mm256_set1_ps(88.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xf = _mm256_xor_ps(_mm256_loadu_ps(x + i), sign); /* -x flips a NaN's sign too */
        __m512d xd = _mm512_cvtps_pd(xf), kd = _mm512_fmadd_pd(inv, xd, shift);
        __m512i ki = _mm512_castpd_si512(kd);
        kd = _mm512_sub_pd(kd, shift);
        __m512d r = _mm512_fmsub_pd(inv, xd, kd); /* fma(inv, xd, -kd) */
        __m512i idx = _mm512_and_si512(ki, _mm512_set1_epi64(EXP_N - 1));
        __m512i lo = _mm512_permutex2var_epi64(t0, idx, t1), hi = _mm512_permutex2var_epi64(t2, idx, t3);
        __mmask8 upper = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
        __m512i t = _mm512_add_epi64(_mm512_mask_blend_epi64(upper, lo, hi), _mm512_slli_epi64(ki, 47));
        __m512d z = _mm512_fmadd_pd(c0, r, c1), y = _mm512_fmadd_pd(c2, r, one);
        y = _mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y);
        _mm256_storeu_ps(e + i, _mm512_cvtpd_ps(_mm512_mul_pd(y, _mm512_castsi512_pd(t))));
        __m256 in = _mm256_cmp_ps(_mm256_and_ps(xf, absmask), lim, _CMP_LT_OQ);
        int off = ~_mm256_movemask_ps(in) & 0xff;
        while (off) {
            int l = __builtin_ctz(off);
            off &= off - 1;
            e[i + l] = expf(neg ? -x[i + l] : x[i + l]);
        }
    }
    return i;
}
#endif

enum { EXP_PLAIN, EXP_FUSED, EXP_LIBM, EXP_FUSED512 };
static _Atomic int g_mode = -1;

/* Which build the C library's expf is, asked of expf itself rather than guessed from the CPU
 * (glibc's choice also follows GLIBC_TUNABLES): probes on which the two builds differ (the
 * only two floats of the fast path where they do, found by trying all 2^32), and ordinary
 * values. A library whose expf is neither (another libc, a later glibc algorithm) gets expf
 * called per element: slower, still its bits. */
static int exp_mode(void) {
    int mode = g_mode;
    if (mode >= 0) return mode;
    static const uint32_t probe_bits[] = {0x4202422f, 0xc27c65d9, 0x3f000000, 0xbfa00000,
                                          0x4124cccd, 0xc28c3333, 0x37fba882, 0x42afcccd};
    enum { NP = sizeof probe_bits / sizeof probe_bits[0] };
    float x[NP], want[NP], got[NP];
    memcpy(x, probe_bits, sizeof x);
    /* through a volatile pointer: the compiler would otherwise fold expf of these constants
     * itself (correctly rounded, which is neither build on the two telling probes) */
    float (*volatile libm_expf)(float) = expf;
    for (int i = 0; i < NP; i++) want[i] = libm_expf(x[i]);
    mode = EXP_LIBM;
    if (__builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2")) {
        exp_block_fused(got, x, 0, NP);
        if (memcmp(got, want, sizeof got) == 0) mode = EXP_FUSED;
    }
    if (mode == EXP_LIBM) {
        exp_block_plain(got, x, 0, NP);
        if (memcmp(got, want, sizeof got) == 0) mode = EXP_PLAIN;
    }
#ifdef __x86_64__
    if (mode == EXP_FUSED && __builtin_cpu_supports("avx512f")) {
        if (exp_block_fused512(got, x, 0, NP) == NP && memcmp(got, want, sizeof got) == 0) mode = EXP_FUSED512;
    }
#endif
    g_mode = mode;
    return mode;
}

static void exp_block(float *e, const float *x, int neg, int n) {
    int mode = exp_mode(), done = 0; /* values done with their off-path lanes */
#ifdef __x86_64__
    if (mode == EXP_FUSED512) done = exp_block_fused512(e, x, neg, n);
#endif
    if (mode == EXP_FUSED || mode == EXP_FUSED512) exp_block_fused(e + done, x + done, neg, n - done);
    else if (mode == EXP_PLAIN) exp_block_plain(e, x, neg, n);
    for (int i = done; i < n; i++)
        if (mode == EXP_LIBM || !(fabsf(x[i]) < 88.0f)) e[i] = expf(neg ? -x[i] : x[i]);
}

int rf_cpu_expf_libm_mode(void) { return exp_mode(); }

void rf_cpu_expf_libm(float *out, const float *x, size_t n) {
    for (size_t i = 0; i < n; i += RF_SWIGLU_BLOCK)
        exp_block(out + i, x + i, 0, n - i < RF_SWIGLU_BLOCK ? (int)(n - i) : RF_SWIGLU_BLOCK);
}

/* e = expf(-gate) over block b of gate (RF_SWIGLU_BLOCK values, fewer at the end); returns how
 * many. The sigmoid is taken from e inside each caller's loop, as one expression with the rest
 * (a NaN's sign then comes out as in kernel_math.h's scalar formulas). */
static int exp_neg_block(float *e, const float *gate, size_t n, size_t b) {
    size_t i0 = b * RF_SWIGLU_BLOCK;
    int m = n - i0 < RF_SWIGLU_BLOCK ? (int)(n - i0) : RF_SWIGLU_BLOCK;
    exp_block(e, gate + i0, 1, m);
    return m;
}

/* rf_swiglu, block by block. A held output (rf_cpu_held_output) gets each block's bf16 values
 * in place of its floats. */
void rf_cpu_swiglu_forward(float *out, const float *gate, const float *up, size_t n) {
    size_t nb = (n + RF_SWIGLU_BLOCK - 1) / RF_SWIGLU_BLOCK;
    uint16_t *ob = rf_cpu_held_output(out, n);
#pragma omp parallel for schedule(static) if (n > RF_OMP_MIN_EXP)
    for (size_t b = 0; b < nb; b++) {
        float e[RF_SWIGLU_BLOCK], o[RF_SWIGLU_BLOCK];
        size_t i0 = b * RF_SWIGLU_BLOCK;
        int m = exp_neg_block(e, gate, n, b);
        float *y = ob ? o : out + i0;
#pragma omp simd
        for (int i = 0; i < m; i++)
            y[i] = rf_swiglu_s(gate[i0 + i], up[i0 + i], rf_sigmoid_of_exp(e[i]));
        if (ob) rf_cpu_bf16_convert(ob + i0, o, m);
    }
}

/* rf_swiglu_grad, block by block; held gradients (rf_cpu_held_output) as for the forward. */
void rf_cpu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, size_t n) {
    size_t nb = (n + RF_SWIGLU_BLOCK - 1) / RF_SWIGLU_BLOCK;
    uint16_t *gb = rf_cpu_held_output(dgate, n), *ub = rf_cpu_held_output(dup, n);
#pragma omp parallel for schedule(static) if (n > RF_OMP_MIN_EXP)
    for (size_t b = 0; b < nb; b++) {
        float e[RF_SWIGLU_BLOCK], g[RF_SWIGLU_BLOCK], u[RF_SWIGLU_BLOCK];
        size_t i0 = b * RF_SWIGLU_BLOCK;
        int m = exp_neg_block(e, gate, n, b);
        float *dg = gb ? g : dgate + i0, *du = ub ? u : dup + i0;
#pragma omp simd
        for (int i = 0; i < m; i++)
            rf_swiglu_grad_s(gate[i0 + i], up[i0 + i], dout[i0 + i], rf_sigmoid_of_exp(e[i]),
                             dg + i, du + i);
        if (gb) rf_cpu_bf16_convert(gb + i0, g, m);
        if (ub) rf_cpu_bf16_convert(ub + i0, u, m);
    }
}
