/* Loading a Hugging Face tokenizer.json (and tokenizer_config.json) into rf_tokenizer.
 *
 * Format reference: the serde layout of the Rust `tokenizers` crate (tokenizers/src/
 * tokenizer/serialization.rs and each component's Serialize impl). Every component type we
 * do not implement is refused with the JSON path of its "type" field, because a tokenizer
 * that quietly skips a step produces plausible but wrong ids. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "model/tokenizer_internal.h"

/* ---- hash maps ---- */

static uint64_t rf__hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a: short keys, no dependency */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static uint32_t rf__pow2_at_least(uint32_t n) {
    uint32_t c = 16;
    while (c < n * 2) c <<= 1; /* load factor <= 1/2 keeps probes short */
    return c;
}

rf_status rf__strmap_init(rf__strmap *m, uint32_t expect) {
    m->cap = rf__pow2_at_least(expect);
    m->n = 0;
    m->keys = calloc(m->cap, sizeof *m->keys);
    m->lens = calloc(m->cap, sizeof *m->lens);
    m->vals = calloc(m->cap, sizeof *m->vals);
    if (!m->keys || !m->lens || !m->vals) return rf_error(RF_ERR_NOMEM, "tokenizer: out of memory");
    return RF_OK;
}

void rf__strmap_free(rf__strmap *m) {
    free(m->keys);
    free(m->lens);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

/* Inserts or overwrites. The map never grows: callers size it from the JSON up front. */
rf_status rf__strmap_put(rf__strmap *m, const char *key, uint32_t len, int32_t val) {
    if ((m->n + 1) * 2 > m->cap) return rf_error(RF_ERR_INTERNAL, "tokenizer: string map full");
    uint32_t i = (uint32_t)rf__hash(key, len) & (m->cap - 1);
    while (m->keys[i]) {
        if (m->lens[i] == len && memcmp(m->keys[i], key, len) == 0) {
            m->vals[i] = val;
            return RF_OK;
        }
        i = (i + 1) & (m->cap - 1);
    }
    m->keys[i] = key;
    m->lens[i] = len;
    m->vals[i] = val;
    m->n++;
    return RF_OK;
}

int32_t rf__strmap_get(const rf__strmap *m, const char *key, size_t len) {
    if (!m->cap) return -1;
    uint32_t i = (uint32_t)rf__hash(key, len) & (m->cap - 1);
    while (m->keys[i]) {
        if (m->lens[i] == len && memcmp(m->keys[i], key, len) == 0) return m->vals[i];
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}

static uint64_t rf__pair_key(int32_t l, int32_t r) {
    return (uint64_t)(uint32_t)l << 32 | (uint32_t)r;
}

static uint32_t rf__pair_slot(uint64_t k, uint32_t cap) {
    k *= 0x9E3779B97F4A7C15ull; /* Fibonacci hashing spreads sequential ids */
    return (uint32_t)(k >> 32) & (cap - 1);
}

static rf_status rf__pairmap_init(rf__pairmap *m, uint32_t expect) {
    m->cap = rf__pow2_at_least(expect);
    m->n = 0;
    m->keys = malloc(m->cap * sizeof *m->keys);
    m->ranks = malloc(m->cap * sizeof *m->ranks);
    m->new_ids = malloc(m->cap * sizeof *m->new_ids);
    if (!m->keys || !m->ranks || !m->new_ids) return rf_error(RF_ERR_NOMEM, "tokenizer: out of memory");
    memset(m->keys, 0xff, m->cap * sizeof *m->keys);
    return RF_OK;
}

static void rf__pairmap_free(rf__pairmap *m) {
    free(m->keys);
    free(m->ranks);
    free(m->new_ids);
    memset(m, 0, sizeof *m);
}

/* A later duplicate merge overwrites the earlier one, as the Rust HashMap collect does. */
static void rf__pairmap_put(rf__pairmap *m, int32_t l, int32_t r, int32_t rank, int32_t new_id) {
    uint64_t k = rf__pair_key(l, r);
    uint32_t i = rf__pair_slot(k, m->cap);
    while (m->keys[i] != UINT64_MAX && m->keys[i] != k) i = (i + 1) & (m->cap - 1);
    if (m->keys[i] == UINT64_MAX) m->n++;
    m->keys[i] = k;
    m->ranks[i] = rank;
    m->new_ids[i] = new_id;
}

int rf__pairmap_get(const rf__pairmap *m, int32_t l, int32_t r, int32_t *rank, int32_t *new_id) {
    if (!m->cap) return 0;
    uint64_t k = rf__pair_key(l, r);
    uint32_t i = rf__pair_slot(k, m->cap);
    while (m->keys[i] != UINT64_MAX) {
        if (m->keys[i] == k) {
            *rank = m->ranks[i];
            *new_id = m->new_ids[i];
            return 1;
        }
        i = (i + 1) & (m->cap - 1);
    }
    return 0;
}

/* ---- JSON field access with "file: field" errors ---- */

/* Returns obj[key] or NULL (absent or JSON null). */
static const cJSON *rf__opt(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static rf_status rf__get_str(const rf_tokenizer *t, const cJSON *obj, const char *where,
                             const char *key, int required, const char **out) {
    const cJSON *v = rf__opt(obj, key);
    *out = NULL;
    if (!v) {
        if (!required) return RF_OK;
        return rf_error(RF_ERR_FORMAT, "%s: %s.%s: missing", t->path, where, key);
    }
    if (!cJSON_IsString(v))
        return rf_error(RF_ERR_FORMAT, "%s: %s.%s: expected a string", t->path, where, key);
    *out = v->valuestring;
    return RF_OK;
}

/* Reads a boolean field; absent/null gives `dflt`. */
static rf_status rf__get_bool(const rf_tokenizer *t, const cJSON *obj, const char *where,
                              const char *key, int dflt, int *out) {
    const cJSON *v = rf__opt(obj, key);
    *out = dflt;
    if (!v) return RF_OK;
    if (!cJSON_IsBool(v))
        return rf_error(RF_ERR_FORMAT, "%s: %s.%s: expected true or false", t->path, where, key);
    *out = cJSON_IsTrue(v);
    return RF_OK;
}

static rf_status rf__get_int(const rf_tokenizer *t, const cJSON *obj, const char *where,
                             const char *key, int dflt, int *out) {
    const cJSON *v = rf__opt(obj, key);
    *out = dflt;
    if (!v) return RF_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 2147483647.0 ||
        v->valuedouble != (double)(int)v->valuedouble)
        return rf_error(RF_ERR_FORMAT, "%s: %s.%s: expected a non-negative integer", t->path,
                        where, key);
    *out = (int)v->valuedouble;
    return RF_OK;
}

/* The "type" of a component, required. */
static rf_status rf__get_type(const rf_tokenizer *t, const cJSON *obj, const char *where,
                              const char **type) {
    if (!cJSON_IsObject(obj))
        return rf_error(RF_ERR_FORMAT, "%s: %s: expected an object", t->path, where);
    return rf__get_str(t, obj, where, "type", 1, type);
}

static rf_status rf__unsupported(const rf_tokenizer *t, const char *where, const char *type,
                                 const char *what) {
    return rf_error(RF_ERR_UNSUPPORTED, "%s: %s.type \"%s\" is not supported (%s)", t->path,
                    where, type, what);
}

/* Pattern objects are {"String": "..."} or {"Regex": "..."}; only String is accepted where
 * the caller passes allow_regex = 0. */
static rf_status rf__get_pattern(const rf_tokenizer *t, const cJSON *obj, const char *where,
                                 const char **str, const char **regex) {
    const cJSON *p = rf__opt(obj, "pattern");
    *str = *regex = NULL;
    if (!cJSON_IsObject(p))
        return rf_error(RF_ERR_FORMAT, "%s: %s.pattern: expected {\"String\"|\"Regex\": ...}",
                        t->path, where);
    char sub[256];
    snprintf(sub, sizeof sub, "%s.pattern", where);
    RF_TRY(rf__get_str(t, p, sub, "String", 0, str));
    RF_TRY(rf__get_str(t, p, sub, "Regex", 0, regex));
    if (!*str && !*regex)
        return rf_error(RF_ERR_FORMAT, "%s: %s: expected \"String\" or \"Regex\"", t->path, sub);
    return RF_OK;
}

/* Oniguruma's \s (HF compiles patterns with onig) is exactly Unicode White_Space. PCRE2's
 * UCP \s also matches U+180E (kept in \h for Perl compatibility), so \s and \S are spelled
 * out as this class before compiling. */
#define RF__WHITE_SPACE "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}" \
                        "\\x{202f}\\x{205f}\\x{3000}"

/* Rewrites \s / \S outside and \s inside [...] classes; *out is malloc'd. \S inside a class
 * has no PCRE2 spelling without nested classes, so it is refused. */
static rf_status rf__onig_pattern(const rf_tokenizer *t, const char *where, const char *p,
                                  char **out) {
    size_t n = strlen(p), cap = n * 16 + 64, k = 0;
    char *o = malloc(cap);
    if (!o) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    int in_class = 0;
    for (size_t i = 0; i < n; i++) {
        const char *rep = NULL;
        if (p[i] == '\\' && i + 1 < n) {
            char c = p[i + 1];
            if (c == 's') rep = in_class ? RF__WHITE_SPACE : "[" RF__WHITE_SPACE "]";
            else if (c == 'S' && !in_class) rep = "[^" RF__WHITE_SPACE "]";
            else if (c == 'S') {
                free(o);
                return rf_error(RF_ERR_UNSUPPORTED, "%s: %s: \\S inside [...] is not supported",
                                t->path, where);
            }
            if (!rep) { /* any other escape is copied as is, both bytes */
                o[k++] = p[i++];
                o[k++] = p[i];
                continue;
            }
            i++;
            memcpy(o + k, rep, strlen(rep));
            k += strlen(rep);
            continue;
        }
        if (p[i] == '[' && !in_class) {
            in_class = 1;
            o[k++] = p[i];
            if (i + 1 < n && p[i + 1] == '^') o[k++] = p[++i];
            if (i + 1 < n && p[i + 1] == ']') o[k++] = p[++i]; /* literal ] first in class */
            continue;
        }
        if (p[i] == ']' && in_class) in_class = 0;
        o[k++] = p[i];
    }
    o[k] = '\0';
    *out = o;
    return RF_OK;
}

/* A String pattern as a regex that matches exactly its text: ASCII punctuation and
 * controls escaped, letters, digits and UTF-8 bytes kept (HF builds the same regex with
 * regex::escape). PCRE2_LITERAL would do this, but PCRE2 refuses it together with PCRE2_UCP.
 * *out is malloc'd. */
static rf_status rf__literal_pattern(const rf_tokenizer *t, const char *s, char **out) {
    size_t n = strlen(s), k = 0;
    char *o = malloc(n * 6 + 1); /* "\x{hh}" is the longest spelling of one byte */
    if (!o) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x80 || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
            (c >= 'A' && c <= 'Z'))
            o[k++] = (char)c;
        else if (c > ' ' && c < 0x7f)
            o[k++] = '\\', o[k++] = (char)c; /* a backslash before punctuation is literal */
        else
            k += (size_t)sprintf(o + k, "\\x{%02x}", c);
    }
    o[k] = '\0';
    *out = o;
    return RF_OK;
}

