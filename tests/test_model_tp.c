/* Tensor parallelism of the model (model/model_tp.h) against one rank holding the whole model,
 * on tiny random models of three shapes:
 *   gqa     4 query / 2 kv heads, q/k/v and o_proj biases, separate LM head, vocabulary 97 (no
 *           tp divides it): k/v split at tp 2, replicated at tp 4 (one kv head per rank);
 *   qwen3   12 query / 3 kv heads, q/k norms, tied embeddings, vocabulary 61, intermediate 30:
 *           k/v replicated at tp 2 and 4, and on some ranks expanded (query heads straddle kv
 *           heads), so the partial gradients of the replicated k/v and norms are summed;
 *   critic  gqa's shape with a value head.
 * Under mpirun (2 and 4 ranks; with 4, tp 2 runs on two groups at once and tp 4 on all), every
 * rank builds the same whole model (same seed) and its shard of it, and checks:
 *   - forward: log-probs, entropies, the loss, values and logits (its slice, and gathered)
 *     equal one rank's within fp32 tolerance;
 *   - backward over two accumulated micro-batches: every gradient shard equals the slice of the
 *     whole model's gradient (replicated ones whole), the gradient norm too;
 *   - generation: prefill + greedy decode, tokens identical and log-probs and logits close;
 *   - that the checks can fail: a changed weight in one rank's shard moves the log-probs;
 *   - shards read straight from Hugging Face files (F32, BF16 over several files, moments;
 *     ranges of a shard's moments, as ZeRO-1 ranks read their blocks)
 *     equal the cut of the whole model bit for bit; bad files are refused naming the tensor;
 *   - refusals: tp not dividing the attention heads, a buffer of another shard or another size,
 *     a back end without the vocabulary-parallel kernels, a cache of the wrong heads.
 * Without mpirun: the parameter table without buffers, the vocabulary-parallel kernels on
 * slices combined by hand against the whole-vocabulary kernels, and tp = 1 on the single-rank
 * communicator; then mpirun itself (skips, 77, when mpirun is not installed).
 *
 * Tolerances: the ranks compute the same fp32 math with sums split across ranks (a dot product
 * of length K becomes tp partial sums added after), so results differ from one rank's by a few
 * ulp times the length of the sums, ~1e-6 relative; 1e-5 relative (plus 1e-5 of the tensor's
 * largest magnitude for gradients, whose small entries come from cancelling sums) leaves a
 * margin without hiding a wrong slice, which is off by O(1). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common/rng.h"
#include "common/util.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "model/model_tp.h"
#include "model/sampler.h"
#include "resharding/layout.h"
#include "test_comm_util.h"
#include "test_util.h"
#include "tp_shapes.h"

#define RTOL 1e-5

static const char *shape_name[] = {"gqa", "qwen3", "critic"};
static rf_model *whole_model(shape s) {
    rf_model_config c = config_of(s);
    rf_model *m = NULL;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, 7 + s, 0.3f);
    /* biases and norm weights random too (init gives zeros and ones), or a bias added on every
     * rank, or a norm applied to the wrong head, would go unseen */
    rf_rng r;
    rf_rng_seed(&r, 100 + s);
    for (int i = 0; i < m->n_views; i++) {
        const rf_param_view *v = &m->views[i];
        int bias = strstr(v->name, ".bias") != NULL, norm = strstr(v->name, "norm") != NULL;
        for (size_t j = 0; (bias || norm) && j < v->numel; j++)
            m->params[v->offset + j] = bias ? 0.3f * rf_rng_normal(&r) : 1.0f + 0.2f * rf_rng_normal(&r);
    }
    RF_ASSERT(rf_model_enable_training(m) == RF_OK);
    return m;
}

/* Two packed batches: three sequences (5, 1, 7) and two (4, 6). */
static const int32_t tok1[13] = {3, 17, 42, 5, 60, 11, 7, 7, 23, 54, 1, 0, 60};
static const int32_t tgt1[13] = {17, 42, 5, 60, 2, 12, 7, 23, 54, 1, 0, 60, 50};
static const int32_t cu1[4] = {0, 5, 6, 13};
static const int32_t tok2[10] = {9, 8, 33, 2, 44, 45, 46, 13, 0, 5};
static const int32_t tgt2[10] = {8, 33, 2, 59, 45, 46, 13, 0, 5, 19};
static const int32_t cu2[3] = {0, 4, 10};

static double g_worst; /* the largest error seen, as a fraction of its tolerance */

