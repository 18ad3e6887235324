/* rlflow environment-program client library (see rlflow_env_client.h, docs/env-api.md), over
 * rlflow's message layer (common/msg.h: handshake, heartbeats, framing). */
#define _POSIX_C_SOURCE 200809L
#include "env/clients/c/rlflow_env_client.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/msg.h"

static const char *str(const char *s) { return s ? s : ""; }

static rf_env_client_reset reset_view(const Rlflow__EnvReset *m) {
    if (!m) return (rf_env_client_reset){.prompt = "", .ground_truth = "", .metadata_json = ""};
    return (rf_env_client_reset){m->request_id, m->episode_id, str(m->prompt), m->prompt_ids, m->n_prompt_ids,
                                 str(m->ground_truth), str(m->metadata_json), m->sample_index, m->group_id};
}

/* Calls the function for message m into r; the EnvReply to send into e. */
static void answer(const rf_msg *m, rf_env_client_reset_fn reset, rf_env_client_step_fn step, void *user,
                   rf_env_client_reply *r, Rlflow__EnvReply *e) {
    memset(r, 0, sizeof *r);
    rlflow__env_reply__init(e);
    int rc = 0, is_step = m->type == RF_MSG_ENV_STEP;
    if (!is_step) {
        rf_env_client_reset q = reset_view((const Rlflow__EnvReset *)m->pb);
        e->request_id = q.request_id;
        if (reset) rc = reset(&q, r, user);
    } else {
        const Rlflow__EnvStep *s = (const Rlflow__EnvStep *)m->pb;
        e->request_id = s->request_id;
        rf_env_client_turn *h = calloc(s->n_history + 1, sizeof *h);
        if (!h) {
            snprintf(r->error, sizeof r->error, "out of memory for %zu turns", s->n_history);
        } else {
            for (size_t k = 0; k < s->n_history; k++)
                h[k] = (rf_env_client_turn){str(s->history[k]->action), s->history[k]->action_ids,
                                            s->history[k]->n_action_ids, str(s->history[k]->observation),
                                            s->history[k]->reward};
            rf_env_client_step q = {s->request_id, s->episode_id, s->turn, str(s->action), s->action_ids,
                                    s->n_action_ids, str(s->finish), s->last, reset_view(s->reset),
                                    str(s->first_observation), h, s->n_history};
            rc = step(&q, r, user);
        }
        free(h);
    }
    if (rc != 0 && !r->error[0]) snprintf(r->error, sizeof r->error, "the function returned %d", rc);
    if (!r->error[0] && !isfinite(r->reward))
        snprintf(r->error, sizeof r->error, "the function answered reward %g; rewards must be finite", (double)r->reward);
    r->observation[sizeof r->observation - 1] = r->info[sizeof r->info - 1] = '\0';
    if (r->error[0]) {
        e->error = r->error;
        return;
    }
    e->observation = r->observation, e->reward = r->reward, e->done = r->done != 0, e->info = r->info;
}

/* One connection: 1 when rlflow dropped this program (reconnect), 0 on Shutdown, -1 on error. */
static int session(rf_msg_client *c, const rf_env_client_opts *o, rf_env_client_reset_fn reset,
                   rf_env_client_step_fn step, void *user, long *answered) {
    rf_env_client_reply *r = malloc(sizeof *r);
    if (!r) return rf_error(RF_ERR_NOMEM, "out of memory"), -1;
    int end = -1;
    for (;;) {
        rf_msg m;
        int got = 0;
        rf_status st = rf_msg_client_try_recv(c, 1.0, &m, &got);
        if (st == RF_ERR_FORMAT) { /* not ours to fix: say so and go on */
            if (!o->quiet) fprintf(stderr, "%s: %s\n", o->name, rf_error_message());
            continue;
        }
        if (st != RF_OK || (!got && rf_msg_client_disconnected(c))) { /* rlflow is gone: connect anew */
            if (!o->quiet) fprintf(stderr, "%s: the connection to rlflow at %s closed\n", o->name, o->connect);
            end = 1;
            break;
        }
        if (!got) continue; /* rlflow may be silent for long while it trains */
        if (m.type == RF_MSG_SHUTDOWN) {
            rf_msg_free(&m);
            end = 0;
            break;
        }
        if (m.type == RF_MSG_ERROR) {
            if (!o->quiet) fprintf(stderr, "%s: rlflow says: %s\n", o->name, str(((Rlflow__Error *)m.pb)->message));
            rf_msg_free(&m);
            end = 1;
            break;
        }
        if (m.type == RF_MSG_ENV_RESET || m.type == RF_MSG_ENV_STEP) {
            Rlflow__EnvReply e;
            answer(&m, reset, step, user, r, &e);
            rf_status st = rf_msg_client_send(c, RF_MSG_ENV_REPLY, &e.base);
            if (st == RF_OK && answered) (*answered)++;
        }
        rf_msg_free(&m);
    }
    free(r);
    return end;
}

