/* Multi-turn episodes: the driver between the rollout engine and an environment
 * (controller/episodes.h, docs/env-api.md). */
#define _POSIX_C_SOURCE 200809L
#include "controller/episodes.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* The one-process driver: the episodes of a batch, by slot g * n + i. */
typedef struct drv {
    const rf_episode_opts *o;
    rf_ep *ep;
    uint64_t *req;      /* (slots) the engine's request id ... */
    int *index;         /* ... and sample index of each episode's sequence */
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

/* ---- the book -------------------------------------------------------------------------- */

static void turn_free(rf_ep_turn *t) {
    free(t->action), free(t->ids), free(t->obs);
    memset(t, 0, sizeof *t);
}

void rf_ep_free(rf_ep *e) {
    if (!e) return;
    for (int k = 0; k < e->cap_turns; k++) turn_free(&e->turns[k]);
    free(e->turns), free(e->first_obs), free(e->first_from);
    e->turns = NULL, e->first_obs = e->first_from = NULL, e->n_turns = e->cap_turns = 0;
}

/* The pending turn's record (room for it made). */
static rf_ep_turn *next_turn(rf_ep *e) {
    if (e->n_turns == e->cap_turns) {
        int cap = e->cap_turns ? 2 * e->cap_turns : 4;
        rf_ep_turn *t = realloc(e->turns, sizeof *t * (size_t)cap);
        if (!t) return NULL;
        memset(t + e->cap_turns, 0, sizeof *t * (size_t)(cap - e->cap_turns));
        e->turns = t, e->cap_turns = cap;
    }
    return &e->turns[e->n_turns];
}

rf_status rf_ep_turn_ended(rf_ep *e, const int32_t *ids, int n_ids, const char *text, size_t len, const char *finish,
                           int used) {
    if (e->pending || e->ended)
        return rf_error(RF_ERR_ARG, "episode %llu: a turn ended while %s", (unsigned long long)e->id,
                        e->ended ? "the episode had ended" : "the last one waits for the environment");
    rf_ep_turn *t = next_turn(e);
    if (!t) return rf_error(RF_ERR_NOMEM, "out of memory");
    turn_free(t);
    t->ids = malloc(sizeof(int32_t) * (size_t)(n_ids > 0 ? n_ids : 1));
    t->action = malloc(len + 1);
    if (!t->ids || !t->action) return rf_error(RF_ERR_NOMEM, "out of memory");
    if (n_ids > 0) memcpy(t->ids, ids, sizeof(int32_t) * (size_t)n_ids);
    if (len) memcpy(t->action, text, len);
    t->action[len] = '\0';
    t->n_ids = n_ids, t->end = used - 1;
    e->finish = finish, e->used = used, e->pending = 1;
    return RF_OK;
}

rf_status rf_ep_turn_rewards(const rf_ep *e, float *tr, int n_tokens, double *sum) {
    *sum = 0;
    for (int k = 0; k < e->n_turns; k++) {
        const rf_ep_turn *t = &e->turns[k];
        if (t->end < 0 || t->end >= n_tokens)
            return rf_error(RF_ERR_FORMAT, "episode %llu: turn %d ends at token %d, outside its %d tokens",
                            (unsigned long long)e->id, k, t->end, n_tokens);
        tr[t->end] += t->reward;
        *sum += t->reward;
    }
    return RF_OK;
}

rf_status rf_ep_reset(rf_env *env, rf_ep *ep, int n_ep) {
    rf_env_call *c = calloc((size_t)n_ep + 1, sizeof *c);
    rf_env_reply *r = calloc((size_t)n_ep + 1, sizeof *r);
    rf_status st = c && r ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < n_ep; k++) c[k] = (rf_env_call){.is_step = 0, .episode = ep[k].id, .ex = &ep[k].ex};
    if (st == RF_OK) st = env->call(env->ctx, c, n_ep, r);
    for (int k = 0; st == RF_OK && k < n_ep; k++) {
        ep[k].first_obs = rf_strdup(r[k].observation ? r[k].observation : "");
        ep[k].first_from = rf_strdup(r[k].from ? r[k].from : "the environment");
        if (!ep[k].first_obs || !ep[k].first_from) st = rf_error(RF_ERR_NOMEM, "out of memory");
    }
    free(c), free(r);
    return st;
}

rf_status rf_ep_encode(const rf_tokenizer *tok, const char *text, int32_t **ids, int *n) {
    *ids = NULL, *n = 0;
    if (!*text) return RF_OK;
    if (!tok) return rf_error(RF_ERR_ARG, "episodes: an environment answered text, and there is no tokenizer");
    return rf_tokenizer_encode(tok, text, strlen(text), 0, ids, n);
}

