/* Exact resume from a stop inside a dynamic-sampling step (algorithm.dynamic_sampling: groups
 * whose rewards are all equal are dropped and replaced in the step's next round, here at most
 * one: algorithm.max_resample_rounds = 1). On the 1-digit arithmetic task (tests/run_util.h),
 * 8 steps, the prompts in file order (data.shuffle = false) with some answers no response can
 * match (every reward 0: the group is dropped): lines 0-15 (batch 0's first round, all
 * dropped; its second round, lines 16-31, is kept whatever it scores) and line 32, the first
 * prompt of batch 1, which is therefore dropped in every run: the case that broke resume
 * (a resumed run started from the oldest prompt still in flight, line 33, and batch 1 and all
 * after it trained on other prompts).
 *   - for batch 1 and up to two more batches that dropped groups, the run is stopped (test hook
 *     RF_TEST_STOP_AT="S.1": a stop, as by SIGINT, asked for when batch S admits its first
 *     replacement: its first round scored, some groups dropped, the replacements in flight),
 *     exits 130 with "interrupted at step S: checkpoint written to <dir>/step_00000S; resume
 *     with --resume", and `--resume` then logs every step's metrics (all but the wall-clock
 *     ones: time, perf/, time/, idle/) equal, bit for bit, to the uninterrupted run's, ends with
 *     a byte-identical model.safetensors at step 8, and the same trainer_state.json (admission
 *     count included: reward and environment programs see the same group ids);
 *   - the same, bit for bit, in a split run (a controller, a training worker and a rollout
 *     worker under mpirun, async.max_staleness = 0) stopped in batch 1, against the
 *     uninterrupted split run, and a second uninterrupted split run likewise. The rollout worker
 *     batches sequences as requests arrive, so which sequences share a decoding step differs
 *     from run to run; before the rollout worker's products were made batch-invariant
 *     (rf_cpu_batch_invariant_exact) a step of up to 4 sequences rounded otherwise, and two
 *     uninterrupted split runs already parted in the last bits of the behaviour log-probs from
 *     step 1 (6e-7 of the largest weight after 8 steps);
 *   - a checkpoint of an older release (trainer_state.json without "admitted") resumes, and
 *     one whose "admitted" is not a whole number >= 0 is refused naming the file and key.
 * Split part skipped when mpirun is missing, or where the CPU back end's products are not
 * batch-invariant (kernels.h rf_cpu_batch_invariant_exact: oneDNN without its AVX-512 kernels). */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "test_shell.h"
#include "run_util.h"
#include "spawn_util.h"
#include "test_util.h"

#define STEPS 8

static const char *rlflow;
static char dir[256];

static char *record_of(const char *run, int step) { return rf_test_record_of(dir, run, step); }

/* Whether step's record of run equals that of run `full`, bit for bit: every key both ways,
 * doubles printed exactly (cJSON prints 17 digits where 15 do not read back). */
static int same_record(const char *full, const char *run, int step) {
    char *a = record_of(full, step), *b = record_of(run, step);
    int ok = a && b && strcmp(a, b) == 0;
    if (!ok) fprintf(stderr, "step %d differs:\n  %s: %s\n  %s: %s\n", step, full, a ? a : "(none)", run, b ? b : "(none)");
    free(a), free(b);
    return ok;
}

/* The file at <dir>/<a> and <dir>/<b> hold the same bytes (and exist). */
static int same_file(const char *a, const char *b) {
    return rf_test_sh(NULL, "cd %s && cmp -s %s %s", dir, a, b) == 0;
}

/* The largest difference between the parameters of the actors in checkpoint STEPS of runs a and
 * b, over their largest magnitude; 1 when either does not load. */
