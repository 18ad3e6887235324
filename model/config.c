#include "model/config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/util.h"

/* Reads integer field `key`; when absent uses `def` (def < -1 means required). */
static rf_status get_int(const cJSON *root, const char *key, int def, int *out,
                         const char *origin) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) {
        if (def < -1) return rf_error(RF_ERR_FORMAT, "%s: missing required field \"%s\"", origin, key);
        *out = def;
        return RF_OK;
    }
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) ||
        fabs(it->valuedouble) > 2147483647.0)
        return rf_error(RF_ERR_FORMAT, "%s: field \"%s\" must be an integer", origin, key);
    *out = (int)it->valuedouble;
    return RF_OK;
}

static rf_status get_float(const cJSON *root, const char *key, float def, float *out,
                           const char *origin) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) {
        *out = def;
        return RF_OK;
    }
    if (!cJSON_IsNumber(it))
        return rf_error(RF_ERR_FORMAT, "%s: field \"%s\" must be a number", origin, key);
    *out = (float)it->valuedouble;
    return RF_OK;
}

static rf_status get_bool(const cJSON *root, const char *key, int def, int *out,
                          const char *origin) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) {
        *out = def;
        return RF_OK;
    }
    if (!cJSON_IsBool(it))
        return rf_error(RF_ERR_FORMAT, "%s: field \"%s\" must be true or false", origin, key);
    *out = cJSON_IsTrue(it);
    return RF_OK;
}

static rf_status parse_arch(rf_model_config *c, const cJSON *root, const char *origin) {
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt))
        return rf_error(RF_ERR_FORMAT, "%s: missing string field \"model_type\"", origin);
    snprintf(c->model_type, sizeof c->model_type, "%s", mt->valuestring);
    static const struct { const char *name; rf_arch arch; } known[] = {
        {"llama", RF_ARCH_LLAMA}, {"qwen2", RF_ARCH_QWEN2},
        {"qwen3", RF_ARCH_QWEN3}, {"mistral", RF_ARCH_MISTRAL}};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(mt->valuestring, known[i].name) == 0) {
            c->arch = known[i].arch;
            return RF_OK;
        }
    return rf_error(RF_ERR_UNSUPPORTED,
                    "%s: model_type \"%s\" is not supported (supported: llama, qwen2, qwen3, "
                    "mistral)", origin, mt->valuestring);
}

/* Fields that would change the math in ways rlflow does not implement. */
static rf_status refuse_unsupported(const cJSON *root, const char *origin) {
    static const char *moe[] = {"num_experts", "num_local_experts", "n_routed_experts",
                                "num_experts_per_tok"};
    for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, moe[i]);
        if (it && cJSON_IsNumber(it) && it->valuedouble > 0)
            return rf_error(RF_ERR_UNSUPPORTED, "%s: \"%s\": mixture-of-experts models are not "
                            "supported", origin, moe[i]);
    }
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0))
        return rf_error(RF_ERR_UNSUPPORTED, "%s: \"hidden_act\" must be \"silu\" (SwiGLU)", origin);
    const cJSON *mlp_bias = cJSON_GetObjectItemCaseSensitive(root, "mlp_bias");
    if (cJSON_IsTrue(mlp_bias))
        return rf_error(RF_ERR_UNSUPPORTED, "%s: \"mlp_bias\" = true is not supported", origin);
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "pretraining_tp");
    if (pt && cJSON_IsNumber(pt) && pt->valuedouble > 1)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: \"pretraining_tp\" > 1 is not supported", origin);
    return RF_OK;
}

/* RoPE parameters come in two spellings: transformers < 5 writes "rope_theta" and
 * "rope_scaling" ({"rope_type"|"type": ..., "factor": ...}); transformers >= 5 writes one
 * "rope_parameters" object holding rope_theta, rope_type and the scaling fields. */
