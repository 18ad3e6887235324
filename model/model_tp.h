/* Tensor parallelism of the decoder model (DESIGN.md section 3), Megatron-style (Shoeybi et
 * al. 2019, "Megatron-LM", section 3): the ranks of one communicator (the tensor-parallel
 * group, tp ranks) each hold one shard of every parameter and together compute what one rank
 * computes with the whole model (model/model.h), forward, backward and KV-cache decoding.
 *
 * Shards follow the split rules of resharding/layout.h (rank t of the group holds shard t, so
 * a buffer the resharding executor writes for shard t is this rank's parameter buffer as is):
 *
 *   embed_tokens      vocabulary-parallel: rows [v0, v0 + Vl). Each rank looks up the tokens
 *                     of its range, zeros elsewhere; one allreduce makes the whole embedding.
 *   q/k/v (+biases)   column-parallel by whole heads: rank t owns query heads [h0, h0 + H)
 *                     (H = num_attention_heads / tp) and runs attention for them alone. k/v
 *                     heads are split when tp divides num_key_value_heads; otherwise every
 *                     rank holds all of them and projects only the heads its query heads read
 *                     ([kv0, kv0 + KV)). No communication in the forward pass; the gradient of
 *                     the layer input is allreduced in the backward pass.
 *   o_proj, down      row-parallel: each rank's product is a partial sum, allreduced in the
 *                     forward pass (o_proj's bias is added by rank 0 only, so once).
 *   gate/up           column-parallel over the intermediate size: rows [f0, f0 + F).
 *   lm_head           vocabulary-parallel (tied: the embedding's rows). The log-prob and
 *                     entropy of each token are combined from per-rank partials (max over the
 *                     slice, sum of exp, sum of exp * logit, target logit): an allgather of the
 *                     maxima, then one allreduce of the rescaled sums. No rank ever holds more
 *                     than chunk x Vl logits (kernels.h, logprob_vp_partials). The backward
 *                     pass needs no further statistics: each rank's share of dh is allreduced.
 *   norms, o bias,    replicated, computed identically on every rank. The gradients that a
 *   score (value        rank sees only in part (Qwen3 q/k norms; k/v weights when replicated:
 *   head), q/k norms    each rank back-propagates through its own query heads) are summed over
 *                       the group at the end of each backward pass; the others are whole on
 *                       every rank already.
 *
 * GQA when tp does not divide num_key_value_heads: when a rank's query heads map onto its k/v
 * heads the way attention's kernel does (num_attention_heads / tp a multiple or a divisor of
 * the group size, e.g. 4 query / 2 kv heads at tp 4: one k/v head per rank), attention reads
 * the projected heads directly; otherwise (e.g. 12 / 3 at tp 2) each query head gets its own
 * copy of its k/v head (KVA = H heads, "expanded"), and the copies' gradients are summed back.
 *
 * Every rank of the group must call every function below that communicates (forward,
 * logprobs, backward, decode, greedy, gather_logits, grad_sumsq) in the same order with the
 * same batch, targets and upstream gradients; the outputs (log-probs, entropies, values,
 * greedy tokens) are then identical on every rank. Every collective is bounded by timeout_s
 * (comm.h: a rank that is gone gives RF_ERR_IO naming it; the communicator is then failed).
 *
 * Back ends: the CPU kernels over an MPI or single-rank communicator, or the CUDA kernels over
 * a NCCL one (the same code: activations, gradients and parameters move over the communicator;
 * the per-token statistics of the log-probs and of sampling are combined in host memory over
 * rf_comm_host of it). rf_model_tp_init refuses other pairings. The CUDA pairing has been
 * compiled, never run (tests/test_model_tp_cuda.c).
 *
 * Data parallelism over a tp x dp grid (trainer/data_parallel.h, rf_dp_init_tp) hooks the
 * backward pass of tp->m like a whole model's.
 *
 * Not here yet (docs/scaling.md): sequence parallelism. Split runs train the actor with it (placement.actor.tp;
 * actor/worker_tp.c) and generate with it (placement.rollout.tp; rollout/rollout_tp.h).
 *
 * Threads: one thread uses a rf_model_tp and its communicator (comm.h). */
#ifndef RF_MODEL_TP_H
#define RF_MODEL_TP_H

#include <stddef.h>
#include <stdint.h>

#include "comm/comm.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/sampler.h"
#include "resharding/layout.h"
#include "rollout/kv_pool.h"

