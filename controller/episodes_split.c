/* Multi-turn episodes in runs of several processes: the controller's book of the episodes its
 * rollout workers run (controller/episodes_split.h). */
#define _POSIX_C_SOURCE 200809L
#include "controller/episodes_split.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "controller/episodes.h"
#include "controller/run_internal.h"

#define N_BUCKET 256 /* a power of 2 */

/* One GenerateRequest's episodes. */
typedef struct eps_group {
    uint64_t req;
    int n;
    int64_t group;          /* admission id; -1 validation */
    char *meta;             /* the example's metadata as JSON (the episodes' ex borrow it) */
    rf_ep *ep;              /* (n) */
    int *base;              /* (n) tokens after the prompt before the turn now generating */
    Rlflow__IntSeq *obs;    /* (n) first observations' ids */
    Rlflow__IntSeq **obs_p; /* (n) */
    struct eps_group *next; /* hash chain */
} eps_group;

/* The env/ sums of one training group's episodes, until its batch takes them. */
typedef struct eps_stats {
    int64_t group;
    double n, turns, trunc, reward, obs;
} eps_stats;

struct rf_split_eps {
    rf_run *run;
    rf_episode_opts o;
    int positions;          /* the model's position limit; 0: not known (the rollout worker checks) */
    eps_group *bucket[N_BUCKET];
    eps_stats *stats;       /* (n_stats) training groups whose episodes ended, not yet in a batch */
    int n_stats, cap_stats;
};

static eps_group **slot_of(rf_split_eps *x, uint64_t req) { return &x->bucket[req & (N_BUCKET - 1)]; }

static eps_group *find(const rf_split_eps *x, uint64_t req) {
    for (eps_group *g = x->bucket[req & (N_BUCKET - 1)]; g; g = g->next)
        if (g->req == req) return g;
    return NULL;
}

static void group_free(eps_group *g) {
    if (!g) return;
    for (int i = 0; g->ep && i < g->n; i++) rf_ep_free(&g->ep[i]);
    for (int i = 0; g->obs && i < g->n; i++) free(g->obs[i].v);
    free(g->ep), free(g->base), free(g->obs), free(g->obs_p), free(g->meta), free(g);
}

rf_status rf_split_eps_open(rf_split_eps **out, rf_run *run) {
    *out = NULL;
    if (!run->env.call) return RF_OK;
    rf_split_eps *x = calloc(1, sizeof *x);
    if (!x) return rf_error(RF_ERR_NOMEM, "out of memory");
    const rf_recipe *r = run->r;
    x->run = run, x->o = (rf_episode_opts){r->env.max_turns, r->env.max_total_tokens, run->tok};
    *out = x;
    return RF_OK;
}

void rf_split_eps_set_positions(rf_split_eps *x, int positions) {
    if (x) x->positions = positions;
}

void rf_split_eps_close(rf_split_eps *x) {
    if (!x) return;
    for (int b = 0; b < N_BUCKET; b++)
        while (x->bucket[b]) {
            eps_group *g = x->bucket[b];
            x->bucket[b] = g->next;
            group_free(g);
        }
    free(x->stats), free(x);
}

void rf_split_eps_forget(rf_split_eps *x, uint64_t req) {
    if (!x) return;
    for (eps_group **p = slot_of(x, req); *p; p = &(*p)->next)
        if ((*p)->req == req) {
            eps_group *g = *p;
            *p = g->next;
            group_free(g);
            return;
        }
}

/* The group's first observations as ids: q->first_observations stays empty when every one is
 * empty (a plain prompt). One that leaves no room for the episode fails here, where who
 * answered it is known, rather than in the rollout worker's engine. */