/* |a - b| <= atol + RTOL |b| over n values; prints the worst one when not. */
static int close_all(const char *what, const float *a, const float *b, size_t n, double atol) {
    size_t worst = 0;
    double excess = -1;
    for (size_t i = 0; i < n; i++) {
        double tol = atol + RTOL * fabs((double)b[i]), d = fabs((double)a[i] - b[i]);
        if (d - tol > excess || i == 0) excess = d - tol, worst = i;
        if (tol > 0) g_worst = fmax(g_worst, d / tol);
    }
    if (excess > 0 || isnan(excess))
        fprintf(stderr, "%s: [%zu] = %.9g, one rank has %.9g\n", what, worst, a[worst], b[worst]);
    return n == 0 || excess <= 0;
}

static double max_abs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

/* Per-token upstream gradients of a loss sum a_t logp_t + b_t H_t (or a_t v_t). */
static void upstream(uint64_t seed, int T, float *a, float *b) {
    rf_rng r;
    rf_rng_seed(&r, seed);
    for (int t = 0; t < T; t++) a[t] = rf_rng_normal(&r), b[t] = 0.5f * rf_rng_normal(&r);
}

/* One micro-batch through both models: outputs compared, then backward on both. */
static void forward_backward(rf_model *ref, rf_model_tp *tp, const char *name, int n_seq, int T,
                             const int32_t *tok, const int32_t *tgt, const int32_t *cu, uint64_t seed) {
    rf_batch b = {n_seq, T, tok, NULL, cu};
    float lp[16], ent[16], lp_tp[16], ent_tp[16], a[16], c[16];
    char what[96];
    upstream(seed, T, a, c);
    CHECK_OK(rf_model_forward(ref, &b));
    CHECK_OK(rf_model_tp_forward(tp, &b));
    if (ref->score) {
        CHECK_OK(rf_model_values(ref, lp));
        CHECK_OK(rf_model_tp_values(tp, lp_tp));
        snprintf(what, sizeof what, "%s tp%d: values", name, tp->tp);
        /* a value is a dot product over C of terms ~0.1 to 1: its error scales with those */
        CHECK(close_all(what, lp_tp, lp, (size_t)T, RTOL));
        CHECK_OK(rf_model_backward(ref, NULL, NULL, a));
        CHECK_OK(rf_model_tp_backward(tp, NULL, NULL, a));
        return;
    }
    CHECK_OK(rf_model_logprobs(ref, tgt, 1.0f / 0.9f, lp, ent));
    CHECK_OK(rf_model_tp_logprobs(tp, tgt, 1.0f / 0.9f, lp_tp, ent_tp));
    snprintf(what, sizeof what, "%s tp%d: log-probs", name, tp->tp);
    CHECK(close_all(what, lp_tp, lp, (size_t)T, 1e-6));
    snprintf(what, sizeof what, "%s tp%d: entropies", name, tp->tp);
    CHECK(close_all(what, ent_tp, ent, (size_t)T, 1e-6));
    double loss = 0, loss_tp = 0;
    for (int t = 0; t < T; t++) loss += a[t] * lp[t] + c[t] * ent[t], loss_tp += a[t] * lp_tp[t] + c[t] * ent_tp[t];
    CHECK_CLOSE(loss_tp, loss, 1e-6, RTOL);
    /* logits: this rank's slice, and the gathered whole rows */
    int V = ref->cfg.vocab_size, rows[16];
    for (int i = 0; i < T; i++) rows[i] = i;
    float *full = malloc(sizeof(float) * T * V), *slice = malloc(sizeof(float) * T * tp->Vl),
          *mine = malloc(sizeof(float) * T * tp->Vl), *gathered = malloc(sizeof(float) * T * V);
    CHECK_OK(rf_model_logits(ref, rows, T, full));
    CHECK_OK(rf_model_tp_logits(tp, rows, T, mine));
    /* a logit near zero comes from cancelling terms: its error scales with the largest ones */
    double scale = max_abs(full, (size_t)T * V);
    for (int i = 0; i < T; i++) memcpy(slice + (size_t)i * tp->Vl, full + (size_t)i * V + tp->v0, sizeof(float) * tp->Vl);
    snprintf(what, sizeof what, "%s tp%d: logits of this rank's slice", name, tp->tp);
    CHECK(close_all(what, mine, slice, (size_t)T * tp->Vl, RTOL * scale));
    CHECK_OK(rf_model_tp_gather_logits(tp, mine, T, gathered));
    snprintf(what, sizeof what, "%s tp%d: gathered logits", name, tp->tp);
    CHECK(close_all(what, gathered, full, (size_t)T * V, RTOL * scale));
    free(full), free(slice), free(mine), free(gathered);
    CHECK_OK(rf_model_backward(ref, a, c, NULL));
    CHECK_OK(rf_model_tp_backward(tp, a, c, NULL));
}

