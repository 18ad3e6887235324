/* Tensor-parallel forward, backward and KV-cache decoding over a packed batch. Each function
 * mirrors its single-rank twin in model_forward.c / model_backward.c / model_decode.c line by
 * line, on this rank's heads, intermediate rows and vocabulary rows, with the collectives of
 * Megatron-LM (model_tp.h) where a partial sum becomes whole. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/model_internal.h"
#include "model/model_tp_internal.h"

/* The gradient of parameter tensor p (at float `off` of it), or NULL when it has none (absent,
 * or the frozen base under LoRA). */
#define GRAD_AT(m, p, off) \
    ((p) && (size_t)((p) - (m)->params) >= (m)->n_frozen ? (m)->grads + ((p) - (m)->params) - (m)->n_frozen + (off) : NULL)
#define GRAD(m, p) GRAD_AT(m, p, 0)

/* A decode call's cache: new keys/values are appended before attention. Either the contiguous
 * cache c (with each new token's row) or, when `paged` is set, a paged one (model_internal.h). */
typedef struct tp_decode {
    rf_kv_cache *c;
    const int32_t *rows; /* (T) back end: each new token's row within a layer of c */
    int n;
    const rf__paged_view *paged;
} tp_decode;

/* ---- embedding (vocabulary-parallel) ---- */

/* x (T, C) = rows of this rank's vocabulary slice for its tokens, zeros elsewhere, summed
 * over the group (one upload of the tokens' slice rows, -1 outside it, and one kernel). */
static rf_status embed_forward(rf_model_tp *tp, float *x, int T) {
    const rf_kernels *k = tp->m->k;
    for (int t = 0; t < T; t++) {
        int r = tp->tokens[t] - tp->v0;
        tp->local[t] = r >= 0 && r < tp->Vl ? r : -1;
    }
    k->to_device(tp->d_local, tp->local, sizeof(int32_t) * (size_t)T);
    k->embedding_forward(x, tp->d_local, tp->m->wte, T, tp->cfg.hidden_size);
    return rf__tp_allreduce(tp, x, (size_t)T * tp->cfg.hidden_size, "allreduce of the embedding", -1);
}

/* dwte rows of this rank's slice += dx (T, C) rows of its tokens (dx is whole everywhere); the
 * ids embed_forward uploaded. */
static void embed_backward(rf_model_tp *tp, const float *dx, int T) {
    rf_model *m = tp->m;
    if (GRAD(m, m->wte)) m->k->embedding_backward(GRAD(m, m->wte), dx, tp->d_local, T, tp->cfg.hidden_size);
}

/* ---- one layer ---- */

/* Copies each local query head's k/v head into its own slot: dst (T, H, D) from src (T, KV, D)
 * (kv_of's map). */
static void expand_heads(const rf_model_tp *tp, float *dst, const float *src, int T) {
    const rf_model_config *c = &tp->cfg;
    tp->m->k->heads_expand(dst, src, T, tp->H, tp->KV, c->head_dim, tp->h0,
                           c->num_attention_heads / c->num_key_value_heads);
}

/* The transpose of expand_heads: dst (T, KV, D) = sums of src (T, H, D) per k/v head. */
static void reduce_heads(const rf_model_tp *tp, float *dst, const float *src, int T) {
    const rf_model_config *c = &tp->cfg;
    tp->m->k->heads_reduce(dst, src, T, tp->H, tp->KV, c->head_dim, tp->h0,
                           c->num_attention_heads / c->num_key_value_heads);
}

/* ---- LoRA adapters on this rank's blocks (model_forward.c's lora_forward) ---- */

/* out (T, OUT) += u B^T with u = scale * in A^T (T, r) kept in a->lora_u[t]; B read from its
 * row b0 on (the k/v heads projected here when k/v are replicated). For o and down, in is this
 * rank's slice of the input and u a partial sum: u B^T joins the partial output that the
 * layer's allreduce sums. */
static void lora_forward(rf_model_tp *tp, const rf_layer_weights *w, rf_tp_acts *a, int t, float *out,
                         const float *in, int T, int IN, int OUT, int b0) {
    if (!w->lora_a[t]) return;
    const rf_kernels *k = tp->m->k;
    int r = tp->m->lora.rank;
    k->matmul_forward(a->lora_u[t], in, w->lora_a[t], NULL, T, IN, r);
    k->scale(a->lora_u[t], tp->m->lora.scale, (size_t)T * r);
    k->matmul_forward(tp->lora_tmp, a->lora_u[t], w->lora_b[t] + (size_t)b0 * r, NULL, T, r, OUT);
    k->add_inplace(out, tp->lora_tmp, (size_t)T * OUT);
}

/* Backward of lora_forward: dB += dout^T u, du = scale * dout B, dA += du^T in, dinp (T, IN) +=
 * du A. For a replicated A or B this rank's gradient is partial (summed with the sync views). */
