/* The RL loop of every deployment (controller/controller.h): the one-process default, split
 * runs and colocated multi-device runs all run this dataflow; only how the roles are reached
 * differs (controller/roles.h: the in-process roles of controller/roles_inproc.c, or the
 * message roles below, over ZeroMQ to rollout and training workers). */
#include <math.h>
#include <signal.h>
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
#include "controller/roles.h"
#include "controller/run_dir.h"
#include "controller/run_internal.h"
#include "trainer/checkpoint.h"

#define MAX_ROLLOUT 4096 /* rollout_peer is 240 bytes: 960 KiB of controller state (calloc) */
#define VERSION_RING 256

/* Where a group's samples are in the dataflow. */
enum { STAGE_GEN, STAGE_RM, STAGE_REWARDED, STAGE_POLICY };

typedef struct group {
    int64_t id;             /* admission id (buffer); -1 for validation */
    uint64_t req;           /* request id (generate and score requests) */
    const rf_example *ex;
    rf_dataset_pos pos;     /* data position before this prompt */
    rf_train_sample *s;     /* (n) */
    int n, n_done, worker;  /* worker: index into ctl.rw (message roles) */
    int min_version;
    int step, round, place; /* its seed's origin (rf__group_seed); validation: its index */
    int stage;              /* STAGE_* */
    int scoring;            /* the flags of the scoring request out (RF_ROLE_SCORE_*), 0: none */
    int policy_scored;      /* its reward-model request also asked for the policy scores */
    int score_deferred;     /* the flags of a ScoreRequest waiting for generation to pause (ctl.turns) */
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

/* A dynamic-sampling replacement: the seed origin of a group admitted for one dropped. */
typedef struct slot {
    int step, round, place;
} slot;

typedef struct ctl {
    rf_run *run;          /* recipe, tokenizer, data, rewards, metrics, step, KL, position */
    rf_run own;           /* the message roles' run (run points here) */
    rf_roles roles;
    rf_role_sink sink;
    rf_buffer *buf;
    group *live;          /* admitted or validation groups not yet in the buffer */
    group **bucket;       /* (n_bucket, a power of 2) live groups by request id */
    int n_bucket;
    int cap;              /* buffer capacity in groups */
    uint64_t next_req;
    int64_t fresh;        /* round-0 places handed out (batch fresh / P, place fresh % P) */
    slot *slots;          /* (n_slots) replacements to admit, in order */
    int n_slots, cap_slots;
    slot *next_place;     /* (n_next) per (step, round > 0): the next place, in step.round.place */
    int n_next, cap_next;
    int dropped_step;     /* groups dynamic sampling dropped since the last batch */
    /* where the newest batch's admission began (its round-0 place-0 group): a checkpoint of
     * that batch's step resumes there when the run is deterministic (resume_point) */
    int start_step;       /* -1: none yet */
    rf_dataset_pos start_pos;
    int64_t start_id;
    int batch_out;        /* a batch is at the trainer */
    double mean_kl;
    int ckpt_out;         /* checkpoint requests not yet done */
    int ckpt_last;        /* the step of the last checkpoint request (-1: none) */
    int stop_ckpt;        /* SIGINT / SIGTERM: the stop's checkpoint is requested */
    int closed;           /* the last step whose record is closed (committed), -1: none */
    /* validation */
    int val_version, val_out, val_n, val_done; /* val_done: the version last validated (-1) */
    rf_train_sample *val_s;  /* (val_n) the responses, by index */
    const rf_example **val_ex;
    double acc0, acc_last;   /* this process's validation before training and the last one */
    /* per step */
    double gen_tokens, last_step_at, train_busy, train_busy0;
    /* ---- the message roles' state ---- */
    rf_msg_server *srv;
    int *rw_of_peer;      /* (n_peer_ids) index into rw by server peer id, -1: not a rollout worker */
    int n_peer_ids;
    int served;           /* the oldest version any rollout worker serves (-1: not all have weights) */
    int n_rollout_want;
    rollout_peer rw[MAX_ROLLOUT];
    int n_rw, train_peer;
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
    double batch_sent_at;
    double last_progress; /* when the last step, sample, score or weights report came */
    rf_split_eps *eps;    /* [env]: the episodes the rollout workers run (controller/episodes_split.h) */
} ctl;

static int g_interrupted; /* the last loop stopped on a signal, its checkpoint written */

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

static group *new_group(ctl *c, const rf_example *ex, int n) {
    group *g = calloc(1, sizeof *g);
    if (g) g->s = calloc((size_t)n, sizeof *g->s);
    if (!g || !g->s) {
        free(g);
        rf_error(RF_ERR_NOMEM, "out of memory");
        return NULL;
    }
    g->ex = ex, g->n = n, g->req = ++c->next_req, g->min_version = INT32_MAX, g->worker = -1;
    g->next = c->live;
    if (c->live) c->live->prev = g;
    c->live = g;
    group **b = bucket_of(c, g->req);
    g->hnext = *b;
    *b = g;
    return g;
}

static int served_version(const ctl *c) { return c->roles.iface->served(c->roles.ctx); }

/* ==== the message roles: ZeroMQ to the rollout and training workers ======================== */

static rollout_peer *find_rw(ctl *c, int peer) {
    if (peer < 0 || peer >= c->n_peer_ids || c->rw_of_peer[peer] < 0) return NULL;
    return &c->rw[c->rw_of_peer[peer]];
}

static int msg_served(void *ctx) { return ((ctl *)ctx)->served; }

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

/* Groups (training and validation) some rollout worker is generating. */
static int gen_in_flight(const ctl *c) {
    int n = 0;
    for (int i = 0; i < c->n_rw; i++) n += c->rw[i].groups;
    return n;
}

/* With ctl.turns: no generation starts while a ScoreRequest is out or waiting. */
static int scoring_has_turn(const ctl *c) { return c->turns && (c->scores_out > 0 || c->scores_deferred > 0); }

/* A GenerateRequest to the rollout worker with the fewest groups in flight. */
static rf_status msg_generate(void *ctx, const rf_role_gen *q) {
    ctl *c = ctx;
    const rf_recipe *r = c->run->r;
    group *g = find_group(c, q->req);
    int best = 0;
    for (int i = 1; i < c->n_rw; i++)
        if (c->rw[i].groups < c->rw[best].groups) best = i;
    Rlflow__SamplingParams sp = RLFLOW__SAMPLING_PARAMS__INIT;
    sp.temperature = (float)r->rollout.temperature, sp.top_k = r->rollout.top_k;
    sp.top_p = (float)r->rollout.top_p, sp.max_new_tokens = r->rollout.max_new_tokens;
    sp.seed = q->seed;
    Rlflow__GenerateRequest m = RLFLOW__GENERATE_REQUEST__INIT;
    m.request_id = q->req, m.n_prompt_ids = (size_t)q->ex->n_prompt, m.prompt_ids = q->ex->prompt_ids;
    m.n = q->n, m.sampling = &sp, m.group_id = q->group_id, m.greedy = q->greedy;
    m.min_version = q->min_version;
    if (c->eps) RF_TRY(rf_split_eps_begin(c->eps, &m, q->ex, q->n, q->group_id)); /* [env]: reset, first observations */
    if (g) g->worker = best;
    c->rw[best].groups++;
    rf_status st = rf_msg_server_send(c->srv, c->rw[best].peer, RF_MSG_GENERATE_REQUEST, &m.base);
    return st == RF_OK ? RF_OK : rf_error_wrap(st, "sending a GenerateRequest");
}

static rf_status send_score(ctl *c, group *g, int flags) {
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
    q.want_ref_logp = !!(flags & RF_ROLE_SCORE_REF), q.want_values = !!(flags & RF_ROLE_SCORE_VALUES);
    q.want_rm_score = !!(flags & RF_ROLE_SCORE_RM);
    rf_status st = rf_msg_server_send(c->srv, c->train_peer, RF_MSG_SCORE_REQUEST, &q.base);
    free(ts), free(tp);
    g->score_sent = rf_time_now();
    c->scores_out++;
    return st;
}

/* A ScoreRequest for the group of req (the training worker recomputes proximal log-probs
 * itself: RF_ROLE_SCORE_PROX alone needs no request); held back while generation runs when
 * generation and scoring take turns (ctl.turns). */
static rf_status msg_score(void *ctx, uint64_t req, rf_train_sample *s, int n, int flags) {
    ctl *c = ctx;
    (void)s, (void)n;
    group *g = find_group(c, req);
    if (!g) return rf_error(RF_ERR_ARG, "scoring request %llu: no such group", (unsigned long long)req);
    flags &= ~RF_ROLE_SCORE_PROX;
    if (!flags) return c->sink.scored(c->sink.ctx, req);
    if (c->turns && gen_in_flight(c) > 0) { /* sent by score_turns when generation pauses */
        g->score_deferred = flags, c->scores_deferred++, c->scores_held++;
        return RF_OK;
    }
    return send_score(c, g, flags);
}

/* ctl.turns: the ScoreRequests held back are sent once no group is generating. */
static rf_status score_turns(ctl *c) {
    if (!c->scores_deferred || gen_in_flight(c) > 0) return RF_OK;
    for (group *g = c->live; g; g = g->next)
        if (g->score_deferred) {
            int flags = g->score_deferred;
            g->score_deferred = 0, c->scores_deferred--;
            RF_TRY(send_score(c, g, flags));
        }
    return RF_OK;
}

/* vers (s->n_resp): room for the tokens' versions as the message carries them (int64). */
static void pack_sample(Rlflow__TrainSample *t, rf_train_sample *s, int group, int with_ref, int with_val, int64_t *vers) {
    rlflow__train_sample__init(t);
    for (int k = 0; k < s->n_resp; k++) vers[k] = s->versions[k];
    t->n_versions = (size_t)s->n_resp, t->versions = vers; /* actor/logprob_mismatch_* counts the current version's */
    t->n_tokens = (size_t)(s->n_prompt + s->n_resp), t->tokens = s->tokens, t->n_prompt = s->n_prompt;
    t->n_behav_logp = (size_t)s->n_resp, t->behav_logp = s->behav_logp;
    t->n_advantages = (size_t)s->n_resp, t->advantages = s->adv;
    t->n_returns = with_val ? (size_t)s->n_resp : 0, t->returns = s->returns;
    t->n_values = with_val ? (size_t)s->n_resp : 0, t->values = s->values;
    t->n_ref_logp = with_ref ? (size_t)s->n_resp : 0, t->ref_logp = s->ref_logp;
    t->reward = s->reward, t->group = group;
    if (s->loss_mask) t->loss_mask = (ProtobufCBinaryData){(size_t)s->n_resp, s->loss_mask}; /* [env] */
}

/* The TrainBatch to the training worker (s freed once packed). */
static rf_status msg_train(void *ctx, rf_train_sample *s, int n, int version, float kl_coef) {
    ctl *c = ctx;
    const rf_recipe *r = c->run->r;
    int with_ref = rf_recipe_reference_enabled(r) && !r->algorithm.kl_in_reward;
    int with_val = c->run->adv_kind == RF_ADV_GAE;
    Rlflow__TrainSample *ts = calloc((size_t)(n ? n : 1), sizeof *ts);
    Rlflow__TrainSample **tp = calloc((size_t)(n ? n : 1), sizeof *tp);
    size_t n_tok = 0;
    for (int i = 0; i < n; i++) n_tok += (size_t)s[i].n_resp;
    int64_t *vers = malloc(sizeof(int64_t) * (n_tok ? n_tok : 1));
    rf_status st = ts && tp && vers ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0, off = 0; st == RF_OK && i < n; off += s[i].n_resp, i++) {
        pack_sample(&ts[i], &s[i], s[i].group, with_ref, with_val, vers + off);
        tp[i] = &ts[i];
    }
    Rlflow__TrainBatch b = RLFLOW__TRAIN_BATCH__INIT;
    b.batch_id = (uint64_t)version, b.policy_version = version;
    b.n_samples = (size_t)n, b.samples = tp, b.kl_coef = kl_coef;
    if (st == RF_OK) st = rf_msg_server_send(c->srv, c->train_peer, RF_MSG_TRAIN_BATCH, &b.base);
    c->batch_sent_at = rf_time_now();
    for (int i = 0; i < n; i++) rf_train_sample_free(&s[i]);
    free(s), free(ts), free(tp), free(vers);
    return st;
}

