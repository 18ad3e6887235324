/* The rollout engine's API: construction, requests and their copies, delivery of finished
 * samples. The scheduler step itself is in rollout/scheduler.c. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "rollout/rollout_internal.h"

static void opts_defaults(rf_rollout_opts *o) {
    if (o->block_size == 0) o->block_size = 16;
    if (o->max_running == 0) o->max_running = 64;
    if (o->max_batch_tokens == 0) o->max_batch_tokens = 2048;
    if (o->mem_fraction == 0) o->mem_fraction = 0.9;
}

static rf_status opts_check(const rf_rollout_opts *o) {
    if (o->block_size < 1 || o->n_blocks < 0 || o->max_running < 1 || o->max_batch_tokens < 1 || o->max_seq_len < 0)
        return rf_error(RF_ERR_ARG, "rollout: block_size (%d), max_running (%d) and max_batch_tokens (%d) must be "
                        ">= 1, n_blocks (%d) and max_seq_len (%d) >= 0 (0 = default)", o->block_size, o->max_running,
                        o->max_batch_tokens, o->n_blocks, o->max_seq_len);
    if (!(o->mem_fraction > 0 && o->mem_fraction <= 1))
        return rf_error(RF_ERR_ARG, "rollout: mem_fraction (%g) must be in (0, 1]", o->mem_fraction);
    if (o->max_running > o->max_batch_tokens)
        return rf_error(RF_ERR_ARG, "rollout: max_running (%d) exceeds max_batch_tokens (%d): a "
                        "decode step would not fit the token budget", o->max_running,
                        o->max_batch_tokens);
    return RF_OK;
}

static double mb(size_t bytes) { return (double)bytes / (1 << 20); }

/* o->n_blocks = 0: enough blocks for max_running sequences of the longest length, as many as
 * mem_fraction of the back end's free memory holds when fewer (the scheduler then preempts),
 * refused when that is not one sequence. */
static rf_status size_pool(const rf_rollout_model *mc, rf_rollout_opts *o) {
    int limit = rf_config_max_seq(mc->cfg);
    int len = o->max_seq_len > 0 && o->max_seq_len < limit ? o->max_seq_len : limit;
    int per_seq = (len + o->block_size - 1) / o->block_size;
    int want = (int)((int64_t)per_seq * o->max_running > INT32_MAX / 2 ? INT32_MAX / 2 : (int64_t)per_seq * o->max_running);
    size_t block_bytes = 2 * sizeof(float) * (size_t)mc->cfg->num_hidden_layers * (size_t)o->block_size *
                         (size_t)mc->kv_heads * (size_t)mc->cfg->head_dim;
    size_t free_b = 0, total_b = 0;
    if (mc->k->mem_info(&free_b, &total_b) != 0)
        return rf_error_wrap(RF_ERR_NODEVICE, "rollout: sizing the KV cache from %s memory", mc->k->name);
    int n = rf_kv_pool_fit(block_bytes, free_b, o->mem_fraction, want, per_seq);
    if (n < 0)
        return rf_error(RF_ERR_NOMEM, "rollout: KV cache sized from memory: %.3g%% of the %.1f MB free on %s holds "
                        "%.0f blocks of %d positions (%.2f MB each), fewer than the %d that one sequence of %d "
                        "positions needs", 100 * o->mem_fraction, mb(free_b), mc->k->name,
                        floor(o->mem_fraction * (double)free_b / (double)block_bytes), o->block_size, mb(block_bytes),
                        per_seq, len);
    o->n_blocks = n;
    if (n == want)
        rf_log_info("KV cache: %d blocks of %d positions, %.1f MB on %s: %d running sequences of up to %d positions "
                    "(%.3g%% of the %.1f MB free would hold more)", n, o->block_size, mb(block_bytes * (size_t)n),
                    mc->k->name, o->max_running, len, 100 * o->mem_fraction, mb(free_b));
    else
        rf_log_info("KV cache: %d blocks of %d positions, %.1f MB on %s: %.3g%% of the %.1f MB free; %d running "
                    "sequences of up to %d positions would need %d (sequences beyond wait or are preempted)", n,
                    o->block_size, mb(block_bytes * (size_t)n), mc->k->name, 100 * o->mem_fraction, mb(free_b),
                    o->max_running, len, want);
    return RF_OK;
}

/* The whole model's calls (rf_rollout_init). */
static rf_status whole_pool_init(void *ctx, rf_kv_pool *p, int n_blocks, int block_size) {
    return rf_kv_pool_init(p, ctx, n_blocks, block_size);
}

