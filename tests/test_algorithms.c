/* Advantage estimators, loss aggregation, KL estimators, the clipped surrogate (with dual clip
 * and the decoupled off-policy weight), GSPO, CISPO, the rollout corrections (truncated and
 * masked IS by token and by sequence), the value loss and the LR schedule against values
 * computed by hand from ../shared/ALGORITHMS.md; gradients of the losses against central
 * finite differences. Tolerances: float32 arithmetic on O(1) values, 1e-5. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actor/losses.h"
#include "controller/advantages.h"
#include "trainer/optim.h"
#include "test_util.h"

#define TOL 1e-5

static void group_estimators(void) {
    float adv[4][1], ret[4][1];
    rf_adv_seq s[4];
    float r[4] = {1, 0, 1, 0};
    for (int i = 0; i < 4; i++) s[i] = (rf_adv_seq){1, 7, r[i], NULL, NULL, adv[i], ret[i], NULL, NULL};
    rf_adv_opts o = {RF_ADV_GRPO, 1, 1, 0, 0, 1e-6f};
    CHECK_OK(rf_advantages(&o, s, 4));
    /* mean 0.5, unbiased std sqrt(1/3) */
    CHECK_CLOSE(adv[0][0], 0.5 / (sqrt(1.0 / 3.0) + 1e-6), TOL, TOL);
    CHECK_CLOSE(adv[1][0], -0.5 / (sqrt(1.0 / 3.0) + 1e-6), TOL, TOL);
    o.kind = RF_ADV_DR_GRPO;
    CHECK_OK(rf_advantages(&o, s, 4));
    CHECK_CLOSE(adv[0][0], 0.5, TOL, 0);
    CHECK_CLOSE(adv[3][0], -0.5, TOL, 0);
    o.kind = RF_ADV_RLOO;
    CHECK_OK(rf_advantages(&o, s, 4));
    CHECK_CLOSE(adv[0][0], 1.0 - 1.0 / 3.0, TOL, 0);
    CHECK_CLOSE(adv[1][0], -2.0 / 3.0, TOL, 0);
    CHECK_ERR(rf_advantages(&o, s, 1), RF_ERR_ARG, "rloo needs at least 2");
    /* two groups are independent */
    s[2].group = s[3].group = 8;
    o.kind = RF_ADV_DR_GRPO;
    CHECK_OK(rf_advantages(&o, s, 4));
    CHECK_CLOSE(adv[0][0], 0.5, TOL, 0);
    CHECK_CLOSE(adv[2][0], 0.5, TOL, 0);
}

/* Per-token rewards from reward programs: GAE and REINFORCE++ add them at their tokens, the
 * group estimators add their sum to the sequence reward. */
