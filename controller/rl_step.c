/* One RL step of the embedded loop. Each phase talks to a role through the shapes the message
 * API will carry: a generate request (prompts, n, sampling, seed, version) in and samples out;
 * samples in and per-token log-probs or values out; a train batch in and statistics out. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/run_internal.h"
#include <stdint.h>

#include <cjson/cJSON.h>

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
    s->n_prompt = rs->prompt_len, s->n_resp = rs->n_tokens, s->group = p;
    s->tokens = malloc(sizeof(int32_t) * (size_t)(s->n_prompt + s->n_resp));
    g->st = s->tokens ? rf_train_sample_alloc(s) : rf_error(RF_ERR_NOMEM, "out of memory");
    if (g->st != RF_OK) return;
    memcpy(s->tokens, rs->prompt, sizeof(int32_t) * (size_t)s->n_prompt);
    memcpy(s->tokens + s->n_prompt, rs->tokens, sizeof(int32_t) * (size_t)s->n_resp);
    memcpy(s->behav_logp, rs->logprobs, sizeof(float) * (size_t)s->n_resp);
    memcpy(s->versions, rs->versions, sizeof(int) * (size_t)s->n_resp);
    g->tokens += s->n_resp;
    s->text = rf_strdup(rs->text ? rs->text : "");
    g->st = rf_reward_rules_score(g->run->rules, rs->text ? rs->text : "", s->n_resp,
                                  g->ex[p]->answer, &s->reward, &s->accuracy);
    s->rule_reward = s->reward;
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
    uint64_t base = ((uint64_t)r->train.seed << 40) ^ ((uint64_t)run->step << 16) ^ ((uint64_t)round << 8);
    rf_status st = RF_OK;
    for (int p = 0; st == RF_OK && p < n_prompts; p++) {
        rf_rollout_request q = {.prompt = ex[p]->prompt_ids, .prompt_len = ex[p]->n_prompt,
                                .n = r->rollout.n,
                                .sampling = {0, (float)r->rollout.temperature, r->rollout.top_k,
                                             (float)r->rollout.top_p},
                                .max_new_tokens = r->rollout.max_new_tokens,
                                .seed = base + (uint64_t)p * (uint64_t)r->rollout.n,
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

rf_status rf__reward_model_scores(rf_reward_model *rm, const rf_train_sample *s, int n, float *sc) {
    const int32_t **seqs = malloc(sizeof *seqs * (size_t)(n ? n : 1));
    int *lens = malloc(sizeof(int) * (size_t)(n ? n : 1));
    rf_status st = seqs && lens ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) seqs[i] = s[i].tokens, lens[i] = s[i].n_prompt + s[i].n_resp;
    if (st == RF_OK) st = rf_reward_model_score(rm, seqs, lens, n, sc);
    free(seqs), free(lens);
    return st;
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

rf_status rf__apply_external(rf_run *run, rf_train_sample *s, int n, const float *sc) {
    float w = (float)run->r->reward.external_weight;
    for (int i = 0; i < n; i++) {
        s[i].reward += w * sc[i];
        s[i].external_reward = w * sc[i];
        const float *v;
        int nt = rf_external_reward_token_rewards(run->ext, i, &v);
        if (nt == 0) continue;
        if (nt != s[i].n_resp)
            return rf_error(RF_ERR_FORMAT, "reward program: %d per-token rewards for a response of %d "
                            "tokens", nt, s[i].n_resp);
        float *t = s[i].token_rewards ? s[i].token_rewards : malloc(sizeof(float) * (size_t)nt);
        if (!t) return rf_error(RF_ERR_NOMEM, "out of memory");
        for (int k = 0; k < nt; k++) t[k] = (s[i].token_rewards ? t[k] : 0.0f) + w * v[k];
        s[i].token_rewards = t;
    }
    rf_external_acc *a = &run->ext_acc;
    rf_external_reward_stats es = rf_external_reward_last_stats(run->ext);
    a->rejected += es.rejected, a->resent += es.resent;
    const char *names[RF_EXTERNAL_MAX_COMPONENTS];
    double means[RF_EXTERNAL_MAX_COMPONENTS];
    int nc = rf_external_reward_components(run->ext, names, means, RF_EXTERNAL_MAX_COMPONENTS);
    for (int k = 0; k < nc; k++) {
        int j = 0;
        while (j < a->count && strcmp(a->name[j], names[k]) != 0) j++;
        if (j == a->count) {
            if (a->count == RF_EXTERNAL_MAX_COMPONENTS) continue;
            snprintf(a->name[a->count++], sizeof a->name[0], "%s", names[k]);
            a->sum[j] = 0, a->n[j] = 0;
        }
        a->sum[j] += means[k], a->n[j]++;
    }
    return RF_OK;
}

void rf__external_metrics(rf_run *run, rf_metrics *m) {
    if (!run->ext) return;
    rf_external_acc *a = &run->ext_acc;
    rf_metrics_set(m, "reward/external/rejected", (double)a->rejected);
    rf_metrics_set(m, "reward/external/resent", (double)a->resent);
    a->rejected = a->resent = 0;
    for (int k = 0; k < a->count; k++) {
        char key[160];
        snprintf(key, sizeof key, "reward/external/%s", a->name[k]);
        if (a->n[k]) rf_metrics_set(m, key, a->sum[k] / a->n[k]);
        a->sum[k] = 0, a->n[k] = 0;
    }
}

/* External reward programs: the whole batch goes out, scores come back per sample. */
static rf_status external_reward(rf_run *run, const rf_example *const *ex, rf_train_sample *s, int n) {
    if (!run->ext) return RF_OK;
    rf_reward_item *items = calloc((size_t)n, sizeof *items);
    float *sc = malloc(sizeof(float) * (size_t)n);
    char **meta = calloc((size_t)n, sizeof *meta);
    rf_status st = items && sc && meta ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    int per = run->r->rollout.n;
    for (int i = 0; st == RF_OK && i < n; i++) {
        const rf_example *e = ex[i / per];
        meta[i] = cJSON_PrintUnformatted(e->extra);
        items[i] = (rf_reward_item){e->prompt_text, s[i].text, s[i].tokens, s[i].n_prompt,
                                    s[i].tokens + s[i].n_prompt, s[i].n_resp, e->answer, meta[i],
                                    i % per, s[i].group};
    }
    if (st == RF_OK) st = rf_external_reward_score(run->ext, items, n, sc);
    if (st == RF_OK) st = rf__apply_external(run, s, n, sc);
    if (st == RF_OK) rf__external_metrics(run, run->metrics);
    for (int i = 0; meta && i < n; i++) free(meta[i]);
    free(items), free(sc), free(meta);
    return st;
}

