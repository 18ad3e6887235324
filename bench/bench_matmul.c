/* Matrix products and AdamW of the CPU back end against the hardware, as JSON lines:
 *  - per shape (the 25M model's training shapes, decode at M = 1, 2, 4, 32, the LM head):
 *    GFLOP/s of OpenBLAS sgemm (reference), of the back end's products in fp32 and in bf16
 *    (oneDNN), each with its ratio to the best fp32 and the best of all measured on the shape
 *    in this run;
 *  - adamw: the back end's fused AdamW in GB/s (28 bytes per element) against memcpy's GB/s
 *    (read + write) on the same 64M-float arrays;
 *  - model_fp32 / model_bf16: bench_model's train step (8 x 256 tokens), prefill (8 x 256) and
 *    decode (batch 1 and 32) of the 25M model in each precision, GFLOP/s with the fraction of
 *    the best matmul GFLOP/s of that precision measured above on the MLP shape (2048x1408x512);
 *    FLOPs counted as bench_model counts them (bench_step.h: prefill's LM head on each prompt's
 *    last token only, a decode step's products without the embedding lookup).
 * Best of several repetitions (the machine may be shared).
 * Usage: bench_matmul [--quick] [--no-model] (--no-model: the products and AdamW only) */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "kernels/kernels.h"
#include "bench/bench_step.h"
#include "model/model.h"

typedef struct shape {
    const char *what;
    int op; /* 0 forward out = x W^T; 1 dinp = dout W; 2 dW += dout^T x */
    int T, C, OC;
} shape;

static float *fill(size_t n, float s) {
    float *a = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) a[i] = s * (float)((i * 2654435761u) % 1000) / 1000.0f - s / 2;
    return a;
}

static void blas(const shape *s, float *x, float *w, float *y) {
    if (s->op == 0 && s->T <= 4) {
        for (int t = 0; t < s->T; t++)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, s->OC, s->C, 1.0f, w, s->C, x + (size_t)t * s->C, 1,
                        0.0f, y + (size_t)t * s->OC, 1);
    } else if (s->op == 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s->T, s->OC, s->C, 1, x, s->C, w, s->C, 0, y, s->OC);
    } else if (s->op == 1) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s->T, s->C, s->OC, 1, y, s->OC, w, s->C, 0, x, s->C);
    } else {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s->OC, s->C, s->T, 1, y, s->OC, x, s->C, 1, w, s->C);
    }
}

static void ours(const rf_kernels *k, const shape *s, float *x, float *w, float *y) {
    if (s->op == 0) k->matmul_forward(y, x, w, NULL, s->T, s->C, s->OC);
    else if (s->op == 1) k->matmul_backward(x, NULL, NULL, y, x, w, s->T, s->C, s->OC);
    else k->matmul_backward(NULL, w, NULL, y, x, w, s->T, s->C, s->OC);
}

/* Best GFLOP/s of `reps` timed calls (after one warm-up) of engine e: 0 OpenBLAS, 1 ours. */
static double time_shape(const rf_kernels *k, const shape *s, int e, int reps) {
    float *x = fill((size_t)s->T * s->C, 1), *w = fill((size_t)s->OC * s->C, 0.1f);
    float *y = fill((size_t)s->T * s->OC, 1);
    double flops = 2.0 * s->T * s->C * s->OC, best = 0;
    for (int r = 0; r <= reps; r++) {
        double t0 = rf_time_now();
        if (e == 0) blas(s, x, w, y);
        else ours(k, s, x, w, y);
        double g = flops / (rf_time_now() - t0) / 1e9;
        if (r > 0 && g > best) best = g;
    }
    free(x), free(w), free(y);
    return best;
}

static double g_best32, g_best16; /* best GFLOP/s on the MLP shape, per precision */

