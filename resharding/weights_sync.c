/* Weight transfers between identical layouts: staging, header, checksum. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/log.h"
#include "common/shm.h"
#include "resharding/weights_sync.h"

#define MAGIC 0x52465754u /* "RFWT" */
#define REPLY_TAG (RF_WEIGHTS_TAG + 1) /* receiver -> sender: READ_DONE or SEND_DATA */
#define DATA_TAG (RF_WEIGHTS_TAG + 2)  /* sender -> receiver: the parameters */
#define READ_DONE 0x52464452           /* "RFDR" */
#define SEND_DATA 0x52465344           /* "RFSD" */

typedef struct header {
    uint32_t magic, checksum;
    int64_t version;
    uint64_t n_floats;    /* floats sent: the model's [first, first + n_floats) */
    uint64_t first;       /* LoRA: the frozen base's floats, not sent; 0 otherwise */
    uint32_t base_crc;    /* CRC-32C of the sender's floats [0, first) (0 without LoRA) */
    int32_t offer;        /* 1: `stage` describes the staged parameters in shareable memory */
    rf_shm_ref stage;
} header;

#define MAX_DST 1024

/* Bytes per message of the parameters: they travel as consecutive messages of this size (the
 * last one shorter; MPI keeps messages of one tag between two ranks in order), so a receiver
 * kept in bf16 takes them a piece at a time into two small buffers instead of a whole fp32 copy. */
#define DATA_CHUNK ((size_t)16 << 20)

/* The number of data messages for `bytes` (at least 1). */
static size_t n_chunks(size_t bytes) { return bytes ? (bytes + DATA_CHUNK - 1) / DATA_CHUNK : 1; }

/* Bytes of data message i of `bytes`. */
static size_t chunk_len(size_t bytes, size_t i) {
    size_t a = i * DATA_CHUNK;
    return bytes - a < DATA_CHUNK ? bytes - a : DATA_CHUNK;
}

/* One destination of a transfer. */
typedef struct dest {
    int rank;
    rf_comm_req *hdr, *reply;        /* in flight; NULL when done or not needed */
    rf_comm_req **data;              /* (n_data) the parameters' messages in flight, NULL when done */
    size_t n_data;
    int32_t answer;                  /* the receiver's reply (offers only) */
} dest;

struct rf_weights_tx {
    float *stage;     /* the parameters sent, shareable when the system allows */
    size_t n_floats;  /* floats sent: the model's from `first` on */
    size_t first;     /* m->n_frozen: under LoRA the adapters alone travel */
    uint32_t base_crc;
    header h;         /* of the transfer in flight */
    int in_place;     /* offer the stage to receivers on this host */
    rf_comm *c;
    dest d[MAX_DST];
    int n;
    int n_in_place, told; /* receivers that read the stage in place; the path was logged */
};

struct rf_weights_rx {
    float *buf;       /* the message path's receive buffer, made on first use */
    rf_shm_map map;   /* the sender's stage, mapped on the first offer and kept */
    int map_refused;  /* it could not be mapped: messages from then on (said once) */
    rf_comm *c;
    int src;
    int in_place;     /* read offered stages in place (default 1) */
    double timeout_s;
    size_t first;     /* the receiving model's n_frozen */
    uint32_t base_crc; /* CRC-32C of its frozen base, taken once at rf_weights_rx_init */
};

/* CRC-32C of floats [a, a + n) of m's parameters (read back from the device when needed). */
static rf_status crc_of(const rf_model *m, size_t a, size_t n, uint32_t *crc) {
    if (strcmp(m->k->name, "cpu") == 0) {
        *crc = rf_crc32c(m->params + a, n * sizeof(float));
        return RF_OK;
    }
    float *h = malloc(n * sizeof(float) + 1);
    if (!h) return rf_error(RF_ERR_NOMEM, "out of memory");
    m->k->to_host(h, m->params + a, n * sizeof(float));
    *crc = rf_crc32c(h, n * sizeof(float));
    free(h);
    return RF_OK;
}

rf_status rf_weights_tx_init(rf_weights_tx **out, const rf_model *m) {
    *out = NULL;
    rf_weights_tx *tx = calloc(1, sizeof *tx);
    if (!tx) return rf_error(RF_ERR_NOMEM, "out of memory");
    tx->first = m->n_frozen, tx->n_floats = m->n_params - m->n_frozen, tx->in_place = 1;
    rf_status st = crc_of(m, 0, tx->first, &tx->base_crc);
    if (st == RF_OK) st = rf_shm_alloc((void **)&tx->stage, tx->n_floats * sizeof(float) + 1, "weights stage");
    if (st != RF_OK) {
        size_t n = tx->n_floats;
        free(tx);
        return rf_error_wrap(st, "weights: staging %zu parameters", n);
    }
    *out = tx;
    return RF_OK;
}

