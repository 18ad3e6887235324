/* Data parallelism of the training worker (placement.actor.dp > 1): the controller talks to
 * DP rank 0 only; rank 0 hands each DP peer its share of every TrainBatch over comm, and all
 * of them update together (trainer/data_parallel.h sums their gradients); rank 0 alone scores,
 * checkpoints and sends weights to the rollout workers; scoring is shared out like training
 * when the models it needs are on every replica.
 *
 * Rank 0 drives the peers with commands, a broadcast over the DP communicator:
 *   NOP         a keep-alive while rank 0 is idle (peers give up on a silent rank 0);
 *   TRAIN       then each peer receives a share header (the size of its part and where the
 *               actor's and the critic's samples lie in it) and the bytes of its part, a
 *               TrainBatch message holding the samples spanning both shares (the same fields
 *               as the controller's), and every rank runs rf__worker_update; `arg` is the
 *               whole batch's sample count;
 *   CHECKPOINT  ZeRO-1: the optimizer shards are gathered for rank 0's checkpoint;
 *   STOP        the run is over (`arg` 1: on an error, and the peers stop with one);
 *   SCORE       a ScoreRequest's samples shared out as TRAIN's (a TrainBatch each) over the
 *               replicas holding the models asked for (the others get none); every rank scores
 *               its share (`arg`: the RF_SCORE_* flags; worker_internal.h) and sends rank 0
 *               the results, per sample its reference log-probs, its values, then its
 *               reward-model score (those asked for).
 * Shares are contiguous runs of the batch with about equal token counts: the actor's over all
 * the replicas, the critic's over its placement.critic.dp.
 *
 * With tensor parallelism too (worker_internal.h), the DP ranks are the replicas' leaders: each
 * hands its TP peers its share and passes the other commands on (worker_tp.c), and the actor's
 * data parallelism runs on every rank over the DP group of its TP position. */
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

enum { DP_NOP = 1, DP_TRAIN, DP_CHECKPOINT, DP_STOP, DP_SCORE };

typedef struct dp_cmd {
    int32_t cmd;
    int32_t pad;
    int64_t arg;
} dp_cmd;

/* What precedes a peer's part of a batch: its size, and each model's samples in it. */
typedef struct dp_part {
    uint64_t bytes;
    rf__share sh;
} dp_part;

/* Whether this rank's TP position holds (a shard of) the critic in the replicas that have it:
 * the critic's DP group is the ranks of that position. */
static int critic_position(const rf__tworker *w) {
    if (!rf__worker_critic_replicas(w)) return 0;
    if (!w->tpc) return 1;
    int t = rf_comm_rank(w->tpc), tp = rf__worker_split_tp(w, RF_ROLE_CRITIC);
    return tp ? t < tp : t == 0;
}

int rf__dp_zero_reads(const rf__tworker *w, int model) {
    if (!w->dpc || w->r->placement.actor.zero != 1) return 0;
    return model ? rf__worker_critic_replicas(w) > 1 : 1;
}

/* A source of moments that fails: a rank that could not open the checkpoint's files still
 * takes part in rf_dp_init, failing its read, so that every rank fails naming it. */
static rf_status unreadable(void *ctx, int which, size_t a, size_t n, float *dst) {
    (void)which, (void)a, (void)n, (void)dst;
    return rf_error(RF_ERR_IO, "%s", (const char *)ctx);
}

/* Data parallelism over g with options o of whole model m or shard tp (the other NULL;
 * `model` 0 the actor, 1 the critic); resuming with ZeRO-1 (ckpt: the checkpoint's directory,
 * "" on a fresh start) every rank reads its own blocks of the moments from the checkpoint. */