/* Saved activations of one layer on one rank, T tokens. H, KV, KVA, F are this rank's. */
typedef struct rf_tp_acts {
    float *x;          /* (T, C) residual stream entering the layer (whole, as on every rank) */
    float *ln1;        /* (T, C) */
    float *rstd1;      /* (T) */
    float *q_raw;      /* (T, H, D) before q_norm (Qwen3 only) */
    float *k_raw;      /* (T, KV, D) before k_norm (Qwen3 only) */
    float *q_rstd;     /* (T, H) */
    float *k_rstd;     /* (T, KV) */
    float *q;          /* (T, H, D) after norm and RoPE */
    float *k, *v;      /* (T, KV, D) */
    float *ka, *va;    /* (T, KVA, D) what attention reads: k, v themselves unless expanded */
    float *att;        /* (T, H, D) attention output of this rank's heads */
    float *lse;        /* (T, H) */
    float *x_mid;      /* (T, C) residual after attention (whole) */
    float *ln2;        /* (T, C) */
    float *rstd2;      /* (T) */
    float *gate, *up;  /* (T, F) */
    float *act;        /* (T, F) */
    float *lora_u[RF_LORA_N]; /* (T, r) scale * x A^T of each adapter (LoRA; NULL without): whole
                                 for q, k, v, gate, up; this rank's partial sum for o, down */
} rf_tp_acts;

typedef struct rf_model_tp {
    rf_model_config cfg;      /* the whole model's */
    rf_comm *comm;            /* the tensor-parallel group; borrowed */
    int tp, t;                /* group size; this rank's shard */
    double timeout_s;         /* bound of every collective */

    /* This rank's shard as a model: m->params (m->n_params) is the layout's local buffer for
     * shard t (rf_layout_shards), views in the same order under the same names with the
     * shard's shapes; m->grads, m->opt_m, m->opt_v alike. m->cfg is the shard's own
     * (num_attention_heads = H, intermediate_size = F, vocab_size = Vl; num_key_value_heads
     * KVH / tp when split, else KVH): never run rf_model_forward on it. */
    rf_model *m;
    rf_param_view *full_views; /* (n_full_views) the whole model's table (rf_model_param_views) */
    int n_full_views;
    size_t full_params;        /* floats in the whole model */
    rf_shard *shards;          /* (n_full_views) the block of each parameter held here */

    int v0, Vl;               /* vocabulary rows [v0, v0 + Vl) */
    int h0, H;                /* query heads [h0, h0 + H) */
    int kv_split;             /* 1: k/v heads split over the group; 0: replicated */
    int kv0, KV;              /* k/v heads projected here: [kv0, kv0 + KV) (whole-model ids) */
    int kv_row0;              /* their first row in the local k/v weights (0 when split) */
    int KVA;                  /* k/v heads attention reads: KV, or H when expanded */
    int *kv_of;               /* (H) local k/v head (0 .. KV) each local query head reads */
    int F;                    /* intermediate rows held */
    int *sync_views;          /* (n_sync) views whose gradients are partial here (summed at the
                                 end of backward): indices into sync_table */
    const rf_param_view *sync_table; /* m->views, or under LoRA m->lora.views (the base is frozen:
                                 the replicated adapters are the partial ones) */
    int n_sync;
    size_t sync_floats;

    /* LoRA (rf_model_tp_lora_attach): the whole model's adapter table and the block of each
     * adapter held here; m->lora holds the blocks (after the frozen base, in this order) */
    rf_param_view *lora_views; /* (n_lora_views) whole shapes, offsets from 0; NULL without */
    int n_lora_views;
    rf_shard *lora_shards;     /* (n_lora_views) rf_layout_shards of lora_views */
    float *lora_tmp, *lora_du; /* (T, max(C, H*D, F)) and (T, r): the adapters' scratch */

    /* activations of the last forward pass */
    int act_cap;
    float *act_mem;
    rf_tp_acts *acts;         /* (L) */
    float *x_final;           /* (T, C) */
    float *h;                 /* (T, C) after the final norm */
    float *rstd_f;            /* (T) */
    int32_t *d_local;         /* (T) on the back end: the tokens' rows in this rank's vocabulary
                                 slice, -1 outside it (the embedding's ids) */
    float *gmem;              /* backward buffers, gmem_cap tokens */
    int gmem_cap;
    float *sync_mem;          /* (2 * sync_floats) on the back end */
    int T, n_seq;             /* shape of the last forward; T = 0 after decoding */
    int32_t *tokens;          /* (T) host copy of the last forward's / decode's tokens */
    int32_t *local;           /* (T) host: d_local's values */
    float *host;              /* per-token host scratch (host_cap tokens) */
    int host_cap;
    float *lse, *ent;         /* (T) host: whole-vocabulary log-sum-exp and entropy of the last
                                 rf_model_tp_logprobs (the backward pass reuses them) */
    float inv_temp;
    int have_logprobs;
    double comm_s;            /* wall time spent in collectives so far (waits for slower ranks
                                 included); the caller may reset it */
    long n_collectives;       /* collectives called so far */
} rf_model_tp;

