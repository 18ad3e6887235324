/* The kernel interface: every tensor operation the model uses, with one signature shared by
 * the CPU reference back end (kernels/cpu/, oneDNN + OpenMP) and the CUDA back end
 * (kernels/cuda/, cuBLAS + hand-written kernels).
 *
 * A back end is an rf_kernels table of function pointers (the ggml {iface} idea). Model code
 * calls ops only through the table, so the same forward/backward runs on either back end, and
 * tests run every op on every back end present and compare with the CPU one.
 *
 * Conventions for all ops:
 *  - fp32 everywhere in memory (set_precision may make matrix products round their operands to
 *    bf16, accumulating in fp32); all pointers are in the back end's memory (host for CPU, device for
 *    CUDA). Shapes in comments are row-major, last dimension contiguous.
 *  - Linear weights use the Hugging Face layout (out_features, in_features): y = x W^T + b.
 *  - Packed variable-length batches: `cu_seqlens` (n_seq + 1) holds token offsets; sequence s
 *    owns rows cu_seqlens[s] .. cu_seqlens[s+1]-1. No padding anywhere.
 *  - Backward ops ACCUMULATE (+=) into parameter gradients (dw, dbias, dweight). Activation
 *    gradients are OVERWRITTEN unless the comment says "accumulates".
 *  - Index arrays (tokens, targets, positions, offsets) are int32 in the back end's memory.
 *  - The CUDA back end runs every op on its own stream (created by rf_cuda_kernels); ops are
 *    asynchronous there and ordered on that stream. The CPU back end is synchronous and uses
 *    OpenMP inside ops; calls themselves are not thread-safe. */
#ifndef RF_KERNELS_H
#define RF_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rf_kernels rf_kernels;

/* One draw of sample_rows: from logits row `row`, greedy (argmax) or at inverse temperature
 * inv_temp with the uniform u in [0, 1). */
typedef struct rf_row_draw {
    int32_t row, greedy;
    float inv_temp; /* 1 / temperature; 1 when greedy */
    float unused;
    double u;
} rf_row_draw;

/* Operand precision of a back end's matrix products (model.precision): FP32 everywhere, or BF16
 * operands with fp32 accumulation (weights, activations and gradients stay fp32 in memory; the
 * back end rounds operands to bf16 inside its products). */
typedef enum rf_precision { RF_PRECISION_FP32 = 0, RF_PRECISION_BF16 = 1 } rf_precision;

struct rf_kernels {
    const char *name; /* "cpu" or "cuda" */

    /* ---- memory ---- */
    void *(*alloc)(size_t bytes);          /* zero-filled; NULL on failure (message recorded) */
    void (*free)(void *p);                 /* accepts NULL */
    void (*to_device)(void *dst, const void *host_src, size_t bytes);
    void (*to_host)(void *host_dst, const void *src, size_t bytes); /* synchronises */
    void (*copy)(void *dst, const void *src, size_t bytes);         /* device to device */
    void (*zero)(void *p, size_t bytes);
    void (*sync)(void);
    /* The device's free and total memory in bytes (CPU: MemAvailable and MemTotal of
     * /proc/meminfo); 0 on success, -1 with the message recorded. */
    int (*mem_info)(size_t *free_bytes, size_t *total_bytes);

    /* ---- precision (process-wide for this back end; not thread-safe against running ops) ---- */
    /* Sets the operand precision of every matrix product from now on. RF_OK, or
     * RF_ERR_UNSUPPORTED with the message recorded where the back end lacks it. */
    rf_status (*set_precision)(rf_precision p);
    rf_precision (*get_precision)(void);
    /* Tells the back end that parameter memory was written (optimizer step, load, resharding):
     * converted or reordered weight copies it keeps are stale from now on. Cheap; call after
     * every such write. */
    void (*weights_updated)(void);

    /* ---- elementwise ---- */
    /* a[i] += b[i] */
    void (*add_inplace)(float *a, const float *b, size_t n);
    /* x[i] *= s */
    void (*scale)(float *x, float s, size_t n);
    /* Returns sum x[i]^2 in double (synchronises on CUDA). */
    double (*sum_squares)(const float *x, size_t n);

