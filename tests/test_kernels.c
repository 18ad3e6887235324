/* Independent tests of every op in the rf_kernels table, written from the specification in
 * kernels/kernels.h (not from any back end's code):
 *  - the forward of each op against the double-precision references in tests/kernel_ref.h;
 *  - the backward of each op against central finite differences, in double, of the scalar
 *    loss L = sum(dout_rand * forward(x)) built on those references;
 *  - the gradient contract: parameter gradients (dw, dbias, dwte, rmsnorm's dinp) accumulate
 *    (+=), activation gradients are overwritten (buffers are pre-filled to tell them apart);
 *  - edge cases: T = 1, sequences of length 1, n_seq = 1, a KV-cache layout (k_len > q_len,
 *    k_start into a bigger buffer), T and V that are not multiples of RF_LOGPROB_CHUNK.
 *
 * Every check goes through a `const rf_kernels *` and touches back-end memory only through
 * alloc/to_device/to_host/free, so the suite runs unchanged on any back end:
 * tests/test_kernels_cuda.c includes this file (with RF_TEST_KERNELS_NO_MAIN) and runs it on
 * CUDA as well as comparing CUDA with CPU.
 *
 * Tolerances (u = 2^-24 ~ 6e-8 is the fp32 unit roundoff). An element passes when
 *     |got - ref| <= tol * (|ref| + rms(ref))
 * The rms term judges outputs that are small through cancellation on the scale of their
 * array, because fp32 error follows the magnitude of the terms summed, not of the result.
 *  - TOL_ELEM 4e-6 for elementwise ops: a handful of roundings and one libm call (expf is
 *    within 1-2 ulp), i.e. under ~10 u = 6e-7, with a 6x margin.
 *  - TOL_ROPE 1e-5: as TOL_ELEM, plus the rotation angle pos * inv_freq, which transformers
 *    rounds to fp32 (and so does the reference); a back end that keeps it in higher precision
 *    differs by at most half an ulp of the angle, 3.8e-6 at the largest position used (99).
 *  - tol_red(K) = 1e-5 sqrt(K) for ops that reduce over K terms: fp32 sums carry ~u sqrt(K)
 *    (random walk) to u K (worst case) relative error; 1e-5 sqrt(K) ~ 170 u sqrt(K) covers
 *    the worst case up to K ~ 30000 and every K used here.
 *  - TOL_GRAD 2e-4 for gradients against finite differences: with h = 1e-4 on O(1) inputs
 *    the central difference has truncation error h^2 |L'''| / 6 ~ 1e-9 and cancellation error
 *    ~1e-16 |L| / h ~ 1e-11, so it is exact to ~1e-8; the fp32 backward carries ~u sqrt(K),
 *    below 2e-6 for K <= 300 reductions plus the saved fp32 statistics (rstd, lse) it reuses.
 *    A missing or wrong term in a gradient is O(1) relative, far above 2e-4.
 * Copies (embedding forward, memory ops) and single IEEE operations (add_inplace, scale)
 * are checked bit for bit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/cpu/cpu_internal.h" /* rf_cpu_expf_libm: test_swiglu_libm_bits */
#include "kernels/cpu/cpu_level.h"
#include "kernels/kernel_math.h"
#include "kernels/kernels.h"
#include "kernel_ref.h"
#include "test_util.h"

#define TOL_ELEM 4e-6
#define TOL_ROPE 1e-5
#define TOL_GRAD 2e-4
#define FD_H 1e-4
#define FD_MAX_SAMPLES 200 /* elements probed per tensor by finite differences */

static double tol_red(int K) { return 1e-5 * sqrt((double)K); }

static rf_rng g_rng;            /* seeded per suite: every run sees the same inputs */
static const char *g_be = "?";  /* back-end name, for messages */

/* ------------------------------------------------------------------ host helpers */

#define FB(n) (sizeof(float) * (size_t)(n))
#define IB(n) (sizeof(int32_t) * (size_t)(n))

static void *xmalloc(size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p) {
        fprintf(stderr, "test_kernels: out of host memory\n");
        exit(1);
    }
    return p;
}

static float *fnew(size_t n) { return xmalloc(FB(n)); }

static float *fnormal(size_t n, float scale) {
    float *x = fnew(n);
    for (size_t i = 0; i < n; i++) x[i] = scale * rf_rng_normal(&g_rng);
    return x;
}

static float *fconst(size_t n, float value) {
    float *x = fnew(n);
    for (size_t i = 0; i < n; i++) x[i] = value;
    return x;
}

static float *fcopy(const float *x, size_t n) {
    float *y = fnew(n);
    memcpy(y, x, FB(n));
    return y;
}

/* Exact widening of an fp32 tensor: the reference sees the very values the back end sees. */
static double *dcopy(const float *x, size_t n) {
    double *y = xmalloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}

static double wsum(const double *a, const double *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One CHECK per array: every |got - ref| <= tol (|ref| + rms(ref) + 1e-2); prints the worst.
 * The 1e-2 floor (so an absolute 1e-2 * tol, 4e-6 for gradients) covers references that are
 * exactly zero, such as the gradients of attention over a single key, where fp32 leaves
 * rounding noise of eps times the 64-term dot products behind them: 4.4e-7 measured (the CUDA
 * kernels run on the CPU, against the CPU's), more than the 1e-3 floor once allowed. Inputs are
 * O(1), so it hides no real error. */
/* How many elements of got are off ref by more than tol, scaled by |ref| + the rms of ref
 * (+ 1e-2); the worst one in *worst, *worst_r. NaN counts as off. */
static size_t count_off(const float *got, const double *ref, size_t n, double tol, size_t *worst,
                        double *worst_r) {
    double rms = 0.0;
    for (size_t i = 0; i < n; i++) rms += ref[i] * ref[i];
    rms = n ? sqrt(rms / n) : 0.0;
    size_t bad = 0;
    *worst = 0, *worst_r = -1.0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs(got[i] - ref[i]) / (fabs(ref[i]) + rms + 1e-2);
        if (!(r <= tol)) bad++;
        if (!(r <= *worst_r)) *worst_r = r, *worst = i;
    }
    return bad;
}

static void check_arr(const char *what, const float *got, const double *ref, size_t n,
                      double tol) {
    size_t worst;
    double worst_r;
    size_t bad = count_off(got, ref, n, tol, &worst, &worst_r);
    if (bad)
        fprintf(stderr, "[%s] %s: %zu of %zu elements off; worst [%zu] got %.9g want %.9g "
                "(scaled error %.3g > tol %.3g)\n", g_be, what, bad, n, worst,
                n ? got[worst] : 0.0, n ? ref[worst] : 0.0, worst_r, tol);
    CHECK(bad == 0);
}

/* check_arr against an fp32 expectation. */
static void check_arr_f(const char *what, const float *got, const float *want, size_t n,
                        double tol) {
    double *w = dcopy(want, n);
    check_arr(what, got, w, n, tol);
    free(w);
}

/* Bit-for-bit equality (copies and single IEEE operations). */
static void check_exact(const char *what, const float *got, const float *want, size_t n) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ == 0) first = i;
    if (bad)
        fprintf(stderr, "[%s] %s: %zu of %zu elements differ; first [%zu] got %.9g want %.9g\n",
                g_be, what, bad, n, first, got[first], want[first]);
    CHECK(bad == 0);
}

/* ------------------------------------------------------------------ finite differences */

typedef double (*loss_fn)(const void *ctx);

/* Checks got[i] == prefill[i] + dL/dx[i] (prefill NULL = 0, i.e. overwritten) for all
 * elements of x, or FD_MAX_SAMPLES distinct random ones of a bigger tensor, where dL/dx[i]
 * is the central difference (L(x + h e_i) - L(x - h e_i)) / 2h in double. x must be the
 * tensor that `ctx` reads; it is perturbed in place and restored. */
