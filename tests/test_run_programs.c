/* Programs started by rlflow (controller/programs.h, reward.programs):
 *   - the supervisor alone: a program that keeps exiting is restarted max_restarts times, then
 *     the error names it, its exit status (or signal) and its log's last line; the environment
 *     and rank reach each program; a program not in PATH is refused by name; stop ends a
 *     program that ignores SIGTERM and its children (SIGKILL to its process group);
 *   - the recipe: bad reward.programs values and reward.rules = [] without a reward source are
 *     refused with exact messages; reward.programs survives a dump and reload;
 *   - rlflow run with a Python reward program it starts (tests/tools/reward_program_started.py,
 *     the client library with no endpoint given): every training sample of every step is scored
 *     exactly once and reward/mean equals the mean of what the program returned (rules = []),
 *     samples.jsonl shows the program's part as the component "external" and the components
 *     add up to the reward,
 *     validation uses the program too (val/reward); a program that exits after 20 requests is
 *     restarted and still no sample is lost or scored twice; a program that keeps exiting stops
 *     the run naming it and its exit status; no program is left running after a run, after
 *     SIGTERM to rlflow, nor after SIGKILL to rlflow (PR_SET_PDEATHSIG); a split run's
 *     controller process starts the program the same way. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "controller/programs.h"
#include "controller/recipe.h"
#include "test_shell.h"
#include "run_util.h"
#include "spawn_util.h"

static char dir[256];

/* Polls p until it fails (or limit_s passes); returns the status. */
static rf_status poll_until_error(rf_programs *p, double limit_s) {
    double end = rf_time_now() + limit_s;
    rf_status st = RF_OK;
    while (st == RF_OK && rf_time_now() < end) {
        st = rf_programs_poll(p);
        nanosleep(&(struct timespec){0, 10000000L}, NULL);
    }
    return st;
}

/* Live processes of process group g (zombies left out: an orphan reparented to a PID 1 that
 * does not reap keeps its group while it is a zombie, but runs nothing). */
static int group_alive(pid_t g) {
    char *out = NULL;
    rf_test_sh(&out, "ps -eo pgid=,stat= | awk '$1 == %d && $2 !~ /^Z/' | wc -l", (int)g);
    int n = out ? atoi(out) : -1;
    free(out);
    return n;
}

static int count_in(const char *text, const char *needle) {
    int n = 0;
    for (const char *s = text; (s = strstr(s, needle)); s += strlen(needle)) n++;
    return n;
}

static void test_restart_limit(void) {
    const char *a0[] = {"sh", "-c", "echo bye; exit 3", NULL};
    const char *const *argv[] = {a0};
    rf_programs_config c = {.key = "test.programs", .restarts_key = "test.restarts", .argv = argv, .n = 1,
                            .log_dir = dir, .log_prefix = "limit", .max_restarts = 2, .backoff_s = 0.02};
    rf_programs *p;
    CHECK_OK(rf_programs_start(&p, &c));
    rf_status st = poll_until_error(p, 20);
    CHECK(st == RF_ERR_IO);
    CHECK(rf_programs_restarts(p, 0) == 2);
    char want[600];
    snprintf(want, sizeof want, ") exited with status 3 after 2 restarts, the limit (test.restarts = 2); its output "
             "is in %s/limit_0.log, last line: bye", dir);
    const char *msg = rf_error_message();
    CHECK(strncmp(msg, "test.programs[0] (sh -c echo bye; exit 3, pid ", 46) == 0);
    CHECK(strlen(msg) > strlen(want) && strcmp(msg + strlen(msg) - strlen(want), want) == 0);
    if (!strstr(msg, want)) fprintf(stderr, "got: %s\nwant: ...%s\n", msg, want);
    rf_programs_stop(p);
    char path[512];
    snprintf(path, sizeof path, "%s/limit_0.log", dir);
    char *log = rf_test_slurp(path);
    CHECK(count_in(log, "bye\n") == 3); /* started, restarted twice */
    CHECK(count_in(log, "[rlflow] test.programs[0]: starting sh -c echo bye; exit 3 again\n") == 2);
    free(log);

    /* killed by a signal: named as such */
    const char *a1[] = {"sh", "-c", "kill -9 $$", NULL};
    const char *const *argv1[] = {a1};
    c.argv = argv1, c.max_restarts = 0, c.log_prefix = "signal";
    CHECK_OK(rf_programs_start(&p, &c));
    CHECK(poll_until_error(p, 20) == RF_ERR_IO);
    snprintf(want, sizeof want, ") was killed by signal 9 (Killed) after 0 restarts, the limit (test.restarts = 0); "
             "its output is in %s/signal_0.log", dir);
    msg = rf_error_message();
    CHECK(strlen(msg) > strlen(want) && strcmp(msg + strlen(msg) - strlen(want), want) == 0);
    if (!strstr(msg, want)) fprintf(stderr, "got: %s\nwant: ...%s\n", msg, want);
    rf_programs_stop(p);
}

