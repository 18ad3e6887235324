/* Tensor-parallel generation: rank 0's engine calls that drive the group, and the peers'
 * command loop (rollout_tp.h). */
#include "rollout/rollout_tp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define MAGIC 0x52465254u /* "RFRT" */

/* Commands beyond the public ones (rollout_tp.h). */
enum { CMD_NOP = 100, CMD_POOL, CMD_STEP, CMD_RELEASE };

/* What rank 0 broadcasts first for every command; a step's int32 payload follows it. */
typedef struct cmd_head {
    uint32_t magic;
    int32_t cmd;
    int32_t n_rows, n_copies; /* CMD_STEP */
    int32_t n_draws, n_capture; /* CMD_STEP */
    int64_t n_ints;           /* CMD_STEP: payload int32s */
    int64_t arg;              /* the caller's; CMD_POOL: n_blocks << 32 | block_size */
} cmd_head;

/* int32 words of a step's payload holding one draw */
#define DRAW_INTS (sizeof(rf_draw) / sizeof(int32_t))

struct rf_rollout_tp {
    rf_model_tp *tp;
    double timeout_s, last_cmd;
    rf_kv_pool pool;          /* peers: their pool (rank 0's is the engine's) */
    int32_t *copies;          /* (n_copies, 3) rank 0: copies on write (dst, src, rows) queued for
                                 the next step; room for cap_copies int32s */
    int n_copies;
    size_t cap_copies;
    int32_t *ints;            /* (cap_ints) a step's payload */
    size_t cap_ints;
    rf_paged_seq *seqs;       /* (cap_seqs) peers: the step's rows */
    size_t cap_seqs;
    float *slice, *full;      /* (n, Vl) this rank's logits; peers: (n_capture, V) captured rows */
    size_t cap_slice, cap_full;
    float *cap_rows;          /* (n_capture, Vl) this rank's slices of the captured rows */
    size_t cap_cap_rows;
    rf_draw *draws;           /* peers: (cap_draws) a step's draws, and their picks */
    int32_t *picks;
    float *pick_logp;
    size_t cap_draws, cap_picks, cap_logp;
    rf_status st;             /* rank 0: a copy that could not be queued, reported at the next step */
    rf_status (*guard_begin)(void *ctx); /* peers: around each step (rf_rollout_tp_set_guard) */
    void (*guard_end)(void *ctx);
    void *guard_ctx;
};

void rf_rollout_tp_set_guard(rf_rollout_tp *g, rf_status (*begin)(void *ctx), void (*end)(void *ctx), void *ctx) {
    g->guard_begin = begin, g->guard_end = end, g->guard_ctx = ctx;
}

/* A peer's step, inside the guard when there is one. */
static rf_status serve_step(rf_rollout_tp *g, const cmd_head *h);
static rf_status guarded_step(rf_rollout_tp *g, const cmd_head *h) {
    if (!g->guard_begin) return serve_step(g, h);
    RF_TRY(g->guard_begin(g->guard_ctx));
    rf_status st = serve_step(g, h);
    g->guard_end(g->guard_ctx);
    return st;
}

/* Grows *p to hold n elements of `size` bytes (contents kept). */
static rf_status grow(void **p, size_t *cap, size_t n, size_t size) {
    if (n <= *cap) return RF_OK;
    void *q = realloc(*p, n * size);
    if (!q) return rf_error(RF_ERR_NOMEM, "rollout tensor parallelism: out of memory for %zu elements", n);
    *p = q, *cap = n;
    return RF_OK;
}

rf_status rf_rollout_tp_init(rf_rollout_tp **out, rf_model_tp *tp, double timeout_s) {
    *out = rf_calloc(1, sizeof **out);
    if (!*out) return RF_ERR_NOMEM;
    (*out)->tp = tp, (*out)->timeout_s = timeout_s, (*out)->last_cmd = rf_time_now();
    return RF_OK;
}

void rf_rollout_tp_free(rf_rollout_tp *g) {
    if (!g) return;
    rf_kv_pool_free(&g->pool);
    free(g->copies), free(g->ints), free(g->seqs), free(g->slice), free(g->full), free(g->cap_rows);
    free(g->draws), free(g->picks), free(g->pick_logp);
    free(g);
}

/* ---- rank 0 ---- */