static void lora_backward(rf_model_tp *tp, int l, int t, float *dinp, const float *dout, const float *in, int IN,
                          int OUT, int b0) {
    rf_model *m = tp->m;
    const rf_layer_weights *w = &m->layers[l];
    if (!w->lora_a[t]) return;
    const rf_kernels *k = m->k;
    int T = tp->T, r = m->lora.rank;
    size_t bo = (size_t)b0 * r;
    k->matmul_backward(tp->lora_du, GRAD_AT(m, w->lora_b[t], bo), NULL, dout, tp->acts[l].lora_u[t], w->lora_b[t] + bo,
                       T, r, OUT);
    k->scale(tp->lora_du, m->lora.scale, (size_t)T * r);
    k->matmul_backward(tp->lora_tmp, GRAD(m, w->lora_a[t]), NULL, tp->lora_du, in, w->lora_a[t], T, IN, r);
    k->add_inplace(dinp, tp->lora_tmp, (size_t)T * IN);
}

/* This rank's q heads and k/v heads: projections (k/v from rows kv_row0.. of the local
 * weights), optional q/k norm, RoPE, expansion. */
static void qkv_forward(rf_model_tp *tp, const rf_layer_weights *w, rf_tp_acts *a, int T) {
    const rf_kernels *k = tp->m->k;
    const rf_model_config *c = &tp->cfg;
    int C = c->hidden_size, D = c->head_dim, H = tp->H, KV = tp->KV;
    size_t wr = (size_t)tp->kv_row0 * C;
    float *qdst = c->qk_norm ? a->q_raw : a->q, *kdst = c->qk_norm ? a->k_raw : a->k;
    k->matmul_forward(qdst, a->ln1, w->wq, w->bq, T, C, H * D);
    k->matmul_forward(kdst, a->ln1, w->wk + wr, w->bk ? w->bk + tp->kv_row0 : NULL, T, C, KV * D);
    k->matmul_forward(a->v, a->ln1, w->wv + wr, w->bv ? w->bv + tp->kv_row0 : NULL, T, C, KV * D);
    lora_forward(tp, w, a, RF_LORA_Q, qdst, a->ln1, T, C, H * D, 0);
    lora_forward(tp, w, a, RF_LORA_K, kdst, a->ln1, T, C, KV * D, tp->kv_row0);
    lora_forward(tp, w, a, RF_LORA_V, a->v, a->ln1, T, C, KV * D, tp->kv_row0);
    if (c->qk_norm) {
        k->rmsnorm_forward(a->q, a->q_rstd, a->q_raw, w->q_norm, T * H, D, c->rms_norm_eps);
        k->rmsnorm_forward(a->k, a->k_rstd, a->k_raw, w->k_norm, T * KV, D, c->rms_norm_eps);
    }
    k->rope_qk(a->q, a->k, tp->m->d_pos, tp->m->inv_freq, T, H, KV, D, 1);
    if (tp->KVA != tp->KV) {
        expand_heads(tp, a->ka, a->k, T);
        expand_heads(tp, a->va, a->v, T);
    }
}

/* One decoder layer: x_in (T, C) -> x_out (T, C), both whole on every rank. */
static rf_status layer_forward(rf_model_tp *tp, int l, rf_tp_acts *a, const float *x_in,
                               float *x_out, int T, const tp_decode *dc) {
    rf_model *m = tp->m;
    const rf_kernels *k = m->k;
    const rf_model_config *c = &tp->cfg;
    const rf_layer_weights *w = &m->layers[l];
    int C = c->hidden_size, F = tp->F, H = tp->H, D = c->head_dim;
    k->rmsnorm_forward(a->ln1, a->rstd1, x_in, w->ln1, T, C, c->rms_norm_eps);
    qkv_forward(tp, w, a, T);
    if (dc && dc->paged) {
        const rf__paged_view *pv = dc->paged;
        size_t off = (size_t)l * pv->layer_floats;
        k->paged_kv_write(pv->k + off, pv->v + off, a->ka, a->va, pv->slots, T, tp->KVA, D);
        k->paged_attention_forward(a->att, a->q, pv->k + off, pv->v + off, pv->q_off, pv->block_table,
                                   pv->max_blocks, pv->k_len, pv->n, pv->block_size, H, tp->KVA, D);
    } else if (dc) {
        size_t off = rf__kv_cache_layer(dc->c, l);
        k->paged_kv_write(dc->c->k + off, dc->c->v + off, a->ka, a->va, dc->rows, T, tp->KVA, D);
        k->attention_forward(a->att, NULL, a->q, dc->c->k + off, dc->c->v + off, m->d_cu,
                             m->d_kstart, m->d_klen, dc->n, H, tp->KVA, D);
    } else {
        k->attention_forward(a->att, a->lse, a->q, a->ka, a->va, m->d_cu, m->d_cu, m->d_klen,
                             tp->n_seq, H, tp->KVA, D);
    }
    /* row-parallel o_proj: partial sums; the replicated bias joins on rank 0 only */
    k->matmul_forward(a->x_mid, a->att, w->wo, tp->t == 0 ? w->bo : NULL, T, H * D, C);
    lora_forward(tp, w, a, RF_LORA_O, a->x_mid, a->att, T, H * D, C, 0);
    RF_TRY(rf__tp_allreduce(tp, a->x_mid, (size_t)T * C, "allreduce of the attention output", l));
    k->add_rmsnorm_forward(a->x_mid, a->ln2, a->rstd2, x_in, w->ln2, T, C, c->rms_norm_eps);
    k->matmul_forward(a->gate, a->ln2, w->wgate, NULL, T, C, F);
    k->matmul_forward(a->up, a->ln2, w->wup, NULL, T, C, F);
    lora_forward(tp, w, a, RF_LORA_GATE, a->gate, a->ln2, T, C, F, 0);
    lora_forward(tp, w, a, RF_LORA_UP, a->up, a->ln2, T, C, F, 0);
    k->swiglu_forward(a->act, a->gate, a->up, (size_t)T * F);
    k->matmul_forward(x_out, a->act, w->wdown, NULL, T, F, C);
    lora_forward(tp, w, a, RF_LORA_DOWN, x_out, a->act, T, F, C, 0);
    RF_TRY(rf__tp_allreduce(tp, x_out, (size_t)T * C, "allreduce of the MLP output", l));
    k->add_inplace(x_out, a->x_mid, (size_t)T * C);
    return RF_OK;
}

