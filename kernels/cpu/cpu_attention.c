/* Causal GQA attention over packed variable-length sequences on the CPU.
 *
 * Forward, two paths chosen per sequence by its number of query rows:
 *  - rows (fewer than RF_ATT_GEMM_MIN_Q queries: decoding, short chunks): plain loops with an
 *    exact softmax per query row, OpenMP over (row, head);
 *  - blocks (prefill, training): per (sequence, head, block of RF_ATT_QB query rows), the keys
 *    and values the block sees are copied to dense (nk, D) buffers and two products run on the
 *    thread (rf_cpu_gemm_local): S = scale Q K^T, then the exact softmax of each row over its
 *    visible keys (the others zeroed), then O = P V. The copy makes the products' operands the
 *    same bytes in the same layout whether the keys come from here or from a paged cache
 *    (cpu_paged.c runs the same blocks), so both give the same bits.
 * Both save the log-sum-exp of each row so that the backward pass recomputes probabilities
 * instead of storing them (the recipe of FlashAttention-2, Dao 2023).
 * Backward: per (sequence, KV head) task, for each head of the group and each block of query
 * rows i0..i1-1 (which see keys 0..i1-1 only), the five products S = QK^T, dP = dO V^T,
 * dQ = dS K, dK += dS^T Q, dV += P^T dO on (block, i1) scratch: the key columns a causal block
 * cannot see are never computed, and the scratch stays O(block x L). Each task alone writes its
 * dk/dv rows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
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

/* Attention of one query row against nk keys (row stride ks floats); sc is nk scratch. */
static void attend_row(float *o, float *lse, const float *qi, const float *kb, const float *vb,
                       int nk, int ks, int D, float scale, float *sc) {
    float m = -INFINITY;
    for (int j = 0; j < nk; j++) {
        sc[j] = scale * dot(qi, kb + (size_t)j * ks, D);
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
        const float *vj = vb + (size_t)j * ks;
        float p = sc[j] * inv;
#pragma omp simd
        for (int d = 0; d < D; d++) o[d] += p * vj[d];
    }
    if (lse) *lse = nk > 0 ? m + logf(sum) : -INFINITY;
}

int32_t *rf_cpu_attn_tasks(const int32_t *q_off, int n_seq, int H, int *n_tasks, int *n_short) {
    int n = 0, shorts = 0;
    for (int s = 0; s < n_seq; s++) {
        int qlen = q_off[s + 1] - q_off[s];
        if (qlen >= RF_ATT_GEMM_MIN_Q) n += H * ((qlen + RF_ATT_QB - 1) / RF_ATT_QB);
        else shorts += qlen > 0;
    }
    *n_tasks = n, *n_short = shorts;
    int32_t *t = malloc(sizeof(int32_t) * 3 * (size_t)(n > 0 ? n : 1));
    if (!t) return NULL;
    n = 0;
    for (int s = 0; s < n_seq; s++) {
        int qlen = q_off[s + 1] - q_off[s];
        if (qlen < RF_ATT_GEMM_MIN_Q) continue;
        for (int i0 = (qlen - 1) / RF_ATT_QB * RF_ATT_QB; i0 >= 0; i0 -= RF_ATT_QB) /* big first */
            for (int h = 0; h < H; h++) t[3 * n] = s, t[3 * n + 1] = h, t[3 * n + 2] = i0, n++;
    }
    return t;
}

