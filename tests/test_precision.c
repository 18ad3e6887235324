/* The CPU back end's matrix products in both precisions (model.precision), against
 * double-precision references:
 *  - every matmul variant (forward with and without bias, small M = 1..4 of decoding, M = 32,
 *    large training shapes; backward dinp overwritten, dw and dbias accumulated), the fused
 *    log-prob kernel forward and backward (the LM head), and attention;
 *  - bf16 mode really rounds operands to bf16 and accumulates in fp32: its result matches the
 *    double product of the bf16-rounded operands within fp32 tolerance, and differs from the
 *    unrounded product by more than fp32 tolerance allows;
 *  - weights_updated: after parameters change (an optimizer step) bf16 log-probs and greedy
 *    generation use the new weights, not the converted copy of the old ones;
 *  - a whole model in bf16 against itself in fp32;
 *  - held activations (operand_hold): the same bits as converting at every product, fewer
 *    conversions, nothing stale after a release or a free;
 *  - model.precision / --precision parsing (exact errors) and "auto" (bf16 exactly when the
 *    instruction set oneDNN runs on has AVX512-BF16 or AMX-BF16: ONEDNN_MAX_CPU_ISA=AVX2 gives
 *    fp32, and the bf16 products still run, emulated; ctest runs this file both ways).
 *
 * Tolerances. Let S = sum_k |a_k b_k| for one output element (operands as rounded).
 *  - fp32 accumulation of K terms: |error| <= K * 2^-24 * S in the worst case, about
 *    sqrt(K) * 2^-24 * S in practice; TOL32 = 1e-5 relative to S holds that with room for
 *    K <= 1408 (sqrt(1408) * 6e-8 = 2.2e-6) and any blocking order.
 *  - bf16 operands (8 significant bits, round to nearest: relative error <= 2^-8 each): a
 *    product's error is <= about 2^-7 of |a b|, so |bf16 result - exact| <= 2^-7 S + fp32
 *    error; TOLBF = 2^-7 relative to S, the worst case (typical errors are far smaller, random
 *    signs: ~2^-9 sqrt(K) |ab|). */
#define _GNU_SOURCE /* strcasestr */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernels.h"
#include "model/generate.h"
#include "model/model.h"
#include "trainer/optim.h"
#include "test_util.h"

#define TOL32 1e-5
#define TOLBF (1.0 / 128.0)

static rf_rng g_rng;
static const rf_kernels *K;

static float *fnormal(size_t n, float s) {
    float *a = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) a[i] = s * rf_rng_normal(&g_rng);
    return a;
}

/* x as the products see it in precision p. */
static double as_op(float x, rf_precision p) {
    return p == RF_PRECISION_BF16 ? (double)rf_cpu_bf16_round(x) : (double)x;
}

/* Worst |got - want| / (scale + tiny) over n elements, and whether it is within tol. */
typedef struct err_stat {
    double worst;
} err_stat;

static void err_add(err_stat *e, double got, double want, double scale) {
    double r = fabs(got - want) / (scale + 1e-30);
    if (!(r <= e->worst)) e->worst = r; /* NaN propagates */
}

/* ---- matmul ---- */

/* out (T, OC) = x (T, C) W^T + b with operands as in p; S per element into s. */
static void ref_fwd(double *out, double *s, const float *x, const float *w, const float *b, int T,
                    int C, int OC, rf_precision p) {
    for (int t = 0; t < T; t++)
        for (int o = 0; o < OC; o++) {
            double acc = b ? b[o] : 0, sa = b ? fabs(b[o]) : 0;
            for (int c = 0; c < C; c++) {
                double v = as_op(x[(size_t)t * C + c], p) * as_op(w[(size_t)o * C + c], p);
                acc += v, sa += fabs(v);
            }
            out[(size_t)t * OC + o] = acc, s[(size_t)t * OC + o] = sa;
        }
}

/* Checks got against the reference in precision pr (tight) and, in bf16 mode, against the
 * exact fp32-operand reference (loose) and that it is NOT within fp32 tolerance of it. */
static void check_prod(const char *what, const float *got, const double *ref_r, const double *s_r,
                       const double *ref_x, const double *s_x, size_t n, rf_precision p) {
    err_stat tight = {0}, loose = {0};
    for (size_t i = 0; i < n; i++) {
        err_add(&tight, got[i], ref_r[i], s_r[i]);
        err_add(&loose, got[i], ref_x[i], s_x[i]);
    }
    int bf = p == RF_PRECISION_BF16;
    if (!(tight.worst <= TOL32) || (bf && !(loose.worst <= TOLBF)) || (bf && !(loose.worst > TOL32))) {
        fprintf(stderr, "%s (%s): error/S %.3g against the %s reference, %.3g against the exact one\n", what,
                bf ? "bf16" : "fp32", tight.worst, bf ? "bf16-operand" : "exact", loose.worst);
    }
    CHECK(tight.worst <= TOL32);
    if (bf) CHECK(loose.worst <= TOLBF);
    if (bf) CHECK(loose.worst > TOL32); /* the operands really were rounded */
}