/* Compiles an Oniguruma-syntax pattern (as HF's regexes are written) with PCRE2; `literal`
 * compiles a String pattern instead, matching its exact text. */
static rf_status rf__compile(const rf_tokenizer *t, const char *where, const char *pattern,
                             int literal, pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    char *rewritten = NULL;
    RF_TRY(literal ? rf__literal_pattern(t, pattern, &rewritten)
                   : rf__onig_pattern(t, where, pattern, &rewritten));
    /* UCP makes \p, \w, \d and POSIX classes Unicode-aware, as Oniguruma's are in HF. */
    *out = pcre2_compile((PCRE2_SPTR)rewritten, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                         &err, &off, NULL);
    free(rewritten);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return rf_error(RF_ERR_UNSUPPORTED, "%s: %s: regex does not compile at offset %zu: %s",
                        t->path, where, (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
    return RF_OK;
}

/* ---- model ---- */

/* Open-addressing id -> slot map; grows at load factor 1/2. */
static uint32_t rf__id_hash(int32_t id, uint32_t cap) {
    return (uint32_t)(((uint64_t)(uint32_t)id * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
}

static int32_t rf__idmap_get(const rf__idmap *m, int32_t id) {
    if (!m->cap) return -1;
    for (uint32_t i = rf__id_hash(id, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == id) return m->vals[i];
        if (m->keys[i] < 0) return -1;
    }
}

static void rf__idmap_insert(rf__idmap *m, int32_t id, int32_t slot) {
    uint32_t i = rf__id_hash(id, m->cap);
    while (m->keys[i] >= 0) i = (i + 1) & (m->cap - 1);
    m->keys[i] = id;
    m->vals[i] = slot;
    m->n++;
}

/* Adds a new id (not yet in the map). */
static rf_status rf__idmap_add(rf_tokenizer *t, rf__idmap *m, int32_t id, int32_t slot) {
    if ((m->n + 1) * 2 > m->cap) {
        rf__idmap g = {rf__pow2_at_least(m->n + 1), 0, NULL, NULL};
        g.keys = malloc(g.cap * sizeof *g.keys);
        g.vals = malloc(g.cap * sizeof *g.vals);
        if (!g.keys || !g.vals) {
            free(g.keys);
            free(g.vals);
            return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
        }
        memset(g.keys, 0xff, g.cap * sizeof *g.keys);
        for (uint32_t i = 0; i < m->cap; i++)
            if (m->keys[i] >= 0) rf__idmap_insert(&g, m->keys[i], m->vals[i]);
        free(m->keys);
        free(m->vals);
        *m = g;
    }
    rf__idmap_insert(m, id, slot);
    return RF_OK;
}

/* The slot of `id`, created empty when new. Tables grow with the number of distinct ids,
 * never with their values: {"a": 0, "b": 1000000000} costs two slots. */
static rf_status rf__slot_for(rf_tokenizer *t, int32_t id, rf__tok **out) {
    int32_t k = rf__idmap_get(&t->slot_of, id);
    if (k < 0) {
        if (t->n_slots == t->cap_slots) {
            int cap = t->cap_slots ? t->cap_slots * 2 : 256;
            rf__tok *p = realloc(t->slots, (size_t)cap * sizeof *p);
            if (!p) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
            t->slots = p;
            t->cap_slots = cap;
        }
        k = t->n_slots;
        RF_TRY(rf__idmap_add(t, &t->slot_of, id, k));
        t->slots[t->n_slots++] = (rf__tok){NULL, 0, id, -1, 0};
        if (id >= t->n_ids) t->n_ids = id + 1;
    }
    *out = &t->slots[k];
    return RF_OK;
}

const rf__tok *rf__id_tok(const rf_tokenizer *t, int32_t id) {
    int32_t k = id < 0 ? -1 : rf__idmap_get(&t->slot_of, id);
    return k < 0 ? NULL : &t->slots[k];
}

/* Records the vocab text of an id (a duplicate id keeps its first text). */
static rf_status rf__set_token(rf_tokenizer *t, int32_t id, const char *s, size_t n,
                               rf__tok **out) {
    rf__tok *x;
    RF_TRY(rf__slot_for(t, id, &x));
    *out = x;
    if (x->text) return RF_OK;
    x->text = malloc(n + 1);
    if (!x->text) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    memcpy(x->text, s, n);
    x->text[n] = '\0';
    x->len = (uint32_t)n;
    return RF_OK;
}

static rf_status rf__load_vocab(rf_tokenizer *t, const cJSON *model) {
    const cJSON *vocab = rf__opt(model, "vocab");
    if (!cJSON_IsObject(vocab))
        return rf_error(RF_ERR_FORMAT, "%s: model.vocab: expected an object", t->path);
    RF_TRY(rf__strmap_init(&t->vocab, (uint32_t)cJSON_GetArraySize(vocab)));
    for (const cJSON *e = vocab->child; e; e = e->next) {
        /* Ids are u32 in HF; ours are int32 and max id + 1 must fit too. */
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > RF__MAX_ID ||
            e->valuedouble != (double)(int32_t)e->valuedouble)
            return rf_error(RF_ERR_FORMAT, "%s: model.vocab[\"%s\"]: expected an integer id "
                            "in 0..%d", t->path, e->string, RF__MAX_ID);
        int32_t id = (int32_t)e->valuedouble;
        rf__tok *x;
        RF_TRY(rf__set_token(t, id, e->string, strlen(e->string), &x));
        /* Keys point at the slot's copy so the map outlives the JSON tree. */
        RF_TRY(rf__strmap_put(&t->vocab, x->text, x->len, id));
    }
    return RF_OK;
}

/* One merge: "a b" (legacy) or ["a", "b"] (tokenizers >= 0.20). */
static rf_status rf__merge_parts(rf_tokenizer *t, const cJSON *m, int i, const char **a,
                                 size_t *na, const char **b, size_t *nb) {
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring, *sp = strchr(s, ' ');
        if (!sp || strchr(sp + 1, ' '))
            return rf_error(RF_ERR_FORMAT, "%s: model.merges[%d]: \"%s\" is not \"a b\"",
                            t->path, i, s);
        *a = s;
        *na = (size_t)(sp - s);
        *b = sp + 1;
        *nb = strlen(sp + 1);
        return RF_OK;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 &&
        cJSON_IsString(cJSON_GetArrayItem(m, 0)) && cJSON_IsString(cJSON_GetArrayItem(m, 1))) {
        *a = cJSON_GetArrayItem(m, 0)->valuestring;
        *b = cJSON_GetArrayItem(m, 1)->valuestring;
        *na = strlen(*a);
        *nb = strlen(*b);
        return RF_OK;
    }
    return rf_error(RF_ERR_FORMAT, "%s: model.merges[%d]: expected \"a b\" or [\"a\", \"b\"]",
                    t->path, i);
}

static rf_status rf__load_merges(rf_tokenizer *t, const cJSON *model) {
    const cJSON *merges = rf__opt(model, "merges");
    if (!merges) return rf__pairmap_init(&t->merges, 0);
    if (!cJSON_IsArray(merges))
        return rf_error(RF_ERR_FORMAT, "%s: model.merges: expected an array", t->path);
    RF_TRY(rf__pairmap_init(&t->merges, (uint32_t)cJSON_GetArraySize(merges)));
    char *buf = NULL;
    size_t cap = 0;
    int i = 0;
    rf_status st = RF_OK;
    for (const cJSON *m = merges->child; m && st == RF_OK; m = m->next, i++) {
        const char *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        st = rf__merge_parts(t, m, i, &a, &na, &b, &nb);
        if (st) break;
        if (na + nb + 1 > cap) {
            cap = (na + nb + 1) * 2;
            char *nbuf = realloc(buf, cap);
            if (!nbuf) { st = rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path); break; }
            buf = nbuf;
        }
        memcpy(buf, a, na);
        memcpy(buf + na, b, nb);
        int32_t l = rf__strmap_get(&t->vocab, a, na), r = rf__strmap_get(&t->vocab, b, nb);
        int32_t id = rf__strmap_get(&t->vocab, buf, na + nb);
        if (l < 0 || r < 0 || id < 0)
            st = rf_error(RF_ERR_FORMAT, "%s: model.merges[%d]: \"%.*s\" + \"%.*s\" -> a token "
                          "missing from model.vocab", t->path, i, (int)na, a, (int)nb, b);
        else
            rf__pairmap_put(&t->merges, l, r, i, id);
    }
    free(buf);
    return st;
}

/* Options of models::bpe::BPE that change results; unknown ones we refuse. */
static rf_status rf__load_bpe_options(rf_tokenizer *t, const cJSON *model) {
    const cJSON *drop = rf__opt(model, "dropout");
    if (drop && !(cJSON_IsNumber(drop) && drop->valuedouble == 0.0))
        return rf_error(RF_ERR_UNSUPPORTED, "%s: model.dropout: BPE dropout is not supported "
                        "(encoding would be random)", t->path);
    const char *s;
    RF_TRY(rf__get_str(t, model, "model", "continuing_subword_prefix", 0, &s));
    if (s && *s)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: model.continuing_subword_prefix \"%s\" is not "
                        "supported", t->path, s);
    RF_TRY(rf__get_str(t, model, "model", "end_of_word_suffix", 0, &s));
    if (s && *s)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: model.end_of_word_suffix \"%s\" is not "
                        "supported", t->path, s);
    RF_TRY(rf__get_bool(t, model, "model", "fuse_unk", 0, &t->fuse_unk));
    RF_TRY(rf__get_bool(t, model, "model", "byte_fallback", 0, &t->byte_fallback));
    RF_TRY(rf__get_bool(t, model, "model", "ignore_merges", 0, &t->ignore_merges));
    return RF_OK;
}

