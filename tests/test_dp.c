/* Data-parallel training (trainer/data_parallel.h) and what it stands on.
 *
 * In this process (one rank):
 *   - the backward hook: ranges from the end of the flat buffer to its start, covering it once,
 *     two per layer (MLP, then attention) plus the head and the embedding; gradients bit for bit the same with and
 *     without a hook; a hook's error stops backward and is returned;
 *   - DP over the single-rank communicator: plain DP bit for bit equal to rf_actor_update
 *     without it, ZeRO-1 within fp32 tolerance; rf_dp_sum exact up to 2^36.
 * Under `mpirun --oversubscribe` with 2 and 4 ranks:
 *   - comm's started collectives: several allreduces and reduce-scatters in flight at once,
 *     results exact (small integers), rf_comm_group_test reaches 1;
 *   - rf_dp_init: ranks that start from different weights all hold DP rank 0's; a resumed
 *     optimizer state reaches every rank (plain: rank 0's moments; ZeRO-1: rank 0 sends each
 *     rank its blocks, or each rank reads its own from rank 0's checkpoint files, bit for bit
 *     rank 0's and its whole moments freed; a rank failing to read fails every rank, naming it);
 *   - DP equals one rank on the combined batch: each rank runs the single-rank update on the
 *     whole batch as the reference, then the DP update on its share (shares uneven; on 4 ranks
 *     one rank has none). Parameters after 6 optimizer steps (3 updates x 2 epochs) agree
 *     within 1e-5 of the largest parameter under every loss aggregation mode, with
 *     micro-batch accumulation (micro-batches of 12 tokens) and clipping that clips (the
 *     global norm is above grad_clip); the statistics are the whole batch's; the critic's value
 *     update likewise; every rank ends with the same parameters bit for bit;
 *   - LoRA (model/lora.h, adapters on every projection): plain DP trains the adapters as one
 *     rank does on the whole batch (3 updates x 2 epochs, clipping that clips: adapters within
 *     1e-5 of the largest, the frozen base untouched bit for bit, every rank the same bits,
 *     buckets of the gradient buffer started during backward); ZeRO-1 likewise (its blocks,
 *     segments and moments over the adapters alone: the same within 1e-5, the moments gathered
 *     whole and a moment range of one adapter read on rank 0 within 1e-4 of the one rank's,
 *     a range past the adapters refused);
 *   - shares smaller than mini_batches: a mini-batch empty on every rank takes no step;
 *   - ZeRO-1 equals plain DP (2 mini-batches, 2 epochs, weight decay, 7 buckets of which the
 *     last is padded): parameters and the gathered AdamW moments within 1e-5, and equals one
 *     rank with mini_batches = 1; the model's whole moments are freed;
 *   - overlap: buckets are started while the backward pass still has layers to go (a counter:
 *     exactly the buckets wholly past the embedding, every step); none when deferred;
 *   - a lost rank: one rank never joins the step; the others fail with RF_ERR_IO naming the
 *     first gradient bucket's allreduce (reduce-scatter with ZeRO-1) and the absent rank,
 *     within the bound.
 * Tolerances: fp32 summation order differs between one rank and N (micro-batches packed
 * differently, partial gradients summed across ranks): gradients agree within a few 1e-6 of
 * the largest. AdamW divides by sqrt(v) + eps, so a gradient element near eps moves its
 * parameter by a good part of lr whatever its rounding; with eps = 1e-8 the k_proj biases
 * (whose true gradient is zero: softmax ignores a shift shared by all keys, so theirs is pure
 * rounding noise) and the clipped small gradients put parameters 1e-5..8e-5 apart after 6
 * steps at lr 3e-3, the same in the single-rank accumulation test. The optimizer here uses
 * eps = 1e-6, above that noise, and the parameters then agree within ~2e-6 of the largest:
 * the check is 1e-5. Skips the MPI part without mpirun. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "model/lora.h"
#include "common/util.h"
#include "test_comm_util.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/checkpoint.h"
#include "trainer/data_parallel.h"

#define T_OK 60.0
#define T_SHORT 0.5
#define NS 12       /* samples in the batch */
#define BUCKET 8192 /* floats: the tiny model has ~100k parameters, so a dozen buckets */


/* NS samples of different lengths with advantages of both signs; prox and behaviour log-probs
 * from model m (so the first step's ratio is 1 and later ones are not). */
static void make_samples(rf_train_sample *s, rf_model *m) {
    rf_test_train_samples(s, NS, m);
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < s[i].n_resp; t++) {
            s[i].returns[t] = 0.3f * (i % 5) - 0.4f;
            s[i].values[t] = 0.1f * t - 0.2f;
        }
}

static void free_samples(rf_train_sample *s) {
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]);
}

/* max |a - b| / max |b| */
static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, mx = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        mx = fmax(mx, fabs((double)b[i]));
    }
    return mx > 0 ? d / mx : d;
}

