/* Decoding's weight products on AMX's tiles: C (M, N) = alpha * A (M, K) W^T + beta * C for
 * 1-64 rows of A, W read from oneDNN's own blocked copy of it (the copy its AMX kernels use:
 * cpu_gemm.c's packed weights, no second copy).
 *
 * Why a kernel of our own beside oneDNN's: at these row counts a product is bound by reading
 * its weight from memory, and oneDNN 2.6's AMX kernel read Qwen2.5-0.5B's 896 x 4864 weight at
 * 14-17 GB/s with 32 rows where a plain read of memory ran at 25 (docs/kernels.md). Its tile
 * loads wait on memory: a tile register is not renamed, so the next load into it waits for the
 * multiply reading it, and nothing runs ahead. Here the weight's blocks are fetched ahead
 * (into L2 16 blocks ahead, into L1 2 ahead) and each block is read whole (64 columns a pass:
 * 16 rows of A at a time, the passes after the first reading the blocks again from L2).
 *
 * Arithmetic: every output is one chain of tile multiply-adds over K in blocks of 32, from
 * zero, then alpha and beta as oneDNN applies them (beta 0, or 1 with alpha 1). A row's bits do
 * not depend on the other rows of the product. Where oneDNN does not split the sum of a
 * product (measured: K up to 1408 with any N, and K up to 4864 with N up to 1000, which covers
 * Qwen2.5-0.5B's products) these are oneDNN's bits, and test_kernels checks that; where it
 * does (K 2048 and more with N 4864 and more) they differ from oneDNN's in the last bits.
 *
 * Built where the compiler knows AMX's intrinsics (GCC 11, clang 12) for x86-64, whatever
 * -march says (the functions carry their own target); runs where the kernel lets the process
 * use AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM). */
#define _DEFAULT_SOURCE /* syscall */
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define RF_CPU_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef RF_CPU_AMX

#define AMX_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a state component */
#define AMX_XTILEDATA 18          /* the tile data's state component */
#define AMX_AHEAD_L1 2            /* blocks of 32 inputs fetched ahead into L1 */
#define AMX_AHEAD_L2 16           /* and into L2 */

/* The tile configuration: palette 1, tiles 0-7 of 16 rows of 64 bytes (A: 16 rows x 32 bf16;
 * B: 16 pairs of inputs x 16 columns x 2; C: 16 x 16 floats). A constant in memory, so that no
 * store into it can be dropped before ldtilecfg reads it. */
typedef struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;
static const amx_config g_config __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

/* Fetches block (nb, kb) of the weight ahead (into L1 when l1, else L2), stepping into the next
 * column block past the last kb; nothing past nb1. */
