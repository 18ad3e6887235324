/* Multi-turn episodes: the driver between the rollout engine and an environment
 * (controller/episodes.h, docs/env-api.md). */
#define _POSIX_C_SOURCE 200809L
#include "controller/episodes.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* A turn as the environment answered it. */
typedef struct turn_rec {
    char *action;
    int32_t *ids;       /* (n_ids) */
    int n_ids;
    char *obs;
    float reward;
    int end;            /* index into the episode's ids of the turn's last generated token */
} turn_rec;

/* One episode while it runs. */
typedef struct ep_state {
    rf_reward_item ex;  /* the group's fields, index set to the sample's */
    uint64_t id;        /* episode id */
    char *first_obs;
    uint64_t req;       /* the engine's request id and sample index */
    int index;
    turn_rec *turns;    /* (n_turns) answered turns, then the pending one at n_turns */
    int n_turns, cap_turns;
    const char *finish; /* of the pending turn */
    int used;           /* tokens after the prompt so far */
    int truncated;
} ep_state;

typedef struct drv {
    const rf_episode_opts *o;
    ep_state *ep;
    rf_episode *out;
    int *pending;       /* (n_pending) slots with a turn waiting for the environment */
    int n_pending;
    rf_status st;
} drv;

void rf_episode_free(rf_episode *e) {
    if (!e) return;
    free(e->prompt), free(e->ids), free(e->logp), free(e->versions), free(e->mask), free(e->turn_rewards);
    free(e->last_text), free(e->text);
    memset(e, 0, sizeof *e);
}

static void turn_free(turn_rec *t) {
    free(t->action), free(t->ids), free(t->obs);
    memset(t, 0, sizeof *t);
}

static void ep_free(ep_state *e) {
    for (int k = 0; k < e->cap_turns; k++) turn_free(&e->turns[k]);
    free(e->turns), free(e->first_obs);
}

static const char *finish_name(rf_finish f) {
    return f == RF_FINISH_EOS ? "eos" : f == RF_FINISH_STOP ? "stop" : "length";
}

/* The pending turn's record (room for it made). */
static turn_rec *next_turn(ep_state *e) {
    if (e->n_turns == e->cap_turns) {
        int cap = e->cap_turns ? 2 * e->cap_turns : 4;
        turn_rec *t = realloc(e->turns, sizeof *t * (size_t)cap);
        if (!t) return NULL;
        memset(t + e->cap_turns, 0, sizeof *t * (size_t)(cap - e->cap_turns));
        e->turns = t, e->cap_turns = cap;
    }
    return &e->turns[e->n_turns];
}

/* A turn ended: kept as the episode's pending turn, the slot queued for the environment. */
static rf_status on_turn(drv *d, int slot, const rf_rollout_sample *s) {
    ep_state *e = &d->ep[slot];
    turn_rec *t = next_turn(e);
    if (!t) return rf_error(RF_ERR_NOMEM, "out of memory");
    int n_ids = s->n_tokens - s->turn_start;
    t->ids = malloc(sizeof(int32_t) * (size_t)(n_ids > 0 ? n_ids : 1));
    t->action = malloc(s->text_len + 1);
    if (!t->ids || !t->action) return rf_error(RF_ERR_NOMEM, "out of memory");
    memcpy(t->ids, s->tokens + s->turn_start, sizeof(int32_t) * (size_t)n_ids);
    if (s->text_len) memcpy(t->action, s->text, s->text_len);
    t->action[s->text_len] = '\0';
    t->n_ids = n_ids, t->end = s->n_tokens - 1;
    e->finish = finish_name(s->finish), e->used = s->n_tokens;
    e->req = s->request_id, e->index = s->index;
    d->pending[d->n_pending++] = slot;
    return RF_OK;
}

/* An episode ended: its whole trajectory into out[slot]. */
static rf_status on_end(drv *d, int slot, const rf_rollout_sample *s) {
    ep_state *e = &d->ep[slot];
    rf_episode *x = &d->out[slot];
    size_t n = (size_t)s->n_tokens, n1 = n ? n : 1;
    x->prompt = malloc(sizeof(int32_t) * (size_t)s->prompt_len);
    x->ids = malloc(sizeof(int32_t) * n1), x->logp = malloc(sizeof(float) * n1);
    x->versions = malloc(sizeof(int) * n1), x->mask = malloc(n1), x->turn_rewards = calloc(n1, sizeof(float));
    if (!x->prompt || !x->ids || !x->logp || !x->versions || !x->mask || !x->turn_rewards)
        return rf_error(RF_ERR_NOMEM, "out of memory for an episode of %zu tokens", n);
    memcpy(x->prompt, s->prompt, sizeof(int32_t) * (size_t)s->prompt_len);
    memcpy(x->ids, s->tokens, sizeof(int32_t) * n), memcpy(x->logp, s->logprobs, sizeof(float) * n);
    memcpy(x->versions, s->versions, sizeof(int) * n), memcpy(x->mask, s->mask, n);
    x->n_prompt = s->prompt_len, x->n = s->n_tokens, x->turns = e->n_turns, x->truncated = e->truncated;
    for (int k = 0; k < e->n_turns; k++) {
        x->turn_rewards[e->turns[k].end] += e->turns[k].reward;
        x->env_reward += e->turns[k].reward;
    }
    x->last_text = rf_strdup(e->n_turns ? e->turns[e->n_turns - 1].action : "");
    if (!x->last_text) return rf_error(RF_ERR_NOMEM, "out of memory");
    if (!d->o->tok) return RF_OK;
    size_t len;
    return rf_tokenizer_decode(d->o->tok, x->ids, x->n, 1, &x->text, &len);
}

