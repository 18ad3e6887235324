/* The MPI back end of comm (host memory): every operation is a non-blocking MPI call tested in a
 * loop against its deadline. Transfers larger than MPI's int counts are split into pieces that
 * every rank posts in the same order. */
#include <limits.h>
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_internal.h"
#include "common/util.h"

#define PIECE ((size_t)1 << 30) /* bytes per MPI message: counts are ints */
#define MAX_PIECES 64
#define TAG_SENDRECV 32001      /* rf_comm_sendrecv's messages (MPI guarantees tags to 32767) */

typedef struct mpi_state {
    MPI_Comm c;
    /* requests of collectives that timed out: MPI forbids cancelling or freeing them, so they
     * stay here (never completed) until the communicator is freed */
    MPI_Request *abandoned;
    int n_abandoned;
} mpi_state;

struct rf_comm_req {
    MPI_Request r[MAX_PIECES];
    int n, peer, done;
};

static const rf_comm_ops mpi_ops;
static rf_comm g_world;
static mpi_state g_world_state;
static int g_inited;

static MPI_Comm mc(const rf_comm *c) { return ((const mpi_state *)c->impl)->c; }

int rf_comm_launched_by_mpi(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

static rf_status mpi_fail(int rc, const char *what) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return rf_error(RF_ERR_IO, "%s: MPI error: %.*s", what, len, msg);
}

/* Fills c->world from MPI's groups. */
static rf_status map_world(rf_comm *c) {
    MPI_Group g, wg;
    MPI_Comm_group(mc(c), &g);
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    int *ranks = malloc(sizeof(int) * (size_t)c->size);
    if (!ranks) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < c->size; i++) ranks[i] = i;
    int rc = MPI_Group_translate_ranks(g, c->size, ranks, wg, c->world);
    free(ranks);
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
    return rc == MPI_SUCCESS ? RF_OK : mpi_fail(rc, "MPI_Group_translate_ranks");
}

rf_status rf_comm_init(int *argc, char ***argv, rf_comm **world) { return rf_comm_init_threads(argc, argv, 0, world); }