rf_status rf_ep_check_room(const rf_ep *e, int n_obs, int max_total_tokens, int positions) {
    int n_prompt = e->ex.n_prompt_ids;
    if (positions <= 0 || (int64_t)n_prompt + n_obs + max_total_tokens <= positions) return RF_OK;
    return rf_error(RF_ERR_RANGE, "episodes: the first observation of episode %llu (sample %lld of group %lld) from %s: "
                    "the prompt (%d tokens) + the observation (%d tokens) + env.max_total_tokens (%d) exceed the "
                    "model's %d positions", (unsigned long long)e->id, (long long)e->ex.index, (long long)e->ex.group,
                    e->first_from ? e->first_from : "the environment", n_prompt, n_obs, max_total_tokens, positions);
}

/* The step call of e's pending turn; hist (n_turns) is filled from its answered turns. */
static rf_env_call step_call(const rf_episode_opts *o, const rf_ep *e, rf_env_turn *hist) {
    for (int k = 0; k < e->n_turns; k++) {
        const rf_ep_turn *t = &e->turns[k];
        hist[k] = (rf_env_turn){t->action, t->ids, t->n_ids, t->obs, t->reward};
    }
    const rf_ep_turn *t = &e->turns[e->n_turns];
    /* the limits end the episode after this turn: no turn left, or no room for one token */
    int last = e->n_turns + 1 >= o->max_turns || e->used >= o->max_total_tokens;
    return (rf_env_call){.is_step = 1, .episode = e->id, .ex = &e->ex, .turn = e->n_turns, .action = t->action,
                         .action_ids = t->ids, .n_action_ids = t->n_ids, .finish = e->finish, .last = last,
                         .first_observation = e->first_obs, .history = hist, .n_history = e->n_turns};
}

/* e's pending turn was answered r: what comes next into *nx. */
static rf_status after_turn(const rf_episode_opts *o, rf_ep *e, const rf_env_call *c, const rf_env_reply *r,
                            rf_ep_next *nx) {
    rf_ep_turn *t = &e->turns[e->n_turns++];
    e->pending = 0;
    t->reward = r->reward;
    if (!(t->obs = rf_strdup(r->observation ? r->observation : ""))) return rf_error(RF_ERR_NOMEM, "out of memory");
    *nx = (rf_ep_next){0};
    if (r->done || c->last) {
        e->truncated = !r->done, e->ended = nx->end = 1;
        return RF_OK;
    }
    RF_TRY(rf_ep_encode(o->tok, t->obs, &nx->obs, &nx->n_obs));
    if (e->used + nx->n_obs + 1 > o->max_total_tokens) { /* no room for it and a token: truncated */
        free(nx->obs);
        *nx = (rf_ep_next){.end = 1};
        e->truncated = e->ended = 1;
    }
    return RF_OK;
}

rf_status rf_ep_step(rf_env *env, const rf_episode_opts *o, rf_ep *const *eps, int n, rf_ep_next *next) {
    size_t total = 0, nn = n > 0 ? (size_t)n : 1;
    for (int k = 0; k < n; k++) total += (size_t)eps[k]->n_turns;
    memset(next, 0, sizeof *next * (size_t)n);
    rf_env_call *c = calloc(nn, sizeof *c);
    rf_env_reply *r = calloc(nn, sizeof *r);
    rf_env_turn *hist = calloc(total + 1, sizeof *hist);
    rf_status st = c && r && hist ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < n; k++)
        if (!eps[k]->pending) st = rf_error(RF_ERR_ARG, "episode %llu has no turn waiting", (unsigned long long)eps[k]->id);
    for (int k = 0, off = 0; st == RF_OK && k < n; k++) {
        c[k] = step_call(o, eps[k], hist + off);
        off += eps[k]->n_turns;
    }
    if (st == RF_OK) st = env->call(env->ctx, c, n, r);
    for (int k = 0; st == RF_OK && k < n; k++) st = after_turn(o, eps[k], &c[k], &r[k], &next[k]);
    free(c), free(r), free(hist);
    if (st != RF_OK)
        for (int k = 0; k < n; k++) free(next[k].obs), next[k] = (rf_ep_next){0};
    return st;
}

/* ---- the one-process driver ------------------------------------------------------------ */

static const char *finish_name(rf_finish f) {
    return f == RF_FINISH_EOS ? "eos" : f == RF_FINISH_STOP ? "stop" : "length";
}