static void bench_shapes(const rf_kernels *k, int quick) {
    const shape shapes[] = {
        {"mlp_up_fwd", 0, 2048, 512, 1408},    {"mlp_down_fwd", 0, 2048, 1408, 512},
        {"mlp_up_dinp", 1, 2048, 512, 1408},   {"mlp_up_dw", 2, 2048, 512, 1408},
        {"attn_q_fwd", 0, 2048, 512, 512},     {"lm_head_fwd", 0, 256, 512, 16384},
        {"lm_head_dinp", 1, 2048, 512, 16384}, {"lm_head_dw", 2, 2048, 512, 16384},
        {"decode_m1", 0, 1, 512, 1408},        {"decode_m2", 0, 2, 512, 1408},
        {"decode_m4", 0, 4, 512, 1408},        {"decode_m32", 0, 32, 512, 1408},
        {"decode_m1_lm", 0, 1, 512, 16384},    {"decode_m32_lm", 0, 32, 512, 16384},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const shape *s = &shapes[i];
        int reps = quick ? 3 : (s->T <= 32 ? 200 : 10);
        double g_blas = time_shape(k, s, 0, reps);
        RF_ASSERT(k->set_precision(RF_PRECISION_FP32) == RF_OK);
        double g_f32 = time_shape(k, s, 1, reps);
        RF_ASSERT(k->set_precision(RF_PRECISION_BF16) == RF_OK);
        double g_bf16 = time_shape(k, s, 1, reps);
        RF_ASSERT(k->set_precision(RF_PRECISION_FP32) == RF_OK);
        double best32 = g_blas > g_f32 ? g_blas : g_f32, best = best32 > g_bf16 ? best32 : g_bf16;
        if (i == 0) g_best32 = best32, g_best16 = best;
        printf("{\"bench\":\"matmul\",\"shape\":\"%s\",\"m\":%d,\"c\":%d,\"oc\":%d,"
               "\"openblas_gflops\":%.1f,\"onednn_f32_gflops\":%.1f,\"onednn_bf16_gflops\":%.1f,"
               "\"openblas_of_best_f32\":%.2f,\"onednn_f32_of_best_f32\":%.2f,"
               "\"onednn_bf16_of_best\":%.2f}\n",
               s->what, s->T, s->C, s->OC, g_blas, g_f32, g_bf16, g_blas / best32, g_f32 / best32,
               g_bf16 / best);
        fflush(stdout);
    }
}

static void bench_adamw(const rf_kernels *k, int quick) {
    size_t n = (size_t)(quick ? 8 : 64) << 20;
    float *p = fill(n, 1), *g = fill(n, 1), *m = fill(n, 0.1f), *v = fill(n, 0.1f);
    for (size_t i = 0; i < n; i++) v[i] = v[i] * v[i];
    double best_a = 0, best_c = 0;
    for (int r = 0; r < 5; r++) {
        double t0 = rf_time_now();
        k->adamw(p, g, m, v, n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.01f, r + 1, 0.5f);
        double ga = 28.0 * n / (rf_time_now() - t0) / 1e9;
        t0 = rf_time_now();
        memcpy(m, g, n * sizeof(float));
        double gc = 8.0 * n / (rf_time_now() - t0) / 1e9;
        best_a = ga > best_a ? ga : best_a, best_c = gc > best_c ? gc : best_c;
    }
    printf("{\"bench\":\"adamw\",\"elements\":%zu,\"adamw_gb_per_s\":%.2f,\"memcpy_gb_per_s\":%.2f,"
           "\"of_memcpy\":%.2f}\n", n, best_a, best_c, best_a / best_c);
    free(p), free(g), free(m), free(v);
}

/* ---- the 25M model (as bench/bench_model.c) in one precision ---- */

static double train_step(rf_model *m, int reps) {
    double best = rf_bench_train_step(m, reps, NULL);
    int T = RF_BENCH_STEP_SEQS * RF_BENCH_STEP_LEN;
    return rf_model_train_flops_per_token(&m->cfg, RF_BENCH_STEP_LEN) * T / best / 1e9;
}

/* GFLOP/s of B sequences decoding `steps` tokens after P-token prompts (P = 256, steps = 0:
 * the prefill of 8 x 256); best of reps. */
