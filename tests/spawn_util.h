/* Child processes for tests that run reward programs: spawn with stderr to a file, wait with a
 * bound (killing what overruns it), read the file back. Include after defining
 * _POSIX_C_SOURCE 200809L. */
#ifndef RF_TEST_SPAWN_UTIL_H
#define RF_TEST_SPAWN_UTIL_H

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

/* Starts argv[0] (searched in PATH) with stdout and stderr appended to `log` (NULL: inherited).
 * Returns the pid, or -1. */
static inline pid_t rf_test_spawn(char *const argv[], const char *log) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (log) {
        posix_spawn_file_actions_addopen(&fa, 2, log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        posix_spawn_file_actions_adddup2(&fa, 2, 1);
    }
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    return rc == 0 ? pid : -1;
}

/* Waits up to limit_s for pid to exit; returns its exit code, 128 + signal when killed by one,
 * or -1 when it overran (it is then killed and reaped). */
static inline int rf_test_wait(pid_t pid, double limit_s) {
    if (pid <= 0) return -1;
    for (double t = 0; t < limit_s; t += 0.01) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (r < 0) return -1;
        nanosleep(&(struct timespec){0, 10000000L}, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

/* Kills and reaps pid (if still there). */
static inline void rf_test_kill(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* The file's contents (caller frees), "" when unreadable. */
static inline char *rf_test_slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    size_t cap = 1 << 16, n = 0;
    char *buf = calloc(cap, 1);
    if (f && buf) {
        n = fread(buf, 1, cap - 1, f);
        buf[n] = '\0';
    }
    if (f) fclose(f);
    return buf;
}

#endif
