/* Layouts: how the model's parameters are spread over ranks, for training (dp x tp) and for
 * generation (tp x replicas), Megatron-style (Shoeybi et al. 2019, "Megatron-LM", section 3):
 *
 *   column-parallel  q/k/v/gate/up weights (out, in) and the q/k/v biases: split along the
 *                    output dimension (rows); q/k/v by whole heads;
 *   row-parallel     o_proj / down_proj weights (out, in): split along the input dimension
 *                    (columns); o_proj by whole heads; o_proj's bias is replicated (it is added
 *                    after the reduction);
 *   vocab-parallel   embed_tokens and lm_head (V, C): split along the vocabulary (rows);
 *   replicated       norms (layer, final, Qwen3 q/k norms), the value head.
 * GQA: k/v heads are split across the tp ranks when tp divides num_key_value_heads; otherwise
 * every tp rank holds all of them (shard t's q heads use k/v heads t*KVH/tp.. when split).
 * Splits are balanced: shard t of n units (heads, rows) gets units [t*n/tp, (t+1)*n/tp), so a
 * vocabulary or an intermediate size that tp does not divide is fine; attention heads must be
 * divisible (rf_layout_check).
 *
 * A rank holding shard t keeps its parameters in one flat local buffer (the model's idea,
 * llm.c style): the shards of every parameter in the parameter table's order, each row-major
 * in its local shape. rf_layout_shards gives the shapes and offsets; rf_layout_extract cuts a
 * rank's buffer out of the full one (initialisation from a checkpoint, tests).
 *
 * A layout places replica d's shard t on rank ranks[d * tp + t] of the communicator the
 * resharding runs over (first_rank + d * tp + t when ranks is NULL: tp ranks adjacent, as
 * Megatron orders them). One rank holds at most one shard of a layout; it may hold one of each
 * of two layouts (colocated). */
#ifndef RF_LAYOUT_H
#define RF_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "model/config.h"
#include "model/model.h"

/* The parameters resharding works on: names and full shapes, as rf_model has them (a rank
 * that holds only a shard can build the table without the full buffer). Borrowed. */
typedef struct rf_param_table {
    const rf_model_config *cfg;
    const rf_param_view *views; /* (n_views) */
    int n_views;
} rf_param_table;

static inline rf_param_table rf_param_table_of(const rf_model *m) {
    rf_param_table t = {&m->cfg, m->views, m->n_views};
    return t;
}

typedef enum rf_split {
    RF_SPLIT_REPLICATED, /* every shard holds the whole tensor */
    RF_SPLIT_ROWS,       /* along dim 0 (column-parallel, vocab-parallel) */
    RF_SPLIT_COLS,       /* along dim 1 (row-parallel) */
} rf_split;

/* One parameter's shard on one tp rank. 1-D tensors are (n, 1). */
typedef struct rf_shard {
    rf_split split;
    int64_t full_rows, full_cols; /* the whole tensor */
    int64_t r0, r1, c0, c1;       /* the block held: rows [r0, r1) x cols [c0, c1) */
    size_t offset;                /* floats, into the rank's local buffer; the block is
                                     row-major (r1 - r0, c1 - c0) there */
} rf_shard;

typedef struct rf_layout {
    int tp;           /* shards per replica */
    int dp;           /* replicas: data-parallel groups (training), engines (generation) */
    int first_rank;   /* rank of replica 0, shard 0 when ranks is NULL */
    const int *ranks; /* (dp * tp) ranks[d * tp + t], or NULL. Borrowed */
} rf_layout;

/* Checks a layout against the model and a communicator of comm_size ranks: tp, dp >= 1; tp
 * divides num_attention_heads and is at most the vocabulary and intermediate sizes; ranks
 * exist and are distinct. RF_ERR_ARG naming `name` ("training layout") and the field. */
rf_status rf_layout_check(const rf_layout *l, const rf_model_config *cfg, int comm_size,
                          const char *name);

/* Rank holding replica d's shard t. */
int rf_layout_rank(const rf_layout *l, int d, int t);

/* 1 when `rank` holds a shard of l (*d, *t set; either may be NULL), else 0. */
int rf_layout_find(const rf_layout *l, int rank, int *d, int *t);

/* How parameter `name` (a Hugging Face name) is split at tensor-parallel degree tp. */
rf_split rf_layout_split_of(const rf_model_config *cfg, const char *name, int tp);

/* Shard t (of tp) of every parameter of the table: shards (n_views) and the local buffer's
 * size in floats. RF_ERR_ARG when tp does not divide the attention heads. */
rf_status rf_layout_shards(const rf_param_table *pt, int tp, int t, rf_shard *shards,
                           size_t *n_floats);

/* Copies shard blocks out of the full flat buffer (the model's, n_params floats) into a local
 * buffer laid out by shards (n_views). Host memory. */
void rf_layout_extract(const rf_param_table *pt, const rf_shard *shards, const float *full,
                       float *local);

#endif
