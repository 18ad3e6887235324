/* Resharding executor: this rank's moves bucket by bucket through grouped send/recv, with a
 * hello (plan id, version) first and a CRC-32C header per bucket and peer. */
#include "resharding/reshard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/log.h"
#include "common/shm.h"

#define HELLO_MAGIC 0x52464853u  /* "RFHS" */
#define BUCKET_MAGIC 0x52464842u /* "RFHB" */
#define DONE_MAGIC 0x52464844u   /* "RFHD" */
#define DONE_TAG 23               /* a reader's "done" (rf_comm_isend: apart from the buckets' messages) */
#define NO_STAGE ((size_t)-1)
#define DEPTH 2 /* buckets in flight: while one is checked, the next is already posted */

typedef struct hello {
    uint32_t magic, plan_id;
    int64_t version;
    int32_t offer, pad; /* 1: `src` is the sender's source buffer in shareable memory */
    rf_shm_ref src;
} hello;

typedef struct bucket_header {
    uint32_t magic, crc;
    int32_t bucket, n_moves;
    uint64_t bytes;
} bucket_header;

/* One direction of exchange with one peer in one bucket. */
typedef struct pair {
    int peer, send;
    int pi;            /* index of peer in x->peers */
    uint32_t got_crc;  /* read in place: the CRC-32C of what was copied in this bucket */
    bucket_header hdr; /* sent, or received */
} pair;

typedef struct bucket {
    int index;             /* the plan's bucket number */
    int first, last;       /* into x->mine */
    int first_pair, n_pairs;
} bucket;

struct rf_reshard {
    const rf_reshard_plan *p;
    rf_comm *c;
    rf_reshard_opts o;
    int me, need_src, need_dst;
    int *mine, n_mine;     /* plan move indices involving this rank, in plan order */
    size_t *stage;         /* (n_mine) floats into the staging buffer of the strided side, or NO_STAGE */
    int *pair_of;          /* (n_mine) index into pairs, -1 for local copies */
    bucket *buckets;
    int n_buckets;
    pair *pairs;
    int n_pairs;
    int *peers, n_peers;   /* every rank exchanged with: the hello */
    hello *hellos_in;      /* (n_peers) */
    uint8_t *sends_to, *recvs_from; /* (n_peers) the plan has moves to / from the peer */
    size_t src_extent;     /* floats of the source buffer this rank's sends read */
    /* Same-host single copy, decided at every run (hello, then the receivers' answers):
     * shm_in[i]: this rank reads peer i's source through maps[i]; shm_out[i]: peer i reads
     * this rank's source. Data of those pairs does not go through comm. */
    uint8_t *shm_in, *shm_out;
    int32_t *answers_in, *answers_out;
    rf_shm_map *maps;      /* (n_peers) kept between runs while the peer's buffer stays */
    rf_comm_req **done_req; /* (n_peers) "done" sent to / awaited from peer i */
    uint8_t *map_refused;  /* (n_peers) peer i's buffer could not be mapped: messages from then on */
    uint32_t done_msg;
    int32_t *done_in;
    float *send_stage[DEPTH], *recv_stage[DEPTH]; /* bucket b uses [b % DEPTH] */
    rf_comm_p2p *ops;      /* room for the largest bucket's exchange */
    int max_ops;
};

static int src_contig(const rf_reshard_move *m) { return m->n_runs == 1 || m->src_stride == m->run; }
static int dst_contig(const rf_reshard_move *m) { return m->n_runs == 1 || m->dst_stride == m->run; }
static size_t move_floats(const rf_reshard_move *m) { return (size_t)(m->n_runs * m->run); }

/* n_runs runs of `run` floats from src (runs src_stride apart) to dst (dst_stride apart). */
static void copy_runs(float *dst, int64_t dst_stride, const float *src, int64_t src_stride, int64_t n_runs, int64_t run) {
    if (dst_stride == run && src_stride == run) {
        memcpy(dst, src, sizeof(float) * (size_t)(n_runs * run));
        return;
    }
    for (int64_t i = 0; i < n_runs; i++) memcpy(dst + i * dst_stride, src + i * src_stride, sizeof(float) * (size_t)run);
}

