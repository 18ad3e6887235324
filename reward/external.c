/* The rlflow side of external reward programs (reward/external.h, docs/reward-api.md). */
#define _POSIX_C_SOURCE 200809L
#include "reward/external.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/curve.h"
#include "common/log.h"
#include "common/msg.h"
#include "common/util.h"

/* A connected program as the scheduler sees it. */
typedef struct prog {
    int id;               /* rf_msg_server peer id */
    int inflight;         /* requests of this batch it holds */
    double last_progress; /* when it last answered, or took work while idle */
} prog;

struct rf_external_reward {
    rf_msg_server *srv;
    double timeout_s;
    prog *progs;
    int n_progs, cap_progs;
    uint64_t next_id;     /* request ids of the next batch start here */
    char **info;          /* (n_info) per item of the last batch */
    int n_info;
    char last_lost[1024]; /* why the last program went away, for the final error */
    char last_refused[800]; /* the last CURVE refusal, for a "nobody came" error */
    struct comp {           /* named components of the last batch: sum and count per name */
        char name[64];
        double sum;
        int n;
    } comps[RF_EXTERNAL_MAX_COMPONENTS];
    int n_comps;
};

/* One score call. Request ids are base + k * n + i for the k-th send of item i, so a response
 * maps back to its item in O(1) and ids never repeat across batches. */
typedef struct batch {
    const rf_reward_item *items;
    int n;
    float *rewards;  /* (n) */
    uint64_t base;
    int *state;      /* (n) 0 pending, 1 in flight, 2 done */
    int *owner;      /* (n) peer id while in flight */
    int *sends;      /* (n) sends so far */
    int done, cursor;
} batch;

enum { PENDING, IN_FLIGHT, DONE };

static prog *find_prog(rf_external_reward *x, int id) {
    for (int i = 0; i < x->n_progs; i++)
        if (x->progs[i].id == id) return &x->progs[i];
    return NULL;
}

static rf_status add_prog(rf_external_reward *x, const rf_msg_event *ev) {
    if (x->n_progs == x->cap_progs) {
        int cap = x->cap_progs ? 2 * x->cap_progs : 4;
        prog *np = realloc(x->progs, sizeof *np * (size_t)cap);
        if (!np) return rf_error(RF_ERR_NOMEM, "out of memory");
        x->progs = np, x->cap_progs = cap;
    }
    x->progs[x->n_progs++] = (prog){ev->peer, 0, rf_time_now()};
    rf_log_info("reward: %s connected (capacity %d)", ev->info.desc, ev->info.capacity);
    return RF_OK;
}

static void remove_prog(rf_external_reward *x, int id) {
    prog *p = find_prog(x, id);
    if (p) *p = x->progs[--x->n_progs];
}

static int nonempty(const char *s) { return s && *s; }

/* The endpoint's security: a refusal for an open endpoint without CURVE (unless insecure),
 * else the CURVE keys, loaded into *secret and *clients (n; NULL without CURVE). */
static rf_status security(const rf_external_reward_config *cfg, rf_curve_key secret,
                          rf_curve_key **clients, int *n) {
    *clients = NULL, *n = 0;
    int curve = nonempty(cfg->curve_secret_file);
    if (curve != nonempty(cfg->curve_clients_file))
        return rf_error(RF_ERR_ARG, "reward.external_curve_%s is set but "
                                    "reward.external_curve_%s is not: CURVE needs both (rlflow's "
                                    "secret key and the public keys of the programs it allows)",
                        curve ? "secret" : "clients", curve ? "clients" : "secret");
    if (!curve) {
        if (rf_curve_endpoint_is_local(cfg->endpoint)) return RF_OK;
        if (!cfg->insecure)
            return rf_error(RF_ERR_ARG,
                            "reward.external = \"%s\" can be reached from other machines, and "
                            "without CURVE anyone who reaches it can send the rewards that "
                            "train the policy: set reward.external_curve_secret and "
                            "reward.external_curve_clients (rlflow keygen; docs/reward-api.md, "
                            "\"CURVE\"), bind a loopback address (tcp://127.0.0.1:5557), or set "
                            "reward.external_insecure = true on a network you trust",
                            cfg->endpoint);
        rf_log_warn("reward: %s can be reached from other machines without authentication "
                    "(reward.external_insecure = true): anyone who reaches it can send rewards",
                    cfg->endpoint);
        return RF_OK;
    }
    rf_status st = rf_curve_read_key(cfg->curve_secret_file, 1, secret);
    if (st != RF_OK) return rf_error_wrap(st, "reward.external_curve_secret");
    st = rf_curve_read_keys(cfg->curve_clients_file, clients, n);
    if (st != RF_OK) return rf_error_wrap(st, "reward.external_curve_clients");
    return RF_OK;
}

