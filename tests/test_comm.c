/* comm on CPU: the single-rank back end in this process, then the MPI back end under
 * `mpirun --oversubscribe` with 2 and 4 ranks. Every result is compared with values worked out
 * by hand; the inputs are small integers, so float sums are exact in any order and the checks
 * are bit for bit (nccl-tests' idea).
 *   - allreduce (separate and in place, including more floats than fit a page), reduce-scatter,
 *     allgather, broadcast from every root, barrier, zero-sized operations;
 *   - grouped send/recv: an all-to-all of distinct payloads with two messages per pair (order
 *     kept), sends to self, a ring of sizes that differ per rank, two exchanges in flight at
 *     once (started, then waited for);
 *   - sub-communicators: split by parity, reversed key order, a rank left out (color < 0), the
 *     world ranks they report;
 *   - timeouts: for each collective and for send/recv, one rank never posts its part; the others
 *     fail with RF_ERR_IO and the exact message naming the operation and the ranks waited for,
 *     within the bound, and the communicator then refuses further work at once;
 *   - single transfers (isend/irecv/wait) keep working, and say UNSUPPORTED off MPI;
 *   - devices for a NCCL communicator: one per rank is fine, one for all is refused on every
 *     rank naming ranks 0 and 1.
 * Skips (77) when mpirun is not installed. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "common/util.h"
#include "test_comm_util.h"
#include "test_util.h"

#define T_OK 30.0   /* bound for operations that must succeed */
#define T_SHORT 0.4 /* bound for operations that must time out */

/* ---- single rank ---- */

static void single_rank(void) {
    rf_comm *c = NULL;
    CHECK_OK(rf_comm_world(NULL, NULL, &c));
    CHECK(c == rf_comm_single());
    CHECK(rf_comm_rank(c) == 0 && rf_comm_size(c) == 1);
    CHECK(rf_comm_backend(c) == RF_COMM_SINGLE && strcmp(rf_comm_backend_name(c), "single") == 0);
    float a[3] = {1, 2, 3}, b[3] = {0};
    CHECK_OK(rf_comm_allreduce(c, a, b, 3, 1, "allreduce"));
    CHECK(b[0] == 1 && b[1] == 2 && b[2] == 3);
    CHECK_OK(rf_comm_allreduce(c, a, a, 3, 1, "allreduce in place"));
    CHECK(a[2] == 3);
    float rs = 0;
    CHECK_OK(rf_comm_reduce_scatter(c, a + 1, &rs, 1, 1, "reduce-scatter"));
    CHECK(rs == 2);
    char g[4] = "xyz", h[4] = "";
    CHECK_OK(rf_comm_allgather(c, g, h, 4, 1, "allgather"));
    CHECK(strcmp(h, "xyz") == 0);
    CHECK_OK(rf_comm_bcast(c, g, 4, 0, 1, "bcast"));
    CHECK_ERR(rf_comm_bcast(c, g, 4, 1, 1, "bcast from 1"), RF_ERR_ARG, "bcast from 1: root 1 is not a rank of a communicator of 1");
    CHECK_OK(rf_comm_barrier(c, 1, "barrier"));
    /* sends to self pair with receives in order */
    int s1 = 11, s2 = 22, r1 = 0, r2 = 0;
    rf_comm_p2p ops[4] = {{&s1, 4, 0, 1}, {&r1, 4, 0, 0}, {&r2, 4, 0, 0}, {&s2, 4, 0, 1}};
    CHECK_OK(rf_comm_sendrecv(c, ops, 4, 1, "to self"));
    CHECK(r1 == 11 && r2 == 22);
    rf_comm_group *grp = NULL;
    r1 = r2 = 0;
    CHECK_OK(rf_comm_sendrecv_start(c, ops, 4, "to self, started", &grp));
    CHECK(r1 == 11 && r2 == 22); /* the single back end copies at the start */
    CHECK_OK(rf_comm_group_wait(grp, 1));
    CHECK_OK(rf_comm_group_wait(NULL, 1));
    rf_comm_p2p bad[2] = {{&s1, 4, 0, 1}, {&r1, 2, 0, 0}};
    CHECK_ERR(rf_comm_sendrecv(c, bad, 2, 1, "sizes"), RF_ERR_ARG, "sizes: a send of 4 bytes to self meets a receive of 2");
    CHECK_ERR(rf_comm_sendrecv(c, bad, 1, 1, "lone"), RF_ERR_ARG, "lone: a send to self has no matching receive");
    rf_comm_p2p far = {&s1, 4, 1, 1};
    CHECK_ERR(rf_comm_sendrecv(c, &far, 1, 1, "far"), RF_ERR_ARG, "far: peer 1 is not a rank of a communicator of 1");
    rf_comm *sub = NULL;
    CHECK_OK(rf_comm_split(c, -1, 0, &sub));
    CHECK(sub == NULL);
    CHECK_OK(rf_comm_split(c, 3, 0, &sub));
    CHECK(sub && rf_comm_size(sub) == 1 && rf_comm_backend(sub) == RF_COMM_SINGLE);
    rf_comm_free(sub);
    rf_comm_req *req = NULL;
    CHECK_ERR(rf_comm_isend(c, &s1, 4, 0, 5, &req), RF_ERR_UNSUPPORTED, "single transfers need the MPI back end of comm, not single");
    CHECK(req == NULL);
    CHECK(rf_comm_iprobe(c, 0, 5) == -1);
    rf_comm *nc = NULL;
    rf_status st = rf_comm_nccl(c, 0, 1, &nc);
#ifdef RLFLOW_HAVE_NCCL
    /* this test runs on machines without a GPU: there the device does not exist */
    CHECK(st == RF_ERR_NODEVICE || st == RF_OK);
#else
    CHECK(st == RF_ERR_UNSUPPORTED && strstr(rf_error_message(), "not in this build"));
#endif
    rf_comm_free(nc);
    rf_comm_free(c); /* the library's: ignored */
    CHECK(rf_comm_size(rf_comm_single()) == 1);
}

