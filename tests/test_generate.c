/* Sampling and generation: the sampler's distribution matches softmax(z / T) (chi-square over
 * 200k draws), top-k and top-p keep exactly the tokens they should, behaviour log-probs equal
 * log softmax(z / T), seeds reproduce; generation stops at EOS ids and stop strings, honours
 * max_new_tokens, and a sequence's output does not depend on the rest of the batch. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/byte_tokenizer.h"
#include "model/generate.h"
#include "test_util.h"

static void softmax(const float *z, int V, float T, double *p) {
    double m = -1e30, s = 0;
    for (int j = 0; j < V; j++) m = z[j] / T > m ? z[j] / T : m;
    for (int j = 0; j < V; j++) s += p[j] = exp(z[j] / T - m);
    for (int j = 0; j < V; j++) p[j] /= s;
}

/* The draw by sorting the whole row (no selection): ids by logit descending, lower id first,
 * cut to top_k, cut at the first place the mass reaches top_p, drawn with u over the rest. */
static const float *g_keys;
static int desc(const void *a, const void *b) {
    float x = g_keys[*(const int32_t *)a], y = g_keys[*(const int32_t *)b];
    return x != y ? (x > y ? -1 : 1) : *(const int32_t *)a - *(const int32_t *)b;
}

static int32_t by_sorting(const float *z, int V, const rf_sampling *s, double u) {
    double it = 1.0 / s->temperature, m = -INFINITY, sum = 0;
    for (int j = 0; j < V; j++) m = fmax(m, (double)z[j]);
    for (int j = 0; j < V; j++) sum += exp(((double)z[j] - m) * it);
    double lse = m * it + log(sum), cum = 0, total = 0;
    int32_t *ids = malloc(sizeof *ids * (size_t)V);
    for (int j = 0; j < V; j++) ids[j] = j;
    g_keys = z;
    qsort(ids, (size_t)V, sizeof *ids, desc);
    int n = s->top_k > 0 && s->top_k < V ? s->top_k : V;
    for (int i = 0; s->top_p < 1.0f && i < n; i++)
        if ((cum += exp((double)z[ids[i]] * it - lse)) >= s->top_p) n = i + 1;
    for (int i = 0; i < n; i++) total += exp((double)z[ids[i]] * it - lse);
    int32_t pick = ids[n - 1];
    cum = 0;
    for (int i = 0; i < n; i++)
        if (u * total < (cum += exp((double)z[ids[i]] * it - lse))) {
            pick = ids[i];
            break;
        }
    free(ids);
    return pick;
}

/* rf_sample_u's top-k / top-p draw (candidates by selection) against sorting the whole row:
 * rows of 1000 logits (spread, peaked, many ties, flat) and of 3, every kind of cut, 40 draws
 * each: the same token every time. */
static void sampler_selection(void) {
    enum { V = 1000 };
    float *z = malloc(sizeof(float) * V), *work = malloc(sizeof(float) * 2 * V);
    const rf_sampling kinds[] = {{0, 1.0f, 1, 1.0f},    {0, 1.0f, 5, 1.0f},     {0, 0.7f, 50, 1.0f},
                                 {0, 1.0f, 999, 1.0f},  {0, 1.0f, 1000, 1.0f},  {0, 1.0f, 1500, 1.0f},
                                 {0, 1.0f, 0, 0.01f},   {0, 1.3f, 0, 0.5f},     {0, 1.0f, 0, 0.9f},
                                 {0, 1.0f, 0, 0.999f},  {0, 0.8f, 40, 0.95f},   {0, 2.0f, 300, 0.999f}};
    int same = 1, draws = 0;
    rf_rng r;
    rf_rng_seed(&r, 9);
    for (int row = 0; row < 5; row++) {
        int n = row == 4 ? 3 : V;
        for (int j = 0; j < n; j++)
            z[j] = row == 0 ? 4.0f * rf_rng_uniform(&r) : row == 1 ? (j % 97 == 5 ? 12.0f : rf_rng_uniform(&r))
                 : row == 2 ? (float)(j % 4) : row == 3 ? 0.0f : (float)j;
        for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++)
            for (int d = 0; d < 40; d++) {
                double u = (d + 0.5) / 40;
                float lp;
                int32_t got = rf_sample_u(z, n, &kinds[k], u, &lp, work), want = by_sorting(z, n, &kinds[k], u);
                if (got != want)
                    fprintf(stderr, "row %d, top_k %d, top_p %g, u %g: %d, by sorting %d\n", row, kinds[k].top_k,
                            kinds[k].top_p, u, got, want);
                same &= got == want, draws++;
            }
    }
    CHECK(same);
    CHECK(draws == 5 * 12 * 40);
    free(z), free(work);
}

