/* Checkpoints of a training run, written atomically:
 *   <run_dir>/step_000200/actor/        config.json, model.safetensors (F32), tokenizer files:
 *                                       loadable by `rlflow generate` and by transformers
 *   <run_dir>/step_000200/actor_optim/  AdamW moments ("<tensor>.exp_avg", ".exp_avg_sq")
 *   <run_dir>/step_000200/critic/, critic_optim/   when there is a critic
 *   <run_dir>/step_000200/trainer_state.json       step, optimizer steps, data position, KL
 *                                                  coefficient, best validation score
 *   <run_dir>/latest                               name of the newest complete checkpoint
 * Everything is written into step_000200.tmp, each file fsynced, then the directory is renamed
 * and `latest` replaced atomically: a crash at any point leaves the last good checkpoint. */
#ifndef RF_CHECKPOINT_H
#define RF_CHECKPOINT_H

#include "controller/dataset.h"
#include "model/model.h"

typedef struct rf_ckpt_state {
    int step;
    rf_dataset_pos pos;
    float kl_beta;
    double best_val;
} rf_ckpt_state;

/* Saves a checkpoint for st->step; tokenizer files are copied from tokenizer_dir; keeps the
 * newest `keep` checkpoints (0 = all). critic may be NULL. */
rf_status rf_checkpoint_save(const char *run_dir, const rf_model *actor, const rf_model *critic,
                             const char *tokenizer_dir, const rf_ckpt_state *st, int keep);

/* Loads the newest checkpoint into existing actor (and critic) models and fills st (actor and
 * critic NULL: the run state only).
 * RF_ERR_IO naming run_dir/latest when there is none. */
rf_status rf_checkpoint_load(const char *run_dir, rf_model *actor, rf_model *critic,
                             rf_ckpt_state *st);

/* Copies tokenizer.json, tokenizer_config.json, generation_config.json (those present) from
 * src_dir to dst_dir. */
rf_status rf_copy_tokenizer_files(const char *src_dir, const char *dst_dir);

#endif