rf_status rf_comm_init_threads(int *argc, char ***argv, int multiple, rf_comm **world) {
    if (!g_inited) {
        int provided = 0, rank = 0, size = 1;
        int rc = MPI_Init_thread(argc, argv, multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Init_thread");
        if (multiple && provided < MPI_THREAD_MULTIPLE)
            return rf_error(RF_ERR_UNSUPPORTED, "MPI_Init_thread: this MPI library does not provide MPI_THREAD_MULTIPLE "
                            "(provided level %d), which a colocated run with placement.rollout.tp > 1 needs", provided);
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        int *w = malloc(sizeof(int) * (size_t)size);
        if (!w) return rf_error(RF_ERR_NOMEM, "out of memory");
        for (int i = 0; i < size; i++) w[i] = i;
        g_world_state = (mpi_state){.c = MPI_COMM_WORLD};
        g_world = (rf_comm){.ops = &mpi_ops, .kind = RF_COMM_MPI, .rank = rank, .size = size,
                            .world = w, .owned_by_lib = 1, .impl = &g_world_state};
        g_inited = 1;
    }
    *world = &g_world;
    return RF_OK;
}

void rf_comm_finalize(void) {
    if (!g_inited) return;
    MPI_Finalize();
    free(g_world.world);
    free(g_world_state.abandoned);
    g_world.world = NULL;
    g_world_state.abandoned = NULL;
    g_inited = 0;
}

void rf_comm_abort(int code) {
    if (g_inited) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

/* ---- waiting ---- */

/* Tests requests r (n) until every one is complete: 1 done, 0 the deadline passed (requests
 * left as they are), -1 an MPI error (message set). */
static int wait_all(MPI_Request *r, int n, double timeout_s, const char *what) {
    double deadline = rf_time_now() + timeout_s;
    int polls = 0;
    for (;;) {
        int flag = 0;
        int rc = MPI_Testall(n, r, &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) {
            mpi_fail(rc, what);
            return -1;
        }
        if (flag) return 1;
        if (rf_time_now() > deadline) return 0;
        rf__comm_backoff(&polls);
    }
}

/* Keeps the requests of a collective that timed out (see mpi_state). */
static void abandon(rf_comm *c, const MPI_Request *r, int n) {
    mpi_state *s = c->impl;
    MPI_Request *a = realloc(s->abandoned, sizeof *a * (size_t)(s->n_abandoned + n));
    if (!a) return; /* leaked: the communicator is unusable anyway */
    memcpy(a + s->n_abandoned, r, sizeof *a * (size_t)n);
    s->abandoned = a;
    s->n_abandoned += n;
}

/* Waits for the requests of one collective; on timeout names every other rank. */
static rf_status finish_collective(rf_comm *c, MPI_Request *r, int n, double timeout_s, const char *what) {
    int t = wait_all(r, n, timeout_s, what);
    if (t == 1) return RF_OK;
    if (t < 0) {
        rf__comm_mark_failed(c);
        return RF_ERR_IO;
    }
    abandon(c, r, n);
    return rf__comm_timeout_all(c, timeout_s, what);
}

/* p + off bytes; NULL stays NULL (an operation of 0 bytes may come with a NULL buffer, and
 * offsetting NULL is undefined in C). */
static void *at(const void *p, size_t off) { return p ? (char *)p + off : NULL; }

/* ---- collectives ---- */

static rf_status mpi_allreduce(rf_comm *c, const float *in, float *out, size_t n, double timeout_s,
                               const char *what) {
    size_t per = PIECE / sizeof(float), pieces = n ? (n + per - 1) / per : 1;
    if (pieces > MAX_PIECES) return rf_error(RF_ERR_ARG, "%s: %zu floats is too many for one allreduce", what, n);
    MPI_Request r[MAX_PIECES];
    for (size_t i = 0; i < pieces; i++) {
        size_t off = i * per, len = n - off < per ? n - off : per;
        int rc = MPI_Iallreduce(in == out ? MPI_IN_PLACE : at(in, off * sizeof(float)),
                                at(out, off * sizeof(float)), (int)len, MPI_FLOAT, MPI_SUM, mc(c), &r[i]);
        if (rc != MPI_SUCCESS) {
            abandon(c, r, (int)i);
            mpi_fail(rc, what);
            rf__comm_mark_failed(c);
            return RF_ERR_IO;
        }
    }
    return finish_collective(c, r, (int)pieces, timeout_s, what);
}

static rf_status mpi_reduce_scatter(rf_comm *c, const float *in, float *out, size_t n, double timeout_s,
                                    const char *what) {
    if (n > (size_t)INT_MAX) return rf_error(RF_ERR_ARG, "%s: %zu floats per rank is too many to reduce-scatter", what, n);
    MPI_Request r;
    int rc = MPI_Ireduce_scatter_block(in, out, (int)n, MPI_FLOAT, MPI_SUM, mc(c), &r);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, what);
    return finish_collective(c, &r, 1, timeout_s, what);
}

static rf_status mpi_allgather(rf_comm *c, const void *in, void *out, size_t bytes, double timeout_s,
                               const char *what) {
    if (bytes > (size_t)INT_MAX) return rf_error(RF_ERR_ARG, "%s: %zu bytes is too many to gather", what, bytes);
    MPI_Request r;
    int rc = MPI_Iallgather(in, (int)bytes, MPI_BYTE, out, (int)bytes, MPI_BYTE, mc(c), &r);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, what);
    return finish_collective(c, &r, 1, timeout_s, what);
}

static rf_status mpi_bcast(rf_comm *c, void *buf, size_t bytes, int root, double timeout_s, const char *what) {
    size_t pieces = bytes ? (bytes + PIECE - 1) / PIECE : 1;
    if (pieces > MAX_PIECES) return rf_error(RF_ERR_ARG, "%s: %zu bytes is too many to broadcast", what, bytes);
    MPI_Request r[MAX_PIECES];
    for (size_t i = 0; i < pieces; i++) {
        size_t off = i * PIECE, len = bytes - off < PIECE ? bytes - off : PIECE;
        int rc = MPI_Ibcast(at(buf, off), (int)len, MPI_BYTE, root, mc(c), &r[i]);
        if (rc != MPI_SUCCESS) {
            abandon(c, r, (int)i);
            mpi_fail(rc, what);
            rf__comm_mark_failed(c);
            return RF_ERR_IO;
        }
    }
    return finish_collective(c, r, (int)pieces, timeout_s, what);
}

