/* Small helpers shared by every module: whole-file reads, atomic writes, paths, clocks. */
#ifndef RF_UTIL_H
#define RF_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* Reads the whole file at `path` into a new NUL-terminated buffer; the caller frees *out.
 * Errors: RF_ERR_IO naming the path. */
rf_status rf_read_file(const char *path, char **out, size_t *len);

/* Writes `len` bytes to `path` atomically: a temporary file beside it, fsync, rename. */
rf_status rf_write_file_atomic(const char *path, const void *data, size_t len);

/* Joins a directory and a file name into `out` (size `cap`). */
void rf_path_join(char *out, size_t cap, const char *dir, const char *name);

/* 1 when `path` exists as a regular file. */
int rf_file_exists(const char *path);

/* Creates a directory and its parents (mkdir -p). */
rf_status rf_mkdirs(const char *path);

/* Removes a file or a directory tree (rm -rf); a missing path is not an error. */
rf_status rf_remove_tree(const char *path);

/* Monotonic time in seconds. */
double rf_time_now(void);

/* Sleeps for s seconds (resumes after signals). */
void rf_sleep(double s);

/* Test hook: the value of environment variable `name` as milliseconds (>= 0), 0 when unset.
 * Split-run workers sleep a random 0 .. that many ms at chosen points when set
 * (RF_TEST_DELAY_ROLLOUT_MS, RF_TEST_DELAY_TRAIN_MS), so tests can check the staleness bound
 * under uneven speeds. */
double rf_test_delay_ms(const char *name);

/* Calloc that records RF_ERR_NOMEM on failure; returns NULL then. */
void *rf_calloc(size_t n, size_t size);

/* Grows the array *p of *cap elements of `size` bytes (contents kept, capacity doubled from 16)
 * to hold at least `need`; RF_ERR_NOMEM recorded on failure, *p and *cap unchanged then. */
rf_status rf_grow(void **p, int *cap, int need, size_t size);

/* Duplicates a string (NULL for NULL). */
char *rf_strdup(const char *s);

/* First occurrence of needle[0..m) in hay[0..n), NULL when none (or m == 0). Works on bytes,
 * so text with NULs inside (a decoded U+0000) is searched whole. */
const char *rf_memfind(const char *hay, size_t n, const char *needle, size_t m);

/* The offset of the first byte of s[0..n) that does not begin a well-formed UTF-8 character
 * (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF), or n when all of it is
 * UTF-8. NUL bytes are well-formed (callers that refuse them check separately). */
size_t rf_utf8_invalid_at(const void *s, size_t n);

/* s[0..n) as a JSON string literal, quotes included: '"', '\\' and every control character
 * escaped (NUL as \u0000), other bytes copied. Malloc'd, NUL-terminated; NULL when out of
 * memory. */
char *rf_json_quote(const char *s, size_t n);

#endif
