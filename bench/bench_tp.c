/* Tensor-parallel model (model/model_tp.h) against one rank with the whole model, on the CPU,
 * printed as JSON lines:
 *  - tp_train: one training step's passes (forward, log-probs and entropies, backward) over a
 *    packed batch, milliseconds per step (median of the repetitions, barrier to barrier);
 *    "whole" is rf_model itself, "tp" the tensor-parallel model at tp = 1 (its overhead) and at
 *    tp = the ranks;
 *  - tp_decode: a greedy decoding step of a batch of sequences after a prefill, milliseconds
 *    per step (rf_model_decode + rf_sample against rf_model_tp_decode + rf_model_tp_greedy);
 *  - train_step: a whole optimizer step on the same global batch (zeroed gradients, the passes,
 *    the optimizer with clipping by the global norm): one rank ("whole"), tp ranks ("tp"), and
 *    dp replicas of tp ranks ("tp x dp", each replica on its half of the sequences, gradients
 *    summed over each shard's DP group during backward: rf_dp_init_tp), with the ratios of its
 *    time to one rank's and to tp's (ratio > 1: slower);
 *  - tp_rollout: the rollout engine generating (8 prompts x 4 samples, 64-token prompts, 32 new
 *    tokens at temperature 1, continuous batching over the paged cache), tokens per second:
 *    the whole-model engine (rf_rollout_init) against the tensor-parallel one
 *    (rollout/rollout_tp.h: rank 0 drives the others' steps) at tp = 1 and tp = the ranks,
 *    with the ratios to the whole model's rate and to tp = 1 (measured first, in one process);
 *  - score: the passes of a PPO ScoreRequest with a KL term on the batch (64 prompt and 64
 *    response tokens per sequence): the reference policy's log-probs and the critic's values
 *    (rf_actor_logprobs and rf_critic_values, micro-batches of 512 tokens), milliseconds per
 *    batch: one rank with both models whole, tp ranks with both split (the _tp passes), and dp
 *    replicas of tp ranks each scoring its half of the sequences, as the training worker shares
 *    out a request, with the ratio to one rank's time.
 * Times are measured, never asserted.
 * One process uses all the machine's threads (OpenMP); under mpirun each of the np ranks gets
 * threads / np of them, so all use the same cores. Model: the "small" preset (4 layers,
 * hidden 256, 8 heads / 4 kv heads) with a 8192-token vocabulary; batch: 8 sequences of 128
 * tokens (1024 tokens); decoding: 8 sequences, 64-token prompts, 32 steps.
 * Usage: bench_tp [--np N] [--dp D] [--preset NAME] [--reps N]. Not started by mpirun, it
 * measures one process and then starts itself under `mpirun -np N --oversubscribe` (N = 2 by
 * default: tp = N), and with D > 1 (2 by default) under `mpirun -np N*D` (tp N x dp D, the
 * ranks of a replica consecutive: tp varies fastest). */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "common/rng.h"
#include "common/util.h"
#include "model/model_tp.h"
#include "model/sampler.h"
#include "rollout/rollout.h"
#include "rollout/rollout_tp.h"
#include "trainer/data_parallel.h"
#include "trainer/optim.h"

#define NS 8
#define LEN 128
#define PROMPT 64
#define STEPS 32
#define VOCAB 8192
#define RS 4 /* samples per prompt in tp_rollout */

static int g_reps = 5, g_np = 2, g_dp = 2;
static double g_ref_whole, g_ref_tp; /* train_step ms of one rank and of tp, for the ratios */
static double g_ref_score;           /* score ms of one rank, likewise */
static double g_base_tok_s; /* the whole-model engine's rate, handed to the ranks under mpirun */
static double g_tp1_tok_s;  /* the tensor-parallel engine's at tp = 1, likewise */
static const char *g_preset = "small";

