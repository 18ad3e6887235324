/* The calculator tool as an environment program in C, over the C client library
 * (env/clients/c/rlflow_env_client.h, docs/env-api.md): the rules of rlflow's built-in
 * calculator (env/calculator.h), whose evaluator it uses. Built as build/calculator_env_c.
 *
 *     rlflow run examples/grpo_calculator.toml --set env.type=external \
 *         --set env.endpoint=tcp://127.0.0.1:5558 --set 'rollout.stop=["</calc>"]' &
 *     build/calculator_env_c --connect tcp://127.0.0.1:5558
 *
 * Started by rlflow (env.programs) it needs no --connect: the client reads RLFLOW_ENV_ENDPOINT and
 * the run's keys. Usage: calculator_env_c [--connect EP] [--name N] [--capacity C]. Exit: 0 after Shutdown,
 * 2 bad usage, 1 an error (printed). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "env/calculator.h"
#include "env/clients/c/rlflow_env_client.h"

/* A tool call: a turn ended at a stop string whose text holds "<calc>"; else the episode ends. */
static int step(const rf_env_client_step *q, rf_env_client_reply *r, void *user) {
    (void)user;
    const char *open = NULL;
    for (const char *p = strstr(q->action, "<calc>"); p; p = strstr(p + 1, "<calc>")) open = p;
    if (!open || strcmp(q->finish, "stop") != 0) {
        r->done = 1;
        return 0;
    }
    char value[256];
    rf_calculator_eval(open + 6, value, sizeof value);
    snprintf(r->observation, sizeof r->observation, "<result>%s</result>", value);
    return 0;
}

int main(int argc, char **argv) {
    /* no --connect: RLFLOW_ENV_ENDPOINT (env.programs), else tcp://127.0.0.1:5558 */
    rf_env_client_opts o = {.name = "calculator", .capacity = 16};
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) return fprintf(stderr, "usage: %s [--connect EP] [--name N] [--capacity C]\n", argv[0]), 2;
        if (!strcmp(argv[i], "--connect")) o.connect = argv[i + 1];
        else if (!strcmp(argv[i], "--name")) o.name = argv[i + 1];
        else if (!strcmp(argv[i], "--capacity")) o.capacity = atoi(argv[i + 1]);
        else return fprintf(stderr, "usage: %s [--connect EP] [--name N] [--capacity C]\n", argv[0]), 2;
    }
    long n = 0;
    rf_status st = rf_env_client_serve(&o, NULL, step, NULL, &n);
    if (st != RF_OK) {
        fprintf(stderr, "%s: %s\n", o.name, rf_error_message());
        return 1;
    }
    fprintf(stderr, "%s: answered %ld requests\n", o.name, n);
    return 0;
}
