/* Resharding layouts and plans in one process, on examples worked out by hand:
 *   - split rules per parameter at tp 1, 2, 4 for a GQA model (4 q heads, 2 kv heads: k/v split
 *     at tp 2, replicated at tp 4), shard blocks and local offsets;
 *   - rf_layout_extract against element-by-element indexing of the full buffer;
 *   - a column-parallel and a row-parallel parameter from tp 2 to tp 3: the exact moves
 *     (blocks, offsets, strides) and their printed lines;
 *   - holders: a local copy preferred, senders spread over source replicas;
 *   - buckets: bucket and move sizes on a hand-counted example, and the bucket bound on a
 *     whole model;
 *   - zero copy for identical layouts only; plan ids equal for equal inputs, different for
 *     another bucket size; layout errors with their messages;
 *   - the checksum the executor uses equals common/'s CRC-32C on random data of every length
 *     (0 .. 40000 bytes, across the 3 x 4096-byte blocks of the hardware path) and alignment. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "model/model.h"
#include "common/crc32c.h"
#include "common/rng.h"
#include "resharding/layout.h"
#include "resharding/plan.h"
#include "test_util.h"

/* The test model: preset "tiny" (C 64, F 176, 2 layers, 4 heads of 16, 2 kv heads) with a
 * vocabulary of 50 (not divisible by 4), separate lm_head, o_proj bias and Qwen3 q/k norms. */
static rf_model *tiny_model(void) {
    rf_model_config cfg;
    if (rf_config_preset(&cfg, "tiny", 50) != RF_OK) return NULL;
    cfg.tie_word_embeddings = 0, cfg.o_bias = 1, cfg.qk_norm = 1;
    rf_model *m = NULL;
    if (rf_model_init(&m, &cfg, rf_cpu_kernels()) != RF_OK) return NULL;
    rf_model_init_random(m, 7, 1.0f);
    return m;
}

static int find_view(const rf_param_table *pt, const char *name) {
    for (int i = 0; i < pt->n_views; i++)
        if (strcmp(pt->views[i].name, name) == 0) return i;
    return -1;
}

static void split_rules(const rf_model *m) {
    const rf_model_config *c = &m->cfg;
    struct { const char *name; rf_split tp2, tp4; } want[] = {
        {"model.embed_tokens.weight", RF_SPLIT_ROWS, RF_SPLIT_ROWS},
        {"lm_head.weight", RF_SPLIT_ROWS, RF_SPLIT_ROWS},
        {"model.layers.1.self_attn.q_proj.weight", RF_SPLIT_ROWS, RF_SPLIT_ROWS},
        {"model.layers.1.self_attn.q_proj.bias", RF_SPLIT_ROWS, RF_SPLIT_ROWS},
        {"model.layers.1.self_attn.k_proj.weight", RF_SPLIT_ROWS, RF_SPLIT_REPLICATED},
        {"model.layers.1.self_attn.v_proj.bias", RF_SPLIT_ROWS, RF_SPLIT_REPLICATED},
        {"model.layers.1.self_attn.o_proj.weight", RF_SPLIT_COLS, RF_SPLIT_COLS},
        {"model.layers.1.self_attn.o_proj.bias", RF_SPLIT_REPLICATED, RF_SPLIT_REPLICATED},
        {"model.layers.1.self_attn.q_norm.weight", RF_SPLIT_REPLICATED, RF_SPLIT_REPLICATED},
        {"model.layers.1.mlp.gate_proj.weight", RF_SPLIT_ROWS, RF_SPLIT_ROWS},
        {"model.layers.1.mlp.up_proj.weight", RF_SPLIT_ROWS, RF_SPLIT_ROWS},
        {"model.layers.1.mlp.down_proj.weight", RF_SPLIT_COLS, RF_SPLIT_COLS},
        {"model.layers.1.input_layernorm.weight", RF_SPLIT_REPLICATED, RF_SPLIT_REPLICATED},
        {"model.norm.weight", RF_SPLIT_REPLICATED, RF_SPLIT_REPLICATED},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        CHECK(rf_model_find(m, want[i].name) != NULL);
        CHECK(rf_layout_split_of(c, want[i].name, 1) == RF_SPLIT_REPLICATED);
        CHECK(rf_layout_split_of(c, want[i].name, 2) == want[i].tp2);
        CHECK(rf_layout_split_of(c, want[i].name, 4) == want[i].tp4);
    }
}

