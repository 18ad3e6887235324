/* Fused LM head + per-token log-prob and entropy of given tokens on the CPU.
 *
 * The logits of RF_LOGPROB_CHUNK tokens at a time are produced by one matrix product (rf_cpu_gemm) into a scratch
 * buffer of (chunk, V) floats, reduced to log-prob and entropy, and dropped: memory stays
 * O(chunk * V) whatever the batch, which is what makes 150k-token vocabularies affordable.
 *
 * Saved logits: where the whole (T, V) fits in LOGITS_SAVE_BYTES, the forward writes every
 * chunk's logits (and their log-sum-exp and entropy) to a kept buffer instead, and a backward
 * on the same inputs uses them rather than computing them again: the training step's forward
 * and backward of the LM head then cost two products of (T, V, C) instead of three. "The same
 * inputs": the same w pointer with no weights_updated since (the back end's contract for
 * parameter writes, kernels.h), the same bits in w at 1024 sampled places, the same h pointer
 * and bits (hashed in full), T, C, V, inv_temp and precision. The backward turns the saved
 * logits into gradients (in place, or into bf16 values beside them), so they serve one backward. Nothing is saved for an LM head
 * of bf16-resident weights (kernels.h bind_bf16): those belong to a frozen model, which has no
 * backward. rf_cpu_logprob_trim gives the kept buffers back (rf_model_trim).
 *
 * The backward's logit gradients, where the products take bf16 operands (rf_cpu_gemm_a16_direct),
 * are written only as bf16, a block of a row at a time from the caches: the values the products
 * would have rounded them to, without writing them in fp32 first and converting them again
 * (for the small config's 2048 x 16384, 128 MB written and 128 MB read less). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernel_math.h"

/* Logits of rows [t0, t0+n) into z (n, V), scaled by inv_temp; returns per-row lse and
 * entropy into lse_out/ent_out (n). */
static void chunk_logits(float *z, float *lse_out, float *ent_out, const float *h,
                         const float *w, int t0, int n, int C, int V, float inv_temp) {
    rf_cpu_gemm(0, 1, n, V, C, inv_temp, h + (size_t)t0 * C,
                C, w, C, 0.0f, z, V, 1);
#pragma omp parallel for if (n * (size_t)V > 65536)
    for (int r = 0; r < n; r++) lse_out[r] = rf_row_lse(z + (size_t)r * V, V, 1.0f, &ent_out[r]);
}

int rf_cpu_logprob_chunk_rows(int V) {
    int r = (8 << 20) / (V > 0 ? V : 1);
    return r < 16 ? 16 : r > RF_LOGPROB_CHUNK ? RF_LOGPROB_CHUNK : r;
}

/* A kept buffer *p of at least `bytes`, grown when short: allocating a fresh multi-megabyte
 * buffer per call costs page faults on every step. The buffers are products' operands and
 * outputs: on whole lines (rf_cpu_alloc_lines). NULL when out of memory. */
static void *grow(void **p, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        free(*p);
        *p = rf_cpu_alloc_lines(bytes);
        *cap = *p ? bytes : 0;
    }
    return *p;
}

float *rf_cpu_logprob_scratch(size_t n) {
    static void *buf;
    static size_t cap;
    return grow(&buf, &cap, n * sizeof(float));
}

/* The LM head's size (V x C) from which a forward with kept logits makes them in one product
 * whatever the CPU (rf_cpu_logprob_forward), and from which an fp32 backward makes dw by columns
 * (fp32_dw): 4 MB in fp32, beyond a core's L2. */
#define LOGPROB_WHOLE_MIN ((size_t)1 << 20)

/* Kept scratch of the backward (rf_cpu_logprob_trim gives it back): the bf16 gradients of a
 * chunk's logits, rows rounded up to 64 (rf_cpu_gemm_a16's room); fp32_dw's columns. */