static double weights_apart(const char *a, const char *b) {
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s/step_%06d/actor", dir, a, STEPS);
    snprintf(pb, sizeof pb, "%s/%s/step_%06d/actor", dir, b, STEPS);
    rf_model *x = NULL, *y = NULL;
    double most = 0, diff = 1;
    if (rf_model_load(&x, pa, rf_cpu_kernels(), 0) == RF_OK && rf_model_load(&y, pb, rf_cpu_kernels(), 0) == RF_OK &&
        x->n_params == y->n_params) {
        diff = 0;
        for (size_t i = 0; i < x->n_params; i++) {
            most = fmax(most, fabs((double)x->params[i]));
            diff = fmax(diff, fabs((double)x->params[i] - (double)y->params[i]));
        }
        diff = most > 0 ? diff / most : 1;
    }
    rf_error_clear();
    rf_model_free(x), rf_model_free(y);
    return diff;
}

/* For each batch in at[] (n), the run "<name><S>" stopped when batch S admits its first
 * replacement, resumed, and compared with `full` (metrics, weights, trainer_state.json). */
static void stop_and_resume(const char *full, const char *name, const char *args, const int *at, int n) {
    for (int i = 0; i < n; i++) {
        int S = at[i];
        char run[64], *out = NULL;
        snprintf(run, sizeof run, "%s%d", name, S);
        int rc = rf_test_sh(&out, "cd %s && RF_TEST_STOP_AT=%d.1 %s run r.toml %s --set logging.dir=%s/%s 2>&1", dir, S,
                            rlflow, args, dir, run);
        char want[600];
        snprintf(want, sizeof want, "interrupted at step %d: checkpoint written to %s/%s/step_%06d; resume with --resume", S,
                 dir, run, S);
        int stopped = rc == 130 && out && strstr(out, want);
        printf("%s: stopped inside batch %d's resample round 1: exit %d%s\n", run, S, rc, stopped ? ", checkpoint written" : "");
        CHECK(stopped);
        if (!stopped) fprintf(stderr, "want exit 130 and \"%s\" in:\n%s\n", want, out ? out : "");
        free(out);
        rc = rf_test_sh(&out, "cd %s && %s run r.toml %s --set logging.dir=%s/%s --resume 2>&1", dir, rlflow, args, dir, run);
        char resumed[64];
        snprintf(resumed, sizeof resumed, "resumed at step %d", S);
        CHECK(rc == 0 && out && strstr(out, resumed));
        if (rc || !out || !strstr(out, resumed)) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
        int same = 0;
        for (int s = 0; s <= STEPS; s++) same += same_record(full, run, s);
        char a[300], b[300], ta[300], tb[300];
        snprintf(a, sizeof a, "%s/step_%06d/actor/model.safetensors", full, STEPS);
        snprintf(b, sizeof b, "%s/step_%06d/actor/model.safetensors", run, STEPS);
        snprintf(ta, sizeof ta, "%s/step_%06d/trainer_state.json", full, STEPS);
        snprintf(tb, sizeof tb, "%s/step_%06d/trainer_state.json", run, STEPS);
        int identical = same_file(a, b), state = same_file(ta, tb);
        double apart = weights_apart(full, run);
        printf("%s resumed: %d of %d steps' metrics equal to %s's, final weights %s (%.3g of the largest apart), "
               "trainer_state.json %s\n", run, same, STEPS + 1, full, identical ? "identical" : "not byte-identical", apart,
               state ? "identical" : "DIFFERENT");
        CHECK(same == STEPS + 1);
        CHECK(identical);
        CHECK(state);
    }
}

/* Batch 1, then up to cap - 1 later batches (not the last) of run that dropped groups; the
 * number found. */
static int batches_with_drops(const char *run, int *at, int cap) {
    int n = 0;
    for (int s = 2; s <= STEPS; s++) { /* batch s - 1 is logged at step s */
        double d = rf_test_metric(dir, run, s, "rollout/dropped_groups");
        printf("%s: batch %d: %.0f groups dropped\n", run, s - 1, d);
        if (s == 2) CHECK(d >= 1); /* line 32 */
        if ((s == 2 || d > 0) && s < STEPS && n < cap) at[n++] = s - 1;
    }
    return n;
}

