/* The benches' --profile: a kernel table that times each op it wraps (seconds, FLOPs of the
 * products, calls) and prints one JSON line per op. Shared by bench_model (the CPU) and
 * bench_cuda (the GPU, synchronising around each op); header-only because benches are single
 * files, and each program includes it once. */
#ifndef RF_BENCH_OPS_H
#define RF_BENCH_OPS_H

#include <stdio.h>
#include <string.h>

#include "common/util.h"
#include "kernels/kernels.h"


enum { OP_MM_F, OP_MM_B, OP_ATT_F, OP_ATT_B, OP_LP_F, OP_LP_B, OP_NORM_F, OP_NORM_B, OP_ADD_NORM_F, OP_ROPE,
       OP_SWIGLU_F, OP_SWIGLU_B, OP_EMB_F, OP_EMB_B, OP_ADAMW, OP_PAGED_ATT, OP_PAGED_KV,
       OP_ADD, OP_SCALE, OP_SUMSQ, OP_COPY, OP_ZERO, OP_SAMPLE, OP_ROW_LSE, OP_WEIGHTS, OP_N };
static const char *op_names[OP_N] = {
    "matmul_forward", "matmul_backward", "attention_forward", "attention_backward",
    "logprob_forward", "logprob_backward", "rmsnorm_forward", "rmsnorm_backward",
    "add_rmsnorm_forward", "rope",
    "swiglu_forward", "swiglu_backward", "embedding_forward", "embedding_backward", "adamw",
    "paged_attention_forward", "paged_kv_write", "add_inplace", "scale", "sum_squares", "copy",
    "zero", "sample_rows", "row_lse", "weights_updated"};
static double op_s[OP_N], op_flops[OP_N];
static long op_calls[OP_N];
static const rf_kernels *base_k;
static rf_kernels timed_k;
static int op_sync;

#define TIMED(op, flops, call)                  \
    do {                                        \
        if (op_sync) base_k->sync();            \
        double t__ = rf_time_now();             \
        call;                                   \
        if (op_sync) base_k->sync();            \
        op_s[op] += rf_time_now() - t__;        \
        op_flops[op] += (flops);                \
        op_calls[op]++;                         \
    } while (0)

