/* Benchmarks of the compute core on the CPU back end, printed as JSON lines:
 *  - sgemm_peak: OpenBLAS sgemm GFLOP/s on the model's largest matmul shape (the baseline);
 *  - train_step: forward + log-probs + backward of a ~25M-parameter model on 8 x 256 tokens,
 *    tokens/s, GFLOP/s and the fraction of the sgemm peak;
 *  - prefill: tokens/s of KV-cache prefill of 8 x 256-token prompts;
 *  - decode: tokens/s of KV-cache decoding at batch 1 and 32.
 * Usage: bench_model [--quick] */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "model/model.h"

static double sgemm_peak(int M, int N, int K, int reps) {
    float *a = calloc((size_t)M * K, 4), *b = calloc((size_t)N * K, 4), *c = calloc((size_t)M * N, 4);
    for (size_t i = 0; i < (size_t)M * K; i++) a[i] = (float)(i % 7) * 0.01f;
    for (size_t i = 0; i < (size_t)N * K; i++) b[i] = (float)(i % 5) * 0.01f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, a, K, b, K, 0, c, N);
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double t = rf_time_now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, a, K, b, K, 0, c, N);
        double g = 2.0 * M * N * K / (rf_time_now() - t) / 1e9;
        best = g > best ? g : best;
    }
    free(a), free(b), free(c);
    return best;
}

/* memcpy bandwidth over 256 MB (read + write counted), GB/s: the roofline of batch-1 decoding,
 * which streams every weight once per token. */
static double memcpy_bw(void) {
    size_t n = 256u << 20;
    char *a = malloc(n), *b = malloc(n);
    memset(a, 1, n), memset(b, 2, n);
    double best = 0;
    for (int r = 0; r < 5; r++) {
        double t = rf_time_now();
        memcpy(b, a, n);
        double g = 2.0 * n / (rf_time_now() - t) / 1e9;
        best = g > best ? g : best;
    }
    free(a), free(b);
    return best;
}

static double g_peak, g_bw;

static rf_model *bench_model(void) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "25m", 16384) == RF_OK);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, 1, 0.02f);
    return m;
}

static void bench_train(rf_model *m, double peak, int reps) {
    int B = 8, L = 256, T = B * L;
    int32_t *tok = malloc(sizeof(int32_t) * T), *tgt = malloc(sizeof(int32_t) * T), cu[9];
    float *lp = malloc(sizeof(float) * T), *dlp = malloc(sizeof(float) * T);
    rf_rng r;
    rf_rng_seed(&r, 1);
    for (int t = 0; t < T; t++) {
        tok[t] = (int32_t)(rf_rng_u64(&r) % 16384), tgt[t] = (int32_t)(rf_rng_u64(&r) % 16384);
        dlp[t] = -1.0f / T;
    }
    for (int b = 0; b <= B; b++) cu[b] = b * L;
    rf_batch bt = {B, T, tok, NULL, cu};
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    double best = 1e30;
    for (int i = 0; i < reps + 1; i++) {
        double t0 = rf_time_now();
        rf_model_zero_grad(m);
        RF_ASSERT(rf_model_forward(m, &bt) == RF_OK);
        RF_ASSERT(rf_model_logprobs(m, tgt, 1.0f, lp, NULL) == RF_OK);
        RF_ASSERT(rf_model_backward(m, dlp, NULL, NULL) == RF_OK);
        double el = rf_time_now() - t0;
        if (i > 0 && el < best) best = el; /* first run warms up allocations */
    }
    double flops = rf_model_train_flops_per_token(&m->cfg, L) * T;
    printf("{\"bench\":\"train_step\",\"params\":%zu,\"tokens\":%d,\"seconds\":%.4f,"
           "\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"sgemm_peak_gflops\":%.2f,\"fraction_of_peak\":%.3f}\n",
           m->n_params, T, best, T / best, flops / best / 1e9, peak, flops / best / 1e9 / peak);
    free(tok), free(tgt), free(lp), free(dlp);
}

