/* Safetensors reading (mmap + header validation) and writing (streamed, atomic), single file
 * and sharded. Byte layout: https://github.com/huggingface/safetensors (README "Format");
 * the writer reproduces the Python library (safetensors 0.4+, Rust `serialize`) byte for byte:
 * compact serde_json header, "__metadata__" first, tensors sorted by name (the library sorts
 * by dtype, largest first, then name; we write one dtype), header padded with spaces to a
 * multiple of 8 so the data buffer starts 8-byte aligned. Sharding and the index follow
 * huggingface_hub.split_state_dict_into_shards_factory and transformers' save_pretrained. */
#define _DEFAULT_SOURCE /* madvise */
#define _POSIX_C_SOURCE 200809L
#include "model/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

/* The Python library refuses larger headers (MAX_HEADER_SIZE); so do we, before parsing. */
#define ST_MAX_HEADER 100000000ull
/* cJSON numbers are doubles: integers are exact up to 2^53. */
#define ST_MAX_INT 9007199254740992.0

static const char ST_SINGLE[] = "model.safetensors";
static const char ST_INDEX[] = "model.safetensors.index.json";

typedef struct st_file {
    char *path;
    void *map;                /* whole file, read-only; NULL until mapped */
    size_t size;
} st_file;

struct rf_safetensors {
    char *origin;             /* the file or directory opened, for messages */
    st_file *files;
    int n_files;
    rf_st_tensor *tensors;    /* (n) */
    int n, cap;
    int32_t *slots;           /* (mask + 1) open addressing: tensor index + 1, 0 = empty */
    size_t mask;
};

/* ---------------------------------------------------------------- small helpers */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) sb_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* Decodes one UTF-8 code point from s[0..len); returns its length, 0 when invalid (overlong,
 * surrogate, beyond U+10FFFF, truncated). */
static size_t utf8_next(const unsigned char *s, size_t len, uint32_t *cp) {
    unsigned c = s[0];
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || n > len) return 0;
    uint32_t v = n == 1 ? c : c & (0x7f >> n);
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3f);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[n] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
    *cp = v;
    return n;
}

/* 1 when s[0..len) is valid UTF-8 without NUL bytes (cJSON works on C strings). */
static int utf8_valid(const char *s, size_t len) {
    const unsigned char *p = (const unsigned char *)s;
    uint32_t cp;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_next(p + i, len - i, &cp);
        if (k == 0 || cp == 0) return 0;
        i += k;
    }
    return 1;
}

/* A JSON string literal. ascii: escape everything outside printable ASCII as \uXXXX like
 * Python's json.dumps (ensure_ascii); otherwise escape only '"', '\\' and control
 * characters like serde_json. s must be valid UTF-8. */
