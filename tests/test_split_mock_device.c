/* Split runs with model.device = "cuda" on the CPU, through the stand-in CUDA module
 * (tests/mock_cuda_module.c, RLFLOW_CUDA_MODULE, set by CMake): every host-side step of the CUDA
 * paths runs (each rank's device, the NCCL communicators of the data- and tensor-parallel
 * groups and of the rollout workers' groups, weights staged through host copies, ZeRO-1 state
 * read into and gathered from device shards), with the CPU kernels doing the arithmetic. So a
 * run on "cuda" must score and train like the same run on the CPU.
 *   - PPO with a KL term, 3 synchronous steps, dp 2 (plain): the same rewards, value loss
 *     within 1e-5 and KL within 1e-4 as on the CPU, and each rank's device in the log;
 *   - tp 2 x dp 2 with ZeRO-1 and generation tp 2 (7 processes), the same against the CPU, a
 *     checkpoint at step 3 resumed to 4;
 *   - the critic and the reference split over 2 of the actor's 4 tensor-parallel ranks, the
 *     critic on 2 of 3 replicas, and a reward model split over 2 ranks: the same against the CPU;
 *   - LoRA with tp 2 and generation tp 2 (adapters alone resharded, the reference the actor's
 *     base shards): the same against the CPU;
 *   - a colocated GRPO run on "cuda": the CPU run's rewards and gradient norms bit for bit;
 *   - colocated runs on two devices (dp 2 zero-copy, tp 2 resharded in place for whole-model
 *     generation, tp 2 with generation tp 2 and a reference, whose scoring takes turns with
 *     generation on CUDA): a rollout thread on each training rank's device, the CPU run's
 *     rewards and gradient norms;
 *   - the rollout worker's KV cache sized from the device's free memory: the longest load, or
 *     what the budget holds (same rewards and gradient norms), or refused at once;
 *   - colocated runs on a device that cannot hold the KV cache and training's workspaces at once
 *     (RF_MOCK_GPU_STRICT: allocations beyond RF_MOCK_GPU_MEMORY fail): with
 *     rollout.free_kv_cache = "off" training runs out of memory; with "auto" the cache is given
 *     back while training runs and the run trains like one on a roomy device (one process, and
 *     dp 2 with a rollout thread per device);
 *   - one GPU for two training ranks of one machine: refused at the start, naming both ranks.
 * Skips (77) without the stand-in module or without mpirun. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

/* Every run at bf16, which `auto` picks on CUDA: on a CPU without bf16 instructions `auto` picks
 * fp32 there, and the CPU runs would not be the stand-in GPU runs' twins. */
#define BF16 "--set model.precision=bf16"
#define PPO "--set algorithm.name=ppo --set algorithm.kl_coef=0.01 --set logging.val_every=0 " \
            "--set async.max_staleness=0 --set train.steps=3 --set checkpoint.every=3 " BF16
#define ON_GPU "--set model.device=cuda --set placement.device=cuda"

/* The same layout on the CPU (run a) and on the stand-in GPUs (run b): the same scores. */
static void same_as_cpu(const char *a, const char *b, const char *layout, const char **want, int n_want) {
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, PPO " %s", layout);
    int rc = rf_test_run_recipe(&out, dir, rlflow, a, args);
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    snprintf(args, sizeof args, PPO " %s " ON_GPU, layout);
    rc = rf_test_run_recipe(&out, dir, rlflow, b, args);
    CHECK(rc == 0);
    rf_test_has_all(out, want, n_want);
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    rf_test_same_scores(dir, a, b, layout);
}

static void data_parallel(void) {
    const char *want[] = {"rank 1 (", "): CUDA device 0 of 8", "rank 2 (", "): CUDA device 1 of 8",
                          "rank 3 (", "): CUDA device 2 of 8",
                          "training worker: data parallel over 2 ranks, actor and critic"};
    same_as_cpu("dp_cpu", "dp_gpu", "--set placement.actor.dp=2", want, (int)(sizeof want / sizeof *want));
}