static double decode(rf_model *m, int B, int P, int steps, int reps) {
    int V = m->cfg.vocab_size;
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        rf_kv_cache kv;
        RF_ASSERT(rf_kv_cache_init(&kv, m, B, P + steps) == RF_OK);
        int32_t *tok = malloc(sizeof(int32_t) * B * P);
        int *slots = malloc(sizeof(int) * B), *counts = malloc(sizeof(int) * B), *ones = malloc(sizeof(int) * B);
        for (int i = 0; i < B * P; i++) tok[i] = (i * 31) % V;
        for (int b = 0; b < B; b++) slots[b] = b, counts[b] = P, ones[b] = 1;
        float *logits = malloc(sizeof(float) * B * V);
        double t0 = rf_time_now();
        RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
        if (steps) t0 = rf_time_now();
        for (int s = 0; s < steps; s++) {
            for (int b = 0; b < B; b++) tok[b] = (s * 7 + b) % V;
            RF_ASSERT(rf_model_decode(m, &kv, slots, ones, B, tok, logits) == RF_OK);
        }
        double el = rf_time_now() - t0;
        best = el < best ? el : best;
        rf_kv_cache_free(&kv, m);
        free(tok), free(slots), free(counts), free(ones), free(logits);
    }
    double layers, head; /* FLOPs as bench_model counts them: prefill's LM head on each prompt's
                            last token only; a decode step's matmuls (attention left out) */
    rf_bench_matmul_weights(&m->cfg, &layers, &head);
    double flops = steps ? 2.0 * (layers + head) * B * steps : rf_bench_prefill_flops(&m->cfg, B, P);
    return flops / best / 1e9;
}

static void bench_model(const rf_kernels *k, rf_precision p, int quick) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "25m", 16384) == RF_OK);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, k) == RF_OK);
    rf_model_init_random(m, 1, 0.02f);
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    RF_ASSERT(k->set_precision(p) == RF_OK);
    double peak = p == RF_PRECISION_BF16 ? g_best16 : g_best32;
    double tr = train_step(m, quick ? 1 : 3), pf = decode(m, 8, 256, 0, quick ? 1 : 3);
    double d1 = decode(m, 1, 16, quick ? 16 : 64, quick ? 1 : 3), d32 = decode(m, 32, 16, quick ? 16 : 64, quick ? 1 : 3);
    double layers, head;
    rf_bench_matmul_weights(&m->cfg, &layers, &head);
    double per_token = 2.0 * (layers + head); /* a decode step's FLOPs per sequence */
    printf("{\"bench\":\"model_%s\",\"params\":%zu,\"train_gflops\":%.1f,\"prefill_gflops\":%.1f,"
           "\"decode1_gflops\":%.2f,\"decode32_gflops\":%.1f,\"best_matmul_gflops\":%.1f,"
           "\"train_of_best\":%.2f,\"prefill_of_best\":%.2f,\"decode32_of_best\":%.2f,"
           "\"decode1_tokens_per_s\":%.1f,\"decode32_tokens_per_s\":%.1f,\"train_tokens_per_s\":%.1f}\n",
           p == RF_PRECISION_BF16 ? "bf16" : "fp32", m->n_params, tr, pf, d1, d32, peak, tr / peak, pf / peak,
           d32 / peak, d1 * 1e9 / per_token, d32 * 1e9 / per_token,
           tr * 1e9 / rf_model_train_flops_per_token(&m->cfg, 256));
    fflush(stdout);
    RF_ASSERT(k->set_precision(RF_PRECISION_FP32) == RF_OK);
    rf_model_free(m);
}

int main(int argc, char **argv) {
    int quick = 0, model = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else if (strcmp(argv[i], "--no-model") == 0) model = 0;
        else {
            fprintf(stderr, "bench_matmul: unknown option \"%s\" (known: --quick, --no-model)\n", argv[i]);
            return 2;
        }
    }
    const rf_kernels *k = rf_cpu_kernels();
    bench_shapes(k, quick);
    bench_adamw(k, quick);
    if (model) {
        bench_model(k, RF_PRECISION_FP32, quick);
        bench_model(k, RF_PRECISION_BF16, quick);
    }
    return 0;
}
