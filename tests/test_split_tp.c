/* Split runs with tensor-parallel training (placement.actor.tp = 2) and whole-model rollout
 * workers (generation tp 1), weights moved by resharding, end to end under mpirun (rlflow
 * starts it): a controller, two training ranks and a rollout worker as four processes on the
 * 1-digit arithmetic task (tests/run_util.h). Then tensor-parallel generation
 * (placement.rollout.tp = 2: the rollout worker is two ranks).
 *   - tp = 2 learns like tp = 1: over 120 GRPO steps with k = 1 the training reward rises (mean
 *     of steps 101-120 above steps 1-20 by a margin) in both runs and the tp = 2 run ends within
 *     0.15 of the tp = 1 run; both ranks trained (the layout is logged, the second rank says it
 *     is ready, perf/tp_comm_s is reported), the first weights were resharded from 2 shards,
 *     run_status.json says ok. The controller checks at every version that the rollout worker
 *     serves the checksum the training ranks computed from their shards (a mismatch stops the
 *     run), and admission waits for served weights, so 120 steps mean 120 checked transfers;
 *   - the checkpoint of step 20, gathered from the shards, holds exactly the weights the
 *     rollout worker was sent as version 20 (CRC-32C of the saved actor, loaded as `rlflow
 *     generate` loads it, equals the checksum of version 20), and `rlflow generate` runs on it;
 *   - PPO at tp = 2 (the critic whole on rank 1): 20 steps with a checkpoint (actor moments
 *     gathered whole), then --resume to step 30: the resumed run's first weights are the
 *     checkpoint's (same CRC-32C), the optimizer step count goes on from 20 (30 at step 30);
 *   - a tensor-parallel peer killed (SIGKILL) mid-run: `rlflow run` fails within seconds of
 *     async.peer_timeout naming the collective that waited and the lost world rank;
 *   - placement.rollout.tp = 2 with training tp 1 and tp 2: learns like tp = 1 (steps 101-120
 *     above steps 1-20 by the same margin, within 0.15 of the tp = 1 run); the layout and the
 *     first weights resharded into the generation shards are logged; every version's checksum,
 *     computed by the rollout ranks from their shards, is checked by the controller;
 *   - a rollout peer (generation tensor-parallel rank 1) killed mid-run: the run fails within
 *     seconds of async.peer_timeout naming the lost world rank (found by its rollout worker's
 *     rank 0 in a step, or by the training rank in a weights transfer);
 *   - refusals with their exact messages: tp = 3 does not divide the tiny model's 4 heads (for
 *     training and for generation); colocated layouts that cannot share devices (both keys); an MPI job of the wrong
 *     size (both layouts).
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
static double g_tp1_end = NAN; /* mean reward over steps 101-120 of the tp = 1 run */

static double mean_of(const char *run, const char *name, int from, int to) {
    return rf_test_metric_mean(dir, run, name, from, to);
}

