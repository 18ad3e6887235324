/* What the tensor-parallel training worker of a split run stands on.
 *
 * In this process: the update with uo.tp over the single-rank communicator (tp 1) equals the
 * update of the whole model.
 * Under `mpirun --oversubscribe` with 2 ranks (tp 2) and 4 ranks (tp 4: the tiny preset's 2 k/v
 * heads replicated over 4 shards):
 *   - rf_actor_logprobs_tp equals rf_actor_logprobs on the whole model (1e-5 relative);
 *   - rf_actor_update with uo.tp equals the update of the whole model: 3 updates x 2 epochs x 2
 *     mini-batches (12 optimizer steps), micro-batches of 12 tokens, clipping that clips (the
 *     whole model's norm is above grad_clip: a shard clipping by its own norm would fail),
 *     under every loss aggregation mode; every shard within 1e-5 of the largest parameter of
 *     the slice of the whole model's; statistics (loss, grad norm, tokens, steps) the same;
 *     replicated tensors bit-identical on every rank;
 *   - weights by resharding (resharding/weights_reshard.h): training ranks 0 .. T-1 (T = 2 and 3
 *     on 4 ranks, 1 on 2 ranks; and on 4 ranks D = 2 and 3 replicas of T = 1) send two versions
 *     to the other ranks, which poll for them as a
 *     rollout worker does: the buffer assembled equals the whole model bit for bit, its
 *     CRC-32C equals the checksum the training ranks computed from the shards, the version is
 *     the one sent; a replicated tensor changed on one training rank is refused by the
 *     checksum (RF_ERR_INTERNAL naming both ranks) before anything is sent; and to
 *     tensor-parallel rollout workers (placement.rollout.tp: 2 training ranks to one worker of
 *     2 ranks, 1 to one of 3): every rollout rank's shard equals the slice of the whole model
 *     bit for bit and the checksum its group computes from the shards is the training ranks'.
 * Tolerance: as test_dp.c (fp32 summation order differs between the whole model and the
 * shards; AdamW with eps = 1e-6 above the rounding noise of zero gradients): 1e-5 of the
 * largest parameter after 12 steps. Skips the MPI part without mpirun. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "common/crc32c.h"
#include "common/util.h"
#include "model/model_tp.h"
#include "resharding/weights_reshard.h"
#include "test_comm_util.h"
#include "test_util.h"
#include "train_util.h"

#define T_OK 60.0
#define NS 12 /* samples in the batch */

static int g_rank, g_size;


/* NS samples of different lengths, advantages of both signs, log-probs from m. */
static void make_samples(rf_train_sample *s, rf_model *m) {
    rf_test_train_samples(s, NS, m);
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < s[i].n_resp; t++) s[i].ref_logp[t] = s[i].prox_logp[t] - 0.05f * (float)(t % 3);
}

static void free_samples(rf_train_sample *s) {
    for (int i = 0; i < NS; i++) rf_train_sample_free(&s[i]);
}

/* Adam's first steps move a parameter by about lr * g / (|g| + eps): where |g| is near eps a
 * rounding difference in g (the shards sum in another order) is magnified by lr / eps. Under
 * Dr. GRPO's aggregation the clipped gradients are small enough that eps = 1e-6 gave 1.3e-5
 * between the shards and the whole model after the first update (and no growth after); eps =
 * 1e-5 gives 1.6e-6, so the check below stays a test of the shards and not of that ratio. */
static rf_optim_opts optim(void) {
    return (rf_optim_opts){.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-5f, .grad_clip = 0.05f,
                           .weight_decay = 0.01f};
}

static rf_update_opts update_opts(rf_loss_agg agg) {
    rf_update_opts uo = {.pg = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0.01f}, .agg = agg, .max_resp_len = 7,
                         .epochs = 2, .mini_batches = 2, .micro_tokens = 12, .inv_temp = 1.0f, .shuffle_seed = 7};
    uo.pg.entropy_coef = 0.001f; /* the entropy's gradient goes through the vocabulary-parallel backward too */
    return uo;
}

