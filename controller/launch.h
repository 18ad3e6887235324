/* Launch and placement of split runs (placement.mode = "split").
 *
 * Layout (MPI ranks of one job, MPMD by rank): rank 0 is the controller, ranks 1 .. dp x tp the
 * training workers (dp = placement.actor.dp, tp = placement.actor.tp; rank 1 hosts the actor
 * with the reference and critic colocated and talks to the controller; training rank
 * i = rank - 1 is tensor-parallel rank i % tp of data-parallel replica i / tp, tp varying
 * fastest as in Megatron-LM), then the rollout workers, placement.rollout.tp = G consecutive
 * ranks each (the first of them runs the engine and talks to the controller). The world size
 * must be 1 + dp x tp + rollout_ranks x G.
 *
 * `rlflow run recipe.toml` outside MPI prepares the data and the model (the SFT warm start)
 * and then replaces itself with `<placement.mpirun> -np N --oversubscribe --bind-to none
 * <rlflow> run ...`; under mpirun (started by rlflow or by the user, one machine or several),
 * each rank takes its role from its rank. The controller binds a ZeroMQ endpoint and
 * broadcasts it over MPI; the workers connect to it (the data-parallel peers do not: rank 1
 * hands them their shares over MPI); weights travel over MPI between rank 1 and the rollout
 * workers. */
#ifndef RF_LAUNCH_H
#define RF_LAUNCH_H

#include "controller/recipe.h"

/* argc/argv: the whole command line of the process (argv[0] = the rlflow program), used to
 * start the same command under mpirun. Returns when the run is over (this rank's part). A
 * rank that fails prints its error itself (before MPI_Finalize, which may wait) and returns it
 * with the thread's message cleared. */
rf_status rf_run_split(const rf_recipe *r, int resume, int argc, char **argv);

/* model.device = "cuda": the GPU of world rank `rank` (> 0) when node[i] is the machine of
 * world rank i (rf_comm_set_nodes' numbers) and its machine shows n_devices GPUs: the worker
 * ranks of each machine (not the controller, rank 0) take its GPUs in turn, by world rank;
 * -1 for rank 0 or n_devices < 1. (A colocated run's rollout ranks are threads of the training
 * ranks' processes, on their GPUs.) */
int rf_launch_gpu_of(const int *node, int rank, int n_devices);

#endif
