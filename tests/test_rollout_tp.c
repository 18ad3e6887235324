/* Tensor-parallel generation (rollout/rollout_tp.h) against the whole-model rollout engine, on
 * tiny random models of two shapes:
 *   gqa     4 query / 2 kv heads, q/k/v and o_proj biases, vocabulary 97: k/v heads split at
 *           tp 2, replicated at tp 4 (one kv head per rank);
 *   qwen3   12 query / 3 kv heads, q/k norms, tied embeddings, vocabulary 61: k/v replicated at
 *           tp 2 and 4, expanded on ranks whose query heads straddle two kv heads.
 * Under mpirun with 2 ranks (tp 2) and 4 ranks (tp 2 on two groups at once, then tp 4), rank 0
 * of each group runs the whole-model engine and the tensor-parallel one on the same requests
 * (GRPO groups sampled at temperature 0.9, with top-k / top-p, and greedy), with a pool small
 * enough to force copies on write of shared blocks and preemption; the other ranks serve.
 * Checks: every sample's tokens identical, behaviour log-probs within 5e-5 (absolute plus
 * relative: the ranks' partial sums change the last bits of the logits, ~1e-6 per step, and the
 * differences grow along a sequence as they feed the cache: up to 1.15e-5 relative here with
 * OpenBLAS 0.3.21's kernels; a wrong head or slice is off by O(1)), finish reasons equal.
 * Each tensor-parallel run is repeated after its KV cache is released on every rank and must
 * give the same samples bit for bit. Then, with 2 ranks, the bounds: a peer that never
 * takes part stops rank 0's step, and a rank 0 that never sends stops the peer, each with the
 * communicator's message naming the missing rank after the bound.
 * Shards kept in bf16 (a tensor-parallel rollout worker of a split run at bf16 precision:
 * rf_model_keep_bf16 on each rank's shard, its floats written with rf_model_write_params): the
 * tensor-parallel engine's samples, ids and behaviour log-probs, are bit for bit those of the
 * same shards held in fp32, at bf16 precision, for both shapes at tp 2 and 4. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/rng.h"
#include "common/util.h"
#include "model/model.h"
#include "model/model_tp.h"
#include "rollout/rollout.h"
#include "rollout/rollout_tp.h"
#include "test_comm_util.h"
#include "test_util.h"

#define TOL 5e-5
#define T_SHORT 2.0
#define MAX_NEW 12
#define N_REQ 5
#define MAX_SAMPLES 16

static double g_max_dlp; /* the largest log-prob difference seen */
static double g_max_rel; /* the same relative to 1 + |log-prob| (the tolerance's scale) */
static long g_tokens;    /* tokens compared */

/* A tiny random model of the gqa (qwen3 = 0) or qwen3 shape, the same on every rank. */
static rf_model *whole_model(int qwen3) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", qwen3 ? 61 : 97) == RF_OK);
    c.hidden_size = 24, c.num_hidden_layers = 2, c.rope_theta = 500.0f;
    if (qwen3) {
        c.arch = RF_ARCH_QWEN3, c.qk_norm = 1, c.qkv_bias = 0, c.head_dim = 4;
        c.num_attention_heads = 12, c.num_key_value_heads = 3, c.intermediate_size = 30;
        c.tie_word_embeddings = 1;
    } else {
        c.arch = RF_ARCH_LLAMA, c.qkv_bias = 1, c.o_bias = 1, c.head_dim = 6;
        c.num_attention_heads = 4, c.num_key_value_heads = 2, c.intermediate_size = 40;
        c.tie_word_embeddings = 0;
    }
    rf_model *m = NULL;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    /* large weights: peaked distributions, so sampled and greedy tokens are far from ties */
    rf_model_init_random(m, 11 + qwen3, 0.6f);
    return m;
}

/* What the callback keeps of each sample, indexed by request and sample index. */
typedef struct kept {
    int32_t tokens[MAX_NEW];
    float logprobs[MAX_NEW];
    int n_tokens, finish, seen;
} kept;

/* The engine's callback: keeps a finished sample's tokens and log-probs. */
static void keep(void *ctx, const rf_rollout_sample *s) {
    kept *k = (kept *)ctx + (uintptr_t)s->user * MAX_SAMPLES + s->index;
    memcpy(k->tokens, s->tokens, sizeof(int32_t) * (size_t)s->n_tokens);
    memcpy(k->logprobs, s->logprobs, sizeof(float) * (size_t)s->n_tokens);
    k->n_tokens = s->n_tokens, k->finish = (int)s->finish, k->seen++;
}

static const int32_t g_prompt[N_REQ][12] = {
    {3, 17, 42, 5, 60}, {11, 7, 7, 23, 54, 1, 0, 60, 9}, {9, 8, 33}, {2, 44, 45, 46, 13, 0, 5, 19, 20, 21, 22, 23},
    {50, 4}};
