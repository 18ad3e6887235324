/* Model construction: the parameter table (Hugging Face names and shapes), flat buffers and the
 * typed views into them, random initialisation, activation buffers. */
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/shm.h"
#include "common/util.h"
#include "model/dtype.h"
#include "model/model_internal.h"

/* Appends a view; returns its offset. */
static size_t add_view(rf_model *m, const char *name, int64_t d0, int64_t d1, int no_decay) {
    rf_param_view *v = &m->views[m->n_views++];
    snprintf(v->name, sizeof v->name, "%s", name);
    v->ndim = d1 > 0 ? 2 : 1;
    v->shape[0] = d0;
    v->shape[1] = d1 > 0 ? d1 : 0;
    v->numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    v->offset = m->n_params;
    v->no_decay = no_decay;
    m->n_params += v->numel;
    return v->offset;
}

/* Offsets of one layer's tensors, kept while the table is built and turned into pointers once
 * the flat buffer exists. SIZE_MAX marks an absent tensor. */
typedef struct { size_t off[16]; } layer_offsets;
enum { O_LN1, O_WQ, O_BQ, O_WK, O_BK, O_WV, O_BV, O_WO, O_BO, O_QN, O_KN, O_LN2, O_WG, O_WU, O_WD };

static void add_layer(rf_model *m, int l, layer_offsets *lo) {
    const rf_model_config *c = &m->cfg;
    int64_t C = c->hidden_size, F = c->intermediate_size, QD = (int64_t)c->num_attention_heads * c->head_dim,
            KD = (int64_t)c->num_key_value_heads * c->head_dim;
    char n[RF_MAX_NAME];
    for (int i = 0; i < 16; i++) lo->off[i] = SIZE_MAX;
#define V(slot, suffix, d0, d1, nd)                                          \
    do {                                                                     \
        snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);              \
        lo->off[slot] = add_view(m, n, d0, d1, nd);                          \
    } while (0)
    V(O_LN1, "input_layernorm.weight", C, 0, 1);
    V(O_WQ, "self_attn.q_proj.weight", QD, C, 0);
    if (c->qkv_bias) V(O_BQ, "self_attn.q_proj.bias", QD, 0, 1);
    V(O_WK, "self_attn.k_proj.weight", KD, C, 0);
    if (c->qkv_bias) V(O_BK, "self_attn.k_proj.bias", KD, 0, 1);
    V(O_WV, "self_attn.v_proj.weight", KD, C, 0);
    if (c->qkv_bias) V(O_BV, "self_attn.v_proj.bias", KD, 0, 1);
    V(O_WO, "self_attn.o_proj.weight", C, QD, 0);
    if (c->o_bias) V(O_BO, "self_attn.o_proj.bias", C, 0, 1);
    if (c->qk_norm) {
        V(O_QN, "self_attn.q_norm.weight", c->head_dim, 0, 1);
        V(O_KN, "self_attn.k_norm.weight", c->head_dim, 0, 1);
    }
    V(O_LN2, "post_attention_layernorm.weight", C, 0, 1);
    V(O_WG, "mlp.gate_proj.weight", F, C, 0);
    V(O_WU, "mlp.up_proj.weight", F, C, 0);
    V(O_WD, "mlp.down_proj.weight", C, F, 0);
#undef V
}

static float *at(rf_model *m, size_t off) { return off == SIZE_MAX ? NULL : m->params + off; }

static void bind_layer(rf_model *m, rf_layer_weights *w, const layer_offsets *lo) {
    w->ln1 = at(m, lo->off[O_LN1]);
    w->wq = at(m, lo->off[O_WQ]);
    w->bq = at(m, lo->off[O_BQ]);
    w->wk = at(m, lo->off[O_WK]);
    w->bk = at(m, lo->off[O_BK]);
    w->wv = at(m, lo->off[O_WV]);
    w->bv = at(m, lo->off[O_BV]);
    w->wo = at(m, lo->off[O_WO]);
    w->bo = at(m, lo->off[O_BO]);
    w->q_norm = at(m, lo->off[O_QN]);
    w->k_norm = at(m, lo->off[O_KN]);
    w->ln2 = at(m, lo->off[O_LN2]);
    w->wgate = at(m, lo->off[O_WG]);
    w->wup = at(m, lo->off[O_WU]);
    w->wdown = at(m, lo->off[O_WD]);
}