/* Every gradient shard against the slice of the whole model's gradient. */
static void compare_grads(rf_model *ref, rf_model_tp *tp, const char *name) {
    rf_param_table pt = rf_param_table_of(ref);
    float *want = malloc(sizeof(float) * tp->m->n_params);
    rf_layout_extract(&pt, tp->shards, ref->grads, want);
    int bad = 0, vacuous = 0;
    for (int i = 0; i < ref->n_views; i++) {
        const rf_param_view *v = &ref->views[i];
        double scale = max_abs(ref->grads + v->offset, v->numel);
        if (scale == 0) vacuous++, fprintf(stderr, "%s: %s has no gradient at all\n", name, v->name);
        const rf_param_view *lv = &tp->m->views[i];
        char what[160];
        snprintf(what, sizeof what, "%s tp%d rank %d: gradient of %s", name, tp->tp, tp->t, v->name);
        if (!close_all(what, tp->m->grads + lv->offset, want + lv->offset, lv->numel, RTOL * scale)) bad++;
    }
    CHECK(bad == 0);
    CHECK(vacuous == 0);
    double ss = ref->k->sum_squares(ref->grads, ref->n_params), ss_tp = -1;
    CHECK_OK(rf_model_tp_grad_sumsq(tp, &ss_tp));
    CHECK_CLOSE(ss_tp, ss, 0, RTOL);
    free(want);
}

/* A weight changed in the last rank's shard must move the log-probs seen on every rank. */
static void sensitivity(rf_model *ref, rf_model_tp *tp, const char *name) {
    const rf_param_view *q = rf_model_find(tp->m, "model.layers.1.self_attn.q_proj.weight");
    float *w = tp->m->params + q->offset + 5, keep = *w;
    if (tp->t == tp->tp - 1) *w += 1.0f;
    tp->m->k->weights_updated(); /* the back end's weight copies follow (kernels.h) */
    rf_batch b = {3, 13, tok1, NULL, cu1};
    float lp[13], lp_tp[13];
    CHECK_OK(rf_model_forward(ref, &b));
    CHECK_OK(rf_model_tp_forward(tp, &b));
    if (ref->score) {
        CHECK_OK(rf_model_values(ref, lp));
        CHECK_OK(rf_model_tp_values(tp, lp_tp));
    } else {
        CHECK_OK(rf_model_logprobs(ref, tgt1, 1.0f, lp, NULL));
        CHECK_OK(rf_model_tp_logprobs(tp, tgt1, 1.0f, lp_tp, NULL));
    }
    double moved = 0;
    for (int t = 0; t < 13; t++) moved = fmax(moved, fabs(lp_tp[t] - lp[t]));
    CHECK(moved > 1e-3);
    if (!(moved > 1e-3)) fprintf(stderr, "%s tp%d: a changed shard moved the outputs by %g only\n", name, tp->tp, moved);
    *w = keep;
    tp->m->k->weights_updated();
}

/* Prefill two prompts into slots 2 and 0, then greedy steps: tokens identical, log-probs and
 * logits close to one rank's. */
static void generation(rf_model *ref, rf_model_tp *tp, const char *name) {
    int V = ref->cfg.vocab_size, Vl = tp->Vl;
    rf_kv_cache kv, kv_tp;
    CHECK_OK(rf_kv_cache_init(&kv, ref, 3, 32));
    CHECK_OK(rf_model_tp_kv_cache_init(tp, &kv_tp, 3, 32));
    CHECK(kv_tp.KVH == tp->KVA);
    int slots[2] = {2, 0}, counts[2] = {5, 7};
    int32_t toks[12] = {3, 17, 42, 5, 60, 7, 7, 23, 54, 1, 0, 9}, next[2], next_tp[2];
    float *lg = malloc(sizeof(float) * 2 * V), *lg_tp = malloc(sizeof(float) * 2 * Vl),
          *gathered = malloc(sizeof(float) * 2 * V), work[2 * 128];
    rf_sampling greedy = {.greedy = 1};
    int same = 1, lp_ok = 1, logits_ok = 1;
    char what[96];
    snprintf(what, sizeof what, "%s tp%d: decode logits", name, tp->tp);
    for (int step = 0; step < 9; step++) {
        const int32_t *in = step == 0 ? toks : next;
        CHECK_OK(rf_model_decode(ref, &kv, slots, counts, 2, in, lg));
        CHECK_OK(rf_model_tp_decode(tp, &kv_tp, slots, counts, 2, in, lg_tp));
        float lp[2], lp_tp[2];
        for (int i = 0; i < 2; i++) next[i] = rf_sample(lg + (size_t)i * V, V, &greedy, NULL, &lp[i], work);
        CHECK_OK(rf_model_tp_greedy(tp, lg_tp, 2, next_tp, lp_tp));
        CHECK_OK(rf_model_tp_gather_logits(tp, lg_tp, 2, gathered));
        logits_ok &= close_all(what, gathered, lg, 2 * (size_t)V, RTOL * max_abs(lg, 2 * (size_t)V));
        for (int i = 0; i < 2; i++) {
            same &= next_tp[i] == next[i];
            lp_ok &= fabs(lp_tp[i] - lp[i]) <= 1e-6 + RTOL * fabs(lp[i]);
            if (next_tp[i] != next[i] || !(fabs(lp_tp[i] - lp[i]) <= 1e-6 + RTOL * fabs(lp[i])))
                fprintf(stderr, "%s tp%d step %d seq %d: token %d logp %.8g, one rank %d %.8g\n", name,
                        tp->tp, step, i, next_tp[i], lp_tp[i], next[i], lp[i]);
        }
        counts[0] = counts[1] = 1;
    }
    CHECK(same);
    CHECK(lp_ok);
    CHECK(logits_ok);
    CHECK(kv_tp.len[2] == 13 && kv_tp.len[0] == 15);
    /* a cache that holds other heads than this rank attends over */
    if (kv.KVH != tp->KVA) {
        int one = 1;
        CHECK_ERR(rf_model_tp_decode(tp, &kv, slots, &one, 1, toks, lg_tp), RF_ERR_ARG, "k/v heads");
    }
    rf_kv_cache_free(&kv, ref);
    rf_kv_cache_free(&kv_tp, tp->m);
    free(lg), free(lg_tp), free(gathered);
}