static rf_status dp_model(rf__tworker *w, rf_dp **out, rf_comm *g, rf_model *m, rf_model_tp *tp, int model,
                          const char *ckpt, rf_dp_opts o) {
    rf_ckpt_moments cm;
    char why[1024] = "";
    int read = ckpt[0] && rf__dp_zero_reads(w, model);
    rf_status st = read ? rf_checkpoint_moments_open(&cm, ckpt, model ? "critic" : "actor", m, tp) : RF_OK;
    if (read && st == RF_OK) o.moments = rf_checkpoint_moments_read, o.moments_ctx = &cm;
    if (read && st != RF_OK) {
        snprintf(why, sizeof why, "%s", rf_error_message());
        o.moments = unreadable, o.moments_ctx = why;
    }
    st = tp ? rf_dp_init_tp(out, g, tp, &o) : rf_dp_init(out, g, m, &o);
    if (read && !why[0]) rf_checkpoint_moments_close(&cm);
    return st;
}

/* The critic's data parallelism over the first k = placement.critic.dp of the replicas (k > 1;
 * its group a split of dpc when fewer than all): every rank of dpc takes part. */
static rf_status critic_dp_setup(rf__tworker *w, const rf_dp_opts *o, const char *ckpt) {
    int k = rf__worker_critic_replicas(w), size = rf_comm_size(w->dpc);
    if (k <= 1 || !critic_position(w)) return RF_OK;
    rf_comm *g = w->dpc;
    if (k < size) {
        RF_TRY(rf_comm_split(w->dpc, w->replica < k ? 0 : -1, w->replica, &w->critic_dpc));
        g = w->critic_dpc;
    }
    if (!g) return RF_OK; /* a replica past the critic's */
    RF_TRY(rf_comm_for(g, w->k, "data parallelism", w->r->async.startup_timeout, &w->critic_dev, &g));
    if (w->critic_tp || w->critic) return dp_model(w, &w->dp_critic, g, w->critic, w->critic_tp, 1, ckpt, *o);
    return rf_error(RF_ERR_ARG, "data-parallel replica %d of the critic's %d holds no critic", w->replica, k);
}

/* How the critic is laid out, for the start-up log line. */
static const char *critic_where(const rf__tworker *w, char *buf, size_t cap) {
    int k = rf__worker_critic_replicas(w), size = rf_comm_size(w->dpc);
    if (!k) snprintf(buf, cap, "actor");
    else if (k == size) snprintf(buf, cap, "actor and critic%s", w->tpc && !w->critic_tp ? " (the critic on the replicas' first ranks)" : "");
    else if (k == 1) snprintf(buf, cap, "actor (the critic on %s alone, on whole batches)", w->tpc ? "replica 0" : "rank 1");
    else snprintf(buf, cap, "actor, and the critic over the first %d replicas (its own shares of each batch)", k);
    return buf;
}

/* ---- both sides ---- */

