/* The ZAP handler thread of a CURVE message server (see common/msg_zap.h). */
#define _POSIX_C_SOURCE 200809L
#include "common/msg_zap.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/util.h"

#define MAX_PENDING 16
#define TEXT_LEN 768

struct rf_msg_zap {
    void *sock;                   /* REP bound to inproc://zeromq.zap.01; the thread's */
    pthread_t thread;
    atomic_int stop;
    rf_curve_key *keys;           /* (n_keys) allowed client public keys */
    int n_keys;
    pthread_mutex_t mu;           /* guards what follows */
    char endpoint[256];
    char pending[MAX_PENDING][TEXT_LEN];  /* refusals not reported yet, oldest first */
    int n_pending;
    char last[TEXT_LEN];          /* the last refusal queued, and when */
    double last_at;
};

static int frame_is(zmq_msg_t *m, const char *s) {
    return zmq_msg_size(m) == strlen(s) && !memcmp(zmq_msg_data(m), s, strlen(s));
}

/* Queues a refusal unless the same one was queued in the last 10 s (or the queue is full). */
static void queue_refusal(rf_msg_zap *z, const char *text) {
    double now = rf_time_now();
    pthread_mutex_lock(&z->mu);
    if ((strcmp(text, z->last) || now - z->last_at >= 10) && z->n_pending < MAX_PENDING) {
        snprintf(z->pending[z->n_pending++], TEXT_LEN, "%s", text);
        snprintf(z->last, sizeof z->last, "%s", text);
        z->last_at = now;
    }
    pthread_mutex_unlock(&z->mu);
}

/* One request (RFC 27: version, request id, domain, address, identity, mechanism, credentials;
 * CURVE's credential is the client's 32-byte public key) and its reply. Every request gets a
 * reply: the REP socket and the peer's handshake wait for it. */
static void answer(rf_msg_zap *z) {
    zmq_msg_t f[8];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 8) f[n++] = m;
        else zmq_msg_close(&m);
    }
    if (n == 0) return;
    char key[RF_CURVE_KEY_LEN + 1] = "", addr[64] = "?";
    int ok = 0, curve = n >= 7 && frame_is(&f[0], "1.0") && frame_is(&f[5], "CURVE") &&
                        zmq_msg_size(&f[6]) == 32;
    if (curve) {
        zmq_z85_encode(key, zmq_msg_data(&f[6]), 32);
        for (int i = 0; i < z->n_keys && !ok; i++) ok = !strcmp(z->keys[i], key);
    }
    if (n >= 4 && zmq_msg_size(&f[3]) > 0 && zmq_msg_size(&f[3]) < sizeof addr) {
        memcpy(addr, zmq_msg_data(&f[3]), zmq_msg_size(&f[3]));
        addr[zmq_msg_size(&f[3])] = '\0';
    }
    const char *status = ok ? "200" : "400", *why = ok ? "OK" : "not an allowed client key";
    zmq_send(z->sock, "1.0", 3, ZMQ_SNDMORE);
    if (n >= 2) zmq_send(z->sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
    else zmq_send(z->sock, "", 0, ZMQ_SNDMORE);
    zmq_send(z->sock, status, 3, ZMQ_SNDMORE);
    zmq_send(z->sock, why, strlen(why), ZMQ_SNDMORE);
    zmq_send(z->sock, "", 0, ZMQ_SNDMORE);  /* user id */
    zmq_send(z->sock, "", 0, 0);            /* metadata */
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
    if (ok) return;
    char text[TEXT_LEN], endpoint[256];
    pthread_mutex_lock(&z->mu);
    snprintf(endpoint, sizeof endpoint, "%s", z->endpoint);
    pthread_mutex_unlock(&z->mu);
    if (curve)
        snprintf(text, sizeof text, "refused a connection to %s from %s: its CURVE public key %s "
                 "is not among the %d client keys this endpoint allows", endpoint, addr, key,
                 z->n_keys);
    else
        snprintf(text, sizeof text, "refused a connection to %s from %s: a malformed ZAP request "
                 "(%d frames)", endpoint, addr, n);
    queue_refusal(z, text);
}

static void *zap_main(void *arg) {
    rf_msg_zap *z = arg;
    while (!atomic_load(&z->stop)) {
        zmq_pollitem_t it = {z->sock, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, 100);
        if (rc > 0) answer(z);
        else if (rc < 0 && zmq_errno() == ETERM) break;
    }
    zmq_close(z->sock);
    z->sock = NULL;
    return NULL;
}

rf_status rf_msg_zap_start(rf_msg_zap **out, void *ctx, const char *endpoint,
                           const rf_curve_key *keys, int n) {
    *out = NULL;
    rf_msg_zap *z = rf_calloc(1, sizeof *z);
    if (!z || !(z->keys = rf_calloc((size_t)n, sizeof *z->keys))) {
        free(z);
        return rf_error(RF_ERR_NOMEM, "message server %s: out of memory for its ZAP handler",
                        endpoint);
    }
    memcpy(z->keys, keys, sizeof *keys * (size_t)n);
    z->n_keys = n;
    snprintf(z->endpoint, sizeof z->endpoint, "%s", endpoint);
    pthread_mutex_init(&z->mu, NULL);
    z->sock = zmq_socket(ctx, ZMQ_REP);
    int zero = 0;
    if (z->sock) zmq_setsockopt(z->sock, ZMQ_LINGER, &zero, sizeof zero);
    rf_status st = RF_OK;
    if (!z->sock || zmq_bind(z->sock, "inproc://zeromq.zap.01") != 0)
        st = rf_error(RF_ERR_IO, "message server %s: cannot bind the ZAP handler "
                                 "inproc://zeromq.zap.01: %s%s", endpoint,
                      zmq_strerror(zmq_errno()),
                      zmq_errno() == EADDRINUSE ? " (another CURVE server uses this ZeroMQ "
                                                  "context; give each its own)" : "");
    else if (pthread_create(&z->thread, NULL, zap_main, z) != 0)
        st = rf_error(RF_ERR_IO, "message server %s: cannot start its ZAP thread", endpoint);
    if (st != RF_OK) {
        if (z->sock) zmq_close(z->sock);
        pthread_mutex_destroy(&z->mu);
        free(z->keys);
        free(z);
        return st;
    }
    *out = z;
    return RF_OK;
}

void rf_msg_zap_set_endpoint(rf_msg_zap *z, const char *endpoint) {
    pthread_mutex_lock(&z->mu);
    snprintf(z->endpoint, sizeof z->endpoint, "%s", endpoint);
    pthread_mutex_unlock(&z->mu);
}

int rf_msg_zap_refusal(rf_msg_zap *z, char *text, size_t cap) {
    pthread_mutex_lock(&z->mu);
    int got = z->n_pending > 0;
    if (got) {
        snprintf(text, cap, "%s", z->pending[0]);
        memmove(z->pending[0], z->pending[1], sizeof z->pending[0] * (size_t)(--z->n_pending));
    }
    pthread_mutex_unlock(&z->mu);
    return got;
}

void rf_msg_zap_stop(rf_msg_zap *z) {
    if (!z) return;
    atomic_store(&z->stop, 1);
    pthread_join(z->thread, NULL);
    pthread_mutex_destroy(&z->mu);
    free(z->keys);
    free(z);
}
