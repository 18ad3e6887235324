/* Benchmarks of the compute core on the CUDA back end, printed as JSON lines in the format of
 * bench/bench_model.c (train_step, prefill, decode at batch 1, 32 and 256), each measured
 * against the device itself in the same run:
 *  - bf16_peak: TFLOP/s of a large bf16 matmul through cublasLt (8192^3, bf16 operands, fp32
 *    accumulation and output), the best of several: the tensor-core roofline;
 *  - copy_bw: GB/s of a 2 GiB device-to-device cudaMemcpyAsync (read + write counted): the
 *    memory roofline of decoding, which streams every weight once per step.
 *  - paged_attention: one layer's attention of a decoding step over the paged KV cache (batch 1,
 *    16, 256 over 1024 keys), GB/s of K and V read against copy_bw, split over key chunks and
 *    not (RLFLOW_CUDA_DECODE=split / =tiled: the same bits);
 *  - attention: one layer's attention forward and backward (the default: at precision bf16, bf16
 *    attention on tensor cores; then fp32 arithmetic, RLFLOW_CUDA_ATTENTION=fp32; or what
 *    RLFLOW_CUDA_ATTENTION names) against the same layer's seven forward products.
 * Three model shapes: "25m" (the CPU bench's model), "qwen0.5b" (Qwen2.5-0.5B: C 896, F 4864,
 * 24 layers, 14/2 heads, V 151936) and "7b" (Llama-2-7B: C 4096, F 11008, 32 layers, 32/32
 * heads, V 32000, untied). Weights are random; the model runs at the precision given.
 * Usage: bench_cuda [--quick] [--precision bf16|fp32] [--model 25m|qwen0.5b|7b|all] [--profile]
 * (--profile: also one "op" line per kernel op of each phase, as bench_model --profile prints;
 * every op then waits for the device before and after it).
 * Exit 77 (and one JSON line saying why) where no GPU is present. Built only with CUDA. */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "model/model.h"
#include "bench/bench_ops.h"

#define CK(call)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "bench_cuda: %s: %s\n", #call, cudaGetErrorString(e_));      \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)
#define CKL(call)                                                                         \
    do {                                                                                  \
        cublasStatus_t s_ = (call);                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            fprintf(stderr, "bench_cuda: %s: cublasLt status %d\n", #call, (int)s_);     \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

static double g_peak_tflops, g_bw; /* measured in this run */
static int g_profile;              /* --profile: one JSON line per op of each phase */

/* A failed model call (out of device memory on a large shape, a CUDA error) ends that
 * benchmark with a JSON line naming it, and the run goes on with the next. */
#define BENCH_TRY(bench, shape, expr)                                                          \
    do {                                                                                       \
        if ((expr) != RF_OK) {                                                                 \
            size_t free_ = 0, total_ = 0;                                                      \
            (void)rf_cuda_kernels(0)->mem_info(&free_, &total_);                               \
            printf("{\"bench\":\"%s\",\"model\":\"%s\",\"error\":\"%s\",\"device_free_mb\":%zu,"   \
                   "\"device_total_mb\":%zu}\n", bench, shape, rf_error_message(), free_ >> 20,        \
                   total_ >> 20);                                                              \
            fflush(stdout);                                                                    \
            goto done;                                                                         \
        }                                                                                      \
    } while (0)

/* The bf16 tensor-core peak: D (N, N) fp32 = A (N, N) bf16 @ B (N, N) bf16 by cublasLt. */
static double bf16_peak(int N, int reps) {
    size_t n = (size_t)N * N;
    void *a, *b, *d, *ws;
    size_t ws_bytes = 64u << 20;
    CK(cudaMalloc(&a, n * 2)); CK(cudaMalloc(&b, n * 2)); CK(cudaMalloc(&d, n * 4));
    CK(cudaMalloc(&ws, ws_bytes));
    CK(cudaMemset(a, 0x3c, n * 2)); CK(cudaMemset(b, 0x3c, n * 2)); /* bf16 0x3c3c ~ 0.0115 */
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    CKL(cublasLtCreate(&lt));
    CKL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T;
    CKL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    CKL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, N, N, N));
    CKL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, N, N, N));
    CKL(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, N, N, N));
    cublasLtMatmulPreference_t pref;
    CKL(cublasLtMatmulPreferenceCreate(&pref));
    CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    CKL(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heur, &found));
    if (!found) {
        fprintf(stderr, "bench_cuda: cublasLt found no bf16 algorithm for %d^3\n", N);
        exit(1);
    }
    float alpha = 1.0f, beta = 0.0f;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    double best = 0.0;
    for (int r = 0; r < reps + 1; r++) {
        CK(cudaEventRecord(e0, 0));
        CKL(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &heur.algo, ws,
                           ws_bytes, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        double tf = 2.0 * N * N * (double)N / (ms * 1e-3) / 1e12;
        if (r > 0 && tf > best) best = tf; /* the first call picks and loads its kernel */
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op), cublasLtDestroy(lt);
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(d)); CK(cudaFree(ws));
    return best;
}

