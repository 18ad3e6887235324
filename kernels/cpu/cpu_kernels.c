/* The CPU reference back end: elementwise ops, normalisation, RoPE, embedding, optimizer,
 * memory, and the rf_kernels table that gathers every CPU op. */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif

#include "common/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernel_math.h"
#include "kernels/sample.h"


/* Allocations are 64-byte aligned and zero-filled. Large ones (CPU_MAP_MIN and up) are fresh
 * anonymous mappings, whose pages the kernel hands out zeroed when first touched: a buffer
 * sized for the worst case (the KV-cache pool, activations for the longest batch) costs
 * resident memory only for what is used. Small ones come from malloc and are cleared. A header
 * of 64 bytes before the block says which, and the mapping's length. Not in huge pages
 * (rf_cpu_alloc_lines): a frozen model leaves its matrices' fp32 memory untouched, which a 2 MB
 * page faulted in for a norm beside them would make resident. */
#ifdef __SANITIZE_ADDRESS__
#define CPU_MAP_MIN SIZE_MAX /* AddressSanitizer builds: every block from malloc, with red zones */
#else
#define CPU_MAP_MIN ((size_t)1 << 20)
#endif
#define CPU_HEAD 64
typedef struct cpu_head {
    size_t len;   /* the mapping's bytes (header included); 0: from posix_memalign */
    void *base;   /* what to free or unmap */
    size_t bytes; /* what the caller asked for */
} cpu_head;

/* Asks for transparent huge pages over [p, p + n), p page-aligned; nothing where THP is off. */
static void huge_pages(void *p, size_t n) {
#ifdef MADV_HUGEPAGE
    (void)madvise(p, (n + 4095) & ~(size_t)4095, MADV_HUGEPAGE); /* EINVAL where THP is not built */
#else
    (void)p, (void)n;
#endif
}

void *rf_cpu_carve(void **p, const size_t *sz, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (sz[i] + 63) & ~(size_t)63;
    char *m = aligned_alloc(64, total ? total : 64);
    if (!m) return NULL;
    size_t off = 0;
    for (int i = 0; i < n; i++) p[i] = m + off, off += (sz[i] + 63) & ~(size_t)63;
    return m;
}

void *rf_cpu_alloc_lines(size_t n) {
    n = (n + 63) / 64 * 64;
    if (n < RF_CPU_HUGE_MIN) return aligned_alloc(64, n);
    void *p = NULL; /* posix_memalign: aligned_alloc wants n a multiple of the alignment */
    if (posix_memalign(&p, RF_CPU_HUGE_ALIGN, n) != 0) return NULL;
    huge_pages(p, n);
    return p;
}

static void *cpu_alloc(size_t bytes) {
    size_t n = (bytes + 63) / 64 * 64 + CPU_HEAD;
    void *base = NULL;
    size_t len = 0;
    if (n >= CPU_MAP_MIN) {
        base = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) base = NULL;
        else len = n;
    } else if (posix_memalign(&base, 64, n) == 0) {
        memset(base, 0, n);
    } else {
        base = NULL;
    }
    if (!base) {
        rf_error(RF_ERR_NOMEM, "cpu: out of memory allocating %zu bytes", bytes);
        return NULL;
    }
    cpu_head *h = base;
    h->len = len, h->base = base, h->bytes = bytes;
    return (char *)base + CPU_HEAD;
}

/* A later alloc may hand the same addresses back holding other data: the weight copies made
 * from this block go with it (as on CUDA). */