static void t_mm_f(float *o, const float *i, const float *w, const float *b, int T, int C, int OC) {
    TIMED(OP_MM_F, 2.0 * T * C * OC, base_k->matmul_forward(o, i, w, b, T, C, OC));
}
static void t_mm_b(float *di, float *dw, float *db, const float *d, const float *i, const float *w,
                   int T, int C, int OC) {
    TIMED(OP_MM_B, (di ? 4.0 : 2.0) * T * C * OC, base_k->matmul_backward(di, dw, db, d, i, w, T, C, OC));
}
static void t_att_f(float *o, float *l, const float *q, const float *k, const float *v,
                    const int32_t *qo, const int32_t *ks, const int32_t *kl, int n, int H, int KVH, int D) {
    TIMED(OP_ATT_F, 0, base_k->attention_forward(o, l, q, k, v, qo, ks, kl, n, H, KVH, D));
}
static void t_att_b(float *dq, float *dk, float *dv, const float *d, const float *q, const float *k,
                    const float *v, const float *o, const float *l, const int32_t *cu, int n, int T,
                    int H, int KVH, int D) {
    TIMED(OP_ATT_B, 0, base_k->attention_backward(dq, dk, dv, d, q, k, v, o, l, cu, n, T, H, KVH, D));
}
static void t_lp_f(float *lp, float *e, const float *h, const float *w, const int32_t *tg, int T,
                   int C, int V, float it) {
    TIMED(OP_LP_F, 2.0 * T * C * V, base_k->logprob_forward(lp, e, h, w, tg, T, C, V, it));
}
static void t_lp_b(float *dh, float *dw, const float *dl, const float *de, const float *h,
                   const float *w, const int32_t *tg, int T, int C, int V, float it) {
    /* the two products dh = dz W and dW += dz^T h; logits the forward did not keep are made
     * again inside (the CPU keeps them up to 512 MB), work not counted, as training FLOPs go */
    TIMED(OP_LP_B, (dw ? 4.0 : 2.0) * T * C * V, base_k->logprob_backward(dh, dw, dl, de, h, w, tg, T, C, V, it));
}
static void t_norm_f(float *o, float *r, const float *i, const float *w, int N, int C, float e) {
    TIMED(OP_NORM_F, 0, base_k->rmsnorm_forward(o, r, i, w, N, C, e));
}
static void t_norm_b(float *di, float *dw, const float *d, const float *i, const float *w,
                     const float *r, int N, int C) {
    TIMED(OP_NORM_B, 0, base_k->rmsnorm_backward(di, dw, d, i, w, r, N, C));
}
static void t_rope(float *x, const int32_t *p, const float *f, int T, int H, int D, int s) {
    TIMED(OP_ROPE, 0, base_k->rope(x, p, f, T, H, D, s));
}
static void t_rope_qk(float *q, float *k, const int32_t *p, const float *f, int T, int H, int KVH, int D,
                      int s) {
    TIMED(OP_ROPE, 0, base_k->rope_qk(q, k, p, f, T, H, KVH, D, s));
}
static void t_add_norm_f(float *x, float *o, float *r, const float *a, const float *w, int N, int C, float e) {
    TIMED(OP_ADD_NORM_F, 0, base_k->add_rmsnorm_forward(x, o, r, a, w, N, C, e));
}
static void t_sw_f(float *o, const float *g, const float *u, size_t n) {
    TIMED(OP_SWIGLU_F, 0, base_k->swiglu_forward(o, g, u, n));
}
static void t_sw_b(float *dg, float *du, const float *d, const float *g, const float *u, size_t n) {
    TIMED(OP_SWIGLU_B, 0, base_k->swiglu_backward(dg, du, d, g, u, n));
}
static void t_emb_f(float *o, const int32_t *t, const float *w, int T, int C) {
    TIMED(OP_EMB_F, 0, base_k->embedding_forward(o, t, w, T, C));
}
static void t_emb_b(float *dw, const float *d, const int32_t *t, int T, int C) {
    TIMED(OP_EMB_B, 0, base_k->embedding_backward(dw, d, t, T, C));
}
static void t_adamw(float *p, const float *g, float *m, float *v, size_t n, float lr, float b1,
                    float b2, float e, float wd, int s, float gs) {
    TIMED(OP_ADAMW, 0, base_k->adamw(p, g, m, v, n, lr, b1, b2, e, wd, s, gs));
}
static void t_patt(float *o, const float *q, const float *kp, const float *vp, const int32_t *qo,
                   const int32_t *bt, int mb, const int32_t *kl, int n, int bs, int H, int KVH, int D) {
    TIMED(OP_PAGED_ATT, 0, base_k->paged_attention_forward(o, q, kp, vp, qo, bt, mb, kl, n, bs, H, KVH, D));
}
static void t_pkv(float *kp, float *vp, const float *k, const float *v, const int32_t *s, int T,
                  int KVH, int D) {
    TIMED(OP_PAGED_KV, 0, base_k->paged_kv_write(kp, vp, k, v, s, T, KVH, D));
}
static void t_add(float *a, const float *b, size_t n) { TIMED(OP_ADD, 0, base_k->add_inplace(a, b, n)); }
static void t_scale(float *x, float s, size_t n) { TIMED(OP_SCALE, 0, base_k->scale(x, s, n)); }
static double t_sumsq(const float *x, size_t n) {
    double r;
    TIMED(OP_SUMSQ, 0, r = base_k->sum_squares(x, n));
    return r;
}
static void t_copy(void *d, const void *s, size_t n) { TIMED(OP_COPY, 0, base_k->copy(d, s, n)); }
static void t_zero(void *p, size_t n) { TIMED(OP_ZERO, 0, base_k->zero(p, n)); }
static void t_sample(int32_t *p, float *l, const float *z, int V, const rf_row_draw *d, int n) {
    TIMED(OP_SAMPLE, 0, base_k->sample_rows(p, l, z, V, d, n));
}
static void t_row_lse(float *l, const float *z, int V, const rf_row_draw *d, int n) {
    TIMED(OP_ROW_LSE, 0, base_k->row_lse(l, z, V, d, n));
}
static void t_weights(void) { TIMED(OP_WEIGHTS, 0, base_k->weights_updated()); }

