/* A reward program in C for the tests (and a model for C clients): connects to rlflow with
 * rf_msg_client, answers RewardRequests with a reward anyone can recompute, exits on Shutdown.
 *
 *   reward = n_response_ids + 0.01 * strlen(response) + (response == ground_truth ? 100 : 0)
 *   info   = "echo <name> n=<n_response_ids>", component "len" = n_response_ids
 *   token_rewards (with --tokens 1) = response_ids[j] * 0.5 + 0.25 * j, one per response token
 *   with --score prompt: reward = n_prompt_ids instead (what the program was told the model saw
 *   before the response: an episode's prompt and first observation)
 *
 * Fault modes, for the tests (--after K: the fault hits the K-th request, counted from 1 over
 * every connection):
 *   ok        answer everything
 *   nan       answer NaN to the K-th request
 *   die       exit abruptly (no answer, no goodbye) on the K-th request
 *   silent    stop reading and answering at the K-th request (sleeps 60 s, then exits)
 *   badid     answer the K-th request with an id nobody sent
 *   duplicate answer the K-th request twice
 *   garbage   answer the K-th request with bytes that do not decode as a RewardResponse
 *   error     answer the K-th request with RewardResponse.error set
 *   badtokens answer the K-th request with n_response_ids + 1 per-token rewards
 *   inftoken  answer the K-th request with +inf as its last per-token reward
 *   badtype   answer the K-th request with a Shutdown, which a reward program may not send
 *   big       answer the K-th request with reward 3e38 (finite; overflows at weight 2)
 *   bigtoken  answer the K-th request with 3e38 as its last per-token reward
 *   compnan   answer the K-th request with a NaN component "len"
 *   longname  answer the K-th request with a component whose name is 64 bytes
 *   huge      answer the K-th request with an info of 64 MiB + 1 bytes (over rlflow's limit)
 *   mute      keep the K-th request and never answer it (pings still answered)
 *   badutf8   answer the K-th request with an info that is not UTF-8 ("\xff")
 * --mode A,B,C: the K-th request gets fault A, the next one B, then C; --every 1 repeats the
 * list for every later request. --reconnect 1: after an Error from rlflow (it dropped this
 * program), connect again with a fresh socket, as the client libraries do.
 * --protocol V claims protocol V in Hello (a mismatch test).
 *
 * Usage: reward_program_echo --connect EP [--name N] [--mode M[,M...]] [--after K] [--every 0|1]
 *                            [--capacity C] [--protocol V] [--delay-ms D] [--tokens 0|1]
 *                            [--reconnect 0|1] [--score response|prompt]
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

#define MAX_MODES 8

typedef struct opts {
    const char *endpoint, *name;
    char modes[MAX_MODES][16];
    int n_modes, after, every, capacity, protocol, delay_ms, tokens, reconnect, prompt_score;
} opts;

/* "nan,error" into o->modes; 0 when there are too many or one is too long. */
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
    *o = (opts){.name = "echo", .modes = {"ok"}, .n_modes = 1, .after = 1 << 30, .capacity = 4};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--connect")) o->endpoint = v;
        else if (!strcmp(k, "--name")) o->name = v;
        else if (!strcmp(k, "--mode")) { if (!parse_modes(v, o)) return 0; }
        else if (!strcmp(k, "--after")) o->after = atoi(v);
        else if (!strcmp(k, "--every")) o->every = atoi(v);
        else if (!strcmp(k, "--capacity")) o->capacity = atoi(v);
        else if (!strcmp(k, "--protocol")) o->protocol = atoi(v);
        else if (!strcmp(k, "--delay-ms")) o->delay_ms = atoi(v);
        else if (!strcmp(k, "--tokens")) o->tokens = atoi(v);
        else if (!strcmp(k, "--reconnect")) o->reconnect = atoi(v);
        else if (!strcmp(k, "--score") && (!strcmp(v, "prompt") || !strcmp(v, "response")))
            o->prompt_score = !strcmp(v, "prompt");
        else return 0;
    }
    return o->endpoint != NULL;
}

/* The fault of the k-th request ("ok" for none). */
static const char *fault_of(const opts *o, int k) {
    if (k < o->after || (!o->every && k - o->after >= o->n_modes)) return "ok";
    return o->modes[(k - o->after) % o->n_modes];
}

