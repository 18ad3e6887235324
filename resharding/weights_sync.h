/* Moving the actor's weights from the training worker to the rollout workers after each
 * optimizer step, through comm (MPI on CPU), with the same layout on both sides (the flat
 * parameter buffer as it is; from tensor-parallel training shards: resharding/weights_reshard.h,
 * on the planner and executor of resharding/plan.h and reshard.h).
 *
 * The sender copies the parameters into a staging buffer first, so training may go on while the
 * transfer progresses, and sends each destination a header (magic, version, CRC-32C of the
 * parameters, element count). The stage is shareable memory (common/shm.h): the header offers
 * it, and a receiver on the same host maps it once and copies the parameters straight from it
 * into its model, checksumming in the same pass (one copy at memory speed), then answers "done";
 * a receiver that cannot map it answers "send" and gets them as messages of 16 MB (in order: one
 * tag between two ranks). Without an offer (no shareable memory, or
 * rf_weights_tx_set_in_place(tx, 0)) the parameters follow the header at once. The receiver
 * probes for a header between decode steps (interruptible generation) and, when one is there,
 * takes the transfer whole at once (bounded waits), checking the count and the checksum. A
 * receiving model kept in bf16 (rf_model_keep_bf16: a rollout worker at bf16
 * precision on the CPU) gets the fp32 floats rounded into its bf16 store (rf_model_write_params):
 * from the mapped stage a chunk at a time, checksummed first; from the messages one at a time
 * through two 16 MB buffers: no fp32 copy of the weights either way.
 *
 * LoRA (model/lora.h): with adapters attached on both sides only the trained floats travel,
 * m->params[n_frozen, n_params) (the adapters): each side holds the frozen base once, loaded at
 * start; the header carries the CRC-32C of the sender's base (taken once at rf_weights_tx_init)
 * and the receiver refuses a transfer whose base is not its own (CRC taken at
 * rf_weights_rx_init). The checksum of a transfer is then over the adapters sent. */
#ifndef RF_WEIGHTS_SYNC_H
#define RF_WEIGHTS_SYNC_H

#include <stdint.h>

#include "comm/comm.h"
#include "model/model.h"

#define RF_WEIGHTS_TAG 17

typedef struct rf_weights_tx rf_weights_tx;
typedef struct rf_weights_rx rf_weights_rx;

/* Sender. rf_weights_tx_init allocates the staging buffer for model m. */
rf_status rf_weights_tx_init(rf_weights_tx **tx, const rf_model *m);

/* on = 0: never offer the stage for reading in place (the parameters always travel as a
 * message). Default 1. */
void rf_weights_tx_set_in_place(rf_weights_tx *tx, int on);

/* Receivers of the last transfer that have read it in place so far. */
int rf_weights_tx_in_place(const rf_weights_tx *tx);
void rf_weights_tx_free(rf_weights_tx *tx);

/* Waits (at most timeout_s) for the previous transfer, then stages m's parameters as
 * `version` and starts sending them to ranks dst (n of them) of c. *checksum receives their
 * CRC-32C. */
rf_status rf_weights_tx_start(rf_weights_tx *tx, rf_comm *c, const rf_model *m, int64_t version,
                              const int *dst, int n, double timeout_s, uint32_t *checksum);

/* Progresses the sends: 1 when every destination has its copy (or nothing was sent), 0 not
 * yet, -1 on an MPI error (message set). */
int rf_weights_tx_test(rf_weights_tx *tx);

/* Waits at most timeout_s for the sends to finish; the error names the rank that did not. */
rf_status rf_weights_tx_wait(rf_weights_tx *tx, double timeout_s);

/* Receiver for model m from rank src of c (m must keep its layout: under LoRA its frozen base
 * is checksummed here once). */
rf_status rf_weights_rx_init(rf_weights_rx **rx, rf_comm *c, const rf_model *m, int src);

/* on = 0: decline offers to read in place (the sender then sends the parameters). Default 1. */
void rf_weights_rx_set_in_place(rf_weights_rx *rx, int on);

/* Bound of each wait inside rf_weights_rx_poll once a transfer is there (<= 0: 60 s). */
void rf_weights_rx_set_timeout(rf_weights_rx *rx, double timeout_s);
void rf_weights_rx_free(rf_weights_rx *rx);

/* When a transfer is waiting: receives it, checks it (magic, count, CRC-32C), copies it into
 * m's parameters (rf_model_write_params: for a model kept in bf16, rounded into its store) and sets *arrived = 1, *version and *checksum. *arrived = 0: none yet. Errors (RF_ERR_FORMAT for a transfer that does not check out, naming the
 * version and both checksums; RF_ERR_IO from MPI). */
rf_status rf_weights_rx_poll(rf_weights_rx *rx, rf_model *m, int *arrived, int64_t *version,
                             uint32_t *checksum);

/* CRC-32C of what a transfer of m sends: m's parameters, under LoRA its adapters
 * (params[n_frozen, n_params)); read back from the device when needed. */
rf_status rf_weights_checksum(const rf_model *m, uint32_t *checksum);

#endif
