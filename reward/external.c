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
#include "common/program_pool.h"
#include "common/util.h"

struct rf_external_reward {
    rf_msg_server *srv;
    double timeout_s;
    float weight;                 /* rf_external_reward_config.weight */
    rf_status (*tick)(void *ctx); /* rf_external_reward_config.tick */
    void *tick_ctx;
    int (*stop)(void);            /* rf_external_reward_config.stop */
    char end[1024];               /* the Shutdown reason at close */
    rf_program_pool pool; /* the connected programs, the failed batches' ids */
    uint64_t next_id;     /* request ids of the next batch start here */
    char **info;          /* (n_info) per item of the last batch */
    int n_info;
    char last_lost[1024]; /* why the last program went away, for the final error */
    struct comp {           /* named components of the last batch: sum and count per name */
        char name[64];
        double sum;
        int n;
    } comps[RF_EXTERNAL_MAX_COMPONENTS];
    int n_comps;
    int comps_full;       /* a batch's names were left out (past the table): warned once */
    int max_attempts;     /* rejected replies per sample before the batch fails */
    int ok;               /* the last batch succeeded: info and token rewards are valid */
    float *tok;           /* per-token rewards of the last batch, item i's at tok + tok_off[i] */
    size_t *tok_off;      /* (n_info) */
    int *tok_n;           /* (n_info) how many item i got (0: none) */
    rf_external_reward_stats stats; /* of the last batch */
    char last_reject[1024];         /* the last rejection's reason in the last batch */
};

/* One score call (its request ids: rf_program_calls). */
typedef struct batch {
    const rf_reward_item *items;
    float *rewards;     /* (n) */
    rf_program_calls c; /* ids, states, owners, sends, rejections */
} batch;

static int nonempty(const char *s) { return s && *s; }

/* The endpoint's security: a refusal for an open endpoint without CURVE (unless insecure),
 * else the CURVE keys (from files, given directly, or both), loaded into secret and *clients (n;
 * NULL without CURVE). */
static rf_status security(const rf_external_reward_config *cfg, rf_curve_key secret,
                          rf_curve_key **clients, int *n) {
    rf_program_security sec = {"reward", "reward.external", "reward.external_curve_secret",
                               "reward.external_curve_clients", "reward.external_insecure", "rewards",
                               "rlflow keygen; docs/reward-api.md, \"CURVE\"", "tcp://127.0.0.1:5557",
                               ": anyone who reaches it can send rewards", cfg->endpoint,
                               cfg->curve_secret_file, cfg->curve_clients_file, cfg->insecure};
    rf_program_direct_keys d = {cfg->curve_secret_key, cfg->curve_client_keys, cfg->n_curve_client_keys};
    return rf_program_pool_keys(&sec, &d, secret, clients, n);
}

rf_status rf_external_reward_listen_with(rf_external_reward **out,
                                         const rf_external_reward_config *c) {
    *out = NULL;
    if (!c || !c->endpoint || !*c->endpoint)
        return rf_error(RF_ERR_ARG, "reward.external: an endpoint is needed "
                                    "(e.g. \"tcp://127.0.0.1:5557\")");
    if (!(c->timeout_s > 0) || !isfinite(c->timeout_s))
        return rf_error(RF_ERR_ARG, "reward.external_timeout must be > 0 s (got %g)", c->timeout_s);
    if (c->max_attempts < 0)
        return rf_error(RF_ERR_ARG, "reward.external: max_attempts must be >= 0 (got %d)",
                        c->max_attempts);
    if (!isfinite((float)c->weight))
        return rf_error(RF_ERR_ARG, "reward.external_weight must be a finite float (got %g)",
                        c->weight);
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
                                .curve_clients = allowed, .n_curve_clients = n_clients,
                                .max_msg_bytes = RF_MSG_EXTERNAL_MAX_BYTES, .check_utf8 = 1};
    if (x) x->stop = c->stop, snprintf(x->end, sizeof x->end, "%s", RF_MSG_SHUTDOWN_DONE);
    if (x) x->timeout_s = c->timeout_s, x->next_id = 1, x->pool.label = "reward", x->tick = c->tick, x->tick_ctx = c->tick_ctx;
    if (x) x->max_attempts = c->max_attempts ? c->max_attempts : RF_EXTERNAL_MAX_ATTEMPTS;
    if (x) x->weight = (float)c->weight;
    if (st == RF_OK) st = rf_msg_server_open(&x->srv, c->endpoint, &cfg);
    memset(secret, 0, sizeof secret);
    free(clients);
    free(allowed);
    if (st != RF_OK) {
        free(x);
        return rf_error_wrap(st, "reward.external");
    }
    int n_file = n_clients - (c->n_curve_client_keys > 0 ? c->n_curve_client_keys : 0);
    if (n_clients && nonempty(c->curve_clients_file))
        rf_log_info("reward: CURVE on %s: %d allowed program key%s from %s%s",
                    rf_msg_server_endpoint(x->srv), n_file, n_file == 1 ? "" : "s",
                    c->curve_clients_file, c->n_curve_client_keys > 0 ? " and the programs rlflow starts" : "");
    else if (n_clients)
        rf_log_info("reward: CURVE on %s with keys made for this run: only the programs rlflow starts "
                    "may connect", rf_msg_server_endpoint(x->srv));
    *out = x;
    return RF_OK;
}

