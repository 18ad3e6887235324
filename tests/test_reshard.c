/* Resharding executed over MPI (mpirun --oversubscribe, 2 and 4 ranks) on a tiny random GQA
 * model (4 q heads, 2 kv heads: k/v split at tp 2, replicated at tp 4; vocabulary 50, not a
 * multiple of 4; o_proj bias and q/k norms replicated):
 *   - every ordered pair of layouts with tp in {1, 2, 4} and dp filling the ranks, colocated on
 *     the same ranks, on ranks in reverse order, and split over disjoint halves (2 + 2 ranks),
 *     in buckets of 4 KiB (many buckets, rows cut into columns) and 1 MiB: every destination
 *     rank's buffer equals, bit for bit (memcmp), the slice of the full model its shard is;
 *     identical layouts are zero copy (nothing executed, the destination buffer untouched);
 *   - a round trip train -> generation -> train with other values on the way back;
 *   - refusals: a rank moving another version, a rank that planned with another bucket size,
 *     data damaged in transit (test hook RF_TEST_RESHARD_CORRUPT on the sender; not detected
 *     with no_verify), a rank that never takes part (RF_ERR_IO within the bound, naming it).
 * Skips (77) when mpirun is not installed. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/shm.h"
#include "common/util.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "resharding/reshard.h"
#include "test_comm_util.h"
#include "test_util.h"

static rf_model *g_m;      /* the full model, identical on every rank (same seed) */
static rf_param_table g_pt;

static rf_model *tiny_model(uint64_t seed) {
    rf_model_config cfg;
    if (rf_config_preset(&cfg, "tiny", 50) != RF_OK) return NULL;
    cfg.tie_word_embeddings = 0, cfg.o_bias = 1, cfg.qk_norm = 1;
    rf_model *m = NULL;
    if (rf_model_init(&m, &cfg, rf_cpu_kernels()) != RF_OK) return NULL;
    rf_model_init_random(m, seed, 1.0f);
    return m;
}

/* This rank's buffer of layout l cut from `full`, or NULL when it holds no shard. *n floats.
 * shared: in memory other ranks may read in place (common/shm.h; free with rf_shm_free). */
static float *local_of_mem(const rf_layout *l, int rank, const float *full, size_t *n, int shared) {
    int t = 0;
    *n = 0;
    if (!rf_layout_find(l, rank, NULL, &t)) return NULL;
    rf_shard *s = calloc((size_t)g_pt.n_views, sizeof *s);
    if (rf_layout_shards(&g_pt, l->tp, t, s, n) != RF_OK) {
        free(s);
        return NULL;
    }
    float *buf = NULL;
    if (shared) CHECK_OK(rf_shm_alloc((void **)&buf, sizeof(float) * (*n + 1), "test source"));
    else buf = malloc(sizeof(float) * (*n + 1));
    rf_layout_extract(&g_pt, s, full, buf);
    free(s);
    return buf;
}

static float *local_of(const rf_layout *l, int rank, const float *full, size_t *n) {
    return local_of_mem(l, rank, full, n, 0);
}

/* 1 when this rank exchanges anything with another rank in plan p. */
static int has_remote(const rf_reshard_plan *p, int rank) {
    for (int i = 0; i < p->n_moves; i++) {
        const rf_reshard_move *m = &p->moves[i];
        if (m->src_rank != m->dst_rank && (m->src_rank == rank || m->dst_rank == rank)) return 1;
    }
    return 0;
}

static const char *describe(const rf_layout *l, char *out, size_t cap) {
    size_t len = (size_t)snprintf(out, cap, "tp%d dp%d on", l->tp, l->dp);
    for (int i = 0; i < l->tp * l->dp && len < cap; i++) len += (size_t)snprintf(out + len, cap - len, " %d", rf_layout_rank(l, i / l->tp, i % l->tp));
    return out;
}

/* Moves `full` from a to b; checks this rank's destination buffer bit for bit. shared: the
 * sources are in shareable memory, so every exchange must be a read in place (all ranks are on
 * this host); otherwise none may be. */
