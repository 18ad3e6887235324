/* End-to-end runs of `rlflow run` on a small arithmetic task (1-digit operands), each a few
 * seconds: GRPO and PPO raise the training reward (mean of the last 20 steps above the first
 * 20 by a clear margin; a seeded run, so it is repeatable on one machine); a run resumed from
 * its step-20 checkpoint logs the same per-step metrics, bit for bit, as the uninterrupted run
 * (everything but wall-clock figures); the checkpoint loads with `rlflow generate`; bad recipes
 * fail with the exact error; an SFT with sft.target_accuracy stops at the first check that
 * reaches the target, and the accuracy it logged is what `rlflow eval` gives the saved model on
 * the same problems. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "kernels/kernels.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

static void write_recipe(void) { rf_test_write_recipe(dir, RF_TEST_VAL_ENDS, ""); }

static double mean_reward(const char *run, int from, int to) {
    return rf_test_metric_mean(dir, run, "reward/mean", from, to);
}

static void rises(const char *algo) {
    char *out;
    int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set algorithm.name=%s --set logging.dir=%s/%s%s", dir,
                rlflow, algo, dir, algo, strcmp(algo, "ppo") == 0 ? " --set critic.lr=1e-3" : "");
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out);
    free(out);
    double a = mean_reward(algo, 1, 20), b = mean_reward(algo, 101, 120);
    printf("%s: mean reward steps 1-20 %.3f, steps 101-120 %.3f\n", algo, a, b);
    CHECK(b > a + 0.08);
}

/* The policy losses and rollout corrections run end to end: GSPO with masked IS by sequence and
 * CISPO with masked IS by token each raise the reward as GRPO's clip does, and log what the
 * correction did. On the CPU the generation and training log-probs come from the same kernels,
 * so the weights sit at 1 and nothing is dropped in [0.5, 2]; truncated IS with is_cap 0.5
 * truncates every token to 0.5, which the metrics must say. */
static void losses_and_corrections(void) {
    static const char *const runs[][3] = {{"gspo", "mis-seq", "gspo"}, {"cispo", "mis-token", "cispo"}};
    for (int i = 0; i < 2; i++) {
        char *out;
        int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set algorithm.policy_loss=%s "
                            "--set algorithm.rollout_correction=%s --set logging.dir=%s/%s", dir, rlflow,
                            runs[i][0], runs[i][1], dir, runs[i][2]);
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out);
        free(out);
        double a = mean_reward(runs[i][2], 1, 20), b = mean_reward(runs[i][2], 101, 120);
        printf("%s + %s: mean reward steps 1-20 %.3f, steps 101-120 %.3f\n", runs[i][0], runs[i][1], a, b);
        CHECK(b > a + 0.08);
        CHECK(rf_test_metric(dir, runs[i][2], 10, "actor/is_masked_frac") == 0.0);
        CHECK(fabs(rf_test_metric(dir, runs[i][2], 10, "actor/is_weight_mean") - 1.0) < 1e-3);
        CHECK(isnan(rf_test_metric(dir, runs[i][2], 10, "actor/is_truncated_frac")));
    }
    CHECK(rf_test_metric(dir, "gspo", 10, "actor/is_masked_seq_frac") == 0.0);
    CHECK(isnan(rf_test_metric(dir, "cispo", 10, "actor/is_masked_seq_frac")));
    char *out;
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=3 --set algorithm.rollout_correction=tis "
                     "--set algorithm.is_cap=0.5 --set logging.dir=%s/truncated", dir, rlflow, dir) == 0);
    free(out);
    CHECK(rf_test_metric(dir, "truncated", 2, "actor/is_truncated_frac") == 1.0);
    CHECK(fabs(rf_test_metric(dir, "truncated", 2, "actor/is_weight_mean") - 0.5) < 1e-6);
    CHECK(isnan(rf_test_metric(dir, "truncated", 2, "actor/is_masked_frac")));
}

static void resume(void) {
    rf_test_resume_matches(dir, rlflow);
    char *out;
    /* the checkpoint is a model directory `rlflow generate` loads */
    CHECK(rf_test_sh(&out, "%s generate --model %s/half/step_000040/actor --prompt 3+4= --greedy --max-new-tokens 4", rlflow, dir) == 0);
    free(out);
}

/* A run whose rewards come (also) from an external reward program over the message API: the
 * echo program's reward includes +100 for an exact answer, so the mean reward jumps above 2
 * (one to three response tokens) and the run ends normally after telling the program to
 * shut down. */