/* rf_model_init, with the parameters in `borrow` (NULL: allocated). */
static rf_status model_init(rf_model **out, const rf_model_config *cfg, const rf_kernels *k, float *borrow) {
    *out = NULL;
    rf_model *m = rf_calloc(1, sizeof *m);
    if (!m) return RF_ERR_NOMEM;
    m->cfg = *cfg;
    m->k = k;
    int L = cfg->num_hidden_layers;
    m->views = rf_calloc((size_t)L * 16 + 8, sizeof *m->views);
    m->layers = rf_calloc((size_t)L, sizeof *m->layers);
    m->acts = rf_calloc((size_t)L, sizeof *m->acts);
    layer_offsets *lo = rf_calloc((size_t)L, sizeof *lo);
    if (!m->views || !m->layers || !m->acts || !lo) {
        free(lo);
        rf_model_free(m);
        return RF_ERR_NOMEM;
    }
    int64_t C = cfg->hidden_size, V = cfg->vocab_size;
    size_t o_wte = add_view(m, "model.embed_tokens.weight", V, C, 0);
    for (int l = 0; l < L; l++) add_layer(m, l, &lo[l]);
    size_t o_norm = add_view(m, "model.norm.weight", C, 0, 1), o_head = SIZE_MAX, o_score = SIZE_MAX;
    if (cfg->value_head)
        o_score = add_view(m, "score.weight", 1, C, 0);
    else if (!cfg->tie_word_embeddings)
        o_head = add_view(m, "lm_head.weight", V, C, 0);
    m->params = borrow ? borrow : k->alloc(m->n_params * sizeof(float));
    m->params_shared = borrow ? 2 : 0;
    m->inv_freq = k->alloc(sizeof(float) * (size_t)(cfg->head_dim / 2));
    if (!m->params || !m->inv_freq) {
        free(lo);
        rf_model_free(m);
        return RF_ERR_NOMEM;
    }
    for (int l = 0; l < L; l++) bind_layer(m, &m->layers[l], &lo[l]);
    free(lo);
    m->wte = at(m, o_wte);
    m->norm = at(m, o_norm);
    m->score = at(m, o_score);
    m->lm_head = cfg->value_head ? NULL : cfg->tie_word_embeddings ? m->wte : at(m, o_head);
    float *inv = malloc(sizeof(float) * (size_t)(cfg->head_dim / 2));
    rf_config_inv_freq(cfg, inv);
    k->to_device(m->inv_freq, inv, sizeof(float) * (size_t)(cfg->head_dim / 2));
    free(inv);
    /* new parameter memory (maybe at the address of a freed model's): converted copies the
     * back end keeps of earlier weights must not be taken for these */
    k->weights_updated();
    *out = m;
    return RF_OK;
}

rf_status rf_model_init(rf_model **out, const rf_model_config *cfg, const rf_kernels *k) {
    return model_init(out, cfg, k, NULL);
}

rf_status rf_model_init_borrowed(rf_model **out, const rf_model_config *cfg, const rf_kernels *k, float *params) {
    return model_init(out, cfg, k, params);
}

void rf_model_free(rf_model *m) {
    if (!m) return;
    const rf_kernels *k = m->k;
    if (k) {
        if (m->wbf16) k->bind_bf16(m->params + m->bf16_lo, NULL, 0); /* before the addresses can be reused */
        k->free(m->wbf16);
        if (m->params_shared == 1) rf_shm_free(m->params);
        else if (!m->params_shared) k->free(m->params);
        k->free(m->grads);
        k->free(m->opt_m);
        k->free(m->opt_v);
        k->free(m->inv_freq);
        rf_model_trim(m);
    }
    free(m->views);
    free(m->lora.views);
    free(m->layers);
    free(m->acts);
    free(m);
}

void rf_model_trim(rf_model *m) {
    if (!m) return;
    m->k->free(m->act_mem);
    m->k->free(m->gmem);
    m->k->free(m->dev_out);
    m->k->free(m->ibuf);
    m->act_mem = m->gmem = m->dev_out = NULL, m->ibuf = NULL;
    m->act_cap = m->gmem_cap = m->ibuf_cap = 0, m->dev_out_cap = 0, m->draw_rows = 0, m->act_layers = 0;
    m->x_final = m->h = m->rstd_f = m->scratch = m->scratch2 = NULL;
    m->T = 0, m->n_seq = 0;
    if (m->k->trim) m->k->trim(); /* the back end's kept logits (CPU: up to 512 MB) */
}