rf_status rf_external_reward_listen(rf_external_reward **out, const char *endpoint,
                                    double timeout_s) {
    rf_external_reward_config c = {.endpoint = endpoint, .timeout_s = timeout_s};
    return rf_external_reward_listen_with(out, &c);
}

rf_status rf_external_reward_wait(rf_external_reward *x, int n, double timeout_s) {
    double deadline = rf_time_now() + timeout_s;
    const char *ep = rf_msg_server_endpoint(x->srv);
    while (x->pool.n < n) {
        double left = deadline - rf_time_now();
        if (left <= 0) {
            if (x->pool.n == 0 && x->pool.last_refused[0])
                return rf_error(RF_ERR_IO, "no reward program connected to %s within %.1f s; "
                                           "the last connection was refused: %s",
                                ep, timeout_s, x->pool.last_refused);
            if (x->pool.n == 0)
                return rf_error(RF_ERR_IO,
                                "no reward program connected to %s within %.1f s (start one, e.g. "
                                "python3 examples/reward/length_judge.py --connect %s)",
                                ep, timeout_s, ep);
            return rf_error(RF_ERR_IO, "%d of %d reward programs connected to %s within %.1f s",
                            x->pool.n, n, ep, timeout_s);
        }
        if (x->tick) RF_TRY(x->tick(x->tick_ctx));
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(x->srv, x->tick ? fmin(left, 0.25) : left, &ev));
        RF_TRY(rf_program_pool_wait_event(&x->pool, &ev));
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

int rf_external_reward_programs(const rf_external_reward *x) { return x->pool.n; }

const char *rf_external_reward_info(const rf_external_reward *x, int i) {
    return x->ok && i >= 0 && i < x->n_info && x->info[i] ? x->info[i] : "";
}

int rf_external_reward_token_rewards(const rf_external_reward *x, int i, const float **v) {
    int ok = x->ok && i >= 0 && i < x->n_info && x->tok_n[i] > 0;
    *v = ok ? x->tok + x->tok_off[i] : NULL;
    return ok ? x->tok_n[i] : 0;
}

rf_external_reward_stats rf_external_reward_last_stats(const rf_external_reward *x) {
    return x->stats;
}

const char *rf_external_reward_last_rejection(const rf_external_reward *x) {
    return x->last_reject;
}

/* Forgets what the last batch left (info strings, token rewards, stats). */
static void free_last(rf_external_reward *x) {
    for (int i = 0; i < x->n_info; i++) free(x->info[i]);
    free(x->info), free(x->tok), free(x->tok_off), free(x->tok_n);
    x->info = NULL, x->tok = NULL, x->tok_off = NULL, x->tok_n = NULL;
    x->n_info = 0, x->ok = 0, x->n_comps = 0;
    x->stats = (rf_external_reward_stats){0};
    x->last_reject[0] = '\0';
}

/* Room for the answers of a batch of n (info strings, token rewards). */
static rf_status alloc_last(rf_external_reward *x, const rf_reward_item *items, int n) {
    x->info = calloc((size_t)n, sizeof *x->info);
    x->tok_off = calloc((size_t)n, sizeof *x->tok_off);
    x->tok_n = calloc((size_t)n, sizeof *x->tok_n);
    size_t total = 0;
    for (int i = 0; x->tok_off && i < n; i++) {
        x->tok_off[i] = total;
        total += items[i].response_ids && items[i].n_response_ids > 0
                     ? (size_t)items[i].n_response_ids : 0;
    }
    x->tok = malloc(sizeof *x->tok * (total + 1));
    if (!x->info || !x->tok_off || !x->tok_n || !x->tok)
        return rf_error(RF_ERR_NOMEM, "out of memory for a batch of %d rewards", n);
    x->n_info = n;
    return RF_OK;
}

void rf_external_reward_close(rf_external_reward *x) {
    if (!x) return;
    rf_msg_server_close(x->srv, x->end);
    free_last(x);
    rf_program_pool_free(&x->pool);
    free(x);
}

void rf_external_reward_set_end(rf_external_reward *x, const char *reason) {
    if (x) snprintf(x->end, sizeof x->end, "%s", reason ? reason : RF_MSG_SHUTDOWN_DONE);
}

/* ---- one batch ---------------------------------------------------------------------------- */

static uint64_t req_id(const batch *b, int i) {
    return rf_program_calls_id(&b->c, i);
}

/* The response's token count as the request carried it. */
static size_t n_ids(const rf_reward_item *it) {
    return it->response_ids && it->n_response_ids > 0 ? (size_t)it->n_response_ids : 0;
}

static rf_status send_item(rf_external_reward *x, batch *b, int i, rf_program *p) {
    const rf_reward_item *it = &b->items[i];
    Rlflow__RewardRequest q = RLFLOW__REWARD_REQUEST__INIT;
    if (b->c.sends[i]++ > 0) x->stats.resent++;
    q.request_id = req_id(b, i);
    q.prompt = (char *)(it->prompt ? it->prompt : "");
    q.response = (char *)(it->response ? it->response : "");
    q.n_prompt_ids = it->prompt_ids && it->n_prompt_ids > 0 ? (size_t)it->n_prompt_ids : 0;
    q.prompt_ids = (int32_t *)it->prompt_ids;
    q.n_response_ids = n_ids(it);
    q.response_ids = (int32_t *)it->response_ids;
    q.ground_truth = (char *)(it->truth ? it->truth : "");
    q.metadata_json = (char *)(it->metadata_json ? it->metadata_json : "");
    q.sample_index = it->index, q.group_id = it->group;
    /* A failed send marks the program lost inside the server; the next poll reports it. */
    if (rf_msg_server_send(x->srv, p->id, RF_MSG_REWARD_REQUEST, &q.base) != RF_OK) return RF_ERR_IO;
    if (p->inflight++ == 0) p->last_progress = rf_time_now();
    b->c.state[i] = RF_CALL_IN_FLIGHT, b->c.owner[i] = p->id;
    return RF_OK;
}

/* The batch's error once a stop was asked for and item i would be sent again (or waits for a
 * program); RF_OK otherwise. */
static rf_status stopped(rf_external_reward *x, batch *b, int i) {
    int sig = x->stop ? x->stop() : 0;
    if (!sig) return RF_OK;
    const rf_reward_item *it = &b->items[i];
    return rf_error(RF_ERR_IO, "interrupted (signal %d): the request for sample %" PRId64 " of group %" PRId64
                    " is not sent%s%s%s", sig, it->index, it->group, b->c.sends[i] > 0 ? " again" : "",
                    x->last_lost[0] ? "; " : "", x->last_lost);
}

/* Hands pending items to programs with room. */
static rf_status assign(rf_external_reward *x, batch *b) {
    for (int i = b->c.cursor; i < b->c.n; i++) {
        if (b->c.state[i] != RF_CALL_PENDING) {
            if (i == b->c.cursor) b->c.cursor++;
            continue;
        }
        if (b->c.sends[i] > 0) RF_TRY(stopped(x, b, i));
        rf_program *p = rf_program_pool_pick(&x->pool, x->srv);
        if (!p || send_item(x, b, i, p) != RF_OK) return RF_OK;
        if (i == b->c.cursor) b->c.cursor++;
    }
    return RF_OK;
}

static rf_status count_rejection(rf_external_reward *x, batch *b, int i, rf_status code, const char *why);

/* Counts why against every request program id holds (each named in its reason). */
static rf_status reject_held(rf_external_reward *x, batch *b, int id, rf_status code, const char *why) {
    rf_status st = RF_OK;
    for (int k = 0; st == RF_OK && k < b->c.n; k++) {
        if (b->c.state[k] != RF_CALL_IN_FLIGHT || b->c.owner[k] != id) continue;
        char held[1100];
        snprintf(held, sizeof held, "%s (it held request %" PRIu64 ")", why, req_id(b, k));
        st = count_rejection(x, b, k, code, held);
    }
    return st;
}

/* A program is gone (disconnected, silent, stuck): its requests return to the pending pool. One
 * dropped for its deadline or for silence (timed_out) is a rejection of each request it held: a
 * sample no program scores fails the batch after max_attempts, naming it. */
static rf_status lose(rf_external_reward *x, batch *b, int id, const char *why, int timed_out) {
    rf_status st = timed_out ? reject_held(x, b, id, RF_ERR_IO, why) : RF_OK;
    int first, count = rf_program_calls_release(&b->c, &x->pool, id, &first);
    x->stats.lost++;
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
                count && x->pool.n ? "; re-sending its requests to the other programs" : "");
    return st;
}