static void check_fd(const char *what, loss_fn L, const void *ctx, double *x, size_t n,
                     const float *got, const float *prefill) {
    size_t m = n < FD_MAX_SAMPLES ? n : FD_MAX_SAMPLES;
    size_t *perm = xmalloc(sizeof(size_t) * n);
    for (size_t i = 0; i < n; i++) perm[i] = i;
    for (size_t i = 0; i < m && m < n; i++) { /* partial Fisher-Yates: m distinct indices */
        size_t j = i + (size_t)(rf_rng_u64(&g_rng) % (n - i)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    double *want = xmalloc(sizeof(double) * m);
    float *have = fnew(m);
    for (size_t j = 0; j < m; j++) {
        size_t i = perm[j];
        double x0 = x[i];
        x[i] = x0 + FD_H;
        double lp = L(ctx);
        x[i] = x0 - FD_H;
        double lm = L(ctx);
        x[i] = x0;
        want[j] = (lp - lm) / (2.0 * FD_H) + (prefill ? prefill[i] : 0.0);
        have[j] = got[i];
    }
    check_arr(what, have, want, m, TOL_GRAD);
    free(perm);
    free(want);
    free(have);
}

/* ------------------------------------------------------------------ back-end wrappers */
/* Each wrapper takes host arrays, copies them to the back end, runs one op and copies the
 * outputs back (NULL host pointer = NULL op argument). Output buffers are uploaded too, so
 * that pre-filled contents reach the op and accumulation can be checked. */

static void *put(const rf_kernels *K, const void *host, size_t bytes) {
    if (!host) return NULL;
    void *d = K->alloc(bytes ? bytes : 1);
    if (!d) {
        fprintf(stderr, "[%s] alloc(%zu) failed: %s\n", K->name, bytes, rf_error_message());
        exit(1);
    }
    K->to_device(d, host, bytes);
    return d;
}

/* Copies back to `host` (unless NULL) and frees the device buffer. */
static void get(const rf_kernels *K, void *host, void *dev, size_t bytes) {
    if (host && dev) K->to_host(host, dev, bytes);
    K->free(dev);
}

static void run_matmul_forward(const rf_kernels *K, float *out, const float *inp,
                               const float *w, const float *bias, int T, int C, int OC) {
    float *d_out = put(K, out, FB(T * OC)), *d_inp = put(K, inp, FB(T * C));
    float *d_w = put(K, w, FB(OC * C)), *d_b = put(K, bias, FB(OC));
    K->matmul_forward(d_out, d_inp, d_w, d_b, T, C, OC);
    get(K, out, d_out, FB(T * OC)), get(K, NULL, d_inp, 0), get(K, NULL, d_w, 0);
    get(K, NULL, d_b, 0);
}

static void run_matmul_backward(const rf_kernels *K, float *dinp, float *dw, float *dbias,
                                const float *dout, const float *inp, const float *w, int T,
                                int C, int OC) {
    float *d_dinp = put(K, dinp, FB(T * C)), *d_dw = put(K, dw, FB(OC * C));
    float *d_db = put(K, dbias, FB(OC)), *d_dout = put(K, dout, FB(T * OC));
    float *d_inp = put(K, inp, FB(T * C)), *d_w = put(K, w, FB(OC * C));
    K->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, T, C, OC);
    get(K, dinp, d_dinp, FB(T * C)), get(K, dw, d_dw, FB(OC * C)), get(K, dbias, d_db, FB(OC));
    get(K, NULL, d_dout, 0), get(K, NULL, d_inp, 0), get(K, NULL, d_w, 0);
}

static void run_embedding_forward(const rf_kernels *K, float *out, const int32_t *tokens,
                                  const float *wte, int V, int T, int C) {
    float *d_out = put(K, out, FB(T * C)), *d_wte = put(K, wte, FB(V * C));
    int32_t *d_tok = put(K, tokens, IB(T));
    K->embedding_forward(d_out, d_tok, d_wte, T, C);
    get(K, out, d_out, FB(T * C)), get(K, NULL, d_wte, 0), get(K, NULL, d_tok, 0);
}

static void run_embedding_backward(const rf_kernels *K, float *dwte, const float *dout,
                                   const int32_t *tokens, int V, int T, int C) {
    float *d_dwte = put(K, dwte, FB(V * C)), *d_dout = put(K, dout, FB(T * C));
    int32_t *d_tok = put(K, tokens, IB(T));
    K->embedding_backward(d_dwte, d_dout, d_tok, T, C);
    get(K, dwte, d_dwte, FB(V * C)), get(K, NULL, d_dout, 0), get(K, NULL, d_tok, 0);
}

static void run_rmsnorm_forward(const rf_kernels *K, float *out, float *rstd, const float *inp,
                                const float *w, int N, int C, float eps) {
    float *d_out = put(K, out, FB(N * C)), *d_rstd = put(K, rstd, FB(N));
    float *d_inp = put(K, inp, FB(N * C)), *d_w = put(K, w, FB(C));
    K->rmsnorm_forward(d_out, d_rstd, d_inp, d_w, N, C, eps);
    get(K, out, d_out, FB(N * C)), get(K, rstd, d_rstd, FB(N));
    get(K, NULL, d_inp, 0), get(K, NULL, d_w, 0);
}

static void run_rmsnorm_backward(const rf_kernels *K, float *dinp, float *dw, const float *dout,
                                 const float *inp, const float *w, const float *rstd, int N,
                                 int C) {
    float *d_dinp = put(K, dinp, FB(N * C)), *d_dw = put(K, dw, FB(C));
    float *d_dout = put(K, dout, FB(N * C)), *d_inp = put(K, inp, FB(N * C));
    float *d_w = put(K, w, FB(C)), *d_rstd = put(K, rstd, FB(N));
    K->rmsnorm_backward(d_dinp, d_dw, d_dout, d_inp, d_w, d_rstd, N, C);
    get(K, dinp, d_dinp, FB(N * C)), get(K, dw, d_dw, FB(C));
    get(K, NULL, d_dout, 0), get(K, NULL, d_inp, 0), get(K, NULL, d_w, 0);
    get(K, NULL, d_rstd, 0);
}

static void run_rope(const rf_kernels *K, float *x, const int32_t *pos, const float *inv_freq,
                     int T, int H, int D, int sign) {
    float *d_x = put(K, x, FB(T * H * D)), *d_f = put(K, inv_freq, FB(D / 2));
    int32_t *d_pos = put(K, pos, IB(T));
    K->rope(d_x, d_pos, d_f, T, H, D, sign);
    get(K, x, d_x, FB(T * H * D)), get(K, NULL, d_f, 0), get(K, NULL, d_pos, 0);
}

/* q has q_off[n_seq] rows; k and v have `rows` rows. */
static void run_attention_forward(const rf_kernels *K, float *out, float *lse, const float *q,
                                  const float *k, const float *v, const int32_t *q_off,
                                  const int32_t *k_start, const int32_t *k_len, int n_seq,
                                  int rows, int H, int KVH, int D) {
    int Tq = q_off[n_seq];
    float *d_out = put(K, out, FB(Tq * H * D)), *d_lse = put(K, lse, FB(Tq * H));
    float *d_q = put(K, q, FB(Tq * H * D)), *d_k = put(K, k, FB(rows * KVH * D));
    float *d_v = put(K, v, FB(rows * KVH * D));
    int32_t *d_qo = put(K, q_off, IB(n_seq + 1)), *d_ks = put(K, k_start, IB(n_seq));
    int32_t *d_kl = put(K, k_len, IB(n_seq));
    K->attention_forward(d_out, d_lse, d_q, d_k, d_v, d_qo, d_ks, d_kl, n_seq, H, KVH, D);
    get(K, out, d_out, FB(Tq * H * D)), get(K, lse, d_lse, FB(Tq * H));
    get(K, NULL, d_q, 0), get(K, NULL, d_k, 0), get(K, NULL, d_v, 0);
    get(K, NULL, d_qo, 0), get(K, NULL, d_ks, 0), get(K, NULL, d_kl, 0);
}

static void run_attention_backward(const rf_kernels *K, float *dq, float *dk, float *dv,
                                   const float *dout, const float *q, const float *k,
                                   const float *v, const float *out, const float *lse,
                                   const int32_t *cu, int n_seq, int T, int H, int KVH, int D) {
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D;
    float *d_dq = put(K, dq, FB(nq)), *d_dk = put(K, dk, FB(nk)), *d_dv = put(K, dv, FB(nk));
    float *d_dout = put(K, dout, FB(nq)), *d_q = put(K, q, FB(nq)), *d_k = put(K, k, FB(nk));
    float *d_v = put(K, v, FB(nk)), *d_out = put(K, out, FB(nq));
    float *d_lse = put(K, lse, FB((size_t)T * H));
    int32_t *d_cu = put(K, cu, IB(n_seq + 1));
    K->attention_backward(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_out, d_lse, d_cu, n_seq,
                          T, H, KVH, D);
    get(K, dq, d_dq, FB(nq)), get(K, dk, d_dk, FB(nk)), get(K, dv, d_dv, FB(nk));
    get(K, NULL, d_dout, 0), get(K, NULL, d_q, 0), get(K, NULL, d_k, 0);
    get(K, NULL, d_v, 0), get(K, NULL, d_out, 0), get(K, NULL, d_lse, 0);
    get(K, NULL, d_cu, 0);
}

static void run_swiglu_forward(const rf_kernels *K, float *out, const float *gate,
                               const float *up, size_t n) {
    float *d_out = put(K, out, FB(n)), *d_g = put(K, gate, FB(n)), *d_u = put(K, up, FB(n));
    K->swiglu_forward(d_out, d_g, d_u, n);
    get(K, out, d_out, FB(n)), get(K, NULL, d_g, 0), get(K, NULL, d_u, 0);
}

static void run_swiglu_backward(const rf_kernels *K, float *dgate, float *dup,
                                const float *dout, const float *gate, const float *up,
                                size_t n) {
    float *d_dg = put(K, dgate, FB(n)), *d_du = put(K, dup, FB(n));
    float *d_dout = put(K, dout, FB(n)), *d_g = put(K, gate, FB(n)), *d_u = put(K, up, FB(n));
    K->swiglu_backward(d_dg, d_du, d_dout, d_g, d_u, n);
    get(K, dgate, d_dg, FB(n)), get(K, dup, d_du, FB(n));
    get(K, NULL, d_dout, 0), get(K, NULL, d_g, 0), get(K, NULL, d_u, 0);
}

static void run_logprob_forward(const rf_kernels *K, float *logp, float *entropy,
                                const float *h, const float *w, const int32_t *targets, int T,
                                int C, int V, float inv_temp) {
    float *d_lp = put(K, logp, FB(T)), *d_ent = put(K, entropy, FB(T));
    float *d_h = put(K, h, FB(T * C)), *d_w = put(K, w, FB(V * C));
    int32_t *d_tg = put(K, targets, IB(T));
    K->logprob_forward(d_lp, d_ent, d_h, d_w, d_tg, T, C, V, inv_temp);
    get(K, logp, d_lp, FB(T)), get(K, entropy, d_ent, FB(T));
    get(K, NULL, d_h, 0), get(K, NULL, d_w, 0), get(K, NULL, d_tg, 0);
}

static void run_logprob_backward(const rf_kernels *K, float *dh, float *dw, const float *dlogp,
                                 const float *dentropy, const float *h, const float *w,
                                 const int32_t *targets, int T, int C, int V, float inv_temp) {
    float *d_dh = put(K, dh, FB(T * C)), *d_dw = put(K, dw, FB(V * C));
    float *d_dlp = put(K, dlogp, FB(T)), *d_dent = put(K, dentropy, FB(T));
    float *d_h = put(K, h, FB(T * C)), *d_w = put(K, w, FB(V * C));
    int32_t *d_tg = put(K, targets, IB(T));
    K->logprob_backward(d_dh, d_dw, d_dlp, d_dent, d_h, d_w, d_tg, T, C, V, inv_temp);
    get(K, dh, d_dh, FB(T * C)), get(K, dw, d_dw, FB(V * C));
    get(K, NULL, d_dlp, 0), get(K, NULL, d_dent, 0), get(K, NULL, d_h, 0);
    get(K, NULL, d_w, 0), get(K, NULL, d_tg, 0);
}

static void run_adamw(const rf_kernels *K, float *param, const float *grad, float *m, float *v,
                      size_t n, float lr, float b1, float b2, float eps, float wd, int step,
                      float gs) {
    float *d_p = put(K, param, FB(n)), *d_g = put(K, grad, FB(n));
    float *d_m = put(K, m, FB(n)), *d_v = put(K, v, FB(n));
    K->adamw(d_p, d_g, d_m, d_v, n, lr, b1, b2, eps, wd, step, gs);
    get(K, param, d_p, FB(n)), get(K, NULL, d_g, 0), get(K, m, d_m, FB(n));
    get(K, v, d_v, FB(n));
}

static void run_add_inplace(const rf_kernels *K, float *a, const float *b, size_t n) {
    float *d_a = put(K, a, FB(n)), *d_b = put(K, b, FB(n));
    K->add_inplace(d_a, d_b, n);
    get(K, a, d_a, FB(n)), get(K, NULL, d_b, 0);
}

static void run_scale(const rf_kernels *K, float *x, float s, size_t n) {
    float *d_x = put(K, x, FB(n));
    K->scale(d_x, s, n);
    get(K, x, d_x, FB(n));
}

static double run_sum_squares(const rf_kernels *K, const float *x, size_t n) {
    float *d_x = put(K, x, FB(n));
    double s = K->sum_squares(d_x, n);
    get(K, NULL, d_x, 0);
    return s;
}

/* ------------------------------------------------------------------ table and memory */

/* Every slot is filled: model code calls them unconditionally. */
static void test_table(const rf_kernels *K) {
    CHECK(K->name != NULL);
    CHECK(K->alloc && K->free && K->to_device && K->to_host && K->copy && K->zero && K->sync);
    CHECK(K->add_inplace && K->scale && K->sum_squares);
    CHECK(K->matmul_forward && K->matmul_backward);
    CHECK(K->embedding_forward && K->embedding_backward);
    CHECK(K->rmsnorm_forward && K->rmsnorm_backward && K->rope && K->add_rmsnorm_forward && K->rope_qk);
    CHECK(K->attention_forward && K->attention_backward);
    CHECK(K->swiglu_forward && K->swiglu_backward);
    CHECK(K->logprob_forward && K->logprob_backward && K->adamw);
    CHECK(K->mem_info && K->heads_expand && K->heads_reduce);
    CHECK(K->paged_kv_write && K->paged_attention_forward && K->logprob_vp_partials && K->logprob_vp_backward);
    size_t free_b = 0, total_b = 0;
    CHECK(K->mem_info(&free_b, &total_b) == 0 && total_b > 0 && free_b <= total_b);
}

/* alloc is zero-filled; to_device/to_host round-trip; copy is device to device and leaves
 * its source alone; zero clears exactly the range asked for; free(NULL) is allowed. */
static void test_memory(const rf_kernels *K) {
    enum { N = 4099 }; /* odd, so that nothing happens to be a multiple of a vector width */
    unsigned char *src = xmalloc(N), *h = xmalloc(N);
    for (int i = 0; i < N; i++) src[i] = (unsigned char)(i * 7 + 1);
    unsigned char *a = K->alloc(N), *b = K->alloc(N);
    CHECK(a != NULL && b != NULL);
    if (!a || !b) return;
    memset(h, 0xAB, N);
    K->to_host(h, a, N);
    int nonzero = 0;
    for (int i = 0; i < N; i++) nonzero += h[i] != 0;
    CHECK(nonzero == 0); /* alloc zero-fills */

    K->to_device(a, src, N);
    K->copy(b, a, N);
    K->zero(b + 100, 1000);
    K->sync();
    K->to_host(h, a, N);
    CHECK(memcmp(h, src, N) == 0); /* round trip, and copy left its source alone */
    K->to_host(h, b, N);
    int bad = 0;
    for (int i = 0; i < N; i++) bad += h[i] != (i >= 100 && i < 1100 ? 0 : src[i]);
    CHECK(bad == 0); /* copy copied; zero cleared [100, 1100) and nothing else */

    K->free(a);
    K->free(b);
    K->free(NULL);
    free(src);
    free(h);
    /* a large range, off a line at both ends (the CPU streams its lines past the caches) */
    size_t big = ((size_t)33 << 20) + 77, z0 = 13, zn = big - 13 - 29;
    unsigned char *hb = xmalloc(big), *db = K->alloc(big);
    CHECK(db != NULL);
    if (db) {
        for (size_t i = 0; i < big; i++) hb[i] = (unsigned char)(i % 251 + 1);
        K->to_device(db, hb, big);
        K->zero(db + z0, zn);
        K->sync();
        K->to_host(hb, db, big);
        size_t wrong = 0;
        for (size_t i = 0; i < big; i++) wrong += hb[i] != (i >= z0 && i < z0 + zn ? 0 : (unsigned char)(i % 251 + 1));
        CHECK(wrong == 0);
        K->free(db);
    }
    free(hb);
    /* 64-byte alignment, small and large (the CPU back end maps large blocks) */
    size_t sizes[4] = {1, 100, (size_t)3 << 20, ((size_t)1 << 20) - 70};
    for (int i = 0; i < 4; i++) {
        void *p = K->alloc(sizes[i]);
        CHECK(p != NULL && (uintptr_t)p % 64 == 0);
        K->free(p);
    }
}

#if defined(__linux__) && !defined(__SANITIZE_ADDRESS__)
/* Resident pages of this process (/proc/self/statm), -1 when unreadable. */
static long resident_pages(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, res = -1;
    if (f && fscanf(f, "%ld %ld", &size, &res) != 2) res = -1;
    if (f) fclose(f);
    return res;
}
#endif

/* The CPU back end's large buffers cost resident memory only where they are used: 256 MB
 * allocated adds almost nothing (under 8 MB), reads as zeros, and touching 16 MB of it adds
 * about that. */
static void test_lazy_alloc(const rf_kernels *K) {
#if defined(__linux__) && !defined(__SANITIZE_ADDRESS__) /* ASan builds allocate with malloc */
    if (strcmp(K->name, "cpu") != 0) return;
    size_t big = (size_t)256 << 20, page = 4096;
    long before = resident_pages();
    unsigned char *p = K->alloc(big);
    CHECK(p != NULL);
    if (!p || before < 0) return;
    long after = resident_pages();
    CHECK((after - before) * (long)page < (8L << 20));
    int nonzero = 0;
    for (size_t i = 0; i < big; i += (size_t)1 << 20) nonzero += p[i] != 0; /* touches 256 pages */
    CHECK(nonzero == 0 && p[big - 1] == 0);
    memset(p + ((size_t)64 << 20), 1, (size_t)16 << 20);
    long touched = resident_pages();
    CHECK((touched - before) * (long)page >= (16L << 20) && (touched - before) * (long)page < (32L << 20));
    K->free(p);
#else
    (void)K;
#endif
}

/* ------------------------------------------------------------------ elementwise */

/* add_inplace and scale are one IEEE operation per element, so they must match the host's
 * fp32 a + b and x * s bit for bit. sum_squares returns a double: tol_red(n). */
static void test_elementwise(const rf_kernels *K) {
    size_t n = 1037;
    float *a = fnormal(n, 1.0f), *b = fnormal(n, 1.0f), *want = fnew(n), *x = fcopy(a, n);
    for (size_t i = 0; i < n; i++) want[i] = a[i] + b[i];
    run_add_inplace(K, x, b, n);
    check_exact("add_inplace", x, want, n);

    memcpy(x, a, FB(n));
    for (size_t i = 0; i < n; i++) want[i] = a[i] * -0.37f;
    run_scale(K, x, -0.37f, n);
    check_exact("scale", x, want, n);

    size_t ns[] = {1, 7, n};
    for (int c = 0; c < 3; c++) {
        double ref = 0.0;
        for (size_t i = 0; i < ns[c]; i++) ref += (double)a[i] * a[i];
        CHECK_CLOSE(run_sum_squares(K, a, ns[c]), ref, 0.0, tol_red((int)ns[c]));
    }
    CHECK(run_sum_squares(K, a, 0) == 0.0);
    free(a), free(b), free(want), free(x);
}

/* ------------------------------------------------------------------ matmul */

typedef struct {
    const double *inp, *w, *bias, *dout;
    int T, C, OC;
} mm_ctx;

static double mm_loss(const void *p) {
    const mm_ctx *c = p;
    size_t n = (size_t)c->T * c->OC;
    double *out = xmalloc(sizeof(double) * n);
    ref_matmul(out, c->inp, c->w, c->bias, c->T, c->C, c->OC);
    double L = wsum(c->dout, out, n);
    free(out);
    return L;
}

static void test_matmul_case(const rf_kernels *K, int T, int C, int OC, int with_bias) {
    char what[160];
    size_t ni = (size_t)T * C, nw = (size_t)OC * C, no = (size_t)T * OC;
    float *inp = fnormal(ni, 1.0f), *w = fnormal(nw, 1.0f);
    float *bias = with_bias ? fnormal(OC, 1.0f) : NULL, *out = fconst(no, NAN);
    double *inp_d = dcopy(inp, ni), *w_d = dcopy(w, nw), *out_d = xmalloc(sizeof(double) * no);
    double *bias_d = bias ? dcopy(bias, OC) : xmalloc(sizeof(double) * OC); /* zeros */

    run_matmul_forward(K, out, inp, w, bias, T, C, OC);
    ref_matmul(out_d, inp_d, w_d, bias_d, T, C, OC);
    snprintf(what, sizeof what, "matmul_forward T=%d C=%d OC=%d bias=%d", T, C, OC, with_bias);
    check_arr(what, out, out_d, no, tol_red(C));

    /* dinp pre-filled with junk (overwritten); dw, dbias pre-filled (accumulate). */
    float *dout = fnormal(no, 1.0f), *dinp = fconst(ni, 1e3f);
    float *dw0 = fnormal(nw, 1.0f), *db0 = fnormal(OC, 1.0f);
    float *dw = fcopy(dw0, nw), *db = fcopy(db0, OC);
    double *dout_d = dcopy(dout, no);
    run_matmul_backward(K, dinp, dw, db, dout, inp, w, T, C, OC);
    mm_ctx ctx = {inp_d, w_d, bias_d, dout_d, T, C, OC};
    snprintf(what, sizeof what, "matmul_backward dinp (overwrite) T=%d C=%d OC=%d", T, C, OC);
    check_fd(what, mm_loss, &ctx, inp_d, ni, dinp, NULL);
    snprintf(what, sizeof what, "matmul_backward dw (+=) T=%d C=%d OC=%d", T, C, OC);
    check_fd(what, mm_loss, &ctx, w_d, nw, dw, dw0);
    snprintf(what, sizeof what, "matmul_backward dbias (+=) T=%d C=%d OC=%d", T, C, OC);
    check_fd(what, mm_loss, &ctx, bias_d, OC, db, db0);

    /* dinp = dbias = NULL: skipped, and dw is still accumulated. */
    memcpy(dw, dw0, FB(nw));
    run_matmul_backward(K, NULL, dw, NULL, dout, inp, w, T, C, OC);
    snprintf(what, sizeof what, "matmul_backward dw with dinp=dbias=NULL T=%d", T);
    check_fd(what, mm_loss, &ctx, w_d, nw, dw, dw0);

    free(inp), free(w), free(bias), free(out), free(inp_d), free(w_d), free(out_d);
    free(bias_d), free(dout), free(dinp), free(dw0), free(db0), free(dw), free(db);
    free(dout_d);
}

static void test_matmul(const rf_kernels *K) {
    test_matmul_case(K, 5, 24, 7, 1);
    test_matmul_case(K, 9, 33, 17, 0);
    test_matmul_case(K, 1, 16, 3, 1); /* T = 1 */
    /* row buckets (cpu_gemm.c bucket_rows): 32 rows and the last 16; 64 and the last 64 */
    test_matmul_case(K, 37, 24, 7, 0);
    test_matmul_case(K, 70, 33, 17, 1);
}

/* ------------------------------------------------------------------ embedding */

typedef struct {
    const double *wte, *dout;
    const int32_t *tokens;
    int T, C;
} emb_ctx;

static double emb_loss(const void *p) {
    const emb_ctx *c = p;
    size_t n = (size_t)c->T * c->C;
    double *out = xmalloc(sizeof(double) * n);
    ref_embedding(out, c->tokens, c->wte, c->T, c->C);
    double L = wsum(c->dout, out, n);
    free(out);
    return L;
}

static void test_embedding_case(const rf_kernels *K, const int32_t *tokens, int T, int V, int C) {
    char what[128];
    size_t nv = (size_t)V * C, no = (size_t)T * C;
    float *wte = fnormal(nv, 1.0f), *out = fconst(no, NAN), *want = fnew(no);
    run_embedding_forward(K, out, tokens, wte, V, T, C);
    for (int t = 0; t < T; t++) memcpy(want + (size_t)t * C, wte + (size_t)tokens[t] * C, FB(C));
    snprintf(what, sizeof what, "embedding_forward T=%d", T);
    check_exact(what, out, want, no);

    float *dout = fnormal(no, 1.0f), *dwte0 = fnormal(nv, 1.0f), *dwte = fcopy(dwte0, nv);
    double *wte_d = dcopy(wte, nv), *dout_d = dcopy(dout, no);
    run_embedding_backward(K, dwte, dout, tokens, V, T, C);
    emb_ctx ctx = {wte_d, dout_d, tokens, T, C};
    snprintf(what, sizeof what, "embedding_backward dwte (+=, repeated tokens) T=%d", T);
    check_fd(what, emb_loss, &ctx, wte_d, nv, dwte, dwte0);
    free(wte), free(out), free(want), free(dout), free(dwte0), free(dwte), free(wte_d);
    free(dout_d);
}

/* Negative ids (a vocabulary-parallel rank's tokens outside its slice): zero rows forward, no
 * gradient backward; the other rows as usual. */
static void test_embedding_masked(const rf_kernels *K) {
    enum { T = 6, V = 5, C = 7 };
    static const int32_t tokens[T] = {2, -1, 4, -1, 0, 2};
    float *wte = fnormal(V * C, 1.0f), *out = fconst(T * C, NAN), *want = fnew(T * C);
    run_embedding_forward(K, out, tokens, wte, V, T, C);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) want[t * C + c] = tokens[t] < 0 ? 0.0f : wte[tokens[t] * C + c];
    check_exact("embedding_forward, negative ids", out, want, T * C);
    float *dout = fnormal(T * C, 1.0f), *dwte = fnormal(V * C, 1.0f), *dwant = fcopy(dwte, V * C);
    run_embedding_backward(K, dwte, dout, tokens, V, T, C);
    for (int t = 0; t < T; t++) /* serial, as the CPU adds; row 2's two adds in this order */
        for (int c = 0; tokens[t] >= 0 && c < C; c++) dwant[tokens[t] * C + c] += dout[t * C + c];
    check_arr_f("embedding_backward, negative ids", dwte, dwant, V * C, 2 * TOL_GRAD);
    free(wte), free(out), free(want), free(dout), free(dwte), free(dwant);
}

