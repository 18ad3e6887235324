/* NCCL over MPI for the emulated CUDA module (include/nccl.h), so that comm/comm_nccl.c itself
 * runs on the CPU, its rank processes under mpirun.
 *
 * A unique id names the process that made it (its MPI_COMM_WORLD rank) and a number of its own.
 * ncclCommInitRankConfig: each other rank sends its world rank and its rank in the new
 * communicator to that process (MPI_COMM_WORLD, a tag from the number), which answers each
 * with the whole table; then every rank makes the communicator with MPI_Comm_create_group,
 * collective over the group only. A communicator of one rank needs no MPI: its operations are
 * copies. Operations run when called (MPI's collectives; grouped sends and receives as
 * MPI_Isend / MPI_Irecv completed by ncclGroupEnd). Every buffer must be device memory of the
 * emulation (rf_emu_on_device), else ncclInvalidArgument with a message naming it, as the
 * stand-in module's NCCL refuses host buffers. */
#define OMPI_SKIP_MPICXX 1 /* the C API only: not the C++ bindings, which need their library */
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <mutex>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <vector>

#include "nccl.h"

struct rf_emu_nccl {
    MPI_Comm comm; /* MPI_COMM_NULL for one rank */
    int rank, size;
    ncclResult_t async; /* ncclInProgress until the first ncclCommGetAsyncError after a non-blocking init */
    char last[256];
};

namespace {
const char MAGIC[8] = "rfemu01";
struct id_body {
    char magic[8];
    int root_world, number;
};
const int TAG_BASE = 29000; /* handshake tags: TAG_BASE + number % 1000, and + 1000 for answers */

struct p2p {
    ncclComm_t comm;
    bool send;
    void *buf;
    size_t bytes;
    int peer;
};
thread_local int t_depth;           /* ncclGroupStart nesting */
thread_local std::vector<p2p> t_ops; /* sends and receives of the open group */

size_t type_size(ncclDataType_t t) { return t == ncclInt8 || t == ncclUint8 ? 1 : 4; }

bool mpi_ready(void) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    return init && !fin;
}

ncclResult_t not_device(ncclComm_t c, const char *what, const void *p, size_t bytes) {
    fprintf(stderr, "cuda emulation: NCCL %s given %zu bytes at %p that are not device memory\n", what, bytes, p);
    if (c) snprintf(c->last, sizeof c->last, "%s: %zu bytes at %p are not device memory", what, bytes, p);
    return ncclInvalidArgument;
}
#define NEED_DEVICE(c, what, p, bytes) \
    if ((bytes) != 0 && !rf_emu_on_device((p), (bytes))) return not_device((c), (what), (p), (bytes))

ncclResult_t mpi_result(ncclComm_t c, int rc, const char *what) {
    if (rc == MPI_SUCCESS) return ncclSuccess;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    snprintf(c->last, sizeof c->last, "%s: %.200s", what, msg);
    return ncclSystemError;
}

/* Runs the group's operations and waits for them. */
ncclResult_t run_group(std::vector<p2p> &ops) {
    std::vector<MPI_Request> reqs;
    ncclResult_t r = ncclSuccess;
    std::vector<p2p *> self_send, self_recv;
    for (p2p &o : ops) {
        if (o.comm->size == 1 || o.peer == o.comm->rank) {
            (o.send ? self_send : self_recv).push_back(&o);
            continue;
        }
        MPI_Request q;
        int rc = o.send ? MPI_Isend(o.buf, (int)o.bytes, MPI_BYTE, o.peer, 0, o.comm->comm, &q)
                        : MPI_Irecv(o.buf, (int)o.bytes, MPI_BYTE, o.peer, 0, o.comm->comm, &q);
        if ((r = mpi_result(o.comm, rc, o.send ? "ncclSend" : "ncclRecv")) != ncclSuccess) break;
        reqs.push_back(q);
    }
    for (size_t i = 0; i < self_send.size() && i < self_recv.size(); i++)
        memmove(self_recv[i]->buf, self_send[i]->buf,
                self_send[i]->bytes < self_recv[i]->bytes ? self_send[i]->bytes : self_recv[i]->bytes);
    if (self_send.size() != self_recv.size()) {
        snprintf(ops[0].comm->last, sizeof ops[0].comm->last, "a group sends itself %zu messages and receives %zu",
                 self_send.size(), self_recv.size());
        r = ncclInvalidUsage;
    }
    if (!reqs.empty()) {
        int rc = MPI_Waitall((int)reqs.size(), reqs.data(), MPI_STATUSES_IGNORE);
        if (r == ncclSuccess) r = mpi_result(ops[0].comm, rc, "ncclGroupEnd");
    }
    return r;
}
} // namespace

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}