/* Sampling from slices (rf_model_tp_sample) against rf_sample_u on whole rows: made-up logits
 * (a spread row, a peaked one, one whose maxima tie across the slices, a flat one) under every
 * kind of sampling, 24 draws a row spread over [0, 1): the same tokens, log-probs within 1e-6. */
static void sampling_from_slices(rf_model_tp *tp, const char *name) {
    enum { R = 4, D = 24 };
    int V = tp->cfg.vocab_size;
    float *whole = malloc(sizeof(float) * R * V), *slices = malloc(sizeof(float) * R * tp->Vl),
          *work = malloc(sizeof(float) * 2 * V);
    rf_rng rng;
    rf_rng_seed(&rng, 11);
    for (int j = 0; j < V; j++) {
        whole[j] = 2.0f * (rf_rng_uniform(&rng) - 0.5f);
        whole[V + j] = 12.0f * (rf_rng_uniform(&rng) - 0.5f);
        whole[2 * V + j] = j % 7 == 3 ? 2.0f : (float)(j % 5) * 0.1f;
        whole[3 * V + j] = 0.0f;
    }
    for (int r = 0; r < R; r++) memcpy(slices + (size_t)r * tp->Vl, whole + (size_t)r * V + tp->v0, sizeof(float) * tp->Vl);
    const rf_sampling kinds[] = {{1, 1.0f, 0, 1.0f},   {0, 1.0f, 0, 1.0f},  {0, 0.7f, 0, 1.0f},
                                 {0, 1.3f, 5, 1.0f},   {0, 1.0f, 0, 0.9f},  {0, 0.8f, 20, 0.7f},
                                 {0, 1.0f, V + 5, 1.0f}, {0, 1.0f, 0, 0.3f}, {0, 2.0f, 1, 1.0f}};
    int n_kinds = (int)(sizeof kinds / sizeof *kinds), same = 1, lp_ok = 1;
    rf_draw draws[R * D];
    int32_t tok[R * D];
    float lp[R * D];
    for (int k = 0; k < n_kinds; k++) {
        for (int r = 0; r < R; r++)
            for (int d = 0; d < D; d++)
                draws[r * D + d] = (rf_draw){r, kinds[(k + r) % n_kinds], d == D - 1 ? 0.9999999 : (d + 0.37) / D};
        CHECK_OK(rf_model_tp_sample(tp, slices, R, draws, R * D, tok, lp));
        for (int i = 0; i < R * D; i++) {
            float want_lp;
            int32_t want = rf_sample_u(whole + (size_t)draws[i].row * V, V, &draws[i].s, draws[i].u, &want_lp, work);
            if (tok[i] != want || !(fabs(lp[i] - want_lp) <= 1e-6)) {
                fprintf(stderr, "%s tp%d: row %d (temperature %g, top_k %d, top_p %g, greedy %d) u %.7f: token %d "
                        "logp %.9g, whole row %d %.9g\n", name, tp->tp, draws[i].row, draws[i].s.temperature,
                        draws[i].s.top_k, draws[i].s.top_p, draws[i].s.greedy, draws[i].u, tok[i], lp[i], want, want_lp);
                same &= tok[i] == want, lp_ok &= fabs(lp[i] - want_lp) <= 1e-6;
            }
        }
    }
    CHECK(same);
    CHECK(lp_ok);
    draws[0].row = R;
    CHECK_ERR(rf_model_tp_sample(tp, slices, R, draws, 1, tok, lp), RF_ERR_ARG, "draw 0 is from row 4 of 4");
    free(whole), free(slices), free(work);
}