#define DIE(st)                                                                               \
    do {                                                                                      \
        if ((st) != RF_OK) {                                                                  \
            fprintf(stderr, "bench_tp: %s:%d: %s\n", __FILE__, __LINE__, rf_error_message()); \
            rf_comm_abort(1);                                                                 \
        }                                                                                     \
    } while (0)

/* The benchmark's model; value_head = 1: a critic of the same shape. */
static rf_model *whole_of(int value_head) {
    rf_model_config c;
    DIE(rf_config_preset(&c, g_preset, VOCAB));
    c.tie_word_embeddings = 0, c.value_head = value_head;
    rf_model *m;
    DIE(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 1, 0.02f);
    DIE(rf_model_enable_training(m));
    return m;
}

static rf_model *whole(void) { return whole_of(0); }

typedef struct batch_data {
    int32_t tok[NS * LEN], tgt[NS * LEN], cu[NS + 1];
    float dl[NS * LEN], de[NS * LEN], lp[NS * LEN], ent[NS * LEN];
} batch_data;

static void make_batch(batch_data *d) {
    rf_rng r;
    rf_rng_seed(&r, 3);
    for (int i = 0; i < NS * LEN; i++) {
        d->tok[i] = (int32_t)(rf_rng_u64(&r) % VOCAB), d->tgt[i] = (int32_t)(rf_rng_u64(&r) % VOCAB);
        d->dl[i] = 1.0f / (NS * LEN), d->de[i] = 0.01f / (NS * LEN);
    }
    for (int s = 0; s <= NS; s++) d->cu[s] = s * LEN;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return x[n / 2];
}

/* One step's passes on the whole model or the tp model (tp NULL: whole). */
static void train_step(rf_model *m, rf_model_tp *tp, batch_data *d) {
    rf_batch b = {NS, NS * LEN, d->tok, NULL, d->cu};
    if (tp) {
        DIE(rf_model_tp_forward(tp, &b));
        DIE(rf_model_tp_logprobs(tp, d->tgt, 1.0f, d->lp, d->ent));
        DIE(rf_model_tp_backward(tp, d->dl, d->de, NULL));
    } else {
        DIE(rf_model_forward(m, &b));
        DIE(rf_model_logprobs(m, d->tgt, 1.0f, d->lp, d->ent));
        DIE(rf_model_backward(m, d->dl, d->de, NULL));
    }
}

static double time_train(rf_model *m, rf_model_tp *tp, rf_comm *c, batch_data *d) {
    double t[32];
    train_step(m, tp, d); /* warm-up: buffers, page faults */
    if (tp) tp->comm_s = 0, tp->n_collectives = 0;
    for (int i = 0; i < g_reps; i++) {
        DIE(rf_comm_barrier(c, 60, "bench"));
        double t0 = rf_time_now();
        train_step(m, tp, d);
        DIE(rf_comm_barrier(c, 60, "bench"));
        t[i] = rf_time_now() - t0;
    }
    return 1e3 * median(t, g_reps);
}

