/* Layouts: split rules per parameter name, shard geometry, checks. */
#include "resharding/layout.h"

#include <string.h>

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* LoRA adapters (model/lora.h) split like their base matrices: on a column-parallel projection
 * (q, k, v, gate, up) A (r, in) is replicated and B (out, r) split by rows as the weight is;
 * on a row-parallel one (o, down) A is split by columns as the weight is and B replicated. */
static rf_split lora_split(const rf_model_config *cfg, const char *name, int tp) {
    int row_parallel = strstr(name, ".self_attn.o_proj.") || strstr(name, ".mlp.down_proj.");
    if (strstr(name, ".lora_A.")) return row_parallel ? RF_SPLIT_COLS : RF_SPLIT_REPLICATED;
    if (row_parallel) return RF_SPLIT_REPLICATED;
    if (strstr(name, ".self_attn.k_proj.") || strstr(name, ".self_attn.v_proj."))
        return cfg->num_key_value_heads % tp == 0 ? RF_SPLIT_ROWS : RF_SPLIT_REPLICATED;
    return RF_SPLIT_ROWS;
}

rf_split rf_layout_split_of(const rf_model_config *cfg, const char *name, int tp) {
    if (tp <= 1) return RF_SPLIT_REPLICATED;
    if (strstr(name, ".lora_A.") || strstr(name, ".lora_B.")) return lora_split(cfg, name, tp);
    if (strcmp(name, "model.embed_tokens.weight") == 0 || strcmp(name, "lm_head.weight") == 0) return RF_SPLIT_ROWS;
    if (strstr(name, ".self_attn.q_proj.")) return RF_SPLIT_ROWS;
    if (strstr(name, ".self_attn.k_proj.") || strstr(name, ".self_attn.v_proj."))
        return cfg->num_key_value_heads % tp == 0 ? RF_SPLIT_ROWS : RF_SPLIT_REPLICATED;
    if (ends_with(name, ".self_attn.o_proj.weight") || ends_with(name, ".mlp.down_proj.weight")) return RF_SPLIT_COLS;
    if (ends_with(name, ".mlp.gate_proj.weight") || ends_with(name, ".mlp.up_proj.weight")) return RF_SPLIT_ROWS;
    return RF_SPLIT_REPLICATED; /* norms, o_proj.bias, score.weight */
}

/* Rows (or columns) per split unit: a head's head_dim for attention, 1 otherwise. */
static int64_t unit_of(const rf_model_config *cfg, const char *name) {
    return strstr(name, ".self_attn.") ? cfg->head_dim : 1;
}

/* Balanced interval of shard t of tp over n units of u. */
static void interval(int64_t n_units, int64_t u, int tp, int t, int64_t *lo, int64_t *hi) {
    *lo = u * (n_units * t / tp);
    *hi = u * (n_units * (t + 1) / tp);
}

rf_status rf_layout_shards(const rf_param_table *pt, int tp, int t, rf_shard *shards, size_t *n_floats) {
    const rf_model_config *cfg = pt->cfg;
    if (tp < 1 || cfg->num_attention_heads % tp != 0)
        return rf_error(RF_ERR_ARG, "tp = %d does not divide num_attention_heads = %d", tp, cfg->num_attention_heads);
    size_t off = 0;
    for (int i = 0; i < pt->n_views; i++) {
        const rf_param_view *v = &pt->views[i];
        rf_shard *s = &shards[i];
        s->full_rows = v->shape[0];
        s->full_cols = v->ndim == 2 ? v->shape[1] : 1;
        s->split = rf_layout_split_of(cfg, v->name, tp);
        s->r0 = 0, s->r1 = s->full_rows, s->c0 = 0, s->c1 = s->full_cols;
        int64_t u = unit_of(cfg, v->name);
        if (s->split == RF_SPLIT_ROWS) interval(s->full_rows / u, u, tp, t, &s->r0, &s->r1);
        if (s->split == RF_SPLIT_COLS) interval(s->full_cols / u, u, tp, t, &s->c0, &s->c1);
        s->offset = off;
        off += (size_t)((s->r1 - s->r0) * (s->c1 - s->c0));
    }
    *n_floats = off;
    return RF_OK;
}

void rf_layout_extract(const rf_param_table *pt, const rf_shard *shards, const float *full, float *local) {
    for (int i = 0; i < pt->n_views; i++) {
        const rf_shard *s = &shards[i];
        const float *src = full + pt->views[i].offset;
        int64_t w = s->c1 - s->c0;
        for (int64_t r = s->r0; r < s->r1; r++)
            memcpy(local + s->offset + (size_t)((r - s->r0) * w), src + r * s->full_cols + s->c0, sizeof(float) * (size_t)w);
    }
}

int rf_layout_rank(const rf_layout *l, int d, int t) {
    return l->ranks ? l->ranks[d * l->tp + t] : l->first_rank + d * l->tp + t;
}

int rf_layout_find(const rf_layout *l, int rank, int *d, int *t) {
    for (int i = 0; i < l->dp * l->tp; i++)
        if (rf_layout_rank(l, i / l->tp, i % l->tp) == rank) {
            if (d) *d = i / l->tp;
            if (t) *t = i % l->tp;
            return 1;
        }
    return 0;
}

rf_status rf_layout_check(const rf_layout *l, const rf_model_config *cfg, int comm_size, const char *name) {
    if (l->tp < 1 || l->dp < 1) return rf_error(RF_ERR_ARG, "%s: tp = %d and dp = %d must be at least 1", name, l->tp, l->dp);
    if (cfg->num_attention_heads % l->tp != 0)
        return rf_error(RF_ERR_ARG, "%s: tp = %d does not divide num_attention_heads = %d", name, l->tp, cfg->num_attention_heads);
    if (l->tp > cfg->vocab_size || l->tp > cfg->intermediate_size)
        return rf_error(RF_ERR_ARG, "%s: tp = %d is more than the vocabulary (%d) or intermediate size (%d)", name, l->tp,
                        cfg->vocab_size, cfg->intermediate_size);
    int n = l->dp * l->tp;
    for (int i = 0; i < n; i++) {
        int r = rf_layout_rank(l, i / l->tp, i % l->tp);
        if (r < 0 || r >= comm_size)
            return rf_error(RF_ERR_ARG, "%s: replica %d shard %d is on rank %d, not a rank of a communicator of %d", name,
                            i / l->tp, i % l->tp, r, comm_size);
        for (int j = 0; j < i; j++)
            if (rf_layout_rank(l, j / l->tp, j % l->tp) == r)
                return rf_error(RF_ERR_ARG, "%s: rank %d holds two shards (replica %d shard %d and replica %d shard %d)", name, r,
                                j / l->tp, j % l->tp, i / l->tp, i % l->tp);
    }
    return RF_OK;
}