static rf_status msg_checkpoint(void *ctx, const rf_ckpt_state *cs) {
    ctl *c = ctx; /* the training worker writes it */
    Rlflow__CheckpointRequest q = RLFLOW__CHECKPOINT_REQUEST__INIT;
    q.step = cs->step, q.data_epoch = cs->pos.epoch, q.data_index = cs->pos.index;
    q.kl_coef = cs->kl_beta, q.best_val = cs->best_val, q.admitted = cs->admitted;
    return rf_msg_server_send(c->srv, c->train_peer, RF_MSG_CHECKPOINT_REQUEST, &q.base);
}

static uint32_t known_crc(const ctl *c, int64_t version, int *known) {
    int i = (int)(version % VERSION_RING);
    *known = c->ver_of[i] == version;
    return c->crc_of[i];
}

/* A Sample: checked against its request and the weights its worker reported serving, scored by
 * the reward rules, delivered. */
static rf_status on_msg_sample(ctl *c, int peer, const Rlflow__Sample *m, const rf_role_sink *sink) {
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
    rf_train_sample s = {0};
    rf_status st;
    if (c->eps) { /* [env]: checked against the book of its turns, the rules on the last turn */
        st = rf_split_eps_sample(c->eps, peer_desc(c, peer), m, g->ex, &s);
        /* validation: the rules score the last turn, the reward model and programs the whole text */
        if (st == RF_OK && g->id < 0) s.rules_text = rf_strdup(rf_split_eps_last_text(c->eps, g->req, m->index));
        if (st == RF_OK && g->id < 0 && !s.rules_text) st = rf_error(RF_ERR_NOMEM, "out of memory");
    } else {
        st = rf__sample_init(c->run, &s, g->ex->prompt_ids, g->ex->n_prompt, m->tokens, m->logprobs, nr, m->text,
                             g->ex->answer);
    }
    for (int t = 0; st == RF_OK && t < nr; t++) s.versions[t] = (int)m->versions[t];
    if (st == RF_OK && g->n_done + 1 == g->n) { /* the group's last sample */
        if (g->worker >= 0 && g->worker < c->n_rw) c->rw[g->worker].groups--;
        rf_split_eps_forget(c->eps, g->req);
    }
    if (st == RF_OK) st = sink->sample(sink->ctx, m->request_id, m->index, &s);
    rf_train_sample_free(&s);
    return st;
}