static void grid_and_resume(void) {
    const char *layout = "--set placement.actor.dp=2 --set placement.actor.tp=2 --set placement.actor.zero=1 "
                         "--set placement.rollout.tp=2";
    const char *want[] = {"): CUDA device 5 of 8", "training worker: 2 data-parallel replicas of 2 tensor-parallel ranks"};
    same_as_cpu("grid_cpu", "grid_gpu", layout, want, (int)(sizeof want / sizeof *want));
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, PPO " %s " ON_GPU " --set train.steps=4 --resume", layout);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "grid_gpu", args);
    CHECK(rc == 0);
    CHECK(out && strstr(out, "resumed at step 3"));
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    CHECK(rf_test_trainer_state(dir, "grid_gpu", "step_000004", "actor_optimizer_steps") == 4);
    CHECK(rf_test_trainer_state(dir, "grid_gpu", "step_000004", "critic_optimizer_steps") == 4);
}

/* The critic and the reference on layouts of their own: split over 2 of the actor's 4
 * tensor-parallel ranks (their own NCCL group), and the critic on 2 of 3 replicas (its own DP
 * group). */
static void own_layouts(void) {
    const char *want_tp[] = {"training worker: critic split over the first 2 tensor-parallel ranks"};
    same_as_cpu("roles_tp_cpu", "roles_tp_gpu", "--set placement.actor.tp=4 --set placement.critic.tp=2 "
                "--set placement.reference.tp=2", want_tp, 1);
    const char *want_dp[] = {"training worker: data parallel over 3 ranks, actor, and the critic over the first 2 replicas"};
    same_as_cpu("roles_dp_cpu", "roles_dp_gpu", "--set placement.actor.dp=3 --set placement.critic.dp=2", want_dp, 1);
    /* a reward model (weight 100: its scores dominate the reward) split over both ranks */
    const char *src = getenv("RF_SOURCE_DIR");
    if (!src) return;
    char layout[1024];
    snprintf(layout, sizeof layout, "--set placement.actor.tp=2 --set reward.model=%s/tests/data/reward_model "
             "--set reward.model_weight=100 --set placement.reward.tp=2", src);
    const char *want_rm[] = {"training worker: reward model split over the 2 tensor-parallel ranks"};
    same_as_cpu("rm_tp_cpu", "rm_tp_gpu", layout, want_rm, 1);
}

/* LoRA on "cuda": the actor's adapters split over 2 tensor-parallel ranks (their base read into
 * each device shard after the adapters were attached), the reference the actor's base shards,
 * the adapters alone resharded to generation tp 2: the same scores as on the CPU (the adapters
 * train: kl_ref above 1e-3 at step 2). */
static void lora(void) {
    const char *want[] = {"resharded from 2 shards to the rollout workers (LoRA: the adapters alone)",
                          "the actor's frozen base shards themselves (LoRA; no second copy"};
    same_as_cpu("lora_cpu", "lora_gpu", "--set lora.enabled=true --set train.lr=5e-3 --set placement.actor.tp=2 "
                "--set placement.rollout.tp=2", want, 2);
}

/* A colocated GRPO run on "cuda" (one process: the generation engine and the update on the
 * device, weights handed over in place) against the CPU: the same rewards and gradient norms
 * bit for bit (the same CPU kernels do the arithmetic). */
static void colocated(void) {
    const char *runs[2] = {"colo_cpu", "colo_gpu"}, *extra[2] = {"", ON_GPU};
    for (int i = 0; i < 2; i++) {
        char args[512], *out = NULL;
        snprintf(args, sizeof args, "--set placement.mode=colocated --set train.steps=3 --set logging.val_every=0 " BF16
                 " %s", extra[i]);
        int rc = rf_test_run_recipe(&out, dir, rlflow, runs[i], args);
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
    }
    for (int step = 1; step <= 3; step++) {
        double ra = rf_test_metric(dir, "colo_cpu", step, "reward/mean"), rb = rf_test_metric(dir, "colo_gpu", step, "reward/mean");
        double ga = rf_test_metric(dir, "colo_cpu", step, "actor/grad_norm"), gb = rf_test_metric(dir, "colo_gpu", step, "actor/grad_norm");
        printf("colocated step %d: reward %.6f / %.6f, grad norm %.10f / %.10f\n", step, ra, rb, ga, gb);
        CHECK(ra == rb && ga == gb && ga > 0);
    }
}

