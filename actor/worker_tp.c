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
 *   CHECKPOINT  rank 0 writes the checkpoint's files tensor by tensor, asking the peers for
 *               each (a broadcast naming the model, part and tensor) and gathering its blocks
 *               (`arg`: the version, checked); with ZeRO-1 over data-parallel replicas each
 *               rank gathers its block of a moment from its DP group as it is asked for it
 *               (rf__dp_moments), so no rank holds whole moments;
 *   STOP        the run is over (`arg` 1: on an error, and the peers stop with one);
 *   SCORE       then the packed TrainBatch (`arg` bytes) by broadcast; every rank runs the
 *               passes of the split critic or reference (`train`: the RF_SCORE_* flags) with
 *               rank 0, which keeps the results.
 *
 * No rank holds a split model whole: at the start every rank reads its own shards from the
 * files (rf_model_tp_load: the model directory, or the checkpoint resumed from), and a
 * checkpoint is written by rank 0 one tensor at a time, each gathered from the shards as the
 * writer reaches it (rank 0 holds one tensor more than its shards). Weights go to the rollout
 * workers by the resharding planner and executor, from the T shards to each whole copy
 * (resharding/weights_reshard.h).
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
#include "common/shm.h"
#include "common/util.h"
#include "controller/advantages.h"
#include "controller/run_internal.h"
#include "trainer/checkpoint.h"

enum { TP_NOP = 1, TP_TRAIN, TP_CHECKPOINT, TP_STOP, TP_SCORE };

typedef struct tp_cmd {
    int32_t cmd;
    int32_t train; /* TRAIN: rf__worker_peer_update's `train` */
    int64_t arg;
    rf__share sh;  /* TRAIN: the actor's and the critic's samples in the batch */
} tp_cmd;

/* The tensors tp trains, checkpoints and sends to the rollout workers (the whole model's table)
 * and the block of each held here: under LoRA the adapters (their floats from p0 = n_frozen on
 * in the parameters, from 0 in the moments; the base is frozen and read from model.path), else
 * every parameter. */
typedef struct tp_table {
    rf_param_table pt;
    const rf_shard *shards; /* (pt.n_views) */
    size_t p0;
} tp_table;

static tp_table table_of(const rf_model_tp *tp) {
    if (tp->lora_views)
        return (tp_table){{&tp->cfg, tp->lora_views, tp->n_lora_views}, tp->lora_shards, tp->m->n_frozen};
    return (tp_table){{&tp->cfg, tp->full_views, tp->n_full_views}, tp->shards, 0};
}

/* LoRA, resuming: the adapters' blocks of part `part` (0 the parameters, 1 and 2 the AdamW
 * moments) from the checkpoint's files in dir into dst (the shard's adapter floats). */
static rf_status load_adapters(rf_model_tp *tp, const char *dir, const char *suffix, float *dst) {
    tp_table tb = table_of(tp);
    size_t n = tp->m->n_params - tp->m->n_frozen;
    rf_safetensors *st = NULL;
    RF_TRY(rf_st_open_dir(&st, dir));
    float *host = tp->m->k == rf_cpu_kernels() ? dst : malloc(sizeof(float) * (n ? n : 1));
    rf_status s = host ? rf_model_read_range(tb.pt.views, tb.pt.n_views, tb.shards, st, suffix, 0, n, host)
                       : rf_error(RF_ERR_NOMEM, "out of memory for %zu floats", n);
    if (s == RF_OK && host != dst) tp->m->k->to_device(dst, host, sizeof(float) * n);
    if (s == RF_OK) tp->m->k->weights_updated(); /* parameters or moments written (kernels.h) */
    if (host != dst) free(host);
    rf_st_close(st);
    return s;
}

/* This rank's shards of tp read from files (model/model_tp_io.c): from the model directory
 * `dir`, or (ckpt) parameters and AdamW moments of role `role` of the checkpoint in `dir`
 * (the moments left to ZeRO-1 when it reads them, rf__dp_zero_reads: `model` 0 the actor, 1
 * the critic). */
static rf_status load_shards(const rf__tworker *w, rf_model_tp *tp, const char *dir, int ckpt, int model) {
    int lora = tp->lora_views != NULL; /* the checkpoint holds the adapters; the base is model.path's */
    if (!ckpt || lora) RF_TRY(rf_model_tp_load(tp, ckpt ? w->r->model.path : dir, NULL, NULL));
    if (!ckpt) return RF_OK;
    const char *role = model ? "critic" : "actor";
    float *dst[3] = {lora ? tp->m->params + tp->m->n_frozen : NULL, tp->m->opt_m, tp->m->opt_v};
    for (int part = 0; part < (rf__dp_zero_reads(w, model) ? 1 : 3); part++) {
        char p[4300];
        const char *suffix = rf_checkpoint_part(dir, role, part, p, sizeof p);
        rf_status st = lora ? load_adapters(tp, p, suffix, dst[part]) : rf_model_tp_load(tp, p, dst[part], suffix);
        if (st != RF_OK) return rf_error_wrap(st, "resuming from %s", dir);
    }
    return RF_OK;
}

