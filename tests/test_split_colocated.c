/* Colocated runs on several ranks (placement.mode = "colocated" with a parallel layout,
 * rf_recipe_colocated_ranks): the controller, the training ranks and one rollout rank on each
 * training rank's device run under mpirun, generation and training taking turns (staleness 0),
 * on the 1-digit arithmetic task (tests/run_util.h), 3 GRPO steps each:
 *   - dp 2 (5 processes): the layout and the rank table; the step-1 reward of the one-process
 *     colocated run (the same samples: the same policy and seeds), and the split run of the same
 *     layout at staleness 0 with two rollout workers gets its rewards and gradient norms;
 *   - tp 2 with generation tp 2 (one rollout worker of 2 ranks on the training ranks' devices):
 *     the same step-1 reward again;
 *   - under a user's mpirun of the wrong size: refused with the exact error.
 * Skips (77) when mpirun is not installed. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

#define STEPS "--set train.steps=3 --set logging.val_every=0 --set checkpoint.every=0"

static void run_ok(const char *run, const char *args, const char **want, size_t n_want) {
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, run, args);
    CHECK(rc == 0);
    int has = rf_test_has_all(out, want, n_want);
    if (rc || !has) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
}

int main(void) {
    int start = rf_test_split_start("test_split_colocated", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\npeer_timeout = 30\n");
    const char *one[] = {"validation accuracy"};
    run_ok("one", STEPS " --set logging.val_every=3", one, 1);
    const char *dp[] = {"colocated run: 5 processes (controller, 2 training workers (placement.actor.dp x "
                        "placement.actor.tp = 2 x 1) and 2 rollout workers on their devices, taking turns)",
                        "  rank 1: training worker, data-parallel rank 0 of 2 (actor)",
                        "  rank 3: rollout worker 0, on the devices of rank 1", "  rank 4: rollout worker 1, on the devices of rank 2",
                        "training worker: data parallel over 2 ranks, actor", "staleness bound k = 0",
                        "KV cache: 1088 blocks of 16 positions", "(50% of the "};
    run_ok("colo_dp", STEPS " --set placement.actor.dp=2", dp, sizeof dp / sizeof *dp);
    const char *split[] = {"split run: 5 processes", "staleness bound k = 0", "(90% of the "};
    run_ok("split_dp", STEPS " --set placement.mode=split --set placement.actor.dp=2 --set placement.rollout_ranks=2",
           split, sizeof split / sizeof *split);
    const char *tp[] = {"rank 3: rollout worker 0, tensor-parallel rank 0 of 2 (engine, talks to the controller), on the "
                        "devices of rank 1",
                        "rank 4: rollout worker 0, tensor-parallel rank 1 of 2, on the devices of rank 2"};
    run_ok("colo_tp", STEPS " --set placement.actor.tp=2 --set placement.rollout.tp=2", tp, sizeof tp / sizeof *tp);
    double r1 = rf_test_metric(dir, "one", 1, "reward/mean");
    const char *runs[3] = {"colo_dp", "split_dp", "colo_tp"};
    for (int i = 0; i < 3; i++) {
        double r = rf_test_metric(dir, runs[i], 1, "reward/mean");
        printf("step 1 reward: one process %.6f, %s %.6f\n", r1, runs[i], r);
        CHECK(r1 > 0 && r == r1);
    }
    for (int step = 1; step <= 3; step++) {
        double ra = rf_test_metric(dir, "colo_dp", step, "reward/mean"), rb = rf_test_metric(dir, "split_dp", step, "reward/mean");
        double ga = rf_test_metric(dir, "colo_dp", step, "actor/grad_norm"), gb = rf_test_metric(dir, "split_dp", step, "actor/grad_norm");
        printf("step %d, colocated / split dp 2: reward %.6f / %.6f, grad norm %.10f / %.10f\n", step, ra, rb, ga, gb);
        if (step > 1 && ra != rb) {
            printf("step %d: other samples (the actors differ by rounding); not compared\n", step);
            break;
        }
        CHECK(ra == rb && ga > 0 && fabs(ga - gb) <= 1e-5 * ga);
    }
    rf_test_refused(dir, rlflow, 4, "size", "--set placement.actor.dp=2",
                    "this MPI job has 4 ranks; the colocated recipe needs 5 (controller, 2 training workers and as many "
                    "rollout ranks on their devices)");
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_colocated");
}