static void matmul_case(int T, int C, int OC, int bias, rf_precision p) {
    char what[128];
    size_t ni = (size_t)T * C, nw = (size_t)OC * C, no = (size_t)T * OC;
    float *x = fnormal(ni, 1), *w = fnormal(nw, 0.5f), *b = bias ? fnormal(OC, 1) : NULL;
    float *out = fnormal(no, 100); /* junk: overwritten */
    double *r_r = malloc(sizeof(double) * (no > ni ? (no > nw ? no : nw) : (ni > nw ? ni : nw)));
    double *s_r = malloc(sizeof(double) * (no > ni ? (no > nw ? no : nw) : (ni > nw ? ni : nw)));
    double *r_x = malloc(sizeof(double) * (no > ni ? (no > nw ? no : nw) : (ni > nw ? ni : nw)));
    double *s_x = malloc(sizeof(double) * (no > ni ? (no > nw ? no : nw) : (ni > nw ? ni : nw)));
    CHECK_OK(K->set_precision(p));
    K->weights_updated();
    K->matmul_forward(out, x, w, b, T, C, OC);
    ref_fwd(r_r, s_r, x, w, b, T, C, OC, p);
    ref_fwd(r_x, s_x, x, w, b, T, C, OC, RF_PRECISION_FP32);
    snprintf(what, sizeof what, "matmul_forward T=%d C=%d OC=%d bias=%d", T, C, OC, bias);
    check_prod(what, out, r_r, s_r, r_x, s_x, no, p);

    /* dinp (T, C) = dout W, overwritten */
    float *dout = fnormal(no, 1), *dinp = fnormal(ni, 100);
    K->matmul_backward(dinp, NULL, NULL, dout, x, w, T, C, OC);
    for (int pass = 0; pass < 2; pass++) {
        rf_precision q = pass ? RF_PRECISION_FP32 : p;
        double *r = pass ? r_x : r_r, *s = pass ? s_x : s_r;
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) {
                double acc = 0, sa = 0;
                for (int o = 0; o < OC; o++) {
                    double v = as_op(dout[(size_t)t * OC + o], q) * as_op(w[(size_t)o * C + c], q);
                    acc += v, sa += fabs(v);
                }
                r[(size_t)t * C + c] = acc, s[(size_t)t * C + c] = sa;
            }
    }
    snprintf(what, sizeof what, "matmul_backward dinp T=%d C=%d OC=%d", T, C, OC);
    check_prod(what, dinp, r_r, s_r, r_x, s_x, ni, p);

    /* dw (OC, C) += dout^T x; dbias += column sums (fp32 always) */
    float *dw = fnormal(nw, 1), *dw0 = malloc(sizeof(float) * nw), *db = fnormal(OC, 1);
    float *db0 = malloc(sizeof(float) * OC);
    memcpy(dw0, dw, sizeof(float) * nw), memcpy(db0, db, sizeof(float) * OC);
    K->matmul_backward(NULL, dw, db, dout, x, w, T, C, OC);
    for (int pass = 0; pass < 2; pass++) {
        rf_precision q = pass ? RF_PRECISION_FP32 : p;
        double *r = pass ? r_x : r_r, *s = pass ? s_x : s_r;
        for (int o = 0; o < OC; o++)
            for (int c = 0; c < C; c++) {
                double acc = dw0[(size_t)o * C + c], sa = fabs(acc);
                for (int t = 0; t < T; t++) {
                    double v = as_op(dout[(size_t)t * OC + o], q) * as_op(x[(size_t)t * C + c], q);
                    acc += v, sa += fabs(v);
                }
                r[(size_t)o * C + c] = acc, s[(size_t)o * C + c] = sa;
            }
    }
    snprintf(what, sizeof what, "matmul_backward dw (+=) T=%d C=%d OC=%d", T, C, OC);
    check_prod(what, dw, r_r, s_r, r_x, s_x, nw, p);
    err_stat e = {0};
    for (int o = 0; o < OC; o++) {
        double acc = db0[o], sa = fabs(acc);
        for (int t = 0; t < T; t++) acc += dout[(size_t)t * OC + o], sa += fabs(dout[(size_t)t * OC + o]);
        err_add(&e, db[o], acc, sa);
    }
    CHECK(e.worst <= TOL32); /* a sum, not a product: fp32 in both modes */

    /* dinp and dw in one call (the dw product reuses the dinp product's conversion of dout,
     * rf_cpu_gemm_same_a): the bits of the two separate calls above. A product on other
     * operands first, so that a conversion held from before would show. */
    float *dinp2 = fnormal(ni, 100), *dw2 = malloc(sizeof(float) * nw), *db2 = malloc(sizeof(float) * OC);
    memcpy(dw2, dw0, sizeof(float) * nw), memcpy(db2, db0, sizeof(float) * OC);
    float *junk = fnormal(no, 1), *jout = malloc(sizeof(float) * ni);
    K->matmul_backward(jout, NULL, NULL, junk, x, w, T, C, OC);
    size_t conv0 = rf_cpu_gemm_a_conversions();
    K->matmul_backward(dinp2, dw2, db2, dout, x, w, T, C, OC);
    /* bf16 mode: dout converted once for both products (fp32: none) */
    CHECK(rf_cpu_gemm_a_conversions() - conv0 == (p == RF_PRECISION_BF16 && T > 0 ? 1u : 0u));
    snprintf(what, sizeof what, "matmul_backward dinp+dw in one call T=%d C=%d OC=%d %s", T, C, OC,
             p == RF_PRECISION_BF16 ? "bf16" : "fp32");
    if (memcmp(dinp2, dinp, sizeof(float) * ni) || memcmp(dw2, dw, sizeof(float) * nw) ||
        memcmp(db2, db, sizeof(float) * OC))
        fprintf(stderr, "%s: differs from the separate calls\n", what);
    CHECK(memcmp(dinp2, dinp, sizeof(float) * ni) == 0);
    CHECK(memcmp(dw2, dw, sizeof(float) * nw) == 0);
    CHECK(memcmp(db2, db, sizeof(float) * OC) == 0);
    free(dinp2), free(dw2), free(db2), free(junk), free(jout);
    free(x), free(w), free(b), free(out), free(r_r), free(s_r), free(r_x), free(s_x);
    free(dout), free(dinp), free(dw), free(dw0), free(db), free(db0);
}

static void test_matmul(rf_precision p) {
    static const int shapes[][4] = {
        {1, 64, 96, 1},   {2, 64, 96, 0},   {3, 128, 40, 1},  {4, 96, 130, 0}, /* decoding */
        {5, 24, 7, 1},    {32, 96, 80, 1},  {32, 512, 64, 0},                  /* small */
        {300, 256, 200, 1}, {257, 64, 1000, 0}, {64, 1408, 48, 0},            /* training */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        matmul_case(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], p);
}

/* ---- fused log-prob (LM head) ---- */

/* Double log-probs, entropies and the gradients of sum dl * logp w.r.t. h and w, with the
 * logits' operands as in precision p. dh (T, C), dw (V, C) overwritten; sdh, sdw get the S of
 * each (sum of |dz w| and |dz h| with dz in double). */
