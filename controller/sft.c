/* Supervised fine-tuning: the loss is the negative log-likelihood of the response tokens only
 * (the prompt is context), token-mean over each batch. Used by `rlflow sft` and to build the
 * warm start of the default recipe. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/util.h"
#include "controller/run_dir.h"
#include "controller/run_internal.h"
#include "model/lora.h"
#include "model/byte_tokenizer.h"
#include "trainer/checkpoint.h"

rf_status rf__eos_ids(const char *dir, const rf_model *m, const rf_tokenizer *tok, int32_t **ids,
                      int *n) {
    int32_t buf[16];
    int k = 0;
    char p[4096], *text = NULL;
    rf_path_join(p, sizeof p, dir, "generation_config.json");
    if (rf_file_exists(p) && rf_read_file(p, &text, NULL) == RF_OK) {
        cJSON *j = cJSON_Parse(text), *e = j ? cJSON_GetObjectItem(j, "eos_token_id") : NULL, *it;
        if (cJSON_IsNumber(e)) buf[k++] = e->valueint;
        if (cJSON_IsArray(e)) cJSON_ArrayForEach(it, e) if (cJSON_IsNumber(it) && k < 8) buf[k++] = it->valueint;
        cJSON_Delete(j);
        free(text);
    }
    for (int i = 0; i < m->cfg.n_eos && k < 15; i++) buf[k++] = m->cfg.eos_token_ids[i];
    if (tok && rf_tokenizer_eos_id(tok) >= 0) buf[k++] = rf_tokenizer_eos_id(tok);
    *ids = malloc(sizeof(int32_t) * (size_t)(k ? k : 1));
    if (!*ids) return rf_error(RF_ERR_NOMEM, "out of memory");
    *n = 0;
    for (int i = 0; i < k; i++) {
        int dup = 0;
        for (int j = 0; j < *n; j++) dup |= (*ids)[j] == buf[i];
        if (!dup) (*ids)[(*n)++] = buf[i];
    }
    return RF_OK;
}

static rf_status make_model(const rf_recipe *r, rf_model **m) {
    rf_model_config cfg;
    RF_TRY(rf_config_preset(&cfg, r->model.init_preset, RF_BYTE_TOKENIZER_VOCAB));
    cfg.eos_token_ids[0] = RF_BYTE_TOKENIZER_EOS, cfg.n_eos = 1;
    RF_TRY(rf_model_init(m, &cfg, rf_cpu_kernels()));
    rf_model_init_random(*m, (uint64_t)r->train.seed, 0.02f);
    return RF_OK;
}

rf_status rf__init_model(const rf_recipe *r, const char *dir) {
    rf_model *m = NULL;
    RF_TRY(make_model(r, &m));
    rf_status s = rf_model_save(m, dir, 0, 0);
    if (s == RF_OK) s = rf_byte_tokenizer_write(dir);
    if (s == RF_OK) rf_log_info("model: wrote a random %s model (%zu parameters) to %s", r->model.init_preset, m->n_params, dir);
    rf_model_free(m);
    return s;
}

/* Builds training samples (prompt ids + response ids + EOS) from a batch of examples. */
static rf_status sft_samples(const rf_tokenizer *tok, const rf_example *const *ex, int n,
                             int32_t eos, rf_train_sample *s) {
    for (int i = 0; i < n; i++) {
        int32_t *resp = NULL;
        int nr = 0;
        memset(&s[i], 0, sizeof s[i]);
        if (!ex[i]->response)
            return rf_error(RF_ERR_FORMAT, "line %d: no response to train on (SFT)", ex[i]->line);
        RF_TRY(rf_tokenizer_encode(tok, ex[i]->response, strlen(ex[i]->response), 0, &resp, &nr));
        int has_eos = eos >= 0;
        s[i].n_prompt = ex[i]->n_prompt, s[i].n_resp = nr + has_eos;
        s[i].tokens = malloc(sizeof(int32_t) * (size_t)(ex[i]->n_prompt + nr + 1));
        if (!s[i].tokens) {
            free(resp);
            return rf_error(RF_ERR_NOMEM, "out of memory");
        }
        memcpy(s[i].tokens, ex[i]->prompt_ids, sizeof(int32_t) * (size_t)ex[i]->n_prompt);
        memcpy(s[i].tokens + ex[i]->n_prompt, resp, sizeof(int32_t) * (size_t)nr);
        if (has_eos) s[i].tokens[ex[i]->n_prompt + nr] = eos;
        free(resp);
    }
    return RF_OK;
}

/* SFT checkpoints (rlflow sft): where, how often, how many kept; dir NULL: none (the warm start
 * of rlflow run). st: where a resumed run starts (zero: from the beginning). */
typedef struct sft_ckpt {
    const char *dir;
    int every, keep;
    rf_ckpt_state st;
} sft_ckpt;