    /* ---- matmul: out (T, OC) = inp (T, C) @ w (OC, C)^T + bias (OC; NULL = none) ---- */
    void (*matmul_forward)(float *out, const float *inp, const float *w, const float *bias,
                           int T, int C, int OC);
    /* dinp (T, C) = dout @ w (overwritten; NULL = skip); dw (OC, C) += dout^T @ inp;
     * dbias (OC) += column sums of dout (NULL = skip). */
    void (*matmul_backward)(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, int T, int C, int OC);

    /* ---- embedding: out (T, C) = wte[tokens[t]]; a negative id gives a zero row (on a
     * vocabulary-parallel rank, a token outside its slice) ---- */
    void (*embedding_forward)(float *out, const int32_t *tokens, const float *wte, int T, int C);
    /* dwte (V, C) += scatter of dout (T, C) by tokens; negative ids add nothing. */
    void (*embedding_backward)(float *dwte, const float *dout, const int32_t *tokens, int T,
                               int C);

    /* ---- RMSNorm over rows: out = inp * rstd * w, rstd = 1/sqrt(mean(inp^2) + eps) ---- */
    /* out, inp (N, C); w (C); rstd (N) saved for backward (NULL = don't save). */
    void (*rmsnorm_forward)(float *out, float *rstd, const float *inp, const float *w, int N,
                            int C, float eps);
    /* dinp (N, C) ACCUMULATES; dw (C) += (NULL = skip); uses rstd from forward. */
    void (*rmsnorm_backward)(float *dinp, float *dw, const float *dout, const float *inp,
                             const float *w, const float *rstd, int N, int C);
    /* The residual add fused with the RMSNorm that follows it (one pass over the rows, one
     * launch on CUDA): x (N, C) += add (N, C), then out, rstd as rmsnorm_forward of the new x.
     * The same bits as add_inplace then rmsnorm_forward on each back end. */
    void (*add_rmsnorm_forward)(float *x, float *out, float *rstd, const float *add, const float *w,
                                int N, int C, float eps);

    /* ---- RoPE, Hugging Face "rotate_half" pairing (i, i + D/2), in place ---- */
    /* x (T, H, D); pos (T); inv_freq (D/2), computed on the host from rope_theta and
     * rope_scaling (see model/config.c). Backward is the same op with sign = -1. */
    void (*rope)(float *x, const int32_t *pos, const float *inv_freq, int T, int H, int D,
                 int sign);
    /* rope on q (T, H, D) and k (T, KVH, D) together: each (t, i) angle's cosine and sine once
     * for all H + KVH heads (one launch on CUDA). The same bits as rope on q then on k. */
    void (*rope_qk)(float *q, float *k, const int32_t *pos, const float *inv_freq, int T, int H,
                    int KVH, int D, int sign);

    /* ---- causal attention with GQA over packed variable-length sequences ---- */
    /* For sequence s, queries are q rows q_off[s]..q_off[s+1]-1 and keys/values are rows
     * k_start[s]..k_start[s]+k_len[s]-1 of k and v. Causality is bottom-right aligned: local
     * query i sees keys 0..i + (k_len - q_len) (so a KV cache holding past tokens works, and
     * training passes k_start = q_off, k_len = q_len). Query head h reads KV head
     * h / (H / KVH). Scale 1/sqrt(D).
     * out (Tq, H, D); lse (Tq, H) log-sum-exp of scaled scores, saved for backward (NULL = no);
     * q (Tq, H, D); k, v (rows, KVH, D). */
    void (*attention_forward)(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *q_off, const int32_t *k_start,
                              const int32_t *k_len, int n_seq, int H, int KVH, int D);
    /* Training layout only (k_start = q_off, k_len = q_len, cu_seqlens = q_off).
     * dq (T, H, D), dk, dv (T, KVH, D) overwritten. Recomputes probabilities from lse. */
    void (*attention_backward)(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                               int H, int KVH, int D);

    /* ---- SwiGLU: out = silu(gate) * up, all (N) ---- */
    void (*swiglu_forward)(float *out, const float *gate, const float *up, size_t n);
    /* dgate, dup overwritten. */
    void (*swiglu_backward)(float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, size_t n);

