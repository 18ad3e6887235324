/* The decoder model: a Llama / Qwen2 / Qwen3 / Mistral-shaped causal LM with explicit forward
 * and backward passes over packed variable-length batches, written out by hand (llm.c style).
 *
 * Parameters, gradients and AdamW state each live in one flat buffer on the model's back end;
 * every tensor is a named view (Hugging Face names) into them, so loading, saving, gradient
 * clipping and the optimizer all walk one table. Optionally a scalar value head (score.weight)
 * replaces the LM head: that is the critic and the reward model.
 *
 * Threads: a model is used by one thread at a time. Back end: every pointer below lives in the
 * memory of `m->k` (host for CPU, device for CUDA). */
#ifndef RF_MODEL_H
#define RF_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/rng.h"
#include "kernels/kernels.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/sampler.h"

#define RF_MAX_NAME 96

typedef struct rf_param_view {
    char name[RF_MAX_NAME]; /* Hugging Face tensor name */
    size_t offset;          /* in floats, into params / grads / opt_m / opt_v */
    int ndim;
    int64_t shape[2];
    size_t numel;
    int no_decay;           /* norms and biases: no weight decay */
} rf_param_view;

/* LoRA targets (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): the
 * projections an adapter can sit on, in the order of rf_lora_target_name. */
enum { RF_LORA_Q, RF_LORA_K, RF_LORA_V, RF_LORA_O, RF_LORA_GATE, RF_LORA_UP, RF_LORA_DOWN, RF_LORA_N };

typedef struct rf_layer_weights {
    float *ln1;              /* (C) input_layernorm */
    float *wq, *bq;          /* (H*D, C), (H*D) */
    float *wk, *bk;          /* (KVH*D, C), (KVH*D) */
    float *wv, *bv;          /* (KVH*D, C), (KVH*D) */
    float *wo, *bo;          /* (C, H*D), (C) */
    float *q_norm, *k_norm;  /* (D) Qwen3 only */
    float *ln2;              /* (C) post_attention_layernorm */
    float *wgate, *wup;      /* (F, C) */
    float *wdown;            /* (C, F) */
    float *lora_a[RF_LORA_N]; /* (r, in) of each target; NULL: no adapter (model/lora.h) */
    float *lora_b[RF_LORA_N]; /* (out, r) */
} rf_layer_weights;

/* Saved activations of one layer for a packed batch of T tokens. */
typedef struct rf_layer_acts {
    float *x;          /* (T, C) residual stream entering the layer */
    float *ln1;        /* (T, C) */
    float *rstd1;      /* (T) */
    float *q_raw;      /* (T, H, D) before q_norm (Qwen3 only) */
    float *k_raw;      /* (T, KVH, D) before k_norm (Qwen3 only) */
    float *q_rstd;     /* (T, H) */
    float *k_rstd;     /* (T, KVH) */
    float *q;          /* (T, H, D) after norm and RoPE */
    float *k, *v;      /* (T, KVH, D) */
    float *att;        /* (T, H, D) attention output before o_proj */
    float *lse;        /* (T, H) */
    float *x_mid;      /* (T, C) residual after attention */
    float *ln2;        /* (T, C) */
    float *rstd2;      /* (T) */
    float *gate, *up;  /* (T, F) */
    float *act;        /* (T, F) silu(gate) * up */
    float *lora_u[RF_LORA_N]; /* (T, r) scale * x A^T of each adapter; NULL without */
} rf_layer_acts;

/* A packed batch, host memory. Sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s+1]-1. */
typedef struct rf_batch {
    int n_seq;
    int T;
    const int32_t *tokens;     /* (T) */
    const int32_t *pos;        /* (T) position ids; NULL = 0.. within each sequence */
    const int32_t *cu_seqlens; /* (n_seq + 1) */
} rf_batch;

/* KV cache for generation: per layer, `n_slots` sequences of up to `max_len` positions. */
typedef struct rf_kv_cache {
    int n_slots, max_len, n_layers, KVH, D;
    float *k, *v;   /* (L, n_slots, max_len, KVH, D) on the back end */
    int *len;       /* (n_slots) host: positions filled per slot */
} rf_kv_cache;