static const int g_len[N_REQ] = {5, 9, 3, 12, 2};

/* The same requests into any engine: sampled groups, top-k / top-p, greedy. */
static void submit_all(rf_rollout *e) {
    const rf_sampling smp[N_REQ] = {{0, 0.9f, 0, 1.0f}, {0, 0.9f, 20, 0.9f}, {1, 1, 0, 1}, {0, 0.9f, 0, 1.0f}, {1, 1, 0, 1}};
    const int n[N_REQ] = {4, 3, 2, 3, 1};
    for (int i = 0; i < N_REQ; i++) {
        rf_rollout_request q = {g_prompt[i], g_len[i], n[i], smp[i], MAX_NEW, 1000 + 10 * (uint64_t)i, NULL, 0, {0}, 0, 0, 0};
        CHECK_OK(rf_rollout_submit(e, &q, (void *)(uintptr_t)i, NULL));
    }
}

/* Small blocks and pool: shared prompt blocks are copied on write and sequences preempted. */
static const rf_rollout_opts g_opts = {.block_size = 4, .n_blocks = 14, .max_running = 6, .max_batch_tokens = 40};
/* Room in the pool but 3 running at most: groups are admitted in parts, and the late samples
 * start from the retained prefix's whole logits (captured from the slices) without a model call. */
static const rf_rollout_opts g_roomy = {.block_size = 4, .n_blocks = 64, .max_running = 3, .max_batch_tokens = 40};

/* What each pool must exercise: copies on write and preemption, or samples joining a prefix. */
static void check_stats(rf_rollout *e, const rf_rollout_opts *o) {
    rf_rollout_stats st;
    rf_rollout_get_stats(e, &st);
    if (o == &g_opts) CHECK(st.cow_copies > 0 && st.preemptions > 0);
    else CHECK(st.prefix_joins > 0);
}

/* Group rank 0: the whole-model engine's samples. */
static void run_whole(rf_model *m, const rf_rollout_opts *o, kept *out) {
    rf_rollout *e = NULL;
    CHECK_OK(rf_rollout_init(&e, m, o));
    rf_rollout_set_callback(e, keep, out);
    submit_all(e);
    CHECK_OK(rf_rollout_run_until_idle(e));
    check_stats(e, o);
    rf_rollout_free(e);
}

/* Group rank 0: the tensor-parallel engine's samples; then every rank's KV cache is released
 * (rf_rollout_release_cache), the same requests run again and must give the same samples bit
 * for bit (each rank allocates its pool again at the first step); the peers stop after it. */
static void run_tp(rf_rollout_tp *g, const rf_rollout_opts *o, kept *out) {
    rf_rollout *e = NULL;
    CHECK_OK(rf_rollout_tp_engine(g, o, &e));
    if (e) {
        rf_rollout_set_callback(e, keep, out);
        submit_all(e);
        CHECK_OK(rf_rollout_run_until_idle(e));
        check_stats(e, o);
        CHECK_OK(rf_rollout_release_cache(e));
        CHECK(!rf_kv_pool_held(rf_rollout_pool(e)));
        kept *again = calloc(N_REQ * MAX_SAMPLES, sizeof *again);
        rf_rollout_set_callback(e, keep, again);
        submit_all(e);
        CHECK_OK(rf_rollout_run_until_idle(e));
        CHECK(rf_kv_pool_held(rf_rollout_pool(e)));
        int same = 1;
        for (int i = 0; i < N_REQ * MAX_SAMPLES; i++)
            same &= again[i].seen == out[i].seen && again[i].n_tokens == out[i].n_tokens &&
                    memcmp(again[i].tokens, out[i].tokens, sizeof(int32_t) * (size_t)out[i].n_tokens) == 0 &&
                    memcmp(again[i].logprobs, out[i].logprobs, sizeof(float) * (size_t)out[i].n_tokens) == 0;
        CHECK(same);
        free(again);
    }
    rf_rollout_free(e);
    CHECK_OK(rf_rollout_tp_send(g, RF_ROLLOUT_TP_STOP, 0));
}

/* Every sample of the tp run (a) against the whole model's (b): same tokens and finish,
 * log-probs within TOL x (1 + |log-prob|); records the largest differences. */
