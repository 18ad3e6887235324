/* Every matrix product of the CPU back end, through oneDNN (Debian's libdnnl, C API).
 *
 * Why oneDNN and not OpenBLAS: oneDNN picks its kernels by the instruction set the CPU reports
 * (cpuid feature bits: AVX-512, AVX512-BF16, AMX), not by a table of CPU models, so a CPU newer
 * than the library still gets its fast kernels; Debian's OpenBLAS 0.3.21 falls back to generic
 * kernels on CPUs it does not name. It also has bf16 x bf16 -> fp32 products (docs/kernels.md).
 *
 * Two paths:
 *  - the primitive path (outside OpenMP parallel regions): a oneDNN matmul primitive per shape
 *    (transposes, M, N, K, leading dimensions, alpha, beta, precision), created on first use
 *    and kept in a small hash table; alpha is an output scale, beta = 1 a sum post-op.
 *  - the nested path (inside a parallel region): the thread-safe dnnl_sgemm, single-threaded
 *    there, with no shared state. Attention's per-head backward products call it directly
 *    (rf_cpu_gemm_local), fp32 at both precisions except where bf16 runs on AMX: there both
 *    of attention's passes run their products on the tiles (cpu_attention_amx.c).
 *
 * bf16 (rf_cpu_gemm_set_precision): operands are rounded to bf16 (round to nearest even) and
 * products accumulate in fp32. Activations are converted at each call; weights (the B operand
 * when the caller says so) once per update, kept until rf_cpu_gemm_weights_updated bumps the
 * epoch. Where oneDNN has no native bf16 matmul for the instruction set it runs on (checked
 * once by creating a probe primitive; ONEDNN_MAX_CPU_ISA=AVX2 for instance), operands are
 * rounded to bf16 values held in fp32 and fp32 products run: the same numbers, at fp32 speed.
 *
 * bf16-resident weights (rf_cpu_bind_bf16): a range of parameter addresses whose values live
 * only as bf16 elsewhere (a frozen model loaded from a bf16 checkpoint: rf_model_load_frozen).
 * A product whose B operand lies in such a range reads the bf16 data in place as its operand in
 * bf16 mode (no copy: rounding a bf16 value to bf16 is the identity, so the operands are the
 * bits the fp32 load's per-update copy would have), or an fp32 copy of it widened once per
 * epoch in fp32 or emulated mode (exact). The fp32 memory of a bound range is never read.
 *
 * Threads: Debian's libdnnl uses OpenMP (libgomp), the same pool as the rest of rlflow; it
 * runs single-threaded inside a parallel region. The primitive path holds a mutex for the
 * whole product, so two threads of one process never share the cached primitives at once. */
#include <dnnl.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

typedef struct gemm_key {
    int ta, tb, M, N, K, lda, ldb, ldc, dt; /* dt: 0 f32, 1 bf16 operands */
    int pack; /* B (a weight) in the layout the primitive chooses (its packed copy) */
    float alpha, beta;
} gemm_key;

typedef struct gemm_entry {
    gemm_key key;
    int used;
    unsigned gen; /* g_gen when last used */
    dnnl_primitive_t prim;
    dnnl_memory_t a, b, c, scratch; /* memory objects whose data handle is set per call */
    size_t scratch_bytes;
    dnnl_memory_desc_t wmd; /* pack: B's layout (blocked); no prim where oneDNN wants it plain */
} gemm_entry;

/* What a weight copy holds: the weight (rows, cols) dense in bf16 or as bf16-rounded floats
 * (emulated), or its transpose in the blocked layout a primitive chose, fp32 or bf16. */
enum { COPY_BF16, COPY_EMULATED, COPY_PACKED_F32, COPY_PACKED_BF16 };

/* A copy of weight src (stored (rows, cols), row stride ld), valid while epoch matches. */
typedef struct weight_copy {
    const float *src;
    int rows, cols, ld, kind;
    unsigned epoch;
    dnnl_memory_desc_t md; /* the packed kinds: the layout */
    void *data;
    size_t bytes;
} weight_copy;

/* A bound range: floats [base, base + n) are held as the bf16 values data (n). */
typedef struct bf16_bind {
    const float *base;
    const uint16_t *data;
    size_t n;
} bf16_bind;

/* A reorder primitive from a plain layout to a blocked one. */
typedef struct reorder_entry {
    dnnl_memory_desc_t from, to;
    dnnl_primitive_t prim;
    dnnl_memory_t src, dst;
} reorder_entry;

#define GEMM_SLOTS 1024 /* power of two; thinned when three-quarters full (entry_get) */
#define WEIGHT_SLOTS 1024 /* power of two: plain and packed copies of every weight in use */
#define REORDER_SLOTS 64
#define BIND_SLOTS 64

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t g_engine;
static dnnl_stream_t g_stream;
static int g_ready = -1; /* -1 not tried, 0 failed, 1 up */
static gemm_entry g_gemm[GEMM_SLOTS];
static int g_gemm_count;
static unsigned g_gen; /* times the table was thinned */
static weight_copy g_wcopy[WEIGHT_SLOTS];
static reorder_entry g_reorder[REORDER_SLOTS];
static int g_n_reorder;
static unsigned g_epoch = 1;
static rf_precision g_prec = RF_PRECISION_FP32;
static int g_bf16_native = -1; /* -1 not probed */
static void *g_scratch;
static size_t g_scratch_cap;
static bf16_bind g_bind[BIND_SLOTS];
static _Atomic int g_n_bind; /* bound ranges (written under g_lock): 0 lets a product skip the
                               lock and the lookup (training: nothing bound) */

