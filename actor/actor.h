/* The actor, reference and critic roles: per-token log-probs and values of responses, and
 * their training updates (policy loss, value loss) in mini-batches of micro-batches packed by
 * token budget. Inputs and outputs are plain host structures (a train batch in, statistics out)
 * so that the message API can carry them unchanged. */
#ifndef RF_ACTOR_H
#define RF_ACTOR_H

#include "actor/losses.h"
#include "model/model.h"
#include "model/model_tp.h"
#include "trainer/data_parallel.h"
#include "trainer/optim.h"

/* One response and everything the update needs, host memory. Arrays of n_resp floats. */
typedef struct rf_train_sample {
    int32_t *tokens;   /* (n_prompt + n_resp) prompt then response */
    int n_prompt, n_resp;
    int group;         /* samples of one prompt share a group id */
    float reward, accuracy;
    float *behav_logp; /* log-probs recorded at generation */
    float *prox_logp;  /* log-probs of the policy at the start of the update */
    float *ref_logp;   /* reference policy (KL) */
    float *values;     /* critic values at the start of the update */
    float *adv, *returns;
    float *entropy;    /* entropy of the policy at generation-time weights (logging) */
    int *versions;     /* policy version of each response token */
    char *text;        /* decoded response (rewards); owned, may be NULL */
    float *token_rewards; /* (n_resp) per-token rewards from reward programs (weighted) added at
                             their tokens by GAE and REINFORCE++; owned, NULL: none */
    float rm_score;    /* the reward model's score of the whole sequence (a training worker
                          scoring for the controller; unweighted) */
    uint8_t *loss_mask;    /* (n_resp) 1: a generated token, in the loss; 0: an environment's
                              observation inside a multi-turn episode, out of every loss term,
                              statistic and token count; owned, NULL: every token is in */
    float rule_reward;     /* the reward rules' part of reward (per-sample logs) */
    float external_reward; /* reward programs' sequence score, weighted: their part of reward */
    char *rules_text;      /* a validation episode: its last turn's text, what the rules score (text
                              stays the whole response, for the reward model and programs); owned,
                              NULL: the rules score text */
} rf_train_sample;

/* Allocates the per-token arrays of s (tokens must be set); frees them. */
rf_status rf_train_sample_alloc(rf_train_sample *s);
void rf_train_sample_free(rf_train_sample *s);

/* Fills out[i] (n_resp floats per sample, array of pointers) with the log-probs (and entropy
 * when ent is non-NULL) of each response token under model m, micro-batched by max_tokens. */
rf_status rf_actor_logprobs(rf_model *m, rf_train_sample *s, int n, int max_tokens,
                            float inv_temp, float **out, float **ent);

/* rf_actor_logprobs on a tensor-parallel model: every rank of tp's group calls it with the same
 * samples and gets the same log-probs (model/model_tp.h). */
rf_status rf_actor_logprobs_tp(rf_model_tp *tp, rf_train_sample *s, int n, int max_tokens,
                               float inv_temp, float **out, float **ent);

/* Critic values of each response token (value at the position that predicts it). */
rf_status rf_critic_values(rf_model *critic, rf_train_sample *s, int n, int max_tokens, float **out);

/* rf_critic_values on a tensor-parallel critic (every rank of the group, the same samples). */
rf_status rf_critic_values_tp(rf_model_tp *tp, rf_train_sample *s, int n, int max_tokens, float **out);

typedef struct rf_update_opts {
    rf_pg_opts pg;
    rf_loss_agg agg;
    int max_resp_len;      /* for seq-mean-token-sum-norm */
    int epochs, mini_batches, micro_tokens;
    float inv_temp;
    float value_clip;
    uint64_t shuffle_seed; /* order of samples across epochs: reproducible */
    int version;           /* the policy version being updated: response tokens generated at it
                              (versions[t] == version) give the log-prob mismatch statistics */
    int prox_from_forward; /* 1: the proximal log-probs are the current policy's, taken from the
                              update's own forward pass (no separate pass). Exact when epochs = 1
                              and mini_batches = 1: the weights do not move before the only
                              optimizer step. prox_logp is overwritten. */
    rf_dp *dp;             /* data parallel over dp's ranks (its model is the one updated), or
                              NULL: this rank alone. With dp, every rank passes its own share
                              of the batch; each pass shuffles each rank's share, and mini-batch
                              b is the b-th of mini_batches parts of every rank's share, with
                              loss weights from the totals over all ranks; every rank gets the
                              same statistics, summed over ranks. */
    rf_model_tp *tp;       /* tensor parallel over tp's group (the model updated is tp->m, this
                              rank's shard), or NULL. Every rank of the group passes the whole
                              batch and the same options; the gradient norm for clipping is the
                              whole model's (rf_model_tp_grad_sumsq), AdamW runs on each shard,
                              and every rank gets the same statistics. With dp too (a
                              tp x dp grid): dp made by rf_dp_init_tp on tp over the ranks
                              holding the same shard; every TP rank of a DP replica passes that
                              replica's share. */
} rf_update_opts;

typedef struct rf_update_stats {
    rf_pg_stats pg;
    double value_loss, value_clipfrac, grad_norm, lr;
    int optimizer_steps;
    long tokens;
    /* |behaviour log-prob - the trainer's log-prob| over response tokens generated at
     * rf_update_opts.version, taken from the forward pass of the first mini-batch (before the
     * weights move): generation and training should compute the same numbers. */
    double lp_mismatch_sum, lp_mismatch_max;
    long lp_mismatch_n;
} rf_update_stats;

/* PPO-style policy update of actor m over samples (advantages, prox/behav/ref log-probs set). */
rf_status rf_actor_update(rf_model *m, const rf_optim_opts *oo, const rf_update_opts *uo,
                          rf_train_sample *s, int n, rf_update_stats *st);

/* Value update of critic c (values and returns set). */
rf_status rf_critic_update(rf_model *c, const rf_optim_opts *oo, const rf_update_opts *uo,
                           rf_train_sample *s, int n, rf_update_stats *st);

/* Supervised update: maximise the log-likelihood of the response tokens (token-mean over the
 * mini-batch), one optimizer step over all samples given. */
rf_status rf_sft_update(rf_model *m, const rf_optim_opts *oo, int micro_tokens,
                        rf_train_sample *s, int n, double *loss, double *grad_norm);

#endif
