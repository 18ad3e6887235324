/* Training updates: policy (PPO-style), value, and supervised. Each mini-batch is one optimizer
 * step; its micro-batches accumulate gradients with loss weights computed from the whole
 * mini-batch, so accumulation equals one big batch (ALGORITHMS.md, loss aggregation). */
#include <stdlib.h>
#include <string.h>

#include "actor/actor_internal.h"
#include "common/rng.h"

/* Per-sample loss weights of one mini-batch, indexed by sample id. */
typedef struct mb_weights {
    float **w; /* (n) pointers into buf, NULL for samples outside the mini-batch */
    float *buf;
} mb_weights;

static rf_status weights_init(mb_weights *mw, const rf_train_sample *s, int n, const int *idx,
                              int cnt, rf_loss_agg agg, int max_len) {
    long total = 0;
    int *nt = calloc((size_t)(cnt > 0 ? cnt : 1), sizeof(int));
    if (!nt) return rf_error(RF_ERR_NOMEM, "out of memory for loss weights");
    for (int k = 0; k < cnt; k++) {
        nt[k] = s[idx[k]].n_resp;
        total += nt[k];
    }
    mw->w = calloc((size_t)n, sizeof(float *));
    mw->buf = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    if (!mw->w || !mw->buf) {
        free(nt);
        return rf_error(RF_ERR_NOMEM, "out of memory for loss weights");
    }
    rf_loss_weights(agg, nt, cnt, max_len, mw->buf);
    for (int k = 0, off = 0; k < cnt; k++) {
        mw->w[idx[k]] = mw->buf + off;
        off += nt[k];
    }
    free(nt);
    return RF_OK;
}

static void weights_free(mb_weights *mw) {
    free(mw->w), free(mw->buf);
}

/* What a micro-batch's loss needs: options, the mini-batch's loss weights, statistics. */
typedef struct upd_ctx {
    const rf_update_opts *uo;
    mb_weights mw;
    rf_update_stats *st;
} upd_ctx;

/* Policy loss gradient for one micro-batch, then backward. */
static rf_status pg_fn(rf_model *m, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    upd_ctx *c = vctx;
    size_t T = (size_t)mb->T;
    float *lp = malloc(sizeof(float) * T), *en = malloc(sizeof(float) * T);
    float *dlp = calloc(T, sizeof(float)), *den = calloc(T, sizeof(float));
    rf_status st = lp && en && dlp && den ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) st = rf_model_logprobs(m, mb->tgt, c->uo->inv_temp, lp, en);
    int use_ent = c->uo->pg.entropy_coef != 0.0f;
    for (int k = 0; st == RF_OK && k < mb->n; k++) {
        rf_train_sample *x = &s[idx[k]];
        int r = mb->resp[k];
        if (c->uo->prox_from_forward) memcpy(x->prox_logp, lp + r, sizeof(float) * (size_t)x->n_resp);
        rf_pg_loss(&c->uo->pg, x->n_resp, lp + r, x->prox_logp, x->behav_logp,
                   c->uo->pg.kl_coef != 0.0f ? x->ref_logp : NULL, en + r, x->adv, c->mw.w[idx[k]],
                   dlp + r, den + r, &c->st->pg);
    }
    if (st == RF_OK) st = rf_model_backward(m, dlp, use_ent ? den : NULL, NULL);
    free(lp), free(en), free(dlp), free(den);
    return st;
}

static rf_status value_fn(rf_model *m, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    upd_ctx *c = vctx;
    size_t T = (size_t)mb->T;
    float *v = malloc(sizeof(float) * T), *dv = calloc(T, sizeof(float));
    rf_status st = v && dv ? rf_model_values(m, v) : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < mb->n; k++) {
        rf_train_sample *x = &s[idx[k]];
        int r = mb->resp[k];
        c->st->value_loss += rf_value_loss(x->n_resp, v + r, x->values, x->returns, c->uo->value_clip,
                                           c->mw.w[idx[k]], dv + r, &c->st->value_clipfrac);
    }
    if (st == RF_OK) st = rf_model_backward(m, NULL, NULL, dv);
    free(v), free(dv);
    return st;
}

