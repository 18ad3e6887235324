/* The rollout engine: the generation side of RL. Requests (a prompt, n samples, sampling
 * parameters, stop conditions, a seed) go in; samples (tokens, behaviour log-probs, the policy
 * version of every token, a finish reason) come out one at a time, as each finishes.
 *
 * Inside: a paged KV cache (rollout/kv_pool.h) whose blocks the n samples of one prompt share
 * (the prompt is prefilled once per group, a shared partially filled block is copied on write),
 * and a continuous-batching scheduler (Orca, Yu et al. 2022; vLLM, Kwon et al. 2023): every
 * step runs ONE model call over the decode tokens of the running sequences plus the prompts of
 * newly admitted ones, so sequences join as others finish, bounded by max_running sequences
 * and max_batch_tokens tokens per step. When the pool runs out of blocks the most recently
 * admitted sequence is preempted (its blocks freed), re-queued at the front, and later
 * recomputed from its prompt and generated tokens.
 *
 * Determinism: sample i of a request draws from its own RNG seeded seed + i, kept across
 * preemption, so a sample's tokens do not depend on scheduling, batching or preemption; with
 * n = 1 and seeds seed + r the engine reproduces rf_generate (model/generate.h).
 *
 * Threads: an engine is used by one thread at a time (it drives its model). The callback runs
 * on that thread inside rf_rollout_step; it may call rf_rollout_submit and
 * rf_rollout_set_version, not rf_rollout_step, rf_rollout_run_until_idle or rf_rollout_free. */
#ifndef RF_ROLLOUT_H
#define RF_ROLLOUT_H

#include <stdint.h>

#include "model/generate.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "rollout/kv_pool.h"

typedef struct rf_rollout rf_rollout;

typedef struct rf_rollout_opts {
    int block_size;          /* positions per KV block; 0 = 16 */
    int n_blocks;            /* blocks in the pool, bounds KV memory; 0 = sized from memory:
                                enough for max_running sequences of max_seq_len positions, at
                                most mem_fraction of the back end's free memory (measured when
                                the engine is made, after the model is loaded) */
    int max_seq_len;         /* the longest sequence (prompt + response) requests will have,
                                for n_blocks = 0; 0 = the model's position limit */
    double mem_fraction;     /* for n_blocks = 0, in (0, 1]; 0 = 0.9 */
    int max_running;         /* sequences in a step at most; 0 = 64 */
    int max_batch_tokens;    /* tokens per model call at most (decode + prefill); 0 = 2048.
                                A prompt longer than this is prefilled alone in its step. */
    const rf_tokenizer *tok; /* for stop strings and sample text; may be NULL */
} rf_rollout_opts;

typedef struct rf_rollout_request {
    const int32_t *prompt;   /* (prompt_len) copied at submit */
    int prompt_len;
    int n;                   /* samples of this prompt (a GRPO group); >= 1 */
    rf_sampling sampling;
    int max_new_tokens;      /* >= 1 */
    uint64_t seed;           /* sample i uses an RNG seeded seed + i */
    const int32_t *stop_ids; /* (n_stop_ids) EOS / stop token ids, copied; finish "eos" */
    int n_stop_ids;
    const char *stop[RF_MAX_STOP]; /* stop strings, copied; need opts.tok; finish "stop" */
    int n_stop;
    /* Multi-turn episodes (docs/env-api.md): with episode = 1 every sample is an episode of
     * turns. A turn ends as a response does (a stop id, a stop string, or max_new_tokens tokens
     * in the turn); the callback then gets the turn (turn_end = 1) and the sample waits, its KV
     * blocks kept, until rf_rollout_continue appends an observation and starts the next turn
     * (the prefix is not run again) or rf_rollout_end delivers it. A turn also ends when the
     * sample reaches max_total_tokens after the prompt. */
    int episode;
    int max_total_tokens;    /* episode: tokens after the prompt (generated and observations) at
                                most, >= max_new_tokens; bounds the sample's positions */
} rf_rollout_request;

/* A finished sample, as the callback sees it. Every pointer is the engine's and valid only
 * during the callback: copy what you keep. */