static void on_sample(void *ctx, const rf_rollout_sample *s) {
    drv *d = ctx;
    if (d->st != RF_OK) return;
    int slot = (int)(intptr_t)s->user + s->index;
    d->st = s->turn_end ? on_turn(d, slot, s) : on_end(d, slot, s);
}

/* ---- resets ---------------------------------------------------------------------------- */

/* Opens every episode; their first observations into ep[k].first_obs. */
static rf_status reset_all(rf_env *env, ep_state *ep, int n_ep) {
    rf_env_call *c = calloc((size_t)n_ep, sizeof *c);
    rf_env_reply *r = calloc((size_t)n_ep, sizeof *r);
    rf_status st = c && r ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < n_ep; k++) c[k] = (rf_env_call){.is_step = 0, .episode = ep[k].id, .ex = &ep[k].ex};
    if (st == RF_OK) st = env->call(env->ctx, c, n_ep, r);
    for (int k = 0; st == RF_OK && k < n_ep; k++)
        if (!(ep[k].first_obs = rf_strdup(r[k].observation ? r[k].observation : "")))
            st = rf_error(RF_ERR_NOMEM, "out of memory");
    free(c), free(r);
    return st;
}

static rf_status encode(const rf_tokenizer *tok, const char *text, int32_t **ids, int *n) {
    *ids = NULL, *n = 0;
    if (!*text) return RF_OK;
    if (!tok) return rf_error(RF_ERR_ARG, "episodes: an environment answered text, and there is no tokenizer");
    return rf_tokenizer_encode(tok, text, strlen(text), 0, ids, n);
}

/* Submits group g: one request of n samples when every first observation is the same (the
 * prompt is prefilled once for the group), else one request per sample, seeded as sample i
 * of the group would be. */
static rf_status submit_group(rf_rollout *eng, const rf_episode_opts *o, const rf_rollout_request *tmpl,
                              ep_state *ep, int g, int n, uint64_t seed) {
    int same = 1;
    for (int i = 1; i < n; i++) same = same && strcmp(ep[g * n + i].first_obs, ep[g * n].first_obs) == 0;
    rf_status st = RF_OK;
    for (int i = 0; st == RF_OK && i < (same ? 1 : n); i++) {
        const rf_reward_item *ex = &ep[g * n + i].ex;
        int32_t *obs, *prompt = NULL;
        int n_obs;
        RF_TRY(encode(o->tok, ep[g * n + i].first_obs, &obs, &n_obs));
        prompt = malloc(sizeof(int32_t) * (size_t)(ex->n_prompt_ids + n_obs + 1));
        if (!prompt) st = rf_error(RF_ERR_NOMEM, "out of memory");
        if (st == RF_OK) {
            memcpy(prompt, ex->prompt_ids, sizeof(int32_t) * (size_t)ex->n_prompt_ids);
            if (n_obs) memcpy(prompt + ex->n_prompt_ids, obs, sizeof(int32_t) * (size_t)n_obs);
            rf_rollout_request q = *tmpl;
            q.prompt = prompt, q.prompt_len = ex->n_prompt_ids + n_obs;
            q.n = same ? n : 1, q.seed = seed + (uint64_t)(g * n + i);
            q.episode = 1, q.max_total_tokens = o->max_total_tokens;
            st = rf_rollout_submit(eng, &q, (void *)(intptr_t)(g * n + i), NULL);
        }
        free(prompt), free(obs);
    }
    return st;
}

/* ---- turns ------------------------------------------------------------------------------ */

/* The step call of slot k's pending turn; hist (n_turns) is filled from its answered turns. */
static rf_env_call step_call(const drv *d, const ep_state *e, rf_env_turn *hist) {
    for (int k = 0; k < e->n_turns; k++) {
        const turn_rec *t = &e->turns[k];
        hist[k] = (rf_env_turn){t->action, t->ids, t->n_ids, t->obs, t->reward};
    }
    const turn_rec *t = &e->turns[e->n_turns];
    /* the limits end the episode after this turn: no turn left, or no room for one token */
    int last = e->n_turns + 1 >= d->o->max_turns || e->used >= d->o->max_total_tokens;
    return (rf_env_call){.is_step = 1, .episode = e->id, .ex = &e->ex, .turn = e->n_turns, .action = t->action,
                         .action_ids = t->ids, .n_action_ids = t->n_ids, .finish = e->finish, .last = last,
                         .first_observation = e->first_obs, .history = hist, .n_history = e->n_turns};
}