static void cpu_free(void *p) {
    if (!p) return;
    const cpu_head *h = (const cpu_head *)((char *)p - CPU_HEAD);
    rf_cpu_gemm_forget(p, h->bytes);
    if (h->len) munmap(h->base, h->len);
    else free(h->base);
}
static void cpu_memcpy(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
/* Blocks larger than the last-level cache (Qwen2.5-0.5B's gradients: 2 GB) are zeroed with
 * streaming stores on every thread: glibc's memset filled 2 GB at 10 GB/s on the AMX machine,
 * where two threads of streaming stores reach 45-47 (docs/kernels.md). Smaller ones (the 25M
 * bench model's 104 MB of gradients) keep memset, which leaves them in the cache for the
 * accumulation that follows; streaming them made its step no faster. */
static _Atomic size_t g_zero_stream_min; /* 0: not chosen yet */

static size_t zero_stream_min(void) {
    size_t min = g_zero_stream_min;
    if (!min) {
        long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
        size_t floor = (size_t)32 << 20;
        g_zero_stream_min = min = l3 > 0 && (size_t)l3 > floor ? (size_t)l3 : floor;
    }
    return min;
}

size_t rf_cpu_zero_stream_from(size_t bytes) {
    size_t was = zero_stream_min();
    if (bytes) g_zero_stream_min = bytes;
    return was;
}

static void cpu_zero(void *p, size_t bytes) {
    char *c = p;
    size_t head = (size_t)(-(uintptr_t)c & 63);
    if (bytes < zero_stream_min()) {
        if (bytes) memset(p, 0, bytes);
        return;
    }
    memset(c, 0, head);
    size_t lines = (bytes - head) / 64;
    char *body = c + head;
#ifndef __x86_64__
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < lines; i++) memset(body + 64 * i, 0, 64);
#else
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < lines; i++) {
#if defined(__AVX512F__)
        _mm512_stream_si512((__m512i *)(body + 64 * i), _mm512_setzero_si512());
#elif defined(__AVX__)
        _mm256_stream_si256((__m256i *)(body + 64 * i), _mm256_setzero_si256());
        _mm256_stream_si256((__m256i *)(body + 64 * i + 32), _mm256_setzero_si256());
#else
        for (int k = 0; k < 64; k += 16) _mm_stream_si128((__m128i *)(body + 64 * i + k), _mm_setzero_si128());
#endif
    }
    _mm_sfence(); /* streaming stores are weakly ordered: visible before the next op */
#endif
    memset(body + 64 * lines, 0, bytes - head - 64 * lines);
}
static void cpu_sync(void) {}

static int cpu_mem_info(size_t *free_bytes, size_t *total_bytes) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) {
        rf_error(RF_ERR_IO, "cpu: cannot read /proc/meminfo: %s", strerror(errno));
        return -1;
    }
    char line[256];
    unsigned long long avail = 0, total = 0, kb;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = kb;
        else if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) total = kb;
    }
    fclose(f);
    if (!total) {
        rf_error(RF_ERR_FORMAT, "cpu: /proc/meminfo has no MemTotal line");
        return -1;
    }
    *free_bytes = (size_t)(avail ? avail : total) * 1024, *total_bytes = (size_t)total * 1024;
    return 0;
}

static void cpu_add_inplace(float *a, const float *b, size_t n) {
#pragma omp parallel for if (n > RF_OMP_MIN_COPY)
    for (size_t i = 0; i < n; i++) a[i] += b[i];
}