/* A copy of table `base` whose ops add up their time, FLOPs and calls. The CPU's ops are
 * synchronous, so wall time around a call is the op's time; a GPU's are queued, so `sync` = 1
 * waits for the device before and after each op (the op's own time plus one launch's latency:
 * a profile, not the step's speed). Ops not listed here run untimed. */
static inline const rf_kernels *bench_timed_kernels(const rf_kernels *base, int sync) {
    base_k = base, op_sync = sync;
    timed_k = *base_k;
    timed_k.matmul_forward = t_mm_f, timed_k.matmul_backward = t_mm_b;
    timed_k.attention_forward = t_att_f, timed_k.attention_backward = t_att_b;
    timed_k.logprob_forward = t_lp_f, timed_k.logprob_backward = t_lp_b;
    timed_k.rmsnorm_forward = t_norm_f, timed_k.rmsnorm_backward = t_norm_b;
    timed_k.add_rmsnorm_forward = t_add_norm_f, timed_k.rope_qk = t_rope_qk;
    timed_k.rope = t_rope, timed_k.swiglu_forward = t_sw_f, timed_k.swiglu_backward = t_sw_b;
    timed_k.embedding_forward = t_emb_f, timed_k.embedding_backward = t_emb_b;
    timed_k.adamw = t_adamw, timed_k.paged_attention_forward = t_patt;
    timed_k.paged_kv_write = t_pkv, timed_k.add_inplace = t_add, timed_k.scale = t_scale;
    timed_k.sum_squares = t_sumsq, timed_k.copy = t_copy, timed_k.zero = t_zero;
    if (base->sample_rows) timed_k.sample_rows = t_sample;
    if (base->row_lse) timed_k.row_lse = t_row_lse;
    if (base->weights_updated) timed_k.weights_updated = t_weights;
    return &timed_k;
}

static inline void profile_reset(void) {
    memset(op_s, 0, sizeof op_s), memset(op_flops, 0, sizeof op_flops);
    memset(op_calls, 0, sizeof op_calls);
}

/* One line per op that ran during `phase` (wall seconds `total`), largest first, then the time
 * outside the timed ops ("untimed": the host's own work, ops this table does not wrap). */
static inline void profile_print(const char *phase, double total) {
    int done[OP_N] = {0};
    double timed = 0.0;
    for (int i = 0; i < OP_N; i++) timed += op_s[i];
    for (;;) {
        int best = -1;
        for (int i = 0; i < OP_N; i++)
            if (!done[i] && op_calls[i] && (best < 0 || op_s[i] > op_s[best])) best = i;
        if (best < 0) break;
        done[best] = 1;
        printf("{\"bench\":\"op\",\"phase\":\"%s\",\"op\":\"%s\",\"calls\":%ld,\"seconds\":%.4f,"
               "\"share\":%.3f", phase, op_names[best], op_calls[best], op_s[best], op_s[best] / total);
        if (op_flops[best] > 0) printf(",\"gflops\":%.2f", op_flops[best] / op_s[best] / 1e9);
        printf("}\n");
    }
    printf("{\"bench\":\"op\",\"phase\":\"%s\",\"op\":\"untimed\",\"seconds\":%.4f,\"share\":%.3f}\n",
           phase, total - timed, (total - timed) / total);
    fflush(stdout);
}

#endif
