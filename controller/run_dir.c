/* The run directory between runs: refuse, overwrite, or cut back for a resume
 * (controller/run_dir.h). */
#define _POSIX_C_SOURCE 200809L
#include "controller/run_dir.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "trainer/checkpoint.h"

/* <pre><i>.log: the output of a program rlflow started. */
static int is_log_of(const char *name, const char *pre) {
    size_t n = strlen(name), p = strlen(pre), digits = strspn(name + (n > p ? p : n), "0123456789");
    return n > p + 4 && strncmp(name, pre, p) == 0 && digits > 0 && strcmp(name + p + digits, ".log") == 0;
}

/* reward_program_<i>.log (reward.programs) or env_program_<i>.log (env.programs). */
static int is_program_log(const char *name) {
    return is_log_of(name, "reward_program_") || is_log_of(name, "env_program_");
}

/* A name a run writes: kind 1 a log (metrics, samples, events), 2 a checkpoint, 3 another
 * file of the run's (recipe.toml, run_status.json, latest, the logs of the programs it
 * started); 0 not ours. */
static int run_file_kind(const char *name) {
    if (strcmp(name, "metrics.jsonl") == 0 || strcmp(name, "samples.jsonl") == 0 || strstr(name, "tfevents"))
        return 1;
    if (strncmp(name, "step_", 5) == 0 && strlen(name) == 11 && strspn(name + 5, "0123456789") == 6) return 2;
    if (strcmp(name, "recipe.toml") == 0 || strcmp(name, "run_status.json") == 0 || strcmp(name, "latest") == 0 ||
        is_program_log(name))
        return 3;
    return 0;
}

/* What a run left in dir: metrics.jsonl, samples.jsonl, event files, checkpoints. */
typedef struct survey_t {
    int metrics, samples, events, ckpts;
} survey_t;

static survey_t survey(const char *dir) {
    survey_t v = {0, 0, 0, 0};
    DIR *d = opendir(dir);
    if (!d) return v;
    for (struct dirent *e; (e = readdir(d));) {
        int k = run_file_kind(e->d_name);
        v.metrics += strcmp(e->d_name, "metrics.jsonl") == 0, v.samples += strcmp(e->d_name, "samples.jsonl") == 0;
        v.events += k == 1 && strstr(e->d_name, "tfevents") != NULL, v.ckpts += k == 2;
    }
    closedir(d);
    return v;
}

int rf_run_dir_has_run(const char *dir) {
    survey_t v = survey(dir);
    return v.metrics + v.samples + v.events + v.ckpts > 0;
}

/* Removes every file and checkpoint of a run in dir (run_file_kind > 0). */
static rf_status remove_run(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return RF_OK;
    rf_status s = RF_OK;
    int n = 0;
    for (struct dirent *e; s == RF_OK && (e = readdir(d));) {
        int k = run_file_kind(e->d_name);
        if (!k) continue;
        char p[4400];
        rf_path_join(p, sizeof p, dir, e->d_name);
        if (k == 2) s = rf_remove_tree(p);
        else if (unlink(p) != 0 && errno != ENOENT) s = rf_error(RF_ERR_IO, "%s: cannot remove: %s", p, strerror(errno));
        n++;
    }
    closedir(d);
    if (s == RF_OK) rf_log_info("--overwrite: removed the earlier run's %d files and checkpoints from %s", n, dir);
    return s;
}