rf_status rf__dp_setup(rf__tworker *w, rf_status loaded) {
    const rf_recipe *r = w->r;
    int size = rf_comm_size(w->dpc), rank = rf_comm_rank(w->dpc);
    RF_TRY(rf__worker_agree_to_start(w, w->dpc, loaded, "data-parallel"));
    rf_status st;
    /* set-up waits for rank 0's checkpoint loading: the start-up bound; later, the peers' */
    rf_dp_opts o = {.zero = r->placement.actor.zero, .timeout_s = r->async.startup_timeout};
    /* ZeRO-1: the checkpoint resumed from (rank 0's; "" on a fresh start), from which every rank
     * reads its blocks of the moments (of its whole model or its tensor-parallel shard) */
    char ckpt[sizeof w->ckpt_dir] = "";
    if (rank == 0) snprintf(ckpt, sizeof ckpt, "%s", w->ckpt_dir);
    st = o.zero ? rf_comm_bcast(w->dpc, ckpt, sizeof ckpt, 0, r->async.startup_timeout,
                                "receiving the checkpoint's directory from data-parallel rank 0")
                : RF_OK;
    rf_comm *g = NULL;
    if (st == RF_OK) st = rf_comm_for(w->dpc, w->k, "data parallelism", w->r->async.startup_timeout, &w->dp_dev, &g);
    if (st == RF_OK) st = dp_model(w, &w->dp_actor, g, w->tp ? NULL : w->actor, w->tp, 0, ckpt, o);
    /* the version comes from replica 0 too (the peers have none yet: on --resume rank 0 read
     * it from the checkpoint), for the versions a colocated peer hands its rollout rank and
     * its tensor-parallel ranks' shards */
    int64_t v = w->version;
    if (st == RF_OK)
        st = rf_comm_bcast(w->dpc, &v, sizeof v, 0, r->async.startup_timeout, "receiving the version from replica 0");
    w->version = (int)v;
    /* the critic data parallel over the replicas holding it when there are several
     * (placement.critic.dp = 1: replica 0 trains it alone, on whole batches) */
    if (st == RF_OK) st = critic_dp_setup(w, &o, ckpt);
    if (st != RF_OK) return st;
    rf_dp_set_timeout(w->dp_actor, r->async.peer_timeout);
    if (w->dp_critic) rf_dp_set_timeout(w->dp_critic, r->async.peer_timeout);
    char where[160];
    if (rank == 0 && w->tpc && rf_comm_rank(w->tpc) == 0)
        rf_log_info("training worker: %d data-parallel replicas of %d tensor-parallel ranks%s, %s", size,
                    rf_comm_size(w->tpc), r->placement.actor.zero ? " (ZeRO-1: optimizer state sharded per shard)" : "",
                    critic_where(w, where, sizeof where));
    else if (rank == 0 && !w->tpc)
        rf_log_info("training worker: data parallel over %d ranks%s, %s", size,
                    r->placement.actor.zero ? " (ZeRO-1: optimizer state sharded)" : "", critic_where(w, where, sizeof where));
    w->last_cmd = rf_time_now();
    return RF_OK;
}

void rf__dp_free(rf__tworker *w) {
    rf_dp_free(w->dp_actor), rf_dp_free(w->dp_critic);
    rf_comm_free(w->dp_dev), rf_comm_free(w->critic_dev);
    rf_comm_free(w->critic_dpc);
    w->dp_actor = w->dp_critic = NULL;
    w->critic_dpc = w->dp_dev = w->critic_dev = NULL;
}

/* ---- DP rank 0 ---- */

static rf_status send_cmd(rf__tworker *w, int cmd, int64_t arg, double timeout_s) {
    dp_cmd c = {cmd, 0, arg};
    w->last_cmd = rf_time_now();
    return rf_comm_bcast(w->dpc, &c, sizeof c, 0, timeout_s, "sending a command to the data-parallel training ranks");
}

rf_status rf__dp_keepalive(rf__tworker *w) {
    if (!w->dp_actor || rf_time_now() - w->last_cmd < w->r->async.peer_timeout / 4) return RF_OK;
    return send_cmd(w, DP_NOP, 0, w->r->async.peer_timeout);
}

void rf__dp_stop(rf__tworker *w, int failed) {
    char keep[1024];
    snprintf(keep, sizeof keep, "%s", rf_error_message());
    /* best effort: when it fails a peer is gone or the communicator failed already, and the
     * run's own error (kept) says why; the peers that are left give up on their own */
    send_cmd(w, DP_STOP, failed, 5.0);
    if (keep[0]) rf_error(RF_ERR_IO, "%s", keep);
    else rf_error_clear();
}

/* Sample boundaries of m shares of b with about equal tokens each, for `size` replicas: bound
 * (size + 1); the replicas from m on get empty shares at the end. */
static void shares(const Rlflow__TrainBatch *b, int m, int size, int64_t *bound) {
    size_t total = 0, acc = 0, i = 0;
    for (size_t k = 0; k < b->n_samples; k++) total += b->samples[k]->n_tokens;
    bound[0] = 0;
    for (int q = 1; q < m; q++) {
        /* share q starts at the first sample that begins at or past q / m of the tokens */
        while (i < b->n_samples && acc * (size_t)m < total * (size_t)q) acc += b->samples[i++]->n_tokens;
        bound[q] = (int64_t)i;
    }
    for (int q = m; q <= size; q++) bound[q] = (int64_t)b->n_samples;
}

