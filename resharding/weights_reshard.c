/* Weights from tensor-parallel training ranks to whole-model rollout workers: the plan, the
 * announcement, the checksum from the shards. */
#include "resharding/weights_reshard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/log.h"
#include "resharding/plan.h"
#include "resharding/reshard.h"
#include "resharding/shard_crc.h"
#include "resharding/weights_sync.h"

#define MAGIC 0x52465752u /* "RFWR" */

typedef struct announce {
    uint32_t magic, checksum;
    int64_t version;
    uint64_t n_floats;
    uint32_t plan_id;
    uint32_t base_crc; /* LoRA: CRC-32C of the training ranks' frozen base (0 without) */
} announce;

struct rf_weights_rs {
    rf_param_table pt;
    rf_comm *c;
    int tp, gen_tp, n_train, n_rollout, me; /* n_train = tp x dp; n_rollout: rollout ranks (gen_tp per worker) */
    int train;              /* 1 on a training rank */
    int t, side_tp;         /* shard held here of this side's layout (tp or gen_tp shards) */
    rf_shard *shards;       /* (pt.n_views) shard t of this side's layout */
    size_t full_floats;     /* the whole buffer */
    rf_reshard_plan *plan;
    rf_reshard *ex;
    double timeout_s;
    uint32_t base_crc;      /* this side's frozen base (rf_weights_rs_set_base; 0 without LoRA) */
    announce sent;          /* rank 0: what the requests below carry */
    rf_comm_req **req;      /* (n_rollout) rank 0: announcements in flight */
    int told;               /* rank 0: the transfer path was logged */
    size_t bytes, across;   /* a version's bytes sent between ranks, and of them between machines */
    int gt;                 /* colocated: the rollout shard this rank's process holds */
    rf_shard *gshards;      /* rf_weights_rs_init_colocated (every rank on both sides):
                               (pt.n_views) shard gt of the rollout layout; NULL otherwise */
};

/* The plan from src to dst over x->c (knowing the ranks' machines when the launcher told
 * them: a piece several replicas hold is sent from one on the receiver's machine), its
 * executor, and the bytes a version moves between ranks and machines. */
static rf_status plan_and_executor(rf_weights_rs *x, const rf_layout *src, const rf_layout *dst, size_t bucket_bytes,
                                   double timeout_s) {
    int size = rf_comm_size(x->c);
    int *node = malloc(sizeof *node * (size_t)size), told = node != NULL;
    for (int r = 0; told && r < size; r++) told = (node[r] = rf_comm_node(x->c, r)) >= 0;
    rf_status st = rf_reshard_plan_make_nodes(&x->plan, &x->pt, src, dst, bucket_bytes, size, told ? node : NULL);
    for (int i = 0; st == RF_OK && i < x->plan->n_moves; i++) {
        const rf_reshard_move *m = &x->plan->moves[i];
        size_t b = (size_t)m->n_runs * (size_t)m->run * sizeof(float);
        if (m->src_rank == m->dst_rank) continue;
        x->bytes += b;
        if (told && node[m->src_rank] != node[m->dst_rank]) x->across += b;
    }
    free(node);
    rf_reshard_opts o = {.timeout_s = timeout_s};
    return st == RF_OK ? rf_reshard_init(&x->ex, x->plan, x->c, &o) : st;
}

/* x for pt over c with this rank's side (train), shard t of side_tp; the rest zero. */
static rf_status alloc_x(rf_weights_rs **out, const rf_param_table *pt, rf_comm *c, int train, int t, int side_tp,
                         int n_req) {
    rf_weights_rs *x = calloc(1, sizeof *x);
    if (!x) return rf_error(RF_ERR_NOMEM, "out of memory");
    x->pt = *pt, x->c = c, x->me = rf_comm_rank(c), x->train = train, x->t = t, x->side_tp = side_tp;
    x->shards = calloc((size_t)pt->n_views, sizeof *x->shards);
    x->req = calloc((size_t)(n_req ? n_req : 1), sizeof *x->req);
    *out = x;
    if (!x->shards || !x->req) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < pt->n_views; i++) x->full_floats = pt->views[i].offset + pt->views[i].numel;
    size_t n_local = 0;
    return rf_layout_shards(pt, side_tp, t, x->shards, &n_local);
}