/* Rank 0: broadcasts a command header to the group (bounded), noting when. */
static rf_status send_head(rf_rollout_tp *g, cmd_head *h) {
    h->magic = MAGIC;
    g->last_cmd = rf_time_now();
    return rf_comm_bcast(rf_comm_host(g->tp->comm), h, sizeof *h, 0, g->timeout_s,
                         "rollout tensor parallelism: sending a command to the group");
}

rf_status rf_rollout_tp_send(rf_rollout_tp *g, int cmd, int64_t arg) {
    cmd_head h = {.cmd = cmd, .arg = arg};
    return send_head(g, &h);
}

rf_status rf_rollout_tp_keepalive(rf_rollout_tp *g) {
    if (g->tp->tp == 1 || rf_time_now() - g->last_cmd < g->timeout_s / 4) return RF_OK;
    return rf_rollout_tp_send(g, CMD_NOP, 0);
}

/* A step's draws and the rows whose whole logits rank 0 keeps. */
typedef struct step_draws {
    const rf_draw *draws;
    int n_draws;
    int32_t *picks;
    float *logp;
    const int *capture;
    int n_capture;
    float *whole; /* (n_capture, V) */
} step_draws;

/* Every rank: the step on this rank's heads and vocabulary rows, the draws made from the
 * slices of the logits (rf_model_tp_sample), and the captured rows gathered whole. */
static rf_status run_step(rf_rollout_tp *g, rf_kv_pool *p, const rf_paged_seq *seqs, int n,
                          const int32_t *tokens, const step_draws *d) {
    size_t Vl = (size_t)g->tp->Vl;
    RF_TRY(grow((void **)&g->slice, &g->cap_slice, (size_t)n * Vl, sizeof(float)));
    RF_TRY(rf_model_tp_decode_paged(g->tp, p, seqs, n, tokens, g->slice));
    RF_TRY(rf_model_tp_sample(g->tp, g->slice, n, d->draws, d->n_draws, d->picks, d->logp));
    if (!d->n_capture) return RF_OK;
    RF_TRY(grow((void **)&g->cap_rows, &g->cap_cap_rows, (size_t)d->n_capture * Vl, sizeof(float)));
    for (int i = 0; i < d->n_capture; i++) {
        if (d->capture[i] < 0 || d->capture[i] >= n)
            return rf_error(RF_ERR_FORMAT, "rollout tensor parallelism: a captured row %d of a step of %d rows",
                            d->capture[i], n);
        memcpy(g->cap_rows + (size_t)i * Vl, g->slice + (size_t)d->capture[i] * Vl, sizeof(float) * Vl);
    }
    return rf_model_tp_gather_logits(g->tp, g->cap_rows, d->n_capture, d->whole);
}

/* The engine's pool: rank 0's own, then the peers make theirs of the same blocks. */
static rf_status engine_pool_init(void *ctx, rf_kv_pool *p, int n_blocks, int block_size) {
    rf_rollout_tp *g = ctx;
    RF_TRY(rf_model_tp_kv_pool_init(g->tp, p, n_blocks, block_size));
    return rf_rollout_tp_send(g, CMD_POOL, (int64_t)n_blocks << 32 | (uint32_t)block_size);
}

/* The pool's memory and the shard's workspace given back on every rank; each allocates the
 * pool again at its next step. */
static rf_status engine_pool_release(void *ctx, rf_kv_pool *p) {
    rf_rollout_tp *g = ctx;
    RF_TRY(rf_kv_pool_release(p));
    rf_model_tp_trim(g->tp);
    return rf_rollout_tp_send(g, CMD_RELEASE, 0);
}

/* A copy on write: done here at once, queued for the peers' next step. */
static void engine_copy(void *ctx, rf_kv_pool *p, int dst, int src, int n_rows) {
    rf_rollout_tp *g = ctx;
    rf_kv_pool_copy(p, dst, src, n_rows);
    rf_status st = grow((void **)&g->copies, &g->cap_copies, 3 * ((size_t)g->n_copies + 1), sizeof(int32_t));
    if (st != RF_OK) {
        if (g->st == RF_OK) g->st = st;
        return;
    }
    int32_t *c = g->copies + 3 * g->n_copies++;
    c[0] = dst, c[1] = src, c[2] = n_rows;
}

