/* FlashAttention-2's tiling on the CPU, loop for loop the CUDA kernels of
 * kernels/cuda/cuda_flash.cu (see kernels/flash_ref.h). A test reference, not a fast path: the
 * CPU back end's attention stays kernels/cpu/cpu_attention.c.
 *
 * Forward (Algorithm 1): for each (sequence, head, tile of RF_FLASH_BR queries), visit the key
 * tiles of RF_FLASH_BC keys in ascending order up to the last key the tile's last query sees;
 * per query row keep the running max m, the running sum l of exp(score - m) and the
 * unnormalised output acc; at each tile m' = max(m, tile max), acc and l are rescaled by
 * exp(m - m'), then the tile's exp(score - m') are added; every RF_FLASH_CHUNK keys the
 * state so far is merged into the chunks' merged state and starts afresh. out = acc / l,
 * lse = m + log l of the merged state.
 * Backward (Algorithm 2, in its deterministic form): P = exp(scale q.k - lse) recomputed from
 * the saved lse, Di = dout_i . out_i (dout rounded at bf16 as the tiles load it); a dk/dv pass
 * per (sequence, KV head, key tile) over the group's heads and the query tiles that see the tile, then a dq pass per (sequence, head,
 * query tile) over the key tiles it sees. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/flash_ref.h"

#define BR RF_FLASH_BR
#define BC RF_FLASH_BC
#define MD RF_FLASH_MAX_D

static float dotf(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* tile (n, D) = rows of src (row stride `stride`), rounded to bf16 when asked. */
static void load_tile(float tile[][MD], const float *src, size_t stride, int n, int D, int bf16) {
    for (int r = 0; r < n; r++)
        for (int d = 0; d < D; d++) {
            float x = src[(size_t)r * stride + d];
            tile[r][d] = bf16 ? rf_round_bf16(x) : x;
        }
}

/* The running state of one query row across key tiles. */
typedef struct {
    float m, l, acc[MD];
} row_state;

static void state_init(row_state *st, int D) {
    st->m = -INFINITY, st->l = 0.0f;
    memset(st->acc, 0, sizeof(float) * (size_t)D);
}

/* t = the state of t's keys then c's (an empty state adds nothing; into an empty one, a copy):
 * the CUDA kernels' merge_state. */
static void state_merge(row_state *t, const row_state *c, int D) {
    float m = fmaxf(t->m, c->m);
    if (m == -INFINITY) return;
    float ca = expf(t->m - m), cb = expf(c->m - m);
    t->l = fmaf(t->l, ca, c->l * cb);
    for (int d = 0; d < D; d++) t->acc[d] = fmaf(t->acc[d], ca, c->acc[d] * cb);
    t->m = m;
}

/* One key tile (keys j0 .. j0 + nc - 1) into one query row that sees keys 0 .. lim. */
static void online_update(row_state *st, const float *qr, float K[][MD], float V[][MD], int j0,
                          int nc, int lim, int D, float scale, int mode) {
    float sc[BC], mt = -INFINITY;
    for (int c = 0; c < BC; c++) {
        sc[c] = c < nc && j0 + c <= lim ? scale * dotf(qr, K[c], D) : -INFINITY;
        mt = fmaxf(mt, sc[c]);
    }
    float m_new = fmaxf(st->m, mt);
    if (m_new == -INFINITY) return; /* no key of this tile (nor before) is visible */
    float corr = expf(st->m - m_new), sum = 0.0f; /* corr = 0 at the first visible tile */
    for (int c = 0; c < BC; c++) sc[c] = expf(sc[c] - m_new), sum += sc[c];
    st->l = st->l * corr + sum;
    for (int d = 0; d < D; d++) st->acc[d] *= corr;
    for (int c = 0; c < nc; c++) {
        float p = mode == RF_FLASH_BF16_MMA ? rf_round_bf16(sc[c]) : sc[c];
        for (int d = 0; d < D; d++) st->acc[d] += p * V[c][d];
    }
    st->m = m_new;
}

