/* The rollout worker's episodes (rollout/worker_episodes.h). */
#include "rollout/worker_episodes.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "reward/external.h" /* RF_EXTERNAL_MAX_ATTEMPTS: the environment's rejections per request */

/* One engine request of an episode GenerateRequest. */
typedef struct wreq {
    uint64_t engine;  /* the engine's request id */
    uint64_t req;     /* the GenerateRequest's */
    int base, n;      /* its samples are base .. base + n - 1 of the GenerateRequest */
    int left;         /* samples not finished yet */
} wreq;

/* A turn sent to the controller, not answered yet. */
typedef struct wturn {
    uint64_t req;
    int index, turn;
    double sent;
} wturn;

struct rf_wep {
    const rf_recipe *r;
    wreq *reqs;
    int n_reqs, cap_reqs;
    Rlflow__EndedTurn *q; /* (n_q) turns queued for the next EnvTurns (ids, text owned) */
    int n_q, cap_q;
    wturn *wait;          /* (n_wait) turns sent and not answered */
    int n_wait, cap_wait;
    double deadline_s;
};

rf_status rf_wep_init(rf_wep **x, const rf_recipe *r) {
    *x = calloc(1, sizeof **x);
    if (!*x) return rf_error(RF_ERR_NOMEM, "out of memory");
    (*x)->r = r;
    (*x)->deadline_s = r->env.timeout * (RF_EXTERNAL_MAX_ATTEMPTS + 1) + r->async.peer_timeout;
    return RF_OK;
}

static void queue_clear(rf_wep *x) {
    for (int k = 0; k < x->n_q; k++) free(x->q[k].ids), free(x->q[k].text);
    x->n_q = 0;
}

void rf_wep_free(rf_wep *x) {
    if (!x) return;
    queue_clear(x);
    free(x->q), free(x->reqs), free(x->wait), free(x);
}

static rf_status add_req(rf_wep *x, uint64_t engine, uint64_t req, int base, int n) {
    RF_TRY(rf_grow((void **)&x->reqs, &x->cap_reqs, x->n_reqs + 1, sizeof *x->reqs));
    x->reqs[x->n_reqs++] = (wreq){engine, req, base, n, n};
    return RF_OK;
}

/* Submits one engine request: the prompt then obs (n_obs), n samples from seed. */
static rf_status submit_one(rf_wep *x, rf_rollout *e, const Rlflow__GenerateRequest *g, const rf_rollout_request *tmpl,
                            const int32_t *obs, int n_obs, int base, int n, uint64_t seed) {
    int np = (int)g->n_prompt_ids;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(np + n_obs + 1));
    if (!prompt) return rf_error(RF_ERR_NOMEM, "out of memory");
    memcpy(prompt, g->prompt_ids, sizeof(int32_t) * (size_t)np);
    if (n_obs) memcpy(prompt + np, obs, sizeof(int32_t) * (size_t)n_obs);
    rf_rollout_request q = *tmpl;
    q.prompt = prompt, q.prompt_len = np + n_obs, q.n = n, q.seed = seed;
    q.episode = 1, q.max_total_tokens = x->r->env.max_total_tokens;
    uint64_t id;
    rf_status st = rf_rollout_submit(e, &q, (void *)(uintptr_t)g->request_id, &id);
    free(prompt);
    return st == RF_OK ? add_req(x, id, g->request_id, base, n) : st;
}

static int same_seq(const Rlflow__IntSeq *a, const Rlflow__IntSeq *b) {
    return a->n_v == b->n_v && (!a->n_v || memcmp(a->v, b->v, sizeof(int32_t) * a->n_v) == 0);
}

rf_status rf_wep_submit(rf_wep *x, rf_rollout *e, const Rlflow__GenerateRequest *g, const rf_rollout_request *tmpl) {
    size_t no = g->n_first_observations;
    if (no != 0 && no != (size_t)g->n)
        return rf_error(RF_ERR_FORMAT, "GenerateRequest %llu: %zu first_observations for %d samples (0 or %d)",
                        (unsigned long long)g->request_id, no, g->n, g->n);
    int same = 1;
    for (size_t i = 1; i < no; i++) same = same && same_seq(g->first_observations[i], g->first_observations[0]);
    if (same) {
        const Rlflow__IntSeq *o = no ? g->first_observations[0] : NULL;
        return submit_one(x, e, g, tmpl, o ? o->v : NULL, o ? (int)o->n_v : 0, 0, g->n, tmpl->seed);
    }
    for (int i = 0; i < g->n; i++) {
        const Rlflow__IntSeq *o = g->first_observations[i];
        RF_TRY(submit_one(x, e, g, tmpl, o->v, (int)o->n_v, i, 1, tmpl->seed + (uint64_t)i));
    }
    return RF_OK;
}

static wreq *find_engine(const rf_wep *x, uint64_t engine) {
    for (int k = 0; k < x->n_reqs; k++)
        if (x->reqs[k].engine == engine) return &x->reqs[k];
    return NULL;
}

int rf_wep_lookup(const rf_wep *x, uint64_t engine_req, int *index_base) {
    const wreq *w = find_engine(x, engine_req);
    if (w) *index_base = w->base;
    return w != NULL;
}