static rf_status answer(rf_msg_client *c, const opts *o, const Rlflow__RewardRequest *q, int k) {
    const char *fault = fault_of(o, k);
    if (o->delay_ms > 0) nanosleep(&(struct timespec){0, o->delay_ms * 1000000L}, NULL);
    if (!strcmp(fault, "die")) _exit(9);
    if (!strcmp(fault, "silent")) {
        sleep(60);
        _exit(0);
    }
    if (!strcmp(fault, "mute")) return RF_OK;
    Rlflow__RewardResponse r = RLFLOW__REWARD_RESPONSE__INIT;
    Rlflow__RewardResponse__ComponentsEntry len = RLFLOW__REWARD_RESPONSE__COMPONENTS_ENTRY__INIT;
    Rlflow__RewardResponse__ComponentsEntry *comps[1] = {&len};
    char info[128];
    float n = (float)q->n_response_ids, tok[257];
    r.request_id = q->request_id;
    r.reward = n + 0.01f * (float)strlen(q->response) +
               (strcmp(q->response, q->ground_truth) == 0 ? 100.0f : 0.0f);
    if (o->prompt_score) r.reward = (float)q->n_prompt_ids;
    len.key = "len", len.value = n;
    r.components = comps, r.n_components = 1;
    snprintf(info, sizeof info, "echo %s n=%zu", o->name, q->n_response_ids);
    r.info = !strcmp(fault, "badutf8") ? "\xff" : info;
    size_t nt = q->n_response_ids < 256 ? q->n_response_ids : 256;
    for (size_t j = 0; j <= nt; j++)
        tok[j] = (j < nt ? (float)q->response_ids[j] * 0.5f : 0.0f) + 0.25f * (float)j;
    if (o->tokens || !strcmp(fault, "badtokens") || !strcmp(fault, "inftoken"))
        r.token_rewards = tok, r.n_token_rewards = nt;
    if (!strcmp(fault, "badtokens")) r.n_token_rewards = nt + 1;
    if (!strcmp(fault, "inftoken") && nt) tok[nt - 1] = INFINITY;
    if (!strcmp(fault, "nan")) r.reward = NAN;
    if (!strcmp(fault, "big")) r.reward = 3e38f;
    if (!strcmp(fault, "bigtoken") && nt) r.token_rewards = tok, r.n_token_rewards = nt, tok[nt - 1] = 3e38f;
    if (!strcmp(fault, "compnan")) len.value = NAN;
    char longname[65];
    memset(longname, 'n', 64), longname[64] = '\0';
    if (!strcmp(fault, "longname")) len.key = longname;
    char *huge = NULL;
    if (!strcmp(fault, "huge") && (huge = malloc((64u << 20) + 2))) {
        memset(huge, 'x', (64u << 20) + 1), huge[(64u << 20) + 1] = '\0';
        r.info = huge;
    }
    if (!strcmp(fault, "badid")) r.request_id += 1000000;
    if (!strcmp(fault, "error")) r.error = "cannot judge this one";
    if (!strcmp(fault, "garbage")) {
        /* tag 17, request_id = 1, then field 4 (info) claiming 127 bytes where 1 follows */
        const uint8_t bad[] = {RF_MSG_REWARD_RESPONSE, 0x08, 0x01, 0x22, 0x7f, 'x'};
        return rf_msg_client_send_raw(c, bad, sizeof bad);
    }
    if (!strcmp(fault, "badtype")) {
        Rlflow__Shutdown sd = RLFLOW__SHUTDOWN__INIT;
        sd.reason = "not mine to send";
        return rf_msg_client_send(c, RF_MSG_SHUTDOWN, &sd.base);
    }
    if (!strcmp(fault, "duplicate")) RF_TRY(rf_msg_client_send(c, RF_MSG_REWARD_RESPONSE, &r.base));
    rf_status st = rf_msg_client_send(c, RF_MSG_REWARD_RESPONSE, &r.base);
    free(huge);
    return st;
}

int main(int argc, char **argv) {
    opts o;
    if (!parse(argc, argv, &o)) {
        fprintf(stderr, "usage: %s --connect ENDPOINT [--name N] [--mode M] [--after K] "
                        "[--capacity C] [--protocol V] [--delay-ms D] [--tokens 0|1] [--reconnect 0|1] "
                        "[--score response|prompt]\n", argv[0]);
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
            if (o.reconnect) {  /* dropped: a fresh socket and Hello (the old one is forgotten) */
                rf_msg_free(&m);
                rf_msg_client_close(c);
                if (rf_msg_client_connect(&c, &cfg) != RF_OK) {
                    fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
                    zmq_ctx_term(ctx);
                    return 4;
                }
                continue;
            }
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
