/* The training worker's event loop. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actor/actor.h"
#include "actor/worker.h"
#include "actor/worker_internal.h"
#include "common/log.h"
#include "common/util.h"
#include "controller/advantages.h"
#include "controller/run_internal.h"
#include "trainer/checkpoint.h"

typedef rf__tworker tworker;

#define samples_free rf__worker_samples_free
#define unpack rf__worker_unpack

/* The replicas a score pass is spread over (each its share): the first m, those holding every
 * model asked for (placement.reference.dp, placement.critic.dp, placement.reward.dp); 1:
 * replica 0 alone. */
static int score_replicas(const tworker *w, int flags) {
    int m = w->dpc ? rf_comm_size(w->dpc) : 1;
    for (int role = RF_ROLE_REFERENCE; role <= RF_ROLE_REWARD; role++) {
        int dp, tp;
        rf_recipe_role_layout(w->r, role, &dp, &tp);
        if ((flags & (1 << role)) && dp < m) m = dp;
    }
    return m;
}

/* items[0..n) (NULL ones skipped) joined into buf as "a", "a and b", "a, b and c". */
static void join_words(char *buf, size_t cap, const char *const *items, int n) {
    int count = 0, k = 0;
    for (int i = 0; i < n; i++) count += items[i] != NULL;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (!items[i]) continue;
        size_t at = strlen(buf);
        k++;
        snprintf(buf + at, cap - at, "%s%s", k == 1 ? "" : k == count ? " and " : ", ", items[i]);
    }
}

/* The first ScoreRequest of each kind: where its passes ran, and which models were split over how many
 * tensor-parallel ranks ("all split over 2", "the critic split over 2", "the reference split
 * over 2 and the critic over 4"). */
static void log_score_layout(const tworker *w, int flags) {
    int spread = score_replicas(w, flags), split = w->tpc ? rf__tp_split_flags(w, flags) : 0;
    static const char *const asked[3] = {"reference log-probs", "values", "reward-model scores"};
    int tpn[3] = {split & RF_SCORE_REF ? w->ref_tp->tp : 0, split & RF_SCORE_VALUES ? w->critic_tp->tp : 0,
                  split & RF_SCORE_RM ? rf_reward_model_split(w->rm) : 0};
    const char *what_items[3], *split_items[3];
    char per[3][64], what[96], tps[256] = "";
    int first = -1, same = 1;
    for (int i = 0; i < 3; i++) {
        what_items[i] = flags & (1 << i) ? asked[i] : NULL;
        split_items[i] = NULL;
        if (!tpn[i]) continue;
        if (first < 0) first = i;
        same &= tpn[i] == tpn[first];
    }
    join_words(what, sizeof what, what_items, 3);
    if (first >= 0 && same && split == flags) {
        snprintf(tps, sizeof tps, ", all split over %d tensor-parallel ranks", tpn[first]);
    } else if (first >= 0) {
        for (int i = 0; i < 3; i++) /* "the reference and the critic split over 2", or each its own count */
            if (tpn[i]) {
                if (same) snprintf(per[i], sizeof per[i], "the %s", rf_recipe_role_name(i));
                else snprintf(per[i], sizeof per[i], "the %s %s %d", rf_recipe_role_name(i), i == first ? "split over" : "over",
                              tpn[i]);
                split_items[i] = per[i];
            }
        char list[160];
        join_words(list, sizeof list, split_items, 3);
        if (same) snprintf(tps, sizeof tps, ", %s split over %d tensor-parallel ranks", list, tpn[first]);
        else snprintf(tps, sizeof tps, ", %s tensor-parallel ranks", list);
    }
    rf_log_info("training worker: scoring %s on %d data-parallel replica%s%s", what, spread,
                spread > 1 ? "s (token-balanced shares)" : "", tps);
}

