/* Split runs with data and tensor parallelism together (placement.actor.dp = 2, tp = 2: two
 * replicas of two shards, tp varying fastest) end to end under mpirun (rlflow starts it): a
 * controller, four training ranks and a rollout worker as six processes on the 1-digit
 * arithmetic task (tests/run_util.h).
 *   - tp 2 x dp 2 learns like one training rank: over 120 GRPO steps with k = 1 the training
 *     reward rises (mean of steps 101-120 above steps 1-20 by a margin) in both runs and the
 *     grid ends within 0.15 of the single rank; every rank trained (the layout is logged, each
 *     peer says it is ready, perf/dp_wait_s and perf/tp_comm_s are reported), the weights were
 *     resharded from the shards of both replicas (the planner spreads each rollout worker's
 *     blocks over them; the controller checks every version's checksum);
 *     the checkpoint of step 20, gathered from replica 0's shards, holds exactly the weights
 *     sent as version 20; run_status.json says ok;
 *   - PPO with a KL term and ZeRO-1 (each shard's AdamW moments sharded over its DP group), the
 *     critic and the reference split like the actor on every replica (their defaults; a
 *     ScoreRequest shared out over the replicas and run tensor parallel in each): 20 steps
 *     with checkpoints (the critic gathered whole), then --resume to step 30: the first
 *     weights after --resume have the checkpoint's CRC-32C and the optimizer step counts go
 *     on from 20; 3 synchronous steps (async.max_staleness = 0: the same samples in every run)
 *     with the critic and the reference split, and with both whole on replica 0's first rank:
 *     at step 1 the same reward, a KL to the generating policy below 1e-6 in both, the same
 *     value loss within 1e-5 of it; at step 2 (when the samples agree) the same within 1e-4;
 *     and the same with the critic split over replica 0's ranks alone (placement.critic.dp = 1:
 *     trained there on whole batches), resumed from its checkpoint at 3 to 4;
 *   - a reward model split over each replica's two ranks (placement.reward.tp = 2) scores like
 *     the whole one on each replica's first rank: the same step-1 reward within 1e-5; the rank
 *     table and the scoring line say where it is;
 *   - replica 1's first rank (world rank 3) killed (SIGKILL) mid-run: `rlflow run` fails within
 *     seconds of async.peer_timeout naming the collective that waited and world rank 3;
 *   - refusals with their exact messages: tp = 3 does not divide the heads (with dp = 2); tp and
 *     a colocated recipe keeping placement.rollout_ranks = 1; an MPI job of the wrong size.
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

/* The lines of the layout and of every rank ready. */
static void check_layout(const char *out) {
    const char *want[] = {
        "split run: 6 processes (controller, 4 training workers: 2 data-parallel replicas of 2 tensor-parallel ranks, 1 "
        "rollout workers)",
        "rank 1: training worker, data-parallel replica 0 of 2, tensor-parallel rank 0 of 2 (actor shard 0 of 2)",
        "rank 2: training worker, data-parallel replica 0 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2)",
        "rank 3: training worker, data-parallel replica 1 of 2, tensor-parallel rank 0 of 2 (actor shard 0 of 2)",
        "rank 4: training worker, data-parallel replica 1 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2)",
        "rank 5: rollout worker 0",
        "training worker: 2 data-parallel replicas of 2 tensor-parallel ranks, actor",
        "training worker: tensor-parallel rank 1 of 2 of data-parallel replica 0 of 2 ready (world rank 2, pid ",
        "training worker: data-parallel rank 1 of 2 ready (world rank 3, pid ",
        "training worker: tensor-parallel rank 1 of 2 of data-parallel replica 1 of 2 ready (world rank 4, pid ",
        ") resharded from 2 shards of every data-parallel replica to the rollout workers",
        "validation at version 120: accuracy"};
    int all = rf_test_has_all(out, want, sizeof want / sizeof want[0]);
    if (!all) fprintf(stderr, "%s\n", out);
}

