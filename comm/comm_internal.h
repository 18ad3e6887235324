/* comm's back-end interface: the table of operations each back end fills (the ggml {iface,
 * context} idea), the communicator every back end shares, and helpers for bounded waits and
 * their messages. Included by the comm sources only. */
#ifndef RF_COMM_INTERNAL_H
#define RF_COMM_INTERNAL_H

#include "comm/comm.h"

typedef struct rf_comm_ops {
    const char *name;
    rf_status (*allreduce)(rf_comm *c, const float *in, float *out, size_t n, double timeout_s,
                           const char *what);
    rf_status (*reduce_scatter)(rf_comm *c, const float *in, float *out, size_t n,
                                double timeout_s, const char *what);
    rf_status (*allgather)(rf_comm *c, const void *in, void *out, size_t bytes, double timeout_s,
                           const char *what);
    rf_status (*bcast)(rf_comm *c, void *buf, size_t bytes, int root, double timeout_s,
                       const char *what);
    rf_status (*barrier)(rf_comm *c, double timeout_s, const char *what);
    /* posts ops; may set g->impl, which group_wait releases */
    rf_status (*sendrecv_start)(rf_comm *c, const rf_comm_p2p *ops, int n, rf_comm_group *g);
    rf_status (*group_wait)(rf_comm_group *g, double timeout_s);
    rf_status (*split)(rf_comm *c, int color, int key, rf_comm **out);
    void (*free)(rf_comm *c); /* the back end's state and c itself */
    /* non-blocking collectives, set g->impl for group_wait; NULL: the blocking one runs at the
     * start (rf_comm_allreduce_start) */
    rf_status (*allreduce_start)(rf_comm *c, const float *in, float *out, size_t n, rf_comm_group *g);
    rf_status (*reduce_scatter_start)(rf_comm *c, const float *in, float *out, size_t n,
                                      rf_comm_group *g);
    int (*group_test)(rf_comm_group *g); /* 1 done, 0 not yet, -1 error; NULL: 0 */
    rf_comm *(*host)(rf_comm *c); /* rf_comm_host; NULL: c itself (host memory already) */
} rf_comm_ops;

struct rf_comm {
    const rf_comm_ops *ops;
    rf_comm_kind kind;
    int rank, size;
    int *world;        /* (size) MPI_COMM_WORLD rank of each rank */
    int owned_by_lib;  /* world and single: rf_comm_free ignores them */
    char failed[512];  /* set by the first timeout: the communicator is unusable */
    void *impl;        /* the back end's state */
};

/* A started rf_comm_sendrecv. */
struct rf_comm_group {
    rf_comm *c;
    int n;
    int *peer;       /* (n) the peer of each op, for timeout messages (a collective: every
                        other rank) */
    char what[160];
    void *impl;      /* the back end's */
};

/* Allocates a communicator of `size` ranks (world table zeroed); NULL with a message. */
rf_comm *rf__comm_new(const rf_comm_ops *ops, rf_comm_kind kind, int rank, int size);
/* Frees what rf__comm_new allocated. */
void rf__comm_delete(rf_comm *c);

/* Writes "world rank 3" / "world ranks 0-2, 5" for the ranks of c listed in `ranks` (n of
 * them, any order) into out (cap bytes), shortened with ", ..." when long. */
void rf__comm_format_ranks(const rf_comm *c, const int *ranks, int n, char *out, size_t cap);

/* The timeout error (message in comm.h) for waiting on ranks `ranks` (n, ranks of c); marks c
 * failed. */
rf_status rf__comm_timeout(rf_comm *c, const int *ranks, int n, double timeout_s, const char *what);
/* The same naming every other rank of c. */
rf_status rf__comm_timeout_all(rf_comm *c, double timeout_s, const char *what);

/* Every rank's host name and `device` over c (host memory): two ranks on one device of one
 * machine are refused with RF_ERR_ARG naming both world ranks, the device and the host (NCCL
 * does not allow a device twice in a communicator). Collective; the same verdict on every
 * rank. For the NCCL back end and its stand-in (tests/mock_cuda_module.c). */
rf_status rf__comm_distinct_devices(rf_comm *c, int device, double timeout_s);

/* Marks c failed with the current error message (later operations refuse at once). */
void rf__comm_mark_failed(rf_comm *c);

/* One step of a polling loop: spins for the first polls (short operations finish within
 * microseconds), then sleeps briefly so that waiting ranks leave the cores to the ones working
 * (ranks often share cores). `polls` counts calls. */
void rf__comm_backoff(int *polls);

#endif
