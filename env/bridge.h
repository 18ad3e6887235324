/* Environment programs: the rlflow side of the environment protocol (docs/env-api.md), built
 * like the reward-program bridge (reward/external.h) and with the same guarantees. rlflow binds
 * an endpoint (a ZeroMQ ROUTER); environment programs, in any language, connect (DEALER), say
 * Hello with role ROLE_ENVIRONMENT and a capacity, and answer EnvReset and EnvStep requests with
 * EnvReplies. Requests are spread over the programs up to each one's capacity, fewest in
 * flight first.
 *
 * Faults: a program that disconnects, stays silent for timeout_s, or holds requests without
 * answering any for timeout_s (the per-call deadline) is dropped and its requests go to another
 * program (every request is self-contained: a step carries the episode's reset and history);
 * when none is left the bridge waits timeout_s for one to connect, then fails naming the
 * program lost and its request. A drop for silence or for the deadline also counts against each
 * request the program held, as a rejection (below), so a request that makes every program hang
 * fails the call after max_attempts deadlines.
 *
 * A bad reply (one that does not decode, a non-finite reward, a reset answered with a reward or
 * done, an `error` reply, an Error message, an unknown or repeated request id, a message an
 * environment may not send) is rejected: logged ("env: rejected a reply: ..."), the program told
 * why and dropped, the request sent again. A request rejected max_attempts times fails the call
 * with RF_ERR_FORMAT (RF_ERR_RANGE when the last reason was a non-finite reward, RF_ERR_IO a
 * deadline), naming the request, the episode, the sample and every rejection. A reply that does
 * not decode includes one that fails rf_msg_validate (a wrong wire type, a NUL byte in a
 * string, a string not UTF-8): it counts against the request it names. Every request is
 * answered exactly once.
 *
 * Security as for reward programs: an endpoint other machines can reach needs CURVE
 * (env.curve_secret, env.curve_clients) or `insecure` (warned).
 *
 * Threads: one thread at a time per object. */
#ifndef RF_ENV_BRIDGE_H
#define RF_ENV_BRIDGE_H

#include "env/env.h"

typedef struct rf_env_bridge rf_env_bridge;

typedef struct rf_env_bridge_config {
    const char *endpoint;           /* "tcp://127.0.0.1:5558", "tcp://127.0.0.1:*", "ipc://..." */
    double timeout_s;               /* > 0: connect wait, silence and per-call deadline */
    const char *curve_secret_file;  /* NULL or "": no CURVE */
    const char *curve_clients_file; /* needed with curve_secret_file */
    int insecure;                   /* 1: bind a non-loopback endpoint without CURVE (warned) */
    int max_attempts;               /* rejected replies per request before the call fails;
                                       0: RF_EXTERNAL_MAX_ATTEMPTS (3) */
    const char *curve_secret_key;   /* rlflow's Z85 secret key itself (keys made for the run,
                                       env.programs); NULL: none */
    const char *const *curve_client_keys; /* (n_curve_client_keys) Z85 public keys allowed besides
                                       those of curve_clients_file (the programs rlflow starts) */
    int n_curve_client_keys;
    rf_status (*tick)(void *ctx);   /* NULL, or called at least every 0.25 s while the bridge
                                       waits (for a program, for replies); an error ends the
                                       wait with that error (env.programs: the supervisor's
                                       restarts; a split controller: its workers' pings) */
    void *tick_ctx;
    int (*stop)(void);              /* NULL, or non-zero (the signal) once the run was asked to
                                       stop (rf_interrupt_signal): from then on no request is
                                       sent again and no program waited for; replies to those in
                                       flight are still taken (each program's deadline bounds
                                       the wait), the first request that would go again fails
                                       the call (RF_ERR_IO, "env: interrupted (signal 15): ...") */
} rf_env_bridge_config;

/* Binds the endpoint without waiting for a program (the first call waits). Caller owns *x
 * (rf_env_bridge_close). Errors: RF_ERR_ARG (bad endpoint, timeout, attempts, an open endpoint
 * without CURVE or insecure, one curve file without the other), RF_ERR_IO (bind, key files). */
rf_status rf_env_bridge_listen(rf_env_bridge **x, const rf_env_bridge_config *cfg);

/* Waits up to timeout_s until n programs are connected. RF_ERR_IO naming how many came. */
rf_status rf_env_bridge_wait(rf_env_bridge *x, int n, double timeout_s);

/* Answers calls (n) into out (n), blocking; see the header comment for faults. Reply strings
 * (from: the answering program's description) are owned by x and valid until the next call. A
 * program dropped for missing its deadline or for silence counts against each request it held
 * as a rejection (so a request no program answers fails the call after max_attempts
 * deadlines). Errors: RF_ERR_FORMAT / RF_ERR_RANGE / RF_ERR_IO after max_attempts rejections of
 * one request; RF_ERR_IO when no program is left for timeout_s, or once a stop was asked for
 * (cfg.stop) and a request would be sent again. */
rf_status rf_env_bridge_call(rf_env_bridge *x, const rf_env_call *calls, int n, rf_env_reply *out);

/* The stats since the last take (zeroed by the take). */
rf_env_stats rf_env_bridge_take_stats(rf_env_bridge *x);

/* The endpoint bound (the port filled in); owned by x. Programs connected now. */
const char *rf_env_bridge_endpoint(const rf_env_bridge *x);
int rf_env_bridge_programs(const rf_env_bridge *x);

/* Sends Shutdown to every program (those whose Hello is waiting included) and closes. NULL
 * fine. The reason is RF_MSG_SHUTDOWN_DONE unless rf_env_bridge_set_end gave another. */
void rf_env_bridge_close(rf_env_bridge *x);

/* The reason the Shutdown at close gives (copied): RF_MSG_SHUTDOWN_DONE,
 * RF_MSG_SHUTDOWN_INTERRUPTED, or "the run stopped on an error: ..." (common/msg.h). */
void rf_env_bridge_set_end(rf_env_bridge *x, const char *reason);

/* The bridge as an rf_env (x owned by e afterwards: rf_env_close closes it). */
void rf_env_bridge_as_env(rf_env_bridge *x, rf_env *e);

#endif
