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
#include "common/msg.h"
#include "controller/recipe.h"
#include "resharding/handover.h"

/* dial: the controller's endpoint and the run's CURVE keys (common/msg.h). wcomm: the weights
 * communicator; rollout workers are its ranks rollout[0..n_rollout-1].
 * resume: load the newest checkpoint of logging.dir first. dpc: with placement.actor.dp > 1,
 * the data-parallel training ranks, this one their rank 0 (NULL: it trains alone): it hands
 * every peer its share of each batch over dpc, and the update's statistics are the batch's.
 * tpc: with placement.actor.tp > 1, the tensor-parallel training ranks, this one their rank 0
 * (NULL: none): it hands every peer the whole batch, each rank trains its shard of the actor,
 * and the shards go to the rollout workers by resharding, the training ranks being ranks
 * 0 .. tp-1 of wcomm and the rollout workers the ranks after them (rollout is then not used).
 * Both (a tp x dp grid, actor/worker_internal.h): tpc is replica 0's TP group and dpc the
 * replicas' first ranks; each replica's TP group trains on its share.
 * ho: a colocated run on several devices, where this process also runs a rollout rank
 * (resharding/handover.h): wcomm then holds the training ranks only, every one of which hands
 * each version to its own process's rollout rank (resharded in place over wcomm when the
 * layouts differ; rollout is not used). NULL in split runs. The same for the peers below. */
rf_status rf_train_worker_main(const rf_recipe *r, const rf_msg_dial *dial, int resume,
                               rf_comm *wcomm, const int *rollout, int n_rollout, rf_comm *dpc,
                               rf_comm *tpc, rf_handover *ho);

/* A data-parallel peer (DP rank > 0 of dpc): loads the actor (and the critic) from the recipe,
 * takes DP rank 0's state, then trains on the shares rank 0 sends until rank 0 says the run is
 * over. It talks to nobody else. A rank 0 silent for async.peer_timeout (it sends keep-alives
 * when idle) is reported lost: RF_ERR_IO naming its world rank. tpc: with tensor parallelism
 * too, its replica's TP group, this rank its rank 0 (NULL: none): it holds shard 0 (replica
 * 0's, copied at the start), hands its TP peers its share of every batch, and sends its shard
 * of every version to the rollout workers with them over wcomm (as tp_peer_main). */
rf_status rf_train_peer_main(const rf_recipe *r, rf_comm *dpc, rf_comm *tpc, rf_comm *wcomm, rf_handover *ho);

/* A tensor-parallel peer (TP rank > 0 of tpc): reads the model's shape from model.path, takes
 * its shard of TP rank 0's actor, sends its shard of every version to the rollout workers (over
 * wcomm, as rank rf_comm_rank(tpc) there) and trains on the batches rank 0 broadcasts, until
 * rank 0 says the run is over. A rank 0 silent for twice async.peer_timeout (it sends
 * keep-alives when idle) is reported lost: RF_ERR_IO naming its world rank. dpc: with data
 * parallelism too, the ranks of this TP position (one per replica; NULL: none): the shard's
 * gradients are summed over it, and it starts from replica 0's shard; every replica sends its
 * shards over wcomm (rank i of the training ranks there). */
rf_status rf_train_tp_peer_main(const rf_recipe *r, rf_comm *tpc, rf_comm *wcomm, rf_comm *dpc, rf_handover *ho);

#endif