static rf_status score(tworker *w, const Rlflow__ScoreRequest *q) {
    int n = (int)q->n_samples;
    rf_train_sample *s = NULL;
    rf_status ust = unpack(q->samples, q->n_samples, &s);
    if (ust != RF_OK)
        return rf_error_wrap(ust, "the controller's ScoreRequest %llu", (unsigned long long)q->request_id);
    Rlflow__FloatSeq *ref = calloc((size_t)(n ? n : 1), sizeof *ref), *val = calloc((size_t)(n ? n : 1), sizeof *val);
    Rlflow__FloatSeq **refp = malloc(sizeof *refp * (size_t)(n ? n : 1)), **valp = malloc(sizeof *valp * (size_t)(n ? n : 1));
    rf_status st = ref && val && refp && valp ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    Rlflow__ScoreResponse resp = RLFLOW__SCORE_RESPONSE__INIT;
    resp.request_id = q->request_id;
    int flags = (q->want_ref_logp ? RF_SCORE_REF : 0) | (q->want_values ? RF_SCORE_VALUES : 0) |
                (q->want_rm_score ? RF_SCORE_RM : 0);
    if (st == RF_OK && q->want_ref_logp && !rf_recipe_reference_enabled(w->r))
        st = rf_error(RF_ERR_ARG, "ScoreRequest asks for reference log-probs, the recipe has no reference");
    if (st == RF_OK && q->want_values && !rf__worker_has_critic(w))
        st = rf_error(RF_ERR_ARG, "ScoreRequest asks for values, the recipe has no critic");
    if (st == RF_OK && q->want_rm_score && !w->rm)
        st = rf_error(RF_ERR_ARG, "ScoreRequest asks for reward-model scores, the recipe has no reward.model");
    Rlflow__TrainBatch b = RLFLOW__TRAIN_BATCH__INIT;
    b.n_samples = q->n_samples, b.samples = q->samples;
    int m = score_replicas(w, flags);
    if (st == RF_OK && flags)
        st = m > 1 ? rf__dp_score(w, &b, s, flags, m) : rf__worker_score_share(w, &b, 0, (size_t)n, s, flags);
    /* once per kind of request (validation asks for reward-model scores alone, training for more) */
    if (st == RF_OK && flags && !(w->scored & (1u << flags))) w->scored |= 1u << flags, log_score_layout(w, flags);
    for (int i = 0; st == RF_OK && i < n; i++) {
        rlflow__float_seq__init(&ref[i]), rlflow__float_seq__init(&val[i]);
        ref[i].n_v = val[i].n_v = (size_t)s[i].n_resp;
        ref[i].v = s[i].ref_logp, val[i].v = s[i].values;
        refp[i] = &ref[i], valp[i] = &val[i];
    }
    if (st == RF_OK && q->want_ref_logp) resp.n_ref_logp = (size_t)n, resp.ref_logp = refp;
    if (st == RF_OK && q->want_values) resp.n_values = (size_t)n, resp.values = valp;
    float *rm = NULL;
    if (st == RF_OK && q->want_rm_score) {
        rm = malloc(sizeof(float) * (size_t)(n ? n : 1));
        if (!rm) st = rf_error(RF_ERR_NOMEM, "out of memory");
        for (int i = 0; rm && i < n; i++) rm[i] = s[i].rm_score;
        resp.n_rm_scores = st == RF_OK ? (size_t)n : 0, resp.rm_scores = rm;
    }
    if (st == RF_OK) st = rf_msg_link_send(w->link, RF_MSG_SCORE_RESPONSE, &resp.base);
    free(ref), free(val), free(refp), free(valp), free(rm);
    samples_free(s, n);
    return st;
}

/* Waits for the previous weight transfer, giving up when the controller stops the run (a
 * rollout worker that is gone never completes it). */
static rf_status transfers_done(tworker *w) {
    double deadline = rf_time_now() + w->r->async.peer_timeout;
    for (;;) {
        int t = rf_weights_tx_test(w->tx);
        if (t < 0) return rf_error_wrap(RF_ERR_IO, "sending weights");
        if (t) return RF_OK;
        if (rf_msg_link_shutdown_seen(w->link))
            return rf_error(RF_ERR_IO, "the controller stopped the run while weights were on their way to the rollout workers");
        if (rf_time_now() > deadline)
            return rf_error(RF_ERR_IO, "the rollout workers did not take weights version %d within %.0f s (async.peer_timeout)",
                            w->version - 1, w->r->async.peer_timeout);
        RF_TRY(rf__dp_keepalive(w));
        rf_sleep(0.0002);
    }
}

