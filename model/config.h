/* Model configuration: the Hugging Face config.json of a Llama / Qwen2 / Qwen3 / Mistral-shaped
 * causal LM, parsed and validated. Anything that would change the math and that rlflow does not
 * implement (MoE, sliding windows shorter than the context, unknown rope_scaling, other
 * activations) is refused with an error naming the field. */
#ifndef RF_CONFIG_H
#define RF_CONFIG_H

#include <stdint.h>

#include "common/status.h"

#define RF_MAX_EOS 8

typedef enum rf_arch { RF_ARCH_LLAMA, RF_ARCH_QWEN2, RF_ARCH_QWEN3, RF_ARCH_MISTRAL } rf_arch;

typedef struct rf_model_config {
    rf_arch arch;
    char model_type[32];         /* as in config.json */
    int hidden_size;             /* C */
    int intermediate_size;       /* F */
    int num_hidden_layers;       /* L */
    int num_attention_heads;     /* H */
    int num_key_value_heads;     /* KVH */
    int head_dim;                /* D */
    int vocab_size;              /* V */
    float rms_norm_eps;
    float rope_theta;
    /* rope_scaling: 0 none, 1 linear, 2 llama3 */
    int rope_scaling_type;
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_pos;
    int max_position_embeddings;
    int sliding_window;          /* 0 = none; otherwise sequences longer than it are refused */
    int tie_word_embeddings;
    int qkv_bias;                /* q/k/v projections carry a bias (Qwen2; Llama attention_bias) */
    int o_bias;                  /* o_proj carries a bias (Llama attention_bias) */
    int qk_norm;                 /* Qwen3 per-head RMSNorm on q and k */
    int bos_token_id;            /* -1 when absent */
    int eos_token_ids[RF_MAX_EOS];
    int n_eos;
    int value_head;              /* ForSequenceClassification with num_labels = 1 (score.weight) */
} rf_model_config;

/* Parses config.json at `path` into `cfg`. Errors name the file and field. */
rf_status rf_config_load(rf_model_config *cfg, const char *path);

/* Parses config JSON text; `origin` names the source in messages. */
rf_status rf_config_parse(rf_model_config *cfg, const char *json, const char *origin);

/* Serialises `cfg` as a config.json that Hugging Face transformers loads (caller frees).
 * bf16: the weights saved beside it are BF16, else F32; written as "dtype" (transformers 5,
 * and 4.56+) and "torch_dtype" (older 4.x), the same value, so that from_pretrained(dtype=
 * "auto") loads them as stored. */
char *rf_config_to_json(const rf_model_config *cfg, int bf16);

/* Fills inv_freq (D/2) from rope_theta and rope_scaling, exactly as transformers does. */
void rf_config_inv_freq(const rf_model_config *cfg, float *inv_freq);

/* A named preset for `rlflow init-model` ("tiny", "small", "25m"); RF_ERR_ARG when unknown. */
rf_status rf_config_preset(rf_model_config *cfg, const char *name, int vocab_size);

/* Longest sequence the model accepts (max_position_embeddings, or sliding_window if smaller). */
int rf_config_max_seq(const rf_model_config *cfg);

#endif
