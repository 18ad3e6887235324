#include "actor/losses.h"

#include <math.h>
#include <string.h>

rf_status rf_loss_agg_parse(const char *name, rf_loss_agg *out) {
    static const char *names[] = {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"};
    for (int i = 0; i < 4; i++)
        if (strcmp(name, names[i]) == 0) {
            *out = (rf_loss_agg)i;
            return RF_OK;
        }
    return rf_error(RF_ERR_ARG, "loss_agg \"%s\" unknown (token-mean, seq-mean-token-sum, "
                    "seq-mean-token-mean, seq-mean-token-sum-norm)", name);
}

rf_status rf_kl_est_parse(const char *name, rf_kl_est *out) {
    if (strcmp(name, "k1") == 0) *out = RF_KL_K1;
    else if (strcmp(name, "k2") == 0) *out = RF_KL_K2;
    else if (strcmp(name, "k3") == 0) *out = RF_KL_K3;
    else return rf_error(RF_ERR_ARG, "kl_estimator \"%s\" unknown (k1, k2, k3)", name);
    return RF_OK;
}

float rf_kl_value(rf_kl_est e, float logp, float ref, float *dlogp) {
    float d = logp - ref;
    switch (e) {
    case RF_KL_K1:
        *dlogp = 1.0f;
        return d;
    case RF_KL_K2:
        *dlogp = d;
        return 0.5f * d * d;
    case RF_KL_K3:
    default: {
        /* exp(ref - logp) - (ref - logp) - 1; clamp the exponent like verl (|x| <= 20) */
        float x = ref - logp;
        x = x > 20.0f ? 20.0f : x < -20.0f ? -20.0f : x;
        float ex = expf(x);
        *dlogp = 1.0f - ex;
        return ex - x - 1.0f;
    }
    }
}

void rf_loss_weights(rf_loss_agg agg, const int *n_tokens, int n_seqs, int max_len, float *w) {
    long total = 0;
    for (int i = 0; i < n_seqs; i++) total += n_tokens[i];
    rf_loss_weights_of(agg, n_tokens, n_seqs, max_len, total, n_seqs, w);
}

void rf_loss_weights_of(rf_loss_agg agg, const int *n_tokens, int n_seqs, int max_len,
                        long total_tokens, long total_seqs, float *w) {
    for (int i = 0, k = 0; i < n_seqs; i++)
        for (int t = 0; t < n_tokens[i]; t++, k++) {
            switch (agg) {
            case RF_AGG_TOKEN_MEAN: w[k] = 1.0f / (float)total_tokens; break;
            case RF_AGG_SEQ_MEAN_TOKEN_SUM: w[k] = 1.0f / (float)total_seqs; break;
            case RF_AGG_SEQ_MEAN_TOKEN_MEAN: w[k] = 1.0f / ((float)total_seqs * (float)n_tokens[i]); break;
            case RF_AGG_SEQ_MEAN_TOKEN_SUM_NORM: w[k] = 1.0f / ((float)total_seqs * (float)max_len); break;
            }
        }
}

/* Clipped surrogate for one token: loss and d loss / d logp (before the aggregation weight). */
static float surrogate(const rf_pg_opts *o, float ratio, float adv, float *dratio, int *clipped) {
    float lo = 1.0f - o->clip_low, hi = 1.0f + o->clip_high;
    float rc = ratio < lo ? lo : ratio > hi ? hi : ratio;
    float s1 = ratio * adv, s2 = rc * adv;
    float loss = -(s1 < s2 ? s1 : s2);
    /* gradient flows through s1 when it is the minimum (or equal), else through the clipped
     * ratio, which is constant outside [lo, hi] */
    *dratio = s1 <= s2 ? -adv : (rc == ratio ? -adv : 0.0f);
    *clipped = s2 < s1;
    if (o->dual_clip > 1.0f && adv < 0.0f && loss > -o->dual_clip * adv) {
        loss = -o->dual_clip * adv;
        *dratio = 0.0f;
        *clipped = 1;
    }
    return loss;
}

void rf_pg_loss(const rf_pg_opts *o, int n, const float *logp, const float *prox,
                const float *behav, const float *ref, const float *entropy, const float *adv,
                const float *w, float *dlogp, float *dentropy, rf_pg_stats *st) {
    for (int t = 0; t < n; t++) {
        float ratio = expf(logp[t] - prox[t]), dratio;
        int clipped;
        float iw = 1.0f;
        if (o->decoupled) {
            float raw = expf(prox[t] - behav[t]);
            iw = raw < o->is_cap ? raw : o->is_cap;
            st->is_truncated += raw > o->is_cap;
        }
        float pg = surrogate(o, ratio, adv[t], &dratio, &clipped);
        float loss = iw * pg, g = iw * dratio * ratio; /* d ratio / d logp = ratio */
        if (ref && o->kl_coef != 0.0f) {
            float dkl, kl = rf_kl_value(o->kl_est, logp[t], ref[t], &dkl);
            loss += o->kl_coef * kl;
            g += o->kl_coef * dkl;
            st->kl += kl;
        }
        if (entropy) {
            loss -= o->entropy_coef * entropy[t];
            if (dentropy) dentropy[t] = -o->entropy_coef * w[t];
            st->entropy += entropy[t];
        }
        dlogp[t] = w[t] * g;
        st->loss += w[t] * loss;
        st->pg_loss += pg;
        st->clipped += clipped;
        st->ratio += ratio;
        st->is_weight += iw;
        st->is_weight_max = iw > st->is_weight_max ? iw : st->is_weight_max;
        st->approx_kl += 0.5 * (double)(logp[t] - prox[t]) * (logp[t] - prox[t]);
        st->tokens++;
    }
}

double rf_value_loss(int n, const float *v, const float *v_old, const float *ret, float clip,
                     const float *w, float *dv, double *clipfrac_sum) {
    double total = 0;
    for (int t = 0; t < n; t++) {
        float lo = v_old[t] - clip, hi = v_old[t] + clip;
        float vc = v[t] < lo ? lo : v[t] > hi ? hi : v[t];
        float e1 = v[t] - ret[t], e2 = vc - ret[t];
        if (e1 * e1 >= e2 * e2) {
            total += 0.5 * w[t] * e1 * e1;
            dv[t] = w[t] * e1;
        } else {
            total += 0.5 * w[t] * e2 * e2;
            dv[t] = vc == v[t] ? w[t] * e2 : 0.0f;
            *clipfrac_sum += 1;
        }
    }
    return total;
}
