/* Multi-turn episodes in runs of several processes (docs/env-api.md, "Episodes in split and
 * multi-device runs"): the controller owns the environment, the rollout worker runs the turns.
 * On the multiply task with the calculator tool (a tiny model, a 300-step SFT warm start that
 * shows the tool's format, fp32 products), against the one-process run of the same recipe:
 *  - split run, staleness 0 (a controller, a training worker and a rollout worker under
 *    mpirun): every logged sample of steps 1-3 (all 16 of each step, samples.jsonl) has the same
 *    token ids, loss mask, per-token versions, response and reward as the one-process run's;
 *    steps 1-3's reward, accuracy, length and env/ metrics are equal bit for bit, the policy loss
 *    and gradient norm to 1e-4 relative or 1e-7 absolute (the rollout worker batches other
 *    sequences together and its products are batch-invariant, so behaviour log-probs may
 *    differ in the last bits);
 *  - colocated on 2 devices (placement.actor.dp = 2): the same samples as the one-process run
 *    at steps 1-2, and step 2's gradient norm and entropy (masked tokens out) to 1e-5 relative
 *    (fp32 sums over two ranks);
 *  - split run, staleness 1, 8 steps: the episodes use the tool (more than one turn and some
 *    observation tokens per episode on average) and get answers right (some reward); every
 *    logged token's version v satisfies step - 2 <= v <= step - 1 (the staleness bound k = 1),
 *    every observation token carries the version of the token before it;
 *  - per-turn rewards in PPO (GAE): the scripted environment program (examples/env/env_script.c,
 *    reward 0.5 (t + 1) + 0.01 x the turn's ids at each turn) in a split run gives the
 *    one-process run's step-1 reward, value loss and env/reward_mean bit for bit;
 *  - env.programs: the scripted program started by rlflow itself (no endpoint in the recipe: a
 *    loopback one with CURVE keys made for the run, read by the program from RLFLOW_ENV_*); in a
 *    split run it dies at its 30th request (--once: its restart plays straight), is restarted
 *    (the log says so, env/resent > 0) and the run gives the one-process run's rewards and
 *    env/ metrics bit for bit for 3 steps: nothing lost, nothing doubled;
 *  - a bounded wait: the only program goes silent mid-run with env.timeout = 4 s longer than
 *    async.peer_timeout = 2 s: the split run fails with the environment's error naming the
 *    request it waited for, not with a controller the workers took for dead (the controller
 *    keeps its workers pinged while it waits on the environment);
 *  - a controller that never answers a turn (test hook RF_TEST_IGNORE_TURNS): the rollout
 *    worker fails after env.timeout x 4 + async.peer_timeout seconds naming the turn, the
 *    request and the sample it waited for;
 *  - reward programs beside [env] (reward.programs = the length judge, examples/reward): the
 *    episodes run (env/turns_mean is logged: the environment was not opened at all with
 *    reward.programs before) and validation scores the episodes with the program too: val/reward
 *    is logged, above val/accuracy (the judge's part, 1 - |len - 64| / 64 > 0 for these short
 *    responses), the same in one process and in a split run;
 *  - validation scores the sequence training scores: an environment program with a first
 *    observation (env_script --first), the reward rules off (reward.rules = []), the only reward
 *    a reward program that answers the number of prompt ids it was sent (reward_program_echo
 *    --score prompt), every prompt the same text: val/reward equals training's reward/mean (the
 *    prompt and first observation's ids, plus the program's turn reward) in one process and in
 *    a split run, and is above the same run's without a first observation (before: validation
 *    left out the first observation and the turn rewards, 7.0 and 4.0 against training's 7.7
 *    and 4.7);
 *  - a reward model (tests/data/reward_model, weight 100) in validation: in the split run the
 *    training worker hosts it and scores the validation episodes for the controller; val/reward
 *    equals the one-process run's (which scores them in process) bit for bit and differs from
 *    val/accuracy (the model counted; before, the split run validated without it).
 * Skips (77) without mpirun. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "kernels/kernels.h"
#include "spawn_util.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

#define PER_STEP 16 /* rollout.n 4 x prompts_per_step 4, all logged */

static const char *rlflow;
static char dir[256];

static void write_recipe(void) {
    char tail[160];
    snprintf(tail, sizeof tail, "samples_every = 1\nsamples_per_step = %d\n[checkpoint]\nevery = 0\n[async]\npeer_timeout = 60\n",
             PER_STEP);
    rf_test_write_calc_recipe(dir, 3, tail);
}