/* Floats sent to the rollout workers each update: the whole actor's (tensor parallelism: the
 * whole model's, not the shard's), or under LoRA its adapters (the base is frozen). */
static size_t actor_floats(const tworker *w) {
    if (w->tp && w->tp->lora_views) { /* the whole adapters' table: the last one ends it */
        const rf_param_view *v = &w->tp->lora_views[w->tp->n_lora_views - 1];
        return v->offset + v->numel;
    }
    return w->tp ? w->tp->full_params : w->actor->n_params - w->actor->n_frozen;
}

/* WeightsUpdate: the version and checksum the rollout workers must report serving. */
static rf_status announce(tworker *w) {
    Rlflow__WeightsUpdate wu = RLFLOW__WEIGHTS_UPDATE__INIT;
    wu.version = w->version, wu.checksum = w->crc, wu.n_bytes = actor_floats(w) * sizeof(float);
    return rf_msg_link_send(w->link, RF_MSG_WEIGHTS_UPDATE, &wu.base);
}

static rf_status publish_weights(tworker *w) {
    if (w->wrs) {
        /* with the TP peers: the checksum from the shards, then resharding to every rollout
         * worker (the first transfer waits for workers still starting) */
        int first = !w->tp_serving;
        RF_TRY(rf__tp_publish(w, first ? w->r->async.startup_timeout : w->r->async.peer_timeout, announce));
        if (first && w->ho)
            rf_log_info("training worker: weights version %d (CRC-32C %08x) handed to the rollout rank in each training "
                        "rank's process (%s)", w->version, w->crc, rf_weights_rs_zero_copy(w->wrs) ?
                        "identical layouts: zero-copy, the rollout ranks read the training shards" :
                        "resharded in place from the training layout");
        else if (first)
            rf_log_info("training worker: weights version %d (CRC-32C %08x) resharded from %d shards%s to the rollout workers%s",
                        w->version, w->crc, w->tp ? w->tp->tp : 1, w->tp && w->dpc ? " of every data-parallel replica" : "",
                        (w->tp ? w->tp->lora_views != NULL : w->actor->n_frozen > 0) ? " (LoRA: the adapters alone)"
                                                                                       : "");
        w->tp_serving = 1;
        return RF_OK;
    }
    RF_TRY(transfers_done(w));
    RF_TRY(rf_weights_tx_start(w->tx, w->wcomm, w->actor, w->version, w->rollout, w->n_rollout,
                               w->r->async.peer_timeout, &w->crc));
    if (w->actor->n_frozen && !w->lora_told++)
        rf_log_info("training worker: LoRA: weights version %d sent as the adapters alone (%.2f MB, CRC-32C %08x; the "
                    "frozen base, %.2f MB, stays on the rollout workers)", w->version,
                    (double)actor_floats(w) * 4e-6, w->crc, (double)w->actor->n_frozen * 4e-6);
    return announce(w);
}

/* Tensor parallelism: the TP peers get the samples [lo, hi) this rank trains on (the whole
 * batch, or its replica's shares; sh: the models' ranges in b; with DP every rank trains
 * whenever the batch has samples). */
static rf_status share_with_tp(tworker *w, const Rlflow__TrainBatch *b, size_t lo, size_t hi, const rf__share *sh) {
    uint8_t *buf = NULL;
    uint64_t bytes = 0;
    RF_TRY(rf__worker_pack_part(b, lo, hi, &buf, &bytes));
    int64_t o = (int64_t)lo;
    rf__share rel = {sh->a_lo - o, sh->a_hi - o, sh->c_lo - o, sh->c_hi - o};
    rf_status st = rf__tp_share(w, buf, bytes, w->dpc ? b->n_samples > 0 : -1, &rel);
    free(buf);
    return st;
}

