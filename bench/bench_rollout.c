/* Rollout engine against the plain batched decoder, printed as JSON lines.
 *
 * Workload: the ~25M-parameter model of bench_model (random init, vocab 16384), 32-token
 * prompts, sampling at temperature 1 with max_new_tokens 128, and a set of stop ids sized so
 * that a sample ends at a geometrically distributed position (mean ~48 tokens): output lengths
 * vary, as in RL rollouts. Both sides run at the same batch size B (max_running for the engine;
 * rf_generate is called on chunks of B samples, each chunk waiting for its slowest member) and
 * the same seeds, so they generate exactly the same tokens (checked: "same_tokens").
 *  - 32 prompts x n=1;
 *  - 8 prompts x n=8: rf_generate prefills each sample's copy of the prompt, the engine
 *    prefills each prompt once and shares its KV blocks.
 * Throughput = generated tokens / wall seconds (prefill included), best of 3 runs.
 * Usage: bench_rollout [--quick] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "rollout/rollout.h"

enum { PROMPT_LEN = 32, BATCH = 16, V = 16384 };

typedef struct workload {
    int n_prompts, n;             /* prompts, samples each */
    int32_t *prompts;             /* (n_prompts, PROMPT_LEN) */
    rf_gen_params gp;
    int32_t *eos;                 /* stop ids */
    int64_t *tokens_hash;         /* (n_prompts * n) per-sample checksum of generated tokens */
    int64_t total_tokens;
} workload;

static int64_t hash_tokens(const int32_t *t, int n) {
    int64_t h = n;
    for (int i = 0; i < n; i++) h = h * 1000003 + t[i];
    return h;
}

static void workload_init(workload *w, int n_prompts, int n, int max_new) {
    memset(w, 0, sizeof *w);
    w->n_prompts = n_prompts, w->n = n;
    w->prompts = malloc(sizeof(int32_t) * (size_t)n_prompts * PROMPT_LEN);
    rf_rng r;
    rf_rng_seed(&r, 5);
    for (int i = 0; i < n_prompts * PROMPT_LEN; i++) w->prompts[i] = (int32_t)(rf_rng_u64(&r) % V);
    int n_eos = V / 48; /* near-uniform next-token distribution: P(stop) ~ 1/48 per token */
    w->eos = malloc(sizeof(int32_t) * (size_t)n_eos);
    for (int i = 0; i < n_eos; i++) w->eos[i] = (int32_t)(i * 48 + 7);
    w->gp = (rf_gen_params){.sampling = {0, 1.0f, 0, 1.0f}, .max_new_tokens = max_new, .seed = 1000,
                            .eos_ids = w->eos, .n_eos = n_eos};
    w->tokens_hash = calloc((size_t)n_prompts * n, sizeof(int64_t));
}

static void workload_free(workload *w) {
    free(w->prompts), free(w->eos), free(w->tokens_hash);
}

/* Baseline: rf_generate on chunks of BATCH samples (sample s = prompt s / n, seed 1000 + s). */
static double run_generate(rf_model *m, workload *w) {
    int total = w->n_prompts * w->n;
    const int32_t *ps[BATCH];
    int lens[BATCH];
    rf_gen_output out[BATCH];
    w->total_tokens = 0;
    double t0 = rf_time_now();
    for (int c = 0; c < total; c += BATCH) {
        int k = total - c < BATCH ? total - c : BATCH;
        for (int i = 0; i < k; i++)
            ps[i] = w->prompts + (size_t)((c + i) / w->n) * PROMPT_LEN, lens[i] = PROMPT_LEN;
        rf_gen_params gp = w->gp;
        gp.seed = w->gp.seed + (uint64_t)c;
        RF_ASSERT(rf_generate(m, NULL, ps, lens, k, &gp, out, 0) == RF_OK);
        for (int i = 0; i < k; i++) {
            w->tokens_hash[c + i] = hash_tokens(out[i].tokens, out[i].n_tokens);
            w->total_tokens += out[i].n_tokens;
            rf_gen_output_free(&out[i]);
        }
    }
    return rf_time_now() - t0;
}

