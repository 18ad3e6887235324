/* The tiny model shapes the tensor-parallel tests cut into shards: GQA with biases (4 query /
 * 2 k/v heads: split at tp 2, replicated at tp 4), Qwen3 (12 / 3 heads, q/k norms, tied
 * embeddings: k/v replicated and expanded where tp does not divide them), and a critic (the
 * GQA shape with a value head). */
#ifndef RF_TEST_TP_SHAPES_H
#define RF_TEST_TP_SHAPES_H

#include <stdio.h>

#include "model/model.h"
#include "test_util.h"

typedef enum { SHAPE_GQA, SHAPE_QWEN3, SHAPE_CRITIC } shape;

static inline rf_model_config config_of(shape s) {
    rf_model_config c;
    RF_ASSERT(rf_config_preset(&c, "tiny", s == SHAPE_QWEN3 ? 61 : 97) == RF_OK);
    c.hidden_size = 24, c.num_hidden_layers = 2;
    c.rope_theta = 500.0f;
    if (s == SHAPE_QWEN3) {
        c.arch = RF_ARCH_QWEN3, c.qk_norm = 1, c.qkv_bias = 0;
        snprintf(c.model_type, sizeof c.model_type, "qwen3"); /* what config.json says when saved */
        c.num_attention_heads = 12, c.num_key_value_heads = 3, c.head_dim = 4;
        c.intermediate_size = 30, c.tie_word_embeddings = 1;
    } else {
        c.arch = RF_ARCH_LLAMA, c.qkv_bias = 1, c.o_bias = 1;
        snprintf(c.model_type, sizeof c.model_type, "llama");
        c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 6;
        c.intermediate_size = 40, c.tie_word_embeddings = 0;
        c.value_head = s == SHAPE_CRITIC;
    }
    return c;
}

#endif
