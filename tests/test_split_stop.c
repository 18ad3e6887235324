/* Stopping and resuming runs (issue 23), on the 1-digit arithmetic task (tests/run_util.h):
 *   - Ctrl-C: a one-process run sent SIGINT after step 3 exits 130, says "interrupted at step
 *     N: checkpoint written to DIR/step_00000N; resume with --resume", leaves that checkpoint,
 *     and `--resume` ends at the same step-30 rewards and gradient norm as a run never stopped
 *     (bit-exact resume on the CPU); a second SIGINT ends the run at once (killed by SIGINT);
 *   - SIGTERM to a split run (staleness 0: deterministic): exit 143, the same message, the
 *     workers end cleanly, and `--resume` matches the uninterrupted split run at step 12 (bit
 *     for bit where the rollout worker's products are batch-invariant);
 *   - colocated on 2 devices (placement.actor.dp = 2) resumed from its step-3 checkpoint, and
 *     from a one-process run's: both finish (they hung: the data-parallel peer handed its
 *     rollout rank version 0), the first with the uninterrupted run's step 4-6 rewards;
 *   - async.progress_timeout: rollout workers that take requests and never answer (a test hook)
 *     while heartbeating stop the run with an error saying what each role was doing;
 *   - rogue clients on the controller's endpoint (Hello as rollout worker rank 7 without CURVE,
 *     and with CURVE keys that are not the run's) are refused and logged; the run finishes.
 * Skips (77) when mpirun is not installed. */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/curve.h"
#include "common/msg.h"
#include "common/util.h"
#include "kernels/kernels.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

#define QUIET "--set logging.val_every=0 --set checkpoint.every=0"

/* Starts `rlflow run r.toml <args> --set logging.dir=<dir>/<run>` in the background, console
 * in <dir>/<run>.log; returns its pid (the rlflow process itself). */
static pid_t start_run(const char *run, const char *args, const char *env) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd %s && rm -rf %s %s.log && exec env %s %s run r.toml %s --set logging.dir=%s/%s > %s.log 2>&1",
             dir, run, run, env ? env : "", rlflow, args, dir, run, run);
    pid_t p = fork();
    if (p == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return p;
}

/* Waits (at most 300 s) until <dir>/<run>.log holds needle; 1 when it does. */
static int wait_log(const char *run, const char *needle) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s.log", dir, run);
    for (int i = 0; i < 30000; i++) {
        if (rf_test_file_has(p, needle)) return 1;
        rf_sleep(0.01);
    }
    return 0;
}

static int wait_exit(pid_t p, int *signalled) {
    int ws = 0;
    waitpid(p, &ws, 0);
    *signalled = WIFSIGNALED(ws) ? WTERMSIG(ws) : 0;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static void log_has(const char *run, const char *needle) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s.log", dir, run);
    int ok = rf_test_file_has(p, needle);
    CHECK(ok);
    if (!ok) fprintf(stderr, "want \"%s\" in %s\n", needle, p);
}

/* The interrupted step from "interrupted at step N:" in the run's log; -1 when absent. */
static int interrupted_step(const char *run) {
    char p[512], *text;
    snprintf(p, sizeof p, "%s/%s.log", dir, run);
    if (rf_read_file(p, &text, NULL) != RF_OK) return -1;
    const char *at = strstr(text, "interrupted at step ");
    int n = at ? atoi(at + strlen("interrupted at step ")) : -1;
    char want[512];
    if (n >= 0) {
        snprintf(want, sizeof want, "interrupted at step %d: checkpoint written to %s/%s/step_%06d; resume with --resume", n,
                 dir, run, n);
        CHECK(strstr(text, want) != NULL);
        if (!strstr(text, want)) fprintf(stderr, "want \"%s\" in:\n%s\n", want, text);
    }
    free(text);
    return n;
}

/* Metric `name` at `step` of runs a and b: equal within rtol (0: bit for bit). */
static void same_metric(const char *a, const char *b, int step, const char *name, double rtol) {
    double x = rf_test_metric(dir, a, step, name), y = rf_test_metric(dir, b, step, name);
    int ok = !isnan(x) && !isnan(y) && fabs(x - y) <= rtol * fabs(x);
    CHECK(ok);
    if (!ok) fprintf(stderr, "%s step %d %s: %.9g vs %s %.9g\n", a, step, name, x, b, y);
}

