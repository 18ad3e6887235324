/* A reward program in C, built on the client library reward/clients/c/rlflow_reward_client.h:
 * rewards responses whose length is close to a target, exactly as length_judge.py does.
 *
 *     reward = 1 - |len - target| / target     (unclipped: 1 at the target, 0 at 0 or 2x)
 *
 * len is the response's token count, or its length in characters (UTF-8 code points) when the
 * request carries no token ids (or with --unit chars). Component "length" = len; info
 * "len <len>, target <target>". Computed in double and sent as a float, like the Python one,
 * so both programs answer the same bits.
 *
 *     build/length_judge --connect tcp://127.0.0.1:5557 --target 64
 *     build/length_judge --connect tcp://10.0.0.1:5557 --server-key rlflow.pub --key judge.key
 *
 * Exit codes (the same as length_judge.py): 0 after rlflow's Shutdown, 2 bad usage or options,
 * 3 no answer / idle / connection lost, 4 refused (protocol version, CURVE key). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reward/clients/c/rlflow_reward_client.h"

typedef struct judge {
    int target, chars;  /* chars: count characters even when token ids are there */
} judge;

static size_t utf8_chars(const char *s) {
    size_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static int score(const rf_reward_request *q, rf_reward_result *r, void *user) {
    const judge *j = user;
    size_t n = !j->chars && q->n_response_ids ? q->n_response_ids : utf8_chars(q->response);
    r->reward = (float)(1.0 - fabs((double)n - j->target) / j->target);
    rf_reward_result_component(r, "length", (float)n);
    snprintf(r->info, sizeof r->info, "len %zu, target %d", n, j->target);
    return 0;
}

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { (void)sig, g_stop = 1; }

static void usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s [--connect EP] [--target N] [--unit tokens|chars] [--name N]\n"
            "          [--capacity C] [--threads T] [--rank R] [--timeout S] [--idle-exit S]\n"
            "          [--server-key FILE --key FILE]\n"
            "  --connect     rlflow's reward endpoint (default $RLFLOW_REWARD_ENDPOINT, else tcp://127.0.0.1:5557)\n"
            "  --target      target length, > 0 (default 64)\n"
            "  --unit        tokens (default; characters when a request has no ids) or chars\n"
            "  --capacity    requests accepted in flight (default 8)\n"
            "  --threads     scoring threads (default 1)\n"
            "  --timeout     seconds to wait for rlflow's HelloAck (default 30)\n"
            "  --idle-exit   exit after this many seconds without any message (default 0: never)\n"
            "  --server-key  rlflow's CURVE public key file (PREFIX.pub of rlflow keygen)\n"
            "  --key         this program's CURVE secret key file (PREFIX.key)\n",
            argv0);
}

/* Parses "--name value" pairs into o and j; 0 on a bad option. */
static int parse(int argc, char **argv, rf_reward_client_opts *o, judge *j, const char **server_key,
                 const char **key) {
    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!v) return 0;
        if (!strcmp(k, "--connect")) o->connect = v;
        else if (!strcmp(k, "--target")) j->target = (int)strtol(v, &end, 10);
        else if (!strcmp(k, "--unit") && (!strcmp(v, "tokens") || !strcmp(v, "chars")))
            j->chars = !strcmp(v, "chars");
        else if (!strcmp(k, "--name")) o->name = v;
        else if (!strcmp(k, "--capacity")) o->capacity = (int)strtol(v, &end, 10);
        else if (!strcmp(k, "--threads")) o->threads = (int)strtol(v, &end, 10);
        else if (!strcmp(k, "--rank")) o->rank = (int)strtol(v, &end, 10);
        else if (!strcmp(k, "--timeout")) o->hello_timeout_s = strtod(v, &end);
        else if (!strcmp(k, "--idle-exit")) o->idle_exit_s = strtod(v, &end);
        else if (!strcmp(k, "--server-key")) *server_key = v;
        else if (!strcmp(k, "--key")) *key = v;
        else return 0;
        if (end && (*end || end == v)) return 0;  /* a number that is not one */
    }
    return j->target > 0 && o->capacity >= 1 && o->threads >= 1 && o->hello_timeout_s > 0 &&
           o->idle_exit_s >= 0 && !*server_key == !*key;
}

int main(int argc, char **argv) {
    rf_reward_client_opts o = {.connect = NULL, .name = "length_judge",
                               .capacity = 8, .threads = 1, .hello_timeout_s = 30, .stop = &g_stop};
    judge j = {64, 0};
    const char *server_key = NULL, *key = NULL;
    if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        usage(argv[0]);
        return 0;
    }
    if (!parse(argc, argv, &o, &j, &server_key, &key)) {
        usage(argv[0]);
        fprintf(stderr, "error: bad options (--target, --capacity, --threads and --timeout must be "
                        "> 0; --server-key and --key go together)\n");
        return 2;
    }
    char server_pub[41], secret[41];
    if (server_key && (rf_reward_client_read_key(server_key, server_pub) != RF_OK ||
                       rf_reward_client_read_key(key, secret) != RF_OK)) {
        fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
        return 2;
    }
    if (server_key) o.curve_server_key = server_pub, o.curve_secret_key = secret;
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    rf_status st = rf_reward_client_serve(&o, score, &j);
    if (st == RF_OK) return 0;
    fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
    return st == RF_ERR_UNSUPPORTED ? 4 : st == RF_ERR_ARG ? 2 : 3;
}