/* ---- forward ---- */

/* Validates the batch as rf_model_forward does (model_forward.c, batch_indices) and builds
 * positions and sequence lengths. */
static rf_status batch_indices(const rf_model_tp *tp, const rf_batch *b, int32_t *pos, int32_t *len) {
    if (b->n_seq <= 0 || b->cu_seqlens[0] != 0 || b->cu_seqlens[b->n_seq] != b->T)
        return rf_error(RF_ERR_ARG, "batch: cu_seqlens must start at 0 and end at T = %d", b->T);
    int max_seq = rf_config_max_seq(&tp->cfg);
    for (int s = 0; s < b->n_seq; s++) {
        len[s] = b->cu_seqlens[s + 1] - b->cu_seqlens[s];
        if (len[s] <= 0) return rf_error(RF_ERR_ARG, "batch: sequence %d is empty or offsets decrease", s);
        for (int i = 0; i < len[s]; i++) {
            int t = b->cu_seqlens[s] + i;
            pos[t] = b->pos ? b->pos[t] : i;
            if (pos[t] < 0 || pos[t] >= max_seq)
                return rf_error(RF_ERR_RANGE, "batch: position %d of sequence %d exceeds the model's "
                                "limit of %d", pos[t], s, max_seq);
        }
    }
    for (int t = 0; t < b->T; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= tp->cfg.vocab_size)
            return rf_error(RF_ERR_RANGE, "token id %d at position %d is outside the vocabulary "
                            "(vocab_size %d)", b->tokens[t], t, tp->cfg.vocab_size);
    return RF_OK;
}

static rf_status upload_batch(rf_model_tp *tp, const rf_batch *b) {
    rf_model *m = tp->m;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)(b->T + 1)),
            *len = malloc(sizeof(int32_t) * (size_t)(b->n_seq + 1));
    rf_status s = pos && len ? batch_indices(tp, b, pos, len) : rf_error(RF_ERR_NOMEM, "out of memory");
    if (s == RF_OK) s = rf__tp_reserve(tp, b->T);
    if (s == RF_OK) {
        const int32_t *host[] = {b->tokens, pos, b->cu_seqlens, len, NULL};
        int counts[] = {b->T, b->T, b->n_seq + 1, b->n_seq, b->T};
        int32_t *dev[5];
        s = rf__model_upload_ints(m, 5, host, counts, dev);
        m->d_tokens = dev[0], m->d_pos = dev[1], m->d_cu = dev[2], m->d_klen = dev[3];
        m->d_targets = dev[4];
        memcpy(tp->tokens, b->tokens, sizeof(int32_t) * (size_t)b->T);
    }
    free(pos);
    free(len);
    return s;
}

rf_status rf_model_tp_forward(rf_model_tp *tp, const rf_batch *b) {
    RF_TRY(upload_batch(tp, b));
    tp->T = b->T, tp->n_seq = b->n_seq, tp->have_logprobs = 0;
    const rf_model_config *c = &tp->cfg;
    int L = c->num_hidden_layers;
    RF_TRY(embed_forward(tp, tp->acts[0].x, b->T));
    for (int l = 0; l < L; l++)
        RF_TRY(layer_forward(tp, l, &tp->acts[l], tp->acts[l].x,
                             l + 1 < L ? tp->acts[l + 1].x : tp->x_final, b->T, NULL));
    tp->m->k->rmsnorm_forward(tp->h, tp->rstd_f, tp->x_final, tp->m->norm, b->T, c->hidden_size,
                              c->rms_norm_eps);
    return RF_OK;
}

/* ---- vocabulary-parallel log-prob ---- */

/* Combines the ranks' partials (lmax, sumexp, zsum, ztgt: part, 4 x T) into the whole
 * vocabulary's lse, entropy and log-prob: the maxima first (allgather), then the sums
 * rescaled to the common maximum (one allreduce). */
