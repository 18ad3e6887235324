/* Shared by the fuzz targets (tests/fuzz/fuzz_*.c): each defines LLVMFuzzerTestOneInput, the
 * libFuzzer entry point, and is linked either with libFuzzer (cmake -DRLFLOW_FUZZ=ON, clang) to
 * search for inputs, or with replay_main.c to run the saved corpus (tests/fuzz/corpus/NAME/)
 * as a ctest. What a target proves: no input makes the code under test crash, read or write
 * out of bounds, leak (under ASan), hit undefined behaviour (UBSan), or return an error
 * without a message. */
#ifndef RF_FUZZ_UTIL_H
#define RF_FUZZ_UTIL_H

#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The input as a NUL-terminated string (embedded NULs kept); the caller frees it. */
static inline char *rf_fuzz_cstr(const uint8_t *data, size_t size) {
    char *s = malloc(size + 1);
    if (!s) abort();
    if (size) memcpy(s, data, size);
    s[size] = 0;
    return s;
}

/* This process's scratch directory ($TMPDIR or /tmp, one per process), made on first use. */
static inline const char *rf_fuzz_dir(void) {
    static char dir[256];
    if (!dir[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/rf_fuzz_%d", t && *t ? t : "/tmp", (int)getpid());
        mkdir(dir, 0700);
    }
    return dir;
}

/* Writes the input to the scratch file NAME and returns its path (static storage, valid until
 * the next call). */
static inline const char *rf_fuzz_file(const char *name, const void *data, size_t size) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", rf_fuzz_dir(), name);
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f)) {
        perror(path);
        abort();
    }
    return path;
}

/* An error must carry a message: a failure the user cannot read is a defect too. */
static inline void rf_fuzz_check_error(rf_status st) {
    if (st != RF_OK && !rf_error_message()[0]) {
        fprintf(stderr, "error %d (%s) returned with an empty message\n", (int)st, rf_strerror(st));
        abort();
    }
}

#endif
