/* CRC-32C of a model's whole flat parameter buffer (rf_model's order: every tensor row-major,
 * one after the other) computed from its tensor-parallel shards, without assembling it: what a
 * training group announces as the checksum of the weights that a rollout worker, which holds the
 * whole model, computes over the buffer it assembled (rf_crc32c, common/crc32c.h).
 *
 * CRC-32C is affine over GF(2): crc(x) = L(x) ^ crc(0^n) for messages x of n bytes, with L
 * linear. Write the whole buffer as the XOR of tp buffers Z_t of the same size, Z_t holding
 * what shard t owns where it lies in the whole buffer and zeros elsewhere (each byte owned by
 * exactly one shard: split tensors by the shard that holds the block, replicated ones by shard
 * 0). Then crc(whole) = crc(Z_0) ^ ... ^ crc(Z_{tp-1}), and ^ crc(0^n) once more when tp is
 * even. Each rank computes crc(Z_t) from its own local buffer; the runs of zeros cost nothing
 * to read: appending k zero bytes multiplies the CRC register by x^(8k) modulo the polynomial,
 * O(log k) (Mark Adler's crc32_combine in zlib 1.2.12, crc32.c: multmodp, x2nmodp). A
 * row-parallel tensor (o_proj, down_proj) is one run of data and one of zeros per row.
 *
 * Host memory; no communication (the caller gathers the parts). */
#ifndef RF_SHARD_CRC_H
#define RF_SHARD_CRC_H

#include <stddef.h>
#include <stdint.h>

#include "resharding/layout.h"

/* rf_crc32c_extend(crc, <n zero bytes>) without reading them. */
uint32_t rf_crc32c_zeros(uint32_t crc, uint64_t n);

/* crc(Z_t) for shard t (of the layout that made `shards`, rf_layout_shards, n = pt->n_views of
 * them) from its local buffer `local` (laid out by shards). */
uint32_t rf_shard_crc32c_part(const rf_param_table *pt, const rf_shard *shards, int t, const float *local);

/* The whole buffer's CRC-32C (full_floats floats) from the tp parts, parts[t] = crc(Z_t). */
uint32_t rf_shard_crc32c_join(const uint32_t *parts, int tp, size_t full_floats);

#endif
