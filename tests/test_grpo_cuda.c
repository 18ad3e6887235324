/* A colocated GRPO run on the CUDA back end against the same run on the CPU (the first GPU
 * run's end-to-end check, tests/test_split_mock_device.c being the same on the stand-in module):
 * the SFT-warm-started tiny model of tests/run_util.h, 5 steps, products in plain fp32
 * (RLFLOW_CUDA_TF32=0, inherited by the run).
 *  - steps 1 and 2: the same mean reward. Both runs sample from the same seeds; their logits
 *    differ by fp32 rounding (~1e-6 relative), which changes a sampled token only where a
 *    uniform draw falls within ~1e-6 of a boundary of the cumulative distribution: for the
 *    ~700 draws of two steps, a chance of ~1e-3.
 *  - step 1: gradient norms within 1e-3 relative (same samples; cuBLAS against OpenBLAS
 *    summation orders through two layers and the loss, as test_model_cuda's 1e-3).
 *  - steps 3 to 5: a finite positive gradient norm and mean rewards within 0.2 (the weights
 *    have moved apart by rounding; samples may differ).
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
    rf_test_write_recipe(dir, 0, "[async]\npeer_timeout = 60\n");
    const char *runs[2] = {"grpo_cpu", "grpo_cuda"};
    const char *extra[2] = {"", "--set model.device=cuda --set placement.device=cuda"};
    for (int i = 0; i < 2; i++) {
        char args[512], *out = NULL;
        /* both at bf16, `auto`'s choice on CUDA (on a CPU without bf16 instructions `auto` is fp32) */
        snprintf(args, sizeof args, "--set placement.mode=colocated --set train.steps=5 --set model.precision=bf16 "
                 "--set logging.val_every=0 %s", extra[i]);
        int rc = rf_test_run_recipe(&out, dir, rlflow, runs[i], args);
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
    }
    for (int step = 1; step <= 5; step++) {
        double ra = rf_test_metric(dir, "grpo_cpu", step, "reward/mean");
        double rb = rf_test_metric(dir, "grpo_cuda", step, "reward/mean");
        double ga = rf_test_metric(dir, "grpo_cpu", step, "actor/grad_norm");
        double gb = rf_test_metric(dir, "grpo_cuda", step, "actor/grad_norm");
        printf("step %d: reward cpu %.6f cuda %.6f, grad norm cpu %.8f cuda %.8f\n", step, ra, rb,
               ga, gb);
        CHECK(isfinite(ga) && isfinite(gb) && ga > 0 && gb > 0);
        if (step <= 2) CHECK(ra == rb);
        else CHECK(fabs(ra - rb) <= 0.2);
        if (step == 1) CHECK(fabs(ga - gb) <= 1e-3 * ga);
    }
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_grpo_cuda");
}