static void test_embedding(const rf_kernels *K) {
    /* token 3 three times, 0 and 10 twice: the scatter must add, not store */
    static const int32_t tokens[9] = {3, 0, 3, 10, 5, 3, 0, 7, 10};
    test_embedding_case(K, tokens, 9, 11, 6);
    test_embedding_case(K, tokens + 3, 1, 11, 6); /* T = 1, last vocabulary row */
}

/* ------------------------------------------------------------------ grouped-query heads */

/* Query heads h0 .. h0 + H - 1 of a model with `group` query heads per k/v head, against the
 * map written out: expand copies exactly, and reduce (its transpose) sums in head order, so
 * both are exact. */
static void test_heads_case(const rf_kernels *K, int T, int H, int D, int h0, int group) {
    int KV = (h0 + H - 1) / group - h0 / group + 1;
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KV * D;
    float *src = fnormal(nk, 1.0f), *out = fconst(nq, NAN), *want = fnew(nq);
    float *d_out = put(K, out, FB(nq)), *d_src = put(K, src, FB(nk));
    K->heads_expand(d_out, d_src, T, H, KV, D, h0, group);
    get(K, out, d_out, FB(nq)), get(K, NULL, d_src, 0);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++)
            for (int d = 0; d < D; d++)
                want[((size_t)t * H + i) * D + d] = src[((size_t)t * KV + (h0 + i) / group - h0 / group) * D + d];
    char what[128];
    snprintf(what, sizeof what, "heads_expand H=%d KV=%d h0=%d group=%d", H, KV, h0, group);
    check_exact(what, out, want, nq);
    float *g = fnormal(nq, 1.0f), *red = fconst(nk, NAN), *rwant = fnew(nk);
    float *d_red = put(K, red, FB(nk)), *d_g = put(K, g, FB(nq));
    K->heads_reduce(d_red, d_g, T, H, KV, D, h0, group);
    get(K, red, d_red, FB(nk)), get(K, NULL, d_g, 0);
    memset(rwant, 0, FB(nk));
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++)
            for (int d = 0; d < D; d++)
                rwant[((size_t)t * KV + (h0 + i) / group - h0 / group) * D + d] += g[((size_t)t * H + i) * D + d];
    snprintf(what, sizeof what, "heads_reduce H=%d KV=%d h0=%d group=%d", H, KV, h0, group);
    check_exact(what, red, rwant, nk);
    free(src), free(out), free(want), free(g), free(red), free(rwant);
}

static void test_heads(const rf_kernels *K) {
    test_heads_case(K, 5, 6, 4, 0, 4); /* 12 / 3 heads at tp 2, rank 0: k/v 0 0 0 0 1 1 */
    test_heads_case(K, 3, 6, 4, 6, 4); /* rank 1: heads 6..11, k/v 1 1 2 2 2 2 */
    test_heads_case(K, 2, 4, 8, 4, 3); /* 12 / 4 at tp 3, rank 1: heads 4..7, k/v 1 1 2 2 */
    test_heads_case(K, 1, 1, 6, 7, 2); /* one head, T = 1 */
}

/* ------------------------------------------------------------------ rmsnorm */

typedef struct {
    const double *inp, *w, *dout;
    int N, C;
    double eps;
} rms_ctx;

static double rms_loss(const void *p) {
    const rms_ctx *c = p;
    size_t n = (size_t)c->N * c->C;
    double *out = xmalloc(sizeof(double) * n);
    ref_rmsnorm(out, NULL, c->inp, c->w, c->N, c->C, c->eps);
    double L = wsum(c->dout, out, n);
    free(out);
    return L;
}

static void test_rmsnorm_case(const rf_kernels *K, int N, int C) {
    char what[128];
    const float eps = 1e-5f;
    size_t n = (size_t)N * C;
    float *inp = fnormal(n, 1.5f), *w = fnormal(C, 0.3f), *out = fconst(n, NAN);
    float *rstd = fconst(N, NAN);
    for (int c = 0; c < C; c++) w[c] += 1.0f;
    double *inp_d = dcopy(inp, n), *w_d = dcopy(w, C), *out_d = xmalloc(sizeof(double) * n);
    double *rstd_d = xmalloc(sizeof(double) * N);
    run_rmsnorm_forward(K, out, rstd, inp, w, N, C, eps);
    ref_rmsnorm(out_d, rstd_d, inp_d, w_d, N, C, (double)eps);
    snprintf(what, sizeof what, "rmsnorm_forward out N=%d C=%d", N, C);
    check_arr(what, out, out_d, n, tol_red(C));
    snprintf(what, sizeof what, "rmsnorm_forward rstd N=%d C=%d", N, C);
    check_arr(what, rstd, rstd_d, N, tol_red(C));
    float *out2 = fconst(n, NAN);
    run_rmsnorm_forward(K, out2, NULL, inp, w, N, C, eps);
    snprintf(what, sizeof what, "rmsnorm_forward with rstd=NULL N=%d C=%d", N, C);
    check_arr(what, out2, out_d, n, tol_red(C));

    /* both dinp and dw accumulate into what they already hold */
    float *dout = fnormal(n, 1.0f), *dinp0 = fnormal(n, 1.0f), *dw0 = fnormal(C, 1.0f);
    float *dinp = fcopy(dinp0, n), *dw = fcopy(dw0, C);
    double *dout_d = dcopy(dout, n);
    run_rmsnorm_backward(K, dinp, dw, dout, inp, w, rstd, N, C);
    rms_ctx ctx = {inp_d, w_d, dout_d, N, C, (double)eps};
    snprintf(what, sizeof what, "rmsnorm_backward dinp (+=) N=%d C=%d", N, C);
    check_fd(what, rms_loss, &ctx, inp_d, n, dinp, dinp0);
    snprintf(what, sizeof what, "rmsnorm_backward dw (+=) N=%d C=%d", N, C);
    check_fd(what, rms_loss, &ctx, w_d, C, dw, dw0);
    free(inp), free(w), free(out), free(rstd), free(inp_d), free(w_d), free(out_d), free(rstd_d);
    free(out2), free(dout), free(dinp0), free(dw0), free(dinp), free(dw), free(dout_d);
}

static void test_rmsnorm(const rf_kernels *K) {
    test_rmsnorm_case(K, 4, 32);
    test_rmsnorm_case(K, 3, 7);
    test_rmsnorm_case(K, 1, 16); /* N = 1 */
}

/* ------------------------------------------------------------------ rope */

typedef struct {
    const double *x, *dout;
    const int32_t *pos;
    const float *inv_freq;
    int T, H, D;
} rope_ctx;

static double rope_loss(const void *p) {
    const rope_ctx *c = p;
    size_t n = (size_t)c->T * c->H * c->D;
    double *y = xmalloc(sizeof(double) * n);
    memcpy(y, c->x, sizeof(double) * n);
    ref_rope(y, c->pos, c->inv_freq, c->T, c->H, c->D, +1);
    double L = wsum(c->dout, y, n);
    free(y);
    return L;
}

/* inv_freq[i] = theta^(-2i/D), as transformers' default rope init computes it. */
static void rope_inv_freq(float *inv_freq, int D, double theta) {
    for (int i = 0; i < D / 2; i++) inv_freq[i] = (float)pow(theta, -2.0 * i / D);
}

static void test_rope_case(const rf_kernels *K, const int32_t *pos, int T, int H, int D) {
    char what[128];
    size_t n = (size_t)T * H * D;
    float inv_freq[64];
    rope_inv_freq(inv_freq, D, 10000.0);
    float *x = fnormal(n, 1.0f), *y = fcopy(x, n);
    double *x_d = dcopy(x, n), *y_d = dcopy(x, n);
    run_rope(K, y, pos, inv_freq, T, H, D, +1);
    ref_rope(y_d, pos, inv_freq, T, H, D, +1);
    snprintf(what, sizeof what, "rope forward (HF rotate_half) T=%d H=%d D=%d", T, H, D);
    check_arr(what, y, y_d, n, TOL_ROPE);

    /* sign = -1 undoes sign = +1 */
    run_rope(K, y, pos, inv_freq, T, H, D, -1);
    snprintf(what, sizeof what, "rope(-1) after rope(+1) is the identity T=%d D=%d", T, D);
    check_arr(what, y, x_d, n, TOL_ROPE);

    /* sign = -1 applied to dout is the backward: the finite-difference gradient of
     * sum(dout * rope(x)), i.e. rope(-1) is the transpose of rope(+1) */
    float *g = fnormal(n, 1.0f);
    double *g_d = dcopy(g, n);
    run_rope(K, g, pos, inv_freq, T, H, D, -1);
    rope_ctx ctx = {x_d, g_d, pos, inv_freq, T, H, D};
    snprintf(what, sizeof what, "rope backward (sign=-1) T=%d H=%d D=%d", T, H, D);
    check_fd(what, rope_loss, &ctx, x_d, n, g, NULL);
    free(x), free(y), free(x_d), free(y_d), free(g), free(g_d);
}

/* The pairing is (i, i + D/2) (rotate_half), not interleaved (2i, 2i+1): one hand-worked
 * vector. D = 4, pos = 2, inv_freq = {1, 0.01}: angles 2 and 0.02 (exact in fp32 up to 0.02's
 * rounding, which the expected values share). */
static void test_rope_by_hand(const rf_kernels *K) {
    float x[4] = {1, 2, 3, 4}, inv_freq[2] = {1.0f, 0.01f};
    int32_t pos[1] = {2};
    double a0 = 2.0, a1 = (double)(2.0f * 0.01f);
    double want[4] = {1 * cos(a0) - 3 * sin(a0), 2 * cos(a1) - 4 * sin(a1),
                      3 * cos(a0) + 1 * sin(a0), 4 * cos(a1) + 2 * sin(a1)};
    run_rope(K, x, pos, inv_freq, 1, 1, 4, +1);
    check_arr("rope forward by hand (pairs i, i+D/2)", x, want, 4, TOL_ROPE);
}

static void test_rope(const rf_kernels *K) {
    static const int32_t pos[5] = {0, 3, 17, 42, 99};
    static const int32_t packed[7] = {0, 1, 2, 0, 1, 2, 3}; /* positions restart per sequence */
    test_rope_by_hand(K);
    test_rope_case(K, pos, 5, 3, 8);
    test_rope_case(K, packed, 7, 2, 16);
    test_rope_case(K, pos + 3, 1, 4, 8); /* T = 1 */
}

/* ------------------------------------------------------------------ attention */

typedef struct {
    const double *q, *k, *v, *dout;
    const int32_t *q_off, *k_start, *k_len;
    int n_seq, H, KVH, D;
} att_ctx;

static double att_loss(const void *p) {
    const att_ctx *c = p;
    size_t n = (size_t)c->q_off[c->n_seq] * c->H * c->D;
    double *out = xmalloc(sizeof(double) * n);
    ref_attention(out, NULL, c->q, c->k, c->v, c->q_off, c->k_start, c->k_len, c->n_seq, c->H,
                  c->KVH, c->D);
    double L = wsum(c->dout, out, n);
    free(out);
    return L;
}

/* Each sequence run alone (n_seq = 1, its rows only) gives the rows the packed call gave.
 * Same arithmetic per (query, head), so only reduction-order differences are allowed. */
static void check_packing(const rf_kernels *K, const float *q, const float *k, const float *v,
                          const float *out, const float *lse, const float *dout,
                          const float *dq, const float *dk, const float *dv,
                          const int32_t *cu, int n_seq, int H, int KVH, int D) {
    char what[128];
    for (int s = 0; s < n_seq; s++) {
        int len = cu[s + 1] - cu[s];
        size_t oq = (size_t)cu[s] * H * D, ok = (size_t)cu[s] * KVH * D;
        size_t nq = (size_t)len * H * D, nk = (size_t)len * KVH * D;
        int32_t off[2] = {0, len}, ks[1] = {0}, kl[1] = {len};
        float *o = fconst(nq, NAN), *l = fconst((size_t)len * H, NAN);
        run_attention_forward(K, o, l, q + oq, k + ok, v + ok, off, ks, kl, 1, len, H, KVH, D);
        snprintf(what, sizeof what, "attention packed == alone: out of sequence %d (len %d)", s,
                 len);
        check_arr_f(what, o, out + oq, nq, tol_red(D + len));
        snprintf(what, sizeof what, "attention packed == alone: lse of sequence %d", s);
        check_arr_f(what, l, lse + (size_t)cu[s] * H, (size_t)len * H, tol_red(D + len));
        float *gq = fconst(nq, NAN), *gk = fconst(nk, NAN), *gv = fconst(nk, NAN);
        run_attention_backward(K, gq, gk, gv, dout + oq, q + oq, k + ok, v + ok, o, l, off, 1,
                               len, H, KVH, D);
        snprintf(what, sizeof what, "attention packed == alone: dq dk dv of sequence %d", s);
        check_arr_f(what, gq, dq + oq, nq, TOL_GRAD);
        check_arr_f(what, gk, dk + ok, nk, TOL_GRAD);
        check_arr_f(what, gv, dv + ok, nk, TOL_GRAD);
        free(o), free(l), free(gq), free(gk), free(gv);
    }
}

/* Training layout: k_start = q_off = cu_seqlens, k_len = q_len. */
static void test_attention_train(const rf_kernels *K, const int *lens, int n_seq, int H, int KVH,
                                 int D) {
    char what[160];
    int32_t cu[16], klen[16];
    cu[0] = 0;
    int maxlen = 0;
    for (int s = 0; s < n_seq; s++) {
        cu[s + 1] = cu[s] + lens[s], klen[s] = lens[s];
        if (lens[s] > maxlen) maxlen = lens[s];
    }
    int T = cu[n_seq];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, nl = (size_t)T * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    float *out = fconst(nq, NAN), *lse = fconst(nl, NAN);
    double *q_d = dcopy(q, nq), *k_d = dcopy(k, nk), *v_d = dcopy(v, nk);
    double *out_d = xmalloc(sizeof(double) * nq), *lse_d = xmalloc(sizeof(double) * nl);
    run_attention_forward(K, out, lse, q, k, v, cu, cu, klen, n_seq, T, H, KVH, D);
    ref_attention(out_d, lse_d, q_d, k_d, v_d, cu, cu, klen, n_seq, H, KVH, D);
    snprintf(what, sizeof what, "attention_forward out n_seq=%d T=%d H=%d KVH=%d D=%d", n_seq,
             T, H, KVH, D);
    check_arr(what, out, out_d, nq, tol_red(D + maxlen));
    snprintf(what, sizeof what, "attention_forward lse n_seq=%d T=%d H=%d KVH=%d", n_seq, T, H,
             KVH);
    check_arr(what, lse, lse_d, nl, tol_red(D + maxlen));
    float *out2 = fconst(nq, NAN);
    run_attention_forward(K, out2, NULL, q, k, v, cu, cu, klen, n_seq, T, H, KVH, D);
    snprintf(what, sizeof what, "attention_forward with lse=NULL H=%d KVH=%d", H, KVH);
    check_arr(what, out2, out_d, nq, tol_red(D + maxlen));

    /* dq, dk, dv pre-filled with junk: all three are overwritten */
    float *dout = fnormal(nq, 1.0f), *dq = fconst(nq, 1e3f), *dk = fconst(nk, 1e3f);
    float *dv = fconst(nk, 1e3f);
    double *dout_d = dcopy(dout, nq);
    run_attention_backward(K, dq, dk, dv, dout, q, k, v, out, lse, cu, n_seq, T, H, KVH, D);
    att_ctx ctx = {q_d, k_d, v_d, dout_d, cu, cu, klen, n_seq, H, KVH, D};
    snprintf(what, sizeof what, "attention_backward dq n_seq=%d T=%d H=%d KVH=%d", n_seq, T, H,
             KVH);
    check_fd(what, att_loss, &ctx, q_d, nq, dq, NULL);
    snprintf(what, sizeof what, "attention_backward dk n_seq=%d T=%d H=%d KVH=%d", n_seq, T, H,
             KVH);
    check_fd(what, att_loss, &ctx, k_d, nk, dk, NULL);
    snprintf(what, sizeof what, "attention_backward dv n_seq=%d T=%d H=%d KVH=%d", n_seq, T, H,
             KVH);
    check_fd(what, att_loss, &ctx, v_d, nk, dv, NULL);

    if (n_seq > 1) check_packing(K, q, k, v, out, lse, dout, dq, dk, dv, cu, n_seq, H, KVH, D);
    free(q), free(k), free(v), free(out), free(lse), free(q_d), free(k_d), free(v_d);
    free(out_d), free(lse_d), free(out2), free(dout), free(dq), free(dk), free(dv), free(dout_d);
}

