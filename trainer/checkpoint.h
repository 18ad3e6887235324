/* Checkpoints of a training run, written atomically:
 *   <run_dir>/step_000200/actor/        config.json, model.safetensors (F32), tokenizer files:
 *                                       loadable by `rlflow generate` and by transformers
 *   <run_dir>/step_000200/actor_optim/  AdamW moments ("<tensor>.exp_avg", ".exp_avg_sq")
 *   <run_dir>/step_000200/critic/, critic_optim/   when there is a critic
 *   <run_dir>/step_000200/adapter/     with LoRA: the actor's adapters again in Hugging Face
 *                                       PEFT's layout (model/lora.h rf_lora_save_peft)
 *   <run_dir>/step_000200/trainer_state.json       step, optimizer steps, data position, KL
 *                                                  coefficient, best validation score, RL's
 *                                                  admission count ("admitted", absent in older
 *                                                  releases' checkpoints and in SFT's)
 *   <run_dir>/latest                               name of the newest complete checkpoint
 * Everything is written into step_000200.tmp, each file fsynced, then the directory is renamed
 * and `latest` replaced atomically: a crash at any point leaves the last good checkpoint. */
#ifndef RF_CHECKPOINT_H
#define RF_CHECKPOINT_H

#include "controller/dataset.h"
#include "model/model.h"
#include "model/model_tp.h"

typedef struct rf_ckpt_state {
    int step;
    rf_dataset_pos pos;
    float kl_beta;
    double best_val;
    int64_t admitted; /* RL: the admission count (group ids) a resumed run goes on from, > 0;
                         0: none (SFT; checkpoints of older releases), step x prompts_per_step */
    int actor_opt_steps, critic_opt_steps; /* filled by rf_checkpoint_load; rf_checkpoint_save
                                              takes them from the models */
} rf_ckpt_state;

/* Saves a checkpoint for st->step; tokenizer files are copied from tokenizer_dir; keeps the
 * newest `keep` checkpoints (0 = all). critic may be NULL. */
rf_status rf_checkpoint_save(const char *run_dir, const rf_model *actor, const rf_model *critic,
                             const char *tokenizer_dir, const rf_ckpt_state *st, int keep);

/* One role's tensors for rf_checkpoint_save_roles, wherever they are: the whole model's config
 * and parameter table, its optimizer step, and tensor(ctx, part, view, dst), which makes part
 * `part` (0 the parameters; 1 and 2 the first and second AdamW moments, when `moments`) of
 * parameter `view` in full into dst (its numel floats, host memory). It is called once per
 * tensor, parts in order, as the files are written (by name within a part). */
typedef struct rf_ckpt_role {
    const rf_model_config *cfg;
    const rf_param_view *views; /* (n_views) */
    int n_views;
    int opt_step;
    int moments;
    rf_status (*tensor)(void *ctx, int part, int view, float *dst);
    void *ctx;
    const rf_lora *lora; /* the actor's adapters (views are then its adapter tensors, whole
                            shapes): also written as <step>/adapter in PEFT's layout, inside the
                            checkpoint before its rename; NULL: none */
} rf_ckpt_role;

/* A whole model as a role (borrowed: m must outlive the role). */
rf_ckpt_role rf_checkpoint_role_of(const rf_model *m);

/* rf_checkpoint_save for roles whose tensors are made on demand (a model held as
 * tensor-parallel shards, gathered tensor by tensor: no rank holds it whole). Files, layout and
 * atomicity as rf_checkpoint_save; an error from a role's tensor function stops the save and
 * leaves the last good checkpoint. */
rf_status rf_checkpoint_save_roles(const char *run_dir, const rf_ckpt_role *actor, const rf_ckpt_role *critic,
                                   const char *tokenizer_dir, const rf_ckpt_state *st, int keep);

/* Loads the newest checkpoint into existing actor (and critic) models and fills st (actor and
 * critic NULL: the run state only).
 * RF_ERR_IO naming run_dir/latest when there is none. */
rf_status rf_checkpoint_load(const char *run_dir, rf_model *actor, rf_model *critic,
                             rf_ckpt_state *st);

/* rf_checkpoint_load choosing whose AdamW moments are loaded: the actor's with moments & 1,
 * the critic's with moments & 2 (the others are left to ZeRO-1 ranks that each read their own
 * blocks, rf_checkpoint_moments_*); the parameters and the run state always (st's optimizer
 * step counts included). The checkpoint's directory goes to dir (cap bytes). */
rf_status rf_checkpoint_load_parts(const char *run_dir, rf_model *actor, rf_model *critic, int moments,
                                   rf_ckpt_state *st, char *dir, size_t cap);

/* A role's AdamW moments in a checkpoint, read a range at a time: the files of both moments
 * opened once; the buffer laid out as whole model m's (tp NULL) or as tensor-parallel shard
 * tp's (m NULL); the model must outlive it. */
typedef struct rf_ckpt_moments {
    rf_safetensors *st[2];
    const char *suffix[2];
    const rf_model *m;
    const rf_model_tp *tp;
    rf_param_view *adapters; /* a whole model with LoRA: its adapters' table, offsets from 0 */
} rf_ckpt_moments;

rf_status rf_checkpoint_moments_open(rf_ckpt_moments *cm, const char *ckpt_dir, const char *role, const rf_model *m,
                                     const rf_model_tp *tp);

/* Floats [a, a + n) of moment `which` (1, 2) of the model's (or shard's) buffer of trained
 * floats (under LoRA the adapters', from 0) into host dst (rf_dp_moment_src; ctx an
 * rf_ckpt_moments). Errors name the file and tensor. */
rf_status rf_checkpoint_moments_read(void *ctx, int which, size_t a, size_t n, float *dst);
void rf_checkpoint_moments_close(rf_ckpt_moments *cm);

/* The newest complete checkpoint's directory (run_dir/step_NNNNNN, from run_dir/latest) in
 * dir (cap bytes). RF_ERR_IO naming run_dir/latest when there is none. */
rf_status rf_checkpoint_latest(const char *run_dir, char *dir, size_t cap);

/* Where part `part` of role `role` ("actor", "critic") of the checkpoint in ckpt_dir is: 0 the
 * model, 1 the first AdamW moments, 2 the second; the directory goes to path (cap bytes) and
 * the suffix of its tensor names (after the parameter's name) is returned (static). For a
 * reader of shards (model_tp.h's rf_model_tp_load). */
const char *rf_checkpoint_part(const char *ckpt_dir, const char *role, int part, char *path, size_t cap);

/* Copies the tokenizer files transformers reads (those present) from src_dir to dst_dir:
 * tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja (where
 * transformers 5 saves the chat template), special_tokens_map.json, added_tokens.json and the
 * *.jinja of additional_chat_templates/. */
rf_status rf_copy_tokenizer_files(const char *src_dir, const char *dst_dir);

#endif