const char *ncclGetLastError(ncclComm_t comm) { return comm ? comm->last : ""; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    static std::mutex lock;
    static int number;
    id_body b;
    memcpy(b.magic, MAGIC, sizeof b.magic);
    b.root_world = 0;
    if (mpi_ready()) MPI_Comm_rank(MPI_COMM_WORLD, &b.root_world);
    {
        std::lock_guard<std::mutex> g(lock);
        b.number = number++;
    }
    memset(id, 0, sizeof *id);
    memcpy(id->internal, &b, sizeof b);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
    *comm = NULL;
    id_body b;
    memcpy(&b, id.internal, sizeof b);
    if (memcmp(b.magic, MAGIC, sizeof b.magic) || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    ncclComm_t c = new rf_emu_nccl();
    c->comm = MPI_COMM_NULL;
    c->rank = rank, c->size = nranks;
    c->async = config && !config->blocking ? ncclInProgress : ncclSuccess;
    if (nranks > 1) {
        if (!mpi_ready()) {
            delete c;
            return ncclSystemError;
        }
        int me = 0, tag = TAG_BASE + b.number % 1000;
        MPI_Comm_rank(MPI_COMM_WORLD, &me);
        std::vector<int> table(nranks, -1);
        if (me == b.root_world) {
            table[rank] = me;
            std::vector<int> asker(nranks, -1);
            for (int i = 1; i < nranks; i++) {
                int pair[2];
                MPI_Status st;
                MPI_Recv(pair, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &st);
                if (pair[1] >= 0 && pair[1] < nranks) table[pair[1]] = pair[0];
            }
            for (int r = 0; r < nranks; r++)
                if (r != rank) MPI_Send(table.data(), nranks, MPI_INT, table[r], tag + 1000, MPI_COMM_WORLD);
        } else {
            int pair[2] = {me, rank};
            MPI_Send(pair, 2, MPI_INT, b.root_world, tag, MPI_COMM_WORLD);
            MPI_Recv(table.data(), nranks, MPI_INT, b.root_world, tag + 1000, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        }
        for (int r = 0; r < nranks; r++)
            if (table[r] < 0) {
                delete c;
                return ncclInvalidUsage; /* two ranks claimed one rank number */
            }
        MPI_Group world, group;
        MPI_Comm_group(MPI_COMM_WORLD, &world);
        MPI_Group_incl(world, nranks, table.data(), &group);
        int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &c->comm);
        MPI_Group_free(&group);
        MPI_Group_free(&world);
        if (rc != MPI_SUCCESS) {
            delete c;
            return ncclSystemError;
        }
    }
    *comm = c;
    return c->async;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async) {
    if (!comm) return ncclInvalidArgument;
    *async = comm->async;
    if (comm->async == ncclInProgress) comm->async = ncclSuccess; /* done by the next look */
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm ? ncclSuccess : ncclInvalidArgument; }

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclInvalidArgument;
    if (comm->comm != MPI_COMM_NULL && mpi_ready()) MPI_Comm_free(&comm->comm);
    delete comm;
    return ncclSuccess;
}