/* The step's logits stay in the model's back end and are drawn from there (rf_model_draw): on
 * a GPU only a token and a log-prob per sequence cross to the host, not (n, V) floats. */
static rf_status whole_decode_sample(void *ctx, rf_kv_pool *p, const rf_paged_seq *seqs, int n,
                                     const int32_t *tokens, const rf_draw *draws, int n_draws, int32_t *picks,
                                     float *logp, const int *capture, int n_capture, float *whole,
                                     const float *capture_inv_temp, float *whole_lse) {
    RF_TRY(rf_model_decode_paged(ctx, p, seqs, n, tokens, NULL));
    return rf_model_draw(ctx, n, draws, n_draws, picks, logp, capture, n_capture, whole, capture_inv_temp, whole_lse);
}

/* The pool's memory and the model's decode workspace given back. */
static rf_status whole_release(void *ctx, rf_kv_pool *p) {
    RF_TRY(rf_kv_pool_release(p));
    rf_model_trim(ctx);
    return RF_OK;
}

static void whole_copy(void *ctx, rf_kv_pool *p, int dst, int src, int n_rows) {
    (void)ctx;
    rf_kv_pool_copy(p, dst, src, n_rows);
}

rf_status rf_rollout_init(rf_rollout **out, rf_model *m, const rf_rollout_opts *opts) {
    *out = NULL;
    if (!m->lm_head) return rf_error(RF_ERR_ARG, "rollout: the model has a value head, not an LM head");
    rf_rollout_model mc = {.cfg = &m->cfg, .ctx = m, .k = m->k, .kv_heads = m->cfg.num_key_value_heads,
                           .pool_init = whole_pool_init, .pool_release = whole_release, .decode_sample = whole_decode_sample,
                           .copy = whole_copy};
    return rf_rollout_init_model(out, &mc, opts);
}

rf_status rf_rollout_init_model(rf_rollout **out, const rf_rollout_model *mc, const rf_rollout_opts *opts) {
    *out = NULL;
    if (!mc->decode == !mc->decode_sample)
        return rf_error(RF_ERR_ARG, "rollout: the model must give exactly one of decode and decode_sample");
    if (!mc->pool_init || !mc->pool_release || !mc->copy)
        return rf_error(RF_ERR_ARG, "rollout: the model must give pool_init, pool_release and copy");
    rf_rollout_opts o = opts ? *opts : (rf_rollout_opts){0};
    opts_defaults(&o);
    RF_TRY(opts_check(&o));
    if (o.n_blocks == 0) RF_TRY(size_pool(mc, &o));
    rf_rollout *e = rf_calloc(1, sizeof *e);
    if (!e) return RF_ERR_NOMEM;
    e->mc = *mc, e->o = o;
    rf_status s = mc->pool_init(mc->ctx, &e->pool, o.n_blocks, o.block_size);
    size_t V = (size_t)mc->cfg->vocab_size, R = (size_t)o.max_running;
    e->V = V;
    e->running = calloc(R, sizeof *e->running);
    e->batch = calloc(R, sizeof *e->batch);
    e->row = calloc(R, sizeof *e->row);
    e->logits = malloc(sizeof(float) * R * V);
    e->n_work = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
    e->work = malloc(sizeof(float) * 2 * V * (size_t)e->n_work);
    e->picks = malloc(sizeof *e->picks * R), e->pick_logp = malloc(sizeof *e->pick_logp * R);
    int drawn = e->picks && e->pick_logp; /* and the draws' buffers, when the model draws */
    if (mc->decode_sample) {
        e->draws = malloc(sizeof *e->draws * R), e->capture = malloc(sizeof *e->capture * R);
        e->capture_inv_temp = malloc(sizeof(float) * R), e->capture_lse = malloc(sizeof(float) * R);
        drawn = drawn && e->draws && e->capture && e->capture_inv_temp && e->capture_lse;
    }
    if (s == RF_OK && (!e->running || !e->batch || !e->row || !e->logits || !e->work || !drawn))
        s = rf_error(RF_ERR_NOMEM, "rollout: out of memory for %d running sequences", o.max_running);
    if (s != RF_OK) {
        rf_rollout_free(e);
        return s;
    }
    *out = e;
    return RF_OK;
}

static void request_free(ro_request *r) {
    if (!r) return;
    free(r->prefix);
    free(r->first_logits);
    free(r->prompt);
    free(r->stop_ids);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r);
}

