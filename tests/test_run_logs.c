/* What a run leaves in its run directory (logging.dir), end to end on the 1-digit arithmetic
 * task (tests/run_util.h):
 *   - a second run into a directory holding a run is refused with the exact error, naming the
 *     directory and both ways out, and changes nothing there; --overwrite removes the earlier
 *     run's files (not the user's) and starts afresh; --resume with --overwrite is a usage
 *     error (exit 2);
 *   - a run cut off after its step-3 checkpoint (steps 4-6 logged, their checkpoint gone) and
 *     resumed holds each step once in metrics.jsonl, samples.jsonl and the event files (read
 *     raw, record by record, no SessionLog purge), equal to the uninterrupted run's (all but
 *     wall-clock figures), and its closing line gives the step-0 accuracy as the accuracy
 *     before training;
 *   - logging.samples_every: samples.jsonl holds samples_per_step samples per logged step,
 *     which, all of a batch logged, average to the step's reward/mean and reward/accuracy; the
 *     GRPO advantages of a group sum to 0 with the sign of reward - group mean; the rules'
 *     component is the whole reward; the event file holds the text summaries; the split
 *     controller writes them too;
 *   - one-process runs write run_status.json (ok, and an error with its message);
 *   - rlflow sft --resume ends with the weights and final loss of an uninterrupted run, bit for
 *     bit; its checkpoints are refused as a run's are;
 *   - relative paths in a recipe resolve against the current directory;
 *   - docs/metrics.md's table of metric names against what the runs log, both ways. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "test_shell.h"
#include "run_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

#define BASE "--set train.steps=6 --set logging.val_every=3 --set checkpoint.every=3 " \
             "--set logging.samples_every=2 --set logging.samples_per_step=3"

static int run(char **out, const char *name, const char *args) {
    return rf_test_sh(out, "cd %s && %s run r.toml %s --set logging.dir=%s/%s", dir, rlflow, args, dir, name);
}

/* The lines of <dir>/<name>/<file> whose "step" is step, without "time" and perf/ figures, as
 * one text (lines joined by '\n'); *count: how many. NULL when the file is missing. */
static char *lines_of(const char *name, const char *file, int step, int *count) {
    char p[512], *text = NULL;
    snprintf(p, sizeof p, "%s/%s/%s", dir, name, file);
    *count = 0;
    if (rf_read_file(p, &text, NULL) != RF_OK) return NULL;
    size_t cap = strlen(text) + 1, n = 0;
    char *res = calloc(1, cap), *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItem(j, "step");
        if (cJSON_IsNumber(s) && s->valueint == step) {
            cJSON_DeleteItemFromObject(j, "time");
            for (cJSON *it = j->child, *next; it; it = next) {
                next = it->next;
                if (strncmp(it->string, "perf/", 5) == 0) cJSON_DeleteItemFromObject(j, it->string);
            }
            char *t = cJSON_PrintUnformatted(j);
            n += (size_t)snprintf(res + n, cap > n ? cap - n : 0, "%s\n", t);
            free(t);
            (*count)++;
        }
        cJSON_Delete(j);
    }
    free(text);
    return res;
}

static uint64_t get_varint(const unsigned char *p, size_t n, size_t *i) {
    uint64_t v = 0;
    for (int sh = 0; *i < n && sh < 64; sh += 7) {
        v |= (uint64_t)(p[*i] & 0x7f) << sh;
        if (!(p[(*i)++] & 0x80)) break;
    }
    return v;
}

/* How many scalar values tagged `tag` at `step` the event files of run `name` hold, read
 * record by record (TFRecord framing, tensorflow.Event: step = 2, summary = 5 { value = 1
 * { tag = 1, simple_value = 2 } }); text values (tensor = 8) are counted in *texts. */
