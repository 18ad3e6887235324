/* The controller's event loop for split runs. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/buffer.h"
#include "controller/controller.h"
#include "controller/episodes_split.h"
#include "controller/interrupt.h"
#include "controller/run_internal.h"
#include "trainer/checkpoint.h"

#define MAX_ROLLOUT 4096 /* rollout_peer is 240 bytes: 960 KiB of controller state (calloc) */
#define VERSION_RING 256

typedef struct group {
    int64_t id;             /* admission id (buffer); -1 for validation */
    uint64_t req;           /* GenerateRequest id */
    const rf_example *ex;
    rf_dataset_pos pos;     /* data position before this prompt */
    rf_train_sample *s;     /* (n) */
    int n, n_done, worker;  /* worker: index into ctl.rw */
    int min_version;
    int scoring;            /* a ScoreRequest is out */
    int score_deferred;     /* its ScoreRequest waits for generation to pause (ctl.turns) */
    double score_sent;      /* when it was sent (rf_time_now) */
    struct group *next, *prev; /* the live list */
    struct group *hnext;    /* the request-id hash chain */
} group;

#define UNVERIFIED_MAX 16

typedef struct rollout_peer {
    int peer, rank, version, groups; /* groups in flight */
    uint32_t crc;
    /* versions this worker serves whose WeightsUpdate has not arrived yet (the two come over
     * different connections): checked when it does */
    int64_t unv_version[UNVERIFIED_MAX];
    uint32_t unv_crc[UNVERIFIED_MAX];
    int n_unv;
    double busy, wall;               /* as of the last WeightsLoaded */
} rollout_peer;

typedef struct ctl {
    rf_run run;           /* recipe, tokenizer, data, rewards, metrics, step, KL, position */
    rf_msg_server *srv;
    rf_buffer *buf;
    group *live;          /* admitted or validation groups not yet in the buffer */
    group **bucket;       /* (n_bucket, a power of 2) live groups by request id */
    int n_bucket;
    int *rw_of_peer;      /* (n_peer_ids) index into rw by server peer id, -1: not a rollout worker */
    int n_peer_ids;
    int served;           /* the oldest version any rollout worker serves (-1: not all have weights) */
    int n_rollout_want;
    rollout_peer rw[MAX_ROLLOUT];
    int n_rw, train_peer;
    int cap;              /* buffer capacity in groups */
    uint64_t next_req;
    /* versions: checksums the training worker announced, by version modulo the ring */
    int64_t ver_of[VERSION_RING];
    uint32_t crc_of[VERSION_RING];
    double announced_at[VERSION_RING]; /* when the WeightsUpdate arrived */
    double weights_latency, weights_load;
    double score_wait; int score_n; /* ScoreRequest round trips answered since the last step */
    /* colocated on CUDA with generation tensor parallelism: generation and scoring take turns
     * (score_turns), so the rollout and training threads never issue NCCL collectives on a
     * device at once */
    int turns;
    int scores_out, scores_deferred; /* ScoreRequests out, and waiting for generation to pause */
    int scores_held;                 /* ScoreRequests held back since the last step (metrics) */
    int batch_out;        /* a TrainBatch is at the training worker */
    double batch_sent_at, train_busy, train_busy0;
    double mean_kl;
    int ckpt_out;         /* CheckpointRequests not yet done */
    int ckpt_last;        /* the step of the last CheckpointRequest (-1: none) */
    int stop_ckpt;        /* SIGINT / SIGTERM: the stop's checkpoint is requested */
    double last_progress; /* when the last step, sample, score or weights report came */
    /* validation */
    int val_version, val_next, val_out, val_n;
    double val_acc, val_len, val_reward; /* sums over the validation responses back so far */
    int final_val_done;
    /* per step */
    double gen_tokens, last_step_at;
    /* reward programs' named components since the last batch: mean of the groups' means */
    int64_t dropped_dynamic, dyn_since_batch;
    rf_split_eps *eps;    /* [env]: the episodes the rollout workers run (controller/episodes_split.h) */
} ctl;

static int g_interrupted; /* the last rf_controller_main stopped on a signal, its checkpoint written */

int rf_controller_interrupted(void) { return g_interrupted; }

static void group_free(group *g) {
    if (!g) return;
    for (int i = 0; g->s && i < g->n; i++) rf_train_sample_free(&g->s[i]);
    free(g->s);
    free(g);
}

static group **bucket_of(ctl *c, uint64_t req) { return &c->bucket[req & (uint64_t)(c->n_bucket - 1)]; }

static void unlink_group(ctl *c, group *g) {
    if (g->prev) g->prev->next = g->next; else if (c->live == g) c->live = g->next;
    if (g->next) g->next->prev = g->prev;
    g->next = g->prev = NULL;
    for (group **p = bucket_of(c, g->req); *p; p = &(*p)->hnext)
        if (*p == g) {
            *p = g->hnext;
            break;
        }
    g->hnext = NULL;
}

static group *find_group(ctl *c, uint64_t req) {
    for (group *g = *bucket_of(c, req); g; g = g->hnext)
        if (g->req == req) return g;
    return NULL;
}

static rollout_peer *find_rw(ctl *c, int peer) {
    if (peer < 0 || peer >= c->n_peer_ids || c->rw_of_peer[peer] < 0) return NULL;
    return &c->rw[c->rw_of_peer[peer]];
}

static int served_version(const ctl *c) { return c->served; }

/* Recomputed when a worker reports a version (once per worker and version). */
static void update_served(ctl *c) {
    int v = INT32_MAX;
    for (int i = 0; i < c->n_rw; i++)
        if (c->rw[i].version < v) v = c->rw[i].version;
    c->served = c->n_rw < c->n_rollout_want || !c->n_rw ? -1 : v;
}

static const char *peer_desc(ctl *c, int peer) {
    const rf_msg_peer_info *i = rf_msg_server_peer(c->srv, peer);
    return i ? i->desc : "a worker";
}

/* ---- generation ----------------------------------------------------------------------- */

/* Groups (training and validation) some rollout worker is generating. */
static int gen_in_flight(const ctl *c) {
    int n = 0;
    for (int i = 0; i < c->n_rw; i++) n += c->rw[i].groups;
    return n;
}

/* With ctl.turns: no generation starts while a ScoreRequest is out or waiting. */
static int scoring_has_turn(const ctl *c) { return c->turns && (c->scores_out > 0 || c->scores_deferred > 0); }

