/* The training worker's files call in one direction (actor/worker_internal.h):
 * actor/worker.c -> actor/worker_dp.c -> actor/worker_tp.c -> actor/worker_common.c. The test
 * reads the four sources (RF_SOURCE_DIR), finds the functions each defines for the others (a
 * line starting in column 0 with a return type, not static, and a name, whose definition opens
 * with "{"), and fails naming
 * every call from a file to a function defined in a file at its level or above it: before the
 * split into these layers worker.c, worker_dp.c and worker_tp.c called each other in a circle
 * (e.g. worker_tp.c -> rf__dp_setup in worker_dp.c -> rf__tp_setup in worker_tp.c). Also
 * checks the scanner itself on a small source with a known call. Skips (77) without
 * RF_SOURCE_DIR. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "test_util.h"

#define MAX_DEFS 512

typedef struct def {
    char name[96];
    int file;
} def;

static const char *const files[4] = {"worker_common.c", "worker_tp.c", "worker_dp.c", "worker.c"}; /* low to high */

static int ident_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

/* The functions text defines: a line in column 0 that is not a comment, preprocessor line or
 * declaration, holding "name(" before the first "(" and, on it or a following line, "{" before
 * ";". Adds them to d (n in/out) as file f. */
static void scan_defs(const char *text, int f, def *d, int *n) {
    for (const char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (!isalpha((unsigned char)*line) || strncmp(line, "typedef", 7) == 0 || strncmp(line, "static", 6) == 0)
            continue; /* static functions are the file's own */
        const char *paren = strchr(line, '('), *eol = strchr(line, '\n');
        if (!paren || (eol && paren > eol)) continue;
        const char *open = strchr(paren, '{'), *semi = strchr(paren, ';');
        if (!open || (semi && semi < open)) continue; /* a declaration or a call */
        const char *e = paren;
        while (e > line && e[-1] == ' ') e--;
        const char *b = e;
        while (b > line && ident_char(b[-1])) b--;
        if (e - b <= 0 || e - b >= (long)sizeof d[0].name || *n >= MAX_DEFS) continue;
        snprintf(d[*n].name, sizeof d[*n].name, "%.*s", (int)(e - b), b);
        d[*n].file = f;
        (*n)++;
    }
}

/* Whether text calls `name(` (an identifier boundary before it). */
static int calls(const char *text, const char *name) {
    size_t k = strlen(name);
    for (const char *p = strstr(text, name); p; p = strstr(p + 1, name))
        if ((p == text || !ident_char(p[-1])) && p[k] == '(') return 1;
    return 0;
}

/* Calls from file i (its text) to functions of files at its level or above, printed; returns
 * how many. Definitions in the same file are not calls across files. */
static int upward_calls(const char *const *text, int nfiles, const def *d, int n) {
    int bad = 0;
    for (int i = 0; i < nfiles; i++)
        for (int k = 0; k < n; k++) {
            if (d[k].file == i || d[k].file < i || !calls(text[i], d[k].name)) continue;
            printf("  %s calls %s, defined in %s (a file it may not call)\n", files[i], d[k].name, files[d[k].file]);
            bad++;
        }
    return bad;
}

int main(void) {
    const char *src = getenv("RF_SOURCE_DIR");
    if (!src) {
        printf("test_worker_layers: skipped: RF_SOURCE_DIR not set\n");
        return 77;
    }
    /* the scanner on a known pair: the low file calls the high one's function */
    {
        const char *t[2] = {"int rf__low(int a) {\n    return rf__high(a);\n}\n",
                            "rf_status rf__high(int a)\n{\n    return a;\n}\nvoid rf__decl(int a);\n"};
        def d[MAX_DEFS];
        int n = 0;
        scan_defs(t[0], 0, d, &n);
        scan_defs(t[1], 1, d, &n);
        CHECK(n == 2 && strcmp(d[0].name, "rf__low") == 0 && strcmp(d[1].name, "rf__high") == 0);
        CHECK(upward_calls(t, 2, d, n) == 1);
    }
    char *text[4] = {0};
    def *d = calloc(MAX_DEFS, sizeof *d);
    int n = 0;
    for (int i = 0; i < 4; i++) {
        char p[1024];
        snprintf(p, sizeof p, "%s/actor/%s", src, files[i]);
        CHECK_OK(rf_read_file(p, &text[i], NULL));
        if (text[i] && d) scan_defs(text[i], i, d, &n);
    }
    printf("test_worker_layers: %d functions defined in the four files\n", n);
    CHECK(n > 20);
    if (d && text[0] && text[1] && text[2] && text[3]) {
        int bad = upward_calls((const char *const *)text, 4, d, n);
        printf("test_worker_layers: %d calls against worker.c -> worker_dp.c -> worker_tp.c -> worker_common.c\n", bad);
        CHECK(bad == 0);
    }
    for (int i = 0; i < 4; i++) free(text[i]);
    free(d);
    return rf_test_finish("test_worker_layers");
}
