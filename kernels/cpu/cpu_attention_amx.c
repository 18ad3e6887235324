/* Attention's products on AMX's tiles, at precision bf16 (rf_cpu_attention_amx_forward and
 * _backward say when: cpu_internal.h).
 *
 * Backward (rf_cpu_attention_backward_amx): the algorithm of cpu_attention.c's backward
 * (FlashAttention-2: per (sequence, KV head) task, each head of the group and block of
 * RF_ATT_QB query rows i0..i0+n-1 over the keys 0..i0+n-1 it sees, the probabilities recomputed
 * from the saved log-sum-exp) with its five products on the tiles, bf16 operands and fp32 sums,
 * as the products of the linear layers are at bf16:
 *   S = Q K^T and dP = dO V^T (Q, K, V, dO rounded to bf16);
 *   P = exp(S scale - lse), dS = P (dP - rowdot(dO, O)) scale, in fp32 as before;
 *   dQ = dS K, dK^T += Q^T dS, dV^T += dO^T P (P and dS rounded to bf16).
 * dK and dV are summed transposed, (D, keys), over the group's heads and blocks in that order,
 * and added to dk and dv once a task. Operands are laid out once a task (K and V) or block (Q,
 * dO, P, dS) as the tiles read them: A row-major bf16, B as pairs (rf_cpu_amx_tile_gemm). Head
 * dims pad to 32 and key and query counts to 32 with zeros, which add nothing. Each task
 * writes its own rows of dk and dv (rows outside every sequence are zeroed).
 *
 * Why on the tiles: the fp32 backward ran its products as dnnl_sgemm calls of 64 x 256 x 64 at
 * 138 GFLOP/s on two AMX cores, 11 % of the 25m bf16 training step (docs/kernels.md).
 *
 * Forward (rf_cpu_attend_tasks_amx, under RLFLOW_CPU_ATTENTION=bf16): cpu_attention.c's tasks
 * and softmax with the scores and P V on the tiles, in passes of up to 32 (query, head) rows:
 * s_j = (Q K^T)_j scale over head dims in blocks of 32, P rounded to bf16 and P V over keys in
 * blocks of 32 from the first, keys a row does not see zero. A tile product computes each
 * output from its own row of A alone, so a row's bits do not depend on the rows beside it or on
 * how many keys past its own the task holds: training, prefill chunks and decoding, dense or
 * paged, agree bit for bit, as in fp32. Not the default: a decoding step lays out the whole
 * fp32 KV cache it reads in bf16 again (1.3x the fp32 forward's time over 300 cached keys). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif

#include "common/status.h"
#include "kernels/cpu/cpu_internal.h"

/* RLFLOW_CPU_ATTENTION (read once; rf_cpu_attention_mode sets it for tests): -1 not read yet,
 * else an rf_cpu_att_mode, or RF_CPU_ATT_BAD for another value. */
enum { RF_CPU_ATT_BAD = 3 };
static int g_mode = -1;

static int mode(void) {
    int v = __atomic_load_n(&g_mode, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *e = getenv("RLFLOW_CPU_ATTENTION");
        v = !e || !*e || strcmp(e, "auto") == 0 ? RF_CPU_ATT_AUTO
            : strcmp(e, "bf16") == 0            ? RF_CPU_ATT_BF16
            : strcmp(e, "fp32") == 0            ? RF_CPU_ATT_FP32
                                                : RF_CPU_ATT_BAD;
        __atomic_store_n(&g_mode, v, __ATOMIC_RELAXED);
    }
    return v;
}

int rf_cpu_attention_mode(int m) {
    int old = mode();
    __atomic_store_n(&g_mode, m, __ATOMIC_RELAXED);
    return old;
}

rf_status rf_cpu_attention_env_check(void) {
    if (mode() == RF_CPU_ATT_BAD)
        return rf_error(RF_ERR_ARG, "RLFLOW_CPU_ATTENTION=\"%s\": expected auto, bf16 or fp32",
                        getenv("RLFLOW_CPU_ATTENTION"));
    return RF_OK;
}

