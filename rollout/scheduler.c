/* One step of the rollout engine (rf_rollout_step): reserve a KV slot for the pending token of
 * every running sequence (preempting the most recently admitted one while the pool is full),
 * admit waiting sequences, run one model call over all of it, sample, deliver.
 *
 * Prefill shares the step's model call with decoding (rather than a step of its own): the
 * decode tokens of the running sequences come first, then the prompts of the groups admitted
 * this step, each prefilled once for all its samples. On the CPU a model call streams every
 * weight once whatever the batch, so folding prefill into the decode call costs the decoders
 * nothing extra, and a newly admitted sequence produces its first token in the step that
 * admits it. A step's tokens stay within max_batch_tokens, except that a prompt longer than
 * the budget is admitted when nothing else is in the step (otherwise it could never run). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/sample.h"
#include "rollout/rollout_internal.h"

/* Makes position pos of s writable: a fresh block at a block boundary, or a private copy of a
 * shared, partially filled block (copy on write). 0 when the pool is empty. */
static int reserve_pos(rf_rollout *e, ro_seq *s, int pos) {
    rf_kv_pool *p = &e->pool;
    int bi = pos / p->block_size, filled = pos % p->block_size;
    if (bi == s->n_blocks) {
        int b = rf_kv_pool_alloc(p);
        if (b < 0) return 0;
        s->blocks[s->n_blocks++] = b;
        return 1;
    }
    int shared = s->blocks[bi];
    if (p->ref[shared] == 1) return 1;
    int b = rf_kv_pool_alloc(p);
    if (b < 0) return 0;
    e->mc.copy(e->mc.ctx, p, b, shared, filled);
    rf_kv_pool_unref(p, shared);
    s->blocks[bi] = b;
    e->stats.cow_copies++;
    return 1;
}

/* Makes every pending position of s writable (n_cached .. n_tokens - 1: the last token, and
 * for an episode continued after a turn, the observation before it). 0 when the pool runs out
 * (the blocks taken so far stay with s). */
static int reserve_slot(rf_rollout *e, ro_seq *s) {
    for (int pos = s->n_cached; pos < s->n_tokens; pos++)
        if (!reserve_pos(e, s, pos)) return 0;
    return 1;
}

/* Preempts the most recently admitted running sequence: frees its blocks and puts it at the
 * front of the queue, where it will be recomputed (prompt + generated tokens) on admission.
 * Its RNG state and outputs so far are kept, so its remaining tokens do not change. */
static rf_status preempt_last(rf_rollout *e) {
    ro_seq *s = e->running[--e->n_running];
    rf__rollout_release_blocks(e, s);
    s->group = e->next_group++; /* recomputed alone: its samples' prefixes now differ */
    s->n_preempted++;
    e->stats.preemptions++;
    return rf__rollout_push_waiting(e, s, 1);
}

/* A slot for every running sequence's pending token. The oldest sequences are served first;
 * when the pool is full, retained prefixes go before running sequences are preempted; a lone
 * sequence always fits (submit checked one sample against the whole pool). */
static rf_status reserve_decode(rf_rollout *e) {
    for (int i = 0; i < e->n_running; i++)
        while (!reserve_slot(e, e->running[i])) {
            if (e->retained) {
                rf__rollout_drop_prefix(e, e->retained);
                continue;
            }
            int self = i == e->n_running - 1;
            RF_ASSERT(e->n_running > 1 || !self);
            RF_TRY(preempt_last(e));
            if (self) break; /* it was the newest: nothing after it is left to serve */
        }
    return RF_OK;
}

/* Number of consecutive waiting sequences at the head sharing its group, within max_running. */
static int head_run(const rf_rollout *e) {
    int room = e->o.max_running - e->n_running, k = 1;
    while (k < room && k < e->n_waiting && e->waiting[k]->group == e->waiting[0]->group) k++;
    return k;
}

/* Moves k sequences from the head of the queue to the running set. */
static void start_head(rf_rollout *e, int k) {
    for (int i = 0; i < k; i++) e->running[e->n_running++] = e->waiting[i];
    e->n_waiting -= k;
    memmove(e->waiting, e->waiting + k, sizeof *e->waiting * (size_t)e->n_waiting);
}

/* Admits the run of waiting sequences at the queue's head that share one prefix (the samples
 * of one request not yet started), as many as max_running allows, when the token budget and
 * the pool have room for one prefill of it; the first gets fresh blocks, the others share them.
 * Returns how many were admitted (0: stop admitting this step, first come first served). */
