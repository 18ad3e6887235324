/* Data-parallel training: gradient buckets reduced during the backward pass, plain DP and
 * ZeRO-1. See data_parallel.h. */
#include "trainer/data_parallel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/lora.h"

/* A bucket: floats [lo, hi) of the flat buffers (of the gradient buffer: under LoRA the
 * parameters' floats n_frozen + lo ..). Bucket 0 ends the buffer; the last one starts it. ZeRO-1 splits a bucket into `size` blocks of blk floats (the last bucket padded). */
typedef struct dp_bucket {
    size_t lo, hi;
    size_t blk;          /* floats per rank's block */
    size_t so;           /* offset of this rank's block in the shard buffers */
    rf_comm_group *g;    /* in flight, or NULL */
} dp_bucket;

/* ZeRO-1: floats of this rank's shard inside one trained view (AdamW per view for its weight
 * decay). Offsets count the trained floats: under LoRA the parameters' n_frozen + p. */
typedef struct dp_seg {
    size_t p, s, n; /* offset among the trained floats, offset in the shard buffers, floats */
    int no_decay;
    int view;       /* index of the view in rf_model_train_views */
} dp_seg;

struct rf_dp {
    rf_comm *c;          /* the model's memory: gradients, parameters, moments */
    rf_comm *h;          /* host memory over the same ranks (rf_comm_host(c)): counts, norms */
    rf_model *m;
    rf_model_tp *tp;     /* tensor parallel: m is tp->m, this rank's shard (rf_dp_init_tp) */
    rf_dp_opts o;
    int rank, size;
    dp_bucket *b;
    int nb;
    int next;            /* the next bucket to start */
    int armed;           /* the current backward pass is the last of the mini-batch */
    int done;            /* buckets known to be complete (progress polling) */
    rf_dp_stats st;
    /* ZeRO-1 */
    size_t shard_n;      /* floats of the shard buffers: sum of blk */
    float *sg, *sm, *sv; /* (shard_n) summed gradients (after the step: the staging of the
                            updated parameters for their allgather), AdamW moments */
    float *pad;          /* (size * blk of the last bucket) staging of the padded bucket */
    dp_seg *seg;
    int nseg;
};

rf_model *rf_dp_model(const rf_dp *dp) { return dp->m; }
rf_model_tp *rf_dp_tp(const rf_dp *dp) { return dp->tp; }
void rf_dp_set_timeout(rf_dp *dp, double timeout_s) { dp->o.timeout_s = timeout_s > 0 ? timeout_s : 30; }
int rf_dp_rank(const rf_dp *dp) { return dp->rank; }
int rf_dp_size(const rf_dp *dp) { return dp->size; }
int rf_dp_zero(const rf_dp *dp) { return dp->o.zero; }
const rf_dp_stats *rf_dp_get_stats(const rf_dp *dp) { return &dp->st; }

/* ---- layout ---- */

static rf_status make_buckets(rf_dp *dp) {
    size_t n = dp->m->n_params - dp->m->n_frozen, S = (size_t)dp->size; /* the gradient buffer */
    size_t B = dp->o.bucket_floats ? dp->o.bucket_floats : RF_DP_BUCKET_DEFAULT;
    B = (B + S - 1) / S * S; /* whole blocks in every bucket but the padded last one */
    dp->nb = (int)((n + B - 1) / B);
    dp->b = calloc((size_t)(dp->nb > 0 ? dp->nb : 1), sizeof *dp->b);
    if (!dp->b) return rf_error(RF_ERR_NOMEM, "out of memory for %d gradient buckets", dp->nb);
    for (int k = 0; k < dp->nb; k++) {
        dp_bucket *b = &dp->b[k];
        b->hi = n - (size_t)k * B;
        b->lo = b->hi > B ? b->hi - B : 0;
        b->blk = (b->hi - b->lo + S - 1) / S;
        b->so = dp->shard_n;
        dp->shard_n += b->blk;
    }
    return RF_OK;
}