/* A hook of the backward pass (data-parallel training: trainer/data_parallel.h). Called by
 * rf_model_backward each time the gradients of a contiguous range of the flat buffer, floats
 * [offset, offset + n), are final for that pass: first the final norm with the LM or value
 * head (the end of the buffer), then each layer from the last to the first, its MLP half
 * (post-attention norm to down projection, the end of the layer) and then its attention half,
 * then the embedding (offset 0, last because a tied LM head also writes it). The ranges cover the buffer once, in
 * that order, so everything at or past `offset` is final. On a device back end the kernels that
 * wrote the range may still be running (synchronise before reading). With LoRA adapters the
 * ranges are of the gradient buffer (the trained floats, from n_frozen on): each layer's
 * adapters from the last layer to the first, once both halves of the layer are done. A status
 * other than RF_OK stops the backward pass and is returned by it. */
typedef rf_status (*rf_grad_ready_fn)(void *ctx, size_t offset, size_t n);

/* The adapters of a model (model/lora.h). */
typedef struct rf_lora {
    int rank;                 /* 0: no adapters */
    float alpha, scale;       /* scale = alpha / rank, PEFT's scaling */
    unsigned targets;         /* bit (1 << RF_LORA_Q) ... */
    rf_param_view *views;     /* (n_views) PEFT names without "base_model.model.", offsets into
                                 the model's params at or past its n_frozen */
    int n_views;
} rf_lora;

typedef struct rf_model {
    rf_model_config cfg;
    const rf_kernels *k;
    rf_param_view *views;
    int n_views;
    size_t n_params;          /* floats, adapters included */
    float *params;            /* (n_params) */
    size_t n_frozen;          /* the first n_frozen floats of params have no gradient or
                                 optimizer state (the base weights under LoRA); 0 otherwise */
    float *grads;             /* (n_params - n_frozen) for floats n_frozen.., NULL until
                                 rf_model_enable_training */
    float *opt_m, *opt_v;     /* (n_params - n_frozen) AdamW state */
    rf_lora lora;             /* rank 0: none; views above cover the base model only */
    int opt_step;
    float *wte;               /* (V, C) */
    float *norm;              /* (C) */
    float *lm_head;           /* (V, C); == wte when tied; NULL with a value head */
    float *score;             /* (1, C) value head; NULL without */
    rf_layer_weights *layers; /* (L) */
    float *inv_freq;          /* (D/2) back end */

    /* activations for the last forward pass */
    int act_cap;              /* tokens the buffers below hold */
    int act_layers;           /* layers with buffers: all (a forward) or 1 (decoding's only) */
    float *act_mem;
    rf_layer_acts *acts;      /* (L) */
    float *x_final;           /* (T, C) residual after the last layer */
    float *h;                 /* (T, C) after the final norm */
    float *rstd_f;            /* (T) */
    float *scratch;           /* (T, max(C, F, H*D)) gradient scratch */
    float *scratch2;          /* (T, max(C, F, H*D)) */
    float *gmem;              /* backward gradient buffers, gmem_cap tokens */
    int gmem_cap;
    float *dev_out;           /* logits / values staging, dev_out_cap floats */
    size_t dev_out_cap;
    int draw_rows;            /* logits rows the last decode left in dev_out for rf_model_draw */
    int32_t *ibuf;            /* index arrays on the back end */
    int ibuf_cap;
    int T, n_seq;             /* shape of the last forward */
    int32_t *d_tokens, *d_pos, *d_cu, *d_kstart, *d_klen, *d_targets;
    float logprob_inv_temp;
    rf_grad_ready_fn grad_ready; /* NULL: no hook (rf_model_set_grad_hook) */
    void *grad_ready_ctx;
    int params_shared;        /* 1: params from rf_shm_alloc (rf_model_share_params); 2:
                                 another model's (rf_model_init_borrowed), not freed here */
    uint16_t *wbf16;          /* (n_params) a frozen bf16 model's matrices (rf_model_load_frozen),
                                 bf16 at the offsets of params, bound to them on the back end
                                 (kernels.h bind_bf16): their floats in params hold nothing
                                 (never touched pages), the 1-D tensors (norms, biases) are in
                                 params only. Also a rollout store's (rf_model_keep_bf16):
                                 then only [bf16_lo, n_params) is bound. NULL for every other
                                 model. */
    size_t bf16_lo;           /* wbf16: the first float of the bound range (0 frozen; a rollout
                                 store: the end of the embedding table, which stays fp32) */
    int bf16_store;           /* 1: wbf16 is a rollout store, written by rf_model_write_params;
                                 0: frozen (never written) */
} rf_model;

