/* Multi-turn episodes in runs of several processes (split runs, colocated runs on several
 * devices; docs/env-api.md, "Episodes in split and multi-device runs"): the controller's side.
 *
 * The controller owns the environment (the built-in calculator, or the bridge to environment
 * programs, which it starts itself with env.programs); the rollout worker owns the episode's
 * sequence (its KV cache, its tokens and their versions). Per GenerateRequest the controller
 * resets the group's episodes and sends their first observations' ids with the request
 * (GenerateRequest.episode, first_observations); the rollout worker generates turns, and after
 * each engine step sends the turns that ended in one EnvTurns; the controller asks the
 * environment (one batch call, the same rf_ep_step as the one-process loop: limits, truncation,
 * observations tokenised once) and answers with one EnvObservations (per turn: end, or the
 * observation's ids to append, masked). When an episode ends the worker sends its Sample with
 * the loss mask; the controller checks it against its book (every turn's ids at their place,
 * the mask's length and values), adds the turn rewards at each turn's last token and scores the
 * last turn by the rules, as the one-process loop does (controller/episodes_run.c).
 *
 * Everything a worker sends is checked: a turn for a request that is not an episode, a turn
 * out of order, a sample whose tokens or mask disagree with the turns, is an error naming the
 * worker and the field. */
#ifndef RF_EPISODES_SPLIT_H
#define RF_EPISODES_SPLIT_H

#include <stdint.h>

#include "common/msg.h"
#include "controller/run.h"

typedef struct rf_split_eps rf_split_eps;

/* The book of the run's episodes over run->env (opened by rf__load_rewards; run->env_tick
 * keeps the controller's workers pinged while it waits on the environment); *x NULL without
 * [env]. Caller owns *x (rf_split_eps_close). */
rf_status rf_split_eps_open(rf_split_eps **x, rf_run *run);
void rf_split_eps_close(rf_split_eps *x);

/* The model's position limit (rf_config_max_seq of model.path's config.json): a first
 * observation that leaves no room for env.max_total_tokens within it fails
 * rf_split_eps_begin with rf_ep_check_room's error, naming who answered the reset and the
 * episode. 0 (the default): not checked here (the rollout worker's engine still refuses it,
 * naming neither). x may be NULL. */
void rf_split_eps_set_positions(rf_split_eps *x, int positions);

/* A GenerateRequest q for n samples of ex becomes episodes: resets them (numbered as the
 * one-process loop numbers its episodes) and sets q->episode and q->first_observations (owned
 * by x until rf_split_eps_forget of q->request_id). group: the admission id (-1 validation).
 * Errors: the environment's, the tokenizer's, RF_ERR_RANGE for a first observation too long
 * (rf_split_eps_set_positions). */
rf_status rf_split_eps_begin(rf_split_eps *x, Rlflow__GenerateRequest *q, const rf_example *ex, int n, int64_t group);

/* EnvTurns m from worker `who` (a description for errors): the environment answers every turn
 * and *reply is filled (free with rf_split_eps_reply_free). RF_ERR_FORMAT naming who and the
 * field for a turn the book does not expect. */
rf_status rf_split_eps_turns(rf_split_eps *x, const char *who, const Rlflow__EnvTurns *m, Rlflow__EnvObservations *reply);
void rf_split_eps_reply_free(Rlflow__EnvObservations *reply);

/* Sample m of an episode into s (zeroed by the caller): tokens (prompt, first observation,
 * then every generated and observation id), behaviour log-probs, loss mask, turn rewards (NULL
 * when all 0), the decoded text, and the rules' score of the last turn. The caller sets the
 * versions. RF_ERR_FORMAT naming who and the field when m disagrees with the book. */
rf_status rf_split_eps_sample(rf_split_eps *x, const char *who, const Rlflow__Sample *m, const rf_example *ex,
                              rf_train_sample *s);

/* The last turn's text of sample `index` of request req ("" when unknown): what the rules
 * score (validation). */
const char *rf_split_eps_last_text(const rf_split_eps *x, uint64_t req, int index);

/* Forgets request req's episodes (its group is complete or dropped). */
void rf_split_eps_forget(rf_split_eps *x, uint64_t req);

/* The env/ metrics of a batch's episodes, training groups `groups` (n_groups admission ids),
 * on m, as the one-process loop sets them per step; their sums are forgotten. The env/rejected,
 * resent and lost counts are the environment's since the last batch. Nothing when x is NULL. */
void rf_split_eps_metrics(rf_split_eps *x, const int64_t *groups, int n_groups, rf_metrics *m);

/* Forgets the sums of training group `group` (dropped: stale, or by dynamic sampling). */
void rf_split_eps_dropped(rf_split_eps *x, int64_t group);

#endif
