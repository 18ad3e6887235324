#define _POSIX_C_SOURCE 200809L
#include "trainer/checkpoint.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"
#include "model/lora.h"

/* src_dir/name to dst_dir/name when it exists. */
static rf_status copy_if_there(const char *src_dir, const char *dst_dir, const char *name) {
    char src[4096], dst[4096], *data = NULL;
    size_t len = 0;
    rf_path_join(src, sizeof src, src_dir, name);
    if (!rf_file_exists(src)) return RF_OK;
    rf_path_join(dst, sizeof dst, dst_dir, name);
    RF_TRY(rf_read_file(src, &data, &len));
    rf_status s = rf_write_file_atomic(dst, data, len);
    free(data);
    return s;
}

/* The files transformers' AutoTokenizer reads besides the vocabulary (tokenization_utils_base.py,
 * from_pretrained): chat_template.jinja is where transformers 5 keeps the chat template (and it
 * wins over tokenizer_config.json's), additional_chat_templates/ holds the named ones,
 * special_tokens_map.json and added_tokens.json are 4.x's, still read. */
rf_status rf_copy_tokenizer_files(const char *src_dir, const char *dst_dir) {
    static const char *files[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja", "special_tokens_map.json", "added_tokens.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) RF_TRY(copy_if_there(src_dir, dst_dir, files[i]));
    char src[4096], dst[4096];
    rf_path_join(src, sizeof src, src_dir, "additional_chat_templates");
    DIR *d = opendir(src);
    if (!d) return RF_OK;
    rf_path_join(dst, sizeof dst, dst_dir, "additional_chat_templates");
    rf_status s = rf_mkdirs(dst);
    for (struct dirent *e; s == RF_OK && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n > 6 && strcmp(e->d_name + n - 6, ".jinja") == 0) s = copy_if_there(src, dst, e->d_name);
    }
    closedir(d);
    return s;
}

/* One part of a role, as the safetensors writer asks for its tensors. */
typedef struct part_src {
    const rf_ckpt_role *role;
    int part;
} part_src;

static rf_status fill_part(void *ctx, int view, float *dst) {
    const part_src *p = ctx;
    return p->role->tensor(p->role->ctx, p->part, view, dst);
}

/* Saves a role's model (config, tensors, tokenizer files) under dir/<name> and its optimizer
 * moments under dir/<name>_optim (rf_checkpoint_part). */
static rf_status save_role(const char *dir, const char *name, const rf_ckpt_role *role, const char *tok_dir) {
    for (int part = 0; part < (role->moments ? 3 : 1); part++) {
        char p[4200];
        const char *suffix = rf_checkpoint_part(dir, name, part, p, sizeof p);
        if (part == 0) RF_TRY(rf_model_save_config(role->cfg, p, 0)); /* F32 weights, below */
        part_src src = {role, part};
        RF_TRY(rf_model_save_views(role->views, role->n_views, p, suffix, 0, 0, fill_part, &src));
        if (part == 0 && tok_dir) RF_TRY(rf_copy_tokenizer_files(tok_dir, p));
    }
    return RF_OK;
}

/* The actor's adapters in PEFT's layout under dir/adapter, from part 0 of its tensors (a second
 * call of the tensor function per adapter: cheap, the adapters are small). */
static rf_status save_adapter(const char *dir, const rf_ckpt_role *role, const char *base) {
    char p[4300];
    snprintf(p, sizeof p, "%s/adapter", dir);
    part_src src = {role, 0};
    return rf_lora_save_peft_fill(role->lora, role->views, role->n_views, p, base, fill_part, &src);
}

static rf_status write_state(const char *dir, const rf_ckpt_state *st, const rf_ckpt_role *actor,
                             const rf_ckpt_role *critic) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "step", st->step);
    cJSON_AddNumberToObject(j, "actor_optimizer_steps", actor->opt_step);
    cJSON_AddNumberToObject(j, "critic_optimizer_steps", critic ? critic->opt_step : 0);
    cJSON_AddNumberToObject(j, "data_epoch", st->pos.epoch);
    cJSON_AddNumberToObject(j, "data_index", st->pos.index);
    if (st->admitted > 0) cJSON_AddNumberToObject(j, "admitted", (double)st->admitted);
    /* floats as exact hex so a resumed run continues bit for bit */
    char hex[64];
    snprintf(hex, sizeof hex, "%a", (double)st->kl_beta);
    cJSON_AddStringToObject(j, "kl_beta", hex);
    snprintf(hex, sizeof hex, "%a", st->best_val);
    cJSON_AddStringToObject(j, "best_val", hex);
    char *text = cJSON_Print(j), p[4096];
    cJSON_Delete(j);
    rf_path_join(p, sizeof p, dir, "trainer_state.json");
    rf_status s = rf_write_file_atomic(p, text, strlen(text));
    free(text);
    return s;
}