static rf_status first_observations(rf_split_eps *x, eps_group *g, Rlflow__GenerateRequest *q) {
    int any = 0;
    for (int i = 0; i < g->n; i++) {
        int32_t *ids;
        int n;
        rlflow__int_seq__init(&g->obs[i]);
        RF_TRY(rf_ep_encode(x->o.tok, g->ep[i].first_obs, &ids, &n));
        g->obs[i].v = ids, g->obs[i].n_v = (size_t)n, g->obs_p[i] = &g->obs[i];
        RF_TRY(rf_ep_check_room(&g->ep[i], n, x->o.max_total_tokens, x->positions));
        any |= n > 0;
    }
    q->episode = 1;
    q->n_first_observations = any ? (size_t)g->n : 0, q->first_observations = g->obs_p;
    return RF_OK;
}

/* The episode ids of a group, as the one-process loop numbers them: training group `group`
 * is prompt group % P of step group / P (round 0), validation from 2^63. */
static uint64_t episode_base(const rf_split_eps *x, int64_t group, uint64_t req, int n) {
    int P = x->run->r->rollout.prompts_per_step;
    if (group < 0) return (1ull << 63) + req * (uint64_t)n;
    return ((uint64_t)(group / P) << 32) + (uint64_t)(group % P) * (uint64_t)n;
}