/* The caller's variables and the rank reach every program; a program rlflow's own environment
 * names too gets the caller's value. */
static void test_environment(void) {
    setenv("RLFLOW_TEST_X", "from rlflow", 1);
    /* ls lists its own descriptors: 0, 1, 2 and 3 (the directory it reads), nothing inherited */
    const char *a0[] = {"sh", "-c", "printf 'x=%s rank=%s fds=' \"$RLFLOW_TEST_X\" \"$RLFLOW_TEST_RANK\"; "
                        "ls /proc/self/fd | tr '\\n' ' '; echo; sleep 30", NULL};
    FILE *open_here = fopen("/dev/null", "r"); /* not close-on-exec: the programs must not get it */
    const char *const *argv[] = {a0, a0};
    const char *env[] = {"RLFLOW_TEST_X=given"};
    rf_programs_config c = {.key = "env.programs", .argv = argv, .n = 2, .env = env, .n_env = 1,
                            .rank_var = "RLFLOW_TEST_RANK", .log_dir = dir, .log_prefix = "env", .max_restarts = 0,
                            .grace_s = 2};
    rf_programs *p;
    CHECK_OK(rf_programs_start(&p, &c));
    pid_t pid1 = rf_programs_pid(p, 1);
    CHECK(pid1 > 0);
    nanosleep(&(struct timespec){0, 300000000L}, NULL);
    CHECK_OK(rf_programs_poll(p)); /* both still running */
    CHECK(group_alive(pid1) == 2);  /* sh and its sleep */
    double t = rf_time_now();
    rf_programs_stop(p);          /* sh ignores nothing: SIGTERM ends it and its sleep */
    CHECK(rf_time_now() - t < 2.0);
    CHECK(group_alive(pid1) == 0);
    if (open_here) fclose(open_here);
    for (int i = 0; i < 2; i++) {
        char path[512], want[64];
        snprintf(path, sizeof path, "%s/env_%d.log", dir, i);
        snprintf(want, sizeof want, "x=given rank=%d fds=0 1 2 3 \n", i);
        char *log = rf_test_slurp(path);
        CHECK(strstr(log, want) != NULL);
        if (!strstr(log, want)) fprintf(stderr, "%s:\n%s\n", path, log);
        free(log);
    }
}

/* A program that ignores SIGTERM, with a child that inherits that: SIGKILL to the group after
 * the grace period, nothing left. */
static void test_stop_stubborn(void) {
    const char *a0[] = {"sh", "-c", "trap '' TERM; sleep 60 & wait", NULL};
    const char *const *argv[] = {a0};
    rf_programs_config c = {.key = "stub.programs", .argv = argv, .n = 1, .log_dir = dir, .log_prefix = "stub",
                            .grace_s = 0.3};
    rf_programs *p;
    CHECK_OK(rf_programs_start(&p, &c));
    pid_t pid = rf_programs_pid(p, 0);
    nanosleep(&(struct timespec){0, 200000000L}, NULL);
    CHECK(group_alive(pid) == 2);
    double t = rf_time_now();
    rf_programs_stop(p);
    double took = rf_time_now() - t;
    CHECK(took > 1.2 && took < 5.0); /* 1 s to leave on its own, 0.3 s after SIGTERM, then SIGKILL */
    CHECK(group_alive(pid) == 0);
}