static rf_status fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return rf_error(RF_ERR_IO, "%s: cannot open directory: %s", dir, strerror(errno));
    fsync(fd);
    close(fd);
    return RF_OK;
}

/* Removes all but the newest `keep` step_* directories. */
static void prune(const char *run_dir, int keep) {
    if (keep <= 0) return;
    DIR *d = opendir(run_dir);
    if (!d) return;
    int steps[4096], n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 4096) {
        int s;
        char tail;
        if (sscanf(e->d_name, "step_%d%c", &s, &tail) == 1) steps[n++] = s;
    }
    closedir(d);
    for (int i = 0; i < n; i++) {
        int newer = 0;
        for (int j = 0; j < n; j++) newer += steps[j] > steps[i];
        if (newer >= keep) {
            char p[4096];
            snprintf(p, sizeof p, "%s/step_%06d", run_dir, steps[i]);
            rf_remove_tree(p);
        }
    }
}

rf_status rf_checkpoint_save_roles(const char *run_dir, const rf_ckpt_role *actor, const rf_ckpt_role *critic,
                                   const char *tokenizer_dir, const rf_ckpt_state *st, int keep) {
    char final[4096], tmp[4200], latest[4096], name[64];
    snprintf(name, sizeof name, "step_%06d", st->step);
    rf_path_join(final, sizeof final, run_dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", final);
    RF_TRY(rf_remove_tree(tmp));
    RF_TRY(rf_mkdirs(tmp));
    RF_TRY(save_role(tmp, "actor", actor, tokenizer_dir));
    if (actor->lora) RF_TRY(save_adapter(tmp, actor, tokenizer_dir));
    if (critic) RF_TRY(save_role(tmp, "critic", critic, tokenizer_dir));
    RF_TRY(write_state(tmp, st, actor, critic));
    RF_TRY(rf_remove_tree(final));
    if (rename(tmp, final) != 0)
        return rf_error(RF_ERR_IO, "%s: rename to %s failed: %s", tmp, final, strerror(errno));
    RF_TRY(fsync_dir(run_dir));
    rf_path_join(latest, sizeof latest, run_dir, "latest");
    RF_TRY(rf_write_file_atomic(latest, name, strlen(name)));
    prune(run_dir, keep);
    return RF_OK;
}

/* A whole model's trained tensor (rf_model_train_views: the adapters under LoRA): a view of its
 * parameters or moments (which start at the first trained float, m->n_frozen), copied to the
 * host. */
static rf_status whole_tensor(void *ctx, int part, int view, float *dst) {
    const rf_model *m = ctx;
    int n;
    const rf_param_view *v = &rf_model_train_views(m, &n)[view];
    const float *src = part == 0 ? m->params + v->offset : (part == 1 ? m->opt_m : m->opt_v) + (v->offset - m->n_frozen);
    m->k->to_host(dst, src, v->numel * sizeof(float));
    return RF_OK;
}

rf_ckpt_role rf_checkpoint_role_of(const rf_model *m) {
    int n;
    const rf_param_view *v = rf_model_train_views(m, &n);
    rf_ckpt_role r = {&m->cfg, v, n, m->opt_step, m->opt_m != NULL, whole_tensor, (void *)m,
                      m->lora.rank ? &m->lora : NULL};
    return r;
}

rf_status rf_checkpoint_save(const char *run_dir, const rf_model *actor, const rf_model *critic,
                             const char *tokenizer_dir, const rf_ckpt_state *st, int keep) {
    rf_ckpt_role a = rf_checkpoint_role_of(actor), c = critic ? rf_checkpoint_role_of(critic) : a;
    c.lora = NULL; /* a critic with adapters keeps them in critic/ only */
    return rf_checkpoint_save_roles(run_dir, &a, critic ? &c : NULL, tokenizer_dir, st, keep);
}

const char *rf_checkpoint_part(const char *ckpt_dir, const char *role, int part, char *path, size_t cap) {
    static const char *fmt[3] = {"%s/%s", "%s/%s_optim", "%s/%s_optim/moments2"};
    static const char *suffix[3] = {NULL, ".exp_avg", ".exp_avg_sq"};
    snprintf(path, cap, fmt[part], ckpt_dir, role);
    return suffix[part];
}

static rf_status load_role(const char *dir, const char *name, rf_model *m, int moments) {
    float *dst[3] = {NULL, m->opt_m, m->opt_v};
    for (int part = 0; part < (m->opt_m && moments ? 3 : 1); part++) {
        char p[4200];
        const char *suffix = rf_checkpoint_part(dir, name, part, p, sizeof p);
        RF_TRY(rf_model_load_params(m, p, dst[part], suffix));
    }
    return RF_OK;
}

/* *out = it when it is a JSON number that is a whole number in 0..max; anything else is
 * refused naming the file, key and value ("<path>: "<key>" = <value>: not <want>"): a double
 * outside int's range may not even be converted. */
static rf_status whole_number(const cJSON *it, double max, const char *path, const char *key,
                              const char *want, double *out) {
    double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
    if (v >= 0 && v <= max && v == floor(v)) {
        *out = v;
        return RF_OK;
    }
    char *text = cJSON_PrintUnformatted(it);
    rf_status st = rf_error(RF_ERR_FORMAT, "%s: \"%s\" = %s: not %s", path, key, text ? text : "?", want);
    free(text);
    return st;
}

/* A counter of trainer_state.json (step, optimizer steps, data position), in 0..INT_MAX. */
static rf_status get_count(const cJSON *j, const char *key, const char *path, int *out) {
    const cJSON *it = cJSON_GetObjectItem(j, key);
    if (!it) return rf_error(RF_ERR_FORMAT, "%s: missing \"%s\"", path, key);
    double v = 0;
    RF_TRY(whole_number(it, INT_MAX, path, key, "a whole number in 0..2147483647", &v));
    *out = (int)v;
    return RF_OK;
}

/* A float of trainer_state.json: written as exact hex text ("%a"), also read as a JSON number;
 * text that is not a whole number in C's syntax (strtod must take all of it) is refused. */
static rf_status get_real(const cJSON *j, const char *key, const char *path, double *out) {
    const cJSON *it = cJSON_GetObjectItem(j, key);
    char *end = NULL;
    if (cJSON_IsNumber(it)) *out = it->valuedouble;
    else if (cJSON_IsString(it) && it->valuestring[0]) *out = strtod(it->valuestring, &end);
    else return rf_error(RF_ERR_FORMAT, "%s: missing \"%s\"", path, key);
    if (end && *end)
        return rf_error(RF_ERR_FORMAT, "%s: \"%s\" = \"%s\": not a number", path, key, it->valuestring);
    return RF_OK;
}

/* "admitted" (the RL admission count, optional: checkpoints of older releases and SFT's have
 * none, 0): a whole number >= 0 when present. */
static rf_status get_admitted(const cJSON *j, const char *path, int64_t *out) {
    const cJSON *it = cJSON_GetObjectItem(j, "admitted");
    double v = 0;
    if (it) RF_TRY(whole_number(it, 9007199254740992.0, path, "admitted", "a whole number of groups >= 0", &v));
    *out = (int64_t)v;
    return RF_OK;
}

static rf_status read_state(const char *dir, rf_ckpt_state *st, rf_model *actor, rf_model *critic) {
    char p[4096], *text;
    rf_path_join(p, sizeof p, dir, "trainer_state.json");
    RF_TRY(rf_read_file(p, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j) return rf_error(RF_ERR_FORMAT, "%s: not valid JSON", p);
    int n[5];
    double kl = 0, best = 0;
    static const char *keys[] = {"step", "actor_optimizer_steps", "critic_optimizer_steps",
                                 "data_epoch", "data_index"};
    rf_status s = RF_OK;
    for (int i = 0; s == RF_OK && i < 5; i++) s = get_count(j, keys[i], p, &n[i]);
    if (s == RF_OK) s = get_real(j, "kl_beta", p, &kl);
    if (s == RF_OK && !(kl >= 0 && kl <= FLT_MAX))
        s = rf_error(RF_ERR_FORMAT, "%s: \"kl_beta\" = %g: not a finite number >= 0", p, kl);
    if (s == RF_OK) s = get_real(j, "best_val", p, &best);
    if (s == RF_OK) s = get_admitted(j, p, &st->admitted);
    cJSON_Delete(j);
    RF_TRY(s);
    st->step = n[0];
    st->actor_opt_steps = n[1], st->critic_opt_steps = n[2];
    if (actor) actor->opt_step = n[1];
    if (critic) critic->opt_step = n[2];
    st->pos.epoch = n[3], st->pos.index = n[4];
    st->kl_beta = (float)kl, st->best_val = best;
    return RF_OK;
}

rf_status rf_checkpoint_latest(const char *run_dir, char *dir, size_t cap) {
    char latest[4096], *name = NULL;
    rf_path_join(latest, sizeof latest, run_dir, "latest");
    if (!rf_file_exists(latest))
        return rf_error(RF_ERR_IO, "%s: no checkpoint to resume from", latest);
    RF_TRY(rf_read_file(latest, &name, NULL));
    name[strcspn(name, "\r\n")] = '\0';
    snprintf(dir, cap, "%s/%s", run_dir, name);
    free(name);
    return RF_OK;
}

rf_status rf_checkpoint_load_parts(const char *run_dir, rf_model *actor, rf_model *critic, int moments,
                                   rf_ckpt_state *st, char *dir, size_t cap) {
    RF_TRY(rf_checkpoint_latest(run_dir, dir, cap));
    rf_status s = actor ? load_role(dir, "actor", actor, moments & 1) : RF_OK;
    if (s == RF_OK && critic) s = load_role(dir, "critic", critic, moments & 2);
    if (s == RF_OK) s = read_state(dir, st, actor, critic);
    return s == RF_OK ? RF_OK : rf_error_wrap(s, "resuming from %s", dir);
}

rf_status rf_checkpoint_load(const char *run_dir, rf_model *actor, rf_model *critic,
                             rf_ckpt_state *st) {
    char dir[4200];
    return rf_checkpoint_load_parts(run_dir, actor, critic, 3, st, dir, sizeof dir);
}

rf_status rf_checkpoint_moments_open(rf_ckpt_moments *cm, const char *ckpt_dir, const char *role, const rf_model *m,
                                     const rf_model_tp *tp) {
    memset(cm, 0, sizeof *cm);
    cm->m = m, cm->tp = tp;
    int n;
    if (!tp && m->lora.rank) RF_TRY(rf_lora_table(m, &cm->adapters, &n));
    for (int k = 0; k < 2; k++) {
        char p[4300];
        cm->suffix[k] = rf_checkpoint_part(ckpt_dir, role, k + 1, p, sizeof p);
        rf_status s = rf_st_open_dir(&cm->st[k], p);
        if (s != RF_OK) {
            rf_checkpoint_moments_close(cm);
            return rf_error_wrap(s, "resuming from %s", ckpt_dir);
        }
    }
    return RF_OK;
}

rf_status rf_checkpoint_moments_read(void *ctx, int which, size_t a, size_t n, float *dst) {
    const rf_ckpt_moments *cm = ctx;
    if (which < 1 || which > 2) return rf_error(RF_ERR_ARG, "AdamW moment %d", which);
    const rf_model_tp *tp = cm->tp;
    if (tp && tp->lora_views) /* LoRA: the adapters' blocks, offsets from 0 */
        return rf_model_read_range(tp->lora_views, tp->n_lora_views, tp->lora_shards, cm->st[which - 1],
                                   cm->suffix[which - 1], a, n, dst);
    if (tp)
        return rf_model_read_range(tp->full_views, tp->n_full_views, tp->shards, cm->st[which - 1],
                                   cm->suffix[which - 1], a, n, dst);
    if (cm->adapters)
        return rf_model_read_range(cm->adapters, cm->m->lora.n_views, NULL, cm->st[which - 1], cm->suffix[which - 1], a,
                                   n, dst);
    return rf_model_read_range(cm->m->views, cm->m->n_views, NULL, cm->st[which - 1], cm->suffix[which - 1], a, n, dst);
}

void rf_checkpoint_moments_close(rf_ckpt_moments *cm) {
    rf_st_close(cm->st[0]), rf_st_close(cm->st[1]);
    cm->st[0] = cm->st[1] = NULL;
    free(cm->adapters);
    cm->adapters = NULL;
}