/* Metric `name` at `step` of runs a and b: equal within an absolute tolerance. */
static void same_metric_abs(const char *a, const char *b, int step, const char *name, double atol) {
    double x = rf_test_metric(dir, a, step, name), y = rf_test_metric(dir, b, step, name);
    int ok = !isnan(x) && !isnan(y) && fabs(x - y) <= atol;
    CHECK(ok);
    if (!ok) fprintf(stderr, "%s step %d %s: %.9g vs %s %.9g (tolerance %g)\n", a, step, name, x, b, y, atol);
}

/* Stops `run` with sig after step 3 and resumes it; its final step must match `full`'s. */
static void stop_and_resume(const char *run, const char *full, const char *args, int sig, int steps, const char *env,
                            int split) {
    pid_t p = start_run(run, args, env);
    CHECK(wait_log(run, "step 3/"));
    kill(p, sig);
    int killed, rc = wait_exit(p, &killed);
    CHECK(rc == 128 + sig);
    if (rc != 128 + sig) fprintf(stderr, "%s: exit %d (signal %d)\n", run, rc, killed);
    int n = interrupted_step(run);
    CHECK(n >= 3 && n < steps);
    char ck[512];
    snprintf(ck, sizeof ck, "%s/%s/step_%06d/trainer_state.json", dir, run, n);
    CHECK(access(ck, R_OK) == 0);
    char *out = NULL;
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "--resume %s", args);
    int rc2 = rf_test_sh(&out, "cd %s && env %s %s run r.toml %s --set logging.dir=%s/%s", dir, env ? env : "", rlflow, cmd,
                         dir, run);
    CHECK(rc2 == 0);
    if (rc2) fprintf(stderr, "%s\n", out);
    free(out);
    /* One process: the same samples after the stop and the same gradient norm, bit for bit;
     * split runs too where the rollout worker's products are batch-invariant
     * (rf_cpu_batch_invariant_exact). Elsewhere its behaviour log-probs depend in their last
     * bits on which sequences it batched together, which changes from run to run (two
     * uninterrupted split runs differed by ~1e-5 in the gradient norm from step 1), so the
     * weights differ in the last bits and a sampled token can flip some steps later (seen: step
     * 11's reward 0.2890625 against 0.3046875, 2 of 128 samples): rewards within 0.05 (6 of 128
     * samples), the gradient norm within 1e-5 at the first step after the stop. A resume that
     * lost or repeated data would move the rewards and the norm far more. */
    int loose = split && !rf_test_auto_exact();
    for (int s = n + 1; s <= steps; s++)
        if (loose) same_metric_abs(run, full, s, "reward/mean", 0.05);
        else same_metric(run, full, s, "reward/mean", 0);
    same_metric(run, full, loose ? n + 1 : steps, "actor/grad_norm", loose ? 1e-5 : 0);
}

static void run_ok(const char *run, const char *args) {
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, run, args);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
}

static void interrupts(void) {
    const char *one = "--set train.steps=30 " QUIET;
    run_ok("one_full", one);
    stop_and_resume("one_int", "one_full", one, SIGINT, 30, NULL, 0);
    /* a second Ctrl-C: at once */
    pid_t p = start_run("one_twice", "--set train.steps=100000 " QUIET, NULL);
    CHECK(wait_log("one_twice", "step 2/"));
    kill(p, SIGINT);
    kill(p, SIGINT);
    int killed, rc = wait_exit(p, &killed);
    CHECK(killed == SIGINT || rc == 130);
    const char *split = "--set train.steps=12 --set placement.mode=split --set async.max_staleness=0 " QUIET;
    run_ok("split_full", split);
    stop_and_resume("split_int", "split_full", split, SIGTERM, 12, "RF_TEST_DELAY_TRAIN_MS=300", 1);
    log_has("split_int", "interrupted (signal 15): step ");
    /* the workers ended as after a complete run: no rank reported an error */
    char lp[512];
    snprintf(lp, sizeof lp, "%s/split_int.log", dir);
    CHECK(!rf_test_file_has(lp, "error"));
}