/* Allocates a model for `cfg` on back end `k` with parameters zeroed. Caller frees with
 * rf_model_free. */
rf_status rf_model_init(rf_model **out, const rf_model_config *cfg, const rf_kernels *k);
void rf_model_free(rf_model *m);
/* Gives the pass workspaces (activations, backward buffers, staging) back to the back end;
 * they grow again with the next pass. Parameters, gradients and optimizer state stay. Between
 * passes only: a backward needs a forward after it. A colocated run's phases use it to leave
 * the device to each other (rollout.free_kv_cache). Also gives back what the back end keeps
 * between calls for every model (kernels.h trim: the CPU's saved LM-head logits, up to
 * 512 MB). NULL is fine. */
void rf_model_trim(rf_model *m);

/* rf_model_init over another model's parameter buffer (params: n_params floats on back end
 * k, laid out for cfg; borrowed, it must outlive the model, which never frees it): a second
 * view of the same weights with activations of its own (the rollout rank of a colocated
 * process, resharding/handover.h). Writing the parameters through either model changes both. */
rf_status rf_model_init_borrowed(rf_model **out, const rf_model_config *cfg, const rf_kernels *k, float *params);

/* Moves the parameters (values kept) into memory other processes of this host can map
 * (common/shm.h), so a resharding that sends them to ranks of the same host lets those read them
 * in place, one copy at memory speed (resharding/reshard.h). CPU back end only: on another one,
 * RF_ERR_UNSUPPORTED. Pointers into the old parameter buffer held elsewhere become invalid. */
rf_status rf_model_share_params(rf_model *m);

/* Random init like transformers' _init_weights: normal(0, std) for matrices, ones for norms,
 * zeros for biases. */
void rf_model_init_random(rf_model *m, uint64_t seed, float std);

/* Loads a Hugging Face model directory (config.json + safetensors) onto back end `k`.
 * Errors name the file and tensor. `value_head` = 1 asks for a critic: score.weight is loaded
 * when present, else initialised to zero (a fresh critic from a policy checkpoint). */
rf_status rf_model_load(rf_model **out, const char *dir, const rf_kernels *k, int value_head);

/* rf_model_load for a model whose weights never change in this process (generate, score,
 * eval, the reference policy): where the back end can bind bf16 weights (kernels.h bind_bf16:
 * the CPU), its precision is bf16 and every matrix of the checkpoint is stored as BF16, the
 * matrices stay bf16 (m->wbf16; 2 bytes per weight instead of 4, no fp32 copy) and products use
 * them as operands directly; norms and biases are fp32. Results are bit for bit those of
 * rf_model_load at the same precision (rounding a bf16 value to bf16 changes nothing). Otherwise
 * exactly rf_model_load (with a log line saying why where the checkpoint is BF16 and the
 * precision bf16 but the back end cannot). Such a model refuses training, reading
 * parameters in (rf_model_load_params) and sharing them (rf_model_share_params); saving widens
 * the bf16 values (exact). Adapters (model/lora.h) must not be attached to it. */
rf_status rf_model_load_frozen(rf_model **out, const char *dir, const rf_kernels *k, int value_head);

/* 1 when rf_model_keep_bf16 would keep a model on back end k in bf16: k is the CPU's, can bind
 * bf16 weights (kernels.h bind_bf16) and its precision is bf16 now. */
int rf_model_can_keep_bf16(const rf_kernels *k);

