/* Tensor-parallel generation (placement.rollout.tp = T > 1): one rollout worker is a group of T
 * ranks, each holding one shard of the policy (model/model_tp.h) and a paged KV pool of its own
 * k/v heads (rf_model_tp_kv_pool_init). Rank 0 of the group runs the rollout engine
 * (rollout/rollout.h: scheduler, sampling, the controller's link) exactly as a whole-model
 * worker does; only the engine's model calls differ (rf_rollout_model):
 *
 *   pool     rank 0 makes its pool and tells the peers to make theirs, of the same blocks;
 *   release  rank 0 gives its pool's memory back and tells the peers to give theirs back
 *            (rf_rollout_release_cache); each rank allocates it again at its next step;
 *   copy     a copy on write is done at once on rank 0 and queued for the peers;
 *   decode   rank 0 broadcasts the step (the queued copies, each row's cached and new
 *            counts and block table, the packed tokens, the rows to capture, the draws: each
 *            running sequence's row, sampling and uniform), every rank runs
 *            rf_model_tp_decode_paged on its heads and vocabulary rows, and the group draws
 *            from the slices of the logits (rf_model_tp_sample: the same tokens as the
 *            whole-model engine's rf_sample on whole rows); captured rows (a prompt's logits
 *            kept for its samples that start later) are gathered whole.
 *
 * Block ids mean the same on every rank: the bookkeeping (free list, references) lives in the
 * engine on rank 0 alone, the peers only hold memory. The other ranks loop in
 * rf_rollout_tp_serve on rank 0's commands: a step, new weights (handed to a callback, in which
 * every rank of the group takes part in the transfer), keep-alive, stop.
 *
 * Bounds: every collective is bounded by timeout_s (comm.h): a peer that is gone stops rank 0
 * at its next step with the operation and the rank named; a peer waits for a command at most
 * 2 x timeout_s (rank 0 sends a keep-alive when it has been quiet for timeout_s / 4,
 * rf_rollout_tp_keepalive), so a rank 0 that is gone stops the peers naming it.
 *
 * Threads: one thread uses a group and its communicator. */
#ifndef RF_ROLLOUT_TP_H
#define RF_ROLLOUT_TP_H

#include <stdint.h>

#include "model/model_tp.h"
#include "rollout/rollout.h"

typedef struct rf_rollout_tp rf_rollout_tp;

/* Commands from rank 0 to the peers: STOP ends their serve loop; the others (WEIGHTS) reach
 * the serve callback. */
enum { RF_ROLLOUT_TP_STOP = 0, RF_ROLLOUT_TP_WEIGHTS = 1 };

/* Called on a peer for a command from rank 0 that is not the engine's (cmd, arg as sent). */
typedef rf_status (*rf_rollout_tp_handler)(void *ctx, int cmd, int64_t arg);

/* The generation side of group tp->comm for the shard model tp (borrowed; must outlive the
 * group). No communication. RF_ERR_NOMEM. Free with rf_rollout_tp_free. */
rf_status rf_rollout_tp_init(rf_rollout_tp **out, rf_model_tp *tp, double timeout_s);
void rf_rollout_tp_free(rf_rollout_tp *g);

/* Rank 0: an engine whose model calls run over the group (o as for rf_rollout_init). Making
 * its pool sends the peers their pool command, so they must be in rf_rollout_tp_serve.
 * Free the engine (rf_rollout_free) before the group. */
rf_status rf_rollout_tp_engine(rf_rollout_tp *g, const rf_rollout_opts *o, rf_rollout **e);

/* Rank 0: sends the peers command cmd (RF_ROLLOUT_TP_WEIGHTS, or RF_ROLLOUT_TP_STOP to end
 * their serve loop) with arg. */
rf_status rf_rollout_tp_send(rf_rollout_tp *g, int cmd, int64_t arg);

/* Rank 0: a keep-alive when no command went out for timeout_s / 4 (call it from the event
 * loop while idle). */
rf_status rf_rollout_tp_keepalive(rf_rollout_tp *g);

/* Peers: begin(ctx) before and end(ctx) after each step served (a colocated process's rollout
 * rank reading the weights its training rank writes: resharding/handover.h); a begin that fails
 * stops rf_rollout_tp_serve with its error. */
void rf_rollout_tp_set_guard(rf_rollout_tp *g, rf_status (*begin)(void *ctx), void (*end)(void *ctx), void *ctx);

/* Peers: follow rank 0's commands until it sends RF_ROLLOUT_TP_STOP (RF_OK) or something
 * fails: a command not heard within 2 x timeout_s, a collective of a step, the handler's error
 * (handler may be NULL when rank 0 sends only engine commands). */
rf_status rf_rollout_tp_serve(rf_rollout_tp *g, rf_rollout_tp_handler handler, void *ctx);

#endif
