/* KV-cache decoding: batched prefill and decode steps over cache slots. */
#include <limits.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/sample.h"
#include "model/model_internal.h"

rf_status rf_kv_cache_init(rf_kv_cache *c, const rf_model *m, int n_slots, int max_len) {
    memset(c, 0, sizeof *c);
    int limit = rf_config_max_seq(&m->cfg);
    if (max_len > limit)
        return rf_error(RF_ERR_RANGE, "KV cache length %d exceeds the model's limit of %d", max_len,
                        limit);
    if ((int64_t)n_slots * max_len > INT32_MAX)
        return rf_error(RF_ERR_RANGE, "KV cache of %d x %d positions: more than %d rows a layer",
                        n_slots, max_len, INT32_MAX);
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

int rf__decode_group(const rf_model *m, const int32_t *q_off, int n, int g0, int32_t *g_off) {
    int budget = strcmp(m->k->name, "cpu") == 0 ? RF_DECODE_GROUP_TOKENS : INT_MAX, g1 = g0 + 1;
    while (g1 < n && q_off[g1 + 1] - q_off[g0] <= budget) g1++;
    for (int i = 0; g_off && i <= g1 - g0; i++) g_off[i] = q_off[g0 + i] - q_off[g0];
    return g1;
}

int rf__decode_group_max(const rf_model *m, const int32_t *q_off, int n) {
    int most = 0;
    for (int g0 = 0, g1; g0 < n; g0 = g1) {
        g1 = rf__decode_group(m, q_off, n, g0, NULL);
        most = q_off[g1] - q_off[g0] > most ? q_off[g1] - q_off[g0] : most;
    }
    return most;
}

void rf__gather_last_rows(const rf_kernels *k, float *dst, const float *x, const int32_t *q_off, int n,
                          size_t C) {
    for (int i = 0, j; i < n; i = j) {
        /* sequence j's last row follows sequence j - 1's exactly when j has one new token */
        for (j = i + 1; j < n && q_off[j + 1] - q_off[j] == 1; j++) {
        }
        k->copy(dst + (size_t)i * C, x + (size_t)(q_off[i + 1] - 1) * C, sizeof(float) * C * (size_t)(j - i));
    }
}

void rf__model_gather_last(rf_model *m, const float *x, const int32_t *q_off, int n, int first) {
    size_t C = (size_t)m->cfg.hidden_size;
    rf__gather_last_rows(m->k, m->scratch2 + (size_t)first * C, x, q_off, n, C);
}

rf_status rf__model_logits_gathered(rf_model *m, int n, float *logits) {
    const rf_model_config *c = &m->cfg;
    int C = c->hidden_size, V = c->vocab_size;
    m->k->rmsnorm_forward(m->scratch, NULL, m->scratch2, m->norm, n, C, c->rms_norm_eps);
    RF_TRY(rf__model_dev_out(m, (size_t)n * V));
    m->k->matmul_forward(m->dev_out, m->scratch, m->lm_head, NULL, n, C, V);
    if (logits) m->k->to_host(logits, m->dev_out, sizeof(float) * (size_t)n * V);
    m->draw_rows = logits ? 0 : n; /* rows rf_model_draw may read */
    return RF_OK;
}

/* The back end's row_lse draw of row `row` at the sampling's inverse temperature. */
static rf_row_draw lse_draw(int row, float inv_temp) { return (rf_row_draw){row, 0, inv_temp, 0.0f, 0.0}; }

rf_status rf_model_draw(rf_model *m, int n_rows, const rf_draw *draws, int n_draws, int32_t *picks, float *logp,
                        const int *capture, int n_capture, float *whole, const float *capture_inv_temp,
                        float *whole_lse) {
    size_t V = (size_t)m->cfg.vocab_size;
    if (n_rows > m->draw_rows)
        return rf_error(RF_ERR_ARG, "draw: %d logits rows asked for, the last decode left %d in the back end's memory",
                        n_rows, m->draw_rows);
    for (int i = 0; i < n_draws; i++)
        if (draws[i].row < 0 || draws[i].row >= n_rows)
            return rf_error(RF_ERR_RANGE, "draw %d: row %d outside the step's %d rows", i, draws[i].row, n_rows);
    for (int i = 0; i < n_capture; i++) {
        if (capture[i] < 0 || capture[i] >= n_rows)
            return rf_error(RF_ERR_RANGE, "draw: captured row %d outside the step's %d rows", capture[i], n_rows);
        m->k->to_host(whole + (size_t)i * V, m->dev_out + (size_t)capture[i] * V, sizeof(float) * V);
    }
    if (whole_lse && n_capture > 0) {
        rf_row_draw *cd = malloc(sizeof *cd * (size_t)n_capture);
        if (!cd) return rf_error(RF_ERR_NOMEM, "draw: out of memory for %d captured rows", n_capture);
        for (int i = 0; i < n_capture; i++) cd[i] = lse_draw(capture[i], capture_inv_temp[i]);
        m->k->row_lse(whole_lse, m->dev_out, (int)V, cd, n_capture);
        free(cd);
    }
    int n_sorted = 0;
    for (int i = 0; i < n_draws; i++) n_sorted += rf_sampling_sorted(&draws[i].s);
    int n_plain = n_draws - n_sorted, threads = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
    /* rd, lp: the plain draws [0, n_plain), then the sorted ones' rows for row_lse */
    rf_row_draw *rd = malloc(sizeof *rd * (size_t)(n_draws > 0 ? n_draws : 1));
    int32_t *at = malloc(sizeof *at * (size_t)(n_draws > 0 ? n_draws : 1)), *pp = malloc(sizeof *pp * (size_t)(n_plain + 1));
    float *lp = malloc(sizeof *lp * (size_t)(n_draws + 1));
    /* sorted draws: their rows on the host, and 2 V floats of scratch a thread (rf_sample_u) */
    float *rows = n_sorted ? malloc(sizeof(float) * V * ((size_t)n_sorted + 2 * (size_t)threads)) : NULL;
    rf_status st = RF_OK;
    if (!rd || !at || !pp || !lp || (n_sorted && !rows)) st = rf_error(RF_ERR_NOMEM, "draw: out of memory for %d draws", n_draws);
    int np = 0, ns = 0;
    for (int i = 0; st == RF_OK && i < n_draws; i++) {
        const rf_draw *d = &draws[i];
        if (rf_sampling_sorted(&d->s)) {
            m->k->to_host(rows + (size_t)ns * V, m->dev_out + (size_t)d->row * V, sizeof(float) * V);
            rd[n_plain + ns] = lse_draw(d->row, rf_sampling_inv_temp(&d->s));
            at[n_plain + ns++] = i;
        } else {
            rd[np] = (rf_row_draw){d->row, d->s.greedy, rf_sampling_inv_temp(&d->s), 0.0f, d->u};
            at[np++] = i;
        }
    }
    if (st == RF_OK && np) {
        m->k->sample_rows(pp, lp, m->dev_out, (int)V, rd, np);
        for (int j = 0; j < np; j++) picks[at[j]] = pp[j], logp[at[j]] = lp[j];
    }
    if (st == RF_OK && ns) {
        float *work = rows + (size_t)ns * V;
        m->k->row_lse(lp + n_plain, m->dev_out, (int)V, rd + n_plain, ns);
#pragma omp parallel for schedule(dynamic, 1) if (ns > 1)
        for (int j = 0; j < ns; j++) {
            const rf_draw *d = &draws[at[n_plain + j]];
            const float *z = rows + (size_t)j * V;
            int32_t pick = rf_sample_u(z, (int)V, &d->s, d->u, NULL, work + 2 * V * (size_t)omp_get_thread_num());
            picks[at[n_plain + j]] = pick;
            logp[at[n_plain + j]] = rf_logprob_given_lse(z[pick], rd[n_plain + j].inv_temp, lp[n_plain + j]);
        }
    }
    for (int i = 0; st == RF_OK && i < n_draws; i++)
        if (picks[i] < 0 || (size_t)picks[i] >= V)
            st = rf_error(RF_ERR_INTERNAL, "draw %d: the %s back end gave no token (%d)", i, m->k->name, picks[i]);
    free(rd), free(at), free(pp), free(lp), free(rows);
    return st;
}

rf_status rf_model_decode(rf_model *m, rf_kv_cache *c, const int *slots, const int *counts,
                          int n, const int32_t *tokens, float *logits) {
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "decode: model has no LM head");
    int T = 0;
    for (int i = 0; i < n; i++) T += counts[i] > 0 ? counts[i] : 0;
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(2 * T + 4 * n + 2));
    if (!idx) return rf_error(RF_ERR_NOMEM, "out of memory");
    int32_t *pos = idx, *q_off = idx + T, *k_start = q_off + n + 1, *k_len = k_start + n;
    int32_t *g_off = k_len + n; /* (n + 1) a group's q_off from its first token */
    int32_t *rows = g_off + n + 1; /* (T) each token's cache row within a layer */
    rf_status s = decode_indices(m, c, slots, counts, n, pos, q_off, k_start, k_len);
    if (s == RF_OK) rf__kv_cache_rows(rows, q_off, k_start, pos, n);
    for (int t = 0; s == RF_OK && t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->cfg.vocab_size)
            s = rf_error(RF_ERR_RANGE, "decode: token id %d outside the vocabulary (%d)", tokens[t],
                         m->cfg.vocab_size);
    /* Decoding reuses layer 0's activation buffers for every layer: nothing is kept for
     * backward, so activation memory stays one layer's worth (of the largest group). */
    int most = s == RF_OK ? rf__decode_group_max(m, q_off, n) : 0;
    if (s == RF_OK) s = rf__model_reserve_decode(m, most > n ? most : n);
    for (int g0 = 0, g1; s == RF_OK && g0 < n; g0 = g1) { /* groups of sequences (RF_DECODE_GROUP_TOKENS) */
        g1 = rf__decode_group(m, q_off, n, g0, g_off);
        int g = g1 - g0, t = g_off[g];
        const int32_t *host[] = {tokens + q_off[g0], pos + q_off[g0], g_off, k_start + g0, k_len + g0,
                                 rows + q_off[g0]};
        int cnt[] = {t, t, g + 1, g, g, t};
        int32_t *dev[6];
        s = rf__model_upload_ints(m, 6, host, cnt, dev);
        if (s != RF_OK) break;
        m->d_tokens = dev[0], m->d_pos = dev[1], m->d_cu = dev[2], m->d_kstart = dev[3];
        m->d_klen = dev[4];
        rf_layer_acts *a = &m->acts[0];
        float *x = m->x_final, *y = m->h; /* ping-pong residual buffers */
        m->k->embedding_forward(x, m->d_tokens, m->wte, t, m->cfg.hidden_size);
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            rf__layer_forward_cached(m, l, a, x, y, t, c, dev[5], g);
            float *tmp = x;
            x = y, y = tmp;
        }
        rf__model_gather_last(m, x, g_off, g, g0);
    }
    if (s == RF_OK) {
        s = rf__model_logits_gathered(m, n, logits);
        for (int i = 0; s == RF_OK && i < n; i++) c->len[slots[i]] += counts[i];
    }
    m->T = 0; /* activations no longer describe a training forward */
    free(idx);
    return s;
}
