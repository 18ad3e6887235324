/* CURVE keys, key files and the loopback test (see common/curve.h). */
#define _POSIX_C_SOURCE 200809L
#include "common/curve.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/util.h"

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

rf_status rf_curve_check(const char *key, const char *what) {
    size_t n = key ? strlen(key) : 0;
    if (n != RF_CURVE_KEY_LEN)
        return rf_error(RF_ERR_ARG, "%s: a CURVE key is %d Z85 characters, got %zu", what,
                        RF_CURVE_KEY_LEN, n);
    uint8_t raw[32];
    /* zmq_z85_decode refuses characters outside the Z85 alphabet */
    if (!zmq_z85_decode(raw, key))
        return rf_error(RF_ERR_ARG, "%s: \"%s\" is not Z85 (ZeroMQ RFC 32)", what, key);
    return RF_OK;
}

static rf_status no_curve(void) {
    return rf_error(RF_ERR_UNSUPPORTED, "this libzmq was built without CURVE (libsodium); "
                                        "Debian's libzmq5 has it");
}

rf_status rf_curve_keypair(rf_curve_key pub, rf_curve_key secret) {
    if (!zmq_has("curve") || zmq_curve_keypair(pub, secret) != 0) return no_curve();
    return RF_OK;
}

rf_status rf_curve_public(const char *secret, rf_curve_key pub) {
    RF_TRY(rf_curve_check(secret, "CURVE secret key"));
    if (!zmq_has("curve") || zmq_curve_public(pub, secret) != 0) return no_curve();
    return RF_OK;
}

/* Calls fn(key, line) for every key line of the text; stops at the first error. */
static rf_status scan_keys(const char *path, char *text,
                           rf_status (*fn)(void *ctx, const char *key, int line), void *ctx) {
    int line = 0;
    for (char *p = text; *p;) {
        char *end = strchr(p, '\n');
        if (end) *end = '\0';
        line++;
        while (is_blank(*p)) p++;
        char *word_end = p;
        while (*word_end && !is_blank(*word_end)) word_end++;
        /* a '#' word that cannot be a key (keys are 40 characters) starts a comment */
        int comment = p[0] == '#' && word_end - p != RF_CURVE_KEY_LEN;
        if (*p && !comment) {
            *word_end = '\0';
            char what[600];
            snprintf(what, sizeof what, "%s:%d", path, line);
            RF_TRY(rf_curve_check(p, what));
            RF_TRY(fn(ctx, p, line));
        }
        if (!end) break;
        p = end + 1;
    }
    return RF_OK;
}

typedef struct one_key {
    const char *path;
    char *out;
    int line;  /* of the key found, 0 while none */
} one_key;

static rf_status take_one(void *ctx, const char *key, int line) {
    one_key *o = ctx;
    if (o->line)
        return rf_error(RF_ERR_ARG, "%s:%d: a second key (the key is on line %d); a key file "
                                    "holds one key", o->path, line, o->line);
    memcpy(o->out, key, RF_CURVE_KEY_LEN + 1);
    o->line = line;
    return RF_OK;
}

rf_status rf_curve_read_key(const char *path, int secret, rf_curve_key key) {
    if (!path || !*path) return rf_error(RF_ERR_ARG, "no key file named");
    char *text;
    size_t len;
    RF_TRY(rf_read_file(path, &text, &len));
    one_key o = {path, key, 0};
    rf_status st = scan_keys(path, text, take_one, &o);
    free(text);
    RF_TRY(st);
    if (!o.line) return rf_error(RF_ERR_ARG, "%s: no key in the file (expected one line of 40 "
                                             "Z85 characters, as `rlflow keygen` writes)", path);
    struct stat sb;
    if (secret && stat(path, &sb) == 0 && (sb.st_mode & 077))
        rf_log_warn("%s holds a secret key and other users may read it (chmod 600 %s)", path, path);
    return RF_OK;
}

typedef struct key_list {
    rf_curve_key *v;
    int n, cap;
} key_list;