/* Where group g's shards of a role come from, as its leader (rank 0 of g) says: the whole
 * model's shape, the optimizer step, and the directory. */
typedef struct shard_src {
    rf_model_config cfg;
    int64_t step;
    int32_t ckpt;      /* 1: dir is a checkpoint (parameters and moments); 0: a model directory */
    char dir[4200];
} shard_src;

/* The leader's shard_src for the critic or the reference: its model directory (config.json
 * read here, with a value head for the critic), or the checkpoint the run resumes from. */
static rf_status role_src(const rf__tworker *w, int critic, shard_src *src) {
    const rf_recipe *r = w->r;
    const char *path = critic ? r->critic.path : r->reference.path;
    if (!path[0]) path = r->model.path;
    char p[4096];
    rf_path_join(p, sizeof p, path, "config.json");
    RF_TRY(rf_config_load(&src->cfg, p));
    if (critic) src->cfg.value_head = 1;
    src->ckpt = critic && w->ckpt_dir[0] && w->replica == 0; /* other replicas take replica 0's */
    snprintf(src->dir, sizeof src->dir, "%s", src->ckpt ? w->ckpt_dir : path);
    src->step = src->ckpt ? w->critic_steps : 0;
    return RF_OK;
}

/* LoRA with no reference.path: the reference is the actor's frozen base (recipe.c makes it
 * split as the actor is). */
static int ref_is_base(const rf__tworker *w, int critic) {
    return !critic && w->tp && w->tp->lora_views && !w->r->reference.path[0];
}

/* The reference as the actor's frozen base: a second shard model over the base floats of the
 * actor's own shard (the first n_frozen of its parameters), over the actor's group: no second
 * copy of the weights is read or held. */
static rf_status base_reference(rf__tworker *w, rf_comm *g, rf_comm *dev, rf_model_tp **out) {
    rf_status st = rf_model_tp_init_borrowed(out, &w->tp->cfg, w->k, dev, w->r->async.peer_timeout, w->tp->m->params);
    if (st == RF_OK && (*out)->m->n_params != w->tp->m->n_frozen)
        st = rf_error(RF_ERR_INTERNAL, "the reference over the actor's base: %zu floats, the base has %zu",
                      (*out)->m->n_params, w->tp->m->n_frozen);
    if (st != RF_OK) st = rf_error_wrap(st, "the reference's shard");
    return rf__worker_agree_to_start(w, g, st, "tensor-parallel (reference)");
}

/* Splits the critic or the reference over group g (the replica's TP group or its first
 * ranks) into *out: the leader says where from (role_src), every rank reads its own shards;
 * under LoRA the reference is the actor's base (base_reference). */
static rf_status role_setup(rf__tworker *w, rf_comm *g, rf_comm *dev, rf_model_tp **out, int critic) {
    const rf_recipe *r = w->r;
    if (ref_is_base(w, critic)) return base_reference(w, g, dev, out);
    const char *name = critic ? "critic" : "reference";
    shard_src src;
    memset(&src, 0, sizeof src);
    char what[96];
    snprintf(what, sizeof what, "tensor-parallel (%s's config)", name);
    RF_TRY(rf__worker_agree_to_start(w, g, rf_comm_rank(g) == 0 ? role_src(w, critic, &src) : RF_OK, what));
    snprintf(what, sizeof what, "tensor-parallel training ranks receiving where the %s is", name);
    RF_TRY(rf_comm_bcast(g, &src, sizeof src, 0, r->async.startup_timeout, what));
    rf_status st = rf_model_tp_init(out, &src.cfg, w->k, dev, r->async.peer_timeout);
    if (st == RF_OK && critic) st = rf_model_tp_enable_training(*out);
    if (st == RF_OK) st = load_shards(w, *out, src.dir, src.ckpt, critic);
    if (st != RF_OK) st = rf_error_wrap(st, "the %s's shard", name);
    snprintf(what, sizeof what, "tensor-parallel (%s)", name);
    RF_TRY(rf__worker_agree_to_start(w, g, st, what));
    (*out)->m->opt_step = (int)src.step;
    return RF_OK;
}

/* The group a role split over the first tp of the replica's T ranks computes in: *g the
 * replica's own when tp = T, else a split of it (kept in *keep; collective over tpc; NULL on the
 * ranks past tp, which then hold nothing of the role); *dev the communicator its shards'
 * collectives use (on CUDA tp_dev, or a NCCL one of the smaller group, kept in *keep_dev). */
