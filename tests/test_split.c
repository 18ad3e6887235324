/* Split runs end to end under mpirun (rlflow starts it): a controller, a training worker and a
 * rollout worker as three processes on the 1-digit arithmetic task.
 *   - k = 1: the training reward rises (mean of steps 101-120 above steps 1-20 by a margin),
 *     every batch is at most 1 version stale and at least one batch is exactly 1 stale
 *     (generation really ran ahead), nothing was dropped as stale, the final validation and
 *     checkpoint are there, run_status.json says ok;
 *   - k = 0: every sample is on-policy (staleness 0 at every step);
 *   - k = 1 and 2 with random delays injected in generation and in training: staleness never
 *     exceeds k, reaches it, and no group is dropped;
 *   - a rollout worker killed (SIGKILL) mid-run: `rlflow run` fails within seconds naming it,
 *     the last checkpoint is intact, and --resume finishes the run from it;
 *   - reward programs in C and Python score the samples; the C one crashes mid-run and the run
 *     goes on;
 *   - an MPI job of the wrong size is refused with the exact error;
 *   - no rank of a CPU run opens the CUDA module.
 * Without mpirun too: the GPU each world rank takes with model.device = "cuda" (one machine
 * and two, fewer GPUs than ranks). Skips (77) when mpirun is not installed. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "controller/launch.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

static void write_recipe(void) {
    rf_test_write_recipe(dir, 60, "[async]\nmax_staleness = 1\npeer_timeout = 10\n"
                                  "[placement]\nmode = \"split\"\nrollout_ranks = 1\n");
}

static double metric(const char *run, int step, const char *name) { return rf_test_metric(dir, run, step, name); }

static double mean_of(const char *run, const char *name, int from, int to) {
    return rf_test_metric_mean(dir, run, name, from, to);
}

static int file_has(const char *path, const char *needle) {
    char *text;
    if (rf_read_file(path, &text, NULL) != RF_OK) return 0;
    int r = strstr(text, needle) != NULL;
    free(text);
    return r;
}

static void async_k1(void) {
    char *out, p[512];
    int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set logging.dir=%s/k1", dir, rlflow, dir);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    CHECK(strstr(out, "rank 2: rollout worker 0") != NULL);
    CHECK(strstr(out, "validation at version 120: accuracy") != NULL);
    /* one host: the rollout worker copies the staged weights in place */
    CHECK(strstr(out, "weights to 1 rollout worker(s): 1 read the stage in place (same host, one copy), 0 through messages") != NULL);
    free(out);
    double a = mean_of("k1", "reward/mean", 1, 20), b = mean_of("k1", "reward/mean", 101, 120);
    printf("split k=1: mean reward steps 1-20 %.3f, steps 101-120 %.3f\n", a, b);
    rf_test_learned(dir, rlflow, "k1", "", &a, &b);
    int max_ok = 1, one = 0;
    for (int s = 1; s <= 120; s++) {
        double m = metric("k1", s, "async/staleness_max");
        max_ok &= m >= 0 && m <= 1;
        one += metric("k1", s, "async/staleness_frac_1") > 0;
    }
    CHECK(max_ok);
    CHECK(one > 10);
    CHECK(metric("k1", 120, "async/stale_dropped") == 0);
    CHECK(metric("k1", 120, "val/accuracy") >= 0);
    CHECK(metric("k1", 50, "idle/rollout") >= 0);
    snprintf(p, sizeof p, "%s/k1/run_status.json", dir);
    CHECK(file_has(p, "\"status\":\"ok\""));
    snprintf(p, sizeof p, "%s/k1/step_000120/actor/model.safetensors", dir);
    CHECK(rf_file_exists(p));
}

static void sync_k0(void) {
    char *out;
    int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=30 --set async.max_staleness=0 --set logging.dir=%s/k0", dir, rlflow, dir);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    int ok = 1;
    for (int s = 1; s <= 30; s++) ok &= metric("k0", s, "async/staleness_max") == 0;
    CHECK(ok);
}

/* Random delays in generation and in training: the bound holds at every step, nothing is
 * dropped, and the bound is reached (generation did run k versions ahead). */
static void delays(int k, const char *rollout_ms, const char *train_ms) {
    char *out, run[32];
    snprintf(run, sizeof run, "delay_k%d", k);
    int rc = rf_test_sh(&out, "cd %s && RF_TEST_DELAY_ROLLOUT_MS=%s RF_TEST_DELAY_TRAIN_MS=%s %s run r.toml "
                        "--set train.steps=40 --set logging.val_every=0 --set async.max_staleness=%d "
                        "--set logging.dir=%s/%s", dir, rollout_ms, train_ms, rlflow, k, dir, run);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    int within = 1, at_k = 0;
    for (int s = 1; s <= 40; s++) {
        double m = metric(run, s, "async/staleness_max");
        within &= m >= 0 && m <= k;
        at_k += m == k;
    }
    printf("delays k=%d (rollout %s ms, train %s ms): %d of 40 steps at staleness %d\n", k, rollout_ms, train_ms, at_k, k);
    CHECK(within);
    CHECK(at_k > 0);
    CHECK(metric(run, 40, "async/stale_dropped") == 0);
}