static int run(const char *name, const char *args) {
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, name, args);
    if (rc) fprintf(stderr, "%s failed:\n%s\n", name, out ? out : "");
    free(out);
    return rc;
}

/* One logged episode: its trajectory as JSON text (response_ids, loss_mask, versions), the
 * response and the reward. */
typedef struct logged {
    char *ids, *mask, *versions, *response;
    double reward;
    int step;
} logged;

static char *json_text(const cJSON *j) { return j ? cJSON_PrintUnformatted(j) : NULL; }

/* The samples of a run's samples.jsonl by (step - 1) * PER_STEP + group * 4 + index. */
static int load(const char *name, logged *out, int steps) {
    char p[512], *text = NULL, *save = NULL;
    memset(out, 0, sizeof *out * (size_t)(steps * PER_STEP));
    snprintf(p, sizeof p, "%s/%s/samples.jsonl", dir, name);
    if (rf_read_file(p, &text, NULL) != RF_OK) return 0;
    int n = 0;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        int step = cJSON_GetObjectItem(j, "step") ? cJSON_GetObjectItem(j, "step")->valueint : 0;
        int g = cJSON_GetObjectItem(j, "group") ? cJSON_GetObjectItem(j, "group")->valueint : -1;
        int i = cJSON_GetObjectItem(j, "index") ? cJSON_GetObjectItem(j, "index")->valueint : -1;
        const cJSON *mask = cJSON_GetObjectItem(j, "loss_mask"), *rw = cJSON_GetObjectItem(j, "reward");
        if (step >= 1 && step <= steps && g >= 0 && g < 4 && i >= 0 && i < 4 && cJSON_IsString(mask) && cJSON_IsNumber(rw)) {
            logged *l = &out[(step - 1) * PER_STEP + g * 4 + i];
            l->ids = json_text(cJSON_GetObjectItem(j, "response_ids"));
            l->versions = json_text(cJSON_GetObjectItem(j, "versions"));
            l->mask = rf_strdup(mask->valuestring);
            l->response = rf_strdup(cJSON_GetStringValue(cJSON_GetObjectItem(j, "response")));
            l->reward = rw->valuedouble, l->step = step;
            n++;
        }
        cJSON_Delete(j);
    }
    free(text);
    return n;
}

static void free_logged(logged *l, int n) {
    for (int k = 0; k < n; k++) free(l[k].ids), free(l[k].mask), free(l[k].versions), free(l[k].response);
}

static int same(const char *a, const char *b) { return a && b && strcmp(a, b) == 0; }

/* Every logged sample of steps 1..steps of run b equals run a's. */
static void same_samples(const char *a, const char *b, int steps) {
    logged x[3 * PER_STEP], y[3 * PER_STEP];
    int na = load(a, x, steps), nb = load(b, y, steps), eq = 0;
    for (int k = 0; k < steps * PER_STEP; k++)
        eq += same(x[k].ids, y[k].ids) && same(x[k].mask, y[k].mask) && same(x[k].versions, y[k].versions) &&
              same(x[k].response, y[k].response) && x[k].reward == y[k].reward;
    printf("%s vs %s, steps 1-%d: %d and %d episodes logged, %d the same (ids, loss mask, versions, response, reward)\n",
           a, b, steps, na, nb, eq);
    CHECK(na == steps * PER_STEP && nb == na && eq == na);
    free_logged(x, steps * PER_STEP), free_logged(y, steps * PER_STEP);
}

