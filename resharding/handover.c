/* The weights handed between the training rank and the rollout rank of one process. */
#define _POSIX_C_SOURCE 200809L
#include "resharding/handover.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/util.h"

rf_status rf_handover_init(rf_handover *h) {
    memset(h, 0, sizeof *h);
    h->version = -1;
    if (pthread_mutex_init(&h->mu, NULL) != 0) return rf_error(RF_ERR_INTERNAL, "weights handover: pthread_mutex_init failed");
    pthread_condattr_t a;
    int ok = pthread_condattr_init(&a) == 0;
    ok = ok && pthread_condattr_setclock(&a, CLOCK_MONOTONIC) == 0 && pthread_cond_init(&h->cv, &a) == 0;
    pthread_condattr_destroy(&a);
    if (!ok) {
        pthread_mutex_destroy(&h->mu);
        return rf_error(RF_ERR_INTERNAL, "weights handover: pthread_cond_init failed");
    }
    return RF_OK;
}

void rf_handover_free(rf_handover *h) {
    if (!h) return;
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
}

void rf_handover_fail(rf_handover *h, const char *who) {
    pthread_mutex_lock(&h->mu);
    if (!h->failed) snprintf(h->why, sizeof h->why, "%s stopped: %s", who, rf_error_message());
    h->failed = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

/* Waits on h->cv until `deadline` (rf_time_now's clock); 0 when it passed. Called locked. */
static int wait_until(rf_handover *h, double deadline) {
    double left = deadline - rf_time_now();
    if (left <= 0) return 0;
    if (left > 0.05) left = 0.05; /* wake up now and then: the clocks may differ in their epoch */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)(left * 1e9);
    ts.tv_sec += ts.tv_nsec / 1000000000L, ts.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    return 1;
}

/* The error of a wait that ended on the other role's failure (called locked). */
static rf_status failed(const rf_handover *h) { return rf_error(RF_ERR_IO, "weights handover: %s", h->why); }

void rf_handover_offer_dst(rf_handover *h, float *dst) {
    pthread_mutex_lock(&h->mu);
    h->dst = dst;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

rf_status rf_handover_wait_dst(rf_handover *h, double timeout_s, float **dst) {
    double deadline = rf_time_now() + timeout_s;
    rf_status st = RF_OK;
    pthread_mutex_lock(&h->mu);
    while (!h->dst && !h->failed)
        if (!wait_until(h, deadline)) break;
    if (h->failed) st = failed(h);
    else if (!h->dst)
        st = rf_error(RF_ERR_IO, "weights handover: the rollout rank of this process did not make its model within %g s",
                      timeout_s);
    *dst = h->dst;
    pthread_mutex_unlock(&h->mu);
    return st;
}

rf_status rf_handover_write_begin(rf_handover *h, double timeout_s) {
    double deadline = rf_time_now() + timeout_s;
    rf_status st = RF_OK;
    pthread_mutex_lock(&h->mu);
    while (h->readers > 0 && !h->failed)
        if (!wait_until(h, deadline)) break;
    if (h->failed) st = failed(h);
    else if (h->readers > 0)
        st = rf_error(RF_ERR_IO, "weights handover: the rollout rank of this process was still in a generation step %g s "
                      "after the training rank began its update", timeout_s);
    else h->writing = 1;
    pthread_mutex_unlock(&h->mu);
    return st;
}

void rf_handover_publish(rf_handover *h, int64_t version, uint32_t crc, float *src) {
    pthread_mutex_lock(&h->mu);
    h->writing = 0;
    h->version = version, h->crc = crc, h->src = src;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

rf_status rf_handover_read_begin(rf_handover *h) {
    rf_status st = RF_OK;
    pthread_mutex_lock(&h->mu);
    if (h->failed) st = failed(h);
    else if (h->writing)
        st = rf_error(RF_ERR_INTERNAL, "weights handover: a generation step began while the training rank of this process "
                      "was updating the weights after version %lld (the controller lets no generation overlap training "
                      "in a colocated run)", (long long)h->version);
    else h->readers++;
    pthread_mutex_unlock(&h->mu);
    return st;
}

void rf_handover_read_end(rf_handover *h) {
    pthread_mutex_lock(&h->mu);
    h->readers--;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

int64_t rf_handover_latest(rf_handover *h, uint32_t *crc, float **src) {
    pthread_mutex_lock(&h->mu);
    int64_t v = h->version;
    if (crc) *crc = h->crc;
    if (src) *src = h->src;
    pthread_mutex_unlock(&h->mu);
    return v;
}

rf_status rf_handover_wait_version(rf_handover *h, int64_t v, double timeout_s, const char *what, uint32_t *crc,
                                   float **src) {
    double deadline = rf_time_now() + timeout_s;
    rf_status st = RF_OK;
    pthread_mutex_lock(&h->mu);
    while (h->version < v && !h->failed)
        if (!wait_until(h, deadline)) break;
    if (h->version >= v) {
        if (crc) *crc = h->crc;
        if (src) *src = h->src;
    } else if (h->failed) {
        st = failed(h);
    } else {
        st = rf_error(RF_ERR_IO, "%s: weights version %lld not handed over by the training rank of this process within "
                      "%g s (it has %lld)", what, (long long)v, timeout_s, (long long)h->version);
    }
    pthread_mutex_unlock(&h->mu);
    return st;
}