static void ref_logprob_all(double *lp, double *ent, double *dh, double *sdh, double *dw, double *sdw,
                            const float *h, const float *w, const int32_t *tg, const float *dl, int T,
                            int C, int V, double it, rf_precision p) {
    double *z = malloc(sizeof(double) * V);
    memset(dw, 0, sizeof(double) * (size_t)V * C), memset(sdw, 0, sizeof(double) * (size_t)V * C);
    for (int t = 0; t < T; t++) {
        double mx = -INFINITY;
        for (int v = 0; v < V; v++) {
            double a = 0;
            for (int c = 0; c < C; c++) a += as_op(h[(size_t)t * C + c], p) * as_op(w[(size_t)v * C + c], p);
            z[v] = a * it, mx = z[v] > mx ? z[v] : mx;
        }
        double sum = 0;
        for (int v = 0; v < V; v++) sum += exp(z[v] - mx);
        double lse = mx + log(sum), en = 0;
        for (int v = 0; v < V; v++) en -= exp(z[v] - lse) * (z[v] - lse);
        lp[t] = z[tg[t]] - lse, ent[t] = en;
        for (int c = 0; c < C; c++) dh[(size_t)t * C + c] = 0, sdh[(size_t)t * C + c] = 0;
        for (int v = 0; v < V; v++) {
            double dz = it * dl[t] * ((v == tg[t]) - exp(z[v] - lse));
            for (int c = 0; c < C; c++) {
                double a = dz * as_op(w[(size_t)v * C + c], p), b = dz * as_op(h[(size_t)t * C + c], p);
                dh[(size_t)t * C + c] += a, sdh[(size_t)t * C + c] += fabs(a);
                dw[(size_t)v * C + c] += b, sdw[(size_t)v * C + c] += fabs(b);
            }
        }
    }
    free(z);
}

/* Log-probs: an error e in a logit moves a log-prob by at most 2e; the logits' S is at most
 * sum |h||w| * inv_temp, bounded here by max over tokens. Gradients against the reference
 * whose logits and products take operands as in p, with dz from those logits in double: in
 * bf16 mode the kernel also rounds dz (an operand of both products) to bf16, 2^-9 relative,
 * which TOLBF covers; fp32 mode is held to TOL32. */
static void logprob_case(int T, int C, int V, rf_precision p) {
    char what[128];
    float it = 0.7f;
    float *h = fnormal((size_t)T * C, 1), *w = fnormal((size_t)V * C, 0.2f), *dl = fnormal(T, 1);
    int32_t *tg = malloc(sizeof(int32_t) * T);
    for (int t = 0; t < T; t++) tg[t] = (int32_t)(rf_rng_u64(&g_rng) % (uint64_t)V);
    float *lp = malloc(sizeof(float) * T), *en = malloc(sizeof(float) * T);
    float *dh = fnormal((size_t)T * C, 100), *dw = calloc((size_t)V * C, sizeof(float));
    CHECK_OK(K->set_precision(p));
    K->weights_updated();
    K->logprob_forward(lp, en, h, w, tg, T, C, V, it);
    K->logprob_backward(dh, dw, dl, NULL, h, w, tg, T, C, V, it);
    double *lr = malloc(sizeof(double) * T), *er = malloc(sizeof(double) * T);
    double *dhr = malloc(sizeof(double) * T * C), *sdh = malloc(sizeof(double) * T * C);
    double *dwr = malloc(sizeof(double) * V * C), *sdw = malloc(sizeof(double) * V * C);
    ref_logprob_all(lr, er, dhr, sdh, dwr, sdw, h, w, tg, dl, T, C, V, it, p);
    double smax = 0;
    for (int t = 0; t < T; t++)
        for (int v = 0; v < V; v++) {
            double s = 0;
            for (int c = 0; c < C; c++) s += fabs(as_op(h[(size_t)t * C + c], p) * as_op(w[(size_t)v * C + c], p));
            smax = s * it > smax ? s * it : smax;
        }
    err_stat el = {0}, ee = {0};
    for (int t = 0; t < T; t++) {
        err_add(&el, lp[t], lr[t], 1.0), err_add(&ee, en[t], er[t], 1.0);
    }
    /* fp32: logits within 2 TOL32 smax, plus the fp32 softmax over V terms (1e-5) */
    double tol_lp = 2 * TOL32 * smax + 1e-5;
    snprintf(what, sizeof what, "logprob_forward T=%d C=%d V=%d %s", T, C, V, p ? "bf16" : "fp32");
    if (!(el.worst <= tol_lp && ee.worst <= tol_lp))
        fprintf(stderr, "%s: |logp err| %.3g, |entropy err| %.3g, tol %.3g\n", what, el.worst, ee.worst, tol_lp);
    CHECK(el.worst <= tol_lp);
    CHECK(ee.worst <= tol_lp);
    double tol_g = p == RF_PRECISION_BF16 ? TOLBF : TOL32;
    double *dhx = dhr, *dwx = dwr;
    err_stat gh = {0}, gw = {0};
    for (size_t i = 0; i < (size_t)T * C; i++) err_add(&gh, dh[i], dhx[i], sdh[i] + 1e-6);
    for (size_t i = 0; i < (size_t)V * C; i++) err_add(&gw, dw[i], dwx[i], sdw[i] + 1e-6);
    if (!(gh.worst <= tol_g && gw.worst <= tol_g))
        fprintf(stderr, "%s: dh err/S %.3g, dw err/S %.3g, tol %.3g\n", what, gh.worst, gw.worst, tol_g);
    CHECK(gh.worst <= tol_g);
    CHECK(gw.worst <= tol_g);
    /* Again without the forward's kept logits (stale after weights_updated): the backward makes
     * the logits chunk by chunk, each chunk's dh and dw products reading that chunk's dz. */
    memset(dw, 0, sizeof(float) * (size_t)V * C);
    K->weights_updated();
    K->logprob_backward(dh, dw, dl, NULL, h, w, tg, T, C, V, it);
    gh = (err_stat){0}, gw = (err_stat){0};
    for (size_t i = 0; i < (size_t)T * C; i++) err_add(&gh, dh[i], dhx[i], sdh[i] + 1e-6);
    for (size_t i = 0; i < (size_t)V * C; i++) err_add(&gw, dw[i], dwx[i], sdw[i] + 1e-6);
    if (!(gh.worst <= tol_g && gw.worst <= tol_g))
        fprintf(stderr, "%s, logits made again: dh err/S %.3g, dw err/S %.3g, tol %.3g\n", what,
                gh.worst, gw.worst, tol_g);
    CHECK(gh.worst <= tol_g);
    CHECK(gw.worst <= tol_g);
    free(h), free(w), free(dl), free(tg), free(lp), free(en), free(dh), free(dw);
    free(lr), free(er), free(dhr), free(sdh), free(dwr), free(sdw);
}

/* ---- attention: fp32 arithmetic at fp32, and at bf16 where its products do not run on AMX's
 * tiles (the bf16 setting must not change a bit there). On the tiles (cpu_attention_amx.c; at
 * bf16 on AMX: the backward by default from head dim 64, both passes under
 * RLFLOW_CPU_ATTENTION=bf16) the backward's five products read bf16 operands: Q, K, V and dO as
 * given, P and dS as made. The reference: double sums over the rounded Q, K, V, dO (with the
 * forward's own lse and O), P and dS unrounded; each gradient within 2^-7 of sum |P or dS|
 * |operand| (their rounding to bf16's 8 significant bits moves each term by at most 2^-8 of
 * itself: 2x headroom) + TOL32. Run at D = 64 and 128 by default (forward fp32, backward tiled)
 * and at D = 40 with both tiled (padded head dims). ---- */