/* KV-cache layout: queries are the last q_len of k_len positions, keys live at k_start in a
 * bigger buffer. Rows of k and v outside every sequence's window hold NaN: the op must not
 * read them (they are another sequence's cache, or never written). */
static void test_attention_kvcache(const rf_kernels *K, const int *q_lens, const int32_t *k_start,
                                   const int32_t *k_len, int n_seq, int rows, int H, int KVH,
                                   int D) {
    char what[160];
    int32_t q_off[16];
    q_off[0] = 0;
    int maxk = 0;
    for (int s = 0; s < n_seq; s++) {
        q_off[s + 1] = q_off[s] + q_lens[s];
        if (k_len[s] > maxk) maxk = k_len[s];
    }
    int Tq = q_off[n_seq];
    size_t nq = (size_t)Tq * H * D, nk = (size_t)rows * KVH * D, nl = (size_t)Tq * H;
    float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
    for (int r = 0; r < rows; r++) {
        int used = 0;
        for (int s = 0; s < n_seq; s++) used |= r >= k_start[s] && r < k_start[s] + k_len[s];
        if (used) continue;
        for (int i = 0; i < KVH * D; i++) k[(size_t)r * KVH * D + i] = v[(size_t)r * KVH * D + i] = NAN;
    }
    float *out = fconst(nq, NAN), *lse = fconst(nl, NAN);
    double *q_d = dcopy(q, nq), *k_d = dcopy(k, nk), *v_d = dcopy(v, nk);
    double *out_d = xmalloc(sizeof(double) * nq), *lse_d = xmalloc(sizeof(double) * nl);
    run_attention_forward(K, out, lse, q, k, v, q_off, k_start, k_len, n_seq, rows, H, KVH, D);
    ref_attention(out_d, lse_d, q_d, k_d, v_d, q_off, k_start, k_len, n_seq, H, KVH, D);
    snprintf(what, sizeof what, "attention_forward KV cache out n_seq=%d H=%d KVH=%d", n_seq, H,
             KVH);
    check_arr(what, out, out_d, nq, tol_red(D + maxk));
    snprintf(what, sizeof what, "attention_forward KV cache lse n_seq=%d H=%d KVH=%d", n_seq, H,
             KVH);
    check_arr(what, lse, lse_d, nl, tol_red(D + maxk));
    free(q), free(k), free(v), free(out), free(lse), free(q_d), free(k_d), free(v_d);
    free(out_d), free(lse_d);
}

static void test_attention(const rf_kernels *K) {
    static const int lens3[3] = {1, 5, 9}, lens1[1] = {7}, one[1] = {1};
    test_attention_train(K, lens3, 3, 4, 2, 8); /* GQA, 2 query heads per KV head */
    test_attention_train(K, lens3, 3, 4, 4, 8); /* MHA */
    test_attention_train(K, lens3, 3, 4, 1, 8); /* MQA */
    test_attention_train(K, lens1, 1, 4, 2, 8); /* n_seq = 1 */
    test_attention_train(K, one, 1, 2, 1, 8);   /* T = 1 */

    /* three sequences: a decode step (1 query, 4 keys), a prefill (k_len = q_len), a chunk
     * of 2 new queries after 5 cached keys; windows [2,6), [8,11), [12,19) of 20 rows */
    static const int q_lens[3] = {1, 3, 2};
    static const int32_t k_start[3] = {2, 8, 12}, k_len[3] = {4, 3, 7};
    test_attention_kvcache(K, q_lens, k_start, k_len, 3, 20, 4, 2, 8);
    test_attention_kvcache(K, q_lens, k_start, k_len, 3, 20, 4, 4, 8);
    static const int dec_q[1] = {1};
    static const int32_t dec_start[1] = {3}, dec_len[1] = {6};
    test_attention_kvcache(K, dec_q, dec_start, dec_len, 1, 10, 4, 2, 8); /* n_seq = 1 decode */

    /* Sequences long enough for the CPU's blocked path (RF_ATT_GEMM_MIN_Q = 16 query rows and
     * up, blocks of RF_ATT_QB = 64): 150 rows = three blocks, the last partial, beside a short
     * one on the row path; small H and D keep the finite differences affordable. */
    static const int lens_long[3] = {20, 3, 150};
    test_attention_train(K, lens_long, 3, 2, 1, 4);
    /* a 70-row chunk after 60 cached keys (k_len 130: blocks see 60 keys more than their rows),
     * a 17-row prefill, a decode row */
    static const int lq[3] = {70, 17, 1};
    static const int32_t lk_start[3] = {5, 140, 160}, lk_len[3] = {130, 17, 9};
    test_attention_kvcache(K, lq, lk_start, lk_len, 3, 170, 4, 2, 8);
}

/* ------------------------------------------------------------------ swiglu */

typedef struct {
    const double *gate, *up, *dout;
    size_t n;
} swi_ctx;

static double swi_loss(const void *p) {
    const swi_ctx *c = p;
    double *out = xmalloc(sizeof(double) * c->n);
    ref_swiglu(out, c->gate, c->up, c->n);
    double L = wsum(c->dout, out, c->n);
    free(out);
    return L;
}

static void test_swiglu(const rf_kernels *K) {
    size_t n = 1001;
    float *gate = fnormal(n, 3.0f), *up = fnormal(n, 1.0f), *out = fconst(n, NAN);
    double *g_d = dcopy(gate, n), *u_d = dcopy(up, n), *out_d = xmalloc(sizeof(double) * n);
    run_swiglu_forward(K, out, gate, up, n);
    ref_swiglu(out_d, g_d, u_d, n);
    check_arr("swiglu_forward", out, out_d, n, TOL_ELEM);

    float *dout = fnormal(n, 1.0f), *dg = fconst(n, 1e3f), *du = fconst(n, 1e3f);
    double *dout_d = dcopy(dout, n);
    run_swiglu_backward(K, dg, du, dout, gate, up, n);
    swi_ctx ctx = {g_d, u_d, dout_d, n};
    check_fd("swiglu_backward dgate (overwrite)", swi_loss, &ctx, g_d, n, dg, NULL);
    check_fd("swiglu_backward dup (overwrite)", swi_loss, &ctx, u_d, n, du, NULL);
    free(gate), free(up), free(out), free(g_d), free(u_d), free(out_d), free(dout), free(dg);
    free(du), free(dout_d);
}

/* ------------------------------------------------------------------ logprob */

typedef struct {
    const double *h, *w, *dlogp, *dent; /* dent NULL = entropy not in the loss */
    const int32_t *targets;
    int T, C, V;
    double inv_temp;
} lp_ctx;

static double lp_loss(const void *p) {
    const lp_ctx *c = p;
    double *logp = xmalloc(sizeof(double) * c->T), *ent = xmalloc(sizeof(double) * c->T);
    ref_logprob(logp, c->dent ? ent : NULL, c->h, c->w, c->targets, c->T, c->C, c->V,
                c->inv_temp);
    double L = wsum(c->dlogp, logp, c->T) + (c->dent ? wsum(c->dent, ent, c->T) : 0.0);
    free(logp), free(ent);
    return L;
}

static void test_logprob_case(const rf_kernels *K, int T, int C, int V, float inv_temp) {
    char what[160];
    size_t nh = (size_t)T * C, nw = (size_t)V * C;
    float *h = fnormal(nh, 1.0f), *w = fnormal(nw, 0.5f);
    int32_t *targets = xmalloc(IB(T));
    for (int t = 0; t < T; t++) targets[t] = (int32_t)(rf_rng_u64(&g_rng) % (uint64_t)V);
    targets[0] = V - 1; /* the last vocabulary row, past the last full chunk */
    if (T > 1) targets[T - 1] = 0;
    float *logp = fconst(T, NAN), *ent = fconst(T, NAN), *logp2 = fconst(T, NAN);
    double *h_d = dcopy(h, nh), *w_d = dcopy(w, nw);
    double *logp_d = xmalloc(sizeof(double) * T), *ent_d = xmalloc(sizeof(double) * T);
    run_logprob_forward(K, logp, ent, h, w, targets, T, C, V, inv_temp);
    ref_logprob(logp_d, ent_d, h_d, w_d, targets, T, C, V, (double)inv_temp);
    snprintf(what, sizeof what, "logprob_forward logp T=%d C=%d V=%d inv_temp=%g", T, C, V,
             inv_temp);
    check_arr(what, logp, logp_d, T, tol_red(C + V));
    snprintf(what, sizeof what, "logprob_forward entropy T=%d C=%d V=%d inv_temp=%g", T, C, V,
             inv_temp);
    check_arr(what, ent, ent_d, T, tol_red(C + V));
    run_logprob_forward(K, logp2, NULL, h, w, targets, T, C, V, inv_temp);
    snprintf(what, sizeof what, "logprob_forward with entropy=NULL T=%d V=%d", T, V);
    check_arr(what, logp2, logp_d, T, tol_red(C + V));

    /* dh pre-filled with junk (overwritten), dw pre-filled (accumulates); both upstream
     * gradients non-zero, then dentropy = NULL */
    float *dlogp = fnormal(T, 1.0f), *dent = fnormal(T, 1.0f), *dh = fconst(nh, 1e3f);
    float *dw0 = fnormal(nw, 1.0f), *dw = fcopy(dw0, nw);
    double *dlogp_d = dcopy(dlogp, T), *dent_d = dcopy(dent, T);
    for (int pass = 0; pass < 2; pass++) {
        const float *de = pass == 0 ? dent : NULL;
        for (size_t i = 0; i < nh; i++) dh[i] = 1e3f;
        memcpy(dw, dw0, FB(nw));
        run_logprob_backward(K, dh, dw, dlogp, de, h, w, targets, T, C, V, inv_temp);
        lp_ctx ctx = {h_d, w_d, dlogp_d, de ? dent_d : NULL, targets, T, C, V, (double)inv_temp};
        snprintf(what, sizeof what, "logprob_backward dh (overwrite) T=%d V=%d inv_temp=%g%s",
                 T, V, inv_temp, de ? "" : " dentropy=NULL");
        check_fd(what, lp_loss, &ctx, h_d, nh, dh, NULL);
        snprintf(what, sizeof what, "logprob_backward dw (+=) T=%d V=%d inv_temp=%g%s", T, V,
                 inv_temp, de ? "" : " dentropy=NULL");
        check_fd(what, lp_loss, &ctx, w_d, nw, dw, dw0);
    }
    free(h), free(w), free(targets), free(logp), free(ent), free(logp2), free(h_d), free(w_d);
    free(logp_d), free(ent_d), free(dlogp), free(dent), free(dh), free(dw0), free(dw);
    free(dlogp_d), free(dent_d);
}

/* A backward after a forward whose inputs then changed in place (same pointers: h's bits, or
 * w's with weights_updated as kernels.h asks) is the gradient at the new inputs, not at the
 * forward's (a back end may keep the forward's logits for the backward: the CPU's does); and
 * with unchanged inputs, the gradient of the forward's inputs whether or not a forward ran
 * just before. Finite differences of the double reference at the inputs the backward saw. */
static void test_logprob_after_forward(const rf_kernels *K) {
    enum { T = 9, C = 16, V = 300 };
    const float inv_temp = 0.9f;
    size_t nh = (size_t)T * C, nw = (size_t)V * C;
    float *h = fnormal(nh, 1.0f), *w = fnormal(nw, 0.5f), *dlogp = fnormal(T, 1.0f);
    float *dh = fconst(nh, NAN), *dw = fconst(nw, 0.0f), *lp = fconst(T, NAN);
    int32_t targets[T];
    for (int t = 0; t < T; t++) targets[t] = (int32_t)((t * 37 + 5) % V);
    float *d_h = put(K, h, FB(nh)), *d_w = put(K, w, FB(nw)), *d_dlp = put(K, dlogp, FB(T));
    float *d_dh = put(K, dh, FB(nh)), *d_dw = put(K, dw, FB(nw)), *d_lp = put(K, lp, FB(T));
    int32_t *d_tg = put(K, targets, IB(T));
    double *dlogp_d = dcopy(dlogp, T);
    for (int change = 0; change < 3; change++) { /* 0 nothing, 1 h, 2 w */
        K->logprob_forward(d_lp, NULL, d_h, d_w, d_tg, T, C, V, inv_temp);
        if (change == 1) for (int c = 0; c < C; c++) h[3 * C + c] += 0.5f;
        if (change == 2) for (size_t i = 0; i < nw; i++) w[i] *= 1.5f;
        K->to_device(d_h, h, FB(nh));
        K->to_device(d_w, w, FB(nw));
        if (change == 2) K->weights_updated();
        K->to_device(d_dw, dw, FB(nw)); /* dw stays zero on the host */
        K->logprob_backward(d_dh, d_dw, d_dlp, NULL, d_h, d_w, d_tg, T, C, V, inv_temp);
        float *gh = fconst(nh, NAN), *gw = fconst(nw, NAN);
        K->to_host(gh, d_dh, FB(nh));
        K->to_host(gw, d_dw, FB(nw));
        double *h_d = dcopy(h, nh), *w_d = dcopy(w, nw);
        lp_ctx ctx = {h_d, w_d, dlogp_d, NULL, targets, T, C, V, (double)inv_temp};
        static const char *what[3] = {"unchanged", "h changed in place", "w changed in place"};
        char msg[128];
        snprintf(msg, sizeof msg, "logprob_backward after a forward, %s: dh", what[change]);
        check_fd(msg, lp_loss, &ctx, h_d, nh, gh, NULL);
        snprintf(msg, sizeof msg, "logprob_backward after a forward, %s: dw", what[change]);
        check_fd(msg, lp_loss, &ctx, w_d, nw, gw, dw);
        free(gh), free(gw), free(h_d), free(w_d);
    }
    get(K, NULL, d_h, 0), get(K, NULL, d_w, 0), get(K, NULL, d_dlp, 0), get(K, NULL, d_dh, 0);
    get(K, NULL, d_dw, 0), get(K, NULL, d_lp, 0), get(K, NULL, d_tg, 0);
    free(h), free(w), free(dlogp), free(dh), free(dw), free(lp), free(dlogp_d);
}

static void test_logprob(const rf_kernels *K) {
    test_logprob_after_forward(K);
    test_logprob_case(K, 7, 16, 300, 1.0f); /* V not a multiple of RF_LOGPROB_CHUNK */
    test_logprob_case(K, 7, 16, 300, 0.7f);
    test_logprob_case(K, 1, 16, 300, 0.7f); /* T = 1 */
    /* T past one chunk of rows, with a partial last chunk */
    test_logprob_case(K, RF_LOGPROB_CHUNK + 5, 8, 37, 0.7f);
}

/* ------------------------------------------------------------------ adamw */

/* Three steps from m = v = 0 against PyTorch's AdamW in double (tests/kernel_ref.h), fed the
 * fp32 hyper-parameters the op receives and the gradient times clip (the op's grad_scale: the
 * clipping factor it folds in). Each fp32 step is a few roundings: TOL_ELEM. */
static void test_adamw_case(const rf_kernels *K, float lr, float b1, float b2, float eps,
                            float wd, float gscale, float clip) {
    char what[160];
    size_t n = 257;
    float *p = fnormal(n, 1.0f), *m = fnew(n), *v = fnew(n);
    double *p_d = dcopy(p, n), *m_d = dcopy(m, n), *v_d = dcopy(v, n);
    for (int step = 1; step <= 3; step++) {
        float *g = fnormal(n, gscale);
        double *g_d = dcopy(g, n);
        for (size_t i = 0; i < n; i++) g_d[i] *= clip;
        run_adamw(K, p, g, m, v, n, lr, b1, b2, eps, wd, step, clip);
        ref_adamw(p_d, g_d, m_d, v_d, n, lr, b1, b2, eps, wd, step);
        snprintf(what, sizeof what, "adamw param step %d lr=%g wd=%g eps=%g", step, lr, wd, eps);
        check_arr(what, p, p_d, n, TOL_ELEM);
        snprintf(what, sizeof what, "adamw m step %d", step);
        check_arr(what, m, m_d, n, TOL_ELEM);
        snprintf(what, sizeof what, "adamw v step %d", step);
        check_arr(what, v, v_d, n, TOL_ELEM);
        free(g), free(g_d);
    }
    free(p), free(m), free(v), free(p_d), free(m_d), free(v_d);
}