/* copy_runs, returning the CRC of the copied runs extended from crc. */
static uint32_t copy_runs_crc(uint32_t crc, float *dst, int64_t dst_stride, const float *src, int64_t src_stride, int64_t n_runs,
                              int64_t run) {
    if (dst_stride == run && src_stride == run) return rf_crc32c_copy(crc, dst, src, sizeof(float) * (size_t)(n_runs * run));
    for (int64_t i = 0; i < n_runs; i++)
        crc = rf_crc32c_copy(crc, dst + i * dst_stride, src + i * src_stride, sizeof(float) * (size_t)run);
    return crc;
}

static uint32_t crc_runs(uint32_t crc, const float *p, int64_t stride, int64_t n_runs, int64_t run) {
    if (stride == run) return rf_crc32c_extend(crc, p, sizeof(float) * (size_t)(n_runs * run));
    for (int64_t i = 0; i < n_runs; i++) crc = rf_crc32c_extend(crc, p + i * stride, sizeof(float) * (size_t)run);
    return crc;
}

/* ---- preparation ---- */

static int add_unique(int *list, int *n, int v) {
    for (int i = 0; i < *n; i++)
        if (list[i] == v) return i;
    list[(*n)++] = v;
    return *n - 1;
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* The index of rank `peer` in x->peers (sorted). */
static int peer_index(const rf_reshard *x, int peer) {
    const int *f = bsearch(&peer, x->peers, (size_t)x->n_peers, sizeof(int), cmp_int);
    return f ? (int)(f - x->peers) : -1;
}

/* Pairs, staging offsets and sizes of the bucket made of mine[first..last). */
static void prepare_bucket(rf_reshard *x, bucket *bk, size_t *send_floats, size_t *recv_floats) {
    size_t so = 0, ro = 0;
    bk->first_pair = x->n_pairs;
    for (int k = bk->first; k < bk->last; k++) {
        const rf_reshard_move *m = &x->p->moves[x->mine[k]];
        x->stage[k] = NO_STAGE, x->pair_of[k] = -1;
        if (m->src_rank == m->dst_rank) continue;
        int send = m->src_rank == x->me, peer = send ? m->dst_rank : m->src_rank, j;
        for (j = bk->first_pair; j < x->n_pairs; j++)
            if (x->pairs[j].peer == peer && x->pairs[j].send == send) break;
        if (j == x->n_pairs) x->pairs[x->n_pairs++] = (pair){.peer = peer, .send = send, .pi = peer_index(x, peer)};
        x->pair_of[k] = j;
        if (send && !src_contig(m)) x->stage[k] = so, so += move_floats(m);
        if (!send && !dst_contig(m)) x->stage[k] = ro, ro += move_floats(m);
    }
    bk->n_pairs = x->n_pairs - bk->first_pair;
    if (so > *send_floats) *send_floats = so;
    if (ro > *recv_floats) *recv_floats = ro;
}

static rf_status prepare(rf_reshard *x) {
    const rf_reshard_plan *p = x->p;
    int n = p->n_moves;
    x->mine = malloc(sizeof(int) * (size_t)(n + 1));
    x->stage = malloc(sizeof(size_t) * (size_t)(n + 1));
    x->pair_of = malloc(sizeof(int) * (size_t)(n + 1));
    x->buckets = malloc(sizeof(bucket) * (size_t)(p->n_buckets + 1));
    x->pairs = malloc(sizeof(pair) * (size_t)(n + 1));
    x->peers = malloc(sizeof(int) * (size_t)(n + 1));
    if (!x->mine || !x->stage || !x->pair_of || !x->buckets || !x->pairs || !x->peers)
        return rf_error(RF_ERR_NOMEM, "resharding: out of memory for a plan of %d moves", n);
    for (int i = 0; i < n; i++) {
        const rf_reshard_move *m = &p->moves[i];
        if (m->src_rank != x->me && m->dst_rank != x->me) continue;
        x->mine[x->n_mine++] = i;
        if (m->src_rank == x->me) x->need_src = 1;
        if (m->dst_rank == x->me) x->need_dst = 1;
        if (m->src_rank != m->dst_rank) add_unique(x->peers, &x->n_peers, m->src_rank == x->me ? m->dst_rank : m->src_rank);
        if (m->src_rank == x->me) {
            size_t end = (size_t)(m->src_off + (m->n_runs - 1) * m->src_stride + m->run);
            if (end > x->src_extent) x->src_extent = end;
        }
    }
    qsort(x->peers, (size_t)x->n_peers, sizeof(int), cmp_int);
    size_t np = (size_t)x->n_peers + 1;
    x->sends_to = calloc(np, 1), x->recvs_from = calloc(np, 1), x->shm_in = calloc(np, 1), x->shm_out = calloc(np, 1);
    x->answers_in = calloc(np, sizeof(int32_t)), x->answers_out = calloc(np, sizeof(int32_t));
    x->maps = calloc(np, sizeof(rf_shm_map));
    x->done_req = calloc(np, sizeof(rf_comm_req *)), x->done_in = calloc(np, sizeof(int32_t));
    x->map_refused = calloc(np, 1);
    x->done_msg = DONE_MAGIC;
    if (!x->sends_to || !x->recvs_from || !x->shm_in || !x->shm_out || !x->answers_in || !x->answers_out || !x->maps ||
        !x->done_req || !x->done_in || !x->map_refused)
        return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; k < x->n_mine; k++) {
        const rf_reshard_move *m = &p->moves[x->mine[k]];
        if (m->src_rank == m->dst_rank) continue;
        if (m->src_rank == x->me) x->sends_to[peer_index(x, m->dst_rank)] = 1;
        else x->recvs_from[peer_index(x, m->src_rank)] = 1;
    }
    size_t send_floats = 0, recv_floats = 0;
    for (int k = 0; k < x->n_mine;) {
        bucket *bk = &x->buckets[x->n_buckets++];
        bk->index = p->moves[x->mine[k]].bucket, bk->first = k;
        while (k < x->n_mine && p->moves[x->mine[k]].bucket == bk->index) k++;
        bk->last = k;
        prepare_bucket(x, bk, &send_floats, &recv_floats);
        int ops = bk->n_pairs + (bk->last - bk->first);
        if (ops > x->max_ops) x->max_ops = ops;
    }
    if (x->max_ops < 2 * x->n_peers) x->max_ops = 2 * x->n_peers; /* the hello */
    x->ops = malloc(sizeof(rf_comm_p2p) * (size_t)(x->max_ops + 1));
    x->hellos_in = malloc(sizeof(hello) * (size_t)(x->n_peers + 1));
    if (!x->ops || !x->hellos_in) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < DEPTH; i++) {
        x->send_stage[i] = malloc(sizeof(float) * (send_floats + 1));
        x->recv_stage[i] = malloc(sizeof(float) * (recv_floats + 1));
        if (!x->send_stage[i] || !x->recv_stage[i])
            return rf_error(RF_ERR_NOMEM, "resharding: out of memory for staging (%zu floats)", DEPTH * (send_floats + recv_floats));
    }
    return RF_OK;
}