static int admit_group(rf_rollout *e, int *n_tokens) {
    rf_kv_pool *p = &e->pool;
    ro_seq *head = e->waiting[0];
    int len = head->n_tokens, need = rf_kv_pool_blocks_for(p, len), k = head_run(e);
    if (*n_tokens > 0 && *n_tokens + len > e->o.max_batch_tokens) return 0;
    if (p->n_free < need) return 0;
    for (int b = 0; b < need; b++) head->blocks[b] = rf_kv_pool_alloc(p);
    for (int i = 0; i < k; i++) {
        ro_seq *s = e->waiting[i];
        for (int b = 0; i > 0 && b < need; b++) {
            rf_kv_pool_ref(p, head->blocks[b]);
            s->blocks[b] = head->blocks[b];
        }
        s->n_blocks = need, s->n_cached = 0;
    }
    start_head(e, k);
    e->stats.prefix_blocks_shared += (int64_t)(k - 1) * need;
    *n_tokens += len;
    return k;
}

/* After the prefill of a group admitted in part (max_running was short), keeps the prompt's
 * blocks and the logits of its last position (copied after the model call, from `row`) for
 * the samples still waiting. */
static rf_status retain_prefix(rf_rollout *e, ro_request *r, const ro_seq *lead, int row) {
    r->prefix = malloc(sizeof(int) * (size_t)lead->n_blocks);
    r->first_logits = malloc(sizeof(float) * e->V);
    if (!r->prefix || !r->first_logits) {
        free(r->prefix), free(r->first_logits);
        r->prefix = NULL, r->first_logits = NULL;
        return RF_OK; /* not fatal: the late samples prefill again */
    }
    for (int b = 0; b < lead->n_blocks; b++) rf_kv_pool_ref(&e->pool, r->prefix[b] = lead->blocks[b]);
    r->n_prefix = lead->n_blocks, r->capture_row = row;
    r->next_retained = e->retained, e->retained = r;
    return RF_OK;
}

/* Starts waiting samples of a request with a retained prefix without a model call: they share
 * the prefix blocks and draw their first token from its saved logits, copied into free logits
 * rows taken from the top (*top, downwards; the model's rows fill from 0 upwards). */
static int join_prefix(rf_rollout *e, int *top) {
    ro_request *r = e->waiting[0]->req;
    int k = head_run(e), first = e->n_running;
    size_t V = e->V;
    for (int i = 0; i < k; i++) {
        ro_seq *s = e->waiting[i];
        for (int b = 0; b < r->n_prefix; b++) rf_kv_pool_ref(&e->pool, s->blocks[b] = r->prefix[b]);
        s->n_blocks = r->n_prefix, s->n_cached = r->prompt_len;
    }
    start_head(e, k);
    for (int i = first; i < first + k; i++) {
        e->row[i] = (*top)--;
        memcpy(e->logits + (size_t)e->row[i] * V, r->first_logits, sizeof(float) * V);
    }
    e->stats.prefix_blocks_shared += (int64_t)k * r->n_prefix;
    e->stats.prefix_joins += k;
    if ((r->n_unstarted -= k) == 0) rf__rollout_drop_prefix(e, r);
    return k;
}

static int is_fresh(const ro_seq *s) { return s->n_tokens == s->req->prompt_len; }

/* Admits waiting sequences (first come first served) and gives each new group a batch row. */
static rf_status admit(rf_rollout *e, int *rows, int *n_tokens) {
    int top = e->o.max_running - 1;
    while (e->n_waiting > 0 && e->n_running < e->o.max_running) {
        ro_seq *head = e->waiting[0];
        if (is_fresh(head) && head->req->first_logits && head->req->capture_row < 0) {
            join_prefix(e, &top);
            continue;
        }
        int first = e->n_running, k = admit_group(e, n_tokens);
        if (k == 0) break;
        ro_seq *lead = e->running[first];
        for (int i = first; i < first + k; i++) e->row[i] = *rows;
        e->batch[(*rows)++] = (rf_paged_seq){lead->blocks, 0, lead->n_tokens};
        if (is_fresh(lead) && (lead->req->n_unstarted -= k) > 0)
            RF_TRY(retain_prefix(e, lead->req, lead, *rows - 1));
    }
    return RF_OK;
}