/* A ScoreResponse: what was asked into the group's samples, delivered. */
static rf_status on_msg_score(ctl *c, const Rlflow__ScoreResponse *m, const rf_role_sink *sink) {
    group *g = find_group(c, m->request_id);
    if (!g || !g->scoring || g->score_deferred)
        return rf_error(RF_ERR_FORMAT, "the training worker answered ScoreRequest %llu, which is not outstanding",
                        (unsigned long long)m->request_id);
    if (m->error && m->error[0])
        return rf_error(RF_ERR_IO, "the training worker could not score request %llu: %s", (unsigned long long)m->request_id, m->error);
    int want_ref = g->scoring & RF_ROLE_SCORE_REF, want_val = g->scoring & RF_ROLE_SCORE_VALUES;
    int want_rm = g->scoring & RF_ROLE_SCORE_RM;
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
        if (want_rm) s->rm_score = m->rm_scores[i];
    }
    c->scores_out--;
    c->score_wait += rf_time_now() - g->score_sent, c->score_n++;
    return sink->scored(sink->ctx, m->request_id);
}

static rf_status on_msg_train_stats(ctl *c, const Rlflow__TrainStats *m, const rf_role_sink *sink) {
    if (!c->batch_out)
        return rf_error(RF_ERR_FORMAT, "the training worker reported version %lld with no batch out", (long long)m->policy_version);
    for (size_t i = 0; i < m->n_metrics; i++) rf_metrics_set(c->run->metrics, m->metrics[i]->key, m->metrics[i]->value);
    return sink->trained(sink->ctx, (int)m->policy_version, m->seconds);
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

/* ---- the message roles' events ---- */

static rf_status on_event(ctl *c, rf_msg_event *ev, const rf_role_sink *sink) {
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
    case RF_MSG_SAMPLE: return on_msg_sample(c, ev->peer, (Rlflow__Sample *)m->pb, sink);
    case RF_MSG_ENV_TURNS: return on_env_turns(c, ev->peer, (Rlflow__EnvTurns *)m->pb);
    case RF_MSG_SCORE_RESPONSE: return on_msg_score(c, (Rlflow__ScoreResponse *)m->pb, sink);
    case RF_MSG_TRAIN_STATS: return on_msg_train_stats(c, (Rlflow__TrainStats *)m->pb, sink);
    case RF_MSG_WEIGHTS_UPDATE: return on_weights_update(c, (Rlflow__WeightsUpdate *)m->pb);
    case RF_MSG_WEIGHTS_LOADED: return on_weights_loaded(c, ev->peer, (Rlflow__WeightsLoaded *)m->pb);
    case RF_MSG_CHECKPOINT_DONE: {
        Rlflow__CheckpointDone *d = (Rlflow__CheckpointDone *)m->pb;
        if (d->error && d->error[0])
            return rf_error(RF_ERR_IO, "the training worker could not save step %lld: %s", (long long)d->step, d->error);
        return sink->checkpointed(sink->ctx, (int)d->step, d->seconds);
    }
    case RF_MSG_ERROR: {
        Rlflow__Error *e = (Rlflow__Error *)m->pb;
        return rf_error(RF_ERR_IO, "%s failed: %s", peer_desc(c, ev->peer), e->message ? e->message : "");
    }
    default:
        return rf_error(RF_ERR_FORMAT, "%s sent an unexpected %s", peer_desc(c, ev->peer), rf_msg_type_name(m->type));
    }
}

static rf_status wait_for_workers(ctl *c, const rf_role_sink *sink) {
    const rf_recipe *r = c->run->r;
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
            rf_status st = on_event(c, &ev, sink); /* e.g. the first WeightsUpdate */
            rf_msg_free(&ev.msg);
            RF_TRY(st);
        } else if (ev.kind != RF_MSG_EV_NONE) {
            RF_TRY(on_event(c, &ev, sink));
        }
    }
    return RF_OK;
}

/* What each role is doing, for the progress bound's error: "training worker: ...; rollout
 * worker 0 (pid P): ...". */
static void describe_roles(ctl *c, char *out, size_t cap) {
    size_t n = 0;
    const rf_msg_peer_info *ti = rf_msg_server_peer(c->srv, c->train_peer);
    if (c->batch_out)
        n += (size_t)snprintf(out + n, cap - n, "training worker (pid %d): training the batch of step %d (sent %.0f s ago)",
                              ti ? ti->pid : -1, c->run->step + 1, rf_time_now() - c->batch_sent_at);
    else if (c->scores_out)
        n += (size_t)snprintf(out + n, cap - n, "training worker (pid %d): scoring %d groups (reference, critic or reward model)",
                              ti ? ti->pid : -1, c->scores_out);
    else
        n += (size_t)snprintf(out + n, cap - n, "training worker (pid %d): idle, waiting for a batch (the buffer holds %d of "
                              "the %d groups a step takes, %d in flight)", ti ? ti->pid : -1, rf_buffer_depth(c->buf),
                              c->run->r->rollout.prompts_per_step, rf_buffer_in_flight(c->buf));
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
                                  c->rw[i].version, c->run->r->async.max_staleness, c->served, c->run->step);
    }
}

/* async.progress_timeout: peers that answer heartbeats but bring no step, sample, score,
 * weights report or checkpoint for that long stop the run, saying what each was doing. */
static rf_status check_progress(ctl *c) {
    double limit = c->run->r->async.progress_timeout, idle = rf_time_now() - c->last_progress;
    if (!(limit > 0) || idle <= limit) return RF_OK;
    char what[2048];
    describe_roles(c, what, sizeof what);
    return rf_error(RF_ERR_IO, "no progress for %.0f s (async.progress_timeout = %g; no step, sample, score or weights "
                    "report while every worker answers heartbeats) at step %d: %s", idle, limit, c->run->step, what);
}

