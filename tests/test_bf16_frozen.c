/* Frozen models with bf16-resident weights (rf_model_load_frozen, kernels.h bind_bf16): a bf16
 * checkpoint's matrices used as the products' operands as stored, with no fp32 copy.
 *
 * What it proves:
 *  - bound products (rf_cpu_gemm with B in a bound range whose floats are NaN) equal, bit for bit,
 *    the same products on an fp32 array holding the bf16 values, in bf16 and fp32 mode, for the
 *    decode shapes (M = 1..4, the matrix-vector path), prefill/training shapes (primitives),
 *    B read transposed or not; the NaNs show any read of the fp32 memory;
 *  - whole models (the "small" preset tied with q/k/v biases, saved as BF16 here; the Qwen3
 *    sharded BF16 golden model, untied with q/k norms; a value head): log-probs, entropies,
 *    values, greedy and sampled generation (ids and behaviour log-probs) of the frozen load
 *    are bit for bit those of rf_model_load at the same precision: rounding a bf16 value to bf16
 *    is the identity, so both paths multiply the same operands. In fp32 mode too (the bound
 *    values widened, exactly);
 *  - the frozen model keeps no fp32 matrix: the pages of params under a projection matrix are
 *    never made resident (mincore), where rf_model_load's are;
 *  - fallbacks (fp32 precision, an F32 checkpoint) load fp32; refusals name the operation;
 *    saving a frozen model writes the same tensors;
 *  - the LM head's kept logits (up to 512 MB) are given back by rf_model_trim, and a frozen
 *    model's log-probs keep none.
 * ctest also runs it with oneDNN capped at AVX2 (bf16 emulated: the bound values widened). */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/rng.h"
#include "common/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernels.h"
#include "model/dtype.h"
#include "model/generate.h"
#include "model/model.h"
#include "mem_util.h"
#include "test_util.h"

#define K (rf_cpu_kernels())

/* ---- bound products ---- */

/* C = A (M, Kd) @ op(B) with B (N, Kd) read transposed (tb) or B (Kd, N) (!tb), once on B32
 * (fp32 values) and once on a bound range whose floats are NaN: the same bits. */
static void check_bound_product(int M, int N, int Kd, int tb, rf_precision p) {
    size_t nb = (size_t)N * Kd;
    float *A = malloc(sizeof(float) * (size_t)M * Kd), *B32 = malloc(sizeof(float) * nb),
          *Bnan = malloc(sizeof(float) * nb), *C1 = malloc(sizeof(float) * (size_t)M * N),
          *C2 = malloc(sizeof(float) * (size_t)M * N);
    uint16_t *Bb = malloc(sizeof(uint16_t) * nb);
    rf_rng r;
    rf_rng_seed(&r, (uint64_t)(M * 131 + N * 7 + Kd + tb));
    for (size_t i = 0; i < (size_t)M * Kd; i++) A[i] = rf_rng_normal(&r);
    for (size_t i = 0; i < nb; i++) {
        Bb[i] = rf_f32_to_bf16(rf_rng_normal(&r));
        B32[i] = rf_bf16_to_f32(Bb[i]);
        Bnan[i] = NAN;
    }
    CHECK_OK(K->set_precision(p));
    CHECK_OK(K->bind_bf16(Bnan, Bb, nb));
    int ldb = tb ? Kd : N;
    for (int beta = 0; beta < 2; beta++) {
        for (size_t i = 0; i < (size_t)M * N; i++) C1[i] = C2[i] = 0.25f * (float)(i % 7);
        rf_cpu_gemm(0, tb, M, N, Kd, 0.5f, A, Kd, B32, ldb, (float)beta, C1, N, 1);
        rf_cpu_gemm(0, tb, M, N, Kd, 0.5f, A, Kd, Bnan, ldb, (float)beta, C2, N, 1);
        int same = memcmp(C1, C2, sizeof(float) * (size_t)M * N) == 0;
        if (!same)
            fprintf(stderr, "bound product M=%d N=%d K=%d tb=%d %s beta=%d differs: %g vs %g\n", M, N, Kd, tb,
                    p == RF_PRECISION_BF16 ? "bf16" : "fp32", beta, C1[0], C2[0]);
        CHECK(same);
    }
    CHECK(rf_cpu_bf16_bound(Bnan + 5) == Bb + 5);
    CHECK_OK(K->bind_bf16(Bnan, NULL, 0));
    CHECK(rf_cpu_bf16_bound(Bnan + 5) == NULL);
    free(A), free(B32), free(Bnan), free(C1), free(C2), free(Bb);
}

