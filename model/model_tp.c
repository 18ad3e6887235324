/* Tensor-parallel model: the shard's geometry from the layout rules, its parameters, buffers,
 * and the generation helpers that combine the ranks' vocabulary slices. The passes themselves
 * are in model_tp_pass.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/model_internal.h"
#include "model/model_tp_internal.h"

/* The sum of x over c (the group's own communicator, or its host one). */
static rf_status allreduce_on(rf_model_tp *tp, rf_comm *c, float *x, size_t n, const char *what, int layer) {
    if (tp->tp == 1) return RF_OK;
    char w[160];
    if (layer >= 0)
        snprintf(w, sizeof w, "tensor parallelism: %s of layer %d", what, layer);
    else
        snprintf(w, sizeof w, "tensor parallelism: %s", what);
    double t0 = rf_time_now();
    rf_status s = rf_comm_allreduce(c, x, x, n, tp->timeout_s, w);
    tp->comm_s += rf_time_now() - t0;
    tp->n_collectives++;
    return s;
}

rf_status rf__tp_allreduce(rf_model_tp *tp, float *x, size_t n, const char *what, int layer) {
    return allreduce_on(tp, tp->comm, x, n, what, layer);
}

rf_status rf__tp_allreduce_host(rf_model_tp *tp, float *x, size_t n, const char *what) {
    return allreduce_on(tp, rf_comm_host(tp->comm), x, n, what, -1);
}

rf_status rf__tp_allgather(rf_model_tp *tp, const void *in, void *out, size_t bytes, const char *what) {
    char w[160];
    snprintf(w, sizeof w, "tensor parallelism: %s", what);
    double t0 = rf_time_now();
    rf_status s = rf_comm_allgather(rf_comm_host(tp->comm), in, out, bytes, tp->timeout_s, w);
    tp->comm_s += rf_time_now() - t0;
    tp->n_collectives++;
    return s;
}

static int find_view(const rf_model_tp *tp, const char *name) {
    for (int i = 0; i < tp->n_full_views; i++)
        if (strcmp(tp->full_views[i].name, name) == 0) return i;
    return -1;
}

/* Which heads, vocabulary rows and intermediate rows this rank holds, read off its shards so
 * that they agree with resharding by construction. */
static rf_status geometry(rf_model_tp *tp) {
    const rf_model_config *c = &tp->cfg;
    const rf_shard *emb = &tp->shards[0]; /* model.embed_tokens.weight comes first */
    tp->v0 = (int)emb->r0, tp->Vl = (int)(emb->r1 - emb->r0);
    int g = find_view(tp, "model.layers.0.mlp.gate_proj.weight");
    if (g < 0) return rf_error(RF_ERR_ARG, "tensor-parallel model: a model without layers");
    tp->F = (int)(tp->shards[g].r1 - tp->shards[g].r0);
    tp->H = c->num_attention_heads / tp->tp, tp->h0 = tp->t * tp->H;
    int group = c->num_attention_heads / c->num_key_value_heads; /* query heads per k/v head */
    tp->kv_split = tp->tp == 1 || c->num_key_value_heads % tp->tp == 0;
    tp->kv0 = tp->h0 / group;
    tp->KV = (tp->h0 + tp->H - 1) / group - tp->kv0 + 1;
    tp->kv_row0 = tp->kv_split ? 0 : tp->kv0 * c->head_dim;
    tp->kv_of = rf_calloc((size_t)tp->H, sizeof(int));
    if (!tp->kv_of) return RF_ERR_NOMEM;
    /* attention maps local query head i to k/v head i / (H / KVA); keep the projected heads
     * when that is the true map, else give each query head its own copy */
    int direct = tp->H % tp->KV == 0;
    for (int i = 0; i < tp->H; i++) {
        tp->kv_of[i] = (tp->h0 + i) / group - tp->kv0;
        if (direct && tp->kv_of[i] != i / (tp->H / tp->KV)) direct = 0;
    }
    tp->KVA = direct ? tp->KV : tp->H;
    return RF_OK;
}

/* The shard's model must have exactly the layout's local buffer: same views, same blocks. */
static rf_status check_local_views(const rf_model_tp *tp) {
    const rf_model *m = tp->m;
    if (m->n_views != tp->n_full_views)
        return rf_error(RF_ERR_INTERNAL, "tensor-parallel model: %d local views, %d in the model",
                        m->n_views, tp->n_full_views);
    for (int i = 0; i < m->n_views; i++) {
        const rf_param_view *v = &m->views[i];
        const rf_shard *s = &tp->shards[i];
        int64_t cols = v->ndim == 2 ? v->shape[1] : 1;
        if (strcmp(v->name, tp->full_views[i].name) != 0 || v->shape[0] != s->r1 - s->r0 ||
            cols != s->c1 - s->c0 || v->offset != s->offset)
            return rf_error(RF_ERR_INTERNAL, "tensor-parallel model: local view %s (%lld x %lld at "
                            "%zu) is not the layout's shard (%lld x %lld at %zu)", v->name,
                            (long long)v->shape[0], (long long)cols, v->offset,
                            (long long)(s->r1 - s->r0), (long long)(s->c1 - s->c0), s->offset);
    }
    return RF_OK;
}

/* Views whose gradient a rank computes only in part: per-head norms shared by all heads, and
 * k/v projections held whole while each rank back-propagates through its own query heads. */