/* Buffers of another shard, of the whole model, or of the wrong size are refused; this
 * rank's own (cut by the layout) is taken. */
static void shard_refusals(rf_model *ref, rf_model_tp *tp) {
    rf_param_table pt = rf_param_table_of(ref);
    int n = ref->n_views;
    rf_shard *own = calloc((size_t)n, sizeof *own), *other = calloc((size_t)n, sizeof *other);
    size_t n_own = 0, n_other = 0;
    CHECK_OK(rf_layout_shards(&pt, tp->tp, tp->t, own, &n_own));
    float *buf = malloc(sizeof(float) * ref->n_params);
    rf_layout_extract(&pt, own, ref->params, buf);
    CHECK_OK(rf_model_tp_set_shard(tp, own, n, buf, n_own));
    CHECK(memcmp(buf, tp->m->params, sizeof(float) * n_own) == 0);
    CHECK_ERR(rf_model_tp_set_shard(tp, own, n, buf, n_own - 1), RF_ERR_ARG, "floats");
    CHECK_ERR(rf_model_tp_set_shard(tp, own, n - 1, buf, n_own), RF_ERR_ARG, "parameters");
    /* the next rank's shard: the vocabulary rows of the embedding differ first */
    CHECK_OK(rf_layout_shards(&pt, tp->tp, (tp->t + 1) % tp->tp, other, &n_other));
    CHECK_ERR(rf_model_tp_set_shard(tp, other, n, buf, n_other), RF_ERR_ARG,
              "model.embed_tokens.weight: the buffer holds rows [");
    /* the whole model (tp 1) */
    CHECK_OK(rf_layout_shards(&pt, 1, 0, other, &n_other));
    CHECK_ERR(rf_model_tp_set_shard(tp, other, n, ref->params, n_other), RF_ERR_ARG, "this rank's shard is rows");
    free(own), free(other), free(buf);
}

/* Reads the shard of model directory dir into tp (dst NULL: the parameters) and compares it
 * bit for bit with this rank's cut (rf_layout_extract) of `full` (the whole buffer the files
 * hold, as fp32). */
static void same_as_cut(rf_model_tp *tp, const char *dir, float *dst, const char *suffix, const float *full,
                        const char *what) {
    rf_param_table pt = {&tp->cfg, tp->full_views, tp->n_full_views};
    float *cut = malloc(sizeof(float) * tp->m->n_params);
    rf_layout_extract(&pt, tp->shards, full, cut);
    memset(dst ? dst : tp->m->params, 0xff, sizeof(float) * tp->m->n_params); /* NaNs: nothing left unread */
    CHECK_OK(rf_model_tp_load(tp, dir, dst, suffix));
    int same = memcmp(cut, dst ? dst : tp->m->params, sizeof(float) * tp->m->n_params) == 0;
    if (!same) fprintf(stderr, "shard from files (%s, tp %d, rank %d): differs from the cut\n", what, tp->tp, tp->t);
    CHECK(same);
    free(cut);
}

/* Tensor i of a whole-model buffer (m's views), for rf_model_save_views. */
typedef struct buf_src {
    const rf_model *m;
    const float *buf;
} buf_src;

static rf_status fill_view(void *ctx, int i, float *dst) {
    const buf_src *b = ctx;
    memcpy(dst, b->buf + b->m->views[i].offset, sizeof(float) * b->m->views[i].numel);
    return RF_OK;
}

/* Ranges of this rank's shard buffer read from the files (rf_model_read_range with the shard
 * table, as ZeRO-1 ranks read their blocks of a tensor-parallel shard's moments) equal the
 * same floats of the whole shard read (want): one float, runs starting and ending inside a
 * block's rows, across tensors, all, none; past the end refused. */