static rf_status sft_save(const sft_ckpt *ck, rf_model *m, const char *tok_dir, int step, rf_dataset_pos pos) {
    rf_ckpt_state st = {.step = step, .pos = pos};
    double t = rf_time_now();
    RF_TRY(rf_checkpoint_save(ck->dir, m, NULL, tok_dir, &st, ck->keep));
    rf_log_info("sft checkpoint: %s/step_%06d (%.2f s)", ck->dir, step, rf_time_now() - t);
    return RF_OK;
}

/* The sft.target_accuracy check: greedy accuracy on the first sft.check_size examples of ds;
 * *done = 1 once it reaches the target. */
static rf_status sft_check(const rf_recipe *r, rf_model *m, const rf_tokenizer *tok, rf_dataset *ds,
                           const rf_reward_rules *rules, const int32_t *eos, int n_eos, int step,
                           int *done) {
    double acc, len;
    RF_TRY(rf_eval_accuracy(m, tok, ds, r->sft.check_size, rules, r->rollout.max_new_tokens, eos,
                            n_eos, &acc, &len));
    *done = acc >= r->sft.target_accuracy;
    rf_log_info("sft step %d | check accuracy %.3f (target %.3f)%s", step, acc,
                r->sft.target_accuracy, *done ? ": stopping" : "");
    return RF_OK;
}

/* Trains m on ds for the [sft] budget (or until sft.target_accuracy is reached when rules is
 * given), from ck's step and data position; prints progress, saves checkpoints (ck->dir not
 * NULL), returns the last loss. */
static rf_status sft_train(const rf_recipe *r, rf_model *m, const rf_tokenizer *tok, rf_dataset *ds,
                           const rf_reward_rules *rules, const int32_t *eos, int n_eos, const sft_ckpt *ck,
                           const char *tok_dir, double *last_loss) {
    int bs = r->sft.batch_size, size = rf_dataset_size(ds), done = 0;
    int32_t eos0 = n_eos ? eos[0] : -1;
    int steps = r->sft.max_steps > 0 ? r->sft.max_steps : (r->sft.epochs * size + bs - 1) / bs;
    rf_optim_opts oo = {.lr = (float)r->sft.lr, .warmup_steps = steps / 20, .total_steps = steps,
                        .cosine = 1, .min_lr_ratio = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f,
                        .eps = 1e-8f, .grad_clip = 1.0f};
    rf_dataset_pos pos = ck->st.pos;
    const rf_example **ex = calloc((size_t)bs, sizeof *ex);
    rf_train_sample *s = calloc((size_t)bs, sizeof *s);
    rf_status st = ex && s ? RF_OK : rf_error(RF_ERR_NOMEM, "out of memory");
    double t0 = rf_time_now();
    int start = ck->st.step;
    if (start >= steps && st == RF_OK)
        rf_log_info("sft: the checkpoint is at step %d of %d: nothing left to train", start, steps);
    /* resumed at a check step (a run that stopped at the target saved there): check again first */
    if (st == RF_OK && rules && start > 0 && start < steps && start % r->sft.check_every == 0)
        st = sft_check(r, m, tok, ds, rules, eos, n_eos, start, &done);
    for (int step = start; st == RF_OK && step < steps && !done; step++) {
        double gn;
        st = rf_dataset_next(ds, &pos, bs, ex);
        if (st == RF_OK) st = sft_samples(tok, ex, bs, eos0, s);
        if (st == RF_OK) st = rf_sft_update(m, &oo, r->train.micro_batch_tokens, s, bs, last_loss, &gn);
        for (int i = 0; i < bs; i++) free(s[i].tokens), s[i].tokens = NULL;
        int n_done = step + 1 - start;
        if (st == RF_OK && ((step + 1) % 50 == 0 || step + 1 == steps)) {
            double el = rf_time_now() - t0;
            char eta[32];
            rf_metrics_format_duration(el / n_done * (steps - step - 1), eta, sizeof eta);
            rf_log_info("sft step %d/%d | loss %.4f | grad norm %.3f | %.1f steps/s | ETA %s", step + 1,
                        steps, *last_loss, gn, n_done / el, eta);
        }
        if (st == RF_OK && rules && (step + 1) % r->sft.check_every == 0)
            st = sft_check(r, m, tok, ds, rules, eos, n_eos, step + 1, &done);
        if (st == RF_OK && ck->dir && (step + 1 == steps || done || (ck->every > 0 && (step + 1) % ck->every == 0)))
            st = sft_save(ck, m, tok_dir, step + 1, pos);
    }
    free(ex), free(s);
    return st;
}

/* SFT of m on data.train, written to out_dir: the whole model, or with `lora` the adapters of
 * the recipe's [lora] section in PEFT's layout (the base stays as it is). */
