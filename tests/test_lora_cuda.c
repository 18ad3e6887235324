/* LoRA adapters (model/lora.h) on the CUDA back end against the CPU back end, the same random
 * tiny models (GQA with biases, and Qwen3 with q/k norms and tied embeddings) with adapters on
 * every projection and B random (a fresh B is zero and would hide A's effect), products in
 * plain fp32 (RLFLOW_CUDA_TF32=0):
 *   - attaching draws the same A on the device as on the CPU (bit for bit: drawn on the host,
 *     uploaded); a tensor-parallel shard on the device (one rank) with adapters attached, its
 *     base then read from a model directory as a training rank reads it, keeps those adapters
 *     (it once wrote zeros over them: zero A and B never train) and holds the files' base;
 *   - log-probs and entropies within 1e-4, and every adapter gradient within 1e-3 (relative,
 *     with an absolute floor of the same size: test_model_cuda's fp32 bounds, cuBLAS against
 *     OpenBLAS summation orders), the gradient buffer holding the adapters' alone;
 *   - one AdamW step moves the adapters alone: the frozen base on the device unchanged bit for
 *     bit, the adapters within 1e-3 of the CPU's step (relative to lr: AdamW's first step moves
 *     each one by about lr);
 *   - the device's adapters written in PEFT's layout (read back from the device) load onto a
 *     CPU base and onto a device base as exactly the same floats, and merging on the device
 *     (rf_lora_merge) gives the CPU's merged weights bit for bit (both merge on the host in
 *     double).
 * CMake also runs it on the stand-in CUDA module (test_lora_mock_device, the CPU kernels over
 * tracked "device" memory: a missing upload or download shows as a wrong value). Skips (77)
 * where rlflow was built without CUDA or no GPU is present. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/rng.h"
#include "common/util.h"
#include "comm/comm.h"
#include "model/lora.h"
#include "model/model_tp.h"
#include "trainer/optim.h"
#include "test_util.h"

static const int32_t tok[13] = {3, 17, 42, 5, 90, 11, 7, 7, 23, 64, 1, 0, 96};
static const int32_t tgt[13] = {17, 42, 5, 90, 2, 12, 7, 23, 64, 1, 0, 96, 50};
static const int32_t cu[4] = {0, 5, 6, 13};

static rf_model *make(const rf_kernels *k, rf_arch arch) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 97) == RF_OK);
    c.arch = arch;
    c.qk_norm = arch == RF_ARCH_QWEN3;
    c.qkv_bias = arch != RF_ARCH_QWEN3;
    c.tie_word_embeddings = arch == RF_ARCH_QWEN3;
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, k) == RF_OK);
    rf_model_init_random(m, 9, 0.2f);
    rf_lora_opts o = {4, 8.0f, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_GAUSSIAN, 3};
    CHECK_OK(rf_model_lora_attach(m, &o));
    return m;
}

/* The adapters' floats of m on the host (caller frees). */
static float *adapters_of(const rf_model *m) {
    size_t n = m->n_params - m->n_frozen;
    float *h = malloc(sizeof(float) * n);
    m->k->to_host(h, m->params + m->n_frozen, sizeof(float) * n);
    return h;
}

/* The same random B on both models (uploaded to b's back end). */
static void random_b(rf_model *a, rf_model *b) {
    size_t n = a->n_params - a->n_frozen;
    float *h = adapters_of(a);
    rf_rng r;
    rf_rng_seed(&r, 5);
    for (int i = 1; i < a->lora.n_views; i += 2)
        for (size_t j = 0; j < a->lora.views[i].numel; j++)
            h[a->lora.views[i].offset - a->n_frozen + j] = 0.3f * rf_rng_normal(&r);
    memcpy(a->params + a->n_frozen, h, sizeof(float) * n);
    b->k->to_device(b->params + b->n_frozen, h, sizeof(float) * n);
    b->k->weights_updated();
    free(h);
}

/* Largest |x - y| / (1 + |y|) over n floats, and how many exceed tol. */
static double worst(const float *x, const float *y, size_t n, double tol, int *bad) {
    double w = 0;
    *bad = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)x[i] - y[i]) / (1.0 + fabs((double)y[i]));
        w = e > w ? e : w;
        *bad += e > tol;
    }
    return w;
}

