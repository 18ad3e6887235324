/* Shared by the end-to-end run tests: the small arithmetic recipe they run (1-digit operands,
 * tiny model, a 150-step SFT warm start, 120 GRPO steps of 16 prompts x 8 samples) and a
 * reader of per-step metrics. Include after test_shell.h. */
#ifndef RF_TEST_RUN_UTIL_H
#define RF_TEST_RUN_UTIL_H

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "common/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernels.h"
#include "model/model.h"

/* How much the mean training reward of steps 101-120 must exceed that of steps 1-20 in the
 * 120-step split runs of the arithmetic task. Measured rises: 0.08-0.15 (every split test,
 * tp, dp, tp x dp, rollout tp); the runs are asynchronous (k = 1), so which samples a batch
 * holds depends on timing, and a 20-step mean moves by 0.02-0.03 between runs of one recipe. A
 * run that does not learn stays within that noise of its start; 0.08 failed learning runs under
 * load (0.079). */
#define RF_TEST_MIN_RISE 0.06
#include "test_util.h"

/* <dir>/r.toml opened for writing (NULL when it cannot be). */
static inline FILE *rf_test_open_recipe(const char *dir) {
    char p[512];
    snprintf(p, sizeof p, "%s/r.toml", dir);
    return fopen(p, "w");
}

/* logging.val_every larger than any test's train.steps: validation before training (step 0)
 * and at the last step only (0 is no validation at all). */
#define RF_TEST_VAL_ENDS 1000000

/* Whether the products of a run at model.precision = "auto" (rf_test_write_recipe's) are
 * batch-invariant here: bf16 where the CPU has bf16 instructions (kernels/precision.c), else
 * fp32. On AMX fp32 products are and bf16 ones are not (kernels.h rf_cpu_batch_invariant_exact),
 * so the test process's own precision (fp32) does not tell. */
static inline int rf_test_auto_exact(void) {
    return rf_cpu_batch_invariant_exact_at(rf_cpu_isa_has_bf16() ? RF_PRECISION_BF16 : RF_PRECISION_FP32);
}

/* Writes <dir>/r.toml: the recipe, validation every val_every steps, then `extra` (more TOML
 * tables, may be ""). */
static inline void rf_test_write_recipe(const char *dir, int val_every, const char *extra) {
    FILE *f = rf_test_open_recipe(dir);
    if (!f) return;
    fprintf(f, "[model]\npath = \"%s/sft\"\ninit_preset = \"tiny\"\n"
               "[data]\ntask = \"arith\"\ntask_max_digits = 1\ntask_mul_percent = 0\n"
               "task_train = 2000\ntask_val = 40\ntrain = \"%s/data/train.jsonl\"\nval = \"%s/data/val.jsonl\"\n"
               "[sft]\nwarm_start = true\nmax_steps = 150\nbatch_size = 64\nlr = 3e-3\n"
               "[rollout]\nn = 8\nprompts_per_step = 16\nmax_new_tokens = 6\n"
               "[algorithm]\nname = \"grpo\"\nclip_high = 0.28\n"
               "[train]\nsteps = 120\nlr = 5e-4\n"
               "[logging]\nval_every = %d\nval_size = 40\n[checkpoint]\nevery = 20\nkeep = 0\n%s",
            dir, dir, dir, val_every, extra);
    fclose(f);
}

/* Writes <dir>/r.toml for the calculator-tool tests (test_run_env, test_split_env): 1-2 digit
 * multiplication, a 300-step SFT warm start, 4 prompts x 4 samples of up to 16 tokens, [env]
 * calculator (3 turns, 64 tokens), fp32 products (the generation's and the trainer's log-probs
 * then differ only by the order of fp32 sums: bf16 operands round a slightly different attention
 * output to the other side of a bf16 step now and then, up to 2.3e-3, which would hide an
 * observation token misplaced in the trajectory), `steps` GRPO steps at lr 3e-4, the numeric
 * rule, validation of 16 prompts every 3 steps; then `extra` (more keys of [logging], then more
 * tables, may be ""). */
