/* Split runs with data-parallel training (placement.actor.dp = 2) end to end under mpirun
 * (rlflow starts it): a controller, two training workers and a rollout worker as four
 * processes on the 1-digit arithmetic task (tests/run_util.h).
 *   - dp = 2 learns like dp = 1: over 120 GRPO steps with k = 1 the training reward rises (mean
 *     of steps 101-120 above steps 1-20 by a margin) in both runs, the dp = 2 run ends within
 *     0.15 of the dp = 1 run, both ranks trained (the layout is logged, the second rank says it
 *     is ready, perf/dp_wait_s is reported), run_status.json says ok;
 *   - ZeRO-1 with PPO (actor and critic sharded): 20 steps with a checkpoint whose optimizer
 *     state is whole (gathered from both ranks), then --resume to step 30;
 *   - the critic on the first replica alone (placement.critic.dp = 1; trained by rank 1 on whole
 *     batches) scores and trains like the data-parallel one: 3 synchronous PPO steps each;
 *   - a data-parallel peer killed (SIGKILL) mid-run: `rlflow run` fails within seconds of
 *     async.peer_timeout naming the collective that waited (mostly a gradient bucket's
 *     allreduce) and the lost world rank;
 *   - --resume without a finished checkpoint stops every rank within seconds (under 60 s; the
 *     rollout worker waiting for the controller that stopped used to keep the job alive); so
 *     does --resume with a cut moment file (the training ranks fail before connecting; the
 *     controller's error names the file);
 *   - an MPI job of the wrong size is refused with the exact error.
 * Skips (77) when mpirun is not installed. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

static double mean_of(const char *run, const char *name, int from, int to) {
    return rf_test_metric_mean(dir, run, name, from, to);
}

static void learns_like_dp1(void) {
    char *out, p[512];
    int rc = rf_test_run_recipe(&out, dir, rlflow, "dp1", "--set placement.actor.dp=1");
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rc = rf_test_run_recipe(&out, dir, rlflow, "dp2", "");
    CHECK(rc == 0);
    CHECK(strstr(out, "split run: 4 processes (controller, 2 data-parallel training workers, 1 rollout workers)") != NULL);
    CHECK(strstr(out, "rank 2: training worker, data-parallel rank 1 of 2 (actor)") != NULL);
    CHECK(strstr(out, "rank 3: rollout worker 0") != NULL);
    CHECK(strstr(out, "training worker: data-parallel rank 1 of 2 ready (world rank 2, pid ") != NULL);
    CHECK(strstr(out, "validation at version 120: accuracy") != NULL);
    if (rc || !strstr(out, "data-parallel rank 1 of 2 ready")) fprintf(stderr, "%s\n", out);
    free(out);
    double a1 = mean_of("dp1", "reward/mean", 1, 20), b1 = mean_of("dp1", "reward/mean", 101, 120);
    double a2 = mean_of("dp2", "reward/mean", 1, 20), b2 = mean_of("dp2", "reward/mean", 101, 120);
    printf("mean reward steps 1-20 -> 101-120: dp = 1 %.3f -> %.3f, dp = 2 %.3f -> %.3f\n", a1, b1, a2, b2);
    rf_test_learned(dir, rlflow, "dp1", "--set placement.actor.dp=1", &a1, &b1);
    rf_test_learned(dir, rlflow, "dp2", "", &a2, &b2);
    CHECK(fabs(b2 - b1) < 0.15);
    double wait = rf_test_metric(dir, "dp2", 60, "perf/dp_wait_s");
    CHECK(wait >= 0 && wait < 5);
    CHECK(isnan(rf_test_metric(dir, "dp1", 60, "perf/dp_wait_s")));
    snprintf(p, sizeof p, "%s/dp2/run_status.json", dir);
    CHECK(rf_test_file_has(p, "\"status\":\"ok\""));
}

/* ZeRO-1 shards the actor's and the critic's optimizer state; a checkpoint gathers it whole and
 * a resumed run hands each rank its shard again. */
static void zero_checkpoint_resume(void) {
    char *out, p[512];
    int rc = rf_test_run_recipe(&out, dir, rlflow, "zero", "--set placement.actor.zero=1 --set algorithm.name=ppo --set train.steps=20 "
                               "--set logging.val_every=0");
    CHECK(rc == 0);
    CHECK(strstr(out, "data parallel over 2 ranks (ZeRO-1: optimizer state sharded), actor and critic") != NULL);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    const char *parts[] = {"actor_optim", "critic_optim"};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/zero/step_000020/%s/model.safetensors", dir, parts[i]);
        CHECK(rf_file_exists(p));
    }
    rc = rf_test_run_recipe(&out, dir, rlflow, "zero", "--set placement.actor.zero=1 --set algorithm.name=ppo --set train.steps=30 "
                           "--set logging.val_every=0 --resume");
    CHECK(rc == 0);
    CHECK(strstr(out, "resumed at step 20") != NULL);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(rf_test_metric(dir, "zero", 30, "critic/value_loss") >= 0);
}

/* The critic on rank 1 alone against the critic on both replicas: 3 synchronous PPO steps with a
 * KL term (the same samples) give the same rewards, value loss and KL; the rank table and the
 * log say where the critic is; then a checkpoint at step 3 resumed to 4. */