static void *g_dz16, *g_dwt;
static size_t g_dz16_cap, g_dwt_cap; /* bytes */

/* Columns of logits per product of fp32_dw. */
#define DW_COLS 4096

/* dw (V, C) += dz^T (V, n) @ h (n, C) in fp32 as (dw^T)[:, v0 : v0 + 4096] = h^T dz[:, v0 : ...],
 * added to dw's rows: oneDNN runs an fp32 product of a transposed A (dz^T) on its gemm:jit
 * kernel, 175 GFLOP/s on `small`'s 16384-long head where these run at 240 (docs/kernels.md). The
 * same sums over the tokens in another order. 0 when out of memory (nothing done). */
static int fp32_dw(float *dw, const float *dz, const float *h, int n, int C, int V) {
    float *t = grow(&g_dwt, &g_dwt_cap, sizeof(float) * (size_t)C * DW_COLS);
    if (!t) return 0;
    for (int v0 = 0; v0 < V; v0 += DW_COLS) {
        int nb = V - v0 < DW_COLS ? V - v0 : DW_COLS;
        rf_cpu_gemm(1, 0, C, nb, n, 1.0f, h, C, dz + v0, V, 0.0f, t, nb, 0);
        /* in tiles of 64 x 64: t's columns are 16 KB apart */
#pragma omp parallel for if ((size_t)nb * C > RF_OMP_MIN_COPY)
        for (int vb = 0; vb < nb; vb += 64)
            for (int cb = 0; cb < C; cb += 64)
                for (int v = vb; v < vb + 64 && v < nb; v++) {
                    float *d = dw + (size_t)(v0 + v) * C;
                    for (int c = cb; c < cb + 64 && c < C; c++) d[c] += t[(size_t)c * nb + v];
                }
    }
    return 1;
}

/* dh (n, C) = dz (n, V) @ w (V, C) and, where dw, dw (V, C) += dz^T @ h (n, C): from the bf16
 * dzb where given, else from dz. */
static void dproducts(float *dh, float *dw, const float *dz, const uint16_t *dzb, const float *h,
                      int n, int C, int V, const float *w) {
    if (dzb) {
        rf_cpu_gemm_a16(0, 0, n, C, V, 1.0f, dzb, V, w, C, 0.0f, dh, C, 1);
        if (dw) rf_cpu_gemm_a16(1, 0, V, C, n, 1.0f, dzb, V, h, C, 1.0f, dw, C, 0);
        return;
    }
    rf_cpu_gemm(0, 0, n, C, V, 1.0f, dz, V, w, C, 0.0f, dh, C, 1);
    /* a large head in fp32 (a small one, the default recipe's, keeps the product below and its bits) */
    if (dw && (size_t)V * C >= LOGPROB_WHOLE_MIN && rf_cpu_gemm_get_precision() == RF_PRECISION_FP32 &&
        fp32_dw(dw, dz, h, n, C, V))
        return;
    if (dw) /* dz as dh's product read it */
        rf_cpu_gemm_same_a(1, 0, V, C, n, 1.0f, dz, V, h, C, 1.0f, dw, C, 0);
}

void rf_cpu_logprob_chunk_backward(float *dh, float *dw, float *z, const float *h, const float *w,
                                   int n, int C, int V, const float *lse, const float *ent,
                                   const int32_t *targets, int v0, const float *dlogp,
                                   const float *dentropy, float inv_temp) {
    /* bf16 gradients only where the products read them in place */
    uint16_t *zb = rf_cpu_gemm_a16_direct()
                       ? grow(&g_dz16, &g_dz16_cap, sizeof(uint16_t) * (size_t)(n + 63) / 64 * 64 * V)
                       : NULL;
    rf_cpu_logprob_dlogits(z, zb, n, V, lse, ent, targets, v0, dlogp, dentropy, inv_temp);
    dproducts(dh, dw, z, zb, h, n, C, V, w);
}