typedef struct att_case {
    int NS, H, KVH, D, T;
    const int32_t *off;
} att_case;

/* g (n) within 2^-7 bound + TOL32 (|ref| + rms) of ref; prints the worst. */
static void check_bound(int D, const char *what, const float *g, const double *ref, const double *bound, size_t n) {
    double rms = 0.0, worst = 0.0;
    size_t bad = 0, at = 0;
    for (size_t i = 0; i < n; i++) rms += ref[i] * ref[i];
    rms = sqrt(rms / (double)(n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        double r = fabs(g[i] - ref[i]) / (ldexp(bound[i], -7) + TOL32 * (fabs(ref[i]) + rms) + 1e-30);
        bad += !(r <= 1.0);
        if (r > worst) worst = r, at = i;
    }
    printf("  attention backward (bf16, AMX, D = %d) %s: worst %.3g of the bound at [%zu] (got %.9g, want %.9g)\n",
           D, what, worst, at, n ? g[at] : 0.0, n ? ref[at] : 0.0);
    CHECK(bad == 0);
}

static void attention_bf16_backward(const att_case *c, const float *q, const float *k, const float *v,
                                    const float *dout, const float *out, const float *lse, const float *dq,
                                    const float *dk, const float *dv) {
    int H = c->H, KVH = c->KVH, D = c->D, T = c->T, g = H / KVH;
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D;
    double scale = 1.0 / sqrt((double)D);
    double *rq = calloc(nq, sizeof(double)), *rk = calloc(nk, sizeof(double)), *rv = calloc(nk, sizeof(double));
    double *bq = calloc(nq, sizeof(double)), *bk = calloc(nk, sizeof(double)), *bv = calloc(nk, sizeof(double));
    double *P = malloc(sizeof(double) * T), *dS = malloc(sizeof(double) * T);
#define OP(x) ((double)rf_cpu_bf16_round(x))
    for (int s = 0; s < c->NS; s++)
        for (int h = 0; h < H; h++) {
            int kh = h / g, t0 = c->off[s];
            for (int i = t0; i < c->off[s + 1]; i++) {
                const float *qi = q + ((size_t)i * H + h) * D, *gi = dout + ((size_t)i * H + h) * D;
                double Di = 0.0;
                for (int d = 0; d < D; d++) Di += (double)gi[d] * out[((size_t)i * H + h) * D + d];
                for (int j = t0; j <= i; j++) {
                    const float *kj = k + ((size_t)j * KVH + kh) * D, *vj = v + ((size_t)j * KVH + kh) * D;
                    double sc = 0.0, dp = 0.0;
                    for (int d = 0; d < D; d++) sc += OP(qi[d]) * OP(kj[d]), dp += OP(gi[d]) * OP(vj[d]);
                    P[j] = exp(sc * scale - lse[(size_t)i * H + h]);
                    dS[j] = P[j] * (dp - Di) * scale;
                }
                for (int j = t0; j <= i; j++) {
                    size_t kr = ((size_t)j * KVH + kh) * D, qr = ((size_t)i * H + h) * D;
                    for (int d = 0; d < D; d++) {
                        rq[qr + d] += dS[j] * OP(k[kr + d]), bq[qr + d] += fabs(dS[j] * OP(k[kr + d]));
                        rk[kr + d] += dS[j] * OP(q[qr + d]), bk[kr + d] += fabs(dS[j] * OP(q[qr + d]));
                        rv[kr + d] += P[j] * OP(dout[qr + d]), bv[kr + d] += fabs(P[j] * OP(dout[qr + d]));
                    }
                }
            }
        }
#undef OP
    check_bound(D, "dq", dq, rq, bq, nq);
    check_bound(D, "dk", dk, rk, bk, nk);
    check_bound(D, "dv", dv, rv, bv, nk);
    free(rq), free(rk), free(rv), free(bq), free(bk), free(bv), free(P), free(dS);
}

static void test_attention_precisions(int D, int att_mode) {
    enum { NS = 3, H = 4, KVH = 2 };
    int old_mode = rf_cpu_attention_mode(att_mode);
    int32_t off[NS + 1] = {0, 37, 37 + 130, 37 + 130 + 64}; /* partial, 3 blocks of 64 (the last partial), 1 */
    int T = off[NS];
    att_case c = {NS, H, KVH, D, T, off};
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D;
    float *q = fnormal(nq, 1), *k = fnormal(nk, 1), *v = fnormal(nk, 1), *dout = fnormal(nq, 1);
    float *o[2], *lse[2], *dq[2], *dk[2], *dv[2];
    int32_t klen[NS] = {37, 130, 64};
    for (int m = 0; m < 2; m++) {
        CHECK_OK(K->set_precision(m ? RF_PRECISION_BF16 : RF_PRECISION_FP32));
        o[m] = malloc(sizeof(float) * nq), lse[m] = malloc(sizeof(float) * T * H);
        dq[m] = malloc(sizeof(float) * nq), dk[m] = malloc(sizeof(float) * nk), dv[m] = malloc(sizeof(float) * nk);
        K->attention_forward(o[m], lse[m], q, k, v, off, off, klen, NS, H, KVH, D);
        K->attention_backward(dq[m], dk[m], dv[m], dout, q, k, v, o[m], lse[m], off, NS, T, H, KVH, D);
    }
    int same = memcmp(o[0], o[1], sizeof(float) * nq) == 0 && memcmp(dq[0], dq[1], sizeof(float) * nq) == 0 &&
               memcmp(dk[0], dk[1], sizeof(float) * nk) == 0 && memcmp(dv[0], dv[1], sizeof(float) * nk) == 0;
    int fwd_same = memcmp(o[0], o[1], sizeof(float) * nq) == 0;
    if (rf_cpu_attention_amx_backward(D)) { /* still set to bf16 */
        CHECK(!same);
        CHECK(fwd_same == !rf_cpu_attention_amx_forward());
        attention_bf16_backward(&c, q, k, v, dout, o[1], lse[1], dq[1], dk[1], dv[1]);
    } else {
        printf("  attention at bf16, D = %d, mode %d: fp32 arithmetic here (no AMX, a head dim under %d or "
               "RLFLOW_CPU_ATTENTION=fp32): the same bits\n", D, att_mode, RF_CPU_ATT_AUTO_MIN_D);
        CHECK(same);
    }
    rf_cpu_attention_mode(old_mode);
    for (int m = 0; m < 2; m++) free(o[m]), free(lse[m]), free(dq[m]), free(dk[m]), free(dv[m]);
    free(q), free(k), free(v), free(dout);
}

/* ---- whole model ---- */

static rf_model *small_model(uint64_t seed) {
    rf_model_config c;
    CHECK_OK(rf_config_preset(&c, "small", 512));
    rf_model *m = NULL;
    CHECK_OK(rf_model_init(&m, &c, K));
    rf_model_init_random(m, seed, 0.05f);
    return m;
}

/* Packed batch of 3 sequences; log-probs of the next tokens into lp (T). */
static int model_logprobs(rf_model *m, float *lp, float *en) {
    enum { T = 40 };
    int32_t tok[T], tgt[T], cu[4] = {0, 11, 30, T};
    for (int t = 0; t < T; t++) tok[t] = (t * 37 + 11) % 512, tgt[t] = (t * 53 + 7) % 512;
    rf_batch b = {3, T, tok, NULL, cu};
    CHECK_OK(rf_model_forward(m, &b));
    CHECK_OK(rf_model_logprobs(m, tgt, 1.0f, lp, en));
    return T;
}

/* bf16 against fp32 on the same weights. Each layer's products carry ~2^-9 relative operand
 * error; through the layers and the LM head the log-probs (magnitude ~6) moved by at most
 * 0.02 (observed, native and emulated); 0.05 is the bound, which a wrong weight or a missing
 * layer exceeds by far. */
static void test_model_bf16_vs_fp32(void) {
    rf_model *m = small_model(3);
    float l32[64], e32[64], l16[64], e16[64];
    CHECK_OK(K->set_precision(RF_PRECISION_FP32));
    int T = model_logprobs(m, l32, e32);
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    model_logprobs(m, l16, e16);
    double worst = 0, worst_e = 0, differ = 0;
    for (int t = 0; t < T; t++) {
        worst = fmax(worst, fabs(l16[t] - l32[t])), worst_e = fmax(worst_e, fabs(e16[t] - e32[t]));
        differ += l16[t] != l32[t];
    }
    printf("model bf16 vs fp32: max |logp diff| %.3g, max |entropy diff| %.3g over %d tokens\n", worst, worst_e, T);
    CHECK(worst <= 0.05);
    CHECK(worst_e <= 0.05);
    CHECK(differ > 0); /* bf16 is in use */
    /* attention's forward on AMX's tiles too (RLFLOW_CPU_ATTENTION=bf16; head dim 32 here) */
    int old_mode = rf_cpu_attention_mode(RF_CPU_ATT_BF16);
    if (rf_cpu_attention_amx_forward()) {
        float lt[64], et[64];
        model_logprobs(m, lt, et);
        double wt = 0, wte = 0;
        int moved = 0;
        for (int t = 0; t < T; t++) {
            wt = fmax(wt, fabs(lt[t] - l32[t])), wte = fmax(wte, fabs(et[t] - e32[t]));
            moved += lt[t] != l16[t];
        }
        printf("model bf16 with attention on the tiles vs fp32: max |logp diff| %.3g, max |entropy diff| %.3g; "
               "%d of %d log-probs moved by the tiles\n", wt, wte, moved, T);
        CHECK(wt <= 0.05);
        CHECK(wte <= 0.05);
        CHECK(moved > 0);
    }
    rf_cpu_attention_mode(old_mode);
    rf_model_free(m);
}

/* A whole model's gradients at bf16 with attention's backward on AMX's tiles (the 25m preset:
 * head dim 64, the default) against the same with it in fp32 arithmetic: the tiles round
 * attention's operands to bf16 as the layers' products already are, so the gradients move by
 * bf16's rounding (0.8 % relative, measured), not more (the bound 5 %, which a wrong layout or a
 * dropped key far exceeds); without the tiles, the same bits. */
static void test_model_grads_attention_tiles(void) {
    rf_model_config c;
    CHECK_OK(rf_config_preset(&c, "25m", 512));
    rf_model *m = NULL;
    CHECK_OK(rf_model_init(&m, &c, K));
    rf_model_init_random(m, 9, 0.05f);
    CHECK_OK(rf_model_enable_training(m));
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    float *g[2], lp[64], en[64], dl[64];
    int old_mode = rf_cpu_attention_mode(RF_CPU_ATT_FP32);
    for (int i = 0; i < 2; i++) {
        if (i) rf_cpu_attention_mode(RF_CPU_ATT_AUTO);
        rf_model_zero_grad(m);
        int T = model_logprobs(m, lp, en);
        for (int t = 0; t < T; t++) dl[t] = -1.0f / T;
        CHECK_OK(rf_model_backward(m, dl, NULL, NULL));
        g[i] = malloc(sizeof(float) * m->n_params);
        memcpy(g[i], m->grads, sizeof(float) * m->n_params);
    }
    double d2 = 0, n2 = 0;
    for (size_t i = 0; i < m->n_params; i++) d2 += (double)(g[1][i] - g[0][i]) * (g[1][i] - g[0][i]), n2 += (double)g[0][i] * g[0][i];
    double rel = sqrt(d2 / (n2 > 0 ? n2 : 1));
    int tiles = rf_cpu_attention_amx_backward(c.head_dim);
    printf("model gradients at bf16, attention's backward %s against fp32 arithmetic: relative L2 difference %.3g\n",
           tiles ? "on the tiles" : "in fp32 (no AMX here)", rel);
    CHECK(n2 > 0);
    if (tiles) CHECK(rel > 0 && rel <= 0.05);
    else CHECK(rel == 0);
    rf_cpu_attention_mode(old_mode);
    free(g[0]), free(g[1]);
    rf_model_free(m);
}

/* After an optimizer step on the parameters, bf16 log-probs and greedy generation must be
 * those of a model loaded fresh with the new parameters (bit for bit: same kernels, same
 * shapes), not those of the converted copy of the old weights. */
static void test_weights_updated(void) {
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    rf_model *m = small_model(5);
    float l0[64], l1[64], l2[64], en[64];
    CHECK_OK(rf_model_enable_training(m));
    const int32_t prompt[4] = {5, 17, 42, 99};
    const int32_t *pp = prompt;
    int plen = 4;
    rf_gen_params gp = {.sampling = {.greedy = 1}, .max_new_tokens = 6};
    rf_gen_output g0, g1, g2;
    CHECK_OK(rf_generate(m, NULL, &pp, &plen, 1, &gp, &g0, 0)); /* converts the weights */
    /* the update: an AdamW step on a gradient made by a backward pass */
    int T = model_logprobs(m, l0, en);
    rf_model_zero_grad(m);
    float dl[64];
    for (int t = 0; t < T; t++) dl[t] = -1.0f;
    CHECK_OK(rf_model_backward(m, dl, NULL, NULL));
    rf_optim_opts o = {.lr = 0.05f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .grad_clip = 1.0f};
    double gn;
    float lr;
    CHECK_OK(rf_optim_step(m, &o, &gn, &lr));
    model_logprobs(m, l1, en);
    CHECK_OK(rf_generate(m, NULL, &pp, &plen, 1, &gp, &g1, 0));
    /* the same parameters in a fresh model */
    rf_model *f = small_model(6);
    memcpy(f->params, m->params, sizeof(float) * m->n_params);
    K->weights_updated();
    model_logprobs(f, l2, en);
    CHECK_OK(rf_generate(f, NULL, &pp, &plen, 1, &gp, &g2, 0));
    int moved = 0, same = 1;
    for (int t = 0; t < T; t++) moved += l1[t] != l0[t], same &= l1[t] == l2[t];
    CHECK(moved > T / 2); /* the step changed the model */
    CHECK(same);          /* and the bf16 products used the new weights */
    CHECK(g1.n_tokens == g2.n_tokens);
    for (int i = 0; i < g1.n_tokens && i < g2.n_tokens; i++) {
        CHECK(g1.tokens[i] == g2.tokens[i]);
        CHECK(g1.logprobs[i] == g2.logprobs[i]);
    }
    rf_gen_output_free(&g0), rf_gen_output_free(&g1), rf_gen_output_free(&g2);
    rf_model_free(m), rf_model_free(f);
}

/* ---- held activations (kernels.h operand_hold) ---- */

/* A training step (forward, log-probs, backward) and a greedy generation of the small model with
 * holds taken and without: the same log-probs, gradients and tokens bit for bit; with them, fewer conversions of A
 * operands in bf16 mode (each projection input once, not once a product). */
static void test_held_model(rf_precision p) {
    CHECK_OK(K->set_precision(p));
    float lp[2][64], en[64], dl[64], *g[2];
    size_t conv[2], held[2], ng = 0;
    rf_gen_output gen[2][2]; /* [holds][prompt] */
    int T = 0, L = 0;
    /* holds first, on a fresh model: an op that wrote only the converted values of an
     * activation something else then read as floats would show (fresh memory, not the values
     * a run without holds left there) */
    for (int on = 1; on >= 0; on--) {
        rf_model *m = small_model(7);
        CHECK_OK(rf_model_enable_training(m));
        ng = m->n_params - m->n_frozen, L = m->cfg.num_hidden_layers;
        int was = rf_cpu_operands_hold_on(on);
        size_t c0 = rf_cpu_gemm_a_conversions(), h0 = rf_cpu_operands_conversions();
        T = model_logprobs(m, lp[on], en);
        rf_model_zero_grad(m);
        for (int t = 0; t < T; t++) dl[t] = -1.0f / (float)(t + 1);
        CHECK_OK(rf_model_backward(m, dl, NULL, NULL));
        conv[on] = rf_cpu_gemm_a_conversions() - c0, held[on] = rf_cpu_operands_conversions() - h0;
        g[on] = malloc(sizeof(float) * ng);
        memcpy(g[on], m->grads, sizeof(float) * ng);
        /* decoding: a prefill of 4 + 9 tokens, then steps of two rows (the matrix-vector and
         * one-row paths read the held values widened) */
        const int32_t p0[4] = {5, 17, 42, 99}, p1[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, *pp[2] = {p0, p1};
        int plen[2] = {4, 9};
        rf_gen_params gp = {.sampling = {.greedy = 1}, .max_new_tokens = 6};
        CHECK_OK(rf_generate(m, NULL, pp, plen, 2, &gp, gen[on], 0));
        rf_cpu_operands_hold_on(was);
        if (on && p == RF_PRECISION_BF16) CHECK(rf_cpu_operands_kept_bytes() > 0);
        rf_model_free(m); /* frees the activations (their holds end) and trims: nothing kept */
        CHECK(rf_cpu_operands_kept_bytes() == 0);
    }
    for (int q = 0; q < 2; q++) {
        rf_gen_output *a = &gen[0][q], *b = &gen[1][q];
        CHECK(a->n_tokens == b->n_tokens && a->n_tokens > 0);
        for (int i = 0; i < a->n_tokens && i < b->n_tokens; i++)
            CHECK(a->tokens[i] == b->tokens[i] && a->logprobs[i] == b->logprobs[i]);
        rf_gen_output_free(a), rf_gen_output_free(b);
    }
    printf("held activations, %s: A conversions %zu without holds, %zu with (+%zu held ones)\n",
           p == RF_PRECISION_BF16 ? "bf16" : "fp32", conv[0], conv[1], held[1]);
    CHECK(memcmp(lp[0], lp[1], sizeof(float) * (size_t)T) == 0);
    CHECK(memcmp(g[0], g[1], sizeof(float) * ng) == 0);
    CHECK(held[0] == 0);
    if (p == RF_PRECISION_BF16) {
        /* per layer: ln1, att, ln2 and act held in the forward (q, k, v read ln1 as A; the
         * backward reads the four as weight gradients' B), dgate and dup in the backward; and
         * the final norm's output */
        CHECK(held[1] == (size_t)(6 * L + 1));
        CHECK(conv[1] + (size_t)(3 * L) <= conv[0]); /* the forward's repeats at least */
    } else {
        CHECK(held[1] == 0 && conv[0] == 0 && conv[1] == 0);
    }
    free(g[0]), free(g[1]);
}

/* Held operands at the kernel level: a slice of whole rows, a weight gradient reading a held
 * input (padded on AMX), values written after a release or after the memory is freed
 * (rf_cpu_gemm_forget): every product equals the product of an unheld copy bit for bit. */
static void test_held_kernels(void) {
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    enum { T = 100, C = 64, OC = 48 };
    float *x = K->alloc(sizeof(float) * T * C), *w = fnormal((size_t)OC * C, 0.1f);
    float *copy = malloc(sizeof(float) * T * C), *dout = fnormal((size_t)T * OC, 1);
    float *o1 = malloc(sizeof(float) * T * OC), *o2 = malloc(sizeof(float) * T * OC);
    float *dw1 = calloc((size_t)OC * C, sizeof(float)), *dw2 = calloc((size_t)OC * C, sizeof(float));
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < (size_t)T * C; i++) x[i] = (float)rf_rng_normal(&g_rng);
        memcpy(copy, x, sizeof(float) * T * C);
        K->operand_hold(&g_rng, x, T, C);
        size_t h0 = rf_cpu_operands_conversions();
        /* rows [10, 60) as A, then all of it as a weight gradient's B, then rows [40, 100) */
        K->matmul_forward(o1, x + 10 * C, w, NULL, 50, C, OC);
        K->matmul_forward(o2, copy + 10 * C, w, NULL, 50, C, OC);
        CHECK(memcmp(o1, o2, sizeof(float) * 50 * OC) == 0);
        K->matmul_backward(NULL, dw1, NULL, dout, x, w, T, C, OC);
        K->matmul_backward(NULL, dw2, NULL, dout, copy, w, T, C, OC);
        CHECK(memcmp(dw1, dw2, sizeof(float) * OC * C) == 0);
        K->matmul_backward(NULL, dw1, NULL, dout, x + 40 * C, w, 60, C, OC);
        K->matmul_backward(NULL, dw2, NULL, dout, copy + 40 * C, w, 60, C, OC);
        CHECK(memcmp(dw1, dw2, sizeof(float) * OC * C) == 0);
        /* a middle slice as B: on AMX its padding would overwrite the rows after it, so it is
         * converted at the call; the rows after it stay as held */
        K->matmul_backward(NULL, dw1, NULL, dout, x + 20 * C, w, 30, C, OC);
        K->matmul_backward(NULL, dw2, NULL, dout, copy + 20 * C, w, 30, C, OC);
        CHECK(memcmp(dw1, dw2, sizeof(float) * OC * C) == 0);
        K->matmul_forward(o1, x + 40 * C, w, NULL, 60, C, OC);
        K->matmul_forward(o2, copy + 40 * C, w, NULL, 60, C, OC);
        CHECK(memcmp(o1, o2, sizeof(float) * 60 * OC) == 0);
        CHECK(rf_cpu_operands_conversions() - h0 == 1u); /* once for every product above */
        if (round == 0) {
            K->operands_release(&g_rng); /* new values next round, in the same memory */
        } else if (round == 1) { /* what free() tells the products of memory it frees; then new
                                    values in that memory, not held */
            rf_cpu_gemm_forget(x, sizeof(float) * T * C);
            for (size_t i = 0; i < (size_t)T * C; i++) x[i] = copy[i] = (float)rf_rng_normal(&g_rng);
            K->matmul_forward(o1, x, w, NULL, T, C, OC);
            K->matmul_forward(o2, copy, w, NULL, T, C, OC);
            CHECK(memcmp(o1, o2, sizeof(float) * T * OC) == 0);
        }
    }
    K->operands_release(&g_rng);
    K->free(x), free(w), free(copy), free(dout), free(o1), free(o2), free(dw1), free(dw2);
}

