/* Data and tensor parallelism together in the update (a tp x dp grid, Megatron-LM's layout):
 * world rank r is replica d = r / tp, TP rank t = r % tp (tp varies fastest); the TP group of
 * a replica and the DP group of a TP position are splits of the world.
 *
 * In this process: tp 1 x dp 1 over single-rank communicators equals the whole model's update.
 * Under `mpirun --oversubscribe` with 4 ranks (tp 2 x dp 2), on the tiny model with its 2 k/v
 * heads split over the shards and with 1 k/v head replicated on both (partial replicated
 * gradients summed at the end of backward, so the backward hook holds their ranges back):
 *   - the backward hook of rf_model_tp_backward: ranges from the end of the shard's buffer to
 *     its start, contiguous, covering it once; the same gradients with and without a hook;
 *   - the update with uo.tp and uo.dp (rf_dp_init_tp), each replica on its share of the batch
 *     (uneven: 4 and 8 samples), equals one rank's update of the whole model on the combined
 *     batch under every loss aggregation mode: 3 updates x 2 epochs (6 optimizer steps),
 *     micro-batches of 12 tokens, clipping that clips (a norm of one shard or of one replica's
 *     gradient would clip by another factor), entropy and KL terms; every shard within 1e-5 of
 *     the largest parameter of the slice of the whole model's; statistics (tokens, steps, loss,
 *     grad norm) the whole batch's; replicated tensors bit-identical over each TP group, and
 *     every shard bit-identical over its DP group;
 *   - and equals tp alone (uo.tp, no dp) on the combined batch, within the same bound;
 *   - the critic (value head replicated on every shard) split over the grid: its values equal
 *     the whole critic's within 1e-5 of the largest, and 2 value updates (clipped values,
 *     2 epochs, gradient clipping that clips, weight decay; plain and
 *     ZeRO-1; lr 0.03, so that values move past the clip range) on each replica's share
 *     equal one rank's on the combined batch within 1e-4 (the 1e-5 bound below, at lr 3e-3,
 *     scaled with the step size);
 *   - ZeRO-1 over each DP group equals plain (2 mini-batches, 2 epochs, weight decay, small
 *     buckets, the last padded): parameters and the gathered AdamW moments within 1e-5; and it
 *     equals one rank with one mini-batch.
 * Tolerance: as test_dp.c and test_train_tp.c (fp32 summation order differs; AdamW's eps = 1e-6
 * above the rounding noise of zero gradients): 1e-5 of the largest parameter. Skips the MPI
 * part without mpirun. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "model/model_tp.h"
#include "test_comm_util.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/data_parallel.h"

#define T_OK 60.0
#define NS 12       /* samples in the batch */
#define BUCKET 8192 /* floats: a shard of the tiny model has ~55k, so 7 buckets */
#define TP 2

static int g_rank, g_size;

/* The grid's groups and this rank's place in it. */
typedef struct grid {
    rf_comm *tpc, *dpc;
    int d, t, dp;
} grid;

static void free_samples(rf_train_sample *s) {
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]);
}

static rf_optim_opts optim(float weight_decay) {
    /* grad_clip below every aggregation mode's norm on this batch (the smallest, 2.7e-3) */
    return (rf_optim_opts){.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-6f, .grad_clip = 0.002f,
                           .weight_decay = weight_decay};
}

static rf_update_opts update_opts(rf_loss_agg agg, int mini_batches) {
    rf_update_opts uo = {.pg = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0.01f}, .agg = agg, .max_resp_len = 7,
                         .epochs = 2, .mini_batches = mini_batches, .micro_tokens = 12, .inv_temp = 1.0f,
                         .shuffle_seed = 7};
    uo.pg.entropy_coef = 0.001f;
    return uo;
}

/* NS samples (log-probs from m) with reference log-probs for the KL term. */
static void make_samples(rf_train_sample *s, rf_model *m) {
    rf_test_train_samples(s, NS, m);
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < s[i].n_resp; t++) s[i].ref_logp[t] = s[i].prox_logp[t] - 0.05f * (float)(t % 3);
}

