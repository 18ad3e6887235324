/* The whole model on the CUDA back end against the CPU back end: log-probs, entropies, values
 * and every parameter gradient, on the same random tiny models, at the back end's three
 * product precisions: plain fp32 (RLFLOW_CUDA_TF32=0), TF32 (the fp32 default on CUDA) and
 * bf16 (set_precision), each against the CPU's fp32. The largest differences are printed, so
 * a GPU run shows its margins. Skips (exit 77) where rlflow was built without CUDA or no GPU
 * is present. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "test_util.h"

static const int32_t tok[13] = {3, 17, 42, 5, 90, 11, 7, 7, 23, 64, 1, 0, 96};
static const int32_t tgt[13] = {17, 42, 5, 90, 2, 12, 7, 23, 64, 1, 0, 96, 50};
static const int32_t cu[4] = {0, 5, 6, 13};

static rf_model *make(const rf_kernels *k, rf_arch arch, int value_head) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 97) == RF_OK);
    c.arch = arch;
    c.qk_norm = arch == RF_ARCH_QWEN3;
    c.qkv_bias = arch != RF_ARCH_QWEN3;
    c.value_head = value_head;
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, k) == RF_OK);
    rf_model_init_random(m, 9, 0.2f);
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    return m;
}

/* Tolerances (relative, with an absolute floor of the same size):
 *  - fp32 on both, cuBLAS and OpenBLAS summing in different orders over K <= 176: 1e-4 on
 *    outputs, 1e-3 on gradients (accumulated over 13 tokens and two layers);
 *  - TF32 (operands rounded to 10 mantissa bits, 2^-11 relative): ~1e-3 per product, grown
 *    through two layers and the softmax: 1e-2 on outputs, 3e-2 on gradients;
 *  - bf16 (8 mantissa bits, 2^-9 relative, 4x TF32's): 4e-2 on outputs, 1e-1 on gradients.
 * The TF32 and bf16 bounds are estimates from the rounding unit, not yet measured on a GPU: the
 * first GPU run prints the differences it sees (docs/cuda.md). */
typedef struct {
    const char *name;
    double out, grad;
} tolerance;

static void compare(rf_arch arch, int value_head, const rf_kernels *gpu, tolerance tol) {
    rf_model *a = make(rf_cpu_kernels(), arch, value_head), *b = make(gpu, arch, value_head);
    rf_batch bt = {3, 13, tok, NULL, cu};
    float oa[13], ob[13], ea[13], eb[13], d[13];
    for (int t = 0; t < 13; t++) d[t] = 0.1f * (float)(t % 5) - 0.2f;
    rf_model *ms[2] = {a, b};
    float *outs[2] = {oa, ob}, *ents[2] = {ea, eb};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(rf_model_forward(ms[i], &bt));
        if (value_head) {
            CHECK_OK(rf_model_values(ms[i], outs[i]));
            CHECK_OK(rf_model_backward(ms[i], NULL, NULL, d));
        } else {
            CHECK_OK(rf_model_logprobs(ms[i], tgt, 1.0f / 0.8f, outs[i], ents[i]));
            CHECK_OK(rf_model_backward(ms[i], d, d, NULL));
        }
    }
    double worst_out = 0.0, worst_grad = 0.0;
    for (int t = 0; t < 13; t++) {
        CHECK_CLOSE(ob[t], oa[t], tol.out, tol.out);
        double e = fabs((double)ob[t] - oa[t]) / (1.0 + fabs((double)oa[t]));
        worst_out = e > worst_out ? e : worst_out;
        if (!value_head) {
            CHECK_CLOSE(eb[t], ea[t], tol.out, tol.out);
            e = fabs((double)eb[t] - ea[t]) / (1.0 + fabs((double)ea[t]));
            worst_out = e > worst_out ? e : worst_out;
        }
    }
    float *ga = malloc(a->n_params * sizeof(float)), *gb = malloc(a->n_params * sizeof(float));
    memcpy(ga, a->grads, a->n_params * sizeof(float));
    gpu->to_host(gb, b->grads, a->n_params * sizeof(float));
    int bad = 0;
    for (size_t i = 0; i < a->n_params; i++) {
        double e = fabs((double)ga[i] - gb[i]) / (1.0 + fabs((double)ga[i]));
        worst_grad = e > worst_grad ? e : worst_grad;
        if (e > tol.grad) bad++;
    }
    printf("test_model_cuda: %s arch %d%s: worst relative difference outputs %.3g (tol %.3g), "
           "gradients %.3g (tol %.3g), %d gradients off\n", tol.name, (int)arch,
           value_head ? " value head" : "", worst_out, tol.out, worst_grad, tol.grad, bad);
    CHECK(bad == 0);
    free(ga), free(gb);
    rf_model_free(a), rf_model_free(b);
}

/* The three precisions in turn; the back end is left at plain fp32. */
static void compare_all(const rf_kernels *gpu, tolerance tol, const char *tf32, rf_precision p) {
    setenv("RLFLOW_CUDA_TF32", tf32, 1);
    CHECK_OK(gpu->set_precision(p)); /* re-reads RLFLOW_CUDA_TF32 */
    compare(RF_ARCH_QWEN2, 0, gpu, tol);
    compare(RF_ARCH_QWEN3, 0, gpu, tol);
    compare(RF_ARCH_QWEN2, 1, gpu, tol);
    setenv("RLFLOW_CUDA_TF32", "0", 1);
    CHECK_OK(gpu->set_precision(RF_PRECISION_FP32));
}

int main(void) {
    setenv("RLFLOW_CUDA_TF32", "0", 1);
    const rf_kernels *gpu = rf_cuda_kernels(0);
    if (!gpu) {
        printf("test_model_cuda: skipped: %s\n", rf_error_message());
        return 77;
    }
    compare_all(gpu, (tolerance){"fp32", 1e-4, 1e-3}, "0", RF_PRECISION_FP32);
    compare_all(gpu, (tolerance){"tf32", 1e-2, 3e-2}, "1", RF_PRECISION_FP32);
    compare_all(gpu, (tolerance){"bf16", 4e-2, 1e-1}, "0", RF_PRECISION_BF16);
    return rf_test_finish("test_model_cuda");
}
