/* External reward programs: the rlflow side of the reward-program protocol
 * (docs/reward-api.md). rlflow binds an endpoint (a ZeroMQ ROUTER); reward programs, written in
 * any language, connect to it (DEALER), say Hello, and answer RewardRequests with
 * RewardResponses. Several programs may connect; requests are spread across them up to each
 * one's declared capacity, fewest in flight first.
 *
 * Faults: a program that disconnects, stays silent (answers no ping) for timeout_s, or holds
 * requests without answering any of them for timeout_s is dropped and its requests go to another
 * program; when none is left, the bridge waits timeout_s for one to connect (or reconnect), then
 * fails naming the program that was lost and the request it was scoring. A drop for silence or
 * for the deadline also counts against each request the program held, as a rejection (below):
 * a sample that makes every program hang fails the batch after max_attempts deadlines.
 *
 * A bad reply never stops a run by itself. A reply that does not decode, a NaN or infinite
 * reward (or one that overflows once multiplied by cfg.weight), an `error` reply, per-token
 * rewards of the wrong count or not finite (or overflowing once weighted), a NaN / infinite
 * component or a component name that is empty or over 63 bytes, an unknown or duplicate
 * request id, or a message a reward program may not send is rejected: logged as a
 * warning ("reward: rejected a reply: <program> answered reward nan for request 5 (sample 4 of
 * group 0); rewards must be finite"), the program is told why (an Error) and dropped as for a
 * crash, and the request is sent again, to another program or to the same one once it has
 * reconnected. Each rejection counts against the sample it answers (a reply that names no
 * request it holds counts against every request the program held). A sample rejected
 * max_attempts times (RF_EXTERNAL_MAX_ATTEMPTS by default) fails the batch with RF_ERR_FORMAT
 * (RF_ERR_RANGE when the last reason was a non-finite value), naming the request, the sample
 * and every rejection's program and reason (RF_ERR_IO when the last was a deadline). A
 * disconnect (crash, closed socket) does not count: it is waited out as above. A reply that
 * does not decode includes one that fails rf_msg_validate (a wrong wire type, a NUL byte in a
 * string, a string not UTF-8): it counts against the request it names.
 *
 * Every sample is scored exactly once: a late answer from a dropped program is never seen (the
 * message layer answers it with an Error), and a late answer to a batch that failed is ignored.
 *
 * Security: an endpoint that other machines can reach (not loopback, ipc:// or inproc://) is
 * refused unless it uses CURVE (a server key file and a list of allowed client keys:
 * reward.external_curve_secret, reward.external_curve_clients) or the caller opts out with
 * `insecure` (reward.external_insecure), which logs a warning. A connection refused by CURVE
 * (an unlisted key, no CURVE) is logged naming the endpoint, the address and the key; it does
 * not stop a run, which goes on waiting for an allowed program.
 *
 * Recipe wiring (docs/reward-api.md, "Using it from a recipe"):
 *     rf_external_reward_config xc = {.endpoint = r->reward.external,
 *         .timeout_s = r->reward.external_timeout,
 *         .curve_secret_file = r->reward.external_curve_secret,
 *         .curve_clients_file = r->reward.external_curve_clients,
 *         .insecure = r->reward.external_insecure};
 *     rf_external_reward_open_with(&run->ext, &xc);
 *     rf_external_reward_score(run->ext, items, n, scores);   // reward += weight * scores[i]
 *     const float *tok;                                       // optional per-token rewards:
 *     int n_tok = rf_external_reward_token_rewards(run->ext, i, &tok);  // 0 or n_response_ids
 *     rf_external_reward_stats st = rf_external_reward_last_stats(run->ext);  // for metrics
 *     rf_external_reward_close(run->ext);
 *
 * Threads: one thread at a time per object. Time between calls is not counted against the
 * programs (they cannot be pinged while nobody listens). */
#ifndef RF_REWARD_EXTERNAL_H
#define RF_REWARD_EXTERNAL_H

#include <stdint.h>

#include "common/status.h"

/* One sample to score. Every pointer is the caller's and only read during the call; NULL text
 * fields travel as "". */
