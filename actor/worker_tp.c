/* Tensor parallelism of the training worker (placement.actor.tp = T > 1): the actor is split
 * over T ranks (model/model_tp.h, the layout rules of resharding/layout.h); the controller
 * talks to TP rank 0 only. Tensor parallelism splits the model, not the data: rank 0 hands
 * every peer the whole TrainBatch, and all of them run the same update, each on its shard
 * (rf_actor_update with uo.tp). The critic and the reference are whole on rank 0 or split over
 * the first of the T ranks (roles_setup); the reward model stays whole on rank 0.
 *
 * Rank 0 drives the peers with commands, a broadcast over the TP communicator (as
 * actor/worker_dp.c does for data parallelism):
 *   NOP         a keep-alive while rank 0 is idle (peers give up on a silent rank 0);
 *   TRAIN       then the packed TrainBatch (`arg` bytes) by broadcast; every rank updates its
 *               shard (`train`: as rf__worker_peer_update's), and all of them send the new
 *               weights to the rollout workers (rf__tp_publish);
 *   CHECKPOINT  the shards (parameters, AdamW moments) are gathered whole on rank 0 (`arg`:
 *               the version, checked); with ZeRO-1 over data-parallel replicas each rank's
 *               optimizer shards are gathered over its DP group first;
 *   STOP        the run is over (`arg` 1: on an error, and the peers stop with one);
 *   SCORE       then the packed TrainBatch (`arg` bytes) by broadcast; every rank runs the
 *               passes of the split critic or reference (`train`: the RF_SCORE_* flags) with
 *               rank 0, which keeps the results.
 *
 * Moving whole models in and out of shards uses the resharding planner and executor over the
 * TP communicator (layout tp 1 on rank 0 <-> tp T on ranks 0 .. T-1): at the start rank 0's
 * loaded (or resumed) actor is scattered, and rank 0 frees it; a checkpoint gathers it again
 * for as long as the files take to write. Weights go to the rollout workers the same way,
 * from the T shards to each whole copy (resharding/weights_reshard.h).
 *
 * With data parallelism too (worker_internal.h) each replica is such a group, led by its TP
 * rank 0; every replica sends weights (the planner spreads the blocks over the replicas that
 * hold them), replica 0 alone gathers checkpoints; the others start from replica 0's shards
 * (rf__dp_setup) and train on their shares. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/worker.h"
#include "actor/worker_internal.h"
#include "common/log.h"
#include "common/util.h"
#include "controller/advantages.h"
#include "controller/run_internal.h"
#include "resharding/plan.h"
#include "resharding/reshard.h"

enum { TP_NOP = 1, TP_TRAIN, TP_CHECKPOINT, TP_STOP, TP_SCORE };

typedef struct tp_cmd {
    int32_t cmd;
    int32_t train; /* TRAIN: rf__worker_peer_update's `train` */
    int64_t arg;
} tp_cmd;

#define BUCKET_BYTES ((size_t)16 << 20)

static rf_param_table table_of(const rf_model_tp *tp) {
    rf_param_table pt = {&tp->cfg, tp->full_views, tp->n_full_views};
    return pt;
}

/* Scatters (to_shards) rank 0's whole model `full` into every rank's shard of tp (the actor,
 * the critic or the reference), or gathers the shards into it: parameters, and both AdamW
 * moments when the shards have them. Every TP rank calls it; full is NULL on the peers. */