rf_status rf_reshard_init(rf_reshard **out, const rf_reshard_plan *plan, rf_comm *c, const rf_reshard_opts *opts) {
    *out = NULL;
    if (rf_comm_size(c) != plan->comm_size)
        return rf_error(RF_ERR_ARG, "resharding: the plan is for %d ranks, the communicator has %d", plan->comm_size,
                        rf_comm_size(c));
    if (rf_comm_backend(c) == RF_COMM_NCCL && !plan->zero_copy)
        return rf_error(RF_ERR_UNSUPPORTED, "resharding device buffers over NCCL is not built (it needs pack and checksum kernels)");
    rf_reshard *x = calloc(1, sizeof *x);
    if (!x) return rf_error(RF_ERR_NOMEM, "out of memory");
    x->p = plan, x->c = c, x->me = rf_comm_rank(c);
    if (opts) x->o = *opts;
    if (x->o.timeout_s <= 0) x->o.timeout_s = 60;
    rf_status st = plan->zero_copy ? RF_OK : prepare(x);
    if (st != RF_OK) {
        rf_reshard_free(x);
        return st;
    }
    *out = x;
    return RF_OK;
}

void rf_reshard_free(rf_reshard *x) {
    if (!x) return;
    free(x->mine), free(x->stage), free(x->pair_of);
    for (int i = 0; x->maps && i < x->n_peers; i++) rf_shm_map_close(&x->maps[i]);
    for (int i = 0; x->done_req && i < x->n_peers; i++) rf_comm_req_free(x->done_req[i]);
    free(x->done_req), free(x->done_in), free(x->map_refused);
    free(x->maps), free(x->sends_to), free(x->recvs_from), free(x->shm_in), free(x->shm_out);
    free(x->answers_in), free(x->answers_out);
    free(x->buckets), free(x->pairs), free(x->peers), free(x->hellos_in);
    for (int i = 0; i < DEPTH; i++) free(x->send_stage[i]), free(x->recv_stage[i]);
    free(x->ops);
    free(x);
}