rf_status rf_weights_rs_init(rf_weights_rs **out, const rf_param_table *pt, int tp, int dp, int gen_tp, rf_comm *c,
                             size_t bucket_bytes, double timeout_s) {
    *out = NULL;
    int size = rf_comm_size(c), n_train = tp * dp, me = rf_comm_rank(c);
    if (tp < 1 || dp < 1 || gen_tp < 1 || size <= n_train || (size - n_train) % gen_tp != 0)
        return rf_error(RF_ERR_ARG, "weights by resharding: %d x %d training ranks and %d rollout ranks (%d per rollout worker) "
                        "in a communicator of %d", dp, tp, size - n_train, gen_tp, size);
    int train = me < n_train;
    rf_weights_rs *x = NULL;
    rf_status st = alloc_x(&x, pt, c, train, train ? me % tp : (me - n_train) % gen_tp, train ? tp : gen_tp, size - n_train);
    if (st == RF_OK) {
        x->tp = tp, x->gen_tp = gen_tp, x->n_train = n_train, x->n_rollout = size - n_train, x->timeout_s = timeout_s;
        rf_layout src = {tp, dp, 0, NULL}, dst = {gen_tp, x->n_rollout / gen_tp, n_train, NULL};
        st = plan_and_executor(x, &src, &dst, bucket_bytes, timeout_s);
    }
    if (st != RF_OK) {
        rf_weights_rs_free(x);
        return st;
    }
    *out = x;
    return RF_OK;
}

rf_status rf_weights_rs_init_colocated(rf_weights_rs **out, const rf_param_table *pt, int tp, int dp, int gen_tp,
                                       rf_comm *c, size_t bucket_bytes, double timeout_s) {
    *out = NULL;
    int size = rf_comm_size(c), me = rf_comm_rank(c);
    if (tp < 1 || dp < 1 || gen_tp < 1 || size != tp * dp || size % gen_tp != 0)
        return rf_error(RF_ERR_ARG, "weights handed over in place: %d x %d training ranks, rollout workers of %d ranks, in "
                        "a communicator of %d", dp, tp, gen_tp, size);
    rf_weights_rs *x = NULL;
    rf_status st = alloc_x(&x, pt, c, 1, me % tp, tp, 0);
    if (st == RF_OK) {
        x->tp = tp, x->gen_tp = gen_tp, x->n_train = size, x->timeout_s = timeout_s;
        x->gt = me % gen_tp;
        x->gshards = calloc((size_t)pt->n_views, sizeof *x->gshards);
        size_t n_local = 0;
        st = x->gshards ? rf_layout_shards(pt, gen_tp, x->gt, x->gshards, &n_local) : rf_error(RF_ERR_NOMEM, "out of memory");
    }
    rf_layout src = {tp, dp, 0, NULL}, dst = {gen_tp, size / gen_tp, 0, NULL};
    if (st == RF_OK) st = plan_and_executor(x, &src, &dst, bucket_bytes, timeout_s);
    if (st != RF_OK) {
        rf_weights_rs_free(x);
        return st;
    }
    *out = x;
    return RF_OK;
}

int rf_weights_rs_zero_copy(const rf_weights_rs *x) { return x->plan->zero_copy; }

