/* cu_rewrite IN.cu OUT.cpp: the two pieces of CUDA syntax that C++ cannot take, rewritten for the
 * emulated CUDA module (include/cuda_runtime.h):
 *   KERNEL<<<GRID, BLOCK[, SMEM[, STREAM]]>>>(ARGS);
 *     -> rf_emu_launch("KERNEL", (const void *)&KERNEL, [=]() { KERNEL(ARGS); }, GRID, BLOCK...);
 *   extern __shared__ [__align__(N)] TYPE NAME[];
 *     -> TYPE *NAME = (TYPE *)rf_emu_dynamic_smem();
 * KERNEL may carry template arguments. Every newline is kept and a #line names IN, so compiler
 * messages and sanitizer reports point into the .cu file. Anything else it cannot parse stops the
 * build with the file and line. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *g_in;

static int line_of(const char *s, const char *p) {
    int n = 1;
    for (; s < p; s++) n += *s == '\n';
    return n;
}

static void die(const char *s, const char *p, const char *what) {
    fprintf(stderr, "%s:%d: cu_rewrite: %s\n", g_in, line_of(s, p), what);
    exit(1);
}

/* The end of the balanced (...) that starts at p ('('), or NULL. */
static const char *close_paren(const char *p) {
    int depth = 0;
    for (; *p; p++) {
        if (*p == '(') depth++;
        else if (*p == ')' && --depth == 0) return p;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: cu_rewrite IN.cu OUT.cpp\n");
        return 2;
    }
    g_in = argv[1];
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)len + 1);
    if (!s || fread(s, 1, (size_t)len, f) != (size_t)len) {
        fprintf(stderr, "%s: cannot read\n", argv[1]);
        return 1;
    }
    s[len] = 0;
    fclose(f);
    FILE *o = fopen(argv[2], "wb");
    if (!o) {
        perror(argv[2]);
        return 1;
    }
    fprintf(o, "#line 1 \"%s\"\n", argv[1]);
    const char *p = s, *done = s; /* done: copied up to here */
    for (;;) {
        /* the next launch or extern __shared__ outside comments, strings and characters */
        const char *launch = NULL, *ext = NULL;
        for (; *p && !launch && !ext; p++) {
            if (p[0] == '/' && p[1] == '*') {
                const char *e = strstr(p + 2, "*/");
                if (!e) die(s, p, "unterminated comment");
                p = e + 1;
            } else if (p[0] == '/' && p[1] == '/') {
                while (p[1] && p[1] != '\n') p++;
            } else if (*p == '"' || *p == '\'') {
                char q = *p;
                for (p++; *p && *p != q; p++)
                    if (*p == '\\' && p[1]) p++;
                if (!*p) die(s, p, "unterminated literal");
            } else if (!strncmp(p, "<<<", 3)) {
                launch = p;
            } else if (!strncmp(p, "extern __shared__", 17)) {
                ext = p;
            }
        }
        if (!launch && !ext) break;
        if (ext && (!launch || ext < launch)) {
            const char *semi = strchr(ext, ';'), *br = semi ? strstr(ext, "[]") : NULL;
            if (!semi || !br || br > semi) die(s, ext, "extern __shared__ without NAME[];");
            const char *q = ext + strlen("extern __shared__");
            while (isspace((unsigned char)*q)) q++;
            if (!strncmp(q, "__align__", 9)) {
                const char *c = close_paren(strchr(q, '('));
                if (!c || c > semi) die(s, ext, "unbalanced __align__(...)");
                q = c + 1;
            }
            const char *ne = br; /* name: the identifier before [] */
            while (ne > q && isspace((unsigned char)ne[-1])) ne--;
            const char *nb = ne;
            while (nb > q && (isalnum((unsigned char)nb[-1]) || nb[-1] == '_')) nb--;
            if (nb == ne) die(s, ext, "extern __shared__ array without a name");
            fwrite(done, 1, (size_t)(ext - done), o);
            fprintf(o, "%.*s *%.*s = (%.*s *)rf_emu_dynamic_smem();", (int)(nb - q), q, (int)(ne - nb), nb,
                    (int)(nb - q), q);
            p = done = semi + 1;
            continue;
        }
        /* the kernel: an identifier, then optionally <...>, right before <<< */
        const char *ke = launch, *kb = launch;
        if (kb > s && kb[-1] == '>') {
            int depth = 0;
            do {
                kb--;
                if (*kb == '>') depth++;
                else if (*kb == '<') depth--;
            } while (kb > s && depth > 0);
            if (depth) die(s, launch, "unbalanced template arguments before <<<");
        }
        while (kb > s && (isalnum((unsigned char)kb[-1]) || kb[-1] == '_')) kb--;
        const char *tmpl = kb;
        while (isalnum((unsigned char)*tmpl) || *tmpl == '_') tmpl++;
        if (tmpl == kb) die(s, launch, "no kernel name before <<<");
        const char *cfg = launch + 3, *cfg_end = strstr(cfg, ">>>");
        if (!cfg_end) die(s, launch, "<<< without >>>");
        const char *a = cfg_end + 3;
        while (isspace((unsigned char)*a)) a++;
        if (*a != '(') die(s, launch, ">>> not followed by (");
        const char *ae = close_paren(a);
        if (!ae) die(s, launch, "unbalanced kernel arguments");
        fwrite(done, 1, (size_t)(kb - done), o);
        fprintf(o, "rf_emu_launch(\"%.*s\", (const void *)&%.*s, [=]() { %.*s",
                (int)(ke - kb), kb, (int)(ke - kb), kb, (int)(ke - kb), kb);
        fwrite(a, 1, (size_t)(ae + 1 - a), o); /* (ARGS) with their newlines */
        fputs("; }, ", o);
        fwrite(cfg, 1, (size_t)(cfg_end - cfg), o);
        fputc(')', o);
        /* the newlines between >>> and ( */
        for (const char *c = cfg_end + 3; c < a; c++)
            if (*c == '\n') fputc('\n', o);
        p = done = ae + 1;
    }
    fputs(done, o);
    if (fclose(o)) {
        perror(argv[2]);
        return 1;
    }
    free(s);
    return 0;
}