static rf_status train(tworker *w, const Rlflow__TrainBatch *b) {
    const rf_recipe *r = w->r;
    if (b->policy_version != w->version)
        return rf_error(RF_ERR_FORMAT, "TrainBatch %llu is for policy version %lld, the actor is at %d",
                        (unsigned long long)b->batch_id, (long long)b->policy_version, w->version);
    double t0 = rf_time_now();
    int n = (int)b->n_samples;
    rf_train_sample *s = NULL;
    rf_status ust = unpack(b->samples, b->n_samples, &s); /* checks every sample, the peers' too */
    if (ust != RF_OK)
        return rf_error_wrap(ust, "the controller's TrainBatch %llu", (unsigned long long)b->batch_id);
    /* data parallel: the peers (replicas) get their shares; this rank (replica) keeps [lo, hi):
     * the actor's share and the critic's (sh) */
    size_t lo = 0, hi = b->n_samples;
    rf__share sh = {0, n, 0, n};
    rf_status st = w->dpc ? rf__dp_scatter(w, b, &lo, &hi, &sh) : RF_OK;
    if (st == RF_OK && w->tpc) st = share_with_tp(w, b, lo, hi, &sh);
    rf_update_stats as = {0}, cs = {0};
    double tp = 0, ta = 0, wait0 = w->dp_actor ? rf_dp_get_stats(w->dp_actor)->wait_s : 0;
    double comm0 = w->tp ? w->tp->comm_s : 0;
    if (st == RF_OK && n > 0) st = rf__worker_update(w, s, &sh, b->kl_coef, &as, &cs, &tp, &ta);
    samples_free(s, n);
    if (st != RF_OK) return st;
    w->version++;
    RF_TRY(publish_weights(w));
    rf__update_metrics(w->metrics, r, &as, rf__worker_has_critic(w) ? &cs : NULL);
    rf_metrics_set(w->metrics, "perf/train_tokens_per_s", (double)as.tokens / fmax(ta, 1e-9));
    rf_metrics_set(w->metrics, "perf/prox_s", tp);
    rf_metrics_set(w->metrics, "perf/weights_mb", (double)actor_floats(w) * 4.0 / 1e6);
    if (w->dp_actor) /* the actor's gradient reduction not hidden behind backward, this rank */
        rf_metrics_set(w->metrics, "perf/dp_wait_s", rf_dp_get_stats(w->dp_actor)->wait_s - wait0);
    if (w->tp) /* the actor model's collectives during the update, rank 0 (waits for the peers included) */
        rf_metrics_set(w->metrics, "perf/tp_comm_s", w->tp->comm_s - comm0);
    int nm = rf_metrics_count(w->metrics);
    Rlflow__TrainStats__MetricsEntry *e = calloc((size_t)(nm ? nm : 1), sizeof *e);
    Rlflow__TrainStats__MetricsEntry **ep = calloc((size_t)(nm ? nm : 1), sizeof *ep);
    if (!e || !ep) {
        free(e), free(ep);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < nm; i++) {
        rlflow__train_stats__metrics_entry__init(&e[i]);
        double v;
        e[i].key = (char *)rf_metrics_at(w->metrics, i, &v);
        e[i].value = v;
        ep[i] = &e[i];
    }
    Rlflow__TrainStats ts = RLFLOW__TRAIN_STATS__INIT;
    ts.batch_id = b->batch_id, ts.policy_version = w->version;
    ts.n_metrics = (size_t)nm, ts.metrics = ep;
    ts.seconds = rf_time_now() - t0;
    st = rf_msg_link_send(w->link, RF_MSG_TRAIN_STATS, &ts.base);
    free(e), free(ep);
    rf_metrics_commit(w->metrics, w->version); /* clears the step's values (no files) */
    return st;
}