static rf_status sft_run(const rf_recipe *r, rf_model *m, const rf_tokenizer *tok, const char *out_dir,
                         const char *tok_dir, sft_ckpt *ck, int lora) {
    rf_dataset *ds = NULL, *val = NULL;
    rf_dataset_opts o = {.prompt_key = r->data.prompt_key, .answer_key = r->data.answer_key,
                         .chat_template = r->data.chat_template, .require_response = 1,
                         .max_prompt_tokens = r->data.max_prompt_tokens, .seed = (uint64_t)r->data.seed};
    int32_t *eos = NULL;
    int n_eos = 0;
    double loss = NAN;
    rf_reward_rules *rules = NULL;
    rf_status s = rf_dataset_load(&ds, r->data.train, &o, tok);
    if (s == RF_OK) s = rf__eos_ids(tok_dir, m, tok, &eos, &n_eos);
    if (s == RF_OK && lora) s = rf__lora_attach(r, m);
    if (s == RF_OK) s = rf_model_enable_training(m);
    if (s == RF_OK && ck->st.step > 0) {
        /* resumed: the weights (the adapters with `lora`), AdamW moments and optimizer step of
         * the newest checkpoint */
        rf_ckpt_state st;
        s = rf_checkpoint_load(ck->dir, m, NULL, &st);
        if (s == RF_OK) ck->st = st, rf_log_info("sft: resumed at step %d (data epoch %d, index %d)", st.step,
                                                 st.pos.epoch, st.pos.index);
    }
    if (s == RF_OK && r->sft.target_accuracy > 0) s = rf__rules_init(r, &rules);
    if (s == RF_OK) s = sft_train(r, m, tok, ds, rules, eos, n_eos, ck, tok_dir, &loss);
    if (s == RF_OK) s = lora ? rf_lora_save_peft(m, out_dir, r->model.path) : rf_model_save(m, out_dir, 0, 0);
    if (s == RF_OK) s = rf_copy_tokenizer_files(tok_dir, out_dir);
    if (s == RF_OK) rf_log_info("sft: final loss %.4f (%a); wrote %s", loss, loss, out_dir);
    free(eos);
    rf_reward_rules_free(rules);
    rf_dataset_free(ds), rf_dataset_free(val);
    return s;
}

rf_status rf__sft_build(const rf_recipe *r, const char *dir) {
    char tmp_dir[4200];
    snprintf(tmp_dir, sizeof tmp_dir, "%s.init", dir);
    rf_log_info("sft: building the warm start %s (%s preset, %s)", dir, r->model.init_preset, r->data.train);
    /* SFT runs on the CPU back end, at model.precision like the rest of the run */
    RF_TRY(rf_kernels_apply_precision(rf_cpu_kernels(), r->model.precision, "model.precision", NULL));
    RF_TRY(rf__init_model(r, tmp_dir));
    rf_model *m = NULL;
    rf_tokenizer *tok = NULL;
    rf_status s = rf_model_load(&m, tmp_dir, rf_cpu_kernels(), 0);
    if (s == RF_OK) s = rf_tokenizer_load_dir(&tok, tmp_dir);
    sft_ckpt ck = {0};
    if (s == RF_OK) s = sft_run(r, m, tok, dir, tmp_dir, &ck, 0); /* the base model itself: no adapters */
    rf_model_free(m);
    rf_tokenizer_free(tok);
    if (s == RF_OK) s = rf_remove_tree(tmp_dir);
    return s;
}

rf_status rf_sft_main(const rf_recipe *r, int resume, int overwrite) {
    RF_TRY(rf__ensure_data(r));
    char out[4096], ck_dir[4200];
    if (r->sft.out[0]) snprintf(out, sizeof out, "%s", r->sft.out);
    else snprintf(out, sizeof out, "%s/sft", r->logging.dir);
    snprintf(ck_dir, sizeof ck_dir, "%s/sft_checkpoints", r->logging.dir);
    sft_ckpt ck = {.dir = ck_dir, .every = r->checkpoint.every, .keep = r->checkpoint.keep};
    RF_TRY(rf_run_dir_prepare(ck_dir, "the SFT checkpoint directory", resume, overwrite));
    if (resume) { /* the step now; the weights once the model is ready for training */
        char latest[4400];
        RF_TRY(rf_checkpoint_latest(ck_dir, latest, sizeof latest));
        RF_TRY(rf_checkpoint_load(ck_dir, NULL, NULL, &ck.st));
        if (ck.st.step <= 0) return rf_error(RF_ERR_FORMAT, "%s: a checkpoint at step %d", latest, ck.st.step);
    }
    char cfg[4200];
    rf_path_join(cfg, sizeof cfg, r->model.path, "config.json");
    if (!rf_file_exists(cfg)) {
        if (!r->model.init_preset[0])
            return rf_error(RF_ERR_IO, "%s: no model to fine-tune (set model.init_preset)", cfg);
        RF_TRY(rf__init_model(r, r->model.path));
    }
    RF_TRY(rf_kernels_apply_precision(rf_cpu_kernels(), r->model.precision, "model.precision", NULL));
    rf_model *m = NULL;
    rf_tokenizer *tok = NULL;
    rf_status s = rf_model_load(&m, r->model.path, rf_cpu_kernels(), 0);
    if (s == RF_OK) s = rf_tokenizer_load_dir(&tok, r->model.path);
    if (s == RF_OK) s = sft_run(r, m, tok, out, r->model.path, &ck, r->lora.enabled);
    rf_model_free(m);
    rf_tokenizer_free(tok);
    return s;
}
