#include "actor/actor.h"
#include "actor/actor_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"

rf_status rf_train_sample_alloc(rf_train_sample *s) {
    size_t n = (size_t)(s->n_resp > 0 ? s->n_resp : 1);
    float **arrs[] = {&s->behav_logp, &s->prox_logp, &s->ref_logp, &s->values,
                      &s->adv,        &s->returns,   &s->entropy};
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++)
        if (!*arrs[i] && !(*arrs[i] = calloc(n, sizeof(float))))
            return rf_error(RF_ERR_NOMEM, "out of memory for a sample");
    if (!s->versions && !(s->versions = calloc(n, sizeof(int))))
        return rf_error(RF_ERR_NOMEM, "out of memory for a sample");
    return RF_OK;
}

void rf_train_sample_free(rf_train_sample *s) {
    if (!s) return;
    free(s->tokens), free(s->behav_logp), free(s->prox_logp), free(s->ref_logp);
    free(s->values), free(s->adv), free(s->returns), free(s->entropy), free(s->versions);
    free(s->text), free(s->token_rewards), free(s->loss_mask), free(s->rules_text);
    memset(s, 0, sizeof *s);
}

rf_status rf__micro_pack(micro *mb, rf_train_sample *s, const int *idx, int n) {
    int T = 0;
    for (int k = 0; k < n; k++) T += s[idx[k]].n_prompt + s[idx[k]].n_resp - 1;
    mb->tok = malloc(sizeof(int32_t) * (size_t)T);
    mb->tgt = malloc(sizeof(int32_t) * (size_t)T);
    mb->cu = malloc(sizeof(int32_t) * (size_t)(n + 1));
    mb->resp = malloc(sizeof(int32_t) * (size_t)n);
    if (!mb->tok || !mb->tgt || !mb->cu || !mb->resp) return rf_error(RF_ERR_NOMEM, "out of memory packing");
    mb->n = n, mb->T = T, mb->cu[0] = 0;
    for (int k = 0, off = 0; k < n; k++) {
        const rf_train_sample *x = &s[idx[k]];
        int len = x->n_prompt + x->n_resp;
        memcpy(mb->tok + off, x->tokens, sizeof(int32_t) * (size_t)(len - 1));
        memcpy(mb->tgt + off, x->tokens + 1, sizeof(int32_t) * (size_t)(len - 1));
        mb->resp[k] = off + x->n_prompt - 1;
        off += len - 1;
        mb->cu[k + 1] = off;
    }
    return RF_OK;
}

void rf__micro_free(micro *mb) {
    free(mb->tok), free(mb->tgt), free(mb->cu), free(mb->resp);
    memset(mb, 0, sizeof *mb);
}

/* How many samples from idx[0..n) fit in the next micro-batch of at most max_tokens (at least
 * one, so a long sample still runs alone). */
int rf__micro_count(const rf_train_sample *s, const int *idx, int n, int max_tokens) {
    int tokens = 0, k = 0;
    while (k < n) {
        int t = s[idx[k]].n_prompt + s[idx[k]].n_resp - 1;
        if (k > 0 && tokens + t > max_tokens) break;
        tokens += t;
        k++;
    }
    return k;
}

rf_status rf__validate_samples(const rf_train_sample *s, int n) {
    for (int i = 0; i < n; i++) {
        if (s[i].n_prompt < 1 || s[i].n_resp < 1)
            return rf_error(RF_ERR_ARG, "sample %d has %d prompt and %d response tokens (need >= 1 each)",
                            i, s[i].n_prompt, s[i].n_resp);
        if (rf__loss_tokens(&s[i]) < 1)
            return rf_error(RF_ERR_ARG, "sample %d has no token in the loss (its loss mask is all 0)", i);
    }
    return RF_OK;
}

int rf__loss_tokens(const rf_train_sample *s) {
    if (!s->loss_mask) return s->n_resp;
    int n = 0;
    for (int t = 0; t < s->n_resp; t++) n += s->loss_mask[t] != 0;
    return n;
}

rf_status rf__net_forward(const rf__net *n, const rf_batch *b) {
    return n->tp ? rf_model_tp_forward(n->tp, b) : rf_model_forward(n->m, b);
}

rf_status rf__net_logprobs(const rf__net *n, const int32_t *targets, float inv_temp, float *logp, float *entropy) {
    return n->tp ? rf_model_tp_logprobs(n->tp, targets, inv_temp, logp, entropy)
                 : rf_model_logprobs(n->m, targets, inv_temp, logp, entropy);
}

