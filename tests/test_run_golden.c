/* The one RL loop (controller/controller.c driving the in-process roles) gives the metrics the
 * one-process loop it replaced gave, bit for bit: tests/data/loop_golden.jsonl holds, for three
 * recipes (GRPO, PPO with a critic and KL to the reference, GRPO with dynamic sampling), every
 * per-step metric but the wall-clock ones (perf/..., time) of the first 8 steps, first written by
 * `rlflow run` of main at c637b7a (the commit before the loop was unified, its
 * controller/rl_step.c loop) with this test's recipe, and written again (RF_WRITE_GOLDEN, below)
 * only where the arithmetic was changed on purpose: when decoding's products of 1-4 rows moved
 * from the matrix-vector loops to oneDNN where its rows are batch-invariant, and when attention
 * took one arithmetic for every row and the sampler the log-prob kernel's log-softmax, and when
 * the backward's plain-B products moved to oneDNN's gemm:jit kernels and the gradient norm's
 * sum of squares took one order for any thread count (all 2026-11-29, docs/kernels.md); each value must come back exactly (0 ulp), and no key may be
 * added or missing.
 *
 * The values depend on the floating-point kernels, so the golden file also holds the CRC-32C of
 * the SFT warm start the recipe builds (fp32, the same kernels): on a machine whose kernels
 * round differently, the warm start differs and the test says so and skips (77) rather than
 * compare numbers made by other arithmetic. RF_WRITE_GOLDEN=<path> writes the file instead
 * (how it was made: this test run with RF_RLFLOW pointing at main's rlflow). */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/util.h"
#include "test_shell.h"
#include "run_util.h"
#include "spawn_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

static const char *const CASES[][2] = {
    {"grpo", ""},
    {"ppo", "--set algorithm.name=ppo --set algorithm.kl_coef=0.01 --set algorithm.kl_in_reward=true --set critic.lr=1e-3"},
    {"dynamic", "--set algorithm.dynamic_sampling=true"},
};
#define N_CASES 3
#define STEPS 8

/* CRC-32C of a whole file; 0 when it cannot be read. */
static uint32_t file_crc(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    uint32_t crc = 0;
    char buf[65536];
    size_t n;
    int first = 1;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) crc = first ? rf_crc32c(buf, n) : rf_crc32c_extend(crc, buf, n), first = 0;
    fclose(f);
    return crc;
}

/* The run's metrics.jsonl as one JSON array of records, the wall-clock keys removed. */
static cJSON *read_metrics(const char *run) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, run);
    char *text = rf_test_slurp(p);
    cJSON *all = cJSON_CreateArray();
    for (char *line = text ? strtok(text, "\n") : NULL; line; line = strtok(NULL, "\n")) {
        cJSON *rec = cJSON_Parse(line);
        if (!rec) continue;
        cJSON *keep = cJSON_CreateObject();
        for (cJSON *it = rec->child; it; it = it->next)
            if (strncmp(it->string, "perf/", 5) != 0 && strcmp(it->string, "time") != 0)
                cJSON_AddItemToObject(keep, it->string, cJSON_Duplicate(it, 1));
        cJSON_AddItemToArray(all, keep);
        cJSON_Delete(rec);
    }
    free(text);
    return all;
}

/* One line {"name": [records]}, each number as %.17g (which reads back to the same double; cJSON's
 * printer may round to 15 digits). */
static void write_case(FILE *f, const char *name, const cJSON *recs) {
    fprintf(f, "{\"%s\": [", name);
    for (const cJSON *r = recs->child; r; r = r->next) {
        fprintf(f, "%s{", r == recs->child ? "" : ", ");
        for (const cJSON *it = r->child; it; it = it->next)
            fprintf(f, "%s\"%s\": %.17g", it == r->child ? "" : ", ", it->string, it->valuedouble);
        fprintf(f, "}");
    }
    fprintf(f, "]}\n");
}

