/* Internal helpers shared by the model's files (not part of the public interface). */
#ifndef RF_MODEL_INTERNAL_H
#define RF_MODEL_INTERNAL_H

#include "model/model.h"
#include "rollout/kv_pool.h"

/* Where n floats read from files are converted before they reach dst (n floats on back end
 * k): dst itself when k works in host memory (the CPU back end), else a host buffer that
 * rf__host_staging_done copies to dst (when ok), tells the back end its weights changed
 * (weights_updated) and frees. `what` names the data in errors. */
rf_status rf__host_staging(const rf_kernels *k, float *dst, size_t n, float **host, const char *what);
void rf__host_staging_done(const rf_kernels *k, float *dst, size_t n, float *host, int ok);

/* Moves every weight pointer of m (adapters included) from parameter buffer old to now (same
 * offsets); m->params itself is the caller's to set. */
void rf__model_rebase(rf_model *m, const float *old, float *now);

/* RF_ERR_UNSUPPORTED for operation `what` on a model with bf16-resident weights (m->wbf16
 * set): a frozen one (its weights never change) or one kept in bf16 for generation
 * (m->bf16_store); neither has an fp32 copy of its matrices. */
rf_status rf__model_frozen_refuse(const rf_model *m, const char *what);

/* Rows the activation and gradient buffers are carved for when a pass has T tokens: T rounded
 * up to a multiple of 16, so that every buffer (a multiple of these rows) starts 64 bytes
 * aligned, as the back end's allocations do. oneDNN's AMX products wrote an output 16 bytes off
 * a 64-byte line 25-35 % slower (2048 x 512 x 1408 in bf16: 2891 against 1863-2172 GFLOP/s). */
static inline size_t rf__rows_padded(int T) { return ((size_t)(T > 0 ? T : 0) + 15) & ~(size_t)15; }

/* Grows activation buffers to hold T tokens for every layer (a forward, which keeps each
 * layer's for backward). */
rf_status rf__model_reserve(rf_model *m, int T);
/* The same for decoding, which runs every layer through the buffers of layer 0 (acts[0]): T
 * tokens of one layer's buffers, or of every layer's where a forward has reserved those (then
 * training and generation share them). A 7B model's prefill of 8 x 1024 tokens reserved 78 GB
 * for 32 layers, where one takes 2.4 GB. */
rf_status rf__model_reserve_decode(rf_model *m, int T);

/* Copies host index arrays to the back end: returns device pointers in the same order.
 * Each of the `n` arrays has counts[i] int32 entries. */
rf_status rf__model_upload_ints(rf_model *m, int n, const int32_t *const *host,
                                const int *counts, int32_t **dev);

/* Ensures m->dev_out holds `n` floats. */
rf_status rf__model_dev_out(rf_model *m, size_t n);

/* Holds the activation p (rows, cols) that only products read until the model's next release
 * (kernels.h operand_hold), and ends the model's holds: before a pass writes activations
 * (model_forward.c). */
void rf__model_hold(const rf_model *m, const float *p, int rows, int cols);
void rf__model_release(const rf_model *m);

/* One layer in decoding mode over n sequences of T new tokens: writes their keys/values to
 * cache c, token t's to row rows[t] (back end memory) of the layer (slot * max_len +
 * position), then attends over the cache. */
void rf__layer_forward_cached(rf_model *m, int l, rf_layer_acts *a, const float *x_in,
                              float *x_out, int T, rf_kv_cache *c, const int32_t *rows, int n);

/* A paged KV cache as one decode call sees it (built by model/model_paged.c from the pool of
 * rollout/kv_pool.h). Device pointers; n sequences with n_new tokens each, packed. */
typedef struct rf__paged_view {
    float *k, *v;               /* (L, n_blocks * block_size, KVH, D) pools */
    size_t layer_floats;        /* floats per layer in each pool */
    int block_size, max_blocks, n;
    const int32_t *slots;       /* (T) pool row of each new token */
    const int32_t *block_table; /* (n, max_blocks) */
    const int32_t *q_off;       /* (n + 1) */
    const int32_t *k_len;       /* (n) cached + new positions per sequence */
} rf__paged_view;

/* One layer in decoding mode over a paged cache: writes the new keys/values to their pool rows
 * and attends through the block tables. */
void rf__layer_forward_paged(rf_model *m, int l, rf_layer_acts *a, const float *x_in,
                             float *x_out, int T, const rf__paged_view *pv);

