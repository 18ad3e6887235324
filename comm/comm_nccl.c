/* The NCCL back end of comm (CUDA device memory). Built only when CMake finds CUDA and NCCL
 * (RLFLOW_HAVE_NCCL); it has run on one H200 in communicators of one rank, never across
 * several GPUs (docs/architecture.md).
 *
 * Bootstrap as in nccl-tests: rank 0 makes the unique id and broadcasts it over the MPI (or
 * single) communicator the NCCL one is made from. Communicators are non-blocking
 * (ncclConfig_t.blocking = 0, NCCL >= 2.14): initialisation and ncclGroupEnd may return
 * ncclInProgress, and ncclCommGetAsyncError reports when they are done or failed. Each
 * operation is enqueued on the communicator's stream and then polled (ncclCommGetAsyncError,
 * cudaStreamQuery) until its deadline; on timeout or an asynchronous error the communicator is
 * aborted (ncclCommAbort), which is NCCL's documented way out of a collective that will never
 * complete (NCCL user guide, "Error handling and communicator abort"). */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_internal.h"
#include "kernels/cuda_module.h"
#include "kernels/kernels.h"
#include "common/util.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "comm's NCCL back end needs NCCL 2.14 or later (non-blocking communicators)"
#endif

typedef struct nccl_state {
    ncclComm_t nc;       /* NULL once aborted */
    cudaStream_t stream;
    int device;
    rf_comm *boot;       /* (owned) duplicate of the MPI / single communicator: splits */
    float *scratch;      /* (1) device: barriers are an allreduce of one float */
    cudaEvent_t queued;  /* marks the kernels' stream: each operation waits for it (after_kernels) */
    double timeout_s;    /* bounds bootstrapping splits */
} nccl_state;

static const rf_comm_ops nccl_ops;

static nccl_state *st_of(rf_comm *c) { return c->impl; }

/* Orders what is enqueued next on the communicator's stream after everything already queued on
 * the CUDA back end's stream (kernels.h: rf_cuda_stream), on the device: an operation reads
 * what the kernels before it wrote without the caller synchronising, and kernels queued after
 * the call run on alongside it (the overlap of gradient buckets with backward). Nothing when
 * the back end has not started (buffers written by plain CUDA calls, as in comm's tests). */
/* The CUDA back end's bf16 weight copies (kernels/cuda/cuda_matmul.cu) of memory a collective
 * is about to overwrite are stale from now on: parameters gathered by ZeRO-1, broadcast to
 * replicas, received by a rollout worker. */
void rf__cuda_bf16_invalidate(const void *p, size_t bytes);

static void after_kernels(rf_comm *c) {
    nccl_state *s = st_of(c);
    cudaStream_t ks = (cudaStream_t)rf_cuda_stream();
    if (!ks || ks == s->stream) return;
    if (cudaEventRecord(s->queued, ks) == cudaSuccess) cudaStreamWaitEvent(s->stream, s->queued, 0);
}

/* Aborts the NCCL communicator (once) and marks c failed with the current message. */
static rf_status give_up(rf_comm *c, rf_status code) {
    nccl_state *s = st_of(c);
    if (s->nc) ncclCommAbort(s->nc);
    s->nc = NULL;
    rf__comm_mark_failed(c);
    return code;
}

static rf_status nccl_error(rf_comm *c, ncclResult_t r, const char *what) {
    nccl_state *s = st_of(c);
    rf_error(RF_ERR_IO, "%s: NCCL error on world rank %d: %s (%s)", what, c->world[c->rank],
             ncclGetErrorString(r), s->nc ? ncclGetLastError(s->nc) : "");
    return give_up(c, RF_ERR_IO);
}

/* 1 when the communicator has nothing in progress, 0 while it has, -1 on an error (c given
 * up, message set). */
static int comm_state(rf_comm *c, const char *what) {
    ncclResult_t a = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(st_of(c)->nc, &a);
    if (r != ncclSuccess) a = r;
    if (a == ncclSuccess) return 1;
    if (a == ncclInProgress) return 0;
    nccl_error(c, a, what);
    return -1;
}

/* Waits for what was just enqueued (`launched` is what the call or ncclGroupEnd returned):
 * first until NCCL has handed it to the stream, then until the stream is done. On timeout:
 * the error names `peers` (n of them; NULL = every other rank). */