static void seq_free(ro_seq *s) {
    if (!s) return;
    free(s->tokens);
    free(s->logprobs);
    free(s->versions);
    free(s->blocks);
    free(s->text);
    free(s->mask);
    free(s);
}

/* Frees a sequence that will never be delivered, and its request with its last one. */
static void seq_drop(rf_rollout *e, ro_seq *s) {
    rf__rollout_release_blocks(e, s);
    ro_request *r = s->req;
    e->n_episode_seqs -= r->episode;
    seq_free(s);
    if (--r->n_left == 0) request_free(r);
}

void rf_rollout_free(rf_rollout *e) {
    if (!e) return;
    while (e->retained) rf__rollout_drop_prefix(e, e->retained);
    for (int i = 0; i < e->n_running; i++) seq_drop(e, e->running[i]);
    for (int i = 0; i < e->n_waiting; i++) seq_drop(e, e->waiting[i]);
    for (int i = 0; i < e->n_paused; i++) seq_drop(e, e->paused[i]);
    rf_kv_pool_free(&e->pool);
    free(e->waiting);
    free(e->paused);
    free(e->running);
    free(e->batch);
    free(e->row);
    free(e->tokens);
    free(e->logits);
    free(e->work);
    free(e->picks), free(e->pick_logp), free(e->draws), free(e->capture);
    free(e->capture_inv_temp), free(e->capture_lse);
    free(e);
}

void rf_rollout_set_callback(rf_rollout *e, rf_rollout_callback fn, void *ctx) {
    e->cb = fn, e->cb_ctx = ctx;
}

void rf_rollout_set_version(rf_rollout *e, int version) { e->version = version; }

int rf_rollout_idle(const rf_rollout *e) { return e->n_running == 0 && e->n_waiting == 0; }

rf_status rf_rollout_release_cache(rf_rollout *e) {
    if (!rf_rollout_idle(e))
        return rf_error(RF_ERR_ARG, "rollout: the KV cache cannot be released while sequences run (%d) or wait (%d)",
                        e->n_running, e->n_waiting);
    if (e->n_paused)
        return rf_error(RF_ERR_ARG, "rollout: the KV cache cannot be released while %d episodes wait between "
                        "turns (their prefixes are in it)", e->n_paused);
    if (!rf_kv_pool_held(&e->pool)) return RF_OK;
    RF_TRY(e->mc.pool_release(e->mc.ctx, &e->pool));
    e->stats.cache_releases++;
    return RF_OK;
}

rf_status rf_rollout_acquire_cache(rf_rollout *e) {
    if (rf_kv_pool_held(&e->pool)) return RF_OK;
    rf_status st = rf_kv_pool_acquire(&e->pool);
    return st == RF_OK ? st : rf_error_wrap(st, "rollout: allocating the released KV cache again");
}

void rf_rollout_get_stats(const rf_rollout *e, rf_rollout_stats *s) {
    *s = e->stats;
    s->pool_blocks = e->pool.n_blocks;
    s->peak_blocks_used = e->pool.peak_used;
    s->running = e->n_running, s->waiting = e->n_waiting;
}

const rf_kv_pool *rf_rollout_pool(const rf_rollout *e) { return &e->pool; }

int rf_rollout_max_positions(const rf_rollout *e) { return rf_config_max_seq(e->mc.cfg); }

/* ---- requests ---- */