static const char *env_nonempty(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* A program rlflow started (env.programs) finds its endpoint, keys and rank in the environment
 * (docs/env-api.md, "Programs started by rlflow"): the endpoint when opts names none, the keys
 * when the endpoint is that one and opts gives no key, the rank when opts leaves it 0. */
static void from_environment(rf_env_client_opts *o) {
    const char *ep = env_nonempty("RLFLOW_ENV_ENDPOINT"), *rank = env_nonempty("RLFLOW_ENV_RANK");
    if (!ep) return;
    if (!o->connect || !*o->connect) o->connect = ep;
    if (strcmp(o->connect, ep) == 0 && !o->curve_server_key && !o->curve_public_key && !o->curve_secret_key) {
        o->curve_server_key = env_nonempty("RLFLOW_ENV_SERVER_KEY");
        o->curve_public_key = env_nonempty("RLFLOW_ENV_PUBLIC_KEY");
        o->curve_secret_key = env_nonempty("RLFLOW_ENV_SECRET_KEY");
    }
    if (o->rank == 0 && rank) o->rank = atoi(rank);
}

rf_status rf_env_client_serve(const rf_env_client_opts *opts, rf_env_client_reset_fn reset,
                              rf_env_client_step_fn step, void *user, long *answered) {
    if (!opts || !step) return rf_error(RF_ERR_ARG, "rf_env_client_serve: options and a step function are needed");
    rf_env_client_opts o = *opts;
    from_environment(&o);
    if (!o.connect) o.connect = "tcp://127.0.0.1:5558";
    if (!o.name) o.name = "env_program";
    if (o.capacity < 0) return rf_error(RF_ERR_ARG, "rf_env_client_serve: capacity must be >= 0 (got %d)", o.capacity);
    if (!o.capacity) o.capacity = 4;
    if (!(o.hello_timeout_s >= 0)) return rf_error(RF_ERR_ARG, "rf_env_client_serve: hello_timeout_s must be >= 0");
    if (!o.hello_timeout_s) o.hello_timeout_s = 30;
    if (answered) *answered = 0;
    rf_msg_client_config cfg = {.endpoint = o.connect, .role = RLFLOW__ROLE__ROLE_ENVIRONMENT, .rank = o.rank,
                                .capacity = o.capacity, .name = o.name, .timeout_s = o.hello_timeout_s,
                                .curve_server_key = o.curve_server_key, .curve_public_key = o.curve_public_key,
                                .curve_secret_key = o.curve_secret_key, .monitor = 1};
    for (;;) {
        rf_msg_client *c;
        RF_TRY(rf_msg_client_connect(&c, &cfg));
        int end = session(c, &o, reset, step, user, answered);
        rf_msg_client_close(c);
        if (end < 0) return RF_ERR_NOMEM;
        if (end == 0) return RF_OK;
        if (o.no_reconnect) return rf_error(RF_ERR_IO, "%s: rlflow at %s dropped this program", o.name, o.connect);
    }
}