static void sb_json_str(sbuf *b, const char *s, int ascii) {
    const unsigned char *p = (const unsigned char *)s;
    size_t len = strlen(s);
    sb_put(b, "\"", 1);
    for (size_t i = 0; i < len;) {
        uint32_t cp = p[i];
        size_t k = utf8_next(p + i, len - i, &cp);
        if (k == 0) k = 1; /* callers validate; never loop forever */
        const char *esc = cp == '"' ? "\\\"" : cp == '\\' ? "\\\\" : cp == '\n' ? "\\n"
                        : cp == '\r' ? "\\r" : cp == '\t' ? "\\t" : cp == '\b' ? "\\b"
                        : cp == '\f' ? "\\f" : NULL;
        if (esc) {
            sb_puts(b, esc);
        } else if (cp < 0x20 || (ascii && cp == 0x7f)) {
            sb_printf(b, "\\u%04x", (unsigned)cp);
        } else if (ascii && cp > 0x7f) {
            if (cp >= 0x10000) { /* UTF-16 surrogate pair */
                uint32_t v = cp - 0x10000;
                sb_printf(b, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
            } else {
                sb_printf(b, "\\u%04x", (unsigned)cp);
            }
        } else {
            sb_put(b, s + i, k);
        }
        i += k;
    }
    sb_put(b, "\"", 1);
}

/* "[2, 3]" into out. */
static const char *fmt_shape(char *out, size_t cap, const int64_t *shape, int ndim) {
    size_t n = (size_t)snprintf(out, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(out + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(out + n, cap - n, "]");
    return out;
}

/* numel * elem_size, or 0 with *overflow set when it does not fit in 64 bits. */
static uint64_t shape_bytes(const int64_t *shape, int ndim, size_t elem, int *overflow) {
    uint64_t v = elem;
    *overflow = 0;
    for (int d = 0; d < ndim; d++)
        if (__builtin_mul_overflow(v, (uint64_t)shape[d], &v)) *overflow = 1;
    return *overflow ? 0 : v;
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* ---------------------------------------------------------------- lookup table */

static int st_lookup(const rf_safetensors *st, const char *name) {
    if (!st->slots) return -1;
    for (size_t i = fnv1a(name) & st->mask;; i = (i + 1) & st->mask) {
        int32_t v = st->slots[i];
        if (v == 0) return -1;
        if (strcmp(st->tensors[v - 1].name, name) == 0) return v - 1;
    }
}

static void st_slot_put(rf_safetensors *st, int idx) {
    size_t i = fnv1a(st->tensors[idx].name) & st->mask;
    while (st->slots[i]) i = (i + 1) & st->mask;
    st->slots[i] = idx + 1;
}

/* Grows the table to hold st->n entries at load <= 1/2, reinserting tensors [0, n_done). */
static rf_status st_slots_reserve(rf_safetensors *st, int n_done) {
    size_t want = 16;
    while (want < 2 * (size_t)st->n) want *= 2;
    if (st->slots && want <= st->mask + 1) return RF_OK;
    int32_t *slots = rf_calloc(want, sizeof *slots);
    if (!slots) return RF_ERR_NOMEM;
    free(st->slots);
    st->slots = slots;
    st->mask = want - 1;
    for (int i = 0; i < n_done; i++) st_slot_put(st, i);
    return RF_OK;
}

/* Adds tensors [first, n) to the table; a name already present is an error naming both. */
static rf_status st_index_new(rf_safetensors *st, int first) {
    RF_TRY(st_slots_reserve(st, first));
    for (int i = first; i < st->n; i++) {
        const rf_st_tensor *t = &st->tensors[i];
        int j = st_lookup(st, t->name);
        if (j >= 0 && st->tensors[j].file == t->file)
            return rf_error(RF_ERR_FORMAT, "%s: duplicate tensor name \"%s\" in the header",
                            t->file, t->name);
        if (j >= 0)
            return rf_error(RF_ERR_FORMAT, "tensor \"%s\" is present in two shards: %s and %s",
                            t->name, st->tensors[j].file, t->file);
        st_slot_put(st, i);
    }
    return RF_OK;
}

/* ---------------------------------------------------------------- header parsing */

/* A JSON number that is an exact non-negative integer (at most 2^53). */
static int json_uint(const cJSON *j, uint64_t *v) {
    if (!cJSON_IsNumber(j)) return 0;
    double d = j->valuedouble;
    if (!(d >= 0.0 && d <= ST_MAX_INT)) return 0;
    uint64_t u = (uint64_t)d;
    if ((double)u != d) return 0;
    *v = u;
    return 1;
}

/* The dtypes of the safetensors specification that we do not compute with. */
static int is_other_st_dtype(const char *s) {
    static const char *const other[] = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64",
                                        "U64", "F64", "C64", "F8_E5M2", "F8_E4M3",
                                        "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"};
    for (size_t i = 0; i < sizeof other / sizeof *other; i++)
        if (strcmp(s, other[i]) == 0) return 1;
    return 0;
}

static rf_status parse_dtype(const char *path, const char *name, const cJSON *j, rf_dtype *d) {
    if (!j) return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": missing \"dtype\"", path, name);
    if (!cJSON_IsString(j))
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": \"dtype\" is not a string", path, name);
    const char *s = j->valuestring;
    if (strcmp(s, "F32") == 0) *d = RF_DTYPE_F32;
    else if (strcmp(s, "BF16") == 0) *d = RF_DTYPE_BF16;
    else if (strcmp(s, "F16") == 0) *d = RF_DTYPE_F16;
    else if (is_other_st_dtype(s))
        return rf_error(RF_ERR_UNSUPPORTED, "%s: tensor \"%s\": dtype %s is not supported "
                        "(only F32, BF16 and F16 tensors can be loaded)", path, name, s);
    else
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": unknown dtype \"%s\"", path, name, s);
    return RF_OK;
}

static rf_status parse_shape(const char *path, const char *name, const cJSON *j,
                             rf_st_tensor *t) {
    if (!j) return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": missing \"shape\"", path, name);
    if (!cJSON_IsArray(j))
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": \"shape\" is not an array", path, name);
    int ndim = cJSON_GetArraySize(j);
    if (ndim > RF_ST_MAX_DIMS)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: tensor \"%s\": %d dimensions, more than the %d "
                        "supported", path, name, ndim, RF_ST_MAX_DIMS);
    int d = 0;
    for (const cJSON *e = j->child; e; e = e->next, d++) {
        uint64_t v;
        if (!json_uint(e, &v))
            return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": \"shape\" dimension %d is not a "
                            "non-negative integer", path, name, d);
        t->shape[d] = (int64_t)v;
    }
    t->ndim = ndim;
    return RF_OK;
}

static rf_status parse_offsets(const char *path, const char *name, const cJSON *j,
                               uint64_t *begin, uint64_t *end) {
    if (!j)
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": missing \"data_offsets\"", path, name);
    if (!cJSON_IsArray(j) || cJSON_GetArraySize(j) != 2 || !json_uint(j->child, begin) ||
        !json_uint(j->child->next, end))
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": \"data_offsets\" is not a pair "
                        "[begin, end] of non-negative integers", path, name);
    if (*begin > *end)
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": data_offsets [%llu, %llu] end before "
                        "they begin", path, name, (unsigned long long)*begin,
                        (unsigned long long)*end);
    return RF_OK;
}

