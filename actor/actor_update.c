/* Training updates: policy (PPO-style), value, and supervised. Each mini-batch is one optimizer
 * step; its micro-batches accumulate gradients with loss weights computed from the whole
 * mini-batch, so accumulation equals one big batch (ALGORITHMS.md, loss aggregation). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actor/actor_internal.h"
#include "common/rng.h"

/* Per-sample loss weights of one mini-batch, indexed by sample id. */
typedef struct mb_weights {
    float **w; /* (n) pointers into buf, NULL for samples outside the mini-batch */
    float *buf;
} mb_weights;

/* tot: the mini-batch's tokens and sequences over every rank (data parallelism; NULL: the
 * samples idx[0..cnt) are the whole mini-batch). */
static rf_status weights_init(mb_weights *mw, const rf_train_sample *s, int n, const int *idx,
                              int cnt, rf_loss_agg agg, int max_len, const long *tot) {
    long total = 0;
    int *nt = calloc((size_t)(cnt > 0 ? cnt : 1), sizeof(int));
    if (!nt) return rf_error(RF_ERR_NOMEM, "out of memory for loss weights");
    for (int k = 0; k < cnt; k++) {
        nt[k] = rf__loss_tokens(&s[idx[k]]);
        total += s[idx[k]].n_resp;
    }
    mw->w = calloc((size_t)(n > 0 ? n : 1), sizeof(float *));
    mw->buf = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    if (!mw->w || !mw->buf) {
        free(nt);
        return rf_error(RF_ERR_NOMEM, "out of memory for loss weights");
    }
    /* weights of the tokens in the loss, in their order; then spread over each response with
     * 0 at its masked tokens (observations), from the back so nothing is overwritten early */
    if (tot) rf_loss_weights_of(agg, nt, cnt, max_len, tot[0], tot[1], mw->buf);
    else rf_loss_weights(agg, nt, cnt, max_len, mw->buf);
    long in_loss = 0;
    for (int k = 0; k < cnt; k++) in_loss += nt[k];
    for (int k = cnt - 1, off = (int)total, src = (int)in_loss; k >= 0; k--) {
        const rf_train_sample *x = &s[idx[k]];
        off -= x->n_resp, src -= nt[k];
        if (x->loss_mask)
            for (int t = x->n_resp - 1, j = nt[k]; t >= 0; t--)
                mw->buf[off + t] = x->loss_mask[t] ? mw->buf[src + --j] : 0.0f;
        else if (off != src)
            memmove(mw->buf + off, mw->buf + src, sizeof(float) * (size_t)nt[k]);
        mw->w[idx[k]] = mw->buf + off;
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

/* Data parallelism: the last backward pass of a mini-batch reduces its gradient buckets as they
 * become final. */
static void arm_last(const upd_ctx *c, const micro *mb) {
    if (c->uo->dp && mb->last) rf_dp_arm(c->uo->dp);
}

/* Adds |behav - lp| of sample x's response tokens generated at `version` to the statistics. */
static void mismatch(rf_update_stats *st, const rf_train_sample *x, const float *lp, int version) {
    for (int t = 0; t < x->n_resp; t++) {
        if ((x->versions && x->versions[t] != version) || (x->loss_mask && !x->loss_mask[t])) continue;
        double d = fabs((double)x->behav_logp[t] - (double)lp[t]);
        st->lp_mismatch_sum += d, st->lp_mismatch_n++;
        st->lp_mismatch_max = d > st->lp_mismatch_max ? d : st->lp_mismatch_max;
    }
}

/* Policy loss gradient for one micro-batch, then backward. */
static rf_status pg_fn(const rf__net *net, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    upd_ctx *c = vctx;
    size_t T = (size_t)mb->T;
    float *lp = malloc(sizeof(float) * T), *en = malloc(sizeof(float) * T);
    float *dlp = calloc(T, sizeof(float)), *den = calloc(T, sizeof(float));
    rf_status st = lp && en && dlp && den ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) st = rf__net_logprobs(net, mb->tgt, c->uo->inv_temp, lp, en);
    int use_ent = c->uo->pg.entropy_coef != 0.0f;
    for (int k = 0; st == RF_OK && k < mb->n; k++) {
        rf_train_sample *x = &s[idx[k]];
        int r = mb->resp[k];
        if (c->uo->prox_from_forward) memcpy(x->prox_logp, lp + r, sizeof(float) * (size_t)x->n_resp);
        if (c->st->optimizer_steps == 0) mismatch(c->st, x, lp + r, c->uo->version);
        rf_pg_loss(&c->uo->pg, x->n_resp, lp + r, x->prox_logp, x->behav_logp,
                   c->uo->pg.kl_coef != 0.0f ? x->ref_logp : NULL, en + r, x->adv, c->mw.w[idx[k]],
                   dlp + r, den + r, &c->st->pg);
    }
    if (st == RF_OK) arm_last(c, mb);
    if (st == RF_OK) st = rf__net_backward(net, dlp, use_ent ? den : NULL, NULL);
    free(lp), free(en), free(dlp), free(den);
    return st;
}

static rf_status value_fn(const rf__net *net, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    upd_ctx *c = vctx;
    size_t T = (size_t)mb->T;
    float *v = malloc(sizeof(float) * T), *dv = calloc(T, sizeof(float));
    rf_status st = v && dv ? rf__net_values(net, v) : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < mb->n; k++) {
        rf_train_sample *x = &s[idx[k]];
        int r = mb->resp[k];
        c->st->value_loss += rf_value_loss(x->n_resp, v + r, x->values, x->returns, c->uo->value_clip,
                                           c->mw.w[idx[k]], dv + r, &c->st->value_clipfrac);
    }
    if (st == RF_OK) arm_last(c, mb);
    if (st == RF_OK) st = rf__net_backward(net, NULL, NULL, dv);
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

/* Data parallelism: the tokens and sequences of each of the mbs mini-batches of this pass over
 * every rank, tot (2 * mbs): tokens then sequences per mini-batch. */
static rf_status global_totals(rf_dp *dp, const rf_train_sample *s, int n, const int *idx, int mbs, long *tot) {
    for (int b = 0; b < mbs; b++) {
        int lo = (int)((long)n * b / mbs), hi = (int)((long)n * (b + 1) / mbs);
        tot[2 * b] = 0, tot[2 * b + 1] = hi - lo;
        for (int k = lo; k < hi; k++) tot[2 * b] += rf__loss_tokens(&s[idx[k]]);
    }
    return rf_dp_sum(dp, tot, tot, 2 * mbs, "summing the mini-batch sizes over DP ranks");
}

/* The optimizer step of the mini-batch: data parallel (over a tp x dp grid too), tensor
 * parallel (the norm is the whole model's, from every shard), or this rank's. */
static rf_status optim_step(const rf__net *net, const rf_optim_opts *oo, const rf_update_opts *uo, double *gn,
                            float *lr) {
    if (uo->dp) return rf_dp_optim_step(uo->dp, oo, gn, lr);
    return net->tp ? rf_optim_step_tp(net->tp, oo, gn, lr) : rf_optim_step(net->m, oo, gn, lr);
}

/* One optimizer step over the samples idx[0..cnt) (with data parallelism: this rank's share of
 * the mini-batch, whose totals over the ranks are tot). */
static rf_status mini_batch(const rf__net *net, const rf_optim_opts *oo, const rf_update_opts *uo, rf_train_sample *s,
                            int n, const int *idx, int cnt, const long *tot, rf_update_stats *st, micro_fn fn) {
    upd_ctx c = {uo, {0}, st};
    rf_status r = weights_init(&c.mw, s, n, idx, cnt, uo->agg, uo->max_resp_len, tot);
    if (net->tp) rf_model_tp_zero_grad(net->tp);
    else rf_model_zero_grad(net->m);
    if (r == RF_OK) r = rf__for_each_micro(net, s, idx, cnt, uo->micro_tokens, fn, &c);
    weights_free(&c.mw);
    if (r == RF_OK && uo->dp) r = rf_dp_sync_grads(uo->dp);
    double gn = 0;
    float lr = 0;
    if (r == RF_OK) r = optim_step(net, oo, uo, &gn, &lr);
    st->grad_norm = gn, st->lr = lr;
    st->optimizer_steps++;
    for (int k = 0; k < cnt; k++) st->tokens += rf__loss_tokens(&s[idx[k]]);
    return r;
}

/* Data parallelism: adds the statistics of this rank's share (loc) over every rank into st. */
static rf_status add_stats_over_ranks(rf_dp *dp, const rf_update_stats *loc, rf_update_stats *st) {
    enum { NF = 20 }; /* the last two are maxima, the others sums */
    const rf_pg_stats *p = &loc->pg;
    double mine[NF] = {p->loss, p->pg_loss, p->kl, p->entropy, p->clipped, p->ratio, p->is_weight,
                       p->is_truncated, p->approx_kl, (double)p->tokens, loc->value_loss,
                       loc->value_clipfrac, (double)loc->tokens, p->is_masked, p->seqs,
                       p->seqs_masked, loc->lp_mismatch_sum, (double)loc->lp_mismatch_n,
                       p->is_weight_max, loc->lp_mismatch_max};
    int size = rf_dp_size(dp);
    double *all = malloc(sizeof(double) * NF * (size_t)size), sum[NF] = {0};
    if (!all) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status r = rf_dp_allgather(dp, mine, all, sizeof mine, "gathering update statistics from DP ranks");
    for (int q = 0; r == RF_OK && q < size; q++)
        for (int i = 0; i < NF; i++)
            sum[i] = i >= NF - 2 ? fmax(sum[i], all[q * NF + i]) : sum[i] + all[q * NF + i];
    free(all);
    RF_TRY(r);
    rf_pg_stats *g = &st->pg;
    g->loss += sum[0], g->pg_loss += sum[1], g->kl += sum[2], g->entropy += sum[3], g->clipped += sum[4];
    g->ratio += sum[5], g->is_weight += sum[6], g->is_truncated += sum[7], g->approx_kl += sum[8];
    g->tokens += (long)sum[9], st->value_loss += sum[10], st->value_clipfrac += sum[11];
    st->tokens += (long)sum[12];
    g->is_masked += sum[13], g->seqs += sum[14], g->seqs_masked += sum[15];
    st->lp_mismatch_sum += sum[16], st->lp_mismatch_n += (long)sum[17];
    g->is_weight_max = fmax(g->is_weight_max, sum[18]);
    st->lp_mismatch_max = fmax(st->lp_mismatch_max, sum[19]);
    st->grad_norm = loc->grad_norm, st->lr = loc->lr;
    st->optimizer_steps += loc->optimizer_steps;
    return RF_OK;
}

/* Epochs x mini-batches; fn computes each micro-batch's loss gradient. With data parallelism
 * the number of mini-batches is bounded by the samples over every rank, each rank splits its
 * own share, and the statistics are summed over ranks at the end. With tensor parallelism
 * every rank runs the whole batch on its shard: the log-probs, losses and statistics are the
 * same on every rank, so nothing is summed. Both (a tp x dp grid): every TP rank of a DP
 * replica runs the replica's share; the totals and statistics are summed over the DP group of
 * the rank's TP position, which holds one rank of every replica. */
static rf_status run_update(rf_model *m, const rf_optim_opts *oo, const rf_update_opts *uo,
                            rf_train_sample *s, int n, rf_update_stats *st, micro_fn fn) {
    RF_TRY(rf__validate_samples(s, n));
    rf_dp *dp = uo->dp;
    if (dp && rf_dp_model(dp) != m)
        return rf_error(RF_ERR_ARG, "update: the data-parallel state belongs to another model");
    if (uo->tp && uo->tp->m != m)
        return rf_error(RF_ERR_ARG, "update: the tensor-parallel model is not this model's shard");
    if (dp && rf_dp_tp(dp) != uo->tp)
        return rf_error(RF_ERR_ARG, "update: the data-parallel state was made for %s",
                        uo->tp ? "another tensor-parallel model (rf_dp_init_tp)" : "a tensor-parallel model");
    rf__net net = {m, uo->tp};
    long n_all = n;
    if (dp) RF_TRY(rf_dp_sum(dp, &n_all, &n_all, 1, "counting the samples over DP ranks"));
    int mbs = uo->mini_batches < 1 ? 1 : uo->mini_batches > n_all ? (int)n_all : uo->mini_batches;
    int *idx = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    long *tot = malloc(sizeof(long) * 2 * (size_t)(mbs > 0 ? mbs : 1));
    rf_update_stats loc = {0}, *acc = dp ? &loc : st;
    rf_status r = idx && tot ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int e = 0; r == RF_OK && e < uo->epochs; e++) {
        shuffle(idx, n, uo->shuffle_seed + (uint64_t)e);
        if (dp) r = global_totals(dp, s, n, idx, mbs, tot);
        for (int b = 0; r == RF_OK && b < mbs; b++) {
            int lo = (int)((long)n * b / mbs), hi = (int)((long)n * (b + 1) / mbs);
            /* shares smaller than mini_batches can leave a mini-batch empty on every rank: no
             * step for it (one rank alone never has an empty one) */
            if (dp && tot[2 * b + 1] == 0) continue;
            r = mini_batch(&net, oo, uo, s, n, idx + lo, hi - lo, dp ? tot + 2 * b : NULL, acc, fn);
        }
    }
    free(idx), free(tot);
    if (r == RF_OK && dp) r = add_stats_over_ranks(dp, &loc, st);
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

static rf_status sft_fn(const rf__net *net, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    sft_ctx *c = vctx;
    size_t T = (size_t)mb->T;
    float *lp = malloc(sizeof(float) * T), *d = calloc(T, sizeof(float));
    rf_status st = lp && d ? rf__net_logprobs(net, mb->tgt, 1.0f, lp, NULL) : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < mb->n; k++)
        for (int j = 0; j < s[idx[k]].n_resp; j++) {
            if (s[idx[k]].loss_mask && !s[idx[k]].loss_mask[j]) continue;
            d[mb->resp[k] + j] = -1.0f / (float)c->total; /* loss masked to the response */
            c->loss -= lp[mb->resp[k] + j] / (double)c->total;
        }
    if (st == RF_OK) st = rf__net_backward(net, d, NULL, NULL);
    free(lp), free(d);
    return st;
}

rf_status rf_sft_update(rf_model *m, const rf_optim_opts *oo, int micro_tokens,
                        rf_train_sample *s, int n, double *loss, double *grad_norm) {
    sft_ctx c = {0, 0};
    for (int i = 0; i < n; i++) c.total += rf__loss_tokens(&s[i]);
    int *idx = rf__identity(n);
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_model_zero_grad(m);
    rf__net net = {m, NULL};
    rf_status st = rf__for_each_micro(&net, s, idx, n, micro_tokens, sft_fn, &c);
    free(idx);
    float lr;
    if (st == RF_OK) st = rf_optim_step(m, oo, grad_norm, &lr);
    *loss = c.loss;
    return st;
}