static rf_status move_state(rf__tworker *w, rf_model_tp *tp, int to_shards, rf_model *full, double timeout_s) {
    rf_param_table pt = table_of(tp);
    int T = tp->tp;
    rf_layout whole = {1, 1, 0, NULL}, shards = {T, 1, 0, NULL};
    rf_reshard_plan *p = NULL;
    RF_TRY(rf_reshard_plan_make(&p, &pt, to_shards ? &whole : &shards, to_shards ? &shards : &whole, BUCKET_BYTES, T));
    rf_reshard_opts o = {.timeout_s = timeout_s};
    rf_reshard *x = NULL;
    rf_status st = rf_reshard_init(&x, p, tp->comm, &o); /* the model's group: the replica's, or its first ranks */
    rf_model *m = tp->m;
    float *fb[3] = {full ? full->params : NULL, full ? full->opt_m : NULL, full ? full->opt_v : NULL};
    float *sb[3] = {m->params, m->opt_m, m->opt_v};
    for (int i = 0; st == RF_OK && i < (m->opt_m ? 3 : 1); i++)
        st = to_shards ? rf_reshard_run(x, fb[i], sb[i], w->version) : rf_reshard_run(x, sb[i], fb[i], w->version);
    rf_reshard_free(x);
    rf_reshard_plan_free(p);
    return st;
}

/* Splits the critic or the reference (`whole`: the leader's loaded model, NULL on the peers)
 * over group g (the replica's TP group or its first ranks) into *out: the shape and optimizer
 * step from the leader, the shards cut by move_state; the leader frees its whole model. */
static rf_status role_setup(rf__tworker *w, rf_comm *g, rf_model **whole, rf_model_tp **out, int train,
                            const char *name) {
    const rf_recipe *r = w->r;
    struct {
        rf_model_config cfg;
        int64_t step;
    } hdr;
    memset(&hdr, 0, sizeof hdr);
    if (*whole) hdr.cfg = (*whole)->cfg, hdr.step = (*whole)->opt_step;
    char what[96];
    snprintf(what, sizeof what, "tensor-parallel training ranks receiving the %s's shape", name);
    RF_TRY(rf_comm_bcast(g, &hdr, sizeof hdr, 0, r->async.startup_timeout, what));
    rf_status st = rf_model_tp_init(out, &hdr.cfg, w->k, g, r->async.peer_timeout);
    if (st == RF_OK && train) st = rf_model_tp_enable_training(*out);
    if (st != RF_OK) st = rf_error_wrap(st, "the %s's shard", name);
    snprintf(what, sizeof what, "tensor-parallel (%s)", name);
    RF_TRY(rf__worker_agree_to_start(w, g, st, what));
    (*out)->m->opt_step = (int)hdr.step;
    RF_TRY(move_state(w, *out, 1, *whole, r->async.startup_timeout));
    rf_model_free(*whole);
    *whole = NULL;
    return RF_OK;
}

/* One role split over the first tp of the replica's T ranks: the group (the replica's own when
 * tp = T; a split of it, kept in *keep, when smaller: collective over tpc, NULL on the ranks
 * past tp, which then hold nothing of the role), then the shards. */
static rf_status role_split(rf__tworker *w, int tp, rf_comm **keep, rf_model **whole, rf_model_tp **out, int train,
                            const char *name) {
    int t = rf_comm_rank(w->tpc);
    rf_comm *g = w->tpc;
    if (tp < rf_comm_size(w->tpc)) {
        RF_TRY(rf_comm_split(w->tpc, t < tp ? 0 : -1, t, keep));
        g = *keep;
    }
    return g ? role_setup(w, g, whole, out, train, name) : RF_OK;
}

/* The critic and the reference of this replica, split when the recipe splits them. */
static rf_status roles_setup(rf__tworker *w) {
    int dp, ctp, rtp, leader = rf_comm_rank(w->tpc) == 0;
    rf_recipe_role_layout(w->r, 1, &dp, &ctp);
    rf_recipe_role_layout(w->r, 0, &dp, &rtp);
    int critic = rf__worker_has_critic(w), ref = rf__worker_has_ref(w);
    /* the leader holds both whole (loaded like the actor); a missing one fails every rank in
     * role_setup (a zero shape) */
    if (critic && ctp > 1) RF_TRY(role_split(w, ctp, &w->critic_comm, &w->critic, &w->critic_tp, 1, "critic"));
    if (ref && rtp > 1) RF_TRY(role_split(w, rtp, &w->ref_comm, &w->ref, &w->ref_tp, 0, "reference"));
    if (!leader || w->replica != 0) return RF_OK;
    for (int c = 1; c >= 0; c--) {
        const rf_model_tp *m = c ? w->critic_tp : w->ref_tp;
        if (m)
            rf_log_info("training worker: %s split over %s%d tensor-parallel ranks of %s (a shard of %zu parameters "
                        "here)", c ? "critic" : "reference", m->tp < w->tp->tp ? "the first " : "the ", m->tp,
                        w->dpc ? "each replica holding it" : "the training worker", m->m->n_params);
    }
    return RF_OK;
}