static void test_not_found(void) {
    const char *a0[] = {"sh", "-c", "sleep 30", NULL}, *a1[] = {"no_such_program_rf", "x.py", NULL};
    const char *const *argv[] = {a0, a1};
    rf_programs_config c = {.key = "reward.programs", .argv = argv, .n = 2, .log_dir = dir, .log_prefix = "nf"};
    rf_programs *p = (rf_programs *)1;
    CHECK(rf_programs_start(&p, &c) == RF_ERR_IO);
    CHECK(p == NULL);
    CHECK(strcmp(rf_error_message(), "reward.programs[1] (no_such_program_rf x.py): cannot run "
                                     "\"no_such_program_rf\": not found in PATH") == 0);
    fprintf(stderr, "not found: %s\n", rf_error_message());
}

/* ---- the recipe ---------------------------------------------------------------------- */

static void refused(const char *set, const char *want) {
    rf_recipe r;
    const char *ov[] = {set};
    rf_status st = rf_recipe_load(&r, NULL, ov, 1);
    CHECK(st == RF_ERR_ARG);
    CHECK(strcmp(rf_error_message(), want) == 0);
    if (strcmp(rf_error_message(), want) != 0) fprintf(stderr, "%s\n  got:  %s\n  want: %s\n", set, rf_error_message(), want);
    if (st == RF_OK) rf_recipe_free(&r);
}

static void test_recipe(void) {
    refused("reward.programs=\"python3\"", "--set: reward.programs: expected an array of string arrays, got a string");
    refused("reward.programs=[\"python3\", \"x.py\"]",
            "--set: reward.programs[0]: expected an array of strings (a program and its arguments), got a string");
    refused("reward.programs=[[\"python3\", \"x.py\"], []]",
            "--set: reward.programs[1]: is empty: give the program and its arguments, e.g. [\"python3\", \"my_reward.py\"]");
    refused("reward.programs=[[\"python3\", 3]]", "--set: reward.programs[0][1]: expected a string, got an integer");
    refused("reward.programs=[[\"\"]]", "--set: reward.programs[0][0]: the program's name is empty");
    refused("reward.program_restarts=-1", "--set: reward.program_restarts = -1: must be >= 0");
    refused("reward.rules=[]", "--set: reward.rules = []: no reward at all: an empty list needs reward.programs, "
            "reward.external or reward.model to give the rewards");
    /* from a file: the position of the bad item */
    char path[512];
    snprintf(path, sizeof path, "%s/bad.toml", dir);
    FILE *f = fopen(path, "w");
    fputs("[reward]\nrules = []\nprograms = [[\"python3\", \"a.py\"], [\"python3\", false]]\n", f);
    fclose(f);
    rf_recipe r;
    CHECK(rf_recipe_load(&r, path, NULL, 0) == RF_ERR_ARG);
    char want[700];
    snprintf(want, sizeof want, "%s:3:46: reward.programs[1][1]: expected a string, got a boolean", path);
    CHECK(strcmp(rf_error_message(), want) == 0);
    if (strcmp(rf_error_message(), want)) fprintf(stderr, "got %s\nwant %s\n", rf_error_message(), want);
    /* accepted: rules = [] with a program; a dump reads back the same argv */
    const char *ok[] = {"reward.rules=[]", "reward.programs=[[\"python3\", \"a b.py\", \"--x=\\\"q\\\"\"], [\"./judge\"]]"};
    CHECK_OK(rf_recipe_load(&r, NULL, ok, 2));
    CHECK(r.reward.programs.n == 2 && r.reward.programs.v[0].n == 3 && r.reward.programs.v[1].n == 1);
    CHECK(r.reward.program_restarts == 3);
    snprintf(path, sizeof path, "%s/dump.toml", dir);
    f = fopen(path, "w");
    CHECK_OK(rf_recipe_dump(&r, f));
    fclose(f);
    rf_recipe back;
    CHECK_OK(rf_recipe_load(&back, path, NULL, 0));
    CHECK(back.reward.programs.n == 2 && back.reward.programs.v[0].n == 3 &&
          strcmp(back.reward.programs.v[0].v[2], "--x=\"q\"") == 0 && strcmp(back.reward.programs.v[1].v[0], "./judge") == 0);
    rf_recipe_free(&back);
    rf_recipe_free(&r);
}

