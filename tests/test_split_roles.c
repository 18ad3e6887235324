/* The critic and the reference on their own data-parallel layouts (placement.critic.dp and
 * placement.reference.dp smaller than placement.actor.dp = 3: the first dp replicas hold them)
 * in split runs under mpirun (rlflow starts it): a controller, three training workers and a
 * rollout worker as five processes on the 1-digit arithmetic task (tests/run_util.h).
 *   - the critic and the reference on 2 of the 3 replicas against both on all 3: 3 synchronous
 *     PPO steps with a KL term (async.max_staleness = 0: the same samples) score and train
 *     alike (rf_test_same_scores: the same reward, value loss within 1e-5, KL within 1e-4);
 *     the rank table, the layout line and the scoring line say where each model is; the
 *     reference on 1 replica with the critic on 2 scores on 1;
 *   - one synchronous step with the critic on 2 of 3 replicas against 3 of 3 (plain): the
 *     critic's AdamW moments in the checkpoints agree within 1e-4 of their largest value (its
 *     shares cover the batch once: a sample trained twice or not at all moves them by far
 *     more), and ZeRO-1 (the critic's moments sharded over its 2 replicas) against plain;
 *   - a ZeRO-1 run with the critic on 2 of 3 replicas checkpointed at step 3, then --resume to
 *     4: the optimizer step counts go on from 3;
 *   - a reward model on 3, 2 and 1 of the 3 replicas (placement.reward.dp): one synchronous step
 *     gives the same reward within 1e-5 (far from the rule's accuracy: the model's scores count),
 *     the rank table and the scoring line say where it is;
 *   - a critic or a reward model on more replicas than the actor has is refused with the exact
 *     error.
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

#define PPO "--set algorithm.name=ppo --set algorithm.kl_coef=0.01 --set logging.val_every=0 --set async.max_staleness=0"

static void fewer_replicas_score_alike(void) {
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "roles2", PPO " --set train.steps=3 --set placement.critic.dp=2 "
                                "--set placement.reference.dp=2");
    CHECK(rc == 0);
    const char *want[] = {
        "split run: 5 processes (controller, 3 data-parallel training workers, 1 rollout workers)",
        "rank 1: training worker, data-parallel rank 0 of 3 (actor, reference, critic)",
        "rank 2: training worker, data-parallel rank 1 of 3 (actor, reference, critic)",
        "rank 3: training worker, data-parallel rank 2 of 3 (actor)",
        "training worker: data parallel over 3 ranks, actor, and the critic over the first 2 replicas (its own shares of "
        "each batch)",
        "training worker: scoring reference log-probs and values on 2 data-parallel replicas (token-balanced shares)"};
    rf_test_has_all(out, want, sizeof want / sizeof want[0]);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rc = rf_test_run_recipe(&out, dir, rlflow, "roles3", PPO " --set train.steps=3");
    CHECK(rc == 0);
    CHECK(out && strstr(out, "training worker: scoring reference log-probs and values on 3 data-parallel replicas"));
    CHECK(out && strstr(out, "training worker: data parallel over 3 ranks, actor and critic"));
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rf_test_same_scores(dir, "roles2", "roles3", "critic and reference on 2 / 3 of 3 replicas");
    /* the reference on replica 0 alone, the critic on two: scored where both are */
    rc = rf_test_run_recipe(&out, dir, rlflow, "ref1", PPO " --set train.steps=3 --set placement.critic.dp=2 "
                            "--set placement.reference.dp=1");
    CHECK(rc == 0);
    CHECK(out && strstr(out, "rank 2: training worker, data-parallel rank 1 of 3 (actor, critic)"));
    CHECK(out && strstr(out, "training worker: scoring reference log-probs and values on 1 data-parallel replica"));
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rf_test_same_scores(dir, "ref1", "roles3", "reference on 1, critic on 2 / both on 3 of 3 replicas");
}

