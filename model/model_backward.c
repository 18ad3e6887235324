/* Backward pass over the packed batch of the last rf_model_forward, accumulating into
 * m->grads. The order mirrors layer_forward in model_forward.c line by line. */
#include <stdlib.h>

#include "common/util.h"
#include "model/model_internal.h"

/* The gradient of parameter tensor p, or NULL when it has none (absent, or frozen under LoRA:
 * the kernels then skip the weight gradient). */
#define GRAD(m, p) \
    ((p) && (size_t)((p) - (m)->params) >= (m)->n_frozen ? (m)->grads + ((p) - (m)->params) - (m)->n_frozen : NULL)

/* Gradient buffers for one backward pass; views into m->gmem. */
typedef struct grad_bufs {
    float *dx;              /* (T, C) gradient of the residual stream */
    float *dln, *tmp;       /* (T, C) */
    float *dact, *dgate, *dup; /* (T, F) */
    float *datt, *dq, *dq_raw; /* (T, H*D) */
    float *dk, *dv, *dk_raw;   /* (T, KVH*D) */
} grad_bufs;

static rf_status reserve_grads(rf_model *m, grad_bufs *g) {
    const rf_model_config *c = &m->cfg;
    size_t T = rf__rows_padded(m->T), C = c->hidden_size, F = c->intermediate_size,
           QD = (size_t)c->num_attention_heads * c->head_dim,
           KD = (size_t)c->num_key_value_heads * c->head_dim;
    size_t per_token = 3 * C + 3 * F + 3 * QD + 3 * KD;
    if (m->T > m->gmem_cap) {
        m->k->free(m->gmem);
        m->gmem = m->k->alloc(per_token * T * sizeof(float)); /* T: rows padded */
        m->gmem_cap = m->gmem ? m->T : 0;
        if (!m->gmem) return rf_error(RF_ERR_NOMEM, "out of memory for gradients of %d tokens", m->T);
    }
    float *p = m->gmem;
#define TAKE(n) (p += (n), p - (n))
    g->dx = TAKE(T * C), g->dln = TAKE(T * C), g->tmp = TAKE(T * C);
    g->dact = TAKE(T * F), g->dgate = TAKE(T * F), g->dup = TAKE(T * F);
    g->datt = TAKE(T * QD), g->dq = TAKE(T * QD), g->dq_raw = TAKE(T * QD);
    g->dk = TAKE(T * KD), g->dv = TAKE(T * KD), g->dk_raw = TAKE(T * KD);
#undef TAKE
    return RF_OK;
}

/* Backward of adapter t of layer l (model_forward.c's lora_forward): from dout (T, OUT) and the
 * projection's input in (T, IN), dB += dout^T u, dA += scale * du^T in with du = dout B, and
 * dinp (T, IN) += scale * du A, m->scratch2 holding du and m->scratch the last product. */
static void lora_backward(rf_model *m, int l, int t, float *dinp, const float *dout, const float *in, int IN,
                          int OUT) {
    const rf_layer_weights *w = &m->layers[l];
    if (!w->lora_a[t]) return;
    const rf_kernels *k = m->k;
    int T = m->T, r = m->lora.rank;
    float *du = m->scratch2, *dx = m->scratch;
    k->matmul_backward(du, GRAD(m, w->lora_b[t]), NULL, dout, m->acts[l].lora_u[t], w->lora_b[t], T, r, OUT);
    k->scale(du, m->lora.scale, (size_t)T * r);
    k->matmul_backward(dx, GRAD(m, w->lora_a[t]), NULL, du, in, w->lora_a[t], T, IN, r);
    k->add_inplace(dinp, dx, (size_t)T * IN);
}

