/* Moving the actor's weights after each optimizer step from a training group (placement.actor.tp
 * = T ranks, each holding one shard of the training layout; T = 1: the whole actor) to the
 * rollout workers (the generation layout: placement.rollout.tp = G ranks per rollout worker,
 * each holding one shard, G = 1: the whole model; one replica per rollout worker), through the
 * resharding planner and executor (resharding/plan.h, reshard.h). What
 * resharding/weights_sync.h does for identical layouts (T = G = 1).
 *
 * One communicator c holds both sides: ranks 0 .. D*T-1 the training shards of D data-parallel
 * replicas (rank r holds shard r % T of replica r / T; D = 1 without data parallelism), ranks
 * D*T .. D*T+R*G-1 the R rollout workers' ranks (rollout worker d's shard g at rank
 * D*T + d*G + g). Every rank of c builds the same plan from the actor's parameter table (no
 * communication); a rollout rank receives each block from a training rank that holds it, the
 * planner spreading the senders over the replicas and shards (rf_reshard_plan_make: the holder
 * with the fewest bytes to send so far). The replicas hold the same bits (data parallelism), so
 * any of them may send a block.
 *
 * A transfer of version v:
 *   1. the training ranks agree on the checksum of the whole parameter buffer
 *      (rf_weights_rs_checksum): each computes its part (resharding/shard_crc.h), one allgather
 *      over the training group joins them. The same allgather carries each rank's CRC-32C of
 *      its replicated tensors, which must agree: rollout workers take those from different
 *      training ranks.
 *   2. training rank 0 (replica 0's shard 0) sends every rollout worker an announcement (version, checksum, size;
 *      under LoRA the frozen base's CRC-32C too, rf_weights_rs_set_base; tag RF_WEIGHTS_TAG, as
 *      weights_sync's header), without waiting;
 *   3. every training rank runs the plan (rf_weights_rs_send): it returns once every rollout
 *      worker has its blocks (the executor's hello, buckets and per-bucket CRC-32C);
 *   4. a rollout worker probes for an announcement between decode steps (rf_weights_rs_poll;
 *      interruptible generation, as with weights_sync), runs its part of the plan writing the
 *      whole buffer in place, and checks the CRC-32C of what it assembled against the
 *      announced one. It reports that CRC-32C (WeightsLoaded) and the controller checks it
 *      against the training worker's WeightsUpdate as with weights_sync. With G > 1 the
 *      group's rank 0 probes (rf_weights_rs_pending), tells its peers, and every rank of the
 *      group receives its shard (rf_weights_rs_receive); the whole model's CRC-32C is then
 *      computed from the G shards as the training side does (rf_weights_rs_checksum over the
 *      group), so no rank assembles the whole model.
 * Unlike weights_sync, where the sender stages a copy and sends in the background, step 3
 * waits for every rollout worker to reach its next step boundary: resharding is a joint
 * exchange.
 *
 * Host memory (CPU back end over MPI). Errors: the executor's (RF_ERR_IO naming the rank that
 * did not take part in time, RF_ERR_FORMAT for damaged data or a peer with another plan),
 * RF_ERR_FORMAT for an assembled buffer whose CRC-32C is not the announced one, RF_ERR_INTERNAL
 * for replicated tensors that differ between training ranks.
 *
 * Threads: one thread uses an rf_weights_rs and its communicators. */
#ifndef RF_WEIGHTS_RESHARD_H
#define RF_WEIGHTS_RESHARD_H

#include <stdint.h>

#include "comm/comm.h"
#include "kernels/kernels.h"
#include "resharding/layout.h"
#include "resharding/plan.h"

typedef struct rf_weights_rs rf_weights_rs;

/* The bucket size split runs use on both sides (it is part of the plan, which both sides must
 * build the same). */
#define RF_WEIGHTS_RS_BUCKET ((size_t)16 << 20)

/* Plans the transfer for the model whose parameters pt describes (the whole model's names and
 * shapes, the same on every rank) from dp replicas of tp training ranks to the
 * (size(c) - tp x dp) / gen_tp rollout workers of gen_tp ranks each, in buckets of
 * bucket_bytes, and prepares this rank's part. timeout_s bounds each exchange. RF_ERR_ARG when c
 * has no rollout worker, gen_tp does not divide the rollout ranks, or tp or gen_tp does not fit
 * the model (the layout's checks). Free with rf_weights_rs_free (NULL is fine). No
 * communication. */
rf_status rf_weights_rs_init(rf_weights_rs **out, const rf_param_table *pt, int tp, int dp, int gen_tp, rf_comm *c,
                             size_t bucket_bytes, double timeout_s);
void rf_weights_rs_free(rf_weights_rs *x);

/* Colocated runs on several devices (resharding/handover.h): the dp x tp training ranks of c
 * (all of it, ranks as above) are also the rollout ranks, rollout worker w's shard g in the
 * process of rank w x gen_tp + g, so the plan goes from the training layout to the generation
 * layout over the same ranks. gen_tp = tp gives identical layouts: rf_weights_rs_zero_copy,
 * and the rollout ranks read the training shards themselves. RF_ERR_ARG when c's size is not
 * dp x tp or gen_tp does not divide it. rf_weights_rs_checksum works as on a training rank. */
