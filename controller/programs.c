/* Programs started by rlflow (controller/programs.h). */
#define _GNU_SOURCE
#include "controller/programs.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "common/log.h"
#include "common/util.h"

extern char **environ;

#define MAX_BACKOFF_S 8.0
#define EXIT_WAIT_S 1.0 /* rf_programs_stop: time to leave on their own before SIGTERM */

typedef struct prog {
    char **argv;      /* (argc + 1) owned copy, NULL-terminated */
    char *path;       /* argv[0] resolved against PATH */
    char *log;        /* <log_dir>/<prefix>_<i>.log */
    char desc[256];   /* "python3 judge.py", for messages */
    char rank_env[96]; /* "<rank_var>=<i>" */
    pid_t pid;        /* 0: not running */
    int restarts;
    double restart_at; /* > 0: start again at this time */
} prog;

struct rf_programs {
    prog *v;
    int n;
    char **envp;      /* rlflow's environment with the caller's variables, a slot for the rank */
    int rank_slot;    /* index of that slot, -1 without rank_var */
    char key[64], restarts_key[64];
    int max_restarts;
    double backoff_s, grace_s;
    int failed;       /* rf_programs_poll returned an error */
};

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* argv[0] as execve needs it: as given when it holds a '/', else the first executable file of
 * that name in PATH. NULL (message set) when there is none. */
static char *resolve(const char *key, int i, const char *desc, const char *name) {
    if (strchr(name, '/')) {
        if (access(name, X_OK) == 0) return rf_strdup(name);
        rf_error(RF_ERR_IO, "%s[%d] (%s): cannot run \"%s\": %s", key, i, desc, name, strerror(errno));
        return NULL;
    }
    const char *path = getenv("PATH");
    if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
    for (const char *p = path; *p;) {
        size_t len = strcspn(p, ":");
        char cand[4096];
        snprintf(cand, sizeof cand, "%.*s/%s", (int)(len ? len : 1), len ? p : ".", name);
        struct stat st;
        if (stat(cand, &st) == 0 && S_ISREG(st.st_mode) && access(cand, X_OK) == 0) return rf_strdup(cand);
        p += len + (p[len] == ':');
    }
    rf_error(RF_ERR_IO, "%s[%d] (%s): cannot run \"%s\": not found in PATH", key, i, desc, name);
    return NULL;
}

/* "python3 judge.py --x": the words joined by blanks, cut at the buffer's size. */
static void describe(char *out, size_t cap, const char *const *argv) {
    size_t n = 0;
    out[0] = '\0';
    for (int k = 0; argv[k] && n + 1 < cap; k++)
        n += (size_t)snprintf(out + n, cap - n, "%s%s", k ? " " : "", argv[k]);
    if (n >= cap && cap > 4) memcpy(out + cap - 4, "...", 4);
}

/* The name part of "NAME=value" (its length). */
static size_t name_len(const char *kv) { return strcspn(kv, "="); }

static int overridden(const char *kv, const rf_programs_config *c) {
    for (int k = 0; k < c->n_env; k++)
        if (name_len(c->env[k]) == name_len(kv) && strncmp(c->env[k], kv, name_len(kv)) == 0) return 1;
    return c->rank_var && strlen(c->rank_var) == name_len(kv) && strncmp(c->rank_var, kv, name_len(kv)) == 0;
}

/* environ without the variables the caller sets, then the caller's, then the rank slot. */
static rf_status build_env(rf_programs *p, const rf_programs_config *c) {
    int n = 0;
    while (environ && environ[n]) n++;
    p->envp = rf_calloc((size_t)(n + c->n_env + 2), sizeof *p->envp);
    if (!p->envp) return rf_error(RF_ERR_NOMEM, "out of memory");
    int k = 0;
    for (int i = 0; i < n; i++)
        if (!overridden(environ[i], c) && !(p->envp[k++] = rf_strdup(environ[i]))) return RF_ERR_NOMEM;
    for (int i = 0; i < c->n_env; i++) {
        if (!strchr(c->env[i], '='))
            return rf_error(RF_ERR_ARG, "%s: environment entry \"%s\" is not NAME=value", c->key, c->env[i]);
        if (!(p->envp[k++] = rf_strdup(c->env[i]))) return RF_ERR_NOMEM;
    }
    p->rank_slot = c->rank_var ? k : -1;
    return RF_OK;
}