static void test_bound_products(void) {
    static const int shapes[][3] = {{1, 96, 64}, {3, 130, 48}, {4, 64, 64}, {37, 96, 80}, {128, 200, 64}};
    for (int p = 0; p < 2; p++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int tb = 0; tb < 2; tb++)
                check_bound_product(shapes[s][0], shapes[s][1], shapes[s][2], tb,
                                    p ? RF_PRECISION_BF16 : RF_PRECISION_FP32);
    printf("bound products: bit-identical to the fp32 array's in both precisions\n");
}

/* ---- whole models ---- */

/* Packed batch of 3 sequences (vocabulary V) run through m: log-probs and entropies (T). */
static int batch_logprobs(rf_model *m, int V, float *lp, float *en) {
    enum { T = 40 };
    int32_t tok[T], tgt[T], cu[4] = {0, 11, 30, T};
    for (int t = 0; t < T; t++) tok[t] = (t * 37 + 11) % V, tgt[t] = (t * 53 + 7) % V;
    rf_batch b = {3, T, tok, NULL, cu};
    CHECK_OK(rf_model_forward(m, &b));
    CHECK_OK(rf_model_logprobs(m, tgt, 0.8f, lp, en));
    return T;
}

/* Greedy (sampled = 0) or sampled generation of 24 tokens from two prompts: ids and behaviour
 * log-probs must be the same bits on a and b. */
static void check_generate_same(rf_model *a, rf_model *b, int V, int sampled) {
    int32_t p0[] = {1, 5 % V, 9 % V}, p1[] = {7 % V, 3, 3, 200 % V, 11 % V};
    const int32_t *ps[] = {p0, p1};
    int lens[] = {3, 5};
    rf_gen_params gp = {.sampling = {.greedy = !sampled, .temperature = 1.0f, .top_p = 1.0f},
                        .max_new_tokens = 24, .seed = 42};
    rf_gen_output oa[2], ob[2];
    CHECK_OK(rf_generate(a, NULL, ps, lens, 2, &gp, oa, 0));
    CHECK_OK(rf_generate(b, NULL, ps, lens, 2, &gp, ob, 0));
    for (int i = 0; i < 2; i++) {
        CHECK(oa[i].n_tokens == ob[i].n_tokens && oa[i].n_tokens > 0);
        int n = oa[i].n_tokens < ob[i].n_tokens ? oa[i].n_tokens : ob[i].n_tokens;
        CHECK(memcmp(oa[i].tokens, ob[i].tokens, sizeof(int32_t) * (size_t)n) == 0);
        CHECK(memcmp(oa[i].logprobs, ob[i].logprobs, sizeof(float) * (size_t)n) == 0);
        rf_gen_output_free(&oa[i]), rf_gen_output_free(&ob[i]);
    }
}

/* The frozen load of dir against rf_model_load, at bf16 and then at fp32 (set after loading:
 * the bound values widened). */
