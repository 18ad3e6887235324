#define _POSIX_C_SOURCE 200809L
#include "common/crc32c.h"

#include <pthread.h>
#include <string.h>

/* rf_crc32c_table[k][b]: the CRC register after feeding byte b followed by k zero bytes.
 * Table 0 is the classic byte-at-a-time table; tables 1..7 let slice-by-8 fold 8 input bytes
 * with 8 independent look-ups. 8 KiB in all. */
static uint32_t rf_crc32c_table[8][256];
static pthread_once_t rf_crc32c_once = PTHREAD_ONCE_INIT;

static void rf__crc32c_init(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int i = 0; i < 8; i++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        rf_crc32c_table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t c = rf_crc32c_table[k - 1][b];
            rf_crc32c_table[k][b] = (c >> 8) ^ rf_crc32c_table[0][c & 0xFFu];
        }
}

/* Loads 8 bytes as a little-endian integer whatever the host's byte order and alignment. */
static inline uint64_t rf__load_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

uint32_t rf_crc32c_table_extend(uint32_t crc, const void *data, size_t n) {
    pthread_once(&rf_crc32c_once, rf__crc32c_init);
    const uint32_t(*t)[256] = (const uint32_t(*)[256])rf_crc32c_table;
    const unsigned char *p = data;
    uint32_t c = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w = rf__load_le64(p) ^ c;
        c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^
            t[4][(w >> 24) & 0xFF] ^ t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^
            t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    }
    for (; n > 0; n--, p++) c = (c >> 8) ^ t[0][(c ^ *p) & 0xFF];
    return ~c;
}

uint32_t rf_crc32c(const void *data, size_t n) { return rf_crc32c_extend(0, data, n); }

/* ---- the SSE4.2 path ------------------------------------------------------------------------
 * CRC-32C with the SSE4.2 crc32 instruction (Intel SDM, CRC32; polynomial 0x1EDC6F41, the
 * reflected register the tables above keep).
 *
 * One crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle, so a single
 * chain runs at a third of the unit's speed. Blocks of 3 x BLOCK bytes are fed as three chains
 * (the register carried into the first, zero into the other two) and joined with the linearity
 * of CRCs over GF(2):
 *     R(c, A || B) = Z_|B|(R(c, A)) ^ R(0, B)
 * where R(c, D) is the register after feeding D from c, and Z_n(c) = R(c, n zero bytes) is a
 * linear map of c, tabulated once per byte of c (4 x 256 entries) by running the instruction
 * over BLOCK zero bytes from each of the 32 unit registers. The same idea as Mark Adler's
 * crc32c.c (zlib's crc32_combine); the code is ours. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>

#define BLOCK 4096 /* bytes per chain per step: 12 KiB a step stays in L1 */

static uint32_t g_zeros[4][256]; /* g_zeros[k][b] = Z_BLOCK(b << 8k) */
static int g_hw;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

__attribute__((target("sse4.2"))) static uint32_t zeros_of(uint32_t c) {
    uint64_t r = c;
    for (int i = 0; i < BLOCK / 8; i++) r = _mm_crc32_u64(r, 0);
    return (uint32_t)r;
}

static void init(void) {
    __builtin_cpu_init();
    g_hw = __builtin_cpu_supports("sse4.2") != 0;
    if (!g_hw) return;
    uint32_t unit[32];
    for (int i = 0; i < 32; i++) unit[i] = zeros_of(1u << i);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t z = 0;
            for (int j = 0; j < 8; j++)
                if (b >> j & 1) z ^= unit[8 * k + j];
            g_zeros[k][b] = z;
        }
}

static inline uint32_t shift(uint32_t c) {
    return g_zeros[0][c & 0xff] ^ g_zeros[1][(c >> 8) & 0xff] ^ g_zeros[2][(c >> 16) & 0xff] ^ g_zeros[3][c >> 24];
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v); /* x86: unaligned loads are fine and little-endian */
    return v;
}

/* Feeds n bytes at p into the CRC; with `copy`, also stores them at d (non-temporal stores:
 * the destination is not read first, as memcpy does for large copies), so a copy and its
 * checksum read the source once. */
__attribute__((always_inline, target("sse4.2"))) static inline uint32_t hw_body(uint32_t crc, unsigned char *d,
                                                                                const unsigned char *p, size_t n, int copy) {
    uint64_t c0 = (uint32_t)~crc;
    while (n >= 3 * BLOCK) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < BLOCK; i += 8) {
            uint64_t v0 = load64(p + i), v1 = load64(p + BLOCK + i), v2 = load64(p + 2 * BLOCK + i);
            c0 = _mm_crc32_u64(c0, v0);
            c1 = _mm_crc32_u64(c1, v1);
            c2 = _mm_crc32_u64(c2, v2);
            if (copy) {
                _mm_stream_si64((long long *)(void *)(d + i), (long long)v0);
                _mm_stream_si64((long long *)(void *)(d + BLOCK + i), (long long)v1);
                _mm_stream_si64((long long *)(void *)(d + 2 * BLOCK + i), (long long)v2);
            }
        }
        c0 = shift(shift((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * BLOCK, n -= 3 * BLOCK;
        if (copy) d += 3 * BLOCK;
    }
    if (copy) {
        _mm_sfence();
        memcpy(d, p, n);
    }
    for (; n >= 8; p += 8, n -= 8) c0 = _mm_crc32_u64(c0, load64(p));
    uint32_t c = (uint32_t)c0;
    for (; n > 0; p++, n--) c = _mm_crc32_u8(c, *p);
    return ~c;
}

__attribute__((target("sse4.2"))) static uint32_t hw(uint32_t crc, const unsigned char *p, size_t n) {
    return hw_body(crc, NULL, p, n, 0);
}

/* Non-temporal 8-byte stores need 8-byte aligned destinations. */
__attribute__((target("sse4.2"))) static uint32_t hw_copy(uint32_t crc, unsigned char *d, const unsigned char *p, size_t n) {
    size_t head = (8 - ((uintptr_t)d & 7)) & 7;
    if (head > n) head = n;
    memcpy(d, p, head);
    crc = hw_body(crc, NULL, p, head, 0);
    return hw_body(crc, d + head, p + head, n - head, 1);
}

uint32_t rf_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n) {
    pthread_once(&g_once, init);
    if (g_hw) return hw_copy(crc, dst, src, n);
    memcpy(dst, src, n);
    return rf_crc32c_table_extend(crc, dst, n);
}

uint32_t rf_crc32c_extend(uint32_t crc, const void *data, size_t n) {
    pthread_once(&g_once, init);
    return g_hw ? hw(crc, data, n) : rf_crc32c_table_extend(crc, data, n);
}

int rf_crc32c_hw(void) {
    pthread_once(&g_once, init);
    return g_hw;
}

#else

uint32_t rf_crc32c_extend(uint32_t crc, const void *data, size_t n) { return rf_crc32c_table_extend(crc, data, n); }
int rf_crc32c_hw(void) { return 0; }

uint32_t rf_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n) {
    memcpy(dst, src, n);
    return rf_crc32c_table_extend(crc, dst, n);
}

#endif

