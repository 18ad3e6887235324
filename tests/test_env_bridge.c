/* The environment-program bridge (env/bridge.h) against the scripted C environment program
 * (examples/env/env_script.c, built as env_program_script):
 *  - resets and steps are answered with exactly the script's observations, rewards and done;
 *    a step carries the episode's reset, first observation and whole history (the script
 *    answers an error when they are not what it would have played);
 *  - replies out of order (each held until the next one went) are matched to their requests;
 *  - a program that dies, hangs (silent) or sends garbage, a bad id, an error, a non-finite
 *    reward or a message it may not send mid-batch: a second program answers its requests,
 *    every request is answered exactly once (accepted == requests) and the answers are exact;
 *  - a request rejected max_attempts times fails the call with the exact error text naming the
 *    request, its episode and sample and every rejection; a reset answered with a reward is
 *    rejected; no program at all fails naming the endpoint;
 *  - a reply whose observation is not UTF-8 or holds a NUL byte, or whose done is sent as a
 *    string, is rejected (naming the program, the request and the byte) and the request re-sent;
 *  - a program that takes requests and never answers them (pings answered) fails the call after
 *    max_attempts deadlines, naming the request; once a stop is asked for (cfg.stop) a request
 *    is not sent again and the call fails at the next deadline, while replies in flight are
 *    still taken;
 *  - the Shutdown's reason is the one set (the run is complete by default), and a program that
 *    reconnects just before the end (after being dropped) gets its Shutdown too;
 *  - an endpoint other machines can reach is refused without CURVE or insecure.
 * Skipped (77) without the program (RF_ENV_SCRIPT). Waits bounded (alarm(300)). */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/util.h"
#include "env/bridge.h"
#include "spawn_util.h"
#include "test_util.h"

static const char *script;
static char log_path[] = "/tmp/rf_env_bridge_XXXXXX";

enum { N = 8 };

/* N episodes of one group each, two samples per group: their reset calls, and their steps of
 * turn `turn` with a history the script would have played. */
typedef struct calls {
    rf_reward_item ex[N];
    int32_t prompt_ids[N][3], action_ids[N][5];
    rf_env_turn hist[N][4];
    rf_env_call c[N];
    char obs[4][16];
} calls;

static void make_calls(calls *k, int turn, int is_step) {
    memset(k, 0, sizeof *k);
    for (int t = 0; t < 4; t++) snprintf(k->obs[t], sizeof k->obs[t], "<o%d>", t);
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < 3; j++) k->prompt_ids[i][j] = 100 + i + j;
        for (int j = 0; j < 5; j++) k->action_ids[i][j] = 7 * i + j;
        k->ex[i] = (rf_reward_item){"12*34=", NULL, k->prompt_ids[i], 3, NULL, 0, "408", "{\"x\":1}", i % 2, i / 2};
        for (int t = 0; t < turn; t++)
            k->hist[i][t] = (rf_env_turn){"earlier", k->action_ids[i], 2, k->obs[t], 0.5f};
        k->c[i] = (rf_env_call){.is_step = is_step, .episode = 40 + (uint64_t)i, .ex = &k->ex[i], .turn = turn,
                                .action = "<calc>12*34", .action_ids = k->action_ids[i], .n_action_ids = 1 + i % 5,
                                .finish = "stop", .first_observation = "", .history = k->hist[i], .n_history = turn};
    }
}

/* The script's answer to step i of turn t (3 turns): exact. */
static int step_exact(const calls *k, const rf_env_reply *r, int turn) {
    int ok = 1;
    for (int i = 0; i < N; i++) {
        float want = 0.5f * (float)(turn + 1) + 0.01f * (float)k->c[i].n_action_ids;
        ok &= strcmp(r[i].observation, k->obs[turn]) == 0 && r[i].reward == want && r[i].done == (turn + 1 >= 3);
        if (!ok) {
            fprintf(stderr, "step %d: \"%s\" %.9g %d\n", i, r[i].observation, (double)r[i].reward, r[i].done);
            return 0;
        }
    }
    return ok;
}

static pid_t spawn_script(const char *ep, const char *name, const char *const *extra) {
    char *argv[24] = {(char *)script, "--connect", (char *)ep, "--name", (char *)name};
    int a = 5;
    for (int i = 0; extra && extra[i] && a < 22; i++) argv[a++] = (char *)extra[i];
    argv[a] = NULL;
    return rf_test_spawn(argv, log_path);
}

static int g_signal; /* what the bridges' stop hook reports */
static int stop_hook(void) { return g_signal; }

