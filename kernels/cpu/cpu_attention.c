/* Causal GQA attention over packed variable-length sequences on the CPU.
 *
 * Forward: one algorithm for every query row, whatever else runs beside it (a training
 * sequence, a prefill chunk, one decoding step among many, keys read in place or through a
 * paged cache's block table), so a row's output and log-sum-exp are a function of its own
 * query and the keys and values it sees, bit for bit. That is what makes a token's log-prob the
 * same in generation and in training (the behaviour and the trainer's log-probs of the same
 * policy then differ by the log-softmax alone, not by attention). Per row i, over its visible
 * keys j < vis:
 *   s_j = (sum_d q_d k_jd) * scale, the sum a chain of fmaf from d = 0 up;
 *   m = max_j s_j; p_j = rf_expf_fast(s_j - m);
 *   l = sum_j p_j in 16 running partial sums (p_j into partial j mod 16, j ascending), then
 *       added in a fixed tree;
 *   o_d = (sum_j p_j v_jd, a chain of fmaf from j = 0 up) * (1 / l); lse = m + log l.
 * Each step is a correctly rounded fmaf, one product or one sum of values that do not depend on
 * the tiling, so the vector lanes, register tiles and threads that compute a row change no bit.
 * The work: tasks of (sequence, KV head, block of RF_ATT_QT queries) whose rows are the
 * (query, head) pairs of the KV head's group (GQA packing: the keys are read once for the
 * group), OpenMP over tasks; a task copies its keys transposed (D, keys; 16 x 16 blocks in
 * registers on AVX-512) so that a tile of RT = 8 rows x KT = 32 keys keeps its scores in
 * registers across d (each row's max taken as they are stored), and runs P V in tiles of PR = 4
 * rows x up to PW = 64 columns over the value rows. Where more than four such tiles read them (a
 * training or prefill task), the value rows are first copied side by side: in place they are a
 * KV row apart (1 KB in `small`), which the prefetchers did not follow, and P V waited on them
 * (1.15-1.25x the forward on an Ice Lake Xeon, docs/kernels.md); a decoding step's few rows read
 * them in place. Keys past a row's last, and
 * padding, never enter its sums. (Across builds the bits can differ: the exponential's
 * polynomial is contracted to fused multiply-adds where the target has them; within one build
 * every row agrees. A build for any x86-64 compiles this file once per x86-64 level,
 * cpu_level.h: its v3 and v4 copies give a CPU of that level the bits of a -march=native build;
 * the baseline's copy, for CPUs without FMA, rounds each product and each sum apart, ATT_FMA.)
 * Backward: per (sequence, KV head) task, for each head of the group and each block of
 * RF_ATT_QB query rows i0..i1-1 (which see keys 0..i1-1 only), the five products S = QK^T,
 * dP = dO V^T, dQ = dS K, dK += dS^T Q, dV += P^T dO on (block, i1) scratch, the
 * probabilities recomputed from the saved log-sum-exp (FlashAttention-2, Dao 2023): the key
 * columns a causal block cannot see are never computed, and the scratch stays O(block x L).
 * Each task alone writes its dk/dv rows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_level.h" /* compiled once per x86-64 level where the build is for any */

/* fmaf, but on x86 without FMA (the x86-64 baseline's copy, cpu_level.h: CPUs from before 2013,
 * or an emulator's), where fmaf is libm's software routine, which made the forward 50x slower:
 * there the product and the sum are rounded each, the same way for every row. */
#if defined(__FMA__) || !(defined(__x86_64__) || defined(__i386__))
#define ATT_FMA(a, b, c) fmaf(a, b, c)
#else
#define ATT_FMA(a, b, c) ((a) * (b) + (c))
#endif

#define RT 8  /* rows of a register tile */
#define KT 32 /* keys of a score tile; a task's transposed keys are padded to a multiple */

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline int imin(int a, int b) { return a < b ? a : b; }

/* The forward's register tiles are 512-bit: GCC's tuning for Intel's AVX-512 CPUs prefers 256-bit
 * vectors, with which a score tile (8 x 32 floats) needs all 32 registers and spilled to the
 * stack (prefill of 8 x 256 tokens on the AMX Xeon: attention 26 ms, 19-21 ms in 512 bits).
 * The forward's bits do not depend on the width (each value a chain of its own, the header);
 * the backward below keeps the default, as its row sums (dot) are split by vector lanes. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=512")
#define RF_ATT_WIDE 1
#endif

/* Scores of nr (1..RT) rows against keys [0, nkp) of the transposed keys kt (D, ldk):
 * S[r][j] = (fmaf chain over d of q[r D + d] kt[d][j]) * scale, and m[r] = the largest of row
 * r's first vis[r] scores. Inlined per nr so that the tile stays in registers; every nr gives
 * each score the same operations. */