static rf_status send_generate(ctl *c, group *g, int greedy) {
    const rf_recipe *r = c->run.r;
    int best = 0;
    for (int i = 1; i < c->n_rw; i++)
        if (c->rw[i].groups < c->rw[best].groups) best = i;
    Rlflow__SamplingParams sp = RLFLOW__SAMPLING_PARAMS__INIT;
    sp.temperature = (float)r->rollout.temperature, sp.top_k = r->rollout.top_k;
    sp.top_p = (float)r->rollout.top_p, sp.max_new_tokens = r->rollout.max_new_tokens;
    /* the group's seed as the one-process loop gives it: its batch and place there (validation,
     * greedy, the first) */
    int P = r->rollout.prompts_per_step;
    sp.seed = g->id < 0 ? rf__group_seed(r, 0, 0, 0) : rf__group_seed(r, (int)(g->id / P), 0, (int)(g->id % P));
    Rlflow__GenerateRequest q = RLFLOW__GENERATE_REQUEST__INIT;
    q.request_id = g->req, q.n_prompt_ids = (size_t)g->ex->n_prompt, q.prompt_ids = g->ex->prompt_ids;
    q.n = g->n, q.sampling = &sp, q.group_id = g->id, q.greedy = greedy;
    q.min_version = served_version(c);
    if (c->eps) RF_TRY(rf_split_eps_begin(c->eps, &q, g->ex, g->n, g->id)); /* [env]: reset, first observations */
    g->worker = best;
    c->rw[best].groups++;
    rf_status st = rf_msg_server_send(c->srv, c->rw[best].peer, RF_MSG_GENERATE_REQUEST, &q.base);
    return st == RF_OK ? RF_OK : rf_error_wrap(st, "sending a GenerateRequest");
}

static group *new_group(ctl *c, const rf_example *ex, int n) {
    group *g = calloc(1, sizeof *g);
    if (g) g->s = calloc((size_t)n, sizeof *g->s);
    if (!g || !g->s) {
        free(g);
        rf_error(RF_ERR_NOMEM, "out of memory");
        return NULL;
    }
    g->ex = ex, g->n = n, g->req = ++c->next_req, g->min_version = INT32_MAX;
    g->next = c->live;
    if (c->live) c->live->prev = g;
    c->live = g;
    group **b = bucket_of(c, g->req);
    g->hnext = *b;
    *b = g;
    return g;
}

/* Admits prompts while the staleness bound and the buffer allow. */
static rf_status admit(ctl *c) {
    const rf_recipe *r = c->run.r;
    int served = served_version(c);
    if (served < 0 || c->run.step >= r->train.steps || scoring_has_turn(c)) return RF_OK;
    /* stop admitting once every batch still to train is covered */
    while (rf_buffer_can_admit(c->buf, served) &&
           rf_buffer_consumed(c->buf) + rf_buffer_depth(c->buf) + rf_buffer_in_flight(c->buf) <
               (int64_t)r->train.steps * r->rollout.prompts_per_step + c->dropped_dynamic +
                   rf_buffer_stale_dropped(c->buf)) {
        rf_dataset_pos before = c->run.pos;
        const rf_example *ex;
        RF_TRY(rf_dataset_next(c->run.train, &c->run.pos, 1, &ex));
        group *g = new_group(c, ex, r->rollout.n);
        if (!g) return RF_ERR_NOMEM;
        g->pos = before;
        g->id = rf_buffer_admit(c->buf, served);
        RF_TRY(send_generate(c, g, 0));
    }
    return RF_OK;
}

/* ---- validation ----------------------------------------------------------------------- */

static int val_due(const ctl *c, int v) {
    const rf_recipe *r = c->run.r;
    if (!c->run.val || v < c->val_next) return 0;
    return v == 0 || rf__val_due(r, v);
}

static rf_status start_validation(ctl *c) {
    const rf_recipe *r = c->run.r;
    int served = served_version(c);
    if (c->val_out || served < 0 || !val_due(c, served) || scoring_has_turn(c)) return RF_OK;
    int n = rf_dataset_size(c->run.val);
    if (r->logging.val_size < n) n = r->logging.val_size;
    rf_dataset_pos p = {0, 0};
    for (int i = 0; i < n; i++) {
        const rf_example *ex;
        RF_TRY(rf_dataset_next(c->run.val, &p, 1, &ex));
        group *g = new_group(c, ex, 1);
        if (!g) return RF_ERR_NOMEM;
        g->id = -1;
        RF_TRY(send_generate(c, g, 1));
    }
    c->val_version = served, c->val_next = served + 1, c->val_out = n, c->val_n = n;
    c->val_acc = c->val_len = c->val_reward = 0;
    return RF_OK;
}

static void finish_validation(ctl *c) {
    double acc = c->val_acc / (c->val_n ? c->val_n : 1), len = c->val_len / (c->val_n ? c->val_n : 1);
    rf__val_metrics(&c->run, acc, c->val_reward / (c->val_n ? c->val_n : 1), len);
    rf_metrics_set(c->run.metrics, "val/version", c->val_version);
    if (acc > c->run.best_val) c->run.best_val = acc;
    rf_log_info("validation at version %d: accuracy %.3f on %d prompts (%.1f s into the run)",
                c->val_version, acc, c->val_n, rf_time_now() - c->run.t_start);
    if (c->val_version >= c->run.r->train.steps) c->final_val_done = 1;
}

/* ---- samples -------------------------------------------------------------------------- */

static rf_status send_score(ctl *c, group *g) {
    const rf_recipe *r = c->run.r;
    int want_ref = c->run.ref != NULL || rf_recipe_reference_enabled(r);
    int want_val = c->run.adv_kind == RF_ADV_GAE, want_rm = r->reward.model[0] != '\0';
    Rlflow__TrainSample *ts = calloc((size_t)g->n, sizeof *ts);
    Rlflow__TrainSample **tp = calloc((size_t)g->n, sizeof *tp);
    if (!ts || !tp) {
        free(ts), free(tp);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < g->n; i++) {
        rlflow__train_sample__init(&ts[i]);
        ts[i].n_tokens = (size_t)(g->s[i].n_prompt + g->s[i].n_resp), ts[i].tokens = g->s[i].tokens;
        ts[i].n_prompt = g->s[i].n_prompt;
        tp[i] = &ts[i];
    }
    Rlflow__ScoreRequest q = RLFLOW__SCORE_REQUEST__INIT;
    q.request_id = g->req, q.n_samples = (size_t)g->n, q.samples = tp;
    q.want_ref_logp = want_ref, q.want_values = want_val, q.want_rm_score = want_rm;
    rf_status st = rf_msg_server_send(c->srv, c->train_peer, RF_MSG_SCORE_REQUEST, &q.base);
    free(ts), free(tp);
    g->scoring = 1, g->score_sent = rf_time_now();
    c->scores_out++;
    return st;
}