/* Prefill NS prompts, then STEPS greedy steps; milliseconds per step. */
static double time_decode(rf_model *m, rf_model_tp *tp, rf_comm *c) {
    rf_kv_cache kv;
    DIE(tp ? rf_model_tp_kv_cache_init(tp, &kv, NS, PROMPT + STEPS) : rf_kv_cache_init(&kv, m, NS, PROMPT + STEPS));
    int V = m->cfg.vocab_size, W = tp ? tp->Vl : V, slots[NS], counts[NS];
    int32_t tok[NS * PROMPT], next[NS];
    float *logits = malloc(sizeof(float) * NS * W), lp[NS], *work = malloc(sizeof(float) * 2 * V);
    rf_sampling greedy = {.greedy = 1};
    for (int i = 0; i < NS * PROMPT; i++) tok[i] = (int32_t)((i * 7919) % V);
    for (int s = 0; s < NS; s++) slots[s] = s, counts[s] = PROMPT;
    DIE(tp ? rf_model_tp_decode(tp, &kv, slots, counts, NS, tok, logits) : rf_model_decode(m, &kv, slots, counts, NS, tok, logits));
    for (int s = 0; s < NS; s++) counts[s] = 1, next[s] = tok[s];
    DIE(rf_comm_barrier(c, 60, "bench"));
    if (tp) tp->comm_s = 0, tp->n_collectives = 0;
    double t0 = rf_time_now();
    for (int step = 0; step < STEPS; step++) {
        if (tp) {
            DIE(rf_model_tp_decode(tp, &kv, slots, counts, NS, next, logits));
            DIE(rf_model_tp_greedy(tp, logits, NS, next, lp));
        } else {
            DIE(rf_model_decode(m, &kv, slots, counts, NS, next, logits));
            for (int s = 0; s < NS; s++) next[s] = rf_sample(logits + (size_t)s * V, V, &greedy, NULL, &lp[s], work);
        }
    }
    DIE(rf_comm_barrier(c, 60, "bench"));
    double ms = 1e3 * (rf_time_now() - t0) / STEPS;
    rf_kv_cache_free(&kv, tp ? tp->m : m);
    free(logits), free(work);
    return ms;
}

/* The parts of one optimizer step: the model trained, and with data parallelism the DP state
 * and this replica's sequences [lo, hi). */
typedef struct step_ctx {
    rf_model *m;
    rf_model_tp *tp;
    rf_dp *dp;
    int lo, hi;
} step_ctx;

/* Zeroed gradients, the passes over sequences [lo, hi) of the batch, the optimizer step. */
static void opt_step(const step_ctx *x, batch_data *d) {
    rf_optim_opts o = {.lr = 1e-5f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .grad_clip = 1.0f};
    int32_t cu[NS + 1];
    for (int s = x->lo; s <= x->hi; s++) cu[s - x->lo] = d->cu[s] - d->cu[x->lo];
    rf_batch b = {x->hi - x->lo, cu[x->hi - x->lo], d->tok + d->cu[x->lo], NULL, cu};
    const int32_t *tgt = d->tgt + d->cu[x->lo];
    double gn;
    float lr;
    if (x->tp) rf_model_tp_zero_grad(x->tp);
    else rf_model_zero_grad(x->m);
    if (x->dp) rf_dp_arm(x->dp);
    if (x->tp) {
        DIE(rf_model_tp_forward(x->tp, &b));
        DIE(rf_model_tp_logprobs(x->tp, tgt, 1.0f, d->lp, d->ent));
        DIE(rf_model_tp_backward(x->tp, d->dl, d->de, NULL));
    } else {
        DIE(rf_model_forward(x->m, &b));
        DIE(rf_model_logprobs(x->m, tgt, 1.0f, d->lp, d->ent));
        DIE(rf_model_backward(x->m, d->dl, d->de, NULL));
    }
    if (x->dp) DIE(rf_dp_sync_grads(x->dp));
    DIE(x->dp ? rf_dp_optim_step(x->dp, &o, &gn, &lr) : x->tp ? rf_optim_step_tp(x->tp, &o, &gn, &lr)
                                                         : rf_optim_step(x->m, &o, &gn, &lr));
}

/* Milliseconds per optimizer step (median, barrier to barrier over c, every rank). */
static double time_opt_step(const step_ctx *x, rf_comm *c, batch_data *d) {
    double t[32];
    opt_step(x, d); /* warm-up */
    for (int i = 0; i < g_reps; i++) {
        DIE(rf_comm_barrier(c, 60, "bench"));
        double t0 = rf_time_now();
        opt_step(x, d);
        DIE(rf_comm_barrier(c, 60, "bench"));
        t[i] = rf_time_now() - t0;
    }
    return 1e3 * median(t, g_reps);
}

