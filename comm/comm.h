/* comm: collectives and point-to-point transfers between ranks, behind one interface with three
 * back ends (DESIGN.md section 3), chosen per communicator when it is created:
 *
 *   single  one rank, no MPI: collectives are copies (or nothing), sends pair with receives to
 *           self. What rf_comm_world gives a process that no MPI launcher started. Host memory.
 *   mpi     OpenMPI, host memory. rf_comm_init / rf_comm_world under mpirun, and every
 *           communicator split from one.
 *   nccl    NCCL, device memory (every buffer argument is a CUDA device pointer on the
 *           communicator's device). rf_comm_nccl makes one from an MPI (or single) communicator:
 *           rank 0 creates the NCCL unique id and broadcasts it over MPI. Built only when CUDA
 *           and NCCL are found (RLFLOW_HAVE_NCCL); otherwise rf_comm_nccl says so.
 *
 * Bounded waits. Every operation takes `timeout_s` and `what` (a phrase naming it, e.g.
 * "allreduce of gradients"). An operation that does not complete in time fails with RF_ERR_IO
 * and the message
 *     "<what>: world rank R waited T s for world rank(s) LIST (a rank is gone or stuck)"
 * where LIST names the other ranks of the collective, or for rf_comm_sendrecv the peers whose
 * transfers had not completed (MPI) / every peer of the group (NCCL cannot tell them apart).
 * Ranks in messages are MPI_COMM_WORLD ranks (what mpirun and the logs show), whatever the
 * communicator. MPI waits are non-blocking calls tested in a loop against the deadline; NCCL
 * communicators are non-blocking (ncclConfig_t.blocking = 0): initialisation and operations are
 * polled with ncclCommGetAsyncError and cudaStreamQuery, and on timeout or an asynchronous
 * error the NCCL communicator is aborted (ncclCommAbort). After a timeout the communicator is
 * unusable (a collective half done cannot be taken back): every later operation on it fails at
 * once with RF_ERR_IO "<what>: this communicator failed earlier (<first message>)". Free it and
 * stop; a run does not go on after a lost rank.
 *
 * Ordering. Collectives on one communicator must be called in the same order on every rank.
 * rf_comm_sendrecv pairs the k-th send from A to B with the k-th receive on B from A (both
 * within one call: a send and its receive must be in the calls that go together on both ranks).
 *
 * NCCL streams: a NCCL communicator runs on a stream of its own. Each operation is ordered on
 * the device after the work already queued on the CUDA back end's stream (kernels.h,
 * rf_cuda_stream; an event the NCCL stream waits for), so inputs written by kernels need no
 * synchronisation by the caller; buffers written by other streams or plain CUDA calls must be
 * complete first. A blocking operation returns once its result is in place (the NCCL stream
 * has been synchronised); a started one once it is queued (rf_comm_group_wait finishes it).
 *
 * Threads: MPI is initialised with MPI_THREAD_FUNNELED; only the thread that called
 * rf_comm_init / rf_comm_world may call these functions. A communicator is used by one thread.
 * rf_comm_init_threads asks for MPI_THREAD_MULTIPLE instead: then each thread may use
 * communicators of its own (a colocated process's training and rollout ranks).
 */
#ifndef RF_COMM_H
#define RF_COMM_H

#include <stddef.h>

#include "common/status.h"

typedef struct rf_comm rf_comm;
typedef struct rf_comm_req rf_comm_req;

typedef enum rf_comm_kind { RF_COMM_SINGLE, RF_COMM_MPI, RF_COMM_NCCL } rf_comm_kind;

/* 1 when this process was started by an MPI launcher (mpirun / srun with PMIx). */
int rf_comm_launched_by_mpi(void);

/* Initialises MPI (once) and returns the world communicator (owned by the library). Errors
 * (RF_ERR_IO) make MPI's own message part of ours. */
rf_status rf_comm_init(int *argc, char ***argv, rf_comm **world);

/* rf_comm_init with MPI_THREAD_MULTIPLE when multiple is 1 (before MPI is initialised):
 * RF_ERR_UNSUPPORTED when the MPI library does not provide it. */
rf_status rf_comm_init_threads(int *argc, char ***argv, int multiple, rf_comm **world);

/* The world of this process: MPI's (rf_comm_init) when an MPI launcher started it, else the
 * single-rank communicator (MPI is not touched). Owned by the library. */
rf_status rf_comm_world(int *argc, char ***argv, rf_comm **world);

/* The single-rank communicator (rank 0 of 1, host memory), owned by the library. */
rf_comm *rf_comm_single(void);