/* Makes this rank's shard of a model of config cfg (the whole model's) on back end k, over
 * communicator comm: tp = rf_comm_size(comm), this rank holds shard rf_comm_rank(comm).
 * Parameters are zero; fill them with rf_model_tp_set_full or rf_model_tp_set_shard. No
 * communication. comm is borrowed and must outlive the model. Errors: RF_ERR_ARG when tp does
 * not divide num_attention_heads or exceeds the vocabulary or intermediate size (the layout
 * rules, rf_layout_check); RF_ERR_UNSUPPORTED for a back end or communicator other than the
 * CPU kernels over MPI or single; RF_ERR_NOMEM. Free with rf_model_tp_free. */
rf_status rf_model_tp_init(rf_model_tp **out, const rf_model_config *cfg, const rf_kernels *k,
                           rf_comm *comm, double timeout_s);

/* The same over another shard's parameter buffer (params: the local floats of shard
 * rf_comm_rank(comm) of tp = rf_comm_size(comm), on back end k; borrowed, never freed here:
 * rf_model_init_borrowed): the colocated rollout rank's view of the training shard it shares a
 * process with (resharding/handover.h). */
rf_status rf_model_tp_init_borrowed(rf_model_tp **out, const rf_model_config *cfg, const rf_kernels *k,
                                    rf_comm *comm, double timeout_s, float *params);
void rf_model_tp_free(rf_model_tp *tp);
/* rf_model_trim for a shard: its activations and backward buffers given back (they grow again
 * with the next pass); no communication. */
void rf_model_tp_trim(rf_model_tp *tp);

/* Cuts this rank's shard out of the whole model's flat parameter buffer (full_params floats,
 * host memory, in rf_model_init's order) into m->params. RF_ERR_NOMEM. */
rf_status rf_model_tp_set_full(rf_model_tp *tp, const float *full);

/* Reads this rank's shard from the Hugging Face model directory `dir` (safetensors, single or
 * sharded; F32, BF16 or F16, converted exactly as rf_model_load converts) without reading the
 * rest: only the blocks this rank holds are converted, so the rank's memory is its shard's.
 * Into tp->m->params when dst is NULL (under LoRA its frozen base: the adapters after it are
 * left as they are), else into dst (tp->m->n_params floats on the back end, e.g. an AdamW
 * moment), each tensor named view name + suffix. With no suffix a missing
 * score.weight starts at zero and tensors the model does not use are refused, as
 * rf_model_load does; the shapes in the files must be the whole model's. On the CPU back end
 * the blocks are converted straight into place (after an error the buffer may hold some of
 * them). Errors (naming the
 * file and tensor): RF_ERR_IO, RF_ERR_FORMAT, RF_ERR_UNSUPPORTED, RF_ERR_NOMEM. No
 * communication: each rank of the group calls it for itself. Implemented in model_tp_io.c. */
rf_status rf_model_tp_load(rf_model_tp *tp, const char *dir, float *dst, const char *suffix);

/* Floats [a, a + n) of a flat buffer read from st into host dst (n floats), converted to f32:
 * the buffer of a whole model laid out by views (n_views; shards NULL), or of a
 * tensor-parallel rank's shard (shards: the block of each view held, rf_model_tp's), each
 * view the tensor view name + suffix of st with the whole tensor's shape. A range may span
 * several tensors and begin or end inside a row; nothing else is read: one rank's ZeRO-1
 * block of a checkpoint's optimizer moments. Floats of the range no view covers are left as
 * they are. Errors: rf_st_read_block_f32's, naming the file and tensor; RF_ERR_ARG for a range
 * past the buffer. Implemented in model_tp_io.c. */
rf_status rf_model_read_range(const rf_param_view *views, int n_views, const rf_shard *shards, const rf_safetensors *st,
                              const char *suffix, size_t a, size_t n, float *dst);

/* Takes a local buffer laid out by `shards` (n_views of them, rf_layout_shards; n_floats
 * floats, host memory: e.g. what resharding delivered) as this rank's parameters. RF_ERR_ARG
 * when the buffer is not this rank's shard: another table, another size, or a parameter whose
 * block (rows, columns, offset) differs from the one this rank holds, naming the tensor and
 * both blocks. */
