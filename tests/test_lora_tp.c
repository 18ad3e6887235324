/* LoRA adapters on a tensor-parallel model (model_tp.h rf_model_tp_lora_attach): split like
 * their base matrices, trained over tp ranks as over one.
 *
 * In this process (tp 1 over the single-rank communicator) and under `mpirun --oversubscribe`
 * with 2 ranks (tp 2) and 4 ranks (tp 4), on the shapes of tests/tp_shapes.h (GQA with biases:
 * k/v heads split at tp 2, replicated at tp 4; Qwen3 with 12 / 3 heads and q/k norms: k/v
 * replicated and expanded, an intermediate size of 30 that 4 does not divide evenly):
 *   - each rank's adapters are its blocks of the whole model's fresh adapters bit for bit (the
 *     same seed gives the same draws: a column-parallel A whole, B's rows; a row-parallel A's
 *     columns, B whole);
 *   - rf_actor_update with uo.tp equals the update of the whole model with the same adapters:
 *     3 updates x 2 epochs x 2 mini-batches (12 optimizer steps), micro-batches of 12 tokens,
 *     clipping that clips, token-mean aggregation; the adapters gathered from the shards within
 *     1e-5 of the largest adapter value of the whole model's, the frozen base untouched bit
 *     for bit, the replicated adapters the same bits on every rank, the log-probs of the
 *     trained adapters within 1e-5;
 *   - the reference of a LoRA run, a second shard model over the actor shard's own base floats
 *     (no second copy), gives the whole base model's log-probs (within 1e-5), while the
 *     trained adapters' are more than 1e-3 away;
 *   - the PEFT adapter written from the gathered shards (rf_lora_save_peft_fill) has the whole
 *     model's layout: adapter_config.json byte for byte, the safetensors header byte for byte
 *     (names, shapes, dtypes, offsets), the values within the tolerance above.
 * Tolerance: as test_train_tp.c (fp32 summation order differs between the whole model and the
 * shards; AdamW with eps = 1e-5 above the rounding noise of near-zero gradients). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actor/actor.h"
#include "comm/comm.h"
#include "common/crc32c.h"
#include "common/util.h"
#include "model/lora.h"
#include "model/model_tp.h"
#include "test_comm_util.h"
#include "test_util.h"
#include "tp_shapes.h"
#include "train_util.h"

#define T_OK 60.0
#define NS 12

static int g_rank, g_size;

static rf_lora_opts lora_opts(void) {
    rf_lora_opts o = {4, 8.0f, 0.0f, (1u << RF_LORA_N) - 1, RF_LORA_INIT_GAUSSIAN, 5};
    return o;
}

/* A whole model of shape s (random base from seed), optionally with the adapters attached. */
static rf_model *whole_model(shape s, uint64_t seed, int lora) {
    rf_model_config c = config_of(s);
    rf_model *m;
    RF_ASSERT(rf_model_init(&m, &c, rf_cpu_kernels()) == RF_OK);
    rf_model_init_random(m, seed, 0.2f);
    rf_lora_opts o = lora_opts();
    if (lora) RF_ASSERT(rf_model_lora_attach(m, &o) == RF_OK);
    return m;
}

/* The shards' adapters put together (whole, in the whole model's adapter layout: floats from
 * n_frozen on) on every rank: each rank's blocks allgathered (padded to the largest rank's). */
