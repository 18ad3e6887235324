/* Colocated runs on several devices (placement.mode = "colocated" with a parallel layout,
 * rf_recipe_colocated_ranks): the controller and one process per training rank under mpirun,
 * each process also running a rollout rank in a thread of its own (resharding/handover.h),
 * generation and training taking turns (staleness 0), on the 1-digit arithmetic task
 * (tests/run_util.h), 3 GRPO steps each:
 *   - dp 2 (3 processes): the layout and the rank table, zero-copy; the step-1 reward of the
 *     one-process colocated run (the same samples: the same policy and seeds), and the split
 *     run of the same layout at staleness 0 with two rollout workers gets its rewards and
 *     gradient norms;
 *   - tp 2 with generation tp 2 (one rollout worker of 2 ranks, each generating with its
 *     process's actor shard: zero-copy): the same step-1 reward again;
 *   - different layouts on the same devices, the weights resharded in place: tp 2 with
 *     generation tp 1 (two whole-model rollout workers, gathered from the two shards) and dp 2
 *     with generation tp 2 (one rollout worker split over the two replicas' processes): the
 *     same step-1 reward, and the same rewards and gradient norms as the zero-copy run of the
 *     same training layout; these two give the KV cache and the pass workspaces back between
 *     phases (rollout.free_kv_cache = "on", the zero-copy runs keep them: the CPU's default),
 *     which must not change what they generate or learn;
 *   - under a user's mpirun of the wrong size: refused with the exact error;
 *   - every run that ends well, the one-process one too, leaves run_status.json saying ok.
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
    /* one-process and several-device colocated runs write run_status.json as split runs do */
    char p[512], *st = NULL;
    snprintf(p, sizeof p, "%s/%s/run_status.json", dir, run);
    CHECK(rf_read_file(p, &st, NULL) == RF_OK && strcmp(st, "{\"status\":\"ok\",\"message\":\"\"}") == 0);
    free(st);
}

int main(void) {
    int start = rf_test_split_start("test_split_colocated", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\npeer_timeout = 30\n");
    const char *one[] = {"validation accuracy"};
    run_ok("one", STEPS " --set logging.val_every=3", one, 1);
    const char *dp[] = {"colocated run: 3 processes (controller, and 2 training ranks (placement.actor.dp x "
                        "placement.actor.tp = 2 x 1), one per device, each also running a rank of the 2 rollout workers, "
                        "taking turns)",
                        "  rank 1: training worker, data-parallel rank 0 of 2 (actor)",
                        "  rank 1, its rollout thread: rollout worker 0 (zero-copy: generates with this rank's actor weights)",
                        "  rank 2, its rollout thread: rollout worker 1 (zero-copy: generates with this rank's actor weights)",
                        "training worker: data parallel over 2 ranks, actor", "staleness bound k = 0",
                        "handed to the rollout rank in each training rank's process (identical layouts: zero-copy",
                        "KV cache: 1088 blocks of 16 positions", "(50% of the "};
    run_ok("colo_dp", STEPS " --set placement.actor.dp=2", dp, sizeof dp / sizeof *dp);
    const char *split[] = {"split run: 5 processes", "staleness bound k = 0", "(90% of the "};
    run_ok("split_dp", STEPS " --set placement.mode=split --set placement.actor.dp=2 --set placement.rollout_ranks=2",
           split, sizeof split / sizeof *split);
    const char *tp[] = {"colocated run: 3 processes",
                        "rank 1, its rollout thread: rollout worker 0, tensor-parallel rank 0 of 2 (engine, talks to the "
                        "controller) (zero-copy: generates with this rank's actor shard)",
                        "rank 2, its rollout thread: rollout worker 0, tensor-parallel rank 1 of 2 (zero-copy: generates "
                        "with this rank's actor shard)"};
    run_ok("colo_tp", STEPS " --set placement.actor.tp=2 --set placement.rollout.tp=2", tp, sizeof tp / sizeof *tp);
    const char *tp1[] = {"rank 2, its rollout thread: rollout worker 1 (its weights resharded in place from the training ranks)",
                         "resharded in place from the training layout",
                         "weights: the training ranks reshard into their processes' rollout ranks: rank 0 exchanges with 1 "
                         "rank(s), 1 in place",
                         "rollout worker 1: KV cache given back while generation pauses (rollout.free_kv_cache = \"on\"): "};
    run_ok("colo_tp_gen1", STEPS " --set placement.actor.tp=2 --set rollout.free_kv_cache=on", tp1, sizeof tp1 / sizeof *tp1);
    const char *dp2[] = {"rank 2, its rollout thread: rollout worker 0, tensor-parallel rank 1 of 2 (its weights resharded "
                         "in place from the training ranks)",
                         "rollout worker 0: KV cache given back while generation pauses (rollout.free_kv_cache = \"on\"): "};
    run_ok("colo_dp_gen2", STEPS " --set placement.actor.dp=2 --set placement.rollout.tp=2 --set rollout.free_kv_cache=on",
           dp2, sizeof dp2 / sizeof *dp2);
    double r1 = rf_test_metric(dir, "one", 1, "reward/mean");
    const char *runs[5] = {"colo_dp", "split_dp", "colo_tp", "colo_tp_gen1", "colo_dp_gen2"};
    for (int i = 0; i < 5; i++) {
        double r = rf_test_metric(dir, runs[i], 1, "reward/mean");
        printf("step 1 reward: one process %.6f, %s %.6f\n", r1, runs[i], r);
        CHECK(r1 > 0 && r == r1);
    }
    /* the same training layout: zero-copy and resharded in place hand over the same weights */
    const char *pairs[3][2] = {{"colo_dp", "split_dp"}, {"colo_tp", "colo_tp_gen1"}, {"colo_dp", "colo_dp_gen2"}};
    for (int p = 0; p < 3; p++)
        for (int step = 1; step <= 3; step++) {
            const char *a = pairs[p][0], *b = pairs[p][1];
            double ra = rf_test_metric(dir, a, step, "reward/mean"), rb = rf_test_metric(dir, b, step, "reward/mean");
            double ga = rf_test_metric(dir, a, step, "actor/grad_norm"), gb = rf_test_metric(dir, b, step, "actor/grad_norm");
            printf("step %d, %s / %s: reward %.6f / %.6f, grad norm %.10f / %.10f\n", step, a, b, ra, rb, ga, gb);
            if (step > 1 && ra != rb) {
                printf("step %d: other samples (the actors differ by rounding); not compared\n", step);
                break;
            }
            CHECK(ra == rb && ga > 0 && fabs(ga - gb) <= 1e-5 * ga);
        }
    rf_test_refused(dir, rlflow, 4, "size", "--set placement.actor.dp=2",
                    "this MPI job has 4 ranks; the colocated recipe needs 3 (controller and 2 training ranks, one per "
                    "device, each also running a rollout rank)");
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_colocated");
}