/* An aborted communicator's peers may still be inside an operation on it: its MPI communicator
 * is left as it is (a process that aborts one goes on to exit or to fail). */
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *in, void *out, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t) {
    if (!comm || t != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;
    size_t bytes = count * 4;
    NEED_DEVICE(comm, "ncclAllReduce's input", in, bytes);
    NEED_DEVICE(comm, "ncclAllReduce's output", out, bytes);
    if (comm->size == 1) {
        memmove(out, in, bytes);
        return ncclSuccess;
    }
    return mpi_result(comm, MPI_Allreduce(in == out ? MPI_IN_PLACE : in, out, (int)count, MPI_FLOAT, MPI_SUM, comm->comm),
                      "ncclAllReduce");
}

ncclResult_t ncclReduceScatter(const void *in, void *out, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t) {
    if (!comm || t != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;
    size_t bytes = recvcount * 4;
    NEED_DEVICE(comm, "ncclReduceScatter's input", in, bytes * comm->size);
    NEED_DEVICE(comm, "ncclReduceScatter's output", out, bytes);
    if (comm->size == 1) {
        memmove(out, in, bytes);
        return ncclSuccess;
    }
    std::vector<char> copy((const char *)in, (const char *)in + bytes * comm->size); /* in may hold out */
    return mpi_result(comm, MPI_Reduce_scatter_block(copy.data(), out, (int)recvcount, MPI_FLOAT, MPI_SUM, comm->comm),
                      "ncclReduceScatter");
}

ncclResult_t ncclAllGather(const void *in, void *out, size_t sendcount, ncclDataType_t t, ncclComm_t comm, cudaStream_t) {
    if (!comm) return ncclInvalidArgument;
    size_t bytes = sendcount * type_size(t);
    NEED_DEVICE(comm, "ncclAllGather's input", in, bytes);
    NEED_DEVICE(comm, "ncclAllGather's output", out, bytes * comm->size);
    if (comm->size == 1) {
        memmove(out, in, bytes);
        return ncclSuccess;
    }
    std::vector<char> copy((const char *)in, (const char *)in + bytes); /* in may lie in out */
    return mpi_result(comm, MPI_Allgather(copy.data(), (int)bytes, MPI_BYTE, out, (int)bytes, MPI_BYTE, comm->comm),
                      "ncclAllGather");
}

ncclResult_t ncclBroadcast(const void *in, void *out, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t) {
    if (!comm || root < 0 || root >= comm->size) return ncclInvalidArgument;
    size_t bytes = count * type_size(t);
    if (comm->rank == root) NEED_DEVICE(comm, "ncclBroadcast's input", in, bytes);
    NEED_DEVICE(comm, "ncclBroadcast's output", out, bytes);
    if (comm->rank == root && in != out) memmove(out, in, bytes);
    if (comm->size == 1) return ncclSuccess;
    return mpi_result(comm, MPI_Bcast(out, (int)bytes, MPI_BYTE, root, comm->comm), "ncclBroadcast");
}

ncclResult_t ncclGroupStart(void) {
    t_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (t_depth == 0) return ncclInvalidUsage;
    if (--t_depth > 0 || t_ops.empty()) return ncclSuccess;
    std::vector<p2p> ops;
    ops.swap(t_ops);
    return run_group(ops);
}

static ncclResult_t p2p_op(bool send, void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm) {
    if (!comm || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    size_t bytes = count * type_size(t);
    NEED_DEVICE(comm, send ? "ncclSend's buffer" : "ncclRecv's buffer", buf, bytes);
    t_ops.push_back(p2p{comm, send, buf, bytes, peer});
    if (t_depth) return ncclSuccess;
    std::vector<p2p> ops; /* outside a group: its own group */
    ops.swap(t_ops);
    return run_group(ops);
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t) {
    return p2p_op(true, (void *)buf, count, t, peer, comm);
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t) {
    return p2p_op(false, buf, count, t, peer, comm);
}