void rf_reshard_set_timeout(rf_reshard *x, double timeout_s) {
    x->o.timeout_s = timeout_s > 0 ? timeout_s : 60;
}

/* ---- running ---- */

static int world(const rf_reshard *x, int r) { return rf_comm_world_rank(x->c, r); }

/* Every peer gets and sends a hello; a peer with another plan or version is refused. */
static rf_status say_hello(rf_reshard *x, int64_t version, hello *mine) {
    if (x->n_peers == 0) return RF_OK;
    int n = 0;
    for (int i = 0; i < x->n_peers; i++) {
        x->ops[n++] = (rf_comm_p2p){mine, sizeof *mine, x->peers[i], 1};
        x->ops[n++] = (rf_comm_p2p){&x->hellos_in[i], sizeof(hello), x->peers[i], 0};
    }
    char what[96];
    snprintf(what, sizeof what, "resharding version %lld (hello)", (long long)version);
    RF_TRY(rf_comm_sendrecv(x->c, x->ops, n, x->o.timeout_s, what));
    for (int i = 0; i < x->n_peers; i++) {
        const hello *h = &x->hellos_in[i];
        if (h->magic != HELLO_MAGIC || h->plan_id != x->p->id)
            return rf_error(RF_ERR_FORMAT, "resharding: world rank %d planned differently from world rank %d (plan %08x, here %08x): layouts, bucket size or model differ",
                            world(x, x->peers[i]), world(x, x->me), h->plan_id, x->p->id);
        if (h->version != version)
            return rf_error(RF_ERR_FORMAT, "resharding: world rank %d moves version %lld, world rank %d version %lld",
                            world(x, x->peers[i]), (long long)h->version, world(x, x->me), (long long)version);
    }
    return RF_OK;
}

/* 1 when peer i's mapping (kept from an earlier run, or made now) is the buffer it offers. */
static int map_peer(rf_reshard *x, int i) {
    if (x->map_refused[i]) return 0; /* refused once: messages from then on, said once */
    if (rf_shm_map_keep(&x->maps[i], &x->hellos_in[i].src) == RF_OK) return 1;
    x->map_refused[i] = 1;
    rf_log_warn("resharding: world rank %d copies from world rank %d through messages: %s", world(x, x->me),
                world(x, x->peers[i]), rf_error_message());
    return 0;
}

/* After the hello: each receiver answers each sender that offered its source buffer whether it
 * will read it in place (same host, mapped); both sides then know which pairs copy once. */