/* Validates one header entry against the data buffer buf[0..buf_len) and fills *t. */
static rf_status parse_entry(const char *path, const cJSON *e, const unsigned char *buf,
                             size_t buf_len, rf_st_tensor *t) {
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": entry is not a JSON object", path, name);
    uint64_t begin = 0, end = 0;
    RF_TRY(parse_dtype(path, name, cJSON_GetObjectItemCaseSensitive(e, "dtype"), &t->dtype));
    RF_TRY(parse_shape(path, name, cJSON_GetObjectItemCaseSensitive(e, "shape"), t));
    RF_TRY(parse_offsets(path, name, cJSON_GetObjectItemCaseSensitive(e, "data_offsets"),
                         &begin, &end));
    if (end > buf_len)
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": data_offsets [%llu, %llu] lie outside "
                        "the %zu-byte data buffer", path, name, (unsigned long long)begin,
                        (unsigned long long)end, buf_len);
    int overflow;
    uint64_t want = shape_bytes(t->shape, t->ndim, rf_dtype_size(t->dtype), &overflow);
    if (overflow || want != end - begin) {
        char shp[256], size[48];
        snprintf(size, sizeof size, overflow ? "more than 2^64 bytes" : "%llu bytes",
                 (unsigned long long)want);
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": data_offsets [%llu, %llu] do not "
                        "match shape %s x %s (%s)", path, name, (unsigned long long)begin,
                        (unsigned long long)end, fmt_shape(shp, sizeof shp, t->shape, t->ndim),
                        rf_dtype_name(t->dtype), size);
    }
    t->data = buf + begin;
    t->nbytes = (size_t)(end - begin);
    t->file = path;
    t->name = rf_strdup(name);
    if (!t->name) return rf_error(RF_ERR_NOMEM, "out of memory reading %s", path);
    return RF_OK;
}

/* "__metadata__" must map strings to strings (the library's HashMap<String, String>). */
static rf_status check_metadata(const char *path, const cJSON *m) {
    if (!cJSON_IsObject(m))
        return rf_error(RF_ERR_FORMAT, "%s: \"__metadata__\" is not a JSON object", path);
    for (const cJSON *e = m->child; e; e = e->next)
        if (!cJSON_IsString(e))
            return rf_error(RF_ERR_FORMAT, "%s: \"__metadata__\" value \"%s\" is not a string",
                            path, e->string);
    return RF_OK;
}

static rf_status st_reserve(rf_safetensors *st, int more) {
    if (st->n + more <= st->cap) return RF_OK;
    int cap = st->cap ? st->cap : 64;
    while (cap < st->n + more) cap *= 2;
    rf_st_tensor *t = realloc(st->tensors, (size_t)cap * sizeof *t);
    if (!t) return rf_error(RF_ERR_NOMEM, "out of memory for %d tensors", cap);
    st->tensors = t, st->cap = cap;
    return RF_OK;
}

/* Appends every tensor of the parsed header `root` to st. */
static rf_status parse_header(rf_safetensors *st, const char *path, const cJSON *root,
                              const unsigned char *buf, size_t buf_len) {
    if (!cJSON_IsObject(root))
        return rf_error(RF_ERR_FORMAT, "%s: header is not a JSON object", path);
    RF_TRY(st_reserve(st, cJSON_GetArraySize(root)));
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) {
            RF_TRY(check_metadata(path, e));
            continue;
        }
        rf_st_tensor *t = &st->tensors[st->n];
        memset(t, 0, sizeof *t);
        RF_TRY(parse_entry(path, e, buf, buf_len, t));
        st->n++;
    }
    return RF_OK;
}

