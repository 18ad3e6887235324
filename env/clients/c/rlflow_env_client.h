/* rlflow environment-program client library for C (docs/env-api.md): write a reset and a step
 * function, call rf_env_client_serve, and the library does the rest of the protocol: it
 * connects a ZeroMQ DEALER to rlflow's env.endpoint, says Hello as an environment program
 * (ROLE_ENVIRONMENT) with a name and a capacity, answers every Heartbeat while it waits,
 * hands each EnvReset and EnvStep to your functions and sends their EnvReply back, connects
 * again after rlflow drops this program (an Error), and returns on Shutdown.
 *
 *     static int step(const rf_env_client_step *q, rf_env_client_reply *r, void *user) {
 *         if (q->finish[0] != 's') { r->done = 1; return 0; }         // not a tool call
 *         snprintf(r->observation, sizeof r->observation, "<result>%d</result>", 42);
 *         return 0;
 *     }
 *     rf_env_client_opts o = {.connect = "tcp://127.0.0.1:5558", .name = "my_env"};
 *     rf_status st = rf_env_client_serve(&o, NULL, step, NULL);   // NULL reset: ""
 *
 * examples/env/calculator_env_c.c is a complete program. Build: CMake target
 * rlflow_env_client (links libzmq and protobuf-c through rlflow_core).
 *
 * Threads: one. Requests are answered in order on the calling thread, which answers pings only
 * between requests: keep each call well under env.timeout / 2 (a tool call, a game move), or use
 * the Python client (threads) for slow work. */
#ifndef RF_ENV_CLIENT_H
#define RF_ENV_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define RF_ENV_CLIENT_TEXT_LEN 4096

/* An EnvReset. Pointers valid during the call only. */
typedef struct rf_env_client_reset {
    uint64_t request_id, episode_id;
    const char *prompt;           /* "" when none */
    const int32_t *prompt_ids;    /* (n_prompt_ids) */
    size_t n_prompt_ids;
    const char *ground_truth;     /* "" when none */
    const char *metadata_json;    /* a JSON object, or "" */
    int64_t sample_index, group_id;
} rf_env_client_reset;

/* An earlier turn of the episode. */
typedef struct rf_env_client_turn {
    const char *action;
    const int32_t *action_ids;    /* (n_action_ids) */
    size_t n_action_ids;
    const char *observation;
    float reward;
} rf_env_client_turn;

/* An EnvStep. Pointers valid during the call only. */
typedef struct rf_env_client_step {
    uint64_t request_id, episode_id;
    int turn;                     /* 0 first */
    const char *action;           /* the turn's text, cut before a stop string */
    const int32_t *action_ids;    /* (n_action_ids) */
    size_t n_action_ids;
    const char *finish;           /* "eos", "stop", "length" */
    int last;                     /* a limit ends the episode after this turn */
    rf_env_client_reset reset;    /* the episode's reset (request_id 0) */
    const char *first_observation;
    const rf_env_client_turn *history; /* (n_history) turns 0 .. turn - 1 */
    size_t n_history;
} rf_env_client_step;

/* What a function fills in (zeroed before the call). */
typedef struct rf_env_client_reply {
    char observation[RF_ENV_CLIENT_TEXT_LEN]; /* "" = nothing to append */
    float reward;                 /* steps: this turn's reward, finite; resets: leave 0 */
    int done;                     /* steps: the episode ends; resets: leave 0 */
    char info[256];
    char error[1024];             /* non-empty: this request could not be answered */
} rf_env_client_reply;

/* Return 0, or any other value to send out->error (or "the function returned <rc>") as the
 * request's error: rlflow re-sends the request to another program and stops the run after
 * max_attempts (3) rejections of one request. */
typedef int (*rf_env_client_reset_fn)(const rf_env_client_reset *req, rf_env_client_reply *out, void *user);
typedef int (*rf_env_client_step_fn)(const rf_env_client_step *req, rf_env_client_reply *out, void *user);

typedef struct rf_env_client_opts {
    const char *connect;       /* rlflow's env.endpoint; NULL: RLFLOW_ENV_ENDPOINT (with its CURVE
                                  keys and RLFLOW_ENV_RANK: a program rlflow started with
                                  env.programs), else "tcp://127.0.0.1:5558" */
    const char *name;          /* NULL: "env_program" */
    int capacity;              /* requests rlflow may send before an answer; 0: 4 */
    int rank;
    double hello_timeout_s;    /* wait for HelloAck, first and after a reconnection; 0: 30 */
    int no_reconnect;          /* 1: return RF_ERR_IO when dropped instead of reconnecting */
    int quiet;                 /* 1: nothing on stderr */
    const char *curve_server_key, *curve_public_key, *curve_secret_key; /* Z85, or NULL */
} rf_env_client_opts;

/* Serves until rlflow sends Shutdown (RF_OK) or an error: RF_ERR_ARG (no step function, bad
 * options), RF_ERR_UNSUPPORTED (refused: rlflow's sentence), RF_ERR_IO (no rlflow answered
 * Hello within hello_timeout_s; dropped with no_reconnect). reset may be NULL (every first
 * observation ""). Blocks the calling thread; *answered (may be NULL) counts the replies sent. */
rf_status rf_env_client_serve(const rf_env_client_opts *opts, rf_env_client_reset_fn reset,
                              rf_env_client_step_fn step, void *user, long *answered);

#endif