static rf_status parse_rope_object(rf_model_config *c, const cJSON *rs, const char *field,
                                   const char *origin) {
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
    if (!ty) ty = cJSON_GetObjectItemCaseSensitive(rs, "type");
    if (!cJSON_IsString(ty))
        return rf_error(RF_ERR_FORMAT, "%s: \"%s.rope_type\" missing (a per-layer-type "
                        "rope_parameters map is not supported)", origin, field);
    const char *t = ty->valuestring;
    if (strcmp(t, "default") == 0) return RF_OK;
    RF_TRY(get_float(rs, "factor", 1.0f, &c->rope_factor, origin));
    if (c->rope_factor <= 0)
        return rf_error(RF_ERR_FORMAT, "%s: \"%s.factor\" must be positive", origin, field);
    if (strcmp(t, "linear") == 0) {
        c->rope_scaling_type = 1;
        return RF_OK;
    }
    if (strcmp(t, "llama3") == 0) {
        c->rope_scaling_type = 2;
        RF_TRY(get_float(rs, "low_freq_factor", 1.0f, &c->rope_low_freq_factor, origin));
        RF_TRY(get_float(rs, "high_freq_factor", 4.0f, &c->rope_high_freq_factor, origin));
        RF_TRY(get_int(rs, "original_max_position_embeddings", 8192, &c->rope_original_max_pos,
                       origin));
        if (c->rope_high_freq_factor <= c->rope_low_freq_factor)
            return rf_error(RF_ERR_FORMAT, "%s: %s.high_freq_factor must exceed "
                            "low_freq_factor", origin, field);
        return RF_OK;
    }
    return rf_error(RF_ERR_UNSUPPORTED, "%s: \"%s.rope_type\" \"%s\" is not supported "
                    "(supported: default, linear, llama3)", origin, field, t);
}

static rf_status parse_rope(rf_model_config *c, const cJSON *root, const char *origin) {
    c->rope_scaling_type = 0;
    RF_TRY(get_float(root, "rope_theta", 10000.0f, &c->rope_theta, origin));
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (rp && !cJSON_IsNull(rp)) {
        if (!cJSON_IsObject(rp))
            return rf_error(RF_ERR_FORMAT, "%s: \"rope_parameters\" must be an object", origin);
        RF_TRY(get_float(rp, "rope_theta", c->rope_theta, &c->rope_theta, origin));
        return parse_rope_object(c, rp, "rope_parameters", origin);
    }
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (!rs || cJSON_IsNull(rs)) return RF_OK;
    if (!cJSON_IsObject(rs))
        return rf_error(RF_ERR_FORMAT, "%s: \"rope_scaling\" must be an object or null", origin);
    return parse_rope_object(c, rs, "rope_scaling", origin);
}

/* transformers >= 5 lists each layer's attention kind; only full attention is implemented. */
static rf_status check_layer_types(const rf_model_config *c, const cJSON *root, const char *origin) {
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types"), *it;
    if (!lt || cJSON_IsNull(lt)) return RF_OK;
    if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != c->num_hidden_layers)
        return rf_error(RF_ERR_FORMAT, "%s: \"layer_types\" must list num_hidden_layers (%d) "
                        "entries", origin, c->num_hidden_layers);
    int i = 0;
    cJSON_ArrayForEach(it, lt) {
        if (!cJSON_IsString(it) || strcmp(it->valuestring, "full_attention") != 0)
            return rf_error(RF_ERR_UNSUPPORTED, "%s: \"layer_types\"[%d] is \"%s\": only "
                            "full_attention is supported (sliding-window attention is not)",
                            origin, i, cJSON_IsString(it) ? it->valuestring : "?");
        i++;
    }
    return RF_OK;
}

static rf_status parse_sliding_window(rf_model_config *c, const cJSON *root, const char *origin) {
    int use = 1, sw = 0;
    /* Qwen2/3 carry a sliding_window value that only applies when use_sliding_window is set. */
    if (c->arch == RF_ARCH_QWEN2 || c->arch == RF_ARCH_QWEN3)
        RF_TRY(get_bool(root, "use_sliding_window", 0, &use, origin));
    if (!use) return RF_OK;
    RF_TRY(get_int(root, "sliding_window", 0, &sw, origin));
    if (sw < 0) return rf_error(RF_ERR_FORMAT, "%s: \"sliding_window\" must be >= 0", origin);
    if (sw > 0 && sw < c->max_position_embeddings) c->sliding_window = sw;
    if (use && (c->arch == RF_ARCH_QWEN2 || c->arch == RF_ARCH_QWEN3) && c->sliding_window)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: \"use_sliding_window\" = true: sliding-window "
                        "attention is not supported", origin);
    return RF_OK;
}