static int cmp_by_data(const void *a, const void *b) {
    const rf_st_tensor *x = a, *y = b;
    const char *px = x->data, *py = y->data;
    if (px != py) return px < py ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

/* Tensors [first, n) all come from one buffer and are sorted by start: each must begin at or
 * after the furthest end seen so far. */
static rf_status check_overlaps(const rf_safetensors *st, int first, const unsigned char *buf) {
    int far = -1;
    for (int i = first; i < st->n; i++) {
        const rf_st_tensor *t = &st->tensors[i];
        const char *b = t->data;
        if (far >= 0) {
            const rf_st_tensor *f = &st->tensors[far];
            const char *fb = f->data;
            if (fb + f->nbytes > b)
                return rf_error(RF_ERR_FORMAT, "%s: tensors \"%s\" [%zu, %zu] and \"%s\" "
                                "[%zu, %zu] overlap", t->file, f->name,
                                (size_t)(fb - (const char *)buf),
                                (size_t)(fb - (const char *)buf) + f->nbytes, t->name,
                                (size_t)(b - (const char *)buf),
                                (size_t)(b - (const char *)buf) + t->nbytes);
        }
        if (far < 0 || b + t->nbytes > (const char *)st->tensors[far].data + st->tensors[far].nbytes)
            far = i;
    }
    return RF_OK;
}

/* Maps `path` into a new st->files slot (which rf_st_close releases even on error). */
static rf_status map_file(rf_safetensors *st, const char *path, st_file **out) {
    st_file *files = realloc(st->files, (size_t)(st->n_files + 1) * sizeof *files);
    if (!files) return rf_error(RF_ERR_NOMEM, "out of memory opening %s", path);
    st->files = files;
    st_file *f = &files[st->n_files];
    memset(f, 0, sizeof *f);
    if (!(f->path = rf_strdup(path))) return rf_error(RF_ERR_NOMEM, "out of memory opening %s", path);
    st->n_files++;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return rf_error(RF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return rf_error(RF_ERR_IO, "%s: not a readable regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return rf_error(RF_ERR_FORMAT, "%s: file is %lld bytes, too short for a safetensors "
                        "file (the header length alone takes 8)", path, (long long)sb.st_size);
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return rf_error(RF_ERR_IO, "%s: cannot mmap: %s", path, strerror(errno));
    f->map = map;
    f->size = (size_t)sb.st_size;
    *out = f;
    return RF_OK;
}

/* Checks the length prefix and that the header is UTF-8 JSON with only whitespace after it;
 * returns the parsed header in *root (caller deletes). */
static rf_status read_header(const st_file *f, cJSON **root, size_t *hlen) {
    const char *path = f->path, *base = f->map;
    uint64_t n;
    memcpy(&n, base, 8); /* little-endian host, see dtype.c */
    if (n > f->size - 8)
        return rf_error(RF_ERR_FORMAT, "%s: header length %llu exceeds the %zu bytes after the "
                        "length field", path, (unsigned long long)n, f->size - 8);
    if (n > ST_MAX_HEADER)
        return rf_error(RF_ERR_FORMAT, "%s: header length %llu exceeds the limit of %llu bytes",
                        path, (unsigned long long)n, ST_MAX_HEADER);
    const char *h = base + 8;
    if (!utf8_valid(h, (size_t)n))
        return rf_error(RF_ERR_FORMAT, "%s: header is not valid UTF-8 text", path);
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(h, (size_t)n, &end, 0);
    if (!*root)
        return rf_error(RF_ERR_FORMAT, "%s: header is not valid JSON (error near byte %lld)", path,
                        end ? (long long)(end - h) + 8 : -1ll);
    for (const char *p = end; p < h + n; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(*root);
            *root = NULL;
            return rf_error(RF_ERR_FORMAT, "%s: header has trailing bytes after the JSON object "
                            "(at byte %lld)", path, (long long)(p - h) + 8);
        }
    }
    *hlen = (size_t)n;
    return RF_OK;
}

/* Maps, validates and appends one file's tensors to st. */
static rf_status load_file(rf_safetensors *st, const char *path) {
    st_file *f = NULL;
    cJSON *root = NULL;
    size_t hlen = 0;
    RF_TRY(map_file(st, path, &f));
    RF_TRY(read_header(f, &root, &hlen));
    const unsigned char *buf = (const unsigned char *)f->map + 8 + hlen;
    size_t buf_len = f->size - 8 - hlen;
    int first = st->n;
    rf_status s = parse_header(st, f->path, root, buf, buf_len);
    cJSON_Delete(root);
    RF_TRY(s);
    if (st->n > first) /* st->tensors may still be NULL */
        qsort(st->tensors + first, (size_t)(st->n - first), sizeof *st->tensors, cmp_by_data);
    RF_TRY(st_index_new(st, first));
    return check_overlaps(st, first, buf);
}

/* ---------------------------------------------------------------- opening */

static rf_status st_new(rf_safetensors **out, const char *origin) {
    rf_safetensors *st = rf_calloc(1, sizeof *st);
    if (!st) return RF_ERR_NOMEM;
    if (!(st->origin = rf_strdup(origin))) {
        free(st);
        return rf_error(RF_ERR_NOMEM, "out of memory opening %s", origin);
    }
    *out = st;
    return RF_OK;
}

rf_status rf_st_open_file(rf_safetensors **out, const char *path) {
    *out = NULL;
    rf_safetensors *st = NULL;
    RF_TRY(st_new(&st, path));
    rf_status s = load_file(st, path);
    if (s != RF_OK) {
        rf_st_close(st);
        return s;
    }
    *out = st;
    return RF_OK;
}

/* A shard name from weight_map must stay inside the model directory. */
static int shard_name_ok(const char *s) {
    if (!*s || s[0] == '/') return 0;
    for (const char *p = s; (p = strstr(p, "..")); p += 2)
        if ((p == s || p[-1] == '/') && (p[2] == '\0' || p[2] == '/')) return 0;
    return 1;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The distinct shard file names in weight_map, sorted; *names (caller frees the array, not
 * the strings, which belong to wm). */
static rf_status index_shards(const char *ipath, const cJSON *wm, const char ***names, int *n) {
    int cap = cJSON_GetArraySize(wm), k = 0;
    const char **v = rf_calloc((size_t)cap + 1, sizeof *v);
    if (!v) return RF_ERR_NOMEM;
    for (const cJSON *e = wm->child; e; e = e->next) {
        if (!cJSON_IsString(e) || !shard_name_ok(e->valuestring)) {
            free(v);
            return rf_error(RF_ERR_FORMAT, "%s: weight_map entry \"%s\" is not a shard file name "
                            "inside the directory", ipath, e->string);
        }
        int seen = 0;
        for (int i = 0; i < k && !seen; i++) seen = strcmp(v[i], e->valuestring) == 0;
        if (!seen) v[k++] = e->valuestring;
    }
    qsort(v, (size_t)k, sizeof *v, cmp_str);
    *names = v;
    *n = k;
    return RF_OK;
}

/* Every weight_map entry must be in the shard it names, and every loaded tensor listed. */
static rf_status index_agrees(const rf_safetensors *st, const char *dir, const char *ipath,
                              const cJSON *wm) {
    char *seen = rf_calloc((size_t)st->n + 1, 1);
    if (!seen) return RF_ERR_NOMEM;
    char path[4096];
    rf_status s = RF_OK;
    for (const cJSON *e = wm->child; e && s == RF_OK; e = e->next) {
        rf_path_join(path, sizeof path, dir, e->valuestring);
        int i = st_lookup(st, e->string);
        if (i < 0)
            s = rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\" is listed in weight_map for %s but is "
                         "missing from that shard", ipath, e->string, path);
        else if (strcmp(st->tensors[i].file, path) != 0)
            s = rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\" is listed in weight_map for %s but is "
                         "missing from that shard (it is in %s)", ipath, e->string, path,
                         st->tensors[i].file);
        else if (seen[i]++)
            s = rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\" is listed twice in weight_map", ipath,
                         e->string);
    }
    for (int i = 0; i < st->n && s == RF_OK; i++)
        if (!seen[i])
            s = rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\" in %s is not listed in weight_map",
                         ipath, st->tensors[i].name, st->tensors[i].file);
    free(seen);
    return s;
}