void rf_wep_finished(rf_wep *x, uint64_t engine_req) {
    wreq *w = find_engine(x, engine_req);
    if (w && --w->left == 0) *w = x->reqs[--x->n_reqs];
}

static const char *finish_name(rf_finish f) {
    return f == RF_FINISH_EOS ? "eos" : f == RF_FINISH_STOP ? "stop" : "length";
}

rf_status rf_wep_turn(rf_wep *x, const rf_rollout_sample *rs) {
    const wreq *w = find_engine(x, rs->request_id);
    if (!w) return rf_error(RF_ERR_INTERNAL, "a turn ended in engine request %llu, which is no episode",
                            (unsigned long long)rs->request_id);
    RF_TRY(rf_grow((void **)&x->q, &x->cap_q, x->n_q + 1, sizeof *x->q));
    Rlflow__EndedTurn *t = &x->q[x->n_q];
    rlflow__ended_turn__init(t);
    int n = rs->n_tokens - rs->turn_start;
    t->ids = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    t->text = malloc(rs->text_len + 1);
    if (!t->ids || !t->text) {
        free(t->ids), free(t->text);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    if (n > 0) memcpy(t->ids, rs->tokens + rs->turn_start, sizeof(int32_t) * (size_t)n);
    if (rs->text_len) memcpy(t->text, rs->text, rs->text_len);
    t->text[rs->text_len] = '\0';
    t->n_ids = (size_t)(n > 0 ? n : 0);
    t->request_id = w->req, t->index = w->base + rs->index, t->turn = rs->turn - 1;
    t->finish = (char *)finish_name(rs->finish), t->used = rs->n_tokens;
    x->n_q++;
    return RF_OK;
}

rf_status rf_wep_flush(rf_wep *x, rf_msg_link *link) {
    if (!x->n_q) return RF_OK;
    Rlflow__EndedTurn **p = malloc(sizeof *p * (size_t)x->n_q);
    rf_status gs = p ? rf_grow((void **)&x->wait, &x->cap_wait, x->n_wait + x->n_q, sizeof *x->wait)
                     : rf_error(RF_ERR_NOMEM, "out of memory");
    if (gs != RF_OK) {
        free(p);
        return gs;
    }
    double now = rf_time_now();
    for (int k = 0; k < x->n_q; k++) {
        p[k] = &x->q[k];
        x->wait[x->n_wait++] = (wturn){x->q[k].request_id, x->q[k].index, x->q[k].turn, now};
    }
    Rlflow__EnvTurns m = RLFLOW__ENV_TURNS__INIT;
    m.n_turns = (size_t)x->n_q, m.turns = p;
    rf_status st = rf_msg_link_send(link, RF_MSG_ENV_TURNS, &m.base);
    free(p);
    queue_clear(x);
    return st;
}

/* The waiting turn of sample `index` of request req, -1 when none. */
static int find_wait(const rf_wep *x, uint64_t req, int index) {
    for (int k = 0; k < x->n_wait; k++)
        if (x->wait[k].req == req && x->wait[k].index == index) return k;
    return -1;
}

/* The engine request and index of sample `index` of GenerateRequest req. */
static const wreq *find_sample(const rf_wep *x, uint64_t req, int index) {
    for (int k = 0; k < x->n_reqs; k++)
        if (x->reqs[k].req == req && index >= x->reqs[k].base && index < x->reqs[k].base + x->reqs[k].n) return &x->reqs[k];
    return NULL;
}

rf_status rf_wep_answers(rf_wep *x, rf_rollout *e, const Rlflow__EnvObservations *m) {
    for (size_t k = 0; k < m->n_answers; k++) {
        const Rlflow__TurnAnswer *a = m->answers[k];
        int w = find_wait(x, a->request_id, a->index);
        const wreq *q = w >= 0 ? find_sample(x, a->request_id, a->index) : NULL;
        if (!q)
            return rf_error(RF_ERR_FORMAT, "the controller sent EnvObservations for request %llu sample %d, which waits for no "
                            "answer", (unsigned long long)a->request_id, a->index);
        x->wait[w] = x->wait[--x->n_wait];
        uint64_t engine = q->engine;
        int idx = a->index - q->base;
        rf_status st = a->end ? rf_rollout_end(e, engine, idx)
                              : rf_rollout_continue(e, engine, idx, a->observation_ids, (int)a->n_observation_ids);
        if (st != RF_OK)
            return rf_error_wrap(st, "the controller's answer to request %llu sample %d", (unsigned long long)a->request_id,
                                 a->index);
    }
    return RF_OK;
}

rf_status rf_wep_check(const rf_wep *x) {
    double now = rf_time_now();
    for (int k = 0; k < x->n_wait; k++) {
        const wturn *t = &x->wait[k];
        if (now - t->sent > x->deadline_s)
            return rf_error(RF_ERR_IO, "the controller did not answer turn %d of request %llu sample %d within %.0f s "
                            "(EnvObservations; env.timeout x %d attempts + async.peer_timeout)", t->turn,
                            (unsigned long long)t->req, t->index, x->deadline_s, RF_EXTERNAL_MAX_ATTEMPTS + 1);
    }
    return RF_OK;
}

int rf_wep_waiting(const rf_wep *x) { return x ? x->n_wait : 0; }
