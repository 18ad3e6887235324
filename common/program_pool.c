/* The programs connected to a bridge's message server (common/program_pool.h). */
#define _POSIX_C_SOURCE 200809L
#include "common/program_pool.h"

#include <stdio.h>
#include <stdlib.h>

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