static inline void rf_test_write_calc_recipe(const char *dir, int steps, const char *extra) {
    FILE *f = rf_test_open_recipe(dir);
    if (!f) return;
    fprintf(f, "[model]\npath = \"%s/sft\"\ninit_preset = \"tiny\"\nprecision = \"fp32\"\n"
               "[data]\ntask = \"multiply\"\ntask_min_digits = 1\ntask_max_digits = 2\n"
               "task_train = 3000\ntask_val = 16\ntrain = \"%s/data/train.jsonl\"\nval = \"%s/data/val.jsonl\"\n"
               "[sft]\nwarm_start = true\nmax_steps = 300\nbatch_size = 64\nlr = 3e-3\n"
               "[rollout]\nn = 4\nprompts_per_step = 4\nmax_new_tokens = 16\n"
               "[env]\ntype = \"calculator\"\nmax_turns = 3\nmax_total_tokens = 64\n"
               "[train]\nsteps = %d\nlr = 3e-4\n[reward]\nrules = [\"numeric\"]\n"
               "[logging]\nval_every = 3\nval_size = 16\n%s",
            dir, dir, dir, steps, extra);
    fclose(f);
}

/* Common start of the tests that run rlflow: the rlflow under test into *rlflow and a fresh work
 * directory /tmp/rf_<test>_<random> into dir (cap bytes). Returns 0 to go on, 77 (ctest's skip)
 * when RF_RLFLOW is not set, 1 when the directory cannot be made. */
static inline int rf_test_run_start(const char *test, const char **rlflow, char *dir, size_t cap) {
    *rlflow = getenv("RF_RLFLOW");
    if (!*rlflow) {
        printf("%s: skipped: RF_RLFLOW not set\n", test);
        return 77;
    }
    snprintf(dir, cap, "/tmp/rf_%s_XXXXXX", test);
    return mkdtemp(dir) ? 0 : 1;
}

/* Common start of the split-run tests: rf_test_run_start, and 77 (ctest's skip) when mpirun is
 * missing too. */
static inline int rf_test_split_start(const char *test, const char **rlflow, char *dir, size_t cap) {
    if (getenv("RF_RLFLOW") && rf_test_sh(NULL, "command -v mpirun >/dev/null") != 0) {
        printf("%s: skipped: mpirun not found (apt-get install openmpi-bin)\n", test);
        return 77;
    }
    return rf_test_run_start(test, rlflow, dir, cap);
}

/* Runs `rlflow run r.toml <args> --set logging.dir=<dir>/<run>` in dir; returns its exit code
 * and output (caller frees). */
static inline int rf_test_run_recipe(char **out, const char *dir, const char *rlflow, const char *run,
                                     const char *args) {
    return rf_test_sh(out, "cd %s && %s run r.toml %s --set logging.dir=%s/%s", dir, rlflow, args, dir, run);
}

/* `rlflow run r.toml <args> --set logging.dir=<dir>/<run>` (np = 0), or the same under a
 * hand-started `mpirun -np <np>` (the MPI job's size against the recipe), must fail with
 * `want` in its output (printed when not). */
static inline void rf_test_refused(const char *dir, const char *rlflow, int np, const char *run, const char *args,
                                   const char *want) {
    char *out = NULL, mpi[64] = "";
    if (np > 0) snprintf(mpi, sizeof mpi, "mpirun -np %d --oversubscribe %s", np, geteuid() == 0 ? "--allow-run-as-root" : "");
    int rc = rf_test_sh(&out, "cd %s && %s %s run r.toml %s --set logging.dir=%s/%s", dir, mpi, rlflow, args, dir, run);
    CHECK(rc != 0);
    CHECK(out && strstr(out, want) != NULL);
    if (!out || !strstr(out, want)) fprintf(stderr, "want \"%s\" in:\n%s\n", want, out ? out : "");
    free(out);
}

/* Runs r.toml under a user's `mpirun -np np` and checks that it fails with `want` (the world
 * size against the recipe's layout). */
static inline void rf_test_wrong_size(const char *dir, const char *rlflow, int np, const char *want) {
    rf_test_refused(dir, rlflow, np, "size", "", want);
}