typedef struct rf_reward_item {
    const char *prompt;          /* prompt text */
    const char *response;        /* generated text */
    const int32_t *prompt_ids;   /* (n_prompt_ids) */
    int n_prompt_ids;
    const int32_t *response_ids; /* (n_response_ids) */
    int n_response_ids;
    const char *truth;           /* the dataset's answer, may be NULL */
    const char *metadata_json;   /* the sample's other dataset fields as a JSON object, may be NULL */
    int64_t index;               /* sample index within its group */
    int64_t group;               /* group (prompt) id */
} rf_reward_item;

typedef struct rf_external_reward rf_external_reward;

typedef struct rf_external_reward_config {
    const char *endpoint;           /* "tcp://127.0.0.1:5557", "tcp://127.0.0.1:*", "ipc://..." */
    double timeout_s;               /* > 0, see rf_external_reward_open */
    const char *curve_secret_file;  /* rlflow's Z85 secret key file (rlflow keygen); NULL or "":
                                       no CURVE */
    const char *curve_clients_file; /* the allowed client public keys, one per line; needed with
                                       curve_secret_file */
    int insecure;                   /* 1: bind a non-loopback endpoint without CURVE (warned) */
    int max_attempts;               /* rejected replies a sample may get before its batch
                                       fails; 0: RF_EXTERNAL_MAX_ATTEMPTS */
    const char *curve_secret_key;   /* rlflow's Z85 secret key itself, instead of
                                       curve_secret_file (keys made for the run); NULL: none */
    const char *const *curve_client_keys; /* (n_curve_client_keys) Z85 public keys allowed
                                       besides those of curve_clients_file (the programs rlflow
                                       starts); CURVE needs a secret key with them */
    int n_curve_client_keys;
    rf_status (*tick)(void *ctx);   /* NULL, or called at least every 0.25 s while the bridge
                                       waits (for programs, for answers); an error from it ends
                                       the wait with that error (rf_programs_tick restarts the
                                       programs rlflow started, controller/programs.h) */
    void *tick_ctx;
    double weight;                  /* reward.external_weight, which the caller multiplies the
                                       rewards by in float: a reply whose reward, per-token
                                       rewards or their sum overflow (are not finite) once
                                       weighted is rejected like a NaN reward. 0: no such check
                                       (nothing overflows at weight 0) */
    int (*stop)(void);              /* NULL, or non-zero (the signal) once the run was asked to
                                       stop (rf_interrupt_signal): from then on no sample is sent
                                       again and no program waited for; answers to the requests in
                                       flight are still taken (each program's deadline bounds the
                                       wait), and the first sample that would go again fails the
                                       batch (RF_ERR_IO, "interrupted (signal 15): ...") */
} rf_external_reward_config;

/* The default of rf_external_reward_config.max_attempts: a sample that three replies in a row
 * were rejected for is the sample's fault, not a program's, and the batch fails naming it. */
#define RF_EXTERNAL_MAX_ATTEMPTS 3

/* Binds `endpoint` ("tcp://127.0.0.1:5557"; "tcp://127.0.0.1:*" picks a free port, see
 * rf_external_reward_endpoint) and waits up to timeout_s for the first reward program to
 * connect. timeout_s (> 0) is also the silence / no-progress limit per program and the wait for
 * a replacement when every program is gone. Caller owns *x (rf_external_reward_close).
 * Errors: RF_ERR_ARG (bad endpoint or timeout), RF_ERR_IO (bind failed; no program connected
 * in time, the message says how to start one), RF_ERR_UNSUPPORTED (the first program to
 * connect was refused, e.g. "reward program 'x' (pid 7) speaks protocol 2, rlflow speaks 1").
 * *x is NULL on error. */
rf_status rf_external_reward_open(rf_external_reward **x, const char *endpoint, double timeout_s);

/* Same, without waiting for a program (the first rf_external_reward_score waits instead). */
rf_status rf_external_reward_listen(rf_external_reward **x, const char *endpoint,
                                    double timeout_s);

/* rf_external_reward_open / _listen with CURVE and the non-loopback policy (the plain ones
 * are these with no key files and insecure = 0). More errors: RF_ERR_ARG for a non-loopback
 * endpoint without CURVE or insecure (the message says what to set), for a curve file without
 * the other, and for malformed key files (naming file and line); RF_ERR_IO for an unreadable
 * key file. */
rf_status rf_external_reward_open_with(rf_external_reward **x,
                                       const rf_external_reward_config *cfg);
rf_status rf_external_reward_listen_with(rf_external_reward **x,
                                         const rf_external_reward_config *cfg);

