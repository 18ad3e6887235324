/* The controller of a split run (DESIGN.md section 1): one process, an event loop over
 * zmq_poll on a ROUTER socket that the workers connect to. It owns the dataflow: it reads
 * prompts and admits them under the staleness bound (controller/buffer.h), sends
 * GenerateRequests to the rollout workers, scores each streamed Sample with the reward rules
 * (and the user's reward programs), asks the training worker for reference log-probs and
 * critic values of each finished group, computes advantages when a batch is taken from the
 * buffer, sends the TrainBatch, checks every WeightsLoaded against the training worker's
 * WeightsUpdate (version and checksum), validates, logs and asks for checkpoints.
 *
 * Faults: a worker that goes silent for async.peer_timeout, disconnects, reports an Error or
 * sends what does not decode stops the run with a message naming its role, rank, pid and what
 * it was doing; the last checkpoint stays intact (atomic saves) and `--resume` continues. */
#ifndef RF_CONTROLLER_H
#define RF_CONTROLLER_H

#include "common/msg.h"
#include "controller/recipe.h"
#include "controller/roles.h"
#include "controller/run.h"

/* The RL loop every deployment runs, over a set-up (and resumed) run and its roles: admission
 * under the staleness bound (in process: one batch at a time), generate requests seeded by
 * rf__group_seed, the reward model, the reward programs, dynamic sampling in rounds, reference /
 * proximal / value scoring, advantages, the batch to the trainer, validation, console lines,
 * metrics, checkpoints and the Ctrl-C stop, until train.steps updates are done. */
rf_status rf_controller_run(rf_run *run, rf_roles roles);

/* Runs the controller on an open server until train.steps updates are done (RF_OK) or the
 * run fails. Waits for 1 training worker and n_rollout rollout workers to join first. */
rf_status rf_controller_main(const rf_recipe *r, int resume, rf_msg_server *srv, int n_rollout);

/* 1 when the last rf_controller_main or rf_controller_run stopped on SIGINT / SIGTERM after writing the checkpoint
 * of the step reached (controller/interrupt.h); its error then says where. */
int rf_controller_interrupted(void);

#endif