/* ---- rlflow run ---------------------------------------------------------------------- */

static const char *py, *rlflow, *src;

static const char *find_python(void) {
    static const char *cands[] = {"python3", "/usr/bin/python3"};
    for (int i = 0; i < 2; i++)
        if (rf_test_sh(NULL, "%s -c 'import zmq, google.protobuf' >/dev/null 2>&1", cands[i]) == 0) return cands[i];
    return NULL;
}

static void write_recipe(const char *extra) {
    char p[512];
    snprintf(p, sizeof p, "%s/r.toml", dir);
    FILE *f = fopen(p, "w");
    fprintf(f, "[model]\npath = \"%s/m\"\ninit_preset = \"tiny\"\n"
               "[data]\ntask = \"arith\"\ntask_train = 200\ntask_val = 8\n"
               "train = \"%s/data/train.jsonl\"\nval = \"%s/data/val.jsonl\"\n"
               "[rollout]\nn = 4\nprompts_per_step = 4\nmax_new_tokens = 4\n"
               "[algorithm]\nname = \"grpo\"\n[train]\nsteps = 3\n"
               "[logging]\nval_every = 1000\nval_size = 8\n%s", /* step 0 and the last */
            dir, dir, dir, extra);
    fclose(f);
}

/* Lines "pid id group index reward rank" of the program's log. */
typedef struct line { long pid; long long id, group, index; double reward; } line;

static int read_lines(const char *path, line *v, int cap) {
    FILE *f = fopen(path, "r");
    int n = 0;
    char rank[16];
    while (f && n < cap && fscanf(f, "%ld %lld %lld %lld %lf %15s", &v[n].pid, &v[n].id, &v[n].group, &v[n].index,
                                  &v[n].reward, rank) == 6) {
        CHECK(strcmp(rank, "0") == 0);
        n++;
    }
    if (f) fclose(f);
    return n;
}

static int by_id(const void *a, const void *b) {
    long long x = ((const line *)a)->id, y = ((const line *)b)->id;
    return x < y ? -1 : x > y;
}

/* Every training request the program answered, in request order, is one step's batch per 16
 * (4 groups x 4 samples, each exactly once), and its mean is the step's reward/mean; the
 * validation answers before training (group -1) give val/reward at step 0. Returns the number
 * of distinct program pids seen. */