static rf_optim_opts optim(void) {
    /* eps above the rounding noise of zero gradients (see the top) */
    return (rf_optim_opts){.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-6f, .grad_clip = 0.05f};
}

static rf_update_opts update_opts(rf_loss_agg agg) {
    rf_update_opts uo = {.pg = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0.01f}, .agg = agg, .max_resp_len = 7,
                         .epochs = 2, .mini_batches = 1, .micro_tokens = 12, .inv_temp = 1.0f,
                         .value_clip = 0.2f, .shuffle_seed = 7};
    return uo;
}

/* ---- one process ---- */

static void run_backward(rf_model *m) {
    int32_t tok[9] = {1, 5, 9, 3, 7, 2, 8, 4, 6}, tgt[9] = {5, 9, 3, 7, 2, 8, 4, 6, 1}, cu[3] = {0, 4, 9};
    rf_batch b = {2, 9, tok, NULL, cu};
    float lp[9], d[9];
    for (int i = 0; i < 9; i++) d[i] = 0.1f * (float)(i - 4);
    rf_model_zero_grad(m);
    RF_ASSERT(rf_model_forward(m, &b) == RF_OK);
    RF_ASSERT(rf_model_logprobs(m, tgt, 1.0f, lp, NULL) == RF_OK);
    rf_error_clear();
    m->T = 9; /* backward below */
    rf_status st = rf_model_backward(m, d, NULL, NULL);
    if (st != RF_OK && !strstr(rf_error_message(), "hook stops")) CHECK_OK(st);
}

static void backward_pass(void *m) { run_backward(m); }

static void backward_hook(void) {
    rf_model *m = rf_test_tiny_model(11, 0);
    rf_test_hook_log h;
    rf_test_hook_pass(m, backward_pass, m, &h);
    int L = m->cfg.num_hidden_layers;
    CHECK(h.count == 2 * L + 2);
    CHECK(h.off[0] + h.n[0] == m->n_params);
    CHECK(rf_test_hook_contiguous(&h));
    CHECK(h.off[h.count - 1] == 0 && h.n[h.count - 1] == (size_t)m->cfg.vocab_size * m->cfg.hidden_size);
    CHECK(h.off[1] == (size_t)(m->layers[L - 1].ln2 - m->params));
    CHECK(h.off[2] == (size_t)(m->layers[L - 1].ln1 - m->params));
    h = (rf_test_hook_log){.fail_at = 2};
    int32_t tok[3] = {1, 2, 3}, cu[2] = {0, 3};
    rf_batch b = {1, 3, tok, NULL, cu};
    float lp[3], d[3] = {1, 1, 1};
    CHECK_OK(rf_model_forward(m, &b));
    CHECK_OK(rf_model_logprobs(m, tok, 1.0f, lp, NULL));
    CHECK_ERR(rf_model_backward(m, d, NULL, NULL), RF_ERR_IO, "hook stops at 2");
    CHECK(h.count == 2);
    rf_model_set_grad_hook(m, NULL, NULL);
    CHECK(m->grad_ready == NULL && m->grad_ready_ctx == NULL);
    rf_model_free(m);
}

/* DP over one rank: plain DP is the single-rank update itself (bit for bit), ZeRO-1 within
 * tolerance (its norm sums the squares in another order). */
static void single_rank_dp(void) {
    rf_model *a = rf_test_tiny_model(3, 0), *b = rf_test_tiny_model(3, 0), *z = rf_test_tiny_model(3, 0);
    rf_train_sample s[NS];
    make_samples(s, a);
    rf_optim_opts oo = optim();
    rf_update_opts uo = update_opts(RF_AGG_TOKEN_MEAN);
    rf_dp *dp = NULL, *dz = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .timeout_s = 5};
    CHECK_OK(rf_dp_init(&dp, rf_comm_single(), b, &o));
    o.zero = 1;
    CHECK_OK(rf_dp_init(&dz, rf_comm_single(), z, &o));
    CHECK(z->opt_m == NULL && z->opt_v == NULL);
    for (int k = 0; k < 2; k++) {
        rf_update_stats sa = {0}, sb = {0}, sz = {0};
        CHECK_OK(rf_actor_update(a, &oo, &uo, s, NS, &sa));
        uo.dp = dp;
        CHECK_OK(rf_actor_update(b, &oo, &uo, s, NS, &sb));
        uo.dp = dz;
        CHECK_OK(rf_actor_update(z, &oo, &uo, s, NS, &sz));
        uo.dp = NULL;
        CHECK(sa.pg.tokens == sb.pg.tokens && sa.tokens == sz.tokens && sa.optimizer_steps == sz.optimizer_steps);
        CHECK(sa.grad_norm == sb.grad_norm);
        CHECK_CLOSE(sz.grad_norm, sa.grad_norm, 0, 1e-5);
    }
    CHECK(memcmp(a->params, b->params, sizeof(float) * a->n_params) == 0);
    double d = rel_diff(z->params, a->params, a->n_params);
    CHECK(d < 1e-5);
    if (!(d < 1e-5)) fprintf(stderr, "ZeRO-1 on one rank: %g\n", d);
    CHECK_OK(rf_dp_gather_optimizer(dz));
    CHECK(z->opt_m && rel_diff(z->opt_m, a->opt_m, a->n_params) < 1e-5);
    rf_dp_release_optimizer(dz);
    CHECK(z->opt_m == NULL);
    /* exact counts */
    long in[3] = {(1L << 35) + 12345, 0, 4095}, out[3];
    CHECK_OK(rf_dp_sum(dp, in, out, 3, "sum"));
    CHECK(out[0] == in[0] && out[1] == 0 && out[2] == 4095);
    rf_dp_free(dp), rf_dp_free(dz);
    CHECK(b->grad_ready == NULL);
    free_samples(s);
    rf_model_free(a), rf_model_free(b), rf_model_free(z);
}