static rf_status find_sync_views(rf_model_tp *tp) {
    tp->sync_views = rf_calloc((size_t)tp->m->n_views, sizeof(int));
    if (!tp->sync_views) return RF_ERR_NOMEM;
    tp->sync_table = tp->m->views;
    if (tp->tp == 1) return RF_OK;
    for (int i = 0; i < tp->m->n_views; i++) {
        const rf_param_view *v = &tp->m->views[i];
        int partial = strstr(v->name, ".self_attn.q_norm.") || strstr(v->name, ".self_attn.k_norm.") ||
                      (!tp->kv_split && (strstr(v->name, ".self_attn.k_proj.") || strstr(v->name, ".self_attn.v_proj.")));
        if (!partial) continue;
        tp->sync_views[tp->n_sync++] = i;
        tp->sync_floats += v->numel;
    }
    return RF_OK;
}

static rf_status check_support(const rf_kernels *k, rf_comm *comm) {
    if (!k->logprob_vp_partials || !k->logprob_vp_backward)
        return rf_error(RF_ERR_UNSUPPORTED, "tensor-parallel model: the %s back end has no "
                        "vocabulary-parallel log-prob kernels (logprob_vp_partials) yet", k->name);
    /* the group's collectives move the back end's memory: host kernels over MPI (or one rank),
     * device kernels over NCCL (or one rank, nothing to move) */
    int device = strcmp(k->name, "cpu") != 0, nccl = rf_comm_backend(comm) == RF_COMM_NCCL;
    if (device ? !nccl && rf_comm_size(comm) > 1 : nccl)
        return rf_error(RF_ERR_ARG, "tensor-parallel model: %s kernels cannot share activations over the %s "
                        "communicator (%s)", k->name, rf_comm_backend_name(comm),
                        device ? "device memory goes over nccl" : "host memory goes over mpi");
    return RF_OK;
}

static rf_status setup(rf_model_tp *tp, const rf_kernels *k, float *borrow) {
    const rf_model_config *c = &tp->cfg;
    RF_TRY(rf_model_param_views(c, &tp->full_views, &tp->n_full_views, &tp->full_params));
    tp->shards = rf_calloc((size_t)tp->n_full_views, sizeof *tp->shards);
    if (!tp->shards) return RF_ERR_NOMEM;
    rf_param_table pt = {c, tp->full_views, tp->n_full_views};
    size_t n_floats = 0;
    RF_TRY(rf_layout_shards(&pt, tp->tp, tp->t, tp->shards, &n_floats));
    RF_TRY(geometry(tp));
    rf_model_config lc = *c;
    lc.num_attention_heads = tp->H;
    lc.num_key_value_heads = tp->kv_split ? c->num_key_value_heads / tp->tp : c->num_key_value_heads;
    lc.intermediate_size = tp->F;
    lc.vocab_size = tp->Vl;
    RF_TRY(borrow ? rf_model_init_borrowed(&tp->m, &lc, k, borrow) : rf_model_init(&tp->m, &lc, k));
    if (tp->m->n_params != n_floats)
        return rf_error(RF_ERR_INTERNAL, "tensor-parallel model: %zu local floats, the layout says %zu",
                        tp->m->n_params, n_floats);
    RF_TRY(check_local_views(tp));
    RF_TRY(find_sync_views(tp));
    tp->acts = rf_calloc((size_t)c->num_hidden_layers, sizeof *tp->acts);
    return tp->acts ? RF_OK : RF_ERR_NOMEM;
}

rf_status rf_model_tp_init(rf_model_tp **out, const rf_model_config *cfg, const rf_kernels *k,
                           rf_comm *comm, double timeout_s) {
    return rf_model_tp_init_borrowed(out, cfg, k, comm, timeout_s, NULL);
}

rf_status rf_model_tp_init_borrowed(rf_model_tp **out, const rf_model_config *cfg, const rf_kernels *k,
                                    rf_comm *comm, double timeout_s, float *params) {
    *out = NULL;
    rf_layout lay = {.tp = rf_comm_size(comm), .dp = 1};
    RF_TRY(rf_layout_check(&lay, cfg, lay.tp, "tensor-parallel model"));
    RF_TRY(check_support(k, comm));
    rf_model_tp *tp = rf_calloc(1, sizeof *tp);
    if (!tp) return RF_ERR_NOMEM;
    tp->cfg = *cfg;
    tp->comm = comm;
    tp->tp = lay.tp, tp->t = rf_comm_rank(comm);
    tp->timeout_s = timeout_s;
    rf_status s = setup(tp, k, params);
    if (s != RF_OK) {
        rf_model_tp_free(tp);
        return s;
    }
    *out = tp;
    return RF_OK;
}

void rf_model_tp_free(rf_model_tp *tp) {
    if (!tp) return;
    if (tp->m) {
        rf_model_tp_trim(tp);
        tp->m->k->free(tp->sync_mem);
    }
    rf_model_free(tp->m);
    free(tp->full_views);
    free(tp->shards);
    free(tp->lora_views);
    free(tp->lora_shards);
    free(tp->kv_of);
    free(tp->sync_views);
    free(tp->acts);
    free(tp->tokens), free(tp->local);
    free(tp->host);
    free(tp->lse);
    free(tp->ent);
    free(tp);
}

