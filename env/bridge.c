/* The rlflow side of environment programs (env/bridge.h, docs/env-api.md). The scheduling,
 * fault and rejection rules are reward/external.c's (their shared part: common/program_pool.c), for
 * EnvReset / EnvStep requests. */
#define _POSIX_C_SOURCE 200809L
#include "env/bridge.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/curve.h"
#include "common/log.h"
#include "common/msg.h"
#include "common/program_pool.h"
#include "common/util.h"

struct rf_env_bridge {
    rf_msg_server *srv;
    double timeout_s;
    int max_attempts;
    rf_program_pool pool; /* the connected programs, the failed calls' ids */
    uint64_t next_id;
    char last_lost[1024];
    char **obs, **info, **from; /* (n_out) the last call's reply strings, who answered each */
    rf_status (*tick)(void *ctx);
    void *tick_ctx;
    int (*stop)(void);    /* rf_env_bridge_config.stop */
    char end[1024];       /* the Shutdown reason at close */
    int n_out;
    rf_env_stats stats;
};

/* One batch call. Request ids are base + k * n + i for the k-th send of call i. */
typedef struct batch {
    const rf_env_call *calls;
    rf_env_reply *out;
    rf_program_calls c; /* ids, states, owners, sends, rejections */
} batch;

static int nonempty(const char *s) { return s && *s; }

rf_status rf_env_bridge_listen(rf_env_bridge **out, const rf_env_bridge_config *c) {
    *out = NULL;
    if (!c || !nonempty(c->endpoint))
        return rf_error(RF_ERR_ARG, "env.endpoint: an endpoint is needed (e.g. \"tcp://127.0.0.1:5558\")");
    if (!(c->timeout_s > 0) || !isfinite(c->timeout_s))
        return rf_error(RF_ERR_ARG, "env.timeout must be > 0 s (got %g)", c->timeout_s);
    if (c->max_attempts < 0)
        return rf_error(RF_ERR_ARG, "env: max_attempts must be >= 0 (got %d)", c->max_attempts);
    rf_curve_key secret = "", *clients = NULL;
    int n_clients = 0;
    rf_program_security sec = {"env", "env.endpoint", "env.curve_secret", "env.curve_clients",
                               "env.insecure", "observations and rewards", "rlflow keygen",
                               "tcp://127.0.0.1:5558", "", c->endpoint, c->curve_secret_file,
                               c->curve_clients_file, c->insecure};
    rf_program_direct_keys d = {c->curve_secret_key, c->curve_client_keys, c->n_curve_client_keys};
    RF_TRY(rf_program_pool_keys(&sec, &d, secret, &clients, &n_clients));
    const char **allowed = rf_calloc((size_t)n_clients + 1, sizeof *allowed);
    rf_env_bridge *x = allowed ? rf_calloc(1, sizeof *x) : NULL;
    rf_status st = x ? RF_OK : RF_ERR_NOMEM;
    for (int i = 0; x && i < n_clients; i++) allowed[i] = clients[i];
    rf_msg_server_config cfg = {.accept_role = RLFLOW__ROLE__ROLE_ENVIRONMENT, .peer_timeout_s = c->timeout_s,
                                .curve_secret_key = clients ? secret : NULL, .curve_clients = allowed,
                                .n_curve_clients = n_clients, .max_msg_bytes = RF_MSG_EXTERNAL_MAX_BYTES,
                                .check_utf8 = 1};
    if (x) x->timeout_s = c->timeout_s, x->next_id = 1, x->pool.label = "env";
    if (x) x->max_attempts = c->max_attempts ? c->max_attempts : RF_EXTERNAL_MAX_ATTEMPTS;
    if (x) x->tick = c->tick, x->tick_ctx = c->tick_ctx, x->stop = c->stop;
    if (x) snprintf(x->end, sizeof x->end, "%s", RF_MSG_SHUTDOWN_DONE);
    if (st == RF_OK) st = rf_msg_server_open(&x->srv, c->endpoint, &cfg);
    memset(secret, 0, sizeof secret);
    free(clients), free(allowed);
    if (st != RF_OK) {
        free(x);
        return rf_error_wrap(st, "env.endpoint");
    }
    *out = x;
    return RF_OK;
}