static const rf_shard *shard_of(const rf_param_table *pt, const rf_shard *s, const char *name) {
    int i = find_view(pt, name);
    return i < 0 ? NULL : &s[i];
}

static void shards(const rf_model *m) {
    rf_param_table pt = rf_param_table_of(m);
    rf_shard *s = calloc((size_t)pt.n_views, sizeof *s);
    size_t n = 0;
    CHECK_OK(rf_layout_shards(&pt, 1, 0, s, &n));
    CHECK(n == m->n_params);
    for (int i = 0; i < pt.n_views; i++) CHECK(s[i].offset == m->views[i].offset); /* tp 1: the model's own buffer */
    /* tp 4, shard 1: vocab rows 12..25 (50 * 1 / 4 = 12, 50 * 2 / 4 = 25); q heads 1 (rows 16..32);
     * kv replicated (rows 0..32); o_proj columns 16..32; gate rows 44..88; down columns 44..88 */
    CHECK_OK(rf_layout_shards(&pt, 4, 1, s, &n));
    const rf_shard *e = shard_of(&pt, s, "model.embed_tokens.weight");
    CHECK(e->r0 == 12 && e->r1 == 25 && e->c0 == 0 && e->c1 == 64 && e->offset == 0);
    const rf_shard *q = shard_of(&pt, s, "model.layers.0.self_attn.q_proj.weight");
    /* after embed (13 x 64) and input_layernorm (64) */
    CHECK(q->r0 == 16 && q->r1 == 32 && q->c1 == 64 && q->offset == 13 * 64 + 64);
    const rf_shard *qb = shard_of(&pt, s, "model.layers.0.self_attn.q_proj.bias");
    CHECK(qb->r0 == 16 && qb->r1 == 32 && qb->c0 == 0 && qb->c1 == 1 && qb->offset == q->offset + 16 * 64);
    const rf_shard *k = shard_of(&pt, s, "model.layers.0.self_attn.k_proj.weight");
    CHECK(k->split == RF_SPLIT_REPLICATED && k->r0 == 0 && k->r1 == 32 && k->offset == qb->offset + 16);
    const rf_shard *o = shard_of(&pt, s, "model.layers.0.self_attn.o_proj.weight");
    CHECK(o->r0 == 0 && o->r1 == 64 && o->c0 == 16 && o->c1 == 32);
    CHECK(shard_of(&pt, s, "model.layers.0.mlp.gate_proj.weight")->r0 == 44);
    CHECK(shard_of(&pt, s, "model.layers.0.mlp.gate_proj.weight")->r1 == 88);
    const rf_shard *dn = shard_of(&pt, s, "model.layers.0.mlp.down_proj.weight");
    CHECK(dn->c0 == 44 && dn->c1 == 88 && dn->r1 == 64);
    /* tp 2, shard 1: kv split, rows 16..32 of 32 */
    CHECK_OK(rf_layout_shards(&pt, 2, 1, s, &n));
    k = shard_of(&pt, s, "model.layers.1.self_attn.v_proj.weight");
    CHECK(k->split == RF_SPLIT_ROWS && k->r0 == 16 && k->r1 == 32);
    /* extract: element (r, c) of the full tensor is at (r - r0) * width + (c - c0) locally */
    float *local = malloc(sizeof(float) * n);
    rf_layout_extract(&pt, s, m->params, local);
    int bad = 0;
    for (int i = 0; i < pt.n_views; i++) {
        const rf_shard *b = &s[i];
        for (int64_t r = b->r0; r < b->r1; r++)
            for (int64_t c = b->c0; c < b->c1; c++)
                bad += local[b->offset + (size_t)((r - b->r0) * (b->c1 - b->c0) + (c - b->c0))] !=
                       m->params[m->views[i].offset + (size_t)(r * b->full_cols + c)];
    }
    CHECK(bad == 0);
    CHECK_ERR(rf_layout_shards(&pt, 3, 0, s, &n), RF_ERR_ARG, "tp = 3 does not divide num_attention_heads = 4");
    free(local);
    free(s);
}