rf_status rf_weights_rs_move(rf_weights_rs *x, const float *local, float *dst, int64_t version, uint32_t checksum) {
    if (!x->gshards) return rf_error(RF_ERR_ARG, "weights by resharding: rf_weights_rs_move is for colocated ranks");
    if (x->plan->zero_copy) return RF_OK;
    RF_TRY(rf_reshard_run(x->ex, local, dst, version));
    /* every rollout worker's whole-model CRC-32C from its ranks' parts, against the training
     * side's: one allgather over the colocated ranks */
    int n = rf_comm_size(x->c);
    uint32_t mine = rf_shard_crc32c_part(&x->pt, x->gshards, x->gt, dst), *all = malloc(sizeof mine * (size_t)n);
    if (!all) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = rf_comm_allgather(x->c, &mine, all, sizeof mine, x->timeout_s,
                                     "colocated ranks: allgather of the handed-over weights' checksum parts");
    uint32_t crc = st == RF_OK ? rf_shard_crc32c_join(all + (x->me - x->gt), x->gen_tp, x->full_floats) : 0;
    free(all);
    RF_TRY(st);
    if (crc != checksum)
        return rf_error(RF_ERR_FORMAT, "weights version %lld gathered in place for the rollout rank at world rank %d: "
                        "CRC-32C %08x, the training ranks' is %08x", (long long)version,
                        rf_comm_world_rank(x->c, x->me), crc, checksum);
    if (x->me == 0 && !x->told) {
        x->told = 1;
        int in_place = rf_reshard_in_place_peers(x->ex), peers = rf_reshard_peers(x->ex);
        rf_log_info("weights: the training ranks reshard into their processes' rollout ranks: rank 0 exchanges with %d "
                    "rank(s), %d in place (same host, one copy); a version moves %.1f MB between ranks", peers, in_place,
                    x->bytes / 1e6);
    }
    return RF_OK;
}

const rf_reshard_plan *rf_weights_rs_plan(const rf_weights_rs *x) { return x->plan; }

void rf_weights_rs_free(rf_weights_rs *x) {
    if (!x) return;
    for (int i = 0; x->req && i < x->n_rollout; i++) rf_comm_req_free(x->req[i]);
    rf_reshard_free(x->ex);
    rf_reshard_plan_free(x->plan);
    free(x->shards), free(x->req), free(x->gshards);
    free(x);
}

void rf_weights_rs_set_timeout(rf_weights_rs *x, double timeout_s) {
    x->timeout_s = timeout_s;
    rf_reshard_set_timeout(x->ex, timeout_s);
}

/* CRC-32C of the replicated tensors of a local buffer, in table order. */
static uint32_t replicated_crc(const rf_weights_rs *x, const float *local) {
    uint32_t crc = 0;
    for (int i = 0; i < x->pt.n_views; i++) {
        const rf_shard *s = &x->shards[i];
        if (s->split == RF_SPLIT_REPLICATED)
            crc = rf_crc32c_extend(crc, local + s->offset, x->pt.views[i].numel * sizeof(float));
    }
    return crc;
}

rf_status rf_weights_rs_checksum(rf_weights_rs *x, rf_comm *tpc, const float *local, double timeout_s,
                                 uint32_t *checksum) {
    const char *side = x->train ? "training" : "rollout";
    int n = x->side_tp;
    if (rf_comm_size(tpc) != n || rf_comm_rank(tpc) != x->t)
        return rf_error(RF_ERR_ARG, "weights by resharding: the checksum is the %d %s ranks' (this rank holds shard %d, "
                        "the group has %d ranks)", n, side, x->t, rf_comm_size(tpc));
    uint32_t mine[2] = {rf_shard_crc32c_part(&x->pt, x->shards, x->t, local), replicated_crc(x, local)};
    uint32_t *all = malloc(sizeof mine * (size_t)n);
    if (!all) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status st = rf_comm_allgather(tpc, mine, all, sizeof mine, timeout_s,
                                     "tensor parallelism: allgather of the weights' checksum parts");
    for (int q = 1; st == RF_OK && q < n; q++)
        if (all[2 * q + 1] != all[1])
            st = rf_error(RF_ERR_INTERNAL, "tensor parallelism: the replicated parameters (norms, biases) differ between "
                          "%s ranks: CRC-32C %08x on world rank %d, %08x on world rank %d", side,
                          all[1], rf_comm_world_rank(tpc, 0), all[2 * q + 1], rf_comm_world_rank(tpc, q));
    for (int q = 0; st == RF_OK && q < n; q++) all[q] = all[2 * q]; /* the parts, compacted */
    if (st == RF_OK) *checksum = rf_shard_crc32c_join(all, n, x->full_floats);
    free(all);
    return st;
}