/* The refusals of a tensor-parallel recipe (r.toml with [placement.actor] tp = 2) before
 * mpirun starts: tp = 3 does not divide the tiny model's 4 heads; the recipe made colocated with
 * its placement.rollout_ranks = 1 kept, where a colocated run has one rollout rank per training
 * rank. */
static inline void rf_test_tp_refusals(const char *dir, const char *rlflow) {
    char want[1024];
    snprintf(want, sizeof want, "error: --set: placement.actor.tp = 3 does not divide the 4 attention heads of model.path "
                                "\"%s/sft\" (tensor parallelism splits whole heads)", dir);
    rf_test_refused(dir, rlflow, 0, "heads", "--set placement.actor.tp=3", want);
    rf_test_refused(dir, rlflow, 0, "colocated", "--set placement.mode=colocated --set async.max_staleness=0",
                    ":1: placement.rollout_ranks = 1, but a colocated run has one rollout rank on each of its ");
}

/* 1 when the file at path holds needle. */
static inline int rf_test_file_has(const char *path, const char *needle) {
    char *text;
    if (rf_read_file(path, &text, NULL) != RF_OK) return 0;
    int r = strstr(text, needle) != NULL;
    free(text);
    return r;
}

/* A peer of a split run killed mid-run (the data- and tensor-parallel tests): starts
 * `rlflow run r.toml` in dir (metrics in dir/kill, console in dir/kill.log; both removed first:
 * an earlier kill's step 5 must not count), SIGKILLs the process whose console line reads
 * "<who> ready (world rank <world_rank>, pid P)" once step 5 is logged and that line has come
 * through mpirun's forwarding (it may come after step 5; the run is bounded by 300 s should it
 * never come), waits for the run to end, and checks what every such stop must show: it ended 9 to
 * 28 s after the kill, exit status 1, the worker that noticed named in the error (`named`, e.g.
 * "error: training worker (rank 1 on "), the collective that gave up naming the ranks waited for
 * (`waited`, e.g. ": world rank 1 waited 10 s for world rank"), and run_status.json saying error.
 * Prints the error line. async.peer_timeout is 10 s, but a resharding's single-copy answers and
 * its senders' wait for their readers are bounded by twice that (resharding/reshard.c: the
 * reader stuck behind the gone rank names it first), so where the kill lands in a weights
 * transfer the message may read "waited 20 s" instead (`waited`'s "waited 10 s" is taken as
 * either), and the run ends up to 20 s + the controller's 5 s of grace + the abort after the
 * kill. rf_test_peer_killed: a training peer at world_rank, noticed by the training worker. */
/* 1 when file p holds `waited`, or `waited` with its "waited 10 s" read as "waited 20 s" (a
 * resharding's doubled bound, rf_test_peer_killed_at). */
static inline int rf_test_file_has_waited(const char *p, const char *waited) {
    if (rf_test_file_has(p, waited)) return 1;
    const char *at = strstr(waited, "waited 10 s");
    if (!at) return 0;
    char alt[512];
    snprintf(alt, sizeof alt, "%.*swaited 20 s%s", (int)(at - waited), waited, at + strlen("waited 10 s"));
    return rf_test_file_has(p, alt);
}