/* Largest (T, V) logits the forward keeps for the backward (the small config's 2048 x 16384
 * is 128 MB, Qwen2.5-0.5B's 512 x 151936 is 311 MB). */
#define LOGITS_SAVE_BYTES ((size_t)512 << 20)

typedef struct saved_logits {
    float *z;      /* (T, V) logits as chunk_logits leaves them */
    float *lse, *ent; /* (T) */
    size_t cap;    /* floats in z */
    int valid, T, C, V;
    float inv_temp;
    rf_precision prec;
    const float *h, *w;
    unsigned epoch;
    uint64_t h_hash, w_hash;
} saved_logits;

static saved_logits g_saved;

/* Hash of the bits of x (n floats), or of `samples` of them spread evenly (0 = all). */
static uint64_t bits_hash(const float *x, size_t n, size_t samples) {
    uint64_t h[4] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull, 0xd6e8feb86659fd93ull};
    size_t step = samples && n > samples ? n / samples : 1;
    size_t i = 0;
    uint32_t u[4];
    for (; i + 3 * step < n; i += 4 * step) { /* four independent chains */
        for (int l = 0; l < 4; l++) memcpy(&u[l], x + i + (size_t)l * step, 4);
        for (int l = 0; l < 4; l++) h[l] = (h[l] ^ u[l]) * 0x100000001b3ull;
    }
    for (; i < n; i += step) {
        memcpy(&u[0], x + i, 4);
        h[0] = (h[0] ^ u[0]) * 0x100000001b3ull;
    }
    return h[0] ^ (h[1] << 1) ^ (h[2] << 2) ^ (h[3] << 3) ^ n;
}

/* What makes saved logits valid for (h, w, T, C, V, inv_temp); `valid` left 0. */
static saved_logits saved_key(const float *h, const float *w, int T, int C, int V, float inv_temp) {
    saved_logits k = {0};
    k.T = T, k.C = C, k.V = V, k.inv_temp = inv_temp, k.h = h, k.w = w;
    k.prec = rf_cpu_gemm_get_precision();
    k.epoch = rf_cpu_gemm_epoch();
    k.h_hash = bits_hash(h, (size_t)T * C, 0);
    const uint16_t *wb = rf_cpu_bf16_bound(w); /* bound: w's floats hold nothing, its bf16 do */
    k.w_hash = wb ? bits_hash((const float *)wb, (size_t)V * C / 2, 1024) : bits_hash(w, (size_t)V * C, 1024);
    return k;
}

static int same_key(const saved_logits *a, const saved_logits *b) {
    return a->T == b->T && a->C == b->C && a->V == b->V && a->inv_temp == b->inv_temp &&
           a->prec == b->prec && a->h == b->h && a->w == b->w && a->epoch == b->epoch &&
           a->h_hash == b->h_hash && a->w_hash == b->w_hash;
}

/* The buffer for the forward to save (T, V) logits in, or NULL where they are too large (or
 * memory is short): then the forward uses the chunk scratch and nothing is saved. */
static size_t g_lse_cap; /* floats in g_saved.lse */

static saved_logits *saved_reserve(int T, int V, const float *w) {
    size_t n = (size_t)T * V;
    g_saved.valid = 0;
    if (n * sizeof(float) > LOGITS_SAVE_BYTES || rf_cpu_bf16_bound(w)) return NULL;
    if (g_saved.cap < n) {
        free(g_saved.z);
        g_saved.z = rf_cpu_alloc_lines(n * sizeof(float));
        g_saved.cap = g_saved.z ? n : 0;
    }
    if (g_lse_cap < 2 * (size_t)T) {
        free(g_saved.lse);
        g_saved.lse = malloc(2 * sizeof(float) * (size_t)T);
        g_lse_cap = g_saved.lse ? 2 * (size_t)T : 0;
    }
    if (!g_saved.z || !g_saved.lse) return NULL;
    g_saved.ent = g_saved.lse + T;
    return &g_saved;
}

