/* Driver for tests/tools/fuzz_tokenizer_vs_hf.py (not part of the build or of ctest).
 * Usage: tokenizer_fuzz_driver tokenizer.json inputs.txt, where each input line is the
 * text's bytes in hex ("." for empty). Prints per line: ids (add_special=1),
 * decode(skip_special=0) hex, decode(skip_special=1) hex, tab-separated. Build:
 *   cc -std=c11 -O2 -I. tests/tools/tokenizer_fuzz_driver.c model/tokenizer*.c \
 *      common/status.c common/util.c $(pkg-config --cflags --libs libcjson libpcre2-8) \
 *      -lunistring -o /tmp/tokenizer_fuzz_driver */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer.h"

static void put_hex(const char *s, size_t n) {
    if (!n) printf(".");
    for (size_t i = 0; i < n; i++) printf("%02x", (unsigned char)s[i]);
}

static char *unhex(const char *line, size_t len, size_t *n) {
    char *txt = malloc(len / 2 + 1);
    *n = 0;
    if (!(len == 1 && line[0] == '.'))
        for (size_t i = 0; i + 1 < len; i += 2) {
            unsigned v;
            sscanf(line + i, "%2x", &v);
            txt[(*n)++] = (char)v;
        }
    return txt;
}

static void run_one(const rf_tokenizer *t, const char *txt, size_t n) {
    int32_t *ids;
    int k;
    if (rf_tokenizer_encode(t, txt, n, 1, &ids, &k)) {
        printf("ERR %s\n", rf_error_message());
        return;
    }
    for (int i = 0; i < k; i++) printf(i ? " %d" : "%d", ids[i]);
    if (!k) printf(".");
    for (int skip = 0; skip <= 1; skip++) {
        char *d;
        size_t dn;
        printf("\t");
        if (rf_tokenizer_decode(t, ids, k, skip, &d, &dn) == RF_OK) put_hex(d, dn);
        free(d);
    }
    printf("\n");
    free(ids);
}

int main(int argc, char **argv) {
    rf_tokenizer *t;
    if (argc != 3) return 2;
    if (rf_tokenizer_load(&t, argv[1])) {
        fprintf(stderr, "%s\n", rf_error_message());
        return 1;
    }
    FILE *f = fopen(argv[2], "r");
    if (!f) return 1;
    char *line = NULL;
    size_t cap = 0, n;
    ssize_t r;
    while ((r = getline(&line, &cap, f)) > 0) {
        if (line[r - 1] == '\n') line[--r] = '\0';
        char *txt = unhex(line, (size_t)r, &n);
        run_one(t, txt, n);
        free(txt);
    }
    free(line);
    fclose(f);
    rf_tokenizer_free(t);
    return 0;
}
