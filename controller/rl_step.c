/* One RL step of the one-process loop: the driving that differs from the split controller's
 * (a step's prompts generated on the engine at once, the whole batch scored at once, dynamic
 * sampling in rounds, the roles called directly); what both compute is controller/rl_core.c's.
 * Each phase talks to a role through the shapes the message API carries: a generate request
 * (prompts, n, sampling, seed, version) in and samples out; samples in and per-token log-probs
 * or values out; a train batch in and statistics out. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/run_internal.h"
#include "rollout/rollout.h"

typedef struct step_buf {
    rf_train_sample *s;
    const rf_example **ex; /* (n_prompts) */
    int n, cap;
} step_buf;

static void buf_free(step_buf *b) {
    for (int i = 0; i < b->n; i++) rf_train_sample_free(&b->s[i]);
    free(b->s), free(b->ex);
    memset(b, 0, sizeof *b);
}

/* Where the rollout engine's callback puts each finished sample. */
typedef struct gen_sink {
    rf_run *run;
    const rf_example *const *ex;
    rf_train_sample *out;
    int n;
    double tokens;
    rf_status st;
} gen_sink;

/* Rollout role output, one sample at a time as each finishes (streaming): the sample's tokens,
 * behaviour log-probs and versions, scored at once by the reward rules. */
static void on_sample(void *ctx, const rf_rollout_sample *rs) {
    gen_sink *g = ctx;
    int p = (int)(intptr_t)rs->user;
    rf_train_sample *s = &g->out[p * g->n + rs->index];
    if (g->st != RF_OK) return;
    memset(s, 0, sizeof *s);
    s->group = p;
    g->st = rf__sample_init(g->run, s, rs->prompt, rs->prompt_len, rs->tokens, rs->logprobs, rs->n_tokens, rs->text,
                            g->ex[p]->answer);
    if (g->st != RF_OK) return;
    memcpy(s->versions, rs->versions, sizeof(int) * (size_t)s->n_resp);
    g->tokens += s->n_resp;
}

/* Rollout role: a generate request per prompt (n samples, sampling parameters, seed derived
 * from train.seed, the step and the round), run by the engine until every sample is back. */
static rf_status generate(rf_run *run, const rf_example *const *ex, int n_prompts, int round,
                          rf_train_sample *out, double *tokens) {
    if (run->env.call) return rf__generate_episodes(run, ex, n_prompts, round, out, tokens); /* [env] */
    const rf_recipe *r = run->r;
    gen_sink g = {run, ex, out, r->rollout.n, 0, RF_OK};
    rf_rollout_set_callback(run->engine, on_sample, &g);
    rf_rollout_set_version(run->engine, run->step);
    rf_status st = RF_OK;
    for (int p = 0; st == RF_OK && p < n_prompts; p++) {
        rf_rollout_request q = {.prompt = ex[p]->prompt_ids, .prompt_len = ex[p]->n_prompt,
                                .n = r->rollout.n,
                                .sampling = {0, (float)r->rollout.temperature, r->rollout.top_k,
                                             (float)r->rollout.top_p},
                                .max_new_tokens = r->rollout.max_new_tokens,
                                .seed = rf__group_seed(r, run->step, round, p),
                                .stop_ids = run->eos, .n_stop_ids = run->n_eos};
        for (int i = 0; i < r->rollout.stop.n && i < RF_MAX_STOP; i++) q.stop[q.n_stop++] = r->rollout.stop.v[i];
        st = rf_rollout_submit(run->engine, &q, (void *)(intptr_t)p, NULL);
    }
    if (st == RF_OK) st = rf__rollout_resume(run->engine);
    if (st == RF_OK) st = rf_rollout_run_until_idle(run->engine);
    if (st == RF_OK) st = rf__rollout_pause(r, run->engine, -1);
    rf_rollout_set_callback(run->engine, NULL, NULL);
    *tokens += g.tokens;
    return st != RF_OK ? st : g.st;
}