void rf_model_tp_trim(rf_model_tp *tp) {
    if (!tp) return;
    tp->m->k->free(tp->act_mem);
    tp->m->k->free(tp->gmem);
    tp->act_mem = tp->gmem = NULL, tp->act_cap = tp->gmem_cap = 0;
    tp->x_final = tp->h = tp->rstd_f = NULL, tp->d_local = NULL, tp->lora_tmp = tp->lora_du = NULL;
    tp->T = 0, tp->n_seq = 0, tp->have_logprobs = 0;
    rf_model_trim(tp->m);
}

rf_status rf_model_tp_set_full(rf_model_tp *tp, const float *full) {
    rf_param_table pt = {&tp->cfg, tp->full_views, tp->n_full_views};
    float *local = malloc(tp->m->n_params * sizeof(float));
    if (!local) return rf_error(RF_ERR_NOMEM, "out of memory for a shard of %zu floats", tp->m->n_params);
    rf_layout_extract(&pt, tp->shards, full, local);
    tp->m->k->to_device(tp->m->params, local, tp->m->n_params * sizeof(float));
    free(local);
    return RF_OK;
}

rf_status rf_model_tp_set_shard(rf_model_tp *tp, const rf_shard *shards, int n_views,
                                const float *local, size_t n_floats) {
    const char *who = "tensor-parallel model";
    if (n_views != tp->n_full_views)
        return rf_error(RF_ERR_ARG, "%s (rank %d of %d): the buffer describes %d parameters, the model "
                        "has %d", who, tp->t, tp->tp, n_views, tp->n_full_views);
    for (int i = 0; i < n_views; i++) {
        const rf_shard *a = &shards[i], *b = &tp->shards[i];
        if (a->full_rows == b->full_rows && a->full_cols == b->full_cols && a->r0 == b->r0 &&
            a->r1 == b->r1 && a->c0 == b->c0 && a->c1 == b->c1 && a->offset == b->offset)
            continue;
        return rf_error(RF_ERR_ARG, "%s (rank %d of %d): %s: the buffer holds rows [%lld, %lld) x "
                        "cols [%lld, %lld) of (%lld, %lld) at float %zu; this rank's shard is rows "
                        "[%lld, %lld) x cols [%lld, %lld) of (%lld, %lld) at float %zu", who, tp->t,
                        tp->tp, tp->full_views[i].name, (long long)a->r0, (long long)a->r1,
                        (long long)a->c0, (long long)a->c1, (long long)a->full_rows,
                        (long long)a->full_cols, a->offset, (long long)b->r0, (long long)b->r1,
                        (long long)b->c0, (long long)b->c1, (long long)b->full_rows,
                        (long long)b->full_cols, b->offset);
    }
    if (n_floats != tp->m->n_params)
        return rf_error(RF_ERR_ARG, "%s (rank %d of %d): the buffer holds %zu floats, this rank's "
                        "shard %zu", who, tp->t, tp->tp, n_floats, tp->m->n_params);
    tp->m->k->to_device(tp->m->params, local, n_floats * sizeof(float));
    tp->m->k->weights_updated();
    return RF_OK;
}

rf_status rf__tp_reserve_sync(rf_model_tp *tp) {
    if (!tp->sync_mem && tp->sync_floats) {
        tp->sync_mem = tp->m->k->alloc(2 * tp->sync_floats * sizeof(float));
        if (!tp->sync_mem) return rf_error(RF_ERR_NOMEM, "out of memory for gradient staging");
    }
    return RF_OK;
}

/* The blocks of the local adapters must be the layout's: same order, shapes and offsets. */
static rf_status check_lora_views(const rf_model_tp *tp) {
    const rf_model *m = tp->m;
    if (m->lora.n_views != tp->n_lora_views)
        return rf_error(RF_ERR_INTERNAL, "tensor-parallel LoRA: %d local adapters, %d in the model", m->lora.n_views,
                        tp->n_lora_views);
    for (int i = 0; i < tp->n_lora_views; i++) {
        const rf_param_view *v = &m->lora.views[i];
        const rf_shard *s = &tp->lora_shards[i];
        if (strcmp(v->name, tp->lora_views[i].name) != 0 || v->shape[0] != s->r1 - s->r0 ||
            v->shape[1] != s->c1 - s->c0 || v->offset - m->n_frozen != s->offset)
            return rf_error(RF_ERR_INTERNAL, "tensor-parallel LoRA: local adapter %s (%lld x %lld) is not the layout's "
                            "block (%lld x %lld)", v->name, (long long)v->shape[0], (long long)v->shape[1],
                            (long long)(s->r1 - s->r0), (long long)(s->c1 - s->c0));
    }
    return RF_OK;
}

/* Under LoRA the replicated adapters are the partial gradients (the base has none). */
static void lora_sync_views(rf_model_tp *tp) {
    tp->sync_table = tp->m->lora.views;
    tp->n_sync = 0, tp->sync_floats = 0;
    tp->m->k->free(tp->sync_mem);
    tp->sync_mem = NULL;
    for (int i = 0; tp->tp > 1 && i < tp->n_lora_views; i++) {
        if (tp->lora_shards[i].split != RF_SPLIT_REPLICATED) continue;
        tp->sync_views[tp->n_sync++] = i;
        tp->sync_floats += tp->m->lora.views[i].numel;
    }
}