static inline __attribute__((always_inline)) void scores_nr(float *S, int ldS, float *m, const int *vis,
                                                            const float *q, const float *kt, int ldk,
                                                            int nkp, int D, float scale, int nr) {
    for (int r = 0; r < nr; r++) m[r] = -INFINITY;
    for (int j0 = 0; j0 < nkp; j0 += KT) {
        float acc[RT][KT];
        for (int r = 0; r < nr; r++)
#pragma omp simd
            for (int c = 0; c < KT; c++) acc[r][c] = 0.0f;
        for (int d = 0; d < D; d++) {
            const float *kd = kt + (size_t)d * ldk + j0;
            for (int r = 0; r < nr; r++) {
                float qd = q[(size_t)r * D + d];
#pragma omp simd
                for (int c = 0; c < KT; c++) acc[r][c] = ATT_FMA(qd, kd[c], acc[r][c]);
            }
        }
        for (int r = 0; r < nr; r++) {
            float mr = m[r];
            int lim = vis[r] - j0;
#pragma omp simd reduction(max : mr)
            for (int c = 0; c < KT; c++) {
                float sv = acc[r][c] * scale, in = c < lim ? sv : -INFINITY;
                S[(size_t)r * ldS + j0 + c] = sv;
                mr = in > mr ? in : mr;
            }
            m[r] = mr;
        }
    }
}

static void scores(float *S, int ldS, float *m, const int *vis, const float *q, const float *kt,
                   int ldk, int nkp, int D, float scale, int nr) {
    switch (nr) {
#define RF_SCORES_CASE(NR) case NR: scores_nr(S, ldS, m, vis, q, kt, ldk, nkp, D, scale, NR); break;
        RF_SCORES_CASE(8) RF_SCORES_CASE(7) RF_SCORES_CASE(6) RF_SCORES_CASE(5)
        RF_SCORES_CASE(4) RF_SCORES_CASE(3) RF_SCORES_CASE(2) RF_SCORES_CASE(1)
#undef RF_SCORES_CASE
    }
}

/* Row softmax over its vis scores (s, overwritten by p_j = exp(s_j - m)), m their max; returns
 * l. Entries [vis, 16-rounded vis) are zeroed and summed (exact zeros). */
static float row_softmax(float *s, int vis, float m) {
    int n16 = (vis + 15) & ~15;
    /* p made block by block and added as it is made: sum partials in a register where there is
     * one (GCC kept an array of them in memory, each add waiting on the last store, and a second
     * loop read p back from the first one's masked stores: together a third of the forward on
     * the default recipe's rows of ~20 keys) */
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
#else
    float part[16] = {0};
#endif
    for (int j0 = 0; j0 < n16; j0 += 16) {
        float p[16];
#pragma omp simd
        for (int c = 0; c < 16; c++) p[c] = j0 + c < vis ? rf_expf_fast(s[j0 + c] - m) : 0.0f;
        memcpy(s + j0, p, sizeof p);
#ifdef __AVX512F__
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(p));
#else
        for (int c = 0; c < 16; c++) part[c] += p[c];
#endif
    }
    /* the partials added in a fixed tree: c += c + 8, then + 4, + 2, + 1 */
#ifdef __AVX512F__
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#else
    for (int w = 8; w >= 1; w /= 2)
        for (int c = 0; c < w; c++) part[c] += part[c + w];
    return part[0];
#endif
}

#define PR 4  /* rows of a P V tile */
#define PW 64 /* its widest columns (4 AVX-512 registers a row) */

