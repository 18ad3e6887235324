/* The staleness-bounded buffer between generation and training (DESIGN.md section 1).
 *
 * Versions: the trainer at version v (v updates done) trains batch v. A sample's staleness at
 * consumption is v - (the policy version of its oldest token). With max_staleness = k:
 *   - consumption: batch v takes only groups whose oldest token is at version >= v - k; an
 *     older group is dropped (counted: with admission control it only happens to a group that
 *     finished much later than the ones admitted after it);
 *   - admission: a prompt group is admitted only when the batch it will land in, counting the
 *     groups ahead of it (trained, buffered or in flight), is within k versions of the
 *     weights the rollout workers serve now: (consumed + pending) / batch_groups <= served + k.
 *     Its tokens are at least at version `served`, so it can still be consumed; nothing is
 *     generated only to be thrown away. k = 0 is synchronous on-policy RL;
 *   - capacity: at most `capacity` groups are admitted and not yet consumed.
 * Batches stream: they are formed from the complete groups, the most at-risk first (oldest
 * token version, then admission order), so a slow group does not hold a batch back, unless
 * that slow group could not wait for the next batch (admitted at version <= v - k): then the
 * batch waits for it. Together with admission control this means no group is ever dropped as
 * stale; the drop path remains as a guard and is counted.
 *
 * The buffer holds opaque group pointers with their admission id and oldest token version;
 * the controller owns the groups. Not thread safe. */
#ifndef RF_BUFFER_H
#define RF_BUFFER_H

#include <stdint.h>

#include "common/status.h"

typedef struct rf_buffer rf_buffer;

/* batch_groups (>= 1) groups form one training batch; capacity (>= batch_groups) bounds the
 * groups admitted and not consumed; k >= 0. */
rf_status rf_buffer_init(rf_buffer **b, int batch_groups, int capacity, int max_staleness);
void rf_buffer_free(rf_buffer *b);

/* A run resumed at version v: v batches count as consumed already, and admission ids go on
 * from `admitted` (the checkpoint's admission count: groups dynamic sampling or the staleness
 * bound dropped took ids too), or from v x P when it is 0 (older checkpoints). Call before
 * admitting. */
void rf_buffer_resume_at(rf_buffer *b, int v, int64_t admitted);

/* The id the next admitted group gets (= groups admitted so far). */
int64_t rf_buffer_next_id(const rf_buffer *b);

/* The i-th buffered group (0 <= i < rf_buffer_depth), in id order; owned by the buffer. */
void *rf_buffer_at(const rf_buffer *b, int i);

/* 1 when one more group may be admitted while the rollout workers serve version `served`. */
int rf_buffer_can_admit(const rf_buffer *b, int served);

/* Records an admission while the workers serve version `served`; returns the group's
 * admission id (0, 1, 2, ...). */
int64_t rf_buffer_admit(rf_buffer *b, int served);

/* Group `id`, admitted earlier, will not reach the buffer (dropped by dynamic sampling). */
void rf_buffer_discard(rf_buffer *b, int64_t id);

/* A complete, scored group arrives: its admission id and the version of its oldest token. */
rf_status rf_buffer_put(rf_buffer *b, void *group, int64_t id, int min_version);

/* Groups buffered now, and those admitted but not yet put. */
int rf_buffer_depth(const rf_buffer *b);
int rf_buffer_in_flight(const rf_buffer *b);

/* When batch_groups eligible groups are buffered for the trainer at version v and no group
 * in flight must go into this batch: moves them into out (batch_groups pointers), counts them
 * consumed and returns 1. Groups too stale for v are removed first: their pointers go to stale (up to stale_cap;
 * *n_stale counts them) for the caller to free. Returns 0 (nothing taken) otherwise. */
int rf_buffer_take(rf_buffer *b, int v, void **out, void **stale, int stale_cap, int *n_stale);

/* Groups consumed by training so far, and groups dropped as too stale. */
int64_t rf_buffer_consumed(const rf_buffer *b);
int64_t rf_buffer_stale_dropped(const rf_buffer *b);

#endif