static rf_status checkpoint(tworker *w, const Rlflow__CheckpointRequest *q) {
    const rf_recipe *r = w->r;
    double t = rf_time_now();
    rf_ckpt_state cs = {.step = (int)q->step, .pos = {q->data_epoch, (int)q->data_index}, .kl_beta = q->kl_coef,
                        .best_val = q->best_val, .admitted = q->admitted};
    Rlflow__CheckpointDone d = RLFLOW__CHECKPOINT_DONE__INIT;
    d.step = q->step;
    rf_status st = RF_OK;
    if (q->step != w->version)
        st = rf_error(RF_ERR_FORMAT, "CheckpointRequest for step %lld, the actor is at %d", (long long)q->step, w->version);
    /* tensor parallelism: each tensor gathered from the shards as it is written; ZeRO-1: each
     * moment tensor (or shard block) from the DP group's blocks (the peers told first) */
    if (st == RF_OK && w->dpc) st = rf__dp_checkpoint_begin(w);
    if (st == RF_OK && w->tpc) st = rf__tp_checkpoint_save(w, &cs);
    else if (st == RF_OK && rf__dp_zero_moments(w, 0)) st = rf__dp_checkpoint_save(w, &cs);
    else if (st == RF_OK)
        st = rf_checkpoint_save(r->logging.dir, w->actor, w->critic, r->model.path, &cs, r->checkpoint.keep);
    if (st == RF_OK && w->tpc)
        rf_log_info("training worker: checkpoint of step %d gathered from %d shards (the weights sent as version %d, "
                    "CRC-32C %08x), tensor by tensor", w->version, w->tp->tp, w->version, w->crc);
    d.seconds = rf_time_now() - t;
    d.error = st == RF_OK ? "" : (char *)rf_error_message();
    rf_status sst = rf_msg_link_send(w->link, RF_MSG_CHECKPOINT_DONE, &d.base);
    return st != RF_OK ? st : sst;
}

static rf_status serve(tworker *w) {
    RF_TRY(publish_weights(w)); /* the rollout workers start from the actor's weights */
    for (;;) {
        int sent = w->tx ? rf_weights_tx_test(w->tx) : 1; /* resharding (tp) is done when it returns */
        if (sent < 0) return rf_error_wrap(RF_ERR_IO, "sending weights");
        int pending = !sent;
        rf_msg m;
        int got = 0;
        /* while weights are on their way, come back often to progress MPI */
        RF_TRY(rf_msg_link_recv(w->link, pending ? 0.0001 : 0.05, &m, &got));
        RF_TRY(rf__dp_keepalive(w));
        RF_TRY(rf__tp_keepalive(w));
        if (!got) continue;
        double t = rf_time_now();
        rf_status st = RF_OK;
        int done = 0;
        switch (m.type) {
        case RF_MSG_SCORE_REQUEST: st = score(w, (Rlflow__ScoreRequest *)m.pb); break;
        case RF_MSG_TRAIN_BATCH:
            if (w->delay_ms > 0) rf_sleep(rf_rng_uniform(&w->delay_rng) * w->delay_ms * 1e-3); /* tests only */
            st = train(w, (Rlflow__TrainBatch *)m.pb);
            break;
        case RF_MSG_CHECKPOINT_REQUEST: st = checkpoint(w, (Rlflow__CheckpointRequest *)m.pb); break;
        case RF_MSG_SHUTDOWN: {
            const char *why = ((Rlflow__Shutdown *)m.pb)->reason;
            done = 1;
            if (!RF_MSG_SHUTDOWN_CLEAN(why))
                st = rf_error(RF_ERR_IO, "the controller stopped the run: %s", why ? why : "");
            break;
        }
        default: st = rf_error(RF_ERR_FORMAT, "the controller sent the training worker %s", rf_msg_type_name(m.type));
        }
        w->busy += rf_time_now() - t;
        rf_msg_free(&m);
        if (st != RF_OK) return st;
        if (done) return RF_OK; /* a transfer still pending is cancelled on free */
    }
}