static void check_model_dir(const char *dir, const char *what) {
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    rf_model *a = NULL, *b = NULL;
    CHECK_OK(rf_model_load(&a, dir, K, 0));
    CHECK_OK(rf_model_load_frozen(&b, dir, K, 0));
    if (!a || !b) {
        rf_model_free(a), rf_model_free(b);
        return;
    }
    CHECK(a->wbf16 == NULL && b->wbf16 != NULL);
    int V = a->cfg.vocab_size;
    float la[64], ea[64], lb[64], eb[64];
    for (int p = 0; p < 2; p++) {
        CHECK_OK(K->set_precision(p ? RF_PRECISION_FP32 : RF_PRECISION_BF16));
        int T = batch_logprobs(a, V, la, ea);
        batch_logprobs(b, V, lb, eb);
        CHECK(memcmp(la, lb, sizeof(float) * (size_t)T) == 0);
        CHECK(memcmp(ea, eb, sizeof(float) * (size_t)T) == 0);
        CHECK(isfinite(lb[0]) && lb[0] < 0);
        check_generate_same(a, b, V, 0);
        check_generate_same(a, b, V, 1);
    }
    /* the matrices' fp32 memory: never touched in the frozen model, filled in the other (where
     * the buffer is a fresh mapping, 1 MB and up outside AddressSanitizer builds: other blocks
     * come cleared from malloc) */
    const rf_param_view *q = rf_model_find(b, "model.layers.0.self_attn.q_proj.weight");
    int ra = q ? rf_test_resident_pages(a, q->offset, q->numel) : -1, rb = q ? rf_test_resident_pages(b, q->offset, q->numel) : -1;
    printf("%s: frozen bf16 load bit-identical (bf16 and fp32 mode); q_proj fp32 pages resident: "
           "%d (rf_model_load), %d (frozen)\n", what, ra, rb);
#ifdef __SANITIZE_ADDRESS__
    int mapped = 0; /* AddressSanitizer builds: every block from malloc, cleared (cpu_kernels.c) */
#else
    int mapped = b->n_params * sizeof(float) >= ((size_t)1 << 20);
#endif
    if (mapped) {
        CHECK(rb == 0);
        CHECK(ra > 0);
    }
    rf_model_free(a), rf_model_free(b);
}

/* The "small" preset (tied, q/k/v biases), random, saved as BF16 into dir/bf16 (and as F32
 * into dir/f32). */
static void make_small(const char *dir) {
    rf_model_config c;
    CHECK_OK(rf_config_preset(&c, "small", 512));
    rf_model *m = NULL;
    CHECK_OK(rf_model_init(&m, &c, K));
    if (!m) return;
    rf_model_init_random(m, 7, 0.05f);
    /* random norms and biases too, so that a mix-up of 1-D tensors shows */
    rf_rng r;
    rf_rng_seed(&r, 8);
    for (int i = 0; i < m->n_views; i++)
        if (m->views[i].ndim == 1)
            for (size_t j = 0; j < m->views[i].numel; j++)
                m->params[m->views[i].offset + j] = (strstr(m->views[i].name, "norm") ? 1.0f : 0.0f) + 0.2f * rf_rng_normal(&r);
    K->weights_updated();
    char p[4096];
    snprintf(p, sizeof p, "%s/bf16", dir);
    CHECK_OK(rf_model_save(m, p, 1, 0));
    snprintf(p, sizeof p, "%s/f32", dir);
    CHECK_OK(rf_model_save(m, p, 0, 0));
    rf_model_free(m);
}

/* A value head (the "small" preset with a random score.weight) saved as BF16: the frozen and
 * plain loads give the same values, bit for bit, and not zeros. */
static void check_value_head(const char *root) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/value_head", root);
    rf_model_config c;
    CHECK_OK(rf_config_preset(&c, "small", 512));
    c.value_head = 1;
    rf_model *m = NULL, *a = NULL, *b = NULL;
    CHECK_OK(rf_model_init(&m, &c, K));
    if (!m) return;
    rf_model_init_random(m, 11, 0.05f);
    CHECK_OK(rf_model_save(m, dir, 1, 0));
    rf_model_free(m);
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    CHECK_OK(rf_model_load(&a, dir, K, 1));
    CHECK_OK(rf_model_load_frozen(&b, dir, K, 1));
    if (!a || !b) {
        rf_model_free(a), rf_model_free(b);
        return;
    }
    CHECK(b->wbf16 != NULL && b->score != NULL);
    int32_t tok[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, cu[2] = {0, 9};
    rf_batch bt = {1, 9, tok, NULL, cu};
    float va[9], vb[9];
    CHECK_OK(rf_model_forward(a, &bt));
    CHECK_OK(rf_model_values(a, va));
    CHECK_OK(rf_model_forward(b, &bt));
    CHECK_OK(rf_model_values(b, vb));
    CHECK(memcmp(va, vb, sizeof va) == 0);
    CHECK(va[0] != 0.0f && isfinite(va[8]));
    rf_model_free(a), rf_model_free(b);
}