/* ctl.turns: the ScoreRequests held back are sent once no group is generating. */
static rf_status score_turns(ctl *c) {
    if (!c->scores_deferred || gen_in_flight(c) > 0) return RF_OK;
    for (group *g = c->live; g; g = g->next)
        if (g->score_deferred) {
            g->score_deferred = 0, c->scores_deferred--;
            RF_TRY(send_score(c, g));
        }
    return RF_OK;
}

/* External reward programs for a whole group (item i: sample i of group g->id). */
static rf_status external_reward(ctl *c, group *g) {
    return rf__external_score(&c->run, &g->ex, g->s, g->n, g->n, g->id);
}

static rf_status group_ready(ctl *c, group *g) {
    unlink_group(c, g);
    rf_status st = rf_buffer_put(c->buf, g, g->id, g->min_version);
    if (st != RF_OK) group_free(g);
    return st;
}

/* A group whose rewards are all in: dropped by dynamic sampling, or into the buffer. */
static rf_status group_scored(ctl *c, group *g) {
    const rf_recipe *r = c->run.r;
    if (r->algorithm.dynamic_sampling && !rf__group_informative(g->s, g->n) &&
        c->dyn_since_batch < (int64_t)r->algorithm.max_resample_rounds * r->rollout.prompts_per_step) {
        c->dropped_dynamic++, c->dyn_since_batch++;
        rf_buffer_discard(c->buf, g->id);
        rf_split_eps_dropped(c->eps, g->id);
        unlink_group(c, g);
        group_free(g);
        return RF_OK;
    }
    return group_ready(c, g);
}

/* Every sample of a training group is back: external rewards, then the training worker's
 * reference / critic / reward model when the recipe has them, then group_scored. */
static rf_status group_complete(ctl *c, group *g) {
    const rf_recipe *r = c->run.r;
    RF_TRY(external_reward(c, g));
    if (!rf_recipe_reference_enabled(r) && c->run.adv_kind != RF_ADV_GAE && !r->reward.model[0])
        return group_scored(c, g);
    if (c->turns && gen_in_flight(c) > 0) { /* sent by score_turns when generation pauses */
        g->score_deferred = 1, c->scores_deferred++, c->scores_held++;
        return RF_OK;
    }
    return send_score(c, g);
}

static uint32_t known_crc(const ctl *c, int64_t version, int *known) {
    int i = (int)(version % VERSION_RING);
    *known = c->ver_of[i] == version;
    return c->crc_of[i];
}

static rf_status on_sample(ctl *c, int peer, const Rlflow__Sample *m) {
    group *g = find_group(c, m->request_id);
    if (!g)
        return rf_error(RF_ERR_FORMAT, "%s sent a Sample for request %llu, which is not outstanding",
                        peer_desc(c, peer), (unsigned long long)m->request_id);
    int nr = (int)m->n_tokens;
    if (m->index < 0 || m->index >= g->n || g->s[m->index].tokens || nr < 1 ||
        m->n_logprobs != m->n_tokens || m->n_versions != m->n_tokens || (!c->eps && m->prompt_len != g->ex->n_prompt))
        return rf_error(RF_ERR_FORMAT, "%s sent a malformed Sample for request %llu (index %d, %d tokens, %zu log-probs, %zu versions, prompt %d)",
                        peer_desc(c, peer), (unsigned long long)m->request_id, m->index, nr,
                        m->n_logprobs, m->n_versions, m->prompt_len);
    /* the sample was finished by the weights the worker last reported loading (its Sample and
     * WeightsLoaded messages travel in order on one connection); those were checked against
     * the training worker's announcement */
    int64_t last = m->versions[nr - 1];
    rollout_peer *rp = find_rw(c, peer);
    /* [env]: an episode ends when the environment's answer comes, maybe after newer weights
     * arrived: its last token may be older than the version served (never newer) */
    if (!rp || (c->eps ? last > rp->version : last != rp->version) || m->weights_checksum != rp->crc)
        return rf_error(RF_ERR_FORMAT, "%s finished request %llu with weights version %lld, checksum %08x; it reported serving version %d, checksum %08x",
                        peer_desc(c, peer), (unsigned long long)m->request_id, (long long)last,
                        m->weights_checksum, rp ? rp->version : -1, rp ? rp->crc : 0);
    rf_train_sample *s = &g->s[m->index];
    s->group = 0;
    if (c->eps) RF_TRY(rf_split_eps_sample(c->eps, peer_desc(c, peer), m, g->ex, s)); /* [env] */
    else RF_TRY(rf__sample_init(&c->run, s, g->ex->prompt_ids, g->ex->n_prompt, m->tokens, m->logprobs, nr, m->text,
                                g->ex->answer));
    memcpy(s->prox_logp, m->logprobs, sizeof(float) * (size_t)nr);
    for (int t = 0; t < nr; t++) {
        s->versions[t] = (int)m->versions[t];
        if (s->versions[t] < g->min_version) g->min_version = s->versions[t];
    }
    c->gen_tokens += nr;
    if (++g->n_done < g->n) return RF_OK;
    if (g->worker >= 0 && g->worker < c->n_rw) c->rw[g->worker].groups--;
    if (g->id < 0) { /* validation: the training reward definition (rf__val_score) */
        rf_val_response v = {g->ex, s->text, s->tokens + s->n_prompt, nr,
                             c->eps ? rf_split_eps_last_text(c->eps, g->req, 0) : NULL};
        RF_TRY(rf__val_score(&c->run, &v, 1, &c->val_acc, &c->val_reward));
        rf_split_eps_forget(c->eps, g->req);
        c->val_len += nr;
        unlink_group(c, g);
        group_free(g);
        if (--c->val_out == 0) finish_validation(c);
        return RF_OK;
    }
    rf_split_eps_forget(c->eps, g->req);
    return group_complete(c, g);
}

