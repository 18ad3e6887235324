/* LoRA adapters: the parameter table of the adapters, their PEFT initialisation, and attaching
 * them to a loaded model (model/lora.h). */
#include "model/lora.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/util.h"
#include "model/model_internal.h"

static const char *const TARGETS[RF_LORA_N] = {"q", "k", "v", "o", "gate", "up", "down"};
static const char *const MODULES[RF_LORA_N] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                               "mlp.down_proj"};

const char *rf_lora_target_name(int t) { return t >= 0 && t < RF_LORA_N ? TARGETS[t] : "?"; }

const char *rf_lora_module_name(int t) {
    return t >= 0 && t < RF_LORA_N ? strchr(MODULES[t], '.') + 1 : "?";
}

rf_status rf_lora_parse_targets(const char *const *names, int n, const char *key, unsigned *targets) {
    *targets = 0;
    for (int i = 0; i < n; i++) {
        int t = 0;
        while (t < RF_LORA_N && strcmp(names[i], TARGETS[t]) != 0) t++;
        if (t == RF_LORA_N)
            return rf_error(RF_ERR_ARG, "%s: unknown target \"%s\" (known: q, k, v, o, gate, up, down)", key, names[i]);
        *targets |= 1u << t;
    }
    if (!*targets) return rf_error(RF_ERR_ARG, "%s: no target (name some of q, k, v, o, gate, up, down)", key);
    return RF_OK;
}

void rf_lora_target_dims(const rf_model_config *c, int t, int *in, int *out) {
    int C = c->hidden_size, F = c->intermediate_size, QD = c->num_attention_heads * c->head_dim,
        KD = c->num_key_value_heads * c->head_dim;
    static const int IN_IS[RF_LORA_N] = {0, 0, 0, 1, 0, 0, 2}; /* 0: C, 1: QD, 2: F */
    static const int OUT_IS[RF_LORA_N] = {1, 3, 3, 0, 2, 2, 0}; /* 3: KD */
    int dim[4] = {C, QD, F, KD};
    *in = dim[IN_IS[t]];
    *out = dim[OUT_IS[t]];
}

rf_status rf_lora_check(const rf_lora_opts *o, const rf_model_config *cfg) {
    if (o->rank < 1)
        return rf_error(RF_ERR_ARG, "lora.rank = %d: must be >= 1", o->rank);
    if (o->rank > cfg->hidden_size)
        return rf_error(RF_ERR_ARG, "lora.rank = %d: must be at most the model's hidden_size (%d)",
                        o->rank, cfg->hidden_size);
    if (!isfinite(o->alpha) || o->alpha <= 0)
        return rf_error(RF_ERR_ARG, "lora.alpha = %g: must be > 0", o->alpha);
    if (o->dropout != 0)
        return rf_error(RF_ERR_UNSUPPORTED, "lora.dropout = %g: dropout on the adapter input is not "
                        "implemented; set it to 0", o->dropout);
    if (!o->targets)
        return rf_error(RF_ERR_ARG, "lora.targets: no target (name some of q, k, v, o, gate, up, down)");
    if (o->targets >= (1u << RF_LORA_N))
        return rf_error(RF_ERR_ARG, "lora.targets: bits 0x%x name no projection", o->targets >> RF_LORA_N << RF_LORA_N);
    return RF_OK;
}

size_t rf_lora_param_count(const rf_lora_opts *o, const rf_model_config *cfg) {
    size_t n = 0;
    for (int t = 0; t < RF_LORA_N; t++) {
        if (!(o->targets & (1u << t))) continue;
        int in, out;
        rf_lora_target_dims(cfg, t, &in, &out);
        n += (size_t)o->rank * (size_t)(in + out);
    }
    return n * (size_t)cfg->num_hidden_layers;
}

/* The adapter table: per layer and target, lora_A (r, in) then lora_B (out, r), offsets from
 * `base` floats on. */
static rf_param_view *lora_views(const rf_lora_opts *o, const rf_model_config *cfg, size_t base, int *n) {
    int L = cfg->num_hidden_layers;
    rf_param_view *v = rf_calloc((size_t)L * 2 * RF_LORA_N + 1, sizeof *v);
    if (!v) return NULL;
    *n = 0;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < RF_LORA_N; t++) {
            if (!(o->targets & (1u << t))) continue;
            int in, out;
            rf_lora_target_dims(cfg, t, &in, &out);
            for (int ab = 0; ab < 2; ab++) {
                rf_param_view *x = &v[(*n)++];
                snprintf(x->name, sizeof x->name, "model.layers.%d.%s.lora_%c.weight", l, MODULES[t], ab ? 'B' : 'A');
                x->ndim = 2;
                x->shape[0] = ab ? out : o->rank;
                x->shape[1] = ab ? o->rank : in;
                x->numel = (size_t)o->rank * (size_t)(ab ? out : in);
                x->offset = base;
                base += x->numel;
            }
        }
    return v;
}