/* ---- bf16 rounding ---- */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float bf16_round(float f) {
    uint32_t u = (uint32_t)f32_to_bf16(f) << 16;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

float rf_cpu_bf16_round(float x) { return bf16_round(x); }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* d[0, n) = s[0, n) as bf16 (f32_to_bf16). With AVX512-BF16, 16 at a time by the CPU's own
 * conversion, which rounds to nearest even and quiets NaNs as f32_to_bf16 does but flushes
 * denormal inputs to zero: those lanes are redone by f32_to_bf16 (the same bits for all 2^32
 * floats, checked when this was written; 1.6x the compiled loop on one core, which mattered
 * where K is small: the default recipe's products convert 64 columns for 64 outputs). */
static void convert_row(uint16_t *d, const float *s, int n) {
    int c = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const __m512i expo = _mm512_set1_epi32(0x7f800000), mant = _mm512_set1_epi32(0x007fffff);
    for (; c + 16 <= n; c += 16) {
        __m512 x = _mm512_loadu_ps(s + c);
        _mm256_storeu_si256((__m256i *)(d + c), (__m256i)_mm512_cvtneps_pbh(x));
        __m512i u = _mm512_castps_si512(x);
        __mmask16 den = _mm512_testn_epi32_mask(u, expo) & _mm512_test_epi32_mask(u, mant);
        while (den) {
            int l = __builtin_ctz(den);
            den &= den - 1;
            d[c + l] = f32_to_bf16(s[c + l]);
        }
    }
#endif
    for (; c < n; c++) d[c] = f32_to_bf16(s[c]);
}

void rf_cpu_bf16_convert(uint16_t *d, const float *s, int n) { convert_row(d, s, n); }

/* dst (rows, cols) dense = src (rows, cols; row stride ld) rounded to bf16: as uint16_t bf16
 * when emulated is 0, as fp32 values otherwise. OpenMP over rows when not nested. */
static void convert(void *dst, const float *src, int rows, int cols, int ld, int emulated) {
#pragma omp parallel for if ((size_t)rows * cols > RF_OMP_MIN_COPY && !omp_in_parallel())
    for (int r = 0; r < rows; r++) {
        const float *s = src + (size_t)r * ld;
        if (emulated) {
            float *d = (float *)dst + (size_t)r * cols;
            for (int c = 0; c < cols; c++) d[c] = bf16_round(s[c]);
        } else {
            convert_row((uint16_t *)dst + (size_t)r * cols, s, cols);
        }
    }
}

/* dst (rows, cols) dense fp32 = the bf16 values src (rows, cols; row stride ld), widened (exact). */
static void widen(float *dst, const uint16_t *src, int rows, int cols, int ld) {
#pragma omp parallel for if ((size_t)rows * cols > RF_OMP_MIN_COPY && !omp_in_parallel())
    for (int r = 0; r < rows; r++) {
        const uint16_t *s = src + (size_t)r * ld;
        float *d = dst + (size_t)r * cols;
        for (int c = 0; c < cols; c++) d[c] = bf16_to_f32(s[c]);
    }
}

/* ---- bound ranges ---- */

/* The bf16 value standing for the float at p, or NULL where p is in no bound range. Caller
 * holds g_lock. */
static const uint16_t *bind_find(const void *p) {
    for (int i = 0; i < BIND_SLOTS; i++) {
        const bf16_bind *b = &g_bind[i];
        if (b->base && (const float *)p >= b->base && (const float *)p < b->base + b->n)
            return b->data + ((const float *)p - b->base);
    }
    return NULL;
}

const uint16_t *rf_cpu_bf16_bound(const float *p) {
    if (!atomic_load_explicit(&g_n_bind, memory_order_relaxed)) return NULL;
    pthread_mutex_lock(&g_lock);
    const uint16_t *r = bind_find(p);
    pthread_mutex_unlock(&g_lock);
    return r;
}

rf_status rf_cpu_bind_bf16(const float *base, const uint16_t *data, size_t n) {
    rf_status s = RF_OK;
    pthread_mutex_lock(&g_lock);
    int i = 0;
    while (i < BIND_SLOTS && g_bind[i].base != base) i++;
    if (i < BIND_SLOTS) { /* rebinding or unbinding base */
        g_bind[i] = (bf16_bind){0};
        g_n_bind--;
    }
    if (data && n) {
        for (i = 0; i < BIND_SLOTS && g_bind[i].base; i++) {}
        if (i == BIND_SLOTS) {
            s = rf_error(RF_ERR_NOMEM, "cpu: more than %d models with bf16-resident weights", BIND_SLOTS);
        } else {
            g_bind[i] = (bf16_bind){base, data, n};
            g_n_bind++;
        }
    }
    g_epoch++; /* copies made from these addresses before are stale */
    pthread_mutex_unlock(&g_lock);
    return s;
}

/* ---- engine, probe ---- */

static int engine_up(void) {
    if (g_ready >= 0) return g_ready;
    g_ready = dnnl_engine_create(&g_engine, dnnl_cpu, 0) == dnnl_success &&
              dnnl_stream_create(&g_stream, g_engine, dnnl_stream_default_flags) == dnnl_success;
    if (!g_ready) fprintf(stderr, "rlflow: oneDNN CPU engine failed to start\n");
    return g_ready;
}

/* Plain memory descriptor of a (rows, cols) operand read with strides (rs, cs). */
static void md2(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                dnnl_data_type_t dt) {
    dnnl_dims_t dims = {rows, cols}, strides = {rs, cs};
    dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
}

/* The primitive descriptor of a backward product (B not transposed: dout W, dout^T x, the
 * log-prob's dz w and dz^T h): oneDNN's gemm:jit implementation where it has one, in place of
 * its first choice, the brgemm kernels (brg:avx512_core[_bf16]) that the forward products run
 * on their packed weights. Measured on the products of both bench configs (docs/kernels.md, "The
 * backward products on oneDNN's gemm kernels"): brgemm copies a plain B into its blocked layout
 * inside every call, which costs most where K is large (the log-prob's dz w, K = V: 1.17-1.32x
 * on gemm:jit), and its copy of a transposed A holds back the bf16 dW products (1.0-1.26x on
 * 48 shapes). AMX kernels are kept: brgemm on AMX-BF16 is the fastest product oneDNN has there.
 * Only the choice of kernel: same operands, same fp32 accumulation. */
static dnnl_status_t backward_pd(dnnl_primitive_desc_t *out, const dnnl_matmul_desc_t *d,
                                 const_dnnl_primitive_attr_t attr) {
    dnnl_primitive_desc_iterator_t it;
    dnnl_status_t st = dnnl_primitive_desc_iterator_create(&it, d, attr, g_engine, NULL);
    if (st != dnnl_success) return st;
    dnnl_primitive_desc_t first = dnnl_primitive_desc_iterator_fetch(it), pick = NULL;
    const char *name = NULL;
    if (first && dnnl_primitive_desc_query(first, dnnl_query_impl_info_str, 0, &name) == dnnl_success &&
        name && !strstr(name, "amx") && strcmp(name, "gemm:jit") != 0) {
        while (!pick && dnnl_primitive_desc_iterator_next(it) == dnnl_success) {
            dnnl_primitive_desc_t q = dnnl_primitive_desc_iterator_fetch(it);
            const char *n = NULL;
            if (q && dnnl_primitive_desc_query(q, dnnl_query_impl_info_str, 0, &n) == dnnl_success &&
                n && strcmp(n, "gemm:jit") == 0)
                pick = q;
            else if (q)
                dnnl_primitive_desc_destroy(q);
        }
    }
    dnnl_primitive_desc_iterator_destroy(it);
    if (pick && first) dnnl_primitive_desc_destroy(first);
    *out = pick ? pick : first;
    return *out ? dnnl_success : dnnl_runtime_error;
}

/* A matmul primitive for key k; NULL where oneDNN cannot make one. *scratch_md gets its
 * scratchpad size. */
static dnnl_primitive_t make_prim(const gemm_key *k, size_t *scratch_bytes, dnnl_memory_desc_t *wmd) {
    dnnl_data_type_t dt = k->dt ? dnnl_bf16 : dnnl_f32;
    dnnl_memory_desc_t a, b, c;
    md2(&a, k->M, k->K, k->ta ? 1 : k->lda, k->ta ? k->lda : 1, dt);
    if (k->pack) {
        dnnl_dims_t dims = {k->K, k->N};
        if (dnnl_memory_desc_init_by_tag(&b, 2, dims, dt, dnnl_format_tag_any) != dnnl_success) return NULL;
    } else {
        md2(&b, k->K, k->N, k->tb ? 1 : k->ldb, k->tb ? k->ldb : 1, dt);
    }
    md2(&c, k->M, k->N, k->ldc, 1, dnnl_f32);
    dnnl_matmul_desc_t d;
    if (dnnl_matmul_desc_init(&d, &a, &b, NULL, &c) != dnnl_success) return NULL;
    dnnl_primitive_attr_t attr;
    if (dnnl_primitive_attr_create(&attr) != dnnl_success) return NULL;
    dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (k->alpha != 1.0f) dnnl_primitive_attr_set_output_scales(attr, 1, 0, &k->alpha);
    dnnl_post_ops_t po = NULL;
    if (k->beta != 0.0f) {
        dnnl_post_ops_create(&po);
        dnnl_post_ops_append_sum(po, k->beta);
        dnnl_primitive_attr_set_post_ops(attr, po);
    }
    dnnl_primitive_desc_t pd;
    dnnl_status_t st = k->pack || k->tb ? dnnl_primitive_desc_create(&pd, &d, attr, g_engine, NULL)
                                        : backward_pd(&pd, &d, attr);
    dnnl_primitive_attr_destroy(attr);
    if (po) dnnl_post_ops_destroy(po);
    if (st != dnnl_success) return NULL;
    if (k->pack) { /* worth a copy only where the kernel has a blocked layout of its own */
        const dnnl_memory_desc_t *w = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
        if (!w || w->format_kind != dnnl_blocked || w->format_desc.blocking.inner_nblks == 0) {
            dnnl_primitive_desc_destroy(pd);
            return NULL;
        }
        *wmd = *w;
    }
    const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    *scratch_bytes = smd ? dnnl_memory_desc_get_size(smd) : 0;
    dnnl_primitive_t p = NULL;
    if (dnnl_primitive_create(&p, pd) != dnnl_success) p = NULL;
    dnnl_primitive_desc_destroy(pd);
    return p;
}

/* Whether oneDNN has a native bf16 matmul on the instruction set it runs on. */
static int bf16_native(void) {
    if (g_bf16_native >= 0) return g_bf16_native;
    gemm_key k = {0, 1, 64, 64, 64, 64, 64, 64, 1, 0, 1.0f, 0.0f};
    size_t sb = 0;
    dnnl_primitive_t p = engine_up() ? make_prim(&k, &sb, NULL) : NULL;
    g_bf16_native = p != NULL;
    if (p) dnnl_primitive_destroy(p);
    return g_bf16_native;
}

/* ---- the shape table ---- */

static uint64_t key_hash(const gemm_key *k) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p = (const unsigned char *)k;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void entry_free(gemm_entry *e) {
    if (e->prim) dnnl_primitive_destroy(e->prim);
    if (e->a) dnnl_memory_destroy(e->a);
    if (e->b) dnnl_memory_destroy(e->b);
    if (e->c) dnnl_memory_destroy(e->c);
    if (e->scratch) dnnl_memory_destroy(e->scratch);
    memset(e, 0, sizeof *e);
}

static int mem_for(dnnl_memory_t *m, dnnl_primitive_t p, dnnl_query_t q, int idx) {
    const_dnnl_primitive_desc_t pd;
    if (dnnl_primitive_get_primitive_desc(p, &pd) != dnnl_success) return 0;
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(pd, q, idx);
    return md && dnnl_memory_create(m, md, g_engine, DNNL_MEMORY_NONE) == dnnl_success;
}

/* Inserts e's contents at its key's place (the table has room). */
static void entry_put(const gemm_entry *e) {
    uint64_t h = key_hash(&e->key);
    for (size_t i = 0;; i++) {
        gemm_entry *d = &g_gemm[(h + i) & (GEMM_SLOTS - 1)];
        if (!d->used) {
            *d = *e;
            return;
        }
    }
}

/* Makes room in a three-quarters full table: keeps the entries used since it was last thinned
 * (the shapes a run repeats: row buckets, decoding steps), frees the others (shapes seen once or
 * twice: a weight gradient's row count of tokens); everything where those kept would fill half
 * the table. */
static void table_thin(void) {
    static gemm_entry keep[GEMM_SLOTS / 2];
    int n = 0;
    for (int j = 0; j < GEMM_SLOTS; j++) {
        gemm_entry *e = &g_gemm[j];
        if (!e->used) continue;
        if (e->gen == g_gen && n < GEMM_SLOTS / 2) keep[n++] = *e;
        else entry_free(e);
        memset(e, 0, sizeof *e);
    }
    g_gen++;
    if (n == GEMM_SLOTS / 2) { /* most shapes in use: start over */
        for (int i = 0; i < n; i++) entry_free(&keep[i]);
        n = 0;
    }
    for (int i = 0; i < n; i++) keep[i].gen = g_gen, entry_put(&keep[i]);
    g_gemm_count = n;
}

/* The table's entry for k, made on first use; NULL where oneDNN cannot make the primitive. */
static gemm_entry *entry_get(const gemm_key *k) {
    uint64_t h = key_hash(k);
    for (size_t i = 0; i < GEMM_SLOTS; i++) {
        gemm_entry *e = &g_gemm[(h + i) & (GEMM_SLOTS - 1)];
        if (e->used && memcmp(&e->key, k, sizeof *k) == 0) {
            e->gen = g_gen;
            return e;
        }
        if (e->used) continue;
        if (g_gemm_count >= GEMM_SLOTS * 3 / 4) { /* many shapes */
            table_thin();
            return entry_get(k);
        }
        e->key = *k;
        e->gen = g_gen;
        e->prim = make_prim(k, &e->scratch_bytes, &e->wmd);
        if (!e->prim && k->pack) { /* remembered: this shape's weights stay in their layout */
            e->used = 1;
            g_gemm_count++;
            return e;
        }
        if (!e->prim || !mem_for(&e->a, e->prim, dnnl_query_src_md, 0) ||
            !mem_for(&e->b, e->prim, dnnl_query_weights_md, 0) ||
            !mem_for(&e->c, e->prim, dnnl_query_dst_md, 0) ||
            (e->scratch_bytes && !mem_for(&e->scratch, e->prim, dnnl_query_scratchpad_md, 0))) {
            entry_free(e);
            return NULL;
        }
        e->used = 1;
        g_gemm_count++;
        return e;
    }
    return NULL;
}

/* ---- weight copies ---- */

/* The table's slot for the copy of kind `kind` of weight src (stored (rows, cols), row stride
 * ld), holding `bytes` bytes (in layout md for the packed kinds, NULL for the others); *current
 * is 1 when it already holds this epoch's copy, else the caller fills it and sets its epoch.
 * NULL where memory is short. Caller holds g_lock. */
static weight_copy *copy_slot(const float *src, int rows, int cols, int ld, int kind, size_t bytes,
                              const dnnl_memory_desc_t *md, int *current) {
    uint64_t h = ((uint64_t)(uintptr_t)src * 0x9e3779b97f4a7c15ull) ^ (uint64_t)rows * 31u ^ (uint64_t)cols;
    weight_copy *slot = NULL;
    for (size_t i = 0; i < WEIGHT_SLOTS && !slot; i++) {
        weight_copy *w = &g_wcopy[((h >> 7 ^ h) + i) & (WEIGHT_SLOTS - 1)];
        if (!w->src || (w->src == src && w->rows == rows && w->cols == cols && w->ld == ld && w->kind == kind))
            slot = w;
    }
    if (!slot) { /* table full: drop everything */
        for (int i = 0; i < WEIGHT_SLOTS; i++) free(g_wcopy[i].data);
        memset(g_wcopy, 0, sizeof g_wcopy);
        return copy_slot(src, rows, cols, ld, kind, bytes, md, current);
    }
    *current = slot->src && slot->epoch == g_epoch && (!md || dnnl_memory_desc_equal(&slot->md, md));
    if (*current) return slot;
    void *data = slot->src && slot->bytes == bytes ? slot->data : NULL;
    if (!data) {
        if (slot->src) free(slot->data);
        data = rf_cpu_alloc_lines(bytes);
        if (!data) {
            *slot = (weight_copy){0};
            return NULL;
        }
    }
    *slot = (weight_copy){src, rows, cols, ld, kind, 0, {0}, data, bytes};
    if (md) slot->md = *md;
    return slot;
}

/* The converted copy of weight src (rows, cols; stride ld), made or refreshed for this epoch:
 * from src's floats, or (emulated only) from its bound bf16 values bsrc (same stride), widened. */
static const void *weight_get(const float *src, int rows, int cols, int ld, int emulated,
                              const uint16_t *bsrc) {
    size_t bytes = (size_t)rows * cols * (emulated ? sizeof(float) : sizeof(uint16_t));
    int current;
    weight_copy *w = copy_slot(src, rows, cols, ld, emulated ? COPY_EMULATED : COPY_BF16, bytes, NULL, &current);
    if (!w || current) return w ? w->data : NULL;
    if (bsrc) widen(w->data, bsrc, rows, cols, ld);
    else convert(w->data, src, rows, cols, ld, emulated);
    w->epoch = g_epoch;
    return w->data;
}

/* ---- scratch buffers ---- */

/* Per-thread growable buffer i (0: operand A, 1: operand B; 2, 3: widened bound A, B; 4: the last
 * rows of a bucketed product with beta 1) of at
 * least n bytes. The buffers live as long as the thread (OpenMP's threads live as long as the
 * process). */
static _Thread_local void *g_tls[5];
static _Thread_local size_t g_tls_cap[5];

/* What buffer 0 holds after gemm_prim converted an A operand into it: that operand's address,
 * stored shape, row stride and kind (bf16 or bf16-rounded floats); src NULL once anything
 * else may have written the buffer. Lets rf_cpu_gemm_same_a skip converting A again. */
typedef struct held_a {
    const float *src;
    int rows, cols, ld, emulated;
} held_a;
static _Thread_local held_a g_held_a;
static _Atomic size_t g_a_conversions; /* bf16 conversions of A operands made (tests) */

/* ---- held activations (kernels.h operand_hold) ---- */

/* An activation its owner (a model) promised only products would read until it releases it:
 * the floats [src, src + rows * cols), converted once, at the first product that reads them (as
 * A, or as a weight gradient's B), for every product that reads them; or written as bf16 by the
 * op that makes them (rf_cpu_held_output: `direct`, the floats then left unwritten). buf has
 * room for 64 rows more than the activation: the zero rows a weight gradient's sum is padded
 * with on AMX (kpad). Live holds are g_held[0, g_n_held); the slots after them keep their
 * buffers for the next holds (a step's activations have the same sizes as the last step's);
 * trim frees those. */
typedef struct held_op {
    const void *owner;
    const float *src;
    int rows, cols;
    int kind;   /* what buf holds: -1 nothing yet, 0 bf16 values, 1 bf16-rounded floats */
    int direct; /* buf was written instead of the floats (bf16 values, kind 0) */
    void *buf;
    size_t cap; /* bytes */
} held_op;
#define HELD_SLOTS 1024 /* a step's holds: four a layer and the final norm's, per model */
static held_op g_held[HELD_SLOTS];
static _Atomic int g_n_held; /* written under g_lock; read without it by a product's quick check */
static int g_held_off;       /* holds ignored while off */
static _Atomic size_t g_held_conversions; /* held activations converted (tests) */

/* Room in h->buf for the conversion (es bytes a value): 0 where memory is short. */
static int held_room(held_op *h, size_t es) {
    size_t need = es * ((size_t)h->rows + 64) * h->cols;
    if (h->cap >= need) return 1;
    free(h->buf);
    h->buf = rf_cpu_alloc_lines(need);
    h->cap = h->buf ? need : 0;
    return h->buf != NULL;
}

/* Writes a direct hold's values into its floats (exact): they are what any reader gets from
 * now on. Caller holds g_lock. */
static void held_undirect(held_op *h) {
    if (!h->direct) return;
    widen((float *)h->src, h->buf, h->rows, h->cols, h->cols);
    h->direct = 0;
}

/* The live hold covering the stored operand at p (rows, cols; row stride ld) and the offset of
 * p in it (floats), or NULL: whole rows of the activation only. Caller holds g_lock. */
static held_op *held_find(const float *p, int rows, int cols, int ld, size_t *off) {
    for (int i = 0; i < g_n_held; i++) {
        held_op *h = &g_held[i];
        if (cols != h->cols || ld != h->cols || p < h->src || p >= h->src + (size_t)h->rows * h->cols)
            continue;
        *off = (size_t)(p - h->src);
        if (*off % (size_t)h->cols || *off / h->cols + rows > (size_t)h->rows) return NULL;
        return h;
    }
    return NULL;
}

/* The conversion of the stored operand at p (rows, cols; row stride ld) that a hold keeps, made
 * now if not yet, with pad zero rows after it (which only a slice ending where the activation
 * ends has room for), as bf16 values or as rounded floats (emulated). NULL where no hold covers
 * it or memory is short. Caller holds g_lock. */
static const void *held_get(const float *p, int rows, int cols, int ld, int emulated, int pad) {
    size_t off;
    held_op *h = held_find(p, rows, cols, ld, &off);
    if (!h || (pad && off / h->cols + rows != (size_t)h->rows)) return NULL;
    size_t es = emulated ? sizeof(float) : sizeof(uint16_t);
    if (h->kind != emulated) {
        held_undirect(h); /* (a direct hold is bf16: kind 0) */
        if (!held_room(h, es)) return NULL;
        convert(h->buf, h->src, h->rows, h->cols, h->cols, emulated);
        h->kind = emulated;
        g_held_conversions++;
    }
    char *b = (char *)h->buf + es * off;
    if (pad) memset(b + es * (size_t)rows * cols, 0, es * (size_t)pad * cols);
    return b;
}

/* The bf16 values of the stored operand at p where a direct hold has them and its floats are
 * unwritten, else NULL; *at_end: whether its rows end the activation (room after them). */
static const uint16_t *held_direct(const float *p, int rows, int cols, int ld, int *at_end) {
    size_t off;
    *at_end = 0;
    /* without the lock where nothing is held (a caller's own holds are seen) */
    if (!atomic_load_explicit(&g_n_held, memory_order_relaxed)) return NULL;
    pthread_mutex_lock(&g_lock);
    held_op *h = held_find(p, rows, cols, ld, &off);
    const uint16_t *d = h && h->direct ? (const uint16_t *)h->buf + off : NULL;
    *at_end = h && off / h->cols + rows == (size_t)h->rows;
    pthread_mutex_unlock(&g_lock);
    return d;
}

uint16_t *rf_cpu_held_output(const float *p, size_t n) {
    uint16_t *d = NULL;
    /* without the lock where nothing is held (a caller's own holds are seen) */
    if (!atomic_load_explicit(&g_n_held, memory_order_relaxed)) return NULL;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_n_held && !d; i++) {
        held_op *h = &g_held[i];
        if (h->src != p || (size_t)h->rows * h->cols != n) continue;
        if (g_prec == RF_PRECISION_BF16 && bf16_native() && held_room(h, sizeof(uint16_t))) {
            h->kind = 0, h->direct = 1, g_held_conversions++;
            d = h->buf;
        }
        break;
    }
    pthread_mutex_unlock(&g_lock);
    return d;
}

void rf_cpu_operand_hold(const void *owner, const float *p, int rows, int cols) {
    if (!p || rows <= 0 || cols <= 0) return;
    pthread_mutex_lock(&g_lock);
    held_op *h = NULL;
    for (int i = 0; i < g_n_held && !h; i++) /* held again: new values */
        if (g_held[i].src == p) h = &g_held[i];
    if (!h && !g_held_off && g_n_held < HELD_SLOTS) h = &g_held[g_n_held++];
    if (h) h->owner = owner, h->src = p, h->rows = rows, h->cols = cols, h->kind = -1, h->direct = 0;
    pthread_mutex_unlock(&g_lock);
}

/* Ends live hold i: its slot (and buffer) goes after the live ones. Caller holds g_lock. */
static void held_end(int i) {
    held_op t = g_held[i];
    g_held[i] = g_held[--g_n_held];
    t.owner = NULL, t.src = NULL, t.rows = t.cols = 0, t.kind = -1, t.direct = 0;
    g_held[g_n_held] = t;
}

void rf_cpu_operands_release(const void *owner) {
    pthread_mutex_lock(&g_lock);
    for (int i = g_n_held - 1; i >= 0; i--)
        if (g_held[i].owner == owner) held_end(i);
    pthread_mutex_unlock(&g_lock);
}

/* Ends the holds on memory overlapping [lo, hi) (being freed). Caller holds g_lock. */
static void held_forget(const char *lo, const char *hi) {
    for (int i = g_n_held - 1; i >= 0; i--) {
        const char *a = (const char *)g_held[i].src, *b = a + sizeof(float) * (size_t)g_held[i].rows * g_held[i].cols;
        if (a < hi && lo < b) held_end(i);
    }
}

void rf_cpu_operands_trim(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = g_n_held; i < HELD_SLOTS; i++) free(g_held[i].buf), g_held[i] = (held_op){0};
    pthread_mutex_unlock(&g_lock);
}

