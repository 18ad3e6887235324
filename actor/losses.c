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

/* Sequence-level quantities of one response: GSPO's ratio and mis-seq's weight. */
typedef struct seq_terms {
    float gspo_ratio; /* exp(mean_t (logp - prox)) */
    float is_w;       /* exp(mean_t (prox - behav)) */
    int keep;         /* mis-seq: is_low <= is_w <= is_high */
} seq_terms;

static seq_terms sequence_terms(const rf_pg_opts *o, int n, const float *logp, const float *prox,
                                const float *behav, const float *w) {
    seq_terms s = {1.0f, 1.0f, 1};
    double a = 0, b = 0;
    int m = 0; /* tokens in the loss (weight 0: masked out) */
    for (int t = 0; t < n; t++) {
        if (w[t] == 0.0f) continue;
        a += (double)logp[t] - prox[t], m++;
        if (o->decoupled && o->corr == RF_CORR_MIS_SEQ) b += (double)prox[t] - behav[t];
    }
    if (m > 0) s.gspo_ratio = (float)exp(a / m), s.is_w = (float)exp(b / m);
    s.keep = s.is_w >= o->is_low && s.is_w <= o->is_high;
    return s;
}

/* The rollout-correction weight of token t (1 when not decoupled). */
static float correction_weight(const rf_pg_opts *o, const seq_terms *sq, float prox, float behav,
                               rf_pg_stats *st) {
    if (!o->decoupled) return 1.0f;
    float raw = expf(prox - behav);
    switch (o->corr) {
    case RF_CORR_MIS_TOKEN: {
        int keep = raw >= o->is_low && raw <= o->is_high;
        st->is_masked += !keep;
        return keep ? raw : 0.0f;
    }
    case RF_CORR_MIS_SEQ:
        st->is_masked += !sq->keep;
        return sq->keep ? sq->is_w : 0.0f;
    case RF_CORR_TIS:
    default:
        st->is_truncated += raw > o->is_cap;
        return raw < o->is_cap ? raw : o->is_cap;
    }
}

/* The policy term of token t: its loss and d loss / d logp_t (before weights). */
static float policy_term(const rf_pg_opts *o, const seq_terms *sq, float logp, float ratio,
                         float adv, float *g, int *clipped) {
    float dratio, pg;
    switch (o->kind) {
    case RF_PG_GSPO:
        pg = surrogate(o, sq->gspo_ratio, adv, &dratio, clipped);
        *g = dratio * sq->gspo_ratio; /* d s / d logp_t = s / n; the weights sum the n tokens */
        return pg;
    case RF_PG_CISPO: {
        float lo = 1.0f - o->clip_low, hi = 1.0f + o->clip_high;
        float c = ratio < lo ? lo : ratio > hi ? hi : ratio;
        *clipped = c != ratio;
        *g = -c * adv; /* the weight is a constant (stop-gradient) */
        return -c * adv * logp;
    }
    case RF_PG_CLIP:
    default:
        pg = surrogate(o, ratio, adv, &dratio, clipped);
        *g = dratio * ratio; /* d ratio / d logp = ratio */
        return pg;
    }
}

void rf_pg_loss(const rf_pg_opts *o, int n, const float *logp, const float *prox,
                const float *behav, const float *ref, const float *entropy, const float *adv,
                const float *w, float *dlogp, float *dentropy, rf_pg_stats *st) {
    seq_terms sq = sequence_terms(o, n, logp, prox, behav, w);
    st->seqs += 1;
    st->seqs_masked += o->decoupled && o->corr == RF_CORR_MIS_SEQ && !sq.keep;
    for (int t = 0; t < n; t++) {
        if (w[t] == 0.0f) { /* masked out of the loss (an environment's observation) */
            dlogp[t] = 0.0f;
            if (dentropy) dentropy[t] = 0.0f;
            continue;
        }
        float ratio = expf(logp[t] - prox[t]), dpg;
        int clipped;
        float iw = correction_weight(o, &sq, prox[t], o->decoupled ? behav[t] : 0.0f, st);
        float pg = policy_term(o, &sq, logp[t], ratio, adv[t], &dpg, &clipped);
        float loss = iw * pg, g = iw * dpg;
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
        if (w[t] == 0.0f) { /* masked out of the loss */
            dv[t] = 0.0f;
            continue;
        }
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