static inline void rf_test_peer_killed_at(const char *dir, const char *rlflow, const char *who, int world_rank,
                                          const char *named, const char *waited) {
    char *out, p[512];
    int rc = rf_test_sh(&out,
                        "cd %s && rm -rf kill kill.log kill.rc && { timeout 300 %s run r.toml --set train.steps=100000 --set logging.val_every=0 --set logging.dir=%s/kill > %s/kill.log 2>&1; echo $? > %s/kill.rc; } &\n"
                        "pid=; for i in $(seq 1200); do\n"
                        "  grep -q '\"step\": 5,' %s/kill/metrics.jsonl 2>/dev/null &&\n"
                        "    pid=$(sed -n 's/.*%s ready (world rank %d, pid \\([0-9]*\\)).*/\\1/p' %s/kill.log | head -1) && [ -n \"$pid\" ] && break\n"
                        "  sleep 0.1; done\n"
                        "kill -9 $pid; t0=$(date +%%s.%%N); wait; echo \"stopped after $(echo \"$(date +%%s.%%N) - $t0\" | bc) s\"",
                        dir, rlflow, dir, dir, dir, dir, who, world_rank, dir);
    CHECK(rc == 0);
    printf("%s", out);
    double after = -1;
    const char *at = strstr(out, "stopped after ");
    if (at) after = atof(at + strlen("stopped after "));
    CHECK(after >= 9 && after < 28);
    free(out);
    snprintf(p, sizeof p, "%s/kill.rc", dir);
    CHECK(rf_test_file_has(p, "1"));
    snprintf(p, sizeof p, "%s/kill.log", dir);
    CHECK(rf_test_file_has(p, named));
    CHECK(rf_test_file_has_waited(p, waited));
    char *log = NULL;
    if (rf_read_file(p, &log, NULL) == RF_OK) {
        const char *e = strstr(log, named);
        if (e) printf("%.*s\n", (int)strcspn(e, "\n"), e);
    }
    free(log);
    snprintf(p, sizeof p, "%s/kill/run_status.json", dir);
    CHECK(rf_test_file_has(p, "\"status\":\"error\""));
}

static inline void rf_test_peer_killed(const char *dir, const char *rlflow, const char *who, int world_rank,
                                       const char *waited) {
    rf_test_peer_killed_at(dir, rlflow, who, world_rank, "error: training worker (rank 1 on ", waited);
}


/* Metric `name` at `step` of <dir>/<run>/metrics.jsonl (the last line of that step), NAN when
 * absent. */
static double rf_test_metric(const char *dir, const char *run, int step, const char *name) {
    char p[512], *text;
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, run);
    if (rf_read_file(p, &text, NULL) != RF_OK) return NAN;
    double v = NAN;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItem(j, "step"), *it = cJSON_GetObjectItem(j, name);
        if (cJSON_IsNumber(s) && s->valueint == step && cJSON_IsNumber(it)) v = it->valuedouble;
        cJSON_Delete(j);
    }
    free(text);
    return v;
}

/* Mean of a metric over steps from..to. */
static double rf_test_metric_mean(const char *dir, const char *run, const char *name, int from, int to) {
    double s = 0;
    for (int k = from; k <= to; k++) s += rf_test_metric(dir, run, k, name);
    return s / (to - from + 1);
}

/* Every line of want (n) appears in out (a run's output; NULL: none does): each one checked,
 * the missing ones printed. Returns 1 when all do. */
static inline int rf_test_has_all(const char *out, const char **want, size_t n) {
    int all = 1;
    for (size_t i = 0; i < n; i++) {
        int has = out && strstr(out, want[i]) != NULL;
        if (!has) fprintf(stderr, "missing: %s\n", want[i]);
        CHECK(has);
        all &= has;
    }
    return all;
}

/* The test reward model (tests/data/reward_model, weight 100: its scores dominate the reward)
 * on n layouts: r.toml for one synchronous step with `base` and extra[i] as run runs[i]; each
 * output holds want[i * n_want .. + n_want), and every run's step-1 reward equals the first's
 * within 1e-5 (the same samples, each sequence scored once wherever it lands) with the same
 * rule accuracy, far from it (the model's scores count). `test` names the skip when
 * RF_SOURCE_DIR is not set. */
static inline void rf_test_rm_layouts(const char *test, const char *dir, const char *rlflow, const char *base, int n,
                                      const char *const *runs, const char *const *extra, const char **want, int n_want) {
    const char *src = getenv("RF_SOURCE_DIR");
    if (!src) {
        printf("%s: reward model part skipped (needs RF_SOURCE_DIR)\n", test);
        return;
    }
    for (int i = 0; i < n; i++) {
        char args[1024], *out = NULL;
        snprintf(args, sizeof args, "%s --set train.steps=1 --set reward.model=%s/tests/data/reward_model "
                 "--set reward.model_weight=100 %s", base, src, extra[i]);
        int rc = rf_test_run_recipe(&out, dir, rlflow, runs[i], args);
        CHECK(rc == 0);
        if (!rf_test_has_all(out, want + (size_t)i * (size_t)n_want, (size_t)n_want) || rc)
            fprintf(stderr, "%s\n", out ? out : "");
        free(out);
    }
    double r0 = rf_test_metric(dir, runs[0], 1, "reward/mean"), acc = rf_test_metric(dir, runs[0], 1, "reward/accuracy");
    for (int i = 1; i < n; i++) {
        double r = rf_test_metric(dir, runs[i], 1, "reward/mean");
        printf("reward model, %s: step-1 reward %.7f (%s: %.7f; accuracy %.4f)\n", extra[i], r, extra[0], r0, acc);
        CHECK(fabs(r - r0) <= 1e-5 * fabs(r0));
        CHECK(rf_test_metric(dir, runs[i], 1, "reward/accuracy") == acc);
    }
    CHECK(fabs(r0 - acc) > 0.1); /* the reward model's share of the reward */
}