static void one_pair_mem(rf_comm *c, const rf_layout *a, const rf_layout *b, size_t bucket, const float *full, int64_t version,
                         int shared) {
    int rank = rf_comm_rank(c);
    rf_reshard_plan *p = NULL;
    CHECK_OK(rf_reshard_plan_make(&p, &g_pt, a, b, bucket, rf_comm_size(c)));
    if (!p) return;
    size_t ns = 0, nd = 0, ne = 0;
    float *src = local_of_mem(a, rank, full, &ns, shared), *want = local_of(b, rank, full, &ne);
    float *dst = want ? malloc(sizeof(float) * (ne + 1)) : NULL;
    if (dst) memset(dst, 0xff, sizeof(float) * (ne + 1)), nd = ne;
    rf_reshard *x = NULL;
    CHECK_OK(rf_reshard_init(&x, p, c, NULL));
    if (x) {
        CHECK_OK(rf_reshard_run(x, src, dst, version));
        int peers = rf_reshard_in_place_peers(x);
        CHECK(shared && has_remote(p, rank) ? peers > 0 : peers == 0);
        rf_reshard_free(x);
    }
    char da[64], db[64];
    if (p->zero_copy) {
        /* nothing moved: the source buffer is the destination's */
        unsigned char ff[sizeof(float)];
        memset(ff, 0xff, sizeof ff);
        CHECK(!dst || memcmp(dst, ff, sizeof ff) == 0);
        CHECK((src == NULL) == (want == NULL));
        if (src && want) CHECK(ns == ne && memcmp(src, want, sizeof(float) * ne) == 0);
    } else if (want) {
        int same = memcmp(dst, want, sizeof(float) * nd) == 0;
        CHECK(same);
        if (!same)
            fprintf(stderr, "rank %d: %s -> %s, bucket %zu: destination differs\n", rank, describe(a, da, sizeof da),
                    describe(b, db, sizeof db), bucket);
    }
    if (shared) rf_shm_free(src);
    else free(src);
    free(want), free(dst);
    rf_reshard_plan_free(p);
}

static void one_pair(rf_comm *c, const rf_layout *a, const rf_layout *b, size_t bucket, const float *full, int64_t version) {
    one_pair_mem(c, a, b, bucket, full, version, 0);
}

/* Every ordered pair of a list of layouts, with two bucket sizes, through messages and read in
 * place. */
static void all_pairs(rf_comm *c, const rf_layout *ls, int n) {
    size_t buckets[2] = {4096, 1 << 20};
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            for (int k = 0; k < 4; k++) one_pair_mem(c, &ls[i], &ls[j], buckets[k / 2], g_m->params, 100 + i * n + j, k & 1);
}

static void layouts_4(rf_comm *c) {
    static const int rev[4] = {3, 2, 1, 0}, lo[2] = {0, 1}, hi[2] = {2, 3};
    rf_layout ls[] = {
        {.tp = 1, .dp = 4}, {.tp = 2, .dp = 2}, {.tp = 4, .dp = 1},             /* all ranks */
        {.tp = 2, .dp = 2, .ranks = rev}, {.tp = 4, .dp = 1, .ranks = rev},      /* reversed */
        {.tp = 1, .dp = 2, .ranks = lo}, {.tp = 2, .dp = 1, .ranks = lo},        /* ranks 0, 1 */
        {.tp = 1, .dp = 2, .ranks = hi}, {.tp = 2, .dp = 1, .ranks = hi},        /* ranks 2, 3 */
    };
    all_pairs(c, ls, (int)(sizeof ls / sizeof *ls));
}

static void layouts_2(rf_comm *c) {
    static const int rev[2] = {1, 0};
    rf_layout ls[] = {
        {.tp = 1, .dp = 2}, {.tp = 2, .dp = 1}, {.tp = 2, .dp = 1, .ranks = rev},
        {.tp = 1, .dp = 1, .first_rank = 0}, {.tp = 1, .dp = 1, .first_rank = 1},
    };
    all_pairs(c, ls, (int)(sizeof ls / sizeof *ls));
}