rf_status rf_weights_rs_init_colocated(rf_weights_rs **out, const rf_param_table *pt, int tp, int dp, int gen_tp,
                                       rf_comm *c, size_t bucket_bytes, double timeout_s);

/* 1 when the plan moves nothing (identical layouts). */
int rf_weights_rs_zero_copy(const rf_weights_rs *x);

/* Colocated, every rank together: moves version `version` from `local` (this rank's training
 * shard, host memory) into `dst` (its process's rollout shard, host memory; the whole model
 * when gen_tp = 1) and checks, with one allgather, that each rollout worker's shards make up
 * the whole buffer whose CRC-32C is `checksum` (rf_weights_rs_checksum's): RF_ERR_FORMAT
 * naming the rank and both checksums otherwise. Nothing to do for a zero-copy plan. */
rf_status rf_weights_rs_move(rf_weights_rs *x, const float *local, float *dst, int64_t version, uint32_t checksum);

/* The plan (its moves, rf_reshard_plan_bytes). Made knowing each rank's machine when the
 * launcher set them (rf_comm_set_nodes): a piece several training replicas hold goes to a
 * rollout rank from a replica on its machine when there is one. */
const rf_reshard_plan *rf_weights_rs_plan(const rf_weights_rs *x);

/* Changes the bound of later exchanges (a first transfer waits for rollout workers still
 * starting: async.startup_timeout; then async.peer_timeout). */
void rf_weights_rs_set_timeout(rf_weights_rs *x, double timeout_s);

/* The ranks of one side's group, all together over tpc (a training replica's tp ranks, or one
 * rollout worker's gen_tp ranks: rank t of tpc holds shard t): the CRC-32C of the whole
 * parameter buffer whose shard t is `local` (the layout's local buffer, rf_layout_shards),
 * identical on every rank. One allgather of 8 bytes per rank, bounded by timeout_s;
 * RF_ERR_INTERNAL when the replicated tensors differ between the ranks. */
rf_status rf_weights_rs_checksum(rf_weights_rs *x, rf_comm *tpc, const float *local, double timeout_s,
                                 uint32_t *checksum);

/* Training ranks (of every replica), all together: moves `local` (this rank's shard) as
 * `version` to every rollout worker, rank 0 announcing version and checksum
 * (rf_weights_rs_checksum's) first. Returns when
 * every rollout worker has its copy. */
rf_status rf_weights_rs_send(rf_weights_rs *x, const float *local, int64_t version, uint32_t checksum);

/* Rollout worker: when a version has been announced, takes part in its transfer into `full`
 * (the whole model's flat buffer, host memory; written in place), checks it and sets
 * *arrived = 1, *version and *checksum (the CRC-32C of full). *arrived = 0: none waiting. */
rf_status rf_weights_rs_poll(rf_weights_rs *x, float *full, int *arrived, int64_t *version, uint32_t *checksum);

/* Rollout rank: 1 when training rank 0 has announced a version to it, 0 when not, < 0 on an
 * MPI error. No waiting. */
int rf_weights_rs_pending(rf_weights_rs *x);

/* Rollout rank, every rank of its rollout worker together (after rank 0 saw
 * rf_weights_rs_pending and told the others): receives the announcement and this rank's shard
 * into `local` (its shard's local buffer, host memory; the whole buffer when gen_tp = 1),
 * then checks the whole model's CRC-32C (from the group's shards over gtc, which may be NULL
 * when gen_tp = 1) against the announced one; sets *version and *checksum. */
rf_status rf_weights_rs_receive(rf_weights_rs *x, float *local, rf_comm *gtc, int64_t *version, uint32_t *checksum);

/* LoRA: the CRC-32C of the frozen base weights this side holds (rf_weights_rs_base_checksum;
 * leave it 0, the default, without adapters), taken once. Training rank 0 sends it with every
 * announcement and every rollout rank refuses a version announced with a base other than its
 * own (RF_ERR_FORMAT naming both CRC-32Cs), the adapters alone being resharded: they are only
 * right on the base they were trained on (weights_sync's check, for the resharding path). */
void rf_weights_rs_set_base(rf_weights_rs *x, uint32_t base_crc);

/* CRC-32C of a whole flat buffer laid out by pt (e.g. the base model's table) from the
 * shards of the ranks of tpc, all together (rank t of tpc holding shard t of rf_comm_size(tpc):
 * `local`, the layout's local buffer, in k's memory, read back once when k is not the CPU's):
 * resharding/shard_crc.h's parts, one allgather of 4 bytes per rank bounded by timeout_s. Equal
 * to rf_crc32c of the whole buffer, on every rank. Errors: comm's, RF_ERR_NOMEM. */
rf_status rf_weights_rs_base_checksum(rf_comm *tpc, const rf_param_table *pt, const rf_kernels *k, const float *local,
                                      double timeout_s, uint32_t *crc);

#endif