static rf_status finish(rf_comm *c, ncclResult_t launched, const int *peers, int n, double timeout_s,
                        const char *what) {
    nccl_state *s = st_of(c);
    if (!s->nc) return rf_error(RF_ERR_IO, "%s: this communicator failed earlier (%s)", what, c->failed);
    if (launched != ncclSuccess && launched != ncclInProgress) return nccl_error(c, launched, what);
    double deadline = rf_time_now() + timeout_s;
    int polls = 0;
    for (;;) {
        int ready = comm_state(c, what);
        if (ready < 0) return RF_ERR_IO;
        if (ready) {
            cudaError_t e = cudaStreamQuery(s->stream);
            if (e == cudaSuccess) return RF_OK;
            if (e != cudaErrorNotReady) {
                rf_error(RF_ERR_IO, "%s: CUDA error on world rank %d: %s", what, c->world[c->rank],
                         cudaGetErrorString(e));
                return give_up(c, RF_ERR_IO);
            }
        }
        if (rf_time_now() > deadline) {
            rf_status st = peers ? rf__comm_timeout(c, peers, n, timeout_s, what) : rf__comm_timeout_all(c, timeout_s, what);
            return give_up(c, st);
        }
        rf__comm_backoff(&polls);
    }
}

/* ---- collectives ---- */

static rf_status nccl_allreduce(rf_comm *c, const float *in, float *out, size_t n, double timeout_s,
                                const char *what) {
    nccl_state *s = st_of(c);
    after_kernels(c);
    rf_status st = finish(c, ncclAllReduce(in, out, n, ncclFloat32, ncclSum, s->nc, s->stream), NULL, 0, timeout_s, what);
    rf__cuda_bf16_invalidate(out, sizeof(float) * n); /* once written (rf_cuda_to_device) */
    return st;
}

static rf_status nccl_reduce_scatter(rf_comm *c, const float *in, float *out, size_t n, double timeout_s,
                                     const char *what) {
    nccl_state *s = st_of(c);
    after_kernels(c);
    rf_status st = finish(c, ncclReduceScatter(in, out, n, ncclFloat32, ncclSum, s->nc, s->stream), NULL, 0, timeout_s, what);
    rf__cuda_bf16_invalidate(out, sizeof(float) * n);
    return st;
}

static rf_status nccl_allgather(rf_comm *c, const void *in, void *out, size_t bytes, double timeout_s,
                                const char *what) {
    nccl_state *s = st_of(c);
    after_kernels(c);
    rf_status st = finish(c, ncclAllGather(in, out, bytes, ncclUint8, s->nc, s->stream), NULL, 0, timeout_s, what);
    rf__cuda_bf16_invalidate(out, bytes * (size_t)c->size);
    return st;
}

static rf_status nccl_bcast(rf_comm *c, void *buf, size_t bytes, int root, double timeout_s, const char *what) {
    nccl_state *s = st_of(c);
    after_kernels(c);
    rf_status st = finish(c, ncclBroadcast(buf, buf, bytes, ncclUint8, root, s->nc, s->stream), NULL, 0, timeout_s, what);
    rf__cuda_bf16_invalidate(buf, bytes);
    return st;
}

static rf_status nccl_barrier(rf_comm *c, double timeout_s, const char *what) {
    nccl_state *s = st_of(c);
    return finish(c, ncclAllReduce(s->scratch, s->scratch, 1, ncclFloat32, ncclSum, s->nc, s->stream), NULL, 0,
                  timeout_s, what);
}

/* The group is enqueued at the start; what ncclGroupEnd said is kept for the wait. */
static rf_status nccl_sendrecv_start(rf_comm *c, const rf_comm_p2p *ops, int n, rf_comm_group *g) {
    nccl_state *s = st_of(c);
    ncclResult_t *launched = malloc(sizeof *launched);
    if (!launched) return rf_error(RF_ERR_NOMEM, "out of memory");
    after_kernels(c);
    /* marked stale when enqueued: the wait does not know the buffers. A bf16 copy another
     * thread makes before the receive completes would stay marked valid; receivers call
     * weights_updated after the weights arrive (rollout/worker.c), which covers it. */
    for (int i = 0; i < n; i++)
        if (!ops[i].send) rf__cuda_bf16_invalidate(ops[i].buf, ops[i].bytes);
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); i++)
        r = ops[i].send ? ncclSend(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, s->nc, s->stream)
                        : ncclRecv(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, s->nc, s->stream);
    ncclResult_t e = ncclGroupEnd();
    *launched = r == ncclSuccess || r == ncclInProgress ? e : r;
    g->impl = launched;
    return RF_OK;
}

