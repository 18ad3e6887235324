/* LoRA adapters (model/lora.h) on tiny models of every shape, fp32 on the CPU:
 *  - forward with adapters equals a plain model whose weights are merged in double,
 *    W + (alpha / r) B A (PEFT's scaling), and a fresh adapter (B = 0) changes nothing;
 *  - gradients of the adapters against central finite differences, no gradient anywhere else,
 *    and an optimizer step moves the adapters only;
 *  - KV-cache decoding with unmerged adapters equals the full forward;
 *  - PEFT's initialisations; bad options refused naming the recipe key;
 *  - a checkpoint of a LoRA model holds its PEFT adapter directory (written inside the
 *    checkpoint before its rename, so no complete checkpoint lacks it);
 *  - adapters bound over a borrowed buffer (rf_model_lora_bind) give the owner's logits bit for
 *    bit; the adapters' table from 0 (rf_lora_table); their refusals, exactly. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "model/lora.h"
#include "common/util.h"
#include "model/safetensors.h"
#include "trainer/checkpoint.h"
#include "trainer/data_parallel.h"
#include "trainer/optim.h"
#include "test_util.h"

static rf_model_config tiny_config(rf_arch arch) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", 97) == RF_OK);
    c.hidden_size = 16, c.intermediate_size = 24, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 6;
    c.arch = arch;
    c.qkv_bias = arch == RF_ARCH_QWEN2;
    c.qk_norm = arch == RF_ARCH_QWEN3;
    c.tie_word_embeddings = arch != RF_ARCH_LLAMA;
    c.rope_theta = 500.0f;
    return c;
}

static const int32_t tok[13] = {3, 17, 42, 5, 90, 11, 7, 7, 23, 64, 1, 0, 96};
static const int32_t tgt[13] = {17, 42, 5, 90, 2, 12, 7, 23, 64, 1, 0, 96, 50};
static const int32_t cu[4] = {0, 5, 6, 13};

static rf_lora_opts all_targets(int rank, float alpha) {
    rf_lora_opts o = {rank, alpha, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_GAUSSIAN, 11};
    return o;
}

/* A random model with adapters on every target, B random too (a fresh B is zero and would hide
 * A's effect). */
static rf_model *lora_model(rf_arch arch, int rank, float alpha) {
    rf_model_config c = tiny_config(arch);
    rf_model *m;
    CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_model_init_random(m, 7, 0.3f);
    rf_lora_opts o = all_targets(rank, alpha);
    CHECK_OK(rf_model_lora_attach(m, &o));
    rf_rng r;
    rf_rng_seed(&r, 5);
    for (int i = 1; i < m->lora.n_views; i += 2)
        for (size_t j = 0; j < m->lora.views[i].numel; j++)
            m->params[m->lora.views[i].offset + j] = 0.3f * rf_rng_normal(&r);
    return m;
}

static void logits_of(rf_model *m, float *out) {
    rf_batch bt = {3, 13, tok, NULL, cu};
    int rows[13];
    for (int i = 0; i < 13; i++) rows[i] = i;
    CHECK_OK(rf_model_forward(m, &bt));
    CHECK_OK(rf_model_logits(m, rows, 13, out));
}

/* The adapters merged in double into a plain copy of m's base: W += scale * B A. */
static rf_model *merged_copy(const rf_model *m) {
    rf_model *p;
    CHECK_OK(rf_model_init(&p, &m->cfg, rf_cpu_kernels()));
    memcpy(p->params, m->params, sizeof(float) * m->n_frozen);
    int r = m->lora.rank;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        float *w[RF_LORA_N] = {p->layers[l].wq, p->layers[l].wk, p->layers[l].wv, p->layers[l].wo,
                               p->layers[l].wgate, p->layers[l].wup, p->layers[l].wdown};
        for (int t = 0; t < RF_LORA_N; t++) {
            int in, out;
            rf_lora_target_dims(&m->cfg, t, &in, &out);
            const float *A = m->layers[l].lora_a[t], *B = m->layers[l].lora_b[t];
            for (int o = 0; o < out; o++)
                for (int i = 0; i < in; i++) {
                    double s = 0;
                    for (int j = 0; j < r; j++) s += (double)B[o * r + j] * A[j * in + i];
                    w[t][o * in + i] = (float)(w[t][o * in + i] + (double)m->lora.alpha / r * s);
                }
        }
    }
    return p;
}