/* For a model that only generates and whose weights arrive from elsewhere with each version (a
 * split run's rollout worker, rollout/worker.c), made by rf_model_init with nothing written to
 * its parameters yet: where rf_model_can_keep_bf16(m->k), keeps every matrix after the
 * embedding table as bf16 only (m->wbf16, bound to the parameters' addresses from m->bf16_lo
 * on): the products read them as their bf16 operands, which are the bits the back end's
 * per-version copy of fp32 weights would hold (the same rounding), so results are bit for bit
 * those of an fp32 model given the same weights. The embedding table stays fp32 (its lookup
 * reads the values unrounded; a tied LM head gets the back end's bf16 copy as before), and so
 * do the 1-D tensors (norms, biases). The fp32 floats under the matrices are never touched
 * again (untouched pages of a fresh mapping cost no memory). Weights are then written with
 * rf_model_write_params only. *kept = 1 when done; 0, and nothing changes, where the back end
 * or precision does not allow it or m has adapters, a value head, or parameters borrowed or
 * shared. The model refuses training and sharing as a frozen one does. RF_ERR_NOMEM. */
rf_status rf_model_keep_bf16(rf_model *m, int *kept);

/* Writes n floats src (host memory) as m's parameters [off, off + n): copied to the back end,
 * or for a model kept in bf16 (rf_model_keep_bf16) the matrices' floats rounded to bf16 (round
 * to nearest even, model/dtype.h) into its store and the others copied. The caller tells the
 * back end afterwards (weights_updated). Multi-threaded (OpenMP) over large ranges. A frozen
 * model (rf_model_load_frozen) refuses: RF_ERR_UNSUPPORTED. */
rf_status rf_model_write_params(rf_model *m, size_t off, const float *src, size_t n);

/* Reads the parameters of an existing model from a safetensors directory (same config);
 * with `prefix`/`suffix` the tensor names are prefix + view name + suffix and the values go to
 * `dst` (n_params - n_frozen floats on the back end, e.g. optimizer moments) instead of the
 * parameters. Only the trained views are read (model/lora.h rf_model_train_views: under LoRA
 * the adapters, named as in m->lora.views; the frozen base stays as it is).
 * On the CPU back end the tensors are converted straight into place (no staging copy), so after
 * an error the buffer may hold some of them. */
rf_status rf_model_load_params(rf_model *m, const char *dir, float *dst, const char *suffix);

/* Tensors in an opened checkpoint (st, of directory dir) that model m does not use would be
 * silently dropped: RF_ERR_UNSUPPORTED naming the tensor and its file, except lm_head.weight
 * next to tied embeddings (transformers ignores it too), an LM head when m has a value head (a
 * critic initialised from a policy) and rotary inv_freq buffers. Only names and m->cfg are
 * read, so a tensor-parallel shard (model_tp.h) is checked with the same call. */
rf_status rf_model_check_unused(const rf_model *m, const rf_safetensors *st, const char *dir);

/* Writes config.json for cfg into dir (created if needed), atomically; bf16: the weights
 * saved with it are BF16 (its "dtype"), else F32. */
rf_status rf_model_save_config(const rf_model_config *cfg, const char *dir, int bf16);

/* Writes tensors of the parameter table views (n_views; whole shapes) into dir as safetensors
 * (rf_st_write_dir_fill: F32, or BF16 when bf16; files of at most max_shard_bytes, 0 = one),
 * each named view name + suffix, its data made by fill(ctx, view index, dst) when the writer
 * reaches it: for models whose tensors are not in one buffer here (tensor-parallel shards
 * gathered one tensor at a time). No config.json (rf_model_save_config). */
rf_status rf_model_save_views(const rf_param_view *views, int n_views, const char *dir, const char *suffix, int bf16,
                              size_t max_shard_bytes, rf_st_fill_fn fill, void *ctx);

/* Writes config.json and model.safetensors (or shards above max_shard_bytes) into `dir`. */
rf_status rf_model_save(const rf_model *m, const char *dir, int bf16, size_t max_shard_bytes);

/* Allocates gradients and optimizer state (zeroed). */
rf_status rf_model_enable_training(rf_model *m);
void rf_model_zero_grad(rf_model *m);

/* Forward over a packed batch, keeping what backward needs. Afterwards m->h holds the final
 * hidden states (T, C). Errors: bad token ids, sequences over the model's length limit. */
rf_status rf_model_forward(rf_model *m, const rf_batch *b);

/* Per-token log-prob of targets (T) and entropy (T; NULL = skip) at temperature 1/inv_temp,
 * from the last forward; host outputs. Keeps targets for rf_model_backward. */