/* The rollout worker's KV cache sized from its device's free memory (rollout.kv_blocks = 0):
 * with 16 GiB, the longest load (64 sequences of 256 + 6 positions, 17 blocks each); on a
 * device of RF_MOCK_GPU_MEMORY bytes where 90% of what the model leaves holds fewer, that many
 * blocks, and the run gets the same rewards and gradient norms (within 1e-5: preempted
 * sequences are recomputed by a prefill, whose behaviour log-probs differ by rounding); with too little for one
 * sequence, refused naming the key, at once (the worker fails before it connects: it connects
 * to say why, where the controller used to wait async.startup_timeout for it). */
static void kv_from_device_memory(void) {
    const char *runs[3] = {"kv_roomy", "kv_tight", "kv_none"};
    const char *mem[3] = {"", "RF_MOCK_GPU_MEMORY=740000", "RF_MOCK_GPU_MEMORY=550000"};
    const char *want[3][2] = {
        {"KV cache: 1088 blocks of 16 positions", " on cuda: 64 running sequences of up to 262 positions (90% of the "},
        {" on cuda: 90% of the ", "; 64 running sequences of up to 262 positions would need 1088 (sequences beyond"},
        {"error: rollout worker 0 on ", ": rollout.kv_blocks = 0 (sized from memory), rollout.kv_memory_fraction = 0.9 (its "
         "default): raise it, lower rollout.max_running, data.max_prompt_tokens or rollout.max_new_tokens, or set "
         "rollout.kv_blocks: rollout: KV cache sized from memory: 90% of the "}};
    for (int i = 0; i < 3; i++) {
        char *out = NULL;
        double t0 = rf_time_now();
        int rc = rf_test_sh(&out, "cd %s && %s %s run r.toml --set async.max_staleness=0 --set train.steps=2 "
                            "--set logging.val_every=0 " ON_GPU " --set logging.dir=%s/%s", dir, mem[i], rlflow, dir, runs[i]);
        double took = rf_time_now() - t0;
        CHECK(i < 2 ? rc == 0 : rc != 0);
        int has = rf_test_has_all(out, want[i], 2);
        if (i == 2) {
            has &= out && strstr(out, " free on cuda holds ") && strstr(out, "fewer than the 17 that one sequence of 262 positions needs");
            CHECK(has);
            printf("kv_none: refused in %.1f s\n", took);
            CHECK(took < 120); /* not async.startup_timeout (600 s) */
        }
        if (rc != (i == 2) || !has) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
    }
    for (int step = 1; step <= 2; step++) {
        double ra = rf_test_metric(dir, "kv_roomy", step, "reward/mean"), rb = rf_test_metric(dir, "kv_tight", step, "reward/mean");
        double ga = rf_test_metric(dir, "kv_roomy", step, "actor/grad_norm"), gb = rf_test_metric(dir, "kv_tight", step, "actor/grad_norm");
        printf("KV cache of the longest load / of the budget, step %d: reward %.6f / %.6f, grad norm %.10f / %.10f\n", step,
               ra, rb, ga, gb);
        CHECK(ra == rb && ga > 0 && fabs(ga - gb) <= 1e-5 * ga);
    }
}

/* The CUDA device a rank's log line names ("  rank R (host): CUDA device D of N"), -1 if none. */
static int device_of(const char *out, int rank) {
    char key[32];
    snprintf(key, sizeof key, "  rank %d (", rank);
    const char *p = out ? strstr(out, key) : NULL, *q = p ? strstr(p, "): CUDA device ") : NULL;
    return q ? atoi(q + strlen("): CUDA device ")) : -1;
}

