/* The whole model on the CUDA back end against the CPU back end: log-probs, entropies, values,
 * every parameter gradient, and KV-cache decode logits, on the same random tiny models.
 * Skips (exit 77) where rlflow was built without CUDA or no GPU is present. */
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

/* fp32 on both, cuBLAS and OpenBLAS summing in different orders over K <= 176: 1e-4 relative
 * on outputs, 1e-3 on gradients (accumulated over 13 tokens and two layers). */
static void compare(rf_arch arch, int value_head, const rf_kernels *gpu) {
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
    for (int t = 0; t < 13; t++) {
        CHECK_CLOSE(ob[t], oa[t], 1e-4, 1e-4);
        if (!value_head) CHECK_CLOSE(eb[t], ea[t], 1e-4, 1e-4);
    }
    float *ga = malloc(a->n_params * sizeof(float)), *gb = malloc(a->n_params * sizeof(float));
    memcpy(ga, a->grads, a->n_params * sizeof(float));
    gpu->to_host(gb, b->grads, a->n_params * sizeof(float));
    int bad = 0;
    for (size_t i = 0; i < a->n_params; i++)
        if (fabsf(ga[i] - gb[i]) > 1e-3f * (1.0f + fabsf(ga[i]))) bad++;
    CHECK(bad == 0);
    free(ga), free(gb);
    rf_model_free(a), rf_model_free(b);
}

int main(void) {
    const rf_kernels *gpu = rf_cuda_kernels(0);
    if (!gpu) {
        printf("test_model_cuda: skipped: %s\n", rf_error_message());
        return 77;
    }
    compare(RF_ARCH_QWEN2, 0, gpu);
    compare(RF_ARCH_QWEN3, 0, gpu);
    compare(RF_ARCH_QWEN2, 1, gpu);
    return rf_test_finish("test_model_cuda");
}