static rf_status on_score(ctl *c, const Rlflow__ScoreResponse *m) {
    group *g = find_group(c, m->request_id);
    if (!g || !g->scoring)
        return rf_error(RF_ERR_FORMAT, "the training worker answered ScoreRequest %llu, which is not outstanding",
                        (unsigned long long)m->request_id);
    if (m->error && m->error[0])
        return rf_error(RF_ERR_IO, "the training worker could not score request %llu: %s", (unsigned long long)m->request_id, m->error);
    int want_ref = rf_recipe_reference_enabled(c->run.r), want_val = c->run.adv_kind == RF_ADV_GAE;
    int want_rm = c->run.r->reward.model[0] != '\0';
    if ((want_ref && m->n_ref_logp != (size_t)g->n) || (want_val && m->n_values != (size_t)g->n) ||
        (want_rm && m->n_rm_scores != (size_t)g->n))
        return rf_error(RF_ERR_FORMAT, "ScoreResponse %llu: %zu reference and %zu value sequences, %zu reward-model scores for %d samples",
                        (unsigned long long)m->request_id, m->n_ref_logp, m->n_values, m->n_rm_scores, g->n);
    for (int i = 0; i < g->n; i++) {
        rf_train_sample *s = &g->s[i];
        if ((want_ref && m->ref_logp[i]->n_v != (size_t)s->n_resp) || (want_val && m->values[i]->n_v != (size_t)s->n_resp))
            return rf_error(RF_ERR_FORMAT, "ScoreResponse %llu: sample %d has the wrong length", (unsigned long long)m->request_id, i);
        if (want_ref) memcpy(s->ref_logp, m->ref_logp[i]->v, sizeof(float) * (size_t)s->n_resp);
        if (want_val) memcpy(s->values, m->values[i]->v, sizeof(float) * (size_t)s->n_resp);
        if (want_rm) {
            if (!isfinite(m->rm_scores[i]))
                return rf_error(RF_ERR_RANGE, "ScoreResponse %llu: the reward model scored sample %d %g",
                                (unsigned long long)m->request_id, i, (double)m->rm_scores[i]);
            s->rm_score = m->rm_scores[i];
            s->reward += (float)c->run.r->reward.model_weight * m->rm_scores[i];
        }
    }
    g->scoring = 0, c->scores_out--;
    c->score_wait += rf_time_now() - g->score_sent, c->score_n++;
    return group_scored(c, g);
}

/* ---- training ------------------------------------------------------------------------- */

static void pack_sample(Rlflow__TrainSample *t, rf_train_sample *s, int group, int with_ref, int with_val) {
    rlflow__train_sample__init(t);
    t->n_tokens = (size_t)(s->n_prompt + s->n_resp), t->tokens = s->tokens, t->n_prompt = s->n_prompt;
    t->n_behav_logp = (size_t)s->n_resp, t->behav_logp = s->behav_logp;
    t->n_advantages = (size_t)s->n_resp, t->advantages = s->adv;
    t->n_returns = with_val ? (size_t)s->n_resp : 0, t->returns = s->returns;
    t->n_values = with_val ? (size_t)s->n_resp : 0, t->values = s->values;
    t->n_ref_logp = with_ref ? (size_t)s->n_resp : 0, t->ref_logp = s->ref_logp;
    t->reward = s->reward, t->group = group;
    if (s->loss_mask) t->loss_mask = (ProtobufCBinaryData){(size_t)s->n_resp, s->loss_mask}; /* [env] */
}

