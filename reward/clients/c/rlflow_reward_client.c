/* rlflow reward-program client library (see rlflow_reward_client.h, docs/reward-api.md).
 *
 * The calling thread owns the DEALER socket; requests go to a FIFO that `threads` workers
 * take from; a worker puts its finished job on the done list and writes one byte to a pipe,
 * which the calling thread polls next to the socket. Every job carries the number of the
 * session (connection) it came from, so an answer computed for a connection that is gone is
 * dropped instead of being sent on the next one (where its request id means nothing). */
#define _POSIX_C_SOURCE 200809L
#include "reward/clients/c/rlflow_reward_client.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/msg.h"
#include "common/util.h"

typedef struct job {
    struct job *next;
    uint64_t session;
    rf_msg msg;            /* the RewardRequest, owned */
    rf_reward_result res;
} job;

typedef struct pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *todo, *todo_tail; /* FIFO of requests not started */
    job *done;             /* finished, not sent yet */
    int quit;
    int wake[2];           /* pipe: one byte per finished job */
    pthread_t *th;
    int n_th;
    rf_reward_score_fn fn;
    void *user;
} pool;

typedef enum { END_SHUTDOWN, END_STOP, END_LOST } session_end;

typedef struct client {
    rf_reward_client_opts o;
    pool p;
    uint64_t session;
    long scored;
} client;

static void say(const client *cl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(const client *cl, const char *fmt, ...) {
    if (cl->o.quiet) return;
    char line[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s\n", cl->o.name, line);
}

int rf_reward_result_component(rf_reward_result *r, const char *name, float value) {
    if (!r || !name || !*name || strlen(name) >= RF_REWARD_NAME_LEN ||
        r->n_components >= RF_REWARD_MAX_COMPONENTS)
        return -1;
    snprintf(r->components[r->n_components].name, RF_REWARD_NAME_LEN, "%s", name);
    r->components[r->n_components++].value = value;
    return 0;
}

int rf_reward_result_token_rewards(rf_reward_result *r, const float *v, size_t n) {
    if (!r || (n > 0 && !v)) return -1;
    float *copy = NULL;
    if (n > 0) {
        copy = malloc(sizeof *copy * n);
        if (!copy) return -1;
        memcpy(copy, v, sizeof *copy * n);
    }
    free(r->token_rewards);
    r->token_rewards = copy, r->n_token_rewards = n;
    return 0;
}

rf_status rf_reward_client_read_key(const char *path, char key[41]) {
    return rf_curve_read_key(path, 0, key);
}

/* ---- scoring on the worker threads -------------------------------------------------------- */

/* Per-token rewards rlflow would reject become the result's error instead, with the score
 * function named as the culprit (rlflow's own sentence would blame the program). */
static void check_token_rewards(rf_reward_result *r, size_t n_ids) {
    size_t n = r->token_rewards ? r->n_token_rewards : 0;
    if (n && n != n_ids) {
        snprintf(r->error, sizeof r->error, "the score function returned %zu per-token rewards "
                 "for a response of %zu token%s", n, n_ids, n_ids == 1 ? "" : "s");
        return;
    }
    for (size_t k = 0; k < n; k++)
        if (!isfinite(r->token_rewards[k])) {
            snprintf(r->error, sizeof r->error, "the score function returned a non-finite "
                     "per-token reward (%g at token %zu)", (double)r->token_rewards[k], k);
            return;
        }
}

static void score_job(pool *p, job *j) {
    const Rlflow__RewardRequest *q = (const Rlflow__RewardRequest *)j->msg.pb;
    rf_reward_request req = {
        .request_id = q->request_id,
        .prompt = q->prompt ? q->prompt : "",
        .response = q->response ? q->response : "",
        .prompt_ids = q->prompt_ids, .n_prompt_ids = q->n_prompt_ids,
        .response_ids = q->response_ids, .n_response_ids = q->n_response_ids,
        .ground_truth = q->ground_truth ? q->ground_truth : "",
        .metadata_json = q->metadata_json ? q->metadata_json : "",
        .sample_index = q->sample_index, .group_id = q->group_id,
    };
    rf_reward_result *r = &j->res;
    memset(r, 0, sizeof *r);
    int rc = p->fn(&req, r, p->user);
    /* the function may have filled a buffer to its last byte */
    r->info[RF_REWARD_INFO_LEN - 1] = r->error[RF_REWARD_INFO_LEN - 1] = '\0';
    if (r->n_components < 0 || r->n_components > RF_REWARD_MAX_COMPONENTS) r->n_components = 0;
    for (int i = 0; i < r->n_components; i++) r->components[i].name[RF_REWARD_NAME_LEN - 1] = '\0';
    if (rc != 0 && !r->error[0]) snprintf(r->error, sizeof r->error, "score function returned %d", rc);
    if (rc == 0 && !r->error[0] && !isfinite(r->reward))
        snprintf(r->error, sizeof r->error, "the score function returned a non-finite reward (%g)",
                 (double)r->reward);
    if (!r->error[0]) check_token_rewards(r, q->n_response_ids);
}

static void *worker(void *arg) {
    pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->todo && !p->quit) pthread_cond_wait(&p->cv, &p->mu);
        job *j = p->todo;
        if (j) {
            p->todo = j->next;
            if (!p->todo) p->todo_tail = NULL;
        }
        pthread_mutex_unlock(&p->mu);
        if (!j) return NULL;  /* quit and nothing left */
        score_job(p, j);
        pthread_mutex_lock(&p->mu);
        j->next = p->done, p->done = j;
        pthread_mutex_unlock(&p->mu);
        /* a full pipe already holds a wake-up: EAGAIN is fine */
        if (write(p->wake[1], "x", 1) < 0 && errno != EAGAIN) { /* nothing to do */ }
    }
}