static int check_scores(const char *run, const char *plog, int steps) {
    static line all[512], train[512], val[512];
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, plog);
    int n = read_lines(p, all, 512), nt = 0, nv = 0, pids = 0;
    long seen[8] = {0};
    for (int i = 0; i < n; i++) {
        if (all[i].group >= 0) train[nt++] = all[i];
        else val[nv++] = all[i];
        int k = 0;
        while (k < pids && seen[k] != all[i].pid) k++;
        if (k == pids && pids < 8) seen[pids++] = all[i].pid;
    }
    qsort(train, (size_t)nt, sizeof *train, by_id);
    qsort(val, (size_t)nv, sizeof *val, by_id);
    CHECK(nt == steps * 16);
    for (int s = 0; s < steps && (s + 1) * 16 <= nt; s++) {
        int got[4][4] = {{0}};
        double sum = 0;
        for (int i = s * 16; i < (s + 1) * 16; i++) { /* group ids: admission ids, 4 a step */
            long long g = train[i].group - s * 4;
            if (g >= 0 && g < 4 && train[i].index < 4) got[g][train[i].index]++;
            sum += train[i].reward;
        }
        for (int g = 0; g < 4; g++)
            for (int j = 0; j < 4; j++) CHECK(got[g][j] == 1);
        double m = rf_test_metric(dir, run, s + 1, "reward/mean");
        printf("%s step %d: reward/mean %.9f, the program's mean %.9f\n", run, s + 1, m, sum / 16);
        CHECK(fabs(m - sum / 16) < 1e-6);
    }
    /* before training and after the last step: 8 greedy responses each */
    CHECK(nv == 16);
    double vs = 0;
    for (int i = 0; i < 8 && i < nv; i++) {
        vs += val[i].reward;
        CHECK(val[i].index == i);
    }
    double vm = rf_test_metric(dir, run, 0, "val/reward");
    printf("%s: val/reward at step 0 %.9f, the program's mean %.9f\n", run, vm, vs / 8);
    CHECK(fabs(vm - vs / 8) < 1e-6);
    return pids;
}

/* Processes running the test program with this directory in their command line. */
static int leftovers(void) {
    char *out = NULL;
    rf_test_sh(&out, "ps -eo args | grep -F 'reward_program_started.py --log %s/' | grep -v grep | wc -l", dir);
    int n = out ? atoi(out) : -1;
    free(out);
    return n;
}

/* samples.jsonl of run `run`: every sample's components hold "external" (the program's part)
 * and add up to its reward (docs/metrics.md). Returns the samples checked. */
static int check_sample_components(const char *run) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/samples.jsonl", dir, run);
    char *text = rf_test_slurp(p);
    int n = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(j, "components"), *e;
        double reward = cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(j, "reward")), sum = 0;
        cJSON_ArrayForEach(e, c) sum += cJSON_GetNumberValue(e);
        int ok = cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(c, "external")) && fabs(sum - reward) < 1e-5;
        CHECK(ok);
        if (!ok) fprintf(stderr, "  %s: components do not add up to the reward: %s\n", p, line);
        cJSON_Delete(j);
        n++;
    }
    free(text);
    return n;
}

static void run_scored(void) {
    char extra[1024];
    snprintf(extra, sizeof extra, "[reward]\nrules = []\nprograms = [[\"%s\", \"%s/tests/tools/reward_program_started.py\", "
             "\"--log\", \"%s/ok.txt\"]]\n", py, src, dir);
    write_recipe(extra);
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "ok", "--set logging.samples_every=1");
    CHECK(rc == 0);
    CHECK(out && strstr(out, "reward: CURVE on tcp://127.0.0.1:") && strstr(out, "with keys made for this run"));
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    CHECK(check_scores("ok", "ok.txt", 3) == 1);
    CHECK(check_sample_components("ok") == 3 * 4);  /* 4 samples per step (samples_per_step) */
    char p[512];
    snprintf(p, sizeof p, "%s/ok/reward_program_0.log", dir);
    char *log = rf_test_slurp(p);
    CHECK(strstr(log, "started: shutdown (the run is complete) after 64 requests") != NULL); /* 48 + 2 x 8 */
    free(log);
    CHECK(leftovers() == 0);
    /* --resume appends to the program's log; --overwrite removes it with the run's other files */
    const char *start = "[rlflow] reward.programs[0]: starting ";
    CHECK(rf_test_run_recipe(&out, dir, rlflow, "ok", "--resume --set train.steps=4") == 0);
    free(out);
    log = rf_test_slurp(p);
    CHECK(count_in(log, start) == 2);
    free(log);
    CHECK(rf_test_run_recipe(&out, dir, rlflow, "ok", "--overwrite --set train.steps=1") == 0);
    free(out);
    log = rf_test_slurp(p);
    CHECK(count_in(log, start) == 1);
    free(log);
    CHECK(leftovers() == 0);
}