/* Host index arrays of one paged decode call (one allocation): positions and pool rows of
 * the new tokens, query offsets, cached + new lengths, the block table padded to max_blocks. */
typedef struct rf__paged_idx {
    int32_t *pos, *slots;  /* (T) */
    int32_t *q_off;        /* (n + 1) */
    int32_t *k_len;        /* (n) */
    int32_t *table;        /* (n, max_blocks) */
    int T, max_blocks;
} rf__paged_idx;

/* Builds and checks the index arrays of n sequences over pool p for a model of config cfg
 * (the whole model's: its vocabulary and position limit): RF_ERR_ARG / RF_ERR_RANGE as
 * rf_model_decode_paged. Free with rf__paged_idx_free (also on error: nothing to free). */
rf_status rf__paged_idx_make(rf__paged_idx *ix, const rf_model_config *cfg, const rf_kv_pool *p,
                             const rf_paged_seq *seqs, int n, const int32_t *tokens);
void rf__paged_idx_free(rf__paged_idx *ix);

/* Uploads tokens and the index arrays to m's back end (m->d_tokens, m->d_pos set) and
 * describes the call's view of pool p. The caller reserved m's buffers. */
rf_status rf__paged_upload(rf_model *m, const rf_kv_pool *p, const rf__paged_idx *ix, int n,
                           const int32_t *tokens, rf__paged_view *pv);

/* New tokens a KV-cache decoder runs through the layers at once on the CPU back end: a call
 * with more (a prefill of many prompts) runs its sequences in groups of at most this many new
 * tokens (a sequence with more goes alone), layer after layer, then the LM head over every
 * sequence's last row at once. A group's activations then stay in the caches: on a Xeon with
 * AMX, the bench's bf16 prefill of 8 x 256 tokens (small) took 0.108 s in one pass, 0.090 s
 * in groups of 512 (0.100 s in groups of 256; Qwen2.5-0.5B's 2 x 256: 0.375 s in groups of
 * 256, 0.333 s in one of 512). Rows are batch-invariant where the products are
 * (rf_cpu_batch_invariant_exact): there the groups change no bit. Other back ends: one group. */
#define RF_DECODE_GROUP_TOKENS 512

/* The group of sequences that starts at sequence g0 of a decode call of n sequences (q_off: the
 * call's query offsets, n + 1): returns its end g1; g_off (unless NULL) gets the group's query
 * offsets from its first token (g1 - g0 + 1 entries, the last its number of tokens). */
int rf__decode_group(const rf_model *m, const int32_t *q_off, int n, int g0, int32_t *g_off);

/* The tokens of the call's largest group (what the activation buffers must hold). */
int rf__decode_group_max(const rf_model *m, const int32_t *q_off, int n);

/* The last row of each of n sequences of x (rows q_off[i+1]-1) copied to rows first.. of
 * m->scratch2 (which the layers do not use). */
void rf__model_gather_last(rf_model *m, const float *x, const int32_t *q_off, int n, int first);
/* The same into dst (n, C) on back end k: one copy per run of sequences whose last rows are
 * adjacent (a decoding step's: all of them), not one per sequence (a launch each on a GPU).
 * Also the tensor-parallel decoder's. */
void rf__gather_last_rows(const rf_kernels *k, float *dst, const float *x, const int32_t *q_off, int n,
                          size_t C);

/* A contiguous KV cache's rows: layer l starts at float rf__kv_cache_layer(c, l) of c->k and
 * c->v; a decode call's token j of sequence i (queries q_off[i] ..) goes to row rows[j] =
 * k_start[i] + pos[j] (slot * max_len + position) of the layer, written by one paged_kv_write
 * a layer. */
static inline size_t rf__kv_cache_layer(const rf_kv_cache *c, int l) {
    return (size_t)l * c->n_slots * c->max_len * c->KVH * c->D;
}
static inline void rf__kv_cache_rows(int32_t *rows, const int32_t *q_off, const int32_t *k_start,
                                     const int32_t *pos, int n) {
    for (int i = 0; i < n; i++)
        for (int j = q_off[i]; j < q_off[i + 1]; j++) rows[j] = k_start[i] + pos[j];
}

/* Logits (n, V) of the n rows rf__model_gather_last left in m->scratch2: final norm, LM head;
 * copied to the host when logits is not NULL, else kept for rf_model_draw. Used by both
 * KV-cache decoders. */
rf_status rf__model_logits_gathered(rf_model *m, int n, float *logits);

#endif