/* A model without "type" (files written by tokenizers < 0.9, e.g. RoBERTa's and T5's): HF
 * tries BPE, WordPiece, WordLevel, Unigram in turn (the untagged ModelWrapper), and each
 * takes the first whose required fields are present. Returns NULL when none fits. */
static const char *rf__model_type_from_fields(const cJSON *model) {
    const cJSON *vocab = rf__opt(model, "vocab");
    if (cJSON_IsArray(vocab)) return "Unigram";
    if (!cJSON_IsObject(vocab)) return NULL;
    if (cJSON_IsArray(rf__opt(model, "merges"))) return "BPE";
    if (!rf__opt(model, "unk_token")) return NULL;
    if (rf__opt(model, "continuing_subword_prefix") && rf__opt(model, "max_input_chars_per_word"))
        return "WordPiece";
    return "WordLevel";
}

static rf_status rf__load_model(rf_tokenizer *t, const cJSON *root) {
    const cJSON *model = rf__opt(root, "model");
    const char *type;
    if (!model) return rf_error(RF_ERR_FORMAT, "%s: model: missing", t->path);
    if (cJSON_IsObject(model) && !rf__opt(model, "type")) {
        type = rf__model_type_from_fields(model);
        if (!type)
            return rf_error(RF_ERR_FORMAT, "%s: model.type: missing, and the fields are those of "
                            "no tokenizer model (BPE needs vocab and merges)", t->path);
        if (strcmp(type, "BPE") != 0)
            return rf_error(RF_ERR_UNSUPPORTED, "%s: model: a \"%s\" model (no \"type\"; told "
                            "by its fields) is not supported (rlflow reads BPE)", t->path, type);
    } else {
        RF_TRY(rf__get_type(t, model, "model", &type));
        if (strcmp(type, "BPE") != 0) return rf__unsupported(t, "model", type, "rlflow reads BPE");
    }
    RF_TRY(rf__load_bpe_options(t, model));
    RF_TRY(rf__load_vocab(t, model));
    RF_TRY(rf__load_merges(t, model));
    const char *unk;
    RF_TRY(rf__get_str(t, model, "model", "unk_token", 0, &unk));
    t->unk_id = unk ? rf__strmap_get(&t->vocab, unk, strlen(unk)) : -1;
    if (unk && t->unk_id < 0)
        return rf_error(RF_ERR_FORMAT, "%s: model.unk_token \"%s\" is not in model.vocab",
                        t->path, unk);
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_ids[b] = rf__strmap_get(&t->vocab, name, 6);
    }
    return RF_OK;
}

