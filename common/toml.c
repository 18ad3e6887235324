/* TOML 1.0.0 parser: a recursive-descent reader over a byte buffer, following the ABNF of
 * https://toml.io/en/v1.0.0 (toml.abnf). See toml.h. */
#include "common/toml.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* Table flags: how a table came to exist decides what may later extend it (spec: "Table"). */
enum {
    F_DEFINED = 1,  /* by a [header] or [[header]] */
    F_IMPLICIT = 2, /* as a parent in a header path ([a.b] creates a) */
    F_DOTTED = 4,   /* by a dotted key (a.b = 1 creates a) */
    F_INLINE = 8,   /* an inline table, or inside one: immutable */
    F_AOT = 16,     /* an array created by [[header]] (arrays only) */
};

#define MAX_DEPTH 128     /* nesting of arrays and inline tables */
#define MAX_KEY_PARTS 128 /* parts of one dotted key */

typedef struct entry {
    char *key;
    size_t klen;
    rf_toml *val;
    int line, col; /* of the key */
} entry;

struct rf_toml {
    rf_toml_type type;
    int line, col;
    unsigned flags;
    const char *origin; /* the root's copy */
    char *own_origin;   /* root only */
    union {
        struct { char *s; size_t len; } str; /* strings and date/times */
        int64_t i;
        double f;
        int b;
        struct { entry *e; size_t n, cap; } tab;
        struct { rf_toml **v; size_t n, cap; } arr;
    } u;
};

typedef struct keypart {
    char *s;
    size_t len;
    size_t off; /* where it starts in the text */
} keypart;

typedef struct keypath {
    keypart part[MAX_KEY_PARTS];
    int n;
} keypath;

typedef struct parser {
    const char *s;
    size_t n, p;
    const char *origin;
    rf_toml *root, *cur; /* the root table; the table the current [header] opened */
    int depth;
    size_t pos_off, pos_line_start; /* position cache: offsets are mostly visited in order */
    int pos_line;
} parser;

typedef struct sbuf {
    char *d;
    size_t n, cap;
} sbuf;

/* ------------------------------------------------------------------ positions and errors */

static void pos_of(parser *P, size_t off, int *line, int *col) {
    if (off < P->pos_off) P->pos_off = 0, P->pos_line = 1, P->pos_line_start = 0;
    for (size_t i = P->pos_off; i < off && i < P->n; i++)
        if (P->s[i] == '\n') P->pos_line++, P->pos_line_start = i + 1;
    P->pos_off = off;
    int c = 1;
    for (size_t i = P->pos_line_start; i < off && i < P->n; i++)
        if (((unsigned char)P->s[i] & 0xC0) != 0x80) c++;
    *line = P->pos_line;
    *col = c;
}