/* Replica q's part of the batch: the samples spanning its actor share [a[q], a[q + 1]) and its
 * critic share (c: NULL without one), as *lo, *hi and sh (ranges in the whole batch). */
static void part_of(const int64_t *a, const int64_t *c, int q, int64_t *lo, int64_t *hi, rf__share *sh) {
    *sh = (rf__share){a[q], a[q + 1], a[q], a[q]};
    if (c) sh->c_lo = c[q], sh->c_hi = c[q + 1];
    *lo = sh->a_lo, *hi = sh->a_hi;
    if (sh->c_hi > sh->c_lo) {
        if (*hi == *lo) *lo = sh->c_lo, *hi = sh->c_hi;
        if (sh->c_lo < *lo) *lo = sh->c_lo;
        if (sh->c_hi > *hi) *hi = sh->c_hi;
    }
    if (sh->c_hi == sh->c_lo) sh->c_lo = sh->c_hi = *lo; /* empty, in the part */
}

/* Tells the peers `cmd` (with arg) and sends each its part of b: the actor's shares over the
 * first m replicas (of size), with the critic's over its replicas when `critic` (training).
 * *own_lo, *own_hi, *own: rank 0's part (ranges in b); bound (size + 1): the actor's share
 * boundaries. */
static rf_status scatter(rf__tworker *w, int cmd, int64_t arg, const Rlflow__TrainBatch *b, int m, int critic,
                         int64_t *bound, int64_t *own_lo, int64_t *own_hi, rf__share *own) {
    int size = rf_comm_size(w->dpc), k = critic ? rf__worker_critic_replicas(w) : 0;
    double t = w->r->async.peer_timeout;
    dp_part *head = calloc((size_t)size, sizeof *head);
    uint8_t **buf = calloc((size_t)size, sizeof *buf);
    rf_comm_p2p *ops = calloc((size_t)size, sizeof *ops);
    int64_t *cb = calloc((size_t)size + 1, sizeof *cb);
    rf_status st = head && buf && ops && cb ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) shares(b, m, size, bound);
    if (st == RF_OK && k) shares(b, k, size, cb);
    /* every part packed before the peers are told: a failure here leaves them waiting for the
     * next command, not half-way through this one */
    for (int q = 0; st == RF_OK && q < size; q++) {
        int64_t lo, hi;
        part_of(bound, k ? cb : NULL, q, &lo, &hi, &head[q].sh);
        if (q == 0) {
            *own_lo = lo, *own_hi = hi, *own = head[0].sh;
            continue;
        }
        head[q].sh = (rf__share){head[q].sh.a_lo - lo, head[q].sh.a_hi - lo, head[q].sh.c_lo - lo, head[q].sh.c_hi - lo};
        st = rf__worker_pack_part(b, (size_t)lo, (size_t)hi, &buf[q], &head[q].bytes);
    }
    if (st == RF_OK) st = send_cmd(w, cmd, arg, t);
    for (int q = 1; q < size; q++) ops[q - 1] = (rf_comm_p2p){&head[q], sizeof head[q], q, 1};
    if (st == RF_OK) st = rf_comm_sendrecv(w->dpc, ops, size - 1, t, "sending the data-parallel ranks their shares");
    for (int q = 1; q < size; q++) ops[q - 1] = (rf_comm_p2p){buf[q], head ? head[q].bytes : 0, q, 1};
    if (st == RF_OK) st = rf_comm_sendrecv(w->dpc, ops, size - 1, t, "sending the data-parallel ranks their shares");
    for (int q = 0; buf && q < size; q++) free(buf[q]);
    free(head), free(buf), free(ops), free(cb);
    return st;
}