/* Query rows i0 .. i0 + nr - 1 of one sequence and head. kb, vb: the sequence's first key row
 * of the head's KV head; off = k_len - q_len (bottom-right causal alignment). */
static void forward_tile(float *out, float *lse, const float *q, const float *kb,
                         const float *vb, int i0, int nr, int klen, int off, int H, int KVH,
                         int D, int bf16) {
    static __thread float Q[BR][MD], K[BC][MD], V[BC][MD];
    static __thread row_state st[BR], tot[BR]; /* the running chunk's state, the merged ones' */
    float scale = 1.0f / sqrtf((float)D);
    load_tile(Q, q, (size_t)H * D, nr, D, bf16);
    for (int r = 0; r < nr; r++) state_init(&st[r], D), state_init(&tot[r], D);
    int nkeys = i0 + nr + off; /* keys seen by the tile's last row */
    if (nkeys > klen) nkeys = klen;
    for (int j0 = 0; j0 < nkeys; j0 += BC) {
        if (j0 > 0 && j0 % RF_FLASH_CHUNK == 0)
            for (int r = 0; r < nr; r++) { /* a chunk ends: merge it, start the next */
                state_merge(&tot[r], &st[r], D);
                state_init(&st[r], D);
            }
        int nc = klen - j0 < BC ? klen - j0 : BC;
        load_tile(K, kb + (size_t)j0 * KVH * D, (size_t)KVH * D, nc, D, bf16);
        load_tile(V, vb + (size_t)j0 * KVH * D, (size_t)KVH * D, nc, D, bf16);
        for (int r = 0; r < nr; r++)
            online_update(&st[r], Q[r], K, V, j0, nc, i0 + r + off, D, scale, bf16);
    }
    for (int r = 0; r < nr; r++) {
        state_merge(&tot[r], &st[r], D);
        float inv = tot[r].l > 0.0f ? 1.0f / tot[r].l : 0.0f;
        for (int d = 0; d < D; d++) out[(size_t)r * H * D + d] = tot[r].acc[d] * inv;
        if (lse) lse[(size_t)r * H] = tot[r].l > 0.0f ? tot[r].m + logf(tot[r].l) : -INFINITY;
    }
}

void rf_flash_ref_forward(float *out, float *lse, const float *q, const float *k,
                          const float *v, const int32_t *q_off, const int32_t *k_start,
                          const int32_t *k_len, int n_seq, int H, int KVH, int D, int bf16) {
    int group = H / KVH;
    for (int s = 0; s < n_seq; s++) {
        int qlen = q_off[s + 1] - q_off[s], off = k_len[s] - qlen;
        for (int h = 0; h < H; h++) {
            size_t kv0 = ((size_t)k_start[s] * KVH + h / group) * D;
            for (int i0 = 0; i0 < qlen; i0 += BR) {
                size_t row = (size_t)(q_off[s] + i0) * H + h;
                forward_tile(out + row * D, lse ? lse + row : NULL, q + row * D, k + kv0,
                             v + kv0, i0, qlen - i0 < BR ? qlen - i0 : BR, k_len[s], off, H,
                             KVH, D, bf16);
            }
        }
    }
}

/* ---- backward ---- */

/* Di = dout_i . out_i with dout as the tiles load it (rounded at bf16), out as saved (fp32). */
static float row_di(const float *dout, const float *out, int D, int bf16) {
    float s = 0.0f;
    for (int d = 0; d < D; d++) s += (bf16 ? rf_round_bf16(dout[d]) : dout[d]) * out[d];
    return s;
}

/* One (query i, key j) pair of the backward: p, and ds = p (dout_i.v_j - Di) scale. */
static void pair_grads(const float *qi, const float *doi, const float *kj, const float *vj,
                       float lse, float di, int D, float scale, float *p, float *ds) {
    *p = expf(scale * dotf(qi, kj, D) - lse);
    *ds = *p * (dotf(doi, vj, D) - di) * scale;
}

