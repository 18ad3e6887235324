/* The staleness-bounded buffer: admission arithmetic for k = 0, 1, 2; streaming batches that
 * take the most at-risk complete groups first; a batch that waits for a group in flight that
 * could not wait for the next one; the stale guard; argument errors. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "controller/buffer.h"
#include "test_util.h"

static int tag[64];

/* Admits as many groups as the buffer allows while `served` is served; returns how many. */
static int admit_all(rf_buffer *b, int served, int64_t *ids) {
    int n = 0;
    while (rf_buffer_can_admit(b, served) && n < 64) ids[n] = rf_buffer_admit(b, served), n++;
    return n;
}

static void synchronous(void) {
    rf_buffer *b;
    CHECK(rf_buffer_init(&b, 2, 2, 0) == RF_OK);
    int64_t ids[64];
    CHECK(admit_all(b, -1, ids) == 0);   /* no weights served yet */
    CHECK(admit_all(b, 0, ids) == 2);    /* batch 0 */
    CHECK(ids[0] == 0 && ids[1] == 1);
    void *out[2], *stale[4];
    int ns;
    CHECK(rf_buffer_put(b, &tag[0], 0, 0) == RF_OK);
    CHECK(rf_buffer_take(b, 0, out, stale, 4, &ns) == 0); /* one group still in flight */
    CHECK(rf_buffer_put(b, &tag[1], 1, 0) == RF_OK);
    CHECK(rf_buffer_take(b, 0, out, stale, 4, &ns) == 1 && ns == 0);
    CHECK(out[0] == &tag[0] && out[1] == &tag[1]);
    CHECK(rf_buffer_consumed(b) == 2 && rf_buffer_depth(b) == 0 && rf_buffer_in_flight(b) == 0);
    /* batch 1 waits for version 1 to be served: synchronous on-policy */
    CHECK(admit_all(b, 0, ids) == 0);
    CHECK(admit_all(b, 1, ids) == 2);
    rf_buffer_free(b);
}

static void one_ahead(void) {
    rf_buffer *b;
    CHECK(rf_buffer_init(&b, 2, 8, 1) == RF_OK);
    int64_t ids[64];
    CHECK(admit_all(b, 0, ids) == 4);  /* batches 0 and 1 while version 0 is served */
    CHECK(admit_all(b, 1, ids) == 2);  /* batch 2 once version 1 is */
    rf_buffer_free(b);
    CHECK(rf_buffer_init(&b, 2, 3, 2) == RF_OK);
    CHECK(admit_all(b, 0, ids) == 3);  /* k = 2 would allow 6: the capacity stops it at 3 */
    rf_buffer_free(b);
    /* resumed at version 50: the bound counts from there */
    CHECK(rf_buffer_init(&b, 2, 64, 1) == RF_OK);
    rf_buffer_resume_at(b, 50, 0);
    CHECK(admit_all(b, 48, ids) == 0);
    CHECK(admit_all(b, 49, ids) == 2);  /* batch 50 may be one version stale */
    CHECK(admit_all(b, 50, ids) == 2);  /* batch 51 */
    CHECK(rf_buffer_consumed(b) == 100);
    rf_buffer_free(b);
}

static void streaming(void) {
    rf_buffer *b;
    CHECK(rf_buffer_init(&b, 2, 8, 1) == RF_OK);
    int64_t ids[64];
    CHECK(admit_all(b, 0, ids) == 4);
    void *out[2], *stale[8];
    int ns;
    /* groups 1 and 2 finish first; group 0 (admitted at version 0) may wait for batch 1 */
    CHECK(rf_buffer_put(b, &tag[1], 1, 0) == RF_OK);
    CHECK(rf_buffer_put(b, &tag[2], 2, 0) == RF_OK);
    CHECK(rf_buffer_take(b, 0, out, stale, 8, &ns) == 1);
    CHECK(out[0] == &tag[1] && out[1] == &tag[2]);
    /* batch 1: group 3 done, group 0 still in flight and too old for batch 2: wait for it */
    CHECK(rf_buffer_put(b, &tag[3], 3, 1) == RF_OK);
    CHECK(admit_all(b, 1, ids) == 2); /* groups 4, 5 for batch 2 */
    CHECK(rf_buffer_put(b, &tag[4], 4, 1) == RF_OK);
    CHECK(rf_buffer_take(b, 1, out, stale, 8, &ns) == 0);
    CHECK(rf_buffer_put(b, &tag[0], 0, 0) == RF_OK);
    CHECK(rf_buffer_take(b, 1, out, stale, 8, &ns) == 1 && ns == 0);
    /* most at risk first: group 0 (version 0), then the oldest of version 1 */
    CHECK(out[0] == &tag[0] && out[1] == &tag[3]);
    CHECK(rf_buffer_stale_dropped(b) == 0 && rf_buffer_depth(b) == 1 && rf_buffer_in_flight(b) == 1);
    rf_buffer_free(b);
}

static void stale_guard(void) {
    rf_buffer *b;
    CHECK(rf_buffer_init(&b, 1, 4, 1) == RF_OK);
    int64_t id = rf_buffer_admit(b, 0), id2 = rf_buffer_admit(b, 0);
    void *out[1], *stale[4];
    int ns;
    CHECK(rf_buffer_put(b, &tag[0], id, 0) == RF_OK);
    CHECK(rf_buffer_put(b, &tag[1], id2, 2) == RF_OK);
    /* at version 2 with k = 1 a group whose oldest token is version 0 is too stale */
    CHECK(rf_buffer_take(b, 2, out, stale, 4, &ns) == 1);
    CHECK(ns == 1 && stale[0] == &tag[0] && out[0] == &tag[1]);
    CHECK(rf_buffer_stale_dropped(b) == 1 && rf_buffer_consumed(b) == 1);
    /* discard frees the slot of a group that never arrives */
    int64_t id3 = rf_buffer_admit(b, 3);
    CHECK(rf_buffer_in_flight(b) == 1);
    rf_buffer_discard(b, id3);
    CHECK(rf_buffer_in_flight(b) == 0);
    rf_buffer_free(b);
}

static void errors(void) {
    rf_buffer *b = (rf_buffer *)1;
    CHECK(rf_buffer_init(&b, 4, 2, 0) == RF_ERR_ARG && b == NULL);
    CHECK(strstr(rf_error_message(), "capacity >= batch_groups (got 2)") != NULL);
    CHECK(rf_buffer_init(&b, 1, 2, -1) == RF_ERR_ARG);
    CHECK(rf_buffer_init(&b, 1, 1, 0) == RF_OK);
    rf_buffer_admit(b, 0);
    CHECK(rf_buffer_put(b, &tag[0], 0, 0) == RF_OK);
    CHECK(rf_buffer_put(b, &tag[1], 1, 0) == RF_ERR_RANGE);
    rf_buffer_free(b);
}

int main(void) {
    synchronous();
    one_ahead();
    streaming();
    stale_guard();
    errors();
    return rf_test_finish("test_buffer");
}