/* Training tp 2 -> generation tp 1 x replicas, then generation -> training with other values
 * (a model of another seed) on the generation ranks: training ends with the new values. */
static void round_trip(rf_comm *c) {
    int size = rf_comm_size(c), rank = rf_comm_rank(c);
    rf_layout train = {.tp = 2, .dp = size / 2}, gen = {.tp = 1, .dp = size};
    rf_model *other = tiny_model(99);
    one_pair(c, &train, &gen, 65536, g_m->params, 1);
    rf_reshard_plan *back = NULL;
    CHECK_OK(rf_reshard_plan_make(&back, &g_pt, &gen, &train, 65536, size));
    size_t ns = 0, ne = 0;
    float *src = local_of(&gen, rank, other->params, &ns), *want = local_of(&train, rank, other->params, &ne);
    float *dst = calloc(ne + 1, sizeof(float));
    CHECK_OK(rf_reshard_execute(back, c, src, dst, 2, NULL));
    CHECK(want && memcmp(dst, want, sizeof(float) * ne) == 0);
    free(src), free(want), free(dst);
    rf_reshard_plan_free(back);
    rf_model_free(other);
}

/* tp 1 on rank 0 -> tp 1 x size replicas: rank 0 talks to every rank. */
static rf_reshard_plan *fan_out(rf_comm *c, size_t bucket) {
    rf_layout a = {.tp = 1, .dp = 1}, b = {.tp = 1, .dp = rf_comm_size(c)};
    rf_reshard_plan *p = NULL;
    CHECK_OK(rf_reshard_plan_make(&p, &g_pt, &a, &b, bucket, rf_comm_size(c)));
    return p;
}