static void shard_ranges(rf_model_tp *tp, const char *dir, const float *want, const char *name) {
    rf_safetensors *st = NULL;
    CHECK_OK(rf_st_open_dir(&st, dir));
    size_t n = tp->m->n_params, q = tp->shards[1].offset;
    size_t ranges[][2] = {{0, n}, {0, 1}, {n - 1, 1}, {3, 17}, {q > 2 ? q - 2 : 0, 5}, {n / 3, n / 2}, {7, 0},
                          {q + 1, n - q - 1}};
    float *got = malloc(sizeof(float) * (n + 1));
    int all = st != NULL;
    for (size_t k = 0; all && k < sizeof ranges / sizeof ranges[0]; k++) {
        size_t a = ranges[k][0], c = ranges[k][1];
        got[c] = -1.0f;
        CHECK_OK(rf_model_read_range(tp->full_views, tp->n_full_views, tp->shards, st, ".exp_avg", a, c, got));
        all = memcmp(got, want + a, sizeof(float) * c) == 0 && got[c] == -1.0f;
        if (!all) fprintf(stderr, "%s, shard %d: floats [%zu, %zu) of the shard differ\n", name, tp->t, a, a + c);
    }
    CHECK(all);
    CHECK_ERR(rf_model_read_range(tp->full_views, tp->n_full_views, tp->shards, st, ".exp_avg", n - 1, 2, got), RF_ERR_ARG,
              "floats [");
    free(got);
    rf_st_close(st);
}

/* Shards read straight from Hugging Face files (rf_model_tp_load) equal the cut of the whole
 * model: F32 in one file, BF16 over several files (the values rounded as rf_model_load rounds
 * them), moments under a suffix; a critic from a policy's files has a zero value head; a
 * missing tensor, a wrong shape and an unused tensor are refused naming them. Every rank
 * writes its own copy (its directory, then removed). */
static void shard_files(rf_model *ref, rf_model_tp *tp, shape s) {
    char dir[256], sub[300];
    snprintf(dir, sizeof dir, "/tmp/rf_tp_load_%d_%d_XXXXXX", (int)getpid(), tp->t);
    if (!mkdtemp(dir)) {
        CHECK(0);
        return;
    }
    const char *name = shape_name[s];
    snprintf(sub, sizeof sub, "%s/f32", dir);
    CHECK_OK(rf_model_save(ref, sub, 0, 0));
    same_as_cut(tp, sub, NULL, NULL, ref->params, name);
    /* bf16 in shards of ~2 KB: blocks cross file boundaries of the index */
    snprintf(sub, sizeof sub, "%s/bf16", dir);
    CHECK_OK(rf_model_save(ref, sub, 1, 2048));
    char idx[400];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", sub);
    CHECK(rf_file_exists(idx));
    rf_model *rounded = NULL;
    CHECK_OK(rf_model_load(&rounded, sub, rf_cpu_kernels(), ref->score != NULL));
    if (rounded) same_as_cut(tp, sub, NULL, NULL, rounded->params, name);
    rf_model_free(rounded);
    /* a moment buffer under its checkpoint suffix */
    float *mom = malloc(sizeof(float) * ref->n_params), *dst = malloc(sizeof(float) * tp->m->n_params);
    for (size_t i = 0; i < ref->n_params; i++) mom[i] = (float)i * 1e-3f - 0.5f;
    snprintf(sub, sizeof sub, "%s/moments", dir);
    buf_src moments = {ref, mom};
    CHECK_OK(rf_model_save_views(ref->views, ref->n_views, sub, ".exp_avg", 0, 0, fill_view, &moments));
    same_as_cut(tp, sub, dst, ".exp_avg", mom, name);
    shard_ranges(tp, sub, dst, name);
    CHECK_ERR(rf_model_tp_load(tp, sub, dst, ".exp_avg_sq"), RF_ERR_FORMAT, "not found");
    if (ref->score) { /* a critic from a policy's files: the value head starts at zero */
        rf_model_config pc = ref->cfg;
        pc.value_head = 0;
        rf_model *policy = NULL;
        CHECK_OK(rf_model_init(&policy, &pc, rf_cpu_kernels()));
        rf_model_init_random(policy, 11, 0.3f); /* with an LM head, which the critic has not */
        snprintf(sub, sizeof sub, "%s/policy", dir);
        CHECK_OK(rf_model_save(policy, sub, 0, 0));
        float *want = calloc(ref->n_params, sizeof(float)); /* by name; score.weight zero */
        for (int i = 0; i < ref->n_views; i++) {
            const rf_param_view *v = &ref->views[i], *pv = rf_model_find(policy, v->name);
            if (pv) memcpy(want + v->offset, policy->params + pv->offset, sizeof(float) * v->numel);
        }
        same_as_cut(tp, sub, NULL, NULL, want, "critic from a policy");
        free(want);
        rf_model_free(policy);
    } else { /* a tensor of another shape; a tensor the model does not use */
        rf_model_config bc = ref->cfg;
        bc.intermediate_size += 2;
        rf_model *other = NULL;
        CHECK_OK(rf_model_init(&other, &bc, rf_cpu_kernels()));
        snprintf(sub, sizeof sub, "%s/other", dir);
        CHECK_OK(rf_model_save(other, sub, 0, 0));
        CHECK_ERR(rf_model_tp_load(tp, sub, NULL, NULL), RF_ERR_FORMAT, "model.layers.0.mlp.gate_proj.weight\": shape [");
        rf_model_free(other);
        rf_model_config vc = ref->cfg;
        vc.value_head = 1;
        CHECK_OK(rf_model_init(&other, &vc, rf_cpu_kernels()));
        snprintf(sub, sizeof sub, "%s/extra", dir);
        CHECK_OK(rf_model_save(other, sub, 0, 0));
        CHECK_ERR(rf_model_tp_load(tp, sub, NULL, NULL), RF_ERR_UNSUPPORTED, "tensor \"score.weight\"");
        rf_model_free(other);
    }
    CHECK_OK(rf_remove_tree(dir));
    free(mom), free(dst);
    CHECK_OK(rf_model_tp_set_full(tp, ref->params)); /* as the other checks had it */
}