rf_status rf__dp_scatter(rf__tworker *w, const Rlflow__TrainBatch *b, size_t *lo, size_t *hi, rf__share *sh) {
    int size = rf_comm_size(w->dpc);
    int64_t *bound = calloc((size_t)size + 1, sizeof *bound), l = 0, h = 0;
    rf_status st = bound ? scatter(w, DP_TRAIN, (int64_t)b->n_samples, b, size, 1, bound, &l, &h, sh)
                         : rf_error(RF_ERR_NOMEM, "out of memory");
    *lo = (size_t)l, *hi = (size_t)h;
    free(bound);
    return st;
}

/* Floats of the scores of samples s (n) for flags: per sample its reference log-probs then its
 * values. */
static size_t score_floats(const rf_train_sample *s, int n, int flags) {
    size_t per = (size_t)((flags & RF_SCORE_REF) != 0) + (size_t)((flags & RF_SCORE_VALUES) != 0), f = 0;
    for (int i = 0; i < n; i++) f += per * (size_t)s[i].n_resp + ((flags & RF_SCORE_RM) != 0);
    return f;
}

/* Copies the scores of s (n) to buf (to_buf) or from it: per sample the reference log-probs,
 * the values, the reward-model score (those in flags). */
static void score_copy(rf_train_sample *s, int n, int flags, float *buf, int to_buf) {
    for (int i = 0; i < n; i++) {
        size_t k = (size_t)s[i].n_resp * sizeof(float);
        float *f[2] = {flags & RF_SCORE_REF ? s[i].ref_logp : NULL, flags & RF_SCORE_VALUES ? s[i].values : NULL};
        for (int j = 0; j < 2; j++) {
            if (!f[j]) continue;
            if (to_buf) memcpy(buf, f[j], k);
            else memcpy(f[j], buf, k);
            buf += s[i].n_resp;
        }
        if (flags & RF_SCORE_RM) {
            if (to_buf) *buf = s[i].rm_score;
            else s[i].rm_score = *buf;
            buf++;
        }
    }
}

rf_status rf__dp_score(rf__tworker *w, const Rlflow__TrainBatch *b, rf_train_sample *s, int flags, int m) {
    int size = rf_comm_size(w->dpc);
    int64_t *bound = calloc((size_t)size + 1, sizeof *bound), lo, hi;
    float **got = calloc((size_t)size, sizeof *got);
    rf_comm_p2p *ops = calloc((size_t)size, sizeof *ops);
    rf__share own;
    rf_status st = bound && got && ops ? scatter(w, DP_SCORE, flags, b, m, 0, bound, &lo, &hi, &own)
                                       : rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) st = rf__worker_score_share(w, b, (size_t)lo, (size_t)hi, s, flags);
    for (int q = 1; st == RF_OK && q < size; q++) {
        size_t f = score_floats(s + bound[q], (int)(bound[q + 1] - bound[q]), flags);
        got[q] = malloc(sizeof(float) * (f ? f : 1));
        if (!got[q]) st = rf_error(RF_ERR_NOMEM, "out of memory for %zu scores", f);
        ops[q - 1] = (rf_comm_p2p){got[q], sizeof(float) * f, q, 0};
    }
    if (st == RF_OK)
        st = rf_comm_sendrecv(w->dpc, ops, size - 1, w->r->async.peer_timeout, "receiving the data-parallel ranks' scores");
    for (int q = 1; st == RF_OK && q < size; q++) score_copy(s + bound[q], (int)(bound[q + 1] - bound[q]), flags, got[q], 0);
    for (int q = 0; got && q < size; q++) free(got[q]);
    free(bound), free(got), free(ops);
    return st;
}

/* ---- ZeRO-1 checkpoints: the moments gathered one range (a tensor, or a shard's block of it)
 * at a time onto the DP rank 0 that writes them; the peers send as asked ---- */

typedef struct dp_ask {
    int32_t model, part; /* 0 actor, 1 critic; 1 or 2: the first or second moment; model -1: done */
    int64_t a, n;        /* floats [a, a + n) of the model's buffer */
} dp_ask;