/* Makes a NCCL communicator over the ranks of `from` (an MPI or single communicator; collective
 * over it), the calling rank using CUDA device `device`; ranks keep their numbers. Rank 0 makes
 * the unique id and broadcasts it over `from`; initialisation is bounded by timeout_s (a rank
 * that never joins: RF_ERR_IO naming the ranks). The new communicator keeps a duplicate of
 * `from` for bootstrapping its splits; timeout_s also bounds those. Caller frees it with
 * rf_comm_free. RF_ERR_UNSUPPORTED when this build has no NCCL, RF_ERR_NODEVICE when `device`
 * does not exist, RF_ERR_ARG (on every rank, naming both world ranks, the device and the host)
 * when two ranks of one machine pass the same device: NCCL does not allow that. */
rf_status rf_comm_nccl(rf_comm *from, int device, double timeout_s, rf_comm **out);

/* The communicator for the memory of back end k (kernels/kernels.h) over g's ranks: g itself
 * for the CPU kernels; for device kernels a NCCL communicator made from g on the back end's
 * device (rf_comm_nccl; *dev, which the caller frees), its errors wrapped as "<what> on CUDA"
 * (what names the feature, e.g. "data parallelism"). Collective over g. */
struct rf_kernels;
rf_status rf_comm_for(rf_comm *g, const struct rf_kernels *k, const char *what, double timeout_s, rf_comm **dev,
                      rf_comm **out);

/* 1 when NCCL can be used: this build has the NCCL back end (RLFLOW_HAVE_NCCL), or
 * RLFLOW_CUDA_MODULE names a CUDA module at run time (the CPU stand-in of the tests); else 0. */
int rf_comm_nccl_built(void);

/* Finalizes MPI (after every communicator and request is freed). Nothing when MPI was not
 * initialised. */
void rf_comm_finalize(void);

/* Aborts every rank of the job (after an error has been printed); exit(code) without MPI. */
void rf_comm_abort(int code);

int rf_comm_rank(const rf_comm *c);
int rf_comm_size(const rf_comm *c);
rf_comm_kind rf_comm_backend(const rf_comm *c);
/* "single", "mpi" or "nccl". */
const char *rf_comm_backend_name(const rf_comm *c);
/* The host-memory communicator over c's ranks (the same rank numbers), for small exchanges of
 * host data beside a device communicator's collectives (counts, norms, flags): c itself for
 * the single and MPI back ends; a NCCL communicator's own MPI duplicate (owned by c: not
 * freed by the caller, valid while c is). */
rf_comm *rf_comm_host(rf_comm *c);

/* The MPI_COMM_WORLD rank of rank r of c (r itself for the single back end). */
int rf_comm_world_rank(const rf_comm *c, int r);

/* The machine of each world rank: node[w] for world rank w < n (equal numbers: one machine),
 * as the launcher found it (host names gathered at the start); copied. Set it on every rank,
 * the same table. Planners use it to keep bytes on a machine (resharding/plan.h). RF_ERR_NOMEM. */
rf_status rf_comm_set_nodes(const int *node, int n);
/* The machine number of rank r of c; -1 when not set (or r out of range). */
int rf_comm_node(const rf_comm *c, int r);

/* Splits c by color (ranks with equal color form one communicator, ordered by key, then by
 * rank in c); a rank passing color < 0 gets *out = NULL. Collective over c. The new
 * communicator has c's back end (a NCCL one is bootstrapped over the split of its MPI
 * duplicate, on the same device). Caller frees it with rf_comm_free. */
rf_status rf_comm_split(rf_comm *c, int color, int key, rf_comm **out);

/* Frees a communicator made by rf_comm_split or rf_comm_nccl; the library's own (world,
 * single) and NULL are ignored. */
void rf_comm_free(rf_comm *c);

/* ---- collectives (every rank of c calls them, in the same order) ---- */

/* out (n) = sum over ranks of in (n), float32, identical on every rank. in == out is in place;
 * otherwise they must not overlap. */
rf_status rf_comm_allreduce(rf_comm *c, const float *in, float *out, size_t n, double timeout_s,
                            const char *what);

/* Reduce-scatter with equal blocks: in is (size, n); out (n) on rank r = sum over ranks of block
 * r of in. in and out must not overlap. n at most INT_MAX (MPI counts). */
rf_status rf_comm_reduce_scatter(rf_comm *c, const float *in, float *out, size_t n,
                                 double timeout_s, const char *what);

/* Gathers `bytes` from every rank into out (size, bytes), rank r's at out + r * bytes. in and
 * out must not overlap. */
rf_status rf_comm_allgather(rf_comm *c, const void *in, void *out, size_t bytes,
                            double timeout_s, const char *what);

/* Whether every rank of c succeeded at a step: each passes its own status `mine`. A rank that
 * failed gets `mine` back with its message; the others get comm's error when the exchange
 * failed, else RF_OK with *failed the first rank that failed (-1: none), for the caller to
 * name. Collective. */
rf_status rf_comm_agree(rf_comm *c, rf_status mine, double timeout_s, const char *what, int *failed);

