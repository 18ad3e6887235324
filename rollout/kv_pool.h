/* The paged KV cache of the rollout engine: a pool of fixed-size blocks on the model's back end
 * with host-side bookkeeping (free list, reference counts), and the model call that decodes over
 * it (the memory scheme of vLLM's PagedAttention, Kwon et al. 2023).
 *
 * A block holds block_size consecutive positions of one sequence for every layer, keys and
 * values. Memory is bounded by n_blocks, fixed at init. Sequences own block tables (lists of
 * block ids); the samples of one prompt point at the same prompt blocks, each holding a
 * reference, and a block is returned to the free list when its last reference goes. A block is
 * written only while it has a single reference: the engine copies a shared, partially filled
 * last block before a sample appends to it (copy on write, rf_kv_pool_copy).
 *
 * Threads: one thread at a time, like the model. */
#ifndef RF_KV_POOL_H
#define RF_KV_POOL_H

#include <stdint.h>

#include "model/model.h"

typedef struct rf_kv_pool {
    const rf_kernels *k;
    int n_blocks, block_size, n_layers, KVH, D;
    float *kc, *vc;  /* (L, n_blocks * block_size, KVH, D) on the back end */
    int *ref;        /* (n_blocks) host: references per block, 0 = free */
    int *free_ids;   /* (n_blocks) host: stack of free block ids, top at n_free - 1 */
    int n_free;
    int peak_used;   /* most blocks in use at once since init */
} rf_kv_pool;

/* Allocates a pool of n_blocks blocks of block_size positions for model m (on m's back end).
 * Errors: RF_ERR_ARG for non-positive sizes, RF_ERR_NOMEM naming the size in MB. On error the
 * pool is left zeroed (rf_kv_pool_free accepts it). */
rf_status rf_kv_pool_init(rf_kv_pool *p, const rf_model *m, int n_blocks, int block_size);
/* The same for an explicit geometry on back end k: n_layers layers of KVH k/v heads of D floats
 * (a tensor-parallel rank's pool holds only the heads it attends over,
 * rf_model_tp_kv_pool_init). */
rf_status rf_kv_pool_init_heads(rf_kv_pool *p, const rf_kernels *k, int n_layers, int KVH, int D,
                                int n_blocks, int block_size);
void rf_kv_pool_free(rf_kv_pool *p);
/* Gives the pool's k/v memory back to the back end while no block is in use (the bookkeeping
 * stays: block ids, the free list, peak_used), so that something else may use the device
 * meanwhile: a colocated run's training (verl's free_cache_engine). RF_ERR_INTERNAL naming the
 * count while blocks are in use; nothing to do when already released. */
rf_status rf_kv_pool_release(rf_kv_pool *p);
/* Allocates a released pool's k/v memory again (its contents undefined: no block is in use);
 * nothing to do when it holds it. RF_ERR_NOMEM naming the size in MB. */
rf_status rf_kv_pool_acquire(rf_kv_pool *p);
/* Whether the pool holds its k/v memory (made and not released). */
int rf_kv_pool_held(const rf_kv_pool *p);
/* Bytes of k/v memory the pool holds when held. */
size_t rf_kv_pool_bytes(const rf_kv_pool *p);

/* The size of a pool sized from memory: `want` blocks (enough for the longest load) when
 * fraction x free_bytes holds that many of block_bytes each, else as many as it holds; -1
 * when it holds fewer than `least` (one longest sequence). */
int rf_kv_pool_fit(size_t block_bytes, size_t free_bytes, double fraction, int want, int least);

/* Takes a free block with one reference; -1 when none is free. Lowest ids are handed out
 * first after init, so runs are reproducible. */
int rf_kv_pool_alloc(rf_kv_pool *p);
/* Adds a reference to block b (sharing). */
void rf_kv_pool_ref(rf_kv_pool *p, int b);
/* Drops a reference; the block returns to the free list at zero. */
void rf_kv_pool_unref(rf_kv_pool *p, int b);
/* Copies the first n_rows positions of block src into block dst, every layer, K and V. */
void rf_kv_pool_copy(rf_kv_pool *p, int dst, int src, int n_rows);
/* Blocks currently referenced. */
int rf_kv_pool_used(const rf_kv_pool *p);
/* Blocks needed for n_pos positions. */
int rf_kv_pool_blocks_for(const rf_kv_pool *p, int n_pos);

/* One sequence of a paged decode call: its block table must cover n_cached + n_new positions,
 * and the blocks receiving the new positions must not be shared (the caller's job). */
typedef struct rf_paged_seq {
    const int *blocks; /* (>= ceil((n_cached + n_new) / block_size)) host block table */
    int n_cached;      /* positions already in the cache */
    int n_new;         /* new tokens in this call, at positions n_cached .. */
} rf_paged_seq;

/* Runs the new tokens of n sequences through the model (tokens packed in sequence order),
 * writing their keys/values into the pool, and writes the logits of each sequence's last new
 * token to logits (n, V) on the host (logits NULL: left in the back end's memory for
 * rf_model_draw, model/model.h). The pool's bookkeeping is not touched: the caller owns
 * block tables and cached lengths. Implemented in model/model_paged.c (it runs the model's
 * layers); declared here because its argument is the pool. Errors: RF_ERR_RANGE for token ids
 * outside the vocabulary, positions past the model's limit or block tables that do not cover
 * the positions; RF_ERR_ARG for a sequence without new tokens. */
rf_status rf_model_decode_paged(rf_model *m, rf_kv_pool *pool, const rf_paged_seq *seqs, int n,
                                const int32_t *tokens, float *logits);

#endif