int rf_cpu_operands_hold_on(int on) {
    pthread_mutex_lock(&g_lock);
    int was = !g_held_off;
    g_held_off = !on;
    if (!on)
        while (g_n_held) held_undirect(&g_held[g_n_held - 1]), held_end(g_n_held - 1);
    pthread_mutex_unlock(&g_lock);
    return was;
}

size_t rf_cpu_operands_conversions(void) { return g_held_conversions; }

size_t rf_cpu_operands_kept_bytes(void) {
    size_t n = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < HELD_SLOTS; i++) n += g_held[i].cap;
    pthread_mutex_unlock(&g_lock);
    return n;
}

static void *tls_buf(int i, size_t n) {
    if (i == 0) g_held_a.src = NULL;
    if (g_tls_cap[i] < n) {
        free(g_tls[i]);
        g_tls[i] = rf_cpu_alloc_lines(n);
        g_tls_cap[i] = g_tls[i] ? n : 0;
    }
    return g_tls[i];
}

/* ---- the product ---- */

/* Stored shape of an operand read as (rows, cols) with transposition t: (cols, rows) if t. */
static void stored(int t, int rows, int cols, int *sr, int *sc) {
    *sr = t ? cols : rows;
    *sc = t ? rows : cols;
}

/* ---- weights in a primitive's own layout ---- */