static void run_restarted(void) {
    char extra[1024];
    snprintf(extra, sizeof extra, "[reward]\nrules = []\nprograms = [[\"%s\", \"%s/tests/tools/reward_program_started.py\", "
             "\"--log\", \"%s/re.txt\", \"--exit-after\", \"20\"]]\n", py, src, dir);
    write_recipe(extra);
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "re", "");
    CHECK(rc == 0);
    CHECK(out && strstr(out, "reward_program_started.py --log ") && strstr(out, "exited with status 5; restart 1 of 3 in 0.5 s"));
    if (rc || !strstr(out ? out : "", "restart 1 of 3")) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    /* 20 answers per process: 64 answers take four processes, three restarts */
    CHECK(check_scores("re", "re.txt", 3) == 4);
    double resent = 0;
    for (int s = 1; s <= 3; s++) resent += rf_test_metric(dir, "re", s, "reward/external/resent");
    CHECK(resent >= 1);
    CHECK(leftovers() == 0);
}

static void run_keeps_dying(void) {
    char extra[1024];
    snprintf(extra, sizeof extra, "[reward]\nrules = []\nprogram_restarts = 1\nprograms = [[\"%s\", "
             "\"%s/tests/tools/reward_program_started.py\", \"--log\", \"%s/dies.txt\", \"--exit-after\", \"0\"]]\n",
             py, src, dir);
    write_recipe(extra);
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "dies", "");
    CHECK(rc != 0);
    char want[1024];
    snprintf(want, sizeof want, ") exited with status 5 after 1 restart, the limit (reward.program_restarts = 1); its "
             "output is in %s/dies/reward_program_0.log, last line: reward_program_started: exiting after 0 requests", dir);
    char head[1024];
    snprintf(head, sizeof head, "error: reward.programs[0] (%s %s/tests/tools/reward_program_started.py --log %s/dies.txt "
             "--exit-after 0, pid ", py, src, dir);
    CHECK(out && strstr(out, want) && strstr(out, head));
    if (!out || !strstr(out, want) || !strstr(out, head)) fprintf(stderr, "want %s...%s in:\n%s\n", head, want, out ? out : "");
    free(out);
    CHECK(leftovers() == 0);
}

/* A program that never connects: the run stops after reward.external_timeout naming the
 * count, the endpoint and where the programs' output is. */
static void run_never_connects(void) {
    char extra[600];
    snprintf(extra, sizeof extra, "[reward]\nrules = []\nexternal_timeout = 1.5\nprograms = [[\"sleep\", \"30.0417\"]]\n");
    write_recipe(extra);
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "never", "");
    CHECK(rc != 0);
    char want[600];
    snprintf(want, sizeof want, " within 1.5 s (reward.external_timeout); a program's output is in "
             "%s/never/reward_program_<i>.log\n", dir);
    CHECK(out && strstr(out, "error: reward.programs: 0 of the 1 program rlflow started connected to tcp://127.0.0.1:") &&
          strstr(out, want));
    if (!out || !strstr(out, want)) fprintf(stderr, "want ...%s in:\n%s\n", want, out ? out : "");
    free(out);
    /* the sleep was stopped with the run */
    CHECK(rf_test_sh(NULL, "ps -eo args= | grep -qx 'sleep 30.0417'") != 0);
}

/* Two programs, the Python one and the C client's length_judge (build/length_judge, no
 * option): each reads its endpoint, CURVE keys and rank from the environment. */
