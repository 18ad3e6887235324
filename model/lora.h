/* LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on a
 * model's projections, laid out and initialised as Hugging Face PEFT does:
 *
 *     y = x W^T + scale * (x A^T) B^T,   A (r, in), B (out, r), scale = alpha / r
 *
 * with A drawn from normal(0, 1/r) ("gaussian") or uniform(-1/sqrt(in), 1/sqrt(in))
 * ("kaiming", PEFT's default kaiming_uniform_(a = sqrt(5))) and B zero, so a fresh adapter
 * leaves the model unchanged. The adapters are appended to the model's flat parameter buffer
 * after the base weights, which become frozen (m->n_frozen): gradients and AdamW moments exist
 * for the adapters only. The forward and backward passes run the adapter products through the
 * kernel table's matrix products, so any back end and precision runs them; KV-cache decoding
 * goes through the same layer code, so generation uses the unmerged adapters too. */
#ifndef RF_LORA_H
#define RF_LORA_H

#include <stdint.h>

#include "model/model.h"
#include "model/safetensors.h"

typedef enum { RF_LORA_INIT_GAUSSIAN, RF_LORA_INIT_KAIMING } rf_lora_init;

typedef struct rf_lora_opts {
    int rank;           /* >= 1 */
    float alpha;        /* scale = alpha / rank */
    float dropout;      /* only 0 is supported */
    unsigned targets;   /* bits (1 << RF_LORA_Q) ...; not 0 */
    rf_lora_init init;
    uint64_t seed;      /* draws of A */
} rf_lora_opts;

/* The short name of target t ("q", "k", "v", "o", "gate", "up", "down"), and the module name
 * PEFT's target_modules use for it ("q_proj", ...). */
const char *rf_lora_target_name(int t);
const char *rf_lora_module_name(int t);

/* Target bits from names (n of them, each a rf_lora_target_name). An unknown name or an empty
 * list: RF_ERR_ARG naming `key` (the recipe key they came from, e.g. "lora.targets"). */
rf_status rf_lora_parse_targets(const char *const *names, int n, const char *key, unsigned *targets);

/* Checks o for model config cfg: RF_ERR_ARG naming the key ("lora.rank", "lora.dropout",
 * "lora.targets", "lora.alpha") whose value cannot be used. */
rf_status rf_lora_check(const rf_lora_opts *o, const rf_model_config *cfg);

/* Adds adapters to every layer's targets of m: the parameter buffer grows (values of the base
 * kept, pointers into it re-pointed; moved to new memory), A initialised per o->init, B zero,
 * and the base weights become frozen. Before rf_model_enable_training, on a model that owns
 * its parameters and has no adapters yet: else RF_ERR_ARG. Errors of rf_lora_check. */
rf_status rf_model_lora_attach(rf_model *m, const rf_lora_opts *o);

/* The adapters o would add, over a buffer m borrows (rf_model_init_borrowed) that already holds
 * them after its base: the buffer of a model that rf_model_lora_attach gave the same options
 * (a colocated rollout rank reading its training rank's weights in place). Nothing is allocated
 * or written but the adapters' table; the base counts as frozen (m->n_frozen) and the adapters'
 * values are the buffer's. RF_ERR_ARG on a model that does not borrow its parameters, has
 * adapters or trains; rf_lora_check's errors. */
rf_status rf_model_lora_bind(rf_model *m, const rf_lora_opts *o);

/* The adapters o would add to a whole model of config cfg, for a tensor-parallel shard to cut
 * its blocks from (model_tp.h rf_model_tp_lora_attach): their table (*views, *n of them: lora_A
 * then lora_B of each target of every layer, offsets from 0) and their initial values (*init,
 * rf_lora_param_count floats on the host: the draws rf_model_lora_attach makes on a whole
 * model, B zero). Both owned by the caller (free). rf_lora_check's errors; RF_ERR_NOMEM. */
rf_status rf_lora_whole(const rf_lora_opts *o, const rf_model_config *cfg, rf_param_view **views, int *n,
                        float **init);

/* The views the optimizer updates and checkpoints keep: the adapters' with LoRA, else all of
 * the model's (borrowed from m). */
const rf_param_view *rf_model_train_views(const rf_model *m, int *n_views);

/* The adapters' table of m with offsets from 0 (their floats from m->n_frozen on): what a
 * transfer of the adapters alone reshards (resharding/weights_reshard.h). A copy owned by the
 * caller (free), *n = m->lora.n_views; RF_ERR_ARG when m has no adapters, RF_ERR_NOMEM. */
rf_status rf_lora_table(const rf_model *m, rf_param_view **views, int *n);

/* Floats of adapters o would add to a model of config cfg (for memory estimates). */
size_t rf_lora_param_count(const rf_lora_opts *o, const rf_model_config *cfg);

/* Input and output width of target t's projection in a model of config cfg. */
void rf_lora_target_dims(const rf_model_config *cfg, int t, int *in, int *out);

/* Writes m's adapters into dir (created if needed) in Hugging Face PEFT's layout:
 * adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, task_type CAUSAL_LM,
 * base_model_name_or_path = base, may be "") and adapter_model.safetensors with PEFT's names,
 * "base_model.model." + the view name (F32). RF_ERR_ARG when m has no adapters; RF_ERR_IO. */
rf_status rf_lora_save_peft(const rf_model *m, const char *dir, const char *base);

/* rf_lora_save_peft for adapters that are not in one buffer here: l's rank, alpha and targets,
 * the adapter tensors' whole shapes and names in views (n of them, l->views' order), each one's
 * floats made by fill(ctx, i, dst) as the writer reaches it (a checkpoint's tensor function:
 * tensor-parallel shards gathered, or a whole model's copied). RF_ERR_ARG without adapters;
 * fill's errors; RF_ERR_IO. */
rf_status rf_lora_save_peft_fill(const rf_lora *l, const rf_param_view *views, int n, const char *dir,
                                 const char *base, rf_st_fill_fn fill, void *ctx);

/* Reads dir/adapter_config.json into o (seed 0, B-zero init; the values come from the file):
 * what rlflow does not implement (use_rslora, bias other than "none", modules_to_save,
 * fan_in_fan_out, rank_pattern / alpha_pattern, layers_to_transform, lora_dropout is read but
 * only matters for training, a target_modules regex or a module other than q/k/v/o/gate/up/
 * down_proj) is refused naming the file and field. RF_ERR_IO, RF_ERR_FORMAT. */
rf_status rf_lora_read_peft_config(const char *dir, rf_lora_opts *o);

/* Attaches the adapters saved in PEFT's layout in dir to m (a model without adapters, not
 * training): config as rf_lora_read_peft_config, every tensor of adapter_model.safetensors
 * read into place; a missing tensor, one of another shape, or one the adapters do not have is
 * an error naming the file and tensor. After an error other than the config's, m may hold
 * adapters partly read: free it. */
rf_status rf_lora_load_peft(rf_model *m, const char *dir);

/* Writes the merged weights W + (alpha / r) B A of every adapter into the base weights of m
 * (in place; computed on the host in double) and drops the adapters: m becomes a plain model
 * (n_frozen 0, no lora views; its buffers keep their size). Not on a training model
 * (RF_ERR_ARG). */
rf_status rf_lora_merge(rf_model *m);

#endif