/* Replica d's share [lo, hi): uneven, 4 of 12 samples for replica 0 of 2. */
static void share(int d, int dp, int *lo, int *hi) {
    *lo = NS * d * d / (dp * (dp + 1)) * 2;
    *hi = d == dp - 1 ? NS : NS * (d + 1) * (d + 1) / (dp * (dp + 1)) * 2;
}

/* This rank's shard of `whole`, training enabled, over the grid's TP group. */
static rf_model_tp *shard_of(const grid *g, const rf_model *whole) {
    rf_model_tp *tp = NULL;
    CHECK_OK(rf_model_tp_init(&tp, &whole->cfg, rf_cpu_kernels(), g->tpc, T_OK));
    CHECK_OK(rf_model_tp_set_full(tp, whole->params));
    CHECK_OK(rf_model_tp_enable_training(tp));
    return tp;
}

/* 1 when a (n floats) is the same bits on every rank of c. */
static int same_bits(rf_comm *c, const float *a, size_t n) {
    uint64_t h = 1469598103934665603ull, *all = malloc(sizeof(uint64_t) * (size_t)rf_comm_size(c));
    const unsigned char *p = (const unsigned char *)a;
    for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
    int same = rf_comm_allgather(c, &h, all, sizeof h, T_OK, "checksums") == RF_OK;
    for (int r = 0; same && r < rf_comm_size(c); r++) same = all[r] == h;
    free(all);
    return same;
}

/* max |a - b| / max |b| */
static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, mx = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i])), mx = fmax(mx, fabs((double)b[i]));
    return mx > 0 ? d / mx : d;
}

/* ---- the backward hook ---- */

static void tp_pass(void *vtp) {
    rf_model_tp *tp = vtp;
    int32_t tok[9] = {1, 5, 9, 3, 7, 2, 8, 4, 6}, tgt[9] = {5, 9, 3, 7, 2, 8, 4, 6, 1}, cu[3] = {0, 4, 9};
    rf_batch b = {2, 9, tok, NULL, cu};
    float lp[9], d[9];
    for (int i = 0; i < 9; i++) d[i] = 0.1f * (float)(i - 4);
    rf_model_tp_zero_grad(tp);
    CHECK_OK(rf_model_tp_forward(tp, &b));
    CHECK_OK(rf_model_tp_logprobs(tp, tgt, 1.0f, lp, NULL));
    CHECK_OK(rf_model_tp_backward(tp, d, NULL, NULL));
}

static void backward_hook(const grid *g, int kv_heads) {
    rf_model *whole = rf_test_tiny_model_kv(11, 0, kv_heads);
    rf_model_tp *tp = shard_of(g, whole);
    rf_model *m = tp->m;
    rf_test_hook_log h;
    rf_test_hook_pass(m, tp_pass, tp, &h);
    CHECK(h.count >= 2 && h.count <= 64);
    CHECK(h.off[0] + h.n[0] == m->n_params && h.off[h.count - 1] == 0 && h.off[0] > 0);
    CHECK(rf_test_hook_contiguous(&h));
    /* split k/v: one range per half layer as rf_model_backward; replicated k/v: the ranges
     * below the last layer's k/v come in one piece after their sum */
    CHECK(tp->n_sync ? h.count < 2 * whole->cfg.num_hidden_layers + 2 : h.count == 2 * whole->cfg.num_hidden_layers + 2);
    if (g_rank == 0) printf("hook, %d k/v heads: %d ranges over %zu floats\n", kv_heads, h.count, m->n_params);
    rf_model_tp_free(tp);
    rf_model_free(whole);
}

/* ---- the update ---- */

/* tp x dp on this replica's share against one rank of the whole model and against tp alone on
 * the combined batch. */