static void learns_like_one_rank(void) {
    char *out, p[512];
    int rc = rf_test_run_recipe(&out, dir, rlflow, "one", "--set placement.actor.tp=1 --set placement.actor.dp=1");
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rc = rf_test_run_recipe(&out, dir, rlflow, "grid", "");
    CHECK(rc == 0);
    check_layout(out);
    long sent = rf_test_crc_after(out, "checkpoint of step 20 gathered from 2 shards (the weights sent as version 20, CRC-32C ");
    snprintf(p, sizeof p, "%s/grid/step_000020/actor", dir);
    long saved = rf_test_saved_crc(p);
    printf("version 20: CRC-32C sent %08lx, of the checkpoint %08lx\n", sent, saved);
    CHECK(sent >= 0 && saved == sent);
    free(out);
    double a1 = mean_of("one", "reward/mean", 1, 20), b1 = mean_of("one", "reward/mean", 101, 120);
    double a2 = mean_of("grid", "reward/mean", 1, 20), b2 = mean_of("grid", "reward/mean", 101, 120);
    printf("mean reward steps 1-20 -> 101-120: tp 1 x dp 1 %.3f -> %.3f, tp 2 x dp 2 %.3f -> %.3f\n", a1, b1, a2, b2);
    const char *runs[] = {"one", "grid"};
    for (int i = 0; i < 2; i++) {
        printf("mean reward per 20 steps, %s:", runs[i]);
        for (int k = 1; k <= 120; k += 20) printf(" %.3f", mean_of(runs[i], "reward/mean", k, k + 19));
        printf(" (step time %.1f ms)\n", 1e3 * mean_of(runs[i], "perf/step_s", 21, 120));
    }
    rf_test_learned(dir, rlflow, "one", "--set placement.actor.tp=1 --set placement.actor.dp=1", &a1, &b1);
    rf_test_learned(dir, rlflow, "grid", "", &a2, &b2);
    CHECK(fabs(b2 - b1) < 0.15);
    double wait = rf_test_metric(dir, "grid", 60, "perf/dp_wait_s"), comm = rf_test_metric(dir, "grid", 60, "perf/tp_comm_s");
    CHECK(wait >= 0 && wait < 5);
    CHECK(comm > 0 && comm < 5);
    snprintf(p, sizeof p, "%s/grid/run_status.json", dir);
    CHECK(rf_test_file_has(p, "\"status\":\"ok\""));
}

/* PPO with a KL term and ZeRO-1 over the grid, the critic and the reference split like the
 * actor (their defaults): checkpoint at 20 (moments gathered over each DP group, then the
 * shards of the actor and of the critic over replica 0's TP group), resume to 30; and 3
 * synchronous steps split against whole. */
