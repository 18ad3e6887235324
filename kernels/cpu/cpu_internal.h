/* Declarations shared by the files of the CPU back end; each file defines one group of ops. */
#ifndef RF_CPU_INTERNAL_H
#define RF_CPU_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h> /* aligned_alloc */

#include "kernels/kernel_math.h" /* rf_expf_fast */
#include "kernels/kernels.h"
#include "kernels/sample.h"    /* rf_row_softmax_stats, rf_row_lse */

/* kernels/cpu/cpu_gemm.c: C (M, N) = alpha * op(A) @ op(B) + beta * C, row-major as
 * cblas_sgemm; op(A) (M, K) is A (M, K; row stride lda), or A (K, M) read transposed when ta;
 * op(B) (K, N) likewise with tb. b_weight: B is a parameter, whose converted bf16 copy is kept
 * until rf_cpu_gemm_weights_updated. oneDNN underneath; synchronous. */
void rf_cpu_gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc, int b_weight);
/* rf_cpu_gemm where A is the A (the same address, stored shape and row stride, transposed or
 * not) of this thread's previous rf_cpu_gemm or rf_cpu_gemm_same_a call, its values unchanged
 * since: in bf16 mode that call's conversion of A is used again (a backward's dinp and dw
 * products read the same output gradient). The same bits as rf_cpu_gemm. */
void rf_cpu_gemm_same_a(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                        const float *B, int ldb, float beta, float *C, int ldc, int b_weight);
/* rf_cpu_gemm with A given as its bf16 values (rf_cpu_bf16_convert of an fp32 A): in bf16 mode
 * the same bits as rf_cpu_gemm on that fp32 A, without converting it at the call (in fp32 mode,
 * those of rf_cpu_gemm on the bf16 values widened). Read in place where
 * rf_cpu_gemm_a16_direct says so, else widened to fp32 first. A holds room for its stored rows
 * rounded up to 64 (a weight gradient on AMX pads its sum with zero rows there, and writes them). */
void rf_cpu_gemm_a16(int ta, int tb, int M, int N, int K, float alpha, const uint16_t *A, int lda,
                     const float *B, int ldb, float beta, float *C, int ldc, int b_weight);
/* Whether rf_cpu_gemm_a16 reads bf16 values in place now (bf16 products, native): where it
 * does not, a caller gains nothing by giving them. */
int rf_cpu_gemm_a16_direct(void);
/* How many bf16 conversions of an A operand rf_cpu_gemm has made in this process (tests). */
size_t rf_cpu_gemm_a_conversions(void);
/* rf_cpu_gemm's fp32 product without the shape cache and its lock: oneDNN's sgemm, on the
 * calling thread alone when called inside a parallel region (attention's per-head products,
 * whose key counts vary too much from call to call for one primitive per shape). fp32 in
 * both precisions. */
void rf_cpu_gemm_local(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc);
/* Operand precision of rf_cpu_gemm from now on. */
rf_status rf_cpu_gemm_set_precision(rf_precision p);
rf_precision rf_cpu_gemm_get_precision(void);
/* Converted weight copies are stale from now on. */
void rf_cpu_gemm_weights_updated(void);
/* Whether bf16 products of 1-64 rows on large weights run on rf_cpu_amx_gemm where the CPU has
 * AMX (1, the default) or as before it (0: oneDNN's kernel, the matrix-vector loops for 1-4
 * rows; tests compare the two); the previous setting. */
int rf_cpu_gemm_own_amx(int on);
/* Drops the weight copies made from memory [p, p + bytes), which is being freed. */
void rf_cpu_gemm_forget(const void *p, size_t bytes);
/* kernels.h operand_hold / operands_release: products reading the floats [p, p + rows * cols)
 * (as A, or a weight gradient's B: whole or a slice of whole rows) use one conversion of them,
 * made at the first, until the owner releases or holds p again (new values); rf_cpu_gemm_forget
 * drops holds on memory being freed. */
