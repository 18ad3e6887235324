/* Forward and backward passes over a packed variable-length batch, and KV-cache decoding.
 * Every op goes through the rf_kernels table, so this file is back-end neutral. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/model_internal.h"

/* Decoding context: the layer appends new keys/values to the cache before attention. Either
 * the contiguous cache c (with rows) or, when `paged` is set, a paged one. */
typedef struct decode_ctx {
    rf_kv_cache *c;
    const int32_t *rows; /* (T) back end: each new token's row within a layer of c */
    int n;
    const rf__paged_view *paged;
} decode_ctx;

rf_status rf__model_upload_ints(rf_model *m, int n, const int32_t *const *host,
                                const int *counts, int32_t **dev) {
    int total = 0;
    for (int i = 0; i < n; i++) total += counts[i];
    if (total > m->ibuf_cap) {
        m->k->free(m->ibuf);
        m->ibuf = m->k->alloc(sizeof(int32_t) * (size_t)total);
        m->ibuf_cap = m->ibuf ? total : 0;
        if (!m->ibuf) return rf_error(RF_ERR_NOMEM, "out of memory for index arrays");
    }
    int32_t *stage = malloc(sizeof(int32_t) * (size_t)(total > 0 ? total : 1));
    if (!stage) return rf_error(RF_ERR_NOMEM, "out of memory for index arrays");
    int off = 0;
    for (int i = 0; i < n; i++) {
        if (counts[i] && host[i]) memcpy(stage + off, host[i], sizeof(int32_t) * (size_t)counts[i]);
        dev[i] = m->ibuf + off;
        off += counts[i];
    }
    m->k->to_device(m->ibuf, stage, sizeof(int32_t) * (size_t)total);
    free(stage);
    return RF_OK;
}

rf_status rf__model_dev_out(rf_model *m, size_t n) {
    m->draw_rows = 0; /* the caller writes dev_out: no decode's rows left to draw from */
    if (n <= m->dev_out_cap) return RF_OK;
    m->k->free(m->dev_out);
    m->dev_out = m->k->alloc(n * sizeof(float));
    m->dev_out_cap = m->dev_out ? n : 0;
    return m->dev_out ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for %zu outputs", n);
}

/* Activations products read (a projection's input: several products' A in the forward, the
 * weight gradients' B in the backward) are held (kernels.h operand_hold): the back end may
 * convert each once for all of them. Those only products read are held before the op that
 * makes them, which may then write the converted values only; the attention output (which
 * attention's backward reads) and the final norm's (the log-prob kernel's) after it. Every pass
 * releases the model's holds before it writes activations. */
void rf__model_hold(const rf_model *m, const float *p, int rows, int cols) {
    if (m->k->operand_hold) m->k->operand_hold(m, p, rows, cols);
}

void rf__model_release(const rf_model *m) {
    if (m->k->operands_release) m->k->operands_release(m);
}

/* Adds adapter t of layer w to out (T, OUT) = in (T, IN) W^T: out += u B^T with the saved
 * u = scale * in A^T (T, r), PEFT's lora_B(lora_A(x)) * scaling. m->scratch holds u B^T. */
static void lora_forward(rf_model *m, const rf_layer_weights *w, rf_layer_acts *a, int t, float *out,
                         const float *in, int T, int IN, int OUT) {
    if (!w->lora_a[t]) return;
    const rf_kernels *k = m->k;
    int r = m->lora.rank;
    k->matmul_forward(a->lora_u[t], in, w->lora_a[t], NULL, T, IN, r);
    k->scale(a->lora_u[t], m->lora.scale, (size_t)T * r);
    k->matmul_forward(m->scratch, a->lora_u[t], w->lora_b[t], NULL, T, r, OUT);
    k->add_inplace(out, m->scratch, (size_t)T * OUT);
}

/* q/k/v projections, optional q/k norm, RoPE. */
static void qkv_forward(rf_model *m, const rf_layer_weights *w, rf_layer_acts *a, int T) {
    const rf_kernels *k = m->k;
    const rf_model_config *c = &m->cfg;
    int C = c->hidden_size, H = c->num_attention_heads, KVH = c->num_key_value_heads,
        D = c->head_dim;
    float *qdst = c->qk_norm ? a->q_raw : a->q, *kdst = c->qk_norm ? a->k_raw : a->k;
    k->matmul_forward(qdst, a->ln1, w->wq, w->bq, T, C, H * D);
    k->matmul_forward(kdst, a->ln1, w->wk, w->bk, T, C, KVH * D);
    k->matmul_forward(a->v, a->ln1, w->wv, w->bv, T, C, KVH * D);
    lora_forward(m, w, a, RF_LORA_Q, qdst, a->ln1, T, C, H * D);
    lora_forward(m, w, a, RF_LORA_K, kdst, a->ln1, T, C, KVH * D);
    lora_forward(m, w, a, RF_LORA_V, a->v, a->ln1, T, C, KVH * D);
    if (c->qk_norm) {
        k->rmsnorm_forward(a->q, a->q_rstd, a->q_raw, w->q_norm, T * H, D, c->rms_norm_eps);
        k->rmsnorm_forward(a->k, a->k_rstd, a->k_raw, w->k_norm, T * KVH, D, c->rms_norm_eps);
    }
    k->rope_qk(a->q, a->k, m->d_pos, m->inv_freq, T, H, KVH, D, 1);
}