static rf_status take_all(void *ctx, const char *key, int line) {
    (void)line;
    key_list *l = ctx;
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->v[i], key)) return RF_OK;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 8;
        rf_curve_key *nv = realloc(l->v, sizeof *nv * (size_t)cap);
        if (!nv) return rf_error(RF_ERR_NOMEM, "out of memory reading keys");
        l->v = nv, l->cap = cap;
    }
    memcpy(l->v[l->n++], key, RF_CURVE_KEY_LEN + 1);
    return RF_OK;
}

rf_status rf_curve_read_keys(const char *path, rf_curve_key **keys, int *n) {
    *keys = NULL, *n = 0;
    if (!path || !*path) return rf_error(RF_ERR_ARG, "no key list named");
    char *text;
    size_t len;
    RF_TRY(rf_read_file(path, &text, &len));
    key_list l = {0};
    rf_status st = scan_keys(path, text, take_all, &l);
    free(text);
    if (st == RF_OK && l.n == 0)
        st = rf_error(RF_ERR_ARG, "%s: no keys (one public key per line, as in the .pub files "
                                  "`rlflow keygen` writes); an empty list would refuse every "
                                  "client", path);
    if (st != RF_OK) {
        free(l.v);
        return st;
    }
    *keys = l.v, *n = l.n;
    return RF_OK;
}

/* Creates `path` with `mode` (O_EXCL unless force) and writes one line. */
static rf_status write_key(const char *path, const char *key, mode_t mode, int force) {
    int fd = open(path, O_WRONLY | O_CREAT | (force ? O_TRUNC : O_EXCL), mode);
    if (fd < 0)
        return rf_error(RF_ERR_IO, "%s: cannot create: %s%s", path, strerror(errno),
                        errno == EEXIST ? " (use --force to replace it)" : "");
    /* an existing file keeps its old mode through O_TRUNC: set it */
    int ok = fchmod(fd, mode) == 0;
    char line[RF_CURVE_KEY_LEN + 2];
    snprintf(line, sizeof line, "%s\n", key);
    ok = ok && write(fd, line, RF_CURVE_KEY_LEN + 1) == RF_CURVE_KEY_LEN + 1;
    ok = close(fd) == 0 && ok;
    if (!ok) return rf_error(RF_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    return RF_OK;
}

rf_status rf_curve_write_keypair(const char *prefix, int force, rf_curve_key pub) {
    if (!prefix || !*prefix) return rf_error(RF_ERR_ARG, "keygen: an output prefix is needed");
    char sec_path[4096], pub_path[4096];
    if (snprintf(sec_path, sizeof sec_path, "%s.key", prefix) >= (int)sizeof sec_path ||
        snprintf(pub_path, sizeof pub_path, "%s.pub", prefix) >= (int)sizeof pub_path)
        return rf_error(RF_ERR_ARG, "keygen: prefix too long");
    if (!force && (access(sec_path, F_OK) == 0 || access(pub_path, F_OK) == 0))
        return rf_error(RF_ERR_IO, "%s: exists (use --force to replace the key pair)",
                        access(sec_path, F_OK) == 0 ? sec_path : pub_path);
    rf_curve_key secret;
    RF_TRY(rf_curve_keypair(pub, secret));
    rf_status st = write_key(sec_path, secret, 0600, force);
    if (st == RF_OK) st = write_key(pub_path, pub, 0644, force);
    memset(secret, 0, sizeof secret);
    return st;
}

int rf_curve_endpoint_is_local(const char *ep) {
    if (!ep) return 0;
    if (!strncmp(ep, "ipc://", 6) || !strncmp(ep, "inproc://", 9)) return 1;
    if (strncmp(ep, "tcp://", 6) != 0) return 0;
    const char *host = ep + 6, *colon = strrchr(host, ':');
    if (!colon) return 0;
    char h[256];
    size_t n = (size_t)(colon - host);
    if (n >= sizeof h) return 0;
    memcpy(h, host, n), h[n] = '\0';
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') memmove(h, h + 1, n - 2), h[n - 2] = '\0';
    if (!strcmp(h, "localhost") || !strcmp(h, "lo") || !strcmp(h, "::1")) return 1;
    unsigned a, b, c, d;
    char tail;
    return sscanf(h, "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4 && a == 127 && b < 256 &&
           c < 256 && d < 256;
}