static void grid_equals_one_rank(const grid *g, rf_loss_agg agg, int kv_heads, int zero) {
    rf_model *ref = rf_test_tiny_model_kv(5, 0, kv_heads), *init = rf_test_tiny_model_kv(5, 0, kv_heads);
    rf_train_sample s[NS];
    make_samples(s, ref);
    rf_model_tp *tp = shard_of(g, ref), *solo = shard_of(g, ref);
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .zero = zero, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init_tp(&dp, g->dpc, tp, &o));
    rf_optim_opts oo = optim(0);
    rf_update_opts uo = update_opts(agg, 1);
    int lo, hi;
    share(g->d, g->dp, &lo, &hi);
    double max_norm = 0;
    for (int k = 0; k < 3; k++) {
        rf_update_stats sr = {0}, ss = {0}, sg = {0};
        uo.tp = NULL, uo.dp = NULL;
        CHECK_OK(rf_actor_update(ref, &oo, &uo, s, NS, &sr));
        uo.tp = solo;
        CHECK_OK(rf_actor_update(solo->m, &oo, &uo, s, NS, &ss));
        uo.tp = tp, uo.dp = dp;
        CHECK_OK(rf_actor_update(tp->m, &oo, &uo, s + lo, hi - lo, &sg));
        CHECK(sg.tokens == sr.tokens && sg.pg.tokens == sr.pg.tokens && sg.optimizer_steps == sr.optimizer_steps);
        CHECK_CLOSE(sg.grad_norm, sr.grad_norm, 0, 5e-4);
        CHECK_CLOSE(sg.pg.loss, sr.pg.loss, 1e-9, 1e-4);
        CHECK_CLOSE(sg.pg.entropy, sr.pg.entropy, 1e-9, 1e-4);
        CHECK(sg.pg.clipped == sr.pg.clipped);
        max_norm = fmax(max_norm, sr.grad_norm);
    }
    CHECK(max_norm > oo.grad_clip); /* clipping was on the path */
    double moved = rel_diff(ref->params, init->params, ref->n_params);
    double d1 = rf_test_shard_diff(tp, ref), d2 = rel_diff(tp->m->params, solo->m->params, tp->m->n_params);
    CHECK(moved > 1e-3);
    CHECK(d1 < 1e-5);
    CHECK(d2 < 1e-5);
    CHECK(tp->m->opt_step == ref->opt_step);
    CHECK(rf_test_replicated_same(g->tpc, tp));
    CHECK(same_bits(g->dpc, tp->m->params, tp->m->n_params));
    if (g_rank == 0 || !(d1 < 1e-5 && d2 < 1e-5))
        printf("rank %d: tp %d x dp %d, agg %d, %d k/v heads, zero %d: parameters moved %.3g; vs one rank %.3g, "
               "vs tp alone %.3g (max grad norm %.3g)\n", g_rank, TP, g->dp, (int)agg, kv_heads, zero, moved, d1, d2,
               max_norm);
    rf_dp_free(dp);
    rf_model_tp_free(tp), rf_model_tp_free(solo);
    free_samples(s);
    rf_model_free(ref), rf_model_free(init);
}

/* The critic split over the grid (a value head, replicated on every shard): its values equal
 * the whole critic's, and its value update on each replica's share equals one rank's on the
 * combined batch (clipped values, clipping of the gradient norm on the path). */