static int scalars_at(const char *name, const char *tag, int step, int *texts) {
    char *out = NULL;
    rf_test_sh(&out, "ls %s/%s/ | grep tfevents", dir, name);
    int count = 0;
    *texts = 0;
    for (char *f = strtok(out, "\n"); f; f = strtok(NULL, "\n")) {
        char p[512], *data = NULL;
        size_t len = 0;
        snprintf(p, sizeof p, "%s/%s/%s", dir, name, f);
        if (rf_read_file(p, &data, &len) != RF_OK) continue;
        const unsigned char *b = (const unsigned char *)data;
        for (size_t i = 0; i + 16 <= len;) {
            uint64_t dl = 0;
            for (int k = 0; k < 8; k++) dl |= (uint64_t)b[i + k] << (8 * k);
            const unsigned char *ev = b + i + 12;
            size_t j = 0, sum_at = 0, sum_len = 0;
            int64_t st = 0;
            while (j < dl) {
                uint64_t key = get_varint(ev, dl, &j);
                if ((key & 7) == 0) {
                    uint64_t v = get_varint(ev, dl, &j);
                    if (key >> 3 == 2) st = (int64_t)v;
                } else if ((key & 7) == 1) {
                    j += 8;
                } else if ((key & 7) == 2) {
                    uint64_t l = get_varint(ev, dl, &j);
                    if (key >> 3 == 5) sum_at = j, sum_len = l;
                    j += l;
                } else {
                    j += 4;
                }
            }
            for (size_t k = sum_at; sum_len && k < sum_at + sum_len && st == step;) {
                get_varint(ev, dl, &k); /* Summary.value */
                uint64_t vl = get_varint(ev, dl, &k);
                size_t end = k + vl;
                int is_tag = 0, is_text = 0;
                while (k < end) {
                    uint64_t key = get_varint(ev, dl, &k);
                    if ((key & 7) == 2) {
                        uint64_t l = get_varint(ev, dl, &k);
                        if (key >> 3 == 1) is_tag = l == strlen(tag) && memcmp(ev + k, tag, l) == 0;
                        if (key >> 3 == 8) is_text = 1;
                        k += l;
                    } else {
                        k += (key & 7) == 5 ? 4 : (key & 7) == 1 ? 8 : 0;
                        if ((key & 7) == 0) get_varint(ev, dl, &k);
                    }
                }
                count += is_tag && !is_text;
                *texts += is_tag && is_text;
            }
            i += 16 + dl;
        }
        free(data);
    }
    free(out);
    return count;
}

static double metric(const char *name, int step, const char *key) { return rf_test_metric(dir, name, step, key); }

/* Refusal, --overwrite, and the exit code of --resume with --overwrite. */
static void refuse_and_overwrite(void) {
    char *out = NULL;
    CHECK(run(&out, "a", BASE) == 0);
    free(out);
    int n0, n1;
    free(lines_of("a", "metrics.jsonl", 6, &n0));
    CHECK(n0 == 1);
    CHECK(run(&out, "a", BASE) == 1);
    char want[1024];
    snprintf(want, sizeof want, "error: logging.dir = \"%s/a\" holds a run already (metrics.jsonl, samples.jsonl, "
             "1 event file, 2 checkpoints): pass --resume to continue it, or --overwrite to remove it and start "
             "afresh (or set logging.dir to another directory)", dir);
    int has = out && strstr(out, want);
    CHECK(has);
    if (!has) fprintf(stderr, "want: %s\ngot: %s\n", want, out ? out : "");
    free(out);
    free(lines_of("a", "metrics.jsonl", 6, &n1));
    CHECK(n1 == 1); /* nothing appended */
    CHECK(run(&out, "a", BASE " --resume --overwrite") == 2);
    CHECK(out && strstr(out, "--resume and --overwrite exclude each other"));
    free(out);
    /* --overwrite: a copy, so that "a" stays for the resume below; a file of the user's stays */
    CHECK(rf_test_sh(NULL, "cp -r %s/a %s/o && echo mine > %s/o/notes.txt", dir, dir, dir) == 0);
    /* the logs of the programs a run starts (reward.programs, env.programs) go with the run;
     * reward_program_x.log is not one (no index) and stays */
    CHECK(rf_test_sh(NULL, "cd %s/o && touch reward_program_0.log env_program_12.log reward_program_x.log", dir) == 0);
    CHECK(run(&out, "o", BASE " --overwrite") == 0);
    CHECK(out && strstr(out, "--overwrite: removed the earlier run's 10 files and checkpoints from "));
    free(out);
    CHECK(rf_test_sh(&out, "cd %s/o && ls reward_program_0.log env_program_12.log reward_program_x.log 2>/dev/null",
                     dir) != 0);
    CHECK(out && strcmp(out, "reward_program_x.log\n") == 0);
    free(out);
    for (int s = 0; s <= 6; s++) {
        free(lines_of("o", "metrics.jsonl", s, &n1));
        CHECK(n1 == 1);
    }
    CHECK(rf_test_sh(&out, "ls %s/o | grep -c tfevents; cat %s/o/notes.txt", dir, dir) == 0);
    CHECK(out && strcmp(out, "1\nmine\n") == 0);
    free(out);
    char p[512], *st = NULL;
    snprintf(p, sizeof p, "%s/o/run_status.json", dir);
    CHECK(rf_read_file(p, &st, NULL) == RF_OK && strcmp(st, "{\"status\":\"ok\",\"message\":\"\"}") == 0);
    free(st);
}

