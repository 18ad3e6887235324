/* The post-training run in one process: recipe -> prompts -> rollout -> rewards -> reference
 * / critic -> advantages -> actor (and critic) update -> new weights to rollout -> repeat, with
 * validation, metrics and checkpoints. The loop is the one every deployment runs
 * (controller/controller.h, rf_controller_run); here it reaches the roles in process
 * (controller/roles.h: a generate request in, samples out; a train batch in, statistics out),
 * split runs reach the same roles by messages. */
#ifndef RF_RUN_H
#define RF_RUN_H

#include <stdint.h>

#include "actor/actor.h"
#include "controller/advantages.h"
#include "controller/dataset.h"
#include "controller/metrics.h"
#include "controller/recipe.h"
#include "model/tokenizer.h"
#include "env/env.h"
#include "reward/external.h"
#include "reward/reward.h"
#include "rollout/rollout.h"

/* What reward programs returned since the metrics last took it (rf__apply_external adds, rf__external_metrics takes). */
typedef struct rf_external_acc {
    char name[RF_EXTERNAL_MAX_COMPONENTS][96]; /* named components seen */
    double sum[RF_EXTERNAL_MAX_COMPONENTS];    /* sum of the batches' means */
    int n[RF_EXTERNAL_MAX_COMPONENTS], count;  /* batches per component; components */
    int64_t rejected, resent;                  /* replies rejected, requests re-sent */
    int warned;                                /* names past the table were reported */
} rf_external_acc;

typedef struct rf_run {
    const rf_recipe *r;
    const rf_kernels *k;
    rf_model *actor, *ref, *critic;
    rf_rollout *engine;    /* generation with the actor's weights (colocated: the same memory) */
    rf_tokenizer *tok;
    rf_dataset *train, *val;
    int positions;         /* the model's position limit (rf_config_max_seq of model.path's
                              config.json), read with the data; 0 where it has none yet */
    rf_reward_rules *rules;
    rf_reward_model *rm;   /* optional reward model */
    rf_external_reward *ext; /* optional external reward programs */
    struct rf_programs *programs; /* reward.programs, started by rlflow (controller/programs.h) */
    struct rf_programs *env_programs; /* env.programs, started by rlflow */
    rf_env env;            /* [env]: the environment of multi-turn episodes; env.call NULL: none */
    rf_status (*env_tick)(void *); /* NULL, or called while the environment is waited on (a split */
    void *env_tick_ctx;            /* controller keeps its workers pinged) */
    rf_metrics *metrics;
    int32_t *eos;          /* generation stops at these ids */
    int n_eos;
    rf_adv_kind adv_kind;
    rf_loss_agg agg;
    rf_kl_est kl_est;
    rf_kl_ctl kl;
    rf_dataset_pos pos;
    int64_t admitted;  /* groups admitted before the first untrained batch, as resumed (0: not
                          in the checkpoint, step x prompts_per_step then) */
    int step;          /* RL steps done (= policy version for rollout) */
    int start_step;    /* step this process started (or resumed) at */
    double t_start;
    double best_val;
    /* reward programs since the metrics last took them: each named component's sum of batch
     * means and count, replies rejected and requests re-sent (rf__apply_external adds,
     * rf__external_metrics logs and resets) */
    rf_external_acc ext_acc;
} rf_run;

/* `rlflow run`: loads the recipe's models, data and rewards (building the SFT warm start and
 * the data set first when the recipe asks and they are missing), then trains. resume = 1
 * continues from the newest checkpoint in logging.dir. */
rf_status rf_run_main(const rf_recipe *r, int resume);

/* `rlflow sft`: supervised fine-tuning of model.path (or a fresh init_preset model) on
 * data.train responses; writes the result to sft.out. Checkpoints (weights, AdamW moments,
 * step, data position) go to <logging.dir>/sft_checkpoints every checkpoint.every steps and at
 * the end; resume = 1 continues from the newest one (exactly: the same final weights as an
 * uninterrupted run); a checkpoint directory holding checkpoints is refused unless resume or
 * overwrite (which removes them) is set (controller/run_dir.h). */
rf_status rf_sft_main(const rf_recipe *r, int resume, int overwrite);

/* Greedy accuracy of model m on the first n examples of ds (reward rules' accuracy). */
rf_status rf_eval_accuracy(rf_model *m, const rf_tokenizer *tok, rf_dataset *ds, int n,
                           const rf_reward_rules *rules, int max_new_tokens, const int32_t *eos,
                           int n_eos, double *acc, double *mean_len);

#endif
