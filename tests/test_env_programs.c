/* The environment clients, Python (env/clients/python/rlflow_env.py) and C
 * (env/clients/c/rlflow_env_client.h), with their example programs examples/env/calculator_env.py
 * and calculator_env_c.c, against rlflow's environment bridge:
 *  - the built-in calculator (env/calculator.c) answers a table of tool calls with hand-checked
 *    values and errors (exact integers, a non-exact division rounded to 6 decimals, overflow,
 *    division by zero, parse errors, nesting), and a turn without a call ends the episode;
 *  - calculator_env.py and calculator_env_c answer every one of them exactly as the built-in
 *    does (observation, reward, done), resets included, through the bridge and each client: a
 *    program in Python or C can stand in for the built-in;
 *  - each client answers several requests in flight (capacity 4) and exits 0 on Shutdown.
 * The Python part is skipped when no python3 with pyzmq and protobuf is found, the C part
 * without RF_ENV_CALC_C. Waits bounded (alarm(120)). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "env/bridge.h"
#include "env/calculator.h"
#include "spawn_util.h"
#include "test_shell.h"
#include "test_util.h"

static const char *find_python(void) {
    static const char *cands[] = {"python3", "/usr/bin/python3"};
    for (int i = 0; i < 2; i++)
        if (rf_test_sh(NULL, "%s -c 'import zmq, google.protobuf' >/dev/null 2>&1", cands[i]) == 0) return cands[i];
    return NULL;
}

/* Tool calls (the turn's text, cut before "</calc>") and what the calculator answers. */
static const struct { const char *action, *finish, *obs; int done; } CASES[] = {
    {"<calc>4821*3907", "stop", "<result>18835647</result>", 0},
    {"I will use it. <calc> 12 * (3 + 4) - -2 ", "stop", "<result>86</result>", 0},
    {"<calc>1<calc>7/2", "stop", "<result>3.5</result>", 0},
    {"<calc>1/3", "stop", "<result>0.333333</result>", 0},
    {"<calc>2/3*3", "stop", "<result>2</result>", 0},
    {"<calc>-9/3", "stop", "<result>-3</result>", 0},
    {"<calc>9223372036854775807+1", "stop", "<result>error: overflow</result>", 0},
    {"<calc>99999999999*99999999999", "stop", "<result>error: overflow</result>", 0},
    {"<calc>5/(2-2)", "stop", "<result>error: division by zero</result>", 0},
    {"<calc>5/(", "stop", "<result>error: the expression ends early</result>", 0},
    {"<calc>(1+2", "stop", "<result>error: a parenthesis is not closed</result>", 0},
    {"<calc>2x3", "stop", "<result>error: cannot parse</result>", 0},
    {"<calc>", "stop", "<result>error: the expression ends early</result>", 0},
    {"<calc>((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((1", "stop",
     "<result>error: too deeply nested</result>", 0},
    {"18835647", "eos", "", 1},
    {"<calc>1+1", "length", "", 1}, /* cut off by the turn's limit: not a call */
    {"the answer is 3", "stop", "", 1},
};
#define N_CASES ((int)(sizeof CASES / sizeof CASES[0]))

static void make_calls(rf_reward_item *ex, rf_env_call *c) {
    *ex = (rf_reward_item){"4821*3907=", NULL, NULL, 0, NULL, 0, "18835647", "", 0, 0};
    c[0] = (rf_env_call){.is_step = 0, .episode = 9, .ex = ex};
    for (int i = 0; i < N_CASES; i++)
        c[i + 1] = (rf_env_call){.is_step = 1, .episode = 9, .ex = ex, .turn = 0, .action = CASES[i].action,
                                 .finish = CASES[i].finish, .first_observation = ""};
}