static void run_two_programs(void) {
    const char *judge = getenv("RF_LENGTH_JUDGE");
    if (!judge) {
        printf("test_run_programs: the C program part skipped: RF_LENGTH_JUDGE not set\n");
        return;
    }
    char extra[1200];
    snprintf(extra, sizeof extra, "[reward]\nrules = []\nprograms = [[\"%s\", \"%s/tests/tools/reward_program_started.py\", "
             "\"--log\", \"%s/two.txt\"], [\"%s\"]]\n", py, src, dir, judge);
    write_recipe(extra);
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "two", "--set train.steps=2");
    CHECK(rc == 0);
    CHECK(out && strstr(out, "reward program 'started' (rank 0, pid ") && strstr(out, "reward program 'length_judge' (rank 1, pid "));
    if (rc || !out || !strstr(out, "'length_judge' (rank 1")) fprintf(stderr, "%s\n", out ? out : "");
    const char *at = out ? strstr(out, "'length_judge' (rank 1, pid ") : NULL;
    int judge_pid = at ? atoi(at + strlen("'length_judge' (rank 1, pid ")) : 0;
    CHECK(judge_pid > 0 && group_alive(judge_pid) == 0); /* its process group is its pid */
    free(out);
    char p[512];
    snprintf(p, sizeof p, "%s/two/reward_program_1.log", dir);
    char *log = rf_test_slurp(p);
    CHECK(strstr(log, "length_judge: connected to tcp://127.0.0.1:") && strstr(log, " with CURVE (protocol 1"));
    free(log);
    CHECK(leftovers() == 0);
}

/* reward.external with CURVE key files and a started program: rlflow adds a key pair made for
 * the run to the allowed keys and gives the program its server public key (derived from the
 * secret key file); the program connects and scores. */
static void run_curve_files(void) {
    char *out = NULL;
    CHECK(rf_test_sh(&out, "cd %s && %s keygen --out rlflow_srv && %s keygen --out someone && cp someone.pub allowed",
                     dir, rlflow, rlflow) == 0);
    free(out);
    char extra[1200];
    snprintf(extra, sizeof extra, "[reward]\nrules = []\nexternal = \"tcp://127.0.0.1:*\"\n"
             "external_curve_secret = \"%s/rlflow_srv.key\"\nexternal_curve_clients = \"%s/allowed\"\n"
             "programs = [[\"%s\", \"%s/tests/tools/reward_program_started.py\", \"--log\", \"%s/curve.txt\"]]\n",
             dir, dir, py, src, dir);
    write_recipe(extra);
    int rc = rf_test_run_recipe(&out, dir, rlflow, "curve", "--set train.steps=1");
    CHECK(rc == 0);
    CHECK(out && strstr(out, "1 allowed program key from ") && strstr(out, "/allowed and the programs rlflow starts"));
    if (rc || !out || !strstr(out, "and the programs rlflow starts")) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    static line v[128];
    char p[512];
    snprintf(p, sizeof p, "%s/curve.txt", dir);
    int n = read_lines(p, v, 128), nt = 0;
    for (int i = 0; i < n; i++) nt += v[i].group >= 0;
    CHECK(nt == 16);
    CHECK(leftovers() == 0);
}

/* rlflow stopped by a signal while its program runs: SIGTERM (a checkpoint, then the programs
 * stopped) and SIGKILL (the programs get SIGTERM from the kernel: PR_SET_PDEATHSIG). */
static void run_signalled(int sig) {
    char extra[1024], logarg[300], run[32];
    snprintf(run, sizeof run, "sig%d", sig);
    snprintf(logarg, sizeof logarg, "%s/%s.txt", dir, run);
    snprintf(extra, sizeof extra, "[reward]\nrules = []\nprograms = [[\"%s\", \"%s/tests/tools/reward_program_started.py\", "
             "\"--log\", \"%s\"]]\n", py, src, logarg);
    write_recipe(extra);
    char rpath[512], ldir[512], out_path[512];
    snprintf(rpath, sizeof rpath, "%s/r.toml", dir);
    snprintf(ldir, sizeof ldir, "logging.dir=%s/%s", dir, run);
    snprintf(out_path, sizeof out_path, "%s/%s.out", dir, run);
    char *argv[] = {(char *)rlflow, "run", rpath, "--set", ldir, "--set", "train.steps=100000", NULL};
    pid_t pid = rf_test_spawn(argv, out_path);
    CHECK(pid > 0);
    struct stat st;
    for (int i = 0; i < 6000 && (stat(logarg, &st) != 0 || st.st_size == 0); i++)
        nanosleep(&(struct timespec){0, 10000000L}, NULL);
    CHECK(stat(logarg, &st) == 0 && st.st_size > 0); /* the program is scoring */
    CHECK(leftovers() == 1);
    kill(pid, sig);
    int rc = rf_test_wait(pid, 60);
    CHECK(rc == 128 + sig);
    for (int i = 0; i < 500 && leftovers() != 0; i++) nanosleep(&(struct timespec){0, 10000000L}, NULL);
    CHECK(leftovers() == 0);
    if (sig == SIGTERM) {
        char *o = rf_test_slurp(out_path);
        CHECK(strstr(o, "interrupted at step") != NULL);
        free(o);
    }
}