/* Ops writing a held output (rf_cpu_held_output: its bf16 values only, with native bf16): every
 * product reading it, whole or in slices, as A or as a weight gradient's B, transposed or not,
 * on the matrix-vector and one-row paths too, equals the product of the op's plain output. */
static void test_held_outputs(void) {
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    enum { T = 100, C = 64, OC = 48 };
    const void *me = &g_rng;
    float *gate = fnormal((size_t)T * C, 1), *up = fnormal((size_t)T * C, 1), *w = fnormal((size_t)OC * C, 0.1f);
    float *g2 = fnormal((size_t)T * OC, 1), *u2 = fnormal((size_t)T * OC, 1), *nw = fnormal(C, 1);
    float *x = K->alloc(sizeof(float) * T * C), *y = malloc(sizeof(float) * T * C);
    float *d = K->alloc(sizeof(float) * T * OC), *dd = malloc(sizeof(float) * T * OC);
    float *n1 = K->alloc(sizeof(float) * T * C), *n2 = malloc(sizeof(float) * T * C);
    float *o1 = malloc(sizeof(float) * T * OC), *o2 = malloc(sizeof(float) * T * OC);
    float *i1 = malloc(sizeof(float) * T * C), *i2 = malloc(sizeof(float) * T * C);
    float *dw1 = calloc((size_t)OC * C, sizeof(float)), *dw2 = calloc((size_t)OC * C, sizeof(float));
    size_t h0 = rf_cpu_operands_conversions();
    K->operand_hold(me, x, T, C), K->operand_hold(me, d, T, OC), K->operand_hold(me, n1, T, C);
    K->swiglu_forward(x, gate, up, (size_t)T * C);
    K->swiglu_forward(y, gate, up, (size_t)T * C);
    K->swiglu_forward(d, g2, u2, (size_t)T * OC);
    K->swiglu_forward(dd, g2, u2, (size_t)T * OC);
    K->rmsnorm_forward(n1, NULL, gate, nw, T, C, 1e-6f);
    K->rmsnorm_forward(n2, NULL, gate, nw, T, C, 1e-6f);
    /* written directly where products read bf16 natively (three ops), else converted lazily */
    CHECK(rf_cpu_operands_conversions() - h0 == (rf_cpu_gemm_a16_direct() ? 3u : 0u));
    static const int slices[][2] = {{0, T}, {10, 50}, {40, 60}, {20, 30}, {99, 1}, {7, 3}};
    for (size_t i = 0; i < sizeof slices / sizeof slices[0]; i++) {
        int r0 = slices[i][0], n = slices[i][1];
        K->matmul_forward(o1, x + (size_t)r0 * C, w, NULL, n, C, OC); /* A */
        K->matmul_forward(o2, y + (size_t)r0 * C, w, NULL, n, C, OC);
        CHECK(memcmp(o1, o2, sizeof(float) * n * OC) == 0);
        K->matmul_forward(o1, n1 + (size_t)r0 * C, w, NULL, n, C, OC);
        K->matmul_forward(o2, n2 + (size_t)r0 * C, w, NULL, n, C, OC);
        CHECK(memcmp(o1, o2, sizeof(float) * n * OC) == 0);
        /* dout held (A, and transposed A of dW), input held (dW's B) */
        K->matmul_backward(i1, dw1, NULL, d + (size_t)r0 * OC, x + (size_t)r0 * C, w, n, C, OC);
        K->matmul_backward(i2, dw2, NULL, dd + (size_t)r0 * OC, y + (size_t)r0 * C, w, n, C, OC);
        CHECK(memcmp(i1, i2, sizeof(float) * n * C) == 0);
        CHECK(memcmp(dw1, dw2, sizeof(float) * OC * C) == 0);
    }
    /* after a change of precision, fp32 products read the held values too */
    CHECK_OK(K->set_precision(RF_PRECISION_FP32));
    K->matmul_forward(o1, x, w, NULL, T, C, OC);
    K->matmul_forward(o2, y, w, NULL, T, C, OC);
    float worst = 0;
    for (int i = 0; i < T * OC; i++) worst = fmaxf(worst, fabsf(o1[i] - o2[i]));
    CHECK(worst < 0.1f); /* bf16-rounded against exact floats: close, not garbage */
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    K->operands_release(me);
    K->free(x), K->free(d), K->free(n1);
    free(gate), free(up), free(w), free(g2), free(u2), free(nw), free(y), free(dd), free(n2);
    free(o1), free(o2), free(i1), free(i2), free(dw1), free(dw2);
}