/* fp32 precision or an F32 checkpoint: the frozen load is rf_model_load's; refusals and save. */
static void check_fallbacks_and_refusals(const char *dir) {
    char bf[4096], f32[4096], out[4096];
    snprintf(bf, sizeof bf, "%s/bf16", dir);
    snprintf(f32, sizeof f32, "%s/f32", dir);
    snprintf(out, sizeof out, "%s/saved", dir);
    rf_model *m = NULL;
    CHECK_OK(K->set_precision(RF_PRECISION_FP32));
    CHECK_OK(rf_model_load_frozen(&m, bf, K, 0));
    CHECK(m && m->wbf16 == NULL);
    rf_model_free(m), m = NULL;
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    CHECK_OK(rf_model_load_frozen(&m, f32, K, 0));
    CHECK(m && m->wbf16 == NULL);
    rf_model_free(m), m = NULL;
    CHECK_OK(rf_model_load_frozen(&m, bf, K, 0));
    if (!m) return;
    CHECK_ERR(rf_model_enable_training(m), RF_ERR_UNSUPPORTED,
              "training: the model was loaded frozen with its weights in bf16 (rf_model_load_frozen), which never change");
    CHECK_ERR(rf_model_load_params(m, bf, NULL, NULL), RF_ERR_UNSUPPORTED,
              ": the model was loaded frozen with its weights in bf16");
    CHECK_ERR(rf_model_share_params(m), RF_ERR_UNSUPPORTED,
              "sharing parameters between processes: the model was loaded frozen");
    /* saving widens the bf16 matrices: the F32 copy loads to the same floats as the original */
    CHECK_OK(rf_model_save(m, out, 0, 0));
    rf_model *s = NULL, *o = NULL;
    CHECK_OK(rf_model_load(&s, out, K, 0));
    CHECK_OK(rf_model_load(&o, bf, K, 0));
    CHECK(s && o && s->n_params == o->n_params &&
          memcmp(s->params, o->params, sizeof(float) * o->n_params) == 0);
    rf_model_free(s), rf_model_free(o), rf_model_free(m);
}

/* The LM head's kept logits: made by a trainable model's log-probs, given back by
 * rf_model_trim; none kept for a frozen model. */
static void check_kept_logits(const char *dir) {
    char bf[4096];
    snprintf(bf, sizeof bf, "%s/bf16", dir);
    CHECK_OK(K->set_precision(RF_PRECISION_BF16));
    rf_model *a = NULL, *b = NULL;
    CHECK_OK(rf_model_load(&a, bf, K, 0));
    CHECK_OK(rf_model_load_frozen(&b, bf, K, 0));
    if (!a || !b) {
        rf_model_free(a), rf_model_free(b);
        return;
    }
    float lp[64], en[64];
    rf_model_trim(a);
    CHECK(rf_cpu_logprob_kept_bytes() == 0);
    batch_logprobs(b, 512, lp, en);
    CHECK(rf_cpu_logprob_kept_bytes() == 0);
    batch_logprobs(a, 512, lp, en);
    size_t kept = rf_cpu_logprob_kept_bytes();
    printf("kept logits after a (40, 512) forward: %zu bytes; after rf_model_trim: ", kept);
    CHECK(kept >= 40 * 512 * sizeof(float));
    rf_model_trim(a);
    printf("%zu\n", rf_cpu_logprob_kept_bytes());
    CHECK(rf_cpu_logprob_kept_bytes() == 0);
    rf_model_free(a), rf_model_free(b);
}

int main(void) {
    test_bound_products();
    char dir[] = "/tmp/rf_bf16_frozen_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    make_small(dir);
    char p[4096];
    snprintf(p, sizeof p, "%s/bf16", dir);
    check_model_dir(p, "small (tied, biases)");
    check_value_head(dir);
    const char *src = getenv("RF_SOURCE_DIR");
    if (src) {
        snprintf(p, sizeof p, "%s/tests/data/hf/qwen3_sharded_bf16", src);
        check_model_dir(p, "qwen3_sharded_bf16 (untied, q/k norms, 3 shards)");
    } else {
        printf("qwen3_sharded_bf16: skipped (RF_SOURCE_DIR not set)\n");
    }
    check_fallbacks_and_refusals(dir);
    check_kept_logits(dir);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rf_test_finish("test_bf16_frozen");
}