static void same_metrics(const char *a, const char *b, int steps) {
    static const char *const exact[] = {"reward/mean", "reward/std", "reward/accuracy", "response/length_mean",
                                        "env/turns_mean", "env/observation_tokens_mean", "env/truncated_frac"};
    static const char *const near[] = {"actor/pg_loss", "actor/grad_norm"};
    for (int s = 1; s <= steps; s++) {
        for (size_t k = 0; k < sizeof exact / sizeof *exact; k++) {
            double x = rf_test_metric(dir, a, s, exact[k]), y = rf_test_metric(dir, b, s, exact[k]);
            CHECK(!isnan(x) && x == y);
            if (!(x == y)) fprintf(stderr, "step %d %s: %s %.17g, %s %.17g\n", s, exact[k], a, x, b, y);
        }
        /* 1e-4 relative, and 1e-7 absolute: a step whose advantages cancel has a policy loss of
         * order 1e-8 made of the behaviour log-probs' last bits alone (step 2 here: -1.66e-8 in
         * one process, -2.16e-8 in the split run, whose rollout worker's products of 1-4 rows go
         * to oneDNN, batch-invariant, where the one-process engine's take the matrix-vector
         * loops) */
        for (size_t k = 0; k < sizeof near / sizeof *near; k++) {
            double x = rf_test_metric(dir, a, s, near[k]), y = rf_test_metric(dir, b, s, near[k]);
            int close = !isnan(x) && fabs(x - y) <= 1e-4 * fabs(x) + 1e-7;
            CHECK(close);
            if (!close) fprintf(stderr, "step %d %s: %s %.17g, %s %.17g\n", s, near[k], a, x, b, y);
        }
    }
}

/* Staleness 1: versions within the bound, observations with the version before them. */
static void stale_run(void) {
    CHECK(run("stale", "--set placement.mode=split --set placement.rollout_ranks=1 --set async.max_staleness=1 "
                       "--set train.steps=8 --set logging.val_every=0") == 0);
    char p[512], *text = NULL, *save = NULL;
    snprintf(p, sizeof p, "%s/stale/samples.jsonl", dir);
    CHECK(rf_read_file(p, &text, NULL) == RF_OK);
    int n = 0, bad = 0, older = 0, mixed = 0, obs = 0;
    for (char *line = text ? strtok_r(text, "\n", &save) : NULL; line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *v = cJSON_GetObjectItem(j, "versions"), *m = cJSON_GetObjectItem(j, "loss_mask");
        int step = cJSON_GetObjectItem(j, "step") ? cJSON_GetObjectItem(j, "step")->valueint : 0;
        int len = cJSON_GetArraySize(v), lo = 1 << 30, hi = -1;
        if (!cJSON_IsString(m) || (int)strlen(m->valuestring) != len || len < 1) bad++;
        for (int t = 0; cJSON_IsString(m) && t < len && t < (int)strlen(m->valuestring); t++) {
            int ver = cJSON_GetArrayItem(v, t)->valueint;
            lo = ver < lo ? ver : lo, hi = ver > hi ? ver : hi;
            bad += ver > step - 1 || ver < step - 2;
            if (m->valuestring[t] == '0')
                obs++, bad += t == 0 || ver != cJSON_GetArrayItem(v, t - 1)->valueint;
        }
        n++, older += lo < step - 1, mixed += lo != hi;
        cJSON_Delete(j);
    }
    free(text);
    double turns = rf_test_metric_mean(dir, "stale", "env/turns_mean", 1, 8);
    double obs_mean = rf_test_metric_mean(dir, "stale", "env/observation_tokens_mean", 1, 8);
    double reward = rf_test_metric_mean(dir, "stale", "reward/mean", 1, 8);
    printf("staleness 1: %d episodes logged over 8 steps, %d with tokens one version old, %d whose versions change "
           "mid-episode, %d observation tokens; %d violations; %.2f turns and %.1f observation tokens per episode, "
           "reward %.3f\n", n, older, mixed, obs, bad, turns, obs_mean, reward);
    CHECK(n == 8 * PER_STEP && bad == 0 && older > 0 && obs > 0);
    CHECK(turns > 1.05 && obs_mean > 1 && reward > 0);
}

/* PPO with the scripted program's per-turn rewards: split = one process at step 1. */
static void turn_rewards(void) {
    const char *script = getenv("RF_ENV_SCRIPT");
    if (!script) {
        printf("skipped: per-turn rewards (RF_ENV_SCRIPT not set)\n");
        return;
    }
    const char *runs[2] = {"ppo_one", "ppo_split"};
    for (int i = 0; i < 2; i++) {
        char *out = NULL;
        int rc = rf_test_sh(&out, "cd %s && (sleep 1; %s --connect ipc://%s/%s.sock --turns 2 > %s/%s_env.log 2>&1) & "
                            "cd %s && %s run r.toml --set logging.dir=%s/%s --set env.type=external --set "
                            "env.endpoint=ipc://%s/%s.sock --set algorithm.name=ppo --set train.steps=1 %s; rc=$?; wait; exit $rc",
                            dir, script, dir, runs[i], dir, runs[i], dir, rlflow, dir, runs[i], dir, runs[i],
                            i ? "--set placement.mode=split --set placement.rollout_ranks=1" : "");
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
    }
    static const char *const keys[] = {"reward/mean", "critic/value_loss", "env/reward_mean", "env/turns_mean"};
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
        double a = rf_test_metric(dir, runs[0], 1, keys[k]), b = rf_test_metric(dir, runs[1], 1, keys[k]);
        printf("PPO with turn rewards, step 1 %s: one process %.17g, split %.17g\n", keys[k], a, b);
        CHECK(!isnan(a) && a == b);
    }
    CHECK(rf_test_metric(dir, runs[0], 1, "env/reward_mean") > 1.0); /* two turns: 0.5 + 1.0 + 0.01 x ids */
}