/* MLP half of a layer: g->dx holds d(layer output); on return it holds d(x_mid). */
static void mlp_backward(rf_model *m, int l, grad_bufs *g) {
    const rf_kernels *k = m->k;
    const rf_model_config *c = &m->cfg;
    const rf_layer_weights *w = &m->layers[l];
    const rf_layer_acts *a = &m->acts[l];
    int T = m->T, C = c->hidden_size, F = c->intermediate_size;
    k->matmul_backward(g->dact, GRAD(m, w->wdown), NULL, g->dx, a->act, w->wdown, T, F, C);
    lora_backward(m, l, RF_LORA_DOWN, g->dact, g->dx, a->act, F, C);
    rf__model_hold(m, g->dgate, T, F); /* read by the products below alone */
    rf__model_hold(m, g->dup, T, F);
    k->swiglu_backward(g->dgate, g->dup, g->dact, a->gate, a->up, (size_t)T * F);
    k->matmul_backward(g->dln, GRAD(m, w->wgate), NULL, g->dgate, a->ln2, w->wgate, T, C, F);
    lora_backward(m, l, RF_LORA_GATE, g->dln, g->dgate, a->ln2, C, F);
    k->matmul_backward(g->tmp, GRAD(m, w->wup), NULL, g->dup, a->ln2, w->wup, T, C, F);
    lora_backward(m, l, RF_LORA_UP, g->tmp, g->dup, a->ln2, C, F);
    k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    k->rmsnorm_backward(g->dx, GRAD(m, w->ln2), g->dln, a->x_mid, w->ln2, a->rstd2, T, C);
}

/* Attention half: g->dx holds d(x_mid); on return it holds d(layer input). */
static void attn_backward(rf_model *m, int l, grad_bufs *g) {
    const rf_kernels *k = m->k;
    const rf_model_config *c = &m->cfg;
    const rf_layer_weights *w = &m->layers[l];
    const rf_layer_acts *a = &m->acts[l];
    int T = m->T, C = c->hidden_size, H = c->num_attention_heads, KVH = c->num_key_value_heads,
        D = c->head_dim;
    k->matmul_backward(g->datt, GRAD(m, w->wo), GRAD(m, w->bo), g->dx, a->att, w->wo, T, H * D, C);
    lora_backward(m, l, RF_LORA_O, g->datt, g->dx, a->att, H * D, C);
    k->attention_backward(g->dq, g->dk, g->dv, g->datt, a->q, a->k, a->v, a->att, a->lse, m->d_cu,
                          m->n_seq, T, H, KVH, D);
    k->rope_qk(g->dq, g->dk, m->d_pos, m->inv_freq, T, H, KVH, D, -1);
    float *dq = g->dq, *dk = g->dk;
    if (c->qk_norm) {
        k->zero(g->dq_raw, sizeof(float) * (size_t)T * H * D);
        k->zero(g->dk_raw, sizeof(float) * (size_t)T * KVH * D);
        k->rmsnorm_backward(g->dq_raw, GRAD(m, w->q_norm), g->dq, a->q_raw, w->q_norm, a->q_rstd,
                            T * H, D);
        k->rmsnorm_backward(g->dk_raw, GRAD(m, w->k_norm), g->dk, a->k_raw, w->k_norm, a->k_rstd,
                            T * KVH, D);
        dq = g->dq_raw, dk = g->dk_raw;
    }
    k->matmul_backward(g->dln, GRAD(m, w->wq), GRAD(m, w->bq), dq, a->ln1, w->wq, T, C, H * D);
    lora_backward(m, l, RF_LORA_Q, g->dln, dq, a->ln1, C, H * D);
    k->matmul_backward(g->tmp, GRAD(m, w->wk), GRAD(m, w->bk), dk, a->ln1, w->wk, T, C, KVH * D);
    lora_backward(m, l, RF_LORA_K, g->tmp, dk, a->ln1, C, KVH * D);
    k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    k->matmul_backward(g->tmp, GRAD(m, w->wv), GRAD(m, w->bv), g->dv, a->ln1, w->wv, T, C, KVH * D);
    lora_backward(m, l, RF_LORA_V, g->tmp, g->dv, a->ln1, C, KVH * D);
    k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    k->rmsnorm_backward(g->dx, GRAD(m, w->ln1), g->dln, a->x, w->ln1, a->rstd1, T, C);
}