/* Builds the batch: one row per decoding sequence (its pending token), then one row per
 * admitted group (its whole prefix). e->row maps each running sequence to its logits row. */
static rf_status build_batch(rf_rollout *e, int *n_rows) {
    int n_decode = e->n_running, rows = 0, n_tokens = 0;
    for (int i = 0; i < n_decode; i++) {
        ro_seq *s = e->running[i];
        e->row[i] = rows;
        e->batch[rows++] = (rf_paged_seq){s->blocks, s->n_cached, s->n_tokens - s->n_cached};
        n_tokens += s->n_tokens - s->n_cached; /* 1, or an episode's observation and last token */
    }
    RF_TRY(admit(e, &rows, &n_tokens));
    if (n_tokens > e->tokens_cap) {
        free(e->tokens);
        e->tokens = malloc(sizeof(int32_t) * (size_t)n_tokens);
        e->tokens_cap = e->tokens ? n_tokens : 0;
        if (!e->tokens) return rf_error(RF_ERR_NOMEM, "rollout: out of memory for %d tokens", n_tokens);
    }
    for (int r = 0, t = 0, i = 0; r < rows; r++) {
        while (e->row[i] != r) i++; /* first running sequence of row r (rows ascend) */
        const ro_seq *s = e->running[i];
        const rf_paged_seq *b = &e->batch[r];
        memcpy(e->tokens + t, s->tokens + b->n_cached, sizeof(int32_t) * (size_t)b->n_new);
        t += b->n_new;
        if (b->n_cached == 0) e->stats.prefill_tokens += b->n_new;
        else e->stats.decode_tokens++, e->stats.prefill_tokens += b->n_new - 1;
    }
    *n_rows = rows;
    return RF_OK;
}

static int is_stop_id(const ro_request *r, int32_t t) {
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == t) return 1;
    return 0;
}

/* Appends s's next token t (log-prob lp) and decides whether s (an episode: its turn) is
 * finished (the rules of rf_generate: a stop id, then a stop string, then max_new_tokens in
 * the turn; an episode also at max_total_tokens). */
static rf_status take_token(rf_rollout *e, ro_seq *s, int32_t t, float lp, int *done) {
    const ro_request *r = s->req;
    int g = s->n_tokens - r->prompt_len, stopped = 0;
    s->tokens[s->n_tokens++] = t;
    s->logprobs[g] = lp;
    s->versions[g] = e->version;
    if (s->mask) s->mask[g] = 1;
    e->stats.tokens_generated++;
    if (r->n_stop) RF_TRY(rf__rollout_update_text(e, s, &stopped));
    int eos = is_stop_id(r, t);
    s->finish = eos ? RF_FINISH_EOS : stopped ? RF_FINISH_STOP : RF_FINISH_LENGTH;
    *done = eos || stopped || s->n_tokens - s->turn_start >= r->max_new_tokens || g + 1 >= r->gen_cap;
    if (*done && !r->n_stop) RF_TRY(rf__rollout_update_text(e, s, &stopped));
    return RF_OK;
}

/* Draws the next token of every running sequence the model did not draw for (with
 * mc.decode_sample, those in the step's n_rows model rows) from its whole logits row, in
 * parallel: each sequence has its own generator, each thread its own scratch, so the tokens do
 * not depend on the threads. */
static void draw_rows(rf_rollout *e, int n_rows) {
    int n = e->n_running, by_model = e->mc.decode_sample != NULL;
    size_t V = e->V;
#pragma omp parallel for schedule(dynamic, 1) num_threads(e->n_work) if (n > 1)
    for (int i = 0; i < n; i++) {
        if (by_model && e->row[i] < n_rows) continue;
        ro_seq *s = e->running[i];
        float *work = e->work + 2 * V * (size_t)omp_get_thread_num(), *z = e->logits + (size_t)e->row[i] * V;
        const rf_sampling *sp = &s->req->sampling;
        /* with the model drawing, a row outside its rows is a joined sample's copy of its
         * prompt's saved logits, whose log-sum-exp the model's back end gave (first_lse) */
        float lse = by_model ? s->req->first_lse : NAN;
        e->picks[i] = rf_sample(z, (int)V, sp, &s->rng, isnan(lse) ? &e->pick_logp[i] : NULL, work);
        if (!isnan(lse)) e->pick_logp[i] = rf_logprob_given_lse(z[e->picks[i]], rf_sampling_inv_temp(sp), lse);
    }
}