void rf_weights_tx_set_in_place(rf_weights_tx *tx, int on) { tx->in_place = on; }

int rf_weights_tx_in_place(const rf_weights_tx *tx) { return tx->n_in_place; }

static void dest_free(dest *d) {
    rf_comm_req_free(d->hdr), rf_comm_req_free(d->reply);
    for (size_t i = 0; i < d->n_data; i++) rf_comm_req_free(d->data[i]);
    free(d->data);
    d->hdr = d->reply = NULL, d->data = NULL, d->n_data = 0;
}

void rf_weights_tx_free(rf_weights_tx *tx) {
    if (!tx) return;
    for (int i = 0; i < tx->n; i++) dest_free(&tx->d[i]);
    rf_shm_free(tx->stage);
    free(tx);
}

/* 1 when *r is done (then freed and NULL) or absent, 0 not yet, -1 on an MPI error. */
static int test_req(rf_comm_req **r) {
    if (!*r) return 1;
    int t = rf_comm_test(*r);
    if (t > 0) rf_comm_req_free(*r), *r = NULL;
    return t;
}

/* Starts the parameters' messages to d (DATA_CHUNK bytes each). */
static rf_status send_data(rf_weights_tx *tx, dest *d) {
    size_t bytes = tx->n_floats * sizeof(float), n = n_chunks(bytes);
    if (!(d->data = calloc(n, sizeof *d->data))) return rf_error(RF_ERR_NOMEM, "out of memory");
    d->n_data = n;
    rf_status st = RF_OK;
    for (size_t i = 0; st == RF_OK && i < n; i++) {
        st = rf_comm_isend(tx->c, (const char *)tx->stage + i * DATA_CHUNK, chunk_len(bytes, i), d->rank, DATA_TAG,
                           &d->data[i]);
    }
    return st == RF_OK ? RF_OK : rf_error_wrap(st, "sending weights version %lld to rank %d", (long long)tx->h.version, d->rank);
}

/* The receiver's answer to an offer: it read the stage in place, or it wants the data. */
static rf_status on_answer(rf_weights_tx *tx, dest *d) {
    if (d->answer == SEND_DATA) return send_data(tx, d);
    tx->n_in_place += d->answer == READ_DONE;
    if (d->answer != READ_DONE)
        return rf_error(RF_ERR_FORMAT, "weights version %lld: rank %d answered %08x to the offer", (long long)tx->h.version, d->rank,
                        (unsigned)d->answer);
    return RF_OK;
}

/* Progresses destination d: 1 done, 0 not yet, -1 on an error (message set). */
static int dest_test(rf_weights_tx *tx, dest *d) {
    int a = test_req(&d->hdr), had_reply = d->reply != NULL, b = test_req(&d->reply);
    if (a < 0 || b < 0) return -1;
    if (had_reply && b > 0 && on_answer(tx, d) != RF_OK) return -1;
    int c = 1;
    for (size_t i = 0; i < d->n_data; i++) {
        int t = test_req(&d->data[i]);
        if (t < 0) return -1;
        c &= t > 0;
    }
    return a && b && c && !d->hdr && !d->reply;
}

/* Once, after the first transfer: how the weights travel. */
static void tell_path(rf_weights_tx *tx) {
    if (tx->told || tx->n == 0) return;
    tx->told = 1;
    rf_log_info("weights to %d rollout worker(s): %d read the stage in place (same host, one copy), %d through messages", tx->n,
                tx->n_in_place, tx->n - tx->n_in_place);
}

int rf_weights_tx_test(rf_weights_tx *tx) {
    int all = 1;
    for (int i = 0; i < tx->n; i++) {
        int t = dest_test(tx, &tx->d[i]);
        if (t < 0) return -1;
        all &= t;
    }
    if (all) tell_path(tx);
    return all;
}

/* Waits for *r (when there) at most timeout_s, then frees it. */
static rf_status wait_req(rf_comm_req **r, double timeout_s, const char *what) {
    if (!*r) return RF_OK;
    RF_TRY(rf_comm_wait(*r, timeout_s, what));
    rf_comm_req_free(*r), *r = NULL;
    return RF_OK;
}