void rf_cpu_operand_hold(const void *owner, const float *p, int rows, int cols);
void rf_cpu_operands_release(const void *owner);
/* Where the op making the held activation p (exactly the n floats of its hold) writes its values:
 * a buffer for their bf16 values (f32_to_bf16 of each, as rf_cpu_bf16_convert makes them) in
 * place of the floats, which stay unwritten (products read the buffer; any other reader of
 * those floats would get garbage, which the hold's contract rules out), where products take
 * bf16 operands natively; else NULL, and the op writes the floats. */
uint16_t *rf_cpu_held_output(const float *p, size_t n);
/* kernels/cpu/cpu_kernels.c: the size from which zero() streams its stores past the caches (the
 * last-level cache's size, 32 MB at least) set to bytes (0: unchanged); the previous one
 * (tests). */
size_t rf_cpu_zero_stream_from(size_t bytes);
/* Frees the conversions' buffers, which released holds keep for the next ones (trim). */
void rf_cpu_operands_trim(void);
/* Whether holds are taken (1, the default) or ignored (0: every product converts its operands,
 * as before holds; tests compare the two); the previous setting. */
int rf_cpu_operands_hold_on(int on);
/* Held activations converted in this process, and the bytes their buffers keep (tests). */
size_t rf_cpu_operands_conversions(void);
size_t rf_cpu_operands_kept_bytes(void);
/* A counter bumped by every rf_cpu_gemm_weights_updated. */
unsigned rf_cpu_gemm_epoch(void);
/* 1 when oneDNN runs bf16 products natively on the instruction set it uses (else bf16 is
 * emulated: bf16-rounded operands in fp32 products). */
int rf_cpu_bf16_native(void);
/* 1 when the instruction set oneDNN uses (ONEDNN_MAX_CPU_ISA applies) has AVX512-BF16 or
 * AMX-BF16. */
int rf_cpu_isa_has_bf16(void);
/* Binds floats [base, base + n) to the bf16 values data (n): products and embedding lookups
 * reading those addresses read data instead (kernels.h bind_bf16). data NULL unbinds base.
 * RF_ERR_NOMEM when 64 ranges are bound already. */
rf_status rf_cpu_bind_bf16(const float *base, const uint16_t *data, size_t n);
/* The bf16 value bound to the float at p, or NULL where p is in no bound range. */
const uint16_t *rf_cpu_bf16_bound(const float *p);
/* n bytes (rounded up to whole 64-byte lines) starting on a 64-byte line, or NULL; free(). The
 * products' operands and outputs: oneDNN's AMX kernels ran 25-35 % slower on ones 16 bytes off
 * a line (docs/kernels.md), which is where glibc's malloc puts large blocks. From
 * RF_CPU_HUGE_MIN bytes, on a 2 MB boundary and in transparent huge pages where the kernel
 * gives them (madvise; THP "madvise" or "always"): a weight copy streamed from memory by
 * decoding then costs a TLB entry a 2 MB, not one a 4 KB block (docs/kernels.md). */
void *rf_cpu_alloc_lines(size_t n);
/* One 64-byte aligned block for n buffers of sz[i] bytes each (each on a 64-byte boundary):
 * p[i] their addresses; returns the block to free, NULL when out of memory (cpu_kernels.c). */
void *rf_cpu_carve(void **p, const size_t *sz, int n);
#define RF_CPU_HUGE_MIN ((size_t)4 << 20) /* blocks from this size go on 2 MB boundaries */
#define RF_CPU_HUGE_ALIGN ((size_t)2 << 20)
/* kernels/cpu/cpu_amx.c: C (M, N) = alpha * A (M, K; fp32, row stride lda) W^T + beta * C on
 * AMX's tiles, for 1 to RF_CPU_AMX_MAX_ROWS rows, with W in oneDNN's blocked bf16 layout
 * "16a64b2a" of the (K, N) operand: block (kb, nb) of 32 inputs x 64 columns at w + kb * sk +
 * nb * sn elements, kbs blocks of inputs (zero past K), columns zero past N. A is rounded to
 * bf16. Only beta 0, or beta 1 with alpha 1. 1 when done; 0 where AMX cannot run here (no
 * compiler support, the OS refused the tile state), the arguments are outside that, or memory
 * is short. */
