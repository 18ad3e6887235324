/* Weight transfers between identical layouts: staging, header, checksum. */
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "resharding/weights_sync.h"

#define MAGIC 0x52465754u /* "RFWT" */

typedef struct header {
    uint32_t magic, checksum;
    int64_t version;
    uint64_t n_floats, reserved;
} header;

#define MAX_DST 1024

struct rf_weights_tx {
    uint8_t *stage; /* header + params */
    size_t bytes;
    rf_comm_req *req[MAX_DST];
    int dst[MAX_DST];
    int n;
};

struct rf_weights_rx {
    uint8_t *buf;
    size_t bytes;
    rf_comm *c;
    int src;
    double timeout_s;
};

static size_t transfer_bytes(const rf_model *m) { return sizeof(header) + m->n_params * sizeof(float); }

rf_status rf_weights_tx_init(rf_weights_tx **out, const rf_model *m) {
    *out = NULL;
    rf_weights_tx *tx = calloc(1, sizeof *tx);
    if (tx) tx->bytes = transfer_bytes(m), tx->stage = malloc(tx->bytes);
    if (!tx || !tx->stage) {
        free(tx);
        return rf_error(RF_ERR_NOMEM, "weights: out of memory staging %zu parameters", m->n_params);
    }
    *out = tx;
    return RF_OK;
}

void rf_weights_tx_free(rf_weights_tx *tx) {
    if (!tx) return;
    for (int i = 0; i < tx->n; i++) rf_comm_req_free(tx->req[i]);
    free(tx->stage);
    free(tx);
}

int rf_weights_tx_test(rf_weights_tx *tx) {
    int all = 1;
    for (int i = 0; i < tx->n; i++) {
        if (!tx->req[i]) continue;
        int t = rf_comm_test(tx->req[i]);
        if (t < 0) return -1;
        if (t) {
            rf_comm_req_free(tx->req[i]);
            tx->req[i] = NULL;
        } else {
            all = 0;
        }
    }
    return all;
}

rf_status rf_weights_tx_wait(rf_weights_tx *tx, double timeout_s) {
    for (int i = 0; i < tx->n; i++) {
        if (!tx->req[i]) continue;
        char what[96];
        snprintf(what, sizeof what, "sending weights to rank %d", tx->dst[i]);
        RF_TRY(rf_comm_wait(tx->req[i], timeout_s, what));
        rf_comm_req_free(tx->req[i]);
        tx->req[i] = NULL;
    }
    tx->n = 0;
    return RF_OK;
}

rf_status rf_weights_checksum(const rf_model *m, uint32_t *checksum) {
    if (strcmp(m->k->name, "cpu") == 0) {
        *checksum = rf_crc32c(m->params, m->n_params * sizeof(float));
        return RF_OK;
    }
    float *h = malloc(m->n_params * sizeof(float));
    if (!h) return rf_error(RF_ERR_NOMEM, "out of memory");
    m->k->to_host(h, m->params, m->n_params * sizeof(float));
    *checksum = rf_crc32c(h, m->n_params * sizeof(float));
    free(h);
    return RF_OK;
}

rf_status rf_weights_tx_start(rf_weights_tx *tx, rf_comm *c, const rf_model *m, int64_t version,
                              const int *dst, int n, double timeout_s, uint32_t *checksum) {
    if (n > MAX_DST) return rf_error(RF_ERR_ARG, "weights: %d destinations, at most %d", n, MAX_DST);
    if (transfer_bytes(m) != tx->bytes) return rf_error(RF_ERR_ARG, "weights: the model changed size");
    RF_TRY(rf_weights_tx_wait(tx, timeout_s));
    float *p = (float *)(tx->stage + sizeof(header));
    m->k->to_host(p, m->params, m->n_params * sizeof(float));
    header h = {MAGIC, rf_crc32c(p, m->n_params * sizeof(float)), version, m->n_params, 0};
    memcpy(tx->stage, &h, sizeof h);
    *checksum = h.checksum;
    for (int i = 0; i < n; i++) {
        tx->dst[i] = dst[i];
        rf_status st = rf_comm_isend(c, tx->stage, tx->bytes, dst[i], RF_WEIGHTS_TAG, &tx->req[i]);
        tx->n = i + (st == RF_OK);
        if (st != RF_OK) return rf_error_wrap(st, "sending weights version %lld to rank %d", (long long)version, dst[i]);
    }
    return RF_OK;
}

rf_status rf_weights_rx_init(rf_weights_rx **out, rf_comm *c, const rf_model *m, int src) {
    *out = NULL;
    rf_weights_rx *rx = calloc(1, sizeof *rx);
    if (rx) rx->bytes = transfer_bytes(m), rx->buf = malloc(rx->bytes);
    if (!rx || !rx->buf) {
        free(rx);
        return rf_error(RF_ERR_NOMEM, "weights: out of memory for a receive buffer of %zu parameters", m->n_params);
    }
    rx->c = c, rx->src = src, rx->timeout_s = 60;
    *out = rx;
    return RF_OK;
}

void rf_weights_rx_free(rf_weights_rx *rx) {
    if (!rx) return;
    free(rx->buf);
    free(rx);
}

rf_status rf_weights_rx_poll(rf_weights_rx *rx, rf_model *m, int *arrived, int64_t *version,
                             uint32_t *checksum) {
    *arrived = 0;
    /* nothing is posted until a transfer is there; then it is received at once, the sender
     * being busy sending it (a posted receive would progress only between decode steps) */
    int t = rf_comm_iprobe(rx->c, rx->src, RF_WEIGHTS_TAG);
    if (t < 0) return rf_error_wrap(RF_ERR_IO, "receiving weights from rank %d", rx->src);
    if (!t) return RF_OK;
    rf_comm_req *req = NULL;
    char what[96];
    snprintf(what, sizeof what, "receiving weights from rank %d", rx->src);
    RF_TRY(rf_comm_irecv(rx->c, rx->buf, rx->bytes, rx->src, RF_WEIGHTS_TAG, &req));
    rf_status st = rf_comm_wait(req, rx->timeout_s, what);
    rf_comm_req_free(req);
    RF_TRY(st);
    header h;
    memcpy(&h, rx->buf, sizeof h);
    const float *p = (const float *)(rx->buf + sizeof(header));
    if (h.magic != MAGIC || h.n_floats != m->n_params)
        return rf_error(RF_ERR_FORMAT, "weights from rank %d: not a transfer for this model (magic %08x, %llu parameters, the model has %zu)",
                        rx->src, h.magic, (unsigned long long)h.n_floats, m->n_params);
    uint32_t crc = rf_crc32c(p, m->n_params * sizeof(float));
    if (crc != h.checksum)
        return rf_error(RF_ERR_FORMAT, "weights version %lld from rank %d arrived damaged: CRC-32C %08x, sent as %08x",
                        (long long)h.version, rx->src, crc, h.checksum);
    m->k->to_device(m->params, p, m->n_params * sizeof(float));
    *arrived = 1, *version = h.version, *checksum = crc;
    return RF_OK;
}