/* Every record of got against want: the same steps, keys and values (doubles, exactly). */
static void compare(const char *name, const cJSON *want, const cJSON *got) {
    int nw = cJSON_GetArraySize(want), ng = cJSON_GetArraySize(got), values = 0, differ = 0;
    CHECK(nw == ng && nw == STEPS + 1);
    for (int i = 0; i < nw && i < ng; i++) {
        const cJSON *w = cJSON_GetArrayItem(want, i), *g = cJSON_GetArrayItem(got, i);
        CHECK(cJSON_GetArraySize(w) == cJSON_GetArraySize(g));
        for (const cJSON *it = w->child; it; it = it->next) {
            const cJSON *o = cJSON_GetObjectItemCaseSensitive(g, it->string);
            values++;
            if (o && cJSON_IsNumber(o) && o->valuedouble == it->valuedouble) continue;
            if (differ++ < 10)
                fprintf(stderr, "%s: record %d: %s = %.17g, golden %.17g\n", name, i, it->string,
                        o ? o->valuedouble : NAN, it->valuedouble);
        }
        for (const cJSON *it = g->child; it; it = it->next)
            if (!cJSON_GetObjectItemCaseSensitive(w, it->string)) {
                differ++;
                fprintf(stderr, "%s: record %d: %s is not in the golden file\n", name, i, it->string);
            }
    }
    printf("%s: %d values of %d records against the golden file, %d differ\n", name, values, nw, differ);
    CHECK(values > 100 && differ == 0);
}

int main(void) {
    rlflow = getenv("RF_RLFLOW");
    const char *src = getenv("RF_SOURCE_DIR"), *write = getenv("RF_WRITE_GOLDEN");
    if (!rlflow || !src) {
        printf("test_run_golden: skipped: RF_RLFLOW or RF_SOURCE_DIR not set\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_test_run_golden_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    rf_test_write_recipe(dir, 4, "");
    cJSON *runs = cJSON_CreateObject();
    for (int i = 0; i < N_CASES; i++) {
        char *out = NULL;
        int rc = rf_test_sh(&out, "cd %s && %s run r.toml --set model.precision=fp32 --set train.steps=%d "
                            "--set checkpoint.every=0 --set logging.dir=%s/%s %s 2>&1", dir, rlflow, STEPS, dir,
                            CASES[i][0], CASES[i][1]);
        CHECK(rc == 0);
        if (rc) fprintf(stderr, "%s\n", out ? out : "");
        free(out);
        cJSON_AddItemToObject(runs, CASES[i][0], read_metrics(CASES[i][0]));
    }
    char p[512];
    snprintf(p, sizeof p, "%s/sft/model.safetensors", dir);
    uint32_t crc = file_crc(p);
    CHECK(crc != 0);
    if (write) {
        FILE *f = fopen(write, "w");
        CHECK(f != NULL);
        if (f) {
            fprintf(f, "{\"sft_crc32c\": %u}\n", crc);
            for (int i = 0; i < N_CASES; i++) write_case(f, CASES[i][0], cJSON_GetObjectItem(runs, CASES[i][0]));
            fclose(f);
            printf("test_run_golden: wrote %s (warm start CRC-32C %08x)\n", write, crc);
        }
    } else {
        snprintf(p, sizeof p, "%s/tests/data/loop_golden.jsonl", src);
        char *text = rf_test_slurp(p);
        CHECK(text != NULL);
        char *line = text ? strtok(text, "\n") : NULL;
        cJSON *head = line ? cJSON_Parse(line) : NULL;
        const cJSON *c = cJSON_GetObjectItem(head, "sft_crc32c");
        CHECK(cJSON_IsNumber(c));
        if (!rf_test_failed && cJSON_IsNumber(c) && (uint32_t)c->valuedouble != crc) {
            printf("test_run_golden: skipped: this machine's fp32 kernels build another warm start (CRC-32C %08x, "
                   "the golden file's %08x): its metrics cannot be compared bit for bit\n", crc,
                   (uint32_t)c->valuedouble);
            cJSON_Delete(head), cJSON_Delete(runs), free(text);
            rf_test_sh(NULL, "rm -rf %s", dir);
            return 77;
        }
        for (int i = 0; i < N_CASES; i++) {
            line = strtok(NULL, "\n");
            cJSON *rec = line ? cJSON_Parse(line) : NULL;
            const cJSON *want = cJSON_GetObjectItem(rec, CASES[i][0]);
            CHECK(want != NULL);
            if (want) compare(CASES[i][0], want, cJSON_GetObjectItem(runs, CASES[i][0]));
            cJSON_Delete(rec);
        }
        cJSON_Delete(head);
        free(text);
    }
    cJSON_Delete(runs);
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_run_golden");
}