static rf_status parse_eos(rf_model_config *c, const cJSON *root, const char *origin) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
    c->n_eos = 0;
    if (!e || cJSON_IsNull(e)) return RF_OK;
    if (cJSON_IsNumber(e)) {
        c->eos_token_ids[c->n_eos++] = e->valueint;
        return RF_OK;
    }
    if (!cJSON_IsArray(e))
        return rf_error(RF_ERR_FORMAT, "%s: \"eos_token_id\" must be an integer or a list", origin);
    const cJSON *it;
    cJSON_ArrayForEach(it, e) {
        if (!cJSON_IsNumber(it))
            return rf_error(RF_ERR_FORMAT, "%s: \"eos_token_id\" entries must be integers", origin);
        if (c->n_eos < RF_MAX_EOS) c->eos_token_ids[c->n_eos++] = it->valueint;
    }
    return RF_OK;
}

static rf_status parse_value_head(rf_model_config *c, const cJSON *root, const char *origin) {
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(root, "architectures"), *it;
    c->value_head = 0;
    if (!cJSON_IsArray(archs)) return RF_OK;
    cJSON_ArrayForEach(it, archs) {
        if (!cJSON_IsString(it)) continue;
        if (strstr(it->valuestring, "ForSequenceClassification") ||
            strstr(it->valuestring, "ForTokenClassification")) {
            int labels = 1;
            const cJSON *id2label = cJSON_GetObjectItemCaseSensitive(root, "id2label");
            if (cJSON_IsObject(id2label)) labels = cJSON_GetArraySize(id2label);
            RF_TRY(get_int(root, "num_labels", labels, &labels, origin));
            if (labels != 1)
                return rf_error(RF_ERR_UNSUPPORTED, "%s: \"num_labels\" = %d: only a scalar head "
                                "(num_labels = 1) is supported", origin, labels);
            c->value_head = 1;
        }
    }
    return RF_OK;
}

static rf_status parse_shapes(rf_model_config *c, const cJSON *root, const char *origin) {
    RF_TRY(get_int(root, "hidden_size", -2, &c->hidden_size, origin));
    RF_TRY(get_int(root, "intermediate_size", -2, &c->intermediate_size, origin));
    RF_TRY(get_int(root, "num_hidden_layers", -2, &c->num_hidden_layers, origin));
    RF_TRY(get_int(root, "num_attention_heads", -2, &c->num_attention_heads, origin));
    RF_TRY(get_int(root, "num_key_value_heads", c->num_attention_heads, &c->num_key_value_heads,
                   origin));
    RF_TRY(get_int(root, "vocab_size", -2, &c->vocab_size, origin));
    if (c->hidden_size <= 0 || c->intermediate_size <= 0 || c->num_hidden_layers <= 0 ||
        c->num_attention_heads <= 0 || c->num_key_value_heads <= 0 || c->vocab_size <= 0)
        return rf_error(RF_ERR_FORMAT, "%s: sizes (hidden_size, intermediate_size, "
                        "num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size) "
                        "must be positive", origin);
    RF_TRY(get_int(root, "head_dim", c->hidden_size / c->num_attention_heads, &c->head_dim, origin));
    if (c->head_dim <= 0 || c->head_dim % 2)
        return rf_error(RF_ERR_FORMAT, "%s: \"head_dim\" must be positive and even", origin);
    if (c->num_attention_heads % c->num_key_value_heads)
        return rf_error(RF_ERR_FORMAT, "%s: \"num_attention_heads\" (%d) must be a multiple of "
                        "\"num_key_value_heads\" (%d)", origin, c->num_attention_heads,
                        c->num_key_value_heads);
    return RF_OK;
}