/* ---- settings ---- */

/* Whether the CPU and ONEDNN_MAX_CPU_ISA allow bf16 instructions, read independently of
 * oneDNN: /proc/cpuinfo flags, and the cap named by the environment. */
static int expect_bf16(void) {
    const char *cap = getenv("ONEDNN_MAX_CPU_ISA");
    if (cap && *cap && strcasecmp(cap, "ALL") != 0 && !strcasestr(cap, "BF16") && !strcasestr(cap, "AMX"))
        return 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return -1;
    char line[8192];
    int has = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "flags", 5) == 0) {
            has = strstr(line, " avx512_bf16") || strstr(line, " amx_bf16");
            break;
        }
    fclose(f);
    return has;
}

static void test_settings(void) {
    int is_auto;
    rf_precision p;
    CHECK_ERR(rf_precision_parse("fp16", "model.precision", &is_auto, &p), RF_ERR_ARG,
              "model.precision = \"fp16\": expected \"auto\", \"fp32\" or \"bf16\"");
    CHECK_ERR(rf_kernels_apply_precision(K, "BF16", "--precision", NULL), RF_ERR_ARG,
              "--precision = \"BF16\": expected \"auto\", \"fp32\" or \"bf16\"");
    CHECK_OK(rf_precision_parse("bf16", "k", &is_auto, &p));
    CHECK(!is_auto && p == RF_PRECISION_BF16);
    rf_precision chosen = RF_PRECISION_FP32;
    CHECK_OK(rf_kernels_apply_precision(K, "auto", "model.precision", &chosen));
    int want = expect_bf16();
    printf("auto chose %s (cpuinfo and ONEDNN_MAX_CPU_ISA say bf16 %s; oneDNN bf16 %s)\n",
           chosen == RF_PRECISION_BF16 ? "bf16" : "fp32", want ? "yes" : "no",
           rf_cpu_bf16_native() ? "native" : "emulated");
    if (want >= 0) CHECK((chosen == RF_PRECISION_BF16) == want);
    /* no bf16 instructions: oneDNN's effective ISA agrees (it emulates bf16 there, taking bf16
     * operands on AVX-512 and not on AVX2, so rf_cpu_bf16_native says only which of the two) */
    if (want == 0) CHECK(!rf_cpu_isa_has_bf16());
    CHECK_OK(rf_kernels_apply_precision(K, "fp32", "model.precision", &chosen));
    CHECK(chosen == RF_PRECISION_FP32 && K->get_precision() == RF_PRECISION_FP32);
}

