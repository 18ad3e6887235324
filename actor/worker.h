/* The training worker of a split run: hosts the actor, and the reference and critic when the
 * recipe has them, colocated on its devices. It connects to the controller (ROLE_ACTOR) and
 * answers, in order:
 *   ScoreRequest      -> ScoreResponse (reference log-probs, critic values of finished samples)
 *   TrainBatch        -> an actor (and critic) update, then the new weights to every rollout
 *                        worker through comm, WeightsUpdate (version, checksum) and TrainStats
 *   CheckpointRequest -> a checkpoint of its models with the controller's run state
 *   Shutdown          -> waits for weight transfers in flight, exits. */
#ifndef RF_ACTOR_WORKER_H
#define RF_ACTOR_WORKER_H

#include "comm/comm.h"
#include "controller/recipe.h"

/* wcomm: the weights communicator; rollout workers are its ranks rollout[0..n_rollout-1].
 * resume: load the newest checkpoint of logging.dir first. */
rf_status rf_train_worker_main(const rf_recipe *r, const char *endpoint, int resume,
                               rf_comm *wcomm, const int *rollout, int n_rollout);

#endif