typedef struct engine_ctx {
    workload *w;
    int64_t tokens, mismatches;
} engine_ctx;

static void on_sample(void *ctx, const rf_rollout_sample *s) {
    engine_ctx *c = ctx;
    int at = (int)(intptr_t)s->user * c->w->n + s->index;
    c->tokens += s->n_tokens;
    c->mismatches += hash_tokens(s->tokens, s->n_tokens) != c->w->tokens_hash[at];
}

/* The engine with max_running = BATCH; request p has seed 1000 + p * n (sample i: + i). */
static double run_engine(rf_model *m, workload *w, engine_ctx *ec, rf_rollout_stats *st) {
    rf_rollout_opts o = {.block_size = 16, .n_blocks = 256, .max_running = BATCH,
                         .max_batch_tokens = 2048};
    rf_rollout *e;
    RF_ASSERT(rf_rollout_init(&e, m, &o) == RF_OK);
    rf_rollout_set_callback(e, on_sample, ec);
    double t0 = rf_time_now();
    for (int p = 0; p < w->n_prompts; p++) {
        rf_rollout_request q = {w->prompts + (size_t)p * PROMPT_LEN, PROMPT_LEN, w->n,
                                w->gp.sampling, w->gp.max_new_tokens,
                                w->gp.seed + (uint64_t)p * w->n, w->eos, w->gp.n_eos, {0}, 0, 0, 0};
        RF_ASSERT(rf_rollout_submit(e, &q, (void *)(intptr_t)p, NULL) == RF_OK);
    }
    RF_ASSERT(rf_rollout_run_until_idle(e) == RF_OK);
    double el = rf_time_now() - t0;
    rf_rollout_get_stats(e, st);
    rf_rollout_free(e);
    return el;
}

static void bench_case(rf_model *m, int n_prompts, int n, int max_new) {
    workload w;
    workload_init(&w, n_prompts, n, max_new);
    /* best of 3 alternating runs each (the first also warms up allocations and threads): the
     * machine may be shared, and the best run is the least disturbed */
    double tg = 1e30, te = 1e30;
    engine_ctx ec;
    rf_rollout_stats st;
    for (int rep = 0; rep < 3; rep++) {
        double g = run_generate(m, &w);
        ec = (engine_ctx){&w, 0, 0};
        double t = run_engine(m, &w, &ec, &st);
        tg = g < tg ? g : tg, te = t < te ? t : te;
    }
    printf("{\"bench\":\"rollout\",\"prompts\":%d,\"n\":%d,\"batch\":%d,\"prompt_len\":%d,"
           "\"max_new_tokens\":%d,\"tokens\":%lld,\"same_tokens\":%s,"
           "\"generate_seconds\":%.3f,\"generate_tokens_per_s\":%.1f,"
           "\"engine_seconds\":%.3f,\"engine_tokens_per_s\":%.1f,\"engine_over_generate\":%.3f,"
           "\"engine_steps\":%lld,\"engine_prefill_tokens\":%lld,\"prefix_blocks_shared\":%lld,"
           "\"cow_copies\":%lld,\"preemptions\":%lld,\"peak_blocks\":%d}\n",
           n_prompts, n, BATCH, PROMPT_LEN, max_new, (long long)w.total_tokens,
           ec.mismatches == 0 && ec.tokens == w.total_tokens ? "true" : "false", tg,
           w.total_tokens / tg, te, ec.tokens / te, (ec.tokens / te) / (w.total_tokens / tg),
           (long long)st.steps, (long long)st.prefill_tokens, (long long)st.prefix_blocks_shared,
           (long long)st.cow_copies, (long long)st.preemptions, st.peak_blocks_used);
    fflush(stdout);
    workload_free(&w);
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "25m", V) == RF_OK);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, 1, 0.02f);
    int max_new = quick ? 64 : 128;
    bench_case(m, 32, 1, max_new);
    bench_case(m, 8, 8, max_new);
    rf_model_free(m);
    return 0;
}