/* ---- collectives under MPI ---- */

static void allreduce(rf_comm *c) {
    int rank = rf_comm_rank(c), size = rf_comm_size(c);
    size_t n = 5000;
    float *in = malloc(n * sizeof(float)), *out = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) in[i] = (float)(rank * 1000 + (int)i);
    CHECK_OK(rf_comm_allreduce(c, in, out, n, T_OK, "allreduce"));
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += out[i] != (float)(1000 * size * (size - 1) / 2 + size * (int)i);
    CHECK(bad == 0);
    CHECK(in[7] == (float)(rank * 1000 + 7)); /* input untouched */
    CHECK_OK(rf_comm_allreduce(c, in, in, n, T_OK, "allreduce in place"));
    CHECK(memcmp(in, out, n * sizeof(float)) == 0);
    CHECK_OK(rf_comm_allreduce(c, in, out, 0, T_OK, "empty allreduce"));
    free(in), free(out);
}

static void reduce_scatter(rf_comm *c) {
    int rank = rf_comm_rank(c), size = rf_comm_size(c), n = 37;
    float *in = malloc(sizeof(float) * (size_t)(n * size)), out[37];
    /* block b, element i of rank q: (q + 1) * (100 b + i) */
    for (int b = 0; b < size; b++)
        for (int i = 0; i < n; i++) in[b * n + i] = (float)((rank + 1) * (100 * b + i));
    CHECK_OK(rf_comm_reduce_scatter(c, in, out, (size_t)n, T_OK, "reduce-scatter"));
    int bad = 0;
    for (int i = 0; i < n; i++) bad += out[i] != (float)((100 * rank + i) * size * (size + 1) / 2);
    CHECK(bad == 0);
    free(in);
}

static void allgather_bcast_barrier(rf_comm *c) {
    int rank = rf_comm_rank(c), size = rf_comm_size(c);
    char mine[16], *all = malloc((size_t)size * 16);
    snprintf(mine, sizeof mine, "rank%04d", rank);
    CHECK_OK(rf_comm_allgather(c, mine, all, 16, T_OK, "allgather"));
    int bad = 0;
    for (int r = 0; r < size; r++) {
        char want[16];
        snprintf(want, sizeof want, "rank%04d", r);
        bad += strcmp(all + r * 16, want) != 0;
    }
    CHECK(bad == 0);
    free(all);
    for (int root = 0; root < size; root++) {
        int64_t v[3] = {rank, rank, rank};
        if (rank == root) v[0] = 1000 + root, v[1] = -root, v[2] = INT64_C(1) << 40;
        CHECK_OK(rf_comm_bcast(c, v, sizeof v, root, T_OK, "bcast"));
        CHECK(v[0] == 1000 + root && v[1] == -root && v[2] == INT64_C(1) << 40);
    }
    CHECK_OK(rf_comm_bcast(c, NULL, 0, 0, T_OK, "empty bcast"));
    CHECK_OK(rf_comm_barrier(c, T_OK, "barrier"));
}

/* Payload k (of two) from src to dst: 3 ints, then 2 + src bytes of src's letter. */
typedef struct msg {
    int src, dst, k;
    char tail[8];
} msg;