rf_status rf__tp_setup(rf__tworker *w, rf_status loaded) {
    const rf_recipe *r = w->r;
    int T = rf_comm_size(w->tpc), rank = rf_comm_rank(w->tpc);
    rf_model_config cfg;
    rf_status st = loaded;
    if (st == RF_OK && w->actor) {
        cfg = w->actor->cfg;
    } else if (st == RF_OK) { /* the peers read only the model's shape */
        char p[4096];
        rf_path_join(p, sizeof p, r->model.path, "config.json");
        st = rf_config_load(&cfg, p);
    }
    if (st == RF_OK) st = rf_model_tp_init(&w->tp, &cfg, w->k, w->tpc, r->async.peer_timeout);
    if (st == RF_OK) st = rf_model_tp_enable_training(w->tp);
    /* rollout workers on this host read the shards in place (resharding/reshard.h) */
    if (st == RF_OK) st = rf_model_share_params(w->tp->m);
    RF_TRY(rf__worker_agree_to_start(w, w->tpc, st, "tensor-parallel"));
    /* rank 0's version and optimizer step (a resumed run's), and whether it holds a whole actor
     * (replicas other than 0 take replica 0's shards later: rf__dp_setup) */
    int64_t vs[3] = {w->version, w->actor ? w->actor->opt_step : 0, w->actor != NULL};
    RF_TRY(rf_comm_bcast(w->tpc, vs, sizeof vs, 0, r->async.startup_timeout,
                         "tensor-parallel training ranks receiving the version"));
    w->version = (int)vs[0], w->tp->m->opt_step = (int)vs[1];
    if (vs[2]) RF_TRY(move_state(w, w->tp, 1, rank == 0 ? w->actor : NULL, r->async.startup_timeout));
    rf_model_free(w->actor); /* rank 0: the shards hold it now */
    w->actor = NULL;
    RF_TRY(roles_setup(w));
    rf_param_table pt = table_of(w->tp);
    int D = w->dpc ? rf_comm_size(w->dpc) : 1; /* every replica sends (the planner spreads the senders) */
    RF_TRY(rf_weights_rs_init(&w->wrs, &pt, T, D, r->placement.rollout.tp, w->wcomm, RF_WEIGHTS_RS_BUCKET,
                              r->async.startup_timeout));
    if (rank == 0 && w->replica == 0)
        rf_log_info("training worker: tensor parallel over %d ranks (actor shards: %zu of %zu parameters here), "
                    "weights to %d rollout workers by resharding", T, w->tp->m->n_params, w->tp->full_params,
                    (rf_comm_size(w->wcomm) - T * D) / r->placement.rollout.tp);
    w->last_cmd = rf_time_now();
    return RF_OK;
}

void rf__tp_free(rf__tworker *w) {
    rf_weights_rs_free(w->wrs);
    rf_model_tp_free(w->tp), rf_model_tp_free(w->critic_tp), rf_model_tp_free(w->ref_tp);
    rf_comm_free(w->critic_comm), rf_comm_free(w->ref_comm);
    w->wrs = NULL, w->tp = w->critic_tp = w->ref_tp = NULL;
    w->critic_comm = w->ref_comm = NULL;
}