static int same_as_cases(const rf_env_reply *r, const char *who) {
    int ok = r[0].observation && strcmp(r[0].observation, "") == 0 && !r[0].done && r[0].reward == 0;
    for (int i = 0; i < N_CASES; i++) {
        const rf_env_reply *x = &r[i + 1];
        int good = x->observation && strcmp(x->observation, CASES[i].obs) == 0 && x->done == CASES[i].done &&
                   x->reward == 0.0f;
        if (!good) fprintf(stderr, "%s, case %d (%s): \"%s\" done %d\n", who, i, CASES[i].action,
                           x->observation ? x->observation : "(null)", x->done);
        ok &= good;
    }
    return ok;
}

static void builtin(void) {
    rf_env e;
    CHECK_OK(rf_calculator_env(&e));
    rf_reward_item ex;
    rf_env_call c[N_CASES + 1];
    rf_env_reply r[N_CASES + 1];
    make_calls(&ex, c);
    CHECK_OK(e.call(e.ctx, c, N_CASES + 1, r));
    CHECK(same_as_cases(r, "built-in"));
    rf_env_close(&e);
    char out[64];
    CHECK(rf_calculator_eval("12", out, sizeof out) == 1 && strcmp(out, "12") == 0);
    CHECK(rf_calculator_eval("1/0", out, sizeof out) == 0 && strcmp(out, "error: division by zero") == 0);
    printf("built-in calculator: %d tool calls answered as hand-checked\n", N_CASES);
}

/* argv's program (the calculator in Python or C) over the bridge: the built-in's answers. */
static void program(char **argv, const char *who) {
    rf_env_bridge *x = NULL;
    rf_env_bridge_config cfg = {.endpoint = "tcp://127.0.0.1:*", .timeout_s = 20};
    CHECK_OK(rf_env_bridge_listen(&x, &cfg));
    if (!x) return;
    char log_path[] = "/tmp/rf_env_programs_XXXXXX";
    int fd = mkstemp(log_path);
    RF_ASSERT(fd >= 0);
    close(fd);
    for (int i = 0; argv[i]; i++)
        if (!strcmp(argv[i], "EP")) argv[i] = (char *)rf_env_bridge_endpoint(x);
    pid_t p = rf_test_spawn(argv, log_path);
    CHECK_OK(rf_env_bridge_wait(x, 1, 20));
    rf_reward_item ex;
    rf_env_call c[N_CASES + 1];
    rf_env_reply r[N_CASES + 1];
    make_calls(&ex, c);
    rf_status st = rf_env_bridge_call(x, c, N_CASES + 1, r);
    CHECK_OK(st);
    if (st == RF_OK) CHECK(same_as_cases(r, who));
    rf_env_stats s = rf_env_bridge_take_stats(x);
    CHECK(s.accepted == N_CASES + 1 && s.rejected == 0);
    rf_env_bridge_close(x);
    CHECK(rf_test_wait(p, 10) == 0);
    char *text = rf_test_slurp(log_path);
    CHECK(strstr(text, "calculator: answered 18 requests") != NULL);
    if (rf_test_failed) fprintf(stderr, "%s said:\n%s\n", who, text);
    free(text);
    unlink(log_path);
    printf("%s over the bridge: the built-in's %d answers, exactly\n", who, N_CASES + 1);
}

int main(void) {
    alarm(120);
    builtin();
    const char *py = find_python(), *src = getenv("RF_SOURCE_DIR"), *cbin = getenv("RF_ENV_CALC_C");
    if (cbin && access(cbin, X_OK) == 0) {
        char *argv[] = {(char *)cbin, "--connect", "EP", "--capacity", "4", NULL};
        program(argv, "calculator_env_c");
    } else {
        printf("skipped: the C program (RF_ENV_CALC_C not set)\n");
    }
    if (py && src) {
        char prog[1024];
        snprintf(prog, sizeof prog, "%s/examples/env/calculator_env.py", src);
        char *argv[] = {(char *)py, prog, "--connect", "EP", "--capacity", "4", NULL};
        program(argv, "calculator_env.py");
    } else {
        printf("skipped: the Python program (no python3 with zmq and protobuf, or RF_SOURCE_DIR unset)\n");
    }
    return rf_test_finish("test_env_programs");
}