static rf_status try_train(ctl *c) {
    const rf_recipe *r = c->run.r;
    if (c->batch_out || c->run.step >= r->train.steps) return RF_OK;
    /* colocated on several devices: the rollout ranks generate with the weights training is
     * about to change (resharding/handover.h), so validation's greedy samples finish first, as
     * the one-process loop validates before it trains */
    if (c->val_out && rf_recipe_colocated_ranks(r)) return RF_OK;
    int P = r->rollout.prompts_per_step, n = r->rollout.n, cap = c->cap;
    void **taken = malloc(sizeof(void *) * (size_t)P), **stale = malloc(sizeof(void *) * (size_t)cap);
    if (!taken || !stale) {
        free(taken), free(stale);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    int n_stale = 0, depth = rf_buffer_depth(c->buf);
    int ok = rf_buffer_take(c->buf, c->run.step, taken, stale, cap, &n_stale);
    for (int i = 0; i < n_stale; i++) rf_split_eps_dropped(c->eps, ((group *)stale[i])->id), group_free(stale[i]);
    free(stale);
    if (!ok) {
        free(taken);
        return RF_OK;
    }
    rf_train_sample *s = calloc((size_t)(P * n), sizeof *s);
    Rlflow__TrainSample *ts = calloc((size_t)(P * n), sizeof *ts);
    Rlflow__TrainSample **tp = calloc((size_t)(P * n), sizeof *tp);
    const rf_example **exs = calloc((size_t)P, sizeof *exs); /* each group's example (sample logs) */
    int64_t *gids = calloc((size_t)P, sizeof *gids);         /* each group's admission id ([env] metrics) */
    rf_status st = s && ts && tp && exs && gids ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    int hist[64] = {0}, max_st = 0;
    double st_sum = 0;
    for (int gi = 0; st == RF_OK && gi < P; gi++) {
        group *g = taken[gi];
        for (int j = 0; j < n; j++) {
            s[gi * n + j] = g->s[j]; /* moved: the group keeps no pointers */
            s[gi * n + j].group = gi;
            int lag = c->run.step - g->s[j].versions[0];
            for (int t = 1; t < g->s[j].n_resp; t++)
                if (c->run.step - g->s[j].versions[t] > lag) lag = c->run.step - g->s[j].versions[t];
            if (lag < 0) lag = 0;
            hist[lag < 63 ? lag : 63]++, st_sum += lag;
            if (lag > max_st) max_st = lag;
        }
        exs[gi] = g->ex, gids[gi] = g->id;
        free(g->s);
        g->s = NULL;
        free(g);
    }
    free(taken);
    int count = P * n;
    double mean_kl = 0;
    int has_ref = rf_recipe_reference_enabled(r), with_val = c->run.adv_kind == RF_ADV_GAE;
    if (st == RF_OK) st = rf__advantages(r, c->run.adv_kind, c->run.kl.beta, has_ref, s, count, &mean_kl);
    if (st == RF_OK) {
        rf_metrics *mt = c->run.metrics;
        rf__batch_metrics(mt, r, s, count);
        if (has_ref) rf_metrics_set(mt, "actor/kl_ref", mean_kl);
        rf_metrics_set(mt, "actor/kl_coef", c->run.kl.beta);
        rf_metrics_set(mt, "async/staleness_mean", st_sum / count);
        rf_metrics_set(mt, "async/staleness_max", max_st);
        for (int k = 0; k <= r->async.max_staleness && k < 63; k++) {
            char name[64];
            snprintf(name, sizeof name, "async/staleness_frac_%d", k);
            rf_metrics_set(mt, name, (double)hist[k] / count);
        }
        rf_metrics_set(mt, "async/buffer_depth", depth);
        rf_metrics_set(mt, "async/in_flight_groups", rf_buffer_in_flight(c->buf));
        rf_metrics_set(mt, "async/stale_dropped", (double)rf_buffer_stale_dropped(c->buf));
        if (r->algorithm.dynamic_sampling) rf_metrics_set(mt, "rollout/dropped_groups", (double)c->dropped_dynamic);
        rf__external_metrics(&c->run, mt);
        rf_split_eps_metrics(c->eps, gids, P, mt);
        c->mean_kl = mean_kl;
        c->dyn_since_batch = 0;
        st = rf__log_samples(&c->run, c->run.step + 1, s, exs, count);
        for (int i = 0; i < count; i++) {
            pack_sample(&ts[i], &s[i], s[i].group, has_ref && !r->algorithm.kl_in_reward, with_val);
            tp[i] = &ts[i];
        }
        Rlflow__TrainBatch b = RLFLOW__TRAIN_BATCH__INIT;
        b.batch_id = (uint64_t)c->run.step, b.policy_version = c->run.step;
        b.n_samples = (size_t)count, b.samples = tp, b.kl_coef = c->run.kl.beta;
        if (st == RF_OK) st = rf_msg_server_send(c->srv, c->train_peer, RF_MSG_TRAIN_BATCH, &b.base);
        c->batch_out = 1, c->batch_sent_at = rf_time_now();
    }
    for (int i = 0; s && i < count; i++) rf_train_sample_free(&s[i]);
    free(s), free(ts), free(tp), free(exs), free(gids);
    return st;
}

static void older_pos(rf_dataset_pos *p, const group *g) {
    if (g->id >= 0 && (g->pos.epoch < p->epoch || (g->pos.epoch == p->epoch && g->pos.index < p->index))) *p = g->pos;
}

/* The data position to resume from: the oldest prompt admitted and not yet trained on, still
 * generating or scoring (live) or complete in the buffer. */
static rf_dataset_pos resume_pos(ctl *c) {
    rf_dataset_pos p = c->run.pos;
    for (group *g = c->live; g; g = g->next) older_pos(&p, g);
    for (int i = 0; i < rf_buffer_depth(c->buf); i++) older_pos(&p, rf_buffer_at(c->buf, i));
    return p;
}

static rf_status request_checkpoint(ctl *c) {
    rf_ckpt_state cs = rf__run_ckpt_state(&c->run, resume_pos(c)); /* the training worker writes it */
    Rlflow__CheckpointRequest q = RLFLOW__CHECKPOINT_REQUEST__INIT;
    q.step = cs.step, q.data_epoch = cs.pos.epoch, q.data_index = cs.pos.index;
    q.kl_coef = cs.kl_beta, q.best_val = cs.best_val;
    c->ckpt_out++, c->ckpt_last = c->run.step;
    return rf_msg_server_send(c->srv, c->train_peer, RF_MSG_CHECKPOINT_REQUEST, &q.base);
}

static rf_status on_train_stats(ctl *c, const Rlflow__TrainStats *m) {
    const rf_recipe *r = c->run.r;
    if (!c->batch_out || m->policy_version != c->run.step + 1)
        return rf_error(RF_ERR_FORMAT, "the training worker reported version %lld, expected %d",
                        (long long)m->policy_version, c->run.step + 1);
    c->batch_out = 0;
    c->train_busy += m->seconds;
    for (size_t i = 0; i < m->n_metrics; i++) rf_metrics_set(c->run.metrics, m->metrics[i]->key, m->metrics[i]->value);
    rf_kl_ctl_update(&c->run.kl, (float)c->mean_kl, r->rollout.prompts_per_step * r->rollout.n);
    c->run.step++;
    double now = rf_time_now(), dt = now - c->last_step_at;
    rf_metrics_set(c->run.metrics, "perf/step_s", dt);
    rf_metrics_set(c->run.metrics, "perf/gen_tokens_per_s", c->gen_tokens / fmax(dt, 1e-9));
    rf_metrics_set(c->run.metrics, "time/elapsed_s", now - c->run.t_start);
    rf_metrics_set(c->run.metrics, "idle/train", fmax(0.0, 1.0 - (c->train_busy - c->train_busy0) / fmax(dt, 1e-9)));
    double idle = 0;
    for (int i = 0; i < c->n_rw; i++) /* since each worker first had weights */
        idle += c->rw[i].wall > 0 ? fmax(0.0, 1.0 - c->rw[i].busy / c->rw[i].wall) : 0;
    rf_metrics_set(c->run.metrics, "idle/rollout", c->n_rw ? idle / c->n_rw : 0);
    rf_metrics_set(c->run.metrics, "perf/weights_latency_s", c->weights_latency);
    rf_metrics_set(c->run.metrics, "perf/weights_load_s", c->weights_load);
    if (c->score_n) rf_metrics_set(c->run.metrics, "perf/score_latency_s", c->score_wait / c->score_n);
    c->score_wait = 0, c->score_n = 0;
    if (c->turns) rf_metrics_set(c->run.metrics, "perf/scores_held", c->scores_held);
    c->scores_held = 0;
    c->train_busy0 = c->train_busy, c->gen_tokens = 0, c->last_step_at = now;
    int last = c->run.step == r->train.steps;
    if (rf__console_due(r, c->run.step)) rf__console(&c->run);
    if (!last) RF_TRY(rf_metrics_commit(c->run.metrics, c->run.step));
    if (rf__ckpt_due(r, c->run.step)) RF_TRY(request_checkpoint(c));
    return RF_OK;
}

static rf_status check_served(ctl *c, rollout_peer *p, int64_t version, uint32_t crc, uint32_t announced) {
    if (crc == announced) return RF_OK;
    return rf_error(RF_ERR_FORMAT, "%s serves weights version %lld with checksum %08x; the training worker sent %08x",
                    peer_desc(c, p->peer), (long long)version, crc, announced);
}

static rf_status on_weights_update(ctl *c, const Rlflow__WeightsUpdate *m) {
    int i = (int)(m->version % VERSION_RING);
    c->ver_of[i] = m->version, c->crc_of[i] = m->checksum, c->announced_at[i] = rf_time_now();
    for (int w = 0; w < c->n_rw; w++) {
        rollout_peer *p = &c->rw[w];
        for (int j = 0; j < p->n_unv; j++) {
            if (p->unv_version[j] != m->version) continue;
            RF_TRY(check_served(c, p, m->version, p->unv_crc[j], m->checksum));
            p->unv_version[j] = p->unv_version[--p->n_unv], p->unv_crc[j] = p->unv_crc[p->n_unv];
            j--;
        }
    }
    return RF_OK;
}

static rf_status on_weights_loaded(ctl *c, int peer, const Rlflow__WeightsLoaded *m) {
    rollout_peer *p = find_rw(c, peer);
    if (!p) return rf_error(RF_ERR_FORMAT, "%s sent WeightsLoaded but is not a rollout worker", peer_desc(c, peer));
    int known;
    uint32_t crc = known_crc(c, m->version, &known);
    if (known) {
        RF_TRY(check_served(c, p, m->version, m->checksum, crc));
    } else {
        if (p->n_unv >= UNVERIFIED_MAX)
            return rf_error(RF_ERR_FORMAT, "%s serves weights version %lld that the training worker never announced",
                            peer_desc(c, peer), (long long)m->version);
        p->unv_version[p->n_unv] = m->version, p->unv_crc[p->n_unv++] = m->checksum;
    }
    if (m->version < p->version)
        return rf_error(RF_ERR_FORMAT, "%s went back from version %d to %lld", peer_desc(c, peer), p->version, (long long)m->version);
    p->version = (int)m->version, p->crc = m->checksum, p->busy = m->busy_s, p->wall = m->wall_s;
    update_served(c);
    /* from the training worker's announcement to this rollout worker serving the version */
    if (known) c->weights_latency = rf_time_now() - c->announced_at[m->version % VERSION_RING];
    c->weights_load = m->load_s;
    return RF_OK;
}

/* NULL when the run has a place for a worker of this role and rank (the training worker, rank
 * 0; rollout workers 0 .. n_rollout_want - 1, each once), else why not. With CURVE only the
 * run's own ranks get this far; a second worker with a rank already taken (a restarted rank, a
 * misconfigured user's mpirun) is refused rather than trusted. */
static const char *place_taken(const ctl *c, const rf_msg_peer_info *i) {
    if (i->role == RLFLOW__ROLE__ROLE_ACTOR)
        return i->rank != 0 ? "the training worker is rank 0" : c->train_peer >= 0 ? "the training worker has joined already" : NULL;
    if (i->role != RLFLOW__ROLE__ROLE_ROLLOUT) return "a run's workers are a training worker and rollout workers";
    if (i->rank < 0 || i->rank >= c->n_rollout_want) return "no rollout worker has that rank in this run";
    for (int k = 0; k < c->n_rw; k++)
        if (c->rw[k].rank == i->rank) return "a rollout worker of that rank has joined already";
    return NULL;
}

/* Refuses a worker the run has no place for (an Error tells it why), logs it, and goes on. */
static void refuse_worker(ctl *c, const rf_msg_event *ev, const char *why) {
    char text[512];
    snprintf(text, sizeof text, "refused: %s (%s); this run has 1 training and %d rollout workers", why, ev->info.desc,
             c->n_rollout_want);
    rf_log_warn("controller: %s", text);
    rf_msg_server_drop(c->srv, ev->peer, RF_ERR_ARG, text, 0);
}

/* [env]: a rollout worker's turns that ended, answered by the environment. */
static rf_status on_env_turns(ctl *c, int peer, const Rlflow__EnvTurns *m) {
    if (!c->eps || !find_rw(c, peer))
        return rf_error(RF_ERR_FORMAT, "%s sent EnvTurns, and %s", peer_desc(c, peer),
                        c->eps ? "it is not a rollout worker" : "this run has no [env]");
    Rlflow__EnvObservations a;
    RF_TRY(rf_split_eps_turns(c->eps, peer_desc(c, peer), m, &a));
    rf_status st = rf_msg_server_send(c->srv, peer, RF_MSG_ENV_OBSERVATIONS, &a.base);
    rf_split_eps_reply_free(&a);
    return st;
}

/* run.env_tick: the workers are pinged while the controller waits on the environment. */
static rf_status keepalive(void *ctx) {
    rf_msg_server_keepalive(((ctl *)ctx)->srv);
    return RF_OK;
}

/* ---- the loop ------------------------------------------------------------------------- */

static rf_status on_event(ctl *c, rf_msg_event *ev) {
    switch (ev->kind) {
    case RF_MSG_EV_NONE: return RF_OK;
    case RF_MSG_EV_JOINED: /* every place is taken: refused, the run goes on */
        refuse_worker(c, ev, "joined after the run started");
        return RF_OK;
    case RF_MSG_EV_REFUSED: rf_log_warn("%s", ev->text); return RF_OK;
    case RF_MSG_EV_LOST: {
        rollout_peer *p = find_rw(c, ev->peer);
        if (p) return rf_error(RF_ERR_IO, "%s (generating %d groups at version %d)", ev->text, p->groups, p->version);
        return rf_error(RF_ERR_IO, "%s (%s)", ev->text, c->batch_out ? "training a batch" : "between batches");
    }
    case RF_MSG_EV_MALFORMED: return rf_error(RF_ERR_FORMAT, "%s", ev->text);
    case RF_MSG_EV_MESSAGE: break;
    }
    rf_msg *m = &ev->msg;
    if (m->type != RF_MSG_HEARTBEAT && m->type != RF_MSG_ERROR) c->last_progress = rf_time_now();
    switch (m->type) {
    case RF_MSG_SAMPLE: return on_sample(c, ev->peer, (Rlflow__Sample *)m->pb);
    case RF_MSG_ENV_TURNS: return on_env_turns(c, ev->peer, (Rlflow__EnvTurns *)m->pb);
    case RF_MSG_SCORE_RESPONSE: return on_score(c, (Rlflow__ScoreResponse *)m->pb);
    case RF_MSG_TRAIN_STATS: return on_train_stats(c, (Rlflow__TrainStats *)m->pb);
    case RF_MSG_WEIGHTS_UPDATE: return on_weights_update(c, (Rlflow__WeightsUpdate *)m->pb);
    case RF_MSG_WEIGHTS_LOADED: return on_weights_loaded(c, ev->peer, (Rlflow__WeightsLoaded *)m->pb);
    case RF_MSG_CHECKPOINT_DONE: {
        Rlflow__CheckpointDone *d = (Rlflow__CheckpointDone *)m->pb;
        c->ckpt_out--;
        if (d->error && d->error[0])
            return rf_error(RF_ERR_IO, "the training worker could not save step %lld: %s", (long long)d->step, d->error);
        rf_log_info("checkpoint: %s/step_%06lld (%.2f s)", c->run.r->logging.dir, (long long)d->step, d->seconds);
        return RF_OK;
    }
    case RF_MSG_ERROR: {
        Rlflow__Error *e = (Rlflow__Error *)m->pb;
        return rf_error(RF_ERR_IO, "%s failed: %s", peer_desc(c, ev->peer), e->message ? e->message : "");
    }
    default:
        return rf_error(RF_ERR_FORMAT, "%s sent an unexpected %s", peer_desc(c, ev->peer), rf_msg_type_name(m->type));
    }
}

static rf_status wait_for_workers(ctl *c) {
    const rf_recipe *r = c->run.r;
    double deadline = rf_time_now() + r->async.startup_timeout;
    c->train_peer = -1;
    while (c->train_peer < 0 || c->n_rw < c->n_rollout_want) {
        double left = deadline - rf_time_now();
        if (left <= 0)
            return rf_error(RF_ERR_IO, "workers did not connect to %s within %.0f s (async.startup_timeout): %s training worker, %d of %d rollout workers",
                            rf_msg_server_endpoint(c->srv), r->async.startup_timeout,
                            c->train_peer < 0 ? "no" : "the", c->n_rw, c->n_rollout_want);
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(c->srv, left < 0.5 ? left : 0.5, &ev));
        if (rf_interrupt_signal())
            return rf_error(RF_ERR_IO, "interrupted (signal %d) while waiting for workers: no step taken, no checkpoint written",
                            rf_interrupt_signal());
        if (ev.kind == RF_MSG_EV_JOINED) {
            const char *why = place_taken(c, &ev.info);
            if (!why) rf_log_info("joined: %s", ev.info.desc);
            if (why) {
                refuse_worker(c, &ev, why);
            } else if (ev.info.role == RLFLOW__ROLE__ROLE_ACTOR) {
                c->train_peer = ev.peer;
            } else {
                if (ev.peer >= c->n_peer_ids) {
                    int n = (ev.peer + 1) * 2;
                    int *m = realloc(c->rw_of_peer, sizeof(int) * (size_t)n);
                    if (!m) return rf_error(RF_ERR_NOMEM, "out of memory");
                    for (int i = c->n_peer_ids; i < n; i++) m[i] = -1;
                    c->rw_of_peer = m, c->n_peer_ids = n;
                }
                c->rw_of_peer[ev.peer] = c->n_rw;
                c->rw[c->n_rw++] = (rollout_peer){.peer = ev.peer, .rank = ev.info.rank, .version = -1};
            }
        } else if (ev.kind == RF_MSG_EV_MESSAGE) {
            rf_status st = on_event(c, &ev); /* e.g. the first WeightsUpdate */
            rf_msg_free(&ev.msg);
            RF_TRY(st);
        } else if (ev.kind != RF_MSG_EV_NONE) {
            RF_TRY(on_event(c, &ev));
        }
    }
    return RF_OK;
}

