/* The handover of the actor's weights between the two roles of one process in a colocated run
 * on several devices (placement.mode = "colocated" with a parallel layout): each training rank's
 * process also runs a rollout rank in a thread of its own (rollout/worker.h), on the same
 * device, verl's hybrid engine as one process per device.
 *
 *   - Identical layouts (placement.rollout.tp = placement.actor.tp: rollout worker d is
 *     training replica d, its rank t in the process of the replica's TP rank t): zero-copy.
 *     The rollout rank's model borrows the training shard's parameter buffer
 *     (rf_model_init_borrowed); a new version costs nothing but its checksum.
 *   - Other layouts: the training ranks reshard from their layout into the rollout ranks'
 *     buffers in their processes (rf_weights_rs_init_colocated: gathered in place over the
 *     host's shared memory), then hand the version over.
 *
 * The two threads take turns on the parameters the rollout reads: generation steps are
 * readers (rf_handover_read_begin/end, around each engine step or step command), the training
 * rank's update and resharding the writer (rf_handover_write_begin ... rf_handover_publish).
 * The controller keeps them apart (at staleness 0 nothing is generating while a batch trains,
 * validation included), so a writer only ever waits for the tail of a step; a generation step
 * that would start while the weights are being written is refused (an error, not torn
 * weights). Readers never wait for the writer: a step's command that reaches a rank that is
 * already writing means that invariant broke, and waiting could close a cycle between ranks.
 *
 * Every wait is bounded, and rf_handover_fail wakes the other thread with the reason when
 * either role stops on an error. Threads: any; one writer thread. */
#ifndef RF_HANDOVER_H
#define RF_HANDOVER_H

#include <pthread.h>
#include <stdint.h>

#include "common/status.h"

typedef struct rf_handover {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int readers;      /* generation steps in progress */
    int writing;      /* 1 between write_begin and publish */
    int failed;       /* a role stopped: why[] says why */
    int64_t version;  /* the last published version, -1 before the first */
    uint32_t crc;     /* its CRC-32C (the whole model's) */
    float *src;       /* zero-copy: the training rank's parameter buffer (the shard's) */
    float *dst;       /* other layouts: the rollout rank's buffer the resharding fills (host) */
    char why[1024];
} rf_handover;

/* Initialises h (no version yet). RF_ERR_INTERNAL when pthreads fail. Free with
 * rf_handover_free after both threads have stopped using it. */
rf_status rf_handover_init(rf_handover *h);
void rf_handover_free(rf_handover *h);

/* Marks h failed with the current error message (who stopped and why) and wakes every
 * waiter; their waits then fail with it. The first failure's message is kept. */
void rf_handover_fail(rf_handover *h, const char *who);

/* The rollout thread (other layouts): the buffer the training rank's resharding writes into
 * (host memory, the rollout layout's local buffer). */
void rf_handover_offer_dst(rf_handover *h, float *dst);

/* The training thread: waits (at most timeout_s) for the rollout thread's buffer. */
rf_status rf_handover_wait_dst(rf_handover *h, double timeout_s, float **dst);

/* The writer: waits (at most timeout_s) until no generation step is in progress, then holds
 * the parameters until rf_handover_publish. RF_ERR_IO naming the wait when a step does not end
 * in time; the failure's message after rf_handover_fail. Calling it again while holding them
 * is a no-op. */
rf_status rf_handover_write_begin(rf_handover *h, double timeout_s);

/* The writer: version `version` (CRC-32C crc) is in place; src is the training rank's buffer
 * (zero-copy) or NULL. Releases the parameters (also when write_begin was not called). */
void rf_handover_publish(rf_handover *h, int64_t version, uint32_t crc, float *src);

/* A generation step begins / ends. begin: RF_ERR_INTERNAL while the training rank writes the
 * parameters (see above), the failure's message after rf_handover_fail. */
rf_status rf_handover_read_begin(rf_handover *h);
void rf_handover_read_end(rf_handover *h);

/* The latest published version (-1: none yet), its CRC-32C and source buffer; no waiting. */
int64_t rf_handover_latest(rf_handover *h, uint32_t *crc, float **src);

/* Waits (at most timeout_s) until version >= v is published; *crc and *src as
 * rf_handover_latest. RF_ERR_IO naming `what` on the deadline. */
rf_status rf_handover_wait_version(rf_handover *h, int64_t v, double timeout_s, const char *what, uint32_t *crc,
                                   float **src);

#endif