/* Takes every running sequence's drawn token, delivering each finished one at once (streaming). */
static rf_status sample_all(rf_rollout *e, int n_rows) {
    rf_status st = RF_OK;
    draw_rows(e, n_rows);
    for (int i = 0; st == RF_OK && i < e->n_running; i++) {
        ro_seq *s = e->running[i];
        int done = 0;
        st = take_token(e, s, e->picks[i], e->pick_logp[i], &done);
        if (st == RF_OK && done) {
            if (s->req->episode) st = rf__rollout_hold_turn(e, s); /* waits for the environment */
            else rf__rollout_deliver(e, s);
            e->running[i] = NULL;
        }
    }
    int n = 0; /* compact, keeping admission order */
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i]) e->running[n++] = e->running[i];
    e->n_running = n;
    return st;
}

/* The model's step with its draws (mc.decode_sample): one draw per running sequence in a model
 * row, in running order, its uniform taken from the sequence's generator as rf_sample takes it;
 * the captured rows' whole logits land in e->logits rows 0, 1, ... in the order of e->retained
 * (joined sequences' rows are above the model rows, out of their way). */
static rf_status decode_and_draw(rf_rollout *e, int n_rows) {
    int n = 0, n_capture = 0;
    for (int i = 0; i < e->n_running; i++) {
        ro_seq *s = e->running[i];
        if (e->row[i] >= n_rows) continue;
        const rf_sampling *sp = &s->req->sampling;
        e->draws[n++] = (rf_draw){e->row[i], *sp, sp->greedy ? 0.0 : (double)rf_rng_uniform(&s->rng)};
    }
    for (ro_request *r = e->retained; r; r = r->next_retained)
        if (r->capture_row >= 0) {
            e->capture_inv_temp[n_capture] = rf_sampling_inv_temp(&r->sampling);
            e->capture[n_capture++] = r->capture_row;
        }
    RF_TRY(e->mc.decode_sample(e->mc.ctx, &e->pool, e->batch, n_rows, e->tokens, e->draws, n, e->picks,
                               e->pick_logp, e->capture, n_capture, e->logits, e->capture_inv_temp, e->capture_lse));
    /* draw k's pick to its sequence's place, from the last: k <= the sequence's index */
    for (int i = e->n_running - 1, k = n - 1; i >= 0; i--)
        if (e->row[i] < n_rows) e->picks[i] = e->picks[k], e->pick_logp[i] = e->pick_logp[k], k--;
    return RF_OK;
}

rf_status rf_rollout_step(rf_rollout *e) {
    if (rf_rollout_idle(e)) return RF_OK;
    RF_TRY(rf_rollout_acquire_cache(e)); /* when released while idle (rf_rollout_release_cache) */
    RF_TRY(reserve_decode(e));
    int n_rows = 0;
    RF_TRY(build_batch(e, &n_rows));
    if (e->n_running == 0)
        return rf_error(RF_ERR_INTERNAL, "rollout: nothing could be scheduled (%d running, %d "
                        "waiting, %d free blocks)", e->n_running, e->n_waiting, e->pool.n_free);
    if (n_rows > 0 && e->mc.decode_sample) RF_TRY(decode_and_draw(e, n_rows));
    else if (n_rows > 0) RF_TRY(e->mc.decode(e->mc.ctx, &e->pool, e->batch, n_rows, e->tokens, e->logits));
    size_t V = e->V;
    int n_capture = 0;
    for (ro_request *r = e->retained; r; r = r->next_retained)
        if (r->capture_row >= 0) { /* decode_and_draw: the whole rows in rows 0, 1, ... in this order */
            size_t at = e->mc.decode_sample ? (size_t)n_capture++ : (size_t)r->capture_row;
            memcpy(r->first_logits, e->logits + at * V, sizeof(float) * V);
            r->first_lse = e->mc.decode_sample ? e->capture_lse[at] : NAN;
            r->capture_row = -1;
        }
    for (int i = 0; i < e->n_running; i++) e->running[i]->n_cached = e->running[i]->n_tokens;
    e->stats.steps++;
    return sample_all(e, n_rows);
}

rf_status rf_rollout_run_until_idle(rf_rollout *e) {
    while (!rf_rollout_idle(e)) RF_TRY(rf_rollout_step(e));
    return RF_OK;
}