static int finished(const ctl *c) {
    const rf_recipe *r = c->run.r;
    return c->run.step >= r->train.steps && !c->batch_out && c->ckpt_out == 0 &&
           (!c->run.val || c->final_val_done || r->logging.val_size == 0);
}

/* What each role is doing, for the progress bound's error: "training worker: ...; rollout
 * worker 0 (pid P): ...". */
static void describe_roles(ctl *c, char *out, size_t cap) {
    size_t n = 0;
    const rf_msg_peer_info *ti = rf_msg_server_peer(c->srv, c->train_peer);
    if (c->batch_out)
        n += (size_t)snprintf(out + n, cap - n, "training worker (pid %d): training the batch of step %d (sent %.0f s ago)",
                              ti ? ti->pid : -1, c->run.step + 1, rf_time_now() - c->batch_sent_at);
    else if (c->scores_out)
        n += (size_t)snprintf(out + n, cap - n, "training worker (pid %d): scoring %d groups (reference, critic or reward model)",
                              ti ? ti->pid : -1, c->scores_out);
    else
        n += (size_t)snprintf(out + n, cap - n, "training worker (pid %d): idle, waiting for a batch (the buffer holds %d of "
                              "the %d groups a step takes, %d in flight)", ti ? ti->pid : -1, rf_buffer_depth(c->buf),
                              c->run.r->rollout.prompts_per_step, rf_buffer_in_flight(c->buf));
    if (c->ckpt_out && n < cap) n += (size_t)snprintf(out + n, cap - n, ", writing a checkpoint");
    for (int i = 0; i < c->n_rw && n < cap; i++) {
        const rf_msg_peer_info *pi = rf_msg_server_peer(c->srv, c->rw[i].peer);
        if (c->rw[i].groups > 0)
            n += (size_t)snprintf(out + n, cap - n, "; rollout worker %d (pid %d): generating %d groups with weights version %d",
                                  c->rw[i].rank, pi ? pi->pid : -1, c->rw[i].groups, c->rw[i].version);
        else
            n += (size_t)snprintf(out + n, cap - n, "; rollout worker %d (pid %d): idle with weights version %d, waiting for "
                                  "prompts (the controller admits none while the staleness bound k = %d holds them back: "
                                  "the oldest version served is %d, at step %d)", c->rw[i].rank, pi ? pi->pid : -1,
                                  c->rw[i].version, c->run.r->async.max_staleness, c->served, c->run.step);
    }
}