static rf_status nccl_group_wait(rf_comm_group *g, double timeout_s) {
    ncclResult_t launched = *(ncclResult_t *)g->impl;
    free(g->impl);
    g->impl = NULL;
    return finish(g->c, launched, g->peer, g->n, timeout_s, g->what);
}

/* ---- started collectives: enqueued on the stream and left to run; the wait is finish()'s ---- */

/* Keeps what the enqueueing call said for the wait. A non-blocking communicator may answer
 * ncclInProgress before the operation is on the stream: that is waited out here (bounded by
 * the communicator's own timeout), so that the next NCCL call finds the communicator free. */
static rf_status keep_started(rf_comm_group *g, ncclResult_t launched) {
    rf_comm *c = g->c;
    nccl_state *s = st_of(c);
    if (launched == ncclInProgress) {
        double deadline = rf_time_now() + s->timeout_s;
        int polls = 0, ready;
        while ((ready = comm_state(c, g->what)) == 0 && rf_time_now() < deadline) rf__comm_backoff(&polls);
        if (ready < 0) return RF_ERR_IO;
        launched = ready ? ncclSuccess : ncclInProgress; /* still in progress: the wait times out */
    }
    ncclResult_t *kept = malloc(sizeof *kept);
    if (!kept) return rf_error(RF_ERR_NOMEM, "out of memory");
    *kept = launched;
    g->impl = kept;
    return RF_OK;
}

static rf_status nccl_allreduce_start(rf_comm *c, const float *in, float *out, size_t n, rf_comm_group *g) {
    nccl_state *s = st_of(c);
    after_kernels(c);
    rf__cuda_bf16_invalidate(out, sizeof(float) * n);
    return keep_started(g, ncclAllReduce(in, out, n, ncclFloat32, ncclSum, s->nc, s->stream));
}

static rf_status nccl_reduce_scatter_start(rf_comm *c, const float *in, float *out, size_t n, rf_comm_group *g) {
    nccl_state *s = st_of(c);
    after_kernels(c);
    rf__cuda_bf16_invalidate(out, sizeof(float) * n);
    return keep_started(g, ncclReduceScatter(in, out, n, ncclFloat32, ncclSum, s->nc, s->stream));
}

/* 1 when the stream has run everything enqueued so far (this operation and those before it),
 * 0 not yet, -1 on an error (the communicator given up, message set). */
static int nccl_group_test(rf_comm_group *g) {
    rf_comm *c = g->c;
    ncclResult_t launched = g->impl ? *(ncclResult_t *)g->impl : ncclSuccess;
    if (launched != ncclSuccess && launched != ncclInProgress) {
        nccl_error(c, launched, g->what);
        return -1;
    }
    int ready = comm_state(c, g->what);
    if (ready <= 0) return ready;
    cudaError_t e = cudaStreamQuery(st_of(c)->stream);
    if (e == cudaSuccess) return 1;
    if (e == cudaErrorNotReady) return 0;
    rf_error(RF_ERR_IO, "%s: CUDA error on world rank %d: %s", g->what, c->world[c->rank], cudaGetErrorString(e));
    give_up(c, RF_ERR_IO);
    return -1;
}

/* ---- communicators ---- */

static void nccl_free(rf_comm *c) {
    nccl_state *s = st_of(c);
    if (s->nc) {
        /* finalize flushes and, non-blocking, reports completion through the async error; a
         * communicator that does not quiesce in time is aborted instead */
        ncclResult_t r = ncclCommFinalize(s->nc);
        double deadline = rf_time_now() + s->timeout_s;
        int polls = 0, ready = 0;
        while (r == ncclSuccess || r == ncclInProgress) {
            ncclResult_t a = ncclSuccess;
            r = ncclCommGetAsyncError(s->nc, &a);
            if (r == ncclSuccess && a == ncclSuccess) {
                ready = 1;
                break;
            }
            if (a != ncclInProgress || rf_time_now() > deadline) break;
            rf__comm_backoff(&polls);
        }
        if (ready) ncclCommDestroy(s->nc);
        else ncclCommAbort(s->nc);
    }
    if (s->scratch) cudaFree(s->scratch);
    if (s->queued) cudaEventDestroy(s->queued);
    if (s->stream) cudaStreamDestroy(s->stream);
    rf_comm_free(s->boot);
    free(s);
    rf__comm_delete(c);
}