static void tp_equals_one_rank(rf_comm *c, rf_loss_agg agg) {
    rf_model *ref = rf_test_tiny_model(5, 0), *init = rf_test_tiny_model(5, 0);
    rf_train_sample s[NS];
    make_samples(s, ref);
    rf_model_tp *tp = NULL;
    CHECK_OK(rf_model_tp_init(&tp, &ref->cfg, rf_cpu_kernels(), c, T_OK));
    CHECK_OK(rf_model_tp_set_full(tp, ref->params));
    CHECK_OK(rf_model_tp_enable_training(tp));
    /* log-probs first */
    float *a[NS], *b[NS];
    for (int i = 0; i < NS; i++) a[i] = calloc((size_t)s[i].n_resp, sizeof(float)), b[i] = calloc((size_t)s[i].n_resp, sizeof(float));
    CHECK_OK(rf_actor_logprobs(ref, s, NS, 20, 1.0f, a, NULL));
    CHECK_OK(rf_actor_logprobs_tp(tp, s, NS, 20, 1.0f, b, NULL));
    double lp = 0;
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < s[i].n_resp; t++) lp = fmax(lp, fabs((double)a[i][t] - b[i][t]) / fmax(1.0, fabs(a[i][t])));
    CHECK(lp < 1e-5);
    for (int i = 0; i < NS; i++) free(a[i]), free(b[i]);
    rf_optim_opts oo = optim();
    rf_update_opts uo = update_opts(agg);
    double max_norm = 0;
    for (int k = 0; k < 3; k++) {
        rf_update_stats sr = {0}, st = {0};
        uo.tp = NULL;
        CHECK_OK(rf_actor_update(ref, &oo, &uo, s, NS, &sr));
        uo.tp = tp;
        CHECK_OK(rf_actor_update(tp->m, &oo, &uo, s, NS, &st));
        CHECK(st.tokens == sr.tokens && st.pg.tokens == sr.pg.tokens && st.optimizer_steps == sr.optimizer_steps);
        CHECK(st.optimizer_steps == 4);
        /* the norm of the update's last step, after up to 11 steps on parameters that differ by
         * rounding: measured up to 1.2e-4 relative at tp 4 */
        CHECK_CLOSE(st.grad_norm, sr.grad_norm, 0, 5e-4);
        CHECK_CLOSE(st.pg.loss, sr.pg.loss, 1e-9, 1e-4);
        CHECK_CLOSE(st.pg.entropy, sr.pg.entropy, 1e-9, 1e-4);
        max_norm = fmax(max_norm, sr.grad_norm);
    }
    CHECK(max_norm > oo.grad_clip); /* clipping was on the path */
    double moved = 0, mx = 0;
    for (size_t i = 0; i < ref->n_params; i++)
        moved = fmax(moved, fabs((double)ref->params[i] - init->params[i])), mx = fmax(mx, fabs((double)init->params[i]));
    double d = rf_test_shard_diff(tp, ref);
    CHECK(moved / mx > 1e-3);
    CHECK(d < 1e-5);
    CHECK(tp->m->opt_step == ref->opt_step);
    CHECK(rf_test_replicated_same(c, tp));
    if (g_rank == 0 || !(d < 1e-5))
        printf("rank %d, tp %d, agg %d: parameters moved %.3g, shards vs whole model %.3g (max grad norm %.3g)\n", g_rank,
               tp->tp, (int)agg, moved / mx, d, max_norm);
    rf_model_tp_free(tp);
    free_samples(s);
    rf_model_free(ref), rf_model_free(init);
}

/* ---- weights by resharding ---- */

/* A rollout rank of a tensor-parallel rollout worker (group gc): waits for its announcement,
 * receives its shard of version v into gtp's model with the group, and checks the checksum
 * computed from the group's shards and the shard itself against the whole model's. */
static void receive_shard(rf_weights_rs *x, rf_model_tp *gtp, rf_comm *gc, const rf_model *whole, int v, uint32_t want) {
    double until = rf_time_now() + T_OK;
    while (rf_weights_rs_pending(x) == 0 && rf_time_now() < until) rf_sleep(0.001);
    int64_t ver = -1;
    uint32_t crc = 0;
    CHECK_OK(rf_weights_rs_receive(x, gtp->m->params, gc, &ver, &crc));
    CHECK(ver == v && crc == want);
    rf_param_table pt = rf_param_table_of(whole);
    float *shard = malloc(gtp->m->n_params * sizeof(float));
    rf_layout_extract(&pt, gtp->shards, whole->params, shard);
    CHECK(memcmp(shard, gtp->m->params, gtp->m->n_params * sizeof(float)) == 0);
    free(shard);
}

/* Training ranks 0 .. D*T-1 (D replicas of T shards, each replica a group tpc) send versions 1
 * and 2 of a model (changed in between) to the rollout ranks D*T .. size-1 of world, whole
 * models (G = 1) or rollout workers of G ranks each holding a shard. 12 query / 3 k/v heads of
 * 4 (T 3 splits them). nodes (NULL: not told): the machine of each world rank, as the launcher
 * sets them; then every byte must go between ranks of one machine where the replicas allow. */