rf_status rf_env_bridge_wait(rf_env_bridge *x, int n, double timeout_s) {
    double deadline = rf_time_now() + timeout_s;
    const char *ep = rf_msg_server_endpoint(x->srv);
    while (x->pool.n < n) {
        double left = deadline - rf_time_now();
        if (left <= 0) {
            if (x->pool.n == 0 && x->pool.last_refused[0])
                return rf_error(RF_ERR_IO, "no environment program connected to %s within %.1f s; the "
                                "last connection was refused: %s", ep, timeout_s, x->pool.last_refused);
            return rf_error(RF_ERR_IO, "%d of %d environment programs connected to %s within %.1f s "
                            "(start one, e.g. python3 examples/env/calculator_env.py --connect %s)",
                            x->pool.n, n, ep, timeout_s, ep);
        }
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(x->srv, fmin(left, 0.25), &ev));
        RF_TRY(rf_program_pool_wait_event(&x->pool, &ev));
        if (x->tick) RF_TRY(x->tick(x->tick_ctx));
    }
    return RF_OK;
}

const char *rf_env_bridge_endpoint(const rf_env_bridge *x) { return rf_msg_server_endpoint(x->srv); }

int rf_env_bridge_programs(const rf_env_bridge *x) { return x->pool.n; }

rf_env_stats rf_env_bridge_take_stats(rf_env_bridge *x) {
    rf_env_stats s = x->stats;
    x->stats = (rf_env_stats){0};
    return s;
}

static void free_out(rf_env_bridge *x) {
    for (int i = 0; i < x->n_out; i++) free(x->obs[i]), free(x->info[i]), free(x->from[i]);
    free(x->obs), free(x->info), free(x->from);
    x->obs = x->info = x->from = NULL, x->n_out = 0;
}

void rf_env_bridge_close(rf_env_bridge *x) {
    if (!x) return;
    rf_msg_server_close(x->srv, x->end);
    free_out(x);
    rf_program_pool_free(&x->pool);
    free(x);
}

void rf_env_bridge_set_end(rf_env_bridge *x, const char *reason) {
    if (x) snprintf(x->end, sizeof x->end, "%s", reason ? reason : RF_MSG_SHUTDOWN_DONE);
}

/* ---- one call ------------------------------------------------------------------------------ */

static uint64_t req_id(const batch *b, int i) {
    return rf_program_calls_id(&b->c, i);
}

/* "request 7 (reset of episode 3, sample 1 of group 0)" */
static void describe(const batch *b, int i, uint64_t id, char *s, size_t cap) {
    const rf_env_call *c = &b->calls[i];
    char what[48];
    if (c->is_step) snprintf(what, sizeof what, "turn %d", c->turn);
    else snprintf(what, sizeof what, "reset");
    snprintf(s, cap, "request %" PRIu64 " (%s of episode %" PRIu64 ", sample %" PRId64 " of group %" PRId64 ")",
             id, what, c->episode, c->ex->index, c->ex->group);
}

static char *str(const char *s) { return (char *)(s ? s : ""); }

static void fill_reset(const rf_env_call *c, uint64_t id, Rlflow__EnvReset *q) {
    const rf_reward_item *ex = c->ex;
    q->request_id = id, q->episode_id = c->episode;
    q->prompt = str(ex->prompt);
    q->n_prompt_ids = ex->prompt_ids && ex->n_prompt_ids > 0 ? (size_t)ex->n_prompt_ids : 0;
    q->prompt_ids = (int32_t *)ex->prompt_ids;
    q->ground_truth = str(ex->truth), q->metadata_json = str(ex->metadata_json);
    q->sample_index = ex->index, q->group_id = ex->group;
}