    /* ---- fused LM head + per-token log-prob and entropy ---- */
    /* logits z = (h (T, C) @ w (V, C)^T) * inv_temp, computed `chunk` rows at a time so the
     * (T, V) matrix never exists at once. logp (T) = log softmax(z)[targets[t]];
     * entropy (T) = -sum p log p (NULL = skip). */
    void (*logprob_forward)(float *logp, float *entropy, const float *h, const float *w,
                            const int32_t *targets, int T, int C, int V, float inv_temp);
    /* Given upstream dlogp (T) and dentropy (T; NULL = zero): dh (T, C) overwritten,
     * dw (V, C) +=. Recomputes the logits chunk by chunk, or (CPU, logits up to 512 MB) uses
     * those the last logprob_forward kept when called on the same h, w (unchanged, and no
     * weights_updated since), sizes and temperature. */
    void (*logprob_backward)(float *dh, float *dw, const float *dlogp, const float *dentropy,
                             const float *h, const float *w, const int32_t *targets, int T,
                             int C, int V, float inv_temp);

    /* ---- AdamW (decoupled weight decay, bias-corrected; Loshchilov & Hutter 2019) ---- */
    /* param, grad, m, v (n); `step` is the 1-based step count after this update. The gradient
     * used is grad[i] * grad_scale (grad-norm clipping folded in: grad is not written), so the
     * update is one pass over the four arrays. */
    void (*adamw)(float *param, const float *grad, float *m, float *v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int step,
                  float grad_scale);

    /* ---- paged KV cache (generation; rollout/kv_pool.h owns the pool) ---- */
    /* One layer's pool: k_pool, v_pool (n_blocks * block_size, KVH, D); pool row
     * r = block * block_size + offset. Writes row t of k, v (T, KVH, D) to pool row slots[t]
     * (slots (T) distinct). */
    void (*paged_kv_write)(float *k_pool, float *v_pool, const float *k, const float *v,
                           const int32_t *slots, int T, int KVH, int D);
    /* attention_forward with keys/values gathered through block tables: key j (< k_len[s]) of
     * sequence s is pool row block_table[s * max_blocks + j / block_size] * block_size +
     * j % block_size. Same bottom-right causal alignment, GQA mapping and scale as
     * attention_forward; no lse (decoding keeps nothing for backward).
     * out (Tq, H, D); q (Tq, H, D); q_off (n_seq + 1); block_table (n_seq, max_blocks);
     * k_len (n_seq). */
    void (*paged_attention_forward)(float *out, const float *q, const float *k_pool,
                                    const float *v_pool, const int32_t *q_off,
                                    const int32_t *block_table, int max_blocks,
                                    const int32_t *k_len, int n_seq, int block_size, int H,
                                    int KVH, int D);

    /* ---- vocabulary-parallel fused log-prob (tensor parallelism, model/model_tp.h) ---- */
    /* Optional: a back end may leave them NULL; the tensor-parallel model refuses such a back
     * end. Both back ends have them (CUDA's ran on one H200, test_model_tp_cuda). This rank holds rows [v0, v0 + Vl) of the LM head, w
     * (Vl, C); its logits z = (h (T, C) @ w^T) * inv_temp are made `chunk` rows at a time as
     * in logprob_forward, so neither (T, Vl) nor (T, V) exists at once. Per token t, over this
     * slice only: lmax (T) = max z; sumexp (T) = sum exp(z - lmax); zsum (T) =
     * sum exp(z - lmax) * (z - lmax); ztgt (T) = z[targets[t] - v0] when the target is in the
     * slice, else 0. targets hold whole-vocabulary ids. The caller combines the slices of all
     * ranks (max, then sums) into log-probs and entropies. */
    void (*logprob_vp_partials)(float *lmax, float *sumexp, float *zsum, float *ztgt,
                                const float *h, const float *w, const int32_t *targets, int T,
                                int C, int Vl, int v0, float inv_temp);
    /* Backward over the slice, given the whole vocabulary's lse (T) of z and entropy (T) from
     * the forward and upstream dlogp (T), dentropy (T; either may be NULL = zero): dh (T, C)
     * overwritten with this slice's share (the sum over the ranks is the whole gradient);
     * dw (Vl, C) +=. Recomputes the slice's logits chunk by chunk. */
    void (*logprob_vp_backward)(float *dh, float *dw, const float *dlogp, const float *dentropy,
                                const float *lse, const float *entropy, const float *h,
                                const float *w, const int32_t *targets, int T, int C, int Vl,
                                int v0, float inv_temp);