/* Colocated runs on two devices, a rollout thread in each training rank's process on its
 * device: dp 2 (zero-copy: each rollout rank generates with its process's device buffer), tp 2
 * with whole-model generation (resharded in place through host copies, uploaded to each
 * rollout rank's device), and tp 2 with generation tp 2 and a reference (zero-copy; the two
 * threads' NCCL groups share each device, so the controller has generation and the
 * reference's scoring take turns, where the CPU run overlaps them). Each trains like the CPU
 * run. */
static void colocated_ranks(void) {
    const char *layouts[3] = {"--set placement.actor.dp=2 --set placement.rollout_ranks=2",
                              "--set placement.actor.tp=2 --set placement.rollout_ranks=2",
                              "--set placement.actor.tp=2 --set placement.rollout.tp=2 --set algorithm.kl_coef=0.01"};
    const char *tag[3] = {"dp", "tp", "tpg2"}, *how[3] = {"zero-copy", "resharded in place", "zero-copy"};
    const char *turns = "controller: generation and scoring take turns (colocated, placement.rollout.tp = 2 on CUDA: "
                        "the rollout and training threads' NCCL groups share each device)";
    for (int l = 0; l < 3; l++) {
        char runs[2][32];
        for (int i = 0; i < 2; i++) {
            char args[512], *out = NULL;
            snprintf(runs[i], sizeof runs[i], "colo_%s_%s", tag[l], i ? "gpu" : "cpu");
            snprintf(args, sizeof args, "--set placement.mode=colocated --set async.max_staleness=0 %s --set train.steps=2 "
                     "--set logging.val_every=0 " BF16 " %s", layouts[l], i ? ON_GPU : "");
            int rc = rf_test_run_recipe(&out, dir, rlflow, runs[i], args);
            CHECK(rc == 0);
            int has_turns = out && strstr(out, turns) != NULL;
            CHECK(has_turns == (l == 2 && i == 1)); /* on CUDA with generation tp > 1 only */
            if (i == 1) {
                int d1 = device_of(out, 1), d2 = device_of(out, 2), d3 = device_of(out, 3);
                printf("colocated %s 2 on cuda: ranks 1-2 on devices %d %d (rank 3: %d)\n", tag[l], d1, d2, d3);
                CHECK(d1 == 0 && d2 == 1 && d3 == -1);
                CHECK(out && strstr(out, how[l]));
            }
            if (rc || has_turns != (l == 2 && i == 1)) fprintf(stderr, "%s\n", out ? out : "");
            free(out);
        }
        for (int step = 1; step <= 2; step++) {
            double ra = rf_test_metric(dir, runs[0], step, "reward/mean"), rb = rf_test_metric(dir, runs[1], step, "reward/mean");
            double ga = rf_test_metric(dir, runs[0], step, "actor/grad_norm"), gb = rf_test_metric(dir, runs[1], step, "actor/grad_norm");
            printf("colocated %s 2, cpu / cuda, step %d: reward %.6f / %.6f, grad norm %.10f / %.10f\n", tag[l], step, ra, rb,
                   ga, gb);
            CHECK(ra == rb && ga > 0 && fabs(ga - gb) <= 1e-5 * ga);
        }
        if (l == 2) {
            double ka = rf_test_metric(dir, runs[0], 2, "actor/kl_ref"), kb = rf_test_metric(dir, runs[1], 2, "actor/kl_ref");
            double held = rf_test_metric(dir, runs[1], 1, "perf/scores_held");
            printf("colocated tpg2 2, cpu / cuda, step 2: kl_ref %.9g / %.9g; step 1: %.0f ScoreRequests held for "
                   "generation to pause\n", ka, kb, held);
            CHECK(ka > 0 && fabs(ka - kb) <= 1e-4 * ka);
            /* groups that finished while others generated: at most one ScoreRequest per group (no
             * reward model), and step 1's count runs until its record, by which time step 2's
             * 16 groups may have begun (a loaded machine gave 30) */
            CHECK(held >= 1 && held <= 32);
            CHECK(isnan(rf_test_metric(dir, runs[0], 1, "perf/scores_held"))); /* the CPU run overlaps */
        }
    }
}

/* One layout of kv_release: a run on a roomy device, then on a small one with the cache kept
 * (out of memory) and given back (trains the same: rewards equal, gradient norms within 1e-5). */