int rf__dp_zero_moments(const rf__tworker *w, int model) {
    const rf_dp *dp = model ? w->dp_critic : w->dp_actor;
    return dp && rf_dp_zero(dp);
}

rf_status rf__dp_checkpoint_begin(rf__tworker *w) {
    if (!rf__dp_zero_moments(w, 0)) return RF_OK;
    return send_cmd(w, DP_CHECKPOINT, 0, w->r->async.peer_timeout);
}

rf_status rf__dp_moments(rf__tworker *w, int model, int part, size_t a, size_t n, float *dst) {
    dp_ask q = {model, part, (int64_t)a, (int64_t)n};
    RF_TRY(rf_comm_bcast(w->dpc, &q, sizeof q, 0, w->r->async.peer_timeout,
                         "asking the data-parallel ranks for a checkpoint's optimizer state"));
    return rf_dp_moment_range(model ? w->dp_critic : w->dp_actor, part, a, n, dst);
}

rf_status rf__dp_moments_done(rf__tworker *w) {
    if (!rf__dp_zero_moments(w, 0)) return RF_OK;
    dp_ask q = {-1, 0, 0, 0};
    return rf_comm_bcast(w->dpc, &q, sizeof q, 0, w->r->async.peer_timeout,
                         "telling the data-parallel ranks the checkpoint is written");
}

static rf_status zero_tensor(void *ctx, int part, int view, float *dst) {
    const rf__zero_role *z = ctx;
    if (part == 0) return z->whole.tensor(z->whole.ctx, 0, view, dst);
    const rf_param_view *v = &z->whole.views[view];
    return rf__dp_moments(z->w, z->model, part, v->offset, v->numel, dst);
}

rf_ckpt_role rf__dp_role_of(rf__tworker *w, const rf_model *m, int model, rf__zero_role *z) {
    *z = (rf__zero_role){w, rf_checkpoint_role_of(m), model};
    if (!rf__dp_zero_moments(w, model)) return z->whole;
    rf_ckpt_role r = z->whole;
    r.moments = 1, r.tensor = zero_tensor, r.ctx = z;
    return r;
}

rf_status rf__dp_checkpoint_save(rf__tworker *w, const rf_ckpt_state *cs) {
    const rf_recipe *r = w->r;
    rf__zero_role za, zc;
    rf_ckpt_role a = rf__dp_role_of(w, w->actor, 0, &za), c = w->critic ? rf__dp_role_of(w, w->critic, 1, &zc) : a;
    rf_status st = rf_checkpoint_save_roles(r->logging.dir, &a, w->critic ? &c : NULL, r->model.path, cs,
                                            r->checkpoint.keep);
    rf_status done = rf__dp_moments_done(w); /* also after a failed write: the peers go on */
    return st != RF_OK ? st : done;
}

rf_status rf__dp_moments_serve(rf__tworker *w) {
    for (;;) {
        dp_ask q;
        RF_TRY(rf_comm_bcast(w->dpc, &q, sizeof q, 0, 2 * w->r->async.peer_timeout,
                             "waiting for data-parallel rank 0 to ask for a checkpoint's optimizer state"));
        if (q.model < 0) return RF_OK;
        rf_dp *dp = q.model ? w->dp_critic : w->dp_actor;
        if (q.model == 1 && !dp && !rf__worker_has_critic(w)) continue; /* past the critic's replicas */
        if (!dp || q.a < 0 || q.n < 0)
            return rf_error(RF_ERR_FORMAT, "data-parallel rank 0 asked for floats [%lld, %lld) of model %d's moment %d, "
                            "which this rank does not hold", (long long)q.a, (long long)(q.a + q.n), (int)q.model,
                            (int)q.part);
        RF_TRY(rf_dp_moment_range(dp, q.part, (size_t)q.a, (size_t)q.n, NULL));
    }
}

/* ---- the peers ---- */