static rf_status request_check(const rf_rollout *e, const rf_rollout_request *q) {
    const rf_model_config *c = e->mc.cfg;
    if (!q->prompt || q->prompt_len <= 0) return rf_error(RF_ERR_ARG, "rollout: the prompt is empty");
    if (q->n < 1) return rf_error(RF_ERR_ARG, "rollout: n (samples) must be >= 1, got %d", q->n);
    if (q->max_new_tokens < 1)
        return rf_error(RF_ERR_ARG, "rollout: max_new_tokens must be >= 1, got %d", q->max_new_tokens);
    RF_TRY(rf_sampling_validate(&q->sampling));
    if (q->n_stop < 0 || q->n_stop > RF_MAX_STOP || q->n_stop_ids < 0)
        return rf_error(RF_ERR_ARG, "rollout: %d stop strings (at most %d), %d stop ids", q->n_stop,
                        RF_MAX_STOP, q->n_stop_ids);
    if (q->n_stop && !e->o.tok) return rf_error(RF_ERR_ARG, "rollout: stop strings need a tokenizer");
    for (int i = 0; i < q->prompt_len; i++)
        if (q->prompt[i] < 0 || q->prompt[i] >= c->vocab_size)
            return rf_error(RF_ERR_RANGE, "rollout: prompt token %d at position %d is outside the "
                            "vocabulary (%d)", q->prompt[i], i, c->vocab_size);
    if (q->episode && q->max_total_tokens < q->max_new_tokens)
        return rf_error(RF_ERR_ARG, "rollout: an episode's max_total_tokens (%d) must be >= max_new_tokens (%d)",
                        q->max_total_tokens, q->max_new_tokens);
    int gen = q->episode ? q->max_total_tokens : q->max_new_tokens;
    int len = q->prompt_len + gen, limit = rf_config_max_seq(c);
    if (len > limit)
        return rf_error(RF_ERR_RANGE, "rollout: prompt (%d tokens) + %s (%d) exceeds "
                        "the model's limit of %d positions", q->prompt_len,
                        q->episode ? "max_total_tokens" : "max_new_tokens", gen, limit);
    int need = rf_kv_pool_blocks_for(&e->pool, len);
    if (need > e->pool.n_blocks)
        return rf_error(RF_ERR_RANGE, "rollout: a sample of this request needs up to %d KV blocks "
                        "(%d positions / %d per block) but the whole pool holds %d", need, len,
                        e->pool.block_size, e->pool.n_blocks);
    return RF_OK;
}

static ro_request *request_copy(const rf_rollout_request *q, void *user, uint64_t id) {
    ro_request *r = rf_calloc(1, sizeof *r);
    if (!r) return NULL;
    r->id = id, r->user = user, r->n = r->n_left = r->n_unstarted = q->n;
    r->sampling = q->sampling, r->capture_row = -1, r->first_lse = NAN;
    r->prompt_len = q->prompt_len, r->max_new_tokens = q->max_new_tokens;
    r->episode = q->episode != 0, r->max_total = q->max_total_tokens;
    r->gen_cap = r->episode ? q->max_total_tokens : q->max_new_tokens;
    r->prompt = malloc(sizeof(int32_t) * (size_t)q->prompt_len);
    r->stop_ids = malloc(sizeof(int32_t) * (size_t)(q->n_stop_ids + 1));
    int ok = r->prompt && r->stop_ids;
    if (ok) memcpy(r->prompt, q->prompt, sizeof(int32_t) * (size_t)q->prompt_len);
    if (ok && q->n_stop_ids) memcpy(r->stop_ids, q->stop_ids, sizeof(int32_t) * (size_t)q->n_stop_ids);
    r->n_stop_ids = q->n_stop_ids;
    for (int i = 0; ok && i < q->n_stop; i++) {
        ok = (r->stop[i] = rf_strdup(q->stop[i])) != NULL;
        r->n_stop = i + 1;
    }
    if (!ok) {
        request_free(r);
        return NULL;
    }
    return r;
}

static ro_seq *seq_new(rf_rollout *e, ro_request *r, int index, uint64_t seed, uint64_t group) {
    ro_seq *s = rf_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->req = r, s->index = index, s->group = group;
    rf_rng_seed(&s->rng, seed + (uint64_t)index);
    s->cap_blocks = rf_kv_pool_blocks_for(&e->pool, r->prompt_len + r->gen_cap);
    s->tokens = malloc(sizeof(int32_t) * (size_t)(r->prompt_len + r->gen_cap));
    s->logprobs = malloc(sizeof(float) * (size_t)r->gen_cap);
    s->versions = malloc(sizeof(int) * (size_t)r->gen_cap);
    s->blocks = malloc(sizeof(int) * (size_t)s->cap_blocks);
    s->mask = r->episode ? malloc((size_t)r->gen_cap) : NULL;
    if (!s->tokens || !s->logprobs || !s->versions || !s->blocks || (r->episode && !s->mask)) {
        seq_free(s);
        return NULL;
    }
    memcpy(s->tokens, r->prompt, sizeof(int32_t) * (size_t)r->prompt_len);
    s->n_tokens = r->prompt_len, s->turn_start = r->prompt_len, s->turn = 1;
    return s;
}

