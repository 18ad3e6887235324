/* Pieces of the run shared by the controller's files. */
#ifndef RF_RUN_INTERNAL_H
#define RF_RUN_INTERNAL_H

#include "controller/run.h"

rf_status rf__ensure_data(const rf_recipe *r);
rf_status rf__ensure_model(const rf_recipe *r);
rf_status rf__load_roles(rf_run *run);
rf_status rf__load_data(rf_run *run);
rf_status rf__load_rewards(rf_run *run);
rf_status rf__reject_unimplemented(const rf_recipe *r);
/* The rollout engine over the actor, sized by [rollout]. */
rf_status rf__start_rollout(rf_run *run);
void rf__run_free(rf_run *run);

/* A random model of model.init_preset with the byte-level tokenizer, saved to dir. */
rf_status rf__init_model(const rf_recipe *r, const char *dir);
/* init_preset model, supervised on data.train responses per [sft], saved to dir. */
rf_status rf__sft_build(const rf_recipe *r, const char *dir);

/* One RL step (generate, score, reference, critic, advantages, updates), metrics set on
 * run->metrics. */
rf_status rf__rl_step(rf_run *run);

/* Optimizer options of the actor (critic = 0) or the critic (1) from the recipe. */
rf_optim_opts rf__optim_opts(const rf_recipe *r, int critic);

/* EOS ids for generation from the model dir and tokenizer (caller frees *ids). */
rf_status rf__eos_ids(const char *dir, const rf_model *m, const rf_tokenizer *tok, int32_t **ids,
                      int *n);

#endif