/* DAPO dynamic sampling: a group whose rewards are all equal has zero advantage. */
static int group_informative(const rf_train_sample *s, int n_per) {
    for (int j = 1; j < n_per; j++)
        if (rf__total_reward(&s[j]) != rf__total_reward(&s[0])) return 1;
    return 0;
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
            int keep = !r->algorithm.dynamic_sampling || group_informative(tmp + g * n, n) ||
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

/* Advantages; k1 KL into the token rewards when kl_in_reward. Returns the mean k1. */
rf_status rf__advantages(const rf_recipe *r, rf_adv_kind kind, float kl_beta, int has_ref,
                         rf_train_sample *samples, int n, double *mean_kl) {
    rf_adv_seq *as = calloc((size_t)(n ? n : 1), sizeof *as);
    float **kl = calloc((size_t)(n ? n : 1), sizeof *kl);
    if (!as || !kl) {
        free(as), free(kl);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    double ksum = 0;
    long kt = 0;
    for (int i = 0; i < n; i++) {
        rf_train_sample *s = &samples[i];
        if (has_ref) {
            kl[i] = malloc(sizeof(float) * (size_t)s->n_resp);
            for (int t = 0; kl[i] && t < s->n_resp; t++) {
                kl[i][t] = s->prox_logp[t] - s->ref_logp[t];
                if (!s->loss_mask || s->loss_mask[t]) ksum += kl[i][t], kt++;
            }
        }
        as[i] = (rf_adv_seq){s->n_resp, s->group, s->reward,
                             r->algorithm.kl_in_reward ? kl[i] : NULL, s->values, s->adv, s->returns,
                             s->token_rewards, s->loss_mask};
    }
    rf_adv_opts o = {kind, (float)r->algorithm.gamma, (float)r->algorithm.lam,
                     r->algorithm.kl_in_reward ? kl_beta : 0.0f, r->algorithm.whiten_advantages,
                     1e-6f};
    if (kind == RF_ADV_GRPO && !r->algorithm.norm_adv_by_std) o.kind = RF_ADV_DR_GRPO;
    rf_status st = rf_advantages(&o, as, n);
    *mean_kl = kt ? ksum / kt : 0;
    for (int i = 0; i < n; i++) free(kl[i]);
    free(as), free(kl);
    return st;
}

/* The reward parts of sample x into l (those the run has). */
static void sample_components(const rf_run *run, const rf_train_sample *x, rf_sample_log *l) {
    const rf_recipe *r = run->r;
    l->n_components = 0;
    l->component_names[l->n_components] = "rules", l->components[l->n_components++] = x->rule_reward;
    if (r->reward.model[0])
        l->component_names[l->n_components] = "reward_model",
        l->components[l->n_components++] = r->reward.model_weight * x->rm_score;
    if (r->reward.external[0])
        l->component_names[l->n_components] = "external", l->components[l->n_components++] = x->external_reward;
    if (x->token_rewards) {
        double t = 0;
        for (int k = 0; k < x->n_resp; k++) t += x->token_rewards[k];
        l->component_names[l->n_components] = "token_rewards", l->components[l->n_components++] = t;
    }
}

rf_status rf__log_samples(rf_run *run, int step, const rf_train_sample *s, const rf_example *const *ex, int n) {
    const rf_recipe *r = run->r;
    int every = r->logging.samples_every, k = r->logging.samples_per_step;
    if (every <= 0 || step % every != 0 || n <= 0) return RF_OK;
    int per = r->rollout.n > 0 ? r->rollout.n : 1, groups = n / per;
    if (k > n) k = n;
    rf_sample_log *l = calloc((size_t)k, sizeof *l);
    if (!l) return rf_error(RF_ERR_NOMEM, "out of memory logging samples");
    for (int i = 0; i < k; i++) {
        /* one response of each group in turn, then the second of each, ... */
        int g = groups ? i % groups : 0, j = groups ? i / groups : i;
        const rf_train_sample *x = &s[g * per + j];
        l[i] = (rf_sample_log){.prompt = ex[g]->prompt_text, .response = x->text, .answer = ex[g]->answer,
                               .group = g, .index = j, .response_tokens = x->n_resp,
                               .reward = rf__total_reward(x), .accuracy = x->accuracy,
                               .advantage = x->adv && x->n_resp ? x->adv[0] : NAN};
        sample_components(run, x, &l[i]);
    }
    rf_status st = rf_metrics_samples(run->metrics, step, l, k);
    free(l);
    return st;
}

void rf__batch_metrics(rf_metrics *m, const rf_recipe *r, const rf_train_sample *samples, int count) {
    double rs = 0, rq = 0, acc = 0, len = 0, nacc = 0, clipped = 0;
    for (int i = 0; i < count; i++) {
        const rf_train_sample *s = &samples[i];
        double rw = rf__total_reward(s);
        rs += rw, rq += rw * rw, len += s->n_resp;
        if (!isnan(s->accuracy)) acc += s->accuracy, nacc++;
        clipped += !s->loss_mask && s->n_resp >= r->rollout.max_new_tokens; /* episodes: env/truncated_frac */
    }
    double n = count ? count : 1, mean = rs / n;
    rf_metrics_set(m, "reward/mean", mean);
    rf_metrics_set(m, "reward/std", sqrt(fmax(0.0, rq / n - mean * mean)));
    if (nacc) rf_metrics_set(m, "reward/accuracy", acc / nacc);
    rf_metrics_set(m, "response/length_mean", len / n);
    rf_metrics_set(m, "response/clip_ratio", clipped / n);
}

void rf__update_metrics(rf_metrics *m, const rf_recipe *r, const rf_update_stats *a,
                        const rf_update_stats *c) {
    double tok = a->pg.tokens ? (double)a->pg.tokens : 1;
    rf_metrics_set(m, "actor/pg_loss", a->pg.pg_loss / tok);
    rf_metrics_set(m, "actor/entropy", a->pg.entropy / tok);
    rf_metrics_set(m, "actor/clip_frac", a->pg.clipped / tok);
    rf_metrics_set(m, "actor/approx_kl", a->pg.approx_kl / tok);
    rf_metrics_set(m, "actor/grad_norm", a->grad_norm);
    rf_metrics_set(m, "actor/lr", a->lr);
    if (a->lp_mismatch_n > 0) { /* tokens generated by the weights trained on (on-policy) */
        rf_metrics_set(m, "actor/logprob_mismatch_max", a->lp_mismatch_max);
        rf_metrics_set(m, "actor/logprob_mismatch_mean", a->lp_mismatch_sum / (double)a->lp_mismatch_n);
    }
    if (rf__is_corrected(r)) {
        const char *corr = r->algorithm.rollout_correction;
        rf_metrics_set(m, "actor/is_weight_mean", a->pg.is_weight / tok);
        rf_metrics_set(m, "actor/is_weight_max", a->pg.is_weight_max);
        if (strncmp(corr, "mis-", 4) != 0) rf_metrics_set(m, "actor/is_truncated_frac", a->pg.is_truncated / tok);
        else rf_metrics_set(m, "actor/is_masked_frac", a->pg.is_masked / tok);
        if (strcmp(corr, "mis-seq") == 0)
            rf_metrics_set(m, "actor/is_masked_seq_frac", a->pg.seqs_masked / (a->pg.seqs ? a->pg.seqs : 1));
    }
    if (c) {
        rf_metrics_set(m, "critic/value_loss", c->value_loss);
        rf_metrics_set(m, "critic/clip_frac", c->value_clipfrac / (c->tokens ? c->tokens : 1));
        rf_metrics_set(m, "critic/grad_norm", c->grad_norm);
    }
}

int rf__is_corrected(const rf_recipe *r) {
    return r->algorithm.decoupled || r->async.max_staleness > 0 ||
           strcmp(r->algorithm.rollout_correction, "none") != 0;
}

/* algorithm.policy_loss and algorithm.rollout_correction as the loss's enums. */
static void pg_kinds(const rf_recipe *r, rf_pg_opts *pg) {
    const char *k = r->algorithm.policy_loss, *c = r->algorithm.rollout_correction;
    pg->kind = strcmp(k, "gspo") == 0 ? RF_PG_GSPO : strcmp(k, "cispo") == 0 ? RF_PG_CISPO : RF_PG_CLIP;
    pg->corr = strcmp(c, "mis-token") == 0 ? RF_CORR_MIS_TOKEN : strcmp(c, "mis-seq") == 0 ? RF_CORR_MIS_SEQ
                                                                                            : RF_CORR_TIS;
    pg->is_low = (float)r->algorithm.rollout_is_low, pg->is_high = (float)r->algorithm.rollout_is_high;
}

rf_update_opts rf__update_opts(const rf_recipe *r, float kl_beta, rf_kl_est est, rf_loss_agg agg,
                               int step, int critic) {
    rf_update_opts uo = {
        .pg = {(float)r->algorithm.clip_low, (float)r->algorithm.clip_high, (float)r->algorithm.dual_clip,
               rf__is_corrected(r), (float)r->algorithm.is_cap,
               r->algorithm.kl_in_reward ? 0.0f : kl_beta, est, (float)r->algorithm.entropy_coef},
        .agg = agg, .epochs = r->train.ppo_epochs,
        /* seq-mean-token-sum-norm's constant: the longest response; an episode's is env.max_total_tokens */
        .max_resp_len = r->env.type[0] ? r->env.max_total_tokens : r->rollout.max_new_tokens,
        .mini_batches = r->train.mini_batches, .micro_tokens = r->train.micro_batch_tokens,
        .inv_temp = 1.0f / (float)r->rollout.temperature, .value_clip = (float)r->algorithm.value_clip,
        .shuffle_seed = ((uint64_t)r->train.seed << 20) + (uint64_t)step * 2 + (uint64_t)critic};
    pg_kinds(r, &uo.pg);
    uo.prox_from_forward = uo.pg.decoupled && uo.epochs == 1 && uo.mini_batches == 1;
    uo.version = step;
    return uo;
}

static rf_update_opts update_opts(const rf_run *run, int critic) {
    return rf__update_opts(run->r, run->kl.beta, run->kl_est, run->agg, run->step, critic);
}

rf_optim_opts rf__optim_opts(const rf_recipe *r, int critic) {
    rf_optim_opts o = {.lr = (float)(critic ? r->critic.lr : r->train.lr),
                       .min_lr_ratio = (float)r->train.min_lr_ratio,
                       .warmup_steps = critic ? r->critic.warmup_steps : r->train.warmup_steps,
                       .total_steps = r->train.steps * r->train.ppo_epochs * r->train.mini_batches,
                       .cosine = strcmp(r->train.schedule, "cosine") == 0,
                       .beta1 = (float)r->train.beta1, .beta2 = (float)r->train.beta2,
                       .eps = (float)r->train.eps, .weight_decay = (float)r->train.weight_decay,
                       .grad_clip = (float)r->train.grad_clip};
    return o;
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