static void sendrecv(rf_comm *c) {
    int rank = rf_comm_rank(c), size = rf_comm_size(c);
    /* all-to-all, two messages per ordered pair (self included), receives posted before sends
     * on even ranks and after on odd ones */
    int n = 4 * size;
    msg *out = calloc((size_t)(2 * size), sizeof *out), *in = calloc((size_t)(2 * size), sizeof *in);
    rf_comm_p2p *ops = calloc((size_t)n, sizeof *ops);
    int k = 0;
    for (int pass = 0; pass < 2; pass++) {
        int sends = (pass == 0) == (rank % 2 == 1);
        for (int p = 0; p < size; p++)
            for (int j = 0; j < 2; j++) {
                msg *m = sends ? &out[2 * p + j] : &in[2 * p + j];
                if (sends) *m = (msg){rank, p, j, "abcdefg"};
                ops[k++] = (rf_comm_p2p){m, sizeof *m, p, sends};
            }
    }
    CHECK_OK(rf_comm_sendrecv(c, ops, n, T_OK, "all-to-all"));
    int bad = 0;
    for (int p = 0; p < size; p++)
        for (int j = 0; j < 2; j++) {
            msg *m = &in[2 * p + j];
            bad += m->src != p || m->dst != rank || m->k != j || strcmp(m->tail, "abcdefg") != 0;
        }
    CHECK(bad == 0);
    free(out), free(in), free(ops);
    /* a ring with sizes that differ per rank: rank r sends r * 100000 + 3 bytes to r + 1 */
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    size_t sb = (size_t)rank * 100000 + 3, rb = (size_t)prev * 100000 + 3;
    unsigned char *s = malloc(sb), *r = malloc(rb);
    for (size_t i = 0; i < sb; i++) s[i] = (unsigned char)(i * 7 + (size_t)rank);
    rf_comm_p2p ring[2] = {{r, rb, prev, 0}, {s, sb, next, 1}};
    CHECK_OK(rf_comm_sendrecv(c, ring, 2, T_OK, "ring"));
    bad = 0;
    for (size_t i = 0; i < rb; i++) bad += r[i] != (unsigned char)(i * 7 + (size_t)prev);
    CHECK(bad == 0);
    free(s), free(r);
    /* two exchanges in flight: one started, a second done whole meanwhile, then the first
     * waited for; each pairs with its own on the peers (posted in the same order) */
    int a_out = 1000 + rank, a_in = -1, b_out = 2000 + rank, b_in = -1;
    rf_comm_p2p first[2] = {{&a_in, sizeof a_in, prev, 0}, {&a_out, sizeof a_out, next, 1}};
    rf_comm_p2p second[2] = {{&b_out, sizeof b_out, prev, 1}, {&b_in, sizeof b_in, next, 0}};
    rf_comm_group *g = NULL;
    CHECK_OK(rf_comm_sendrecv_start(c, first, 2, "first exchange", &g));
    first[0].buf = NULL; /* the array may be reused once started */
    CHECK_OK(rf_comm_sendrecv(c, second, 2, T_OK, "second exchange"));
    CHECK_OK(rf_comm_group_wait(g, T_OK));
    CHECK(a_in == 1000 + prev && b_in == 2000 + next);
    /* zero-byte messages still pair up */
    rf_comm_p2p z[2] = {{NULL, 0, prev, 0}, {NULL, 0, next, 1}};
    CHECK_OK(rf_comm_sendrecv(c, z, 2, T_OK, "empty messages"));
    rf_comm_p2p far = {NULL, 0, size, 1};
    char want[128];
    snprintf(want, sizeof want, "far: peer %d is not a rank of a communicator of %d", size, size);
    CHECK_ERR(rf_comm_sendrecv(c, &far, 1, T_OK, "far"), RF_ERR_ARG, want);
}

/* ---- sub-communicators ---- */