static rf_status msg_progress(void *ctx, double timeout, const rf_role_sink *sink) {
    ctl *c = ctx;
    RF_TRY(check_progress(c));
    RF_TRY(score_turns(c));
    rf_msg_event ev;
    RF_TRY(rf_msg_server_poll(c->srv, timeout, &ev));
    rf_status st = on_event(c, &ev, sink);
    if (ev.kind == RF_MSG_EV_MESSAGE) rf_msg_free(&ev.msg);
    return st;
}

static void msg_step_metrics(void *ctx, rf_metrics *m, double dt) {
    ctl *c = ctx;
    rf_metrics_set(m, "time/elapsed_s", rf_time_now() - c->run->t_start);
    rf_metrics_set(m, "idle/train", fmax(0.0, 1.0 - (c->train_busy - c->train_busy0) / fmax(dt, 1e-9)));
    double idle = 0;
    for (int i = 0; i < c->n_rw; i++) /* since each worker first had weights */
        idle += c->rw[i].wall > 0 ? fmax(0.0, 1.0 - c->rw[i].busy / c->rw[i].wall) : 0;
    rf_metrics_set(m, "idle/rollout", c->n_rw ? idle / c->n_rw : 0);
    rf_metrics_set(m, "perf/weights_latency_s", c->weights_latency);
    rf_metrics_set(m, "perf/weights_load_s", c->weights_load);
    if (c->score_n) rf_metrics_set(m, "perf/score_latency_s", c->score_wait / c->score_n);
    c->score_wait = 0, c->score_n = 0;
    if (c->turns) rf_metrics_set(m, "perf/scores_held", c->scores_held);
    c->scores_held = 0;
    c->train_busy0 = c->train_busy;
}

static const rf_role_iface MSG = {"message", 1, msg_served, msg_generate, msg_score, msg_train, msg_checkpoint,
                                  msg_progress, msg_step_metrics};

/* ==== the loop ============================================================================= */

/* ---- admission ---- */

/* The seed origin of the next group: a dynamic-sampling replacement first (its batch's next
 * round, places in the order groups were dropped), else the next batch place of round 0. */
static slot next_slot(ctl *c) {
    int P = c->run->r->rollout.prompts_per_step;
    if (c->n_slots) {
        slot s = c->slots[0];
        memmove(c->slots, c->slots + 1, sizeof *c->slots * (size_t)--c->n_slots);
        return s;
    }
    slot s = {(int)(c->fresh / P), 0, (int)(c->fresh % P)};
    c->fresh++;
    return s;
}

/* Group g (of step, round) was dropped by dynamic sampling: a replacement in the next round. */
static rf_status add_slot(ctl *c, const group *g) {
    int k = 0;
    while (k < c->n_next && !(c->next_place[k].step == g->step && c->next_place[k].round == g->round + 1)) k++;
    if (k == c->n_next) {
        if (c->n_next == c->cap_next) {
            int cap = c->cap_next ? 2 * c->cap_next : 16;
            slot *p = realloc(c->next_place, sizeof *p * (size_t)cap);
            if (!p) return rf_error(RF_ERR_NOMEM, "out of memory");
            c->next_place = p, c->cap_next = cap;
        }
        c->next_place[c->n_next++] = (slot){g->step, g->round + 1, 0};
    }
    if (c->n_slots == c->cap_slots) {
        int cap = c->cap_slots ? 2 * c->cap_slots : 16;
        slot *p = realloc(c->slots, sizeof *p * (size_t)cap);
        if (!p) return rf_error(RF_ERR_NOMEM, "out of memory");
        c->slots = p, c->cap_slots = cap;
    }
    c->slots[c->n_slots++] = (slot){g->step, g->round + 1, c->next_place[k].place++};
    /* places of batches already trained are not needed any more */
    for (int i = 0; i < c->n_next; i++)
        if (c->next_place[i].step < c->run->step) c->next_place[i--] = c->next_place[--c->n_next];
    return RF_OK;
}

/* Test hook RF_TEST_STOP_AT="S.R": a stop is asked for (as by SIGINT) when the first group of
 * dynamic-sampling round R of batch S is admitted, a chosen moment inside a step with resample
 * rounds in flight (tests/test_run_resample.c). */
static void stop_hook(slot s) {
    static int at_step = -2, at_round = -1;
    if (at_step == -2) {
        const char *e = getenv("RF_TEST_STOP_AT");
        at_step = -1;
        if (e && sscanf(e, "%d.%d", &at_step, &at_round) != 2) at_step = -1;
    }
    if (s.step == at_step && s.round == at_round && s.place == 0) rf_interrupt_note(SIGINT);
}

/* Admits prompts while the staleness bound and the buffer allow, each a generate request. */
static rf_status admit(ctl *c) {
    const rf_recipe *r = c->run->r;
    int served = served_version(c), P = r->rollout.prompts_per_step;
    if (served < 0 || c->run->step >= r->train.steps || scoring_has_turn(c)) return RF_OK;
    /* stop admitting once every batch still to train is covered */
    while (rf_buffer_can_admit(c->buf, served) &&
           (c->n_slots > 0 || c->fresh < (int64_t)r->train.steps * P + rf_buffer_stale_dropped(c->buf))) {
        rf_dataset_pos before = c->run->pos;
        const rf_example *ex;
        RF_TRY(rf_dataset_next(c->run->train, &c->run->pos, 1, &ex));
        group *g = new_group(c, ex, r->rollout.n);
        if (!g) return RF_ERR_NOMEM;
        slot s = next_slot(c);
        stop_hook(s);
        g->pos = before, g->step = s.step, g->round = s.round, g->place = s.place;
        g->id = rf_buffer_admit(c->buf, served);
        if (s.round == 0 && s.place == 0) c->start_step = s.step, c->start_pos = before, c->start_id = g->id;
        rf_role_gen q = {g->req, g->id, ex, g->n, 0, s.step, s.round, s.place,
                         rf__group_seed(r, s.step, s.round, s.place), served};
        RF_TRY(c->roles.iface->generate(c->roles.ctx, &q));
    }
    return RF_OK;
}

/* ---- validation ---- */

/* Whether version v is validated: with logging.val_every > 0, before training (0), every
 * logging.val_every and the last; with 0, never. */
static int val_due_at(const ctl *c, int v) { return c->run->val && rf__val_due(c->run->r, v); }

/* Greedy generate requests for the first logging.val_size validation prompts (all when <= 0),
 * once the rollout side serves the version whose record waits for them. */