static rf_status mpi_barrier(rf_comm *c, double timeout_s, const char *what) {
    MPI_Request r;
    int rc = MPI_Ibarrier(mc(c), &r);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, what);
    return finish_collective(c, &r, 1, timeout_s, what);
}

/* ---- grouped send / receive ---- */

/* Cancels and frees the requests still active (after a timeout or an error). */
static void drop_pending(MPI_Request *r, int n) {
    for (int i = 0; i < n; i++) {
        if (r[i] == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&r[i]);
        MPI_Request_free(&r[i]);
    }
}

/* A started group's requests: owner[i] is the op request i belongs to. */
typedef struct mpi_group {
    MPI_Request *r;
    int *owner;
    int nr;
    int collective; /* a started collective: its requests cannot be cancelled (abandon them) */
} mpi_group;

static void group_release(mpi_group *q) {
    if (!q) return;
    free(q->r), free(q->owner), free(q);
}

/* After a timeout: the peers of the ops with a request not yet complete. */
static rf_status sendrecv_timeout(rf_comm_group *g, mpi_group *q, double timeout_s) {
    int *late = malloc(sizeof(int) * (size_t)q->nr), n = 0;
    if (!late) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < q->nr; i++) {
        int flag = 1;
        if (q->r[i] != MPI_REQUEST_NULL) MPI_Test(&q->r[i], &flag, MPI_STATUS_IGNORE);
        if (!flag) late[n++] = g->peer[q->owner[i]];
    }
    rf_status st = rf__comm_timeout(g->c, late, n, timeout_s, g->what);
    free(late);
    return st;
}

static rf_status mpi_sendrecv_start(rf_comm *c, const rf_comm_p2p *ops, int n, rf_comm_group *g) {
    int nr = 0;
    for (int i = 0; i < n; i++) nr += ops[i].bytes ? (int)((ops[i].bytes + PIECE - 1) / PIECE) : 1;
    mpi_group *q = calloc(1, sizeof *q);
    if (q) q->r = malloc(sizeof *q->r * (size_t)nr), q->owner = malloc(sizeof *q->owner * (size_t)nr);
    if (!q || !q->r || !q->owner) {
        group_release(q);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory for %d requests", g->what, nr);
    }
    for (int i = 0; i < n; i++) {
        size_t bytes = ops[i].bytes;
        for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += PIECE) {
            size_t len = bytes - off < PIECE ? bytes - off : PIECE;
            void *p = at(ops[i].buf, off);
            int rc = ops[i].send ? MPI_Isend(p, (int)len, MPI_BYTE, ops[i].peer, TAG_SENDRECV, mc(c), &q->r[q->nr])
                                 : MPI_Irecv(p, (int)len, MPI_BYTE, ops[i].peer, TAG_SENDRECV, mc(c), &q->r[q->nr]);
            if (rc != MPI_SUCCESS) {
                rf_status st = mpi_fail(rc, g->what);
                drop_pending(q->r, q->nr);
                group_release(q);
                rf__comm_mark_failed(c);
                return st;
            }
            q->owner[q->nr++] = i;
            if (bytes == 0) break;
        }
    }
    g->impl = q;
    return RF_OK;
}

static rf_status mpi_group_wait(rf_comm_group *g, double timeout_s) {
    mpi_group *q = g->impl;
    if (q->collective) {
        rf_status st = finish_collective(g->c, q->r, q->nr, timeout_s, g->what);
        group_release(q);
        g->impl = NULL;
        return st;
    }
    rf_status st = RF_OK;
    int t = wait_all(q->r, q->nr, timeout_s, g->what);
    if (t < 0) st = RF_ERR_IO;
    else if (t == 0) st = sendrecv_timeout(g, q, timeout_s);
    if (st != RF_OK) {
        drop_pending(q->r, q->nr);
        rf__comm_mark_failed(g->c);
    }
    group_release(q);
    g->impl = NULL;
    return st;
}

