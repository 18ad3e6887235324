/* Environments of multi-turn episodes (docs/env-api.md): what the controller's episode driver
 * (controller/episodes.h) asks of an environment, whoever implements it: the bridge to
 * environment programs over the message API (env/bridge.h) or the built-in calculator tool
 * (env/calculator.h).
 *
 * An episode is one sample: the controller opens it with a reset (the example's fields in, a
 * first observation out, possibly empty), then after each turn the model generates it sends a
 * step (the turn's text and token ids in; an observation, a reward for the turn and done out).
 * Every call is self-contained: a step carries the reset's fields and the whole history of the
 * episode, so that any environment can answer it (the bridge re-sends a step to another program
 * when the one holding it dies). */
#ifndef RF_ENV_H
#define RF_ENV_H

#include <stdint.h>

#include "common/status.h"
#include "reward/external.h" /* rf_reward_item: the example's fields */

/* An earlier turn of an episode, with the environment's answer to it. Pointers borrowed. */
typedef struct rf_env_turn {
    const char *action;          /* the turn's text */
    const int32_t *action_ids;   /* (n_action_ids) */
    int n_action_ids;
    const char *observation;     /* what the environment answered */
    float reward;
} rf_env_turn;

/* One request to an environment. Every pointer is the caller's, read during the call only. */
typedef struct rf_env_call {
    int is_step;                 /* 0: reset, 1: step */
    uint64_t episode;            /* unique for the run */
    const rf_reward_item *ex;    /* the example: prompt, prompt ids, truth, metadata, sample
                                    index, group (the response fields are not used) */
    /* steps only */
    int turn;                    /* 0 for the first turn after the reset */
    const char *action;          /* the turn's text, cut before a stop string */
    const int32_t *action_ids;   /* (n_action_ids) the turn's generated ids */
    int n_action_ids;
    const char *finish;          /* "eos", "stop", "length" */
    int last;                    /* a limit ends the episode after this turn */
    const char *first_observation;
    const rf_env_turn *history;  /* (n_history) turns 0 .. turn-1 */
    int n_history;
} rf_env_call;

/* The answer to one call. Strings are owned by the environment and valid until its next call. */
typedef struct rf_env_reply {
    const char *observation;     /* "" = nothing to append */
    float reward;                /* finite; 0 for a reset */
    int done;                    /* 0 for a reset */
    const char *info;            /* "" when none */
    const char *from;            /* who answered, for messages: "environment program 'x' (rank 0,
                                    pid 7) on tcp://...", "the built-in calculator"; NULL: unknown */
} rf_env_reply;

/* What happened during an environment's calls since its stats were last taken (metrics). */
typedef struct rf_env_stats {
    int accepted, rejected, lost, resent;
} rf_env_stats;

/* An environment: a batch call and its bookkeeping. */
typedef struct rf_env {
    void *ctx;
    /* Answers calls[0 .. n) into out (n), blocking until every one is answered or an error. */
    rf_status (*call)(void *ctx, const rf_env_call *calls, int n, rf_env_reply *out);
    /* Returns the stats since the last take and zeroes them; NULL: none kept. */
    rf_env_stats (*take_stats)(void *ctx);
    void (*close)(void *ctx);
    /* NULL, or sets the Shutdown reason its programs get at close (rf_env_bridge_set_end) */
    void (*set_end)(void *ctx, const char *reason);
} rf_env;

/* Closes e's implementation (NULL fine) and clears e. */
void rf_env_close(rf_env *e);

#endif