static void report_step(rf_comm *c, const char *model, int tp, int dp, double ms, double dp_wait_ms) {
    if (rf_comm_rank(c) != 0) return;
    printf("{\"bench\": \"train_step\", \"model\": \"%s\", \"ranks\": %d, \"tp\": %d, \"dp\": %d, "
           "\"threads_per_rank\": %d, \"preset\": \"%s\", \"sequences\": %d, \"tokens\": %d, \"ms_per_step\": %.2f, "
           "\"dp_wait_ms_per_step\": %.2f", model, rf_comm_size(c), tp, dp, omp_get_max_threads(), g_preset, NS,
           NS * LEN, ms, dp_wait_ms);
    if (dp > 1 && g_ref_whole > 0) printf(", \"ratio_vs_one_rank\": %.3f", ms / g_ref_whole);
    if (dp > 1 && g_ref_tp > 0) printf(", \"ratio_vs_tp\": %.3f", ms / g_ref_tp);
    if (dp == 1 && tp > 1 && g_ref_whole > 0) printf(", \"ratio_vs_one_rank\": %.3f", ms / g_ref_whole);
    printf("}\n");
    fflush(stdout);
}

/* Rank 0: submits NS prompts of RS samples and generates until idle; tokens per second. */
static double generate(rf_rollout *e, int V) {
    int32_t prompt[PROMPT];
    double t0 = rf_time_now();
    for (int p = 0; p < NS; p++) {
        for (int i = 0; i < PROMPT; i++) prompt[i] = (int32_t)(((p + 1) * 7919 + i * 104729) % V);
        rf_rollout_request q = {prompt, PROMPT, RS, {0, 1.0f, 0, 1.0f}, STEPS, 100 + (uint64_t)p, NULL, 0, {0}, 0, 0, 0};
        DIE(rf_rollout_submit(e, &q, NULL, NULL));
    }
    DIE(rf_rollout_run_until_idle(e));
    rf_rollout_stats st;
    rf_rollout_get_stats(e, &st);
    return (double)st.tokens_generated / (rf_time_now() - t0);
}

/* The rollout engine's generation rate (tokens/s on rank 0; 0 elsewhere): whole (tp NULL) or
 * over tp's group, the other ranks serving rank 0's steps. */
static double time_rollout(rf_model *m, rf_model_tp *tp, rf_comm *c) {
    rf_rollout_opts o = {.block_size = 16, .n_blocks = 1024, .max_running = 64};
    rf_rollout *e = NULL;
    rf_rollout_tp *g = NULL;
    double tok_s = 0;
    DIE(rf_comm_barrier(c, 60, "bench"));
    if (tp) DIE(rf_rollout_tp_init(&g, tp, 120));
    if (tp && rf_comm_rank(c) > 0) {
        DIE(rf_rollout_tp_serve(g, NULL, NULL));
    } else {
        DIE(tp ? rf_rollout_tp_engine(g, &o, &e) : rf_rollout_init(&e, m, &o));
        tok_s = generate(e, m->cfg.vocab_size);
        rf_rollout_free(e);
        if (g) DIE(rf_rollout_tp_send(g, RF_ROLLOUT_TP_STOP, 0));
    }
    rf_rollout_tp_free(g);
    DIE(rf_comm_barrier(c, 60, "bench"));
    return tok_s;
}

/* A rate, or null when it was not measured (yet). */
static void json_rate(char *buf, size_t cap, double x) {
    if (x > 0) snprintf(buf, cap, "%.3f", x);
    else snprintf(buf, cap, "null");
}

/* Rank 0: one tp_rollout JSON line, with the ratios to the whole model and to tp = 1. */
static void report_rollout(rf_comm *c, const char *model, double tok_s) {
    if (rf_comm_rank(c) != 0) return;
    char vw[32], vt[32];
    json_rate(vw, sizeof vw, g_base_tok_s > 0 ? tok_s / g_base_tok_s : 0);
    json_rate(vt, sizeof vt, g_tp1_tok_s > 0 ? tok_s / g_tp1_tok_s : 0);
    printf("{\"bench\": \"tp_rollout\", \"model\": \"%s\", \"ranks\": %d, \"threads_per_rank\": %d, "
           "\"preset\": \"%s\", \"sequences\": %d, \"new_tokens\": %d, \"tokens_per_s\": %.1f, "
           "\"whole_tokens_per_s\": %.1f, \"ratio_vs_whole\": %s, \"tp1_tokens_per_s\": %.1f, \"ratio_vs_tp1\": %s}\n",
           model, rf_comm_size(c), omp_get_max_threads(), g_preset, NS * RS, STEPS, tok_s, g_base_tok_s, vw,
           g_tp1_tok_s, vt);
    fflush(stdout);
}