/* ---- added tokens ---- */

/* Rust regex's Unicode \\w (what single_word tests): Alphabetic, marks, decimal digits,
 * connector punctuation and the joiners; wider than PCRE2's \\w. */
static const char rf__word_class[] = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200c}\\x{200d}]";

static rf_status rf__load_added_one(rf_tokenizer *t, const cJSON *e, int i, rf__added *a) {
    char where[64];
    snprintf(where, sizeof where, "added_tokens[%d]", i);
    const char *content;
    int id, v;
    RF_TRY(rf__get_str(t, e, where, "content", 1, &content));
    if (!rf__opt(e, "id")) return rf_error(RF_ERR_FORMAT, "%s: %s.id: missing", t->path, where);
    RF_TRY(rf__get_int(t, e, where, "id", 0, &id));
    if (!*content) return rf_error(RF_ERR_FORMAT, "%s: %s.content: empty", t->path, where);
    a->len = strlen(content);
    a->content = rf_strdup(content);
    if (!a->content) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    a->id = id;
    RF_TRY(rf__get_bool(t, e, where, "special", 0, &v));
    a->special = (uint8_t)v;
    RF_TRY(rf__get_bool(t, e, where, "single_word", 0, &v));
    a->single_word = (uint8_t)v;
    RF_TRY(rf__get_bool(t, e, where, "lstrip", 0, &v));
    a->lstrip = (uint8_t)v;
    RF_TRY(rf__get_bool(t, e, where, "rstrip", 0, &v));
    a->rstrip = (uint8_t)v;
    /* AddedToken's serde default is normalized = !special. */
    RF_TRY(rf__get_bool(t, e, where, "normalized", !a->special, &v));
    a->normalized = (uint8_t)v;
    return RF_OK;
}

static rf_status rf__load_added(rf_tokenizer *t, const cJSON *root) {
    const cJSON *arr = rf__opt(root, "added_tokens");
    if (!arr) return RF_OK;
    if (!cJSON_IsArray(arr))
        return rf_error(RF_ERR_FORMAT, "%s: added_tokens: expected an array", t->path);
    int n = cJSON_GetArraySize(arr), i = 0;
    t->added = calloc((size_t)n + 1, sizeof *t->added);
    if (!t->added) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        t->n_added = i + 1; /* counted first: a token refused after its content was copied is freed too */
        RF_TRY(rf__load_added_one(t, e, i, &t->added[i]));
    }
    for (int k = 0; k < t->n_added; k++)
        if (t->added[k].single_word && !t->word_re)
            RF_TRY(rf__compile(t, "added_tokens.single_word", rf__word_class, 0, &t->word_re));
    return RF_OK;
}

/* Normalized added tokens are matched against normalized text, so their pattern is the
 * content passed through the normalizer (AddedVocabulary::refresh_added_tokens). */
static rf_status rf__normalize_added(rf_tokenizer *t) {
    for (int i = 0; i < t->n_added; i++) {
        rf__added *a = &t->added[i];
        if (!a->normalized) continue;
        RF_TRY(rf__normalize(t, a->content, a->len, &a->norm, &a->norm_len));
    }
    /* Lets the matcher skip, in one lookup, every byte no added token can start at. */
    for (int i = 0; i < t->n_added; i++) {
        const rf__added *a = &t->added[i];
        if (a->normalized && a->norm_len) t->added_first[1][(unsigned char)a->norm[0]] = 1;
        if (!a->normalized) t->added_first[0][(unsigned char)a->content[0]] = 1;
    }
    return RF_OK;
}