/* The adapters o on the shard: attached (their blocks of the whole model's fresh values written
 * after the base), or with `bind` bound over the borrowed buffer, which holds them already. */
static rf_status tp_lora(rf_model_tp *tp, const rf_lora_opts *o, int bind) {
    rf_param_view *views = NULL;
    float *init = NULL, *local = NULL;
    int n = 0;
    RF_TRY(rf_lora_whole(o, &tp->cfg, &views, &n, &init));
    rf_shard *sh = calloc((size_t)n + 1, sizeof *sh);
    int *sync = realloc(tp->sync_views, sizeof(int) * ((size_t)n + 1));
    if (sync) tp->sync_views = sync;
    size_t nf = 0;
    rf_param_table pt = {&tp->cfg, views, n};
    rf_status st = sh && sync ? rf_layout_shards(&pt, tp->tp, tp->t, sh, &nf) : rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) st = bind ? rf_model_lora_bind(tp->m, o) : rf_model_lora_attach(tp->m, o);
    if (st == RF_OK) {
        tp->lora_views = views, tp->lora_shards = sh, tp->n_lora_views = n;
        views = NULL, sh = NULL;
        st = check_lora_views(tp);
    }
    if (st == RF_OK && !bind && !(local = malloc(sizeof(float) * (nf ? nf : 1))))
        st = rf_error(RF_ERR_NOMEM, "out of memory");
    if (st == RF_OK) {
        if (!bind) {
            rf_layout_extract(&pt, tp->lora_shards, init, local);
            tp->m->k->to_device(tp->m->params + tp->m->n_frozen, local, sizeof(float) * nf);
            tp->m->k->weights_updated();
        }
        lora_sync_views(tp);
        rf_model_tp_trim(tp); /* the activations grow by the adapters' */
    }
    free(views), free(sh), free(init), free(local);
    return st;
}

rf_status rf_model_tp_lora_attach(rf_model_tp *tp, const rf_lora_opts *o) { return tp_lora(tp, o, 0); }

rf_status rf_model_tp_lora_bind(rf_model_tp *tp, const rf_lora_opts *o) { return tp_lora(tp, o, 1); }

rf_status rf_model_tp_enable_training(rf_model_tp *tp) {
    RF_TRY(rf_model_enable_training(tp->m));
    return rf__tp_reserve_sync(tp);
}

void rf_model_tp_zero_grad(rf_model_tp *tp) { rf_model_zero_grad(tp->m); }

/* Activation floats per token of one layer, and the model-wide ones. */
static size_t layer_floats(const rf_model_tp *tp) {
    const rf_model_config *c = &tp->cfg;
    size_t C = c->hidden_size, D = c->head_dim, H = tp->H, KV = tp->KV, F = tp->F;
    size_t raw = c->qk_norm ? H * D + KV * D : 0, expanded = tp->KVA != tp->KV ? 2 * H * D : 0;
    return 4 * C + 2 + raw + H + KV + H * D + 2 * KV * D + expanded + H * D + H + 3 * F;
}

/* The adapters' scratch width: the widest input or output of a projection here. */
static size_t lora_width(const rf_model_tp *tp) {
    size_t C = tp->cfg.hidden_size, HD = (size_t)tp->H * tp->cfg.head_dim, KD = (size_t)tp->KV * tp->cfg.head_dim,
           F = tp->F, w = C > HD ? C : HD;
    w = w > F ? w : F;
    return w > KD ? w : KD;
}

/* Activation floats per token of the adapters: u of each (all layers) and the scratch. */
static size_t lora_floats(const rf_model_tp *tp) {
    const rf_model *m = tp->m;
    if (!m->lora.rank) return 0;
    size_t r = (size_t)m->lora.rank;
    return (size_t)m->lora.n_views / 2 * r + lora_width(tp) + r;
}

static rf_status reserve_host(rf_model_tp *tp, int T) {
    if (T <= tp->host_cap) return RF_OK;
    free(tp->tokens), free(tp->local), free(tp->host), free(tp->lse), free(tp->ent);
    tp->tokens = malloc(sizeof(int32_t) * (size_t)T);
    tp->local = malloc(sizeof(int32_t) * (size_t)T);
    tp->host = malloc(sizeof(float) * RF_TP_HOST_PER_TOKEN(tp) * (size_t)T);
    tp->lse = malloc(sizeof(float) * (size_t)T);
    tp->ent = malloc(sizeof(float) * (size_t)T);
    tp->host_cap = tp->tokens && tp->local && tp->host && tp->lse && tp->ent ? T : 0;
    return tp->host_cap ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory for %d tokens", T);
}