/* PEFT files of the device model load onto a CPU base as the same floats; merging agrees. */
static void peft_and_merge(rf_model *cpu, rf_model *gpu, rf_arch arch) {
    char dir[128];
    snprintf(dir, sizeof dir, "/tmp/rf_lora_cuda_%d_%d", (int)getpid(), (int)arch);
    CHECK_OK(rf_lora_save_peft(gpu, dir, "base"));
    rf_model_config c = cpu->cfg;
    rf_model *plain = NULL;
    CHECK_OK(rf_model_init(&plain, &c, rf_cpu_kernels()));
    memcpy(plain->params, cpu->params, sizeof(float) * cpu->n_frozen);
    CHECK_OK(rf_lora_load_peft(plain, dir));
    float *g = adapters_of(gpu);
    size_t n = gpu->n_params - gpu->n_frozen;
    CHECK(plain->n_params == gpu->n_params && memcmp(plain->params + plain->n_frozen, g, sizeof(float) * n) == 0);
    /* the same files loaded onto a device base (a model that does not train), merged there */
    rf_model *dev = NULL;
    CHECK_OK(rf_model_init(&dev, &c, gpu->k));
    gpu->k->to_device(dev->params, cpu->params, sizeof(float) * cpu->n_frozen);
    CHECK_OK(rf_lora_load_peft(dev, dir));
    float *d = adapters_of(dev);
    CHECK(dev->n_params == gpu->n_params && memcmp(d, g, sizeof(float) * n) == 0);
    CHECK_OK(rf_lora_merge(plain));
    CHECK_OK(rf_lora_merge(dev));
    float *m = malloc(sizeof(float) * dev->n_params);
    gpu->k->to_host(m, dev->params, sizeof(float) * dev->n_params);
    CHECK(dev->n_params == plain->n_params && memcmp(m, plain->params, sizeof(float) * plain->n_params) == 0);
    free(d);
    rf_model_free(dev);
    free(m), free(g);
    rf_model_free(plain);
    rf_remove_tree(dir);
}

/* A tensor-parallel shard on the device (one rank) with adapters attached, its base then read
 * from a model directory (as a training rank reads it): the adapters keep their fresh values
 * (a device staging buffer of the whole shard once wrote zeros over them, and a zero A and B
 * never train), and the base is the files'. */
static void tp_load_keeps_adapters(const rf_kernels *gpu, const rf_model *fresh, rf_arch arch) {
    char dir[128];
    snprintf(dir, sizeof dir, "/tmp/rf_lora_cuda_base_%d_%d", (int)getpid(), (int)arch);
    rf_model *plain = NULL;
    CHECK_OK(rf_model_init(&plain, &fresh->cfg, rf_cpu_kernels()));
    memcpy(plain->params, fresh->params, sizeof(float) * fresh->n_frozen);
    CHECK_OK(rf_model_save(plain, dir, 0, 0));
    rf_model_tp *tp = NULL;
    rf_lora_opts o = {4, 8.0f, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_GAUSSIAN, 3};
    CHECK_OK(rf_model_tp_init(&tp, &fresh->cfg, gpu, rf_comm_single(), 30));
    CHECK_OK(rf_model_tp_lora_attach(tp, &o));
    CHECK_OK(rf_model_tp_load(tp, dir, NULL, NULL));
    size_t n = fresh->n_params - fresh->n_frozen;
    float *h = malloc(sizeof(float) * fresh->n_params);
    gpu->to_host(h, tp->m->params, sizeof(float) * fresh->n_params);
    CHECK(tp->m->n_params == fresh->n_params && memcmp(h, fresh->params, sizeof(float) * fresh->n_frozen) == 0);
    CHECK(memcmp(h + fresh->n_frozen, fresh->params + fresh->n_frozen, sizeof(float) * n) == 0);
    free(h);
    rf_model_tp_free(tp);
    rf_model_free(plain);
    rf_remove_tree(dir);
}