/* Seeded Fisher-Yates: the order of samples for one epoch. */
static void shuffle(int *idx, int n, uint64_t seed) {
    rf_rng r;
    rf_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) idx[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(rf_rng_u64(&r) % (uint64_t)(i + 1)), t = idx[i];
        idx[i] = idx[j], idx[j] = t;
    }
}

/* Epochs x mini-batches; fn computes each micro-batch's loss gradient. */
static rf_status run_update(rf_model *m, const rf_optim_opts *oo, const rf_update_opts *uo,
                            rf_train_sample *s, int n, rf_update_stats *st, micro_fn fn) {
    RF_TRY(rf__validate_samples(s, n));
    int *idx = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    int mbs = uo->mini_batches < 1 ? 1 : uo->mini_batches > n ? n : uo->mini_batches;
    rf_status r = RF_OK;
    for (int e = 0; r == RF_OK && e < uo->epochs; e++) {
        shuffle(idx, n, uo->shuffle_seed + (uint64_t)e);
        for (int b = 0; r == RF_OK && b < mbs; b++) {
            int lo = (int)((long)n * b / mbs), hi = (int)((long)n * (b + 1) / mbs);
            upd_ctx c = {uo, {0}, st};
            r = weights_init(&c.mw, s, n, idx + lo, hi - lo, uo->agg, uo->max_resp_len);
            rf_model_zero_grad(m);
            if (r == RF_OK) r = rf__for_each_micro(m, s, idx + lo, hi - lo, uo->micro_tokens, fn, &c);
            weights_free(&c.mw);
            double gn = 0;
            float lr = 0;
            if (r == RF_OK) r = rf_optim_step(m, oo, &gn, &lr);
            st->grad_norm = gn, st->lr = lr;
            st->optimizer_steps++;
            for (int k = lo; k < hi; k++) st->tokens += s[idx[k]].n_resp;
        }
    }
    free(idx);
    return r;
}

rf_status rf_actor_update(rf_model *m, const rf_optim_opts *oo, const rf_update_opts *uo,
                          rf_train_sample *s, int n, rf_update_stats *st) {
    return run_update(m, oo, uo, s, n, st, pg_fn);
}

rf_status rf_critic_update(rf_model *c, const rf_optim_opts *oo, const rf_update_opts *uo,
                           rf_train_sample *s, int n, rf_update_stats *st) {
    return run_update(c, oo, uo, s, n, st, value_fn);
}

typedef struct sft_ctx {
    long total;
    double loss;
} sft_ctx;

static rf_status sft_fn(rf_model *m, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    sft_ctx *c = vctx;
    size_t T = (size_t)mb->T;
    float *lp = malloc(sizeof(float) * T), *d = calloc(T, sizeof(float));
    rf_status st = lp && d ? rf_model_logprobs(m, mb->tgt, 1.0f, lp, NULL) : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < mb->n; k++)
        for (int j = 0; j < s[idx[k]].n_resp; j++) {
            d[mb->resp[k] + j] = -1.0f / (float)c->total; /* loss masked to the response */
            c->loss -= lp[mb->resp[k] + j] / (double)c->total;
        }
    if (st == RF_OK) st = rf_model_backward(m, d, NULL, NULL);
    free(lp), free(d);
    return st;
}

rf_status rf_sft_update(rf_model *m, const rf_optim_opts *oo, int micro_tokens,
                        rf_train_sample *s, int n, double *loss, double *grad_norm) {
    sft_ctx c = {0, 0};
    for (int i = 0; i < n; i++) c.total += s[i].n_resp;
    int *idx = rf__identity(n);
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_model_zero_grad(m);
    rf_status st = rf__for_each_micro(m, s, idx, n, micro_tokens, sft_fn, &c);
    free(idx);
    float lr;
    if (st == RF_OK) st = rf_optim_step(m, oo, grad_norm, &lr);
    *loss = c.loss;
    return st;
}