/* async.progress_timeout: peers that answer heartbeats but bring no step, sample, score,
 * weights report or checkpoint for that long stop the run, saying what each was doing. */
static rf_status check_progress(ctl *c) {
    double limit = c->run.r->async.progress_timeout, idle = rf_time_now() - c->last_progress;
    if (!(limit > 0) || idle <= limit) return RF_OK;
    char what[2048];
    describe_roles(c, what, sizeof what);
    return rf_error(RF_ERR_IO, "no progress for %.0f s (async.progress_timeout = %g; no step, sample, score or weights "
                    "report while every worker answers heartbeats) at step %d: %s", idle, limit, c->run.step, what);
}

/* SIGINT / SIGTERM: no prompt is admitted nor batch sent any more; the batch at the training
 * worker finishes (its step counts), then the checkpoint of the step reached is written (unless
 * it is being written already). *stopped once it is done: the groups still generating are
 * abandoned (the checkpoint's data position is the oldest of them, so a resumed run generates
 * them again). */
static rf_status stop_step(ctl *c, int *stopped) {
    *stopped = 0;
    if (c->batch_out) return RF_OK;
    if (!c->stop_ckpt) {
        rf_log_warn("interrupted (signal %d): step %d is done, writing its checkpoint (a second signal stops at once)",
                    rf_interrupt_signal(), c->run.step);
        c->stop_ckpt = 1;
        if (c->ckpt_last != c->run.step) RF_TRY(request_checkpoint(c));
    }
    *stopped = c->ckpt_out == 0;
    return RF_OK;
}