/* Receives this rank's part of a batch (caller frees *buf) and where its shares lie in it. */
static rf_status recv_share(rf__tworker *w, uint8_t **buf, dp_part *head) {
    double t = w->r->async.peer_timeout;
    *buf = NULL;
    memset(head, 0, sizeof *head);
    rf_comm_p2p op = {head, sizeof *head, 0, 0};
    RF_TRY(rf_comm_sendrecv(w->dpc, &op, 1, t, "receiving this rank's share of the batch"));
    *buf = malloc(head->bytes ? head->bytes : 1);
    if (!*buf) return rf_error(RF_ERR_NOMEM, "out of memory for a share of %llu bytes", (unsigned long long)head->bytes);
    op = (rf_comm_p2p){*buf, head->bytes, 0, 0};
    return rf_comm_sendrecv(w->dpc, &op, 1, t, "receiving this rank's share of the batch");
}

/* Receives this rank's part and trains on it with the others (with tensor parallelism: with
 * its TP peers, after handing them the part). */
static rf_status peer_train(rf__tworker *w, int64_t n_batch) {
    double t = w->r->async.peer_timeout;
    uint8_t *buf = NULL;
    dp_part head;
    rf_status st = recv_share(w, &buf, &head);
    if (st == RF_OK && w->tpc) st = rf__tp_share(w, buf, head.bytes, n_batch > 0, &head.sh);
    if (st == RF_OK) st = rf__worker_peer_update(w, buf, head.bytes, "this rank's share of the batch", n_batch > 0, &head.sh);
    /* tensor parallelism: this replica's shards go to the rollout workers with the others';
     * colocated: to this process's rollout rank */
    if (st == RF_OK && (w->tpc || w->ho)) st = rf__tp_publish(w, t, NULL);
    free(buf);
    return st;
}

/* Receives this rank's share of the samples to score, scores it (with its TP peers when a
 * split model takes part) and sends rank 0 the results. */
static rf_status peer_score(rf__tworker *w, int flags) {
    uint8_t *buf = NULL;
    dp_part head;
    rf_status st = recv_share(w, &buf, &head);
    Rlflow__TrainBatch *b = NULL;
    rf_train_sample *s = NULL;
    if (st == RF_OK) st = rf__worker_unpack_packed(buf, head.bytes, "this rank's share of the samples to score", &b, &s);
    int n = b ? (int)b->n_samples : 0;
    if (st == RF_OK) st = rf__worker_score_share(w, b, 0, (size_t)n, s, flags);
    size_t f = st == RF_OK ? score_floats(s, n, flags) : 0;
    float *out = st == RF_OK ? malloc(sizeof(float) * (f ? f : 1)) : NULL;
    if (st == RF_OK && !out) st = rf_error(RF_ERR_NOMEM, "out of memory for %zu scores", f);
    if (st == RF_OK) {
        score_copy(s, n, flags, out, 1);
        rf_comm_p2p op = {out, sizeof(float) * f, 0, 1};
        st = rf_comm_sendrecv(w->dpc, &op, 1, w->r->async.peer_timeout, "sending data-parallel rank 0 this rank's scores");
    }
    free(out);
    rf__worker_packed_free(b, s);
    free(buf);
    return st;
}

static rf_status peer_serve(rf__tworker *w) {
    const rf_recipe *r = w->r;
    /* rank 0 connects to the controller before its first command: the start-up bound first */
    double bound = r->async.startup_timeout;
    for (;;) {
        dp_cmd c = {0};
        RF_TRY(rf_comm_bcast(w->dpc, &c, sizeof c, 0, bound, "waiting for a command from the training worker (data-parallel rank 0)"));
        bound = 2 * r->async.peer_timeout; /* rank 0 sends a keep-alive every peer_timeout / 4 when idle */
        switch (c.cmd) {
        case DP_NOP: RF_TRY(rf__tp_keepalive(w)); break;
        case DP_TRAIN: RF_TRY(peer_train(w, c.arg)); break;
        case DP_SCORE: RF_TRY(peer_score(w, (int)c.arg)); break;
        case DP_CHECKPOINT: /* ZeRO-1: this replica's blocks of the moments, as asked */
            if (w->tpc) RF_TRY(rf__tp_checkpoint_peers(w));
            RF_TRY(rf__dp_moments_serve(w));
            break;
        case DP_STOP:
            rf__tp_stop(w, c.arg != 0);
            return c.arg ? rf_error(RF_ERR_IO, "the training worker (data-parallel rank 0) stopped the run on an error")
                         : RF_OK;
        default: return rf_error(RF_ERR_FORMAT, "data-parallel rank 0 sent an unknown command %d", (int)c.cmd);
        }
    }
}