/* ---- under mpirun ---- */

static int g_rank, g_size;

/* rank r's share of the batch: [lo, hi), uneven (lo = NS r^2 / size^2): on 4 ranks rank 0
 * has none. */
static void share(int r, int size, int *lo, int *hi) {
    *lo = NS * r * r / (size * size);
    *hi = NS * (r + 1) * (r + 1) / (size * size);
}

static void started_collectives(rf_comm *c) {
    enum { N = 3000 };
    float *a = malloc(sizeof(float) * N * 3), *rs = malloc(sizeof(float) * N);
    float *rs_in = malloc(sizeof(float) * N * (size_t)g_size);
    for (int i = 0; i < 3 * N; i++) a[i] = (float)(g_rank + 1) * (float)(i % 7);
    for (int i = 0; i < N * g_size; i++) rs_in[i] = (float)(i / N + g_rank); /* block q: q + rank */
    rf_comm_group *g[4] = {0};
    CHECK_OK(rf_comm_allreduce_start(c, a, a, N, T_OK, "allreduce 1", &g[0]));
    CHECK_OK(rf_comm_allreduce_start(c, a + N, a + N, N, T_OK, "allreduce 2", &g[1]));
    CHECK_OK(rf_comm_reduce_scatter_start(c, rs_in, rs, N, T_OK, "reduce-scatter", &g[2]));
    CHECK_OK(rf_comm_allreduce_start(c, a + 2 * N, a + 2 * N, N, T_OK, "allreduce 3", &g[3]));
    int done = 0;
    double t0 = rf_time_now();
    while (!done && rf_time_now() - t0 < 10) {
        done = 1;
        for (int i = 0; i < 4; i++) {
            int t = rf_comm_group_test(g[i]);
            CHECK(t >= 0);
            done &= t == 1;
        }
    }
    CHECK(done);
    for (int i = 0; i < 4; i++) CHECK_OK(rf_comm_group_wait(g[i], T_OK));
    float ranks_sum = (float)(g_size * (g_size + 1) / 2);
    int ok = 1;
    for (int i = 0; i < 3 * N; i++) ok &= a[i] == ranks_sum * (float)(i % 7);
    for (int i = 0; i < N; i++) ok &= rs[i] == (float)(g_size * g_rank + g_size * (g_size - 1) / 2);
    CHECK(ok);
    free(a), free(rs), free(rs_in);
}

/* Ranks start from different weights; after rf_dp_init all hold rank 0's. */
static void init_broadcasts(rf_comm *c) {
    rf_model *m = rf_test_tiny_model(100 + (uint64_t)g_rank, 0), *ref = rf_test_tiny_model(100, 0);
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init(&dp, c, m, &o));
    CHECK(memcmp(m->params, ref->params, sizeof(float) * m->n_params) == 0);
    rf_dp_free(dp);
    rf_model_free(m), rf_model_free(ref);
}

/* rf_dp_init of m with o: afterwards (the moments gathered again with ZeRO-1) every rank holds
 * optimizer step 42 and the moments want_m / want_v bit for bit (`how` names the way, in a
 * failure's message). */
static void init_gives_moments(rf_comm *c, rf_model *m, const rf_dp_opts *o, const float *want_m, const float *want_v,
                               const char *how) {
    size_t n = m->n_params;
    rf_dp *dp = NULL;
    CHECK_OK(rf_dp_init(&dp, c, m, o));
    if (o->zero) CHECK(m->opt_m == NULL); /* the whole moments freed on every rank */
    if (dp) CHECK_OK(rf_dp_gather_optimizer(dp));
    CHECK(m->opt_step == 42);
    int same = m->opt_m && m->opt_v && memcmp(m->opt_m, want_m, sizeof(float) * n) == 0 &&
               memcmp(m->opt_v, want_v, sizeof(float) * n) == 0;
    if (!same) fprintf(stderr, "rank %d: the moments %s are not rank 0's\n", g_rank, how);
    CHECK(same);
    if (dp) rf_dp_release_optimizer(dp);
    rf_dp_free(dp);
}

