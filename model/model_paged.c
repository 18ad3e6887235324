/* Decoding over the paged KV cache of rollout/kv_pool.h: the paged twin of rf_model_decode
 * (model_decode.c). The same layers run; only where keys/values are written and read changes
 * (rf__layer_forward_paged), so with the same batch a paged decode gives the same logits. */
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"
#include "rollout/kv_pool.h"

/* Allocates the index arrays of one call (one allocation) and counts its tokens. */
static rf_status idx_alloc(rf__paged_idx *ix, const rf_kv_pool *p, const rf_paged_seq *seqs, int n) {
    ix->T = 0, ix->max_blocks = 1;
    for (int i = 0; i < n; i++) {
        if (seqs[i].n_new <= 0)
            return rf_error(RF_ERR_ARG, "paged decode: sequence %d has no new tokens", i);
        int nb = rf_kv_pool_blocks_for(p, seqs[i].n_cached + seqs[i].n_new);
        ix->max_blocks = nb > ix->max_blocks ? nb : ix->max_blocks;
        ix->T += seqs[i].n_new;
    }
    size_t total = 2 * (size_t)ix->T + 2 * (size_t)n + 1 + (size_t)n * ix->max_blocks;
    ix->pos = calloc(total, sizeof(int32_t));
    if (!ix->pos) return rf_error(RF_ERR_NOMEM, "paged decode: out of memory");
    ix->slots = ix->pos + ix->T, ix->q_off = ix->slots + ix->T, ix->k_len = ix->q_off + n + 1;
    ix->table = ix->k_len + n;
    return RF_OK;
}

/* Fills positions, pool slots of the new tokens, offsets, lengths and the padded block table. */
static rf_status idx_fill(rf__paged_idx *ix, const rf_model_config *cfg, const rf_kv_pool *p,
                          const rf_paged_seq *seqs, int n) {
    int limit = rf_config_max_seq(cfg), bs = p->block_size;
    ix->q_off[0] = 0;
    for (int i = 0; i < n; i++) {
        const rf_paged_seq *s = &seqs[i];
        int len = s->n_cached + s->n_new, nb = rf_kv_pool_blocks_for(p, len);
        if (len > limit)
            return rf_error(RF_ERR_RANGE, "paged decode: sequence %d would hold %d positions, "
                            "more than the model's limit of %d", i, len, limit);
        for (int b = 0; b < nb; b++) {
            if (s->blocks[b] < 0 || s->blocks[b] >= p->n_blocks)
                return rf_error(RF_ERR_RANGE, "paged decode: sequence %d: block %d of its table "
                                "is %d, outside the pool's %d blocks", i, b, s->blocks[b], p->n_blocks);
            ix->table[(size_t)i * ix->max_blocks + b] = s->blocks[b];
        }
        for (int j = 0; j < s->n_new; j++) {
            int t = ix->q_off[i] + j, at = s->n_cached + j;
            ix->pos[t] = at;
            ix->slots[t] = s->blocks[at / bs] * bs + at % bs;
        }
        ix->q_off[i + 1] = ix->q_off[i] + s->n_new;
        ix->k_len[i] = len;
    }
    return RF_OK;
}

rf_status rf__paged_idx_make(rf__paged_idx *ix, const rf_model_config *cfg, const rf_kv_pool *p,
                             const rf_paged_seq *seqs, int n, const int32_t *tokens) {
    memset(ix, 0, sizeof *ix);
    rf_status s = idx_alloc(ix, p, seqs, n);
    if (s == RF_OK) s = idx_fill(ix, cfg, p, seqs, n);
    for (int t = 0; s == RF_OK && t < ix->T; t++)
        if (tokens[t] < 0 || tokens[t] >= cfg->vocab_size)
            s = rf_error(RF_ERR_RANGE, "paged decode: token id %d outside the vocabulary (%d)",
                         tokens[t], cfg->vocab_size);
    if (s != RF_OK) rf__paged_idx_free(ix);
    return s;
}

void rf__paged_idx_free(rf__paged_idx *ix) {
    free(ix->pos);
    ix->pos = NULL;
}

rf_status rf__paged_upload(rf_model *m, const rf_kv_pool *p, const rf__paged_idx *ix, int n,
                           const int32_t *tokens, rf__paged_view *pv) {
    const int32_t *host[] = {tokens, ix->pos, ix->slots, ix->q_off, ix->k_len, ix->table};
    int cnt[] = {ix->T, ix->T, ix->T, n + 1, n, n * ix->max_blocks};
    int32_t *dev[6];
    RF_TRY(rf__model_upload_ints(m, 6, host, cnt, dev));
    m->d_tokens = dev[0], m->d_pos = dev[1];
    *pv = (rf__paged_view){p->kc, p->vc, (size_t)p->n_blocks * p->block_size * p->KVH * p->D,
                           p->block_size, ix->max_blocks, n, dev[2], dev[5], dev[3], dev[4]};
    return RF_OK;
}

/* Uploads a group's index arrays and runs embedding and layers over it; its sequences' last
 * rows go to rows `first`.. of the gathered ones. */
static rf_status paged_run(rf_model *m, rf_kv_pool *p, const rf__paged_idx *ix, int n,
                           const int32_t *tokens, int first) {
    rf__paged_view pv;
    RF_TRY(rf__paged_upload(m, p, ix, n, tokens, &pv));
    rf_layer_acts *a = &m->acts[0]; /* one layer's buffers serve every layer, as in decoding */
    float *x = m->x_final, *y = m->h;
    m->k->embedding_forward(x, m->d_tokens, m->wte, ix->T, m->cfg.hidden_size);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        rf__layer_forward_paged(m, l, a, x, y, ix->T, &pv);
        float *t = x;
        x = y, y = t;
    }
    rf__model_gather_last(m, x, ix->q_off, n, first);
    return RF_OK;
}

rf_status rf_model_decode_paged(rf_model *m, rf_kv_pool *pool, const rf_paged_seq *seqs, int n,
                                const int32_t *tokens, float *logits) {
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "paged decode: model has no LM head");
    if (n <= 0) return RF_OK;
    rf__paged_idx ix;
    RF_TRY(rf__paged_idx_make(&ix, &m->cfg, pool, seqs, n, tokens));
    /* groups of sequences of at most RF_DECODE_GROUP_TOKENS new tokens (model_internal.h),
     * each a view of ix with its own query offsets from its first token */
    int most = rf__decode_group_max(m, ix.q_off, n);
    int32_t *g_off = malloc(sizeof(int32_t) * (size_t)(n + 1));
    rf_status s = g_off ? rf__model_reserve_decode(m, most > n ? most : n) : rf_error(RF_ERR_NOMEM, "paged decode: out of memory");
    for (int g0 = 0, g1; s == RF_OK && g0 < n; g0 = g1) {
        g1 = rf__decode_group(m, ix.q_off, n, g0, g_off);
        int o = ix.q_off[g0];
        rf__paged_idx gx = {ix.pos + o, ix.slots + o, g_off, ix.k_len + g0, ix.table + (size_t)g0 * ix.max_blocks,
                            g_off[g1 - g0], ix.max_blocks};
        s = paged_run(m, pool, &gx, g1 - g0, tokens + o, g0);
    }
    if (s == RF_OK) s = rf__model_logits_gathered(m, n, logits);
    m->T = 0; /* activations no longer describe a training forward */
    free(g_off);
    rf__paged_idx_free(&ix);
    return s;
}