rf_status rf_split_eps_begin(rf_split_eps *x, Rlflow__GenerateRequest *q, const rf_example *ex, int n, int64_t group) {
    uint64_t base = episode_base(x, group, q->request_id, n);
    if (find(x, q->request_id))
        return rf_error(RF_ERR_INTERNAL, "episodes: request %llu opened twice", (unsigned long long)q->request_id);
    eps_group *g = calloc(1, sizeof *g);
    if (g) g->ep = calloc((size_t)n, sizeof *g->ep), g->base = calloc((size_t)n, sizeof(int));
    if (g) g->obs = calloc((size_t)n, sizeof *g->obs), g->obs_p = calloc((size_t)n, sizeof *g->obs_p);
    if (!g || !g->ep || !g->base || !g->obs || !g->obs_p) {
        group_free(g);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    g->req = q->request_id, g->n = n, g->group = group;
    g->meta = cJSON_PrintUnformatted(ex->extra);
    for (int i = 0; i < n; i++) {
        g->ep[i].ex = (rf_reward_item){ex->prompt_text, NULL, ex->prompt_ids, ex->n_prompt, NULL, 0, ex->answer,
                                       g->meta, i, group};
        g->ep[i].id = base + (uint64_t)i;
    }
    eps_group **b = slot_of(x, g->req);
    g->next = *b, *b = g;
    rf_status st = rf_ep_reset(&x->run->env, g->ep, n);
    if (st == RF_OK) st = first_observations(x, g, q);
    return st; /* on error the group stays in the book (freed by forget or close) */
}

/* ---- turns -------------------------------------------------------------------------------- */

/* The episode of turn t, checked against the book: outstanding, in order, its tokens counted. */
static rf_status turn_episode(rf_split_eps *x, const char *who, const Rlflow__EndedTurn *t, eps_group **gp, rf_ep **ep) {
    unsigned long long req = (unsigned long long)t->request_id;
    eps_group *g = find(x, t->request_id);
    if (!g) return rf_error(RF_ERR_FORMAT, "%s sent EnvTurns for request %llu, which is not an outstanding episode", who, req);
    if (t->index < 0 || t->index >= g->n)
        return rf_error(RF_ERR_FORMAT, "%s sent EnvTurns for request %llu: index %d, outside its %d samples", who, req,
                        t->index, g->n);
    rf_ep *e = &g->ep[t->index];
    if (e->ended || e->pending || t->turn != e->n_turns)
        return rf_error(RF_ERR_FORMAT, "%s sent EnvTurns for request %llu sample %d: turn %d, the episode %s", who, req,
                        t->index, t->turn, e->ended ? "has ended" : e->pending ? "waits for its last turn's answer" : "expects another turn");
    int want = g->base[t->index] + (int)t->n_ids;
    if (t->n_ids < 1 || t->used != want || t->used > x->o.max_total_tokens)
        return rf_error(RF_ERR_FORMAT, "%s sent EnvTurns for request %llu sample %d turn %d: %zu ids and used %d (expected "
                        "at least 1 id and used = %d, at most env.max_total_tokens = %d)", who, req, t->index, t->turn,
                        t->n_ids, t->used, want, x->o.max_total_tokens);
    const char *f = t->finish ? t->finish : "";
    if (strcmp(f, "eos") && strcmp(f, "stop") && strcmp(f, "length"))
        return rf_error(RF_ERR_FORMAT, "%s sent EnvTurns for request %llu sample %d turn %d: finish \"%.32s\" (eos, stop or length)",
                        who, req, t->index, t->turn, f);
    *gp = g, *ep = e;
    return RF_OK;
}

static const char *finish_const(const char *f) { return !strcmp(f, "eos") ? "eos" : !strcmp(f, "stop") ? "stop" : "length"; }

void rf_split_eps_reply_free(Rlflow__EnvObservations *reply) {
    for (size_t k = 0; reply->answers && k < reply->n_answers; k++) free(reply->answers[k]->observation_ids);
    if (reply->answers) free(reply->answers[0]);
    free(reply->answers);
    rlflow__env_observations__init(reply);
}

rf_status rf_split_eps_turns(rf_split_eps *x, const char *who, const Rlflow__EnvTurns *m, Rlflow__EnvObservations *reply) {
    int n = (int)m->n_turns;
    rlflow__env_observations__init(reply);
    if (n < 1) return rf_error(RF_ERR_FORMAT, "%s sent an empty EnvTurns", who);
    /* test hook: answer no turn (the rollout worker's deadline, tests/test_split_env.c) */
    if (getenv("RF_TEST_IGNORE_TURNS")) return RF_OK;
    rf_ep **eps = calloc((size_t)n, sizeof *eps);
    eps_group **gs = calloc((size_t)n, sizeof *gs);
    rf_ep_next *nx = calloc((size_t)n, sizeof *nx);
    Rlflow__TurnAnswer *a = calloc((size_t)n, sizeof *a);
    reply->answers = calloc((size_t)n, sizeof *reply->answers);
    rf_status st = eps && gs && nx && a && reply->answers ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < n; k++) {
        const Rlflow__EndedTurn *t = m->turns[k];
        st = turn_episode(x, who, t, &gs[k], &eps[k]);
        const char *text = t->text ? t->text : "";
        if (st == RF_OK)
            st = rf_ep_turn_ended(eps[k], t->ids, (int)t->n_ids, text, strlen(text), finish_const(t->finish), t->used);
    }
    if (st == RF_OK) st = rf_ep_step(&x->run->env, &x->o, eps, n, nx);
    for (int k = 0; st == RF_OK && k < n; k++) {
        const Rlflow__EndedTurn *t = m->turns[k];
        rlflow__turn_answer__init(&a[k]);
        a[k].request_id = t->request_id, a[k].index = t->index, a[k].end = nx[k].end;
        a[k].observation_ids = nx[k].obs, a[k].n_observation_ids = (size_t)nx[k].n_obs, nx[k].obs = NULL;
        gs[k]->base[t->index] = t->used + nx[k].n_obs;
        reply->answers[k] = &a[k];
        reply->n_answers = (size_t)k + 1;
    }
    for (int k = 0; nx && k < n; k++) free(nx[k].obs);
    free(eps), free(gs), free(nx);
    if (!reply->n_answers) free(a); /* else freed with reply->answers[0] */
    if (st != RF_OK) rf_split_eps_reply_free(reply);
    return st;
}

/* ---- samples ------------------------------------------------------------------------------ */

/* m agrees with e's turns: every turn's ids at its place and in the loss, no other token in
 * it, the mask's length and values. */