/* One step over 100003 elements (the threaded, vectorised pass and its remainder) with clipping
 * folded in, against the double reference; TOL_ELEM as above. */
static void test_adamw_long(const rf_kernels *K) {
    size_t n = 100003;
    float *p = fnormal(n, 1.0f), *m = fnormal(n, 0.1f), *v = fnew(n), *g = fnormal(n, 1.0f);
    for (size_t i = 0; i < n; i++) v[i] = 0.01f + 0.001f * (float)(i % 7);
    double *p_d = dcopy(p, n), *m_d = dcopy(m, n), *v_d = dcopy(v, n), *g_d = dcopy(g, n);
    for (size_t i = 0; i < n; i++) g_d[i] *= 0.5;
    run_adamw(K, p, g, m, v, n, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.01f, 7, 0.5f);
    ref_adamw(p_d, g_d, m_d, v_d, n, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.01f, 7);
    check_arr("adamw long param (clip 0.5)", p, p_d, n, TOL_ELEM);
    check_arr("adamw long m", m, m_d, n, TOL_ELEM);
    check_arr("adamw long v", v, v_d, n, TOL_ELEM);
    free(p), free(m), free(v), free(g), free(p_d), free(m_d), free(v_d), free(g_d);
}

static void test_adamw(const rf_kernels *K) {
    test_adamw_case(K, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f, 1.0f);
    /* small gradients and a large eps, so that eps's place in the formula shows */
    test_adamw_case(K, 1e-3f, 0.8f, 0.95f, 1e-3f, 0.0f, 1e-2f, 1.0f);
    /* clipping folded in: the update sees grad * 0.37 */
    test_adamw_case(K, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f, 0.37f);
    /* a vector long enough for the threaded pass (more than one OpenMP chunk) */
    test_adamw_long(K);
}

/* ------------------------------------------------------------------ fused ops */

/* add_rmsnorm_forward gives the same bits as add_inplace then rmsnorm_forward on the same back
 * end: x, out and rstd. */
static void test_add_rmsnorm_case(const rf_kernels *K, int N, int C) {
    char what[128];
    size_t n = (size_t)N * C;
    float *x = fnormal(n, 1.0f), *add = fnormal(n, 0.7f), *w = fnormal(C, 0.3f);
    float *x1 = fcopy(x, n), *out1 = fconst(n, NAN), *r1 = fconst(N, NAN);
    float *x2 = fcopy(x, n), *out2 = fconst(n, NAN), *r2 = fconst(N, NAN);
    float *d_x = put(K, x1, FB(n)), *d_add = put(K, add, FB(n)), *d_w = put(K, w, FB(C));
    float *d_out = put(K, out1, FB(n)), *d_r = put(K, r1, FB(N));
    K->add_inplace(d_x, d_add, n);
    K->rmsnorm_forward(d_out, d_r, d_x, d_w, N, C, 1e-6f);
    get(K, x1, d_x, FB(n)), get(K, out1, d_out, FB(n)), get(K, r1, d_r, FB(N));
    d_x = put(K, x2, FB(n)), d_out = put(K, out2, FB(n)), d_r = put(K, r2, FB(N));
    K->add_rmsnorm_forward(d_x, d_out, d_r, d_add, d_w, N, C, 1e-6f);
    get(K, x2, d_x, FB(n)), get(K, out2, d_out, FB(n)), get(K, r2, d_r, FB(N));
    get(K, NULL, d_add, 0), get(K, NULL, d_w, 0);
    snprintf(what, sizeof what, "add_rmsnorm_forward x == add_inplace's, N=%d C=%d", N, C);
    check_exact(what, x2, x1, n);
    snprintf(what, sizeof what, "add_rmsnorm_forward out == rmsnorm_forward's after add_inplace, N=%d C=%d", N, C);
    check_exact(what, out2, out1, n);
    snprintf(what, sizeof what, "add_rmsnorm_forward rstd == rmsnorm_forward's, N=%d C=%d", N, C);
    check_exact(what, r2, r1, N);
    float *ref_x = fcopy(x, n); /* x + add, one IEEE addition each */
    for (size_t i = 0; i < n; i++) ref_x[i] += add[i];
    snprintf(what, sizeof what, "add_rmsnorm_forward x += add N=%d C=%d", N, C);
    check_exact(what, x2, ref_x, n);
    free(x), free(add), free(w), free(x1), free(out1), free(r1), free(x2), free(out2), free(r2), free(ref_x);
}

/* rope_qk gives the same bits as rope on q then rope on k, both signs. */
static void test_rope_qk_case(const rf_kernels *K, int T, int H, int KVH, int D) {
    char what[128];
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D;
    float *inv_freq = xmalloc(FB(D / 2));
    rope_inv_freq(inv_freq, D, 1e6);
    int32_t *pos = xmalloc(IB(T));
    for (int t = 0; t < T; t++) pos[t] = (t * 37) % 301;
    for (int sign = 1; sign >= -1; sign -= 2) {
        float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *q1 = fcopy(q, nq), *k1 = fcopy(k, nk);
        run_rope(K, q1, pos, inv_freq, T, H, D, sign);
        run_rope(K, k1, pos, inv_freq, T, KVH, D, sign);
        float *d_q = put(K, q, FB(nq)), *d_k = put(K, k, FB(nk)), *d_f = put(K, inv_freq, FB(D / 2));
        int32_t *d_pos = put(K, pos, IB(T));
        K->rope_qk(d_q, d_k, d_pos, d_f, T, H, KVH, D, sign);
        get(K, q, d_q, FB(nq)), get(K, k, d_k, FB(nk)), get(K, NULL, d_f, 0), get(K, NULL, d_pos, 0);
        snprintf(what, sizeof what, "rope_qk q == rope's, T=%d H=%d KVH=%d D=%d sign=%d", T, H, KVH, D, sign);
        check_exact(what, q, q1, nq);
        snprintf(what, sizeof what, "rope_qk k == rope's, T=%d H=%d KVH=%d D=%d sign=%d", T, H, KVH, D, sign);
        check_exact(what, k, k1, nk);
        free(q), free(k), free(q1), free(k1);
    }
    free(inv_freq), free(pos);
}

static void test_fused(const rf_kernels *K) {
    test_add_rmsnorm_case(K, 3, 7);
    test_add_rmsnorm_case(K, 70, 896); /* above the CPU's threading threshold */
    test_rope_qk_case(K, 5, 4, 2, 8);
    test_rope_qk_case(K, 70, 14, 2, 64); /* Qwen2.5-0.5B's heads, threaded */
    test_rope_qk_case(K, 2, 2, 1, 1026); /* half > 512: the CPU's per-pair path */
}

/* ------------------------------------------------------------------ sampling */

/* sample_rows against a double reference: lse and the cumulative probabilities in id order in
 * double. A sampled pick p must have positive probability and hold u: cum(p - 1) <= u < cum(p),
 * each side widened by 1e-6 (the back ends sum weights computed in float, 6e-8 relative each,
 * over up to 151936 ids); logp within 1e-5. Greedy: the largest logit, lowest id among equal
 * ones, exactly. row_lse: logp is rf_logprob_given_lse of the pick's logit and the row's
 * row_lse, bit for bit (what a draw on the host from a copy of the row reports). */
static void test_sample_case(const rf_kernels *K, int rows, int V, int n, float scale) {
    char what[160];
    float *z = fnormal((size_t)rows * V, scale);
    if (V > 3) z[(size_t)(rows - 1) * V + 1] = z[(size_t)(rows - 1) * V + 3] = 50.0f; /* a tie */
    if (V > 2) z[2] = -INFINITY;                                                  /* a masked id */
    if (V > 4) z[V - 1] = -1e30f; /* the last id of row 0: probability 0, never a pick */
    rf_row_draw *d = xmalloc(sizeof *d * (size_t)n);
    for (int i = 0; i < n; i++) {
        int greedy = i % 4 == 3;
        float temp = i % 3 == 0 ? 1.0f : i % 3 == 1 ? 0.7f : 1.6f;
        /* u at both ends: 0, the largest float uniform (rf_rng_uniform) and a double closer to 1 */
        double u = i == 0 ? 0.0 : i == 1 ? 1.0 - 0x1p-24 : i == 2 ? 1.0 - 1e-12 : (double)rf_rng_uniform(&g_rng);
        int row = i == 1 || i == 2 ? 0 : i % 5 == 4 ? rows - 1 : (int)(rf_rng_u64(&g_rng) % (uint64_t)rows);
        d[i] = (rf_row_draw){(int32_t)row, greedy, greedy ? 1.0f : 1.0f / temp, 0.0f, greedy ? 0.0 : u};
    }
    int32_t *picks = xmalloc(IB(n));
    float *logp = fconst(n, NAN);
    float *d_z = put(K, z, FB((size_t)rows * V));
    K->sample_rows(picks, logp, d_z, V, d, n);
    float *rlse = fconst(n, NAN);
    K->row_lse(rlse, d_z, V, d, n);
    get(K, NULL, d_z, 0);
    int bad = 0, bad_lse = 0;
    for (int i = 0; i < n; i++) {
        const float *zr = z + (size_t)d[i].row * V;
        double it = d[i].inv_temp, mx = -INFINITY, sum = 0;
        for (int j = 0; j < V; j++) mx = zr[j] > mx ? zr[j] : mx;
        for (int j = 0; j < V; j++) sum += exp(((double)zr[j] - mx) * it);
        double lse = mx * it + log(sum);
        int want = 0, ok;
        if (d[i].greedy) {
            for (int j = 1; j < V; j++)
                if (zr[j] > zr[want]) want = j;
            ok = picks[i] == want;
        } else {
            double before = 0, cum = 0;
            want = V - 1;
            for (int j = 0; j < V; j++) {
                cum += exp((double)zr[j] * it - lse);
                if (d[i].u < cum) {
                    want = j;
                    break;
                }
            }
            for (int j = 0; j < V && j < picks[i]; j++) before += exp((double)zr[j] * it - lse);
            double at = picks[i] >= 0 && picks[i] < V ? exp((double)zr[picks[i]] * it - lse) : NAN;
            ok = at > 0 && d[i].u >= before - 1e-6 && d[i].u < before + at + 1e-6;
        }
        double lp = picks[i] >= 0 && picks[i] < V ? (double)zr[picks[i]] * it - lse : NAN;
        ok = ok && fabs(logp[i] - lp) <= 1e-5 * (fabs(lp) > 1 ? fabs(lp) : 1);
        float via = ok ? rf_logprob_given_lse(zr[picks[i]], d[i].inv_temp, rlse[i]) : NAN;
        if (ok && memcmp(&via, &logp[i], sizeof via) != 0 && bad_lse++ < 3)
            fprintf(stderr, "[%s] row_lse V=%d draw %d: logp %a, from row_lse %a (lse %a)\n", g_be, V, i, logp[i], via,
                    rlse[i]);
        if (!ok && bad++ < 3)
            fprintf(stderr, "[%s] sample_rows V=%d draw %d (row %d, %s, inv_temp %g, u %.17g): pick %d logp %.9g, "
                            "want %d logp %.9g\n", g_be, V, i, d[i].row, d[i].greedy ? "greedy" : "sampled",
                    d[i].inv_temp, d[i].u, picks[i], logp[i], want, lp);
    }
    snprintf(what, sizeof what, "sample_rows rows=%d V=%d draws=%d", rows, V, n);
    if (bad) fprintf(stderr, "[%s] %s: %d of %d draws wrong\n", g_be, what, bad, n);
    CHECK(bad == 0 && bad_lse == 0);
    free(z), free(d), free(picks), free(logp), free(rlse);
}

/* Draws at the top of the CDF (u = 1 - 2^-24, the largest float uniform) from rows whose last
 * id has probability 0 (logit -1e30): on broad rows of 151936 ids, weights summed in float
 * rounding can end 1e-7 short of the total, and a walk that then fell through to the last id
 * drew a token of probability 0 (about 1 in 7 of these rows). Every pick must have positive
 * probability. */
static void test_sample_tail(const rf_kernels *K) {
    int rows = 32, V = 151936;
    float *z = fnew((size_t)rows * V);
    for (int r = 0; r < rows; r++) {
        float sc = 2.0f + 0.05f * (float)r;
        for (int j = 0; j < V; j++) z[(size_t)r * V + j] = sc * rf_rng_normal(&g_rng);
        z[(size_t)r * V + V - 1] = -1e30f;
    }
    rf_row_draw *d = xmalloc(sizeof *d * (size_t)rows);
    for (int r = 0; r < rows; r++) d[r] = (rf_row_draw){r, 0, 1.0f, 0.0f, 1.0 - 0x1p-24};
    int32_t *picks = xmalloc(IB(rows));
    float *logp = fnew(rows);
    float *d_z = put(K, z, FB((size_t)rows * V));
    K->sample_rows(picks, logp, d_z, V, d, rows);
    get(K, NULL, d_z, 0);
    int bad = 0;
    for (int r = 0; r < rows; r++) bad += picks[r] < 0 || picks[r] >= V - 1 || !(logp[r] > -1e9f);
    if (bad) fprintf(stderr, "[%s] sample_rows at u = 1 - 2^-24: %d of %d rows drew an id of probability 0\n", g_be, bad, rows);
    CHECK(bad == 0);
    free(z), free(d), free(picks), free(logp);
}

static void test_sample(const rf_kernels *K) {
    CHECK(K->sample_rows != NULL && K->row_lse != NULL);
    if (!K->sample_rows || !K->row_lse) return;
    test_sample_case(K, 1, 1, 3, 1.0f);        /* one id: every draw takes it */
    test_sample_case(K, 3, 7, 40, 2.0f);       /* fewer ids than a block's threads */
    test_sample_case(K, 6, 300, 200, 3.0f);    /* ids not a multiple of the threads */
    test_sample_case(K, 4, 16384, 64, 4.0f);   /* the bench's vocabulary */
    test_sample_case(K, 2, 151936, 16, 6.0f);  /* Qwen2.5's */
    /* u spread over the whole range on a small row: every id a pick somewhere */
    test_sample_case(K, 1, 5, 500, 0.5f);
    test_sample_tail(K);
}

/* ------------------------------------------------------------------ suite */

/* Runs every check on back end K with inputs drawn from `seed`. */
static void run_kernel_suite(const rf_kernels *K, uint64_t seed) {
    g_be = K->name ? K->name : "?";
    rf_rng_seed(&g_rng, seed);
    test_table(K);
    test_memory(K);
    test_lazy_alloc(K);
    test_elementwise(K);
    test_matmul(K);
    test_embedding(K);
    test_rmsnorm(K);
    test_rope(K);
    test_attention(K);
    test_swiglu(K);
    test_logprob(K);
    test_adamw(K);
    /* last, so that the cases above keep their random draws */
    test_embedding_masked(K);
    test_heads(K);
    test_fused(K);
    test_sample(K);
}

/* Packed sequences of the given lengths, the training layout: cu (n_seq + 1) the offsets,
 * kl (n_seq) the key counts (= the lengths). Returns the longest length. Used by the attention
 * tests below and by those that include this file (test_flash_ref, test_kernels_cuda). */
static inline int packed_lens(const int *lens, int n_seq, int32_t *cu, int32_t *kl) {
    int maxlen = 0;
    cu[0] = 0;
    for (int s = 0; s < n_seq; s++) {
        cu[s + 1] = cu[s] + lens[s], kl[s] = lens[s];
        maxlen = lens[s] > maxlen ? lens[s] : maxlen;
    }
    return maxlen;
}

/* The paged view of packed sequences (training layout cu, n_seq <= 16; k, v (T, KVH, D), q (T,
 * H, D)) that a generation engine would hold: each sequence's key rows scattered into a pool of
 * blocks of `bs` rows through a shuffled block table (`maxb` blocks a sequence), and as queries
 * the last chunk[s] rows of each sequence (1: a decoding step; more: a prefill chunk), so that
 * paged query row i sees exactly the keys training row src[i] sees. */
typedef struct {
    float *kp, *vp, *q;   /* pool (n_seq maxb bs, KVH, D) x2, queries (q_off[n_seq], H, D) */
    int32_t *bt, *src;    /* block table (n_seq, maxb); training row of each query row */
    int32_t q_off[17];
    size_t pool_rows;
} paged_view;