/* dk, dv rows j0 .. j0 + nc - 1 of one sequence (rows off ..) and KV head: over the group's
 * heads in order, and for each the query tiles that see a key of the tile, in order. */
static void dkdv_tile(float *dk, float *dv, const float *dout, const float *q, const float *k,
                      const float *v, const float *lse, const float *di, int off, int L, int j0,
                      int nc, int H, int KVH, int kvh, int D, int bf16) {
    static __thread float K[BC][MD], V[BC][MD], Q[BR][MD], dO[BR][MD], dK[BC][MD], dV[BC][MD];
    int group = H / KVH;
    float scale = 1.0f / sqrtf((float)D);
    size_t ks = (size_t)KVH * D, qs = (size_t)H * D;
    load_tile(K, k + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, bf16);
    load_tile(V, v + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, bf16);
    memset(dK, 0, sizeof dK), memset(dV, 0, sizeof dV);
    for (int h = kvh * group; h < (kvh + 1) * group; h++) {
        for (int i0 = j0 / BR * BR; i0 < L; i0 += BR) {
            int nr = L - i0 < BR ? L - i0 : BR;
            size_t row0 = (size_t)(off + i0) * H + h;
            load_tile(Q, q + row0 * D, qs, nr, D, bf16);
            load_tile(dO, dout + row0 * D, qs, nr, D, bf16);
            for (int c = 0; c < nc; c++)
                for (int r = 0; r < nr; r++) {
                    if (j0 + c > i0 + r) continue; /* causal */
                    float p, ds;
                    pair_grads(Q[r], dO[r], K[c], V[c], lse[row0 + (size_t)r * H],
                               di[row0 + (size_t)r * H], D, scale, &p, &ds);
                    if (bf16 == RF_FLASH_BF16_MMA) p = rf_round_bf16(p), ds = rf_round_bf16(ds);
                    for (int d = 0; d < D; d++) dV[c][d] += p * dO[r][d], dK[c][d] += ds * Q[r][d];
                }
        }
    }
    for (int c = 0; c < nc; c++) {
        size_t row = ((size_t)(off + j0 + c) * KVH + kvh) * D;
        memcpy(dk + row, dK[c], sizeof(float) * (size_t)D);
        memcpy(dv + row, dV[c], sizeof(float) * (size_t)D);
    }
}

/* dq rows i0 .. i0 + nr - 1 of one sequence and head, over the key tiles they see, in order. */
static void dq_tile(float *dq, const float *dout, const float *q, const float *k, const float *v,
                    const float *lse, const float *di, int off, int i0, int nr, int H, int KVH,
                    int h, int D, int bf16) {
    static __thread float Q[BR][MD], dO[BR][MD], K[BC][MD], V[BC][MD], dQ[BR][MD];
    int kvh = h / (H / KVH);
    float scale = 1.0f / sqrtf((float)D);
    size_t ks = (size_t)KVH * D, qs = (size_t)H * D, row0 = (size_t)(off + i0) * H + h;
    load_tile(Q, q + row0 * D, qs, nr, D, bf16);
    load_tile(dO, dout + row0 * D, qs, nr, D, bf16);
    memset(dQ, 0, sizeof dQ);
    for (int j0 = 0; j0 < i0 + nr; j0 += BC) {
        int nc = i0 + nr - j0 < BC ? i0 + nr - j0 : BC;
        load_tile(K, k + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, bf16);
        load_tile(V, v + ((size_t)(off + j0) * KVH + kvh) * D, ks, nc, D, bf16);
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < nc; c++) {
                if (j0 + c > i0 + r) continue;
                float p, ds;
                pair_grads(Q[r], dO[r], K[c], V[c], lse[row0 + (size_t)r * H],
                           di[row0 + (size_t)r * H], D, scale, &p, &ds);
                if (bf16 == RF_FLASH_BF16_MMA) ds = rf_round_bf16(ds);
                for (int d = 0; d < D; d++) dQ[r][d] += ds * K[c][d];
            }
    }
    for (int r = 0; r < nr; r++)
        memcpy(dq + (row0 + (size_t)r * H) * D, dQ[r], sizeof(float) * (size_t)D);
}