/* Runs (once made, from a table) the reorder of a plain (K, N) operand `from` at data into the
 * layout `to` at out; 1 when done. Caller holds g_lock. */
static int reorder_run(const dnnl_memory_desc_t *from, const void *data, const dnnl_memory_desc_t *to,
                       void *out) {
    reorder_entry *r = NULL;
    for (int i = 0; i < g_n_reorder && !r; i++)
        if (dnnl_memory_desc_equal(&g_reorder[i].from, from) && dnnl_memory_desc_equal(&g_reorder[i].to, to))
            r = &g_reorder[i];
    if (!r) {
        if (g_n_reorder == REORDER_SLOTS) { /* many shapes: start over */
            for (int i = 0; i < g_n_reorder; i++) {
                dnnl_primitive_destroy(g_reorder[i].prim);
                dnnl_memory_destroy(g_reorder[i].src);
                dnnl_memory_destroy(g_reorder[i].dst);
            }
            g_n_reorder = 0;
        }
        reorder_entry e = {*from, *to, NULL, NULL, NULL};
        dnnl_primitive_desc_t pd;
        if (dnnl_reorder_primitive_desc_create(&pd, from, g_engine, to, g_engine, NULL) != dnnl_success)
            return 0;
        dnnl_status_t st = dnnl_primitive_create(&e.prim, pd);
        dnnl_primitive_desc_destroy(pd);
        if (st != dnnl_success) return 0;
        if (dnnl_memory_create(&e.src, from, g_engine, DNNL_MEMORY_NONE) != dnnl_success ||
            dnnl_memory_create(&e.dst, to, g_engine, DNNL_MEMORY_NONE) != dnnl_success) {
            if (e.src) dnnl_memory_destroy(e.src);
            dnnl_primitive_destroy(e.prim);
            return 0;
        }
        g_reorder[g_n_reorder] = e;
        r = &g_reorder[g_n_reorder++];
    }
    dnnl_memory_set_data_handle(r->src, (void *)data);
    dnnl_memory_set_data_handle(r->dst, out);
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, r->src}, {DNNL_ARG_TO, r->dst}};
    return dnnl_primitive_execute(r->prim, g_stream, 2, args) == dnnl_success &&
           dnnl_stream_wait(g_stream) == dnnl_success;
}

/* Weight src (stored (N, K), row stride ld) read transposed, as the operand B (K, N) of a
 * forward product, in the layout md a primitive chose for it: bf16 values (bf16: of src
 * rounded, or the bound values bsrc in place) or fp32 ones, reordered once per epoch (a
 * permutation of the plain operand's elements: the product's bits are those of the plain
 * operand, tests/test_kernels.c). NULL where memory is short. Caller holds g_lock. */
static const void *packed_get(const float *src, const uint16_t *bsrc, int N, int K, int ld, int bf16,
                              const dnnl_memory_desc_t *md) {
    int current;
    weight_copy *w = copy_slot(src, N, K, ld, bf16 ? COPY_PACKED_BF16 : COPY_PACKED_F32,
                               dnnl_memory_desc_get_size(md), md, &current);
    if (!w || current) return w ? w->data : NULL;
    const void *plain = src;
    if (bf16 && !bsrc) { /* rounded to bf16 as every bf16 operand is (convert) */
        void *t = tls_buf(1, sizeof(uint16_t) * (size_t)N * K);
        if (!t) return NULL;
        convert(t, src, N, K, ld, 0);
        plain = t, ld = K;
    } else if (bf16) {
        plain = bsrc;
    }
    dnnl_memory_desc_t from;
    md2(&from, K, N, 1, ld, bf16 ? dnnl_bf16 : dnnl_f32);
    if (!reorder_run(&from, plain, md, w->data)) return NULL; /* epoch 0: made again next time */
    w->epoch = g_epoch;
    return w->data;
}