static rf_status perr(parser *P, size_t off, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static rf_status perr(parser *P, size_t off, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    pos_of(P, off, &line, &col);
    return rf_error(RF_ERR_FORMAT, "%s:%d:%d: %s", P->origin, line, col, msg);
}

/* ------------------------------------------------------------------ nodes */

static rf_toml *node_new(parser *P, rf_toml_type t, size_t off) {
    rf_toml *v = rf_calloc(1, sizeof *v);
    if (!v) return NULL;
    v->type = t;
    v->origin = P->origin;
    pos_of(P, off, &v->line, &v->col);
    return v;
}

static void node_free(rf_toml *v) {
    if (!v) return;
    if (v->type == RF_TOML_TABLE) {
        for (size_t i = 0; i < v->u.tab.n; i++) {
            free(v->u.tab.e[i].key);
            node_free(v->u.tab.e[i].val);
        }
        free(v->u.tab.e);
    } else if (v->type == RF_TOML_ARRAY) {
        for (size_t i = 0; i < v->u.arr.n; i++) node_free(v->u.arr.v[i]);
        free(v->u.arr.v);
    } else if (v->type != RF_TOML_INTEGER && v->type != RF_TOML_FLOAT &&
               v->type != RF_TOML_BOOL) {
        free(v->u.str.s);
    }
    free(v->own_origin);
    free(v);
}

void rf_toml_free(rf_toml *root) { node_free(root); }

static entry *tab_find(const rf_toml *t, const char *key, size_t klen) {
    for (size_t i = 0; i < t->u.tab.n; i++) {
        entry *e = &t->u.tab.e[i];
        if (e->klen == klen && memcmp(e->key, key, klen) == 0) return e;
    }
    return NULL;
}

/* Adds key -> val to table t (the key is copied); on failure val is freed. */
static rf_status tab_add(parser *P, rf_toml *t, const keypart *k, rf_toml *val) {
    if (t->u.tab.n == t->u.tab.cap) {
        size_t cap = t->u.tab.cap ? 2 * t->u.tab.cap : 4;
        entry *e = realloc(t->u.tab.e, cap * sizeof *e);
        if (!e) {
            node_free(val);
            return rf_error(RF_ERR_NOMEM, "%s: out of memory", P->origin);
        }
        t->u.tab.e = e;
        t->u.tab.cap = cap;
    }
    entry *e = &t->u.tab.e[t->u.tab.n];
    e->key = malloc(k->len + 1);
    if (!e->key) {
        node_free(val);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory", P->origin);
    }
    memcpy(e->key, k->s, k->len);
    e->key[k->len] = '\0';
    e->klen = k->len;
    e->val = val;
    pos_of(P, k->off, &e->line, &e->col);
    t->u.tab.n++;
    return RF_OK;
}

/* Appends v to array a; on failure v is freed. */
static rf_status arr_add(parser *P, rf_toml *a, rf_toml *v) {
    if (a->u.arr.n == a->u.arr.cap) {
        size_t cap = a->u.arr.cap ? 2 * a->u.arr.cap : 4;
        rf_toml **nv = realloc(a->u.arr.v, cap * sizeof *nv);
        if (!nv) {
            node_free(v);
            return rf_error(RF_ERR_NOMEM, "%s: out of memory", P->origin);
        }
        a->u.arr.v = nv;
        a->u.arr.cap = cap;
    }
    a->u.arr.v[a->u.arr.n++] = v;
    return RF_OK;
}

/* ------------------------------------------------------------------ characters */

static int peek(const parser *P) { return P->p < P->n ? (unsigned char)P->s[P->p] : -1; }
static int peek_at(const parser *P, size_t k) {
    return P->p + k < P->n ? (unsigned char)P->s[P->p + k] : -1;
}

/* Control characters other than tab may appear in no comment or string (0x00-0x1F, 0x7F). */
static int is_control(int c) { return (c >= 0 && c < 0x20 && c != '\t') || c == 0x7F; }
static int is_bare(int c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-';
}
static int is_digit(int c) { return c >= '0' && c <= '9'; }

static void skip_ws(parser *P) {
    while (peek(P) == ' ' || peek(P) == '\t') P->p++;
}

static int at_newline(const parser *P) {
    return peek(P) == '\n' || (peek(P) == '\r' && peek_at(P, 1) == '\n');
}

static rf_status eat_newline(parser *P) {
    if (peek(P) == '\n') {
        P->p++;
        return RF_OK;
    }
    if (peek(P) == '\r' && peek_at(P, 1) == '\n') {
        P->p += 2;
        return RF_OK;
    }
    return perr(P, P->p, "expected a newline");
}

/* p at '#': skips to the end of the line (not past it). */
static rf_status skip_comment(parser *P) {
    for (P->p++; P->p < P->n && !at_newline(P); P->p++)
        if (is_control(peek(P))) return perr(P, P->p, "control character in a comment");
    return RF_OK;
}

/* Whitespace, newlines and comments, as allowed between array items. */
static rf_status skip_ws_nl(parser *P) {
    for (;;) {
        skip_ws(P);
        if (peek(P) == '#') RF_TRY(skip_comment(P));
        else if (at_newline(P)) RF_TRY(eat_newline(P));
        else if (peek(P) == '\r') return perr(P, P->p, "carriage return without a line feed");
        else return RF_OK;
    }
}

/* After a key/value pair or a header: optional whitespace and comment, then the line ends. */
static rf_status expect_eol(parser *P, const char *after) {
    skip_ws(P);
    if (peek(P) == '#') RF_TRY(skip_comment(P));
    if (P->p >= P->n) return RF_OK;
    if (at_newline(P)) return eat_newline(P);
    return perr(P, P->p, "expected a newline after %s", after);
}

/* ------------------------------------------------------------------ strings */

static rf_status sb_put(sbuf *b, const char *d, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 32;
        while (cap < b->n + n + 1) cap *= 2;
        char *nd = realloc(b->d, cap);
        if (!nd) return rf_error(RF_ERR_NOMEM, "out of memory");
        b->d = nd;
        b->cap = cap;
    }
    memcpy(b->d + b->n, d, n);
    b->n += n;
    b->d[b->n] = '\0';
    return RF_OK;
}

static rf_status sb_utf8(sbuf *b, uint32_t cp) {
    char u[4];
    size_t n;
    if (cp < 0x80) u[0] = (char)cp, n = 1;
    else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
    else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
    } else {
        u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
    }
    return sb_put(b, u, n);
}