static rf_status first_ranks(rf__tworker *w, int tp, rf_comm **keep, rf_comm **keep_dev, rf_comm **g, rf_comm **dev) {
    int t = rf_comm_rank(w->tpc);
    *g = w->tpc, *dev = w->tp_dev ? w->tp_dev : w->tpc;
    if (tp == rf_comm_size(w->tpc)) return RF_OK;
    RF_TRY(rf_comm_split(w->tpc, t < tp ? 0 : -1, t, keep));
    *g = *keep;
    return *g ? rf_comm_for(*g, w->k, "tensor parallelism", w->r->async.startup_timeout, keep_dev, dev) : RF_OK;
}

/* The critic or the reference split over the first tp ranks of the replica: the group, then
 * the shards. */
static rf_status role_split(rf__tworker *w, int tp, rf_comm **keep, rf_comm **keep_dev, rf_model_tp **out,
                            int critic) {
    rf_comm *g, *dev;
    RF_TRY(first_ranks(w, tp, keep, keep_dev, &g, &dev));
    return g ? role_setup(w, g, dev, out, critic) : RF_OK;
}

/* The reward model split over the first placement.reward.tp ranks of a replica holding it
 * (placement.reward.dp): each of them reads its shard of reward.model's files. */
static rf_status rm_split(rf__tworker *w) {
    int tp = rf__worker_split_tp(w, RF_ROLE_REWARD);
    if (!tp || !rf__worker_has_rm(w)) return RF_OK;
    rf_comm *g, *dev;
    RF_TRY(first_ranks(w, tp, &w->rm_comm, &w->rm_tp_dev, &g, &dev));
    if (!g) return RF_OK;
    rf_status st = rf_reward_model_open_tp(&w->rm, w->r->reward.model, w->k, dev, w->r->async.peer_timeout);
    if (st != RF_OK) st = rf_error_wrap(st, "the reward model's shard");
    return rf__worker_agree_to_start(w, g, st, "tensor-parallel (reward model)");
}

/* The critic, the reference and the reward model of this replica, split when the recipe splits
 * them. */
static rf_status roles_setup(rf__tworker *w) {
    int leader = rf_comm_rank(w->tpc) == 0;
    for (int c = 1; c >= 0; c--) {
        int tp = rf__worker_split_tp(w, c), has = c ? rf__worker_has_critic(w) : rf__worker_has_ref(w);
        if (has && tp)
            RF_TRY(role_split(w, tp, c ? &w->critic_comm : &w->ref_comm, c ? &w->critic_tp_dev : &w->ref_tp_dev,
                              c ? &w->critic_tp : &w->ref_tp, c));
    }
    RF_TRY(rm_split(w));
    if (!leader || w->replica != 0) return RF_OK;
    if (rf_reward_model_split(w->rm))
        rf_log_info("training worker: reward model split over %s%d tensor-parallel ranks of %s (read from the files)",
                    rf_reward_model_split(w->rm) < w->tp->tp ? "the first " : "the ", rf_reward_model_split(w->rm),
                    w->dpc ? "each replica holding it" : "the training worker");
    for (int c = 1; c >= 0; c--) {
        const rf_model_tp *m = c ? w->critic_tp : w->ref_tp;
        if (m && ref_is_base(w, c))
            rf_log_info("training worker: reference split over the %d tensor-parallel ranks of %s: the actor's frozen "
                        "base shards themselves (LoRA; no second copy: %.2f MB per rank not allocated)", m->tp,
                        w->dpc ? "each replica holding it" : "the training worker", (double)m->m->n_params * 4e-6);
        else if (m)
            rf_log_info("training worker: %s split over %s%d tensor-parallel ranks of %s (a shard of %zu parameters "
                        "here, read from the files)", c ? "critic" : "reference", m->tp < w->tp->tp ? "the first " : "the ",
                        m->tp, w->dpc ? "each replica holding it" : "the training worker", m->m->n_params);
    }
    return RF_OK;
}

/* TP rank 0's shard_src for the actor: the model directory, or the checkpoint resumed from
 * (cfg unused: every rank reads config.json itself). */
static shard_src actor_src(const rf__tworker *w) {
    shard_src src;
    memset(&src, 0, sizeof src);
    src.ckpt = w->ckpt_dir[0] != 0;
    snprintf(src.dir, sizeof src.dir, "%s", src.ckpt ? w->ckpt_dir : w->r->model.path);
    src.step = src.ckpt ? w->actor_steps : 0;
    return src;
}

/* Where the rollout workers read m's parameters from: the buffer itself (host memory, moved
 * into shared memory), or on CUDA a host copy in shared memory (w->wstage, refreshed before
 * each transfer: weights_of, which the checksum reads too). */
