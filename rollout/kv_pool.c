/* Block pool of the paged KV cache: device memory plus a host free list and reference counts. */
#include "rollout/kv_pool.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

rf_status rf_kv_pool_init(rf_kv_pool *p, const rf_model *m, int n_blocks, int block_size) {
    return rf_kv_pool_init_heads(p, m->k, m->cfg.num_hidden_layers, m->cfg.num_key_value_heads,
                                 m->cfg.head_dim, n_blocks, block_size);
}

rf_status rf_kv_pool_init_heads(rf_kv_pool *p, const rf_kernels *k, int n_layers, int KVH, int D,
                                int n_blocks, int block_size) {
    memset(p, 0, sizeof *p);
    if (n_blocks <= 0 || block_size <= 0)
        return rf_error(RF_ERR_ARG, "kv pool: n_blocks (%d) and block_size (%d) must be >= 1",
                        n_blocks, block_size);
    p->k = k;
    p->n_blocks = n_blocks, p->block_size = block_size;
    p->n_layers = n_layers, p->KVH = KVH, p->D = D;
    p->ref = calloc((size_t)n_blocks, sizeof(int));
    p->free_ids = malloc(sizeof(int) * (size_t)n_blocks);
    rf_status st = p->ref && p->free_ids ? rf_kv_pool_acquire(p)
                                         : rf_error(RF_ERR_NOMEM, "kv pool: out of host memory for %d blocks", n_blocks);
    if (st != RF_OK) {
        rf_kv_pool_free(p);
        return st;
    }
    for (int i = 0; i < n_blocks; i++) p->free_ids[i] = n_blocks - 1 - i; /* block 0 on top */
    p->n_free = n_blocks;
    return RF_OK;
}

/* Floats of k (or of v) in the pool. */
static size_t pool_floats(const rf_kv_pool *p) {
    return (size_t)p->n_layers * p->n_blocks * p->block_size * p->KVH * p->D;
}

rf_status rf_kv_pool_acquire(rf_kv_pool *p) {
    if (p->kc) return RF_OK;
    size_t n = pool_floats(p);
    p->kc = p->k->alloc(n * sizeof(float));
    p->vc = p->kc ? p->k->alloc(n * sizeof(float)) : NULL;
    if (p->vc) return RF_OK;
    p->k->free(p->kc);
    p->kc = NULL;
    return rf_error(RF_ERR_NOMEM, "kv pool: out of %s memory for %d blocks of %d positions (%zu MB)", p->k->name,
                    p->n_blocks, p->block_size, rf_kv_pool_bytes(p) >> 20);
}

rf_status rf_kv_pool_release(rf_kv_pool *p) {
    if (!p->kc) return RF_OK;
    if (p->n_free != p->n_blocks)
        return rf_error(RF_ERR_INTERNAL, "kv pool: releasing its memory while %d of its %d blocks are in use",
                        p->n_blocks - p->n_free, p->n_blocks);
    p->k->free(p->kc);
    p->k->free(p->vc);
    p->kc = p->vc = NULL;
    return RF_OK;
}

int rf_kv_pool_held(const rf_kv_pool *p) { return p->kc != NULL; }

size_t rf_kv_pool_bytes(const rf_kv_pool *p) { return 2 * pool_floats(p) * sizeof(float); }

int rf_kv_pool_fit(size_t block_bytes, size_t free_bytes, double fraction, int want, int least) {
    double fit = block_bytes ? floor(fraction * (double)free_bytes / (double)block_bytes) : (double)want;
    int n = fit >= want ? want : (int)fit;
    return n < least ? -1 : n;
}

void rf_kv_pool_free(rf_kv_pool *p) {
    if (!p) return;
    if (p->k) {
        p->k->free(p->kc);
        p->k->free(p->vc);
    }
    free(p->ref);
    free(p->free_ids);
    memset(p, 0, sizeof *p);
}

int rf_kv_pool_alloc(rf_kv_pool *p) {
    if (p->n_free == 0) return -1;
    int b = p->free_ids[--p->n_free];
    RF_ASSERT(p->ref[b] == 0);
    p->ref[b] = 1;
    int used = p->n_blocks - p->n_free;
    if (used > p->peak_used) p->peak_used = used;
    return b;
}

void rf_kv_pool_ref(rf_kv_pool *p, int b) {
    RF_ASSERT(b >= 0 && b < p->n_blocks && p->ref[b] > 0);
    p->ref[b]++;
}

void rf_kv_pool_unref(rf_kv_pool *p, int b) {
    RF_ASSERT(b >= 0 && b < p->n_blocks && p->ref[b] > 0);
    if (--p->ref[b] == 0) p->free_ids[p->n_free++] = b;
}

void rf_kv_pool_copy(rf_kv_pool *p, int dst, int src, int n_rows) {
    size_t row = (size_t)p->KVH * p->D, layer = (size_t)p->n_blocks * p->block_size * row;
    size_t bytes = (size_t)n_rows * row * sizeof(float);
    for (int l = 0; l < p->n_layers; l++) {
        size_t d = l * layer + (size_t)dst * p->block_size * row;
        size_t s = l * layer + (size_t)src * p->block_size * row;
        p->k->copy(p->kc + d, p->kc + s, bytes);
        p->k->copy(p->vc + d, p->vc + s, bytes);
    }
}

int rf_kv_pool_used(const rf_kv_pool *p) { return p->n_blocks - p->n_free; }

int rf_kv_pool_blocks_for(const rf_kv_pool *p, int n_pos) {
    return (n_pos + p->block_size - 1) / p->block_size;
}