static void weights_by_resharding(rf_comm *world, int T, int D, int G, const int *nodes) {
    int train = g_rank < T * D;
    rf_comm *tpc = NULL, *gc = NULL;
    CHECK_OK(rf_comm_split(world, train ? g_rank / T : D, g_rank, &tpc));
    CHECK_OK(rf_comm_split(world, train ? 0 : 1 + (g_rank - T * D) / G, g_rank, &gc));
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 50) == RF_OK);
    c.num_attention_heads = 12, c.num_key_value_heads = 3, c.head_dim = 4;
    rf_model *whole = NULL;
    RF_ASSERT(rf_model_init(&whole, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(whole, 9, 0.2f);
    rf_param_table pt = rf_param_table_of(whole);
    rf_weights_rs *x = NULL;
    if (nodes) CHECK_OK(rf_comm_set_nodes(nodes, g_size));
    CHECK_OK(rf_weights_rs_init(&x, &pt, T, D, G, world, 4096, T_OK));
    if (nodes) CHECK_OK(rf_comm_set_nodes(NULL, 0));
    size_t across = 0, sent = 0; /* bytes between machines, bytes sent */
    const rf_reshard_plan *p = x ? rf_weights_rs_plan(x) : NULL;
    for (int i = 0; p && i < p->n_moves; i++) {
        const rf_reshard_move *m = &p->moves[i];
        size_t bytes = (size_t)(m->n_runs * m->run) * sizeof(float);
        if (m->src_rank != m->dst_rank) sent += bytes;
        if (nodes && nodes[m->src_rank] != nodes[m->dst_rank]) across += bytes;
    }
    CHECK(sent > 0);
    if (nodes) CHECK(across == 0);
    rf_model_tp *tp = NULL;
    if (train || G > 1) CHECK_OK(rf_model_tp_init(&tp, &whole->cfg, rf_cpu_kernels(), train ? tpc : gc, T_OK));
    float *got = calloc(whole->n_params, sizeof(float));
    for (int v = 1; v <= 2; v++) {
        for (size_t i = 0; i < whole->n_params; i += 97) whole->params[i] += 0.25f * (float)v; /* a new version */
        uint32_t crc = 0, want = rf_crc32c(whole->params, whole->n_params * sizeof(float));
        if (train) {
            CHECK_OK(rf_model_tp_set_full(tp, whole->params));
            CHECK_OK(rf_weights_rs_checksum(x, tpc, tp->m->params, T_OK, &crc));
            CHECK(crc == want);
            CHECK_OK(rf_weights_rs_send(x, tp->m->params, v, crc));
        } else if (G > 1) {
            receive_shard(x, tp, gc, whole, v, want);
        } else {
            int arrived = 0;
            int64_t ver = -1;
            double until = rf_time_now() + T_OK;
            while (!arrived && rf_time_now() < until) {
                CHECK_OK(rf_weights_rs_poll(x, got, &arrived, &ver, &crc));
                if (!arrived) rf_sleep(0.001);
            }
            CHECK(arrived && ver == v);
            CHECK(crc == want);
            CHECK(memcmp(got, whole->params, whole->n_params * sizeof(float)) == 0);
        }
    }
    /* a replicated tensor that differs on the last training rank: refused before sending */
    if (train && T > 1 && D == 1) {
        if (g_rank == T - 1) tp->m->params[tp->m->views[tp->m->n_views - 1].offset] += 1.0f; /* model.norm.weight */
        uint32_t crc = 0;
        char want[160];
        snprintf(want, sizeof want, "differ between training ranks: CRC-32C");
        CHECK_ERR(rf_weights_rs_checksum(x, tpc, tp->m->params, T_OK, &crc), RF_ERR_INTERNAL, want);
        char tail[64];
        snprintf(tail, sizeof tail, "on world rank %d", T - 1);
        CHECK(strstr(rf_error_message(), "on world rank 0,") && strstr(rf_error_message(), tail));
    }
    free(got);
    rf_model_tp_free(tp);
    rf_weights_rs_free(x);
    rf_comm_free(tpc);
    rf_comm_free(gc);
    rf_model_free(whole);
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = rf_test_mpi_world(&argc, &argv, "test_train_tp");
    if (!world) return 1;
    g_rank = rf_comm_rank(world), g_size = rf_comm_size(world);
    for (int agg = 0; agg < 4; agg++) tp_equals_one_rank(world, (rf_loss_agg)agg);
    /* 2 ranks: 1 training rank and 1 rollout worker; 4: 2 and 2 (replicated tensors from
     * either training rank), then 3 and 1 (an odd number of parts); tensor-parallel rollout
     * workers: 2 training ranks and one worker of 2 ranks, 1 and one of 3; data-parallel replicas
     * holding the same bits, the senders spread over them: 2 replicas of 1 shard to 2 rollout
     * workers, 3 replicas to 1 */
    weights_by_resharding(world, g_size / 2, 1, 1, NULL);
    if (g_size == 4) {
        weights_by_resharding(world, 3, 1, 1, NULL);
        weights_by_resharding(world, 2, 1, 2, NULL); /* one rollout worker of 2 ranks (k/v heads replicated) */
        weights_by_resharding(world, 1, 1, 3, NULL); /* of 3 ranks from a whole actor (k/v heads split) */
        weights_by_resharding(world, 1, 2, 1, NULL);
        weights_by_resharding(world, 1, 3, 1, NULL);
        /* two machines of a replica and a rollout worker each, crossed (the least-loaded choice alone
         * sends worker 0 its weights from the other machine): each worker's from its own */
        const int two_machines[4] = {1, 0, 0, 1};
        weights_by_resharding(world, 1, 2, 1, two_machines);
    }
    int rc = rf_test_mpi_finish(world, "test_train_tp");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    rf_comm *one = NULL;
    CHECK_OK(rf_comm_world(&argc, &argv, &one)); /* the single-rank communicator */
    g_rank = 0, g_size = 1;
    tp_equals_one_rank(one, RF_AGG_TOKEN_MEAN);
    rf_comm_free(one);
    const int np[] = {2, 4};
    return rf_test_mpi_part("test_train_tp", np, 2);
}