static void refusals(rf_comm *world) {
    int rank = rf_comm_rank(world), size = rf_comm_size(world);
    rf_layout a = {.tp = 1, .dp = 1}, b = {.tp = 1, .dp = size};
    size_t n = 0, ne = 0;
    float *src = local_of(&a, rank, g_m->params, &n), *dst = local_of(&b, rank, g_m->params, &ne);
    char want[256];
    /* another version on rank 0: refused by every rank at the hello */
    rf_reshard_plan *p = fan_out(world, 65536);
    rf_error_clear();
    rf_status st = rf_reshard_execute(p, world, src, dst, rank == 0 ? 5 : 6, NULL);
    CHECK(st == RF_ERR_FORMAT);
    if (rank == 0) snprintf(want, sizeof want, "resharding: world rank 1 moves version 6, world rank 0 version 5");
    else snprintf(want, sizeof want, "resharding: world rank 0 moves version 5, world rank %d version 6", rank);
    CHECK(strcmp(rf_error_message(), want) == 0);
    /* another plan on rank 0 (bucket size) */
    rf_reshard_plan *q = fan_out(world, 32768);
    rf_error_clear();
    st = rf_reshard_execute(rank == 0 ? q : p, world, src, dst, 7, NULL);
    CHECK(st == RF_ERR_FORMAT);
    snprintf(want, sizeof want, "resharding: world rank %d planned differently from world rank %d", rank == 0 ? 1 : 0, rank);
    CHECK(strstr(rf_error_message(), want) == rf_error_message());
    /* damaged in bucket 0 on the way from rank 0: every receiver says so, naming it */
    if (rank == 0) setenv("RF_TEST_RESHARD_CORRUPT", "0", 1);
    rf_error_clear();
    st = rf_reshard_execute(p, world, src, dst, 8, NULL);
    if (rank == 0) {
        CHECK_OK(st);
    } else {
        CHECK(st == RF_ERR_FORMAT);
        snprintf(want, sizeof want, "resharding version 8, bucket 0: the data from world rank 0 arrived damaged at world rank %d: CRC-32C ", rank);
        CHECK(strstr(rf_error_message(), want) == rf_error_message());
        CHECK(strstr(rf_error_message(), "model.layers.") != NULL);
    }
    /* the same damage when the receivers read rank 0's buffer in place */
    size_t n2 = 0;
    float *shared = local_of_mem(&a, rank, g_m->params, &n2, 1);
    rf_error_clear();
    rf_reshard *x = NULL;
    CHECK_OK(rf_reshard_init(&x, p, world, NULL));
    st = rf_reshard_run(x, shared, dst, 10);
    CHECK(rf_reshard_in_place_peers(x) == (rank == 0 ? size - 1 : 1));
    rf_reshard_free(x);
    if (rank == 0) {
        CHECK_OK(st);
    } else {
        CHECK(st == RF_ERR_FORMAT);
        snprintf(want, sizeof want, "resharding version 10, bucket 0: the data from world rank 0 arrived damaged at world rank %d: CRC-32C ", rank);
        CHECK(strstr(rf_error_message(), want) == rf_error_message());
    }
    if (rank == 0) unsetenv("RF_TEST_RESHARD_CORRUPT");
    /* no_shm: through messages although the buffer could be read in place */
    rf_reshard_opts ns = {.no_shm = 1};
    CHECK_OK(rf_reshard_init(&x, p, world, &ns));
    CHECK_OK(rf_reshard_run(x, shared, dst, 11));
    CHECK(rf_reshard_in_place_peers(x) == 0);
    rf_reshard_free(x);
    /* rank 0 offers, the last rank declines (no_shm on the reader's side): it gets messages,
     * the others read in place; every destination bit for bit */
    rf_reshard_opts decline = {.no_shm = rank == size - 1};
    float *want_dst = local_of(&b, rank, g_m->params, &ne);
    CHECK_OK(rf_reshard_init(&x, p, world, &decline));
    memset(dst, 0, sizeof(float) * ne);
    CHECK_OK(rf_reshard_run(x, shared, dst, 12));
    CHECK(memcmp(dst, want_dst, sizeof(float) * ne) == 0);
    CHECK(rf_reshard_in_place_peers(x) == (rank == 0 ? size - 2 : rank == size - 1 ? 0 : 1));
    rf_reshard_free(x);
    free(want_dst);
    if (rank == 0) setenv("RF_TEST_RESHARD_CORRUPT", "0", 1);
    rf_shm_free(shared);
    rf_reshard_opts nv = {.no_verify = 1};
    CHECK_OK(rf_reshard_execute(p, world, src, dst, 9, &nv)); /* not checked, not detected */
    unsetenv("RF_TEST_RESHARD_CORRUPT");
    CHECK_OK(rf_reshard_execute(p, world, src, dst, 10, NULL));
    rf_reshard_plan_free(q);
    /* the last rank never takes part: rank 0 fails at the hello naming it, the others while
     * waiting for rank 0's data in bucket 0 */
    rf_comm *d = NULL;
    CHECK_OK(rf_comm_split(world, 0, rank, &d));
    if (rank != size - 1) {
        rf_reshard_opts o = {.timeout_s = 0.4};
        double t0 = rf_time_now();
        rf_error_clear();
        st = rf_reshard_execute(p, d, src, dst, 11, &o);
        double dt = rf_time_now() - t0;
        CHECK(st == RF_ERR_IO);
        if (rank == 0)
            snprintf(want, sizeof want, "resharding version 11 (hello): world rank 0 waited 0.4 s for world rank %d (a rank is gone or stuck)", size - 1);
        else
            snprintf(want, sizeof want, "resharding version 11, bucket 0 of %d: world rank %d waited 0.4 s for world rank 0 (a rank is gone or stuck)",
                     p->n_buckets, rank);
        CHECK(strcmp(rf_error_message(), want) == 0);
        if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), want);
        CHECK(dt >= 0.4 && dt < (rank == 0 ? 2.0 : 3.0));
    }
    rf_comm_free(d);
    CHECK_OK(rf_comm_barrier(world, 30, "after the resharding timeout"));
    rf_reshard_plan_free(p);
    free(src), free(dst);
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = NULL;
    if (rf_comm_world(&argc, &argv, &world) != RF_OK) {
        fprintf(stderr, "test_reshard: %s\n", rf_error_message());
        return 1;
    }
    g_m = tiny_model(7);
    CHECK(g_m != NULL);
    if (g_m) {
        g_pt = rf_param_table_of(g_m);
        if (rf_comm_size(world) == 4) layouts_4(world);
        else layouts_2(world);
        round_trip(world);
        refusals(world);
    }
    rf_model_free(g_m);
    int rc = rf_test_mpi_finish(world, "test_reshard");
    rf_comm_finalize();
    return rc;
}