rf_status rf_run_dir_cut_jsonl(const char *path, long step, int *dropped) {
    if (dropped) *dropped = 0;
    if (!rf_file_exists(path)) return RF_OK;
    char *text = NULL;
    size_t len = 0;
    RF_TRY(rf_read_file(path, &text, &len));
    char *out = malloc(len + 1);
    if (!out) {
        free(text);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t n = 0;
    int cut = 0;
    for (char *line = text, *end; line < text + len; line = end + 1) {
        end = memchr(line, '\n', (size_t)(text + len - line));
        if (!end) end = text + len; /* a torn last line (no newline) is dropped */
        int keep = end < text + len;
        if (keep) {
            cJSON *j = cJSON_ParseWithLength(line, (size_t)(end - line));
            const cJSON *s = cJSON_GetObjectItem(j, "step");
            keep = !cJSON_IsNumber(s) || s->valuedouble <= (double)step;
            cJSON_Delete(j);
        }
        if (!keep) {
            cut++;
            continue;
        }
        memcpy(out + n, line, (size_t)(end - line) + 1);
        n += (size_t)(end - line) + 1;
    }
    rf_status s = cut ? rf_write_file_atomic(path, out, n) : RF_OK;
    free(text), free(out);
    if (dropped) *dropped = cut;
    return s;
}

/* Event.step (field 2, varint) of a serialized tensorflow.Event, or -1 when it has none; -2
 * when the bytes are not a protobuf message (https://protobuf.dev/programming-guides/encoding/). */
static long long event_step(const unsigned char *p, size_t n) {
    size_t i = 0;
    long long step = -1;
    while (i < n) {
        uint64_t key = 0, v = 0;
        for (int sh = 0; i < n && sh < 64; sh += 7) {
            key |= (uint64_t)(p[i] & 0x7f) << sh;
            if (!(p[i++] & 0x80)) break;
        }
        int wire = (int)(key & 7);
        if (wire == 0) {
            for (int sh = 0; i < n && sh < 64; sh += 7) {
                v |= (uint64_t)(p[i] & 0x7f) << sh;
                if (!(p[i++] & 0x80)) break;
            }
            if ((key >> 3) == 2) step = (long long)v;
        } else if (wire == 1 || wire == 5) {
            i += wire == 1 ? 8 : 4;
        } else if (wire == 2) {
            for (int sh = 0; i < n && sh < 64; sh += 7) {
                v |= (uint64_t)(p[i] & 0x7f) << sh;
                if (!(p[i++] & 0x80)) break;
            }
            if (v > n - i) return -2;
            i += (size_t)v;
        } else {
            return -2;
        }
    }
    return i == n ? step : -2;
}

rf_status rf_run_dir_cut_events(const char *path, long step, int *dropped) {
    if (dropped) *dropped = 0;
    char *text = NULL;
    size_t len = 0;
    RF_TRY(rf_read_file(path, &text, &len));
    const unsigned char *b = (const unsigned char *)text;
    unsigned char *out = malloc(len ? len : 1);
    if (!out) {
        free(text);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t i = 0, n = 0;
    int cut = 0;
    while (i + 12 <= len) { /* TFRecord: u64 length, u32 crc, data, u32 crc (tb_writer.h) */
        uint64_t dl = 0;
        for (int k = 0; k < 8; k++) dl |= (uint64_t)b[i + k] << (8 * k);
        if (dl > len - i - 12 || len - i - 12 - dl < 4) break; /* torn: dropped */
        long long s = event_step(b + i + 12, (size_t)dl);
        size_t rec = 16 + (size_t)dl;
        if (s > step || s == -2) {
            cut++;
        } else {
            memcpy(out + n, b + i, rec);
            n += rec;
        }
        i += rec;
    }
    if (i < len) cut++;
    rf_status st = cut ? rf_write_file_atomic(path, out, n) : RF_OK;
    free(text), free(out);
    if (dropped) *dropped = cut;
    return st;
}

/* The step of the newest checkpoint in dir (its trainer_state.json), or an error naming it. */
static rf_status checkpoint_step(const char *dir, long *step) {
    char ck[4200], p[4400], *text = NULL;
    RF_TRY(rf_checkpoint_latest(dir, ck, sizeof ck));
    rf_path_join(p, sizeof p, ck, "trainer_state.json");
    RF_TRY(rf_read_file(p, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    free(text);
    const cJSON *s = cJSON_GetObjectItem(j, "step");
    double v = cJSON_IsNumber(s) ? s->valuedouble : cJSON_IsString(s) ? strtod(s->valuestring, NULL) : -1;
    cJSON_Delete(j);
    if (!(v >= 0)) return rf_error(RF_ERR_FORMAT, "%s: no \"step\"", p);
    *step = (long)v;
    return RF_OK;
}

/* --resume: every log of dir cut back to the newest checkpoint's step. */
static rf_status cut_back(const char *dir) {
    long step = 0;
    RF_TRY(checkpoint_step(dir, &step));
    DIR *d = opendir(dir);
    if (!d) return rf_error(RF_ERR_IO, "%s: cannot read: %s", dir, strerror(errno));
    rf_status s = RF_OK;
    int lines = 0, records = 0;
    for (struct dirent *e; s == RF_OK && (e = readdir(d));) {
        if (run_file_kind(e->d_name) != 1) continue;
        char p[4400];
        int k = 0;
        rf_path_join(p, sizeof p, dir, e->d_name);
        if (strstr(e->d_name, "tfevents")) s = rf_run_dir_cut_events(p, step, &k), records += k;
        else s = rf_run_dir_cut_jsonl(p, step, &k), lines += k;
    }
    closedir(d);
    if (s == RF_OK && lines + records)
        rf_log_info("--resume: dropped what came after the checkpoint's step %ld from %s (%d JSONL lines, %d event "
                    "records)", step, dir, lines, records);
    return s;
}

rf_status rf_run_dir_prepare(const char *dir, const char *label, int resume, int overwrite) {
    if (resume && overwrite) return rf_error(RF_ERR_ARG, "--resume and --overwrite exclude each other");
    if (resume) return rf_run_dir_has_run(dir) ? cut_back(dir) : RF_OK; /* none: the resume says so */
    if (overwrite) return remove_run(dir);
    survey_t v = survey(dir);
    if (v.metrics + v.samples + v.events + v.ckpts == 0) return RF_OK;
    char what[200];
    size_t n = 0;
    if (v.metrics) n += (size_t)snprintf(what + n, sizeof what - n, "metrics.jsonl, ");
    if (v.samples) n += (size_t)snprintf(what + n, sizeof what - n, "samples.jsonl, ");
    if (v.events) n += (size_t)snprintf(what + n, sizeof what - n, "%d event file%s, ", v.events, v.events > 1 ? "s" : "");
    if (v.ckpts) n += (size_t)snprintf(what + n, sizeof what - n, "%d checkpoint%s, ", v.ckpts, v.ckpts > 1 ? "s" : "");
    what[n - 2] = '\0';
    return rf_error(RF_ERR_ARG, "%s \"%s\" holds a run already (%s): pass --resume to continue it, or "
                    "--overwrite to remove it and start afresh (or set logging.dir to another directory)", label, dir, what);
}

int rf_run_dir_val_before(const char *dir, double *acc) {
    char p[4200], *text = NULL;
    rf_path_join(p, sizeof p, dir, "metrics.jsonl");
    if (rf_read_file(p, &text, NULL) != RF_OK) return 0;
    int found = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line && !found; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItem(j, "step"), *a = cJSON_GetObjectItem(j, "val/accuracy");
        if (cJSON_IsNumber(s) && s->valuedouble == 0 && cJSON_IsNumber(a)) *acc = a->valuedouble, found = 1;
        cJSON_Delete(j);
    }
    free(text);
    return found;
}