rf_status rf_config_parse(rf_model_config *c, const char *json, const char *origin) {
    memset(c, 0, sizeof *c);
    cJSON *root = cJSON_Parse(json);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return rf_error(RF_ERR_FORMAT, "%s: not a valid JSON object", origin);
    }
    rf_status s = RF_OK;
    int attention_bias = 0;
    if ((s = parse_arch(c, root, origin)) ||
        (s = refuse_unsupported(root, origin)) ||
        (s = parse_shapes(c, root, origin)) ||
        (s = get_float(root, "rms_norm_eps", 1e-6f, &c->rms_norm_eps, origin)) ||
        (s = get_int(root, "max_position_embeddings", 2048, &c->max_position_embeddings, origin)) ||
        (s = get_bool(root, "tie_word_embeddings", 0,
                      &c->tie_word_embeddings, origin)) ||
        (s = get_bool(root, "attention_bias", 0, &attention_bias, origin)) ||
        (s = get_int(root, "bos_token_id", -1, &c->bos_token_id, origin)) ||
        (s = parse_rope(c, root, origin)) ||
        (s = check_layer_types(c, root, origin)) ||
        (s = parse_sliding_window(c, root, origin)) ||
        (s = parse_eos(c, root, origin)) ||
        (s = parse_value_head(c, root, origin))) {
        cJSON_Delete(root);
        return s;
    }
    /* transformers: Qwen2 always has q/k/v bias and no o bias; Llama/Mistral/Qwen3 follow
     * attention_bias for q/k/v and o (Qwen3 and Mistral use it for q/k/v/o too). */
    c->qkv_bias = c->arch == RF_ARCH_QWEN2 ? 1 : attention_bias;
    c->o_bias = c->arch == RF_ARCH_QWEN2 ? 0 : attention_bias;
    c->qk_norm = c->arch == RF_ARCH_QWEN3;
    cJSON_Delete(root);
    return RF_OK;
}

rf_status rf_config_load(rf_model_config *cfg, const char *path) {
    char *text = NULL;
    RF_TRY(rf_read_file(path, &text, NULL));
    rf_status s = rf_config_parse(cfg, text, path);
    free(text);
    return s;
}

void rf_config_inv_freq(const rf_model_config *c, float *inv_freq) {
    int D = c->head_dim;
    for (int i = 0; i < D / 2; i++) {
        /* transformers computes base ** (arange(0, D, 2) / D) in float32 */
        float f = 1.0f / powf(c->rope_theta, (float)(2 * i) / (float)D);
        if (c->rope_scaling_type == 1) {
            f /= c->rope_factor;
        } else if (c->rope_scaling_type == 2) {
            /* Llama 3.1 frequency-dependent scaling (transformers _compute_llama3_parameters) */
            float old = (float)c->rope_original_max_pos;
            float low_wl = old / c->rope_low_freq_factor, high_wl = old / c->rope_high_freq_factor;
            float wl = 2.0f * (float)M_PI / f;
            if (wl > low_wl) {
                f = f / c->rope_factor;
            } else if (wl >= high_wl) {
                float smooth = (old / wl - c->rope_low_freq_factor) /
                               (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0f - smooth) * f / c->rope_factor + smooth * f;
            }
        }
        inv_freq[i] = f;
    }
}

int rf_config_max_seq(const rf_model_config *c) {
    int m = c->max_position_embeddings;
    return c->sliding_window > 0 && c->sliding_window < m ? c->sliding_window : m;
}

static const char *arch_class(const rf_model_config *c) {
    static const char *names[][2] = {{"LlamaForCausalLM", "LlamaForSequenceClassification"},
                                     {"Qwen2ForCausalLM", "Qwen2ForSequenceClassification"},
                                     {"Qwen3ForCausalLM", "Qwen3ForSequenceClassification"},
                                     {"MistralForCausalLM", "MistralForSequenceClassification"}};
    return names[c->arch][c->value_head ? 1 : 0];
}