/* HF ignores the ids written in added_tokens and re-derives them on load
 * (AddedVocabulary::add_tokens): a content already added or in the vocab keeps that id,
 * otherwise ids continue after the largest so far (or at the vocab's entry count). Files HF
 * writes always agree with this; for a hand-edited one we do what HF does. */
static void rf__assign_added_ids(rf_tokenizer *t) {
    int32_t max_id = -1, vs = (int32_t)t->vocab.n;
    for (int i = 0; i < t->n_added; i++) {
        rf__added *a = &t->added[i];
        int32_t id = -1;
        for (int j = 0; j < i && id < 0; j++)
            if (t->added[j].len == a->len && memcmp(t->added[j].content, a->content, a->len) == 0)
                id = t->added[j].id;
        if (id < 0) id = rf__strmap_get(&t->vocab, a->content, a->len);
        if (id < 0) id = max_id < 0 ? vs : (max_id >= vs || vs == 0) ? max_id + 1 : vs;
        a->id = id;
        if (id > max_id) max_id = id;
    }
}

/* Text of an added token as HF's id_to_token gives it: the normalized form when normalized. */
static const char *rf__added_text(const rf__added *a, size_t *len) {
    *len = a->normalized ? a->norm_len : a->len;
    return a->normalized ? a->norm : a->content;
}

/* Id tables for added tokens. skip_special drops an id when its text is the content of a
 * special added token (HF's is_special_token looks the text up, so a normalized special
 * token whose text the normalizer changed is kept: we reproduce that). */
static rf_status rf__index_added(rf_tokenizer *t) {
    rf__assign_added_ids(t);
    for (int i = 0; i < t->n_added; i++) {
        rf__tok *x;
        RF_TRY(rf__slot_for(t, t->added[i].id, &x));
        x->added = i;
    }
    for (int k = 0; k < t->n_slots; k++) {
        rf__tok *x = &t->slots[k];
        size_t n;
        const char *s = rf__id_text(t, x->id, &n);
        for (int a = 0; s && a < t->n_added && !x->special; a++)
            x->special = t->added[a].special && t->added[a].len == n &&
                         memcmp(t->added[a].content, s, n) == 0;
    }
    return RF_OK;
}

const char *rf__tok_text(const rf_tokenizer *t, const rf__tok *x, size_t *len) {
    if (x->added >= 0) return rf__added_text(&t->added[x->added], len);
    *len = x->len;
    return x->text;
}

const char *rf__id_text(const rf_tokenizer *t, int32_t id, size_t *len) {
    const rf__tok *x = rf__id_tok(t, id);
    *len = 0;
    return x ? rf__tok_text(t, x, len) : NULL;
}

/* ---- normalizer ---- */

static rf_status rf__push_norm(rf_tokenizer *t, rf__norm n) {
    rf__norm *p = realloc(t->norms, (size_t)(t->n_norms + 1) * sizeof *p);
    if (!p) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    t->norms = p;
    t->norms[t->n_norms++] = n;
    return RF_OK;
}

static rf_status rf__load_normalizer(rf_tokenizer *t, const cJSON *n, const char *where) {
    const char *type;
    RF_TRY(rf__get_type(t, n, where, &type));
    rf__norm x = {0};
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = rf__opt(n, "normalizers");
        if (!cJSON_IsArray(list))
            return rf_error(RF_ERR_FORMAT, "%s: %s.normalizers: expected an array", t->path, where);
        int i = 0;
        for (const cJSON *e = list->child; e; e = e->next, i++) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.normalizers[%d]", where, i);
            RF_TRY(rf__load_normalizer(t, e, sub));
        }
        return RF_OK;
    }
    if (strcmp(type, "NFC") == 0) x.type = RF__NORM_NFC;
    else if (strcmp(type, "NFD") == 0) x.type = RF__NORM_NFD;
    else if (strcmp(type, "NFKC") == 0) x.type = RF__NORM_NFKC;
    else if (strcmp(type, "NFKD") == 0) x.type = RF__NORM_NFKD;
    else if (strcmp(type, "Prepend") == 0) {
        const char *p;
        RF_TRY(rf__get_str(t, n, where, "prepend", 1, &p));
        x.type = RF__NORM_PREPEND;
        x.a = rf_strdup(p);
    } else if (strcmp(type, "Replace") == 0) {
        const char *s, *re, *c;
        RF_TRY(rf__get_pattern(t, n, where, &s, &re));
        if (re || !*s)
            return rf_error(RF_ERR_UNSUPPORTED, "%s: %s.pattern: only a non-empty \"String\" "
                            "pattern is supported for Replace", t->path, where);
        RF_TRY(rf__get_str(t, n, where, "content", 1, &c));
        x.type = RF__NORM_REPLACE;
        x.a = rf_strdup(s);
        x.b = rf_strdup(c);
    } else {
        return rf__unsupported(t, where, type, "NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence");
    }
    return rf__push_norm(t, x);
}

/* ---- pre-tokenizer ---- */

/* The pattern of pre_tokenizers::byte_level::ByteLevel with use_regex (GPT-2's). */
static const char rf__gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static rf_status rf__push_pretok(rf_tokenizer *t, rf__pretok p) {
    rf__pretok *q = realloc(t->pretoks, (size_t)(t->n_pretoks + 1) * sizeof *q);
    if (!q) {
        if (p.re) pcre2_code_free(p.re);
        return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    }
    t->pretoks = q;
    t->pretoks[t->n_pretoks++] = p;
    return RF_OK;
}

static rf_status rf__load_split(rf_tokenizer *t, const cJSON *n, const char *where, rf__pretok *p) {
    static const char *const names[] = {"Isolated", "Removed", "MergedWithPrevious",
                                        "MergedWithNext", "Contiguous"};
    const char *s, *re, *beh;
    RF_TRY(rf__get_pattern(t, n, where, &s, &re));
    RF_TRY(rf__get_str(t, n, where, "behavior", 1, &beh));
    p->behavior = -1;
    for (int i = 0; i < 5; i++)
        if (strcmp(beh, names[i]) == 0) p->behavior = i;
    if (p->behavior < 0)
        return rf_error(RF_ERR_UNSUPPORTED, "%s: %s.behavior \"%s\" is not supported", t->path,
                        where, beh);
    RF_TRY(rf__get_bool(t, n, where, "invert", 0, &p->invert));
    char sub[256];
    snprintf(sub, sizeof sub, "%s.pattern", where);
    p->type = RF__PRE_SPLIT;
    if (!re && !*s) return RF_OK; /* HF: an empty String pattern matches nothing (re = NULL) */
    return rf__compile(t, sub, re ? re : s, !re, &p->re);
}

/* Reads replacement + prepend_scheme shared by the Metaspace pre-tokenizer and decoder.
 * Older files carry add_prefix_space instead of prepend_scheme. */