#define RF_CPU_AMX_MAX_ROWS 64
/* The smallest weight (bytes in bf16) whose products rf_cpu_gemm gives rf_cpu_amx_gemm. */
#define RF_CPU_AMX_MIN_BYTES ((size_t)1 << 20)
int rf_cpu_amx_gemm(int M, int N, int K, float alpha, const float *A, int lda, const uint16_t *w,
                    long sk, long sn, int kbs, float beta, float *C, int ldc);
/* 1 when this process may use AMX's tiles (asked of the OS once). */
int rf_cpu_amx_ready(void);
/* 1 when rf_cpu_amx_gemm takes a product of M rows with this alpha and beta here. */
int rf_cpu_amx_fits(int M, float alpha, float beta);
/* How many products rf_cpu_amx_gemm has run in this process (tests). */
size_t rf_cpu_amx_products(void);
/* Tile products on AMX (rf_cpu_amx_ready first): tiles_begin loads the tile configuration
 * (tiles 0-7 of 16 rows x 64 bytes) on the calling thread, tiles_end releases it. tile_gemm:
 * C (M, N; fp32, row stride ldc) = (acc ? C : 0) + A (M, K; bf16, row stride lda) B, B given as
 * pairs (K / 2 rows of N uint32, row stride ldb: element (p, n) holds B[2p][n] in its low half,
 * B[2p + 1][n] in its high half); M a multiple of 16, N and K multiples of 32. A row's
 * outputs do not depend on the other rows. */
void rf_cpu_amx_tiles_begin(void);
void rf_cpu_amx_tiles_end(void);
void rf_cpu_amx_tile_gemm(int M, int N, int K, const uint16_t *A, int lda, const uint32_t *B, int ldb,
                          float *C, int ldc, int acc);
/* 1 when the instruction set oneDNN uses (ONEDNN_MAX_CPU_ISA applies) has AMX: its bf16
 * products run on the tiles, and so do rf_cpu_gemm's own (rf_cpu_gemm_own_amx). */
int rf_cpu_isa_amx(void);
/* x rounded to the nearest bf16 value (ties to even), as a float. */
float rf_cpu_bf16_round(float x);
/* d[0, n) = s[0, n) rounded to bf16 as the products' operands are (the upper 16 bits of
 * rf_cpu_bf16_round's value; a NaN quieted, its sign and upper payload kept). */
void rf_cpu_bf16_convert(uint16_t *d, const float *s, int n);

void rf_cpu_matmul_forward(float *out, const float *inp, const float *w, const float *bias, int T,
                           int C, int OC);
void rf_cpu_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, int T, int C, int OC);
void rf_cpu_attention_forward(float *out, float *lse, const float *q, const float *k,
                              const float *v, const int32_t *q_off, const int32_t *k_start,
                              const int32_t *k_len, int n_seq, int H, int KVH, int D);
/* Queries per forward task (cpu_attention.c); query rows per backward block. */
#define RF_ATT_QT 64
#define RF_ATT_QB 64
/* The forward's tasks: (sequence, KV head, first query) triples, one per KV head and block of
 * RF_ATT_QT queries of each sequence, the blocks with most keys first. Caller frees; NULL when
 * out of memory. */
int32_t *rf_cpu_attn_tasks(const int32_t *q_off, int n_seq, int KVH, int *n_tasks);
/* Task t of rf_cpu_attn_tasks: sequence *s, KV head *kvh, first query *i0, its *nq queries
 * (at most RF_ATT_QT) and the *nk keys they see (0 or more); *off = k_len - q_len (a query i
 * sees keys up to i + *off). */
static inline void rf_cpu_attn_task(const int32_t *tasks, int t, const int32_t *q_off, const int32_t *k_len,
                                    int *s, int *kvh, int *i0, int *off, int *nq, int *nk) {
    *s = tasks[3 * t], *kvh = tasks[3 * t + 1], *i0 = tasks[3 * t + 2];
    int qlen = q_off[*s + 1] - q_off[*s];
    *off = k_len[*s] - qlen;
    *nq = qlen - *i0 < RF_ATT_QT ? qlen - *i0 : RF_ATT_QT;
    int n = *i0 + *nq + *off < k_len[*s] ? *i0 + *nq + *off : k_len[*s];
    *nk = n > 0 ? n : 0;
}
/* Fills krow[j], vrow[j] (j < n) with the addresses of key and value row j (D floats each) of KV
 * head kvh of sequence s: how a KV layout (contiguous, paged) is read by rf_cpu_attend_tasks. */
