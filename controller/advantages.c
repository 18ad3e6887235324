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

static int in_loss(const rf_adv_seq *s, int t) { return !s->mask || s->mask[t]; }

/* The last token of s in the loss (-1: none), where the sequence reward goes. */
static int last_token(const rf_adv_seq *s) {
    int t = s->n - 1;
    while (t >= 0 && !in_loss(s, t)) t--;
    return t;
}

/* Token reward r_t: -beta * k1_t, plus the per-token reward when given, plus the sequence
 * reward on the last token (`last`). */
static float token_reward(const rf_adv_seq *s, int t, int last, float beta) {
    float r = s->kl && beta != 0.0f ? -beta * s->kl[t] : 0.0f;
    if (s->token_rewards) r += s->token_rewards[t];
    return t == last ? r + s->reward : r;
}

/* The sequence reward a group estimator uses: the reward plus the sum of the per-token ones. */
static double seq_reward(const rf_adv_seq *s) {
    double r = s->reward;
    for (int t = 0; s->token_rewards && t < s->n; t++) r += s->token_rewards[t];
    return r;
}

static void gae(const rf_adv_opts *o, rf_adv_seq *s) {
    float next_v = 0.0f, next_a = 0.0f; /* V after the last token = 0 */
    int last = last_token(s);
    for (int t = s->n - 1; t >= 0; t--) {
        if (!in_loss(s, t)) {
            s->adv[t] = 0.0f, s->returns[t] = 0.0f;
            continue;
        }
        float delta = token_reward(s, t, last, o->kl_coef) + o->gamma * next_v - s->values[t];
        next_a = delta + o->gamma * o->lam * next_a;
        s->adv[t] = next_a;
        s->returns[t] = next_a + s->values[t];
        next_v = s->values[t];
    }
}

static void discounted_returns(const rf_adv_opts *o, rf_adv_seq *s) {
    float g = 0.0f;
    int last = last_token(s);
    for (int t = s->n - 1; t >= 0; t--) {
        if (!in_loss(s, t)) {
            s->adv[t] = 0.0f, s->returns[t] = 0.0f;
            continue;
        }
        g = token_reward(s, t, last, o->kl_coef) + o->gamma * g;
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
            if (!in_loss(&seqs[i], t)) continue;
            sum += seqs[i].adv[t];
            count++;
        }
    if (count == 0) return;
    double mean = sum / count;
    for (int i = 0; i < n; i++)
        for (int t = 0; t < seqs[i].n; t++)
            if (in_loss(&seqs[i], t)) sq += (seqs[i].adv[t] - mean) * (seqs[i].adv[t] - mean);
    double var = count > 1 ? sq / (count - 1) : 0.0, inv = 1.0 / sqrt(var + 1e-8);
    for (int i = 0; i < n; i++)
        for (int t = 0; t < seqs[i].n; t++)
            if (in_loss(&seqs[i], t)) seqs[i].adv[t] = (float)((seqs[i].adv[t] - mean) * inv);
}

typedef struct group_ix {
    int group, i;
} group_ix;

static int by_group(const void *a, const void *b) {
    const group_ix *x = a, *y = b;
    if (x->group != y->group) return x->group < y->group ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Group-relative advantages. The sequences are sorted by (group, index) once, so each group's
 * statistics take one pass over its members, in index order (the sums are the same, bit for
 * bit, as a scan of the whole batch per sequence would give). */
static rf_status group_advantage(const rf_adv_opts *o, rf_adv_seq *seqs, int n) {
    group_ix *ix = malloc(sizeof *ix * (size_t)(n ? n : 1));
    if (!ix) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) ix[i] = (group_ix){seqs[i].group, i};
    qsort(ix, (size_t)n, sizeof *ix, by_group);
    for (int a = 0, b; a < n; a = b) {
        for (b = a + 1; b < n && ix[b].group == ix[a].group; b++) {
        }
        int g = b - a;
        if (o->kind == RF_ADV_RLOO && g < 2) {
            free(ix);
            return rf_error(RF_ERR_ARG, "rloo needs at least 2 samples per prompt (rollout.n)");
        }
        double sum = 0, sq = 0;
        for (int k = a; k < b; k++) sum += seq_reward(&seqs[ix[k].i]);
        double mean = sum / g;
        for (int k = a; k < b; k++) {
            double d = seq_reward(&seqs[ix[k].i]) - mean;
            sq += d * d;
        }
        double std = g > 1 ? sqrt(sq / (g - 1)) : 0.0;
        for (int k = a; k < b; k++) {
            rf_adv_seq *q = &seqs[ix[k].i];
            double rq = seq_reward(q), adv;
            if (o->kind == RF_ADV_GRPO)
                adv = g > 1 ? (rq - mean) / (std + o->eps) : 0.0;
            else if (o->kind == RF_ADV_DR_GRPO)
                adv = rq - mean;
            else
                adv = rq - (sum - rq) / (g - 1);
            for (int t = 0; t < q->n; t++) {
                q->adv[t] = (float)adv;
                if (q->returns) q->returns[t] = (float)rq;
            }
        }
    }
    free(ix);
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