/* The floats of this rank's block of bucket k that are real (not padding): [*a, *e). */
static void own_block(const rf_dp *dp, int k, size_t *a, size_t *e) {
    const dp_bucket *b = &dp->b[k];
    *a = b->lo + (size_t)dp->rank * b->blk;
    *e = *a + b->blk < b->hi ? *a + b->blk : b->hi;
    if (*a > *e) *a = *e;
}

/* ZeRO-1: this rank's shard cut at the boundaries of the trained views (under LoRA the
 * adapters'). */
static rf_status make_segments(rf_dp *dp) {
    const rf_model *m = dp->m;
    int nv;
    const rf_param_view *views = rf_model_train_views(m, &nv);
    dp->seg = calloc((size_t)(dp->nb + nv + 1), sizeof *dp->seg);
    if (!dp->seg) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int k = 0; k < dp->nb; k++) {
        size_t a, e;
        own_block(dp, k, &a, &e);
        for (int i = 0; i < nv && a < e; i++) {
            const rf_param_view *v = &views[i];
            size_t vo = v->offset - m->n_frozen; /* among the trained floats */
            size_t lo = vo > a ? vo : a, hi = vo + v->numel < e ? vo + v->numel : e;
            if (lo >= hi) continue;
            dp->seg[dp->nseg++] = (dp_seg){lo, dp->b[k].so + (lo - (dp->b[k].lo + (size_t)dp->rank * dp->b[k].blk)),
                                          hi - lo, v->no_decay, i};
        }
    }
    return RF_OK;
}

/* Copies this rank's blocks of a whole buffer (the trained floats) into shard layout. */
static void to_shard(rf_dp *dp, const float *full, float *shard) {
    const rf_kernels *k = dp->m->k;
    for (int i = 0; i < dp->nseg; i++)
        k->copy(shard + dp->seg[i].s, full + dp->seg[i].p, sizeof(float) * dp->seg[i].n);
}

/* Is bucket k one that needs the padded staging buffer (its length not size * blk)? */
static int padded(const rf_dp *dp, int k) {
    return dp->b[k].hi - dp->b[k].lo != dp->b[k].blk * (size_t)dp->size;
}

/* Allgathers every bucket: rank r's block comes from shard (shard layout), the whole goes to
 * full (the trained floats). Blocking, bucket by bucket. */
static rf_status gather_buckets(rf_dp *dp, const float *shard, float *full, const char *what) {
    const rf_kernels *k = dp->m->k;
    for (int i = 0; i < dp->nb; i++) {
        const dp_bucket *b = &dp->b[i];
        float *dst = padded(dp, i) ? dp->pad : full + b->lo;
        RF_TRY(rf_comm_allgather(dp->c, shard + b->so, dst, sizeof(float) * b->blk, dp->o.timeout_s, what));
        if (dst == dp->pad) k->copy(full + b->lo, dp->pad, sizeof(float) * (b->hi - b->lo));
    }
    return RF_OK;
}

/* Rank 0's `full` (the trained floats; NULL on the others) cut into every rank's shard: block r of
 * each bucket sent to rank r (the padded bucket through the staging buffer: zeros past its
 * end). Blocking, bucket by bucket. */
static rf_status scatter_buckets_root(rf_dp *dp, const float *full, float *shard, const char *what) {
    const rf_kernels *k = dp->m->k;
    rf_comm_p2p *ops = calloc((size_t)dp->size, sizeof *ops);
    rf_status st = ops ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < dp->nb; i++) {
        const dp_bucket *b = &dp->b[i];
        if (dp->rank != 0) {
            ops[0] = (rf_comm_p2p){shard + b->so, sizeof(float) * b->blk, 0, 0};
            st = rf_comm_sendrecv(dp->c, ops, 1, dp->o.timeout_s, what);
            continue;
        }
        const float *src = full + b->lo;
        if (padded(dp, i)) {
            k->zero(dp->pad, sizeof(float) * b->blk * (size_t)dp->size);
            k->copy(dp->pad, full + b->lo, sizeof(float) * (b->hi - b->lo));
            src = dp->pad;
        }
        for (int r = 1; r < dp->size; r++)
            ops[r - 1] = (rf_comm_p2p){(void *)(src + (size_t)r * b->blk), sizeof(float) * b->blk, r, 1};
        k->copy(shard + b->so, src, sizeof(float) * b->blk);
        st = rf_comm_sendrecv(dp->c, ops, dp->size - 1, dp->o.timeout_s, what);
    }
    free(ops);
    return st;
}