static void learns_like_tp1(void) {
    char *out, p[512];
    int rc = rf_test_run_recipe(&out, dir, rlflow, "tp1", "--set placement.actor.tp=1");
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rc = rf_test_run_recipe(&out, dir, rlflow, "tp2", "");
    CHECK(rc == 0);
    CHECK(strstr(out, "split run: 4 processes (controller, 2 tensor-parallel training workers, 1 rollout workers)") != NULL);
    CHECK(strstr(out, "rank 1: training worker, tensor-parallel rank 0 of 2 (actor shard 0 of 2)") != NULL);
    CHECK(strstr(out, "rank 2: training worker, tensor-parallel rank 1 of 2 (actor shard 1 of 2)") != NULL);
    CHECK(strstr(out, "rank 3: rollout worker 0") != NULL);
    CHECK(strstr(out, "training worker: tensor-parallel rank 1 of 2 ready (world rank 2, pid ") != NULL);
    CHECK(strstr(out, "training worker: weights version 0 (CRC-32C ") != NULL);
    CHECK(strstr(out, ") resharded from 2 shards to the rollout workers") != NULL);
    /* the rollout worker reads the shards in place (one host) */
    CHECK(strstr(out, "weights: training rank 0 sends to 1 rollout rank(s): 1 read its shard in place (same host, one copy), 0 through messages") != NULL);
    CHECK(strstr(out, "validation at version 120: accuracy") != NULL);
    if (rc || !strstr(out, "tensor-parallel rank 1 of 2 ready")) fprintf(stderr, "%s\n", out);
    /* the checkpoint of step 20 is the weights served as version 20 */
    long sent = rf_test_crc_after(out, "checkpoint of step 20 gathered from 2 shards (the weights sent as version 20, CRC-32C ");
    snprintf(p, sizeof p, "%s/tp2/step_000020/actor", dir);
    long saved = rf_test_saved_crc(p);
    printf("version 20: CRC-32C sent %08lx, of the checkpoint %08lx\n", sent, saved);
    CHECK(sent >= 0 && saved == sent);
    free(out);
    rc = rf_test_sh(&out, "%s generate --model %s --prompt '3+4=' --greedy --max-new-tokens 4", rlflow, p);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    double a1 = mean_of("tp1", "reward/mean", 1, 20), b1 = mean_of("tp1", "reward/mean", 101, 120);
    double a2 = mean_of("tp2", "reward/mean", 1, 20), b2 = mean_of("tp2", "reward/mean", 101, 120);
    printf("mean reward steps 1-20 -> 101-120: tp = 1 %.3f -> %.3f, tp = 2 %.3f -> %.3f\n", a1, b1, a2, b2);
    printf("mean reward per 20 steps, tp = 1:");
    for (int k = 1; k <= 120; k += 20) printf(" %.3f", mean_of("tp1", "reward/mean", k, k + 19));
    printf("\nmean reward per 20 steps, tp = 2:");
    for (int k = 1; k <= 120; k += 20) printf(" %.3f", mean_of("tp2", "reward/mean", k, k + 19));
    printf("\n");
    rf_test_learned(dir, rlflow, "tp1", "--set placement.actor.tp=1", &a1, &b1);
    rf_test_learned(dir, rlflow, "tp2", "", &a2, &b2);
    g_tp1_end = b1;
    CHECK(fabs(b2 - b1) < 0.15);
    double comm = rf_test_metric(dir, "tp2", 60, "perf/tp_comm_s");
    CHECK(comm > 0 && comm < 5);
    CHECK(isnan(rf_test_metric(dir, "tp1", 60, "perf/tp_comm_s")));
    snprintf(p, sizeof p, "%s/tp2/run_status.json", dir);
    CHECK(rf_test_file_has(p, "\"status\":\"ok\""));
}

/* placement.rollout.tp = 2 with training tp `train_tp`: learns like the tp = 1 run. */
static void rollout_tp_learns(int train_tp) {
    char *out, run[32], args[128], p[512];
    snprintf(run, sizeof run, "gen2_tp%d", train_tp);
    snprintf(args, sizeof args, "--set placement.actor.tp=%d --set placement.rollout.tp=2", train_tp);
    int rc = rf_test_run_recipe(&out, dir, rlflow, run, args);
    CHECK(rc == 0);
    char want[256];
    snprintf(want, sizeof want, "split run: %d processes (controller, %d training workers, 1 rollout workers of 2 "
             "tensor-parallel ranks)", 3 + train_tp, train_tp);
    CHECK(strstr(out, want) != NULL);
    snprintf(want, sizeof want, "rank %d: rollout worker 0, tensor-parallel rank 0 of 2 (engine, talks to the controller)",
             1 + train_tp);
    CHECK(strstr(out, want) != NULL);
    snprintf(want, sizeof want, "rollout worker 0: tensor-parallel rank 1 of 2 ready (world rank %d, pid ", 2 + train_tp);
    CHECK(strstr(out, want) != NULL);
    snprintf(want, sizeof want, ") resharded from %d shards to the rollout workers", train_tp);
    CHECK(strstr(out, want) != NULL);
    if (rc || !strstr(out, want)) fprintf(stderr, "%s\n", out);
    free(out);
    double a = mean_of(run, "reward/mean", 1, 20), b = mean_of(run, "reward/mean", 101, 120);
    printf("rollout tp = 2, training tp = %d: mean reward steps 1-20 -> 101-120 %.3f -> %.3f (tp = 1 ends at %.3f); "
           "per 20 steps:", train_tp, a, b, g_tp1_end);
    for (int k = 1; k <= 120; k += 20) printf(" %.3f", mean_of(run, "reward/mean", k, k + 19));
    printf("\n");
    rf_test_learned(dir, rlflow, run, args, &a, &b);
    CHECK(fabs(b - g_tp1_end) < 0.15);
    snprintf(p, sizeof p, "%s/%s/run_status.json", dir, run);
    CHECK(rf_test_file_has(p, "\"status\":\"ok\""));
}