static paged_view paged_view_make(const float *q, const float *k, const float *v,
                                  const int32_t *cu, const int *chunk, int n_seq, int maxb,
                                  int bs, int H, int KVH, int D) {
    paged_view pv;
    int n_blocks = n_seq * maxb;
    size_t kr = (size_t)KVH * D, qr = (size_t)H * D;
    pv.pool_rows = (size_t)n_blocks * bs;
    pv.kp = fconst(pv.pool_rows * kr, 0.0f), pv.vp = fconst(pv.pool_rows * kr, 0.0f);
    pv.bt = malloc(sizeof(int32_t) * (size_t)n_blocks);
    for (int b = 0; b < n_blocks; b++) pv.bt[b] = (int32_t)(((size_t)b * 389 + 11) % (size_t)n_blocks);
    pv.q_off[0] = 0;
    for (int s = 0; s < n_seq; s++) pv.q_off[s + 1] = pv.q_off[s] + chunk[s];
    pv.q = fnew((size_t)pv.q_off[n_seq] * qr);
    pv.src = malloc(sizeof(int32_t) * (size_t)pv.q_off[n_seq]);
    for (int s = 0; s < n_seq; s++) {
        int len = cu[s + 1] - cu[s];
        for (int j = 0; j < len; j++) {
            size_t slot = (size_t)pv.bt[s * maxb + j / bs] * bs + j % bs;
            memcpy(pv.kp + slot * kr, k + (size_t)(cu[s] + j) * kr, sizeof(float) * kr);
            memcpy(pv.vp + slot * kr, v + (size_t)(cu[s] + j) * kr, sizeof(float) * kr);
        }
        for (int i = 0; i < chunk[s]; i++) {
            int t = pv.q_off[s] + i;
            pv.src[t] = cu[s] + len - chunk[s] + i;
            memcpy(pv.q + (size_t)t * qr, q + (size_t)pv.src[t] * qr, sizeof(float) * qr);
        }
    }
    return pv;
}

static void paged_view_free(paged_view *pv) {
    free(pv->kp), free(pv->vp), free(pv->q), free(pv->bt), free(pv->src);
}

/* Rows of `paged` (the view's query rows) that differ in any bit from the training rows they
 * copy, in `train` (T, H, D). */
static size_t paged_rows_differing(const paged_view *pv, int n_seq, const float *paged,
                                   const float *train, int H, int D) {
    size_t bad = 0, qr = (size_t)H * D;
    for (int t = 0; t < pv->q_off[n_seq]; t++)
        bad += memcmp(paged + (size_t)t * qr, train + (size_t)pv->src[t] * qr, sizeof(float) * qr) != 0;
    return bad;
}

#ifndef RF_TEST_KERNELS_NO_MAIN
/* The CPU forward gives every query row the same bits whatever runs beside it
 * (cpu_attention.c): training's rows (sequences packed, lse saved) against the same rows as
 * decoding steps and prefill chunks over a paged cache (shuffled block table), as decoding
 * steps through the dense KV-cache layout one position at a time, on one thread and on all;
 * and every row against the double-precision reference. In both precisions, and at bf16 under
 * RLFLOW_CPU_ATTENTION=bf16, where AMX runs the products on its tiles (cpu_attention_amx.c) with
 * bf16 operands, whose rows must agree as well; the double reference then reads q, k and v rounded to bf16 as the tiles do, and holds
 * the outputs to a bound of the probabilities' rounding to bf16. */
static void test_attention_rows_invariant(const rf_kernels *K, rf_precision prec, int att_mode) {
    CHECK(K->set_precision(prec) == RF_OK);
    int old_mode = rf_cpu_attention_mode(att_mode);
    int tiles = rf_cpu_attention_amx_forward();
    static const int lens[5] = {1, 17, 150, 300, 70};
    static const int heads[][3] = {{4, 2, 64}, {7, 1, 64}, {4, 4, 16}, {2, 1, 80}, {6, 2, 32}};
    for (size_t hc = 0; hc < sizeof heads / sizeof *heads; hc++) {
        int H = heads[hc][0], KVH = heads[hc][1], D = heads[hc][2], n_seq = 5;
        int32_t cu[6], kl[5];
        int maxlen = packed_lens(lens, n_seq, cu, kl), T = cu[n_seq];
        size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, qr = (size_t)H * D;
        float *q = fnormal(nq, 1.0f), *k = fnormal(nk, 1.0f), *v = fnormal(nk, 1.0f);
        float *out = fconst(nq, NAN), *lse = fconst((size_t)T * H, NAN), *out1 = fconst(nq, NAN);
        run_attention_forward(K, out, lse, q, k, v, cu, cu, kl, n_seq, T, H, KVH, D);
        double *q_d = dcopy(q, nq), *k_d = dcopy(k, nk), *v_d = dcopy(v, nk);
        if (tiles) /* the reference on the operands the tiles read */
            for (size_t i = 0; i < nq; i++) q_d[i] = rf_cpu_bf16_round(q[i]);
        for (size_t i = 0; tiles && i < nk; i++) k_d[i] = rf_cpu_bf16_round(k[i]), v_d[i] = rf_cpu_bf16_round(v[i]);
        double *out_d = xmalloc(sizeof(double) * nq), *lse_d = xmalloc(sizeof(double) * T * H);
        ref_attention(out_d, lse_d, q_d, k_d, v_d, cu, cu, kl, n_seq, H, KVH, D);
        char what[160];
        snprintf(what, sizeof what, "attention rows H=%d KVH=%d D=%d%s against double", H, KVH, D,
                 tiles ? " (bf16, AMX)" : "");
        if (tiles) {
            /* o = sum_j bf16(p_j) v_j / l: each p_j off by at most 2^-8 of itself (8 significant
             * bits), so o by at most 2^-8 sum_j p_j |v_j| / l (the reference over |v|); doubled */
            double *va = xmalloc(sizeof(double) * nk), *oa = xmalloc(sizeof(double) * nq);
            double *la = xmalloc(sizeof(double) * T * H);
            for (size_t i = 0; i < nk; i++) va[i] = fabs(v_d[i]);
            ref_attention(oa, la, q_d, k_d, va, cu, cu, kl, n_seq, H, KVH, D);
            size_t bad = 0, worst = 0;
            double worst_r = 0.0;
            for (size_t i = 0; i < nq; i++) {
                double r = fabs(out[i] - out_d[i]) / (ldexp(oa[i], -7) + tol_red(D + maxlen) * (fabs(out_d[i]) + 1e-2));
                bad += !(r <= 1.0);
                if (r > worst_r) worst_r = r, worst = i;
            }
            if (bad)
                fprintf(stderr, "%s: %zu of %zu outside the bound of the probabilities' rounding; worst [%zu] got %.9g "
                        "want %.9g (%.3g of the bound)\n", what, bad, nq, worst, out[worst], out_d[worst], worst_r);
            CHECK(bad == 0);
            free(va), free(oa), free(la);
        } else {
            check_arr(what, out, out_d, nq, tol_red(D + maxlen));
        }
        check_arr(what, lse, lse_d, (size_t)T * H, tol_red(D + maxlen));
        int threads = omp_get_max_threads();
        omp_set_num_threads(1);
        run_attention_forward(K, out1, NULL, q, k, v, cu, cu, kl, n_seq, T, H, KVH, D);
        omp_set_num_threads(threads);
        size_t bad_threads = memcmp(out1, out, FB(nq)) != 0;
        /* paged: decoding steps (1 query a sequence) and prefill chunks of 4 and 40 */
        static const int chunk_kinds[3] = {1, 4, 40};
        size_t bad_paged = 0, bad_dense = 0, bad_lse = 0;
        for (int ck = 0; ck < 3; ck++) {
            int chunk[5];
            for (int s = 0; s < n_seq; s++) chunk[s] = lens[s] < chunk_kinds[ck] ? lens[s] : chunk_kinds[ck];
            paged_view pv = paged_view_make(q, k, v, cu, chunk, n_seq, (maxlen + 7) / 8, 8, H, KVH, D);
            int Tq = pv.q_off[n_seq];
            float *po = fconst((size_t)Tq * qr, NAN);
            float *d_po = K->alloc(FB((size_t)Tq * qr)), *d_q = K->alloc(FB((size_t)Tq * qr));
            float *d_kp = K->alloc(FB(pv.pool_rows * KVH * D)), *d_vp = K->alloc(FB(pv.pool_rows * KVH * D));
            int32_t *d_qo = K->alloc(sizeof(int32_t) * (n_seq + 1)), *d_kl = K->alloc(sizeof(int32_t) * n_seq);
            int32_t *d_bt = K->alloc(sizeof(int32_t) * (size_t)n_seq * ((maxlen + 7) / 8));
            K->to_device(d_q, pv.q, FB((size_t)Tq * qr));
            K->to_device(d_kp, pv.kp, FB(pv.pool_rows * KVH * D));
            K->to_device(d_vp, pv.vp, FB(pv.pool_rows * KVH * D));
            K->to_device(d_qo, pv.q_off, sizeof(int32_t) * (n_seq + 1));
            K->to_device(d_kl, kl, sizeof(int32_t) * n_seq);
            K->to_device(d_bt, pv.bt, sizeof(int32_t) * (size_t)n_seq * ((maxlen + 7) / 8));
            K->paged_attention_forward(d_po, d_q, d_kp, d_vp, d_qo, d_bt, (maxlen + 7) / 8, d_kl, n_seq, 8, H, KVH, D);
            K->to_host(po, d_po, FB((size_t)Tq * qr));
            bad_paged += paged_rows_differing(&pv, n_seq, po, out, H, D);
            K->free(d_po), K->free(d_q), K->free(d_kp), K->free(d_vp), K->free(d_qo), K->free(d_kl), K->free(d_bt);
            free(po);
            paged_view_free(&pv);
        }
        /* dense KV cache: query row t of sequence s alone, its keys k_start = cu[s], k_len = i + 1 */
        float *o1 = fnew(qr), *l1 = fnew((size_t)H);
        for (int s = 0; s < n_seq; s++)
            for (int i = 0; i < lens[s]; i++) {
                int32_t qo[2] = {0, 1}, ks[1] = {cu[s]}, kn[1] = {i + 1};
                size_t t = (size_t)cu[s] + i;
                run_attention_forward(K, o1, l1, q + t * qr, k, v, qo, ks, kn, 1, T, H, KVH, D);
                bad_dense += memcmp(o1, out + t * qr, FB(qr)) != 0;
                bad_lse += memcmp(l1, lse + t * H, sizeof(float) * H) != 0;
            }
        if (bad_threads || bad_paged || bad_dense || bad_lse)
            fprintf(stderr, "attention rows H=%d KVH=%d D=%d precision %d: 1 thread differs %zu; paged rows differing %zu; "
                    "dense decoding rows %zu (lse %zu) of %d\n", H, KVH, D, (int)prec, bad_threads, bad_paged, bad_dense,
                    bad_lse, T);
        CHECK(bad_threads == 0 && bad_paged == 0 && bad_dense == 0 && bad_lse == 0);
        free(q), free(k), free(v), free(out), free(lse), free(out1), free(o1), free(l1);
        free(q_d), free(k_d), free(v_d), free(out_d), free(lse_d);
    }
    rf_cpu_attention_mode(old_mode);
}

/* The samplers' log-prob of a pick (kernels/sample.h rf_logits_logprob, over logits made by
 * matmul_forward, unscaled, as decoding makes them) is the log-prob logprob_forward gives the
 * same token (its product scales by inv_temp), bit for bit, at temperature 1 and 0.7 and in both
 * precisions, where the back end's products are batch-invariant; within 1e-5 elsewhere. */
static void test_sampler_logprob(const rf_kernels *K) {
    enum { T = 37, C = 64, V = 1000 };
    /* the weight in the back end's memory, freed through it: the products keep converted
     * copies of weights by address until the back end frees them (a malloc'd weight freed
     * behind its back would leave a stale copy for the next array at that address) */
    float *hh = fnormal((size_t)T * C, 1.0f), *wh = fnormal((size_t)V * C, 0.3f);
    float *h = put(K, hh, FB((size_t)T * C)), *w = put(K, wh, FB((size_t)V * C));
    float *z = fnew((size_t)T * V), lp[T];
    int32_t tg[T];
    for (int t = 0; t < T; t++) tg[t] = (int32_t)((t * 389 + 7) % V);
    for (int prec = 0; prec < 2; prec++) {
        rf_precision p = prec ? RF_PRECISION_BF16 : RF_PRECISION_FP32;
        CHECK(K->set_precision(p) == RF_OK);
        int exact = rf_cpu_batch_invariant_exact_at(p);
        K->matmul_forward(z, h, w, NULL, T, C, V);
        for (int ti = 0; ti < 2; ti++) {
            float it = ti ? 1.0f / 0.7f : 1.0f;
            K->logprob_forward(lp, NULL, h, w, tg, T, C, V, it);
            int differ = 0;
            double worst = 0;
            for (int t = 0; t < T; t++) {
                float s = rf_logits_logprob(z + (size_t)t * V, V, it, tg[t]);
                differ += memcmp(&s, &lp[t], sizeof s) != 0;
                worst = fabs((double)s - lp[t]) > worst ? fabs((double)s - lp[t]) : worst;
            }
            if (differ) fprintf(stderr, "sampler log-prob, precision %d, inv_temp %g: %d of %d differ (largest %.3g)\n",
                                prec, it, differ, T, worst);
            CHECK(exact ? differ == 0 : worst < 1e-5);
        }
    }
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
    get(K, NULL, h, 0), get(K, NULL, w, 0);
    free(hh), free(wh), free(z);
}

/* Batch-invariant products (kernels.h rf_cpu_batch_invariant_exact): where the CPU back end says
 * it is exact (oneDNN's AVX-512 kernels), every row of out = x W^T has the same bits in products
 * of 1 to 63 rows as among 64 (fp32 and bf16 operands) on decode shapes, the rows of 1-4-row
 * products too (oneDNN's, not the matrix-vector loops); where it is not (ONEDNN_MAX_CPU_ISA=AVX2,
 * or bf16 emulated on AVX512_CORE), products of up to 4 rows take the matrix-vector loops, whose
 * rows differ in the last bits from the same rows among more (some row must differ then). */
static void test_batch_invariant(const rf_kernels *K) {
    static const int shapes[][2] = {{64, 64}, {64, 1000}, {512, 1408}, {1408, 512}};
    for (int prec = 0; prec < 2; prec++) {
        CHECK(K->set_precision(prec ? RF_PRECISION_BF16 : RF_PRECISION_FP32) == RF_OK);
        for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
            int C = shapes[si][0], OC = shapes[si][1], MAXM = 64, differ = 0, differ_small = 0;
            float *x = xmalloc(FB((size_t)MAXM * C)), *w = xmalloc(FB((size_t)OC * C));
            float *ref = xmalloc(FB((size_t)MAXM * OC)), *out = xmalloc(FB((size_t)MAXM * OC));
            for (size_t i = 0; i < (size_t)MAXM * C; i++) x[i] = rf_rng_uniform(&g_rng) - 0.5f;
            for (size_t i = 0; i < (size_t)OC * C; i++) w[i] = 0.1f * (rf_rng_uniform(&g_rng) - 0.5f);
            K->matmul_forward(ref, x, w, NULL, MAXM, C, OC);
            for (int M = 1; M < MAXM; M++) {
                K->matmul_forward(out, x, w, NULL, M, C, OC);
                for (int r = 0; r < M; r++) {
                    int d = memcmp(out + (size_t)r * OC, ref + (size_t)r * OC, FB(OC)) != 0;
                    differ += d, differ_small += d && M <= 4;
                }
            }
            int exact = rf_cpu_batch_invariant_exact();
            /* on AMX, bf16 products of up to 64 rows on weights of 1 MB and more run on the own
             * tile kernel (cpu_amx.c), whose rows do not depend on the others */
            int own = prec && rf_cpu_isa_amx() && rf_cpu_amx_ready() &&
                      (size_t)OC * C * sizeof(uint16_t) >= RF_CPU_AMX_MIN_BYTES;
            printf("batch-invariant products (%s here), %s, C %d OC %d: rows of products of 1..63 rows unlike the same "
                   "rows of 64: %d (%d of them in products of 1-4 rows)\n", exact ? "exact" : own ? "own AMX kernel" : "not exact",
                   prec ? "bf16" : "fp32", C, OC, differ, differ_small);
            if (exact || own) CHECK(differ == 0);
            else CHECK(differ_small > 0); /* the matrix-vector loops */
            /* more rows, in row buckets of 64 (cpu_gemm.c bucket_rows) with an overlapping last
             * one: rows of 65, 130 and 199 against the same rows of 300; where not exact (AMX's
             * bf16 products) within the roundings of another order of the sum */
            enum { BIGM = 300 };
            float *xb = xmalloc(FB((size_t)BIGM * C)), *rb = xmalloc(FB((size_t)BIGM * OC)), *ob = xmalloc(FB((size_t)BIGM * OC));
            for (size_t i = 0; i < (size_t)BIGM * C; i++) xb[i] = rf_rng_uniform(&g_rng) - 0.5f;
            K->matmul_forward(rb, xb, w, NULL, BIGM, C, OC);
            int bdiffer = 0;
            double worst = 0, big = 0;
            static const int ms[] = {65, 130, 199};
            for (int mi = 0; mi < 3; mi++) {
                K->matmul_forward(ob, xb, w, NULL, ms[mi], C, OC);
                for (size_t i = 0; i < (size_t)ms[mi] * OC; i++) {
                    bdiffer += memcmp(ob + i, rb + i, sizeof(float)) != 0;
                    worst = fmax(worst, fabs((double)ob[i] - rb[i]));
                    big = fmax(big, fabs((double)rb[i]));
                }
            }
            if (bdiffer) printf("  rows of 65, 130, 199 against 300: %d values differ, largest by %.3g (values up to %.3g)\n",
                                bdiffer, worst, big);
            CHECK(exact ? bdiffer == 0 : worst <= 1e-5 * big);
            /* beta = 1 (the sum post-op), bucketed too: C + the product's rows, one fp32 add each */
            float *acc = xmalloc(FB((size_t)BIGM * OC));
            int sdiffer = 0;
            for (int mi = 0; mi < 3; mi++) {
                for (size_t i = 0; i < (size_t)ms[mi] * OC; i++) ob[i] = acc[i] = rf_rng_uniform(&g_rng) - 0.5f;
                rf_cpu_gemm(0, 1, ms[mi], OC, C, 1.0f, xb, C, w, C, 1.0f, ob, OC, 1);
                for (size_t i = 0; i < (size_t)ms[mi] * OC; i++) {
                    float want = rb[i] + acc[i];
                    sdiffer += memcmp(&want, ob + i, sizeof want) != 0;
                    worst = fmax(worst, fabs((double)ob[i] - want));
                }
            }
            if (sdiffer) printf("  with beta 1: %d values differ from C + the rows of 300, largest by %.3g\n", sdiffer, worst);
            CHECK(exact ? sdiffer == 0 : worst <= 1e-5 * big);
            free(acc);
            free(xb), free(rb), free(ob);
            free(x), free(w), free(ref), free(out);
        }
    }
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
}