/* \uXXXX or \UXXXXXXXX with p at the 'u'/'U'. */
static rf_status unicode_escape(parser *P, sbuf *b) {
    size_t start = P->p - 1, digits = peek(P) == 'u' ? 4 : 8;
    uint32_t cp = 0;
    P->p++;
    for (size_t i = 0; i < digits; i++, P->p++) {
        int c = peek(P), d = is_digit(c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                                       : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
        if (d < 0) return perr(P, start, "\\%c escape needs %zu hex digits", digits == 4 ? 'u' : 'U', digits);
        cp = cp * 16 + (uint32_t)d;
    }
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return perr(P, start, "escape is not a Unicode scalar value (U+%X)", cp);
    return sb_utf8(b, cp);
}

/* Multi-line basic strings: a backslash that ends a line swallows the whitespace and
 * newlines that follow. p is just after the backslash; returns 1 in *done when it applied. */
static rf_status line_ending_backslash(parser *P, int *done) {
    size_t q = P->p;
    while (q < P->n && (P->s[q] == ' ' || P->s[q] == '\t')) q++;
    *done = q < P->n && (P->s[q] == '\n' || (P->s[q] == '\r' && q + 1 < P->n && P->s[q + 1] == '\n'));
    if (!*done) return RF_OK;
    P->p = q;
    for (;;) {
        skip_ws(P);
        if (!at_newline(P)) break;
        RF_TRY(eat_newline(P));
    }
    return RF_OK;
}

/* p at the backslash. */
static rf_status escape(parser *P, sbuf *b, int multiline) {
    size_t start = P->p++;
    int c = peek(P);
    if (multiline && (c == ' ' || c == '\t' || c == '\n' || c == '\r')) {
        int done;
        RF_TRY(line_ending_backslash(P, &done));
        if (done) return RF_OK;
    }
    static const char from[] = "btnfr\"\\", to[] = "\b\t\n\f\r\"\\";
    const char *hit = c > 0 ? strchr(from, c) : NULL;
    if (hit) {
        P->p++;
        return sb_put(b, &to[hit - from], 1);
    }
    if (c == 'u' || c == 'U') return unicode_escape(P, b);
    return perr(P, start, "invalid escape sequence in a string");
}

/* A newline inside a multi-line string: LF or CRLF, kept as LF. */
static rf_status string_newline(parser *P, sbuf *b) {
    if (peek(P) == '\r' && peek_at(P, 1) != '\n')
        return perr(P, P->p, "carriage return without a line feed in a string");
    RF_TRY(eat_newline(P));
    return sb_put(b, "\n", 1);
}

/* Closing delimiter of a multi-line string at p (a run of quotes q): up to two quotes may
 * belong to the content. Sets *closed when the string ended. */
static rf_status ml_quotes(parser *P, sbuf *b, char q, int *closed) {
    size_t k = 0;
    while (P->p + k < P->n && P->s[P->p + k] == q) k++;
    *closed = k >= 3;
    if (k > 5) return perr(P, P->p + 5, "too many quotes at the end of a multi-line string");
    size_t keep = k >= 3 ? k - 3 : k;
    for (size_t i = 0; i < keep; i++) RF_TRY(sb_put(b, &q, 1));
    P->p += k;
    return RF_OK;
}

/* Reads a string of any of the four forms starting at p into b. `quote` is '"' or '\''. */
static rf_status read_string_body(parser *P, sbuf *b, char quote, int multiline, size_t start) {
    for (;;) {
        int c = peek(P);
        if (c < 0) return perr(P, start, "unterminated string");
        if (c == quote) {
            if (!multiline) {
                P->p++;
                return RF_OK;
            }
            int closed;
            RF_TRY(ml_quotes(P, b, quote, &closed));
            if (closed) return RF_OK;
        } else if (c == '\\' && quote == '"') {
            RF_TRY(escape(P, b, multiline));
        } else if (c == '\n' || c == '\r') {
            if (!multiline) return perr(P, start, "unterminated string (newline before the closing quote)");
            RF_TRY(string_newline(P, b));
        } else if (is_control(c)) {
            return perr(P, P->p, "control character U+%04X in a string (use an escape)", c);
        } else {
            RF_TRY(sb_put(b, &P->s[P->p], 1));
            P->p++;
        }
    }
}

/* p at the opening quote. Multi-line forms only where allow_ml (not in keys). */
static rf_status read_string(parser *P, sbuf *b, int allow_ml) {
    size_t start = P->p;
    char quote = (char)peek(P);
    int ml = peek_at(P, 1) == quote && peek_at(P, 2) == quote;
    if (ml && !allow_ml) return perr(P, start, "a key cannot be a multi-line string");
    P->p += ml ? 3 : 1;
    if (ml && at_newline(P)) RF_TRY(eat_newline(P)); /* a newline right after """ is trimmed */
    RF_TRY(sb_put(b, "", 0));
    return read_string_body(P, b, quote, ml, start);
}

static rf_status parse_string(parser *P, rf_toml **out) {
    sbuf b = {0};
    size_t start = P->p;
    rf_status st = read_string(P, &b, 1);
    if (st != RF_OK) {
        free(b.d);
        return st;
    }
    rf_toml *v = node_new(P, RF_TOML_STRING, start);
    if (!v) {
        free(b.d);
        return RF_ERR_NOMEM;
    }
    v->u.str.s = b.d;
    v->u.str.len = b.n;
    *out = v;
    return RF_OK;
}

/* ------------------------------------------------------------------ keys */

static void keypath_free(keypath *k) {
    for (int i = 0; i < k->n; i++) free(k->part[i].s);
    k->n = 0;
}

static rf_status key_part(parser *P, keypart *kp) {
    sbuf b = {0};
    kp->off = P->p;
    int c = peek(P);
    if (c == '"' || c == '\'') {
        rf_status st = read_string(P, &b, 0);
        if (st != RF_OK) {
            free(b.d);
            return st;
        }
    } else {
        size_t s = P->p;
        while (is_bare(peek(P))) P->p++;
        if (P->p == s) return perr(P, s, c < 0 || c == '\n' || c == '\r' ? "expected a key" :
                                   c == '=' ? "expected a key before '='" :
                                   "invalid character in a bare key (quote the key)");
        RF_TRY(sb_put(&b, P->s + s, P->p - s));
    }
    kp->s = b.d;
    kp->len = b.n;
    return RF_OK;
}

/* key = simple-key *( ws '.' ws simple-key ). The caller frees k with keypath_free. */
static rf_status parse_key(parser *P, keypath *k) {
    k->n = 0;
    for (;;) {
        skip_ws(P);
        if (k->n == MAX_KEY_PARTS) return perr(P, P->p, "key has too many parts");
        RF_TRY(key_part(P, &k->part[k->n]));
        k->n++;
        skip_ws(P);
        if (peek(P) != '.') return RF_OK;
        P->p++;
    }
}

/* "a.b.c" for messages, quoting parts that are not bare keys. */
static const char *key_name(const keypath *k, int upto, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (int i = 0; i <= upto && i < k->n && n < cap; i++) {
        int bare = k->part[i].len > 0;
        for (size_t j = 0; j < k->part[i].len; j++) bare &= is_bare((unsigned char)k->part[i].s[j]);
        n += (size_t)snprintf(buf + n, cap - n, bare ? "%s%.*s" : "%s\"%.*s\"", i ? "." : "",
                              (int)k->part[i].len, k->part[i].s);
    }
    return buf;
}

/* ------------------------------------------------------------------ scalars */

static int bad_underscores(const char *t, size_t n) {
    if (n == 0 || t[0] == '_' || t[n - 1] == '_') return 1;
    for (size_t i = 1; i < n; i++)
        if (t[i] == '_' && t[i - 1] == '_') return 1;
    return 0;
}

static int digit_val(int c) {
    if (is_digit(c)) return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return 99;
}

/* Digits in `base` with underscores between them; accumulates into *v, 0 on overflow past
 * `limit`. Returns 1 when well formed. */
static int read_digits(const char *t, size_t n, int base, uint64_t limit, uint64_t *v, int *ovf) {
    if (bad_underscores(t, n)) return 0;
    *v = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i] == '_') continue;
        int d = digit_val((unsigned char)t[i]);
        if (d >= base) return 0;
        if (*v > (limit - (uint64_t)d) / (uint64_t)base) *ovf = 1;
        else *v = *v * (uint64_t)base + (uint64_t)d;
    }
    return 1;
}

