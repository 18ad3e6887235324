/* The programs connected to a bridge's message server (reward/external.c, env/bridge.c): the
 * table the scheduler picks from, the ids of failed calls whose late answers are ignored, the
 * last CURVE refusal, and the endpoint's security policy, named by each bridge's recipe keys. */
#ifndef RF_PROGRAM_POOL_H
#define RF_PROGRAM_POOL_H

#include <stdint.h>

#include "common/curve.h"
#include "common/msg.h"
#include "common/status.h"

/* A connected program as the scheduler sees it. */
typedef struct rf_program {
    int id;               /* rf_msg_server peer id */
    int inflight;         /* requests of this call it holds */
    double last_progress; /* when it last answered, or took work while idle */
} rf_program;

typedef struct rf_program_pool {
    const char *label;      /* log prefix: "reward", "env" */
    rf_program *progs;      /* (n) */
    int n, cap;
    char last_refused[800]; /* the last CURVE refusal, for a "nobody came" error */
    struct { uint64_t lo, hi; } failed[8]; /* request ids [lo, hi) of the last failed calls,
                                              whose late answers are ignored */
    int next_failed;
} rf_program_pool;

/* The recipe keys and words of one bridge, for its security errors and warnings. */
typedef struct rf_program_security {
    const char *label;        /* log prefix: "reward" */
    const char *endpoint_key; /* "reward.external" */
    const char *secret_key;   /* "reward.external_curve_secret" */
    const char *clients_key;  /* "reward.external_curve_clients" */
    const char *insecure_key; /* "reward.external_insecure" */
    const char *sends;        /* what a program sends that trains the policy: "rewards" */
    const char *keygen;       /* where keys come from: "rlflow keygen" */
    const char *loopback;     /* an example loopback endpoint */
    const char *warn_tail;    /* appended to the insecure warning ("" for none) */
    const char *endpoint;     /* the configured endpoint */
    const char *secret_file, *clients_file; /* the key files (NULL or "": no CURVE) */
    int insecure;
} rf_program_security;

/* The program with peer id `id`, NULL when it is not connected. */
rf_program *rf_program_pool_find(rf_program_pool *p, int id);

/* Adds the program that joined in ev (logged with its capacity). */
rf_status rf_program_pool_add(rf_program_pool *p, const rf_msg_event *ev);

/* Forgets program `id` (nothing when it is not in the table). */
void rf_program_pool_remove(rf_program_pool *p, int id);

/* The least-loaded program with room (in flight / capacity), NULL when all are full. Ties go to
 * the program that connected first. */
rf_program *rf_program_pool_pick(rf_program_pool *p, rf_msg_server *srv);

/* A new call starts: no program holds a request, and every one made progress now. */
void rf_program_pool_start_call(rf_program_pool *p, double now);

/* A connection CURVE refused: logged (it names the endpoint, address and key), remembered. */
void rf_program_pool_refused(rf_program_pool *p, const rf_msg_event *ev);

/* Remembers the request ids [lo, hi) of a failed call: answers to them are ignored. */
void rf_program_pool_fail(rf_program_pool *p, uint64_t lo, uint64_t hi);

/* Whether id belongs to a call that failed (its answers may still come, and are ignored). */
int rf_program_pool_failed(const rf_program_pool *p, uint64_t id);

/* One event while waiting for programs to connect: a join added, a CURVE refusal remembered, a
 * loss logged and forgotten, a late message freed; an error for a refusal that is not CURVE's. */
rf_status rf_program_pool_wait_event(rf_program_pool *p, rf_msg_event *ev);

/* A program holding requests without answering any for timeout_s (it may answer pings from a
 * thread while its work is stuck): dropped from the server with *why ("<desc> answered no request
 * for 12.3 s<tail>", desc `nobody` when unknown) and its id returned; -1 when none is. A program
 * silent for over timeout_s / 2 is left to the server to report. */
int rf_program_pool_stuck(rf_program_pool *p, rf_msg_server *srv, double timeout_s, double now,
                          const char *nobody, const char *tail, char *why, size_t cap);

/* Frees the table. */
void rf_program_pool_free(rf_program_pool *p);

/* The endpoint's security from key files: a refusal for an open endpoint without CURVE (unless
 * insecure), else the CURVE keys, loaded into secret and *clients (n; NULL without CURVE). */
rf_status rf_program_pool_security(const rf_program_security *s, rf_curve_key secret,
                                   rf_curve_key **clients, int *n);

/* The keys of the programs rlflow starts itself (controller/programs.h), given directly. */
typedef struct rf_program_direct_keys {
    const char *secret;                /* rlflow's Z85 secret key made for the run; NULL: none */
    const char *const *clients;        /* (n_clients) Z85 public keys allowed besides the file's */
    int n_clients;
} rf_program_direct_keys;

/* rf_program_pool_security with the keys of d too: keys given directly alone (no key files: the
 * run's own server key and its programs' keys), or the file's client keys plus d's. */
rf_status rf_program_pool_keys(const rf_program_security *s, const rf_program_direct_keys *d, rf_curve_key secret,
                               rf_curve_key **clients, int *n);

/* The bookkeeping of one call sent to the pool: request ids are base + k * n + i for the k-th
 * send of item i, so an answer maps back to its item in O(1) and ids never repeat across calls. */
typedef struct rf_program_calls {
    int n;
    uint64_t base;
    int *state;   /* (n) RF_CALL_PENDING, RF_CALL_IN_FLIGHT, RF_CALL_DONE */
    int *owner;   /* (n) peer id while in flight */
    int *sends;   /* (n) sends so far */
    int *rejects; /* (n) replies rejected so far */
    char **why;   /* (n) their reasons, "1) ...; 2) ...", NULL while none */
    int done, cursor;
} rf_program_calls;

enum { RF_CALL_PENDING, RF_CALL_IN_FLIGHT, RF_CALL_DONE };

/* Room for n items whose ids start at base: 1, or 0 when out of memory (free it either way). */
int rf_program_calls_init(rf_program_calls *c, int n, uint64_t base);

/* Frees the arrays. */
void rf_program_calls_free(rf_program_calls *c);

/* The request id of item i's last send. */
uint64_t rf_program_calls_id(const rf_program_calls *c, int i);

/* The first id past every id this call used: where the next call's ids start. */
uint64_t rf_program_calls_end(const rf_program_calls *c);

/* Returns the items program `id` holds to the pending pool and forgets the program. Returns how
 * many it held; *first is the first of them (-1: none). */
int rf_program_calls_release(rf_program_calls *c, rf_program_pool *p, int id, int *first);

/* Adds rejection `why` to item i's history ("1) ...; 2) ..."); *limit is set once the item has
 * been rejected max_attempts times. */
rf_status rf_program_calls_reject(rf_program_calls *c, int i, const char *why, int max_attempts,
                                  int *limit);

/* The item whose request `id` program `peer` holds in flight; else -1, with *done set when it
 * answered that item already, or *stale for a late answer to a failed call. */
int rf_program_calls_match(const rf_program_calls *c, const rf_program_pool *p, int peer,
                           uint64_t id, int *done, int *stale);

#endif