static rf_status combine_partials(rf_model_tp *tp, const float *part, float *logp, float *entropy) {
    int T = tp->T;
    const float *lmax = part, *sumexp = part + T, *zsum = part + 2 * T, *ztgt = part + 3 * T;
    float *M = tp->host + 4 * (size_t)T, *red = M + T, *all = red + 3 * (size_t)T;
    RF_TRY(rf__tp_allgather(tp, lmax, all, sizeof(float) * (size_t)T, "allgather of the log-prob maxima"));
    for (int t = 0; t < T; t++) {
        float mx = all[t];
        for (int r = 1; r < tp->tp; r++) mx = fmaxf(mx, all[(size_t)r * T + t]);
        M[t] = mx;
        double f = exp((double)lmax[t] - mx), d = (double)lmax[t] - mx;
        red[t] = (float)(sumexp[t] * f);
        red[T + t] = (float)(f * (zsum[t] + sumexp[t] * d));
        red[2 * T + t] = ztgt[t]; /* zero on every rank but the target's */
    }
    RF_TRY(rf__tp_allreduce_host(tp, red, 3 * (size_t)T, "allreduce of the log-prob sums"));
    for (int t = 0; t < T; t++) {
        double S = red[t], W = red[T + t];
        tp->lse[t] = (float)(M[t] + log(S));
        tp->ent[t] = (float)(log(S) - W / S); /* H = lse - E[z] */
        logp[t] = red[2 * T + t] - tp->lse[t];
        if (entropy) entropy[t] = tp->ent[t];
    }
    return RF_OK;
}

rf_status rf_model_tp_logprobs(rf_model_tp *tp, const int32_t *targets, float inv_temp,
                               float *logp, float *entropy) {
    rf_model *m = tp->m;
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "model has a value head, not an LM head");
    if (tp->T <= 0) return rf_error(RF_ERR_ARG, "log-probs: no forward pass");
    int T = tp->T;
    for (int t = 0; t < T; t++)
        if (targets[t] < 0 || targets[t] >= tp->cfg.vocab_size)
            return rf_error(RF_ERR_RANGE, "token id %d at position %d is outside the vocabulary "
                            "(vocab_size %d)", targets[t], t, tp->cfg.vocab_size);
    m->k->to_device(m->d_targets, targets, sizeof(int32_t) * (size_t)T);
    RF_TRY(rf__model_dev_out(m, 4 * (size_t)T));
    float *d = m->dev_out;
    m->k->logprob_vp_partials(d, d + T, d + 2 * T, d + 3 * T, tp->h, m->lm_head, m->d_targets, T,
                              tp->cfg.hidden_size, tp->Vl, tp->v0, inv_temp);
    m->k->to_host(tp->host, d, 4 * sizeof(float) * (size_t)T);
    RF_TRY(combine_partials(tp, tp->host, logp, entropy));
    tp->inv_temp = inv_temp;
    tp->have_logprobs = 1;
    return RF_OK;
}

rf_status rf_model_tp_values(rf_model_tp *tp, float *values) {
    rf_model *m = tp->m;
    if (!m->score) return rf_error(RF_ERR_ARG, "model has no value head (score.weight)");
    RF_TRY(rf__model_dev_out(m, (size_t)tp->T));
    m->k->matmul_forward(m->dev_out, tp->h, m->score, NULL, tp->T, tp->cfg.hidden_size, 1);
    m->k->to_host(values, m->dev_out, sizeof(float) * (size_t)tp->T);
    return RF_OK;
}

rf_status rf_model_tp_logits(rf_model_tp *tp, const int *rows, int n_rows, float *logits) {
    rf_model *m = tp->m;
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "model has a value head, not an LM head");
    int C = tp->cfg.hidden_size, Vl = tp->Vl;
    RF_TRY(rf__model_dev_out(m, (size_t)Vl));
    for (int i = 0; i < n_rows; i++) {
        if (rows[i] < 0 || rows[i] >= tp->T)
            return rf_error(RF_ERR_RANGE, "logits: row %d outside the batch of %d", rows[i], tp->T);
        m->k->matmul_forward(m->dev_out, tp->h + (size_t)rows[i] * C, m->lm_head, NULL, 1, C, Vl);
        m->k->to_host(logits + (size_t)i * Vl, m->dev_out, sizeof(float) * (size_t)Vl);
    }
    return RF_OK;
}

/* ---- backward ---- */

typedef struct grad_bufs {
    float *dx, *dln, *tmp;       /* (T, C) */
    float *dact, *dgate, *dup;   /* (T, F) */
    float *datt, *dq, *dq_raw;   /* (T, H*D) */
    float *dk, *dv, *dk_raw;     /* (T, KV*D) */
    float *dka, *dva;            /* (T, KVA*D): dk, dv themselves unless expanded */
} grad_bufs;