/* Every check above for one shape on the group g. */
static void check_shape(shape s, rf_comm *g) {
    rf_model *ref = whole_model(s);
    rf_model_tp *tp = NULL;
    CHECK_OK(rf_model_tp_init(&tp, &ref->cfg, rf_cpu_kernels(), g, 60));
    if (!tp) {
        rf_model_free(ref);
        return;
    }
    shard_files(ref, tp, s);
    CHECK_OK(rf_model_tp_set_full(tp, ref->params));
    CHECK_OK(rf_model_tp_enable_training(tp));
    forward_backward(ref, tp, shape_name[s], 3, 13, tok1, tgt1, cu1, 1);
    forward_backward(ref, tp, shape_name[s], 2, 10, tok2, tgt2, cu2, 2); /* accumulates */
    compare_grads(ref, tp, shape_name[s]);
    sensitivity(ref, tp, shape_name[s]);
    if (!ref->score) generation(ref, tp, shape_name[s]);
    if (!ref->score) sampling_from_slices(tp, shape_name[s]);
    if (tp->tp > 1) shard_refusals(ref, tp);
    rf_model_tp_free(tp);
    rf_model_free(ref);
}

/* tp must divide the attention heads; a back end without the kernels is refused. */
static void init_refusals(rf_comm *g) {
    int tp = rf_comm_size(g);
    rf_model_config c = config_of(SHAPE_GQA);
    rf_model_tp *m = NULL;
    if (tp > 1) {
        c.num_attention_heads = tp + 1, c.num_key_value_heads = 1;
        char want[96];
        snprintf(want, sizeof want, "tp = %d does not divide num_attention_heads = %d", tp, tp + 1);
        CHECK_ERR(rf_model_tp_init(&m, &c, rf_cpu_kernels(), g, 60), RF_ERR_ARG, want);
        CHECK(m == NULL);
        c = config_of(SHAPE_GQA);
    }
    rf_kernels k = *rf_cpu_kernels();
    k.logprob_vp_partials = NULL;
    CHECK_ERR(rf_model_tp_init(&m, &c, &k, g, 60), RF_ERR_UNSUPPORTED, "vocabulary-parallel");
    CHECK(m == NULL);
    if (tp > 1) { /* device kernels (by name) over MPI: the activations would be device pointers */
        k = *rf_cpu_kernels();
        k.name = "cuda";
        CHECK_ERR(rf_model_tp_init(&m, &c, &k, g, 60), RF_ERR_ARG,
                  "tensor-parallel model: cuda kernels cannot share activations over the mpi communicator "
                  "(device memory goes over nccl)");
        CHECK(m == NULL);
    }
}

static void all_checks(rf_comm *g) {
    init_refusals(g);
    for (int s = SHAPE_GQA; s <= SHAPE_CRITIC; s++) check_shape((shape)s, g);
}

/* ---- without MPI ---- */

/* rf_model_param_views gives rf_model_init's table. */
static void param_views(void) {
    for (int s = SHAPE_GQA; s <= SHAPE_CRITIC; s++) {
        rf_model *m = whole_model((shape)s);
        rf_param_view *v = NULL;
        int n = 0;
        size_t np = 0;
        CHECK_OK(rf_model_param_views(&m->cfg, &v, &n, &np));
        CHECK(n == m->n_views && np == m->n_params);
        for (int i = 0; v && i < n && i < m->n_views; i++)
            CHECK(memcmp(&v[i], &m->views[i], sizeof *v) == 0);
        free(v);
        rf_model_free(m);
    }
}

/* The vocabulary-parallel kernels on three uneven slices, combined here, against the
 * whole-vocabulary kernels: log-probs, entropies, dh (sum of the slices') and dw. */