static rf_model_tp *tp_model(rf_model *m, rf_comm *c) {
    rf_model_tp *tp;
    DIE(rf_model_tp_init(&tp, &m->cfg, rf_cpu_kernels(), c, 120));
    DIE(rf_model_tp_set_full(tp, m->params));
    DIE(rf_model_tp_enable_training(tp));
    return tp;
}

/* comm_ms, collectives: rank 0's time in collectives per step (waits for the other ranks
 * included) and their number, for the tp model. */
static void report(rf_comm *c, const char *what, const char *model, double ms, double comm_ms,
                   long collectives) {
    if (rf_comm_rank(c) == 0)
        printf("{\"bench\": \"%s\", \"model\": \"%s\", \"ranks\": %d, \"threads_per_rank\": %d, "
               "\"preset\": \"%s\", \"ms_per_step\": %.2f, \"comm_ms_per_step\": %.2f, "
               "\"collectives_per_step\": %ld}\n", what, model, rf_comm_size(c),
               omp_get_max_threads(), g_preset, ms, comm_ms, collectives);
    fflush(stdout);
}

/* ---- score ---- */

/* The batch's sequences as samples: the first PROMPT tokens the prompt, the rest the response. */
static rf_train_sample *score_samples(const batch_data *d) {
    rf_train_sample *s = calloc(NS, sizeof *s);
    if (!s) DIE(RF_ERR_NOMEM);
    for (int i = 0; i < NS; i++) {
        s[i].tokens = malloc(sizeof(int32_t) * LEN);
        if (!s[i].tokens) DIE(RF_ERR_NOMEM);
        memcpy(s[i].tokens, d->tok + (size_t)i * LEN, sizeof(int32_t) * LEN);
        s[i].n_prompt = PROMPT, s[i].n_resp = LEN - PROMPT;
        DIE(rf_train_sample_alloc(&s[i]));
    }
    return s;
}

static void score_samples_free(rf_train_sample *s) {
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]), free(s[i].tokens);
    free(s);
}

/* Milliseconds per batch (median, barrier to barrier over c) of reference log-probs and critic
 * values for sequences [lo, hi): whole models (ref, critic) or split ones (rt, ct). */
static double time_score(rf_model *ref, rf_model *critic, rf_model_tp *rt, rf_model_tp *ct, rf_comm *c,
                         rf_train_sample *s, int lo, int hi) {
    float *lp[NS], *v[NS];
    for (int i = lo; i < hi; i++) lp[i - lo] = s[i].ref_logp, v[i - lo] = s[i].values;
    double t[33];
    for (int i = 0; i <= g_reps; i++) { /* the first a warm-up */
        DIE(rf_comm_barrier(c, 60, "bench"));
        double t0 = rf_time_now();
        if (rt) {
            DIE(rf_actor_logprobs_tp(rt, s + lo, hi - lo, 512, 1.0f, lp, NULL));
            DIE(rf_critic_values_tp(ct, s + lo, hi - lo, 512, v));
        } else {
            DIE(rf_actor_logprobs(ref, s + lo, hi - lo, 512, 1.0f, lp, NULL));
            DIE(rf_critic_values(critic, s + lo, hi - lo, 512, v));
        }
        DIE(rf_comm_barrier(c, 60, "bench"));
        t[i] = rf_time_now() - t0;
    }
    return 1e3 * median(t + 1, g_reps);
}