rf_status rf_model_tp_set_shard(rf_model_tp *tp, const rf_shard *shards, int n_views,
                                const float *local, size_t n_floats);

/* LoRA adapters (model/lora.h) on the shard, split like their base matrices (resharding/layout.c):
 * on q, k, v, gate, up (column-parallel) A (r, in) whole on every rank and B (out, r) split by
 * rows as the weight; on o, down (row-parallel) A split by columns as the weight and B whole.
 * Each rank takes its blocks of the values rf_model_lora_attach would give the whole model
 * (the same seed, the same draws), so a tp run starts where a one-rank run does; the base
 * becomes frozen (tp->m->n_frozen) and only the adapters train. The replicated adapters'
 * gradients are partial on each rank (a column-parallel A sees this rank's output rows; a
 * row-parallel B this rank's share of u) and are summed over the group at the end of each
 * backward pass, as the replicated norms are: no collective is added to forward or backward (o
 * and down's partial products join the allreduce of the layer's output). Before
 * rf_model_tp_enable_training, on a shard without adapters that owns its parameters; errors as
 * rf_model_lora_attach's (naming the lora keys), RF_ERR_NOMEM. No communication. */
rf_status rf_model_tp_lora_attach(rf_model_tp *tp, const rf_lora_opts *o);

/* The same adapters bound over the buffer a shard borrows (rf_model_tp_init_borrowed: a
 * colocated rollout rank over its training rank's shard, which rf_model_tp_lora_attach gave the
 * same options): the table and blocks only, the values the buffer's (model/lora.h
 * rf_model_lora_bind). Errors as rf_model_lora_bind's, RF_ERR_NOMEM. No communication. */
rf_status rf_model_tp_lora_bind(rf_model_tp *tp, const rf_lora_opts *o);

/* Gradients and AdamW state for the shard (rf_model_enable_training on tp->m). AdamW then runs
 * on tp->m as on any model: elementwise, every rank on its own shard; replicated parameters
 * stay identical because their gradients are. */
rf_status rf_model_tp_enable_training(rf_model_tp *tp);
void rf_model_tp_zero_grad(rf_model_tp *tp);

/* Forward over a packed batch (the same on every rank), keeping what backward needs; tp->h
 * holds the final hidden states (T, C), whole, on every rank. 2 L + 1 allreduces of T x C.
 * Errors: as rf_model_forward (bad token ids, positions past the model's limit), comm's. */
rf_status rf_model_tp_forward(rf_model_tp *tp, const rf_batch *b);

/* Per-token log-prob of targets (T, whole-vocabulary ids) and entropy (T; NULL = skip) at
 * temperature 1/inv_temp from the last forward, vocabulary-parallel (module comment); host
 * outputs, identical on every rank. Keeps what rf_model_tp_backward needs. */
rf_status rf_model_tp_logprobs(rf_model_tp *tp, const int32_t *targets, float inv_temp,
                               float *logp, float *entropy);

/* Value head outputs (T) from the last forward (host; the head is replicated: no
 * communication). */
rf_status rf_model_tp_values(rf_model_tp *tp, float *values);

/* This rank's slice of the logits, (n_rows, Vl) on the host, for selected rows of the last
 * forward (vocabulary [v0, v0 + Vl)). No communication. */
rf_status rf_model_tp_logits(rf_model_tp *tp, const int *rows, int n_rows, float *logits);

/* Backward from host upstream gradients dlogp (T), dentropy (T) (either NULL; needs a prior
 * rf_model_tp_logprobs) and dvalues (T) for a value head, the same on every rank. Accumulates
 * into tp->m->grads: afterwards every parameter's gradient shard equals the slice of the
 * gradient one rank with the whole model would have (replicated parameters: whole, equal on
 * every rank). 2 L + 1 allreduces of T x C and one of the partial replicated gradients. Calls
 * tp->m's backward hook (rf_model_set_grad_hook: data parallelism over the ranks holding the
 * same shard) in rf_model_backward's order over the shard's flat buffer; a partial replicated
 * gradient (q/k norms, replicated k/v) is final only once summed at the end, so the ranges
 * below the highest such view are reported after that sum, in one piece. */
rf_status rf_model_tp_backward(rf_model_tp *tp, const float *dlogp, const float *dentropy,
                               const float *dvalues);

/* The whole model's sum of squared gradients (split parameters summed over the ranks,
 * replicated ones counted once), in double, identical on every rank: for gradient clipping. */
rf_status rf_model_tp_grad_sumsq(rf_model_tp *tp, double *out);

/* Sum over the group of one double per rank (`local`), added in rank order so that every rank
 * gets the same bits. One allgather of 8 bytes per rank. */