rf_status rf__tp_reserve(rf_model_tp *tp, int T) {
    RF_TRY(reserve_host(tp, T));
    if (T <= tp->act_cap) return RF_OK;
    const rf_model_config *c = &tp->cfg;
    const rf_kernels *k = tp->m->k;
    size_t t = rf__rows_padded(T), C = c->hidden_size, D = c->head_dim, H = tp->H, KV = tp->KV, F = tp->F;
    k->free(tp->act_mem);
    size_t lora = lora_floats(tp); /* per token, 0 without adapters */
    tp->act_mem = k->alloc(t * (layer_floats(tp) * c->num_hidden_layers + 2 * C + 2 + lora) * sizeof(float));
    tp->act_cap = tp->act_mem ? T : 0;
    if (!tp->act_mem) return rf_error(RF_ERR_NOMEM, "out of memory for activations of %d tokens", T);
    float *p = tp->act_mem;
#define TAKE(n) (p += (n), p - (n))
    for (int l = 0; l < c->num_hidden_layers; l++) {
        rf_tp_acts *a = &tp->acts[l];
        a->x = TAKE(t * C), a->ln1 = TAKE(t * C), a->rstd1 = TAKE(t);
        a->q_raw = c->qk_norm ? TAKE(t * H * D) : NULL;
        a->k_raw = c->qk_norm ? TAKE(t * KV * D) : NULL;
        a->q_rstd = TAKE(t * H), a->k_rstd = TAKE(t * KV);
        a->q = TAKE(t * H * D), a->k = TAKE(t * KV * D), a->v = TAKE(t * KV * D);
        int expanded = tp->KVA != tp->KV;
        a->ka = expanded ? TAKE(t * H * D) : a->k;
        a->va = expanded ? TAKE(t * H * D) : a->v;
        a->att = TAKE(t * H * D), a->lse = TAKE(t * H);
        a->x_mid = TAKE(t * C), a->ln2 = TAKE(t * C), a->rstd2 = TAKE(t);
        a->gate = TAKE(t * F), a->up = TAKE(t * F), a->act = TAKE(t * F);
        for (int i = 0; i < RF_LORA_N; i++)
            a->lora_u[i] = tp->m->layers[l].lora_a[i] ? TAKE(t * (size_t)tp->m->lora.rank) : NULL;
    }
    if (lora) tp->lora_tmp = TAKE(t * lora_width(tp)), tp->lora_du = TAKE(t * (size_t)tp->m->lora.rank);
    tp->x_final = TAKE(t * C), tp->h = TAKE(t * C), tp->rstd_f = TAKE(t);
    tp->d_local = (int32_t *)TAKE(t); /* sizeof(int32_t) == sizeof(float) */
#undef TAKE
    return RF_OK;
}

/* The views that train here and their blocks: the adapters under LoRA, else every view. */
static const rf_param_view *train_table(const rf_model_tp *tp, int *n, const rf_shard **shards) {
    if (tp->m->lora.rank) {
        *n = tp->m->lora.n_views, *shards = tp->lora_shards;
        return tp->m->lora.views;
    }
    *n = tp->m->n_views, *shards = tp->shards;
    return tp->m->views;
}

rf_status rf_model_tp_grad_sumsq(rf_model_tp *tp, double *out) {
    const rf_model *m = tp->m;
    if (!m->grads) return rf_error(RF_ERR_ARG, "tensor-parallel model: no gradients (enable training)");
    double local = 0.0;
    int n;
    const rf_shard *sh;
    const rf_param_view *v = train_table(tp, &n, &sh);
    for (int i = 0; i < n; i++)
        if (sh[i].split != RF_SPLIT_REPLICATED || tp->t == 0)
            local += m->k->sum_squares(m->grads + (v[i].offset - m->n_frozen), v[i].numel);
    return rf_model_tp_sum(tp, local, out, "allgather of gradient norms");
}

rf_status rf_model_tp_sum(rf_model_tp *tp, double local, double *out, const char *what) {
    /* in double and in rank order, so every rank gets the same bits */
    double *all = malloc(sizeof(double) * (size_t)tp->tp);
    if (!all) return rf_error(RF_ERR_NOMEM, "out of memory");
    rf_status s = rf__tp_allgather(tp, &local, all, sizeof(double), what);
    *out = 0.0;
    for (int r = 0; s == RF_OK && r < tp->tp; r++) *out += all[r];
    free(all);
    return s;
}

int rf_model_tp_replicated(const rf_model_tp *tp, int i) { return tp->shards[i].split == RF_SPLIT_REPLICATED; }

/* Packs (to_pack) the replicated views of buf into pack, or unpacks them. */
static size_t pack_replicated(const rf_model_tp *tp, float *buf, float *pack, int to_pack) {
    const rf_model *m = tp->m;
    size_t off = 0;
    int n;
    const rf_shard *sh;
    const rf_param_view *views = train_table(tp, &n, &sh); /* a frozen base never changes */
    for (int i = 0; i < n; i++) {
        if (sh[i].split != RF_SPLIT_REPLICATED) continue;
        const rf_param_view *v = &views[i];
        if (pack && to_pack) m->k->copy(pack + off, buf + v->offset, v->numel * sizeof(float));
        else if (pack) m->k->copy(buf + v->offset, pack + off, v->numel * sizeof(float));
        off += v->numel;
    }
    return off;
}

rf_status rf_model_tp_bcast_replicated(rf_model_tp *tp, float *buf, const char *what) {
    if (tp->tp == 1) return RF_OK;
    size_t n = pack_replicated(tp, buf, NULL, 1);
    float *pack = tp->m->k->alloc(sizeof(float) * (n ? n : 1));
    if (!pack) return rf_error(RF_ERR_NOMEM, "out of memory for %zu replicated floats", n);
    if (tp->t == 0) pack_replicated(tp, buf, pack, 1);
    char w[160];
    snprintf(w, sizeof w, "tensor parallelism: %s", what);
    double t0 = rf_time_now();
    rf_status s = rf_comm_bcast(tp->comm, pack, sizeof(float) * n, 0, tp->timeout_s, w);
    tp->comm_s += rf_time_now() - t0, tp->n_collectives++;
    if (s == RF_OK && tp->t != 0) pack_replicated(tp, buf, pack, 0);
    tp->m->k->free(pack);
    return s;
}