void rf_cpu_gemm_forget(const void *p, size_t bytes) {
    const char *lo = p, *hi = lo + bytes;
    pthread_mutex_lock(&g_lock);
    held_forget(lo, hi);
    for (int i = 0; i < WEIGHT_SLOTS; i++) {
        weight_copy *w = &g_wcopy[i];
        if (w->data && (const char *)w->src >= lo && (const char *)w->src < hi) {
            /* the key stays (the table's probe chains run through it), the copy goes */
            free(w->data);
            w->data = NULL, w->bytes = 0, w->epoch = 0;
        }
    }
    pthread_mutex_unlock(&g_lock);
}

size_t rf_cpu_gemm_copies_bytes(void) {
    size_t n = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < WEIGHT_SLOTS; i++)
        if (g_wcopy[i].src) n += g_wcopy[i].bytes;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* dnnl_sgemm on fp32 operands, or on bf16-rounded copies of them when round is set (the
 * fallback of a bf16 product without a primitive). */
static void gemm_nested(int ta, int tb, int M, int N, int K, float alpha, const float *A,
                        int lda, const float *B, int ldb, float beta, float *C, int ldc, int round) {
    if (round) {
        int ar, ac, br, bc;
        stored(ta, M, K, &ar, &ac);
        stored(tb, K, N, &br, &bc);
        float *a = tls_buf(0, sizeof(float) * (size_t)ar * ac), *b = tls_buf(1, sizeof(float) * (size_t)br * bc);
        if (!a || !b) abort(); /* out of memory for a few (L, D) operands: nothing sane left */
        convert(a, A, ar, ac, lda, 1);
        convert(b, B, br, bc, ldb, 1);
        A = a, lda = ac, B = b, ldb = bc;
    }
    dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* Rows of A at or below which a weight product out = A W^T runs as the matrix-vector loops
 * below, where oneDNN's rows are not batch-invariant (rf_cpu_batch_invariant_exact 0: its AVX2
 * gemm, its bf16 emulation, AMX's bf16 products but those on rf_cpu_amx_gemm): there they keep
 * the roundings every run on such a CPU has had.
 * Where oneDNN's are, every product goes to oneDNN: on the weights in its own layout and both
 * threads it was 1.8-17x the loops at 1-4 rows (bench_matmul on the AMD EPYC Zen 5,
 * docs/kernels.md), and a row then gets the same bits whatever the number of rows it shares a
 * product with. */
#define GEMV_MAX_M 4

/* Products of at most this many multiply-adds run on one thread (rf_cpu_gemm). */
#define RF_GEMM_SERIAL_MACS (1 << 22)

/* Whether oneDNN's effective instruction set (ONEDNN_MAX_CPU_ISA honoured) has AMX: its bf16
 * products run on the tiles, its fp32 ones on the AVX-512 kernels as without. */
static int isa_amx(void) {
    static atomic_int amx = -1;
    int v = atomic_load(&amx);
    if (v < 0) {
        int isa = (int)dnnl_get_effective_cpu_isa(), bf16 = (int)dnnl_cpu_isa_avx512_core_bf16;
        v = (isa & ((int)dnnl_cpu_isa_avx512_core_amx & ~bf16)) != 0;
        atomic_store(&amx, v);
    }
    return v;
}

int rf_cpu_isa_amx(void) { return isa_amx(); }

/* Whether the products now run bf16 on AMX's tiles (AMX has AVX512-BF16: never emulated). */
static int amx_bf16(void) { return g_prec == RF_PRECISION_BF16 && isa_amx(); }

/* Whether oneDNN's matmul gives a row the same bits in products of any number of rows: with
 * its AVX-512 kernels (avx512_core_bf16, AMD EPYC), measured for 1 to 300 rows, fp32 and bf16,
 * with 64 to 1376 inputs and 64 to 8000 outputs (tests/test_kernels.c checks decode shapes
 * where it runs). Not with its AVX2 ones (ONEDNN_MAX_CPU_ISA=AVX2: a sixth of the rows of
 * products under 64 rows differ from the same rows among 64), where only the matrix-vector
 * loops at every size would do, 5-8x slower at 32 rows (bench_matmul). With AMX (Intel Xeon with
 * AMX-BF16, 2026-11-30): fp32 products run on the same AVX-512 kernels and are exact (11 shapes,
 * K 64-4864, rows of 1-2048-row products equal to the same rows among 4096); bf16 products on
 * the tiles are not: where oneDNN declines AMX for a few rows (M N small) those run on its
 * AVX512-BF16 kernels, and from K of about 1024 the blocking of the sum depends on the rows (11
 * of 36 shapes with K 512-1280 differ).
 * Where 1, every product goes to oneDNN (GEMV_MAX_M).
 * bf16 products on AVX-512 without AVX512-BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE, as on a
 * Cascade Lake) are oneDNN's emulating gemm, not the brgemm kernels: there a row of a 1-row
 * product differs from the same row among more, so only fp32 products are exact there.
 * Bit 0: fp32 products exact; bit 1: bf16 products exact. */
static atomic_int g_row_invariant = -1; /* -1 not known yet */

int rf_cpu_batch_invariant_exact_at(rf_precision p) {
    int known = atomic_load(&g_row_invariant);
    if (known < 0) {
        int isa = (int)dnnl_get_effective_cpu_isa(), avx512 = (int)dnnl_cpu_isa_avx512_core;
        int bf16 = (int)dnnl_cpu_isa_avx512_core_bf16;
        int fp32_ok = (isa & avx512) == avx512; /* AMX has no fp32 tiles: the same f32 kernels */
        known = fp32_ok | (fp32_ok && (isa & bf16) == bf16 && !isa_amx()) << 1;
        atomic_store(&g_row_invariant, known);
    }
    return (known >> (p == RF_PRECISION_BF16)) & 1;
}

int rf_cpu_batch_invariant_exact(void) { return rf_cpu_batch_invariant_exact_at(g_prec); }

/* Lanes of the matrix-vector accumulators: one 512-bit vector of floats. */
#define GEMV_LANES 16

/* The sum of the GEMV_LANES partial sums of acc, pairwise (a tree: the compiler keeps it in
 * vector registers, where a serial chain of 16 adds cost more than the dot product itself at
 * K = 512). */
static inline float lanes_sum(float *acc) {
    for (int w = GEMV_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* s[t][r] = row t of x . row r of W, for M (<= GEMV_MAX_M) rows of x (K floats apart) and the
 * nr (<= 4) rows of W starting at w0 (row stride ld), fp32 or bf16 weights (wb0). Per (t, r),
 * GEMV_LANES partial sums, lane l a chain of fused multiply-adds over c = l, l + 16, ... in
 * order, then the rest of K into lane 0 and the lanes added pairwise (lanes_sum): the same
 * bits however the loops run. On AVX-512 the lanes are one register, a chunk of the four weight
 * rows is read (and widened from bf16) once for all M rows of x, and the rows ahead are
 * prefetched: a batch-1 product of Qwen2.5-0.5B's MLP (896 x 4864, bf16) read its weights at
 * 14.3 GB/s as a loop per row, 21.4 GB/s so, and four rows at once 6.2 -> 15-17 GB/s (the AMX
 * Xeon's DRAM reads 30 GB/s). */
#define GEMV_PREFETCH 512 /* elements of a weight row ahead (the next rows where it ends) */
static void gemv_dots(float s[GEMV_MAX_M][4], int M, int nr, int K, const float *x, const float *w0,
                      const uint16_t *wb0, size_t ld) {
    float acc[GEMV_MAX_M][4][GEMV_LANES];
    int kv = K / GEMV_LANES * GEMV_LANES;
#ifdef __AVX512F__
    __m512 a[GEMV_MAX_M][4];
    for (int t = 0; t < M; t++)
        for (int r = 0; r < 4; r++) a[t][r] = _mm512_setzero_ps();
    for (int c0 = 0; c0 < kv; c0 += GEMV_LANES) {
        __m512 w[4];
        for (int r = 0; r < nr; r++) {
            if (wb0) {
                const uint16_t *p = wb0 + (size_t)r * ld + c0;
                _mm_prefetch((const char *)(p + GEMV_PREFETCH), _MM_HINT_T0);
                __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
                w[r] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
            } else {
                const float *p = w0 + (size_t)r * ld + c0;
                _mm_prefetch((const char *)(p + GEMV_PREFETCH), _MM_HINT_T0);
                w[r] = _mm512_loadu_ps(p);
            }
        }
        for (int t = 0; t < M; t++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)t * K + c0);
            for (int r = 0; r < nr; r++) a[t][r] = _mm512_fmadd_ps(xv, w[r], a[t][r]);
        }
    }
    for (int t = 0; t < M; t++)
        for (int r = 0; r < nr; r++) _mm512_storeu_ps(acc[t][r], a[t][r]);
#else
    for (int t = 0; t < M; t++)
        for (int r = 0; r < nr; r++) {
            float *ac = acc[t][r];
            const float *xt = x + (size_t)t * K;
            for (int l = 0; l < GEMV_LANES; l++) ac[l] = 0.0f;
            if (wb0) {
                const uint16_t *w = wb0 + (size_t)r * ld;
                for (int c0 = 0; c0 < kv; c0 += GEMV_LANES)
#pragma omp simd
                    for (int l = 0; l < GEMV_LANES; l++) ac[l] += xt[c0 + l] * bf16_to_f32(w[c0 + l]);
            } else {
                const float *w = w0 + (size_t)r * ld;
                for (int c0 = 0; c0 < kv; c0 += GEMV_LANES)
#pragma omp simd
                    for (int l = 0; l < GEMV_LANES; l++) ac[l] += xt[c0 + l] * w[c0 + l];
            }
        }
#endif
    for (int t = 0; t < M; t++)
        for (int r = 0; r < nr; r++) {
            const float *xt = x + (size_t)t * K;
            float *ac = acc[t][r];
            if (wb0)
                for (int c = kv; c < K; c++) ac[0] += xt[c] * bf16_to_f32(wb0[(size_t)r * ld + c]);
            else
                for (int c = kv; c < K; c++) ac[0] += xt[c] * w0[(size_t)r * ld + c];
            s[t][r] = lanes_sum(ac);
        }
}

/* C (M, N) = alpha * A (M, K) @ W^T + beta * C with W (N, K; row stride ldw) a weight: fp32 W,
 * or its bf16 values Wb (N, K; row stride ldw: a dense copy, or bound values in place) with A
 * rounded to bf16 as it is read. OpenMP over output columns (blocks of four rows of W), each a
 * dot product accumulated in fp32 in GEMV_LANES lanes (gemv_dots). */
static void gemv_rows(int M, int N, int K, float alpha, const float *A, int lda, const float *W,
                      int ldw, const uint16_t *Wb, float beta, float *C, int ldc, float *xr) {
    for (int t = 0; t < M; t++)
        for (int c = 0; c < K; c++)
            xr[(size_t)t * K + c] = Wb ? bf16_round(A[(size_t)t * lda + c]) : A[(size_t)t * lda + c];
    size_t ld = (size_t)ldw;
#pragma omp parallel for schedule(static) if ((size_t)N * K > 65536)
    for (int o0 = 0; o0 < N; o0 += 4) {
        int nr = N - o0 < 4 ? N - o0 : 4;
        float s[GEMV_MAX_M][4];
        gemv_dots(s, M, nr, K, xr, Wb ? NULL : W + (size_t)o0 * ld, Wb ? Wb + (size_t)o0 * ld : NULL, ld);
        for (int t = 0; t < M; t++)
            for (int r = 0; r < nr; r++) {
                float *cp = C + (size_t)t * ldc + o0 + r;
                *cp = alpha * s[t][r] + (beta == 0.0f ? 0.0f : beta * *cp);
            }
    }
}

void rf_cpu_gemm_local(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc) {
    if (M == 0 || N == 0) return;
    if (K == 0) {
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
        return;
    }
    dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static int run_entry(gemm_entry *e, const void *A, const void *B, float *C) {
    dnnl_memory_set_data_handle(e->a, (void *)A);
    dnnl_memory_set_data_handle(e->b, (void *)B);
    dnnl_memory_set_data_handle(e->c, C);
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b}, {DNNL_ARG_DST, e->c}};
    int n = 3;
    if (e->scratch_bytes) {
        if (g_scratch_cap < e->scratch_bytes) {
            free(g_scratch);
            g_scratch = rf_cpu_alloc_lines(e->scratch_bytes);
            g_scratch_cap = g_scratch ? e->scratch_bytes : 0;
            if (!g_scratch) return 0;
        }
        dnnl_memory_set_data_handle(e->scratch, g_scratch);
        args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, e->scratch};
    }
    return dnnl_primitive_execute(e->prim, g_stream, n, args) == dnnl_success &&
           dnnl_stream_wait(g_stream) == dnnl_success;
}