typedef void (*rf_cpu_kv_rows)(const float **krow, const float **vrow, const void *ctx, int s,
                               int kvh, int n, int D);
/* The forward over the tasks of rf_cpu_attn_tasks (every row by the same arithmetic,
 * cpu_attention.c): out (Tq, H, D), lse (Tq, H) or NULL, q (Tq, H, D); sequence s's query i
 * sees its keys 0 .. i + k_len[s] - q_len(s). max_k >= every k_len. OpenMP over tasks. */
void rf_cpu_attend_tasks(float *out, float *lse, const float *q, const int32_t *q_off,
                         const int32_t *k_len, const int32_t *tasks, int n_tasks, int max_k,
                         int H, int KVH, int D, rf_cpu_kv_rows rows, const void *ctx);
/* dst (cols, ldd) = the first n rows (cols 32-bit values each, at rows[j]) transposed, columns
 * [n, npad) zero (npad a multiple of 16); bits copied as they are (cpu_attention.c). */
void rf_cpu_transpose32(float *dst, int ldd, const float *const *rows, int n, int npad, int cols);
/* Attention on AMX's tiles (cpu_attention_amx.c), at precision bf16 where the instruction set
 * oneDNN uses has AMX and the OS lets this process use the tiles. RLFLOW_CPU_ATTENTION chooses:
 *  - "auto" (or unset): the backward on the tiles for head dims of RF_CPU_ATT_AUTO_MIN_D and
 *    more, the forward in fp32 arithmetic (decoding would convert its whole fp32 KV cache to
 *    bf16 at every step: docs/kernels.md);
 *  - "bf16": both passes on the tiles, any head dim;
 *  - "fp32": fp32 arithmetic at every precision. */
enum rf_cpu_att_mode { RF_CPU_ATT_FP32 = 0, RF_CPU_ATT_AUTO = 1, RF_CPU_ATT_BF16 = 2 };
#define RF_CPU_ATT_AUTO_MIN_D 64
int rf_cpu_attention_amx_forward(void);
int rf_cpu_attention_amx_backward(int D);
/* Sets the mode as RLFLOW_CPU_ATTENTION would (tests); returns the one before. */
int rf_cpu_attention_mode(int mode);
void rf_cpu_attend_tasks_amx(float *out, float *lse, const float *q, const int32_t *q_off,
                             const int32_t *k_len, const int32_t *tasks, int n_tasks, int max_k,
                             int H, int KVH, int D, rf_cpu_kv_rows rows, const void *ctx);
/* The forward's softmax of one row (cpu_attention.c): s[0, vis) scores, m their max; s[j] =
 * exp(s[j] - m) for j < vis, zeros up to vis rounded to 16; returns their sum (16 running
 * partial sums added in a fixed tree). */
float rf_cpu_row_softmax(float *s, int vis, float m);
/* An error naming RLFLOW_CPU_ATTENTION when it holds another value (set_precision reports it). */
rf_status rf_cpu_attention_env_check(void);
void rf_cpu_attention_backward_amx(float *dq, float *dk, float *dv, const float *dout,
                                   const float *q, const float *k, const float *v, const float *out,
                                   const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                                   int H, int KVH, int D);
void rf_cpu_attention_backward(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const int32_t *cu_seqlens, int n_seq, int T,
                               int H, int KVH, int D);
void rf_cpu_logprob_forward(float *logp, float *entropy, const float *h, const float *w,
                            const int32_t *targets, int T, int C, int V, float inv_temp);
void rf_cpu_logprob_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                             const float *h, const float *w, const int32_t *targets, int T,
                             int C, int V, float inv_temp);