static int tiles_here(void) {
    return rf_cpu_gemm_get_precision() == RF_PRECISION_BF16 && rf_cpu_isa_amx() && rf_cpu_amx_ready();
}

int rf_cpu_attention_amx_forward(void) { return mode() == RF_CPU_ATT_BF16 && tiles_here(); }

int rf_cpu_attention_amx_backward(int D) {
    int m = mode();
    return (m == RF_CPU_ATT_BF16 || (m == RF_CPU_ATT_AUTO && D >= RF_CPU_ATT_AUTO_MIN_D)) && tiles_here();
}

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))

#define AMX_T __attribute__((target("avx512f,avx512bw,avx512vl")))

/* 512-bit vectors for the compiled loops (the exponential's: no bit depends on the width);
 * GCC's tuning for Intel's AVX-512 CPUs prefers 256. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

/* 16 floats rounded to bf16 as rf_cpu_bf16_convert rounds them (nearest, ties to even; a NaN
 * quieted), each in the low half of its 32-bit lane. */
static inline AMX_T __m512i bf16_lanes(__m512 x) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(hi, one))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

/* d[j] = (bf16 of b[j]) << 16 | bf16 of a[j] for j < n (b NULL: zeros), 0 for j in [n, npad):
 * rows a and b of a B operand as the tiles read pairs of its rows. */
static AMX_T void pair_rows(uint32_t *d, const float *a, const float *b, int n, int npad) {
    for (int j = 0; j < npad; j += 16) {
        int m = n - j;
        __mmask16 k = m >= 16 ? 0xffff : m > 0 ? (__mmask16)((1u << m) - 1) : 0;
        __m512i lo = bf16_lanes(_mm512_maskz_loadu_ps(k, a + j));
        __m512i hi = b ? bf16_lanes(_mm512_maskz_loadu_ps(k, b + j)) : _mm512_setzero_si512();
        __m512i p = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        if (npad - j >= 16) _mm512_storeu_si512(d + j, p);
        else _mm512_mask_storeu_epi32(d + j, (__mmask16)((1u << (npad - j)) - 1), p);
    }
}

/* d[0, npad) = a[0, n) rounded to bf16, zeros after (a NULL: all zeros). */
static AMX_T void bf16_row(uint16_t *d, const float *a, int n, int npad) {
    if (!a) {
        memset(d, 0, sizeof(uint16_t) * (size_t)npad);
        return;
    }
    for (int j = 0; j < npad; j += 16) {
        int m = n - j;
        __mmask16 k = m >= 16 ? 0xffff : m > 0 ? (__mmask16)((1u << m) - 1) : 0;
        __m256i h = _mm512_cvtepi32_epi16(bf16_lanes(_mm512_maskz_loadu_ps(k, a + j)));
        if (npad - j >= 16) _mm256_storeu_si256((__m256i *)(d + j), h);
        else _mm256_mask_storeu_epi16(d + j, (__mmask16)((1u << (npad - j)) - 1), h);
    }
}

/* Rows 2p and 2p + 1 of P (p0, p1) and of dS (d0, d1), n values each (a multiple of 16), as the
 * products read them: dS's rows in bf16 (ds0, ds1: dQ's A) and both as pairs of rows (pv, dsv:
 * the B of dV^T and dK^T). */
