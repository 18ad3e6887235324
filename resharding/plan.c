/* Resharding planner: interval intersection of source and destination shards, holders, cutting
 * into bucket-sized moves, buckets. */
#include "resharding/plan.h"

#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"

typedef struct builder {
    rf_reshard_move *moves;
    int n, cap;
    int64_t cap_floats; /* bucket_bytes / 4 */
    int64_t *sent;      /* (comm_size) floats each rank sends so far: senders are balanced */
    const int *node;    /* (comm_size) node of each rank, or NULL: one node */
} builder;

static rf_status push(builder *b, const rf_reshard_move *m) {
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 256;
        rf_reshard_move *p = realloc(b->moves, sizeof *p * (size_t)cap);
        if (!p) return rf_error(RF_ERR_NOMEM, "resharding plan: out of memory for %d moves", cap);
        b->moves = p, b->cap = cap;
    }
    b->moves[b->n++] = *m;
    return RF_OK;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* One move for rows [r0, r1) x cols [c0, c1) of parameter p from shard s to shard d. */
static rf_status emit(builder *b, int p, int src_rank, int dst_rank, const rf_shard *s, const rf_shard *d,
                      int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    int64_t sw = s->c1 - s->c0, dw = d->c1 - d->c0, w = c1 - c0;
    rf_reshard_move m = {
        .param = p, .src_rank = src_rank, .dst_rank = dst_rank, .r0 = r0, .r1 = r1, .c0 = c0, .c1 = c1,
        .src_off = s->offset + (size_t)((r0 - s->r0) * sw + (c0 - s->c0)),
        .dst_off = d->offset + (size_t)((r0 - d->r0) * dw + (c0 - d->c0)),
        .n_runs = r1 - r0, .run = w, .src_stride = sw, .dst_stride = dw, .bucket = 0,
    };
    if (m.n_runs == 1 || (sw == w && dw == w)) /* contiguous on both sides: one run */
        m.run *= m.n_runs, m.n_runs = 1, m.src_stride = m.dst_stride = m.run;
    return push(b, &m);
}

/* Cuts the block into moves of at most cap_floats (a row of more than that is cut into column
 * groups first). */
static rf_status cut(builder *b, int p, int src_rank, int dst_rank, const rf_shard *s, const rf_shard *d,
                     int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    int64_t cap = b->cap_floats, cw = min64(c1 - c0, cap);
    for (int64_t c = c0; c < c1; c += cw) {
        int64_t ce = min64(c + cw, c1), rows = max64(1, cap / (ce - c));
        for (int64_t r = r0; r < r1; r += rows) RF_TRY(emit(b, p, src_rank, dst_rank, s, d, r, min64(r + rows, r1), c, ce));
    }
    return RF_OK;
}

/* Source pieces of parameter p: replicated -> one piece held by every (replica, shard); split
 * -> shard s held by every replica. Picks the holder for destination replica dd, shard dt on
 * rank R and emits the intersection: R itself when it holds the piece (a local copy), else the
 * holder that has sent the least so far, scanning from a start that spreads destinations over
 * holders (so ties go round-robin), preferring holders on R's node when the nodes are known.
 * Balancing matters: with a fixed round-robin, training tp 2 x dp 4 to 8 generation replicas
 * had 4 ranks send the whole model and 4 send nothing; without the node preference, most bytes
 * of a colocated 70B tp 8 -> tp 4 reshard cross nodes. */
