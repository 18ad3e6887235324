/* The pieces of the RL dataflow that the one loop of every deployment (controller/controller.c,
 * with the in-process roles of controller/roles_inproc.c or the message roles) and the training
 * worker (actor/worker*.c) run: a group's external rewards and dynamic-sampling test,
 * reward-model scores, advantages, the update and optimizer options, the batch's metrics and
 * sample logs, resuming the run's state from a checkpoint. Each exists once. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/run_internal.h"
#include "trainer/checkpoint.h"

rf_status rf__reward_model_scores(rf_reward_model *rm, const rf_train_sample *s, int n, float *sc) {
    const int32_t **seqs = malloc(sizeof *seqs * (size_t)(n ? n : 1));
    int *lens = malloc(sizeof(int) * (size_t)(n ? n : 1));
    rf_status st = seqs && lens ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) seqs[i] = s[i].tokens, lens[i] = s[i].n_prompt + s[i].n_resp;
    if (st == RF_OK) st = rf_reward_model_score(rm, seqs, lens, n, sc);
    free(seqs), free(lens);
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
    /* The bridge rejects replies that overflow once weighted (rf_external_reward_config.weight);
     * what is left is the sum with the rules, the reward model or an environment's turn
     * rewards overflowing a float: refused here, before it reaches the update as a NaN. */
    for (int i = 0; i < n; i++) {
        int bad = !isfinite(s[i].reward) || !isfinite((float)rf__total_reward(&s[i]));
        for (int k = 0; !bad && s[i].token_rewards && k < s[i].n_resp; k++) bad = !isfinite(s[i].token_rewards[k]);
        if (bad)
            return rf_error(RF_ERR_RANGE, "reward programs: response %d of the batch (group %d) has a total reward "
                            "that overflows a float (%g, of which %g from the reward programs at "
                            "reward.external_weight = %g): rewards must stay within +-3.4e38",
                            i, s[i].group, rf__total_reward(&s[i]), (double)s[i].external_reward, (double)w);
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
            if (a->count == RF_EXTERNAL_MAX_COMPONENTS) {
                if (!a->warned++)
                    rf_log_warn("reward: the programs sent more than %d component names in this run: '%s' and "
                                "any later new name are left out of the metrics", RF_EXTERNAL_MAX_COMPONENTS, names[k]);
                continue;
            }
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
    if (r->reward.external[0] || r->reward.programs.n > 0)
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
        if (x->loss_mask) /* an episode: its trajectory as trained on */
            l[i].response_ids = x->tokens + x->n_prompt, l[i].loss_mask = x->loss_mask, l[i].versions = x->versions;
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

int rf__group_informative(const rf_train_sample *s, int n) {
    for (int j = 1; j < n; j++)
        if (rf__total_reward(&s[j]) != rf__total_reward(&s[0])) return 1;
    return 0;
}

rf_status rf__external_score(rf_run *run, const rf_example *const *ex, rf_train_sample *s, int n, int per,
                             const int64_t *ids) {
    if (!run->ext || n <= 0) return RF_OK;
    int groups = (n + per - 1) / per;
    rf_reward_item *items = calloc((size_t)n, sizeof *items);
    float *sc = malloc(sizeof(float) * (size_t)n);
    char **meta = calloc((size_t)groups, sizeof *meta);
    rf_status st = items && sc && meta ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int g = 0; st == RF_OK && g < groups; g++)
        if (!(meta[g] = cJSON_PrintUnformatted(ex[g]->extra))) st = rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) {
        const rf_example *e = ex[i / per];
        items[i] = (rf_reward_item){e->prompt_text, s[i].text, s[i].tokens, s[i].n_prompt,
                                    s[i].tokens + s[i].n_prompt, s[i].n_resp, e->answer, meta[i / per],
                                    i % per, ids[i / per]};
    }
    if (st == RF_OK) st = rf_external_reward_score(run->ext, items, n, sc);
    if (st == RF_OK) st = rf__apply_external(run, s, n, sc);
    for (int g = 0; meta && g < groups; g++) free(meta[g]);
    free(items), free(sc), free(meta);
    return st;
}