/* ---- communicators ---- */

static rf_status mpi_split(rf_comm *c, int color, int key, rf_comm **out) {
    MPI_Comm nc;
    int rc = MPI_Comm_split(mc(c), color < 0 ? MPI_UNDEFINED : color, key, &nc);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_split");
    if (nc == MPI_COMM_NULL) return RF_OK;
    MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(nc, &rank);
    MPI_Comm_size(nc, &size);
    mpi_state *s = calloc(1, sizeof *s);
    rf_comm *r = s ? rf__comm_new(&mpi_ops, RF_COMM_MPI, rank, size) : NULL;
    if (!r) {
        free(s);
        MPI_Comm_free(&nc);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    s->c = nc;
    r->impl = s;
    rf_status st = map_world(r);
    if (st != RF_OK) {
        r->ops->free(r);
        return st;
    }
    *out = r;
    return RF_OK;
}

static void mpi_free(rf_comm *c) {
    mpi_state *s = c->impl;
    /* pending operations (abandoned ones included) do not stop MPI_Comm_free: the communicator
     * goes once they are done */
    if (s->c != MPI_COMM_NULL) MPI_Comm_free(&s->c);
    free(s->abandoned);
    free(s);
    rf__comm_delete(c);
}

/* ---- non-blocking collectives ---- */

/* A collective's group state for n requests (not yet posted). */
static mpi_group *collective_requests(int n, const char *what) {
    mpi_group *q = calloc(1, sizeof *q);
    if (q) q->r = malloc(sizeof *q->r * (size_t)n);
    if (!q || !q->r) {
        group_release(q);
        rf_error(RF_ERR_NOMEM, "%s: out of memory", what);
        return NULL;
    }
    q->collective = 1;
    return q;
}

/* After a failed post: what was posted is abandoned and c fails. */
static rf_status post_failed(rf_comm *c, mpi_group *q, int rc, const char *what) {
    rf_status st = mpi_fail(rc, what);
    abandon(c, q->r, q->nr);
    group_release(q);
    rf__comm_mark_failed(c);
    return st;
}

static rf_status mpi_allreduce_start(rf_comm *c, const float *in, float *out, size_t n, rf_comm_group *g) {
    size_t per = PIECE / sizeof(float), pieces = n ? (n + per - 1) / per : 1;
    if (pieces > MAX_PIECES) return rf_error(RF_ERR_ARG, "%s: %zu floats is too many for one allreduce", g->what, n);
    mpi_group *q = collective_requests((int)pieces, g->what);
    if (!q) return RF_ERR_NOMEM;
    for (size_t i = 0; i < pieces; i++, q->nr++) {
        size_t off = i * per, len = n - off < per ? n - off : per;
        int rc = MPI_Iallreduce(in == out ? MPI_IN_PLACE : (const void *)(in + off), out + off, (int)len,
                                MPI_FLOAT, MPI_SUM, mc(c), &q->r[i]);
        if (rc != MPI_SUCCESS) return post_failed(c, q, rc, g->what);
    }
    g->impl = q;
    return RF_OK;
}

static rf_status mpi_reduce_scatter_start(rf_comm *c, const float *in, float *out, size_t n, rf_comm_group *g) {
    if (n > (size_t)INT_MAX) return rf_error(RF_ERR_ARG, "%s: %zu floats per rank is too many to reduce-scatter", g->what, n);
    mpi_group *q = collective_requests(1, g->what);
    if (!q) return RF_ERR_NOMEM;
    int rc = MPI_Ireduce_scatter_block(in, out, (int)n, MPI_FLOAT, MPI_SUM, mc(c), &q->r[0]);
    if (rc != MPI_SUCCESS) return post_failed(c, q, rc, g->what);
    q->nr = 1;
    g->impl = q;
    return RF_OK;
}

static int mpi_group_test(rf_comm_group *g) {
    mpi_group *q = g->impl;
    if (!q) return 1;
    int flag = 0;
    int rc = MPI_Testall(q->nr, q->r, &flag, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
        mpi_fail(rc, g->what);
        rf__comm_mark_failed(g->c);
        return -1;
    }
    return flag;
}

static const rf_comm_ops mpi_ops = {
    "mpi", mpi_allreduce, mpi_reduce_scatter, mpi_allgather, mpi_bcast,
    mpi_barrier, mpi_sendrecv_start, mpi_group_wait, mpi_split, mpi_free,
    mpi_allreduce_start, mpi_reduce_scatter_start, mpi_group_test,
    NULL, /* host: host memory already */
};

/* ---- single transfers ---- */

static rf_status start(rf_comm *c, void *buf, size_t bytes, int peer, int tag, int send,
                       rf_comm_req **out) {
    *out = NULL;
    if (c->kind != RF_COMM_MPI)
        return rf_error(RF_ERR_UNSUPPORTED, "single transfers need the MPI back end of comm, not %s", c->ops->name);
    size_t pieces = bytes ? (bytes + PIECE - 1) / PIECE : 1;
    if (pieces > MAX_PIECES) return rf_error(RF_ERR_ARG, "%zu bytes is too many for one transfer", bytes);
    rf_comm_req *q = calloc(1, sizeof *q);
    if (!q) return rf_error(RF_ERR_NOMEM, "out of memory");
    q->peer = peer;
    for (size_t i = 0; i < pieces; i++) {
        size_t off = i * PIECE, len = bytes - off < PIECE ? bytes - off : PIECE;
        int rc = send ? MPI_Isend((char *)buf + off, (int)len, MPI_BYTE, peer, tag, mc(c), &q->r[i])
                      : MPI_Irecv((char *)buf + off, (int)len, MPI_BYTE, peer, tag, mc(c), &q->r[i]);
        if (rc != MPI_SUCCESS) {
            q->n = (int)i;
            rf_comm_req_free(q);
            return mpi_fail(rc, send ? "MPI_Isend" : "MPI_Irecv");
        }
    }
    q->n = (int)pieces;
    *out = q;
    return RF_OK;
}

rf_status rf_comm_isend(rf_comm *c, const void *buf, size_t bytes, int peer, int tag,
                        rf_comm_req **req) {
    return start(c, (void *)buf, bytes, peer, tag, 1, req);
}

rf_status rf_comm_irecv(rf_comm *c, void *buf, size_t bytes, int peer, int tag,
                        rf_comm_req **req) {
    return start(c, buf, bytes, peer, tag, 0, req);
}

int rf_comm_iprobe(rf_comm *c, int peer, int tag) {
    if (c->kind != RF_COMM_MPI) {
        rf_error(RF_ERR_UNSUPPORTED, "probing needs the MPI back end of comm, not %s", c->ops->name);
        return -1;
    }
    int flag = 0;
    int rc = MPI_Iprobe(peer, tag, mc(c), &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
        mpi_fail(rc, "MPI_Iprobe");
        return -1;
    }
    return flag;
}

int rf_comm_test(rf_comm_req *q) {
    if (q->done) return 1;
    int flag = 0;
    int rc = MPI_Testall(q->n, q->r, &flag, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
        mpi_fail(rc, "transfer");
        return -1;
    }
    q->done = flag;
    return flag;
}

rf_status rf_comm_wait(rf_comm_req *q, double timeout_s, const char *what) {
    double deadline = rf_time_now() + timeout_s;
    int polls = 0;
    for (;;) {
        int t = rf_comm_test(q);
        if (t < 0) return rf_error_wrap(RF_ERR_IO, "%s (rank %d)", what, q->peer);
        if (t) return RF_OK;
        if (rf_time_now() > deadline)
            return rf_error(RF_ERR_IO, "%s: rank %d did not complete it within %g s", what,
                            q->peer, timeout_s);
        rf__comm_backoff(&polls);
    }
}

void rf_comm_req_free(rf_comm_req *q) {
    if (!q) return;
    if (!q->done) drop_pending(q->r, q->n);
    free(q);
}