/* The unique id with rank 0's verdict, so that a failure there stops every rank. */
typedef struct boot_msg {
    int ok;
    ncclUniqueId id;
} boot_msg;

/* Makes the NCCL communicator over boot's ranks (boot becomes its own). */
static rf_status nccl_make(rf_comm *boot, int device, double timeout_s, rf_comm **out) {
    *out = NULL;
    const char *what = "creating a NCCL communicator";
    boot_msg m = {0};
    if (boot->rank == 0) m.ok = ncclGetUniqueId(&m.id) == ncclSuccess;
    RF_TRY(rf_comm_bcast(boot, &m, sizeof m, 0, timeout_s, "sharing the NCCL unique id"));
    if (!m.ok) return rf_error(RF_ERR_IO, "%s: rank 0 could not make a NCCL unique id", what);
    nccl_state *s = calloc(1, sizeof *s);
    rf_comm *c = s ? rf__comm_new(&nccl_ops, RF_COMM_NCCL, boot->rank, boot->size) : NULL;
    if (!c) {
        free(s);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    for (int r = 0; r < boot->size; r++) c->world[r] = rf_comm_world_rank(boot, r);
    s->device = device, s->boot = boot, s->timeout_s = timeout_s;
    c->impl = s;
    cudaError_t ce = cudaSetDevice(device);
    if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
    if (ce == cudaSuccess) ce = cudaMalloc((void **)&s->scratch, sizeof(float));
    if (ce == cudaSuccess) ce = cudaEventCreateWithFlags(&s->queued, cudaEventDisableTiming);
    if (ce != cudaSuccess) {
        s->boot = NULL; /* stays the caller's on failure */
        nccl_free(c);
        return rf_error(RF_ERR_CUDA, "%s on device %d: %s", what, device, cudaGetErrorString(ce));
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    rf_status st = finish(c, ncclCommInitRankConfig(&s->nc, boot->size, m.id, boot->rank, &cfg), NULL, 0,
                          timeout_s, what);
    if (st != RF_OK) {
        s->boot = NULL;
        nccl_free(c);
        return st;
    }
    *out = c;
    return RF_OK;
}

/* rf_comm_nccl (comm.h), reached through the CUDA module (kernels/cuda_module.h). */
rf_status rf__comm_nccl_impl(rf_comm *from, int device, double timeout_s, rf_comm **out) {
    *out = NULL;
    if (!from || from->kind == RF_COMM_NCCL)
        return rf_error(RF_ERR_ARG, "a NCCL communicator is made from an MPI or single one");
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || device < 0 || device >= n)
        return rf_error(RF_ERR_NODEVICE, "world rank %d: CUDA device %d does not exist (%d found)",
                        rf_comm_world_rank(from, from->rank), device, n);
    rf_comm *boot = NULL;
    RF_TRY(rf_comm_split(from, 0, from->rank, &boot));
    rf_status st = rf__comm_distinct_devices(boot, device, timeout_s);
    if (st == RF_OK) st = nccl_make(boot, device, timeout_s, out);
    if (st != RF_OK) rf_comm_free(boot);
    return st;
}

static rf_status nccl_split(rf_comm *c, int color, int key, rf_comm **out) {
    nccl_state *s = st_of(c);
    rf_comm *boot = NULL;
    RF_TRY(rf_comm_split(s->boot, color, key, &boot));
    if (!boot) return RF_OK;
    rf_status st = nccl_make(boot, s->device, s->timeout_s, out);
    if (st != RF_OK) rf_comm_free(boot);
    return st;
}

/* Host-memory exchanges over the same ranks: the MPI (or single) duplicate that bootstraps
 * splits. Its rank numbers are this communicator's (nccl_make). */
static rf_comm *nccl_host(rf_comm *c) { return st_of(c)->boot; }

static const rf_comm_ops nccl_ops = {
    "nccl", nccl_allreduce, nccl_reduce_scatter, nccl_allgather, nccl_bcast,
    nccl_barrier, nccl_sendrecv_start, nccl_group_wait, nccl_split, nccl_free,
    nccl_allreduce_start, nccl_reduce_scatter_start, nccl_group_test,
    nccl_host,
};