rf_status rf__net_values(const rf__net *n, float *values) {
    return n->tp ? rf_model_tp_values(n->tp, values) : rf_model_values(n->m, values);
}

rf_status rf__net_backward(const rf__net *n, const float *dlogp, const float *dentropy, const float *dvalues) {
    return n->tp ? rf_model_tp_backward(n->tp, dlogp, dentropy, dvalues) : rf_model_backward(n->m, dlogp, dentropy, dvalues);
}

rf_status rf__for_each_micro(const rf__net *net, rf_train_sample *s, const int *idx, int n,
                                int max_tokens, micro_fn fn, void *ctx) {
    RF_TRY(rf__validate_samples(s, n));
    for (int i = 0; i < n;) {
        int c = rf__micro_count(s, idx + i, n - i, max_tokens);
        micro mb = {0};
        rf_status st = rf__micro_pack(&mb, s, idx + i, c);
        mb.last = i + c >= n;
        rf_batch b = {mb.n, mb.T, mb.tok, NULL, mb.cu};
        if (st == RF_OK) st = rf__net_forward(net, &b);
        if (st == RF_OK) st = fn(net, &mb, s, idx + i, ctx);
        rf__micro_free(&mb);
        RF_TRY(st);
        i += c;
    }
    return RF_OK;
}

typedef struct lp_ctx {
    float inv_temp;
    float **out, **ent;
} lp_ctx;

static rf_status lp_fn(const rf__net *net, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    lp_ctx *c = vctx;
    float *lp = malloc(sizeof(float) * (size_t)mb->T), *en = malloc(sizeof(float) * (size_t)mb->T);
    rf_status st = lp && en ? rf__net_logprobs(net, mb->tgt, c->inv_temp, lp, c->ent ? en : NULL)
                            : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < mb->n; k++) {
        int i = idx[k];
        memcpy(c->out[i], lp + mb->resp[k], sizeof(float) * (size_t)s[idx[k]].n_resp);
        if (c->ent) memcpy(c->ent[i], en + mb->resp[k], sizeof(float) * (size_t)s[idx[k]].n_resp);
    }
    free(lp), free(en);
    return st;
}

int *rf__identity(int n) {
    int *idx = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    for (int i = 0; idx && i < n; i++) idx[i] = i;
    return idx;
}

static rf_status logprobs(const rf__net *net, rf_train_sample *s, int n, int max_tokens, float inv_temp,
                          float **out, float **ent) {
    int *idx = rf__identity(n);
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    lp_ctx c = {inv_temp, out, ent};
    rf_status st = rf__for_each_micro(net, s, idx, n, max_tokens, lp_fn, &c);
    free(idx);
    return st;
}

rf_status rf_actor_logprobs(rf_model *m, rf_train_sample *s, int n, int max_tokens,
                            float inv_temp, float **out, float **ent) {
    rf__net net = {m, NULL};
    return logprobs(&net, s, n, max_tokens, inv_temp, out, ent);
}

rf_status rf_actor_logprobs_tp(rf_model_tp *tp, rf_train_sample *s, int n, int max_tokens,
                               float inv_temp, float **out, float **ent) {
    rf__net net = {tp->m, tp};
    return logprobs(&net, s, n, max_tokens, inv_temp, out, ent);
}

static rf_status val_fn(const rf__net *net, micro *mb, rf_train_sample *s, const int *idx, void *vctx) {
    float **out = vctx, *v = malloc(sizeof(float) * (size_t)mb->T);
    rf_status st = v ? rf__net_values(net, v) : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; st == RF_OK && k < mb->n; k++)
        memcpy(out[idx[k]], v + mb->resp[k], sizeof(float) * (size_t)s[idx[k]].n_resp);
    free(v);
    return st;
}

static rf_status values(const rf__net *net, rf_train_sample *s, int n, int max_tokens, float **out) {
    int *idx = rf__identity(n);
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = rf__for_each_micro(net, s, idx, n, max_tokens, val_fn, out);
    free(idx);
    return st;
}

rf_status rf_critic_values(rf_model *critic, rf_train_sample *s, int n, int max_tokens, float **out) {
    rf__net net = {critic, NULL};
    return values(&net, s, n, max_tokens, out);
}

rf_status rf_critic_values_tp(rf_model_tp *tp, rf_train_sample *s, int n, int max_tokens, float **out) {
    rf__net net = {tp->m, tp};
    return values(&net, s, n, max_tokens, out);
}