typedef struct rf_rollout_sample {
    uint64_t request_id;     /* as returned by rf_rollout_submit */
    int index;               /* sample index within the request, 0 .. n-1 */
    void *user;              /* as given to rf_rollout_submit */
    const int32_t *prompt;   /* (prompt_len) */
    int prompt_len;
    const int32_t *tokens;   /* (n_tokens) generated ids, including a final stop id */
    const float *logprobs;   /* (n_tokens) behaviour log-probs (rf_sample's) */
    const int *versions;     /* (n_tokens) policy version current when each token was sampled */
    int n_tokens;
    const char *text;        /* decoded, cut before a stop string; NULL without a tokenizer.
                                NUL-terminated, but a token decoding to U+0000 puts NULs
                                inside: text_len counts every byte */
    size_t text_len;
    rf_finish finish;
    int n_preempted;         /* times this sample was preempted and recomputed */
    /* episodes (rf_rollout_request.episode): */
    const uint8_t *mask;     /* (n_tokens) 1: generated (in the loss), 0: an observation; NULL
                                for a plain request. Observation tokens have log-prob 0 and
                                the version of the generated token before them */
    int turn_end;            /* 1: a turn ended and the sample waits (rf_rollout_continue or
                                rf_rollout_end); 0: the sample is finished and gone */
    int turn;                /* turns generated so far, this one included */
    int turn_start;          /* index into tokens of this turn's first generated token; text is
                                this turn's (a plain request: 0, the whole response) */
} rf_rollout_sample;

typedef void (*rf_rollout_callback)(void *ctx, const rf_rollout_sample *s);

typedef struct rf_rollout_stats {
    int pool_blocks;              /* blocks in the KV pool */
    int64_t steps;                /* rf_rollout_step iterations that did work */
    int64_t tokens_generated;     /* sampled tokens */
    int64_t prefill_tokens;       /* prompt (and recomputed) tokens run through the model */
    int64_t decode_tokens;        /* single-token decode positions run through the model */
    int64_t preemptions;
    int64_t samples_finished;
    int64_t prefix_blocks_shared; /* block references shared instead of prefilled again */
    int64_t prefix_joins;         /* samples started from a retained prefix, without a model call */
    int64_t cow_copies;           /* shared blocks copied before an append */
    int64_t cache_releases;       /* times the pool's memory was given back (rf_rollout_release_cache) */
    int peak_blocks_used;
    int running, waiting;         /* sequences now */
} rf_rollout_stats;

/* The model behind an engine: what makes its pool and runs a step's one model call. The whole
 * model's (rf_rollout_init) by default; a tensor-parallel group supplies its own
 * (rollout/rollout_tp.h), whose calls also drive the group's other ranks. */
typedef struct rf_rollout_model {
    const rf_model_config *cfg; /* the whole model's: vocabulary and position limit */
    void *ctx;                  /* passed back to the functions below; borrowed */
    const rf_kernels *k;        /* the back end holding the pool (its free memory sizes it) */
    int kv_heads;               /* k/v heads a block holds (a tensor-parallel rank's share) */
    /* Makes the engine's pool of n_blocks blocks of block_size positions. */
    rf_status (*pool_init)(void *ctx, rf_kv_pool *p, int n_blocks, int block_size);
    /* rf_model_decode_paged's contract: whole rows of logits (n, cfg->vocab_size), from which
     * the engine samples. NULL when decode_sample is given. */
    rf_status (*decode)(void *ctx, rf_kv_pool *p, const rf_paged_seq *seqs, int n,
                        const int32_t *tokens, float *logits);
    /* Copy on write (rf_kv_pool_copy's contract); it runs before the step's decode call. */
    void (*copy)(void *ctx, rf_kv_pool *p, int dst, int src, int n_rows);
    /* Gives the pool's memory back while no block is in use (rf_kv_pool_release's contract),
     * and the model's pass workspace (rf_model_trim); the engine's next step allocates the
     * pool again (rf_kv_pool_acquire). */
    rf_status (*pool_release)(void *ctx, rf_kv_pool *p);
    /* Optional, in place of decode, for a model that samples from logits it holds in parts
     * (tensor parallelism): the step's model call as decode, then the step's n_draws draws
     * (draw i from row draws[i].row into picks[i], logp[i], as rf_sample_u gives them), and
     * the whole logits of rows capture[0 .. n_capture) into whole (n_capture, V), kept for
     * samples that start later from a retained prefix, and into whole_lse[i] the row's
     * log-sum-exp at capture_inv_temp[i] as the model's back end computes it (rf_model_draw), or
     * NaN where the model does not give it (the engine then computes it on the host). */
    rf_status (*decode_sample)(void *ctx, rf_kv_pool *p, const rf_paged_seq *seqs, int n, const int32_t *tokens,
                               const rf_draw *draws, int n_draws, int32_t *picks, float *logp,
                               const int *capture, int n_capture, float *whole, const float *capture_inv_temp,
                               float *whole_lse);
} rf_rollout_model;