/* The step's payload: queued copies (dst, src, rows), each row's (n_cached, n_new, blocks),
 * the block tables, the tokens, the captured rows, the draws. */
static rf_status pack_step(rf_rollout_tp *g, const rf_kv_pool *p, const rf_paged_seq *seqs, int n,
                           const int32_t *tokens, const step_draws *d, cmd_head *h) {
    size_t n_ints = 3 * (size_t)g->n_copies + 3 * (size_t)n + (size_t)d->n_capture + DRAW_INTS * (size_t)d->n_draws, T = 0;
    for (int i = 0; i < n; i++) {
        n_ints += (size_t)rf_kv_pool_blocks_for(p, seqs[i].n_cached + seqs[i].n_new) + (size_t)seqs[i].n_new;
        T += (size_t)seqs[i].n_new;
    }
    RF_TRY(grow((void **)&g->ints, &g->cap_ints, n_ints, sizeof(int32_t)));
    int32_t *w = g->ints;
    if (g->n_copies) memcpy(w, g->copies, sizeof(int32_t) * 3 * (size_t)g->n_copies);
    w += 3 * g->n_copies;
    for (int i = 0; i < n; i++) {
        int nb = rf_kv_pool_blocks_for(p, seqs[i].n_cached + seqs[i].n_new);
        *w++ = seqs[i].n_cached, *w++ = seqs[i].n_new, *w++ = nb;
        memcpy(w, seqs[i].blocks, sizeof(int32_t) * (size_t)nb);
        w += nb;
    }
    memcpy(w, tokens, sizeof(int32_t) * T);
    w += T;
    if (d->n_capture) memcpy(w, d->capture, sizeof(int32_t) * (size_t)d->n_capture);
    w += d->n_capture;
    if (d->n_draws) memcpy(w, d->draws, sizeof(rf_draw) * (size_t)d->n_draws);
    *h = (cmd_head){.cmd = CMD_STEP, .n_rows = n, .n_copies = g->n_copies, .n_draws = d->n_draws,
                    .n_capture = d->n_capture, .n_ints = (int64_t)n_ints};
    g->n_copies = 0;
    return RF_OK;
}

/* The step's model call and draws: the peers get the step, then every rank runs it. */
static rf_status engine_decode_sample(void *ctx, rf_kv_pool *p, const rf_paged_seq *seqs, int n, const int32_t *tokens,
                                      const rf_draw *draws, int n_draws, int32_t *picks, float *logp,
                                      const int *capture, int n_capture, float *whole,
                                      const float *capture_inv_temp, float *whole_lse) {
    rf_rollout_tp *g = ctx;
    (void)capture_inv_temp; /* the group's vocabulary-parallel sampler has its own log-softmax */
    for (int i = 0; i < n_capture; i++) whole_lse[i] = NAN;
    RF_TRY(g->st);
    step_draws d = {draws, n_draws, picks, logp, capture, n_capture, whole};
    cmd_head h;
    RF_TRY(pack_step(g, p, seqs, n, tokens, &d, &h));
    RF_TRY(send_head(g, &h));
    RF_TRY(rf_comm_bcast(rf_comm_host(g->tp->comm), g->ints, sizeof(int32_t) * (size_t)h.n_ints, 0, g->timeout_s,
                         "rollout tensor parallelism: sending a step to the group"));
    return run_step(g, p, seqs, n, tokens, &d);
}

rf_status rf_rollout_tp_engine(rf_rollout_tp *g, const rf_rollout_opts *o, rf_rollout **e) {
    *e = NULL;
    if (g->tp->t != 0)
        return rf_error(RF_ERR_ARG, "rollout tensor parallelism: the engine runs on rank 0 of the group, not %d", g->tp->t);
    if (!g->tp->m->lm_head) return rf_error(RF_ERR_ARG, "rollout: the model has a value head, not an LM head");
    rf_rollout_model mc = {.cfg = &g->tp->cfg, .ctx = g, .k = g->tp->m->k, .kv_heads = g->tp->KVA,
                           .pool_init = engine_pool_init, .pool_release = engine_pool_release,
                           .copy = engine_copy, .decode_sample = engine_decode_sample};
    return rf_rollout_init_model(e, &mc, o);
}

/* ---- peers ---- */