static void cpu_scale(float *x, float s, size_t n) {
#pragma omp parallel for if (n > RF_OMP_MIN_COPY)
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

/* The sum of squares in one order whatever the number of threads: blocks of SUMSQ_BLOCK
 * floats, element i of a block into double lane i mod SUMSQ_LANES, the lanes added in a fixed
 * tree, the block sums added in block order. Each square is exact in double (a float's 24-bit
 * significand squared), so a fused multiply-add and a product then a sum give the same bits.
 * OpenMP's reduction it replaces ran one dependent chain of double additions per thread: 14 GB/s
 * against the machine's 45-50 (docs/kernels.md), and its result depended on the thread count. */
#define SUMSQ_LANES 32
#define SUMSQ_BLOCK 16384

static double block_sum_squares(const float *x, size_t n) {
    double acc[SUMSQ_LANES] = {0};
    size_t i = 0;
    for (; i + SUMSQ_LANES <= n; i += SUMSQ_LANES)
#pragma omp simd
        for (int l = 0; l < SUMSQ_LANES; l++) acc[l] += (double)x[i + l] * (double)x[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += (double)x[i] * (double)x[i];
    for (int w = SUMSQ_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static double cpu_sum_squares(const float *x, size_t n) {
    size_t nb = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    double stack[64], *part = nb <= 64 ? stack : malloc(nb * sizeof(double)), s = 0.0;
    if (!part) { /* the same sums in the same order, on one thread */
        for (size_t b = 0; b < nb; b++) {
            size_t i0 = b * SUMSQ_BLOCK;
            s += block_sum_squares(x + i0, n - i0 < SUMSQ_BLOCK ? n - i0 : SUMSQ_BLOCK);
        }
        return s;
    }
#pragma omp parallel for schedule(static) if (nb > 1)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * SUMSQ_BLOCK;
        part[b] = block_sum_squares(x + i0, n - i0 < SUMSQ_BLOCK ? n - i0 : SUMSQ_BLOCK);
    }
    for (size_t b = 0; b < nb; b++) s += part[b];
    if (part != stack) free(part);
    return s;
}

static void cpu_embedding_forward(float *out, const int32_t *tokens, const float *wte, int T,
                                  int C) {
    const uint16_t *wb = rf_cpu_bf16_bound(wte); /* a frozen bf16 model's table: rows widened */
#pragma omp parallel for if ((size_t)T * C > RF_OMP_MIN_COPY)
    for (int t = 0; t < T; t++) {
        float *o = out + (size_t)t * C;
        if (tokens[t] < 0) {
            memset(o, 0, sizeof(float) * (size_t)C);
        } else if (wb) {
            const uint16_t *r = wb + (size_t)tokens[t] * C;
            for (int c = 0; c < C; c++) {
                uint32_t u = (uint32_t)r[c] << 16;
                memcpy(&o[c], &u, 4);
            }
        } else {
            memcpy(o, wte + (size_t)tokens[t] * C, sizeof(float) * (size_t)C);
        }
    }
}

static void cpu_embedding_backward(float *dwte, const float *dout, const int32_t *tokens, int T,
                                   int C) {
    /* Serial over tokens: repeated tokens add into the same row. */
    for (int t = 0; t < T; t++) {
        if (tokens[t] < 0) continue;
        float *row = dwte + (size_t)tokens[t] * C;
        const float *d = dout + (size_t)t * C;
        for (int c = 0; c < C; c++) row[c] += d[c];
    }
}

/* With a held output (rf_cpu_held_output: its bf16 values in place of its floats), rows of up
 * to NORM_ROW floats are made in a buffer on the stack and converted; longer ones in out's own
 * floats (which the hold lets the op write) and converted from there. */
#define NORM_ROW 4096
static void cpu_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w, int N,
                                int C, float eps) {
    uint16_t *ob = rf_cpu_held_output(out, (size_t)N * C);
#pragma omp parallel for if ((size_t)N * C > RF_OMP_MIN)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float buf[NORM_ROW], *y = ob && C <= NORM_ROW ? buf : out + (size_t)n * C;
        float ss = 0.0f;
        for (int c = 0; c < C; c++) ss += x[c] * x[c];
        float r = 1.0f / sqrtf(ss / (float)C + eps);
        for (int c = 0; c < C; c++) y[c] = x[c] * r * w[c];
        if (rstd) rstd[n] = r;
        if (ob) rf_cpu_bf16_convert(ob + (size_t)n * C, y, C);
    }
}

/* x += add and the sum of squares in one pass over each row (the same additions and the same
 * order of the sum as cpu_add_inplace then cpu_rmsnorm_forward, so the same bits). */
static void cpu_add_rmsnorm_forward(float *x, float *out, float *rstd, const float *add, const float *w,
                                    int N, int C, float eps) {
    uint16_t *ob = rf_cpu_held_output(out, (size_t)N * C);
#pragma omp parallel for if ((size_t)N * C > RF_OMP_MIN)
    for (int n = 0; n < N; n++) {
        float buf[NORM_ROW], *xr = x + (size_t)n * C, *y = ob && C <= NORM_ROW ? buf : out + (size_t)n * C;
        const float *ar = add + (size_t)n * C;
        float ss = 0.0f;
        for (int c = 0; c < C; c++) {
            float v = xr[c] + ar[c];
            xr[c] = v;
            ss += v * v;
        }
        float r = 1.0f / sqrtf(ss / (float)C + eps);
        for (int c = 0; c < C; c++) y[c] = xr[c] * r * w[c];
        if (rstd) rstd[n] = r;
        if (ob) rf_cpu_bf16_convert(ob + (size_t)n * C, y, C);
    }
}

static void cpu_rmsnorm_backward(float *dinp, float *dw, const float *dout, const float *inp,
                                 const float *w, const float *rstd, int N, int C) {
#pragma omp parallel for if ((size_t)N * C > RF_OMP_MIN)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float r = rstd[n], dot = 0.0f;
        for (int c = 0; c < C; c++) dot += dy[c] * w[c] * x[c];
        float k = dot * r * r * r / (float)C;
        for (int c = 0; c < C; c++) dx[c] += r * w[c] * dy[c] - k * x[c];
    }
    if (!dw) return; /* a frozen norm (LoRA) */
    /* dw[c] += sum_n dout[n, c] inp[n, c] rstd[n], each column summed in n order as one
     * serial chain (the same bits whatever the thread count), 16 columns at a time so that
     * the rows are read contiguously and the 16 chains run in one vector */
#pragma omp parallel for if ((size_t)N * C > RF_OMP_MIN)
    for (int c0 = 0; c0 < C; c0 += 16) {
        int nc = C - c0 < 16 ? C - c0 : 16;
        float s[16] = {0};
        for (int n = 0; n < N; n++) {
            const float *dy = dout + (size_t)n * C + c0, *x = inp + (size_t)n * C + c0;
            float r = rstd[n];
#pragma omp simd
            for (int j = 0; j < nc; j++) s[j] += dy[j] * x[j] * r;
        }
        for (int j = 0; j < nc; j++) dw[c0 + j] += s[j];
    }
}