/* One decoder layer: x_in (T, C) -> x_out (T, C), saving activations in a. */
static void layer_forward(rf_model *m, int l, rf_layer_acts *a, const float *x_in, float *x_out,
                          int T, const decode_ctx *dc) {
    const rf_kernels *k = m->k;
    const rf_model_config *c = &m->cfg;
    const rf_layer_weights *w = &m->layers[l];
    int C = c->hidden_size, F = c->intermediate_size, H = c->num_attention_heads,
        KVH = c->num_key_value_heads, D = c->head_dim;
    if (dc) rf__model_release(m); /* decoding writes one layer's buffers for every layer */
    rf__model_hold(m, a->ln1, T, C);
    k->rmsnorm_forward(a->ln1, a->rstd1, x_in, w->ln1, T, C, c->rms_norm_eps);
    qkv_forward(m, w, a, T);
    if (dc && dc->paged) {
        const rf__paged_view *pv = dc->paged;
        size_t off = (size_t)l * pv->layer_floats;
        k->paged_kv_write(pv->k + off, pv->v + off, a->k, a->v, pv->slots, T, KVH, D);
        k->paged_attention_forward(a->att, a->q, pv->k + off, pv->v + off, pv->q_off,
                                   pv->block_table, pv->max_blocks, pv->k_len, pv->n,
                                   pv->block_size, H, KVH, D);
    } else if (dc) { /* one scatter of the new rows a layer, not a copy per sequence */
        size_t off = rf__kv_cache_layer(dc->c, l);
        k->paged_kv_write(dc->c->k + off, dc->c->v + off, a->k, a->v, dc->rows, T, KVH, D);
        k->attention_forward(a->att, NULL, a->q, dc->c->k + off, dc->c->v + off,
                             m->d_cu, m->d_kstart, m->d_klen, dc->n, H, KVH, D);
    } else {
        k->attention_forward(a->att, a->lse, a->q, a->k, a->v, m->d_cu, m->d_cu, m->d_klen,
                             m->n_seq, H, KVH, D);
    }
    rf__model_hold(m, a->att, T, H * D);
    k->matmul_forward(a->x_mid, a->att, w->wo, w->bo, T, H * D, C);
    lora_forward(m, w, a, RF_LORA_O, a->x_mid, a->att, T, H * D, C);
    rf__model_hold(m, a->ln2, T, C);
    k->add_rmsnorm_forward(a->x_mid, a->ln2, a->rstd2, x_in, w->ln2, T, C, c->rms_norm_eps);
    k->matmul_forward(a->gate, a->ln2, w->wgate, NULL, T, C, F);
    k->matmul_forward(a->up, a->ln2, w->wup, NULL, T, C, F);
    lora_forward(m, w, a, RF_LORA_GATE, a->gate, a->ln2, T, C, F);
    lora_forward(m, w, a, RF_LORA_UP, a->up, a->ln2, T, C, F);
    rf__model_hold(m, a->act, T, F);
    k->swiglu_forward(a->act, a->gate, a->up, (size_t)T * F);
    k->matmul_forward(x_out, a->act, w->wdown, NULL, T, F, C);
    lora_forward(m, w, a, RF_LORA_DOWN, x_out, a->act, T, F, C);
    k->add_inplace(x_out, a->x_mid, (size_t)T * C);
}

void rf__layer_forward_cached(rf_model *m, int l, rf_layer_acts *a, const float *x_in,
                              float *x_out, int T, rf_kv_cache *c, const int32_t *rows, int n) {
    decode_ctx dc = {c, rows, n, NULL};
    layer_forward(m, l, a, x_in, x_out, T, &dc);
}

void rf__layer_forward_paged(rf_model *m, int l, rf_layer_acts *a, const float *x_in,
                             float *x_out, int T, const rf__paged_view *pv) {
    decode_ctx dc = {NULL, NULL, pv->n, pv};
    layer_forward(m, l, a, x_in, x_out, T, &dc);
}

static rf_status check_tokens(const rf_model *m, const int32_t *tokens, int T) {
    for (int t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->cfg.vocab_size)
            return rf_error(RF_ERR_RANGE, "token id %d at position %d is outside the vocabulary "
                            "(vocab_size %d)", tokens[t], t, m->cfg.vocab_size);
    return RF_OK;
}