static void zero_ppo_checkpoint_resume(void) {
    char *out, p[512];
    const char *args = "--set algorithm.name=ppo --set algorithm.kl_coef=0.01 --set placement.actor.zero=1 "
                       "--set logging.val_every=0";
    char a20[320], a30[320], whole[400];
    snprintf(a20, sizeof a20, "%s --set train.steps=20", args);
    snprintf(a30, sizeof a30, "%s --set train.steps=30 --resume", args);
    snprintf(whole, sizeof whole, "%s --set train.steps=3 --set async.max_staleness=0 --set placement.critic.tp=1 "
             "--set placement.reference.tp=1 --set placement.reference.dp=1", args);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "zero", a20);
    CHECK(rc == 0);
    const char *want[] = {
        "2 data-parallel replicas of 2 tensor-parallel ranks (ZeRO-1: optimizer state sharded per shard), actor and critic",
        "rank 1: training worker, data-parallel replica 0 of 2, tensor-parallel rank 0 of 2 (actor shard 0 of 2, reference "
        "shard 0 of 2, critic shard 0 of 2)",
        "rank 4: training worker, data-parallel replica 1 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2, reference "
        "shard 1 of 2, critic shard 1 of 2)",
        "training worker: critic split over the 2 tensor-parallel ranks of each replica holding it",
        "training worker: reference split over the 2 tensor-parallel ranks of each replica holding it",
        "training worker: scoring reference log-probs and values on 2 data-parallel replicas (token-balanced shares), all "
        "split over 2 tensor-parallel ranks",
        "checkpoint of step 20 gathered from 2 shards"};
    rf_test_has_all(out, want, sizeof want / sizeof want[0]);
    if (rc) fprintf(stderr, "%s\n", out);
    long saved = rf_test_crc_after(out, "checkpoint of step 20 gathered from 2 shards (the weights sent as version 20, CRC-32C ");
    free(out);
    const char *parts[] = {"actor_optim", "critic_optim", "critic"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/zero/step_000020/%s/model.safetensors", dir, parts[i]);
        CHECK(rf_file_exists(p));
    }
    CHECK(rf_test_trainer_state(dir, "zero", "step_000020", "actor_optimizer_steps") == 20);
    CHECK(rf_test_trainer_state(dir, "zero", "step_000020", "critic_optimizer_steps") == 20);
    /* synchronous (the same samples in both runs): the batches scored by the split models and
     * by the whole ones give the same reward, reference KL and value loss */
    char sync[400];
    snprintf(sync, sizeof sync, "%s --set train.steps=3 --set async.max_staleness=0", args);
    rc = rf_test_run_recipe(&out, dir, rlflow, "split3", sync);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rc = rf_test_run_recipe(&out, dir, rlflow, "whole3", whole);
    CHECK(rc == 0);
    CHECK(strstr(out, "training worker: scoring reference log-probs and values on 1 data-parallel replica") != NULL);
    CHECK(strstr(out, "rank 3: training worker, data-parallel replica 1 of 2, tensor-parallel rank 0 of 2 (actor shard 0 of "
                      "2, critic)") != NULL);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rf_test_same_scores(dir, "split3", "whole3", "critic and reference split / whole");
    /* the critic on replica 0 alone, split over its two ranks: trained there on whole batches
     * (the TP peer gets them with its actor share), then resumed from its checkpoint */
    char r0[480];
    snprintf(r0, sizeof r0, "%s --set train.steps=3 --set async.max_staleness=0 --set placement.critic.dp=1", args);
    rc = rf_test_run_recipe(&out, dir, rlflow, "critic_r0", r0);
    CHECK(rc == 0);
    const char *want_r0[] = {
        "rank 2: training worker, data-parallel replica 0 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2, reference "
        "shard 1 of 2, critic shard 1 of 2)",
        "rank 3: training worker, data-parallel replica 1 of 2, tensor-parallel rank 0 of 2 (actor shard 0 of 2, reference "
        "shard 0 of 2)",
        "2 data-parallel replicas of 2 tensor-parallel ranks (ZeRO-1: optimizer state sharded per shard), actor (the "
        "critic on replica 0 alone, on whole batches)",
        "training worker: scoring reference log-probs and values on 1 data-parallel replica, all split over 2 "
        "tensor-parallel ranks"};
    rf_test_has_all(out, want_r0, sizeof want_r0 / sizeof want_r0[0]);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rf_test_same_scores(dir, "critic_r0", "split3", "critic split on replica 0 alone / on both replicas");
    snprintf(r0, sizeof r0, "%s --set train.steps=4 --set async.max_staleness=0 --set placement.critic.dp=1 --resume", args);
    rc = rf_test_run_recipe(&out, dir, rlflow, "critic_r0", r0);
    CHECK(rc == 0);
    CHECK(out && strstr(out, "resumed at step 3"));
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(rf_test_trainer_state(dir, "critic_r0", "step_000004", "critic_optimizer_steps") == 4);
    /* ZeRO-1's checkpoint over the grid (each moment block gathered from its DP group as the
     * shards are gathered, a tensor at a time) against plain's, after one step on the same
     * samples */
    rf_test_zero_like_plain(dir, rlflow, "one", args);
    /* the critic whole on each replica's first rank, data parallel (its moments from the leaders) */
    char whole_critic[400];
    snprintf(whole_critic, sizeof whole_critic, "%s --set placement.critic.tp=1", args);
    rf_test_zero_like_plain(dir, rlflow, "one_whole_critic", whole_critic);
    rc = rf_test_run_recipe(&out, dir, rlflow, "zero", a30);
    CHECK(rc == 0);
    CHECK(strstr(out, "resumed at step 20") != NULL);
    long resumed = rf_test_crc_after(out, "training worker: weights version 20 (CRC-32C ");
    printf("PPO, ZeRO-1, tp 2 x dp 2: checkpoint of step 20 CRC-32C %08lx, first weights after --resume %08lx\n", saved,
           resumed);
    CHECK(saved >= 0 && resumed == saved);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(rf_test_trainer_state(dir, "zero", "step_000030", "actor_optimizer_steps") == 30);
    CHECK(rf_test_trainer_state(dir, "zero", "step_000030", "critic_optimizer_steps") == 30);
    CHECK(rf_test_metric(dir, "zero", 30, "critic/value_loss") >= 0);
}