/* ---- set-up ---- */

static rf_status alloc_zero(rf_dp *dp) {
    const rf_kernels *k = dp->m->k;
    size_t bytes = sizeof(float) * (dp->shard_n ? dp->shard_n : 1);
    size_t pad = 0;
    for (int i = 0; i < dp->nb; i++)
        if (padded(dp, i)) pad = dp->b[i].blk * (size_t)dp->size;
    /* the gradient shard (sg) comes after the whole moments are freed (share_moments) */
    dp->sm = k->alloc(bytes), dp->sv = k->alloc(bytes);
    dp->pad = k->alloc(sizeof(float) * (pad ? pad : 1));
    if (!dp->sm || !dp->sv || !dp->pad)
        return rf_error(RF_ERR_NOMEM, "out of memory for the ZeRO-1 shard (%zu floats)", dp->shard_n);
    return make_segments(dp);
}

/* Rank 0's moments to every rank: broadcast (plain) or each rank its shard (ZeRO-1: rank 0
 * sends each rank its blocks), and the model's whole moments freed (ZeRO-1: the peers' before
 * their shards were allocated, rf_dp_init), then the gradient shard allocated: no rank holds
 * the whole moments and the shards together but rank 0, while it sends. */
static rf_status share_moments(rf_dp *dp) {
    rf_model *m = dp->m;
    size_t bytes = sizeof(float) * (m->n_params - m->n_frozen); /* the moments of the trained floats */
    const char *what = "sharing DP rank 0's optimizer state";
    if (!dp->o.zero) {
        RF_TRY(rf_comm_bcast(dp->c, m->opt_m, bytes, 0, dp->o.timeout_s, what));
        return rf_comm_bcast(dp->c, m->opt_v, bytes, 0, dp->o.timeout_s, what);
    }
    if (m->opt_step > 0 && !dp->o.moments) { /* else the shards are zero already or read (rf_dp_init) */
        RF_TRY(scatter_buckets_root(dp, m->opt_m, dp->sm, what));
        RF_TRY(scatter_buckets_root(dp, m->opt_v, dp->sv, what));
    }
    m->k->free(m->opt_m), m->k->free(m->opt_v);
    m->opt_m = m->opt_v = NULL;
    dp->sg = m->k->alloc(sizeof(float) * (dp->shard_n ? dp->shard_n : 1));
    return dp->sg ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for the ZeRO-1 gradient shard (%zu floats)", dp->shard_n);
}

static rf_status dp_ready(void *ctx, size_t offset, size_t n);

/* ZeRO-1, resuming: this rank's blocks of both moments read through o.moments, a segment (a
 * run of one tensor) at a time, straight into the shards; every rank learns whether all read
 * theirs. */
static rf_status read_moments(rf_dp *dp) {
    const rf_kernels *k = dp->m->k;
    int device = k != rf_cpu_kernels();
    size_t most = 0; /* a device shard: each segment through host staging */
    for (int i = 0; device && i < dp->nseg; i++) most = dp->seg[i].n > most ? dp->seg[i].n : most;
    float *stage = device ? malloc(sizeof(float) * (most ? most : 1)) : NULL;
    rf_status st = !device || stage ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for %zu floats", most);
    for (int i = 0; st == RF_OK && i < dp->nseg; i++) {
        const dp_seg *g = &dp->seg[i];
        for (int which = 1; st == RF_OK && which <= 2; which++) {
            float *dst = (which == 1 ? dp->sm : dp->sv) + g->s;
            st = dp->o.moments(dp->o.moments_ctx, which, g->p, g->n, device ? stage : dst);
            if (st == RF_OK && device) k->to_device(dst, stage, sizeof(float) * g->n);
        }
    }
    free(stage);
    if (st != RF_OK) st = rf_error_wrap(st, "ZeRO-1: reading this rank's optimizer state");
    int failed;
    RF_TRY(rf_comm_agree(dp->h, st, dp->o.timeout_s, "ZeRO-1: agreeing that every rank read its optimizer state", &failed));
    if (failed >= 0)
        return rf_error(RF_ERR_IO, "ZeRO-1: DP rank %d (world rank %d) could not read its optimizer state; its message "
                        "says why", failed, rf_comm_world_rank(dp->c, failed));
    return RF_OK;
}