static void token_rewards(void) {
    /* GAE, gamma = lambda = 1, V = (0.5, 0.2, 0.1), sequence reward 1, token rewards
     * (0.3, -0.1, 0.2): r = (0.3, -0.1, 1.2); returns (1.4, 1.1, 1.2); adv = returns - V */
    float v[3] = {0.5f, 0.2f, 0.1f}, tr[3] = {0.3f, -0.1f, 0.2f}, adv[3], ret[3];
    rf_adv_seq s = {3, 0, 1.0f, NULL, v, adv, ret, tr, NULL};
    rf_adv_opts o = {RF_ADV_GAE, 1, 1, 0, 0, 1e-6f};
    CHECK_OK(rf_advantages(&o, &s, 1));
    CHECK_CLOSE(ret[0], 1.4, TOL, 0);
    CHECK_CLOSE(ret[1], 1.1, TOL, 0);
    CHECK_CLOSE(ret[2], 1.2, TOL, 0);
    CHECK_CLOSE(adv[0], 0.9, TOL, 0);
    CHECK_CLOSE(adv[1], 0.9, TOL, 0);
    CHECK_CLOSE(adv[2], 1.1, TOL, 0);
    /* gamma 0.5, lambda 1: returns (0.3 - 0.05 + 0.3, -0.1 + 0.6, 1.2) = (0.55, 0.5, 1.2) */
    o.gamma = 0.5f;
    CHECK_OK(rf_advantages(&o, &s, 1));
    CHECK_CLOSE(ret[0], 0.55, TOL, 0);
    CHECK_CLOSE(ret[1], 0.5, TOL, 0);
    /* REINFORCE++ (gamma 1): the same returns (1.4, 1.1, 1.2), whitened */
    rf_adv_opts rp = {RF_ADV_REINFORCE_PP, 1, 1, 0, 0, 1e-6f};
    CHECK_OK(rf_advantages(&rp, &s, 1));
    CHECK_CLOSE(ret[0], 1.4, TOL, 0);
    double mean = (1.4 + 1.1 + 1.2) / 3,
           sd = sqrt((pow(1.4 - mean, 2) + pow(1.1 - mean, 2) + pow(1.2 - mean, 2)) / 2);
    CHECK_CLOSE(adv[1], (1.1 - mean) / sd, 1e-4, 1e-4);
    /* Dr. GRPO over two samples: rewards 1 + (0.3 - 0.1 + 0.2) = 1.4 and 0.5: adv = +-0.45 on
     * every token, returns the whole reward */
    float adv2[3], ret2[3], v2[3] = {0};
    rf_adv_seq g[2] = {{3, 1, 1.0f, NULL, NULL, adv, ret, tr, NULL}, {3, 1, 0.5f, NULL, v2, adv2, ret2, NULL, NULL}};
    rf_adv_opts dr = {RF_ADV_DR_GRPO, 1, 1, 0, 0, 1e-6f};
    CHECK_OK(rf_advantages(&dr, g, 2));
    for (int t = 0; t < 3; t++) {
        CHECK_CLOSE(adv[t], 0.45, TOL, 0);
        CHECK_CLOSE(adv2[t], -0.45, TOL, 0);
    }
    CHECK_CLOSE(ret[0], 1.4, TOL, 0);
    /* GRPO: (r - mean) / (std + eps), std of (1.4, 0.5) = 0.45 * sqrt(2) */
    dr.kind = RF_ADV_GRPO;
    CHECK_OK(rf_advantages(&dr, g, 2));
    CHECK_CLOSE(adv[0], 0.45 / (0.45 * sqrt(2.0) + 1e-6), 1e-5, 1e-5);
}

static void gae_and_reinforce(void) {
    float v[3] = {0.5f, 0.2f, 0.1f}, kl[3] = {0.1f, 0.2f, 0.3f}, adv[3], ret[3];
    rf_adv_seq s = {3, 0, 1.0f, NULL, v, adv, ret, NULL, NULL};
    rf_adv_opts o = {RF_ADV_GAE, 1, 1, 0, 0, 1e-6f};
    CHECK_OK(rf_advantages(&o, &s, 1));
    CHECK_CLOSE(adv[0], 0.5, TOL, 0);
    CHECK_CLOSE(adv[1], 0.8, TOL, 0);
    CHECK_CLOSE(adv[2], 0.9, TOL, 0);
    for (int t = 0; t < 3; t++) CHECK_CLOSE(ret[t], 1.0, TOL, 0);
    o.gamma = 0.9f, o.lam = 0.8f;
    CHECK_OK(rf_advantages(&o, &s, 1));
    CHECK_CLOSE(adv[2], 0.9, TOL, 0);
    CHECK_CLOSE(adv[1], -0.11 + 0.72 * 0.9, TOL, 0);
    CHECK_CLOSE(adv[0], -0.32 + 0.72 * (-0.11 + 0.72 * 0.9), TOL, 0);
    /* k1 penalty in the reward, beta 0.5: r = (-0.05, -0.1, 0.85); REINFORCE++ with gamma 1
     * returns (0.7, 0.75, 0.85), whitened over the batch */
    s.kl = kl;
    rf_adv_opts rp = {RF_ADV_REINFORCE_PP, 1, 1, 0.5f, 0, 1e-6f};
    CHECK_OK(rf_advantages(&rp, &s, 1));
    CHECK_CLOSE(ret[0], 0.7, TOL, 0);
    CHECK_CLOSE(ret[2], 0.85, TOL, 0);
    double mean = (0.7 + 0.75 + 0.85) / 3, sd = sqrt((pow(0.7 - mean, 2) + pow(0.75 - mean, 2) + pow(0.85 - mean, 2)) / 2);
    CHECK_CLOSE(adv[0], (0.7 - mean) / sd, 1e-4, 1e-4);
    CHECK_CLOSE(adv[2], (0.85 - mean) / sd, 1e-4, 1e-4);
    /* GAE with whitening: zero mean, unit (unbiased) variance */
    s.kl = NULL;
    o.whiten = 1;
    CHECK_OK(rf_advantages(&o, &s, 1));
    CHECK_CLOSE(adv[0] + adv[1] + adv[2], 0.0, 1e-5, 0);
    CHECK_CLOSE((adv[0] * adv[0] + adv[1] * adv[1] + adv[2] * adv[2]) / 2, 1.0, 1e-4, 0);
}