rf_status rf__rollout_push_waiting(rf_rollout *e, ro_seq *s, int front) {
    if (e->n_waiting == e->cap_waiting) {
        int cap = e->cap_waiting ? 2 * e->cap_waiting : 64;
        ro_seq **w = realloc(e->waiting, sizeof *w * (size_t)cap);
        if (!w) return rf_error(RF_ERR_NOMEM, "rollout: out of memory for the waiting queue");
        e->waiting = w, e->cap_waiting = cap;
    }
    if (front) {
        memmove(e->waiting + 1, e->waiting, sizeof *e->waiting * (size_t)e->n_waiting);
        e->waiting[0] = s;
    } else {
        e->waiting[e->n_waiting] = s;
    }
    e->n_waiting++;
    return RF_OK;
}

/* Room on the paused list for every episode sample live after adding n more, so that a turn's
 * end never allocates (and never loses its sample). */
static rf_status paused_room(rf_rollout *e, int n) {
    int need = e->n_episode_seqs + n;
    if (need <= e->cap_paused) return RF_OK;
    int cap = e->cap_paused ? e->cap_paused : 16;
    while (cap < need) cap *= 2;
    ro_seq **p = realloc(e->paused, sizeof *p * (size_t)cap);
    if (!p) return rf_error(RF_ERR_NOMEM, "rollout: out of memory for %d episodes", need);
    e->paused = p, e->cap_paused = cap;
    return RF_OK;
}

rf_status rf_rollout_submit(rf_rollout *e, const rf_rollout_request *q, void *user,
                            uint64_t *id) {
    RF_TRY(request_check(e, q));
    if (q->episode) RF_TRY(paused_room(e, q->n));
    ro_request *r = request_copy(q, user, e->next_id);
    if (!r) return rf_error(RF_ERR_NOMEM, "rollout: out of memory for a request");
    uint64_t group = e->next_group++;
    int queued = 0;
    rf_status st = RF_OK;
    while (st == RF_OK && queued < q->n) {
        ro_seq *s = seq_new(e, r, queued, q->seed, group);
        st = s ? rf__rollout_push_waiting(e, s, 0) : rf_error(RF_ERR_NOMEM, "rollout: out of memory");
        if (st == RF_OK) queued++;
        else seq_free(s);
    }
    if (st != RF_OK) { /* take back the samples already queued (the queue's tail) */
        e->n_waiting -= queued;
        for (int i = 0; i < queued; i++) seq_free(e->waiting[e->n_waiting + i]);
        request_free(r);
        return st;
    }
    if (id) *id = e->next_id;
    e->next_id++;
    if (q->episode) e->n_episode_seqs += q->n;
    return RF_OK;
}

/* ---- finished samples ---- */

void rf__rollout_release_blocks(rf_rollout *e, ro_seq *s) {
    for (int i = 0; i < s->n_blocks; i++) rf_kv_pool_unref(&e->pool, s->blocks[i]);
    s->n_blocks = 0, s->n_cached = 0;
}

void rf__rollout_drop_prefix(rf_rollout *e, ro_request *r) {
    for (ro_request **at = &e->retained; *at; at = &(*at)->next_retained)
        if (*at == r) {
            *at = r->next_retained;
            break;
        }
    for (int i = 0; i < r->n_prefix; i++) rf_kv_pool_unref(&e->pool, r->prefix[i]);
    free(r->prefix);
    free(r->first_logits);
    r->prefix = NULL, r->first_logits = NULL, r->n_prefix = 0, r->capture_row = -1;
    r->next_retained = NULL;
}

rf_status rf__rollout_update_text(rf_rollout *e, ro_seq *s, int *stopped) {
    *stopped = 0;
    const rf_tokenizer *tok = e->o.tok;
    if (!tok) return RF_OK;
    int n_gen = s->n_tokens - s->turn_start, n = 0; /* this turn's tokens (a plain request: all) */
    const int32_t *gen = s->tokens + s->turn_start;
    /* ids without a token (vocabulary padding) decode to nothing, as in rf_generate */
    int32_t *known = malloc(sizeof(int32_t) * (size_t)(n_gen + 1));
    if (!known) return rf_error(RF_ERR_NOMEM, "rollout: out of memory");
    for (int i = 0; i < n_gen; i++)
        if (rf_tokenizer_id_to_token(tok, gen[i])) known[n++] = gen[i];
    char *text = NULL;
    size_t len = 0;
    rf_status st = rf_tokenizer_decode(tok, known, n, 1, &text, &len);
    free(known);
    RF_TRY(st);
    /* by length: a NUL inside the text (U+0000) must not hide a later stop string */
    for (int i = 0; i < s->req->n_stop; i++) {
        const char *hit = rf_memfind(text, len, s->req->stop[i], strlen(s->req->stop[i]));
        if (hit) len = (size_t)(hit - text), text[len] = '\0', *stopped = 1;
    }
    free(s->text);
    s->text = text;
    s->text_len = len;
    return RF_OK;
}