/* Closes every descriptor but 0, 1, 2 and keep: rlflow's own files and sockets (MPI's, a
 * checkpoint being written) must not live on in a program. */
static void close_others(int keep) {
#ifdef __linux__
    if (keep > 3 && close_range(3, (unsigned)keep - 1, 0) == 0 && close_range((unsigned)keep + 1, ~0U, 0) == 0) return;
#endif
    for (int fd = 3; fd < 4096; fd++)
        if (fd != keep) close(fd);
}

/* The child between fork and exec: only async-signal-safe calls. Never returns. */
static void child(const prog *g, char **envp, int log_fd, int null_fd, int err_fd, pid_t parent) {
    setpgid(0, 0);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127); /* rlflow died before prctl */
#else
    (void)parent;
#endif
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int s = 1; s < 32; s++)
        if (s != SIGKILL && s != SIGSTOP) sigaction(s, &dfl, NULL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (dup2(null_fd, 0) < 0 || dup2(log_fd, 1) < 0 || dup2(log_fd, 2) < 0) {
        int e = errno;
        if (write(err_fd, &e, sizeof e) < 0) _exit(127);
        _exit(127);
    }
    close_others(err_fd);
    execve(g->path, g->argv, envp);
    int e = errno;
    if (write(err_fd, &e, sizeof e) < 0) _exit(127);
    _exit(127);
}

/* Starts program i (its log opened for appending, a line saying so written first). */
static rf_status spawn(rf_programs *p, int i) {
    prog *g = &p->v[i];
    int log_fd = open(g->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) return rf_error(RF_ERR_IO, "%s[%d]: cannot open its log %s: %s", p->key, i, g->log, strerror(errno));
    int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC), fds[2] = {-1, -1};
    if (null_fd < 0 || pipe2(fds, O_CLOEXEC) != 0) {
        int e = errno;
        close(log_fd);
        if (null_fd >= 0) close(null_fd);
        return rf_error(RF_ERR_IO, "%s[%d]: %s", p->key, i, strerror(e));
    }
    dprintf(log_fd, "[rlflow] %s[%d]: starting %s%s\n", p->key, i, g->desc, g->restarts ? " again" : "");
    if (p->rank_slot >= 0) p->envp[p->rank_slot] = g->rank_env;
    pid_t parent = getpid(), pid = fork();
    if (pid == 0) child(g, p->envp, log_fd, null_fd, fds[1], parent);
    int fork_errno = errno;
    close(fds[1]), close(log_fd), close(null_fd);
    if (pid < 0) {
        close(fds[0]);
        return rf_error(RF_ERR_IO, "%s[%d] (%s): fork: %s", p->key, i, g->desc, strerror(fork_errno));
    }
    setpgid(pid, pid); /* also here: a kill of the group must not race the child's own call */
    int e = 0;
    ssize_t got;
    while ((got = read(fds[0], &e, sizeof e)) < 0 && errno == EINTR) {
    }
    close(fds[0]);
    if (got == (ssize_t)sizeof e) { /* exec failed: the child is gone already */
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
        }
        return rf_error(RF_ERR_IO, "%s[%d] (%s): cannot run \"%s\": %s", p->key, i, g->desc, g->path, strerror(e));
    }
    g->pid = pid;
    rf_log_info("%s[%d]: started %s (pid %d; its output goes to %s)", p->key, i, g->desc, (int)pid, g->log);
    return RF_OK;
}