/* rf_expf_fast (the log-prob kernels' vectorised exponential) against double exp: within 2
 * ulp of the correctly rounded value over [-87.3, 88.37], sampled every 997th float (about 4
 * million points); the clamps below and above; NaN in, NaN out. */
static void test_expf(void) {
    double worst = 0.0;
    float at = 0.0f;
    for (int neg = 0; neg < 2; neg++) {
        float lim = neg ? -87.3f : 88.37f;
        uint32_t u0 = neg ? 0x80000000u : 0u;
        for (uint32_t u = u0;; u += 997) {
            float x;
            memcpy(&x, &u, 4);
            if (neg ? x < lim : x > lim) break;
            double ref = exp((double)x);
            float rr = (float)ref, ulp = nextafterf(rr, INFINITY) - rr;
            double e = fabs((double)rf_expf_fast(x) - ref) / ulp;
            if (e > worst) worst = e, at = x;
        }
    }
    printf("  rf_expf_fast: worst %.3f ulp at x = %.9g\n", worst, at);
    CHECK(worst <= 2.0);
    CHECK(rf_expf_fast(0.0f) == 1.0f);
    CHECK(rf_expf_fast(-1000.0f) == rf_expf_fast(-87.3f) && rf_expf_fast(-1000.0f) > 0.0f);
    CHECK(rf_expf_fast(1000.0f) == rf_expf_fast(88.37f) && isfinite(rf_expf_fast(1000.0f)));
    CHECK(isnan(rf_expf_fast(NAN)));
}