void rf_flash_ref_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                           const float *k, const float *v, const float *out, const float *lse,
                           const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH, int D,
                           int bf16) {
    size_t rows = (size_t)cu_seqlens[n_seq] * H;
    float *di = malloc(sizeof(float) * (rows ? rows : 1)); /* (T, H): Di = dout . out */
    for (size_t r = 0; r < rows; r++) di[r] = row_di(dout + r * D, out + r * D, D, bf16);
    memset(dk, 0, sizeof(float) * (size_t)T * KVH * D);
    memset(dv, 0, sizeof(float) * (size_t)T * KVH * D);
    for (int s = 0; s < n_seq; s++) {
        int off = cu_seqlens[s], L = cu_seqlens[s + 1] - off;
        for (int kvh = 0; kvh < KVH; kvh++)
            for (int j0 = 0; j0 < L; j0 += BC)
                dkdv_tile(dk, dv, dout, q, k, v, lse, di, off, L, j0, L - j0 < BC ? L - j0 : BC,
                          H, KVH, kvh, D, bf16);
        for (int h = 0; h < H; h++)
            for (int i0 = 0; i0 < L; i0 += BR)
                dq_tile(dq, dout, q, k, v, lse, di, off, i0, L - i0 < BR ? L - i0 : BR, H, KVH,
                        h, D, bf16);
    }
    free(di);
}

static const float *pool_row(const float *pool, const int32_t *bt, int j, int block_size, int KVH,
                             int D, int kvh) {
    return pool + (((size_t)bt[j / block_size] * block_size + j % block_size) * KVH + kvh) * D;
}

/* ---- paged attention, tiled (the CUDA back end's default) ---- */

void rf_flash_ref_paged_forward(float *out, const float *q, const float *k_pool,
                                const float *v_pool, const int32_t *q_off,
                                const int32_t *block_table, int max_blocks,
                                const int32_t *k_len, int n_seq, int block_size, int H, int KVH,
                                int D, int bf16) {
    RF_ASSERT(D >= 1 && D <= MD);
    int group = H / KVH;
    for (int s = 0; s < n_seq; s++) {
        int qlen = q_off[s + 1] - q_off[s], klen = k_len[s], off = klen - qlen;
        const int32_t *bt = block_table + (size_t)s * max_blocks;
        size_t row_len = (size_t)KVH * D, n = (size_t)(klen > 0 ? klen : 1) * row_len;
        float *kb = malloc(sizeof(float) * n), *vb = malloc(sizeof(float) * n);
        RF_ASSERT(kb && vb);
        /* the sequence's keys gathered in order: what the CUDA kernel's tiles load */
        for (int j = 0; j < klen; j++) {
            memcpy(kb + j * row_len, pool_row(k_pool, bt, j, block_size, KVH, D, 0), sizeof(float) * row_len);
            memcpy(vb + j * row_len, pool_row(v_pool, bt, j, block_size, KVH, D, 0), sizeof(float) * row_len);
        }
        for (int h = 0; h < H; h++)
            for (int i0 = 0; i0 < qlen; i0 += BR) {
                size_t row = (size_t)(q_off[s] + i0) * H + h;
                forward_tile(out + row * D, NULL, q + row * D, kb + (size_t)(h / group) * D,
                             vb + (size_t)(h / group) * D, i0, qlen - i0 < BR ? qlen - i0 : BR,
                             klen, off, H, KVH, D, bf16);
            }
        free(kb), free(vb);
    }
}
