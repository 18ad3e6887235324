/* Pieces of the run shared by the controller's files. */
#ifndef RF_RUN_INTERNAL_H
#define RF_RUN_INTERNAL_H

#include "controller/roles.h"
#include "controller/run.h"
#include "env/bridge.h"
#include "model/lora.h"
#include "rollout/rollout_tp.h"
#include "trainer/checkpoint.h"

rf_status rf__ensure_data(const rf_recipe *r);
rf_status rf__ensure_model(const rf_recipe *r);
rf_status rf__load_roles(rf_run *run);
/* Attaches the adapters of the recipe's [lora] section to m (nothing when lora.enabled is
 * false), before rf_model_enable_training. Errors name the lora key. */
rf_status rf__lora_attach(const rf_recipe *r, rf_model *m);

/* The adapters' options of the recipe's [lora] section (seeded by train.seed); errors name
 * lora.targets. */
rf_status rf__lora_opts(const rf_recipe *r, rf_lora_opts *o);
rf_status rf__load_data(rf_run *run);
rf_status rf__load_rewards(rf_run *run);
rf_status rf__reject_unimplemented(const rf_recipe *r);
/* placement.actor.tp and placement.rollout.tp against the model's shape: tensor parallelism
 * splits whole attention heads (and at most one vocabulary or intermediate row per shard).
 * RF_ERR_ARG naming the key, where it was set, and the model's numbers. rf__check_tp_model_path reads model.path's config.json. */
rf_status rf__check_tp_model(const rf_recipe *r, const rf_model_config *cfg);
rf_status rf__check_tp_model_path(const rf_recipe *r);
/* The rollout engine over the actor, sized by [rollout]. */
rf_status rf__start_rollout(rf_run *run);
/* A rollout engine sized by the recipe's [rollout] (colocated: rollout.kv_memory_fraction's
 * colocated default) over model m, or over tensor-parallel group g when not NULL; a pool
 * that does not fit is an error naming the keys that size it. */
rf_status rf__rollout_engine(const rf_recipe *r, int colocated, rf_model *m, rf_rollout_tp *g,
                             const rf_tokenizer *tok, rf_rollout **e);
/* Generation has paused (engine e idle): with rollout.free_kv_cache resolved on, the KV
 * cache's memory is given back until e's next step; the first release is logged, naming
 * rollout worker `worker` (-1: the one-process run's engine) and the MB. */
rf_status rf__rollout_pause(const rf_recipe *r, rf_rollout *e, int worker);
/* Generation resumes on engine e: its KV cache allocated again when it was given back, and a
 * device without room for it an error naming the keys that size it. */
rf_status rf__rollout_resume(rf_rollout *e);
void rf__run_free(rf_run *run);

/* The Shutdown reason the reward and environment programs get when rf__run_free closes their
 * endpoints: RF_MSG_SHUTDOWN_DONE when st is RF_OK, RF_MSG_SHUTDOWN_INTERRUPTED when the run
 * stopped on a signal with its checkpoint written, else "the run stopped on an error: <the
 * error message>" (docs/message-api.md). */
void rf__run_set_end(rf_run *run, rf_status st);

/* <logging.dir>/run_status.json: how the run ended, {"status": "ok", "message": ""} or
 * {"status": "error", "message": <the error>}, written atomically; one-process and split runs
 * alike (docs/deployment.md). Best effort: a directory that cannot take it is not an error. */
void rf__write_run_status(const rf_recipe *r, rf_status st);

/* logging.dir, the metrics sinks and <logging.dir>/recipe.toml (the effective recipe). */
rf_status rf__open_logging(rf_run *run);

/* One console line for run->step from the metrics set so far. */
void rf__console(const rf_run *run);

/* A random model of model.init_preset with the byte-level tokenizer, saved to dir. */
rf_status rf__init_model(const rf_recipe *r, const char *dir);
/* The [reward] rules of r (reward.rules, weights, format, length, overlong). */
rf_status rf__rules_init(const rf_recipe *r, rf_reward_rules **out);
/* init_preset model, supervised on data.train responses per [sft], saved to dir. */
rf_status rf__sft_build(const rf_recipe *r, const char *dir);

/* [env] (controller/episodes_run.c): opens run->env from the recipe (nothing without
 * env.type; env.type = "external" waits env.timeout for a program); a step's samples as
 * episodes (n_prompts groups of rollout.n into out, scored by the rules on the last turn,
 * env/ metrics set); validation responses by greedy episodes for requests q (n, one each) into
 * out (text: the whole response, for the reward model and programs; rules_text: the last
 * turn's, which the rules score: rf__val_score, the training reward definition). */