/* A hand-made table: one row-parallel weight (4, 6) and one column-parallel weight (6, 2). */
static rf_model_config small_cfg(void) {
    rf_model_config c;
    memset(&c, 0, sizeof c);
    c.hidden_size = 6, c.intermediate_size = 6, c.num_hidden_layers = 1, c.num_attention_heads = 6;
    c.num_key_value_heads = 6, c.head_dim = 1, c.vocab_size = 100;
    return c;
}

static rf_param_view view(const char *name, int64_t d0, int64_t d1, size_t offset) {
    rf_param_view v;
    memset(&v, 0, sizeof v);
    snprintf(v.name, sizeof v.name, "%s", name);
    v.ndim = d1 > 0 ? 2 : 1, v.shape[0] = d0, v.shape[1] = d1 > 0 ? d1 : 0;
    v.numel = (size_t)(d0 * (d1 > 0 ? d1 : 1)), v.offset = offset;
    return v;
}

static char *plan_text(const rf_reshard_plan *p) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    rf_reshard_plan_print(p, f);
    fclose(f);
    return buf;
}

static void tp2_to_tp3(void) {
    rf_model_config cfg = small_cfg();
    rf_param_view v[2] = {view("model.layers.0.mlp.down_proj.weight", 4, 6, 0), view("model.layers.0.mlp.up_proj.weight", 6, 2, 24)};
    rf_param_table pt = {&cfg, v, 2};
    rf_layout src = {.tp = 2, .dp = 1, .first_rank = 0}, dst = {.tp = 3, .dp = 1, .first_rank = 2};
    rf_reshard_plan *p = NULL;
    CHECK_OK(rf_reshard_plan_make(&p, &pt, &src, &dst, 1 << 20, 5));
    if (!p) return;
    /* down_proj columns: source [0,3) [3,6) on ranks 0, 1; destination [0,2) [2,4) [4,6) on 2, 3, 4.
     * up_proj rows: source [0,3) [3,6); destination [0,2) [2,4) [4,6). Local buffers: source shard
     * = down (4 x 3) at 0, up (3 x 2) at 12; destination shard = down (4 x 2) at 0, up (2 x 2) at 8. */
    CHECK(p->src_floats[0] == 18 && p->src_floats[1] == 18);
    CHECK(p->dst_floats[0] == 12 && p->dst_floats[2] == 12);
    CHECK(!p->zero_copy && p->n_moves == 8 && p->n_buckets == 1);
    struct { int param, src, dst; int64_t r0, r1, c0, c1; size_t so, dof; int64_t n_runs, run, ss, ds; } want[8] = {
        {0, 0, 2, 0, 4, 0, 2, 0, 0, 4, 2, 3, 2},  /* down [0:4, 0:2] from source shard 0 */
        {0, 0, 3, 0, 4, 2, 3, 2, 0, 4, 1, 3, 2},  /* down [0:4, 2:3]: column 2 of shard 0 */
        {0, 1, 3, 0, 4, 3, 4, 0, 1, 4, 1, 3, 2},  /* down [0:4, 3:4]: column 0 of shard 1 */
        {0, 1, 4, 0, 4, 4, 6, 1, 0, 4, 2, 3, 2},  /* down [0:4, 4:6] */
        {1, 0, 2, 0, 2, 0, 2, 12, 8, 1, 4, 4, 4}, /* up rows 0..2: contiguous, one run */
        {1, 0, 3, 2, 3, 0, 2, 16, 8, 1, 2, 2, 2}, /* up row 2 from shard 0 */
        {1, 1, 3, 3, 4, 0, 2, 12, 10, 1, 2, 2, 2},/* up row 3 from shard 1 */
        {1, 1, 4, 4, 6, 0, 2, 14, 8, 1, 4, 4, 4}, /* up rows 4..6 */
    };
    for (int i = 0; i < 8 && i < p->n_moves; i++) {
        const rf_reshard_move *m = &p->moves[i];
        int ok = m->param == want[i].param && m->src_rank == want[i].src && m->dst_rank == want[i].dst &&
                 m->r0 == want[i].r0 && m->r1 == want[i].r1 && m->c0 == want[i].c0 && m->c1 == want[i].c1 &&
                 m->src_off == want[i].so && m->dst_off == want[i].dof && m->n_runs == want[i].n_runs &&
                 m->run == want[i].run && m->src_stride == want[i].ss && m->dst_stride == want[i].ds;
        CHECK(ok);
        if (!ok)
            fprintf(stderr, "move %d: param %d %d->%d [%lld:%lld, %lld:%lld] off %zu/%zu %lld x %lld strides %lld/%lld\n", i,
                    m->param, m->src_rank, m->dst_rank, (long long)m->r0, (long long)m->r1, (long long)m->c0,
                    (long long)m->c1, m->src_off, m->dst_off, (long long)m->n_runs, (long long)m->run,
                    (long long)m->src_stride, (long long)m->dst_stride);
    }
    char *text = plan_text(p);
    CHECK(strstr(text, "source tp=2 dp=1 ranks 0,1 -> destination tp=3 dp=1 ranks 2,3,4; 8 moves, 144 bytes, 1 bucket of at most 1048576 bytes\n"));
    CHECK(strstr(text, "\nbucket 0: model.layers.0.mlp.down_proj.weight [0:4, 2:3] rank 0 -> rank 3, 4 x 1 floats (strided)\n"));
    CHECK(strstr(text, "\nbucket 0: model.layers.0.mlp.up_proj.weight [0:2, 0:2] rank 0 -> rank 2, 1 x 4 floats\n"));
    free(text);
    size_t s = 0, r = 0, c = 0;
    rf_reshard_plan_bytes(p, 3, &s, &r, &c);
    CHECK(s == 0 && r == 4 * (4 + 4 + 2 + 2) && c == 0);
    rf_reshard_plan_bytes(p, 0, &s, &r, &c);
    CHECK(s == 4 * (8 + 4 + 4 + 2) && r == 0);
    rf_reshard_plan_free(p);
}