/* The shape table (cpu_gemm.c entry_get) is thinned when three-quarters full (768 of 1024
 * slots): 1200 shapes (600 in fp32, 600 in bf16), each twice, every product against a double
 * reference (operands exact in bf16, so within 1e-4 in both). A thinned table that lost or
 * mixed up entries gives wrong values; a primitive freed while still in the table is a crash,
 * or a use after free the sanitizer build reports. */
static void test_many_shapes(const rf_kernels *K) {
    int bad = 0, runs = 0;
    for (int prec = 0; prec < 2; prec++) {
        CHECK(K->set_precision(prec ? RF_PRECISION_BF16 : RF_PRECISION_FP32) == RF_OK);
        for (int rep = 0; rep < 2; rep++)
            for (int N = 1; N <= 600; N++) {
                int M = N % 3 + 5, Kd = 8 + N % 5;
                float *a = xmalloc(FB((size_t)M * Kd)), *b = xmalloc(FB((size_t)Kd * N)), *c = xmalloc(FB((size_t)M * N));
                for (int i = 0; i < M * Kd; i++) a[i] = (float)(i % 7 - 3) * 0.25f;
                for (int i = 0; i < Kd * N; i++) b[i] = (float)(i % 5 - 2) * 0.5f;
                rf_cpu_gemm(0, 0, M, N, Kd, 1.0f, a, Kd, b, N, 0.0f, c, N, 0);
                for (int i = 0; i < M; i++)
                    for (int j = 0; j < N; j++) {
                        double want = 0;
                        for (int k = 0; k < Kd; k++) want += (double)a[i * Kd + k] * b[(size_t)k * N + j];
                        bad += fabs(want - c[(size_t)i * N + j]) > 1e-4;
                    }
                runs++;
                free(a), free(b), free(c);
            }
    }
    printf("many shapes: %d products, %d wrong values\n", runs, bad);
    CHECK(runs == 2400 && bad == 0);
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
}

/* One product of test_packed_weights: the packed operand's c1 against the plain one's c0. Bits
 * equal, counted in *differ; where loose (AMX's bf16 kernels, which block the sum of a plain
 * operand, copied into blocks inside the call, otherwise than of a packed one where K is large:
 * 1408 here) other roundings of the same sums are allowed, counted in *loose_differ, their
 * largest difference in *worst beside the largest value in *big. */
static void compare_packed(const float *c0, const float *c1, size_t n, int loose, int *differ, int *loose_differ,
                           double *worst, double *big) {
    if (memcmp(c0, c1, FB(n)) == 0) return;
    if (!loose) {
        (*differ)++;
        return;
    }
    (*loose_differ)++;
    for (size_t i = 0; i < n; i++) {
        *worst = fmax(*worst, fabs((double)c0[i] - c1[i]));
        *big = fmax(*big, fabs((double)c0[i]));
    }
}

/* Weights in oneDNN's own layout (cpu_gemm.c packed_get): a product whose B operand is a weight
 * read transposed (b_weight 1, the forward's x W^T) runs on a copy reordered once per epoch,
 * where the kernel has a blocked layout. The reorder permutes elements, so every product must
 * give the bits of the same product on the plain operand (b_weight 0): forward (B = W^T) and,
 * kept plain, dinp (B = W) shapes, odd sizes, alpha and
 * beta, fp32 and bf16, 5 to 300 rows. After rf_cpu_gemm_weights_updated the copy follows the new
 * weights; the bytes it holds are counted by rf_cpu_gemm_copies_bytes. */
static void test_packed_weights(const rf_kernels *K) {
    static const int shapes[][3] = {{300, 1, 1000}, {7, 300, 1000}, {32, 512, 1408}, {300, 1408, 512}, {5, 96, 4000}};
    int differ = 0, runs = 0, loose_differ = 0;
    double worst = 0, big = 0;
    for (int prec = 0; prec < 2; prec++) {
        CHECK(K->set_precision(prec ? RF_PRECISION_BF16 : RF_PRECISION_FP32) == RF_OK);
        int loose = prec && rf_cpu_bf16_native() && !rf_cpu_batch_invariant_exact_at(RF_PRECISION_BF16); /* AMX */
        for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
            int M = shapes[si][0], Kd = shapes[si][1], N = shapes[si][2];
            float *a = fnormal((size_t)M * Kd, 1.0f), *w = fnormal((size_t)N * Kd, 0.1f);
            float *c0 = fnormal((size_t)M * N, 1.0f), *c1 = xmalloc(FB((size_t)M * N));
            for (int tb = 0; tb < 2; tb++)
                for (int beta = 0; beta < 2; beta++) {
                    /* tb: B (K, N) = w^T, w (N, K); else B = w read as (K, N) */
                    int ldb = tb ? Kd : N;
                    memcpy(c1, c0, FB((size_t)M * N));
                    rf_cpu_gemm(0, tb, M, N, Kd, 0.5f, a, Kd, w, ldb, (float)beta, c0, N, 0);
                    size_t before = rf_cpu_gemm_copies_bytes();
                    rf_cpu_gemm(0, tb, M, N, Kd, 0.5f, a, Kd, w, ldb, (float)beta, c1, N, 1);
                    compare_packed(c0, c1, (size_t)M * N, loose, &differ, &loose_differ, &worst, &big), runs++;
                    if (prec == 0 && si == 2 && tb && !beta)
                        printf("packed weights: fp32 copies grew by %zu bytes for a (%d, %d) weight\n",
                               rf_cpu_gemm_copies_bytes() - before, N, Kd);
                    /* new values: the copy follows after weights_updated */
                    for (size_t i = 0; i < (size_t)N * Kd; i++) w[i] = -2.0f * w[i] + 0.01f;
                    rf_cpu_gemm_weights_updated();
                    memcpy(c1, c0, FB((size_t)M * N));
                    rf_cpu_gemm(0, tb, M, N, Kd, 0.5f, a, Kd, w, ldb, (float)beta, c0, N, 0);
                    rf_cpu_gemm(0, tb, M, N, Kd, 0.5f, a, Kd, w, ldb, (float)beta, c1, N, 1);
                    compare_packed(c0, c1, (size_t)M * N, loose, &differ, &loose_differ, &worst, &big), runs++;
                }
            /* as the back end's free does: the next weight malloc returns here must not find
             * this one's copies (same address, shape and epoch) */
            rf_cpu_gemm_forget(w, FB((size_t)N * Kd));
            free(a), free(w), free(c0), free(c1);
        }
    }
    printf("packed weights: %d of %d products differ from the plain operand's", differ + loose_differ, runs);
    printf(loose_differ ? " (%d of AMX's bf16 ones, by at most %.3g, values up to %.3g)\n" : "\n", loose_differ,
           worst, big);
    CHECK(runs >= 32 && differ == 0 && worst <= 1e-5 * big);
    CHECK(rf_cpu_gemm_copies_bytes() > 0); /* at least the bf16 copies */
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
}

/* Decoding's products on AMX (cpu_amx.c, rf_cpu_amx_gemm): bf16 products of 1-64 rows on
 * weights of 1 MB and more run on rlflow's own tile kernel where the CPU has AMX. Against
 * oneDNN's kernel on the same packed copy (rf_cpu_gemm_own_amx(0)): the same bits where oneDNN
 * does not split the sum (K up to 1408 with any N, Qwen2.5-0.5B's K = 4864 with N = 896; K and N
 * not multiples of its blocks: its zero padding), with beta 0, beta 1 and alpha 1 / 0.7 (the
 * LM head's inverse temperature). Where it does split (K 2048, N 4864) against a double
 * reference of the bf16-rounded operands; and there every row has the bits it has in a product
 * of 64 rows. The kernel's product counter
 * must move, or the comparisons compared oneDNN with itself (products of 1-4 rows, which went
 * to the matrix-vector loops before: test_batch_invariant). Without AMX: it must decline. */
/* rf_cpu_gemm_a16: a product given A's bf16 values has the bits of rf_cpu_gemm on the fp32 A they
 * were rounded from in bf16 mode (on those values widened in fp32 mode), on every path (read in place: the LM head backward's two
 * products; widened: fp32 mode, the matrix-vector loops, the own AMX kernel); read in place it
 * converts nothing (or a conversion would hide that it did not take the bf16 values). */
static void test_gemm_a16(const rf_kernels *K) {
    static const struct { int M, N, Kd, ta, tb, bw; float beta; } cs[] = {
        {300, 64, 1000, 0, 0, 1, 0.0f},  /* dz @ w */
        {1000, 64, 300, 1, 0, 0, 1.0f},  /* dw += dz^T h: K 300, padded on AMX into A's room */
        {2048, 96, 77, 1, 0, 0, 1.0f},
        {3, 96, 200, 0, 1, 1, 0.0f},     /* the matrix-vector loops where they run */
        {32, 1024, 640, 0, 1, 1, 0.0f},  /* a weight of 1.3 MB: the own AMX kernel where it runs */
        {70, 130, 50, 0, 1, 0, 1.0f},
    };
    for (int p = 0; p < 2; p++) {
        CHECK(K->set_precision(p ? RF_PRECISION_BF16 : RF_PRECISION_FP32) == RF_OK);
        int differ = 0, direct = 0, converted = 0;
        for (size_t i = 0; i < sizeof cs / sizeof *cs; i++) {
            int M = cs[i].M, N = cs[i].N, Kd = cs[i].Kd;
            int ar = cs[i].ta ? Kd : M, ac = cs[i].ta ? M : Kd;
            float *a = fnormal((size_t)ar * ac, 1.0f), *b = fnormal((size_t)Kd * N, 0.1f);
            float *c0 = fnormal((size_t)M * N, 1.0f), *c1 = fcopy(c0, (size_t)M * N);
            uint16_t *ab = xmalloc(sizeof(uint16_t) * (size_t)(ar + 63) / 64 * 64 * ac);
            for (int r = 0; r < ar; r++) rf_cpu_bf16_convert(ab + (size_t)r * ac, a + (size_t)r * ac, ac);
            if (!p) /* fp32: the product of the bf16 values themselves */
                for (size_t j = 0; j < (size_t)ar * ac; j++) a[j] = rf_cpu_bf16_round(a[j]);
            int ldb = cs[i].tb ? Kd : N;
            rf_cpu_gemm(cs[i].ta, cs[i].tb, M, N, Kd, 1.0f, a, ac, b, ldb, cs[i].beta, c0, N, cs[i].bw);
            size_t conv = rf_cpu_gemm_a_conversions();
            rf_cpu_gemm_a16(cs[i].ta, cs[i].tb, M, N, Kd, 1.0f, ab, ac, b, ldb, cs[i].beta, c1, N, cs[i].bw);
            if (p && rf_cpu_gemm_a16_direct() && i < 3) direct++, converted += rf_cpu_gemm_a_conversions() != conv;
            differ += memcmp(c0, c1, FB((size_t)M * N)) != 0;
            if (cs[i].bw) rf_cpu_gemm_forget(b, FB((size_t)Kd * N));
            free(a), free(b), free(c0), free(c1), free(ab);
        }
        printf("products of bf16 A (%s): %d of %zu differ from rf_cpu_gemm on its fp32 A; %d read in place, %d of "
               "those converted A\n", p ? "bf16" : "fp32", differ, sizeof cs / sizeof *cs, direct, converted);
        CHECK(differ == 0 && converted == 0);
        CHECK(!p || !rf_cpu_bf16_native() || direct == 3);
    }
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
}

/* rf_cpu_alloc_lines: whole lines from 64-byte boundaries, 2 MB ones from RF_CPU_HUGE_MIN bytes
 * (huge pages, where the kernel gives them, cover whole 2 MB ranges only), every byte usable. */
static void test_alloc_lines(void) {
    static const size_t sizes[] = {1, 100, 4096, (size_t)3 << 20, RF_CPU_HUGE_MIN - 1, RF_CPU_HUGE_MIN, (size_t)9 << 20};
    int bad = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        unsigned char *p = rf_cpu_alloc_lines(sizes[i]);
        size_t want = sizes[i] >= RF_CPU_HUGE_MIN ? RF_CPU_HUGE_ALIGN : 64;
        if (!p || (uintptr_t)p % want) { bad++; free(p); continue; }
        memset(p, 0xa5, sizes[i]);
        bad += p[0] != 0xa5 || p[sizes[i] - 1] != 0xa5;
        free(p);
    }
    CHECK(bad == 0);
}

/* rf_cpu_logprob_dlogits into bf16: the bf16 rounding of what it writes in place, z untouched. */
static void test_dlogits_bf16(void) {
    static const int Vs[] = {1, 15, 1000, 1024, 3001, 5000};
    int bad = 0;
    for (size_t vi = 0; vi < sizeof Vs / sizeof *Vs; vi++) {
        int V = Vs[vi], n = 7;
        float *z = fnormal((size_t)n * V, 3.0f), *z0 = fcopy(z, (size_t)n * V), *zf = fcopy(z, (size_t)n * V);
        float lse[7], ent[7], dl[7], de[7];
        int32_t tg[7];
        for (int r = 0; r < n; r++) {
            lse[r] = rf_row_lse(z + (size_t)r * V, V, 1.0f, &ent[r]);
            tg[r] = r == 3 ? -1 : (r * 977 + 5) % (V + 2); /* some outside [0, V) after v0 */
            dl[r] = 0.1f * (float)(r + 1), de[r] = -0.03f * (float)r;
        }
        uint16_t *zb = xmalloc(sizeof(uint16_t) * (size_t)64 * V), *want = xmalloc(sizeof(uint16_t) * (size_t)n * V);
        for (int v = 0; v < 3; v++) { /* both gradients, log-prob alone, entropy alone */
            const float *pl = v == 2 ? NULL : dl, *pe = v == 1 ? NULL : de;
            memcpy(zf, z0, FB((size_t)n * V));
            rf_cpu_logprob_dlogits(zf, NULL, n, V, lse, ent, tg, 1, pl, pe, 0.8f);
            for (int r = 0; r < n; r++) rf_cpu_bf16_convert(want + (size_t)r * V, zf + (size_t)r * V, V);
            rf_cpu_logprob_dlogits(z, zb, n, V, lse, ent, tg, 1, pl, pe, 0.8f);
            bad += memcmp(zb, want, sizeof(uint16_t) * (size_t)n * V) != 0 || memcmp(z, z0, FB((size_t)n * V)) != 0;
        }
        free(z), free(z0), free(zf), free(zb), free(want);
    }
    printf("logit gradients as bf16: %d of %zu vocabularies differ from the rounded fp32 ones\n", bad, 3 * sizeof Vs / sizeof *Vs);
    CHECK(bad == 0);
}

