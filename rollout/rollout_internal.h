/* State of the rollout engine shared by rollout/rollout.c (API, requests, delivery) and
 * rollout/scheduler.c (one step: reserve, admit, run, sample). Not a public interface. */
#ifndef RF_ROLLOUT_INTERNAL_H
#define RF_ROLLOUT_INTERNAL_H

#include "rollout/rollout.h"

/* A submitted request: a copy of everything the caller passed. Freed when its last sample has
 * been delivered. */
typedef struct ro_request {
    uint64_t id;
    void *user;
    int32_t *prompt;          /* (prompt_len) */
    int prompt_len, n, n_left; /* n_left: samples not yet delivered */
    rf_sampling sampling;
    int max_new_tokens;
    int32_t *stop_ids;        /* (n_stop_ids) */
    int n_stop_ids;
    char *stop[RF_MAX_STOP];
    int n_stop;
    int episode, max_total;   /* episodes: gen_cap = max_total tokens after the prompt */
    int gen_cap;              /* tokens after the prompt a sample holds at most */
    /* Prefix retained for samples not yet started, so that a group admitted in parts is still
     * prefilled once: the prompt's blocks (one reference each) and the logits of its last
     * position, from which a late sample draws its first token. Dropped when the last sample
     * starts, or when the pool runs short (the late samples then prefill again). */
    int n_unstarted;          /* samples never admitted */
    int *prefix;              /* (n_prefix) block ids, or NULL */
    int n_prefix;
    float *first_logits;      /* (V) */
    float first_lse;          /* their log-sum-exp at the request's temperature from the model's
                                 back end (decode_sample's whole_lse), or NaN: the host's */
    int capture_row;          /* logits row to copy into first_logits after this step; -1 */
    struct ro_request *next_retained;
} ro_request;

/* One sample of a request, from submit to delivery. Between steps a running sequence has its
 * last token pending: n_cached == n_tokens - 1. A waiting one has no blocks (n_cached == 0). */
typedef struct ro_seq {
    ro_request *req;
    int index;               /* sample index within the request */
    rf_rng rng;              /* seeded seed + index; kept across preemption */
    int32_t *tokens;         /* (prompt_len + gen_cap) prompt, then generated (and observations) */
    float *logprobs;         /* (gen_cap) */
    int *versions;           /* (gen_cap) */
    uint8_t *mask;           /* (gen_cap) episodes: 1 generated, 0 observation; else NULL */
    int turn_start;          /* index into tokens where the current turn starts */
    int turn;                /* turns started */
    int n_tokens, n_cached;
    int *blocks;             /* (cap_blocks) block table */
    int n_blocks, cap_blocks;
    uint64_t group;          /* consecutive waiting sequences of one group share a prefill */
    int n_preempted;
    char *text;              /* decoded output (with a tokenizer); may hold NULs */
    size_t text_len;         /* bytes in text */
    rf_finish finish;
} ro_seq;

struct rf_rollout {
    rf_rollout_model mc;     /* the model behind the engine */
    size_t V;                /* its vocabulary */
    rf_rollout_opts o;
    rf_kv_pool pool;
    rf_rollout_callback cb;
    void *cb_ctx;
    int version;
    uint64_t next_id, next_group;
    ro_seq **waiting;        /* (cap_waiting) FIFO; preempted sequences go to the front */
    int n_waiting, cap_waiting;
    ro_seq **running;        /* (max_running) in admission order */
    int n_running;
    ro_request *retained;    /* list of requests holding a prefix */
    ro_seq **paused;         /* (cap_paused) episode samples between turns, blocks kept */
    int n_paused, cap_paused; /* cap_paused >= n_episode_seqs: pausing never allocates */
    int n_episode_seqs;      /* episode samples submitted and not yet freed */
    /* per-step scratch */
    rf_paged_seq *batch;     /* (max_running) */
    int *row;                /* (max_running) logits row of each running sequence */
    int32_t *tokens;         /* (tokens_cap) packed input tokens */
    int tokens_cap;
    float *logits;           /* (max_running, V) */
    float *work;             /* (n_work, 2 V) sampler scratch, one per thread */
    int n_work;
    int32_t *picks;          /* (max_running) each running sequence's next token, */
    float *pick_logp;        /* its log-prob */
    /* with mc.decode_sample: the step's draws (one per running sequence in a model row, in
       running order) and the rows to capture (max_running each) */
    rf_draw *draws;
    int *capture;
    float *capture_inv_temp, *capture_lse;
    rf_rollout_stats stats;
};

/* rollout.c */
rf_status rf__rollout_push_waiting(rf_rollout *e, ro_seq *s, int front);
/* Decodes s's output into s->text (with a tokenizer); *stopped = 1 when a stop string occurs,
 * the text then cut before it. */
rf_status rf__rollout_update_text(rf_rollout *e, ro_seq *s, int *stopped);
/* Hands a finished sample to the callback, then frees it (and its request after the last). */
void rf__rollout_deliver(rf_rollout *e, ro_seq *s);
/* An episode's turn ended: s keeps its blocks on the paused list and the callback gets the turn. */
rf_status rf__rollout_hold_turn(rf_rollout *e, ro_seq *s);
/* Drops every block reference of s. */
void rf__rollout_release_blocks(rf_rollout *e, ro_seq *s);
/* Drops request r's retained prefix (and takes r off the list). */
void rf__rollout_drop_prefix(rf_rollout *e, ro_request *r);

#endif
