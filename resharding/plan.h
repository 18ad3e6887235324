/* Resharding plans: for every parameter, which block each destination rank needs from which
 * source rank (interval intersection along the split dimension), cut into buckets. A plan is
 * plain data, the same on every rank (computed from the parameter table and the two layouts,
 * without communication), so it can be printed, tested, and executed by each rank for its own
 * part (resharding/reshard.h).
 *
 * Moves. A move copies the block rows [r0, r1) x cols [c0, c1) of one parameter (full-tensor
 * coordinates) from src_rank's local buffer (source layout) to dst_rank's (destination layout).
 * In the local buffers that block is n_runs runs of `run` contiguous floats, starting at
 * src_off / dst_off and src_stride / dst_stride floats apart; a block contiguous on both sides
 * is one run. src_rank == dst_rank is a local copy (no communication).
 *
 * Sources. A destination block is covered by the pieces of the source shards it intersects; a
 * piece held by several source ranks (dp replicas, or a replicated parameter) is taken from the
 * destination rank itself when it holds it, else from the holder with the fewest bytes to send
 * so far, scanning from holder (d * tp_dst + t) mod n_holders of the destination's replica d,
 * shard t (ties round-robin): the senders are balanced.
 *
 * Buckets. Moves are taken in order (parameters in table order, then destination replica and
 * shard) and cut so that none is larger than bucket_bytes (into groups of rows, and of columns
 * when one row is larger); a new bucket starts when a move would take any rank's bytes sent or
 * received in the current one past bucket_bytes. Each bucket is one grouped send/recv; local
 * copies ride along in their bucket.
 *
 * Zero copy. Identical layouts (same tp and dp on the same ranks) hold identical local
 * buffers: the plan says zero_copy and has no moves; the caller uses the source buffer as the
 * destination (colocated training and generation share memory). */
#ifndef RF_PLAN_H
#define RF_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "resharding/layout.h"

typedef struct rf_reshard_move {
    int param;                    /* index into the parameter table */
    int src_rank, dst_rank;       /* ranks of the communicator */
    int64_t r0, r1, c0, c1;       /* block of the full tensor */
    size_t src_off, dst_off;      /* floats, into the local buffers: first element */
    int64_t n_runs, run;          /* n_runs x run floats */
    int64_t src_stride, dst_stride; /* floats between runs */
    int bucket;
} rf_reshard_move;

typedef struct rf_reshard_plan {
    int zero_copy;                /* identical layouts: no moves, nothing to do */
    int n_moves;
    rf_reshard_move *moves;       /* (n_moves) bucket by bucket */
    int n_buckets;
    size_t bucket_bytes;
    int comm_size;
    rf_layout src, dst;           /* copies; their rank tables are the plan's */
    int *src_ranks, *dst_ranks;   /* (src.dp * src.tp), (dst.dp * dst.tp) */
    int tp_src, tp_dst;
    size_t *src_floats, *dst_floats; /* (tp_src), (tp_dst) local buffer sizes per shard */
    rf_param_view *views;         /* (n_views) copy of the table's names and shapes */
    int n_views;
    uint32_t id;                  /* CRC-32C of the moves and layouts: ranks check they agree */
} rf_reshard_plan;

/* Plans moving parameters from layout src to layout dst over a communicator of comm_size ranks,
 * in buckets of at most bucket_bytes (>= 4096) per rank and direction. Both layouts are
 * checked (rf_layout_check). Caller frees with rf_reshard_plan_free. */
rf_status rf_reshard_plan_make(rf_reshard_plan **out, const rf_param_table *pt, const rf_layout *src,
                               const rf_layout *dst, size_t bucket_bytes, int comm_size);

/* The same, knowing the node of each rank (node[r] for r < comm_size; equal numbers: the same
 * machine): a piece several ranks hold is taken from a holder on the destination's node when
 * there is one (then the least loaded of those), so fewer bytes cross the network. Every rank
 * must pass the same table (the plan id would differ otherwise). NULL: one node. */
rf_status rf_reshard_plan_make_nodes(rf_reshard_plan **out, const rf_param_table *pt, const rf_layout *src,
                                     const rf_layout *dst, size_t bucket_bytes, int comm_size,
                                     const int *node);
void rf_reshard_plan_free(rf_reshard_plan *p);

/* Bytes rank `rank` sends to other ranks, receives from them, and copies locally. */
void rf_reshard_plan_bytes(const rf_reshard_plan *p, int rank, size_t *sent, size_t *received,
                           size_t *copied);

/* Writes the plan, one line per move:
 *   bucket 0: model.layers.0.self_attn.o_proj.weight [0:64, 0:32] rank 0 -> rank 2, 64 x 32 floats (strided)
 * after a header line with the plan id, the layouts, the bucket size and the totals. */
void rf_reshard_plan_print(const rf_reshard_plan *p, FILE *f);

#endif