/* Loads every shard named by the parsed index `root` into st. */
static rf_status load_index(rf_safetensors *st, const char *dir, const char *ipath,
                            const cJSON *root) {
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm))
        return rf_error(RF_ERR_FORMAT, "%s: no \"weight_map\" object", ipath);
    const char **shards = NULL;
    int n_shards = 0;
    RF_TRY(index_shards(ipath, wm, &shards, &n_shards));
    char path[4096];
    rf_status s = RF_OK;
    for (int i = 0; i < n_shards && s == RF_OK; i++) {
        rf_path_join(path, sizeof path, dir, shards[i]);
        if (!rf_file_exists(path))
            s = rf_error(RF_ERR_IO, "%s: weight_map names shard %s, which does not exist", ipath,
                         path);
        else
            s = load_file(st, path);
    }
    free(shards);
    RF_TRY(s);
    return index_agrees(st, dir, ipath, wm);
}

rf_status rf_st_open_dir(rf_safetensors **out, const char *dir) {
    *out = NULL;
    char path[4096], ipath[4096];
    rf_path_join(path, sizeof path, dir, ST_SINGLE);
    if (rf_file_exists(path)) return rf_st_open_file(out, path);
    rf_path_join(ipath, sizeof ipath, dir, ST_INDEX);
    if (!rf_file_exists(ipath))
        return rf_error(RF_ERR_IO, "%s: neither %s nor %s found in this directory", dir,
                        ST_SINGLE, ST_INDEX);
    char *text = NULL;
    size_t len = 0;
    RF_TRY(rf_read_file(ipath, &text, &len));
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return rf_error(RF_ERR_FORMAT, "%s: not a JSON object", ipath);
    }
    rf_safetensors *st = NULL;
    rf_status s = st_new(&st, dir);
    if (s == RF_OK) s = load_index(st, dir, ipath, root);
    cJSON_Delete(root);
    if (s != RF_OK) {
        rf_st_close(st);
        return s;
    }
    *out = st;
    return RF_OK;
}

void rf_st_close(rf_safetensors *st) {
    if (!st) return;
    for (int i = 0; i < st->n; i++) free((char *)st->tensors[i].name);
    for (int i = 0; i < st->n_files; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->tensors);
    free(st->slots);
    free(st->origin);
    free(st);
}

int rf_st_count(const rf_safetensors *st) { return st ? st->n : 0; }

const rf_st_tensor *rf_st_at(const rf_safetensors *st, int i) {
    return st && i >= 0 && i < st->n ? &st->tensors[i] : NULL;
}

const rf_st_tensor *rf_st_find(const rf_safetensors *st, const char *name) {
    int i = st && name ? st_lookup(st, name) : -1;
    return i >= 0 ? &st->tensors[i] : NULL;
}

/* Tensor `name` of st with the shape the caller expects (expect_shape NULL: any). */
static rf_status find_shaped(const rf_safetensors *st, const char *name, const int64_t *expect_shape,
                             int expect_ndim, const rf_st_tensor **out) {
    const rf_st_tensor *t = rf_st_find(st, name);
    if (!t)
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\" not found", st ? st->origin : "?",
                        name ? name : "(null)");
    int same = !expect_shape || t->ndim == expect_ndim;
    for (int d = 0; expect_shape && same && d < t->ndim; d++) same = t->shape[d] == expect_shape[d];
    if (!same) {
        char got[256], want[256];
        int wn = expect_ndim < 0 ? 0 : expect_ndim > RF_ST_MAX_DIMS ? RF_ST_MAX_DIMS : expect_ndim;
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\": shape %s (%s) does not match the "
                        "expected %s", t->file, t->name, fmt_shape(got, sizeof got, t->shape, t->ndim),
                        rf_dtype_name(t->dtype), fmt_shape(want, sizeof want, expect_shape, wn));
    }
    *out = t;
    return RF_OK;
}

/* Drops the pages of t's data from this process's view of the mapping once it has been
 * converted: a reader's memory is then what it converted, not the files too (the pages are
 * clean and stay in the page cache; reading t again maps them back). Best effort. */
static void release_pages(const rf_st_tensor *t) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)t->data, b = a + t->nbytes;
    if (!t->nbytes || !page) return;
    a &= ~(page - 1), b = (b + page - 1) & ~(page - 1); /* inside the mapping: it is page-granular */
    (void)madvise((void *)a, b - a, MADV_DONTNEED);
}

rf_status rf_st_read_f32(const rf_safetensors *st, const char *name, float *dst,
                         const int64_t *expect_shape, int expect_ndim) {
    const rf_st_tensor *t;
    RF_TRY(find_shaped(st, name, expect_shape, expect_ndim, &t));
    rf_dtype_to_f32(dst, t->data, t->dtype, t->nbytes / rf_dtype_size(t->dtype));
    release_pages(t);
    return RF_OK;
}

rf_status rf_st_read_bf16(const rf_safetensors *st, const char *name, uint16_t *dst,
                          const int64_t *expect_shape, int expect_ndim) {
    const rf_st_tensor *t;
    RF_TRY(find_shaped(st, name, expect_shape, expect_ndim, &t));
    if (t->dtype != RF_DTYPE_BF16)
        return rf_error(RF_ERR_FORMAT, "%s: tensor \"%s\" is %s, not BF16", t->file, t->name,
                        rf_dtype_name(t->dtype));
    if (t->nbytes) memcpy(dst, t->data, t->nbytes);
    release_pages(t);
    return RF_OK;
}