static void compare(const kept *a, const kept *b, const char *name, int tp) {
    int same = 1;
    for (int i = 0; i < N_REQ * MAX_SAMPLES; i++) {
        if (!a[i].seen && !b[i].seen) continue;
        same &= a[i].seen == 1 && b[i].seen == 1 && a[i].n_tokens == b[i].n_tokens && a[i].finish == b[i].finish;
        for (int t = 0; same && t < a[i].n_tokens; t++) {
            same &= a[i].tokens[t] == b[i].tokens[t];
            double d = fabs((double)a[i].logprobs[t] - b[i].logprobs[t]);
            g_max_dlp = fmax(g_max_dlp, d);
            g_max_rel = fmax(g_max_rel, d / (1 + fabs((double)b[i].logprobs[t])));
            same &= d <= TOL * (1 + fabs((double)b[i].logprobs[t]));
            g_tokens++;
        }
        if (!same) fprintf(stderr, "%s tp %d: request %d sample %d differs from the whole model's\n", name, tp,
                           i / MAX_SAMPLES, i % MAX_SAMPLES);
    }
    CHECK(same);
}

/* One shape over group g: rank 0 compares, the others serve. */
static void check_shape(int qwen3, rf_comm *g) {
    const char *name = qwen3 ? "qwen3" : "gqa";
    rf_model *m = whole_model(qwen3);
    rf_model_tp *tp = NULL;
    rf_rollout_tp *grp = NULL;
    CHECK_OK(rf_model_tp_init(&tp, &m->cfg, rf_cpu_kernels(), g, 60));
    CHECK_OK(rf_model_tp_set_full(tp, m->params));
    CHECK_OK(rf_rollout_tp_init(&grp, tp, 60));
    if (rf_comm_rank(g) == 0) {
        for (int pool = 0; pool < 2; pool++) {
            const rf_rollout_opts *o = pool ? &g_roomy : &g_opts;
            kept *want = calloc(N_REQ * MAX_SAMPLES, sizeof *want), *got = calloc(N_REQ * MAX_SAMPLES, sizeof *got);
            run_whole(m, o, want);
            run_tp(grp, o, got);
            compare(got, want, name, rf_comm_size(g));
            free(want), free(got);
        }
    } else {
        for (int pool = 0; pool < 2; pool++) CHECK_OK(rf_rollout_tp_serve(grp, NULL, NULL));
    }
    rf_rollout_tp_free(grp);
    rf_model_tp_free(tp);
    rf_model_free(m);
}

/* At bf16 precision over group g: the shards of the same model held in fp32 (a) and kept in bf16
 * (b, written from a's floats) give the same samples bit for bit (rank 0 compares, the others
 * serve both). */
static void check_shape_kept(int qwen3, rf_comm *g) {
    const rf_kernels *k = rf_cpu_kernels();
    CHECK_OK(k->set_precision(RF_PRECISION_BF16));
    rf_model *m = whole_model(qwen3);
    rf_comm *g2 = NULL;
    rf_model_tp *a = NULL, *b = NULL;
    rf_rollout_tp *ga = NULL, *gb = NULL;
    int kept_b = 0;
    CHECK_OK(rf_comm_split(g, 0, rf_comm_rank(g), &g2));
    CHECK_OK(rf_model_tp_init(&a, &m->cfg, k, g, 60));
    CHECK_OK(rf_model_tp_set_full(a, m->params));
    CHECK_OK(rf_model_tp_init(&b, &m->cfg, k, g2, 60));
    CHECK_OK(rf_model_keep_bf16(b->m, &kept_b));
    CHECK(kept_b == 1);
    CHECK_OK(rf_model_write_params(b->m, 0, a->m->params, a->m->n_params));
    k->weights_updated();
    CHECK_OK(rf_rollout_tp_init(&ga, a, 60));
    CHECK_OK(rf_rollout_tp_init(&gb, b, 60));
    if (rf_comm_rank(g) == 0) {
        kept *want = calloc(N_REQ * MAX_SAMPLES, sizeof *want), *got = calloc(N_REQ * MAX_SAMPLES, sizeof *got);
        run_tp(ga, &g_roomy, want);
        run_tp(gb, &g_roomy, got);
        int same = 1, n = 0;
        for (int i = 0; i < N_REQ * MAX_SAMPLES; i++) {
            same &= want[i].seen == got[i].seen && want[i].n_tokens == got[i].n_tokens && want[i].finish == got[i].finish &&
                    memcmp(want[i].tokens, got[i].tokens, sizeof(int32_t) * (size_t)want[i].n_tokens) == 0 &&
                    memcmp(want[i].logprobs, got[i].logprobs, sizeof(float) * (size_t)want[i].n_tokens) == 0;
            n += want[i].n_tokens;
        }
        CHECK(same && n > 0);
        printf("test_rollout_tp: %s tp %d, shards kept in bf16: %d tokens %s\n", qwen3 ? "qwen3" : "gqa",
               rf_comm_size(g), n, same ? "bit-identical to fp32 shards" : "DIFFER");
        free(want), free(got);
    } else {
        CHECK_OK(rf_rollout_tp_serve(ga, NULL, NULL));
        CHECK_OK(rf_rollout_tp_serve(gb, NULL, NULL));
    }
    rf_rollout_tp_free(ga), rf_rollout_tp_free(gb);
    rf_model_tp_free(a), rf_model_tp_free(b);
    rf_model_free(m);
    rf_comm_free(g2);
    CHECK_OK(k->set_precision(RF_PRECISION_FP32));
}