/* Two synchronous 3-step PPO runs with a KL term (async.max_staleness = 0: the same samples)
 * whose critic and reference are laid out differently (`what`, for the printout) must score
 * alike: at step 1 the same mean reward, the value loss within 1e-5 and the KL to the reference
 * under 1e-6 in both (the reference is the generating policy; under 1e-5 where the CPU back
 * end's products are not batch-invariant in both precisions, kernels.h
 * rf_cpu_batch_invariant_exact: 1.6e-6 measured at bf16 with oneDNN's AVX2 kernels and the
 * reference split otherwise than the actor); at step 2, when the rewards are still equal (the
 * actors differ by rounding, so a token may be sampled otherwise), the same again with the KL
 * within 1e-4. */
static inline void rf_test_same_scores(const char *dir, const char *a, const char *b, const char *what) {
    int exact = rf_cpu_batch_invariant_exact_at(RF_PRECISION_BF16) && rf_cpu_batch_invariant_exact_at(RF_PRECISION_FP32);
    double kl0 = exact ? 1e-6 : 1e-5;
    for (int step = 1; step <= 2; step++) {
        double ra = rf_test_metric(dir, a, step, "reward/mean"), rb = rf_test_metric(dir, b, step, "reward/mean");
        double ka = rf_test_metric(dir, a, step, "actor/kl_ref"), kb = rf_test_metric(dir, b, step, "actor/kl_ref");
        double va = rf_test_metric(dir, a, step, "critic/value_loss"), vb = rf_test_metric(dir, b, step, "critic/value_loss");
        printf("step %d, %s: reward %.6f / %.6f, kl_ref %.8g / %.8g, value loss %.10f / %.10f\n", step, what, ra, rb, ka,
               kb, va, vb);
        if (step == 2 && ra != rb) {
            printf("step 2: other samples (the actors differ by rounding); not compared\n");
            break;
        }
        CHECK(ra == rb);
        CHECK(vb > 0 && fabs(va - vb) <= 1e-5 * vb);
        if (step == 1) CHECK(fabs(ka) < kl0 && fabs(kb) < kl0);
        else CHECK(kb > 1e-3 && fabs(ka - kb) <= 1e-4 * kb);
    }
}

/* Checks that run `run` of dir (made by rf_test_run_recipe with `args`) learned: the mean
 * training reward over steps 101-120 exceeds that over steps 1-20 by RF_TEST_MIN_RISE. One
 * seed's rise is a noisy draw (now and then a run stalls for tens of steps: 0.303 -> 0.362 once,
 * where its recipe's runs rise 0.10-0.14; LoRA split dp 2 over train.seed 1, 2, 3 rose 0.046,
 * 0.107, 0.054), and split runs now sample with the one-process seeds, so the same run again
 * repeats the same draw: a run that falls short is repeated once with another train.seed as
 * "<run>_again", which must then learn: a change that stops learning fails both. *a, *b: the
 * two means of the run that counts. */