/* env.programs: a program rlflow starts dies and is restarted; nothing lost or doubled. */
static void started_programs(void) {
    const char *script = getenv("RF_ENV_SCRIPT");
    if (!script) {
        printf("skipped: env.programs (RF_ENV_SCRIPT not set)\n");
        return;
    }
    const char *names[2] = {"progs_one", "progs_die"};
    char *logs[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        char args[1024];
        snprintf(args, sizeof args, "--set env.type=external --set 'env.programs=[[\"%s\", \"--turns\", \"2\"%s%s%s]]' %s",
                 script, i ? ", \"--mode\", \"die\", \"--after\", \"30\", \"--once\", \"" : "", i ? dir : "",
                 i ? "/died\"" : "", i ? "--set placement.mode=split --set placement.rollout_ranks=1" : "");
        int rc = rf_test_run_recipe(&logs[i], dir, rlflow, names[i], args);
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", logs[i] ? logs[i] : "");
    }
    CHECK(logs[1] && strstr(logs[1], "env.programs[0] (") && strstr(logs[1], "exited with status 9; restart 1 of 3"));
    double resent = 0;
    for (int s = 1; s <= 3; s++) {
        resent += rf_test_metric(dir, names[1], s, "env/resent");
        static const char *const keys[] = {"reward/mean", "reward/std", "env/reward_mean", "env/turns_mean",
                                           "response/length_mean"};
        for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
            double a = rf_test_metric(dir, names[0], s, keys[k]), b = rf_test_metric(dir, names[1], s, keys[k]);
            CHECK(!isnan(a) && a == b);
            if (!(a == b)) fprintf(stderr, "step %d %s: one process %.17g, split with a death %.17g\n", s, keys[k], a, b);
        }
    }
    printf("env.programs: the program rlflow started died at its 30th request and was restarted; %.0f requests "
           "re-sent; 3 steps' rewards and env/ metrics equal the one-process run's\n", resent);
    CHECK(resent > 0);
    free(logs[0]), free(logs[1]);
}

/* A silent environment in a split run: the environment's error, within its deadlines. */
static void silent_environment(void) {
    const char *script = getenv("RF_ENV_SCRIPT");
    if (!script) {
        printf("skipped: a silent environment (RF_ENV_SCRIPT not set)\n");
        return;
    }
    char ep[300], log[300];
    snprintf(ep, sizeof ep, "ipc://%s/hang.sock", dir);
    snprintf(log, sizeof log, "%s/hang_env.log", dir);
    char *argv[] = {(char *)script, "--connect", ep, "--turns", "2", "--mode", "silent", "--after", "40", NULL};
    pid_t p = rf_test_spawn(argv, log);
    CHECK(p > 0);
    char *out = NULL;
    int rc = rf_test_sh(&out, "cd %s && timeout 120 %s run r.toml --set logging.dir=%s/hang --set env.type=external "
                        "--set env.endpoint=%s --set env.timeout=4 --set async.peer_timeout=2 --set placement.mode=split "
                        "--set placement.rollout_ranks=1", dir, rlflow, dir, ep);
    rf_test_kill(p); /* silent: it would sleep on */
    CHECK(rc != 0 && rc != 124);
    int named = out && strstr(out, "sent nothing for 4.0 s while answering request 40 (") &&
                strstr(out, "no other environment program connected to ipc://");
    CHECK(named);
    CHECK(out && !strstr(out, "(async.peer_timeout): it is gone or stuck"));
    if (!named) fprintf(stderr, "%s\n", out ? out : "");
    else printf("a silent environment: the split run failed naming the request it waited for, its workers still pinged\n");
    free(out);
}