static rf_status check_sample(const char *who, const Rlflow__Sample *m, const rf_ep *e) {
    unsigned long long req = (unsigned long long)m->request_id;
    int n = (int)m->n_tokens;
    if (!e->ended || e->pending)
        return rf_error(RF_ERR_FORMAT, "%s sent the Sample of request %llu sample %d before its episode ended", who, req, m->index);
    if (m->loss_mask.len != (size_t)n)
        return rf_error(RF_ERR_FORMAT, "%s sent a malformed Sample for request %llu: loss_mask has %zu values for %d tokens",
                        who, req, m->loss_mask.len, n);
    int in_loss = 0, turn_ids = 0;
    for (int t = 0; t < n; t++) {
        if (m->loss_mask.data[t] > 1)
            return rf_error(RF_ERR_FORMAT, "%s sent a malformed Sample for request %llu: loss_mask[%d] = %d (0 or 1)", who,
                            req, t, m->loss_mask.data[t]);
        in_loss += m->loss_mask.data[t];
    }
    for (int k = 0; k < e->n_turns; k++) {
        const rf_ep_turn *t = &e->turns[k];
        int first = t->end - t->n_ids + 1;
        turn_ids += t->n_ids;
        for (int j = 0; first >= 0 && t->end < n && j < t->n_ids; j++)
            if (m->tokens[first + j] != t->ids[j] || !m->loss_mask.data[first + j]) first = -1;
        if (first < 0 || t->end >= n)
            return rf_error(RF_ERR_FORMAT, "%s sent a malformed Sample for request %llu: tokens or loss_mask disagree with "
                            "turn %d (%d ids ending at token %d of %d)", who, req, k, t->n_ids, t->end, n);
    }
    if (in_loss != turn_ids || n != e->used)
        return rf_error(RF_ERR_FORMAT, "%s sent a malformed Sample for request %llu: %d tokens, %d in loss_mask; its %d turns "
                        "generated %d of %d tokens", who, req, n, in_loss, e->n_turns, turn_ids, e->used);
    return RF_OK;
}

/* The sample's arrays from m and the group's prompt and first observation. */
static rf_status fill_sample(const Rlflow__Sample *m, const rf_example *ex, const Rlflow__IntSeq *obs, rf_train_sample *s) {
    int nr = (int)m->n_tokens, no = obs ? (int)obs->n_v : 0;
    s->n_prompt = ex->n_prompt + no, s->n_resp = nr;
    s->tokens = malloc(sizeof(int32_t) * (size_t)(s->n_prompt + nr));
    RF_TRY(s->tokens ? rf_train_sample_alloc(s) : rf_error(RF_ERR_NOMEM, "out of memory"));
    memcpy(s->tokens, ex->prompt_ids, sizeof(int32_t) * (size_t)ex->n_prompt);
    if (no) memcpy(s->tokens + ex->n_prompt, obs->v, sizeof(int32_t) * (size_t)no);
    memcpy(s->tokens + s->n_prompt, m->tokens, sizeof(int32_t) * (size_t)nr);
    memcpy(s->behav_logp, m->logprobs, sizeof(float) * (size_t)nr);
    s->loss_mask = malloc((size_t)nr);
    if (!s->loss_mask) return rf_error(RF_ERR_NOMEM, "out of memory");
    memcpy(s->loss_mask, m->loss_mask.data, (size_t)nr);
    return RF_OK;
}

static eps_stats *stats_of(rf_split_eps *x, int64_t group) {
    for (int k = 0; k < x->n_stats; k++)
        if (x->stats[k].group == group) return &x->stats[k];
    return NULL;
}

/* Training episode e of admission group `group` ended as sample s: into its group's sums. */
static rf_status add_stats(rf_split_eps *x, int64_t group, const rf_ep *e, double env_reward, const rf_train_sample *s) {
    eps_stats *p = stats_of(x, group);
    if (!p) {
        if (x->n_stats == x->cap_stats) {
            int cap = x->cap_stats ? 2 * x->cap_stats : 16;
            eps_stats *q = realloc(x->stats, sizeof *q * (size_t)cap);
            if (!q) return rf_error(RF_ERR_NOMEM, "out of memory");
            x->stats = q, x->cap_stats = cap;
        }
        p = &x->stats[x->n_stats++];
        *p = (eps_stats){.group = group};
    }
    double obs = 0;
    for (int t = 0; t < s->n_resp; t++) obs += !s->loss_mask[t];
    p->n++, p->turns += e->n_turns, p->trunc += e->truncated, p->reward += env_reward, p->obs += obs;
    return RF_OK;
}

