/* LoRA against full fine-tuning on the CPU back end, printed as JSON lines:
 *  - lora_memory: bytes of parameters + gradients + AdamW moments for full training and for
 *    LoRA (rank 8 on q, v and rank 16 on every projection) on the bench's 25M model and on the
 *    Qwen2.5-0.5B shape, read from models built here with their adapters attached (the
 *    allocated adapter count is checked against rf_lora_param_count), with the fraction saved;
 *  - lora_train_step: forward + log-probs + backward + AdamW of the 25M model on 8 x 256 tokens
 *    ("shape":"25m"), and of a random-init model of the Qwen2.5-0.5B shape on 1 x 128 tokens
 *    (1 x 32 with --quick; "shape":"qwen2.5-0.5b": ~9 GB of host memory for its full step),
 *    full and with adapters, seconds (best of reps) and the ratio to full;
 *  - lora_decode: KV-cache decoding at batch 32 with unmerged adapters and with them merged into
 *    the weights, tokens/s and the ratio (the cost of unmerged generation), the seconds one
 *    merge takes (rf_lora_merge, on the host in double) and the tokens after which merging
 *    would have paid for itself (-1: never); a run's adapters change every version.
 * Hardware reference of the same run: sgemm_peak (OpenBLAS on the model's MLP shape).
 * Usage: bench_lora [--quick] */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "bench/bench_step.h"
#include "model/lora.h"
#include "trainer/optim.h"

static const unsigned QV = 1u << RF_LORA_Q | 1u << RF_LORA_V, ALL = (1u << RF_LORA_N) - 1;

static double sgemm_peak(int M, int N, int K, int reps) {
    float *a = calloc((size_t)M * K, 4), *b = calloc((size_t)N * K, 4), *c = calloc((size_t)M * N, 4);
    double best = 0;
    for (int r = 0; r < reps + 1; r++) {
        double t = rf_time_now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, a, K, b, K, 0, c, N);
        double g = 2.0 * M * N * K / (rf_time_now() - t) / 1e9;
        best = r && g > best ? g : best;
    }
    free(a), free(b), free(c);
    return best;
}

static void qwen05b_config(rf_model_config *c) {
    RF_ASSERT(rf_config_preset(c, "25m", 16384) == RF_OK);
    c->hidden_size = 896, c->intermediate_size = 4864, c->num_hidden_layers = 24;
    c->num_attention_heads = 14, c->num_key_value_heads = 2, c->head_dim = 64;
    c->vocab_size = 151936, c->rope_theta = 1e6f, c->tie_word_embeddings = 1, c->qkv_bias = 1;
}

/* Bytes of params + grads + both moments for n_params floats of which n_trained are trained. */
static double train_bytes(size_t n_params, size_t n_trained) { return 4.0 * ((double)n_params + 3.0 * (double)n_trained); }

static void memory_line(const char *shape, size_t base, int rank, unsigned targets, const rf_model_config *c,
                        size_t measured_lora_trained) {
    rf_lora_opts o = {rank, 2.0f * rank, 0, targets, RF_LORA_INIT_GAUSSIAN, 1};
    size_t n = rf_lora_param_count(&o, c);
    double full = train_bytes(base, base), lora = train_bytes(base + n, n);
    printf("{\"bench\":\"lora_memory\",\"shape\":\"%s\",\"rank\":%d,\"targets\":\"%s\",\"base_params\":%zu,"
           "\"adapter_params\":%zu,\"full_bytes\":%.0f,\"lora_bytes\":%.0f,\"saved_bytes\":%.0f,\"saved_fraction\":%.4f,"
           "\"measured\":%s}\n", shape, rank, targets == QV ? "q,v" : "all", base, n, full, lora, full - lora,
           (full - lora) / full, measured_lora_trained ? "true" : "false");
    if (measured_lora_trained) RF_ASSERT(measured_lora_trained == n); /* the model allocated exactly that */
}

/* A random-init model of config c, with adapters when rank > 0. */
static rf_model *model_of(const rf_model_config *c, int rank, unsigned targets) {
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, 1, 0.02f);
    if (rank) {
        rf_lora_opts o = {rank, 2.0f * rank, 0, targets, RF_LORA_INIT_GAUSSIAN, 1};
        RF_ASSERT(rf_model_lora_attach(m, &o) == RF_OK);
    }
    return m;
}

static rf_model *model_25m(int rank, unsigned targets) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "25m", 16384) == RF_OK);
    return model_of(&c, rank, targets);
}

static void bench_memory(void) {
    int ranks[2] = {8, 16};
    unsigned tg[2] = {QV, ALL};
    rf_model_config shapes[2];
    const char *names[2] = {"25m", "qwen2.5-0.5b"};
    RF_ASSERT(rf_config_preset(&shapes[0], "25m", 16384) == RF_OK);
    qwen05b_config(&shapes[1]);
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < 2; i++) { /* the adapters the model allocates for training (~2 GB at 0.5B) */
            rf_model *m = model_of(&shapes[s], ranks[i], tg[i]);
            RF_ASSERT(rf_model_enable_training(m) == RF_OK);
            memory_line(names[s], m->n_frozen, ranks[i], tg[i], &m->cfg, m->n_params - m->n_frozen);
            rf_model_free(m);
        }
}

