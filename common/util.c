#define _XOPEN_SOURCE 700
#include "common/util.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

rf_status rf_read_file(const char *path, char **out, size_t *len) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return rf_error(RF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return rf_error(RF_ERR_IO, "%s: cannot seek", path);
    }
    long n = ftell(f);
    rewind(f);
    if (n < 0) {
        fclose(f);
        return rf_error(RF_ERR_IO, "%s: cannot size", path);
    }
    char *buf = malloc((size_t)n + 1);
    if (!buf) {
        fclose(f);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory reading %ld bytes", path, n);
    }
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) {
        free(buf);
        return rf_error(RF_ERR_IO, "%s: short read", path);
    }
    buf[n] = '\0';
    *out = buf;
    if (len) *len = (size_t)n;
    return RF_OK;
}

rf_status rf_write_file_atomic(const char *path, const void *data, size_t len) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return rf_error(RF_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    const char *p = data;
    size_t left = len;
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0) {
            if (errno == EINTR) continue;
            close(fd);
            unlink(tmp);
            return rf_error(RF_ERR_IO, "%s: write failed: %s", tmp, strerror(errno));
        }
        p += w;
        left -= (size_t)w;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        unlink(tmp);
        return rf_error(RF_ERR_IO, "%s: fsync/close failed: %s", tmp, strerror(errno));
    }
    if (rename(tmp, path) != 0) {
        unlink(tmp);
        return rf_error(RF_ERR_IO, "%s: rename failed: %s", path, strerror(errno));
    }
    return RF_OK;
}

void rf_path_join(char *out, size_t cap, const char *dir, const char *name) {
    size_t n = strlen(dir);
    if (n > 0 && dir[n - 1] == '/')
        snprintf(out, cap, "%s%s", dir, name);
    else
        snprintf(out, cap, "%s/%s", dir, name);
}

int rf_file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

rf_status rf_mkdirs(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return rf_error(RF_ERR_IO, "%s: cannot create directory: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return rf_error(RF_ERR_IO, "%s: cannot create directory: %s", buf, strerror(errno));
    return RF_OK;
}

static int remove_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(p);
}

rf_status rf_remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return RF_OK;
    if (nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
        return rf_error(RF_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
    return RF_OK;
}

double rf_time_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void rf_sleep(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

double rf_test_delay_ms(const char *name) {
    const char *v = getenv(name);
    double ms = v ? strtod(v, NULL) : 0;
    return ms > 0 ? ms : 0;
}

void *rf_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) rf_error(RF_ERR_NOMEM, "out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

rf_status rf_grow(void **p, int *cap, int need, size_t size) {
    if (need <= *cap) return RF_OK;
    int c = *cap > 0 ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, size * (size_t)c);
    if (!q) return rf_error(RF_ERR_NOMEM, "out of memory growing an array to %d x %zu bytes", c, size);
    *p = q, *cap = c;
    return RF_OK;
}

char *rf_strdup(const char *s) {
    if (!s) return NULL;
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

const char *rf_memfind(const char *hay, size_t n, const char *needle, size_t m) {
    if (m == 0 || m > n) return NULL;
    for (size_t i = 0; i + m <= n; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, m) == 0) return hay + i;
    return NULL;
}

char *rf_json_quote(const char *s, size_t n) {
    char *o = malloc(n * 6 + 3), *p = o; /* "\u00XX" is the longest escape of one byte */
    if (!o) return NULL;
    *p++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n"
                        : c == '\r' ? "\\r" : c == '\t' ? "\\t" : NULL;
        if (esc) p += sprintf(p, "%s", esc);
        else if (c < 0x20 || c == 0x7f) p += sprintf(p, "\\u%04x", c);
        else *p++ = (char)c;
    }
    *p++ = '"';
    *p = '\0';
    return o;
}

size_t rf_utf8_invalid_at(const void *p, size_t n) {
    const uint8_t *s = p;
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
        if (!len || i + len > n || (len == 2 && c < 0xc2)) return i;
        uint32_t cp = len == 1 ? c : c & (0x7f >> len);
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return i;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        if ((len == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)))
            return i;
        i += len;
    }
    return n;
}