void rf_cpu_attend_block(float *o, int os, float *lse, int ls, const float *q, int qs,
                         const float *kb, const float *vb, int n, int i0, int off, int D,
                         float *S) {
    int nk = i0 + n + off; /* keys the block's last row sees */
    float scale = 1.0f / sqrtf((float)D);
    rf_cpu_gemm_local(0, 1, n, nk, D, scale, q, qs, kb, D, 0.0f, S, nk);
    for (int r = 0; r < n; r++) {
        float *sr = S + (size_t)r * nk, m = -INFINITY, sum = 0.0f;
        int vis = i0 + r + off + 1; /* keys this row sees */
#pragma omp simd reduction(max : m)
        for (int j = 0; j < vis; j++) m = sr[j] > m ? sr[j] : m;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < vis; j++) {
            sr[j] = rf_cpu_expf(sr[j] - m);
            sum += sr[j];
        }
        float inv = 1.0f / sum;
#pragma omp simd
        for (int j = 0; j < vis; j++) sr[j] *= inv;
        for (int j = vis; j < nk; j++) sr[j] = 0.0f;
        if (lse) lse[(size_t)r * ls] = m + logf(sum);
    }
    rf_cpu_gemm_local(0, 0, n, D, nk, 1.0f, S, nk, vb, D, 0.0f, o, os);
}

void rf_cpu_attend_blocks(float *out, float *lse, const float *q, const int32_t *q_off, const int32_t *k_len,
                          const int32_t *tasks, int n_tasks, int max_k, int H, int KVH, int D,
                          rf_cpu_kv_gather gather, const void *ctx) {
    int group = H / KVH;
#pragma omp parallel
    {
        float *S = malloc(sizeof(float) * ((size_t)RF_ATT_QB + 2 * (size_t)D) * max_k);
        RF_ASSERT(S); /* (64 + 2 D, max_k) floats per thread */
        float *kb = S + (size_t)RF_ATT_QB * max_k, *vb = kb + (size_t)D * max_k;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n_tasks; t++) {
            int s = tasks[3 * t], h = tasks[3 * t + 1], i0 = tasks[3 * t + 2];
            int qlen = q_off[s + 1] - q_off[s], off = k_len[s] - qlen;
            int n = qlen - i0 < RF_ATT_QB ? qlen - i0 : RF_ATT_QB, nk = i0 + n + off;
            size_t row = (size_t)q_off[s] + i0;
            gather(kb, ctx, s, h / group, nk, 0, D);
            gather(vb, ctx, s, h / group, nk, 1, D);
            rf_cpu_attend_block(out + (row * H + h) * D, H * D, lse ? lse + row * H + h : NULL, H,
                                q + (row * H + h) * D, H * D, kb, vb, n, i0, off, D, S);
        }
        free(S);
    }
}

/* The contiguous layout: rows k_start[s].. of k and v (KVH heads a row). */
typedef struct dense_kv {
    const float *k, *v;
    const int32_t *k_start;
    int KVH;
} dense_kv;

static void gather_dense(float *dst, const void *ctx, int s, int kvh, int n, int v, int D) {
    const dense_kv *c = ctx;
    const float *src = (v ? c->v : c->k) + ((size_t)c->k_start[s] * c->KVH + kvh) * D;
    for (int j = 0; j < n; j++) memcpy(dst + (size_t)j * D, src + (size_t)j * c->KVH * D, sizeof(float) * (size_t)D);
}

void rf_cpu_attention_forward(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *q_off, const int32_t *k_start,
                              const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    int Tq = q_off[n_seq], group = H / KVH, max_k = 1, n_tasks, n_short;
    float scale = 1.0f / sqrtf((float)D);
    for (int s = 0; s < n_seq; s++) max_k = k_len[s] > max_k ? k_len[s] : max_k;
    int32_t *tasks = rf_cpu_attn_tasks(q_off, n_seq, H, &n_tasks, &n_short);
    RF_ASSERT(tasks);
    dense_kv kv = {k, v, k_start, KVH};
    if (n_tasks) rf_cpu_attend_blocks(out, lse, q, q_off, k_len, tasks, n_tasks, max_k, H, KVH, D, gather_dense, &kv);
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
                size_t kv0 = ((size_t)k_start[s] * KVH + h / group) * D;
                attend_row(out + ((size_t)t * H + h) * D, lse ? lse + (size_t)t * H + h : NULL,
                           q + ((size_t)t * H + h) * D, k + kv0, v + kv0, nk, KVH * D, D, scale, sc);
            }
        }
        free(sc);
    }
}