/* acc[r][0, W) = sum_{j in [j0, j1)} p[r][j] v[j][d0 + .] as fmaf chains, for nr rows. */
static inline __attribute__((always_inline)) void pv_w(float acc[PR][PW], const float *P, int ldP,
                                                       const float *const *vrow, int d0, int j0,
                                                       int j1, int nr, int W) {
    float a[PR][PW]; /* local, so that it can live in registers */
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < W; c++) a[r][c] = acc[r][c];
    for (int j = j0; j < j1; j++) {
        const float *vj = vrow[j] + d0;
        for (int r = 0; r < nr; r++) {
            float p = P[(size_t)r * ldP + j];
#pragma omp simd
            for (int c = 0; c < W; c++) a[r][c] = ATT_FMA(p, vj[c], a[r][c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < W; c++) acc[r][c] = a[r][c];
}

static void pv(float acc[PR][PW], const float *P, int ldP, const float *const *vrow, int d0,
               int j0, int j1, int nr, int W) {
#define RF_PV_CASE(NR)                                                        \
    if (nr == NR) {                                                           \
        if (W == 64) pv_w(acc, P, ldP, vrow, d0, j0, j1, NR, 64);             \
        else if (W == 32) pv_w(acc, P, ldP, vrow, d0, j0, j1, NR, 32);        \
        else if (W == 16) pv_w(acc, P, ldP, vrow, d0, j0, j1, NR, 16);        \
        else pv_w(acc, P, ldP, vrow, d0, j0, j1, NR, W);                      \
        return;                                                               \
    }
    RF_PV_CASE(4)
    RF_PV_CASE(3)
    RF_PV_CASE(2)
    RF_PV_CASE(1)
#undef RF_PV_CASE
}

/* One tile of nr rows (queries q (nr, D) contiguous, head outputs o[r], lse[r] or NULL, keys
 * visible vis[r]) against keys kt (transposed, row stride ldk) and value rows vrow. S is (RT,
 * ldk) scratch. */
static void attend_tile(float *const *o, float *const *lse, const float *q,
                        const int *vis, int nr, const float *kt, int ldk,
                        const float *const *vrow, int D, float scale, float *S) {
    int vmax = 0;
    for (int r = 0; r < nr; r++) vmax = vis[r] > vmax ? vis[r] : vmax;
    float l[RT], m[RT];
    if (vmax > 0) scores(S, ldk, m, vis, q, kt, ldk, (vmax + KT - 1) / KT * KT, D, scale, nr);
    for (int r = 0; r < nr; r++) l[r] = vis[r] > 0 ? row_softmax(S + (size_t)r * ldk, vis[r], m[r]) : 0.0f;
    for (int r0 = 0; r0 < nr; r0 += PR) { /* P V by groups of PR rows */
        int n = imin(PR, nr - r0), lo = vis[r0];
        for (int r = r0; r < r0 + n; r++) lo = imin(lo, vis[r]);
        lo = lo > 0 ? lo : 0; /* keys every row of the group sees */
        for (int d0 = 0, W; d0 < D; d0 += W) {
            W = D - d0 >= 64 ? 64 : D - d0 >= 32 ? 32 : D - d0 >= 16 ? 16 : D - d0;
            float acc[PR][PW];
            for (int r = 0; r < n; r++)
                for (int c = 0; c < W; c++) acc[r][c] = 0.0f;
            pv(acc, S + (size_t)r0 * ldk, ldk, vrow, d0, 0, lo, n, W);
            for (int r = 0; r < n; r++) /* the rows that see more keys than that */
                if (vis[r0 + r] > lo) pv(acc + r, S + (size_t)(r0 + r) * ldk, ldk, vrow, d0, lo, vis[r0 + r], 1, W);
            for (int r = 0; r < n; r++) {
                float inv = l[r0 + r] > 0.0f ? 1.0f / l[r0 + r] : 0.0f;
                for (int c = 0; c < W; c++) o[r0 + r][d0 + c] = acc[r][c] * inv;
            }
        }
    }
    if (lse)
        for (int r = 0; r < nr; r++)
            if (lse[r]) *lse[r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
}

/* kt (D, ldk) = the first nk key rows (D floats each, at krow[j]) transposed, keys [nk, nkp)
 * zero. Copies only: any order gives the same bits. 16 x 16 blocks in registers on AVX-512. */
static void transpose_keys(float *kt, int ldk, const float *const *krow, int nk, int nkp, int D) {
    int j0 = 0, d16 = D & ~15;
#ifdef __AVX512F__
    for (; j0 + 16 <= nk; j0 += 16)
        for (int d0 = 0; d0 < d16; d0 += 16) {
            __m512 r[16], t[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(krow[j0 + j] + d0);
            for (int j = 0; j < 16; j += 2) { /* 32-bit interleave of row pairs */
                t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 16; j += 4) { /* 64-bit interleave of pair pairs */
                r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
                r[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
                r[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j + 1]), _mm512_castps_pd(t[j + 3])));
                r[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j + 1]), _mm512_castps_pd(t[j + 3])));
            }
            /* r[4 a + b] holds, in 128-bit lane c, element d0 + 4 c + b of rows j0 + 4 a .. + 3 */
            for (int b = 0; b < 4; b++) {
                __m512 lo01 = _mm512_shuffle_f32x4(r[b], r[4 + b], 0x44), hi01 = _mm512_shuffle_f32x4(r[b], r[4 + b], 0xee);
                __m512 lo23 = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], 0x44), hi23 = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], 0xee);
                /* element d0 + 4 c + b of rows j0 .. j0 + 15: lanes (a, c) picked from the four */
                t[0 + b] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);  /* c = 0 */
                t[4 + b] = _mm512_shuffle_f32x4(lo01, lo23, 0xdd);  /* c = 1 */
                t[8 + b] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);  /* c = 2 */
                t[12 + b] = _mm512_shuffle_f32x4(hi01, hi23, 0xdd); /* c = 3 */
            }
            for (int c = 0; c < 4; c++)
                for (int b = 0; b < 4; b++)
                    _mm512_storeu_ps(kt + (size_t)(d0 + 4 * c + b) * ldk + j0, t[4 * c + b]);
        }
    int jv = j0; /* the blocks done above cover d < d16 of keys < jv */
    for (int j = 0; j < jv; j++)
        for (int d = d16; d < D; d++) kt[(size_t)d * ldk + j] = krow[j][d];