/* Holders: source dp 2 x tp 1 on ranks 0, 1. Destination replicas on ranks 1 and 2: rank 1
 * copies its own; rank 2 (replica 1) is sent by source replica 1 % 2 = 1, i.e. rank 1. With the
 * destination on ranks 2, 3: replica 0 from rank 0, replica 1 from rank 1. */
static void holders(void) {
    rf_model_config cfg = small_cfg();
    rf_param_view v[1] = {view("model.norm.weight", 6, 0, 0)};
    rf_param_table pt = {&cfg, v, 1};
    int dst_ranks[2] = {1, 2};
    rf_layout src = {.tp = 1, .dp = 2, .first_rank = 0}, dst = {.tp = 1, .dp = 2, .ranks = dst_ranks};
    rf_reshard_plan *p = NULL;
    CHECK_OK(rf_reshard_plan_make(&p, &pt, &src, &dst, 4096, 4));
    CHECK(p && p->n_moves == 2);
    if (p && p->n_moves == 2) {
        CHECK(p->moves[0].src_rank == 1 && p->moves[0].dst_rank == 1);
        CHECK(p->moves[1].src_rank == 1 && p->moves[1].dst_rank == 2);
        CHECK(p->moves[0].n_runs == 1 && p->moves[0].run == 6);
    }
    rf_reshard_plan_free(p);
    dst = (rf_layout){.tp = 1, .dp = 2, .first_rank = 2};
    CHECK_OK(rf_reshard_plan_make(&p, &pt, &src, &dst, 4096, 4));
    CHECK(p && p->n_moves == 2 && p->moves[0].src_rank == 0 && p->moves[1].src_rank == 1);
    rf_reshard_plan_free(p);
    /* a replicated parameter from tp 2 to tp 1: one piece, taken from the destination's own rank */
    src = (rf_layout){.tp = 2, .dp = 1, .first_rank = 0};
    dst = (rf_layout){.tp = 1, .dp = 1, .first_rank = 1};
    CHECK_OK(rf_reshard_plan_make(&p, &pt, &src, &dst, 4096, 4));
    CHECK(p && p->n_moves == 1 && p->moves[0].src_rank == 1 && p->moves[0].dst_rank == 1);
    rf_reshard_plan_free(p);
    /* senders balanced: training tp 2 x dp 4 on ranks 0-7 to 8 generation replicas on the same
     * ranks. Each replica holds one half of q_proj (3 x 6) and needs the other; 8 halves of 18
     * floats are sent, one by each rank (a fixed round-robin had ranks 1, 2, 5, 6 send two) */
    rf_param_view q[1] = {view("model.layers.0.self_attn.q_proj.weight", 6, 6, 0)};
    rf_param_table qt = {&cfg, q, 1};
    src = (rf_layout){.tp = 2, .dp = 4, .first_rank = 0};
    dst = (rf_layout){.tp = 1, .dp = 8, .first_rank = 0};
    CHECK_OK(rf_reshard_plan_make(&p, &qt, &src, &dst, 4096, 8));
    size_t most = 0, total = 0;
    for (int r = 0; p && r < 8; r++) {
        size_t sent, recv, copied;
        rf_reshard_plan_bytes(p, r, &sent, &recv, &copied);
        most = sent > most ? sent : most, total += sent;
        CHECK(recv == 18 * sizeof(float) && copied == 18 * sizeof(float));
    }
    CHECK(total == 8 * 18 * sizeof(float) && most == 18 * sizeof(float));
    rf_reshard_plan_free(p);
    /* nodes: ranks 0-3 on node 0, 4-7 on node 1, training tp 2 x dp 4 (replica r on ranks 2r,
     * 2r + 1) to 8 replicas. Told the nodes, every half comes from the destination's node (no
     * byte crosses) and senders stay balanced; not told, the balancing alone sends some across */
    int node[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    for (int told = 0; told < 2; told++) {
        CHECK_OK(rf_reshard_plan_make_nodes(&p, &qt, &src, &dst, 4096, 8, told ? node : NULL));
        size_t across = 0, most_sent = 0, sent_by[8] = {0};
        for (int i = 0; p && i < p->n_moves; i++) {
            const rf_reshard_move *m = &p->moves[i];
            if (m->src_rank == m->dst_rank) continue;
            size_t bytes = (size_t)(m->n_runs * m->run) * sizeof(float);
            if (node[m->src_rank] != node[m->dst_rank]) across += bytes;
            sent_by[m->src_rank] += bytes;
        }
        for (int r = 0; r < 8; r++) most_sent = sent_by[r] > most_sent ? sent_by[r] : most_sent;
        if (told) CHECK(across == 0 && most_sent == 18 * sizeof(float));
        else CHECK(across > 0);
        rf_reshard_plan_free(p);
    }
}

/* Buckets of 4096 bytes (1024 floats) from rank 0 to rank 1: an embedding (30 x 100) is cut
 * into 3 moves of 10 rows (4000 bytes, one bucket each); a down_proj (2 x 3000) has rows larger
 * than a bucket, cut into columns of 1024, 1024, 952 (6 moves); two 952-float pieces never share
 * a bucket (7616 bytes > 4096), so 3 + 6 = 9 buckets. */
static void buckets(void) {
    rf_model_config cfg = small_cfg();
    cfg.intermediate_size = 3000;
    rf_param_view v[2] = {view("model.embed_tokens.weight", 30, 100, 0), view("model.layers.0.mlp.down_proj.weight", 2, 3000, 3000)};
    rf_param_table pt = {&cfg, v, 2};
    rf_layout src = {.tp = 1, .dp = 1, .first_rank = 0}, dst = {.tp = 1, .dp = 1, .first_rank = 1};
    rf_reshard_plan *p = NULL;
    CHECK_OK(rf_reshard_plan_make(&p, &pt, &src, &dst, 4096, 2));
    CHECK(p && p->n_moves == 9 && p->n_buckets == 9);
    if (p && p->n_moves == 9) {
        for (int i = 0; i < 3; i++) CHECK(p->moves[i].r0 == 10 * i && p->moves[i].run == 1000 && p->moves[i].n_runs == 1);
        int64_t c0[6] = {0, 0, 1024, 1024, 2048, 2048}, r0[6] = {0, 1, 0, 1, 0, 1};
        for (int i = 0; i < 6; i++) {
            const rf_reshard_move *m = &p->moves[3 + i];
            CHECK(m->c0 == c0[i] && m->r0 == r0[i] && m->r1 == r0[i] + 1 && m->n_runs == 1);
            CHECK(m->run == (i < 4 ? 1024 : 952) && m->src_off == 3000 + (size_t)(r0[i] * 3000 + c0[i]));
            CHECK(m->bucket == 3 + i);
        }
    }
    rf_reshard_plan_free(p);
}

/* On the whole tiny model, every pair of 4-rank layouts: each move within the bucket, each
 * rank's bytes per bucket within it unless one move fills it; every destination element
 * covered exactly once. */
static void whole_model(const rf_model *m) {
    rf_param_table pt = rf_param_table_of(m);
    rf_layout ls[3] = {{.tp = 1, .dp = 4}, {.tp = 2, .dp = 2}, {.tp = 4, .dp = 1}};
    size_t bucket = 8192;
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            rf_reshard_plan *p = NULL;
            CHECK_OK(rf_reshard_plan_make(&p, &pt, &ls[a], &ls[b], bucket, 4));
            if (!p) continue;
            CHECK(p->zero_copy == (a == b));
            CHECK((p->n_moves == 0) == (a == b));
            int bad = 0;
            for (int i = 0; i < p->n_moves; i++) bad += (size_t)(p->moves[i].n_runs * p->moves[i].run) * 4 > bucket;
            CHECK(bad == 0);
            /* per bucket and rank */
            size_t *sent = calloc((size_t)p->n_buckets * 4 + 1, sizeof *sent), *recv = calloc((size_t)p->n_buckets * 4 + 1, sizeof *recv);
            for (int i = 0; i < p->n_moves; i++) {
                const rf_reshard_move *mv = &p->moves[i];
                if (mv->src_rank == mv->dst_rank) continue;
                size_t by = (size_t)(mv->n_runs * mv->run) * 4;
                sent[mv->bucket * 4 + mv->src_rank] += by, recv[mv->bucket * 4 + mv->dst_rank] += by;
            }
            bad = 0;
            for (int k = 0; k < p->n_buckets * 4; k++) bad += sent[k] > bucket || recv[k] > bucket;
            CHECK(bad == 0);
            free(sent), free(recv);
            /* coverage: count writes per destination element of each destination rank */
            int *cover[4];
            for (int r = 0; r < 4; r++) cover[r] = calloc(p->dst_floats[r % ls[b].tp] + 1, sizeof(int));
            for (int i = 0; i < p->n_moves; i++) {
                const rf_reshard_move *mv = &p->moves[i];
                for (int64_t j = 0; j < mv->n_runs; j++)
                    for (int64_t e = 0; e < mv->run; e++) cover[mv->dst_rank][mv->dst_off + (size_t)(j * mv->dst_stride + e)]++;
            }
            bad = 0;
            for (int r = 0; r < 4 && !p->zero_copy; r++)
                for (size_t e = 0; e < p->dst_floats[r % ls[b].tp]; e++) bad += cover[r][e] != 1;
            CHECK(bad == 0);
            for (int r = 0; r < 4; r++) free(cover[r]);
            rf_reshard_plan_free(p);
        }
}