rf_status rf_weights_tx_wait(rf_weights_tx *tx, double timeout_s) {
    char what[128];
    for (int i = 0; i < tx->n; i++) {
        dest *d = &tx->d[i];
        snprintf(what, sizeof what, "sending weights version %lld to rank %d", (long long)tx->h.version, d->rank);
        RF_TRY(wait_req(&d->hdr, timeout_s, what));
        if (d->reply) {
            snprintf(what, sizeof what, "waiting for rank %d to take weights version %lld", d->rank, (long long)tx->h.version);
            RF_TRY(wait_req(&d->reply, timeout_s, what));
            RF_TRY(on_answer(tx, d));
        }
        snprintf(what, sizeof what, "sending weights version %lld to rank %d", (long long)tx->h.version, d->rank);
        for (size_t k = 0; k < d->n_data; k++) RF_TRY(wait_req(&d->data[k], timeout_s, what));
        dest_free(d); /* everything done: the messages' table */
    }
    tell_path(tx);
    tx->n = 0;
    return RF_OK;
}

rf_status rf_weights_checksum(const rf_model *m, uint32_t *checksum) {
    return crc_of(m, m->n_frozen, m->n_params - m->n_frozen, checksum);
}

rf_status rf_weights_tx_start(rf_weights_tx *tx, rf_comm *c, const rf_model *m, int64_t version,
                              const int *dst, int n, double timeout_s, uint32_t *checksum) {
    if (n > MAX_DST) return rf_error(RF_ERR_ARG, "weights: %d destinations, at most %d", n, MAX_DST);
    if (m->n_params - m->n_frozen != tx->n_floats || m->n_frozen != tx->first)
        return rf_error(RF_ERR_ARG, "weights: the model changed size");
    RF_TRY(rf_weights_tx_wait(tx, timeout_s));
    size_t bytes = tx->n_floats * sizeof(float);
    m->k->to_host(tx->stage, m->params + tx->first, bytes);
    header h = {MAGIC, rf_crc32c(tx->stage, bytes), version, tx->n_floats, tx->first, tx->base_crc, 0, {0}};
    h.offer = tx->in_place && rf_shm_lookup(tx->stage, bytes, &h.stage);
    tx->h = h, tx->c = c, tx->n_in_place = 0;
    *checksum = h.checksum;
    const char *damage = getenv("RF_TEST_WEIGHTS_DAMAGE"); /* test hook: announce a wrong checksum */
    if (damage && *damage == '1') tx->h.checksum ^= 1u;
    for (int i = 0; i < n; i++) {
        dest *d = &tx->d[i];
        dest_free(d);
        *d = (dest){.rank = dst[i]};
        tx->n = i + 1;
        rf_status st = rf_comm_isend(c, &tx->h, sizeof tx->h, dst[i], RF_WEIGHTS_TAG, &d->hdr);
        if (st == RF_OK) st = h.offer ? rf_comm_irecv(c, &d->answer, sizeof d->answer, dst[i], REPLY_TAG, &d->reply) : send_data(tx, d);
        if (st != RF_OK) return rf_error_wrap(st, "sending weights version %lld to rank %d", (long long)version, dst[i]);
    }
    return RF_OK;
}

rf_status rf_weights_rx_init(rf_weights_rx **out, rf_comm *c, const rf_model *m, int src) {
    *out = NULL;
    rf_weights_rx *rx = calloc(1, sizeof *rx);
    if (!rx) return rf_error(RF_ERR_NOMEM, "out of memory");
    rx->c = c, rx->src = src, rx->timeout_s = 60, rx->in_place = 1, rx->first = m->n_frozen;
    rf_status st = crc_of(m, 0, rx->first, &rx->base_crc);
    if (st != RF_OK) {
        free(rx);
        return st;
    }
    *out = rx;
    return RF_OK;
}

void rf_weights_rx_set_in_place(rf_weights_rx *rx, int on) { rx->in_place = on; }

void rf_weights_rx_set_timeout(rf_weights_rx *rx, double timeout_s) { rx->timeout_s = timeout_s > 0 ? timeout_s : 60; }

void rf_weights_rx_free(rf_weights_rx *rx) {
    if (!rx) return;
    rf_shm_map_close(&rx->map);
    free(rx->buf);
    free(rx);
}