rf_status rf_dp_init(rf_dp **out, rf_comm *c, rf_model *m, const rf_dp_opts *o) {
    *out = NULL;
    if (!m->grads || !m->opt_m || !m->opt_v)
        return rf_error(RF_ERR_ARG, "data parallelism needs a model with training buffers (rf_model_enable_training)");
    /* LoRA: the buckets, ZeRO-1's blocks and segments cover the gradient buffer (the adapters,
     * the parameters' floats from n_frozen on) */
    int device = m->k != rf_cpu_kernels();
    if (device != (rf_comm_backend(c) == RF_COMM_NCCL))
        return rf_error(RF_ERR_ARG, "data parallelism: the %s communicator cannot reduce %s gradients",
                        rf_comm_backend_name(c), device ? "device" : "host");
    rf_dp *dp = calloc(1, sizeof *dp);
    if (!dp) return rf_error(RF_ERR_NOMEM, "out of memory");
    dp->c = c, dp->h = rf_comm_host(c), dp->m = m, dp->o = *o;
    dp->rank = rf_comm_rank(c), dp->size = rf_comm_size(c);
    if (dp->o.timeout_s <= 0) dp->o.timeout_s = 30;
    rf_status st = make_buckets(dp);
    /* every rank starts from DP rank 0's state */
    if (st == RF_OK)
        st = rf_comm_bcast(dp->h, &m->opt_step, sizeof m->opt_step, 0, dp->o.timeout_s, "broadcasting the optimizer step");
    /* ZeRO-1: whole moments are never read but rank 0's after a step (a resumed run's), which
     * share_moments scatters, unless every rank reads its own blocks; before any step they are
     * zero, as the shards start */
    if (st == RF_OK && dp->o.zero && (dp->rank != 0 || m->opt_step == 0 || dp->o.moments)) {
        m->k->free(m->opt_m), m->k->free(m->opt_v);
        m->opt_m = m->opt_v = NULL;
    }
    if (st == RF_OK && dp->o.zero) st = alloc_zero(dp);
    if (st == RF_OK && dp->o.zero && dp->o.moments && m->opt_step > 0) st = read_moments(dp);
    if (st == RF_OK)
        st = rf_comm_bcast(c, m->params, sizeof(float) * m->n_params, 0, dp->o.timeout_s,
                           "broadcasting DP rank 0's parameters");
    m->k->weights_updated();
    if (st == RF_OK) st = share_moments(dp);
    if (st != RF_OK) {
        rf_dp_free(dp);
        return st;
    }
    rf_model_set_grad_hook(m, dp_ready, dp);
    *out = dp;
    return RF_OK;
}

rf_status rf_dp_init_tp(rf_dp **out, rf_comm *c, rf_model_tp *tp, const rf_dp_opts *o) {
    RF_TRY(rf_dp_init(out, c, tp->m, o));
    (*out)->tp = tp;
    return RF_OK;
}

void rf_dp_free(rf_dp *dp) {
    if (!dp) return;
    const rf_kernels *k = dp->m->k;
    if (dp->m->grad_ready == dp_ready) rf_model_set_grad_hook(dp->m, NULL, NULL);
    /* buckets still in flight (an error between arming and the sync) are released; a
     * collective abandoned half-way leaves the communicator failed */
    for (int i = 0; dp->b && i < dp->nb; i++) rf_comm_group_wait(dp->b[i].g, 0);
    k->free(dp->sg), k->free(dp->sm), k->free(dp->sv), k->free(dp->pad);
    free(dp->b), free(dp->seg);
    free(dp);
}

/* ---- small collectives ---- */