static rf_status cover(builder *b, const rf_reshard_plan *pl, int p, rf_shard *const *ss, const rf_shard *D, int dd,
                       int dt, int R) {
    const rf_layout *src = &pl->src;
    int replicated = ss[0][p].split == RF_SPLIT_REPLICATED;
    int n_pieces = replicated ? 1 : src->tp;
    for (int piece = 0; piece < n_pieces; piece++) {
        const rf_shard *S = &ss[piece][p];
        int64_t r0 = max64(S->r0, D->r0), r1 = min64(S->r1, D->r1), c0 = max64(S->c0, D->c0), c1 = min64(S->c1, D->c1);
        if (r0 >= r1 || c0 >= c1) continue;
        /* holders: (replica r, shard piece) for split; (r, any shard) for replicated */
        int n_holders = replicated ? src->dp * src->tp : src->dp, pick = -1;
        for (int h = 0; h < n_holders && pick < 0; h++) {
            int rr = replicated ? h / src->tp : h, st = replicated ? h % src->tp : piece;
            if (rf_layout_rank(src, rr, st) == R) pick = h;
        }
        if (pick < 0) {
            int start = (dd * pl->dst.tp + dt) % n_holders, best_far = 2;
            int64_t best = -1;
            for (int k = 0; k < n_holders; k++) {
                int h = (start + k) % n_holders;
                int rr = replicated ? h / src->tp : h, st = replicated ? h % src->tp : piece;
                int hr = rf_layout_rank(src, rr, st), far = b->node && b->node[hr] != b->node[R];
                int64_t load = b->sent[hr];
                if (far < best_far || (far == best_far && load < best)) best_far = far, best = load, pick = h;
            }
            int rr = replicated ? pick / src->tp : pick, st = replicated ? pick % src->tp : piece;
            b->sent[rf_layout_rank(src, rr, st)] += (r1 - r0) * (c1 - c0);
        }
        int rr = replicated ? pick / src->tp : pick, st = replicated ? pick % src->tp : piece;
        RF_TRY(cut(b, p, rf_layout_rank(src, rr, st), R, &ss[st][p], D, r0, r1, c0, c1));
    }
    return RF_OK;
}

static void assign_buckets(rf_reshard_plan *pl) {
    size_t *sent = calloc((size_t)pl->comm_size, sizeof *sent), *recv = calloc((size_t)pl->comm_size, sizeof *recv);
    RF_ASSERT(sent && recv);
    int cur = 0, any = 0;
    for (int i = 0; i < pl->n_moves; i++) {
        rf_reshard_move *m = &pl->moves[i];
        if (m->src_rank != m->dst_rank) {
            size_t bytes = (size_t)(m->n_runs * m->run) * sizeof(float);
            if ((sent[m->src_rank] && sent[m->src_rank] + bytes > pl->bucket_bytes) ||
                (recv[m->dst_rank] && recv[m->dst_rank] + bytes > pl->bucket_bytes)) {
                cur++;
                memset(sent, 0, sizeof *sent * (size_t)pl->comm_size);
                memset(recv, 0, sizeof *recv * (size_t)pl->comm_size);
            }
            sent[m->src_rank] += bytes, recv[m->dst_rank] += bytes;
        }
        m->bucket = cur, any = 1;
    }
    pl->n_buckets = any ? cur + 1 : 0;
    free(sent), free(recv);
}

static uint32_t crc_i64(uint32_t crc, int64_t v) { return rf_crc32c_extend(crc, &v, sizeof v); }

/* Over the fields (not the structs: their padding is undefined). */
static uint32_t plan_id(const rf_reshard_plan *pl) {
    uint32_t c = 0;
    int64_t head[] = {pl->tp_src, pl->src.dp, pl->tp_dst, pl->dst.dp, pl->n_views, pl->n_moves, (int64_t)pl->bucket_bytes};
    for (size_t i = 0; i < sizeof head / sizeof *head; i++) c = crc_i64(c, head[i]);
    for (int i = 0; i < pl->src.dp * pl->src.tp; i++) c = crc_i64(c, pl->src_ranks[i]);
    for (int i = 0; i < pl->dst.dp * pl->dst.tp; i++) c = crc_i64(c, pl->dst_ranks[i]);
    for (int i = 0; i < pl->n_views; i++) c = crc_i64(c, (int64_t)pl->views[i].numel);
    for (int i = 0; i < pl->n_moves; i++) {
        const rf_reshard_move *m = &pl->moves[i];
        int64_t f[] = {m->param, m->src_rank, m->dst_rank, m->r0, m->r1, m->c0, m->c1, (int64_t)m->src_off,
                       (int64_t)m->dst_off, m->n_runs, m->run, m->src_stride, m->dst_stride, m->bucket};
        for (size_t k = 0; k < sizeof f / sizeof *f; k++) c = crc_i64(c, f[k]);
    }
    return c;
}

