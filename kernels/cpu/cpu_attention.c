/* Causal GQA attention over packed variable-length sequences on the CPU.
 *
 * Forward: plain loops with an exact softmax per query row (OpenMP over rows); it also serves
 * KV-cache decoding, where a query sees a cache of past keys. It saves the log-sum-exp of each
 * row so that the backward pass recomputes probabilities instead of storing them (the recipe
 * of FlashAttention-2, Dao 2023).
 * Backward: per (sequence, head) the five products S = QK^T, dP = dO V^T, dQ = dS K,
 * dK = dS^T Q, dV = P^T dO run as rf_cpu_gemm calls (single-threaded there: they run inside
 * the parallel region) on an (L, L) scratch, with OpenMP
 * over (sequence, KV head) tasks so that each task alone writes its dk/dv rows. */
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

void rf_cpu_attention_forward(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *q_off, const int32_t *k_start,
                              const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    int Tq = q_off[n_seq], group = H / KVH, max_k = 1;
    float scale = 1.0f / sqrtf((float)D);
    for (int s = 0; s < n_seq; s++) max_k = k_len[s] > max_k ? k_len[s] : max_k;
#pragma omp parallel if ((size_t)Tq * H * max_k > 4096)
    {
        float *sc = malloc(sizeof(float) * (size_t)max_k);
#pragma omp for collapse(2) schedule(dynamic, 8)
        for (int t = 0; t < Tq; t++) {
            for (int h = 0; h < H; h++) {
                int s = seq_of_row(q_off, n_seq, t);
                int qlen = q_off[s + 1] - q_off[s], i = t - q_off[s];
                int nk = i + (k_len[s] - qlen) + 1; /* keys visible to this query */
                size_t kv0 = ((size_t)k_start[s] * KVH + h / group) * D;
                attend_row(out + ((size_t)t * H + h) * D, lse ? lse + (size_t)t * H + h : NULL,
                           q + ((size_t)t * H + h) * D, k + kv0, v + kv0, nk, KVH * D, D, scale, sc);
            }
        }
        free(sc);
    }
}

/* Backward of one head h over one sequence (rows off .. off+L-1). P and dS are (L, L)
 * scratch. dq rows are overwritten; dk/dv rows accumulate (zeroed by the caller). */
static void head_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                          const float *k, const float *v, const float *out, const float *lse,
                          int off, int L, int H, int KVH, int D, int h, float *P, float *dS) {
    int kvh = h / (H / KVH), qs = H * D, ks = KVH * D;
    float scale = 1.0f / sqrtf((float)D);
    const float *Q = q + (size_t)off * qs + (size_t)h * D, *dO = dout + (size_t)off * qs + (size_t)h * D;
    const float *K = k + (size_t)off * ks + (size_t)kvh * D, *Vv = v + (size_t)off * ks + (size_t)kvh * D;
    /* P = softmax rows from saved lse; dS = dO V^T first, then P * (dS - rowdot(dO, O)). */
    rf_cpu_gemm(0, 1, L, L, D, scale, Q, qs, K, ks, 0.0f, P, L, 0);
    rf_cpu_gemm(0, 1, L, L, D, 1.0f, dO, qs, Vv, ks, 0.0f, dS, L, 0);
    for (int i = 0; i < L; i++) {
        float l = lse[(size_t)(off + i) * H + h];
        float Di = dot(dO + (size_t)i * qs, out + (size_t)(off + i) * qs + (size_t)h * D, D);
        float *pr = P + (size_t)i * L, *dr = dS + (size_t)i * L;
        for (int j = 0; j <= i; j++) {
            pr[j] = expf(pr[j] - l);
            dr[j] = pr[j] * (dr[j] - Di) * scale;
        }
        for (int j = i + 1; j < L; j++) pr[j] = dr[j] = 0.0f;
    }
    float *dQ = dq + (size_t)off * qs + (size_t)h * D;
    float *dK = dk + (size_t)off * ks + (size_t)kvh * D, *dV = dv + (size_t)off * ks + (size_t)kvh * D;
    rf_cpu_gemm(0, 0, L, D, L, 1.0f, dS, L, K, ks, 0.0f, dQ, qs, 0);
    rf_cpu_gemm(1, 0, L, D, L, 1.0f, dS, L, Q, qs, 1.0f, dK, ks, 0);
    rf_cpu_gemm(1, 0, L, D, L, 1.0f, P, L, dO, qs, 1.0f, dV, ks, 0);
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
        float *P = malloc(sizeof(float) * 2 * (size_t)max_l * max_l), *dS = P + (size_t)max_l * max_l;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int s = 0; s < n_seq; s++)
            for (int kvh = 0; kvh < KVH; kvh++)
                for (int h = kvh * group; h < (kvh + 1) * group; h++)
                    head_backward(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens[s],
                                  cu_seqlens[s + 1] - cu_seqlens[s], H, KVH, D, h, P, dS);
        free(P);
    }
}
