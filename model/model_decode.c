/* KV-cache decoding: batched prefill and decode steps over cache slots. */
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/model_internal.h"

rf_status rf_kv_cache_init(rf_kv_cache *c, const rf_model *m, int n_slots, int max_len) {
    memset(c, 0, sizeof *c);
    int limit = rf_config_max_seq(&m->cfg);
    if (max_len > limit)
        return rf_error(RF_ERR_RANGE, "KV cache length %d exceeds the model's limit of %d", max_len,
                        limit);
    c->n_slots = n_slots, c->max_len = max_len, c->n_layers = m->cfg.num_hidden_layers;
    c->KVH = m->cfg.num_key_value_heads, c->D = m->cfg.head_dim;
    size_t n = (size_t)c->n_layers * n_slots * max_len * c->KVH * c->D;
    c->k = m->k->alloc(n * sizeof(float));
    c->v = m->k->alloc(n * sizeof(float));
    c->len = calloc((size_t)n_slots, sizeof(int));
    if (!c->k || !c->v || !c->len) {
        rf_kv_cache_free(c, m);
        return rf_error(RF_ERR_NOMEM, "out of memory for a KV cache of %d x %d positions (%zu MB)",
                        n_slots, max_len, 2 * n * sizeof(float) >> 20);
    }
    return RF_OK;
}

void rf_kv_cache_free(rf_kv_cache *c, const rf_model *m) {
    if (!c) return;
    if (m) {
        m->k->free(c->k);
        m->k->free(c->v);
    }
    free(c->len);
    memset(c, 0, sizeof *c);
}

/* Host index arrays for a decode call: positions, query offsets, key starts and lengths. */
static rf_status decode_indices(const rf_model *m, const rf_kv_cache *c, const int *slots,
                                const int *counts, int n, int32_t *pos, int32_t *q_off,
                                int32_t *k_start, int32_t *k_len) {
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
    (void)m;
    return RF_OK;
}

rf_status rf__model_last_logits(rf_model *m, const float *x, const int32_t *q_off, int n,
                             float *logits) {
    const rf_model_config *c = &m->cfg;
    int C = c->hidden_size, V = c->vocab_size;
    for (int i = 0; i < n; i++)
        m->k->copy(m->scratch + (size_t)i * C, x + (size_t)(q_off[i + 1] - 1) * C,
                   sizeof(float) * (size_t)C);
    m->k->rmsnorm_forward(m->scratch2, NULL, m->scratch, m->norm, n, C, c->rms_norm_eps);
    RF_TRY(rf__model_dev_out(m, (size_t)n * V));
    m->k->matmul_forward(m->dev_out, m->scratch2, m->lm_head, NULL, n, C, V);
    m->k->to_host(logits, m->dev_out, sizeof(float) * (size_t)n * V);
    return RF_OK;
}

rf_status rf_model_decode(rf_model *m, rf_kv_cache *c, const int *slots, const int *counts,
                          int n, const int32_t *tokens, float *logits) {
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "decode: model has no LM head");
    int T = 0;
    for (int i = 0; i < n; i++) T += counts[i] > 0 ? counts[i] : 0;
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T + 3 * n + 1));
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    int32_t *pos = idx, *q_off = idx + T, *k_start = q_off + n + 1, *k_len = k_start + n;
    rf_status s = decode_indices(m, c, slots, counts, n, pos, q_off, k_start, k_len);
    for (int t = 0; s == RF_OK && t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->cfg.vocab_size)
            s = rf_error(RF_ERR_RANGE, "decode: token id %d outside the vocabulary (%d)", tokens[t],
                         m->cfg.vocab_size);
    /* Decoding reuses layer 0's activation buffers for every layer: nothing is kept for
     * backward, so activation memory stays one layer's worth. */
    if (s == RF_OK) s = rf__model_reserve(m, T > n ? T : n);
    if (s == RF_OK) {
        const int32_t *host[] = {tokens, pos, q_off, k_start, k_len};
        int cnt[] = {T, T, n + 1, n, n};
        int32_t *dev[5];
        s = rf__model_upload_ints(m, 5, host, cnt, dev);
        m->d_tokens = dev[0], m->d_pos = dev[1], m->d_cu = dev[2], m->d_kstart = dev[3];
        m->d_klen = dev[4];
    }
    if (s == RF_OK) {
        rf_layer_acts *a = &m->acts[0];
        float *x = m->x_final, *y = m->h; /* ping-pong residual buffers */
        m->k->embedding_forward(x, m->d_tokens, m->wte, T, m->cfg.hidden_size);
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            rf__layer_forward_cached(m, l, a, x, y, T, c, slots, counts, n);
            float *t = x;
            x = y, y = t;
        }
        s = rf__model_last_logits(m, x, q_off, n, logits);
        for (int i = 0; s == RF_OK && i < n; i++) c->len[slots[i]] += counts[i];
        m->T = 0; /* activations no longer describe a training forward */
    }
    free(idx);
    return s;
}