static void critic_on_rank1(void) {
    const char *args = "--set algorithm.name=ppo --set algorithm.kl_coef=0.01 --set logging.val_every=0 "
                       "--set train.steps=3 --set async.max_staleness=0";
    char one[400], *out = NULL;
    snprintf(one, sizeof one, "%s --set placement.critic.dp=1", args);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "critic1", one);
    CHECK(rc == 0);
    const char *want[] = {"rank 1: training worker, data-parallel rank 0 of 2 (actor, reference, critic)",
                          "rank 2: training worker, data-parallel rank 1 of 2 (actor, reference)",
                          "data parallel over 2 ranks, actor (the critic on rank 1 alone, on whole batches)",
                          "training worker: scoring reference log-probs and values on 1 data-parallel replica"};
    rf_test_has_all(out, want, sizeof want / sizeof want[0]);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rc = rf_test_run_recipe(&out, dir, rlflow, "critic2", args);
    CHECK(rc == 0);
    CHECK(out && strstr(out, "training worker: scoring reference log-probs and values on 2 data-parallel replicas"));
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rf_test_same_scores(dir, "critic1", "critic2", "critic on rank 1 / on both replicas");
    /* ZeRO-1's checkpoint (moments gathered a tensor at a time onto rank 1) against plain DP's,
     * after one step on the same samples */
    rf_test_zero_like_plain(dir, rlflow, "one", args);
    CHECK(rf_test_trainer_state(dir, "critic1", "step_000003", "critic_optimizer_steps") == 3);
    rc = rf_test_run_recipe(&out, dir, rlflow, "critic1", "--set algorithm.name=ppo --set algorithm.kl_coef=0.01 "
                            "--set logging.val_every=0 --set train.steps=4 --set placement.critic.dp=1 --resume");
    CHECK(rc == 0);
    CHECK(out && strstr(out, "resumed at step 3"));
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(rf_test_trainer_state(dir, "critic1", "step_000004", "critic_optimizer_steps") == 4);
}

/* A peer killed mid-run: rank 1's next collective gives up after async.peer_timeout (10 s)
 * naming world rank 2, and the run stops. */
static void peer_killed(void) {
    rf_test_peer_killed(dir, rlflow, "data-parallel rank 1 of 2", 2, ": world rank 1 waited 10 s for world rank 2 (a rank is gone or stuck)");
}

/* --resume with no finished checkpoint (a save that did not complete): every rank stops
 * naming it, within seconds; the rollout worker, waiting for a controller that is gone, does
 * not keep the MPI job alive (it did, for async.startup_timeout = 600 s). */
static void resume_without_checkpoint(void) {
    char *out = NULL, want[512];
    rf_test_sh(NULL, "mkdir -p %s/nockpt/step_000020.tmp", dir);
    double t = rf_time_now();
    int rc = rf_test_run_recipe(&out, dir, rlflow, "nockpt", "--set train.steps=30 --resume");
    t = rf_time_now() - t;
    printf("--resume without a checkpoint: exit %d after %.1f s\n", rc, t);
    snprintf(want, sizeof want, "error: %s/nockpt/latest: no checkpoint to resume from", dir);
    CHECK(rc != 0);
    CHECK(out && strstr(out, want) != NULL);
    CHECK(t < 60);
    if (!out || !strstr(out, want)) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
}

/* --resume from a checkpoint whose critic moments are cut short (ZeRO-1: every rank reads its
 * blocks): both training ranks fail before the training worker has connected; it connects to
 * say why, so the run stops within seconds naming the file (the controller waited
 * async.startup_timeout for it before). */
static void resume_bad_moments(void) {
    char *out = NULL, want[512];
    rf_test_sh(NULL, "rm -rf %s/badm && cp -r %s/zero %s/badm && truncate -s 100 %s/badm/step_000030/critic_optim/model.safetensors",
               dir, dir, dir, dir);
    double t = rf_time_now();
    int rc = rf_test_run_recipe(&out, dir, rlflow, "badm", "--set placement.actor.zero=1 --set algorithm.name=ppo "
                                "--set train.steps=40 --set logging.val_every=0 --resume");
    t = rf_time_now() - t;
    printf("--resume with a cut moment file: exit %d after %.1f s\n", rc, t);
    snprintf(want, sizeof want, "%s/badm/step_000030/critic_optim/model.safetensors: ", dir);
    CHECK(rc != 0);
    CHECK(out && strstr(out, "error: training worker (rank 1 on ") && strstr(out, want));
    char *last = out ? strstr(out, "\nerror: actor worker 'train'") : NULL; /* the run's error, from the controller */
    CHECK(last && strstr(last, want));
    CHECK(t < 60);
    if (!last || !strstr(last, want)) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
}

static void wrong_size(void) {
    rf_test_wrong_size(dir, rlflow, 3, "this MPI job has 3 ranks; the recipe needs 4 (controller, placement.actor.dp = 2 "
                                       "training workers and placement.rollout_ranks = 1 rollout workers)");
}

int main(void) {
    int start = rf_test_split_start("test_split_dp", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\nmax_staleness = 1\npeer_timeout = 10\n"
                                  "[placement]\nmode = \"split\"\nrollout_ranks = 1\n"
                                  "[placement.actor]\ndp = 2\n");
    learns_like_dp1();
    zero_checkpoint_resume();
    critic_on_rank1();
    peer_killed();
    resume_without_checkpoint();
    resume_bad_moments();
    wrong_size();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_dp");
}
