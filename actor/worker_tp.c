/* Tensor parallelism of the training worker (placement.actor.tp = T > 1): the actor is split
 * over T ranks (model/model_tp.h, the layout rules of resharding/layout.h); the controller
 * talks to TP rank 0 only. Tensor parallelism splits the model, not the data: rank 0 hands
 * every peer the whole TrainBatch, and all of them run the same update, each on its shard
 * (rf_actor_update with uo.tp). The reference, the critic and the reward model stay whole
 * models on rank 0, as with one training worker.
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
 *   STOP        the run is over (`arg` 1: on an error, and the peers stop with one).
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

enum { TP_NOP = 1, TP_TRAIN, TP_CHECKPOINT, TP_STOP };

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

/* Scatters (to_shards) rank 0's whole actor `full` into every rank's shard, or gathers the
 * shards into it: parameters and both AdamW moments. Every TP rank calls it; full is NULL on
 * the peers. */
static rf_status move_state(rf__tworker *w, int to_shards, rf_model *full, double timeout_s) {
    rf_param_table pt = table_of(w->tp);
    int T = w->tp->tp;
    rf_layout whole = {1, 1, 0, NULL}, shards = {T, 1, 0, NULL};
    rf_reshard_plan *p = NULL;
    RF_TRY(rf_reshard_plan_make(&p, &pt, to_shards ? &whole : &shards, to_shards ? &shards : &whole, BUCKET_BYTES, T));
    rf_reshard_opts o = {.timeout_s = timeout_s};
    rf_reshard *x = NULL;
    rf_status st = rf_reshard_init(&x, p, w->tpc, &o);
    rf_model *m = w->tp->m;
    float *fb[3] = {full ? full->params : NULL, full ? full->opt_m : NULL, full ? full->opt_v : NULL};
    float *sb[3] = {m->params, m->opt_m, m->opt_v};
    for (int i = 0; st == RF_OK && i < 3; i++)
        st = to_shards ? rf_reshard_run(x, fb[i], sb[i], w->version) : rf_reshard_run(x, sb[i], fb[i], w->version);
    rf_reshard_free(x);
    rf_reshard_plan_free(p);
    return st;
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
    if (vs[2]) RF_TRY(move_state(w, 1, rank == 0 ? w->actor : NULL, r->async.startup_timeout));
    rf_model_free(w->actor); /* rank 0: the shards hold it now */
    w->actor = NULL;
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
    rf_model_tp_free(w->tp);
    w->wrs = NULL, w->tp = NULL;
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

rf_status rf__tp_checkpoint_peers(rf__tworker *w) {
    return send_cmd(w, TP_CHECKPOINT, 0, w->version, w->r->async.peer_timeout);
}

rf_status rf__tp_gather(rf__tworker *w, rf_model **out) {
    *out = NULL;
    rf_model *full = NULL;
    RF_TRY(rf_model_init(&full, &w->tp->cfg, w->k));
    size_t bytes = full->n_params * sizeof(float);
    full->opt_m = w->k->alloc(bytes), full->opt_v = w->k->alloc(bytes); /* no gradients: not trained */
    rf_status st = full->opt_m && full->opt_v ? RF_OK
                                              : rf_error(RF_ERR_NOMEM, "out of memory for the whole actor's optimizer state (%zu MB)", 2 * bytes >> 20);
    if (st == RF_OK) st = rf__tp_checkpoint_peers(w);
    if (st == RF_OK) st = move_state(w, 0, full, w->r->async.peer_timeout);
    full->opt_step = w->tp->m->opt_step;
    if (st != RF_OK) {
        rf_model_free(full);
        return st;
    }
    *out = full;
    return RF_OK;
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
 * shards gathered whole on rank 0. */
static rf_status peer_checkpoint(rf__tworker *w, int64_t version) {
    if (version != w->version)
        return rf_error(RF_ERR_FORMAT, "tensor-parallel rank 0 checkpoints version %lld, this rank is at %d",
                        (long long)version, w->version);
    rf_status st = w->dp_actor ? rf_dp_gather_optimizer(w->dp_actor) : RF_OK;
    if (st == RF_OK && w->replica == 0) st = move_state(w, 0, NULL, w->r->async.peer_timeout);
    if (w->dp_actor) rf_dp_release_optimizer(w->dp_actor);
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