rf_status rf_dp_sum(rf_dp *dp, const long *in, long *out, int n, const char *what) {
    /* three base-4096 digits per count: each digit summed over fewer than 4096 ranks stays
     * below 2^24, where float sums are exact in any order */
    float *f = calloc(3 * (size_t)(n > 0 ? n : 1), sizeof(float));
    if (!f) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++)
        for (int d = 0; d < 3; d++) f[3 * i + d] = (float)((in[i] >> (12 * d)) & 4095);
    rf_status st = rf_comm_allreduce(dp->h, f, f, 3 * (size_t)n, dp->o.timeout_s, what);
    for (int i = 0; st == RF_OK && i < n; i++)
        out[i] = (long)f[3 * i] + ((long)f[3 * i + 1] << 12) + ((long)f[3 * i + 2] << 24);
    free(f);
    return st;
}

rf_status rf_dp_allgather(rf_dp *dp, const void *in, void *out, size_t bytes, const char *what) {
    return rf_comm_allgather(dp->h, in, out, bytes, dp->o.timeout_s, what);
}

/* ---- buckets ---- */

static rf_status start_bucket(rf_dp *dp, int i, int early) {
    dp_bucket *b = &dp->b[i];
    rf_model *m = dp->m;
    char what[96];
    /* a device back end: NCCL waits on the device for the kernels queued so far (comm.h), the
     * bucket's gradients and the padded staging below among them; the host goes on */
    if (!dp->o.zero) {
        snprintf(what, sizeof what, "allreduce of gradient bucket %d of %d", i + 1, dp->nb);
        RF_TRY(rf_comm_allreduce_start(dp->c, m->grads + b->lo, m->grads + b->lo, b->hi - b->lo,
                                       dp->o.timeout_s, what, &b->g));
    } else {
        const float *src = m->grads + b->lo;
        if (padded(dp, i)) {
            m->k->zero(dp->pad, sizeof(float) * b->blk * (size_t)dp->size);
            m->k->copy(dp->pad, src, sizeof(float) * (b->hi - b->lo));
            src = dp->pad;
        }
        snprintf(what, sizeof what, "reduce-scatter of gradient bucket %d of %d", i + 1, dp->nb);
        RF_TRY(rf_comm_reduce_scatter_start(dp->c, src, dp->sg + b->so, b->blk, dp->o.timeout_s, what, &b->g));
    }
    dp->st.buckets++;
    dp->st.buckets_early += early;
    return RF_OK;
}

/* Starts every bucket that lies wholly at or past `from`. */
static rf_status start_ready(rf_dp *dp, size_t from, int early) {
    while (dp->next < dp->nb && dp->b[dp->next].lo >= from) {
        RF_TRY(start_bucket(dp, dp->next, early));
        dp->next++;
    }
    return RF_OK;
}

/* Lets MPI move the buckets in flight forward (it does so only inside its calls). */
static rf_status progress(rf_dp *dp) {
    while (dp->done < dp->next) {
        int t = rf_comm_group_test(dp->b[dp->done].g);
        if (t < 0) return RF_ERR_IO;
        if (!t) break;
        dp->done++;
    }
    return RF_OK;
}

/* The hook: buckets past `offset` are final. Only the range at offset 0 (the embedding) is
 * reported as the pass ends; buckets started before it overlap with backward work. */
static rf_status dp_ready(void *ctx, size_t offset, size_t n) {
    rf_dp *dp = ctx;
    (void)n;
    if (!dp->armed) return RF_OK;
    if (!dp->o.defer) RF_TRY(start_ready(dp, offset, offset > 0));
    int before = dp->done;
    RF_TRY(progress(dp));
    if (offset > 0) dp->st.buckets_done_early += dp->done - before;
    return RF_OK;
}

void rf_dp_arm(rf_dp *dp) { dp->armed = 1; }

rf_status rf_dp_sync_grads(rf_dp *dp) {
    double t0 = rf_time_now();
    rf_status st = start_ready(dp, 0, 0);
    char first[1024] = "";
    if (st != RF_OK) snprintf(first, sizeof first, "%s", rf_error_message());
    /* after a failure the other buckets are released at once (the communicator has failed);
     * the first message is the one that says what happened */
    for (int i = 0; i < dp->nb; i++) {
        rf_status s = rf_comm_group_wait(dp->b[i].g, dp->o.timeout_s);
        dp->b[i].g = NULL;
        if (st == RF_OK && s != RF_OK) {
            st = s;
            snprintf(first, sizeof first, "%s", rf_error_message());
        }
    }
    dp->next = dp->done = 0, dp->armed = 0;
    dp->st.syncs++;
    dp->st.sync_start = t0, dp->st.sync_end = rf_time_now();
    dp->st.wait_s += dp->st.sync_end - t0;
    return st == RF_OK ? RF_OK : rf_error(st, "%s", first);
}

