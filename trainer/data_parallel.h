/* Data-parallel training (DESIGN.md section 3): every rank of a communicator holds the whole
 * model and trains on its own share of each mini-batch; the ranks' gradients are summed over
 * comm before the optimizer step, so that N ranks take the same step as one rank over the
 * combined mini-batch (the callers weight each token's loss by the totals of the whole
 * mini-batch over all ranks, which rf_dp_sum gives them; summing is then averaging).
 *
 * Buckets and overlap (as PyTorch DDP does it): the flat gradient buffer is cut into buckets
 * of about bucket_floats, from the end of the buffer towards its start, the order in which the
 * backward pass finishes them (model.h, rf_grad_ready_fn). During the last backward pass of a
 * mini-batch (rf_dp_arm before it) each bucket is reduced by a non-blocking collective as soon
 * as the pass has walked past it, while the pass goes on through the earlier layers; the
 * buckets still in flight are waited for after it (rf_dp_sync_grads). Earlier micro-batches of
 * the same mini-batch only accumulate locally.
 *
 * ZeRO-1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
 * Models", 2020, stage 1): the optimizer state is sharded. Each bucket is reduce-scattered in
 * `size` equal blocks (the bucket holding offset 0 is zero-padded to a multiple of the ranks),
 * rank r keeps block r of every bucket, runs AdamW on those floats only (moments of that shard
 * only), and the updated parameters are allgathered bucket by bucket. The global gradient norm
 * for clipping is the sum over ranks of each shard's sum of squares. The result equals plain DP
 * within fp32 summation order.
 *
 * Memory: the model's buffers (params, grads) stay whole on every rank. Plain DP keeps the
 * model's AdamW moments; ZeRO-1 frees them (rf_dp_init) and keeps moments for its shard, about
 * n_params / size floats each, plus a gradient shard and a staging shard of the same size.
 * With LoRA (model/lora.h) only the adapters train: buckets, blocks and moments cover the
 * trained floats, the parameters' from n_frozen on, and every offset below counts from there.
 *
 * Back ends: the communicator's memory must be the model's (MPI or single with the CPU
 * kernels; NCCL with CUDA ones, whose buckets run on the NCCL stream while backward goes on
 * on the kernels' stream: comm.h). Host data (counts, norms, statistics, agreement) goes over
 * rf_comm_host of it (for NCCL, its MPI duplicate); a resumed ZeRO-1 shard is read through
 * host staging and moment ranges come back to rank 0's host memory. The same code runs on
 * both; the CUDA side has been compiled but never run (tests/test_dp_cuda.c).
 *
 * Threads: one thread uses a rf_dp, its communicator and its model (comm.h's rule). */
#ifndef RF_DATA_PARALLEL_H
#define RF_DATA_PARALLEL_H

#include <stddef.h>

#include "comm/comm.h"
#include "model/model.h"
#include "model/model_tp.h"
#include "trainer/optim.h"

#define RF_DP_BUCKET_DEFAULT ((size_t)4 << 20) /* floats: 16 MB buckets */

typedef struct rf_dp rf_dp;

/* Floats [a, a + n) of AdamW moment `which` (1 or 2) of a whole model's buffer (its trained
 * floats: under LoRA the adapters', from 0) into host dst: where a resumed ZeRO-1 run's ranks
 * read their blocks (a checkpoint's files). */
typedef rf_status (*rf_dp_moment_src)(void *ctx, int which, size_t a, size_t n, float *dst);

typedef struct rf_dp_opts {
    size_t bucket_floats; /* bucket size; 0 = RF_DP_BUCKET_DEFAULT */
    int zero;             /* 0 plain DP (allreduce), 1 ZeRO-1 */
    int defer;            /* 1: start every bucket after the backward pass (no overlap): the
                             baseline benchmarks compare with */
    double timeout_s;     /* bound of every collective (a rank that is gone: RF_ERR_IO) */
    rf_dp_moment_src moments; /* ZeRO-1 (host memory), resuming: every rank reads its own blocks
                                 of the moments through it (moments_ctx, this rank's) instead of
                                 taking them from rank 0's model, whose whole moments are then
                                 never read; NULL: from rank 0 */
    void *moments_ctx;
} rf_dp_opts;

typedef struct rf_dp_stats {
    long syncs;           /* rf_dp_sync_grads calls */
    long buckets;         /* buckets started */
    long buckets_early;   /* of those, started while the backward pass still had layers to
                             go (overlapped with its work) */
    long buckets_done_early; /* buckets seen complete while the pass still had layers to go */
    double wait_s;        /* in rf_dp_sync_grads: comm time not hidden behind backward (with
                             the wait for slower ranks) */
    double sync_start, sync_end; /* rf_time_now at the last rf_dp_sync_grads' start and end
                             (CLOCK_MONOTONIC: comparable between the ranks of one machine) */
} rf_dp_stats;