static void external_program(void) {
    const char *echo = getenv("RF_REWARD_ECHO");
    if (!echo) {
        printf("test_run: external reward part skipped: RF_REWARD_ECHO not set\n");
        return;
    }
    char *out;
    CHECK(rf_test_sh(&out, "cd %s && (sleep 1; %s --connect ipc://%s/reward.sock --name e2e) & cd %s && "
                     "%s run r.toml --set train.steps=3 --set logging.dir=%s/ext "
                     "--set reward.external=ipc://%s/reward.sock --set reward.external_weight=0.01 "
                     "--set reward.external_timeout=20; wait", dir, echo, dir, dir, rlflow, dir, dir) == 0);
    CHECK(strstr(out, "waiting up to 20 s for a reward program") != NULL);
    free(out);
    char *m = rf_test_metrics_of(dir, "ext", 3);
    cJSON *j = m ? cJSON_Parse(m) : NULL;
    double r = j ? cJSON_GetObjectItem(j, "reward/mean")->valuedouble : -1;
    /* rule reward (0/1) + 0.01 * (n_tokens + 0.01 * len + 100 if exact): between 0 and 3 */
    CHECK(r > 0.0 && r < 3.0);
    cJSON_Delete(j), free(m);
    /* the program's "len" component (response token count) is logged */
    double len = rf_test_metric(dir, "ext", 3, "reward/external/len");
    CHECK(len >= 1 && len <= 6);
}

/* Per-token rewards from a reward program (echo --tokens 1: 0.5 * id_j + 0.25 * j at token j)
 * in a PPO run: the same first step with and without them differs in the reward (their sum,
 * weighted, is part of reward/mean) and in the critic's loss (GAE puts them at their tokens, so
 * the returns the critic regresses on change; the policy loss of a first step is ~0 either way:
 * whitened advantages at ratio 1). */
static void token_rewards(void) {
    const char *echo = getenv("RF_REWARD_ECHO");
    if (!echo) {
        printf("test_run: per-token reward part skipped: RF_REWARD_ECHO not set\n");
        return;
    }
    for (int tok = 0; tok < 2; tok++) {
        char *out;
        int rc = rf_test_sh(&out, "cd %s && (sleep 1; %s --connect ipc://%s/tok.sock --tokens %d) & cd %s && "
                            "%s run r.toml --set train.steps=1 --set algorithm.name=ppo "
                            "--set logging.val_every=0 --set logging.dir=%s/tok%d "
                            "--set reward.external=ipc://%s/tok.sock --set reward.external_weight=0.01 "
                            "--set reward.external_timeout=20; rc=$?; wait; exit $rc",
                            dir, echo, dir, tok, dir, rlflow, dir, tok, dir);
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out);
        free(out);
    }
    double r0 = rf_test_metric(dir, "tok0", 1, "reward/mean"), r1 = rf_test_metric(dir, "tok1", 1, "reward/mean");
    double l0 = rf_test_metric(dir, "tok0", 1, "critic/value_loss"), l1 = rf_test_metric(dir, "tok1", 1, "critic/value_loss");
    printf("per-token rewards: reward/mean %.4f -> %.4f, critic/value_loss %.5f -> %.5f\n", r0, r1, l0, l1);
    /* every response token adds 0.01 * (0.5 * id + 0.25 * j) >= 0, most of them > 0 */
    CHECK(r1 > r0 + 0.001);
    CHECK(fabs(l1 - l0) > 1e-3 * fabs(l0) && l1 > l0);
}

/* sft.target_accuracy: the SFT stops early at the first check at or above the target, and the
 * logged check accuracy equals `rlflow eval` of the saved model on the same first problems of
 * data.train (an independent pass over the written files). */