rf_status rf_train_worker_main(const rf_recipe *r, const rf_msg_dial *dial, int resume,
                               rf_comm *wcomm, const int *rollout, int n_rollout, rf_comm *dpc,
                               rf_comm *tpc, rf_handover *ho) {
    tworker w = {.r = r, .wcomm = wcomm, .rollout = rollout, .n_rollout = n_rollout, .ho = ho,
                 .delay_ms = rf_test_delay_ms("RF_TEST_DELAY_TRAIN_MS"), .dpc = dpc, .tpc = tpc};
    rf_rng_seed(&w.delay_rng, 0x2545f4914f6cdd1dull);
    w.k = rf_kernels_for(r->model.device);
    if (!w.k) return rf_error_wrap(RF_ERR_NODEVICE, "model.device = \"%s\"", r->model.device);
    RF_TRY(rf_kernels_apply_precision(w.k, r->model.precision, "model.precision", NULL));
    rf_adv_kind kind;
    rf_status st = rf_adv_kind_parse(r->algorithm.name, &kind);
    if (st == RF_OK) st = rf_loss_agg_parse(r->algorithm.loss_agg, &w.agg);
    if (st == RF_OK) st = rf_kl_est_parse(r->algorithm.kl_estimator, &w.kl_est);
    /* whole here unless split over tensor-parallel ranks (then every rank reads its shards) */
    if (st == RF_OK && !w.tpc) st = rf__worker_actor_load(&w);
    if (st == RF_OK && rf_recipe_reference_enabled(r) && !rf__worker_split_tp(&w, RF_ROLE_REFERENCE))
        st = rf__worker_ref_load(&w);
    if (st == RF_OK && kind == RF_ADV_GAE && !rf__worker_split_tp(&w, RF_ROLE_CRITIC)) {
        st = rf_model_load(&w.critic, r->critic.path[0] ? r->critic.path : r->model.path, w.k, 1);
        if (st == RF_OK) st = rf_model_enable_training(w.critic);
    }
    if (st == RF_OK && rf__worker_has_rm(&w) && !rf__worker_split_tp(&w, RF_ROLE_REWARD))
        st = rf_reward_model_open(&w.rm, r->reward.model, w.k);
    if (st == RF_OK && resume) {
        /* the whole models' parameters and the state; their moments here unless ZeRO-1 shards
         * them, when every DP rank reads its own blocks (rf__dp_setup): no rank holds them whole */
        rf_ckpt_state cs = {0};
        int moments = (rf__dp_zero_reads(&w, 0) ? 0 : 1) | (rf__dp_zero_reads(&w, 1) ? 0 : 2);
        st = rf_checkpoint_load_parts(r->logging.dir, w.actor, w.critic, moments, &cs, w.ckpt_dir, sizeof w.ckpt_dir);
        w.version = cs.step, w.actor_steps = cs.actor_opt_steps, w.critic_steps = cs.critic_opt_steps;
    }
    /* tensor parallel: every rank reads its shards (this rank shard 0) */
    if (w.tpc) st = rf__tp_setup(&w, st);
    /* data parallel: the peers (with tp: every replica's shards) start from this rank's state
     * (they stop too if it failed) */
    if (w.dpc) st = rf__dp_setup(&w, st);
    if (st == RF_OK) st = rf_metrics_open(&w.metrics, NULL, 0, 0);
    if (st == RF_OK && !w.tp)
        st = r->placement.rollout.tp > 1 || ho ? rf__rs_whole_setup(&w) : rf_weights_tx_init(&w.tx, w.actor);
    rf_msg_client_config cc = {.role = RLFLOW__ROLE__ROLE_ACTOR, .rank = 0,
                               .capacity = 1, .name = "train", .timeout_s = r->async.startup_timeout};
    rf_msg_dial_apply(dial, &cc);
    if (st == RF_OK) st = rf_msg_link_open(&w.link, &cc, r->async.peer_timeout);
    if (st == RF_OK) st = serve(&w);
    if (st != RF_OK) rf_msg_link_tell_error(&w.link, &cc, r->async.peer_timeout, st);
    else if (w.link) rf_msg_link_flush(w.link, 5.0);
    if (w.dp_actor) rf__dp_stop(&w, st != RF_OK);
    rf__tp_stop(&w, st != RF_OK);
    rf__dp_free(&w);
    rf__tp_free(&w);
    rf_msg_link_close(w.link);
    rf_weights_tx_free(w.tx);
    rf_metrics_close(w.metrics);
    rf_model_free(w.ref), rf_model_free(w.actor), rf_model_free(w.critic); /* the reference may borrow the actor's base */
    rf_reward_model_close(w.rm);
    return st;
}