static rf_status loop(ctl *c) {
    const rf_recipe *r = c->run.r;
    RF_TRY(wait_for_workers(c));
    rf_log_info("controller: 1 training worker and %d rollout workers; staleness bound k = %d, buffer %d groups, batch %d groups x %d samples",
                c->n_rw, r->async.max_staleness, c->cap, r->rollout.prompts_per_step, r->rollout.n);
    c->turns = rf_recipe_colocated_ranks(r) && r->placement.rollout.tp > 1 && strcmp(r->model.device, "cuda") == 0;
    if (c->turns)
        rf_log_info("controller: generation and scoring take turns (colocated, placement.rollout.tp = %d on CUDA: the "
                    "rollout and training threads' NCCL groups share each device)", r->placement.rollout.tp);
    c->run.t_start = c->last_step_at = c->last_progress = rf_time_now();
    c->run.start_step = c->run.step;
    c->val_next = c->run.step == 0 ? 0 : c->run.step + 1;
    while (!finished(c)) {
        if (rf_interrupt_signal()) {
            int stopped;
            RF_TRY(stop_step(c, &stopped));
            if (stopped) {
                g_interrupted = 1;
                return rf_error(RF_ERR_IO, "interrupted at step %d: checkpoint written to %s/step_%06d; resume with --resume",
                                c->run.step, r->logging.dir, c->ckpt_last);
            }
        }
        RF_TRY(check_progress(c));
        RF_TRY(score_turns(c));
        if (!rf_interrupt_signal()) {
            RF_TRY(start_validation(c));
            RF_TRY(admit(c));
            RF_TRY(try_train(c));
        }
        if (finished(c)) break;
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(c->srv, 0.1, &ev));
        rf_status st = on_event(c, &ev);
        if (ev.kind == RF_MSG_EV_MESSAGE) rf_msg_free(&ev.msg);
        RF_TRY(st);
        if (c->run.step >= r->train.steps && c->final_val_done && rf_metrics_count(c->run.metrics))
            RF_TRY(rf_metrics_commit(c->run.metrics, c->run.step));
    }
    if (rf_metrics_count(c->run.metrics)) RF_TRY(rf_metrics_commit(c->run.metrics, c->run.step));
    rf_log_info("done: %d steps in %.1f s (%.2f steps/s)", c->run.step - c->run.start_step,
                rf_time_now() - c->run.t_start,
                (c->run.step - c->run.start_step) / fmax(rf_time_now() - c->run.t_start, 1e-9));
    return RF_OK;
}

static rf_status setup(ctl *c, const rf_recipe *r, int resume) {
    rf_run *run = &c->run;
    RF_TRY(rf__run_state_init(run, r));
    RF_TRY(rf_tokenizer_load_dir(&run->tok, r->model.path));
    RF_TRY(rf__load_data(run));
    run->env_tick = keepalive, run->env_tick_ctx = c;
    RF_TRY(rf__load_rewards(run));
    RF_TRY(rf_split_eps_open(&c->eps, run));
    if (resume) RF_TRY(rf__run_resume(run, NULL, NULL));
    c->cap = r->async.buffer_groups > 0 ? r->async.buffer_groups
                                        : r->rollout.prompts_per_step * (r->async.max_staleness + 1);
    for (c->n_bucket = 64; c->n_bucket < 2 * (c->cap + r->logging.val_size); c->n_bucket *= 2) {
    }
    c->bucket = calloc((size_t)c->n_bucket, sizeof *c->bucket);
    if (!c->bucket) return rf_error(RF_ERR_NOMEM, "out of memory");
    RF_TRY(rf_buffer_init(&c->buf, r->rollout.prompts_per_step, c->cap, r->async.max_staleness));
    rf_buffer_resume_at(c->buf, run->step);
    return rf__open_logging(run);
}

rf_status rf_controller_main(const rf_recipe *r, int resume, rf_msg_server *srv, int n_rollout) {
    if (n_rollout < 1 || n_rollout > MAX_ROLLOUT)
        return rf_error(RF_ERR_ARG, "placement.rollout_ranks = %d: between 1 and %d", n_rollout, MAX_ROLLOUT);
    ctl *c = calloc(1, sizeof *c);
    if (!c) return rf_error(RF_ERR_NOMEM, "out of memory");
    c->srv = srv, c->n_rollout_want = n_rollout, c->served = -1;
    for (int i = 0; i < VERSION_RING; i++) c->ver_of[i] = -1;
    c->ckpt_last = -1;
    g_interrupted = 0;
    int mine = rf_interrupt_install(); /* installed already for every rank of a run under mpirun */
    rf_status st = setup(c, r, resume);
    if (st == RF_OK) st = loop(c);
    if (mine) rf_interrupt_restore();
    while (c->live) {
        group *g = c->live;
        c->live = g->next;
        group_free(g);
    }
    free(c->bucket);
    free(c->rw_of_peer);
    rf_split_eps_close(c->eps);
    if (c->buf) {
        void *out[1], **stale = malloc(sizeof(void *) * (size_t)(c->cap + 1));
        int ns = 0;
        /* a version far ahead makes every buffered group stale: collect them to free */
        if (stale) {
            rf_buffer_take(c->buf, INT32_MAX / 2, out, stale, c->cap + 1, &ns);
            for (int i = 0; i < ns; i++) group_free(stale[i]);
            free(stale);
        }
        rf_buffer_free(c->buf);
    }
    rf__run_free(&c->run);
    free(c);
    return st;
}
