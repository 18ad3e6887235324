/* The staleness-bounded buffer: admission arithmetic and an array of complete groups kept in
 * admission order. */
#include <stdlib.h>
#include <string.h>

#include "controller/buffer.h"

typedef struct slot {
    void *group;
    int64_t id;
    int min_version;
} slot;

typedef struct flight {
    int64_t id;
    int version; /* served when admitted: a lower bound of the group's oldest token version */
} flight;

struct rf_buffer {
    int P, cap, k;
    int64_t next_id, consumed, stale;
    int pending;   /* admitted, not consumed or discarded (in flight + buffered) */
    slot *s;       /* (n) buffered, sorted by id */
    int n;
    flight *f;     /* (nf) in flight, by admission */
    int nf;
};

static void flight_remove(rf_buffer *b, int64_t id) {
    for (int i = 0; i < b->nf; i++)
        if (b->f[i].id == id) {
            memmove(b->f + i, b->f + i + 1, sizeof *b->f * (size_t)(b->nf - i - 1));
            b->nf--;
            return;
        }
}

rf_status rf_buffer_init(rf_buffer **out, int batch_groups, int capacity, int max_staleness) {
    *out = NULL;
    if (batch_groups < 1 || capacity < batch_groups || max_staleness < 0)
        return rf_error(RF_ERR_ARG, "buffer: need batch_groups >= 1 (got %d), capacity >= batch_groups (got %d), max_staleness >= 0 (got %d)",
                        batch_groups, capacity, max_staleness);
    rf_buffer *b = calloc(1, sizeof *b);
    if (b) b->s = calloc((size_t)capacity, sizeof *b->s), b->f = calloc((size_t)capacity, sizeof *b->f);
    if (!b || !b->s || !b->f) {
        if (b) free(b->s), free(b->f);
        free(b);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    b->P = batch_groups, b->cap = capacity, b->k = max_staleness;
    *out = b;
    return RF_OK;
}

void rf_buffer_free(rf_buffer *b) {
    if (!b) return;
    free(b->s), free(b->f);
    free(b);
}

/* Admission ids go on from where the run stopped, as if it had not: a group's id seeds its
 * sampling (controller.c), so a resumed run draws what the uninterrupted one would have. */
void rf_buffer_resume_at(rf_buffer *b, int v, int64_t admitted) {
    b->consumed = (int64_t)v * b->P;
    b->next_id = admitted > 0 ? admitted : b->consumed;
}

int64_t rf_buffer_next_id(const rf_buffer *b) { return b->next_id; }

int rf_buffer_can_admit(const rf_buffer *b, int served) {
    if (b->pending >= b->cap) return 0;
    int64_t batch = (b->consumed + b->pending) / b->P;
    return batch <= (int64_t)served + b->k;
}

int64_t rf_buffer_admit(rf_buffer *b, int served) {
    if (b->nf < b->cap) b->f[b->nf++] = (flight){b->next_id, served};
    b->pending++;
    return b->next_id++;
}

void rf_buffer_discard(rf_buffer *b, int64_t id) {
    flight_remove(b, id);
    if (b->pending > 0) b->pending--;
}

rf_status rf_buffer_put(rf_buffer *b, void *group, int64_t id, int min_version) {
    if (b->n >= b->cap) return rf_error(RF_ERR_RANGE, "buffer: full (%d groups)", b->cap);
    flight_remove(b, id);
    int i = b->n;
    while (i > 0 && b->s[i - 1].id > id) {
        b->s[i] = b->s[i - 1];
        i--;
    }
    b->s[i] = (slot){group, id, min_version};
    b->n++;
    return RF_OK;
}

int rf_buffer_depth(const rf_buffer *b) { return b->n; }
void *rf_buffer_at(const rf_buffer *b, int i) { return i >= 0 && i < b->n ? b->s[i].group : NULL; }
int rf_buffer_in_flight(const rf_buffer *b) { return b->pending - b->n; }
int64_t rf_buffer_consumed(const rf_buffer *b) { return b->consumed; }
int64_t rf_buffer_stale_dropped(const rf_buffer *b) { return b->stale; }

/* Most at risk first: oldest token version, then admission order. */
static int at_risk_first(const slot *a, const slot *b) {
    if (a->min_version != b->min_version) return a->min_version < b->min_version;
    return a->id < b->id;
}

int rf_buffer_take(rf_buffer *b, int v, void **out, void **stale, int stale_cap, int *n_stale) {
    *n_stale = 0;
    int j = 0;
    for (int i = 0; i < b->n; i++) {
        if (b->s[i].min_version < v - b->k) {
            if (*n_stale < stale_cap) stale[(*n_stale)++] = b->s[i].group;
            b->stale++;
            b->pending--;
            continue;
        }
        b->s[j++] = b->s[i];
    }
    b->n = j;
    if (b->n < b->P) return 0;
    /* a group in flight that would be too stale for batch v + 1 belongs in this one: wait */
    for (int i = 0; i < b->nf; i++)
        if (b->f[i].version < v + 1 - b->k) return 0;
    /* selection: move the P most at-risk slots to the front (P is small) */
    for (int i = 0; i < b->P; i++) {
        int best = i;
        for (int q = i + 1; q < b->n; q++)
            if (at_risk_first(&b->s[q], &b->s[best])) best = q;
        slot t = b->s[i];
        b->s[i] = b->s[best], b->s[best] = t;
        out[i] = b->s[i].group;
    }
    memmove(b->s, b->s + b->P, sizeof *b->s * (size_t)(b->n - b->P));
    b->n -= b->P;
    /* keep the rest sorted by id */
    for (int i = 1; i < b->n; i++) {
        slot t = b->s[i];
        int q = i;
        while (q > 0 && b->s[q - 1].id > t.id) b->s[q] = b->s[q - 1], q--;
        b->s[q] = t;
    }
    b->pending -= b->P;
    b->consumed += b->P;
    return 1;
}
