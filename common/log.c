#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

/* One line, prefix + message + newline, in one write: stderr is unbuffered, and under mpirun
 * the lines of several ranks would otherwise interleave mid-line. Longer lines are cut. */
static void emit(const char *prefix, const char *fmt, va_list ap) {
    char buf[16384];
    size_t p = strlen(prefix), room = sizeof buf - p - 1;
    memcpy(buf, prefix, p);
    int n = vsnprintf(buf + p, room, fmt, ap);
    size_t len = p + (n < 0 ? 0 : (size_t)n < room ? (size_t)n : room - 1);
    buf[len++] = '\n';
    fwrite(buf, 1, len, stderr);
}

void rf_log_info(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    emit("", fmt, ap);
    va_end(ap);
}

void rf_log_warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    emit("warning: ", fmt, ap);
    va_end(ap);
}

void rf_log_status(rf_status s) {
    const char *m = rf_error_message();
    fprintf(stderr, "error: %s\n", m[0] ? m : rf_strerror(s));
}

void rf_progress(const char *what, long done, long total, double t0, const char *unit) {
    double el = rf_time_now() - t0;
    double rate = el > 0 ? (double)done / el : 0.0;
    double eta = rate > 0 && total > done ? (double)(total - done) / rate : 0.0;
    int tty = isatty(2);
    if (el < 1.0) return; /* short phases need no progress line */
    if (!tty && total > 0) {
        long step = total / 10 > 0 ? total / 10 : 1;
        if (done % step != 0 && done != total) return;
    }
    int width = 30, fill = total > 0 ? (int)((double)width * (double)done / (double)total) : 0;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = '\0';
    fprintf(stderr, "%s%s [%s] %ld/%ld %.1f %s/s ETA %.0fs%s", tty ? "\r" : "", what, bar, done,
            total, rate, unit, eta, tty && done < total ? "" : "\n");
    fflush(stderr);
}
