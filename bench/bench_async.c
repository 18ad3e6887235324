/* Split asynchronous training against colocated synchronous training, at equal cores, on the
 * arithmetic recipe (examples/grpo.toml: data, SFT warm start, GRPO), printed as JSON lines.
 *
 * Each configuration runs `rlflow run` for the same number of RL steps from the same warm
 * start, with validation (greedy accuracy on 500 held-out prompts) every val_every steps:
 *   colocated k=0  the embedded single process (generation and training alternate, 2 threads)
 *   split k=0      controller + training worker + rollout worker, synchronous (on-policy)
 *   split k=1, 2   the same, generation running up to k policy versions ahead
 * and reports steps per hour (first to last step, wall clock), the validation curve
 * (seconds since the first step, accuracy), the accuracy each configuration has when colocated
 * ends, and, as ratios against colocated k=0 measured in the same run, steps per hour and the
 * wall-clock time to reach colocated's final accuracy (accuracies smoothed over 3 points).
 * Published figures for the same comparison on large clusters: AsyncFlow 1.59x, AReaL 2.77x.
 *
 * Usage: bench_async [--steps N] [--val-every N] [--dir DIR] [--quick]
 * (the rlflow program next to this one is used; the work directory is kept for inspection). */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

#define MAX_PTS 256

typedef struct result {
    const char *name;
    int ok, steps;
    double steps_per_hour, wall_s;
    double t[MAX_PTS], acc[MAX_PTS];
    int n_pts;
} result;

static char rlflow[8200], src[8200], work[4096];

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[16384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return system(cmd);
}

/* Steps/hour and the validation curve from a run's metrics.jsonl. */
static void read_metrics(result *r, const char *dir) {
    char p[8400], *text;
    snprintf(p, sizeof p, "%s/metrics.jsonl", dir);
    if (rf_read_file(p, &text, NULL) != RF_OK) return;
    double t_first = NAN, t_last = NAN;
    int s_first = -1, s_last = -1;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItem(j, "step"), *t = cJSON_GetObjectItem(j, "time"),
                    *a = cJSON_GetObjectItem(j, "val/accuracy");
        /* validation before training: logged at step 0 (colocated) or with step 1 (split) */
        if (cJSON_IsNumber(s) && s->valueint == 0 && cJSON_IsNumber(a) && r->n_pts < MAX_PTS)
            r->t[r->n_pts] = 0, r->acc[r->n_pts++] = a->valuedouble;
        if (cJSON_IsNumber(s) && cJSON_IsNumber(t) && s->valueint >= 1) {
            if (s_first < 0) s_first = s->valueint, t_first = t->valuedouble;
            s_last = s->valueint, t_last = t->valuedouble;
            if (cJSON_IsNumber(a) && r->n_pts < MAX_PTS) {
                r->t[r->n_pts] = t->valuedouble - t_first;
                r->acc[r->n_pts++] = a->valuedouble;
            }
        }
        cJSON_Delete(j);
    }
    free(text);
    if (s_last > s_first && t_last > t_first) {
        r->steps = s_last;
        r->steps_per_hour = (s_last - s_first) / (t_last - t_first) * 3600.0;
    }
}

/* Validation accuracy is noisy (500 prompts, a tiny model): curves are compared through the
 * mean of 3 consecutive points, ending at point i. */
static double smooth(const result *r, int i) {
    int a = i >= 2 ? i - 2 : 0;
    double s = 0;
    for (int k = a; k <= i; k++) s += r->acc[k];
    return s / (i - a + 1);
}

/* Seconds until the smoothed curve first reaches acc after the start, NAN if never. */
static double time_to(const result *r, double acc) {
    for (int i = 1; i < r->n_pts; i++)
        if (smooth(r, i) >= acc - 1e-9) return r->t[i];
    return NAN;
}

/* Smoothed accuracy at wall-clock t (the last point at or before t). */
static double acc_at(const result *r, double t) {
    int last = -1;
    for (int i = 0; i < r->n_pts; i++)
        if (r->t[i] <= t + 1e-9) last = i;
    return last < 0 ? NAN : smooth(r, last);
}

