/* rlflow reward-program client library for C: write a score function, call
 * rf_reward_client_serve, and the library does the rest of the reward-program protocol
 * (docs/reward-api.md): it connects a ZeroMQ DEALER to rlflow's endpoint, says Hello with a
 * name and a capacity, checks the protocol version, answers every Heartbeat, hands each
 * RewardRequest to the score function on a pool of worker threads and sends its
 * RewardResponse back, and returns on Shutdown.
 *
 *     static int score(const rf_reward_request *q, rf_reward_result *r, void *user) {
 *         r->reward = (float)q->n_response_ids / 64.0f;
 *         rf_reward_result_component(r, "length", (float)q->n_response_ids);
 *         return 0;   // optional: rf_reward_result_token_rewards(r, v, q->n_response_ids)
 *     }
 *     rf_reward_client_opts o = {.connect = "tcp://127.0.0.1:5557", .name = "judge"};
 *     rf_status st = rf_reward_client_serve(&o, score, NULL);
 *
 * examples/reward/length_judge.c is a complete program. Build: CMake target
 * rlflow_reward_client (links libzmq and protobuf-c through rlflow_core).
 *
 * Threads: the calling thread owns the socket (ZeroMQ sockets are not thread safe) and keeps
 * answering pings while the score function runs on `threads` worker threads, so a score may
 * take longer than rlflow's peer timeout without the program being declared dead. With
 * threads > 1 the score function must be thread safe.
 *
 * Reconnection (docs/reward-api.md, "Reconnection"): when rlflow closes the connection (its
 * process ended without a Shutdown, or it restarted) or drops this program (an Error), the
 * library opens a fresh socket and says Hello again, waiting up to hello_timeout_s for an
 * rlflow to answer; the requests it held are abandoned (rlflow re-sends them elsewhere, and
 * answers to a session that is gone are never sent). A refusal (protocol version, CURVE key)
 * is final. */
#ifndef RF_REWARD_CLIENT_H
#define RF_REWARD_CLIENT_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define RF_REWARD_MAX_COMPONENTS 32
#define RF_REWARD_NAME_LEN 64
#define RF_REWARD_INFO_LEN 1024

/* One sample to score (RewardRequest). Every pointer is valid during the score call only. */
typedef struct rf_reward_request {
    uint64_t request_id;
    const char *prompt;           /* UTF-8 prompt text, "" when none */
    const char *response;         /* UTF-8 generated text */
    const int32_t *prompt_ids;    /* (n_prompt_ids) prompt token ids */
    size_t n_prompt_ids;
    const int32_t *response_ids;  /* (n_response_ids) response token ids */
    size_t n_response_ids;
    const char *ground_truth;     /* the dataset's answer, "" when none */
    const char *metadata_json;    /* the sample's other dataset fields as a JSON object, or "" */
    int64_t sample_index;         /* index of the sample within its group */
    int64_t group_id;             /* the prompt's group */
} rf_reward_request;

/* What the score function fills in (RewardResponse). It starts zeroed. */
typedef struct rf_reward_result {
    float reward;  /* must be finite: NaN or inf is sent as an error instead */
    int n_components;
    struct {
        char name[RF_REWARD_NAME_LEN];
        float value;
    } components[RF_REWARD_MAX_COMPONENTS];  /* named parts, logged by rlflow as metrics */
    char info[RF_REWARD_INFO_LEN];           /* a one-line explanation, kept with the sample */
    char error[RF_REWARD_INFO_LEN];          /* non-empty: this sample could not be scored */
    /* Optional per-token rewards (RewardResponse.token_rewards), one per response token:
     * set them with rf_reward_result_token_rewards, which copies; the library owns and frees
     * the copy (do not point these at memory of your own). */
    float *token_rewards;                    /* (n_token_rewards) */
    size_t n_token_rewards;                  /* 0 (none) or the request's n_response_ids */
} rf_reward_result;

