/* Loading and saving models in Hugging Face layout: config.json + safetensors (single file or
 * sharded with model.safetensors.index.json). Tensors are read by their HF names through the
 * parameter table, converted to fp32 and copied to the model's back end. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/model_internal.h"
#include "model/safetensors.h"

rf_status rf__host_staging(const rf_kernels *k, float *dst, size_t n, float **host, const char *what) {
    *host = strcmp(k->name, "cpu") == 0 ? dst : calloc(n ? n : 1, sizeof(float));
    return *host ? RF_OK : rf_error(RF_ERR_NOMEM, "%s: out of memory for %zu parameters", what, n);
}

void rf__host_staging_done(const rf_kernels *k, float *dst, size_t n, float *host, int ok) {
    if (host != dst && ok && host) k->to_device(dst, host, n * sizeof(float));
    if (ok) k->weights_updated(); /* dst was written (in place when host == dst) */
    if (host != dst) free(host);
}

/* Reads every parameter view from st into the host staging buffer. */
static rf_status read_params(const rf_model *m, const rf_safetensors *st, float *host,
                             const char *dir) {
    for (int i = 0; i < m->n_views; i++) {
        const rf_param_view *v = &m->views[i];
        if (strcmp(v->name, "score.weight") == 0 && !rf_st_find(st, v->name)) {
            rf_log_info("%s: no score.weight; the value head starts at zero", dir);
            continue;
        }
        RF_TRY(rf_st_read_f32(st, v->name, host + v->offset, v->shape, v->ndim));
    }
    return RF_OK;
}

rf_status rf_model_check_unused(const rf_model *m, const rf_safetensors *st, const char *dir) {
    for (int i = 0; i < rf_st_count(st); i++) {
        const rf_st_tensor *t = rf_st_at(st, i);
        if (rf_model_find(m, t->name)) continue;
        if (strcmp(t->name, "lm_head.weight") == 0 && (m->cfg.tie_word_embeddings || m->score))
            continue;
        if (strstr(t->name, "rotary_emb.inv_freq")) continue; /* buffer saved by old checkpoints */
        return rf_error(RF_ERR_UNSUPPORTED, "%s: tensor \"%s\" (in %s) is not part of a %s model "
                        "with this config; refusing to ignore it", dir, t->name, t->file,
                        m->cfg.model_type);
    }
    return RF_OK;
}

/* Why a frozen load of checkpoint st cannot keep m's matrices in bf16, written into why (n
 * bytes): 0 when it can, 1 for the usual reasons (fp32 precision, a checkpoint not in BF16),
 * 2 when a BF16 checkpoint at bf16 precision still loads as fp32 (worth a log line). */
static int frozen_obstacle(const rf_model *m, const rf_safetensors *st, char *why, size_t n) {
    if (m->k->get_precision() != RF_PRECISION_BF16) {
        snprintf(why, n, "the precision is fp32");
        return 1;
    }
    for (int i = 0; i < m->n_views; i++) {
        const rf_st_tensor *t = m->views[i].ndim == 2 ? rf_st_find(st, m->views[i].name) : NULL;
        if (t && t->dtype != RF_DTYPE_BF16) {
            snprintf(why, n, "tensor \"%s\" is stored as %s, not BF16", t->name, rf_dtype_name(t->dtype));
            return 1;
        }
    }
    if (!m->k->bind_bf16 || strcmp(m->k->name, "cpu") != 0) {
        snprintf(why, n, "the %s back end does not read bf16 weights in place yet", m->k->name);
        return 2;
    }
    return 0;
}

/* Reads a frozen bf16 model's tensors: matrices as stored into m->wbf16, the 1-D ones into
 * m->params as fp32 (host memory: CPU back end), then binds the bf16 values to the params. */
static rf_status read_params_frozen(rf_model *m, const rf_safetensors *st, const char *dir) {
    m->wbf16 = m->k->alloc(m->n_params * sizeof(uint16_t));
    if (!m->wbf16)
        return rf_error(RF_ERR_NOMEM, "%s: out of memory for %zu bf16 weights", dir, m->n_params);
    for (int i = 0; i < m->n_views; i++) {
        const rf_param_view *v = &m->views[i];
        if (strcmp(v->name, "score.weight") == 0 && !rf_st_find(st, v->name)) {
            rf_log_info("%s: no score.weight; the value head starts at zero", dir);
            continue;
        }
        if (v->ndim == 2) RF_TRY(rf_st_read_bf16(st, v->name, m->wbf16 + v->offset, v->shape, v->ndim));
        else RF_TRY(rf_st_read_f32(st, v->name, m->params + v->offset, v->shape, v->ndim));
    }
    RF_TRY(m->k->bind_bf16(m->params, m->wbf16, m->n_params));
    rf_log_info("%s: frozen weights kept in bf16 as stored (%.1f MB, no fp32 copy)", dir,
                (double)(m->n_params * sizeof(uint16_t)) / (1 << 20));
    return RF_OK;
}