rf_status rf_model_logprobs(rf_model *m, const int32_t *targets, float inv_temp, float *logp,
                            float *entropy);

/* Value head outputs (T) from the last forward (host). */
rf_status rf_model_values(rf_model *m, float *values);

/* Full logits (n_rows, V) on the host for selected rows of the last forward. */
rf_status rf_model_logits(rf_model *m, const int *rows, int n_rows, float *logits);

/* Backward from host upstream gradients: dlogp (T), dentropy (T) (either may be NULL; needs a
 * prior rf_model_logprobs) and dvalues (T) for a value head. Accumulates into m->grads. */
rf_status rf_model_backward(rf_model *m, const float *dlogp, const float *dentropy,
                            const float *dvalues);

/* Installs (fn != NULL) or removes (NULL) the backward hook; it does not change what backward
 * computes. ctx is the caller's, passed to fn. */
void rf_model_set_grad_hook(rf_model *m, rf_grad_ready_fn fn, void *ctx);

/* KV cache with n_slots sequences of max_len positions each. */
rf_status rf_kv_cache_init(rf_kv_cache *c, const rf_model *m, int n_slots, int max_len);
void rf_kv_cache_free(rf_kv_cache *c, const rf_model *m);

/* Runs new tokens of several cache slots through the model, appending their keys/values to the
 * cache, and writes the logits of each slot's last new token to logits (n, V) on the host.
 * slots (n), counts (n) new tokens per slot; tokens packed in slot order. logits NULL: the
 * rows stay in the back end's memory for rf_model_draw (nothing crosses to the host). */
rf_status rf_model_decode(rf_model *m, rf_kv_cache *c, const int *slots, const int *counts,
                          int n, const int32_t *tokens, float *logits);

/* Draws tokens from the n_rows logits rows that the model's last decode call (rf_model_decode
 * or rf_model_decode_paged with logits NULL) left in the back end's memory, and nothing else
 * ran since: draw i (its row, sampling and uniform) gives picks[i] and logp[i] as rf_sample_u
 * gives them. Draws without top-k / top-p run on the back end (kernels.h sample_rows: a token
 * and a log-prob per draw cross to the host; on a GPU the pick can differ from the CPU's only
 * where the uniform falls within rounding of a boundary); the others copy their row to the host
 * and draw there, each pick's log-prob taken from the back end's log-sum-exp of the row
 * (kernels.h row_lse), so that it is the log-prob the back end's sampler would report. The whole
 * rows capture[0 .. n_capture) are copied into whole (n_capture, V) (may be NULL when n_capture
 * is 0), and where whole_lse is given, whole_lse[i] gets row capture[i]'s log-sum-exp at inverse
 * temperature capture_inv_temp[i] from the back end (row_lse): a later draw from the copy then
 * reports rf_logprob_given_lse(z_pick, inv_temp, whole_lse[i]), the back end's log-prob.
 * RF_ERR_RANGE for a row outside [0, n_rows). */
rf_status rf_model_draw(rf_model *m, int n_rows, const rf_draw *draws, int n_draws, int32_t *picks, float *logp,
                        const int *capture, int n_capture, float *whole, const float *capture_inv_temp,
                        float *whole_lse);

/* The parameter table of a model of config `cfg` (names, shapes, offsets; the order of
 * rf_model_init) without allocating any buffer: what a rank that holds only a shard needs to
 * plan with (resharding/layout.h, model/model_tp.h). *views (*n_views) is the caller's to
 * free(); *n_params is the whole model's size in floats. RF_ERR_NOMEM. */
rf_status rf_model_param_views(const rf_model_config *cfg, rf_param_view **views, int *n_views,
                               size_t *n_params);

/* Number of parameters (floats) and the view named `name` (NULL if absent). */
const rf_param_view *rf_model_find(const rf_model *m, const char *name);

/* Forward+backward FLOPs per token for a sequence of length `seq_len` (matmuls and attention,
 * the convention of the PaLM paper's MFU: 6N + 12 L H D seq_len / 2 causal). */
double rf_model_train_flops_per_token(const rf_model_config *cfg, int seq_len);

#endif