void rf_cpu_logprob_vp_partials(float *lmax, float *sumexp, float *zsum, float *ztgt,
                                const float *h, const float *w, const int32_t *targets, int T,
                                int C, int Vl, int v0, float inv_temp);
void rf_cpu_logprob_vp_backward(float *dh, float *dw, const float *dlogp, const float *dentropy,
                                const float *lse, const float *entropy, const float *h,
                                const float *w, const int32_t *targets, int T, int C, int Vl,
                                int v0, float inv_temp);

/* Frees the logits logprob_forward keeps for the backward (the back end's trim). */
void rf_cpu_logprob_trim(void);
/* Bytes of kept logits now held (tests). */
size_t rf_cpu_logprob_kept_bytes(void);

/* The gradient with respect to the raw logits of n rows (of V) of logits z made with inv_temp,
 * inv_temp * dL/dz, given each row's log-sum-exp, entropy, target (targets[r] - v0; out of
 * [0, V): none in this slice) and the gradients of its log-prob and entropy (NULL: 0). Into z
 * in place, or, where zb is given, as bf16 values into zb (n, V) with z left as it was. */
void rf_cpu_logprob_dlogits(float *z, uint16_t *zb, int n, int V, const float *lse,
                            const float *ent, const int32_t *targets, int v0, const float *dlogp,
                            const float *dentropy, float inv_temp);
/* The backward of a chunk of n rows whose logits z (n, V) = inv_temp * h w^T are made: the
 * logit gradients (rf_cpu_logprob_dlogits; as bf16 where the products read them in place,
 * rf_cpu_gemm_a16_direct), then dh (n, C) = dz w and, where dw, dw (V, C) += dz^T h. z is
 * overwritten or left as it was. lse, ent, targets, dlogp, dentropy: the chunk's rows. */
void rf_cpu_logprob_chunk_backward(float *dh, float *dw, float *z, const float *h, const float *w,
                                   int n, int C, int V, const float *lse, const float *ent,
                                   const int32_t *targets, int v0, const float *dlogp,
                                   const float *dentropy, float inv_temp);

/* Rows per chunk of the log-prob kernels: up to RF_LOGPROB_CHUNK, fewer for large vocabularies
 * so that the scratch stays near 32 MB (about 55 rows for a 150k vocabulary). */
int rf_cpu_logprob_chunk_rows(int V);

/* Below these many elements a parallel region costs more than it saves: waking a sleeping
 * OpenMP thread is a system call each way (rlflow's threads sleep when idle, training.md), tens
 * of microseconds, which is more than a few thousand elements of arithmetic (RF_OMP_MIN: norms,
 * RoPE, AdamW, embedding) or tens of thousands of copied or added ones (RF_OMP_MIN_COPY). Every
 * loop they guard computes each element (or row, or column) the same way whichever thread does
 * it, so they decide speed, not bits. */
#define RF_OMP_MIN 16384
#define RF_OMP_MIN_COPY 65536
#define RF_OMP_MIN_EXP 4096 /* an exponential an element (SwiGLU) */

/* SwiGLU (cpu_swiglu.c): vectorised, the bits of kernel_math.h's rf_swiglu / rf_swiglu_grad
 * with the C library's expf. */
void rf_cpu_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
void rf_cpu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, size_t n);

/* out[i] = expf(x[i]) with the bits of glibc's expf (2.27 and later) on this CPU, vectorised
 * (cpu_swiglu.c); what SwiGLU uses, exposed for tests/test_kernels.c. */
void rf_cpu_expf_libm(float *out, const float *x, size_t n);

/* Which evaluation rf_cpu_expf_libm found the C library's expf to be: 0 glibc's plain build,
 * 1 its fused build (FMA + AVX2), 2 neither (expf called per element), 3 the fused build
 * evaluated on AVX-512 (where the CPU has it and that evaluation gives the library's bits). */
int rf_cpu_expf_libm_mode(void);

/* The log-prob kernels' scratch of n floats, reused across calls and shared by the whole-
 * vocabulary and vocabulary-parallel kernels (the back end is not re-entrant: kernels.h). */
float *rf_cpu_logprob_scratch(size_t n);

#endif