/* Run "a" cut off after its step-3 checkpoint, resumed: each step once, as "a" logged it. */
static void resume_once(void) {
    char *out = NULL;
    CHECK(rf_test_sh(NULL, "cp -r %s/a %s/c && echo step_000003 > %s/c/latest && rm -r %s/c/step_000006", dir, dir,
                     dir, dir) == 0);
    CHECK(run(&out, "c", BASE " --resume") == 0);
    CHECK(out && strstr(out, "--resume: dropped what came after the checkpoint's step 3 from "));
    CHECK(out && strstr(out, "(9 JSONL lines, 5 event records)")); /* 3 metric + 6 sample lines */
    char want[128];
    snprintf(want, sizeof want, "validation accuracy: %.3f -> %.3f after 6 steps", metric("a", 0, "val/accuracy"),
             metric("a", 6, "val/accuracy"));
    int has = out && strstr(out, want);
    CHECK(has);
    if (!has) fprintf(stderr, "want: %s\ngot: %s\n", want, out ? out : "");
    free(out);
    for (int s = 0; s <= 6; s++) {
        int na, nc, sa, sc, ta, tc;
        char *a = lines_of("a", "metrics.jsonl", s, &na), *c = lines_of("c", "metrics.jsonl", s, &nc);
        CHECK(nc == 1 && a && c && strcmp(a, c) == 0);
        free(a), free(c);
        a = lines_of("a", "samples.jsonl", s, &sa), c = lines_of("c", "samples.jsonl", s, &sc);
        CHECK(sc == (s > 0 && s % 2 == 0 ? 3 : 0) && sc == sa && a && c && strcmp(a, c) == 0);
        free(a), free(c);
        CHECK(scalars_at("c", "reward/mean", s, &tc) == (s > 0) && scalars_at("a", "reward/mean", s, &ta) == (s > 0));
        CHECK(scalars_at("c", "val/accuracy", s, &tc) == (s % 3 == 0));
        scalars_at("c", "samples/2", s, &tc);
        CHECK(tc == (s > 0 && s % 2 == 0));
    }
}