/* A reward model whole on each replica's first rank against split over both ranks of each
 * replica (placement.reward.tp = 2): the same step-1 reward, and the rank table and the
 * scoring line say where it is. */
static void reward_model_split(void) {
    const char *runs[2] = {"rm_whole", "rm_split"};
    const char *extra[2] = {"--set placement.reward.tp=1", "--set placement.reward.tp=2"};
    const char *want[4] = {
        "rank 2: training worker, data-parallel replica 0 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2, "
        "reference shard 1 of 2)",
        "training worker: scoring reference log-probs and reward-model scores on 2 data-parallel replicas "
        "(token-balanced shares), the reference split over 2 tensor-parallel ranks",
        "rank 4: training worker, data-parallel replica 1 of 2, tensor-parallel rank 1 of 2 (actor shard 1 of 2, "
        "reference shard 1 of 2, reward model shard 1 of 2)",
        "training worker: scoring reference log-probs and reward-model scores on 2 data-parallel replicas "
        "(token-balanced shares), all split over 2 tensor-parallel ranks"};
    rf_test_rm_layouts("test_split_tpdp", dir, rlflow,
                       "--set algorithm.kl_coef=0.01 --set logging.val_every=0 --set async.max_staleness=0", 2, runs,
                       extra, want, 2);
}

/* Replica 1's first rank killed: the run stops after async.peer_timeout (10 s) naming world
 * rank 3. Who notices depends on where the kill lands: rank 1 in its next collective with it
 * (the batch's shares, or a gradient bucket of its TP position), or the rollout worker in a
 * weights transfer from it. */
static void peer_killed(void) {
    rf_test_peer_killed_at(dir, rlflow, "data-parallel rank 1 of 2", 3, "error: ", " waited 10 s for world rank 3 (a rank is gone or stuck)");
}

static void refusals(void) {
    rf_test_tp_refusals(dir, rlflow);
    rf_test_wrong_size(dir, rlflow, 5, "this MPI job has 5 ranks; the recipe needs 6 (controller, placement.actor.dp x "
                                       "placement.actor.tp = 2 x 2 training workers and placement.rollout_ranks = 1 rollout "
                                       "workers)");
}

int main(void) {
    int start = rf_test_split_start("test_split_tpdp", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\nmax_staleness = 1\npeer_timeout = 10\n"
                                  "[placement]\nmode = \"split\"\nrollout_ranks = 1\n"
                                  "[placement.actor]\ntp = 2\ndp = 2\n");
    learns_like_one_rank();
    zero_ppo_checkpoint_resume();
    reward_model_split();
    peer_killed();
    refusals();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_tpdp");
}