static rf_status share_weights(rf__tworker *w, rf_model *m) {
    if (m->k == rf_cpu_kernels()) return rf_model_share_params(m);
    return rf_shm_alloc((void **)&w->wstage, sizeof(float) * (m->n_params ? m->n_params : 1), "the staged weights");
}

/* The parameters to send (host memory): m's own, or their host copy made now. */
static float *weights_of(rf__tworker *w, rf_model *m) {
    if (!w->wstage) return m->params;
    m->k->to_host(w->wstage, m->params, sizeof(float) * m->n_params);
    return w->wstage;
}

/* LoRA: the frozen base's CRC-32C (the whole model's, from the shards over the TP group; each
 * replica's ranks together, replica 0's being the one sent), which every announcement carries
 * for the rollout workers to check against their own base. Nothing without adapters. */
static rf_status set_base_crc(rf__tworker *w) {
    rf_model *m = w->tp ? w->tp->m : w->actor;
    if (!m->n_frozen) return RF_OK;
    rf_param_table pt = w->tp ? (rf_param_table){&w->tp->cfg, w->tp->full_views, w->tp->n_full_views}
                              : rf_param_table_of(m);
    uint32_t crc = 0;
    RF_TRY(rf_weights_rs_base_checksum(w->tp ? w->tpc : rf_comm_single(), &pt, w->k, m->params,
                                       w->r->async.startup_timeout, &crc));
    rf_weights_rs_set_base(w->wrs, crc);
    return RF_OK;
}

/* w->wrs for the actor (pt; the training layout dp x tp): to the rollout workers after the
 * training ranks in w->wcomm (split runs), or colocated to the rollout rank in each training
 * rank's process (w->wcomm: the training ranks alone). */
static rf_status weights_out_init(rf__tworker *w, const rf_param_table *pt, int tp, int dp) {
    const rf_recipe *r = w->r;
    if (w->ho)
        return rf_weights_rs_init_colocated(&w->wrs, pt, tp, dp, r->placement.rollout.tp, w->wcomm, RF_WEIGHTS_RS_BUCKET,
                                            r->async.startup_timeout);
    RF_TRY(rf_weights_rs_init(&w->wrs, pt, tp, dp, r->placement.rollout.tp, w->wcomm, RF_WEIGHTS_RS_BUCKET,
                              r->async.startup_timeout));
    return set_base_crc(w);
}

rf_status rf__tp_setup(rf__tworker *w, rf_status loaded) {
    const rf_recipe *r = w->r;
    int T = rf_comm_size(w->tpc), rank = rf_comm_rank(w->tpc);
    rf_model_config cfg;
    rf_status st = loaded;
    char p[4096];
    rf_path_join(p, sizeof p, r->model.path, "config.json");
    if (st == RF_OK) st = rf_config_load(&cfg, p); /* every rank reads the shape */
    rf_comm *g = w->tpc; /* the shards' collectives: over NCCL on CUDA */
    if (w->k != rf_cpu_kernels()) {
        RF_TRY(rf__worker_agree_to_start(w, w->tpc, st, "tensor-parallel"));
        RF_TRY(rf_comm_for(w->tpc, w->k, "tensor parallelism", w->r->async.startup_timeout, &w->tp_dev, &g));
    }
    if (st == RF_OK) st = rf_model_tp_init(&w->tp, &cfg, w->k, g, r->async.peer_timeout);
    rf_lora_opts lo;
    if (st == RF_OK && r->lora.enabled) st = rf__lora_opts(r, &lo); /* the adapters, split like their base */
    if (st == RF_OK && r->lora.enabled) st = rf_model_tp_lora_attach(w->tp, &lo);
    if (st == RF_OK) st = rf_model_tp_enable_training(w->tp);
    /* rollout workers on this host read the shards in place (resharding/reshard.h): the
     * model's own buffer, or on CUDA its host copy */
    if (st == RF_OK) st = share_weights(w, w->tp->m);
    RF_TRY(rf__worker_agree_to_start(w, w->tpc, st, "tensor-parallel"));
    /* rank 0's version and where the shards come from (a resumed run's checkpoint) */
    shard_src src = actor_src(w);
    int64_t version = w->version;
    RF_TRY(rf_comm_bcast(w->tpc, &src, sizeof src, 0, r->async.startup_timeout,
                         "tensor-parallel training ranks receiving where the actor is"));
    RF_TRY(rf_comm_bcast(w->tpc, &version, sizeof version, 0, r->async.startup_timeout,
                         "tensor-parallel training ranks receiving the version"));
    w->version = (int)version, w->tp->m->opt_step = (int)src.step;
    /* replica 0's ranks each read their shards; the other replicas take replica 0's later
     * (rf__dp_setup) */
    st = w->replica == 0 ? load_shards(w, w->tp, src.dir, src.ckpt, 0) : RF_OK;
    /* replica 0's ranks are the DP groups' rank 0: where the checkpoint is (ZeRO-1 reads) */
    if (src.ckpt) snprintf(w->ckpt_dir, sizeof w->ckpt_dir, "%s", src.dir);
    RF_TRY(rf__worker_agree_to_start(w, w->tpc, st, "tensor-parallel (the actor's shards)"));
    RF_TRY(roles_setup(w));
    tp_table tb = table_of(w->tp); /* under LoRA the adapters alone travel */
    int D = w->dpc ? rf_comm_size(w->dpc) : 1; /* every replica sends (the planner spreads the senders) */
    RF_TRY(weights_out_init(w, &tb.pt, T, D));
    if (rank == 0 && w->replica == 0 && w->ho)
        rf_log_info("training worker: tensor parallel over %d ranks (actor shards: %zu of %zu parameters here, "
                    "each rank reading its own from %s), each handing its weights to its process's rollout rank", T,
                    w->tp->m->n_params, w->tp->full_params, src.dir);
    else if (rank == 0 && w->replica == 0)
        rf_log_info("training worker: tensor parallel over %d ranks (actor shards: %zu of %zu parameters here, "
                    "each rank reading its own from %s), weights to %d rollout workers by resharding", T,
                    w->tp->m->n_params, w->tp->full_params, src.dir,
                    (rf_comm_size(w->wcomm) - T * D) / r->placement.rollout.tp);
    w->last_cmd = rf_time_now();
    return RF_OK;
}