/* Sends step c as EnvStep (its history built on the stack of the call). */
static rf_status send_step(rf_env_bridge *x, int peer, const rf_env_call *c, uint64_t id) {
    Rlflow__EnvStep q = RLFLOW__ENV_STEP__INIT;
    Rlflow__EnvReset r = RLFLOW__ENV_RESET__INIT;
    fill_reset(c, 0, &r);
    q.request_id = id, q.episode_id = c->episode, q.turn = c->turn;
    q.action = str(c->action), q.finish = str(c->finish), q.last = c->last != 0;
    q.n_action_ids = c->action_ids && c->n_action_ids > 0 ? (size_t)c->n_action_ids : 0;
    q.action_ids = (int32_t *)c->action_ids;
    q.reset = &r, q.first_observation = str(c->first_observation);
    size_t nh = c->n_history > 0 ? (size_t)c->n_history : 0;
    Rlflow__EnvTurn *t = calloc(nh + 1, sizeof *t);
    Rlflow__EnvTurn **tp = calloc(nh + 1, sizeof *tp);
    if (!t || !tp) {
        free(t), free(tp);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    for (size_t k = 0; k < nh; k++) {
        const rf_env_turn *h = &c->history[k];
        rlflow__env_turn__init(&t[k]);
        t[k].action = str(h->action), t[k].observation = str(h->observation), t[k].reward = h->reward;
        t[k].n_action_ids = h->action_ids && h->n_action_ids > 0 ? (size_t)h->n_action_ids : 0;
        t[k].action_ids = (int32_t *)h->action_ids;
        tp[k] = &t[k];
    }
    q.n_history = nh, q.history = tp;
    rf_status st = rf_msg_server_send(x->srv, peer, RF_MSG_ENV_STEP, &q.base);
    free(t), free(tp);
    return st;
}

static rf_status send_item(rf_env_bridge *x, batch *b, int i, rf_program *p) {
    const rf_env_call *c = &b->calls[i];
    if (b->c.sends[i]++ > 0) x->stats.resent++;
    uint64_t id = req_id(b, i);
    rf_status st;
    if (c->is_step) {
        st = send_step(x, p->id, c, id);
    } else {
        Rlflow__EnvReset q = RLFLOW__ENV_RESET__INIT;
        fill_reset(c, id, &q);
        st = rf_msg_server_send(x->srv, p->id, RF_MSG_ENV_RESET, &q.base);
    }
    if (st == RF_ERR_NOMEM) return st;
    if (st != RF_OK) return RF_ERR_IO; /* the next poll reports the program lost */
    if (p->inflight++ == 0) p->last_progress = rf_time_now();
    b->c.state[i] = RF_CALL_IN_FLIGHT, b->c.owner[i] = p->id;
    return RF_OK;
}

/* The call's error once a stop was asked for and request i would be sent again (or waits for a
 * program); RF_OK otherwise. */
static rf_status stopped(rf_env_bridge *x, batch *b, int i) {
    int sig = x->stop ? x->stop() : 0;
    if (!sig) return RF_OK;
    char req[200];
    describe(b, i, req_id(b, i), req, sizeof req);
    return rf_error(RF_ERR_IO, "env: interrupted (signal %d): %s is not sent%s%s%s", sig, req,
                    b->c.sends[i] > 0 ? " again" : "", x->last_lost[0] ? "; " : "", x->last_lost);
}

static rf_status assign(rf_env_bridge *x, batch *b) {
    for (int i = b->c.cursor; i < b->c.n; i++) {
        if (b->c.state[i] != RF_CALL_PENDING) {
            if (i == b->c.cursor) b->c.cursor++;
            continue;
        }
        if (b->c.sends[i] > 0) RF_TRY(stopped(x, b, i));
        rf_program *p = rf_program_pool_pick(&x->pool, x->srv);
        if (!p) return RF_OK;
        rf_status st = send_item(x, b, i, p);
        if (st == RF_ERR_NOMEM) return st;
        if (st != RF_OK) return RF_OK;
        if (i == b->c.cursor) b->c.cursor++;
    }
    return RF_OK;
}

static rf_status count_rejection(rf_env_bridge *x, batch *b, int i, rf_status code, const char *why);

/* Counts why against every request program id holds (each named in its reason). */
static rf_status reject_held(rf_env_bridge *x, batch *b, int id, rf_status code, const char *why) {
    rf_status st = RF_OK;
    for (int k = 0; st == RF_OK && k < b->c.n; k++) {
        if (b->c.state[k] != RF_CALL_IN_FLIGHT || b->c.owner[k] != id) continue;
        char held[1100];
        snprintf(held, sizeof held, "%s (it held request %" PRIu64 ")", why, req_id(b, k));
        st = count_rejection(x, b, k, code, held);
    }
    return st;
}

/* A program is gone: its requests return to the pending pool. One dropped for its deadline or
 * for silence (timed_out) is a rejection of each request it held: a request that no program
 * answers fails the call after max_attempts, naming it. */
static rf_status lose(rf_env_bridge *x, batch *b, int id, const char *why, int timed_out) {
    rf_status st = timed_out ? reject_held(x, b, id, RF_ERR_IO, why) : RF_OK;
    int first, count = rf_program_calls_release(&b->c, &x->pool, id, &first);
    x->stats.lost++;
    char req[200] = "";
    if (first >= 0) describe(b, first, req_id(b, first), req, sizeof req);
    if (first < 0) snprintf(x->last_lost, sizeof x->last_lost, "%s", why);
    else snprintf(x->last_lost, sizeof x->last_lost, "%s while answering %s%s", why, req,
                  count > 1 ? " (and more)" : "");
    rf_log_warn("env: %s%s", x->last_lost,
                count && x->pool.n ? "; re-sending its requests to the other programs" : "");
    return st;
}

/* Adds a rejection to call i; the call's error once it reached max_attempts. */
static rf_status count_rejection(rf_env_bridge *x, batch *b, int i, rf_status code, const char *why) {
    int limit;
    RF_TRY(rf_program_calls_reject(&b->c, i, why, x->max_attempts, &limit));
    if (!limit) return RF_OK;
    const char *s = b->c.why[i];
    char req[200];
    describe(b, i, req_id(b, i), req, sizeof req);
    return rf_error(code, "env: %s was rejected %d time%s, the limit (max_attempts): %s", req, b->c.rejects[i],
                    b->c.rejects[i] == 1 ? "" : "s", s);
}

static rf_status reject(rf_env_bridge *x, batch *b, int peer, int i, rf_status code, const char *why) {
    rf_log_warn("env: rejected a reply: %s", why);
    x->stats.rejected++;
    rf_msg_server_drop(x->srv, peer, code, why, i >= 0 ? req_id(b, i) : 0);
    rf_status st = i >= 0 ? count_rejection(x, b, i, code, why) : reject_held(x, b, peer, code, why);
    snprintf(x->last_lost, sizeof x->last_lost, "%s", why);
    int first;
    rf_program_calls_release(&b->c, &x->pool, peer, &first);
    return st;
}

/* The call whose request `id` the program holds; -1 otherwise (*why says what is wrong, or
 * *stale is set for a late answer to a failed call). */
static int match_reply(const rf_env_bridge *x, const batch *b, const rf_msg_event *ev, uint64_t id, char *why,
                       size_t cap, int *stale) {
    int done, i = rf_program_calls_match(&b->c, &x->pool, ev->peer, id, &done, stale);
    if (i >= 0 || *stale) return i;
    if (done) {
        char req[200];
        describe(b, (int)((id - b->c.base) % (uint64_t)b->c.n), id, req, sizeof req);
        snprintf(why, cap, "%s answered %s a second time", ev->info.desc, req);
        return -1;
    }
    snprintf(why, cap, "%s answered request %" PRIu64 ", which is not one it holds", ev->info.desc, id);
    return -1;
}

/* The longest observation accepted, in bytes: an episode's text must fit its token budget. */
#define RF_ENV_MAX_OBSERVATION (1 << 20)

static rf_status check_reply(const batch *b, int i, const Rlflow__EnvReply *r, const char *who, char *why,
                             size_t cap) {
    char req[200];
    describe(b, i, r->request_id, req, sizeof req);
    if (r->error && *r->error) {
        snprintf(why, cap, "%s could not answer %s: %s", who, req, r->error);
        return RF_ERR_FORMAT;
    }
    if (!isfinite(r->reward)) {
        snprintf(why, cap, "%s answered reward %g for %s; rewards must be finite", who, (double)r->reward, req);
        return RF_ERR_RANGE;
    }
    if (!b->calls[i].is_step && (r->reward != 0.0f || r->done)) {
        snprintf(why, cap, "%s answered %s with %s; a reset answers an observation only", who, req,
                 r->done ? "done = true" : "a reward");
        return RF_ERR_FORMAT;
    }
    size_t ol = r->observation ? strlen(r->observation) : 0;
    if (ol > RF_ENV_MAX_OBSERVATION) {
        snprintf(why, cap, "%s answered %s with an observation of %zu bytes (at most %d)", who, req, ol,
                 RF_ENV_MAX_OBSERVATION);
        return RF_ERR_FORMAT;
    }
    return RF_OK;
}

static rf_status accept_reply(rf_env_bridge *x, batch *b, int i, const Rlflow__EnvReply *r, rf_program *p,
                              const char *who) {
    free(x->obs[i]), free(x->info[i]), free(x->from[i]);
    x->obs[i] = rf_strdup(r->observation ? r->observation : "");
    x->info[i] = rf_strdup(r->info ? r->info : "");
    x->from[i] = rf_strdup(who);
    if (!x->obs[i] || !x->info[i] || !x->from[i]) return rf_error(RF_ERR_NOMEM, "out of memory");
    b->out[i] = (rf_env_reply){x->obs[i], r->reward, r->done != 0, x->info[i], x->from[i]};
    b->c.state[i] = RF_CALL_DONE, b->c.done++;
    x->stats.accepted++;
    if (p) p->inflight--;
    return RF_OK;
}

static rf_status on_reply(rf_env_bridge *x, batch *b, const rf_msg_event *ev) {
    const Rlflow__EnvReply *r = (const Rlflow__EnvReply *)ev->msg.pb;
    rf_program *p = rf_program_pool_find(&x->pool, ev->peer);
    if (p) p->last_progress = rf_time_now();
    char why[1024];
    int stale, i = match_reply(x, b, ev, r->request_id, why, sizeof why, &stale);
    if (stale) return RF_OK;
    if (i < 0) return reject(x, b, ev->peer, -1, RF_ERR_FORMAT, why);
    rf_status code = check_reply(b, i, r, ev->info.desc, why, sizeof why);
    if (code != RF_OK) return reject(x, b, ev->peer, i, code, why);
    return accept_reply(x, b, i, r, p, ev->info.desc);
}

/* A frame that does not decode: counted against the request it names when it unpacked and
 * names one the program holds (a string not UTF-8, a wrong wire type), else against every
 * request the program held. */
static rf_status on_malformed(rf_env_bridge *x, batch *b, const rf_msg_event *ev) {
    char unused[1024], why[1400], req[200];
    int stale = 0, i = ev->request_id ? match_reply(x, b, ev, ev->request_id, unused, sizeof unused, &stale) : -1;
    if (i < 0) return reject(x, b, ev->peer, -1, RF_ERR_FORMAT, ev->text);
    describe(b, i, ev->request_id, req, sizeof req);
    snprintf(why, sizeof why, "%s (its reply to %s)", ev->text, req);
    return reject(x, b, ev->peer, i, RF_ERR_FORMAT, why);
}

static rf_status on_program_error(rf_env_bridge *x, batch *b, const rf_msg_event *ev) {
    const Rlflow__Error *e = (const Rlflow__Error *)ev->msg.pb;
    char why[1024], unused[1024];
    int stale = 0, i = e->request_id ? match_reply(x, b, ev, e->request_id, unused, sizeof unused, &stale) : -1;
    snprintf(why, sizeof why, "%s reported an error: %s", ev->info.desc, e->message ? e->message : "");
    return reject(x, b, ev->peer, i, RF_ERR_FORMAT, why);
}

static rf_status on_event(rf_env_bridge *x, batch *b, rf_msg_event *ev) {
    rf_status st = RF_OK;
    char why[1024];
    switch (ev->kind) {
    case RF_MSG_EV_JOINED: return rf_program_pool_add(&x->pool, ev);
    case RF_MSG_EV_REFUSED:
        if (ev->auth) rf_program_pool_refused(&x->pool, ev);
        else rf_log_warn("env: %s", ev->text);
        return RF_OK;
    case RF_MSG_EV_LOST: return lose(x, b, ev->peer, ev->text, ev->silent);
    case RF_MSG_EV_MALFORMED: return on_malformed(x, b, ev);
    case RF_MSG_EV_MESSAGE:
        if (ev->msg.type == RF_MSG_ENV_REPLY) {
            st = on_reply(x, b, ev);
        } else if (ev->msg.type == RF_MSG_ERROR) {
            st = on_program_error(x, b, ev);
        } else {
            snprintf(why, sizeof why, "%s sent a %s, which an environment program may not send", ev->info.desc,
                     rf_msg_type_name(ev->msg.type));
            st = reject(x, b, ev->peer, -1, RF_ERR_FORMAT, why);
        }
        rf_msg_free(&ev->msg);
        return st;
    default: return RF_OK;
    }
}

/* Programs holding requests without answering any for timeout_s (the per-call deadline) are
 * dropped, even when they still answer pings. */
static rf_status check_progress(rf_env_bridge *x, batch *b, double now) {
    char why[800];
    for (int id; (id = rf_program_pool_stuck(&x->pool, x->srv, x->timeout_s, now, "an environment program",
                                             " (env.timeout)", why, sizeof why)) >= 0;)
        RF_TRY(lose(x, b, id, why, 1));
    return RF_OK;
}

static rf_status run_batch(rf_env_bridge *x, batch *b) {
    double no_prog_since = x->pool.n ? -1 : rf_time_now();
    while (b->c.done < b->c.n) {
        RF_TRY(assign(x, b));
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(x->srv, fmin(0.25, x->timeout_s), &ev));
        RF_TRY(on_event(x, b, &ev));
        if (x->tick) RF_TRY(x->tick(x->tick_ctx));
        double now = rf_time_now();
        RF_TRY(check_progress(x, b, now));
        for (int i = b->c.cursor; !x->pool.n && i < b->c.n; i++) /* no program to wait for once stopping */
            if (b->c.state[i] == RF_CALL_PENDING) {
                RF_TRY(stopped(x, b, i));
                break;
            }
        if (x->pool.n) {
            no_prog_since = -1;
        } else if (no_prog_since < 0) {
            no_prog_since = now;
        } else if (now - no_prog_since > x->timeout_s) {
            const char *ep = rf_msg_server_endpoint(x->srv);
            if (!x->last_lost[0])
                return rf_error(RF_ERR_IO, "env: no environment program connected to %s within %.1f s (%d of %d "
                                "requests unanswered)", ep, x->timeout_s, b->c.n - b->c.done, b->c.n);
            return rf_error(RF_ERR_IO, "env: %s; no other environment program connected to %s within %.1f s "
                            "(%d of %d requests unanswered)", x->last_lost, ep, x->timeout_s, b->c.n - b->c.done, b->c.n);
        }
    }
    return RF_OK;
}