rf_status rf__rs_whole_setup(rf__tworker *w) {
    rf_param_table pt = rf_param_table_of(w->actor);
    if (strcmp(w->k->name, "cpu") != 0)
        return rf_error(RF_ERR_UNSUPPORTED, "weights by resharding need the actor in host memory (model.device = \"cpu\")");
    RF_TRY(rf_model_share_params(w->actor)); /* rollout ranks on this host read it in place */
    return rf_weights_rs_init(&w->wrs, &pt, 1, 1, w->r->placement.rollout.tp, w->wcomm, RF_WEIGHTS_RS_BUCKET,
                              w->r->async.startup_timeout);
}

rf_status rf__tp_publish(rf__tworker *w, double timeout_s, rf_status (*announce)(rf__tworker *w)) {
    /* without tensor parallelism of the actor: the whole actor is the one shard */
    rf_comm *tpc = w->tp ? w->tpc : rf_comm_single();
    float *local = w->tp ? w->tp->m->params : w->actor->params;
    RF_TRY(rf_weights_rs_checksum(w->wrs, tpc, local, timeout_s, &w->crc));
    if (announce) RF_TRY(announce(w));
    rf_weights_rs_set_timeout(w->wrs, timeout_s);
    return rf_weights_rs_send(w->wrs, local, w->version, w->crc);
}

/* ---- TP rank 0 ---- */

static rf_status send_cmd(rf__tworker *w, int cmd, int train, int64_t arg, double timeout_s) {
    tp_cmd c = {cmd, train, arg};
    w->last_cmd = rf_time_now();
    return rf_comm_bcast(w->tpc, &c, sizeof c, 0, timeout_s, "sending a command to the tensor-parallel training ranks");
}

rf_status rf__tp_keepalive(rf__tworker *w) {
    if (!w->tp || !w->tp_serving || rf_time_now() - w->last_cmd < w->r->async.peer_timeout / 4) return RF_OK;
    return send_cmd(w, TP_NOP, 0, 0, w->r->async.peer_timeout);
}

void rf__tp_stop(rf__tworker *w, int failed) {
    if (!w->tp || !w->tp_serving) return; /* before the first weights the peers wait elsewhere */
    char keep[1024];
    snprintf(keep, sizeof keep, "%s", rf_error_message());
    /* best effort: when it fails a peer is gone or the communicator failed already, and the
     * run's own error (kept) says why; the peers that are left give up on their own */
    send_cmd(w, TP_STOP, 0, failed, 5.0);
    if (keep[0]) rf_error(RF_ERR_IO, "%s", keep);
    else rf_error_clear();
}

rf_status rf__tp_share(rf__tworker *w, const uint8_t *buf, uint64_t bytes, int train) {
    double t = w->r->async.peer_timeout;
    RF_TRY(send_cmd(w, TP_TRAIN, train, (int64_t)bytes, t));
    return rf_comm_bcast(w->tpc, (void *)buf, bytes, 0, t, "sending the tensor-parallel ranks the batch");
}

int rf__tp_split_flags(const rf__tworker *w, int flags) {
    return (w->ref_tp ? flags & RF_SCORE_REF : 0) | (w->critic_tp ? flags & RF_SCORE_VALUES : 0);
}

rf_status rf__tp_score_share(rf__tworker *w, const uint8_t *buf, uint64_t bytes, int flags) {
    int split = rf__tp_split_flags(w, flags);
    if (!split) return RF_OK;
    double t = w->r->async.peer_timeout;
    RF_TRY(send_cmd(w, TP_SCORE, split, (int64_t)bytes, t));
    return rf_comm_bcast(w->tpc, (void *)buf, bytes, 0, t, "sending the tensor-parallel ranks the samples to score");
}

rf_status rf__tp_checkpoint_peers(rf__tworker *w) {
    return send_cmd(w, TP_CHECKPOINT, 0, w->version, w->r->async.peer_timeout);
}