rf_status rf_st_read_block_f32(const rf_safetensors *st, const char *name, float *dst,
                               const int64_t *expect_shape, int expect_ndim, int64_t r0, int64_t r1,
                               int64_t c0, int64_t c1) {
    const rf_st_tensor *t;
    RF_TRY(find_shaped(st, name, expect_shape, expect_ndim, &t));
    int64_t rows = t->ndim > 0 ? t->shape[0] : 1, cols = 1;
    for (int d = 1; d < t->ndim; d++) cols *= t->shape[d];
    if (r0 < 0 || r1 < r0 || r1 > rows || c0 < 0 || c1 < c0 || c1 > cols)
        return rf_error(RF_ERR_ARG, "%s: tensor \"%s\" is (%lld, %lld): no block rows [%lld, %lld) x "
                        "cols [%lld, %lld) in it", t->file, t->name, (long long)rows, (long long)cols,
                        (long long)r0, (long long)r1, (long long)c0, (long long)c1);
    size_t es = rf_dtype_size(t->dtype), w = (size_t)(c1 - c0);
    const unsigned char *src = t->data;
    for (int64_t r = r0; r < r1; r++)
        rf_dtype_to_f32(dst + (size_t)(r - r0) * w, src + ((size_t)r * (size_t)cols + (size_t)c0) * es, t->dtype, w);
    release_pages(t);
    return RF_OK;
}

/* ---------------------------------------------------------------- writing */

typedef struct wr_ctx {
    const char *dir;
    const rf_st_entry *e; /* (n) caller's entries */
    int n;
    rf_dtype dtype;
    size_t *nbytes;       /* (n) on-disk bytes of each entry */
    int *shard;           /* (n) shard index of each entry */
    int *by_name;         /* (n) entry indices sorted by name */
    int n_shards;
    rf_st_fill_fn fill;   /* or NULL: the entries' data */
    void *fill_ctx;
    float *scratch;       /* with fill: the largest entry's floats */
} wr_ctx;

typedef struct name_idx {
    const char *name;
    int idx;
} name_idx;

static int cmp_name_idx(const void *a, const void *b) {
    return strcmp(((const name_idx *)a)->name, ((const name_idx *)b)->name);
}

/* Fills order[0..n) with entry indices sorted by name (qsort in C11 takes no context, so the
 * names travel with the indices). */
static rf_status sort_by_name(const rf_st_entry *e, int n, int *order) {
    name_idx *v = rf_calloc((size_t)n + 1, sizeof *v);
    if (!v) return RF_ERR_NOMEM;
    for (int i = 0; i < n; i++) v[i] = (name_idx){e[i].name, i};
    qsort(v, (size_t)n, sizeof *v, cmp_name_idx);
    for (int i = 0; i < n; i++) order[i] = v[i].idx;
    free(v);
    return RF_OK;
}

static rf_status check_entry(const rf_st_entry *e, int i, rf_dtype dtype, int fill, size_t *nbytes) {
    if (!e->name || !*e->name || strcmp(e->name, "__metadata__") == 0 ||
        !utf8_valid(e->name, strlen(e->name)))
        return rf_error(RF_ERR_ARG, "safetensors entry %d: name must be non-empty UTF-8 and not "
                        "\"__metadata__\"", i);
    if (e->ndim < 0 || e->ndim > RF_ST_MAX_DIMS)
        return rf_error(RF_ERR_ARG, "tensor \"%s\": ndim %d outside 0..%d", e->name, e->ndim,
                        RF_ST_MAX_DIMS);
    for (int d = 0; d < e->ndim; d++)
        if (e->shape[d] < 0)
            return rf_error(RF_ERR_ARG, "tensor \"%s\": negative dimension %lld", e->name,
                            (long long)e->shape[d]);
    int overflow;
    uint64_t b = shape_bytes(e->shape, e->ndim, 4, &overflow);
    if (overflow || b > (uint64_t)ST_MAX_INT || b > SIZE_MAX)
        return rf_error(RF_ERR_ARG, "tensor \"%s\": too large", e->name);
    if (b && !e->data && !fill) return rf_error(RF_ERR_ARG, "tensor \"%s\": data is NULL", e->name);
    *nbytes = (size_t)(b / 4 * rf_dtype_size(dtype));
    return RF_OK;
}

/* Validates entries, sorts names, rejects duplicates. */
static rf_status wr_prepare(wr_ctx *c) {
    for (int i = 0; i < c->n; i++) RF_TRY(check_entry(&c->e[i], i, c->dtype, c->fill != NULL, &c->nbytes[i]));
    RF_TRY(sort_by_name(c->e, c->n, c->by_name));
    for (int i = 1; i < c->n; i++)
        if (strcmp(c->e[c->by_name[i - 1]].name, c->e[c->by_name[i]].name) == 0)
            return rf_error(RF_ERR_ARG, "duplicate tensor name \"%s\"", c->e[c->by_name[i]].name);
    return RF_OK;
}

/* huggingface_hub's greedy split, in the caller's order: a tensor that would tip the current
 * shard over the limit closes it; a tensor above the limit becomes a shard of its own at once
 * (so it is numbered before the shard still being filled). Shards are numbered in the order
 * they are closed; members of the open shard carry -1 until then. */