void rf_model_init_random(rf_model *m, uint64_t seed, float std) {
    rf_rng rng;
    rf_rng_seed(&rng, seed);
    float *host = malloc(m->n_params * sizeof(float));
    RF_ASSERT(host);
    for (int i = 0; i < m->n_views; i++) {
        const rf_param_view *v = &m->views[i];
        float *p = host + v->offset;
        int is_norm = strstr(v->name, "norm") != NULL, is_bias = strstr(v->name, ".bias") != NULL;
        for (size_t j = 0; j < v->numel; j++)
            p[j] = is_norm ? 1.0f : is_bias ? 0.0f : std * rf_rng_normal(&rng);
    }
    m->k->to_device(m->params, host, m->n_params * sizeof(float));
    m->k->weights_updated();
    free(host);
}

/* Every weight pointer of a layer, to move them with the parameter buffer. */
static float **layer_weight(rf_layer_weights *w, int i) {
    float **all[] = {&w->ln1, &w->wq, &w->bq, &w->wk, &w->bk, &w->wv, &w->bv, &w->wo,
                     &w->bo, &w->q_norm, &w->k_norm, &w->ln2, &w->wgate, &w->wup, &w->wdown};
    return i < (int)(sizeof all / sizeof all[0]) ? all[i] : NULL;
}

static void rebase(float **p, const float *old, float *now) {
    if (*p) *p = now + (*p - old);
}

void rf__model_rebase(rf_model *m, const float *old, float *now) {
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        rf_layer_weights *w = &m->layers[l];
        for (int i = 0; layer_weight(w, i); i++) rebase(layer_weight(w, i), old, now);
        for (int t = 0; t < RF_LORA_N; t++) rebase(&w->lora_a[t], old, now), rebase(&w->lora_b[t], old, now);
    }
    rebase(&m->wte, old, now), rebase(&m->norm, old, now), rebase(&m->score, old, now), rebase(&m->lm_head, old, now);
}

rf_status rf_model_share_params(rf_model *m) {
    if (m->params_shared) return RF_OK;
    if (m->wbf16) return rf__model_frozen_refuse(m, "sharing parameters between processes");
    if (strcmp(m->k->name, "cpu") != 0)
        return rf_error(RF_ERR_UNSUPPORTED, "sharing parameters between processes: the %s back end's memory is not host memory", m->k->name);
    float *now = NULL, *old = m->params;
    RF_TRY(rf_shm_alloc((void **)&now, m->n_params * sizeof(float) + 1, "parameters"));
    memcpy(now, old, m->n_params * sizeof(float));
    rf__model_rebase(m, old, now);
    m->params = now, m->params_shared = 1;
    m->k->free(old);
    m->k->weights_updated();
    return RF_OK;
}

int rf_model_can_keep_bf16(const rf_kernels *k) {
    return k->bind_bf16 && strcmp(k->name, "cpu") == 0 && k->get_precision() == RF_PRECISION_BF16;
}

rf_status rf_model_keep_bf16(rf_model *m, int *kept) {
    *kept = 0;
    if (!rf_model_can_keep_bf16(m->k) || m->wbf16 || m->params_shared || m->n_frozen || m->lora.rank ||
        m->cfg.value_head)
        return RF_OK;
    const rf_param_view *wte = rf_model_find(m, "model.embed_tokens.weight");
    RF_ASSERT(wte && wte->offset == 0); /* the table is laid out first (model_init) */
    m->wbf16 = m->k->alloc(m->n_params * sizeof(uint16_t)); /* [0, bf16_lo) never touched */
    if (!m->wbf16) return rf_error(RF_ERR_NOMEM, "out of memory for %zu bf16 weights", m->n_params);
    m->bf16_lo = wte->numel, m->bf16_store = 1;
    rf_status st = m->k->bind_bf16(m->params + m->bf16_lo, m->wbf16 + m->bf16_lo, m->n_params - m->bf16_lo);
    if (st != RF_OK) {
        m->k->free(m->wbf16);
        m->wbf16 = NULL, m->bf16_lo = 0, m->bf16_store = 0;
        return st;
    }
    *kept = 1;
    return RF_OK;
}

/* src (n floats) rounded to bf16 into dst: OpenMP over blocks where it pays. */
static void round_bf16(uint16_t *dst, const float *src, size_t n) {
    const size_t blk = (size_t)1 << 16;
    size_t nb = (n + blk - 1) / blk;
#pragma omp parallel for schedule(static) if (nb > 1)
    for (size_t b = 0; b < nb; b++) {
        size_t e = (b + 1) * blk < n ? (b + 1) * blk : n;
        for (size_t i = b * blk; i < e; i++) dst[i] = rf_f32_to_bf16(src[i]);
    }
}