static void critic_equals_one_rank(const grid *g, int zero) {
    rf_model *actor = rf_test_tiny_model_kv(6, 0, 2), *ref = rf_test_tiny_model_kv(9, 1, 2);
    rf_train_sample s[NS];
    make_samples(s, actor);
    rf_model_tp *tp = shard_of(g, ref);
    float *whole[NS], *split[NS];
    for (int i = 0; i < NS; i++) whole[i] = s[i].values, split[i] = s[i].returns; /* returns: scratch */
    CHECK_OK(rf_critic_values(ref, s, NS, 12, whole));
    CHECK_OK(rf_critic_values_tp(tp, s, NS, 12, split));
    double dv = 0, vmax = 0;
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < s[i].n_resp; t++)
            dv = fmax(dv, fabs((double)whole[i][t] - split[i][t])), vmax = fmax(vmax, fabs((double)whole[i][t]));
    CHECK(vmax > 1e-3 && dv <= 1e-5 * vmax);
    for (int i = 0; i < NS; i++) /* returns a step away from the values: some clipped at 0.2 */
        for (int t = 0; t < s[i].n_resp; t++) s[i].returns[t] = s[i].values[t] + (i % 2 ? 0.5f : -0.1f) * (float)(1 + t % 2);
    rf_dp *dp = NULL;
    rf_dp_opts o = {.bucket_floats = BUCKET, .zero = zero, .timeout_s = T_OK};
    CHECK_OK(rf_dp_init_tp(&dp, g->dpc, tp, &o));
    rf_optim_opts oo = optim(0.01f);
    oo.grad_clip = 0.05f, oo.lr = 0.03f; /* large enough that the values move past the clip range */
    oo.eps = 1e-4f; /* clipped from a norm near 30 the gradients come near eps = 1e-6, where AdamW's
                       lr * g / (|g| + eps) magnifies rounding: 3.8e-5 from one rank at -O2 and
                       1.2e-4 at -O0 with eps = 1e-6 */
    rf_update_opts uo = update_opts(RF_AGG_TOKEN_MEAN, 1); /* mini-batches of shares are not one rank's */
    uo.value_clip = 0.2f;
    int lo, hi;
    share(g->d, g->dp, &lo, &hi);
    double max_norm = 0;
    for (int k = 0; k < 2; k++) {
        rf_update_stats sr = {0}, sg = {0};
        uo.tp = NULL, uo.dp = NULL;
        CHECK_OK(rf_critic_update(ref, &oo, &uo, s, NS, &sr));
        uo.tp = tp, uo.dp = dp;
        CHECK_OK(rf_critic_update(tp->m, &oo, &uo, s + lo, hi - lo, &sg));
        CHECK(sg.tokens == sr.tokens && sg.optimizer_steps == sr.optimizer_steps);
        CHECK_CLOSE(sg.value_loss, sr.value_loss, 1e-9, 1e-4);
        CHECK_CLOSE(sg.value_clipfrac, sr.value_clipfrac, 1e-9, 1e-4);
        CHECK_CLOSE(sg.grad_norm, sr.grad_norm, 0, 5e-4);
        max_norm = fmax(max_norm, sr.grad_norm);
        if (k == 1) CHECK(sr.value_clipfrac > 0);
    }
    CHECK(max_norm > oo.grad_clip);
    /* 1e-5 at lr 3e-3 elsewhere; lr here is 10x, and what rounding the step magnifies grows with
     * it: measured 4.7e-6 at -O2, 7.2e-6 at -O0 */
    double d = rf_test_shard_diff(tp, ref);
    CHECK(d < 5e-5);
    CHECK(rf_test_replicated_same(g->tpc, tp)); /* the value head among them */
    CHECK(same_bits(g->dpc, tp->m->params, tp->m->n_params));
    if (g_rank == 0 || !(d < 5e-5))
        printf("rank %d: critic split over tp %d x dp %d, zero %d: values vs whole %.3g (max |v| %.3g), after 2 updates "
               "vs one rank %.3g (max grad norm %.3g)\n", g_rank, TP, g->dp, zero, dv, vmax, d, max_norm);
    rf_dp_free(dp);
    rf_model_tp_free(tp);
    free_samples(s);
    rf_model_free(actor), rf_model_free(ref);
}