static void bench_prefill(rf_model *m) {
    int B = 8, L = 256, V = m->cfg.vocab_size;
    rf_kv_cache kv;
    RF_ASSERT(rf_kv_cache_init(&kv, m, B, L) == RF_OK);
    int32_t *tok = malloc(sizeof(int32_t) * B * L);
    int slots[8], counts[8];
    for (int i = 0; i < B * L; i++) tok[i] = i % V;
    for (int b = 0; b < B; b++) slots[b] = b, counts[b] = L;
    float *logits = malloc(sizeof(float) * B * V);
    /* one untimed pass first, then the cache emptied: the timed one finds its memory touched, as
     * a serving engine's long-lived cache is (the CPU back end maps large buffers lazily) */
    RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
    for (int b = 0; b < B; b++) kv.len[b] = 0;
    double t0 = rf_time_now();
    RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
    double el = rf_time_now() - t0;
    double gf = 2.0 * m->n_params * B * L / el / 1e9;
    printf("{\"bench\":\"prefill\",\"sequences\":%d,\"prompt_len\":%d,\"seconds\":%.4f,\"tokens_per_s\":%.1f,"
           "\"gflops\":%.2f,\"fraction_of_sgemm_peak\":%.3f}\n", B, L, el, B * L / el, gf, gf / g_peak);
    rf_kv_cache_free(&kv, m);
    free(tok), free(logits);
}

static void bench_decode(rf_model *m, int B, int steps) {
    int P = 16, V = m->cfg.vocab_size;
    rf_kv_cache kv;
    RF_ASSERT(rf_kv_cache_init(&kv, m, B, P + steps) == RF_OK);
    int32_t *tok = malloc(sizeof(int32_t) * B * P);
    int *slots = malloc(sizeof(int) * B), *counts = malloc(sizeof(int) * B), *ones = malloc(sizeof(int) * B);
    for (int i = 0; i < B * P; i++) tok[i] = (i * 31) % V;
    for (int b = 0; b < B; b++) slots[b] = b, counts[b] = P, ones[b] = 1;
    float *logits = malloc(sizeof(float) * B * V);
    RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
    double t0 = rf_time_now();
    for (int s = 0; s < steps; s++) {
        for (int b = 0; b < B; b++) tok[b] = (s * 7 + b) % V;
        RF_ASSERT(rf_model_decode(m, &kv, slots, ones, B, tok, logits) == RF_OK);
    }
    double el = rf_time_now() - t0;
    /* each step reads every weight once: achieved bandwidth against memcpy's */
    double bw = (double)m->n_params * 4 * steps / el / 1e9, gf = 2.0 * m->n_params * B * steps / el / 1e9;
    printf("{\"bench\":\"decode\",\"batch\":%d,\"steps\":%d,\"seconds\":%.4f,\"tokens_per_s\":%.1f,"
           "\"weight_gb_per_s\":%.2f,\"memcpy_gb_per_s\":%.2f,\"fraction_of_memcpy_bw\":%.3f,"
           "\"gflops\":%.2f,\"fraction_of_sgemm_peak\":%.3f}\n",
           B, steps, el, (double)B * steps / el, bw, g_bw, bw / g_bw, gf, gf / g_peak);
    rf_kv_cache_free(&kv, m);
    free(tok), free(slots), free(counts), free(ones), free(logits);
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    rf_model *m = bench_model();
    /* Baseline: the MLP up-projection shape of the benchmark model, (T=2048, F=1408, C=512). */
    double peak = g_peak = sgemm_peak(2048, 1408, 512, quick ? 3 : 10);
    g_bw = memcpy_bw();
    printf("{\"bench\":\"sgemm_peak\",\"m\":2048,\"n\":1408,\"k\":512,\"gflops\":%.2f}\n", peak);
    printf("{\"bench\":\"memcpy\",\"bytes\":%u,\"gb_per_s\":%.2f}\n", 256u << 20, g_bw);
    bench_train(m, peak, quick ? 1 : 3);
    bench_prefill(m);
    bench_decode(m, 1, quick ? 16 : 64);
    bench_decode(m, 32, quick ? 16 : 64);
    rf_model_free(m);
    return 0;
}