rf_status rf_model_tp_kv_cache_init(rf_model_tp *tp, rf_kv_cache *c, int n_slots, int max_len) {
    memset(c, 0, sizeof *c);
    int limit = rf_config_max_seq(&tp->cfg);
    if (max_len > limit)
        return rf_error(RF_ERR_RANGE, "KV cache length %d exceeds the model's limit of %d", max_len, limit);
    c->n_slots = n_slots, c->max_len = max_len, c->n_layers = tp->cfg.num_hidden_layers;
    c->KVH = tp->KVA, c->D = tp->cfg.head_dim;
    size_t n = (size_t)c->n_layers * n_slots * max_len * c->KVH * c->D;
    c->k = tp->m->k->alloc(n * sizeof(float));
    c->v = tp->m->k->alloc(n * sizeof(float));
    c->len = calloc((size_t)n_slots, sizeof(int));
    if (!c->k || !c->v || !c->len) {
        rf_kv_cache_free(c, tp->m);
        return rf_error(RF_ERR_NOMEM, "out of memory for a KV cache of %d x %d positions", n_slots, max_len);
    }
    return RF_OK;
}

rf_status rf_model_tp_kv_pool_init(rf_model_tp *tp, rf_kv_pool *p, int n_blocks, int block_size) {
    return rf_kv_pool_init_heads(p, tp->m->k, tp->cfg.num_hidden_layers, tp->KVA, tp->cfg.head_dim,
                                 n_blocks, block_size);
}

/* First vocabulary row of rank r's slice: the balanced split of layout.h. */
static int slice_start(const rf_model_tp *tp, int r) {
    return (int)((int64_t)tp->cfg.vocab_size * r / tp->tp);
}

/* One rank's figures of one row of logits (its slice). */
typedef struct slice_part {
    float max;   /* largest logit of the slice */
    int32_t id;  /* its whole-vocabulary id (the lowest on ties) */
    double sum;  /* sum of exp((z - max) * inv_temp) over the slice */
} slice_part;

rf_status rf_model_tp_greedy(rf_model_tp *tp, const float *logits, int n, int32_t *tokens,
                             float *logp) {
    size_t m = (size_t)(n > 0 ? n : 1);
    rf_draw *d = malloc(sizeof *d * m);
    float *lp = logp ? logp : malloc(sizeof *lp * m);
    rf_status st = d && lp ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RF_OK && i < n; i++) d[i] = (rf_draw){i, {1, 1.0f, 0, 1.0f}, 0.0};
    if (st == RF_OK) st = rf_model_tp_sample(tp, logits, n, d, n, tokens, lp);
    free(d);
    if (lp != logp) free(lp);
    return st;
}

/* ---- sampling from slices ---- */

/* A row's whole-vocabulary figures, from every rank's slice_part (the same on every rank). */
typedef struct row_stats {
    float inv_temp;
    int sorted;   /* top-k / top-p: drawn from candidates */
    int32_t best; /* the argmax id (lowest on ties) */
    float max;    /* its logit */
    double lse;   /* log-sum-exp at inv_temp */
} row_stats;

/* A candidate of a top-k / top-p row: its logit and whole-vocabulary id. */
typedef struct cand {
    float z;
    int32_t id;
} cand;

static int cand_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->z != y->z) return x->z > y->z ? -1 : 1;
    return x->id - y->id;
}

/* A pick of a draw in id order: the id (-1 on the ranks that do not hold it) and log-prob. */
typedef struct pick {
    int32_t id;
    float logp;
} pick;

/* A slice's share of its row's probability: its sum of exp(z * inv_temp - lse). */
static double slice_mass(const slice_part *p, const row_stats *r) {
    return p->sum * exp((double)p->max * r->inv_temp - r->lse);
}

/* The draws in id order: each rank walks its slice for the draws whose point of the cumulative
 * distribution falls in it (the slices' masses from the row statistics), then the picks are
 * gathered. */