/* The rollout worker's bounded wait for its turns' answers. */
static void unanswered_turns(void) {
    char *out = NULL;
    int rc = rf_test_sh(&out, "cd %s && RF_TEST_IGNORE_TURNS=1 timeout 120 %s run r.toml --set logging.dir=%s/ignored "
                        "--set env.timeout=1 --set async.peer_timeout=2 --set placement.mode=split "
                        "--set placement.rollout_ranks=1", dir, rlflow, dir);
    CHECK(rc != 0 && rc != 124);
    int named = out && strstr(out, "the controller did not answer turn 0 of request ") &&
                strstr(out, " within 6 s (EnvObservations; env.timeout x 4 attempts + async.peer_timeout)");
    CHECK(named);
    if (!named) fprintf(stderr, "%s\n", out ? out : "");
    else printf("a controller that never answers a turn: the rollout worker failed after 6 s naming the turn\n");
    free(out);
}

/* [env] with reward.programs: training and validation scored by the programs too. */
static void env_with_reward_programs(void) {
    const char *judge = getenv("RF_LENGTH_JUDGE");
    if (!judge) {
        printf("skipped: [env] with reward.programs (RF_LENGTH_JUDGE not set)\n");
        return;
    }
    const char *names[2] = {"judged_one", "judged_split"};
    for (int i = 0; i < 2; i++) {
        char args[800];
        snprintf(args, sizeof args, "--set train.steps=1 --set 'reward.programs=[[\"%s\"]]' %s", judge,
                 i ? "--set placement.mode=split --set placement.rollout_ranks=1" : "");
        CHECK(run(names[i], args) == 0);
    }
    double acc[2], rew[2];
    for (int i = 0; i < 2; i++) {
        acc[i] = rf_test_metric(dir, names[i], 1, "val/accuracy"), rew[i] = rf_test_metric(dir, names[i], 1, "val/reward");
        CHECK(rf_test_metric(dir, names[i], 1, "env/turns_mean") >= 1);
    }
    printf("[env] with reward.programs, validation after step 1: accuracy %.4f / %.4f, reward %.6f / %.6f (one "
           "process / split)\n", acc[0], acc[1], rew[0], rew[1]);
    CHECK(!isnan(rew[0]) && rew[0] == rew[1] && acc[0] == acc[1] && rew[0] > acc[0] + 0.05);
}

/* Validation's reward program request carries the prompt and first observation, as training's:
 * one prompt text everywhere, the reward = the number of prompt ids the program was sent (plus
 * the scripted environment's turn reward, 0.5 + 0.01 x the action's ids: one token per response
 * here, so that sampled and greedy responses score alike whatever the model emits; with up to 16
 * the sampled ones' lengths differed from the greedy ones' on another rounding, an AddressSanitizer
 * build's, and the means parted). */
static void val_first_observation(void) {
    const char *script = getenv("RF_ENV_SCRIPT"), *echo = getenv("RF_REWARD_ECHO");
    if (!script || !echo) {
        printf("skipped: validation with a first observation (RF_ENV_SCRIPT or RF_REWARD_ECHO not set)\n");
        return;
    }
    CHECK(rf_test_sh(NULL, "mkdir -p %s/same && for i in 1 2 3 4 5 6 7 8; do echo '{\"prompt\": \"6*7=\", "
                     "\"answer\": \"42\"}'; done > %s/same/train.jsonl && cp %s/same/train.jsonl %s/same/val.jsonl",
                     dir, dir, dir, dir) == 0);
    const char *names[3] = {"first_one", "first_split", "nofirst_one"};
    for (int i = 0; i < 3; i++) {
        char args[1600];
        snprintf(args, sizeof args,
                 "--set train.steps=1 --set logging.val_every=1 --set logging.val_size=4 --set rollout.max_new_tokens=1 "
                 "--set data.train=%s/same/train.jsonl "
                 "--set data.val=%s/same/val.jsonl --set 'reward.rules=[]' --set reward.external=tcp://127.0.0.1:%d "
                 "--set 'reward.programs=[[\"%s\", \"--connect\", \"tcp://127.0.0.1:%d\", \"--score\", \"prompt\"]]' "
                 "--set env.type=external --set 'env.programs=[[\"%s\", \"--turns\", \"1\"%s]]' %s",
                 dir, dir, 45310 + i, echo, 45310 + i, script, i == 2 ? "" : ", \"--first\", \"<f>\"",
                 i == 1 ? "--set placement.mode=split --set placement.rollout_ranks=1" : "");
        CHECK(run(names[i], args) == 0);
    }
    double train[3], val[3];
    for (int i = 0; i < 3; i++)
        train[i] = rf_test_metric(dir, names[i], 1, "reward/mean"), val[i] = rf_test_metric(dir, names[i], 1, "val/reward");
    printf("validation with a first observation: prompt ids sent to the reward program, training / validation: "
           "%.1f / %.1f one process, %.1f / %.1f split, %.1f / %.1f without a first observation\n", train[0], val[0],
           train[1], val[1], train[2], val[2]);
    CHECK(!isnan(val[0]) && val[0] == train[0] && val[1] == train[1] && train[1] == train[0]);
    CHECK(!isnan(val[2]) && val[2] == train[2] && val[0] > val[2]);
}