rf_status rf__run_state_init(rf_run *run, const rf_recipe *r) {
    run->r = r;
    RF_TRY(rf_adv_kind_parse(r->algorithm.name, &run->adv_kind));
    RF_TRY(rf_loss_agg_parse(r->algorithm.loss_agg, &run->agg));
    RF_TRY(rf_kl_est_parse(r->algorithm.kl_estimator, &run->kl_est));
    run->kl = (rf_kl_ctl){(float)r->algorithm.kl_coef, (float)r->algorithm.kl_target,
                          r->algorithm.kl_horizon, r->algorithm.adaptive_kl};
    run->best_val = -1;
    return RF_OK;
}

rf_status rf__run_resume(rf_run *run, rf_model *actor, rf_model *critic) {
    rf_ckpt_state st;
    RF_TRY(rf_checkpoint_load(run->r->logging.dir, actor, critic, &st));
    run->step = st.step, run->pos = st.pos, run->kl.beta = st.kl_beta, run->best_val = st.best_val;
    run->admitted = st.admitted;
    rf_log_info("resumed at step %d (data epoch %d, index %d)", run->step, run->pos.epoch, run->pos.index);
    return RF_OK;
}

rf_ckpt_state rf__run_ckpt_state(const rf_run *run, rf_dataset_pos pos, int64_t admitted) {
    return (rf_ckpt_state){.step = run->step, .pos = pos, .kl_beta = run->kl.beta, .best_val = run->best_val,
                           .admitted = admitted};
}

void rf__val_metrics(rf_run *run, double acc, double reward, double len) {
    rf_metrics_set(run->metrics, "val/accuracy", acc);
    if (run->ext || run->rm || run->r->reward.model[0]) rf_metrics_set(run->metrics, "val/reward", reward);
    rf_metrics_set(run->metrics, "val/length_mean", len);
}

uint64_t rf__group_seed(const rf_recipe *r, int step, int round, int p) {
    uint64_t base = ((uint64_t)r->train.seed << 40) ^ ((uint64_t)step << 16) ^ ((uint64_t)round << 8);
    return base + (uint64_t)p * (uint64_t)r->rollout.n;
}

rf_status rf__sample_init(rf_run *run, rf_train_sample *s, const int32_t *prompt, int n_prompt, const int32_t *resp,
                          const float *logp, int n_resp, const char *text, const char *answer) {
    s->n_prompt = n_prompt, s->n_resp = n_resp;
    s->tokens = malloc(sizeof(int32_t) * (size_t)(n_prompt + n_resp));
    RF_TRY(s->tokens ? rf_train_sample_alloc(s) : rf_error(RF_ERR_NOMEM, "out of memory"));
    memcpy(s->tokens, prompt, sizeof(int32_t) * (size_t)n_prompt);
    memcpy(s->tokens + n_prompt, resp, sizeof(int32_t) * (size_t)n_resp);
    memcpy(s->behav_logp, logp, sizeof(float) * (size_t)n_resp);
    if (!text) text = "";
    s->text = rf_strdup(text);
    if (!s->text) return rf_error(RF_ERR_NOMEM, "out of memory");
    RF_TRY(rf_reward_rules_score(run->rules, text, n_resp, answer, &s->reward, &s->accuracy));
    s->rule_reward = s->reward;
    return RF_OK;
}

int rf__val_due(const rf_recipe *r, int step) {
    if (r->logging.val_every <= 0) return 0; /* 0 = never, not even before training or at the end */
    return step == r->train.steps || step % r->logging.val_every == 0;
}

int rf__ckpt_due(const rf_recipe *r, int step) {
    return step == r->train.steps || (r->checkpoint.every > 0 && step % r->checkpoint.every == 0);
}

int rf__console_due(const rf_recipe *r, int step) {
    return step == r->train.steps || step % (r->logging.every > 0 ? r->logging.every : 1) == 0;
}

double rf__val_credit(double reward, float accuracy) { return isnan(accuracy) ? reward : accuracy; }
