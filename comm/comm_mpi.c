/* The MPI back end of comm (host memory). */
#include <limits.h>
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/util.h"

struct rf_comm {
    MPI_Comm c;
};

#define PIECE ((size_t)1 << 30) /* bytes per MPI message: counts are ints */
#define MAX_PIECES 64

struct rf_comm_req {
    MPI_Request r[MAX_PIECES];
    int n, peer, done;
};

static rf_comm g_world;
static int g_inited;

int rf_comm_launched_by_mpi(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

static rf_status mpi_fail(int rc, const char *what) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return rf_error(RF_ERR_IO, "%s: MPI error: %.*s", what, len, msg);
}

rf_status rf_comm_init(int *argc, char ***argv, rf_comm **world) {
    if (!g_inited) {
        int provided = 0;
        int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Init_thread");
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        g_world.c = MPI_COMM_WORLD;
        g_inited = 1;
    }
    *world = &g_world;
    return RF_OK;
}

void rf_comm_finalize(void) {
    if (g_inited) MPI_Finalize();
    g_inited = 0;
}

void rf_comm_abort(int code) {
    if (g_inited) MPI_Abort(MPI_COMM_WORLD, code);
}

int rf_comm_rank(const rf_comm *c) {
    int r = 0;
    MPI_Comm_rank(c->c, &r);
    return r;
}

int rf_comm_size(const rf_comm *c) {
    int n = 1;
    MPI_Comm_size(c->c, &n);
    return n;
}

rf_status rf_comm_split(rf_comm *c, int color, int key, rf_comm **out) {
    *out = NULL;
    MPI_Comm nc;
    int rc = MPI_Comm_split(c->c, color < 0 ? MPI_UNDEFINED : color, key, &nc);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_split");
    if (nc == MPI_COMM_NULL) return RF_OK;
    MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN);
    rf_comm *r = malloc(sizeof *r);
    if (!r) {
        MPI_Comm_free(&nc);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    r->c = nc;
    *out = r;
    return RF_OK;
}

void rf_comm_free(rf_comm *c) {
    if (!c || c == &g_world) return;
    MPI_Comm_free(&c->c);
    free(c);
}

/* Tests until done or the deadline; the request is completed or left for the caller to free. */
static rf_status wait_one(MPI_Request *r, double timeout_s, const char *what) {
    double deadline = rf_time_now() + timeout_s;
    for (;;) {
        int flag = 0;
        int rc = MPI_Test(r, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, what);
        if (flag) return RF_OK;
        if (rf_time_now() > deadline)
            return rf_error(RF_ERR_IO, "%s did not complete within %.0f s (a rank is gone or stuck)",
                            what, timeout_s);
        rf_sleep(0.0005);
    }
}

rf_status rf_comm_bcast(rf_comm *c, void *buf, size_t bytes, int root, double timeout_s,
                        const char *what) {
    if (bytes > (size_t)INT_MAX) return rf_error(RF_ERR_ARG, "%s: %zu bytes is too many to broadcast", what, bytes);
    MPI_Request r;
    int rc = MPI_Ibcast(buf, (int)bytes, MPI_BYTE, root, c->c, &r);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, what);
    rf_status st = wait_one(&r, timeout_s, what);
    if (st != RF_OK) MPI_Request_free(&r);
    return st;
}

rf_status rf_comm_allgather(rf_comm *c, const void *in, void *out, size_t bytes,
                            double timeout_s, const char *what) {
    if (bytes > (size_t)INT_MAX) return rf_error(RF_ERR_ARG, "%s: %zu bytes is too many to gather", what, bytes);
    MPI_Request r;
    int rc = MPI_Iallgather(in, (int)bytes, MPI_BYTE, out, (int)bytes, MPI_BYTE, c->c, &r);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, what);
    rf_status st = wait_one(&r, timeout_s, what);
    if (st != RF_OK) MPI_Request_free(&r);
    return st;
}

static rf_status start(rf_comm *c, void *buf, size_t bytes, int peer, int tag, int send,
                       rf_comm_req **out) {
    *out = NULL;
    size_t pieces = bytes ? (bytes + PIECE - 1) / PIECE : 1;
    if (pieces > MAX_PIECES) return rf_error(RF_ERR_ARG, "%zu bytes is too many for one transfer", bytes);
    rf_comm_req *q = calloc(1, sizeof *q);
    if (!q) return rf_error(RF_ERR_NOMEM, "out of memory");
    q->peer = peer;
    for (size_t i = 0; i < pieces; i++) {
        size_t off = i * PIECE, len = bytes - off < PIECE ? bytes - off : PIECE;
        int rc = send ? MPI_Isend((char *)buf + off, (int)len, MPI_BYTE, peer, tag, c->c, &q->r[i])
                      : MPI_Irecv((char *)buf + off, (int)len, MPI_BYTE, peer, tag, c->c, &q->r[i]);
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
    int flag = 0;
    int rc = MPI_Iprobe(peer, tag, c->c, &flag, MPI_STATUS_IGNORE);
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
    for (;;) {
        int t = rf_comm_test(q);
        if (t < 0) return rf_error_wrap(RF_ERR_IO, "%s (rank %d)", what, q->peer);
        if (t) return RF_OK;
        if (rf_time_now() > deadline)
            return rf_error(RF_ERR_IO, "%s: rank %d did not complete it within %.0f s", what,
                            q->peer, timeout_s);
        rf_sleep(0.0002);
    }
}

void rf_comm_req_free(rf_comm_req *q) {
    if (!q) return;
    for (int i = 0; !q->done && i < q->n; i++) {
        if (q->r[i] == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&q->r[i]);
        MPI_Request_free(&q->r[i]);
    }
    free(q);
}