static void free_jobs(job *j) {
    while (j) {
        job *next = j->next;
        rf_msg_free(&j->msg);
        free(j->res.token_rewards);
        free(j);
        j = next;
    }
}

static rf_status pool_start(pool *p, int n, rf_reward_score_fn fn, void *user) {
    memset(p, 0, sizeof *p);
    p->fn = fn, p->user = user, p->wake[0] = p->wake[1] = -1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (pipe(p->wake) != 0)
        return rf_error(RF_ERR_IO, "reward client: pipe: %s", strerror(errno));
    for (int i = 0; i < 2; i++) fcntl(p->wake[i], F_SETFL, fcntl(p->wake[i], F_GETFL) | O_NONBLOCK);
    p->th = rf_calloc((size_t)n, sizeof *p->th);
    if (!p->th) return RF_ERR_NOMEM;
    for (; p->n_th < n; p->n_th++)
        if (pthread_create(&p->th[p->n_th], NULL, worker, p) != 0)
            return rf_error(RF_ERR_IO, "reward client: cannot start scoring thread %d of %d",
                            p->n_th + 1, n);
    return RF_OK;
}

/* Stops the workers (each finishes the job it holds) and frees everything. */
static void pool_stop(pool *p) {
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    free_jobs(p->todo);
    p->todo = p->todo_tail = NULL;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_th; i++) pthread_join(p->th[i], NULL);
    free_jobs(p->done);
    free(p->th);
    for (int i = 0; i < 2; i++)
        if (p->wake[i] >= 0) close(p->wake[i]);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