/* All 128 samples of two steps logged: their means are the step's metrics. */
static void samples(void) {
    char *out = NULL;
    CHECK(run(&out, "s", "--set train.steps=2 --set logging.val_every=0 --set logging.samples_every=1 "
                         "--set logging.samples_per_step=1000") == 0);
    free(out);
    char p[512], *text = NULL;
    snprintf(p, sizeof p, "%s/s/samples.jsonl", dir);
    CHECK(rf_read_file(p, &text, NULL) == RF_OK);
    double rs[3] = {0}, as[3] = {0}, gadv[3][16] = {{0}}, grew[3][16] = {{0}};
    int n[3] = {0}, bad = 0, seen[3][16][8] = {{{0}}};
    cJSON *rows[3][128] = {{0}};
    for (char *save = NULL, *line = text ? strtok_r(text, "\n", &save) : NULL; line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        int step = cJSON_GetObjectItem(j, "step")->valueint, g = cJSON_GetObjectItem(j, "group")->valueint,
            i = cJSON_GetObjectItem(j, "index")->valueint;
        if (step < 1 || step > 2 || g < 0 || g >= 16 || i < 0 || i >= 8 || n[step] >= 128 || seen[step][g][i]++) {
            bad++;
            cJSON_Delete(j);
            continue;
        }
        double r = cJSON_GetObjectItem(j, "reward")->valuedouble, a = cJSON_GetObjectItem(j, "advantage")->valuedouble;
        const cJSON *comp = cJSON_GetObjectItem(j, "components");
        bad += cJSON_GetArraySize(comp) != 1 || cJSON_GetObjectItem(comp, "rules")->valuedouble != r;
        bad += !cJSON_IsString(cJSON_GetObjectItem(j, "prompt")) || !cJSON_IsString(cJSON_GetObjectItem(j, "response")) ||
               !cJSON_IsString(cJSON_GetObjectItem(j, "answer"));
        int nt = cJSON_GetObjectItem(j, "response_tokens")->valueint;
        bad += nt < 1 || nt > 6;
        rs[step] += r, as[step] += cJSON_GetObjectItem(j, "accuracy")->valuedouble;
        gadv[step][g] += a, grew[step][g] += r;
        rows[step][n[step]++] = j;
    }
    free(text);
    CHECK(bad == 0 && n[1] == 128 && n[2] == 128);
    for (int s = 1; s <= 2; s++) {
        printf("step %d: mean sample reward %.6f, reward/mean %.6f\n", s, rs[s] / 128, metric("s", s, "reward/mean"));
        CHECK(fabs(rs[s] / 128 - metric("s", s, "reward/mean")) < 1e-9);
        CHECK(fabs(as[s] / 128 - metric("s", s, "reward/accuracy")) < 1e-9);
        int sign_ok = 1;
        for (int g = 0; g < 16; g++) CHECK(fabs(gadv[s][g]) < 1e-4); /* whitened within the group */
        for (int k = 0; k < 128; k++) {
            int g = cJSON_GetObjectItem(rows[s][k], "group")->valueint;
            double d = cJSON_GetObjectItem(rows[s][k], "reward")->valuedouble - grew[s][g] / 8;
            double a = cJSON_GetObjectItem(rows[s][k], "advantage")->valuedouble;
            sign_ok &= fabs(d) < 1e-9 ? fabs(a) < 1e-4 : (d > 0) == (a > 0);
            cJSON_Delete(rows[s][k]);
        }
        CHECK(sign_ok);
        int texts;
        scalars_at("s", "samples/127", s, &texts);
        CHECK(texts == 1);
    }
}

/* A one-process run that fails leaves its error in run_status.json. */
static void status_on_error(void) {
    char *out = NULL, p[512], *st = NULL;
    CHECK(run(&out, "bad", "--set model.path=nomodel --set sft.warm_start=false --set model.init_preset=\"\"") == 1);
    free(out);
    snprintf(p, sizeof p, "%s/bad/run_status.json", dir);
    CHECK(rf_read_file(p, &st, NULL) == RF_OK && strcmp(st, "{\"status\":\"error\",\"message\":\"model.path \\\"nomodel\\\" "
                                                          "holds no config.json (set model.init_preset to create a model there)\"}") == 0);
    if (st) printf("run_status.json of a failed run: %s\n", st);
    free(st);
}

/* rlflow sft --resume: a run cut off after its step-10 checkpoint and resumed ends with the
 * weights of the uninterrupted 30-step run, byte for byte, and the same final loss (printed
 * exactly, %a); the checkpoints refuse a second run without --resume or --overwrite. */