#endif
    for (; j0 < nkp; j0 += 16)
        for (int d = 0; d < D; d++) {
            float *dst = kt + (size_t)d * ldk + j0;
            int j = 0;
            for (; j < 16 && j0 + j < nk; j++) dst[j] = krow[j0 + j][d];
            for (; j < 16; j++) dst[j] = 0.0f;
        }
    (void)d16;
}

float RF_LEVELED(rf_cpu_row_softmax)(float *s, int vis, float m) { return row_softmax(s, vis, m); }

void RF_LEVELED(rf_cpu_transpose32)(float *dst, int ldd, const float *const *rows, int n, int npad, int cols) {
    transpose_keys(dst, ldd, rows, n, npad, cols);
}

/* Asks for the queries of the next tile (n rows from task row r0) while this one computes: a
 * task's (query, head) rows are a few hundred bytes apart in q, which the hardware's prefetchers
 * do not follow, and copying them in cold took a fifth of the forward's time. */
static void prefetch_queries(const float *q, int first, int i0, int r0, int n, int group, int kvh,
                             int H, int D) {
    for (int r = r0; r < r0 + n; r++) {
        const char *row = (const char *)(q + ((size_t)(first + i0 + r / group) * H + kvh * group + r % group) * D);
        for (int b = 0; b < D * (int)sizeof(float); b += 64) __builtin_prefetch(row + b);
    }
}

#ifndef RF_CPU_LEVEL /* the tasks and the dense layout's entry point: in the baseline copy alone */
int32_t *rf_cpu_attn_tasks(const int32_t *q_off, int n_seq, int KVH, int *n_tasks) {
    int n = 0;
    for (int s = 0; s < n_seq; s++) n += KVH * ((q_off[s + 1] - q_off[s] + RF_ATT_QT - 1) / RF_ATT_QT);
    *n_tasks = n;
    int32_t *t = malloc(sizeof(int32_t) * 3 * (size_t)(n > 0 ? n : 1));
    if (!t) return NULL;
    n = 0;
    for (int s = 0; s < n_seq; s++) {
        int qlen = q_off[s + 1] - q_off[s];
        if (qlen <= 0) continue;
        for (int i0 = (qlen - 1) / RF_ATT_QT * RF_ATT_QT; i0 >= 0; i0 -= RF_ATT_QT) /* big first */
            for (int h = 0; h < KVH; h++) t[3 * n] = s, t[3 * n + 1] = h, t[3 * n + 2] = i0, n++;
    }
    return t;
}
#endif