static rf_status copy_prog(rf_programs *p, const rf_programs_config *c, int i) {
    prog *g = &p->v[i];
    const char *const *a = c->argv[i];
    int argc = 0;
    while (a && a[argc]) argc++;
    if (argc == 0 || !a[0][0])
        return rf_error(RF_ERR_ARG, "%s[%d]: the program's argv is empty", c->key, i);
    describe(g->desc, sizeof g->desc, a);
    if (!(g->argv = rf_calloc((size_t)argc + 1, sizeof *g->argv))) return RF_ERR_NOMEM;
    for (int k = 0; k < argc; k++)
        if (!(g->argv[k] = rf_strdup(a[k]))) return RF_ERR_NOMEM;
    char log[4200];
    snprintf(log, sizeof log, "%s/%s_%d.log", c->log_dir, c->log_prefix ? c->log_prefix : "program", i);
    if (!(g->log = rf_strdup(log))) return RF_ERR_NOMEM;
    if (c->rank_var) snprintf(g->rank_env, sizeof g->rank_env, "%s=%d", c->rank_var, i);
    if (!(g->path = resolve(c->key, i, g->desc, a[0]))) return RF_ERR_IO;
    return RF_OK;
}

rf_status rf_programs_start(rf_programs **out, const rf_programs_config *c) {
    *out = NULL;
    if (!c || c->n < 0 || (c->n > 0 && !c->argv) || c->max_restarts < 0 || !c->log_dir)
        return rf_error(RF_ERR_ARG, "rf_programs_start: bad configuration");
    rf_programs *p = rf_calloc(1, sizeof *p);
    if (!p || (c->n && !(p->v = rf_calloc((size_t)c->n, sizeof *p->v)))) {
        free(p);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    snprintf(p->key, sizeof p->key, "%s", c->key ? c->key : "programs");
    snprintf(p->restarts_key, sizeof p->restarts_key, "%s", c->restarts_key ? c->restarts_key : "max_restarts");
    p->max_restarts = c->max_restarts;
    p->backoff_s = c->backoff_s > 0 ? c->backoff_s : 0.5;
    p->grace_s = c->grace_s > 0 ? c->grace_s : 5.0;
    rf_status st = build_env(p, c);
    if (st == RF_OK && c->n) st = rf_mkdirs(c->log_dir);
    for (int i = 0; st == RF_OK && i < c->n; i++) {
        p->n = i + 1; /* a half-copied program is freed with the others */
        st = copy_prog(p, c, i);
    }
    for (int i = 0; st == RF_OK && i < p->n; i++) st = spawn(p, i);
    if (st != RF_OK) {
        char msg[2048];
        snprintf(msg, sizeof msg, "%s", rf_error_message());
        rf_programs_stop(p);
        return rf_error(st, "%s", msg[0] ? msg : "out of memory starting the programs");
    }
    *out = p;
    return RF_OK;
}

/* "exited with status 3", "was killed by signal 9 (Killed)". */
static void status_text(int ws, char *out, size_t cap) {
    if (WIFEXITED(ws)) snprintf(out, cap, "exited with status %d", WEXITSTATUS(ws));
    else if (WIFSIGNALED(ws)) snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(ws), strsignal(WTERMSIG(ws)));
    else snprintf(out, cap, "stopped (wait status %d)", ws);
}

/* The last line of the program's own output in its log (lines rlflow wrote left out). */
static void last_line(const char *log, char *out, size_t cap) {
    out[0] = '\0';
    FILE *f = fopen(log, "rb");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = '\0';
        size_t len = strlen(line);
        if (!len || strncmp(line, "[rlflow] ", 9) == 0) continue;
        if (len >= cap) len = cap - 1;
        memcpy(out, line, len);
        out[len] = '\0';
    }
    fclose(f);
}

/* Program i exited with wait status ws: scheduled for a restart, or the error. */
static rf_status on_exit_status(rf_programs *p, int i, int ws) {
    prog *g = &p->v[i];
    pid_t pid = g->pid;
    kill(-pid, SIGKILL); /* what it left behind in its process group */
    g->pid = 0;
    char how[128];
    status_text(ws, how, sizeof how);
    if (g->restarts >= p->max_restarts) {
        char last[512];
        last_line(g->log, last, sizeof last);
        return rf_error(RF_ERR_IO, "%s[%d] (%s, pid %d) %s after %d restart%s, the limit (%s = %d); its output is in %s%s%s",
                        p->key, i, g->desc, (int)pid, how, g->restarts, g->restarts == 1 ? "" : "s",
                        p->restarts_key, p->max_restarts, g->log, last[0] ? ", last line: " : "", last);
    }
    double delay = p->backoff_s;
    for (int k = 0; k < g->restarts && delay < MAX_BACKOFF_S; k++) delay *= 2;
    if (delay > MAX_BACKOFF_S) delay = MAX_BACKOFF_S;
    g->restarts++;
    g->restart_at = rf_time_now() + delay;
    rf_log_warn("%s[%d] (%s, pid %d) %s; restart %d of %d in %.1f s (its output is in %s)", p->key, i, g->desc,
                (int)pid, how, g->restarts, p->max_restarts, delay, g->log);
    return RF_OK;
}

