/* Console logging and progress lines. Messages go to stderr so that stdout stays clean for
 * machine-readable output (JSON from `rlflow score`, JSON lines from benchmarks). */
#ifndef RF_LOG_H
#define RF_LOG_H

#include "common/status.h"

void rf_log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void rf_log_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prints "error: <message>" for a failed status using the thread's recorded message. */
void rf_log_status(rf_status s);

/* Progress of a long phase: `done` of `total` units started at `t0` (rf_time_now). Redraws one
 * line on a terminal with rate and ETA; prints every 10% otherwise. `unit` names the unit. */
void rf_progress(const char *what, long done, long total, double t0, const char *unit);

#endif