/* Shareable memory in one process: found, mapped through /proc like another process would,
 * refused when the description does not match. */
static void shm_alone(void) {
    float *a = NULL;
    CHECK_OK(rf_shm_alloc((void **)&a, 10000 * sizeof(float), "test"));
    if (!a) return;
    for (int i = 0; i < 10000; i++) a[i] = (float)i;
    rf_shm_ref ref;
    float plain[4];
    CHECK(rf_shm_lookup(plain, sizeof plain, &ref) == 0);
    CHECK(rf_shm_lookup(a + 9000, 2000 * sizeof(float), &ref) == 0); /* runs past the end */
    CHECK(rf_shm_lookup(a + 100, 50 * sizeof(float), &ref) == 1);
    CHECK(ref.offset == 100 * sizeof(float) && ref.region >= 10000 * sizeof(float) && ref.host == rf_shm_host_key());
    rf_shm_map m;
    CHECK_OK(rf_shm_map_open(&m, &ref));
    const float *seen = (const float *)((const char *)m.base + ref.offset);
    CHECK(m.base && seen[0] == 100.0f && seen[49] == 149.0f);
    a[100] = -1; /* one memory: the mapping sees the change */
    CHECK(m.base && seen[0] == -1.0f);
    /* kept while the same allocation is described (another offset into it), remapped else */
    const void *base = m.base;
    rf_shm_ref other = ref;
    other.offset = 0;
    CHECK_OK(rf_shm_map_keep(&m, &other));
    CHECK(m.base == base);
    rf_shm_ref gone = ref;
    gone.inode += 1;
    CHECK(rf_shm_map_keep(&m, &gone) == RF_ERR_IO && m.base == NULL);
    rf_shm_map_close(&m);
    rf_shm_ref bad = ref;
    bad.inode += 1;
    char want[256];
    snprintf(want, sizeof want, "shared memory of pid %d: /proc/%d/fd/%d is not the allocation described (inode %llu, expected %llu)",
             ref.pid, ref.pid, ref.fd, (unsigned long long)ref.inode, (unsigned long long)bad.inode);
    CHECK_ERR(rf_shm_map_open(&m, &bad), RF_ERR_IO, want);
    bad = ref, bad.host ^= 1;
    snprintf(want, sizeof want, "shared memory of pid %d: on another host or PID namespace", ref.pid);
    CHECK_ERR(rf_shm_map_open(&m, &bad), RF_ERR_IO, want);
    rf_shm_free(a);
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    shm_alone();
    if (!rf_test_have_mpirun()) {
        printf("test_reshard: skipped: mpirun not found (apt-get install openmpi-bin)\n");
        return 77;
    }
    /* the single-rank back end: tp 1 to tp 1 on rank 0 is zero copy, and executes */
    g_m = tiny_model(7);
    g_pt = rf_param_table_of(g_m);
    rf_layout one = {.tp = 1, .dp = 1};
    one_pair(rf_comm_single(), &one, &one, 4096, g_m->params, 1);
    rf_model_free(g_m);
    CHECK(rf_test_mpirun_self(2, 120, NULL) == 0);
    CHECK(rf_test_mpirun_self(4, 120, NULL) == 0);
    return rf_test_finish("test_reshard");
}
