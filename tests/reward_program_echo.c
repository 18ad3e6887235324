/* A reward program in C for the tests (and a model for C clients): connects to rlflow with
 * rf_msg_client, answers RewardRequests with a reward anyone can recompute, exits on Shutdown.
 *
 *   reward = n_response_ids + 0.01 * strlen(response) + (response == ground_truth ? 100 : 0)
 *   info   = "echo <name> n=<n_response_ids>", component "len" = n_response_ids
 *
 * Fault modes, for the tests (--after K: the fault hits the K-th request, counted from 1):
 *   ok       answer everything
 *   nan      answer NaN to the K-th request
 *   die      exit abruptly (no answer, no goodbye) on the K-th request
 *   silent   stop reading and answering at the K-th request (sleeps 60 s, then exits)
 *   badid    answer the K-th request with an id nobody sent
 *   garbage  answer the K-th request with bytes that do not decode as a RewardResponse
 *   error    answer the K-th request with RewardResponse.error set
 * --protocol V claims protocol V in Hello (a mismatch test).
 *
 * Usage: reward_program_echo --connect EP [--name N] [--mode M] [--after K] [--capacity C]
 *                            [--protocol V] [--delay-ms D]
 * Exit: 0 after Shutdown, 2 bad usage, 3 rlflow silent for 30 s, 4 connection refused. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/msg.h"

typedef struct opts {
    const char *endpoint, *name, *mode;
    int after, capacity, protocol, delay_ms;
} opts;

static int parse(int argc, char **argv, opts *o) {
    *o = (opts){NULL, "echo", "ok", 1 << 30, 4, 0, 0};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--connect")) o->endpoint = v;
        else if (!strcmp(k, "--name")) o->name = v;
        else if (!strcmp(k, "--mode")) o->mode = v;
        else if (!strcmp(k, "--after")) o->after = atoi(v);
        else if (!strcmp(k, "--capacity")) o->capacity = atoi(v);
        else if (!strcmp(k, "--protocol")) o->protocol = atoi(v);
        else if (!strcmp(k, "--delay-ms")) o->delay_ms = atoi(v);
        else return 0;
    }
    return o->endpoint != NULL;
}

static rf_status answer(rf_msg_client *c, const opts *o, const Rlflow__RewardRequest *q, int k) {
    int fault = k == o->after;
    if (o->delay_ms > 0) nanosleep(&(struct timespec){0, o->delay_ms * 1000000L}, NULL);
    if (fault && !strcmp(o->mode, "die")) _exit(9);
    if (fault && !strcmp(o->mode, "silent")) {
        sleep(60);
        _exit(0);
    }
    Rlflow__RewardResponse r = RLFLOW__REWARD_RESPONSE__INIT;
    Rlflow__RewardResponse__ComponentsEntry len = RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT;
    Rlflow__RewardResponse__ComponentsEntry *comps[1] = {&len};
    char info[128];
    float n = (float)q->n_response_ids;
    r.request_id = q->request_id;
    r.reward = n + 0.01f * (float)strlen(q->response) +
               (strcmp(q->response, q->ground_truth) == 0 ? 100.0f : 0.0f);
    len.key = "len", len.value = n;
    r.components = comps, r.n_components = 1;
    snprintf(info, sizeof info, "echo %s n=%zu", o->name, q->n_response_ids);
    r.info = info;
    if (fault && !strcmp(o->mode, "nan")) r.reward = NAN;
    if (fault && !strcmp(o->mode, "badid")) r.request_id += 1000000;
    if (fault && !strcmp(o->mode, "error")) r.error = "cannot judge this one";
    if (fault && !strcmp(o->mode, "garbage")) {
        /* tag 17, request_id = 1, then field 4 (info) claiming 127 bytes where 1 follows */
        const uint8_t bad[] = {RF_MSG_REWARD_RESPONSE, 0x08, 0x01, 0x22, 0x7f, 'x'};
        return rf_msg_client_send_raw(c, bad, sizeof bad);
    }
    return rf_msg_client_send(c, RF_MSG_REWARD_RESPONSE, &r.base);
}

int main(int argc, char **argv) {
    opts o;
    if (!parse(argc, argv, &o)) {
        fprintf(stderr, "usage: %s --connect ENDPOINT [--name N] [--mode M] [--after K] "
                        "[--capacity C] [--protocol V] [--delay-ms D]\n", argv[0]);
        return 2;
    }
    void *ctx = zmq_ctx_new();  /* a caller-owned context, as an embedding program would */
    rf_msg_client_config cfg = {.endpoint = o.endpoint, .role = RLFLOW__ROLE__ROLE_REWARD_PROGRAM,
                                .capacity = o.capacity, .name = o.name, .timeout_s = 10,
                                .protocol_version = (uint32_t)o.protocol, .zmq_ctx = ctx};
    rf_msg_client *c;
    if (rf_msg_client_connect(&c, &cfg) != RF_OK) {
        fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
        zmq_ctx_term(ctx);
        return 4;
    }
    int k = 0, rc = 0;
    for (;;) {
        rf_msg m;
        if (rf_msg_client_recv(c, 30, &m) != RF_OK) {
            fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
            rc = 3;
            break;
        }
        if (m.type == RF_MSG_SHUTDOWN) {
            rf_msg_free(&m);
            break;
        }
        if (m.type == RF_MSG_ERROR) {
            fprintf(stderr, "%s: rlflow says: %s\n", o.name, ((Rlflow__Error *)m.pb)->message);
        } else if (m.type == RF_MSG_REWARD_REQUEST) {
            if (answer(c, &o, (Rlflow__RewardRequest *)m.pb, ++k) != RF_OK)
                fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
        }
        rf_msg_free(&m);
    }
    rf_msg_client_close(c);
    zmq_ctx_term(ctx);
    return rc;
}