/* A split run (controller, training and rollout workers under mpirun): the controller process
 * starts the program; every one of the 12 groups x 4 samples is scored exactly once, the
 * steps' reward/mean average to the program's mean, validation uses the program too, and
 * nothing is left running. Skipped without mpirun. */
static void run_split(void) {
    if (rf_test_sh(NULL, "command -v mpirun >/dev/null") != 0) {
        printf("test_run_programs: split part skipped: mpirun not found\n");
        return;
    }
    char extra[1024];
    snprintf(extra, sizeof extra, "[placement]\nmode = \"split\"\n[reward]\nrules = []\nprograms = [[\"%s\", "
             "\"%s/tests/tools/reward_program_started.py\", \"--log\", \"%s/split.txt\"]]\n", py, src, dir);
    write_recipe(extra);
    char *out = NULL;
    int rc = rf_test_run_recipe(&out, dir, rlflow, "split", "");
    CHECK(rc == 0);
    if (rc) fprintf(stderr, "%s\n", out ? out : "");
    free(out);
    static line v[512];
    char p[512];
    snprintf(p, sizeof p, "%s/split.txt", dir);
    int n = read_lines(p, v, 512), nt = 0, nv = 0;
    double train = 0, val = 0;
    for (int i = 0; i < n; i++) {
        if (v[i].group < 0) {
            if (nv++ < 8) val += v[i].reward;
            continue;
        }
        nt++, train += v[i].reward;
        for (int j = 0; j < i; j++) CHECK(!(v[j].group == v[i].group && v[j].index == v[i].index));
        CHECK(v[i].index >= 0 && v[i].index < 4);
    }
    CHECK(nt == 48 && nv == 16);
    double steps = 0;
    for (int s = 1; s <= 3; s++) steps += rf_test_metric(dir, "split", s, "reward/mean");
    printf("split: mean of the steps' reward/mean %.9f, the program's mean %.9f\n", steps / 3, train / 48);
    CHECK(fabs(steps / 3 - train / 48) < 1e-6);
    /* the validation at version 0 is logged with step 0's metrics, as in one process */
    CHECK(rf_test_metric(dir, "split", 0, "val/version") == 0);
    CHECK(fabs(rf_test_metric(dir, "split", 0, "val/reward") - val / 8) < 1e-6);
    CHECK(leftovers() == 0);
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/rf_test_run_programs_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    test_restart_limit();
    test_environment();
    test_stop_stubborn();
    test_not_found();
    test_recipe();
    rlflow = getenv("RF_RLFLOW"), src = getenv("RF_SOURCE_DIR"), py = find_python();
    if (rlflow && src && py) {
        run_scored();
        run_restarted();
        run_keeps_dying();
        run_curve_files();
        run_two_programs();
        run_never_connects();
        run_signalled(SIGTERM);
        run_signalled(SIGKILL);
        run_split();
    } else {
        printf("test_run_programs: rlflow runs skipped (RF_RLFLOW, RF_SOURCE_DIR or a python3 with zmq and protobuf "
               "missing)\n");
    }
    rf_test_sh(NULL, "rm -rf %s", dir);
    printf("test_run_programs: %d passed, %d failed\n", rf_test_passed, rf_test_failed);
    return rf_test_failed ? 1 : 0;
}