rf_status rf_split_eps_sample(rf_split_eps *x, const char *who, const Rlflow__Sample *m, const rf_example *ex,
                              rf_train_sample *s) {
    unsigned long long req = (unsigned long long)m->request_id;
    eps_group *g = find(x, m->request_id);
    if (!g || m->index < 0 || m->index >= g->n)
        return rf_error(RF_ERR_FORMAT, "%s sent a Sample for request %llu sample %d, which is not an outstanding episode", who,
                        req, m->index);
    const rf_ep *e = &g->ep[m->index];
    const Rlflow__IntSeq *obs = g->obs[m->index].n_v ? &g->obs[m->index] : NULL;
    int want_prompt = ex->n_prompt + (obs ? (int)obs->n_v : 0);
    if (m->prompt_len != want_prompt)
        return rf_error(RF_ERR_FORMAT, "%s sent a malformed Sample for request %llu: prompt_len %d, the prompt and first "
                        "observation are %d tokens", who, req, m->prompt_len, want_prompt);
    RF_TRY(check_sample(who, m, e));
    RF_TRY(fill_sample(m, ex, obs, s));
    int nr = s->n_resp;
    float *tr = calloc((size_t)nr, sizeof *tr);
    if (!tr) return rf_error(RF_ERR_NOMEM, "out of memory");
    double env_reward;
    rf_status st = rf_ep_turn_rewards(e, tr, nr, &env_reward);
    int any = 0;
    for (int t = 0; t < nr; t++) any |= tr[t] != 0.0f;
    if (st == RF_OK && any) s->token_rewards = tr, tr = NULL;
    free(tr);
    size_t len;
    if (st == RF_OK) st = rf_tokenizer_decode(x->run->tok, m->tokens, nr, 1, &s->text, &len);
    const char *last = e->n_turns ? e->turns[e->n_turns - 1].action : "";
    if (st == RF_OK) st = rf_reward_rules_score(x->run->rules, last, nr, ex->answer, &s->reward, &s->accuracy);
    s->rule_reward = s->reward;
    if (st == RF_OK && g->group >= 0) st = add_stats(x, g->group, e, env_reward, s);
    return st;
}

const char *rf_split_eps_last_text(const rf_split_eps *x, uint64_t req, int index) {
    const eps_group *g = x ? find(x, req) : NULL;
    if (!g || index < 0 || index >= g->n || !g->ep[index].n_turns) return "";
    return g->ep[index].turns[g->ep[index].n_turns - 1].action;
}

void rf_split_eps_metrics(rf_split_eps *x, const int64_t *groups, int n_groups, rf_metrics *m) {
    if (!x) return;
    double n = 0, turns = 0, trunc = 0, reward = 0, obs = 0;
    for (int i = 0; i < n_groups; i++) {
        eps_stats *p = stats_of(x, groups[i]);
        if (!p) continue;
        n += p->n, turns += p->turns, trunc += p->trunc, reward += p->reward, obs += p->obs;
        *p = x->stats[--x->n_stats];
    }
    n = n ? n : 1;
    rf_metrics_set(m, "env/turns_mean", turns / n);
    rf_metrics_set(m, "env/truncated_frac", trunc / n);
    rf_metrics_set(m, "env/reward_mean", reward / n);
    rf_metrics_set(m, "env/observation_tokens_mean", obs / n);
    rf_env *env = &x->run->env;
    if (env->take_stats) {
        rf_env_stats st = env->take_stats(env->ctx);
        rf_metrics_set(m, "env/rejected", st.rejected);
        rf_metrics_set(m, "env/resent", st.resent);
        rf_metrics_set(m, "env/lost", st.lost);
    }
}

void rf_split_eps_dropped(rf_split_eps *x, int64_t group) {
    eps_stats *p = x ? stats_of(x, group) : NULL;
    if (p) *p = x->stats[--x->n_stats];
}