static rf_status poll_one(rf_programs *p, int i) {
    prog *g = &p->v[i];
    if (g->pid > 0) {
        int ws;
        pid_t r = waitpid(g->pid, &ws, WNOHANG);
        if (r == g->pid) RF_TRY(on_exit_status(p, i, ws));
    }
    if (g->pid == 0 && g->restart_at > 0 && rf_time_now() >= g->restart_at) {
        g->restart_at = 0;
        RF_TRY(spawn(p, i));
    }
    return RF_OK;
}

rf_status rf_programs_poll(rf_programs *p) {
    if (!p) return RF_OK;
    for (int i = 0; i < p->n; i++) {
        rf_status st = poll_one(p, i);
        if (st != RF_OK) {
            p->failed = 1;
            return st;
        }
    }
    return RF_OK;
}

int rf_programs_failed(const rf_programs *p) { return p && p->failed; }

rf_status rf_programs_tick(void *ctx) { return rf_programs_poll(ctx); }

pid_t rf_programs_pid(const rf_programs *p, int i) { return p && i >= 0 && i < p->n ? p->v[i].pid : -1; }

int rf_programs_restarts(const rf_programs *p, int i) { return p && i >= 0 && i < p->n ? p->v[i].restarts : 0; }

const char *rf_programs_log(const rf_programs *p, int i) { return p && i >= 0 && i < p->n ? p->v[i].log : NULL; }

/* Reaps the programs that exited; returns how many still run. */
static int reap(rf_programs *p) {
    int alive = 0;
    for (int i = 0; i < p->n; i++) {
        prog *g = &p->v[i];
        if (g->pid <= 0) continue;
        pid_t r = waitpid(g->pid, NULL, WNOHANG);
        if (r == g->pid || (r < 0 && errno == ECHILD)) {
            kill(-g->pid, SIGKILL); /* leftovers of its process group */
            g->pid = 0;
        } else {
            alive++;
        }
    }
    return alive;
}

/* Waits up to s seconds for every program to exit. */
static int wait_all(rf_programs *p, double s) {
    double end = rf_time_now() + s;
    int alive;
    while ((alive = reap(p)) > 0 && rf_time_now() < end) sleep_s(0.01);
    return alive;
}

static void signal_all(rf_programs *p, int sig) {
    for (int i = 0; i < p->n; i++)
        if (p->v[i].pid > 0) kill(-p->v[i].pid, sig);
}

void rf_programs_stop(rf_programs *p) {
    if (!p) return;
    if (wait_all(p, EXIT_WAIT_S) > 0) {
        signal_all(p, SIGTERM);
        if (wait_all(p, p->grace_s) > 0) {
            for (int i = 0; i < p->n; i++)
                if (p->v[i].pid > 0)
                    rf_log_warn("%s[%d] (%s, pid %d) did not stop within %.1f s of SIGTERM: killed", p->key, i,
                                p->v[i].desc, (int)p->v[i].pid, p->grace_s);
            signal_all(p, SIGKILL);
            for (int i = 0; i < p->n; i++)
                if (p->v[i].pid > 0) {
                    while (waitpid(p->v[i].pid, NULL, 0) < 0 && errno == EINTR) {
                    }
                    p->v[i].pid = 0;
                }
        }
    }
    for (int i = 0; i < p->n; i++) {
        for (int k = 0; p->v[i].argv && p->v[i].argv[k]; k++) free(p->v[i].argv[k]);
        free(p->v[i].argv), free(p->v[i].path), free(p->v[i].log);
    }
    for (int k = 0; p->envp && p->envp[k]; k++)
        if (k != p->rank_slot) free(p->envp[k]);
    free(p->envp), free(p->v);
    free(p);
}