static void gather_adapters(rf_comm *c, const rf_model_tp *tp, float *whole) {
    int T = tp->tp, n = tp->n_lora_views;
    rf_param_table pt = {&tp->cfg, tp->lora_views, n};
    rf_shard *all = calloc((size_t)T * (size_t)n, sizeof *all);
    size_t most = 0, *size = calloc((size_t)T, sizeof *size);
    for (int t = 0; t < T; t++) {
        CHECK_OK(rf_layout_shards(&pt, T, t, all + (size_t)t * n, &size[t]));
        most = size[t] > most ? size[t] : most;
    }
    float *mine = calloc(most + 1, sizeof(float)), *got = calloc((most + 1) * (size_t)T, sizeof(float));
    memcpy(mine, tp->m->params + tp->m->n_frozen, sizeof(float) * size[tp->t]);
    CHECK_OK(rf_comm_allgather(c, mine, got, sizeof(float) * (most + 1), T_OK, "adapters"));
    for (int t = 0; t < T; t++)
        for (int i = 0; i < n; i++) {
            const rf_shard *s = &all[(size_t)t * n + i];
            const float *src = got + (size_t)t * (most + 1) + s->offset;
            int64_t w = s->c1 - s->c0;
            for (int64_t r = s->r0; r < s->r1; r++)
                memcpy(whole + tp->lora_views[i].offset + (size_t)(r * s->full_cols + s->c0), src + (size_t)((r - s->r0) * w),
                       sizeof(float) * (size_t)w);
        }
    free(all), free(size), free(mine), free(got);
}

/* 1 when the replicated adapters are the same bits on every rank of the group. */
static int adapters_replicated_same(rf_comm *c, const rf_model_tp *tp) {
    uint32_t crc = 0, *all = malloc(sizeof(uint32_t) * (size_t)tp->tp);
    int n_rep = 0;
    for (int i = 0; i < tp->n_lora_views; i++)
        if (tp->lora_shards[i].split == RF_SPLIT_REPLICATED) {
            const rf_param_view *v = &tp->m->lora.views[i];
            crc = rf_crc32c_extend(crc, tp->m->params + v->offset, v->numel * sizeof(float));
            n_rep++;
        }
    int same = rf_comm_allgather(c, &crc, all, sizeof crc, T_OK, "replicated adapters") == RF_OK;
    for (int r = 0; same && r < tp->tp; r++) same = all[r] == crc;
    free(all);
    return same && n_rep > 0;
}

/* max |a - b| / max |b| */
static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, mx = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i])), mx = fmax(mx, fabs((double)b[i]));
    return mx > 0 ? d / mx : d;
}

static rf_status fill_gathered(void *ctx, int i, float *dst) {
    const rf_model_tp *tp = ((void **)ctx)[0];
    const float *whole = ((void **)ctx)[1];
    memcpy(dst, whole + tp->lora_views[i].offset, sizeof(float) * tp->lora_views[i].numel);
    return RF_OK;
}

/* The 8-byte length and JSON header of a safetensors file, and the file's size. */
static char *st_header(const char *path, size_t *hlen, size_t *size) {
    char *data = NULL;
    if (rf_read_file(path, &data, size) != RF_OK || *size < 8) return data;
    uint64_t n = 0;
    memcpy(&n, data, 8);
    *hlen = 8 + (size_t)n;
    return data;
}

/* Rank 0: the PEFT adapter of the gathered shards against the whole model's. */
static void peft_layout(const rf_model_tp *tp, const rf_model *ref, const float *gathered, shape s) {
    if (g_rank != 0) return;
    char a[128], b[128], pa[200], pb[200];
    snprintf(a, sizeof a, "/tmp/rf_lora_tp_%d_%d_whole", (int)getpid(), (int)s);
    snprintf(b, sizeof b, "/tmp/rf_lora_tp_%d_%d_shards", (int)getpid(), (int)s);
    CHECK_OK(rf_lora_save_peft(ref, a, "base"));
    const void *ctx[2] = {tp, gathered};
    CHECK_OK(rf_lora_save_peft_fill(&tp->m->lora, tp->lora_views, tp->n_lora_views, b, "base", fill_gathered, ctx));
    char *ja = NULL, *jb = NULL;
    size_t na = 0, nb = 0;
    snprintf(pa, sizeof pa, "%s/adapter_config.json", a), snprintf(pb, sizeof pb, "%s/adapter_config.json", b);
    CHECK_OK(rf_read_file(pa, &ja, &na));
    CHECK_OK(rf_read_file(pb, &jb, &nb));
    CHECK(ja && jb && na == nb && memcmp(ja, jb, na) == 0);
    free(ja), free(jb);
    size_t ha = 0, hb = 0, sa = 0, sb = 0;
    snprintf(pa, sizeof pa, "%s/adapter_model.safetensors", a), snprintf(pb, sizeof pb, "%s/adapter_model.safetensors", b);
    char *fa = st_header(pa, &ha, &sa), *fb = st_header(pb, &hb, &sb);
    CHECK(fa && fb && sa == sb && ha == hb && ha > 8 && memcmp(fa, fb, ha) == 0);
    if (fa && fb && sa == sb && ha == hb) /* the data: F32 in the same order */
        CHECK(rel_diff((const float *)(fb + ha), (const float *)(fa + ha), (sa - ha) / 4) < 1e-5);
    free(fa), free(fb);
    rf_remove_tree(a), rf_remove_tree(b);
}

