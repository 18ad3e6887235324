/* A tiny test harness: CHECK macros that count, and a closing "N passed, N failed" line.
 * Exit code 0 when all checks pass, 1 otherwise, 77 for "skipped" (ctest SKIP_RETURN_CODE). */
#ifndef RF_TEST_UTIL_H
#define RF_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

static int rf_test_passed, rf_test_failed;

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (cond) {                                                          \
            rf_test_passed++;                                                \
        } else {                                                             \
            rf_test_failed++;                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                    \
    } while (0)

#define CHECK_OK(expr)                                                                  \
    do {                                                                                \
        rf_status rf__st = (expr);                                                      \
        if (rf__st == RF_OK) {                                                          \
            rf_test_passed++;                                                           \
        } else {                                                                        \
            rf_test_failed++;                                                           \
            fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #expr,   \
                    rf_strerror(rf__st), rf_error_message());                            \
        }                                                                               \
    } while (0)

/* Expects `expr` to fail with `code` and a message containing `needle`. */
#define CHECK_ERR(expr, code, needle)                                                  \
    do {                                                                               \
        rf_error_clear();                                                              \
        rf_status rf__st = (expr);                                                     \
        if (rf__st == (code) && strstr(rf_error_message(), (needle))) {                \
            rf_test_passed++;                                                          \
        } else {                                                                       \
            rf_test_failed++;                                                          \
            fprintf(stderr, "%s:%d: %s: expected %s containing \"%s\", got %s \"%s\"\n", \
                    __FILE__, __LINE__, #expr, rf_strerror(code), (needle),            \
                    rf_strerror(rf__st), rf_error_message());                          \
        }                                                                              \
    } while (0)

/* |a - b| <= atol + rtol * |b| */
#define CHECK_CLOSE(a, b, atol, rtol)                                                    \
    do {                                                                                 \
        double rf__a = (a), rf__b = (b);                                                 \
        if (fabs(rf__a - rf__b) <= (atol) + (rtol) * fabs(rf__b)) {                      \
            rf_test_passed++;                                                            \
        } else {                                                                         \
            rf_test_failed++;                                                            \
            fprintf(stderr, "%s:%d: %s = %.9g, expected %s = %.9g\n", __FILE__, __LINE__, \
                    #a, rf__a, #b, rf__b);                                               \
        }                                                                                \
    } while (0)

static inline int rf_test_finish(const char *name) {
    printf("%s: %d passed, %d failed\n", name, rf_test_passed, rf_test_failed);
    return rf_test_failed ? 1 : 0;
}

/* Directory of shared test data, or NULL (tests that need it skip). */
static inline const char *rf_test_shared_dir(void) {
    const char *d = getenv("RF_SHARED_DIR");
    return d && *d ? d : NULL;
}

#endif