/* Rank 0: the announcements of the previous transfer are done (rollout workers received them
 * before taking part in it), so the buffer can be reused. */
static rf_status announcements_done(rf_weights_rs *x) {
    for (int i = 0; i < x->n_rollout; i++) {
        if (!x->req[i]) continue;
        char what[96];
        snprintf(what, sizeof what, "announcing weights to world rank %d", rf_comm_world_rank(x->c, x->n_train + i));
        rf_status st = rf_comm_wait(x->req[i], x->timeout_s, what);
        rf_comm_req_free(x->req[i]);
        x->req[i] = NULL;
        RF_TRY(st);
    }
    return RF_OK;
}

rf_status rf_weights_rs_send(rf_weights_rs *x, const float *local, int64_t version, uint32_t checksum) {
    if (!x->train) return rf_error(RF_ERR_ARG, "weights by resharding: a rollout worker cannot send weights");
    if (x->me == 0) {
        RF_TRY(announcements_done(x));
        x->sent = (announce){MAGIC, checksum, version, x->full_floats, x->plan->id, x->base_crc};
        for (int i = 0; i < x->n_rollout; i++) {
            rf_status st = rf_comm_isend(x->c, &x->sent, sizeof x->sent, x->n_train + i, RF_WEIGHTS_TAG, &x->req[i]);
            if (st != RF_OK)
                return rf_error_wrap(st, "announcing weights version %lld to world rank %d", (long long)version,
                                     rf_comm_world_rank(x->c, x->n_train + i));
        }
    }
    RF_TRY(rf_reshard_run(x->ex, local, NULL, version));
    if (x->me == 0 && !x->told) { /* once: how the weights travel */
        x->told = 1;
        int in_place = rf_reshard_in_place_peers(x->ex);
        int peers = rf_reshard_peers(x->ex);
        rf_log_info("weights: training rank 0 sends to %d rollout rank(s): %d read its shard in place (same host, one copy), %d "
                    "through messages; a version moves %.1f MB between ranks, %.1f MB of it between machines", peers, in_place,
                    peers - in_place, x->bytes / 1e6, x->across / 1e6);
    }
    return x->me == 0 ? announcements_done(x) : RF_OK;
}

int rf_weights_rs_pending(rf_weights_rs *x) {
    return x->train ? -1 : rf_comm_iprobe(x->c, 0, RF_WEIGHTS_TAG);
}

/* A rollout rank: receives the announcement training rank 0 sent it (bounded). */
static rf_status receive_announcement(rf_weights_rs *x, announce *a) {
    int from = rf_comm_world_rank(x->c, 0);
    rf_comm_req *req = NULL;
    char what[96];
    snprintf(what, sizeof what, "receiving the weights announcement of world rank %d", from);
    RF_TRY(rf_comm_irecv(x->c, a, sizeof *a, 0, RF_WEIGHTS_TAG, &req));
    rf_status st = rf_comm_wait(req, x->timeout_s, what);
    rf_comm_req_free(req);
    RF_TRY(st);
    if (a->magic != MAGIC || a->n_floats != x->full_floats || a->plan_id != x->plan->id)
        return rf_error(RF_ERR_FORMAT, "weights from world rank %d: not a resharded transfer for this model (magic %08x, "
                        "%llu parameters, plan %08x; here %zu parameters, plan %08x)", from, a->magic,
                        (unsigned long long)a->n_floats, a->plan_id, x->full_floats, x->plan->id);
    /* LoRA: the adapters are only right on the base they were trained on */
    if (a->base_crc != x->base_crc)
        return rf_error(RF_ERR_FORMAT, "weights version %lld from world rank %d: the training ranks' frozen base weights "
                        "(CRC-32C %08x) are not this rollout worker's (%08x): both must load the same model.path",
                        (long long)a->version, from, a->base_crc, x->base_crc);
    return RF_OK;
}

