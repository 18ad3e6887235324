/* LoRA adapters in Hugging Face PEFT's layout (adapter_config.json, adapter_model.safetensors)
 * and merging them into the base weights (model/lora.h). Format: peft's LoraConfig and
 * save_pretrained (tensor names "base_model.model.<module>.lora_A.weight", adapter name
 * dropped). */
#include <cjson/cJSON.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/lora.h"
#include "model/model_internal.h"
#include "model/safetensors.h"

#define PEFT_PREFIX "base_model.model."

static rf_status write_config(const rf_lora *l, const char *dir, const char *base) {
    cJSON *j = cJSON_CreateObject(), *t = cJSON_CreateArray();
    for (int i = 0; i < RF_LORA_N; i++)
        if (l->targets & (1u << i)) cJSON_AddItemToArray(t, cJSON_CreateString(rf_lora_module_name(i)));
    cJSON_AddStringToObject(j, "base_model_name_or_path", base ? base : "");
    cJSON_AddStringToObject(j, "bias", "none");
    cJSON_AddBoolToObject(j, "fan_in_fan_out", 0);
    cJSON_AddBoolToObject(j, "inference_mode", 1);
    cJSON_AddNumberToObject(j, "lora_alpha", l->alpha);
    cJSON_AddNumberToObject(j, "lora_dropout", 0.0);
    cJSON_AddStringToObject(j, "peft_type", "LORA");
    cJSON_AddNumberToObject(j, "r", l->rank);
    cJSON_AddItemToObject(j, "target_modules", t);
    cJSON_AddStringToObject(j, "task_type", "CAUSAL_LM");
    cJSON_AddBoolToObject(j, "use_rslora", 0);
    char *text = cJSON_Print(j), p[4096];
    cJSON_Delete(j);
    rf_path_join(p, sizeof p, dir, "adapter_config.json");
    rf_status s = text ? rf_write_file_atomic(p, text, strlen(text)) : rf_error(RF_ERR_NOMEM, "out of memory");
    free(text);
    return s;
}

rf_status rf_lora_save_peft_fill(const rf_lora *l, const rf_param_view *views, int n, const char *dir,
                                 const char *base, rf_st_fill_fn fill, void *ctx) {
    if (!l || !l->rank) return rf_error(RF_ERR_ARG, "%s: the model has no LoRA adapters to save", dir);
    rf_st_entry *e = calloc((size_t)n + 1, sizeof *e);
    char (*names)[RF_MAX_NAME + 32] = calloc((size_t)n + 1, sizeof *names);
    rf_status s = e && names ? rf_mkdirs(dir) : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; s == RF_OK && i < n; i++) {
        const rf_param_view *v = &views[i];
        snprintf(names[i], sizeof names[i], PEFT_PREFIX "%s", v->name);
        e[i] = (rf_st_entry){names[i], NULL, 2, {v->shape[0], v->shape[1]}};
    }
    /* the writer names its file model.safetensors: write into a scratch directory and move it */
    char tmp[4200], from[4300], to[4300];
    snprintf(tmp, sizeof tmp, "%s/.adapter.tmp", dir);
    if (s == RF_OK) s = rf_st_write_dir_fill(tmp, e, n, RF_DTYPE_F32, 0, fill, ctx);
    snprintf(from, sizeof from, "%s/model.safetensors", tmp);
    rf_path_join(to, sizeof to, dir, "adapter_model.safetensors");
    if (s == RF_OK && rename(from, to) != 0) s = rf_error(RF_ERR_IO, "%s: cannot move %s into place", to, from);
    if (s == RF_OK) s = rf_remove_tree(tmp);
    if (s == RF_OK) s = write_config(l, dir, base);
    free(e), free(names);
    return s;
}

/* An adapter of a whole model, copied to the host as the writer reaches it. */
static rf_status fill_adapter(void *ctx, int i, float *dst) {
    const rf_model *m = ctx;
    const rf_param_view *v = &m->lora.views[i];
    m->k->to_host(dst, m->params + v->offset, v->numel * sizeof(float));
    return RF_OK;
}

rf_status rf_lora_save_peft(const rf_model *m, const char *dir, const char *base) {
    if (!m->lora.rank) return rf_error(RF_ERR_ARG, "%s: the model has no LoRA adapters to save", dir);
    return rf_lora_save_peft_fill(&m->lora, m->lora.views, m->lora.n_views, dir, base, fill_adapter, (void *)m);
}

/* Refuses a field of the config whose value rlflow would silently not honour: anything but
 * absent, null, false, {} or []. */
static rf_status refuse_field(const cJSON *j, const char *path, const char *field) {
    const cJSON *it = cJSON_GetObjectItem(j, field);
    if (!it || cJSON_IsNull(it) || cJSON_IsFalse(it)) return RF_OK;
    if ((cJSON_IsObject(it) || cJSON_IsArray(it)) && !it->child) return RF_OK;
    return rf_error(RF_ERR_UNSUPPORTED, "%s: \"%s\" is set; rlflow's LoRA does not implement it", path, field);
}