static void colocated_resume(void) {
    const char *colo = "--set train.steps=6 --set logging.val_every=0 --set checkpoint.every=3 --set placement.actor.dp=2";
    run_ok("colo_full", colo);
    run_ok("one6", "--set train.steps=6 --set logging.val_every=0 --set checkpoint.every=3");
    const char *from[2] = {"colo_full", "one6"}, *to[2] = {"colo_res", "colo_from_one"};
    for (int i = 0; i < 2; i++) {
        char *out = NULL;
        int rc = rf_test_sh(&out, "cd %s && rm -rf %s && mkdir %s && cp -r %s/step_000003 %s/ && echo step_000003 > %s/latest && "
                                  "timeout 300 %s run r.toml --resume %s --set logging.dir=%s/%s",
                            dir, to[i], to[i], from[i], to[i], to[i], rlflow, colo, dir, to[i]);
        CHECK(rc == 0 && strstr(out, "resumed at step 3") && strstr(out, "step 6/6"));
        if (rc || !strstr(out, "step 6/6")) fprintf(stderr, "%s\n", out);
        free(out);
    }
    for (int s = 4; s <= 6; s++) same_metric("colo_res", "colo_full", s, "reward/mean", 0);
}

static void progress_bound(void) {
    char *out = NULL;
    int rc = rf_test_sh(&out, "cd %s && RF_TEST_ROLLOUT_STALL=1 %s run r.toml --set placement.mode=split "
                              "--set async.progress_timeout=4 --set train.steps=3 " QUIET " --set logging.dir=%s/stall",
                        dir, rlflow, dir);
    CHECK(rc == 1);
    const char *want[] = {"no progress for ", " s (async.progress_timeout = 4; no step, sample, score or weights report while "
                          "every worker answers heartbeats) at step 0: training worker (pid ",
                          "): idle, waiting for a batch (the buffer holds 0 of the 16 groups a step takes, 16 in flight); "
                          "rollout worker 0 (pid ", "): generating 16 groups with weights version 0"};
    CHECK(rf_test_has_all(out, want, 3));
    free(out);
}

/* A client that says Hello as rollout worker rank 7; keys: NULL plain, else a fresh key pair
 * and a made-up server key. It must not get in. */
static void rogue(const char *endpoint, int curve) {
    rf_curve_key spub, ssec, pub, sec;
    rf_msg_client_config cc = {.endpoint = endpoint, .role = RLFLOW__ROLE__ROLE_ROLLOUT, .rank = 7, .name = "rogue",
                               .timeout_s = 2, .monitor = 1};
    if (curve) {
        CHECK(rf_curve_keypair(spub, ssec) == RF_OK && rf_curve_keypair(pub, sec) == RF_OK);
        cc.curve_server_key = spub, cc.curve_public_key = pub, cc.curve_secret_key = sec;
    }
    rf_msg_client *c = NULL;
    CHECK(rf_msg_client_connect(&c, &cc) != RF_OK && !c);
    rf_msg_client_close(c);
    rf_error_clear();
}

static void rogues(void) {
    pid_t p = start_run("rogue", "--set train.steps=8 --set placement.mode=split " QUIET, "RF_TEST_DELAY_TRAIN_MS=400");
    CHECK(wait_log("rogue", "step 1/"));
    char path[512], *text = NULL, ep[256] = "";
    snprintf(path, sizeof path, "%s/rogue.log", dir);
    if (rf_read_file(path, &text, NULL) == RF_OK) {
        const char *at = strstr(text, "controller at ");
        if (at) sscanf(at + strlen("controller at "), "%255s", ep);
    }
    free(text);
    CHECK(strncmp(ep, "tcp://127.0.0.1:", 16) == 0); /* one machine: loopback */
    rogue(ep, 0);
    rogue(ep, 1);
    int killed, rc = wait_exit(p, &killed);
    CHECK(rc == 0);
    log_has("rogue", "step 8/8");
    char want[512];
    /* without CURVE: a mechanism mismatch, or the client's close seen first (either is logged) */
    char a[512], b[512];
    snprintf(a, sizeof a, "warning: refused a connection to %s without CURVE: this endpoint requires CURVE", ep);
    snprintf(b, sizeof b, "warning: refused a connection to %s: the peer closed it during the CURVE handshake", ep);
    CHECK(rf_test_file_has(path, a) || rf_test_file_has(path, b));
    snprintf(want, sizeof want, "warning: refused a connection to %s: its CURVE handshake failed with a cryptographic error", ep);
    log_has("rogue", want);
}

int main(void) {
    int start = rf_test_split_start("test_split_stop", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\npeer_timeout = 30\n");
    interrupts();
    colocated_resume();
    progress_bound();
    rogues();
    if (!rf_test_failed) rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_stop");
}
