/* A colocated GRPO run on the CUDA back end against the same run on the CPU (the first GPU
 * run's end-to-end check, tests/test_split_mock_device.c being the same on the stand-in module):
 * the SFT-warm-started tiny model of tests/run_util.h, 5 steps, in both precisions.
 * model.precision = "fp32", products in plain fp32 (RLFLOW_CUDA_TF32=0, inherited by the run):
 *  - steps 1 and 2: the same mean reward. Both runs sample from the same seeds; their logits
 *    differ by fp32 rounding (~1e-6 relative), which changes a sampled token only where a
 *    uniform draw falls within ~1e-6 of a boundary of the cumulative distribution: for the
 *    ~700 draws of two steps, a chance of ~1e-3.
 *  - step 1: gradient norms within 1e-3 relative (same samples; cuBLAS against oneDNN
 *    summation orders through two layers and the loss, as test_model_cuda's 1e-3).
 *  - steps 3 to 5: a finite positive gradient norm and mean rewards within 0.2 (the weights
 *    have moved apart by rounding; samples may differ).
 * model.precision = "bf16" (`auto`'s choice on CUDA), twice on each back end:
 *  - with RLFLOW_CUDA_ATTENTION=fp32 and RLFLOW_CPU_ATTENTION=fp32: both back ends round the
 *    products' operands to bf16 and keep attention in fp32 arithmetic, but round in other
 *    summation orders (test_model_cuda holds their gradients to 0.1 of each other): the step-1
 *    gradient norms within 1 % (4.7e-7 relative on an H200, 4.6e-6 with the kernels run on the
 *    CPU, tests/cuda_emu);
 *  - as by default, bf16 attention on tensor cores, against the CPU's default (fp32 arithmetic
 *    at the tiny model's head dim 16, AMX or not): within 5 % (2.2 % on an H200, 1.4 % on the
 *    emulation);
 *  every step's mean reward within 0.2, finite positive norms.
 * Both precisions: the CUDA run's mean |behaviour - trainer| log-prob difference at step 1
 * (actor/logprob_mismatch_mean) under 1e-4: generation and training on CUDA give a token the
 * same log-prob up to rounding (1.6e-7 measured on the emulation, also with bf16 attention,
 * bf16 attention, whose decoding kernels are training's; 8.6e-4 when decoding is
 * made to skip the bf16 rounding training does, under =fma; 1.9e-3 before decoding had
 * training's kernels, docs/cuda.md "Precision"). On the emulation (tests/cuda_emu, where a
 * product's rows do not depend on how many there are) every step's largest difference is 0:
 * rollout.max_running = 20 admits groups of 8 in parts, so late samples draw their first token
 * on the host from their prompt's saved logits with the device's log-sum-exp (row_lse);
 * 9.5e-7 when the host's own log-softmax is used.
 * CMake also runs it on the stand-in module (test_grpo_mock_device), where both runs use the CPU
 * kernels and agree bit for bit.
 * Skips (77) without a CUDA device (rf_cuda_device_count), RF_RLFLOW or mpirun. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

int main(void) {
    if (rf_cuda_device_count() == 0) {
        printf("test_grpo_cuda: skipped: no CUDA device (built without CUDA, no GPU, or the CUDA "
               "module could not be loaded)\n");
        return 77;
    }
    const char *rlflow;
    char dir[256];
    int start = rf_test_split_start("test_grpo_cuda", &rlflow, dir, sizeof dir);
    if (start) return start;
    setenv("RLFLOW_CUDA_TF32", "0", 1);
    const char *module = getenv("RLFLOW_CUDA_MODULE");
    int emulated = module && strstr(module, "cudaemu") != NULL;
    rf_test_write_recipe(dir, RF_TEST_VAL_ENDS, "[async]\npeer_timeout = 60\n");
    /* fp32; bf16 with attention in fp32 arithmetic on both back ends (RLFLOW_CUDA_ATTENTION,
     * RLFLOW_CPU_ATTENTION); bf16 with each back end's default attention */
    static const char *precisions[3] = {"fp32", "bf16", "bf16"}, *attention[3] = {NULL, "fp32", NULL};
    for (int p = 0; p < 3; p++) {
        const char *prec = precisions[p];
        char runs[2][32];
        snprintf(runs[0], sizeof runs[0], "grpo_cpu_%s%s", prec, p == 2 ? "_bf16att" : "");
        snprintf(runs[1], sizeof runs[1], "grpo_cuda_%s%s", prec, p == 2 ? "_tc" : "");
        const char *extra[2] = {"", "--set model.device=cuda --set placement.device=cuda"};
        for (int i = 0; i < 2; i++) {
            char args[512], *out = NULL;
            snprintf(args, sizeof args, "--set placement.mode=colocated --set train.steps=5 --set model.precision=%s "
                     "--set rollout.max_running=20 "
                     "--set logging.val_every=0 %s", prec, extra[i]);
            if (attention[p]) /* both, as the CUDA run may be the CPU's kernels (the stand-in module) */
                setenv("RLFLOW_CUDA_ATTENTION", attention[p], 1), setenv("RLFLOW_CPU_ATTENTION", attention[p], 1);
            int rc = rf_test_run_recipe(&out, dir, rlflow, runs[i], args);
            unsetenv("RLFLOW_CUDA_ATTENTION"), unsetenv("RLFLOW_CPU_ATTENTION");
            CHECK(rc == 0);
            if (rc) fprintf(stderr, "%s\n", out ? out : "");
            free(out);
        }
        const char *name = p == 0 ? "fp32" : p == 1 ? "bf16 (fp32 attention)" : "bf16";
        for (int step = 1; step <= 5; step++) {
            double ra = rf_test_metric(dir, runs[0], step, "reward/mean");
            double rb = rf_test_metric(dir, runs[1], step, "reward/mean");
            double ga = rf_test_metric(dir, runs[0], step, "actor/grad_norm");
            double gb = rf_test_metric(dir, runs[1], step, "actor/grad_norm");
            printf("%s step %d: reward cpu %.6f cuda %.6f, grad norm cpu %.8f cuda %.8f\n", name, step, ra,
                   rb, ga, gb);
            CHECK(isfinite(ga) && isfinite(gb) && ga > 0 && gb > 0);
            if (p == 0 && step <= 2) CHECK(ra == rb);
            else CHECK(fabs(ra - rb) <= 0.2);
            if (step == 1) CHECK(fabs(ga - gb) <= (p == 0 ? 1e-3 : p == 1 ? 1e-2 : 5e-2) * ga);
            if (step == 1) {
                double mm = rf_test_metric(dir, runs[1], step, "actor/logprob_mismatch_mean");
                printf("%s step 1: cuda log-prob mismatch mean %.3g\n", name, mm);
                CHECK(mm >= 0 && mm < 1e-4);
            }
            if (emulated) { /* the kernels' own arithmetic on the CPU: every log-prob exact */
                double mx = rf_test_metric(dir, runs[1], step, "actor/logprob_mismatch_max");
                if (mx != 0) fprintf(stderr, "%s step %d: cuda log-prob mismatch max %.3g on the emulation\n", name, step, mx);
                CHECK(mx == 0);
            }
        }
    }
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_grpo_cuda");
}