/* target_modules: a list of module names (a string is PEFT's regex form, refused). */
static rf_status read_targets(const cJSON *j, const char *path, unsigned *targets) {
    const cJSON *t = cJSON_GetObjectItem(j, "target_modules");
    if (!cJSON_IsArray(t))
        return rf_error(RF_ERR_UNSUPPORTED, "%s: \"target_modules\" must be a list of module names "
                        "(a regex string is not implemented)", path);
    *targets = 0;
    for (const cJSON *it = t->child; it; it = it->next) {
        int k = 0;
        while (k < RF_LORA_N && !(cJSON_IsString(it) && strcmp(it->valuestring, rf_lora_module_name(k)) == 0)) k++;
        if (k == RF_LORA_N)
            return rf_error(RF_ERR_UNSUPPORTED, "%s: target_modules: \"%s\" is not one of q_proj, k_proj, v_proj, "
                            "o_proj, gate_proj, up_proj, down_proj", path, cJSON_IsString(it) ? it->valuestring : "?");
        *targets |= 1u << k;
    }
    return *targets ? RF_OK : rf_error(RF_ERR_FORMAT, "%s: \"target_modules\" is empty", path);
}

/* init_lora_weights: PEFT's initialisations that leave the base weights as they are (true,
 * false, "gaussian", "eva", "orthogonal"); the others (pissa, olora, corda, loftq, lora_ga)
 * change the base, so the adapter does not fit the original base unless PEFT converted it on
 * saving (which writes true). */
static rf_status check_init(const cJSON *j, const char *path) {
    const cJSON *it = cJSON_GetObjectItem(j, "init_lora_weights");
    if (!it || cJSON_IsNull(it) || cJSON_IsBool(it)) return RF_OK;
    static const char *const ok[] = {"gaussian", "eva", "orthogonal"};
    for (size_t i = 0; cJSON_IsString(it) && i < sizeof ok / sizeof ok[0]; i++)
        if (strcmp(it->valuestring, ok[i]) == 0) return RF_OK;
    return rf_error(RF_ERR_UNSUPPORTED, "%s: \"init_lora_weights\" = \"%s\" is not implemented (an initialisation "
                    "that changes the base weights: save the adapter converted for the original base, PEFT's "
                    "path_initial_model_for_weight_conversion)", path, cJSON_IsString(it) ? it->valuestring : "?");
}

/* Fields of adapter_config.json read above or that do not change the adapted model once
 * trained (ensure_weight_tying ties adapters of tied embeddings, which only modules_to_save,
 * trainable_token_indices or an embedding target add: all refused); every other field (PEFT's variants: lora_bias, use_qalora, exclude_modules,
 * target_parameters, trainable_token_indices, alora_invocation_tokens, arrow_config, ...,
 * and those a later PEFT adds) is refused when set rather than ignored. */
static int known_field(const char *name) {
    static const char *const known[] = {"peft_type", "r", "lora_alpha", "bias", "target_modules", "init_lora_weights",
                                        "base_model_name_or_path", "revision", "task_type", "inference_mode",
                                        "lora_dropout", "peft_version", "auto_mapping", "megatron_core",
                                        "qalora_group_size", "layers_pattern", "ensure_weight_tying", "eva_config"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(name, known[i]) == 0) return 1;
    return 0;
}

static rf_status parse_config(const cJSON *j, const char *path, rf_lora_opts *o) {
    const cJSON *type = cJSON_GetObjectItem(j, "peft_type"), *r = cJSON_GetObjectItem(j, "r"),
                *alpha = cJSON_GetObjectItem(j, "lora_alpha"), *bias = cJSON_GetObjectItem(j, "bias");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "LORA") != 0)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: \"peft_type\" must be \"LORA\"", path);
    /* range first: converting a double outside int's (or float's) range is undefined */
    if (!cJSON_IsNumber(r) || !(r->valuedouble >= 1 && r->valuedouble <= INT_MAX) ||
        r->valuedouble != floor(r->valuedouble))
        return rf_error(RF_ERR_FORMAT, "%s: \"r\" must be an integer in 1..%d", path, INT_MAX);
    if (!cJSON_IsNumber(alpha) || !(alpha->valuedouble > 0 && alpha->valuedouble <= FLT_MAX))
        return rf_error(RF_ERR_FORMAT, "%s: \"lora_alpha\" must be a finite number > 0", path);
    if (bias && !(cJSON_IsString(bias) && strcmp(bias->valuestring, "none") == 0))
        return rf_error(RF_ERR_UNSUPPORTED, "%s: \"bias\" must be \"none\" (trained biases are not implemented)", path);
    static const char *const refused[] = {"use_rslora", "fan_in_fan_out", "modules_to_save", "layers_to_transform",
                                          "rank_pattern", "alpha_pattern", "use_dora", "layer_replication"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) RF_TRY(refuse_field(j, path, refused[i]));
    for (const cJSON *it = j->child; it; it = it->next)
        if (!known_field(it->string)) RF_TRY(refuse_field(j, path, it->string));
    RF_TRY(check_init(j, path));
    *o = (rf_lora_opts){r->valueint, (float)alpha->valuedouble, 0.0f, 0, RF_LORA_INIT_GAUSSIAN, 0};
    return read_targets(j, path, &o->targets);
}