static rf_status agree_single_copy(rf_reshard *x, const hello *mine, int64_t version) {
    int n = 0;
    for (int i = 0; i < x->n_peers; i++) {
        x->shm_in[i] = x->shm_out[i] = 0;
        if (x->recvs_from[i] && x->hellos_in[i].offer) {
            x->answers_out[i] = !x->o.no_shm && map_peer(x, i);
            x->ops[n++] = (rf_comm_p2p){&x->answers_out[i], sizeof(int32_t), x->peers[i], 1};
        }
        if (x->sends_to[i] && mine->offer) {
            x->answers_in[i] = 0;
            x->ops[n++] = (rf_comm_p2p){&x->answers_in[i], sizeof(int32_t), x->peers[i], 0};
        }
    }
    if (n == 0) return RF_OK;
    char what[96];
    snprintf(what, sizeof what, "resharding version %lld (single-copy answers)", (long long)version);
    /* twice the bound: a reader may still be in its hello with a third rank that is gone, and
     * should be the one to name it */
    RF_TRY(rf_comm_sendrecv(x->c, x->ops, n, 2 * x->o.timeout_s, what));
    for (int i = 0; i < x->n_peers; i++) {
        x->shm_in[i] = x->recvs_from[i] && x->hellos_in[i].offer && x->answers_out[i] == 1;
        x->shm_out[i] = x->sends_to[i] && mine->offer && x->answers_in[i] == 1;
    }
    return RF_OK;
}

/* Requests of the "done" exchange left from a run that failed. */
static void forget_done(rf_reshard *x) {
    for (int i = 0; i < x->n_peers; i++) rf_comm_req_free(x->done_req[i]), x->done_req[i] = NULL;
}

/* Senders whose source this rank reads in place are told "done" as soon as all of it has been
 * copied (read_in_place), and post their receive of it; before returning, a sender waits for
 * every reader's "done" (its buffer must not change or go before), bounded by twice the
 * exchanges' bound: a reader stuck on a third rank reports that rank first. */
static rf_status post_done_receives(rf_reshard *x) {
    for (int i = 0; i < x->n_peers; i++)
        if (x->shm_out[i]) RF_TRY(rf_comm_irecv(x->c, &x->done_in[i], sizeof(int32_t), x->peers[i], DONE_TAG, &x->done_req[i]));
    return RF_OK;
}

static rf_status finish_single_copy(rf_reshard *x, int64_t version) {
    char what[160];
    for (int i = 0; i < x->n_peers; i++) {
        if (!x->done_req[i]) continue;
        double bound = x->shm_out[i] ? 2 * x->o.timeout_s : x->o.timeout_s;
        snprintf(what, sizeof what, "resharding version %lld (%s)", (long long)version,
                 x->shm_out[i] ? "waiting for a reader of this rank's weights" : "telling a sender its weights were read");
        rf_status st = rf_comm_wait(x->done_req[i], bound, what);
        rf_comm_req_free(x->done_req[i]), x->done_req[i] = NULL;
        if (st != RF_OK && x->shm_out[i])
            return rf_error(RF_ERR_IO, "resharding version %lld: world rank %d waited %g s for world rank %d to finish reading its "
                            "weights in place (a rank is gone or stuck, or waits for another)", (long long)version,
                            world(x, x->me), bound, world(x, x->peers[i]));
        RF_TRY(st);
        if (x->shm_out[i] && (uint32_t)x->done_in[i] != DONE_MAGIC)
            return rf_error(RF_ERR_FORMAT, "resharding version %lld: world rank %d ended its in-place read with %08x", (long long)version,
                            world(x, x->peers[i]), (unsigned)x->done_in[i]);
    }
    return RF_OK;
}

/* 1 when pair j's data is read in place by the receiver rather than sent. */
static int pair_in_place(const rf_reshard *x, int j) {
    const pair *p = &x->pairs[j];
    return p->send ? x->shm_out[p->pi] : x->shm_in[p->pi];
}

/* The source buffer of peer i, mapped here. */
static const float *peer_src(const rf_reshard *x, int i) {
    return (const float *)((const char *)x->maps[i].base + x->hellos_in[i].src.offset);
}