static rf_env_bridge *open_bridge(double timeout, int attempts) {
    rf_env_bridge *x = NULL;
    rf_env_bridge_config c = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = timeout, .max_attempts = attempts,
                              .stop = stop_hook};
    CHECK_OK(rf_env_bridge_listen(&x, &c));
    return x;
}

/* Resets and the three turns of N episodes with one program: every answer exact. */
static void plays_episodes(void) {
    rf_env_bridge *x = open_bridge(5, 0);
    if (!x) return;
    pid_t p = spawn_script(rf_env_bridge_endpoint(x), "script", NULL);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    calls k;
    rf_env_reply r[N];
    make_calls(&k, 0, 0);
    CHECK_OK(rf_env_bridge_call(x, k.c, N, r));
    for (int i = 0; i < N; i++) CHECK(strcmp(r[i].observation, "") == 0 && r[i].reward == 0 && !r[i].done);
    for (int t = 0; t < 3; t++) {
        make_calls(&k, t, 1);
        CHECK_OK(rf_env_bridge_call(x, k.c, N, r));
        CHECK(step_exact(&k, r, t));
    }
    rf_env_stats s = rf_env_bridge_take_stats(x);
    CHECK(s.accepted == 4 * N && s.rejected == 0 && s.lost == 0 && s.resent == 0);
    rf_env_bridge_close(x);
    CHECK(rf_test_wait(p, 5) == 0);
    printf("resets and 3 turns of %d episodes: exact\n", N);
}

/* Replies held and sent after the next one: all matched, nothing rejected. */
static void out_of_order(void) {
    rf_env_bridge *x = open_bridge(5, 0);
    if (!x) return;
    const char *swap[] = {"--mode", "swap", "--after", "1", "--every", "1", NULL};
    pid_t p = spawn_script(rf_env_bridge_endpoint(x), "swapper", swap);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    calls k;
    rf_env_reply r[N];
    make_calls(&k, 1, 1);
    rf_status st = rf_env_bridge_call(x, k.c, N, r);
    CHECK_OK(st);
    if (st == RF_OK) CHECK(step_exact(&k, r, 1));
    rf_env_stats s = rf_env_bridge_take_stats(x);
    CHECK(s.accepted == N && s.rejected == 0 && s.lost == 0);
    rf_env_bridge_close(x);
    CHECK(rf_test_wait(p, 5) == 0);
    printf("replies out of order: %d matched, none rejected\n", N);
}

/* 'bad' spoils its 2nd request with `mode` mid-batch, 'good' answers the rest and the
 * re-sent one: exact, each request accepted once. */
static void survives(const char *mode, int rejected, int lost) {
    rf_env_bridge *x = open_bridge(1.5, 0);
    if (!x) return;
    const char *ep = rf_env_bridge_endpoint(x);
    const char *bad_opts[] = {"--mode", mode, "--after", "2", "--capacity", "2", NULL}; /* its 2nd: sent at once */
    pid_t bad = spawn_script(ep, "bad", bad_opts);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    pid_t good = spawn_script(ep, "good", NULL);
    CHECK_OK(rf_env_bridge_wait(x, 2, 10));
    calls k;
    rf_env_reply r[N];
    make_calls(&k, 2, 1);
    rf_status st = rf_env_bridge_call(x, k.c, N, r);
    CHECK_OK(st);
    if (st == RF_OK) CHECK(step_exact(&k, r, 2));
    rf_env_stats s = rf_env_bridge_take_stats(x);
    CHECK(s.accepted == N && s.rejected == rejected && s.lost == lost && s.resent >= 1);
    if (s.accepted != N || s.rejected != rejected || s.lost != lost)
        fprintf(stderr, "%s: accepted %d rejected %d lost %d resent %d\n", mode, s.accepted, s.rejected, s.lost,
                s.resent);
    rf_env_bridge_close(x);
    rf_test_kill(bad);
    CHECK(rf_test_wait(good, 5) == 0);
    printf("a program that answers '%s' mid-batch: %d requests answered once each, exact\n", mode, N);
}

/* One program spoiling every request (reconnecting after each drop): the call fails after
 * two rejections with exactly `want` (made from the program's pid and the endpoint). */