rf_status rf_external_reward_listen_with(rf_external_reward **out,
                                         const rf_external_reward_config *c) {
    *out = NULL;
    if (!c || !c->endpoint || !*c->endpoint)
        return rf_error(RF_ERR_ARG, "reward.external: an endpoint is needed "
                                    "(e.g. \"tcp://127.0.0.1:5557\")");
    if (!(c->timeout_s > 0) || !isfinite(c->timeout_s))
        return rf_error(RF_ERR_ARG, "reward.external_timeout must be > 0 s (got %g)", c->timeout_s);
    rf_curve_key secret = "", *clients = NULL;
    int n_clients = 0;
    RF_TRY(security(c, secret, &clients, &n_clients));
    const char **allowed = rf_calloc((size_t)n_clients + 1, sizeof *allowed);
    rf_external_reward *x = allowed ? rf_calloc(1, sizeof *x) : NULL;
    rf_status st = x ? RF_OK : RF_ERR_NOMEM;
    for (int i = 0; x && i < n_clients; i++) allowed[i] = clients[i];
    rf_msg_server_config cfg = {.accept_role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM,
                                .peer_timeout_s = c->timeout_s,
                                .curve_secret_key = clients ? secret : NULL,
                                .curve_clients = allowed, .n_curve_clients = n_clients};
    if (x) x->timeout_s = c->timeout_s, x->next_id = 1;
    if (st == RF_OK) st = rf_msg_server_open(&x->srv, c->endpoint, &cfg);
    memset(secret, 0, sizeof secret);
    free(clients);
    free(allowed);
    if (st != RF_OK) {
        free(x);
        return rf_error_wrap(st, "reward.external");
    }
    if (n_clients)
        rf_log_info("reward: CURVE on %s: %d allowed program key%s from %s",
                    rf_msg_server_endpoint(x->srv), n_clients, n_clients == 1 ? "" : "s",
                    c->curve_clients_file);
    *out = x;
    return RF_OK;
}

rf_status rf_external_reward_listen(rf_external_reward **out, const char *endpoint,
                                    double timeout_s) {
    rf_external_reward_config c = {.endpoint = endpoint, .timeout_s = timeout_s};
    return rf_external_reward_listen_with(out, &c);
}

/* A connection CURVE refused: logged (it names the endpoint, address and key), remembered. */
static void refused(rf_external_reward *x, const rf_msg_event *ev) {
    rf_log_warn("reward: %s", ev->text);
    snprintf(x->last_refused, sizeof x->last_refused, "%s", ev->text);
}

rf_status rf_external_reward_wait(rf_external_reward *x, int n, double timeout_s) {
    double deadline = rf_time_now() + timeout_s;
    const char *ep = rf_msg_server_endpoint(x->srv);
    while (x->n_progs < n) {
        double left = deadline - rf_time_now();
        if (left <= 0) {
            if (x->n_progs == 0 && x->last_refused[0])
                return rf_error(RF_ERR_IO, "no reward program connected to %s within %.1f s; "
                                           "the last connection was refused: %s",
                                ep, timeout_s, x->last_refused);
            if (x->n_progs == 0)
                return rf_error(RF_ERR_IO,
                                "no reward program connected to %s within %.1f s (start one, e.g. "
                                "python3 examples/reward/length_judge.py --connect %s)",
                                ep, timeout_s, ep);
            return rf_error(RF_ERR_IO, "%d of %d reward programs connected to %s within %.1f s",
                            x->n_progs, n, ep, timeout_s);
        }
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(x->srv, left, &ev));
        if (ev.kind == RF_MSG_EV_JOINED) RF_TRY(add_prog(x, &ev));
        else if (ev.kind == RF_MSG_EV_REFUSED && ev.auth) refused(x, &ev);
        else if (ev.kind == RF_MSG_EV_REFUSED) return rf_error(RF_ERR_UNSUPPORTED, "%s", ev.text);
        else if (ev.kind == RF_MSG_EV_LOST) remove_prog(x, ev.peer), rf_log_warn("reward: %s", ev.text);
        else if (ev.kind == RF_MSG_EV_MESSAGE) rf_msg_free(&ev.msg);  /* stale answers */
    }
    return RF_OK;
}