/* Sets up data parallelism for model m (training enabled) over the ranks of c: collective over
 * c. Every rank takes DP rank 0's parameters, optimizer step count and AdamW moments (plain:
 * broadcast; ZeRO-1: each rank its shard, sent by rank 0 or read by each rank through
 * o->moments, then the model's whole moments are freed), so a run resumed on rank 0 alone
 * continues everywhere; when a rank fails to read its blocks every rank returns an error. Installs m's backward hook (removed by
 * rf_dp_free). c and m stay the caller's and must outlive the rf_dp. Errors: RF_ERR_ARG (no
 * training buffers, a device model on a host communicator), RF_ERR_NOMEM, comm's errors. */
rf_status rf_dp_init(rf_dp **out, rf_comm *c, rf_model *m, const rf_dp_opts *o);

/* Data parallelism of one shard of a tensor-parallel model (a tp x dp grid, Megatron-LM's
 * layout): c holds the ranks that hold the same shard (the same TP rank of every DP replica),
 * and each replica's TP group is tp's. rf_dp_init on tp->m (its backward hook is called by
 * rf_model_tp_backward), plus: the gradient norm for clipping is the whole model's (the
 * shard's sum of squares of the DP-summed gradient, summed over the TP group with replicated
 * tensors counted once; ZeRO-1: over the DP shards first), and after each optimizer step the
 * replicated tensors are copied from TP rank 0 (rf_model_tp_bcast_replicated), since each TP
 * position sums its gradients over its own DP group. Every rank of the grid calls
 * rf_dp_optim_step together. tp must outlive the rf_dp. Errors as rf_dp_init. */
rf_status rf_dp_init_tp(rf_dp **out, rf_comm *c, rf_model_tp *tp, const rf_dp_opts *o);

/* Removes the hook and frees what rf_dp_init allocated (with ZeRO-1 the model is left without
 * AdamW moments). Buckets still in flight (after an error) are released at once, which leaves
 * the communicator failed. NULL is fine. */
void rf_dp_free(rf_dp *dp);

/* Changes the bound of the collectives that follow (e.g. a long one for set-up, then the
 * run's). */
void rf_dp_set_timeout(rf_dp *dp, double timeout_s);

rf_model *rf_dp_model(const rf_dp *dp);
rf_model_tp *rf_dp_tp(const rf_dp *dp); /* NULL unless made by rf_dp_init_tp */
int rf_dp_rank(const rf_dp *dp);
int rf_dp_size(const rf_dp *dp);
int rf_dp_zero(const rf_dp *dp);
const rf_dp_stats *rf_dp_get_stats(const rf_dp *dp);

/* Exact sums over the ranks of n non-negative counts (below 2^36 each), out (n) on every rank
 * (in == out allowed). Collective. */
rf_status rf_dp_sum(rf_dp *dp, const long *in, long *out, int n, const char *what);

/* Gathers `bytes` of host memory from every rank into out (size, bytes). Collective. */
rf_status rf_dp_allgather(rf_dp *dp, const void *in, void *out, size_t bytes, const char *what);

/* The next backward pass of m is the last of this mini-batch on this rank: its buckets are
 * started as they become final. Exactly one backward pass may follow before rf_dp_sync_grads
 * (a rank with no work in the mini-batch arms nothing). */
void rf_dp_arm(rf_dp *dp);

/* Starts the buckets not started yet (all of them when this rank ran no armed backward pass)
 * and waits for every bucket. Afterwards (plain) m->grads holds the sum over ranks on every
 * rank, or (ZeRO-1) this rank's shard holds the summed gradients of its floats. Collective. */
rf_status rf_dp_sync_grads(rf_dp *dp);

/* The optimizer step after rf_dp_sync_grads: rf_optim_step's clipping, schedule and AdamW
 * (plain DP runs rf_optim_step itself: every rank holds the same summed gradients); ZeRO-1 on
 * the shard, clipped by the global norm, then the parameters allgathered. *grad_norm is the
 * global norm before clipping on every rank. A non-finite norm applies no step on any rank
 * (RF_ERR_RANGE; the run stops with it). Collective. */
rf_status rf_dp_optim_step(rf_dp *dp, const rf_optim_opts *o, double *grad_norm, float *lr_used);

/* ZeRO-1: gathers the whole AdamW moments into m->opt_m / m->opt_v (allocated here) on every
 * rank, to inspect them (tests); rf_dp_release_optimizer frees them again. Checkpoints take
 * them a tensor at a time instead (rf_dp_moment_range). Plain DP: nothing to do (the model
 * holds them). Collective. */
rf_status rf_dp_gather_optimizer(rf_dp *dp);

/* ZeRO-1: floats [a, a + n) of the first (which = 1) or second (2) AdamW moment (offsets into
 * the model's whole buffer of trained floats: under LoRA the adapters', from 0) gathered onto rank 0 into dst (n floats of host memory, whatever
 * the back end; NULL on the others, which send their blocks of the range): one tensor of a checkpoint at a time, so
 * no rank ever holds the whole moments. Every rank calls it with the same which, a, n.
 * RF_ERR_ARG without ZeRO-1 or for a range outside the buffer. Collective. */
rf_status rf_dp_moment_range(rf_dp *dp, int which, size_t a, size_t n, float *dst);
void rf_dp_release_optimizer(rf_dp *dp);

#endif
