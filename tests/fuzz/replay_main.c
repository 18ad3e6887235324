/* Runs a fuzz target over saved inputs without libFuzzer (gcc builds, ctest): every argument is
 * a file or a directory of files, each passed once to LLVMFuzzerTestOneInput. Exits 0 when all
 * ran; a crash or sanitizer report ends the process, failing the test. Prints how many ran so a
 * test over an empty or missing corpus cannot pass unnoticed (exit 1). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
        fprintf(stderr, "%s: cannot read\n", path);
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 1;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Files of a directory in name order (a stable order makes a failure reproducible). */
static int run_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) {
        perror(dir);
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        if (n == cap && !(names = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof *names))) abort();
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_names);
    int ran = 0;
    for (size_t i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        int r = run_file(path);
        if (r < 0) ran = -1;
        else if (ran >= 0) ran += r;
        free(names[i]);
    }
    free(names);
    return ran;
}

int main(int argc, char **argv) {
    int total = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        int r = stat(argv[i], &sb) ? (perror(argv[i]), -1)
                : S_ISDIR(sb.st_mode) ? run_dir(argv[i]) : run_file(argv[i]);
        if (r < 0) return 1;
        total += r;
    }
    printf("%s: %d inputs ran\n", argv[0], total);
    return total > 0 ? 0 : 1;
}