/* Packs strided sends, checksums what goes to each peer, fills the headers. */
static void prepare_sends(rf_reshard *x, const bucket *bk, const float *src, float *stage, int corrupt) {
    for (int j = bk->first_pair; j < bk->first_pair + bk->n_pairs; j++)
        if (x->pairs[j].send) x->pairs[j].hdr = (bucket_header){BUCKET_MAGIC, 0, bk->index, 0, 0};
    for (int k = bk->first; k < bk->last; k++) {
        const rf_reshard_move *m = &x->p->moves[x->mine[k]];
        if (x->pair_of[k] < 0 || m->src_rank != x->me) continue;
        bucket_header *h = &x->pairs[x->pair_of[k]].hdr;
        const float *from = src + m->src_off;
        int64_t stride = m->src_stride;
        if (x->stage[k] != NO_STAGE && !pair_in_place(x, x->pair_of[k])) {
            copy_runs(stage + x->stage[k], m->run, from, m->src_stride, m->n_runs, m->run);
            from = stage + x->stage[k], stride = m->run;
        }
        if (!x->o.no_verify) h->crc = crc_runs(h->crc, from, stride, m->n_runs, m->run);
        h->n_moves++, h->bytes += move_floats(m) * sizeof(float);
    }
    if (corrupt)
        for (int j = bk->first_pair; j < bk->first_pair + bk->n_pairs; j++) x->pairs[j].hdr.crc ^= 1u;
}

/* The bucket's exchange: headers first, then every move in plan order (the same order on the
 * sending and the receiving rank, so MPI and NCCL pair them). */
static int build_ops(rf_reshard *x, const bucket *bk, const float *src, const float *stage, float *rstage, float *dst) {
    int n = 0;
    for (int j = bk->first_pair; j < bk->first_pair + bk->n_pairs; j++)
        x->ops[n++] = (rf_comm_p2p){&x->pairs[j].hdr, sizeof(bucket_header), x->pairs[j].peer, x->pairs[j].send};
    for (int k = bk->first; k < bk->last; k++) {
        const rf_reshard_move *m = &x->p->moves[x->mine[k]];
        if (x->pair_of[k] < 0 || pair_in_place(x, x->pair_of[k])) continue;
        size_t bytes = move_floats(m) * sizeof(float);
        if (m->src_rank == x->me)
            x->ops[n++] = (rf_comm_p2p){(float *)(x->stage[k] != NO_STAGE ? stage + x->stage[k] : src + m->src_off),
                                        bytes, m->dst_rank, 1};
        else
            x->ops[n++] = (rf_comm_p2p){x->stage[k] != NO_STAGE ? rstage + x->stage[k] : dst + m->dst_off, bytes,
                                        m->src_rank, 0};
    }
    return n;
}

/* Names the parameters a pair carried in this bucket, for messages. */
static void pair_params(const rf_reshard *x, const bucket *bk, int j, char *out, size_t cap) {
    size_t len = 0;
    int last = -1, count = 0;
    out[0] = '\0';
    for (int k = bk->first; k < bk->last && len < cap; k++) {
        int param = x->p->moves[x->mine[k]].param;
        if (x->pair_of[k] != j || param == last) continue;
        last = param;
        if (count++ == 3) {
            snprintf(out + len, cap - len, ", ...");
            break;
        }
        len += (size_t)snprintf(out + len, cap - len, "%s%s", count > 1 ? ", " : "", x->p->views[param].name);
    }
}

/* Copies everything this rank reads in place, every bucket, straight from the senders' buffers
 * (the CRC-32C of each bucket's part computed in the same pass, kept for the bucket's header),
 * then tells each such sender "done" at once: the data is there since the hello, and a sender
 * need not wait for this rank's other exchanges. */
static rf_status read_in_place(rf_reshard *x, float *dst) {
    for (int b = 0; b < x->n_buckets; b++) {
        const bucket *bk = &x->buckets[b];
        for (int j = bk->first_pair; j < bk->first_pair + bk->n_pairs; j++) {
            if (x->pairs[j].send || !x->shm_in[x->pairs[j].pi]) continue;
            const float *src = peer_src(x, x->pairs[j].pi);
            uint32_t crc = 0;
            for (int k = bk->first; k < bk->last; k++) {
                if (x->pair_of[k] != j) continue;
                const rf_reshard_move *m = &x->p->moves[x->mine[k]];
                if (x->o.no_verify) copy_runs(dst + m->dst_off, m->dst_stride, src + m->src_off, m->src_stride, m->n_runs, m->run);
                else crc = copy_runs_crc(crc, dst + m->dst_off, m->dst_stride, src + m->src_off, m->src_stride, m->n_runs, m->run);
            }
            x->pairs[j].got_crc = crc;
        }
    }
    for (int i = 0; i < x->n_peers; i++)
        if (x->shm_in[i]) RF_TRY(rf_comm_isend(x->c, &x->done_msg, sizeof x->done_msg, x->peers[i], DONE_TAG, &x->done_req[i]));
    return RF_OK;
}