/* ZeRO-1 against plain, both over the grid: parameters and gathered moments. */
static void zero_equals_plain(const grid *g) {
    rf_model *whole = rf_test_tiny_model_kv(8, 0, 1);
    rf_train_sample s[NS];
    make_samples(s, whole);
    rf_model_tp *a = shard_of(g, whole), *b = shard_of(g, whole);
    rf_dp *pa = NULL, *pb = NULL;
    rf_dp_opts plain = {.bucket_floats = BUCKET, .timeout_s = T_OK}, zero = plain;
    zero.zero = 1;
    CHECK_OK(rf_dp_init_tp(&pa, g->dpc, a, &plain));
    CHECK_OK(rf_dp_init_tp(&pb, g->dpc, b, &zero));
    CHECK(b->m->opt_m == NULL); /* sharded: the whole moments freed */
    rf_optim_opts oo = optim(0.01f);
    rf_update_opts uo = update_opts(RF_AGG_SEQ_MEAN_TOKEN_MEAN, 2);
    int lo, hi;
    share(g->d, g->dp, &lo, &hi);
    for (int k = 0; k < 2; k++) {
        rf_update_stats x = {0}, y = {0};
        uo.tp = a, uo.dp = pa;
        CHECK_OK(rf_actor_update(a->m, &oo, &uo, s + lo, hi - lo, &x));
        uo.tp = b, uo.dp = pb;
        CHECK_OK(rf_actor_update(b->m, &oo, &uo, s + lo, hi - lo, &y));
        CHECK(x.optimizer_steps == 4 && y.optimizer_steps == 4);
        CHECK_CLOSE(y.grad_norm, x.grad_norm, 0, 1e-4);
    }
    CHECK(b->m->opt_m == NULL); /* still sharded after backward passes */
    CHECK_OK(rf_dp_gather_optimizer(pb));
    size_t n = a->m->n_params;
    double dp_ = rel_diff(b->m->params, a->m->params, n), dm = rel_diff(b->m->opt_m, a->m->opt_m, n),
           dv = rel_diff(b->m->opt_v, a->m->opt_v, n);
    CHECK(dp_ < 1e-5 && dm < 1e-5 && dv < 1e-5);
    CHECK(rf_test_replicated_same(g->tpc, b));
    rf_dp_release_optimizer(pb);
    if (g_rank == 0 || !(dp_ < 1e-5 && dm < 1e-5 && dv < 1e-5))
        printf("rank %d: ZeRO-1 vs plain over tp %d x dp %d: parameters %.3g, moments %.3g %.3g\n", g_rank, TP, g->dp,
               dp_, dm, dv);
    rf_dp_free(pa), rf_dp_free(pb);
    rf_model_tp_free(a), rf_model_tp_free(b);
    free_samples(s);
    rf_model_free(whole);
}

/* ---- processes ---- */

static void run_all(const grid *g) {
    backward_hook(g, 2);
    backward_hook(g, 1);
    for (int agg = 0; agg < 4; agg++) grid_equals_one_rank(g, (rf_loss_agg)agg, 2, 0);
    grid_equals_one_rank(g, RF_AGG_TOKEN_MEAN, 1, 0);
    grid_equals_one_rank(g, RF_AGG_SEQ_MEAN_TOKEN_SUM, 1, 1);
    critic_equals_one_rank(g, 0);
    critic_equals_one_rank(g, 1);
    zero_equals_plain(g);
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = rf_test_mpi_world(&argc, &argv, "test_train_tpdp");
    if (!world) return 1;
    g_rank = rf_comm_rank(world), g_size = rf_comm_size(world);
    grid g = {NULL, NULL, g_rank / TP, g_rank % TP, g_size / TP};
    CHECK_OK(rf_comm_split(world, g.d, g_rank, &g.tpc));
    CHECK_OK(rf_comm_split(world, g.t, g_rank, &g.dpc));
    if (g.tpc && g.dpc) run_all(&g);
    rf_comm_free(g.tpc), rf_comm_free(g.dpc);
    int rc = rf_test_mpi_finish(world, "test_train_tpdp");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    grid g = {rf_comm_single(), rf_comm_single(), 0, 0, 1}; /* both groups: this process alone */
    grid_equals_one_rank(&g, RF_AGG_TOKEN_MEAN, 2, 0);
    critic_equals_one_rank(&g, 0);
    const int np[] = {2 * TP};
    return rf_test_mpi_part("test_train_tpdp", np, 1);
}
