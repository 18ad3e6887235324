/* Paged KV cache ops on the CPU: scatter of new key/value rows into pool slots, and causal GQA
 * attention whose keys/values are read through per-sequence block tables (the memory layout of
 * vLLM's PagedAttention, Kwon et al. 2023).
 *
 * The attention is the contiguous forward's (cpu_attention.c rf_cpu_attend_tasks): only the
 * address of key j changes, so a row's output is the bits attention_forward gives it, in
 * training or in a dense KV cache (tests/test_rollout.c and test_kernels check it), which is
 * what lets the rollout engine reproduce rf_generate token for token and give the trainer's
 * attention. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

void rf_cpu_paged_kv_write(float *k_pool, float *v_pool, const float *k, const float *v,
                           const int32_t *slots, int T, int KVH, int D) {
    size_t row = (size_t)KVH * D;
#pragma omp parallel for if ((size_t)T * row > RF_OMP_MIN_COPY)
    for (int t = 0; t < T; t++) {
        memcpy(k_pool + (size_t)slots[t] * row, k + (size_t)t * row, sizeof(float) * row);
        memcpy(v_pool + (size_t)slots[t] * row, v + (size_t)t * row, sizeof(float) * row);
    }
}

/* The paged layout: a sequence's block table over the k and v pools. */
typedef struct paged_kv {
    const float *k_pool, *v_pool;
    const int32_t *block_table;
    int max_blocks, block_size, KVH;
} paged_kv;

static void rows_paged(const float **krow, const float **vrow, const void *ctx, int s, int kvh,
                       int n, int D) {
    const paged_kv *c = ctx;
    const int32_t *bt = c->block_table + (size_t)s * c->max_blocks;
    for (int j = 0; j < n; j++) {
        size_t at = (((size_t)bt[j / c->block_size] * c->block_size + j % c->block_size) * c->KVH + kvh) * D;
        krow[j] = c->k_pool + at, vrow[j] = c->v_pool + at;
    }
}

void rf_cpu_paged_attention_forward(float *out, const float *q, const float *k_pool,
                                    const float *v_pool, const int32_t *q_off,
                                    const int32_t *block_table, int max_blocks,
                                    const int32_t *k_len, int n_seq, int block_size, int H,
                                    int KVH, int D) {
    int max_k = 1, n_tasks;
    for (int s = 0; s < n_seq; s++) max_k = k_len[s] > max_k ? k_len[s] : max_k;
    int32_t *tasks = rf_cpu_attn_tasks(q_off, n_seq, KVH, &n_tasks);
    RF_ASSERT(tasks);
    paged_kv kv = {k_pool, v_pool, block_table, max_blocks, block_size, KVH};
    if (n_tasks) rf_cpu_attend_tasks(out, NULL, q, q_off, k_len, tasks, n_tasks, max_k, H, KVH, D, rows_paged, &kv);
    free(tasks);
}
