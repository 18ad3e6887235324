/* The programs connected to a bridge's message server (common/program_pool.h). */
#define _POSIX_C_SOURCE 200809L
#include "common/program_pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

rf_program *rf_program_pool_find(rf_program_pool *p, int id) {
    for (int i = 0; i < p->n; i++)
        if (p->progs[i].id == id) return &p->progs[i];
    return NULL;
}

rf_status rf_program_pool_add(rf_program_pool *p, const rf_msg_event *ev) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 4;
        rf_program *np = realloc(p->progs, sizeof *np * (size_t)cap);
        if (!np) return rf_error(RF_ERR_NOMEM, "out of memory");
        p->progs = np, p->cap = cap;
    }
    p->progs[p->n++] = (rf_program){ev->peer, 0, rf_time_now()};
    rf_log_info("%s: %s connected (capacity %d)", p->label, ev->info.desc, ev->info.capacity);
    return RF_OK;
}

void rf_program_pool_remove(rf_program_pool *p, int id) {
    rf_program *q = rf_program_pool_find(p, id);
    if (q) *q = p->progs[--p->n];
}

rf_program *rf_program_pool_pick(rf_program_pool *p, rf_msg_server *srv) {
    rf_program *best = NULL;
    double best_load = 0;
    for (int i = 0; i < p->n; i++) {
        const rf_msg_peer_info *pi = rf_msg_server_peer(srv, p->progs[i].id);
        if (!pi || p->progs[i].inflight >= pi->capacity) continue;
        double load = (double)p->progs[i].inflight / pi->capacity;
        if (!best || load < best_load) best = &p->progs[i], best_load = load;
    }
    return best;
}

void rf_program_pool_start_call(rf_program_pool *p, double now) {
    for (int i = 0; i < p->n; i++) p->progs[i].inflight = 0, p->progs[i].last_progress = now;
}

void rf_program_pool_refused(rf_program_pool *p, const rf_msg_event *ev) {
    rf_log_warn("%s: %s", p->label, ev->text);
    snprintf(p->last_refused, sizeof p->last_refused, "%s", ev->text);
}

void rf_program_pool_fail(rf_program_pool *p, uint64_t lo, uint64_t hi) {
    p->failed[p->next_failed].lo = lo, p->failed[p->next_failed].hi = hi;
    p->next_failed = (p->next_failed + 1) % (int)(sizeof p->failed / sizeof p->failed[0]);
}

int rf_program_pool_failed(const rf_program_pool *p, uint64_t id) {
    for (size_t k = 0; k < sizeof p->failed / sizeof p->failed[0]; k++)
        if (id >= p->failed[k].lo && id < p->failed[k].hi) return 1;
    return 0;
}

rf_status rf_program_pool_wait_event(rf_program_pool *p, rf_msg_event *ev) {
    if (ev->kind == RF_MSG_EV_JOINED) RF_TRY(rf_program_pool_add(p, ev));
    else if (ev->kind == RF_MSG_EV_REFUSED && ev->auth) rf_program_pool_refused(p, ev);
    else if (ev->kind == RF_MSG_EV_REFUSED) return rf_error(RF_ERR_UNSUPPORTED, "%s", ev->text);
    else if (ev->kind == RF_MSG_EV_LOST) rf_program_pool_remove(p, ev->peer), rf_log_warn("%s: %s", p->label, ev->text);
    else if (ev->kind == RF_MSG_EV_MESSAGE) rf_msg_free(&ev->msg); /* stale answers */
    return RF_OK;
}

int rf_program_pool_stuck(rf_program_pool *p, rf_msg_server *srv, double timeout_s, double now,
                          const char *nobody, const char *tail, char *why, size_t cap) {
    for (int i = 0; i < p->n; i++) {
        rf_program *q = &p->progs[i];
        if (q->inflight == 0 || now - q->last_progress <= timeout_s) continue;
        if (rf_msg_server_silence(srv, q->id) > timeout_s / 2) continue; /* the server's to report */
        const rf_msg_peer_info *pi = rf_msg_server_peer(srv, q->id);
        snprintf(why, cap, "%s answered no request for %.1f s%s", pi ? pi->desc : nobody,
                 now - q->last_progress, tail);
        rf_msg_server_drop(srv, q->id, RF_ERR_IO, why, 0);
        return q->id;
    }
    return -1;
}

void rf_program_pool_free(rf_program_pool *p) {
    free(p->progs);
    p->progs = NULL, p->n = p->cap = 0;
}

static int nonempty(const char *s) { return s && *s; }

rf_status rf_program_pool_security(const rf_program_security *s, rf_curve_key secret,
                                   rf_curve_key **clients, int *n) {
    *clients = NULL, *n = 0;
    int curve = nonempty(s->secret_file);
    if (curve != nonempty(s->clients_file))
        return rf_error(RF_ERR_ARG, "%s is set but %s is not: CURVE needs both (rlflow's secret key "
                        "and the public keys of the programs it allows)",
                        curve ? s->secret_key : s->clients_key, curve ? s->clients_key : s->secret_key);
    if (!curve) {
        if (rf_curve_endpoint_is_local(s->endpoint)) return RF_OK;
        if (!s->insecure)
            return rf_error(RF_ERR_ARG, "%s = \"%s\" can be reached from other machines, and without "
                            "CURVE anyone who reaches it can send the %s that train the policy: set "
                            "%s and %s (%s), bind a loopback address (%s), or set %s = true on a "
                            "network you trust", s->endpoint_key, s->endpoint, s->sends, s->secret_key,
                            s->clients_key, s->keygen, s->loopback, s->insecure_key);
        rf_log_warn("%s: %s can be reached from other machines without authentication (%s = true)%s",
                    s->label, s->endpoint, s->insecure_key, s->warn_tail);
        return RF_OK;
    }
    rf_status st = rf_curve_read_key(s->secret_file, 1, secret);
    if (st != RF_OK) return rf_error_wrap(st, "%s", s->secret_key);
    st = rf_curve_read_keys(s->clients_file, clients, n);
    if (st != RF_OK) return rf_error_wrap(st, "%s", s->clients_key);
    return RF_OK;
}