rf_status rf_train_peer_main(const rf_recipe *r, rf_comm *dpc, rf_comm *tpc, rf_comm *wcomm, rf_handover *ho) {
    rf__tworker w = {.r = r, .dpc = dpc, .tpc = tpc, .wcomm = wcomm, .replica = rf_comm_rank(dpc), .ho = ho};
    w.k = rf_kernels_for(r->model.device);
    rf_adv_kind kind;
    rf_status st = w.k ? rf_adv_kind_parse(r->algorithm.name, &kind)
                       : rf_error_wrap(RF_ERR_NODEVICE, "model.device = \"%s\"", r->model.device);
    if (st == RF_OK) st = rf_kernels_apply_precision(w.k, r->model.precision, "model.precision", NULL);
    if (st == RF_OK) st = rf_loss_agg_parse(r->algorithm.loss_agg, &w.agg);
    if (st == RF_OK) st = rf_kl_est_parse(r->algorithm.kl_estimator, &w.kl_est);
    if (st == RF_OK && !tpc) st = rf__worker_actor_load(&w); /* tp: shards, from replica 0 */
    if (st == RF_OK && kind == RF_ADV_GAE && rf__worker_has_critic(&w) && !rf__worker_split_tp(&w, RF_ROLE_CRITIC)) {
        /* placement.critic.dp replicas (split: rf__tp_setup reads the shards) */
        st = rf_model_load(&w.critic, r->critic.path[0] ? r->critic.path : r->model.path, w.k, 1);
        if (st == RF_OK) st = rf_model_enable_training(w.critic);
    }
    /* the reference on the first placement.reference.dp replicas */
    if (st == RF_OK && rf__worker_has_ref(&w) && !rf__worker_split_tp(&w, RF_ROLE_REFERENCE))
        st = rf__worker_ref_load(&w);
    /* the reward model whole on the first placement.reward.dp replicas' first ranks */
    if (st == RF_OK && rf__worker_has_rm(&w) && !rf__worker_split_tp(&w, RF_ROLE_REWARD))
        st = rf_reward_model_open(&w.rm, r->reward.model, w.k);
    if (tpc) st = rf__tp_setup(&w, st);
    st = rf__dp_setup(&w, st);
    if (st == RF_OK)
        rf_log_info("training worker: data-parallel rank %d of %d ready (world rank %d, pid %d)", rf_comm_rank(dpc),
                    rf_comm_size(dpc), rf_comm_world_rank(dpc, rf_comm_rank(dpc)), (int)getpid());
    /* tensor parallelism: the first weights, with every replica; then this replica's TP peers
     * wait for commands */
    /* colocated without tensor parallelism: this replica's actor for its own process's rollout rank */
    if (st == RF_OK && ho && !tpc) st = rf__rs_whole_setup(&w);
    if (st == RF_OK && (tpc || ho)) st = rf__tp_publish(&w, r->async.startup_timeout, NULL);
    w.tp_serving = st == RF_OK && tpc;
    if (st == RF_OK) st = peer_serve(&w);
    if (st != RF_OK) rf__tp_stop(&w, 1);
    rf__dp_free(&w);
    rf__tp_free(&w);
    rf_model_free(w.ref), rf_model_free(w.actor), rf_model_free(w.critic); /* the reference may borrow the actor's base */
    rf_reward_model_close(w.rm);
    return st;
}