static inline void rf_test_learned(const char *dir, const char *rlflow, const char *run, const char *args, double *a,
                                   double *b) {
    *a = rf_test_metric_mean(dir, run, "reward/mean", 1, 20), *b = rf_test_metric_mean(dir, run, "reward/mean", 101, 120);
    if (*b > *a + RF_TEST_MIN_RISE) return;
    char again[128], *out = NULL;
    snprintf(again, sizeof again, "%s_again", run);
    printf("%s: mean reward %.3f -> %.3f, a rise under %.2f: running it again as %s\n", run, *a, *b, RF_TEST_MIN_RISE, again);
    char args2[1024];
    snprintf(args2, sizeof args2, "%s --set train.seed=11", args);
    CHECK(rf_test_run_recipe(&out, dir, rlflow, again, args2) == 0);
    free(out);
    *a = rf_test_metric_mean(dir, again, "reward/mean", 1, 20), *b = rf_test_metric_mean(dir, again, "reward/mean", 101, 120);
    printf("%s: mean reward %.3f -> %.3f\n", again, *a, *b);
    CHECK(*b > *a + RF_TEST_MIN_RISE);
}

/* The AdamW moments of `role` ("actor", "critic") in checkpoint `step` of runs a and b of dir
 * agree within tol of their largest magnitude (ZeRO-1, gathered tensor by tensor, against plain
 * data parallelism on the same samples: the gradients are summed in another order, so they
 * differ by rounding; a wrong block would be off by its whole size). Prints the difference. */
static inline void rf_test_same_moments(const char *dir, const char *a, const char *b, const char *step, const char *role,
                                        double tol) {
    static const char *part[2] = {"%s/%s/%s/%s_optim", "%s/%s/%s/%s_optim/moments2"};
    for (int k = 0; k < 2; k++) {
        char pa[512], pb[512];
        snprintf(pa, sizeof pa, part[k], dir, a, step, role);
        snprintf(pb, sizeof pb, part[k], dir, b, step, role);
        rf_safetensors *sa = NULL, *sb = NULL;
        CHECK_OK(rf_st_open_dir(&sa, pa));
        CHECK_OK(rf_st_open_dir(&sb, pb));
        double most = 0, diff = 0;
        int n = rf_st_count(sa), same_names = sa && sb && n == rf_st_count(sb) && n > 0;
        for (int i = 0; same_names && i < n; i++) {
            const rf_st_tensor *t = rf_st_at(sa, i);
            size_t numel = t->nbytes / 4;
            float *x = malloc(sizeof(float) * (numel + 1)), *y = malloc(sizeof(float) * (numel + 1));
            same_names = rf_st_read_f32(sa, t->name, x, t->shape, t->ndim) == RF_OK &&
                         rf_st_read_f32(sb, t->name, y, t->shape, t->ndim) == RF_OK;
            for (size_t j = 0; same_names && j < numel; j++) {
                most = fmax(most, fabs((double)y[j]));
                diff = fmax(diff, fabs((double)x[j] - (double)y[j]));
            }
            free(x), free(y);
        }
        printf("%s %s, %s / %s at %s: largest difference %.3g of largest magnitude %.3g\n", role,
               k ? "exp_avg_sq" : "exp_avg", a, b, step, diff, most);
        CHECK(same_names);
        CHECK(most > 0 && diff <= tol * most);
        rf_st_close(sa), rf_st_close(sb);
    }
}

/* One synchronous step of `args` (async.max_staleness = 0: the same samples) with ZeRO-1 and
 * without, as runs <name>_zero and <name>_plain: both exit 0 and their checkpoints' moments of
 * the actor and the critic agree (rf_test_same_moments, 1e-4 of the largest). */
static inline void rf_test_zero_like_plain(const char *dir, const char *rlflow, const char *name, const char *args) {
    char a[1024], run[2][128], *out = NULL;
    for (int zero = 0; zero < 2; zero++) {
        snprintf(run[zero], sizeof run[zero], "%s_%s", name, zero ? "zero" : "plain");
        snprintf(a, sizeof a, "%s --set train.steps=1 --set async.max_staleness=0 --set placement.actor.zero=%d", args,
                 zero);
        int rc = rf_test_run_recipe(&out, dir, rlflow, run[zero], a);
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out);
        free(out);
    }
    rf_test_same_moments(dir, run[1], run[0], "step_000001", "actor", 1e-4);
    rf_test_same_moments(dir, run[1], run[0], "step_000001", "critic", 1e-4);
}

