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

/* ---- an episode's book, between its turns -------------------------------------------------
 * What both drivers keep per episode (the one-process loop's below, which steps the engine
 * itself, and the split controller's, controller/episodes_split.c, whose rollout worker sends
 * the turns that ended in EnvTurns): the reset's fields and answer, the turns answered, and the
 * pending turn. The environment calls, the limits and the decision what comes after a turn are
 * made here once for both. */
typedef struct rf_ep_turn {
    char *action;
    int32_t *ids;       /* (n_ids) */
    int n_ids;
    char *obs;
    float reward;
    int end;            /* index into the episode's tokens (after the prompt) of the turn's last
                           generated token */
} rf_ep_turn;

typedef struct rf_ep {
    rf_reward_item ex;  /* the group's fields, index set to the sample's (pointers borrowed) */
    uint64_t id;        /* episode id */
    char *first_obs;    /* the reset's answer */
    char *first_from;   /* who answered it (rf_env_reply.from), for messages */
    rf_ep_turn *turns;  /* (n_turns) answered turns, then the pending one at n_turns */
    int n_turns, cap_turns;
    int pending;        /* a turn waits for the environment */
    const char *finish; /* of the pending turn: "eos", "stop", "length" */
    int used;           /* tokens after the prompt (and first observation) so far */
    int truncated;      /* ended by a limit */
    int ended;          /* the last answer ended the episode */
} rf_ep;

/* What follows a turn the environment answered: the episode ends, or obs (n_obs, owned: free)
 * is appended and the next turn starts. */
typedef struct rf_ep_next {
    int end;
    int32_t *obs;       /* (n_obs) */
    int n_obs;
} rf_ep_next;

/* Frees e's strings and turns (not e). */
void rf_ep_free(rf_ep *e);

/* Opens every episode of ep (n; ex and id set by the caller) with one reset call; their first
 * observations into ep[k].first_obs. Errors: the environment's. */
rf_status rf_ep_reset(rf_env *env, rf_ep *ep, int n);

/* The first observation's ids (*ids owned, NULL when empty). RF_ERR_ARG: text and no tokenizer. */
rf_status rf_ep_encode(const rf_tokenizer *tok, const char *text, int32_t **ids, int *n);

/* Checks that e's prompt and first observation (n_obs tokens) leave room for max_total_tokens
 * within the model's `positions` (0: not known, nothing checked). RF_ERR_RANGE otherwise, a
 * failure of the run rather than a rejection (the same prompt gets the same answer from any
 * program), naming who answered the reset, the episode and every count: "episodes: the first
 * observation of episode 40 (sample 0 of group 0) from environment program 'x' (rank 0, pid 7)
 * on tcp://...: the prompt (100 tokens) + the observation (2008 tokens) + env.max_total_tokens
 * (32) exceed the model's 2048 positions". */
rf_status rf_ep_check_room(const rf_ep *e, int n_obs, int max_total_tokens, int positions);

/* Records e's turn that ended: ids (n_ids) and text (len bytes) copied, finish its reason, used
 * the episode's tokens after the prompt so far (the turn's last at used - 1). RF_ERR_ARG when a
 * turn is pending already or the episode ended. */
rf_status rf_ep_turn_ended(rf_ep *e, const int32_t *ids, int n_ids, const char *text, size_t len, const char *finish,
                           int used);

/* Sends the pending turns of eps (n) to env in one call and decides each one's next step into
 * next (n; obs owned by the caller): the environment said done or a limit was reached (max_turns,
 * or no room for the observation and a token within max_total_tokens: truncated) -> end; else
 * the observation tokenised once. Errors: the environment's, the tokenizer's. */
rf_status rf_ep_step(rf_env *env, const rf_episode_opts *o, rf_ep *const *eps, int n, rf_ep_next *next);

/* The turn rewards of e at each turn's last token: adds them into tr (n_tokens, zeroed by the
 * caller) and returns their sum. RF_ERR_FORMAT when a turn's end is not in [0, n_tokens). */
rf_status rf_ep_turn_rewards(const rf_ep *e, float *tr, int n_tokens, double *sum);

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