static void vp_kernels(void) {
    const rf_kernels *k = rf_cpu_kernels();
    enum { T = 300, C = 8, V = 50 }; /* T over one chunk */
    float *h = malloc(sizeof(float) * T * C), *w = malloc(sizeof(float) * V * C);
    int32_t tgt[T];
    rf_rng r;
    rf_rng_seed(&r, 5);
    for (int i = 0; i < T * C; i++) h[i] = rf_rng_normal(&r);
    for (int i = 0; i < V * C; i++) w[i] = 2.0f * rf_rng_normal(&r);
    for (int t = 0; t < T; t++) tgt[t] = (int32_t)(rf_rng_u64(&r) % V);
    float lp[T], ent[T], dl[T], de[T], lse[T], H[T], lp_vp[T];
    for (int t = 0; t < T; t++) dl[t] = rf_rng_normal(&r), de[t] = rf_rng_normal(&r);
    float inv_temp = 1.0f / 0.7f;
    k->logprob_forward(lp, ent, h, w, tgt, T, C, V, inv_temp);
    const int cut[4] = {0, 13, 14, V};
    float part[3][4][T];
    for (int s = 0; s < 3; s++)
        k->logprob_vp_partials(part[s][0], part[s][1], part[s][2], part[s][3], h, w + cut[s] * C, tgt, T,
                               C, cut[s + 1] - cut[s], cut[s], inv_temp);
    for (int t = 0; t < T; t++) {
        double M = fmax(fmax(part[0][0][t], part[1][0][t]), part[2][0][t]), S = 0, W = 0, Z = 0;
        for (int s = 0; s < 3; s++) {
            double f = exp(part[s][0][t] - M);
            S += part[s][1][t] * f;
            W += f * (part[s][2][t] + part[s][1][t] * (part[s][0][t] - M));
            Z += part[s][3][t];
        }
        lse[t] = (float)(M + log(S)), H[t] = (float)(log(S) - W / S), lp_vp[t] = (float)(Z - lse[t]);
    }
    CHECK(close_all("vp kernel: log-probs", lp_vp, lp, T, 1e-6));
    CHECK(close_all("vp kernel: entropies", H, ent, T, 1e-6));
    float *dh = calloc(T * C, sizeof(float)), *dw = calloc(V * C, sizeof(float)),
          *dh_vp = calloc(T * C, sizeof(float)), *dh_s = malloc(sizeof(float) * T * C),
          *dw_vp = calloc(V * C, sizeof(float));
    k->logprob_backward(dh, dw, dl, de, h, w, tgt, T, C, V, inv_temp);
    for (int s = 0; s < 3; s++) {
        k->logprob_vp_backward(dh_s, dw_vp + cut[s] * C, dl, de, lse, H, h, w + cut[s] * C, tgt, T, C,
                               cut[s + 1] - cut[s], cut[s], inv_temp);
        k->add_inplace(dh_vp, dh_s, T * C);
    }
    double sh = max_abs(dh, T * C), sw = max_abs(dw, V * C);
    CHECK(sh > 0 && sw > 0);
    CHECK(close_all("vp kernel: dh", dh_vp, dh, T * C, RTOL * sh));
    CHECK(close_all("vp kernel: dw", dw_vp, dw, V * C, RTOL * sw));
    free(h), free(w), free(dh), free(dw), free(dh_vp), free(dh_s), free(dw_vp);
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = NULL;
    if (rf_comm_world(&argc, &argv, &world) != RF_OK) {
        fprintf(stderr, "test_model_tp: %s\n", rf_error_message());
        return 1;
    }
    int rank = rf_comm_rank(world), size = rf_comm_size(world);
    for (int tp = 2; tp <= size; tp *= 2) {
        rf_comm *g = NULL;
        CHECK_OK(rf_comm_split(world, rank / tp, rank % tp, &g));
        if (g) all_checks(g);
        rf_comm_free(g);
        CHECK_OK(rf_comm_barrier(world, 60, "after one tp"));
    }
    printf("test_model_tp: rank %d: largest error %.3f of its tolerance\n", rank, g_worst);
    int rc = rf_test_mpi_finish(world, "test_model_tp");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    param_views();
    vp_kernels();
    all_checks(rf_comm_single()); /* tp = 1 */
    printf("test_model_tp: one process: largest error %.3f of its tolerance\n", g_worst);
    if (!rf_test_have_mpirun()) {
        printf("test_model_tp: mpirun not found (apt-get install openmpi-bin): tp > 1 skipped\n");
        rf_test_finish("test_model_tp");
        return rf_test_failed ? 1 : 77;
    }
    CHECK(rf_test_mpirun_self(2, 300, NULL) == 0);
    CHECK(rf_test_mpirun_self(4, 300, NULL) == 0);
    return rf_test_finish("test_model_tp");
}
