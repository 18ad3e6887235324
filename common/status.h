/* Status codes and error messages for every rlflow module.
 *
 * Library code never aborts on bad input: it returns an rf_status and records a message
 * with context (file, line, tensor name, field) through rf_error(). The message lives in a
 * thread-local buffer and is read back with rf_error_message() by whoever reports it. */
#ifndef RF_STATUS_H
#define RF_STATUS_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RF_STATUS_LIST(X)                                   \
    X(RF_OK, "ok")                                          \
    X(RF_ERR_ARG, "invalid argument")                       \
    X(RF_ERR_IO, "input/output error")                      \
    X(RF_ERR_FORMAT, "malformed input")                     \
    X(RF_ERR_UNSUPPORTED, "unsupported feature")            \
    X(RF_ERR_NOMEM, "out of memory")                        \
    X(RF_ERR_RANGE, "value out of range")                   \
    X(RF_ERR_CUDA, "CUDA error")                            \
    X(RF_ERR_NODEVICE, "no device available")               \
    X(RF_ERR_INTERNAL, "internal error")

typedef enum {
#define RF__ENUM(name, text) name,
    RF_STATUS_LIST(RF__ENUM)
#undef RF__ENUM
    RF_STATUS_COUNT
} rf_status;

/* Short fixed description of a status code. */
const char *rf_strerror(rf_status s);

/* Records a formatted message for the current thread and returns `code`, so that
 * `return rf_error(RF_ERR_FORMAT, "%s: ...", path)` reads naturally. */
rf_status rf_error(rf_status code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prepends context to the current thread's message ("loading x: " + old message). */
rf_status rf_error_wrap(rf_status code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The last message recorded by rf_error on this thread ("" when none). */
const char *rf_error_message(void);

/* Clears the current thread's message. */
void rf_error_clear(void);

#define RF_TRY(expr)                         \
    do {                                     \
        rf_status rf__s = (expr);            \
        if (rf__s != RF_OK) return rf__s;    \
    } while (0)

/* For invariants of our own code only, never for input validation. */
#define RF_ASSERT(cond)                                                         \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "%s:%d: internal invariant failed: %s\n", __FILE__, \
                    __LINE__, #cond);                                           \
            abort();                                                            \
        }                                                                       \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