/* Host values of the adapters: A per o->init (PEFT's reset_lora_parameters), B zero. */
static void lora_init_values(const rf_lora_opts *o, const rf_param_view *v, int n, size_t base, float *host) {
    rf_rng rng;
    rf_rng_seed(&rng, o->seed);
    for (int i = 0; i < n; i += 2) {
        float *a = host + (v[i].offset - base);
        double bound = 1.0 / sqrt((double)v[i].shape[1]);
        for (size_t j = 0; j < v[i].numel; j++)
            a[j] = o->init == RF_LORA_INIT_GAUSSIAN ? rf_rng_normal(&rng) / (float)o->rank
                                                    : (float)((2.0 * rf_rng_uniform(&rng) - 1.0) * bound);
    }
}

/* Points each layer's lora_a / lora_b at its views. */
static void bind_lora(rf_model *m) {
    int i = 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++)
        for (int t = 0; t < RF_LORA_N; t++) {
            int on = (m->lora.targets >> t) & 1;
            m->layers[l].lora_a[t] = on ? m->params + m->lora.views[i].offset : NULL;
            m->layers[l].lora_b[t] = on ? m->params + m->lora.views[i + 1].offset : NULL;
            i += on ? 2 : 0;
        }
}

rf_status rf_lora_whole(const rf_lora_opts *o, const rf_model_config *cfg, rf_param_view **views, int *n,
                        float **init) {
    *views = NULL, *init = NULL, *n = 0;
    RF_TRY(rf_lora_check(o, cfg));
    size_t count = rf_lora_param_count(o, cfg);
    *views = lora_views(o, cfg, 0, n);
    *init = calloc(count ? count : 1, sizeof(float));
    if (!*views || !*init) {
        free(*views), free(*init);
        *views = NULL, *init = NULL;
        return rf_error(RF_ERR_NOMEM, "LoRA: out of memory for %zu adapter parameters", count);
    }
    lora_init_values(o, *views, *n, 0, *init);
    return RF_OK;
}

rf_status rf_model_lora_attach(rf_model *m, const rf_lora_opts *o) {
    RF_TRY(rf_lora_check(o, &m->cfg));
    if (m->lora.rank || m->grads || m->opt_m || m->params_shared)
        return rf_error(RF_ERR_ARG, "LoRA: adapters go on a model that owns its parameters, has none "
                        "yet and is not training yet");
    const rf_kernels *k = m->k;
    size_t base = m->n_params, n_lora = rf_lora_param_count(o, &m->cfg);
    int n_views = 0;
    rf_param_view *views = lora_views(o, &m->cfg, base, &n_views);
    float *host = malloc(sizeof(float) * (n_lora ? n_lora : 1));
    float *now = k->alloc((base + n_lora) * sizeof(float));
    if (!views || !host || !now) {
        free(views), free(host), k->free(now);
        return rf_error(RF_ERR_NOMEM, "LoRA: out of memory for %zu adapter parameters", n_lora);
    }
    memset(host, 0, sizeof(float) * n_lora);
    lora_init_values(o, views, n_views, base, host);
    k->copy(now, m->params, base * sizeof(float));
    k->to_device(now + base, host, n_lora * sizeof(float));
    free(host);
    float *old = m->params;
    rf__model_rebase(m, old, now);
    m->params = now;
    k->free(old);
    m->n_frozen = base;
    m->n_params = base + n_lora;
    m->lora = (rf_lora){o->rank, o->alpha, o->alpha / (float)o->rank, o->targets, views, n_views};
    bind_lora(m);
    rf_model_trim(m); /* the activation buffers grow by the adapters' products */
    k->weights_updated();
    return RF_OK;
}

rf_status rf_model_lora_bind(rf_model *m, const rf_lora_opts *o) {
    RF_TRY(rf_lora_check(o, &m->cfg));
    if (m->lora.rank || m->grads || m->params_shared != 2)
        return rf_error(RF_ERR_ARG, "LoRA: adapters are bound over a borrowed buffer, on a model without any that is "
                        "not training");
    int n_views = 0;
    rf_param_view *views = lora_views(o, &m->cfg, m->n_params, &n_views);
    if (!views) return rf_error(RF_ERR_NOMEM, "LoRA: out of memory for the adapters' table");
    m->n_frozen = m->n_params;
    m->n_params += rf_lora_param_count(o, &m->cfg);
    m->lora = (rf_lora){o->rank, o->alpha, o->alpha / (float)o->rank, o->targets, views, n_views};
    bind_lora(m);
    rf_model_trim(m);
    m->k->weights_updated();
    return RF_OK;
}

const rf_param_view *rf_model_train_views(const rf_model *m, int *n_views) {
    *n_views = m->lora.rank ? m->lora.n_views : m->n_views;
    return m->lora.rank ? m->lora.views : m->views;
}

rf_status rf_lora_table(const rf_model *m, rf_param_view **views, int *n) {
    *views = NULL, *n = 0;
    if (!m->lora.rank) return rf_error(RF_ERR_ARG, "LoRA: the model has no adapters");
    rf_param_view *v = malloc(sizeof *v * (size_t)m->lora.n_views);
    if (!v) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < m->lora.n_views; i++) v[i] = m->lora.views[i], v[i].offset -= m->n_frozen;
    *views = v, *n = m->lora.n_views;
    return RF_OK;
}