static rf_status draw_in_order(rf_model_tp *tp, const float *logits, const row_stats *rs, const slice_part *all,
                               int n_rows, const rf_draw *draws, int n_draws, int32_t *tokens, float *logp) {
    int T = tp->tp, me = tp->t, n = 0;
    for (int i = 0; i < n_draws; i++) n += !draws[i].s.greedy && !rs[draws[i].row].sorted;
    if (!n) return RF_OK;
    pick *mine = malloc(sizeof *mine * (size_t)n), *got = malloc(sizeof *got * (size_t)n * T);
    rf_status st = mine && got ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int i = 0, k = 0; st == RF_OK && i < n_draws; i++) {
        const rf_draw *d = &draws[i];
        const row_stats *r = &rs[d->row];
        if (d->s.greedy || r->sorted) continue;
        double total = 0, before = 0;
        for (int q = 0; q < T; q++) total += slice_mass(&all[(size_t)q * n_rows + d->row], r);
        double target = d->u * total;
        int owner = 0; /* the slice the draw's point falls in (the last, past rounding) */
        for (; owner < T - 1; owner++) {
            double m = slice_mass(&all[(size_t)owner * n_rows + d->row], r);
            if (target < before + m) break;
            before += m;
        }
        mine[k] = (pick){-1, 0.0f};
        if (owner == me) {
            const float *z = logits + (size_t)d->row * tp->Vl;
            int j = 0;
            double cum = before;
            for (; j < tp->Vl; j++) {
                cum += (double)expf((float)((double)z[j] * r->inv_temp - r->lse));
                if (target < cum) break;
            }
            if (j == tp->Vl) j = tp->Vl - 1; /* rounding past the slice's end: its last id */
            mine[k] = (pick){tp->v0 + j, (float)((double)z[j] * r->inv_temp - r->lse)};
        }
        k++;
    }
    if (st == RF_OK) st = rf__tp_allgather(tp, mine, got, sizeof *mine * (size_t)n, "allgather of sampled tokens");
    for (int i = 0, k = 0; st == RF_OK && i < n_draws; i++) {
        if (draws[i].s.greedy || rs[draws[i].row].sorted) continue;
        for (int q = 0; q < T; q++)
            if (got[(size_t)q * n + k].id >= 0) tokens[i] = got[(size_t)q * n + k].id, logp[i] = got[(size_t)q * n + k].logp;
        k++;
    }
    free(mine), free(got);
    return st;
}

/* The draws of top-k / top-p rows: every rank's candidates of each such row gathered (padded
 * to the largest rank's count), merged in logit order and drawn from. */
static rf_status draw_sorted(rf_model_tp *tp, const float *logits, const row_stats *rs, int n_rows,
                             const rf_draw *draws, int n_draws, int32_t *tokens, float *logp) {
    int T = tp->tp, n_sorted = 0;
    for (int r = 0; r < n_rows; r++) n_sorted += rs[r].sorted;
    if (!n_sorted) return RF_OK;
    size_t cap = 1024; /* mine's room, grown as the rows' candidates come */
    cand *mine = malloc(sizeof *mine * cap), *all = NULL, *merged = NULL;
    int32_t *idx = malloc(sizeof *idx * (size_t)tp->Vl), *counts = malloc(sizeof *counts * (size_t)n_rows),
            *every = malloc(sizeof *every * (size_t)n_rows * T);
    float *mz = NULL, *scratch = malloc(sizeof *scratch * (size_t)tp->Vl);
    int32_t *mid = NULL;
    rf_status st = mine && idx && counts && every && scratch ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    size_t used = 0;
    for (int r = 0; st == RF_OK && r < n_rows; r++) {
        counts[r] = 0;
        if (!rs[r].sorted) continue;
        const rf_draw *d = NULL;
        for (int i = 0; i < n_draws && !d; i++)
            if (draws[i].row == r) d = &draws[i];
        /* this rank's candidates: rf_sample_candidates on the slice (its top-k, and enough of its
         * largest logits that their mass passes top_p: a token of the whole row's nucleus has
         * less mass above it in its slice than in the row, so the nucleus's tokens of this slice
         * are all among them) */
        const float *z = logits + (size_t)r * tp->Vl;
        int n = counts[r] = rf_sample_candidates(z, tp->Vl, &d->s, rs[r].lse, idx, scratch);
        if (used + (size_t)n > cap) {
            size_t want = 2 * (used + (size_t)n);
            cand *bigger = realloc(mine, sizeof *mine * want);
            if (!bigger) {
                st = rf_error(RF_ERR_NOMEM, "out of memory");
                break;
            }
            mine = bigger, cap = want;
        }
        for (int i = 0; i < n; i++) mine[used + (size_t)i] = (cand){z[idx[i]], tp->v0 + idx[i]};
        used += (size_t)n;
    }
    if (st == RF_OK) st = rf__tp_allgather(tp, counts, every, sizeof *counts * (size_t)n_rows, "allgather of candidate counts");
    size_t width = 0, most = 0; /* the widest rank's candidates; the most of one row */
    for (int q = 0; st == RF_OK && q < T; q++) {
        size_t sum = 0;
        for (int r = 0; r < n_rows; r++) {
            sum += (size_t)every[(size_t)q * n_rows + r];
            size_t row_all = 0;
            for (int x = 0; x < T; x++) row_all += (size_t)every[(size_t)x * n_rows + r];
            most = row_all > most ? row_all : most;
        }
        width = sum > width ? sum : width;
    }
    if (st == RF_OK) {
        cand *padded = width > cap ? realloc(mine, sizeof *mine * width) : mine;
        all = malloc(sizeof *all * (width ? width : 1) * T);
        merged = malloc(sizeof *merged * (most ? most : 1));
        mz = malloc(sizeof *mz * (most ? most : 1)), mid = malloc(sizeof *mid * (most ? most : 1));
        if (padded) mine = padded;
        if (!padded || !all || !merged || !mz || !mid) st = rf_error(RF_ERR_NOMEM, "out of memory");
        else memset(mine + used, 0, sizeof *mine * (width - used));
    }
    if (st == RF_OK) st = rf__tp_allgather(tp, mine, all, sizeof *mine * width, "allgather of sampling candidates");
    size_t *at = st == RF_OK ? calloc((size_t)T, sizeof *at) : NULL; /* each rank's next candidate */
    if (st == RF_OK && !at) st = rf_error(RF_ERR_NOMEM, "out of memory");
    for (int r = 0; st == RF_OK && r < n_rows; r++) {
        if (!rs[r].sorted) continue;
        int n = 0;
        for (int q = 0; q < T; q++) {
            int c = every[(size_t)q * n_rows + r];
            memcpy(merged + n, all + (size_t)q * width + at[q], sizeof *merged * (size_t)c);
            n += c, at[q] += (size_t)c;
        }
        qsort(merged, (size_t)n, sizeof *merged, cand_desc);
        for (int i = 0; i < n; i++) mz[i] = merged[i].z, mid[i] = merged[i].id;
        for (int i = 0; i < n_draws; i++) {
            if (draws[i].row != r) continue;
            int k = rf_sample_sorted(mz, n, &draws[i].s, rs[r].lse, draws[i].u);
            tokens[i] = mid[k], logp[i] = (float)((double)mz[k] * rs[r].inv_temp - rs[r].lse);
        }
    }
    free(at), free(mine), free(all), free(merged), free(mz), free(mid), free(idx), free(counts), free(every), free(scratch);
    return st;
}