static inline void fetch_block(const uint16_t *w, long sk, long sn, int kbs, int nb, int kb, int nb1, int l1) {
    nb += kb / kbs, kb %= kbs;
    if (nb >= nb1) return;
    const char *p = (const char *)(w + (size_t)kb * sk + (size_t)nb * sn);
    if (l1)
        for (int l = 0; l < 4096; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    else
        for (int l = 0; l < 4096; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
}

/* Column blocks [nb0, nb1) of the product: per block of 64 columns and 16 rows of a (bf16,
 * rows of kbs * 32 values, zero past K and past the rows), four C tiles summed over the
 * blocks of 32 inputs, then written to C. */
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void amx_columns(
    int M, int N, const uint16_t *a, const uint16_t *w, long sk, long sn, int kbs, float alpha,
    float beta, float *C, int ldc, int nb0, int nb1) {
    float acc[16][64] __attribute__((aligned(64)));
    size_t lda = (size_t)kbs * 64; /* bytes */
    int R = (M + 15) / 16;
    _tile_loadconfig(&g_config);
    for (int nb = nb0; nb < nb1; nb++) {
        int n0 = nb * 64, nc = N - n0 < 64 ? N - n0 : 64;
        for (int r = 0; r < R; r++) {
            const uint16_t *ar = a + (size_t)r * 16 * kbs * 32;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int kb = 0; kb < kbs; kb++) {
                if (r == 0) { /* the first pass reads the block from memory; the others from L2 */
                    fetch_block(w, sk, sn, kbs, nb, kb + AMX_AHEAD_L1, nb1, 1);
                    fetch_block(w, sk, sn, kbs, nb, kb + AMX_AHEAD_L2, nb1, 0);
                }
                /* block (kb, nb): 16 rows (pairs of inputs) of 64 columns x 2 bf16, 256 bytes */
                const char *b = (const char *)(w + (size_t)kb * sk + (size_t)nb * sn);
                _tile_loadd(1, b, 256);
                _tile_loadd(2, b + 64, 256);
                _tile_loadd(3, b + 128, 256);
                _tile_loadd(0, ar + kb * 32, lda);
                _tile_dpbf16ps(4, 0, 1);
                _tile_dpbf16ps(5, 0, 2);
                _tile_dpbf16ps(6, 0, 3);
                _tile_loadd(1, b + 192, 256);
                _tile_dpbf16ps(7, 0, 1);
            }
            _tile_stored(4, &acc[0][0], 256);
            _tile_stored(5, &acc[0][16], 256);
            _tile_stored(6, &acc[0][32], 256);
            _tile_stored(7, &acc[0][48], 256);
            int rows = M - r * 16 < 16 ? M - r * 16 : 16;
            for (int m = 0; m < rows; m++) {
                float *c = C + (size_t)(r * 16 + m) * ldc + n0;
                const float *s = acc[m];
                if (beta != 0.0f)
                    for (int j = 0; j < nc; j++) c[j] = s[j] + c[j];
                else if (alpha != 1.0f)
                    for (int j = 0; j < nc; j++) c[j] = alpha * s[j];
                else
                    memcpy(c, s, sizeof(float) * (size_t)nc);
            }
        }
    }
    _tile_release();
}

/* ---- tile products for attention (cpu_attention_amx.c) ---- */

__attribute__((target("amx-tile"))) void rf_cpu_amx_tiles_begin(void) { _tile_loadconfig(&g_config); }

__attribute__((target("amx-tile"))) void rf_cpu_amx_tiles_end(void) { _tile_release(); }

/* C (M, N) = (acc ? C : 0) + A B by blocks of 32 x 32 outputs (tiles 4-7), each output one chain
 * of tile multiply-adds over K in blocks of 32 from the first (the hardware's own order inside a
 * block): the same bits for a row whatever the other rows are. */
__attribute__((target("amx-tile,amx-bf16"))) void rf_cpu_amx_tile_gemm(
    int M, int N, int K, const uint16_t *A, int lda, const uint32_t *B, int ldb, float *C, int ldc,
    int acc) {
    size_t sa = (size_t)lda * 2, sb = (size_t)ldb * 4, sc = (size_t)ldc * 4;
    int M32 = M & ~31;
    for (int m0 = 0; m0 < M32; m0 += 32)
        for (int n0 = 0; n0 < N; n0 += 32) {
            float *c = C + (size_t)m0 * ldc + n0, *c1 = c + (size_t)16 * ldc;
            if (acc) {
                _tile_loadd(4, c, sc);
                _tile_loadd(5, c + 16, sc);
                _tile_loadd(6, c1, sc);
                _tile_loadd(7, c1 + 16, sc);
            } else {
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
            }
            const uint16_t *a = A + (size_t)m0 * lda;
            for (int k0 = 0; k0 < K; k0 += 32) {
                const uint32_t *b = B + (size_t)(k0 / 2) * ldb + n0;
                _tile_loadd(0, a + k0, sa);
                _tile_loadd(1, a + (size_t)16 * lda + k0, sa);
                _tile_loadd(2, b, sb);
                _tile_loadd(3, b + 16, sb);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
            _tile_stored(4, c, sc);
            _tile_stored(5, c + 16, sc);
            _tile_stored(6, c1, sc);
            _tile_stored(7, c1 + 16, sc);
        }
    if (M32 < M) /* 16 rows left: one tile of A */
        for (int n0 = 0; n0 < N; n0 += 32) {
            float *c = C + (size_t)M32 * ldc + n0;
            if (acc) {
                _tile_loadd(4, c, sc);
                _tile_loadd(5, c + 16, sc);
            } else {
                _tile_zero(4);
                _tile_zero(5);
            }
            const uint16_t *a = A + (size_t)M32 * lda;
            for (int k0 = 0; k0 < K; k0 += 32) {
                const uint32_t *b = B + (size_t)(k0 / 2) * ldb + n0;
                _tile_loadd(0, a + k0, sa);
                _tile_loadd(2, b, sb);
                _tile_loadd(3, b + 16, sb);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
            }
            _tile_stored(4, c, sc);
            _tile_stored(5, c + 16, sc);
        }
}

int rf_cpu_amx_ready(void) {
    static atomic_int ready = -1;
    int v = atomic_load(&ready);
    if (v < 0) {
        v = syscall(SYS_arch_prctl, AMX_REQ_XCOMP_PERM, AMX_XTILEDATA) == 0;
        atomic_store(&ready, v);
    }
    return v;
}

int rf_cpu_amx_fits(int M, float alpha, float beta) {
    return M >= 1 && M <= RF_CPU_AMX_MAX_ROWS && (beta == 0.0f || (beta == 1.0f && alpha == 1.0f)) &&
           rf_cpu_amx_ready();
}

/* The A operand rounded to bf16, rows of kbs * 32 values zero past K, and zero rows up to a
 * multiple of 16: per thread, as long as the thread. */
static _Thread_local uint16_t *g_a;
static _Thread_local size_t g_a_cap;
static atomic_size_t g_products; /* rf_cpu_amx_products */

size_t rf_cpu_amx_products(void) { return atomic_load(&g_products); }

int rf_cpu_amx_gemm(int M, int N, int K, float alpha, const float *A, int lda, const uint16_t *w,
                    long sk, long sn, int kbs, float beta, float *C, int ldc) {
    if (!w || kbs * 32 < K || !rf_cpu_amx_fits(M, alpha, beta)) return 0;
    int R = (M + 15) / 16, kp = kbs * 32;
    size_t need = sizeof(uint16_t) * (size_t)R * 16 * kp;
    if (g_a_cap < need) {
        free(g_a);
        g_a = rf_cpu_alloc_lines(need);
        g_a_cap = g_a ? need : 0;
        if (!g_a) return 0;
    }
    memset(g_a + (size_t)M * kp, 0, sizeof(uint16_t) * (size_t)(R * 16 - M) * kp);
    for (int m = 0; m < M; m++) {
        rf_cpu_bf16_convert(g_a + (size_t)m * kp, A + (size_t)m * lda, K);
        memset(g_a + (size_t)m * kp + K, 0, sizeof(uint16_t) * (size_t)(kp - K));
    }
    int nbs = (N + 63) / 64, nt = omp_get_max_threads();
    if (nt > nbs) nt = nbs;
    const uint16_t *a = g_a;
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int nb0 = (int)((long)nbs * t / n), nb1 = (int)((long)nbs * (t + 1) / n);
        if (nb1 > nb0) amx_columns(M, N, a, w, sk, sn, kbs, alpha, beta, C, ldc, nb0, nb1);
    }
    atomic_fetch_add(&g_products, 1);
    return 1;
}

#else /* no AMX intrinsics in this compiler or not x86-64: oneDNN's products throughout */

int rf_cpu_amx_ready(void) { return 0; }

int rf_cpu_amx_fits(int M, float alpha, float beta) {
    (void)M, (void)alpha, (void)beta;
    return 0;
}

size_t rf_cpu_amx_products(void) { return 0; }

void rf_cpu_amx_tiles_begin(void) {}
void rf_cpu_amx_tiles_end(void) {}
void rf_cpu_amx_tile_gemm(int M, int N, int K, const uint16_t *A, int lda, const uint32_t *B, int ldb,
                          float *C, int ldc, int acc) {
    (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)acc;
    RF_ASSERT(!"rf_cpu_amx_tile_gemm without AMX");
}

int rf_cpu_amx_gemm(int M, int N, int K, float alpha, const float *A, int lda, const uint16_t *w,
                    long sk, long sn, int kbs, float beta, float *C, int ldc) {
    (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)lda, (void)w, (void)sk, (void)sn;
    (void)kbs, (void)beta, (void)C, (void)ldc;
    return 0;
}

#endif