/* A resumed optimizer state (rank 0's moments and step, different moments elsewhere) reaches
 * every rank: plain DP holds rank 0's moments, ZeRO-1 its blocks of them (gathered again: rank
 * 0's bits), with the padded last bucket (7 ranks' worth of floats do not divide it). */
static void init_shares_moments(rf_comm *c, int zero) {
    rf_model *m = rf_test_tiny_model(100, 0);
    CHECK_OK(rf_model_enable_training(m));
    size_t n = m->n_params;
    float *want_m = malloc(sizeof(float) * n), *want_v = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) {
        want_m[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f, want_v[i] = (float)(i % 977) * 1e-6f;
        m->opt_m[i] = g_rank ? 7.0f : want_m[i], m->opt_v[i] = g_rank ? 7.0f : want_v[i];
    }
    m->opt_step = g_rank ? 0 : 42;
    rf_dp_opts o = {.bucket_floats = 7001, .timeout_s = T_OK, .zero = zero};
    init_gives_moments(c, m, &o, want_m, want_v, zero ? "sent by rank 0 (ZeRO-1)" : "broadcast");
    free(want_m), free(want_v);
    rf_model_free(m);
}

/* A source of moments that fails on one rank (its file unreadable, say). */
static rf_status failing_src(void *ctx, int which, size_t a, size_t n, float *dst) {
    (void)ctx, (void)which, (void)dst;
    return rf_error(RF_ERR_FORMAT, "moments [%zu, %zu): planted failure", a, a + n);
}

/* ZeRO-1 resumed from a checkpoint's files: rank 0 saves its moments (rf_checkpoint_save, as a
 * run does), then every rank reads its own blocks through rf_checkpoint_moments_read; gathered
 * again they are rank 0's bits, and rank 0's model moments are never read (set to 7 before
 * rf_dp_init, as on the others). A rank whose read fails makes every rank fail, naming it. */