/* Returns 1 (integer), 0 (not integer syntax); *ovf set when it does not fit in int64. */
static int parse_integer(const char *t, size_t n, int64_t *out, int *ovf) {
    uint64_t v;
    *ovf = 0;
    if (n > 2 && t[0] == '0' && (t[1] == 'x' || t[1] == 'o' || t[1] == 'b')) {
        int base = t[1] == 'x' ? 16 : t[1] == 'o' ? 8 : 2;
        if (!read_digits(t + 2, n - 2, base, INT64_MAX, &v, ovf)) return 0;
        *out = (int64_t)v;
        return 1;
    }
    int neg = n > 0 && t[0] == '-';
    size_t s = n > 0 && (t[0] == '-' || t[0] == '+');
    if (n - s > 1 && t[s] == '0') return 0; /* no leading zeros */
    if (!read_digits(t + s, n - s, 10, (uint64_t)INT64_MAX + (uint64_t)neg, &v, ovf)) return 0;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 1;
}

/* Returns 1 when t is a TOML float (stored in *out). */
static int parse_float(const char *t, size_t n, double *out) {
    size_t s = n > 0 && (t[0] == '-' || t[0] == '+');
    double sign = t[0] == '-' ? -1.0 : 1.0;
    if (n - s == 3 && (memcmp(t + s, "inf", 3) == 0 || memcmp(t + s, "nan", 3) == 0)) {
        *out = t[s] == 'i' ? sign * INFINITY : (sign < 0 ? -NAN : NAN);
        return 1;
    }
    size_t i = s, dot = 0, exp = 0;
    while (i < n && t[i] != '.' && t[i] != 'e' && t[i] != 'E') i++;
    uint64_t v;
    int ovf = 0;
    if (i == s || !read_digits(t + s, i - s, 10, UINT64_MAX, &v, &ovf)) return 0;
    if (i - s > 1 && t[s] == '0') return 0;
    if (i < n && t[i] == '.') {
        dot = ++i;
        while (i < n && t[i] != 'e' && t[i] != 'E') i++;
        if (!read_digits(t + dot, i - dot, 10, UINT64_MAX, &v, &ovf)) return 0;
    }
    if (i < n) {
        exp = ++i;
        if (i < n && (t[i] == '+' || t[i] == '-')) exp++;
        if (!read_digits(t + exp, n - exp, 10, UINT64_MAX, &v, &ovf)) return 0;
    }
    if (!dot && !exp) return 0;
    char clean[512];
    size_t m = 0;
    for (size_t j = 0; j < n && m + 1 < sizeof clean; j++)
        if (t[j] != '_') clean[m++] = t[j];
    clean[m] = '\0';
    *out = strtod(clean, NULL);
    return 1;
}

static int two_digits(const char *t, int *v) {
    if (!is_digit((unsigned char)t[0]) || !is_digit((unsigned char)t[1])) return 0;
    *v = (t[0] - '0') * 10 + (t[1] - '0');
    return 1;
}