void rf__tp_free(rf__tworker *w) {
    rf_weights_rs_free(w->wrs);
    if (rf_reward_model_split(w->rm)) {
        rf_reward_model_close(w->rm);
        w->rm = NULL;
    }
    rf_comm_free(w->rm_tp_dev), rf_comm_free(w->rm_comm);
    w->rm_tp_dev = w->rm_comm = NULL;
    rf_model_tp_free(w->tp), rf_model_tp_free(w->critic_tp), rf_model_tp_free(w->ref_tp);
    rf_comm_free(w->tp_dev), rf_comm_free(w->critic_tp_dev), rf_comm_free(w->ref_tp_dev);
    rf_comm_free(w->critic_comm), rf_comm_free(w->ref_comm);
    if (w->wstage) rf_shm_free(w->wstage);
    free(w->adapters);
    w->adapters = NULL;
    w->wrs = NULL, w->tp = w->critic_tp = w->ref_tp = NULL;
    w->tp_dev = w->critic_tp_dev = w->ref_tp_dev = NULL;
    w->critic_comm = w->ref_comm = NULL;
    w->wstage = NULL;
}

rf_status rf__rs_whole_setup(rf__tworker *w) {
    rf_param_table pt = rf_param_table_of(w->actor);
    if (w->actor->n_frozen) { /* LoRA: the adapters alone are resharded */
        int n = 0;
        RF_TRY(rf_lora_table(w->actor, &w->adapters, &n));
        pt = (rf_param_table){&w->actor->cfg, w->adapters, n};
    }
    float *before = w->actor->params;
    RF_TRY(share_weights(w, w->actor)); /* rollout ranks on this host read it in place */
    if (w->ref && w->ref->params == before && w->actor->params != before) {
        /* LoRA: the reference borrows the actor's frozen base, which has just moved */
        rf_model_free(w->ref);
        w->ref = NULL;
        RF_TRY(rf__worker_ref_load(w));
    }
    return weights_out_init(w, &pt, 1, w->ho && w->dpc ? rf_comm_size(w->dpc) : 1);
}

/* Colocated: hands the version (its checksum w->crc) to this process's rollout rank, resharded
 * into its buffer first unless the layouts are identical. The writer's hold on the weights
 * (rf_handover_write_begin in the update) ends here. */
static rf_status hand_over(rf__tworker *w, rf_model *m, const float *local) {
    rf_status st = RF_OK;
    if (!rf_weights_rs_zero_copy(w->wrs)) {
        float *dst;
        st = rf_handover_wait_dst(w->ho, w->r->async.startup_timeout, &dst);
        if (st == RF_OK) st = rf_weights_rs_move(w->wrs, local, dst, w->version, w->crc);
    }
    if (st == RF_OK) rf_handover_publish(w->ho, w->version, w->crc, m->params);
    return st;
}

