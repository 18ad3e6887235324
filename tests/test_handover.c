/* The weights handover between a colocated process's training and rollout threads
 * (resharding/handover.h), with real threads:
 *   - versions: none before the first publish; latest and wait_version see what was published;
 *   - the writer waits for a generation step in progress to end (a reader thread ending it
 *     0.1 s later), and a step that begins while the writer holds the weights is refused with
 *     the exact error (no torn weights); readers are counted, so two steps must both end;
 *   - bounded: a step that never ends, a version that never comes and a buffer never offered
 *     are errors naming the wait within their timeouts;
 *   - a failure on one side wakes the other at once with its message;
 *   - the rollout side's buffer offered from another thread reaches the writer. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>

#include "common/util.h"
#include "resharding/handover.h"
#include "test_util.h"

typedef struct job {
    rf_handover *h;
    double delay;
    int64_t version;
    float *dst;
} job;

static void *end_step_later(void *arg) {
    job *j = arg;
    rf_sleep(j->delay);
    rf_handover_read_end(j->h);
    return NULL;
}

static void *publish_later(void *arg) {
    job *j = arg;
    rf_sleep(j->delay);
    rf_handover_publish(j->h, j->version, 0xabcd1234u, NULL);
    return NULL;
}

static void *offer_later(void *arg) {
    job *j = arg;
    rf_sleep(j->delay);
    rf_handover_offer_dst(j->h, j->dst);
    return NULL;
}

static void *fail_later(void *arg) {
    job *j = arg;
    rf_sleep(j->delay);
    rf_error(RF_ERR_IO, "the controller stopped the run");
    rf_handover_fail(j->h, "the training rank of this process");
    return NULL;
}

static void versions(void) {
    rf_handover h;
    CHECK_OK(rf_handover_init(&h));
    uint32_t crc = 0;
    float *src = NULL, buf[4];
    CHECK(rf_handover_latest(&h, &crc, &src) == -1);
    rf_handover_publish(&h, 0, 0x11u, buf);
    CHECK(rf_handover_latest(&h, &crc, &src) == 0 && crc == 0x11u && src == buf);
    /* a later version published from another thread wakes the waiter */
    job j = {&h, 0.1, 3, NULL};
    pthread_t t;
    pthread_create(&t, NULL, publish_later, &j);
    double t0 = rf_time_now();
    CHECK_OK(rf_handover_wait_version(&h, 3, 5.0, "test", &crc, &src));
    double waited = rf_time_now() - t0;
    CHECK(crc == 0xabcd1234u && src == NULL && waited >= 0.09 && waited < 2.0);
    pthread_join(t, NULL);
    /* one that never comes: an error within its bound */
    t0 = rf_time_now();
    CHECK_ERR(rf_handover_wait_version(&h, 4, 0.2, "rollout tensor parallelism", &crc, &src), RF_ERR_IO,
              "rollout tensor parallelism: weights version 4 not handed over by the training rank of this process within "
              "0.2 s (it has 3)");
    CHECK(rf_time_now() - t0 < 1.0);
    rf_handover_free(&h);
}

static void turns(void) {
    rf_handover h;
    CHECK_OK(rf_handover_init(&h));
    /* two steps in progress; the writer waits until both end */
    CHECK_OK(rf_handover_read_begin(&h));
    CHECK_OK(rf_handover_read_begin(&h));
    rf_handover_read_end(&h);
    job j = {&h, 0.1, 0, NULL};
    pthread_t t;
    pthread_create(&t, NULL, end_step_later, &j);
    double t0 = rf_time_now();
    CHECK_OK(rf_handover_write_begin(&h, 5.0));
    double waited = rf_time_now() - t0;
    printf("the writer waited %.3f s for the step to end\n", waited);
    CHECK(waited >= 0.09 && waited < 2.0);
    pthread_join(t, NULL);
    /* a step while the weights are written: refused, nothing counted */
    CHECK_ERR(rf_handover_read_begin(&h), RF_ERR_INTERNAL,
              "weights handover: a generation step began while the training rank of this process was updating the "
              "weights after version -1 (the controller lets no generation overlap training in a colocated run)");
    CHECK_OK(rf_handover_write_begin(&h, 0.1)); /* again while holding them: a no-op */
    rf_handover_publish(&h, 0, 1u, NULL);
    CHECK_OK(rf_handover_read_begin(&h)); /* released by publish */
    /* a step that never ends: the writer's wait is bounded */
    t0 = rf_time_now();
    CHECK_ERR(rf_handover_write_begin(&h, 0.2), RF_ERR_IO,
              "weights handover: the rollout rank of this process was still in a generation step 0.2 s after the training "
              "rank began its update");
    CHECK(rf_time_now() - t0 < 1.0);
    rf_handover_read_end(&h);
    CHECK_OK(rf_handover_write_begin(&h, 0.1));
    rf_handover_publish(&h, 1, 2u, NULL);
    rf_handover_free(&h);
}

static void buffers_and_failures(void) {
    rf_handover h;
    CHECK_OK(rf_handover_init(&h));
    float *dst = NULL, buf[8];
    CHECK_ERR(rf_handover_wait_dst(&h, 0.1, &dst), RF_ERR_IO,
              "weights handover: the rollout rank of this process did not make its model within 0.1 s");
    job j = {&h, 0.05, 0, buf};
    pthread_t t;
    pthread_create(&t, NULL, offer_later, &j);
    CHECK_OK(rf_handover_wait_dst(&h, 5.0, &dst));
    CHECK(dst == buf);
    pthread_join(t, NULL);
    /* the training side fails while the rollout side waits for a version: it wakes at once */
    job f = {&h, 0.1, 0, NULL};
    pthread_create(&t, NULL, fail_later, &f);
    double t0 = rf_time_now();
    uint32_t crc;
    CHECK_ERR(rf_handover_wait_version(&h, 0, 30.0, "test", &crc, NULL), RF_ERR_IO,
              "weights handover: the training rank of this process stopped: the controller stopped the run");
    CHECK(rf_time_now() - t0 < 2.0);
    pthread_join(t, NULL);
    /* and every later wait or step says so too; the first failure's message is kept */
    rf_error(RF_ERR_IO, "something later");
    rf_handover_fail(&h, "the rollout rank of this process");
    CHECK_ERR(rf_handover_read_begin(&h), RF_ERR_IO, "the training rank of this process stopped: the controller stopped");
    CHECK_ERR(rf_handover_write_begin(&h, 5.0), RF_ERR_IO, "the training rank of this process stopped");
    rf_handover_free(&h);
}

int main(void) {
    versions();
    turns();
    buffers_and_failures();
    return rf_test_finish("test_handover");
}