rf_status rf_model_tp_sample(rf_model_tp *tp, const float *logits, int n_rows, const rf_draw *draws, int n_draws,
                             int32_t *tokens, float *logp) {
    for (int i = 0; i < n_draws; i++)
        if (draws[i].row < 0 || draws[i].row >= n_rows)
            return rf_error(RF_ERR_ARG, "sampling from slices: draw %d is from row %d of %d", i, draws[i].row, n_rows);
    size_t R = (size_t)(n_rows > 0 ? n_rows : 1);
    row_stats *rs = calloc(R, sizeof *rs);
    slice_part *mine = calloc(R, sizeof *mine), *all = malloc(sizeof *all * R * (size_t)tp->tp);
    rf_status st = rs && mine && all ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    for (int r = 0; st == RF_OK && r < n_rows; r++) rs[r].inv_temp = 1.0f;
    for (int i = 0; st == RF_OK && i < n_draws; i++) { /* a row's temperature and kind: its draws' */
        const rf_sampling *s = &draws[i].s;
        rs[draws[i].row].inv_temp = rf_sampling_inv_temp(s);
        rs[draws[i].row].sorted = rf_sampling_sorted(s);
    }
    for (int r = 0; st == RF_OK && r < n_rows; r++) { /* the slice's max, its first id, sum exp((z - max) * it) */
        const float *z = logits + (size_t)r * tp->Vl;
        int best = 0;
        for (int j = 1; j < tp->Vl; j++)
            if (z[j] > z[best]) best = j;
        double sum = 0;
        for (int j = 0; j < tp->Vl; j++) sum += (double)expf((z[j] - z[best]) * rs[r].inv_temp);
        mine[r] = (slice_part){z[best], tp->v0 + best, sum};
    }
    if (st == RF_OK) st = rf__tp_allgather(tp, mine, all, sizeof *mine * (size_t)n_rows, "allgather of row statistics");
    for (int r = 0; st == RF_OK && r < n_rows; r++) {
        int best = 0; /* ranks hold increasing ids: the first of equal maxima is the lowest id */
        for (int q = 1; q < tp->tp; q++)
            if (all[(size_t)q * n_rows + r].max > all[(size_t)best * n_rows + r].max) best = q;
        float M = all[(size_t)best * n_rows + r].max;
        double S = 0;
        for (int q = 0; q < tp->tp; q++) {
            const slice_part *p = &all[(size_t)q * n_rows + r];
            S += p->sum * exp((double)(p->max - M) * rs[r].inv_temp);
        }
        rs[r].best = all[(size_t)best * n_rows + r].id, rs[r].max = M;
        rs[r].lse = (double)M * rs[r].inv_temp + log(S);
    }
    for (int i = 0; st == RF_OK && i < n_draws; i++)
        if (draws[i].s.greedy) {
            const row_stats *r = &rs[draws[i].row];
            tokens[i] = r->best, logp[i] = (float)((double)r->max * r->inv_temp - r->lse);
        }
    if (st == RF_OK) st = draw_in_order(tp, logits, rs, all, n_rows, draws, n_draws, tokens, logp);
    if (st == RF_OK) st = draw_sorted(tp, logits, rs, n_rows, draws, n_draws, tokens, logp);
    free(rs), free(mine), free(all);
    return st;
}

rf_status rf_model_tp_gather_logits(rf_model_tp *tp, const float *logits, int n, float *full) {
    int V = tp->cfg.vocab_size, W = (V + tp->tp - 1) / tp->tp; /* the widest slice */
    size_t row = (size_t)n * W;
    float *mine = calloc(row ? row : 1, sizeof(float)), *all = malloc(sizeof(float) * (row ? row : 1) * tp->tp);
    if (!mine || !all) {
        free(mine), free(all);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) memcpy(mine + (size_t)i * W, logits + (size_t)i * tp->Vl, sizeof(float) * tp->Vl);
    rf_status st = rf__tp_allgather(tp, mine, all, row * sizeof(float), "allgather of logits");
    for (int r = 0; st == RF_OK && r < tp->tp; r++) {
        int a = slice_start(tp, r), b = slice_start(tp, r + 1);
        for (int i = 0; i < n; i++)
            memcpy(full + (size_t)i * V + a, all + row * r + (size_t)i * W, sizeof(float) * (size_t)(b - a));
    }
    free(mine), free(all);
    return st;
}