static AMX_T void block_operands(uint16_t *ds0, uint16_t *ds1, uint32_t *pv, uint32_t *dsv, const float *p0,
                                 const float *p1, const float *d0, const float *d1, int n) {
    for (int j = 0; j < n; j += 16) {
        __m512i a = bf16_lanes(_mm512_loadu_ps(d0 + j)), b = bf16_lanes(_mm512_loadu_ps(d1 + j));
        _mm256_storeu_si256((__m256i *)(ds0 + j), _mm512_cvtepi32_epi16(a));
        _mm256_storeu_si256((__m256i *)(ds1 + j), _mm512_cvtepi32_epi16(b));
        _mm512_storeu_si512(dsv + j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        a = bf16_lanes(_mm512_loadu_ps(p0 + j)), b = bf16_lanes(_mm512_loadu_ps(p1 + j));
        _mm512_storeu_si512(pv + j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
}

static inline int imin(int a, int b) { return a < b ? a : b; }

/* Per-thread buffers of a backward task (sizes in the comments: Dp head dims, Lp keys). */
typedef struct amx_bwd_buf {
    uint16_t *kb, *vb;        /* K, V rows in bf16 (Lp, Dp) */
    uint32_t *kt, *vt, *kv;   /* K^T, V^T as pairs of head dims (Dp / 2, Lp); K as pairs of keys (Lp / 2, Dp) */
    float *dkt, *dvt, *tmp;   /* dK^T, dV^T (Dp, Lp); a transposed copy (Lp, Dp) */
    float *S, *dP, *dqs;      /* (QB, Lp) x 2; dQ (QB, Dp) */
    uint16_t *dsb, *qb, *dob; /* dS (QB, Lp); Q and dO rows (QB, Dp) */
    uint32_t *pv, *dsv;       /* P, dS as pairs of queries (QB / 2, Lp) */
    uint32_t *qv, *dov;       /* Q, dO as pairs of queries (QB / 2, Dp) */
    uint32_t *qt, *dot;       /* their transposes: Q^T, dO^T (Dp, QB) bf16 */
    const float **rows;       /* row pointers (max(Lp, Dp)) */
    void *mem;
} amx_bwd_buf;

static int bwd_buf_alloc(amx_bwd_buf *b, int Lp, int Dp) {
    size_t L = (size_t)Lp, D = (size_t)Dp, QB = RF_ATT_QB;
    size_t sz[] = {2 * L * D, 2 * L * D, 2 * D * L, 2 * D * L, 2 * L * D, 4 * D * L, 4 * D * L, 4 * L * D,
                   4 * QB * L, 4 * QB * L, 4 * QB * D, 2 * QB * L, 2 * QB * D, 2 * QB * D,
                   2 * QB * L, 2 * QB * L, 2 * QB * D, 2 * QB * D, 2 * D * QB, 2 * D * QB,
                   sizeof(float *) * (L > D ? L : D)};
    enum { N = sizeof sz / sizeof sz[0] };
    void *p[N];
    if (!(b->mem = rf_cpu_carve(p, sz, N))) return 0;
    b->kb = p[0], b->vb = p[1], b->kt = p[2], b->vt = p[3], b->kv = p[4];
    b->dkt = p[5], b->dvt = p[6], b->tmp = p[7], b->S = p[8], b->dP = p[9], b->dqs = p[10];
    b->dsb = p[11], b->qb = p[12], b->dob = p[13], b->pv = p[14], b->dsv = p[15];
    b->qv = p[16], b->dov = p[17], b->qt = p[18], b->dot = p[19], b->rows = p[20];
    return 1;
}

/* x (n rows of D floats, row stride ld) as a B operand read transposed, (Dp / 2, Lp) pairs of
 * head dims: rows in bf16 into xb, then their 32-bit pairs transposed. */
static void pairs_of_dims(uint32_t *xt, uint16_t *xb, const float *x, size_t ld, int n, int Lp, int D, int Dp,
                          const float **rows) {
    for (int j = 0; j < n; j++) bf16_row(xb + (size_t)j * Dp, x + (size_t)j * ld, D, Dp);
    for (int j = 0; j < n; j++) rows[j] = (const float *)(xb + (size_t)j * Dp);
    rf_cpu_transpose32((float *)xt, Lp, rows, n, Lp, Dp / 2);
}

/* x (n rows of D floats, row stride ld) as pairs of rows (np / 2, Dp), and those transposed
 * into xt: x^T (Dp, np) in bf16, an A operand. */
static void rows_transposed(uint32_t *xt, uint32_t *xv, const float *x, size_t ld, int n, int np, int D,
                            int Dp, const float **rows) {
    for (int p = 0; p < np / 2; p++) {
        const float *a = 2 * p < n ? x + (size_t)(2 * p) * ld : NULL;
        const float *b = 2 * p + 1 < n ? x + (size_t)(2 * p + 1) * ld : NULL;
        if (a) pair_rows(xv + (size_t)p * Dp, a, b, D, Dp);
        else memset(xv + (size_t)p * Dp, 0, sizeof(uint32_t) * (size_t)Dp);
        rows[p] = (const float *)(xv + (size_t)p * Dp);
    }
    rf_cpu_transpose32((float *)xt, np / 2, rows, np / 2, np / 2, Dp);
}

static void prefetch_rows(const float *x, size_t ld, int n, int D) {
    for (int r = 0; r < n; r++)
        for (int c = 0; c < D * (int)sizeof(float); c += 64) __builtin_prefetch((const char *)(x + r * ld) + c);
}

static void backward_task(amx_bwd_buf *b, float *dq, float *dk, float *dv, const float *dout, const float *q,
                          const float *k, const float *v, const float *out, const float *lse, int off, int L,
                          int H, int KVH, int D, int kvh) {
    int group = H / KVH, Dp = (D + 31) & ~31, Lp = (L + 31) & ~31;
    size_t qs = (size_t)H * D, ks = (size_t)KVH * D;
    float scale = 1.0f / sqrtf((float)D);
    const float *K0 = k + (size_t)off * ks + (size_t)kvh * D, *V0 = v + (size_t)off * ks + (size_t)kvh * D;
    pairs_of_dims(b->kt, b->kb, K0, ks, L, Lp, D, Dp, b->rows);
    pairs_of_dims(b->vt, b->vb, V0, ks, L, Lp, D, Dp, b->rows);
    for (int p = 0; p < Lp / 2; p++) {
        const float *a = 2 * p < L ? K0 + (size_t)(2 * p) * ks : NULL;
        const float *c = 2 * p + 1 < L ? K0 + (size_t)(2 * p + 1) * ks : NULL;
        if (a) pair_rows(b->kv + (size_t)p * Dp, a, c, D, Dp);
        else memset(b->kv + (size_t)p * Dp, 0, sizeof(uint32_t) * (size_t)Dp);
    }
    memset(b->dkt, 0, sizeof(float) * (size_t)Dp * Lp);
    memset(b->dvt, 0, sizeof(float) * (size_t)Dp * Lp);
    for (int h = kvh * group; h < (kvh + 1) * group; h++)
        for (int i0 = 0; i0 < L; i0 += RF_ATT_QB) {
            int n = imin(RF_ATT_QB, L - i0), np = (n + 31) & ~31, nk = i0 + n, nkp = (nk + 31) & ~31;
            size_t r0 = (size_t)off + i0;
            const float *Q = q + r0 * qs + (size_t)h * D, *dO = dout + r0 * qs + (size_t)h * D;
            for (int r = 0; r < np; r++) {
                bf16_row(b->qb + (size_t)r * Dp, r < n ? Q + r * qs : NULL, D, Dp);
                bf16_row(b->dob + (size_t)r * Dp, r < n ? dO + r * qs : NULL, D, Dp);
            }
            /* O's rows, read below for rowdot(dO, O), and the next block's Q and dO rows: rows
             * H D floats apart, which the hardware's prefetchers do not follow */
            prefetch_rows(out + r0 * qs + (size_t)h * D, qs, n, D);
            int nh = i0 + RF_ATT_QB < L ? h : h + 1, ni = i0 + RF_ATT_QB < L ? i0 + RF_ATT_QB : 0;
            if (nh < (kvh + 1) * group) {
                size_t nr0 = (size_t)off + ni;
                prefetch_rows(q + nr0 * qs + (size_t)nh * D, qs, imin(RF_ATT_QB, L - ni), D);
                prefetch_rows(dout + nr0 * qs + (size_t)nh * D, qs, imin(RF_ATT_QB, L - ni), D);
            }
            rows_transposed(b->qt, b->qv, Q, qs, n, np, D, Dp, b->rows);
            rows_transposed(b->dot, b->dov, dO, qs, n, np, D, Dp, b->rows);
            rf_cpu_amx_tile_gemm(np, nkp, Dp, b->qb, Dp, b->kt, Lp, b->S, Lp, 0);
            rf_cpu_amx_tile_gemm(np, nkp, Dp, b->dob, Dp, b->vt, Lp, b->dP, Lp, 0);
            float Di[RF_ATT_QB];
            for (int r = 0; r < n; r++) {
                const float *o = out + (r0 + r) * qs + (size_t)h * D, *g = dO + r * qs;
                float t = 0.0f;
#pragma omp simd reduction(+ : t)
                for (int d = 0; d < D; d++) t += g[d] * o[d];
                Di[r] = t;
            }
            for (int r = 0; r < np; r++) {
                float *pr = b->S + (size_t)r * Lp, *dr = b->dP + (size_t)r * Lp;
                int vis = r < n ? i0 + r + 1 : 0;
                if (vis) {
                    float l = lse[(r0 + r) * H + h], di = Di[r];
#pragma omp simd
                    for (int j = 0; j < vis; j++) {
                        float p = rf_expf_fast(pr[j] * scale - l);
                        pr[j] = p;
                        dr[j] = p * (dr[j] - di) * scale;
                    }
                }
                for (int j = vis; j < nkp; j++) pr[j] = dr[j] = 0.0f;
            }
            for (int p = 0; p < np / 2; p++) {
                size_t a = (size_t)(2 * p) * Lp, c = a + Lp;
                block_operands(b->dsb + a, b->dsb + c, b->pv + (size_t)p * Lp, b->dsv + (size_t)p * Lp, b->S + a,
                               b->S + c, b->dP + a, b->dP + c, nkp);
            }
            float *dQ = dq + r0 * qs + (size_t)h * D;
            if (n == np && D == Dp) { /* whole tiles of rows and head dims: straight into dq */
                rf_cpu_amx_tile_gemm(np, Dp, nkp, b->dsb, Lp, b->kv, Dp, dQ, (int)qs, 0);
            } else {
                rf_cpu_amx_tile_gemm(np, Dp, nkp, b->dsb, Lp, b->kv, Dp, b->dqs, Dp, 0);
                for (int r = 0; r < n; r++) memcpy(dQ + r * qs, b->dqs + (size_t)r * Dp, sizeof(float) * D);
            }
            rf_cpu_amx_tile_gemm(Dp, nkp, np, (const uint16_t *)b->qt, np, b->dsv, Lp, b->dkt, Lp, 1);
            rf_cpu_amx_tile_gemm(Dp, nkp, np, (const uint16_t *)b->dot, np, b->pv, Lp, b->dvt, Lp, 1);
        }
    /* dK^T, dV^T (Dp, keys) transposed into the task's rows of dk, dv */
    for (int t = 0; t < 2; t++) {
        const float *src = t ? b->dvt : b->dkt;
        float *dst = (t ? dv : dk) + (size_t)off * ks + (size_t)kvh * D;
        for (int d = 0; d < Dp; d++) b->rows[d] = src + (size_t)d * Lp;
        if (D % 16 == 0) { /* straight into the rows, D values each */
            rf_cpu_transpose32(dst, (int)ks, b->rows, D, D, L);
            continue;
        }
        rf_cpu_transpose32(b->tmp, Dp, b->rows, Dp, Dp, L);
        for (int j = 0; j < L; j++) {
            const float *s = b->tmp + (size_t)j * Dp;
            float *o = dst + (size_t)j * ks;
            memcpy(o, s, sizeof(float) * D);
        }
    }
}

void rf_cpu_attention_backward_amx(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                   const float *k, const float *v, const float *out, const float *lse,
                                   const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH, int D) {
    int max_l = 1;
    for (int s = 0; s < n_seq; s++) {
        int L = cu_seqlens[s + 1] - cu_seqlens[s];
        max_l = L > max_l ? L : max_l;
    }
    /* rows outside the sequences (none where cu_seqlens spans [0, T)) */
    size_t first = (size_t)cu_seqlens[0] * KVH * D, end = (size_t)cu_seqlens[n_seq] * KVH * D;
    size_t all = (size_t)T * KVH * D;
    memset(dk, 0, sizeof(float) * first), memset(dv, 0, sizeof(float) * first);
    memset(dk + end, 0, sizeof(float) * (all - end)), memset(dv + end, 0, sizeof(float) * (all - end));
    int Lp = (max_l + 31) & ~31, Dp = (D + 31) & ~31;
#pragma omp parallel
    {
        amx_bwd_buf b;
        RF_ASSERT(bwd_buf_alloc(&b, Lp, Dp));
        rf_cpu_amx_tiles_begin();
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int s = 0; s < n_seq; s++)
            for (int kvh = 0; kvh < KVH; kvh++) {
                int L = cu_seqlens[s + 1] - cu_seqlens[s];
                if (L > 0) backward_task(&b, dq, dk, dv, dout, q, k, v, out, lse, cu_seqlens[s], L, H, KVH, D, kvh);
            }
        rf_cpu_amx_tiles_end();
        free(b.mem);
    }
}

/* ---- forward ---- */

enum { FR = 32 }; /* (query, head) rows a pass of the forward's products */

typedef struct amx_fwd_buf {
    float *kf;          /* the task's keys transposed, (D, Lp) floats */
    uint32_t *kt, *vv;  /* K^T as pairs of head dims (Dp / 2, Lp); V as pairs of keys (Lp / 2, Dp) */
    uint16_t *qb, *pb;  /* a pass's query rows (FR, Dp), probabilities (FR, Lp) in bf16 */
    float *S, *O;       /* scores (FR, Lp), outputs (FR, Dp) */
    const float **krow, **vrow, **rows; /* max_k each; max(Lp, Dp) */
    void *mem;
} amx_fwd_buf;

static int fwd_buf_alloc(amx_fwd_buf *b, int max_k, int Lp, int Dp) {
    size_t L = (size_t)Lp, D = (size_t)Dp, P = sizeof(float *);
    size_t sz[] = {4 * L * D, 2 * D * L, 2 * L * D, 2 * FR * D, 2 * FR * L, 4 * FR * L, 4 * FR * D,
                   P * (size_t)max_k, P * (size_t)max_k, P * (L > D ? L : D)};
    enum { N = sizeof sz / sizeof sz[0] };
    void *p[N];
    if (!(b->mem = rf_cpu_carve(p, sz, N))) return 0;
    b->kf = p[0], b->kt = p[1], b->vv = p[2], b->qb = p[3], b->pb = p[4], b->S = p[5], b->O = p[6];
    b->krow = p[7], b->vrow = p[8], b->rows = p[9];
    return 1;
}

/* Rows [r0, r0 + nr) of a task ((query, head) pairs, query-major: row r is query i0 + r / group
 * of head kvh * group + r % group), against the task's nk keys. Per row, whatever the others:
 * s_j = (Q K^T)_j scale, K in blocks of 32 head dims; m, p_j and l as the fp32 forward makes
 * them (rf_cpu_row_softmax); o = (P V) (1 / l), P in bf16 over keys in blocks of 32 from the
 * first, keys past the row's last and padding zero; lse = m + log l. S and pb have rows of Lp. */
static void forward_rows(amx_fwd_buf *b, const uint32_t *kt, const uint32_t *vv, int ldk, float *out, float *lse,
                         const float *q, int first, int i0, int off, int r0, int nr, int nk, int nkp, int group,
                         int kvh, int H, int D, int Dp, int Lp, float scale) {
    int row_of[FR], vis[FR], M = (nr + 15) & ~15; /* rows in the products: nr up to 16 */
    for (int r = 0; r < M; r++) {
        const float *src = NULL;
        if (r < nr) {
            int i = i0 + (r0 + r) / group, h = kvh * group + (r0 + r) % group;
            row_of[r] = (first + i) * H + h;
            vis[r] = imin(i + off + 1, nk);
            src = q + (size_t)row_of[r] * D;
        }
        bf16_row(b->qb + (size_t)r * Dp, src, D, Dp);
    }
    float m[FR], l[FR];
    rf_cpu_amx_tile_gemm(M, nkp, Dp, b->qb, Dp, kt, ldk, b->S, Lp, 0);
    for (int r = 0; r < M; r++) {
        float *sr = b->S + (size_t)r * Lp;
        int v = r < nr && vis[r] > 0 ? vis[r] : 0;
        float mr = -INFINITY;
        if (v > 0) {
#pragma omp simd reduction(max : mr)
            for (int j = 0; j < v; j++) {
                sr[j] *= scale;
                mr = sr[j] > mr ? sr[j] : mr;
            }
        }
        m[r] = mr;
        l[r] = v > 0 ? rf_cpu_row_softmax(sr, v, mr) : 0.0f;
        bf16_row(b->pb + (size_t)r * Lp, sr, v, nkp);
    }
    rf_cpu_amx_tile_gemm(M, Dp, nkp, b->pb, Lp, vv, Dp, b->O, Dp, 0);
    for (int r = 0; r < nr; r++) {
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f, *o = out + (size_t)row_of[r] * D;
        const float *a = b->O + (size_t)r * Dp;
        for (int d = 0; d < D; d++) o[d] = a[d] * inv;
        if (lse) lse[row_of[r]] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
    }
}

/* A (sequence, KV head)'s first nk keys as the forward's products read them: K^T as pairs of
 * head dims into kt (Dp / 2, ldk), V as pairs of keys into vv (nkp / 2, Dp); zeros past nk. */
static void task_keys(uint32_t *kt, uint32_t *vv, int ldk, amx_fwd_buf *b, rf_cpu_kv_rows rows, const void *ctx,
                      int s, int kvh, int nk, int D, int Dp) {
    int nkp = (nk + 31) & ~31;
    rows(b->krow, b->vrow, ctx, s, kvh, nk, D);
    /* K transposed as floats first (16 rows at a time: the rows are KVH D floats apart, or a
     * paged cache's blocks, and a row at a time waited on memory), then paired */
    if (nk > 0) rf_cpu_transpose32(b->kf, nkp, b->krow, nk, nkp, D);
    for (int p = 0; p < Dp / 2; p++) {
        uint32_t *d = kt + (size_t)p * ldk;
        if (2 * p < D) pair_rows(d, b->kf + (size_t)(2 * p) * nkp, 2 * p + 1 < D ? b->kf + (size_t)(2 * p + 1) * nkp : NULL, nkp, nkp);
        else memset(d, 0, sizeof(uint32_t) * (size_t)nkp);
    }
    /* V as pairs of its rows, fetched KEYS_AHEAD rows ahead (transposing it as K is, and
     * back, ran 1.3x slower on decoding's layout) */
    enum { KEYS_AHEAD = 8 };
    for (int j = 0; j < imin(KEYS_AHEAD, nk); j++) prefetch_rows(b->vrow[j], 0, 1, D);
    for (int p = 0; p < nkp / 2; p++) {
        for (int j = 2 * p + KEYS_AHEAD; j < imin(2 * p + KEYS_AHEAD + 2, nk); j++) prefetch_rows(b->vrow[j], 0, 1, D);
        const float *a = 2 * p < nk ? b->vrow[2 * p] : NULL, *c = 2 * p + 1 < nk ? b->vrow[2 * p + 1] : NULL;
        if (a) pair_rows(vv + (size_t)p * Dp, a, c, D, Dp);
        else memset(vv + (size_t)p * Dp, 0, sizeof(uint32_t) * (size_t)Dp);
    }
}

void rf_cpu_attend_tasks_amx(float *out, float *lse, const float *q, const int32_t *q_off,
                             const int32_t *k_len, const int32_t *tasks, int n_tasks, int max_k,
                             int H, int KVH, int D, rf_cpu_kv_rows rows, const void *ctx) {
    int group = H / KVH, Dp = (D + 31) & ~31, Lp = (max_k + 31) & ~31, n_seq = 0;
    float scale = 1.0f / sqrtf((float)D);
    /* The keys of a sequence with more than one block of queries are laid out once, before the
     * tasks, not by each of its blocks' tasks (a block sees the keys of the blocks before it). */
    for (int t = 0; t < n_tasks; t++) n_seq = tasks[3 * t] + 1 > n_seq ? tasks[3 * t] + 1 : n_seq;
    size_t *slot = malloc(sizeof(size_t) * ((size_t)n_seq + 1)), total = 0;
    RF_ASSERT(slot);
    for (int s = 0; s < n_seq; s++) {
        int many = q_off[s + 1] - q_off[s] > RF_ATT_QT && k_len[s] > 0;
        slot[s] = many ? total : (size_t)-1;
        if (many) total += (size_t)KVH * Dp * (((size_t)k_len[s] + 31) & ~(size_t)31); /* kt and vv: half each */
    }
    uint32_t *laid = total ? aligned_alloc(64, sizeof(uint32_t) * total) : NULL;
    RF_ASSERT(!total || laid);
#pragma omp parallel if (n_tasks > 1)
    {
        amx_fwd_buf b;
        RF_ASSERT(fwd_buf_alloc(&b, max_k, Lp, Dp));
        if (total) {
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int s = 0; s < n_seq; s++)
                for (int kvh = 0; kvh < KVH; kvh++) {
                    if (slot[s] == (size_t)-1) continue;
                    int Ls = (k_len[s] + 31) & ~31;
                    uint32_t *kt = laid + slot[s] + (size_t)kvh * Dp * Ls;
                    task_keys(kt, kt + (size_t)Dp / 2 * Ls, Ls, &b, rows, ctx, s, kvh, k_len[s], D, Dp);
                }
        }
        rf_cpu_amx_tiles_begin();
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n_tasks; t++) {
            int s, kvh, i0, off, nq, nk;
            rf_cpu_attn_task(tasks, t, q_off, k_len, &s, &kvh, &i0, &off, &nq, &nk);
            int nkp = (nk + 31) & ~31, ldk = Lp;
            const uint32_t *kt = b.kt, *vv = b.vv;
            if (slot[s] != (size_t)-1) {
                ldk = (k_len[s] + 31) & ~31;
                kt = laid + slot[s] + (size_t)kvh * Dp * ldk, vv = kt + (size_t)Dp / 2 * ldk;
            } else {
                task_keys(b.kt, b.vv, Lp, &b, rows, ctx, s, kvh, nk, D, Dp);
            }
            int nrows = nq * group;
            for (int r0 = 0; r0 < nrows; r0 += FR) {
                for (int r = r0 + FR; r < imin(r0 + 2 * FR, nrows); r++) /* the next pass's queries */
                    prefetch_rows(q + ((size_t)(q_off[s] + i0 + r / group) * H + kvh * group + r % group) * D, 0, 1, D);
                forward_rows(&b, kt, vv, ldk, out, lse, q, q_off[s], i0, off, r0, imin(FR, nrows - r0), nk, nkp,
                             group, kvh, H, D, Dp, Lp, scale);
            }
        }
        rf_cpu_amx_tiles_end();
        free(b.mem);
    }
    free(laid), free(slot);
}

#else /* no AMX intrinsics in this compiler: the tiles never run here (rf_cpu_amx_ready) */

void rf_cpu_attend_tasks_amx(float *out, float *lse, const float *q, const int32_t *q_off,
                             const int32_t *k_len, const int32_t *tasks, int n_tasks, int max_k,
                             int H, int KVH, int D, rf_cpu_kv_rows rows, const void *ctx) {
    (void)out, (void)lse, (void)q, (void)q_off, (void)k_len, (void)tasks, (void)n_tasks, (void)max_k;
    (void)H, (void)KVH, (void)D, (void)rows, (void)ctx;
    RF_ASSERT(!"attention on AMX without AMX");
}

void rf_cpu_attention_backward_amx(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                   const float *k, const float *v, const float *out, const float *lse,
                                   const int32_t *cu_seqlens, int n_seq, int T, int H, int KVH, int D) {
    (void)dq, (void)dk, (void)dv, (void)dout, (void)q, (void)k, (void)v, (void)out, (void)lse;
    (void)cu_seqlens, (void)n_seq, (void)T, (void)H, (void)KVH, (void)D;
    RF_ASSERT(!"attention on AMX without AMX");
}

#endif