static void forward_check(rf_arch arch) {
    rf_model *m = lora_model(arch, 3, 6.0f);
    CHECK(fabsf(m->lora.scale - 2.0f) < 1e-7f);
    rf_model *p = merged_copy(m);
    int V = m->cfg.vocab_size;
    float *a = malloc(sizeof(float) * 13 * V), *b = malloc(sizeof(float) * 13 * V);
    logits_of(m, a);
    logits_of(p, b);
    double maxdiff = 0, maxabs = 0;
    for (int i = 0; i < 13 * V; i++) maxdiff = fmax(maxdiff, fabs(a[i] - b[i])), maxabs = fmax(maxabs, fabs(b[i]));
    /* fp32 products in a different order than the merged weights: 1e-4 on logits of size ~1 */
    if (maxdiff >= 1e-4) fprintf(stderr, "arch %d: adapters vs merged max |diff| %g\n", arch, maxdiff);
    CHECK(maxdiff < 1e-4);
    CHECK(maxabs > 0.1);
    /* a fresh adapter (B = 0, PEFT's init) leaves the model as it was */
    rf_model *base;
    CHECK_OK(rf_model_init(&base, &m->cfg, rf_cpu_kernels()));
    rf_model_init_random(base, 7, 0.3f);
    logits_of(base, b);
    rf_lora_opts o = all_targets(4, 8.0f);
    CHECK_OK(rf_model_lora_attach(base, &o));
    logits_of(base, a);
    CHECK(memcmp(a, b, sizeof(float) * 13 * V) == 0);
    free(a), free(b);
    rf_model_free(base);
    rf_model_free(p);
    rf_model_free(m);
}

static double loss(rf_model *m, const double *a) {
    rf_batch bt = {3, 13, tok, NULL, cu};
    float lp[13];
    CHECK_OK(rf_model_forward(m, &bt));
    CHECK_OK(rf_model_logprobs(m, tgt, 1.0f, lp, NULL));
    double s = 0;
    for (int t = 0; t < 13; t++) s += a[t] * lp[t];
    return s;
}

/* Central differences with the tolerance of tests/test_model.c (2% + 1e-3), every adapter
 * tensor, five elements each. h = 3e-3 rather than 1e-2: the random B (std 0.3) makes the loss
 * more curved in A, and at h = 1e-2 the O(h^2) truncation error reached 10% on one element
 * and at h = 1e-3 the fp32 rounding of the forward passes (amplified by 1/h) reached it. */
