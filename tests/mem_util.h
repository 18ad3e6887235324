/* Test helper: which of a model's parameter pages are resident (mincore), for the tests that
 * check an fp32 copy is never touched (test_bf16_frozen, test_weights_sync). Needs _GNU_SOURCE
 * (or _DEFAULT_SOURCE) before the first system header, for mincore. */
#ifndef RF_TEST_MEM_UTIL_H
#define RF_TEST_MEM_UTIL_H

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "model/model.h"

/* Pages wholly inside floats [off, off + n) of m->params that are resident. */
static inline int rf_test_resident_pages(const rf_model *m, size_t off, size_t n) {
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)(m->params + off) + pg - 1) & ~(pg - 1), b = (uintptr_t)(m->params + off + n) & ~(pg - 1);
    if (b <= a) return 0;
    size_t np = (b - a) / pg;
    unsigned char *v = calloc(np, 1);
    int res = 0;
    if (v && mincore((void *)a, b - a, v) == 0)
        for (size_t i = 0; i < np; i++) res += v[i] & 1;
    free(v);
    return res;
}

#endif
