/* Causal GQA attention over packed variable-length sequences on the CPU.
 *
 * Plain loops with OpenMP: at the sequence lengths of RL post-training (hundreds to a few
 * thousand tokens) attention is a few percent of a layer's FLOPs, and the log-sum-exp saved by
 * the forward pass lets the backward pass recompute probabilities instead of storing the
 * (L, L) matrix per head (FlashAttention-2's recipe, Dao 2023). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
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

void rf_cpu_attention_forward(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *q_off, const int32_t *k_start,
                              const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    int Tq = q_off[n_seq], group = H / KVH, max_k = 0;
    float scale = 1.0f / sqrtf((float)D);
    for (int s = 0; s < n_seq; s++) max_k = k_len[s] > max_k ? k_len[s] : max_k;
#pragma omp parallel
    {
        float *sc = malloc(sizeof(float) * (size_t)(max_k > 0 ? max_k : 1));
#pragma omp for collapse(2) schedule(dynamic, 8)
        for (int t = 0; t < Tq; t++) {
            for (int h = 0; h < H; h++) {
                int s = seq_of_row(q_off, n_seq, t);
                int qlen = q_off[s + 1] - q_off[s], i = t - q_off[s];
                int nk = i + (k_len[s] - qlen) + 1; /* keys visible to this query */
                const float *qi = q + ((size_t)t * H + h) * D;
                const float *kb = k + ((size_t)k_start[s] * KVH + h / group) * D;
                const float *vb = v + ((size_t)k_start[s] * KVH + h / group) * D;
                float *o = out + ((size_t)t * H + h) * D;
                float m = -INFINITY;
                for (int j = 0; j < nk; j++) {
                    sc[j] = scale * dot(qi, kb + (size_t)j * KVH * D, D);
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
                    const float *vj = vb + (size_t)j * KVH * D;
                    float p = sc[j] * inv;
                    for (int d = 0; d < D; d++) o[d] += p * vj[d];
                }
                if (lse) lse[(size_t)t * H + h] = nk > 0 ? m + logf(sum) : -INFINITY;
            }
        }
        free(sc);
    }
}

/* Backward for one (sequence, KV head) pair: this task alone writes the dk/dv rows of that KV
 * head in that sequence, and the dq rows of the query heads that read it, so no atomics. */
static void attention_backward_task(float *dq, float *dk, float *dv, const float *dout,
                                    const float *q, const float *k, const float *v,
                                    const float *out, const float *lse, int off, int L, int H,
                                    int KVH, int D, int kvh) {
    int group = H / KVH;
    float scale = 1.0f / sqrtf((float)D);
    for (int j = 0; j < L; j++) {
        memset(dk + ((size_t)(off + j) * KVH + kvh) * D, 0, sizeof(float) * (size_t)D);
        memset(dv + ((size_t)(off + j) * KVH + kvh) * D, 0, sizeof(float) * (size_t)D);
    }
    for (int h = kvh * group; h < (kvh + 1) * group; h++) {
        for (int i = 0; i < L; i++) {
            size_t qi = ((size_t)(off + i) * H + h) * D;
            const float *do_i = dout + qi;
            float Di = dot(do_i, out + qi, D), l = lse[(size_t)(off + i) * H + h];
            float *dq_i = dq + qi;
            memset(dq_i, 0, sizeof(float) * (size_t)D);
            for (int j = 0; j <= i; j++) {
                size_t kj = ((size_t)(off + j) * KVH + kvh) * D;
                float p = expf(scale * dot(q + qi, k + kj, D) - l);
                float dp = dot(do_i, v + kj, D);
                float ds = p * (dp - Di) * scale;
                float *dk_j = dk + kj, *dv_j = dv + kj;
                const float *k_j = k + kj, *q_i = q + qi;
                for (int d = 0; d < D; d++) {
                    dv_j[d] += p * do_i[d];
                    dq_i[d] += ds * k_j[d];
                    dk_j[d] += ds * q_i[d];
                }
            }
        }
    }
}

void rf_cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                               int H, int KVH, int D) {
    (void)T;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int s = 0; s < n_seq; s++)
        for (int kvh = 0; kvh < KVH; kvh++)
            attention_backward_task(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens[s],
                                    cu_seqlens[s + 1] - cu_seqlens[s], H, KVH, D, kvh);
}