static rf_status reserve_grads(rf_model_tp *tp, grad_bufs *g) {
    size_t T = rf__rows_padded(tp->T), C = tp->cfg.hidden_size, F = tp->F, D = tp->cfg.head_dim,
           QD = (size_t)tp->H * D, KD = (size_t)tp->KV * D, XD = tp->KVA != tp->KV ? QD : 0;
    if (tp->T > tp->gmem_cap) {
        tp->m->k->free(tp->gmem);
        tp->gmem = tp->m->k->alloc((3 * C + 3 * F + 3 * QD + 3 * KD + 2 * XD) * T * sizeof(float));
        tp->gmem_cap = tp->gmem ? tp->T : 0;
        if (!tp->gmem) return rf_error(RF_ERR_NOMEM, "out of memory for gradients of %d tokens", tp->T);
    }
    float *p = tp->gmem;
#define TAKE(n) (p += (n), p - (n))
    g->dx = TAKE(T * C), g->dln = TAKE(T * C), g->tmp = TAKE(T * C);
    g->dact = TAKE(T * F), g->dgate = TAKE(T * F), g->dup = TAKE(T * F);
    g->datt = TAKE(T * QD), g->dq = TAKE(T * QD), g->dq_raw = TAKE(T * QD);
    g->dk = TAKE(T * KD), g->dv = TAKE(T * KD), g->dk_raw = TAKE(T * KD);
    g->dka = XD ? TAKE(T * XD) : g->dk;
    g->dva = XD ? TAKE(T * XD) : g->dv;
#undef TAKE
    return RF_OK;
}

/* MLP half: g->dx holds d(layer output) (whole); on return d(x_mid) (whole). */
static rf_status mlp_backward(rf_model_tp *tp, int l, grad_bufs *g) {
    rf_model *m = tp->m;
    const rf_kernels *k = m->k;
    const rf_layer_weights *w = &m->layers[l];
    const rf_tp_acts *a = &tp->acts[l];
    int T = tp->T, C = tp->cfg.hidden_size, F = tp->F;
    k->matmul_backward(g->dact, GRAD(m, w->wdown), NULL, g->dx, a->act, w->wdown, T, F, C);
    lora_backward(tp, l, RF_LORA_DOWN, g->dact, g->dx, a->act, F, C, 0);
    k->swiglu_backward(g->dgate, g->dup, g->dact, a->gate, a->up, (size_t)T * F);
    k->matmul_backward(g->dln, GRAD(m, w->wgate), NULL, g->dgate, a->ln2, w->wgate, T, C, F);
    lora_backward(tp, l, RF_LORA_GATE, g->dln, g->dgate, a->ln2, C, F, 0);
    k->matmul_backward(g->tmp, GRAD(m, w->wup), NULL, g->dup, a->ln2, w->wup, T, C, F);
    lora_backward(tp, l, RF_LORA_UP, g->tmp, g->dup, a->ln2, C, F, 0);
    k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    /* column-parallel gate/up: each rank's input gradient is a partial sum */
    RF_TRY(rf__tp_allreduce(tp, g->dln, (size_t)T * C, "allreduce of the MLP input gradient", l));
    k->rmsnorm_backward(g->dx, GRAD(m, w->ln2), g->dln, a->x_mid, w->ln2, a->rstd2, T, C);
    return RF_OK;
}

/* Attention half: g->dx holds d(x_mid); on return d(layer input). */
static rf_status attn_backward(rf_model_tp *tp, int l, grad_bufs *g) {
    rf_model *m = tp->m;
    const rf_kernels *k = m->k;
    const rf_model_config *c = &tp->cfg;
    const rf_layer_weights *w = &m->layers[l];
    const rf_tp_acts *a = &tp->acts[l];
    int T = tp->T, C = c->hidden_size, H = tp->H, KV = tp->KV, D = c->head_dim;
    size_t wr = (size_t)tp->kv_row0 * C;
    /* o_proj's bias gradient is the column sums of the whole dx: the same on every rank */
    k->matmul_backward(g->datt, GRAD(m, w->wo), GRAD(m, w->bo), g->dx, a->att, w->wo, T, H * D, C);
    lora_backward(tp, l, RF_LORA_O, g->datt, g->dx, a->att, H * D, C, 0);
    k->attention_backward(g->dq, g->dka, g->dva, g->datt, a->q, a->ka, a->va, a->att, a->lse,
                          m->d_cu, tp->n_seq, T, H, tp->KVA, D);
    if (tp->KVA != KV) {
        reduce_heads(tp, g->dk, g->dka, T);
        reduce_heads(tp, g->dv, g->dva, T);
    }
    k->rope_qk(g->dq, g->dk, m->d_pos, m->inv_freq, T, H, KV, D, -1);
    float *dq = g->dq, *dk = g->dk;
    if (c->qk_norm) {
        k->zero(g->dq_raw, sizeof(float) * (size_t)T * H * D);
        k->zero(g->dk_raw, sizeof(float) * (size_t)T * KV * D);
        k->rmsnorm_backward(g->dq_raw, GRAD(m, w->q_norm), g->dq, a->q_raw, w->q_norm, a->q_rstd, T * H, D);
        k->rmsnorm_backward(g->dk_raw, GRAD(m, w->k_norm), g->dk, a->k_raw, w->k_norm, a->k_rstd, T * KV, D);
        dq = g->dq_raw, dk = g->dk_raw;
    }
    float *dbk = GRAD_AT(m, w->bk, (size_t)tp->kv_row0), *dbv = GRAD_AT(m, w->bv, (size_t)tp->kv_row0);
    k->matmul_backward(g->dln, GRAD(m, w->wq), GRAD(m, w->bq), dq, a->ln1, w->wq, T, C, H * D);
    lora_backward(tp, l, RF_LORA_Q, g->dln, dq, a->ln1, C, H * D, 0);
    k->matmul_backward(g->tmp, GRAD_AT(m, w->wk, wr), dbk, dk, a->ln1, w->wk + wr, T, C, KV * D);
    lora_backward(tp, l, RF_LORA_K, g->tmp, dk, a->ln1, C, KV * D, tp->kv_row0);
    k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    k->matmul_backward(g->tmp, GRAD_AT(m, w->wv, wr), dbv, g->dv, a->ln1, w->wv + wr, T, C, KV * D);
    lora_backward(tp, l, RF_LORA_V, g->tmp, g->dv, a->ln1, C, KV * D, tp->kv_row0);
    k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    RF_TRY(rf__tp_allreduce(tp, g->dln, (size_t)T * C, "allreduce of the attention input gradient", l));
    k->rmsnorm_backward(g->dx, GRAD(m, w->ln1), g->dln, a->x, w->ln1, a->rstd1, T, C);
    return RF_OK;
}

