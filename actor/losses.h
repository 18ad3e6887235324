/* RL losses on per-token host arrays, with their gradients with respect to the per-token
 * log-prob, entropy and value, as ../shared/ALGORITHMS.md defines them: the clipped surrogate
 * (asymmetric clip, optional dual clip), the decoupled off-policy weight, KL to the reference
 * as a loss (k1/k2/k3), the entropy bonus, the clipped value loss, and the loss aggregation
 * modes; GSPO's sequence-level ratio and CISPO's clipped stop-gradient weight instead of the
 * token clip; the rollout-correction weights (truncated IS, masked IS by token or sequence).
 * The model's backward takes the gradients these return. */
#ifndef RF_LOSSES_H
#define RF_LOSSES_H

#include "common/status.h"

typedef enum rf_loss_agg {
    RF_AGG_TOKEN_MEAN,              /* sum over tokens / tokens in the mini-batch */
    RF_AGG_SEQ_MEAN_TOKEN_SUM,      /* mean over sequences of each sequence's token sum */
    RF_AGG_SEQ_MEAN_TOKEN_MEAN,     /* mean over sequences of each sequence's token mean */
    RF_AGG_SEQ_MEAN_TOKEN_SUM_NORM, /* token sum / (sequences * max response length): Dr. GRPO */
} rf_loss_agg;

rf_status rf_loss_agg_parse(const char *name, rf_loss_agg *out);

typedef enum rf_kl_est { RF_KL_K1, RF_KL_K2, RF_KL_K3 } rf_kl_est;
rf_status rf_kl_est_parse(const char *name, rf_kl_est *out);

/* KL estimate between policy and reference from log-probs, and its derivative in logp. */
float rf_kl_value(rf_kl_est e, float logp, float ref_logp, float *dlogp);

/* Weight of each token in the aggregated loss, computed from the totals of the whole
 * mini-batch so that gradient accumulation over micro-batches equals one big batch.
 * n_tokens (n_seqs) per sequence; writes w for every token of every sequence, in order. */
void rf_loss_weights(rf_loss_agg agg, const int *n_tokens, int n_seqs, int max_len, float *w);

/* The same for a part of a mini-batch (data parallelism: one rank's share) whose whole has
 * total_tokens tokens in total_seqs sequences: the weights this part's tokens have in the
 * whole. rf_loss_weights is this with the part's own totals. */
void rf_loss_weights_of(rf_loss_agg agg, const int *n_tokens, int n_seqs, int max_len,
                        long total_tokens, long total_seqs, float *w);

typedef enum rf_pg_kind {
    RF_PG_CLIP = 0, /* PPO's clipped surrogate on each token's ratio */
    RF_PG_GSPO,     /* GSPO (Zheng et al. 2025): the clipped surrogate on the sequence's ratio
                       s = exp(mean_t (logp - prox)), in its token form: d loss_t / d logp_t =
                       d surrogate / d s * s, which with any aggregation mode (equal weights
                       within a sequence) is the exact gradient of sum_t w_t * surrogate(s) */
    RF_PG_CISPO,    /* CISPO (MiniMax-M1, 2025): loss_t = -sg(clip(ratio_t, 1 - clip_low,
                       1 + clip_high)) * adv_t * logp_t; every token keeps its gradient */
} rf_pg_kind;

/* The weight of the gap between the behaviour (generation) and proximal (training) log-probs,
 * w = exp(prox - behav), when rf_pg_opts.decoupled is set. */
typedef enum rf_is_corr {
    RF_CORR_TIS = 0,   /* min(w_t, is_cap): truncated IS (AReaL's decoupled weight) */
    RF_CORR_MIS_TOKEN, /* w_t when is_low <= w_t <= is_high, else 0: the token is dropped */
    RF_CORR_MIS_SEQ,   /* w_seq = exp(mean_t (prox - behav)) on every token when is_low <=
                          w_seq <= is_high, else 0: the whole sequence is dropped */
} rf_is_corr;

typedef struct rf_pg_opts {
    float clip_low, clip_high; /* epsilon_low, epsilon_high */
    float dual_clip;           /* c > 1 enables dual clip for negative advantages; 0 = off */
    int decoupled;             /* weight by min(exp(prox - behav), is_cap) */
    float is_cap;
    float kl_coef;             /* beta for KL as a loss (0 = off) */
    rf_kl_est kl_est;
    float entropy_coef;        /* alpha */
    rf_pg_kind kind;           /* RF_PG_CLIP (0) unless set; clip_low / clip_high bound GSPO's
                                  sequence ratio and CISPO's weight; dual_clip applies to clip
                                  and gspo */
    rf_is_corr corr;           /* with decoupled: which weight (RF_CORR_TIS when 0) */
    float is_low, is_high;     /* masked IS: the range of weights kept */
} rf_pg_opts;

/* Statistics summed over tokens (divide by `tokens` for means). */
typedef struct rf_pg_stats {
    double loss, pg_loss, kl, entropy, clipped, ratio, is_weight, is_truncated, approx_kl;
    double is_weight_max;
    long tokens;
    double is_masked;      /* tokens whose masked-IS weight was 0 (dropped) */
    double seqs, seqs_masked; /* calls (sequences), and those mis-seq dropped */
} rf_pg_stats;

/* Policy-gradient loss over the n tokens of one response: logp (current), prox (proximal: the
 * policy at the start of this update), behav (behaviour, from generation; used when
 * decoupled), ref (NULL unless KL is a loss), entropy (current; NULL = no bonus), adv, w
 * (aggregation weights; a token of weight 0 is masked out: no gradient, no statistic, not in
 * GSPO's or mis-seq's sequence means). Outputs the gradients dlogp and dentropy (NULL allowed when entropy
 * is NULL) and accumulates stats. GSPO and mis-seq take sequence-level quantities over the n
 * tokens, so a call must hold exactly one response there; the token-level losses accept any
 * run of tokens. ../shared/ALGORITHMS.md defines each term. */
void rf_pg_loss(const rf_pg_opts *o, int n, const float *logp, const float *prox,
                const float *behav, const float *ref, const float *entropy, const float *adv,
                const float *w, float *dlogp, float *dentropy, rf_pg_stats *st);

/* Clipped value loss 0.5 * max((V - R)^2, (clip(V, Vold - c, Vold + c) - R)^2) weighted by w;
 * writes dvalues and returns the weighted loss; *clipfrac_sum counts tokens where the clipped
 * term was chosen. */
double rf_value_loss(int n, const float *v, const float *v_old, const float *ret, float clip,
                     const float *w, float *dv, double *clipfrac_sum);

#endif