/* A whole model of tp's shape with AdamW moments (no gradients: not trained), for gathering. */
static rf_status whole_of(rf__tworker *w, const rf_model_tp *tp, rf_model **out, const char *name) {
    *out = NULL;
    rf_model *full = NULL;
    RF_TRY(rf_model_init(&full, &tp->cfg, w->k));
    size_t bytes = full->n_params * sizeof(float);
    full->opt_m = w->k->alloc(bytes), full->opt_v = w->k->alloc(bytes);
    if (!full->opt_m || !full->opt_v) {
        rf_model_free(full);
        return rf_error(RF_ERR_NOMEM, "out of memory for the whole %s's optimizer state (%zu MB)", name, 2 * bytes >> 20);
    }
    full->opt_step = tp->m->opt_step;
    *out = full;
    return RF_OK;
}

rf_status rf__tp_gather(rf__tworker *w, rf_model **out, rf_model **critic) {
    *out = *critic = NULL;
    /* both allocated before the peers are told: a failure here leaves them waiting for the
     * next command */
    rf_status st = whole_of(w, w->tp, out, "actor");
    if (st == RF_OK && w->critic_tp) st = whole_of(w, w->critic_tp, critic, "critic");
    if (st == RF_OK) st = rf__tp_checkpoint_peers(w);
    if (st == RF_OK) st = move_state(w, w->tp, 0, *out, w->r->async.peer_timeout);
    if (st == RF_OK && w->critic_tp) st = move_state(w, w->critic_tp, 0, *critic, w->r->async.peer_timeout);
    if (st != RF_OK) {
        rf_model_free(*out), rf_model_free(*critic);
        *out = *critic = NULL;
    }
    return st;
}

/* ---- the peers ---- */

/* Receives the whole batch (with data parallelism: the replica's share) and trains this rank's
 * shard on it with the others, then sends the new weights with them (and the other replicas). */
static rf_status peer_train(rf__tworker *w, int64_t bytes, int train) {
    double t = w->r->async.peer_timeout;
    uint8_t *buf = malloc(bytes ? (size_t)bytes : 1);
    if (!buf) return rf_error(RF_ERR_NOMEM, "out of memory for a batch of %lld bytes", (long long)bytes);
    rf_status st = rf_comm_bcast(w->tpc, buf, (size_t)bytes, 0, t, "receiving the batch from the training worker (tensor-parallel rank 0)");
    if (st == RF_OK) st = rf__worker_peer_update(w, buf, (size_t)bytes, "the batch from tensor-parallel rank 0", train);
    free(buf);
    return st == RF_OK ? rf__tp_publish(w, t, NULL) : st;
}

/* A checkpoint: ZeRO-1's optimizer shards gathered over the DP group, then (replica 0) the
 * shards of the actor (and of a split critic) gathered whole on rank 0. */
static rf_status peer_checkpoint(rf__tworker *w, int64_t version) {
    if (version != w->version)
        return rf_error(RF_ERR_FORMAT, "tensor-parallel rank 0 checkpoints version %lld, this rank is at %d",
                        (long long)version, w->version);
    rf_status st = w->dp_actor ? rf_dp_gather_optimizer(w->dp_actor) : RF_OK;
    if (st == RF_OK && w->dp_critic) st = rf_dp_gather_optimizer(w->dp_critic);
    if (st == RF_OK && w->replica == 0) st = move_state(w, w->tp, 0, NULL, w->r->async.peer_timeout);
    if (st == RF_OK && w->replica == 0 && w->critic_tp) st = move_state(w, w->critic_tp, 0, NULL, w->r->async.peer_timeout);
    if (w->dp_actor) rf_dp_release_optimizer(w->dp_actor);
    if (w->dp_critic) rf_dp_release_optimizer(w->dp_critic);
    return st;
}