/* Slot k's turn was answered r: the episode ends or its next turn starts. */
static rf_status after_turn(rf_rollout *eng, drv *d, int slot, const rf_env_call *c, const rf_env_reply *r) {
    ep_state *e = &d->ep[slot];
    turn_rec *t = &e->turns[e->n_turns++];
    t->reward = r->reward;
    if (!(t->obs = rf_strdup(r->observation ? r->observation : ""))) return rf_error(RF_ERR_NOMEM, "out of memory");
    if (r->done || c->last) {
        e->truncated = !r->done;
        return rf_rollout_end(eng, e->req, e->index);
    }
    int32_t *obs;
    int n_obs;
    RF_TRY(encode(d->o->tok, t->obs, &obs, &n_obs));
    rf_status st;
    if (e->used + n_obs + 1 > d->o->max_total_tokens) { /* no room for it and a token: truncated */
        e->truncated = 1;
        st = rf_rollout_end(eng, e->req, e->index);
    } else {
        st = rf_rollout_continue(eng, e->req, e->index, obs, n_obs);
    }
    free(obs);
    return st;
}

/* Sends every pending turn to the environment in one call and acts on the answers. */
static rf_status answer_turns(rf_rollout *eng, rf_env *env, drv *d) {
    int n = d->n_pending;
    size_t total = 0, nn = n > 0 ? (size_t)n : 1;
    for (int k = 0; k < n; k++) total += (size_t)d->ep[d->pending[k]].n_turns;
    rf_env_call *c = calloc(nn, sizeof *c);
    rf_env_reply *r = calloc(nn, sizeof *r);
    rf_env_turn *hist = calloc(total + 1, sizeof *hist);
    int *slots = malloc(sizeof(int) * nn);
    rf_status st = c && r && hist && slots ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0, off = 0; st == RF_OK && k < n; k++) {
        const ep_state *e = &d->ep[d->pending[k]];
        c[k] = step_call(d, e, hist + off);
        off += e->n_turns;
        slots[k] = d->pending[k];
    }
    d->n_pending = 0; /* ending an episode below delivers it (on_end), continuing queues nothing */
    if (st == RF_OK) st = env->call(env->ctx, c, n, r);
    for (int k = 0; st == RF_OK && k < n; k++) {
        st = after_turn(eng, d, slots[k], &c[k], &r[k]);
        if (st == RF_OK) st = d->st;
    }
    free(c), free(r), free(hist), free(slots);
    return st;
}

static rf_status drive(rf_rollout *eng, rf_env *env, drv *d) {
    for (;;) {
        if (d->n_pending) {
            RF_TRY(answer_turns(eng, env, d));
            continue;
        }
        if (rf_rollout_idle(eng)) break;
        RF_TRY(rf_rollout_step(eng));
        RF_TRY(d->st);
    }
    if (rf_rollout_waiting_turns(eng))
        return rf_error(RF_ERR_INTERNAL, "episodes: %d episodes wait for a turn nobody asked for",
                        rf_rollout_waiting_turns(eng));
    return RF_OK;
}

rf_status rf_episodes_run(rf_rollout *eng, rf_env *env, const rf_episode_opts *o, const rf_reward_item *ex,
                          int n_groups, int n, const rf_rollout_request *req, uint64_t seed, uint64_t episode_base,
                          rf_episode *out) {
    if (o->max_turns < 1 || o->max_total_tokens < req->max_new_tokens)
        return rf_error(RF_ERR_ARG, "episodes: max_turns %d (>= 1), max_total_tokens %d (>= the turn's %d)",
                        o->max_turns, o->max_total_tokens, req->max_new_tokens);
    int n_ep = n_groups * n;
    memset(out, 0, sizeof *out * (size_t)n_ep);
    drv d = {o, calloc((size_t)n_ep + 1, sizeof(ep_state)), out, malloc(sizeof(int) * ((size_t)n_ep + 1)), 0, RF_OK};
    rf_status st = d.ep && d.pending ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < n_ep; k++) {
        d.ep[k].ex = ex[k / n];
        d.ep[k].ex.index = k % n;
        d.ep[k].id = episode_base + (uint64_t)k;
    }
    if (st == RF_OK) st = reset_all(env, d.ep, n_ep);
    for (int g = 0; st == RF_OK && g < n_groups; g++) st = submit_group(eng, o, req, d.ep, g, n, seed);
    rf_rollout_set_callback(eng, on_sample, &d);
    if (st == RF_OK) st = drive(eng, env, &d);
    rf_rollout_set_callback(eng, NULL, NULL);
    for (int k = 0; d.ep && k < n_ep; k++) ep_free(&d.ep[k]);
    free(d.ep), free(d.pending);
    if (st != RF_OK)
        for (int k = 0; k < n_ep; k++) rf_episode_free(&out[k]);
    return st;
}