static void aggregation_and_kl(void) {
    int nt[2] = {2, 3};
    float w[5];
    rf_loss_weights(RF_AGG_TOKEN_MEAN, nt, 2, 4, w);
    CHECK_CLOSE(w[0], 0.2, TOL, 0);
    rf_loss_weights(RF_AGG_SEQ_MEAN_TOKEN_SUM, nt, 2, 4, w);
    CHECK_CLOSE(w[4], 0.5, TOL, 0);
    rf_loss_weights(RF_AGG_SEQ_MEAN_TOKEN_MEAN, nt, 2, 4, w);
    CHECK_CLOSE(w[0], 0.25, TOL, 0);
    CHECK_CLOSE(w[4], 1.0 / 6.0, TOL, 0);
    rf_loss_weights(RF_AGG_SEQ_MEAN_TOKEN_SUM_NORM, nt, 2, 4, w);
    CHECK_CLOSE(w[3], 0.125, TOL, 0);
    float d;
    CHECK_CLOSE(rf_kl_value(RF_KL_K1, -1.0f, -1.5f, &d), 0.5, TOL, 0);
    CHECK_CLOSE(d, 1.0, TOL, 0);
    CHECK_CLOSE(rf_kl_value(RF_KL_K2, -1.0f, -1.5f, &d), 0.125, TOL, 0);
    CHECK_CLOSE(d, 0.5, TOL, 0);
    CHECK_CLOSE(rf_kl_value(RF_KL_K3, -1.0f, -1.5f, &d), exp(-0.5) + 0.5 - 1.0, TOL, 0);
    CHECK_CLOSE(d, 1.0 - exp(-0.5), TOL, 0);
    rf_loss_agg a;
    CHECK_ERR(rf_loss_agg_parse("mean", &a), RF_ERR_ARG, "loss_agg \"mean\" unknown");
}

static float pg1(const rf_pg_opts *o, float logp, float prox, float behav, float adv, float *g,
                 rf_pg_stats *st) {
    float w = 1.0f;
    rf_pg_stats local = {0};
    rf_pg_loss(o, 1, &logp, &prox, &behav, NULL, NULL, &adv, &w, g, NULL, st ? st : &local);
    return (float)(st ? st->loss : local.loss);
}

static void surrogate(void) {
    rf_pg_opts o = {0.2f, 0.2f, 0, 0, 5, 0, RF_KL_K3, 0, RF_PG_CLIP, RF_CORR_TIS, 0, 0};
    float g;
    CHECK_CLOSE(pg1(&o, -1, -1, -1, 2.0f, &g, NULL), -2.0, TOL, 0); /* ratio 1: -A */
    CHECK_CLOSE(g, -2.0, TOL, 0);
    float l15 = logf(1.5f);
    rf_pg_stats st = {0};
    CHECK_CLOSE(pg1(&o, l15, 0, 0, 1.0f, &g, &st), -1.2, TOL, 0); /* clipped high */
    CHECK_CLOSE(g, 0.0, TOL, 0);
    CHECK(st.clipped == 1);
    CHECK_CLOSE(pg1(&o, l15, 0, 0, -1.0f, &g, NULL), 1.5, TOL, 0); /* A < 0: unclipped side */
    CHECK_CLOSE(g, 1.5, TOL, 0);
    o.clip_high = 0.28f; /* DAPO clip-higher */
    CHECK_CLOSE(pg1(&o, l15, 0, 0, 1.0f, &g, NULL), -1.28, TOL, 0);
    o.dual_clip = 3.0f;
    CHECK_CLOSE(pg1(&o, logf(4.0f), 0, 0, -1.0f, &g, NULL), 3.0, TOL, 0);
    CHECK_CLOSE(g, 0.0, TOL, 0);
    /* decoupled: weight exp(prox - behav) = 2, truncated at is_cap */
    o.dual_clip = 0, o.decoupled = 1;
    CHECK_CLOSE(pg1(&o, -1, -1, -1 - logf(2.0f), 1.0f, &g, NULL), -2.0, TOL, 0);
    o.is_cap = 1.5f;
    rf_pg_stats st2 = {0};
    CHECK_CLOSE(pg1(&o, -1, -1, -1 - logf(2.0f), 1.0f, &g, &st2), -1.5, TOL, 0);
    CHECK(st2.is_truncated == 1);
}

