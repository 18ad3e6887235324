/* Multi-turn episodes in a run ([env], docs/env-api.md): the environment opened from the recipe,
 * a step's samples generated as episodes (controller/episodes.h) and turned into training
 * samples, validation by greedy episodes, and the env/ metrics. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/episodes.h"
#include "controller/run_internal.h"
#include "env/bridge.h"
#include "env/calculator.h"

rf_status rf__env_open(rf_run *run) {
    const rf_recipe *r = run->r;
    if (!r->env.type[0]) return RF_OK;
    if (strcmp(r->env.type, "calculator") == 0) return rf_calculator_env(&run->env);
    rf_env_bridge *x;
    RF_TRY(rf__env_bridge_open(run, &x));
    rf_env_bridge_as_env(x, &run->env);
    return RF_OK;
}

/* The engine request of the run's episodes: [rollout]'s sampling, turn limit and stops, with
 * the calculator's "</calc>" added for env.type = "calculator". */
static rf_rollout_request episode_request(const rf_run *run, int greedy) {
    const rf_recipe *r = run->r;
    rf_rollout_request q = {.sampling = {greedy, (float)r->rollout.temperature, r->rollout.top_k,
                                         (float)r->rollout.top_p},
                            .max_new_tokens = r->rollout.max_new_tokens, .stop_ids = run->eos,
                            .n_stop_ids = run->n_eos};
    int calc = strcmp(r->env.type, "calculator") == 0, has = 0;
    for (int i = 0; i < r->rollout.stop.n && q.n_stop < RF_MAX_STOP; i++) {
        q.stop[q.n_stop++] = r->rollout.stop.v[i];
        has |= strcmp(r->rollout.stop.v[i], RF_CALC_STOP) == 0;
    }
    if (calc && !has && q.n_stop < RF_MAX_STOP) q.stop[q.n_stop++] = RF_CALC_STOP;
    return q;
}

/* The example fields of ex (metadata as JSON into *meta, the caller frees); group is the
 * group_id the environment sees (the admission id, -1 for validation). */
static rf_reward_item example_item(const rf_example *ex, int64_t group, char **meta) {
    *meta = cJSON_PrintUnformatted(ex->extra);
    return (rf_reward_item){ex->prompt_text, NULL, ex->prompt_ids, ex->n_prompt, NULL, 0, ex->answer, *meta, 0, group};
}

/* Moves episode e into training sample s, scored by the reward rules on its last turn. */
static rf_status to_sample(rf_run *run, rf_episode *e, const rf_example *ex, int group, rf_train_sample *s) {
    memset(s, 0, sizeof *s);
    s->n_prompt = e->n_prompt, s->n_resp = e->n, s->group = group;
    s->tokens = malloc(sizeof(int32_t) * (size_t)(e->n_prompt + e->n));
    RF_TRY(s->tokens ? rf_train_sample_alloc(s) : rf_error(RF_ERR_NOMEM, "out of memory"));
    memcpy(s->tokens, e->prompt, sizeof(int32_t) * (size_t)e->n_prompt);
    memcpy(s->tokens + e->n_prompt, e->ids, sizeof(int32_t) * (size_t)e->n);
    memcpy(s->behav_logp, e->logp, sizeof(float) * (size_t)e->n);
    memcpy(s->versions, e->versions, sizeof(int) * (size_t)e->n);
    s->loss_mask = e->mask, e->mask = NULL;
    int any = 0;
    for (int t = 0; t < e->n; t++) any |= e->turn_rewards[t] != 0.0f;
    if (any) s->token_rewards = e->turn_rewards, e->turn_rewards = NULL;
    s->text = e->text ? e->text : rf_strdup(""), e->text = NULL;
    RF_TRY(rf_reward_rules_score(run->rules, e->last_text, e->n, ex->answer, &s->reward, &s->accuracy));
    s->rule_reward = s->reward;
    return RF_OK;
}

/* Per-step sums for the env/ metrics. */
static void add_metrics(rf_run *run, const rf_episode *e, int n) {
    double turns = 0, trunc = 0, env_r = 0, obs = 0;
    for (int i = 0; i < n; i++) {
        turns += e[i].turns, trunc += e[i].truncated, env_r += e[i].env_reward;
        for (int t = 0; t < e[i].n; t++) obs += !e[i].mask[t];
    }
    rf_metrics_set(run->metrics, "env/turns_mean", n ? turns / n : 0);
    rf_metrics_set(run->metrics, "env/truncated_frac", n ? trunc / n : 0);
    rf_metrics_set(run->metrics, "env/reward_mean", n ? env_r / n : 0);
    rf_metrics_set(run->metrics, "env/observation_tokens_mean", n ? obs / n : 0);
    if (run->env.take_stats) {
        rf_env_stats st = run->env.take_stats(run->env.ctx);
        rf_metrics_set(run->metrics, "env/rejected", st.rejected);
        rf_metrics_set(run->metrics, "env/resent", st.resent);
        rf_metrics_set(run->metrics, "env/lost", st.lost);
    }
}