/* The bounds, on two duplicates of a 2-rank world at once: on d1 rank 1 never takes part and
 * rank 0's step must fail naming it; on d2 rank 0 never sends and rank 1's wait for a command
 * must fail naming it, after 2 x the bound. */
static void bounds(rf_comm *world) {
    int rank = rf_comm_rank(world);
    rf_comm *d1 = NULL, *d2 = NULL;
    CHECK_OK(rf_comm_split(world, 0, rank, &d1));
    CHECK_OK(rf_comm_split(world, 0, rank, &d2));
    rf_model *m = whole_model(0);
    rf_model_tp *tp = NULL;
    rf_rollout_tp *g = NULL;
    CHECK_OK(rf_model_tp_init(&tp, &m->cfg, rf_cpu_kernels(), rank == 0 ? d1 : d2, T_SHORT));
    CHECK_OK(rf_model_tp_set_full(tp, m->params));
    CHECK_OK(rf_rollout_tp_init(&g, tp, T_SHORT));
    char want[256];
    double t0 = rf_time_now();
    rf_error_clear();
    if (rank == 0) {
        rf_rollout *e = NULL;
        rf_status st = rf_rollout_tp_engine(g, &g_opts, &e);
        if (st == RF_OK) {
            submit_all(e);
            st = rf_rollout_step(e);
        }
        snprintf(want, sizeof want, "waited %g s for world rank 1 (a rank is gone or stuck)", T_SHORT);
        CHECK(st == RF_ERR_IO && strstr(rf_error_message(), want));
        printf("test_rollout_tp: a peer gone: \"%s\" after %.2f s\n", rf_error_message(), rf_time_now() - t0);
        CHECK(rf_time_now() - t0 < T_SHORT + 1.5);
        rf_rollout_free(e);
    } else {
        rf_status st = rf_rollout_tp_serve(g, NULL, NULL);
        snprintf(want, sizeof want, "rollout tensor parallelism: waiting for a command from tensor-parallel rank 0: "
                 "world rank 1 waited %g s for world rank 0 (a rank is gone or stuck)", 2 * T_SHORT);
        CHECK(st == RF_ERR_IO && strcmp(rf_error_message(), want) == 0);
        printf("test_rollout_tp: rank 0 gone: \"%s\" after %.2f s\n", rf_error_message(), rf_time_now() - t0);
        CHECK(rf_time_now() - t0 >= 2 * T_SHORT && rf_time_now() - t0 < 2 * T_SHORT + 1.5);
    }
    rf_rollout_tp_free(g);
    rf_model_tp_free(tp);
    rf_model_free(m);
    rf_comm_free(d1), rf_comm_free(d2);
    CHECK_OK(rf_comm_barrier(world, 60, "after the bounds"));
}

/* Groups of tp ranks (tp = 2, then 4 with 4 ranks: two tp 2 groups at once, then one of 4),
 * each checking both shapes. */
static void every_group(rf_comm *world) {
    int rank = rf_comm_rank(world);
    for (int tp = 2; tp <= rf_comm_size(world); tp *= 2) {
        rf_comm *g = NULL;
        CHECK_OK(rf_comm_split(world, rank / tp, rank % tp, &g));
        for (int qwen3 = 0; g && qwen3 < 2; qwen3++) check_shape(qwen3, g);
        for (int qwen3 = 0; g && qwen3 < 2; qwen3++) check_shape_kept(qwen3, g);
        rf_comm_free(g);
        CHECK_OK(rf_comm_barrier(world, 60, "after one tp"));
    }
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = rf_test_mpi_world(&argc, &argv, "test_rollout_tp");
    if (!world) return 1;
    int rank = rf_comm_rank(world), size = rf_comm_size(world);
    every_group(world);
    if (size == 2) bounds(world);
    if (rank == 0)
        printf("test_rollout_tp: %d ranks: %ld tokens compared, all identical; largest log-prob difference %.3g, "
               "%.3g relative to 1 + |log-prob| (tolerance %g)\n", size, g_tokens, g_max_dlp, g_max_rel, TOL);
    int rc = rf_test_mpi_finish(world, "test_rollout_tp");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    /* one process: tp = 1 over the single-rank communicator is the whole model */
    check_shape(0, rf_comm_single());
    check_shape(1, rf_comm_single());
    printf("test_rollout_tp: one process: %ld tokens compared, largest log-prob difference %.3g\n", g_tokens, g_max_dlp);
    static const int nps[] = {2, 4};
    return rf_test_mpi_part("test_rollout_tp", nps, 2);
}