static rf_status start_validation(ctl *c) {
    const rf_recipe *r = c->run->r;
    int v = c->run->step;
    if (c->val_out || c->closed >= v || c->val_done == v || !val_due_at(c, v) || served_version(c) != v ||
        scoring_has_turn(c))
        return RF_OK;
    int size = rf_dataset_size(c->run->val), n = r->logging.val_size;
    n = n <= 0 || n > size ? size : n;
    free(c->val_s), free(c->val_ex);
    c->val_s = calloc((size_t)(n ? n : 1), sizeof *c->val_s);
    c->val_ex = calloc((size_t)(n ? n : 1), sizeof *c->val_ex);
    if (!c->val_s || !c->val_ex) return rf_error(RF_ERR_NOMEM, "out of memory for validation");
    c->val_version = v, c->val_out = n, c->val_n = n;
    if (n == 0) c->val_done = v;
    for (int i = 0; i < n; i++) {
        const rf_example *ex = rf_dataset_get(c->run->val, i); /* file order: the same set every time */
        group *g = new_group(c, ex, 1);
        if (!g) return RF_ERR_NOMEM;
        g->id = -1, g->place = i, c->val_ex[i] = ex;
        rf_role_gen q = {g->req, -1, ex, 1, 1, 0, 0, i, rf__group_seed(r, 0, 0, 0), v};
        RF_TRY(c->roles.iface->generate(c->roles.ctx, &q));
    }
    return RF_OK;
}

/* Every validation response is back: scored together by the training reward definition. */
static rf_status finish_validation(ctl *c) {
    int n = c->val_n;
    rf_val_response *v = calloc((size_t)(n ? n : 1), sizeof *v);
    if (!v) return rf_error(RF_ERR_NOMEM, "out of memory for validation");
    double len = 0, acc_sum = 0, reward_sum = 0;
    for (int i = 0; i < n; i++) {
        const rf_train_sample *s = &c->val_s[i];
        /* [env] episodes: the rules score the last turn (rules_text), the rest the whole text
         * after the prompt and first observation (s->tokens' first n_prompt), as in training;
         * the environment's turn rewards count (s->token_rewards holds only those here) */
        v[i] = (rf_val_response){c->val_ex[i], s->text, s->tokens + s->n_prompt, s->n_resp, s->rules_text,
                                 s->tokens, s->n_prompt, s->token_rewards,
                                 c->run->r->reward.model[0] && !c->run->rm ? &s->rm_score : NULL};
        len += s->n_resp;
    }
    rf_status st = rf__val_score(c->run, v, n, &acc_sum, &reward_sum);
    free(v);
    for (int i = 0; i < n; i++) rf_train_sample_free(&c->val_s[i]);
    RF_TRY(st);
    double acc = n ? acc_sum / n : 0;
    rf__val_metrics(c->run, acc, n ? reward_sum / n : 0, n ? len / n : 0);
    if (c->roles.iface->concurrent) rf_metrics_set(c->run->metrics, "val/version", c->val_version);
    if (c->val_version > 0 && acc > c->run->best_val) c->run->best_val = acc;
    if (c->val_version == 0) {
        c->acc0 = acc;
        rf_log_info("validation before training: accuracy %.3f on %d prompts", acc, n);
    } else {
        c->acc_last = acc;
        rf_log_info("validation at version %d: accuracy %.3f on %d prompts (%.1f s into the run)", c->val_version, acc,
                    n, rf_time_now() - c->run->t_start);
    }
    c->val_done = c->val_version;
    return RF_OK;
}

/* ---- a group's way: samples, reward model, reward programs, dynamic sampling, scoring ---- */

/* The reference, proximal log-probs and values a kept group needs before the buffer. */
static int policy_flags(const ctl *c) {
    const rf_recipe *r = c->run->r;
    int f = 0;
    if (rf_recipe_reference_enabled(r)) f |= RF_ROLE_SCORE_REF;
    if (c->run->adv_kind == RF_ADV_GAE) f |= RF_ROLE_SCORE_VALUES;
    /* several updates reuse the batch: the proximal policy is the current actor's, not the
     * behaviour policy (which it otherwise equals: generation used the current weights) */
    if (r->train.ppo_epochs > 1 || r->train.mini_batches > 1) f |= RF_ROLE_SCORE_PROX;
    return f;
}

static rf_status request_score(ctl *c, group *g, int stage, int flags) {
    g->stage = stage, g->scoring = flags;
    return c->roles.iface->score(c->roles.ctx, g->req, g->s, g->n, flags);
}

static rf_status group_ready(ctl *c, group *g) {
    unlink_group(c, g);
    rf_status st = rf_buffer_put(c->buf, g, g->id, g->min_version);
    if (st != RF_OK) group_free(g);
    return st;
}

/* Every sample of a training group is back: the reward model's scores when the recipe has one
 * (without dynamic sampling, which could drop the group, with the reference, proximal and value
 * scores in the same request), then (STAGE_REWARDED) the reward programs with the groups
 * rewarded by then. */
static rf_status group_complete(ctl *c, group *g) {
    const rf_recipe *r = c->run->r;
    if (!r->reward.model[0]) {
        g->stage = STAGE_REWARDED;
        return RF_OK;
    }
    g->policy_scored = !r->algorithm.dynamic_sampling;
    return request_score(c, g, STAGE_RM, RF_ROLE_SCORE_RM | (g->policy_scored ? policy_flags(c) : 0));
}

/* Validation group g (one response) is generated and scored: into c->val_s; the last one
 * finishes the validation. */
static rf_status val_response_done(ctl *c, group *g) {
    c->val_s[g->place] = g->s[0];
    memset(&g->s[0], 0, sizeof g->s[0]);
    unlink_group(c, g);
    group_free(g);
    return --c->val_out == 0 ? finish_validation(c) : RF_OK;
}

static rf_status loop_sample(void *ctx, uint64_t req, int index, rf_train_sample *in) {
    ctl *c = ctx;
    group *g = find_group(c, req);
    if (!g || g->stage != STAGE_GEN || index < 0 || index >= g->n || g->s[index].tokens)
        return rf_error(RF_ERR_ARG, "sample %d of request %llu, which is not outstanding", index, (unsigned long long)req);
    rf_train_sample *s = &g->s[index];
    *s = *in;
    memset(in, 0, sizeof *in);
    s->group = 0;
    memcpy(s->prox_logp, s->behav_logp, sizeof(float) * (size_t)s->n_resp); /* the behaviour policy's */
    for (int t = 0; t < s->n_resp; t++)
        if (s->versions[t] < g->min_version) g->min_version = s->versions[t];
    c->gen_tokens += s->n_resp;
    if (++g->n_done < g->n) return RF_OK;
    if (g->id >= 0) return group_complete(c, g);
    /* validation: a reward model this process does not host (the training worker's) scores the
     * response first, as it scores training's */
    if (c->run->r->reward.model[0] && !c->run->rm) return request_score(c, g, STAGE_RM, RF_ROLE_SCORE_RM);
    return val_response_done(c, g);
}