static void worker_killed(void) {
    char *out, p[512];
    /* kill the rollout worker once step 45 is logged (checkpoint at 40) */
    int rc = rf_test_sh(&out,
                        "cd %s && { %s run r.toml --set train.steps=400 --set logging.dir=%s/kill > %s/kill.log 2>&1; echo $? > %s/kill.rc; } &\n"
                        "for i in $(seq 1200); do grep -q '\"step\": 45,' %s/kill/metrics.jsonl 2>/dev/null && break; sleep 0.1; done\n"
                        "pid=$(sed -n 's/.*joined: rollout worker .*pid \\([0-9]*\\)).*/\\1/p' %s/kill.log | head -1)\n"
                        "kill -9 $pid; t0=$(date +%%s.%%N); wait; echo \"stopped after $(echo \"$(date +%%s.%%N) - $t0\" | bc) s\"",
                        dir, rlflow, dir, dir, dir, dir, dir);
    CHECK(rc == 0);
    printf("%s", out);
    free(out);
    snprintf(p, sizeof p, "%s/kill.rc", dir);
    CHECK(file_has(p, "1"));
    snprintf(p, sizeof p, "%s/kill.log", dir);
    CHECK(file_has(p, "error: rollout worker 'rollout' (rank 0, pid "));
    snprintf(p, sizeof p, "%s/kill/run_status.json", dir);
    CHECK(file_has(p, "\"status\":\"error\""));
    snprintf(p, sizeof p, "%s/kill/latest", dir);
    char *latest = NULL;
    CHECK(rf_read_file(p, &latest, NULL) == RF_OK);
    int step = latest ? atoi(latest + 5) : -1;
    free(latest);
    printf("last checkpoint: step %d\n", step);
    CHECK(step >= 40 && step % 20 == 0);
    /* the checkpoint is whole: resume and finish */
    rc = rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=%d --set logging.dir=%s/kill --resume", dir,
                    rlflow, step + 20, dir);
    CHECK(rc == 0);
    char want[64];
    snprintf(want, sizeof want, "resumed at step %d", step);
    CHECK(strstr(out, want) != NULL);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(metric("kill", step + 20, "reward/mean") >= 0);
}

/* Reward programs in a split run: a C program that dies after 30 requests and a Python one,
 * both on the controller's reward endpoint; the run finishes, the crash is reported, and the
 * Python program took over its requests. */
static void reward_programs(void) {
    const char *echo = getenv("RF_REWARD_ECHO"), *src = getenv("RF_SOURCE_DIR");
    /* a python3 that imports zmq: the one in PATH, else Debian's */
    const char *py = rf_test_sh(NULL, "python3 -c 'import zmq' 2>/dev/null") == 0 ? "python3"
                   : rf_test_sh(NULL, "/usr/bin/python3 -c 'import zmq' 2>/dev/null") == 0 ? "/usr/bin/python3"
                   : NULL;
    if (!echo || !src || !py) {
        printf("test_split: reward programs part skipped (needs RF_REWARD_ECHO, RF_SOURCE_DIR, python3-zmq)\n");
        return;
    }
    char *out;
    int rc = rf_test_sh(&out, "cd %s && (sleep 1; %s --connect ipc://%s/rw.sock --name c_echo --mode die --after 30) & "
                        "(sleep 1; %s %s/examples/reward/length_judge.py --connect ipc://%s/rw.sock --target 3) & "
                        "cd %s && %s run r.toml --set train.steps=20 --set logging.val_every=0 --set logging.val_size=4 "
                        "--set logging.dir=%s/rp "
                        "--set reward.external=ipc://%s/rw.sock --set reward.external_weight=0.01 "
                        "--set reward.external_timeout=20; rc=$?; wait; exit $rc",
                        dir, echo, dir, py, src, dir, dir, rlflow, dir, dir);
    CHECK(rc == 0);
    CHECK(strstr(out, "'c_echo'") != NULL);
    CHECK(strstr(out, "'length_judge'") != NULL || strstr(out, "length_judge") != NULL);
    CHECK(strstr(out, "step 20/20") != NULL);
    if (rc || !strstr(out, "step 20/20")) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(metric("rp", 20, "reward/mean") >= 0);
    /* the programs' components are logged: echo's "len" (tokens) at the steps whose groups it
     * scored before it died, length_judge's "length" at the last step (it alone is left).
     * Validation is scored by the programs too (docs/training.md): 4 prompts, so that echo's
     * 30 requests are mostly training samples */
    double len = NAN;
    for (int k = 1; k <= 20 && isnan(len); k++) len = metric("rp", k, "reward/external/len");
    double length = metric("rp", 20, "reward/external/length");
    CHECK(len >= 1 && len <= 6);
    CHECK(length >= 1 && length <= 6);
    CHECK(isnan(metric("rp", 20, "reward/external/len")));
}

