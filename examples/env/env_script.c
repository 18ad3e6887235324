/* A scripted environment program in C (docs/env-api.md): the example of an environment written
 * against rlflow's message layer, and the environment the episode tests run. It connects with
 * rf_msg_client (role ROLE_ENVIRONMENT), answers EnvReset and EnvStep requests, exits on
 * Shutdown. Its answers depend on the request alone, so that any copy of it can answer any
 * request (rlflow re-sends a request to another program when one dies):
 *
 *   reset: observation = --first (default ""), reward 0, done false
 *   step of turn t: observation = "<o" t ">", reward = 0.5 * (t + 1) + 0.01 * n_action_ids,
 *                   done = t + 1 >= --turns (default 3)
 *   a step whose history does not hold exactly t turns, each observed "<o" k ">", or whose
 *   first_observation is not --first, is answered with an error (the controller sent a wrong
 *   episode): the tests would see rejections.
 *
 * Fault modes for the tests (--after K: the fault hits the K-th request, counted from 1 over
 * every connection; --mode A,B: the K-th gets A, the next B; --every 1 repeats them):
 *   ok          answer
 *   die         exit at once without answering
 *   silent      stop reading and answering (sleeps 60 s, then exits)
 *   mute        keep the request and never answer it (pings still answered)
 *   badutf8     answer with an observation that is not UTF-8 ("<o\xff>")
 *   nul         answer with an observation holding a NUL byte ("a\0b", by hand)
 *   donestr     answer with done sent as the string "yes" (wire type 2, by hand)
 *   garbage     answer with bytes that do not decode as an EnvReply
 *   nan         answer reward NaN
 *   badid       answer with an id nobody sent
 *   error       answer with EnvReply.error set
 *   badtype     answer with a Shutdown, which an environment may not send
 *   resetreward answer a reset with reward 1
 *   swap        hold this answer and send it after the next request's answer (or after 0.3 s
 *               with nothing new): replies out of order, which is allowed
 *
 * --once FILE: the faults hit only while FILE does not exist, and the first one makes it: a
 * program rlflow restarts (env.programs) plays straight after its first fault.
 *
 * Started by rlflow (env.programs) it finds the endpoint and CURVE keys in RLFLOW_ENV_ENDPOINT,
 * RLFLOW_ENV_SERVER_KEY, RLFLOW_ENV_PUBLIC_KEY and RLFLOW_ENV_SECRET_KEY (--connect not given).
 *
 * Usage: env_program_script [--connect EP] [--name N] [--first TEXT] [--turns T] [--capacity C]
 *                           [--mode M[,M...]] [--after K] [--every 0|1] [--reconnect 0|1]
 *                           [--once FILE]
 * Exit: 0 after Shutdown (its reason printed on stderr: "<name>: shutdown: <reason>"), 2 bad
 * usage, 3 rlflow silent for 30 s, 4 connection refused. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/msg.h"

#define MAX_MODES 8

typedef struct opts {
    const char *endpoint, *name, *first, *once;
    char modes[MAX_MODES][16];
    int n_modes, after, every, capacity, turns, reconnect;
} opts;

static int parse_modes(const char *v, opts *o) {
    o->n_modes = 0;
    for (const char *p = v; *p && o->n_modes < MAX_MODES;) {
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof o->modes[0]) return 0;
        memcpy(o->modes[o->n_modes], p, len), o->modes[o->n_modes++][len] = '\0';
        p += len + (p[len] == ',');
    }
    return o->n_modes > 0;
}

static int parse(int argc, char **argv, opts *o) {
    *o = (opts){.name = "script", .first = "", .modes = {"ok"}, .n_modes = 1, .after = 1 << 30, .capacity = 4,
                .turns = 3};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--connect")) o->endpoint = v;
        else if (!strcmp(k, "--name")) o->name = v;
        else if (!strcmp(k, "--first")) o->first = v;
        else if (!strcmp(k, "--turns")) o->turns = atoi(v);
        else if (!strcmp(k, "--mode")) { if (!parse_modes(v, o)) return 0; }
        else if (!strcmp(k, "--after")) o->after = atoi(v);
        else if (!strcmp(k, "--every")) o->every = atoi(v);
        else if (!strcmp(k, "--capacity")) o->capacity = atoi(v);
        else if (!strcmp(k, "--reconnect")) o->reconnect = atoi(v);
        else if (!strcmp(k, "--once")) o->once = v;
        else return 0;
    }
    if (!o->endpoint && getenv("RLFLOW_ENV_ENDPOINT") && *getenv("RLFLOW_ENV_ENDPOINT"))
        o->endpoint = getenv("RLFLOW_ENV_ENDPOINT");
    return o->endpoint != NULL && o->turns >= 1;
}

static const char *fault_of(const opts *o, int k) {
    if (k < o->after || (!o->every && k - o->after >= o->n_modes)) return "ok";
    if (o->once) { /* the first fault of all the program's lives, alone */
        if (access(o->once, F_OK) == 0) return "ok";
        FILE *f = fopen(o->once, "w");
        if (f) fclose(f);
    }
    return o->modes[(k - o->after) % o->n_modes];
}