/* Seconds of one training step with its AdamW step on B x L tokens (best of reps after a
 * warm-up). */
static double train_step(rf_model *m, int reps, int B, int L) {
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    rf_optim_opts o = {.lr = 1e-5f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .grad_clip = 1.0f};
    return rf_bench_train_step_batch(m, reps, &o, B, L);
}

/* Full training against rank 8 on q, v and rank 16 everywhere, on one shape: one model at a
 * time (the 0.5B shape's full step holds ~8 GB of weights, gradients and moments). */
static void bench_train_shape(const char *shape, const rf_model_config *c, int reps, int B, int L, double peak) {
    rf_model *m = model_of(c, 0, 0);
    double full = train_step(m, reps, B, L);
    rf_model_free(m);
    printf("{\"bench\":\"lora_train_step\",\"shape\":\"%s\",\"tokens\":\"%dx%d\",\"mode\":\"full\",\"seconds\":%.4f,"
           "\"ratio_to_full\":1.000,\"sgemm_peak_gflops\":%.2f}\n", shape, B, L, full, peak);
    fflush(stdout);
    int ranks[2] = {8, 16};
    unsigned tg[2] = {QV, ALL};
    for (int i = 0; i < 2; i++) {
        m = model_of(c, ranks[i], tg[i]);
        double s = train_step(m, reps, B, L);
        printf("{\"bench\":\"lora_train_step\",\"shape\":\"%s\",\"tokens\":\"%dx%d\",\"mode\":\"lora\",\"rank\":%d,"
               "\"targets\":\"%s\",\"seconds\":%.4f,\"ratio_to_full\":%.3f,\"sgemm_peak_gflops\":%.2f}\n", shape, B, L,
               ranks[i], tg[i] == QV ? "q,v" : "all", s, s / full, peak);
        fflush(stdout);
        rf_model_free(m);
    }
}

static void bench_train(int quick, double peak) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "25m", 16384) == RF_OK);
    bench_train_shape("25m", &c, quick ? 1 : 3, RF_BENCH_STEP_SEQS, RF_BENCH_STEP_LEN, peak);
    qwen05b_config(&c);
    bench_train_shape("qwen2.5-0.5b", &c, 1, 1, quick ? 32 : 128, peak);
}

/* tokens/s of `steps` decoding steps of B sequences after a 16-token prefill. */
static double decode_rate(rf_model *m, int B, int steps) {
    rf_kv_cache kv;
    RF_ASSERT(rf_kv_cache_init(&kv, m, B, 16 + steps + 1) == RF_OK);
    int *slots = malloc(sizeof(int) * B), *counts = malloc(sizeof(int) * B);
    int32_t *tok = malloc(sizeof(int32_t) * B * 16);
    float *logits = malloc(sizeof(float) * (size_t)B * m->cfg.vocab_size);
    for (int i = 0; i < B; i++) slots[i] = i, counts[i] = 16;
    for (int i = 0; i < B * 16; i++) tok[i] = (i * 37) % 16384;
    RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
    for (int i = 0; i < B; i++) counts[i] = 1;
    double t0 = rf_time_now();
    for (int s = 0; s < steps; s++) RF_ASSERT(rf_model_decode(m, &kv, slots, counts, B, tok, logits) == RF_OK);
    double el = rf_time_now() - t0;
    rf_kv_cache_free(&kv, m);
    free(slots), free(counts), free(tok), free(logits);
    return (double)B * steps / el;
}

static void bench_decode(int steps) {
    int B = 32;
    rf_model *m = model_25m(16, ALL);
    double un = 0, me = 0;
    for (int r = 0; r < 2; r++) { /* best of two */
        double x = decode_rate(m, B, steps);
        un = x > un ? x : un;
    }
    double t = rf_time_now();
    RF_ASSERT(rf_lora_merge(m) == RF_OK);
    double merge_s = rf_time_now() - t;
    for (int r = 0; r < 2; r++) {
        double x = decode_rate(m, B, steps);
        me = x > me ? x : me;
    }
    rf_model_free(m);
    /* merging pays once it has saved its own time: tokens generated after it until then */
    double saved_per_token = 1.0 / un - 1.0 / me;
    printf("{\"bench\":\"lora_decode\",\"batch\":%d,\"rank\":16,\"targets\":\"all\",\"unmerged_tokens_per_s\":%.1f,"
           "\"merged_tokens_per_s\":%.1f,\"unmerged_over_merged\":%.3f,\"merge_seconds\":%.3f,"
           "\"break_even_tokens\":%.0f}\n", B, un, me, un / me, merge_s,
           saved_per_token > 0 ? merge_s / saved_per_token : -1.0);
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    double peak = sgemm_peak(2048, 1408, 512, quick ? 2 : 5);
    printf("{\"bench\":\"sgemm_peak\",\"m\":2048,\"n\":1408,\"k\":512,\"gflops\":%.2f}\n", peak);
    bench_memory();
    bench_train(quick, peak);
    bench_decode(quick ? 8 : 32);
    return 0;
}