/* The angle's cosine and sine depend on (t, i) only: computed once per position for all H heads
 * (H times fewer sincos than per pair), then the rotation, vectorised over i. Same roundings as
 * rf_rope_pair, so the same bits. */
#define ROPE_HALF_MAX 512
static void cpu_rope(float *x, const int32_t *pos, const float *inv_freq, int T, int H, int D,
                     int sign) {
    int half = D / 2;
    if (half > ROPE_HALF_MAX) {
#pragma omp parallel for collapse(2) if ((size_t)T * H * D > RF_OMP_MIN)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                float *xh = x + ((size_t)t * H + h) * D;
                for (int i = 0; i < half; i++)
                    rf_rope_pair(xh + i, xh + i + half, (float)pos[t] * inv_freq[i], sign);
            }
        return;
    }
#pragma omp parallel for if ((size_t)T * H * D > RF_OMP_MIN)
    for (int t = 0; t < T; t++) {
        float cs[ROPE_HALF_MAX], sn[ROPE_HALF_MAX];
        for (int i = 0; i < half; i++) {
            float angle = (float)pos[t] * inv_freq[i];
            cs[i] = cosf(angle), sn[i] = sign * sinf(angle);
        }
        for (int h = 0; h < H; h++) {
            float *x0 = x + ((size_t)t * H + h) * D, *x1 = x0 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = x0[i], b = x1[i];
                x0[i] = a * cs[i] - b * sn[i];
                x1[i] = b * cs[i] + a * sn[i];
            }
        }
    }
}

/* Rotates the heads x (H, D) of one position by the angles' cs, sn (half). */
static inline void rope_heads(float *x, int H, int half, const float *cs, const float *sn) {
    for (int h = 0; h < H; h++) {
        float *x0 = x + (size_t)h * 2 * half, *x1 = x0 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            float a = x0[i], b = x1[i];
            x0[i] = a * cs[i] - b * sn[i];
            x1[i] = b * cs[i] + a * sn[i];
        }
    }
}

/* cpu_rope's rotation on q's H heads and k's KVH heads with one sincos per (t, i). */
static void cpu_rope_qk(float *q, float *k, const int32_t *pos, const float *inv_freq, int T, int H, int KVH,
                        int D, int sign) {
    int half = D / 2;
    if (half > ROPE_HALF_MAX) {
        cpu_rope(q, pos, inv_freq, T, H, D, sign);
        cpu_rope(k, pos, inv_freq, T, KVH, D, sign);
        return;
    }
#pragma omp parallel for if ((size_t)T * (H + KVH) * D > RF_OMP_MIN)
    for (int t = 0; t < T; t++) {
        float cs[ROPE_HALF_MAX], sn[ROPE_HALF_MAX];
        for (int i = 0; i < half; i++) {
            float angle = (float)pos[t] * inv_freq[i];
            cs[i] = cosf(angle), sn[i] = sign * sinf(angle);
        }
        rope_heads(q + (size_t)t * H * D, H, half, cs, sn);
        rope_heads(k + (size_t)t * KVH * D, KVH, half, cs, sn);
    }
}

static void cpu_heads_expand(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group) {
#pragma omp parallel for if ((size_t)T * H * D > RF_OMP_MIN)
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++)
            memcpy(dst + ((size_t)t * H + i) * D, src + ((size_t)t * KV + (h0 + i) / group - h0 / group) * D,
                   sizeof(float) * (size_t)D);
}

/* Draws in parallel: each reads its own row, so the picks do not depend on the threads. */
static void cpu_sample_rows(int32_t *picks, float *logp, const float *logits, int V, const rf_row_draw *draws,
                            int n) {
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && (size_t)n * V > RF_OMP_MIN)
    for (int i = 0; i < n; i++) {
        const rf_row_draw *d = &draws[i];
        picks[i] = rf_draw_whole(logits + (size_t)d->row * V, V, d->inv_temp, d->greedy, d->u, &logp[i]);
    }
}