rf_status rf_external_reward_open_with(rf_external_reward **out,
                                       const rf_external_reward_config *cfg) {
    RF_TRY(rf_external_reward_listen_with(out, cfg));
    rf_status st = rf_external_reward_wait(*out, 1, cfg->timeout_s);
    if (st != RF_OK) {
        rf_external_reward_close(*out);
        *out = NULL;
    }
    return st;
}

rf_status rf_external_reward_open(rf_external_reward **out, const char *endpoint,
                                  double timeout_s) {
    rf_external_reward_config c = {.endpoint = endpoint, .timeout_s = timeout_s};
    return rf_external_reward_open_with(out, &c);
}

const char *rf_external_reward_endpoint(const rf_external_reward *x) {
    return rf_msg_server_endpoint(x->srv);
}

int rf_external_reward_programs(const rf_external_reward *x) { return x->n_progs; }

const char *rf_external_reward_info(const rf_external_reward *x, int i) {
    return i >= 0 && i < x->n_info && x->info[i] ? x->info[i] : "";
}

static void free_info(rf_external_reward *x) {
    for (int i = 0; i < x->n_info; i++) free(x->info[i]);
    free(x->info);
    x->info = NULL, x->n_info = 0;
}

void rf_external_reward_close(rf_external_reward *x) {
    if (!x) return;
    rf_msg_server_close(x->srv, "rlflow is done");
    free_info(x);
    free(x->progs);
    free(x);
}

/* ---- one batch ---------------------------------------------------------------------------- */

static uint64_t req_id(const batch *b, int i) {
    return b->base + (uint64_t)(b->sends[i] - 1) * (uint64_t)b->n + (uint64_t)i;
}

/* The least-loaded program with room (in flight / capacity), NULL when all are full. */
static prog *pick(rf_external_reward *x) {
    prog *best = NULL;
    double best_load = 0;
    for (int i = 0; i < x->n_progs; i++) {
        const rf_msg_peer_info *pi = rf_msg_server_peer(x->srv, x->progs[i].id);
        if (!pi || x->progs[i].inflight >= pi->capacity) continue;
        double load = (double)x->progs[i].inflight / pi->capacity;
        if (!best || load < best_load) best = &x->progs[i], best_load = load;
    }
    return best;
}

static rf_status send_item(rf_external_reward *x, batch *b, int i, prog *p) {
    const rf_reward_item *it = &b->items[i];
    Rlflow__RewardRequest q = RLFLOW__REWARD_REQUEST__INIT;
    b->sends[i]++;
    q.request_id = req_id(b, i);
    q.prompt = (char *)(it->prompt ? it->prompt : "");
    q.response = (char *)(it->response ? it->response : "");
    q.n_prompt_ids = it->prompt_ids ? (size_t)it->n_prompt_ids : 0;
    q.prompt_ids = (int32_t *)it->prompt_ids;
    q.n_response_ids = it->response_ids ? (size_t)it->n_response_ids : 0;
    q.response_ids = (int32_t *)it->response_ids;
    q.ground_truth = (char *)(it->truth ? it->truth : "");
    q.metadata_json = (char *)(it->metadata_json ? it->metadata_json : "");
    q.sample_index = it->index, q.group_id = it->group;
    /* A failed send marks the program lost inside the server; the next poll reports it. */
    if (rf_msg_server_send(x->srv, p->id, RF_MSG_REWARD_REQUEST, &q.base) != RF_OK) return RF_ERR_IO;
    if (p->inflight++ == 0) p->last_progress = rf_time_now();
    b->state[i] = IN_FLIGHT, b->owner[i] = p->id;
    return RF_OK;
}

/* Hands pending items to programs with room. */
static void assign(rf_external_reward *x, batch *b) {
    for (int i = b->cursor; i < b->n; i++) {
        if (b->state[i] != PENDING) {
            if (i == b->cursor) b->cursor++;
            continue;
        }
        prog *p = pick(x);
        if (!p || send_item(x, b, i, p) != RF_OK) return;
        if (i == b->cursor) b->cursor++;
    }
}

/* A program is gone: its requests return to the pending pool. */
static void lose(rf_external_reward *x, batch *b, int id, const char *why) {
    int first = -1, count = 0;
    for (int i = 0; i < b->n; i++)
        if (b->state[i] == IN_FLIGHT && b->owner[i] == id) {
            if (first < 0) first = i;
            count++;
            b->state[i] = PENDING;
            if (i < b->cursor) b->cursor = i;
        }
    remove_prog(x, id);
    if (first < 0)
        snprintf(x->last_lost, sizeof x->last_lost, "%s", why);
    else if (count == 1)
        snprintf(x->last_lost, sizeof x->last_lost, "%s while scoring request %" PRIu64, why,
                 req_id(b, first));
    else
        snprintf(x->last_lost, sizeof x->last_lost,
                 "%s while scoring request %" PRIu64 " (and %d more)", why, req_id(b, first),
                 count - 1);
    rf_log_warn("reward: %s%s", x->last_lost,
                count && x->n_progs ? "; re-sending its requests to the other programs" : "");
}