/* Checks what arrived against the headers, then unpacks strided receives. Returns the first
 * problem (RF_ERR_FORMAT) without stopping. */
static rf_status finish_receives(rf_reshard *x, const bucket *bk, const float *rstage, float *dst, int64_t version) {
    rf_status st = RF_OK;
    for (int j = bk->first_pair; j < bk->first_pair + bk->n_pairs; j++) {
        if (x->pairs[j].send) continue;
        uint32_t crc = 0;
        uint64_t bytes = 0;
        int n = 0;
        for (int k = bk->first; k < bk->last; k++) {
            if (x->pair_of[k] != j) continue;
            const rf_reshard_move *m = &x->p->moves[x->mine[k]];
            int in_place = x->shm_in[x->pairs[j].pi], staged = x->stage[k] != NO_STAGE && !in_place;
            if (in_place) { /* copied by read_in_place */
                crc = x->pairs[j].got_crc;
                bytes += move_floats(m) * sizeof(float), n++;
                continue;
            }
            if (!x->o.no_verify)
                crc = crc_runs(crc, staged ? rstage + x->stage[k] : dst + m->dst_off, staged ? m->run : m->dst_stride,
                               m->n_runs, m->run);
            bytes += move_floats(m) * sizeof(float), n++;
        }
        const bucket_header *h = &x->pairs[j].hdr;
        char params[256];
        pair_params(x, bk, j, params, sizeof params);
        if (st == RF_OK && (h->magic != BUCKET_MAGIC || h->bucket != bk->index || h->bytes != bytes || h->n_moves != n))
            st = rf_error(RF_ERR_FORMAT, "resharding version %lld, bucket %d: world rank %d sent bucket %d with %d moves of %llu bytes, world rank %d expected %d moves of %llu bytes (%s)",
                          (long long)version, bk->index, world(x, x->pairs[j].peer), h->bucket, h->n_moves,
                          (unsigned long long)h->bytes, world(x, x->me), n, (unsigned long long)bytes, params);
        else if (st == RF_OK && !x->o.no_verify && h->crc != crc)
            st = rf_error(RF_ERR_FORMAT, "resharding version %lld, bucket %d: the data from world rank %d arrived damaged at world rank %d: CRC-32C %08x, sent as %08x (%s)",
                          (long long)version, bk->index, world(x, x->pairs[j].peer), world(x, x->me), crc, h->crc, params);
    }
    for (int k = bk->first; k < bk->last; k++) {
        const rf_reshard_move *m = &x->p->moves[x->mine[k]];
        if (x->pair_of[k] >= 0 && m->dst_rank == x->me && x->stage[k] != NO_STAGE && !pair_in_place(x, x->pair_of[k]))
            copy_runs(dst + m->dst_off, m->dst_stride, rstage + x->stage[k], m->run, m->n_runs, m->run);
    }
    return st;
}

static void local_copies(rf_reshard *x, const bucket *bk, const float *src, float *dst) {
    for (int k = bk->first; k < bk->last; k++) {
        const rf_reshard_move *m = &x->p->moves[x->mine[k]];
        if (x->pair_of[k] < 0) copy_runs(dst + m->dst_off, m->dst_stride, src + m->src_off, m->src_stride, m->n_runs, m->run);
    }
}

/* Packs and checksums bucket b's sends and starts its exchange. */
static rf_status start_bucket(rf_reshard *x, int b, const float *src, float *dst, int64_t version, int corrupt,
                              rf_comm_group **g) {
    const bucket *bk = &x->buckets[b];
    prepare_sends(x, bk, src, x->send_stage[b % DEPTH], bk->index == corrupt);
    int n = build_ops(x, bk, src, x->send_stage[b % DEPTH], x->recv_stage[b % DEPTH], dst);
    char what[96];
    snprintf(what, sizeof what, "resharding version %lld, bucket %d of %d", (long long)version, bk->index, x->p->n_buckets);
    return rf_comm_sendrecv_start(x->c, x->ops, n, what, g);
}