char *rf_config_to_json(const rf_model_config *c, int bf16) {
    cJSON *r = cJSON_CreateObject();
    cJSON *archs = cJSON_AddArrayToObject(r, "architectures");
    cJSON_AddItemToArray(archs, cJSON_CreateString(arch_class(c)));
    cJSON_AddStringToObject(r, "model_type", c->model_type);
    cJSON_AddNumberToObject(r, "hidden_size", c->hidden_size);
    cJSON_AddNumberToObject(r, "intermediate_size", c->intermediate_size);
    cJSON_AddNumberToObject(r, "num_hidden_layers", c->num_hidden_layers);
    cJSON_AddNumberToObject(r, "num_attention_heads", c->num_attention_heads);
    cJSON_AddNumberToObject(r, "num_key_value_heads", c->num_key_value_heads);
    cJSON_AddNumberToObject(r, "head_dim", c->head_dim);
    cJSON_AddNumberToObject(r, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(r, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddNumberToObject(r, "rope_theta", c->rope_theta);
    cJSON_AddNumberToObject(r, "max_position_embeddings", c->max_position_embeddings);
    cJSON_AddBoolToObject(r, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddStringToObject(r, "hidden_act", "silu");
    if (c->arch != RF_ARCH_QWEN2) cJSON_AddBoolToObject(r, "attention_bias", c->qkv_bias);
    if (c->arch == RF_ARCH_QWEN2 || c->arch == RF_ARCH_QWEN3)
        cJSON_AddBoolToObject(r, "use_sliding_window", 0);
    if (c->rope_scaling_type) {
        cJSON *rs = cJSON_AddObjectToObject(r, "rope_scaling");
        cJSON_AddStringToObject(rs, "rope_type", c->rope_scaling_type == 1 ? "linear" : "llama3");
        cJSON_AddNumberToObject(rs, "factor", c->rope_factor);
        if (c->rope_scaling_type == 2) {
            cJSON_AddNumberToObject(rs, "low_freq_factor", c->rope_low_freq_factor);
            cJSON_AddNumberToObject(rs, "high_freq_factor", c->rope_high_freq_factor);
            cJSON_AddNumberToObject(rs, "original_max_position_embeddings",
                                    c->rope_original_max_pos);
        }
    }
    if (c->bos_token_id >= 0) cJSON_AddNumberToObject(r, "bos_token_id", c->bos_token_id);
    if (c->n_eos == 1) cJSON_AddNumberToObject(r, "eos_token_id", c->eos_token_ids[0]);
    if (c->n_eos > 1)
        cJSON_AddItemToObject(r, "eos_token_id", cJSON_CreateIntArray(c->eos_token_ids, c->n_eos));
    if (c->value_head) cJSON_AddNumberToObject(r, "num_labels", 1);
    cJSON_AddStringToObject(r, "dtype", bf16 ? "bfloat16" : "float32");
    cJSON_AddStringToObject(r, "torch_dtype", bf16 ? "bfloat16" : "float32");
    char *s = cJSON_Print(r);
    cJSON_Delete(r);
    return s;
}

rf_status rf_config_preset(rf_model_config *c, const char *name, int vocab_size) {
    static const struct { const char *name; int C, F, L, H, KVH; } presets[] = {
        {"tiny", 64, 176, 2, 4, 2},
        {"small", 256, 704, 4, 8, 4},
        {"25m", 512, 1408, 6, 8, 4},
    };
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(name, presets[i].name) != 0) continue;
        memset(c, 0, sizeof *c);
        c->arch = RF_ARCH_QWEN2;
        snprintf(c->model_type, sizeof c->model_type, "qwen2");
        c->hidden_size = presets[i].C;
        c->intermediate_size = presets[i].F;
        c->num_hidden_layers = presets[i].L;
        c->num_attention_heads = presets[i].H;
        c->num_key_value_heads = presets[i].KVH;
        c->head_dim = presets[i].C / presets[i].H;
        c->vocab_size = vocab_size;
        c->rms_norm_eps = 1e-6f;
        c->rope_theta = 10000.0f;
        c->max_position_embeddings = 2048;
        c->tie_word_embeddings = 1;
        c->qkv_bias = 1;
        c->bos_token_id = -1;
        return RF_OK;
    }
    return rf_error(RF_ERR_ARG, "unknown model preset \"%s\" (known: tiny, small, 25m)", name);
}