rf_status rf_weights_rs_receive(rf_weights_rs *x, float *local, rf_comm *gtc, int64_t *version, uint32_t *checksum) {
    if (x->train) return rf_error(RF_ERR_ARG, "weights by resharding: a training rank does not receive weights");
    announce a;
    RF_TRY(receive_announcement(x, &a));
    RF_TRY(rf_reshard_run(x->ex, NULL, local, a.version));
    uint32_t crc;
    if (x->gen_tp == 1) crc = rf_crc32c_extend(0, local, x->full_floats * sizeof(float));
    else RF_TRY(rf_weights_rs_checksum(x, gtc, local, x->timeout_s, &crc));
    if (crc != a.checksum)
        return rf_error(RF_ERR_FORMAT, "weights version %lld assembled from %d training shards at world rank %d: CRC-32C "
                        "%08x, announced as %08x", (long long)a.version, x->tp, rf_comm_world_rank(x->c, x->me), crc,
                        a.checksum);
    *version = a.version, *checksum = crc;
    return RF_OK;
}

rf_status rf_weights_rs_poll(rf_weights_rs *x, float *full, int *arrived, int64_t *version, uint32_t *checksum) {
    *arrived = 0;
    if (x->train) return rf_error(RF_ERR_ARG, "weights by resharding: a training rank does not receive weights");
    int t = rf_weights_rs_pending(x);
    if (t < 0) return rf_error_wrap(RF_ERR_IO, "receiving weights from world rank %d", rf_comm_world_rank(x->c, 0));
    if (!t) return RF_OK;
    RF_TRY(rf_weights_rs_receive(x, full, NULL, version, checksum));
    *arrived = 1;
    return RF_OK;
}

void rf_weights_rs_set_base(rf_weights_rs *x, uint32_t base_crc) { x->base_crc = base_crc; }

rf_status rf_weights_rs_base_checksum(rf_comm *tpc, const rf_param_table *pt, const rf_kernels *k, const float *local,
                                      double timeout_s, uint32_t *crc) {
    int n = rf_comm_size(tpc), t = rf_comm_rank(tpc);
    size_t n_local = 0, full = 0;
    for (int i = 0; i < pt->n_views; i++) full = pt->views[i].offset + pt->views[i].numel;
    rf_shard *sh = calloc((size_t)pt->n_views + 1, sizeof *sh);
    uint32_t *parts = calloc((size_t)n, sizeof *parts);
    rf_status st = sh && parts ? rf_layout_shards(pt, n, t, sh, &n_local) : rf_error(RF_ERR_NOMEM, "out of memory");
    float *host = NULL; /* a device buffer is read back once */
    if (st == RF_OK && k != rf_cpu_kernels()) {
        if ((host = malloc(sizeof(float) * (n_local ? n_local : 1)))) k->to_host(host, local, sizeof(float) * n_local);
        else st = rf_error(RF_ERR_NOMEM, "out of memory for %zu floats", n_local);
    }
    uint32_t mine = st == RF_OK ? rf_shard_crc32c_part(pt, sh, t, host ? host : local) : 0;
    if (st == RF_OK)
        st = rf_comm_allgather(tpc, &mine, parts, sizeof mine, timeout_s, "allgather of the frozen base's checksum parts");
    if (st == RF_OK) *crc = rf_shard_crc32c_join(parts, n, full);
    free(host), free(sh), free(parts);
    return st;
}