static void init_reads_moments(rf_comm *c) {
    rf_model *m = rf_test_tiny_model(100, 0);
    CHECK_OK(rf_model_enable_training(m));
    size_t n = m->n_params;
    float *want_m = malloc(sizeof(float) * n), *want_v = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        want_m[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f, want_v[i] = (float)(i % 977) * 1e-6f;
    char run[64] = "";
    if (g_rank == 0) {
        snprintf(run, sizeof run, "/tmp/rf_dp_ckpt_XXXXXX");
        CHECK(mkdtemp(run) != NULL);
        memcpy(m->opt_m, want_m, sizeof(float) * n), memcpy(m->opt_v, want_v, sizeof(float) * n);
        m->opt_step = 42;
        rf_ckpt_state cs = {.step = 5};
        CHECK_OK(rf_checkpoint_save(run, m, NULL, NULL, &cs, 0));
    }
    CHECK_OK(rf_comm_bcast(c, run, sizeof run, 0, T_OK, "the checkpoint's run directory"));
    char dir[4200];
    CHECK_OK(rf_checkpoint_latest(run, dir, sizeof dir));
    for (size_t i = 0; i < n; i++) m->opt_m[i] = m->opt_v[i] = 7.0f;
    m->opt_step = g_rank ? 0 : 42;
    rf_ckpt_moments cm;
    CHECK_OK(rf_checkpoint_moments_open(&cm, dir, "actor", m, NULL));
    rf_dp_opts o = {.bucket_floats = 7001, .timeout_s = T_OK, .zero = 1, .moments = rf_checkpoint_moments_read,
                    .moments_ctx = &cm};
    init_gives_moments(c, m, &o, want_m, want_v, "read from the checkpoint's files");
    rf_model_free(m);
    /* the last rank fails to read: every rank returns an error */
    rf_checkpoint_moments_close(&cm);
    m = rf_test_tiny_model(100, 0);
    CHECK_OK(rf_model_enable_training(m));
    CHECK_OK(rf_checkpoint_moments_open(&cm, dir, "actor", m, NULL)); /* the views of this model */
    m->opt_step = 42;
    if (g_rank == g_size - 1) o.moments = failing_src;
    rf_dp *dp = NULL;
    rf_status st = rf_dp_init(&dp, c, m, &o);
    char want[160];
    if (g_rank == g_size - 1) snprintf(want, sizeof want, "reading this rank's optimizer state: moments [");
    else snprintf(want, sizeof want, "ZeRO-1: DP rank %d (world rank %d) could not read its optimizer state", g_size - 1,
                  g_size - 1);
    CHECK(st != RF_OK && dp == NULL && strstr(rf_error_message(), want) != NULL);
    if (st == RF_OK || !strstr(rf_error_message(), want)) fprintf(stderr, "rank %d: want \"%s\", got \"%s\"\n", g_rank, want, rf_error_message());
    rf_dp_free(dp);
    rf_model_free(m);
    rf_checkpoint_moments_close(&cm);
    CHECK_OK(rf_comm_barrier(c, T_OK, "the checkpoint read"));
    char rm[128];
    snprintf(rm, sizeof rm, "rm -rf %s", run);
    if (g_rank == 0 && system(rm) != 0) fprintf(stderr, "could not remove %s\n", run);
    free(want_m), free(want_v);
}

/* Every rank's parameters are the same bits: their checksums gathered. */
static int same_on_every_rank(rf_comm *c, const rf_model *m) {
    uint64_t h = 1469598103934665603ull, *all = malloc(sizeof(uint64_t) * (size_t)g_size);
    const unsigned char *p = (const unsigned char *)m->params;
    for (size_t i = 0; i < m->n_params * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
    int same = rf_comm_allgather(c, &h, all, sizeof h, T_OK, "checksums") == RF_OK;
    for (int r = 0; same && r < g_size; r++) same = all[r] == h;
    free(all);
    return same;
}

/* The DP update on this rank's share against the single-rank update on the whole batch. */
static void dp_equals_one_rank(rf_comm *c, rf_loss_agg agg, int critic, int zero) {
    rf_model *ref = rf_test_tiny_model(3, critic), *m = rf_test_tiny_model(3, critic), *init = rf_test_tiny_model(3, critic);
    rf_train_sample s[NS];
    rf_model *pol = critic ? rf_test_tiny_model(3, 0) : NULL;
    make_samples(s, pol ? pol : ref);
    rf_optim_opts oo = optim();
    rf_update_opts uo = update_opts(agg);
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .zero = zero, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init(&dp, c, m, &o));
    int lo, hi;
    share(g_rank, g_size, &lo, &hi);
    double max_norm = 0;
    for (int k = 0; k < 3; k++) {
        rf_update_stats sr = {0}, sd = {0};
        uo.dp = NULL;
        CHECK_OK(critic ? rf_critic_update(ref, &oo, &uo, s, NS, &sr) : rf_actor_update(ref, &oo, &uo, s, NS, &sr));
        uo.dp = dp;
        CHECK_OK(critic ? rf_critic_update(m, &oo, &uo, s + lo, hi - lo, &sd) : rf_actor_update(m, &oo, &uo, s + lo, hi - lo, &sd));
        CHECK(sd.tokens == sr.tokens && sd.pg.tokens == sr.pg.tokens && sd.optimizer_steps == sr.optimizer_steps);
        CHECK_CLOSE(sd.grad_norm, sr.grad_norm, 0, 1e-4);
        if (critic) CHECK_CLOSE(sd.value_loss, sr.value_loss, 1e-9, 1e-4);
        else CHECK_CLOSE(sd.pg.loss, sr.pg.loss, 1e-9, 1e-4);
        CHECK(sd.pg.clipped == sr.pg.clipped && sd.pg.is_weight_max == sr.pg.is_weight_max);
        max_norm = fmax(max_norm, sr.grad_norm);
    }
    CHECK(max_norm > oo.grad_clip); /* clipping was on the path */
    double moved = rel_diff(ref->params, init->params, ref->n_params);
    double d = rel_diff(m->params, ref->params, ref->n_params);
    CHECK(moved > 1e-3);
    CHECK(d < 1e-5);
    if (g_rank == 0 || !(d < 1e-5))
        printf("rank %d of %d: agg %d critic %d zero %d: parameters moved %.3g, DP vs one rank %.3g (max grad norm %.3g)\n",
               g_rank, g_size, (int)agg, critic, zero, moved, d, max_norm);
    CHECK(same_on_every_rank(c, m));
    rf_dp_free(dp);
    free_samples(s);
    rf_model_free(ref), rf_model_free(m), rf_model_free(init), rf_model_free(pol);
}

/* The tiny model (seed) with rank-4 adapters on every projection (A gaussian, seed 5; B zero),
 * training buffers for the adapters only. */
static rf_model *tiny_lora(uint64_t seed) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 50) == RF_OK);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, seed, 0.2f);
    rf_lora_opts lo = {4, 8.0f, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_GAUSSIAN, 5};
    RF_ASSERT(rf_model_lora_attach(m, &lo) == RF_OK);
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    return m;
}

/* LoRA: the DP update of the adapters on this rank's share (plain, or ZeRO-1) against one rank
 * on the whole batch; the base stays as it was. */