/* A variable of the environment rlflow sets for the programs it starts; NULL when unset or "". */
static const char *env_key(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* What is wrong with step q's episode as this script would have played it; NULL: nothing. */
static const char *check_history(const opts *o, const Rlflow__EnvStep *q, char *buf, size_t cap) {
    if ((size_t)q->turn != q->n_history) {
        snprintf(buf, cap, "turn %d came with %zu earlier turns", q->turn, q->n_history);
        return buf;
    }
    if (strcmp(q->first_observation, o->first) != 0) return "the first observation is not mine";
    for (size_t k = 0; k < q->n_history; k++) {
        char want[32];
        snprintf(want, sizeof want, "<o%zu>", k);
        if (strcmp(q->history[k]->observation, want) != 0) {
            snprintf(buf, cap, "turn %zu's observation is \"%s\", not \"%s\"", k, q->history[k]->observation, want);
            return buf;
        }
    }
    return NULL;
}

/* The reply to message m (a reset or a step), into r; obs and err are its strings' room. */
static void reply_to(const opts *o, const rf_msg *m, Rlflow__EnvReply *r, char *obs, char *err, size_t cap) {
    rlflow__env_reply__init(r);
    if (m->type == RF_MSG_ENV_RESET) {
        const Rlflow__EnvReset *q = (const Rlflow__EnvReset *)m->pb;
        r->request_id = q->request_id, r->observation = (char *)o->first;
        return;
    }
    const Rlflow__EnvStep *q = (const Rlflow__EnvStep *)m->pb;
    r->request_id = q->request_id;
    const char *bad = check_history(o, q, err, cap);
    if (bad) {
        if (bad != err) snprintf(err, cap, "%s", bad);
        r->error = err;
        return;
    }
    snprintf(obs, cap, "<o%d>", q->turn);
    r->observation = obs;
    r->reward = 0.5f * (float)(q->turn + 1) + 0.01f * (float)q->n_action_ids;
    r->done = q->turn + 1 >= o->turns;
}

/* A reply held back by "swap". */
typedef struct held {
    int on;
    Rlflow__EnvReply r;
    char obs[64], err[256];
} held;

static rf_status send_reply(rf_msg_client *c, held *h) {
    h->on = 0;
    return rf_msg_client_send(c, RF_MSG_ENV_REPLY, &h->r.base);
}

/* *dst = *src with the reply's strings pointing into dst's own room. */
static void copy_held(held *dst, const held *src) {
    *dst = *src;
    if (src->r.observation == src->obs) dst->r.observation = dst->obs;
    if (src->r.error == src->err) dst->r.error = dst->err;
}

static rf_status answer(rf_msg_client *c, const opts *o, const rf_msg *m, int k, held *h) {
    const char *fault = fault_of(o, k);
    if (!strcmp(fault, "die")) _exit(9);
    if (!strcmp(fault, "silent")) {
        sleep(60);
        _exit(0);
    }
    held now = {0};
    reply_to(o, m, &now.r, now.obs, now.err, sizeof now.err);
    if (!strcmp(fault, "garbage")) { /* tag EnvReply, request_id = 1, then field 2 claiming 127 bytes */
        const uint8_t bad[] = {RF_MSG_ENV_REPLY, 0x08, 0x01, 0x12, 0x7f, 'x'};
        return rf_msg_client_send_raw(c, bad, sizeof bad);
    }
    if (!strcmp(fault, "mute")) return RF_OK;
    if (!strcmp(fault, "nul") || !strcmp(fault, "donestr")) { /* tag, request_id, then the field */
        uint8_t bad[32] = {RF_MSG_ENV_REPLY, 0x08};
        size_t n = 2;
        for (uint64_t v = now.r.request_id; n < 14; v >>= 7) {
            bad[n++] = (uint8_t)(v & 0x7f) | (v >= 0x80 ? 0x80 : 0);
            if (v < 0x80) break;
        }
        const uint8_t nul[] = {0x12, 0x03, 'a', 0x00, 'b'}, done[] = {0x22, 0x03, 'y', 'e', 's'};
        memcpy(bad + n, !strcmp(fault, "nul") ? nul : done, 5);
        return rf_msg_client_send_raw(c, bad, n + 5);
    }
    if (!strcmp(fault, "badutf8")) now.r.observation = "<o\xff>";
    if (!strcmp(fault, "badtype")) {
        Rlflow__Shutdown sd = RLFLOW__SHUTDOWN__INIT;
        sd.reason = "not mine to send";
        return rf_msg_client_send(c, RF_MSG_SHUTDOWN, &sd.base);
    }
    if (!strcmp(fault, "nan")) now.r.reward = NAN;
    if (!strcmp(fault, "badid")) now.r.request_id += 1000000;
    if (!strcmp(fault, "error")) now.r.error = "cannot play this one";
    if (!strcmp(fault, "resetreward") && m->type == RF_MSG_ENV_RESET) now.r.reward = 1.0f;
    if (!strcmp(fault, "swap") && !h->on) { /* (holding one already: this one goes first) */
        copy_held(h, &now);
        h->on = 1;
        return RF_OK;
    }
    rf_status st = send_reply(c, &now);
    if (st == RF_OK && h->on) st = send_reply(c, h); /* the held one after this one */
    return st;
}

int main(int argc, char **argv) {
    opts o;
    if (!parse(argc, argv, &o)) {
        fprintf(stderr, "usage: %s [--connect ENDPOINT] [--name N] [--first TEXT] [--turns T] [--capacity C] "
                        "[--mode M] [--after K] [--every 0|1] [--reconnect 0|1] [--once FILE]\n", argv[0]);
        return 2;
    }
    void *ctx = zmq_ctx_new();
    rf_msg_client_config cfg = {.endpoint = o.endpoint, .role = RLFLOW__ROLE__ROLE_ENVIRONMENT,
                                .capacity = o.capacity, .name = o.name, .timeout_s = 10, .zmq_ctx = ctx};
    const char *own = env_key("RLFLOW_ENV_ENDPOINT");
    if (own && strcmp(own, o.endpoint) == 0) { /* started by rlflow: the run's keys */
        cfg.curve_server_key = env_key("RLFLOW_ENV_SERVER_KEY");
        cfg.curve_public_key = env_key("RLFLOW_ENV_PUBLIC_KEY");
        cfg.curve_secret_key = env_key("RLFLOW_ENV_SECRET_KEY");
    }
    rf_msg_client *c;
    if (rf_msg_client_connect(&c, &cfg) != RF_OK) {
        fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
        zmq_ctx_term(ctx);
        return 4;
    }
    int k = 0, rc = 0;
    held h = {0};
    for (;;) {
        rf_msg m;
        int got = 1;
        rf_status st = h.on ? rf_msg_client_try_recv(c, 0.3, &m, &got) : rf_msg_client_recv(c, 30, &m);
        if (st != RF_OK) {
            fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
            rc = 3;
            break;
        }
        if (!got) { /* nothing came while a reply was held: send it now */
            if (send_reply(c, &h) != RF_OK) fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
            continue;
        }
        if (m.type == RF_MSG_SHUTDOWN) {
            fprintf(stderr, "%s: shutdown: %s\n", o.name, ((Rlflow__Shutdown *)m.pb)->reason);
            rf_msg_free(&m);
            break;
        }
        if (m.type == RF_MSG_ERROR) {
            fprintf(stderr, "%s: rlflow says: %s\n", o.name, ((Rlflow__Error *)m.pb)->message);
            h.on = 0;
            if (o.reconnect) {
                rf_msg_free(&m);
                rf_msg_client_close(c);
                if (rf_msg_client_connect(&c, &cfg) != RF_OK) {
                    fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
                    zmq_ctx_term(ctx);
                    return 4;
                }
                continue;
            }
        } else if (m.type == RF_MSG_ENV_RESET || m.type == RF_MSG_ENV_STEP) {
            if (answer(c, &o, &m, ++k, &h) != RF_OK) fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
        }
        rf_msg_free(&m);
    }
    rf_msg_client_close(c);
    zmq_ctx_term(ctx);
    return rc;
}