/* With behaviour = proximal the decoupled objective is plain PPO, token for token. */
static void decoupled_reduces_to_ppo(void) {
    float logp[6] = {-1, -2, -0.5f, -3, -1.2f, -0.1f}, prox[6] = {-1.1f, -1.5f, -0.5f, -2, -1.5f, -0.3f};
    float adv[6] = {1, -1, 0.5f, 2, -0.3f, 1}, w[6] = {0.2f, 0.2f, 0.2f, 0.2f, 0.2f, 0.2f}, g1[6], g2[6];
    rf_pg_opts a = {0.2f, 0.28f, 3, 0, 5, 0, RF_KL_K3, 0, RF_PG_CLIP, RF_CORR_TIS, 0, 0}, b = a;
    b.decoupled = 1;
    rf_pg_stats s1 = {0}, s2 = {0};
    rf_pg_loss(&a, 6, logp, prox, NULL, NULL, NULL, adv, w, g1, NULL, &s1);
    rf_pg_loss(&b, 6, logp, prox, prox, NULL, NULL, adv, w, g2, NULL, &s2);
    CHECK(s1.loss == s2.loss);
    for (int t = 0; t < 6; t++) CHECK(g1[t] == g2[t]);
}

/* d loss / d logp of the full objective (surrogate + k3 KL) by central differences. */
static void pg_gradient_fd(void) {
    rf_pg_opts o = {0.2f, 0.28f, 3, 1, 5, 0.1f, RF_KL_K3, 0.01f, RF_PG_CLIP, RF_CORR_TIS, 0, 0};
    float prox = -1.0f, behav = -1.3f, ref = -0.7f, ent = 1.3f, w = 0.5f;
    float logps[5] = {-1.5f, -1.1f, -0.95f, -0.9f, -0.3f}, advs[2] = {0.7f, -0.7f};
    for (int a = 0; a < 2; a++)
        for (int i = 0; i < 5; i++) {
            float lp = logps[i], g, gd, h = 1e-3f;
            rf_pg_stats s = {0}, sp = {0}, sm = {0};
            rf_pg_loss(&o, 1, &lp, &prox, &behav, &ref, &ent, &advs[a], &w, &g, &gd, &s);
            float lpp = lp + h, lpm = lp - h, dummy, dd;
            rf_pg_loss(&o, 1, &lpp, &prox, &behav, &ref, &ent, &advs[a], &w, &dummy, &dd, &sp);
            rf_pg_loss(&o, 1, &lpm, &prox, &behav, &ref, &ent, &advs[a], &w, &dummy, &dd, &sm);
            /* away from the clip kinks the central difference is accurate to O(h^2) */
            CHECK_CLOSE(g, (sp.loss - sm.loss) / (2 * h), 2e-3, 1e-2);
            CHECK_CLOSE(gd, -0.01 * 0.5, TOL, 0);
        }
}

/* One response of n tokens through rf_pg_loss with fresh statistics; returns the loss. */
static double pg_seq(const rf_pg_opts *o, int n, const float *logp, const float *prox, const float *behav,
                     const float *adv, const float *w, float *g, rf_pg_stats *st) {
    rf_pg_stats local = {0};
    if (!st) st = &local;
    *st = (rf_pg_stats){0};
    rf_pg_loss(o, n, logp, prox, behav, NULL, NULL, adv, w, g, NULL, st);
    return st->loss;
}