static void ids_and_errors(const rf_model *m) {
    rf_param_table pt = rf_param_table_of(m);
    rf_layout a = {.tp = 2, .dp = 1}, b = {.tp = 1, .dp = 2};
    rf_reshard_plan *p1 = NULL, *p2 = NULL, *p3 = NULL;
    CHECK_OK(rf_reshard_plan_make(&p1, &pt, &a, &b, 65536, 2));
    CHECK_OK(rf_reshard_plan_make(&p2, &pt, &a, &b, 65536, 2));
    CHECK_OK(rf_reshard_plan_make(&p3, &pt, &a, &b, 32768, 2));
    CHECK(p1 && p2 && p3 && p1->id == p2->id && p1->id != p3->id);
    rf_reshard_plan_free(p1), rf_reshard_plan_free(p2), rf_reshard_plan_free(p3);
    /* same tp and dp on other ranks: not zero copy; everything moves, the replicated norms
     * by local copies */
    int rev[2] = {1, 0};
    rf_layout c = {.tp = 2, .dp = 1, .ranks = rev};
    CHECK_OK(rf_reshard_plan_make(&p1, &pt, &a, &c, 1 << 20, 2));
    size_t s0 = 0, c0 = 0, s1 = 0, c1 = 0, total = 0;
    for (int t = 0; p1 && t < 2; t++) total += p1->dst_floats[t];
    if (p1) rf_reshard_plan_bytes(p1, 0, &s0, NULL, &c0), rf_reshard_plan_bytes(p1, 1, &s1, NULL, &c1);
    CHECK(p1 && !p1->zero_copy && c0 > 0 && c1 > 0 && s0 + s1 + c0 + c1 == total * 4);
    rf_reshard_plan_free(p1);
    rf_layout bad = {.tp = 3, .dp = 1};
    CHECK_ERR(rf_reshard_plan_make(&p1, &pt, &bad, &b, 65536, 4), RF_ERR_ARG, "source layout: tp = 3 does not divide num_attention_heads = 4");
    int dup[2] = {1, 1};
    rf_layout d = {.tp = 1, .dp = 2, .ranks = dup};
    CHECK_ERR(rf_reshard_plan_make(&p1, &pt, &a, &d, 65536, 4), RF_ERR_ARG, "destination layout: rank 1 holds two shards (replica 0 shard 0 and replica 1 shard 0)");
    rf_layout far = {.tp = 2, .dp = 2, .first_rank = 1};
    CHECK_ERR(rf_reshard_plan_make(&p1, &pt, &a, &far, 65536, 4), RF_ERR_ARG, "destination layout: replica 1 shard 1 is on rank 4, not a rank of a communicator of 4");
    CHECK_ERR(rf_reshard_plan_make(&p1, &pt, &a, &b, 100, 4), RF_ERR_ARG, "a bucket of 100 bytes is too small");
    CHECK(p1 == NULL);
}