/* A rollout peer (generation rank 1, world rank 3 with training tp 1) killed: its rank 0 gives
 * up at its next step's collective after async.peer_timeout, or the training rank at the
 * weights transfer the peer no longer takes part in, and the run stops naming world rank 3. */
static void rollout_peer_killed(void) {
    rf_test_write_recipe(dir, 60, "[async]\nmax_staleness = 1\npeer_timeout = 10\n"
                                  "[placement]\nmode = \"split\"\nrollout_ranks = 1\n"
                                  "[placement.actor]\ntp = 1\n[placement.rollout]\ntp = 2\n");
    rf_test_peer_killed_at(dir, rlflow, "rollout worker 0: tensor-parallel rank 1 of 2", 3, "error: ",
                           " waited 10 s for world rank 3 (a rank is gone or stuck)");
    rf_test_write_recipe(dir, 60, "[async]\nmax_staleness = 1\npeer_timeout = 10\n"
                                  "[placement]\nmode = \"split\"\nrollout_ranks = 1\n"
                                  "[placement.actor]\ntp = 2\n");
}

/* PPO (the critic whole on rank 1: placement.critic.tp = 1) at tp = 2: checkpoint at 20,
 * resume to 30. test_split_tpdp.c runs the critic split like the actor. */
static void ppo_checkpoint_resume(void) {
    char *out, p[512];
    const char *args = "--set algorithm.name=ppo --set logging.val_every=0 --set placement.critic.tp=1";
    char a20[256], a30[256];
    snprintf(a20, sizeof a20, "%s --set train.steps=20", args);
    snprintf(a30, sizeof a30, "%s --set train.steps=30 --resume", args);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "ppo", a20);
    CHECK(rc == 0);
    CHECK(strstr(out, "rank 1: training worker, tensor-parallel rank 0 of 2 (actor shard 0 of 2, critic)") != NULL);
    if (rc) fprintf(stderr, "%s\n", out);
    long saved = rf_test_crc_after(out, "checkpoint of step 20 gathered from 2 shards (the weights sent as version 20, CRC-32C ");
    free(out);
    const char *parts[] = {"actor_optim", "critic_optim", "critic"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/ppo/step_000020/%s/model.safetensors", dir, parts[i]);
        CHECK(rf_file_exists(p));
    }
    CHECK(rf_test_trainer_state(dir, "ppo", "step_000020", "actor_optimizer_steps") == 20);
    CHECK(rf_test_trainer_state(dir, "ppo", "step_000020", "critic_optimizer_steps") == 20);
    rc = rf_test_run_recipe(&out, dir, rlflow, "ppo", a30);
    CHECK(rc == 0);
    CHECK(strstr(out, "resumed at step 20") != NULL);
    long resumed = rf_test_crc_after(out, "training worker: weights version 20 (CRC-32C ");
    printf("PPO tp = 2: checkpoint of step 20 CRC-32C %08lx, first weights after --resume %08lx\n", saved, resumed);
    CHECK(saved >= 0 && resumed == saved);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    /* the shards' optimizer step came back from the checkpoint (10 if it had started over) */
    CHECK(rf_test_trainer_state(dir, "ppo", "step_000030", "actor_optimizer_steps") == 30);
    CHECK(rf_test_trainer_state(dir, "ppo", "step_000030", "critic_optimizer_steps") == 30);
    CHECK(rf_test_metric(dir, "ppo", 30, "critic/value_loss") >= 0);
}

/* A TP peer killed mid-run: rank 1's next collective gives up after async.peer_timeout (10 s)
 * naming world rank 2, and the run stops. */
static void peer_killed(void) {
    rf_test_peer_killed(dir, rlflow, "tensor-parallel rank 1 of 2", 2, ": world rank 1 waited 10 s for world rank");
    char p[512];
    snprintf(p, sizeof p, "%s/kill.log", dir);
    CHECK(rf_test_file_has(p, "world rank 2"));
}