/* GSPO: one ratio per sequence, s = exp(mean log ratio), clipped for the whole sequence. */
static void gspo(void) {
    rf_pg_opts o = {0.2f, 0.2f, 0, 0, 5, 0, RF_KL_K3, 0, RF_PG_GSPO, RF_CORR_TIS, 0, 0};
    float logp[3] = {-1.0f, -2.0f, -0.5f}, prox[3] = {-1.2f, -1.8f, -0.7f}; /* log ratios .2 -.2 .2 */
    float adv[3] = {1.5f, 1.5f, 1.5f}, w[3] = {1 / 3.0f, 1 / 3.0f, 1 / 3.0f}, g[3];
    double s = exp(0.2 / 3); /* 1.0689391 */
    rf_pg_stats st;
    /* seq-mean-token-mean over one sequence: loss -s*A; d/dlogp_t = -A * s / 3 */
    CHECK_CLOSE(pg_seq(&o, 3, logp, prox, NULL, adv, w, g, &st), -1.5 * s, TOL, 0);
    for (int t = 0; t < 3; t++) CHECK_CLOSE(g[t], -1.5 * s / 3, TOL, 0);
    CHECK(st.clipped == 0);
    /* clip_high 0.05: s > 1.05 with A > 0 clips the whole sequence, the token whose own ratio
     * (exp(-0.2) = 0.82) is inside the range included; the token clip would keep that one */
    o.clip_high = 0.05f;
    CHECK_CLOSE(pg_seq(&o, 3, logp, prox, NULL, adv, w, g, &st), -1.5 * 1.05, TOL, 0);
    for (int t = 0; t < 3; t++) CHECK(g[t] == 0.0f);
    CHECK(st.clipped == 3);
    o.kind = RF_PG_CLIP;
    pg_seq(&o, 3, logp, prox, NULL, adv, w, g, &st);
    CHECK(g[0] == 0.0f && g[2] == 0.0f && fabsf(g[1] - (float)(-1.5 * exp(-0.2) / 3)) < TOL);
    /* A < 0: min(s*A, 1.05*A) = s*A, unclipped */
    o.kind = RF_PG_GSPO;
    float neg[3] = {-1.5f, -1.5f, -1.5f};
    CHECK_CLOSE(pg_seq(&o, 3, logp, prox, NULL, neg, w, g, &st), 1.5 * s, TOL, 0);
    for (int t = 0; t < 3; t++) CHECK_CLOSE(g[t], 1.5 * s / 3, TOL, 0);
}

/* GSPO's gradient against central differences of its loss, under token-mean and
 * seq-mean-token-mean weights, with and without clipping. */
static void gspo_gradient_fd(void) {
    rf_pg_opts o = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0, RF_PG_GSPO, RF_CORR_TIS, 0, 0};
    float logp[4] = {-0.7f, -1.9f, -0.2f, -1.1f}, prox[4] = {-0.9f, -1.6f, -0.25f, -1.3f};
    float wm[4] = {0.25f, 0.25f, 0.25f, 0.25f}, wt[4] = {0.1f, 0.1f, 0.1f, 0.1f};
    float advs[3] = {0.8f, -0.6f, 0.8f};
    for (int k = 0; k < 3; k++) {
        if (k == 2) o.clip_high = 0.01f; /* s = exp(0.0375) = 1.038 > 1.01: clipped, gradient 0 */
        float adv[4] = {advs[k], advs[k], advs[k], advs[k]};
        for (int which = 0; which < 2; which++) {
            const float *w = which ? wt : wm;
            float g[4], dummy[4], h = 1e-3f;
            pg_seq(&o, 4, logp, prox, NULL, adv, w, g, NULL);
            for (int t = 0; t < 4; t++) {
                float lp[4];
                memcpy(lp, logp, sizeof lp);
                lp[t] = logp[t] + h;
                double up = pg_seq(&o, 4, lp, prox, NULL, adv, w, dummy, NULL);
                lp[t] = logp[t] - h;
                double dn = pg_seq(&o, 4, lp, prox, NULL, adv, w, dummy, NULL);
                CHECK_CLOSE(g[t], (up - dn) / (2 * h), 2e-3, 1e-2);
            }
        }
    }
}

