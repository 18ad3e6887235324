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

rf_status rf__worker_score_share(rf__tworker *w, const Rlflow__TrainBatch *b, size_t lo, size_t hi, rf_train_sample *s,
                                 int flags) {
    if (w->tpc && rf__tp_split_flags(w, flags)) {
        uint8_t *buf = NULL;
        uint64_t bytes = 0;
        RF_TRY(rf__worker_pack_part(b, lo, hi, &buf, &bytes));
        rf_status st = rf__tp_score_share(w, buf, bytes, flags);
        free(buf);
        RF_TRY(st);
    }
    return rf__worker_score(w, s, (int)(hi - lo), flags);
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

rf_status rf__dp_checkpoint_begin(rf__tworker *w) {
    if (!rf__dp_zero_moments(w, 0)) return RF_OK;
    return send_cmd(w, DP_CHECKPOINT, 0, w->r->async.peer_timeout);
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