/* YYYY-MM-DD with a real day of that month. */
static int valid_date(const char *t, size_t n) {
    int y1, y2, m, d;
    if (n < 10 || !two_digits(t, &y1) || !two_digits(t + 2, &y2) || t[4] != '-' ||
        !two_digits(t + 5, &m) || t[7] != '-' || !two_digits(t + 8, &d))
        return 0;
    int y = y1 * 100 + y2, leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    static const int mdays[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    return m >= 1 && m <= 12 && d >= 1 && d <= mdays[m - 1] + (m == 2 && leap);
}

/* HH:MM:SS[.frac]; returns its length or 0. Seconds 60 allowed (a leap second, RFC 3339). */
static size_t valid_time(const char *t, size_t n) {
    int h, m, s;
    if (n < 8 || !two_digits(t, &h) || t[2] != ':' || !two_digits(t + 3, &m) || t[5] != ':' ||
        !two_digits(t + 6, &s) || h > 23 || m > 59 || s > 60)
        return 0;
    size_t i = 8;
    if (i < n && t[i] == '.') {
        i++;
        size_t f = i;
        while (i < n && is_digit((unsigned char)t[i])) i++;
        if (i == f) return 0;
    }
    return i;
}

/* Z, z or +HH:MM / -HH:MM, exactly the rest of the token. */
static int valid_offset(const char *t, size_t n) {
    int h, m;
    if (n == 1) return t[0] == 'Z' || t[0] == 'z';
    return n == 6 && (t[0] == '+' || t[0] == '-') && two_digits(t + 1, &h) && t[3] == ':' &&
           two_digits(t + 4, &m) && h <= 23 && m <= 59;
}

/* Classifies a date/time token; returns 0 when it is none. */
static int datetime_kind(const char *t, size_t n, rf_toml_type *kind) {
    if (n >= 3 && t[2] == ':') {
        *kind = RF_TOML_TIME_LOCAL;
        return valid_time(t, n) == n;
    }
    if (!valid_date(t, n)) return 0;
    if (n == 10) {
        *kind = RF_TOML_DATE_LOCAL;
        return 1;
    }
    if (t[10] != 'T' && t[10] != 't' && t[10] != ' ') return 0;
    size_t tl = valid_time(t + 11, n - 11);
    if (!tl) return 0;
    if (11 + tl == n) {
        *kind = RF_TOML_DATETIME_LOCAL;
        return 1;
    }
    *kind = RF_TOML_DATETIME;
    return valid_offset(t + 11 + tl, n - 11 - tl);
}

static int is_token_char(int c) { return is_bare(c) || c == '+' || c == '.' || c == ':'; }

/* The extent of an unquoted scalar at p: [0-9A-Za-z_+-.:], plus the one space that may
 * separate a date from its time ("1979-05-27 07:32:00"). */
static size_t token_end(const parser *P) {
    size_t q = P->p;
    while (q < P->n && is_token_char((unsigned char)P->s[q])) q++;
    if (q - P->p == 10 && valid_date(P->s + P->p, 10) && q + 2 < P->n && P->s[q] == ' ' &&
        is_digit((unsigned char)P->s[q + 1]) && is_digit((unsigned char)P->s[q + 2])) {
        q++;
        while (q < P->n && is_token_char((unsigned char)P->s[q])) q++;
    }
    return q;
}

static rf_status make_datetime(parser *P, rf_toml_type kind, const char *t, size_t n,
                               rf_toml **out) {
    rf_toml *v = node_new(P, kind, P->p);
    char *s = malloc(n + 1);
    if (!v || !s) {
        free(v);
        free(s);
        return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    memcpy(s, t, n);
    s[n] = '\0';
    if (kind != RF_TOML_TIME_LOCAL && n > 10) s[10] = 'T';
    if (s[n - 1] == 'z') s[n - 1] = 'Z';
    v->u.str.s = s;
    v->u.str.len = n;
    *out = v;
    return RF_OK;
}

/* Length of the prefix of t (n bytes) without any byte of `stop`. */
static size_t strcspn_n(const char *t, size_t n, const char *stop) {
    size_t i = 0;
    while (i < n && t[i] && !strchr(stop, t[i])) i++;
    return i;
}

/* Booleans, numbers and date/times. */
static rf_status parse_scalar(parser *P, rf_toml **out) {
    size_t end = token_end(P), n = end - P->p;
    const char *t = P->s + P->p;
    if (n == 0) return perr(P, P->p, "expected a value");
    rf_toml_type kind;
    int64_t i;
    double f;
    int ovf;
    rf_toml *v = NULL;
    if ((n == 4 && memcmp(t, "true", 4) == 0) || (n == 5 && memcmp(t, "false", 5) == 0)) {
        if ((v = node_new(P, RF_TOML_BOOL, P->p))) v->u.b = n == 4;
    } else if (datetime_kind(t, n, &kind)) {
        RF_TRY(make_datetime(P, kind, t, n, &v));
    } else if (parse_integer(t, n, &i, &ovf)) {
        if (ovf) return perr(P, P->p, "integer %.*s does not fit in 64 bits", (int)n, t);
        if ((v = node_new(P, RF_TOML_INTEGER, P->p))) v->u.i = i;
    } else if (parse_float(t, n, &f)) {
        if ((v = node_new(P, RF_TOML_FLOAT, P->p))) v->u.f = f;
    } else {
        n = strcspn_n(t, P->n - P->p, " \t\r\n,]}#"); /* show the whole word */
        return perr(P, P->p, is_digit((unsigned char)t[0]) || t[0] == '+' || t[0] == '-'
                                 ? "invalid number or date \"%.*s\""
                                 : "invalid value \"%.*s\" (strings must be quoted)",
                    (int)(n > 64 ? 64 : n), t);
    }
    if (!v) return RF_ERR_NOMEM;
    P->p = end;
    *out = v;
    return RF_OK;
}

/* ------------------------------------------------------------------ tables */

static rf_status parse_value(parser *P, rf_toml **out);

/* Walks a dotted key (all parts but the last) from table t, creating tables; used by
 * key/value pairs. A dotted key may only extend tables that dotted keys created. */
static rf_status descend_dotted(parser *P, rf_toml *t, const keypath *k, rf_toml **out) {
    char name[512];
    for (int i = 0; i < k->n - 1; i++) {
        entry *e = tab_find(t, k->part[i].s, k->part[i].len);
        if (!e) {
            rf_toml *nt = node_new(P, RF_TOML_TABLE, k->part[i].off);
            if (!nt) return RF_ERR_NOMEM;
            nt->flags = F_DOTTED;
            RF_TRY(tab_add(P, t, &k->part[i], nt));
            t = nt;
            continue;
        }
        rf_toml *v = e->val;
        if (v->type != RF_TOML_TABLE)
            return perr(P, k->part[i].off, "key \"%s\" is already defined as %s %s",
                        key_name(k, i, name, sizeof name), rf_toml_article(rf_toml_type_name(v->type)),
                        rf_toml_type_name(v->type));
        if (v->flags & F_INLINE)
            return perr(P, k->part[i].off, "cannot add keys to inline table \"%s\"",
                        key_name(k, i, name, sizeof name));
        if (!(v->flags & F_DOTTED))
            return perr(P, k->part[i].off, "cannot add keys to table \"%s\" with dotted keys "
                        "here (it is defined by a [table] header)", key_name(k, i, name, sizeof name));
        t = v;
    }
    *out = t;
    return RF_OK;
}

/* key = value into table t (the current table, or an inline table being read). */
static rf_status parse_keyval(parser *P, rf_toml *t) {
    keypath k;
    rf_status st = parse_key(P, &k);
    char name[512];
    if (st == RF_OK) {
        skip_ws(P);
        if (peek(P) != '=')
            st = perr(P, P->p, "expected '=' after key \"%s\"", key_name(&k, k.n, name, sizeof name));
        else P->p++;
    }
    if (st == RF_OK) st = descend_dotted(P, t, &k, &t);
    const keypart *last = st == RF_OK ? &k.part[k.n - 1] : NULL;
    if (st == RF_OK && tab_find(t, last->s, last->len))
        st = perr(P, last->off, "duplicate key \"%s\"", key_name(&k, k.n, name, sizeof name));
    rf_toml *v = NULL;
    if (st == RF_OK) {
        skip_ws(P);
        st = parse_value(P, &v);
    }
    if (st == RF_OK) st = tab_add(P, t, last, v);
    keypath_free(&k);
    return st;
}

/* Marks an inline table and every table inside it immutable. */
static void seal(rf_toml *t) {
    t->flags |= F_INLINE;
    for (size_t i = 0; i < t->u.tab.n; i++)
        if (t->u.tab.e[i].val->type == RF_TOML_TABLE) seal(t->u.tab.e[i].val);
}

/* { key = value, ... } on one line, no trailing comma (TOML 1.0). */
static rf_status parse_inline_body(parser *P, rf_toml *t) {
    skip_ws(P);
    if (peek(P) == '}') {
        P->p++;
        return RF_OK;
    }
    for (;;) {
        RF_TRY(parse_keyval(P, t));
        skip_ws(P);
        int c = peek(P);
        if (c == '}') {
            P->p++;
            return RF_OK;
        }
        if (c != ',')
            return perr(P, P->p, c == '\n' || c == '\r' ? "newline in an inline table"
                                 : c < 0 ? "unterminated inline table"
                                 : "expected ',' or '}' in an inline table");
        size_t comma = P->p++;
        skip_ws(P);
        if (peek(P) == '}') return perr(P, comma, "trailing comma in an inline table");
    }
}

static rf_status parse_inline(parser *P, rf_toml **out) {
    rf_toml *t = node_new(P, RF_TOML_TABLE, P->p);
    if (!t) return RF_ERR_NOMEM;
    P->p++;
    rf_status st = parse_inline_body(P, t);
    if (st != RF_OK) {
        node_free(t);
        return st;
    }
    seal(t);
    *out = t;
    return RF_OK;
}

static rf_status parse_array_body(parser *P, rf_toml *a) {
    for (;;) {
        RF_TRY(skip_ws_nl(P));
        if (peek(P) == ']') {
            P->p++;
            return RF_OK;
        }
        if (peek(P) < 0) return perr(P, P->p, "unterminated array");
        rf_toml *v;
        RF_TRY(parse_value(P, &v));
        RF_TRY(arr_add(P, a, v));
        RF_TRY(skip_ws_nl(P));
        int c = peek(P);
        if (c == ']') continue;
        if (c != ',') return perr(P, P->p, c < 0 ? "unterminated array" : "expected ',' or ']' in an array");
        P->p++;
    }
}

static rf_status parse_array(parser *P, rf_toml **out) {
    rf_toml *a = node_new(P, RF_TOML_ARRAY, P->p);
    if (!a) return RF_ERR_NOMEM;
    P->p++;
    rf_status st = parse_array_body(P, a);
    if (st != RF_OK) {
        node_free(a);
        return st;
    }
    *out = a;
    return RF_OK;
}

static rf_status parse_value(parser *P, rf_toml **out) {
    int c = peek(P);
    if (c == '"' || c == '\'') return parse_string(P, out);
    if (c != '[' && c != '{') return parse_scalar(P, out);
    if (P->depth >= MAX_DEPTH) return perr(P, P->p, "arrays and inline tables nested too deeply");
    P->depth++;
    rf_status st = c == '[' ? parse_array(P, out) : parse_inline(P, out);
    P->depth--;
    return st;
}

/* One step of a [header] path below table t: creates implicit tables, enters the last
 * table of an array of tables. */
static rf_status descend_header(parser *P, rf_toml *t, const keypath *k, int i, rf_toml **out) {
    char name[512];
    entry *e = tab_find(t, k->part[i].s, k->part[i].len);
    if (!e) {
        rf_toml *nt = node_new(P, RF_TOML_TABLE, k->part[i].off);
        if (!nt) return RF_ERR_NOMEM;
        nt->flags = F_IMPLICIT;
        RF_TRY(tab_add(P, t, &k->part[i], nt));
        *out = nt;
        return RF_OK;
    }
    rf_toml *v = e->val;
    if (v->type == RF_TOML_ARRAY && (v->flags & F_AOT)) v = v->u.arr.v[v->u.arr.n - 1];
    if (v->type != RF_TOML_TABLE)
        return perr(P, k->part[i].off, "key \"%s\" is already defined as %s %s",
                    key_name(k, i, name, sizeof name), rf_toml_article(rf_toml_type_name(v->type)),
                    rf_toml_type_name(v->type));
    if (v->flags & F_INLINE)
        return perr(P, k->part[i].off, "cannot extend inline table \"%s\"", key_name(k, i, name, sizeof name));
    *out = v;
    return RF_OK;
}

/* The last part of a [table] header: a new table, or one only created implicitly so far. */
static rf_status open_table(parser *P, rf_toml *t, const keypath *k, size_t off) {
    char name[512];
    const keypart *last = &k->part[k->n - 1];
    entry *e = tab_find(t, last->s, last->len);
    if (!e) {
        rf_toml *nt = node_new(P, RF_TOML_TABLE, off);
        if (!nt) return RF_ERR_NOMEM;
        nt->flags = F_DEFINED;
        RF_TRY(tab_add(P, t, last, nt));
        P->cur = nt;
        return RF_OK;
    }
    rf_toml *v = e->val;
    key_name(k, k->n, name, sizeof name);
    if (v->type != RF_TOML_TABLE || (v->flags & F_INLINE))
        return perr(P, last->off, "key \"%s\" is already defined as %s", name,
                    v->type == RF_TOML_TABLE ? "an inline table"
                    : v->flags & F_AOT ? "an array of tables" : "a value");
    if (v->flags & (F_DEFINED | F_DOTTED))
        return perr(P, last->off, "table \"%s\" is defined twice", name);
    v->flags = (v->flags & ~(unsigned)F_IMPLICIT) | F_DEFINED;
    pos_of(P, off, &v->line, &v->col);
    P->cur = v;
    return RF_OK;
}

/* The last part of a [[array]] header: appends a table to an array of tables. */
static rf_status open_array_table(parser *P, rf_toml *t, const keypath *k, size_t off) {
    char name[512];
    const keypart *last = &k->part[k->n - 1];
    entry *e = tab_find(t, last->s, last->len);
    rf_toml *a = e ? e->val : NULL;
    if (a && !(a->type == RF_TOML_ARRAY && (a->flags & F_AOT)))
        return perr(P, last->off, "key \"%s\" is already defined as %s",
                    key_name(k, k->n, name, sizeof name),
                    a->type == RF_TOML_ARRAY ? "a static array" : a->type == RF_TOML_TABLE ? "a table" : "a value");
    if (!a) {
        if (!(a = node_new(P, RF_TOML_ARRAY, off))) return RF_ERR_NOMEM;
        a->flags = F_AOT;
        RF_TRY(tab_add(P, t, last, a));
    }
    rf_toml *nt = node_new(P, RF_TOML_TABLE, off);
    if (!nt) return RF_ERR_NOMEM;
    nt->flags = F_DEFINED;
    RF_TRY(arr_add(P, a, nt));
    P->cur = nt;
    return RF_OK;
}

static rf_status header_path(parser *P, keypath *k, int aot) {
    RF_TRY(parse_key(P, k));
    skip_ws(P);
    if (peek(P) != ']' || (aot && peek_at(P, 1) != ']'))
        return perr(P, P->p, aot ? "expected ']]' to close the array-of-tables header"
                                 : "expected ']' to close the table header");
    P->p += aot ? 2 : 1;
    return RF_OK;
}

/* [a.b.c] or [[a.b.c]]; p at the first '['. */
static rf_status parse_header(parser *P) {
    size_t off = P->p;
    int aot = peek_at(P, 1) == '[';
    P->p += aot ? 2 : 1;
    keypath k;
    rf_status st = header_path(P, &k, aot);
    rf_toml *t = P->root;
    for (int i = 0; st == RF_OK && i < k.n - 1; i++) st = descend_header(P, t, &k, i, &t);
    if (st == RF_OK) st = aot ? open_array_table(P, t, &k, off) : open_table(P, t, &k, off);
    keypath_free(&k);
    return st;
}

static rf_status parse_document(parser *P) {
    if (P->n >= 3 && memcmp(P->s, "\xEF\xBB\xBF", 3) == 0) P->p = 3;
    for (;;) {
        skip_ws(P);
        int c = peek(P);
        if (c < 0) return RF_OK;
        if (c == '#') RF_TRY(skip_comment(P));
        else if (c == '\n' || c == '\r') RF_TRY(eat_newline(P));
        else if (c == '[') {
            RF_TRY(parse_header(P));
            RF_TRY(expect_eol(P, "a table header"));
        } else {
            RF_TRY(parse_keyval(P, P->cur));
            RF_TRY(expect_eol(P, "a value"));
        }
    }
}

rf_status rf_toml_parse(rf_toml **out, const char *text, size_t len, const char *origin) {
    *out = NULL;
    parser P = {.s = text, .n = len, .origin = origin ? origin : "(toml)", .pos_line = 1};
    size_t bad = rf_utf8_invalid_at(text, len);
    if (bad < len) return perr(&P, bad, "invalid UTF-8");
    rf_toml *root = node_new(&P, RF_TOML_TABLE, 0);
    char *own = rf_strdup(P.origin);
    if (!root || !own) {
        free(root);
        free(own);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory", P.origin);
    }
    root->own_origin = own;
    root->flags = F_DEFINED;
    P.origin = own;
    root->origin = own;
    P.root = P.cur = root;
    rf_status st = parse_document(&P);
    if (st != RF_OK) {
        rf_toml_free(root);
        return st;
    }
    *out = root;
    return RF_OK;
}

rf_status rf_toml_parse_file(rf_toml **out, const char *path) {
    char *text;
    size_t len;
    *out = NULL;
    RF_TRY(rf_read_file(path, &text, &len));
    rf_status st = rf_toml_parse(out, text, len, path);
    free(text);
    return st;
}

/* ------------------------------------------------------------------ accessors */

rf_toml_type rf_toml_kind(const rf_toml *v) { return v->type; }

const char *rf_toml_type_name(rf_toml_type t) {
    static const char *const names[] = {"table", "array", "string", "integer", "float", "boolean",
                                        "offset date-time", "local date-time", "local date",
                                        "local time"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

const char *rf_toml_article(const char *type_name) {
    return type_name && strchr("aeiou", type_name[0]) && type_name[0] ? "an" : "a";
}

const char *rf_toml_origin(const rf_toml *v) { return v->origin; }
int rf_toml_line(const rf_toml *v) { return v->line; }
int rf_toml_col(const rf_toml *v) { return v->col; }

size_t rf_toml_count(const rf_toml *v) {
    if (!v) return 0;
    return v->type == RF_TOML_TABLE ? v->u.tab.n : v->type == RF_TOML_ARRAY ? v->u.arr.n : 0;
}

const char *rf_toml_key(const rf_toml *t, size_t i, size_t *len) {
    if (!t || t->type != RF_TOML_TABLE || i >= t->u.tab.n) return NULL;
    if (len) *len = t->u.tab.e[i].klen;
    return t->u.tab.e[i].key;
}

rf_toml *rf_toml_value(const rf_toml *t, size_t i) {
    return t && t->type == RF_TOML_TABLE && i < t->u.tab.n ? t->u.tab.e[i].val : NULL;
}

void rf_toml_key_pos(const rf_toml *t, size_t i, int *line, int *col) {
    int ok = t && t->type == RF_TOML_TABLE && i < t->u.tab.n;
    *line = ok ? t->u.tab.e[i].line : 0;
    *col = ok ? t->u.tab.e[i].col : 0;
}

rf_toml *rf_toml_at(const rf_toml *a, size_t i) {
    return a && a->type == RF_TOML_ARRAY && i < a->u.arr.n ? a->u.arr.v[i] : NULL;
}

rf_toml *rf_toml_find(const rf_toml *t, const char *key) {
    if (!t || t->type != RF_TOML_TABLE) return NULL;
    entry *e = tab_find(t, key, strlen(key));
    return e ? e->val : NULL;
}

rf_toml *rf_toml_get(const rf_toml *t, const char *path) {
    const char *p = path;
    while (t && t->type == RF_TOML_TABLE) {
        const char *dot = strchr(p, '.');
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        entry *e = tab_find(t, p, n);
        if (!e || !dot) return e ? e->val : NULL;
        t = e->val;
        p = dot + 1;
    }
    return NULL;
}

static int is_text(const rf_toml *v) {
    return v && v->type != RF_TOML_TABLE && v->type != RF_TOML_ARRAY && v->type != RF_TOML_INTEGER &&
           v->type != RF_TOML_FLOAT && v->type != RF_TOML_BOOL;
}

const char *rf_toml_string(const rf_toml *v, size_t *len) {
    if (!is_text(v)) return NULL;
    if (len) *len = v->u.str.len;
    return v->u.str.s;
}

int64_t rf_toml_int(const rf_toml *v) { return v && v->type == RF_TOML_INTEGER ? v->u.i : 0; }

double rf_toml_float(const rf_toml *v) {
    if (v && v->type == RF_TOML_FLOAT) return v->u.f;
    return v && v->type == RF_TOML_INTEGER ? (double)v->u.i : 0.0;
}

int rf_toml_bool(const rf_toml *v) { return v && v->type == RF_TOML_BOOL ? v->u.b : 0; }

static rf_status type_error(const rf_toml *v, const char *path, const char *want) {
    const char *got = rf_toml_type_name(v->type);
    return rf_error(RF_ERR_FORMAT, "%s:%d:%d: %s: expected %s %s, got %s %s", v->origin, v->line,
                    v->col, path, rf_toml_article(want), want, rf_toml_article(got), got);
}

rf_status rf_toml_get_string(const rf_toml *t, const char *path, const char **out) {
    const rf_toml *v = rf_toml_get(t, path);
    if (!v) return RF_OK;
    if (v->type != RF_TOML_STRING) return type_error(v, path, "string");
    *out = v->u.str.s;
    return RF_OK;
}

rf_status rf_toml_get_int(const rf_toml *t, const char *path, int64_t *out) {
    const rf_toml *v = rf_toml_get(t, path);
    if (!v) return RF_OK;
    if (v->type != RF_TOML_INTEGER) return type_error(v, path, "integer");
    *out = v->u.i;
    return RF_OK;
}

rf_status rf_toml_get_float(const rf_toml *t, const char *path, double *out) {
    const rf_toml *v = rf_toml_get(t, path);
    if (!v) return RF_OK;
    if (v->type != RF_TOML_FLOAT && v->type != RF_TOML_INTEGER) return type_error(v, path, "float");
    *out = rf_toml_float(v);
    return RF_OK;
}

rf_status rf_toml_get_bool(const rf_toml *t, const char *path, int *out) {
    const rf_toml *v = rf_toml_get(t, path);
    if (!v) return RF_OK;
    if (v->type != RF_TOML_BOOL) return type_error(v, path, "boolean");
    *out = v->u.b;
    return RF_OK;
}