/* An older checkpoint (no "admitted") resumes; a bad "admitted" is refused with its file named. */
static void older_checkpoints(const char *full, const char *args, int S) {
    char *out = NULL;
    CHECK(rf_test_sh(NULL, "cd %s && rm -rf old bad && mkdir old bad && cp -r %s/step_%06d old/ && cp -r %s/step_%06d bad/ && "
                     "echo step_%06d > old/latest && echo step_%06d > bad/latest && "
                     "sed -i '/\"admitted\"/d' old/step_%06d/trainer_state.json && "
                     "sed -i 's/\"admitted\":[^,]*,/\"admitted\": 2.5,/' bad/step_%06d/trainer_state.json && "
                     "! grep -q admitted old/step_%06d/trainer_state.json && grep -q '\"admitted\": 2.5' bad/step_%06d/trainer_state.json",
                     dir, full, S, full, S, S, S, S, S, S, S) == 0);
    int rc = rf_test_sh(&out, "cd %s && %s run r.toml %s --set train.steps=%d --set logging.dir=%s/old --resume 2>&1", dir, rlflow,
                        args, S + 1, dir);
    char want[600];
    snprintf(want, sizeof want, "resumed at step %d", S);
    CHECK(rc == 0 && out && strstr(out, want));
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    rc = rf_test_sh(&out, "cd %s && %s run r.toml %s --set logging.dir=%s/bad --resume 2>&1", dir, rlflow, args, dir);
    snprintf(want, sizeof want, "%s/bad/step_%06d/trainer_state.json: \"admitted\" = 2.5: not a whole number of groups >= 0",
             dir, S);
    CHECK(rc == 1 && out && strstr(out, want));
    if (!(rc == 1 && out && strstr(out, want))) fprintf(stderr, "want exit 1 and \"%s\" in:\n%s\n", want, out ? out : "");
    else printf("a bad \"admitted\" refused: %s\n", want);
    free(out);
}

static int run_ok(const char *run, const char *args) {
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, run, args);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    return rc;
}

int main(void) {
    int start = rf_test_run_start("test_run_resample", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, RF_TEST_VAL_ENDS, "");
    /* the data set and the SFT warm start, then the prompts with answers no response matches */
    if (run_ok("prep", "--set train.steps=1")) return rf_test_finish("test_run_resample");
    CHECK(rf_test_sh(NULL, "cd %s && awk '{ if (NR <= 16 || NR == 33) sub(/\"answer\":\"[^\"]*\"/, \"\\\"answer\\\":\\\"-99999\\\"\"); "
                     "print }' data/train.jsonl > data/resample.jsonl && [ $(grep -c 99999 data/resample.jsonl) = 17 ]", dir) == 0);
    char one[512];
    snprintf(one, sizeof one, "--set train.steps=%d --set algorithm.dynamic_sampling=true --set algorithm.max_resample_rounds=1 "
             "--set data.train=%s/data/resample.jsonl --set data.shuffle=false", STEPS, dir);
    run_ok("full", one);
    CHECK(rf_test_metric(dir, "full", 1, "rollout/dropped_groups") == 16);
    int at[3], n = batches_with_drops("full", at, 3);
    stop_and_resume("full", "stop", one, at, n);
    older_checkpoints("stop1", one, 1);
    if (rf_test_sh(NULL, "command -v mpirun >/dev/null") != 0) {
        printf("test_run_resample: split part skipped: mpirun not found\n");
    } else if (!rf_test_auto_exact()) {
        printf("test_run_resample: split part skipped: the CPU back end's products are not batch-invariant on this CPU "
               "(kernels.h rf_cpu_batch_invariant_exact), so split runs agree only to the last bits\n");
    } else {
        char split[1024];
        snprintf(split, sizeof split, "%s --set placement.mode=split --set placement.rollout_ranks=1 "
                 "--set async.max_staleness=0", one);
        run_ok("sfull", split);
        run_ok("sfull2", split);
        for (int s = 0; s <= STEPS; s++) CHECK(same_record("sfull", "sfull2", s));
        CHECK(same_file("sfull/step_000008/actor/model.safetensors", "sfull2/step_000008/actor/model.safetensors"));
        int b1 = 1;
        stop_and_resume("sfull", "sstop", split, &b1, 1);
    }
    if (!rf_test_failed) rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_run_resample");
}