static void sft_target(void) {
    char *out;
    int rc = rf_test_sh(&out, "cd %s && %s sft r.toml --set model.path=%s/fresh --set sft.out=%s/sft_t "
                        "--set sft.max_steps=800 --set sft.target_accuracy=0.5 --set sft.check_every=25 "
                        "--set sft.check_size=40", dir, rlflow, dir, dir);
    CHECK(rc == 0);
    const char *stop = out ? strstr(out, ": stopping") : NULL;
    CHECK(stop != NULL);
    if (rc || !stop) {
        fprintf(stderr, "%s\n", out ? out : "");
        free(out);
        return;
    }
    const char *line = stop;
    while (line > out && line[-1] != '\n') line--;
    int step = 0;
    double acc = -1, target = -1;
    const char *at = strstr(line, "sft step ");
    CHECK(at && at < stop && sscanf(at, "sft step %d | check accuracy %lf (target %lf)", &step, &acc, &target) == 3);
    CHECK(step > 0 && step < 800 && step % 25 == 0);
    CHECK(acc >= 0.5 && fabs(target - 0.5) < 1e-12);
    /* no check before it reached the target */
    int earlier = 0;
    for (const char *p = strstr(out, "check accuracy"); p && p < line; p = strstr(p + 1, "check accuracy"))
        earlier++;
    CHECK(earlier == step / 25 - 1);
    free(out);
    char *ev;
    CHECK(rf_test_sh(&ev, "%s eval --model %s/sft_t --data %s/data/train.jsonl --n 40 --max-new-tokens 6",
                     rlflow, dir, dir) == 0);
    cJSON *j = ev ? cJSON_Parse(strchr(ev, '{')) : NULL;
    cJSON *a = j ? cJSON_GetObjectItem(j, "accuracy") : NULL;
    CHECK(cJSON_IsNumber(a) && fabs(a->valuedouble - acc) < 1e-9);
    cJSON_Delete(j);
    free(ev);
}

/* OpenMP's idle threads (cli/main.c): where the user set neither OMP_WAIT_POLICY nor
 * GOMP_SPINCOUNT and the machine is idle at the start, they spin 1000 times before they sleep,
 * and the run says so; on a busy machine, or with either variable set, nothing is changed and
 * nothing said. RF_TEST_MACHINE_IDLE gives the idle check's answer. */