/* Creates an engine generating with model m (borrowed: m must outlive the engine and is driven
 * by it during steps) and a KV pool of o->n_blocks blocks on m's back end (sized from memory
 * when 0, logged). o may be NULL (defaults). Errors: RF_ERR_ARG for negative sizes, a model
 * without an LM head, or max_running > max_batch_tokens; RF_ERR_NOMEM, also when a pool sized
 * from memory would not hold one sequence of max_seq_len positions. Free with rf_rollout_free. */
rf_status rf_rollout_init(rf_rollout **e, rf_model *m, const rf_rollout_opts *o);
/* The same over any model behind mc (copied; mc->ctx and mc->cfg borrowed, outliving the
 * engine). RF_ERR_ARG unless mc gives pool_init, pool_release, copy and exactly one of decode
 * and decode_sample. */
rf_status rf_rollout_init_model(rf_rollout **e, const rf_rollout_model *mc, const rf_rollout_opts *o);
void rf_rollout_free(rf_rollout *e);

/* Sets the function that receives each finished sample (ctx is passed back). Without one,
 * finished samples are counted and dropped. */
void rf_rollout_set_callback(rf_rollout *e, rf_rollout_callback fn, void *ctx);

/* Queues a request; nothing runs until rf_rollout_step. Everything in req is copied. *id (may
 * be NULL) receives the request id. Errors (nothing queued): RF_ERR_ARG for an empty prompt,
 * n < 1, max_new_tokens < 1, bad sampling parameters, stop strings without a tokenizer, or
 * too many stop strings; RF_ERR_RANGE for a token id outside the vocabulary, a sequence longer
 * than the model's limit, or one sample needing more KV blocks than the whole pool holds. */
rf_status rf_rollout_submit(rf_rollout *e, const rf_rollout_request *req, void *user,
                            uint64_t *id);

/* The policy version recorded on tokens sampled from now on (weights may change between
 * steps: in-flight sequences continue and their later tokens carry the new version). */
void rf_rollout_set_version(rf_rollout *e, int version);

/* One scheduler iteration: reserve KV slots for the running sequences (preempting when the
 * pool is full), admit waiting sequences, run one model call, sample, and deliver the samples
 * that finished. Does nothing when idle. Errors come from the model call or the tokenizer;
 * after one the engine should be freed. */
rf_status rf_rollout_step(rf_rollout *e);

/* Episodes: sample `index` of request `request_id`, waiting after a turn, gets the observation
 * obs (n_obs >= 0 token ids, copied, masked out) appended and generates its next turn from
 * the next step. Its KV blocks stay: only the observation and the turn's last token are run
 * through the model (when max_running sequences already run, it waits and its prefix is
 * computed again on admission). Call between steps, not from the callback. Errors:
 * RF_ERR_ARG for a sample that is not waiting; RF_ERR_RANGE for an id outside the vocabulary
 * or when the observation leaves no room for a token within max_total_tokens (end the episode
 * instead). */
rf_status rf_rollout_continue(rf_rollout *e, uint64_t request_id, int index, const int32_t *obs, int n_obs);

/* Episodes: ends waiting sample `index` of request `request_id`: the callback gets the whole
 * episode (turn_end = 0; tokens are every generated and observation token after the prompt,
 * mask says which) and the sample is freed. Call between steps. RF_ERR_ARG when not waiting. */
rf_status rf_rollout_end(rf_rollout *e, uint64_t request_id, int index);

/* Episode samples waiting between turns. */
int rf_rollout_waiting_turns(const rf_rollout *e);

/* Steps until no sequence is running or waiting. */
rf_status rf_rollout_run_until_idle(rf_rollout *e);

/* 1 when nothing is running or waiting (episode samples between turns do not count). */
int rf_rollout_idle(const rf_rollout *e);

/* Gives the KV pool's memory and the model's pass workspace back to the back end while the
 * engine is idle, so that the device can serve something else until the next step with work
 * allocates them again (verl's free_cache_engine, vLLM's sleep mode; in a colocated run,
 * training). Nothing to do when already released. Errors: RF_ERR_ARG when sequences are
 * running or waiting, or episodes wait between turns; the model's pool_release. */
rf_status rf_rollout_release_cache(rf_rollout *e);
/* Allocates a released KV pool again (rf_rollout_step does when it has work); nothing to do
 * when it is held. RF_ERR_NOMEM naming the size. */
rf_status rf_rollout_acquire_cache(rf_rollout *e);

void rf_rollout_get_stats(const rf_rollout *e, rf_rollout_stats *s);

/* The engine's KV pool, read-only (tests inspect block references). */
const rf_kv_pool *rf_rollout_pool(const rf_rollout *e);

/* The most positions one sequence (prompt and generation) may take: the model's limit
 * (rf_config_max_seq), which rf_rollout_submit holds a request to. */
int rf_rollout_max_positions(const rf_rollout *e);

#endif