/* ---- optimizer ---- */

/* Is trained view `view` of a tensor-parallel shard whole on every rank of its group (under
 * LoRA an adapter's block, else a parameter's)? */
static int seg_replicated(const rf_dp *dp, int view) {
    if (dp->m->n_frozen) return dp->tp->lora_shards[view].split == RF_SPLIT_REPLICATED;
    return rf_model_tp_replicated(dp->tp, view);
}

/* ZeRO-1: the global squared norm from each shard's sum of squares; a double sent as two
 * floats (high part and remainder) keeps its precision through the float allreduce. With
 * tensor parallelism the sum is the TP shard's (its replicated tensors counted on TP rank 0
 * only), then summed over the TP group. */
static rf_status global_sumsq(rf_dp *dp, double *out) {
    const rf_kernels *k = dp->m->k;
    double local = 0;
    for (int i = 0; i < dp->nseg; i++)
        if (!dp->tp || dp->tp->t == 0 || !seg_replicated(dp, dp->seg[i].view))
            local += k->sum_squares(dp->sg + dp->seg[i].s, dp->seg[i].n);
    float *parts = malloc(sizeof(float) * 2 * (size_t)dp->size), mine[2];
    if (!parts) return rf_error(RF_ERR_NOMEM, "out of memory");
    mine[0] = (float)local, mine[1] = (float)(local - (double)mine[0]);
    rf_status st = rf_comm_allgather(dp->h, mine, parts, sizeof mine, dp->o.timeout_s,
                                     "allgather of the gradient norm");
    double sum = 0;
    for (int r = 0; r < dp->size; r++) sum += (double)parts[2 * r] + (double)parts[2 * r + 1];
    free(parts);
    *out = sum;
    if (st == RF_OK && dp->tp) st = rf_model_tp_sum(dp->tp, sum, out, "allgather of the gradient norm");
    return st;
}

static rf_status zero_step(rf_dp *dp, const rf_optim_opts *o, double *grad_norm, float *lr_used) {
    rf_model *m = dp->m;
    const rf_kernels *k = m->k;
    float *p = m->params + m->n_frozen; /* the trained floats (under LoRA the adapters) */
    double sumsq = 0;
    RF_TRY(global_sumsq(dp, &sumsq));
    double norm = sqrt(sumsq);
    *grad_norm = norm;
    if (!isfinite(norm)) return rf_error(RF_ERR_RANGE, "gradient norm is %g (a non-finite loss, advantage or "
                                              "reward): the update is not applied and training stops", norm);
    float gs = o->grad_clip > 0 && norm > o->grad_clip ? (float)(o->grad_clip / (norm + 1e-6)) : 1.0f;
    float lr = rf_lr_at(o, m->opt_step);
    int step = ++m->opt_step;
    for (int i = 0; i < dp->nseg; i++) {
        const dp_seg *s = &dp->seg[i];
        k->adamw(p + s->p, dp->sg + s->s, dp->sm + s->s, dp->sv + s->s, s->n, lr, o->beta1, o->beta2,
                 o->eps, s->no_decay ? 0.0f : o->weight_decay, step, gs);
    }
    if (lr_used) *lr_used = lr;
    /* the summed gradients are spent: their buffer stages the updated shard */
    to_shard(dp, p, dp->sg);
    rf_status st = gather_buckets(dp, dp->sg, p, "allgather of updated parameters");
    k->weights_updated();
    return st;
}

