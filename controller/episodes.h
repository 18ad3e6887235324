/* Multi-turn episodes (docs/env-api.md): the controller's driver of the rollout engine's
 * episodes (rollout/rollout.h, rf_rollout_request.episode) and an environment (env/env.h).
 *
 * For a batch of prompt groups it opens one episode per sample (a reset), appends the first
 * observation to the prompt, and lets the engine generate turns. After each engine step, the
 * turns that ended go to the environment in one batch call; each answer's observation is
 * tokenised once and appended to the sequence as masked tokens (its KV blocks stay in the
 * cache), and the next turn starts. An episode ends when the environment says done, after
 * env.max_turns turns, or when max_total_tokens leaves no room for the next observation and a
 * token (the observation is then dropped: truncated). The trajectory is exactly the
 * generated ids and the observation ids in order, never re-tokenised; every generated token
 * keeps the policy version that produced it; each turn's reward sits at the turn's last
 * generated token.
 *
 * Determinism: sample i of group g draws from an RNG seeded seed + g * n + i whatever the
 * environment's timing, so the same replies give the same episodes. */
#ifndef RF_EPISODES_H
#define RF_EPISODES_H

#include <stdint.h>

#include "env/env.h"
#include "model/tokenizer.h"
#include "rollout/rollout.h"

typedef struct rf_episode_opts {
    int max_turns;            /* >= 1 */
    int max_total_tokens;     /* tokens after the prompt and first observation, generated and
                                 observed, >= the turn limit (req->max_new_tokens) */
    const rf_tokenizer *tok;  /* encodes observations (no special tokens added) */
} rf_episode_opts;

/* One finished episode. Arrays owned (rf_episode_free). */
typedef struct rf_episode {
    int32_t *prompt;          /* (n_prompt) the prompt, then the first observation's ids */
    int n_prompt;
    int32_t *ids;             /* (n) generated and observation ids after the prompt, in order */
    float *logp;              /* (n) behaviour log-probs; 0 at observations */
    int *versions;            /* (n) policy version of each generated token; at an observation
                                 the version of the generated token before it */
    uint8_t *mask;            /* (n) 1 generated, 0 observation */
    float *turn_rewards;      /* (n) each turn's reward at its last generated token, else 0 */
    int n;
    int turns;                /* turns generated */
    int truncated;            /* ended by max_turns or max_total_tokens, not by the environment */
    double env_reward;        /* the sum of the turn rewards */
    char *last_text;          /* the last turn's text (the reward rules score it) */
    char *text;               /* the whole response decoded (logs) */
} rf_episode;

void rf_episode_free(rf_episode *e);

/* Runs n_groups * n episodes: group g's prompt and fields are ex[g] (ex[g].index is ignored,
 * .group is passed on), sample i of group g is out[g * n + i]. req gives the sampling, the turn
 * limit (max_new_tokens), stop ids and strings; its prompt, n, seed and episode fields are
 * ignored. episode_base numbers the episodes (episode_base + g * n + i). The engine must be
 * idle with its callback free; it is set and cleared here. Errors: the environment's (a
 * failed call fails the batch), the engine's, the tokenizer's; out is then freed. */
rf_status rf_episodes_run(rf_rollout *eng, rf_env *env, const rf_episode_opts *o, const rf_reward_item *ex,
                          int n_groups, int n, const rf_rollout_request *req, uint64_t seed, uint64_t episode_base,
                          rf_episode *out);

#endif