/* Scores the batch with rank 0: the passes of the split models in `flags`. */
static rf_status peer_score(rf__tworker *w, int64_t bytes, int flags) {
    uint8_t *buf = malloc(bytes ? (size_t)bytes : 1);
    if (!buf) return rf_error(RF_ERR_NOMEM, "out of memory for %lld bytes of samples", (long long)bytes);
    rf_status st = rf_comm_bcast(w->tpc, buf, (size_t)bytes, 0, w->r->async.peer_timeout,
                                 "receiving the samples to score from the training worker (tensor-parallel rank 0)");
    Rlflow__TrainBatch *b = NULL;
    rf_train_sample *s = NULL;
    if (st == RF_OK) st = rf__worker_unpack_packed(buf, (size_t)bytes, "the samples to score from tensor-parallel rank 0", &b, &s);
    /* the passes of the models this rank holds a shard of (a role on fewer ranks skips these) */
    flags = rf__tp_split_flags(w, flags);
    if (st == RF_OK && flags) st = rf__worker_score(w, s, (int)b->n_samples, flags);
    rf__worker_packed_free(b, s);
    free(buf);
    return st;
}

static rf_status peer_serve(rf__tworker *w) {
    const rf_recipe *r = w->r;
    for (;;) {
        tp_cmd c = {0};
        /* rank 0 sends a keep-alive every peer_timeout / 4 when idle */
        RF_TRY(rf_comm_bcast(w->tpc, &c, sizeof c, 0, 2 * r->async.peer_timeout,
                             "waiting for a command from the training worker (tensor-parallel rank 0)"));
        switch (c.cmd) {
        case TP_NOP: break;
        case TP_TRAIN: RF_TRY(peer_train(w, c.arg, c.train)); break;
        case TP_CHECKPOINT: RF_TRY(peer_checkpoint(w, c.arg)); break;
        case TP_SCORE: RF_TRY(peer_score(w, c.arg, c.train)); break;
        case TP_STOP:
            return c.arg ? rf_error(RF_ERR_IO, "the training worker (tensor-parallel rank 0) stopped the run on an error")
                         : RF_OK;
        default: return rf_error(RF_ERR_FORMAT, "tensor-parallel rank 0 sent an unknown command %d", (int)c.cmd);
        }
    }
}

rf_status rf_train_tp_peer_main(const rf_recipe *r, rf_comm *tpc, rf_comm *wcomm, rf_comm *dpc) {
    rf__tworker w = {.r = r, .tpc = tpc, .wcomm = wcomm, .dpc = dpc, .k = rf_cpu_kernels(),
                     .replica = dpc ? rf_comm_rank(dpc) : 0};
    rf_status st = rf_loss_agg_parse(r->algorithm.loss_agg, &w.agg);
    if (st == RF_OK) st = rf_kl_est_parse(r->algorithm.kl_estimator, &w.kl_est);
    st = rf__tp_setup(&w, st);
    if (dpc) st = rf__dp_setup(&w, st);
    if (st == RF_OK && dpc)
        rf_log_info("training worker: tensor-parallel rank %d of %d of data-parallel replica %d of %d ready (world rank %d, pid %d)",
                    rf_comm_rank(tpc), rf_comm_size(tpc), w.replica, rf_comm_size(dpc),
                    rf_comm_world_rank(tpc, rf_comm_rank(tpc)), (int)getpid());
    else if (st == RF_OK)
        rf_log_info("training worker: tensor-parallel rank %d of %d ready (world rank %d, pid %d)", rf_comm_rank(tpc),
                    rf_comm_size(tpc), rf_comm_world_rank(tpc, rf_comm_rank(tpc)), (int)getpid());
    /* the first weights, with rank 0 once it has connected to the controller */
    if (st == RF_OK) st = rf__tp_publish(&w, r->async.startup_timeout, NULL);
    if (st == RF_OK) st = peer_serve(&w);
    rf__dp_free(&w);
    rf__tp_free(&w);
    return st;
}