rf_status rf_lora_read_peft_config(const char *dir, rf_lora_opts *o) {
    char path[4096], *text = NULL;
    rf_path_join(path, sizeof path, dir, "adapter_config.json");
    RF_TRY(rf_read_file(path, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j) return rf_error(RF_ERR_FORMAT, "%s: not valid JSON", path);
    rf_status s = cJSON_IsObject(j) ? parse_config(j, path, o) : rf_error(RF_ERR_FORMAT, "%s: not a JSON object", path);
    cJSON_Delete(j);
    return s;
}

/* Every tensor of st must be one of m's adapters (PEFT name), and every adapter present. */
static rf_status read_tensors(rf_model *m, const rf_safetensors *st, const char *path, float *host) {
    for (int i = 0; i < rf_st_count(st); i++) {
        const char *name = rf_st_at(st, i)->name;
        int found = 0;
        for (int v = 0; v < m->lora.n_views && !found; v++)
            found = strncmp(name, PEFT_PREFIX, strlen(PEFT_PREFIX)) == 0 &&
                    strcmp(name + strlen(PEFT_PREFIX), m->lora.views[v].name) == 0;
        if (!found)
            return rf_error(RF_ERR_UNSUPPORTED, "%s: tensor \"%s\" is not an adapter of this model and "
                            "adapter_config.json; refusing to ignore it", path, name);
    }
    for (int v = 0; v < m->lora.n_views; v++) {
        const rf_param_view *pv = &m->lora.views[v];
        char name[RF_MAX_NAME + 32];
        snprintf(name, sizeof name, PEFT_PREFIX "%s", pv->name);
        RF_TRY(rf_st_read_f32(st, name, host + (pv->offset - m->n_frozen), pv->shape, pv->ndim));
    }
    return RF_OK;
}

rf_status rf_lora_load_peft(rf_model *m, const char *dir) {
    rf_lora_opts o;
    RF_TRY(rf_lora_read_peft_config(dir, &o));
    char path[4096];
    rf_path_join(path, sizeof path, dir, "adapter_model.safetensors");
    rf_safetensors *st = NULL;
    RF_TRY(rf_st_open_file(&st, path));
    rf_status s = rf_model_lora_attach(m, &o);
    float *host = NULL;
    size_t n = m->n_params - m->n_frozen;
    if (s == RF_OK) s = rf__host_staging(m->k, m->params + m->n_frozen, n, &host, path);
    if (s == RF_OK) s = read_tensors(m, st, path, host);
    if (host) rf__host_staging_done(m->k, m->params + m->n_frozen, n, host, s == RF_OK);
    rf_st_close(st);
    return s;
}

/* W (out, in) += scale * B (out, r) A (r, in), in double, host arrays. */
static void merge_one(float *W, const float *A, const float *B, int in, int out, int r, double scale) {
    for (int o = 0; o < out; o++)
        for (int i = 0; i < in; i++) {
            double s = 0;
            for (int j = 0; j < r; j++) s += (double)B[(size_t)o * r + j] * A[(size_t)j * in + i];
            W[(size_t)o * in + i] = (float)(W[(size_t)o * in + i] + scale * s);
        }
}

rf_status rf_lora_merge(rf_model *m) {
    if (!m->lora.rank) return RF_OK;
    if (m->grads) return rf_error(RF_ERR_ARG, "LoRA: merging the adapters of a model that is training");
    float *host = malloc(sizeof(float) * m->n_params);
    if (!host) return rf_error(RF_ERR_NOMEM, "LoRA merge: out of memory for %zu parameters", m->n_params);
    m->k->to_host(host, m->params, sizeof(float) * m->n_params);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        rf_layer_weights *w = &m->layers[l];
        float *W[RF_LORA_N] = {w->wq, w->wk, w->wv, w->wo, w->wgate, w->wup, w->wdown};
        for (int t = 0; t < RF_LORA_N; t++) {
            if (!w->lora_a[t]) continue;
            int in, out;
            rf_lora_target_dims(&m->cfg, t, &in, &out);
            merge_one(host + (W[t] - m->params), host + (w->lora_a[t] - m->params), host + (w->lora_b[t] - m->params),
                      in, out, m->lora.rank, (double)m->lora.scale);
            w->lora_a[t] = w->lora_b[t] = NULL;
        }
    }
    m->k->to_device(m->params, host, sizeof(float) * m->n_frozen);
    free(host);
    free(m->lora.views);
    m->n_params = m->n_frozen, m->n_frozen = 0;
    memset(&m->lora, 0, sizeof m->lora);
    rf_model_trim(m);
    m->k->weights_updated();
    return RF_OK;
}