/* A peer: the next command header from rank 0, waiting at most 2 x the bound. */
static rf_status recv_head(rf_rollout_tp *g, cmd_head *h) {
    RF_TRY(rf_comm_bcast(rf_comm_host(g->tp->comm), h, sizeof *h, 0, 2 * g->timeout_s,
                         "rollout tensor parallelism: waiting for a command from tensor-parallel rank 0"));
    if (h->magic != MAGIC)
        return rf_error(RF_ERR_FORMAT, "rollout tensor parallelism: a command from world rank %d is not one "
                        "(magic %08x)", rf_comm_world_rank(g->tp->comm, 0), h->magic);
    return RF_OK;
}

/* Receives a step's payload, applies its copies and runs it. */
static rf_status serve_step(rf_rollout_tp *g, const cmd_head *h) {
    if (!g->pool.n_blocks) return rf_error(RF_ERR_FORMAT, "rollout tensor parallelism: a step before the pool was made");
    if (!rf_kv_pool_held(&g->pool)) { /* released (CMD_RELEASE) since the last step */
        rf_status st = rf_kv_pool_acquire(&g->pool);
        if (st != RF_OK) return rf_error_wrap(st, "rollout tensor parallelism: allocating the released KV cache again");
    }
    int n = h->n_rows;
    RF_TRY(grow((void **)&g->ints, &g->cap_ints, (size_t)h->n_ints, sizeof(int32_t)));
    RF_TRY(rf_comm_bcast(rf_comm_host(g->tp->comm), g->ints, sizeof(int32_t) * (size_t)h->n_ints, 0, g->timeout_s,
                         "rollout tensor parallelism: receiving a step from tensor-parallel rank 0"));
    RF_TRY(grow((void **)&g->seqs, &g->cap_seqs, (size_t)n, sizeof *g->seqs));
    RF_TRY(grow((void **)&g->full, &g->cap_full, (size_t)h->n_capture * g->tp->cfg.vocab_size, sizeof(float)));
    size_t nd = (size_t)h->n_draws;
    RF_TRY(grow((void **)&g->draws, &g->cap_draws, nd, sizeof *g->draws));
    RF_TRY(grow((void **)&g->picks, &g->cap_picks, nd, sizeof *g->picks));
    RF_TRY(grow((void **)&g->pick_logp, &g->cap_logp, nd, sizeof *g->pick_logp));
    const int32_t *r = g->ints;
    for (int i = 0; i < h->n_copies; i++, r += 3) rf_kv_pool_copy(&g->pool, r[0], r[1], r[2]);
    size_t T = 0;
    for (int i = 0; i < n; i++) {
        g->seqs[i] = (rf_paged_seq){r + 3, r[0], r[1]};
        T += (size_t)r[1];
        r += 3 + r[2];
    }
    const int32_t *tokens = r, *capture = r + T;
    memcpy(g->draws, capture + h->n_capture, sizeof(rf_draw) * nd); /* aligned for its double */
    step_draws d = {g->draws, h->n_draws, g->picks, g->pick_logp, capture, h->n_capture, g->full};
    return run_step(g, &g->pool, g->seqs, n, tokens, &d);
}

rf_status rf_rollout_tp_serve(rf_rollout_tp *g, rf_rollout_tp_handler handler, void *ctx) {
    for (;;) {
        cmd_head h;
        RF_TRY(recv_head(g, &h));
        switch (h.cmd) {
        case CMD_NOP: break;
        case RF_ROLLOUT_TP_STOP: return RF_OK;
        case CMD_POOL:
            rf_kv_pool_free(&g->pool);
            RF_TRY(rf_model_tp_kv_pool_init(g->tp, &g->pool, (int)(h.arg >> 32), (int)(h.arg & 0xffffffff)));
            break;
        case CMD_STEP: RF_TRY(guarded_step(g, &h)); break;
        case CMD_RELEASE:
            RF_TRY(rf_kv_pool_release(&g->pool));
            rf_model_tp_trim(g->tp);
            break;
        default:
            if (!handler)
                return rf_error(RF_ERR_FORMAT, "rollout tensor parallelism: command %d from world rank %d has no handler",
                                h.cmd, rf_comm_world_rank(g->tp->comm, 0));
            RF_TRY(handler(ctx, h.cmd, h.arg));
        }
    }
}