    /* ---- grouped-query heads of a tensor-parallel rank whose query heads h0 .. h0 + H - 1
     * (of the whole model's) do not split evenly over its KV k/v heads: local query head i
     * attends over local k/v head (h0 + i) / group - h0 / group, group = the whole model's
     * query heads per k/v head ---- */
    /* dst (T, H, D): each query head's copy of its k/v head's row of src (T, KV, D). */
    void (*heads_expand)(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group);
    /* The transpose: dst (T, KV, D) = for each k/v head the sum, over its query heads in
     * order, of their rows of src (T, H, D); overwritten. */
    void (*heads_reduce)(float *dst, const float *src, int T, int H, int KV, int D, int h0, int group);

    /* ---- sampling (rollout: the logits stay in the back end's memory) ---- */
    /* For each of n draws (a host array), a token drawn from row draws[i].row of logits (rows,
     * V) as kernels/sample.h's rf_draw_whole draws it: greedy the largest logit (lowest id
     * among equal ones), else the first id whose cumulative probability in id order exceeds u
     * times the total, at inv_temp; picks (n) and logp (n, the pick's log-probability at
     * inv_temp) are host arrays. Synchronises. The CPU gives rf_draw_whole's bits; CUDA sums
     * in another order (double), so a pick can differ only where u falls within rounding of a
     * boundary between two ids. */
    void (*sample_rows)(int32_t *picks, float *logp, const float *logits, int V, const rf_row_draw *draws,
                        int n);
    /* For each of n draws (a host array; greedy and u are not read), lse[i] (host) = the
     * log-sum-exp of row draws[i].row at draws[i].inv_temp exactly as sample_rows and the
     * log-prob kernels compute it, so that rf_logprob_given_lse(z[id], inv_temp, lse[i])
     * (kernels/sample.h) is the log-prob sample_rows reports for id: the log-prob of a token
     * drawn on the host from a copy of the row (top-k / top-p, a group's late samples drawing
     * from their prompt's saved logits) as the back end would report it. Synchronises. */
    void (*row_lse)(float *lse, const float *logits, int V, const rf_row_draw *draws, int n);

    /* ---- frozen weights and kept memory (last: the CUDA table is positional) ---- */
    /* Optional (NULL: the back end lacks it; CUDA does). Makes floats [base, base + n) of
     * parameter memory stand for the bf16 values data (n; same offsets), which the caller keeps
     * alive and unchanged until it unbinds (data NULL): matrix products and embedding lookups
     * reading those addresses use data (in bf16 mode directly as operands, otherwise widened to
     * fp32, exactly), so the fp32 memory of matrices never needs to exist. Other ops (norms,
     * biases) read base's floats as always. For weights that never change (a frozen model:
     * rf_model_load_frozen). RF_OK, or an error with the message recorded. */
    rf_status (*bind_bf16)(const float *base, const uint16_t *data, size_t n);
    /* Optional (NULL: nothing to do): gives back memory the back end keeps between calls for
     * speed (the CPU's saved LM-head logits, up to 512 MB); it grows again on use. Between ops
     * only. rf_model_trim calls it. */
    void (*trim)(void);
    /* Optional (NULL: nothing to gain; CUDA). The floats [p, p + rows * cols) are an activation
     * that matrix products will read (as their input, or as a weight gradient's) and that does
     * not change until owner (any address naming the caller: a model) releases it or holds p
     * again: the back end may convert it to the products' operand precision once for all of
     * them (the CPU in bf16 mode: the same bits as converting at each product). Held before the
     * op that writes it, which then writes it whole: that op may write only the converted
     * values (the CPU with native bf16), so only matrix products may read it, and its floats
     * hold garbage while held and after. Held after it is written, its floats stay as written
     * for any op. Freeing the memory through free() drops the hold. */
    void (*operand_hold)(const void *owner, const float *p, int rows, int cols);
    /* Every hold of owner ends (others' stay). Cheap; the CPU keeps the conversions' memory for
     * the next holds, and trim gives it back. */
    void (*operands_release)(const void *owner);
};

/* The CPU back end (always present). Static storage; never freed. */
const rf_kernels *rf_cpu_kernels(void);

