/* `rlflow run` with multi-turn episodes ([env], docs/env-api.md) on the multiply task with the
 * calculator tool (a tiny model, a 300-step SFT warm start that shows the tool's format):
 *  - the episodes use the tool: more than one turn per episode on average and observation
 *    tokens on average; the generation's log-probs equal the trainer's on the generated
 *    tokens (actor/logprob_mismatch_max below 1e-3: the trajectory is what was generated, in
 *    order, with the observations in context);
 *  - multi-turn resume: 3 steps, then --resume to 6, gives the metrics of 6 steps straight,
 *    bit for bit (one process);
 *  - the calculator as a Python environment program (examples/env/calculator_env.py,
 *    env.type = "external") gives the built-in's run, bit for bit (skipped without a python3
 *    with pyzmq and protobuf);
 *  - the calculator as programs rlflow starts itself (env.programs, no endpoint in the recipe:
 *    a loopback one with CURVE keys made for the run, which the clients read from RLFLOW_ENV_*):
 *    the C program (build/calculator_env_c over the C client) and the Python one give the
 *    built-in's 6 steps, bit for bit (the Python one skipped as above);
 *  - an environment program written from docs/env-api.md alone (examples/env/wire_env.py:
 *    pyzmq and the wire format by hand, no rlflow code, no protobuf library) started by
 *    env.programs: it connects with the run's CURVE keys, the 6 steps run, the episodes use
 *    its tool (more than one turn, observation tokens), no reply rejected or re-sent.
 * Episodes in split and multi-device runs: tests/test_split_env.c. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "spawn_util.h"
#include "test_shell.h"
#include "run_util.h"

static const char *rlflow;
static char dir[64];

static void write_recipe(void) { rf_test_write_calc_recipe(dir, 6, "[checkpoint]\nevery = 3\nkeep = 0\n"); }

static const char *KEYS[] = {"reward/mean", "actor/pg_loss", "actor/grad_norm", "env/turns_mean",
                             "env/observation_tokens_mean", "response/length_mean"};

static int same_steps(const char *a, const char *b, int from, int to) {
    int ok = 1;
    for (int s = from; s <= to; s++)
        for (size_t k = 0; k < sizeof KEYS / sizeof KEYS[0]; k++) {
            double x = rf_test_metric(dir, a, s, KEYS[k]), y = rf_test_metric(dir, b, s, KEYS[k]);
            if (!(x == y)) {
                fprintf(stderr, "step %d %s: %s %.17g, %s %.17g\n", s, KEYS[k], a, x, b, y);
                ok = 0;
            }
        }
    return ok;
}

static void uses_the_tool(void) {
    double turns = 0, obs = 0, mism = 0;
    for (int s = 1; s <= 6; s++) {
        turns += rf_test_metric(dir, "full", s, "env/turns_mean") / 6;
        obs += rf_test_metric(dir, "full", s, "env/observation_tokens_mean") / 6;
        double m = rf_test_metric(dir, "full", s, "actor/logprob_mismatch_max");
        mism = m > mism ? m : mism;
    }
    CHECK(turns > 1.05 && obs > 1 && mism < 1e-3);
    printf("episodes: %.2f turns and %.1f observation tokens per episode on average, log-prob mismatch max %.2g\n",
           turns, obs, mism);
}

static void python_program(void) {
    const char *py = "/usr/bin/python3", *src = getenv("RF_SOURCE_DIR");
    if (!src || rf_test_sh(NULL, "%s -c 'import zmq, google.protobuf' >/dev/null 2>&1", py) != 0) {
        printf("skipped: the Python environment program (no python3 with zmq and protobuf)\n");
        return;
    }
    char ep[64], prog[512], log[128];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", 20000 + (int)(getpid() % 20000));
    snprintf(prog, sizeof prog, "%s/examples/env/calculator_env.py", src);
    snprintf(log, sizeof log, "%s/env.log", dir);
    char *argv[] = {(char *)py, prog, "--connect", ep, NULL};
    pid_t p = rf_test_spawn(argv, log);
    char *out = NULL, args[200];
    /* a program's stop strings are the recipe's: the built-in adds "</calc>" itself */
    snprintf(args, sizeof args, "--set env.type=external --set env.endpoint=%s --set 'rollout.stop=[\"</calc>\"]'", ep);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "python", args);
    CHECK(rc == 0);
    if (rc != 0) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    CHECK(same_steps("full", "python", 1, 6));
    CHECK(rf_test_wait(p, 10) == 0);
    printf("the calculator as a Python program: the built-in's 6 steps, bit for bit\n");
}