/* Broadcasts bytes of buf from root to every rank (in place). */
rf_status rf_comm_bcast(rf_comm *c, void *buf, size_t bytes, int root, double timeout_s,
                        const char *what);

/* Returns on every rank once every rank has called it. */
rf_status rf_comm_barrier(rf_comm *c, double timeout_s, const char *what);

/* ---- grouped point-to-point ---- */

/* One send or receive of a group. */
typedef struct rf_comm_p2p {
    void *buf;    /* (bytes) read when sending, written when receiving */
    size_t bytes; /* a send's and its receive's must be equal */
    int peer;     /* rank in the communicator; may be the caller itself */
    int send;     /* 1 send, 0 receive */
} rf_comm_p2p;

/* Posts every send and receive of ops (n of them) together and returns when all have
 * completed (ncclGroupStart/End on NCCL; Isend/Irecv on MPI; copies on the single back end).
 * Only the ranks named as peers take part: this is not a collective. Timeouts name the peers
 * not done. Buffers of different ops must not overlap where one of them is received into. */
rf_status rf_comm_sendrecv(rf_comm *c, const rf_comm_p2p *ops, int n, double timeout_s,
                           const char *what);

/* The same in two steps, so that the caller can work while the transfers progress (on MPI
 * they progress inside comm calls and in the peer's; the single back end copies at the start).
 * rf_comm_sendrecv_start posts ops (the array may be reused at once; the buffers stay in use
 * until the wait) and returns a group; rf_comm_group_wait waits for it at most timeout_s and
 * frees it, whatever the outcome (every started group must be waited for). `what` names the
 * exchange in errors. */
typedef struct rf_comm_group rf_comm_group;
rf_status rf_comm_sendrecv_start(rf_comm *c, const rf_comm_p2p *ops, int n, const char *what,
                                 rf_comm_group **g);
rf_status rf_comm_group_wait(rf_comm_group *g, double timeout_s);

/* ---- single transfers (MPI back end only; RF_ERR_UNSUPPORTED elsewhere) ---- */

/* Non-blocking send / receive of any number of bytes (split into pieces MPI can count).
 * buf must stay untouched until the request completes. */
rf_status rf_comm_isend(rf_comm *c, const void *buf, size_t bytes, int peer, int tag,
                        rf_comm_req **req);
rf_status rf_comm_irecv(rf_comm *c, void *buf, size_t bytes, int peer, int tag,
                        rf_comm_req **req);

/* 1 when a message with `tag` from `peer` is waiting to be received, 0 when not, -1 on an MPI
 * error (message set). */
int rf_comm_iprobe(rf_comm *c, int peer, int tag);

/* Progresses req: 1 when complete, 0 when not yet, -1 on an MPI error (message set). */
int rf_comm_test(rf_comm_req *req);

/* Waits for req at most timeout_s. RF_ERR_IO "<what>: rank R did not complete it within T s"
 * (R the peer's rank in the request's communicator). */
rf_status rf_comm_wait(rf_comm_req *req, double timeout_s, const char *what);

/* Frees a request; a pending one is cancelled first. NULL is fine. */
void rf_comm_req_free(rf_comm_req *req);

/* ---- non-blocking collectives (started, then waited for) ---- */

/* rf_comm_allreduce and rf_comm_reduce_scatter in two steps, so that the caller can compute
 * while the reduction progresses (data-parallel training starts one per gradient bucket during
 * the backward pass: trainer/data_parallel.h). Arguments and results are those of the blocking
 * calls; in and out stay in use until the wait. Several may be in flight on one communicator
 * and, like every collective, they are started in the same order on every rank. The group is
 * waited for and freed with rf_comm_group_wait, whose timeout message names every other rank as
 * the blocking collective's does; after a timeout the communicator has failed, as there.
 * Progress: MPI moves a started collective forward only inside MPI calls, so a caller that
 * computes should call rf_comm_group_test now and then; the single back end reduces at the
 * start; NCCL enqueues the collective on the communicator's stream (after the kernels queued
 * so far: see "NCCL streams") and returns, the GPU runs it while the caller goes on queuing
 * kernels that do not touch `in` or `out`, and the wait polls the stream (several in flight
 * run in order on it). */
rf_status rf_comm_allreduce_start(rf_comm *c, const float *in, float *out, size_t n,
                                  double timeout_s, const char *what, rf_comm_group **g);
rf_status rf_comm_reduce_scatter_start(rf_comm *c, const float *in, float *out, size_t n,
                                       double timeout_s, const char *what, rf_comm_group **g);

/* Progresses a started group (collective or send/recv) without waiting: 1 when it has
 * completed, 0 when not yet (NCCL: once its stream has run everything enqueued so far), -1 on an
 * error (message set; the communicator has failed). It must still be waited for. */
int rf_comm_group_test(rf_comm_group *g);

#endif
