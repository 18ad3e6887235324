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

uint32_t rf_crc32c_extend(uint32_t crc, const void *data, size_t n) {
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