/* A reward model in a split run: the training worker hosts it and scores each group for the
 * controller. The numeric rule gives reward = accuracy, so reward/mean - reward/accuracy is
 * reward.model_weight times the mean score: 0 without a reward model (run k1), not 0 with. */
static void reward_model_split(void) {
    const char *src = getenv("RF_SOURCE_DIR");
    if (!src) {
        printf("test_split: reward model part skipped (needs RF_SOURCE_DIR)\n");
        return;
    }
    char *out;
    int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=3 --set logging.val_every=0 "
                        "--set logging.dir=%s/rm --set reward.model=%s/tests/data/reward_model "
                        "--set reward.model_weight=100", dir, rlflow, dir, src);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    double plain = 0, with_rm = 0;
    for (int s = 1; s <= 3; s++) {
        plain += fabs(metric("k1", s, "reward/mean") - metric("k1", s, "reward/accuracy"));
        with_rm += fabs(metric("rm", s, "reward/mean") - metric("rm", s, "reward/accuracy"));
    }
    printf("reward model in a split run: |reward - accuracy| summed over 3 steps %.3g (without: %.3g)\n",
           with_rm, plain);
    CHECK(plain < 1e-6);
    CHECK(with_rm > 0.1);
}

/* rf_launch_gpu_of: each machine's worker ranks take its GPUs in turn (one machine of 4 GPUs,
 * and two machines of 2 with the ranks spread as mpirun fills them); the controller none. */
static void gpu_choice(void) {
    const int one[6] = {0, 0, 0, 0, 0, 0}, two[7] = {0, 0, 0, 3, 3, 3, 3};
    const int want_one[6] = {-1, 0, 1, 2, 3, 0}, want_two[7] = {-1, 0, 1, 0, 1, 0, 1};
    for (int r = 0; r < 6; r++) CHECK(rf_launch_gpu_of(one, r, 4) == want_one[r]);
    for (int r = 0; r < 7; r++) CHECK(rf_launch_gpu_of(two, r, 2) == want_two[r]);
    CHECK(rf_launch_gpu_of(one, 1, 0) == -1);
    const int spread[9] = {0, 0, 0, 3, 3, 0, 0, 3, 3}, want_spread[9] = {-1, 0, 1, 0, 1, 2, 3, 2, 3};
    for (int r = 0; r < 9; r++) CHECK(rf_launch_gpu_of(spread, r, 4) == want_spread[r]);
}

/* A CPU split run never opens the CUDA module (docs/cuda.md): the dynamic loader's log
 * (LD_DEBUG=files) of every rank names rlflow's core library and not the module. */
static void cpu_run_skips_cuda(void) {
    char *out = NULL;
    int rc = rf_test_sh(&out, "cd %s && LD_DEBUG=files %s run r.toml --set train.steps=1 --set logging.val_every=0 "
                        "--set logging.dir=%s/nocuda 2>&1 | grep -o 'file=[^ ]*librlflow_[a-z]*' | sort -u", dir, rlflow, dir);
    CHECK(rc == 0 && out && strstr(out, "librlflow_core") != NULL);
    CHECK(out && strstr(out, "librlflow_cuda") == NULL);
    if (!out || !strstr(out, "librlflow_core") || strstr(out, "librlflow_cuda")) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
}

static void wrong_size(void) {
    rf_test_wrong_size(dir, rlflow, 2, "this MPI job has 2 ranks; the recipe needs 3 (controller, training worker and "
                                       "placement.rollout_ranks = 1 rollout workers)");
}

int main(void) {
    gpu_choice();
    int start = rf_test_split_start("test_split", &rlflow, dir, sizeof dir);
    if (start) return start == 77 && rf_test_failed ? 1 : start;
    write_recipe();
    async_k1();
    sync_k0();
    delays(1, "20", "40");
    delays(2, "40", "20");
    worker_killed();
    reward_programs();
    reward_model_split();
    cpu_run_skips_cuda();
    wrong_size();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split");
}