rf_status rf__tp_publish(rf__tworker *w, double timeout_s, rf_status (*announce)(rf__tworker *w)) {
    /* without tensor parallelism of the actor: the whole actor is the one shard */
    rf_comm *tpc = w->tp ? w->tpc : rf_comm_single();
    rf_model *m = w->tp ? w->tp->m : w->actor;
    float *local = weights_of(w, m) + (w->tp ? table_of(w->tp).p0 : m->n_frozen); /* LoRA: the adapters */
    RF_TRY(rf_weights_rs_checksum(w->wrs, tpc, local, timeout_s, &w->crc));
    if (announce) RF_TRY(announce(w));
    rf_weights_rs_set_timeout(w->wrs, timeout_s);
    if (w->ho) return hand_over(w, m, local);
    return rf_weights_rs_send(w->wrs, local, w->version, w->crc);
}

/* ---- TP rank 0 ---- */

static rf_status send_cmd_share(rf__tworker *w, int cmd, int train, int64_t arg, const rf__share *sh, double timeout_s) {
    tp_cmd c = {cmd, train, arg, sh ? *sh : (rf__share){0, 0, 0, 0}};
    w->last_cmd = rf_time_now();
    return rf_comm_bcast(w->tpc, &c, sizeof c, 0, timeout_s, "sending a command to the tensor-parallel training ranks");
}

