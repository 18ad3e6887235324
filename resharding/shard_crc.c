/* CRC-32C of the whole parameter buffer from its shards: runs of zeros by multiplication
 * modulo the polynomial (zlib 1.2.12, crc32.c), the data by the fast CRC. */
#include "resharding/shard_crc.h"

#include <pthread.h>

#include "common/crc32c.h"

#define POLY 0x82f63b78u /* CRC-32C, reflected */

/* a(x) * b(x) modulo p(x), reflected: bit 31 is x^0. a must not be zero. */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(2^k) modulo p(x), k < 64: zlib's table stops at 32 and wraps k, which holds for CRC-32's
 * polynomial (x^(2^k) repeats with period 32) but not for CRC-32C's, whose zero runs of 2^29
 * bytes (512 MiB) and more came out wrong (a 142M-parameter model's tensor-parallel checksums). */
static uint32_t x2n_table[64];
static pthread_once_t x2n_once = PTHREAD_ONCE_INIT;

static void x2n_init(void) {
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int k = 1; k < 64; k++) x2n_table[k] = p = multmodp(p, p);
}

/* x^(n * 2^k) modulo p(x); n * 2^k < 2^64. */
static uint32_t x2nmodp(uint64_t n, unsigned k) {
    uint32_t p = 1u << 31; /* x^0 */
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k], p);
        n >>= 1;
        k++;
    }
    return p;
}

uint32_t rf_crc32c_zeros(uint32_t crc, uint64_t n) {
    if (n == 0) return crc;
    pthread_once(&x2n_once, x2n_init);
    /* the register (the finished value without the final xor) times x^(8n) */
    return multmodp(x2nmodp(n, 3), crc ^ 0xffffffffu) ^ 0xffffffffu;
}

/* A CRC being extended with data and runs of zeros; runs are held back and merged until the
 * next data, and the multiplier of the last run length is kept (a row-parallel tensor repeats
 * one length per row). */
typedef struct walker {
    uint32_t crc;
    uint64_t zeros;       /* bytes of zeros not applied yet */
    uint64_t last_n;      /* run length of last_x */
    uint32_t last_x;      /* x^(8 last_n) */
} walker;

static void add_zeros(walker *w, uint64_t bytes) { w->zeros += bytes; }

static void add_data(walker *w, const float *p, size_t n) {
    if (n == 0) return;
    if (w->zeros) {
        if (w->zeros != w->last_n) w->last_n = w->zeros, w->last_x = x2nmodp(w->zeros, 3);
        w->crc = multmodp(w->last_x, w->crc ^ 0xffffffffu) ^ 0xffffffffu;
        w->zeros = 0;
    }
    w->crc = rf_crc32c_extend(w->crc, p, n * sizeof(float));
}

uint32_t rf_shard_crc32c_part(const rf_param_table *pt, const rf_shard *shards, int t, const float *local) {
    pthread_once(&x2n_once, x2n_init);
    walker w = {0, 0, 0, 0};
    size_t at = 0; /* floats of the whole buffer walked so far */
    for (int i = 0; i < pt->n_views; i++) {
        const rf_param_view *v = &pt->views[i];
        const rf_shard *s = &shards[i];
        add_zeros(&w, (uint64_t)(v->offset - at) * sizeof(float)); /* nothing between views today */
        int64_t cols = s->full_cols, wd = s->c1 - s->c0;
        const float *blk = local + s->offset;
        if (s->split == RF_SPLIT_REPLICATED) {
            if (t == 0) add_data(&w, blk, v->numel);
            else add_zeros(&w, (uint64_t)v->numel * sizeof(float));
        } else if (s->split == RF_SPLIT_ROWS) {
            add_zeros(&w, (uint64_t)(s->r0 * cols) * sizeof(float));
            add_data(&w, blk, (size_t)((s->r1 - s->r0) * cols));
            add_zeros(&w, (uint64_t)((s->full_rows - s->r1) * cols) * sizeof(float));
        } else {
            for (int64_t r = 0; r < s->full_rows; r++) {
                add_zeros(&w, (uint64_t)s->c0 * sizeof(float));
                add_data(&w, blk + r * wd, (size_t)wd);
                add_zeros(&w, (uint64_t)(cols - s->c1) * sizeof(float));
            }
        }
        at = v->offset + v->numel;
    }
    /* trailing zeros: applied in full (not merged into a next run) */
    return rf_crc32c_zeros(w.crc, w.zeros);
}

uint32_t rf_shard_crc32c_join(const uint32_t *parts, int tp, size_t full_floats) {
    uint32_t crc = 0;
    for (int t = 0; t < tp; t++) crc ^= parts[t];
    /* each part carries crc(0^n) once: an odd number of them leaves it once, as in crc(whole) */
    if (tp % 2 == 0) crc ^= rf_crc32c_zeros(0, (uint64_t)full_floats * sizeof(float));
    return crc;
}