rf_status rf_model_write_params(rf_model *m, size_t off, const float *src, size_t n) {
    RF_ASSERT(off + n <= m->n_params);
    if (m->wbf16 && !m->bf16_store) return rf__model_frozen_refuse(m, "writing parameters");
    if (!m->wbf16) {
        m->k->to_device(m->params + off, src, n * sizeof(float));
        return RF_OK;
    }
    size_t end = off + n;
    for (int i = 0; i < m->n_views; i++) { /* the views cover [0, n_params) in order */
        const rf_param_view *v = &m->views[i];
        size_t a = v->offset > off ? v->offset : off, b = v->offset + v->numel < end ? v->offset + v->numel : end;
        if (a >= b) continue;
        if (v->ndim == 2 && a >= m->bf16_lo) round_bf16(m->wbf16 + a, src + (a - off), b - a);
        else memcpy(m->params + a, src + (a - off), (b - a) * sizeof(float));
    }
    return RF_OK;
}

rf_status rf_model_enable_training(rf_model *m) {
    if (m->wbf16) return rf__model_frozen_refuse(m, "training");
    size_t bytes = (m->n_params - m->n_frozen) * sizeof(float);
    if (!m->grads) m->grads = m->k->alloc(bytes);
    if (!m->opt_m) m->opt_m = m->k->alloc(bytes);
    if (!m->opt_v) m->opt_v = m->k->alloc(bytes);
    if (!m->grads || !m->opt_m || !m->opt_v)
        return rf_error(RF_ERR_NOMEM, "out of memory for gradients and optimizer state (%zu MB)",
                        3 * bytes >> 20);
    return RF_OK;
}

void rf_model_zero_grad(rf_model *m) {
    if (m->grads) m->k->zero(m->grads, (m->n_params - m->n_frozen) * sizeof(float));
}

rf_status rf_model_param_views(const rf_model_config *cfg, rf_param_view **views, int *n_views,
                               size_t *n_params) {
    /* The table rf_model_init builds, on a model that never gets buffers. */
    rf_model tmp = {0};
    tmp.cfg = *cfg;
    tmp.views = rf_calloc((size_t)cfg->num_hidden_layers * 16 + 8, sizeof *tmp.views);
    if (!tmp.views) return RF_ERR_NOMEM;
    layer_offsets lo;
    add_view(&tmp, "model.embed_tokens.weight", cfg->vocab_size, cfg->hidden_size, 0);
    for (int l = 0; l < cfg->num_hidden_layers; l++) add_layer(&tmp, l, &lo);
    add_view(&tmp, "model.norm.weight", cfg->hidden_size, 0, 1);
    if (cfg->value_head)
        add_view(&tmp, "score.weight", 1, cfg->hidden_size, 0);
    else if (!cfg->tie_word_embeddings)
        add_view(&tmp, "lm_head.weight", cfg->vocab_size, cfg->hidden_size, 0);
    *views = tmp.views;
    *n_views = tmp.n_views;
    *n_params = tmp.n_params;
    return RF_OK;
}

const rf_param_view *rf_model_find(const rf_model *m, const char *name) {
    for (int i = 0; i < m->n_views; i++)
        if (strcmp(m->views[i].name, name) == 0) return &m->views[i];
    return NULL;
}

double rf_model_train_flops_per_token(const rf_model_config *c, int seq_len) {
    double C = c->hidden_size, F = c->intermediate_size, QD = (double)c->num_attention_heads * c->head_dim,
           KD = (double)c->num_key_value_heads * c->head_dim, L = c->num_hidden_layers;
    double per_layer = C * QD * 2 + C * KD * 2 + 3 * C * F; /* weights touched by matmuls */
    double n = L * per_layer + (double)c->vocab_size * C;   /* + LM head */
    double attn = L * 2.0 * 2.0 * QD * seq_len / 2.0;       /* QK^T and PV, causal half */
    return 6.0 * n + 3.0 * attn;
}

/* Activation buffers for T tokens: one allocation, carved into per-layer views. */
static size_t acts_floats(const rf_model_config *c, int T, int layers) {
    size_t C = c->hidden_size, F = c->intermediate_size, H = c->num_attention_heads,
           KVH = c->num_key_value_heads, D = c->head_dim, QD = H * D, KD = KVH * D;
    size_t per_layer = 2 * C + 1 + QD + KD + H + KVH + QD + 2 * KD + QD + H + C + C + 1 + 3 * F;
    size_t wide = C > F ? C : F;
    wide = wide > QD ? wide : QD;
    return (size_t)T * (per_layer * (size_t)layers + 2 * C + 1 + 2 * wide);
}