static rf_status send_cmd(rf__tworker *w, int cmd, int train, int64_t arg, double timeout_s) {
    return send_cmd_share(w, cmd, train, arg, NULL, timeout_s);
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

rf_status rf__tp_share(rf__tworker *w, const uint8_t *buf, uint64_t bytes, int train, const rf__share *sh) {
    double t = w->r->async.peer_timeout;
    RF_TRY(send_cmd_share(w, TP_TRAIN, train, (int64_t)bytes, sh, t));
    return rf_comm_bcast(w->tpc, (void *)buf, bytes, 0, t, "sending the tensor-parallel ranks the batch");
}

int rf__tp_split_flags(const rf__tworker *w, int flags) {
    return (w->ref_tp ? flags & RF_SCORE_REF : 0) | (w->critic_tp ? flags & RF_SCORE_VALUES : 0) |
           (rf_reward_model_split(w->rm) ? flags & RF_SCORE_RM : 0);
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

/* What rank 0 asks for next while a checkpoint is written: part `part` (0 parameters, 1 and 2
 * the AdamW moments) of parameter `view` of the actor (model 0) or the split critic (1);
 * model -1: the files are done (or failed on rank 0). */
typedef struct ckpt_ask {
    int32_t model, part, view;
} ckpt_ask;

static float *part_of(const rf_model_tp *tp, int part) {
    return part == 0 ? tp->m->params + table_of(tp).p0 : part == 1 ? tp->m->opt_m : tp->m->opt_v;
}

/* Copies a row-major block (rows r0..r1, cols c0..c1 of a full_cols-wide tensor) into it. */
static void place_block(float *dst, const rf_shard *b, const float *src) {
    size_t w = (size_t)(b->c1 - b->c0);
    for (int64_t r = b->r0; r < b->r1; r++)
        memcpy(dst + (size_t)r * (size_t)b->full_cols + (size_t)b->c0, src + (size_t)(r - b->r0) * w, w * sizeof(float));
}

/* One tensor (part `part` of parameter `view`) of the actor (model 0) or critic (1), tp, gathered
 * whole on rank 0 of its group into dst (numel floats; NULL on the others, which send their
 * blocks). Replicated tensors are rank 0's own. With ZeRO-1 a rank's block of a moment is first
 * gathered from its DP group (rf__dp_moments: this rank is replica 0's, their DP rank 0). Over
 * host memory (a CUDA shard's block is copied to the host first, and goes over rf_comm_host of
 * the group). `all` (rank 0): every rank's shard table, (tp x n_full_views). */
static rf_status gather_tensor(rf__tworker *w, const rf_model_tp *tp, int model, const rf_shard *all, int part,
                               int view, float *dst) {
    double timeout_s = w->r->async.peer_timeout;
    tp_table tb = table_of(tp);
    const rf_shard *own = &tb.shards[view];
    const rf_param_view *full = &tb.pt.views[view];
    size_t n_views = (size_t)tb.pt.n_views;
    size_t n_mine = (size_t)(own->r1 - own->r0) * (size_t)(own->c1 - own->c0);
    int split = own->split != RF_SPLIT_REPLICATED;
    if (!split && tp->t != 0) return RF_OK;
    /* ZeRO-1: this rank's block of the moment, from its DP group; a CUDA shard's: its copy */
    float *zero = NULL;
    const float *mine = part > 0 && rf__dp_zero_moments(w, model) ? NULL : part_of(tp, part) + own->offset;
    int device = tp->m->k != rf_cpu_kernels();
    if ((!mine || device) && !(zero = malloc(sizeof(float) * (n_mine ? n_mine : 1))))
        return rf_error(RF_ERR_NOMEM, "out of memory for a block of %zu floats", n_mine);
    rf_status st = mine ? RF_OK : rf__dp_moments(w, model, part, own->offset, n_mine, zero);
    if (mine && device) tp->m->k->to_host(zero, mine, sizeof(float) * n_mine);
    if (zero) mine = zero;
    rf_comm *c = rf_comm_host(tp->comm);
    char what[RF_MAX_NAME + 64];
    snprintf(what, sizeof what, "gathering %s for a checkpoint", full->name);
    if (st != RF_OK || !split) {
        if (st == RF_OK) memcpy(dst, mine, n_mine * sizeof(float));
    } else if (tp->t != 0) {
        rf_comm_p2p op = {(void *)mine, n_mine * sizeof(float), 0, 1};
        st = rf_comm_sendrecv(c, &op, 1, timeout_s, what);
    } else {
        rf_comm_p2p *ops = calloc((size_t)tp->tp, sizeof *ops);
        float *stage = malloc(full->numel * sizeof(float));
        st = ops && stage ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory %s", what);
        size_t at = 0;
        for (int s = 1; st == RF_OK && s < tp->tp; s++) {
            const rf_shard *b = &all[(size_t)s * n_views + (size_t)view];
            size_t n = (size_t)(b->r1 - b->r0) * (size_t)(b->c1 - b->c0);
            ops[s - 1] = (rf_comm_p2p){stage + at, n * sizeof(float), s, 0};
            at += n;
        }
        if (st == RF_OK) st = rf_comm_sendrecv(c, ops, tp->tp - 1, timeout_s, what);
        if (st == RF_OK) {
            place_block(dst, own, mine);
            for (int s = 1; s < tp->tp; s++)
                place_block(dst, &all[(size_t)s * n_views + (size_t)view], ops[s - 1].buf);
        }
        free(ops), free(stage);
    }
    free(zero);
    return st;
}

/* Rank 0's side of a checkpoint's tensors: each one asked of the peers, then gathered. */
typedef struct tp_role {
    rf__tworker *w;
    rf_model_tp *tp;
    int model;     /* 0 actor, 1 critic (ckpt_ask) */
    rf_shard *all; /* (tp x n_full_views) every rank's shards */
} tp_role;

static rf_status ask(rf__tworker *w, ckpt_ask a) {
    return rf_comm_bcast(w->tpc, &a, sizeof a, 0, w->r->async.peer_timeout,
                         "asking the tensor-parallel ranks for a checkpoint's next tensor");
}

static rf_status tp_role_tensor(void *ctx, int part, int view, float *dst) {
    tp_role *c = ctx;
    RF_TRY(ask(c->w, (ckpt_ask){c->model, part, view}));
    return gather_tensor(c->w, c->tp, c->model, c->all, part, view, dst);
}

/* A split model as a checkpoint role (c->all allocated here; free it after). */
static rf_status tp_role_init(tp_role *c, rf__tworker *w, rf_model_tp *tp, int model, rf_ckpt_role *out) {
    tp_table tb = table_of(tp); /* under LoRA the adapters, whole, and their PEFT copy */
    size_t nv = (size_t)tb.pt.n_views;
    *c = (tp_role){w, tp, model, calloc((size_t)tp->tp * nv + 1, sizeof(rf_shard))};
    if (!c->all) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int s = 0; s < tp->tp; s++) {
        size_t n;
        RF_TRY(rf_layout_shards(&tb.pt, tp->tp, s, c->all + (size_t)s * nv, &n));
    }
    *out = (rf_ckpt_role){&tp->cfg, tb.pt.views, tb.pt.n_views, tp->m->opt_step, 1, tp_role_tensor, c,
                          tp->lora_views ? &tp->m->lora : NULL};
    return RF_OK;
}

rf_status rf__tp_checkpoint_save(rf__tworker *w, const rf_ckpt_state *cs) {
    const rf_recipe *r = w->r;
    tp_role ac = {0}, cc = {0};
    rf__zero_role zc;
    rf_ckpt_role a, c;
    const rf_ckpt_role *critic = NULL;
    rf_status st = tp_role_init(&ac, w, w->tp, 0, &a);
    if (st == RF_OK && w->critic_tp) st = tp_role_init(&cc, w, w->critic_tp, 1, &c), critic = &c;
    else if (st == RF_OK && w->critic) c = rf__dp_role_of(w, w->critic, 1, &zc), critic = &c; /* whole here (ZeRO-1: its moments from the DP group) */
    /* the peers are told only once nothing can fail before the first ask */
    if (st == RF_OK) st = rf__tp_checkpoint_peers(w);
    if (st == RF_OK) {
        st = rf_checkpoint_save_roles(r->logging.dir, &a, critic, r->model.path, cs, r->checkpoint.keep);
        rf_status done = ask(w, (ckpt_ask){-1, 0, 0}); /* also after a failed write: the peers go on */
        if (done == RF_OK) done = rf__dp_moments_done(w); /* ZeRO-1: this rank's DP group too */
        if (st == RF_OK) st = done;
    }
    free(ac.all), free(cc.all);
    return st;
}

/* ---- the peers ---- */

/* Receives the whole batch (with data parallelism: the replica's shares) and trains this
 * rank's shards on it with the others (sh: the actor's and the critic's samples), then sends
 * the new weights with them (and the other replicas). */
static rf_status peer_train(rf__tworker *w, int64_t bytes, int train, const rf__share *sh) {
    double t = w->r->async.peer_timeout;
    uint8_t *buf = malloc(bytes ? (size_t)bytes : 1);
    if (!buf) return rf_error(RF_ERR_NOMEM, "out of memory for a batch of %lld bytes", (long long)bytes);
    rf_status st = rf_comm_bcast(w->tpc, buf, (size_t)bytes, 0, t, "receiving the batch from the training worker (tensor-parallel rank 0)");
    if (st == RF_OK) st = rf__worker_peer_update(w, buf, (size_t)bytes, "the batch from tensor-parallel rank 0", train, sh);
    free(buf);
    return st == RF_OK ? rf__tp_publish(w, t, NULL) : st;
}

/* A checkpoint: (replica 0) the blocks of the actor's (and a split critic's) tensors sent to
 * rank 0 as it writes them, with ZeRO-1 each moment block first gathered from this rank's DP
 * group; (other replicas) the DP group's blocks sent as replica 0's rank asks. */
static rf_status peer_checkpoint(rf__tworker *w, int64_t version) {
    if (version != w->version)
        return rf_error(RF_ERR_FORMAT, "tensor-parallel rank 0 checkpoints version %lld, this rank is at %d",
                        (long long)version, w->version);
    /* another replica: only ZeRO-1's blocks of the moments, to replica 0's rank at this position */
    if (w->replica != 0) return rf__dp_zero_moments(w, 0) ? rf__dp_moments_serve(w) : RF_OK;
    /* replica 0: send the blocks rank 0 asks for until it says the files are done */
    rf_status st = RF_OK;
    for (ckpt_ask a = {0, 0, 0}; st == RF_OK;) {
        st = rf_comm_bcast(w->tpc, &a, sizeof a, 0, 2 * w->r->async.peer_timeout,
                           "waiting for tensor-parallel rank 0 to ask for a checkpoint's next tensor");
        if (st != RF_OK || a.model < 0) break;
        rf_model_tp *tp = a.model ? w->critic_tp : w->tp; /* NULL: the critic is not on this rank */
        if (a.part < 0 || a.part > 2 || a.view < 0 || (tp && a.view >= table_of(tp).pt.n_views))
            st = rf_error(RF_ERR_FORMAT, "tensor-parallel rank 0 asked for part %d of tensor %d", a.part, a.view);
        else if (tp) st = gather_tensor(w, tp, a.model, NULL, a.part, a.view, NULL);
    }
    return st == RF_OK ? rf__dp_moments_done(w) : st;
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
        case TP_TRAIN: RF_TRY(peer_train(w, c.arg, c.train, &c.sh)); break;
        case TP_CHECKPOINT: RF_TRY(peer_checkpoint(w, c.arg)); break;
        case TP_SCORE: RF_TRY(peer_score(w, c.arg, c.train)); break;
        case TP_STOP:
            return c.arg ? rf_error(RF_ERR_IO, "the training worker (tensor-parallel rank 0) stopped the run on an error")
                         : RF_OK;
        default: return rf_error(RF_ERR_FORMAT, "tensor-parallel rank 0 sent an unknown command %d", (int)c.cmd);
        }
    }
}

rf_status rf_train_tp_peer_main(const rf_recipe *r, rf_comm *tpc, rf_comm *wcomm, rf_comm *dpc, rf_handover *ho) {
    rf__tworker w = {.r = r, .tpc = tpc, .wcomm = wcomm, .dpc = dpc, .replica = dpc ? rf_comm_rank(dpc) : 0, .ho = ho};
    w.k = rf_kernels_for(r->model.device);
    rf_status st = w.k ? rf_loss_agg_parse(r->algorithm.loss_agg, &w.agg)
                       : rf_error_wrap(RF_ERR_NODEVICE, "model.device = \"%s\"", r->model.device);
    if (st == RF_OK) st = rf_kernels_apply_precision(w.k, r->model.precision, "model.precision", NULL);
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
