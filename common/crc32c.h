/* CRC-32C (Castagnoli), the checksum of iSCSI (RFC 3720, appendix B.4), ext4, and TFRecord
 * framing, and TFRecord's "masked" form of it.
 *
 * Polynomial 0x1EDC6F41, reflected 0x82F63B78; initial value and final xor 0xFFFFFFFF. The
 * table-driven slice-by-8 form processes 8 bytes per step (Intel, "A Systematic Approach to
 * Building High Performance Software-based CRC Generators", Kounavis & Berry 2005). */
#ifndef RF_CRC32C_H
#define RF_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C of n bytes. rf_crc32c("123456789", 9) == 0xE3069283. Thread-safe (the tables are
 * built once, under pthread_once). */
uint32_t rf_crc32c(const void *data, size_t n);

/* Continues a CRC: rf_crc32c_extend(rf_crc32c(a, na), b, nb) == CRC of a followed by b.
 * `crc` is a finished CRC value (0 for "nothing yet"), not the raw register. Uses the SSE4.2
 * crc32 instruction on three interleaved streams where the CPU has it (about 13 GB/s here, at
 * memory speed: resharding and weight transfers check every byte), the tables elsewhere. */
uint32_t rf_crc32c_extend(uint32_t crc, const void *data, size_t n);

/* Copies n bytes from src to dst (not overlapping) and returns rf_crc32c_extend(crc, src, n),
 * reading the source once: a checked copy at about the speed of memcpy where the CPU has
 * SSE4.2 (the destination is written with non-temporal stores, as memcpy does for large
 * copies). */
uint32_t rf_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n);

/* The table-driven slice-by-8 form (about 2.3 GB/s), bit for bit the same function: the
 * reference the tests hold the hardware path to. */
uint32_t rf_crc32c_table_extend(uint32_t crc, const void *data, size_t n);

/* 1 when rf_crc32c_extend uses the SSE4.2 instruction. */
int rf_crc32c_hw(void);

/* TFRecord's masked CRC (tensorflow/core/lib/hash/crc32c.h, Mask): rotate right by 15 bits and
 * add 0xa282ead8. Masking keeps a CRC computed over data that itself holds CRCs from being
 * trivially zero. */
static inline uint32_t rf_crc32c_mask(uint32_t crc) {
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* Inverse of rf_crc32c_mask. */
static inline uint32_t rf_crc32c_unmask(uint32_t masked) {
    uint32_t rot = masked - 0xa282ead8u;
    return (rot >> 17) | (rot << 15);
}

#endif