/* Operand X (stored (rows, cols), row stride *ld) as fp32 values: itself, or where it lies in a
 * bound range (xb its bf16 values) a widened dense copy in per-thread buffer `buf`, *ld
 * updated. Aborts when out of memory for it, as gemm_nested does. */
static const float *operand_f32(const float *X, const uint16_t *xb, int t, int r, int c, int *ld, int buf) {
    if (!xb) return X;
    int sr, sc;
    stored(t, r, c, &sr, &sc);
    float *d = tls_buf(buf, sizeof(float) * (size_t)sr * sc);
    if (!d) abort(); /* out of memory for one operand: nothing sane left */
    widen(d, xb, sr, sc, *ld);
    *ld = sc;
    return d;
}

/* The matrix-vector path of a weight product (M <= GEMV_MAX_M rows): 1 when done. bb: B's bound
 * bf16 values or NULL. */
static int gemm_small(int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                      int ldb, const uint16_t *bb, float beta, float *C, int ldc) {
    float *xr = tls_buf(0, sizeof(float) * (size_t)M * K);
    if (!xr) return 0;
    pthread_mutex_lock(&g_lock);
    const uint16_t *wb = NULL;
    const float *w = B;
    int bf16 = g_prec == RF_PRECISION_BF16, ldw = ldb;
    if (bf16 && bb) wb = bb; /* bound values in place */
    else if (bf16) wb = weight_get(B, N, K, ldb, 0, NULL), ldw = K;
    else if (bb) w = weight_get(B, N, K, ldb, 1, bb), ldw = K;
    pthread_mutex_unlock(&g_lock);
    if (bf16 ? !wb : !w) return 0;
    gemv_rows(M, N, K, alpha, A, lda, w, ldw, wb, beta, C, ldc, xr);
    return 1;
}

/* Row buckets. A product's primitive is made for its exact shape (oneDNN JIT-compiles kernels
 * for it: 0.1-0.3 ms on AVX512-BF16, 0.3-1.1 ms on AMX), and an RL run's row counts change at
 * every call: a decoding step's running sequences, a micro-batch's packed tokens. The default
 * recipe made 57 primitives a step, 37 % of its time on an AMX machine (docs/kernels.md). So a
 * bucketed product of M >= 16 rows runs as one product of the rows [0, Mb), Mb = M rounded down
 * to a multiple of b (64 from 64 rows, else 16), and, where M is not a multiple, one of the last
 * b rows [M - b, M): every shape it makes has a row count from a small set, and the rows both
 * compute are written twice. Bucketed only where that leaves every row's bits as one product
 * gives them: rows that oneDNN computes alike in products of any number of rows (the forward
 * products on weights in its own layout, where rf_cpu_batch_invariant_exact says so), beta 0 or
 * 1 (with 1, the last rows go to a buffer and those not done yet are added to C: the sum
 * post-op's one addition, so the same bits; test_kernels). And bf16 products on AMX, whose rows already depend on the
 * product's rows (rf_cpu_batch_invariant_exact 0 there): the same bits every run. */
static int bucket_rows(int M) { return M >= 64 ? 64 : M >= 16 ? 16 : 0; }

/* Runs the product of key k (its primitive made on first use) on operands a (rows of arow
 * bytes) and b, in row buckets (bucket_rows) where bucket is set. pb_for, where given, gives B
 * in the layout of the entry's primitive (b unused). 1 when done. Caller holds g_lock. */
typedef const void *(*packed_fn)(const gemm_entry *e, void *ctx);
static int run_rows(gemm_key *k, const void *a, size_t arow, const void *b, float *C, int bucket,
                    packed_fn pb_for, void *ctx) {
    int M = k->M, ldc = k->ldc, bs = bucket ? bucket_rows(M) : 0;
    float beta = k->beta;
    int pieces = bs && M % bs ? 2 : 1, rows[2] = {pieces == 2 ? M / bs * bs : M, bs}, at[2] = {0, M - bs};
    /* beta 1: the last rows first, into a buffer (beta 0), so that C is written only once both
     * products are done (a failure leaves it for the caller's fallback); the rows the first does
     * not cover are then added to C: oneDNN's sum post-op is that one fp32 addition, acc + C */
    float *t = NULL;
    if (pieces == 2 && beta != 0.0f && !(t = tls_buf(4, sizeof(float) * (size_t)bs * k->N))) return 0;
    int ok = 1;
    for (int n = 0; n < pieces && ok; n++) {
        int i = t ? 1 - n : n;
        float *c = C + (size_t)at[i] * ldc;
        if (i == 1 && t) k->beta = 0.0f, k->ldc = k->N, c = t;
        k->M = rows[i];
        gemm_entry *e = entry_get(k); /* made before the previous one is needed no more: entry_get
                                         may clear the table */
        const void *bb = b;
        if (e && pb_for) bb = e->prim ? pb_for(e, ctx) : NULL;
        ok = e && e->prim && bb && run_entry(e, (const char *)a + (size_t)at[i] * arow, bb, c);
        k->beta = beta, k->ldc = ldc;
    }
    k->M = M;
    if (ok && t)
        for (int r = rows[0] - at[1]; r < bs; r++) {
            float *cr = C + (size_t)(at[1] + r) * ldc;
            const float *tr = t + (size_t)r * k->N;
            for (int j = 0; j < k->N; j++) cr[j] = tr[j] + cr[j];
        }
    return ok;
}

