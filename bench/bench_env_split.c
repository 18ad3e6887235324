/* The cost of a multi-turn episode's turn in a split run (controller/episodes_split.h,
 * docs/env-api.md section 16), printed as JSON lines: a rollout worker's EnvTurns through the
 * controller's message server, the controller's book and the built-in calculator, and the
 * EnvObservations back, against the same book and calculator called in process (what the
 * one-process loop pays for the same turns), measured in the same run.
 *
 * A "rollout worker" thread connects to a message server over tcp://127.0.0.1 (rf_msg_client,
 * role ROLE_ROLLOUT). Each round is a group of `batch` episodes (request id = round): the
 * worker sends one EnvTurns holding every episode's turn 0, a tool call "<calc>48211*39077"
 * (24 ids); the controller opens the group (reset: one batch call), answers every turn (one
 * batch call; each gets the 12 ids of "<result>1883941047</result>"), sends the
 * EnvObservations and forgets the group. In process the same rounds run without messages.
 *   split_turns_per_s     turns answered per second through the messages
 *   inproc_turns_per_s    the same rounds in process
 *   us_per_turn           microseconds per turn through the messages
 *   ratio_vs_inproc       split_turns_per_s / inproc_turns_per_s
 * Usage: bench_env_split [--seconds S] (default 1 per configuration). */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/msg.h"
#include "common/util.h"
#include "controller/episodes_split.h"
#include "controller/run_internal.h"
#include "env/calculator.h"
#include "model/byte_tokenizer.h"

static char g_ep[256];
static int g_batch;
static volatile int g_stop;
static int32_t g_ids[24];

_Noreturn static void die(const char *what) {
    fprintf(stderr, "bench_env_split: %s: %s\n", what, rf_error_message());
    exit(1);
}

/* The EnvTurns of round `req`: turn 0 of each of g_batch episodes. */
static void send_turns(rf_msg_client *c, uint64_t req, Rlflow__EndedTurn *t, Rlflow__EndedTurn **p) {
    for (int i = 0; i < g_batch; i++) {
        rlflow__ended_turn__init(&t[i]);
        t[i].request_id = req, t[i].index = i, t[i].turn = 0, t[i].ids = g_ids, t[i].n_ids = 24;
        t[i].text = "I call it: <calc>48211*39077", t[i].finish = "stop", t[i].used = 24;
        p[i] = &t[i];
    }
    Rlflow__EnvTurns m = RLFLOW__ENV_TURNS__INIT;
    m.n_turns = (size_t)g_batch, m.turns = p;
    if (rf_msg_client_send(c, RF_MSG_ENV_TURNS, &m.base) != RF_OK) die("sending EnvTurns");
}

/* The rollout worker: one round at a time until g_stop. */
static void *worker(void *arg) {
    (void)arg;
    rf_msg_client_config cfg = {.endpoint = g_ep, .role = RLFLOW__ROLE__ROLE_ROLLOUT, .name = "bench", .timeout_s = 10};
    rf_msg_client *c;
    if (rf_msg_client_connect(&c, &cfg) != RF_OK) die("connecting");
    Rlflow__EndedTurn *t = calloc((size_t)g_batch, sizeof *t), **p = calloc((size_t)g_batch, sizeof *p);
    for (uint64_t req = 1; !g_stop; req++) {
        send_turns(c, req, t, p);
        for (;;) {
            rf_msg m;
            if (rf_msg_client_recv(c, 10, &m) != RF_OK) die("waiting for EnvObservations");
            int done = m.type == RF_MSG_ENV_OBSERVATIONS;
            if (done && ((Rlflow__EnvObservations *)m.pb)->n_answers != (size_t)g_batch) die("a short answer");
            rf_msg_free(&m);
            if (done) break;
        }
    }
    free(t), free(p);
    rf_msg_client_close(c);
    return NULL;
}

/* One round on the controller's side: open the group, answer its turns, forget it. */
static void round_of(rf_split_eps *x, const rf_example *ex, const Rlflow__EnvTurns *m, Rlflow__EnvObservations *reply) {
    Rlflow__GenerateRequest q = RLFLOW__GENERATE_REQUEST__INIT;
    q.request_id = m->turns[0]->request_id, q.n = g_batch;
    if (rf_split_eps_begin(x, &q, ex, g_batch, 0) != RF_OK) die("opening a group");
    if (rf_split_eps_turns(x, "bench", m, reply) != RF_OK) die("answering turns");
}

/* Turns per second in process over `seconds`. */
static double inproc_rate(rf_split_eps *x, const rf_example *ex, double seconds) {
    Rlflow__EndedTurn *t = calloc((size_t)g_batch, sizeof *t), **p = calloc((size_t)g_batch, sizeof *p);
    long n = 0;
    double t0 = rf_time_now(), dt;
    for (uint64_t req = 1 << 30;; req++) {
        for (int i = 0; i < g_batch; i++) {
            rlflow__ended_turn__init(&t[i]);
            t[i].request_id = req, t[i].index = i, t[i].ids = g_ids, t[i].n_ids = 24;
            t[i].text = "I call it: <calc>48211*39077", t[i].finish = "stop", t[i].used = 24;
            p[i] = &t[i];
        }
        Rlflow__EnvTurns m = RLFLOW__ENV_TURNS__INIT;
        m.n_turns = (size_t)g_batch, m.turns = p;
        Rlflow__EnvObservations reply;
        round_of(x, ex, &m, &reply);
        rf_split_eps_reply_free(&reply);
        rf_split_eps_forget(x, req);
        n += g_batch;
        if ((dt = rf_time_now() - t0) >= seconds) break;
    }
    free(t), free(p);
    return (double)n / dt;
}