void rf_cpu_logprob_trim(void) {
    free(g_dwt);
    g_dwt = NULL, g_dwt_cap = 0;
    free(g_dz16);
    g_dz16 = NULL, g_dz16_cap = 0;
    free(g_saved.z);
    free(g_saved.lse);
    g_saved = (saved_logits){0};
    g_lse_cap = 0;
}

size_t rf_cpu_logprob_kept_bytes(void) {
    return g_saved.cap * sizeof(float) + g_lse_cap * sizeof(float) + g_dz16_cap + g_dwt_cap;
}

void rf_cpu_logprob_forward(float *logp, float *entropy, const float *h, const float *w,
                            const int32_t *targets, int T, int C, int V, float inv_temp) {
    saved_logits *sv = saved_reserve(T, V, w);
    /* Logits kept whole: one product over every row, which reads the weight once (in chunks of
     * 55 rows, Qwen2.5-0.5B's 272 MB of bf16 weight was read ten times for 512 tokens). Where a
     * row's bits depend on the rows beside it (bf16 on AMX, AVX2), only for a weight beyond the
     * caches: a small one costs nothing to read again, and its runs keep their bits. */
    int whole = sv && (rf_cpu_batch_invariant_exact() || (size_t)V * C >= LOGPROB_WHOLE_MIN);
    int chunk = whole ? T : rf_cpu_logprob_chunk_rows(V);
    float *z = sv ? NULL : rf_cpu_logprob_scratch((size_t)chunk * V);
    float lse_s[RF_LOGPROB_CHUNK], ent_s[RF_LOGPROB_CHUNK];
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        float *zc = sv ? sv->z + (size_t)t0 * V : z, *lse = sv ? sv->lse + t0 : lse_s;
        float *ent = sv ? sv->ent + t0 : ent_s;
        chunk_logits(zc, lse, ent, h, w, t0, n, C, V, inv_temp);
        for (int r = 0; r < n; r++) {
            logp[t0 + r] = zc[(size_t)r * V + targets[t0 + r]] - lse[r];
            if (entropy) entropy[t0 + r] = ent[r];
        }
    }
    if (sv) {
        saved_logits k = saved_key(h, w, T, C, V, inv_temp);
        k.z = sv->z, k.lse = sv->lse, k.ent = sv->ent, k.cap = sv->cap, k.valid = 1;
        g_saved = k;
    }
}

void rf_cpu_logprob_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                             const float *h, const float *w, const int32_t *targets, int T,
                             int C, int V, float inv_temp) {
    int chunk = rf_cpu_logprob_chunk_rows(V);
    int saved = 0;
    if (g_saved.valid) {
        saved_logits k = saved_key(h, w, T, C, V, inv_temp);
        saved = same_key(&k, &g_saved);
        g_saved.valid = 0; /* turned into gradients below, or stale */
    }
    if (saved) chunk = T; /* one pass: the products at full size, dw accumulated once */
    float *zs = saved ? NULL : rf_cpu_logprob_scratch((size_t)chunk * V);
    float lse_s[RF_LOGPROB_CHUNK], ent_s[RF_LOGPROB_CHUNK];
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        float *z = saved ? g_saved.z + (size_t)t0 * V : zs, *lse = saved ? g_saved.lse + t0 : lse_s;
        float *ent = saved ? g_saved.ent + t0 : ent_s;
        if (!saved) chunk_logits(z, lse, ent, h, w, t0, n, C, V, inv_temp);
        rf_cpu_logprob_chunk_backward(dh + (size_t)t0 * C, dw, z, h + (size_t)t0 * C, w, n, C, V, lse, ent,
                                      targets + t0, 0, dlogp ? dlogp + t0 : NULL,
                                      dentropy ? dentropy + t0 : NULL, inv_temp);
    }
}