/* A turn ended: kept as the episode's pending turn, the slot queued for the environment. */
static rf_status on_turn(drv *d, int slot, const rf_rollout_sample *s) {
    rf_ep *e = &d->ep[slot];
    d->req[slot] = s->request_id, d->index[slot] = s->index;
    RF_TRY(rf_ep_turn_ended(e, s->tokens + s->turn_start, s->n_tokens - s->turn_start, s->text, s->text_len,
                            finish_name(s->finish), s->n_tokens));
    d->pending[d->n_pending++] = slot;
    return RF_OK;
}

/* An episode ended: its whole trajectory into out[slot]. */
static rf_status on_end(drv *d, int slot, const rf_rollout_sample *s) {
    rf_ep *e = &d->ep[slot];
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
    RF_TRY(rf_ep_turn_rewards(e, x->turn_rewards, x->n, &x->env_reward));
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

/* Submits group g: one request of n samples when every first observation is the same (the
 * prompt is prefilled once for the group), else one request per sample, seeded as sample i
 * of the group would be. */
static rf_status submit_group(rf_rollout *eng, const rf_episode_opts *o, const rf_rollout_request *tmpl,
                              rf_ep *ep, int g, int n, uint64_t seed) {
    int same = 1;
    for (int i = 1; i < n; i++) same = same && strcmp(ep[g * n + i].first_obs, ep[g * n].first_obs) == 0;
    rf_status st = RF_OK;
    for (int i = 0; st == RF_OK && i < (same ? 1 : n); i++) {
        const rf_reward_item *ex = &ep[g * n + i].ex;
        int32_t *obs, *prompt = NULL;
        int n_obs;
        RF_TRY(rf_ep_encode(o->tok, ep[g * n + i].first_obs, &obs, &n_obs));
        st = rf_ep_check_room(&ep[g * n + i], n_obs, o->max_total_tokens, rf_rollout_max_positions(eng));
        if (st == RF_OK && !(prompt = malloc(sizeof(int32_t) * (size_t)(ex->n_prompt_ids + n_obs + 1))))
            st = rf_error(RF_ERR_NOMEM, "out of memory");
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

/* Sends every pending turn to the environment in one call and acts on the answers. */
static rf_status answer_turns(rf_rollout *eng, rf_env *env, drv *d) {
    int n = d->n_pending;
    rf_ep **eps = malloc(sizeof *eps * (size_t)(n + 1));
    rf_ep_next *nx = calloc((size_t)n + 1, sizeof *nx);
    int *slots = malloc(sizeof(int) * (size_t)(n + 1));
    rf_status st = eps && nx && slots ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < n; k++) slots[k] = d->pending[k], eps[k] = &d->ep[slots[k]];
    d->n_pending = 0; /* ending an episode below delivers it (on_end), continuing queues nothing */
    if (st == RF_OK) st = rf_ep_step(env, d->o, eps, n, nx);
    for (int k = 0; st == RF_OK && k < n; k++) {
        int sl = slots[k];
        st = nx[k].end ? rf_rollout_end(eng, d->req[sl], d->index[sl])
                       : rf_rollout_continue(eng, d->req[sl], d->index[sl], nx[k].obs, nx[k].n_obs);
        if (st == RF_OK) st = d->st;
    }
    for (int k = 0; nx && k < n; k++) free(nx[k].obs);
    free(eps), free(nx), free(slots);
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
    size_t slots = (size_t)n_ep + 1;
    drv d = {o, calloc(slots, sizeof(rf_ep)), calloc(slots, sizeof(uint64_t)), calloc(slots, sizeof(int)), out,
             malloc(sizeof(int) * slots), 0, RF_OK};
    rf_status st = d.ep && d.req && d.index && d.pending ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < n_ep; k++) {
        d.ep[k].ex = ex[k / n];
        d.ep[k].ex.index = k % n;
        d.ep[k].id = episode_base + (uint64_t)k;
    }
    if (st == RF_OK) st = rf_ep_reset(env, d.ep, n_ep);
    for (int g = 0; st == RF_OK && g < n_groups; g++) st = submit_group(eng, o, req, d.ep, g, n, seed);
    rf_rollout_set_callback(eng, on_sample, &d);
    if (st == RF_OK) st = drive(eng, env, &d);
    rf_rollout_set_callback(eng, NULL, NULL);
    for (int k = 0; d.ep && k < n_ep; k++) rf_ep_free(&d.ep[k]);
    free(d.ep), free(d.req), free(d.index), free(d.pending);
    if (st != RF_OK)
        for (int k = 0; k < n_ep; k++) rf_episode_free(&out[k]);
    return st;
}