/* Receives `bytes` with `tag` from the sender into buf, bounded. */
static rf_status rx_recv(rf_weights_rx *rx, void *buf, size_t bytes, int tag, const char *what) {
    rf_comm_req *req = NULL;
    RF_TRY(rf_comm_irecv(rx->c, buf, bytes, rx->src, tag, &req));
    rf_status st = rf_comm_wait(req, rx->timeout_s, what);
    rf_comm_req_free(req);
    return st;
}

static rf_status rx_reply(rf_weights_rx *rx, int32_t answer, const char *what) {
    rf_comm_req *req = NULL;
    RF_TRY(rf_comm_isend(rx->c, &answer, sizeof answer, rx->src, REPLY_TAG, &req));
    rf_status st = rf_comm_wait(req, rx->timeout_s, what);
    rf_comm_req_free(req);
    return st;
}

/* 1 when the sender's stage is mapped here (kept from an earlier version or mapped now). */
static int rx_map(rf_weights_rx *rx, const rf_shm_ref *ref) {
    if (rx->map_refused) return 0; /* refused once: messages from then on, said once */
    if (rf_shm_map_keep(&rx->map, ref) == RF_OK) return 1;
    rx->map_refused = 1;
    rf_log_warn("weights from rank %d come through messages: %s", rx->src, rf_error_message());
    return 0;
}

/* Floats of the sender's stage read in place per pass into a model kept in bf16: 1 MB, so the
 * conversion reads what the checksum just brought into the cache. */
#define KEPT_CHUNK ((size_t)1 << 18)

/* n floats `from` (the sender's mapped stage) into a model kept in bf16 (rf_model_keep_bf16) at
 * float `first`: checksummed and written (rounded) a chunk at a time, no fp32 copy. *crc: their
 * CRC-32C. */
static rf_status take_kept(rf_model *m, size_t first, const float *from, size_t n, uint32_t *crc) {
    uint32_t c = 0;
    for (size_t a = 0; a < n; a += KEPT_CHUNK) {
        size_t k = n - a < KEPT_CHUNK ? n - a : KEPT_CHUNK;
        c = rf_crc32c_extend(c, from + a, k * sizeof(float));
        RF_TRY(rf_model_write_params(m, first + a, from + a, k));
    }
    *crc = c;
    return RF_OK;
}

/* The parameters' messages (DATA_CHUNK bytes each) received whole into rx->buf (made on first
 * use, kept), then checked and written into m. */
static rf_status recv_whole(rf_weights_rx *rx, rf_model *m, const header *h, const char *what, uint32_t *crc) {
    size_t bytes = h->n_floats * sizeof(float);
    if (!rx->buf && !(rx->buf = malloc(bytes + 1))) return rf_error(RF_ERR_NOMEM, "weights: out of memory");
    for (size_t i = 0, n = n_chunks(bytes); i < n; i++)
        RF_TRY(rx_recv(rx, (char *)rx->buf + i * DATA_CHUNK, chunk_len(bytes, i), DATA_TAG, what));
    *crc = rf_crc32c(rx->buf, bytes);
    return *crc == h->checksum ? rf_model_write_params(m, rx->first, rx->buf, h->n_floats) : RF_OK;
}

/* The parameters' messages into a model kept in bf16, one at a time through two buffers of
 * DATA_CHUNK bytes (the next message is received while this one is checksummed and rounded into
 * the store): no fp32 copy of the weights. */
static rf_status recv_kept(rf_weights_rx *rx, rf_model *m, const header *h, const char *what, uint32_t *crc) {
    size_t bytes = h->n_floats * sizeof(float), n = n_chunks(bytes);
    float *buf[2] = {malloc(DATA_CHUNK), malloc(DATA_CHUNK)};
    rf_comm_req *req[2] = {NULL, NULL};
    uint32_t c = 0;
    rf_status st = buf[0] && buf[1] ? RF_OK : rf_error(RF_ERR_NOMEM, "weights: out of memory");
    if (st == RF_OK) st = rf_comm_irecv(rx->c, buf[0], chunk_len(bytes, 0), rx->src, DATA_TAG, &req[0]);
    for (size_t i = 0; st == RF_OK && i < n; i++) {
        size_t a = i * DATA_CHUNK, len = chunk_len(bytes, i);
        st = rf_comm_wait(req[i & 1], rx->timeout_s, what);
        rf_comm_req_free(req[i & 1]), req[i & 1] = NULL;
        if (st == RF_OK && i + 1 < n)
            st = rf_comm_irecv(rx->c, buf[(i + 1) & 1], chunk_len(bytes, i + 1), rx->src, DATA_TAG, &req[(i + 1) & 1]);
        c = rf_crc32c_extend(c, buf[i & 1], len);
        if (st == RF_OK) st = rf_model_write_params(m, rx->first + a / sizeof(float), buf[i & 1], len / sizeof(float));
    }
    rf_comm_req_free(req[0]), rf_comm_req_free(req[1]);
    free(buf[0]), free(buf[1]);
    *crc = c;
    return st;
}

