/* Paged KV cache ops on the CPU: scatter of new key/value rows into pool slots, and causal GQA
 * attention whose keys/values are gathered through per-sequence block tables (the memory
 * layout of vLLM's PagedAttention, Kwon et al. 2023).
 *
 * The attention arithmetic is the contiguous forward's (cpu_attention.c) operation for
 * operation: the same two paths chosen the same way, the row path's dot products in the same
 * order, and the blocked path's products on keys and values gathered to the same dense
 * buffers (rf_cpu_attend_block). Only the address of key j changes, so on the same data a paged
 * forward gives bit-identical output to attention_forward (tests/test_rollout.c checks it),
 * which is what lets the rollout engine reproduce rf_generate token for token. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

/* Same reduction as cpu_attention.c's dot (kept identical for bit-identical results). */
static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void rf_cpu_paged_kv_write(float *k_pool, float *v_pool, const float *k, const float *v,
                           const int32_t *slots, int T, int KVH, int D) {
    size_t row = (size_t)KVH * D;
#pragma omp parallel for if ((size_t)T * row > RF_OMP_MIN_COPY)
    for (int t = 0; t < T; t++) {
        memcpy(k_pool + (size_t)slots[t] * row, k + (size_t)t * row, sizeof(float) * row);
        memcpy(v_pool + (size_t)slots[t] * row, v + (size_t)t * row, sizeof(float) * row);
    }
}

/* Index of the sequence that owns query row t (q_off is sorted). */
static int seq_of_row(const int32_t *q_off, int n_seq, int t) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (q_off[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Where key/value rows of one sequence and one KV head live in the pool. */
typedef struct paged_seq {
    const int32_t *blocks; /* (max_blocks) this sequence's block table */
    int block_size, row;   /* tokens per block; floats per pool row (KVH * D) */
    size_t head;           /* offset of the KV head inside a row (kvh * D) */
} paged_seq;

static inline size_t key_at(const paged_seq *ps, int j) {
    return ((size_t)ps->blocks[j / ps->block_size] * ps->block_size + j % ps->block_size) *
               ps->row + ps->head;
}

/* Attention of one query row against the first nk keys of a paged sequence; sc is nk scratch. */
static void attend_row_paged(float *o, const float *qi, const float *kp, const float *vp,
                             const paged_seq *ps, int nk, int D, float scale, float *sc) {
    float m = -INFINITY;
    for (int j = 0; j < nk; j++) {
        sc[j] = scale * dot(qi, kp + key_at(ps, j), D);
        m = sc[j] > m ? sc[j] : m;
    }
    float sum = 0.0f;
    for (int j = 0; j < nk; j++) {
        sc[j] = expf(sc[j] - m);
        sum += sc[j];
    }
    memset(o, 0, sizeof(float) * (size_t)D);
    float inv = nk > 0 ? 1.0f / sum : 0.0f;
    for (int j = 0; j < nk; j++) {
        const float *vj = vp + key_at(ps, j);
        float p = sc[j] * inv;
#pragma omp simd
        for (int d = 0; d < D; d++) o[d] += p * vj[d];
    }
}

/* The paged layout: a sequence's block table over the k and v pools. */
typedef struct paged_kv {
    const float *k_pool, *v_pool;
    const int32_t *block_table;
    int max_blocks, block_size, KVH;
} paged_kv;

static void gather_paged(float *dst, const void *ctx, int s, int kvh, int n, int v, int D) {
    const paged_kv *c = ctx;
    paged_seq ps = {c->block_table + (size_t)s * c->max_blocks, c->block_size, c->KVH * D, (size_t)kvh * D};
    const float *pool = v ? c->v_pool : c->k_pool;
    for (int j = 0; j < n; j++) memcpy(dst + (size_t)j * D, pool + key_at(&ps, j), sizeof(float) * (size_t)D);
}

void rf_cpu_paged_attention_forward(float *out, const float *q, const float *k_pool,
                                    const float *v_pool, const int32_t *q_off,
                                    const int32_t *block_table, int max_blocks,
                                    const int32_t *k_len, int n_seq, int block_size, int H,
                                    int KVH, int D) {
    int Tq = q_off[n_seq], group = H / KVH, max_k = 1, n_tasks, n_short;
    float scale = 1.0f / sqrtf((float)D);
    for (int s = 0; s < n_seq; s++) max_k = k_len[s] > max_k ? k_len[s] : max_k;
    int32_t *tasks = rf_cpu_attn_tasks(q_off, n_seq, H, &n_tasks, &n_short);
    RF_ASSERT(tasks);
    paged_kv kv = {k_pool, v_pool, block_table, max_blocks, block_size, KVH};
    if (n_tasks) rf_cpu_attend_blocks(out, NULL, q, q_off, k_len, tasks, n_tasks, max_k, H, KVH, D, gather_paged, &kv);
    free(tasks);
    if (!n_short) return;
#pragma omp parallel if ((size_t)Tq * H * max_k > 4096)
    {
        float *sc = malloc(sizeof(float) * (size_t)max_k);
#pragma omp for collapse(2) schedule(dynamic, 8)
        for (int t = 0; t < Tq; t++) {
            for (int h = 0; h < H; h++) {
                int s = seq_of_row(q_off, n_seq, t);
                int qlen = q_off[s + 1] - q_off[s], i = t - q_off[s];
                if (qlen >= RF_ATT_GEMM_MIN_Q) continue; /* done by blocks */
                int nk = i + (k_len[s] - qlen) + 1; /* keys visible to this query */
                paged_seq ps = {block_table + (size_t)s * max_blocks, block_size, KVH * D,
                                (size_t)(h / group) * D};
                attend_row_paged(out + ((size_t)t * H + h) * D, q + ((size_t)t * H + h) * D,
                                 k_pool, v_pool, &ps, nk, D, scale, sc);
            }
        }
        free(sc);
    }
}