static int *copy_ranks(const rf_layout *l) {
    int n = l->dp * l->tp, *r = malloc(sizeof(int) * (size_t)n);
    if (r)
        for (int i = 0; i < n; i++) r[i] = rf_layout_rank(l, i / l->tp, i % l->tp);
    return r;
}

static int same_layout(const rf_reshard_plan *pl) {
    if (pl->src.tp != pl->dst.tp || pl->src.dp != pl->dst.dp) return 0;
    return memcmp(pl->src_ranks, pl->dst_ranks, sizeof(int) * (size_t)(pl->src.dp * pl->src.tp)) == 0;
}

/* Shards of every tp rank of a layout: (tp) arrays of n_views. */
static rf_status all_shards(const rf_param_table *pt, int tp, rf_shard ***out, size_t *floats) {
    rf_shard **s = calloc((size_t)tp, sizeof *s);
    if (!s) return rf_error(RF_ERR_NOMEM, "out of memory");
    *out = s;
    for (int t = 0; t < tp; t++) {
        s[t] = calloc((size_t)pt->n_views, sizeof **s);
        if (!s[t]) return rf_error(RF_ERR_NOMEM, "out of memory");
        RF_TRY(rf_layout_shards(pt, tp, t, s[t], &floats[t]));
    }
    return RF_OK;
}

static void free_shards(rf_shard **s, int tp) {
    for (int t = 0; s && t < tp; t++) free(s[t]);
    free(s);
}

static rf_status plan_moves(rf_reshard_plan *pl, const rf_param_table *pt, const int *node) {
    rf_shard **ss = NULL, **ds = NULL;
    builder b = {.cap_floats = (int64_t)(pl->bucket_bytes / sizeof(float)),
                 .sent = calloc((size_t)pl->comm_size, sizeof(int64_t)), .node = node};
    rf_status st = b.sent ? all_shards(pt, pl->tp_src, &ss, pl->src_floats) : rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) st = all_shards(pt, pl->tp_dst, &ds, pl->dst_floats);
    if (st == RF_OK && same_layout(pl)) pl->zero_copy = 1;
    for (int p = 0; st == RF_OK && !pl->zero_copy && p < pt->n_views; p++)
        for (int d = 0; st == RF_OK && d < pl->dst.dp; d++)
            for (int t = 0; st == RF_OK && t < pl->tp_dst; t++)
                st = cover(&b, pl, p, ss, &ds[t][p], d, t, rf_layout_rank(&pl->dst, d, t));
    free_shards(ss, pl->tp_src);
    free_shards(ds, pl->tp_dst);
    free(b.sent);
    pl->moves = b.moves, pl->n_moves = b.n;
    return st;
}

rf_status rf_reshard_plan_make(rf_reshard_plan **out, const rf_param_table *pt, const rf_layout *src,
                               const rf_layout *dst, size_t bucket_bytes, int comm_size) {
    return rf_reshard_plan_make_nodes(out, pt, src, dst, bucket_bytes, comm_size, NULL);
}