/* rf_model_load (frozen = 0) and rf_model_load_frozen (1). */
static rf_status model_load(rf_model **out, const char *dir, const rf_kernels *k, int value_head, int frozen) {
    *out = NULL;
    char path[4096], why[256];
    rf_model_config cfg;
    rf_path_join(path, sizeof path, dir, "config.json");
    RF_TRY(rf_config_load(&cfg, path));
    if (value_head) cfg.value_head = 1;
    rf_safetensors *st = NULL;
    RF_TRY(rf_st_open_dir(&st, dir));
    rf_model *m = NULL;
    float *host = NULL;
    rf_status s = rf_model_init(&m, &cfg, k);
    if (s == RF_OK) s = rf_model_check_unused(m, st, dir);
    int obstacle = s == RF_OK && frozen ? frozen_obstacle(m, st, why, sizeof why) : 1;
    if (s == RF_OK && !obstacle) {
        s = read_params_frozen(m, st, dir);
    } else if (s == RF_OK) {
        if (obstacle == 2) rf_log_info("%s: weights loaded as fp32: %s", dir, why);
        s = rf__host_staging(k, m->params, m->n_params, &host, dir);
        if (s == RF_OK) s = read_params(m, st, host, dir);
        rf__host_staging_done(k, m->params, m->n_params, host, s == RF_OK);
    }
    rf_st_close(st);
    if (s != RF_OK) {
        rf_model_free(m);
        return s;
    }
    *out = m;
    return RF_OK;
}

rf_status rf_model_load(rf_model **out, const char *dir, const rf_kernels *k, int value_head) {
    return model_load(out, dir, k, value_head, 0);
}

rf_status rf_model_load_frozen(rf_model **out, const char *dir, const rf_kernels *k, int value_head) {
    return model_load(out, dir, k, value_head, 1);
}

/* The error of an operation a model with bf16-resident weights cannot do (what: the
 * operation): a frozen one, or one kept in bf16 for generation. */
rf_status rf__model_frozen_refuse(const rf_model *m, const char *what) {
    if (m->bf16_store)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: the model keeps its matrices in bf16 only, for generation "
                        "(rf_model_keep_bf16: a rollout worker's weights, written with each version)", what);
    return rf_error(RF_ERR_UNSUPPORTED, "%s: the model was loaded frozen with its weights in bf16 "
                    "(rf_model_load_frozen), which never change", what);
}

rf_status rf_model_load_params(rf_model *m, const char *dir, float *dst, const char *suffix) {
    if (m->wbf16) return rf__model_frozen_refuse(m, dir);
    rf_safetensors *st = NULL;
    RF_TRY(rf_st_open_dir(&st, dir));
    /* the trained floats [lo, n_params): all, or the adapters after the frozen base (LoRA);
     * moments hold those floats only */
    size_t lo = m->n_frozen, n = m->n_params - lo;
    float *host = NULL, *to = dst ? dst : m->params + lo;
    int n_views;
    const rf_param_view *views = rf_model_train_views(m, &n_views);
    rf_status s = rf__host_staging(m->k, to, n, &host, dir);
    for (int i = 0; s == RF_OK && i < n_views; i++) {
        const rf_param_view *v = &views[i];
        char name[RF_MAX_NAME + 32];
        snprintf(name, sizeof name, "%s%s", v->name, suffix ? suffix : "");
        s = rf_st_read_f32(st, name, host + (v->offset - lo), v->shape, v->ndim);
    }
    rf__host_staging_done(m->k, to, n, host, s == RF_OK);
    rf_st_close(st);
    return s;
}

rf_status rf_model_save_views(const rf_param_view *views, int n_views, const char *dir, const char *suffix, int bf16,
                              size_t max_shard_bytes, rf_st_fill_fn fill, void *ctx) {
    rf_st_entry *e = calloc((size_t)n_views + 1, sizeof *e);
    char (*names)[RF_MAX_NAME + 32] = calloc((size_t)n_views + 1, sizeof *names);
    rf_status s = e && names ? rf_mkdirs(dir) : rf_error(RF_ERR_NOMEM, "out of memory saving %s", dir);
    for (int i = 0; s == RF_OK && i < n_views; i++) {
        const rf_param_view *v = &views[i];
        snprintf(names[i], sizeof names[i], "%s%s", v->name, suffix ? suffix : "");
        e[i].name = names[i];
        e[i].ndim = v->ndim;
        e[i].shape[0] = v->shape[0];
        e[i].shape[1] = v->shape[1];
    }
    if (s == RF_OK)
        s = rf_st_write_dir_fill(dir, e, n_views, bf16 ? RF_DTYPE_BF16 : RF_DTYPE_F32, max_shard_bytes, fill, ctx);
    free(e), free(names);
    return s;
}

/* A view of a back-end buffer, copied to the host as the writer reaches it. */
typedef struct buffer_src {
    const rf_model *m;
    const float *src; /* (n_params) on the back end */
} buffer_src;

static rf_status fill_from_buffer(void *ctx, int i, float *dst) {
    const buffer_src *b = ctx;
    const rf_param_view *v = &b->m->views[i];
    if (b->m->wbf16 && v->ndim == 2 && v->offset >= b->m->bf16_lo) /* a bf16-kept matrix (host memory): widened */
        rf_dtype_to_f32(dst, b->m->wbf16 + v->offset, RF_DTYPE_BF16, v->numel);
    else
        b->m->k->to_host(dst, b->src + v->offset, v->numel * sizeof(float));
    return RF_OK;
}

rf_status rf_model_save_config(const rf_model_config *cfg, const char *dir, int bf16) {
    RF_TRY(rf_mkdirs(dir));
    char path[4096];
    char *json = rf_config_to_json(cfg, bf16);
    if (!json) return rf_error(RF_ERR_NOMEM, "out of memory serialising config");
    rf_path_join(path, sizeof path, dir, "config.json");
    rf_status s = rf_write_file_atomic(path, json, strlen(json));
    free(json);
    return s;
}

rf_status rf_model_save(const rf_model *m, const char *dir, int bf16, size_t max_shard_bytes) {
    RF_TRY(rf_model_save_config(&m->cfg, dir, bf16));
    buffer_src b = {m, m->params};
    return rf_model_save_views(m->views, m->n_views, dir, NULL, bf16, max_shard_bytes, fill_from_buffer, &b);
}