static void sft_resume(void) {
    char *a = NULL, *b = NULL, *out = NULL;
    const char *sft = "--set sft.max_steps=30 --set sft.batch_size=16 --set checkpoint.every=10 --set checkpoint.keep=0";
    CHECK(rf_test_sh(&a, "cd %s && %s sft r.toml %s --set logging.dir=sA", dir, rlflow, sft) == 0);
    CHECK(rf_test_sh(NULL, "cd %s && mkdir sB && cp -r sA/sft_checkpoints sB/ && echo step_000010 > sB/sft_checkpoints/latest "
                     "&& rm -r sB/sft_checkpoints/step_000020 sB/sft_checkpoints/step_000030", dir) == 0);
    CHECK(rf_test_sh(&out, "cd %s && %s sft r.toml %s --set logging.dir=sB", dir, rlflow, sft) == 1);
    CHECK(out && strstr(out, "error: the SFT checkpoint directory \"sB/sft_checkpoints\" holds a run already (1 checkpoint): "
                        "pass --resume to continue it, or --overwrite"));
    free(out);
    CHECK(rf_test_sh(&b, "cd %s && %s sft r.toml %s --set logging.dir=sB --resume", dir, rlflow, sft) == 0);
    CHECK(b && strstr(b, "sft: resumed at step 10 (data epoch 0, index 160)"));
    const char *la = a ? strstr(a, "sft: final loss ") : NULL, *lb = b ? strstr(b, "sft: final loss ") : NULL;
    CHECK(la && lb && strncmp(la, lb, (size_t)(strchr(la, ';') - la)) == 0);
    if (la && lb) printf("uninterrupted:  %.60s\nresumed at 10: %.60s\n", la, lb);
    CHECK(rf_test_sh(NULL, "cd %s && cmp sA/sft/model.safetensors sB/sft/model.safetensors", dir) == 0);
    free(a), free(b);
}

/* Relative paths inside a recipe resolve against the current directory, not the recipe's. */
static void relative_paths(void) {
    char *out = NULL;
    CHECK(rf_test_sh(&out, "cd %s && mkdir -p sub && cp r.toml sub/r.toml && %s run sub/r.toml --set train.steps=1 "
                     "--set logging.val_every=0 --set logging.dir=rel", dir, rlflow) == 0);
    free(out);
    CHECK(rf_test_sh(NULL, "test -f %s/rel/metrics.jsonl && test ! -e %s/sub/rel", dir, dir) == 0);
}

/* ---- docs/metrics.md's names ---- */

typedef struct doc_name {
    char name[96], when[32];
    int logged;
} doc_name;

/* The rows "| `name` | when | ..." of docs/metrics.md's "## Metric names" table. */
static int doc_names(doc_name *d, int cap) {
    const char *src = getenv("RF_SOURCE_DIR");
    char p[512], *text = NULL;
    snprintf(p, sizeof p, "%s/docs/metrics.md", src ? src : ".");
    if (rf_read_file(p, &text, NULL) != RF_OK) return 0;
    char *sec = strstr(text, "\n## Metric names\n"), *save = NULL;
    int n = 0;
    for (char *line = sec ? strtok_r(sec, "\n", &save) : NULL; line && n < cap; line = strtok_r(NULL, "\n", &save)) {
        if (strncmp(line, "## ", 3) == 0 && strstr(line, "Metric names") == NULL) break;
        if (sscanf(line, "| `%95[^`]` | %31[^ |] |", d[n].name, d[n].when) == 2) d[n].logged = 0, n++;
    }
    free(text);
    return n;
}

/* name against a documented pattern: "<...>" stands for one or more characters. */
static int matches(const char *pat, const char *name) {
    const char *lt = strchr(pat, '<');
    if (!lt) return strcmp(pat, name) == 0;
    const char *gt = strchr(lt, '>');
    size_t pre = (size_t)(lt - pat), post = strlen(gt + 1), len = strlen(name);
    return strncmp(pat, name, pre) == 0 && len > pre + post && strcmp(name + len - post, gt + 1) == 0;
}

/* Marks the documented names the run logged; counts the logged names the doc lacks. */
static int check_logged(doc_name *d, int nd, const char *name) {
    char p[512], *text = NULL;
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, name);
    if (rf_read_file(p, &text, NULL) != RF_OK) return 1;
    int missing = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        for (cJSON *it = j ? j->child : NULL; it; it = it->next) {
            if (!strcmp(it->string, "step") || !strcmp(it->string, "time")) continue;
            int found = 0;
            for (int k = 0; k < nd; k++)
                if (matches(d[k].name, it->string)) d[k].logged = found = 1;
            if (!found) {
                fprintf(stderr, "%s logs \"%s\", which docs/metrics.md does not list\n", name, it->string);
                missing++;
                cJSON_DeleteItemFromObject(j, it->string); /* report once per line */
                break;
            }
        }
        cJSON_Delete(j);
    }
    free(text);
    return missing;
}

