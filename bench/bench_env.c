/* The cost of environment programs over the message API (env/bridge.h), printed as JSON lines:
 * what a batch of episode steps costs through the bridge against the same batch answered in
 * process by the built-in calculator (env/calculator.h), measured in the same run.
 *
 * An environment program with the calculator's rules runs in a thread of this process over the
 * real protocol (a DEALER on tcp://127.0.0.1, rf_msg_client; capacity 64): every EnvStep is
 * decoded, its tool call evaluated and an EnvReply sent. Each batch holds `batch` steps of turn
 * `turns - 1` (so each carries turns - 1 earlier turns of history, 24-byte actions and 25-byte
 * observations: the calculator task's shapes). Per configuration:
 *   bridge_steps_per_s   steps answered per second through the bridge
 *   inproc_steps_per_s   the same calls to the built-in calculator, in process
 *   us_per_step          microseconds per step through the bridge
 *   ratio_vs_inproc      bridge_steps_per_s / inproc_steps_per_s
 * Usage: bench_env [--seconds S] (default 1 per configuration). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/msg.h"
#include "common/util.h"
#include "env/bridge.h"
#include "env/calculator.h"

static const char *g_ep;
static volatile int g_stop;

/* The calculator as a program: answers until Shutdown. */
static void *program(void *arg) {
    (void)arg;
    rf_msg_client_config cfg = {.endpoint = g_ep, .role = RLFLOW__ROLE__ROLE_ENVIRONMENT, .capacity = 64,
                                .name = "bench_calc", .timeout_s = 10};
    rf_msg_client *c;
    if (rf_msg_client_connect(&c, &cfg) != RF_OK) return NULL;
    rf_env e;
    rf_calculator_env(&e);
    while (!g_stop) {
        rf_msg m;
        int got;
        if (rf_msg_client_try_recv(c, 0.1, &m, &got) != RF_OK) break;
        if (!got) continue;
        if (m.type == RF_MSG_SHUTDOWN) {
            rf_msg_free(&m);
            break;
        }
        if (m.type == RF_MSG_ENV_STEP) {
            const Rlflow__EnvStep *s = (const Rlflow__EnvStep *)m.pb;
            rf_env_call call = {.is_step = 1, .action = s->action, .finish = s->finish};
            rf_env_reply r;
            e.call(e.ctx, &call, 1, &r);
            Rlflow__EnvReply rep = RLFLOW__ENV_REPLY__INIT;
            rep.request_id = s->request_id, rep.observation = (char *)r.observation, rep.done = r.done;
            rf_msg_client_send(c, RF_MSG_ENV_REPLY, &rep.base);
        }
        rf_msg_free(&m);
    }
    rf_env_close(&e);
    rf_msg_client_close(c);
    return NULL;
}

typedef struct calls {
    rf_reward_item ex;
    int32_t prompt[11], action[24];
    rf_env_turn hist[8];
    rf_env_call *c;
    rf_env_reply *r;
} calls;

static void make_calls(calls *k, int batch, int turns) {
    for (int i = 0; i < 11; i++) k->prompt[i] = 48 + i;
    for (int i = 0; i < 24; i++) k->action[i] = 60 + i;
    k->ex = (rf_reward_item){"48211*39077=", NULL, k->prompt, 11, NULL, 0, "1883941047", "", 0, 0};
    for (int t = 0; t < turns - 1 && t < 8; t++)
        k->hist[t] = (rf_env_turn){"<calc>48211*39077", k->action, 24, "<result>1883941047</result>", 0};
    k->c = calloc((size_t)batch, sizeof *k->c), k->r = calloc((size_t)batch, sizeof *k->r);
    for (int i = 0; i < batch; i++)
        k->c[i] = (rf_env_call){.is_step = 1, .episode = (uint64_t)i, .ex = &k->ex, .turn = turns - 1,
                                .action = "I call it: <calc>48211*39077", .action_ids = k->action,
                                .n_action_ids = 24, .finish = "stop", .first_observation = "",
                                .history = k->hist, .n_history = turns - 1};
}

/* Steps per second of env over `seconds`. */
static double rate(rf_env *env, calls *k, int batch, double seconds) {
    long n = 0;
    double t0 = rf_time_now(), t;
    do {
        if (env->call(env->ctx, k->c, batch, k->r) != RF_OK) {
            fprintf(stderr, "bench_env: %s\n", rf_error_message());
            exit(1);
        }
        n += batch;
    } while ((t = rf_time_now() - t0) < seconds);
    return (double)n / t;
}

int main(int argc, char **argv) {
    double seconds = argc == 3 && !strcmp(argv[1], "--seconds") ? atof(argv[2]) : 1.0;
    rf_env_bridge *x;
    rf_env_bridge_config cfg = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 10};
    if (rf_env_bridge_listen(&x, &cfg) != RF_OK) return fprintf(stderr, "bench_env: %s\n", rf_error_message()), 1;
    g_ep = rf_env_bridge_endpoint(x);
    pthread_t th;
    pthread_create(&th, NULL, program, NULL);
    if (rf_env_bridge_wait(x, 1, 10) != RF_OK) return fprintf(stderr, "bench_env: %s\n", rf_error_message()), 1;
    rf_env bridge, inproc;
    rf_env_bridge_as_env(x, &bridge);
    rf_calculator_env(&inproc);
    static const int batches[] = {1, 16, 128}, turns[] = {1, 3};
    for (size_t b = 0; b < 3; b++)
        for (size_t t = 0; t < 2; t++) {
            calls k;
            make_calls(&k, batches[b], turns[t]);
            rate(&bridge, &k, batches[b], seconds / 5); /* warm up */
            double br = rate(&bridge, &k, batches[b], seconds), ip = rate(&inproc, &k, batches[b], seconds);
            printf("{\"bench\": \"env\", \"batch\": %d, \"turn\": %d, \"bridge_steps_per_s\": %.0f, "
                   "\"inproc_steps_per_s\": %.0f, \"us_per_step\": %.2f, \"ratio_vs_inproc\": %.4f}\n",
                   batches[b], turns[t] - 1, br, ip, 1e6 / br, br / ip);
            fflush(stdout);
            free(k.c), free(k.r);
        }
    rf_env_close(&bridge); /* Shutdown: the program thread returns */
    pthread_join(th, NULL);
    rf_env_close(&inproc);
    return 0;
}
