/* Ctrl-C in a one-process run (the one RL loop with the in-process roles): SIGINT at five
 * moments of a 40-step run (during generation, scoring, the update, validation, between steps:
 * the delays spread over the steps) must each stop the run with exit status 130 and
 * "interrupted at step N: checkpoint written to <dir>/step_00000N; resume with --resume", the
 * checkpoint of step N on disk and step N's metrics record the last one written; `--resume`
 * then ends with every per-step metric but the wall-clock ones equal, bit for bit, to an
 * uninterrupted run's. (A stop that came while a step was being trained once left the loop
 * waiting with no request pending: "in-process roles: the loop waits with no request
 * pending".) */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "test_shell.h"
#include "run_util.h"
#include "spawn_util.h"
#include "test_util.h"

static const char *rlflow;
static char dir[256];

/* Lines in <dir>/<run>/metrics.jsonl (0 when missing). */
static int records(const char *run) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, run);
    char *t = rf_test_slurp(p);
    int n = 0;
    for (char *c = t; c && *c; c++) n += *c == '\n';
    free(t);
    return n;
}

/* The record of `step` in <dir>/<run>/metrics.jsonl (the last one), NULL when missing. */
static cJSON *record(const char *run, int step) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, run);
    char *text = rf_test_slurp(p);
    cJSON *res = NULL;
    for (char *line = text ? strtok(text, "\n") : NULL; line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *st = cJSON_GetObjectItem(j, "step");
        if (st && st->valueint == step) cJSON_Delete(res), res = j;
        else cJSON_Delete(j);
    }
    free(text);
    return res;
}

/* Whether step's record of run holds the uninterrupted run's keys and values (doubles compared
 * exactly; wall-clock keys, perf/... and time, left out). */
static int same_record(const char *run, int step) {
    cJSON *a = record("full", step), *b = record(run, step);
    int n = 0, bad = !a || !b;
    for (int pass = 0; !bad && pass < 2; pass++) /* a's keys in b, then b's in a */
        for (const cJSON *it = (pass ? b : a)->child; it; it = it->next) {
            if (strncmp(it->string, "perf/", 5) == 0 || strcmp(it->string, "time") == 0) continue;
            const cJSON *o = cJSON_GetObjectItemCaseSensitive(pass ? a : b, it->string);
            n++;
            if (!o || o->valuedouble != it->valuedouble) {
                fprintf(stderr, "%s: step %d: %s = %.17g, uninterrupted %.17g\n", run, step, it->string,
                        pass ? it->valuedouble : (o ? o->valuedouble : NAN), pass ? (o ? o->valuedouble : NAN) : it->valuedouble);
                bad = 1;
            }
        }
    if (!a || !b) fprintf(stderr, "%s: step %d: no record (%s)\n", run, step, a ? "resumed run" : "uninterrupted run");
    cJSON_Delete(a), cJSON_Delete(b);
    return !bad && n > 0;
}

/* Interrupts a run after its first `after` metrics records and delay_ms more; checks the stop,
 * resumes it and compares it with the uninterrupted run "full". */
static void stop_and_resume(int k, int after, int delay_ms) {
    char run[32], ldir[300], rpath[300], out_path[300];
    snprintf(run, sizeof run, "stop%d", k);
    snprintf(ldir, sizeof ldir, "logging.dir=%s/%s", dir, run);
    snprintf(rpath, sizeof rpath, "%s/r.toml", dir);
    snprintf(out_path, sizeof out_path, "%s/%s.out", dir, run);
    char *argv[] = {(char *)rlflow, "run", rpath, "--set", ldir, "--set", "train.steps=40", "--set",
                    "logging.val_every=4", NULL};
    pid_t pid = rf_test_spawn(argv, out_path);
    CHECK(pid > 0);
    for (int i = 0; i < 6000 && records(run) < after; i++) nanosleep(&(struct timespec){0, 5000000L}, NULL);
    nanosleep(&(struct timespec){0, delay_ms * 1000000L}, NULL);
    kill(pid, SIGINT);
    int rc = rf_test_wait(pid, 120);
    char *o = rf_test_slurp(out_path);
    int step = -1;
    const char *m = strstr(o, "interrupted at step ");
    if (m) sscanf(m, "interrupted at step %d", &step);
    printf("%s: SIGINT %d ms after %d records: exit %d, stopped at step %d\n", run, delay_ms, after, rc, step);
    CHECK(rc == 130);
    CHECK(step >= 0 && step < 40);
    char want[600];
    snprintf(want, sizeof want, "interrupted at step %d: checkpoint written to %s/%s/step_%06d; resume with --resume", step,
             dir, run, step);
    CHECK(strstr(o, want) != NULL);
    if (!strstr(o, want)) fprintf(stderr, "%s\n", o);
    free(o);
    struct stat st;
    char ck[400];
    snprintf(ck, sizeof ck, "%s/%s/step_%06d", dir, run, step);
    CHECK(stat(ck, &st) == 0 && S_ISDIR(st.st_mode));
    CHECK(records(run) == step + 1); /* steps 0 .. N: the stop's step is logged */
    char *out = NULL;
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=40 --set logging.val_every=4 --set logging.dir=%s/%s "
                     "--resume 2>&1", dir, rlflow, dir, run) == 0);
    free(out);
    int same = 0;
    for (int s = 0; s <= 40; s++) same += same_record(run, s);
    CHECK(same == 41);
}

int main(void) {
    rlflow = getenv("RF_RLFLOW");
    if (!rlflow) {
        printf("test_run_stop: skipped: RF_RLFLOW not set\n");
        return 77;
    }
    snprintf(dir, sizeof dir, "/tmp/rf_test_run_stop_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    rf_test_write_recipe(dir, 4, "");
    char *out = NULL;
    CHECK(rf_test_sh(&out, "cd %s && %s run r.toml --set train.steps=40 --set logging.val_every=4 --set logging.dir=%s/full "
                     "2>&1", dir, rlflow, dir) == 0);
    free(out);
    CHECK(records("full") == 41);
    /* the delays fall in different phases of different steps */
    static const int at[][2] = {{2, 0}, {3, 37}, {5, 71}, {8, 113}, {12, 157}};
    for (int k = 0; k < 5; k++) stop_and_resume(k, at[k][0], at[k][1]);
    rf_test_sh(NULL, "rm -rf %s", dir);
    return rf_test_finish("test_run_stop");
}