static void fails_after_limit(const char *mode, int is_step, rf_status code, const char *reason_fmt) {
    rf_env_bridge *x = open_bridge(5, 2);
    if (!x) return;
    const char *ep = rf_env_bridge_endpoint(x);
    const char *opts[] = {"--mode", mode, "--after", "1", "--every", "1", "--reconnect", "1", NULL};
    pid_t p = spawn_script(ep, "spoiler", opts);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    calls k;
    rf_env_reply r[1];
    make_calls(&k, 0, is_step);
    char desc[300], what[80], why1[700], why2[700], want[2000];
    snprintf(desc, sizeof desc, "environment program 'spoiler' (rank 0, pid %d) on %s", (int)p, ep);
    snprintf(what, sizeof what, "%s of episode 40, sample 0 of group 0", is_step ? "turn 0" : "reset");
    snprintf(why1, sizeof why1, reason_fmt, desc, 1, what);
    snprintf(why2, sizeof why2, reason_fmt, desc, 2, what);
    snprintf(want, sizeof want, "env: request 2 (%s) was rejected 2 times, the limit (max_attempts): 1) %s; 2) %s",
             what, why1, why2);
    rf_error_clear();
    CHECK(rf_env_bridge_call(x, k.c, 1, r) == code);
    CHECK(strcmp(rf_error_message(), want) == 0);
    if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got:  %s\nwant: %s\n", rf_error_message(), want);
    rf_env_bridge_close(x);
    /* it was dropped and reconnects at once: it gets the Shutdown too and exits 0 */
    CHECK(rf_test_wait(p, 5) == 0);
    rf_test_kill(p);
    printf("'%s' every time: fails after 2 rejections, exact text; the program reconnected and got Shutdown\n", mode);
}

/* A program that keeps every request and never answers (pings answered, reconnecting after each
 * drop): each drop at the deadline counts against the request, and the call fails after
 * max_attempts (2) deadlines of 1 s, naming the request, instead of re-sending forever. */
static void mute_fails(void) {
    rf_env_bridge *x = open_bridge(1, 2);
    if (!x) return;
    const char *opts[] = {"--mode", "mute", "--after", "1", "--every", "1", "--reconnect", "1", NULL};
    pid_t p = spawn_script(rf_env_bridge_endpoint(x), "mute", opts);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    calls k;
    rf_env_reply r[1];
    make_calls(&k, 0, 1);
    double t0 = rf_time_now();
    rf_error_clear();
    CHECK(rf_env_bridge_call(x, k.c, 1, r) == RF_ERR_IO);
    double dt = rf_time_now() - t0;
    const char *e = rf_error_message();
    CHECK(strstr(e, "env: request 2 (turn 0 of episode 40, sample 0 of group 0) was rejected 2 times, the limit "
                 "(max_attempts): 1) environment program 'mute' (rank 0, pid ") == e);
    CHECK(strstr(e, "answered no request for 1.") && strstr(e, " s (env.timeout) (it held request 1); 2) "));
    CHECK(strstr(e, "(env.timeout) (it held request 2)") != NULL);
    CHECK(dt > 1.9 && dt < 5);
    printf("a program that never answers: the call fails after %.1f s: %s\n", dt, e);
    rf_env_bridge_close(x);
    rf_test_kill(p);
}

/* A stop asked for (cfg.stop): replies in flight are taken (a healthy program's call completes),
 * but a request whose program missed its deadline is not sent again: the call fails at the
 * first deadline (1 s) though max_attempts (10) would allow 10. */
static void stop_honoured(void) {
    rf_env_bridge *x = open_bridge(1, 10);
    if (!x) return;
    pid_t good = spawn_script(rf_env_bridge_endpoint(x), "script", NULL);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    calls k;
    rf_env_reply r[N];
    make_calls(&k, 0, 1);
    g_signal = 15;
    CHECK_OK(rf_env_bridge_call(x, k.c, N, r));
    CHECK(step_exact(&k, r, 0));
    rf_env_bridge_close(x);
    CHECK(rf_test_wait(good, 5) == 0);
    x = open_bridge(1, 10);
    if (!x) return;
    const char *opts[] = {"--mode", "mute", "--after", "1", "--every", "1", "--reconnect", "1", NULL};
    pid_t p = spawn_script(rf_env_bridge_endpoint(x), "mute", opts);
    CHECK_OK(rf_env_bridge_wait(x, 1, 10));
    double t0 = rf_time_now();
    rf_error_clear();
    CHECK(rf_env_bridge_call(x, k.c, 1, r) == RF_ERR_IO);
    double dt = rf_time_now() - t0;
    const char *e = rf_error_message();
    CHECK(strstr(e, "env: interrupted (signal 15): request 1 (turn 0 of episode 40, sample 0 of group 0) is not sent "
                 "again; environment program 'mute'") == e);
    CHECK(dt > 0.9 && dt < 3);
    printf("stop asked for: a healthy call completes; a stuck one fails after %.1f s: %s\n", dt, e);
    g_signal = 0;
    rf_env_bridge_close(x);
    rf_test_kill(p);
}

