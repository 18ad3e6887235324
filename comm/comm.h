/* comm: collectives and point-to-point transfers between ranks, behind one interface. This
 * build carries the MPI back end (host memory, OpenMPI); the single-rank and NCCL back ends of
 * DESIGN.md section 3 come with the parallelism work. Every wait is bounded: an operation that
 * does not complete within its timeout fails with RF_ERR_IO naming the operation and the peer
 * rank, never a hang.
 *
 * Threads: MPI is initialised with MPI_THREAD_FUNNELED; only the thread that called
 * rf_comm_init may call these functions. */
#ifndef RF_COMM_H
#define RF_COMM_H

#include <stddef.h>

#include "common/status.h"

typedef struct rf_comm rf_comm;
typedef struct rf_comm_req rf_comm_req;

/* 1 when this process was started by an MPI launcher (mpirun / srun with PMIx). */
int rf_comm_launched_by_mpi(void);

/* Initialises MPI (once) and returns the world communicator (owned by the library). Errors
 * (RF_ERR_IO) make MPI's own message part of ours. */
rf_status rf_comm_init(int *argc, char ***argv, rf_comm **world);

/* Finalizes MPI (after every communicator and request is freed). */
void rf_comm_finalize(void);

/* Aborts every rank of the job (after an error has been printed). */
void rf_comm_abort(int code);

int rf_comm_rank(const rf_comm *c);
int rf_comm_size(const rf_comm *c);

/* Splits c by color (ranks with equal color form one communicator, ordered by key); a rank
 * passing color < 0 gets *out = NULL. Collective over c. */
rf_status rf_comm_split(rf_comm *c, int color, int key, rf_comm **out);
void rf_comm_free(rf_comm *c);

/* Broadcasts bytes from root, waiting at most timeout_s ("what" names it in errors). */
rf_status rf_comm_bcast(rf_comm *c, void *buf, size_t bytes, int root, double timeout_s,
                        const char *what);

/* Gathers `bytes` from every rank into out (size * bytes), bounded like bcast. */
rf_status rf_comm_allgather(rf_comm *c, const void *in, void *out, size_t bytes,
                            double timeout_s, const char *what);

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

/* Waits for req at most timeout_s. RF_ERR_IO "<what>: rank R did not complete in T s". */
rf_status rf_comm_wait(rf_comm_req *req, double timeout_s, const char *what);

/* Frees a request; a pending one is cancelled first. NULL is fine. */
void rf_comm_req_free(rf_comm_req *req);

#endif