/* Sums the response's named components per name (check_reply has refused empty or long names
 * and non-finite values). A batch's names past RF_EXTERNAL_MAX_COMPONENTS are left out of the
 * metrics, with one warning in the bridge's life. */
static void add_components(rf_external_reward *x, const Rlflow__RewardResponse *r) {
    for (size_t k = 0; k < r->n_components; k++) {
        const char *name = r->components[k]->key ? r->components[k]->key : "";
        double v = r->components[k]->value;
        int j = 0;
        while (j < x->n_comps && strcmp(x->comps[j].name, name)) j++;
        if (j == x->n_comps) {
            if (j == RF_EXTERNAL_MAX_COMPONENTS) {
                if (!x->comps_full++)
                    rf_log_warn("reward: the programs sent more than %d component names in one "
                                "batch: '%s' and any later new name of a batch are left out of the metrics",
                                RF_EXTERNAL_MAX_COMPONENTS, name);
                continue;
            }
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

/* ---- rejected replies ------------------------------------------------------------------------ */

/* Adds one rejection to item i's history: RF_OK, or the batch's error (`code`) once the item
 * has been rejected max_attempts times, naming its last request, the sample and every reason. */
static rf_status count_rejection(rf_external_reward *x, batch *b, int i, rf_status code,
                                 const char *why) {
    int limit;
    RF_TRY(rf_program_calls_reject(&b->c, i, why, x->max_attempts, &limit));
    if (!limit) return RF_OK;
    const char *s = b->c.why[i];
    const rf_reward_item *it = &b->items[i];
    return rf_error(code,
                    "request %" PRIu64 " (sample %" PRId64 " of group %" PRId64 ") was rejected %d "
                    "time%s, the limit (max_attempts): %s", req_id(b, i), it->index, it->group,
                    b->c.rejects[i], b->c.rejects[i] == 1 ? "" : "s", s);
}

/* A reply is rejected: logged, the program told why and dropped (its requests return to the
 * pending pool, as for a crash), and the rejection counted against item i, or against every
 * request the program held when i < 0 (a reply that names none of them). */
static rf_status reject(rf_external_reward *x, batch *b, int peer, int i, rf_status code,
                        const char *why) {
    rf_log_warn("reward: rejected a reply: %s", why);
    snprintf(x->last_reject, sizeof x->last_reject, "%s", why);
    x->stats.rejected++;
    rf_msg_server_drop(x->srv, peer, code, why, i >= 0 ? req_id(b, i) : 0);
    rf_status st = i >= 0 ? count_rejection(x, b, i, code, why) : reject_held(x, b, peer, code, why);
    snprintf(x->last_lost, sizeof x->last_lost, "%s", why);
    int first, count = rf_program_calls_release(&b->c, &x->pool, peer, &first);
    if (count)
        rf_log_warn("reward: dropped that program; request %" PRIu64 "%s go%s to %s", req_id(b, first),
                    count > 1 ? " and the others it held" : "", count > 1 ? "" : "es",
                    x->pool.n ? "the other programs" : "the next program to connect");
    return st;
}

/* The item whose request `id` the program holds; -1 otherwise, with *why saying what is wrong
 * (an unknown id, a second answer) or *stale set for a late answer to a failed batch. */
static int match_reply(const rf_external_reward *x, const batch *b, const rf_msg_event *ev,
                       uint64_t id, char *why, size_t cap, int *stale) {
    int done, i = rf_program_calls_match(&b->c, &x->pool, ev->peer, id, &done, stale);
    if (i >= 0 || *stale) return i;
    if (done) {
        const rf_reward_item *it = &b->items[(id - b->c.base) % (uint64_t)b->c.n];
        snprintf(why, cap, "%s answered request %" PRIu64 " (sample %" PRId64 " of group %" PRId64
                 ") a second time", ev->info.desc, id, it->index, it->group);
        return -1;
    }
    snprintf(why, cap, "%s answered request %" PRIu64 ", which is not one it holds",
             ev->info.desc, id);
    return -1;
}

/* Why reply r (finite values) cannot be used once weighted by w, as the trainer adds it in float
 * (controller/rl_core.c, controller/advantages.c): the weighted reward, each weighted per-token
 * reward and their running sum must stay finite. RF_OK, or RF_ERR_RANGE with *why. */
static rf_status check_weighted(float w, const Rlflow__RewardResponse *r, const char *who,
                                const char *req, char *why, size_t cap) {
    float sum = w * r->reward;
    if (!isfinite(sum)) {
        snprintf(why, cap, "%s answered reward %g for %s, which overflows to %g once weighted by "
                 "reward.external_weight = %g; weighted rewards must be finite", who,
                 (double)r->reward, req, (double)sum, (double)w);
        return RF_ERR_RANGE;
    }
    for (size_t k = 0; k < r->n_token_rewards; k++) {
        float v = w * r->token_rewards[k];
        sum += v;
        if (!isfinite(v) || !isfinite(sum)) {
            snprintf(why, cap, "%s answered per-token rewards for %s whose weighted %s overflows "
                     "to %g at token %zu (reward.external_weight = %g); weighted rewards must "
                     "be finite", who, req, isfinite(v) ? "sum with the reward" : "value",
                     (double)(isfinite(v) ? sum : v), k, (double)w);
            return RF_ERR_RANGE;
        }
    }
    return RF_OK;
}

/* Why reply r to item i cannot be accepted: RF_OK when it can, else the status with *why. */
static rf_status check_reply(const batch *b, int i, const Rlflow__RewardResponse *r, float w,
                             const char *who, char *why, size_t cap) {
    const rf_reward_item *it = &b->items[i];
    char req[160];
    snprintf(req, sizeof req, "request %" PRIu64 " (sample %" PRId64 " of group %" PRId64 ")",
             r->request_id, it->index, it->group);
    if (r->error && *r->error) {
        snprintf(why, cap, "%s could not score %s: %s", who, req, r->error);
        return RF_ERR_FORMAT;
    }
    for (size_t k = 0; k < r->n_components; k++) {
        const char *name = r->components[k]->key ? r->components[k]->key : "";
        size_t len = strlen(name);
        if (len == 0 || len >= sizeof ((struct comp *)0)->name) {
            snprintf(why, cap, "%s answered a component named \"%.40s%s\" (%zu bytes) for %s; "
                     "component names must be 1 to %zu bytes", who, name, len > 40 ? "..." : "",
                     len, req, sizeof ((struct comp *)0)->name - 1);
            return RF_ERR_FORMAT;
        }
        if (!isfinite(r->components[k]->value)) {
            snprintf(why, cap, "%s answered a non-finite component (%s = %g) for %s", who, name,
                     (double)r->components[k]->value, req);
            return RF_ERR_RANGE;
        }
    }
    if (!isfinite(r->reward)) {
        snprintf(why, cap, "%s answered reward %g for %s; rewards must be finite", who,
                 (double)r->reward, req);
        return RF_ERR_RANGE;
    }
    if (r->n_token_rewards && r->n_token_rewards != n_ids(it)) {
        snprintf(why, cap, "%s answered %zu per-token rewards for %s, whose response has %zu "
                 "token%s", who, r->n_token_rewards, req, n_ids(it), n_ids(it) == 1 ? "" : "s");
        return RF_ERR_FORMAT;
    }
    for (size_t k = 0; k < r->n_token_rewards; k++)
        if (!isfinite(r->token_rewards[k])) {
            snprintf(why, cap, "%s answered a non-finite per-token reward (%g at token %zu) for "
                     "%s", who, (double)r->token_rewards[k], k, req);
            return RF_ERR_RANGE;
        }
    return check_weighted(w, r, who, req, why, cap);
}

/* Records an accepted reply: the sample is scored, exactly once. */
static void accept_reply(rf_external_reward *x, batch *b, int i, const Rlflow__RewardResponse *r,
                         rf_program *p) {
    b->rewards[i] = r->reward;
    b->c.state[i] = RF_CALL_DONE, b->c.done++;
    x->stats.accepted++;
    add_components(x, r);
    if (p) p->inflight--;
    free(x->info[i]);
    x->info[i] = r->info && *r->info ? rf_strdup(r->info) : NULL;
    if (r->n_token_rewards) {
        memcpy(x->tok + x->tok_off[i], r->token_rewards, sizeof(float) * r->n_token_rewards);
        x->tok_n[i] = (int)r->n_token_rewards;
        x->stats.token_rewards++;
    }
}

static rf_status on_response(rf_external_reward *x, batch *b, const rf_msg_event *ev) {
    const Rlflow__RewardResponse *r = (const Rlflow__RewardResponse *)ev->msg.pb;
    rf_program *p = rf_program_pool_find(&x->pool, ev->peer);
    if (p) p->last_progress = rf_time_now();
    char why[1024];
    int stale, i = match_reply(x, b, ev, r->request_id, why, sizeof why, &stale);
    if (stale) return RF_OK;
    if (i < 0) return reject(x, b, ev->peer, -1, RF_ERR_FORMAT, why);
    rf_status code = check_reply(b, i, r, x->weight, ev->info.desc, why, sizeof why);
    if (code != RF_OK) return reject(x, b, ev->peer, i, code, why);
    accept_reply(x, b, i, r, p);
    return RF_OK;
}

/* A frame that does not decode: counted against the request it names when it unpacked and
 * names one the program holds (a string not UTF-8, a wrong wire type), else against every
 * request the program held. */
static rf_status on_malformed(rf_external_reward *x, batch *b, const rf_msg_event *ev) {
    char unused[1024], why[1400];
    int stale = 0, i = ev->request_id ? match_reply(x, b, ev, ev->request_id, unused, sizeof unused, &stale) : -1;
    if (i < 0) return reject(x, b, ev->peer, -1, RF_ERR_FORMAT, ev->text);
    snprintf(why, sizeof why, "%s (its reply to request %" PRIu64 " (sample %" PRId64 " of group %" PRId64 "))",
             ev->text, ev->request_id, b->items[i].index, b->items[i].group);
    return reject(x, b, ev->peer, i, RF_ERR_FORMAT, why);
}

/* An Error from a program: it gives up on the request it names (or on all it holds). */
static rf_status on_program_error(rf_external_reward *x, batch *b, const rf_msg_event *ev) {
    const Rlflow__Error *e = (const Rlflow__Error *)ev->msg.pb;
    const char *text = e->message ? e->message : "";
    char why[1024], unused[1024];
    int stale = 0, i = e->request_id ? match_reply(x, b, ev, e->request_id, unused, sizeof unused,
                                                   &stale) : -1;
    if (i >= 0)
        snprintf(why, sizeof why, "%s reported an error for request %" PRIu64 " (sample %" PRId64
                 " of group %" PRId64 "): %s", ev->info.desc, e->request_id, b->items[i].index,
                 b->items[i].group, text);
    else
        snprintf(why, sizeof why, "%s reported an error: %s", ev->info.desc, text);
    return reject(x, b, ev->peer, i, RF_ERR_FORMAT, why);
}

static rf_status on_event(rf_external_reward *x, batch *b, rf_msg_event *ev) {
    rf_status st = RF_OK;
    char why[1024];
    switch (ev->kind) {
    case RF_MSG_EV_JOINED: return rf_program_pool_add(&x->pool, ev);
    case RF_MSG_EV_REFUSED:
        if (ev->auth) rf_program_pool_refused(&x->pool, ev);
        else rf_log_warn("reward: %s", ev->text);
        return RF_OK;
    case RF_MSG_EV_LOST: return lose(x, b, ev->peer, ev->text, ev->silent);
    case RF_MSG_EV_MALFORMED: return on_malformed(x, b, ev);
    case RF_MSG_EV_MESSAGE:
        if (ev->msg.type == RF_MSG_REWARD_RESPONSE) {
            st = on_response(x, b, ev);
        } else if (ev->msg.type == RF_MSG_ERROR) {
            st = on_program_error(x, b, ev);
        } else {
            snprintf(why, sizeof why, "%s sent a %s, which a reward program may not send",
                     ev->info.desc, rf_msg_type_name(ev->msg.type));
            st = reject(x, b, ev->peer, -1, RF_ERR_FORMAT, why);
        }
        rf_msg_free(&ev->msg);
        return st;
    default: return RF_OK;
    }
}

/* Programs holding requests without answering any for timeout_s are dropped (they may answer
 * pings from a thread while their scoring is stuck). */
static rf_status check_progress(rf_external_reward *x, batch *b, double now) {
    char why[800];
    for (int id; (id = rf_program_pool_stuck(&x->pool, x->srv, x->timeout_s, now, "a reward program", "",
                                             why, sizeof why)) >= 0;)
        RF_TRY(lose(x, b, id, why, 1));
    return RF_OK;
}

static rf_status run_batch(rf_external_reward *x, batch *b) {
    double no_prog_since = x->pool.n ? -1 : rf_time_now();
    while (b->c.done < b->c.n) {
        if (x->tick) RF_TRY(x->tick(x->tick_ctx));
        RF_TRY(assign(x, b));
        rf_msg_event ev;
        RF_TRY(rf_msg_server_poll(x->srv, fmin(0.25, x->timeout_s), &ev));
        RF_TRY(on_event(x, b, &ev));
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
                return rf_error(RF_ERR_IO, "no reward program connected to %s within %.1f s "
                                           "(%d of %d samples unscored)",
                                ep, x->timeout_s, b->c.n - b->c.done, b->c.n);
            return rf_error(RF_ERR_IO, "%s; no other reward program connected to %s within "
                                       "%.1f s (%d of %d samples unscored)",
                            x->last_lost, ep, x->timeout_s, b->c.n - b->c.done, b->c.n);
        }
    }
    return RF_OK;
}

rf_status rf_external_reward_score(rf_external_reward *x, const rf_reward_item *items, int n,
                                   float *rewards) {
    if (n < 0 || (n > 0 && (!items || !rewards)))
        return rf_error(RF_ERR_ARG, "rf_external_reward_score: bad batch (n = %d)", n);
    if (n == 0) return RF_OK;
    free_last(x);
    batch b = {.items = items, .rewards = rewards};
    int room = rf_program_calls_init(&b.c, n, x->next_id);
    rf_status st = alloc_last(x, items, n);
    if (st == RF_OK && !room)
        st = rf_error(RF_ERR_NOMEM, "out of memory for a batch of %d rewards", n);
    double now = rf_time_now();
    rf_program_pool_start_call(&x->pool, now);
    x->last_lost[0] = '\0';
    if (st == RF_OK) st = run_batch(x, &b);
    /* the next batch's ids start past every id this one used */
    x->next_id = rf_program_calls_end(&b.c);
    if (st != RF_OK) {  /* programs may still answer this batch: those answers are ignored */
        rf_program_pool_fail(&x->pool, b.c.base, x->next_id);
    }
    x->ok = st == RF_OK;
    rf_program_calls_free(&b.c);
    return st;
}
