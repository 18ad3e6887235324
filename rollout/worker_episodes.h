/* The rollout worker's side of multi-turn episodes in runs of several processes
 * (controller/episodes_split.h has the controller's): the GenerateRequests that are episodes,
 * their turns that ended on their way to the controller (EnvTurns, one per engine step that
 * ended any), and the controller's answers (EnvObservations) applied to the engine: the
 * observation appended masked and the next turn started (the KV prefix kept), or the episode
 * ended and its Sample sent with the loss mask.
 *
 * Versions: every generated token keeps the version of the weights that sampled it; weights
 * that arrive while an episode waits for its observation serve its next turn (interruptible
 * generation); an observation's tokens carry the version of the generated token before them.
 *
 * A controller that does not answer a turn within the deadline (env.timeout times the
 * rejections a request may take, plus async.peer_timeout) fails the worker with an error naming
 * the request, the sample and the turn it waited for.
 *
 * Threads: the worker's loop thread only. */
#ifndef RF_ROLLOUT_WORKER_EPISODES_H
#define RF_ROLLOUT_WORKER_EPISODES_H

#include <stdint.h>

#include "common/msg_link.h"
#include "controller/recipe.h"
#include "rollout/rollout.h"

typedef struct rf_wep rf_wep;

/* The book for recipe r (its [env] limits). Caller owns *x (rf_wep_free). */
rf_status rf_wep_init(rf_wep **x, const rf_recipe *r);
void rf_wep_free(rf_wep *x);

/* Submits episode request g to engine e with tmpl's sampling and stops (prompt, n, seed and
 * episode fields set here): one engine request of n samples when every first observation is
 * the same, else one per sample seeded as sample i would be. The engine's samples carry user =
 * g->request_id. RF_ERR_FORMAT naming the request for first_observations that are not 0 or n. */
rf_status rf_wep_submit(rf_wep *x, rf_rollout *e, const Rlflow__GenerateRequest *g, const rf_rollout_request *tmpl);

/* Whether engine request id belongs to an episode; then *index_base is what its sample indices
 * add up to within the GenerateRequest. */
int rf_wep_lookup(const rf_wep *x, uint64_t engine_req, int *index_base);

/* The engine callback's turn that ended (rs->turn_end): queued for the next EnvTurns. */
rf_status rf_wep_turn(rf_wep *x, const rf_rollout_sample *rs);

/* The callback's final sample of an episode request: its engine request is forgotten once all
 * its samples are in. */
void rf_wep_finished(rf_wep *x, uint64_t engine_req);

/* Sends the queued turns in one EnvTurns (nothing when none). */
rf_status rf_wep_flush(rf_wep *x, rf_msg_link *link);

/* The controller's EnvObservations m, applied to engine e (the samples that end are delivered to
 * the callback here). RF_ERR_FORMAT naming the answer for one that matches no waiting turn. */
rf_status rf_wep_answers(rf_wep *x, rf_rollout *e, const Rlflow__EnvObservations *m);

/* RF_ERR_IO when a turn has waited for its answer past the deadline. */
rf_status rf_wep_check(const rf_wep *x);

/* Turns sent and not answered yet. */
int rf_wep_waiting(const rf_wep *x);

#endif