/* The hexadecimal CRC-32C after `prefix` in text, or -1. */
static inline long rf_test_crc_after(const char *text, const char *prefix) {
    const char *at = text ? strstr(text, prefix) : NULL;
    return at ? strtol(at + strlen(prefix), NULL, 16) : -1;
}

/* A number of <dir>/<run>/<step dir>/trainer_state.json, or -1. */
static inline double rf_test_trainer_state(const char *dir, const char *run, const char *step, const char *key) {
    char p[512], *text = NULL;
    snprintf(p, sizeof p, "%s/%s/%s/trainer_state.json", dir, run, step);
    if (rf_read_file(p, &text, NULL) != RF_OK) return -1;
    cJSON *j = cJSON_Parse(text);
    free(text);
    const cJSON *v = cJSON_GetObjectItem(j, key);
    double x = cJSON_IsNumber(v) ? v->valuedouble : -1;
    cJSON_Delete(j);
    return x;
}

/* CRC-32C of the flat parameter buffer of the model saved in d (what a rollout worker holding
 * it would report), or -1. */
static inline long rf_test_saved_crc(const char *d) {
    rf_model *m = NULL;
    if (rf_model_load(&m, d, rf_cpu_kernels(), 0) != RF_OK) return -1;
    long crc = (long)rf_crc32c(m->params, m->n_params * sizeof(float));
    rf_model_free(m);
    return crc;
}

/* Step `step`'s line of <dir>/<run>/metrics.jsonl without its time and perf/ figures, as JSON
 * text (the caller frees); the last line of a step wins; NULL when absent. */
static inline char *rf_test_metrics_of(const char *dir, const char *run, int step) {
    char p[512], *text;
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, run);
    if (rf_read_file(p, &text, NULL) != RF_OK) return NULL;
    char *res = NULL;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        if (j && cJSON_GetObjectItem(j, "step")->valueint == step) {
            cJSON_DeleteItemFromObject(j, "time");
            for (cJSON *it = j->child, *next; it; it = next) {
                next = it->next;
                if (strncmp(it->string, "perf/", 5) == 0) cJSON_DeleteItemFromObject(j, it->string);
            }
            free(res);
            res = cJSON_PrintUnformatted(j);
        }
        cJSON_Delete(j);
    }
    free(text);
    return res;
}

/* rf_test_metrics_of without the other wall-clock figures either (time/elapsed_s, and idle/:
 * shares of wall-clock time), for comparing runs bit for bit; NULL when absent; the caller
 * frees. */
static inline char *rf_test_record_of(const char *dir, const char *run, int step) {
    char *text = rf_test_metrics_of(dir, run, step);
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    free(text);
    for (cJSON *it = j ? j->child : NULL, *next; it; it = next) {
        next = it->next;
        if (strncmp(it->string, "time/", 5) == 0 || strncmp(it->string, "idle/", 5) == 0)
            cJSON_DeleteItemFromObject(j, it->string);
    }
    text = j ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    return text;
}

/* Runs r.toml in dir for 40 steps ("full"), and for 20 then resumed to 40 ("half"); every step's
 * metrics (time and perf/ aside) must be equal, and the resume must say where it resumed. */
static inline void rf_test_resume_matches(const char *dir, const char *rlflow) {
    char *out;
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=40 --set logging.val_every=20 --set logging.dir=%s/full", dir, rlflow, dir) == 0);
    free(out);
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=20 --set logging.val_every=20 --set logging.dir=%s/half", dir, rlflow, dir) == 0);
    free(out);
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=40 --set logging.val_every=20 --set logging.dir=%s/half --resume", dir, rlflow, dir) == 0);
    CHECK(strstr(out, "resumed at step 20") != NULL);
    free(out);
    int same = 0;
    for (int s = 1; s <= 40; s++) {
        char *a = rf_test_metrics_of(dir, "full", s), *b = rf_test_metrics_of(dir, "half", s);
        same += a && b && strcmp(a, b) == 0;
        if (!(a && b && strcmp(a, b) == 0)) fprintf(stderr, "step %d differs:\n%s\n%s\n", s, a, b);
        free(a), free(b);
    }
    CHECK(same == 40);
}

#endif