static void checksum(void) {
    size_t cap = 3 * 1000 * 1000 + 64;
    unsigned char *b = malloc(cap);
    rf_rng rng;
    rf_rng_seed(&rng, 3);
    for (size_t i = 0; i < cap; i++) b[i] = (unsigned char)(rf_rng_u64(&rng) >> 24);
    int bad = 0;
    for (size_t n = 0; n <= 40000; n += n < 64 ? 1 : 97)
        for (size_t off = 0; off < 8; off += 3) {
            uint32_t seed = (uint32_t)rf_rng_u64(&rng);
            bad += rf_crc32c_extend(seed, b + off, n) != rf_crc32c_table_extend(seed, b + off, n);
        }
    CHECK(bad == 0);
    CHECK(rf_crc32c_extend(0, b + 5, cap - 64) == rf_crc32c_table_extend(0, b + 5, cap - 64));
    CHECK(rf_crc32c_extend(0, "123456789", 9) == 0xE3069283u); /* RFC 3720 B.4 check value */
    /* the checked copy: the same CRC, the same bytes, for every length and both alignments */
    unsigned char *d = malloc(cap);
    int bad_copy = 0;
    for (size_t n = 0; n <= 40000; n += n < 64 ? 1 : 97)
        for (size_t off = 0; off < 8; off += 3) {
            uint32_t seed = (uint32_t)rf_rng_u64(&rng);
            memset(d, 0xA5, n + 16);
            uint32_t crc = rf_crc32c_copy(seed, d + (off ^ 1), b + off, n);
            bad_copy += crc != rf_crc32c_table_extend(seed, b + off, n) || memcmp(d + (off ^ 1), b + off, n) != 0 ||
                        d[(off ^ 1) + n] != 0xA5;
        }
    CHECK(bad_copy == 0);
    CHECK(rf_crc32c_copy(0, d + 3, b + 5, cap - 64) == rf_crc32c_table_extend(0, b + 5, cap - 64));
    CHECK(memcmp(d + 3, b + 5, cap - 64) == 0);
    free(d);
    printf("checksum: %s path\n", rf_crc32c_hw() ? "SSE4.2" : "table");
    free(b);
}

int main(void) {
    checksum();
    rf_model *m = tiny_model();
    CHECK(m != NULL);
    if (!m) return rf_test_finish("test_reshard_plan");
    split_rules(m);
    shards(m);
    tp2_to_tp3();
    holders();
    buckets();
    whole_model(m);
    ids_and_errors(m);
    rf_model_free(m);
    return rf_test_finish("test_reshard_plan");
}