/* Waits for every started bucket (after an error: their buffers must not be left in use). */
static void drain(rf_reshard *x, rf_comm_group **g) {
    for (int i = 0; i < DEPTH; i++) {
        if (g[i]) rf_comm_group_wait(g[i], x->o.timeout_s);
        g[i] = NULL;
    }
}

/* Buckets in a pipeline DEPTH deep: bucket b + DEPTH is posted as soon as bucket b is done, so
 * a receiver finds the next bucket waiting when it finishes one (no round trip between
 * buckets). Deadlock-free: every rank posts buckets in order, so the lowest bucket anyone waits
 * for has been posted by all its ranks. */
rf_status rf_reshard_run(rf_reshard *x, const float *src, float *dst, int64_t version) {
    if (x->p->zero_copy) return RF_OK;
    if ((x->need_src && !src) || (x->need_dst && !dst))
        return rf_error(RF_ERR_ARG, "resharding: world rank %d has a part in the plan but no %s buffer was given", world(x, x->me),
                        x->need_src && !src ? "source" : "destination");
    hello mine = {HELLO_MAGIC, x->p->id, version, 0, 0, {0}};
    if (x->need_src && !x->o.no_shm && rf_shm_lookup(src, sizeof(float) * x->src_extent, &mine.src)) mine.offer = 1;
    RF_TRY(say_hello(x, version, &mine));
    forget_done(x);
    RF_TRY(agree_single_copy(x, &mine, version));
    RF_TRY(post_done_receives(x));
    RF_TRY(read_in_place(x, dst));
    const char *corrupt_env = getenv("RF_TEST_RESHARD_CORRUPT"); /* test hook: damage this bucket's checksums */
    int corrupt = corrupt_env && *corrupt_env ? atoi(corrupt_env) : -1;
    rf_status first = RF_OK;
    char first_msg[1024] = "";
    rf_comm_group *g[DEPTH] = {NULL};
    for (int b = 0; b < x->n_buckets + DEPTH - 1; b++) {
        if (b < x->n_buckets) {
            rf_status st = start_bucket(x, b, src, dst, version, corrupt, &g[b % DEPTH]);
            if (st != RF_OK) {
                drain(x, g);
                return st;
            }
        }
        int done = b - (DEPTH - 1); /* the bucket to finish now */
        if (done < 0) continue;
        rf_status st = rf_comm_group_wait(g[done % DEPTH], x->o.timeout_s);
        g[done % DEPTH] = NULL;
        if (st != RF_OK) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", rf_error_message());
            drain(x, g);
            return rf_error(st, "%s", msg);
        }
        st = finish_receives(x, &x->buckets[done], x->recv_stage[done % DEPTH], dst, version);
        if (st != RF_OK && first == RF_OK) first = st, snprintf(first_msg, sizeof first_msg, "%s", rf_error_message());
        local_copies(x, &x->buckets[done], src, dst);
    }
    RF_TRY(finish_single_copy(x, version));
    if (first != RF_OK) return rf_error(first, "%s", first_msg);
    return RF_OK;
}

int rf_reshard_peers(const rf_reshard *x) { return x->n_peers; }

int rf_reshard_in_place_peers(const rf_reshard *x) {
    int n = 0;
    for (int i = 0; i < x->n_peers; i++) n += x->shm_in[i] || x->shm_out[i];
    return n;
}

rf_status rf_reshard_execute(const rf_reshard_plan *plan, rf_comm *c, const float *src, float *dst, int64_t version,
                             const rf_reshard_opts *opts) {
    rf_reshard *x = NULL;
    RF_TRY(rf_reshard_init(&x, plan, c, opts));
    rf_status st = rf_reshard_run(x, src, dst, version);
    rf_reshard_free(x);
    return st;
}
