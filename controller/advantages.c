#include "controller/advantages.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

rf_status rf_adv_kind_parse(const char *name, rf_adv_kind *out) {
    static const struct { const char *n; rf_adv_kind k; } t[] = {
        {"ppo", RF_ADV_GAE}, {"grpo", RF_ADV_GRPO}, {"dr_grpo", RF_ADV_DR_GRPO},
        {"rloo", RF_ADV_RLOO}, {"reinforce_pp", RF_ADV_REINFORCE_PP}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (strcmp(name, t[i].n) == 0) {
            *out = t[i].k;
            return RF_OK;
        }
    return rf_error(RF_ERR_ARG, "algorithm \"%s\" unknown (ppo, grpo, dr_grpo, rloo, reinforce_pp)", name);
}

/* Token reward r_t: -beta * k1_t, plus the sequence reward on the last token. */
static float token_reward(const rf_adv_seq *s, int t, float beta) {
    float r = s->kl && beta != 0.0f ? -beta * s->kl[t] : 0.0f;
    return t == s->n - 1 ? r + s->reward : r;
}

static void gae(const rf_adv_opts *o, rf_adv_seq *s) {
    float next_v = 0.0f, next_a = 0.0f; /* V after the last token = 0 */
    for (int t = s->n - 1; t >= 0; t--) {
        float delta = token_reward(s, t, o->kl_coef) + o->gamma * next_v - s->values[t];
        next_a = delta + o->gamma * o->lam * next_a;
        s->adv[t] = next_a;
        s->returns[t] = next_a + s->values[t];
        next_v = s->values[t];
    }
}

static void discounted_returns(const rf_adv_opts *o, rf_adv_seq *s) {
    float g = 0.0f;
    for (int t = s->n - 1; t >= 0; t--) {
        g = token_reward(s, t, o->kl_coef) + o->gamma * g;
        s->returns[t] = g;
        s->adv[t] = g;
    }
}

void rf_whiten(rf_adv_seq *seqs, int n, int use_returns) {
    double sum = 0, sq = 0;
    long count = 0;
    (void)use_returns;
    for (int i = 0; i < n; i++)
        for (int t = 0; t < seqs[i].n; t++) {
            sum += seqs[i].adv[t];
            count++;
        }
    if (count == 0) return;
    double mean = sum / count;
    for (int i = 0; i < n; i++)
        for (int t = 0; t < seqs[i].n; t++) sq += (seqs[i].adv[t] - mean) * (seqs[i].adv[t] - mean);
    double var = count > 1 ? sq / (count - 1) : 0.0, inv = 1.0 / sqrt(var + 1e-8);
    for (int i = 0; i < n; i++)
        for (int t = 0; t < seqs[i].n; t++) seqs[i].adv[t] = (float)((seqs[i].adv[t] - mean) * inv);
}

/* Group statistics for sequence i: mean and unbiased std of the group's rewards, the sum of
 * the others' rewards and the group size. */
static void group_stats(const rf_adv_seq *seqs, int n, int i, double *mean, double *std,
                        double *others, int *size) {
    double sum = 0, sq = 0;
    int g = 0;
    for (int j = 0; j < n; j++)
        if (seqs[j].group == seqs[i].group) sum += seqs[j].reward, g++;
    *mean = sum / g;
    for (int j = 0; j < n; j++)
        if (seqs[j].group == seqs[i].group) sq += (seqs[j].reward - *mean) * (seqs[j].reward - *mean);
    *std = g > 1 ? sqrt(sq / (g - 1)) : 0.0;
    *others = sum - seqs[i].reward;
    *size = g;
}

static rf_status group_advantage(const rf_adv_opts *o, rf_adv_seq *seqs, int n) {
    for (int i = 0; i < n; i++) {
        double mean, std, others, a;
        int g;
        group_stats(seqs, n, i, &mean, &std, &others, &g);
        if (o->kind == RF_ADV_RLOO && g < 2)
            return rf_error(RF_ERR_ARG, "rloo needs at least 2 samples per prompt (rollout.n)");
        if (o->kind == RF_ADV_GRPO)
            a = g > 1 ? (seqs[i].reward - mean) / (std + o->eps) : 0.0;
        else if (o->kind == RF_ADV_DR_GRPO)
            a = seqs[i].reward - mean;
        else
            a = seqs[i].reward - others / (g - 1);
        for (int t = 0; t < seqs[i].n; t++) {
            seqs[i].adv[t] = (float)a;
            if (seqs[i].returns) seqs[i].returns[t] = seqs[i].reward;
        }
    }
    return RF_OK;
}

rf_status rf_advantages(const rf_adv_opts *o, rf_adv_seq *seqs, int n) {
    switch (o->kind) {
    case RF_ADV_GAE:
        for (int i = 0; i < n; i++) {
            if (!seqs[i].values) return rf_error(RF_ERR_ARG, "GAE needs critic values");
            gae(o, &seqs[i]);
        }
        if (o->whiten) rf_whiten(seqs, n, 0);
        return RF_OK;
    case RF_ADV_REINFORCE_PP:
        for (int i = 0; i < n; i++) discounted_returns(o, &seqs[i]);
        rf_whiten(seqs, n, 0);
        return RF_OK;
    default:
        return group_advantage(o, seqs, n);
    }
}

void rf_kl_ctl_update(rf_kl_ctl *c, float kl, int n_steps) {
    if (!c->adaptive || c->target <= 0 || c->horizon <= 0) return;
    float err = kl / c->target - 1.0f;
    err = err < -0.2f ? -0.2f : err > 0.2f ? 0.2f : err;
    c->beta *= 1.0f + err * (float)n_steps / (float)c->horizon;
}