static rf_model_tp *tp_model(rf_model *m, rf_comm *c);

/* One score line: the passes over c (tp: the ranks of one replica, dp replicas of them), each
 * replica on its share of the sequences. */
static void run_score(rf_comm *c, rf_comm *tpc, int tp, int dp, int d) {
    batch_data *data = calloc(1, sizeof *data);
    if (!data) DIE(RF_ERR_NOMEM);
    make_batch(data);
    rf_train_sample *s = score_samples(data);
    rf_model *ref = whole_of(0), *critic = whole_of(1);
    rf_model_tp *rt = tpc ? tp_model(ref, tpc) : NULL, *ct = tpc ? tp_model(critic, tpc) : NULL;
    double ms = time_score(ref, critic, rt, ct, c, s, NS * d / dp, NS * (d + 1) / dp);
    if (!tpc) g_ref_score = ms;
    if (rf_comm_rank(c) == 0) {
        printf("{\"bench\": \"score\", \"model\": \"%s\", \"ranks\": %d, \"tp\": %d, \"dp\": %d, "
               "\"threads_per_rank\": %d, \"preset\": \"%s\", \"sequences\": %d, \"tokens\": %d, "
               "\"ms_per_batch\": %.2f", !tpc ? "whole" : dp > 1 ? "tp x dp" : "tp", rf_comm_size(c), tp, dp,
               omp_get_max_threads(), g_preset, NS, NS * LEN, ms);
        if (tpc && g_ref_score > 0) printf(", \"ratio_vs_one_rank\": %.3f", ms / g_ref_score);
        printf("}\n");
        fflush(stdout);
    }
    rf_model_tp_free(rt), rf_model_tp_free(ct);
    rf_model_free(ref), rf_model_free(critic);
    score_samples_free(s);
    free(data);
}

static void run(rf_comm *c) {
    rf_model *m = whole();
    batch_data *d = calloc(1, sizeof *d);
    make_batch(d);
    rf_model_tp *tp = tp_model(m, c);
    if (rf_comm_size(c) == 1) {
        report(c, "tp_train", "whole", time_train(m, NULL, c, d), 0, 0);
        report(c, "tp_decode", "whole", time_decode(m, NULL, c), 0, 0);
        step_ctx x = {m, NULL, NULL, 0, NS};
        g_ref_whole = time_opt_step(&x, c, d);
        report_step(c, "whole", 1, 1, g_ref_whole, 0);
    }
    double ms = time_train(m, tp, c, d);
    report(c, "tp_train", "tp", ms, tp->comm_s * 1e3 / g_reps, tp->n_collectives / g_reps);
    ms = time_decode(m, tp, c);
    report(c, "tp_decode", "tp", ms, tp->comm_s * 1e3 / STEPS, tp->n_collectives / STEPS);
    step_ctx x = {tp->m, tp, NULL, 0, NS};
    report_step(c, "tp", rf_comm_size(c), 1, time_opt_step(&x, c, d), 0);
    if (rf_comm_size(c) == 1) {
        g_base_tok_s = time_rollout(m, NULL, c);
        report_rollout(c, "whole", g_base_tok_s);
    }
    double tok_s = time_rollout(m, tp, c);
    if (rf_comm_size(c) == 1) g_tp1_tok_s = tok_s;
    report_rollout(c, "tp", tok_s);
    rf_model_tp_free(tp);
    rf_model_free(m);
    free(d);
    if (rf_comm_size(c) == 1) run_score(c, NULL, 1, 1, 0);
    else run_score(c, c, rf_comm_size(c), 1, 0);
}