/* Whether layer l's buffers hold adapter i's saved product: where it has the adapter, and in
 * decoding's one layer (layers == 1, serving every layer) where any layer has it. */
static int lora_saved(const rf_model *m, int l, int i, int layers) {
    if (layers == m->cfg.num_hidden_layers) return m->layers[l].lora_a[i] != NULL;
    for (int j = 0; j < m->cfg.num_hidden_layers; j++)
        if (m->layers[j].lora_a[i]) return 1;
    return 0;
}

/* Carves the adapters' saved products (T, r) of the first `layers` layers out of *p. */
static void reserve_lora(rf_model *m, float **p, size_t t, int layers) {
    for (int l = 0; l < layers; l++)
        for (int i = 0; i < RF_LORA_N; i++) {
            int on = lora_saved(m, l, i, layers);
            m->acts[l].lora_u[i] = on ? *p : NULL;
            if (on) *p += t * (size_t)m->lora.rank;
        }
}

/* Floats of reserve_lora for T tokens. */
static size_t lora_floats(const rf_model *m, int T, int layers) {
    size_t n = 0;
    for (int l = 0; l < layers; l++)
        for (int i = 0; i < RF_LORA_N; i++)
            if (lora_saved(m, l, i, layers)) n += (size_t)T * (size_t)m->lora.rank;
    return n;
}

/* Activation buffers for T tokens in the first `layers` layers (all, or 1 for decoding);
 * the other layers' pointers are NULL. */
static rf_status reserve(rf_model *m, int T, int layers) {
    if (T <= m->act_cap && layers <= m->act_layers) return RF_OK;
    const rf_model_config *c = &m->cfg;
    m->k->free(m->act_mem);
    memset(m->acts, 0, sizeof *m->acts * (size_t)c->num_hidden_layers);
    int rows = (int)rf__rows_padded(T);
    m->act_mem = m->k->alloc((acts_floats(c, rows, layers) + lora_floats(m, rows, layers)) * sizeof(float));
    if (!m->act_mem) {
        m->act_cap = m->act_layers = 0;
        return rf_error(RF_ERR_NOMEM, "out of memory for activations of %d tokens", T);
    }
    size_t C = c->hidden_size, F = c->intermediate_size, H = c->num_attention_heads,
           KVH = c->num_key_value_heads, D = c->head_dim, QD = H * D, KD = KVH * D, t = (size_t)rows;
    float *p = m->act_mem;
#define TAKE(n) (p += (n), p - (n))
    for (int l = 0; l < layers; l++) {
        rf_layer_acts *a = &m->acts[l];
        a->x = TAKE(t * C);
        a->ln1 = TAKE(t * C);
        a->rstd1 = TAKE(t);
        a->q_raw = TAKE(t * QD);
        a->k_raw = TAKE(t * KD);
        a->q_rstd = TAKE(t * H);
        a->k_rstd = TAKE(t * KVH);
        a->q = TAKE(t * QD);
        a->k = TAKE(t * KD);
        a->v = TAKE(t * KD);
        a->att = TAKE(t * QD);
        a->lse = TAKE(t * H);
        a->x_mid = TAKE(t * C);
        a->ln2 = TAKE(t * C);
        a->rstd2 = TAKE(t);
        a->gate = TAKE(t * F);
        a->up = TAKE(t * F);
        a->act = TAKE(t * F);
    }
    size_t wide = C > F ? C : F;
    wide = wide > QD ? wide : QD;
    m->x_final = TAKE(t * C);
    m->h = TAKE(t * C);
    m->rstd_f = TAKE(t);
    m->scratch = TAKE(t * wide);
    m->scratch2 = TAKE(t * wide);
#undef TAKE
    reserve_lora(m, &p, t, layers);
    m->act_cap = T, m->act_layers = layers;
    return RF_OK;
}

rf_status rf__model_reserve(rf_model *m, int T) { return reserve(m, T, m->cfg.num_hidden_layers); }

rf_status rf__model_reserve_decode(rf_model *m, int T) {
    /* a model that has run a forward keeps every layer's buffers when it grows them: a
     * colocated run's training and generation would otherwise trade reallocations each step */
    return reserve(m, T, m->act_layers > 1 ? m->act_layers : 1);
}