static void grad_check(rf_arch arch) {
    rf_model *m = lora_model(arch, 2, 3.0f);
    CHECK_OK(rf_model_enable_training(m));
    size_t n_lora = rf_lora_param_count(&(rf_lora_opts){2, 3.0f, 0, (1u << RF_LORA_N) - 1, 0, 0}, &m->cfg);
    CHECK(m->n_params - m->n_frozen == n_lora);
    double a[13];
    float fa[13];
    rf_rng r;
    rf_rng_seed(&r, 3);
    for (int t = 0; t < 13; t++) a[t] = fa[t] = rf_rng_normal(&r);
    loss(m, a);
    rf_model_zero_grad(m);
    CHECK_OK(rf_model_backward(m, fa, NULL, NULL));
    int bad = 0, checked = 0;
    for (int v = 0; v < m->lora.n_views; v++) {
        const rf_param_view *pv = &m->lora.views[v];
        for (int trial = 0; trial < 5; trial++) {
            size_t i = pv->offset + (size_t)(rf_rng_u64(&r) % pv->numel);
            float keep = m->params[i], h = 3e-3f;
            m->params[i] = keep + h;
            m->k->weights_updated(); /* the back end's weight copies follow (kernels.h) */
            double lp = loss(m, a);
            m->params[i] = keep - h;
            m->k->weights_updated();
            double lm = loss(m, a);
            m->params[i] = keep;
            m->k->weights_updated();
            double fd = (lp - lm) / (2.0 * h), an = m->grads[i - m->n_frozen];
            checked++;
            if (fabs(fd - an) > 1e-3 + 2e-2 * fabs(fd)) {
                bad++;
                fprintf(stderr, "arch %d: %s[%zu]: analytic %.6g, numeric %.6g\n", arch, pv->name,
                        i - pv->offset, an, fd);
            }
        }
    }
    CHECK(bad == 0);
    CHECK(checked == 5 * 2 * RF_LORA_N * m->cfg.num_hidden_layers);
    /* one AdamW step: the base stays bit for bit, every adapter tensor moves */
    float *before = malloc(sizeof(float) * m->n_params);
    memcpy(before, m->params, sizeof(float) * m->n_params);
    rf_optim_opts oo = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f, .grad_clip = 1.0f};
    double norm;
    CHECK_OK(rf_optim_step(m, &oo, &norm, NULL));
    CHECK(norm > 0);
    CHECK(memcmp(before, m->params, sizeof(float) * m->n_frozen) == 0);
    for (int v = 0; v < m->lora.n_views; v++) {
        const rf_param_view *pv = &m->lora.views[v];
        CHECK(memcmp(before + pv->offset, m->params + pv->offset, sizeof(float) * pv->numel) != 0);
    }
    free(before);
    rf_model_free(m);
}

/* Prefill + decode of one sequence through the KV cache against the full forward. */
static void decode_check(void) {
    rf_model *m = lora_model(RF_ARCH_QWEN2, 3, 5.0f);
    int V = m->cfg.vocab_size;
    float *full = malloc(sizeof(float) * 13 * V), *dec = malloc(sizeof(float) * V);
    logits_of(m, full);
    rf_kv_cache kv;
    CHECK_OK(rf_kv_cache_init(&kv, m, 1, 16));
    int slot = 0, count = 4, one = 1;
    CHECK_OK(rf_model_decode(m, &kv, &slot, &count, 1, tok + 6, dec));
    double maxdiff = 0;
    for (int j = 0; j < V; j++) maxdiff = fmax(maxdiff, fabs(dec[j] - full[9 * V + j]));
    for (int s = 4; s < 7; s++) {
        CHECK_OK(rf_model_decode(m, &kv, &slot, &one, 1, tok + 6 + s, dec));
        for (int j = 0; j < V; j++) maxdiff = fmax(maxdiff, fabs(dec[j] - full[(6 + s) * V + j]));
    }
    if (maxdiff >= 1e-4) fprintf(stderr, "lora decode max |diff| %g\n", maxdiff);
    CHECK(maxdiff < 1e-4);
    rf_kv_cache_free(&kv, m);
    free(full), free(dec);
    rf_model_free(m);
}

/* PEFT's reset_lora_parameters: "gaussian" A ~ normal(0, 1/r); default kaiming_uniform_(a =
 * sqrt(5)) A ~ uniform(-1/sqrt(in), 1/sqrt(in)); B = 0. The sample std of the q_proj A's
 * 2 x 4 x 16 = 128 draws is within 25% of 1/r (a 4-sigma band for 128 normal draws is ~25%). */