/* Turns per second through the messages over `seconds`. */
static double split_rate(rf_split_eps *x, const rf_example *ex, double seconds) {
    rf_msg_server *srv;
    rf_msg_server_config sc = {.accept_role = RLFLOW__ROLE__ROLE_ROLLOUT, .peer_timeout_s = 30};
    if (rf_msg_server_open(&srv, "tcp://127.0.0.1:*", &sc) != RF_OK) die("binding");
    snprintf(g_ep, sizeof g_ep, "%s", rf_msg_server_endpoint(srv));
    g_stop = 0;
    pthread_t th;
    pthread_create(&th, NULL, worker, NULL);
    long n = 0;
    double t0 = 0, dt = 0;
    for (;;) {
        rf_msg_event ev;
        if (rf_msg_server_poll(srv, 1.0, &ev) != RF_OK) die("polling");
        if (ev.kind == RF_MSG_EV_JOINED) t0 = rf_time_now();
        if (ev.kind != RF_MSG_EV_MESSAGE) continue;
        if (ev.msg.type == RF_MSG_ENV_TURNS) {
            const Rlflow__EnvTurns *m = (const Rlflow__EnvTurns *)ev.msg.pb;
            Rlflow__EnvObservations reply;
            round_of(x, ex, m, &reply);
            if (rf_msg_server_send(srv, ev.peer, RF_MSG_ENV_OBSERVATIONS, &reply.base) != RF_OK) die("answering");
            rf_split_eps_reply_free(&reply);
            rf_split_eps_forget(x, m->turns[0]->request_id);
            n += g_batch;
            if ((dt = rf_time_now() - t0) >= seconds) g_stop = 1;
        }
        rf_msg_free(&ev.msg);
        if (g_stop) break;
    }
    /* the worker's last round is answered so that it sees g_stop */
    for (int k = 0; k < 50; k++) {
        rf_msg_event ev;
        if (rf_msg_server_poll(srv, 0.1, &ev) != RF_OK || ev.kind != RF_MSG_EV_MESSAGE) continue;
        if (ev.msg.type == RF_MSG_ENV_TURNS) {
            const Rlflow__EnvTurns *m = (const Rlflow__EnvTurns *)ev.msg.pb;
            Rlflow__EnvObservations reply;
            round_of(x, ex, m, &reply);
            rf_msg_server_send(srv, ev.peer, RF_MSG_ENV_OBSERVATIONS, &reply.base);
            rf_split_eps_reply_free(&reply);
            rf_split_eps_forget(x, m->turns[0]->request_id);
            rf_msg_free(&ev.msg);
            break;
        }
        rf_msg_free(&ev.msg);
    }
    pthread_join(th, NULL);
    rf_msg_server_close(srv, "done");
    return (double)n / dt;
}

int main(int argc, char **argv) {
    double seconds = argc == 3 && !strcmp(argv[1], "--seconds") ? atof(argv[2]) : 1.0;
    char dir[] = "/tmp/rf_bench_env_split_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    rf_tokenizer *tok;
    if (rf_byte_tokenizer_write(dir) != RF_OK || rf_tokenizer_load_dir(&tok, dir) != RF_OK) die("tokenizer");
    const char *ov[] = {"env.type=calculator", "env.max_turns=4", "env.max_total_tokens=256"};
    rf_recipe r;
    if (rf_recipe_load(&r, NULL, ov, 3) != RF_OK) die("recipe");
    rf_run run = {.r = &r, .tok = tok};
    if (rf__rules_init(&r, &run.rules) != RF_OK || rf_calculator_env(&run.env) != RF_OK) die("run");
    rf_split_eps *x;
    if (rf_split_eps_open(&x, &run) != RF_OK) die("book");
    int32_t prompt[11];
    for (int i = 0; i < 11; i++) prompt[i] = 48 + i;
    for (int i = 0; i < 24; i++) g_ids[i] = 60 + i;
    cJSON *extra = cJSON_CreateObject();
    rf_example ex = {.prompt_text = "48211*39077=", .prompt_ids = prompt, .n_prompt = 11, .answer = "1883941047",
                     .extra = extra};
    static const int batches[] = {1, 16, 128};
    for (size_t b = 0; b < 3; b++) {
        g_batch = batches[b];
        inproc_rate(x, &ex, seconds / 5); /* warm up */
        double ip = inproc_rate(x, &ex, seconds), sp = split_rate(x, &ex, seconds);
        printf("{\"bench\": \"env_split\", \"batch\": %d, \"split_turns_per_s\": %.0f, \"inproc_turns_per_s\": %.0f, "
               "\"us_per_turn\": %.2f, \"ratio_vs_inproc\": %.4f}\n", g_batch, sp, ip, 1e6 / sp, sp / ip);
        fflush(stdout);
    }
    rf_split_eps_close(x);
    rf_env_close(&run.env);
    rf_reward_rules_free(run.rules);
    rf_tokenizer_free(tok);
    rf_recipe_free(&r);
    cJSON_Delete(extra);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : 1;
}