/* Waits up to timeout_s until at least n programs are connected (e.g. before a run that wants
 * all of its programs from the start). Errors: RF_ERR_IO naming how many came (and the last
 * CURVE refusal, if any); RF_ERR_UNSUPPORTED when a program that got through is refused at
 * Hello meanwhile (its sentence: a protocol mismatch). CURVE refusals are logged and waited
 * past: a stranger's connection must not stop a run. */
rf_status rf_external_reward_wait(rf_external_reward *x, int n, double timeout_s);

/* Scores n items into rewards (n), blocking until every one is back or an error. Rejected
 * replies are re-sent (header comment) and do not fail the call by themselves. Errors:
 * RF_ERR_FORMAT / RF_ERR_RANGE / RF_ERR_IO when a sample was rejected (or its program dropped
 * for a deadline or silence) max_attempts times (the message names the request, the sample and
 * each rejection's program and reason); RF_ERR_IO when no program is left for timeout_s (naming
 * the last one lost and its request), or once a stop was asked for (cfg.stop) and a sample
 * would be sent again. On error the
 * contents of rewards are unspecified. n == 0 returns at once. */
rf_status rf_external_reward_score(rf_external_reward *x, const rf_reward_item *items, int n,
                                   float *rewards);

/* The info string the program returned for item i of the last successful batch ("" when
 * none, or after a failed batch); owned by x, valid until the next score call. */
const char *rf_external_reward_info(const rf_external_reward *x, int i);

/* The per-token rewards (RewardResponse.token_rewards) of item i of the last successful batch:
 * sets *v to them (owned by x, valid until the next score call) and returns how many, which is
 * the item's n_response_ids; returns 0 with *v = NULL when the program sent none (or after a
 * failed batch). Semantics (docs/reward-api.md): added to the sample's reward per token; for
 * PPO/GAE each value is the reward at its token, for group-based estimators (GRPO, RLOO, ...)
 * their sum is added to the sequence reward. */
int rf_external_reward_token_rewards(const rf_external_reward *x, int i, const float **v);

/* What happened during the last score call, for the run's metrics. */
typedef struct rf_external_reward_stats {
    int accepted;    /* replies accepted: n after a successful batch (each sample exactly once) */
    int rejected;    /* replies rejected (their programs told why and dropped) */
    int lost;        /* programs lost while the batch ran (disconnected, silent, no progress) */
    int resent;      /* requests sent again after their program was dropped or lost */
    int token_rewards; /* accepted replies that carried per-token rewards */
} rf_external_reward_stats;

/* The stats of the last score call (zeros before the first), successful or not. */
rf_external_reward_stats rf_external_reward_last_stats(const rf_external_reward *x);

/* The reason of the last reply rejected during the last score call ("" when none), the text
 * that was logged and sent to the program; owned by x, valid until the next score call. */
const char *rf_external_reward_last_rejection(const rf_external_reward *x);

#define RF_EXTERNAL_MAX_COMPONENTS 64

/* The named components (RewardResponse.components) of the last successful batch, each
 * averaged over the samples whose response carried it, for the run's metrics: up to cap names
 * (owned by x, valid until the next score call) and means. Returns how many. At most
 * RF_EXTERNAL_MAX_COMPONENTS distinct names are kept (later new names are left out, with one
 * warning per batch); a reply with a non-finite value or an empty or over-63-byte name was
 * rejected instead. */
int rf_external_reward_components(const rf_external_reward *x, const char **names, double *means,
                                  int cap);

/* The endpoint actually bound (the port filled in); owned by x. */
const char *rf_external_reward_endpoint(const rf_external_reward *x);

/* Number of reward programs connected now (as of the last call). */
int rf_external_reward_programs(const rf_external_reward *x);

/* Sends Shutdown to every connected program (those whose Hello is waiting included) and closes
 * the endpoint. NULL is fine. The reason is RF_MSG_SHUTDOWN_DONE unless
 * rf_external_reward_set_end gave another. */
void rf_external_reward_close(rf_external_reward *x);

/* The reason the Shutdown at close gives (copied): RF_MSG_SHUTDOWN_DONE,
 * RF_MSG_SHUTDOWN_INTERRUPTED, or "the run stopped on an error: ..." (common/msg.h). */
void rf_external_reward_set_end(rf_external_reward *x, const char *reason);

#endif