static rf_status loop_scored(void *ctx, uint64_t req) {
    ctl *c = ctx;
    group *g = find_group(c, req);
    if (!g || !g->scoring) return rf_error(RF_ERR_ARG, "scores for request %llu, which is not outstanding", (unsigned long long)req);
    g->scoring = 0;
    if (g->stage == STAGE_POLICY) return group_ready(c, g);
    float w = (float)c->run->r->reward.model_weight;
    for (int i = 0; i < g->n; i++) {
        if (!isfinite(g->s[i].rm_score))
            return rf_error(RF_ERR_RANGE, "the reward model scored sample %d of request %llu %g", i,
                            (unsigned long long)req, (double)g->s[i].rm_score);
        if (g->id >= 0) g->s[i].reward += w * g->s[i].rm_score;
    }
    if (g->id < 0) return val_response_done(c, g); /* rm_score: rf__val_score adds it */
    g->stage = STAGE_REWARDED;
    return RF_OK;
}

static int by_id(const void *a, const void *b) {
    int64_t x = (*(group *const *)a)->id, y = (*(group *const *)b)->id;
    return (x > y) - (x < y);
}

/* The reward programs score the groups rewarded so far, all in one batch (item group ids: the
 * groups' admission ids). */
static rf_status external_batch(ctl *c, group **gs, int k) {
    if (!c->run->ext || k == 0) return RF_OK;
    int n = 0;
    for (int i = 0; i < k; i++) n += gs[i]->n;
    rf_train_sample *s = malloc(sizeof *s * (size_t)n);
    const rf_example **ex = malloc(sizeof *ex * (size_t)k);
    int64_t *ids = malloc(sizeof *ids * (size_t)k);
    rf_status st = s && ex && ids ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0, at = 0; st == RF_OK && i < k; at += gs[i]->n, i++) {
        memcpy(s + at, gs[i]->s, sizeof *s * (size_t)gs[i]->n); /* shallow: the arrays stay the group's */
        ex[i] = gs[i]->ex, ids[i] = gs[i]->id;
    }
    if (st == RF_OK) st = rf__external_score(c->run, ex, s, n, c->run->r->rollout.n, ids);
    for (int i = 0, at = 0; st == RF_OK && i < k; at += gs[i]->n, i++) memcpy(gs[i]->s, s + at, sizeof *s * (size_t)gs[i]->n);
    free(s), free(ex), free(ids);
    return st;
}

/* The groups whose rewards are in (STAGE_REWARDED), in admission order: the reward programs,
 * then each dropped by dynamic sampling (a replacement admitted in the next round, up to
 * algorithm.max_resample_rounds) or scored for the buffer. */
static rf_status rewards(ctl *c) {
    const rf_recipe *r = c->run->r;
    int k = 0;
    for (group *g = c->live; g; g = g->next) k += g->id >= 0 && g->stage == STAGE_REWARDED && !g->scoring;
    if (!k) return RF_OK;
    group **gs = malloc(sizeof *gs * (size_t)k);
    if (!gs) return rf_error(RF_ERR_NOMEM, "out of memory");
    k = 0;
    for (group *g = c->live; g; g = g->next)
        if (g->id >= 0 && g->stage == STAGE_REWARDED && !g->scoring) gs[k++] = g;
    qsort(gs, (size_t)k, sizeof *gs, by_id);
    rf_status st = external_batch(c, gs, k);
    int flags = policy_flags(c);
    for (int i = 0; st == RF_OK && i < k; i++) {
        group *g = gs[i];
        if (r->algorithm.dynamic_sampling && !rf__group_informative(g->s, g->n) &&
            g->round < r->algorithm.max_resample_rounds) {
            c->dropped_step++;
            st = add_slot(c, g);
            rf_buffer_discard(c->buf, g->id);
            rf_split_eps_dropped(c->eps, g->id); /* [env] split runs: its episodes' sums */
            unlink_group(c, g);
            group_free(g);
        } else if (flags && !g->policy_scored) {
            st = request_score(c, g, STAGE_POLICY, flags);
        } else {
            st = group_ready(c, g);
        }
    }
    free(gs);
    return st;
}

/* ---- training ---- */

static void older_pos(rf_dataset_pos *p, const group *g) {
    if (g->id >= 0 && (g->pos.epoch < p->epoch || (g->pos.epoch == p->epoch && g->pos.index < p->index))) *p = g->pos;
}

/* The data position to resume from: the oldest prompt admitted and not yet trained on, still
 * generating or scoring (live) or complete in the buffer. */
static rf_dataset_pos resume_pos(ctl *c) {
    rf_dataset_pos p = c->run->pos;
    for (group *g = c->live; g; g = g->next) older_pos(&p, g);
    for (int i = 0; i < rf_buffer_depth(c->buf); i++) older_pos(&p, rf_buffer_at(c->buf, i));
    return p;
}

static void older_id(int64_t *id, const group *g) {
    if (g->id >= 0 && g->id < *id) *id = g->id;
}

/* Where a run resumed from a checkpoint of the step reached starts: its data position and
 * admission count (the next group id). Where generation is reproducible (one process, or
 * async.max_staleness = 0: only the batch of this step is admitted, every group generated with
 * this step's weights), at the start of this batch's admission when it has begun: the resumed
 * run replays the batch's rounds of dynamic sampling exactly, the groups dropped so far
 * included (their prompts are dropped again; resuming from the oldest live group instead would
 * skip a dropped first prompt and shift the batch's data). Otherwise (staleness k > 0: later
 * batches' groups are out too, generated with older weights) at the oldest group admitted and
 * not trained on, live or buffered: nothing is trained twice, nothing skipped but the groups
 * dropped. */
static void resume_point(ctl *c, rf_dataset_pos *pos, int64_t *admitted) {
    int exact = !c->roles.iface->concurrent || c->run->r->async.max_staleness == 0;
    if (exact && c->start_step == c->run->step) {
        *pos = c->start_pos, *admitted = c->start_id;
        return;
    }
    *pos = resume_pos(c), *admitted = rf_buffer_next_id(c->buf);
    for (group *g = c->live; g; g = g->next) older_id(admitted, g);
    for (int i = 0; i < rf_buffer_depth(c->buf); i++) older_id(admitted, rf_buffer_at(c->buf, i));
}

static rf_status request_checkpoint(ctl *c) {
    rf_dataset_pos pos;
    int64_t admitted;
    resume_point(c, &pos, &admitted);
    rf_ckpt_state cs = rf__run_ckpt_state(c->run, pos, admitted);
    c->ckpt_out++, c->ckpt_last = c->run->step;
    return c->roles.iface->checkpoint(c->roles.ctx, &cs);
}

/* The async/ metrics of a batch taken (concurrent roles). */
static void async_metrics(ctl *c, const rf_train_sample *s, int count, int depth) {
    const rf_recipe *r = c->run->r;
    rf_metrics *mt = c->run->metrics;
    int hist[64] = {0}, max_st = 0;
    double st_sum = 0;
    for (int i = 0; i < count; i++) {
        int lag = c->run->step - s[i].versions[0];
        for (int t = 1; t < s[i].n_resp; t++)
            if (c->run->step - s[i].versions[t] > lag) lag = c->run->step - s[i].versions[t];
        if (lag < 0) lag = 0;
        hist[lag < 63 ? lag : 63]++, st_sum += lag;
        if (lag > max_st) max_st = lag;
    }
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
}