static void subcomms(rf_comm *c) {
    int rank = rf_comm_rank(c), size = rf_comm_size(c);
    rf_comm *par = NULL;
    CHECK_OK(rf_comm_split(c, rank % 2, rank, &par));
    CHECK(par && rf_comm_backend(par) == RF_COMM_MPI);
    if (par) {
        int members = (size + 1 - rank % 2) / 2;
        CHECK(rf_comm_size(par) == members && rf_comm_rank(par) == rank / 2);
        float me = (float)rank, sum = 0, want = 0;
        for (int r = rank % 2; r < size; r += 2) want += (float)r;
        CHECK_OK(rf_comm_allreduce(par, &me, &sum, 1, T_OK, "allreduce over a parity"));
        CHECK(sum == want);
        for (int i = 0; i < members; i++) CHECK(rf_comm_world_rank(par, i) == rank % 2 + 2 * i);
        /* neighbours within the parity */
        int n = rf_comm_size(par), pr = rf_comm_rank(par);
        int got = -1, mine = rank;
        rf_comm_p2p ops[2] = {{&got, sizeof got, (pr + n - 1) % n, 0}, {&mine, sizeof mine, (pr + 1) % n, 1}};
        CHECK_OK(rf_comm_sendrecv(par, ops, 2, T_OK, "ring in a parity"));
        CHECK(got == rf_comm_world_rank(par, (pr + n - 1) % n));
    }
    rf_comm_free(par);
    /* reversed order by key; rank 0 left out */
    rf_comm *rev = NULL;
    CHECK_OK(rf_comm_split(c, rank == 0 ? -1 : 7, -rank, &rev));
    if (rank == 0) {
        CHECK(rev == NULL);
    } else {
        CHECK(rev && rf_comm_size(rev) == size - 1 && rf_comm_rank(rev) == size - 1 - rank);
        if (rev) CHECK(rf_comm_world_rank(rev, 0) == size - 1);
        int v = rank == size - 1 ? 4242 : 0;
        CHECK_OK(rf_comm_bcast(rev, &v, sizeof v, 0, T_OK, "bcast in the reversed communicator"));
        CHECK(v == 4242);
    }
    rf_comm_free(rev);
}

/* ---- timeouts ---- */

/* The other ranks as the message lists them, worked out by hand for 2 and 4 ranks. */
static const char *others(int size, int rank) {
    static const char *two[2] = {"world rank 1", "world rank 0"};
    static const char *four[4] = {"world ranks 1-3", "world ranks 0, 2-3", "world ranks 0-1, 3", "world ranks 0-2"};
    return size == 2 ? two[rank] : size == 4 ? four[rank] : "(a size this test does not know)";
}

/* Runs one collective on a fresh duplicate of world where rank `absent` never takes part; the
 * others must fail within the bound with the exact message, and the communicator must then
 * refuse work at once. */
static void one_timeout(rf_comm *world, int which, const char *what) {
    int rank = rf_comm_rank(world), size = rf_comm_size(world), absent = size - 1;
    rf_comm *d = NULL;
    CHECK_OK(rf_comm_split(world, 0, rank, &d));
    if (!d) return;
    if (rank != absent) {
        float buf[64] = {0}, out[64 * 4];
        double t0 = rf_time_now();
        rf_status st = RF_OK;
        rf_error_clear();
        switch (which) {
        case 0: st = rf_comm_allreduce(d, buf, out, 64, T_SHORT, what); break;
        case 1: st = rf_comm_reduce_scatter(d, out, buf, 16, T_SHORT, what); break;
        case 2: st = rf_comm_allgather(d, buf, out, 64, T_SHORT, what); break;
        case 3: st = rf_comm_bcast(d, buf, sizeof buf, absent, T_SHORT, what); break;
        case 4: st = rf_comm_barrier(d, T_SHORT, what); break;
        }
        double dt = rf_time_now() - t0;
        char want[512];
        snprintf(want, sizeof want, "%s: world rank %d waited %g s for %s (a rank is gone or stuck)", what, rank,
                 T_SHORT, others(size, rank));
        CHECK(st == RF_ERR_IO);
        CHECK(strcmp(rf_error_message(), want) == 0);
        if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), want);
        CHECK(dt >= T_SHORT && dt < T_SHORT + 1.5);
        /* refused at once afterwards */
        t0 = rf_time_now();
        snprintf(want, sizeof want, "later: this communicator failed earlier (%s: world rank %d waited", what, rank);
        CHECK_ERR(rf_comm_barrier(d, 10, "later"), RF_ERR_IO, want);
        CHECK(rf_time_now() - t0 < 0.1);
    }
    rf_comm_free(d);
    CHECK_OK(rf_comm_barrier(world, T_OK, "after a timeout"));
}

/* Send/recv: rank 0 receives from every other rank and sends 1 MB to each; rank 1 never posts
 * anything. Rank 0 must name world rank 1 only; the others complete. */