static void lora_equals_one_rank(rf_comm *c, int zero) {
    rf_model *ref = tiny_lora(3), *m = tiny_lora(3), *init = tiny_lora(3);
    rf_train_sample s[NS];
    make_samples(s, ref);
    rf_optim_opts oo = optim();
    oo.grad_clip = 0.01f;
    rf_update_opts uo = update_opts(RF_AGG_TOKEN_MEAN);
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = 2048, .zero = zero, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init(&dp, c, m, &o));
    int lo = NS * g_rank / g_size, hi = NS * (g_rank + 1) / g_size; /* every rank has work: its backward reports */
    double max_norm = 0;
    for (int k = 0; k < 3; k++) {
        rf_update_stats sr = {0}, sd = {0};
        uo.dp = NULL;
        CHECK_OK(rf_actor_update(ref, &oo, &uo, s, NS, &sr));
        uo.dp = dp;
        CHECK_OK(rf_actor_update(m, &oo, &uo, s + lo, hi - lo, &sd));
        CHECK(sd.tokens == sr.tokens && sd.optimizer_steps == sr.optimizer_steps);
        CHECK_CLOSE(sd.grad_norm, sr.grad_norm, 0, 1e-4);
        CHECK_CLOSE(sd.pg.loss, sr.pg.loss, 1e-9, 1e-4);
        max_norm = fmax(max_norm, sr.grad_norm);
    }
    CHECK(max_norm > oo.grad_clip);
    size_t n = m->n_params - m->n_frozen, f = m->n_frozen;
    double moved = rel_diff(ref->params + f, init->params + f, n), d = rel_diff(m->params + f, ref->params + f, n);
    CHECK(moved > 1e-3);
    CHECK(d < 1e-5);
    CHECK(memcmp(m->params, init->params, sizeof(float) * f) == 0);
    const rf_dp_stats *ds = rf_dp_get_stats(dp);
    CHECK(ds->buckets_early > 0);
    double dm = 0, dr = 0;
    if (zero) { /* the moments of the adapters, gathered whole, and one adapter's range on rank 0 */
        CHECK(!m->opt_m);
        CHECK_OK(rf_dp_gather_optimizer(dp));
        dm = fmax(rel_diff(m->opt_m, ref->opt_m, n), rel_diff(m->opt_v, ref->opt_v, n));
        CHECK(dm < 1e-4);
        rf_dp_release_optimizer(dp);
        const rf_param_view *v = &m->lora.views[3];
        float *got = g_rank == 0 ? calloc(v->numel, sizeof(float)) : NULL;
        CHECK_OK(rf_dp_moment_range(dp, 2, v->offset - f, v->numel, got));
        if (got) dr = rel_diff(got, ref->opt_v + (v->offset - f), v->numel);
        CHECK(dr < 1e-4);
        free(got);
        CHECK_ERR(rf_dp_moment_range(dp, 1, n - 1, 2, NULL), RF_ERR_ARG, "rf_dp_moment_range: moment 1, floats");
    }
    if (g_rank == 0 || !(d < 1e-5))
        printf("rank %d of %d: LoRA, zero %d (%zu adapter floats, %ld buckets started early of %ld): adapters moved %.3g, "
               "DP vs one rank %.3g, moments %.3g, a moment range %.3g (max grad norm %.3g)\n", g_rank, g_size, zero, n,
               ds->buckets_early, ds->buckets, moved, d, dm, dr, max_norm);
    CHECK(same_on_every_rank(c, m));
    rf_dp_free(dp);
    free_samples(s);
    rf_model_free(ref), rf_model_free(m), rf_model_free(init);
}