/* A batch from the buffer once the step's record is closed: advantages, the batch's metrics
 * and sample logs, then the trainer. */
static rf_status try_train(ctl *c) {
    const rf_recipe *r = c->run->r;
    if (c->batch_out || c->run->step >= r->train.steps || c->closed < c->run->step) return RF_OK;
    int P = r->rollout.prompts_per_step, n = r->rollout.n, cap = c->cap;
    void **taken = malloc(sizeof(void *) * (size_t)P), **stale = malloc(sizeof(void *) * (size_t)cap);
    if (!taken || !stale) {
        free(taken), free(stale);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    int n_stale = 0, depth = rf_buffer_depth(c->buf);
    int ok = rf_buffer_take(c->buf, c->run->step, taken, stale, cap, &n_stale);
    for (int i = 0; i < n_stale; i++) rf_split_eps_dropped(c->eps, ((group *)stale[i])->id), group_free(stale[i]);
    free(stale);
    if (!ok) {
        free(taken);
        return RF_OK;
    }
    int count = P * n;
    rf_train_sample *s = calloc((size_t)count, sizeof *s);
    const rf_example **exs = calloc((size_t)P, sizeof *exs); /* each group's example (sample logs) */
    int64_t *gids = calloc((size_t)P, sizeof *gids);         /* each group's admission id ([env] metrics) */
    rf_status st = s && exs && gids ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int gi = 0; st == RF_OK && gi < P; gi++) {
        group *g = taken[gi];
        for (int j = 0; j < n; j++) {
            s[gi * n + j] = g->s[j]; /* moved: the group keeps no pointers */
            s[gi * n + j].group = gi;
        }
        exs[gi] = g->ex, gids[gi] = g->id;
        free(g->s);
        g->s = NULL;
        free(g);
    }
    free(taken);
    double mean_kl = 0;
    int has_ref = rf_recipe_reference_enabled(r);
    if (st == RF_OK) st = rf__advantages(r, c->run->adv_kind, c->run->kl.beta, has_ref, s, count, &mean_kl);
    if (st == RF_OK) {
        rf_metrics *mt = c->run->metrics;
        rf__batch_metrics(mt, r, s, count);
        if (has_ref) rf_metrics_set(mt, "actor/kl_ref", mean_kl);
        rf_metrics_set(mt, "actor/kl_coef", c->run->kl.beta);
        if (c->roles.iface->concurrent) async_metrics(c, s, count, depth);
        if (r->algorithm.dynamic_sampling) rf_metrics_set(mt, "rollout/dropped_groups", c->dropped_step);
        rf__external_metrics(c->run, mt);
        rf_split_eps_metrics(c->eps, gids, P, mt); /* [env] split runs: the batch's episodes */
        c->mean_kl = mean_kl;
        c->dropped_step = 0;
        st = rf__log_samples(c->run, c->run->step + 1, s, exs, count);
    }
    free(exs), free(gids);
    if (st != RF_OK) {
        for (int i = 0; s && i < count; i++) rf_train_sample_free(&s[i]);
        free(s);
        return st;
    }
    c->batch_out = 1;
    return c->roles.iface->train(c->roles.ctx, s, count, c->run->step, c->run->kl.beta); /* s taken over */
}

static rf_status loop_trained(void *ctx, int version, double seconds) {
    ctl *c = ctx;
    const rf_recipe *r = c->run->r;
    if (!c->batch_out || version != c->run->step + 1)
        return rf_error(RF_ERR_FORMAT, "the trainer reported version %d, expected %d", version, c->run->step + 1);
    c->batch_out = 0;
    c->train_busy += seconds;
    rf_kl_ctl_update(&c->run->kl, (float)c->mean_kl, r->rollout.prompts_per_step * r->rollout.n);
    c->run->step++;
    double now = rf_time_now(), dt = now - c->last_step_at;
    rf_metrics_set(c->run->metrics, "perf/step_s", dt);
    rf_metrics_set(c->run->metrics, "perf/gen_tokens_per_s", c->gen_tokens / fmax(dt, 1e-9));
    c->roles.iface->step_metrics(c->roles.ctx, c->run->metrics, dt);
    c->gen_tokens = 0, c->last_step_at = now;
    return RF_OK;
}

static rf_status loop_checkpointed(void *ctx, int step, double seconds) {
    ctl *c = ctx;
    c->ckpt_out--;
    rf_log_info("checkpoint: %s/step_%06d (%.2f s)", c->run->r->logging.dir, step, seconds);
    return RF_OK;
}

/* The record of the step reached, once trained and (when due) validated: the console line, the
 * metrics committed, the checkpoint asked for (it carries the validation's best accuracy). */
static rf_status close_record(ctl *c) {
    const rf_recipe *r = c->run->r;
    int s = c->run->step;
    if (c->closed >= s || (val_due_at(c, s) && c->val_done != s)) return RF_OK;
    if (s > 0 && rf__console_due(r, s)) rf__console(c->run);
    RF_TRY(rf_metrics_commit(c->run->metrics, s));
    c->closed = s;
    if (s > 0 && rf__ckpt_due(r, s) && c->ckpt_last != s) RF_TRY(request_checkpoint(c));
    return RF_OK;
}

static int finished(const ctl *c) {
    return c->run->step >= c->run->r->train.steps && !c->batch_out && c->ckpt_out == 0 &&
           c->closed >= c->run->r->train.steps;
}

/* SIGINT / SIGTERM: no prompt is admitted nor batch sent any more; the batch at the trainer
 * finishes (its step counts) and the step's record closes, then the checkpoint of the step
 * reached is written (unless it is being written already). *stopped once it is done: the
 * groups still generating are abandoned (the checkpoint's data position is the oldest of them,
 * so a resumed run generates them again). */
static rf_status stop_step(ctl *c, int *stopped) {
    *stopped = 0;
    if (c->batch_out || c->closed < c->run->step) return RF_OK;
    if (!c->stop_ckpt) {
        rf_log_warn("interrupted (signal %d): step %d is done, writing its checkpoint (a second signal stops at once)",
                    rf_interrupt_signal(), c->run->step);
        c->stop_ckpt = 1;
        if (c->ckpt_last != c->run->step) RF_TRY(request_checkpoint(c));
    }
    *stopped = c->ckpt_out == 0;
    return RF_OK;
}