/* Sums the response's named components per name (non-finite values and names past the table
 * are left out: they are metrics, not rewards). */
static void add_components(rf_external_reward *x, const Rlflow__RewardResponse *r) {
    for (size_t k = 0; k < r->n_components; k++) {
        const char *name = r->components[k]->key ? r->components[k]->key : "";
        double v = r->components[k]->value;
        if (!*name || strlen(name) >= sizeof x->comps[0].name || !isfinite(v)) continue;
        int j = 0;
        while (j < x->n_comps && strcmp(x->comps[j].name, name)) j++;
        if (j == x->n_comps) {
            if (j == RF_EXTERNAL_MAX_COMPONENTS) continue;
            snprintf(x->comps[j].name, sizeof x->comps[j].name, "%s", name);
            x->comps[j].sum = 0, x->comps[j].n = 0, x->n_comps++;
        }
        x->comps[j].sum += v, x->comps[j].n++;
    }
}

int rf_external_reward_components(const rf_external_reward *x, const char **names, double *means,
                                  int cap) {
    int n = 0;
    for (; n < x->n_comps && n < cap; n++) {
        names[n] = x->comps[n].name;
        means[n] = x->comps[n].sum / x->comps[n].n;
    }
    return n;
}

/* Validates one RewardResponse and records it. */
static rf_status on_response(rf_external_reward *x, batch *b, const rf_msg_event *ev) {
    const Rlflow__RewardResponse *r = (const Rlflow__RewardResponse *)ev->msg.pb;
    const char *who = ev->info.desc;
    prog *p = find_prog(x, ev->peer);
    if (p) p->last_progress = rf_time_now();
    if (r->request_id < b->base) return RF_OK;  /* from a batch that failed earlier: stale */
    uint64_t off = r->request_id - b->base;
    int i = (int)(off % (uint64_t)b->n);
    if (off / (uint64_t)b->n >= (uint64_t)b->sends[i] || req_id(b, i) != r->request_id ||
        b->state[i] != IN_FLIGHT || b->owner[i] != ev->peer) {
        char msg[1200];
        snprintf(msg, sizeof msg, "%s answered request %" PRIu64 ", which is not one it holds",
                 who, r->request_id);
        rf_msg_server_drop(x->srv, ev->peer, RF_ERR_FORMAT, msg, r->request_id);
        remove_prog(x, ev->peer);
        return rf_error(RF_ERR_FORMAT, "%s (unknown request id)", msg);
    }
    const rf_reward_item *it = &b->items[i];
    if (r->error && *r->error)
        return rf_error(RF_ERR_FORMAT,
                        "%s could not score request %" PRIu64 " (sample %" PRId64 " of group %" PRId64 "): %s",
                        who, r->request_id, it->index, it->group, r->error);
    if (!isfinite(r->reward)) {
        char msg[1200];
        snprintf(msg, sizeof msg,
                 "%s answered reward %g for request %" PRIu64 " (sample %" PRId64 " of group %" PRId64
                 "); rewards must be finite",
                 who, (double)r->reward, r->request_id, it->index, it->group);
        rf_msg_server_drop(x->srv, ev->peer, RF_ERR_RANGE, msg, r->request_id);
        remove_prog(x, ev->peer);
        return rf_error(RF_ERR_RANGE, "%s", msg);
    }
    b->rewards[i] = r->reward;
    b->state[i] = DONE, b->done++;
    add_components(x, r);
    if (p) p->inflight--;
    free(x->info[i]);
    x->info[i] = r->info && *r->info ? rf_strdup(r->info) : NULL;
    return RF_OK;
}

