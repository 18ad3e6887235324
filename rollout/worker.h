/* The rollout worker: the rollout engine as a process of a split run. It connects to the
 * controller (role ROLE_ROLLOUT), receives GenerateRequests, streams back one Sample per
 * finished sequence (tokens, behaviour log-probs, the policy version of every token, the
 * checksum of the weights that finished it), and loads new weights from the training worker
 * between decode steps: sequences in flight continue with them (interruptible generation).
 * After each load it reports WeightsLoaded (version, checksum, busy time). With
 * placement.rollout.tp > 1 a rollout worker is a group of tensor-parallel ranks. */
#ifndef RF_ROLLOUT_WORKER_H
#define RF_ROLLOUT_WORKER_H

#include "comm/comm.h"
#include "common/msg.h"
#include "controller/recipe.h"
#include "resharding/handover.h"

/* Runs until the controller says Shutdown (RF_OK) or something fails (the error names it).
 * dial: the controller's endpoint and the run's CURVE keys (common/msg.h). wcomm: the weights
 * communicator, in which the training worker is rank train_rank. gcomm:
 * with placement.rollout.tp = G > 1, the G ranks of this rollout worker (NULL or one rank:
 * the whole model here). Its rank 0 talks to the controller and runs the engine; the others
 * follow it (rollout/rollout_tp.h) and receive their shards of the weights with it.
 * ho (a colocated run on several devices: this rank is a thread of a training rank's process)
 * replaces wcomm: the weights are that training rank's, handed over in the process
 * (resharding/handover.h); with identical layouts the model borrows its buffer. NULL in split
 * runs. */
rf_status rf_rollout_worker_main(const rf_recipe *r, const rf_msg_dial *dial, int rank,
                                 rf_comm *wcomm, rf_comm *gcomm, int train_rank, rf_handover *ho);

#endif