typedef struct packed_ctx {
    const float *B;
    const uint16_t *bb;
    int N, K, ldb, bf16;
} packed_ctx;

static const void *packed_for(const gemm_entry *e, void *ctx) {
    packed_ctx *c = ctx;
    return packed_get(c->B, c->bf16 ? c->bb : NULL, c->N, c->K, c->ldb, c->bf16, &e->wmd);
}

static atomic_int g_own_amx = 1; /* rf_cpu_gemm_own_amx */

int rf_cpu_gemm_own_amx(int on) { return atomic_exchange(&g_own_amx, on); }

/* Whether a product runs on rf_cpu_amx_gemm: bf16 on AMX, out = A W^T on a weight of
 * RF_CPU_AMX_MIN_BYTES or more (decoding a real model: from that size it read weights from
 * memory faster than oneDNN's kernel and than the matrix-vector loops, docs/kernels.md), with
 * rows, alpha and beta as the kernel takes them. Decided once per product, by gemm. */
static int own_amx_takes(int ta, int tb, int M, int N, int K, float alpha, float beta, int b_weight) {
    return b_weight && tb && !ta && (size_t)N * K * sizeof(uint16_t) >= RF_CPU_AMX_MIN_BYTES && amx_bf16() &&
           atomic_load(&g_own_amx) && rf_cpu_amx_fits(M, alpha, beta);
}

/* Whether md is oneDNN's AMX layout of a bf16 (K, N) weight that rf_cpu_amx_gemm reads,
 * "16a64b2a": blocks of 32 inputs x 64 columns, inside a block 16 pairs of inputs x 64 columns
 * x 2; K padded to a multiple of 32 and N to one of 64 (oneDNN's reorder writes the padding
 * as zeros). Its block strides in *sk, *sn and the blocks of inputs in *kbs. */
static int amx_layout(const dnnl_memory_desc_t *md, int K, int N, long *sk, long *sn, int *kbs) {
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    if (md->format_kind != dnnl_blocked || md->ndims != 2 || md->data_type != dnnl_bf16 || md->offset0 != 0 ||
        md->extra.flags != 0 || b->inner_nblks != 3 || b->inner_blks[0] != 16 || b->inner_idxs[0] != 0 ||
        b->inner_blks[1] != 64 || b->inner_idxs[1] != 1 || b->inner_blks[2] != 2 || b->inner_idxs[2] != 0 ||
        md->padded_dims[0] % 32 || md->padded_dims[1] % 64 || md->padded_dims[0] < K || md->padded_dims[1] < N)
        return 0;
    *sk = (long)b->strides[0], *sn = (long)b->strides[1], *kbs = (int)(md->padded_dims[0] / 32);
    return 1;
}

/* A weight product out = A W^T of 1-64 rows on AMX (bf16), on rf_cpu_amx_gemm: W's packed copy
 * is the one oneDNN's products use (made here if none yet), in the layout oneDNN chose for a
 * 16-row product of the weight (the same for every row count, measured). 1 when done; 0 leaves
 * the product to oneDNN. Caller holds g_lock. */
static int gemm_own_amx(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                        const uint16_t *bb, float beta, float *C, int ldc) {
    gemm_key k = {0, 0, 16, N, K, K, 0, N, 1, 1, 1.0f, 0.0f};
    gemm_entry *e = entry_get(&k);
    long sk, sn;
    int kbs;
    if (!e || !e->prim || !amx_layout(&e->wmd, K, N, &sk, &sn, &kbs)) return 0;
    const uint16_t *w = packed_get(B, bb, N, K, ldb, 1, &e->wmd);
    return w && rf_cpu_amx_gemm(M, N, K, alpha, A, lda, w, sk, sn, kbs, beta, C, ldc);
}

/* Runs the product through a cached primitive, or on rf_cpu_amx_gemm where own (own_amx_takes);
 * caller holds g_lock. 1 when done. bb: B's bound bf16 values or NULL (a bound A was widened
 * before). */
static int gemm_prim(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                     const float *B, int ldb, const uint16_t *bb, float beta, float *C, int ldc,
                     int b_weight, int same_a, int own, const uint16_t *a16) {
    int ok = engine_up();
    if (ok && own && gemm_own_amx(M, N, K, alpha, A, lda, B, ldb, bb, beta, C, ldc)) return 1;
    int bf16 = ok && g_prec == RF_PRECISION_BF16, emulated = bf16 && !bf16_native();
    gemm_key k = {ta, tb, M, N, K, lda, ldb, ldc, bf16 && !emulated, 0, alpha, beta};
    const void *a = A, *b = B;
    int ar, ac, br, bc;
    stored(ta, M, K, &ar, &ac);
    stored(tb, K, N, &br, &bc);
    size_t es = emulated ? sizeof(float) : sizeof(uint16_t);
    int amx = bf16 && amx_bf16();
    /* A weight gradient's sum over tokens (x^T dout: A and B both stored with K rows) on AMX:
     * K rounded up to a multiple of 64 with zero rows, which add exactly nothing, so that its
     * shapes repeat (K is a micro-batch's token count, new at every step: 380 primitives in 100
     * steps of the default recipe, 2.2 ms each). AMX's bf16 sums are not batch-invariant: no bits
     * to keep there. */
    int kpad = amx && ta && !tb && !b_weight && !bb ? (K + 63) / 64 * 64 : K;
    const void *held = NULL;
    if (bf16 && a16) { /* A's bf16 values from the caller (native bf16 only: gemm), with room
                          for the zero rows of kpad */
        if (kpad > K) memset((uint16_t *)a16 + (size_t)ar * lda, 0, es * (size_t)(kpad - K) * lda);
        a = a16, k.lda = lda;
    } else if (bf16 && (held = held_get(A, ar, ac, lda, emulated, ta ? kpad - K : 0))) {
        a = held, k.lda = ac; /* a held activation's conversion, padded where kpad needs */
    } else if (bf16) {
        held_a h = {A, ar, ac, lda, emulated}, *g = &g_held_a;
        void *abuf;
        if (same_a && g->src == A && g->rows == ar && g->cols == ac && g->ld == lda && g->emulated == emulated) {
            abuf = g_tls[0]; /* this thread's last product converted this A, unchanged since */
        } else { /* on AMX room for the zero rows a weight gradient reusing it adds (kpad) */
            abuf = tls_buf(0, es * (size_t)(ar + (amx ? 63 : 0)) * ac);
            if (abuf) convert(abuf, A, ar, ac, lda, emulated), *g = h, g_a_conversions++;
        }
        if (abuf && kpad > K) memset((char *)abuf + es * (size_t)ar * ac, 0, es * (size_t)(kpad - K) * ac);
        a = abuf, k.lda = ac;
        ok = a != NULL;
    }
    size_t arow = (size_t)k.lda * (bf16 ? es : sizeof(float)); /* bytes per row of A (not ta) */
    /* row buckets: for the products on packed weights where rows are batch-invariant, and for
     * every product on AMX's bf16 tiles (bucket_rows) */
    int rows_ok = !ta && (beta == 0.0f || beta == 1.0f);
    int bucket_packed = rows_ok && (amx || rf_cpu_batch_invariant_exact_at(g_prec));
    int bucket_plain = rows_ok && amx;
    /* A weight in the kernel's own layout, where it has one (oneDNN's brgemm kernels: 1.1x at
     * 2048 rows, 1.6-1.9x at 32, docs/kernels.md): kept per epoch instead of repacked by every
     * call. Only the forward's W^T (tb): a copy of W for the backward's dout W as well held
     * another 4 bytes a parameter in fp32 (2 in bf16, beside the plain bf16 copy the backward
     * reads) for 1 % of a training step. Emulated bf16 and fp32
     * products of bound values keep the plain copies below. */
    if (ok && b_weight && tb && !emulated && (bf16 || !bb)) {
        gemm_key kp = k;
        kp.pack = 1, kp.tb = 0, kp.ldb = 0; /* the primitive does not see B's plain layout */
        packed_ctx c = {B, bb, N, K, ldb, bf16};
        /* 0 where this shape has no blocked layout (or no memory): the plain operand below */
        if (run_rows(&kp, a, arow, NULL, C, bucket_packed, packed_for, &c)) return 1;
    }
    if (bf16) {
        if (bb && !emulated) { /* bound bf16 values: the operand as stored */
            b = bb;
        } else if (b_weight || bb) {
            b = weight_get(B, br, bc, ldb, emulated, emulated ? bb : NULL), k.ldb = bc;
        } else if ((b = held_get(B, br, bc, ldb, emulated, kpad - K))) {
            k.ldb = bc, k.K = kpad; /* a held activation: the weight gradient's inputs */
        } else {
            void *bbuf = tls_buf(1, es * (size_t)(br + kpad - K) * bc);
            if (bbuf) {
                convert(bbuf, B, br, bc, ldb, emulated);
                memset((char *)bbuf + es * (size_t)br * bc, 0, es * (size_t)(kpad - K) * bc);
            }
            b = bbuf, k.ldb = bc, k.K = kpad;
        }
        ok = ok && b;
    } else if (ok && bb) { /* fp32 products on bound values: widened once per epoch */
        b = weight_get(B, br, bc, ldb, 1, bb), k.ldb = bc;
        ok = b != NULL;
    }
    return ok && run_rows(&k, a, arow, b, C, bucket_plain, NULL, NULL);
}