rf_status rf_model_tp_sum(rf_model_tp *tp, double local, double *out, const char *what);

/* Is view i of the shard replicated (whole on every rank of the group)? */
int rf_model_tp_replicated(const rf_model_tp *tp, int i);

/* Copies the replicated tensors of a local flat buffer `buf` (the shard's layout, e.g.
 * tp->m->params) from rank 0 of the group to every other rank: one broadcast of the replicated
 * floats. Data parallelism over a tp x dp grid calls it after each optimizer step: every
 * position's gradients are summed over its own data-parallel group, whose reduction order may
 * differ between positions (the same tensor sits at another offset of another bucket), and
 * the replicated tensors must stay the same bits on every rank of the group. */
rf_status rf_model_tp_bcast_replicated(rf_model_tp *tp, float *buf, const char *what);

/* KV cache holding this rank's k/v heads (KVA of them) for n_slots sequences of max_len
 * positions. Free with rf_kv_cache_free(c, tp->m). */
rf_status rf_model_tp_kv_cache_init(rf_model_tp *tp, rf_kv_cache *c, int n_slots, int max_len);

/* rf_model_decode with tensor parallelism: runs new tokens of several cache slots (the same on
 * every rank) through the model, appends this rank's keys/values to c and writes this rank's
 * slice of the logits of each slot's last new token to logits (n, Vl) on the host. Combine
 * with rf_model_tp_greedy or rf_model_tp_gather_logits. */
rf_status rf_model_tp_decode(rf_model_tp *tp, rf_kv_cache *c, const int *slots,
                             const int *counts, int n, const int32_t *tokens, float *logits);

/* Paged KV pool (rollout/kv_pool.h) of n_blocks blocks of block_size positions holding this
 * rank's k/v heads (KVA of them), for rf_model_tp_decode_paged. Block ids mean the same on
 * every rank of the group: the engine on rank 0 keeps the bookkeeping (free list, references)
 * for all of them. Free with rf_kv_pool_free. */
rf_status rf_model_tp_kv_pool_init(rf_model_tp *tp, rf_kv_pool *p, int n_blocks, int block_size);

/* rf_model_decode_paged with tensor parallelism: the same sequences, block tables and tokens
 * on every rank; each rank writes its k/v heads into its own pool and writes its slice (n, Vl)
 * of the logits of each sequence's last new token on the host. 2 L + 1 allreduces. Errors as
 * rf_model_decode_paged, RF_ERR_ARG for a pool of other heads, comm's. */
rf_status rf_model_tp_decode_paged(rf_model_tp *tp, rf_kv_pool *pool, const rf_paged_seq *seqs, int n,
                                   const int32_t *tokens, float *logits);

/* Greedy choice over the whole vocabulary from each rank's slice (n, Vl) of n rows of logits:
 * tokens (n) the argmax (lowest id on ties, as rf_sample), logp (n; NULL = skip) its
 * log-probability at temperature 1. One allgather of three numbers per row; identical on
 * every rank. */
rf_status rf_model_tp_greedy(rf_model_tp *tp, const float *logits, int n, int32_t *tokens,
                             float *logp);

/* Sampling from each rank's slice (n_rows, Vl) of n_rows rows of logits, without whole rows:
 * draw i (draws[i]: its row, sampling and uniform) gives tokens[i] and logp[i] as rf_sample_u
 * on the whole row gives them, up to the rounding of the row's log-sum-exp (summed per slice).
 * Every rank calls it with the same draws (a row may be drawn from several times; every draw
 * of a row must have the same temperature) and gets the same tokens. Collectives: one
 * allgather of each row's (max, sum, argmax) per rank; for draws in id order (no top-k, no
 * top-p) one allgather of each rank's pick, made by the rank whose slice holds the draw's
 * point of the cumulative distribution; for top-k / top-p rows, one allgather of each rank's
 * candidate count and one of the candidates themselves (its top-k, and the part of the nucleus
 * it can hold), merged and drawn from as rf_sample_sorted. RF_ERR_ARG for a row outside
 * [0, n_rows); comm's errors. */
rf_status rf_model_tp_sample(rf_model_tp *tp, const float *logits, int n_rows, const rf_draw *draws, int n_draws,
                             int32_t *tokens, float *logp);

/* Gathers the slices (n, Vl) of every rank into whole rows full (n, V) on every rank (for
 * samplers that need the whole distribution, rf_sample). One allgather of n x ceil(V/tp). */
rf_status rf_model_tp_gather_logits(rf_model_tp *tp, const float *logits, int n, float *full);

#endif