static void sampler_distribution(void) {
    enum { V = 6, N = 200000 };
    const float z[V] = {1.0f, 2.0f, 0.5f, -1.0f, 2.0f, 0.0f};
    float work[2 * V];
    double p[V];
    rf_sampling s = {0, 0.8f, 0, 1.0f};
    softmax(z, V, 0.8f, p);
    rf_rng r;
    rf_rng_seed(&r, 42);
    long count[V] = {0};
    for (int i = 0; i < N; i++) {
        float lp;
        int32_t t = rf_sample(z, V, &s, &r, &lp, work);
        count[t]++;
        if (i < 10) CHECK_CLOSE(lp, log(p[t]), 1e-5, 0);
    }
    double chi2 = 0;
    for (int j = 0; j < V; j++) chi2 += pow(count[j] - N * p[j], 2) / (N * p[j]);
    /* 5 degrees of freedom: P(chi2 > 20.5) = 0.001 for a correct sampler */
    CHECK(chi2 < 20.5);
    /* top-k = 2 keeps ids 1 and 4 (tied highest) only, renormalised between them */
    rf_sampling k2 = {0, 1.0f, 2, 1.0f};
    long c1 = 0, other = 0;
    for (int i = 0; i < 20000; i++) {
        int32_t t = rf_sample(z, V, &k2, &r, NULL, work);
        c1 += t == 1, other += t != 1 && t != 4;
    }
    CHECK(other == 0);
    CHECK(c1 > 9000 && c1 < 11000);
    /* top-p: p(1) = p(4) ~ 0.33 each, p(0) ~ 0.12: 0.5 keeps two tokens, 0.7 keeps three */
    softmax(z, V, 1.0f, p);
    rf_sampling tp = {0, 1.0f, 0, 0.5f};
    other = 0;
    for (int i = 0; i < 20000; i++) {
        int32_t t = rf_sample(z, V, &tp, &r, NULL, work);
        other += t != 1 && t != 4;
    }
    CHECK(other == 0);
    tp.top_p = (float)(p[1] + p[4] + 0.5 * p[0]);
    long c0 = 0;
    other = 0;
    for (int i = 0; i < 20000; i++) {
        int32_t t = rf_sample(z, V, &tp, &r, NULL, work);
        c0 += t == 0, other += t != 0 && t != 1 && t != 4;
    }
    CHECK(other == 0 && c0 > 0);
    /* greedy picks the first of tied maxima and reports log softmax at temperature 1 */
    rf_sampling g = {1, 1.0f, 0, 1.0f};
    float lp;
    CHECK(rf_sample(z, V, &g, &r, &lp, work) == 1);
    CHECK_CLOSE(lp, log(p[1]), 1e-6, 0);
    /* validation names the option */
    rf_sampling bad = {0, 1.0f, 0, 1.5f};
    CHECK_ERR(rf_sampling_validate(&bad), RF_ERR_ARG, "top_p must be in (0, 1]");
    bad.top_p = 1.0f, bad.top_k = -1;
    CHECK_ERR(rf_sampling_validate(&bad), RF_ERR_ARG, "top_k must be >= 0");
}

static rf_model *byte_model(void) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", RF_BYTE_TOKENIZER_VOCAB) == RF_OK);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, 4, 0.5f);
    return m;
}

static void generation(void) {
    char dir[] = "/tmp/rf_gen_XXXXXX";
    RF_ASSERT(mkdtemp(dir));
    CHECK_OK(rf_byte_tokenizer_write(dir));
    rf_tokenizer *tok = NULL;
    CHECK_OK(rf_tokenizer_load_dir(&tok, dir));
    rf_model *m = byte_model();
    int32_t p0[3] = {72, 105, 33}, p1[5] = {50, 43, 50, 61, 10};
    const int32_t *prompts[2] = {p0, p1};
    int lens[2] = {3, 5};
    rf_gen_params gp = {.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = 20, .seed = 7};
    rf_gen_output both[2], alone;
    CHECK_OK(rf_generate(m, tok, prompts, lens, 2, &gp, both, 0));
    CHECK(both[0].n_tokens == 20 && both[0].finish == RF_FINISH_LENGTH);
    /* prompt 1 alone with seed + 1 gives what it gave inside the batch */
    rf_gen_params gp1 = gp;
    gp1.seed = 8;
    CHECK_OK(rf_generate(m, tok, &prompts[1], &lens[1], 1, &gp1, &alone, 0));
    CHECK(alone.n_tokens == both[1].n_tokens &&
          memcmp(alone.tokens, both[1].tokens, sizeof(int32_t) * (size_t)alone.n_tokens) == 0);
    for (int i = 0; i < alone.n_tokens; i++) CHECK_CLOSE(alone.logprobs[i], both[1].logprobs[i], 1e-5, 1e-5);
    rf_gen_output_free(&alone);
    /* EOS: declare the 5th sampled token an EOS id; generation must end right there */
    int32_t eos = both[0].tokens[4];
    int first = 0;
    while (both[0].tokens[first] != eos) first++;
    rf_gen_params ge = gp;
    ge.eos_ids = &eos, ge.n_eos = 1;
    CHECK_OK(rf_generate(m, tok, prompts, lens, 1, &ge, &alone, 0));
    CHECK(alone.n_tokens == first + 1 && alone.finish == RF_FINISH_EOS);
    rf_gen_output_free(&alone);
    /* stop string: the byte of the 6th token (if printable ASCII) as a one-character stop */
    int32_t st = both[0].tokens[5];
    if (st > 32 && st < 127) {
        char stop[2] = {(char)st, 0};
        int at = 0;
        while (both[0].tokens[at] != st) at++;
        rf_gen_params gs = gp;
        gs.stop[0] = stop, gs.n_stop = 1;
        CHECK_OK(rf_generate(m, tok, prompts, lens, 1, &gs, &alone, 0));
        CHECK(alone.finish == RF_FINISH_STOP && alone.n_tokens == at + 1);
        CHECK(strchr(alone.text, st) == NULL);
        rf_gen_output_free(&alone);
    }
    CHECK_ERR(rf_generate(m, NULL, prompts, lens, 1, &(rf_gen_params){.sampling = {1, 1, 0, 1},
              .max_new_tokens = 4, .stop = {"x"}, .n_stop = 1}, &alone, 0), RF_ERR_ARG, "stop strings need a tokenizer");
    rf_gen_output_free(&both[0]);
    rf_gen_output_free(&both[1]);
    rf_model_free(m);
    rf_tokenizer_free(tok);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

int main(void) {
    sampler_distribution();
    sampler_selection();
    generation();
    return rf_test_finish("test_generate");
}