static rf_status rf__load_metaspace(rf_tokenizer *t, const cJSON *n, const char *where,
                                    char repl[8], int *scheme) {
    const char *r, *ps;
    RF_TRY(rf__get_str(t, n, where, "replacement", 1, &r));
    uint32_t cp;
    int k = rf__utf8_next((const unsigned char *)r, strlen(r), &cp);
    if (k == 0 || r[k] != '\0')
        return rf_error(RF_ERR_FORMAT, "%s: %s.replacement: expected one character", t->path, where);
    memcpy(repl, r, (size_t)k + 1);
    RF_TRY(rf__get_str(t, n, where, "prepend_scheme", 0, &ps));
    if (!ps) {
        int aps;
        RF_TRY(rf__get_bool(t, n, where, "add_prefix_space", 1, &aps));
        *scheme = aps ? RF__PREPEND_ALWAYS : RF__PREPEND_NEVER;
    } else if (strcmp(ps, "always") == 0) *scheme = RF__PREPEND_ALWAYS;
    else if (strcmp(ps, "first") == 0) *scheme = RF__PREPEND_FIRST;
    else if (strcmp(ps, "never") == 0) *scheme = RF__PREPEND_NEVER;
    else
        return rf_error(RF_ERR_FORMAT, "%s: %s.prepend_scheme \"%s\": expected always, first "
                        "or never", t->path, where, ps);
    return RF_OK;
}

static rf_status rf__load_pretok(rf_tokenizer *t, const cJSON *n, const char *where) {
    const char *type;
    RF_TRY(rf__get_type(t, n, where, &type));
    rf__pretok p = {0};
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = rf__opt(n, "pretokenizers");
        if (!cJSON_IsArray(list))
            return rf_error(RF_ERR_FORMAT, "%s: %s.pretokenizers: expected an array", t->path,
                            where);
        int i = 0;
        for (const cJSON *e = list->child; e; e = e->next, i++) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.pretokenizers[%d]", where, i);
            RF_TRY(rf__load_pretok(t, e, sub));
        }
        return RF_OK;
    }
    if (strcmp(type, "Split") == 0) {
        rf_status st = rf__load_split(t, n, where, &p);
        if (st) return st;
    } else if (strcmp(type, "ByteLevel") == 0) {
        int use_regex;
        p.type = RF__PRE_BYTELEVEL;
        t->byte_level = 1;
        RF_TRY(rf__get_bool(t, n, where, "add_prefix_space", 1, &p.add_prefix_space));
        RF_TRY(rf__get_bool(t, n, where, "use_regex", 1, &use_regex));
        if (use_regex) RF_TRY(rf__compile(t, where, rf__gpt2_pattern, 0, &p.re));
    } else if (strcmp(type, "Metaspace") == 0) {
        p.type = RF__PRE_METASPACE;
        RF_TRY(rf__load_metaspace(t, n, where, p.repl, &p.prepend_scheme));
        RF_TRY(rf__get_bool(t, n, where, "split", 1, &p.split));
    } else {
        return rf__unsupported(t, where, type, "ByteLevel, Split, Metaspace, Sequence");
    }
    return rf__push_pretok(t, p);
}

/* ---- decoder ---- */

static rf_status rf__push_dec(rf_tokenizer *t, rf__dec d) {
    rf__dec *q = realloc(t->decs, (size_t)(t->n_decs + 1) * sizeof *q);
    if (!q) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    t->decs = q;
    t->decs[t->n_decs++] = d;
    return RF_OK;
}

static rf_status rf__load_strip(rf_tokenizer *t, const cJSON *n, const char *where, rf__dec *d) {
    const char *c;
    RF_TRY(rf__get_str(t, n, where, "content", 1, &c));
    uint32_t cp;
    int k = rf__utf8_next((const unsigned char *)c, strlen(c), &cp);
    if (k == 0 || c[k] != '\0')
        return rf_error(RF_ERR_FORMAT, "%s: %s.content: expected one character", t->path, where);
    d->type = RF__DEC_STRIP;
    d->a = rf_strdup(c);
    RF_TRY(rf__get_int(t, n, where, "start", 0, &d->start));
    RF_TRY(rf__get_int(t, n, where, "stop", 0, &d->stop));
    return RF_OK;
}

static rf_status rf__load_decoder(rf_tokenizer *t, const cJSON *n, const char *where) {
    const char *type;
    RF_TRY(rf__get_type(t, n, where, &type));
    rf__dec d = {0};
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = rf__opt(n, "decoders");
        if (!cJSON_IsArray(list))
            return rf_error(RF_ERR_FORMAT, "%s: %s.decoders: expected an array", t->path, where);
        int i = 0;
        for (const cJSON *e = list->child; e; e = e->next, i++) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.decoders[%d]", where, i);
            RF_TRY(rf__load_decoder(t, e, sub));
        }
        return RF_OK;
    }
    if (strcmp(type, "ByteLevel") == 0) d.type = RF__DEC_BYTELEVEL;
    else if (strcmp(type, "ByteFallback") == 0) d.type = RF__DEC_BYTEFALLBACK;
    else if (strcmp(type, "Fuse") == 0) d.type = RF__DEC_FUSE;
    else if (strcmp(type, "Strip") == 0) RF_TRY(rf__load_strip(t, n, where, &d));
    else if (strcmp(type, "Metaspace") == 0) {
        d.type = RF__DEC_METASPACE;
        RF_TRY(rf__load_metaspace(t, n, where, d.repl, &d.prepend_scheme));
    } else if (strcmp(type, "Replace") == 0) {
        const char *s, *re, *c;
        RF_TRY(rf__get_pattern(t, n, where, &s, &re));
        if (re || !*s)
            return rf_error(RF_ERR_UNSUPPORTED, "%s: %s.pattern: only a non-empty \"String\" "
                            "pattern is supported for Replace", t->path, where);
        RF_TRY(rf__get_str(t, n, where, "content", 1, &c));
        d.type = RF__DEC_REPLACE;
        d.a = rf_strdup(s);
        d.b = rf_strdup(c);
    } else {
        return rf__unsupported(t, where, type,
                               "ByteLevel, ByteFallback, Fuse, Strip, Metaspace, Replace, Sequence");
    }
    return rf__push_dec(t, d);
}

/* ---- post-processor ---- */

static rf_status rf__append_ids(rf_tokenizer *t, int32_t **arr, int *n, const int32_t *ids, int k) {
    int32_t *p = realloc(*arr, (size_t)(*n + k + 1) * sizeof *p);
    if (!p) return rf_error(RF_ERR_NOMEM, "%s: out of memory", t->path);
    memcpy(p + *n, ids, (size_t)k * sizeof *p);
    *arr = p;
    *n += k;
    return RF_OK;
}