/* Gradient at the final hidden states into g->dln (whole on every rank). */
static rf_status head_backward(rf_model_tp *tp, grad_bufs *g, const float *dlogp,
                               const float *dentropy, const float *dvalues) {
    rf_model *m = tp->m;
    const rf_kernels *k = m->k;
    int T = tp->T, C = tp->cfg.hidden_size;
    k->zero(g->dln, sizeof(float) * (size_t)T * C);
    if (dlogp || dentropy) {
        if (!m->lm_head) return rf_error(RF_ERR_ARG, "backward: log-prob gradient on a value-head model");
        if (!tp->have_logprobs) return rf_error(RF_ERR_ARG, "backward: call rf_model_tp_logprobs first");
        RF_TRY(rf__model_dev_out(m, 4 * (size_t)T));
        float *d_dl = m->dev_out, *d_de = d_dl + T, *d_lse = d_de + T, *d_ent = d_lse + T;
        if (dlogp) k->to_device(d_dl, dlogp, sizeof(float) * (size_t)T);
        if (dentropy) k->to_device(d_de, dentropy, sizeof(float) * (size_t)T);
        k->to_device(d_lse, tp->lse, sizeof(float) * (size_t)T);
        k->to_device(d_ent, tp->ent, sizeof(float) * (size_t)T);
        k->logprob_vp_backward(g->dln, GRAD(m, m->lm_head), dlogp ? d_dl : NULL, dentropy ? d_de : NULL,
                               d_lse, d_ent, tp->h, m->lm_head, m->d_targets, T, C, tp->Vl, tp->v0,
                               tp->inv_temp);
        RF_TRY(rf__tp_allreduce(tp, g->dln, (size_t)T * C, "allreduce of the LM head's input gradient", -1));
    }
    if (dvalues) {
        if (!m->score) return rf_error(RF_ERR_ARG, "backward: value gradient without a value head");
        RF_TRY(rf__model_dev_out(m, (size_t)T));
        k->to_device(m->dev_out, dvalues, sizeof(float) * (size_t)T);
        k->matmul_backward(g->tmp, GRAD(m, m->score), NULL, m->dev_out, tp->h, m->score, T, C, 1);
        k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    }
    return RF_OK;
}

/* Partial gradients (model_tp.h): this pass's share of each sync view is summed over the
 * group and added to what earlier passes accumulated. Before the pass: the accumulated values
 * move to staging and the views are zeroed; after it: pack, allreduce, add back. */
static void sync_save(rf_model_tp *tp) {
    rf_model *m = tp->m;
    size_t off = 0;
    for (int i = 0; i < tp->n_sync; i++) {
        const rf_param_view *v = &tp->sync_table[tp->sync_views[i]];
        float *gr = m->grads + (v->offset - m->n_frozen);
        m->k->copy(tp->sync_mem + off, gr, v->numel * sizeof(float));
        m->k->zero(gr, v->numel * sizeof(float));
        off += v->numel;
    }
}

static rf_status sync_finish(rf_model_tp *tp) {
    rf_model *m = tp->m;
    float *saved = tp->sync_mem, *pack = saved ? saved + tp->sync_floats : NULL; /* none to sync: NULL */
    size_t off = 0;
    for (int i = 0; i < tp->n_sync; i++) {
        const rf_param_view *v = &tp->sync_table[tp->sync_views[i]];
        m->k->copy(pack + off, m->grads + (v->offset - m->n_frozen), v->numel * sizeof(float));
        off += v->numel;
    }
    RF_TRY(rf__tp_allreduce(tp, pack, tp->sync_floats, "allreduce of the partial replicated gradients", -1));
    m->k->add_inplace(pack, saved, tp->sync_floats);
    off = 0;
    for (int i = 0; i < tp->n_sync; i++) {
        const rf_param_view *v = &tp->sync_table[tp->sync_views[i]];
        m->k->copy(m->grads + (v->offset - m->n_frozen), pack + off, v->numel * sizeof(float));
        off += v->numel;
    }
    return RF_OK;
}

/* The backward hook (model.h, rf_grad_ready_fn) on the shard's flat buffer, reported in the
 * order of rf_model_backward. A partial replicated gradient (sync views) is final only after
 * sync_finish: ranges are reported down to the end of the highest sync view, the rest after it
 * (`lo`: the lowest offset reported so far). */