void RF_LEVELED(rf_cpu_attend_tasks)(float *out, float *lse, const float *q, const int32_t *q_off,
                         const int32_t *k_len, const int32_t *tasks, int n_tasks, int max_k,
                         int H, int KVH, int D, rf_cpu_kv_rows rows, const void *ctx) {
    if (rf_cpu_attention_amx_forward()) { /* precision bf16 on AMX: the products on the tiles */
        rf_cpu_attend_tasks_amx(out, lse, q, q_off, k_len, tasks, n_tasks, max_k, H, KVH, D, rows, ctx);
        return;
    }
    int group = H / KVH, ldk = (max_k + KT - 1) / KT * KT;
    float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel if (n_tasks > 1)
    {
        /* per thread: keys transposed (D, ldk), a tile's scores (RT, ldk) and queries (RT, D),
         * key/value row pointers (max_k each); value rows side by side (max_k, D) when needed */
        float *kt = malloc(sizeof(float) * (((size_t)D + RT) * ldk + (size_t)RT * D));
        const float **krow = malloc(sizeof(float *) * 2 * (size_t)max_k);
        RF_ASSERT(kt && krow);
        float *S = kt + (size_t)D * ldk, *qt = S + (size_t)RT * ldk, *vc = NULL;
        const float **vrow = krow + max_k;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n_tasks; t++) {
            int s, kvh, i0, off, nq, nk;
            rf_cpu_attn_task(tasks, t, q_off, k_len, &s, &kvh, &i0, &off, &nq, &nk);
            int nkp = (nk + KT - 1) / KT * KT;
            rows(krow, vrow, ctx, s, kvh, nk, D);
            transpose_keys(kt, ldk, krow, nk, nkp, D);
            int nrows = nq * group; /* (query, head) pairs, query-major */
            if (nrows > 4 * PR) { /* value rows read by more than four P V tiles */
                if (!vc) {
                    vc = malloc(sizeof(float) * (size_t)max_k * D);
                    RF_ASSERT(vc);
                }
                for (int j = 0; j < nk; j++) {
                    memcpy(vc + (size_t)j * D, vrow[j], sizeof(float) * (size_t)D);
                    vrow[j] = vc + (size_t)j * D;
                }
            }
            for (int r0 = 0; r0 < nrows; r0 += RT) {
                int nr = imin(RT, nrows - r0), vis[RT];
                float *orow[RT], *lrow[RT];
                for (int r = 0; r < nr; r++) {
                    int i = i0 + (r0 + r) / group, h = kvh * group + (r0 + r) % group;
                    size_t row = (size_t)(q_off[s] + i) * H + h;
                    vis[r] = imin(i + off + 1, nk);
                    for (int d = 0; d < D; d++) qt[(size_t)r * D + d] = q[row * D + d];
                    orow[r] = out + row * D, lrow[r] = lse ? lse + row : NULL;
                }
                prefetch_queries(q, q_off[s], i0, r0 + RT, imin(RT, nrows - r0 - RT), group, kvh, H, D);
                attend_tile(orow, lse ? lrow : NULL, qt, vis, nr, kt, ldk, vrow, D, scale, S);
            }
        }
        free(kt), free((void *)krow), free(vc);
    }
}

#ifndef RF_CPU_LEVEL
/* The contiguous layout: rows k_start[s].. of k and v (KVH heads a row). */
typedef struct dense_kv {
    const float *k, *v;
    const int32_t *k_start;
    int KVH;
} dense_kv;

static void rows_dense(const float **krow, const float **vrow, const void *ctx, int s, int kvh,
                       int n, int D) {
    const dense_kv *c = ctx;
    size_t first = ((size_t)c->k_start[s] * c->KVH + kvh) * D, step = (size_t)c->KVH * D;
    for (int j = 0; j < n; j++) krow[j] = c->k + first + j * step, vrow[j] = c->v + first + j * step;
}

void rf_cpu_attention_forward(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *q_off, const int32_t *k_start,
                              const int32_t *k_len, int n_seq, int H, int KVH, int D) {
    int max_k = 1, n_tasks;
    for (int s = 0; s < n_seq; s++) max_k = k_len[s] > max_k ? k_len[s] : max_k;
    int32_t *tasks = rf_cpu_attn_tasks(q_off, n_seq, KVH, &n_tasks);
    RF_ASSERT(tasks);
    dense_kv kv = {k, v, k_start, KVH};
    if (n_tasks) rf_cpu_attend_tasks(out, lse, q, q_off, k_len, tasks, n_tasks, max_k, H, KVH, D, rows_dense, &kv);
    free(tasks);
}
#endif

#ifdef RF_ATT_WIDE
#pragma GCC pop_options
#endif

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
            pr[j] = rf_expf_fast(pr[j] - l);
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

void RF_LEVELED(rf_cpu_attention_backward)(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                               int H, int KVH, int D) {
    if (rf_cpu_attention_amx_backward(D)) { /* precision bf16 on AMX: the products on the tiles */
        rf_cpu_attention_backward_amx(dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens, n_seq, T, H, KVH, D);
        return;
    }
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