static void init_check(void) {
    rf_model_config c = tiny_config(RF_ARCH_QWEN2);
    for (int init = 0; init < 2; init++) {
        rf_model *m;
        CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
        rf_lora_opts o = {4, 8.0f, 0, 1u << RF_LORA_Q | 1u << RF_LORA_DOWN, (rf_lora_init)init, 9};
        CHECK_OK(rf_model_lora_attach(m, &o));
        CHECK(m->lora.n_views == 8);
        CHECK(strcmp(m->lora.views[0].name, "model.layers.0.self_attn.q_proj.lora_A.weight") == 0);
        CHECK(strcmp(m->lora.views[3].name, "model.layers.0.mlp.down_proj.lora_B.weight") == 0);
        CHECK(m->lora.views[3].shape[0] == 16 && m->lora.views[3].shape[1] == 4);
        CHECK(m->lora.views[2].shape[0] == 4 && m->lora.views[2].shape[1] == 24);
        double ss = 0;
        float mx = 0;
        for (int l = 0; l < 2; l++) {
            const float *A = m->layers[l].lora_a[RF_LORA_Q], *B = m->layers[l].lora_b[RF_LORA_Q];
            for (int i = 0; i < 4 * 16; i++) ss += (double)A[i] * A[i], mx = fmaxf(mx, fabsf(A[i]));
            for (int i = 0; i < 24 * 4; i++) CHECK(B[i] == 0.0f);
            CHECK(m->layers[l].lora_a[RF_LORA_K] == NULL);
        }
        double sd = sqrt(ss / 128);
        if (init == RF_LORA_INIT_GAUSSIAN) CHECK(fabs(sd - 0.25) < 0.25 * 0.25);
        else CHECK(mx <= 0.25f && fabs(sd - 0.25 / sqrt(3.0)) < 0.25 * 0.25 / sqrt(3.0)); /* uniform: bound/sqrt(3) */
        rf_model_free(m);
    }
}

static void error_check(void) {
    rf_model_config c = tiny_config(RF_ARCH_QWEN2);
    rf_model *m;
    CHECK_OK(rf_model_init(&m, &c, rf_cpu_kernels()));
    rf_lora_opts o = all_targets(0, 16.0f);
    CHECK_ERR(rf_model_lora_attach(m, &o), RF_ERR_ARG, "lora.rank = 0: must be >= 1");
    o.rank = 17;
    CHECK_ERR(rf_model_lora_attach(m, &o), RF_ERR_ARG, "lora.rank = 17: must be at most the model's hidden_size (16)");
    o.rank = 2, o.dropout = 0.05f;
    CHECK_ERR(rf_model_lora_attach(m, &o), RF_ERR_UNSUPPORTED, "lora.dropout = 0.05: dropout on the adapter input is not implemented; set it to 0");
    o.dropout = 0, o.alpha = 0;
    CHECK_ERR(rf_model_lora_attach(m, &o), RF_ERR_ARG, "lora.alpha = 0: must be > 0");
    o.alpha = 4, o.targets = 0;
    CHECK_ERR(rf_model_lora_attach(m, &o), RF_ERR_ARG, "lora.targets: no target");
    const char *names[] = {"q", "qkv"};
    unsigned bits;
    CHECK_ERR(rf_lora_parse_targets(names, 2, "lora.targets", &bits), RF_ERR_ARG,
              "lora.targets: unknown target \"qkv\" (known: q, k, v, o, gate, up, down)");
    const char *good[] = {"down", "q", "o"};
    CHECK_OK(rf_lora_parse_targets(good, 3, "lora.targets", &bits));
    CHECK(bits == (1u << RF_LORA_DOWN | 1u << RF_LORA_Q | 1u << RF_LORA_O));
    o.targets = bits;
    CHECK_OK(rf_model_lora_attach(m, &o));
    CHECK_ERR(rf_model_lora_attach(m, &o), RF_ERR_ARG, "has none yet");
    rf_model_free(m);
}

/* rf_checkpoint_save of a LoRA model: step_N/adapter holds adapter_config.json and
 * adapter_model.safetensors with PEFT's names and the adapters' exact floats, and nothing is
 * left in step_N.tmp (it was written there and renamed with the rest). */