static void pool_push(pool *p, job *j) {
    pthread_mutex_lock(&p->mu);
    j->next = NULL;
    if (p->todo_tail) p->todo_tail->next = j;
    else p->todo = j;
    p->todo_tail = j;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Requests of a finished session that no worker started: rlflow re-sends them elsewhere. */
static int pool_drop_todo(pool *p) {
    pthread_mutex_lock(&p->mu);
    job *j = p->todo;
    p->todo = p->todo_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    int n = 0;
    for (job *k = j; k; k = k->next) n++;
    free_jobs(j);
    return n;
}

/* ---- one session: the socket side on the calling thread ----------------------------------- */

static rf_status send_result(rf_msg_client *c, const job *j) {
    const Rlflow__RewardRequest *q = (const Rlflow__RewardRequest *)j->msg.pb;
    const rf_reward_result *r = &j->res;
    Rlflow__RewardResponse m = RLFLOW__REWARD_RESPONSE__INIT;
    Rlflow__RewardResponse__ComponentsEntry ent[RF_REWARD_MAX_COMPONENTS];
    Rlflow__RewardResponse__ComponentsEntry *ptr[RF_REWARD_MAX_COMPONENTS];
    m.request_id = q->request_id;
    if (r->error[0]) {
        m.error = (char *)r->error;
    } else {
        m.reward = r->reward;
        for (int i = 0; i < r->n_components; i++) {
            Rlflow__RewardResponse__ComponentsEntry e =
                RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT;
            ent[i] = e;
            ent[i].key = (char *)r->components[i].name, ent[i].value = r->components[i].value;
            ptr[i] = &ent[i];
        }
        m.components = ptr, m.n_components = (size_t)r->n_components;
        m.info = (char *)r->info;
        if (r->token_rewards) m.token_rewards = r->token_rewards, m.n_token_rewards = r->n_token_rewards;
    }
    return rf_msg_client_send(c, RF_MSG_REWARD_RESPONSE, &m.base);
}

/* Sends the finished jobs of this session; drops those of sessions that are gone. */
static rf_status flush_done(client *cl, rf_msg_client *c) {
    char buf[256];
    while (read(cl->p.wake[0], buf, sizeof buf) > 0) {}
    pthread_mutex_lock(&cl->p.mu);
    job *j = cl->p.done;
    cl->p.done = NULL;
    pthread_mutex_unlock(&cl->p.mu);
    rf_status st = RF_OK;
    for (job *k = j; k; k = k->next) {
        if (k->session != cl->session || st != RF_OK) continue;
        st = send_result(c, k);
        if (st == RF_OK) cl->scored++;
    }
    free_jobs(j);
    return st;
}

/* Takes one message from rlflow: a request goes to the workers; the rest ends the session or
 * is reported. *end is set when the session is over. */
static rf_status on_message(client *cl, rf_msg *m, int *ended, session_end *end) {
    switch (m->type) {
    case RF_MSG_REWARD_REQUEST: {
        job *j = rf_calloc(1, sizeof *j);
        if (!j) return RF_ERR_NOMEM;
        j->session = cl->session, j->msg = *m;
        m->pb = NULL;
        pool_push(&cl->p, j);
        return RF_OK;
    }
    case RF_MSG_SHUTDOWN:
        say(cl, "shutdown (%s) after %ld requests", ((Rlflow__Shutdown *)m->pb)->reason, cl->scored);
        *ended = 1, *end = END_SHUTDOWN;
        return RF_OK;
    case RF_MSG_ERROR:
        /* rlflow sends Error when it drops a program, or to one it no longer knows */
        say(cl, "rlflow says: %s", ((Rlflow__Error *)m->pb)->message);
        *ended = 1, *end = END_LOST;
        return RF_OK;
    default:
        say(cl, "ignoring a %s from rlflow", rf_msg_type_name(m->type));
        return RF_OK;
    }
}

/* Reads every message pending on the socket (pings are answered inside try_recv). */
static rf_status drain_socket(client *cl, rf_msg_client *c, int *ended, session_end *end) {
    for (int got = 1; got && !*ended;) {
        rf_msg m = {0};
        rf_status st = rf_msg_client_try_recv(c, 0, &m, &got);
        if (st == RF_ERR_FORMAT) {  /* a frame that does not decode: report, keep serving */
            say(cl, "%s", rf_error_message());
            got = 1;
            continue;
        }
        RF_TRY(st);
        if (got) st = on_message(cl, &m, ended, end);
        rf_msg_free(&m);
        RF_TRY(st);
    }
    return RF_OK;
}

static rf_status serve_session(client *cl, rf_msg_client *c, session_end *end) {
    const rf_reward_client_opts *o = &cl->o;
    double last_heard = rf_time_now();
    for (int ended = 0;;) {
        if (o->stop && *o->stop) {
            *end = END_STOP;
            return RF_OK;
        }
        zmq_pollitem_t it[2] = {{rf_msg_client_socket(c), 0, ZMQ_POLLIN, 0},
                                {NULL, cl->p.wake[0], ZMQ_POLLIN, 0}};
        if (zmq_poll(it, 2, 250) < 0 && zmq_errno() != EINTR)
            return rf_error(RF_ERR_IO, "polling rlflow at %s: %s", o->connect,
                            zmq_strerror(zmq_errno()));
        if (it[1].revents & ZMQ_POLLIN) RF_TRY(flush_done(cl, c));
        if (it[0].revents & ZMQ_POLLIN) {
            last_heard = rf_time_now();
            RF_TRY(drain_socket(cl, c, &ended, end));
            if (ended) return RF_OK;
        }
        if (rf_msg_client_disconnected(c)) {
            /* what rlflow sent before it closed (a Shutdown) may still wait in the socket:
             * the monitor's event can overtake it */
            RF_TRY(drain_socket(cl, c, &ended, end));
            if (ended) return RF_OK;
            say(cl, "rlflow at %s closed the connection", o->connect);
            *end = END_LOST;
            return RF_OK;
        }
        if (o->idle_exit_s > 0 && rf_time_now() - last_heard > o->idle_exit_s)
            return rf_error(RF_ERR_IO, "nothing from rlflow at %s for %.1f s (idle_exit_s)",
                            o->connect, o->idle_exit_s);
    }
}

/* ---- serve ---------------------------------------------------------------------------------- */

static rf_status check_opts(const rf_reward_client_opts *o, rf_reward_score_fn fn) {
    if (!fn) return rf_error(RF_ERR_ARG, "reward client: no score function");
    if (o->threads < 0 || o->threads > 1024)
        return rf_error(RF_ERR_ARG, "reward client: threads must be in [0, 1024] (got %d)", o->threads);
    if (o->capacity < 0)
        return rf_error(RF_ERR_ARG, "reward client: capacity must be >= 0 (got %d)", o->capacity);
    if (!(o->hello_timeout_s >= 0) || !isfinite(o->hello_timeout_s))
        return rf_error(RF_ERR_ARG, "reward client: hello_timeout_s must be >= 0 (got %g)",
                        o->hello_timeout_s);
    if (!(o->idle_exit_s >= 0) || !isfinite(o->idle_exit_s))
        return rf_error(RF_ERR_ARG, "reward client: idle_exit_s must be >= 0 (got %g)",
                        o->idle_exit_s);
    if (o->name && strlen(o->name) > 63)
        return rf_error(RF_ERR_ARG, "reward client: name \"%s\" is longer than 63 bytes", o->name);
    if ((o->curve_public_key || o->curve_secret_key) && !o->curve_server_key)
        return rf_error(RF_ERR_ARG, "reward client: a CURVE key pair without rlflow's public key "
                                    "(curve_server_key)");
    return RF_OK;
}

static const char *env_nonempty(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* A program rlflow started (reward.programs) finds its endpoint, keys and rank in the
 * environment (docs/reward-api.md, "Programs started by rlflow"): the endpoint when opts names
 * none, the keys when the endpoint is that one and opts gives no key, the rank when opts
 * leaves it 0. */
static void from_environment(rf_reward_client_opts *o) {
    const char *ep = env_nonempty("RLFLOW_REWARD_ENDPOINT"), *rank = env_nonempty("RLFLOW_REWARD_RANK");
    if (!ep) return;
    if (!o->connect || !*o->connect) o->connect = ep;
    if (strcmp(o->connect, ep) == 0 && !o->curve_server_key && !o->curve_public_key && !o->curve_secret_key) {
        o->curve_server_key = env_nonempty("RLFLOW_REWARD_SERVER_KEY");
        o->curve_public_key = env_nonempty("RLFLOW_REWARD_PUBLIC_KEY");
        o->curve_secret_key = env_nonempty("RLFLOW_REWARD_SECRET_KEY");
    }
    if (o->rank == 0 && rank) o->rank = atoi(rank);
}

static rf_status connect_once(client *cl, rf_msg_client **c) {
    const rf_reward_client_opts *o = &cl->o;
    rf_msg_client_config cfg = {
        .endpoint = o->connect, .role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM, .rank = o->rank,
        .capacity = o->capacity, .name = o->name, .timeout_s = o->hello_timeout_s,
        .protocol_version = o->protocol_version, .curve_server_key = o->curve_server_key,
        .curve_public_key = o->curve_public_key, .curve_secret_key = o->curve_secret_key,
        .monitor = 1};
    RF_TRY(rf_msg_client_connect(c, &cfg));
    double hb, to;
    rf_msg_client_timing(*c, &hb, &to);
    say(cl, "connected to %s%s (protocol %d, capacity %d, %d thread%s; rlflow pings every %.2f s)",
        o->connect, o->curve_server_key ? " with CURVE" : "", RF_PROTOCOL_VERSION, o->capacity,
        o->threads, o->threads == 1 ? "" : "s", hb);
    return RF_OK;
}

rf_status rf_reward_client_serve(const rf_reward_client_opts *opts, rf_reward_score_fn score,
                                 void *user) {
    if (!opts) return rf_error(RF_ERR_ARG, "reward client: no options");
    RF_TRY(check_opts(opts, score));
    client *cl = rf_calloc(1, sizeof *cl);
    if (!cl) return RF_ERR_NOMEM;
    cl->o = *opts;
    rf_reward_client_opts *o = &cl->o;
    from_environment(o);
    if (!o->connect || !*o->connect) o->connect = "tcp://127.0.0.1:5557";
    if (!o->name || !*o->name) o->name = "reward_program";
    if (!o->threads) o->threads = 1;
    if (!o->capacity) o->capacity = 2 * o->threads;
    if (!o->hello_timeout_s) o->hello_timeout_s = 30;
    rf_status st = pool_start(&cl->p, o->threads, score, user);
    for (session_end end = END_LOST; st == RF_OK && end == END_LOST;) {
        cl->session++;
        rf_msg_client *c = NULL;
        st = connect_once(cl, &c);
        if (st != RF_OK && cl->session > 1)
            st = rf_error_wrap(st, "reconnecting after the connection was lost");
        if (st == RF_OK) st = serve_session(cl, c, &end);
        rf_msg_client_close(c);
        int dropped = pool_drop_todo(&cl->p);
        if (st == RF_OK && end == END_LOST) {
            if (o->no_reconnect) {
                st = rf_error(RF_ERR_IO, "the connection to rlflow at %s was lost (no_reconnect)",
                              o->connect);
            } else {
                say(cl, "reconnecting to %s (%d unstarted request%s left to rlflow)", o->connect,
                    dropped, dropped == 1 ? "" : "s");
            }
        }
    }
    pool_stop(&cl->p);
    free(cl);
    return st;
}