/* Reward model role: score full sequences, added with reward.model_weight. */
static rf_status reward_model(rf_run *run, rf_train_sample *s, int n) {
    if (!run->rm) return RF_OK;
    float *sc = malloc(sizeof(float) * (size_t)(n ? n : 1));
    rf_status st = sc ? rf__reward_model_scores(run->rm, s, n, sc) : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) {
        s[i].rm_score = sc[i];
        s[i].reward += (float)run->r->reward.model_weight * sc[i];
    }
    free(sc);
    return st;
}

/* External reward programs: the whole batch goes out, scores come back per sample. */
static rf_status external_reward(rf_run *run, const rf_example *const *ex, rf_train_sample *s, int n) {
    if (!run->ext) return RF_OK;
    RF_TRY(rf__external_score(run, ex, s, n, run->r->rollout.n, 0));
    rf__external_metrics(run, run->metrics);
    return RF_OK;
}

/* Fills b with prompts_per_step groups (fewer when dynamic sampling runs out of rounds). */
static rf_status collect(rf_run *run, step_buf *b, double *gen_tokens, int *dropped) {
    const rf_recipe *r = run->r;
    int P = r->rollout.prompts_per_step, n = r->rollout.n;
    b->cap = P * n;
    b->s = calloc((size_t)b->cap, sizeof *b->s);
    b->ex = calloc((size_t)P, sizeof *b->ex);
    rf_train_sample *tmp = calloc((size_t)b->cap, sizeof *tmp);
    const rf_example **ex = calloc((size_t)P, sizeof *ex);
    if (!b->s || !b->ex || !tmp || !ex) {
        free(tmp), free(ex);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    int groups = 0;
    rf_status st = RF_OK;
    for (int round = 0; st == RF_OK && groups < P; round++) {
        int want = P - groups;
        st = rf_dataset_next(run->train, &run->pos, want, ex);
        if (st == RF_OK) st = generate(run, ex, want, round, tmp, gen_tokens);
        if (st == RF_OK) st = reward_model(run, tmp, want * n);
        if (st == RF_OK) st = external_reward(run, ex, tmp, want * n);
        for (int g = 0; st == RF_OK && g < want; g++) {
            int keep = !r->algorithm.dynamic_sampling || rf__group_informative(tmp + g * n, n) ||
                       round >= r->algorithm.max_resample_rounds;
            if (!keep) {
                (*dropped)++;
                for (int j = 0; j < n; j++) rf_train_sample_free(&tmp[g * n + j]);
                continue;
            }
            for (int j = 0; j < n; j++) {
                b->s[groups * n + j] = tmp[g * n + j];
                b->s[groups * n + j].group = groups;
            }
            b->ex[groups++] = ex[g];
        }
        b->n = groups * n;
    }
    free(tmp), free(ex);
    return st;
}

typedef struct phase_times {
    double generate, reference, critic, prox, actor, critic_train;
} phase_times;

/* Reference, proximal log-probs and critic values for the whole batch. */
static rf_status score(rf_run *run, step_buf *b, phase_times *pt) {
    const rf_recipe *r = run->r;
    int n = b->n, mt = r->train.micro_batch_tokens;
    float **ptrs = malloc(sizeof(float *) * (size_t)(n ? n : 1));
    if (!ptrs) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = RF_OK;
    double t = rf_time_now();
    if (run->ref) {
        for (int i = 0; i < n; i++) ptrs[i] = b->s[i].ref_logp;
        st = rf_actor_logprobs(run->ref, b->s, n, mt, 1.0f / (float)r->rollout.temperature, ptrs, NULL);
    }
    pt->reference = rf_time_now() - t, t = rf_time_now();
    /* The proximal policy equals the behaviour policy here (generation used the current
     * weights); recompute only when several updates reuse the batch or the objective asks. */
    int recompute = r->train.ppo_epochs > 1 || r->train.mini_batches > 1;
    for (int i = 0; st == RF_OK && i < n; i++) {
        ptrs[i] = b->s[i].prox_logp;
        if (!recompute) memcpy(b->s[i].prox_logp, b->s[i].behav_logp, sizeof(float) * (size_t)b->s[i].n_resp);
    }
    if (st == RF_OK && recompute)
        st = rf_actor_logprobs(run->actor, b->s, n, mt, 1.0f / (float)r->rollout.temperature, ptrs, NULL);
    pt->prox = rf_time_now() - t, t = rf_time_now();
    if (st == RF_OK && run->critic) {
        for (int i = 0; i < n; i++) ptrs[i] = b->s[i].values;
        st = rf_critic_values(run->critic, b->s, n, mt, ptrs);
    }
    pt->critic = rf_time_now() - t;
    free(ptrs);
    return st;
}

static rf_update_opts update_opts(const rf_run *run, int critic) {
    return rf__update_opts(run->r, run->kl.beta, run->kl_est, run->agg, run->step, critic);
}

rf_status rf__rl_step(rf_run *run) {
    step_buf b = {0};
    phase_times pt = {0};
    double gen_tokens = 0, mean_kl = 0, t = rf_time_now();
    int dropped = 0;
    rf_status st = collect(run, &b, &gen_tokens, &dropped);
    pt.generate = rf_time_now() - t;
    if (st == RF_OK) st = score(run, &b, &pt);
    if (st == RF_OK) st = rf__advantages(run->r, run->adv_kind, run->kl.beta, run->ref != NULL, b.s, b.n, &mean_kl);
    rf_update_stats as = {0}, cs = {0};
    t = rf_time_now();
    rf_optim_opts ao = rf__optim_opts(run->r, 0), co = rf__optim_opts(run->r, 1);
    rf_update_opts uo = update_opts(run, 0), uc = update_opts(run, 1);
    if (st == RF_OK && b.n > 0) st = rf_actor_update(run->actor, &ao, &uo, b.s, b.n, &as);
    pt.actor = rf_time_now() - t, t = rf_time_now();
    if (st == RF_OK && run->critic && b.n > 0) st = rf_critic_update(run->critic, &co, &uc, b.s, b.n, &cs);
    pt.critic_train = rf_time_now() - t;
    if (rf_recipe_free_kv_cache(run->r)) /* training pauses: its workspaces go back, for the KV cache */
        rf_model_trim(run->actor), rf_model_trim(run->critic), rf_model_trim(run->ref);
    if (st == RF_OK) {
        rf__batch_metrics(run->metrics, run->r, b.s, b.n);
        rf__update_metrics(run->metrics, run->r, &as, run->critic ? &cs : NULL);
        if (run->ref) rf_metrics_set(run->metrics, "actor/kl_ref", mean_kl);
        rf_metrics_set(run->metrics, "actor/kl_coef", run->kl.beta);
        rf_kl_ctl_update(&run->kl, (float)mean_kl, b.n);
        if (run->r->algorithm.dynamic_sampling) rf_metrics_set(run->metrics, "rollout/dropped_groups", dropped);
        double total = pt.generate + pt.reference + pt.prox + pt.critic + pt.actor + pt.critic_train;
        rf_metrics_set(run->metrics, "perf/gen_tokens_per_s", gen_tokens / fmax(pt.generate, 1e-9));
        rf_metrics_set(run->metrics, "perf/train_tokens_per_s", (double)as.tokens / fmax(pt.actor, 1e-9));
        rf_metrics_set(run->metrics, "perf/step_s", total);
        rf_metrics_set(run->metrics, "perf/share_generate", pt.generate / total);
        rf_metrics_set(run->metrics, "perf/share_reference", pt.reference / total);
        rf_metrics_set(run->metrics, "perf/share_prox", pt.prox / total);
        rf_metrics_set(run->metrics, "perf/share_critic", (pt.critic + pt.critic_train) / total);
        rf_metrics_set(run->metrics, "perf/share_train", pt.actor / total);
        st = rf__log_samples(run, run->step + 1, b.s, b.ex, b.n);
    }
    buf_free(&b);
    return st;
}