/* Validates the batch and builds host index arrays: positions and per-sequence lengths. */
static rf_status batch_indices(const rf_model *m, const rf_batch *b, int32_t *pos, int32_t *len) {
    if (b->n_seq <= 0 || b->cu_seqlens[0] != 0 || b->cu_seqlens[b->n_seq] != b->T)
        return rf_error(RF_ERR_ARG, "batch: cu_seqlens must start at 0 and end at T = %d", b->T);
    int max_seq = rf_config_max_seq(&m->cfg);
    for (int s = 0; s < b->n_seq; s++) {
        len[s] = b->cu_seqlens[s + 1] - b->cu_seqlens[s];
        if (len[s] <= 0)
            return rf_error(RF_ERR_ARG, "batch: sequence %d is empty or offsets decrease", s);
        for (int i = 0; i < len[s]; i++) {
            int t = b->cu_seqlens[s] + i;
            pos[t] = b->pos ? b->pos[t] : i;
            if (pos[t] < 0 || pos[t] >= max_seq)
                return rf_error(RF_ERR_RANGE, "batch: position %d of sequence %d exceeds the "
                                "model's limit of %d (%s)", pos[t], s, max_seq,
                                m->cfg.sliding_window ? "sliding_window" : "max_position_embeddings");
        }
    }
    return check_tokens(m, b->tokens, b->T);
}

rf_status rf_model_forward(rf_model *m, const rf_batch *b) {
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)(b->T + 1)),
            *len = malloc(sizeof(int32_t) * (size_t)(b->n_seq + 1));
    rf_status s = pos && len ? batch_indices(m, b, pos, len) : rf_error(RF_ERR_NOMEM, "out of memory");
    if (s == RF_OK) s = rf__model_reserve(m, b->T);
    if (s == RF_OK) {
        const int32_t *host[] = {b->tokens, pos, b->cu_seqlens, len, NULL};
        int counts[] = {b->T, b->T, b->n_seq + 1, b->n_seq, b->T};
        int32_t *dev[5];
        s = rf__model_upload_ints(m, 5, host, counts, dev);
        m->d_tokens = dev[0], m->d_pos = dev[1], m->d_cu = dev[2], m->d_klen = dev[3];
        m->d_targets = dev[4];
    }
    free(pos);
    free(len);
    if (s != RF_OK) return s;
    m->T = b->T;
    m->n_seq = b->n_seq;
    const rf_model_config *c = &m->cfg;
    int L = c->num_hidden_layers, C = c->hidden_size;
    rf__model_release(m);
    m->k->embedding_forward(m->acts[0].x, m->d_tokens, m->wte, b->T, C);
    for (int l = 0; l < L; l++)
        layer_forward(m, l, &m->acts[l], m->acts[l].x, l + 1 < L ? m->acts[l + 1].x : m->x_final,
                      b->T, NULL);
    m->k->rmsnorm_forward(m->h, m->rstd_f, m->x_final, m->norm, b->T, C, c->rms_norm_eps);
    rf__model_hold(m, m->h, b->T, C); /* after it is written: the log-prob kernel reads its floats */
    return RF_OK;
}

rf_status rf_model_logprobs(rf_model *m, const int32_t *targets, float inv_temp, float *logp,
                            float *entropy) {
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "model has a value head, not an LM head");
    RF_TRY(check_tokens(m, targets, m->T));
    m->k->to_device(m->d_targets, targets, sizeof(int32_t) * (size_t)m->T);
    RF_TRY(rf__model_dev_out(m, 2 * (size_t)m->T));
    float *d_lp = m->dev_out, *d_ent = m->dev_out + m->T;
    m->k->logprob_forward(d_lp, entropy ? d_ent : NULL, m->h, m->lm_head, m->d_targets, m->T,
                          m->cfg.hidden_size, m->cfg.vocab_size, inv_temp);
    m->k->to_host(logp, d_lp, sizeof(float) * (size_t)m->T);
    if (entropy) m->k->to_host(entropy, d_ent, sizeof(float) * (size_t)m->T);
    m->logprob_inv_temp = inv_temp;
    return RF_OK;
}

rf_status rf_model_values(rf_model *m, float *values) {
    if (!m->score) return rf_error(RF_ERR_ARG, "model has no value head (score.weight)");
    RF_TRY(rf__model_dev_out(m, (size_t)m->T));
    m->k->matmul_forward(m->dev_out, m->h, m->score, NULL, m->T, m->cfg.hidden_size, 1);
    m->k->to_host(values, m->dev_out, sizeof(float) * (size_t)m->T);
    return RF_OK;
}

rf_status rf_model_logits(rf_model *m, const int *rows, int n_rows, float *logits) {
    const float *w = m->lm_head ? m->lm_head : m->score;
    int C = m->cfg.hidden_size, V = m->lm_head ? m->cfg.vocab_size : 1;
    RF_TRY(rf__model_dev_out(m, (size_t)V + C));
    for (int i = 0; i < n_rows; i++) {
        if (rows[i] < 0 || rows[i] >= m->T)
            return rf_error(RF_ERR_RANGE, "logits: row %d outside the batch of %d", rows[i], m->T);
        m->k->matmul_forward(m->dev_out, m->h + (size_t)rows[i] * C, w, NULL, 1, C, V);
        m->k->to_host(logits + (size_t)i * V, m->dev_out, sizeof(float) * (size_t)V);
    }
    return RF_OK;
}