rf_status rf_reshard_plan_make_nodes(rf_reshard_plan **out, const rf_param_table *pt, const rf_layout *src,
                                     const rf_layout *dst, size_t bucket_bytes, int comm_size,
                                     const int *node) {
    *out = NULL;
    RF_TRY(rf_layout_check(src, pt->cfg, comm_size, "source layout"));
    RF_TRY(rf_layout_check(dst, pt->cfg, comm_size, "destination layout"));
    if (bucket_bytes < 4096) return rf_error(RF_ERR_ARG, "resharding: a bucket of %zu bytes is too small (4096 at least)", bucket_bytes);
    rf_reshard_plan *pl = calloc(1, sizeof *pl);
    if (!pl) return rf_error(RF_ERR_NOMEM, "out of memory");
    pl->bucket_bytes = bucket_bytes, pl->comm_size = comm_size, pl->n_views = pt->n_views;
    pl->src = *src, pl->dst = *dst, pl->tp_src = src->tp, pl->tp_dst = dst->tp;
    pl->src_ranks = copy_ranks(src), pl->dst_ranks = copy_ranks(dst);
    pl->src.ranks = pl->src_ranks, pl->dst.ranks = pl->dst_ranks;
    pl->src_floats = calloc((size_t)src->tp, sizeof(size_t));
    pl->dst_floats = calloc((size_t)dst->tp, sizeof(size_t));
    pl->views = malloc(sizeof *pl->views * (size_t)(pt->n_views ? pt->n_views : 1));
    rf_status st = RF_OK;
    if (!pl->src_ranks || !pl->dst_ranks || !pl->src_floats || !pl->dst_floats || !pl->views) {
        st = rf_error(RF_ERR_NOMEM, "out of memory");
    } else {
        memcpy(pl->views, pt->views, sizeof *pl->views * (size_t)pt->n_views);
        st = plan_moves(pl, pt, node);
    }
    if (st != RF_OK) {
        rf_reshard_plan_free(pl);
        return st;
    }
    assign_buckets(pl);
    pl->id = plan_id(pl);
    *out = pl;
    return RF_OK;
}

void rf_reshard_plan_free(rf_reshard_plan *p) {
    if (!p) return;
    free(p->moves);
    free(p->src_ranks), free(p->dst_ranks);
    free(p->src_floats), free(p->dst_floats);
    free(p->views);
    free(p);
}

void rf_reshard_plan_bytes(const rf_reshard_plan *p, int rank, size_t *sent, size_t *received, size_t *copied) {
    size_t s = 0, r = 0, c = 0;
    for (int i = 0; i < p->n_moves; i++) {
        const rf_reshard_move *m = &p->moves[i];
        size_t bytes = (size_t)(m->n_runs * m->run) * sizeof(float);
        if (m->src_rank == rank && m->dst_rank == rank) c += bytes;
        else if (m->src_rank == rank) s += bytes;
        else if (m->dst_rank == rank) r += bytes;
    }
    if (sent) *sent = s;
    if (received) *received = r;
    if (copied) *copied = c;
}

static void print_layout(FILE *f, const char *name, const rf_layout *l) {
    fprintf(f, "%s tp=%d dp=%d ranks", name, l->tp, l->dp);
    for (int i = 0; i < l->dp * l->tp; i++) fprintf(f, "%s%d", i ? "," : " ", l->ranks[i]);
}

void rf_reshard_plan_print(const rf_reshard_plan *p, FILE *f) {
    size_t total = 0;
    for (int i = 0; i < p->n_moves; i++) total += (size_t)(p->moves[i].n_runs * p->moves[i].run) * sizeof(float);
    fprintf(f, "plan %08x: ", p->id);
    print_layout(f, "source", &p->src);
    fprintf(f, " -> ");
    print_layout(f, "destination", &p->dst);
    fprintf(f, "; %s%d moves, %zu bytes, %d bucket%s of at most %zu bytes\n", p->zero_copy ? "zero copy, " : "", p->n_moves,
            total, p->n_buckets, p->n_buckets == 1 ? "" : "s", p->bucket_bytes);
    for (int i = 0; i < p->n_moves; i++) {
        const rf_reshard_move *m = &p->moves[i];
        int strided = m->n_runs > 1;
        fprintf(f, "bucket %d: %s [%lld:%lld, %lld:%lld] rank %d -> rank %d, %lld x %lld floats%s\n", m->bucket,
                p->views[m->param].name, (long long)m->r0, (long long)m->r1, (long long)m->c0, (long long)m->c1,
                m->src_rank, m->dst_rank, (long long)m->n_runs, (long long)m->run,
                m->src_rank == m->dst_rank ? " (local copy)" : strided ? " (strided)" : "");
    }
}