/* CISPO: -sg(clip(ratio)) * A * logp; the clipped weight never drops a token. */
static void cispo(void) {
    rf_pg_opts o = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0, RF_PG_CISPO, RF_CORR_TIS, 0, 0};
    float g;
    rf_pg_stats st;
    float lp = -1.0f, prox = -1.0f - logf(1.5f), adv = 2.0f, w = 1.0f; /* ratio 1.5 */
    CHECK_CLOSE(pg_seq(&o, 1, &lp, &prox, NULL, &adv, &w, &g, &st), -1.28 * 2 * -1.0, TOL, 0);
    CHECK_CLOSE(g, -1.28 * 2, TOL, 0); /* the clip objective drops this token: gradient 0 */
    CHECK(st.clipped == 1);
    o.kind = RF_PG_CLIP;
    pg_seq(&o, 1, &lp, &prox, NULL, &adv, &w, &g, NULL);
    CHECK(g == 0.0f);
    o.kind = RF_PG_CISPO;
    prox = -1.0f + logf(2.0f), adv = -1.0f; /* ratio 0.5 */
    CHECK_CLOSE(pg_seq(&o, 1, &lp, &prox, NULL, &adv, &w, &g, &st), -0.8 * -1 * -1, TOL, 0);
    CHECK_CLOSE(g, 0.8, TOL, 0);
    o.clip_low = 1.0f; /* no lower bound, as MiniMax-M1 */
    pg_seq(&o, 1, &lp, &prox, NULL, &adv, &w, &g, &st);
    CHECK_CLOSE(g, 0.5, TOL, 0);
    CHECK(st.clipped == 0);
    /* inside the range the weight is the ratio: -ratio * A, and a weight w scales it */
    prox = -1.1f, adv = 0.5f, w = 0.25f;
    CHECK_CLOSE(pg_seq(&o, 1, &lp, &prox, NULL, &adv, &w, &g, &st), 0.25 * -exp(0.1) * 0.5 * -1.0, TOL, 0);
    CHECK_CLOSE(g, 0.25 * -exp(0.1) * 0.5, TOL, 0);
    /* gradient = the derivative with the weight held (stop-gradient): move logp and prox
     * together so that the ratio, and so the weight, stays put */
    float lps[3] = {-2.0f, -0.4f, -1.0f}, proxs[3] = {-1.0f, -0.9f, -1.3f}; /* ratios e^-1, e^.5, e^.3 */
    o.clip_low = 0.2f;
    for (int i = 0; i < 3; i++) {
        float h = 1e-3f, a = 0.7f, g0, d, up_lp = lps[i] + h, up_px = proxs[i] + h, dn_lp = lps[i] - h,
              dn_px = proxs[i] - h;
        pg_seq(&o, 1, &lps[i], &proxs[i], NULL, &a, &w, &g0, NULL);
        double up = pg_seq(&o, 1, &up_lp, &up_px, NULL, &a, &w, &d, NULL);
        double dn = pg_seq(&o, 1, &dn_lp, &dn_px, NULL, &a, &w, &d, NULL);
        CHECK_CLOSE(g0, (up - dn) / (2 * h), 1e-3, 1e-2);
    }
}

/* Rollout corrections on w = exp(prox - behav): truncated IS, masked IS by token and by
 * sequence; with ratio 1 (logp = prox) and A = 1 each token's loss is -weight. */