rf_status rf_dp_optim_step(rf_dp *dp, const rf_optim_opts *o, double *grad_norm, float *lr_used) {
    if (!dp->tp) return dp->o.zero ? zero_step(dp, o, grad_norm, lr_used) : rf_optim_step(dp->m, o, grad_norm, lr_used);
    RF_TRY(dp->o.zero ? zero_step(dp, o, grad_norm, lr_used) : rf_optim_step_tp(dp->tp, o, grad_norm, lr_used));
    rf_status st = rf_model_tp_bcast_replicated(dp->tp, dp->m->params, "broadcast of the replicated parameters");
    dp->m->k->weights_updated();
    return st;
}

rf_status rf_dp_gather_optimizer(rf_dp *dp) {
    rf_model *m = dp->m;
    if (!dp->o.zero || m->opt_m) return RF_OK;
    size_t bytes = sizeof(float) * (m->n_params - m->n_frozen); /* the moments of the trained floats */
    m->opt_m = m->k->alloc(bytes), m->opt_v = m->k->alloc(bytes);
    rf_status st = m->opt_m && m->opt_v ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for the optimizer state");
    if (st == RF_OK) st = gather_buckets(dp, dp->sm, m->opt_m, "allgather of the optimizer state");
    if (st == RF_OK) st = gather_buckets(dp, dp->sv, m->opt_v, "allgather of the optimizer state");
    if (st != RF_OK) rf_dp_release_optimizer(dp);
    return st;
}

rf_status rf_dp_moment_range(rf_dp *dp, int which, size_t a, size_t n, float *dst) {
    const float *shard = which == 1 ? dp->sm : dp->sv;
    size_t trained = dp->m->n_params - dp->m->n_frozen;
    if (!dp->o.zero || (which != 1 && which != 2) || a + n > trained || a + n < a)
        return rf_error(RF_ERR_ARG, "rf_dp_moment_range: moment %d, floats [%zu, %zu) of %zu%s", which, a, a + n,
                        trained, dp->o.zero ? "" : " without ZeRO-1");
    /* the pieces: bucket by bucket, rank by rank, [x0, x1) of rank r's block inside [a, a + n) */
    int cap = 0, k = 0;
    for (int i = 0; i < dp->nb; i++) cap += dp->b[i].lo < a + n && dp->b[i].hi > a ? dp->size : 0;
    rf_comm_p2p *ops = calloc((size_t)cap + 1, sizeof *ops);
    if (!ops) return rf_error(RF_ERR_NOMEM, "out of memory");
    /* a device model: rank 0 gathers the range on the device, then copies it to dst */
    const rf_kernels *kn = dp->m->k;
    float *host = dst;
    if (dp->rank == 0 && kn != rf_cpu_kernels() && !(dst = kn->alloc(sizeof(float) * (n ? n : 1)))) {
        free(ops);
        return rf_error(RF_ERR_NOMEM, "out of device memory for %zu floats of the optimizer state", n);
    }
    for (int i = 0; i < dp->nb; i++) {
        const dp_bucket *b = &dp->b[i];
        for (int r = 0; r < dp->size; r++) {
            size_t lo = b->lo + (size_t)r * b->blk, hi = lo + b->blk < b->hi ? lo + b->blk : b->hi;
            size_t x0 = lo > a ? lo : a, x1 = hi < a + n ? hi : a + n;
            if (x0 >= x1 || (dp->rank != 0 && r != dp->rank)) continue;
            const float *src = shard + b->so + (x0 - lo);
            size_t bytes = sizeof(float) * (x1 - x0);
            if (dp->rank != 0) ops[k++] = (rf_comm_p2p){(void *)src, bytes, 0, 1};
            else if (r != 0) ops[k++] = (rf_comm_p2p){dst + (x0 - a), bytes, r, 0};
            else dp->m->k->copy(dst + (x0 - a), src, bytes);
        }
    }
    rf_status st = rf_comm_sendrecv(dp->c, ops, k, dp->o.timeout_s, "gathering the optimizer state on rank 0");
    if (dst != host) {
        if (st == RF_OK) kn->to_host(host, dst, sizeof(float) * n);
        kn->free(dst);
    }
    free(ops);
    return st;
}

void rf_dp_release_optimizer(rf_dp *dp) {
    rf_model *m = dp->m;
    if (!dp->o.zero) return;
    m->k->free(m->opt_m), m->k->free(m->opt_v);
    m->opt_m = m->opt_v = NULL;
}