static void wr_assign_shards(wr_ctx *c, size_t max_shard) {
    int n_closed = 0, open_from = -1; /* first member of the open shard, -1: none */
    size_t open_size = 0;
    for (int i = 0; i < c->n; i++) {
        size_t b = c->nbytes[i];
        if (max_shard && b > max_shard) {
            c->shard[i] = n_closed++;
            continue;
        }
        if (max_shard && open_from >= 0 && open_size + b > max_shard) {
            for (int j = open_from; j < i; j++)
                if (c->shard[j] == -1) c->shard[j] = n_closed;
            n_closed++;
            open_from = -1;
            open_size = 0;
        }
        if (open_from < 0) open_from = i;
        c->shard[i] = -1;
        open_size += b;
    }
    if (open_from >= 0) {
        for (int j = open_from; j < c->n; j++)
            if (c->shard[j] == -1) c->shard[j] = n_closed;
        n_closed++;
    }
    c->n_shards = n_closed ? n_closed : 1; /* no tensors: one empty file */
}

/* The padded header of a file holding entries idx[0..k) (sorted by name), as the Python
 * library writes it. */
static rf_status wr_header(const wr_ctx *c, const int *idx, int k, sbuf *h) {
    sb_puts(h, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (int j = 0; j < k; j++) {
        const rf_st_entry *e = &c->e[idx[j]];
        sb_puts(h, ",");
        sb_json_str(h, e->name, 0);
        sb_printf(h, ":{\"dtype\":\"%s\",\"shape\":[", rf_dtype_name(c->dtype));
        for (int d = 0; d < e->ndim; d++) sb_printf(h, "%s%lld", d ? "," : "", (long long)e->shape[d]);
        sb_printf(h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                  (unsigned long long)(off + c->nbytes[idx[j]]));
        off += c->nbytes[idx[j]];
    }
    sb_puts(h, "}");
    while (h->len % 8) sb_puts(h, " ");
    return h->oom ? rf_error(RF_ERR_NOMEM, "out of memory building a safetensors header") : RF_OK;
}

static rf_status write_all(int fd, const void *data, size_t len, const char *path) {
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return rf_error(RF_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        p += w;
        len -= (size_t)w;
    }
    return RF_OK;
}

/* Streams entry i, converting from f32 in chunks so no full copy is ever built (with a fill
 * function: produced into the scratch buffer first). */
static rf_status write_tensor(const wr_ctx *c, int fd, int i, const char *tmp) {
    size_t nbytes = c->nbytes[i];
    const float *data = c->e[i].data;
    if (c->fill && nbytes) {
        RF_TRY(c->fill(c->fill_ctx, i, c->scratch));
        data = c->scratch;
    }
    if (c->dtype == RF_DTYPE_F32) return write_all(fd, data, nbytes, tmp);
    enum { CHUNK = 16384 };
    uint16_t buf[CHUNK];
    size_t n = nbytes / 2;
    for (size_t k = 0; k < n; k += CHUNK) {
        size_t m = n - k < CHUNK ? n - k : CHUNK;
        rf_dtype_from_f32(buf, data + k, c->dtype, m);
        RF_TRY(write_all(fd, buf, m * 2, tmp));
    }
    return RF_OK;
}

/* Writes dir/name holding entries idx[0..k): temp file, fsync, rename. */
static rf_status wr_file(const wr_ctx *c, const char *name, const int *idx, int k) {
    char path[4096], tmp[4200];
    rf_path_join(path, sizeof path, c->dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    sbuf h = {0};
    rf_status s = wr_header(c, idx, k, &h);
    int fd = -1;
    if (s == RF_OK && (fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0)
        s = rf_error(RF_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    if (s == RF_OK) {
        uint64_t n = h.len; /* little-endian host */
        s = write_all(fd, &n, 8, tmp);
    }
    if (s == RF_OK) s = write_all(fd, h.p, h.len, tmp);
    for (int j = 0; j < k && s == RF_OK; j++)
        s = write_tensor(c, fd, idx[j], tmp);
    if (s == RF_OK && fsync(fd) != 0)
        s = rf_error(RF_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (fd >= 0 && close(fd) != 0 && s == RF_OK)
        s = rf_error(RF_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    if (s == RF_OK && rename(tmp, path) != 0)
        s = rf_error(RF_ERR_IO, "%s: rename failed: %s", path, strerror(errno));
    if (s != RF_OK && fd >= 0) unlink(tmp);
    free(h.p);
    return s;
}

static void shard_name(char *out, size_t cap, int i, int n) {
    snprintf(out, cap, "model-%05d-of-%05d.safetensors", i + 1, n);
}

/* Writes every shard: for each, its entries in name order. */
static rf_status wr_shards(const wr_ctx *c) {
    int *idx = rf_calloc((size_t)c->n + 1, sizeof *idx);
    if (!idx) return RF_ERR_NOMEM;
    rf_status s = RF_OK;
    char name[64];
    for (int sh = 0; sh < c->n_shards && s == RF_OK; sh++) {
        int k = 0;
        for (int j = 0; j < c->n; j++)
            if (c->shard[c->by_name[j]] == sh) idx[k++] = c->by_name[j];
        if (c->n_shards == 1) snprintf(name, sizeof name, "%s", ST_SINGLE);
        else shard_name(name, sizeof name, sh, c->n_shards);
        s = wr_file(c, name, idx, k);
    }
    free(idx);
    return s;
}

/* model.safetensors.index.json as transformers writes it: json.dumps(index, indent=2,
 * sort_keys=True) + "\n" (so non-ASCII names are \u-escaped). */
static rf_status wr_index(const wr_ctx *c) {
    uint64_t size = 0, params = 0;
    for (int i = 0; i < c->n; i++) {
        size += c->nbytes[i];
        params += c->nbytes[i] / rf_dtype_size(c->dtype);
    }
    sbuf b = {0};
    sb_printf(&b, "{\n  \"metadata\": {\n    \"total_parameters\": %llu,\n    \"total_size\": %llu\n"
              "  },\n  \"weight_map\": {", (unsigned long long)params, (unsigned long long)size);
    char name[64];
    for (int j = 0; j < c->n; j++) {
        int i = c->by_name[j];
        sb_puts(&b, j ? ",\n    " : "\n    ");
        sb_json_str(&b, c->e[i].name, 1);
        shard_name(name, sizeof name, c->shard[i], c->n_shards);
        sb_printf(&b, ": \"%s\"", name);
    }
    sb_puts(&b, c->n ? "\n  }\n}\n" : "}\n}\n");
    char path[4096];
    rf_path_join(path, sizeof path, c->dir, ST_INDEX);
    rf_status s = b.oom ? rf_error(RF_ERR_NOMEM, "out of memory building %s", path)
                        : rf_write_file_atomic(path, b.p, b.len);
    free(b.p);
    return s;
}

/* The shard count N of a name "model-0000i-of-0000N.safetensors", or 0 for any other name. */
static int shard_count_of(const char *s) {
    static const char pat[] = "model-#####-of-#####.safetensors";
    if (strlen(s) != sizeof pat - 1) return 0;
    int of = 0;
    for (size_t i = 0; pat[i]; i++) {
        if (pat[i] == '#' && (s[i] < '0' || s[i] > '9')) return 0;
        if (pat[i] != '#' && pat[i] != s[i]) return 0;
        if (pat[i] == '#' && i > 14) of = of * 10 + (s[i] - '0');
    }
    return of;
}

static rf_status remove_if_present(const char *dir, const char *name) {
    char path[4096];
    rf_path_join(path, sizeof path, dir, name);
    if (unlink(path) != 0 && errno != ENOENT)
        return rf_error(RF_ERR_IO, "%s: cannot remove stale file: %s", path, strerror(errno));
    return RF_OK;
}

/* Removes what an earlier save with another layout left behind, after the new files are in
 * place (so a crash midway leaves a loadable directory: rf_st_open_dir and transformers
 * both prefer model.safetensors over the index). */
static rf_status wr_remove_stale(const wr_ctx *c) {
    int sharded = c->n_shards > 1;
    RF_TRY(remove_if_present(c->dir, sharded ? ST_SINGLE : ST_INDEX));
    DIR *d = opendir(c->dir);
    if (!d) return rf_error(RF_ERR_IO, "%s: cannot list directory: %s", c->dir, strerror(errno));
    rf_status s = RF_OK;
    for (struct dirent *de; s == RF_OK && (de = readdir(d));) {
        int of = shard_count_of(de->d_name);
        if (of && (!sharded || of != c->n_shards)) s = remove_if_present(c->dir, de->d_name);
    }
    closedir(d);
    return s;
}

/* Makes the renames durable; best effort (some file systems refuse fsync on a directory). */
static void fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    (void)fsync(fd);
    close(fd);
}

/* The largest entry's floats, for a fill function's scratch buffer. */
static float *wr_scratch(const wr_ctx *c) {
    size_t most = 1;
    for (int i = 0; i < c->n; i++) {
        size_t f = c->nbytes[i] / rf_dtype_size(c->dtype);
        if (f > most) most = f;
    }
    return malloc(most * sizeof(float));
}

rf_status rf_st_write_dir_fill(const char *dir, const rf_st_entry *entries, int n, rf_dtype dtype,
                               size_t max_shard_bytes, rf_st_fill_fn fill, void *ctx) {
    if (!dir || n < 0 || (n > 0 && !entries) || rf_dtype_size(dtype) == 0)
        return rf_error(RF_ERR_ARG, "rf_st_write_dir: invalid arguments");
    wr_ctx c = {.dir = dir, .e = entries, .n = n, .dtype = dtype, .fill = fill, .fill_ctx = ctx};
    c.nbytes = rf_calloc((size_t)n + 1, sizeof *c.nbytes);
    c.shard = rf_calloc((size_t)n + 1, sizeof *c.shard);
    c.by_name = rf_calloc((size_t)n + 1, sizeof *c.by_name);
    rf_status s = c.nbytes && c.shard && c.by_name ? RF_OK : RF_ERR_NOMEM;
    if (s == RF_OK) s = wr_prepare(&c);
    if (s == RF_OK && fill && !(c.scratch = wr_scratch(&c)))
        s = rf_error(RF_ERR_NOMEM, "%s: out of memory for the largest tensor", dir);
    if (s == RF_OK) s = rf_mkdirs(dir);
    if (s == RF_OK) {
        wr_assign_shards(&c, max_shard_bytes);
        s = wr_shards(&c);
    }
    if (s == RF_OK && c.n_shards > 1) s = wr_index(&c);
    if (s == RF_OK) s = wr_remove_stale(&c);
    if (s == RF_OK) fsync_dir(dir);
    free(c.nbytes);
    free(c.shard);
    free(c.by_name);
    free(c.scratch);
    return s;
}

rf_status rf_st_write_dir(const char *dir, const rf_st_entry *entries, int n, rf_dtype dtype,
                          size_t max_shard_bytes) {
    return rf_st_write_dir_fill(dir, entries, n, dtype, max_shard_bytes, NULL, NULL);
}