/* ZeRO-1 against plain DP with 2 mini-batches, 2 epochs and weight decay. */
static void zero_equals_plain(rf_comm *c) {
    rf_model *p = rf_test_tiny_model(5, 0), *z = rf_test_tiny_model(5, 0);
    rf_train_sample s[NS];
    make_samples(s, p);
    rf_optim_opts oo = optim();
    oo.weight_decay = 0.01f;
    rf_update_opts uo = update_opts(RF_AGG_SEQ_MEAN_TOKEN_MEAN);
    uo.mini_batches = 2;
    rf_dp *dp = NULL, *dz = NULL;
    /* 7 buckets: 14000 floats each (a multiple of 2 and 4 ranks), the last one the rest */
    rf_dp_opts o = {.bucket_floats = 14000, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init(&dp, c, p, &o));
    o.zero = 1;
    CHECK_OK(rf_dp_init(&dz, c, z, &o));
    CHECK(z->opt_m == NULL && z->opt_v == NULL);
    int lo, hi;
    share(g_rank, g_size, &lo, &hi);
    for (int k = 0; k < 2; k++) {
        rf_update_stats sp = {0}, sz = {0};
        uo.dp = dp;
        CHECK_OK(rf_actor_update(p, &oo, &uo, s + lo, hi - lo, &sp));
        uo.dp = dz;
        CHECK_OK(rf_actor_update(z, &oo, &uo, s + lo, hi - lo, &sz));
        CHECK(sp.optimizer_steps == 4 && sz.optimizer_steps == 4 && sp.tokens == sz.tokens);
        CHECK_CLOSE(sz.grad_norm, sp.grad_norm, 0, 1e-4);
    }
    double d = rel_diff(z->params, p->params, p->n_params);
    CHECK(d < 1e-5);
    CHECK_OK(rf_dp_gather_optimizer(dz));
    double dm = z->opt_m ? rel_diff(z->opt_m, p->opt_m, p->n_params) : 1;
    double dv = z->opt_v ? rel_diff(z->opt_v, p->opt_v, p->n_params) : 1;
    CHECK(dm < 1e-5 && dv < 1e-4);
    if (g_rank == 0 || !(d < 1e-5 && dm < 1e-5 && dv < 1e-4))
        printf("rank %d of %d: ZeRO-1 vs plain DP: parameters %.3g, exp_avg %.3g, exp_avg_sq %.3g\n", g_rank, g_size,
               d, dm, dv);
    /* ranges onto rank 0 (a checkpoint's tensors): the same bits as the whole gather; one float,
     * within one block, across blocks and buckets, the padded end, everything, nothing */
    size_t n = z->n_params;
    float *all_m = malloc(sizeof(float) * n), *all_v = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    if (z->opt_m) memcpy(all_m, z->opt_m, sizeof(float) * n), memcpy(all_v, z->opt_v, sizeof(float) * n);
    rf_dp_release_optimizer(dz);
    const size_t range[][2] = {{0, 1}, {10, 100}, {13990, 30}, {5, 40000}, {n - 333, 333}, {0, n}, {77, 0}};
    for (size_t i = 0; i < sizeof range / sizeof range[0]; i++)
        for (int which = 1; which <= 2; which++) {
            memset(got, 0xff, sizeof(float) * n);
            CHECK_OK(rf_dp_moment_range(dz, which, range[i][0], range[i][1], g_rank == 0 ? got : NULL));
            if (g_rank == 0)
                CHECK(memcmp(got, (which == 1 ? all_m : all_v) + range[i][0], sizeof(float) * range[i][1]) == 0);
        }
    CHECK(z->opt_m == NULL);
    CHECK_ERR(rf_dp_moment_range(dz, 1, n - 1, 2, got), RF_ERR_ARG, "floats [");
    CHECK_ERR(rf_dp_moment_range(dp, 1, 0, 1, got), RF_ERR_ARG, "without ZeRO-1");
    free(all_m), free(all_v), free(got);
    CHECK(same_on_every_rank(c, z));
    const rf_dp_stats *st = rf_dp_get_stats(dz);
    CHECK(st->syncs == 8 && st->buckets == 8 * 7);
    rf_dp_free(dp), rf_dp_free(dz);
    free_samples(s);
    rf_model_free(p), rf_model_free(z);
}

/* Shares of one sample with mini_batches = 2: the first mini-batch is empty on every rank and
 * is skipped (no optimizer step), so the update is one rank's with mini_batches = 1 over the
 * same samples. */
static void empty_mini_batches(rf_comm *c) {
    rf_model *ref = rf_test_tiny_model(13, 0), *m = rf_test_tiny_model(13, 0);
    rf_train_sample s[NS];
    make_samples(s, ref);
    rf_optim_opts oo = optim();
    rf_update_opts uo = update_opts(RF_AGG_TOKEN_MEAN);
    rf_update_stats sr = {0}, sd = {0};
    CHECK_OK(rf_actor_update(ref, &oo, &uo, s, g_size, &sr));
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init(&dp, c, m, &o));
    uo.dp = dp, uo.mini_batches = 2;
    CHECK_OK(rf_actor_update(m, &oo, &uo, s + g_rank, 1, &sd));
    CHECK(sd.optimizer_steps == sr.optimizer_steps && sd.optimizer_steps == 2 && m->opt_step == 2);
    double d = rel_diff(m->params, ref->params, ref->n_params);
    CHECK(d < 1e-5);
    if (!(d < 1e-5)) fprintf(stderr, "empty mini-batches: %g\n", d);
    rf_dp_free(dp);
    free_samples(s);
    rf_model_free(ref), rf_model_free(m);
}

/* Buckets are started while backward still has layers to go: exactly those wholly past the
 * embedding when overlapping, none when deferred. Every rank has work here (a share of at least
 * one sample). */
static void overlap(rf_comm *c, int defer) {
    rf_model *m = rf_test_tiny_model(9, 0);
    rf_train_sample s[NS];
    make_samples(s, m);
    rf_optim_opts oo = optim();
    rf_update_opts uo = update_opts(RF_AGG_TOKEN_MEAN);
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .defer = defer, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init(&dp, c, m, &o));
    int lo = NS * g_rank / g_size, hi = NS * (g_rank + 1) / g_size;
    uo.dp = dp;
    rf_update_stats st = {0};
    CHECK_OK(rf_actor_update(m, &oo, &uo, s + lo, hi - lo, &st));
    const rf_dp_stats *ds = rf_dp_get_stats(dp);
    long nb = ds->buckets / (ds->syncs ? ds->syncs : 1);
    /* buckets wholly past the embedding are final before backward reaches it */
    long early = 0;
    for (long k = 0; k < nb; k++)
        early += (long)m->n_params - (k + 1) * BUCKET >= (long)m->cfg.vocab_size * m->cfg.hidden_size;
    if (g_rank == 0)
        printf("%d ranks, %s: %ld buckets per step, %ld of %ld started while backward had layers to go, "
               "%ld seen complete then, %.4f s waiting after it\n", g_size, defer ? "deferred" : "overlapped", nb,
               ds->buckets_early, ds->buckets, ds->buckets_done_early, ds->wait_s);
    CHECK(ds->syncs == 2 && nb > 5 && early > 5);
    CHECK(ds->buckets_early == (defer ? 0 : ds->syncs * early));
    rf_dp_free(dp);
    free_samples(s);
    rf_model_free(m);
}

