/* Resuming multi-turn runs (docs/env-api.md, docs/training.md "Checkpoints and resume"): on the
 * multiply task with the calculator tool (tests/run_util.h's calc recipe, fp32, validation at
 * steps 0, 2 and 4), 4 GRPO steps uninterrupted against
 *   - 2 steps, then `--resume` to 4 (its step-2 checkpoint), and
 *   - a run stopped inside step 3 (test hook RF_TEST_STOP_AT="2.0": a stop, as by SIGINT, asked
 *     for when batch 2 admits its first group, its episodes then in flight), exit 130 with the
 *     checkpoint of step 2, then `--resume`,
 * each in one process and in a split run (a controller, a training worker and a rollout worker
 * under mpirun, async.max_staleness = 0). The resumed run must log every step's metrics (all
 * but the wall-clock ones: time, perf/, time/, idle/) as the uninterrupted run of its
 * deployment does, bit for bit, and end with the same model.safetensors byte for byte and the
 * same trainer_state.json. Split runs repeat bit for bit because the CPU back end's products
 * are batch-invariant (kernels.h rf_cpu_batch_invariant_exact: the rollout worker batches
 * sequences as requests and observations arrive; when products of up to 4 rows rounded
 * otherwise, the resumed split runs parted from the uninterrupted one in the behaviour
 * log-probs' last bits from the step after the resume, the weights with them); where they are
 * not (oneDNN without its AVX-512 kernels) the split runs are skipped. Skips (77) without mpirun. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

#define STEPS 4

static const char *rlflow;
static char dir[256];

static char *record_of(const char *run, int step) { return rf_test_record_of(dir, run, step); }

static int run(const char *name, const char *args, const char *env, int want_rc) {
    char *out = NULL;
    int rc = rf_test_sh(&out, "cd %s && %s %s run r.toml %s --set logging.dir=%s/%s 2>&1", dir, env ? env : "", rlflow, args,
                        dir, name);
    CHECK(rc == want_rc);
    if (rc != want_rc) fprintf(stderr, "%s: exit %d, want %d:\n%s\n", name, rc, want_rc, out ? out : "");
    free(out);
    return rc;
}

/* Runs b's steps 0..STEPS against a's (records without wall-clock figures, exactly), the final
 * weights byte for byte and trainer_state.json. */
static void same_as(const char *a, const char *b) {
    int same = 0;
    for (int s = 0; s <= STEPS; s++) {
        char *x = record_of(a, s), *y = record_of(b, s);
        int ok = x && y && strcmp(x, y) == 0;
        same += ok;
        if (!ok) fprintf(stderr, "step %d differs:\n  %s: %s\n  %s: %s\n", s, a, x ? x : "(none)", b, y ? y : "(none)");
        free(x), free(y);
    }
    int weights = rf_test_sh(NULL, "cd %s && cmp -s %s/step_%06d/actor/model.safetensors %s/step_%06d/actor/model.safetensors",
                             dir, a, STEPS, b, STEPS) == 0;
    int state = rf_test_sh(NULL, "cd %s && cmp -s %s/step_%06d/trainer_state.json %s/step_%06d/trainer_state.json", dir, a,
                           STEPS, b, STEPS) == 0;
    printf("%s against %s: %d of %d steps' metrics equal, final weights %s, trainer_state.json %s\n", b, a, same, STEPS + 1,
           weights ? "identical" : "DIFFERENT", state ? "identical" : "DIFFERENT");
    CHECK(same == STEPS + 1);
    CHECK(weights);
    CHECK(state);
}

/* The uninterrupted run <name>_full, then <name>_half (2 steps + --resume to 4) and
 * <name>_stop (stopped inside step 3, --resume), each compared with it. */
static void deployment(const char *name, const char *args) {
    char full[64], half[64], stop[64], a4[1024], a2[1024];
    snprintf(full, sizeof full, "%s_full", name);
    snprintf(half, sizeof half, "%s_half", name);
    snprintf(stop, sizeof stop, "%s_stop", name);
    snprintf(a4, sizeof a4, "%s --set train.steps=%d", args, STEPS);
    snprintf(a2, sizeof a2, "%s --set train.steps=2", args);
    if (run(full, a4, NULL, 0)) return;
    run(half, a2, NULL, 0);
    char resume[1100];
    snprintf(resume, sizeof resume, "%s --resume", a4);
    run(half, resume, NULL, 0);
    same_as(full, half);
    run(stop, a4, "RF_TEST_STOP_AT=2.0", 130);
    CHECK(rf_test_trainer_state(dir, stop, "step_000002", "step") == 2);
    CHECK(isnan(rf_test_metric(dir, stop, 3, "reward/mean"))); /* stopped inside step 3: not logged */
    run(stop, resume, NULL, 0);
    same_as(full, stop);
}

int main(void) {
    int start = rf_test_split_start("test_split_env_resume", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_calc_recipe(dir, STEPS, "[checkpoint]\nkeep = 0\n[async]\npeer_timeout = 60\n");
    /* validation at 0, 2 and 4: the 2-step run's last step is validated as the 4-step run's step 2 */
    deployment("one", "--set logging.val_every=2");
    if (rf_cpu_batch_invariant_exact())
        deployment("split", "--set logging.val_every=2 --set placement.mode=split --set placement.rollout_ranks=1 "
                            "--set async.max_staleness=0");
    else
        printf("test_split_env_resume: split runs skipped: the CPU back end's products are not batch-invariant on this "
               "CPU (kernels.h rf_cpu_batch_invariant_exact), so split runs agree only to the last bits\n");
    if (!rf_test_failed) rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_env_resume");
}
