/* Executing a resharding plan (resharding/plan.h) over comm: every rank of the communicator
 * runs rf_reshard_run with its own source and destination buffers, and the moves of the plan
 * that concern it happen bucket by bucket, each bucket one grouped send/recv
 * (rf_comm_sendrecv).
 *
 *   - A block contiguous on the sending side is sent from the source buffer as it is; one
 *     contiguous on the receiving side is received straight into the destination buffer. A
 *     strided side (row-parallel weights whose column range differs) goes through a staging
 *     buffer. Local moves are copies.
 *   - Buckets are pipelined two deep: bucket b + 1 is packed, checksummed and posted before
 *     bucket b is waited for and checked, so a receiver finds the next bucket waiting (no round
 *     trip between buckets) and a sender checksums while the receiver copies. Staging is at
 *     most 2 x bucket_bytes per direction.
 *   - Before the first bucket, every pair of ranks that exchange anything swap a hello (magic,
 *     plan id, version): a rank that planned differently (other layouts, bucket size or model)
 *     or holds another version is refused with RF_ERR_FORMAT before any data moves.
 *   - With every bucket, each sender sends each receiver a header with the CRC-32C (common/
 *     crc32c.h; computed by rf_crc32c_extend, the SSE4.2 path) of the bytes it sends it in that bucket,
 *     in move order; the receiver computes
 *     the CRC of what arrived and refuses a mismatch (RF_ERR_FORMAT naming the bucket, the
 *     parameters, both ranks and both checksums), after finishing the remaining buckets so that
 *     its peers are not left waiting.
 *   - Single copy on one host: when a sender's source buffer is shareable memory
 *     (rf_shm_alloc, or a model after rf_model_share_params) it offers it in its hello; a
 *     receiver on the same host maps it (once, kept between runs) and answers yes, and then
 *     copies all its moves straight from the sender's buffer into its destination at once
 *     (before any bucket), computing each bucket's CRC-32C in the same pass (rf_crc32c_copy),
 *     and tells that sender "done"; only the bucket headers travel, and each is checked against
 *     the CRC kept for it. A receiver that cannot map the buffer answers no and the pair goes
 *     through messages as above. Before returning, each sender waits for every in-place
 *     reader's "done", so the buffer may change again once rf_reshard_run returns. A sender's
 *     waits on its readers (their answers, their "done") are bounded by twice timeout_s: a
 *     reader stuck on a third rank that is gone names that rank first. The CPU counterpart of CUDA IPC handles:
 *     MPI's own single copy between processes (CMA) runs at about half of memcpy here, the
 *     read in place at memcpy speed (docs/scaling.md).
 *   - Each exchange is bounded by timeout_s (RF_ERR_IO from comm naming the ranks).
 *   - Zero-copy plans return at once.
 *
 * Memory: host buffers (CPU back end, MPI or single communicators). Device buffers over NCCL
 * need pack and checksum kernels that are not written: RF_ERR_UNSUPPORTED.
 *
 * Reverse direction (generation -> training): a plan with the layouts swapped. Source and
 * destination buffers must not overlap. */
#ifndef RF_RESHARD_H
#define RF_RESHARD_H

#include <stdint.h>

#include "comm/comm.h"
#include "resharding/plan.h"

typedef struct rf_reshard rf_reshard;

typedef struct rf_reshard_opts {
    double timeout_s; /* bound of each exchange (hello, every bucket); <= 0: 60 s */
    int no_verify;    /* 1: no CRC-32C of the data (plans and versions are still checked) */
    int no_shm;       /* 1: neither offer this rank's source for reading in place nor read a
                         peer's (decline its offer): always through comm */
} rf_reshard_opts;

/* Prepares this rank's part of `plan` (borrowed: it must outlive the executor) over c (its size
 * must be the plan's): the rank's moves per bucket, its peers, staging buffers. opts NULL:
 * defaults. Caller frees with rf_reshard_free. */
rf_status rf_reshard_init(rf_reshard **out, const rf_reshard_plan *plan, rf_comm *c,
                          const rf_reshard_opts *opts);
void rf_reshard_free(rf_reshard *x);

/* Changes the bound of each later exchange (<= 0: 60 s): e.g. a first transfer that waits for
 * peers still starting, then the steady-state bound. */
void rf_reshard_set_timeout(rf_reshard *x, double timeout_s);

/* Moves version `version` of the parameters: src is this rank's buffer in the source layout
 * (plan->src_floats[t] floats; NULL when the rank holds no source shard), dst its buffer in the
 * destination layout (NULL when it holds none). Every rank that appears in the plan calls it
 * with the same version. On success dst holds exactly the destination shard of the sources'
 * parameters (bit for bit). */
rf_status rf_reshard_run(rf_reshard *x, const float *src, float *dst, int64_t version);

/* How many peers this rank exchanged with in place (read their source, or was read) in the last
 * rf_reshard_run: pairs on one host whose sender's source buffer is shareable (common/shm.h). */
int rf_reshard_in_place_peers(const rf_reshard *x);

/* How many other ranks this rank exchanges with in the plan. */
int rf_reshard_peers(const rf_reshard *x);

/* rf_reshard_init + run + free. */
rf_status rf_reshard_execute(const rf_reshard_plan *plan, rf_comm *c, const float *src, float *dst,
                             int64_t version, const rf_reshard_opts *opts);

#endif