static void run_one(result *r, const char *name, const char *extra, int steps, int val_every) {
    memset(r, 0, sizeof *r);
    r->name = name;
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/runs/%s", work, name);
    sh("rm -rf %s", dir);
    fprintf(stderr, "bench_async: %s (%d steps)...\n", name, steps);
    double t = rf_time_now();
    int rc = sh("cd %s && %s run %s/examples/grpo.toml --set train.steps=%d --set logging.val_every=%d "
                "--set logging.dir=%s --set checkpoint.every=0 --set logging.every=100 %s > %s.log 2>&1",
                work, rlflow, src, steps, val_every, dir, extra, dir);
    r->wall_s = rf_time_now() - t;
    r->ok = rc == 0;
    if (!r->ok) fprintf(stderr, "bench_async: %s failed (see %s.log)\n", name, dir);
    read_metrics(r, dir);
}

int main(int argc, char **argv) {
    int steps = 600, val_every = 100;
    snprintf(work, sizeof work, "/tmp/rf_bench_async");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--val-every") == 0 && i + 1 < argc) val_every = atoi(argv[++i]);
        else if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) snprintf(work, sizeof work, "%s", argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0) steps = 100, val_every = 50;
        else {
            fprintf(stderr, "usage: bench_async [--steps N] [--val-every N] [--dir DIR] [--quick]\n");
            return 2;
        }
    }
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 1;
    self[n] = '\0';
    *strrchr(self, '/') = '\0';
    snprintf(rlflow, sizeof rlflow, "%s/rlflow", self);
    /* the source tree: RF_SOURCE_DIR, else the build directory's parent */
    const char *sd = getenv("RF_SOURCE_DIR");
    if (sd) snprintf(src, sizeof src, "%s", sd);
    else snprintf(src, sizeof src, "%s/..", self);
    sh("mkdir -p %s", work);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    /* the warm start once, shared by every configuration */
    fprintf(stderr, "bench_async: data and SFT warm start in %s...\n", work);
    if (sh("cd %s && %s run %s/examples/grpo.toml --set train.steps=0 --set logging.dir=%s/runs/prep > %s/prep.log 2>&1",
           work, rlflow, src, work, work) != 0) {
        fprintf(stderr, "bench_async: preparing the warm start failed (see %s/prep.log)\n", work);
        return 1;
    }
    result res[4];
    run_one(&res[0], "colocated_k0", "", steps, val_every);
    run_one(&res[1], "split_k0", "--set placement.mode=split --set async.max_staleness=0", steps, val_every);
    run_one(&res[2], "split_k1", "--set placement.mode=split --set async.max_staleness=1", steps, val_every);
    run_one(&res[3], "split_k2", "--set placement.mode=split --set async.max_staleness=2", steps, val_every);
    const result *base = &res[0];
    double target = base->n_pts ? smooth(base, base->n_pts - 1) : NAN, t_base = time_to(base, target);
    double t_end = base->n_pts ? base->t[base->n_pts - 1] : NAN;
    for (int i = 0; i < 4; i++) {
        const result *r = &res[i];
        char curve[8192];
        size_t off = 0;
        off += (size_t)snprintf(curve + off, sizeof curve - off, "[");
        for (int k = 0; k < r->n_pts && off < sizeof curve - 64; k++)
            off += (size_t)snprintf(curve + off, sizeof curve - off, "%s[%.1f,%.3f]", k ? "," : "", r->t[k], r->acc[k]);
        snprintf(curve + off, sizeof curve - off, "]");
        double tt = time_to(r, target);
        char tts[32] = "null", ratio[32] = "null";
        if (!isnan(tt)) snprintf(tts, sizeof tts, "%.1f", tt);
        if (!isnan(tt) && !isnan(t_base) && tt > 0) snprintf(ratio, sizeof ratio, "%.3f", t_base / tt);
        printf("{\"bench\":\"async\",\"config\":\"%s\",\"ok\":%s,\"cores\":%ld,\"steps\":%d,\"steps_per_hour\":%.0f,"
               "\"ratio_steps_per_hour_vs_colocated\":%.3f,\"start_val_accuracy\":%.3f,"
               "\"final_val_accuracy_mean3\":%.3f,\"val_accuracy_mean3_at_colocated_end_s\":%.3f,"
               "\"seconds_to_colocated_final_accuracy\":%s,\"ratio_time_to_accuracy\":%s,"
               "\"wall_s\":%.1f,\"val_curve\":%s}\n",
               r->name, r->ok ? "true" : "false", cores, r->steps, r->steps_per_hour,
               base->steps_per_hour > 0 ? r->steps_per_hour / base->steps_per_hour : 0.0,
               r->n_pts ? r->acc[0] : -1.0, r->n_pts ? smooth(r, r->n_pts - 1) : -1.0,
               acc_at(r, t_end), tts, ratio, r->wall_s, curve);
        fflush(stdout);
    }
    return 0;
}