static rf_status on_event(rf_external_reward *x, batch *b, rf_msg_event *ev) {
    rf_status st = RF_OK;
    switch (ev->kind) {
    case RF_MSG_EV_JOINED: return add_prog(x, ev);
    case RF_MSG_EV_REFUSED:
        if (ev->auth) refused(x, ev);
        else rf_log_warn("reward: %s", ev->text);
        return RF_OK;
    case RF_MSG_EV_LOST: lose(x, b, ev->peer, ev->text); return RF_OK;
    case RF_MSG_EV_MALFORMED:
        rf_msg_server_drop(x->srv, ev->peer, RF_ERR_FORMAT, ev->text, 0);
        remove_prog(x, ev->peer);
        return rf_error(RF_ERR_FORMAT, "%s", ev->text);
    case RF_MSG_EV_MESSAGE:
        if (ev->msg.type == RF_MSG_REWARD_RESPONSE) {
            st = on_response(x, b, ev);
        } else if (ev->msg.type == RF_MSG_ERROR) {
            const Rlflow__Error *e = (const Rlflow__Error *)ev->msg.pb;
            st = rf_error(RF_ERR_IO, "%s reported an error (request %" PRIu64 "): %s", ev->info.desc,
                          e->request_id, e->message);
        } else {
            st = rf_error(RF_ERR_FORMAT, "%s sent an unexpected %s", ev->info.desc,
                          rf_msg_type_name(ev->msg.type));
        }
        rf_msg_free(&ev->msg);
        return st;
    default: return RF_OK;
    }
}

/* Programs holding requests without answering any for timeout_s are dropped (they may answer
 * pings from a thread while their scoring is stuck). */
static void check_progress(rf_external_reward *x, batch *b, double now) {
    for (int i = 0; i < x->n_progs; i++) {
        prog *p = &x->progs[i];
        if (p->inflight == 0 || now - p->last_progress <= x->timeout_s) continue;
        /* a silent program is the server's to report (it answers no ping either) */
        if (rf_msg_server_silence(x->srv, p->id) > x->timeout_s / 2) continue;
        const rf_msg_peer_info *pi = rf_msg_server_peer(x->srv, p->id);
        char why[800];
        snprintf(why, sizeof why, "%s answered no request for %.1f s",
                 pi ? pi->desc : "a reward program", now - p->last_progress);
        int id = p->id;
        rf_msg_server_drop(x->srv, id, RF_ERR_IO, why, 0);
        lose(x, b, id, why);
        i = -1;  /* the table changed */
    }
}

static rf_status run_batch(rf_external_reward *x, batch *b) {
    double no_prog_since = x->n_progs ? -1 : rf_time_now();
    while (b->done < b->n) {
        assign(x, b);
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(x->srv, fmin(0.25, x->timeout_s), &ev));
        RF_TRY(on_event(x, b, &ev));
        double now = rf_time_now();
        check_progress(x, b, now);
        if (x->n_progs) {
            no_prog_since = -1;
        } else if (no_prog_since < 0) {
            no_prog_since = now;
        } else if (now - no_prog_since > x->timeout_s) {
            const char *ep = rf_msg_server_endpoint(x->srv);
            if (!x->last_lost[0])
                return rf_error(RF_ERR_IO, "no reward program connected to %s within %.1f s "
                                           "(%d of %d samples unscored)",
                                ep, x->timeout_s, b->n - b->done, b->n);
            return rf_error(RF_ERR_IO, "%s; no other reward program connected to %s within "
                                       "%.1f s (%d of %d samples unscored)",
                            x->last_lost, ep, x->timeout_s, b->n - b->done, b->n);
        }
    }
    return RF_OK;
}

rf_status rf_external_reward_score(rf_external_reward *x, const rf_reward_item *items, int n,
                                   float *rewards) {
    if (n < 0 || (n > 0 && (!items || !rewards)))
        return rf_error(RF_ERR_ARG, "rf_external_reward_score: bad batch (n = %d)", n);
    if (n == 0) return RF_OK;
    free_info(x);
    x->n_comps = 0;
    batch b = {.items = items, .n = n, .rewards = rewards, .base = x->next_id};
    b.state = calloc((size_t)n, sizeof(int));
    b.owner = calloc((size_t)n, sizeof(int));
    b.sends = calloc((size_t)n, sizeof(int));
    x->info = calloc((size_t)n, sizeof(char *));
    rf_status st = RF_OK;
    if (!b.state || !b.owner || !b.sends || !x->info)
        st = rf_error(RF_ERR_NOMEM, "out of memory for a batch of %d rewards", n);
    else x->n_info = n;
    double now = rf_time_now();
    for (int i = 0; i < x->n_progs; i++) x->progs[i].inflight = 0, x->progs[i].last_progress = now;
    x->last_lost[0] = '\0';
    if (st == RF_OK) st = run_batch(x, &b);
    /* the next batch's ids start past every id this one used */
    int max_sends = 1;
    for (int i = 0; b.sends && i < n; i++)
        if (b.sends[i] > max_sends) max_sends = b.sends[i];
    x->next_id = b.base + (uint64_t)max_sends * (uint64_t)n;
    free(b.state), free(b.owner), free(b.sends);
    return st;
}