/* The Shutdown reason: "the run is complete" by default, the one set otherwise. */
static void shutdown_reasons(void) {
    const char *set[] = {NULL, "the run stopped on an error: boom"};
    for (int t = 0; t < 2; t++) {
        rf_env_bridge *x = open_bridge(5, 0);
        if (!x) return;
        pid_t p = spawn_script(rf_env_bridge_endpoint(x), t ? "ender_error" : "ender_done", NULL);
        CHECK_OK(rf_env_bridge_wait(x, 1, 10));
        if (set[t]) rf_env_bridge_set_end(x, set[t]);
        rf_env_bridge_close(x);
        CHECK(rf_test_wait(p, 5) == 0);
    }
    char *text = rf_test_slurp(log_path);
    CHECK(text && strstr(text, "ender_done: shutdown: the run is complete\n"));
    CHECK(text && strstr(text, "ender_error: shutdown: the run stopped on an error: boom\n"));
    free(text);
    printf("Shutdown reasons: the default and the one set reach the program\n");
}

static void no_program_and_security(void) {
    rf_env_bridge *x = open_bridge(0.5, 0);
    if (!x) return;
    calls k;
    rf_env_reply r[N];
    make_calls(&k, 0, 0);
    char want[300];
    snprintf(want, sizeof want, "env: no environment program connected to %s within 0.5 s (8 of 8 requests "
             "unanswered)", rf_env_bridge_endpoint(x));
    rf_error_clear();
    CHECK(rf_env_bridge_call(x, k.c, N, r) == RF_ERR_IO);
    CHECK(strcmp(rf_error_message(), want) == 0);
    rf_env_bridge_close(x);
    rf_env_bridge_config c = {.endpoint = "tcp://0.0.0.0:*", .timeout_s = 1};
    CHECK_ERR(rf_env_bridge_listen(&x, &c), RF_ERR_ARG, "env.endpoint = \"tcp://0.0.0.0:*\" can be reached from "
              "other machines");
    c = (rf_env_bridge_config){.endpoint = "tcp://127.0.0.1:*", .timeout_s = 0};
    CHECK_ERR(rf_env_bridge_listen(&x, &c), RF_ERR_ARG, "env.timeout must be > 0 s (got 0)");
    c = (rf_env_bridge_config){.endpoint = "tcp://127.0.0.1:*", .timeout_s = 1, .curve_secret_file = "/x"};
    CHECK_ERR(rf_env_bridge_listen(&x, &c), RF_ERR_ARG, "env.curve_secret is set but env.curve_clients is not");
}

int main(void) {
    script = getenv("RF_ENV_SCRIPT");
    if (!script || access(script, X_OK) != 0) {
        printf("skipped: RF_ENV_SCRIPT (the env_program_script program) not set\n");
        return 77;
    }
    alarm(300);
    int fd = mkstemp(log_path);
    RF_ASSERT(fd >= 0);
    close(fd);
    plays_episodes();
    out_of_order();
    survives("die", 0, 1);
    survives("silent", 0, 1);
    survives("garbage", 1, 0);
    survives("nan", 1, 0);
    survives("badid", 1, 0);
    survives("error", 1, 0);
    survives("badtype", 1, 0);
    survives("badutf8", 1, 0);
    survives("nul", 1, 0);
    survives("donestr", 1, 0);
    fails_after_limit("nan", 1, RF_ERR_RANGE, "%s answered reward nan for request %d (%s); rewards must be finite");
    fails_after_limit("resetreward", 0, RF_ERR_FORMAT,
                      "%s answered request %d (%s) with a reward; a reset answers an observation only");
    fails_after_limit("error", 1, RF_ERR_FORMAT, "%s could not answer request %d (%s): cannot play this one");
    fails_after_limit("garbage", 1, RF_ERR_FORMAT, "%s sent a malformed message: 5 bytes after tag 20 do not decode "
                      "as rlflow.EnvReply (it held request %d)%.0s");
    fails_after_limit("badutf8", 1, RF_ERR_FORMAT, "%s sent a malformed message: 13 bytes after tag 20 do not decode "
                      "as rlflow.EnvReply: field 2 (observation) of rlflow.EnvReply is not valid UTF-8 at byte 2 of "
                      "its 4 (its reply to request %d (%s))");
    fails_after_limit("nul", 1, RF_ERR_FORMAT, "%s sent a malformed message: 7 bytes after tag 20 do not decode as "
                      "rlflow.EnvReply: field 2 (observation) of rlflow.EnvReply holds a NUL byte at byte 1 of its 3 "
                      "(strings may not hold one) (its reply to request %d (%s))");
    mute_fails();
    stop_honoured();
    shutdown_reasons();
    no_program_and_security();
    char *text = rf_test_slurp(log_path);
    if (rf_test_failed) fprintf(stderr, "programs said:\n%s\n", text);
    free(text);
    unlink(log_path);
    return rf_test_finish("test_env_bridge");
}