rf_status rf_env_bridge_call(rf_env_bridge *x, const rf_env_call *calls, int n, rf_env_reply *out) {
    if (n < 0 || (n > 0 && (!calls || !out))) return rf_error(RF_ERR_ARG, "rf_env_bridge_call: bad batch (n = %d)", n);
    for (int i = 0; i < n; i++)
        if (!calls[i].ex) return rf_error(RF_ERR_ARG, "rf_env_bridge_call: call %d has no example", i);
    if (n == 0) return RF_OK;
    free_out(x);
    batch b = {.calls = calls, .out = out};
    int room = rf_program_calls_init(&b.c, n, x->next_id);
    x->obs = calloc((size_t)n, sizeof(char *)), x->info = calloc((size_t)n, sizeof(char *));
    x->from = calloc((size_t)n, sizeof(char *));
    rf_status st = RF_OK;
    if (!room || !x->obs || !x->info || !x->from)
        st = rf_error(RF_ERR_NOMEM, "out of memory for %d environment requests", n);
    else x->n_out = n;
    double now = rf_time_now();
    rf_program_pool_start_call(&x->pool, now);
    x->last_lost[0] = '\0';
    if (st == RF_OK) st = run_batch(x, &b);
    x->next_id = rf_program_calls_end(&b.c);
    if (st != RF_OK) {
        rf_program_pool_fail(&x->pool, b.c.base, x->next_id);
    }
    rf_program_calls_free(&b.c);
    return st;
}

/* ---- as an rf_env ------------------------------------------------------------------------ */

static rf_status env_call(void *ctx, const rf_env_call *calls, int n, rf_env_reply *out) {
    return rf_env_bridge_call(ctx, calls, n, out);
}

static rf_env_stats env_stats(void *ctx) { return rf_env_bridge_take_stats(ctx); }

static void env_close(void *ctx) { rf_env_bridge_close(ctx); }

static void env_set_end(void *ctx, const char *reason) { rf_env_bridge_set_end(ctx, reason); }

void rf_env_bridge_as_env(rf_env_bridge *x, rf_env *e) {
    *e = (rf_env){x, env_call, env_stats, env_close, env_set_end};
}