/* d's client keys appended to *clients (n). */
static rf_status add_client_keys(const rf_program_security *s, const rf_program_direct_keys *d, rf_curve_key **clients,
                                 int *n) {
    if (d->n_clients <= 0) return RF_OK;
    rf_curve_key *all = realloc(*clients, sizeof *all * (size_t)(*n + d->n_clients));
    if (!all) return rf_error(RF_ERR_NOMEM, "out of memory");
    *clients = all;
    char what[128];
    snprintf(what, sizeof what, "%s: a program's public key", s->endpoint_key);
    for (int i = 0; i < d->n_clients; i++) {
        RF_TRY(rf_curve_check(d->clients[i], what));
        memcpy(all[(*n)++], d->clients[i], sizeof all[0]);
    }
    return RF_OK;
}

rf_status rf_program_pool_keys(const rf_program_security *s, const rf_program_direct_keys *d, rf_curve_key secret,
                               rf_curve_key **clients, int *n) {
    *clients = NULL, *n = 0;
    if (!nonempty(s->secret_file) && nonempty(d->secret) && !nonempty(s->clients_file)) {
        if (d->n_clients <= 0)
            return rf_error(RF_ERR_ARG, "%s: a CURVE secret key needs the public keys of the programs it allows",
                            s->endpoint_key);
        char what[128];
        snprintf(what, sizeof what, "%s: rlflow's secret key", s->endpoint_key);
        RF_TRY(rf_curve_check(d->secret, what));
        memcpy(secret, d->secret, sizeof(rf_curve_key));
        return add_client_keys(s, d, clients, n);
    }
    RF_TRY(rf_program_pool_security(s, secret, clients, n));
    return nonempty(s->secret_file) ? add_client_keys(s, d, clients, n) : RF_OK;
}

int rf_program_calls_init(rf_program_calls *c, int n, uint64_t base) {
    *c = (rf_program_calls){.n = n, .base = base};
    c->state = calloc((size_t)n, sizeof(int));
    c->owner = calloc((size_t)n, sizeof(int));
    c->sends = calloc((size_t)n, sizeof(int));
    c->rejects = calloc((size_t)n, sizeof(int));
    c->why = calloc((size_t)n, sizeof(char *));
    return c->state && c->owner && c->sends && c->rejects && c->why;
}

void rf_program_calls_free(rf_program_calls *c) {
    for (int i = 0; c->why && i < c->n; i++) free(c->why[i]);
    free(c->state), free(c->owner), free(c->sends), free(c->rejects), free(c->why);
}

uint64_t rf_program_calls_id(const rf_program_calls *c, int i) {
    return c->base + (uint64_t)(c->sends[i] - 1) * (uint64_t)c->n + (uint64_t)i;
}

uint64_t rf_program_calls_end(const rf_program_calls *c) {
    int max_sends = 1;
    for (int i = 0; c->sends && i < c->n; i++)
        if (c->sends[i] > max_sends) max_sends = c->sends[i];
    return c->base + (uint64_t)max_sends * (uint64_t)c->n;
}

int rf_program_calls_release(rf_program_calls *c, rf_program_pool *p, int id, int *first) {
    int count = 0;
    *first = -1;
    for (int i = 0; i < c->n; i++)
        if (c->state[i] == RF_CALL_IN_FLIGHT && c->owner[i] == id) {
            if (*first < 0) *first = i;
            count++;
            c->state[i] = RF_CALL_PENDING;
            if (i < c->cursor) c->cursor = i;
        }
    rf_program_pool_remove(p, id);
    return count;
}

rf_status rf_program_calls_reject(rf_program_calls *c, int i, const char *why, int max_attempts,
                                  int *limit) {
    size_t ol = c->why[i] ? strlen(c->why[i]) : 0, add = strlen(why) + 32;
    char *s = realloc(c->why[i], ol + add);
    if (!s) return rf_error(RF_ERR_NOMEM, "out of memory");
    c->why[i] = s;
    snprintf(s + ol, add, "%s%d) %s", ol ? "; " : "", c->rejects[i] + 1, why);
    *limit = ++c->rejects[i] >= max_attempts;
    return RF_OK;
}

int rf_program_calls_match(const rf_program_calls *c, const rf_program_pool *p, int peer,
                           uint64_t id, int *done, int *stale) {
    *done = 0, *stale = id < c->base && rf_program_pool_failed(p, id);
    if (*stale || id < c->base) return -1;
    uint64_t off = id - c->base;
    int i = (int)(off % (uint64_t)c->n);
    if (off / (uint64_t)c->n < (uint64_t)c->sends[i] && rf_program_calls_id(c, i) == id &&
        c->owner[i] == peer) {
        if (c->state[i] == RF_CALL_IN_FLIGHT) return i;
        *done = c->state[i] == RF_CALL_DONE;
    }
    return -1;
}
