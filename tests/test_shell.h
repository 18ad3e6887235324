/* Running the rlflow binary from end-to-end tests: a shell command with its combined output
 * captured. Include after defining _POSIX_C_SOURCE (popen). */
#ifndef RF_TEST_SHELL_H
#define RF_TEST_SHELL_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Runs the printf-formatted command with stderr merged into stdout; *out (when out is not
 * NULL) receives the output, which the caller frees. Returns the exit code. */
static int rf_test_sh(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int rf_test_sh(char **out, const char *fmt, ...) {
    char body[8000], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    /* a group, so that a compound command's every part is captured */
    snprintf(cmd, sizeof cmd, "{ %s\n} 2>&1", body);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap);
    while ((got = fread(buf + n, 1, cap - n - 1, p)) > 0)
        if ((n += got) + 1 >= cap) buf = realloc(buf, cap *= 2);
    buf[n] = '\0';
    int st = pclose(p);
    if (out) *out = buf;
    else free(buf);
    return WEXITSTATUS(st);
}

#endif