/* Gradient at the final hidden states h (T, C) into g->dln from the heads. */
static rf_status head_backward(rf_model *m, grad_bufs *g, const float *dlogp,
                               const float *dentropy, const float *dvalues) {
    const rf_kernels *k = m->k;
    int T = m->T, C = m->cfg.hidden_size;
    k->zero(g->dln, sizeof(float) * (size_t)T * C);
    if (dlogp || dentropy) {
        if (!m->lm_head) return rf_error(RF_ERR_ARG, "backward: log-prob gradient on a value-head model");
        RF_TRY(rf__model_dev_out(m, 2 * (size_t)T));
        float *d_dlp = m->dev_out, *d_dent = m->dev_out + T;
        k->zero(m->dev_out, 2 * sizeof(float) * (size_t)T);
        if (dlogp) k->to_device(d_dlp, dlogp, sizeof(float) * (size_t)T);
        if (dentropy) k->to_device(d_dent, dentropy, sizeof(float) * (size_t)T);
        k->logprob_backward(g->dln, GRAD(m, m->lm_head), d_dlp, dentropy ? d_dent : NULL, m->h,
                            m->lm_head, m->d_targets, T, C, m->cfg.vocab_size, m->logprob_inv_temp);
    }
    if (dvalues) {
        if (!m->score) return rf_error(RF_ERR_ARG, "backward: value gradient without a value head");
        RF_TRY(rf__model_dev_out(m, (size_t)T));
        k->to_device(m->dev_out, dvalues, sizeof(float) * (size_t)T);
        k->matmul_backward(g->tmp, GRAD(m, m->score), NULL, m->dev_out, m->h, m->score, T, C, 1);
        k->add_inplace(g->dln, g->tmp, (size_t)T * C);
    }
    return RF_OK;
}

void rf_model_set_grad_hook(rf_model *m, rf_grad_ready_fn fn, void *ctx) {
    m->grad_ready = fn;
    m->grad_ready_ctx = fn ? ctx : NULL;
}

/* Tells the hook that gradients of floats [from, to) are final. */
static rf_status ready(rf_model *m, size_t from, size_t to) {
    return m->grad_ready ? m->grad_ready(m->grad_ready_ctx, from, to - from) : RF_OK;
}

/* First float of layer l's parameters (its input norm comes first), or of the final norm for
 * l = L. */
static size_t layer_start(const rf_model *m, int l) {
    const float *p = l < m->cfg.num_hidden_layers ? m->layers[l].ln1 : m->norm;
    return (size_t)(p - m->params);
}

/* With LoRA: the first gradient float of layer l's adapters (every layer has the same ones, in
 * layer order after the base), or the gradient buffer's end for l = L. */
static size_t lora_start(const rf_model *m, int l) {
    int per = m->lora.n_views / m->cfg.num_hidden_layers;
    if (l >= m->cfg.num_hidden_layers) return m->n_params - m->n_frozen;
    return m->lora.views[l * per].offset - m->n_frozen;
}

rf_status rf_model_backward(rf_model *m, const float *dlogp, const float *dentropy,
                            const float *dvalues) {
    if (!m->grads) return rf_error(RF_ERR_ARG, "backward: call rf_model_enable_training first");
    if (m->T <= 0) return rf_error(RF_ERR_ARG, "backward: no forward pass to differentiate");
    grad_bufs g = {0};
    RF_TRY(reserve_grads(m, &g));
    RF_TRY(head_backward(m, &g, dlogp, dentropy, dvalues));
    const rf_model_config *c = &m->cfg;
    int T = m->T, C = c->hidden_size;
    m->k->zero(g.dx, sizeof(float) * (size_t)T * C);
    m->k->rmsnorm_backward(g.dx, GRAD(m, m->norm), g.dln, m->x_final, m->norm, m->rstd_f, T, C);
    int L = c->num_hidden_layers, lora = m->lora.rank > 0;
    if (!lora) RF_TRY(ready(m, layer_start(m, L), m->n_params));
    for (int l = L - 1; l >= 0; l--) {
        size_t mlp = (size_t)(m->layers[l].ln2 - m->params); /* the layer's MLP ends it */
        mlp_backward(m, l, &g);
        if (!lora) RF_TRY(ready(m, mlp, layer_start(m, l + 1)));
        attn_backward(m, l, &g);
        if (lora) RF_TRY(ready(m, lora_start(m, l), lora_start(m, l + 1)));
        else RF_TRY(ready(m, layer_start(m, l), mlp));
    }
    if (GRAD(m, m->wte)) m->k->embedding_backward(GRAD(m, m->wte), g.dx, m->d_tokens, T, C);
    return lora ? RF_OK : ready(m, 0, layer_start(m, 0));
}