/* The critic's optimizer state after one step on the same samples: on 2 replicas against 3
 * (plain), and ZeRO-1 against plain on 2. */
static void critic_moments(void) {
    rf_test_zero_like_plain(dir, rlflow, "c2", PPO " --set placement.critic.dp=2");
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "c3_plain", PPO " --set train.steps=1");
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    rf_test_same_moments(dir, "c2_plain", "c3_plain", "step_000001", "critic", 1e-4);
    rf_test_same_moments(dir, "c2_plain", "c3_plain", "step_000001", "actor", 1e-4);
}

static void zero_resume(void) {
    const char *args = PPO " --set placement.critic.dp=2 --set placement.reference.dp=2 --set placement.actor.zero=1";
    char a[512], *out = NULL;
    snprintf(a, sizeof a, "%s --set train.steps=3", args);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "zero", a);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(rf_test_trainer_state(dir, "zero", "step_000003", "critic_optimizer_steps") == 3);
    snprintf(a, sizeof a, "%s --set train.steps=4 --resume", args);
    rc = rf_test_run_recipe(&out, dir, rlflow, "zero", a);
    CHECK(rc == 0);
    CHECK(out && strstr(out, "resumed at step 3"));
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    CHECK(rf_test_trainer_state(dir, "zero", "step_000004", "actor_optimizer_steps") == 4);
    CHECK(rf_test_trainer_state(dir, "zero", "step_000004", "critic_optimizer_steps") == 4);
    CHECK(rf_test_metric(dir, "zero", 4, "critic/value_loss") > 0);
}

/* A reward model on all 3 replicas, on 2 and on replica 0 alone: the same step-1 reward, and
 * the rank table and the scoring line say where it is. */
static void reward_model_replicas(void) {
    const char *runs[3] = {"rm3", "rm2", "rm1"};
    const char *extra[3] = {"--set placement.reward.dp=3", "--set placement.reward.dp=2", "--set placement.reward.dp=1"};
    const char *rank1 = "rank 1: training worker, data-parallel rank 0 of 3 (actor, reference, critic, reward model)";
    const char *want[9] = {
        "training worker: scoring reference log-probs, values and reward-model scores on 3 data-parallel replicas "
        "(token-balanced shares)",
        "rank 3: training worker, data-parallel rank 2 of 3 (actor, reference, critic, reward model)", rank1,
        "training worker: scoring reference log-probs, values and reward-model scores on 2 data-parallel replicas "
        "(token-balanced shares)",
        "rank 3: training worker, data-parallel rank 2 of 3 (actor, reference, critic)", rank1,
        "training worker: scoring reference log-probs, values and reward-model scores on 1 data-parallel replica",
        "rank 3: training worker, data-parallel rank 2 of 3 (actor, reference, critic)", rank1};
    rf_test_rm_layouts("test_split_roles", dir, rlflow, PPO, 3, runs, extra, want, 3);
}

static void refused(void) {
    char want[600];
    snprintf(want, sizeof want, "error: --set: placement.critic.dp = 4 is more than placement.actor.dp = 3 "
             "(the critic is held by the first placement.critic.dp of the actor's data-parallel replicas)");
    rf_test_refused(dir, rlflow, 0, "refused", PPO " --set placement.critic.dp=4", want);
    snprintf(want, sizeof want, "error: --set: placement.reward.dp = 4 is more than placement.actor.dp = 3 "
             "(the reward model is held by the first placement.reward.dp of the actor's data-parallel replicas)");
    rf_test_refused(dir, rlflow, 0, "refused_rm", PPO " --set placement.reward.dp=4", want);
}

int main(void) {
    int start = rf_test_split_start("test_split_roles", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\nmax_staleness = 1\npeer_timeout = 20\n"
                                  "[placement]\nmode = \"split\"\nrollout_ranks = 1\n"
                                  "[placement.actor]\ndp = 3\n");
    fewer_replicas_score_alike();
    critic_moments();
    zero_resume();
    reward_model_replicas();
    refused();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_roles");
}