/* The critic and the reference on the first 2 of the actor's 4 tensor-parallel ranks (their own
 * groups, split from the replica's), against both whole on rank 1: 3 synchronous PPO steps
 * with a KL term give the same rewards, reference KL and value loss; the rank table and logs
 * say where the shards are; a size that does not divide the actor's is refused. */
static void roles_on_fewer_ranks(void) {
    const char *args = "--set algorithm.name=ppo --set algorithm.kl_coef=0.01 --set logging.val_every=0 "
                       "--set placement.actor.tp=4 --set train.steps=3 --set async.max_staleness=0";
    char sub[400], whole[400], *out = NULL;
    snprintf(sub, sizeof sub, "%s --set placement.critic.tp=2 --set placement.reference.tp=2", args);
    snprintf(whole, sizeof whole, "%s --set placement.critic.tp=1 --set placement.reference.tp=1", args);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "sub3", sub);
    CHECK(rc == 0);
    const char *want[] = {
        "rank 2: training worker, tensor-parallel rank 1 of 4 (actor shard 1 of 4, reference shard 1 of 2, critic shard 1 "
        "of 2)",
        "rank 3: training worker, tensor-parallel rank 2 of 4 (actor shard 2 of 4)",
        "training worker: critic split over the first 2 tensor-parallel ranks of the training worker",
        "training worker: reference split over the first 2 tensor-parallel ranks of the training worker",
        "training worker: scoring reference log-probs and values on 1 data-parallel replica, all split over"};
    rf_test_has_all(out, want, sizeof want / sizeof want[0]);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rc = rf_test_run_recipe(&out, dir, rlflow, "whole3", whole);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rf_test_same_scores(dir, "sub3", "whole3", "critic and reference on 2 of 4 ranks / whole");
    rf_test_refused(dir, rlflow, 0, "critic_tp3", "--set algorithm.name=ppo --set placement.actor.tp=4 "
                    "--set placement.critic.tp=3",
                    "error: --set: placement.critic.tp = 3 is not implemented yet (a critic tensor-parallel size that "
                    "does not divide the actor's (placement.actor.tp = 4): the critic's shards live on the first ranks of "
                    "each replica)");
}

static void refusals(void) {
    char want[1024];
    rf_test_tp_refusals(dir, rlflow);
    rf_test_wrong_size(dir, rlflow, 3, "this MPI job has 3 ranks; the recipe needs 4 (controller, placement.actor.tp = 2 training "
                                       "workers and placement.rollout_ranks = 1 rollout workers)");
    /* generation's tp: the heads, colocated runs, the MPI job's size */
    snprintf(want, sizeof want, "error: --set: placement.rollout.tp = 3 does not divide the 4 attention heads of "
                                "model.path \"%s/sft\" (tensor parallelism splits whole heads)", dir);
    rf_test_refused(dir, rlflow, 0, "gen_heads", "--set placement.rollout.tp=3", want);
    rf_test_refused(dir, rlflow, 0, "gen_colocated",
                    "--set placement.mode=colocated --set async.max_staleness=0 --set placement.actor.tp=1 "
                    "--set placement.rollout.tp=2",
                    "error: --set: placement.rollout.tp = 2 does not divide the 1 training ranks (placement.actor.dp x "
                    "placement.actor.tp) of a colocated run, whose rollout ranks are on their devices");
    rf_test_refused(dir, rlflow, 4, "gen_size", "--set placement.rollout.tp=2",
                    "this MPI job has 4 ranks; the recipe needs 5 (controller, 2 training workers and "
                    "placement.rollout_ranks = 1 rollout workers of placement.rollout.tp = 2 ranks each)");
}

int main(void) {
    int start = rf_test_split_start("test_split_tp", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\nmax_staleness = 1\npeer_timeout = 10\n"
                                  "[placement]\nmode = \"split\"\nrollout_ranks = 1\n"
                                  "[placement.actor]\ntp = 2\n");
    learns_like_tp1();
    rollout_tp_learns(1);
    rollout_tp_learns(2);
    ppo_checkpoint_resume();
    roles_on_fewer_ranks();
    peer_killed();
    rollout_peer_killed();
    refusals();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_tp");
}