/* tp x dp over the world (rank = d * tp + t): replica d trains on its part of the sequences. */
static void run_grid(rf_comm *world) {
    int rank = rf_comm_rank(world), tp = g_np, dp = rf_comm_size(world) / g_np, d = rank / tp;
    rf_comm *tpc = NULL, *dpc = NULL;
    DIE(rf_comm_split(world, d, rank, &tpc));
    DIE(rf_comm_split(world, rank % tp, rank, &dpc));
    rf_model *m = whole();
    batch_data *data = calloc(1, sizeof *data);
    make_batch(data);
    rf_model_tp *t = tp_model(m, tpc);
    rf_dp *dpst = NULL;
    rf_dp_opts o = {.timeout_s = 120};
    DIE(rf_dp_init_tp(&dpst, dpc, t, &o));
    step_ctx x = {t->m, t, dpst, NS * d / dp, NS * (d + 1) / dp};
    double ms = time_opt_step(&x, world, data);
    const rf_dp_stats *st = rf_dp_get_stats(dpst);
    report_step(world, "tp x dp", tp, dp, ms, 1e3 * st->wait_s / (double)(st->syncs ? st->syncs : 1));
    rf_dp_free(dpst);
    rf_model_tp_free(t);
    rf_model_free(m);
    free(data);
    run_score(world, tpc, tp, dp, d);
    rf_comm_free(tpc), rf_comm_free(dpc);
}

/* Runs `mpirun -np np` of this program (threads divided among the ranks), echoing its output;
 * the train_step time of its "tp" line into *tp_ms when asked. 0 on success. */
static int mpirun_self(int np, const char *extra, double *tp_ms) {
    char self[4096], cmd[8192], line[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 1;
    self[n] = '\0';
    int per = omp_get_max_threads() / np > 0 ? omp_get_max_threads() / np : 1;
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=%d mpirun -np %d --oversubscribe %s -x OMP_NUM_THREADS %s --reps %d "
             "--preset %s --np %d %s", per, np, geteuid() == 0 ? "--allow-run-as-root" : "", self, g_reps, g_preset,
             g_np, extra);
    fflush(stdout);
    FILE *f = popen(cmd, "r");
    if (!f) return 1;
    while (fgets(line, sizeof line, f)) {
        fputs(line, stdout);
        const char *at = strstr(line, "\"train_step\", \"model\": \"tp\"");
        const char *ms = at ? strstr(line, "\"ms_per_step\": ") : NULL;
        if (ms && tp_ms) *tp_ms = atof(ms + strlen("\"ms_per_step\": "));
    }
    return pclose(f) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--np") && i + 1 < argc) g_np = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--preset") && i + 1 < argc) g_preset = argv[++i];
        else if (!strcmp(argv[i], "--dp") && i + 1 < argc) g_dp = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--base-tok-s") && i + 1 < argc) g_base_tok_s = atof(argv[++i]);
        else if (!strcmp(argv[i], "--tp1-tok-s") && i + 1 < argc) g_tp1_tok_s = atof(argv[++i]);
        else if (!strcmp(argv[i], "--ref") && i + 2 < argc) g_ref_whole = atof(argv[++i]), g_ref_tp = atof(argv[++i]);
        else if (!strcmp(argv[i], "--ref-score") && i + 1 < argc) g_ref_score = atof(argv[++i]);
    }
    if (g_reps < 1 || g_reps > 32) g_reps = 5;
    if (rf_comm_launched_by_mpi()) {
        rf_comm *world;
        DIE(rf_comm_world(&argc, &argv, &world));
        if (rf_comm_size(world) > g_np) run_grid(world);
        else run(world);
        rf_comm_finalize();
        return 0;
    }
    run(rf_comm_single());
    char extra[256];
    double tp_ms = 0;
    snprintf(extra, sizeof extra, "--ref %.4f 0 --ref-score %.4f --base-tok-s %.1f --tp1-tok-s %.1f", g_ref_whole,
             g_ref_score, g_base_tok_s, g_tp1_tok_s);
    if (mpirun_self(g_np, extra, &tp_ms)) return 1;
    if (g_dp <= 1) return 0;
    snprintf(extra, sizeof extra, "--ref %.4f %.4f --ref-score %.4f", g_ref_whole, tp_ms, g_ref_score);
    return mpirun_self(g_np * g_dp, extra, NULL);
}
