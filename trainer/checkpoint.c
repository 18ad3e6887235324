#define _POSIX_C_SOURCE 200809L
#include "trainer/checkpoint.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

rf_status rf_copy_tokenizer_files(const char *src_dir, const char *dst_dir) {
    static const char *files[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char src[4096], dst[4096], *data = NULL;
        size_t len = 0;
        rf_path_join(src, sizeof src, src_dir, files[i]);
        if (!rf_file_exists(src)) continue;
        rf_path_join(dst, sizeof dst, dst_dir, files[i]);
        RF_TRY(rf_read_file(src, &data, &len));
        rf_status s = rf_write_file_atomic(dst, data, len);
        free(data);
        RF_TRY(s);
    }
    return RF_OK;
}

/* Saves a model and its optimizer moments under dir/<name> and dir/<name>_optim. */
static rf_status save_role(const char *dir, const char *name, const rf_model *m, const char *tok_dir) {
    char p[4096], q[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    RF_TRY(rf_model_save(m, p, 0, 0));
    if (tok_dir) RF_TRY(rf_copy_tokenizer_files(tok_dir, p));
    if (!m->opt_m) return RF_OK;
    snprintf(q, sizeof q, "%s/%s_optim", dir, name);
    RF_TRY(rf_model_save_buffer(m, m->opt_m, q, ".exp_avg"));
    snprintf(q, sizeof q, "%s/%s_optim/moments2", dir, name);
    return rf_model_save_buffer(m, m->opt_v, q, ".exp_avg_sq");
}

static rf_status write_state(const char *dir, const rf_ckpt_state *st, const rf_model *actor,
                             const rf_model *critic) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "step", st->step);
    cJSON_AddNumberToObject(j, "actor_optimizer_steps", actor->opt_step);
    cJSON_AddNumberToObject(j, "critic_optimizer_steps", critic ? critic->opt_step : 0);
    cJSON_AddNumberToObject(j, "data_epoch", st->pos.epoch);
    cJSON_AddNumberToObject(j, "data_index", st->pos.index);
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

rf_status rf_checkpoint_save(const char *run_dir, const rf_model *actor, const rf_model *critic,
                             const char *tokenizer_dir, const rf_ckpt_state *st, int keep) {
    char final[4096], tmp[4200], latest[4096], name[64];
    snprintf(name, sizeof name, "step_%06d", st->step);
    rf_path_join(final, sizeof final, run_dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", final);
    RF_TRY(rf_remove_tree(tmp));
    RF_TRY(rf_mkdirs(tmp));
    RF_TRY(save_role(tmp, "actor", actor, tokenizer_dir));
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

static rf_status load_role(const char *dir, const char *name, rf_model *m) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    RF_TRY(rf_model_load_params(m, p, NULL, NULL));
    if (!m->opt_m) return RF_OK;
    snprintf(p, sizeof p, "%s/%s_optim", dir, name);
    RF_TRY(rf_model_load_params(m, p, m->opt_m, ".exp_avg"));
    snprintf(p, sizeof p, "%s/%s_optim/moments2", dir, name);
    return rf_model_load_params(m, p, m->opt_v, ".exp_avg_sq");
}

static rf_status get_num(const cJSON *j, const char *key, const char *path, double *out) {
    const cJSON *it = cJSON_GetObjectItem(j, key);
    if (cJSON_IsNumber(it)) *out = it->valuedouble;
    else if (cJSON_IsString(it)) *out = strtod(it->valuestring, NULL);
    else return rf_error(RF_ERR_FORMAT, "%s: missing \"%s\"", path, key);
    return RF_OK;
}

static rf_status read_state(const char *dir, rf_ckpt_state *st, rf_model *actor, rf_model *critic) {
    char p[4096], *text;
    rf_path_join(p, sizeof p, dir, "trainer_state.json");
    RF_TRY(rf_read_file(p, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j) return rf_error(RF_ERR_FORMAT, "%s: not valid JSON", p);
    double v[7];
    static const char *keys[] = {"step", "actor_optimizer_steps", "critic_optimizer_steps",
                                 "data_epoch", "data_index", "kl_beta", "best_val"};
    rf_status s = RF_OK;
    for (int i = 0; s == RF_OK && i < 7; i++) s = get_num(j, keys[i], p, &v[i]);
    cJSON_Delete(j);
    RF_TRY(s);
    st->step = (int)v[0];
    if (actor) actor->opt_step = (int)v[1];
    if (critic) critic->opt_step = (int)v[2];
    st->pos.epoch = (int)v[3], st->pos.index = (int)v[4];
    st->kl_beta = (float)v[5], st->best_val = v[6];
    return RF_OK;
}

rf_status rf_checkpoint_load(const char *run_dir, rf_model *actor, rf_model *critic,
                             rf_ckpt_state *st) {
    char latest[4096], *name = NULL, dir[4200];
    rf_path_join(latest, sizeof latest, run_dir, "latest");
    if (!rf_file_exists(latest))
        return rf_error(RF_ERR_IO, "%s: no checkpoint to resume from", latest);
    RF_TRY(rf_read_file(latest, &name, NULL));
    name[strcspn(name, "\r\n")] = '\0';
    snprintf(dir, sizeof dir, "%s/%s", run_dir, name);
    free(name);
    rf_status s = actor ? load_role(dir, "actor", actor) : RF_OK;
    if (s == RF_OK && critic) s = load_role(dir, "critic", critic);
    if (s == RF_OK) s = read_state(dir, st, actor, critic);
    return s == RF_OK ? RF_OK : rf_error_wrap(s, "resuming from %s", dir);
}