static void omp_spin_choice(void) {
    static const struct { const char *env; int spins; } cases[] = {
        {"env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT RF_TEST_MACHINE_IDLE=1", 1},
        {"env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT RF_TEST_MACHINE_IDLE=0", 0},
        {"env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=PASSIVE RF_TEST_MACHINE_IDLE=1", 0},
        {"env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=5000 RF_TEST_MACHINE_IDLE=1", 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out;
        int rc = rf_test_sh(&out, "cd %s && %s %s run r.toml --set train.steps=1 --set logging.val_every=0 "
                            "--set logging.dir=%s/spin%zu 2>&1", dir, cases[i].env, rlflow, dir, i);
        CHECK(rc == 0);
        int said = strstr(out, "OpenMP: idle threads spin 1000 times (about 10 us) before they sleep: the machine was idle "
                               "at the start (set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose)") != NULL;
        CHECK(said == cases[i].spins);
        CHECK(cases[i].spins || !strstr(out, "OpenMP:"));
        if (rc || said != cases[i].spins) fprintf(stderr, "%s:\n%s\n", cases[i].env, out);
        free(out);
    }
}

/* model.precision = "bf16" (emulated where the CPU has no bf16 instructions): the training
 * reward rises as in fp32. Held-out greedy accuracy is printed, not asserted: at this test's size
 * (120 steps of 16 prompts) it moves within noise in fp32 and bf16 alike (on 150 problems one
 * build gave 0.460 -> 0.387 while the sampled training reward rose 0.293 -> 0.443); the held-out
 * gain of bf16 training is measured on the default recipe (docs/training.md). The log-probs generation recorded and the
 * trainer's own agree: exactly where the products are batch-invariant, to bf16 rounding
 * elsewhere (below). */
static void rises_bf16(void) {
    char *out;
    /* validated on 150 of the task's ~160 one-digit problems (the recipe's 40 give +-7 points) */
    int rc = rf_test_sh(&out, "cd %s && %s data arith --out %s/val150 --train 10 --val 150 --seed 7 --max-digits 1 "
                        "--mul-percent 0 >/dev/null && "
                        "%s run r.toml --set model.precision=bf16 --set logging.dir=%s/bf16 "
                        "--set data.val=%s/val150/val.jsonl --set logging.val_size=150 "
                        "--set logging.val_every=60 2>&1", dir, rlflow, dir, rlflow, dir, dir);
    CHECK(rc == 0);
    CHECK(strstr(out, "precision: bf16 (model.precision)") != NULL);
    const char *v = strstr(out, "validation accuracy: ");
    double a = -1, b = -1;
    CHECK(v && sscanf(v, "validation accuracy: %lf -> %lf", &a, &b) == 2);
    if (rc || !v) fprintf(stderr, "%s\n", out);
    free(out);
    double r0 = mean_reward("bf16", 1, 20), r1 = mean_reward("bf16", 101, 120);
    printf("bf16: mean reward steps 1-20 %.3f, steps 101-120 %.3f; validation accuracy %.3f -> %.3f\n", r0, r1, a, b);
    CHECK(r1 > r0 + 0.08);
    CHECK(a >= 0 && a <= 1 && b >= 0 && b <= 1);
    double mm = 0;
    for (int step = 1; step <= 120; step++) {
        double x = rf_test_metric_mean(dir, "bf16", "actor/logprob_mismatch_max", step, step);
        mm = x > mm ? x : mm;
    }
    /* Where the CPU back end's bf16 products are batch-invariant, a token's log-prob is the same
     * bits in generation and in training (attention gives every row the same bits whatever runs
     * beside it, and the sampler reports the log-prob kernel's own log-softmax): the mismatch
     * is exactly 0. Where they are not (oneDNN's AVX2 kernels: 1.06e-3 measured), a last-bit
     * difference upstream flips bf16 roundings of later activations, and the mismatch is of
     * bf16's own size. */
    int exact = rf_cpu_batch_invariant_exact_at(RF_PRECISION_BF16);
    printf("bf16: max actor/logprob_mismatch_max %.3g (bf16 products %sbatch-invariant here)\n", mm, exact ? "" : "not ");
    CHECK(exact ? mm == 0 : mm > 0 && mm < 1e-2);
}

static void bad_recipes(void) {
    char *out;
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set model.precision=fp16", dir, rlflow) == 1);
    CHECK(strstr(out, "--set: model.precision: \"fp16\" is not allowed (allowed: \"auto\", \"fp32\", \"bf16\")") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set algorithm.kl_coeff=0.1", dir, rlflow) == 1);
    CHECK(strstr(out, "unknown key \"algorithm.kl_coeff\" (did you mean \"algorithm.kl_coef\"?)") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set async.max_staleness=1", dir, rlflow) == 1);
    CHECK(strstr(out, "--set: async.max_staleness = 1 needs placement.mode = \"split\"") != NULL);
    free(out);
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set logging.dir=%s/none --resume", dir, rlflow, dir) == 1);
    CHECK(strstr(out, "no checkpoint to resume from") != NULL);
    free(out);
    /* a countdown file whose answers are the target alone (as older rlflow wrote them) */
    CHECK(rf_test_sh(NULL, "printf '%%s\\n' '{\"prompt\": \"3 5 -> 8:\", \"answer\": \"3 5 -> 8\"}' "
                     "'{\"prompt\": \"2 7 -> 14:\", \"answer\": \"14\"}' > %s/cd.jsonl", dir) == 0);
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set data.task=countdown --set data.train=%s/cd.jsonl "
                     "--set data.val= --set logging.dir=%s/cd", dir, rlflow, dir, dir) == 1);
    char want[600];
    snprintf(want, sizeof want, "%s/cd.jsonl:2: \"answer\" (data.answer_key) = \"14\" is not a countdown truth "
             "\"NUMBERS -> TARGET\" (\"3 7 25 50 -> 82\"), which the countdown rule reads", dir);
    CHECK(out && strstr(out, want) != NULL);
    if (out && !strstr(out, want)) fprintf(stderr, "%s\n", out);
    free(out);
    /* a prompt that leaves no room for the responses: refused at load, naming its line (it used
     * to fail the run when the rollout met it) */
    CHECK(rf_test_sh(NULL, "printf '%%s\\n' '{\"prompt\": \"1+1=\", \"answer\": \"2\"}' "
                     "'{\"prompt\": \"%0200d\", \"answer\": \"0\"}' > %s/long.jsonl", 0, dir) == 0);
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set data.train=%s/long.jsonl --set data.val= "
                     "--set data.max_prompt_tokens=0 --set rollout.max_new_tokens=2040 --set logging.dir=%s/long",
                     dir, rlflow, dir, dir) == 1);
    snprintf(want, sizeof want, "%s/long.jsonl:2: the prompt (", dir);
    CHECK(out && strstr(out, want) && strstr(out, "+ rollout.max_new_tokens (2040) exceed the model's 2048 positions"));
    if (out && !strstr(out, want)) fprintf(stderr, "%s\n", out);
    free(out);
}

int main(void) {
    rlflow = getenv("RF_RLFLOW");
    if (!rlflow) {
        printf("test_run: skipped: RF_RLFLOW not set\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_run_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    write_recipe();
    rises("grpo");
    rises("ppo");
    losses_and_corrections();
    rises_bf16();
    omp_spin_choice();
    resume();
    external_program();
    token_rewards();
    sft_target();
    bad_recipes();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_run");
}