int main(void) {
    K = rf_cpu_kernels();
    rf_rng_seed(&g_rng, 1234);
    test_settings();
    test_expf();
    for (int p = 0; p < 2; p++) {
        test_matmul((rf_precision)p);
        logprob_case(37, 64, 700, (rf_precision)p);  /* a whole chunk and more rows */
        logprob_case(3, 96, 300, (rf_precision)p);   /* decoding-sized: the small-M path */
        logprob_case(300, 32, 50, (rf_precision)p);  /* more than one chunk */
        logprob_case(512, 32, 50, (rf_precision)p);  /* two chunks of the same shape */
    }
    test_attention_precisions(64, RF_CPU_ATT_AUTO);
    test_attention_precisions(128, RF_CPU_ATT_AUTO); /* Llama's and Qwen's larger models */
    test_attention_precisions(40, RF_CPU_ATT_BF16); /* padded head dims, not a multiple of 16 */
    test_attention_precisions(48, RF_CPU_ATT_AUTO); /* under the auto head dim: fp32 arithmetic */
    test_model_bf16_vs_fp32();
    test_model_grads_attention_tiles();
    test_weights_updated();
    test_held_model(RF_PRECISION_BF16);
    test_held_model(RF_PRECISION_FP32);
    test_held_kernels();
    test_held_outputs();
    CHECK_OK(K->set_precision(RF_PRECISION_FP32));
    return rf_test_finish("test_precision");
}