rf_status rf__env_open(rf_run *run);
/* env.type = "external": the environment bridge bound (env.endpoint, or a loopback endpoint with
 * CURVE keys made for the run when only env.programs is set), env.programs started with the
 * endpoint and keys in their environment (RLFLOW_ENV_*), and every program waited for (one
 * without env.programs) up to env.timeout. Caller owns *x. */
rf_status rf__env_bridge_open(rf_run *run, rf_env_bridge **x);
rf_status rf__generate_episodes(rf_run *run, const rf_example *const *ex, const int64_t *group_ids, int n_prompts, int round,
                                rf_train_sample *out, double *tokens);
rf_status rf__val_episodes(rf_run *run, const rf_role_gen *q, int n, rf_train_sample *out);

/* ---- controller/rl_core.c: the dataflow's pieces every deployment runs, once ---- */

/* run->r = r, and the run state the loop starts from: the algorithm's enums parsed (errors
 * name the recipe key), the KL controller at algorithm.kl_coef, no best validation yet. */
rf_status rf__run_state_init(rf_run *run, const rf_recipe *r);

/* --resume: the newest checkpoint of logging.dir into actor and critic (either may be NULL: the
 * controller of a split run, whose training worker loads its own) and run's step, data
 * position, KL coefficient and best validation accuracy; logs where it resumes. */
rf_status rf__run_resume(rf_run *run, rf_model *actor, rf_model *critic);

/* The run state a checkpoint of run->step keeps, resuming generation at data position pos with
 * admission count (next group id) admitted. */
rf_ckpt_state rf__run_ckpt_state(const rf_run *run, rf_dataset_pos pos, int64_t admitted);

/* DAPO dynamic sampling: whether a group of n samples is informative (not every total reward
 * equal: an all-equal group has zero advantage). */
int rf__group_informative(const rf_train_sample *s, int n);

/* External reward programs (run->ext; nothing without) score samples s (n, in groups of per;
 * group g's example ex[g]): item i is sample i % per of group ids[i / per], and
 * rf__apply_external adds the scores. */
rf_status rf__external_score(rf_run *run, const rf_example *const *ex, rf_train_sample *s, int n, int per,
                             const int64_t *ids);

/* What a validation sample counts towards val/accuracy, the same in every deployment: its
 * accuracy by the reward rules, or its reward when none of the rules judges correctness
 * (accuracy NaN): the rules' reward for `rlflow eval`, the total reward of the training reward
 * definition in a run (rf__val_score). */
double rf__val_credit(double reward, float accuracy);

/* A validation's result on run->metrics: val/accuracy, val/reward (the mean total reward; only
 * with reward programs or a reward model, [env] episodes included) and val/length_mean. */
void rf__val_metrics(rf_run *run, double acc, double reward, double len);

/* The sampling seed of a prompt group: prompt p of dynamic-sampling round `round` of the batch
 * of step `step` (0-based); its n samples take seed, seed + 1, ... Split runs give the group
 * admitted as id the seed of (id / prompts_per_step, 0, id % prompts_per_step), so that at
 * staleness 0 a group is generated as in the one-process run. */
uint64_t rf__group_seed(const rf_recipe *r, int step, int round, int p);

/* A generated sample into s (zeroed by the caller): the prompt's and the response's tokens and
 * the behaviour log-probs copied, the text kept (NULL: ""), and scored by the reward rules
 * (reward, accuracy, rule_reward) against answer. The caller sets the token versions. */
rf_status rf__sample_init(rf_run *run, rf_train_sample *s, const int32_t *prompt, int n_prompt, const int32_t *resp,
                          const float *logp, int n_resp, const char *text, const char *answer);

/* Whether the end of update `step` (1-based) validates, writes a checkpoint, prints a console
 * line: the last step always; else logging.val_every, checkpoint.every, logging.every.
 * Validation alone has an off switch: logging.val_every = 0 validates no step at all (also
 * not step 0, before training, which rf__val_due also answers for). */
int rf__val_due(const rf_recipe *r, int step);
int rf__ckpt_due(const rf_recipe *r, int step);
int rf__console_due(const rf_recipe *r, int step);

/* Optimizer options of the actor (critic = 0) or the critic (1) from the recipe. */
rf_optim_opts rf__optim_opts(const rf_recipe *r, int critic);

/* Update options of the actor (critic = 0) or the critic (1) at RL step `step`; the
 * decoupled objective is on when the recipe asks or when async.max_staleness > 0. */