/* The other ranks as the message lists them, for 2 and 4 ranks. */
static const char *others(int rank) {
    static const char *two[2] = {"world rank 1", "world rank 0"};
    static const char *four[4] = {"world ranks 1-3", "world ranks 0, 2-3", "world ranks 0-1, 3", "world ranks 0-2"};
    return g_size == 2 ? two[rank] : g_size == 4 ? four[rank] : "(a size this test does not know)";
}

/* The last rank never joins the step (its process could be gone): the others' step fails in
 * the first gradient bucket, within the bound, with RF_ERR_IO naming the operation. */
static void lost_rank(rf_comm *world, int zero) {
    const double bound = 2.0;
    rf_comm *c = NULL;
    CHECK_OK(rf_comm_split(world, 0, g_rank, &c));
    rf_model *m = rf_test_tiny_model(9, 0);
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .zero = zero, .timeout_s = bound};
    CHECK_OK(rf_dp_init(&dp, c, m, &o));
    if (dp && g_rank != g_size - 1) {
        int32_t tok[6] = {1, 5, 9, 3, 7, 2}, cu[2] = {0, 6};
        rf_batch b = {1, 6, tok, NULL, cu};
        float lp[6], d[6] = {1, 1, 1, 1, 1, 1};
        rf_model_zero_grad(m);
        CHECK_OK(rf_model_forward(m, &b));
        CHECK_OK(rf_model_logprobs(m, tok, 1.0f, lp, NULL));
        rf_dp_arm(dp);
        CHECK_OK(rf_model_backward(m, d, NULL, NULL));
        double t0 = rf_time_now();
        rf_error_clear();
        rf_status st = rf_dp_sync_grads(dp);
        double dt = rf_time_now() - t0;
        char want[512];
        int nb = (int)((m->n_params + BUCKET - 1) / BUCKET);
        snprintf(want, sizeof want, "%s of gradient bucket 1 of %d: world rank %d waited %g s for %s (a rank is gone or stuck)",
                 zero ? "reduce-scatter" : "allreduce", nb, g_rank, bound, others(g_rank));
        CHECK(st == RF_ERR_IO);
        CHECK(strcmp(rf_error_message(), want) == 0);
        if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), want);
        CHECK(dt >= bound && dt < bound + 1.5);
        /* the step cannot go on: the communicator refuses at once */
        CHECK_ERR(rf_dp_sync_grads(dp), RF_ERR_IO, "this communicator failed earlier");
    }
    rf_dp_free(dp);
    rf_comm_free(c);
    rf_model_free(m);
    CHECK_OK(rf_comm_barrier(world, T_OK, "after the lost rank"));
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = NULL;
    if (rf_comm_world(&argc, &argv, &world) != RF_OK) {
        fprintf(stderr, "test_dp: %s\n", rf_error_message());
        return 1;
    }
    g_rank = rf_comm_rank(world), g_size = rf_comm_size(world);
    started_collectives(world);
    init_broadcasts(world);
    init_shares_moments(world, 0);
    init_shares_moments(world, 1);
    init_reads_moments(world);
    for (int agg = 0; agg < 4; agg++) dp_equals_one_rank(world, (rf_loss_agg)agg, 0, 0);
    dp_equals_one_rank(world, RF_AGG_TOKEN_MEAN, 1, 0);
    dp_equals_one_rank(world, RF_AGG_SEQ_MEAN_TOKEN_SUM, 0, 1);
    zero_equals_plain(world);
    lora_equals_one_rank(world, 0);
    lora_equals_one_rank(world, 1);
    empty_mini_batches(world);
    overlap(world, 0);
    overlap(world, 1);
    lost_rank(world, 0);
    lost_rank(world, 1);
    int rc = rf_test_mpi_finish(world, "test_dp");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    backward_hook();
    single_rank_dp();
    if (!rf_test_have_mpirun()) {
        printf("test_dp: MPI part skipped: mpirun not found (apt-get install openmpi-bin)\n");
        return rf_test_failed ? 1 : rf_test_finish("test_dp");
    }
    /* ranks share the 2 cores: one thread each, idle threads asleep */
    setenv("OMP_NUM_THREADS", "1", 1);
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    CHECK(rf_test_mpirun_self(2, 300, NULL) == 0);
    CHECK(rf_test_mpirun_self(4, 300, NULL) == 0);
    return rf_test_finish("test_dp");
}