/* {"SpecialToken": {"id": name}} -> the ids listed under special_tokens[name].ids. */
static rf_status rf__template_special(rf_tokenizer *t, const cJSON *proc, const cJSON *item,
                                      const char *where, int after) {
    const char *name;
    RF_TRY(rf__get_str(t, item, where, "id", 1, &name));
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(rf__opt(proc, "special_tokens"), name);
    const cJSON *ids = sp ? rf__opt(sp, "ids") : NULL;
    if (!cJSON_IsArray(ids))
        return rf_error(RF_ERR_FORMAT, "%s: %s: special token \"%s\" has no special_tokens "
                        "entry with ids", t->path, where, name);
    for (const cJSON *e = ids->child; e; e = e->next) {
        size_t n;
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > 2147483647.0 ||
            e->valuedouble != (double)(int32_t)e->valuedouble ||
            !rf__id_text(t, (int32_t)e->valuedouble, &n))
            return rf_error(RF_ERR_FORMAT, "%s: %s: special token \"%s\" has an id that is "
                            "neither in model.vocab nor an added token", t->path, where, name);
        int32_t id = (int32_t)e->valuedouble;
        RF_TRY(after ? rf__append_ids(t, &t->suffix, &t->n_suffix, &id, 1)
                     : rf__append_ids(t, &t->prefix, &t->n_prefix, &id, 1));
    }
    return RF_OK;
}

/* TemplateProcessing "single": SpecialTokens before $A form the prefix, after it the suffix. */
static rf_status rf__load_template(rf_tokenizer *t, const cJSON *proc, const char *where) {
    const cJSON *single = rf__opt(proc, "single");
    if (!cJSON_IsArray(single))
        return rf_error(RF_ERR_FORMAT, "%s: %s.single: expected an array", t->path, where);
    int after = 0, i = 0;
    for (const cJSON *e = single->child; e; e = e->next, i++) {
        char sub[256];
        snprintf(sub, sizeof sub, "%s.single[%d]", where, i);
        const cJSON *st = rf__opt(e, "SpecialToken"), *sq = rf__opt(e, "Sequence");
        if (st) {
            snprintf(sub + strlen(sub), sizeof sub - strlen(sub), ".SpecialToken");
            RF_TRY(rf__template_special(t, proc, st, sub, after));
        } else if (sq && !after) {
            after = 1;
        } else {
            return rf_error(RF_ERR_FORMAT, "%s: %s: expected SpecialToken or one Sequence",
                            t->path, sub);
        }
    }
    if (!after)
        return rf_error(RF_ERR_FORMAT, "%s: %s.single: no {\"Sequence\": ...} item", t->path, where);
    return RF_OK;
}

static rf_status rf__load_post(rf_tokenizer *t, const cJSON *n, const char *where) {
    const char *type;
    RF_TRY(rf__get_type(t, n, where, &type));
    if (strcmp(type, "ByteLevel") == 0) return RF_OK; /* only trims offsets: ids unchanged */
    if (strcmp(type, "TemplateProcessing") == 0) return rf__load_template(t, n, where);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = rf__opt(n, "processors");
        if (!cJSON_IsArray(list))
            return rf_error(RF_ERR_FORMAT, "%s: %s.processors: expected an array", t->path, where);
        int i = 0;
        for (const cJSON *e = list->child; e; e = e->next, i++) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.processors[%d]", where, i);
            RF_TRY(rf__load_post(t, e, sub));
        }
        return RF_OK;
    }
    return rf__unsupported(t, where, type, "TemplateProcessing, ByteLevel, Sequence");
}

/* ---- whole file ---- */

static int32_t rf__find_first(const rf_tokenizer *t, const char *const *names) {
    for (; *names; names++) {
        int32_t id = rf__strmap_get(&t->all, *names, strlen(*names));
        if (id >= 0) return id;
    }
    return -1;
}

/* token_to_id: added contents win over the vocab, as in HF. */
static rf_status rf__index_all(rf_tokenizer *t) {
    RF_TRY(rf__strmap_init(&t->all, t->vocab.n + (uint32_t)t->n_added));
    for (uint32_t i = 0; i < t->vocab.cap; i++)
        if (t->vocab.keys[i])
            RF_TRY(rf__strmap_put(&t->all, t->vocab.keys[i], t->vocab.lens[i], t->vocab.vals[i]));
    for (int i = 0; i < t->n_added; i++)
        RF_TRY(rf__strmap_put(&t->all, t->added[i].content, (uint32_t)t->added[i].len,
                              t->added[i].id));
    static const char *const eos[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>",
                                      "<|eot_id|>", NULL};
    static const char *const bos[] = {"<s>", "<|begin_of_text|>", NULL};
    t->eos_id = rf__find_first(t, eos);
    t->bos_id = t->n_prefix > 0 ? t->prefix[0] : rf__find_first(t, bos);
    return RF_OK;
}

static rf_status rf__load_components(rf_tokenizer *t, const cJSON *root) {
    static const char *const refused[] = {"truncation", "padding"};
    for (int i = 0; i < 2; i++)
        if (rf__opt(root, refused[i]))
            return rf_error(RF_ERR_UNSUPPORTED, "%s: %s: must be null (encode does not truncate "
                            "or pad)", t->path, refused[i]);
    RF_TRY(rf__load_model(t, root));
    RF_TRY(rf__load_added(t, root));
    const cJSON *n;
    if ((n = rf__opt(root, "normalizer"))) RF_TRY(rf__load_normalizer(t, n, "normalizer"));
    if ((n = rf__opt(root, "pre_tokenizer"))) RF_TRY(rf__load_pretok(t, n, "pre_tokenizer"));
    if ((n = rf__opt(root, "decoder"))) {
        t->has_decoder = 1;
        RF_TRY(rf__load_decoder(t, n, "decoder"));
        for (int i = 0; i < t->n_decs; i++)
            if (t->decs[i].type == RF__DEC_BYTELEVEL) t->byte_level = 1;
    }
    RF_TRY(rf__normalize_added(t));
    RF_TRY(rf__index_added(t));
    /* After the added tokens: a template may name one outside model.vocab (Llama-3's
     * <|begin_of_text|> = 128000 past a 128000-entry vocab). */
    if ((n = rf__opt(root, "post_processor"))) RF_TRY(rf__load_post(t, n, "post_processor"));
    return rf__index_all(t);
}

rf_status rf_tokenizer_load(rf_tokenizer **out, const char *path) {
    *out = NULL;
    char *text;
    size_t len;
    RF_TRY(rf_read_file(path, &text, &len));
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at && at >= text && at <= text + len ? (long)(at - text) : -1;
        free(text);
        return rf_error(RF_ERR_FORMAT, "%s: malformed JSON near byte %ld", path, off);
    }
    free(text);
    rf_tokenizer *t = rf_calloc(1, sizeof *t);
    rf_status st = t ? RF_OK : RF_ERR_NOMEM;
    if (t) {
        t->path = rf_strdup(path);
        t->unk_id = -1;
        st = cJSON_IsObject(root) ? rf__load_components(t, root)
                                  : rf_error(RF_ERR_FORMAT, "%s: expected a JSON object", path);
    }
    cJSON_Delete(root);
    if (st != RF_OK) {
        rf_tokenizer_free(t);
        return st;
    }
    *out = t;
    return RF_OK;
}