/* The parameters into m: read in place from the sender's stage (copy and checksum in one pass;
 * into a model kept in bf16, rounded into its store chunk by chunk), or received as messages
 * (recv_whole; recv_kept for a model kept in bf16, which holds no fp32 weights). *crc: what
 * arrived. */
static rf_status rx_take(rf_weights_rx *rx, rf_model *m, const header *h, uint32_t *crc) {
    size_t bytes = h->n_floats * sizeof(float);
    float *to = m->params + rx->first; /* under LoRA the adapters: the base stays */
    int cpu = strcmp(m->k->name, "cpu") == 0, kept = m->wbf16 != NULL;
    char what[128];
    snprintf(what, sizeof what, "receiving weights version %lld from rank %d", (long long)h->version, rx->src);
    if (h->offer && rx->in_place && rx_map(rx, &h->stage)) {
        const float *from = (const float *)((const char *)rx->map.base + h->stage.offset);
        if (kept) {
            RF_TRY(take_kept(m, rx->first, from, h->n_floats, crc));
            return rx_reply(rx, READ_DONE, what);
        }
        if (!cpu && !rx->buf && !(rx->buf = malloc(bytes + 1))) return rf_error(RF_ERR_NOMEM, "weights: out of memory");
        *crc = rf_crc32c_copy(0, cpu ? to : rx->buf, from, bytes);
        RF_TRY(rx_reply(rx, READ_DONE, what));
        if (!cpu) m->k->to_device(to, rx->buf, bytes);
        return RF_OK;
    }
    if (h->offer) RF_TRY(rx_reply(rx, SEND_DATA, what));
    return kept ? recv_kept(rx, m, h, what, crc) : recv_whole(rx, m, h, what, crc);
}

rf_status rf_weights_rx_poll(rf_weights_rx *rx, rf_model *m, int *arrived, int64_t *version,
                             uint32_t *checksum) {
    *arrived = 0;
    /* nothing is posted until a transfer is there; then it is received at once, the sender
     * being busy sending it (a posted receive would progress only between decode steps) */
    int t = rf_comm_iprobe(rx->c, rx->src, RF_WEIGHTS_TAG);
    if (t < 0) return rf_error_wrap(RF_ERR_IO, "receiving weights from rank %d", rx->src);
    if (!t) return RF_OK;
    char what[96];
    snprintf(what, sizeof what, "receiving weights from rank %d", rx->src);
    header h;
    RF_TRY(rx_recv(rx, &h, sizeof h, RF_WEIGHTS_TAG, what));
    if (h.magic != MAGIC || h.n_floats != m->n_params - rx->first || h.first != rx->first)
        return rf_error(RF_ERR_FORMAT, "weights from rank %d: not a transfer for this model (magic %08x, %llu parameters "
                        "after %llu frozen ones, the model has %zu after %zu)", rx->src, h.magic,
                        (unsigned long long)h.n_floats, (unsigned long long)h.first, m->n_params - rx->first, rx->first);
    /* LoRA: the adapters are only right on the base they were trained on */
    if (h.base_crc != rx->base_crc)
        return rf_error(RF_ERR_FORMAT, "weights version %lld from rank %d: the training worker's frozen base weights "
                        "(CRC-32C %08x of %zu floats) are not this worker's (%08x): both must load the same model.path",
                        (long long)h.version, rx->src, h.base_crc, rx->first, rx->base_crc);
    uint32_t crc = 0;
    RF_TRY(rx_take(rx, m, &h, &crc));
    if (crc != h.checksum)
        return rf_error(RF_ERR_FORMAT, "weights version %lld from rank %d arrived damaged: CRC-32C %08x, sent as %08x",
                        (long long)h.version, rx->src, crc, h.checksum);
    *arrived = 1, *version = h.version, *checksum = crc;
    return RF_OK;
}