/* env.programs: the calculator programs started by rlflow give the built-in's run. */
static void started_programs(void) {
    const char *c_prog = getenv("RF_ENV_CALC_C"), *src = getenv("RF_SOURCE_DIR"), *py = "/usr/bin/python3";
    int have_py = src && rf_test_sh(NULL, "%s -c 'import zmq, google.protobuf' >/dev/null 2>&1", py) == 0;
    for (int k = 0; k < 2; k++) {
        if (k == 0 && !c_prog) {
            printf("skipped: env.programs with the C calculator (RF_ENV_CALC_C not set)\n");
            continue;
        }
        if (k == 1 && !have_py) {
            printf("skipped: env.programs with the Python calculator (no python3 with zmq and protobuf)\n");
            continue;
        }
        char args[1200], *out = NULL;
        const char *name = k ? "py_started" : "c_started";
        if (k) snprintf(args, sizeof args, "--set env.type=external --set 'rollout.stop=[\"</calc>\"]' "
                        "--set 'env.programs=[[\"%s\", \"%s/examples/env/calculator_env.py\"]]'", py, src);
        else snprintf(args, sizeof args, "--set env.type=external --set 'rollout.stop=[\"</calc>\"]' "
                      "--set 'env.programs=[[\"%s\"]]'", c_prog);
        int rc = rf_test_run_recipe(&out, dir, rlflow, name, args);
        CHECK(rc == 0);
        CHECK(out && strstr(out, "env.programs[0]: started ") && strstr(out, "environment program rlflow started on tcp://127.0.0.1:"));
        if (rc != 0) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
        CHECK(same_steps("full", name, 1, 6));
        printf("the calculator as a %s program rlflow started: the built-in's 6 steps, bit for bit\n", k ? "Python" : "C");
    }
}

/* The environment program written from the docs alone (examples/env/wire_env.py). */
static void wire_program(void) {
    const char *src = getenv("RF_SOURCE_DIR"), *py = "/usr/bin/python3";
    if (!src || rf_test_sh(NULL, "%s -c 'import zmq' >/dev/null 2>&1", py) != 0) {
        printf("skipped: examples/env/wire_env.py (no python3 with zmq)\n");
        return;
    }
    char args[1200], *out = NULL;
    snprintf(args, sizeof args, "--set env.type=external --set 'rollout.stop=[\"</calc>\"]' "
             "--set 'env.programs=[[\"%s\", \"%s/examples/env/wire_env.py\"]]'", py, src);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "wire", args);
    CHECK(rc == 0);
    CHECK(out && strstr(out, "environment program 'wire_env' (rank 0, pid "));
    if (rc != 0) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    double turns = 0, obs = 0, bad = 0;
    for (int s = 1; s <= 6; s++) {
        turns += rf_test_metric(dir, "wire", s, "env/turns_mean") / 6;
        obs += rf_test_metric(dir, "wire", s, "env/observation_tokens_mean") / 6;
        bad += rf_test_metric(dir, "wire", s, "env/rejected") + rf_test_metric(dir, "wire", s, "env/resent");
    }
    CHECK(turns > 1.05 && obs > 1 && bad == 0);
    printf("the environment program written from the docs alone: %.2f turns and %.1f observation tokens per "
           "episode, %.0f replies rejected or re-sent\n", turns, obs, bad);
}

int main(void) {
    rlflow = getenv("RF_RLFLOW");
    if (!rlflow) {
        printf("skipped: RF_RLFLOW not set\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_run_env_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    (void)rf_test_write_recipe; /* run_util.h's arithmetic recipe: this test writes its own */
    write_recipe();
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "full", "");
    CHECK(rc == 0);
    if (rc != 0) fprintf(stderr, "%s\n", out ? out : "");
    free(out), out = NULL;
    uses_the_tool();
    rc = rf_test_run_recipe(&out, dir, rlflow, "half", "--set train.steps=3");
    CHECK(rc == 0);
    free(out), out = NULL;
    rc = rf_test_run_recipe(&out, dir, rlflow, "half", "--resume");
    CHECK(rc == 0);
    if (rc != 0) fprintf(stderr, "%s\n", out ? out : "");
    free(out), out = NULL;
    CHECK(same_steps("full", "half", 4, 6));
    printf("multi-turn resume: 3 + 3 steps = 6 steps, bit for bit\n");
    python_program();
    started_programs();
    wire_program();
    if (!rf_test_failed) rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_run_env");
}