static void kv_release_case(const char *tag, const char *layout, const char *mem, const char *given_back) {
    const char *cache[3] = {"auto", "off", "auto"};
    char runs[3][64];
    for (int i = 0; i < 3; i++) {
        char *out = NULL;
        snprintf(runs[i], sizeof runs[i], "kvrel_%s_%d", tag, i);
        int rc = rf_test_sh(&out, "cd %s && %s%s %s run r.toml --set placement.mode=colocated --set async.max_staleness=0 "
                            "--set train.steps=2 --set data.val='\"\"' --set checkpoint.every=0 %s " ON_GPU
                            " --set rollout.free_kv_cache=%s --set logging.dir=%s/%s", dir,
                            i ? "RF_MOCK_GPU_STRICT=1 " : "", i ? mem : "", rlflow, layout, cache[i], dir, runs[i]);
        int ok = i == 1 ? rc != 0 && out && strstr(out, "error: ") && strstr(out, "out of memory for ")
                        : rc == 0 && out && strstr(out, given_back);
        CHECK(ok);
        if (!ok) fprintf(stderr, "%s (free_kv_cache = %s, %s):\n%s\n", tag, cache[i], i ? mem : "roomy", out ? out : "");
        free(out);
    }
    for (int step = 1; step <= 2; step++) {
        double ra = rf_test_metric(dir, runs[0], step, "reward/mean"), rb = rf_test_metric(dir, runs[2], step, "reward/mean");
        double ga = rf_test_metric(dir, runs[0], step, "actor/grad_norm"), gb = rf_test_metric(dir, runs[2], step, "actor/grad_norm");
        printf("KV cache given back, %s, roomy / %s, step %d: reward %.6f / %.6f, grad norm %.10f / %.10f\n", tag, mem, step,
               ra, rb, ga, gb);
        CHECK(ra == rb && ga > 0 && fabs(ga - gb) <= 1e-5 * ga);
    }
}

/* rollout.free_kv_cache on devices too small to keep the KV cache through training (sizes of
 * the tiny model: one process trains in 16 MB only when the cache goes back, a dp 2 rank in
 * 12 MB). */
static void kv_release(void) {
    kv_release_case("one", "", "RF_MOCK_GPU_MEMORY=16000000",
                    "rollout: KV cache given back while generation pauses (rollout.free_kv_cache = \"auto\"): ");
    kv_release_case("dp2", "--set placement.actor.dp=2 --set placement.rollout_ranks=2", "RF_MOCK_GPU_MEMORY=12000000",
                    "rollout worker 1: KV cache given back while generation pauses (rollout.free_kv_cache = \"auto\"): ");
}

static void one_gpu_for_two(void) {
    char *out = NULL;
    int rc = rf_test_sh(&out, "cd %s && RF_MOCK_GPUS=1 %s run r.toml " PPO " " ON_GPU " --set placement.actor.dp=2 "
                        "--set logging.dir=%s/one_gpu", dir, rlflow, dir);
    CHECK(rc != 0);
    CHECK(out && strstr(out, "data parallelism on CUDA: a NCCL communicator: world ranks 1 and 2 would both use CUDA "
                             "device 0 of"));
    if (!out || !strstr(out, "would both use CUDA device 0")) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
}

int main(void) {
    if (!getenv("RLFLOW_CUDA_MODULE")) {
        printf("test_split_mock_device: skipped: RLFLOW_CUDA_MODULE is not set (CMake sets it to the stand-in "
               "module in builds with CUDA)\n");
        return 77;
    }
    int start = rf_test_split_start("test_split_mock_device", &rlflow, dir, sizeof dir);
    if (start) return start;
    rf_test_write_recipe(dir, 60, "[async]\npeer_timeout = 30\n[placement]\nmode = \"split\"\nrollout_ranks = 1\n");
    data_parallel();
    grid_and_resume();
    own_layouts();
    lora();
    colocated();
    colocated_ranks();
    kv_from_device_memory();
    kv_release();
    one_gpu_for_two();
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_split_mock_device");
}