/* Whether the CPU back end's matrix products are batch-invariant on this CPU at its current
 * precision: each row of a product gets the bits it would get among any number of rows. 1 where
 * oneDNN runs its AVX-512 brgemm kernels (measured: avx512_core_bf16; at bf16 only where the CPU
 * has AVX512-BF16: oneDNN's bf16 emulation on plain AVX-512 is not), whose products of 1 to 300
 * rows give a row the same bits; every product then goes to oneDNN, decoding's 1-4-row ones
 * included. 0 with its AVX2 kernels (there a row's bits depend on the number of rows at every
 * size, and products of 1-4 rows take the back end's matrix-vector loops) and with AMX (not
 * measured). Where 1, a sequence's tokens and log-probs do not depend on which sequences share
 * its decoding step, which in a split run depends on when requests and observations arrive:
 * split runs then repeat bit for bit and resume exactly (tests/test_kernels.c checks the rows,
 * tests/test_split_env_resume.c the runs); where 0, they agree to the last bits only. */
int rf_cpu_batch_invariant_exact(void);
/* The same at precision p, whatever the back end's current one. */
int rf_cpu_batch_invariant_exact_at(rf_precision p);

/* Bytes the CPU back end holds in copies of weights, beside the weights themselves, each made
 * once per weights_updated: copies of the forward's operand W^T in oneDNN's own blocked layout
 * (fp32 or bf16, as the precision) and plain bf16 copies (at bf16: the backward's dout W, the
 * matrix-vector loops of 1-4-row products where oneDNN's rows are not batch-invariant, kernels
 * without a blocked layout). */
size_t rf_cpu_gemm_copies_bytes(void);

/* The CUDA back end on `device`: NULL when rlflow was built without CUDA or no GPU is
 * present (message recorded saying which). One device per process: the first call picks it.
 * RF_CUDA_ANY: the device already picked, or the one rf_cuda_select_device named (0 by
 * default). */
#define RF_CUDA_ANY (-1)
const rf_kernels *rf_cuda_kernels(int device);

/* The CUDA back end's stream (a cudaStream_t), on which every op is queued in order; NULL
 * before rf_cuda_kernels has started the back end (or without CUDA). comm's NCCL back end
 * orders its operations after the work queued here (comm.h). */
void *rf_cuda_stream(void);

/* The back end a recipe's or a command's device names: "cpu" (or NULL) the CPU one, "cuda" the
 * CUDA one (RF_CUDA_ANY). NULL with the reason recorded: RF_ERR_NODEVICE for "cuda" where it
 * cannot start, RF_ERR_ARG for another name. */
const rf_kernels *rf_kernels_for(const char *device);

/* The device RF_CUDA_ANY starts on (default 0): a split run's launcher picks each rank's
 * before its role starts the back end. Nothing without CUDA. */
void rf_cuda_select_device(int device);

/* CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies); 0 without the CUDA back end
 * or without a GPU. */
int rf_cuda_device_count(void);

/* The device the CUDA back end runs on; -1 before rf_cuda_kernels has started it (or
 * without CUDA). */
int rf_cuda_current_device(void);

/* Parses a precision setting named by key (a recipe key or a CLI option, for the message):
 * "auto" sets *is_auto, "fp32" / "bf16" set *p. RF_ERR_ARG naming key for anything else. */
rf_status rf_precision_parse(const char *s, const char *key, int *is_auto, rf_precision *p);

/* Sets back end k's precision from setting ("auto" | "fp32" | "bf16"; key names it in
 * messages) and logs the choice ("precision: bf16 (auto: this CPU has AVX512-BF16 or
 * AMX-BF16)"). auto: on the CPU, bf16 where the instruction set oneDNN runs on has AVX512-BF16
 * or AMX-BF16 (ONEDNN_MAX_CPU_ISA applies), else fp32; on CUDA, bf16 where the back end has it,
 * else fp32 with a log line. An explicit "bf16" the back end lacks is an error naming key.
 * *chosen (may be NULL) gets the precision set. Process-wide, like set_precision. */
rf_status rf_kernels_apply_precision(const rf_kernels *k, const char *setting, const char *key,
                                     rf_precision *chosen);

/* Most token rows whose logits the CPU's logprob_forward/backward hold at once (fewer for large
 * vocabularies); the CUDA back end sizes its chunks by memory (cuda_logprob.cu). */
#define RF_LOGPROB_CHUNK 256

#ifdef __cplusplus
}
#endif

#endif