/* Validation with a reward model: the split run's (the training worker scores) equals one process's. */
static void val_reward_model(void) {
    const char *src = getenv("RF_SOURCE_DIR");
    if (!src) {
        printf("skipped: validation with a reward model (RF_SOURCE_DIR not set)\n");
        return;
    }
    const char *names[2] = {"rm_one", "rm_split"};
    double val[2], acc[2];
    for (int i = 0; i < 2; i++) {
        char args[800];
        snprintf(args, sizeof args, "--set train.steps=1 --set logging.val_every=1 --set reward.model=%s/tests/data/reward_model "
                 "--set reward.model_weight=100 %s", src, i ? "--set placement.mode=split --set placement.rollout_ranks=1" : "");
        CHECK(run(names[i], args) == 0);
        val[i] = rf_test_metric(dir, names[i], 1, "val/reward"), acc[i] = rf_test_metric(dir, names[i], 1, "val/accuracy");
    }
    printf("validation with a reward model: val/reward %.17g one process, %.17g split (val/accuracy %.4f / %.4f)\n",
           val[0], val[1], acc[0], acc[1]);
    CHECK(!isnan(val[0]) && !isnan(val[1]) && fabs(val[0] - acc[0]) > 0.1);
    /* equal where the products are batch-invariant (the recipe is fp32): else the rollout
     * worker's batches round otherwise and a greedy answer may change */
    if (rf_cpu_batch_invariant_exact_at(RF_PRECISION_FP32)) CHECK(val[0] == val[1] && acc[0] == acc[1]);
    else printf("validation with a reward model: not compared bit for bit (products not batch-invariant here)\n");
}

int main(void) {
    int start = rf_test_split_start("test_split_env", &rlflow, dir, sizeof dir);
    if (start) return start;
    write_recipe();
    CHECK(run("one", "") == 0);
    CHECK(run("split", "--set placement.mode=split --set placement.rollout_ranks=1 --set async.max_staleness=0") == 0);
    same_samples("one", "split", 3);
    same_metrics("one", "split", 3);
    CHECK(run("colo", "--set placement.actor.dp=2 --set train.steps=2") == 0);
    same_samples("one", "colo", 2);
    /* the loss mask reaches both data-parallel ranks: with an entropy bonus every step has a
     * gradient whatever the rewards (groups of equal rewards give none otherwise, and which steps
     * those are depends on the CPU's roundings), and the bonus counts generated tokens only; the
     * update agrees with one process's to fp32 sums */
    const char *ent = "--set train.steps=2 --set algorithm.entropy_coef=0.01";
    char colo[256];
    snprintf(colo, sizeof colo, "%s --set placement.actor.dp=2", ent);
    CHECK(run("one_ent", ent) == 0);
    CHECK(run("colo_ent", colo) == 0);
    for (int step = 1; step <= 2; step++)
        for (int k = 0; k < 2; k++) {
            const char *key = k ? "actor/entropy" : "actor/grad_norm";
            double a = rf_test_metric(dir, "one_ent", step, key), b = rf_test_metric(dir, "colo_ent", step, key);
            printf("colocated dp = 2, entropy bonus, step %d %s: one process %.9g, colocated %.9g\n", step, key, a, b);
            CHECK(a > 0 && fabs(a - b) <= 1e-5 * a);
        }
    stale_run();
    turn_rewards();
    started_programs();
    silent_environment();
    unanswered_turns();
    env_with_reward_programs();
    val_first_observation();
    val_reward_model();
    if (!rf_test_failed) rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_env");
}