static void sendrecv_timeout(rf_comm *world) {
    int rank = rf_comm_rank(world), size = rf_comm_size(world);
    rf_comm *d = NULL;
    CHECK_OK(rf_comm_split(world, 0, rank, &d));
    if (!d) return;
    size_t big = 1 << 20;
    char *buf = calloc((size_t)size, big);
    rf_comm_p2p *ops = calloc((size_t)(2 * size), sizeof *ops);
    int n = 0;
    if (rank == 0) {
        for (int p = 1; p < size; p++) {
            ops[n++] = (rf_comm_p2p){buf + (size_t)p * big, 16, p, 0};
            ops[n++] = (rf_comm_p2p){buf, big, p, 1};
        }
    } else if (rank != 1) {
        ops[n++] = (rf_comm_p2p){buf, 16, 0, 1};
        ops[n++] = (rf_comm_p2p){buf + big, big, 0, 0};
    }
    if (rank != 1) {
        double t0 = rf_time_now();
        rf_error_clear();
        rf_status st = rf_comm_sendrecv(d, ops, n, T_SHORT, "weights to the rollout ranks");
        double dt = rf_time_now() - t0;
        if (rank == 0) {
            CHECK(st == RF_ERR_IO);
            char want[256];
            snprintf(want, sizeof want, "weights to the rollout ranks: world rank 0 waited %g s for world rank 1 (a rank is gone or stuck)", T_SHORT);
            CHECK(strcmp(rf_error_message(), want) == 0);
            if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "got  \"%s\"\nwant \"%s\"\n", rf_error_message(), want);
            CHECK(dt >= T_SHORT && dt < T_SHORT + 1.5);
        } else {
            CHECK_OK(st);
        }
    }
    free(buf), free(ops);
    rf_comm_free(d);
    CHECK_OK(rf_comm_barrier(world, T_OK, "after the send/recv timeout"));
}

/* The single transfers used by weights_sync: a round trip and a wait that times out. */
static void single_transfers(rf_comm *c) {
    int rank = rf_comm_rank(c);
    if (rank > 1) return;
    int v = rank == 0 ? 99 : 0;
    rf_comm_req *q = NULL;
    if (rank == 0) CHECK_OK(rf_comm_isend(c, &v, sizeof v, 1, 9, &q));
    else CHECK_OK(rf_comm_irecv(c, &v, sizeof v, 0, 9, &q));
    CHECK_OK(rf_comm_wait(q, T_OK, "round trip"));
    CHECK(v == 99);
    rf_comm_req_free(q);
    if (rank == 1) {
        CHECK_OK(rf_comm_irecv(c, &v, sizeof v, 0, 10, &q));
        CHECK_ERR(rf_comm_wait(q, 0.2, "nothing comes"), RF_ERR_IO, "nothing comes: rank 0 did not complete it within 0.2 s");
        rf_comm_req_free(q);
    }
}

/* Devices for a NCCL communicator (rf__comm_distinct_devices): one each is fine; the same one
 * on every rank (one machine) fails on every rank, naming the first two. */
static void distinct_devices(rf_comm *c) {
    CHECK_OK(rf__comm_distinct_devices(c, rf_comm_rank(c), 10));
    CHECK_ERR(rf__comm_distinct_devices(c, 3, 10), RF_ERR_ARG,
              "a NCCL communicator: world ranks 0 and 1 would both use CUDA device 3 of ");
}

static int under_mpi(int argc, char **argv) {
    rf_comm *world = NULL;
    rf_status st = rf_comm_world(&argc, &argv, &world);
    if (st != RF_OK) {
        fprintf(stderr, "test_comm: %s\n", rf_error_message());
        return 1;
    }
    CHECK(rf_comm_backend(world) == RF_COMM_MPI);
    CHECK(rf_comm_world_rank(world, rf_comm_rank(world)) == rf_comm_rank(world));
    allreduce(world);
    reduce_scatter(world);
    allgather_bcast_barrier(world);
    sendrecv(world);
    subcomms(world);
    single_transfers(world);
    distinct_devices(world);
    one_timeout(world, 0, "allreduce of gradients");
    one_timeout(world, 1, "reduce-scatter of gradients");
    one_timeout(world, 2, "allgather of parameters");
    one_timeout(world, 3, "broadcast of the step");
    one_timeout(world, 4, "barrier before saving");
    sendrecv_timeout(world);
    int rc = rf_test_mpi_finish(world, "test_comm");
    rf_comm_finalize();
    return rc;
}

int main(int argc, char **argv) {
    if (rf_comm_launched_by_mpi()) return under_mpi(argc, argv);
    single_rank();
    if (!rf_test_have_mpirun()) {
        printf("test_comm: MPI part skipped: mpirun not found (apt-get install openmpi-bin)\n");
        return rf_test_failed ? 1 : 77;
    }
    CHECK(rf_test_mpirun_self(2, 120, NULL) == 0);
    CHECK(rf_test_mpirun_self(4, 120, NULL) == 0);
    return rf_test_finish("test_comm");
}