/* ---- tokenizer_config.json ---- */

/* bos_token / eos_token are a string or an AddedToken object {"content": ...}. */
static rf_status rf__config_token(rf_tokenizer *t, const cJSON *cfg, const char *cpath,
                                  const char *key, int32_t *id) {
    const cJSON *v = rf__opt(cfg, key);
    if (!v) return RF_OK;
    if (cJSON_IsObject(v)) v = rf__opt(v, "content");
    if (!cJSON_IsString(v))
        return rf_error(RF_ERR_FORMAT, "%s: %s: expected a string or {\"content\": ...}", cpath, key);
    int32_t found = rf_tokenizer_token_to_id(t, v->valuestring);
    if (found < 0)
        return rf_error(RF_ERR_FORMAT, "%s: %s \"%s\" is not a token of %s", cpath, key,
                        v->valuestring, t->path);
    *id = found;
    return RF_OK;
}

/* Makes ids[] contain `id` (at the front or back) or not, as add_*_token asks. This is what
 * transformers' LlamaTokenizerFast.update_post_processor does with the same flags. */
static rf_status rf__force_special(rf_tokenizer *t, int32_t **arr, int *n, int32_t id, int want,
                                   int at_front) {
    int pos = -1;
    for (int i = 0; i < *n; i++)
        if ((*arr)[i] == id) pos = i;
    if (want && pos < 0) {
        RF_TRY(rf__append_ids(t, arr, n, &id, 1));
        if (at_front) {
            memmove(*arr + 1, *arr, (size_t)(*n - 1) * sizeof **arr);
            (*arr)[0] = id;
        }
    } else if (!want && pos >= 0) {
        memmove(*arr + pos, *arr + pos + 1, (size_t)(*n - pos - 1) * sizeof **arr);
        (*n)--;
    }
    return RF_OK;
}

static rf_status rf__apply_config(rf_tokenizer *t, const cJSON *cfg, const char *cpath) {
    RF_TRY(rf__config_token(t, cfg, cpath, "bos_token", &t->bos_id));
    RF_TRY(rf__config_token(t, cfg, cpath, "eos_token", &t->eos_id));
    t->has_chat_template = rf__opt(cfg, "chat_template") != NULL;
    const cJSON *ab = rf__opt(cfg, "add_bos_token"), *ae = rf__opt(cfg, "add_eos_token");
    if (ab && !cJSON_IsBool(ab))
        return rf_error(RF_ERR_FORMAT, "%s: add_bos_token: expected true or false", cpath);
    if (ae && !cJSON_IsBool(ae))
        return rf_error(RF_ERR_FORMAT, "%s: add_eos_token: expected true or false", cpath);
    if (ab && t->bos_id >= 0)
        RF_TRY(rf__force_special(t, &t->prefix, &t->n_prefix, t->bos_id, cJSON_IsTrue(ab), 1));
    if (ae && t->eos_id >= 0)
        RF_TRY(rf__force_special(t, &t->suffix, &t->n_suffix, t->eos_id, cJSON_IsTrue(ae), 0));
    return RF_OK;
}

rf_status rf_tokenizer_load_dir(rf_tokenizer **out, const char *dir) {
    char path[4096], cpath[4096];
    rf_path_join(path, sizeof path, dir, "tokenizer.json");
    rf_path_join(cpath, sizeof cpath, dir, "tokenizer_config.json");
    rf_tokenizer *t;
    RF_TRY(rf_tokenizer_load(&t, path));
    *out = t;
    /* transformers 5 saves the template in chat_template.jinja, not tokenizer_config.json, and
     * reads that file first (tokenization_utils_base.py: "independent chat template file(s)
     * ... take priority") */
    char jpath[4096];
    rf_path_join(jpath, sizeof jpath, dir, "chat_template.jinja");
    int jinja = rf_file_exists(jpath);
    t->has_chat_template = jinja;
    if (!rf_file_exists(cpath)) return RF_OK;
    char *text;
    size_t len;
    rf_status st = rf_read_file(cpath, &text, &len);
    cJSON *cfg = st == RF_OK ? cJSON_ParseWithLength(text, len) : NULL;
    if (st == RF_OK) free(text);
    if (st == RF_OK && !cJSON_IsObject(cfg))
        st = rf_error(RF_ERR_FORMAT, "%s: malformed JSON (expected an object)", cpath);
    if (st == RF_OK) st = rf__apply_config(t, cfg, cpath);
    t->has_chat_template |= jinja;
    cJSON_Delete(cfg);
    if (st != RF_OK) {
        rf_tokenizer_free(t);
        *out = NULL;
    }
    return st;
}

void rf_tokenizer_free(rf_tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_slots; i++) free(t->slots[i].text);
    free(t->slots);
    free(t->slot_of.keys);
    free(t->slot_of.vals);
    rf__strmap_free(&t->vocab);
    rf__strmap_free(&t->all);
    rf__pairmap_free(&t->merges);
    for (int i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].norm);
    }
    free(t->added);
    for (int i = 0; i < t->n_norms; i++) {
        free(t->norms[i].a);
        free(t->norms[i].b);
    }
    free(t->norms);
    for (int i = 0; i < t->n_pretoks; i++)
        if (t->pretoks[i].re) pcre2_code_free(t->pretoks[i].re);
    free(t->pretoks);
    for (int i = 0; i < t->n_decs; i++) {
        free(t->decs[i].a);
        free(t->decs[i].b);
    }
    free(t->decs);
    free(t->prefix);
    free(t->suffix);
    if (t->word_re) pcre2_code_free(t->word_re);
    free(t->path);
    free(t);
}

/* ---- accessors ---- */

int rf_tokenizer_vocab_size(const rf_tokenizer *t) { return t->n_ids; }

int32_t rf_tokenizer_token_to_id(const rf_tokenizer *t, const char *token) {
    return rf__strmap_get(&t->all, token, strlen(token));
}

const char *rf_tokenizer_id_to_token(const rf_tokenizer *t, int32_t id) {
    size_t n;
    return rf__id_text(t, id, &n);
}

int32_t rf_tokenizer_bos_id(const rf_tokenizer *t) { return t->bos_id; }
int32_t rf_tokenizer_eos_id(const rf_tokenizer *t) { return t->eos_id; }

const char *rf_tokenizer_family(const rf_tokenizer *t) {
    return t->byte_level ? "byte_level" : "sentencepiece";
}

int rf_tokenizer_has_chat_template(const rf_tokenizer *t) { return t->has_chat_template; }