static rf_optim_opts optim(void) {
    return (rf_optim_opts){.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-5f, .grad_clip = 0.02f,
                           .weight_decay = 0.01f};
}

static void lora_tp_equals_one_rank(rf_comm *c, shape s) {
    rf_model *ref = whole_model(s, 5, 1), *base = whole_model(s, 5, 0), *init = whole_model(s, 5, 1);
    RF_ASSERT(rf_model_enable_training(ref) == RF_OK);
    rf_train_sample smp[NS];
    rf_test_train_samples(smp, NS, ref);
    rf_model_tp *tp = NULL;
    rf_lora_opts o = lora_opts();
    CHECK_OK(rf_model_tp_init(&tp, &ref->cfg, rf_cpu_kernels(), c, T_OK));
    CHECK_OK(rf_model_tp_set_full(tp, base->params)); /* the base, then the adapters */
    CHECK_OK(rf_model_tp_lora_attach(tp, &o));
    CHECK_OK(rf_model_tp_enable_training(tp));
    size_t n = ref->n_params - ref->n_frozen, f = tp->m->n_frozen;
    float *got = calloc(n, sizeof(float)), *frozen = malloc(sizeof(float) * f);
    memcpy(frozen, tp->m->params, sizeof(float) * f);
    gather_adapters(c, tp, got);
    CHECK(memcmp(got, ref->params + ref->n_frozen, sizeof(float) * n) == 0); /* fresh: the whole model's draws */
    rf_optim_opts oo = optim();
    rf_update_opts uo = {.pg = {0.2f, 0.28f, 0, 0, 5, 0, RF_KL_K3, 0.01f}, .agg = RF_AGG_TOKEN_MEAN, .max_resp_len = 7,
                         .epochs = 2, .mini_batches = 2, .micro_tokens = 12, .inv_temp = 1.0f, .shuffle_seed = 7};
    double max_norm = 0;
    for (int k = 0; k < 3; k++) {
        rf_update_stats sr = {0}, st = {0};
        uo.tp = NULL;
        CHECK_OK(rf_actor_update(ref, &oo, &uo, smp, NS, &sr));
        uo.tp = tp;
        CHECK_OK(rf_actor_update(tp->m, &oo, &uo, smp, NS, &st));
        CHECK(st.tokens == sr.tokens && st.optimizer_steps == sr.optimizer_steps && st.optimizer_steps == 4);
        CHECK_CLOSE(st.grad_norm, sr.grad_norm, 0, 5e-4);
        CHECK_CLOSE(st.pg.loss, sr.pg.loss, 1e-9, 1e-4);
        max_norm = fmax(max_norm, sr.grad_norm);
    }
    CHECK(max_norm > oo.grad_clip);
    gather_adapters(c, tp, got);
    double moved = rel_diff(ref->params + ref->n_frozen, init->params + init->n_frozen, n);
    double d = rel_diff(got, ref->params + ref->n_frozen, n);
    CHECK(moved > 1e-3);
    CHECK(d < 1e-5);
    CHECK(memcmp(frozen, tp->m->params, sizeof(float) * f) == 0);
    CHECK(rf_test_replicated_same(c, tp) && adapters_replicated_same(c, tp));
    /* the trained adapters' log-probs */
    float *a[NS], *b[NS];
    for (int i = 0; i < NS; i++) a[i] = calloc((size_t)smp[i].n_resp, sizeof(float)), b[i] = calloc((size_t)smp[i].n_resp, sizeof(float));
    CHECK_OK(rf_actor_logprobs(ref, smp, NS, 20, 1.0f, a, NULL));
    CHECK_OK(rf_actor_logprobs_tp(tp, smp, NS, 20, 1.0f, b, NULL));
    double lp = 0;
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < smp[i].n_resp; t++) lp = fmax(lp, fabs((double)a[i][t] - b[i][t]) / fmax(1.0, fabs(a[i][t])));
    CHECK(lp < 1e-5);
    /* the reference of a LoRA run: a second shard model over the actor shard's own base floats
     * (actor/worker_tp.c base_reference) gives the base's log-probs, not the adapted policy's */
    rf_model_tp *rt = NULL;
    float *rp[NS];
    CHECK_OK(rf_model_tp_init_borrowed(&rt, &ref->cfg, rf_cpu_kernels(), c, T_OK, tp->m->params));
    CHECK(rt->m->n_params == tp->m->n_frozen && rt->m->params == tp->m->params);
    for (int i = 0; i < NS; i++) rp[i] = calloc((size_t)smp[i].n_resp, sizeof(float));
    CHECK_OK(rf_actor_logprobs(base, smp, NS, 20, 1.0f, a, NULL));
    CHECK_OK(rf_actor_logprobs_tp(rt, smp, NS, 20, 1.0f, rp, NULL));
    double rl = 0, off = 0;
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < smp[i].n_resp; t++) {
            rl = fmax(rl, fabs((double)a[i][t] - rp[i][t]) / fmax(1.0, fabs(a[i][t])));
            off = fmax(off, fabs((double)b[i][t] - rp[i][t]));
        }
    CHECK(rl < 1e-5);
    CHECK(off > 1e-3); /* the adapters moved the policy: a reference with them would miss by this */
    if (g_rank == 0)
        printf("tp %d, shape %d: reference over the actor's base shards against the base model %.3g (the adapted "
               "policy is %.3g away)\n", tp->tp, (int)s, rl, off);
    for (int i = 0; i < NS; i++) free(rp[i]);
    rf_model_tp_free(rt);
    for (int i = 0; i < NS; i++) free(a[i]), free(b[i]);
    if (g_rank == 0 || !(d < 1e-5))
        printf("rank %d, tp %d, shape %d: %zu adapter floats, %d summed at the end of backward; adapters moved %.3g, "
               "shards vs whole model %.3g, log-probs %.3g (max grad norm %.3g)\n", g_rank, tp->tp, (int)s, n,
               tp->n_sync, moved, d, lp, max_norm);
    peft_layout(tp, ref, got, s);
    for (int i = 0; i < NS; i++) rf_train_sample_free(&smp[i]);
    free(got), free(frozen);
    rf_model_tp_free(tp);
    rf_model_free(ref), rf_model_free(base), rf_model_free(init);
}

static void all_shapes(rf_comm *c) {
    lora_tp_equals_one_rank(c, SHAPE_GQA);
    lora_tp_equals_one_rank(c, SHAPE_QWEN3);
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = rf_test_mpi_world(&argc, &argv, "test_lora_tp");
    if (!world) return 1;
    g_rank = rf_comm_rank(world), g_size = rf_comm_size(world);
    all_shapes(world);
    int rc = rf_test_mpi_finish(world, "test_lora_tp");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    rf_comm *one = NULL;
    CHECK_OK(rf_comm_world(&argc, &argv, &one));
    g_rank = 0, g_size = 1;
    all_shapes(one);
    rf_comm_free(one);
    const int np[] = {2, 4};
    return rf_test_mpi_part("test_lora_tp", np, 2);
}