static void test_own_amx(const rf_kernels *K) {
    CHECK(K->set_precision(RF_PRECISION_BF16) == RF_OK);
    if (!rf_cpu_isa_amx() || !rf_cpu_amx_ready()) { /* a product it would take: oneDNN's here */
        enum { M = 32, KD = 896, N = 1200 };
        float *a = fnormal((size_t)M * KD, 1.0f), *w = fnormal((size_t)N * KD, 0.1f), *c = xmalloc(FB((size_t)M * N));
        size_t before = rf_cpu_amx_products();
        rf_cpu_gemm(0, 1, M, N, KD, 1.0f, a, KD, w, KD, 0.0f, c, N, 1);
        printf("own AMX products: not here (oneDNN's instruction set has no AMX, or the OS refused its tiles)\n");
        CHECK(rf_cpu_amx_products() == before);
        rf_cpu_gemm_forget(w, FB((size_t)N * KD));
        free(a), free(w), free(c);
        CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
        return;
    }
    static const int shapes[][2] = {{896, 4864}, {4864, 896}, {1000, 1000}, {1408, 600}, {512, 1408}};
    static const int ms[] = {5, 16, 17, 32, 33, 64};
    int differ = 0, runs = 0;
    size_t before = rf_cpu_amx_products();
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        int Kd = shapes[si][0], N = shapes[si][1], MAXM = 64;
        float *a = fnormal((size_t)MAXM * Kd, 1.0f), *w = fnormal((size_t)N * Kd, 0.1f);
        float *c0 = fnormal((size_t)MAXM * N, 1.0f), *c1 = xmalloc(FB((size_t)MAXM * N)), *cin = fcopy(c0, (size_t)MAXM * N);
        for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++)
            for (int v = 0; v < 3; v++) { /* beta 0, beta 1, alpha 1 / 0.7 */
                int M = ms[mi];
                float alpha = v == 2 ? 1.0f / 0.7f : 1.0f, beta = v == 1 ? 1.0f : 0.0f;
                memcpy(c0, cin, FB((size_t)M * N)), memcpy(c1, cin, FB((size_t)M * N));
                rf_cpu_gemm_own_amx(0);
                rf_cpu_gemm(0, 1, M, N, Kd, alpha, a, Kd, w, Kd, beta, c0, N, 1);
                rf_cpu_gemm_own_amx(1);
                rf_cpu_gemm(0, 1, M, N, Kd, alpha, a, Kd, w, Kd, beta, c1, N, 1);
                differ += memcmp(c0, c1, FB((size_t)M * N)) != 0, runs++;
            }
        rf_cpu_gemm_forget(w, FB((size_t)N * Kd));
        free(a), free(w), free(c0), free(c1), free(cin);
    }
    size_t own = rf_cpu_amx_products() - before;
    printf("own AMX products: %d of %d differ from oneDNN's kernel on the same packed weights (%zu run on the own kernel)\n",
           differ, runs, own);
    CHECK(differ == 0 && own == (size_t)runs);
    /* K 2048, N 4864: oneDNN splits the sum there; a double reference, and rows alike in products of any size */
    enum { KD = 2048, NN = 4864, MM = 64 };
    float *a = fnormal((size_t)MM * KD, 1.0f), *w = fnormal((size_t)NN * KD, 0.1f);
    float *ref = xmalloc(FB((size_t)MM * NN)), *c = xmalloc(FB((size_t)MM * NN));
    rf_cpu_gemm(0, 1, MM, NN, KD, 1.0f, a, KD, w, KD, 0.0f, ref, NN, 1);
    double worst = 0;
    for (int i = 0; i < MM; i += 7)
        for (int j = 0; j < NN; j += 13) {
            double want = 0;
            for (int k = 0; k < KD; k++)
                want += (double)rf_cpu_bf16_round(a[(size_t)i * KD + k]) * rf_cpu_bf16_round(w[(size_t)j * KD + k]);
            worst = fmax(worst, fabs(want - ref[(size_t)i * NN + j]));
        }
    int rows_differ = 0;
    static const int sub[] = {5, 17, 40};
    for (int si = 0; si < 3; si++) {
        rf_cpu_gemm(0, 1, sub[si], NN, KD, 1.0f, a, KD, w, KD, 0.0f, c, NN, 1);
        rows_differ += memcmp(c, ref, FB((size_t)sub[si] * NN)) != 0;
    }
    printf("own AMX products, K %d N %d: largest difference from the double reference %.3g (bound %.3g); "
           "products of 5, 17, 40 rows unlike the same rows of 64: %d\n", KD, NN, worst, tol_red(KD), rows_differ);
    CHECK(worst <= tol_red(KD) && rows_differ == 0 && rf_cpu_amx_products() - before == (size_t)runs + 4);
    rf_cpu_gemm_forget(w, FB((size_t)NN * KD));
    free(a), free(w), free(ref), free(c);
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
}

/* Memory freed and allocated again comes back at the same address holding another weight: the
 * back end's copies of the old one must go with the free (cpu_free, as CUDA's), since nothing
 * else tells it (the suite's uploads call no weights_updated). Eight rounds of alloc, upload,
 * forward product, free, each weight new; every product against the plain operand's. The
 * allocator hands the block back in most rounds (counted: the check that this can fail; not in
 * AddressSanitizer builds, whose quarantine keeps freed blocks out of use for a while). */
static void test_weights_freed(const rf_kernels *K) {
    enum { T = 32, C = 96, OC = 200 };
    float *x = fnormal((size_t)T * C, 1.0f), *out = xmalloc(FB((size_t)T * OC)), *ref = xmalloc(FB((size_t)T * OC));
    void *last = NULL;
    int reused = 0, differ = 0;
    for (int prec = 0; prec < 2; prec++) {
        CHECK(K->set_precision(prec ? RF_PRECISION_BF16 : RF_PRECISION_FP32) == RF_OK);
        for (int round = 0; round < 8; round++) {
            float *wh = fnormal((size_t)OC * C, 0.1f), *w = put(K, wh, FB((size_t)OC * C));
            reused += (void *)w == last, last = w;
            K->matmul_forward(out, x, w, NULL, T, C, OC);
            rf_cpu_gemm(0, 1, T, OC, C, 1.0f, x, C, wh, C, 0.0f, ref, OC, 0); /* plain operand */
            differ += memcmp(out, ref, FB((size_t)T * OC)) != 0;
            K->free(w);
            free(wh);
        }
    }
    printf("freed weights: %d of 16 products differ from the plain operand's; the block came back at the "
           "same address %d times\n", differ, reused);
    CHECK(differ == 0);
#ifndef __SANITIZE_ADDRESS__ /* its quarantine never hands a freed block straight back */
    CHECK(reused > 0);
#endif
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
    free(x), free(out), free(ref);
}

/* The CPU back end's SwiGLU (kernels/cpu/cpu_swiglu.c) evaluates glibc's expf algorithm
 * vectorised: it must give the bits of the C library's expf and of kernel_math.h's formulas,
 * not merely close values (every measured run depends on them). expf over every 4093rd float
 * (1.05 M of the 2^32, the whole range: NaNs, infinities, subnormals, |x| >= 88 where glibc
 * leaves its fast path), and the two floats of the fast path where glibc's fused and plain
 * builds differ; SwiGLU forward and backward over 1M values, |g| up to 150 (every seventh), and
 * NaN, infinities, +-88, a subnormal, -0. The whole 2^32 was checked when this was written, in
 * both of glibc's builds (GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA: plain): no difference. */
/* The same bits, or both NaN: which NaN an operation on NaNs returns (sign, payload) follows
 * the order the compiler gives a commutative operation's operands, which differs between
 * builds (the -O2 sanitizer build against -O3). */
static int same_or_nans(float a, float b) { return memcmp(&a, &b, 4) == 0 || (isnan(a) && isnan(b)); }

static void test_swiglu_libm_bits(const rf_kernels *K) {
    enum { N = 1 << 20 };
    float *x = malloc(sizeof(float) * N), *e = malloc(sizeof(float) * N);
    size_t n = 0, bad = 0;
    for (uint64_t w = 0; w < 0x100000000ull && n < N - 2; w += 4093) {
        uint32_t v = (uint32_t)w;
        memcpy(&x[n++], &v, 4);
    }
    static const uint32_t split[2] = {0x4202422f, 0xc27c65d9};
    memcpy(&x[n], split, sizeof split), n += 2;
    rf_cpu_expf_libm(e, x, n);
    for (size_t i = 0; i < n; i++) {
        float want = expf(x[i]);
        if (memcmp(&want, &e[i], 4) != 0 && bad++ < 3)
            fprintf(stderr, "expf(%a): %a, the C library %a\n", x[i], e[i], want);
    }
    printf("expf, glibc's algorithm vectorised (mode %d): %zu of %zu differ from the C library\n",
           rf_cpu_expf_libm_mode(), bad, n);
    CHECK(bad == 0);
#ifdef __GLIBC__
    CHECK(rf_cpu_expf_libm_mode() != 2); /* glibc's expf recognised: the vectorised path runs */
#endif
#ifdef __x86_64__
    /* glibc's fused build on an AVX-512 CPU runs the AVX-512 evaluation (mode 3) */
    CHECK(!(__builtin_cpu_supports("avx512f") && rf_cpu_expf_libm_mode() == 1));
#endif
    float *g = fnew(N), *u = fnormal(N, 1.0f), *d = fnormal(N, 1.0f), *o = fnew(N), *dg = fnew(N), *du = fnew(N);
    for (size_t i = 0; i < N; i++) g[i] = (float)(rf_rng_uniform(&g_rng) - 0.5) * (i % 7 ? 20.0f : 300.0f);
    static const float special[] = {INFINITY, -INFINITY, NAN, -NAN, 88.0f, -88.0f, 0x1p-140f, -0.0f};
    memcpy(g, special, sizeof special);
    K->swiglu_forward(o, g, u, N);
    K->swiglu_backward(dg, du, d, g, u, N);
    size_t bf = 0, bb = 0;
    for (size_t i = 0; i < N; i++) {
        float w = rf_swiglu(g[i], u[i]), wg, wu;
        rf_swiglu_grad(g[i], u[i], d[i], &wg, &wu);
        bf += !same_or_nans(w, o[i]);
        bb += !same_or_nans(wg, dg[i]) || !same_or_nans(wu, du[i]);
    }
    if (bf || bb) fprintf(stderr, "swiglu: %zu forward, %zu backward of %d differ from kernel_math.h\n", bf, bb, N);
    CHECK(bf == 0 && bb == 0);
    free(x), free(e), free(g), free(u), free(d), free(o), free(dg), free(du);
}

/* The gradient norm's sum of squares (cpu_kernels.c): blocks of 16384 floats, element i of a
 * block in double lane i mod 32, the lanes added in a halving tree, the block sums in order.
 * The same bits on one thread and on two, and those of this scalar statement of the order. */
static void test_sum_squares_order(const rf_kernels *K) {
    size_t ns[] = {5, 16384, 3 * 16384 + 77, 1200013};
    for (int c = 0; c < 4; c++) {
        size_t n = ns[c];
        float *x = fnormal(n, 3.0f);
        double want = 0.0;
        for (size_t b0 = 0; b0 < n; b0 += 16384) {
            double acc[32] = {0};
            for (size_t i = b0; i < n && i < b0 + 16384; i++) acc[(i - b0) % 32] += (double)x[i] * (double)x[i];
            for (int w = 16; w > 0; w /= 2)
                for (int l = 0; l < w; l++) acc[l] += acc[l + w];
            want += acc[0];
        }
        double two = K->sum_squares(x, n);
        int threads = omp_get_max_threads();
        omp_set_num_threads(1);
        double one = K->sum_squares(x, n);
        omp_set_num_threads(threads);
        if (memcmp(&two, &want, sizeof want) != 0 || memcmp(&one, &want, sizeof want) != 0)
            fprintf(stderr, "sum_squares n=%zu: %.17g (%d threads), %.17g (1), the stated order %.17g\n",
                    n, two, threads, one, want);
        CHECK(memcmp(&two, &want, sizeof want) == 0 && memcmp(&one, &want, sizeof want) == 0);
        free(x);
    }
}

/* The products' bf16 conversion (rf_cpu_bf16_convert: AVX512-BF16's instruction where the
 * build has it, with its flushed denormals redone) against the rounding written out: round to
 * nearest, ties to even, a NaN quieted with its sign and upper payload. Every 251st bit pattern
 * (about 17 million), every denormal boundary and tie near 0 and the largest values, in rows
 * of 1-40 floats so that the vector loop's tail is met too. */
static uint16_t bf16_written_out(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void test_bf16_convert(void) {
    enum { B = 4096 };
    static uint32_t in[B];
    static uint16_t out[B];
    size_t n = 0, bad = 0;
    uint32_t u = 0;
    for (int done = 0; !done;) {
        int k = 0;
        while (k < B) {
            uint64_t next = (uint64_t)u + 251;
            in[k++] = u;
            if (next > 0xffffffffull) { done = 1; break; }
            u = (uint32_t)next;
        }
        /* the edges: denormals and their rounding, ties, the largest finite, infinities, NaNs */
        if (done) {
            static const uint32_t edge[] = {0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00007fff,
                                            0x00008000, 0x00008001, 0x00018000, 0x007f8000, 0x007fffff,
                                            0x807fffff, 0x00800000, 0x3f808000, 0x3f818000, 0x7f7fffff,
                                            0xff7fffff, 0x7f7f8000, 0x7f800000, 0xff800000, 0x7f800001,
                                            0xff800001, 0x7fc00000, 0x7fbfffff, 0xffffffff};
            for (size_t e = 0; e < sizeof edge / sizeof *edge && k < B; e++) in[k++] = edge[e];
        }
        for (int off = 0, len = 1; off < k; off += len, len = len % 40 + 1)
            rf_cpu_bf16_convert(out + off, (const float *)(in + off), off + len <= k ? len : k - off);
        for (int i = 0; i < k; i++) bad += out[i] != bf16_written_out(in[i]);
        n += (size_t)k;
    }
    CHECK(n > 17000000 && bad == 0);
    if (bad) fprintf(stderr, "bf16 conversion: %zu of %zu differ\n", bad, n);
}

/* The kernels compiled once per x86-64 level in a build for any x86-64 (kernels/cpu/cpu_level.h):
 * the highest level this CPU has runs everywhere above; here every other level it can run goes
 * through the same checks of attention, the log-prob kernel and the row statistics. A build for
 * this CPU (-march=native) has one copy and no other level. */
static void test_cpu_levels(const rf_kernels *K) {
    int top = rf_cpu_level();
    CHECK(rf_cpu_level_available(top));
    if (top == RF_CPU_LEVEL_BUILD) {
        CHECK(!rf_cpu_level_available(RF_CPU_LEVEL_BASE) && strcmp(rf_cpu_level_name(), "native") == 0);
        return;
    }
    __builtin_cpu_init(); /* the highest level: what the CPU's features say */
    int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    CHECK(top == (v4 ? RF_CPU_LEVEL_V4 : v3 ? RF_CPU_LEVEL_V3 : RF_CPU_LEVEL_BASE));
    CHECK(!rf_cpu_level_available(RF_CPU_LEVEL_BUILD) && rf_cpu_level_available(RF_CPU_LEVEL_BASE));
    const int levels[] = {RF_CPU_LEVEL_V3, RF_CPU_LEVEL_BASE};
    for (size_t i = 0; i < sizeof levels / sizeof *levels; i++) {
        if (levels[i] == top || !rf_cpu_level_available(levels[i])) continue;
        CHECK(rf_cpu_level_use(levels[i]) == top && rf_cpu_level() == levels[i]);
        printf("kernels of level %s\n", rf_cpu_level_name());
        test_attention(K);
        test_attention_rows_invariant(K, RF_PRECISION_FP32, RF_CPU_ATT_AUTO);
        test_logprob(K);
        test_sample(K);
        test_sampler_logprob(K);
        test_dlogits_bf16();
        rf_cpu_level_use(top);
    }
    CHECK(rf_cpu_level() == top);
}

int main(void) {
    const rf_kernels *K = rf_cpu_kernels();
    CHECK(K != NULL);
    if (!K) return rf_test_finish("test_kernels");
    CHECK(K->name && strcmp(K->name, "cpu") == 0);
    run_kernel_suite(K, 20240611);
    size_t stream_from = rf_cpu_zero_stream_from((size_t)1 << 20); /* zero()'s streaming stores */
    test_memory(K);
    rf_cpu_zero_stream_from(stream_from);
    test_batch_invariant(K);
    test_attention_rows_invariant(K, RF_PRECISION_FP32, RF_CPU_ATT_AUTO);
    test_attention_rows_invariant(K, RF_PRECISION_BF16, RF_CPU_ATT_AUTO); /* fp32 arithmetic */
    test_attention_rows_invariant(K, RF_PRECISION_BF16, RF_CPU_ATT_BF16); /* the tiles, where AMX */
    CHECK(K->set_precision(RF_PRECISION_FP32) == RF_OK);
    test_sampler_logprob(K);
    test_packed_weights(K);
    test_own_amx(K);
    /* an LM head of over 2^20 values: the CPU's forward makes kept logits in one product, its
     * fp32 backward dW by columns (here, not in the shared suite: the emulated device's run of
     * it took minutes) */
    test_logprob_case(K, 5, 64, 16500, 0.8f);
    test_gemm_a16(K);
    test_dlogits_bf16();
    test_alloc_lines();
    test_many_shapes(K);
    test_weights_freed(K);
    test_swiglu_libm_bits(K);
    test_sum_squares_order(K);
    test_bf16_convert();
    test_cpu_levels(K);
    return rf_test_finish("test_kernels");
}
#endif