static void cpu_row_lse(float *lse, const float *logits, int V, const rf_row_draw *draws, int n) {
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && (size_t)n * V > RF_OMP_MIN)
    for (int i = 0; i < n; i++) lse[i] = rf_row_lse(logits + (size_t)draws[i].row * V, V, draws[i].inv_temp, NULL);
}

static void cpu_heads_reduce(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group) {
#pragma omp parallel for if ((size_t)T * H * D > RF_OMP_MIN)
    for (int t = 0; t < T; t++) {
        memset(dst + (size_t)t * KV * D, 0, sizeof(float) * (size_t)KV * D);
        for (int i = 0; i < H; i++) {
            float *o = dst + ((size_t)t * KV + (h0 + i) / group - h0 / group) * D;
            const float *x = src + ((size_t)t * H + i) * D;
            for (int d = 0; d < D; d++) o[d] += x[d];
        }
    }
}

/* One pass over param, grad, m, v (28 bytes per element moved: 16 read, 12 written), threaded
 * and vectorised; the clipping factor gs is applied as the gradient is read (bench_matmul's
 * adamw line gives its bandwidth against a memory copy). */
static void cpu_adamw(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                      float beta1, float beta2, float eps, float weight_decay, int step,
                      float gs) {
    float bc1 = (float)(1.0 - pow(beta1, step)), bc2 = (float)(1.0 - pow(beta2, step));
#pragma omp parallel for simd schedule(static) if (n > RF_OMP_MIN)
    for (size_t i = 0; i < n; i++)
        param[i] = rf_adamw_elem(param[i], grad[i] * gs, m + i, v + i, lr, beta1, beta2, eps,
                                 weight_decay, bc1, bc2);
}

/* kernels/cpu/cpu_paged.c (declared here rather than in cpu_internal.h: only this table uses
 * them) */
void rf_cpu_paged_kv_write(float *k_pool, float *v_pool, const float *k, const float *v,
                           const int32_t *slots, int T, int KVH, int D);
void rf_cpu_paged_attention_forward(float *out, const float *q, const float *k_pool,
                                    const float *v_pool, const int32_t *q_off,
                                    const int32_t *block_table, int max_blocks,
                                    const int32_t *k_len, int n_seq, int block_size, int H,
                                    int KVH, int D);


/* The memory kept between calls: the LM head's saved logits and scratch, held activations'
 * conversions. */
static void cpu_trim(void) {
    rf_cpu_logprob_trim();
    rf_cpu_operands_trim();
}

static const rf_kernels cpu_table = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .to_device = cpu_memcpy,
    .to_host = cpu_memcpy,
    .copy = cpu_memcpy,
    .zero = cpu_zero,
    .sync = cpu_sync,
    .mem_info = cpu_mem_info,
    .set_precision = rf_cpu_gemm_set_precision,
    .get_precision = rf_cpu_gemm_get_precision,
    .weights_updated = rf_cpu_gemm_weights_updated,
    .add_inplace = cpu_add_inplace,
    .scale = cpu_scale,
    .sum_squares = cpu_sum_squares,
    .matmul_forward = rf_cpu_matmul_forward,
    .matmul_backward = rf_cpu_matmul_backward,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .add_rmsnorm_forward = cpu_add_rmsnorm_forward,
    .rope = cpu_rope,
    .rope_qk = cpu_rope_qk,
    .attention_forward = rf_cpu_attention_forward,
    .attention_backward = rf_cpu_attention_backward,
    .swiglu_forward = rf_cpu_swiglu_forward,
    .swiglu_backward = rf_cpu_swiglu_backward,
    .logprob_forward = rf_cpu_logprob_forward,
    .logprob_backward = rf_cpu_logprob_backward,
    .adamw = cpu_adamw,
    .paged_kv_write = rf_cpu_paged_kv_write,
    .paged_attention_forward = rf_cpu_paged_attention_forward,
    .logprob_vp_partials = rf_cpu_logprob_vp_partials,
    .logprob_vp_backward = rf_cpu_logprob_vp_backward,
    .heads_expand = cpu_heads_expand,
    .heads_reduce = cpu_heads_reduce,
    .sample_rows = cpu_sample_rows,
    .row_lse = cpu_row_lse,
    .bind_bf16 = rf_cpu_bind_bf16,
    .trim = cpu_trim,
    .operand_hold = rf_cpu_operand_hold,
    .operands_release = rf_cpu_operands_release,
};

const rf_kernels *rf_cpu_kernels(void) { return &cpu_table; }