typedef struct tp_ready {
    size_t hold; /* end of the highest sync view (0: none) */
    size_t lo;
} tp_ready;

static tp_ready ready_init(const rf_model_tp *tp) {
    const rf_model *m = tp->m;
    size_t n = m->n_params - m->n_frozen; /* the gradient buffer */
    /* LoRA: the adapters' ranges are not in rf_model_backward's order here: all at the end */
    tp_ready r = {m->lora.rank ? n : 0, n};
    for (int i = 0; i < tp->n_sync; i++) {
        const rf_param_view *v = &tp->sync_table[tp->sync_views[i]];
        if (v->offset + v->numel - m->n_frozen > r.hold) r.hold = v->offset + v->numel - m->n_frozen;
    }
    return r;
}

/* Floats from `from` to the end are final (from = 0 after sync_finish: all of them). */
static rf_status ready(rf_model_tp *tp, tp_ready *r, size_t from, int synced) {
    rf_model *m = tp->m;
    if (!synced && from < r->hold) from = r->hold;
    if (from >= r->lo || !m->grad_ready) return RF_OK;
    size_t hi = r->lo;
    r->lo = from;
    return m->grad_ready(m->grad_ready_ctx, from, hi - from);
}

/* First float of layer l's parameters, or of the final norm for l = L (model_backward.c). */
static size_t layer_start(const rf_model_tp *tp, int l) {
    const rf_model *m = tp->m;
    const float *p = l < tp->cfg.num_hidden_layers ? m->layers[l].ln1 : m->norm;
    return (size_t)(p - m->params);
}

rf_status rf_model_tp_backward(rf_model_tp *tp, const float *dlogp, const float *dentropy,
                               const float *dvalues) {
    rf_model *m = tp->m;
    if (!m->grads) return rf_error(RF_ERR_ARG, "backward: call rf_model_tp_enable_training first");
    if (tp->T <= 0) return rf_error(RF_ERR_ARG, "backward: no forward pass to differentiate");
    RF_TRY(rf__tp_reserve_sync(tp));
    grad_bufs g = {0};
    RF_TRY(reserve_grads(tp, &g));
    sync_save(tp);
    RF_TRY(head_backward(tp, &g, dlogp, dentropy, dvalues));
    const rf_model_config *c = &tp->cfg;
    int T = tp->T, C = c->hidden_size, L = c->num_hidden_layers;
    m->k->zero(g.dx, sizeof(float) * (size_t)T * C);
    m->k->rmsnorm_backward(g.dx, GRAD(m, m->norm), g.dln, tp->x_final, m->norm, tp->rstd_f, T, C);
    tp_ready r = ready_init(tp);
    RF_TRY(ready(tp, &r, layer_start(tp, L), 0));
    for (int l = L - 1; l >= 0; l--) {
        RF_TRY(mlp_backward(tp, l, &g));
        RF_TRY(ready(tp, &r, (size_t)(m->layers[l].ln2 - m->params), 0));
        RF_TRY(attn_backward(tp, l, &g));
        RF_TRY(ready(tp, &r, layer_start(tp, l), 0));
    }
    embed_backward(tp, g.dx, T);
    RF_TRY(sync_finish(tp));
    return ready(tp, &r, 0, 1);
}

/* ---- KV-cache decoding ---- */

/* Host index arrays of a decode call (as model_decode.c). */
static rf_status decode_indices(const rf_model_tp *tp, const rf_kv_cache *c, const int *slots,
                                const int *counts, int n, const int32_t *tokens, int32_t *pos,
                                int32_t *q_off, int32_t *k_start, int32_t *k_len) {
    q_off[0] = 0;
    for (int i = 0; i < n; i++) {
        int s = slots[i];
        if (s < 0 || s >= c->n_slots)
            return rf_error(RF_ERR_RANGE, "decode: slot %d outside the cache's %d slots", s, c->n_slots);
        if (counts[i] <= 0) return rf_error(RF_ERR_ARG, "decode: slot %d has no new tokens", s);
        if (c->len[s] + counts[i] > c->max_len)
            return rf_error(RF_ERR_RANGE, "decode: slot %d would hold %d positions, more than the "
                            "cache's %d", s, c->len[s] + counts[i], c->max_len);
        for (int j = 0; j < counts[i]; j++) pos[q_off[i] + j] = c->len[s] + j;
        q_off[i + 1] = q_off[i] + counts[i];
        k_start[i] = s * c->max_len;
        k_len[i] = c->len[s] + counts[i];
    }
    for (int t = 0; t < q_off[n]; t++)
        if (tokens[t] < 0 || tokens[t] >= tp->cfg.vocab_size)
            return rf_error(RF_ERR_RANGE, "decode: token id %d outside the vocabulary (%d)", tokens[t],
                            tp->cfg.vocab_size);
    return RF_OK;
}

