/* Shared by the end-to-end run tests: the small arithmetic recipe they run (1-digit operands,
 * tiny model, a 150-step SFT warm start, 120 GRPO steps of 16 prompts x 8 samples) and a
 * reader of per-step metrics. Include after test_shell.h. */
#ifndef RF_TEST_RUN_UTIL_H
#define RF_TEST_RUN_UTIL_H

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* Writes <dir>/r.toml: the recipe, validation every val_every steps, then `extra` (more TOML
 * tables, may be ""). */
static void rf_test_write_recipe(const char *dir, int val_every, const char *extra) {
    char p[512];
    snprintf(p, sizeof p, "%s/r.toml", dir);
    FILE *f = fopen(p, "w");
    if (!f) return;
    fprintf(f, "[model]\npath = \"%s/sft\"\ninit_preset = \"tiny\"\n"
               "[data]\ntask = \"arith\"\ntask_max_digits = 1\ntask_mul_percent = 0\n"
               "task_train = 2000\ntask_val = 40\ntrain = \"%s/data/train.jsonl\"\nval = \"%s/data/val.jsonl\"\n"
               "[sft]\nwarm_start = true\nmax_steps = 150\nbatch_size = 64\nlr = 3e-3\n"
               "[rollout]\nn = 8\nprompts_per_step = 16\nmax_new_tokens = 6\n"
               "[algorithm]\nname = \"grpo\"\nclip_high = 0.28\n"
               "[train]\nsteps = 120\nlr = 5e-4\n"
               "[logging]\nval_every = %d\nval_size = 40\n[checkpoint]\nevery = 20\nkeep = 0\n%s",
            dir, dir, dir, val_every, extra);
    fclose(f);
}

/* Common start of the split-run tests: the rlflow under test into *rlflow and a fresh work
 * directory named after `test` into dir (cap bytes). Returns 0 to go on, 77 (ctest's skip)
 * when RF_RLFLOW or mpirun is missing, 1 when the directory cannot be made. */
static inline int rf_test_split_start(const char *test, const char **rlflow, char *dir, size_t cap) {
    *rlflow = getenv("RF_RLFLOW");
    if (!*rlflow) {
        printf("%s: skipped: RF_RLFLOW not set\n", test);
        return 77;
    }
    if (rf_test_sh(NULL, "command -v mpirun >/dev/null") != 0) {
        printf("%s: skipped: mpirun not found (apt-get install openmpi-bin)\n", test);
        return 77;
    }
    snprintf(dir, cap, "/tmp/rf_%s_XXXXXX", test);
    return mkdtemp(dir) ? 0 : 1;
}

/* Metric `name` at `step` of <dir>/<run>/metrics.jsonl (the last line of that step), NAN when
 * absent. */
static double rf_test_metric(const char *dir, const char *run, int step, const char *name) {
    char p[512], *text;
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, run);
    if (rf_read_file(p, &text, NULL) != RF_OK) return NAN;
    double v = NAN;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItem(j, "step"), *it = cJSON_GetObjectItem(j, name);
        if (cJSON_IsNumber(s) && s->valueint == step && cJSON_IsNumber(it)) v = it->valuedouble;
        cJSON_Delete(j);
    }
    free(text);
    return v;
}

/* Mean of a metric over steps from..to. */
static double rf_test_metric_mean(const char *dir, const char *run, const char *name, int from, int to) {
    double s = 0;
    for (int k = from; k <= to; k++) s += rf_test_metric(dir, run, k, name);
    return s / (to - from + 1);
}

#endif
