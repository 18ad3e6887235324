/* Shared by the fuzz targets (tests/fuzz/fuzz_*.c): each defines LLVMFuzzerTestOneInput, the
 * libFuzzer entry point, and is linked either with libFuzzer (cmake -DRLFLOW_FUZZ=ON, clang) to
 * search for inputs, or with replay_main.c to run the saved corpus (tests/fuzz/corpus/NAME/)
 * as a ctest. What a target proves: no input makes the code under test crash, read or write
 * out of bounds, leak (under ASan), hit undefined behaviour (UBSan), or return an error
 * without a message. */
#ifndef RF_FUZZ_UTIL_H
#define RF_FUZZ_UTIL_H

#ifndef _GNU_SOURCE /* CMake defines it for the fuzz targets: it must precede every header */
#define _GNU_SOURCE
#endif
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <ftw.h>
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

static char rf_fuzz_dir_path[256];

static inline int rf_fuzz_remove(const char *p, const struct stat *sb, int flag, struct FTW *f) {
    (void)sb, (void)flag, (void)f;
    return remove(p);
}

/* At exit: the scratch directory and what the code under test wrote in it. */
static inline void rf_fuzz_dir_remove(void) {
    nftw(rf_fuzz_dir_path, rf_fuzz_remove, 16, FTW_DEPTH | FTW_PHYS);
}

/* This process's scratch directory ($TMPDIR or /tmp, one per process), made on first use and
 * removed when the process exits (each ctest run of a target left one behind before). */
static inline const char *rf_fuzz_dir(void) {
    if (!rf_fuzz_dir_path[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(rf_fuzz_dir_path, sizeof rf_fuzz_dir_path, "%s/rf_fuzz_%d", t && *t ? t : "/tmp", (int)getpid());
        if (mkdir(rf_fuzz_dir_path, 0700) == 0) atexit(rf_fuzz_dir_remove);
    }
    return rf_fuzz_dir_path;
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