static void checkpoint_check(void) {
    rf_model *m = lora_model(RF_ARCH_QWEN2, 3, 6.0f);
    CHECK_OK(rf_model_enable_training(m));
    char dir[] = "/tmp/rf_lora_ckpt_XXXXXX", p[4200];
    CHECK(mkdtemp(dir) != NULL);
    rf_ckpt_state st = {.step = 3, .kl_beta = 0.1f};
    CHECK_OK(rf_checkpoint_save(dir, m, NULL, NULL, &st, 0));
    snprintf(p, sizeof p, "%s/step_000003/adapter/adapter_config.json", dir);
    CHECK(rf_file_exists(p));
    snprintf(p, sizeof p, "%s/step_000003.tmp", dir);
    CHECK(!rf_file_exists(p));
    snprintf(p, sizeof p, "%s/step_000003/adapter/adapter_model.safetensors", dir);
    rf_safetensors *sf = NULL;
    CHECK_OK(rf_st_open_file(&sf, p));
    CHECK(sf && rf_st_count(sf) == m->lora.n_views);
    for (int i = 0; sf && i < m->lora.n_views; i++) {
        const rf_param_view *v = &m->lora.views[i];
        char name[RF_MAX_NAME + 32];
        snprintf(name, sizeof name, "base_model.model.%s", v->name);
        float *got = malloc(sizeof(float) * v->numel);
        CHECK_OK(rf_st_read_f32(sf, name, got, v->shape, v->ndim));
        CHECK(memcmp(got, m->params + v->offset, sizeof(float) * v->numel) == 0);
        free(got);
    }
    rf_st_close(sf);
    snprintf(p, sizeof p, "%s/step_000003/adapter", dir);
    /* the PEFT copy loads back onto the base as the adapters themselves */
    rf_model *b;
    CHECK_OK(rf_model_init(&b, &m->cfg, rf_cpu_kernels()));
    memcpy(b->params, m->params, sizeof(float) * m->n_frozen);
    CHECK_OK(rf_lora_load_peft(b, p));
    CHECK(b->n_params == m->n_params && memcmp(b->params, m->params, sizeof(float) * m->n_params) == 0);
    rf_model_free(b);
    rf_remove_tree(dir);
    rf_model_free(m);
}

/* Adapters bound over a borrowed buffer (a colocated rollout rank over its training rank's
 * weights): the same logits as the model that owns the buffer, bit for bit, and the table
 * rf_lora_table gives is the adapters' from 0; what bind and the table refuse, exactly. */
static void bind_check(void) {
    rf_model *m = lora_model(RF_ARCH_QWEN2, 3, 6.0f), *b = NULL;
    rf_lora_opts o = all_targets(3, 6.0f);
    CHECK_OK(rf_model_init_borrowed(&b, &m->cfg, rf_cpu_kernels(), m->params));
    rf_param_view *t = NULL;
    int n = -1;
    CHECK_ERR(rf_lora_table(b, &t, &n), RF_ERR_ARG, "LoRA: the model has no adapters");
    CHECK(t == NULL && n == 0);
    CHECK_OK(rf_model_lora_bind(b, &o));
    CHECK(b->n_frozen == m->n_frozen && b->n_params == m->n_params && b->params == m->params);
    int V = m->cfg.vocab_size;
    float *x = malloc(sizeof(float) * 13 * V), *y = malloc(sizeof(float) * 13 * V);
    logits_of(m, x);
    logits_of(b, y);
    CHECK(memcmp(x, y, sizeof(float) * 13 * V) == 0);
    CHECK_OK(rf_lora_table(b, &t, &n));
    CHECK(n == m->lora.n_views && t[0].offset == 0 && t[n - 1].offset + t[n - 1].numel == m->n_params - m->n_frozen);
    free(t), free(x), free(y);
    CHECK_ERR(rf_model_lora_bind(b, &o), RF_ERR_ARG,
              "LoRA: adapters are bound over a borrowed buffer, on a model without any that is not training");
    rf_model *own = NULL; /* a model with a buffer of its own: attach, not bind */
    CHECK_OK(rf_model_init(&own, &m->cfg, rf_cpu_kernels()));
    CHECK_ERR(rf_model_lora_bind(own, &o), RF_ERR_ARG, "LoRA: adapters are bound over a borrowed buffer");
    rf_model_free(own), rf_model_free(b), rf_model_free(m);
}

int main(void) {
    rf_arch arch[] = {RF_ARCH_QWEN2, RF_ARCH_LLAMA, RF_ARCH_QWEN3};
    for (int i = 0; i < 3; i++) {
        forward_check(arch[i]);
        grad_check(arch[i]);
    }
    decode_check();
    init_check();
    error_check();
    checkpoint_check();
    bind_check();
    return rf_test_finish("test_lora");
}