/* The callback's view of s; turn_end as given. */
static rf_rollout_sample sample_view(const ro_seq *s, int turn_end) {
    const ro_request *r = s->req;
    int P = r->prompt_len;
    return (rf_rollout_sample){r->id, s->index, r->user, r->prompt, P, s->tokens + P, s->logprobs,
                               s->versions, s->n_tokens - P, s->text, s->text_len, s->finish,
                               s->n_preempted, s->mask, turn_end, s->turn, s->turn_start - P};
}

void rf__rollout_deliver(rf_rollout *e, ro_seq *s) {
    rf_rollout_sample out = sample_view(s, 0);
    e->stats.samples_finished++;
    if (e->cb) e->cb(e->cb_ctx, &out);
    seq_drop(e, s);
}

rf_status rf__rollout_hold_turn(rf_rollout *e, ro_seq *s) {
    RF_ASSERT(e->n_paused < e->cap_paused); /* room made at submit */
    e->paused[e->n_paused++] = s;
    rf_rollout_sample out = sample_view(s, 1);
    if (e->cb) e->cb(e->cb_ctx, &out);
    return RF_OK;
}

int rf_rollout_waiting_turns(const rf_rollout *e) { return e->n_paused; }

/* Takes the paused sample (request_id, index) off the paused list; NULL when not there. */
static ro_seq *unpause(rf_rollout *e, uint64_t request_id, int index) {
    for (int i = 0; i < e->n_paused; i++) {
        ro_seq *s = e->paused[i];
        if (s->req->id != request_id || s->index != index) continue;
        e->paused[i] = e->paused[--e->n_paused];
        return s;
    }
    return NULL;
}

/* The paused sample (request_id, index), NULL when not there. */
static ro_seq *find_paused(const rf_rollout *e, uint64_t request_id, int index) {
    for (int i = 0; i < e->n_paused; i++)
        if (e->paused[i]->req->id == request_id && e->paused[i]->index == index) return e->paused[i];
    return NULL;
}

rf_status rf_rollout_continue(rf_rollout *e, uint64_t request_id, int index, const int32_t *obs, int n_obs) {
    ro_seq *s = find_paused(e, request_id, index);
    if (!s)
        return rf_error(RF_ERR_ARG, "rollout: sample %d of request %llu is not waiting between turns", index,
                        (unsigned long long)request_id);
    const ro_request *r = s->req;
    int used = s->n_tokens - r->prompt_len, V = e->mc.cfg->vocab_size;
    if (n_obs < 0 || used + n_obs >= r->gen_cap)
        return rf_error(RF_ERR_RANGE, "rollout: an observation of %d tokens after %d leaves no room for a turn "
                        "within max_total_tokens (%d)", n_obs, used, r->gen_cap);
    for (int k = 0; k < n_obs; k++)
        if (obs[k] < 0 || obs[k] >= V)
            return rf_error(RF_ERR_RANGE, "rollout: observation token %d at position %d is outside the "
                            "vocabulary (%d)", obs[k], k, V);
    unpause(e, request_id, index);
    int version = used > 0 ? s->versions[used - 1] : e->version;
    for (int k = 0; k < n_obs; k++, used++) {
        s->tokens[s->n_tokens++] = obs[k];
        s->logprobs[used] = 0.0f, s->versions[used] = version, s->mask[used] = 0;
    }
    s->turn_start = s->n_tokens, s->turn++;
    free(s->text);
    s->text = NULL, s->text_len = 0;
    if (e->n_running < e->o.max_running) { /* its blocks stay: the next step runs only the new tokens */
        e->running[e->n_running++] = s;
        return RF_OK;
    }
    rf__rollout_release_blocks(e, s); /* no room in the running batch: recomputed on admission */
    s->group = e->next_group++;
    return rf__rollout_push_waiting(e, s, 1);
}

rf_status rf_rollout_end(rf_rollout *e, uint64_t request_id, int index) {
    ro_seq *s = unpause(e, request_id, index);
    if (!s)
        return rf_error(RF_ERR_ARG, "rollout: sample %d of request %llu is not waiting between turns", index,
                        (unsigned long long)request_id);
    rf__rollout_deliver(e, s);
    return RF_OK;
}