static void metric_names(void) {
    doc_name d[128];
    int nd = doc_names(d, 128);
    if (!getenv("RF_SOURCE_DIR")) {
        printf("metric names: skipped (RF_SOURCE_DIR not set)\n");
        return;
    }
    CHECK(nd > 30);
    char *out = NULL;
    /* PPO with a reference (KL), the decoupled objective and dynamic sampling */
    CHECK(run(&out, "ppo", "--set train.steps=2 --set logging.val_every=2 --set algorithm.name=ppo "
                           "--set algorithm.kl_coef=0.01 --set algorithm.decoupled=true "
                           "--set algorithm.dynamic_sampling=true") == 0);
    free(out);
    const char *runs[4] = {"a", "ppo", NULL, NULL};
    const char *covered = "always val rules ppo ref decoupled dynamic one-process"; /* what these runs log */
    int n_runs = 2;
    const char *echo = getenv("RF_REWARD_ECHO");
    if (echo) {
        CHECK(rf_test_sh(&out, "cd %s && (sleep 1; %s --connect ipc://%s/names.sock --name names) & "
                         "cd %s && %s run r.toml --set train.steps=2 --set logging.val_every=2 --set logging.dir=%s/ext "
                         "--set reward.external=ipc://%s/names.sock --set reward.external_weight=0.01 "
                         "--set reward.external_timeout=20; rc=$?; wait; exit $rc", dir, echo, dir, dir, rlflow, dir, dir) == 0);
        free(out);
        runs[n_runs++] = "ext";
    }
    int split = rf_test_sh(NULL, "command -v mpirun >/dev/null") == 0;
    if (split) {
        int rc = run(&out, "split", "--set train.steps=2 --set logging.val_every=2 --set placement.mode=split "
                                    "--set algorithm.kl_coef=0.01 --set logging.samples_every=1 "
                                    "--set logging.samples_per_step=1000 --set async.max_staleness=0");
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
        runs[n_runs++] = "split";
        /* the split controller logs the samples too: all of a batch, averaging to reward/mean */
        char p[512], *text = NULL;
        snprintf(p, sizeof p, "%s/split/samples.jsonl", dir);
        double sum[3] = {0};
        int cnt[3] = {0};
        if (rf_read_file(p, &text, NULL) == RF_OK)
            for (char *save = NULL, *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
                cJSON *j = cJSON_Parse(line);
                int s = cJSON_GetObjectItem(j, "step")->valueint;
                if (s >= 1 && s <= 2) sum[s] += cJSON_GetObjectItem(j, "reward")->valuedouble, cnt[s]++;
                cJSON_Delete(j);
            }
        free(text);
        for (int s = 1; s <= 2; s++) {
            printf("split, step %d: %d samples, mean reward %.6f, reward/mean %.6f\n", s, cnt[s], sum[s] / (cnt[s] ? cnt[s] : 1),
                   metric("split", s, "reward/mean"));
            CHECK(cnt[s] == 128 && fabs(sum[s] / 128 - metric("split", s, "reward/mean")) < 1e-9);
        }
    }
    int missing = 0;
    for (int i = 0; i < n_runs; i++) missing += check_logged(d, nd, runs[i]);
    CHECK(missing == 0);
    for (int k = 0; k < nd; k++) {
        int want = strstr(covered, d[k].when) != NULL || (echo && strcmp(d[k].when, "external") == 0) ||
                   (split && (strcmp(d[k].when, "split") == 0 || strcmp(d[k].when, "split-score") == 0));
        if (want && !d[k].logged) fprintf(stderr, "docs/metrics.md lists \"%s\" (%s), which no run logged\n", d[k].name, d[k].when);
        CHECK(!want || d[k].logged);
    }
}

int main(void) {
    rlflow = getenv("RF_RLFLOW");
    if (!rlflow) {
        printf("test_run_logs: skipped: RF_RLFLOW not set\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_run_logs_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    rf_test_write_recipe(dir, RF_TEST_VAL_ENDS, "");
    refuse_and_overwrite();
    resume_once();
    samples();
    status_on_error();
    sft_resume();
    relative_paths();
    metric_names();
    if (!getenv("RF_KEEP_TMP")) rf_test_sh(NULL, "rm -rf %s", dir);
    else printf("kept %s\n", dir);
    return rf_test_finish("test_run_logs");
}