/* Backward of query rows i0..i0+n-1 of head h over one sequence starting at row off; those rows
 * see keys 0..i0+n-1. P and dS are (n, i0+n) scratch. dq rows are overwritten; dk/dv rows
 * accumulate (zeroed by the caller). */
static void block_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                           const float *k, const float *v, const float *out, const float *lse,
                           int off, int i0, int n, int H, int KVH, int D, int h, float *P, float *dS) {
    int kvh = h / (H / KVH), qs = H * D, ks = KVH * D, nk = i0 + n;
    float scale = 1.0f / sqrtf((float)D);
    size_t r0 = (size_t)off + i0;
    const float *Q = q + r0 * qs + (size_t)h * D, *dO = dout + r0 * qs + (size_t)h * D;
    const float *K = k + (size_t)off * ks + (size_t)kvh * D, *Vv = v + (size_t)off * ks + (size_t)kvh * D;
    /* P = softmax rows from saved lse; dS = dO V^T first, then P * (dS - rowdot(dO, O)). */
    rf_cpu_gemm_local(0, 1, n, nk, D, scale, Q, qs, K, ks, 0.0f, P, nk);
    rf_cpu_gemm_local(0, 1, n, nk, D, 1.0f, dO, qs, Vv, ks, 0.0f, dS, nk);
    for (int r = 0; r < n; r++) {
        float l = lse[(r0 + r) * H + h];
        float Di = dot(dO + (size_t)r * qs, out + (r0 + r) * qs + (size_t)h * D, D);
        float *pr = P + (size_t)r * nk, *dr = dS + (size_t)r * nk;
        int vis = i0 + r + 1;
#pragma omp simd
        for (int j = 0; j < vis; j++) {
            pr[j] = rf_cpu_expf(pr[j] - l);
            dr[j] = pr[j] * (dr[j] - Di) * scale;
        }
        for (int j = vis; j < nk; j++) pr[j] = dr[j] = 0.0f;
    }
    float *dQ = dq + r0 * qs + (size_t)h * D;
    float *dK = dk + (size_t)off * ks + (size_t)kvh * D, *dV = dv + (size_t)off * ks + (size_t)kvh * D;
    rf_cpu_gemm_local(0, 0, n, D, nk, 1.0f, dS, nk, K, ks, 0.0f, dQ, qs);
    rf_cpu_gemm_local(1, 0, nk, D, n, 1.0f, dS, nk, Q, qs, 1.0f, dK, ks);
    rf_cpu_gemm_local(1, 0, nk, D, n, 1.0f, P, nk, dO, qs, 1.0f, dV, ks);
}

void rf_cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                               int H, int KVH, int D) {
    int max_l = 1, group = H / KVH;
    for (int s = 0; s < n_seq; s++) {
        int L = cu_seqlens[s + 1] - cu_seqlens[s];
        max_l = L > max_l ? L : max_l;
    }
    memset(dk, 0, sizeof(float) * (size_t)T * KVH * D);
    memset(dv, 0, sizeof(float) * (size_t)T * KVH * D);
#pragma omp parallel
    {
        float *P = malloc(sizeof(float) * 2 * (size_t)RF_ATT_QB * max_l), *dS = P + (size_t)RF_ATT_QB * max_l;
        RF_ASSERT(P); /* two (64, L) floats per thread */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int s = 0; s < n_seq; s++)
            for (int kvh = 0; kvh < KVH; kvh++) {
                int L = cu_seqlens[s + 1] - cu_seqlens[s];
                for (int h = kvh * group; h < (kvh + 1) * group; h++)
                    for (int i0 = 0; i0 < L; i0 += RF_ATT_QB)
                        block_backward(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens[s], i0,
                                       L - i0 < RF_ATT_QB ? L - i0 : RF_ATT_QB, H, KVH, D, h, P, dS);
            }
        free(P);
    }
}