static void rollout_corrections(void) {
    rf_pg_opts o = {0.2f, 0.2f, 0, 1, 2.0f, 0, RF_KL_K3, 0, RF_PG_CLIP, RF_CORR_TIS, 0.5f, 2.0f};
    float lp[4] = {-1, -1, -1, -1}, behav[4], adv[4] = {1, 1, 1, 1}, w[4] = {1, 1, 1, 1}, g[4];
    float want_w[4] = {0.4f, 1.0f, 2.5f, 1.5f};
    for (int t = 0; t < 4; t++) behav[t] = -1.0f - logf(want_w[t]);
    rf_pg_stats st;
    /* tis: min(w, 2) = .4 1 2 1.5 */
    CHECK_CLOSE(pg_seq(&o, 4, lp, lp, behav, adv, w, g, &st), -(0.4 + 1 + 2 + 1.5), TOL, 0);
    CHECK_CLOSE(g[2], -2.0, TOL, 0);
    CHECK(st.is_truncated == 1 && st.is_masked == 0);
    CHECK_CLOSE(st.is_weight_max, 2.0, TOL, 0);
    /* mis-token, [0.5, 2]: 0.4 and 2.5 are dropped, the others weighted by w */
    o.corr = RF_CORR_MIS_TOKEN;
    CHECK_CLOSE(pg_seq(&o, 4, lp, lp, behav, adv, w, g, &st), -(1.0 + 1.5), TOL, 0);
    CHECK(g[0] == 0.0f && g[2] == 0.0f);
    CHECK_CLOSE(g[1], -1.0, TOL, 0);
    CHECK_CLOSE(g[3], -1.5, TOL, 0);
    CHECK(st.is_masked == 2 && st.is_truncated == 0 && st.seqs == 1 && st.seqs_masked == 0);
    /* mis-seq: the sequence's weight exp(mean log w) = (.4 * 1 * 2.5)^(1/3) = 1 is inside, so
     * every token is kept with weight 1 though two tokens' own weights are outside */
    o.corr = RF_CORR_MIS_SEQ;
    float b3[3] = {behav[0], behav[1], behav[2]};
    CHECK_CLOSE(pg_seq(&o, 3, lp, lp, b3, adv, w, g, &st), -3.0, TOL, 0);
    for (int t = 0; t < 3; t++) CHECK_CLOSE(g[t], -1.0, TOL, 0);
    CHECK(st.is_masked == 0 && st.seqs_masked == 0);
    /* a sequence at weight 3 everywhere is dropped whole */
    float b3x[3] = {-1 - logf(3), -1 - logf(3), -1 - logf(3)};
    CHECK(pg_seq(&o, 3, lp, lp, b3x, adv, w, g, &st) == 0.0);
    CHECK(g[0] == 0.0f && g[1] == 0.0f && g[2] == 0.0f);
    CHECK(st.is_masked == 3 && st.seqs_masked == 1 && st.seqs == 1);
    /* weight 1.5 everywhere: kept, each token weighted 1.5 */
    float b15[3] = {-1 - logf(1.5f), -1 - logf(1.5f), -1 - logf(1.5f)};
    CHECK_CLOSE(pg_seq(&o, 3, lp, lp, b15, adv, w, g, &st), -4.5, TOL, 0);
    /* the weights are constants: the gradient still matches finite differences (mis-token on
     * the clip objective, ratios away from the clip kinks) */
    o.corr = RF_CORR_MIS_TOKEN;
    float lq[4] = {-0.9f, -1.05f, -1.1f, -0.95f}, advq[4] = {0.6f, -0.4f, 1.1f, -0.8f}, dummy[4];
    pg_seq(&o, 4, lq, lp, behav, advq, w, g, NULL);
    for (int t = 0; t < 4; t++) {
        float x[4], h = 1e-3f;
        memcpy(x, lq, sizeof x);
        x[t] = lq[t] + h;
        double up = pg_seq(&o, 4, x, lp, behav, advq, w, dummy, NULL);
        x[t] = lq[t] - h;
        double dn = pg_seq(&o, 4, x, lp, behav, advq, w, dummy, NULL);
        CHECK_CLOSE(g[t], (up - dn) / (2 * h), 2e-3, 1e-2);
    }
}

static void value_loss(void) {
    float v = 1.0f, vo = 0.5f, r = 2.0f, w = 1.0f, dv;
    double cf = 0;
    CHECK_CLOSE(rf_value_loss(1, &v, &vo, &r, 0.2f, &w, &dv, &cf), 0.5 * 1.3 * 1.3, TOL, 0);
    CHECK_CLOSE(dv, 0.0, TOL, 0);
    CHECK(cf == 1);
    v = 0.6f;
    CHECK_CLOSE(rf_value_loss(1, &v, &vo, &r, 0.2f, &w, &dv, &cf), 0.5 * 1.4 * 1.4, TOL, 0);
    CHECK_CLOSE(dv, -1.4, TOL, 0);
}

static void schedule(void) {
    rf_optim_opts o = {.lr = 1e-3f, .min_lr_ratio = 0.1f, .warmup_steps = 10, .total_steps = 110, .cosine = 1};
    CHECK_CLOSE(rf_lr_at(&o, 0), 1e-4, 1e-9, 0);
    CHECK_CLOSE(rf_lr_at(&o, 9), 1e-3, 1e-9, 0);
    CHECK_CLOSE(rf_lr_at(&o, 60), 1e-4 + 0.5 * 9e-4, 1e-8, 0); /* halfway: cos(pi/2) = 0 */
    CHECK_CLOSE(rf_lr_at(&o, 110), 1e-4, 1e-9, 0);
    o.cosine = 0;
    CHECK_CLOSE(rf_lr_at(&o, 100), 1e-3, 1e-9, 0);
}

int main(void) {
    group_estimators();
    token_rewards();
    gae_and_reinforce();
    aggregation_and_kl();
    surrogate();
    decoupled_reduces_to_ppo();
    pg_gradient_fd();
    gspo();
    gspo_gradient_fd();
    cispo();
    rollout_corrections();
    value_loss();
    schedule();
    return rf_test_finish("test_algorithms");
}