/* Whether the update weights tokens by the behaviour/proximal gap: algorithm.decoupled,
 * async.max_staleness > 0 or algorithm.rollout_correction other than "none". */
int rf__is_corrected(const rf_recipe *r);

rf_update_opts rf__update_opts(const rf_recipe *r, float kl_beta, rf_kl_est est, rf_loss_agg agg,
                               int step, int critic);

/* Advantages (and returns) of n samples in place; k1 KL (prox_logp - ref_logp) into the token
 * rewards when algorithm.kl_in_reward and has_ref. *mean_kl: the mean k1 (0 without ref). */
rf_status rf__advantages(const rf_recipe *r, rf_adv_kind kind, float kl_beta, int has_ref,
                         rf_train_sample *samples, int n, double *mean_kl);

/* A sample's whole reward: the sequence reward plus the sum of its per-token rewards. */
static inline double rf__total_reward(const rf_train_sample *s) {
    double r = s->reward;
    for (int t = 0; s->token_rewards && t < s->n_resp; t++) r += s->token_rewards[t];
    return r;
}

/* The reward model's score of each of the n samples (whole sequences) into sc (n). */
rf_status rf__reward_model_scores(rf_reward_model *rm, const rf_train_sample *s, int n, float *sc);

/* Applies the last successful external batch (run->ext) to samples s (n, item i = sample i):
 * reward += reward.external_weight * sc[i], and the per-token rewards the programs sent,
 * weighted the same, into s[i].token_rewards; adds the batch's named components and reply
 * counts to run->ext_acc. */
rf_status rf__apply_external(rf_run *run, rf_train_sample *s, int n, const float *sc);

/* Sets reward/external/rejected, /resent and /<component> (the mean of the batches' means)
 * from run->ext_acc on m, and resets it. Nothing without reward programs. */
void rf__external_metrics(rf_run *run, rf_metrics *m);

/* One validation response (pointers borrowed for the call). */
typedef struct rf_val_response {
    const rf_example *ex;
    const char *text;     /* NULL: "" */
    const int32_t *ids;   /* (n_ids) the response's token ids */
    int n_ids;
    const char *rules_text; /* NULL: text; an episode: its last turn, what the rules score (the
                               reward model and programs get the whole response, as in training) */
    const int32_t *prompt_ids; /* (n_prompt) the prompt as the model saw it, before ids: an
                                  episode's prompt and first observation, as training's sample
                                  holds it; NULL: the example's prompt ids */
    int n_prompt;
    const float *turn_rewards; /* (n_ids) an episode's turn rewards at their turns' last tokens,
                                  summed into the reward as training's GRPO reward does; NULL: none */
    const float *rm_score;     /* the reward model's score when another process hosts it (the
                                  training worker scored the response); NULL: run->rm scores it */
} rf_val_response;

/* Scores n validation responses with the run's reward definition, the one training uses:
 * the rules, plus an episode's turn rewards, plus reward.model_weight x the reward model (run->rm
 * here, or the score the training worker sent, rf_val_response.rm_score), plus
 * reward.external_weight x the reward programs' reward and per-token rewards (requests with
 * group_id -1). Adds each response's total to *reward_sum and its accuracy (the rules'
 * correctness, or the total when no correctness rule is listed) to *acc_sum. The same in the
 * one loop of every deployment (docs/training.md, "Validation"). */
rf_status rf__val_score(rf_run *run, const rf_val_response *v, int n, double *acc_sum, double *reward_sum);


/* logging.samples_every: at a step it divides, logs logging.samples_per_step of the batch's n
 * samples s (groups of rollout.n; ex: the example of each group) with rf_metrics_samples on
 * run->metrics: one response of each group in turn. The same in every deployment (the one
 * loop calls it). */
rf_status rf__log_samples(rf_run *run, int step, const rf_train_sample *s, const rf_example *const *ex, int n);

/* reward/..., response/... metrics of a batch (reward/mean: rf__total_reward). */
void rf__batch_metrics(rf_metrics *m, const rf_recipe *r, const rf_train_sample *samples, int count);

/* Sets the actor/... and critic/... metrics of one update on m (c may be NULL). */
void rf__update_metrics(rf_metrics *m, const rf_recipe *r, const rf_update_stats *a,
                        const rf_update_stats *c);

/* EOS ids for generation from the model dir and tokenizer (caller frees *ids). */
rf_status rf__eos_ids(const char *dir, const rf_model *m, const rf_tokenizer *tok, int32_t **ids,
                      int *n);

#endif
