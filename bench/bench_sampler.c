/* Token sampling (model/sampler.h) on one row of logits, printed as JSON lines: microseconds per
 * draw of rf_sample for vocabularies of 32 k and 152 k (Llama 3's and Qwen's sizes), made-up
 * logits shaped like a language model's (a few likely tokens, a long tail), under the kinds of
 * sampling RL recipes use: temperature 1 over the whole vocabulary, top-p 0.95, top-k 50, and
 * greedy. The baseline, measured in the same run, is one pass of exp over the row (double
 * precision, as the sampler computes it): the least any exact sampler over the whole row
 * costs. ratio_vs_exp_pass = draw time / that pass.
 * Usage: bench_sampler [--reps N] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "model/sampler.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Logits of a peaked, long-tailed distribution: Gumbel-like noise plus a few strong tokens. */
static void make_row(float *z, int V, uint64_t seed) {
    rf_rng r;
    rf_rng_seed(&r, seed);
    for (int j = 0; j < V; j++) {
        double u = rf_rng_uniform(&r) * 0.999999 + 1e-7;
        z[j] = (float)(-log(-log(u)) * 1.5);
    }
    for (int k = 0; k < 8; k++) z[rf_rng_u64(&r) % (uint64_t)V] += 9.0f - (float)k;
}

static volatile double g_sink;

/* Median microseconds of one exp pass over the row. */
static double exp_pass_us(const float *z, int V, int reps) {
    double t[64];
    for (int i = 0; i < reps; i++) {
        double t0 = rf_time_now(), s = 0;
        for (int j = 0; j < V; j++) s += exp((double)z[j] - 10.0);
        g_sink = s;
        t[i] = rf_time_now() - t0;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    return 1e6 * t[reps / 2];
}

/* Median microseconds of one rf_sample draw (each repetition draws from a fresh generator). */
static double sample_us(const float *z, int V, const rf_sampling *s, float *work, int reps) {
    double t[64];
    rf_rng rng;
    rf_rng_seed(&rng, 5);
    for (int i = 0; i < reps; i++) {
        float lp;
        double t0 = rf_time_now();
        g_sink = rf_sample(z, V, s, &rng, &lp, work) + lp;
        t[i] = rf_time_now() - t0;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    return 1e6 * t[reps / 2];
}

int main(int argc, char **argv) {
    int reps = 21;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    if (reps < 1 || reps > 64) reps = 21;
    const int vocab[] = {32768, 151936};
    const struct {
        const char *name;
        rf_sampling s;
    } kinds[] = {{"temperature 1", {0, 1.0f, 0, 1.0f}},
                 {"top-p 0.95", {0, 1.0f, 0, 0.95f}},
                 {"top-k 50", {0, 1.0f, 50, 1.0f}},
                 {"greedy", {1, 1.0f, 0, 1.0f}}};
    for (int v = 0; v < 2; v++) {
        int V = vocab[v];
        float *z = malloc(sizeof(float) * (size_t)V), *work = malloc(sizeof(float) * 2 * (size_t)V);
        if (!z || !work) return 1;
        make_row(z, V, 1 + (uint64_t)v);
        double base = exp_pass_us(z, V, reps);
        for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
            double us = sample_us(z, V, &kinds[k].s, work, reps);
            printf("{\"bench\": \"sample\", \"vocab\": %d, \"sampling\": \"%s\", \"us_per_draw\": %.1f, "
                   "\"exp_pass_us\": %.1f, \"ratio_vs_exp_pass\": %.2f}\n", V, kinds[k].name, us, base, us / base);
            fflush(stdout);
        }
        free(z), free(work);
    }
    return 0;
}