rf_status rf__generate_episodes(rf_run *run, const rf_example *const *ex, const int64_t *group_ids, int n_prompts,
                                int round, rf_train_sample *out, double *tokens) {
    const rf_recipe *r = run->r;
    int n = r->rollout.n, n_ep = n_prompts * n;
    rf_reward_item *items = calloc((size_t)n_prompts + 1, sizeof *items);
    char **meta = calloc((size_t)n_prompts + 1, sizeof *meta);
    rf_episode *eps = calloc((size_t)n_ep + 1, sizeof *eps);
    rf_status st = items && meta && eps ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int p = 0; st == RF_OK && p < n_prompts; p++) items[p] = example_item(ex[p], group_ids[p], &meta[p]);
    rf_episode_opts eo = {r->env.max_turns, r->env.max_total_tokens, run->tok};
    rf_rollout_request q = episode_request(run, 0);
    uint64_t seed = ((uint64_t)r->train.seed << 40) ^ ((uint64_t)run->step << 16) ^ ((uint64_t)round << 8);
    uint64_t base = ((uint64_t)run->step << 32) | ((uint64_t)round << 24);
    rf_rollout_set_version(run->engine, run->step);
    if (st == RF_OK) st = rf__rollout_resume(run->engine);
    if (st == RF_OK) st = rf_episodes_run(run->engine, &run->env, &eo, items, n_prompts, n, &q, seed, base, eps);
    if (st == RF_OK) st = rf__rollout_pause(r, run->engine, -1);
    if (st == RF_OK) add_metrics(run, eps, n_ep);
    for (int k = 0; st == RF_OK && k < n_ep; k++) {
        st = to_sample(run, &eps[k], ex[k / n], k / n, &out[k]);
        *tokens += eps[k].n;
    }
    for (int k = 0; eps && k < n_ep; k++) rf_episode_free(&eps[k]);
    for (int p = 0; meta && p < n_prompts; p++) free(meta[p]);
    free(items), free(meta), free(eps);
    return st;
}

rf_status rf__val_episodes(rf_run *run, const rf_role_gen *q, int n, rf_train_sample *out) {
    const rf_recipe *r = run->r;
    rf_reward_item *items = calloc((size_t)n + 1, sizeof *items);
    char **meta = calloc((size_t)n + 1, sizeof *meta);
    rf_episode *eps = calloc((size_t)n + 1, sizeof *eps);
    rf_status st = items && meta && eps ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for validation");
    for (int i = 0; st == RF_OK && i < n; i++) items[i] = example_item(q[i].ex, q[i].group_id, &meta[i]);
    /* validation episodes are numbered 2^63 + the request's id (unique in the run, consecutive in
     * a pass), as a split run numbers them: apart from training's, and never reused by a later
     * pass */
    for (int i = 1; st == RF_OK && i < n; i++)
        if (q[i].req != q[0].req + (uint64_t)i)
            st = rf_error(RF_ERR_INTERNAL, "validation episodes: request %d has id %llu, not %llu", i,
                          (unsigned long long)q[i].req, (unsigned long long)(q[0].req + (uint64_t)i));
    rf_episode_opts eo = {r->env.max_turns, r->env.max_total_tokens, run->tok};
    rf_rollout_request rq = episode_request(run, 1);
    rf_rollout_set_version(run->engine, run->step);
    if (st == RF_OK) st = rf__rollout_resume(run->engine);
    uint64_t base = (1ull << 63) + (n ? q[0].req : 0);
    if (st == RF_OK) st = rf_episodes_run(run->engine, &run->env, &eo, items, n, 1, &rq, 0, base, eps);
    if (st == RF_OK) st = rf__rollout_pause(r, run->engine, -1);
    if (run->env.take_stats) run->env.take_stats(run->env.ctx); /* training's metrics count training's calls */
    for (int i = 0; st == RF_OK && i < n; i++) {
        st = to_sample(run, &eps[i], q[i].ex, 0, &out[i]);
        /* the training reward definition (rf__val_score): the rules score the last turn, the
         * reward model and programs the whole response (out[i].text) */
        if (st == RF_OK) out[i].rules_text = rf_strdup(eps[i].last_text ? eps[i].last_text : "");
        if (st == RF_OK && !out[i].rules_text) st = rf_error(RF_ERR_NOMEM, "out of memory for validation");
    }
    for (int i = 0; eps && i < n; i++) rf_episode_free(&eps[i]);
    for (int i = 0; meta && i < n; i++) free(meta[i]);
    free(items), free(meta), free(eps);
    return st;
}