/* Device-to-device copy bandwidth, read + write counted, GB/s. */
static double copy_bw(size_t bytes, int reps) {
    void *a, *b;
    CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes)); CK(cudaMemset(b, 2, bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    double best = 0.0;
    for (int r = 0; r < reps + 1; r++) {
        CK(cudaEventRecord(e0, 0));
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        double g = 2.0 * (double)bytes / (ms * 1e-3) / 1e9;
        if (r > 0 && g > best) best = g;
    }
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    CK(cudaFree(a)); CK(cudaFree(b));
    return best;
}

/* One of the three shapes. */
static void shape_config(rf_model_config *c, const char *name) {
    if (strcmp(name, "25m") == 0) {
        RF_ASSERT(rf_config_preset(c, "25m", 16384) == RF_OK);
        return;
    }
    RF_ASSERT(rf_config_preset(c, "25m", 16384) == RF_OK); /* the common fields */
    if (strcmp(name, "qwen0.5b") == 0) {
        c->hidden_size = 896, c->intermediate_size = 4864, c->num_hidden_layers = 24;
        c->num_attention_heads = 14, c->num_key_value_heads = 2, c->head_dim = 64;
        c->vocab_size = 151936, c->rope_theta = 1e6f, c->max_position_embeddings = 32768;
    } else { /* 7b */
        c->arch = RF_ARCH_LLAMA;
        snprintf(c->model_type, sizeof c->model_type, "llama");
        c->hidden_size = 4096, c->intermediate_size = 11008, c->num_hidden_layers = 32;
        c->num_attention_heads = 32, c->num_key_value_heads = 32, c->head_dim = 128;
        c->vocab_size = 32000, c->tie_word_embeddings = 0, c->qkv_bias = 0;
        c->max_position_embeddings = 4096, c->rms_norm_eps = 1e-5f;
    }
}

/* Random weights without drawing billions of numbers on the host: one 16M-float block of
 * N(0, 0.02) tiled over the parameters with device copies (speed does not depend on values). */
static void fill_params(rf_model *m) {
    const rf_kernels *k = m->k;
    size_t blk = (size_t)1 << 24, n = m->n_params;
    float *h = malloc(sizeof(float) * blk);
    rf_rng r;
    rf_rng_seed(&r, 1);
    for (size_t i = 0; i < blk; i++) h[i] = 0.02f * rf_rng_normal(&r);
    size_t first = n < blk ? n : blk;
    k->to_device(m->params, h, sizeof(float) * first);
    for (size_t off = first; off < n; off += blk)
        k->copy(m->params + off, m->params, sizeof(float) * (n - off < blk ? n - off : blk));
    k->weights_updated();
    k->sync();
    free(h);
}

static double weight_bytes(const rf_model *m) {
    return (double)m->n_params * (m->k->get_precision() == RF_PRECISION_BF16 ? 2.0 : 4.0);
}

static void bench_train(rf_model *m, const char *shape, int B, int L, int reps) {
    int T = B * L, V = m->cfg.vocab_size;
    int32_t *tok = malloc(sizeof(int32_t) * T), *tgt = malloc(sizeof(int32_t) * T);
    int32_t *cu = malloc(sizeof(int32_t) * (B + 1));
    float *lp = malloc(sizeof(float) * T), *dlp = malloc(sizeof(float) * T);
    rf_rng r;
    rf_rng_seed(&r, 1);
    for (int t = 0; t < T; t++) {
        tok[t] = (int32_t)(rf_rng_u64(&r) % (uint64_t)V), tgt[t] = (int32_t)(rf_rng_u64(&r) % (uint64_t)V);
        dlp[t] = -1.0f / T;
    }
    for (int b = 0; b <= B; b++) cu[b] = b * L;
    rf_batch bt = {B, T, tok, NULL, cu};
    BENCH_TRY("train_step", shape, rf_model_enable_training(m));
    double best = 1e30;
    for (int i = 0; i < reps + 1; i++) {
        m->k->sync();
        if (g_profile && i == reps) profile_reset();
        double t0 = rf_time_now();
        rf_model_zero_grad(m);
        BENCH_TRY("train_step", shape, rf_model_forward(m, &bt));
        BENCH_TRY("train_step", shape, rf_model_logprobs(m, tgt, 1.0f, lp, NULL)); /* synchronises */
        BENCH_TRY("train_step", shape, rf_model_backward(m, dlp, NULL, NULL));
        m->k->sync();
        double el = rf_time_now() - t0;
        if (i > 0 && el < best) best = el; /* the first run warms up allocations and kernels */
        if (g_profile && i == reps) profile_print("train_step", el);
    }
    double tf = rf_model_train_flops_per_token(&m->cfg, L) * T / best / 1e12;
    printf("{\"bench\":\"train_step\",\"device\":\"cuda\",\"model\":\"%s\",\"params\":%zu,"
           "\"tokens\":%d,\"seconds\":%.4f,\"tokens_per_s\":%.1f,\"tflops\":%.2f,"
           "\"bf16_peak_tflops\":%.1f,\"fraction_of_peak\":%.3f}\n",
           shape, m->n_params, T, best, T / best, tf, g_peak_tflops, tf / g_peak_tflops);
    fflush(stdout);
done:
    free(tok), free(tgt), free(cu), free(lp), free(dlp);
}

static void bench_prefill(rf_model *m, const char *shape, int B, int L) {
    int V = m->cfg.vocab_size;
    rf_kv_cache kv = {0};
    int32_t *tok = malloc(sizeof(int32_t) * B * L);
    int *slots = malloc(sizeof(int) * B), *counts = malloc(sizeof(int) * B);
    for (int i = 0; i < B * L; i++) tok[i] = i % V;
    for (int b = 0; b < B; b++) slots[b] = b, counts[b] = L;
    float *logits = malloc(sizeof(float) * B * (size_t)V);
    BENCH_TRY("prefill", shape, rf_kv_cache_init(&kv, m, B, L));
    BENCH_TRY("prefill", shape, rf_model_decode(m, &kv, slots, counts, B, tok, logits)); /* warm-up */
    for (int b = 0; b < B; b++) kv.len[b] = 0;
    if (g_profile) profile_reset();
    double t0 = rf_time_now();
    BENCH_TRY("prefill", shape, rf_model_decode(m, &kv, slots, counts, B, tok, logits)); /* logits: D2H */
    double el = rf_time_now() - t0;
    if (g_profile) profile_print("prefill", el);
    double tf = 2.0 * m->n_params * B * L / el / 1e12;
    printf("{\"bench\":\"prefill\",\"device\":\"cuda\",\"model\":\"%s\",\"sequences\":%d,"
           "\"prompt_len\":%d,\"seconds\":%.4f,\"tokens_per_s\":%.1f,\"tflops\":%.2f,"
           "\"fraction_of_peak\":%.3f}\n", shape, B, L, el, B * L / el, tf, tf / g_peak_tflops);
    fflush(stdout);
done:
    rf_kv_cache_free(&kv, m);
    free(tok), free(slots), free(counts), free(logits);
}

static void bench_decode(rf_model *m, const char *shape, int B, int steps) {
    int P = 16, V = m->cfg.vocab_size;
    rf_kv_cache kv = {0};
    int32_t *tok = malloc(sizeof(int32_t) * B * P);
    int *slots = malloc(sizeof(int) * B), *counts = malloc(sizeof(int) * B), *ones = malloc(sizeof(int) * B);
    for (int i = 0; i < B * P; i++) tok[i] = (i * 31) % V;
    for (int b = 0; b < B; b++) slots[b] = b, counts[b] = P, ones[b] = 1;
    /* as the rollout engine decodes: the logits stay on the GPU and each step draws the next
     * tokens there (temperature 1, rf_model_draw), which feed the next step */
    rf_draw *draws = malloc(sizeof *draws * B);
    float *logp = malloc(sizeof(float) * B);
    rf_rng rng;
    rf_rng_seed(&rng, 1);
    for (int b = 0; b < B; b++) draws[b] = (rf_draw){b, {0, 1.0f, 0, 1.0f}, 0.0};
    BENCH_TRY("decode", shape, rf_kv_cache_init(&kv, m, B, P + steps + 1));
    BENCH_TRY("decode", shape, rf_model_decode(m, &kv, slots, counts, B, tok, NULL));
    BENCH_TRY("decode", shape, rf_model_draw(m, B, draws, B, tok, logp, NULL, 0, NULL, NULL, NULL)); /* warm-up */
    if (g_profile) profile_reset();
    double t0 = rf_time_now();
    for (int s = 0; s < steps; s++) {
        BENCH_TRY("decode", shape, rf_model_decode(m, &kv, slots, ones, B, tok, NULL));
        for (int b = 0; b < B; b++) draws[b].u = (double)rf_rng_uniform(&rng);
        BENCH_TRY("decode", shape, rf_model_draw(m, B, draws, B, tok, logp, NULL, 0, NULL, NULL, NULL));
    }
    double el = rf_time_now() - t0;
    if (g_profile) {
        char phase[32];
        snprintf(phase, sizeof phase, "decode%d", B);
        profile_print(phase, el);
    }
    /* each step reads every weight once (at the precision its products use) */
    double bw = weight_bytes(m) * steps / el / 1e9, tf = 2.0 * m->n_params * B * steps / el / 1e12;
    printf("{\"bench\":\"decode\",\"device\":\"cuda\",\"model\":\"%s\",\"sampling\":\"device\",\"batch\":%d,\"steps\":%d,"
           "\"seconds\":%.4f,\"tokens_per_s\":%.1f,\"weight_gb_per_s\":%.1f,\"copy_gb_per_s\":%.1f,"
           "\"fraction_of_bw\":%.3f,\"tflops\":%.2f,\"fraction_of_peak\":%.3f}\n",
           shape, B, steps, el, (double)B * steps / el, bw, g_bw, bw / g_bw, tf, tf / g_peak_tflops);
    fflush(stdout);
done:
    rf_kv_cache_free(&kv, m);
    free(tok), free(slots), free(counts), free(ones), free(draws), free(logp);
}

/* Seconds of the best of `reps` calls of fn(ctx) (after one warm-up), synchronised. */
typedef void (*timed_fn)(const rf_kernels *k, void *ctx);
static double best_time(const rf_kernels *k, timed_fn fn, void *ctx, int reps) {
    double best = 1e30;
    for (int r = 0; r < reps + 1; r++) {
        k->sync();
        double t0 = rf_time_now();
        fn(k, ctx);
        k->sync();
        double el = rf_time_now() - t0;
        if (r > 0 && el < best) best = el;
    }
    return best;
}

typedef struct {
    const rf_model_config *c;
    int n_seq, T;
    float *q, *kk, *v, *out, *lse, *dout, *dq, *dk, *dv, *x, *y, *w;
    int32_t *cu;
} att_ctx;

static void att_fwd(const rf_kernels *k, void *p) {
    att_ctx *a = p;
    k->attention_forward(a->out, a->lse, a->q, a->kk, a->v, a->cu, a->cu, a->cu + a->n_seq + 1,
                         a->n_seq, a->c->num_attention_heads, a->c->num_key_value_heads, a->c->head_dim);
}

static void att_bwd(const rf_kernels *k, void *p) {
    att_ctx *a = p;
    k->attention_backward(a->dq, a->dk, a->dv, a->dout, a->q, a->kk, a->v, a->out, a->lse, a->cu,
                          a->n_seq, a->T, a->c->num_attention_heads, a->c->num_key_value_heads,
                          a->c->head_dim);
}

/* The seven products of one layer's forward (q, k, v, o, gate, up, down) on T tokens. */
static void layer_matmuls(const rf_kernels *k, void *p) {
    att_ctx *a = p;
    int C = a->c->hidden_size, F = a->c->intermediate_size, T = a->T;
    int HD = a->c->num_attention_heads * a->c->head_dim, KD = a->c->num_key_value_heads * a->c->head_dim;
    int shapes[7][2] = {{C, HD}, {C, KD}, {C, KD}, {HD, C}, {C, F}, {C, F}, {F, C}};
    for (int i = 0; i < 7; i++) k->matmul_forward(a->y, a->x, a->w, NULL, T, shapes[i][0], shapes[i][1]);
}

/* Attention forward and backward of one layer against the forward products of the same layer
 * (the target: attention forward within 1.5x of them), B sequences of L tokens. */
static void bench_attention(const rf_kernels *k, const char *shape, const rf_model_config *c, int B,
                            int L, int reps) {
    int T = B * L, H = c->num_attention_heads, KVH = c->num_key_value_heads, D = c->head_dim;
    int C = c->hidden_size, F = c->intermediate_size;
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KVH * D, big = (size_t)T * (F > H * D ? F : H * D);
    att_ctx a = {c, B, T, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    float **bufs[] = {&a.q, &a.out, &a.dout, &a.dq, &a.kk, &a.v, &a.dk, &a.dv, &a.lse, &a.x, &a.y, &a.w};
    size_t sizes[] = {nq, nq, nq, nq, nk, nk, nk, nk, (size_t)T * H, big, big, (size_t)F * (F > C ? F : C)};
    int ok = 1;
    for (int i = 0; i < 12; i++) ok = ok && (*bufs[i] = k->alloc(sizeof(float) * sizes[i])) != NULL;
    int32_t *cu_h = malloc(sizeof(int32_t) * (2 * B + 1));
    for (int b = 0; b <= B; b++) cu_h[b] = b * L;
    for (int b = 0; b < B; b++) cu_h[B + 1 + b] = L;
    ok = ok && (a.cu = k->alloc(sizeof(int32_t) * (2 * B + 1))) != NULL;
    if (!ok) {
        printf("{\"bench\":\"attention\",\"model\":\"%s\",\"error\":\"%s\"}\n", shape, rf_error_message());
    } else {
        k->to_device(a.cu, cu_h, sizeof(int32_t) * (2 * B + 1));
        /* small values: softmax and its statistics finite whatever the path */
        for (int i = 0; i < 12; i++) k->zero(*bufs[i], sizeof(float) * sizes[i]);
        double mm = best_time(k, layer_matmuls, &a, reps);
        /* the path RLFLOW_CUDA_ATTENTION chooses; unset, the default (at precision bf16: bf16
         * attention, the tensor-core kernels) and then fp32 arithmetic (=fp32) */
        const char *e = getenv("RLFLOW_CUDA_ATTENTION");
        for (int pass = 0; pass < (e ? 1 : 2); pass++) {
            if (pass) setenv("RLFLOW_CUDA_ATTENTION", "fp32", 1);
            const char *path = getenv("RLFLOW_CUDA_ATTENTION");
            int bf16 = k->get_precision() == RF_PRECISION_BF16 &&
                       (!path || strcmp(path, "bf16") == 0 || strcmp(path, "fma") == 0);
            const char *kernels = (path && strcmp(path, "reference") == 0) || D > 128 ? "reference"
                                  : !bf16 ? "tiled fp32"
                                  : !path || strcmp(path, "bf16") == 0 ? "tiled bf16 (tensor cores where they apply)"
                                  : "tiled bf16 (FMA)";
            double fwd = best_time(k, att_fwd, &a, reps), bwd = best_time(k, att_bwd, &a, reps);
            printf("{\"bench\":\"attention\",\"device\":\"cuda\",\"model\":\"%s\",\"kernels\":\"%s\","
                   "\"sequences\":%d,\"seq_len\":%d,\"fwd_seconds\":%.5f,\"bwd_seconds\":%.5f,"
                   "\"layer_matmul_fwd_seconds\":%.5f,\"fwd_over_matmuls\":%.2f}\n", shape,
                   kernels, B, L, fwd, bwd, mm, fwd / mm);
            fflush(stdout);
            if (pass) unsetenv("RLFLOW_CUDA_ATTENTION");
        }
    }
    for (int i = 0; i < 12; i++) k->free(*bufs[i]);
    k->free(a.cu);
    free(cu_h);
}

typedef struct {
    const rf_model_config *c;
    int B, bs, max_blocks;
    float *out, *q, *kp, *vp;
    int32_t *q_off, *bt, *klen;
} paged_ctx;

static void paged_fwd(const rf_kernels *k, void *p) {
    paged_ctx *a = p;
    k->paged_attention_forward(a->out, a->q, a->kp, a->vp, a->q_off, a->bt, a->max_blocks,
                               a->klen, a->B, a->bs, a->c->num_attention_heads,
                               a->c->num_key_value_heads, a->c->head_dim);
}

/* One layer's attention of a decoding step over the paged KV cache: B sequences of one query
 * each over L cached keys (blocks of 16, scattered), as the rollout engine runs it. Decoding's
 * attention streams the sequences' K and V: GB/s of those bytes against copy_bw. Both ways of
 * running it, which give the same bits (cuda_flash.cu): split over key chunks
 * (RLFLOW_CUDA_DECODE=split) and one block per sequence and KV head (=tiled), unless
 * RLFLOW_CUDA_DECODE names one. */
static void bench_paged(const rf_kernels *k, const char *shape, const rf_model_config *c, int B,
                        int L, int reps) {
    int H = c->num_attention_heads, KVH = c->num_key_value_heads, D = c->head_dim, bs = 16;
    int mb = (L + bs - 1) / bs;
    size_t rows = (size_t)B * mb * bs, nq = (size_t)B * H * D, np = rows * KVH * D;
    paged_ctx a = {c, B, bs, mb, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    int32_t *qo = malloc(sizeof(int32_t) * (B + 1)), *kl = malloc(sizeof(int32_t) * B);
    int32_t *bt = malloc(sizeof(int32_t) * (size_t)B * mb);
    int ok = qo && kl && bt;
    ok = ok && (a.out = k->alloc(sizeof(float) * nq)) && (a.q = k->alloc(sizeof(float) * nq));
    ok = ok && (a.kp = k->alloc(sizeof(float) * np)) && (a.vp = k->alloc(sizeof(float) * np));
    ok = ok && (a.q_off = k->alloc(sizeof(int32_t) * (B + 1))) && (a.klen = k->alloc(sizeof(int32_t) * B));
    ok = ok && (a.bt = k->alloc(sizeof(int32_t) * (size_t)B * mb));
    if (!ok) {
        printf("{\"bench\":\"paged_attention\",\"model\":\"%s\",\"batch\":%d,\"error\":\"%s\"}\n", shape,
               B, rf_error_message());
        goto done;
    }
    for (int b = 0; b <= B; b++) qo[b] = b;
    for (int b = 0; b < B; b++) kl[b] = L;
    for (size_t i = 0; i < (size_t)B * mb; i++) bt[i] = (int32_t)((i * 389 + 11) % ((size_t)B * mb));
    k->to_device(a.q_off, qo, sizeof(int32_t) * (B + 1));
    k->to_device(a.klen, kl, sizeof(int32_t) * B);
    k->to_device(a.bt, bt, sizeof(int32_t) * (size_t)B * mb);
    k->zero(a.q, sizeof(float) * nq), k->zero(a.kp, sizeof(float) * np), k->zero(a.vp, sizeof(float) * np);
    /* both ways of running a decoding step (the same bits), unless RLFLOW_CUDA_DECODE names one */
    static const char *const modes[2] = {"split", "tiled"};
    const char *e = getenv("RLFLOW_CUDA_DECODE"), *att = getenv("RLFLOW_CUDA_ATTENTION");
    /* at precision bf16 (unless RLFLOW_CUDA_ATTENTION names another path) decoding runs the
     * tensor-core kernel, split or not as the FMA one; heads over 128 the reference kernel: one
     * pass */
    int tc = k->get_precision() == RF_PRECISION_BF16 && D % 16 == 0 && D <= 128 &&
             (!att || strcmp(att, "bf16") == 0);
    int ref = D > 128 || (att && strcmp(att, "reference") == 0);
    for (int pass = 0; pass < (e || ref ? 1 : 2); pass++) {
        if (!e) setenv("RLFLOW_CUDA_DECODE", modes[pass], 1);
        const char *mode = getenv("RLFLOW_CUDA_DECODE");
        double t = best_time(k, paged_fwd, &a, reps);
        double gb = 2.0 * B * L * KVH * D * sizeof(float) / 1e9;
        printf("{\"bench\":\"paged_attention\",\"device\":\"cuda\",\"model\":\"%s\",\"kernels\":\"%s\","
               "\"batch\":%d,\"context\":%d,\"seconds\":%.6f,\"kv_gb_per_s\":%.2f,\"copy_gb_per_s\":%.1f,"
               "\"fraction_of_bw\":%.3f}\n", shape,
               ref                          ? "reference"
               : strcmp(mode, "split") == 0 ? (tc ? "tensor cores, split over key chunks" : "tiled, split over key chunks")
               : tc ? "tensor cores, one block per row tile" : "tiled, one block per sequence and KV head",
               B, L, t, gb / t, g_bw, gb / t / g_bw);
        fflush(stdout);
        if (!e) unsetenv("RLFLOW_CUDA_DECODE");
    }
done:
    k->free(a.out), k->free(a.q), k->free(a.kp), k->free(a.vp);
    k->free(a.q_off), k->free(a.klen), k->free(a.bt);
    free(qo), free(kl), free(bt);
}

/* The device's free memory after a phase: what a later phase (7b's training) has left. */
static void memory_line(const rf_kernels *k, const char *shape, const char *after) {
    size_t free_b = 0, total_b = 0;
    if (k->mem_info(&free_b, &total_b) == 0)
        printf("{\"bench\":\"memory\",\"model\":\"%s\",\"after\":\"%s\",\"device_free_mb\":%zu,"
               "\"device_total_mb\":%zu}\n", shape, after, free_b >> 20, total_b >> 20);
    fflush(stdout);
}

static void bench_shape(const rf_kernels *k, const char *shape, int quick) {
    rf_model_config c;
    shape_config(&c, shape);
    rf_model *m;
    if (rf_model_init(&m, &c, k) != RF_OK) {
        printf("{\"bench\":\"model\",\"model\":\"%s\",\"error\":\"%s\"}\n", shape, rf_error_message());
        return;
    }
    fill_params(m);
    memory_line(k, shape, "weights");
    int big = strcmp(shape, "25m") != 0, steps = quick ? 8 : 32;
    bench_attention(k, shape, &c, big ? 4 : 8, big ? 1024 : 256, quick ? 2 : 5);
    for (int b = 1; b <= 256; b *= 16) /* 1, 16, 256 sequences over 1024 keys */
        bench_paged(k, shape, &c, b, 1024, quick ? 3 : 10);
    memory_line(k, shape, "attention");
    /* generation first (no gradients held yet), then training */
    bench_prefill(m, shape, 8, big ? 1024 : 256);
    memory_line(k, shape, "prefill");
    bench_decode(m, shape, 1, steps);
    bench_decode(m, shape, 32, steps);
    bench_decode(m, shape, 256, steps);
    memory_line(k, shape, "generation");
    /* 7b: 4 x 27 GB of fp32 weights, gradients and AdamW moments and the 13.5 GB bf16 copy
     * leave ~20 GB of an H200 for activations: 2 x 1024 tokens */
    int B = strcmp(shape, "7b") == 0 ? 2 : big ? 4 : 8;
    bench_train(m, shape, B, big ? 1024 : 256, quick ? 1 : 3);
    rf_model_free(m);
}

int main(int argc, char **argv) {
    int quick = 0;
    const char *prec = "bf16", *which = "all";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else if (strcmp(argv[i], "--precision") == 0 && i + 1 < argc) prec = argv[++i];
        else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc) which = argv[++i];
        else if (strcmp(argv[i], "--profile") == 0) g_profile = 1;
        else {
            fprintf(stderr, "bench_cuda: unknown option \"%s\" (usage: bench_cuda [--quick] "
                    "[--precision bf16|fp32] [--model 25m|qwen0.5b|7b|all] [--profile])\n", argv[i]);
            return 2;
        }
    }
    if (strcmp(prec, "bf16") != 0 && strcmp(prec, "fp32") != 0) {
        fprintf(stderr, "bench_cuda: --precision: \"%s\" is not bf16 or fp32\n", prec);
        return 2;
    }
    if (strcmp(which, "all") && strcmp(which, "25m") && strcmp(which, "qwen0.5b") && strcmp(which, "7b")) {
        fprintf(stderr, "bench_cuda: --model: \"%s\" is not 25m, qwen0.5b, 7b or all\n", which);
        return 2;
    }
    const rf_kernels *k = rf_cuda_kernels(0);
    if (!k) {
        printf("{\"bench\":\"skipped\",\"reason\":\"%s\"}\n", rf_error_message());
        return 77;
    }
    if (k->set_precision(strcmp(prec, "bf16") == 0 ? RF_PRECISION_BF16 : RF_PRECISION_FP32) != RF_OK) {
        fprintf(stderr, "bench_cuda: %s\n", rf_error_message());
        return 1;
    }
    /* --profile: every op of the model's passes waits for the device before and after it, so
     * each op's time is its own (plus a launch's latency); the phases' own figures then
     * include those waits */
    if (g_profile) k = bench_timed_kernels(k, 1);
    g_peak_tflops = bf16_peak(8192, quick ? 3 : 10);
    g_bw = copy_bw((size_t)2 << 30, quick ? 3 : 10);
    printf("{\"bench\":\"bf16_peak\",\"m\":8192,\"n\":8192,\"k\":8192,\"tflops\":%.1f}\n", g_peak_tflops);
    printf("{\"bench\":\"copy_bw\",\"bytes\":%zu,\"gb_per_s\":%.1f}\n", (size_t)2 << 30, g_bw);
    printf("{\"bench\":\"config\",\"precision\":\"%s\",\"tf32\":\"%s\",\"attention\":\"%s\"}\n", prec,
           getenv("RLFLOW_CUDA_TF32") ? getenv("RLFLOW_CUDA_TF32") : "default (on)",
           getenv("RLFLOW_CUDA_ATTENTION") ? getenv("RLFLOW_CUDA_ATTENTION") : "default (bf16 at precision bf16)");
    fflush(stdout);
    const char *shapes[3] = {"25m", "qwen0.5b", "7b"};
    for (int i = 0; i < 3; i++)
        if (strcmp(which, "all") == 0 || strcmp(which, shapes[i]) == 0) bench_shape(k, shapes[i], quick);
    return 0;
}