/* This rank's logits slice (n, Vl) on the host of the last row of each sequence of x. */
static rf_status last_logits(rf_model_tp *tp, const float *x, const int32_t *q_off, int n, float *logits) {
    rf_model *m = tp->m;
    const rf_model_config *c = &tp->cfg;
    size_t C = c->hidden_size;
    float *rows = tp->acts[0].x, *normed = tp->acts[0].ln1; /* free after the layers */
    rf__gather_last_rows(m->k, rows, x, q_off, n, C);
    m->k->rmsnorm_forward(normed, NULL, rows, m->norm, n, (int)C, c->rms_norm_eps);
    RF_TRY(rf__model_dev_out(m, (size_t)n * tp->Vl));
    m->k->matmul_forward(m->dev_out, normed, m->lm_head, NULL, n, (int)C, tp->Vl);
    m->k->to_host(logits, m->dev_out, sizeof(float) * (size_t)n * tp->Vl);
    return RF_OK;
}

/* Embedding, every layer over the cache dc, and this rank's logits slice of each sequence's
 * last token. */
static rf_status decode_layers(rf_model_tp *tp, const tp_decode *dc, int T, const int32_t *q_off,
                               float *logits) {
    /* every layer reuses layer 0's buffers: nothing is kept for backward */
    float *x = tp->x_final, *y = tp->h; /* ping-pong residual buffers */
    RF_TRY(embed_forward(tp, x, T));
    for (int l = 0; l < tp->cfg.num_hidden_layers; l++) {
        RF_TRY(layer_forward(tp, l, &tp->acts[0], x, y, T, dc));
        float *t = x;
        x = y, y = t;
    }
    return last_logits(tp, x, q_off, dc->n, logits);
}

rf_status rf_model_tp_decode(rf_model_tp *tp, rf_kv_cache *c, const int *slots,
                             const int *counts, int n, const int32_t *tokens, float *logits) {
    rf_model *m = tp->m;
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "decode: model has no LM head");
    if (c->KVH != tp->KVA || c->D != tp->cfg.head_dim)
        return rf_error(RF_ERR_ARG, "decode: the cache holds %d k/v heads, this rank attends over %d "
                        "(rf_model_tp_kv_cache_init)", c->KVH, tp->KVA);
    int T = 0;
    for (int i = 0; i < n; i++) T += counts[i] > 0 ? counts[i] : 0;
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(2 * T + 3 * n + 1));
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    int32_t *pos = idx, *q_off = idx + T, *k_start = q_off + n + 1, *k_len = k_start + n;
    int32_t *rows = k_len + n; /* (T) each token's cache row within a layer: one scatter a layer */
    rf_status s = decode_indices(tp, c, slots, counts, n, tokens, pos, q_off, k_start, k_len);
    if (s == RF_OK) rf__kv_cache_rows(rows, q_off, k_start, pos, n);
    if (s == RF_OK) s = rf__tp_reserve(tp, T > n ? T : n);
    int32_t *dev[6] = {NULL};
    if (s == RF_OK) {
        const int32_t *host[] = {tokens, pos, q_off, k_start, k_len, rows};
        int cnt[] = {T, T, n + 1, n, n, T};
        s = rf__model_upload_ints(m, 6, host, cnt, dev);
        m->d_tokens = dev[0], m->d_pos = dev[1], m->d_cu = dev[2], m->d_kstart = dev[3];
        m->d_klen = dev[4];
        memcpy(tp->tokens, tokens, sizeof(int32_t) * (size_t)T);
    }
    tp_decode dc = {c, dev[5], n, NULL};
    if (s == RF_OK) s = decode_layers(tp, &dc, T, q_off, logits);
    for (int i = 0; s == RF_OK && i < n; i++) c->len[slots[i]] += counts[i];
    tp->T = 0, tp->have_logprobs = 0; /* activations no longer describe a training forward */
    free(idx);
    return s;
}

rf_status rf_model_tp_decode_paged(rf_model_tp *tp, rf_kv_pool *pool, const rf_paged_seq *seqs, int n,
                                   const int32_t *tokens, float *logits) {
    if (!tp->m->lm_head) return rf_error(RF_ERR_ARG, "paged decode: model has no LM head");
    if (pool->KVH != tp->KVA || pool->D != tp->cfg.head_dim || pool->n_layers != tp->cfg.num_hidden_layers)
        return rf_error(RF_ERR_ARG, "paged decode: the pool holds %d k/v heads, this rank attends over %d "
                        "(rf_model_tp_kv_pool_init)", pool->KVH, tp->KVA);
    if (n <= 0) return RF_OK;
    rf__paged_idx ix;
    RF_TRY(rf__paged_idx_make(&ix, &tp->cfg, pool, seqs, n, tokens));
    rf__paged_view pv;
    rf_status s = rf__tp_reserve(tp, ix.T > n ? ix.T : n);
    if (s == RF_OK) s = rf__paged_upload(tp->m, pool, &ix, n, tokens, &pv);
    if (s == RF_OK) {
        memcpy(tp->tokens, tokens, sizeof(int32_t) * (size_t)ix.T);
        tp_decode dc = {NULL, NULL, n, &pv};
        s = decode_layers(tp, &dc, ix.T, ix.q_off, logits);
    }
    tp->T = 0, tp->have_logprobs = 0; /* activations no longer describe a training forward */
    rf__paged_idx_free(&ix);
    return s;
}