static void compare(const rf_kernels *gpu, rf_arch arch) {
    rf_model *a = make(rf_cpu_kernels(), arch), *b = make(gpu, arch);
    size_t n = a->n_params - a->n_frozen;
    float *fresh = adapters_of(b);
    CHECK(b->n_frozen == a->n_frozen && b->n_params == a->n_params && memcmp(fresh, a->params + a->n_frozen, sizeof(float) * n) == 0);
    free(fresh);
    tp_load_keeps_adapters(gpu, a, arch);
    random_b(a, b);
    CHECK_OK(rf_model_enable_training(a));
    CHECK_OK(rf_model_enable_training(b));
    rf_batch bt = {3, 13, tok, NULL, cu};
    float lp[2][13], en[2][13], d[13];
    for (int t = 0; t < 13; t++) d[t] = 0.1f * (float)(t % 5) - 0.2f;
    rf_model *ms[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(rf_model_forward(ms[i], &bt));
        CHECK_OK(rf_model_logprobs(ms[i], tgt, 1.0f, lp[i], en[i]));
        CHECK_OK(rf_model_backward(ms[i], d, d, NULL));
    }
    int bad_out, bad_ent, bad_grad;
    double wo = worst(lp[1], lp[0], 13, 1e-4, &bad_out), we = worst(en[1], en[0], 13, 1e-4, &bad_ent);
    float *ga = malloc(sizeof(float) * n), *gb = malloc(sizeof(float) * n), *base = malloc(sizeof(float) * b->n_frozen);
    memcpy(ga, a->grads, sizeof(float) * n);
    gpu->to_host(gb, b->grads, sizeof(float) * n);
    double wg = worst(gb, ga, n, 1e-3, &bad_grad), gmax = 0;
    for (size_t i = 0; i < n; i++) gmax = fmax(gmax, fabs(ga[i]));
    CHECK(bad_out == 0 && bad_ent == 0 && bad_grad == 0 && gmax > 1e-3);
    /* one AdamW step: the adapters alone move */
    gpu->to_host(base, b->params, sizeof(float) * b->n_frozen);
    rf_optim_opts oo = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .grad_clip = 0, .weight_decay = 0.01f};
    double na = 0, nb = 0;
    CHECK_OK(rf_optim_step(a, &oo, &na, NULL));
    CHECK_OK(rf_optim_step(b, &oo, &nb, NULL));
    CHECK(fabs(na - nb) <= 1e-3 * na);
    float *base2 = malloc(sizeof(float) * b->n_frozen), *pb = adapters_of(b);
    gpu->to_host(base2, b->params, sizeof(float) * b->n_frozen);
    CHECK(memcmp(base, base2, sizeof(float) * b->n_frozen) == 0 && memcmp(base, a->params, sizeof(float) * a->n_frozen) == 0);
    double ws = 0;
    for (size_t i = 0; i < n; i++) ws = fmax(ws, fabs((double)pb[i] - a->params[a->n_frozen + i]) / oo.lr);
    CHECK(ws < 1e-3);
    printf("test_lora_cuda: arch %d, %zu adapter floats: worst relative difference log-probs %.3g, entropies %.3g "
           "(tol 1e-4), adapter gradients %.3g (tol 1e-3, largest gradient %.3g); after one AdamW step the adapters "
           "differ by %.3g lr (tol 1e-3)\n", (int)arch, n, wo, we, wg, gmax, ws);
    free(ga), free(gb), free(base), free(base2), free(pb);
    peft_and_merge(a, b, arch);
    rf_model_free(a), rf_model_free(b);
}

int main(void) {
    setenv("RLFLOW_CUDA_TF32", "0", 1);
    const rf_kernels *gpu = rf_cuda_kernels(0);
    if (!gpu) {
        printf("test_lora_cuda: skipped: %s\n", rf_error_message());
        return 77;
    }
    CHECK_OK(gpu->set_precision(RF_PRECISION_FP32));
    compare(gpu, RF_ARCH_QWEN2);
    compare(gpu, RF_ARCH_QWEN3);
    return rf_test_finish("test_lora_cuda");
}