int rf_cpu_gemm_a16_direct(void) {
    return g_prec == RF_PRECISION_BF16 && rf_cpu_bf16_native();
}

/* The product; a16: A's bf16 values instead of A (rf_cpu_gemm_a16), A NULL then. */
static void gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc, int b_weight, int same_a,
                 const uint16_t *a16) {
    if (!same_a) g_held_a.src = NULL; /* only a conversion this call makes is held after it */
    if (M == 0 || N == 0) return;
    /* An activation whose op wrote only its bf16 values (rf_cpu_held_output): A as those, and B
     * widened where the product does not go through gemm_prim (which reads the hold's values) */
    int ar, ac, br, bc;
    stored(ta, M, K, &ar, &ac);
    stored(tb, K, N, &br, &bc);
    int at_end;
    const uint16_t *hb = b_weight ? NULL : held_direct(B, br, bc, ldb, &at_end);
    if (hb && !tb && !at_end) /* a weight gradient's B, padded the same way (gemm_prim) */
        B = operand_f32(NULL, hb, tb, K, N, &ldb, 3), hb = NULL;
    const uint16_t *ha = !a16 && A ? held_direct(A, ar, ac, lda, &at_end) : NULL;
    if (ha && ta && !at_end) /* on AMX a transposed A is padded in place (kpad), over the rows
                                after it: those of the activation but where its rows end it */
        A = operand_f32(NULL, ha, ta, M, K, &lda, 2), ha = NULL;
    if (ha) a16 = ha, A = NULL;
    int exact = rf_cpu_batch_invariant_exact();
    int own = own_amx_takes(ta, tb, M, N, K, alpha, beta, b_weight);
    int gemv = M <= GEMV_MAX_M && !exact && !own;
    /* bf16 values are read in place only by a product with bf16 operands on oneDNN's
     * primitives; any other path reads A widened to fp32, whose rounding to bf16 gives the same
     * values back */
    if (a16 && (omp_in_parallel() || !rf_cpu_gemm_a16_direct() || own || gemv)) {
        A = operand_f32(NULL, a16, ta, M, K, &lda, 2);
        a16 = NULL;
    }
    if (K == 0) { /* oneDNN refuses empty reductions: C = beta * C */
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
        return;
    }
    const uint16_t *ab = NULL, *bb = NULL;
    if (atomic_load_explicit(&g_n_bind, memory_order_relaxed)) {
        pthread_mutex_lock(&g_lock);
        ab = bind_find(A), bb = bind_find(B);
        pthread_mutex_unlock(&g_lock);
    }
    if (!a16) A = operand_f32(A, ab, ta, M, K, &lda, 2); /* no product reads a weight as A; exact if one does */
    if (omp_in_parallel()) { /* attention's per-head products: fp32 in both modes (the top) */
        B = operand_f32(B, bb ? bb : hb, tb, K, N, &ldb, 3);
        gemm_nested(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, 0);
        return;
    }
    if (gemv && !ta && tb && (b_weight || bb) &&
        gemm_small(M, N, K, alpha, A, lda, B, ldb, bb, beta, C, ldc))
        return;
    /* A small product runs on the calling thread: its primitive is made and run with one
     * OpenMP thread, so no sleeping thread is woken for it (a futex call each way, which cost
     * more than the product: a small model's decoding and training are thousands of these a
     * step). Only where that gives the bits of the product on every thread: oneDNN splits the
     * rows and columns of a plain A among threads, not the sum (no difference in 1320 shapes
     * up to K = 4096, fp32 and bf16, when this was written; test_kernels compares rows of small
     * products with the same rows of large ones), but it does split the sum of a transposed A
     * with few outputs (a dW product: 40 of those shapes differed), which keeps every thread.
     * That is its brgemm kernels, where rows are batch-invariant (rf_cpu_batch_invariant_exact),
     * which run the forward products. The backward's plain-B products (dout W, dz w) run on
     * gemm:jit (backward_pd), whose bf16 kernel splits the sum of a few rows over a long K among
     * threads (20 of 368 shapes, none in fp32): on one thread they get other bits than on two,
     * but always the same for their shape, and no row of theirs is compared with a rollout's.
     * oneDNN's AVX2 gemm splits sums otherwise (ONEDNN_MAX_CPU_ISA=AVX2 moved the default recipe's
     * per-step metrics), so there every product keeps every thread. Products of 1-4 rows keep
     * both threads too: they are bound by reading the weight, which two cores do faster (batch-1
     * decoding of the 25M model 1.45x in fp32, 1.7x in bf16, at the DRAM's read bandwidth), and
     * their bits are the same (test_kernels' batch-invariant rows). AMX's bf16 products, whose
     * rows are not batch-invariant, split rows and columns alike (no difference between one and
     * two threads in 248 products of 5-4089 rows, K 32-4096; test_kernels checks it). */
    int single = !ta && M > GEMV_MAX_M && K <= 4096 && (double)M * N * K <= RF_GEMM_SERIAL_MACS &&
                 (exact || amx_bf16());
    int threads = single ? omp_get_max_threads() : 0;
    if (single) omp_set_num_threads(1);
    pthread_mutex_lock(&g_lock);
    int bf16 = g_prec == RF_PRECISION_BF16;
    int ok = gemm_prim(ta, tb, M, N, K, alpha, A, lda, B, ldb, bb, beta, C, ldc, b_weight, same_a, own, a16);
    pthread_mutex_unlock(&g_lock);
    if (single) omp_set_num_threads(threads);
    if (!ok) { /* no primitive for this shape (or no memory): oneDNN's sgemm, same numbers */
        if (a16) A = operand_f32(NULL, a16, ta, M, K, &lda, 2);
        B = operand_f32(B, bb ? bb : hb, tb, K, N, &ldb, 3);
        if (bf16) {
            gemm_nested(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, 1);
        } else {
            dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        }
    }
}

void rf_cpu_gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc, int b_weight) {
    gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, b_weight, 0, NULL);
}

void rf_cpu_gemm_a16(int ta, int tb, int M, int N, int K, float alpha, const uint16_t *A, int lda,
                     const float *B, int ldb, float beta, float *C, int ldc, int b_weight) {
    gemm(ta, tb, M, N, K, alpha, NULL, lda, B, ldb, beta, C, ldc, b_weight, 0, A);
}


void rf_cpu_gemm_same_a(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                        const float *B, int ldb, float beta, float *C, int ldc, int b_weight) {
    gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, b_weight, 1, NULL);
}

size_t rf_cpu_gemm_a_conversions(void) { return g_a_conversions; }

rf_status rf_cpu_gemm_set_precision(rf_precision p) {
    if (p != RF_PRECISION_FP32 && p != RF_PRECISION_BF16)
        return rf_error(RF_ERR_ARG, "cpu: unknown precision %d", (int)p);
    RF_TRY(rf_cpu_attention_env_check());
    pthread_mutex_lock(&g_lock);
    g_prec = p;
    for (int i = 0; i < g_n_held; i++) held_undirect(&g_held[i]); /* other products read floats */
    pthread_mutex_unlock(&g_lock);
    return RF_OK;
}

rf_precision rf_cpu_gemm_get_precision(void) { return g_prec; }

void rf_cpu_gemm_weights_updated(void) {
    pthread_mutex_lock(&g_lock);
    g_epoch++;
    pthread_mutex_unlock(&g_lock);
}

unsigned rf_cpu_gemm_epoch(void) {
    pthread_mutex_lock(&g_lock);
    unsigned e = g_epoch;
    pthread_mutex_unlock(&g_lock);
    return e;
}

int rf_cpu_bf16_native(void) {
    pthread_mutex_lock(&g_lock);
    int n = bf16_native();
    pthread_mutex_unlock(&g_lock);
    return n;
}

int rf_cpu_isa_has_bf16(void) {
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    /* Each ISA value holds the bits of those it extends (dnnl_types.h); avx512_core_bf16 and
     * avx512_core_amx both contain avx512_core_bf16's bits. */
    return ((unsigned)isa & (unsigned)dnnl_cpu_isa_avx512_core_bf16) ==
           (unsigned)dnnl_cpu_isa_avx512_core_bf16;
}