/* Scores one request into *out. Returns 0 on success; any other value means the sample could
 * not be scored: out->error is sent (or "score function returned <rc>" when it is empty).
 * rlflow then logs that text naming the program and the request, drops the program (this
 * library reconnects at once) and sends the request again, to another program or to this one;
 * a sample refused max_attempts times (3 by default) stops the run. So return an error for a
 * sample you cannot score, not for a fault of your own that will pass. */
typedef int (*rf_reward_score_fn)(const rf_reward_request *req, rf_reward_result *out,
                                  void *user);

typedef struct rf_reward_client_opts {
    const char *connect;       /* rlflow's endpoint; NULL: $RLFLOW_REWARD_ENDPOINT (set for
                                  the programs rlflow starts, with their CURVE keys and rank:
                                  docs/reward-api.md, "Programs started by rlflow"), else
                                  "tcp://127.0.0.1:5557" */
    const char *name;          /* a short name for rlflow's logs; NULL: "reward_program" */
    int capacity;              /* requests rlflow may send before an answer; 0: 2 * threads */
    int threads;               /* scoring threads; 0: 1 */
    int rank;                  /* index among several instances (messages only) */
    double hello_timeout_s;    /* wait for HelloAck, first and after a reconnection; 0: 30 */
    double idle_exit_s;        /* return RF_ERR_IO after this long without any message; 0: never */
    int no_reconnect;          /* 1: return RF_ERR_IO instead of reconnecting */
    int quiet;                 /* 1: no progress lines on stderr (errors are still returned) */
    /* CURVE (docs/reward-api.md, "CURVE"): rlflow's public key, and this program's key pair
     * (the public key may be NULL: derived from the secret). Z85 strings, 40 characters; read
     * them from the files of `rlflow keygen` with rf_reward_client_read_key. */
    const char *curve_server_key, *curve_public_key, *curve_secret_key;
    uint32_t protocol_version; /* 0: the library's (tests claim others) */
    volatile sig_atomic_t *stop; /* optional: set non-zero (e.g. from a signal handler) to make
                                    serve return RF_OK within 0.25 s once the scores in
                                    progress have finished */
} rf_reward_client_opts;

/* Serves until rlflow sends Shutdown (RF_OK), *opts->stop is set (RF_OK), or an error:
 * RF_ERR_ARG (bad options, a malformed key: the message names it), RF_ERR_UNSUPPORTED (refused:
 * rlflow's sentence, e.g. "refused by rlflow at tcp://127.0.0.1:5557: reward program 'judge'
 * (pid 7) speaks protocol 2, rlflow speaks 1", or a CURVE refusal), RF_ERR_IO (no rlflow
 * answered Hello within hello_timeout_s, idle_exit_s passed, or the connection was lost with
 * no_reconnect). The message is rf_error_message(). Blocks the calling thread. */
rf_status rf_reward_client_serve(const rf_reward_client_opts *opts, rf_reward_score_fn score,
                                 void *user);

/* Adds a named component to a result. Returns 0, or -1 when the table is full or the name is
 * empty or longer than RF_REWARD_NAME_LEN - 1 (the component is then not added). */
int rf_reward_result_component(rf_reward_result *r, const char *name, float value);

/* Sets the result's per-token rewards to a copy of v (n): the reward of each response token,
 * so n must be the request's n_response_ids and every value finite (otherwise the library sends
 * an error instead: "the score function returned 3 per-token rewards for a response of 4
 * tokens", "... a non-finite per-token reward (inf at token 2)"). rlflow adds them to the
 * sample's reward per token (PPO/GAE: each is the reward at its token; GRPO, RLOO and other
 * group estimators: their sum is added to the sequence reward). n = 0 clears them. Returns 0,
 * or -1 when out of memory or v is NULL with n > 0 (the result is then unchanged). */
int rf_reward_result_token_rewards(rf_reward_result *r, const float *v, size_t n);

/* Reads the key of a key file (`rlflow keygen`'s PREFIX.key or PREFIX.pub) into key (41
 * bytes). Errors name the file and line. */
rf_status rf_reward_client_read_key(const char *path, char key[41]);

#endif
