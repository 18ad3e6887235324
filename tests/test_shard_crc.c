/* The CRC-32C of a whole parameter buffer computed from its tensor-parallel shards
 * (resharding/shard_crc.h) equals rf_crc32c of the whole buffer: what the training ranks of a
 * split run announce must be what a rollout worker computes over the buffer it assembles.
 *   - rf_crc32c_zeros against rf_crc32c_extend over real zeros (lengths 0 to 100003, several
 *     starting CRCs, and 512 MiB + 4), and runs of 512 MiB to 16 GiB against the same run in
 *     pieces of 256 MiB;
 *   - for three model shapes (4 query / 2 kv heads with biases and a separate LM head: k/v split
 *     at tp 2, replicated at tp 4; 12 / 3 heads with q/k norms, tied embeddings, a vocabulary of
 *     61 and an intermediate size of 30 that tp does not divide; a value head) at every tp that
 *     divides the heads: the parts of the shards cut by rf_layout_extract, joined, equal the
 *     whole buffer's CRC-32C, bit for bit;
 *   - one float changed in one shard's block of a row-parallel tensor (o_proj) changes the
 *     joined CRC, to the CRC of the whole buffer with the same change;
 *   - replicated tensors count once: a replicated tensor changed on a shard other than 0 does
 *     not change the join (the weights module checks them equal separately).
 * Exact integer checks: no tolerance. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/rng.h"
#include "model/config.h"
#include "model/model.h"
#include "resharding/layout.h"
#include "resharding/shard_crc.h"
#include "test_util.h"
#include "tp_shapes.h"

static void zeros_match(void) {
    size_t lens[] = {0, 1, 3, 4, 7, 64, 4096, 100003};
    uint32_t starts[] = {0, 0xE3069283u, 0xdeadbeefu};
    unsigned char *z = calloc(100003, 1);
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++)
        for (size_t j = 0; j < sizeof starts / sizeof starts[0]; j++)
            CHECK(rf_crc32c_zeros(starts[j], lens[i]) == rf_crc32c_extend(starts[j], z, lens[i]));
    free(z);
    /* runs of 512 MiB and more (a model of 134M parameters or more): over real zeros once, and
     * up to 16 GiB against the same run applied in pieces of 256 MiB (before the fix, every
     * run of 2^29 bytes or more came out wrong) */
    size_t big = ((size_t)1 << 29) + 4;
    z = calloc(big, 1);
    CHECK(z != NULL);
    if (z) CHECK(rf_crc32c_zeros(0xE3069283u, big) == rf_crc32c_extend(0xE3069283u, z, big));
    free(z);
    uint64_t bigs[] = {(uint64_t)1 << 29, ((uint64_t)1 << 32) + 12, ((uint64_t)1 << 34) + 5};
    for (size_t i = 0; i < sizeof bigs / sizeof bigs[0]; i++) {
        uint32_t piecewise = 0xdeadbeefu;
        uint64_t left = bigs[i], piece = (uint64_t)1 << 28;
        for (; left > piece; left -= piece) piecewise = rf_crc32c_zeros(piecewise, piece);
        piecewise = rf_crc32c_zeros(piecewise, left);
        CHECK(rf_crc32c_zeros(0xdeadbeefu, bigs[i]) == piecewise);
    }
}

static int find(const rf_param_view *v, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(v[i].name, name) == 0) return i;
    return -1;
}

/* Parts of every shard of `full` at tp, joined. */
static uint32_t joined(const rf_param_table *pt, int tp, const float *full, size_t n_full, int mut_t, int mut_view) {
    uint32_t parts[16];
    for (int t = 0; t < tp; t++) {
        rf_shard *sh = calloc((size_t)pt->n_views, sizeof *sh);
        size_t n = 0;
        CHECK_OK(rf_layout_shards(pt, tp, t, sh, &n));
        float *local = calloc(n ? n : 1, sizeof(float));
        rf_layout_extract(pt, sh, full, local);
        if (t == mut_t) local[sh[mut_view].offset] += 1.0f; /* the first float of the view's block */
        parts[t] = rf_shard_crc32c_part(pt, sh, t, local);
        free(local), free(sh);
    }
    return rf_shard_crc32c_join(parts, tp, n_full);
}

static void shards_join(shape s) {
    rf_model_config c = config_of(s);
    rf_param_view *views = NULL;
    int nv = 0;
    size_t n_full = 0;
    CHECK_OK(rf_model_param_views(&c, &views, &nv, &n_full));
    rf_param_table pt = {&c, views, nv};
    float *full = malloc(sizeof(float) * n_full);
    rf_rng r;
    rf_rng_seed(&r, 11 + s);
    for (size_t i = 0; i < n_full; i++) full[i] = rf_rng_uniform(&r) - 0.5f;
    full[3] = 0.0f; /* a zero in the data, where the runs of zeros are */
    uint32_t want = rf_crc32c(full, sizeof(float) * n_full);
    int o = find(views, nv, "model.layers.1.self_attn.o_proj.weight");
    int norm = find(views, nv, "model.norm.weight");
    RF_ASSERT(o >= 0 && norm >= 0);
    for (int tp = 1; tp <= c.num_attention_heads && tp <= 12; tp++) {
        if (c.num_attention_heads % tp) continue;
        uint32_t got = joined(&pt, tp, full, n_full, -1, 0);
        CHECK(got == want);
        if (got != want) printf("shape %d tp %d: joined %08x, whole %08x\n", s, tp, got, want);
        /* a changed float of shard tp-1's o_proj block: the whole buffer with the same change */
        rf_shard *sh = calloc((size_t)nv, sizeof *sh);
        size_t n = 0;
        CHECK_OK(rf_layout_shards(&pt, tp, tp - 1, sh, &n));
        full[views[o].offset + (size_t)sh[o].c0] += 1.0f;
        uint32_t changed = rf_crc32c(full, sizeof(float) * n_full);
        full[views[o].offset + (size_t)sh[o].c0] -= 1.0f;
        CHECK(changed != want);
        CHECK(joined(&pt, tp, full, n_full, tp - 1, o) == changed);
        free(sh);
        /* a replicated tensor changed on shard tp-1 (> 0) is not counted there */
        if (tp > 1) CHECK(joined(&pt, tp, full, n_full, tp - 1, norm) == want);
    }
    free(full);
    free(views);
}

int main(void) {
    zeros_match();
    shards_join(SHAPE_GQA);
    shards_join(SHAPE_QWEN3);
    shards_join(SHAPE_CRITIC);
    return rf_test_finish("test_shard_crc");
}