/* The accuracy line at the end (a resumed run's accuracy before training is the first run's). */
static void log_accuracy(ctl *c) {
    const rf_recipe *r = c->run->r;
    double acc0 = c->acc0, acc = c->acc_last;
    if (isnan(acc0) && c->run->start_step > 0 && !rf_run_dir_val_before(r->logging.dir, &acc0)) acc0 = NAN;
    if (!isnan(acc) && !isnan(acc0))
        rf_log_info("validation accuracy: %.3f -> %.3f after %d steps (%.1f s)", acc0, acc, r->train.steps,
                    rf_time_now() - c->run->t_start);
    else if (!isnan(acc))
        rf_log_info("validation accuracy: %.3f after %d steps (%.1f s; the accuracy before training is not in "
                    "%s/metrics.jsonl)", acc, r->train.steps, rf_time_now() - c->run->t_start, r->logging.dir);
}

static rf_status loop(ctl *c) {
    const rf_recipe *r = c->run->r;
    c->run->t_start = c->last_step_at = c->last_progress = rf_time_now();
    c->run->start_step = c->run->step;
    c->closed = c->run->step > 0 || !val_due_at(c, 0) ? c->run->step : -1;
    while (!finished(c)) {
        RF_TRY(rewards(c));
        RF_TRY(close_record(c));
        RF_TRY(start_validation(c));
        if (rf_interrupt_signal()) {
            int stopped;
            RF_TRY(stop_step(c, &stopped));
            if (stopped) {
                g_interrupted = 1;
                return rf_error(RF_ERR_IO, "interrupted at step %d: checkpoint written to %s/step_%06d; resume with --resume",
                                c->run->step, r->logging.dir, c->ckpt_last);
            }
        } else {
            RF_TRY(admit(c));
            RF_TRY(try_train(c));
        }
        if (finished(c)) break;
        RF_TRY(c->roles.iface->progress(c->roles.ctx, 0.1, &c->sink));
    }
    log_accuracy(c);
    rf_log_info("done: %d steps in %.1f s (%.2f steps/s)", c->run->step - c->run->start_step,
                rf_time_now() - c->run->t_start,
                (c->run->step - c->run->start_step) / fmax(rf_time_now() - c->run->t_start, 1e-9));
    return RF_OK;
}

/* The loop's state over run (set up, resumed) and roles: the buffer sized by the deployment
 * (concurrent roles: async.max_staleness and async.buffer_groups; in process: one batch). */
static rf_status loop_init(ctl *c, rf_run *run, rf_roles roles) {
    const rf_recipe *r = run->r;
    c->run = run, c->roles = roles;
    c->sink = (rf_role_sink){c, loop_sample, loop_scored, loop_trained, loop_checkpointed};
    c->ckpt_last = -1, c->val_done = -1, c->acc0 = c->acc_last = NAN;
    int P = r->rollout.prompts_per_step, k = roles.iface->concurrent ? r->async.max_staleness : 0;
    c->cap = !roles.iface->concurrent ? P : r->async.buffer_groups > 0 ? r->async.buffer_groups : P * (k + 1);
    int vs = r->logging.val_size > 0 ? r->logging.val_size : run->val ? rf_dataset_size(run->val) : 0;
    for (c->n_bucket = 64; c->n_bucket < 2 * (c->cap + vs); c->n_bucket *= 2) {
    }
    c->bucket = calloc((size_t)c->n_bucket, sizeof *c->bucket);
    if (!c->bucket) return rf_error(RF_ERR_NOMEM, "out of memory");
    RF_TRY(rf_buffer_init(&c->buf, P, c->cap, k));
    rf_buffer_resume_at(c->buf, run->step, run->admitted);
    c->fresh = (int64_t)run->step * P;
    c->start_step = -1;
    return RF_OK;
}

static void loop_free(ctl *c) {
    while (c->live) {
        group *g = c->live;
        c->live = g->next;
        group_free(g);
    }
    free(c->bucket), free(c->slots), free(c->next_place), free(c->val_ex);
    for (int i = 0; c->val_s && i < c->val_n; i++) rf_train_sample_free(&c->val_s[i]);
    free(c->val_s);
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
}

rf_status rf_controller_run(rf_run *run, rf_roles roles) {
    ctl *c = calloc(1, sizeof *c);
    if (!c) return rf_error(RF_ERR_NOMEM, "out of memory");
    g_interrupted = 0;
    rf_status st = loop_init(c, run, roles);
    if (st == RF_OK) st = loop(c);
    loop_free(c);
    free(c);
    return st;
}

static rf_status msg_setup(ctl *c, const rf_recipe *r, int resume) {
    rf_run *run = &c->own;
    RF_TRY(rf__run_state_init(run, r));
    RF_TRY(rf_tokenizer_load_dir(&run->tok, r->model.path));
    RF_TRY(rf__load_data(run));
    run->env_tick = keepalive, run->env_tick_ctx = c;
    RF_TRY(rf__load_rewards(run));
    RF_TRY(rf_split_eps_open(&c->eps, run));
    /* first observations are checked here, where who answered them is known, against the
     * model every rollout worker generates with (model.path's, read with the data) */
    rf_split_eps_set_positions(c->eps, run->positions);
    if (resume) RF_TRY(rf__run_resume(run, NULL, NULL));
    RF_TRY(loop_init(c, run, (rf_roles){&MSG, c}));
    return rf__open_logging(run);
}

rf_status rf_controller_main(const rf_recipe *r, int resume, rf_msg_server *srv, int n_rollout) {
    if (n_rollout < 1 || n_rollout > MAX_ROLLOUT)
        return rf_error(RF_ERR_ARG, "placement.rollout_ranks = %d: between 1 and %d", n_rollout, MAX_ROLLOUT);
    ctl *c = calloc(1, sizeof *c);
    if (!c) return rf_error(RF_ERR_NOMEM, "out of memory");
    c->srv = srv, c->n_rollout_want = n_rollout, c->served = -1;
    for (int i = 0; i < VERSION_RING; i++) c->ver_of[i] = -1;
    g_interrupted = 0;
    int mine = rf_interrupt_install(); /* installed already for every rank of a run under mpirun */
    rf_status st = msg_setup(c, r, resume);
    if (st == RF_OK) st = wait_for_workers(c, &c->sink);
    if (st == RF_OK) {
        rf_log_info("controller: 1 training worker and %d rollout workers; staleness bound k = %d, buffer %d groups, batch %d groups x %d samples",
                    c->n_rw, r->async.max_staleness, c->cap, r->rollout.prompts_per_step, r->rollout.n);
        c->turns = rf_recipe_colocated_ranks(r) && r->placement.rollout.tp > 1 && strcmp(r->model.device, "cuda") == 0;
        if (c->turns)
            rf_log_info("controller: generation and scoring take turns (colocated, placement.rollout.tp = %d on CUDA: the "
                        "rollout and training threads' NCCL groups share each device)", r->placement.rollout.tp);
        st = loop(c);
    }
    if (mine) rf_interrupt_restore();
    free(c->rw_of_peer);
    rf_split_eps_close(c->eps);
    loop_free(c);
    rf__run_set_end(&c->own, st);
    rf__run_free(&c->own);
    free(c);
    return st;
}
